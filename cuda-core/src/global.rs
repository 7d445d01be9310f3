//! A module's `__device__` and `__constant__` variables
//! ([`Module::global_on`]): their addresses and sizes on a device.

use cudarc::driver::sys;

use crate::device::Device;
use crate::error::{Error, Result};
use crate::module::Module;

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
