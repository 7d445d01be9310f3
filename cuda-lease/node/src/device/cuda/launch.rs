//! Kernel launches: kernels resolved and checked against their PTX
//! parameters, and run-time argument lists laid out for the driver.

use std::collections::HashMap;

use cuda_async::{check_launch_config, DeviceBuffer, Error, Kernel, LaunchConfig};
use cuda_core::{Args, ParamClass};

use super::{bind, CudaDevice};
use crate::device::error::{map, mem_arg, not_found};
use crate::device::{DeviceArg, DeviceError, LaunchDims};
use crate::proto::{Id, ModuleHash, Status, StreamId};

/// The kernel of the last launch, resolved on this device (its `Kernel`
/// keeps its module loaded).
#[derive(Debug)]
pub(super) struct LastKernel {
    module: ModuleHash,
    name: String,
    kernel: Kernel,
}

impl CudaDevice {
    /// Kernel `name` of `module`, resolved on this device, after checking
    /// `args` against its PTX parameter list: their count, each
    /// argument's size, and that buffers go where pointers do. The
    /// last kernel launched is kept at hand, so a chain of launches of
    /// one kernel looks nothing up in a map.
    fn launchable(
        &mut self,
        module: ModuleHash,
        name: &str,
        args: &[DeviceArg<'_>],
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
        specs.extend(args.iter().map(|a| match a {
            DeviceArg::Scalar(b) => (b.len(), ParamClass::Bits, "bytes"),
            DeviceArg::Mem { .. } => (8, ParamClass::Int, "device address"),
        }));
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

    /// `LeaseDevice::launch` on this device: the arguments checked against the
    /// kernel's PTX parameters (`launchable`), each buffer's use ordered
    /// (`use_on`), and the values laid out for the driver in storage reused by
    /// every launch (`cuda-core`'s `ArgList`).
    pub(super) fn enqueue_launch(
        &mut self,
        stream: StreamId,
        module: ModuleHash,
        kernel: &str,
        dims: LaunchDims,
        args: &[DeviceArg<'_>],
    ) -> Result<(), DeviceError> {
        let sid = stream;
        let stream = self.stream(stream)?;
        let config = launch_config(dims)?;
        self.launchable(module, kernel, args)?;
        // Ordered here, buffer by buffer (see `flush_use`).
        for a in args {
            if let DeviceArg::Mem { id, .. } = a {
                self.use_on(*id, sid, &stream)?;
            }
        }
        // The values, each in 8-byte aligned words of storage reused by
        // every launch (no allocation once it has grown).
        let mut list = self.arg_list.start(&stream);
        Self::push_args(&self.buffers, &mut list, args)?;
        bind(&self.device)?;
        let kernel = &self.last_kernel.as_ref().expect("set by launchable").kernel;
        // SAFETY: the kernel is the client's code, launched with the
        // arguments the client gave, which `cuda-core` checks against its
        // PTX parameter list (as `launchable` did); what it does with
        // memory is the client's business: a fault poisons only this
        // worker process, whose context serves one lease. Buffer addresses
        // come from this context's live buffers, whose uses on other
        // streams this launch waits for (`use_on` above, `before_write`)
        // and whose frees come after it (`use_on` marks it pending,
        // recorded in the buffer's events by `flush_use` before anything
        // could depend on them: a use on another stream, a copy, the free,
        // the end of the batch).
        let launched = unsafe { kernel.launch_with(&self.device, &config, list) };
        launched.map_err(|e| map(Status::LaunchFailed, "cuLaunchKernel", e))
    }

    /// `args`' values pushed onto `list`, a buffer's as its address at its
    /// offset (the buffer one of `buffers`).
    fn push_args<'a>(
        buffers: &'a HashMap<Id, DeviceBuffer<u8>>,
        list: &mut Args<'a>,
        args: &[DeviceArg<'_>],
    ) -> Result<(), DeviceError> {
        for a in args {
            match a {
                DeviceArg::Scalar(b) => list.push_bytes(b),
                DeviceArg::Mem { id, offset } => {
                    let buffer = mem_arg(buffers, *id, *offset, DeviceBuffer::len)?;
                    // At most the buffer's length (checked by `mem_arg`).
                    let offset = *offset as usize;
                    list.push_buffer(Self::raw(buffer), offset)
                        .map_err(|e| map(Status::BadRequest, "kernel arguments", e))?;
                }
            }
        }
        Ok(())
    }
}

/// A launch's grid, block and shared memory as a [`LaunchConfig`], checked
/// as `cuda-async` checks every launch's.
fn launch_config(dims: LaunchDims) -> Result<LaunchConfig, DeviceError> {
    let config = LaunchConfig {
        grid_dim: (dims.grid[0], dims.grid[1], dims.grid[2]),
        block_dim: (dims.block[0], dims.block[1], dims.block[2]),
        shared_mem_bytes: dims.shared_mem,
    };
    check_launch_config(&config).map_err(|e| map(Status::BadRequest, "launch", e))?;
    Ok(config)
}
