//! A session's ledger of ids: which of its buffers, events and graphs exist
//! on the node, as far as frees need to know, and the frees waiting to be
//! sent. Pure bookkeeping over the commands sent and the replies' counts of
//! commands that ran, with no I/O: a transport keeps one
//! ([`RemoteSession::ledger`](super::RemoteSession::ledger)) and numbers
//! each message through it ([`Ledger::send`]); `cuda-async` asks it for
//! frees, graph holds and graph frees.
//!
//! A BATCH reply says which commands ran (`0..completed`), so what exists
//! after a failed submission is exactly what those commands created and did
//! not free. A free is sent only for an id that exists:
//!
//! - *pending*: its creating command (`Alloc`, an event's first `Record`,
//!   `GraphBegin`, `PrepareBegin`) is unanswered; its free waits for that reply;
//! - *born*: its creating command ran, and no free of it is queued or ran;
//! - any other id does not exist (its creating command did not run or was
//!   never sent, e.g. a recording dropped on an error): its free is dropped;
//! - a free that did not run (a queued one leading the batch, or one of the
//!   recording) is queued again, unless its id was created by a command of
//!   that batch that did not run, or it is the command the node refused.
//!
//! A request refused whole, or one whose reply never came, ran nothing.
//!
//! Queued frees go with the next message the transport numbers or, when none
//! is in flight, at once, alone; a free asked meanwhile waits for the last
//! reply, unless a message takes it first. No timer decides either.

use super::proto::{IdMap, IdSet};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::proto::{Command, Op};

/// A sent BATCH's ids, by their command's index in it: what its reply
/// settles ([`Ledger::settle`]).
#[derive(Debug, Default)]
pub struct Sent {
    /// Commands that create an id.
    created: Vec<(u32, u64)>,
    /// Frees: the queued ones leading the batch, then the recording's.
    freed: Vec<(u32, u64)>,
}

impl Sent {
    /// The ids of a BATCH of `frees` (stream 0, first), then `commands`.
    fn of(frees: &[u64], commands: &[Command<'_>]) -> Self {
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
                // An event is created by its first record (cuda-async records
                // each of its fresh event ids once).
                Op::Record { event } if !s.created.iter().any(|&(_, e)| e == event.0) => {
                    s.created.push((at, event.0));
                }
                Op::GraphBegin { graph } | Op::PrepareBegin { prepared: graph } => {
                    s.created.push((at, graph.0))
                }
                Op::Free { id } => s.freed.push((at, id.0)),
                _ => {}
            }
        }
        s
    }
}

/// What ran of a sent BATCH, from its reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ran {
    /// Commands `0..completed` ran.
    pub completed: u32,
    /// The command the node refused, if any.
    pub refused: Option<u32>,
}

impl Ran {
    /// Nothing ran (a request refused whole, or no reply).
    pub const NOTHING: Ran = Ran {
        completed: 0,
        refused: None,
    };

    /// All `n` commands ran.
    pub fn all(n: usize) -> Ran {
        Ran {
            completed: u32::try_from(n).unwrap_or(u32::MAX),
            refused: None,
        }
    }
}

/// A session's ids and queued frees (see the module's docs), shared by the
/// transport and `cuda-async`.
#[derive(Debug, Default)]
pub struct Ledger {
    book: Mutex<Book>,
    /// Notified when a message is settled.
    settled: Condvar,
}

impl Ledger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    fn book(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A message goes out: takes the queued frees to lead it (unless
    /// `keep_frees`), notes its ids and calls `number` with the frees, all
    /// under the ledger's lock. A transport numbers the message in `number`,
    /// so frees reach the node in the order taken (a graph's free before the
    /// frees it held back). Settle each message sent this way once
    /// ([`Ledger::settle`] or [`Ledger::forget`]).
    pub fn send<R>(
        &self,
        keep_frees: bool,
        commands: &[Command<'_>],
        number: impl FnOnce(&[u64]) -> R,
    ) -> (Sent, R) {
        let mut book = self.book();
        let frees = if keep_frees {
            Vec::new()
        } else {
            std::mem::take(&mut book.queued)
        };
        let sent = Sent::of(&frees, commands);
        book.sending(&sent);
        let r = number(&frees);
        (sent, r)
    }

    /// The queued frees alone, as [`Ledger::send`] of no commands; `None`
    /// when none are queued (a message took them first: nothing to send).
    pub fn send_frees<R>(&self, number: impl FnOnce(&[u64]) -> R) -> Option<(Sent, R)> {
        let mut book = self.book();
        if book.queued.is_empty() {
            return None;
        }
        let frees = std::mem::take(&mut book.queued);
        let sent = Sent::of(&frees, &[]);
        book.sending(&sent);
        let r = number(&frees);
        Some((sent, r))
    }

    /// The reply of `sent` says what `ran` (`None`: no reply, or a request
    /// refused whole: nothing ran). True when the transport should send the
    /// queued frees now ([`Ledger::send_frees`]): some are queued, no message
    /// is in flight, and the reply named what ran (so a lease that refuses
    /// every request does not loop on its frees; they ride on the next one).
    pub fn settle(&self, sent: &Sent, ran: Option<Ran>) -> bool {
        let mut book = self.book();
        book.in_flight = book.in_flight.saturating_sub(1);
        book.settle(sent, ran.unwrap_or(Ran::NOTHING));
        self.notify(&book);
        ran.is_some() && book.flush_due()
    }

    /// A message whose reply will never be read (its future dropped after it
    /// was sent): no longer in flight; its ids stay as they are (what it
    /// created leaks, never a free of something in use).
    pub fn forget(&self, sent: Sent) {
        let _ = sent;
        let mut book = self.book();
        book.in_flight = book.in_flight.saturating_sub(1);
        self.notify(&book);
    }

    /// Wakes the [`Ledger::wait_idle`] callers, if any: a condition
    /// variable's notify is a system call even with no one waiting, and
    /// every reply settles.
    fn notify(&self, book: &Book) {
        if book.waiters > 0 {
            self.settled.notify_all();
        }
    }

    /// Blocks until no message is in flight and no free is queued, or `limit`
    /// passes; true when idle.
    pub fn wait_idle(&self, limit: Duration) -> bool {
        let end = Instant::now() + limit;
        let mut book = self.book();
        // Counted under the lock, so a settle after this sees it.
        book.waiters += 1;
        let idle = loop {
            if book.in_flight == 0 && book.queued.is_empty() {
                break true;
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break false;
            }
            book = self
                .settled
                .wait_timeout(book, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        book.waiters -= 1;
        idle
    }

    /// Whether frees are queued and no message is in flight: they go now, alone.
    pub fn flush_due(&self) -> bool {
        self.book().flush_due()
    }

    /// The free of `id` (a dropped buffer or event). True when the caller
    /// should have the queued frees sent now ([`Ledger::flush_due`]); else it
    /// rides on a later message, waits for the reply creating `id` or for the
    /// graphs holding `id`, or is dropped (`id` never existed).
    pub fn free(&self, id: u64) -> bool {
        let mut book = self.book();
        book.free(id) && book.flush_due()
    }

    /// Frees graph `graph`; once a reply says that free ran, lets go of the ids
    /// it held ([`Ledger::hold`]), whose frees follow in a later message (the
    /// node refuses to free what a live graph uses). True as [`Ledger::free`].
    pub fn free_graph(&self, graph: u64, held: Vec<u64>) -> bool {
        let mut book = self.book();
        book.free_graph(graph, held) && book.flush_due()
    }

    /// Holds `ids` (what a graph kept on the node uses, or a transfer moves):
    /// their frees asked for meanwhile wait for [`Ledger::free_and_release`].
    pub fn hold(&self, ids: &[u64]) {
        self.book().hold(ids);
    }

    /// Frees `frees` and lets go of `held` in one step (the end of a transfer).
    /// True as [`Ledger::free`].
    pub fn free_and_release(&self, frees: &[u64], held: &[u64]) -> bool {
        let mut book = self.book();
        for &id in frees {
            book.free(id);
        }
        book.release(held);
        book.flush_due()
    }

    /// Whether `id` is held ([`Ledger::hold`]).
    pub fn is_held(&self, id: u64) -> bool {
        self.book().is_held(id)
    }
}

/// The ledger's state, behind its lock.
#[derive(Debug, Default)]
struct Book {
    /// Frees to send with the next message.
    queued: Vec<u64>,
    /// Messages sent and not settled yet.
    in_flight: usize,
    /// Threads in [`Ledger::wait_idle`].
    waiters: usize,
    /// Ids created by submissions not answered yet: true once freed.
    pending: IdMap<u64, bool>,
    /// Ids whose creating command ran, not freed since.
    born: IdSet<u64>,
    /// Ids graphs hold, with how many hold each.
    held: IdMap<u64, u32>,
    /// Frees asked for held ids: queued when the last hold goes.
    deferred: IdSet<u64>,
    /// Freed graphs whose free has not run yet, with the ids they hold: let go
    /// once a reply says it ran, or the graph never existed (the node would
    /// refuse a held id's free sent while the graph's is in flight).
    after: IdMap<u64, Vec<u64>>,
}

impl Book {
    fn flush_due(&self) -> bool {
        self.in_flight == 0 && !self.queued.is_empty()
    }

    /// `sent` goes out now: its creations are pending until its reply.
    fn sending(&mut self, sent: &Sent) {
        self.in_flight += 1;
        for &(_, id) in &sent.created {
            self.pending.insert(id, false);
        }
    }

    /// Frees `graph`, then `held` once that ran (see [`Ledger::free_graph`]).
    fn free_graph(&mut self, graph: u64, held: Vec<u64>) -> bool {
        self.after.insert(graph, held);
        self.free(graph)
    }

    fn is_held(&self, id: u64) -> bool {
        self.held.contains_key(&id)
    }

    /// The free of `id`: true when it was queued (it exists), false when
    /// it waits for a reply or was dropped (the id never existed).
    fn free(&mut self, id: u64) -> bool {
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

    fn queue(&mut self, id: u64) -> bool {
        self.queued.push(id);
        true
    }

    /// Lets go of what graph `id` held, if it was freed holding some.
    fn let_go(&mut self, id: u64) -> bool {
        match self.after.remove(&id) {
            Some(held) => self.release(&held),
            None => false,
        }
    }

    /// A graph holds `ids`: their frees wait for [`Book::release`].
    fn hold(&mut self, ids: &[u64]) {
        for id in ids {
            *self.held.entry(*id).or_insert(0) += 1;
        }
    }

    /// A graph lets go of `ids`: the frees asked for meanwhile of those no
    /// other graph holds go now. True when frees were queued.
    fn release(&mut self, ids: &[u64]) -> bool {
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

    /// The reply of `sent` says `ran`: creations that ran are born (frees
    /// asked meanwhile are queued), the others never existed; frees that ran
    /// are gone, the others are asked again. True when frees were queued.
    fn settle(&mut self, sent: &Sent, ran: Ran) -> bool {
        let mut queued = false;
        let mut never = IdSet::default();
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
                // A graph's free ran: what it held may go now.
                queued |= self.let_go(id);
            } else if Some(at) != ran.refused && !never.contains(&id) {
                self.born.insert(id);
                queued |= self.free(id);
            }
        }
        queued
    }
}

#[cfg(test)]
impl Book {
    fn take_queued(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.queued)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::remote::proto::Id;

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

    /// `ids` made by a batch that ran.
    fn born(book: &mut Book, ids: &[u64]) {
        let allocs: Vec<_> = ids.iter().map(|&id| alloc(id)).collect();
        let sent = Sent::of(&[], &allocs);
        book.sending(&sent);
        assert!(!book.settle(&sent, Ran::all(ids.len())));
    }

    #[test]
    fn frees_leading_a_refused_batch_are_sent_again_but_not_the_refused_one() {
        let mut book = Book::default();
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
        let mut book = Book::default();
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
    fn the_frees_a_graph_held_follow_the_graphs_own_free_once_it_ran() {
        let mut book = Book::default();
        born(&mut book, &[5, 6, 7]);
        // Graph 2, capture unanswered, holds buffer 5 (freed meanwhile).
        let sent = Sent::of(&[], &[graph(2)]);
        book.sending(&sent);
        book.hold(&[5]);
        assert!(!book.free(5));
        // Dropped before its capture's reply: nothing may go yet (5 in use).
        assert!(!book.free_graph(2, vec![5]));
        assert!(book.take_queued().is_empty());
        assert!(book.settle(&sent, Ran::all(1)));
        assert_eq!(book.take_queued(), [2]);
        // 5 waits until the graph's free has run (see `Book::after`).
        let free_2 = Sent::of(&[2], &[]);
        book.sending(&free_2);
        assert!(book.is_held(5));
        assert!(book.settle(&free_2, Ran::all(1)));
        assert_eq!(book.take_queued(), [5]);
        // A graph's free that did not run goes again; what it holds waits.
        born(&mut book, &[4]);
        book.hold(&[6]);
        assert!(!book.free(6));
        assert!(book.free_graph(4, vec![6]));
        assert_eq!(book.take_queued(), [4]);
        let lost = Sent::of(&[4], &[]);
        book.sending(&lost);
        assert!(book.settle(&lost, Ran::NOTHING));
        assert_eq!(book.take_queued(), [4], "asked again; 6 still held");
        let free_4 = Sent::of(&[4], &[]);
        book.sending(&free_4);
        assert!(book.settle(&free_4, Ran::all(1)));
        assert_eq!(book.take_queued(), [6]);
        // A graph whose capture did not run held nothing on the node.
        let sent = Sent::of(&[], &[graph(3)]);
        book.sending(&sent);
        book.hold(&[7]);
        assert!(!book.free(7));
        assert!(!book.free_graph(3, vec![7]));
        assert!(book.settle(&sent, Ran::NOTHING));
        assert_eq!(book.take_queued(), [7]);
    }

    #[test]
    fn frees_go_alone_only_when_no_message_is_in_flight() {
        let ledger = Ledger::new();
        let (made, ()) = ledger.send(false, &[alloc(1), alloc(2), alloc(3)], |_| ());
        assert!(!ledger.settle(&made, Some(Ran::all(3))));
        // Idle: the free should go now.
        assert!(ledger.free(1));
        let (frees, taken) = ledger.send_frees(<[u64]>::to_vec).unwrap();
        assert_eq!(taken, [1]);
        assert!(!ledger.free(2), "a message is in flight");
        // A message numbered meanwhile takes it.
        let (other, led) = ledger.send(false, &[], <[u64]>::to_vec);
        assert_eq!(led, [2]);
        assert!(
            ledger.send_frees(|_| ()).is_none(),
            "nothing left: no empty batch"
        );
        assert!(!ledger.free(3));
        assert!(
            !ledger.settle(&frees, Some(Ran::all(1))),
            "one still in flight"
        );
        assert!(
            ledger.settle(&other, Some(Ran::all(1))),
            "the last reply sends 3"
        );
        assert!(ledger.flush_due());
        // A reply that names nothing leaves the frees for the next message.
        let (lost, _) = ledger.send_frees(|_| ()).unwrap();
        assert!(!ledger.settle(&lost, None));
        assert!(ledger.flush_due(), "3 was asked again");
    }

    /// Settles notify only while someone waits: each waiter must still be
    /// woken by the settle (or forget) that makes the ledger idle.
    #[test]
    fn a_waiter_is_woken_by_the_reply_that_makes_the_ledger_idle() {
        let ledger = std::sync::Arc::new(Ledger::new());
        for forget in [false, true] {
            let (sent, ()) = ledger.send(false, &[alloc(1)], |_| ());
            let waiter = {
                let ledger = ledger.clone();
                std::thread::spawn(move || ledger.wait_idle(Duration::from_secs(20)))
            };
            // Until the waiter is counted (then it waits, or is about to,
            // under the lock the settle takes).
            while ledger.book().waiters == 0 {
                std::thread::yield_now();
            }
            let t = Instant::now();
            if forget {
                ledger.forget(sent);
            } else {
                ledger.settle(&sent, Some(Ran::all(1)));
            }
            assert!(waiter.join().unwrap(), "not woken (forget: {forget})");
            assert!(t.elapsed() < Duration::from_secs(10));
            assert_eq!(ledger.book().waiters, 0);
        }
    }
}
