//! Copies: host to device through the batch arena or pooled staging,
//! device to host, fills, and device to device.

use cuda_async::PinnedBuffer;
use cuda_core::ArenaSlot;

use super::staging::{new_arena, ARENA_BYTES};
use super::CudaDevice;
use crate::device::error::{driver, map, not_found, range, same_buffer};
use crate::device::DeviceError;
use crate::proto::{Id, Status, StreamId};

impl CudaDevice {
    /// `len` bytes of the batch arena, or `None` when they do not fit
    /// (the caller takes the pooled path).
    fn arena_take(&mut self, len: usize) -> Result<Option<ArenaSlot>, DeviceError> {
        if len > ARENA_BYTES / 4 || self.capturing {
            return Ok(None);
        }
        if self.arena.is_none() {
            self.arena = Some(new_arena(&self.device)?);
        }
        Ok(self.arena.as_mut().and_then(|a| a.reserve(len)))
    }

    /// `LeaseDevice::write` on this device: small writes staged in the batch
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
        if let Some(slot) = self.arena_take(r.len())? {
            self.use_on(id, sid, &stream)?;
            let buf = Self::raw_mut(self.buffers.get_mut(&id).expect("checked above"));
            let arena = self.arena.as_mut().expect("made by arena_take");
            // A host memcpy into the arena, then an asynchronous copy of
            // `r.len()` bytes into the buffer at `r.start` (range checked),
            // ordered after its other uses (`use_on`); the arena's bytes
            // stay untouched until the batch's end has waited for it.
            return arena
                .upload(slot, data, buf, r.start, &stream)
                .map_err(|e| map(Status::Internal, "cuMemcpyHtoDAsync", e));
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

    /// `LeaseDevice::read` on this device: small reads land in the batch arena,
    /// larger ones in a pooled `PinnedBuffer`; both are delivered at finish.
    pub(super) fn enqueue_read(
        &mut self,
        stream: StreamId,
        id: Id,
        offset: u64,
        len: u64,
        at: usize,
    ) -> Result<(), DeviceError> {
        let sid = stream;
        let stream = self.stream(stream)?;
        let r = range(self.buffer(id)?.len(), offset, len)?;
        if r.is_empty() {
            return Ok(());
        }
        let st = Status::ReadFailed;
        if let Some(slot) = self.arena_take(r.len())? {
            self.use_on(id, sid, &stream)?;
            let buf = self
                .buffers
                .get(&id)
                .ok_or_else(|| not_found("buffer", id))?;
            let arena = self.arena.as_mut().expect("made by arena_take");
            // `r.len()` bytes of the buffer at `r.start` (range checked),
            // ordered after its writes (`use_on`), into the arena, read
            // only after the batch's end waited for the copy.
            let read = arena
                .download(slot, Self::raw(buf), r.start, &stream)
                .map_err(|e| map(st, "cuMemcpyDtoHAsync", e))?;
            self.arena_reads.push((at, read));
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

    /// `LeaseDevice::fill` on this device: a memset ordered by the buffer.
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
        // `r` is inside the buffer (checked above); the buffer orders the
        // write against its other uses.
        let filled = buf.memset_unordered(r.clone(), value, &stream);
        let after = buf.after_write(&stream);
        filled.map_err(|e| map(st, "cuMemsetD8Async", e))?;
        after.map_err(|e| map(st, "fill", e))
    }

    /// `LeaseDevice::copy` on this device: a device-to-device copy ordered by
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
