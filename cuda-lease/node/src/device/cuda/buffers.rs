//! A worker's buffers: the `cuda-core` buffer under each, and their uses
//! ordered across streams with deferred use records.

use cuda_async::{CudaStream, DeviceBuffer};

use super::CudaDevice;
use crate::device::error::{check_fresh, map, not_found};
use crate::device::DeviceError;
use crate::proto::{Id, Status, StreamId};

impl CudaDevice {
    /// A node's buffers are all local: the `cuda-core` buffer under one.
    pub(super) fn raw(b: &DeviceBuffer<u8>) -> &cuda_core::DeviceBuffer<u8> {
        b.local().expect("a node's buffers are local")
    }

    pub(super) fn raw_mut(b: &mut DeviceBuffer<u8>) -> &mut cuda_core::DeviceBuffer<u8> {
        b.local_mut().expect("a node's buffers are local")
    }

    pub(super) fn buffer(&self, id: Id) -> Result<&DeviceBuffer<u8>, DeviceError> {
        self.buffers.get(&id).ok_or_else(|| not_found("buffer", id))
    }

    /// Records the deferred uses of buffer `id` (if any) in its use events, on
    /// the stream they were enqueued on.
    ///
    /// A buffer's uses on one stream are ordered by the stream, so they are
    /// marked pending and recorded once, before anything could depend on the
    /// events: a use on another stream, a copy, read, write or fill (which
    /// order themselves by those events), the free, or the batch's end. A later
    /// record on the same stream covers every earlier use: a wait may wait for
    /// more of that stream than needed, never less.
    ///
    /// The record is not work the batch's end waits for: the use it marks
    /// is of this batch (its stream is touched already) or of an earlier
    /// one, whose own end covers it.
    pub(super) fn flush_use(&mut self, id: Id) -> Result<(), DeviceError> {
        let Some(s) = self.pending.remove(&id) else {
            return Ok(());
        };
        let (Some(stream), Some(buf)) = (self.streams.get(&s), self.buffers.get(&id)) else {
            return Ok(());
        };
        Self::raw(buf)
            .after_write(stream)
            .map_err(|e| map(Status::Internal, "recording a buffer's use", e))
    }

    /// Orders a use of buffer `id` on `stream` after its uses elsewhere,
    /// and marks it pending there (see [`CudaDevice::flush_use`]).
    pub(super) fn use_on(
        &mut self,
        id: Id,
        stream: StreamId,
        s: &CudaStream,
    ) -> Result<(), DeviceError> {
        if self.pending.get(&id) == Some(&stream) {
            // Same stream: ordered by the stream.
            return Ok(());
        }
        self.flush_use(id)?;
        Self::raw(self.buffer(id)?)
            .before_write(s)
            .map_err(|e| map(Status::Internal, "ordering a buffer's use", e))?;
        self.pending.insert(id, stream);
        Ok(())
    }

    /// Allocates `size` bytes as buffer `id` on `stream`: a recycled
    /// buffer of that size if one is spare, else a new one; zeroed if
    /// `zero`, else left for the write of all of them that the caller
    /// enqueues next on `stream` (see `LeaseDevice::alloc_overwritten`).
    pub(super) fn alloc_buffer(
        &mut self,
        stream: StreamId,
        id: Id,
        size: u64,
        zero: bool,
    ) -> Result<(), DeviceError> {
        let taken = self.buffers.contains_key(&id) || self.events.contains_key(&id);
        check_fresh(taken, id)?;
        let sid = stream;
        let stream = self.stream(stream)?;
        let n = usize::try_from(size)
            .map_err(|_| DeviceError::new(Status::CapacityExceeded, "size too large"))?;
        if n == 0 {
            let buf = cuda_core::DeviceBuffer::<u8>::zeros(&stream, n)
                .map_err(|e| map(Status::CapacityExceeded, "cuMemAllocAsync", e))?;
            self.buffers.insert(id, buf.into());
            return Ok(());
        }
        match self.spare.take(n) {
            // A freed buffer of this size: its memset (or the write
            // that replaces it) waits for its earlier uses like any
            // other use (`use_on`).
            Some(buf) => {
                self.buffers.insert(id, buf);
                self.use_on(id, sid, &stream)?;
            }
            None => {
                // SAFETY: the memset below, or else the write of every
                // byte that the caller enqueues next on the allocating
                // stream (zeroing it if that fails), writes every byte
                // before anything else can use the buffer (later commands
                // on this stream follow it; other streams wait for the
                // use `flush_use` records).
                let buf = unsafe { cuda_core::DeviceBuffer::<u8>::uninit(&stream, n) }
                    .map_err(|e| map(Status::CapacityExceeded, "cuMemAllocAsync", e))?;
                self.buffers.insert(id, buf.into());
                // Pending even if the memset fails: recorded (or the
                // buffer leaked) like any other use before it is freed.
                self.pending.insert(id, sid);
            }
        }
        if !zero {
            return Ok(());
        }
        let buf = Self::raw_mut(self.buffers.get_mut(&id).expect("inserted above"));
        // All `n` bytes, ordered after the buffer's earlier uses (a
        // recycled buffer) or its allocation on this stream.
        buf.memset_unordered(0..n, 0, &stream)
            .map_err(|e| map(Status::Internal, "cuMemsetD8Async", e))
    }
}
