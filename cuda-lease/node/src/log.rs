//! Program logs: `tracing` events on stderr at `RUST_LOG`'s levels, as
//! text or JSON lines.

use tracing_subscriber::filter::EnvFilter;
use tracing_subscriber::layer::{Layer, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;

/// How a program writes its log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum LogFormat {
    /// Human-readable lines (in colour only on a terminal).
    #[default]
    Text,
    /// One JSON object per line, for a log collector.
    Json,
}

/// `RUST_LOG`, or `default` when unset or empty.
pub fn log_filter(default: &str) -> EnvFilter {
    let directives = std::env::var(EnvFilter::DEFAULT_ENV)
        .ok()
        .filter(|d| !d.trim().is_empty())
        .unwrap_or_else(|| default.to_owned());
    EnvFilter::builder().parse_lossy(directives)
}

/// Installs the global subscriber: lines in `format` on stderr at
/// [`log_filter`]'s levels.
pub fn init_log_as(default: &str, format: LogFormat) {
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let log = match format {
        LogFormat::Text => fmt
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_filter(log_filter(default))
            .boxed(),
        LogFormat::Json => fmt
            .json()
            .with_ansi(false)
            .with_filter(log_filter(default))
            .boxed(),
    };
    tracing_subscriber::registry().with(log).init();
}
