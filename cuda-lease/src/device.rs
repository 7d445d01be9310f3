//! The device layer a worker process drives: the [`Device`] trait, the real
//! [`CudaDevice`] and the in-memory test double [`MemoryDevice`].

use std::collections::HashMap;

use crate::proto::{DeviceInfo, Handle, Status};

/// A failed device operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct DeviceError {
    /// Status to report.
    pub status: Status,
    /// Details (the JIT log for LOAD_FAILED).
    pub message: String,
    /// True when the device context is unusable afterwards (a kernel fault):
    /// the lease is poisoned and its worker ended.
    pub sticky: bool,
}

impl DeviceError {
    /// A non-sticky error.
    pub fn new(status: Status, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            sticky: false,
        }
    }

    /// A sticky error (the context is gone).
    pub fn sticky(status: Status, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            sticky: true,
        }
    }
}

/// Launch geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchDims {
    /// Grid dimensions.
    pub grid: [u32; 3],
    /// Block dimensions.
    pub block: [u32; 3],
    /// Dynamic shared memory bytes.
    pub shared_mem: u32,
}

/// A kernel argument with handles resolved by the worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceArg<'a> {
    /// Bytes passed by value.
    Scalar(&'a [u8]),
    /// The address of memory `handle` plus `offset`.
    Mem {
        /// Memory.
        handle: Handle,
        /// Byte offset.
        offset: u64,
    },
}

/// One device context with one stream, owned by one worker process.
/// Operations are stream-ordered; [`Device::sync`] waits for all of them.
pub trait Device {
    /// Describes the device, with free memory measured now.
    ///
    /// # Errors
    ///
    /// A driver error.
    fn info(&mut self) -> Result<DeviceInfo, DeviceError>;
    /// Allocates `size` zeroed bytes under `handle`.
    ///
    /// # Errors
    ///
    /// CAPACITY_EXCEEDED when the device is out of memory.
    fn alloc(&mut self, handle: Handle, size: u64) -> Result<(), DeviceError>;
    /// Frees memory.
    ///
    /// # Errors
    ///
    /// NOT_FOUND for an unknown handle.
    fn free(&mut self, handle: Handle) -> Result<(), DeviceError>;
    /// Copies `data` into memory at `offset`.
    ///
    /// # Errors
    ///
    /// NOT_FOUND, BAD_REQUEST when out of bounds, or a driver error.
    fn write(&mut self, handle: Handle, offset: u64, data: &[u8]) -> Result<(), DeviceError>;
    /// Fills `out` with the memory at `offset` (`out.len()` bytes).
    ///
    /// # Errors
    ///
    /// NOT_FOUND, BAD_REQUEST when out of bounds, READ_FAILED.
    fn read(&mut self, handle: Handle, offset: u64, out: &mut [u8]) -> Result<(), DeviceError>;
    /// Loads PTX text as module `handle`.
    ///
    /// # Errors
    ///
    /// LOAD_FAILED with the JIT log.
    fn load_module(&mut self, handle: Handle, ptx: &[u8]) -> Result<(), DeviceError>;
    /// Unloads a module.
    ///
    /// # Errors
    ///
    /// NOT_FOUND.
    fn unload_module(&mut self, handle: Handle) -> Result<(), DeviceError>;
    /// Enqueues a kernel launch.
    ///
    /// # Errors
    ///
    /// NOT_FOUND (module, kernel or memory), LAUNCH_FAILED.
    fn launch(
        &mut self,
        module: Handle,
        kernel: &str,
        dims: LaunchDims,
        args: &[DeviceArg<'_>],
    ) -> Result<(), DeviceError>;
    /// Waits for everything enqueued.
    ///
    /// # Errors
    ///
    /// LAUNCH_FAILED (sticky) when a kernel faulted.
    fn sync(&mut self) -> Result<(), DeviceError>;
}

fn range(len: usize, offset: u64, n: u64) -> Result<std::ops::Range<usize>, DeviceError> {
    let end = offset
        .checked_add(n)
        .filter(|e| *e <= len as u64)
        .ok_or_else(|| {
            DeviceError::new(
                Status::BadRequest,
                format!("range {offset}+{n} is outside a buffer of {len} bytes"),
            )
        })?;
    Ok(offset as usize..end as usize)
}

fn not_found(what: &str, h: Handle) -> DeviceError {
    DeviceError::new(Status::NotFound, format!("no {what} {h}"))
}

/// The buffer a memory kernel argument names, with its offset checked
/// against the buffer's length (shared by every device implementation).
fn mem_arg<B>(
    buffers: &HashMap<Handle, B>,
    handle: Handle,
    offset: u64,
    len: impl Fn(&B) -> usize,
) -> Result<&B, DeviceError> {
    let b = buffers
        .get(&handle)
        .ok_or_else(|| not_found("memory", handle))?;
    if offset > len(b) as u64 {
        return Err(DeviceError::new(
            Status::BadRequest,
            "argument offset past buffer end",
        ));
    }
    Ok(b)
}

/// In-memory test double of a device: memory is host `Vec`s and modules are
/// kept as text. A launch checks that the module holds `.entry <kernel>` and
/// that memory arguments exist; the test kernels `iota` and `vadd` of
/// [`crate::ptx::TEST_KERNELS`] run on the host (so data flow is testable
/// without a GPU), other kernels are not run.
///
/// For tests of the supervisor it understands three magic kernel names:
/// `__fault` fails like an illegal address (sticky LAUNCH_FAILED at the next
/// sync), `__hang` never returns and `__exit` ends the worker process.
#[derive(Debug)]
pub struct MemoryDevice {
    capacity: u64,
    used: u64,
    buffers: HashMap<Handle, Vec<u8>>,
    modules: HashMap<Handle, String>,
    faulted: bool,
}

impl MemoryDevice {
    /// A device with `capacity` bytes of memory.
    pub fn new(capacity: u64) -> Self {
        Self {
            capacity,
            used: 0,
            buffers: HashMap::new(),
            modules: HashMap::new(),
            faulted: false,
        }
    }

    /// Runs the test kernels of [`crate::ptx::TEST_KERNELS`] on the host,
    /// as the GPU would (one element per thread, `i < n`): `iota(out, n)`
    /// writes `out[i] = i` (u32), `vadd(a, b, c, n)` writes
    /// `c[i] = a[i] + b[i]` (f32). An access outside a buffer faults the
    /// "device" like an illegal address (sticky, at the next sync).
    fn run_host_kernel(
        &mut self,
        kernel: &str,
        dims: LaunchDims,
        args: &[DeviceArg<'_>],
    ) -> Result<(), DeviceError> {
        let threads = dims
            .grid
            .iter()
            .chain(&dims.block)
            .map(|&d| u64::from(d))
            .product::<u64>();
        let bad = || {
            DeviceError::new(
                Status::LaunchFailed,
                format!("test double: wrong arguments for {kernel}"),
            )
        };
        let mem = |a: &DeviceArg<'_>| match a {
            DeviceArg::Mem { handle, offset } => Ok((*handle, *offset as usize)),
            DeviceArg::Scalar(_) => Err(bad()),
        };
        let u32_arg = |a: &DeviceArg<'_>| match a {
            DeviceArg::Scalar(b) if b.len() == 4 => {
                Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            }
            _ => Err(bad()),
        };
        // Element `i` of (handle, byte offset), if inside its buffer.
        let word = |bufs: &HashMap<Handle, Vec<u8>>, (h, off): (Handle, usize), i: u64| {
            let start = off.checked_add(usize::try_from(i).ok()?.checked_mul(4)?)?;
            let b = bufs.get(&h)?;
            b.get(start..start + 4).map(|_| start)
        };
        match (kernel, args) {
            ("iota", [out, n]) => {
                let (out, n) = (mem(out)?, u32_arg(n)?);
                for i in 0..u64::from(n).min(threads) {
                    let Some(at) = word(&self.buffers, out, i) else {
                        self.faulted = true;
                        return Ok(());
                    };
                    if let Some(b) = self.buffers.get_mut(&out.0) {
                        b[at..at + 4].copy_from_slice(&(i as u32).to_le_bytes());
                    }
                }
            }
            ("vadd", [a, b, c, n]) => {
                let (a, b, c, n) = (mem(a)?, mem(b)?, mem(c)?, u32_arg(n)?);
                for i in 0..u64::from(n).min(threads) {
                    let (Some(ia), Some(ib), Some(ic)) = (
                        word(&self.buffers, a, i),
                        word(&self.buffers, b, i),
                        word(&self.buffers, c, i),
                    ) else {
                        self.faulted = true;
                        return Ok(());
                    };
                    let f = |h: Handle, at: usize| {
                        let v = &self.buffers[&h][at..at + 4];
                        f32::from_le_bytes([v[0], v[1], v[2], v[3]])
                    };
                    let sum = f(a.0, ia) + f(b.0, ib);
                    if let Some(buf) = self.buffers.get_mut(&c.0) {
                        buf[ic..ic + 4].copy_from_slice(&sum.to_le_bytes());
                    }
                }
            }
            _ => return Err(bad()),
        }
        Ok(())
    }

    fn check_fault(&self) -> Result<(), DeviceError> {
        if self.faulted {
            return Err(DeviceError::sticky(
                Status::LaunchFailed,
                "an illegal memory access was encountered (test double)",
            ));
        }
        Ok(())
    }
}

impl Device for MemoryDevice {
    fn info(&mut self) -> Result<DeviceInfo, DeviceError> {
        Ok(DeviceInfo {
            ordinal: 0,
            name: "MemoryDevice (test double)".into(),
            total_bytes: self.capacity,
            free_bytes: self.capacity - self.used,
            compute_capability: (0, 0),
        })
    }

    fn alloc(&mut self, handle: Handle, size: u64) -> Result<(), DeviceError> {
        self.check_fault()?;
        if size > self.capacity - self.used {
            return Err(DeviceError::new(Status::CapacityExceeded, "out of memory"));
        }
        self.used += size;
        self.buffers.insert(handle, vec![0; size as usize]);
        Ok(())
    }

    fn free(&mut self, handle: Handle) -> Result<(), DeviceError> {
        let b = self
            .buffers
            .remove(&handle)
            .ok_or_else(|| not_found("memory", handle))?;
        self.used -= b.len() as u64;
        Ok(())
    }

    fn write(&mut self, handle: Handle, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.check_fault()?;
        let b = self
            .buffers
            .get_mut(&handle)
            .ok_or_else(|| not_found("memory", handle))?;
        let r = range(b.len(), offset, data.len() as u64)?;
        b[r].copy_from_slice(data);
        Ok(())
    }

    fn read(&mut self, handle: Handle, offset: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        self.check_fault()?;
        let b = self
            .buffers
            .get(&handle)
            .ok_or_else(|| not_found("memory", handle))?;
        let r = range(b.len(), offset, out.len() as u64)?;
        out.copy_from_slice(&b[r]);
        Ok(())
    }

    fn load_module(&mut self, handle: Handle, ptx: &[u8]) -> Result<(), DeviceError> {
        let text = std::str::from_utf8(ptx)
            .map_err(|_| DeviceError::new(Status::LoadFailed, "ptx is not UTF-8"))?;
        if !text.contains(".entry") {
            return Err(DeviceError::new(
                Status::LoadFailed,
                "ptxas fatal: no .entry in module (test double JIT log)",
            ));
        }
        self.modules.insert(handle, text.to_owned());
        Ok(())
    }

    fn unload_module(&mut self, handle: Handle) -> Result<(), DeviceError> {
        self.modules
            .remove(&handle)
            .map(|_| ())
            .ok_or_else(|| not_found("module", handle))
    }

    fn launch(
        &mut self,
        module: Handle,
        kernel: &str,
        dims: LaunchDims,
        args: &[DeviceArg<'_>],
    ) -> Result<(), DeviceError> {
        self.check_fault()?;
        let text = self
            .modules
            .get(&module)
            .ok_or_else(|| not_found("module", module))?;
        let has_entry = text.split(".entry").skip(1).any(|rest| {
            rest.trim_start()
                .split(|c: char| c == '(' || c.is_whitespace())
                .next()
                == Some(kernel)
        });
        if !has_entry {
            return Err(DeviceError::new(
                Status::NotFound,
                format!("no kernel {kernel} in module"),
            ));
        }
        for a in args {
            if let DeviceArg::Mem { handle, offset } = a {
                mem_arg(&self.buffers, *handle, *offset, Vec::len)?;
            }
        }
        match kernel {
            "__fault" => self.faulted = true,
            "__hang" => loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            },
            "__exit" => std::process::exit(3),
            "iota" | "vadd" => self.run_host_kernel(kernel, dims, args)?,
            _ => {}
        }
        Ok(())
    }

    fn sync(&mut self) -> Result<(), DeviceError> {
        self.check_fault()
    }
}

pub use cuda::CudaDevice;

mod cuda {
    use std::collections::HashMap;
    use std::sync::Arc;

    use cuda_async::{
        launch, CudaStream, DeviceBuffer, DeviceOpExt, DynArg, DynArgs, Error, Kernel,
        LaunchConfig, Module, PinnedBuffer,
    };

    use super::{mem_arg, not_found, range, Device, DeviceArg, DeviceError, LaunchDims};
    use crate::proto::{DeviceInfo, Handle, Status};

    /// A real device, driven through `cuda-core` and `cuda-async`: the
    /// device's primary context (the worker process owns it alone) and one
    /// stream. Memory is `cuda-core` device buffers (frees are stream-ordered
    /// after their uses); copies go through pinned staging memory, never a
    /// pageable copy; kernels are `cuda-core` modules (PTX, JIT-loaded once
    /// per content), launched with run-time argument lists checked against
    /// their PTX parameters.
    #[derive(Debug)]
    pub struct CudaDevice {
        device: cuda_async::Device,
        stream: Arc<CudaStream>,
        buffers: HashMap<Handle, DeviceBuffer<u8>>,
        modules: HashMap<Handle, Module>,
        kernels: HashMap<(Handle, String), Kernel>,
    }

    /// Maps a `cuda-core` error: sticky ones (kernel faults) become sticky
    /// LAUNCH_FAILED whatever the op; the rest get a status by kind, or
    /// `status`.
    fn map(status: Status, what: &str, e: Error) -> DeviceError {
        let status = match &e {
            e if e.is_sticky() => {
                return DeviceError::sticky(Status::LaunchFailed, format!("{what}: {e}"))
            }
            e if e.is_out_of_memory() => Status::CapacityExceeded,
            Error::Compile { .. } | Error::NoNvrtc => Status::LoadFailed,
            Error::KernelNotFound { .. } => Status::NotFound,
            Error::ArgumentMismatch { .. } | Error::InvalidArgument(_) => Status::BadRequest,
            _ => status,
        };
        DeviceError::new(status, format!("{what}: {e}"))
    }

    impl CudaDevice {
        /// Opens device `ordinal`: its primary context and a new stream.
        ///
        /// # Errors
        ///
        /// "no NVIDIA driver found" when libcuda cannot be loaded, or the
        /// driver's error.
        pub fn open(ordinal: usize) -> Result<Self, DeviceError> {
            let st = Status::Internal;
            let device = cuda_async::Device::new(ordinal)
                .map_err(|e| map(st, &format!("opening device {ordinal}"), e))?;
            // The worker's one thread drives this context from now on.
            device.context().bind_to_thread().map_err(|e| {
                map(
                    st,
                    "binding the context",
                    Error::driver("cuCtxSetCurrent", e),
                )
            })?;
            let stream = device
                .new_stream()
                .map_err(|e| map(st, "creating a stream", e))?;
            Ok(Self {
                device,
                stream,
                buffers: HashMap::new(),
                modules: HashMap::new(),
                kernels: HashMap::new(),
            })
        }

        fn buffer(&self, handle: Handle) -> Result<&DeviceBuffer<u8>, DeviceError> {
            self.buffers
                .get(&handle)
                .ok_or_else(|| not_found("memory", handle))
        }
    }

    impl Device for CudaDevice {
        fn info(&mut self) -> Result<DeviceInfo, DeviceError> {
            let st = Status::Internal;
            let info = self.device.info().map_err(|e| map(st, "device info", e))?;
            let (free, total) = self
                .device
                .memory()
                .map_err(|e| map(st, "memory info", e))?;
            Ok(DeviceInfo {
                ordinal: info.ordinal as u32,
                name: info.name,
                total_bytes: total as u64,
                free_bytes: free as u64,
                compute_capability: info.compute_capability,
            })
        }

        fn alloc(&mut self, handle: Handle, size: u64) -> Result<(), DeviceError> {
            let n = usize::try_from(size)
                .map_err(|_| DeviceError::new(Status::CapacityExceeded, "size too large"))?;
            let buf = DeviceBuffer::<u8>::zeros(&self.stream, n)
                .map_err(|e| map(Status::CapacityExceeded, "cuMemAllocAsync", e))?;
            self.buffers.insert(handle, buf);
            Ok(())
        }

        fn free(&mut self, handle: Handle) -> Result<(), DeviceError> {
            // Stream-ordered after every use of the buffer.
            self.buffers
                .remove(&handle)
                .map(drop)
                .ok_or_else(|| not_found("memory", handle))
        }

        fn write(&mut self, handle: Handle, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
            let buf = self
                .buffers
                .get_mut(&handle)
                .ok_or_else(|| not_found("memory", handle))?;
            let r = range(buf.len(), offset, data.len() as u64)?;
            // Staged through pooled pinned memory: a host memcpy, then an
            // asynchronous copy; `data` is free once this returns.
            cuda_core::staging::upload_at(data, buf, r.start, &self.stream)
                .map_err(|e| map(Status::BadRequest, "host-to-device copy", e))
        }

        fn read(&mut self, handle: Handle, offset: u64, out: &mut [u8]) -> Result<(), DeviceError> {
            let buf = self.buffer(handle)?;
            let r = range(buf.len(), offset, out.len() as u64)?;
            if r.is_empty() {
                return Ok(());
            }
            let st = Status::ReadFailed;
            // SAFETY: the download below overwrites every byte before any
            // host access, which waits for it.
            let mut host = unsafe { PinnedBuffer::<u8>::uninit(&self.device, r.len()) }
                .map_err(|e| map(st, "pinned allocation", e))?;
            host.download_from(buf, r.start, &self.stream)
                .map_err(|e| map(st, "device-to-host copy", e))?;
            // Waits for the copy (and surfaces kernel faults here).
            self.sync()?;
            let bytes = host
                .as_slice()
                .map_err(|e| map(st, "device-to-host copy", e))?;
            out.copy_from_slice(bytes);
            Ok(())
        }

        fn load_module(&mut self, handle: Handle, ptx: &[u8]) -> Result<(), DeviceError> {
            let st = Status::LoadFailed;
            let text =
                std::str::from_utf8(ptx).map_err(|_| DeviceError::new(st, "ptx is not UTF-8"))?;
            let module = Module::ptx(text)
                .map_err(|e| map(st, "PTX", e))?
                .named(format!("module {handle}"));
            // JIT-loaded now (once per content in this process), so the log
            // of a bad module comes back with this request.
            module
                .load_on(&self.device)
                .map_err(|e| map(st, "cuModuleLoadData", e))?;
            self.modules.insert(handle, module);
            Ok(())
        }

        fn unload_module(&mut self, handle: Handle) -> Result<(), DeviceError> {
            let module = self
                .modules
                .remove(&handle)
                .ok_or_else(|| not_found("module", handle))?;
            // Nothing of it may run when it unloads: wait for the stream,
            // then let go of its kernels and its cache entry.
            self.sync()?;
            self.kernels.retain(|(m, _), _| *m != handle);
            // SAFETY: the stream (the only one of this context) is idle, and
            // the kernels resolved from this module are dropped.
            unsafe { module.evict_on(&self.device) };
            Ok(())
        }

        fn launch(
            &mut self,
            module: Handle,
            kernel: &str,
            dims: LaunchDims,
            args: &[DeviceArg<'_>],
        ) -> Result<(), DeviceError> {
            let key = (module, kernel.to_owned());
            if !self.kernels.contains_key(&key) {
                let m = self
                    .modules
                    .get(&module)
                    .ok_or_else(|| not_found("module", module))?;
                let k = m
                    .kernel(kernel)
                    .map_err(|e| map(Status::NotFound, "kernel", e))?;
                self.kernels.insert(key.clone(), k);
            }
            let k = &self.kernels[&key];
            let args = args
                .iter()
                .map(|a| match a {
                    DeviceArg::Scalar(b) => Ok(DynArg::Bytes(b.to_vec())),
                    DeviceArg::Mem { handle, offset } => {
                        let buffer = mem_arg(&self.buffers, *handle, *offset, DeviceBuffer::len)?;
                        Ok(DynArg::Buffer {
                            buffer,
                            offset: *offset as usize,
                        })
                    }
                })
                .collect::<Result<Vec<_>, DeviceError>>()?;
            let args =
                DynArgs::new(args).map_err(|e| map(Status::BadRequest, "kernel arguments", e))?;
            let config = LaunchConfig {
                grid_dim: (dims.grid[0], dims.grid[1], dims.grid[2]),
                block_dim: (dims.block[0], dims.block[1], dims.block[2]),
                shared_mem_bytes: dims.shared_mem,
            };
            // SAFETY: the kernel is the lease holder's code; the arguments
            // are checked against its PTX parameter list, buffer addresses
            // come from this context's live buffers (which order their frees
            // after this launch), and the output (the argument list) is
            // dropped unread. What the kernel does with memory is the
            // client's business: a fault poisons only this worker process.
            unsafe { launch(k, config, args).async_on(&self.stream) }
                .map(drop)
                .map_err(|e| map(Status::LaunchFailed, "launch", e))
        }

        fn sync(&mut self) -> Result<(), DeviceError> {
            self.stream.synchronize().map_err(|e| {
                let mut d = map(
                    Status::LaunchFailed,
                    "synchronize",
                    Error::driver("cuStreamSynchronize", e),
                );
                d.sticky = true;
                d
            })
        }
    }
}
