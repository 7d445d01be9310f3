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
    /// Appends `len` bytes of memory at `offset` to `out`.
    ///
    /// # Errors
    ///
    /// NOT_FOUND, BAD_REQUEST when out of bounds, READ_FAILED.
    fn read(
        &mut self,
        handle: Handle,
        offset: u64,
        len: u64,
        out: &mut Vec<u8>,
    ) -> Result<(), DeviceError>;
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

/// In-memory test double of a device: memory is host `Vec`s, modules are kept
/// as text and kernels are **not run**. A launch checks that the module holds
/// `.entry <kernel>` and that memory arguments exist.
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

    fn read(
        &mut self,
        handle: Handle,
        offset: u64,
        len: u64,
        out: &mut Vec<u8>,
    ) -> Result<(), DeviceError> {
        self.check_fault()?;
        let b = self
            .buffers
            .get(&handle)
            .ok_or_else(|| not_found("memory", handle))?;
        let r = range(b.len(), offset, len)?;
        out.extend_from_slice(&b[r]);
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
        _dims: LaunchDims,
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
    use std::ffi::c_void;
    use std::sync::Arc;

    use cudarc::driver::sys;
    use cudarc::driver::{
        CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DriverError,
    };

    use super::{mem_arg, not_found, range, Device, DeviceArg, DeviceError, LaunchDims};
    use crate::proto::{DeviceInfo, Handle, Status};

    /// Zero padding after the packed kernel arguments, so that a kernel
    /// declaring larger parameters than the client sent reads zeros from
    /// this buffer, never foreign memory (CUDA allows 32 KiB of parameters).
    const PARAM_PAD: usize = 32 * 1024;

    /// A real device: one CUDA context and one stream on one GPU.
    #[derive(Debug)]
    pub struct CudaDevice {
        ordinal: usize,
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        buffers: HashMap<Handle, CudaSlice<u8>>,
        modules: HashMap<Handle, (Arc<CudaModule>, HashMap<String, CudaFunction>)>,
    }

    fn is_sticky(e: &DriverError) -> bool {
        use sys::cudaError_enum as E;
        matches!(
            e.0,
            E::CUDA_ERROR_ILLEGAL_ADDRESS
                | E::CUDA_ERROR_LAUNCH_FAILED
                | E::CUDA_ERROR_MISALIGNED_ADDRESS
                | E::CUDA_ERROR_ILLEGAL_INSTRUCTION
                | E::CUDA_ERROR_INVALID_PC
                | E::CUDA_ERROR_HARDWARE_STACK_ERROR
                | E::CUDA_ERROR_INVALID_ADDRESS_SPACE
                | E::CUDA_ERROR_ASSERT
                | E::CUDA_ERROR_LAUNCH_TIMEOUT
                | E::CUDA_ERROR_ECC_UNCORRECTABLE
                | E::CUDA_ERROR_CONTEXT_IS_DESTROYED
        )
    }

    /// Maps a driver error: sticky ones (kernel faults) become sticky
    /// LAUNCH_FAILED whatever the op, others get `status`.
    fn map(status: Status, what: &str, e: DriverError) -> DeviceError {
        if is_sticky(&e) {
            DeviceError::sticky(Status::LaunchFailed, format!("{what}: {e}"))
        } else if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
            DeviceError::new(Status::CapacityExceeded, format!("{what}: {e}"))
        } else {
            DeviceError::new(status, format!("{what}: {e}"))
        }
    }

    impl CudaDevice {
        /// Opens device `ordinal`: a new context and stream.
        ///
        /// # Errors
        ///
        /// "no NVIDIA driver found" when libcuda cannot be loaded, or the driver's error.
        pub fn open(ordinal: usize) -> Result<Self, DeviceError> {
            // SAFETY: only tries to dlopen libcuda; no other CUDA state is touched.
            if !unsafe { sys::is_culib_present() } {
                return Err(DeviceError::new(Status::Internal, "no NVIDIA driver found"));
            }
            let ctx = CudaContext::new(ordinal)
                .map_err(|e| map(Status::Internal, &format!("opening device {ordinal}"), e))?;
            // SAFETY: this context is used by one thread through one stream
            // (`stream` below), so stream order alone keeps every buffer's uses
            // ordered; cudarc's cross-stream event tracking is not needed.
            unsafe { ctx.disable_event_tracking() };
            let stream = ctx
                .new_stream()
                .map_err(|e| map(Status::Internal, "creating a stream", e))?;
            Ok(Self {
                ordinal,
                ctx,
                stream,
                buffers: HashMap::new(),
                modules: HashMap::new(),
            })
        }

        fn jit_log(ptx: &std::ffi::CStr) -> String {
            const LOG: usize = 16 * 1024;
            let mut log = vec![0u8; LOG];
            let mut opts = [
                sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
                sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
            ];
            let mut vals: [*mut c_void; 2] = [log.as_mut_ptr().cast(), LOG as *mut c_void];
            let mut module: sys::CUmodule = std::ptr::null_mut();
            // SAFETY: `ptx` is NUL-terminated; the option arrays have 2 entries each and the
            // log buffer is LOG bytes long and outlives the call; the context is bound.
            let r = unsafe {
                sys::cuModuleLoadDataEx(
                    &mut module,
                    ptx.as_ptr().cast(),
                    2,
                    opts.as_mut_ptr(),
                    vals.as_mut_ptr(),
                )
            };
            if r == sys::cudaError_enum::CUDA_SUCCESS && !module.is_null() {
                // SAFETY: `module` was just loaded by us and is not used elsewhere.
                unsafe { sys::cuModuleUnload(module) };
            }
            let end = log.iter().position(|b| *b == 0).unwrap_or(log.len());
            String::from_utf8_lossy(&log[..end]).into_owned()
        }
    }

    impl Device for CudaDevice {
        fn info(&mut self) -> Result<DeviceInfo, DeviceError> {
            let st = Status::Internal;
            let name = self.ctx.name().map_err(|e| map(st, "device name", e))?;
            let (free, total) = self
                .ctx
                .mem_get_info()
                .map_err(|e| map(st, "mem_get_info", e))?;
            let (maj, min) = self
                .ctx
                .compute_capability()
                .map_err(|e| map(st, "compute capability", e))?;
            Ok(DeviceInfo {
                ordinal: self.ordinal as u32,
                name,
                total_bytes: total as u64,
                free_bytes: free as u64,
                compute_capability: (maj as u32, min as u32),
            })
        }

        fn alloc(&mut self, handle: Handle, size: u64) -> Result<(), DeviceError> {
            let n = usize::try_from(size)
                .map_err(|_| DeviceError::new(Status::CapacityExceeded, "size too large"))?;
            let buf = self
                .stream
                .alloc_zeros::<u8>(n)
                .map_err(|e| map(Status::CapacityExceeded, "cuMemAlloc", e))?;
            self.buffers.insert(handle, buf);
            Ok(())
        }

        fn free(&mut self, handle: Handle) -> Result<(), DeviceError> {
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
            if r.is_empty() {
                return Ok(());
            }
            let mut view = buf.slice_mut(r);
            self.stream
                .memcpy_htod(data, &mut view)
                .map_err(|e| map(Status::BadRequest, "memcpy_htod", e))
        }

        fn read(
            &mut self,
            handle: Handle,
            offset: u64,
            len: u64,
            out: &mut Vec<u8>,
        ) -> Result<(), DeviceError> {
            let buf = self
                .buffers
                .get(&handle)
                .ok_or_else(|| not_found("memory", handle))?;
            let r = range(buf.len(), offset, len)?;
            if r.is_empty() {
                return Ok(());
            }
            let start = out.len();
            out.resize(start + r.len(), 0);
            let view = buf.slice(r);
            self.stream
                .memcpy_dtoh(&view, &mut out[start..])
                .map_err(|e| map(Status::ReadFailed, "memcpy_dtoh", e))?;
            // A pageable device-to-host copy returns when done, but a sync
            // makes the bytes certain and surfaces kernel faults here.
            self.stream
                .synchronize()
                .map_err(|e| map(Status::ReadFailed, "synchronize", e))
        }

        fn load_module(&mut self, handle: Handle, ptx: &[u8]) -> Result<(), DeviceError> {
            let text = std::str::from_utf8(ptx)
                .map_err(|_| DeviceError::new(Status::LoadFailed, "ptx is not UTF-8"))?;
            let c = std::ffi::CString::new(text)
                .map_err(|_| DeviceError::new(Status::LoadFailed, "ptx contains a NUL byte"))?;
            match self.ctx.load_module(cudarc::nvrtc::Ptx::from_src(text)) {
                Ok(m) => {
                    self.modules.insert(handle, (m, HashMap::new()));
                    Ok(())
                }
                Err(e) if is_sticky(&e) => Err(map(Status::LoadFailed, "cuModuleLoadData", e)),
                Err(e) => {
                    let log = Self::jit_log(&c);
                    Err(DeviceError::new(
                        Status::LoadFailed,
                        format!("cuModuleLoadData: {e}\n{log}"),
                    ))
                }
            }
        }

        fn unload_module(&mut self, handle: Handle) -> Result<(), DeviceError> {
            self.modules
                .remove(&handle)
                .map(drop)
                .ok_or_else(|| not_found("module", handle))
        }

        fn launch(
            &mut self,
            module: Handle,
            kernel: &str,
            dims: LaunchDims,
            args: &[DeviceArg<'_>],
        ) -> Result<(), DeviceError> {
            let (m, funcs) = self
                .modules
                .get_mut(&module)
                .ok_or_else(|| not_found("module", module))?;
            if !funcs.contains_key(kernel) {
                let f = m.load_function(kernel).map_err(|e| {
                    DeviceError::new(Status::NotFound, format!("kernel {kernel}: {e}"))
                })?;
                funcs.insert(kernel.to_owned(), f);
            }
            let func = funcs
                .get(kernel)
                .map(|f| f.cu_function())
                .ok_or_else(|| DeviceError::new(Status::NotFound, format!("kernel {kernel}")))?;

            // Pack the arguments into one zeroed, 16-byte aligned buffer.
            let mut offsets = Vec::with_capacity(args.len());
            let mut bytes = 0usize;
            for a in args {
                let len = match a {
                    DeviceArg::Scalar(b) => b.len(),
                    DeviceArg::Mem { .. } => 8,
                };
                offsets.push(bytes);
                bytes += len.div_ceil(16) * 16;
            }
            let mut storage = vec![0u128; (bytes + PARAM_PAD) / 16];
            let base = storage.as_mut_ptr().cast::<u8>();
            for (a, off) in args.iter().zip(&offsets) {
                let src: Vec<u8> = match a {
                    DeviceArg::Scalar(b) => b.to_vec(),
                    DeviceArg::Mem { handle, offset } => {
                        let buf = mem_arg(&self.buffers, *handle, *offset, CudaSlice::len)?;
                        let (ptr, _sync) = buf.device_ptr(&self.stream);
                        (ptr + *offset).to_le_bytes().to_vec()
                    }
                };
                // SAFETY: `off + src.len()` is within `bytes`, which is within `storage`.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), base.add(*off), src.len()) };
            }
            let mut params: Vec<*mut c_void> = offsets
                .iter()
                .map(|off| {
                    // SAFETY: `off` is within `storage` (see above).
                    unsafe { base.add(*off) }.cast::<c_void>()
                })
                .collect();
            self.ctx
                .bind_to_thread()
                .map_err(|e| map(Status::LaunchFailed, "bind context", e))?;
            // SAFETY: `func` belongs to a module loaded in this context, which is bound to this
            // thread; `params` holds one pointer per argument into `storage`, which stays alive
            // until the call returns (the driver copies parameters at launch) and is padded so
            // that any parameter size the kernel declares reads inside it; the memory addresses
            // passed come from live allocations of this context, ordered on this stream.
            let r = unsafe {
                sys::cuLaunchKernel(
                    func,
                    dims.grid[0],
                    dims.grid[1],
                    dims.grid[2],
                    dims.block[0],
                    dims.block[1],
                    dims.block[2],
                    dims.shared_mem,
                    self.stream.cu_stream(),
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            drop(storage);
            if r != sys::cudaError_enum::CUDA_SUCCESS {
                return Err(map(Status::LaunchFailed, "cuLaunchKernel", DriverError(r)));
            }
            Ok(())
        }

        fn sync(&mut self) -> Result<(), DeviceError> {
            self.stream.synchronize().map_err(|e| {
                let mut d = map(Status::LaunchFailed, "synchronize", e);
                d.sticky = true;
                d
            })
        }
    }
}
