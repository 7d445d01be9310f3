//! loom model of the callback-vs-poll handoff: the host callback sets the
//! flag and wakes; the future registers its waker and re-checks. No
//! interleaving may lose the wake-up.
//!
//! `RUSTFLAGS="--cfg cuda_async_loom" cargo test -p cuda-async --test loom_completion --release`
#![cfg(cuda_async_loom)]

#[path = "../src/completion.rs"]
#[allow(dead_code, unreachable_pub)]
mod completion;
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
