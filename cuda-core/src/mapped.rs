//! Page-locked host memory mapped into the device's address space: the GPU
//! reads and writes it directly, through a device address, with no copy.

use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};

use crate::device::Device;
use crate::error::{DriverResultExt, Error, Result};

/// Zeroed, page-locked host memory that the GPU can address
/// (`cuMemHostAlloc` with `CU_MEMHOSTALLOC_DEVICEMAP |
/// CU_MEMHOSTALLOC_PORTABLE`): pinned for every context, mapped into the
/// device's address space at [`MappedHostMemory::device_ptr`].
///
/// Freed (`cuMemFreeHost`, on the reclaimer thread) when dropped, at once:
/// it does not track GPU work that uses it. Memory a stream may write at
/// any later time (a completion word) is kept for the process with
/// [`MappedHostMemory::leak`].
pub struct MappedHostMemory {
    host: NonNull<u8>,
    dptr: sys::CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: a `MappedHostMemory` owns its allocation exclusively, like a
// `Box<[u8]>`; moving it to another thread moves only bytes. The context
// handle is `Send + Sync` in cudarc, and the driver API is thread-safe.
unsafe impl Send for MappedHostMemory {}
// SAFETY: `&MappedHostMemory` gives out only `&AtomicU64` (which is
// `Sync`), raw pointers (whose use is the caller's unsafe business) and
// plain values, so sharing it shares nothing non-atomic.
unsafe impl Sync for MappedHostMemory {}

impl fmt::Debug for MappedHostMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MappedHostMemory")
            .field("bytes", &self.bytes)
            .field("device_ptr", &format_args!("{:#x}", self.dptr))
            .finish()
    }
}

impl MappedHostMemory {
    /// Allocates `bytes` zeroed bytes of mapped, page-locked host memory in
    /// `device`'s context (made current first) and looks up their device
    /// address.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for 0 bytes; a driver error naming
    /// `cuCtxSetCurrent` (also when the context holds an error deferred by
    /// an earlier call), `cuMemHostAlloc` or `cuMemHostGetDevicePointer`.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// let dev = cuda_core::Device::new(0)?;
    /// let mem = cuda_core::MappedHostMemory::zeroed(&dev, 4096)?;
    /// let word = mem.atomic_u64(0)?;
    /// assert_eq!(word.load(std::sync::atomic::Ordering::Acquire), 0);
    /// println!("the GPU sees it at {:#x}", mem.device_ptr());
    /// # Ok::<(), cuda_core::Error>(())
    /// ```
    pub fn zeroed(device: &Device, bytes: usize) -> Result<Self> {
        if bytes == 0 {
            return Err(Error::InvalidArgument(
                "mapped host memory of 0 bytes".into(),
            ));
        }
        let ctx = device.context().clone();
        ctx.bind_to_thread().call("cuCtxSetCurrent")?;
        let mut host = std::ptr::null_mut();
        // SAFETY: plain allocation of `bytes` bytes of pinned memory, mapped
        // into the device's address space; writes one pointer through a
        // valid out-pointer.
        unsafe {
            sys::cuMemHostAlloc(
                &mut host,
                bytes,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        }
        .result()
        .call("cuMemHostAlloc")?;
        let host = NonNull::new(host.cast::<u8>())
            .ok_or_else(|| Error::InvalidArgument("cuMemHostAlloc returned null".into()))?;
        // SAFETY: `host` is a fresh allocation of `bytes` bytes that nothing
        // else uses yet.
        unsafe { std::ptr::write_bytes(host.as_ptr(), 0, bytes) };
        // Owned from here: freed on drop if the lookup below fails.
        let mut mem = MappedHostMemory {
            host,
            dptr: 0,
            bytes,
            ctx,
        };
        // SAFETY: `host` is mapped pinned memory allocated in the current
        // context; writes one address through a valid out-pointer; flags 0
        // is the only defined value.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut mem.dptr, host.as_ptr().cast(), 0) }
            .result()
            .call("cuMemHostGetDevicePointer")?;
        Ok(mem)
    }

    /// Its size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Its host address. Access through it while the GPU may use the
    /// memory is the caller's to make safe (atomics, or ordering).
    pub fn host_ptr(&self) -> *mut u8 {
        self.host.as_ptr()
    }

    /// The address the device reaches it at, for kernels and stream memory
    /// operations ([`stream_write_value_64`](crate::stream_write_value_64)).
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.dptr
    }

    /// The 8 bytes at `offset`, as an atomic the host can read while the
    /// GPU writes them (the GPU writes an aligned word whole).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] unless the word is 8-byte aligned and
    /// inside the memory (the memory is page-aligned, so any `offset` that
    /// is a multiple of 8 and leaves room for 8 bytes).
    pub fn atomic_u64(&self, offset: usize) -> Result<&AtomicU64> {
        let fits = offset.checked_add(8).is_some_and(|end| end <= self.bytes);
        let aligned = (self.host.as_ptr() as usize)
            .wrapping_add(offset)
            .is_multiple_of(8);
        if !aligned || !fits {
            return Err(Error::InvalidArgument(format!(
                "a 64-bit word at offset {offset} of {} bytes of mapped host memory \
                 (must be 8-byte aligned and inside it)",
                self.bytes
            )));
        }
        // SAFETY: the word lies inside the allocation and is 8-byte aligned
        // (both checked); it is initialised
        // (zeroed at allocation) and lives as long as `&self`. Nothing in
        // this type accesses it non-atomically; the GPU writes it whole.
        Ok(unsafe { &*self.host.as_ptr().add(offset).cast::<AtomicU64>() })
    }

    /// Keeps the memory for the rest of the process: it is never freed.
    /// For memory that streams may write at any later time (a completion
    /// word that every submission on a stream writes), which no point of
    /// the program could free safely.
    pub fn leak(self) -> &'static MappedHostMemory {
        Box::leak(Box::new(self))
    }
}

impl Drop for MappedHostMemory {
    fn drop(&mut self) {
        let host = self.host.as_ptr() as usize;
        let ctx = self.ctx.clone();
        // On the reclaimer thread: `cuMemFreeHost` may synchronize the
        // device, which must never stall the dropping thread.
        crate::reclaim::defer(move || {
            let _ = crate::raw::set_current(&ctx);
            // SAFETY: the memory came from `cuMemHostAlloc` and is freed
            // once; its owner is gone, so the host no longer uses it, and
            // GPU work that writes it through its device address was
            // enqueued (unsafely) on the promise that it outlives that work.
            let _ = unsafe { result::free_host(host as *mut std::ffi::c_void) };
        });
    }
}
