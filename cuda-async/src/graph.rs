//! CUDA graphs of ops: capture a [`DeviceOp`] once, replay it with one
//! driver call as an op of its own.
//!
//! [`DeviceOpExt::graph`] executes the op while
//! a private stream of the device captures (thread-local capture mode, so
//! other threads' CUDA work is unaffected); `zip` and `join_all` arms fork
//! onto private streams that join the capture through their events. Nothing
//! runs during the capture: the result is a [`CudaGraph`] that owns the
//! op's output (device buffers, typically) and replays the work on
//! [`CudaGraph::launch`], an op like any other (`.sync()`, `.await`,
//! `then`, any local policy).
//!
//! Soundness, as for every op:
//! - each buffer the graph uses lives as long as the graph, even if its
//!   handle is dropped right after the capture;
//! - each replay is ordered like a use of each of those buffers on the
//!   replay's stream: after their earlier conflicting uses on any stream,
//!   and before their later ones (their events record the replay);
//! - replays of one graph run one after another (the driver orders the
//!   launches of one executable graph);
//! - memory the captured copies read (staging blocks, modules) is released
//!   only after the last replay, never by blocking.
//!
//! What cannot be captured is an [`Error::Capture`](crate::Error::Capture) naming it, and the
//! capture ends either way (also on a panic): copies between the device
//! and a [`PinnedBuffer`](crate::PinnedBuffer) or fresh host memory (`d2h`;
//! `copy_d2h` and `copy_h2d` with a `PinnedBuffer`), a synchronize, a wait on work outside the capture (an op that
//! orders itself after an unfinished `shared` op of another execution).
//! Allocations inside the op (`zeros`, `h2d`) are made once, outside the
//! graph; `zeros` is zeroed again at every replay, and `h2d` copies the same
//! host data (staged at capture) at every replay.
//!
//! Copies with a [`SharedPinnedBuffer`](crate::SharedPinnedBuffer) are
//! captured: `copy_h2d` from one uploads what the host last wrote there at
//! each replay, and `copy_d2h` into one downloads at each replay. The host
//! reaches the memory through `read` and `write` closures, which wait for
//! the replays launched before them; a replay launched while a closure runs
//! waits for it. Host steps that run at each replay are
//! [`host_step_each`](crate::host_step_each).
//!
//! # Examples
//!
//! ```no_run
//! use cuda_async::prelude::*;
//! let m = cuda_async::Module::cuda(
//!     r#"extern "C" __global__ void inc(float* x, unsigned n) {
//!         unsigned i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] += 1.0f; }"#,
//!     &[],
//! )?;
//! let inc = m.kernel("inc")?;
//! let n = 1024u32;
//! let cfg = cuda_async::LaunchConfig::for_num_elems(n);
//! let mut x = Some(zeros::<f32>(n as usize).sync()?);
//! // Capture 100 launches on x (nothing runs yet).
//! let mut op = value(x.take().unwrap()).boxed();
//! for _ in 0..100 {
//!     let k = inc.clone();
//!     // SAFETY: inc touches x[0..n) of an n-element buffer.
//!     op = op.then(move |x| unsafe { launch(&k, cfg, (x, n)) }).map(|(x, _)| x).boxed();
//! }
//! let graph = op.graph()?;
//! graph.launch().sync()?; // 100 kernels, one driver call
//! graph.launch().sync()?;
//! let y = d2h(graph.output()).sync()?;
//! assert!(y.as_slice()?.iter().all(|v| *v == 200.0));
//! # Ok::<(), cuda_async::Error>(())
//! ```

use std::fmt;
use std::sync::{Arc, Mutex};

use cuda_core::cudarc::driver::{CudaStream, DeviceRepr};
use cuda_core::{AnyBitPattern, Device, GraphUpdate, Result, TrackedGraph};

use crate::buffer::DeviceBuffer;
use crate::context::ExecutionContext;
use crate::context::GraphRef;
use crate::exec::{check_poison, execute_guarded, note};
use crate::op::{DeviceOp, DeviceOpExt};
use crate::policy::default_device;
use crate::remote::{CaptureRemote, RemoteGraph, RemotePolicy};
use crate::stream_pool::{StreamPool, DEFAULT_POOL_STREAMS};

/// A captured op: an instantiated CUDA graph that owns the op's output and
/// everything its replays use. Replay it with [`CudaGraph::launch`].
///
/// `Send` and `Sync`: replays from several threads are serialized on the
/// graph (the driver requires it) and ordered on the GPU.
pub struct CudaGraph<T> {
    home: GraphHome,
    output: Option<T>,
}

/// Where a graph lives and replays.
enum GraphHome {
    Local {
        graph: Mutex<TrackedGraph>,
        /// Where recaptures run: the capture stream, its fork pool and
        /// the stream allocations go to.
        streams: CaptureStreams,
    },
    /// Kept on a remote session's node, captured over `streams` streams.
    Remote { graph: RemoteGraph, streams: u32 },
}

struct CaptureStreams {
    stream: Arc<CudaStream>,
    pool: Arc<StreamPool>,
    alloc: Arc<CudaStream>,
}

impl<T> fmt::Debug for CudaGraph<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("CudaGraph");
        match &self.home {
            GraphHome::Local { graph, streams } => d
                .field("device", &streams.stream.context().ordinal())
                .field("graph", graph),
            GraphHome::Remote { graph, .. } => d.field("graph", graph),
        };
        d.field("output", &std::any::type_name::<T>()).finish()
    }
}

/// Captures `op` on `stream`, forking concurrent arms onto `pool` (whose
/// streams, like `stream`, no other thread uses during the capture).
pub(crate) fn capture<O: DeviceOp>(
    op: O,
    stream: &Arc<CudaStream>,
    pool: Arc<StreamPool>,
) -> Result<CudaGraph<<O as DeviceOp>::Output>> {
    check_poison()?;
    let alloc = Device::of_stream(stream).new_stream()?;
    let streams = CaptureStreams {
        stream: stream.clone(),
        pool,
        alloc,
    };
    let mut output = None;
    let mut ctx = streams.context();
    let captured = TrackedGraph::capture(stream, streams.pool.streams(), &streams.alloc, |_| {
        // SAFETY: nothing runs during a capture; what the op retains is
        // handed to the graph below and released after its last replay, and
        // its output holds device buffers (host reads cannot be captured).
        output = Some(unsafe { execute_guarded(op, &mut ctx) }?);
        Ok(())
    });
    let retained = ctx.take_retained();
    // On error nothing captured ever ran: the retained values and any output
    // can go now.
    let mut graph = captured.map_err(note)?;
    if !retained.is_empty() {
        graph.keep(retained);
    }
    Ok(CudaGraph {
        home: GraphHome::Local {
            graph: Mutex::new(graph),
            streams,
        },
        output,
    })
}

/// Captures on `policy`'s session: the graph is kept on its node.
pub(crate) fn capture_remote<O: DeviceOp>(
    op: O,
    policy: &RemotePolicy,
) -> Result<CudaGraph<<O as DeviceOp>::Output>> {
    let captured = CaptureRemote { op }.sync_with(policy)?;
    Ok(CudaGraph::kept(captured, policy.streams()))
}

/// [`capture_remote`] as a future.
pub(crate) fn capture_remote_async<O: DeviceOp>(
    op: O,
    policy: &RemotePolicy,
) -> Result<impl std::future::Future<Output = Result<CudaGraph<<O as DeviceOp>::Output>>> + Send> {
    let pending = CaptureRemote { op }.schedule(policy)?;
    let streams = policy.streams();
    Ok(async move { Ok(CudaGraph::kept(pending.await?, streams)) })
}

impl<T> CudaGraph<T> {
    /// A graph kept on a node, with the captured op's output.
    fn kept((output, graph): (T, RemoteGraph), streams: u32) -> Self {
        CudaGraph {
            home: GraphHome::Remote { graph, streams },
            output: Some(output),
        }
    }
}

impl CaptureStreams {
    fn context(&self) -> ExecutionContext {
        ExecutionContext::new(
            Device::of_stream(&self.stream),
            self.stream.clone(),
            self.pool.clone(),
        )
    }
}

/// Captures on a fresh private stream of the default device.
pub(crate) fn capture_default<O: DeviceOp>(op: O) -> Result<CudaGraph<<O as DeviceOp>::Output>> {
    let device = Device::new(default_device())?;
    let pool = StreamPool::new(&device, DEFAULT_POOL_STREAMS)?;
    let stream = pool.streams()[0].clone();
    capture(op, &stream, pool)
}

/// Captures on `stream` (which no other thread may use during the capture),
/// forking onto a fresh private pool.
pub(crate) fn capture_on<O: DeviceOp>(
    op: O,
    stream: &Arc<CudaStream>,
) -> Result<CudaGraph<<O as DeviceOp>::Output>> {
    let device = Device::of_stream(stream);
    let pool = StreamPool::new(&device, DEFAULT_POOL_STREAMS)?;
    capture(op, stream, pool)
}

impl<T> CudaGraph<T> {
    /// The op that replays the whole graph on the stream it is given (one
    /// driver call), ordered against every other use of the graph's
    /// buffers. Run it like any op: `.sync()`, `.await`, `.then(..)`,
    /// `.schedule(&policy)` with a local policy. The same graph can be
    /// launched any number of times, from any thread. A use of the graph's
    /// buffers (its output, say) that another thread enqueues while a
    /// replay is being enqueued is not ordered against that replay: await
    /// the replay first (see [`cuda_core::TrackedGraph`]).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn f(graph: cuda_async::CudaGraph<cuda_async::DeviceBuffer<f32>>) -> cuda_async::Result<()> {
    /// use cuda_async::prelude::*;
    /// for _ in 0..10 {
    ///     graph.launch().sync()?;
    /// }
    /// let out = graph.launch().then(|()| d2h(graph.output())).sync()?;
    /// # Ok(()) }
    /// ```
    pub fn launch(&self) -> GraphLaunch<'_, T> {
        GraphLaunch { graph: self }
    }

    /// [`CudaGraph::launch`] as an op that holds the graph by `Arc`, so it
    /// is `'static`: it can be handed to another thread (a
    /// [`SubmitThread`](crate::SubmitThread), a spawned task) while other
    /// tasks share the graph. Replays are ordered as
    /// [`CudaGraph::launch`]'s are.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use std::sync::Arc;
    /// use cuda_async::prelude::*;
    /// use cuda_async::SubmitThread;
    /// # async fn f() -> cuda_async::Result<()> {
    /// let graph = Arc::new(zeros::<f32>(1024).graph()?);
    /// let submit = SubmitThread::new()?;
    /// let pool = StreamPoolRoundRobin::new(&cuda_async::Device::new(0)?, 4)?;
    /// submit.enqueue(graph.launch_owned().schedule(&pool)?).await?;
    /// # Ok(()) }
    /// ```
    pub fn launch_owned(self: &Arc<Self>) -> OwnedGraphLaunch<T> {
        OwnedGraphLaunch {
            graph: self.clone(),
        }
    }

    /// The captured op's output (for instance the buffers it produced):
    /// what each replay recomputes. Ops that use it are ordered after the
    /// replays launched before them.
    ///
    /// # Panics
    /// If the output was taken ([`CudaGraph::take_output`]).
    pub fn output(&self) -> &T {
        self.output
            .as_ref()
            .expect("the graph's output was taken with take_output")
    }

    /// Takes the output out of the graph (the graph keeps replaying into
    /// the same memory; ops on the output stay ordered after its replays).
    pub fn take_output(&mut self) -> Option<T> {
        self.output.take()
    }

    /// Captures the op `f` builds from the graph's output (typically the
    /// same work with other scalars, or on other buffers) and makes it the
    /// graph. When the topology is the same (the same kinds of nodes in the
    /// same dependency order; only kernel arguments, copy addresses or sizes
    /// and memset values differ), the executable graph is updated in place
    /// with `cuGraphExecUpdate` (no re-instantiation, no re-upload: cheap
    /// enough for every few replays); otherwise the new graph is
    /// instantiated and replaces it. The result says which happened.
    /// Replays launched before keep running the old work; ones launched
    /// after run the new one.
    ///
    /// # Errors
    /// As [`DeviceOpExt::graph`]; then the graph keeps its old work, but
    /// its output was moved into `f` and is gone (the graph's replays still
    /// write that memory).
    ///
    /// # Panics
    /// If the output was taken ([`CudaGraph::take_output`]).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn f(mut graph: cuda_async::CudaGraph<cuda_async::DeviceBuffer<f32>>, k: cuda_async::Kernel) -> cuda_async::Result<()> {
    /// use cuda_async::prelude::*;
    /// use cuda_async::GraphUpdate;
    /// let n = 1024u32;
    /// let cfg = cuda_async::LaunchConfig::for_num_elems(n);
    /// // The same launch with another scalar: updated in place.
    /// // SAFETY: the kernel touches y[0..n) of an n-element buffer.
    /// let how = graph.recapture(|y| unsafe { launch(&k, cfg, (y, 0.25f32, n)) }.map(|(y, _, _)| y))?;
    /// assert_eq!(how, GraphUpdate::InPlace);
    /// # Ok(()) }
    /// ```
    pub fn recapture<O, F>(&mut self, f: F) -> Result<GraphUpdate>
    where
        F: FnOnce(T) -> O,
        O: DeviceOp<Output = T>,
    {
        check_poison()?;
        let old = self
            .output
            .take()
            .expect("the graph's output was taken with take_output");
        let op = f(old);
        let (graph, streams) = match &mut self.home {
            GraphHome::Local { graph, streams } => (graph, &*streams),
            GraphHome::Remote { graph, streams } => {
                // Captured anew on the node; the old graph goes after the
                // launches submitted before.
                let policy = RemotePolicy::new(&graph.session).with_streams(*streams);
                let (output, fresh) = CaptureRemote { op }.sync_with(&policy)?;
                *graph = fresh;
                self.output = Some(output);
                return Ok(GraphUpdate::Reinstantiated);
            }
        };
        let mut ctx = streams.context();
        let mut output = None;
        let graph = graph.get_mut().unwrap_or_else(|e| e.into_inner());
        let how = graph.recapture(
            &streams.stream,
            streams.pool.streams(),
            &streams.alloc,
            |_| {
                // SAFETY: as in the first capture.
                output = Some(unsafe { execute_guarded(op, &mut ctx) }?);
                Ok(())
            },
        );
        let retained = ctx.take_retained();
        let how = how.map_err(note)?;
        if !retained.is_empty() {
            graph.keep(retained);
        }
        self.output = output;
        Ok(how)
    }

    /// The op that changes the graph's inputs between replays: `f` gets the
    /// output (return in it the buffers you want to change, e.g. an input
    /// the op took by value), builds an op that writes into it (a
    /// `copy_h2d`, a `d2d`, a kernel) and returns it; when that op runs,
    /// its result becomes the output again. It is ordered like any op: after
    /// the replays launched before it, before the ones launched after.
    ///
    /// If the returned op is dropped without running, the output is gone
    /// with it (the graph keeps replaying into the same memory).
    ///
    /// # Panics
    /// If the output was taken ([`CudaGraph::take_output`]).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn f(mut graph: cuda_async::CudaGraph<cuda_async::DeviceBuffer<f32>>, x: cuda_async::PinnedBuffer<f32>) -> cuda_async::Result<()> {
    /// use cuda_async::prelude::*;
    /// graph.update(|y| copy_h2d(x, y).map(|(_, y)| y)).sync()?; // new data in the captured buffer
    /// graph.launch().sync()?;
    /// # Ok(()) }
    /// ```
    pub fn update<O, F>(&mut self, f: F) -> UpdateOutput<'_, O>
    where
        F: FnOnce(T) -> O,
        O: DeviceOp<Output = T>,
    {
        let out = self
            .output
            .take()
            .expect("the graph's output was taken with take_output");
        UpdateOutput {
            op: f(out),
            slot: &mut self.output,
        }
    }

    /// Kernels, copies, memsets and event nodes in the graph; for a graph
    /// kept on a node, the commands its body replays.
    pub fn node_count(&self) -> usize {
        match &self.home {
            GraphHome::Local { graph, .. } => lock(graph).graph().node_count(),
            GraphHome::Remote { graph, .. } => graph.commands,
        }
    }

    /// The device buffers the graph uses, and how many of them it writes.
    pub fn buffers(&self) -> (usize, usize) {
        match &self.home {
            GraphHome::Local { graph, .. } => lock(graph).buffers(),
            GraphHome::Remote { graph, .. } => graph.buffers,
        }
    }

    /// The local device the graph runs on; `None` for a graph kept on a
    /// remote node ([`CudaGraph::home`] names it).
    pub fn device(&self) -> Option<Device> {
        match &self.home {
            GraphHome::Local { streams, .. } => Some(Device::of_stream(&streams.stream)),
            GraphHome::Remote { .. } => None,
        }
    }

    /// Where the graph lives, e.g. `local GPU 0` or `lease 1a2b... on
    /// node gpu-7`.
    pub fn home(&self) -> String {
        match &self.home {
            GraphHome::Local { streams, .. } => {
                format!("local GPU {}", streams.stream.context().ordinal())
            }
            GraphHome::Remote { graph, .. } => graph.session.describe(),
        }
    }
}

fn lock(graph: &Mutex<TrackedGraph>) -> std::sync::MutexGuard<'_, TrackedGraph> {
    graph.lock().unwrap_or_else(|e| e.into_inner())
}

/// One replay of a [`CudaGraph`], as an op (see [`CudaGraph::launch`]).
#[must_use = "ops do nothing until they are run (.sync(), .await, ...)"]
pub struct GraphLaunch<'g, T> {
    graph: &'g CudaGraph<T>,
}

impl<T> fmt::Debug for GraphLaunch<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GraphLaunch")
            .field("graph", self.graph)
            .finish()
    }
}

impl<T: Send + Sync> DeviceOp for GraphLaunch<'_, T> {
    type Output = ();

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<()> {
        let graph = match &self.graph.home {
            GraphHome::Local { graph, .. } => GraphRef::Local(graph),
            GraphHome::Remote { graph, .. } => GraphRef::Remote(graph),
        };
        ctx.launch_graph(graph, || self.graph.home())
    }
}

crate::op::impl_into_future!(impl['g, T: Send + Sync] for GraphLaunch<'g, T>);

/// One replay of a [`CudaGraph`] shared by `Arc`, as an op (see
/// [`CudaGraph::launch_owned`]).
#[must_use = "ops do nothing until they are run (.sync(), .await, ...)"]
pub struct OwnedGraphLaunch<T> {
    graph: Arc<CudaGraph<T>>,
}

impl<T> fmt::Debug for OwnedGraphLaunch<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedGraphLaunch")
            .field("graph", &*self.graph)
            .finish()
    }
}

impl<T: Send + Sync> DeviceOp for OwnedGraphLaunch<T> {
    type Output = ();

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<()> {
        // SAFETY: the caller's contract, passed on; the graph lives (by
        // this op's `Arc`) as long as the borrowed launch.
        unsafe { self.graph.launch().execute(ctx) }
    }
}
crate::op::impl_into_future!(impl[T: Send + Sync] for OwnedGraphLaunch<T>);

/// Writes new inputs into a graph's output (see [`CudaGraph::update`]).
#[must_use = "ops do nothing until they are run (.sync(), .await, ...)"]
pub struct UpdateOutput<'a, O: DeviceOp> {
    op: O,
    slot: &'a mut Option<<O as DeviceOp>::Output>,
}

impl<O: DeviceOp> fmt::Debug for UpdateOutput<'_, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpdateOutput").finish_non_exhaustive()
    }
}

impl<O: DeviceOp> DeviceOp for UpdateOutput<'_, O> {
    type Output = ();

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<()> {
        // SAFETY: forwarded to our caller.
        let out = unsafe { self.op.execute(ctx) }?;
        *self.slot = Some(out);
        Ok(())
    }
}

crate::op::impl_into_future!(impl['a, O: DeviceOp] for UpdateOutput<'a, O>);

/// A device-resident scalar for graphs: a captured kernel reads it through
/// its address (pass [`DeviceScalar::buffer`] as a `const T*` argument), and
/// [`DeviceScalar::set`] changes its value between replays with a small
/// stream-ordered write (ordered after the replays that read it, and before
/// the ones launched after it). A step counter of a decode loop, a time
/// step of a solver.
///
/// # Examples
///
/// ```no_run
/// # fn f(graph: &cuda_async::CudaGraph<()>, step: &mut cuda_async::DeviceScalar<u32>) -> cuda_async::Result<()> {
/// use cuda_async::prelude::*;
/// for t in 0..100u32 {
///     step.set(t).sync()?; // captured kernels read the new value
///     graph.launch().sync()?;
/// }
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct DeviceScalar<T> {
    buf: DeviceBuffer<T>,
}

impl<T: DeviceRepr + AnyBitPattern> DeviceScalar<T> {
    /// The op that allocates the scalar on the device with `value`.
    pub fn new(value: T) -> impl DeviceOp<Output = DeviceScalar<T>> {
        crate::memory::h2d(vec![value]).map(|buf| DeviceScalar { buf })
    }

    /// The op that writes `value` into the scalar (one element through a
    /// pooled pinned staging block), ordered after earlier uses of the
    /// scalar (graph replays included) and before later ones.
    pub fn set(&mut self, value: T) -> SetScalar<'_, T> {
        SetScalar {
            buf: &mut self.buf,
            value,
        }
    }

    /// The one-element buffer, to pass to kernels (read-only: `const T*`).
    pub fn buffer(&self) -> &DeviceBuffer<T> {
        &self.buf
    }
}

/// Writes a [`DeviceScalar`] (see [`DeviceScalar::set`]).
#[derive(Debug)]
#[must_use = "ops do nothing until they are run (.sync(), .await, ...)"]
pub struct SetScalar<'a, T> {
    buf: &'a mut DeviceBuffer<T>,
    value: T,
}

impl<T: DeviceRepr + AnyBitPattern> DeviceOp for SetScalar<'_, T> {
    type Output = ();

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<()> {
        ctx.write_elems(
            "DeviceScalar::set",
            self.buf,
            0,
            std::slice::from_ref(&self.value),
        )
    }
}

crate::op::impl_into_future!(impl['a, T: DeviceRepr + AnyBitPattern] for SetScalar<'a, T>);

#[cfg(test)]
mod tests {
    use super::*;
    use cuda_core::Error;

    #[test]
    fn graphs_and_their_replays_cross_threads() {
        static_assertions::assert_impl_all!(CudaGraph<crate::DeviceBuffer<f32>>: Send, Sync);
        static_assertions::assert_impl_all!(GraphLaunch<'static, crate::DeviceBuffer<f32>>: Send);
    }

    #[test]
    fn capture_without_a_driver_is_an_error_not_a_panic() {
        if cuda_core::driver_present() {
            return;
        }
        use crate::prelude::*;
        let e = crate::zeros::<f32>(4).graph().unwrap_err();
        assert!(matches!(e, Error::NoDriver), "{e}");
    }
}
