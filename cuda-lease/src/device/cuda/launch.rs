//! Kernel launches: kernels resolved and checked against their PTX
//! parameters, and run-time argument lists laid out for the driver.

use cuda_async::{check_launch_config, DeviceBuffer, Error, Kernel, LaunchConfig};
use cuda_core::cudarc::driver::{result, sys, DevicePtr};
use cuda_core::ParamClass;

use super::CudaDevice;
use crate::device::error::{driver, map, mem_arg, not_found};
use crate::device::{DeviceArg, DeviceError, LaunchDims};
use crate::proto::{ModuleHash, Status, StreamId};

/// A kernel and its driver function, kept while its `Kernel` (and so
/// its module) lives.
#[derive(Debug)]
pub(super) struct LastKernel {
    module: ModuleHash,
    name: String,
    kernel: Kernel,
    func: sys::CUfunction,
}

impl CudaDevice {
    /// The driver function of kernel `name` of `module`, after checking
    /// `args` against its PTX parameter list: their count, each
    /// argument's size, and that buffers go where pointers do. The
    /// last kernel launched is kept at hand, so a chain of launches of
    /// one kernel looks nothing up in a map.
    fn launchable(
        &mut self,
        module: ModuleHash,
        name: &str,
        args: &[DeviceArg<'_>],
    ) -> Result<sys::CUfunction, DeviceError> {
        let hit = matches!(&self.last_kernel, Some(l) if l.module == module && l.name == name);
        if !hit {
            let kernel = self.kernel(module, name)?;
            let func = kernel
                .function_on(&self.device)
                .map_err(|e| map(Status::NotFound, "kernel", e))?
                .cu_function();
            self.last_kernel = Some(LastKernel {
                module,
                name: name.to_owned(),
                kernel,
                func,
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
        Ok(last.func)
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

    /// `Device::launch` on this device: the arguments checked against the
    /// kernel's PTX parameters (`launchable`), each buffer's use ordered
    /// (`use_on`), and the values laid out for the driver in storage reused by
    /// every launch.
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
        let config = LaunchConfig {
            grid_dim: (dims.grid[0], dims.grid[1], dims.grid[2]),
            block_dim: (dims.block[0], dims.block[1], dims.block[2]),
            shared_mem_bytes: dims.shared_mem,
        };
        check_launch_config(&config).map_err(|e| map(Status::BadRequest, "launch", e))?;
        let func = self.launchable(module, kernel, args)?;
        // Ordered here, buffer by buffer (see `flush_use`).
        for a in args {
            if let DeviceArg::Mem { id, .. } = a {
                self.use_on(*id, sid, &stream)?;
            }
        }
        // The values, each in 8-byte aligned words of storage reused by
        // every launch (no allocation once it has grown), then a pointer
        // to each: the driver's parameter array.
        let words = &mut self.arg_words;
        let at = &mut self.arg_at;
        words.clear();
        at.clear();
        for a in args {
            at.push(words.len());
            match a {
                DeviceArg::Scalar(b) => {
                    let start = words.len();
                    words.resize(start + b.len().div_ceil(8), 0);
                    for (j, chunk) in b.chunks(8).enumerate() {
                        let mut w = [0u8; 8];
                        w[..chunk.len()].copy_from_slice(chunk);
                        words[start + j] = u64::from_ne_bytes(w);
                    }
                }
                DeviceArg::Mem { id, offset } => {
                    let buffer = mem_arg(&self.buffers, *id, *offset, DeviceBuffer::len)?;
                    // Event tracking is off in this context (see
                    // `open`): the guard records nothing.
                    let (base, _guard) = Self::raw(buffer).as_cuda_slice().device_ptr(&stream);
                    words.push(base + *offset);
                }
            }
        }
        let base = words.as_mut_ptr();
        let params = &mut self.arg_ptrs;
        params.clear();
        // SAFETY: each index was taken from `words` before it grew past
        // it, and `words` is not touched again until the launch is done.
        params.extend(
            at.iter()
                .map(|&i| unsafe { base.add(i) }.cast::<std::ffi::c_void>()),
        );
        self.device
            .context()
            .bind_to_thread()
            .map_err(|e| driver(Status::Internal, "cuCtxSetCurrent", e))?;
        // SAFETY: `func` is a kernel of a module this context has
        // loaded (`launchable` keeps its `Kernel`, hence the module,
        // alive); the argument count and each size match its PTX
        // parameter list (checked by `launchable`), and each pointer in
        // `params` points at that many bytes of `words`, which outlive
        // the call (the driver copies the values before returning).
        // Buffer addresses come from this context's live buffers, whose
        // uses on other streams this launch waits for and whose frees
        // come after it (`use_on` marks it pending, recorded before
        // anything could depend on it). What the kernel does with
        // memory is the client's business: a fault poisons only this
        // worker process.
        let launched = unsafe {
            result::launch_kernel(
                func,
                config.grid_dim,
                config.block_dim,
                config.shared_mem_bytes,
                stream.cu_stream(),
                params,
            )
        };
        params.clear();
        launched.map_err(|e| driver(Status::LaunchFailed, "cuLaunchKernel", e))
    }
}
