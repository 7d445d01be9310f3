//! Typed device buffers that order every use across streams themselves.
//!
//! `DeviceBuffer<T>` wraps cudarc's `CudaSlice<T>` (so interop code can pass
//! slices in and out) but does not rely on cudarc's use tracking for
//! safety: cudarc keeps one read event per slice (a second reader stream
//! overwrites the first, so a free waits only for the last reader), and its
//! waits go through a context-binding call that silently skips them when an
//! earlier error is pending. So the buffer keeps its own events, through raw
//! driver calls: one per stream that read it since the last write, and one
//! for the last write (per range, for ranged uses). An event is shared by
//! every buffer one op used: the op records one, after its work, and each
//! buffer's use record keeps a share of it ([`UseMark`]). Every use through this crate waits for what it must
//! (a read for the last write; a write for the last write and every read)
//! and records itself; the destructor makes the buffer's home stream wait
//! for all of them before the stream-ordered free (`cuMemFreeAsync`), and
//! leaks the memory rather than free it if it cannot order the free.
//!
//! Uses made directly through the cudarc slice (`as_cuda_slice`) are not
//! ordered by the buffer: on the contexts this crate opens
//! ([`Device::new`](crate::Device::new)) cudarc's own tracking is off, so
//! such a use is ordered by its stream alone (a context made by other code
//! keeps cudarc's tracking as that code set it).
//!
//! Inside a CUDA graph capture (see [`crate::graph`]), uses on the
//! capture's streams record no events: they are logged for the graph,
//! whose every replay is ordered and recorded as a use of the buffer.

use std::fmt;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits};

use crate::device::Device;
use crate::error::{DriverResultExt, Error, Result};
use crate::raw::{check_same_context, set_current};
use crate::tracking::{Span, UseMark, UseRecord, WHOLE};

/// A typed buffer in device memory.
///
/// Its contents are only reachable through work on a stream (copies,
/// kernels). Every use through this crate is ordered after the uses it
/// conflicts with, on any stream, and the buffer's free after all of them;
/// so a buffer can be handed out, used and dropped while the GPU still works
/// on it. A CUDA graph that captured a use of the buffer shares its use
/// record and keeps its memory: dropping the handle first hands the memory
/// to that record, freed when the graph is gone, after its replays.
pub struct DeviceBuffer<T> {
    slice: ManuallyDrop<CudaSlice<T>>,
    uses: Arc<UseRecord>,
    /// The [`MemPool`](crate::MemPool) the memory came from, when a scope
    /// chose one: kept until the GPU has run the free (a pool destroyed
    /// with memory outstanding breaks the driver).
    pool: Option<crate::MemPool>,
    _marker: PhantomData<T>,
}

impl<T> fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("type", &std::any::type_name::<T>())
            .field("len", &self.slice.len())
            .field("device", &self.slice.ordinal())
            .finish()
    }
}

impl<T: DeviceRepr> DeviceBuffer<T> {
    /// Takes ownership of a cudarc slice.
    pub fn from_cuda_slice(slice: CudaSlice<T>) -> Self {
        Self::from_pool_slice(slice, None)
    }

    /// A slice allocated from `pool` (a [`MemPool`](crate::MemPool)'s
    /// handle, held until the slice's free has run).
    fn from_pool_slice(slice: CudaSlice<T>, pool: Option<crate::MemPool>) -> Self {
        DeviceBuffer {
            slice: ManuallyDrop::new(slice),
            uses: Arc::default(),
            pool,
            _marker: PhantomData,
        }
    }

    /// Allocates `len` zeroed elements, stream-ordered on `stream`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the byte size overflows; a driver error
    /// (e.g. out of memory) naming the failing call.
    pub fn zeros(stream: &Arc<CudaStream>, len: usize) -> Result<Self>
    where
        T: ValidAsZeroBits,
    {
        check_len::<T>(len)?;
        let pool = crate::mempool::scoped_for(stream);
        let (mut slice, pool) = match crate::tracking::alloc_stream_for(stream) {
            // Inside a capture: allocated outside the graph, zeroed by a
            // captured memset (so each replay zeroes it, as the op does).
            Some(side) => crate::tracking::outside_capture(|| {
                // SAFETY: zeroed by the memset just below, before any use.
                unsafe { crate::mempool::alloc::<T>(&side, len, pool) }
            }),
            // SAFETY: zeroed by the memset just below, before any use.
            None => unsafe { crate::mempool::alloc::<T>(stream, len, pool) },
        }
        .call("cuMemAllocAsync")?;
        let zeroed = stream.memset_zeros(&mut slice).call("cuMemsetD8Async");
        let b = Self::from_pool_slice(slice, pool);
        zeroed?;
        b.after_write(stream)?;
        Ok(b)
    }

    /// Allocates `len` elements with unspecified contents.
    ///
    /// # Errors
    /// As [`DeviceBuffer::zeros`].
    ///
    /// # Safety
    /// The contents are uninitialised device memory: the caller makes sure
    /// every element is written before it is read (by the GPU or, after a
    /// download, by the host).
    pub unsafe fn uninit(stream: &Arc<CudaStream>, len: usize) -> Result<Self> {
        check_len::<T>(len)?;
        let pool = crate::mempool::scoped_for(stream);
        // Inside a capture: allocated outside the graph (see `zeros`).
        let on = crate::tracking::alloc_stream_for(stream).unwrap_or_else(|| stream.clone());
        // SAFETY: forwarded to the caller (see `# Safety`).
        let (slice, pool) = crate::tracking::outside_capture(|| unsafe {
            crate::mempool::alloc::<T>(&on, len, pool)
        })
        .call("cuMemAllocAsync")?;
        Ok(Self::from_pool_slice(slice, pool))
    }
}

impl<T> DeviceBuffer<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.slice.len()
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.slice.len() == 0
    }

    /// Size in bytes.
    pub fn num_bytes(&self) -> usize {
        self.slice.num_bytes()
    }

    /// The device the memory is on.
    pub fn device(&self) -> Device {
        Device::of_stream(self.slice.stream())
    }

    /// The stream the buffer was allocated on (its free is ordered there).
    pub fn home_stream(&self) -> &Arc<CudaStream> {
        self.slice.stream()
    }

    /// The cudarc slice, for interop and kernel arguments. Uses made through
    /// it directly are not ordered by the buffer (see the module docs).
    pub fn as_cuda_slice(&self) -> &CudaSlice<T> {
        &self.slice
    }

    /// The cudarc slice, mutably (see [`DeviceBuffer::as_cuda_slice`]).
    pub fn as_cuda_slice_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }

    /// Gives the cudarc slice back, after making its home stream wait for
    /// every use recorded here (later uses on the home stream are ordered
    /// by the stream; the caller orders any other).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if a CUDA graph still uses the buffer (it
    /// is then dropped as usual); a driver error if the wait cannot be
    /// enqueued (the memory is then leaked, never freed).
    pub fn into_cuda_slice(self) -> Result<CudaSlice<T>> {
        if Arc::strong_count(&self.uses) > 1 {
            return Err(Error::InvalidArgument(
                "the buffer is used by a CUDA graph: drop the graph first".into(),
            ));
        }
        let mut this = ManuallyDrop::new(self);
        let ordered = this.uses.order_home_stream(this.slice.stream());
        // SAFETY: `this` is never used or dropped again; each field is moved
        // out (or dropped) exactly once.
        let uses = unsafe { std::ptr::read(&this.uses) };
        drop(uses);
        // SAFETY: as above. The memory leaves our hands: its pool is kept
        // for the life of the process (never destroyed under it).
        std::mem::forget(unsafe { std::ptr::read(&this.pool) });
        match ordered {
            // SAFETY: as above: the slice is taken exactly once.
            Ok(()) => Ok(unsafe { ManuallyDrop::take(&mut this.slice) }),
            Err(e) => Err(e),
        }
    }

    pub(crate) fn same_context(&self, stream: &CudaStream) -> Result<()> {
        check_same_context("a buffer", self.slice.stream().context(), stream)
    }

    /// Orders a read on `stream` after the last write. Call before
    /// enqueuing the read, and [`DeviceBuffer::after_read`] after.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a stream of another device; a driver
    /// error if the wait cannot be enqueued.
    pub fn before_read(&self, stream: &CudaStream) -> Result<()> {
        self.same_context(stream)?;
        self.uses.before(stream, false, WHOLE)
    }

    /// Orders a write on `stream` after the last write and every read since.
    /// Call before enqueuing the write, and [`DeviceBuffer::after_write`]
    /// after.
    ///
    /// # Errors
    /// As [`DeviceBuffer::before_read`].
    pub fn before_write(&self, stream: &CudaStream) -> Result<()> {
        self.same_context(stream)?;
        self.uses.before(stream, true, WHOLE)
    }

    /// Records a read enqueued on `stream` (later writes and the free wait
    /// for it): [`DeviceBuffer::after_read_with`] a mark of its own, so
    /// it records one event. An op that uses several buffers marks them
    /// all with one [`UseMark`] instead.
    ///
    /// # Errors
    /// A driver error if the event cannot be created or recorded; the
    /// buffer is then never freed (it cannot know when the read ends).
    pub fn after_read(&self, stream: &CudaStream) -> Result<()> {
        self.after(&UseMark::new(stream), false, WHOLE)
    }

    /// Records a write enqueued on `stream`. Earlier reads are ordered
    /// before it (by [`DeviceBuffer::before_write`]), so they are forgotten.
    ///
    /// # Errors
    /// As [`DeviceBuffer::after_read`].
    pub fn after_write(&self, stream: &CudaStream) -> Result<()> {
        self.after(&UseMark::new(stream), true, WHOLE)
    }

    /// [`DeviceBuffer::after_read`] of a read enqueued on `mark`'s stream,
    /// marked by `mark`'s event, which the op's other uses share (see
    /// [`UseMark`] for when to call it).
    ///
    /// # Errors
    /// As [`DeviceBuffer::after_read`] (a mark whose event could not be
    /// recorded fails every use it marks).
    pub fn after_read_with(&self, mark: &UseMark<'_>) -> Result<()> {
        self.after(mark, false, WHOLE)
    }

    /// [`DeviceBuffer::after_write`] of a write enqueued on `mark`'s
    /// stream, marked by `mark`'s event (see [`UseMark`]).
    ///
    /// # Errors
    /// As [`DeviceBuffer::after_read_with`].
    pub fn after_write_with(&self, mark: &UseMark<'_>) -> Result<()> {
        self.after(mark, true, WHOLE)
    }

    /// [`DeviceBuffer::before_read`] of elements `range` only: ordered
    /// after the writes that overlap it.
    ///
    /// # Errors
    /// As [`DeviceBuffer::before_read`]; [`Error::InvalidArgument`] for a
    /// range outside the buffer.
    pub fn before_read_range(&self, stream: &CudaStream, range: Range<usize>) -> Result<()> {
        let span = self.span(&range)?;
        self.same_context(stream)?;
        self.uses.before(stream, false, span)
    }

    /// [`DeviceBuffer::before_write`] of elements `range` only: ordered
    /// after the reads and writes that overlap it, so writes of disjoint
    /// ranges on two streams run at once. The caller holds the range
    /// exclusively until [`DeviceBuffer::after_write_range`].
    ///
    /// # Errors
    /// As [`DeviceBuffer::before_read_range`].
    pub fn before_write_range(&self, stream: &CudaStream, range: Range<usize>) -> Result<()> {
        let span = self.span(&range)?;
        self.same_context(stream)?;
        self.uses.before(stream, true, span)
    }

    /// [`DeviceBuffer::after_read`] of elements `range`.
    ///
    /// # Errors
    /// As [`DeviceBuffer::before_read_range`].
    pub fn after_read_range(&self, stream: &CudaStream, range: Range<usize>) -> Result<()> {
        self.after_read_range_with(&UseMark::new(stream), range)
    }

    /// [`DeviceBuffer::after_write`] of elements `range`: it forgets the
    /// uses inside the range, which it was ordered after.
    ///
    /// # Errors
    /// As [`DeviceBuffer::before_read_range`].
    pub fn after_write_range(&self, stream: &CudaStream, range: Range<usize>) -> Result<()> {
        self.after_write_range_with(&UseMark::new(stream), range)
    }

    /// [`DeviceBuffer::after_read_range`] marked by `mark` (see
    /// [`UseMark`]).
    ///
    /// # Errors
    /// As [`DeviceBuffer::before_read_range`] and
    /// [`DeviceBuffer::after_read_with`].
    pub fn after_read_range_with(&self, mark: &UseMark<'_>, range: Range<usize>) -> Result<()> {
        let span = self.span(&range)?;
        self.after(mark, false, span)
    }

    /// [`DeviceBuffer::after_write_range`] marked by `mark` (see
    /// [`UseMark`]).
    ///
    /// # Errors
    /// As [`DeviceBuffer::after_read_range_with`].
    pub fn after_write_range_with(&self, mark: &UseMark<'_>, range: Range<usize>) -> Result<()> {
        let span = self.span(&range)?;
        self.after(mark, true, span)
    }

    /// Elements `range` as bytes, checked.
    fn span(&self, range: &Range<usize>) -> Result<Span> {
        if range.start > range.end || range.end > self.len() {
            return Err(Error::InvalidArgument(format!(
                "elements {}..{} are outside a buffer of {}",
                range.start,
                range.end,
                self.len()
            )));
        }
        let size = std::mem::size_of::<T>();
        Ok(range.start * size..range.end * size)
    }

    fn after(&self, mark: &UseMark<'_>, write: bool, span: Span) -> Result<()> {
        if crate::tracking::is_capture_stream(mark.stream()) {
            // Captured: each replay records the use (of the whole buffer)
            // instead.
            crate::tracking::log_use(&self.uses, write);
            return Ok(());
        }
        self.uses.record(mark, write, span)
    }
}

impl DeviceBuffer<u8> {
    /// Enqueues on `stream` a memset of the bytes `range` to `value`
    /// (`cuMemsetD8Async`), one driver call; an empty range enqueues
    /// nothing.
    ///
    /// # Ordering
    ///
    /// Ordered by `stream` alone, like a use through
    /// [`DeviceBuffer::as_cuda_slice_mut`]: the buffer's use events are
    /// neither waited for nor recorded here. The caller orders it as a
    /// write: [`DeviceBuffer::before_write`] before, and
    /// [`DeviceBuffer::after_write`] after (or later on the same stream,
    /// before anything else could depend on the buffer's events, as a
    /// batch that records a buffer's uses on one stream once does). A use
    /// that is never recorded is not waited for by the buffer's free.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `range` is not inside the buffer or
    /// `stream` is of another device (both checked before any driver call);
    /// the driver's error, naming `cuMemsetD8Async`.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// let dev = cuda_core::Device::new(0)?;
    /// let stream = dev.new_stream()?;
    /// let mut buf = cuda_core::DeviceBuffer::<u8>::zeros(&stream, 64)?;
    /// buf.before_write(&stream)?;
    /// buf.memset_unordered(16..32, 0xff, &stream)?;
    /// buf.after_write(&stream)?;
    /// # Ok::<(), cuda_core::Error>(())
    /// ```
    pub fn memset_unordered(
        &mut self,
        range: std::ops::Range<usize>,
        value: u8,
        stream: &CudaStream,
    ) -> Result<()> {
        check_range("memset", &range, self.len())?;
        self.same_context(stream)?;
        if range.is_empty() {
            return Ok(());
        }
        let (ptr, _write) = self.slice.device_ptr_mut(stream);
        // SAFETY: `ptr + range.start` addresses `range.len()` bytes inside
        // this live allocation (range checked above), of `stream`'s context
        // (checked above); `&mut self` keeps the allocation until the call
        // returns, and its free is ordered after the uses recorded in its
        // events (see `# Ordering`). Any byte pattern is a valid `u8`.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                ptr + range.start as u64,
                value,
                range.len(),
                stream.cu_stream(),
            )
        }
        .call("cuMemsetD8Async")
    }
}

impl<T: DeviceRepr> DeviceBuffer<T> {
    /// Enqueues on `stream` a copy of the whole buffer into a new buffer on
    /// `stream`'s device, which may be another device than this buffer's
    /// (a peer copy, `cuMemcpyPeerAsync`: direct over NVLink or PCIe where
    /// the devices can reach each other, staged by the driver where they
    /// cannot). Before the first copy between two devices that can reach
    /// each other it enables their peer access, once for the process
    /// ([`enable_peer_access`](crate::enable_peer_access); opt out with
    /// [`set_auto_peer_access`](crate::set_auto_peer_access)). Ordered by events on both devices: the copy waits for this
    /// buffer's last write (on any stream of its device), and later writes
    /// and the free of this buffer wait for the copy.
    ///
    /// # Errors
    /// Driver errors (allocation, the copy, ordering events), named;
    /// [`Error::PeerAccess`] if the driver refuses peer access between the
    /// two devices.
    pub fn copy_to(&self, stream: &Arc<CudaStream>) -> Result<DeviceBuffer<T>> {
        // SAFETY: fully written by the copy enqueued next.
        let mut dst = unsafe { DeviceBuffer::<T>::uninit(stream, self.len()) }?;
        if self.is_empty() {
            return Ok(dst);
        }
        let src_ctx = self.slice.stream().context();
        let (src_ptr, dst_ptr) = (
            self.slice.device_ptr(self.slice.stream()).0,
            dst.slice.device_ptr(stream).0,
        );
        crate::peer::before_peer_copy(src_ctx, src_ptr, stream.context(), dst_ptr)?;
        set_current(stream.context())?;
        // A wait on an event of another device's context is allowed.
        self.uses.before(stream, false, WHOLE)?;
        dst.before_write(stream)?;
        let copied = {
            let (src_ptr, _r) = self.slice.device_ptr(self.slice.stream());
            let (dst_ptr, _w) = dst.as_cuda_slice_mut().device_ptr_mut(stream);
            // SAFETY: both pointers address `num_bytes` bytes of live
            // allocations of their contexts (same length); the copy is
            // ordered after the source's last write (above) and recorded
            // below.
            unsafe {
                cudarc::driver::sys::cuMemcpyPeerAsync(
                    dst_ptr,
                    stream.context().cu_ctx(),
                    src_ptr,
                    src_ctx.cu_ctx(),
                    self.num_bytes(),
                    stream.cu_stream(),
                )
            }
        };
        copied
            .result()
            .map_err(|e| Error::driver("cuMemcpyPeerAsync", e))?;
        let mark = UseMark::new(stream);
        let read = self.uses.record(&mark, false, WHOLE);
        dst.after_write_with(&mark)?;
        read?;
        Ok(dst)
    }
}

impl<T> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        // SAFETY: dropped exactly once, here; the slice is not used again.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        let pool = self.pool.take();
        if Arc::strong_count(&self.uses) > 1 {
            // A graph still uses the memory: hand it over (as bytes) to the
            // shared record, which frees it after the graph's last replay.
            // (We hold `&mut self`, so no capture can take a new share now;
            // whichever of us and the graphs lets go last frees it.)
            let bytes = slice.num_bytes();
            let home = slice.stream().clone();
            let ptr = slice.leak();
            // SAFETY: `ptr` is the allocation of `bytes` bytes the slice
            // owned, on `home`'s context; nothing else owns it now.
            let bytes = unsafe { home.upgrade_device_ptr::<u8>(ptr, bytes) };
            self.uses.adopt(bytes, pool);
            return;
        }
        crate::tracking::free_ordered(&self.uses, slice, pool);
    }
}

/// Fails unless `range` lies inside a buffer of `len` bytes (checked before
/// any driver call); `what` names the operation.
pub(crate) fn check_range(what: &str, range: &std::ops::Range<usize>, len: usize) -> Result<()> {
    if range.start <= range.end && range.end <= len {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{what}: bytes {}..{} are outside a buffer of {len} bytes",
            range.start, range.end
        )))
    }
}

pub(crate) fn check_len<T>(len: usize) -> Result<usize> {
    len.checked_mul(std::mem::size_of::<T>())
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{len} elements of {} bytes overflow the address space",
                std::mem::size_of::<T>()
            ))
        })
}

/// Types for which every bit pattern is a valid value (integers, floats,
/// arrays of them). Bytes written by the GPU (a memset, a kernel, a copy)
/// can only be read on the host as such types: a `bool` holding `2` would
/// be undefined behaviour.
///
/// # Safety
/// Implement only for types with no padding, no invalid bit patterns and no
/// pointers or references (plain old data).
pub unsafe trait AnyBitPattern: DeviceRepr + Copy + Send + Sync + 'static {}

macro_rules! any_bit_pattern {
    ($($t:ty),*) => {$(
        // SAFETY: every bit pattern of this primitive is a valid value.
        unsafe impl AnyBitPattern for $t {}
    )*};
}
any_bit_pattern!(u8, i8, u16, i16, u32, i32, u64, i64, u128, i128, usize, isize, f32, f64);
// SAFETY: 16 bits with no padding; every bit pattern is a half-precision
// value (NaNs included).
#[cfg(feature = "half")]
unsafe impl AnyBitPattern for half::f16 {}
// SAFETY: as `f16`.
#[cfg(feature = "half")]
unsafe impl AnyBitPattern for half::bf16 {}
// SAFETY: an array of values with any bit pattern has any bit pattern.
unsafe impl<T: AnyBitPattern, const N: usize> AnyBitPattern for [T; N] {}

#[cfg(test)]
mod tests {
    use super::check_range;
    use crate::Error;

    #[test]
    fn ranges_outside_a_buffer_are_refused_before_any_driver_call() {
        assert!(check_range("memset", &(0..0), 0).is_ok());
        assert!(check_range("memset", &(0..16), 16).is_ok());
        assert!(check_range("memset", &(16..16), 16).is_ok());
        let reversed = std::ops::Range { start: 8, end: 4 };
        for bad in [0..17, 17..17, reversed, usize::MAX..usize::MAX] {
            let e = check_range("memset", &bad, 16).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
            assert!(e.to_string().contains("memset"), "{e}");
        }
    }
}
