//! The per-thread capture log of a [`TrackedGraph`](crate::TrackedGraph)
//! capture: the streams it captures, where its allocations go, the buffers
//! it uses and what must live as long as the graph.

use std::any::Any;
use std::cell::RefCell;
use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::UseRecord;
use crate::error::{Error, Result};
use crate::raw::set_current;

/// What a [`TrackedGraph`](crate::TrackedGraph) capture collects on its thread: the streams of
/// the capture, where allocations go, the buffers used and what must live
/// as long as the graph.
pub(crate) struct CaptureLog {
    streams: Vec<usize>,
    alloc: Arc<CudaStream>,
    pub(crate) uses: Vec<(Arc<UseRecord>, bool)>,
    pub(crate) keep: Vec<Box<dyn Any + Send>>,
}

thread_local! {
    static LOG: RefCell<Option<CaptureLog>> = const { RefCell::new(None) };
}

fn with_log<R>(stream: &CudaStream, f: impl FnOnce(&mut CaptureLog) -> R) -> Option<R> {
    LOG.try_with(|l| {
        let mut l = l.borrow_mut();
        match l.as_mut() {
            Some(log) if log.streams.contains(&(stream.cu_stream() as usize)) => Some(f(log)),
            _ => None,
        }
    })
    .ok()
    .flatten()
}

/// Whether `stream` is capturing for a [`TrackedGraph`](crate::TrackedGraph) on this thread:
/// buffer uses on it are logged for the graph instead of being ordered and
/// recorded with events (events recorded in a capture cannot be waited for
/// outside it, and waits on events from outside break the capture).
pub(crate) fn is_capture_stream(stream: &CudaStream) -> bool {
    with_log(stream, |_| ()).is_some()
}

/// Where an allocation requested on `stream` goes: during a tracked
/// capture, a stream outside it (so the graph holds no memory nodes);
/// `None` otherwise.
pub(crate) fn alloc_stream_for(stream: &CudaStream) -> Option<Arc<CudaStream>> {
    with_log(stream, |l| l.alloc.clone())
}

/// Runs `f` where allocations are allowed: inline, or, while this thread
/// captures a [`TrackedGraph`](crate::TrackedGraph), on a helper thread (the driver refuses
/// `cuMemAllocAsync` and `cuMemHostAlloc` from a thread with a capture
/// open, even on a stream outside it; measured on an H100, driver 580).
pub(crate) fn outside_capture<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let capturing = LOG.try_with(|l| l.borrow().is_some()).unwrap_or(false);
    if !capturing {
        return f();
    }
    std::thread::scope(|s| match s.spawn(f).join() {
        Ok(r) => r,
        Err(panic) => std::panic::resume_unwind(panic),
    })
}

/// Logs a captured use of a buffer (once per buffer; a write wins).
pub(crate) fn log_use(record: &Arc<UseRecord>, write: bool) {
    let _ = LOG.try_with(|l| {
        if let Some(log) = l.borrow_mut().as_mut() {
            match log.uses.iter_mut().find(|(r, _)| Arc::ptr_eq(r, record)) {
                Some((_, w)) => *w |= write,
                None => log.uses.push((record.clone(), write)),
            }
        }
    });
}

/// Keeps `value` as long as the graph being captured on `stream` (for
/// memory its nodes read, such as a staging block); gives it back when
/// `stream` is not capturing for a [`TrackedGraph`](crate::TrackedGraph).
pub(crate) fn keep_with_graph<V: Send + 'static>(
    stream: &CudaStream,
    value: V,
) -> std::result::Result<(), V> {
    let mut value = Some(value);
    let kept = with_log(stream, |l| {
        if let Some(v) = value.take() {
            l.keep.push(Box::new(v));
        }
    });
    match (kept, value) {
        (Some(()), _) | (None, None) => Ok(()),
        (None, Some(v)) => Err(v),
    }
}

/// While `stream` captures for a [`TrackedGraph`](crate::TrackedGraph)
/// on this thread: `Some` with what `find` gives for the values the graph
/// keeps; `None` otherwise.
#[cfg(any(feature = "blas", feature = "rand", feature = "fft"))]
pub(crate) fn search_kept<R>(
    stream: &CudaStream,
    find: impl FnOnce(&[Box<dyn Any + Send>]) -> R,
) -> Option<R> {
    with_log(stream, |l| find(&l.keep))
}

/// Removes the log when the capture ends, however it ends.
struct LogGuard;

impl LogGuard {
    fn install(log: CaptureLog) -> Result<LogGuard> {
        LOG.with(|l| {
            let mut l = l.borrow_mut();
            if l.is_some() {
                return Err(Error::Capture(
                    "this thread is already capturing a graph (captures do not nest)".into(),
                ));
            }
            *l = Some(log);
            Ok(LogGuard)
        })
    }

    fn take(self) -> Option<CaptureLog> {
        LOG.with(|l| l.borrow_mut().take())
    }
}

impl Drop for LogGuard {
    fn drop(&mut self) {
        let _ = LOG.try_with(|l| l.borrow_mut().take());
    }
}

/// Runs `capture` (which captures on `stream`, forking onto `side`) with
/// this thread's capture log installed: buffer uses on those streams are
/// logged, allocations go to `alloc` (synchronized after, so they are
/// complete before any replay). On error the log is dropped: nothing
/// captured ran, so nothing it kept is in use.
pub(crate) fn with_capture_log<R>(
    stream: &CudaStream,
    side: &[Arc<CudaStream>],
    alloc: &Arc<CudaStream>,
    capture: impl FnOnce() -> Result<R>,
) -> Result<(R, CaptureLog)> {
    let mut streams: Vec<usize> = vec![stream.cu_stream() as usize];
    streams.extend(side.iter().map(|s| s.cu_stream() as usize));
    if streams.contains(&(alloc.cu_stream() as usize)) {
        return Err(Error::InvalidArgument(
            "the allocation stream of a capture must not be one of its streams".into(),
        ));
    }
    let guard = LogGuard::install(CaptureLog {
        streams,
        alloc: alloc.clone(),
        uses: Vec::new(),
        keep: Vec::new(),
    })?;
    let r = capture();
    let log = guard.take();
    let r = r?;
    let log = log.ok_or_else(|| Error::Capture("the capture log was lost".into()))?;
    set_current(alloc.context())?;
    alloc
        .synchronize()
        .map_err(|e| Error::driver("cuStreamSynchronize", e))?;
    Ok((r, log))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outside_a_capture_allocations_run_inline() {
        let here = std::thread::current().id();
        assert_eq!(outside_capture(|| std::thread::current().id()), here);
    }
}
