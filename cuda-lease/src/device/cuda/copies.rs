//! Copies: host to device through the batch arena or pooled staging,
//! device to host, fills, and device to device.

use cuda_async::PinnedBuffer;
use cuda_core::cudarc::driver::{result, sys, DevicePtr, DevicePtrMut};

use super::staging::{BatchArena, ARENA_BYTES};
use super::CudaDevice;
use crate::device::error::{driver, map, not_found, range, same_buffer};
use crate::device::DeviceError;
use crate::proto::{Id, Status, StreamId};

impl CudaDevice {
    /// `len` bytes of the batch arena, or `None` when they do not fit
    /// (the caller takes the pooled path).
    fn arena_take(&mut self, len: usize) -> Result<Option<(usize, *mut u8)>, DeviceError> {
        if len > ARENA_BYTES / 4 {
            return Ok(None);
        }
        if self.arena.is_none() {
            self.arena = Some(BatchArena::new(&self.device)?);
        }
        Ok(self.arena.as_mut().and_then(|a| a.take(len)))
    }

    /// `Device::write` on this device: small writes staged in the batch
    /// arena, larger ones through `cuda-core`'s pooled staging.
    pub(super) fn enqueue_write(
        &mut self,
        stream: StreamId,
        id: Id,
        offset: u64,
        data: &[u8],
    ) -> Result<(), DeviceError> {
        let sid = stream;
        let stream = self.stream(stream)?;
        let r = range(self.buffer(id)?.len(), offset, data.len() as u64)?;
        if r.is_empty() {
            return Ok(());
        }
        if let Some((_, host)) = self.arena_take(r.len())? {
            // SAFETY: `host` addresses `r.len()` free bytes of the
            // arena (no copy uses them until the one below), and `data`
            // has as many; they cannot overlap.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), host, r.len()) };
            self.use_on(id, sid, &stream)?;
            let buf = Self::raw_mut(self.buffers.get_mut(&id).expect("checked above"));
            let (dptr, _w) = buf.as_cuda_slice_mut().device_ptr_mut(&stream);
            // SAFETY: `dptr + r.start` addresses `r.len()` bytes of a
            // live buffer (range checked), ordered after its other
            // uses (`use_on`); the arena bytes stay untouched until the
            // batch's end has waited for this copy.
            return unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    dptr + r.start as u64,
                    host.cast::<std::ffi::c_void>(),
                    r.len(),
                    stream.cu_stream(),
                )
            }
            .result()
            .map_err(|e| driver(Status::Internal, "cuMemcpyHtoDAsync", e));
        }
        self.flush_use(id)?;
        let buf = self
            .buffers
            .get_mut(&id)
            .ok_or_else(|| not_found("buffer", id))?;
        // Staged through pooled pinned memory: a host memcpy, then an
        // asynchronous copy; `data` is free once this returns.
        cuda_core::staging::upload_at(data, Self::raw_mut(buf), r.start, &stream)
            .map_err(|e| map(Status::BadRequest, "host-to-device copy", e))
    }

    /// `Device::read` on this device: small reads land in the batch arena,
    /// larger ones in a pooled `PinnedBuffer`; both are delivered at finish.
    pub(super) fn enqueue_read(
        &mut self,
        stream: StreamId,
        id: Id,
        offset: u64,
        len: u32,
        at: usize,
    ) -> Result<(), DeviceError> {
        let sid = stream;
        let stream = self.stream(stream)?;
        let r = range(self.buffer(id)?.len(), offset, u64::from(len))?;
        if r.is_empty() {
            return Ok(());
        }
        let st = Status::ReadFailed;
        if let Some((off, host)) = self.arena_take(r.len())? {
            self.use_on(id, sid, &stream)?;
            let dptr = {
                let buf = Self::raw(self.buffer(id)?);
                buf.as_cuda_slice().device_ptr(&stream).0
            };
            // SAFETY: `host` addresses `r.len()` free bytes of the
            // arena, read only after the batch's end waited for this
            // copy; `dptr + r.start` addresses `r.len()` bytes of a live
            // buffer (range checked), ordered after its writes.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    host.cast::<std::ffi::c_void>(),
                    dptr + r.start as u64,
                    r.len(),
                    stream.cu_stream(),
                )
            }
            .result()
            .map_err(|e| driver(st, "cuMemcpyDtoHAsync", e))?;
            self.arena_reads.push((at, off, r.len()));
            return Ok(());
        }
        self.flush_use(id)?;
        let buf = self.buffer(id)?;
        // SAFETY: the download below overwrites every byte before any
        // host access, which waits for it.
        let mut host = unsafe { PinnedBuffer::<u8>::uninit(&self.device, r.len()) }
            .map_err(|e| map(st, "pinned allocation", e))?;
        host.download_from(Self::raw(buf), r.start, &stream)
            .map_err(|e| map(st, "device-to-host copy", e))?;
        self.reads.push((host, at));
        Ok(())
    }

    /// `Device::fill` on this device: a memset ordered by the buffer.
    pub(super) fn enqueue_fill(
        &mut self,
        stream: StreamId,
        id: Id,
        offset: u64,
        len: u64,
        value: u8,
    ) -> Result<(), DeviceError> {
        let stream = self.stream(stream)?;
        self.flush_use(id)?;
        let buf = self
            .buffers
            .get_mut(&id)
            .ok_or_else(|| not_found("buffer", id))?;
        let r = range(buf.len(), offset, len)?;
        if r.is_empty() {
            return Ok(());
        }
        let st = Status::Internal;
        let buf = Self::raw_mut(buf);
        buf.before_write(&stream).map_err(|e| map(st, "fill", e))?;
        let filled = {
            let (ptr, _write) = buf.as_cuda_slice_mut().device_ptr_mut(&stream);
            // SAFETY: `ptr + r.start` addresses `r.len()` bytes inside
            // a live allocation (checked above); the buffer orders the
            // write against its other uses.
            unsafe {
                result::memset_d8_async(ptr + r.start as u64, value, r.len(), stream.cu_stream())
            }
        };
        let after = buf.after_write(&stream);
        filled.map_err(|e| driver(st, "cuMemsetD8Async", e))?;
        after.map_err(|e| map(st, "fill", e))
    }

    /// `Device::copy` on this device: a device-to-device copy ordered by
    /// both buffers.
    pub(super) fn enqueue_copy(
        &mut self,
        stream: StreamId,
        src: (Id, u64),
        dst: (Id, u64),
        len: u64,
    ) -> Result<(), DeviceError> {
        if src.0 == dst.0 {
            return Err(same_buffer());
        }
        let stream = self.stream(stream)?;
        self.flush_use(src.0)?;
        self.flush_use(dst.0)?;
        let rs = range(self.buffer(src.0)?.len(), src.1, len)?;
        let rd = range(self.buffer(dst.0)?.len(), dst.1, len)?;
        if rs.is_empty() {
            return Ok(());
        }
        // Out of the map while borrowed mutably next to the source.
        let mut to = self
            .buffers
            .remove(&dst.0)
            .ok_or_else(|| not_found("buffer", dst.0))?;
        let from = Self::raw(&self.buffers[&src.0]);
        let st = Status::Internal;
        let r = (|| {
            let to = Self::raw_mut(&mut to);
            from.before_read(&stream).map_err(|e| map(st, "copy", e))?;
            to.before_write(&stream).map_err(|e| map(st, "copy", e))?;
            let copied = stream.memcpy_dtod(
                &from.as_cuda_slice().slice(rs.clone()),
                &mut to.as_cuda_slice_mut().slice_mut(rd.clone()),
            );
            let read = from.after_read(&stream);
            let wrote = to.after_write(&stream);
            copied.map_err(|e| driver(st, "cuMemcpyDtoDAsync", e))?;
            read.map_err(|e| map(st, "copy", e))?;
            wrote.map_err(|e| map(st, "copy", e))
        })();
        self.buffers.insert(dst.0, to);
        r
    }
}
