//! [`SubmitThread`]: one thread that enqueues the ops of many tasks, so
//! that the driver is called from one thread, not from every executor
//! thread at once.

use std::fmt;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, TryLockError};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;

use cuda_core::{Error, Result};

use crate::future::DeviceFuture;
use crate::op::DeviceOp;

type Job = Box<dyn FnOnce() + Send>;

/// A thread that enqueues ops for other threads: [`SubmitThread::enqueue`]
/// hands it a scheduled op ([`DeviceOpExt::schedule`](crate::DeviceOpExt::schedule)),
/// it makes the op's driver calls, and the returned future, awaited
/// anywhere, waits for the GPU as the op's own future would.
///
/// Why: the CUDA driver serializes the calls made on one context, so
/// executor threads that all enqueue at once mostly wait for each other
/// (the book's async chapter has the figures of an HTTP service). With a
/// `SubmitThread`, the executor threads parse, route and answer, and one
/// thread makes every driver call, in the order the ops reach it.
///
/// What moves to the thread is what the first poll of a
/// [`DeviceFuture`] does: choosing nothing (the policy chose the stream
/// at `schedule`), enqueuing the op's work and its completion signal.
/// Ops are enqueued one at a time, in the order handed; when the thread
/// has nothing to do, the caller enqueues its op itself at once (no hop
/// to the thread and back for a lone request).
/// Waiting, an inline spin of [`CompletionMode::ReactorInlineSpin`](crate::CompletionMode::ReactorInlineSpin)
/// included, stays with the awaiting task. Buffers an op returns are
/// dropped (and freed) wherever the caller drops them.
///
/// Dropping the `SubmitThread` lets the thread finish the ops handed to
/// it and waits for it.
///
/// # Examples
///
/// ```no_run
/// use std::sync::Arc;
/// use cuda_async::prelude::*;
/// use cuda_async::{Device, SubmitThread};
/// # async fn f() -> Result<(), cuda_async::Error> {
/// let pool = StreamPoolRoundRobin::new(&Device::new(0)?, 4)?;
/// let submit = Arc::new(SubmitThread::new()?);
/// // In each request's task: scheduled here, enqueued there, awaited here.
/// let v = submit
///     .enqueue(h2d(vec![1.0f32; 256]).then(d2h).schedule(&pool)?)
///     .await?
///     .to_vec()?;
/// assert_eq!(v.len(), 256);
/// # Ok(()) }
/// ```
pub struct SubmitThread {
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    shared: Arc<Shared>,
}

/// What the thread and the callers share: enqueuing happens under `lock`
/// (on the thread, or inline when it is idle), and `pending` counts the
/// jobs handed to the thread and not yet run.
#[derive(Default)]
struct Shared {
    lock: Mutex<()>,
    pending: AtomicUsize,
}

impl fmt::Debug for SubmitThread {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SubmitThread").finish_non_exhaustive()
    }
}

impl SubmitThread {
    /// Starts the thread (named `cuda-async-submit`).
    ///
    /// # Errors
    /// [`Error::Other`] when the thread cannot be started.
    pub fn new() -> Result<Self> {
        let (jobs, rx) = mpsc::channel::<Job>();
        let shared = Arc::new(Shared::default());
        let thread = std::thread::Builder::new()
            .name("cuda-async-submit".into())
            .spawn(move || {
                for job in rx {
                    job();
                }
            })
            .map_err(|e| Error::Other(Arc::new(e)))?;
        Ok(SubmitThread {
            jobs: Some(jobs),
            thread: Some(thread),
            shared,
        })
    }

    /// Has the thread enqueue `op`'s work; the future waits for the GPU.
    /// Ops are enqueued in the order of these calls, one at a time. When
    /// the thread is idle (nothing handed to it is waiting or running),
    /// the calling thread enqueues `op` itself, at once: a lone request
    /// pays no hop to the thread and back.
    ///
    /// Dropping the returned future does not take the op back: it is
    /// enqueued all the same, and its work runs to completion (as for a
    /// [`DeviceFuture`] dropped after its first poll).
    pub fn enqueue<O: DeviceOp + 'static>(&self, mut op: DeviceFuture<O>) -> Enqueued<O> {
        let shared = &self.shared;
        if shared.pending.load(Ordering::Acquire) == 0 {
            let guard = match shared.lock.try_lock() {
                Ok(g) => Some(g),
                Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
                Err(TryLockError::WouldBlock) => None,
            };
            // Nothing handed over before this call is still to run: going
            // first keeps the order.
            if guard.is_some() && shared.pending.load(Ordering::Acquire) == 0 {
                let r = catch_unwind(AssertUnwindSafe(|| op.enqueue()))
                    .unwrap_or_else(|_| Err(panicked()));
                drop(guard);
                let state = match r {
                    Ok(()) => Step::Running(Box::new(op)),
                    Err(e) => Step::Failed(e),
                };
                return Enqueued { state };
            }
        }
        let hand = Arc::new(Hand::default());
        let (back, shared) = (hand.clone(), self.shared.clone());
        let job: Job = Box::new(move || {
            let mut op = op;
            let guard = shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            let r = catch_unwind(AssertUnwindSafe(|| op.enqueue()))
                .unwrap_or_else(|_| Err(panicked()))
                .map(|()| op);
            shared.pending.fetch_sub(1, Ordering::AcqRel);
            drop(guard);
            back.put(r);
        });
        self.shared.pending.fetch_add(1, Ordering::AcqRel);
        let sent = self.jobs.as_ref().map(|tx| tx.send(job));
        if !matches!(sent, Some(Ok(()))) {
            self.shared.pending.fetch_sub(1, Ordering::AcqRel);
            hand.put(Err(Error::InvalidArgument(
                "the submit thread is gone: the op was not enqueued".into(),
            )));
        }
        Enqueued {
            state: Step::Handed(hand),
        }
    }
}

impl Drop for SubmitThread {
    fn drop(&mut self) {
        // The thread ends once it has run what it was handed.
        drop(self.jobs.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn panicked() -> Error {
    Error::InvalidArgument("an op panicked while the submit thread enqueued it".into())
}

/// The future of an op handed to a [`SubmitThread`].
#[must_use = "futures do nothing unless polled (the op is enqueued all the same)"]
pub struct Enqueued<O: DeviceOp> {
    state: Step<O>,
}

enum Step<O: DeviceOp> {
    /// With the thread.
    Handed(Arc<Hand<O>>),
    /// Enqueued: waiting for the GPU.
    Running(Box<DeviceFuture<O>>),
    /// Enqueuing it failed.
    Failed(Error),
    Done,
}

impl<O: DeviceOp> fmt::Debug for Enqueued<O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match &self.state {
            Step::Handed(_) => "Handed",
            Step::Running(_) => "Running",
            Step::Failed(_) => "Failed",
            Step::Done => "Done",
        };
        f.debug_struct("Enqueued").field("state", &s).finish()
    }
}

impl<O: DeviceOp> Unpin for Enqueued<O> {}

/// The enqueued future (or why it was not), once the thread has put it.
type Put<O> = Option<Result<DeviceFuture<O>>>;

/// Where the thread puts the enqueued future back, and who to wake.
struct Hand<O: DeviceOp> {
    slot: Mutex<(Put<O>, Option<Waker>)>,
}

impl<O: DeviceOp> Default for Hand<O> {
    fn default() -> Self {
        Hand {
            slot: Mutex::new((None, None)),
        }
    }
}

impl<O: DeviceOp> Hand<O> {
    fn put(&self, r: Result<DeviceFuture<O>>) {
        let waker = {
            let mut slot = self.slot.lock().unwrap_or_else(|e| e.into_inner());
            slot.0 = Some(r);
            slot.1.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    fn take(&self, waker: &Waker) -> Put<O> {
        let mut slot = self.slot.lock().unwrap_or_else(|e| e.into_inner());
        let r = slot.0.take();
        if r.is_none() {
            slot.1 = Some(waker.clone());
        }
        r
    }
}

impl<O: DeviceOp> Future for Enqueued<O> {
    type Output = Result<<O as DeviceOp>::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        loop {
            match std::mem::replace(&mut this.state, Step::Done) {
                Step::Handed(hand) => match hand.take(cx.waker()) {
                    None => {
                        this.state = Step::Handed(hand);
                        return Poll::Pending;
                    }
                    Some(Err(e)) => return Poll::Ready(Err(e)),
                    Some(Ok(f)) => this.state = Step::Running(Box::new(f)),
                },
                Step::Running(mut f) => {
                    return match Pin::new(&mut *f).poll(cx) {
                        Poll::Pending => {
                            this.state = Step::Running(f);
                            Poll::Pending
                        }
                        ready => ready,
                    }
                }
                Step::Failed(e) => return Poll::Ready(Err(e)),
                Step::Done => {
                    return Poll::Ready(Err(Error::InvalidArgument(
                        "Enqueued polled after it completed".into(),
                    )))
                }
            }
        }
    }
}
