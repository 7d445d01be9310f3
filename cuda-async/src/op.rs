//! The [`DeviceOp`] trait and its extension trait [`DeviceOpExt`].

use std::future::IntoFuture;
use std::sync::Arc;

use cuda_core::cudarc::driver::CudaStream;
use cuda_core::Result;

use crate::combinators::{Boxed, Map, Shared, Then, Timed, Zip};
use crate::context::ExecutionContext;
use crate::exec::IdleSync;
use crate::future::DeviceFuture;
use crate::policy::{default_policy, SchedulingPolicy};

/// A lazy description of GPU work (allocations, copies, kernel launches).
///
/// Building an op touches no stream; the work is enqueued only when the op
/// is executed: by `.sync()`, `.sync_on(&stream)`, `.await`,
/// `.schedule(&policy)` or `unsafe async_on(&stream)` (see
/// [`DeviceOpExt`]). Ops are `Send`: they cross threads, live in
/// collections, and can be spawned on an executor.
///
/// # Every op can be awaited
///
/// `IntoFuture` is part of the trait's contract (a supertrait), so `.await`
/// works wherever an op is named: a concrete op, an `impl DeviceOp<Output =
/// T>` a function returns, a generic `O: DeviceOp`, a [`BoxedOp`](crate::BoxedOp).
/// `.await` runs the op on the default policy, as
/// [`into_device_future`](DeviceOpExt::into_device_future) does; use
/// [`schedule`](DeviceOpExt::schedule) to pick the policy.
///
/// ```no_run
/// use cuda_async::prelude::*;
/// use cuda_async::HostBuffer;
///
/// fn pipeline(x: Vec<f32>) -> impl DeviceOp<Output = HostBuffer<f32>> { h2d(x).then(d2h) }
///
/// async fn service(x: Vec<f32>) -> Result<(), cuda_async::Error> {
///     let y = pipeline(x).await?;
///     assert_eq!(y.len(), 3);
///     Ok(())
/// }
///
/// // Generic code and boxed ops too.
/// async fn run_any<O: DeviceOp>(op: O) -> cuda_async::Result<cuda_async::OutputOf<O>> {
///     op.await
/// }
/// async fn run_boxed(op: BoxedOp<'static, u32>) -> cuda_async::Result<u32> {
///     op.await
/// }
/// ```
///
/// # Naming the output in generic code
///
/// `IntoFuture` has an associated type called `Output` too (the op's
/// `Result`), so for a type parameter `O: DeviceOp` the compiler cannot tell
/// which one `O::Output` means (error E0221). Write
/// [`OutputOf<O>`](crate::OutputOf) or `<O as DeviceOp>::Output`. Bindings
/// such as `impl DeviceOp<Output = T>` and `O: DeviceOp<Output = T>` are
/// unaffected: they name this trait's `Output`. This is the price of
/// `.await` on every op; a blanket `IntoFuture` impl, which would avoid it,
/// is not allowed for a trait of another crate (the orphan rule).
///
/// # Implementing it
///
/// Implementing `DeviceOp` by hand is for new primitive ops; composing the
/// existing ones with [`DeviceOpExt`] covers most needs. A hand-written op
/// adds one line, [`awaitable!`](crate::awaitable), which provides the
/// `IntoFuture` half:
///
/// ```no_run
/// use cuda_async::prelude::*;
/// use cuda_async::{ExecutionContext, Result};
///
/// /// Produces its value after checking that it runs on a local GPU.
/// struct OnLocalGpu<T>(T);
///
/// impl<T: Send> DeviceOp for OnLocalGpu<T> {
///     type Output = T;
///     unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<T> {
///         ctx.cuda_stream()?; // an error on a remote context
///         Ok(self.0)
///     }
/// }
/// cuda_async::awaitable!(impl[T: Send] for OnLocalGpu<T>);
///
/// # async fn f() -> Result<()> {
/// let v = OnLocalGpu(7u8).await?;
/// # Ok(()) }
/// ```
pub trait DeviceOp:
    Send
    + Sized
    + IntoFuture<Output = Result<<Self as DeviceOp>::Output>, IntoFuture = DeviceFuture<Self>>
{
    /// What the op produces. Buffers in it may still be being written by the
    /// GPU when `execute` returns; this crate's buffer types order every later
    /// use after that work themselves.
    type Output: Send;

    /// Enqueues the op's work on `ctx`'s stream and returns its output.
    ///
    /// # Errors
    /// Whatever stopped the op from being enqueued. Work enqueued before the
    /// error stays enqueued; the caller keeps `ctx`'s retained values alive
    /// until the stream has passed it.
    ///
    /// # Safety
    /// The caller must (1) keep everything handed to
    /// [`ExecutionContext::retain`] alive until the stream has passed the work
    /// enqueued here, and (2) not let host code read memory that the output
    /// refers to before that point, except through types that wait for the
    /// GPU themselves ([`cuda_core::PinnedBuffer`], [`cuda_core::DeviceBuffer`]).
    /// The executors in this crate (`sync`, `DeviceFuture`) do both.
    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<<Self as DeviceOp>::Output>;
}

/// Combinators and executors for every [`DeviceOp`].
pub trait DeviceOpExt: DeviceOp {
    /// Feeds this op's output to `f`, which returns the next op; both run in
    /// order on the same stream.
    ///
    /// `f` runs on the host when the chain is *enqueued*, before the GPU has
    /// done the work: the values it gets are handles to in-flight results.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use cuda_async::prelude::*;
    /// let host = h2d(vec![1.0f32, 2.0, 3.0]).then(d2h).sync()?;
    /// assert_eq!(host.as_slice()?, &[1.0, 2.0, 3.0]);
    /// # Ok::<(), cuda_async::Error>(())
    /// ```
    fn then<B, F>(self, f: F) -> Then<Self, F>
    where
        B: DeviceOp,
        F: FnOnce(<Self as DeviceOp>::Output) -> B + Send,
    {
        Then::new(self, f)
    }

    /// Measures on the GPU the time this op's work takes: an event before
    /// and after it on its stream (work it forks onto other streams joins
    /// back before the end). The output comes with a [`GpuTime`](crate::GpuTime), whose
    /// [`elapsed`](crate::GpuTime::elapsed) is known once the stream has passed
    /// the end (after `.sync()` or `.await`). On a remote policy the node
    /// times the op's commands the same way, with two events on the
    /// lease's stream, and the reply carries the time (transfers that take
    /// the data path, outside the submission's message, are not in it).
    /// The time is the stream's, from the first event to the second: where
    /// the GPU waits in between for the host to enqueue the op's next
    /// command (on an idle GPU, say, while the enqueuing thread is held
    /// up), the wait is in it. Work already queued ahead of the op keeps
    /// the GPU busy while the op is enqueued, and the span then holds the
    /// op's GPU work alone. Not inside a graph capture (`Error::Capture`).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use cuda_async::prelude::*;
    /// let (buf, t) = zeros::<f32>(1 << 24).timed().sync()?;
    /// println!("{} floats zeroed in {:?} of GPU time", buf.len(), t.elapsed()?);
    /// # Ok::<(), cuda_async::Error>(())
    /// ```
    fn timed(self) -> Timed<Self> {
        Timed::new(self)
    }

    /// Transforms the output on the host (when enqueued, like `then`).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use cuda_async::prelude::*;
    /// assert_eq!(value(20).map(|x| x * 2 + 2).sync()?, 42);
    /// # Ok::<(), cuda_async::Error>(())
    /// ```
    fn map<U, F>(self, f: F) -> Map<Self, F>
    where
        U: Send,
        F: FnOnce(<Self as DeviceOp>::Output) -> U + Send,
    {
        Map::new(self, f)
    }

    /// Runs this op and `other` concurrently, on different streams of the
    /// pool (forked from the parent stream and joined back with events).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use cuda_async::prelude::*;
    /// let (a, b) = h2d(vec![1u32; 4]).zip(h2d(vec![2u32; 4])).sync()?;
    /// assert_eq!((a.len(), b.len()), (4, 4));
    /// # Ok::<(), cuda_async::Error>(())
    /// ```
    fn zip<B: DeviceOp>(self, other: B) -> Zip<(Self, B)> {
        Zip::new((self, other))
    }

    /// Makes the op cloneable: it runs once, the first time any clone is
    /// executed; later executions wait for that work (on their own streams,
    /// by event) and get a clone of the output.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use std::sync::Arc;
    /// use cuda_async::prelude::*;
    /// let x = h2d(vec![1.0f32; 1024]).map(Arc::new).shared();
    /// let (a, b) = x.clone().zip(x).sync()?;
    /// assert!(Arc::ptr_eq(&a, &b));
    /// # Ok::<(), cuda_async::Error>(())
    /// ```
    fn shared(self) -> Shared<Self>
    where
        <Self as DeviceOp>::Output: Clone,
    {
        Shared::new(self)
    }

    /// Erases the op's type (for collections of different ops).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use cuda_async::prelude::*;
    /// let ops: Vec<BoxedOp<'static, i32>> = vec![value(1).boxed(), value(2).map(|x| x * 10).boxed()];
    /// assert_eq!(join_all(ops).sync()?, vec![1, 20]);
    /// # Ok::<(), cuda_async::Error>(())
    /// ```
    fn boxed<'a>(self) -> Boxed<'a, <Self as DeviceOp>::Output>
    where
        Self: 'a,
    {
        Boxed::new(self)
    }

    /// Runs the op on the default device's pool and blocks the calling
    /// thread until the GPU is done. Each thread keeps to one stream of the
    /// pool (given round-robin on its first call), so threads that each
    /// launch and wait do not queue behind each other. For scripts and tests; inside
    /// an async runtime use `.await`.
    ///
    /// An op that enqueues no GPU work (`value`, a `then` whose closure only
    /// returns `value`s, a `shared` op that has already run and finished)
    /// returns without synchronizing; buffers in its output still order
    /// their own later uses after the work that wrote them.
    ///
    /// # Errors
    /// Any error of the op; the sticky error if the GPU faulted.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use cuda_async::prelude::*;
    /// let v = h2d(vec![7u8; 3]).then(d2h).sync()?.to_vec()?;
    /// assert_eq!(v, vec![7, 7, 7]);
    /// # Ok::<(), cuda_async::Error>(())
    /// ```
    fn sync(self) -> Result<<Self as DeviceOp>::Output> {
        let ctx = default_policy()?.select_for_thread();
        crate::exec::run_blocking(self, ctx, IdleSync::Skip, None)
    }

    /// [`DeviceOpExt::sync`] that waits at most `timeout` for the GPU.
    /// After it the op's work goes on: what it uses stays allocated until
    /// it ends (the output's buffers wait for it before they are freed),
    /// and the call returns [`Error::Timeout`](crate::Error::Timeout).
    ///
    /// # Errors
    /// [`Error::Timeout`](crate::Error::Timeout); as [`DeviceOpExt::sync`].
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use cuda_async::prelude::*;
    /// match zeros::<f32>(1 << 20).sync_timeout(Duration::from_secs(1)) {
    ///     Ok(buf) => println!("{} floats", buf.len()),
    ///     Err(cuda_async::Error::Timeout { waited }) => eprintln!("still running after {waited:?}"),
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok::<(), cuda_async::Error>(())
    /// ```
    fn sync_timeout(self, timeout: std::time::Duration) -> Result<<Self as DeviceOp>::Output> {
        let ctx = default_policy()?.select_for_thread();
        crate::exec::run_blocking(self, ctx, IdleSync::Skip, Some(timeout))
    }

    /// [`DeviceOpExt::sync_with`] that waits at most `timeout`, as
    /// [`DeviceOpExt::sync_timeout`] does (remotely: for the reply; the
    /// submission stays sent and its reply is dropped when it comes).
    ///
    /// # Errors
    /// [`Error::Timeout`](crate::Error::Timeout); as [`DeviceOpExt::sync_with`].
    fn sync_with_timeout<P: SchedulingPolicy + ?Sized>(
        self,
        policy: &P,
        timeout: std::time::Duration,
    ) -> Result<<Self as DeviceOp>::Output> {
        crate::exec::run_blocking(self, policy.select()?, IdleSync::Skip, Some(timeout))
    }

    /// Runs the op on `stream` (which other code may have created: interop
    /// with other CUDA libraries) and blocks until the stream is done:
    /// it synchronizes `stream` even when the op enqueued nothing, so work
    /// other code put on it earlier is done too. Concurrent combinators fork
    /// onto the device's pool and join back to `stream`.
    ///
    /// # Errors
    /// As [`DeviceOpExt::sync`].
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use cuda_async::prelude::*;
    /// let ctx = cuda_async::Device::new(0)?.context().clone();
    /// let theirs = ctx.new_stream().unwrap();
    /// let host = h2d(vec![1i32, 2]).then(d2h).sync_on(&theirs)?;
    /// assert_eq!(host.as_slice()?, &[1, 2]);
    /// # Ok::<(), cuda_async::Error>(())
    /// ```
    fn sync_on(self, stream: &Arc<CudaStream>) -> Result<<Self as DeviceOp>::Output> {
        let ctx = ExecutionContext::on_stream(stream)?;
        crate::exec::run_blocking(self, ctx, IdleSync::Always, None)
    }

    /// Captures the op into a CUDA graph on a private stream of the default
    /// device, without running it; [`CudaGraph::launch`](crate::CudaGraph::launch)
    /// replays it with one driver call. See [`crate::graph`] for what is
    /// captured and how replays are ordered.
    ///
    /// # Errors
    /// [`Error::Capture`](crate::Error::Capture) naming what cannot be
    /// captured (a download into host memory, a synchronize...); the op's
    /// own errors; driver errors. The capture has ended in every case.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use cuda_async::prelude::*;
    /// let graph = zeros::<f32>(1 << 20).graph()?; // nothing runs yet
    /// graph.launch().sync()?; // zeroes the graph's buffer
    /// let host = d2h(graph.output()).sync()?;
    /// # Ok::<(), cuda_async::Error>(())
    /// ```
    fn graph(self) -> Result<crate::CudaGraph<<Self as DeviceOp>::Output>> {
        crate::graph::capture_default(self)
    }

    /// [`DeviceOpExt::graph`] on `stream`, which no other thread may use
    /// while the capture runs (work enqueued on a capturing stream joins the
    /// graph); concurrent arms fork onto a private pool.
    ///
    /// # Errors
    /// As [`DeviceOpExt::graph`].
    fn graph_on(
        self,
        stream: &Arc<CudaStream>,
    ) -> Result<crate::CudaGraph<<Self as DeviceOp>::Output>> {
        crate::graph::capture_on(self, stream)
    }

    /// [`DeviceOpExt::graph`] on a remote session's GPU: the op is recorded
    /// once and sent to the node as a graph's body (its allocations are
    /// made there at once; nothing else runs); the node keeps it, and each
    /// [`CudaGraph::launch`](crate::CudaGraph::launch) run with `policy` is
    /// one small command. Blocks until the node has it (as
    /// [`sync_with`](DeviceOpExt::sync_with) does). What the graph uses
    /// lives on the node as long as the graph; dropping the graph frees it
    /// there, after the launches submitted before.
    ///
    /// # Errors
    /// [`Error::Capture`](crate::Error::Capture) for what a graph kept on a
    /// node cannot hold (a download, `timed`, a host step, another graph);
    /// whatever the submission fails with.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn f(remote: &cuda_async::RemotePolicy, k: cuda_async::Kernel) -> cuda_async::Result<()> {
    /// use cuda_async::prelude::*;
    /// use cuda_async::LaunchConfig;
    /// let n = 1 << 20;
    /// // SAFETY: the kernel touches x[0..n) of an n-element buffer.
    /// let graph = zeros::<f32>(n as usize)
    ///     .then(move |x| unsafe { launch(&k, LaunchConfig::for_num_elems(n), (x, 1.0f32, n)) })
    ///     .map(|(x, _, _)| x)
    ///     .graph_with(remote)?;
    /// for _ in 0..10 {
    ///     graph.launch().sync_with(remote)?; // one small message each
    /// }
    /// let x = graph.launch().then(|()| d2h(graph.output())).sync_with(remote)?;
    /// # Ok(()) }
    /// ```
    fn graph_with(
        self,
        policy: &crate::RemotePolicy,
    ) -> Result<crate::CudaGraph<<Self as DeviceOp>::Output>> {
        crate::graph::capture_remote(self, policy)
    }

    /// [`DeviceOpExt::graph_with`] as a future, for async code (it does not
    /// block the runtime's thread while the node takes the graph).
    ///
    /// # Errors
    /// As [`DeviceOpExt::graph_with`] (at once for what the policy refuses,
    /// else from the future).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn f(remote: &cuda_async::RemotePolicy) -> cuda_async::Result<()> {
    /// use cuda_async::prelude::*;
    /// let graph = zeros::<f32>(1024).graph_with_async(remote)?.await?;
    /// graph.launch().schedule(remote)?.await?;
    /// # Ok(()) }
    /// ```
    fn graph_with_async(
        self,
        policy: &crate::RemotePolicy,
    ) -> Result<
        impl std::future::Future<Output = Result<crate::CudaGraph<<Self as DeviceOp>::Output>>> + Send,
    > {
        crate::graph::capture_remote_async(self, policy)
    }

    /// The op that keeps this op on a remote session's node as a
    /// [`Prepared`](crate::remote::Prepared) submission: recorded and
    /// checked once, then run by id with new bytes for its uploads, its
    /// downloads returned at each run (see
    /// [`Prepared::run`](crate::remote::Prepared::run)). Run it with a
    /// [`RemotePolicy`](crate::RemotePolicy): nothing but the body's
    /// allocations runs now. The op's output is dropped (the buffers in it
    /// live, and are freed, with the prepared submission).
    ///
    /// # Errors
    /// On a local context, [`Error::InvalidArgument`](crate::Error::InvalidArgument);
    /// [`Error::Capture`](crate::Error::Capture) for what a prepared body
    /// cannot hold (`timed`, a host step or a copy into host memory, a
    /// graph, a cuRAND fill); whatever the submission fails with.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn f(remote: &cuda_async::RemotePolicy) -> cuda_async::Result<()> {
    /// use cuda_async::prelude::*;
    /// let echo = h2d(vec![0u32; 4]).then(d2h).prepare().sync_with(remote)?;
    /// let out = echo.run(&[&[1u32, 2, 3, 4][..]])?.sync_with(remote)?;
    /// assert_eq!(out.to_vec::<u32>(0)?, [1, 2, 3, 4]);
    /// # Ok(()) }
    /// ```
    fn prepare(self) -> crate::remote::Prepare<Self> {
        crate::remote::Prepare { op: self }
    }

    /// Runs the op on a context `policy` picks and blocks the calling
    /// thread until it is done: a local GPU's policy or a remote session's
    /// ([`RemotePolicy`](crate::RemotePolicy)), with no async runtime
    /// needed for either. Inside an async runtime use
    /// `.schedule(&policy)?.await`: blocking a runtime thread that also
    /// drives a remote session's I/O would wait forever (a `BlockingLease`
    /// of `cuda-lease` owns its own I/O thread and is safe here).
    ///
    /// # Errors
    /// Whatever the policy fails with; any error of the op.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use cuda_async::prelude::*;
    /// let local = StreamPoolRoundRobin::default_for(&cuda_async::Device::new(0)?)?;
    /// let v = h2d(vec![1u32, 2]).then(d2h).sync_with(&local)?.to_vec()?;
    /// assert_eq!(v, vec![1, 2]);
    /// # Ok::<(), cuda_async::Error>(())
    /// ```
    fn sync_with<P: SchedulingPolicy + ?Sized>(
        self,
        policy: &P,
    ) -> Result<<Self as DeviceOp>::Output> {
        crate::exec::run_blocking(self, policy.select()?, IdleSync::Skip, None)
    }

    /// Enqueues the op on `stream` and returns at once, without waiting.
    /// Values the op retains are released on a background thread after the
    /// stream passes the work.
    ///
    /// # Errors
    /// Any error raised while enqueuing.
    ///
    /// # Safety
    /// The output may refer to work still running on `stream`. This crate's
    /// buffers wait for it themselves; for anything else in the output the
    /// caller must order host access after the stream's work (e.g.
    /// `stream.synchronize()`).
    unsafe fn async_on(self, stream: &Arc<CudaStream>) -> Result<<Self as DeviceOp>::Output> {
        let ctx = ExecutionContext::on_stream(stream)?;
        // SAFETY: forwarded to our caller (see `# Safety`).
        unsafe { crate::exec::run_detached(self, ctx) }
    }

    /// Picks the execution context now (with `policy`) and returns a future
    /// that enqueues the work when first polled.
    ///
    /// # Errors
    /// Whatever the policy fails with.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn f() -> Result<(), cuda_async::Error> {
    /// use cuda_async::prelude::*;
    /// let policy = StreamPoolRoundRobin::default_for(&cuda_async::Device::new(0)?)?;
    /// let buf = zeros::<f32>(1 << 20).schedule(&policy)?.await?;
    /// # Ok(()) }
    /// ```
    fn schedule<P: SchedulingPolicy + ?Sized>(self, policy: &P) -> Result<DeviceFuture<Self>> {
        Ok(DeviceFuture::ready(self, policy.select()?))
    }

    /// A future that runs the op on the default policy: what `.await` does
    /// (an explicit name for it, e.g. to store the future in a field).
    fn into_device_future(self) -> DeviceFuture<Self> {
        DeviceFuture::lazy(self)
    }
}

impl<T: DeviceOp> DeviceOpExt for T {}

/// The output type of op `O`: `<O as DeviceOp>::Output`, for generic code
/// (see [`DeviceOp`]'s "Naming the output in generic code").
pub type OutputOf<O> = <O as DeviceOp>::Output;

/// Makes a hand-written [`DeviceOp`] awaitable: implements `IntoFuture`
/// for it, running it on the default policy when awaited (the half of the
/// `DeviceOp` contract that the trait cannot provide itself).
///
/// Forms: `awaitable!(MyOp);` for a type without generic parameters, and
/// `awaitable!(impl[T: Send, ...] for MyOp<T, ...> where ...);` with the
/// same generics and bounds as its `DeviceOp` impl.
///
/// ```no_run
/// use cuda_async::prelude::*;
/// use cuda_async::{ExecutionContext, Result};
///
/// struct Answer;
/// impl DeviceOp for Answer {
///     type Output = u32;
///     unsafe fn execute(self, _ctx: &mut ExecutionContext) -> Result<u32> {
///         Ok(42)
///     }
/// }
/// cuda_async::awaitable!(Answer);
///
/// # async fn f() -> Result<()> {
/// assert_eq!(Answer.await?, 42);
/// # Ok(()) }
/// ```
#[macro_export]
macro_rules! awaitable {
    (impl[$($g:tt)*] for $ty:ty $(where $($w:tt)*)?) => {
        impl<$($g)*> ::core::future::IntoFuture for $ty
        $(where $($w)*)?
        {
            type Output = $crate::Result<<$ty as $crate::DeviceOp>::Output>;
            type IntoFuture = $crate::DeviceFuture<$ty>;
            fn into_future(self) -> Self::IntoFuture {
                $crate::DeviceOpExt::into_device_future(self)
            }
        }
    };
    ($ty:ty) => {
        $crate::awaitable!(impl[] for $ty);
    };
}
pub(crate) use crate::awaitable as impl_into_future;
