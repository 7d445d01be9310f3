//! The reclaimer: one background thread that releases resources whose GPU
//! work may still be running, so that no caller (an async executor's
//! thread, above all) ever blocks on the GPU in a destructor.
//!
//! A job may block (it waits for the GPU before freeing); jobs run in the
//! order they were deferred.

use std::sync::mpsc::{channel, Sender};
use std::sync::{Mutex, OnceLock};

type Job = Box<dyn FnOnce() + Send + 'static>;

fn sender() -> &'static Mutex<Sender<Job>> {
    static TX: OnceLock<Mutex<Sender<Job>>> = OnceLock::new();
    TX.get_or_init(|| {
        let (tx, rx) = channel::<Job>();
        std::thread::Builder::new()
            .name("cuda-reclaim".into())
            .spawn(move || {
                for job in rx {
                    // A panicking job must not take the reclaimer down.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                }
            })
            .expect("failed to spawn the cuda-reclaim thread");
        Mutex::new(tx)
    })
}

/// Runs `job` on the reclaimer thread. `job` may block until the GPU is done
/// with what it releases; it must not wait on anything that needs the caller.
///
/// If the reclaimer thread cannot be reached, the job is leaked (never run):
/// leaking is always safe, freeing early never is.
pub fn defer(job: impl FnOnce() + Send + 'static) {
    let tx = sender().lock().unwrap_or_else(|e| e.into_inner());
    if let Err(e) = tx.send(Box::new(job)) {
        std::mem::forget(e.0);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn jobs_run_in_order() {
        let (tx, rx) = std::sync::mpsc::channel();
        for i in 0..100 {
            let tx = tx.clone();
            super::defer(move || tx.send(i).unwrap());
        }
        let got: Vec<i32> = (0..100).map(|_| rx.recv().unwrap()).collect();
        assert_eq!(got, (0..100).collect::<Vec<_>>());
    }

    #[test]
    fn a_panicking_job_does_not_stop_the_thread() {
        super::defer(|| panic!("boom"));
        let (tx, rx) = std::sync::mpsc::channel();
        super::defer(move || tx.send(7).unwrap());
        assert_eq!(rx.recv().unwrap(), 7);
    }
}
