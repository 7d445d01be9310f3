//! The real device, [`CudaDevice`], on `cuda-core` and `cuda-async`.

use std::collections::HashMap;
use std::sync::Arc;

use cuda_async::{CudaStream, DeviceBuffer, Kernel, Module, PinnedBuffer};
use cuda_core::{ArenaRead, ArgList, CudaEvent, ParamClass, StagingArena};

use super::error::{check_fresh, driver, map, not_found, range};
use super::{DeviceArg, DeviceError, LaunchDims, LeaseDevice, Ticket};
use crate::proto::{DeviceInfo, GemmSpec, Id, ModuleHash, RandSpec, SourceKind, Status, StreamId};
use crate::sandbox::Compiler;

mod blas;
mod buffers;
mod copies;
mod graphs;
mod launch;
mod rand;
mod sealed;
mod staging;
mod streams;
mod wake;

use launch::LastKernel;

/// Events of timers measure time (the lease's other events do not).
const TIMING: cuda_core::cudarc::driver::sys::CUevent_flags =
    cuda_core::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
use staging::SpareBuffers;

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
    /// Started timers: their start events (timing enabled).
    timers: HashMap<Id, CudaEvent>,
    /// Timers ended since the last finish: start, end, where the
    /// nanoseconds land.
    timer_reads: Vec<(CudaEvent, CudaEvent, usize)>,
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
    /// first use; see `staging::new_arena`).
    arena: Option<StagingArena>,
    /// Reads into the arena since the last finish: (where in the
    /// reply, where in the arena).
    arena_reads: Vec<(usize, ArenaRead)>,
    /// The kernel of the last launch (see [`CudaDevice::launchable`]).
    last_kernel: Option<LastKernel>,
    /// The streams this batch enqueued work on (see
    /// [`CudaDevice::sync_touched`]).
    touched: Vec<Arc<CudaStream>>,
    /// A launch's argument kinds, for the parameter check (reused).
    arg_specs: Vec<(usize, ParamClass, &'static str)>,
    /// A launch's argument values and the driver's parameter array
    /// (reused: no allocation per launch once it has grown).
    arg_list: ArgList,
    /// Compiles tenants' CUDA C in a confined child process.
    compiler: Arc<Compiler>,
    /// The node's ring, registered for direct copies (`register_ring`).
    ring: Option<cuda_core::HostRegistration>,
    /// Graphs captured natively, by id.
    graphs: HashMap<Id, cuda_core::TrackedGraph>,
    /// Where a capture's allocations go (made on first capture).
    capture_alloc: Option<Arc<CudaStream>>,
    /// A graph's body is being captured: writes bypass the batch arena
    /// (reused after the batch, which a replay would read).
    capturing: bool,
    /// Arenas of batches that are done, for the next batches.
    spare_arenas: Vec<StagingArena>,
    /// Sealed batches, running on (see `LeaseDevice::seal`).
    sealed: HashMap<Ticket, Result<sealed::InFlight, DeviceError>>,
    next_ticket: u64,
    /// Wakes the worker when an armed batch is done (made on first use).
    wake: Option<wake::Wake>,
}

/// The stream of streamed uploads' chunks (downloads' take
/// `StreamId::MAX`): ids no lease's commands use.
const UPLOAD_STREAM: StreamId = StreamId::MAX - 1;

/// Makes `device`'s primary context current on this thread.
fn bind(device: &cuda_async::Device) -> Result<(), DeviceError> {
    device
        .context()
        .bind_to_thread()
        .map_err(|e| driver(Status::Internal, "cuCtxSetCurrent", e))
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
        bind(&device)?;
        // Every buffer of this device is a `cuda-core` buffer, used only
        // by the commands below, each of which orders itself with the
        // buffer's own use events (`before_*`/`after_*`, and the drop
        // orders the free after them). cudarc's per-slice events would
        // repeat that work: two more event records and waits per buffer
        // argument of every launch (about 5 us of the 8 us a launch
        // took here on an H100). `cuda-core`'s `Device::new` opened this
        // context with cudarc's tracking off, before it allocated any
        // slice; this process has no other CUDA user.
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
            timers: HashMap::new(),
            timer_reads: Vec::new(),
            modules: HashMap::new(),
            kernels: HashMap::new(),
            reads: Vec::new(),
            pending: HashMap::new(),
            spare: SpareBuffers::default(),
            arena: None,
            arena_reads: Vec::new(),
            last_kernel: None,
            touched: Vec::new(),
            arg_specs: Vec::new(),
            arg_list: ArgList::new(),
            compiler: Arc::default(),
            ring: None,
            graphs: HashMap::new(),
            capture_alloc: None,
            capturing: false,
            spare_arenas: Vec::new(),
            sealed: HashMap::new(),
            next_ticket: 0,
            wake: None,
        })
    }

    /// Compiles CUDA C with `compiler` (its headers, time and log
    /// bounds) from now on; the default offers no headers.
    pub fn set_compiler(&mut self, compiler: Arc<Compiler>) {
        self.compiler = compiler;
    }
}

impl LeaseDevice for CudaDevice {
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
            limits: crate::proto::DeviceLimits {
                multiprocessors: info.multiprocessors,
                warp_size: info.warp_size,
                max_threads_per_block: info.max_threads_per_block,
                max_threads_per_multiprocessor: info.max_threads_per_multiprocessor,
                shared_memory_per_block: info.shared_memory_per_block as u32,
                shared_memory_per_block_optin: info.shared_memory_per_block_optin as u32,
                shared_memory_per_multiprocessor: info.shared_memory_per_multiprocessor as u32,
                l2_cache_bytes: info.l2_cache_bytes as u32,
                memory_bus_width_bits: info.memory_bus_width_bits,
                clock_khz: info.clock_khz.unwrap_or(0),
                memory_clock_khz: info.memory_clock_khz.unwrap_or(0),
            },
        })
    }

    fn alloc(&mut self, stream: StreamId, id: Id, size: u64) -> Result<(), DeviceError> {
        let taken = self.buffers.contains_key(&id) || self.events.contains_key(&id);
        check_fresh(taken, id)?;
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
        // All `n` bytes, ordered after the buffer's earlier uses (a
        // recycled buffer) or its allocation on this stream.
        buf.memset_unordered(0..n, 0, &stream)
            .map_err(|e| map(Status::Internal, "cuMemsetD8Async", e))
    }

    fn free(&mut self, _stream: StreamId, id: Id) -> Result<(), DeviceError> {
        if self.events.remove(&id).is_some() || self.timers.remove(&id).is_some() {
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
        self.enqueue_write(stream, id, offset, data)
    }

    fn read(
        &mut self,
        stream: StreamId,
        id: Id,
        offset: u64,
        len: u64,
        at: usize,
    ) -> Result<(), DeviceError> {
        self.enqueue_read(stream, id, offset, len, at)
    }

    fn fill(
        &mut self,
        stream: StreamId,
        id: Id,
        offset: u64,
        len: u64,
        value: u8,
    ) -> Result<(), DeviceError> {
        self.enqueue_fill(stream, id, offset, len, value)
    }

    fn copy(
        &mut self,
        stream: StreamId,
        src: (Id, u64),
        dst: (Id, u64),
        len: u64,
    ) -> Result<(), DeviceError> {
        self.enqueue_copy(stream, src, dst, len)
    }

    fn gemm(&mut self, stream: StreamId, spec: &GemmSpec) -> Result<(), DeviceError> {
        self.enqueue_gemm(stream, spec)
    }

    fn rand_fill(&mut self, stream: StreamId, spec: &RandSpec) -> Result<(), DeviceError> {
        self.enqueue_rand_fill(stream, spec)
    }

    unsafe fn register_ring(&mut self, ptr: *mut u8, len: usize) -> bool {
        // SAFETY: the caller keeps the ring mapped for the device's life;
        // the registration is dropped with the device.
        match unsafe { cuda_core::HostRegistration::new(&self.device, ptr, len) } {
            Ok(r) => {
                self.ring = Some(r);
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "the shared ring could not be registered: chunks are staged");
                false
            }
        }
    }

    fn write_chunk(&mut self, id: Id, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        // On a stream of its own (the buffer orders it after its earlier
        // uses), not behind the lease's other work on its streams.
        if !self.ring.as_ref().is_some_and(|r| r.contains(data)) {
            return self.write(UPLOAD_STREAM, id, offset, data);
        }
        let stream = self.stream(UPLOAD_STREAM)?;
        self.flush_use(id)?;
        let buf = self
            .buffers
            .get_mut(&id)
            .ok_or_else(|| not_found("buffer", id))?;
        let r = range(buf.len(), offset, data.len() as u64)?;
        let ring = self.ring.as_ref().expect("checked above");
        // SAFETY: the worker replies (and the node reuses the slot) only
        // after `chunks_done` has waited for the stream.
        unsafe { ring.upload(data, Self::raw_mut(buf), r.start, &stream) }
            .map_err(|e| map(Status::BadRequest, "host-to-device copy", e))
    }

    fn read_chunk(&mut self, id: Id, offset: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        if !self.ring.as_ref().is_some_and(|r| r.contains(out)) {
            return self.read_now(id, offset, out);
        }
        // On a stream of its own (the buffer orders it after its writes).
        let stream = self.stream(StreamId::MAX)?;
        self.flush_use(id)?;
        let buf = self.buffer(id)?;
        let r = range(buf.len(), offset, out.len() as u64)?;
        let ring = self.ring.as_ref().expect("checked above");
        // SAFETY: nothing reads the slot (the worker replies, and the node
        // sends it) before `chunks_done` has waited for the stream.
        unsafe { ring.download(Self::raw(buf), r.start, out, &stream) }
            .map_err(|e| map(Status::ReadFailed, "device-to-host copy", e))
    }

    fn chunks_done(&mut self) -> Result<(), DeviceError> {
        self.finish(&mut [])
    }

    fn read_now(&mut self, id: Id, offset: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        // On a stream of its own (the buffer orders it after its writes).
        self.read(StreamId::MAX, id, offset, out.len() as u64, 0)?;
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
                let ptx = self
                    .compiler
                    .compile(&name, text, options, &arch)
                    .map_err(|log| {
                        DeviceError::new(st, format!("module `{name}` failed to compile:\n{log}"))
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
        self.enqueue_launch(stream, module, kernel, dims, args)
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

    fn timer_start(&mut self, stream: StreamId, timer: Id) -> Result<(), DeviceError> {
        let taken = self.buffers.contains_key(&timer)
            || self.events.contains_key(&timer)
            || self.timers.contains_key(&timer);
        check_fresh(taken, timer)?;
        let stream = self.stream(stream)?;
        let ev = stream
            .record_event(Some(TIMING))
            .map_err(|e| driver(Status::Internal, "cuEventRecord", e))?;
        self.timers.insert(timer, ev);
        Ok(())
    }

    fn timer_end(&mut self, stream: StreamId, timer: Id, at: usize) -> Result<(), DeviceError> {
        let stream = self.stream(stream)?;
        let start = self
            .timers
            .remove(&timer)
            .ok_or_else(|| not_found("timer", timer))?;
        let end = stream
            .record_event(Some(TIMING))
            .map_err(|e| driver(Status::Internal, "cuEventRecord", e))?;
        // (`stream()` noted the stream: the batch's end waits for it.)
        self.timer_reads.push((start, end, at));
        Ok(())
    }

    fn capture_graph(
        &mut self,
        graph: Id,
        streams: &[StreamId],
        enqueue: &mut dyn FnMut(&mut dyn LeaseDevice) -> Result<(), DeviceError>,
    ) -> Result<bool, DeviceError> {
        self.capture_native(graph, streams, enqueue)
    }

    fn launch_graph(&mut self, stream: StreamId, graph: Id) -> Result<(), DeviceError> {
        self.launch_native(stream, graph)
    }

    fn free_graph(&mut self, graph: Id) {
        // Released after its last replay, on the reclaimer thread.
        self.graphs.remove(&graph);
    }

    fn seal(&mut self, out_len: usize) -> Ticket {
        self.seal_batch(out_len)
    }

    fn poll_sealed(&mut self, ticket: Ticket) -> Option<Result<Vec<u8>, DeviceError>> {
        self.poll_batch(ticket)
    }

    fn wake_when_done(&mut self, ticket: Ticket) -> Option<std::os::fd::RawFd> {
        self.arm_wake(ticket)
    }

    fn finish(&mut self, out: &mut [u8]) -> Result<(), DeviceError> {
        // Waits for the copies (and surfaces kernel faults here).
        let synced = self.sync_touched();
        self.spare.settle(synced.is_ok());
        if synced.is_ok() && self.sealed.is_empty() {
            // Every use is done: nothing needs their events.
            self.pending.clear();
        } else {
            // Sealed batches may still use them (`sync_touched` waited
            // only for the streams touched since the last seal): their
            // uses go into their events, so that later copies, frees and
            // other streams wait for them. (On a dead context the buffers
            // are marked broken and leaked when freed, never freed before
            // their uses.)
            self.flush_pending();
        }
        let reads = std::mem::take(&mut self.reads);
        let timers = std::mem::take(&mut self.timer_reads);
        let arena_reads = std::mem::take(&mut self.arena_reads);
        if synced.is_err() {
            // Copies may still use it: never reuse or free it.
            std::mem::forget(self.arena.take());
        }
        synced?;
        if let Some(arena) = &self.arena {
            // Every copy of the batch is done (the arena waited for them
            // in `sync_touched`).
            sealed::arena_reads_into(out, arena, arena_reads)?;
        }
        sealed::reads_into(out, reads, timers)?;
        Ok(())
    }
}
