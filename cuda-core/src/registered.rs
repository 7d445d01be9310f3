//! Host memory registered with the driver in place (`cuMemHostRegister`):
//! copies DMA straight from and to it, with no staging copy through a
//! pinned block. For memory a program keeps mapped for a long time and
//! reuses, such as a ring shared between processes; registering is slow
//! (it page-locks every page), so it is done once.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaStream, DevicePtr, DevicePtrMut};

use crate::buffer::DeviceBuffer;
use crate::copy;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::raw::set_current;

/// A range of host memory registered with a device's context for as long
/// as this lives ([`HostRegistration::new`]); dropping it unregisters the
/// range.
#[derive(Debug)]
pub struct HostRegistration {
    addr: usize,
    len: usize,
    ctx: Arc<CudaContext>,
}

impl HostRegistration {
    /// Page-locks and registers `len` bytes at `ptr` with `device`'s
    /// context (portable: usable from every context).
    ///
    /// # Errors
    /// No driver; a driver error from `cuMemHostRegister`, named (memory
    /// the driver cannot pin, a range already registered).
    ///
    /// # Safety
    /// `ptr..ptr + len` is memory of this process that stays mapped until
    /// the registration is dropped, and no GPU copy through this
    /// registration is still running when it is unmapped.
    pub unsafe fn new(device: &Device, ptr: *mut u8, len: usize) -> Result<Self> {
        crate::device::require_driver()?;
        let ctx = device.context().clone();
        set_current(&ctx)?;
        if len == 0 {
            return Err(Error::InvalidArgument(
                "cannot register an empty host range".into(),
            ));
        }
        // SAFETY: the caller promises the range is mapped for the
        // registration's life.
        unsafe {
            sys::cuMemHostRegister_v2(
                ptr as *mut std::ffi::c_void,
                len,
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        }
        .result()
        .map_err(|e| Error::driver("cuMemHostRegister", e))?;
        Ok(HostRegistration {
            addr: ptr as usize,
            len,
            ctx,
        })
    }

    /// Whether `bytes` lie inside the registered range.
    pub fn contains(&self, bytes: &[u8]) -> bool {
        let start = bytes.as_ptr() as usize;
        start >= self.addr
            && start
                .checked_add(bytes.len())
                .is_some_and(|end| end <= self.addr + self.len)
    }

    fn check(&self, bytes: &[u8], what: &str) -> Result<()> {
        if self.contains(bytes) {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "{what}: the host bytes are outside the registered range"
            )))
        }
    }

    /// Enqueues on `stream` a copy of `src` (inside this registration) into
    /// `dst` at byte `offset`, ordered after `dst`'s earlier uses and
    /// recorded as a write of it. Does not wait.
    ///
    /// # Errors
    /// `src` outside the registration or the range outside `dst`
    /// ([`Error::InvalidArgument`]); a driver error, named.
    ///
    /// # Safety
    /// The host does not write `src` until `stream` has passed the copy
    /// (synchronize the stream first).
    pub unsafe fn upload(
        &self,
        src: &[u8],
        dst: &mut DeviceBuffer<u8>,
        offset: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.check(src, "host-to-device copy")?;
        in_range(offset, src.len(), dst.len(), "host-to-device copy")?;
        if src.is_empty() {
            return Ok(());
        }
        set_current(stream.context())?;
        dst.before_write(stream)?;
        let copied = {
            let (dptr, _write) = dst.as_cuda_slice_mut().device_ptr_mut(stream);
            // SAFETY: `dptr + offset` addresses `src.len()` bytes inside
            // `dst` (checked); `src` is registered host memory the caller
            // leaves alone until the stream passes the copy.
            unsafe { copy::htod_async(dptr + offset as u64, src.as_ptr(), src.len(), stream) }
        };
        let written = dst.after_write(stream);
        copied.and(written)
    }

    /// Enqueues on `stream` a copy of `src[offset..offset + dst.len()]`
    /// into `dst` (inside this registration), ordered after `src`'s last
    /// write and recorded as a read of it. Does not wait.
    ///
    /// # Errors
    /// As [`HostRegistration::upload`].
    ///
    /// # Safety
    /// The host does not read or write `dst` until `stream` has passed the
    /// copy (synchronize the stream first).
    pub unsafe fn download(
        &self,
        src: &DeviceBuffer<u8>,
        offset: usize,
        dst: &mut [u8],
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        self.check(dst, "device-to-host copy")?;
        in_range(offset, dst.len(), src.len(), "device-to-host copy")?;
        if dst.is_empty() {
            return Ok(());
        }
        set_current(stream.context())?;
        src.before_read(stream)?;
        let copied = {
            let (dptr, _read) = src.as_cuda_slice().device_ptr(stream);
            // SAFETY: `dptr + offset` addresses `dst.len()` bytes inside
            // `src` (checked); `dst` is registered host memory the caller
            // leaves alone until the stream passes the copy.
            unsafe { copy::dtoh_async(dst.as_mut_ptr(), dptr + offset as u64, dst.len(), stream) }
        };
        let read = src.after_read(stream);
        copied.and(read)
    }
}

fn in_range(offset: usize, len: usize, size: usize, what: &str) -> Result<()> {
    if offset.checked_add(len).is_some_and(|end| end <= size) {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{what}: {len} bytes at offset {offset} do not fit a buffer of {size}"
        )))
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if set_current(&self.ctx).is_ok() {
            // SAFETY: registered by `new` (the caller keeps it mapped until
            // now and no copy through it is running).
            let _ = unsafe { sys::cuMemHostUnregister(self.addr as *mut std::ffi::c_void) };
        }
    }
}
