//! Uploads from ordinary (pageable) host memory without blocking.
//!
//! `cuMemcpyHtoDAsync` from pageable memory is not asynchronous: the driver
//! may make the calling thread wait for earlier work on the stream before it
//! stages the data (measured: such a call blocked behind a gated stream).
//! On an async executor that is a blocked worker thread. So uploads copy
//! the data into pinned staging memory on the host (a memcpy), enqueue a
//! truly asynchronous copy from there, and hand the staging block back to a
//! per-device pool once the copy is done (via the reclaimer, never waiting
//! on the caller's thread). Blocks come in power-of-two size classes from
//! 64 KiB; the pool keeps at most [`POOL_LIMIT_BYTES`] in all. The same
//! pool backs [`crate::PinnedBuffer`]s (downloads allocate one per call), so
//! repeated transfers stop paying for `cuMemHostAlloc`.

use std::sync::{Arc, Mutex};

use cudarc::driver::{result, CudaContext, CudaStream, DevicePtrMut, DeviceRepr};

use crate::buffer::DeviceBuffer;
use crate::error::{Error, Result};
use crate::raw::set_current;
use crate::reclaim::{defer, release_after};

/// The most pinned memory the staging pool keeps for reuse.
pub const POOL_LIMIT_BYTES: usize = 512 << 20;
const MIN_BLOCK: usize = 64 << 10;

struct Block {
    /// Host address of the pinned allocation.
    addr: usize,
    bytes: usize,
    /// The context (address of its handle) the block was allocated in.
    ctx: usize,
}

struct Pool {
    free: Vec<Block>,
    cached: usize,
}

static POOL: Mutex<Pool> = Mutex::new(Pool {
    free: Vec::new(),
    cached: 0,
});

fn class(bytes: usize) -> usize {
    bytes.max(MIN_BLOCK).next_power_of_two()
}

fn take(stream: &CudaStream, bytes: usize) -> Result<Block> {
    take_in(stream.context(), bytes)
}

/// A pinned block of at least `bytes` bytes in `ctx`: `(address, capacity)`.
/// Give it back with [`give_back_block`] once no GPU work uses it.
pub(crate) fn take_block(ctx: &CudaContext, bytes: usize) -> Result<(usize, usize)> {
    let b = take_in(ctx, bytes)?;
    Ok((b.addr, b.bytes))
}

/// Returns a block from [`take_block`] to the pool (or frees it past the
/// pool's limit). May call `cuMemFreeHost`: call it on the reclaimer thread.
pub(crate) fn give_back_block(ctx: &CudaContext, addr: usize, bytes: usize) {
    give_back(Block {
        addr,
        bytes,
        ctx: ctx.cu_ctx() as usize,
    });
}

fn take_in(cx: &CudaContext, bytes: usize) -> Result<Block> {
    let ctx = cx.cu_ctx() as usize;
    let want = class(bytes);
    {
        let mut p = POOL.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = p.free.iter().position(|b| b.ctx == ctx && b.bytes == want) {
            let b = p.free.swap_remove(i);
            p.cached -= b.bytes;
            return Ok(b);
        }
    }
    let addr = crate::tracking::outside_capture(|| {
        set_current(cx)?;
        // SAFETY: plain allocation of `want` bytes of pinned host memory.
        unsafe { result::malloc_host(want, 0) }
            .map(|p| p as usize)
            .map_err(|e| Error::driver("cuMemHostAlloc", e))
    })?;
    Ok(Block {
        addr,
        bytes: want,
        ctx,
    })
}

/// A block that goes back to the pool when dropped (on the reclaimer
/// thread, once its copy is done).
struct ReturnToPool(Block);

impl Drop for ReturnToPool {
    fn drop(&mut self) {
        give_back(Block {
            addr: self.0.addr,
            bytes: self.0.bytes,
            ctx: self.0.ctx,
        });
    }
}

/// Returns an idle block to the pool, or frees it past the pool's limit.
/// Runs on the reclaimer thread.
fn give_back(b: Block) {
    let mut p = POOL.lock().unwrap_or_else(|e| e.into_inner());
    if p.cached + b.bytes <= POOL_LIMIT_BYTES {
        p.cached += b.bytes;
        p.free.push(b);
    } else {
        drop(p);
        // SAFETY: the block came from `cuMemHostAlloc` and no GPU work uses
        // it any more (its copy completed); freed once.
        let _ = unsafe { result::free_host(b.addr as *mut std::ffi::c_void) };
    }
}

/// Copies `src` into `dst` on `stream` through pinned staging memory: the
/// calling thread only does a host memcpy and enqueues; `src` may go as soon
/// as this returns. The copy is ordered after `dst`'s earlier uses and
/// recorded as a write.
///
/// # Errors
/// [`Error::InvalidArgument`] if the lengths differ or `dst` is on another
/// device; driver errors (allocation, copy), named.
pub fn upload<T: DeviceRepr + Copy>(
    src: &[T],
    dst: &mut DeviceBuffer<T>,
    stream: &Arc<CudaStream>,
) -> Result<()> {
    if src.len() != dst.len() {
        return Err(Error::InvalidArgument(format!(
            "host-to-device copy: source has {} elements, destination {}",
            src.len(),
            dst.len()
        )));
    }
    upload_at(src, dst, 0, stream)
}

/// Copies `src` into `dst[offset..offset + src.len()]` (in elements) on
/// `stream`, through pinned staging memory, as [`upload`] does for a whole
/// buffer.
///
/// # Errors
/// [`Error::InvalidArgument`] if the range is outside `dst` or `dst` is on
/// another device; driver errors (allocation, copy), named.
pub fn upload_at<T: DeviceRepr + Copy>(
    src: &[T],
    dst: &mut DeviceBuffer<T>,
    offset: usize,
    stream: &Arc<CudaStream>,
) -> Result<()> {
    let in_range = offset
        .checked_add(src.len())
        .is_some_and(|end| end <= dst.len());
    if !in_range {
        return Err(Error::InvalidArgument(format!(
            "host-to-device copy: {} elements at offset {offset} do not fit a buffer of {}",
            src.len(),
            dst.len()
        )));
    }
    let bytes = std::mem::size_of_val(src);
    if bytes == 0 {
        return Ok(());
    }
    dst.before_write(stream)?;
    let block = take(stream, bytes)?;
    // SAFETY: the block holds at least `bytes` bytes and is not shared (it
    // left the pool); `src` is valid for `bytes` bytes; they cannot overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(src.as_ptr() as *const u8, block.addr as *mut u8, bytes)
    };
    let enqueued = {
        let (dptr, _record) = dst.as_cuda_slice_mut().device_ptr_mut(stream);
        let dptr = dptr + (offset * std::mem::size_of::<T>()) as u64;
        // SAFETY: `dptr` addresses `bytes` bytes inside a live allocation
        // (range checked above); the pinned source stays allocated until the
        // copy is done (below).
        unsafe { crate::copy::htod_async(dptr, block.addr as *const u8, bytes, stream) }
    };
    if let Err(e) = enqueued {
        // Nothing was enqueued: the block is idle.
        defer(move || give_back(block));
        return Err(e);
    }
    let written = dst.after_write(stream);
    // Back to the pool once the copy is done (leaked if that cannot be known).
    release_after(stream, ReturnToPool(block))?;
    written
}

#[cfg(test)]
mod tests {
    #[test]
    fn size_classes_are_powers_of_two_from_64k() {
        assert_eq!(super::class(1), 64 << 10);
        assert_eq!(super::class(64 << 10), 64 << 10);
        assert_eq!(super::class((64 << 10) + 1), 128 << 10);
        assert_eq!(super::class(3 << 20), 4 << 20);
    }
}
