//! Use tracking shared by buffers and graphs: a device buffer's use record
//! ([`UseRecord`]) and the per-thread capture log of a
//! [`TrackedGraph`](crate::TrackedGraph) capture.
//!
//! A leaf of the crate: [`crate::buffer`] and [`crate::graph`] both build on
//! it, and it imports neither.

use std::cell::OnceCell;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, CudaStream};

use crate::error::{Error, Result};
use crate::raw::{set_current, tick, MarkEvent, SharedEvent};

mod capture;
#[cfg(any(feature = "blas", feature = "rand", feature = "fft"))]
pub(crate) use capture::search_kept;
pub(crate) use capture::{
    alloc_stream_for, is_capture_stream, keep_with_graph, log_use, outside_capture,
    with_capture_log,
};

/// A buffer's uses, shared by its handle and by every graph that captured a
/// use of it (see [`crate::graph`]). When the handle is dropped while a
/// graph still shares this, the memory moves here (as bytes) and is freed,
/// ordered after every recorded use, when the last graph lets go.
pub(crate) struct UseRecord {
    uses: Mutex<Uses>,
    /// What [`Uses::sole`] was after the last change of `uses`, published
    /// under its lock: a use on that stream (or on any, where there are no
    /// entries) has nothing to wait for, and [`UseRecord::before`] skips the
    /// lock. A use that conflicts with an entry was handed its buffer after
    /// that entry was recorded, so it sees the value published then.
    sole: [AtomicUsize; 2],
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

/// [`Uses::sole`] of no entries.
const NO_STREAM: usize = usize::MAX;

/// [`Uses::sole`] of entries of more than one stream.
const MANY_STREAMS: usize = usize::MAX - 1;

/// Most entries of one stream in one list before they merge into one.
const PER_STREAM: usize = 8;

/// A recorded use: its stream (the handle's address, identity only), the
/// bytes it touches, the event recorded after it (`E`: a [`SharedEvent`],
/// shared with the other uses of the same op; the tests use plain values)
/// and the [`tick`] of its stream when it was noted.
struct Entry<E> {
    stream: usize,
    span: Span,
    ev: E,
    noted: u64,
}

/// What [`Uses`] asks of an entry's event.
trait Mark: Clone {
    /// Whether waiting for the event waits for a use of its stream noted
    /// at `noted` ([`MarkEvent::follows`]).
    fn follows(&self, noted: u64) -> bool;
}

impl Mark for SharedEvent {
    fn follows(&self, noted: u64) -> bool {
        MarkEvent::follows(self, noted)
    }
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
///
/// An entry's event is shared (one per op, see [`UseMark`]) and never
/// re-recorded: a newer use replaces an entry's event instead.
struct Uses<E = SharedEvent> {
    reads: Vec<Entry<E>>,
    writes: Vec<Entry<E>>,
    /// Set when a use could not be recorded: the buffer can no longer tell
    /// when the GPU is done with it, so it is never freed.
    broken: bool,
}

impl<E> Default for Uses<E> {
    fn default() -> Self {
        Uses {
            reads: Vec::new(),
            writes: Vec::new(),
            broken: false,
        }
    }
}

impl<E: Mark> Uses<E> {
    /// Notes, at tick `now` of stream `raw`, a use of `span` on that
    /// stream whose op is marked by `ev` (recorded on the stream after the
    /// op's work).
    ///
    /// A write first forgets the uses inside its span, on any stream: it
    /// was ordered after them, so whatever overlaps them overlaps it and
    /// waits for it. Then the use joins its list: the stream's entries of
    /// that list inside `span` that `ev` [follows](Mark::follows) are
    /// dropped (whatever overlaps them overlaps `span` and waits for
    /// `ev`), and once the stream has [`PER_STREAM`] entries those that
    /// `ev` follows merge into one, of their hull, marked by `ev`. An
    /// entry that `ev` does not follow (a use another thread enqueued on
    /// the stream after `ev` was recorded and noted before this) stays.
    fn note(&mut self, raw: usize, write: bool, span: Span, ev: &E, now: u64) {
        if write {
            for list in [&mut self.reads, &mut self.writes] {
                list.retain(|e| !within(&e.span, &span));
            }
        }
        let list = if write {
            &mut self.writes
        } else {
            &mut self.reads
        };
        let followed = |e: &Entry<E>| e.stream == raw && ev.follows(e.noted);
        list.retain(|e| !(within(&e.span, &span) && followed(e)));
        let mut span = span;
        if list.iter().filter(|e| e.stream == raw).count() >= PER_STREAM {
            list.retain(|e| {
                if !followed(e) {
                    return true;
                }
                span = span.start.min(e.span.start)..span.end.max(e.span.end);
                false
            });
        }
        list.push(Entry {
            stream: raw,
            span,
            ev: ev.clone(),
            noted: now,
        });
    }

    /// The one stream of the writes, then of the reads and writes together
    /// ([`NO_STREAM`] where there are none, [`MANY_STREAMS`] where there
    /// are several): a read on the first, or a write on the second, waits
    /// for nothing ([`Uses::conflicts`] is empty).
    fn sole(&self) -> [usize; 2] {
        let of = |list: &[Entry<E>], init: usize| {
            list.iter().fold(init, |s, e| match s {
                NO_STREAM => e.stream,
                s if s == e.stream => s,
                _ => MANY_STREAMS,
            })
        };
        let writes = of(&self.writes, NO_STREAM);
        [writes, of(&self.reads, writes)]
    }

    /// Whether a use of `span` on stream `raw` marked by an event `same` as
    /// an entry's would change nothing: an entry of its list on its stream
    /// with that event holds its span (a write would only forget entries,
    /// which is never needed).
    fn covered(&self, raw: usize, write: bool, span: &Span, same: impl Fn(&E) -> bool) -> bool {
        let list = if write { &self.writes } else { &self.reads };
        list.iter()
            .any(|e| e.stream == raw && same(&e.ev) && within(span, &e.span))
    }

    /// The events a use of `span` on stream `raw` waits for: those of the
    /// other streams' entries that overlap it (writes, for a read; reads
    /// and writes, for a write).
    fn conflicts(&self, raw: usize, write: bool, span: Span) -> impl Iterator<Item = &E> {
        let reads = if write { &self.reads[..] } else { &[] };
        reads
            .iter()
            .chain(&self.writes)
            .filter(move |e| e.stream != raw && overlaps(&e.span, &span))
            .map(|e| &e.ev)
    }
}

/// Calls `f` once for each event of `evs`, skipping an event equal to the
/// one just before it (the entries of one op share theirs).
fn each_event<'a>(
    evs: impl Iterator<Item = &'a SharedEvent>,
    mut f: impl FnMut(&MarkEvent) -> Result<()>,
) -> Result<()> {
    let mut last: Option<&SharedEvent> = None;
    for ev in evs {
        if last.is_some_and(|l| Arc::ptr_eq(l, ev)) {
            continue;
        }
        f(ev)?;
        last = Some(ev);
    }
    Ok(())
}

/// The mark of one op's uses of buffers on one stream: one event, recorded
/// on the stream once, after the op's work, and shared by the use record
/// of every buffer the op used ([`DeviceBuffer::after_read_with`] and its
/// kin). An op on three buffers records one event, not three.
///
/// The event is recorded when the mark is first used (a mark never used
/// records nothing, and on a stream capturing a
/// [`TrackedGraph`](crate::TrackedGraph) the uses are logged instead and
/// nothing is recorded). So every use a mark records must be enqueued
/// before its first use: make the mark after enqueuing the op's work and
/// record all of the op's uses with it, as [`DeviceBuffer::after_read`]
/// does for a single use. A use enqueued later than the event is not
/// waited for by the buffer's later users or its free. Uses that other ops
/// or threads enqueue on the stream between the mark's first and last use
/// keep their own record: the mark's later uses do not replace it.
///
/// Events come from a pool per context, so marking an op creates no event
/// once the pool has some to spare.
///
/// # Examples
///
/// ```no_run
/// use cuda_core::{Device, DeviceBuffer, UseMark};
/// let dev = Device::new(0)?;
/// let stream = dev.new_stream()?;
/// let src = DeviceBuffer::<f32>::zeros(&stream, 256)?;
/// let mut dst = DeviceBuffer::<f32>::zeros(&stream, 256)?;
/// src.before_read(&stream)?;
/// dst.before_write(&stream)?;
/// stream
///     .memcpy_dtod(src.as_cuda_slice(), dst.as_cuda_slice_mut())
///     .map_err(|e| cuda_core::Error::driver("cuMemcpyDtoDAsync", e))?;
/// // Right after the copy: one event marks both uses.
/// let mark = UseMark::new(&stream);
/// src.after_read_with(&mark)?;
/// dst.after_write_with(&mark)?;
/// # Ok::<(), cuda_core::Error>(())
/// ```
///
/// [`DeviceBuffer::after_read_with`]: crate::DeviceBuffer::after_read_with
/// [`DeviceBuffer::after_read`]: crate::DeviceBuffer::after_read
pub struct UseMark<'s> {
    stream: &'s CudaStream,
    /// A mark of a scope: its event is the scope's for the stream.
    scope: Option<(&'s MarkScope, &'s Arc<CudaStream>)>,
    ev: OnceCell<Result<SharedEvent>>,
}

impl fmt::Debug for UseMark<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UseMark")
            .field("stream", &(self.stream.cu_stream() as usize))
            .field(
                "recorded",
                &matches!(self.ev.get(), Some(Ok(e)) if e.is_recorded()),
            )
            .field("scoped", &self.scope.is_some())
            .finish()
    }
}

impl<'s> UseMark<'s> {
    /// A mark for uses enqueued on `stream`; nothing is recorded yet.
    pub fn new(stream: &'s CudaStream) -> Self {
        UseMark {
            stream,
            scope: None,
            ev: OnceCell::new(),
        }
    }

    /// The stream the marked uses were enqueued on.
    pub fn stream(&self) -> &'s CudaStream {
        self.stream
    }

    /// The mark's event, recorded on its stream on the first call (a
    /// failure is kept: every later call fails alike).
    pub(crate) fn event(&self) -> Result<&SharedEvent> {
        self.ev
            .get_or_init(|| match self.scope {
                Some((scope, stream)) => scope.event_for(stream),
                None => MarkEvent::recorded(self.stream).map(Arc::new),
            })
            .as_ref()
            .map_err(Clone::clone)
    }
}

/// Use marks whose events are deferred: the marks a scope makes on one
/// stream share one event, recorded once after all of their uses, when the
/// scope is flushed (or dropped), or earlier, the moment anything needs it
/// (another stream's wait, a host access, a free); a mark made after that
/// gets a new event. So a chain of ops on one stream records one event,
/// not one an op. Waiting for a deferred event waits for everything its
/// stream ran up to its record: never less than the uses it marks.
///
/// A scope is for one execution: flush it before its streams are handed
/// on (a graph capture of a stream with an event pending would capture
/// its record).
///
/// # Examples
///
/// ```no_run
/// use cuda_core::{Device, DeviceBuffer, MarkScope};
/// let dev = Device::new(0)?;
/// let stream = dev.new_stream()?;
/// let mut buf = DeviceBuffer::<f32>::zeros(&stream, 256)?;
/// let scope = MarkScope::new();
/// for _ in 0..10 {
///     buf.before_write(&stream)?;
///     // ... enqueue a write of `buf` on `stream` ...
///     buf.after_write_with(&scope.mark(&stream))?;
/// }
/// scope.flush()?; // one event, recorded after the ten writes
/// # Ok::<(), cuda_core::Error>(())
/// ```
#[derive(Debug, Default)]
pub struct MarkScope {
    /// The events not yet recorded, one a stream (boxed: a scope that
    /// marks nothing stays small and allocates nothing).
    pending: Mutex<Option<Box<Pending>>>,
}

/// A scope's events not yet recorded.
#[derive(Debug, Default)]
struct Pending(Vec<SharedEvent>);

impl MarkScope {
    /// A scope with nothing pending.
    pub fn new() -> Self {
        Self::default()
    }

    /// A mark for uses enqueued on `stream`, sharing the scope's event for
    /// the stream (see [`UseMark`] for when to make and use it).
    pub fn mark<'s>(&'s self, stream: &'s Arc<CudaStream>) -> UseMark<'s> {
        UseMark {
            stream,
            scope: Some((self, stream)),
            ev: OnceCell::new(),
        }
    }

    /// The pending event of `stream`, or a new one. Called when a mark is
    /// first used, after the uses it marks are enqueued: an event still
    /// pending now is recorded later, after them.
    fn event_for(&self, stream: &Arc<CudaStream>) -> Result<SharedEvent> {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let pending = &mut pending.get_or_insert_with(Box::default).0;
        pending.retain(|e| !e.is_recorded());
        let raw = stream.cu_stream();
        let found = pending
            .iter()
            .find(|e| e.deferred_on().is_some_and(|s| s.cu_stream() == raw));
        if let Some(ev) = found {
            return Ok(ev.clone());
        }
        let ev = Arc::new(MarkEvent::deferred(stream)?);
        pending.push(ev.clone());
        Ok(ev)
    }

    /// Records every pending event on its stream.
    ///
    /// # Errors
    ///
    /// The first record that failed (each is tried); the uses it marks then
    /// fail their waits, and their buffers are leaked rather than freed.
    pub fn flush(&self) -> Result<()> {
        let pending = self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let mut first = Ok(());
        for ev in pending.into_iter().flat_map(|p| p.0) {
            if let Err(e) = ev.event() {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }
}

impl Drop for MarkScope {
    fn drop(&mut self) {
        let _ = self.flush();
    }
}

impl Default for UseRecord {
    fn default() -> Self {
        UseRecord::new(None)
    }
}

impl UseRecord {
    fn new(gate: Option<Mutex<()>>) -> UseRecord {
        UseRecord {
            uses: Mutex::default(),
            sole: [AtomicUsize::new(NO_STREAM), AtomicUsize::new(NO_STREAM)],
            orphan: Mutex::new(None),
            gate,
        }
    }

    /// The record of host memory the host also reaches: with a gate.
    pub(crate) fn with_gate() -> UseRecord {
        UseRecord::new(Some(Mutex::new(())))
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
        each_event(reads.iter().chain(&u.writes).map(|e| &e.ev), |ev| {
            ev.synchronize()
        })
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
        let raw = stream.cu_stream() as usize;
        let sole = self.sole[usize::from(write)].load(Ordering::Acquire);
        if sole == NO_STREAM || sole == raw {
            return Ok(());
        }
        let u = self.lock();
        each_event(u.conflicts(raw, write, span), |ev| ev.wait_on(stream))
    }

    /// Records a use of `span` enqueued on `mark`'s stream, marked by its
    /// event (recorded now if it is the mark's first use). A write forgets
    /// the uses inside its span: it was ordered after them, so whatever
    /// overlaps them overlaps it and waits for it. If the mark's event
    /// cannot be recorded the record breaks (the memory is never freed).
    pub(crate) fn record(&self, mark: &UseMark<'_>, write: bool, span: Span) -> Result<()> {
        if span.is_empty() {
            return Ok(());
        }
        let ev = match mark.event() {
            Ok(ev) => ev,
            Err(e) => {
                self.lock().broken = true;
                return Err(e);
            }
        };
        let raw = mark.stream().cu_stream() as usize;
        let mut u = self.lock();
        // A chain of ops on one stream shares its event (a `MarkScope`'s):
        // a use its entry already covers changes nothing.
        if !u.covered(raw, write, &span, |e| Arc::ptr_eq(e, ev)) {
            u.note(raw, write, span, ev, tick(raw));
            for (sole, now) in self.sole.iter().zip(u.sole()) {
                sole.store(now, Ordering::Release);
            }
        }
        Ok(())
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
        each_event(u.reads.iter().chain(&u.writes).map(|e| &e.ev), |ev| {
            ev.wait_on(home)
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A mark's event in the tests: a shared value, so a test sees when an
    /// entry lets go of it (`Arc::strong_count`).
    type Ev = Arc<u32>;

    /// These events follow every use noted before them (as a scope's
    /// deferred event does).
    impl Mark for Ev {
        fn follows(&self, _noted: u64) -> bool {
            true
        }
    }

    fn entries(list: &[Entry<Ev>]) -> Vec<(usize, Span, u32)> {
        let mut v: Vec<_> = list
            .iter()
            .map(|e| (e.stream, e.span.clone(), *e.ev))
            .collect();
        v.sort_by_key(|(s, sp, _)| (*s, sp.start, sp.end));
        v
    }

    #[test]
    fn one_op_on_three_buffers_shares_one_event() {
        let (mut a, mut b, mut c) = (Uses::<Ev>::default(), Uses::default(), Uses::default());
        let ev = Arc::new(1);
        a.note(1, false, WHOLE, &ev, 0);
        b.note(1, false, 0..64, &ev, 0);
        c.note(1, true, WHOLE, &ev, 0);
        // The op's own handle and one share per use record.
        assert_eq!(Arc::strong_count(&ev), 4);
        assert_eq!(entries(&a.reads), vec![(1, WHOLE, 1)]);
        assert_eq!(entries(&c.writes), vec![(1, WHOLE, 1)]);
        // A later op on the same stream replaces each share with its own;
        // the first event is let go (back to its pool), not re-recorded.
        let next = Arc::new(2);
        for u in [&mut a, &mut b, &mut c] {
            u.note(1, true, WHOLE, &next, 0);
        }
        assert_eq!(Arc::strong_count(&ev), 1);
        assert_eq!(*ev, 1);
        for u in [&a, &b, &c] {
            assert!(u.reads.is_empty());
            assert_eq!(entries(&u.writes), vec![(1, WHOLE, 2)]);
        }
    }

    #[test]
    fn a_use_of_the_same_span_on_the_same_stream_replaces_the_event() {
        let mut u = Uses::<Ev>::default();
        let (e1, e2) = (Arc::new(1), Arc::new(2));
        u.note(7, false, 0..8, &e1, 0);
        u.note(7, false, 0..8, &e2, 0);
        assert_eq!(entries(&u.reads), vec![(7, 0..8, 2)]);
        assert_eq!(Arc::strong_count(&e1), 1);
        // Another stream's read of the same span is its own entry.
        u.note(8, false, 0..8, &e1, 0);
        assert_eq!(entries(&u.reads), vec![(7, 0..8, 2), (8, 0..8, 1)]);
        // A read on stream 7 covering its earlier one replaces it.
        u.note(7, false, 0..16, &e1, 0);
        assert_eq!(entries(&u.reads), vec![(7, 0..16, 1), (8, 0..8, 1)]);
    }

    #[test]
    fn a_streams_entries_merge_into_their_hull_with_the_newest_event() {
        let mut u = Uses::<Ev>::default();
        let old = Arc::new(0);
        for i in 0..PER_STREAM {
            u.note(3, false, i * 10..i * 10 + 5, &old, 0);
        }
        u.note(4, false, 0..1000, &old, 0);
        assert_eq!(u.reads.len(), PER_STREAM + 1);
        let newest = Arc::new(9);
        u.note(3, false, 500..505, &newest, 0);
        assert_eq!(entries(&u.reads), vec![(3, 0..505, 9), (4, 0..1000, 0)]);
        // Stream 4's entry and the test's handle keep the old event.
        assert_eq!(Arc::strong_count(&old), 2);
    }

    #[test]
    fn a_write_forgets_the_uses_within_its_span_on_every_stream() {
        let mut u = Uses::<Ev>::default();
        let ev = Arc::new(1);
        u.note(1, false, 0..10, &ev, 0);
        u.note(2, false, 5..15, &ev, 0);
        u.note(2, true, 20..30, &ev, 0);
        u.note(3, false, 40..60, &ev, 0);
        let w = Arc::new(2);
        u.note(4, true, 0..30, &w, 0);
        // Within 0..30: forgotten (any stream, reads and writes); 40..60
        // is apart.
        assert_eq!(entries(&u.reads), vec![(3, 40..60, 1)]);
        assert_eq!(entries(&u.writes), vec![(4, 0..30, 2)]);
        // Overlapping but not within: kept.
        u.note(5, true, 50..70, &w, 0);
        assert_eq!(entries(&u.reads), vec![(3, 40..60, 1)]);
        assert_eq!(entries(&u.writes), vec![(4, 0..30, 2), (5, 50..70, 2)]);
    }

    #[test]
    fn a_read_waits_for_overlapping_writes_a_write_for_every_overlapping_use() {
        let mut u = Uses::<Ev>::default();
        u.note(1, true, 0..10, &Arc::new(1), 0);
        u.note(2, false, 0..10, &Arc::new(2), 0);
        u.note(3, true, 20..30, &Arc::new(3), 0);
        let waits = |u: &Uses<Ev>, raw, write, span| {
            let mut v: Vec<u32> = u.conflicts(raw, write, span).map(|e| **e).collect();
            v.sort();
            v
        };
        assert_eq!(waits(&u, 9, false, 5..25), vec![1, 3]);
        assert_eq!(waits(&u, 9, true, 5..25), vec![1, 2, 3]);
        assert_eq!(waits(&u, 9, true, 10..20), Vec::<u32>::new());
        // Never for the stream's own uses (the stream orders them).
        assert_eq!(waits(&u, 1, true, 0..10), vec![2]);
        assert_eq!(waits(&u, 2, true, 0..10), vec![1]);
    }

    #[test]
    fn a_use_skips_the_lock_only_where_it_waits_for_nothing() {
        // Random uses of three streams over a buffer of 64 bytes; after
        // each, every use that `sole` lets skip the lock (`before`) has no
        // conflict, and one stream's uses alone let it skip.
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut skipped = [0, 0];
        for _ in 0..200 {
            let mut u = Uses::<Ev>::default();
            assert_eq!(u.sole(), [NO_STREAM, NO_STREAM]);
            for i in 0..12u32 {
                let (a, b) = (next(64) as usize, next(64) as usize);
                let span = a.min(b)..a.max(b) + 1;
                u.note(next(3) as usize, next(2) == 1, span, &Arc::new(i), 0);
                let sole = u.sole();
                for raw in 0..3 {
                    for write in [false, true] {
                        if sole[usize::from(write)] == NO_STREAM || sole[usize::from(write)] == raw
                        {
                            skipped[usize::from(write)] += 1;
                            assert_eq!(u.conflicts(raw, write, WHOLE).count(), 0);
                        }
                    }
                }
            }
        }
        assert!(skipped[0] > 0 && skipped[1] > 0);
        let mut u = Uses::<Ev>::default();
        u.note(5, false, 0..8, &Arc::new(1), 0);
        u.note(5, true, 8..16, &Arc::new(2), 0);
        assert_eq!(u.sole(), [5, 5]);
        u.note(6, false, 0..8, &Arc::new(3), 0);
        assert_eq!(u.sole(), [5, MANY_STREAMS]);
    }

    /// An event whose record was enqueued after tick `.1` of its stream
    /// (`u64::MAX`: not yet), named `.0`.
    #[derive(Clone)]
    struct At(u32, u64);

    impl Mark for At {
        fn follows(&self, noted: u64) -> bool {
            self.1 == u64::MAX || self.1 > noted
        }
    }

    fn names(list: &[Entry<At>]) -> Vec<u32> {
        let mut v: Vec<u32> = list.iter().map(|e| e.ev.0).collect();
        v.sort();
        v
    }

    #[test]
    fn a_use_enqueued_after_an_events_record_outlives_that_events_later_note() {
        // An op's event is recorded at tick 10 of stream 1; before the op
        // notes its read, another thread enqueues a read of the same bytes
        // on the stream and notes it (tick 12, its event recorded at 11).
        let mut u = Uses::<At>::default();
        u.note(1, false, WHOLE, &At(2, 11), 12);
        u.note(1, false, WHOLE, &At(1, 10), 13);
        // Waiting for event 1 would not wait for that read: both stay.
        assert_eq!(names(&u.reads), vec![1, 2]);
        // An event recorded after both notes follows both; so does one
        // still to be recorded.
        u.note(1, false, 0..8, &At(3, 14), 15);
        assert_eq!(names(&u.reads), vec![1, 2, 3]);
        u.note(1, false, WHOLE, &At(4, 16), 17);
        assert_eq!(names(&u.reads), vec![4]);
        u.note(1, false, WHOLE, &At(5, u64::MAX), 18);
        assert_eq!(names(&u.reads), vec![5]);
        // Merging keeps apart the entries the new event does not follow.
        let mut u = Uses::<At>::default();
        for i in 0..PER_STREAM {
            let t = i as u64;
            u.note(
                1,
                false,
                i * 10..i * 10 + 5,
                &At(i as u32, 2 * t),
                2 * t + 1,
            );
        }
        u.note(1, false, 500..505, &At(99, 8), 100);
        let list: Vec<(u32, Span)> = u.reads.iter().map(|e| (e.ev.0, e.span.clone())).collect();
        // Events 0-3 were noted at ticks 1-7, before event 99's record
        // (8): they merge into its entry; 4-7 stay.
        assert_eq!(names(&u.reads), vec![4, 5, 6, 7, 99]);
        assert!(list.contains(&(99, 0..505)));
    }
}
