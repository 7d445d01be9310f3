//! The reclaimer: one background thread that releases resources whose GPU
//! work may still be running, so that no caller (an async executor's
//! thread, above all) ever blocks on the GPU in a destructor.
//!
//! A job comes with a readiness check (an event query, a completion flag).
//! The thread polls pending jobs without blocking, with a back-off from
//! 50 us to 5 ms while any are pending, and sleeps on its queue when none
//! are; so one job waiting on a slow stream never holds up the others. A job
//! whose GPU work can never complete (a fault) is leaked, never run: leaking
//! is always safe, freeing early never is.

use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use cudarc::driver::CudaStream;

use crate::error::Result;
use crate::raw::RawEvent;

/// Whether the GPU work a deferred job waits for is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// Done: release now.
    Ready,
    /// Still running: ask again later.
    Pending,
    /// It will never complete normally (the GPU faulted): leak.
    Failed,
}

struct Job {
    check: Box<dyn FnMut() -> Readiness + Send>,
    release: Box<dyn FnOnce() + Send>,
}

const MIN_BACKOFF: Duration = Duration::from_micros(50);
const MAX_BACKOFF: Duration = Duration::from_millis(5);

fn sender() -> &'static Mutex<Sender<Job>> {
    static TX: OnceLock<Mutex<Sender<Job>>> = OnceLock::new();
    TX.get_or_init(|| {
        let (tx, rx) = channel::<Job>();
        std::thread::Builder::new()
            .name("cuda-reclaim".into())
            .spawn(move || {
                let mut pending: Vec<Job> = Vec::new();
                let mut backoff = MIN_BACKOFF;
                loop {
                    // Take new jobs: wait for one if nothing is pending,
                    // else at most one back-off period.
                    let first = if pending.is_empty() {
                        match rx.recv() {
                            Ok(j) => Some(j),
                            Err(_) => return,
                        }
                    } else {
                        match rx.recv_timeout(backoff) {
                            Ok(j) => Some(j),
                            Err(RecvTimeoutError::Timeout) => None,
                            Err(RecvTimeoutError::Disconnected) => return,
                        }
                    };
                    pending.extend(first);
                    pending.extend(rx.try_iter());
                    let before = pending.len();
                    let mut i = 0;
                    while i < pending.len() {
                        // A panicking check or release must not take the
                        // reclaimer down; such a job is dropped (leaked).
                        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            (pending[i].check)()
                        }))
                        .unwrap_or(Readiness::Failed);
                        match r {
                            Readiness::Pending => i += 1,
                            Readiness::Ready => {
                                let job = pending.swap_remove(i);
                                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(
                                    job.release,
                                ));
                            }
                            Readiness::Failed => std::mem::forget(pending.swap_remove(i)),
                        }
                    }
                    backoff = if pending.len() < before {
                        MIN_BACKOFF
                    } else {
                        (backoff * 2).min(MAX_BACKOFF)
                    };
                }
            })
            .expect("failed to spawn the cuda-reclaim thread");
        Mutex::new(tx)
    })
}

/// Runs `release` on the reclaimer thread once `check` says the GPU work
/// it waits for is done; leaks it if `check` says that work failed.
/// Never blocks the caller.
pub fn defer_until(
    check: impl FnMut() -> Readiness + Send + 'static,
    release: impl FnOnce() + Send + 'static,
) {
    let job = Job {
        check: Box::new(check),
        release: Box::new(release),
    };
    let tx = sender().lock().unwrap_or_else(|e| e.into_inner());
    if let Err(e) = tx.send(job) {
        // The reclaimer is gone: leak rather than release early.
        std::mem::forget(e.0);
    }
}

/// Drops `value` on the reclaimer thread once `stream` has passed the work
/// enqueued on it so far (an event recorded now); never blocks the caller.
///
/// # Errors
/// A driver error if the event cannot be created or recorded; `value` is
/// then leaked (never dropped), since nothing can tell when the GPU is done
/// with it.
pub fn release_after(stream: &CudaStream, value: impl Send + 'static) -> Result<()> {
    // Work captured into a graph runs at each replay: what it uses lives as
    // long as the graph.
    let value = match crate::tracking::keep_with_graph(stream, value) {
        Ok(()) => return Ok(()),
        Err(v) => v,
    };
    match RawEvent::new(stream.context()).and_then(|ev| ev.record(stream).map(|()| ev)) {
        Ok(ev) => {
            defer_until(move || ev.readiness(), move || drop(value));
            Ok(())
        }
        Err(e) => {
            std::mem::forget(value);
            Err(e)
        }
    }
}

/// Runs `release` on the reclaimer thread as soon as possible (for frees
/// that may block, such as `cuMemFreeHost`, but wait for no GPU work).
pub fn defer(release: impl FnOnce() + Send + 'static) {
    defer_until(|| Readiness::Ready, release);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[test]
    fn ready_jobs_run() {
        let (tx, rx) = std::sync::mpsc::channel();
        for i in 0..100 {
            let tx = tx.clone();
            defer(move || tx.send(i).unwrap());
        }
        let mut got: Vec<i32> = (0..100).map(|_| rx.recv().unwrap()).collect();
        got.sort();
        assert_eq!(got, (0..100).collect::<Vec<_>>());
    }

    #[test]
    fn a_pending_job_does_not_hold_up_later_ones() {
        let gate = Arc::new(AtomicBool::new(false));
        let g = gate.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let tx1 = tx.clone();
        defer_until(
            move || {
                if g.load(Ordering::SeqCst) {
                    Readiness::Ready
                } else {
                    Readiness::Pending
                }
            },
            move || tx1.send("slow").unwrap(),
        );
        defer(move || tx.send("fast").unwrap());
        assert_eq!(rx.recv().unwrap(), "fast");
        gate.store(true, Ordering::SeqCst);
        assert_eq!(rx.recv().unwrap(), "slow");
    }

    #[test]
    fn failed_jobs_are_leaked_not_run() {
        let ran = Arc::new(AtomicBool::new(false));
        let r = ran.clone();
        defer_until(
            || Readiness::Failed,
            move || r.store(true, Ordering::SeqCst),
        );
        let (tx, rx) = std::sync::mpsc::channel();
        defer(move || tx.send(()).unwrap());
        rx.recv().unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert!(!ran.load(Ordering::SeqCst));
    }

    #[test]
    fn a_panicking_job_does_not_stop_the_thread() {
        defer(|| panic!("boom"));
        let (tx, rx) = std::sync::mpsc::channel();
        defer(move || tx.send(7).unwrap());
        assert_eq!(rx.recv().unwrap(), 7);
    }
}
