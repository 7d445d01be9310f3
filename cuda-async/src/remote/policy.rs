//! [`RemotePolicy`]: the scheduling policy that hands out remote contexts,
//! and the sending of what one recorded.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cuda_core::Result;

use crate::context::ExecutionContext;
use crate::policy::SchedulingPolicy;

use super::context::{OnReply, RemoteContext};
use super::recording::RemoteStream;
use super::session::{AsRemoteSession, RemoteCompletion, RemoteSession};

/// The default number of streams a [`RemotePolicy`] spreads submissions over.
pub const DEFAULT_REMOTE_STREAMS: u32 = 4;

/// Submissions on a remote session's GPU, round-robin over k of its streams.
///
/// The same op runs locally or remotely; only the policy changes:
///
/// | | local GPU | remote session |
/// |---|---|---|
/// | policy | [`StreamPoolRoundRobin`](crate::StreamPoolRoundRobin) | `RemotePolicy::new(&lease)` |
/// | async | `op.schedule(&local)?.await` | `op.schedule(&remote)?.await` |
/// | blocking, no runtime | `op.sync_with(&local)` (or `op.sync()`) | `op.sync_with(&remote)` |
/// | one call | [`run_on(op, &local).await`](crate::run_on) | `run_on(op, &remote).await` |
///
/// A submission (everything one executor call runs) is recorded without
/// waiting and sent as one message on its first poll (or its blocking call);
/// the node's reply completes it. Submissions run on the remote GPU in the
/// order sent; buffers carry their ordering across streams as they do locally.
#[derive(Debug)]
pub struct RemotePolicy {
    session: Arc<dyn RemoteSession>,
    streams: u32,
    next: AtomicUsize,
}

impl RemotePolicy {
    /// A policy over [`DEFAULT_REMOTE_STREAMS`] streams of `target`'s session.
    pub fn new(target: &impl AsRemoteSession) -> Self {
        RemotePolicy {
            session: target.remote_session(),
            streams: DEFAULT_REMOTE_STREAMS,
            next: AtomicUsize::new(0),
        }
    }

    /// The same session over `k` streams (at least 1; a node allows at most
    /// 8 per lease by default).
    pub fn with_streams(mut self, k: u32) -> Self {
        self.streams = k.max(1);
        self
    }

    /// The session.
    pub fn session(&self) -> &Arc<dyn RemoteSession> {
        &self.session
    }

    /// The streams of the session it spreads ops over.
    pub fn streams(&self) -> u32 {
        self.streams
    }
}

impl SchedulingPolicy for RemotePolicy {
    fn select(&self) -> Result<ExecutionContext> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.streams as usize;
        Ok(ExecutionContext::new_remote(RemoteContext::new(
            self.session.clone(),
            i as RemoteStream,
            self.streams,
        )))
    }
}

/// Sends what `ctx` recorded, returning its completion and the steps to run
/// on reply. An empty recording is complete at once (no message): `None`.
pub(crate) fn send(ctx: &mut ExecutionContext) -> Option<(RemoteCompletion, OnReply)> {
    let remote = ctx.as_remote()?;
    let recording = std::mem::take(&mut remote.recording);
    let on_reply = std::mem::take(&mut remote.on_reply);
    if recording.is_empty() {
        return None;
    }
    let done = RemoteCompletion::new();
    remote.session().submit(recording, done.clone());
    Some((done, on_reply))
}
