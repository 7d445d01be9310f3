//! Blocking and detached execution.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use cuda_core::cudarc::driver::CudaStream;
use cuda_core::{Error, Result};

use crate::completion::watchdog;
use crate::context::{ExecutionContext, Retained};
use crate::op::DeviceOp;

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
) -> Result<O::Output> {
    // SAFETY: forwarded to our caller.
    match catch_unwind(AssertUnwindSafe(|| unsafe { op.execute(ctx) })) {
        Ok(r) => r,
        Err(panic) => {
            let retained = ctx.take_retained();
            release_after(ctx.stream(), retained);
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

pub(crate) fn run_blocking<O: DeviceOp>(op: O, mut ctx: ExecutionContext) -> Result<O::Output> {
    check_poison()?;
    // SAFETY: we synchronize the stream below before returning the output or
    // dropping the retained values, on success and on error alike.
    let out = unsafe { execute_guarded(op, &mut ctx) };
    let retained = ctx.take_retained();
    let synced = ctx
        .stream()
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
) -> Result<O::Output> {
    check_poison()?;
    // SAFETY: retained values are released only after the stream passes the
    // work (below); output access is the caller's contract.
    let out = unsafe { execute_guarded(op, &mut ctx) };
    let retained = ctx.take_retained();
    release_after(ctx.stream(), retained);
    out.map_err(note)
}

/// Drops `retained` on the reclaimer thread once `stream` has passed the
/// work enqueued so far; never blocks the caller.
pub(crate) fn release_after(stream: &CudaStream, retained: Retained) {
    if retained.is_empty() {
        return;
    }
    // On error the values are leaked: nothing can tell when the GPU is done.
    let _ = cuda_core::reclaim::release_after(stream, retained);
}
