//! The device layer a worker process drives: the [`Device`] trait, the real
//! [`CudaDevice`] and the in-memory test double [`MemoryDevice`].

use crate::proto::{DeviceInfo, Id, ModuleHash, SourceKind, StreamId};

mod error;
mod memory;

pub use cuda::CudaDevice;
pub use error::DeviceError;
pub use memory::MemoryDevice;

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

/// A kernel argument with ids resolved by the worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceArg<'a> {
    /// Bytes passed by value.
    Scalar(&'a [u8]),
    /// The address of buffer `id` plus `offset`.
    Mem {
        /// The buffer.
        id: Id,
        /// Byte offset.
        offset: u64,
    },
}

/// Most streams one device context makes (the node's per-lease limit is
/// lower; this bounds a worker whatever it is sent).
pub const MAX_DEVICE_STREAMS: usize = 64;

/// One device context owned by one worker process, with streams made on
/// demand and named by the lease's client.
///
/// Commands are enqueued: each runs after the earlier commands of its
/// stream, after the event record a [`Device::wait`] names, and after the
/// earlier commands on any stream that used the same buffer in a
/// conflicting way (a write against any use), as `cuda-core` buffers order
/// themselves; otherwise streams run concurrently. Errors returned at
/// enqueue (unknown ids, bounds, arguments) leave nothing enqueued; a kernel
/// fault is sticky and surfaces at [`Device::finish`].
pub trait Device {
    /// Describes the device, with free memory measured now.
    ///
    /// # Errors
    ///
    /// A driver error.
    fn info(&mut self) -> Result<DeviceInfo, DeviceError>;
    /// Allocates `size` zeroed bytes as buffer `id`, ordered on `stream`.
    ///
    /// # Errors
    ///
    /// CAPACITY_EXCEEDED when the device is out of memory; BAD_REQUEST for
    /// an id in use.
    fn alloc(&mut self, stream: StreamId, id: Id, size: u64) -> Result<(), DeviceError>;
    /// Frees buffer or event `id` after every enqueued use of it.
    ///
    /// # Errors
    ///
    /// NOT_FOUND for an unknown id.
    fn free(&mut self, stream: StreamId, id: Id) -> Result<(), DeviceError>;
    /// Enqueues a copy of `data` into buffer `id` at `offset`; `data` is
    /// not needed once this returns.
    ///
    /// # Errors
    ///
    /// NOT_FOUND, BAD_REQUEST when out of bounds, or a driver error.
    fn write(
        &mut self,
        stream: StreamId,
        id: Id,
        offset: u64,
        data: &[u8],
    ) -> Result<(), DeviceError>;
    /// Enqueues a read of `len` bytes of buffer `id` at `offset`; they land
    /// in `out[at..at + len]` of the next [`Device::finish`].
    ///
    /// # Errors
    ///
    /// NOT_FOUND, BAD_REQUEST when out of bounds, READ_FAILED.
    fn read(
        &mut self,
        stream: StreamId,
        id: Id,
        offset: u64,
        len: u32,
        at: usize,
    ) -> Result<(), DeviceError>;
    /// Reads `out.len()` bytes of buffer `id` at `offset` now, after every
    /// enqueued write of it (the streamed MEM_READ path).
    ///
    /// # Errors
    ///
    /// As [`Device::read`], and a sticky fault of earlier work.
    fn read_now(&mut self, id: Id, offset: u64, out: &mut [u8]) -> Result<(), DeviceError>;
    /// Loads a module (PTX: JIT; CUDA C: compiled by NVRTC for this device)
    /// under its content hash, and returns the PTX it compiled CUDA C to
    /// (so the node can keep it and spare other workers the compile).
    /// Loading a hash already loaded is a no-op.
    ///
    /// # Errors
    ///
    /// LOAD_FAILED with the JIT or compile log.
    fn load_module(
        &mut self,
        hash: ModuleHash,
        kind: &SourceKind,
        text: &[u8],
    ) -> Result<Option<String>, DeviceError>;
    /// Unloads a module after everything enqueued.
    ///
    /// # Errors
    ///
    /// NOT_FOUND.
    fn unload_module(&mut self, hash: ModuleHash) -> Result<(), DeviceError>;
    /// Enqueues a kernel launch.
    ///
    /// # Errors
    ///
    /// NOT_FOUND (module, kernel or memory), BAD_REQUEST, LAUNCH_FAILED.
    fn launch(
        &mut self,
        stream: StreamId,
        module: ModuleHash,
        kernel: &str,
        dims: LaunchDims,
        args: &[DeviceArg<'_>],
    ) -> Result<(), DeviceError>;
    /// Records event `event` on `stream` (made on first use).
    ///
    /// # Errors
    ///
    /// BAD_REQUEST when `event` names a buffer.
    fn record(&mut self, stream: StreamId, event: Id) -> Result<(), DeviceError>;
    /// Makes `stream` wait for the last record of `event`.
    ///
    /// # Errors
    ///
    /// NOT_FOUND for an event never recorded.
    fn wait(&mut self, stream: StreamId, event: Id) -> Result<(), DeviceError>;
    /// Enqueues setting `len` bytes of buffer `id` at `offset` to `value`.
    ///
    /// # Errors
    ///
    /// NOT_FOUND, BAD_REQUEST when out of bounds, or a driver error.
    fn fill(
        &mut self,
        stream: StreamId,
        id: Id,
        offset: u64,
        len: u64,
        value: u8,
    ) -> Result<(), DeviceError>;
    /// Enqueues a copy of `len` bytes from `(buffer, offset)` `src` to
    /// another buffer's `dst`.
    ///
    /// # Errors
    ///
    /// NOT_FOUND, BAD_REQUEST when out of bounds or both are one buffer,
    /// or a driver error.
    fn copy(
        &mut self,
        stream: StreamId,
        src: (Id, u64),
        dst: (Id, u64),
        len: u64,
    ) -> Result<(), DeviceError>;
    /// Waits for everything enqueued on every stream and delivers the
    /// enqueued reads into `out`.
    ///
    /// # Errors
    ///
    /// LAUNCH_FAILED (sticky) when a kernel faulted.
    fn finish(&mut self, out: &mut [u8]) -> Result<(), DeviceError>;
}

mod cuda {
    use std::collections::HashMap;
    use std::sync::Arc;

    use cuda_async::{
        check_launch_config, CudaStream, DeviceBuffer, Error, Kernel, LaunchConfig, Module,
        PinnedBuffer,
    };
    use cuda_core::cudarc::driver::{result, sys, DevicePtr, DevicePtrMut};
    use cuda_core::CudaEvent;
    use cuda_core::ParamClass;

    use super::error::{mem_arg, not_found, range, same_buffer, too_many_streams};
    use super::{Device, DeviceArg, DeviceError, LaunchDims, MAX_DEVICE_STREAMS};
    use crate::proto::{DeviceInfo, Id, ModuleHash, SourceKind, Status, StreamId};
    use crate::sandbox::Compiler;

    /// A real device, driven through `cuda-core` and `cuda-async`: the
    /// device's primary context (the worker process owns it alone) and
    /// streams made on demand, named by the lease's client. Memory is
    /// `cuda-core` device buffers, which order their uses across streams
    /// and their frees after every use; copies go through pinned staging
    /// memory, never a pageable copy; kernels are `cuda-core` modules (PTX
    /// JIT-loaded, CUDA C compiled by NVRTC for this device, once per
    /// content), launched with run-time argument lists checked against
    /// their PTX parameters.
    ///
    /// A batch's launches cost one driver call each: a buffer's uses on one
    /// stream are recorded in its use events once, when something could
    /// depend on them (a use on another stream, a copy, the free, the end
    /// of the batch), not after every launch; see `flush_use`.
    #[derive(Debug)]
    pub struct CudaDevice {
        device: cuda_async::Device,
        streams: HashMap<StreamId, Arc<CudaStream>>,
        buffers: HashMap<Id, DeviceBuffer<u8>>,
        events: HashMap<Id, CudaEvent>,
        modules: HashMap<ModuleHash, Module>,
        /// Kernels resolved so far, by module and name.
        kernels: HashMap<ModuleHash, HashMap<String, Kernel>>,
        /// Reads enqueued since the last finish: where they land.
        reads: Vec<(PinnedBuffer<u8>, usize)>,
        /// Buffers whose latest uses, on the stream named here, are not
        /// recorded in the buffer's own use events yet (see
        /// [`CudaDevice::flush_use`]).
        pending: HashMap<Id, StreamId>,
        /// Small freed buffers kept for the next allocation of their size.
        spare: SpareBuffers,
        /// Where small writes are staged and small reads land (made on
        /// first use).
        arena: Option<BatchArena>,
        /// Reads into the arena since the last finish: (where in the
        /// reply, where in the arena, length).
        arena_reads: Vec<(usize, usize, usize)>,
        /// The kernel of the last launch (see [`CudaDevice::launchable`]).
        last_kernel: Option<LastKernel>,
        /// The streams this batch enqueued work on (see
        /// [`CudaDevice::sync_touched`]).
        touched: Vec<Arc<CudaStream>>,
        /// A launch's argument values, 8-byte aligned (reused).
        arg_words: Vec<u64>,
        /// Where each argument starts in `arg_words` (reused).
        arg_at: Vec<usize>,
        /// A launch's argument kinds, for the parameter check (reused).
        arg_specs: Vec<(usize, ParamClass, &'static str)>,
        /// The driver's parameter array: a pointer into `arg_words` per
        /// argument (reused; empty between launches).
        arg_ptrs: Vec<*mut std::ffi::c_void>,
        /// Compiles tenants' CUDA C in a confined child process.
        compiler: Arc<Compiler>,
    }

    /// A kernel and its driver function, kept while its `Kernel` (and so
    /// its module) lives.
    #[derive(Debug)]
    struct LastKernel {
        module: ModuleHash,
        name: String,
        kernel: Kernel,
        func: sys::CUfunction,
    }

    /// Bytes of page-locked memory a worker stages a batch's small writes
    /// and reads in.
    const ARENA_BYTES: usize = 1 << 20;

    /// Page-locked host memory that a batch's small writes are staged in and
    /// its small reads land in, handed out front to back and reused after
    /// each batch's end, which waits for every copy. A write or read that
    /// does not fit takes the pooled path (`cuda-core`'s staging and
    /// `PinnedBuffer`s). Staging here skips, per copy, a pool lookup, an
    /// event and a hand-off to `cuda-core`'s reclaimer thread.
    ///
    /// The memory is a `PinnedBuffer` from `cuda-core`'s pool whose copies
    /// are not recorded in it (that is the per-copy event this avoids):
    /// instead the arena is reused only after a finish that waited for
    /// every stream, and leaked when that wait fails.
    #[derive(Debug)]
    struct BatchArena {
        buf: PinnedBuffer<u8>,
        used: usize,
    }

    impl BatchArena {
        fn new(device: &cuda_async::Device) -> Result<Self, DeviceError> {
            // SAFETY: every byte is written (by a host copy or a download)
            // before it is read: reads of the arena are the downloads'
            // ranges, read after the batch's end waited for them.
            let buf = unsafe { PinnedBuffer::<u8>::uninit(device, ARENA_BYTES) }
                .map_err(|e| map(Status::Internal, "pinned allocation", e))?;
            Ok(Self { buf, used: 0 })
        }

        /// The offset and address of `len` free bytes (64-byte aligned),
        /// or `None` if they do not fit.
        fn take(&mut self, len: usize) -> Option<(usize, *mut u8)> {
            let start = self.used.next_multiple_of(64);
            if start.checked_add(len)? > ARENA_BYTES {
                return None;
            }
            // Never waits: no use of the buffer is ever recorded.
            let all = self.buf.as_mut_slice().ok()?;
            self.used = start + len;
            Some((start, all[start..start + len].as_mut_ptr()))
        }

        /// `len` bytes at `off`, once the copies into them are done.
        fn bytes(&self, off: usize, len: usize) -> Result<&[u8], DeviceError> {
            let all = self
                .buf
                .as_slice()
                .map_err(|e| map(Status::ReadFailed, "device-to-host copy", e))?;
            Ok(&all[off..off + len])
        }
    }

    /// Most bytes of freed buffers a worker keeps for reuse, and the largest
    /// buffer it keeps: like the memory pool's release threshold, outside
    /// any lease's reservation and covered by the node's headroom.
    const SPARE_BYTES: usize = 8 << 20;
    const SPARE_BUFFER_MAX: usize = 1 << 20;

    /// Freed buffers of up to [`SPARE_BUFFER_MAX`] bytes, [`SPARE_BYTES`]
    /// in all, by size. A chain allocates and frees the same small sizes
    /// batch after batch; handing a freed buffer out again skips
    /// `cuMemAllocAsync` and `cuMemFreeAsync` (together about 10 us of a
    /// batch's allocation on an H100).
    ///
    /// A buffer freed in a batch is handed out only from the next batch on,
    /// once the batch's end has waited for every use of it: reused in the
    /// same batch, its new owner on another stream would wait for its old
    /// uses, and streams that ran concurrently would run one after another.
    #[derive(Debug, Default)]
    struct SpareBuffers {
        by_len: HashMap<usize, Vec<DeviceBuffer<u8>>>,
        /// Freed in this batch; their uses may still be running.
        freed: Vec<DeviceBuffer<u8>>,
        bytes: usize,
    }

    impl SpareBuffers {
        fn take(&mut self, len: usize) -> Option<DeviceBuffer<u8>> {
            let b = self.by_len.get_mut(&len)?.pop()?;
            self.bytes -= len;
            Some(b)
        }

        /// Keeps `buf` if there is room; else drops it (a stream-ordered
        /// free after its uses).
        fn keep(&mut self, buf: DeviceBuffer<u8>) {
            let len = buf.len();
            if len == 0 || len > SPARE_BUFFER_MAX || self.bytes + len > SPARE_BYTES {
                return;
            }
            self.bytes += len;
            self.freed.push(buf);
        }

        /// At the end of a batch: with every use done (`done`), this
        /// batch's frees can be handed out; else they are dropped (each a
        /// free ordered after its recorded uses, or leaked).
        fn settle(&mut self, done: bool) {
            for b in std::mem::take(&mut self.freed) {
                if done {
                    self.by_len.entry(b.len()).or_default().push(b);
                } else {
                    self.bytes -= b.len();
                }
            }
        }
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

    fn driver(
        status: Status,
        call: &'static str,
        e: cuda_core::cudarc::driver::DriverError,
    ) -> DeviceError {
        map(status, call, Error::driver(call, e))
    }

    impl CudaDevice {
        /// Opens device `ordinal`: its primary context, bound to this
        /// thread. Streams are made on first use.
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
            device
                .context()
                .bind_to_thread()
                .map_err(|e| driver(st, "cuCtxSetCurrent", e))?;
            // Every buffer of this device is a `cuda-core` buffer, used only
            // by the commands below, each of which orders itself with the
            // buffer's own use events (`before_*`/`after_*`, and the drop
            // orders the free after them). cudarc's per-slice events would
            // repeat that work: two more event records and waits per buffer
            // argument of every launch (about 5 us of the 8 us a launch
            // took here on an H100). This process has no other CUDA user.
            // SAFETY: called before this context allocates any slice, and
            // no code in this process uses its slices outside `cuda-core`'s
            // tracking (the worker's commands are the only users).
            unsafe { device.context().disable_event_tracking() };
            // A batch allocates, synchronizes and frees: keep a little freed
            // memory in the pool, or every batch's first allocation maps it
            // again. Bounded (32 MiB per worker), so a lease's freed memory
            // goes back for other leases' workers; the node's headroom
            // covers it.
            device
                .set_mem_pool_release_threshold(32 << 20)
                .map_err(|e| map(st, "memory pool", e))?;
            Ok(Self {
                device,
                streams: HashMap::new(),
                buffers: HashMap::new(),
                events: HashMap::new(),
                modules: HashMap::new(),
                kernels: HashMap::new(),
                reads: Vec::new(),
                pending: HashMap::new(),
                spare: SpareBuffers::default(),
                arena: None,
                arena_reads: Vec::new(),
                last_kernel: None,
                touched: Vec::new(),
                arg_words: Vec::new(),
                arg_at: Vec::new(),
                arg_specs: Vec::new(),
                arg_ptrs: Vec::new(),
                compiler: Arc::default(),
            })
        }

        /// Compiles CUDA C with `compiler` (its headers, time and log
        /// bounds) from now on; the default offers no headers.
        pub fn set_compiler(&mut self, compiler: Arc<Compiler>) {
            self.compiler = compiler;
        }

        fn stream(&mut self, id: StreamId) -> Result<Arc<CudaStream>, DeviceError> {
            let s = match self.streams.get(&id) {
                Some(s) => s.clone(),
                None => {
                    if self.streams.len() >= MAX_DEVICE_STREAMS {
                        return Err(too_many_streams());
                    }
                    let s = self
                        .device
                        .new_stream()
                        .map_err(|e| map(Status::Internal, "creating a stream", e))?;
                    self.streams.insert(id, s.clone());
                    s
                }
            };
            self.touch(&s);
            Ok(s)
        }

        /// Notes that this batch enqueues work on `s` (see
        /// [`CudaDevice::sync_touched`]).
        fn touch(&mut self, s: &Arc<CudaStream>) {
            if !self.touched.iter().any(|t| Arc::ptr_eq(t, s)) {
                self.touched.push(s.clone());
            }
        }

        /// Waits for the streams this batch enqueued work on (every
        /// earlier batch's work was waited for at its own end), and
        /// forgets them; a failure is sticky (a kernel fault). An idle
        /// stream's synchronize costs about 1.3 us on an H100 host, and a
        /// lease's round-robin policy keeps four streams, one busy per
        /// submission.
        fn sync_touched(&mut self) -> Result<(), DeviceError> {
            let touched = std::mem::take(&mut self.touched);
            touched.iter().try_for_each(|s| sync(s))
        }

        /// A node's buffers are all local: the `cuda-core` buffer under one.
        fn raw(b: &DeviceBuffer<u8>) -> &cuda_core::DeviceBuffer<u8> {
            b.local().expect("a node's buffers are local")
        }

        fn raw_mut(b: &mut DeviceBuffer<u8>) -> &mut cuda_core::DeviceBuffer<u8> {
            b.local_mut().expect("a node's buffers are local")
        }

        fn buffer(&self, id: Id) -> Result<&DeviceBuffer<u8>, DeviceError> {
            self.buffers.get(&id).ok_or_else(|| not_found("buffer", id))
        }

        /// Records the deferred uses of buffer `id` (if any) in its use
        /// events, on the stream they were enqueued on.
        ///
        /// Allocations and launches do not record an event per buffer per
        /// command: a buffer's uses on one stream are ordered by the stream
        /// itself, so they are marked pending and recorded once, before
        /// anything could depend on the events: a use on another stream, a
        /// copy, read, write or fill (which order themselves by those
        /// events), the free, or the end of the batch. Recording later on
        /// the same stream covers every earlier use; a wait on it may wait
        /// for more of that stream than needed, never less.
        fn flush_use(&mut self, id: Id) -> Result<(), DeviceError> {
            let Some(s) = self.pending.remove(&id) else {
                return Ok(());
            };
            let (Some(stream), Some(buf)) = (self.streams.get(&s), self.buffers.get(&id)) else {
                return Ok(());
            };
            let stream = stream.clone();
            Self::raw(buf)
                .after_write(&stream)
                .map_err(|e| map(Status::Internal, "recording a buffer's use", e))?;
            self.touch(&stream);
            Ok(())
        }

        /// Orders a use of buffer `id` on `stream` after its uses elsewhere,
        /// and marks it pending there (see [`CudaDevice::flush_use`]).
        fn use_on(&mut self, id: Id, stream: StreamId, s: &CudaStream) -> Result<(), DeviceError> {
            if self.pending.get(&id) == Some(&stream) {
                // Same stream: ordered by the stream.
                return Ok(());
            }
            self.flush_use(id)?;
            Self::raw(self.buffer(id)?)
                .before_write(s)
                .map_err(|e| map(Status::Internal, "ordering a buffer's use", e))?;
            self.pending.insert(id, stream);
            Ok(())
        }

        /// `len` bytes of the batch arena, or `None` when they do not fit
        /// (the caller takes the pooled path).
        fn arena_take(&mut self, len: usize) -> Result<Option<(usize, *mut u8)>, DeviceError> {
            if len > ARENA_BYTES / 4 {
                return Ok(None);
            }
            if self.arena.is_none() {
                self.arena = Some(BatchArena::new(&self.device)?);
            }
            Ok(self.arena.as_mut().and_then(|a| a.take(len)))
        }

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

        /// Waits for every stream; a failure is sticky (a kernel fault).
        fn sync_all(&mut self) -> Result<(), DeviceError> {
            self.streams.values().try_for_each(|s| sync(s))
        }
    }

    /// Waits for `s`; a failure is sticky (a kernel fault).
    fn sync(s: &CudaStream) -> Result<(), DeviceError> {
        s.synchronize().map_err(|e| {
            let mut d = driver(Status::LaunchFailed, "cuStreamSynchronize", e);
            d.sticky = true;
            d
        })
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

        fn alloc(&mut self, stream: StreamId, id: Id, size: u64) -> Result<(), DeviceError> {
            if self.buffers.contains_key(&id) || self.events.contains_key(&id) {
                return Err(DeviceError::new(
                    Status::BadRequest,
                    format!("id {id} is in use"),
                ));
            }
            let sid = stream;
            let stream = self.stream(stream)?;
            let n = usize::try_from(size)
                .map_err(|_| DeviceError::new(Status::CapacityExceeded, "size too large"))?;
            if n == 0 {
                let buf = cuda_core::DeviceBuffer::<u8>::zeros(&stream, n)
                    .map_err(|e| map(Status::CapacityExceeded, "cuMemAllocAsync", e))?;
                self.buffers.insert(id, buf.into());
                return Ok(());
            }
            match self.spare.take(n) {
                // A freed buffer of this size: its memset waits for its
                // earlier uses like any other use (`use_on`).
                Some(buf) => {
                    self.buffers.insert(id, buf);
                    self.use_on(id, sid, &stream)?;
                }
                None => {
                    // SAFETY: the memset below, on the allocating stream,
                    // writes every byte before anything else can use the
                    // buffer (later commands on this stream follow it;
                    // other streams wait for the use `flush_use` records).
                    let buf = unsafe { cuda_core::DeviceBuffer::<u8>::uninit(&stream, n) }
                        .map_err(|e| map(Status::CapacityExceeded, "cuMemAllocAsync", e))?;
                    self.buffers.insert(id, buf.into());
                    // Pending even if the memset fails: recorded (or the
                    // buffer leaked) like any other use before it is freed.
                    self.pending.insert(id, sid);
                }
            }
            let buf = Self::raw_mut(self.buffers.get_mut(&id).expect("inserted above"));
            let (ptr, _write) = buf.as_cuda_slice_mut().device_ptr_mut(&stream);
            // SAFETY: `ptr` addresses the `n` bytes of a live allocation,
            // ordered after its earlier uses (a recycled buffer) or its
            // allocation on this stream.
            unsafe { result::memset_d8_async(ptr, 0, n, stream.cu_stream()) }
                .map_err(|e| driver(Status::Internal, "cuMemsetD8Async", e))
        }

        fn free(&mut self, _stream: StreamId, id: Id) -> Result<(), DeviceError> {
            if self.events.remove(&id).is_some() {
                // The driver releases a pending event when it completes.
                return Ok(());
            }
            // Stream-ordered after every use of the buffer, on any stream
            // (its events are complete or recorded before it is dropped or
            // handed out again).
            self.flush_use(id)?;
            let buf = self
                .buffers
                .remove(&id)
                .ok_or_else(|| not_found("buffer", id))?;
            // A buffer not kept is freed on its home stream, which the
            // batch's end then waits for (as for every other stream it
            // touched), so the memory is back in the pool by the reply.
            let home = Self::raw(&buf).home_stream().clone();
            self.touch(&home);
            self.spare.keep(buf);
            Ok(())
        }

        fn write(
            &mut self,
            stream: StreamId,
            id: Id,
            offset: u64,
            data: &[u8],
        ) -> Result<(), DeviceError> {
            let sid = stream;
            let stream = self.stream(stream)?;
            let r = range(self.buffer(id)?.len(), offset, data.len() as u64)?;
            if r.is_empty() {
                return Ok(());
            }
            if let Some((_, host)) = self.arena_take(r.len())? {
                // SAFETY: `host` addresses `r.len()` free bytes of the
                // arena (no copy uses them until the one below), and `data`
                // has as many; they cannot overlap.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), host, r.len()) };
                self.use_on(id, sid, &stream)?;
                let buf = Self::raw_mut(self.buffers.get_mut(&id).expect("checked above"));
                let (dptr, _w) = buf.as_cuda_slice_mut().device_ptr_mut(&stream);
                // SAFETY: `dptr + r.start` addresses `r.len()` bytes of a
                // live buffer (range checked), ordered after its other
                // uses (`use_on`); the arena bytes stay untouched until the
                // batch's end has waited for this copy.
                return unsafe {
                    sys::cuMemcpyHtoDAsync_v2(
                        dptr + r.start as u64,
                        host.cast::<std::ffi::c_void>(),
                        r.len(),
                        stream.cu_stream(),
                    )
                }
                .result()
                .map_err(|e| driver(Status::Internal, "cuMemcpyHtoDAsync", e));
            }
            self.flush_use(id)?;
            let buf = self
                .buffers
                .get_mut(&id)
                .ok_or_else(|| not_found("buffer", id))?;
            // Staged through pooled pinned memory: a host memcpy, then an
            // asynchronous copy; `data` is free once this returns.
            cuda_core::staging::upload_at(data, Self::raw_mut(buf), r.start, &stream)
                .map_err(|e| map(Status::BadRequest, "host-to-device copy", e))
        }

        fn read(
            &mut self,
            stream: StreamId,
            id: Id,
            offset: u64,
            len: u32,
            at: usize,
        ) -> Result<(), DeviceError> {
            let sid = stream;
            let stream = self.stream(stream)?;
            let r = range(self.buffer(id)?.len(), offset, u64::from(len))?;
            if r.is_empty() {
                return Ok(());
            }
            let st = Status::ReadFailed;
            if let Some((off, host)) = self.arena_take(r.len())? {
                self.use_on(id, sid, &stream)?;
                let dptr = {
                    let buf = Self::raw(self.buffer(id)?);
                    buf.as_cuda_slice().device_ptr(&stream).0
                };
                // SAFETY: `host` addresses `r.len()` free bytes of the
                // arena, read only after the batch's end waited for this
                // copy; `dptr + r.start` addresses `r.len()` bytes of a live
                // buffer (range checked), ordered after its writes.
                unsafe {
                    sys::cuMemcpyDtoHAsync_v2(
                        host.cast::<std::ffi::c_void>(),
                        dptr + r.start as u64,
                        r.len(),
                        stream.cu_stream(),
                    )
                }
                .result()
                .map_err(|e| driver(st, "cuMemcpyDtoHAsync", e))?;
                self.arena_reads.push((at, off, r.len()));
                return Ok(());
            }
            self.flush_use(id)?;
            let buf = self.buffer(id)?;
            // SAFETY: the download below overwrites every byte before any
            // host access, which waits for it.
            let mut host = unsafe { PinnedBuffer::<u8>::uninit(&self.device, r.len()) }
                .map_err(|e| map(st, "pinned allocation", e))?;
            host.download_from(Self::raw(buf), r.start, &stream)
                .map_err(|e| map(st, "device-to-host copy", e))?;
            self.reads.push((host, at));
            Ok(())
        }

        fn fill(
            &mut self,
            stream: StreamId,
            id: Id,
            offset: u64,
            len: u64,
            value: u8,
        ) -> Result<(), DeviceError> {
            let stream = self.stream(stream)?;
            self.flush_use(id)?;
            let buf = self
                .buffers
                .get_mut(&id)
                .ok_or_else(|| not_found("buffer", id))?;
            let r = range(buf.len(), offset, len)?;
            if r.is_empty() {
                return Ok(());
            }
            let st = Status::Internal;
            let buf = Self::raw_mut(buf);
            buf.before_write(&stream).map_err(|e| map(st, "fill", e))?;
            let filled = {
                let (ptr, _write) = buf.as_cuda_slice_mut().device_ptr_mut(&stream);
                // SAFETY: `ptr + r.start` addresses `r.len()` bytes inside
                // a live allocation (checked above); the buffer orders the
                // write against its other uses.
                unsafe {
                    result::memset_d8_async(
                        ptr + r.start as u64,
                        value,
                        r.len(),
                        stream.cu_stream(),
                    )
                }
            };
            let after = buf.after_write(&stream);
            filled.map_err(|e| driver(st, "cuMemsetD8Async", e))?;
            after.map_err(|e| map(st, "fill", e))
        }

        fn copy(
            &mut self,
            stream: StreamId,
            src: (Id, u64),
            dst: (Id, u64),
            len: u64,
        ) -> Result<(), DeviceError> {
            if src.0 == dst.0 {
                return Err(same_buffer());
            }
            let stream = self.stream(stream)?;
            self.flush_use(src.0)?;
            self.flush_use(dst.0)?;
            let rs = range(self.buffer(src.0)?.len(), src.1, len)?;
            let rd = range(self.buffer(dst.0)?.len(), dst.1, len)?;
            if rs.is_empty() {
                return Ok(());
            }
            // Out of the map while borrowed mutably next to the source.
            let mut to = self
                .buffers
                .remove(&dst.0)
                .ok_or_else(|| not_found("buffer", dst.0))?;
            let from = Self::raw(&self.buffers[&src.0]);
            let st = Status::Internal;
            let r = (|| {
                let to = Self::raw_mut(&mut to);
                from.before_read(&stream).map_err(|e| map(st, "copy", e))?;
                to.before_write(&stream).map_err(|e| map(st, "copy", e))?;
                let copied = stream.memcpy_dtod(
                    &from.as_cuda_slice().slice(rs.clone()),
                    &mut to.as_cuda_slice_mut().slice_mut(rd.clone()),
                );
                let read = from.after_read(&stream);
                let wrote = to.after_write(&stream);
                copied.map_err(|e| driver(st, "cuMemcpyDtoDAsync", e))?;
                read.map_err(|e| map(st, "copy", e))?;
                wrote.map_err(|e| map(st, "copy", e))
            })();
            self.buffers.insert(dst.0, to);
            r
        }

        fn read_now(&mut self, id: Id, offset: u64, out: &mut [u8]) -> Result<(), DeviceError> {
            let len = u32::try_from(out.len())
                .map_err(|_| DeviceError::new(Status::BadRequest, "read too large"))?;
            // On a stream of its own (the buffer orders it after its writes).
            self.read(StreamId::MAX, id, offset, len, 0)?;
            self.finish(out)
        }

        fn load_module(
            &mut self,
            hash: ModuleHash,
            kind: &SourceKind,
            text: &[u8],
        ) -> Result<Option<String>, DeviceError> {
            if self.modules.contains_key(&hash) {
                return Ok(None);
            }
            let st = Status::LoadFailed;
            let text = std::str::from_utf8(text)
                .map_err(|_| DeviceError::new(st, "module text is not UTF-8"))?;
            let name = format!("module {hash}");
            // CUDA C is compiled by this node's NVRTC for this GPU, and the
            // PTX goes back to the node for other workers.
            let (ptx, compiled) = match kind {
                SourceKind::Ptx => (text.to_owned(), false),
                SourceKind::Cuda { options } => {
                    // In a confined child process (`crate::sandbox`): the
                    // compiler reads no file of this machine but the
                    // offered headers, and is killed at its time bound.
                    let (major, minor) = self
                        .device
                        .compute_capability()
                        .map_err(|e| map(st, "compute capability", e))?;
                    let arch = format!("compute_{major}{minor}");
                    let ptx =
                        self.compiler
                            .compile(&name, text, options, &arch)
                            .map_err(|log| {
                                DeviceError::new(
                                    st,
                                    format!("module `{name}` failed to compile:\n{log}"),
                                )
                            })?;
                    (ptx, true)
                }
            };
            let module = Module::ptx(ptx.as_str())
                .map_err(|e| map(st, "PTX", e))?
                .named(name);
            // JIT-loaded now (once per content in this process), so the
            // log of a bad module comes back with this request.
            module
                .load_on(&self.device)
                .map_err(|e| map(st, "load", e))?;
            self.modules.insert(hash, module);
            Ok(compiled.then_some(ptx))
        }

        fn unload_module(&mut self, hash: ModuleHash) -> Result<(), DeviceError> {
            let module = self
                .modules
                .remove(&hash)
                .ok_or_else(|| not_found("module", hash))?;
            // Nothing of it may run when it unloads: wait for every stream,
            // then let go of its kernels and its cache entry.
            self.sync_all()?;
            self.kernels.remove(&hash);
            self.last_kernel = None;
            // SAFETY: every stream of this context is idle, and the kernels
            // resolved from this module are dropped.
            unsafe { module.evict_on(&self.device) };
            Ok(())
        }

        fn launch(
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

        fn record(&mut self, stream: StreamId, event: Id) -> Result<(), DeviceError> {
            if self.buffers.contains_key(&event) {
                return Err(DeviceError::new(
                    Status::BadRequest,
                    format!("{event} is a buffer, not an event"),
                ));
            }
            let stream = self.stream(stream)?;
            let st = Status::Internal;
            match self.events.get(&event) {
                Some(ev) => ev
                    .record(&stream)
                    .map_err(|e| driver(st, "cuEventRecord", e)),
                None => {
                    let ev = stream
                        .record_event(None)
                        .map_err(|e| driver(st, "cuEventRecord", e))?;
                    self.events.insert(event, ev);
                    Ok(())
                }
            }
        }

        fn wait(&mut self, stream: StreamId, event: Id) -> Result<(), DeviceError> {
            let stream = self.stream(stream)?;
            let ev = self
                .events
                .get(&event)
                .ok_or_else(|| not_found("event", event))?;
            stream
                .wait(ev)
                .map_err(|e| driver(Status::Internal, "cuStreamWaitEvent", e))
        }

        fn finish(&mut self, out: &mut [u8]) -> Result<(), DeviceError> {
            // Waits for the copies (and surfaces kernel faults here).
            let synced = self.sync_touched();
            self.spare.settle(synced.is_ok());
            if synced.is_ok() {
                // Every use is done: nothing needs their events.
                self.pending.clear();
            } else {
                // Recorded (or, on a dead context, the buffers marked broken
                // and leaked when freed), never freed before their uses.
                let ids: Vec<Id> = self.pending.keys().copied().collect();
                for id in ids {
                    let _ = self.flush_use(id);
                }
            }
            let reads = std::mem::take(&mut self.reads);
            let arena_reads = std::mem::take(&mut self.arena_reads);
            if synced.is_err() {
                // Copies may still use it: never reuse or free it.
                std::mem::forget(self.arena.take());
            }
            synced?;
            if let Some(arena) = &mut self.arena {
                // Every copy of the batch is done (synced above).
                for (at, off, len) in arena_reads {
                    let bytes = arena.bytes(off, len)?;
                    if let Some(dst) = out.get_mut(at..at + len) {
                        dst.copy_from_slice(bytes);
                    }
                }
                arena.used = 0;
            }
            for (host, at) in reads {
                let bytes = host
                    .as_slice()
                    .map_err(|e| map(Status::ReadFailed, "device-to-host copy", e))?;
                if let Some(dst) = out.get_mut(at..at + bytes.len()) {
                    dst.copy_from_slice(bytes);
                }
            }
            Ok(())
        }
    }
}
