//! A module's `__device__` and `__constant__` variables
//! ([`Module::global_on`]): their addresses and sizes on a device, and
//! stream-ordered copies between them and [`PinnedBuffer`]s.

use cudarc::driver::{sys, CudaStream, DeviceRepr};

use crate::buffer::AnyBitPattern;
use crate::device::Device;
use crate::error::{DriverResultExt, Error, Result};
use crate::module::Module;
use crate::pinned::PinnedBuffer;

/// A `__device__` or `__constant__` variable of a module loaded on a
/// device ([`Module::global_on`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModuleGlobal {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    ordinal: usize,
}

impl ModuleGlobal {
    /// Its device address.
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Its size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The device it lives on.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
}

impl Module {
    /// The `__device__` (or `__constant__`) variable `name` of this module
    /// on `device` (loading the module there first): its address and size.
    /// Loaded modules stay in the process-wide cache, so the address stays
    /// valid for the process.
    ///
    /// # Errors
    /// A module that does not load; [`Error::InvalidArgument`] naming the
    /// variable when the module has none of that name.
    pub fn global_on(&self, device: &Device, name: &str) -> Result<ModuleGlobal> {
        let loaded = self.loaded_on(device)?;
        let name_c = std::ffi::CString::new(name).map_err(|_| {
            Error::InvalidArgument(format!("global name {name:?} contains a NUL byte"))
        })?;
        drop(name_c);
        let stream = device.context().default_stream();
        match loaded.module.get_global(name, &stream) {
            Ok(view) => {
                use cudarc::driver::DevicePtr;
                let bytes = view.len();
                let (ptr, _no_record) = view.device_ptr(&stream);
                Ok(ModuleGlobal {
                    ptr,
                    bytes,
                    ordinal: device.ordinal(),
                })
            }
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_FOUND => {
                Err(Error::InvalidArgument(format!(
                    "module `{}` has no global `{name}` (a `__device__` or `__constant__` \
                     variable at namespace scope)",
                    self.name()
                )))
            }
            Err(e) => Err(Error::driver("cuModuleGetGlobal", e)),
        }
    }
}

impl ModuleGlobal {
    /// Fails unless a buffer of `bytes` bytes matches the global's size
    /// and `stream` is on the global's device.
    fn check_copy(&self, what: &str, bytes: usize, stream: &CudaStream) -> Result<()> {
        if bytes != self.bytes {
            return Err(Error::InvalidArgument(format!(
                "{what}: the global is {} bytes, the pinned buffer {bytes}",
                self.bytes
            )));
        }
        let on = stream.context().ordinal();
        if on != self.ordinal {
            return Err(Error::InvalidArgument(format!(
                "{what}: a global of device {} used on a stream of device {on}",
                self.ordinal
            )));
        }
        Ok(())
    }
}

impl<T: AnyBitPattern> PinnedBuffer<T> {
    /// Enqueues on `stream` a copy of the global `src` into this buffer
    /// (`cuMemcpyDtoHAsync`), which must be exactly the global's size:
    /// ordered after this buffer's earlier GPU uses and recorded as a use,
    /// so host access waits for it. Does not wait itself; nothing is
    /// enqueued for a global of 0 bytes.
    ///
    /// The global is not a tracked buffer: kernels that write it on other
    /// streams are not ordered before the copy.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the sizes differ or `src` lives on
    /// another device than `stream`; the errors of
    /// [`PinnedBuffer::begin_use`] and [`PinnedBuffer::record_use`]; a
    /// driver error naming `cuMemcpyDtoHAsync`.
    pub fn download_from_global(&mut self, src: &ModuleGlobal, stream: &CudaStream) -> Result<()> {
        // (No overflow: the size was checked when the buffer was allocated.)
        let bytes = self.len() * std::mem::size_of::<T>();
        src.check_copy("device-to-host copy of a global", bytes, stream)?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the copy below writes the buffer's `bytes` bytes, only
        // on `stream`, and `record_use` follows it.
        let host = unsafe { self.begin_use(stream) }?;
        // SAFETY: `host` holds `bytes` pinned bytes untouched until the
        // recorded use completes; the global's address and size come from
        // the driver for a module that stays loaded (`Module::global_on`),
        // on the stream's device (checked); `T` accepts any bit pattern.
        let copied = unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                host as *mut std::ffi::c_void,
                src.ptr,
                bytes,
                stream.cu_stream(),
            )
        }
        .result()
        .call("cuMemcpyDtoHAsync");
        self.record_use(stream)?;
        copied
    }
}

impl<T: DeviceRepr> PinnedBuffer<T> {
    /// Enqueues on `stream` a copy of this buffer into the global `dst`
    /// (`cuMemcpyHtoDAsync`), which must be exactly the buffer's size:
    /// ordered after this buffer's earlier GPU uses and recorded as a use,
    /// so host writes and drop wait for it. Does not wait itself; nothing is
    /// enqueued for a global of 0 bytes.
    ///
    /// The global is not a tracked buffer: kernels that use it on other
    /// streams are not ordered against the copy.
    ///
    /// # Errors
    /// As [`PinnedBuffer::download_from_global`], naming
    /// `cuMemcpyHtoDAsync`.
    pub fn upload_to_global(&mut self, dst: &ModuleGlobal, stream: &CudaStream) -> Result<()> {
        // (No overflow: the size was checked when the buffer was allocated.)
        let bytes = self.len() * std::mem::size_of::<T>();
        dst.check_copy("host-to-device copy to a global", bytes, stream)?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the copy below reads the buffer's `bytes` bytes, only on
        // `stream`, and `record_use` follows it.
        let host = unsafe { self.begin_use(stream) }?;
        // SAFETY: `host` holds `bytes` pinned bytes that the buffer keeps
        // (its drop waits for the recorded use); the global's address and
        // size come from the driver for a module that stays loaded
        // (`Module::global_on`), on the stream's device (checked).
        let copied = unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst.ptr,
                host as *const std::ffi::c_void,
                bytes,
                stream.cu_stream(),
            )
        }
        .result()
        .call("cuMemcpyHtoDAsync");
        self.record_use(stream)?;
        copied
    }
}
