//! A page-locked staging arena for a batch of small copies.
//!
//! [`crate::staging::upload_at`] and [`crate::PinnedBuffer::download_from`]
//! stage each copy on its own: a pool lookup, an event recorded after the
//! copy and a hand-off to the reclaimer thread. A caller that works in
//! batches (enqueue many small copies, then wait for its streams) can skip
//! all three with a [`StagingArena`]: one pinned block, handed out front to
//! back, whose copies are recorded by nothing but the streams they run on.
//! The arena stays safe by its own bookkeeping instead of events:
//!
//! - every range is handed out once ([`StagingArena::reserve`]) and used by
//!   one copy, and ranges are handed out again only after
//!   [`StagingArena::synchronize`] waited for every stream the arena's
//!   copies ran on; so the host never writes bytes a copy still reads, nor
//!   touches bytes a copy still writes;
//! - a download's bytes are read ([`StagingArena::read`]) only after that
//!   wait, and before any range is handed out again;
//! - an arena whose copies may still run (a wait failed, or none was made)
//!   leaks its block when dropped rather than free it under the copies.
//!
//! The device side of each copy is ordered by its stream alone, like a use
//! through [`DeviceBuffer::as_cuda_slice`]: the caller orders it against the
//! buffer's other uses (see [`DeviceBuffer::memset_unordered`]'s
//! `# Ordering`).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};

use crate::buffer::{check_range, DeviceBuffer};
use crate::device::Device;
use crate::error::{DriverResultExt, Error, Result};
use crate::raw::{check_same_context, MarkEvent};

/// The start of every range a [`StagingArena`] hands out is a multiple of
/// this many bytes.
pub const ARENA_ALIGN: usize = 64;

/// Page-locked host memory that a batch's small copies are staged in (see
/// the [module docs](self)): reserve a range per copy, enqueue the copy
/// with it, wait for the batch with [`StagingArena::synchronize`], then
/// read the downloads' bytes; the next reservation starts over at the
/// front.
///
/// # Examples
///
/// ```no_run
/// use cuda_core::{Device, DeviceBuffer, StagingArena};
/// let dev = Device::new(0)?;
/// let stream = dev.new_stream()?;
/// let mut buf = DeviceBuffer::<u8>::zeros(&stream, 8)?;
/// let mut arena = StagingArena::new(&dev, 1 << 20)?;
/// // The device side is ordered by the caller (here: one stream).
/// let slot = arena.reserve(4).expect("room");
/// arena.upload(slot, &[1, 2, 3, 4], &mut buf, 2, &stream)?;
/// let slot = arena.reserve(8).expect("room");
/// let read = arena.download(slot, &buf, 0, &stream)?;
/// arena.synchronize(&[stream.clone()])?;
/// assert_eq!(arena.read(read)?, &[0, 0, 1, 2, 3, 4, 0, 0]);
/// # Ok::<(), cuda_core::Error>(())
/// ```
pub struct StagingArena {
    /// Host address of the pinned block.
    addr: usize,
    /// Capacity of the pooled block behind `addr`.
    block_bytes: usize,
    ctx: Arc<CudaContext>,
    bump: Bump,
    /// The streams of the copies since the last successful synchronize:
    /// while it is not empty, copies may still use the block.
    streams: Vec<Arc<CudaStream>>,
    /// [`StagingArena::mark_end`] closed the epoch: nothing is handed out
    /// until [`StagingArena::settle`].
    ended: bool,
}

/// Events recorded after every copy of one epoch of a [`StagingArena`]
/// ([`StagingArena::mark_end`]; [`StagingArena::mark_end_with`] records
/// them on more streams); [`StagingArena::settle`] waits for them.
#[derive(Debug)]
#[must_use = "an arena whose end is dropped hands nothing out again"]
pub struct ArenaEnd {
    epoch: u64,
    /// Pooled: an arena's end creates and destroys no event.
    events: Vec<MarkEvent>,
}

impl ArenaEnd {
    /// Whether every copy of the epoch is done (never waits).
    ///
    /// # Errors
    /// The driver's error naming `cuEventQuery` (a sticky fault of earlier
    /// work is [`Error::Poisoned`]).
    pub fn is_done(&self) -> Result<bool> {
        for e in &self.events {
            if !e.query()? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Makes `stream` wait for every copy of the epoch (and, for an end of
    /// [`StagingArena::mark_end_with`], for the work before it on the
    /// streams it names): a `cuStreamWaitEvent` per event.
    ///
    /// # Errors
    /// The driver's error naming `cuStreamWaitEvent`.
    pub fn wait_on(&self, stream: &CudaStream) -> Result<()> {
        self.events.iter().try_for_each(|e| e.wait_on(stream))
    }
}

impl fmt::Debug for StagingArena {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StagingArena")
            .field("len", &self.bump.len)
            .field("used", &self.bump.used)
            .field("streams", &self.streams.len())
            .finish()
    }
}

/// A range of a [`StagingArena`], handed out by [`StagingArena::reserve`]
/// for one copy. Not `Clone`: each range is used once.
#[derive(Debug, PartialEq, Eq)]
pub struct ArenaSlot {
    epoch: u64,
    start: usize,
    len: usize,
}

impl ArenaSlot {
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Where a download staged in a [`StagingArena`] lands: its bytes are
/// [`StagingArena::read`] after the arena's next synchronize.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaRead {
    epoch: u64,
    start: usize,
    len: usize,
}

impl ArenaRead {
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A number no other arena epoch of this process has (so a slot or read of
/// one arena, or of an earlier epoch, is never taken for another's).
fn next_epoch() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// An arena's bookkeeping, apart from its memory (so it is tested without
/// a GPU): ranges handed out front to back in the current epoch, and the
/// epoch whose copies are known complete and whose ranges are untouched
/// since.
#[derive(Debug)]
struct Bump {
    len: usize,
    used: usize,
    epoch: u64,
    readable: Option<u64>,
}

impl Bump {
    fn new(len: usize) -> Self {
        Bump {
            len,
            used: 0,
            epoch: next_epoch(),
            readable: None,
        }
    }

    fn reserve(&mut self, len: usize) -> Option<ArenaSlot> {
        let start = self.used.checked_next_multiple_of(ARENA_ALIGN)?;
        let end = start.checked_add(len).filter(|&e| e <= self.len)?;
        self.used = end;
        // From here on the last epoch's ranges may be written again.
        self.readable = None;
        Some(ArenaSlot {
            epoch: self.epoch,
            start,
            len,
        })
    }

    fn check_slot(&self, slot: &ArenaSlot) -> Result<()> {
        if slot.epoch == self.epoch {
            Ok(())
        } else {
            Err(Error::InvalidArgument(
                "a staging arena range used after the arena's synchronize, or with another \
                 arena"
                    .into(),
            ))
        }
    }

    /// Every copy of the current epoch is done: its ranges become readable,
    /// and ranges are handed out from the front again.
    fn settle(&mut self) {
        self.readable = Some(self.epoch);
        self.epoch = next_epoch();
        self.used = 0;
    }

    fn check_read(&self, read: &ArenaRead) -> Result<()> {
        if self.readable == Some(read.epoch) {
            Ok(())
        } else {
            Err(Error::InvalidArgument(
                "a staging arena download read before the arena's synchronize, after a later \
                 reservation, or from another arena"
                    .into(),
            ))
        }
    }
}

impl StagingArena {
    /// Allocates an arena of `len` bytes of page-locked, not
    /// write-combined host memory (from the pool of pinned blocks that
    /// staging and [`crate::PinnedBuffer`]s share).
    ///
    /// # Errors
    /// [`Error::NoDriver`]; [`Error::InvalidArgument`] for `len` 0 or one
    /// that overflows; the driver's error naming `cuMemHostAlloc`.
    pub fn new(device: &Device, len: usize) -> Result<Self> {
        crate::device::require_driver()?;
        if len == 0 {
            return Err(Error::InvalidArgument(
                "a staging arena needs at least one byte".into(),
            ));
        }
        crate::buffer::check_len::<u8>(len)?;
        let ctx = device.context().clone();
        let (addr, block_bytes) = crate::staging::take_block(&ctx, len)?;
        Ok(StagingArena {
            addr,
            block_bytes,
            ctx,
            bump: Bump::new(len),
            streams: Vec::new(),
            ended: false,
        })
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.bump.len
    }

    /// Whether it has no bytes (never: see [`StagingArena::new`]).
    pub fn is_empty(&self) -> bool {
        self.bump.len == 0
    }

    /// Bytes handed out since the last synchronize (alignment included).
    pub fn used(&self) -> usize {
        self.bump.used
    }

    /// The next `len` bytes (starting at a multiple of [`ARENA_ALIGN`]), or
    /// `None` when they do not fit before the next synchronize. A
    /// reservation ends the reads of the last synchronize: read them first.
    pub fn reserve(&mut self, len: usize) -> Option<ArenaSlot> {
        if self.ended {
            return None;
        }
        self.bump.reserve(len)
    }

    /// Records an event after this epoch's copies on every stream they ran
    /// on, and closes the epoch: nothing is handed out until
    /// [`StagingArena::settle`] waited for the events. Unlike
    /// [`StagingArena::synchronize`], this lets the streams run on with
    /// later work while the copies complete.
    ///
    /// # Errors
    /// The driver's error naming `cuEventRecord` (the epoch stays open).
    pub fn mark_end(&mut self) -> Result<ArenaEnd> {
        self.mark_end_with(&[])
    }

    /// [`StagingArena::mark_end`], the end also recorded on `streams`
    /// (each stream once, `streams` first): a caller that waits for a
    /// batch's streams anyway passes them here, and the end marks the
    /// whole batch on them ([`ArenaEnd::is_done`], [`ArenaEnd::wait_on`])
    /// with no events of the caller's own.
    ///
    /// # Errors
    /// As [`StagingArena::mark_end`].
    pub fn mark_end_with(&mut self, streams: &[Arc<CudaStream>]) -> Result<ArenaEnd> {
        let mut events = Vec::with_capacity(streams.len().max(self.streams.len()));
        for s in self.with_own(streams) {
            events.push(MarkEvent::recorded(s)?);
        }
        self.ended = true;
        Ok(ArenaEnd {
            epoch: self.bump.epoch,
            events,
        })
    }

    /// Waits for the events of `end` (at once when
    /// [`ArenaEnd::is_done`]); then the epoch's downloads can be read and
    /// ranges are handed out from the front again.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for the end of another arena or epoch;
    /// the first failed wait, naming `cuEventSynchronize` (the arena then
    /// holds on to its ranges, and leaks its block when dropped).
    pub fn settle(&mut self, end: ArenaEnd) -> Result<()> {
        if !self.ended || end.epoch != self.bump.epoch {
            return Err(Error::InvalidArgument(
                "a staging arena settled with the end of another arena or epoch".into(),
            ));
        }
        for e in &end.events {
            e.synchronize()?;
        }
        self.streams.clear();
        self.bump.settle();
        self.ended = false;
        Ok(())
    }

    /// Copies `data` into `slot` (a host memcpy), then enqueues on `stream`
    /// a copy of it into `dst[offset..offset + data.len()]`
    /// (`cuMemcpyHtoDAsync`); `data` is free once this returns.
    ///
    /// Ordered on the device side by `stream` alone (see the
    /// [module docs](self)): the caller orders it as a write of `dst`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `data` is not the slot's length, the
    /// range is outside `dst`, the slot is of another arena or epoch, or
    /// `dst` or the arena is of another device than `stream` (all checked
    /// before any copy); [`Error::Capture`] while `stream` captures a graph;
    /// the driver's error naming `cuMemcpyHtoDAsync`.
    pub fn upload(
        &mut self,
        slot: ArenaSlot,
        data: &[u8],
        dst: &mut DeviceBuffer<u8>,
        offset: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.bump.check_slot(&slot)?;
        if data.len() != slot.len {
            return Err(Error::InvalidArgument(format!(
                "host-to-device copy: {} bytes staged in a range of {}",
                data.len(),
                slot.len
            )));
        }
        let range = device_range("host-to-device copy", offset, slot.len, dst.len())?;
        self.check_stream(stream)?;
        dst.same_context(stream)?;
        if slot.len == 0 {
            return Ok(());
        }
        let host = (self.addr + slot.start) as *mut u8;
        // SAFETY: `host` addresses `slot.len` bytes of this arena's block
        // (`reserve` kept them inside it), which no copy uses: the range
        // was handed out once in this epoch (checked above, and the slot is
        // consumed), and every copy of earlier epochs is done (the epoch
        // only changes when `synchronize` waited for them). `data` is the
        // caller's memory, not the block (`&mut self` excludes a borrow of
        // the arena's bytes), so they do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), host, slot.len) };
        self.note_stream(stream);
        let (dptr, _write) = dst.as_cuda_slice_mut().device_ptr_mut(stream);
        // SAFETY: `dptr + range.start` addresses `slot.len` bytes inside a
        // live allocation of `stream`'s context (range and context checked
        // above; `&mut dst` keeps it until the call returns, and its free is
        // ordered by the caller's records). The host bytes stay allocated
        // and unwritten until the copy is done: the arena hands the range
        // out again, or frees the block, only after `synchronize` waited
        // for `stream` (noted above).
        unsafe { crate::copy::htod_async(dptr + range.start as u64, host, slot.len, stream) }
    }

    /// Enqueues on `stream` a copy of `src[offset..offset + slot.len()]`
    /// into `slot` (`cuMemcpyDtoHAsync`); its bytes are
    /// [`StagingArena::read`] after the next synchronize.
    ///
    /// Ordered on the device side by `stream` alone (see the
    /// [module docs](self)): the caller orders it as a read of `src`.
    ///
    /// # Errors
    /// As [`StagingArena::upload`], naming `cuMemcpyDtoHAsync`.
    pub fn download(
        &mut self,
        slot: ArenaSlot,
        src: &DeviceBuffer<u8>,
        offset: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<ArenaRead> {
        self.bump.check_slot(&slot)?;
        let range = device_range("device-to-host copy", offset, slot.len, src.len())?;
        self.check_stream(stream)?;
        src.same_context(stream)?;
        let read = ArenaRead {
            epoch: slot.epoch,
            start: slot.start,
            len: slot.len,
        };
        if slot.len == 0 {
            return Ok(read);
        }
        let host = (self.addr + slot.start) as *mut u8;
        self.note_stream(stream);
        let (dptr, _read) = src.as_cuda_slice().device_ptr(stream);
        // SAFETY: `host` addresses `slot.len` bytes of this arena's block
        // that no other copy uses and the host does not touch until the
        // copy is done (as in `upload`: one use per range per epoch, and
        // `read` only after `synchronize` waited for `stream`, noted
        // above); `dptr + range.start` addresses as many bytes inside a
        // live allocation of `stream`'s context (checked above). Any byte
        // pattern is a valid `u8`.
        unsafe { crate::copy::dtoh_async(host, dptr + range.start as u64, slot.len, stream) }?;
        Ok(read)
    }

    /// Waits for `streams`, in order (`cuStreamSynchronize`, stopping at the
    /// first failure), then for any other stream this arena's copies ran on
    /// since the last synchronize. Once all are done, the downloads'
    /// bytes can be read and the arena's ranges are handed out again from
    /// the front. A caller that waits for a batch's streams anyway passes
    /// them here, so each is waited for once.
    ///
    /// # Errors
    /// The first failed wait, naming `cuStreamSynchronize` (a sticky fault
    /// is [`Error::Poisoned`]). The arena then holds on to its ranges (and
    /// leaks its block when dropped) as its copies may still run.
    pub fn synchronize(&mut self, streams: &[Arc<CudaStream>]) -> Result<()> {
        for s in self.with_own(streams) {
            s.synchronize().call("cuStreamSynchronize")?;
        }
        self.streams.clear();
        self.bump.settle();
        self.ended = false;
        Ok(())
    }

    /// The bytes of a download, after the synchronize that followed it and
    /// before the next reservation.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a download of another arena, one not
    /// yet waited for, or one whose range may have been reused since.
    pub fn read(&self, read: ArenaRead) -> Result<&[u8]> {
        self.bump.check_read(&read)?;
        // SAFETY: the range lies in this arena's block (`reserve` kept it
        // inside); the download into it is complete (its stream was waited
        // for by the `synchronize` that made its epoch readable), and no
        // range has been handed out since (a reservation ends
        // readability), so no copy touches it while `&self` is borrowed.
        // The download wrote every byte, and any byte is a valid `u8`.
        Ok(unsafe { std::slice::from_raw_parts((self.addr + read.start) as *const u8, read.len) })
    }

    /// `streams` (each once, in order), then the streams of this epoch's
    /// copies that `streams` does not name.
    fn with_own<'a>(
        &'a self,
        streams: &'a [Arc<CudaStream>],
    ) -> impl Iterator<Item = &'a Arc<CudaStream>> {
        let named = |s: &CudaStream, among: &[Arc<CudaStream>]| {
            among.iter().any(|t| t.cu_stream() == s.cu_stream())
        };
        let given = streams
            .iter()
            .enumerate()
            .filter(move |(i, s)| !named(s, &streams[..*i]))
            .map(|(_, s)| s);
        given.chain(self.streams.iter().filter(move |s| !named(s, streams)))
    }

    fn check_stream(&self, stream: &CudaStream) -> Result<()> {
        check_same_context("a staging arena", &self.ctx, stream)?;
        if crate::tracking::is_capture_stream(stream) {
            return Err(Error::Capture(
                "a copy through a staging arena cannot be captured: the arena's bytes are \
                 reused once the copy is waited for, which a replay would not be"
                    .into(),
            ));
        }
        Ok(())
    }

    fn note_stream(&mut self, stream: &Arc<CudaStream>) {
        if !self
            .streams
            .iter()
            .any(|s| s.cu_stream() == stream.cu_stream())
        {
            self.streams.push(stream.clone());
        }
    }
}

/// `offset..offset + len` checked against a buffer of `buffer_len` bytes.
fn device_range(
    what: &str,
    offset: usize,
    len: usize,
    buffer_len: usize,
) -> Result<std::ops::Range<usize>> {
    let end = offset.checked_add(len).ok_or_else(|| {
        Error::InvalidArgument(format!("{what}: {len} bytes at offset {offset} overflow"))
    })?;
    let range = offset..end;
    check_range(what, &range, buffer_len)?;
    Ok(range)
}

impl Drop for StagingArena {
    fn drop(&mut self) {
        if !self.streams.is_empty() {
            // Copies since the last synchronize may still use the block:
            // leak it rather than free it under them.
            return;
        }
        let (ctx, addr, bytes) = (self.ctx.clone(), self.addr, self.block_bytes);
        // On the reclaimer thread (`cuMemFreeHost` may synchronize).
        crate::reclaim::defer(move || crate::staging::give_back_block(&ctx, addr, bytes));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_aligned_and_handed_out_once_per_epoch() {
        let mut b = Bump::new(256);
        let a = b.reserve(10).unwrap();
        assert_eq!((a.start, a.len), (0, 10));
        let c = b.reserve(64).unwrap();
        assert_eq!((c.start, c.len), (64, 64));
        let d = b.reserve(100).unwrap();
        assert_eq!(d.start, 128);
        assert!(
            b.reserve(1).is_none(),
            "256 bytes are used up to 228, next start 256"
        );
        assert!(b.check_slot(&a).is_ok());
        b.settle();
        // Old slots are refused after a synchronize, ranges start over.
        assert!(matches!(b.check_slot(&a), Err(Error::InvalidArgument(_))));
        let e = b.reserve(256).unwrap();
        assert_eq!((e.start, e.len), (0, 256));
        assert!(b.reserve(1).is_none());
    }

    #[test]
    fn ranges_that_do_not_fit_are_refused() {
        let mut b = Bump::new(100);
        assert!(b.reserve(101).is_none());
        assert!(b.reserve(usize::MAX).is_none());
        assert_eq!(b.used, 0, "a refused reservation takes nothing");
        assert!(b.reserve(100).is_some());
    }

    #[test]
    fn downloads_are_readable_only_between_synchronize_and_the_next_reservation() {
        let mut b = Bump::new(128);
        let s = b.reserve(8).unwrap();
        let r = ArenaRead {
            epoch: s.epoch,
            start: s.start,
            len: s.len,
        };
        assert!(b.check_read(&r).is_err(), "not waited for yet");
        b.settle();
        assert!(b.check_read(&r).is_ok());
        let _ = b.reserve(8).unwrap();
        assert!(b.check_read(&r).is_err(), "its range may be reused now");
        b.settle();
        assert!(b.check_read(&r).is_err(), "an older epoch");
    }

    #[test]
    fn epochs_of_different_arenas_differ() {
        let (a, b) = (Bump::new(64), Bump::new(64));
        assert_ne!(a.epoch, b.epoch);
        let mut a = a;
        let slot = a.reserve(8).unwrap();
        assert!(b.check_slot(&slot).is_err());
    }

    #[test]
    fn device_ranges_are_checked_before_any_copy() {
        assert_eq!(device_range("copy", 4, 4, 8).unwrap(), 4..8);
        assert!(device_range("copy", 5, 4, 8).is_err());
        assert!(device_range("copy", usize::MAX, 2, 8).is_err());
        assert_eq!(device_range("copy", 8, 0, 8).unwrap(), 8..8);
    }
}
