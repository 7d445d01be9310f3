//! Worker processes: one per lease (plus a small pool for GPU_SUBMIT), each
//! owning one CUDA context and stream.
//!
//! A kernel fault poisons every CUDA context of the process that made it, so
//! the node never touches CUDA itself: it starts a worker by re-executing a
//! program (by default its own executable) with the environment variable
//! [`WORKER_ENV`] set, and talks to it over the child's stdin/stdout with the
//! same framing as the wire ([`crate::proto`]). The program must call
//! [`main_if_worker`] first thing in `main`; the `cuda-lease-node` binary
//! does, so any process may point [`WorkerSpec::program`] at it.
//!
//! When the node goes away the worker reads end-of-file and exits; when the
//! lease ends the node kills it. Either way the driver frees everything the
//! worker held.

use std::collections::HashSet;
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::Mutex as StdMutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::BufReader;
use tokio::process::{Child, ChildStdin, Command};

use crate::device::{CudaDevice, Device, DeviceArg, DeviceError, LaunchDims, MemoryDevice};
use crate::hops::{self, HopTimer};
use crate::proto::{
    self, from_body, to_body, ArgView, Commands, DeviceInfo, Frame, GpuSubmit, Header, Id,
    KernelArg, Limits, ModuleHash, OpView as Op, Opcode, SourceKind, Status, StreamId,
};
use crate::sandbox::{CompileSandbox, Compiler};
use crate::shm::{ShmRing, WorkerRing, SHM_ENV};

/// Environment variable that turns a process into a worker. Its value names
/// the device: `cuda:<ordinal>` or `memory:<capacity bytes>`.
pub const WORKER_ENV: &str = "CUDA_LEASE_WORKER";

/// Environment variable with a worker's spin budget in microseconds
/// ([`WorkerSpec::spin`]).
const SPIN_ENV: &str = "CUDA_LEASE_WORKER_SPIN_US";

/// Which device a worker drives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSpec {
    /// A real GPU.
    Cuda {
        /// CUDA ordinal.
        ordinal: usize,
    },
    /// The in-memory test double ([`MemoryDevice`]): host memory, real
    /// streams and events, a few test kernels run on the host.
    Memory {
        /// Bytes of "device" memory per worker.
        capacity: u64,
    },
}

impl DeviceSpec {
    fn to_env(&self) -> String {
        match self {
            DeviceSpec::Cuda { ordinal } => format!("cuda:{ordinal}"),
            DeviceSpec::Memory { capacity } => format!("memory:{capacity}"),
        }
    }

    fn parse(s: &str) -> Option<Self> {
        let (kind, n) = s.split_once(':')?;
        match kind {
            "cuda" => Some(DeviceSpec::Cuda {
                ordinal: n.parse().ok()?,
            }),
            "memory" => Some(DeviceSpec::Memory {
                capacity: n.parse().ok()?,
            }),
            _ => None,
        }
    }
}

/// How to start a worker process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSpec {
    /// Executable that calls [`main_if_worker`] at start-up (for example the
    /// `cuda-lease-node` binary, or the current executable).
    pub program: PathBuf,
    /// Extra arguments.
    pub args: Vec<OsString>,
    /// Device to drive.
    pub device: DeviceSpec,
    /// How long the worker, after each reply, and the node, after each
    /// request, poll the pipe without sleeping before they block (see
    /// [`crate::spin`]); zero blocks at once.
    pub spin: Duration,
    /// How workers compile tenants' CUDA C: the headers offered, the time
    /// and log bounds ([`crate::sandbox`]).
    pub compile: CompileSandbox,
}

impl WorkerSpec {
    /// Workers run the current executable, which must call [`main_if_worker`].
    ///
    /// # Errors
    ///
    /// When the current executable's path is unknown.
    pub fn current_exe(device: DeviceSpec) -> std::io::Result<Self> {
        Ok(Self {
            program: std::env::current_exe()?,
            args: Vec::new(),
            device,
            spin: crate::spin::default_spin(),
            compile: CompileSandbox::default(),
        })
    }
}

/// A module a worker loads before a batch's commands; its source is the
/// next `len` bytes of the call's data.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WorkerLoad {
    pub(crate) hash: ModuleHash,
    pub(crate) kind: SourceKind,
    pub(crate) len: u32,
}

/// One chunk of a streamed MEM_WRITE (node -> worker: copy slot `slot` to
/// the memory) or MEM_READ (worker fills the slot), sent with the opcode
/// of the request; the data is in the shared ring, not the pipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ChunkOp {
    pub(crate) id: Id,
    pub(crate) offset: u64,
    pub(crate) slot: u32,
    pub(crate) len: u32,
}

/// A batch for a worker: the modules to load, then the client's commands
/// (checked by the node, and forwarded as the client encoded them). The
/// call's data holds the module sources, then the writes' payloads.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WorkerBatch<'a> {
    pub(crate) loads: Vec<WorkerLoad>,
    #[serde(borrow)]
    pub(crate) commands: Commands<'a>,
}

impl<'a> WorkerBatch<'a> {
    /// Decodes a worker's BATCH body: its loads, then the commands through
    /// [`proto::decode_commands`] (as serde would, faster).
    fn decode(body: &'a [u8]) -> Result<Self, proto::ProtoError> {
        let (loads, wire) = postcard::take_from_bytes::<Vec<WorkerLoad>>(body)
            .map_err(|e| proto::ProtoError::Body(e.to_string()))?;
        Ok(WorkerBatch {
            loads,
            commands: Commands(proto::decode_commands(wire)?),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WorkerFailure {
    pub(crate) status: Status,
    pub(crate) message: String,
    pub(crate) sticky: bool,
}

impl From<DeviceError> for WorkerFailure {
    fn from(e: DeviceError) -> Self {
        Self {
            status: e.status,
            message: e.message,
            sticky: e.sticky,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WorkerBatchReply {
    /// Commands enqueued; with `error` and `completed == ops.len()`, the
    /// failure came when waiting for them (a kernel fault).
    pub(crate) completed: u32,
    /// PTX that CUDA C modules of the batch compiled to, for the node's
    /// cache.
    pub(crate) compiled: Vec<(ModuleHash, String)>,
    pub(crate) error: Option<WorkerFailure>,
}

/// Kernel buffer size requested for each pipe between the node and a worker.
///
/// Linux pipes default to 64 KiB, so a 256 MiB MEM_WRITE or MEM_READ crossed
/// the pipe in 4096 fills, each one a wake-up of the reader and a round trip
/// through the node's tokio reactor; on a 2-core machine that hop alone took
/// 0.5 to 1.3 s. 1 MiB is the largest size an unprivileged process may ask
/// for by default (`/proc/sys/fs/pipe-max-size`).
pub const PIPE_BUFFER_BYTES: usize = 1 << 20;

/// The two Linux-only `fcntl` commands for pipe buffers, declared here
/// rather than pulling in a crate for them (`F_LINUX_SPECIFIC_BASE` + 7 and
/// + 8 in `<linux/fcntl.h>`, the same on every architecture).
#[cfg(target_os = "linux")]
mod pipe_fcntl {
    use std::ffi::c_int;

    pub(super) const F_SETPIPE_SZ: c_int = 1031;
    #[cfg(test)]
    pub(super) const F_GETPIPE_SZ: c_int = 1032;

    unsafe extern "C" {
        /// `fcntl(2)` from the C library std already links.
        pub(super) fn fcntl(fd: c_int, cmd: c_int, ...) -> c_int;
    }
}

/// Grows the kernel buffer of the pipe behind `fd` to [`PIPE_BUFFER_BYTES`]
/// (best effort: a smaller system limit only costs throughput).
#[cfg(target_os = "linux")]
fn grow_pipe(fd: std::os::fd::BorrowedFd<'_>) {
    use std::os::fd::AsRawFd;
    // SAFETY: `fd` is borrowed, so it is open for the whole call;
    // F_SETPIPE_SZ takes one `int` argument, which we pass, and touches no
    // memory of ours.
    let r = unsafe {
        pipe_fcntl::fcntl(
            fd.as_raw_fd(),
            pipe_fcntl::F_SETPIPE_SZ,
            PIPE_BUFFER_BYTES as std::ffi::c_int,
        )
    };
    if r < 0 {
        tracing::debug!(
            error = %std::io::Error::last_os_error(),
            "could not grow a worker pipe; keeping the default size"
        );
    }
}

/// Worker-side limits: the parent already enforced the wire limits.
const WORKER_LIMITS: Limits = Limits {
    max_body: 64 << 20,
    max_data: u32::MAX,
};

/// Runs the worker loop and exits the process if [`WORKER_ENV`] is set;
/// returns at once otherwise. Call it first thing in `main` of any program
/// that serves as a worker executable.
pub fn main_if_worker() {
    if std::env::var_os(crate::sandbox::COMPILER_ENV).is_some() {
        std::process::exit(crate::sandbox::child_main());
    }
    if let Some(spec) = std::env::var_os(WORKER_ENV) {
        let code = run_worker(&spec.to_string_lossy());
        std::process::exit(code);
    }
}

fn run_worker(spec: &str) -> i32 {
    // The node's shared ring for streamed transfers (absent: they fail),
    // mapped before we report ready: the node removes its file then.
    let mut ring = std::env::var_os(SHM_ENV).map(|p| WorkerRing::open(std::path::Path::new(&p)));
    let stdin = std::io::stdin();
    let stdout = std::io::stdout();
    let mut input = std::io::BufReader::with_capacity(1 << 20, stdin.lock());
    let mut output = std::io::BufWriter::with_capacity(1 << 20, stdout.lock());
    let ready = Header::request(Opcode::GetInventory, 0, 0, 0);
    // Tenants' CUDA C is checked here and compiled in a confined child.
    let compiler = Arc::new(Compiler::new(CompileSandbox::from_env()));
    let device: Result<Box<dyn Device>, DeviceError> = match DeviceSpec::parse(spec) {
        Some(DeviceSpec::Cuda { ordinal }) => CudaDevice::open(ordinal).map(|mut d| {
            d.set_compiler(compiler.clone());
            Box::new(d) as Box<dyn Device>
        }),
        Some(DeviceSpec::Memory { capacity }) => Ok(Box::new(MemoryDevice::new(capacity))),
        None => Err(DeviceError::new(
            Status::Internal,
            format!("bad {WORKER_ENV} value {spec:?}"),
        )),
    };
    let mut device = match device.and_then(|mut d| d.info().map(|i| (d, i))) {
        Ok((d, info)) => {
            let body = to_body(&info);
            let h = Header::reply(&ready, Status::Ok, body.len() as u32, 0);
            if proto::write_frame_blocking(&mut output, &h, &body, &[]).is_err() {
                return 1;
            }
            d
        }
        Err(e) => {
            let body = to_body(&WorkerFailure::from(e));
            let h = Header::reply(&ready, Status::Internal, body.len() as u32, 0);
            let _ = proto::write_frame_blocking(&mut output, &h, &body, &[]);
            return 1;
        }
    };
    let mut submit_modules: HashSet<ModuleHash> = HashSet::new();
    // How long to poll for the next request before blocking (the node
    // passes its budget; absent: block at once).
    let spin = std::env::var(SPIN_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(Duration::ZERO, Duration::from_micros);
    loop {
        if input.buffer().is_empty() {
            use std::os::fd::AsRawFd;
            crate::spin::readable_within(std::io::stdin().as_raw_fd(), spin);
        }
        let header = match proto::read_header_blocking(&mut input, &WORKER_LIMITS) {
            Ok(h) => h,
            // End of file: the node is gone or done with us.
            Err(_) => return 0,
        };
        let mut hop = HopTimer::start("worker", header.opcode, u64::from(header.data_len));
        let frame = match proto::read_rest_blocking(&mut input, header) {
            Ok(f) => f,
            Err(_) => return 0,
        };
        hops::mark(&mut hop, "pipe_read");
        let (status, body, data) = match frame.header.opcode {
            Opcode::MemWrite | Opcode::MemRead => serve_chunk(device.as_mut(), &mut ring, &frame),
            _ => serve(device.as_mut(), &compiler, &mut submit_modules, &frame),
        };
        if let Some(t) = &mut hop {
            t.mark("device");
            t.set_op(frame.header.opcode, frame.data.len().max(data.len()) as u64);
        }
        let h = Header::reply(&frame.header, status, body.len() as u32, data.len() as u32);
        if proto::write_frame_blocking(&mut output, &h, &body, &data).is_err() {
            return 1;
        }
        hops::mark(&mut hop, "pipe_write");
        if let Some(t) = LAST_TRACE.with(|l| l.borrow_mut().take()) {
            hops::emit(t.line());
        }
    }
}

/// A chunk of a streamed transfer, through the shared ring.
fn serve_chunk(
    dev: &mut dyn Device,
    ring: &mut Option<std::io::Result<WorkerRing>>,
    f: &Frame,
) -> (Status, Vec<u8>, Vec<u8>) {
    let fail = |status: Status, message: String| {
        let e = WorkerFailure {
            status,
            message,
            sticky: false,
        };
        (e.status, to_body(&e), Vec::new())
    };
    let ring = match ring {
        Some(Ok(r)) => r,
        Some(Err(e)) => return fail(Status::Internal, format!("shared ring: {e}")),
        None => return fail(Status::Internal, "no shared ring".into()),
    };
    let op: ChunkOp = match from_body(&f.body) {
        Ok(op) => op,
        Err(e) => return fail(Status::BadRequest, e.to_string()),
    };
    let slot = match ring.slot(op.slot, op.len) {
        Ok(s) => s,
        Err(e) => return fail(Status::BadRequest, e),
    };
    let r = if f.header.opcode == Opcode::MemWrite {
        // Stream 0; the buffer orders later uses on any stream after it.
        dev.write(0, op.id, op.offset, slot)
    } else {
        dev.read_now(op.id, op.offset, slot)
    };
    match r {
        Ok(()) => (Status::Ok, Vec::new(), Vec::new()),
        Err(e) => {
            let e = WorkerFailure::from(e);
            (e.status, to_body(&e), Vec::new())
        }
    }
}

fn serve(
    dev: &mut dyn Device,
    compiler: &Compiler,
    cache: &mut HashSet<ModuleHash>,
    f: &Frame,
) -> (Status, Vec<u8>, Vec<u8>) {
    let fail = |e: WorkerFailure| (e.status, to_body(&e), Vec::new());
    match f.header.opcode {
        Opcode::GetInventory => match dev.info() {
            Ok(info) => (Status::Ok, to_body(&info), Vec::new()),
            Err(e) => fail(e.into()),
        },
        Opcode::Batch => match WorkerBatch::decode(&f.body) {
            Ok(b) => {
                let mut out = Vec::new();
                let reply = run_batch(dev, compiler, &b, &f.data, &mut out);
                (Status::Ok, to_body(&reply), out)
            }
            Err(e) => fail(WorkerFailure {
                status: Status::BadRequest,
                message: e.to_string(),
                sticky: false,
            }),
        },
        Opcode::GpuSubmit => match from_body::<GpuSubmit>(&f.body) {
            Ok(s) => match submit(dev, cache, &s, &f.data) {
                Ok(out) => (Status::Ok, Vec::new(), out),
                Err(e) => fail(e.into()),
            },
            Err(e) => fail(WorkerFailure {
                status: Status::BadRequest,
                message: e.to_string(),
                sticky: false,
            }),
        },
        op => fail(WorkerFailure {
            status: Status::BadRequest,
            message: format!("worker does not serve {op:?}"),
            sticky: false,
        }),
    }
}

/// With the hop timings on (`CUDA_LEASE_HOP_TIMES`, see `hops`), workers
/// also print each batch's per-command enqueue times and its finish time,
/// and the node each batch's planning and worker times, to stderr.
pub(crate) fn trace_enabled() -> bool {
    crate::hops::enabled()
}

fn op_name(op: &Op<'_>) -> &'static str {
    match op {
        Op::Alloc { .. } => "alloc",
        Op::Write { .. } => "write",
        Op::Read { .. } => "read",
        Op::Free { .. } => "free",
        Op::Launch(_) => "launch",
        Op::Record { .. } => "record",
        Op::Wait { .. } => "wait",
        Op::Fill { .. } => "fill",
        Op::Copy { .. } => "copy",
    }
}

/// The hop timings of the last batch, printed once its reply is written.
struct BatchTrace {
    ops: usize,
    enqueued: std::time::Duration,
    finish: std::time::Duration,
    total: std::time::Duration,
    spans: Vec<(&'static str, std::time::Duration)>,
}

impl BatchTrace {
    fn line(&self) -> String {
        let mut line = format!(
            "cuda-lease worker batch: {} ops enqueued in {:?}, finish {:?}, total {:?};",
            self.ops, self.enqueued, self.finish, self.total
        );
        for (name, d) in &self.spans {
            line.push_str(&format!(" {name} {d:?}"));
        }
        line
    }
}

thread_local! {
    static LAST_TRACE: std::cell::RefCell<Option<BatchTrace>> = const { std::cell::RefCell::new(None) };
}

fn run_batch(
    dev: &mut dyn Device,
    compiler: &Compiler,
    batch: &WorkerBatch<'_>,
    data: &[u8],
    out: &mut Vec<u8>,
) -> WorkerBatchReply {
    let mut cursor = 0usize;
    let mut take = |len: u32| -> Result<&[u8], DeviceError> {
        let end = cursor + len as usize;
        let s = data
            .get(cursor..end)
            .ok_or_else(|| DeviceError::new(Status::BadRequest, "batch data too short"))?;
        cursor = end;
        Ok(s)
    };
    let mut read_at = 0usize;
    let mut failed = None;
    let mut compiled = Vec::new();
    let trace = trace_enabled();
    let t0 = std::time::Instant::now();
    let mut spans: Vec<(&'static str, std::time::Duration)> = Vec::new();
    let loads = batch.loads.len();
    let steps = loads + batch.commands.0.len();
    for (i, l) in batch.loads.iter().enumerate() {
        let ts = std::time::Instant::now();
        let r = take(l.len)
            .and_then(|d| {
                check_module(compiler, &l.kind, d)?;
                dev.load_module(l.hash, &l.kind, d)
            })
            .map(|ptx| compiled.extend(ptx.map(|p| (l.hash, p))));
        if trace {
            spans.push(("load", ts.elapsed()));
        }
        if let Err(e) = r {
            failed = Some((i, e));
            break;
        }
    }
    let commands = if failed.is_none() {
        &batch.commands.0[..]
    } else {
        &[]
    };
    for (i, c) in commands.iter().enumerate() {
        let ts = std::time::Instant::now();
        let stream: StreamId = c.stream;
        let op = &c.op;
        let r = match op {
            Op::Alloc { buf, size } => dev.alloc(stream, *buf, *size),
            Op::Write { buf, offset, len } => {
                take(*len).and_then(|d| dev.write(stream, *buf, *offset, d))
            }
            Op::Read { buf, offset, len } => dev
                .read(stream, *buf, *offset, *len, read_at)
                .map(|()| read_at += *len as usize),
            Op::Free { id } => dev.free(stream, *id),
            Op::Launch(spec) => spec
                .args
                .iter()
                .map(|a| match a {
                    ArgView::Scalar(b) => Ok(DeviceArg::Scalar(b)),
                    ArgView::Mem { buf, offset } => Ok(DeviceArg::Mem {
                        id: *buf,
                        offset: *offset,
                    }),
                    ArgView::Input(_) | ArgView::Output => Err(DeviceError::new(
                        Status::BadRequest,
                        "Input/Output are for GPU_SUBMIT",
                    )),
                })
                .collect::<Result<Vec<_>, _>>()
                .and_then(|args| {
                    let dims = LaunchDims {
                        grid: spec.grid,
                        block: spec.block,
                        shared_mem: spec.shared_mem,
                    };
                    dev.launch(stream, spec.module, spec.kernel, dims, &args)
                }),
            Op::Record { event } => dev.record(stream, *event),
            Op::Wait { event } => dev.wait(stream, *event),
            Op::Fill {
                buf,
                offset,
                len,
                value,
            } => dev.fill(stream, *buf, *offset, *len, *value),
            Op::Copy {
                src,
                src_offset,
                dst,
                dst_offset,
                len,
            } => dev.copy(stream, (*src, *src_offset), (*dst, *dst_offset), *len),
        };
        if trace {
            spans.push((op_name(op), ts.elapsed()));
        }
        if let Err(e) = r {
            failed = Some((loads + i, e));
            break;
        }
    }
    // What was enqueued runs to its end (a failure stops only what comes
    // after it), and the reads of it land.
    out.resize(read_at, 0);
    let tf = std::time::Instant::now();
    let finished = dev.finish(out);
    if trace {
        // Formatted and printed after the reply is written (off its path).
        let t = BatchTrace {
            ops: steps,
            enqueued: tf - t0,
            finish: tf.elapsed(),
            total: t0.elapsed(),
            spans,
        };
        LAST_TRACE.with(|l| *l.borrow_mut() = Some(t));
    }
    let (completed, error) = match (failed, finished) {
        // A fault while waiting outranks an enqueue error: it is sticky.
        (Some((i, _)), Err(e)) if e.sticky => (i, Some(e)),
        (Some((i, e)), _) => (i, Some(e)),
        (None, Err(e)) => (steps, Some(e)),
        (None, Ok(())) => (steps, None),
    };
    WorkerBatchReply {
        completed: completed as u32,
        compiled,
        error: error.map(Into::into),
    }
}

fn submit(
    dev: &mut dyn Device,
    cache: &mut HashSet<ModuleHash>,
    s: &GpuSubmit,
    data: &[u8],
) -> Result<Vec<u8>, DeviceError> {
    let bad = |m: &str| DeviceError::new(Status::BadRequest, m);
    let ptx = data
        .get(..s.ptx_len as usize)
        .ok_or_else(|| bad("data too short"))?;
    let text = std::str::from_utf8(ptx)
        .map_err(|_| DeviceError::new(Status::LoadFailed, "module text is not UTF-8"))?;
    let module = ModuleHash::of(&SourceKind::Ptx, text);
    if !cache.contains(&module) {
        if cache.len() >= 32 {
            for m in cache.drain() {
                let _ = dev.unload_module(m);
            }
        }
        dev.load_module(module, &SourceKind::Ptx, ptx)?;
        cache.insert(module);
    }
    // Buffer ids of this call alone (a submit worker serves no lease).
    let mut owned: Vec<Id> = Vec::new();
    let result = (|| {
        let mut next = 0u64;
        let mut fresh = |dev: &mut dyn Device, size: u64| -> Result<Id, DeviceError> {
            let id = Id(next);
            next += 1;
            dev.alloc(0, id, size)?;
            Ok(id)
        };
        let mut cursor = s.ptx_len as usize;
        let mut inputs = Vec::with_capacity(s.input_lens.len());
        for len in &s.input_lens {
            let bytes = data
                .get(cursor..cursor + *len as usize)
                .ok_or_else(|| bad("data too short"))?;
            cursor += *len as usize;
            let id = fresh(dev, u64::from((*len).max(1)))?;
            owned.push(id);
            dev.write(0, id, 0, bytes)?;
            inputs.push(id);
        }
        let output = fresh(dev, u64::from(s.output_size))?;
        owned.push(output);
        if s.output_fill != 0 {
            dev.write(0, output, 0, &vec![s.output_fill; s.output_size as usize])?;
        }
        let mem = |id: Id| DeviceArg::Mem { id, offset: 0 };
        let args: Vec<DeviceArg<'_>> = s
            .args
            .iter()
            .map(|a| match a {
                KernelArg::Scalar(b) => Ok(DeviceArg::Scalar(b)),
                KernelArg::Input(n) => inputs
                    .get(*n as usize)
                    .map(|id| mem(*id))
                    .ok_or_else(|| bad("no such input")),
                KernelArg::Output => Ok(mem(output)),
                KernelArg::Mem { .. } => Err(bad("GPU_SUBMIT has no lease memory")),
            })
            .collect::<Result<_, _>>()?;
        let d = LaunchDims {
            grid: s.grid,
            block: s.block,
            shared_mem: s.shared_mem,
        };
        dev.launch(0, module, &s.kernel, d, &args)?;
        let mut out = vec![0u8; s.output_size as usize];
        dev.read(0, output, 0, s.output_size, 0)?;
        dev.finish(&mut out)?;
        Ok(out)
    })();
    for id in owned {
        let _ = dev.free(0, id);
    }
    // The frees run before the next call's work (same stream).
    result
}

/// Refuses a CUDA C module whose options or includes could reach the
/// node's files ([`crate::sandbox`]), before any device sees it.
fn check_module(compiler: &Compiler, kind: &SourceKind, text: &[u8]) -> Result<(), DeviceError> {
    let SourceKind::Cuda { options } = kind else {
        return Ok(());
    };
    let text = std::str::from_utf8(text)
        .map_err(|_| DeviceError::new(Status::LoadFailed, "module text is not UTF-8"))?;
    compiler
        .check(text, options)
        .map_err(|e| DeviceError::new(Status::LoadFailed, format!("module refused: {e}")))
}

/// Why talking to a worker failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum WorkerError {
    /// It could not start (the message says why, e.g. "no NVIDIA driver found").
    #[error("worker failed to start: {0}")]
    Start(String),
    /// It exited or its pipe broke.
    #[error("worker died: {0}")]
    Dead(String),
    /// It did not answer in time and was killed.
    #[error("worker hung for {0:?} and was killed")]
    Hung(Duration),
}

struct WorkerIo {
    stdin: ChildStdin,
    stdout: BufReader<PipeReader>,
    next_id: u64,
}

/// The read end of the worker's stdout, read with the `read` call first
/// and the reactor's readiness only when that finds nothing.
///
/// Tokio's own pipe waits for the reactor to report the pipe readable
/// again after every read that emptied it, even when the bytes are there
/// by now (the node spins for the worker's reply, so they usually are):
/// one reactor turn and one task wake-up on every reply's path, about 20 us
/// of a chain's round trip on an H100 host (2026-11-23,
/// `cuda-lease/scripts/hop-timeline`).
struct PipeReader(tokio::io::unix::AsyncFd<std::fs::File>);

impl PipeReader {
    /// Takes over the read end of a pipe (made non-blocking here).
    fn new(fd: std::os::fd::OwnedFd) -> std::io::Result<Self> {
        use std::os::fd::AsRawFd;
        // SAFETY: `fd` is an open descriptor owned here; F_GETFL/F_SETFL
        // change only its status flags.
        unsafe {
            let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
            if flags < 0 || libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) < 0
            {
                return Err(std::io::Error::last_os_error());
            }
        }
        let file = std::fs::File::from(fd);
        // SAFETY: a `File` owns its descriptor: it stays open, and is the
        // same one, until the `AsyncFd` (which owns the `File`) is dropped.
        let fd = unsafe { tokio::io::unix::AsyncFd::register(file) }?;
        Ok(PipeReader(fd))
    }
}

impl std::os::fd::AsRawFd for PipeReader {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }
}

impl tokio::io::AsyncRead for PipeReader {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::io::Read;
        use std::task::Poll;
        loop {
            match self.0.get_ref().read(buf.initialize_unfilled()) {
                Ok(n) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() != std::io::ErrorKind::WouldBlock => {
                    return Poll::Ready(Err(e));
                }
                Err(_) => {}
            }
            // Empty: wait for the reactor. Readiness it reported before
            // the read above is stale; clear it and read again (nothing is
            // lost: a write after the clear sets it anew).
            match self.0.poll_read_ready(cx) {
                Poll::Ready(Ok(mut guard)) => guard.clear_ready(),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// The node's side of one worker process.
pub(crate) struct WorkerProcess {
    io: tokio::sync::Mutex<WorkerIo>,
    child: StdMutex<Option<Child>>,
    info: DeviceInfo,
    pid: Option<u32>,
    /// The bulk-data ring shared with the process.
    ring: Arc<ShmRing>,
    /// How long to poll for a reply before awaiting it ([`crate::spin`]).
    spin: Duration,
}

impl std::fmt::Debug for WorkerProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerProcess")
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

impl WorkerProcess {
    /// Starts a worker and waits (up to `timeout`) for it to report its device.
    pub(crate) async fn spawn(spec: &WorkerSpec, timeout: Duration) -> Result<Self, WorkerError> {
        let ring = ShmRing::create()
            .map_err(|e| WorkerError::Start(format!("creating the shared ring: {e}")))?;
        let mut cmd = Command::new(&spec.program);
        cmd.args(&spec.args)
            .env(WORKER_ENV, spec.device.to_env())
            .env(SHM_ENV, ring.path())
            .env(SPIN_ENV, spec.spin.as_micros().to_string())
            .envs(spec.compile.to_env())
            // Workers run tenants' work: the node's tokens stay behind.
            .env_remove("CUDA_LEASE_TOKENS")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .map_err(|e| WorkerError::Start(format!("{}: {e}", spec.program.display())))?;
        let pid = child.id();
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(WorkerError::Start("no pipes".into()));
        };
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsFd;
            grow_pipe(stdin.as_fd());
            grow_pipe(stdout.as_fd());
        }
        let stdout = stdout
            .into_owned_fd()
            .and_then(PipeReader::new)
            .map_err(|e| WorkerError::Start(format!("the worker's stdout: {e}")))?;
        let mut stdout = BufReader::with_capacity(PIPE_BUFFER_BYTES, stdout);
        let ready =
            tokio::time::timeout(timeout, proto::read_frame(&mut stdout, &WORKER_LIMITS)).await;
        let frame = match ready {
            Err(_) => {
                let _ = child.start_kill();
                return Err(WorkerError::Start(format!("no answer within {timeout:?}")));
            }
            Ok(Err(e)) => {
                let _ = child.start_kill();
                return Err(WorkerError::Start(format!(
                    "{e} (does {} call cuda_lease::worker::main_if_worker()?)",
                    spec.program.display()
                )));
            }
            Ok(Ok(f)) => f,
        };
        if frame.header.status != Status::Ok {
            let msg = from_body::<WorkerFailure>(&frame.body)
                .map(|f| f.message)
                .unwrap_or_default();
            let _ = child.start_kill();
            return Err(WorkerError::Start(msg));
        }
        let info: DeviceInfo = from_body(&frame.body)
            .map_err(|e| WorkerError::Start(format!("bad ready frame: {e}")))?;
        // The worker mapped the ring before it said it was ready.
        ring.unlink();
        Ok(Self {
            ring: Arc::new(ring),
            io: tokio::sync::Mutex::new(WorkerIo {
                stdin,
                stdout,
                next_id: 1,
            }),
            child: StdMutex::new(Some(child)),
            info,
            pid,
            spin: spec.spin,
        })
    }

    /// The bulk-data ring shared with this worker.
    pub(crate) fn ring(&self) -> &Arc<ShmRing> {
        &self.ring
    }

    /// Sends one chunk of a streamed transfer (`opcode` MEM_WRITE or
    /// MEM_READ, the data in slot `op.slot` of [`WorkerProcess::ring`]);
    /// the outer error is the worker's death or hang, the inner one the
    /// chunk's failure.
    pub(crate) async fn chunk(
        &self,
        opcode: Opcode,
        op: ChunkOp,
        timeout: Duration,
    ) -> Result<Result<(), WorkerFailure>, WorkerError> {
        let f = self.call(opcode, &to_body(&op), &[], timeout).await?;
        if f.header.status == Status::Ok {
            return Ok(Ok(()));
        }
        Ok(Err(from_body::<WorkerFailure>(&f.body).unwrap_or_else(
            |e| WorkerFailure {
                status: Status::Internal,
                message: format!("bad worker reply: {e}"),
                sticky: false,
            },
        )))
    }

    /// The device as reported at start-up.
    pub(crate) fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Sends one request and waits up to `timeout` for the reply; on timeout
    /// the worker is killed. Calls on one worker run one at a time, in order.
    pub(crate) async fn call(
        &self,
        opcode: Opcode,
        body: &[u8],
        data: &[u8],
        timeout: Duration,
    ) -> Result<Frame, WorkerError> {
        self.call_parts(opcode, body, &[data], timeout).await
    }

    /// [`WorkerProcess::call`] with the data in parts, written back to
    /// back (never joined in memory).
    pub(crate) async fn call_parts(
        &self,
        opcode: Opcode,
        body: &[u8],
        parts: &[&[u8]],
        timeout: Duration,
    ) -> Result<Frame, WorkerError> {
        let mut io = self.io.lock().await;
        let io = &mut *io;
        io.next_id += 1;
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let h = Header::request(opcode, io.next_id, body.len() as u32, len as u32);
        let exchange = async {
            let mut hop = HopTimer::start("node-worker", opcode, len as u64);
            proto::write_frame_parts(&mut io.stdin, &h, body, parts).await?;
            hops::mark(&mut hop, "pipe_send");
            if io.stdout.buffer().is_empty() {
                use std::os::fd::AsRawFd;
                let fd = io.stdout.get_ref().as_raw_fd();
                crate::spin::readable_within_async(fd, self.spin).await;
            }
            let f = proto::read_frame(&mut io.stdout, &WORKER_LIMITS).await;
            if let (Some(t), Ok(f)) = (&mut hop, &f) {
                t.mark("pipe_reply");
                t.set_op(opcode, len.max(f.data.len()) as u64);
            }
            f
        };
        match tokio::time::timeout(timeout, exchange).await {
            Ok(Ok(f)) => Ok(f),
            Ok(Err(e)) => {
                self.kill();
                Err(WorkerError::Dead(e.to_string()))
            }
            Err(_) => {
                self.kill();
                Err(WorkerError::Hung(timeout))
            }
        }
    }

    /// Kills the process (idempotent); the exit is reaped in the background.
    pub(crate) fn kill(&self) {
        let child = self.child.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(mut child) = child {
            let _ = child.start_kill();
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let _ = child.wait().await;
                });
            }
        }
    }

    /// Kills the process and waits until it has exited (so its GPU memory is back).
    pub(crate) async fn kill_and_wait(&self) {
        let child = self.child.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(mut child) = child {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }

    /// `Some(reason)` when the process has exited or was killed.
    pub(crate) fn exited(&self) -> Option<String> {
        let mut guard = self.child.lock().unwrap_or_else(|e| e.into_inner());
        match guard.as_mut() {
            None => Some("killed".into()),
            Some(c) => match c.try_wait() {
                Ok(Some(status)) => Some(format!("exited with {status}")),
                Ok(None) => None,
                Err(e) => Some(e.to_string()),
            },
        }
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::os::fd::{AsFd, AsRawFd};

    #[tokio::test]
    async fn the_pipe_reader_reads_what_is_there_waits_for_the_rest_and_sees_the_end() {
        use std::io::Write;
        use tokio::io::AsyncReadExt;
        let (r, mut w) = std::io::pipe().expect("pipe");
        let mut reader = PipeReader::new(r.into()).expect("reader");
        w.write_all(b"abc").expect("write");
        let mut got = [0u8; 3];
        reader.read_exact(&mut got).await.expect("there already");
        assert_eq!(&got, b"abc");
        // Nothing there: the read waits for the writer (a thread, later).
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            w.write_all(b"defg").expect("write");
            // Dropped: the end of the pipe.
        });
        let mut rest = Vec::new();
        reader.read_to_end(&mut rest).await.expect("to the end");
        assert_eq!(rest, b"defg");
        writer.join().expect("writer");
    }

    fn pipe_size(fd: std::os::fd::BorrowedFd<'_>) -> std::ffi::c_int {
        // SAFETY: `fd` is borrowed and open for the call; F_GETPIPE_SZ
        // takes no argument and touches no memory of ours.
        unsafe { pipe_fcntl::fcntl(fd.as_raw_fd(), pipe_fcntl::F_GETPIPE_SZ) }
    }

    #[test]
    fn pipes_are_grown_up_to_the_system_limit() {
        let (reader, writer) = std::io::pipe().unwrap();
        let before = pipe_size(reader.as_fd());
        grow_pipe(writer.as_fd());
        let after = pipe_size(reader.as_fd());
        let max: usize = std::fs::read_to_string("/proc/sys/fs/pipe-max-size")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        if max >= PIPE_BUFFER_BYTES {
            assert_eq!(after as usize, PIPE_BUFFER_BYTES);
        } else {
            assert_eq!(after, before, "a refused resize leaves the pipe as it was");
        }
    }
}
