//! [`RemoteContext`]: a stream of a remote session being recorded onto,
//! with the forks and joins of concurrent arms, the remote events that
//! order them, and the host steps run on reply.

use std::fmt;
use std::mem::size_of;
use std::sync::Arc;

use cuda_core::{Error, Result};

use crate::buffer::DeviceBuffer;
use crate::host::ReadSlot;

use super::frees::free_remote;
use super::proto::{Id, Op};
use super::recording::{Recording, RemoteStream};
use super::session::RemoteSession;

/// A stream of a remote session being recorded onto: what an op sees
/// through [`ExecutionContext::as_remote`](crate::ExecutionContext::as_remote).
///
/// The ops of this crate record through it; a hand-written op can too:
///
/// ```
/// use cuda_async::remote::{Id, Op, RemoteContext};
/// use cuda_async::{DeviceBuffer, Result};
/// // A remote "fill with 0xff" of a buffer, as `memset` records it.
/// fn record_ones(r: &mut RemoteContext, buf: &DeviceBuffer<u8>) -> Result<()> {
///     let (stream, len) = (r.stream(), buf.len() as u64);
///     let buf = Id(r.id_of(buf)?);
///     r.recording().push(stream, Op::Fill { buf, offset: 0, len, value: 0xff });
///     Ok(())
/// }
/// ```
pub struct RemoteContext {
    session: Arc<dyn RemoteSession>,
    stream: RemoteStream,
    /// The policy's streams (`0..streams`), which concurrent arms fork onto.
    streams: u32,
    pub(super) recording: Recording,
    /// The steps to run on reply recorded so far (taken by `send`).
    pub(super) on_reply: OnReply,
}

/// Host steps run once a submission's reply has arrived, before its output
/// is handed out (e.g. copying a read into a caller's pinned buffer).
#[derive(Default)]
pub(crate) struct OnReply(Vec<Box<dyn FnOnce() + Send>>);

impl OnReply {
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    pub(crate) fn run(self) {
        for f in self.0 {
            f();
        }
    }
}

impl fmt::Debug for RemoteContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteContext")
            .field("session", &self.session.describe())
            .field("stream", &self.stream)
            .field("commands", &self.recording.commands().len())
            .finish()
    }
}

impl RemoteContext {
    pub(crate) fn new(session: Arc<dyn RemoteSession>, stream: RemoteStream, streams: u32) -> Self {
        RemoteContext {
            session,
            stream,
            streams: streams.max(1),
            recording: Recording::new(),
            on_reply: OnReply::default(),
        }
    }

    /// Adds a host step to run on reply (see `OnReply`).
    pub(crate) fn on_reply(&mut self, f: impl FnOnce() + Send + 'static) {
        self.on_reply.0.push(Box::new(f));
    }

    /// The session.
    pub fn session(&self) -> &Arc<dyn RemoteSession> {
        &self.session
    }

    /// The session's stream commands are recorded on.
    pub fn stream(&self) -> RemoteStream {
        self.stream
    }

    /// The submission's recording so far.
    pub fn recording(&mut self) -> &mut Recording {
        &mut self.recording
    }

    /// `stream N of <session>`.
    pub fn describe(&self) -> String {
        format!("stream {} of {}", self.stream, self.session.describe())
    }

    /// The id of `buf` on this session.
    ///
    /// # Errors
    /// [`Error::WrongHome`] for a local buffer or one of another session,
    /// naming both homes.
    pub fn id_of<T>(&self, buf: &DeviceBuffer<T>) -> Result<u64> {
        buf.remote_id(&self.session)
    }

    /// Elements `at` of `buf` as a library command names them: the
    /// buffer's id here and the byte offset of the first element.
    ///
    /// # Errors
    /// As [`RemoteContext::id_of`].
    #[cfg(any(feature = "blas", feature = "rand"))]
    pub(crate) fn operand<T>(
        &self,
        buf: &DeviceBuffer<T>,
        at: std::ops::Range<usize>,
    ) -> Result<super::proto::Operand> {
        Ok(super::proto::Operand {
            buf: Id(self.id_of(buf)?),
            offset: (at.start * size_of::<T>()) as u64,
        })
    }

    /// Records the allocation of `len` zeroed elements and returns the
    /// buffer (its free is queued when it is dropped).
    pub fn alloc<T>(&mut self, len: usize) -> Result<DeviceBuffer<T>> {
        let bytes = len.checked_mul(size_of::<T>()).ok_or_else(|| {
            Error::InvalidArgument(format!("{len} elements overflow a buffer size"))
        })?;
        let id = self.session.fresh_id();
        // A node refuses empty allocations; an empty buffer still needs an
        // id (later ops may name it), so it holds one byte there.
        let size = bytes.max(1) as u64;
        self.recording
            .push(self.stream, Op::Alloc { buf: Id(id), size });
        Ok(DeviceBuffer::remote(self.session.clone(), id, len))
    }

    pub(crate) fn fork(&self) -> Self {
        Self::new(self.session.clone(), self.stream, self.streams)
    }

    /// Records a fresh event on this stream; the handle frees it when dropped.
    pub(crate) fn record_event(&mut self) -> RemoteEvent {
        RemoteEvent {
            id: self.record_fresh(),
            stream: self.stream,
            session: self.session.clone(),
        }
    }

    /// Makes this stream wait for `ev` (nothing when `ev` is on this stream).
    pub(crate) fn wait_event(&mut self, ev: &RemoteEvent) {
        if ev.stream != self.stream {
            self.recording
                .push(self.stream, Op::Wait { event: Id(ev.id) });
        }
    }

    /// The context of concurrent arm `arm` (>= 1): a fresh recording on
    /// another stream of the policy, first waiting for the fork event
    /// (recorded here once, in `fork_event`). One stream: this one, in order.
    pub(crate) fn fork_arm(&mut self, arm: usize, fork_event: &mut Option<u64>) -> Self {
        let stream = (self.stream + (arm % self.streams as usize) as u32) % self.streams;
        let mut child = Self::new(self.session.clone(), stream, self.streams);
        if stream == self.stream {
            return child;
        }
        let ev = *fork_event.get_or_insert_with(|| self.record_fresh());
        child.recording.push(stream, Op::Wait { event: Id(ev) });
        child
    }

    /// Ends an arm forked from a context on `parent_stream`: records its
    /// join event (returned) when it ran on another stream.
    pub(crate) fn end_arm(&mut self, parent_stream: RemoteStream) -> Option<u64> {
        (self.stream != parent_stream).then(|| self.record_fresh())
    }

    /// Records the start of a fresh timer on this stream; returns its id.
    pub(crate) fn timer_start(&mut self) -> u64 {
        let timer = self.session.fresh_id();
        self.recording
            .push(self.stream, Op::TimerStart { timer: Id(timer) });
        timer
    }

    /// Records the end of `timer` on `stream`: the reply's slot receives
    /// the nanoseconds between its start and end.
    pub(crate) fn timer_end(&mut self, stream: RemoteStream, timer: u64) -> Arc<ReadSlot> {
        self.recording.timer_end(stream, timer)
    }

    /// Records a fresh event id on this stream.
    fn record_fresh(&mut self) -> u64 {
        let id = self.session.fresh_id();
        self.recording
            .push(self.stream, Op::Record { event: Id(id) });
        id
    }

    /// Waits for each join event, then frees every event of the fork.
    pub(crate) fn join_arms(&mut self, fork_event: Option<u64>, joins: &[u64]) {
        let stream = self.stream;
        for &event in joins {
            self.recording.push(stream, Op::Wait { event: Id(event) });
        }
        for id in fork_event.into_iter().chain(joins.iter().copied()) {
            self.recording.push(stream, Op::Free { id: Id(id) });
        }
    }

    pub(crate) fn absorb(&mut self, arm: RemoteContext) {
        self.recording.append(arm.recording);
        self.on_reply.0.extend(arm.on_reply.0);
    }
}

/// An event of a remote session, freed (like a buffer) when dropped.
pub(crate) struct RemoteEvent {
    id: u64,
    stream: RemoteStream,
    session: Arc<dyn RemoteSession>,
}

impl Drop for RemoteEvent {
    fn drop(&mut self) {
        free_remote(&self.session, self.id);
    }
}
