//! Buffers that streamed downloads are reading. The node runs a streamed
//! download (a MEM_READ after its submission's batch) beside the lease's
//! later batches, so a later submission that uses (and may overwrite) such a
//! buffer is numbered when made but sent only once those reads are done: the
//! download sees the buffer as its own submission left it. Submissions that
//! use other buffers go at once.
//!
//! A session numbers a submission and registers (or checks) its reads under
//! the lock of its [`Reading`], so a submission waits only for reads
//! numbered before it, never for a later one (which waits for it).

use cuda_async::remote::proto::{IdMap, Role};
use cuda_async::remote::Command;
use tokio::sync::watch;

/// The streamed reads in flight, by buffer id.
#[derive(Debug, Default)]
pub(super) struct Reading {
    by_id: IdMap<u64, Vec<(u64, watch::Receiver<()>)>>,
    next: u64,
}

/// The reads of one streamed submission, registered in a [`Reading`] until
/// [`Reading::end`]; its buffers' waiters wake when this is dropped.
#[derive(Debug)]
pub(super) struct Reads {
    ticket: u64,
    ids: Vec<u64>,
    _done: watch::Sender<()>,
}

impl Reading {
    /// Registers reads of `ids` (none: `None`).
    pub(super) fn start(&mut self, ids: Vec<u64>) -> Option<Reads> {
        if ids.is_empty() {
            return None;
        }
        let (tx, rx) = watch::channel(());
        self.next += 1;
        for &id in &ids {
            self.by_id
                .entry(id)
                .or_default()
                .push((self.next, rx.clone()));
        }
        Some(Reads {
            ticket: self.next,
            ids,
            _done: tx,
        })
    }

    /// The reads are done (or failed): their buffers' waiters go on.
    pub(super) fn end(&mut self, reads: Reads) {
        for id in &reads.ids {
            if let Some(v) = self.by_id.get_mut(id) {
                v.retain(|(t, _)| *t != reads.ticket);
                if v.is_empty() {
                    self.by_id.remove(id);
                }
            }
        }
    }

    /// What a submission of `commands` waits for before it is sent: the
    /// reads in flight of the buffers it uses (every read in flight when
    /// it replays a graph or runs a prepared submission, whose buffers the
    /// commands do not name).
    pub(super) fn conflicts(&self, commands: &[Command<'_>]) -> Vec<watch::Receiver<()>> {
        if self.by_id.is_empty() {
            return Vec::new();
        }
        let mut waits = Vec::new();
        let mut of = |id: u64| {
            if let Some(v) = self.by_id.get(&id) {
                waits.extend(v.iter().map(|(_, rx)| rx.clone()));
            }
        };
        for c in commands {
            match c.op.role() {
                Role::Free(id) => of(id.0),
                Role::Launch(_) | Role::Run { .. } => {
                    for &id in self.by_id.keys() {
                        of(id);
                    }
                }
                Role::Alloc { .. }
                | Role::Write { .. }
                | Role::Read { .. }
                | Role::Begin { .. }
                | Role::End(_)
                | Role::Plain => c.op.buffers(|id, _| of(id.0)),
            }
        }
        waits
    }
}

/// Waits until every read of `waits` is done.
pub(super) async fn done(waits: Vec<watch::Receiver<()>>) {
    for mut rx in waits {
        // The sender goes when the reads end: `changed` then fails.
        while rx.changed().await.is_ok() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cuda_async::remote::Op;

    fn read(id: u64) -> Command<'static> {
        let (buf, offset, len) = (cuda_async::remote::Id(id), 0, 4);
        Command {
            stream: 0,
            op: Op::Read { buf, offset, len },
        }
    }

    #[tokio::test]
    async fn a_use_of_a_buffer_being_read_waits_for_the_read_and_others_do_not() {
        let mut r = Reading::default();
        let reads = r.start(vec![1, 2]).unwrap();
        assert!(r.conflicts(&[read(3)]).is_empty());
        let waits = r.conflicts(&[read(2)]);
        assert_eq!(waits.len(), 1);
        let mut waiting = Box::pin(done(waits));
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        r.end(reads);
        waiting.await;
        assert!(r.conflicts(&[read(1), read(2)]).is_empty());
        assert!(r.start(Vec::new()).is_none());
    }
}
