//! Pinned (page-locked) host buffers that protect themselves while the GPU
//! uses them.
//!
//! A `PinnedBuffer` remembers the last stream work that reads or writes it
//! (an event). Host access waits for that work first, so a device-to-host
//! copy's destination is never visible before the DMA is done (invariant 3),
//! and dropping the buffer while a copy is in flight hands the free to the
//! reclaimer thread instead of freeing early or blocking the caller
//! (invariant 1).

use std::fmt;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DeviceRepr};

use crate::buffer::{check_len, AnyBitPattern, DeviceBuffer};
use crate::device::Device;
use crate::error::{DriverResultExt, Error, Result};
use crate::raw::{set_current, RawEvent};

/// A typed, page-locked, non-write-combined host buffer (fast to read back
/// from, usable by asynchronous copies in both directions).
pub struct PinnedBuffer<T> {
    ptr: NonNull<T>,
    len: usize,
    ctx: Arc<CudaContext>,
    /// Recorded after the last stream work that touches the memory.
    last_use: Option<RawEvent>,
    /// Set once `last_use` is known to be complete.
    idle: AtomicBool,
    /// Set when a GPU use could not be recorded: the buffer can no longer
    /// tell when the GPU is done with it, so host access fails and the
    /// memory is leaked, never freed.
    broken: AtomicBool,
    /// Capacity of the pooled pinned block behind `ptr` (0 for none).
    block_bytes: usize,
    _marker: PhantomData<T>,
}

// SAFETY: a `PinnedBuffer<T>` owns its allocation like a `Box<[T]>` does;
// moving it to another thread moves `T`s, so it is `Send` when `T` is. The
// context handle and event are `Send + Sync` in cudarc.
unsafe impl<T: Send> Send for PinnedBuffer<T> {}
// SAFETY: `&PinnedBuffer<T>` only gives out `&[T]` (after waiting for the
// GPU) and touches `idle` atomically, so sharing it is sharing `&[T]`.
unsafe impl<T: Sync> Sync for PinnedBuffer<T> {}

impl<T> fmt::Debug for PinnedBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("type", &std::any::type_name::<T>())
            .field("len", &self.len)
            .field("idle", &self.idle.load(Ordering::Relaxed))
            .finish()
    }
}

impl<T: DeviceRepr + Copy> PinnedBuffer<T> {
    /// Allocates `len` elements of pinned memory, filled with `value`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the size overflows; a driver error
    /// naming `cuMemHostAlloc` if the allocation fails.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// let dev = cuda_core::Device::new(0)?;
    /// let mut b = cuda_core::PinnedBuffer::filled(&dev, 4, 1.5f32)?;
    /// b.as_mut_slice()?[0] = 2.0;
    /// assert_eq!(b.as_slice()?, &[2.0, 1.5, 1.5, 1.5]);
    /// # Ok::<(), cuda_core::Error>(())
    /// ```
    pub fn filled(device: &Device, len: usize, value: T) -> Result<Self> {
        let mut b = Self::alloc(device, len)?;
        let p = b.ptr.as_ptr();
        for i in 0..len {
            // SAFETY: `i < len` and the allocation holds `len` `T`s; writing
            // (not assigning) never reads or drops the uninitialised old value.
            unsafe { p.add(i).write(value) };
        }
        b.idle = AtomicBool::new(true);
        Ok(b)
    }

    /// Copies `data` into a new pinned buffer.
    ///
    /// # Errors
    /// As [`PinnedBuffer::filled`].
    pub fn from_slice(device: &Device, data: &[T]) -> Result<Self> {
        let b = Self::alloc(device, data.len())?;
        // SAFETY: the new allocation holds `data.len()` `T`s and cannot
        // overlap `data`; `T: Copy`.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), b.ptr.as_ptr(), data.len()) };
        Ok(b)
    }

    /// Allocates `len` elements without initialising them.
    ///
    /// # Errors
    /// As [`PinnedBuffer::filled`].
    ///
    /// # Safety
    /// The contents are uninitialised: before any host access, the caller
    /// fully overwrites the buffer (e.g. with a device-to-host copy whose use
    /// it records with [`PinnedBuffer::record_use`], which host access then
    /// waits for).
    pub unsafe fn uninit(device: &Device, len: usize) -> Result<Self> {
        Self::alloc(device, len)
    }

    fn alloc(device: &Device, len: usize) -> Result<Self> {
        crate::device::require_driver()?;
        let bytes = check_len::<T>(len)?;
        let ctx = device.context().clone();
        // Page-locked, not write-combined (flags 0), from the per-device pool
        // of pinned blocks (allocating page-locked memory is slow; blocks are
        // page-aligned, so any `T` fits).
        let (ptr, block_bytes) = if bytes == 0 {
            (NonNull::dangling(), 0)
        } else {
            let (addr, cap) = crate::staging::take_block(&ctx, bytes)?;
            let p = NonNull::new(addr as *mut T)
                .ok_or_else(|| Error::InvalidArgument("cuMemHostAlloc returned null".into()))?;
            (p, cap)
        };
        Ok(PinnedBuffer {
            ptr,
            len,
            ctx,
            last_use: None,
            idle: AtomicBool::new(true),
            broken: AtomicBool::new(false),
            block_bytes,
            _marker: PhantomData,
        })
    }
}

impl<T> PinnedBuffer<T> {
    /// The memory, with no wait (for a captured use, which the caller
    /// orders at each replay).
    pub(crate) fn raw_ptr(&self) -> *mut T {
        self.ptr.as_ptr()
    }

    /// The context the memory is pinned in.
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether no GPU work on this buffer is pending (queries the driver at
    /// most until it first says so).
    ///
    /// # Errors
    /// The sticky error, if the GPU faulted before finishing the work.
    pub fn is_idle(&self) -> Result<bool> {
        if self.broken.load(Ordering::Acquire) {
            return Err(Error::InvalidArgument(
                "a GPU use of this pinned buffer could not be recorded; its contents are \
                 unavailable"
                    .into(),
            ));
        }
        if self.idle.load(Ordering::Acquire) {
            return Ok(true);
        }
        let Some(ev) = &self.last_use else {
            return Ok(true);
        };
        match ev.query() {
            Ok(true) => {
                self.idle.store(true, Ordering::Release);
                Ok(true)
            }
            Ok(false) => Ok(false),
            Err(e) => Err(Error::driver("cuEventQuery", e)),
        }
    }

    /// Blocks the calling thread until GPU work on this buffer is done.
    ///
    /// # Errors
    /// The sticky error, if the GPU faulted before finishing the work.
    pub fn wait_idle(&self) -> Result<()> {
        if self.is_idle()? {
            return Ok(());
        }
        if let Some(ev) = &self.last_use {
            ev.synchronize().call("cuEventSynchronize")?;
        }
        self.idle.store(true, Ordering::Release);
        Ok(())
    }

    /// The contents, once pending GPU work on them is done (waits for it if
    /// needed; after a completed future that is one cheap query, then none).
    ///
    /// # Errors
    /// The sticky error, if the copy into this buffer faulted.
    pub fn as_slice(&self) -> Result<&[T]> {
        self.wait_idle()?;
        // SAFETY: the GPU no longer touches the memory (waited above); it
        // holds `len` initialised `T`s (filled at construction or written by
        // completed copies of `T`s).
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) })
    }

    /// The contents, mutably; waits as [`PinnedBuffer::as_slice`] does.
    ///
    /// # Errors
    /// As [`PinnedBuffer::as_slice`].
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.wait_idle()?;
        // SAFETY: as in `as_slice`, and `&mut self` makes the access unique.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) })
    }

    /// Copies the contents into a `Vec` (waiting as `as_slice` does).
    ///
    /// # Errors
    /// As [`PinnedBuffer::as_slice`].
    pub fn to_vec(&self) -> Result<Vec<T>>
    where
        T: Clone,
    {
        Ok(self.as_slice()?.to_vec())
    }

    /// Prepares the buffer for an asynchronous copy on `stream`: returns the
    /// raw pointer, after making `stream` wait for earlier GPU work on it.
    /// Call [`PinnedBuffer::record_use`] right after enqueuing the copy.
    ///
    /// # Errors
    /// A driver error from `cuStreamWaitEvent`; [`Error::Capture`] while
    /// `stream` is capturing a graph (a pinned buffer's host access waits
    /// for one completion, which a replayed copy does not have).
    ///
    /// # Safety
    /// The caller enqueues work that accesses at most `len` elements through
    /// the pointer, only on `stream`, and calls `record_use(stream)` after it
    /// before any other use of the buffer.
    pub unsafe fn begin_use(&mut self, stream: &CudaStream) -> Result<*mut T> {
        crate::raw::check_same_context("a pinned buffer", &self.ctx, stream)?;
        if self.broken.load(Ordering::Acquire) {
            return Err(Error::InvalidArgument(
                "a GPU use of this pinned buffer could not be recorded earlier".into(),
            ));
        }
        if crate::tracking::is_capture_stream(stream) {
            return Err(Error::Capture(
                "a copy between a device buffer and a PinnedBuffer (d2h, copy_d2h, copy_h2d) \
                 cannot be captured: share the buffer with the graph (PinnedBuffer::into_shared) \
                 for a copy that acts at each replay"
                    .into(),
            ));
        }
        if let Some(ev) = &self.last_use {
            if !self.idle.load(Ordering::Acquire) {
                ev.wait_on(stream).call("cuStreamWaitEvent")?;
            }
        }
        Ok(self.ptr.as_ptr())
    }

    /// Records that work enqueued on `stream` uses the buffer; host access
    /// and drop will wait for it.
    ///
    /// # Errors
    /// A driver error from `cuEventCreate` or `cuEventRecord`. On error the
    /// buffer marks itself broken: host access fails from then on and the
    /// memory is leaked rather than freed while the GPU might still use it.
    pub fn record_use(&mut self, stream: &CudaStream) -> Result<()> {
        self.idle.store(false, Ordering::Release);
        let r = (|| {
            if self.last_use.is_none() {
                self.last_use = Some(RawEvent::new(&self.ctx)?);
            }
            match &self.last_use {
                Some(ev) => ev.record(stream),
                None => Ok(()),
            }
        })();
        if r.is_err() {
            self.broken.store(true, Ordering::Release);
        }
        r
    }
}

impl<T: AnyBitPattern> PinnedBuffer<T> {
    /// Enqueues on `stream` a copy of `src[offset..offset + self.len()]`
    /// (in elements) into this buffer: ordered after `src`'s writes that
    /// overlap the range and
    /// this buffer's earlier GPU uses, recorded as a read of `src` and a use
    /// of this buffer, so host access waits for it. Does not wait itself.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the range is outside `src`, or either
    /// buffer is on another device than `stream`; a driver error, named.
    pub fn download_from(
        &mut self,
        src: &DeviceBuffer<T>,
        offset: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        let in_range = offset
            .checked_add(self.len)
            .is_some_and(|end| end <= src.len());
        if !in_range {
            return Err(Error::InvalidArgument(format!(
                "device-to-host copy: {} elements at offset {offset} are outside a buffer of {}",
                self.len,
                src.len()
            )));
        }
        if self.len == 0 {
            return Ok(());
        }
        set_current(stream.context())?;
        let range = offset..offset + self.len;
        src.before_read_range(stream, range.clone())?;
        // SAFETY: the copy below writes exactly `self.len` elements on
        // `stream`, and `record_use` follows it.
        let host = unsafe { self.begin_use(stream) }?;
        let copied = {
            // (cudarc's own tracking too: waits for its last write, records
            // a read when dropped.)
            let (dptr, _read) = src.as_cuda_slice().device_ptr(stream);
            let dptr = dptr + (offset * std::mem::size_of::<T>()) as u64;
            let bytes = self.len * std::mem::size_of::<T>();
            // SAFETY: `host` points to `self.len` pinned elements that
            // nothing else touches until the recorded use completes; `dptr`
            // addresses as many inside `src` (range checked above); `T`
            // accepts any bit pattern, so whatever the GPU wrote is a valid
            // `T`.
            unsafe { crate::copy::dtoh_async(host.cast::<u8>(), dptr, bytes, stream) }
        };
        let read = src.after_read_range(stream, range);
        self.record_use(stream)?;
        copied.and(read)
    }
}

impl<T> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        if self.block_bytes == 0 {
            return;
        }
        let ptr = self.ptr.as_ptr() as usize;
        let bytes = self.block_bytes;
        let ctx = self.ctx.clone();
        // Back to the pool (or freed past its limit) once no GPU work uses it.
        let free = move || crate::staging::give_back_block(&ctx, ptr, bytes);
        // This always happens on the reclaimer thread: `cuMemFreeHost` may
        // synchronize the device, which must never stall the dropping thread
        // (an async executor's worker, say).
        match self.is_idle() {
            Ok(true) => crate::reclaim::defer(free),
            // In flight: free once the GPU is done with it.
            Ok(false) => {
                let ev = self.last_use.take().expect("busy implies an event");
                // Freed once the copy is done; leaked if the context faulted.
                crate::reclaim::defer_until(move || ev.readiness(), free);
            }
            // The GPU faulted while it might have been using the memory: leak.
            Err(_) => {}
        }
    }
}
