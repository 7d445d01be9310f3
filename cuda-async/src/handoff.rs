//! The host-only parts of the completion reactor, kept free of CUDA so loom
//! can model them and miri can check them:
//!
//! - [`SeqQueue`]: one stream's pending submissions, in sequence order,
//!   completed up to the number the stream has written;
//! - [`IdleGate`]: the reactor's "anything in flight?" counter and its
//!   sleep flag in one word: a submitter's increment returns the flag; the
//!   reactor sets the flag only if the count is zero (one compare-exchange).
//!   The two are ordered on one location, so either the submitter sees the
//!   flag and unparks the reactor, or the reactor sees the count and stays
//!   awake: it never sleeps through work.

use std::collections::VecDeque;

use cuda_core::Error;

use crate::completion::Completion;
use crate::sync::{Arc, AtomicUsize, Ordering};

/// Pending submissions of one stream, by sequence number.
#[derive(Debug, Default)]
pub(crate) struct SeqQueue {
    last: u64,
    waiting: VecDeque<(u64, Arc<Completion>)>,
}

impl SeqQueue {
    /// The number the next submission gets (not yet taken).
    pub(crate) fn next_seq(&self) -> u64 {
        self.last + 1
    }

    /// Takes `seq` (= `next_seq()`) for `c`, once its write is enqueued.
    pub(crate) fn push(&mut self, seq: u64, c: Arc<Completion>) {
        debug_assert_eq!(seq, self.last + 1, "sequence numbers are taken in order");
        self.last = seq;
        self.waiting.push_back((seq, c));
    }

    /// Completes every submission numbered `<= reached`; returns how many.
    pub(crate) fn complete_upto(&mut self, reached: u64) -> usize {
        let mut n = 0;
        while let Some((seq, _)) = self.waiting.front() {
            if *seq > reached {
                break;
            }
            if let Some((_, c)) = self.waiting.pop_front() {
                c.complete();
                n += 1;
            }
        }
        n
    }

    /// Fails every pending submission with `e`; returns how many.
    pub(crate) fn fail_all(&mut self, e: &Error) -> usize {
        let n = self.waiting.len();
        for (_, c) in self.waiting.drain(..) {
            c.fail(e.clone());
        }
        n
    }

    /// Number of pending submissions.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.waiting.len()
    }
}

/// The reactor's in-flight count and sleep flag, in one atomic word (see
/// the module docs): every access is a read-modify-write of the same
/// location, so the submitter's increment and the reactor's "going to
/// sleep" are totally ordered and one of them always sees the other.
#[derive(Debug)]
pub(crate) struct IdleGate {
    state: AtomicUsize,
}

const SLEEPING: usize = 1 << (usize::BITS - 1);

impl IdleGate {
    pub(crate) fn new() -> Self {
        IdleGate {
            state: AtomicUsize::new(0),
        }
    }

    /// Submitter: one more in flight. Returns whether the reactor may be
    /// asleep (the caller then unparks it).
    pub(crate) fn add(&self) -> bool {
        self.state.fetch_add(1, Ordering::AcqRel) & SLEEPING != 0
    }

    /// Reactor: `n` finished.
    pub(crate) fn finished(&self, n: usize) {
        self.state.fetch_sub(n, Ordering::AcqRel);
    }

    /// Reactor: whether anything is in flight.
    pub(crate) fn busy(&self) -> bool {
        self.state.load(Ordering::Acquire) & !SLEEPING != 0
    }

    /// Reactor: announces it goes to sleep until the next submission;
    /// returns `false` (and announces nothing) if work is in flight. Call
    /// [`IdleGate::awake`] after parking.
    pub(crate) fn prepare_sleep(&self) -> bool {
        self.state
            .compare_exchange(0, SLEEPING, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Reactor: announces a short nap while work is in flight, so that a new
    /// submission cuts it short. Call [`IdleGate::awake`] after it.
    pub(crate) fn prepare_nap(&self) {
        self.state.fetch_or(SLEEPING, Ordering::AcqRel);
    }

    /// Reactor: no longer asleep.
    pub(crate) fn awake(&self) {
        self.state.fetch_and(!SLEEPING, Ordering::AcqRel);
    }
}

#[cfg(all(test, not(cuda_async_loom)))]
mod tests {
    //! Pure Rust: also run under miri (`scripts/miri`).
    use super::*;
    use crate::completion::Status;

    #[test]
    fn completes_in_order_up_to_the_word() {
        let mut q = SeqQueue::default();
        let cs: Vec<Arc<Completion>> = (0..5).map(|_| Arc::new(Completion::new())).collect();
        for c in &cs {
            let s = q.next_seq();
            q.push(s, c.clone());
        }
        assert_eq!(q.complete_upto(0), 0);
        assert_eq!(q.complete_upto(2), 2);
        assert_eq!(
            cs.iter()
                .map(|c| c.status() == Status::Done)
                .collect::<Vec<_>>(),
            [true, true, false, false, false]
        );
        // A word that jumps ahead completes everything up to it, once.
        assert_eq!(q.complete_upto(9), 3);
        assert_eq!(q.complete_upto(9), 0);
        assert_eq!(q.len(), 0);
        assert_eq!(q.next_seq(), 6);
    }

    #[test]
    fn fail_all_fails_only_pending_ones() {
        let mut q = SeqQueue::default();
        let a = Arc::new(Completion::new());
        let b = Arc::new(Completion::new());
        q.push(1, a.clone());
        q.push(2, b.clone());
        q.complete_upto(1);
        assert_eq!(q.fail_all(&Error::InvalidArgument("fault".into())), 1);
        assert_eq!(a.status(), Status::Done);
        assert_eq!(b.status(), Status::Failed);
    }

    #[test]
    fn the_gate_reports_a_sleeping_reactor() {
        let g = IdleGate::new();
        assert!(!g.busy());
        assert!(g.prepare_sleep());
        assert!(g.add(), "a submitter must see the sleep flag");
        g.awake();
        assert!(g.busy());
        assert!(!g.prepare_sleep(), "work arrived: do not park");
        g.prepare_nap();
        assert!(g.add(), "a nap is cut short by a submission");
        g.awake();
        assert!(!g.add());
        g.finished(3);
        assert!(!g.busy());
    }
}
