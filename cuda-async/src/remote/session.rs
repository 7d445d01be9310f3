//! The seam a transport implements: [`RemoteSession`], the
//! [`RemoteCompletion`] it completes for each submission, and
//! [`AsRemoteSession`] for whatever hands a session out.

use std::fmt;
use std::sync::Arc;

use cuda_core::{Error, Result};

use crate::completion::Completion;

use super::ledger::Ledger;
use super::recording::Recording;

/// A session with a remote GPU: the transport behind remote contexts.
///
/// No method may block: [`RemoteSession::submit`] hands the recording to the
/// session's own I/O (a thread or a runtime task) and returns at once.
///
/// A session is [`Any`](std::any::Any), so [`RemoteSession::accepts`] can
/// downcast `owner` (`&**owner as &dyn Any`) to recognise a sibling.
pub trait RemoteSession: std::any::Any + Send + Sync + fmt::Debug {
    /// Names the session for errors, e.g. `lease 1a2b... on node gpu-7`.
    fn describe(&self) -> String;

    /// A fresh id for a buffer or an event (never handed out twice).
    fn fresh_id(&self) -> u64;

    /// Sends `recording` as one message. On reply, delivers the reads into
    /// their slots ([`ReadSlot::receive`](crate::remote::ReadSlot::receive)),
    /// then completes `done`; any failure (a command's, the connection's, the
    /// lease's) fails `done` with the matching [`Error`] variant instead.
    /// Submissions run on the remote GPU in the order of these calls. An
    /// empty recording sends the queued frees alone ([`RemoteSession::ledger`]),
    /// or nothing when none are queued.
    fn submit(&self, recording: Recording, done: RemoteCompletion);

    /// The session's [`Ledger`]: which of its ids exist on the node and the
    /// frees waiting to go. `cuda-async` frees dropped buffers, events and
    /// graphs through it and, when it says the frees should go now, submits
    /// an empty [`Recording`]. Default: `None`, a session that frees nothing
    /// outside its recordings and keeps no graphs.
    fn ledger(&self) -> Option<Arc<Ledger>> {
        None
    }

    /// Whether an op recorded on this session may use buffer `id` of `owner`,
    /// another session handle (this handle's own buffers are always accepted).
    /// Default: no, and the op fails with [`Error::WrongHome`]. A session that
    /// picks its node late (one submission of a fleet) accepts a sibling's
    /// buffer here and then goes where that buffer lives.
    fn accepts(&self, owner: &Arc<dyn RemoteSession>, id: u64) -> bool {
        let _ = (owner, id);
        false
    }
}

/// The completion of one remote submission, handed to
/// [`RemoteSession::submit`]: complete it (after delivering the reads) or
/// fail it, exactly once; the first outcome wins.
#[derive(Debug, Clone)]
pub struct RemoteCompletion(Arc<Completion>);

impl Default for RemoteCompletion {
    fn default() -> Self {
        Self::new()
    }
}

impl RemoteCompletion {
    /// A pending completion.
    pub fn new() -> Self {
        RemoteCompletion(Arc::new(Completion::new()))
    }

    /// The reply arrived and every command ran: wakes the future.
    pub fn complete(&self) {
        self.0.complete();
    }

    /// The submission failed: the future resolves to `error`.
    pub fn fail(&self, error: Error) {
        self.0.fail(error);
    }

    /// Wakes whatever awaits the submission now, leaving it pending: for a
    /// transport whose reply has begun to arrive, so that an awaiting thread
    /// is awake (a parked thread takes microseconds to run again) by the
    /// time the reply is read and [`RemoteCompletion::complete`] is called.
    /// The awaiter polls, spins up to 30 us for the completion, and waits
    /// again if it has not come; nothing is lost whatever the order of the
    /// two calls.
    pub fn nudge(&self) {
        self.0.nudge();
    }

    /// True once completed or failed.
    pub fn is_finished(&self) -> bool {
        self.0.is_finished()
    }

    /// `None` while pending; then `Ok` or the error it failed with.
    pub fn outcome(&self) -> Option<Result<()>> {
        match self.0.status() {
            crate::completion::Status::Pending => None,
            crate::completion::Status::Done => Some(Ok(())),
            crate::completion::Status::Failed => Some(Err(self.0.error())),
        }
    }

    /// `Ready` with the outcome once finished; otherwise wakes `cx`'s waker
    /// when it is (one waiter: the last registered). For a session wrapping
    /// another, to forward the inner completion's outcome.
    pub fn poll_outcome(&self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<()>> {
        match self.0.poll_status(cx.waker()) {
            crate::completion::Status::Pending => std::task::Poll::Pending,
            crate::completion::Status::Done => std::task::Poll::Ready(Ok(())),
            crate::completion::Status::Failed => std::task::Poll::Ready(Err(self.0.error())),
        }
    }

    /// Waits for the outcome ([`RemoteCompletion::poll_outcome`]).
    pub async fn finished(&self) -> Result<()> {
        std::future::poll_fn(|cx| self.poll_outcome(cx)).await
    }

    pub(crate) fn completion(&self) -> &Arc<Completion> {
        &self.0
    }
}

/// What [`RemotePolicy::new`](crate::remote::RemotePolicy::new) takes: a
/// session, or something that provides one (a lease).
pub trait AsRemoteSession {
    /// The session.
    fn remote_session(&self) -> Arc<dyn RemoteSession>;
}

impl<S: RemoteSession + 'static> AsRemoteSession for Arc<S> {
    fn remote_session(&self) -> Arc<dyn RemoteSession> {
        self.clone()
    }
}

impl AsRemoteSession for Arc<dyn RemoteSession> {
    fn remote_session(&self) -> Arc<dyn RemoteSession> {
        self.clone()
    }
}
