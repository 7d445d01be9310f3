//! The real device, [`CudaDevice`], on `cuda-core` and `cuda-async`.

use std::collections::HashMap;

use crate::proto::IdMap;
use std::sync::Arc;

use cuda_async::{CudaStream, DeviceBuffer, Kernel, Module, PinnedBuffer};
use cuda_core::{ArenaRead, ArgList, CudaEvent, ParamClass, StagingArena};

use super::error::{driver, map};
use super::{DeviceError, Ticket};
use crate::proto::{Id, ModuleHash, Status, StreamId};
use crate::sandbox::Compiler;

mod buffers;
mod launch;
mod ops;
mod prepared;
mod sealed;
mod staging;
mod streams;
mod wake;

use launch::LastKernel;

/// Events of timers measure time (the lease's other events do not).
const TIMING: cuda_core::cudarc::driver::sys::CUevent_flags =
    cuda_core::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
use staging::SpareBuffers;

/// A real device: the device's primary context (owned by the worker process
/// alone) and streams made on demand. Memory is `cuda-core` device buffers,
/// which order their uses across streams and their frees after every use;
/// copies go through pinned staging memory, never pageable; kernels are
/// `cuda-core` modules (PTX JIT-loaded, CUDA C compiled by NVRTC once per
/// content) launched with argument lists checked against their PTX
/// parameters.
///
/// A launch costs one driver call: a buffer's uses on one stream are
/// recorded in its use events only when something could depend on them (a
/// use on another stream, a copy, the free, the batch's end); see
/// `flush_use`.
#[derive(Debug)]
pub struct CudaDevice {
    device: cuda_async::Device,
    streams: IdMap<StreamId, Arc<CudaStream>>,
    buffers: IdMap<Id, DeviceBuffer<u8>>,
    events: IdMap<Id, CudaEvent>,
    /// Started timers: their start events (timing enabled).
    timers: IdMap<Id, CudaEvent>,
    /// Timers ended since the last finish: start, end, where the result lands.
    timer_reads: Vec<(CudaEvent, CudaEvent, usize)>,
    modules: IdMap<ModuleHash, Module>,
    /// Kernels resolved so far, by module and name.
    kernels: IdMap<ModuleHash, IdMap<String, Kernel>>,
    /// Reads enqueued since the last finish: where they land.
    reads: Vec<(PinnedBuffer<u8>, usize)>,
    /// Buffers whose latest uses, on the stream named, are not yet recorded in
    /// their use events (see [`CudaDevice::flush_use`]).
    pending: IdMap<Id, StreamId>,
    /// Small freed buffers kept for the next allocation of their size.
    spare: SpareBuffers,
    /// Where small writes are staged and small reads land (made on first use).
    arena: Option<StagingArena>,
    /// Reads into the arena since the last finish: (reply offset, arena read).
    arena_reads: Vec<(usize, ArenaRead)>,
    /// The kernel of the last launch (see [`CudaDevice::launchable`]).
    last_kernel: Option<LastKernel>,
    /// The streams this batch enqueued work on (see
    /// [`CudaDevice::sync_touched`]).
    touched: Vec<Arc<CudaStream>>,
    /// A launch's argument kinds, for the parameter check (reused).
    arg_specs: Vec<(usize, ParamClass, &'static str)>,
    /// A launch's argument values and the driver's parameter array (reused).
    arg_list: ArgList,
    /// Compiles tenants' CUDA C in a confined child process.
    compiler: Arc<Compiler>,
    /// The node's ring, registered for direct copies (`register_ring`).
    ring: Option<cuda_core::HostRegistration>,
    /// Graphs captured natively, by id.
    graphs: IdMap<Id, cuda_core::TrackedGraph>,
    /// Where a capture's allocations go (made on first capture).
    capture_alloc: Option<Arc<CudaStream>>,
    /// A graph's body is being captured: writes bypass the batch arena
    /// (reused after the batch, which a replay would read).
    capturing: bool,
    /// Prepared bodies captured natively, by id, each body's instances
    /// (see `prepared`).
    prepared: IdMap<Id, Vec<std::rc::Rc<prepared::PreparedGraph>>>,
    /// Bytes of staging `prepared`'s instances keep, all together (at most
    /// `prepared::STAGING_MAX`).
    staged: usize,
    /// The staging of the prepared body being captured.
    staging: Option<prepared::Staging>,
    /// Runs of prepared bodies since the last seal or finish: their
    /// outputs' places in the reply's data.
    prepared_reads: Vec<prepared::PreparedRead>,
    /// Arenas of batches that are done, for the next batches.
    spare_arenas: Vec<StagingArena>,
    /// Sealed batches, running on (see `LeaseDevice::seal`).
    sealed: HashMap<Ticket, Result<sealed::InFlight, DeviceError>>,
    /// Done events of batches that are done, recorded again by the next
    /// seals (no event made and destroyed per batch).
    spare_events: Vec<cuda_core::CudaEvent>,
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
    /// Opens device `ordinal`'s primary context, bound to this thread.
    ///
    /// # Errors
    /// "no NVIDIA driver found" when libcuda cannot be loaded, or the
    /// driver's error.
    pub fn open(ordinal: usize) -> Result<Self, DeviceError> {
        let st = Status::Internal;
        let device = cuda_async::Device::new(ordinal)
            .map_err(|e| map(st, &format!("opening device {ordinal}"), e))?;
        // The worker's one thread drives this context from now on.
        bind(&device)?;
        // Batches allocate, synchronize and free: keep a little freed
        // memory pooled so a batch's first allocation need not map it
        // again, but bounded so freed memory goes back to other leases (the
        // node's headroom covers it).
        device
            .set_mem_pool_release_threshold(32 << 20)
            .map_err(|e| map(st, "memory pool", e))?;
        Ok(Self {
            device,
            streams: IdMap::default(),
            buffers: IdMap::default(),
            events: IdMap::default(),
            timers: IdMap::default(),
            timer_reads: Vec::new(),
            modules: IdMap::default(),
            kernels: IdMap::default(),
            reads: Vec::new(),
            pending: IdMap::default(),
            spare: SpareBuffers::default(),
            arena: None,
            arena_reads: Vec::new(),
            last_kernel: None,
            touched: Vec::new(),
            arg_specs: Vec::new(),
            arg_list: ArgList::new(),
            compiler: Arc::default(),
            ring: None,
            graphs: IdMap::default(),
            capture_alloc: None,
            capturing: false,
            prepared: IdMap::default(),
            staged: 0,
            staging: None,
            prepared_reads: Vec::new(),
            spare_arenas: Vec::new(),
            sealed: HashMap::new(),
            spare_events: Vec::new(),
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
