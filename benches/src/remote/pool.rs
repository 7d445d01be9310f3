//! `remote_pool` (only when named): whether a lease behaves like a local
//! stream pool when many tokio tasks share it. The node pipelines a
//! lease's submissions over its streams, so independent work from several
//! tasks should overlap on the remote GPU as it does on the local pool's
//! streams, and many small pipelines should keep it as busy.
//!
//! Every row runs on one lease of the default client (striped, the
//! bulk-data channel on), with [`RemotePolicy::new`] (4 streams), and on
//! the local default policy ([`cuda_async::default_policy`], a
//! [`StreamPoolRoundRobin`]) in the same run, the two in alternating
//! order, round by round (the pipeline rows drop their first round: it
//! warms up):
//! - two tasks' independent ~1 s kernels: the pair's wall time against
//!   one kernel alone, on the lease (the local figure in the note);
//! - [`PoolConfig::tasks`] tasks x [`PoolConfig::pipelines`] pipelines
//!   each: the kernel alone on a buffer the task keeps; 1 MiB up, the
//!   kernel, 1 MiB down (checked); the same with a one-FMA kernel
//!   (transfers, in effect): pipelines per second, lease against local;
//! - the same tasks moving 1 MiB up and 1 MiB down per pipeline, against
//!   one `h2d` then one `d2h` of the bulk size, both on the lease.
//!
//! With the memory device the lease side of the first and the last rows
//! runs (its `delay(ms)` test kernel takes `ms` of its stream's time);
//! the kernel rows need a GPU and say so.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_async::prelude::*;
use cuda_async::{DeviceBuffer, HostBuffer, Kernel, LaunchConfig, Module, StreamPoolRoundRobin};
use cuda_lease::client::Lease;
use cuda_lease::remote::LeaseBackend;
use tokio::task::JoinHandle;

use super::{detail, gib_s, size_label, times, Ctx};
use crate::measure::Config;
use crate::report::{Goal, Row, Unit};
use crate::stats::Summary;
use crate::Result;

const GROUP: &str = "remote_pool";

/// Floats in a pipeline's buffer: 1 MiB.
const PIPE_ELEMS: usize = 262_144;

/// Bytes of a pipeline's buffer.
const PIPE_BYTES: u64 = (PIPE_ELEMS * 4) as u64;

/// FMAs per element of the pipelines' kernel: about 0.5 ms over 1 MiB on
/// an H100 (the topic prints what it measured).
const FMA_ITERS: u32 = 28_000;

/// What each FMA adds (`v = fma(v, 1, STEP)`): a power of two, so the
/// sums stay exact and a download can be checked for equality.
const STEP: f32 = 1.0 / 1024.0;

/// `delay(ms)`: on a GPU, one thread spins on the global timer for `ms`
/// milliseconds; the memory device runs its own `delay(ms)` test kernel
/// instead (it takes `ms` of its stream's time).
const DELAY: &str = r#"
extern "C" __global__ void delay(unsigned ms) {
    unsigned long long t0, t, ns = ms * 1000000ull;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"#;

/// The pipelines' kernel: `iters` dependent FMAs per element, in place.
const FMA: &str = r#"
extern "C" __global__ void fma_loop(float* y, unsigned n, unsigned iters, float a, float b) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = y[i];
    for (unsigned k = 0; k < iters; ++k) v = fmaf(v, a, b);
    y[i] = v;
}
"#;

/// The sizes of `remote_pool`.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolConfig {
    /// Tokio tasks of the pipeline rows (64).
    pub tasks: usize,
    /// Pipelines per task and run (8 at `REPORT_SCALE=1`).
    pub pipelines: usize,
    /// Kept runs of each path per pipeline row, after one that warms up
    /// (5 at `REPORT_SCALE=1`).
    pub rounds: usize,
    /// How long the kernels of the first row run (1 s).
    pub spin: Duration,
    /// Kept runs of the first row (3 at `REPORT_SCALE=1`).
    pub spin_rounds: usize,
}

impl PoolConfig {
    /// The report's sizes at `cfg`'s scale: 64 tasks always (the point is
    /// many tasks), 1 s kernels, fewer pipelines and rounds at a smaller
    /// scale.
    pub fn new(cfg: &Config) -> Self {
        PoolConfig {
            tasks: 64,
            pipelines: cfg.reps(8, 2),
            rounds: cfg.reps(5, 2),
            spin: Duration::from_secs(1),
            spin_rounds: cfg.reps(3, 1),
        }
    }
}

/// The `remote_pool` topic's rows.
pub(super) async fn pool_rows(ctx: &Ctx) -> Result<Vec<Row>> {
    let (pc, memory, bytes) = (&ctx.cfg.pool, ctx.cfg.memory(), ctx.cfg.bytes);
    let delay = Module::cuda(DELAY, &[])?.kernel("delay")?;
    let fma = Module::cuda(FMA, &[])?.kernel("fma_loop")?;
    // Room for the bulk transfers, every task's kept buffer and one in
    // flight per task, and headroom for frees not yet done.
    let vram = 2 * bytes + pc.tasks as u64 * 4 * PIPE_BYTES + (64 << 20);
    let lease = Lease::builder()
        .min_vram(vram)
        .ttl(Duration::from_secs(120))
        .on(ctx.striped.clone())
        .await?;
    let remote = Arc::new(RemotePolicy::new(&LeaseBackend::current(lease.session())));
    let local = if memory {
        None
    } else {
        let dev = cuda_async::Device::new(0)?;
        delay.load_on(&dev)?;
        fma.load_on(&dev)?;
        Some(cuda_async::default_policy()?)
    };
    let result = measure(pc, bytes, &delay, &fma, &remote, local.as_ref()).await;
    drop(remote);
    lease.free().await?;
    result
}

/// Every row, on `remote` and (with a GPU here) `local`.
async fn measure(
    pc: &PoolConfig,
    bytes: u64,
    delay: &Kernel,
    fma: &Kernel,
    remote: &Arc<RemotePolicy>,
    local: Option<&Arc<StreamPoolRoundRobin>>,
) -> Result<Vec<Row>> {
    let mut rows = vec![spin_row(pc, delay, remote, local).await?];
    detail(format_args!(
        "{} tasks x {} pipelines of 1 MiB per run, {} runs of each path kept",
        pc.tasks, pc.pipelines, pc.rounds
    ));
    // Buffers kept by the tasks (the kernel-only row), on each side.
    let mut on_remote = lanes(remote, pc.tasks, local.is_some()).await?;
    let mut on_local = match local {
        Some(l) => Some(lanes(l, pc.tasks, true).await?),
        None => None,
    };
    match (local, &mut on_local) {
        (Some(l), Some(lanes)) => {
            kernel_alone(
                fma,
                remote,
                first_lane(&mut on_remote)?,
                l,
                first_lane(lanes)?,
            )
            .await?;
            rows.extend(pipeline_rows(pc, fma, remote, &mut on_remote, l, lanes).await?);
        }
        _ => rows.extend(PIPES.iter().map(|&(pipe, goal)| {
            Row::new(GROUP, pipe_metric(pc, pipe), Unit::OpsPerSec)
                .goal(goal)
                .note("n/a: needs a GPU (the memory device runs only its test kernels)")
        })),
    }
    rows.push(
        transfer_row(
            pc,
            bytes,
            fma,
            remote,
            &mut on_remote,
            local.zip(on_local.as_mut()),
        )
        .await?,
    );
    Ok(rows)
}

fn first_lane(lanes: &mut [Lane]) -> Result<&mut Lane> {
    Ok(lanes.first_mut().ok_or("no tasks")?)
}

/// Two tasks' independent kernels of `pc.spin`, each awaiting one launch,
/// against one such kernel alone: on the lease (the row), and locally
/// (the note).
async fn spin_row(
    pc: &PoolConfig,
    delay: &Kernel,
    remote: &Arc<RemotePolicy>,
    local: Option<&Arc<StreamPoolRoundRobin>>,
) -> Result<Row> {
    let ms = u32::try_from(pc.spin.as_millis()).map_err(|_| "the spin is too long")?;
    // The module is loaded (on the node, and here) before the clock starts.
    one_delay(remote.clone(), delay.clone(), 0).await?;
    if let Some(l) = local {
        one_delay(l.clone(), delay.clone(), 0).await?;
    }
    let (mut lease_one, mut lease_two) = (Vec::new(), Vec::new());
    let (mut local_one, mut local_two) = (Vec::new(), Vec::new());
    for round in 0..pc.spin_rounds {
        let lease_first = round % 2 == 0;
        for on_lease in [lease_first, !lease_first] {
            if on_lease {
                let (a, b) = spins(remote, delay, ms).await?;
                lease_one.push(a);
                lease_two.push(b);
            } else if let Some(l) = local {
                let (a, b) = spins(l, delay, ms).await?;
                local_one.push(a);
                local_two.push(b);
            }
        }
    }
    let label = duration_label(pc.spin);
    let ms_of = |v: &[Duration]| times(Unit::Millis, v);
    let (one, two) = (ms_of(&lease_one), ms_of(&lease_two));
    detail(format_args!(
        "two tasks' {label} kernels on the lease: pair {:.1} ms, one alone {:.1} ms",
        median(two),
        median(one)
    ));
    let local_note = match (ms_of(&local_one), ms_of(&local_two)) {
        (Some(l1), Some(l2)) => {
            detail(format_args!(
                "two tasks' {label} kernels on the local pool: pair {:.1} ms, one alone {:.1} ms",
                l2.median, l1.median
            ));
            format!(
                "on the local pool the pair took {:.1} ms against {:.1} ms alone (ratio {:.3})",
                l2.median,
                l1.median,
                l2.median / l1.median
            )
        }
        _ => "no local GPU here".into(),
    };
    Ok(Row::new(
        GROUP,
        format!(
            "two tasks' independent ~{label} kernels on one lease: the pair's wall time vs one \
             kernel alone (each task awaits one launch)"
        ),
        Unit::Millis,
    )
    .raw(one)
    .lib(two)
    .goal(Goal::AtMost(1.1))
    .note(format!(
        "both sides the lease: one kernel alone in the raw column, the two tasks' pair in the \
         cuda-async column; {local_note}"
    )))
}

/// One kernel of `ms` alone, then two tasks' kernels of `ms` at once, on
/// `policy`: the wall times.
async fn spins<P>(policy: &Arc<P>, delay: &Kernel, ms: u32) -> Result<(Duration, Duration)>
where
    P: SchedulingPolicy + Send + Sync + 'static,
{
    let t = Instant::now();
    one_delay(policy.clone(), delay.clone(), ms).await?;
    let one = t.elapsed();
    let t = Instant::now();
    let tasks = (0..2)
        .map(|_| tokio::spawn(one_delay(policy.clone(), delay.clone(), ms)))
        .collect();
    joined(tasks).await?;
    Ok((one, t.elapsed()))
}

/// One awaited launch of `delay(ms)` on `policy`.
async fn one_delay<P>(policy: Arc<P>, delay: Kernel, ms: u32) -> Result<()>
where
    P: SchedulingPolicy + Send + Sync + 'static,
{
    // SAFETY: `delay` takes one u32 and touches no memory.
    unsafe { launch(&delay, LaunchConfig::for_num_elems(1), (ms,)) }
        .schedule(&*policy)?
        .await?;
    Ok(())
}

/// Waits for every task, then returns their outputs, or the first error
/// (a task's own, or its panic).
async fn joined<T>(tasks: Vec<JoinHandle<Result<T>>>) -> Result<Vec<T>> {
    let mut out = Vec::with_capacity(tasks.len());
    let mut first = None;
    for t in tasks {
        match t.await {
            Ok(Ok(v)) => out.push(v),
            Ok(Err(e)) => {
                first.get_or_insert(e);
            }
            Err(e) => {
                first.get_or_insert(format!("a task failed: {e}").into());
            }
        }
    }
    match first {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// What one pipeline does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pipe {
    /// The kernel ([`FMA_ITERS`]) on the task's kept buffer, awaited.
    Kernel,
    /// 1 MiB up, the kernel with this many FMAs per element, 1 MiB down,
    /// in one submission; the download checked.
    Through(u32),
    /// 1 MiB up, then down, in one submission; the download checked.
    Transfers,
}

/// The pipeline rows and their goals on `lease / local`.
const PIPES: [(Pipe, Goal); 3] = [
    (Pipe::Kernel, Goal::AtLeast(0.9)),
    (Pipe::Through(FMA_ITERS), Goal::AtLeast(0.5)),
    (Pipe::Through(1), Goal::None),
];

fn pipe_metric(pc: &PoolConfig, pipe: Pipe) -> String {
    let what = match pipe {
        Pipe::Kernel => "kernel only (a ~0.5 ms kernel over 1 MiB the task keeps)",
        Pipe::Through(1) => "transfers only (1 MiB up, a one-FMA kernel, 1 MiB down)",
        Pipe::Through(_) => "1 MiB up + a ~0.5 ms kernel + 1 MiB down",
        Pipe::Transfers => "1 MiB up + 1 MiB down",
    };
    format!(
        "{} tasks x {} pipelines, {what}: pipelines/s, lease vs local pool",
        pc.tasks, pc.pipelines
    )
}

/// One task's data: its value, the 1 MiB of it it uploads, and the
/// buffer it keeps for the kernel-only row.
#[derive(Debug)]
struct Lane {
    value: f32,
    input: Arc<[f32]>,
    kept: Option<DeviceBuffer<f32>>,
}

/// `tasks` lanes; with `keep`, each one's input uploaded on `policy` and
/// kept.
async fn lanes<P: SchedulingPolicy>(
    policy: &Arc<P>,
    tasks: usize,
    keep: bool,
) -> Result<Vec<Lane>> {
    let mut v = Vec::with_capacity(tasks);
    for t in 0..tasks {
        // Small integers: exact in f32, and every task's differs.
        let value = (t % 64) as f32;
        let input: Arc<[f32]> = vec![value; PIPE_ELEMS].into();
        let kept = if keep {
            Some(h2d(input.clone()).schedule(&**policy)?.await?)
        } else {
            None
        };
        v.push(Lane { value, input, kept });
    }
    Ok(v)
}

/// Runs a task per lane on `policy`, each `pipelines` pipelines of `pipe`
/// one after the other, and waits for all: the wall time. The lanes come
/// back (with their kept buffers) when every task succeeded.
async fn run<P>(
    policy: &Arc<P>,
    fma: &Kernel,
    pipe: Pipe,
    lanes: &mut Vec<Lane>,
    pipelines: usize,
) -> Result<Duration>
where
    P: SchedulingPolicy + Send + Sync + 'static,
{
    let t = Instant::now();
    let tasks = lanes
        .drain(..)
        .map(|lane| {
            tokio::spawn(lane_task(
                policy.clone(),
                fma.clone(),
                pipe,
                lane,
                pipelines,
            ))
        })
        .collect();
    let back = joined(tasks).await?;
    let d = t.elapsed();
    *lanes = back;
    Ok(d)
}

/// One task: `pipelines` pipelines of `pipe` on `policy`, each awaited
/// (and its download checked) before the next.
async fn lane_task<P>(
    policy: Arc<P>,
    fma: Kernel,
    pipe: Pipe,
    mut lane: Lane,
    pipelines: usize,
) -> Result<Lane>
where
    P: SchedulingPolicy + Send + Sync + 'static,
{
    let n = PIPE_ELEMS as u32;
    let cfg = LaunchConfig::for_num_elems(n);
    for _ in 0..pipelines {
        match pipe {
            Pipe::Kernel => {
                let buf = lane.kept.take().ok_or("the task has no kept buffer")?;
                // SAFETY: fma_loop reads and writes y[0..n) of an n-float
                // buffer.
                let (buf, ..) = unsafe { launch(&fma, cfg, (buf, n, FMA_ITERS, 1.0f32, STEP)) }
                    .schedule(&*policy)?
                    .await?;
                lane.kept = Some(buf);
            }
            Pipe::Through(iters) => {
                let k = fma.clone();
                let out = h2d(lane.input.clone())
                    // SAFETY: as above.
                    .then(move |buf| unsafe { launch(&k, cfg, (buf, n, iters, 1.0f32, STEP)) })
                    .then(|(buf, ..)| d2h(buf))
                    .schedule(&*policy)?
                    .await?;
                check(&out, lane.value + iters as f32 * STEP)?;
            }
            Pipe::Transfers => {
                let out = h2d(lane.input.clone())
                    .then(d2h)
                    .schedule(&*policy)?
                    .await?;
                check(&out, lane.value)?;
            }
        }
    }
    Ok(lane)
}

/// Whether a pipeline's download is 1 MiB of `want` (its first and last
/// floats).
fn check(out: &HostBuffer<f32>, want: f32) -> Result<()> {
    let s = out.as_slice()?;
    match (s.len(), s.first(), s.last()) {
        (PIPE_ELEMS, Some(&a), Some(&b)) if a == want && b == want => Ok(()),
        (len, a, b) => Err(format!(
            "a pipeline downloaded {len} floats, {a:?} .. {b:?}, expected {PIPE_ELEMS} of {want}"
        )
        .into()),
    }
}

/// The pipelines' kernel awaited alone on a kept buffer, on the lease and
/// locally (on a detail line: the kernel's time, plus a submission's).
async fn kernel_alone(
    fma: &Kernel,
    remote: &Arc<RemotePolicy>,
    remote_lane: &mut Lane,
    local: &Arc<StreamPoolRoundRobin>,
    local_lane: &mut Lane,
) -> Result<()> {
    let r = time_kernel(remote, fma, remote_lane).await?;
    let l = time_kernel(local, fma, local_lane).await?;
    detail(format_args!(
        "the pipelines' kernel ({FMA_ITERS} FMAs per float over 1 MiB) awaited alone: \
         local {:.3} ms, lease {:.3} ms (medians)",
        median(times(Unit::Millis, &l)),
        median(times(Unit::Millis, &r))
    ));
    Ok(())
}

/// 20 awaited launches of the pipelines' kernel on `lane`'s kept buffer,
/// after 3 not kept.
async fn time_kernel<P>(policy: &Arc<P>, fma: &Kernel, lane: &mut Lane) -> Result<Vec<Duration>>
where
    P: SchedulingPolicy + Send + Sync + 'static,
{
    let mut v = Vec::new();
    for i in 0..23 {
        let one = Lane {
            value: lane.value,
            input: lane.input.clone(),
            kept: lane.kept.take(),
        };
        let t = Instant::now();
        let back = lane_task(policy.clone(), fma.clone(), Pipe::Kernel, one, 1).await?;
        let d = t.elapsed();
        lane.kept = back.kept;
        if i >= 3 {
            v.push(d);
        }
    }
    Ok(v)
}

/// The three pipeline rows: each round runs every row's pipelines on the
/// lease and locally, in alternating order; pipelines per second.
async fn pipeline_rows(
    pc: &PoolConfig,
    fma: &Kernel,
    remote: &Arc<RemotePolicy>,
    on_remote: &mut Vec<Lane>,
    local: &Arc<StreamPoolRoundRobin>,
    on_local: &mut Vec<Lane>,
) -> Result<Vec<Row>> {
    let count = (pc.tasks * pc.pipelines) as f64;
    let mut lease_rates: [Vec<f64>; 3] = Default::default();
    let mut local_rates: [Vec<f64>; 3] = Default::default();
    for round in 0..=pc.rounds {
        for (i, &(pipe, _)) in PIPES.iter().enumerate() {
            let lease_first = (round + i) % 2 == 0;
            for on_lease in [lease_first, !lease_first] {
                let d = if on_lease {
                    run(remote, fma, pipe, on_remote, pc.pipelines).await?
                } else {
                    run(local, fma, pipe, on_local, pc.pipelines).await?
                };
                if round > 0 {
                    let v = if on_lease {
                        &mut lease_rates
                    } else {
                        &mut local_rates
                    };
                    v[i].push(count / d.as_secs_f64());
                }
            }
        }
    }
    Ok(PIPES
        .iter()
        .zip(lease_rates.iter().zip(&local_rates))
        .map(|(&(pipe, goal), (lease, local))| {
            Row::new(GROUP, pipe_metric(pc, pipe), Unit::OpsPerSec)
                .raw(Summary::of(local))
                .lib(Summary::of(lease))
                .goal(goal)
                .note(
                    "the raw column is the local stream pool's (the default policy), not a raw \
                     driver's: both sides cuda-async",
                )
        })
        .collect())
}

/// Mid-size transfers from many tasks (1 MiB up and down per pipeline)
/// against one `h2d` then one `d2h` of `bytes`, all on the lease, round
/// by round; the local pool's rate of the same pipelines on a detail
/// line when there is a GPU here.
async fn transfer_row(
    pc: &PoolConfig,
    bytes: u64,
    fma: &Kernel,
    remote: &Arc<RemotePolicy>,
    on_remote: &mut Vec<Lane>,
    mut local: Option<(&Arc<StreamPoolRoundRobin>, &mut Vec<Lane>)>,
) -> Result<Row> {
    let moved = (pc.tasks * pc.pipelines) as u64 * 2 * PIPE_BYTES;
    let big: Arc<[u8]> = vec![0x5Au8; bytes as usize].into();
    let (mut pooled, mut pooled_local) = (Vec::new(), Vec::new());
    let (mut up, mut down) = (Vec::new(), Vec::new());
    for round in 0..=pc.rounds {
        let d = run(remote, fma, Pipe::Transfers, on_remote, pc.pipelines).await?;
        let t = Instant::now();
        let buf = h2d(big.clone()).schedule(&**remote)?.await?;
        let u = t.elapsed();
        let t = Instant::now();
        let back = d2h(&buf).schedule(&**remote)?.await?;
        let w = t.elapsed();
        drop(buf);
        if back.as_slice()?.last() != Some(&0x5A) {
            return Err("`d2h` returned other bytes than `h2d` wrote".into());
        }
        let l = match &mut local {
            Some((l, lanes)) => Some(run(l, fma, Pipe::Transfers, lanes, pc.pipelines).await?),
            None => None,
        };
        if round > 0 {
            pooled.push(gib_s(moved, d));
            up.push(u);
            down.push(w);
            pooled_local.extend(l.map(|l| gib_s(moved, l)));
        }
    }
    // One `h2d` then one `d2h` of `bytes`: 2 x `bytes` in their summed time.
    let single: Vec<f64> = up
        .iter()
        .zip(&down)
        .map(|(u, w)| gib_s(2 * bytes, *u + *w))
        .collect();
    let med = |v: &[Duration]| {
        let r: Vec<f64> = v.iter().map(|d| gib_s(bytes, *d)).collect();
        median(Summary::of(&r))
    };
    let size = size_label(bytes);
    let local_note = match Summary::of(&pooled_local) {
        Some(s) => format!(
            "; the same pipelines on the local pool: {:.2} GiB/s",
            s.median
        ),
        None => String::new(),
    };
    detail(format_args!(
        "{} tasks' 1 MiB transfers on the lease: {:.2} GiB/s; one {size} `h2d` {:.2} GiB/s, \
         `d2h` {:.2} GiB/s{local_note}",
        pc.tasks,
        median(Summary::of(&pooled)),
        med(&up),
        med(&down)
    ));
    Ok(Row::new(
        GROUP,
        format!(
            "mid-size transfers from {} tasks ({} pipelines each of 1 MiB up + 1 MiB down) vs one \
             `h2d` then one `d2h` of {size}, on a lease",
            pc.tasks, pc.pipelines
        ),
        Unit::GiBps,
    )
    .raw(Summary::of(&single))
    .lib(Summary::of(&pooled))
    .goal(Goal::AtLeast(0.6))
    .note(format!(
        "both sides the lease (default client): the raw column moves 2 x {size} in one `h2d` \
         ({:.2} GiB/s) and one `d2h` ({:.2} GiB/s){local_note}",
        med(&up),
        med(&down)
    )))
}

fn median(s: Option<Summary>) -> f64 {
    s.map_or(f64::NAN, |s| s.median)
}

/// `d` in words (`1 s`, `50 ms`).
fn duration_label(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{} ms", d.as_millis())
    }
}
