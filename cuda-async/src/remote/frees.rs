//! Where the free of a remote buffer or event goes: into the submission of
//! its session being recorded on this thread, if any (after every use it
//! records), otherwise to the session's [`Ledger`](super::Ledger).

use std::cell::RefCell;
use std::sync::Arc;

use super::proto::{Id, Op};
use super::recording::{Recording, RemoteStream};
use super::session::{RemoteCompletion, RemoteSession};

/// Frees of a session's buffers dropped while one of its submissions is
/// recorded on this thread, to join that submission's end.
struct Frame {
    session: *const (),
    frees: Vec<u64>,
    /// A graph's capture: the session's frees go into its body (the node
    /// keeps them until the graph's free), not to the outermost frame's end.
    capture: bool,
}

thread_local! {
    static FRAMES: RefCell<Vec<Frame>> = const { RefCell::new(Vec::new()) };
}

fn session_addr(s: &Arc<dyn RemoteSession>) -> *const () {
    Arc::as_ptr(s).cast::<()>()
}

/// Frees remote buffer `id` of `session` after every use recorded so far.
pub(crate) fn free_remote(session: &Arc<dyn RemoteSession>, id: u64) {
    let addr = session_addr(session);
    let taken = FRAMES
        .try_with(|f| {
            let mut frames = f.borrow_mut();
            // The outermost frame of the session: its submission is sent
            // last (a nested blocking call sends its own first), so the
            // free follows every use recorded on this thread.
            let capture = frames
                .iter()
                .rposition(|fr| fr.session == addr && fr.capture);
            let at = capture.or_else(|| frames.iter().position(|fr| fr.session == addr));
            let frame = at.and_then(|i| frames.get_mut(i));
            frame.map(|fr| fr.frees.push(id)).is_some()
        })
        .unwrap_or(false);
    if !taken {
        free_through_ledger(session, id);
    }
}

/// Frees `id` through `session`'s ledger (none: nothing outside recordings is
/// freed), sending the queued frees now when the ledger says so.
pub(crate) fn free_through_ledger(session: &Arc<dyn RemoteSession>, id: u64) {
    if let Some(ledger) = session.ledger() {
        if ledger.free(id) {
            send_frees(session);
        }
    }
}

/// Has `session` send its queued frees now, as an empty submission.
pub(crate) fn send_frees(session: &Arc<dyn RemoteSession>) {
    session.submit(Recording::new(), RemoteCompletion::new());
}

/// While alive, frees of `session`'s buffers dropped on this thread are
/// collected for the submission being recorded.
pub(crate) struct RecordingFrame {
    session: Arc<dyn RemoteSession>,
    depth: usize,
}

impl RecordingFrame {
    /// A frame for `session`'s frees on this thread; `capture` for a graph's
    /// capture (see [`Frame::capture`]).
    pub(crate) fn push(session: &Arc<dyn RemoteSession>, capture: bool) -> Self {
        let depth = FRAMES.with(|f| {
            let mut frames = f.borrow_mut();
            frames.push(Frame {
                session: session_addr(session),
                frees: Vec::new(),
                capture,
            });
            frames.len()
        });
        RecordingFrame {
            session: session.clone(),
            depth,
        }
    }

    /// Ends the frame: its frees are recorded at the end of `recording`
    /// on `stream`, except those of ids a graph holds, which go to the
    /// session (it frees them once the graph lets go).
    pub(crate) fn finish(self, recording: &mut Recording, stream: RemoteStream) {
        let ledger = self.session.ledger();
        for id in self.pop() {
            if ledger.as_ref().is_some_and(|l| l.is_held(id)) {
                free_through_ledger(&self.session, id);
                continue;
            }
            recording.push(stream, Op::Free { id: Id(id) });
        }
        std::mem::forget(self);
    }

    fn pop(&self) -> Vec<u64> {
        FRAMES
            .try_with(|f| {
                let mut frames = f.borrow_mut();
                if frames.len() >= self.depth {
                    frames.remove(self.depth - 1).frees
                } else {
                    Vec::new()
                }
            })
            .unwrap_or_default()
    }
}

impl Drop for RecordingFrame {
    fn drop(&mut self) {
        // Not finished (a panic): the frees go out through the session.
        for id in self.pop() {
            free_through_ledger(&self.session, id);
        }
    }
}
