//! Blocking and detached execution.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::task::{Wake, Waker};
use std::thread::{self, Thread};

use cuda_core::{Error, Result};

use crate::completion::{watchdog, Completion, Status};
use crate::context::{ExecutionContext, Retained};
use crate::op::DeviceOp;
use crate::remote;

/// Runs `op.execute(ctx)`. If user code inside it (a `then`/`map` closure)
/// panics, the work enqueued so far may still be running: what it retained
/// is handed to the reclaimer to be released after the stream passes it,
/// and the panic continues.
///
/// # Safety
/// As [`DeviceOp::execute`].
pub(crate) unsafe fn execute_guarded<O: DeviceOp>(
    op: O,
    ctx: &mut ExecutionContext,
) -> Result<<O as DeviceOp>::Output> {
    // Remotely, buffers dropped while recording are freed at the end of
    // this submission.
    let frame = ctx.open_frame();
    // A policy's chosen pool serves the op's allocations on its device.
    let pool = ctx.mem_pool().cloned();
    // SAFETY: forwarded to our caller.
    let run = || catch_unwind(AssertUnwindSafe(|| unsafe { op.execute(ctx) }));
    let result = match pool {
        Some(pool) => pool.allocate_in(run),
        None => run(),
    };
    // The ops' use marks: recorded once the whole op is enqueued.
    let flushed = ctx.flush_marks();
    ctx.close_frame(frame);
    match result {
        Ok(r) => {
            let r = r?;
            flushed?;
            Ok(r)
        }
        Err(panic) => {
            // What was recorded before the panic is sent as enqueued work is
            // left enqueued locally: the ids it names stay consistent.
            let _ = remote::send(ctx);
            let retained = ctx.take_retained();
            release_after(ctx, retained);
            resume_unwind(panic)
        }
    }
}

/// Fails fast once the process's CUDA state is poisoned.
pub(crate) fn check_poison() -> Result<()> {
    match watchdog::poisoned() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Records sticky errors so every later op fails fast.
pub(crate) fn note(e: Error) -> Error {
    watchdog::note_error(&e);
    e
}

/// Whether a blocking execution synchronizes its stream when no op
/// enqueued anything on it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum IdleSync {
    /// Return at once: nothing of this execution is on the stream (a pool's
    /// stream; `sync`, `sync_with`).
    Skip,
    /// Synchronize anyway: the caller's stream, whose documented contract is
    /// "done when this returns" (`sync_on`).
    Always,
}

/// Runs `op` on `ctx` and blocks until its work is done, or at most
/// `timeout`: after it, [`Error::Timeout`], with the values the work uses
/// released only once the stream has passed it (the output's buffers order
/// their own frees after the work).
pub(crate) fn run_blocking<O: DeviceOp>(
    op: O,
    mut ctx: ExecutionContext,
    idle: IdleSync,
    timeout: Option<std::time::Duration>,
) -> Result<<O as DeviceOp>::Output> {
    if ctx.is_remote() {
        return run_blocking_remote(op, ctx, timeout);
    }
    check_poison()?;
    // SAFETY: we synchronize the stream below before returning the output or
    // dropping the retained values, on success and on error alike; or no op
    // enqueued anything, so the GPU uses nothing of this execution; or, on
    // a timeout, the retained values go to the reclaimer, released after
    // the stream passes the work, and the output's buffers wait for it.
    let out = unsafe { execute_guarded(op, &mut ctx) };
    let retained = ctx.take_retained();
    if idle == IdleSync::Skip && !ctx.touched() {
        // Buffers in the output order their own uses after earlier work.
        drop(retained);
        return out.map_err(note);
    }
    let stream = ctx.stream().expect("a local context").clone();
    if let Some(timeout) = timeout {
        let (tx, rx) = std::sync::mpsc::sync_channel::<()>(1);
        let signalled = cuda_core::launch_host_callback(&stream, move || {
            let _ = tx.send(());
        });
        if signalled.is_ok() {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(timeout) {
                release_after(&ctx, retained);
                drop(out);
                return Err(Error::Timeout { waited: timeout });
            }
        }
        // Passed (or the signal could not be sent): the synchronize below
        // returns at once, with the stream's error if the work failed.
    }
    let synced = stream
        .synchronize()
        .map_err(|e| note(Error::driver("cuStreamSynchronize", e)));
    match synced {
        Ok(()) => {
            drop(retained);
            out.map_err(note)
        }
        Err(e) => {
            // The GPU may never finish what it was doing: keep, never free.
            std::mem::forget(retained);
            drop(out);
            Err(e)
        }
    }
}

/// # Safety
/// See `DeviceOpExt::async_on`.
pub(crate) unsafe fn run_detached<O: DeviceOp>(
    op: O,
    mut ctx: ExecutionContext,
) -> Result<<O as DeviceOp>::Output> {
    check_poison()?;
    // SAFETY: retained values are released only after the stream passes the
    // work (below); output access is the caller's contract.
    let out = unsafe { execute_guarded(op, &mut ctx) };
    let retained = ctx.take_retained();
    release_after(&ctx, retained);
    out.map_err(note)
}

/// Records `op` on a remote context, sends it as one message and blocks the
/// calling thread until the reply (no async runtime needed: the session
/// does its own I/O), or at most `timeout`: after it, [`Error::Timeout`]
/// (the submission stays sent; its reply is dropped when it comes).
fn run_blocking_remote<O: DeviceOp>(
    op: O,
    mut ctx: ExecutionContext,
    timeout: Option<std::time::Duration>,
) -> Result<<O as DeviceOp>::Output> {
    // SAFETY: remotely, retained values are kept until the reply below; the
    // output's host data is reachable only once its reply has arrived
    // (which a timeout forgoes).
    let out = unsafe { execute_guarded(op, &mut ctx) };
    // Sent even after an error: what was recorded before it names ids that
    // later frees refer to.
    let done = remote::send(&mut ctx);
    let retained = ctx.take_retained();
    let out = out?;
    if let Some((done, on_reply)) = done {
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        if !wait_blocking_until(done.completion(), deadline)? {
            return Err(Error::Timeout {
                waited: timeout.unwrap_or_default(),
            });
        }
        on_reply.run();
    }
    drop(retained);
    Ok(out)
}

/// Parks the calling thread until `c` finishes or `deadline` passes:
/// whether it finished.
fn wait_blocking_until(c: &Arc<Completion>, deadline: Option<std::time::Instant>) -> Result<bool> {
    struct Unpark(Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(thread::current())));
    loop {
        c.spin_if_nudged(crate::completion::NUDGE_SPIN);
        match c.poll_status(&waker) {
            Status::Done => return Ok(true),
            Status::Failed => return Err(c.error()),
            Status::Pending => match deadline {
                None => thread::park(),
                Some(d) => {
                    let now = std::time::Instant::now();
                    if now >= d {
                        return Ok(false);
                    }
                    thread::park_timeout(d - now);
                }
            },
        }
    }
}

/// Drops `retained` on the reclaimer thread once `ctx`'s stream has passed
/// the work enqueued so far; never blocks the caller. Remotely nothing of
/// the client's memory is read by the GPU: dropped now.
pub(crate) fn release_after(ctx: &ExecutionContext, retained: Retained) {
    if retained.is_empty() {
        return;
    }
    let Some(stream) = ctx.stream() else {
        drop(retained);
        return;
    };
    // On error the values are leaked: nothing can tell when the GPU is done.
    let _ = cuda_core::reclaim::release_after(stream, retained);
}
