//! Timing: interleaved per-rep latencies, throughput drivers, and the
//! report's comparisons, one function per topic.
//!
//! Method: every path of a comparison is warmed up first, then the paths
//! run in rounds, each round visiting every path once in a rotated order
//! (so drift, clock boosts and background noise hit all paths alike).
//! Latencies are timed rep by rep; rates run whole batches per round. The
//! report compares medians.

use std::cell::RefCell;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use tokio::runtime::Runtime;

use cuda_async::{CompletionMode, StreamPoolRoundRobin};

use crate::fixture::{AwaitPath, Fixture, SyncPath, COMPLETION_MODES};
use crate::report::{Goal, Row, Unit};
use crate::stats::Summary;
use crate::{BenchError, Result};

/// Worker threads of the tokio runtime.
pub const TOKIO_WORKERS: usize = 4;
/// Task counts of the await-throughput comparison.
pub const THROUGHPUT_TASKS: [usize; 3] = [4, 64, 256];
/// Awaits per task in the throughput comparison (at scale 1).
pub const AWAITS_PER_TASK: usize = 400;
/// Threads of the blocking-throughput comparison.
pub const SYNC_THREADS: usize = 4;
/// Kernels in the graph comparison's chain.
pub const GRAPH_NODES: usize = 100;
/// Bytes per copy in the copy comparison.
pub const COPY_BYTES: usize = 256 << 20;

/// Independent kernels per run of the multi-GPU comparison.
pub const MULTI_KERNELS: usize = 16;

/// The report's local topics (they need a GPU here), in the order they run.
pub const LOCAL_GROUPS: [&str; 10] = [
    "overhead",
    "await_latency",
    "throughput",
    "completion",
    "zip",
    "graph",
    "copies",
    "multi_gpu",
    "mem_pools",
    "blas",
];

/// Every topic of the report, in the order they run: the local ones
/// ([`LOCAL_GROUPS`]), then the remote ones ([`crate::remote::TOPICS`]).
pub fn groups() -> impl Iterator<Item = &'static str> + Clone {
    LOCAL_GROUPS.into_iter().chain(crate::remote::TOPICS)
}

/// Run-size settings, from the environment.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Multiplies every rep and batch count (`REPORT_SCALE`, default 1;
    /// 0.1 for a quick look). Counts never drop below a small floor.
    pub scale: f64,
    /// Only these topics (`REPORT_ONLY=overhead,zip`); when `None`, all
    /// but those that run only on request ([`crate::remote::ON_REQUEST`]).
    pub only: Option<Vec<String>>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            scale: 1.0,
            only: None,
        }
    }
}

impl Config {
    /// Reads `REPORT_SCALE` and `REPORT_ONLY`.
    ///
    /// # Errors
    /// If `REPORT_SCALE` is not a positive number or `REPORT_ONLY` names an
    /// unknown topic.
    pub fn from_env() -> Result<Self> {
        Self::parse(
            std::env::var("REPORT_SCALE").ok().as_deref(),
            std::env::var("REPORT_ONLY").ok().as_deref(),
        )
    }

    /// As [`Config::from_env`], from the variables' values.
    ///
    /// # Errors
    /// As [`Config::from_env`].
    ///
    /// # Examples
    ///
    /// ```
    /// let c = benches::Config::parse(Some("0.5"), Some("zip, copies")).unwrap();
    /// assert_eq!(c.reps(1000, 10), 500);
    /// assert!(c.wants("zip") && !c.wants("graph"));
    /// let all = benches::Config::parse(None, None).unwrap();
    /// assert!(all.wants("remote") && !all.wants("remote_chain"));
    /// assert!(benches::Config::parse(Some("-1"), None).is_err());
    /// ```
    pub fn parse(scale: Option<&str>, only: Option<&str>) -> Result<Self> {
        let scale = match scale.map(str::trim).filter(|s| !s.is_empty()) {
            None => 1.0,
            Some(s) => match s.parse::<f64>() {
                Ok(x) if x.is_finite() && x > 0.0 => x,
                _ => {
                    return Err(format!("REPORT_SCALE must be a positive number, got `{s}`").into())
                }
            },
        };
        let only = match only.map(str::trim).filter(|s| !s.is_empty()) {
            None => None,
            Some(list) => {
                let names: Vec<String> = list.split(',').map(|g| g.trim().to_string()).collect();
                if let Some(bad) = names.iter().find(|g| !groups().any(|k| k == g.as_str())) {
                    return Err(format!(
                        "REPORT_ONLY: unknown topic `{bad}` (topics: {})",
                        groups().collect::<Vec<_>>().join(", ")
                    )
                    .into());
                }
                Some(names)
            }
        };
        Ok(Config { scale, only })
    }

    /// `base` scaled, at least `min`.
    pub fn reps(&self, base: usize, min: usize) -> usize {
        ((base as f64 * self.scale).round() as usize).max(min)
    }

    /// Whether topic `group` is to run.
    pub fn wants(&self, group: &str) -> bool {
        match &self.only {
            Some(o) => o.iter().any(|g| g == group),
            None => !crate::remote::ON_REQUEST.contains(&group),
        }
    }

    /// Whether a topic that needs a GPU here (not a remote one) is to run.
    pub fn wants_local(&self) -> bool {
        LOCAL_GROUPS.iter().any(|g| self.wants(g))
    }

    /// Whether a remote topic is to run.
    pub fn wants_remote(&self) -> bool {
        crate::remote::TOPICS.iter().any(|g| self.wants(g))
    }
}

/// One measured path of a latency comparison.
pub type Path<'a> = &'a mut dyn FnMut() -> Result<()>;

/// Runs every path `warmup` times, then `reps` rounds of every path once
/// (rotating which goes first); returns each path's per-rep times in
/// microseconds.
///
/// # Errors
/// The first error of any path.
pub fn interleaved(warmup: usize, reps: usize, paths: &mut [Path<'_>]) -> Result<Vec<Vec<f64>>> {
    for _ in 0..warmup {
        for p in paths.iter_mut() {
            p()?;
        }
    }
    let k = paths.len();
    let mut out = vec![Vec::with_capacity(reps); k];
    for rep in 0..reps {
        for j in 0..k {
            let i = (rep + j) % k;
            let t = Instant::now();
            (paths[i])()?;
            out[i].push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(out)
}

/// Per-await latencies (microseconds) of `paths`, interleaved as in
/// [`interleaved`], inside one task spawned on `rt` (so wake-ups go through
/// the runtime's scheduler like any task's).
///
/// # Errors
/// The first error of any path.
pub fn await_latencies(
    rt: &Runtime,
    fx: &Arc<Fixture>,
    warmup: usize,
    reps: usize,
    paths: &[AwaitPath],
) -> Result<Vec<Vec<f64>>> {
    let fx = fx.clone();
    let paths = paths.to_vec();
    let task = rt.spawn(async move {
        for _ in 0..warmup {
            for &p in &paths {
                fx.await_empty(p).await?;
            }
        }
        let k = paths.len();
        let mut out = vec![Vec::with_capacity(reps); k];
        for rep in 0..reps {
            for j in 0..k {
                let i = (rep + j) % k;
                let t = Instant::now();
                fx.await_empty(paths[i]).await?;
                out[i].push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        Ok::<_, BenchError>(out)
    });
    rt.block_on(task)?
}

/// Wall time of `tasks` tokio tasks each awaiting `per_task` empty kernels
/// one after another, the `path` way.
///
/// # Errors
/// The first error of any task; a panicking task.
pub fn await_throughput(
    rt: &Runtime,
    fx: &Arc<Fixture>,
    tasks: usize,
    per_task: usize,
    path: AwaitPath,
) -> Result<Duration> {
    let fx = fx.clone();
    rt.block_on(async move {
        let start = Instant::now();
        let handles: Vec<_> = (0..tasks)
            .map(|_| {
                let fx = fx.clone();
                tokio::spawn(async move {
                    for _ in 0..per_task {
                        fx.await_empty(path).await?;
                    }
                    Ok::<(), BenchError>(())
                })
            })
            .collect();
        for h in handles {
            h.await??;
        }
        Ok(start.elapsed())
    })
}

/// Wall time of `threads` threads each waiting for `per_thread` empty
/// kernels one after another, the `path` way (timed from a common start).
///
/// # Errors
/// The first error of any thread; a panicking thread.
pub fn sync_throughput(
    fx: &Fixture,
    threads: usize,
    per_thread: usize,
    path: SyncPath,
) -> Result<Duration> {
    let barrier = Barrier::new(threads + 1);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|i| {
                let barrier = &barrier;
                s.spawn(move || {
                    barrier.wait();
                    for _ in 0..per_thread {
                        fx.sync_empty(path, i)?;
                    }
                    Ok::<(), BenchError>(())
                })
            })
            .collect();
        barrier.wait();
        let t = Instant::now();
        for h in handles {
            h.join()
                .map_err(|_| BenchError::from("a bench thread panicked"))??;
        }
        Ok(t.elapsed())
    })
}

/// Runs each batch once to warm up, then `rounds` rounds of every batch
/// (rotating which goes first); returns each batch's rates in `ops` per
/// second.
///
/// # Errors
/// The first error of any batch.
pub fn interleaved_rates(
    rounds: usize,
    ops: f64,
    batches: &mut [&mut dyn FnMut() -> Result<Duration>],
) -> Result<Vec<Vec<f64>>> {
    for b in batches.iter_mut() {
        b()?;
    }
    let k = batches.len();
    let mut out = vec![Vec::with_capacity(rounds); k];
    for round in 0..rounds {
        for j in 0..k {
            let i = (round + j) % k;
            let d = (batches[i])()?;
            out[i].push(ops / d.as_secs_f64().max(1e-12));
        }
    }
    Ok(out)
}

/// The statistics of `bytes` moved in each of `times_us`, in GB/s.
fn gb_per_s(bytes: f64, times_us: &[f64]) -> Option<Summary> {
    let rates: Vec<f64> = times_us
        .iter()
        .map(|us| bytes / 1e9 / (us * 1e-6))
        .collect();
    sum(&rates)
}

fn sum(v: &[f64]) -> Option<Summary> {
    Summary::of(v)
}

/// `overhead`: one empty kernel blocking (`sync_on`, `sync`) vs raw launch
/// and synchronize; `value(..).sync()` vs an idle synchronize; a 10-op
/// `then` chain vs 10 raw launches and one synchronize.
///
/// # Errors
/// The first error of any path.
pub fn overhead(fx: &Fixture, cfg: &Config) -> Result<Vec<Row>> {
    let reps = cfg.reps(5_000, 50);
    let t = interleaved(
        cfg.reps(200, 10),
        reps,
        &mut [
            &mut || fx.raw_launch_sync(),
            &mut || fx.lib_sync_on(),
            &mut || fx.lib_sync(),
            &mut || fx.raw_idle_sync(),
            &mut || fx.lib_value_sync(7).map(drop),
            &mut || fx.raw_chain10(),
            &mut || fx.lib_chain10(),
        ],
    )?;
    let g = "overhead";
    Ok(vec![
        Row::new(
            g,
            "sync overhead, 1 empty kernel: `sync_on(&s)` vs raw launch + sync",
            Unit::Micros,
        )
        .raw(sum(&t[0]))
        .lib(sum(&t[1]))
        .goal(Goal::AtMost(1.05)),
        Row::new(
            g,
            "sync overhead, 1 empty kernel: `.sync()` (pool) vs raw launch + sync",
            Unit::Micros,
        )
        .raw(sum(&t[0]))
        .lib(sum(&t[2]))
        .goal(Goal::AtMost(1.05)),
        Row::new(
            g,
            "`value(x).sync()` vs raw sync of an idle stream (no GPU work: no sync)",
            Unit::Micros,
        )
        .raw(sum(&t[3]))
        .lib(sum(&t[4]))
        .goal(Goal::AtMost(0.3)),
        Row::new(
            g,
            "10-op `then` chain + sync vs raw 10 launches + 1 sync",
            Unit::Micros,
        )
        .raw(sum(&t[5]))
        .lib(sum(&t[6]))
        .goal(Goal::AtMost(1.05)),
    ])
}

/// `await_latency`: one empty kernel awaited from a task on a 4-worker
/// tokio runtime: `DeviceFuture` vs the raw host-callback future, and vs
/// raw launch + synchronize (issue 5's denominator).
///
/// # Errors
/// The first error of any path.
pub fn await_latency(fx: &Arc<Fixture>, rt: &Runtime, cfg: &Config) -> Result<Vec<Row>> {
    let paths = [AwaitPath::RawSync, AwaitPath::RawHostFn, AwaitPath::Lib];
    let t = await_latencies(rt, fx, cfg.reps(200, 10), cfg.reps(3_000, 50), &paths)?;
    let g = "await_latency";
    Ok(vec![
        Row::new(
            g,
            "await latency, 1 empty kernel: `DeviceFuture` vs raw host-callback future",
            Unit::Micros,
        )
        .raw(sum(&t[1]))
        .lib(sum(&t[2]))
        .goal(Goal::AtMost(1.05)),
        Row::new(
            g,
            "await latency, 1 empty kernel: `DeviceFuture` vs raw launch + stream sync",
            Unit::Micros,
        )
        .raw(sum(&t[0]))
        .lib(sum(&t[2]))
        .goal(Goal::AtMost(1.6))
        .goal_from("issue 5"),
        Row::new(
            g,
            "await latency: raw host-callback future vs raw launch + stream sync",
            Unit::Micros,
        )
        .raw(sum(&t[0]))
        .lib(sum(&t[1]))
        .note("both sides raw: what the host callback itself costs"),
    ])
}

/// `throughput`: 4, 64 and 256 tasks x N awaits (`DeviceFuture` on the
/// default pool vs the raw future round-robin over 4 raw streams); 4
/// threads x N blocking waits (`.sync()` vs raw launch + synchronize).
///
/// # Errors
/// The first error of any path.
pub fn throughput(fx: &Arc<Fixture>, rt: &Runtime, cfg: &Config) -> Result<Vec<Row>> {
    let g = "throughput";
    let per_task = cfg.reps(AWAITS_PER_TASK, 20);
    let rounds = cfg.reps(7, 3);
    let mut rows = Vec::new();
    let mut lib_256 = None;
    for tasks in THROUGHPUT_TASKS {
        let ops = (tasks * per_task) as f64;
        let r = interleaved_rates(
            rounds,
            ops,
            &mut [
                &mut || await_throughput(rt, fx, tasks, per_task, AwaitPath::RawHostFn),
                &mut || await_throughput(rt, fx, tasks, per_task, AwaitPath::Lib),
            ],
        )?;
        let mut row = Row::new(
            g,
            format!("await throughput, {tasks} tasks x {per_task} awaits: `DeviceFuture` vs raw host-callback future"),
            Unit::OpsPerSec,
        )
        .raw(sum(&r[0]))
        .lib(sum(&r[1]));
        if tasks == 256 {
            row = row.goal(Goal::AtLeast(0.95));
            lib_256 = sum(&r[1]);
        }
        rows.push(row);
    }
    let per_thread = cfg.reps(2_000, 100);
    let ops = (SYNC_THREADS * per_thread) as f64;
    let r = interleaved_rates(
        rounds,
        ops,
        &mut [
            &mut || sync_throughput(fx, SYNC_THREADS, per_thread, SyncPath::Raw),
            &mut || sync_throughput(fx, SYNC_THREADS, per_thread, SyncPath::Lib),
        ],
    )?;
    rows.push(
        Row::new(
            g,
            format!("{SYNC_THREADS} threads x {per_thread} blocking waits: `.sync()` vs raw launch + sync"),
            Unit::OpsPerSec,
        )
        .raw(sum(&r[0]))
        .lib(sum(&r[1]))
        .note("raw: one stream per thread; `.sync()`: the shared 4-stream pool, one stream per thread (affinity)"),
    );
    rows.push(
        Row::new(
            g,
            format!("256 tasks x {per_task} awaits (`DeviceFuture`) vs {SYNC_THREADS} threads raw launch + sync"),
            Unit::OpsPerSec,
        )
        .raw(sum(&r[0]))
        .lib(lib_256)
        .goal(Goal::AtLeast(0.65))
        .goal_from("issue 5"),
    );
    Ok(rows)
}

fn mode_name(m: CompletionMode) -> String {
    match m {
        CompletionMode::HostCallback => "host callback".into(),
        CompletionMode::Reactor => "reactor".into(),
        CompletionMode::ReactorInlineSpin(d) => {
            format!("reactor + {} us inline spin", d.as_micros())
        }
        CompletionMode::Reply => "remote reply".into(),
    }
}

fn mode_label(m: CompletionMode) -> String {
    if m == CompletionMode::DEFAULT {
        format!("{} (default)", mode_name(m))
    } else {
        mode_name(m)
    }
}

/// `completion`: every completion mode side by side (issue 5): await
/// latency of one empty kernel vs raw launch + sync and vs the raw
/// host-callback future; 256 tasks x N awaits vs the raw future and vs 4
/// threads of raw launch + sync; the reactor thread's CPU while idle.
///
/// # Errors
/// The first error of any path.
pub fn completion(fx: &Arc<Fixture>, rt: &Runtime, cfg: &Config) -> Result<Vec<Row>> {
    let g = "completion";
    let mut rows = Vec::new();
    let mut paths = vec![AwaitPath::RawSync, AwaitPath::RawHostFn];
    paths.extend(COMPLETION_MODES.iter().map(|&m| AwaitPath::Mode(m)));
    let t = await_latencies(rt, fx, cfg.reps(200, 10), cfg.reps(3_000, 50), &paths)?;
    for (i, &m) in COMPLETION_MODES.iter().enumerate() {
        let lib = sum(&t[2 + i]);
        let mut vs_sync = Row::new(
            g,
            format!(
                "await latency, 1 empty kernel, {}: vs raw launch + sync",
                mode_label(m)
            ),
            Unit::Micros,
        )
        .raw(sum(&t[0]))
        .lib(lib);
        if m == CompletionMode::DEFAULT {
            vs_sync = vs_sync.goal(Goal::AtMost(1.6)).goal_from("issue 5");
        }
        rows.push(vs_sync);
        let mut vs_cb = Row::new(
            g,
            format!(
                "await latency, 1 empty kernel, {}: vs raw host-callback future",
                mode_label(m)
            ),
            Unit::Micros,
        )
        .raw(sum(&t[1]))
        .lib(lib);
        if m == CompletionMode::HostCallback {
            vs_cb = vs_cb.goal(Goal::AtMost(1.05)).goal_from("issue 5");
        }
        rows.push(vs_cb);
    }

    let tasks = 256;
    let per_task = cfg.reps(AWAITS_PER_TASK, 20);
    let per_thread = cfg.reps(2_000, 100);
    let rounds = cfg.reps(5, 3);
    let task_ops = (tasks * per_task) as f64;
    let thread_ops = (SYNC_THREADS * per_thread) as f64;
    let mut raw_fut = Vec::new();
    let mut raw_sync = Vec::new();
    let mut lib: Vec<Vec<f64>> = vec![Vec::new(); COMPLETION_MODES.len()];
    for round in 0..rounds {
        let k = COMPLETION_MODES.len() + 2;
        for j in 0..k {
            match (round + j) % k {
                0 => raw_fut.push(
                    task_ops
                        / await_throughput(rt, fx, tasks, per_task, AwaitPath::RawHostFn)?
                            .as_secs_f64(),
                ),
                1 => raw_sync.push(
                    thread_ops
                        / sync_throughput(fx, SYNC_THREADS, per_thread, SyncPath::Raw)?
                            .as_secs_f64(),
                ),
                i => {
                    let m = COMPLETION_MODES[i - 2];
                    let d = await_throughput(rt, fx, tasks, per_task, AwaitPath::Mode(m))?;
                    lib[i - 2].push(task_ops / d.as_secs_f64());
                }
            }
        }
    }
    for (i, &m) in COMPLETION_MODES.iter().enumerate() {
        let mut vs_cb = Row::new(
            g,
            format!(
                "{tasks} tasks x {per_task} awaits, {}: vs raw host-callback future",
                mode_label(m)
            ),
            Unit::OpsPerSec,
        )
        .raw(sum(&raw_fut))
        .lib(sum(&lib[i]));
        if m == CompletionMode::HostCallback {
            vs_cb = vs_cb.goal(Goal::AtLeast(0.95)).goal_from("issue 5");
        }
        rows.push(vs_cb);
        let mut vs_sync = Row::new(
            g,
            format!(
                "{tasks} tasks x {per_task} awaits, {}: vs {SYNC_THREADS} threads raw launch + sync",
                mode_label(m)
            ),
            Unit::OpsPerSec,
        )
        .raw(sum(&raw_sync))
        .lib(sum(&lib[i]));
        if m == CompletionMode::DEFAULT {
            vs_sync = vs_sync.goal(Goal::AtLeast(0.65)).goal_from("issue 5");
        }
        rows.push(vs_sync);
        if m == CompletionMode::DEFAULT {
            rows.push(
                Row::new(
                    g,
                    format!(
                        "{tasks} tasks x {per_task} awaits, {}: vs the 250k ops/s goal",
                        mode_label(m)
                    ),
                    Unit::OpsPerSec,
                )
                .raw(Summary::of(&[250_000.0]))
                .lib(sum(&lib[i]))
                .goal(Goal::AtLeast(1.0))
                .goal_from("issue 5")
                .note("raw column: the goal (250k ops/s on an H200), not a measurement"),
            );
        }
    }

    // The reactor thread while nothing is in flight.
    let secs = (10.0 * cfg.scale).clamp(2.0, 10.0);
    match reactor_idle_cpu(Duration::from_secs_f64(secs)) {
        Some(pct) => rows.push(
            Row::new(
                g,
                format!("reactor thread CPU with nothing in flight, over {secs:.0} s"),
                Unit::PercentCore,
            )
            .raw(Summary::of(&[1.0]))
            .lib(Summary::of(&[pct]))
            .goal(Goal::AtMost(1.0))
            .goal_from("issue 5")
            .note("raw column: the 1% budget, not a measurement; from /proc/self/task/*/stat"),
        ),
        None => rows.push(Row::error(g, "reactor thread not found in /proc/self/task")),
    }
    Ok(rows)
}

/// CPU time of the reactor thread over `window`, in percent of one core.
/// `None` if the thread is not found (no reactor started, or no /proc).
pub fn reactor_idle_cpu(window: Duration) -> Option<f64> {
    fn find() -> Option<std::path::PathBuf> {
        for e in std::fs::read_dir("/proc/self/task").ok()? {
            let p = e.ok()?.path();
            let comm = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
            if comm.trim_end().starts_with("cuda-async-reac") {
                return Some(p);
            }
        }
        None
    }
    fn ticks(p: &std::path::Path) -> Option<u64> {
        let stat = std::fs::read_to_string(p.join("stat")).ok()?;
        // Fields after the `(comm)`: state is field 3; utime 14, stime 15.
        let rest = &stat[stat.rfind(')')? + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
    }
    let p = find()?;
    // Let in-flight work drain and the reactor reach its parked state.
    std::thread::sleep(Duration::from_millis(200));
    let t0 = ticks(&p)?;
    let start = Instant::now();
    std::thread::sleep(window);
    let t1 = ticks(&p)?;
    let hz = 100.0; // USER_HZ is 100 on Linux (x86-64).
    let cpu_s = (t1 - t0) as f64 / hz;
    Some(cpu_s / start.elapsed().as_secs_f64() * 100.0)
}

/// `zip`: two ~1 ms spin kernels zipped vs one, vs the same two in
/// sequence, vs a raw two-stream fork/join.
///
/// # Errors
/// The first error of any path.
pub fn zip(fx: &Fixture, cfg: &Config) -> Result<Vec<Row>> {
    let mut rows = zip_pairs(fx, cfg)?;
    rows.push(width(fx, cfg)?);
    Ok(rows)
}

/// Concurrent spins of the width row.
pub const WIDTH: usize = 32;
/// Each one's length.
pub const WIDE_SPIN_NS: u64 = 10_000_000;

/// The width row: [`WIDTH`] independent 10 ms spins awaited together
/// (`join_all` on a pool of one stream more) against one spin, which is
/// their ideal concurrent time (they fit on the GPU at once). The report
/// sets [`WIDTH`] hardware queues before the driver starts
/// (`set_hardware_queues`); the row's note says how many the driver took.
fn width(fx: &Fixture, cfg: &Config) -> Result<Row> {
    let wide = StreamPoolRoundRobin::new(&fx.device, WIDTH + 1)?;
    let t = interleaved(
        cfg.reps(3, 1),
        cfg.reps(20, 5),
        &mut [&mut || fx.raw_spin_ns(WIDE_SPIN_NS), &mut || {
            fx.lib_wide(&wide, WIDTH, WIDE_SPIN_NS)
        }],
    )?;
    let ms = |v: &Vec<f64>| sum(v).map(|s| s.scaled(1e-3));
    Ok(Row::new(
        "zip",
        format!(
            "{WIDTH} independent 10 ms spins awaited together (`join_all`, {} streams) vs one spin (their ideal concurrent time)",
            WIDTH + 1
        ),
        Unit::Millis,
    )
    .raw(ms(&t[0]))
    .lib(ms(&t[1]))
    .goal(Goal::AtMost(1.1))
    .note(format!(
        "{} hardware queues (CUDA_DEVICE_MAX_CONNECTIONS)",
        cuda_async::hardware_queues()
    )))
}

fn zip_pairs(fx: &Fixture, cfg: &Config) -> Result<Vec<Row>> {
    let t = interleaved(
        cfg.reps(5, 2),
        cfg.reps(200, 20),
        &mut [
            &mut || fx.raw_spin(),
            &mut || fx.lib_spin(),
            &mut || fx.lib_zip2(),
            &mut || fx.lib_seq2(),
            &mut || fx.raw_fork_join2(),
        ],
    )?;
    let ms = |v: &Vec<f64>| sum(v).map(|s| s.scaled(1e-3));
    let g = "zip";
    Ok(vec![
        Row::new(
            g,
            "`zip` of two 1 ms spins vs one spin (raw launch + sync)",
            Unit::Millis,
        )
        .raw(ms(&t[0]))
        .lib(ms(&t[2]))
        .goal(Goal::AtMost(1.15)),
        Row::new(
            g,
            "`zip` of two 1 ms spins vs raw two-stream fork/join",
            Unit::Millis,
        )
        .raw(ms(&t[4]))
        .lib(ms(&t[2])),
        Row::new(
            g,
            "two 1 ms spins in sequence (`then`) vs one spin (raw)",
            Unit::Millis,
        )
        .raw(ms(&t[0]))
        .lib(ms(&t[3]))
        .note("expected ~2: the serial reference for `zip`"),
        Row::new(
            g,
            "one 1 ms spin: `.sync()` vs raw launch + sync",
            Unit::Millis,
        )
        .raw(ms(&t[0]))
        .lib(ms(&t[1])),
    ])
}

/// `graph`: a chain of 100 empty kernels: eager through ops vs raw eager
/// launches; its graph replay through ops (`op.graph()`, `graph.launch()`)
/// vs a raw cudarc graph replay, and vs the eager ops.
///
/// # Errors
/// The first error of any path.
pub fn graph(fx: &Fixture, cfg: &Config) -> Result<Vec<Row>> {
    let graph = fx.raw_graph(GRAPH_NODES)?;
    let ours = fx.lib_graph(GRAPH_NODES)?;
    let t = interleaved(
        cfg.reps(20, 3),
        cfg.reps(500, 20),
        &mut [
            &mut || Ok(graph.replay_sync()?),
            &mut || fx.raw_eager(GRAPH_NODES),
            &mut || fx.lib_eager(GRAPH_NODES),
            &mut || fx.lib_replay(&ours),
        ],
    )?;
    let per_node = |v: &Vec<f64>| sum(v).map(|s| s.scaled(1.0 / GRAPH_NODES as f64));
    let g = "graph";
    Ok(vec![
        Row::new(
            g,
            "100-kernel chain, eager, per node: ops (`then` + `boxed`) vs raw launches",
            Unit::Micros,
        )
        .raw(per_node(&t[1]))
        .lib(per_node(&t[2])),
        Row::new(
            g,
            "graph replay of 100 kernels + sync, per node: `graph.launch().sync_on(&s)` vs raw cudarc graph",
            Unit::Micros,
        )
        .raw(per_node(&t[0]))
        .lib(per_node(&t[3]))
        .goal(Goal::AtMost(1.05)),
        Row::new(
            g,
            "100-kernel chain + sync, per node: graph replay (ops) vs eager ops",
            Unit::Micros,
        )
        .raw(per_node(&t[2]))
        .lib(per_node(&t[3])),
    ])
}

/// `copies`: 256 MiB pinned host-to-device and device-to-host, through
/// `copy_h2d`/`copy_d2h` vs raw `cuMemcpy*Async`, in GB/s.
///
/// # Errors
/// The first error of any path (out of memory included).
pub fn copies(fx: &Fixture, cfg: &Config) -> Result<Vec<Row>> {
    let cp = RefCell::new(fx.copies(COPY_BYTES)?);
    let bytes = cp.borrow().bytes() as f64;
    let t = interleaved(
        cfg.reps(3, 1),
        cfg.reps(30, 5),
        &mut [
            &mut || cp.borrow_mut().raw_h2d(),
            &mut || cp.borrow_mut().lib_h2d(),
            &mut || cp.borrow_mut().raw_d2h(),
            &mut || cp.borrow_mut().lib_d2h(),
        ],
    )?;
    let gbps = |v: &Vec<f64>| gb_per_s(bytes, v);
    let g = "copies";
    Ok(vec![
        Row::new(
            g,
            "pinned copy 256 MiB host-to-device: `copy_h2d` vs raw",
            Unit::GBps,
        )
        .raw(gbps(&t[0]))
        .lib(gbps(&t[1]))
        .goal(Goal::AtLeast(0.95)),
        Row::new(
            g,
            "pinned copy 256 MiB device-to-host: `copy_d2h` vs raw",
            Unit::GBps,
        )
        .raw(gbps(&t[2]))
        .lib(gbps(&t[3]))
        .goal(Goal::AtLeast(0.95)),
    ])
}

/// `multi_gpu` (a host with two GPUs): [`MULTI_KERNELS`] independent
/// ~1 ms spin kernels, each filling its GPU, awaited together through a
/// [`cuda_async::DevicePool`] over GPUs 0 and 1 vs GPU 0's own pool; and a
/// 256 MiB peer copy GPU 0 -> GPU 1 through `to_device` vs a raw
/// `cuMemcpyPeerAsync`, in GB/s: first with peer access off on both sides
/// (automatic access turned off), then with it on (the raw copy between
/// `cuMemAlloc` buffers of contexts whose access it enabled itself; the
/// library's enabled by its first copy). With one GPU every row says why
/// it is empty.
///
/// # Errors
/// The first error of any path.
pub fn multi_gpu(fx: &Fixture, rt: &Runtime, cfg: &Config) -> Result<Vec<Row>> {
    use cuda_async::cudarc::driver::{sys, DevicePtr, DevicePtrMut};
    use cuda_async::prelude::*;
    use cuda_async::{DeviceBuffer, DevicePool, SchedulingPolicy, StreamPoolRoundRobin};
    let g = "multi_gpu";
    let spread = format!(
        "{MULTI_KERNELS} independent 1 ms kernels (each fills its GPU), awaited together: \
         `DevicePool` over 2 GPUs vs one GPU's pool"
    );
    let peer = "peer copy 256 MiB GPU 0 -> GPU 1: `to_device` vs raw `cuMemcpyPeerAsync` \
                (peer access not enabled on either side)";
    let linked = "peer copy 256 MiB GPU 0 -> GPU 1 with peer access enabled: `to_device` vs raw \
                  `cuMemcpyPeerAsync` (raw: the link's speed)";
    if cuda_async::device_count()? < 2 {
        let why = "needs 2 GPUs: this host has one";
        return Ok(vec![
            Row::new(g, spread, Unit::Millis)
                .goal(Goal::AtMost(0.55))
                .note(why),
            Row::new(g, peer, Unit::GBps)
                .goal(Goal::AtLeast(0.95))
                .note(why),
            Row::new(g, linked, Unit::GBps)
                .goal(Goal::AtLeast(0.95))
                .note(why),
        ]);
    }
    let d0 = fx.device.clone();
    let d1 = cuda_async::Device::new(1)?;
    // Enough 128-thread blocks of `spin` to fill every SM (16 per SM is
    // 2048 threads, an SM's limit), so two such kernels cannot share a GPU.
    let sms = d0
        .context()
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    let fill = cuda_async::LaunchConfig {
        grid_dim: (sms.max(1) as u32 * 16, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let one = StreamPoolRoundRobin::default_for(&d0)?;
    let two = DevicePool::new(&[0, 1])?;
    let spin = &fx.kernels.spin;
    let batch = |p: &dyn SchedulingPolicy| -> Result<()> {
        let futures = (0..MULTI_KERNELS)
            // SAFETY: `spin` takes one u64 and touches no memory.
            .map(|_| unsafe { launch(spin, fill, (crate::kernels::SPIN_NS,)) }.schedule(p))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        for r in rt.block_on(futures_util::future::join_all(futures)) {
            r?;
        }
        Ok(())
    };
    let t = interleaved(
        cfg.reps(2, 1),
        cfg.reps(20, 5),
        &mut [&mut || batch(&one), &mut || batch(&two)],
    )?;
    let ms = |v: &Vec<f64>| sum(v).map(|s| s.scaled(1e-3));
    let mut rows = vec![Row::new(g, spread, Unit::Millis)
        .raw(ms(&t[0]))
        .lib(ms(&t[1]))
        .goal(Goal::AtMost(0.55))];

    // The peer copy, first staged: nothing in this process has enabled
    // peer access yet, and `to_device` is told not to.
    cuda_async::set_auto_peer_access(false);
    let s0 = d0.new_stream()?;
    let s1 = d1.new_stream()?;
    let src = h2d(vec![7u8; COPY_BYTES]).sync_on(&s0)?;
    let on1 = cuda_async::SingleStream::new(s1.clone())?;
    let mut dst = zeros::<u8>(COPY_BYTES).sync_on(&s1)?;
    let raw_copy = |dst: &mut DeviceBuffer<u8>| -> Result<()> {
        let src = src.local()?;
        let dst = dst
            .local_mut()
            .map_err(|e| BenchError::from(e.to_string()))?;
        let (sp, _r) = src.as_cuda_slice().device_ptr(&s1);
        let (dp, _w) = dst.as_cuda_slice_mut().device_ptr_mut(&s1);
        // SAFETY: both pointers address COPY_BYTES bytes of live
        // allocations of their contexts; both devices are idle between
        // reps (the copy is synchronized), so nothing else touches them.
        unsafe { crate::raw::peer_copy_sync(dp, s1.context(), sp, s0.context(), COPY_BYTES, &s1) }?;
        Ok(())
    };
    let t = interleaved(
        cfg.reps(3, 1),
        cfg.reps(20, 5),
        &mut [&mut || raw_copy(&mut dst), &mut || {
            cuda_async::to_device(&src, &d1).sync_with(&on1)?;
            Ok(())
        }],
    )?;
    let gbps = |v: &Vec<f64>| gb_per_s(COPY_BYTES as f64, v);
    rows.push(
        Row::new(g, peer, Unit::GBps)
            .raw(gbps(&t[0]))
            .lib(gbps(&t[1]))
            .goal(Goal::AtLeast(0.95)),
    );

    // Then over the link. Raw: `cuMemAlloc` buffers, access enabled by
    // hand on both contexts. The library: its default, enabling access
    // (contexts and pools) at its first copy; GPU 1's pool keeps the
    // freed copies, so every rep does not map 256 MiB afresh.
    cuda_async::set_auto_peer_access(true);
    d1.set_mem_pool_release_threshold(2 * COPY_BYTES as u64)?;
    let note = match crate::raw::peer_link(d0.context(), d1.context())? {
        Some(rank) => format!("P2P performance rank {rank}"),
        None => {
            rows.push(
                Row::new(g, linked, Unit::GBps)
                    .goal(Goal::AtLeast(0.95))
                    .note("GPU 0 and GPU 1 cannot access each other (`cuDeviceCanAccessPeer`)"),
            );
            return Ok(rows);
        }
    };
    let raw_src = crate::raw::RawDeviceMem::new(d0.context(), COPY_BYTES)?;
    let raw_dst = crate::raw::RawDeviceMem::new(d1.context(), COPY_BYTES)?;
    let raw_linked = || -> Result<()> {
        // SAFETY: both pointers address COPY_BYTES bytes of live
        // `cuMemAlloc` allocations of their contexts, touched by nothing
        // else (both devices idle between reps: the copy is synchronized).
        unsafe {
            crate::raw::peer_copy_sync(
                raw_dst.ptr(),
                s1.context(),
                raw_src.ptr(),
                s0.context(),
                COPY_BYTES,
                &s1,
            )
        }?;
        Ok(())
    };
    let t = interleaved(
        cfg.reps(3, 1),
        cfg.reps(40, 5),
        &mut [&mut || raw_linked(), &mut || {
            cuda_async::to_device(&src, &d1).sync_with(&on1)?;
            Ok(())
        }],
    )?;
    rows.push(
        Row::new(g, linked, Unit::GBps)
            .raw(gbps(&t[0]))
            .lib(gbps(&t[1]))
            .goal(Goal::AtLeast(0.95))
            .note(note),
    );
    Ok(rows)
}

/// Sizes of the known allocation pattern of the `mem_pools` topic.
pub const POOL_PATTERN_MIB: [usize; 3] = [1, 3, 16];
/// Buffers of 4 KiB per op in the `mem_pools` timing rows.
pub const POOL_ALLOCS: usize = 64;

/// `mem_pools`: a policy given its own memory pool
/// ([`SchedulingPolicy::with_mem_pool`](cuda_async::SchedulingPolicy::with_mem_pool))
/// against the default policy. After a known allocation pattern the pool's
/// used-high mark is what was allocated; an op that allocates
/// [`POOL_ALLOCS`] buffers of 4 KiB (zeroed, then freed) costs the same
/// from the chosen pool as from the device's default pool, both keeping
/// freed memory (release threshold 1 GiB; the default pool's is restored
/// after).
///
/// # Errors
/// The first error of any path; an error if the used-high mark is below
/// what was allocated.
pub fn mem_pools(fx: &Fixture, cfg: &Config) -> Result<Vec<Row>> {
    use cuda_async::prelude::*;
    use cuda_async::{MemPool, MemPoolOptions};
    let g = "mem_pools";
    let d = &fx.device;
    let pool = MemPool::new(d, MemPoolOptions::default().release_threshold(1 << 30))?;
    let chosen = fx.policy.as_ref().clone().with_mem_pool(pool.clone());

    // The known pattern: allocated, the high mark read, freed.
    pool.reset_high_marks()?;
    let bufs = POOL_PATTERN_MIB
        .iter()
        .map(|&m| zeros::<u8>(m << 20).sync_with(&chosen))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let high = pool.stats()?.used_high;
    drop(bufs);
    let allocated: usize = POOL_PATTERN_MIB.iter().sum::<usize>() << 20;
    if high < allocated as u64 {
        return Err(format!(
            "the pool's used-high mark {high} B is below the {allocated} B allocated"
        )
        .into());
    }
    let mib = |b: f64| Summary::of(&[b / f64::from(1u32 << 20)]);
    let mut rows = vec![Row::new(
        g,
        "used-high mark of a chosen pool after zeros of 1, 3 and 16 MiB vs the bytes allocated",
        Unit::MiB,
    )
    .raw(mib(allocated as f64))
    .lib(mib(high as f64))
    .goal(Goal::AtMost(1.0))
    .note("raw column: the bytes asked for; ratio 1: the pool counted exactly those (below 1 is an error)")];

    // The cost of allocating from it.
    let default_pool = MemPool::default_of(d)?;
    let threshold = default_pool.release_threshold()?;
    default_pool.set_release_threshold(1 << 30)?;
    let many = |p: &dyn SchedulingPolicy| -> Result<()> {
        let bufs = join_all(
            (0..POOL_ALLOCS)
                .map(|_| zeros::<u8>(4096))
                .collect::<Vec<_>>(),
        )
        .sync_with(p)?;
        drop(bufs);
        Ok(())
    };
    let t = interleaved(
        cfg.reps(20, 5),
        cfg.reps(400, 20),
        &mut [&mut || many(fx.policy.as_ref()), &mut || many(&chosen)],
    );
    default_pool.set_release_threshold(threshold)?;
    let t = t?;
    rows.push(
        Row::new(
            g,
            format!(
                "{POOL_ALLOCS} zeroed 4 KiB buffers in one op + sync: a chosen pool (`with_mem_pool`) vs the default pool"
            ),
            Unit::Micros,
        )
        .raw(Summary::of(&t[0]))
        .lib(Summary::of(&t[1]))
        .goal(Goal::AtMost(1.05)),
    );
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_defaults_and_floors() {
        let c = Config::parse(None, None).unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.reps(400, 20), 400);
        let q = Config::parse(Some("0.01"), Some("")).unwrap();
        assert_eq!(q.reps(400, 20), 20);
        assert!(q.wants("copies"));
        assert!(Config::parse(Some("abc"), None).is_err());
        assert!(Config::parse(Some("0"), None).is_err());
        assert!(Config::parse(None, Some("overhead,nope")).is_err());
    }

    #[test]
    fn interleaving_rotates_and_times_every_path() {
        let order = RefCell::new(Vec::new());
        let t = interleaved(
            1,
            3,
            &mut [
                &mut || {
                    order.borrow_mut().push('a');
                    Ok(())
                },
                &mut || {
                    order.borrow_mut().push('b');
                    Ok(())
                },
            ],
        )
        .unwrap();
        assert_eq!(t.len(), 2);
        assert!(t
            .iter()
            .all(|v| v.len() == 3 && v.iter().all(|x| *x >= 0.0)));
        assert_eq!(order.into_inner().iter().collect::<String>(), "ababbaab");
    }

    #[test]
    fn rates_are_ops_over_seconds() {
        let r = interleaved_rates(2, 1000.0, &mut [&mut || Ok(Duration::from_millis(10))]).unwrap();
        assert_eq!(r[0].len(), 2);
        assert!((r[0][0] - 100_000.0).abs() < 1e-6);
    }

    #[test]
    fn errors_stop_the_measurement() {
        let e = interleaved(0, 5, &mut [&mut || Err("broken".into())]).unwrap_err();
        assert_eq!(e.to_string(), "broken");
    }
}
