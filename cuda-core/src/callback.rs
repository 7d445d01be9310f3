//! Host callbacks on a stream, over `cuLaunchHostFunc`.
//!
//! The driver runs every host function of a context on one internal thread,
//! in series, and forbids CUDA calls inside them. So a callback here owns a
//! `Send + 'static` payload, must only set state and wake, and its panics are
//! caught before they can unwind into the driver.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};

use cudarc::driver::{sys, CudaStream};

use crate::error::{DriverResultExt, Result};

/// Enqueues `f` to run on the driver's callback thread once all work
/// enqueued on `stream` before it has completed.
///
/// `f` must not call into CUDA (the driver forbids it and may deadlock).
/// A panic in `f` is caught and discarded (it would otherwise unwind into
/// the driver, which is undefined behaviour).
///
/// If a sticky error hits the context before `f` runs, the driver never runs
/// it: `f` (and what it owns) is then leaked, never dropped. Code that waits
/// on `f` needs another way to notice such errors (`cuda-async` polls the
/// stream from a watchdog).
///
/// # Errors
/// A driver error if `cuLaunchHostFunc` fails; `f` is then dropped here.
///
/// # Examples
///
/// ```no_run
/// use std::sync::{Arc, atomic::{AtomicBool, Ordering}};
/// let dev = cuda_core::Device::new(0)?;
/// let stream = dev.new_stream()?;
/// let done = Arc::new(AtomicBool::new(false));
/// let flag = done.clone();
/// cuda_core::launch_host_callback(&stream, move || flag.store(true, Ordering::Release))?;
/// stream.synchronize().unwrap();
/// assert!(done.load(Ordering::Acquire));
/// # Ok::<(), cuda_core::Error>(())
/// ```
pub fn launch_host_callback<F>(stream: &CudaStream, f: F) -> Result<()>
where
    F: FnOnce() + Send + 'static,
{
    crate::device::require_driver()?;
    stream.context().bind_to_thread().call("cuCtxSetCurrent")?;
    let payload = Box::into_raw(Box::new(f)) as *mut c_void;
    // SAFETY: `trampoline::<F>` matches `CUhostFn` (`extern "C" fn(*mut c_void)`),
    // and `payload` is a leaked `Box<F>` that only the trampoline reclaims,
    // exactly once, since the driver calls a host function at most once.
    // `F: Send` because it runs on the driver's thread; `'static` because
    // nothing bounds when that happens.
    let rc = unsafe { sys::cuLaunchHostFunc(stream.cu_stream(), Some(trampoline::<F>), payload) };
    if let Err(e) = rc.result() {
        // SAFETY: the launch failed, so the driver holds no copy of `payload`;
        // we are its only owner and reclaim the box exactly once.
        drop(unsafe { Box::from_raw(payload as *mut F) });
        return Err(e).call("cuLaunchHostFunc");
    }
    Ok(())
}

unsafe extern "C" fn trampoline<F: FnOnce() + Send + 'static>(data: *mut c_void) {
    // SAFETY: `data` is the `Box<F>` leaked in `launch_host_callback`, handed
    // to us once by the driver.
    let f = unsafe { Box::from_raw(data as *mut F) };
    // Never unwind into the driver; the payload is dropped inside the guard too.
    let _ = catch_unwind(AssertUnwindSafe(f));
}

/// Enqueues `f` to run on the driver's callback thread each time `stream`
/// reaches this point: once, or inside a CUDA graph capture at every
/// replay of the graph (a host node). `f` is borrowed, not owned: the
/// driver calls it through the pointer.
///
/// A panic in `f` is caught and discarded, as in
/// [`launch_host_callback`]; `f` must not call into CUDA.
///
/// # Errors
/// A driver error if `cuLaunchHostFunc` fails.
///
/// # Safety
/// `f` stays alive (not moved, not dropped) until every call the driver
/// makes has returned: until the stream has passed this point, and for a
/// capture until the last replay of every graph made from it has ended.
pub unsafe fn launch_host_fn_borrowed<F>(stream: &CudaStream, f: *const F) -> Result<()>
where
    F: Fn() + Send + Sync + 'static,
{
    crate::device::require_driver()?;
    stream.context().bind_to_thread().call("cuCtxSetCurrent")?;
    // SAFETY: `borrowed_trampoline::<F>` matches `CUhostFn`; the caller
    // keeps `*f` alive for every call (the function's contract), and
    // `F: Sync` lets the driver's thread call it through a shared pointer.
    unsafe {
        sys::cuLaunchHostFunc(
            stream.cu_stream(),
            Some(borrowed_trampoline::<F>),
            f as *mut c_void,
        )
    }
    .result()
    .call("cuLaunchHostFunc")
}

unsafe extern "C" fn borrowed_trampoline<F: Fn() + Send + Sync + 'static>(data: *mut c_void) {
    // SAFETY: `data` is the `*const F` given to `launch_host_fn_borrowed`,
    // alive for this call (its caller's contract).
    let f = unsafe { &*(data as *const F) };
    // Never unwind into the driver.
    let _ = catch_unwind(AssertUnwindSafe(f));
}
