//! Use tracking shared by buffers and graphs: a device buffer's use record
//! ([`UseRecord`]) and the per-thread capture log of a
//! [`TrackedGraph`](crate::TrackedGraph) capture.
//!
//! A leaf of the crate: [`crate::buffer`] and [`crate::graph`] both build on
//! it, and it imports neither.

use std::any::Any;
use std::cell::RefCell;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, CudaStream};

use crate::error::{Error, Result};
use crate::raw::{set_current, RawEvent};

/// A buffer's uses, shared by its handle and by every graph that captured a
/// use of it (see [`crate::graph`]). When the handle is dropped while a
/// graph still shares this, the memory moves here (as bytes) and is freed,
/// ordered after every recorded use, when the last graph lets go.
#[derive(Default)]
pub(crate) struct UseRecord {
    uses: Mutex<Uses>,
    /// The memory of a dropped handle, and its pool's handle (if a
    /// [`MemPool`](crate::MemPool) scope chose it).
    orphan: Mutex<Option<(CudaSlice<u8>, Option<crate::MemPool>)>>,
    /// For host memory the host also reaches (a
    /// [`SharedPinnedBuffer`](crate::SharedPinnedBuffer)): held by each
    /// host access and by each use enqueued on the GPU, graph replays
    /// included, so no GPU use starts while the host holds the memory.
    gate: Option<Mutex<()>>,
}

/// Bytes of a buffer a use touches; [`WHOLE`] for the whole buffer.
pub(crate) type Span = std::ops::Range<usize>;

/// Every byte of a buffer.
pub(crate) const WHOLE: Span = 0..usize::MAX;

/// Most entries of one stream in one list before they merge into one.
const PER_STREAM: usize = 8;

/// A recorded use: its stream (the handle's address, identity only), the
/// bytes it touches and the event recorded after it.
struct Entry {
    stream: usize,
    span: Span,
    ev: RawEvent,
}

fn overlaps(a: &Span, b: &Span) -> bool {
    a.start < b.end && b.start < a.end
}

fn within(a: &Span, b: &Span) -> bool {
    b.start <= a.start && a.end <= b.end
}

/// The recorded uses not yet known to be ordered before a later write that
/// covers them: reads and writes, each with the bytes it touched. A use
/// waits only for the entries that overlap it (a read for writes; a write
/// for both), so uses of disjoint parts of a buffer on two streams run at
/// once.
#[derive(Default)]
struct Uses {
    reads: Vec<Entry>,
    writes: Vec<Entry>,
    /// Set when a use could not be recorded: the buffer can no longer tell
    /// when the GPU is done with it, so it is never freed.
    broken: bool,
}

impl Uses {
    /// Records a use on `stream` (raw handle `raw`) of `span` in `list`:
    /// re-recording the stream's entry of the same span, or merging the
    /// stream's entries into one once it has [`PER_STREAM`] (an event
    /// recorded now follows all of the stream's earlier work, so the merged
    /// entry's span is their hull).
    fn push(
        list: &mut Vec<Entry>,
        stream: &CudaStream,
        raw: usize,
        span: Span,
        spare: Option<RawEvent>,
    ) -> Result<()> {
        if let Some(e) = list.iter_mut().find(|e| e.stream == raw && e.span == span) {
            return e.ev.record(stream);
        }
        let mut span = span;
        let mut ev = spare;
        if list.iter().filter(|e| e.stream == raw).count() >= PER_STREAM {
            let mut i = 0;
            while i < list.len() {
                if list[i].stream == raw {
                    let e = list.swap_remove(i);
                    span = span.start.min(e.span.start)..span.end.max(e.span.end);
                    ev = ev.or(Some(e.ev));
                } else {
                    i += 1;
                }
            }
        }
        let ev = match ev {
            Some(ev) => ev,
            None => RawEvent::new(stream.context())?,
        };
        let recorded = ev.record(stream);
        list.push(Entry {
            stream: raw,
            span,
            ev,
        });
        recorded
    }
}

impl UseRecord {
    /// The record of host memory the host also reaches: with a gate.
    pub(crate) fn with_gate() -> UseRecord {
        UseRecord {
            uses: Mutex::default(),
            orphan: Mutex::new(None),
            gate: Some(Mutex::new(())),
        }
    }

    /// Holds the gate, if the record has one.
    pub(crate) fn hold(&self) -> Option<std::sync::MutexGuard<'_, ()>> {
        self.gate
            .as_ref()
            .map(|g| g.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Whether the record has a gate.
    pub(crate) fn has_gate(&self) -> bool {
        self.gate.is_some()
    }

    /// Blocks the calling thread until the recorded uses a host access
    /// conflicts with are done: the writes for a read, every use for a
    /// write.
    pub(crate) fn wait_host(&self, write: bool) -> Result<()> {
        let u = self.lock();
        if u.broken {
            return Err(Error::InvalidArgument(
                "a GPU use of this memory could not be recorded; its contents are unavailable"
                    .into(),
            ));
        }
        let reads = if write { &u.reads[..] } else { &[] };
        for e in reads.iter().chain(&u.writes) {
            e.ev.synchronize()
                .map_err(|e| Error::driver("cuEventSynchronize", e))?;
        }
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Uses> {
        self.uses.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Orders a use of `span` on `stream` after the recorded uses it
    /// conflicts with on other streams (a read after the writes that
    /// overlap it; a write after the reads and writes that overlap it).
    pub(crate) fn before(&self, stream: &CudaStream, write: bool, span: Span) -> Result<()> {
        if is_capture_stream(stream) {
            // Inside a capture only the captured work is ordered (by its
            // streams and forks); each replay is ordered against the
            // buffer's other uses when it is launched.
            return Ok(());
        }
        let u = self.lock();
        let raw = stream.cu_stream() as usize;
        let reads = if write { &u.reads[..] } else { &[] };
        for e in reads.iter().chain(&u.writes) {
            if e.stream != raw && overlaps(&e.span, &span) {
                e.ev.wait_on(stream)
                    .map_err(|e| Error::driver("cuStreamWaitEvent", e))?;
            }
        }
        Ok(())
    }

    /// Records a use of `span` enqueued on `stream`. A write forgets the
    /// uses inside its span: it was ordered after them, so whatever
    /// overlaps them overlaps it and waits for it.
    pub(crate) fn record(&self, stream: &CudaStream, write: bool, span: Span) -> Result<()> {
        if span.is_empty() {
            return Ok(());
        }
        let mut guard = self.lock();
        let u = &mut *guard;
        let raw = stream.cu_stream() as usize;
        let r = if write {
            let mut spare = None;
            for list in [&mut u.reads, &mut u.writes] {
                let mut i = 0;
                while i < list.len() {
                    if within(&list[i].span, &span) {
                        let e = list.swap_remove(i);
                        spare = spare.or(Some(e.ev));
                    } else {
                        i += 1;
                    }
                }
            }
            Uses::push(&mut u.writes, stream, raw, span, spare)
        } else {
            Uses::push(&mut u.reads, stream, raw, span, None)
        };
        if r.is_err() {
            u.broken = true;
        }
        r
    }

    /// Takes over the memory of a buffer whose handle is dropped while a
    /// graph still shares this record; it is freed when the record is.
    pub(crate) fn adopt(&self, bytes: CudaSlice<u8>, pool: Option<crate::MemPool>) {
        *self.orphan.lock().unwrap_or_else(|e| e.into_inner()) = Some((bytes, pool));
    }

    /// Makes `home` wait for every recorded use (raw calls).
    pub(crate) fn order_home_stream(&self, home: &CudaStream) -> Result<()> {
        let u = self.lock();
        if u.broken {
            return Err(Error::InvalidArgument(
                "a use of this buffer could not be recorded; it is leaked".into(),
            ));
        }
        if u.reads.is_empty() && u.writes.is_empty() {
            return Ok(());
        }
        set_current(home.context())?;
        for e in u.reads.iter().chain(&u.writes) {
            e.ev.wait_on(home)
                .map_err(|e| Error::driver("cuStreamWaitEvent", e))?;
        }
        Ok(())
    }
}

impl Drop for UseRecord {
    fn drop(&mut self) {
        let orphan = self
            .orphan
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some((slice, pool)) = orphan {
            free_ordered(self, slice, pool);
        }
    }
}

/// Frees `slice` (cudarc's stream-ordered free, on its home stream) after
/// every use `record` holds, graph replays included; then lets go of its
/// pool's handle. Leaks both when the free cannot be ordered: leaking is
/// safe, freeing early never is.
pub(crate) fn free_ordered<T>(
    record: &UseRecord,
    slice: CudaSlice<T>,
    pool: Option<crate::MemPool>,
) {
    if record.order_home_stream(slice.stream()).is_err() {
        let _ = slice.leak();
        std::mem::forget(pool);
        return;
    }
    drop(slice);
    // After the free is enqueued: the pool, if this was its last handle,
    // is destroyed once the free has run (see `MemPool`'s drop).
    drop(pool);
}

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
