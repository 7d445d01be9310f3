//! Worker processes: one per lease (plus a small pool for GPU_SUBMIT), each
//! owning one CUDA context and stream.
//!
//! A kernel fault poisons every CUDA context of its process, so the node
//! never touches CUDA: it re-executes a program (by default its own
//! executable) with [`WORKER_ENV`] set and talks to it over the child's
//! stdin/stdout in the wire's framing ([`crate::proto`]). The program must
//! call [`main_if_worker`] first thing in `main`; the `cuda-lease-node`
//! binary does. A worker exits at end-of-file when the node goes away and
//! is killed when its lease ends; either way the driver frees everything
//! it held.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use crate::proto::Limits;
use crate::sandbox::CompileSandbox;

mod child;
mod direct;
mod enqueue;
mod graphs;
mod lease;
mod messages;
mod objects;
mod plan;
mod process;

pub(crate) use self::direct::{DirectLimits, DirectOpen, DirectPort, DirectServed};
pub(crate) use self::messages::{
    encode_worker_batch, ChunkOp, ChunkOps, WorkerBatchReply, WorkerLoad, FLAG_HELD, FLAG_STAMPS,
    MAX_CHUNKS_PER_CALL,
};
pub(crate) use self::messages::{BatchLimits, Usage, FLAG_AFTER};
pub use self::process::PIPE_BUFFER_BYTES;
pub(crate) use self::process::{SentRequest, WorkerError, WorkerProcess};

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
    /// The in-memory test double ([`MemoryDevice`](crate::device::MemoryDevice)).
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
    /// Executable that calls [`main_if_worker`] at start-up.
    pub program: PathBuf,
    /// Extra arguments.
    pub args: Vec<OsString>,
    /// Device to drive.
    pub device: DeviceSpec,
    /// How long the worker after each reply, and the node after each request,
    /// poll the pipe before blocking (see [`crate::spin`]); zero blocks at once.
    pub spin: Duration,
    /// How workers compile tenants' CUDA C ([`crate::sandbox`]).
    pub compile: CompileSandbox,
}

impl WorkerSpec {
    /// Workers run the current executable, which must call [`main_if_worker`].
    ///
    /// # Errors
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
        let code = child::run_worker(&spec.to_string_lossy());
        std::process::exit(code);
    }
}
