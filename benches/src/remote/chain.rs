//! The rows of awaited ops on a lease through cuda-async's remote backend:
//! the 20-op chain, one launch on kept buffers, `h2d` / `d2h` of the bulk
//! size and (with a GPU) a `zip` of two 1 ms spins; remote against local
//! where a GPU is here, both against the raw round trip.
//!
//! The chain and launch rows measure their own raw round trips (64 B, and a
//! request/reply of the chain's sizes) interleaved with the remote and the
//! local path, in blocks of each in turn, so all of them see the same host.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::raw::RawQuinn;
use cuda_async::prelude::*;
use cuda_async::{DeviceBuffer, HostBuffer, Kernel, Module, RemotePolicy, StreamPoolRoundRobin};
use cuda_lease::client::{Client, Lease};
use cuda_lease::remote::LeaseBackend;
use cuda_lease::stamps::{self, stamp, Point};

use super::baselines::Raw;
use super::{detail, detail_steps, difference, rates, size_label, times, Ctx};
use crate::report::{Goal, Row, Unit};
use crate::stats::Summary;
use crate::Result;

/// About the bytes the 20-op chain's message carries (29 commands, about 1.3 kB
/// of body, plus 1 KiB written and the header) and its reply (1 KiB read,
/// plus the reply's header and body).
const CHAIN_OUT: usize = 2320;
const CHAIN_BACK: usize = 1060;
/// About the bytes a run of the chain prepared on the node carries (one
/// command and the 1 KiB input, about 30 B of body, plus the header); its
/// reply is the chain's.
const PREPARED_OUT: usize = 1080;
/// Runs of one path in a row in the chain rows' measurement.
const CHAIN_BLOCK: usize = 25;
/// Runs dropped at the start of each block.
const CHAIN_SETTLE: usize = 5;
/// At most this many chains per path are kept in the `remote` topic.
const CHAIN_ITERS: usize = 500;

/// The 20-op chain's kernel.
const AXPY: &str = r#"
extern "C" __global__ void axpy(float a, const float* x, float* y, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"#;

/// h2d, zeros, 17 launches, d2h: 20 ops, one submission.
fn chain(axpy: &Kernel, x: Arc<Vec<f32>>) -> impl DeviceOp<Output = HostBuffer<f32>> {
    chain_body(axpy, x).then(|(_, y)| d2h(y))
}

/// The chain's h2d, zeros and 17 launches (what a graph of it captures;
/// its d2h follows each replay).
type Pair = (Arc<DeviceBuffer<f32>>, DeviceBuffer<f32>);

fn chain_body(axpy: &Kernel, x: Arc<Vec<f32>>) -> cuda_async::combinators::BoxedOp<'static, Pair> {
    let n = x.len() as u32;
    let mut op = h2d(x.to_vec())
        .map(Arc::new)
        .zip(zeros::<f32>(n as usize))
        .boxed();
    for _ in 0..17 {
        let k = axpy.clone();
        op = op
            // SAFETY: axpy touches x[0..n) and y[0..n); both hold n floats.
            .then(move |(x, y)| unsafe {
                launch(
                    &k,
                    cuda_async::LaunchConfig::for_num_elems(n),
                    (0.5f32, x, y, n),
                )
            })
            .map(|(_, x, y, _)| (x, y))
            .boxed();
    }
    op
}

/// One replay of a graph of the chain's body and the download of its
/// output, awaited on `policy` (checked), timed.
async fn one_replay<P: SchedulingPolicy + ?Sized>(
    label: &str,
    policy: &P,
    graph: &cuda_async::CudaGraph<Pair>,
    x: &Arc<Vec<f32>>,
) -> Result<Duration> {
    stamp(Point::Start);
    let t = Instant::now();
    let op = graph
        .launch()
        .then(|()| d2h(&graph.output().1))
        .schedule(policy)?;
    let out = op.await?;
    let d = t.elapsed();
    stamp(Point::End);
    if out.as_slice()?[1] != 17.0 * 0.5 * x[1] {
        return Err(format!("the chain graph's result on the {label} path is wrong").into());
    }
    Ok(d)
}

/// One run of the chain prepared on the node with input `x`, awaited
/// (checked), timed.
async fn one_prepared(
    remote: &RemotePolicy,
    prepared: &cuda_async::remote::Prepared,
    x: &Arc<Vec<f32>>,
) -> Result<Duration> {
    stamp(Point::Start);
    let t = Instant::now();
    let out = prepared.run(&[&x[..]])?.schedule(remote)?.await?;
    let d = t.elapsed();
    stamp(Point::End);
    if out.to_vec::<f32>(0)?[1] != 17.0 * 0.5 * x[1] {
        return Err("the prepared chain's result is wrong".into());
    }
    Ok(d)
}

/// The awaited 20-op chain, remote and (with a GPU) local, one awaited
/// launch, `h2d` and `d2h` of the bulk size, and (with a GPU) one remote
/// 1 ms spin and a remote zip of two.
#[derive(Debug)]
pub(super) struct ChainRows {
    times: ChainTimes,
    spins: Option<(Vec<Duration>, Vec<Duration>)>,
    /// The bulk size and the times of awaited `h2d` and `d2h` of it: with
    /// the default client (both over the bulk-data channel), then with the
    /// channel off (both over striped QUIC).
    bytes: u64,
    up: Vec<Duration>,
    down: Vec<Duration>,
    up_quic: Vec<Duration>,
    down_quic: Vec<Duration>,
    /// One awaited launch on kept buffers: remote, and local with a GPU.
    op_remote: Vec<Duration>,
    op_local: Option<Vec<Duration>>,
    /// Submissions of 1 and of [`MANY`] launches: remote, then local.
    per_launch: [Vec<Duration>; 4],
}

/// One awaited `axpy` launch on buffers made beforehand, `iters` times
/// after 50 not kept.
async fn time_one_op<P: SchedulingPolicy>(
    policy: &P,
    axpy: &Kernel,
    iters: usize,
) -> Result<Vec<Duration>> {
    let mut kept = KeptLaunch::new(policy, axpy).await?;
    let mut v = Vec::with_capacity(iters);
    for i in 0..iters + 50 {
        let d = kept.time(policy).await?;
        if i >= 50 {
            v.push(d);
        }
    }
    Ok(v)
}

/// One `axpy` launch on buffers made beforehand, timed awaited.
struct KeptLaunch {
    axpy: Kernel,
    x: Arc<DeviceBuffer<f32>>,
    y: Option<DeviceBuffer<f32>>,
}

impl KeptLaunch {
    const N: u32 = 256;

    async fn new<P: SchedulingPolicy + ?Sized>(policy: &P, axpy: &Kernel) -> Result<Self> {
        let n = Self::N as usize;
        Ok(KeptLaunch {
            axpy: axpy.clone(),
            x: Arc::new(h2d(vec![1.0f32; n]).schedule(policy)?.await?),
            y: Some(zeros::<f32>(n).schedule(policy)?.await?),
        })
    }

    async fn time<P: SchedulingPolicy + ?Sized>(&mut self, policy: &P) -> Result<Duration> {
        stamp(Point::Start);
        let t = Instant::now();
        // SAFETY: axpy touches x[0..n) and y[0..n); both hold n floats.
        let fut = unsafe {
            launch(
                &self.axpy,
                cuda_async::LaunchConfig::for_num_elems(Self::N),
                (0.5f32, self.x.clone(), self.y.take().expect("y"), Self::N),
            )
        }
        .schedule(policy)?;
        let (_, _, back, _) = fut.await?;
        let d = t.elapsed();
        stamp(Point::End);
        self.y = Some(back);
        Ok(d)
    }
}

/// Launches in the long submission of the per-launch row.
const MANY: u32 = 100;

impl KeptLaunch {
    /// `count` `axpy` launches chained in one submission on the kept
    /// buffers, timed awaited.
    async fn time_many<P: SchedulingPolicy + ?Sized>(
        &mut self,
        policy: &P,
        count: u32,
    ) -> Result<Duration> {
        let cfg = cuda_async::LaunchConfig::for_num_elems(Self::N);
        let one = |k: Kernel, x, y| {
            // SAFETY: axpy touches x[0..n) and y[0..n); both hold n floats.
            unsafe { launch(&k, cfg, (0.5f32, x, y, Self::N)) }.map(|(_, x, y, _)| (x, y))
        };
        let t = Instant::now();
        let mut op = one(self.axpy.clone(), self.x.clone(), self.y.take().expect("y")).boxed();
        for _ in 1..count {
            let k = self.axpy.clone();
            op = op.then(move |(x, y)| one(k, x, y)).boxed();
        }
        let (_, back) = op.schedule(policy)?.await?;
        let d = t.elapsed();
        self.y = Some(back);
        Ok(d)
    }
}

/// What one more launch in a submission costs: submissions of 1 and of
/// [`MANY`] chained launches on kept buffers, remote and (with a GPU)
/// local, in interleaved blocks, `iters` of each kept. Returns the four
/// sets of times: remote 1, remote many, local 1, local many.
async fn per_launch_times(
    remote: &RemotePolicy,
    local: Option<&StreamPoolRoundRobin>,
    axpy: &Kernel,
    iters: usize,
) -> Result<[Vec<Duration>; 4]> {
    let mut on_remote = KeptLaunch::new(remote, axpy).await?;
    let mut on_local = match local {
        Some(l) => Some(KeptLaunch::new(l, axpy).await?),
        None => None,
    };
    let mut v: [Vec<Duration>; 4] = Default::default();
    for (path, keep) in interleaved(iters, 4) {
        let count = if path % 2 == 0 { 1 } else { MANY };
        let d = match (path, &mut on_local, local) {
            (0 | 1, _, _) => on_remote.time_many(remote, count).await?,
            (_, Some(k), Some(l)) => k.time_many(l, count).await?,
            _ => continue,
        };
        if keep {
            v[path].push(d);
        }
    }
    Ok(v)
}

/// The per-launch row: `(t(MANY) - t(1)) / (MANY - 1)` of the medians, the
/// remote path against the local one (or remote alone, with no GPU here).
fn per_launch_row(group: &'static str, t: &[Vec<Duration>; 4]) -> Row {
    let per = |one: &[Duration], many: &[Duration]| {
        let (one, many) = (times(Unit::Micros, one)?, times(Unit::Micros, many)?);
        Some(difference(many, one).scaled(1.0 / f64::from(MANY - 1)))
    };
    let remote = per(&t[0], &t[1]);
    let what = format!(
        "one more launch in a submission, (t({MANY} chained launches) - t(1)) / {}",
        MANY - 1
    );
    match per(&t[2], &t[3]) {
        Some(local) => Row::new(
            group,
            format!("{what}: remote (node and worker) vs local eager (interleaved)"),
            Unit::Micros,
        )
        .raw(Some(local))
        .lib(remote)
        .goal(Goal::AtMost(1.3))
        .note("the raw column is the local path's, not a raw driver's: both sides cuda-async"),
        // No local GPU: against a whole one-launch submission (what one
        // more launch costs next to a round trip).
        None => Row::new(
            group,
            format!("{what}, remote (no local GPU), vs a whole one-launch remote submission"),
            Unit::Micros,
        )
        .raw(times(Unit::Micros, &t[0]))
        .lib(remote),
    }
}

/// Awaited `h2d` of a `Vec` and `d2h` of `size` bytes, as a user writes
/// them, on a lease of the client with the default stripes and data path,
/// `iters` of each after one not kept.
async fn transfer_ops(
    client: &Arc<Client>,
    size: u64,
    iters: usize,
) -> Result<(Vec<Duration>, Vec<Duration>)> {
    let lease = Lease::builder()
        .min_vram(size + (64 << 20))
        .ttl(Duration::from_secs(120))
        .on(client.clone())
        .await?;
    let policy = RemotePolicy::new(&LeaseBackend::current(lease.session()));
    let remote = &policy;
    let data = vec![7u8; size as usize];
    let (mut up, mut down) = (Vec::new(), Vec::new());
    for i in 0..=iters {
        let input = data.clone();
        let t = Instant::now();
        let buf = h2d(input).schedule(remote)?.await?;
        let u = t.elapsed();
        let t = Instant::now();
        let back = d2h(&buf).schedule(remote)?.await?;
        let d = t.elapsed();
        if back.as_slice()?[size as usize - 1] != 7 {
            return Err("`d2h` returned other bytes than `h2d` wrote".into());
        }
        if i > 0 {
            up.push(u);
            down.push(d);
        }
    }
    drop(policy);
    lease.free().await?;
    Ok((up, down))
}

const SPIN: &str = r#"
extern "C" __global__ void spin(unsigned long long ns, unsigned long long* stamps) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    t = t0;
    while (t - t0 < ns) { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); }
    if (threadIdx.x == 0 && blockIdx.x == 0) { stamps[0] = t0; stamps[1] = t; }
}
"#;

fn spin_op(k: &Kernel) -> impl DeviceOp<Output = HostBuffer<u64>> {
    let k = k.clone();
    zeros::<u64>(2)
        // SAFETY: spin writes stamps[0..2) of a 2-element buffer.
        .then(move |s| unsafe {
            launch(
                &k,
                cuda_async::LaunchConfig::for_num_elems(1),
                (1_000_000u64, s),
            )
        })
        .then(|(_, s)| d2h(s))
}

/// One remote 1 ms spin and a remote zip of two, 50 of each after 10 not
/// kept.
async fn spin_rows(remote: &RemotePolicy) -> Result<(Vec<Duration>, Vec<Duration>)> {
    let k = Module::cuda(SPIN, &[])?.kernel("spin")?;
    let (mut one, mut two) = (Vec::new(), Vec::new());
    for i in 0..60 {
        let t = Instant::now();
        spin_op(&k).schedule(remote)?.await?;
        let a = t.elapsed();
        let t = Instant::now();
        spin_op(&k).zip(spin_op(&k)).schedule(remote)?.await?;
        let b = t.elapsed();
        if i >= 10 {
            one.push(a);
            two.push(b);
        }
    }
    Ok((one, two))
}

/// One awaited chain on `policy` (checked), timed.
async fn one_chain<P: SchedulingPolicy + ?Sized>(
    label: &str,
    policy: &P,
    axpy: &Kernel,
    x: &Arc<Vec<f32>>,
) -> Result<Duration> {
    stamp(Point::Start);
    let t = Instant::now();
    let out = chain(axpy, x.clone()).schedule(policy)?.await?;
    let d = t.elapsed();
    stamp(Point::End);
    if out.as_slice()?[1] != 17.0 * 0.5 * x[1] {
        return Err(format!("the chain's result on the {label} path is wrong").into());
    }
    Ok(d)
}

/// The chain rows' four paths, measured interleaved so they see the same
/// host: the raw 64 B round trip, a raw request/reply of the chain's sizes,
/// the chain on the lease and (with a GPU) on the local GPU. Each round
/// runs a block of [`CHAIN_BLOCK`] of each path, in rotating order, and
/// drops the first [`CHAIN_SETTLE`] of each block: one of each in turn
/// made every path pay for the one before it (the GPU switching between
/// the worker's and this process's contexts, and the worker's pipe spin).
#[derive(Debug)]
struct ChainTimes {
    rtt: Vec<Duration>,
    sized: Vec<Duration>,
    remote: Vec<Duration>,
    local: Option<Vec<Duration>>,
    /// A graph of the chain's body replayed, then its output downloaded:
    /// kept on the lease's node, and (with a GPU) local.
    replay_remote: Vec<Duration>,
    replay_local: Option<Vec<Duration>>,
    /// The chain prepared on the node, run again with its input; a raw
    /// request/reply of that run's sizes.
    prepared: Vec<Duration>,
    prepared_sized: Vec<Duration>,
}

/// The order of an interleaved measurement of `paths` paths: rounds of a
/// block of [`CHAIN_BLOCK`] of each path, the paths in rotating order, as
/// `(path, keep)`; enough rounds to keep `iters` of each. Not kept: the
/// first round (it warms everything up) and the first [`CHAIN_SETTLE`] of
/// each block.
pub(super) fn interleaved(iters: usize, paths: usize) -> impl Iterator<Item = (usize, bool)> {
    let rounds = iters.div_ceil(CHAIN_BLOCK - CHAIN_SETTLE) + 1;
    (0..rounds).flat_map(move |round| {
        (0..paths).flat_map(move |k| {
            (0..CHAIN_BLOCK).map(move |j| ((round + k) % paths, round > 0 && j >= CHAIN_SETTLE))
        })
    })
}

/// [`interleaved`] over `paths` paths timed (stamping off), then, when
/// `stamped`, a shorter pass (at most [`CHAIN_ITERS`]) of the `lease`
/// paths alone with stamping on, for their steps: `(path, keep, stamping)`.
pub(super) fn timed_then_stamped(
    iters: usize,
    paths: usize,
    stamped: bool,
    lease: &'static [usize],
) -> impl Iterator<Item = (usize, bool, bool)> {
    let again = if stamped { iters.min(CHAIN_ITERS) } else { 0 };
    let timed = interleaved(iters, paths).map(|(p, k)| (p, k, false));
    let steps = interleaved(again, paths)
        .filter(move |(p, _)| lease.contains(p))
        .map(|(p, k)| (p, k, true));
    timed.chain(steps)
}

async fn chain_times(
    remote: &RemotePolicy,
    local: Option<&StreamPoolRoundRobin>,
    axpy: &Kernel,
    iters: usize,
    stamped: bool,
) -> Result<ChainTimes> {
    let x = Arc::new(vec![2.0f32; 256]);
    let raw = RawQuinn::start(1).await?;
    let kept = chain_body(axpy, x.clone())
        .graph_with_async(remote)?
        .await?;
    let local_graph = match local {
        Some(_) => Some(chain_body(axpy, x.clone()).graph()?),
        None => None,
    };
    let prepared = chain(axpy, x.clone()).prepare().schedule(remote)?.await?;
    let mut v: [Vec<Duration>; 8] = Default::default();
    let mut steps: [Vec<_>; 3] = Default::default();
    for (path, keep, stamping) in timed_then_stamped(iters, 8, stamped, &[2, 4, 7]) {
        stamps::set_enabled(stamping);
        stamps::clear();
        let d = match (path, local, &local_graph) {
            (0, _, _) => raw.round_trip(64).await?,
            (1, _, _) => raw.request_reply(CHAIN_OUT, CHAIN_BACK).await?,
            (2, _, _) => one_chain("remote", remote, axpy, &x).await?,
            (3, Some(l), _) => one_chain("local", l, axpy, &x).await?,
            (4, _, _) => one_replay("remote", remote, &kept, &x).await?,
            (5, Some(l), Some(g)) => one_replay("local", l, g, &x).await?,
            (6, _, _) => raw.request_reply(PREPARED_OUT, CHAIN_BACK).await?,
            (7, _, _) => one_prepared(remote, &prepared, &x).await?,
            _ => continue,
        };
        match (keep, stamping, path) {
            (true, false, _) => v[path].push(d),
            (true, true, 2) => steps[0].push(stamps::take()),
            (true, true, 4) => steps[1].push(stamps::take()),
            (true, true, 7) => steps[2].push(stamps::take()),
            _ => {}
        }
    }
    stamps::set_enabled(false);
    raw.close().await;
    let [chain_steps, replay_steps, prepared_steps] = steps;
    detail_steps("20-op chain awaited on the lease", &chain_steps);
    detail_steps(
        "20-op chain replayed from a graph kept on the node",
        &replay_steps,
    );
    detail_steps(
        "20-op chain run again, prepared on the node",
        &prepared_steps,
    );
    let [rtt, sized, remote, local, replay_remote, replay_local, prepared_sized, prepared] = v;
    Ok(ChainTimes {
        rtt,
        sized,
        remote,
        local: (!local.is_empty()).then_some(local),
        replay_remote,
        replay_local: (!replay_local.is_empty()).then_some(replay_local),
        prepared,
        prepared_sized,
    })
}

/// `remote_chain`: the raw 64 B round trip and the chain rows alone (no
/// bulk transfers), e.g. to profile the node's command path.
pub(super) async fn chain_only(ctx: &Ctx) -> Result<Vec<Row>> {
    let setup = ChainSetup::new(ctx, 64 << 20, ctx.cfg.iters).await?;
    setup.lease.free().await?;
    Ok(chain_rows("remote_chain", &setup.times))
}

/// `remote_launch`: one awaited launch on kept buffers, remote and (with a
/// GPU) local, against the raw 64 B round trip, interleaved in blocks as
/// the chain rows are: the submission's fixed cost, with no bulk bytes;
/// then the per-launch row.
pub(super) async fn launch_only(ctx: &Ctx) -> Result<Vec<Row>> {
    let axpy = Module::cuda(AXPY, &[])?.kernel("axpy")?;
    let lease = Lease::builder()
        .min_vram(64 << 20)
        .ttl(Duration::from_secs(120))
        .on(ctx.client.clone())
        .await?;
    let remote = RemotePolicy::new(&LeaseBackend::current(lease.session()));
    let local = local_policy(&axpy, ctx.cfg.memory())?;
    let raw = RawQuinn::start(1).await?;
    let mut on_remote = KeptLaunch::new(&remote, &axpy).await?;
    let mut on_local = match &local {
        Some(l) => Some(KeptLaunch::new(l.as_ref(), &axpy).await?),
        None => None,
    };
    let mut v: [Vec<Duration>; 3] = Default::default();
    let mut launch_steps = Vec::new();
    for (path, keep, stamping) in timed_then_stamped(ctx.cfg.iters, 3, ctx.cfg.stamps, &[1]) {
        stamps::set_enabled(stamping);
        stamps::clear();
        let d = match path {
            0 => raw.round_trip(64).await?,
            1 => on_remote.time(&remote).await?,
            _ => match (&mut on_local, &local) {
                (Some(k), Some(l)) => k.time(l.as_ref()).await?,
                _ => continue,
            },
        };
        match (keep, stamping) {
            (true, false) => v[path].push(d),
            (true, true) => launch_steps.push(stamps::take()),
            _ => {}
        }
    }
    stamps::set_enabled(false);
    raw.close().await;
    detail_steps("one awaited launch on the lease", &launch_steps);
    drop((on_remote, on_local));
    let per_launch =
        per_launch_times(&remote, local.as_deref(), &axpy, ctx.cfg.iters.min(200)).await?;
    lease.free().await?;
    let [rtt, r, l] = v;
    let local = (!l.is_empty()).then_some(l.as_slice());
    Ok(vec![
        launch_row("remote_launch", true, &rtt, &r, local),
        per_launch_row("remote_launch", &per_launch),
    ])
}

/// One awaited launch: remote - local (or remote alone, with no local
/// GPU) against the raw 64 B round trip.
fn launch_row(
    group: &'static str,
    interleaved: bool,
    rtt: &[Duration],
    remote: &[Duration],
    local: Option<&[Duration]>,
) -> Row {
    let rtt = times(Unit::Micros, rtt);
    let remote = times(Unit::Micros, remote);
    let how = if interleaved { "interleaved; " } else { "" };
    match (local.and_then(|l| times(Unit::Micros, l)), remote) {
        (Some(l), Some(r)) => Row::new(
            group,
            format!(
                "one awaited launch: remote - local vs 64 B request/reply{}",
                if interleaved { " (interleaved)" } else { "" }
            ),
            Unit::Micros,
        )
        .raw(rtt)
        .lib(Some(difference(r, l)))
        .note(remote_local_note(r, l)),
        _ => Row::new(
            group,
            format!("one awaited launch on the lease vs 64 B request/reply ({how}no local GPU: remote alone)"),
            Unit::Micros,
        )
        .raw(rtt)
        .lib(remote),
    }
}

fn remote_local_note(r: Summary, l: Summary) -> String {
    format!(
        "cuda-async column: remote {:.1} us - local {:.1} us",
        r.median, l.median
    )
}

/// A lease of `vram` bytes with its remote policy, the kernel, and the
/// chain rows' times measured on them.
struct ChainSetup {
    axpy: Kernel,
    lease: Lease,
    remote: RemotePolicy,
    times: ChainTimes,
}

impl ChainSetup {
    async fn new(ctx: &Ctx, vram: u64, iters: usize) -> Result<Self> {
        let axpy = Module::cuda(AXPY, &[])?.kernel("axpy")?;
        let lease = Lease::builder()
            .min_vram(vram)
            .ttl(Duration::from_secs(120))
            .on(ctx.client.clone())
            .await?;
        let remote = RemotePolicy::new(&LeaseBackend::current(lease.session()));
        let local = local_policy(&axpy, ctx.cfg.memory())?;
        let times = chain_times(&remote, local.as_deref(), &axpy, iters, ctx.cfg.stamps).await?;
        Ok(ChainSetup {
            axpy,
            lease,
            remote,
            times,
        })
    }
}

/// GPU 0's default policy with `axpy` loaded; `None` with the memory
/// device (no GPU here).
fn local_policy(axpy: &Kernel, memory: bool) -> Result<Option<Arc<StreamPoolRoundRobin>>> {
    if memory {
        return Ok(None);
    }
    axpy.load_on(&cuda_async::Device::new(0)?)?;
    Ok(Some(cuda_async::default_policy()?))
}

/// The chain rows: remote - local against the raw 64 B round trip and
/// against a raw request/reply of the chain's sizes, and that floor
/// itself; with no local GPU, the remote chain against the round trip.
fn chain_rows(group: &'static str, t: &ChainTimes) -> Vec<Row> {
    let us = |v: &[Duration]| times(Unit::Micros, v);
    let (rtt, sized, remote) = (us(&t.rtt), us(&t.sized), us(&t.remote));
    detail(format_args!(
        "20-op chain awaited on the lease: median {:.1} us; raw 64 B request/reply {:.1} us, \
         of the chain's sizes ({CHAIN_OUT} B / {CHAIN_BACK} B) {:.1} us (interleaved)",
        remote.map_or(f64::NAN, |s| s.median),
        rtt.map_or(f64::NAN, |s| s.median),
        sized.map_or(f64::NAN, |s| s.median),
    ));
    let mut rows = match (t.local.as_deref().and_then(us), remote) {
        (Some(l), Some(r)) => {
            let diff = difference(r, l);
            vec![
                Row::new(
                    group,
                    "20-op chain (h2d, zeros, 17 launches, d2h) awaited: remote - local vs 64 B request/reply (interleaved)",
                    Unit::Micros,
                )
                .raw(rtt)
                .lib(Some(diff))
                .goal(Goal::AtMost(1.2))
                .goal_from("issue 22")
                .note(remote_local_note(r, l)),
                Row::new(
                    group,
                    format!("20-op chain: remote - local vs a raw request/reply of the chain's own sizes ({CHAIN_OUT} B / {CHAIN_BACK} B)"),
                    Unit::Micros,
                )
                .raw(sized)
                .lib(Some(diff))
                .goal(Goal::AtMost(1.35))
                .goal_from("issue 61"),
                // What the first row cannot go below: moving the chain's
                // own bytes (its upload and download) with no work at all.
                Row::new(
                    group,
                    "20-op chain floor: a raw request/reply of the chain's sizes vs 64 B (the first row with no client, node or worker work)",
                    Unit::Micros,
                )
                .raw(rtt)
                .lib(sized)
                .note("both sides raw quinn"),
            ]
        }
        _ => vec![Row::new(
            group,
            "20-op chain awaited remotely vs 64 B request/reply (no local GPU: remote alone)",
            Unit::Micros,
        )
        .raw(rtt)
        .lib(remote)],
    };
    rows.push(replay_row(group, t));
    rows.push(prepared_row(group, t));
    rows
}

/// The chain prepared on the node and run again with its input: remote -
/// local or remote alone, against a raw request/reply of the run's own
/// sizes. The local side is the chain's graph replayed and its output
/// downloaded: the same GPU work at the cost of one launch, as a prepared
/// run has none of the client's recording; the local eager chain pays its
/// ops' enqueueing on the host, which the remote side would be credited.
fn prepared_row(group: &'static str, t: &ChainTimes) -> Row {
    let us = |v: &[Duration]| times(Unit::Micros, v);
    let (sized, remote) = (us(&t.prepared_sized), us(&t.prepared));
    let what = format!(
        "20-op chain sent again as a prepared submission: remote (prepared) - local (graph replay) vs a raw request/reply of the run's own sizes ({PREPARED_OUT} B / {CHAIN_BACK} B)"
    );
    match (t.replay_local.as_deref().and_then(us), remote) {
        (Some(l), Some(r)) => Row::new(group, what, Unit::Micros)
            .raw(sized)
            .lib(Some(difference(r, l)))
            .goal(Goal::AtMost(1.2))
            .goal_from("issue 61")
            .note(remote_local_note(r, l)),
        _ => Row::new(
            group,
            format!("20-op chain run again as a prepared submission vs a raw request/reply of its own sizes ({PREPARED_OUT} B / {CHAIN_BACK} B; no local GPU: remote alone)"),
            Unit::Micros,
        )
        .raw(sized)
        .lib(remote),
    }
}

/// A graph of the chain's body replayed, then its output downloaded, one
/// submission: remote - local (or remote alone) against the raw 64 B
/// round trip.
fn replay_row(group: &'static str, t: &ChainTimes) -> Row {
    let us = |v: &[Duration]| times(Unit::Micros, v);
    let (rtt, remote) = (us(&t.rtt), us(&t.replay_remote));
    match (t.replay_local.as_deref().and_then(us), remote) {
        (Some(l), Some(r)) => Row::new(
            group,
            "20-op chain replayed from a graph, then downloaded (one submission): remote (kept on the node) - local vs 64 B request/reply (interleaved)",
            Unit::Micros,
        )
        .raw(rtt)
        .lib(Some(difference(r, l)))
        .goal(Goal::AtMost(1.25))
        .goal_from("issue 61")
        .note(remote_local_note(r, l)),
        _ => Row::new(
            group,
            "20-op chain replayed from a graph kept on the node, then downloaded, vs 64 B request/reply (no local GPU: remote alone)",
            Unit::Micros,
        )
        .raw(rtt)
        .lib(remote),
    }
}

/// The `remote` topic's rows of awaited ops: the chain rows, one awaited
/// launch, `h2d` / `d2h` against raw one connection, the spins.
pub(super) fn rows(group: &'static str, c: &ChainRows, raw: &Raw) -> Vec<Row> {
    let mut rows = chain_rows(group, &c.times);
    rows.push(launch_row(
        group,
        false,
        &raw.rtt,
        &c.op_remote,
        c.op_local.as_deref(),
    ));
    rows.push(per_launch_row(group, &c.per_launch));
    let size = size_label(c.bytes);
    // What a user gets by default (the data path, striped): against one
    // raw quinn connection with quinn's defaults, and against TCP.
    for (op, lib) in [("h2d", &c.up), ("d2h", &c.down)] {
        let (quinn, tcp, dir) = if op == "h2d" {
            (&raw.default.up, &raw.tcp.up, "up")
        } else {
            (&raw.default.down, &raw.tcp.down, "down")
        };
        rows.push(
            Row::new(
                group,
                format!(
                    "`{op}` {size} awaited on a lease (default client) vs raw quinn one connection \
                     {dir}, quinn's defaults"
                ),
                Unit::GiBps,
            )
            .raw(rates(c.bytes, quinn))
            .lib(rates(c.bytes, lib))
            .goal(Goal::AtLeast(2.0))
            .goal_from("issue 39"),
        );
        rows.push(
            Row::new(
                group,
                format!(
                    "`{op}` {size} awaited on a lease (default client) vs TCP on loopback {dir}"
                ),
                Unit::GiBps,
            )
            .raw(rates(c.bytes, tcp))
            .lib(rates(c.bytes, lib))
            .goal(Goal::AtLeast(0.6))
            .goal_from("issue 39"),
        );
    }
    // The two data paths against each other: what decides the default
    // `BulkUse::Large` for transfers of this size.
    let note = "both sides cuda-lease: the default client in the cuda-async column, the same with \
                `BulkUse::Off` in the raw column";
    for (op, quic, bulk) in [("h2d", &c.up_quic, &c.up), ("d2h", &c.down_quic, &c.down)] {
        rows.push(
            Row::new(
                group,
                format!(
                    "`{op}` {size} awaited on a lease: bulk-data channel (TLS over TCP) vs \
                     QUIC, both striped"
                ),
                Unit::GiBps,
            )
            .raw(rates(c.bytes, quic))
            .lib(rates(c.bytes, bulk))
            .note(note),
        );
    }
    if let Some((one, two)) = &c.spins {
        rows.push(
            Row::new(
                group,
                "remote `zip` of two 1 ms spins vs one remote 1 ms spin (each awaited)",
                Unit::Millis,
            )
            .raw(times(Unit::Millis, one))
            .lib(times(Unit::Millis, two))
            .goal(Goal::AtMost(1.15))
            .goal_from("issue 23")
            .note("both sides remote: one spin in the raw column, the zip of two in the cuda-async column"),
        );
    }
    rows
}

/// The `remote` topic's awaited ops: the chain rows (at most
/// [`CHAIN_ITERS`] of each path), `h2d` / `d2h` of the bulk size (3 of
/// each), one awaited launch remote and local, and with a GPU the spins.
pub(super) async fn chain_bench(ctx: &Ctx) -> Result<ChainRows> {
    let (iters, memory, bytes) = (ctx.cfg.iters, ctx.cfg.memory(), ctx.cfg.bytes);
    let ChainSetup {
        axpy,
        lease,
        remote,
        times,
    } = ChainSetup::new(ctx, 2 * bytes + (64 << 20), iters.min(CHAIN_ITERS)).await?;
    let (up, down) = transfer_ops(&ctx.striped, bytes, 3).await?;
    let (up_quic, down_quic) = transfer_ops(&ctx.quic_striped, bytes, 3).await?;
    let op_remote = time_one_op(&remote, &axpy, iters).await?;
    let spins = if memory {
        None
    } else {
        Some(spin_rows(&remote).await?)
    };
    let op_local = if memory {
        None
    } else {
        Some(time_one_op(&*cuda_async::default_policy()?, &axpy, iters).await?)
    };
    let local = local_policy(&axpy, memory)?;
    let per_launch = per_launch_times(&remote, local.as_deref(), &axpy, iters.min(200)).await?;
    lease.free().await?;
    Ok(ChainRows {
        times,
        spins,
        bytes,
        up,
        down,
        up_quic,
        down_quic,
        op_remote,
        op_local,
        per_launch,
    })
}
