//! The device layer a worker process drives: the [`LeaseDevice`] trait, the real
//! [`CudaDevice`] and the in-memory test double [`MemoryDevice`].

use cuda_core::blas::{BlasScalar, Gemm};
use cuda_core::rand::{Fill, RandScalar};

use crate::proto::{
    Command, DeviceInfo, Dtype, GemmSpec, Id, LaunchSpec, ModuleHash, Op, RandDist, RandSpec,
    SourceKind, Status, StreamId,
};

mod cuda;
mod error;
mod memory;

pub use cuda::CudaDevice;
pub(crate) use error::not_found;
pub use error::DeviceError;
pub use memory::MemoryDevice;

/// Most streams one device context makes (the node's per-lease limit is
/// lower; this bounds a worker whatever it is sent).
pub const MAX_DEVICE_STREAMS: usize = 64;

/// One device context, owned by one worker process; streams are made on demand.
///
/// Commands are enqueued: each runs after the earlier commands of its
/// stream, the event record a [`LeaseDevice::wait`] names, and the earlier
/// conflicting uses (a write against any use) of the same buffer on any
/// stream; otherwise streams run concurrently. Errors at enqueue (unknown
/// ids, bounds, arguments) leave nothing enqueued; a kernel fault is sticky
/// and surfaces at [`LeaseDevice::finish`].
///
/// # Errors
///
/// Every method's: NOT_FOUND for an unknown id, module, kernel, graph or
/// timer; BAD_REQUEST for a range outside its buffer, a copy within one
/// buffer, an id in use or of another kind, or bad arguments;
/// CAPACITY_EXCEEDED when out of memory; LOAD_FAILED for a module that does
/// not load; else a driver or library error. A kernel fault is sticky:
/// LAUNCH_FAILED at [`LeaseDevice::finish`] and [`LeaseDevice::poll_sealed`].
pub trait LeaseDevice {
    /// Describes the device, with free memory measured now.
    fn info(&mut self) -> Result<DeviceInfo, DeviceError>;
    /// Allocates `size` zeroed bytes as buffer `id`, ordered on `stream`.
    fn alloc(&mut self, stream: StreamId, id: Id, size: u64) -> Result<(), DeviceError>;
    /// Allocates `size` bytes as buffer `id`, ordered on `stream`, for a
    /// write of all of them that the caller enqueues next on `stream`; the
    /// bytes are unspecified until then, and the caller zeroes them
    /// ([`LeaseDevice::fill`]) if that write is not enqueued. By default
    /// they are zeroed, as [`LeaseDevice::alloc`] does.
    fn alloc_overwritten(
        &mut self,
        stream: StreamId,
        id: Id,
        size: u64,
    ) -> Result<(), DeviceError> {
        self.alloc(stream, id, size)
    }
    /// Frees buffer or event `id` after every enqueued use of it.
    fn free(&mut self, stream: StreamId, id: Id) -> Result<(), DeviceError>;
    /// Enqueues a copy of `data` into buffer `id` at `offset`; `data` is
    /// free once this returns.
    fn write(
        &mut self,
        stream: StreamId,
        id: Id,
        offset: u64,
        data: &[u8],
    ) -> Result<(), DeviceError>;
    /// Enqueues a read of `len` bytes of buffer `id` at `offset`; they land
    /// in `out[at..at + len]` of the next [`LeaseDevice::finish`].
    fn read(
        &mut self,
        stream: StreamId,
        id: Id,
        offset: u64,
        len: u64,
        at: usize,
    ) -> Result<(), DeviceError>;
    /// Reads `out.len()` bytes of buffer `id` at `offset` now, after every
    /// enqueued write of it (the streamed MEM_READ path); a sticky fault
    /// of earlier work is its error.
    fn read_now(&mut self, id: Id, offset: u64, out: &mut [u8]) -> Result<(), DeviceError>;
    /// Registers `len` bytes at `ptr` (the node's ring) for
    /// [`LeaseDevice::write_chunk`] and [`LeaseDevice::read_chunk`] to copy
    /// straight from and to; whether it did (by default not).
    ///
    /// # Safety
    /// The memory stays mapped as long as the device lives.
    unsafe fn register_ring(&mut self, _ptr: *mut u8, _len: usize) -> bool {
        false
    }
    /// A streamed MEM_WRITE chunk: copies `data` (in the ring) into buffer
    /// `id` at `offset`; done, and `data` free, once
    /// [`LeaseDevice::chunks_done`] has returned.
    fn write_chunk(&mut self, id: Id, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        self.write(0, id, offset, data)
    }
    /// A chunk of a streamed MEM_READ: copies `out.len()` bytes of buffer `id`
    /// at `offset` into `out` (in the ring), which nothing may touch until
    /// [`LeaseDevice::chunks_done`] has returned.
    fn read_chunk(&mut self, id: Id, offset: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        self.read_now(id, offset, out)
    }
    /// Waits for the chunks since the last call.
    fn chunks_done(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }
    /// Loads a module (PTX: JIT; CUDA C: compiled by NVRTC for this device)
    /// under its content hash, returning the PTX compiled from CUDA C (the node
    /// keeps it to spare other workers the compile). A loaded hash is a no-op;
    /// LOAD_FAILED carries the JIT or compile log.
    fn load_module(
        &mut self,
        hash: ModuleHash,
        kind: &SourceKind,
        text: &str,
    ) -> Result<Option<String>, DeviceError>;
    /// Unloads a module after everything enqueued.
    fn unload_module(&mut self, hash: ModuleHash) -> Result<(), DeviceError>;
    /// Enqueues a kernel launch; its memory arguments are the lease's buffers
    /// (BAD_REQUEST for a GPU_SUBMIT argument among them).
    fn launch(&mut self, stream: StreamId, spec: &LaunchSpec<'_>) -> Result<(), DeviceError>;
    /// Records event `event` on `stream` (made on first use).
    fn record(&mut self, stream: StreamId, event: Id) -> Result<(), DeviceError>;
    /// Makes `stream` wait for the last record of `event`.
    fn wait(&mut self, stream: StreamId, event: Id) -> Result<(), DeviceError>;
    /// Captures graph `graph` natively: `enqueue` enqueues the body's
    /// commands while `streams` (the body's, its first stream first)
    /// capture. `Ok(true)`: the device keeps the graph for
    /// [`LeaseDevice::launch_graph`]; `Ok(false)`: it does not capture (the
    /// worker replays the commands).
    fn capture_graph(
        &mut self,
        graph: Id,
        streams: &[StreamId],
        enqueue: &mut dyn FnMut(&mut dyn LeaseDevice) -> Result<(), DeviceError>,
    ) -> Result<bool, DeviceError> {
        let _ = (graph, streams, enqueue);
        Ok(false)
    }
    /// Captures prepared body `graph` natively, as
    /// [`LeaseDevice::capture_graph`] does, its uploads reading `bytes.0`
    /// bytes and its downloads writing `bytes.1` bytes that each
    /// [`LeaseDevice::run_prepared`] brings and takes; called again, it
    /// captures another instance, for runs in flight together. `Ok(false)`
    /// (the default): not captured (the worker replays the commands).
    fn capture_prepared(
        &mut self,
        graph: Id,
        streams: &[StreamId],
        bytes: (u64, u64),
        enqueue: &mut dyn FnMut(&mut dyn LeaseDevice) -> Result<(), DeviceError>,
    ) -> Result<bool, DeviceError> {
        let _ = (graph, streams, bytes, enqueue);
        Ok(false)
    }
    /// Runs a prepared body [`LeaseDevice::capture_prepared`] kept, after
    /// the work on `stream` so far, with `inputs` for its uploads; its
    /// downloads land at `at` in the output of the batch's end, as reads
    /// do. `Ok(false)` (the default) when it cannot now (not captured, or
    /// every instance still serves an earlier run): the worker captures
    /// another instance or replays the commands instead.
    fn run_prepared(
        &mut self,
        stream: StreamId,
        graph: Id,
        inputs: &[u8],
        at: usize,
    ) -> Result<bool, DeviceError> {
        let _ = (stream, graph, inputs, at);
        Ok(false)
    }
    /// Replays a graph [`LeaseDevice::capture_graph`] kept, after the work
    /// on `stream` so far.
    fn launch_graph(&mut self, stream: StreamId, graph: Id) -> Result<(), DeviceError> {
        let _ = stream;
        Err(DeviceError::new(
            Status::NotFound,
            format!("no graph {graph} on this device"),
        ))
    }
    /// Frees a graph [`LeaseDevice::capture_graph`] (or a prepared body
    /// [`LeaseDevice::capture_prepared`]) kept, after its replays.
    fn free_graph(&mut self, graph: Id) {
        let _ = graph;
    }
    /// Bytes of page-locked host memory kept as the staging of prepared
    /// bodies [`LeaseDevice::capture_prepared`] captured (no reservation
    /// covers it; a device bounds it itself). 0 by default.
    fn staging_bytes(&self) -> u64 {
        0
    }
    /// Starts timer `timer` (a new id) where `stream` is now.
    fn timer_start(&mut self, stream: StreamId, timer: Id) -> Result<(), DeviceError>;
    /// Ends timer `timer` where `stream` is now, removing it: the nanoseconds
    /// since its start, a little-endian `u64`, land in `out[at..at + 8]` of the
    /// next [`LeaseDevice::finish`].
    fn timer_end(&mut self, stream: StreamId, timer: Id, at: usize) -> Result<(), DeviceError>;
    /// Enqueues setting `len` bytes of buffer `id` at `offset` to `value`.
    fn fill(
        &mut self,
        stream: StreamId,
        id: Id,
        offset: u64,
        len: u64,
        value: u8,
    ) -> Result<(), DeviceError>;
    /// Enqueues a copy of `len` bytes from `src` to `dst` (buffer, offset).
    fn copy(
        &mut self,
        stream: StreamId,
        src: (Id, u64),
        dst: (Id, u64),
        len: u64,
    ) -> Result<(), DeviceError>;
    /// Enqueues a matrix product by the device's own BLAS (cuBLAS on a
    /// GPU), ordered like a launch that reads `A` and `B` and writes `C`.
    fn gemm(&mut self, stream: StreamId, spec: &GemmSpec) -> Result<(), DeviceError>;
    /// Enqueues a random fill by the device's own generator (cuRAND's Philox
    /// on a GPU, restarted at the spec's seed), ordered like a launch writing
    /// its buffer.
    fn rand_fill(&mut self, stream: StreamId, spec: &RandSpec) -> Result<(), DeviceError>;
    /// Waits for all enqueued work and delivers the enqueued reads into `out`;
    /// LAUNCH_FAILED (sticky) when a kernel faulted.
    fn finish(&mut self, out: &mut [u8]) -> Result<(), DeviceError>;
    /// Seals what was enqueued since the last seal (or finish) as one batch
    /// whose reads fill `out_len` bytes, without waiting: later commands
    /// enqueue while it runs (ordered by stream, event and buffer, as always)
    /// and [`LeaseDevice::poll_sealed`] says when it is done.
    fn seal(&mut self, out_len: usize) -> Ticket;
    /// The reads of sealed batch `ticket` once its work is done (the
    /// ticket is then spent), `None` while it runs.
    fn poll_sealed(&mut self, ticket: Ticket) -> Option<Result<Vec<u8>, DeviceError>>;
    /// Arms a wake-up for sealed batch `ticket`: the descriptor returned turns
    /// readable once its work is done (the caller drains it, then polls). `None`
    /// (the default) when the device cannot or the batch needs no wait: poll it.
    fn wake_when_done(&mut self, ticket: Ticket) -> Option<std::os::fd::RawFd> {
        let _ = ticket;
        None
    }

    /// Enqueues command `c` through its op's method: `data` is a write's bytes;
    /// a read's bytes (or a timer's nanoseconds) land at `at` in the output of
    /// the next [`LeaseDevice::finish`].
    ///
    /// # Errors
    /// The op's method's; BAD_REQUEST for a graph command (the worker's).
    fn enqueue(&mut self, c: &Command<'_>, data: &[u8], at: usize) -> Result<(), DeviceError> {
        let s = c.stream;
        match &c.op {
            Op::Alloc { buf, size } => self.alloc(s, *buf, *size),
            Op::Write { buf, offset, .. } => self.write(s, *buf, *offset, data),
            Op::Read { buf, offset, len } => self.read(s, *buf, *offset, *len, at),
            Op::Free { id } => self.free(s, *id),
            Op::Launch(spec) => self.launch(s, spec),
            Op::Record { event } => self.record(s, *event),
            Op::Wait { event } => self.wait(s, *event),
            Op::Fill {
                buf,
                offset,
                len,
                value,
            } => self.fill(s, *buf, *offset, *len, *value),
            Op::Copy { src, dst, len } => {
                self.copy(s, (src.buf, src.offset), (dst.buf, dst.offset), *len)
            }
            Op::TimerStart { timer } => self.timer_start(s, *timer),
            Op::TimerEnd { timer } => self.timer_end(s, *timer, at),
            Op::Gemm(g) => self.gemm(s, g),
            Op::RandFill(r) => self.rand_fill(s, r),
            Op::GraphBegin { .. }
            | Op::GraphEnd { .. }
            | Op::GraphLaunch { .. }
            | Op::PrepareBegin { .. }
            | Op::Run { .. } => Err(DeviceError::new(
                Status::BadRequest,
                "a graph command out of place",
            )),
        }
    }
}

/// `g` as `cuda-core` describes a product, in `T`.
pub(crate) fn core_gemm<T: BlasScalar>(g: &GemmSpec, scalar: impl Fn(f64) -> T) -> Gemm<T> {
    let mut c = Gemm::<T>::new(g.m as usize, g.n as usize, g.k as usize);
    [c.lda, c.ldb, c.ldc] = g.ld.map(|v| v as usize);
    [c.transpose_a, c.transpose_b] = g.transpose;
    c.alpha = scalar(g.alpha());
    c.beta = scalar(g.beta());
    c.batch = g.batch as usize;
    [c.stride_a, c.stride_b, c.stride_c] = g.strides.map(|v| v as usize);
    c
}

/// The bytes each of `A`, `B` and `C` of `g` spans from its offset, by
/// `cuda-core`'s rules for a product (leading dimensions, `C`'s batch not
/// overlapping, sizes cuBLAS takes), or why it cannot run.
pub(crate) fn gemm_spans(g: &GemmSpec) -> Result<[u64; 3], String> {
    let extents = core_gemm(g, |v| v).extents().map_err(|e| match e {
        cuda_core::Error::InvalidArgument(m) => m,
        e => e.to_string(),
    })?;
    let size = g.dtype.size();
    let mut out = [0; 3];
    for ((o, e), (name, _)) in out.iter_mut().zip(extents).zip(g.operands()) {
        *o = (e as u64)
            .checked_mul(size)
            .ok_or_else(|| format!("gemm: {name} spans more than 2^64 bytes"))?;
    }
    Ok(out)
}

/// `r` as `cuda-core` describes a fill, in `T`.
pub(crate) fn core_fill<T: RandScalar>(r: &RandSpec, scalar: impl Fn(f64) -> T) -> Fill<T> {
    match r.dist {
        RandDist::Uniform => Fill::uniform(r.seed),
        RandDist::Normal { mean, std_dev } => Fill::normal(
            r.seed,
            scalar(f64::from_bits(mean)),
            scalar(f64::from_bits(std_dev)),
        ),
    }
}

/// The bytes `r` writes from its offset, by `cuda-core`'s rules for a
/// fill (a normal one in pairs, finite parameters), or why it cannot run.
pub(crate) fn fill_bytes(r: &RandSpec) -> Result<u64, String> {
    let len = usize::try_from(r.len).map_err(|_| format!("random fill: {} elements", r.len))?;
    let checked = match r.dtype {
        Dtype::F32 => core_fill(r, |v| v as f32).check(len),
        Dtype::F64 => core_fill(r, |v| v).check(len),
        Dtype::Bf16 | Dtype::F16 => {
            return Err(format!(
                "random fill: cuRAND fills f32 and f64, not {}",
                r.dtype.name()
            ))
        }
    };
    checked.map_err(|e| match e {
        cuda_core::Error::InvalidArgument(m) => m,
        e => e.to_string(),
    })?;
    r.bytes()
        .ok_or_else(|| format!("random fill: {} elements span more than 2^64 bytes", r.len))
}

/// A sealed batch of a [`LeaseDevice`] (see [`LeaseDevice::seal`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket(pub u64);
