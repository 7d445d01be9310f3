//! loom models of the completion handoffs: the host callback (or the
//! reactor) sets the flag and wakes while the future registers its waker
//! and re-checks; and the reactor's sleep handoff with submitters. No
//! interleaving may lose a wake-up.
//!
//! `RUSTFLAGS="--cfg cuda_async_loom" cargo test -p cuda-async --test loom_completion --release`
#![cfg(cuda_async_loom)]

#[path = "../src/completion.rs"]
#[allow(dead_code, unreachable_pub)]
mod completion;
#[path = "../src/handoff.rs"]
#[allow(dead_code, unreachable_pub)]
mod handoff;
#[path = "../src/sync.rs"]
#[allow(dead_code, unreachable_pub)]
mod sync;
#[path = "../src/waker.rs"]
#[allow(dead_code, unreachable_pub)]
mod waker;

use std::sync::atomic::{AtomicUsize as StdAtomicUsize, Ordering as StdOrdering};
use std::task::{Wake, Waker};

use completion::{Completion, Status};
use loom::sync::Arc;

struct CountingWaker(StdAtomicUsize);
impl Wake for CountingWaker {
    fn wake(self: std::sync::Arc<Self>) {
        self.0.fetch_add(1, StdOrdering::SeqCst);
    }
}

#[test]
fn callback_and_poll_never_lose_the_wakeup() {
    loom::model(|| {
        let c = Arc::new(Completion::new());
        let count = std::sync::Arc::new(CountingWaker(StdAtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let producer = {
            let c = c.clone();
            loom::thread::spawn(move || c.complete())
        };
        let first = c.poll_status(&waker);
        producer.join().unwrap();
        if first == Status::Pending {
            // The future went to sleep: the producer must have woken it.
            assert_eq!(count.0.load(StdOrdering::SeqCst), 1, "lost wake-up");
        }
        assert_eq!(c.status(), Status::Done);
    });
}

#[test]
fn re_registering_a_new_waker_while_completing_wakes_one_of_them() {
    loom::model(|| {
        let c = Arc::new(Completion::new());
        let a = std::sync::Arc::new(CountingWaker(StdAtomicUsize::new(0)));
        let b = std::sync::Arc::new(CountingWaker(StdAtomicUsize::new(0)));
        let (wa, wb) = (Waker::from(a.clone()), Waker::from(b.clone()));
        assert_eq!(c.poll_status(&wa), Status::Pending);
        let producer = {
            let c = c.clone();
            loom::thread::spawn(move || c.complete())
        };
        // The task moved to another executor thread: a new waker.
        let second = c.poll_status(&wb);
        producer.join().unwrap();
        if second == Status::Pending {
            assert_eq!(
                b.0.load(StdOrdering::SeqCst),
                1,
                "the latest waker was not woken"
            );
        }
        assert!(
            a.0.load(StdOrdering::SeqCst) + b.0.load(StdOrdering::SeqCst) <= 1
                || second != Status::Pending
        );
    });
}

/// A transport's early wake-up (`nudge`, as a reply begins to arrive)
/// races the completion and the consumer's re-poll after it: the consumer
/// finds the submission done, or is woken once more after it re-registers.
#[test]
fn a_nudge_racing_the_completion_never_loses_the_final_wakeup() {
    loom::model(|| {
        let c = Arc::new(Completion::new());
        let count = std::sync::Arc::new(CountingWaker(StdAtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        assert_eq!(c.poll_status(&waker), Status::Pending);
        let producer = {
            let c = c.clone();
            loom::thread::spawn(move || {
                c.nudge();
                c.complete();
            })
        };
        // The consumer polls again whenever it has been woken.
        let mut seen = 0;
        loop {
            let woken = count.0.load(StdOrdering::SeqCst);
            if woken == seen {
                loom::thread::yield_now();
                continue;
            }
            seen = woken;
            if c.poll_status(&waker) == Status::Done {
                break;
            }
        }
        producer.join().unwrap();
        assert_eq!(c.status(), Status::Done);
    });
}

#[test]
fn failure_from_the_watchdog_races_the_callback_and_one_outcome_wins() {
    loom::model(|| {
        let c = Arc::new(Completion::new());
        let count = std::sync::Arc::new(CountingWaker(StdAtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        assert_eq!(c.poll_status(&waker), Status::Pending);
        let p1 = {
            let c = c.clone();
            loom::thread::spawn(move || c.complete())
        };
        let p2 = {
            let c = c.clone();
            loom::thread::spawn(move || c.fail(cuda_core::Error::InvalidArgument("x".into())))
        };
        p1.join().unwrap();
        p2.join().unwrap();
        assert_ne!(c.status(), Status::Pending);
        assert_eq!(
            count.0.load(StdOrdering::SeqCst),
            1,
            "exactly one wake for one outcome"
        );
    });
}

/// The reactor parks only when nothing is in flight, and a submission that
/// races with it going to sleep always wakes it: the reactor ends up having
/// seen the work (a lost wake-up would leave it parked forever, which loom
/// reports as a deadlock).
#[test]
fn the_reactor_never_sleeps_through_a_submission() {
    loom::model(|| {
        let gate = Arc::new(handoff::IdleGate::new());
        let g = gate.clone();
        let reactor = loom::thread::spawn(move || {
            let mut seen = 0;
            while seen == 0 {
                if !g.busy() {
                    if g.prepare_sleep() {
                        loom::thread::park();
                    }
                    g.awake();
                    continue;
                }
                g.finished(1);
                seen += 1;
            }
        });
        if gate.add() {
            reactor.thread().unpark();
        }
        reactor.join().unwrap();
        assert!(!gate.busy());
    });
}

/// The reactor completing a stream's queue up to the word races with a new
/// submission being queued: every completion is completed exactly once, and
/// only once its number is reached.
#[test]
fn queue_drain_and_push_race_without_losing_completions() {
    loom::model(|| {
        let q = Arc::new(loom::sync::Mutex::new(handoff::SeqQueue::default()));
        let a = Arc::new(Completion::new());
        let b = Arc::new(Completion::new());
        {
            let mut g = q.lock().unwrap();
            let s = g.next_seq();
            g.push(s, a.clone());
        }
        let q2 = q.clone();
        let b2 = b.clone();
        let submitter = loom::thread::spawn(move || {
            let mut g = q2.lock().unwrap();
            let s = g.next_seq();
            g.push(s, b2);
        });
        // The word says 1: only `a` may complete.
        let n = q.lock().unwrap().complete_upto(1);
        submitter.join().unwrap();
        assert_eq!(n, 1);
        assert_eq!(a.status(), Status::Done);
        assert_eq!(b.status(), Status::Pending);
        assert_eq!(q.lock().unwrap().complete_upto(2), 1);
        assert_eq!(b.status(), Status::Done);
    });
}
