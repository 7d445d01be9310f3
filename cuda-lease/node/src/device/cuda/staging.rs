//! Where a batch's copies are staged: the page-locked batch arena, and the
//! freed buffers kept for the next batch.

use std::collections::HashMap;

use cuda_async::DeviceBuffer;
use cuda_core::{ArenaSlot, StagingArena};

use super::CudaDevice;
use crate::device::error::map;
use crate::device::DeviceError;
use crate::proto::Status;

/// Page-locked bytes a worker stages a batch's small writes and reads in.
pub(super) const ARENA_BYTES: usize = 1 << 20;

/// Page-locked memory for a batch's small writes and reads: a `cuda-core`
/// [`StagingArena`], handed out front to back, skipping per copy a pool
/// lookup, an event and a hand-off to the reclaimer thread; what does not
/// fit takes the pooled path (`cuda-core`'s staging and `PinnedBuffer`s).
///
/// Its copies are recorded in no event: its ranges are reused, and its
/// downloads read, only after a wait for every stream its copies ran on
/// (the arena makes it, see `sync_touched`); an arena whose wait failed is
/// leaked.
pub(super) fn new_arena(device: &cuda_async::Device) -> Result<StagingArena, DeviceError> {
    StagingArena::new(device, ARENA_BYTES)
        .map_err(|e| map(Status::Internal, "pinned allocation", e))
}

/// Most bytes of freed buffers a worker keeps for reuse, and the largest
/// buffer it keeps: like the memory pool's release threshold, outside
/// any lease's reservation and covered by the node's headroom.
const SPARE_BYTES: usize = 8 << 20;
const SPARE_BUFFER_MAX: usize = 1 << 20;

/// Freed buffers of up to [`SPARE_BUFFER_MAX`] bytes, [`SPARE_BYTES`] in
/// all, by size: handing one out again skips `cuMemAllocAsync` and
/// `cuMemFreeAsync` for the small sizes a chain allocates every batch.
///
/// A buffer freed in a batch is handed out only from the next batch on,
/// once the batch's end has waited for its uses: reused in the same batch,
/// its new owner on another stream would wait for its old uses, serializing
/// streams that ran concurrently.
#[derive(Debug, Default)]
pub(super) struct SpareBuffers {
    by_len: HashMap<usize, Vec<DeviceBuffer<u8>>>,
    /// Freed in this batch; their uses may still be running.
    freed: Vec<DeviceBuffer<u8>>,
    bytes: usize,
}

impl SpareBuffers {
    pub(super) fn take(&mut self, len: usize) -> Option<DeviceBuffer<u8>> {
        let b = self.by_len.get_mut(&len)?.pop()?;
        self.bytes -= len;
        Some(b)
    }

    /// Keeps `buf` if there is room; else drops it (a stream-ordered
    /// free after its uses).
    pub(super) fn keep(&mut self, buf: DeviceBuffer<u8>) {
        let len = buf.len();
        if len == 0 || len > SPARE_BUFFER_MAX || self.bytes + len > SPARE_BYTES {
            return;
        }
        self.bytes += len;
        self.freed.push(buf);
    }

    /// At the end of a batch: with every use done (`done`), this
    /// batch's frees can be handed out; else they are dropped (each a
    /// free ordered after its recorded uses, or leaked).
    pub(super) fn settle(&mut self, done: bool) {
        let freed = self.take_freed();
        self.settle_these(freed, done);
    }

    /// This batch's frees, for [`SpareBuffers::settle_these`] once the
    /// batch (sealed, running on) is done.
    pub(super) fn take_freed(&mut self) -> Vec<DeviceBuffer<u8>> {
        std::mem::take(&mut self.freed)
    }

    /// [`SpareBuffers::settle`] for frees taken from a batch earlier.
    pub(super) fn settle_these(&mut self, freed: Vec<DeviceBuffer<u8>>, done: bool) {
        for b in freed {
            if done {
                self.by_len.entry(b.len()).or_default().push(b);
            } else {
                self.bytes -= b.len();
            }
        }
    }
}

impl CudaDevice {
    /// `len` bytes of the batch arena, or `None` when they do not fit
    /// (the caller takes the pooled path).
    pub(super) fn arena_take(&mut self, len: usize) -> Result<Option<ArenaSlot>, DeviceError> {
        if len > ARENA_BYTES / 4 || self.capturing {
            return Ok(None);
        }
        if self.arena.is_none() {
            self.arena = Some(new_arena(&self.device)?);
        }
        Ok(self.arena.as_mut().and_then(|a| a.reserve(len)))
    }
}
