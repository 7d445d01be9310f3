//! The remote backend's seam: what a remote execution context records and
//! the trait of the session that sends it.
//!
//! A remote context does not enqueue work on a CUDA stream: it records
//! [`RemoteCommand`]s into a [`Recording`], naming buffers and events with
//! ids the client picks ([`RemoteSession::fresh_id`]), so a whole chain is
//! recorded without waiting for any reply. When the submission's future is
//! first polled (or its blocking call is made), the recording goes to the
//! [`RemoteSession`] as one message; the session delivers the reads of the
//! reply into their [`ReadSlot`]s and then completes the submission's
//! [`RemoteCompletion`] (the same completion state the local modes
//! complete), or fails it with one of the remote [`Error`] variants.
//!
//! `cuda-async` defines this seam and nothing of the transport: it has no
//! QUIC, TLS or async-runtime dependency. `cuda-lease` implements
//! [`RemoteSession`] for a leased GPU.
//!
//! Every op of this crate records onto a remote context
//! ([`ExecutionContext::as_remote`](crate::ExecutionContext::as_remote));
//! [`RemotePolicy`] hands out such contexts, round-robin over k streams of
//! a session:
//!
//! ```no_run
//! # fn f(session: std::sync::Arc<dyn cuda_async::RemoteSession>) -> cuda_async::Result<()> {
//! use cuda_async::prelude::*;
//! use cuda_async::remote::RemotePolicy;
//! let remote = RemotePolicy::new(&session);
//! // blocking, no async runtime needed:
//! let y = h2d(vec![1.0f32; 4]).then(d2h).sync_with(&remote)?;
//! assert_eq!(y.to_vec()?, vec![1.0; 4]);
//! // or, in an async fn: h2d(..).then(d2h).schedule(&remote)?.await?
//! # Ok(()) }
//! ```

use std::fmt;
use std::mem::size_of;
use std::sync::Arc;

use cuda_core::{Error, Result};

use crate::buffer::DeviceBuffer;

mod frees;
mod policy;
mod recording;
mod session;

pub use crate::host::{HostBuffer, ReadBuf, ReadSlot};
pub use policy::{RemotePolicy, DEFAULT_REMOTE_STREAMS};
pub use recording::{Recording, RemoteArg, RemoteCommand};
pub use session::{AsRemoteSession, RemoteCompletion, RemoteSession, RemoteStream};

pub(crate) use frees::{free_remote, RecordingFrame};
pub(crate) use policy::send;

/// A stream of a remote session being recorded onto: what an op sees
/// through [`ExecutionContext::as_remote`](crate::ExecutionContext::as_remote).
///
/// The ops of this crate record through it; a hand-written op can too:
///
/// ```
/// use cuda_async::remote::{RemoteCommand, RemoteContext};
/// use cuda_async::{DeviceBuffer, Result};
/// // A remote "fill with 0xff" of a buffer, as `memset` records it.
/// fn record_ones(r: &mut RemoteContext, buf: &DeviceBuffer<u8>) -> Result<()> {
///     let id = r.id_of(buf)?;
///     let stream = r.stream();
///     r.recording().push(RemoteCommand::Fill { stream, id, offset: 0, len: buf.len() as u64, value: 0xff });
///     Ok(())
/// }
/// ```
pub struct RemoteContext {
    session: Arc<dyn RemoteSession>,
    stream: RemoteStream,
    /// The policy's streams (`0..streams`), which concurrent arms fork onto.
    streams: u32,
    recording: Recording,
    on_reply: OnReply,
}

/// Host-side steps run once a submission's reply has arrived, before its
/// output is handed out (e.g. copying a read into a caller's pinned
/// buffer).
#[derive(Default)]
pub(crate) struct OnReply(Vec<Box<dyn FnOnce() + Send>>);

impl OnReply {
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

    /// Runs `f` on the host once the reply has arrived, before the output
    /// is handed out.
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

    /// Records the allocation of `len` zeroed elements and returns the
    /// buffer (its free is queued when it is dropped).
    pub fn alloc<T>(&mut self, len: usize) -> Result<DeviceBuffer<T>> {
        let bytes = len.checked_mul(size_of::<T>()).ok_or_else(|| {
            Error::InvalidArgument(format!("{len} elements overflow a buffer size"))
        })?;
        let id = self.session.fresh_id();
        // A node refuses empty allocations; an empty buffer still needs an
        // id (later ops may name it), so it holds one byte there.
        self.recording.push(RemoteCommand::Alloc {
            stream: self.stream,
            id,
            bytes: bytes.max(1) as u64,
        });
        Ok(DeviceBuffer::remote(self.session.clone(), id, len))
    }

    pub(crate) fn fork(&self) -> Self {
        Self::new(self.session.clone(), self.stream, self.streams)
    }

    /// Records a fresh event on this stream; the returned handle frees it
    /// (through the session) when dropped.
    pub(crate) fn record_event(&mut self) -> RemoteEvent {
        let id = self.session.fresh_id();
        self.recording.push(RemoteCommand::Record {
            stream: self.stream,
            event: id,
        });
        RemoteEvent {
            id,
            stream: self.stream,
            session: self.session.clone(),
        }
    }

    /// Makes this stream wait for `ev` (nothing when `ev` was recorded on
    /// this stream: stream order covers it).
    pub(crate) fn wait_event(&mut self, ev: &RemoteEvent) {
        if ev.stream != self.stream {
            self.recording.push(RemoteCommand::Wait {
                stream: self.stream,
                event: ev.id,
            });
        }
    }

    /// The context of concurrent arm `arm` (>= 1): a fresh recording on
    /// another stream of the policy that starts by waiting for the fork
    /// event (recorded here once, in `fork_event`). With one stream, the
    /// arm records on this stream, in order.
    pub(crate) fn fork_arm(&mut self, arm: usize, fork_event: &mut Option<u64>) -> Self {
        let stream = (self.stream + (arm % self.streams as usize) as u32) % self.streams;
        let mut child = Self::new(self.session.clone(), stream, self.streams);
        if stream == self.stream {
            return child;
        }
        let ev = *fork_event.get_or_insert_with(|| {
            let ev = self.session.fresh_id();
            self.recording.push(RemoteCommand::Record {
                stream: self.stream,
                event: ev,
            });
            ev
        });
        child
            .recording
            .push(RemoteCommand::Wait { stream, event: ev });
        child
    }

    /// Ends an arm forked from a context on `parent_stream`: records its
    /// join event (returned) when it ran on another stream.
    pub(crate) fn end_arm(&mut self, parent_stream: RemoteStream) -> Option<u64> {
        if self.stream == parent_stream {
            return None;
        }
        let ev = self.session.fresh_id();
        self.recording.push(RemoteCommand::Record {
            stream: self.stream,
            event: ev,
        });
        Some(ev)
    }

    /// Joins the arms back: this stream waits for each join event, then
    /// every event of the fork is freed.
    pub(crate) fn join_arms(&mut self, fork_event: Option<u64>, joins: &[u64]) {
        let stream = self.stream;
        for &event in joins {
            self.recording.push(RemoteCommand::Wait { stream, event });
        }
        for id in fork_event.into_iter().chain(joins.iter().copied()) {
            self.recording.push(RemoteCommand::Free { stream, id });
        }
    }

    pub(crate) fn absorb(&mut self, arm: RemoteContext) {
        self.recording.append(arm.recording);
        self.on_reply.0.extend(arm.on_reply.0);
    }

    pub(crate) fn take_recording(&mut self) -> Recording {
        std::mem::take(&mut self.recording)
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;

    #[test]
    fn a_remote_host_buffer_is_an_error_until_its_bytes_arrive() {
        let mut rec = Recording::new();
        rec.push(RemoteCommand::Alloc {
            stream: 0,
            id: 1,
            bytes: 12,
        });
        rec.write(0, 1, 0, &[1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0]);
        let slot = rec.read(0, 1, 0, 12);
        assert_eq!(rec.commands().len(), 3);
        assert_eq!(rec.data().len(), 12);
        let host = HostBuffer::<u32>::remote(slot.clone()).unwrap();
        assert_eq!(host.len(), 3);
        let err = host.as_slice().unwrap_err();
        assert!(err.to_string().contains("before its submission completed"));
        slot.receive(|b| {
            b.copy_from_slice(&[1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0]);
            Ok(())
        })
        .unwrap();
        assert_eq!(host.to_vec().unwrap(), [1, 2, 3]);
        assert!(slot.receive(|_| Ok(())).is_err(), "filled once");
        assert!(HostBuffer::<u64>::remote(Arc::new(ReadSlot::new(12))).is_err());
    }

    #[test]
    fn a_remote_completion_completes_once_and_the_first_outcome_wins() {
        let done = RemoteCompletion::new();
        assert!(!done.is_finished());
        assert!(done.outcome().is_none());
        done.clone().fail(Error::Disconnected("node gone".into()));
        done.complete();
        assert!(done.is_finished());
        assert!(matches!(done.outcome(), Some(Err(Error::Disconnected(_)))));
    }

    /// A session that keeps what it is sent and answers at once.
    #[derive(Debug, Default)]
    struct Capture {
        next: std::sync::atomic::AtomicU64,
        sent: std::sync::Mutex<Vec<Vec<RemoteCommand>>>,
        freed: std::sync::Mutex<Vec<u64>>,
    }

    impl RemoteSession for Capture {
        fn describe(&self) -> String {
            "capture".into()
        }
        fn fresh_id(&self) -> u64 {
            self.next.fetch_add(1, Ordering::Relaxed) + 1
        }
        fn submit(&self, r: Recording, done: RemoteCompletion) {
            for s in r.reads() {
                s.receive(|b| {
                    b.fill(0);
                    Ok(())
                })
                .unwrap();
            }
            self.sent.lock().unwrap().push(r.commands().to_vec());
            done.complete();
        }
        fn free(&self, id: u64) {
            self.freed.lock().unwrap().push(id);
        }
    }

    fn streams_and_kinds(cmds: &[RemoteCommand]) -> Vec<(RemoteStream, &'static str)> {
        cmds.iter()
            .map(|c| match c {
                RemoteCommand::Alloc { stream, .. } => (*stream, "alloc"),
                RemoteCommand::Write { stream, .. } => (*stream, "write"),
                RemoteCommand::Read { stream, .. } => (*stream, "read"),
                RemoteCommand::Fill { stream, .. } => (*stream, "fill"),
                RemoteCommand::Copy { stream, .. } => (*stream, "copy"),
                RemoteCommand::Free { stream, .. } => (*stream, "free"),
                RemoteCommand::Launch { stream, .. } => (*stream, "launch"),
                RemoteCommand::Record { stream, .. } => (*stream, "record"),
                RemoteCommand::Wait { stream, .. } => (*stream, "wait"),
            })
            .collect()
    }

    #[test]
    fn a_remote_zip_forks_its_arms_onto_other_streams_with_events() {
        use crate::prelude::*;
        let capture = Arc::new(Capture::default());
        let remote = RemotePolicy::new(&capture).with_streams(2);
        let (a, b) = zeros::<u8>(4)
            .then(d2h)
            .zip(zeros::<u8>(8).then(d2h))
            .sync_with(&remote)
            .unwrap();
        assert_eq!((a.len(), b.len()), (4, 8));
        let sent = capture.sent.lock().unwrap();
        assert_eq!(sent.len(), 1, "one message");
        assert_eq!(
            streams_and_kinds(&sent[0]),
            [
                (0, "record"), // the fork, before arm 0
                (0, "alloc"),
                (0, "read"),
                (1, "wait"), // arm 1 starts after the fork
                (1, "alloc"),
                (1, "read"),
                (1, "record"), // arm 1's end
                (0, "wait"),   // the join
                (0, "free"),   // the fork and join events
                (0, "free"),
                (0, "free"), // the two buffers, dropped while recording
                (0, "free"),
            ]
        );
        drop(sent);
        // With one stream the arms record in order, with no events.
        let one = RemotePolicy::new(&capture).with_streams(1);
        zeros::<u8>(4).zip(zeros::<u8>(4)).sync_with(&one).unwrap();
        let sent = capture.sent.lock().unwrap();
        assert_eq!(streams_and_kinds(&sent[1]), [(0, "alloc"), (0, "alloc")]);
        // Buffers dropped after their submission are freed through the
        // session.
        assert_eq!(capture.freed.lock().unwrap().len(), 2);
        drop(sent);
        // A shared op: its consumer on another stream waits on the event
        // recorded after the producer; the event is freed with the op.
        let shared = zeros::<u8>(4).map(Arc::new).shared();
        let (x, y) = shared.clone().zip(shared).sync_with(&remote).unwrap();
        assert!(Arc::ptr_eq(&x, &y));
        let sent = capture.sent.lock().unwrap();
        let kinds = streams_and_kinds(&sent[2]);
        // The policy's second submission: stream 1; arm 1 forks onto 0.
        assert_eq!(
            kinds[..6],
            [
                (1, "record"), // fork
                (1, "alloc"),  // the producer, in arm 0
                (1, "record"), // the shared op's event
                (0, "wait"),   // arm 1 after the fork
                (0, "wait"),   // and after the producer
                (0, "record"), // arm 1's end
            ]
        );
        assert_eq!(
            kinds.iter().filter(|k| k.1 == "free").count(),
            3,
            "the fork, join and shared events: {kinds:?}"
        );
    }

    #[test]
    fn a_buffer_dropped_inside_a_nested_submission_is_freed_by_the_outer_one() {
        use crate::prelude::*;
        let capture = Arc::new(Capture::default());
        let remote = Arc::new(RemotePolicy::new(&capture).with_streams(1));
        let inner = remote.clone();
        // The outer submission allocates `b`; a closure of it runs an inner
        // blocking submission, which drops `b` while it records. The inner
        // message is sent first: `b`'s free must ride the outer one.
        zeros::<u8>(4)
            .then(move |b| {
                let r = zeros::<u8>(2)
                    .then(move |c| {
                        drop(b);
                        d2h(c)
                    })
                    .sync_with(&*inner)
                    .unwrap();
                value(r.len())
            })
            .sync_with(&*remote)
            .unwrap();
        let sent = capture.sent.lock().unwrap();
        assert_eq!(sent.len(), 2);
        assert_eq!(streams_and_kinds(&sent[0]), [(0, "alloc"), (0, "read")]);
        assert_eq!(
            streams_and_kinds(&sent[1]),
            [(0, "alloc"), (0, "free"), (0, "free")]
        );
    }

    #[test]
    #[should_panic(expected = "use Recording::write")]
    fn writes_go_through_write() {
        Recording::new().push(RemoteCommand::Write {
            stream: 0,
            id: 1,
            offset: 0,
            len: 4,
        });
    }
}
