//! Which of a session's ids exist on the node, as far as frees need to
//! know: pure bookkeeping over the commands sent and the replies' counts
//! of commands that ran, with no I/O (unit-tested below).
//!
//! The rule: a BATCH reply says which commands ran (`0..completed`), so
//! what exists after a failed submission is exactly what those commands
//! created and did not free. A free is sent only for an id that exists:
//!
//! - an id whose creating command (`Alloc`, the first `Record` of an
//!   event) has not been answered yet is *pending*: its free waits for
//!   that reply;
//! - an id whose creating command ran is *born*, until a free of it is
//!   queued or runs;
//! - any other id does not exist on the node (its creating command did
//!   not run, or was never sent: a recording dropped on an error): its
//!   free is dropped, never sent;
//! - a free that did not run (a queued one leading the batch, or one the
//!   recording holds) is queued again, unless its id was created by a
//!   command of that batch that did not run, or it is the command the
//!   node refused (that free could not run).
//!
//! A request the node refused whole, or one whose reply never came, ran
//! nothing as far as this client knows.

use std::collections::{HashMap, HashSet};

use cuda_async::remote::{Command, Op};

/// A sent BATCH's ids, by their command's index in it.
#[derive(Debug, Default)]
pub(super) struct Sent {
    /// Commands that create an id.
    created: Vec<(u32, u64)>,
    /// Frees: the queued ones leading the batch, then the recording's.
    freed: Vec<(u32, u64)>,
}

impl Sent {
    /// The ids of a BATCH of `frees` (stream 0, first), then `commands`.
    pub(super) fn of(frees: &[u64], commands: &[Command<'_>]) -> Self {
        let mut s = Sent {
            created: Vec::new(),
            freed: frees
                .iter()
                .enumerate()
                .map(|(i, id)| (i as u32, *id))
                .collect(),
        };
        let base = frees.len();
        for (i, c) in commands.iter().enumerate() {
            let at = (base + i) as u32;
            match c.op {
                Op::Alloc { buf, .. } => s.created.push((at, buf.0)),
                // An event is created by its first record (a session's
                // events are fresh ids: cuda-async records each once).
                Op::Record { event } if !s.created.iter().any(|&(_, e)| e == event.0) => {
                    s.created.push((at, event.0));
                }
                Op::GraphBegin { graph } => s.created.push((at, graph.0)),
                Op::Free { id } => s.freed.push((at, id.0)),
                _ => {}
            }
        }
        s
    }

    /// Nothing to settle when its reply comes.
    pub(super) fn is_empty(&self) -> bool {
        self.created.is_empty() && self.freed.is_empty()
    }
}

/// What ran of a sent BATCH.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Ran {
    /// Commands `0..completed` ran.
    pub(super) completed: u32,
    /// The command the node refused, if any.
    pub(super) refused: Option<u32>,
}

impl Ran {
    /// Nothing ran (a request refused whole, or no reply).
    pub(super) const NOTHING: Ran = Ran {
        completed: 0,
        refused: None,
    };
}

/// The frees to send and the ids they must wait for or forget.
#[derive(Debug, Default)]
pub(super) struct IdBook {
    /// Frees to send with the next message.
    queued: Vec<u64>,
    /// Ids created by submissions not answered yet: true once freed.
    pending: HashMap<u64, bool>,
    /// Ids whose creating command ran, not freed since.
    born: HashSet<u64>,
    /// Ids graphs hold, with how many hold each.
    held: HashMap<u64, u32>,
    /// Frees asked for held ids: queued when the last hold goes.
    deferred: HashSet<u64>,
    /// Graphs freed whose free is not queued yet, with the ids they hold:
    /// let go once it is (or once the graph is known never to have
    /// existed), so the node sees the graph's free first.
    after: HashMap<u64, Vec<u64>>,
}

impl IdBook {
    /// Takes the queued frees, to lead the next message.
    pub(super) fn take_queued(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.queued)
    }

    /// Whether frees are queued.
    pub(super) fn has_queued(&self) -> bool {
        !self.queued.is_empty()
    }

    /// `sent` goes out now: its creations are pending until its reply.
    pub(super) fn sending(&mut self, sent: &Sent) {
        for &(_, id) in &sent.created {
            self.pending.insert(id, false);
        }
    }

    /// The free of `id`: true when it was queued (it exists), false when
    /// it waits for a reply or was dropped (the id never existed).
    pub(super) fn free(&mut self, id: u64) -> bool {
        if self.held.contains_key(&id) {
            self.deferred.insert(id);
            return false;
        }
        if let Some(freed) = self.pending.get_mut(&id) {
            *freed = true;
            return false;
        }
        if self.born.remove(&id) {
            return self.queue(id);
        }
        // It does not exist (a graph so freed lets go of what it held).
        self.let_go(id)
    }

    /// Frees `graph`, then lets go of the ids it held (as
    /// [`IdBook::release`]) once its free is queued: their frees follow
    /// it, whenever its creation is answered. True when frees were queued.
    pub(super) fn free_graph(&mut self, graph: u64, held: Vec<u64>) -> bool {
        self.after.insert(graph, held);
        self.free(graph)
    }

    /// Queues the free of `id`, then the frees a graph `id` held back.
    fn queue(&mut self, id: u64) -> bool {
        self.queued.push(id);
        self.let_go(id);
        true
    }

    /// Lets go of what graph `id` held, if it was freed holding some.
    fn let_go(&mut self, id: u64) -> bool {
        match self.after.remove(&id) {
            Some(held) => self.release(&held),
            None => false,
        }
    }

    /// A graph holds `ids`: their frees wait for [`IdBook::release`].
    pub(super) fn hold(&mut self, ids: &[u64]) {
        for id in ids {
            *self.held.entry(*id).or_insert(0) += 1;
        }
    }

    /// A graph lets go of `ids`: the frees asked for meanwhile of those no
    /// other graph holds go now. True when frees were queued.
    pub(super) fn release(&mut self, ids: &[u64]) -> bool {
        let mut queued = false;
        for id in ids {
            let Some(n) = self.held.get_mut(id) else {
                continue;
            };
            *n -= 1;
            if *n == 0 {
                self.held.remove(id);
                if self.deferred.remove(id) {
                    queued |= self.free(*id);
                }
            }
        }
        queued
    }

    /// Whether a graph holds `id`.
    pub(super) fn is_held(&self, id: u64) -> bool {
        self.held.contains_key(&id)
    }

    /// The reply of `sent` says `ran`: creations that ran are born (their
    /// frees asked meanwhile are queued), the others never existed; frees
    /// that ran are gone, those that did not are asked again. True when
    /// frees were queued.
    pub(super) fn settle(&mut self, sent: &Sent, ran: Ran) -> bool {
        let mut queued = false;
        let mut never = HashSet::new();
        for &(at, id) in &sent.created {
            let freed = self.pending.remove(&id).unwrap_or(false);
            match (at < ran.completed, freed) {
                (true, true) => queued |= self.queue(id),
                (true, false) => {
                    self.born.insert(id);
                }
                (false, _) => {
                    never.insert(id);
                    if freed {
                        queued |= self.let_go(id);
                    }
                }
            }
        }
        for &(at, id) in &sent.freed {
            if at < ran.completed {
                self.born.remove(&id);
            } else if Some(at) != ran.refused && !never.contains(&id) {
                self.born.insert(id);
                queued |= self.free(id);
            }
        }
        queued
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use cuda_async::remote::Id;

    fn on_stream_0(op: Op<'static>) -> Command<'static> {
        Command { stream: 0, op }
    }

    fn alloc(id: u64) -> Command<'static> {
        on_stream_0(Op::Alloc {
            buf: Id(id),
            size: 4,
        })
    }

    fn free(id: u64) -> Command<'static> {
        on_stream_0(Op::Free { id: Id(id) })
    }

    fn record(event: u64) -> Command<'static> {
        on_stream_0(Op::Record { event: Id(event) })
    }

    fn all(n: u32) -> Ran {
        Ran {
            completed: n,
            refused: None,
        }
    }

    /// `ids` made by a batch that ran.
    fn born(book: &mut IdBook, ids: &[u64]) {
        let allocs: Vec<_> = ids.iter().map(|&id| alloc(id)).collect();
        let sent = Sent::of(&[], &allocs);
        book.sending(&sent);
        assert!(!book.settle(&sent, all(ids.len() as u32)));
    }

    #[test]
    fn a_submission_that_ran_leaves_its_ids_and_frees_them_once() {
        let mut book = IdBook::default();
        let sent = Sent::of(&[], &[alloc(1), alloc(2), free(2)]);
        book.sending(&sent);
        // Dropped before the reply: the free waits for it.
        assert!(!book.free(1));
        assert!(book.take_queued().is_empty());
        assert!(book.settle(&sent, all(3)));
        assert_eq!(book.take_queued(), [1]);
        // Later frees go straight out, once.
        born(&mut book, &[7]);
        assert!(book.free(7));
        assert_eq!(book.take_queued(), [7]);
        assert!(!book.free(7));
        // 2 was freed by its batch: nothing more to send.
        assert!(!book.free(2));
        assert!(book.take_queued().is_empty());
    }

    #[test]
    fn ids_whose_creation_did_not_run_are_never_freed() {
        let mut book = IdBook::default();
        // A batch refused whole (a module that does not compile).
        let sent = Sent::of(&[], &[alloc(1), record(2), alloc(3)]);
        book.sending(&sent);
        assert!(!book.free(3), "waits for the reply");
        assert!(!book.settle(&sent, Ran::NOTHING));
        assert!(!book.free(1));
        assert!(!book.free(2));
        assert!(book.take_queued().is_empty());
        // Never sent at all (a recording dropped on an error): its free
        // is not sent either.
        assert!(!book.free(40));
        assert!(book.take_queued().is_empty());
    }

    #[test]
    fn a_batch_stopped_midway_keeps_what_ran_and_asks_its_frees_again() {
        let mut book = IdBook::default();
        born(&mut book, &[10, 11, 12]);
        book.free(10);
        book.free(11);
        let queued = book.take_queued();
        // Free 10, free 11, alloc 1, alloc 2 (refused), free 1, free 12.
        let sent = Sent::of(&queued, &[alloc(1), alloc(2), free(1), free(12)]);
        book.sending(&sent);
        let ran = Ran {
            completed: 3,
            refused: Some(3),
        };
        assert!(book.settle(&sent, ran));
        // 1 exists (its free did not run), 12 exists; 2 never did.
        assert_eq!(book.take_queued(), [1, 12]);
        assert!(!book.free(2));
        assert!(book.take_queued().is_empty());
    }

    #[test]
    fn frees_leading_a_refused_batch_are_sent_again_but_not_the_refused_one() {
        let mut book = IdBook::default();
        born(&mut book, &[10, 11, 12]);
        for id in [10, 11, 12] {
            book.free(id);
        }
        let queued = book.take_queued();
        let sent = Sent::of(&queued, &[]);
        // Free 11 was refused: 10 ran, 11 cannot run, 12 must go again.
        let ran = Ran {
            completed: 1,
            refused: Some(1),
        };
        assert!(book.settle(&sent, ran));
        assert_eq!(book.take_queued(), [12]);
        // Nothing ran at all: all of them again.
        let sent = Sent::of(&[12], &[]);
        assert!(book.settle(&sent, Ran::NOTHING));
        assert_eq!(book.take_queued(), [12]);
    }

    #[test]
    fn an_event_is_created_by_its_first_record() {
        let sent = Sent::of(&[5], &[record(1), record(1), free(1)]);
        assert_eq!(sent.created, [(1, 1)]);
        assert_eq!(sent.freed, [(0, 5), (3, 1)]);
    }

    #[test]
    fn a_held_id_is_freed_when_its_last_hold_goes() {
        let mut book = IdBook::default();
        born(&mut book, &[1, 2, 3]);
        book.hold(&[1, 2]);
        book.hold(&[1]);
        assert!(!book.free(1), "held: the free waits");
        assert!(!book.free(2));
        assert!(book.take_queued().is_empty());
        assert!(book.release(&[1, 2]), "2 goes; 1 is still held once");
        assert_eq!(book.take_queued(), [2]);
        assert!(book.is_held(1));
        assert!(book.release(&[1]));
        assert_eq!(book.take_queued(), [1]);
        // Not asked for: nothing to send.
        book.hold(&[3]);
        assert!(!book.release(&[3]));
        assert!(book.take_queued().is_empty());
    }

    fn graph(id: u64) -> Command<'static> {
        on_stream_0(Op::GraphBegin { graph: Id(id) })
    }

    #[test]
    fn the_frees_a_graph_held_follow_the_graphs_own_free() {
        let mut book = IdBook::default();
        born(&mut book, &[5, 6, 7]);
        // Graph 2, capture unanswered, holds buffer 5 (freed meanwhile).
        let sent = Sent::of(&[], &[graph(2)]);
        book.sending(&sent);
        book.hold(&[5]);
        assert!(!book.free(5));
        // Dropped before its capture's reply: nothing may go yet, 5 least
        // of all (the node refuses to free what a live graph uses).
        assert!(!book.free_graph(2, vec![5]));
        assert!(book.take_queued().is_empty());
        assert!(book.settle(&sent, all(1)));
        assert_eq!(book.take_queued(), [2, 5]);
        // Settled first: both go at once, the graph first.
        born(&mut book, &[4]);
        book.hold(&[6]);
        assert!(!book.free(6));
        assert!(book.free_graph(4, vec![6]));
        assert_eq!(book.take_queued(), [4, 6]);
        // A graph whose capture did not run held nothing on the node.
        let sent = Sent::of(&[], &[graph(3)]);
        book.sending(&sent);
        book.hold(&[7]);
        assert!(!book.free(7));
        assert!(!book.free_graph(3, vec![7]));
        assert!(book.settle(&sent, Ran::NOTHING));
        assert_eq!(book.take_queued(), [7]);
    }
}
