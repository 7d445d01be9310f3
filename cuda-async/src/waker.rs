//! A waker slot for one consumer and any number of producers.
//!
//! The consumer (a future's `poll`) registers its waker and then re-checks
//! its completion flag; a producer (the host callback, the watchdog) sets the
//! flag and then calls `wake`. Whatever the interleaving, either the consumer
//! sees the flag or the producer sees the waker.
//!
//! State machine over one atomic word:
//! - `IDLE`: the slot may hold a waker; nobody is touching it.
//! - `REGISTERING`: the consumer is writing the slot.
//! - `WAKING`: a producer is taking the waker out (or wants to).
//!
//! A producer that finds `REGISTERING` only sets the `WAKING` bit; the
//! consumer notices it when it finishes writing, and wakes the waker it
//! just stored itself.

use std::fmt;
use std::task::Waker;

use crate::sync::{AtomicUsize, Ordering, UnsafeCell};

const IDLE: usize = 0;
const REGISTERING: usize = 0b01;
const WAKING: usize = 0b10;

/// See the module docs.
pub(crate) struct AtomicWaker {
    state: AtomicUsize,
    slot: UnsafeCell<Option<Waker>>,
}

// SAFETY: the slot is only read or written by the thread that moved `state`
// from IDLE to REGISTERING (the consumer) or from IDLE to WAKING (one
// producer), so accesses never overlap; `Waker` is `Send + Sync`.
unsafe impl Send for AtomicWaker {}
// SAFETY: as above: the state word serialises every access to the slot.
unsafe impl Sync for AtomicWaker {}

impl fmt::Debug for AtomicWaker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AtomicWaker")
            .field("state", &self.state.load(Ordering::Relaxed))
            .finish()
    }
}

impl AtomicWaker {
    pub(crate) fn new() -> Self {
        AtomicWaker {
            state: AtomicUsize::new(IDLE),
            slot: UnsafeCell::new(None),
        }
    }

    /// Stores `waker` (consumer side; one consumer at a time).
    pub(crate) fn register(&self, waker: &Waker) {
        match self
            .state
            .compare_exchange(IDLE, REGISTERING, Ordering::Acquire, Ordering::Acquire)
        {
            Ok(_) => {
                // SAFETY: we own the slot: state is REGISTERING by us.
                self.slot.with_mut(|slot| unsafe {
                    match &*slot {
                        Some(old) if old.will_wake(waker) => {}
                        _ => *slot = Some(waker.clone()),
                    }
                });
                // Give the slot back; a producer may have set WAKING meanwhile.
                match self.state.compare_exchange(
                    REGISTERING,
                    IDLE,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => {}
                    Err(_) => {
                        // State is REGISTERING | WAKING: a wake arrived while we
                        // wrote. Take the waker back out and wake it ourselves.
                        // SAFETY: producers never touch the slot while the
                        // REGISTERING bit is set, so we still own it.
                        let w = self.slot.with_mut(|slot| unsafe { (*slot).take() });
                        self.state.store(IDLE, Ordering::Release);
                        if let Some(w) = w {
                            w.wake();
                        }
                    }
                }
            }
            Err(WAKING) => {
                // A producer is waking the old waker right now; make sure this
                // task is polled again so it re-checks the flag.
                waker.wake_by_ref();
            }
            Err(_) => {
                // Concurrent `register` calls are a caller bug (one consumer);
                // stay correct anyway by forcing a re-poll.
                waker.wake_by_ref();
            }
        }
    }

    /// Takes the stored waker, if any, and wakes it (producer side).
    pub(crate) fn wake(&self) {
        if let Some(w) = self.take() {
            w.wake();
        }
    }

    fn take(&self) -> Option<Waker> {
        match self.state.fetch_or(WAKING, Ordering::AcqRel) {
            IDLE => {
                // SAFETY: we moved IDLE -> WAKING, so we own the slot.
                let w = self.slot.with_mut(|slot| unsafe { (*slot).take() });
                self.state.fetch_and(!WAKING, Ordering::Release);
                w
            }
            // The consumer is registering (it will see WAKING), or another
            // producer is already waking.
            _ => None,
        }
    }
}

#[cfg(all(test, not(cuda_async_loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize as StdAtomicUsize;
    use std::sync::Arc;
    use std::task::Wake;

    struct Counter(StdAtomicUsize);
    impl Wake for Counter {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn wake_without_register_is_a_no_op() {
        let w = AtomicWaker::new();
        w.wake();
    }

    #[test]
    fn register_then_wake_wakes_once() {
        let c = Arc::new(Counter(StdAtomicUsize::new(0)));
        let waker = Waker::from(c.clone());
        let w = AtomicWaker::new();
        w.register(&waker);
        w.wake();
        w.wake();
        assert_eq!(c.0.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    #[test]
    fn re_register_replaces_the_waker() {
        let a = Arc::new(Counter(StdAtomicUsize::new(0)));
        let b = Arc::new(Counter(StdAtomicUsize::new(0)));
        let w = AtomicWaker::new();
        w.register(&Waker::from(a.clone()));
        w.register(&Waker::from(b.clone()));
        w.wake();
        assert_eq!(a.0.load(std::sync::atomic::Ordering::SeqCst), 0);
        assert_eq!(b.0.load(std::sync::atomic::Ordering::SeqCst), 1);
    }
}
