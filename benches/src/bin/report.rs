//! `bench-report OUT.json`: runs every comparison of `cuda-async` against
//! raw cudarc in one process (warm-up, then interleaved reps, medians),
//! prints the device and a markdown table (metric | raw | cuda-async |
//! ratio | goal | pass/fail) to stdout, and writes the same as JSON to
//! `OUT.json`. Progress goes to stderr.
//!
//! Environment:
//! - `REPORT_SCALE` (default 1): multiplies every rep count (0.1 for a
//!   quick look; counts have floors).
//! - `REPORT_ONLY` (default all): comma-separated topics among
//!   `overhead,await_latency,throughput,completion,zip,graph,copies,multi_gpu`.
//! - `REPORT_TIMEOUT_S` (default 170): past this, the report prints and
//!   writes what it has and exits with status 3.
//!
//! Exit status: 0 when the report was written (whether or not every goal
//! passed: read the table), 1 on an error (no driver, no GPU...), 2 on a
//! usage error, 3 on the time limit.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use benches::measure::{self, GROUPS};
use benches::report::Report;
use benches::{Config, Fixture, Result, Row};

const USAGE: &str = "usage: bench-report OUT.json   \
    (env: REPORT_SCALE=1, REPORT_ONLY=overhead,await_latency,throughput,completion,zip,graph,copies,multi_gpu, \
    REPORT_TIMEOUT_S=170)";

fn main() -> ExitCode {
    let Some(out) = std::env::args_os().nth(1).map(PathBuf::from) else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    if out.as_os_str() == "-h" || out.as_os_str() == "--help" {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    match run(&out) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench-report: {e}");
            ExitCode::FAILURE
        }
    }
}

/// What the deadline thread needs to write a partial report.
struct Progress {
    report: Report,
    group: &'static str,
}

fn run(out: &Path) -> Result<()> {
    let cfg = Config::from_env()?;
    let timeout = match std::env::var("REPORT_TIMEOUT_S") {
        Ok(s) => s
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|x| *x > 0.0)
            .ok_or_else(|| {
                format!("REPORT_TIMEOUT_S must be a positive number of seconds, got `{s}`")
            })?,
        Err(_) => 170.0,
    };
    let started = Instant::now();
    let fx = Arc::new(Fixture::new()?);
    let (major, minor) = fx.info.compute_capability;
    println!(
        "device: {} (sm_{major}{minor}, driver {}, kernels from {}, REPORT_SCALE={})",
        fx.info.name,
        fx.driver_version
            .map_or_else(|| "?".into(), |v| v.to_string()),
        fx.kernels.source,
        cfg.scale
    );
    let rt = benches::tokio_runtime()?;
    let progress = Arc::new(Mutex::new(Progress {
        report: Report {
            device: fx.info.name.clone(),
            compute_capability: fx.info.compute_capability,
            driver_version: fx.driver_version,
            kernels: fx.kernels.source,
            scale: cfg.scale,
            unix_time: Report::now_unix(),
            wall_s: 0.0,
            rows: Vec::new(),
        },
        group: "setup",
    }));
    spawn_deadline(
        progress.clone(),
        out.to_path_buf(),
        Duration::from_secs_f64(timeout),
        started,
    );

    for group in GROUPS.into_iter().filter(|g| cfg.wants(g)) {
        lock(&progress).group = group;
        eprintln!("[bench-report] {group} ...");
        let t = Instant::now();
        let rows = match catch_unwind(AssertUnwindSafe(|| run_group(group, &fx, &rt, &cfg))) {
            Ok(Ok(rows)) => rows,
            Ok(Err(e)) => vec![Row::error(group, e)],
            Err(p) => vec![Row::error(group, format!("panicked: {}", panic_text(&*p)))],
        };
        for r in &rows {
            let ratio = r.ratio().map_or_else(|| "-".into(), |x| format!("{x:.3}"));
            eprintln!("[bench-report]   {}: ratio {ratio}", r.metric);
        }
        eprintln!(
            "[bench-report] {group} done in {:.1} s",
            t.elapsed().as_secs_f64()
        );
        lock(&progress).report.rows.extend(rows);
    }

    let mut p = lock(&progress);
    p.report.wall_s = started.elapsed().as_secs_f64();
    p.report.unix_time = Report::now_unix();
    print_and_write(&p.report, out)?;
    eprintln!(
        "[bench-report] wrote {} ({:.1} s in all)",
        out.display(),
        p.report.wall_s
    );
    Ok(())
}

fn run_group(
    group: &str,
    fx: &Arc<Fixture>,
    rt: &tokio::runtime::Runtime,
    cfg: &Config,
) -> Result<Vec<Row>> {
    match group {
        "overhead" => measure::overhead(fx, cfg),
        "await_latency" => measure::await_latency(fx, rt, cfg),
        "throughput" => measure::throughput(fx, rt, cfg),
        "completion" => measure::completion(fx, rt, cfg),
        "zip" => measure::zip(fx, cfg),
        "graph" => measure::graph(fx, cfg),
        "copies" => measure::copies(fx, cfg),
        "multi_gpu" => measure::multi_gpu(fx, rt, cfg),
        other => Err(format!("unknown topic `{other}`").into()),
    }
}

fn print_and_write(report: &Report, out: &Path) -> Result<()> {
    println!();
    print!("{}", report.markdown());
    println!();
    println!(
        "ratio = cuda-async / raw, of the medians (goals: `<=` for times, `>=` for rates); \
         {:.0} s wall, REPORT_SCALE={}",
        report.wall_s, report.scale
    );
    std::fs::write(out, report.json())
        .map_err(|e| format!("cannot write {}: {e}", out.display()))?;
    Ok(())
}

fn lock(p: &Mutex<Progress>) -> std::sync::MutexGuard<'_, Progress> {
    p.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Past `limit`, prints and writes the rows so far, then exits with 3 (a
/// hung GPU wait must not eat the whole GPU session).
fn spawn_deadline(progress: Arc<Mutex<Progress>>, out: PathBuf, limit: Duration, started: Instant) {
    let spawned = std::thread::Builder::new()
        .name("report-deadline".into())
        .spawn(move || {
            std::thread::sleep(limit.saturating_sub(started.elapsed()));
            let mut p = lock(&progress);
            let group = p.group;
            let msg = format!(
                "timed out after {:.0} s (REPORT_TIMEOUT_S) while running it",
                limit.as_secs_f64()
            );
            p.report.rows.push(Row::error(group, msg));
            p.report.wall_s = started.elapsed().as_secs_f64();
            p.report.unix_time = Report::now_unix();
            eprintln!("[bench-report] time limit hit in `{group}`; writing partial results");
            if let Err(e) = print_and_write(&p.report, &out) {
                eprintln!("bench-report: {e}");
            }
            std::process::exit(3);
        });
    if let Err(e) = spawned {
        eprintln!("[bench-report] no deadline thread ({e}); running without a time limit");
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".into()
    }
}
