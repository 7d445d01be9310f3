//! Host steps: a host closure that runs when its stream reaches it, with
//! the ops after it ordered after it ([`host_step`], [`host_step_with`]),
//! what `cudaLaunchHostFunc` does.
//!
//! The closure runs on the driver's callback thread, which runs every host
//! function of the process's contexts in turn: it must be short and must
//! not call CUDA (the driver forbids it; an op's `.sync()` inside one would
//! deadlock). While it runs, its stream waits. Its return value, or its
//! panic, comes back in a [`HostResult`].

use std::fmt;
use std::sync::{Arc, Mutex};

use cuda_core::cudarc::driver::{sys, CudaEvent, CudaStream};
use cuda_core::{panic_message, Error, PinnedBuffer, Result};

use crate::context::ExecutionContext;
use crate::op::{impl_into_future, DeviceOp};

/// What a host step's closure returned (or how it panicked), known once
/// its stream has passed it: after the op's `.sync()` or `.await`, at once.
pub struct HostResult<R> {
    slot: Arc<Mutex<Option<std::result::Result<R, String>>>>,
    ran: CudaEvent,
    op: &'static str,
}

impl<R> fmt::Debug for HostResult<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostResult")
            .field("op", &self.op)
            .finish_non_exhaustive()
    }
}

impl<R> HostResult<R> {
    /// The closure's return value. Waits for the stream to pass the step if
    /// it has not yet.
    ///
    /// # Errors
    /// [`Error::HostStep`] with the panic's message if the closure
    /// panicked; a driver error, named, if the stream faulted before the
    /// step (the driver then never runs it).
    pub fn get(self) -> Result<R> {
        self.ran
            .synchronize()
            .map_err(|e| Error::driver("cuEventSynchronize", e))?;
        let taken = self.slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        match taken {
            Some(Ok(r)) => Ok(r),
            Some(Err(message)) => Err(Error::HostStep {
                op: self.op,
                message,
            }),
            // The event follows the host function on its stream, so it
            // has run; a second `get` cannot happen (`self` is taken).
            None => Err(Error::InvalidArgument(format!(
                "{}: the host closure's result is missing",
                self.op
            ))),
        }
    }
}

/// The context's stream for `op`, a host step that runs once: refused on
/// a remote context and inside a graph capture.
fn step_stream(ctx: &ExecutionContext, op: &'static str) -> Result<Arc<CudaStream>> {
    let stream = ctx.cuda_stream_for(op)?;
    refuse_capture(stream, op)?;
    Ok(stream.clone())
}

/// Enqueues `f` on `stream` as a host function, and an event after it;
/// `op` names the op in errors.
fn enqueue<R, F>(stream: &CudaStream, op: &'static str, f: F) -> Result<HostResult<R>>
where
    R: Send + 'static,
    F: FnOnce() -> R + Send + 'static,
{
    let ran = stream
        .context()
        .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
        .map_err(|e| Error::driver("cuEventCreate", e))?;
    let slot = Arc::new(Mutex::new(None));
    let out = slot.clone();
    cuda_core::launch_host_callback(stream, move || {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
            .map_err(|p| panic_message(&*p));
        *out.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
    })?;
    ran.record(stream)
        .map_err(|e| Error::driver("cuEventRecord", e))?;
    Ok(HostResult { slot, ran, op })
}

fn refuse_capture(stream: &Arc<CudaStream>, op: &str) -> Result<()> {
    if cuda_core::graph::is_capturing(stream)? {
        return Err(Error::Capture(format!(
            "{op} cannot be captured into a graph: its closure runs once, and a graph \
             replays; use host_step_each (a closure run at every replay), or run the step \
             between two graph launches"
        )));
    }
    Ok(())
}

/// Op for [`host_step`].
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct HostStep<F> {
    f: F,
}

impl<F> fmt::Debug for HostStep<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostStep").finish_non_exhaustive()
    }
}

/// Runs `f` on the host when the op's stream reaches this point (after the
/// ops before it in the chain); the ops after it start once `f` has
/// returned. `f` runs on the driver's callback thread: keep it short, and
/// call no CUDA in it. Its return value comes in the [`HostResult`].
///
/// # Errors
/// At execution: [`Error::NeedsLocalStream`] on a remote policy (the node
/// cannot run the client's closure: end the submission there and start
/// another after it); [`Error::Capture`] inside a graph capture; a driver
/// error, named. A panic in `f` is caught (it cannot unwind into the
/// driver) and reported by [`HostResult::get`]; the stream goes on.
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// use cuda_async::host_step;
/// let (buf, at) = zeros::<f32>(1 << 20)
///     .then(|buf| host_step(std::time::Instant::now).map(move |t| (buf, t)))
///     .sync()?;
/// println!("zeroed {} floats by {:?}", buf.len(), at.get()?);
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub fn host_step<R, F>(f: F) -> HostStep<F>
where
    R: Send + 'static,
    F: FnOnce() -> R + Send + 'static,
{
    HostStep { f }
}

impl<R, F> DeviceOp for HostStep<F>
where
    R: Send + 'static,
    F: FnOnce() -> R + Send + 'static,
{
    type Output = HostResult<R>;

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<HostResult<R>> {
        let op = "host_step";
        let stream = step_stream(ctx, op)?;
        enqueue(&stream, op, self.f)
    }
}
impl_into_future!(impl[R, F] for HostStep<F> where R: Send + 'static, F: FnOnce() -> R + Send + 'static);

/// Op for [`host_step_with`].
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct HostStepWith<T, F> {
    buf: PinnedBuffer<T>,
    f: F,
}

impl<T, F> fmt::Debug for HostStepWith<T, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostStepWith")
            .field("len", &self.buf.len())
            .finish_non_exhaustive()
    }
}

/// [`host_step`] with a pinned buffer's contents: `f` gets them, mutably,
/// when the stream reaches this point and after every earlier GPU use of
/// the buffer, so it sees what a download before it brought and an upload
/// after it sends what `f` wrote. Yields the buffer back with the result.
///
/// # Errors
/// As [`host_step`].
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// use cuda_async::{host_step_with, PinnedBuffer};
/// let dev = cuda_async::Device::new(0)?;
/// let pinned = PinnedBuffer::filled(&dev, 4, 0f32)?;
/// // Download, double on the host in stream order, upload again.
/// let (back, _) = h2d(vec![1.0f32, 2.0, 3.0, 4.0])
///     .then(move |buf| copy_d2h(buf, pinned))
///     .then(|(buf, pinned)| {
///         host_step_with(pinned, |v: &mut [f32]| v.iter_mut().for_each(|x| *x *= 2.0))
///             .then(move |(pinned, _)| copy_h2d(pinned, buf))
///     })
///     .then(|(pinned, buf)| d2h(buf).map(move |h| (h, pinned)))
///     .sync()?;
/// assert_eq!(back.as_slice()?, &[2.0, 4.0, 6.0, 8.0]);
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub fn host_step_with<T, R, F>(buf: PinnedBuffer<T>, f: F) -> HostStepWith<T, F>
where
    T: Send + 'static,
    R: Send + 'static,
    F: FnOnce(&mut [T]) -> R + Send + 'static,
{
    HostStepWith { buf, f }
}

/// A pinned buffer's memory, handed to the callback thread.
struct HostSpan<T>(*mut T, usize);

// SAFETY: the pointer addresses pinned memory that only the host function
// touches while it runs (see `HostStepWith::execute`); `T: Send` moves the
// access to that thread.
unsafe impl<T: Send> Send for HostSpan<T> {}

impl<T, R, F> DeviceOp for HostStepWith<T, F>
where
    T: Send + 'static,
    R: Send + 'static,
    F: FnOnce(&mut [T]) -> R + Send + 'static,
{
    type Output = (PinnedBuffer<T>, HostResult<R>);

    unsafe fn execute(mut self, ctx: &mut ExecutionContext) -> Result<<Self as DeviceOp>::Output> {
        let op = "host_step_with";
        let stream = step_stream(ctx, op)?;
        // SAFETY: the host function below is the only access through the
        // pointer, on `stream`, and `record_use` follows it: the stream
        // waits for the buffer's earlier GPU uses first, and later uses
        // (and host access) wait for the host function's end.
        let ptr = unsafe { self.buf.begin_use(&stream) }?;
        let span = HostSpan(ptr, self.buf.len());
        let f = self.f;
        let result = enqueue(&stream, op, move || {
            let span = span;
            // SAFETY: `span` is the buffer's initialised memory, `len`
            // elements, not accessed by anything else until this returns
            // (see above); the buffer outlives it (its drop waits for the
            // recorded use).
            let data = unsafe { std::slice::from_raw_parts_mut(span.0, span.1) };
            f(data)
        });
        let recorded = self.buf.record_use(&stream);
        let result = result?;
        recorded?;
        Ok((self.buf, result))
    }
}
impl_into_future!(impl[T, R, F] for HostStepWith<T, F> where T: Send + 'static, R: Send + 'static, F: FnOnce(&mut [T]) -> R + Send + 'static);

/// Op for [`host_step_each`].
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct HostStepEach<F> {
    f: Arc<F>,
}

impl<F> fmt::Debug for HostStepEach<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostStepEach").finish_non_exhaustive()
    }
}

/// Runs `f` on the host each time the op's stream reaches this point:
/// once when the op runs, and, captured into a graph (`op.graph()`), at
/// every replay of the graph: the host step a graph can hold. As for
/// [`host_step`], `f` runs on the driver's callback thread, must be short
/// and must call no CUDA; it returns nothing, and a panic in it is caught
/// and discarded (use [`host_step`] for a result).
///
/// # Errors
/// At execution: [`Error::NeedsLocalStream`] on a remote policy; a driver
/// error, named.
///
/// # Examples
///
/// ```no_run
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use std::sync::Arc;
/// use cuda_async::prelude::*;
/// use cuda_async::host_step_each;
/// let replays = Arc::new(AtomicUsize::new(0));
/// let seen = replays.clone();
/// let graph = zeros::<f32>(1024)
///     .then(move |buf| host_step_each(move || {
///         seen.fetch_add(1, Ordering::Relaxed);
///     }).map(move |()| buf))
///     .graph()?;
/// for _ in 0..3 {
///     graph.launch().sync()?;
/// }
/// assert_eq!(replays.load(Ordering::Relaxed), 3);
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub fn host_step_each<F>(f: F) -> HostStepEach<F>
where
    F: Fn() + Send + Sync + 'static,
{
    HostStepEach { f: Arc::new(f) }
}

impl<F> DeviceOp for HostStepEach<F>
where
    F: Fn() + Send + Sync + 'static,
{
    type Output = ();

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<()> {
        let stream = ctx.cuda_stream_for("host_step_each")?.clone();
        // SAFETY: the closure is retained below: with the submission until
        // its stream has passed this point, or, inside a capture, with the
        // graph until its last replay has ended.
        unsafe { cuda_core::launch_host_fn_borrowed(&stream, Arc::as_ptr(&self.f)) }?;
        ctx.retain(self.f);
        Ok(())
    }
}
impl_into_future!(impl[F] for HostStepEach<F> where F: Fn() + Send + Sync + 'static);
