//! [`Fixture`]: the device, kernels and streams every comparison uses, and
//! one iteration of each measured path, raw and through `cuda-async`. The
//! criterion benches and the report both call these, so they measure the
//! same code.

use std::future::IntoFuture;
use std::sync::Arc;

use cuda_async::cudarc::driver::{sys, CudaStream};
use cuda_async::prelude::*;
use cuda_async::{
    CompletionMode, Device, DeviceBuffer, DeviceInfo, PinnedBuffer, StreamPoolRoundRobin,
};

use crate::kernels::{Kernels, ONE_THREAD, SPIN_NS};
use crate::raw::{
    self, RawDeviceMem, RawForkJoin, RawGraph, RawHostFnFuture, RawPinned, RawStreams,
};
use crate::Result;

/// How many raw streams the raw paths round-robin over: the size of the
/// library's default pool (`cuda_async::policy::DEFAULT_POOL_STREAMS`).
pub const RAW_STREAMS: usize = 4;

/// The completion modes compared side by side.
pub const COMPLETION_MODES: [CompletionMode; 4] = [
    CompletionMode::HostCallback,
    CompletionMode::Reactor,
    CompletionMode::ReactorInlineSpin(std::time::Duration::from_micros(10)),
    CompletionMode::ReactorInlineSpin(std::time::Duration::from_micros(20)),
];

/// Which way one empty kernel is awaited (or waited for).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AwaitPath {
    /// Raw launch + `cuStreamSynchronize`, blocking the polling thread (the
    /// floor: what completion costs without any callback).
    RawSync,
    /// Raw launch + the minimal `cuLaunchHostFunc` + `AtomicWaker` future.
    RawHostFn,
    /// `launch(&empty, ..).await` on the default policy (`DeviceFuture`).
    Lib,
    /// The same, scheduled on the default pool with this completion mode.
    Mode(CompletionMode),
}

/// Which way each thread of the multi-threaded blocking comparison runs one
/// empty kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncPath {
    /// Raw launch + `cuStreamSynchronize` on the thread's own raw stream.
    Raw,
    /// `launch(&empty, ..).sync()` (default policy, shared pool).
    Lib,
}

/// The shared setup: device 0, its kernels, an interop stream, raw streams.
pub struct Fixture {
    /// Device 0.
    pub device: Device,
    /// Its name, compute capability and memory.
    pub info: DeviceInfo,
    /// `cuDriverGetVersion` (e.g. 12080), if it answered.
    pub driver_version: Option<i32>,
    /// The empty and spin kernels.
    pub kernels: Kernels,
    /// A stream created here (not one of the pool's): the raw single-stream
    /// paths and the library's `sync_on` paths both use it.
    pub stream: Arc<CudaStream>,
    /// Raw streams for the raw round-robin paths.
    pub raw_streams: RawStreams,
    /// The library's default policy (round-robin over the process pool).
    pub policy: Arc<StreamPoolRoundRobin>,
    /// The default pool with each completion mode, for side-by-side rows.
    pub mode_policies: Vec<(CompletionMode, StreamPoolRoundRobin)>,
    fork_join: RawForkJoin,
}

impl std::fmt::Debug for Fixture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fixture")
            .field("device", &self.info.name)
            .field("kernels", &self.kernels.source)
            .finish_non_exhaustive()
    }
}

fn driver_version() -> Option<i32> {
    let mut v = 0i32;
    // SAFETY: `cuDriverGetVersion` writes one int through a valid pointer;
    // callers reach here only after the driver library loaded.
    let rc = unsafe { sys::cuDriverGetVersion(&mut v) };
    (rc == sys::CUresult::CUDA_SUCCESS).then_some(v)
}

impl Fixture {
    /// Opens device 0, loads the kernels, creates the streams, and warms up
    /// the library's default pool.
    ///
    /// # Errors
    /// "no NVIDIA driver found" without a driver, "no CUDA device 0" without
    /// a GPU, or the driver's error.
    pub fn new() -> Result<Self> {
        let device = Device::new(0)?;
        let info = device.info()?;
        let kernels = Kernels::load(&device)?;
        let ctx = device.context();
        let stream = device.new_stream()?;
        let raw_streams = RawStreams::new(ctx, RAW_STREAMS)?;
        let fork_join = RawForkJoin::new(ctx)?;
        let policy = cuda_async::default_policy()?;
        let mode_policies = COMPLETION_MODES
            .iter()
            .map(|&m| (m, (*policy).clone().with_completion(m)))
            .collect();
        let fx = Fixture {
            mode_policies,
            driver_version: driver_version(),
            device,
            info,
            kernels,
            stream,
            raw_streams,
            policy,
            fork_join,
        };
        // First launches load the module's code; first syncs create the pool.
        fx.raw_launch_sync()?;
        fx.lib_sync()?;
        Ok(fx)
    }

    // ---- overhead -------------------------------------------------------

    /// Raw: launch `empty` on [`Fixture::stream`], synchronize.
    ///
    /// # Errors
    /// The driver's error.
    pub fn raw_launch_sync(&self) -> Result<()> {
        Ok(raw::launch_sync(&self.stream, &self.kernels.empty_fn)?)
    }

    /// Library: `launch(&empty, ..).sync_on(&stream)` on [`Fixture::stream`].
    ///
    /// # Errors
    /// The op's error.
    pub fn lib_sync_on(&self) -> Result<()> {
        // SAFETY: `empty` takes no parameters and touches no memory.
        let op = unsafe { launch(&self.kernels.empty, ONE_THREAD, ()) };
        Ok(op.sync_on(&self.stream)?)
    }

    /// Library: `launch(&empty, ..).sync()` (default policy).
    ///
    /// # Errors
    /// The op's error.
    pub fn lib_sync(&self) -> Result<()> {
        // SAFETY: as in `lib_sync_on`.
        let op = unsafe { launch(&self.kernels.empty, ONE_THREAD, ()) };
        Ok(op.sync()?)
    }

    /// Raw: `cuStreamSynchronize` of an idle stream (the floor of `value`).
    ///
    /// # Errors
    /// The driver's error.
    pub fn raw_idle_sync(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }

    /// Library: `value(x).sync()`: no GPU work, one synchronize.
    ///
    /// # Errors
    /// The op's error.
    pub fn lib_value_sync(&self, x: u64) -> Result<u64> {
        Ok(value(x).sync()?)
    }

    /// Raw: 10 launches of `empty` on [`Fixture::stream`], one synchronize.
    ///
    /// # Errors
    /// The driver's error.
    pub fn raw_chain10(&self) -> Result<()> {
        self.raw_eager(10)
    }

    /// Library: a chain of 10 `empty` launches built with `then`, run with
    /// `sync_on(&stream)`.
    ///
    /// # Errors
    /// The op's error.
    pub fn lib_chain10(&self) -> Result<()> {
        let k = &self.kernels.empty;
        // SAFETY: `empty` takes no parameters and touches no memory.
        let l = move || unsafe { launch(k, ONE_THREAD, ()) };
        let op = l()
            .then(move |()| l())
            .then(move |()| l())
            .then(move |()| l())
            .then(move |()| l())
            .then(move |()| l())
            .then(move |()| l())
            .then(move |()| l())
            .then(move |()| l())
            .then(move |()| l());
        Ok(op.sync_on(&self.stream)?)
    }

    // ---- await latency and throughput -----------------------------------

    /// One empty kernel, completed the `path` way. [`AwaitPath::RawSync`]
    /// blocks the polling thread (it is the blocking floor).
    ///
    /// # Errors
    /// The driver's or the op's error.
    pub async fn await_empty(&self, path: AwaitPath) -> Result<()> {
        let f = &self.kernels.empty_fn;
        match path {
            AwaitPath::RawSync => raw::launch_sync(self.raw_streams.next(), f)?,
            AwaitPath::RawHostFn => {
                RawHostFnFuture::launch_empty(self.raw_streams.next(), f)?.await
            }
            AwaitPath::Lib => {
                // SAFETY: `empty` takes no parameters and touches no memory.
                let op = unsafe { launch(&self.kernels.empty, ONE_THREAD, ()) };
                op.into_future().await?
            }
            AwaitPath::Mode(m) => {
                let policy = self.policy_for(m)?;
                // SAFETY: `empty` takes no parameters and touches no memory.
                let op = unsafe { launch(&self.kernels.empty, ONE_THREAD, ()) };
                op.schedule(policy)?.await?
            }
        }
        Ok(())
    }

    /// The default pool with completion mode `m`.
    ///
    /// # Errors
    /// If `m` is not one of [`COMPLETION_MODES`].
    pub fn policy_for(&self, m: CompletionMode) -> Result<&StreamPoolRoundRobin> {
        self.mode_policies
            .iter()
            .find(|(k, _)| *k == m)
            .map(|(_, p)| p)
            .ok_or_else(|| format!("no policy for completion mode {m:?}").into())
    }

    /// One empty kernel, waited for the `path` way on this thread.
    /// `stream_index` picks the raw stream (each thread its own).
    ///
    /// # Errors
    /// The driver's or the op's error.
    pub fn sync_empty(&self, path: SyncPath, stream_index: usize) -> Result<()> {
        match path {
            SyncPath::Raw => {
                let s = self.raw_streams.get(stream_index);
                Ok(raw::launch_sync(s, &self.kernels.empty_fn)?)
            }
            SyncPath::Lib => self.lib_sync(),
        }
    }

    // ---- zip ------------------------------------------------------------

    /// Raw: one ~1 ms spin on [`Fixture::stream`], synchronize.
    ///
    /// # Errors
    /// The driver's error.
    pub fn raw_spin(&self) -> Result<()> {
        raw::launch_spin(&self.stream, &self.kernels.spin_fn, SPIN_NS)?;
        Ok(self.stream.synchronize()?)
    }

    /// Library: one ~1 ms spin, `.sync()`.
    ///
    /// # Errors
    /// The op's error.
    pub fn lib_spin(&self) -> Result<()> {
        self.lib_spin_op().sync()?;
        Ok(())
    }

    fn lib_spin_op(&self) -> impl DeviceOp<Output = (u64,)> + '_ {
        // SAFETY: `spin` takes one u64 and touches no memory.
        unsafe { launch(&self.kernels.spin, ONE_THREAD, (SPIN_NS,)) }
    }

    /// Library: two ~1 ms spins zipped (concurrent arms), `.sync()`.
    ///
    /// # Errors
    /// The op's error.
    pub fn lib_zip2(&self) -> Result<()> {
        self.lib_spin_op().zip(self.lib_spin_op()).sync()?;
        Ok(())
    }

    /// Raw: one spin of `ns`, launch + synchronize.
    ///
    /// # Errors
    /// The driver's error.
    pub fn raw_spin_ns(&self, ns: u64) -> Result<()> {
        raw::launch_spin(&self.stream, &self.kernels.spin_fn, ns)?;
        Ok(self.stream.synchronize()?)
    }

    /// Library: `n` independent spins of `ns`, awaited together
    /// (`join_all`) on `policy`.
    ///
    /// # Errors
    /// The op's error.
    pub fn lib_wide(&self, policy: &StreamPoolRoundRobin, n: usize, ns: u64) -> Result<()> {
        let arms: Vec<_> = (0..n)
            // SAFETY: `spin` takes one u64 and touches no memory.
            .map(|_| unsafe { launch(&self.kernels.spin, ONE_THREAD, (ns,)) })
            .collect();
        join_all(arms).sync_with(policy)?;
        Ok(())
    }

    /// Library: two ~1 ms spins one after the other (`then`), `.sync()`.
    ///
    /// # Errors
    /// The op's error.
    pub fn lib_seq2(&self) -> Result<()> {
        let second = self.lib_spin_op();
        self.lib_spin_op().then(move |_| second).sync()?;
        Ok(())
    }

    /// Raw: two ~1 ms spins on [`Fixture::stream`] and a raw stream, forked
    /// and joined with events, one synchronize.
    ///
    /// # Errors
    /// The driver's error.
    pub fn raw_fork_join2(&self) -> Result<()> {
        let other = self.raw_streams.get(0);
        Ok(self
            .fork_join
            .two_spins(&self.stream, other, &self.kernels.spin_fn, SPIN_NS)?)
    }

    // ---- graph ----------------------------------------------------------

    /// Raw: `n` launches of `empty` on [`Fixture::stream`], one synchronize.
    ///
    /// # Errors
    /// The driver's error.
    pub fn raw_eager(&self, n: usize) -> Result<()> {
        let f = &self.kernels.empty_fn;
        for _ in 0..n {
            raw::launch_empty(&self.stream, f)?;
        }
        Ok(self.stream.synchronize()?)
    }

    /// Library: a chain of `n` `empty` launches built in a loop with `then`
    /// and `boxed` (how a chain of run-time length is written), run with
    /// `sync_on(&stream)`. Building the chain is part of the time.
    ///
    /// # Errors
    /// The op's error.
    pub fn lib_eager(&self, n: usize) -> Result<()> {
        Ok(self.empty_chain(n).sync_on(&self.stream)?)
    }

    /// `n` chained launches of `empty`, one op each.
    fn empty_chain(&self, n: usize) -> BoxedOp<'_, ()> {
        let k = &self.kernels.empty;
        let mut op: BoxedOp<'_, ()> = value(()).boxed();
        for _ in 0..n {
            // SAFETY: `empty` takes no parameters and touches no memory.
            op = op
                .then(move |()| unsafe { launch(k, ONE_THREAD, ()) })
                .boxed();
        }
        op
    }

    /// Ops: the chain of [`Fixture::lib_eager`] captured into a graph on a
    /// private stream ([`DeviceOpExt::graph`]); replay it with
    /// [`Fixture::lib_replay`].
    ///
    /// # Errors
    /// The capture's error.
    pub fn lib_graph(&self, n: usize) -> Result<cuda_async::CudaGraph<()>> {
        Ok(self.empty_chain(n).graph()?)
    }

    /// Ops: one replay of `graph` (an op) on the fixture's stream, synced.
    ///
    /// # Errors
    /// The replay's error.
    pub fn lib_replay(&self, graph: &cuda_async::CudaGraph<()>) -> Result<()> {
        Ok(graph.launch().sync_on(&self.stream)?)
    }

    /// Raw: captures a graph of `nodes` chained `empty` launches on a new
    /// stream.
    ///
    /// # Errors
    /// The driver's error.
    pub fn raw_graph(&self, nodes: usize) -> Result<RawGraph> {
        let s = self.device.new_stream()?;
        Ok(RawGraph::capture_empty_chain(
            &s,
            &self.kernels.empty_fn,
            nodes,
        )?)
    }

    // ---- copies ---------------------------------------------------------

    /// Allocates the buffers of the copy comparison: `bytes` of pinned host
    /// and device memory for each side.
    ///
    /// # Errors
    /// Out of memory and other driver errors.
    pub fn copies(&self, bytes: usize) -> Result<Copies<'_>> {
        let n = bytes / 4;
        let ctx = self.device.context();
        let raw_host = RawPinned::new(ctx, n * 4, 0xab)?;
        let raw_dev = RawDeviceMem::new(ctx, n * 4)?;
        let host = PinnedBuffer::filled(&self.device, n, 0xabab_abab_u32)?;
        let dev = zeros::<u32>(n).sync_on(&self.stream)?;
        Ok(Copies {
            fx: self,
            bytes: n * 4,
            raw_host,
            raw_dev,
            lib: Some((host, dev)),
        })
    }
}

/// The buffers of the copy comparison (see [`Fixture::copies`]).
#[derive(Debug)]
pub struct Copies<'f> {
    fx: &'f Fixture,
    bytes: usize,
    raw_host: RawPinned,
    raw_dev: RawDeviceMem,
    lib: Option<(PinnedBuffer<u32>, DeviceBuffer<u32>)>,
}

fn lost() -> crate::BenchError {
    "the library's copy buffers were lost to an earlier error".into()
}

impl Copies<'_> {
    /// Bytes per copy.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Raw pinned host-to-device copy, synchronized.
    ///
    /// # Errors
    /// The driver's error.
    pub fn raw_h2d(&mut self) -> Result<()> {
        Ok(raw::copy_htod_sync(
            &self.fx.stream,
            &self.raw_host,
            &self.raw_dev,
        )?)
    }

    /// Raw pinned device-to-host copy, synchronized.
    ///
    /// # Errors
    /// The driver's error.
    pub fn raw_d2h(&mut self) -> Result<()> {
        Ok(raw::copy_dtoh_sync(
            &self.fx.stream,
            &self.raw_dev,
            &mut self.raw_host,
        )?)
    }

    /// Library: `copy_h2d(pinned, device).sync_on(&stream)`.
    ///
    /// # Errors
    /// The op's error (after which the library's buffers are gone).
    pub fn lib_h2d(&mut self) -> Result<()> {
        let (host, dev) = self.lib.take().ok_or_else(lost)?;
        self.lib = Some(copy_h2d(host, dev).sync_on(&self.fx.stream)?);
        Ok(())
    }

    /// Library: `copy_d2h(device, pinned).sync_on(&stream)`.
    ///
    /// # Errors
    /// The op's error (after which the library's buffers are gone).
    pub fn lib_d2h(&mut self) -> Result<()> {
        let (host, dev) = self.lib.take().ok_or_else(lost)?;
        let (dev, host) = copy_d2h(dev, host).sync_on(&self.fx.stream)?;
        self.lib = Some((host, dev));
        Ok(())
    }
}
