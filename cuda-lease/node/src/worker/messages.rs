//! What the node and a worker say to each other beyond the wire's own messages:
//! a batch's modules and commands, streamed chunks, failures and replies.

use serde::{Deserialize, Serialize};

use crate::device::DeviceError;
use crate::proto::{CommandList, Id, ModuleHash, SourceKind};

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
    pub(crate) commands: CommandList<'a>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WorkerBatchReply {
    /// Commands enqueued; with `error` and `completed == ops.len()`, the
    /// failure came when waiting for them (a kernel fault).
    pub(crate) completed: u32,
    /// PTX that CUDA C modules of the batch compiled to, for the node's
    /// cache.
    pub(crate) compiled: Vec<(ModuleHash, String)>,
    pub(crate) error: Option<DeviceError>,
    /// The worker's stamps of the batch ([`FLAG_STAMPS`]): when it read
    /// the request, enqueued it, saw it done and wrote this reply
    /// (`cuda_lease::stamps::now_ns` times).
    pub(crate) stamps: Option<[u64; 4]>,
}

/// A worker request flag (on BATCH requests): the node is stamping, so
/// the worker stamps the batch too and sends its stamps in the reply.
pub(crate) const FLAG_STAMPS: u16 = 0x4000;

/// Chunks of one streamed transfer handed to the worker in one call, done
/// in order (a call per chunk would pay a pipe round trip, and the node's
/// wake-up, per 2 MiB).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ChunkOps {
    pub(crate) ops: Vec<ChunkOp>,
}

/// Most chunks in one [`ChunkOps`] call.
pub(crate) const MAX_CHUNKS_PER_CALL: usize = 8;

/// A worker reply flag (on BATCH replies): the reply's `data_len` bytes stay in the worker,
/// under the request's id, and the frame carries none of them; the node
/// reads them with [`HeldRead`] requests as its client takes them. A
/// request with this flag is a [`HeldRead`].
pub(crate) const FLAG_HELD: u16 = 0x8000;

/// Replies with more data than this keep it in the worker
/// ([`FLAG_HELD`]); smaller ones carry it.
pub(crate) const HELD_MIN: usize = 4 << 20;

/// Node -> worker: up to `len` bytes of reply `request`'s held data from
/// `offset` (the reply's data is that part); `len` 0 drops the rest. The
/// part that reaches the end drops it too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct HeldRead {
    pub(crate) request: u64,
    pub(crate) offset: u64,
    pub(crate) len: u32,
}
