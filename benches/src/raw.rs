//! The raw baselines: the same work written directly against cudarc 0.19,
//! without `cuda-async`. Each is the shortest correct way to do the job, so
//! the report's ratios are the framework's cost over plain driver calls.
//!
//! These are benchmark baselines, not products: the host-callback future
//! does not notice sticky GPU faults (it would hang), and nothing here
//! guards buffers against use while the GPU works.

use std::ffi::c_void;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use cuda_async::cudarc::driver::{
    result, sys, CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaStream, DriverError,
    PushKernelArg,
};
use futures_util::task::AtomicWaker;

use crate::kernels::ONE_THREAD;

/// Enqueues the parameterless kernel `f` (one thread) on `stream`.
///
/// # Errors
/// The driver's error from `cuLaunchKernel` (or binding the context).
pub fn launch_empty(stream: &CudaStream, f: &CudaFunction) -> Result<(), DriverError> {
    // SAFETY: callers pass the `empty` kernel (no parameters, touches no
    // memory); the builder has no arguments, which matches.
    unsafe { stream.launch_builder(f).launch(ONE_THREAD) }.map(drop)
}

/// Enqueues the `spin(ns)` kernel (one thread) on `stream`.
///
/// # Errors
/// The driver's error from `cuLaunchKernel` (or binding the context).
pub fn launch_spin(stream: &CudaStream, f: &CudaFunction, ns: u64) -> Result<(), DriverError> {
    let mut b = stream.launch_builder(f);
    b.arg(&ns);
    // SAFETY: callers pass the `spin` kernel, whose one parameter is a u64
    // (pushed above); it reads only the global timer.
    unsafe { b.launch(ONE_THREAD) }.map(drop)
}

/// Raw launch of the empty kernel, then `cuStreamSynchronize`.
///
/// # Errors
/// The driver's error.
pub fn launch_sync(stream: &CudaStream, f: &CudaFunction) -> Result<(), DriverError> {
    launch_empty(stream, f)?;
    stream.synchronize()
}

/// What the host function and the future share.
#[derive(Debug, Default)]
struct Signal {
    done: AtomicBool,
    waker: AtomicWaker,
}

/// The minimal future over `cuLaunchHostFunc`: the host function (on the
/// driver's callback thread) sets a flag and wakes an [`AtomicWaker`].
/// The yardstick of `DeviceFuture`.
#[derive(Debug)]
#[must_use = "futures do nothing unless polled"]
pub struct RawHostFnFuture {
    signal: Arc<Signal>,
}

impl RawHostFnFuture {
    /// Enqueues a host function on `stream` after the work already there;
    /// the future completes when it has run. The stream's context must be
    /// current on this thread (any cudarc call on the stream makes it so).
    ///
    /// # Errors
    /// The driver's error from `cuLaunchHostFunc`.
    pub fn after(stream: &CudaStream) -> Result<Self, DriverError> {
        let signal = Arc::new(Signal::default());
        let payload = Box::into_raw(Box::new(signal.clone())).cast::<c_void>();
        // SAFETY: `complete` has the `CUhostFn` signature and reclaims
        // `payload` (a leaked `Box<Arc<Signal>>`) exactly once, when the
        // driver calls it; the stream is alive (we hold a reference).
        let rc =
            unsafe { result::stream::launch_host_function(stream.cu_stream(), complete, payload) };
        if let Err(e) = rc {
            // SAFETY: the driver refused the host function, so it will never
            // run it: we are the box's only owner.
            drop(unsafe { Box::from_raw(payload.cast::<Arc<Signal>>()) });
            return Err(e);
        }
        Ok(RawHostFnFuture { signal })
    }

    /// Launches the empty kernel on `stream`, then [`RawHostFnFuture::after`].
    ///
    /// # Errors
    /// The driver's error.
    pub fn launch_empty(stream: &CudaStream, f: &CudaFunction) -> Result<Self, DriverError> {
        launch_empty(stream, f)?;
        Self::after(stream)
    }
}

/// The host function: flag, then wake (never a CUDA call).
unsafe extern "C" fn complete(data: *mut c_void) {
    // SAFETY: `data` is the `Box<Arc<Signal>>` leaked by `after`, handed to
    // us once by the driver.
    let signal = unsafe { Box::from_raw(data.cast::<Arc<Signal>>()) };
    signal.done.store(true, Ordering::Release);
    signal.waker.wake();
}

impl Future for RawHostFnFuture {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.signal.done.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        self.signal.waker.register(cx.waker());
        if self.signal.done.load(Ordering::Acquire) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

/// A fixed set of raw streams handed out round-robin (what the library's
/// default pool does, for the raw side of the comparisons).
#[derive(Debug)]
pub struct RawStreams {
    streams: Vec<Arc<CudaStream>>,
    next: AtomicUsize,
}

impl RawStreams {
    /// `n` new non-blocking streams of `ctx`.
    ///
    /// # Errors
    /// The driver's error from `cuStreamCreate`.
    pub fn new(ctx: &Arc<CudaContext>, n: usize) -> Result<Self, DriverError> {
        let streams = (0..n.max(1))
            .map(|_| ctx.new_stream())
            .collect::<Result<_, _>>()?;
        Ok(RawStreams {
            streams,
            next: AtomicUsize::new(0),
        })
    }

    /// The next stream in round-robin order.
    pub fn next(&self) -> &Arc<CudaStream> {
        &self.streams[self.next.fetch_add(1, Ordering::Relaxed) % self.streams.len()]
    }

    /// Stream `i` (modulo the count).
    pub fn get(&self, i: usize) -> &Arc<CudaStream> {
        &self.streams[i % self.streams.len()]
    }
}

/// Raw fork/join of two streams with two reusable events.
#[derive(Debug)]
pub struct RawForkJoin {
    fork: CudaEvent,
    join: CudaEvent,
}

impl RawForkJoin {
    /// Creates the two events (timing disabled).
    ///
    /// # Errors
    /// The driver's error from `cuEventCreate`.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, DriverError> {
        let flags = Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        Ok(RawForkJoin {
            fork: ctx.new_event(flags)?,
            join: ctx.new_event(flags)?,
        })
    }

    /// Runs `spin(ns)` on `a` and on `b` concurrently (b forked from a and
    /// joined back), then synchronizes `a`.
    ///
    /// # Errors
    /// The driver's error.
    pub fn two_spins(
        &self,
        a: &CudaStream,
        b: &CudaStream,
        spin: &CudaFunction,
        ns: u64,
    ) -> Result<(), DriverError> {
        self.fork.record(a)?;
        b.wait(&self.fork)?;
        launch_spin(a, spin, ns)?;
        launch_spin(b, spin, ns)?;
        self.join.record(b)?;
        a.wait(&self.join)?;
        a.synchronize()
    }
}

/// A captured CUDA graph of `nodes` empty kernels in a chain, replayed on
/// the stream it was captured on.
pub struct RawGraph {
    graph: CudaGraph,
    stream: Arc<CudaStream>,
    nodes: usize,
}

impl std::fmt::Debug for RawGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawGraph")
            .field("nodes", &self.nodes)
            .finish()
    }
}

impl RawGraph {
    /// Captures `nodes` launches of `empty` on `stream` (thread-local
    /// capture mode), instantiates and uploads the graph.
    ///
    /// # Errors
    /// The driver's error; `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` if the
    /// capture produced no graph.
    pub fn capture_empty_chain(
        stream: &Arc<CudaStream>,
        empty: &CudaFunction,
        nodes: usize,
    ) -> Result<Self, DriverError> {
        stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let launched = (0..nodes).try_for_each(|_| launch_empty(stream, empty));
        // End the capture whatever happened, so the stream is usable again.
        let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        launched?;
        let graph = ended?.ok_or(DriverError(
            sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        ))?;
        graph.upload()?;
        stream.synchronize()?;
        Ok(RawGraph {
            graph,
            stream: stream.clone(),
            nodes,
        })
    }

    /// Number of kernel nodes.
    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// One replay (`cuGraphLaunch`), then `cuStreamSynchronize`.
    ///
    /// # Errors
    /// The driver's error.
    pub fn replay_sync(&self) -> Result<(), DriverError> {
        self.graph.launch()?;
        self.stream.synchronize()
    }
}

/// Page-locked, non-write-combined host memory from `cuMemHostAlloc`
/// (flags 0: what the library's `PinnedBuffer` uses too).
#[derive(Debug)]
pub struct RawPinned {
    ptr: *mut u8,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl RawPinned {
    /// Allocates `bytes` (> 0) and fills them with `fill`.
    ///
    /// # Errors
    /// The driver's error from `cuMemHostAlloc`.
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize, fill: u8) -> Result<Self, DriverError> {
        ctx.bind_to_thread()?;
        // SAFETY: a plain allocation call; the result is checked.
        let ptr = unsafe { result::malloc_host(bytes.max(1), 0) }?.cast::<u8>();
        // SAFETY: `ptr` addresses `bytes` writable bytes just allocated.
        unsafe { std::ptr::write_bytes(ptr, fill, bytes) };
        Ok(RawPinned {
            ptr,
            bytes,
            ctx: ctx.clone(),
        })
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` holds `bytes` initialised bytes (filled in `new`);
        // the benches never let the GPU write them while this borrow lives
        // (every copy is synchronized before returning).
        unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }
}

impl Drop for RawPinned {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` came from `cuMemHostAlloc`; every copy using it was
        // synchronized; freed exactly once.
        let _ = unsafe { result::free_host(self.ptr.cast::<c_void>()) };
    }
}

/// Device memory from `cuMemAlloc`.
#[derive(Debug)]
pub struct RawDeviceMem {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl RawDeviceMem {
    /// Allocates `bytes` (> 0), contents unspecified.
    ///
    /// # Errors
    /// The driver's error from `cuMemAlloc`.
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self, DriverError> {
        ctx.bind_to_thread()?;
        // SAFETY: a plain allocation call; the result is checked.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }?;
        Ok(RawDeviceMem {
            ptr,
            bytes,
            ctx: ctx.clone(),
        })
    }
}

impl RawDeviceMem {
    /// The allocation's device address.
    pub fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }
}

/// `cuMemcpyPeerAsync` of `bytes` from `src` (memory of `src_ctx`) to
/// `dst` (memory of `dst_ctx`) on `stream`, then `cuStreamSynchronize`.
///
/// # Safety
/// Both pointers address `bytes` bytes of live allocations of their
/// contexts, which nothing else touches until this returns.
///
/// # Errors
/// The driver's error.
pub unsafe fn peer_copy_sync(
    dst: sys::CUdeviceptr,
    dst_ctx: &CudaContext,
    src: sys::CUdeviceptr,
    src_ctx: &CudaContext,
    bytes: usize,
    stream: &CudaStream,
) -> Result<(), DriverError> {
    // SAFETY: forwarded to our caller.
    unsafe {
        sys::cuMemcpyPeerAsync(
            dst,
            dst_ctx.cu_ctx(),
            src,
            src_ctx.cu_ctx(),
            bytes,
            stream.cu_stream(),
        )
    }
    .result()?;
    stream.synchronize()
}

/// Enables peer access between the contexts `a` and `b`, both directions
/// (`cuCtxEnablePeerAccess`, covering `cuMemAlloc` memory), and returns
/// the link's P2P performance rank; `None` (nothing enabled) when the
/// devices cannot access each other.
///
/// # Errors
/// The driver's error.
pub fn peer_link(a: &Arc<CudaContext>, b: &Arc<CudaContext>) -> Result<Option<i32>, DriverError> {
    for (from, to) in [(a, b), (b, a)] {
        let mut yes = 0;
        // SAFETY: writes one int; both device handles are live.
        unsafe { sys::cuDeviceCanAccessPeer(&mut yes, from.cu_device(), to.cu_device()) }
            .result()?;
        if yes == 0 {
            return Ok(None);
        }
    }
    for (from, to) in [(a, b), (b, a)] {
        from.bind_to_thread()?;
        // SAFETY: `to` is a live context; flags must be 0.
        match unsafe { sys::cuCtxEnablePeerAccess(to.cu_ctx(), 0) } {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
            }
            e => return Err(DriverError(e)),
        }
    }
    let mut rank = 0;
    // SAFETY: writes one int; both device handles are live.
    unsafe {
        sys::cuDeviceGetP2PAttribute(
            &mut rank,
            sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK,
            a.cu_device(),
            b.cu_device(),
        )
    }
    .result()?;
    Ok(Some(rank))
}

impl Drop for RawDeviceMem {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` came from `cuMemAlloc`; every copy using it was
        // synchronized; freed exactly once.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// `cuMemcpyHtoDAsync` of all of `src` into `dst`, then synchronize.
///
/// # Errors
/// The driver's error; `CUDA_ERROR_INVALID_VALUE` if the sizes differ.
pub fn copy_htod_sync(
    stream: &CudaStream,
    src: &RawPinned,
    dst: &RawDeviceMem,
) -> Result<(), DriverError> {
    if src.bytes != dst.bytes {
        return Err(DriverError(sys::CUresult::CUDA_ERROR_INVALID_VALUE));
    }
    stream.context().bind_to_thread()?;
    // SAFETY: `dst` holds `src.bytes` bytes of device memory, `src` is live
    // pinned memory; both outlive the copy (synchronized below).
    unsafe { result::memcpy_htod_async(dst.ptr, src.as_slice(), stream.cu_stream()) }?;
    stream.synchronize()
}

/// `cuMemcpyDtoHAsync` of all of `src` into `dst`, then synchronize.
///
/// # Errors
/// The driver's error; `CUDA_ERROR_INVALID_VALUE` if the sizes differ.
pub fn copy_dtoh_sync(
    stream: &CudaStream,
    src: &RawDeviceMem,
    dst: &mut RawPinned,
) -> Result<(), DriverError> {
    if src.bytes != dst.bytes {
        return Err(DriverError(sys::CUresult::CUDA_ERROR_INVALID_VALUE));
    }
    stream.context().bind_to_thread()?;
    // SAFETY: as in `copy_htod_sync`; the host slice is borrowed mutably
    // until the copy is synchronized below.
    unsafe { result::memcpy_dtoh_async(dst.as_mut_slice(), src.ptr, stream.cu_stream()) }?;
    stream.synchronize()
}
