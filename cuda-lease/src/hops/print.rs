//! Printing the hop spans: a `tracing-subscriber` fmt layer filtered to the
//! hop target, and the logger thread it writes through.

use std::io::Write;
use std::sync::mpsc::{channel, Sender};
use std::sync::OnceLock;

use tracing::Subscriber;
use tracing_subscriber::filter::{EnvFilter, LevelFilter};
use tracing_subscriber::fmt::format::FmtSpan;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::{Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

use super::{ENV, TARGET};

/// `RUST_LOG`'s directives, split into those for the hop target and the
/// rest (`None`: `RUST_LOG` unset).
fn rust_log() -> (Vec<String>, Option<String>) {
    let Ok(all) = std::env::var(EnvFilter::DEFAULT_ENV) else {
        return (Vec::new(), None);
    };
    let (hops, rest): (Vec<&str>, Vec<&str>) = all
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .partition(|d| d.starts_with(TARGET));
    (
        hops.into_iter().map(String::from).collect(),
        Some(rest.join(",")),
    )
}

/// The hop spans' directives: `RUST_LOG`'s for [`TARGET`], and
/// `cuda_lease::hop=trace` if [`ENV`] is set; empty when hops are off.
fn hop_directives() -> Vec<String> {
    let mut d = rust_log().0;
    if std::env::var_os(ENV).is_some() {
        d.push(format!("{TARGET}=trace"));
    }
    d
}

/// The filter of a program's own log lines: `RUST_LOG` without its
/// directives for the hop target (`default` when that leaves none, so
/// `RUST_LOG=cuda_lease::hop=trace` keeps the default log), the hop target
/// off, so that the hop spans go to [`layer`] alone.
pub fn log_filter(default: &str) -> EnvFilter {
    let rest = rust_log()
        .1
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| default.to_owned());
    let mut f = EnvFilter::builder().parse_lossy(rest);
    if let Ok(off) = format!("{TARGET}=off").parse() {
        f = f.add_directive(off);
    }
    f
}

/// A layer that prints each hop span (and [`super::emit`]'s lines) as one
/// line to stderr when it closes, through a logger thread; `None` when the
/// environment turns no hop on (see the module docs).
///
/// ```text
/// client{at_us=3606017790 send_us=41 reply_us=160 op=Batch bytes=4096}: close
/// ```
pub fn layer<S>() -> Option<impl Layer<S> + Send + Sync + 'static>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    let directives = hop_directives();
    if directives.is_empty() {
        return None;
    }
    // Only the hop target's directives: nothing else reaches this layer,
    // and its level hint is TRACE only where hops are on.
    let filter = EnvFilter::builder()
        .with_default_directive(LevelFilter::OFF.into())
        .parse_lossy(directives.join(","));
    Some(format_layer(Logger).with_filter(filter))
}

/// The format of [`layer`], writing to `writer`, with no filter of its own:
/// a hop span's name and fields when it closes, an event's message, no
/// time, level or target.
pub fn format_layer<S, W>(writer: W) -> impl Layer<S> + Send + Sync + 'static
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    tracing_subscriber::fmt::layer()
        .without_time()
        .with_level(false)
        .with_target(false)
        .with_ansi(false)
        .with_span_events(FmtSpan::CLOSE)
        .with_writer(writer)
}

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

/// Installs the global subscriber of a program with a log of its own (the
/// node, the client CLI): the log at `RUST_LOG`'s levels (`default`
/// without it, hop spans left out, [`log_filter`]) on stderr, and the hop
/// spans, if turned on, as lines of their own ([`layer`]).
pub fn init_log(default: &str) {
    init_log_as(default, LogFormat::Text);
}

/// [`init_log`] with the log lines in `format`.
pub fn init_log_as(default: &str, format: LogFormat) {
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let log = match format {
        // Colour only on a terminal: a log file or journal gets plain text.
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
    tracing_subscriber::registry()
        .with(log)
        .with(layer())
        .init();
}

/// Installs a subscriber of [`layer`] alone as the global default, if the
/// environment turns hop spans on and no global default is set yet; for
/// programs that print nothing else (the node's workers, examples, bench
/// programs). Returns whether it did.
pub fn init_from_env() -> bool {
    match layer() {
        Some(l) => tracing_subscriber::registry().with(l).try_init().is_ok(),
        None => false,
    }
}

/// Makes a [`Line`] per line the fmt layer writes.
struct Logger;

impl<'a> MakeWriter<'a> for Logger {
    type Writer = Line;

    fn make_writer(&'a self) -> Line {
        Line(Vec::new())
    }
}

/// One formatted line, handed to the logger thread when dropped.
struct Line(Vec<u8>);

impl Write for Line {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for Line {
    fn drop(&mut self) {
        if !self.0.is_empty() {
            print(std::mem::take(&mut self.0));
        }
    }
}

/// Writes `line` to stderr from a logger thread (the caller only queues
/// it). Lines still queued when the process exits may be lost.
fn print(line: Vec<u8>) {
    static LOGGER: OnceLock<Option<Sender<Vec<u8>>>> = OnceLock::new();
    let tx = LOGGER.get_or_init(|| {
        let (tx, rx) = channel::<Vec<u8>>();
        std::thread::Builder::new()
            .name("cuda-lease-hops".into())
            .spawn(move || {
                for line in rx {
                    let _ = std::io::stderr().write_all(&line);
                }
            })
            .ok()
            .map(|_| tx)
    });
    let unsent = match tx {
        Some(tx) => tx.send(line).err().map(|e| e.0),
        None => Some(line),
    };
    if let Some(line) = unsent {
        let _ = std::io::stderr().write_all(&line);
    }
}
