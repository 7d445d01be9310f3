//! `bench-report OUT.json`: runs every comparison of `cuda-async` against
//! raw cudarc, and of the lease node against raw quinn, in one process
//! (warm-up, then interleaved reps, medians), prints the device and a
//! markdown table (metric | raw | cuda-async | ratio | goal | pass/fail)
//! to stdout, and writes the same as JSON to `OUT.json`. Progress goes to
//! stderr.
//!
//! Environment:
//! - `REPORT_SCALE` (default 1): multiplies every rep count (0.1 for a
//!   quick look; counts have floors).
//! - `REPORT_ONLY` (default all but `remote_chain,remote_launch,remote_pool`):
//!   comma-separated topics among
//!   `overhead,await_latency,throughput,completion,zip,graph,copies,multi_gpu,mem_pools`
//!   (local: GPU 0 here) and
//!   `remote_alloc,remote,remote_chain,remote_launch,remote_pool`
//!   (a lease node embedded in this process, on loopback; see
//!   `benches::remote`). A run of remote topics alone needs no GPU here.
//! - `REPORT_REMOTE_DEVICE` (default `cuda`): `memory` has the node's
//!   workers drive the in-memory device instead of GPU 0 (no GPU needed).
//! - `REPORT_REMOTE_SPIN_US`: the workers' pipe spin budget.
//! - `REPORT_CLIENT_SPIN=1`: a task on the report's runtime yields in a
//!   loop for the whole run, so one runtime thread never sleeps (the
//!   clients' and the raw references' alike).
//! - `REPORT_BUSY_POLL_US`: the clients' `ClientConfig::busy_poll` in
//!   microseconds (off by default): each client's endpoint on a thread of
//!   its own, kept awake while a request of the client is in flight; the
//!   raw quinn references' clients busy-poll the same way, and their
//!   servers keep polling for the workers' spin after each request (raw
//!   TCP is left as it is).
//! - `REPORT_REMOTE_IN_TASK=1`: measure the remote rows from a task on the
//!   runtime instead of `block_on`'s thread.
//! - `REPORT_TIMEOUT_S` (default 300): past this, the report prints and
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

use benches::measure::{self, groups};
use benches::remote::{self, RemoteConfig};
use benches::report::Report;
use benches::{Config, Fixture, Result, Row};

const USAGE: &str = "usage: bench-report [--no-fail] OUT.json   \
    (exits 1 when a row fails its goal or could not be measured, unless --no-fail) \
    (env: REPORT_SCALE=1, REPORT_ONLY=overhead,await_latency,throughput,completion,zip,graph,copies,multi_gpu,mem_pools,\
    remote_alloc,remote[,remote_chain,remote_launch,remote_pool], REPORT_REMOTE_DEVICE=cuda|memory, \
    REPORT_REMOTE_SPIN_US, REPORT_REMOTE_IN_TASK=1, REPORT_CLIENT_SPIN=1, REPORT_BUSY_POLL_US, \
    REPORT_TRANSPORT=loopback|default|datacenter|wan, REPORT_STRIPES=4, REPORT_TIMEOUT_S=300)";

fn main() -> ExitCode {
    // The remote topics' node starts its workers from this program.
    cuda_lease_node::main_if_worker();
    let mut args: Vec<_> = std::env::args_os().skip(1).collect();
    let no_fail = args.first().is_some_and(|a| a == "--no-fail");
    if no_fail {
        args.remove(0);
    }
    let Some(out) = args.first().map(PathBuf::from) else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    if out.as_os_str() == "-h" || out.as_os_str() == "--help" {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    match run(&out) {
        Ok(report) => match report.verdict() {
            Ok(()) => ExitCode::SUCCESS,
            Err(failed) if no_fail => {
                eprintln!("bench-report: {failed}\n(--no-fail: exit status 0)");
                ExitCode::SUCCESS
            }
            Err(failed) => {
                eprintln!("bench-report: {failed}");
                ExitCode::FAILURE
            }
        },
        Err(e) => {
            eprintln!("bench-report: {e}");
            ExitCode::from(2)
        }
    }
}

/// What the deadline thread needs to write a partial report.
struct Progress {
    report: Report,
    group: &'static str,
}

fn run(out: &Path) -> Result<Report> {
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
        Err(_) => 300.0,
    };
    let started = Instant::now();
    let mut remote = Remote {
        cfg: if cfg.wants_remote() {
            Some(RemoteConfig::from_env(&cfg)?)
        } else {
            None
        },
        bench: None,
    };
    let mut local = if cfg.wants_local() {
        // Before the driver starts: the width row's spins each need a
        // hardware queue. Once it has started, the variable goes, so the
        // remote topics' workers start with the driver's default (more
        // queues make a context slower to create).
        let wide = cfg.wants("zip");
        if wide {
            cuda_async::set_hardware_queues(benches::measure::WIDTH as u32)?;
        }
        let fx = Fixture::new()?;
        if wide {
            std::env::remove_var("CUDA_DEVICE_MAX_CONNECTIONS");
        }
        Some((Arc::new(fx), benches::tokio_runtime()?))
    } else {
        None
    };
    let report = new_report(local.as_ref().map(|(fx, _)| &**fx), &remote, &cfg);
    let progress = Arc::new(Mutex::new(Progress {
        report,
        group: "setup",
    }));
    spawn_deadline(
        progress.clone(),
        out.to_path_buf(),
        Duration::from_secs_f64(timeout),
        started,
    );

    for group in groups().filter(|g| cfg.wants(g)) {
        lock(&progress).group = group;
        eprintln!("[bench-report] {group} ...");
        let t = Instant::now();
        if remote::TOPICS.contains(&group) {
            // The local topics are done: their GPU context, streams and
            // threads go before the remote rows are measured.
            local = None;
        }
        let rows = match catch_unwind(AssertUnwindSafe(|| {
            run_group(group, local.as_ref(), &mut remote, &cfg)
        })) {
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
        let mut p = lock(&progress);
        p.report.rows.extend(rows);
        if let (None, Some(Ok(bench))) = (p.report.compute_capability, &remote.bench) {
            p.report.device = format!("remote: {}", bench.device());
        }
    }

    if let Some(Ok(bench)) = remote.bench.take() {
        bench.shutdown();
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
    Ok(p.report.clone())
}

/// The report's header: the local GPU's, or with remote topics alone the
/// node's device (printed to stdout), and no rows yet.
fn new_report(fx: Option<&Fixture>, remote: &Remote, cfg: &Config) -> Report {
    match fx {
        Some(fx) => {
            let (major, minor) = fx.info.compute_capability;
            println!(
                "device: {} (sm_{major}{minor}, driver {}, kernels from {}, REPORT_SCALE={})",
                fx.info.name,
                fx.driver_version
                    .map_or_else(|| "?".into(), |v| v.to_string()),
                fx.kernels.source,
                cfg.scale
            );
            Report {
                device: fx.info.name.clone(),
                compute_capability: Some(fx.info.compute_capability),
                driver_version: fx.driver_version,
                kernels: fx.kernels.source,
                scale: cfg.scale,
                unix_time: Report::now_unix(),
                wall_s: 0.0,
                rows: Vec::new(),
            }
        }
        None => {
            println!(
                "device: none here (remote topics only, on the node's {}), REPORT_SCALE={}",
                remote.device_kind(),
                cfg.scale
            );
            Report {
                device: format!("remote {}", remote.device_kind()),
                compute_capability: None,
                driver_version: None,
                kernels: "-",
                scale: cfg.scale,
                unix_time: Report::now_unix(),
                wall_s: 0.0,
                rows: Vec::new(),
            }
        }
    }
}

/// The remote topics' node: started by the first remote topic, shared by
/// the others.
struct Remote {
    cfg: Option<RemoteConfig>,
    bench: Option<std::result::Result<remote::Bench, String>>,
}

impl Remote {
    /// The node's device, in words.
    fn device_kind(&self) -> &'static str {
        match &self.cfg {
            Some(c) if c.memory() => "memory device",
            _ => "GPU 0",
        }
    }

    /// The started node; starts it on the first call.
    fn bench(&mut self) -> Result<&remote::Bench> {
        if self.bench.is_none() {
            let cfg = self.cfg.clone().ok_or("no remote topic was asked for")?;
            eprintln!("[bench-report] starting the lease node ...");
            self.bench = Some(remote::Bench::start(cfg).map_err(|e| e.to_string()));
        }
        match &self.bench {
            Some(Ok(b)) => Ok(b),
            Some(Err(e)) => Err(format!("the lease node did not start: {e}").into()),
            None => unreachable!("started above"),
        }
    }
}

fn run_group(
    group: &str,
    local: Option<&(Arc<Fixture>, tokio::runtime::Runtime)>,
    remote: &mut Remote,
    cfg: &Config,
) -> Result<Vec<Row>> {
    if remote::TOPICS.contains(&group) {
        return remote.bench()?.run(group);
    }
    let (fx, rt) = local.ok_or("no local GPU fixture")?;
    match group {
        "overhead" => measure::overhead(fx, cfg),
        "await_latency" => measure::await_latency(fx, rt, cfg),
        "throughput" => measure::throughput(fx, rt, cfg),
        "completion" => measure::completion(fx, rt, cfg),
        "zip" => measure::zip(fx, cfg),
        "graph" => measure::graph(fx, cfg),
        "copies" => measure::copies(fx, cfg),
        "multi_gpu" => measure::multi_gpu(fx, rt, cfg),
        "mem_pools" => measure::mem_pools(fx, cfg),
        "blas" => benches::library::blas(fx, cfg),
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
