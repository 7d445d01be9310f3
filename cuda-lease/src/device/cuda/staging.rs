//! Where a batch's copies are staged: the page-locked batch arena, and the
//! freed buffers kept for the next batch.

use std::collections::HashMap;

use cuda_async::{DeviceBuffer, PinnedBuffer};

use crate::device::error::map;
use crate::device::DeviceError;
use crate::proto::Status;

/// Bytes of page-locked memory a worker stages a batch's small writes
/// and reads in.
pub(super) const ARENA_BYTES: usize = 1 << 20;

/// Page-locked host memory that a batch's small writes are staged in and
/// its small reads land in, handed out front to back and reused after
/// each batch's end, which waits for every copy. A write or read that
/// does not fit takes the pooled path (`cuda-core`'s staging and
/// `PinnedBuffer`s). Staging here skips, per copy, a pool lookup, an
/// event and a hand-off to `cuda-core`'s reclaimer thread.
///
/// The memory is a `PinnedBuffer` from `cuda-core`'s pool whose copies
/// are not recorded in it (that is the per-copy event this avoids):
/// instead the arena is reused only after a finish that waited for
/// every stream, and leaked when that wait fails.
#[derive(Debug)]
pub(super) struct BatchArena {
    buf: PinnedBuffer<u8>,
    pub(super) used: usize,
}

impl BatchArena {
    pub(super) fn new(device: &cuda_async::Device) -> Result<Self, DeviceError> {
        // SAFETY: every byte is written (by a host copy or a download)
        // before it is read: reads of the arena are the downloads'
        // ranges, read after the batch's end waited for them.
        let buf = unsafe { PinnedBuffer::<u8>::uninit(device, ARENA_BYTES) }
            .map_err(|e| map(Status::Internal, "pinned allocation", e))?;
        Ok(Self { buf, used: 0 })
    }

    /// The offset and address of `len` free bytes (64-byte aligned),
    /// or `None` if they do not fit.
    pub(super) fn take(&mut self, len: usize) -> Option<(usize, *mut u8)> {
        let start = self.used.next_multiple_of(64);
        if start.checked_add(len)? > ARENA_BYTES {
            return None;
        }
        // Never waits: no use of the buffer is ever recorded.
        let all = self.buf.as_mut_slice().ok()?;
        self.used = start + len;
        Some((start, all[start..start + len].as_mut_ptr()))
    }

    /// `len` bytes at `off`, once the copies into them are done.
    pub(super) fn bytes(&self, off: usize, len: usize) -> Result<&[u8], DeviceError> {
        let all = self
            .buf
            .as_slice()
            .map_err(|e| map(Status::ReadFailed, "device-to-host copy", e))?;
        Ok(&all[off..off + len])
    }
}

/// Most bytes of freed buffers a worker keeps for reuse, and the largest
/// buffer it keeps: like the memory pool's release threshold, outside
/// any lease's reservation and covered by the node's headroom.
const SPARE_BYTES: usize = 8 << 20;
const SPARE_BUFFER_MAX: usize = 1 << 20;

/// Freed buffers of up to [`SPARE_BUFFER_MAX`] bytes, [`SPARE_BYTES`]
/// in all, by size. A chain allocates and frees the same small sizes
/// batch after batch; handing a freed buffer out again skips
/// `cuMemAllocAsync` and `cuMemFreeAsync` (together about 10 us of a
/// batch's allocation on an H100).
///
/// A buffer freed in a batch is handed out only from the next batch on,
/// once the batch's end has waited for every use of it: reused in the
/// same batch, its new owner on another stream would wait for its old
/// uses, and streams that ran concurrently would run one after another.
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
        for b in std::mem::take(&mut self.freed) {
            if done {
                self.by_len.entry(b.len()).or_default().push(b);
            } else {
                self.bytes -= b.len();
            }
        }
    }
}
