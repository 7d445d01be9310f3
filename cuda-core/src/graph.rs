//! CUDA graphs: work enqueued on a stream, captured once and replayed with
//! one driver call on any stream of the same device.
//!
//! [`Graph::capture`] runs a closure that enqueues work on a stream while
//! the stream is capturing (in `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`, so
//! other threads' driver calls are never refused because of this capture),
//! then instantiates and uploads what it recorded. The capture always ends
//! before `capture` returns: when the closure fails, when the driver
//! invalidates the capture (the closure enqueued something that cannot be
//! captured, such as a synchronize), and when the closure panics (a guard
//! ends it while unwinding). The stream is then usable as before.
//!
//! [`Graph::recapture`] records new work for the same graph and applies it
//! with `cuGraphExecUpdate` when the topology is unchanged (only parameters
//! differ: kernel arguments, copy addresses), or instantiates it anew when
//! it is not; the returned [`GraphUpdate`] says which happened.
//!
//! This layer knows nothing of buffers: a replay reads and writes whatever
//! memory the captured work named, so the caller keeps that memory alive
//! and ordered for as long as replays may run (`cuda-async`'s graph ops do
//! this for its buffers).
//!
//! # Examples
//!
//! ```no_run
//! use cuda_core::{Device, Graph};
//! let dev = Device::new(0)?;
//! let (capture_stream, replay_stream) = (dev.new_stream()?, dev.new_stream()?);
//! let mut x = capture_stream.alloc_zeros::<u8>(1024).map_err(|e| cuda_core::Error::driver("alloc", e))?;
//! let graph = Graph::capture(&capture_stream, |s| {
//!     s.memset_zeros(&mut x).map_err(|e| cuda_core::Error::driver("cuMemsetD8Async", e))
//! })?;
//! graph.launch_on(&replay_stream)?; // one driver call, on any stream of the device
//! replay_stream.synchronize().map_err(|e| cuda_core::Error::driver("cuStreamSynchronize", e))?;
//! # Ok::<(), cuda_core::Error>(())
//! ```

use std::any::Any;
use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaStream, DriverError};

use crate::error::{Error, Result};
use crate::raw::{check_same_context, set_current, SharedEvent};
use crate::tracking::{is_capture_stream, with_capture_log, UseMark, UseRecord};

/// How [`Graph::recapture`] applied the new work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GraphUpdate {
    /// Same topology: the executable graph was updated in place
    /// (`cuGraphExecUpdate`, no re-instantiation, no re-upload).
    InPlace,
    /// The topology changed (nodes added, removed or of another kind): the
    /// new graph was instantiated and uploaded, and replaced the old one.
    Reinstantiated,
}

/// An instantiated, uploaded CUDA graph of one device.
///
/// `Send`, not `Sync`: the driver requires calls on one graph object to be
/// serialized (<https://docs.nvidia.com/cuda/cuda-driver-api/graphs-thread-safety.html>),
/// so a `Graph` is used from one thread at a time; methods that change it
/// take `&mut self`.
///
/// ```compile_fail
/// fn sync<T: Sync>() {}
/// sync::<cuda_core::Graph>();
/// ```
pub struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    ctx: Arc<CudaContext>,
    nodes: usize,
    /// Not `Sync` (see the type's docs).
    _not_sync: PhantomData<Cell<()>>,
}

// SAFETY: the graph and executable-graph handles are not tied to the thread
// that made them: any thread may use them once the owning context is made
// current, which every method here does first (`set_current`). The driver
// only forbids concurrent calls on the same graph object; `Graph` is not
// `Sync` and its mutating methods take `&mut self`, so the one thread that
// holds it at any time is the only one calling the driver with its handles.
// The handles are destroyed once, in `Drop`.
unsafe impl Send for Graph {}

impl fmt::Debug for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Graph")
            .field("device", &self.ctx.ordinal())
            .field("nodes", &self.nodes)
            .finish()
    }
}

/// A captured (not instantiated) graph, destroyed on drop.
struct Template {
    graph: sys::CUgraph,
    ctx: Arc<CudaContext>,
}

impl Template {
    fn nodes(&self) -> Result<usize> {
        let mut n = 0usize;
        // SAFETY: a live graph; with a null node array the call only writes
        // the count through a valid pointer.
        unsafe { sys::cuGraphGetNodes(self.graph, std::ptr::null_mut(), &mut n) }
            .result()
            .map_err(|e| Error::driver("cuGraphGetNodes", e))?;
        Ok(n)
    }

    /// Instantiates and uploads on `stream`.
    fn instantiate(&self, stream: &CudaStream) -> Result<sys::CUgraphExec> {
        let mut exec = std::ptr::null_mut();
        // SAFETY: a live graph of the current context; writes one handle
        // through a valid pointer. Flags 0: default instantiation.
        unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, self.graph, 0) }
            .result()
            .map_err(|e| Error::driver("cuGraphInstantiateWithFlags", e))?;
        // SAFETY: a live executable graph and stream of this context.
        if let Err(e) = unsafe { sys::cuGraphUpload(exec, stream.cu_stream()) }.result() {
            // SAFETY: made just above, never launched.
            unsafe { sys::cuGraphExecDestroy(exec) };
            return Err(Error::driver("cuGraphUpload", e));
        }
        Ok(exec)
    }

    /// Gives up ownership of the handle (the caller destroys it).
    fn into_raw(self) -> sys::CUgraph {
        let g = self.graph;
        std::mem::forget(self);
        g
    }
}

impl Drop for Template {
    fn drop(&mut self) {
        if set_current(&self.ctx).is_ok() {
            // SAFETY: we own the handle and destroy it once.
            unsafe { sys::cuGraphDestroy(self.graph) };
        }
    }
}

/// Ends a capture that is still open when dropped (the closure panicked),
/// so the stream is never left capturing.
struct CaptureGuard<'a> {
    stream: &'a CudaStream,
    open: bool,
}

impl CaptureGuard<'_> {
    /// Ends the capture: the captured graph (null if the driver made none),
    /// or why the capture could not be ended normally.
    fn end(&mut self) -> std::result::Result<sys::CUgraph, DriverError> {
        self.open = false;
        let mut g = std::ptr::null_mut();
        // SAFETY: the stream is live and capturing (begun by `capture_raw`
        // on this thread); writes one handle through a valid pointer.
        unsafe { sys::cuStreamEndCapture(self.stream.cu_stream(), &mut g) }.result()?;
        Ok(g)
    }
}

impl Drop for CaptureGuard<'_> {
    fn drop(&mut self) {
        if self.open && set_current(self.stream.context()).is_ok() {
            if let Ok(g) = self.end() {
                if !g.is_null() {
                    // SAFETY: the graph the capture just returned; ours.
                    unsafe { sys::cuGraphDestroy(g) };
                }
            }
        }
    }
}

/// Whether `stream` is capturing now (for any thread).
///
/// # Errors
/// A driver error from `cuStreamIsCapturing` (for instance a capture that
/// was invalidated and not yet ended).
pub fn is_capturing(stream: &CudaStream) -> Result<bool> {
    set_current(stream.context())?;
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: a live stream; writes the status through a valid pointer.
    unsafe { sys::cuStreamIsCapturing(stream.cu_stream(), &mut status) }
        .result()
        .map_err(|e| Error::driver("cuStreamIsCapturing", e))?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

fn capture_raw(
    stream: &Arc<CudaStream>,
    f: impl FnOnce(&Arc<CudaStream>) -> Result<()>,
) -> Result<Template> {
    crate::device::require_driver()?;
    if is_capturing(stream)? {
        return Err(Error::Capture(
            "the stream is already capturing (captures do not nest)".into(),
        ));
    }
    set_current(stream.context())?;
    // SAFETY: a live stream of the current context. Thread-local mode: only
    // this thread's potentially unsafe calls are refused while it captures.
    unsafe {
        sys::cuStreamBeginCapture_v2(
            stream.cu_stream(),
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        )
    }
    .result()
    .map_err(|e| Error::driver("cuStreamBeginCapture", e))?;
    let mut guard = CaptureGuard { stream, open: true };
    let enqueued = f(stream);
    let _ = set_current(stream.context());
    let ended = guard.end();
    if enqueued.is_err() || ended.is_err() {
        // cudarc defers some errors into the context (destructors of events
        // and streams touched by the failed capture) and hands them to the
        // next call made through it, on any thread: they belong to this
        // capture, which reports its own error below.
        let _ = stream.context().check_err();
    }
    let ctx = stream.context().clone();
    match (enqueued, ended) {
        (Err(e), Ok(g)) => {
            if !g.is_null() {
                drop(Template { graph: g, ctx });
            }
            Err(e)
        }
        // The work's own error says more than the invalidated capture.
        (Err(e), Err(_)) => Err(e),
        (Ok(()), Err(e)) => Err(Error::Capture(format!(
            "the driver ended it with {e:?}: work enqueued during it could not be captured \
             (a synchronize, a pageable or synchronous copy, an event query, or a wait on work \
             outside the capture)"
        ))),
        (Ok(()), Ok(g)) if g.is_null() => {
            Err(Error::Capture("the capture produced no graph".into()))
        }
        (Ok(()), Ok(g)) => Ok(Template { graph: g, ctx }),
    }
}

impl Graph {
    /// Captures the work `f` enqueues on `stream`, then instantiates the
    /// graph and uploads it (on `stream`).
    ///
    /// Work on other streams joins the capture only through events the
    /// captured stream records and those streams wait for (fork/join); such
    /// streams must not be used by other threads meanwhile, or their work
    /// joins the graph too. Capture mode is thread-local.
    ///
    /// # Errors
    /// [`Error::Capture`] when the stream is already capturing or when the
    /// driver invalidated the capture (naming the driver's error); `f`'s own
    /// error if it fails; a driver error if instantiation or upload fails.
    /// In every case the capture has ended and the stream works as before.
    ///
    /// # Panics
    /// If `f` panics, the panic continues after the capture was ended.
    pub fn capture(
        stream: &Arc<CudaStream>,
        f: impl FnOnce(&Arc<CudaStream>) -> Result<()>,
    ) -> Result<Graph> {
        let template = capture_raw(stream, f)?;
        let nodes = template.nodes()?;
        let exec = template.instantiate(stream)?;
        let ctx = template.ctx.clone();
        Ok(Graph {
            graph: template.into_raw(),
            exec,
            ctx,
            nodes,
            _not_sync: PhantomData,
        })
    }

    /// Enqueues one replay of the whole graph on `stream` (one driver call).
    ///
    /// Replays on one stream run in order; replays on different streams may
    /// overlap, so the caller orders them when they touch the same memory.
    /// Replays already enqueued are not affected by a later
    /// [`recapture`](Self::recapture) or by dropping the graph.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a stream of another device; a driver
    /// error from `cuGraphLaunch` (a sticky fault of the context included).
    pub fn launch_on(&self, stream: &CudaStream) -> Result<()> {
        self.check_stream(stream)?;
        set_current(&self.ctx)?;
        // SAFETY: a live executable graph and a live stream of its context.
        unsafe { sys::cuGraphLaunch(self.exec, stream.cu_stream()) }
            .result()
            .map_err(|e| Error::driver("cuGraphLaunch", e))
    }

    /// Captures `f`'s work again and makes it the graph: in place when only
    /// parameters changed, else by instantiating the new graph.
    ///
    /// # Errors
    /// As [`Graph::capture`]; on error the graph is unchanged.
    pub fn recapture(
        &mut self,
        stream: &Arc<CudaStream>,
        f: impl FnOnce(&Arc<CudaStream>) -> Result<()>,
    ) -> Result<GraphUpdate> {
        self.check_stream(stream)?;
        let template = capture_raw(stream, f)?;
        let nodes = template.nodes()?;
        set_current(&self.ctx)?;
        // SAFETY: an all-zero result info is a valid out-parameter.
        let mut info: sys::CUgraphExecUpdateResultInfo = unsafe { std::mem::zeroed() };
        // SAFETY: both graphs are live and of this context; `self` is held
        // mutably, so no other call uses the executable graph meanwhile.
        let r = unsafe { sys::cuGraphExecUpdate_v2(self.exec, template.graph, &mut info) };
        let how = match r {
            sys::CUresult::CUDA_SUCCESS => GraphUpdate::InPlace,
            sys::CUresult::CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE => {
                let exec = template.instantiate(stream)?;
                // SAFETY: ours, destroyed once; replays in flight finish
                // first (the driver frees it when they are done).
                unsafe { sys::cuGraphExecDestroy(self.exec) };
                self.exec = exec;
                GraphUpdate::Reinstantiated
            }
            code => return Err(Error::driver("cuGraphExecUpdate", DriverError(code))),
        };
        // SAFETY: the old template is ours; the executable graph does not
        // depend on it.
        unsafe { sys::cuGraphDestroy(self.graph) };
        self.graph = template.into_raw();
        self.nodes = nodes;
        Ok(how)
    }

    /// Nodes in the graph (kernels, copies, memsets, event and empty nodes).
    pub fn node_count(&self) -> usize {
        self.nodes
    }

    /// The context (device) the graph belongs to.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The executable graph's handle, for interop. It must not be destroyed
    /// or used concurrently with this `Graph`'s methods.
    pub fn cu_graph_exec(&self) -> sys::CUgraphExec {
        self.exec
    }

    fn check_stream(&self, stream: &CudaStream) -> Result<()> {
        check_same_context("a graph", &self.ctx, stream)
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        if set_current(&self.ctx).is_ok() {
            // SAFETY: both handles are ours and destroyed once. Replays in
            // flight complete first (the driver frees the executable graph
            // when they are done).
            unsafe {
                sys::cuGraphExecDestroy(self.exec);
                sys::cuGraphDestroy(self.graph);
            }
        }
    }
}

/// A [`Graph`] captured together with the device buffers its work uses
/// ([`DeviceBuffer`](crate::DeviceBuffer)): each replay is ordered like a
/// use of every one of them, on the replay's stream, in both directions
/// (it waits for their earlier conflicting uses, and later uses wait for
/// it), and their memory lives as long as the graph (dropping a buffer's
/// handle after the capture is safe).
///
/// A replay's uses are recorded once it is enqueued. A use of one of its
/// buffers that another thread enqueues at the same time (between the
/// replay's ordering and its record) is not ordered against that replay,
/// in either direction: the values may race (the memory is never freed
/// early). Order such a use after the replay (await or synchronize it
/// first) or before it.
///
/// During the capture, buffer uses on the capture's streams record no
/// events (they are logged instead), allocations go to a stream outside the
/// capture (the zeroing of `zeros` is captured), and staging memory that
/// the captured copies read is kept by the graph. Copies between device
/// memory and a [`PinnedBuffer`](crate::PinnedBuffer) cannot be captured
/// ([`Error::Capture`]); copies with a
/// [`SharedPinnedBuffer`](crate::SharedPinnedBuffer) can: each replay
/// holds its gate while it is ordered and enqueued.
///
/// Replays of one graph are ordered after each other by the driver (each
/// launch of an executable graph follows its earlier launches), and by
/// their buffers' events. Memory the graph keeps is released after its
/// last replay completes, on the reclaimer thread, never by blocking.
pub struct TrackedGraph {
    graph: Graph,
    uses: Vec<(Arc<UseRecord>, bool)>,
    /// The uses of host memory the host also reaches, in address order
    /// (the order every launch takes their gates in).
    gates: Vec<Arc<UseRecord>>,
    keep: Vec<Box<dyn Any + Send>>,
    /// The event recorded after the last replay, which the buffers' use
    /// records share (`None` before the first replay).
    last: Mutex<Option<SharedEvent>>,
    replayed: AtomicBool,
    /// Set when a replay's end could not be recorded: kept values leak.
    broken: AtomicBool,
}

impl fmt::Debug for TrackedGraph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TrackedGraph")
            .field("graph", &self.graph)
            .field("buffers", &self.uses.len())
            .field("kept", &self.keep.len())
            .finish()
    }
}

impl TrackedGraph {
    /// Captures the work `f` enqueues on `stream` and on `side` streams that
    /// join the capture through events (fork/join), with buffer uses
    /// logged and allocations made on `alloc` (which must not be `stream`
    /// or a side stream; it is synchronized before this returns).
    ///
    /// # Errors
    /// As [`Graph::capture`]; also [`Error::Capture`] when this thread is
    /// already capturing. On error nothing captured ever runs.
    pub fn capture(
        stream: &Arc<CudaStream>,
        side: &[Arc<CudaStream>],
        alloc: &Arc<CudaStream>,
        f: impl FnOnce(&Arc<CudaStream>) -> Result<()>,
    ) -> Result<TrackedGraph> {
        let (graph, log) = with_capture_log(stream, side, alloc, || Graph::capture(stream, f))?;
        Ok(TrackedGraph {
            graph,
            gates: gates_of(&log.uses),
            uses: log.uses,
            keep: log.keep,
            last: Mutex::new(None),
            replayed: AtomicBool::new(false),
            broken: AtomicBool::new(false),
        })
    }

    /// Enqueues one replay on `stream`, ordered after the conflicting uses
    /// of the graph's buffers and recorded as a use of each (a write where
    /// the captured work wrote it).
    ///
    /// # Errors
    /// As [`Graph::launch_on`]; a driver error if an ordering event cannot
    /// be waited for or recorded (a buffer that cannot record its use is
    /// then never freed).
    pub fn launch_on(&self, stream: &CudaStream) -> Result<()> {
        self.graph.check_stream(stream)?;
        if is_capture_stream(stream) {
            // Its uses would be recorded inside the outer capture, where
            // nothing outside it could wait for them.
            return Err(Error::Capture(
                "a graph replay cannot be captured into another graph".into(),
            ));
        }
        set_current(self.graph.context())?;
        // No host access to shared pinned memory the graph uses runs while
        // the replay is ordered, enqueued and recorded (an access that
        // comes after waits for the replay).
        let _held: Vec<_> = self.gates.iter().filter_map(|u| u.hold()).collect();
        for (u, write) in &self.uses {
            u.before(stream, *write, crate::tracking::WHOLE)?;
        }
        self.graph.launch_on(stream)?;
        self.replayed.store(true, Ordering::Release);
        // One event after the replay, shared by every buffer's use record
        // (and kept as the graph's last replay).
        let mark = UseMark::new(stream);
        let recorded = mark.event().map(|ev| {
            *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(ev.clone());
        });
        if recorded.is_err() {
            // Nothing can tell when this replay ends: keep what it reads
            // forever rather than release it early.
            self.broken.store(true, Ordering::Release);
        }
        // Every buffer's use is recorded, even after one fails (a failed
        // mark breaks each record: those buffers are never freed).
        let mut first = Ok(());
        for (u, write) in &self.uses {
            let r = u.record(&mark, *write, crate::tracking::WHOLE);
            if first.is_ok() {
                first = r;
            }
        }
        recorded.and(first)
    }

    /// Captures new work for the same graph, as [`TrackedGraph::capture`]
    /// does, and makes it the graph: in place (`cuGraphExecUpdate`) when
    /// the topology is unchanged, else by instantiating it anew
    /// ([`Graph::recapture`]). The buffers and kept values of the old work
    /// are let go after its replays in flight.
    ///
    /// # Errors
    /// As [`TrackedGraph::capture`]; on error the graph is unchanged.
    pub fn recapture(
        &mut self,
        stream: &Arc<CudaStream>,
        side: &[Arc<CudaStream>],
        alloc: &Arc<CudaStream>,
        f: impl FnOnce(&Arc<CudaStream>) -> Result<()>,
    ) -> Result<GraphUpdate> {
        let graph = &mut self.graph;
        let (how, log) = with_capture_log(stream, side, alloc, || graph.recapture(stream, f))?;
        // The old work's buffers: each record orders its own free after the
        // replays recorded in it. Its kept values: after its last replay.
        self.gates = gates_of(&log.uses);
        self.uses = log.uses;
        let old_keep = std::mem::replace(&mut self.keep, log.keep);
        let old_last = self
            .last
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let replayed = self.replayed.swap(false, Ordering::AcqRel);
        if self.broken.load(Ordering::Acquire) {
            std::mem::forget(old_keep);
        } else {
            release_after_replays(old_keep, old_last, replayed);
        }
        Ok(how)
    }

    /// Keeps `value` as long as the graph, and until its last replay is
    /// done (for what the captured work reads: modules, staging memory).
    pub fn keep(&mut self, value: impl Send + 'static) {
        self.keep.push(Box::new(value));
    }

    /// The buffers the graph uses, and how many of them it writes.
    pub fn buffers(&self) -> (usize, usize) {
        let writes = self.uses.iter().filter(|(_, w)| *w).count();
        (self.uses.len(), writes)
    }

    /// The graph itself.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }
}

/// The uses among `uses` that have a gate, in address order.
fn gates_of(uses: &[(Arc<UseRecord>, bool)]) -> Vec<Arc<UseRecord>> {
    let mut gates: Vec<_> = uses
        .iter()
        .filter(|(u, _)| u.has_gate())
        .map(|(u, _)| u.clone())
        .collect();
    gates.sort_by_key(|u| Arc::as_ptr(u) as usize);
    gates
}

/// Releases `keep` once the replays before `last`'s record are done (or at
/// once, without blocking, if there were none).
fn release_after_replays(
    keep: Vec<Box<dyn Any + Send>>,
    last: Option<SharedEvent>,
    replayed: bool,
) {
    if keep.is_empty() {
        return;
    }
    match last {
        // After the last replay (launches of one executable graph run in
        // order, so it is the last to finish).
        Some(last) if replayed => {
            crate::reclaim::defer_until(move || last.readiness(), move || drop(keep));
        }
        _ => crate::reclaim::defer(move || drop(keep)),
    }
}

impl Drop for TrackedGraph {
    fn drop(&mut self) {
        let keep = std::mem::take(&mut self.keep);
        if self.broken.load(Ordering::Acquire) {
            std::mem::forget(keep);
            return;
        }
        let replayed = self.replayed.load(Ordering::Acquire);
        let last = self
            .last
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        release_after_replays(keep, last, replayed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn graph_is_send_but_not_sync() {
        fn send<T: Send>() {}
        send::<Graph>();
        // `Graph: !Sync` is checked by a compile-fail doctest on the type.
    }

    #[test]
    fn values_kept_by_a_graph_never_replayed_are_released_without_a_gpu() {
        use std::sync::atomic::AtomicBool;
        struct Flag(Arc<AtomicBool>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let dropped = Arc::new(AtomicBool::new(false));
        release_after_replays(vec![Box::new(Flag(dropped.clone()))], None, false);
        let t = std::time::Instant::now();
        while !dropped.load(Ordering::SeqCst) {
            assert!(
                t.elapsed() < std::time::Duration::from_secs(5),
                "not released"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    #[test]
    fn update_kinds_compare() {
        assert_ne!(GraphUpdate::InPlace, GraphUpdate::Reinstantiated);
    }
}
