//! Kernel launches: kernels resolved and checked against their PTX
//! parameters, and run-time argument lists laid out for the driver.

use cuda_async::{check_launch_config, DeviceBuffer, Error, Kernel, LaunchConfig};
use cuda_core::{Args, ParamClass};

use super::CudaDevice;
use crate::device::error::{map, mem_arg, not_found, submit_only};
use crate::device::DeviceError;
use crate::proto::{Id, LaunchArg, LaunchSpec, ModuleHash, Status};

/// The kernel of the last launch, resolved on this device (its `Kernel`
/// keeps its module loaded).
#[derive(Debug)]
pub(super) struct LastKernel {
    module: ModuleHash,
    name: String,
    pub(super) kernel: Kernel,
}

impl CudaDevice {
    /// Kernel `name` of `module`, resolved on this device, after checking
    /// `args` against its PTX parameters: their count, each one's size, and
    /// that buffers go where pointers do. The last kernel launched is kept at
    /// hand, so a chain of its launches looks nothing up.
    pub(super) fn launchable(
        &mut self,
        module: ModuleHash,
        name: &str,
        args: &[LaunchArg<'_>],
    ) -> Result<&Kernel, DeviceError> {
        let hit = matches!(&self.last_kernel, Some(l) if l.module == module && l.name == name);
        if !hit {
            let kernel = self.kernel(module, name)?;
            kernel
                .function_on(&self.device)
                .map_err(|e| map(Status::NotFound, "kernel", e))?;
            self.last_kernel = Some(LastKernel {
                module,
                name: name.to_owned(),
                kernel,
            });
        }
        let last = self.last_kernel.as_ref().expect("set above");
        let bad = |e| map(Status::BadRequest, "kernel arguments", e);
        if last.kernel.params().is_none() {
            return Err(bad(Error::ArgumentMismatch {
                kernel: name.into(),
                detail: "the kernel's parameter list could not be read from its PTX, and \
                         run-time arguments are only launched against a known list"
                    .into(),
            }));
        }
        // `cuda-core`'s own check, on a list reused by every launch.
        let specs = &mut self.arg_specs;
        specs.clear();
        for a in args {
            specs.push(match a {
                LaunchArg::Scalar(b) => (b.len(), ParamClass::Bits, "bytes"),
                LaunchArg::Mem { .. } => (8, ParamClass::Int, "device address"),
                LaunchArg::Input(_) | LaunchArg::Output => return Err(submit_only()),
            });
        }
        last.kernel.check_args(specs).map_err(bad)?;
        Ok(&last.kernel)
    }

    /// The kernel `name` of a loaded module, resolved on first use.
    fn kernel(&mut self, module: ModuleHash, name: &str) -> Result<Kernel, DeviceError> {
        if let Some(k) = self.kernels.get(&module).and_then(|m| m.get(name)) {
            return Ok(k.clone());
        }
        let m = self
            .modules
            .get(&module)
            .ok_or_else(|| not_found("module", module))?;
        let k = m
            .kernel(name)
            .map_err(|e| map(Status::NotFound, "kernel", e))?;
        k.load_on(&self.device)
            .map_err(|e| map(Status::NotFound, "kernel", e))?;
        self.kernels
            .entry(module)
            .or_default()
            .insert(name.to_owned(), k.clone());
        Ok(k)
    }

    /// `args`' values pushed onto `list`, a buffer's as its address at its
    /// offset (the buffer one of `buffers`).
    pub(super) fn push_args<'a>(
        buffers: &'a crate::proto::IdMap<Id, DeviceBuffer<u8>>,
        list: &mut Args<'a>,
        args: &[LaunchArg<'_>],
    ) -> Result<(), DeviceError> {
        for a in args {
            match a {
                LaunchArg::Scalar(b) => list.push_bytes(b),
                LaunchArg::Mem { buf, offset } => {
                    let buffer = mem_arg(buffers, *buf, *offset, DeviceBuffer::len)?;
                    // At most the buffer's length (checked by `mem_arg`).
                    let offset = *offset as usize;
                    list.push_buffer(Self::raw(buffer), offset)
                        .map_err(|e| map(Status::BadRequest, "kernel arguments", e))?;
                }
                LaunchArg::Input(_) | LaunchArg::Output => return Err(submit_only()),
            }
        }
        Ok(())
    }
}

/// A launch's grid, block and shared memory as a [`LaunchConfig`], checked
/// as `cuda-async` checks every launch's.
pub(super) fn launch_config(spec: &LaunchSpec<'_>) -> Result<LaunchConfig, DeviceError> {
    let [g, b] = [spec.grid, spec.block];
    let config = LaunchConfig {
        grid_dim: (g[0], g[1], g[2]),
        block_dim: (b[0], b[1], b[2]),
        shared_mem_bytes: spec.shared_mem,
    };
    check_launch_config(&config).map_err(|e| map(Status::BadRequest, "launch", e))?;
    Ok(config)
}
