//! The memory primitives of an execution context: allocate, upload,
//! download, copy and fill. Each runs on the local stream or is recorded
//! by the remote backend; the ops in [`crate::memory`] only call them.

use std::ops::Range;
use std::sync::Arc;

use cuda_core::copy;
use cuda_core::cudarc::driver::{CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits};
use cuda_core::{AnyBitPattern, Error, PinnedBuffer, Result};

use super::ExecutionContext;
use crate::buffer::DeviceBuffer;
use crate::host::HostBuffer;
use crate::memory::{byte_range, HostSource};
use crate::pinned_host::PinnedHost;

fn same_len(what: &str, a: usize, b: usize) -> Result<()> {
    if a == b {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{what}: source has {a} elements, destination {b}"
        )))
    }
}

impl ExecutionContext {
    fn bind(&self) -> Result<()> {
        self.device()?
            .context()
            .bind_to_thread()
            .map_err(|e| Error::driver("cuCtxSetCurrent", e))
    }

    /// `len` zeroed elements (stream-ordered).
    pub(crate) fn alloc_zeroed<T: DeviceRepr + ValidAsZeroBits>(
        &mut self,
        len: usize,
    ) -> Result<DeviceBuffer<T>> {
        if let Some(r) = self.as_remote() {
            return r.alloc(len);
        }
        DeviceBuffer::zeros_local(self.cuda_stream()?, len)
    }

    /// `len` elements whose contents the caller overwrites before any
    /// other use (remotely: zeroed, as every remote allocation is).
    ///
    /// # Safety
    /// Every element is written by work enqueued next on this context,
    /// before the buffer is read.
    pub(crate) unsafe fn alloc_uninit<T: DeviceRepr>(
        &mut self,
        len: usize,
    ) -> Result<DeviceBuffer<T>> {
        if let Some(r) = self.as_remote() {
            return r.alloc(len);
        }
        let stream = self.cuda_stream()?;
        // SAFETY: the caller's contract: fully written before it is read.
        Ok(unsafe { cuda_core::DeviceBuffer::<T>::uninit(stream, len) }?.into())
    }

    /// A new buffer holding `src`'s elements. Locally through pinned
    /// staging (never blocks on the stream; `src` is free once this
    /// returns); remotely the bytes ride with the submission (owned data
    /// kept as it is, borrowed data copied).
    pub(crate) fn upload<T: DeviceRepr + Copy, S: HostSource<T>>(
        &mut self,
        src: S,
    ) -> Result<DeviceBuffer<T>> {
        if let Some(r) = self.as_remote() {
            return r.upload(src);
        }
        let src = src.host_slice();
        let stream = self.cuda_stream()?;
        // SAFETY: every element is written by the copy enqueued next, before
        // any later work on the buffer (its recorded write orders them).
        let mut dst = unsafe { cuda_core::DeviceBuffer::<T>::uninit(stream, src.len()) }?;
        cuda_core::staging::upload(src, &mut dst, stream)?;
        Ok(dst.into())
    }

    /// Writes `values` into `dst` from element `at` on, through a pooled
    /// pinned staging block (remotely: in the submission's message); `op`
    /// names the caller for a context that cannot run it.
    pub(crate) fn write_elems<T: DeviceRepr + Copy>(
        &mut self,
        op: &str,
        dst: &mut DeviceBuffer<T>,
        at: usize,
        values: &[T],
    ) -> Result<()> {
        if let Some(r) = self.as_remote() {
            return r.write_elems(dst, at, values);
        }
        let stream = self.cuda_stream_for(op)?;
        let dst = dst.local_mut_on(stream)?;
        cuda_core::staging::upload_at(values, dst, at, stream)
    }

    /// Elements `range` of `src` in a new host buffer: pinned memory
    /// locally, reachable once the copy is done; remotely the reply's
    /// bytes, received straight into it.
    pub(crate) fn download<T: AnyBitPattern>(
        &mut self,
        src: &DeviceBuffer<T>,
        range: Range<usize>,
    ) -> Result<HostBuffer<T>> {
        if let Some(r) = self.as_remote() {
            return r.download(src, range);
        }
        // SAFETY: the copy enqueued next overwrites every element, and host
        // access to the buffer waits for that copy (its recorded use).
        let mut dst = unsafe { PinnedBuffer::uninit(self.device()?, range.len()) }?;
        self.enqueue_d2h(src, range, &mut dst)?;
        Ok(dst.into())
    }

    /// Downloads elements `range` of `src` into `dst` (of the same length,
    /// checked), ordered after `src`'s overlapping writes.
    pub(crate) fn download_into<T: AnyBitPattern, H: PinnedHost<T>>(
        &mut self,
        src: &DeviceBuffer<T>,
        range: Range<usize>,
        dst: &mut H,
    ) -> Result<()> {
        same_len("device-to-host copy", range.len(), dst.host_len())?;
        if let Some(r) = self.as_remote() {
            return r.download_into(src, range, dst);
        }
        self.enqueue_d2h(src, range, dst)
    }

    /// Enqueues the download of elements `range` of `src` into `dst`,
    /// recorded as a read of them and a use of `dst`.
    fn enqueue_d2h<T: AnyBitPattern, H: PinnedHost<T>>(
        &self,
        src: &DeviceBuffer<T>,
        range: Range<usize>,
        dst: &mut H,
    ) -> Result<()> {
        same_len("device-to-host copy", range.len(), dst.host_len())?;
        if range.is_empty() {
            return Ok(());
        }
        let stream = self.cuda_stream()?;
        self.bind()?;
        let src = src.local_on(stream)?;
        src.before_read_range(stream, range.clone())?;
        let (at, bytes) = byte_range::<T>(&range);
        let mut copy = |host: *mut T| {
            // (cudarc's own tracking sees a read too.)
            let (dptr, _use) = src.as_cuda_slice().device_ptr(stream);
            // SAFETY: `host` addresses `range.len()` pinned elements that no
            // host code touches until the recorded use is done; `dptr + at`
            // as many inside `src`; `T` accepts any bits.
            unsafe { copy::dtoh_async(host.cast::<u8>(), dptr + at, bytes as usize, stream) }
        };
        // SAFETY: the copy writes `range.len()` elements on `stream`.
        let copied = unsafe { dst.enqueue_use(stream, true, &mut copy) };
        let read = src.after_read_range(stream, range);
        copied.and(read)
    }

    /// Uploads `src` (pinned memory, of the same length, checked) into
    /// elements `range` of `dst`, ordered after the uses it conflicts with.
    pub(crate) fn upload_from<T: DeviceRepr, H: PinnedHost<T>>(
        &mut self,
        src: &mut H,
        dst: &DeviceBuffer<T>,
        range: Range<usize>,
    ) -> Result<()> {
        same_len("host-to-device copy", src.host_len(), range.len())?;
        if let Some(r) = self.as_remote() {
            return r.upload_from(src, dst, range);
        }
        if range.is_empty() {
            return Ok(());
        }
        let (at, bytes) = byte_range::<T>(&range);
        let stream = self.cuda_stream()?;
        self.bind()?;
        let dst = dst.local_on(stream)?;
        dst.before_write_range(stream, range.clone())?;
        let mut copy = |host: *mut T| {
            // (cudarc's own tracking sees a read: ours records the write.)
            let (dptr, _use) = dst.as_cuda_slice().device_ptr(stream);
            // SAFETY: `host` holds `range.len()` initialised pinned elements
            // that host code cannot mutate until the recorded use completes;
            // `dptr + at` addresses as many inside the buffer (`range` lies
            // inside it), held exclusively by the op; live stream.
            unsafe { copy::htod_async(dptr + at, host.cast::<u8>(), bytes as usize, stream) }
        };
        // SAFETY: the copy reads `range.len()` elements on `stream`.
        let copied = unsafe { src.enqueue_use(stream, false, &mut copy) };
        let written = dst.after_write_range(stream, range);
        copied.and(written)
    }

    /// Copies elements `from` of `src` into elements `to` of `dst` (of the
    /// same length, checked), ordered after the uses it conflicts with and
    /// recorded as a read of `from` and a write of `to`.
    pub(crate) fn copy<T>(
        &mut self,
        src: &DeviceBuffer<T>,
        from: Range<usize>,
        dst: &DeviceBuffer<T>,
        to: Range<usize>,
    ) -> Result<()> {
        same_len("device-to-device copy", from.len(), to.len())?;
        if let Some(r) = self.as_remote() {
            return r.copy(src, from, dst, to);
        }
        let ((src_at, bytes), (dst_at, _)) = (byte_range::<T>(&from), byte_range::<T>(&to));
        let stream: &Arc<CudaStream> = self.cuda_stream()?;
        let (src, dst) = (src.local_on(stream)?, dst.local_on(stream)?);
        if bytes == 0 {
            return Ok(());
        }
        src.before_read_range(stream, from.clone())?;
        dst.before_write_range(stream, to.clone())?;
        {
            let (sptr, _read) = src.as_cuda_slice().device_ptr(stream);
            // (cudarc's own tracking sees a read: ours records the write.)
            let (dptr, _use) = dst.as_cuda_slice().device_ptr(stream);
            // SAFETY: both ranges lie inside their buffers (checked by the
            // range calls above), the destination's held exclusively by the
            // op; a live stream.
            unsafe { copy::dtod_async(dptr + dst_at, sptr + src_at, bytes as usize, stream) }?;
        }
        // One event after the copy marks both uses.
        let mark = cuda_core::UseMark::new(stream);
        let read = src.after_read_range_with(&mark, from);
        dst.after_write_range_with(&mark, to)?;
        read
    }

    /// Sets every byte of elements `range` of `buf` to `byte`.
    pub(crate) fn fill<T>(
        &mut self,
        buf: &DeviceBuffer<T>,
        range: Range<usize>,
        byte: u8,
    ) -> Result<()> {
        if let Some(r) = self.as_remote() {
            return r.fill(buf, range, byte);
        }
        let (at, bytes) = byte_range::<T>(&range);
        let stream = self.cuda_stream()?;
        self.bind()?;
        if bytes == 0 {
            return Ok(());
        }
        let buf = buf.local_on(stream)?;
        buf.before_write_range(stream, range.clone())?;
        {
            // (cudarc's own tracking sees a read: ours records the write.)
            let (dptr, _use) = buf.as_cuda_slice().device_ptr(stream);
            // SAFETY: `dptr + at` addresses `bytes` bytes of a live
            // allocation (`range` lies inside the buffer), which the op
            // holds exclusively (an owned buffer, `&mut` or a writable view).
            unsafe { copy::memset_d8_async(dptr + at, byte, bytes as usize, stream) }?;
        }
        buf.after_write_range(stream, range)
    }
}
