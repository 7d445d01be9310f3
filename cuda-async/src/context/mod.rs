//! [`ExecutionContext`]: what an op is executed against.

use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cuda_core::cudarc::driver::CudaStream;
use cuda_core::{Device, Error, MarkScope, MemPool, Result, UseMark};

use crate::reactor::{CompletionMode, StreamSlot};
use crate::remote::{RecordingFrame, RemoteContext};
use crate::spread::Spread;
use crate::stream_pool::StreamPool;

mod fork;
#[cfg(any(feature = "blas", feature = "rand"))]
mod library;
mod memory;
mod order;
mod work;

pub(crate) use fork::Fork;
pub(crate) use order::{DoneEvent, TimerPoints};
pub(crate) use work::GraphRef;

/// What an op executes against: a stream of a local GPU (a device, a CUDA
/// stream on it, and the pool that concurrent combinators fork onto), or a
/// stream of a remote session, where ops record commands instead of
/// enqueueing them (see [`RemoteContext`]). Whatever must outlive the
/// work is handed to [`ExecutionContext::retain`].
///
/// The ops of this crate run on both. A hand-written op that needs a local
/// CUDA stream gets it from [`ExecutionContext::cuda_stream`], which is
/// [`Error::NeedsLocalStream`] on a remote context, so such an op fails
/// cleanly there; one that supports both matches on
/// [`ExecutionContext::as_remote`].
pub struct ExecutionContext {
    backend: Backend,
    retained: Vec<Box<dyn Any + Send>>,
    /// Whether an op asked for the local stream (to enqueue on it): if none
    /// did, the executors return without synchronizing or signalling.
    touched: AtomicBool,
    /// The use marks of this execution's ops: one event a stream, recorded
    /// after the last of them when the execution ends.
    marks: MarkScope,
}

enum Backend {
    Local(Local),
    Remote(RemoteContext),
}

struct Local {
    device: Device,
    stream: Arc<CudaStream>,
    pool: Arc<StreamPool>,
    completion: CompletionMode,
    slot: Option<Arc<StreamSlot>>,
    /// Set by a [`DevicePool`](crate::DevicePool) that spreads concurrent
    /// arms over its devices.
    spread: Option<Spread>,
    /// Set by [`WithMemPool`](crate::WithMemPool): the pool its ops
    /// allocate from (on the pool's device).
    mem_pool: Option<MemPool>,
}

impl fmt::Debug for ExecutionContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.backend {
            Backend::Local(l) => f
                .debug_struct("ExecutionContext")
                .field("device", &l.device.ordinal())
                .field("stream", &l.stream.cu_stream())
                .field("retained", &self.retained.len())
                .finish(),
            Backend::Remote(r) => f
                .debug_struct("ExecutionContext")
                .field("remote", r)
                .field("retained", &self.retained.len())
                .finish(),
        }
    }
}

impl ExecutionContext {
    pub(crate) fn new(device: Device, stream: Arc<CudaStream>, pool: Arc<StreamPool>) -> Self {
        ExecutionContext {
            backend: Backend::Local(Local {
                device,
                stream,
                pool,
                completion: CompletionMode::HostCallback,
                slot: None,
                spread: None,
                mem_pool: None,
            }),
            retained: Vec::new(),
            touched: AtomicBool::new(false),
            marks: MarkScope::new(),
        }
    }

    /// A context recording onto stream `stream` of `session`, whose
    /// concurrent arms fork onto the other streams of `0..streams`: what a
    /// remote policy's [`select`](crate::SchedulingPolicy::select)
    /// returns (a policy of one's own over several sessions, say).
    pub fn remote(
        session: std::sync::Arc<dyn crate::remote::RemoteSession>,
        stream: u32,
        streams: u32,
    ) -> Self {
        Self::new_remote(RemoteContext::new(
            session,
            stream % streams.max(1),
            streams,
        ))
    }

    pub(crate) fn new_remote(remote: RemoteContext) -> Self {
        ExecutionContext {
            backend: Backend::Remote(remote),
            retained: Vec::new(),
            touched: AtomicBool::new(false),
            marks: MarkScope::new(),
        }
    }

    /// Whether any op has asked for the local stream (through
    /// [`cuda_stream`](Self::cuda_stream) or a concurrent combinator's fork)
    /// since the context was made: an execution where none did enqueued
    /// nothing, and needs no synchronize or completion signal.
    pub(crate) fn touched(&self) -> bool {
        self.touched.load(Ordering::Relaxed)
    }

    /// The local stream, for an op about to enqueue on it.
    pub(crate) fn work_stream(&self) -> Option<&Arc<CudaStream>> {
        let s = self.stream();
        if s.is_some() {
            self.touched.store(true, Ordering::Relaxed);
        }
        s
    }

    /// Sets how a future on this context learns of completion (the reactor
    /// needs the stream's slot; without one, the host callback is used).
    pub(crate) fn with_completion(
        mut self,
        mode: CompletionMode,
        slot: Option<Arc<StreamSlot>>,
    ) -> Self {
        if let Backend::Local(l) = &mut self.backend {
            match (mode.uses_reactor(), slot) {
                (true, Some(slot)) => {
                    l.completion = mode;
                    l.slot = Some(slot);
                }
                _ => {
                    l.completion = CompletionMode::HostCallback;
                    l.slot = None;
                }
            }
        }
        self
    }

    /// How a future on this context learns that its work is done
    /// ([`CompletionMode::Reply`] on a remote context).
    pub fn completion_mode(&self) -> CompletionMode {
        match &self.backend {
            Backend::Local(l) => l.completion,
            Backend::Remote(_) => CompletionMode::Reply,
        }
    }

    pub(crate) fn slot(&self) -> Option<&Arc<StreamSlot>> {
        match &self.backend {
            Backend::Local(l) => l.slot.as_ref(),
            Backend::Remote(_) => None,
        }
    }

    /// A context on a stream that other code created (interop), forking
    /// concurrent arms onto the device's default pool.
    ///
    /// # Errors
    /// As [`StreamPool::default_for`].
    pub fn on_stream(stream: &Arc<CudaStream>) -> Result<Self> {
        let device = Device::of_stream(stream);
        let pool = StreamPool::default_for(&device)?;
        Ok(Self::new(device, stream.clone(), pool))
    }

    /// Where ops on this context run, e.g. `local GPU 0` or
    /// `stream 2 of lease 1a2b3c4d... on node gpu-7`.
    pub fn describe(&self) -> String {
        match &self.backend {
            Backend::Local(l) => crate::buffer::local_home(l.device.ordinal()),
            Backend::Remote(r) => r.describe(),
        }
    }

    fn needs_local(&self, what: &str) -> Error {
        Error::NeedsLocalStream {
            op: what.into(),
            context: self.describe(),
        }
    }

    /// The local device.
    ///
    /// # Errors
    /// [`Error::NeedsLocalStream`] on a remote context.
    pub fn device(&self) -> Result<&Device> {
        match &self.backend {
            Backend::Local(l) => Ok(&l.device),
            Backend::Remote(_) => Err(self.needs_local("an op that asks for the local device")),
        }
    }

    /// The local CUDA stream work is enqueued on.
    ///
    /// Asking for it marks the execution as one that enqueued work: the
    /// executors (`sync`, `.await`, ...) skip their synchronize or
    /// completion signal only for executions where no op did. An op that
    /// enqueues on the stream must get it here.
    ///
    /// # Errors
    /// [`Error::NeedsLocalStream`] on a remote context: an op that enqueues
    /// on a CUDA stream itself cannot run there.
    pub fn cuda_stream(&self) -> Result<&Arc<CudaStream>> {
        match &self.backend {
            Backend::Local(l) => {
                self.touched.store(true, Ordering::Relaxed);
                Ok(&l.stream)
            }
            Backend::Remote(_) => Err(self.needs_local("an op that enqueues on a CUDA stream")),
        }
    }

    /// [`cuda_stream`](Self::cuda_stream) for an op that names itself: on
    /// a remote context the error says `op` needs a local CUDA stream.
    ///
    /// # Errors
    /// [`Error::NeedsLocalStream`] naming `op` on a remote context.
    pub fn cuda_stream_for(&self, op: &str) -> Result<&Arc<CudaStream>> {
        match &self.backend {
            Backend::Local(_) => self.cuda_stream(),
            Backend::Remote(_) => Err(self.needs_local(op)),
        }
    }

    /// The pool concurrent combinators fork onto.
    ///
    /// # Errors
    /// [`Error::NeedsLocalStream`] on a remote context.
    pub fn pool(&self) -> Result<&Arc<StreamPool>> {
        match &self.backend {
            Backend::Local(l) => Ok(&l.pool),
            Backend::Remote(_) => {
                Err(self.needs_local("an op that forks onto a local stream pool"))
            }
        }
    }

    /// The remote context, where ops record commands; `None` locally.
    pub fn as_remote(&mut self) -> Option<&mut RemoteContext> {
        match &mut self.backend {
            Backend::Local(_) => None,
            Backend::Remote(r) => Some(r),
        }
    }

    /// True on a remote context.
    pub fn is_remote(&self) -> bool {
        matches!(self.backend, Backend::Remote(_))
    }

    /// Keeps `value` alive until the GPU has passed everything enqueued in
    /// this submission (kernel modules, staging buffers...).
    pub fn retain(&mut self, value: impl Any + Send) {
        self.retained.push(Box::new(value));
    }

    /// A context for a concurrent arm: on a local context, one on `stream`
    /// of the same pool; on a remote one, a fresh recording on the same
    /// stream (arms run in order there).
    pub(crate) fn fork(&self, stream: Option<Arc<CudaStream>>) -> Self {
        match (&self.backend, stream) {
            (Backend::Local(l), s) => {
                let s = s.unwrap_or_else(|| l.stream.clone());
                let mut arm = Self::new(l.device.clone(), s, l.pool.clone());
                if let Backend::Local(a) = &mut arm.backend {
                    a.mem_pool = l.mem_pool.clone();
                }
                match &l.spread {
                    Some(spread) => arm.with_spread(spread.clone()),
                    None => arm,
                }
            }
            (Backend::Remote(r), _) => Self::new_remote(r.fork()),
        }
    }

    /// Lets concurrent arms of this (local) context go to the devices of
    /// `spread` (see [`DevicePool::spread_arms`](crate::DevicePool::spread_arms)).
    pub(crate) fn with_spread(mut self, spread: Spread) -> Self {
        if let Backend::Local(l) = &mut self.backend {
            l.spread = Some(spread);
        }
        self
    }

    /// Makes this (local) context's ops allocate from `pool` (on the pool's
    /// device; allocations on other devices, such as spread arms', stay on
    /// their device's current pool).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a remote context: a lease's memory is
    /// the node's.
    pub(crate) fn with_mem_pool(mut self, pool: MemPool) -> Result<Self> {
        match &mut self.backend {
            Backend::Local(l) => {
                l.mem_pool = Some(pool);
                Ok(self)
            }
            Backend::Remote(r) => Err(Error::InvalidArgument(format!(
                "a memory pool of GPU {} serves local ops, not {} (a lease's memory is \
                 the node's: its statistics are in the lease's status)",
                pool.device().ordinal(),
                r.describe()
            ))),
        }
    }

    /// The memory pool this context's ops allocate from, if a policy chose
    /// one ([`SchedulingPolicy::with_mem_pool`](crate::SchedulingPolicy::with_mem_pool));
    /// `None`: the device's current pool.
    pub fn mem_pool(&self) -> Option<&MemPool> {
        match &self.backend {
            Backend::Local(l) => l.mem_pool.as_ref(),
            Backend::Remote(_) => None,
        }
    }

    /// Where concurrent arms of this context may go, if a device pool
    /// spreads them.
    pub(crate) fn spread(&self) -> Option<&Spread> {
        match &self.backend {
            Backend::Local(l) => l.spread.as_ref(),
            Backend::Remote(_) => None,
        }
    }

    /// Moves a finished arm's retained values (and, remotely, its recorded
    /// commands) into this context.
    /// A mark for an op's uses of buffers on `stream`, enqueued by this
    /// execution: the marks of one stream share one event, recorded after
    /// the last of them ([`Self::flush_marks`]) or when something needs
    /// it first.
    pub(crate) fn mark<'s>(&'s self, stream: &'s Arc<CudaStream>) -> UseMark<'s> {
        self.marks.mark(stream)
    }

    /// Records the events of this execution's marks (when its ops are
    /// enqueued, before its streams are joined or synchronized).
    pub(crate) fn flush_marks(&self) -> Result<()> {
        self.marks.flush()
    }

    pub(crate) fn absorb(&mut self, mut other: ExecutionContext) {
        self.retained.append(&mut other.retained);
        if other.touched() {
            self.touched.store(true, Ordering::Relaxed);
        }
        if let (Backend::Remote(me), Backend::Remote(arm)) = (&mut self.backend, other.backend) {
            me.absorb(arm);
        }
    }

    pub(crate) fn take_retained(&mut self) -> Retained {
        Retained(std::mem::take(&mut self.retained))
    }

    /// The local stream, for the executors (it does not count as enqueuing
    /// work: see [`work_stream`](Self::work_stream)); `None` on a remote
    /// context.
    pub(crate) fn stream(&self) -> Option<&Arc<CudaStream>> {
        match &self.backend {
            Backend::Local(l) => Some(&l.stream),
            Backend::Remote(_) => None,
        }
    }

    /// Which backend this is: every local context is one (events order
    /// work across local devices), each remote session another.
    pub(crate) fn backend_key(&self) -> usize {
        match &self.backend {
            Backend::Local(_) => 0,
            Backend::Remote(r) => Arc::as_ptr(r.session()).cast::<()>() as usize,
        }
    }

    /// Opens the frame of an op's execution: buffers dropped while a
    /// remote context records are freed at the end of its submission
    /// ([`close_frame`](Self::close_frame)); locally, nothing.
    pub(crate) fn open_frame(&self) -> Option<RecordingFrame> {
        self.remote_ref()
            .map(|r| RecordingFrame::push(r.session(), false))
    }

    /// Closes `frame`: the frees of buffers dropped while recording join
    /// the recording.
    pub(crate) fn close_frame(&mut self, frame: Option<RecordingFrame>) {
        if let (Some(frame), Some(r)) = (frame, self.as_remote()) {
            let stream = r.stream();
            frame.finish(r.recording(), stream);
        }
    }

    pub(crate) fn remote_ref(&self) -> Option<&RemoteContext> {
        match &self.backend {
            Backend::Local(_) => None,
            Backend::Remote(r) => Some(r),
        }
    }
}

/// What a submission keeps alive until the GPU has passed it.
#[derive(Default)]
pub(crate) struct Retained(Vec<Box<dyn Any + Send>>);

impl fmt::Debug for Retained {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Retained({})", self.0.len())
    }
}

impl Retained {
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}
