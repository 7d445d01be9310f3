//! What the node and a worker say to each other beyond the wire's own messages:
//! a batch's modules and commands, streamed chunks, failures and replies.

use serde::{Deserialize, Serialize};

#[cfg(doc)]
use crate::device::DeviceError;
use crate::proto::{
    postcard_decode, CommandList, CommandSpares, Id, ModuleHash, OpError, ProtoError, SourceKind,
};

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

/// A batch for a worker: the modules to load, the lease's limits, the
/// batch's module list, then the client's commands as it encoded them
/// (undecoded by the node; the worker checks and plans them). The call's
/// data holds the sources of the modules to load, then the writes' payloads.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WorkerBatch<'a> {
    pub(crate) loads: Vec<WorkerLoad>,
    pub(crate) limits: BatchLimits,
    /// Every module the batch names (its launches may name only these).
    pub(crate) modules: Vec<ModuleHash>,
    #[serde(borrow)]
    pub(crate) commands: CommandList<'a>,
}

impl<'a> WorkerBatch<'a> {
    /// Decodes a worker batch's body: its head through serde, its commands
    /// by hand, in lists taken from `spares` where it has some
    /// ([`CommandList::from_wire_reusing`]); what `from_body` decodes.
    pub(crate) fn decode_reusing(
        mut body: &'a [u8],
        spares: &mut CommandSpares,
    ) -> Result<Self, ProtoError> {
        let (loads, limits, modules) = postcard_decode(&mut body)?;
        Ok(WorkerBatch {
            loads,
            limits,
            modules,
            commands: CommandList::from_wire_reusing(body, spares)?,
        })
    }
}

/// Appends a [`WorkerBatch`] whose commands are `wire`, a command list as
/// a client encoded it (the node does not decode it).
pub(crate) fn encode_worker_batch(
    out: &mut Vec<u8>,
    loads: &[WorkerLoad],
    limits: &BatchLimits,
    modules: &[ModuleHash],
    wire: &[u8],
) {
    crate::proto::postcard_encode(&(loads, limits, modules), out);
    out.extend_from_slice(wire);
}

/// What a worker ran of a batch. A batch the worker refuses whole (its
/// commands malformed, its modules over the reservation) is answered with
/// the [`DeviceError`] as the status and body instead.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WorkerBatchReply {
    /// Modules loaded.
    pub(crate) loaded: u32,
    /// Commands that ran.
    pub(crate) completed: u32,
    /// PTX the batch's CUDA C modules compiled to, for the node's cache.
    pub(crate) compiled: Vec<(ModuleHash, String)>,
    /// The first failure, by the command (or module) it names.
    pub(crate) error: Option<OpError>,
    /// The failure poisoned the lease's context.
    pub(crate) sticky: bool,
    /// What the lease holds once the batch settled.
    pub(crate) usage: Usage,
    /// The worker's stamps ([`FLAG_STAMPS`], `cuda_lease::stamps::now_ns`
    /// times): when it read the request, planned it, enqueued its
    /// commands, sealed it, saw it done and replied.
    pub(crate) stamps: Option<[u64; crate::stamps::WORKER_POINTS.len()]>,
}

/// A worker request flag (on BATCH requests): the node is stamping, so
/// the worker stamps the batch too and sends its stamps in the reply.
pub(crate) const FLAG_STAMPS: u16 = 0x4000;

/// A worker request flag (on BATCH requests): the request is an "after"
/// (its body a `u64`, `upto`), answered once the lease's direct path has
/// handed every batch numbered below `upto` to the device (at once when
/// the lease has none).
pub(crate) const FLAG_AFTER: u16 = 0x2000;

/// Chunks of one streamed transfer handed to the worker in one call (saving
/// a pipe round trip and a node wake-up per chunk), done in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ChunkOps {
    /// The transfer's whole range (buffer, offset, bytes), checked
    /// against the lease before any chunk: sent with a transfer's first
    /// call (alone for an empty transfer).
    pub(crate) range: Option<(Id, u64, u64)>,
    pub(crate) ops: Vec<ChunkOp>,
}

/// Most chunks in one [`ChunkOps`] call.
pub(crate) const MAX_CHUNKS_PER_CALL: usize = 8;

/// A worker reply flag (on BATCH replies): the reply's `data_len` bytes stay
/// in the worker under the request's id, the frame carrying none; the node
/// reads them with [`HeldRead`] requests as its client takes them. A request
/// with this flag is a [`HeldRead`].
pub(crate) const FLAG_HELD: u16 = 0x8000;

/// Replies with more data than this keep it in the worker
/// ([`FLAG_HELD`]); smaller ones carry it.
pub(crate) const HELD_MIN: usize = 4 << 20;

/// Node -> worker: up to `len` bytes of reply `request`'s held data from
/// `offset`, sent as the reply's data; `len` 0, or a part reaching the end,
/// drops what is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct HeldRead {
    pub(crate) request: u64,
    pub(crate) offset: u64,
    pub(crate) len: u32,
}

/// What a lease holds, as its worker reports it with each batch's reply.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Usage {
    /// Bytes charged to the reservation: buffers, modules' sources and
    /// graphs' kept uploads.
    pub(crate) allocated: u64,
    /// Live buffers.
    pub(crate) buffers: u32,
    /// Live events and started timers.
    pub(crate) events: u32,
    /// Live graphs.
    pub(crate) graphs: u32,
    /// Streams used.
    pub(crate) streams: u32,
    /// Page-locked staging the worker keeps for the lease's prepared
    /// bodies, in bytes (outside the reservation).
    pub(crate) staging: u64,
}

/// The lease's limits and budgets, as the node gives them with each batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct BatchLimits {
    /// The lease's reservation, in bytes.
    pub(crate) reserved: u64,
    /// Most live ids (buffers and events) in the lease.
    pub(crate) max_ids: u32,
    /// Most streams the lease may use.
    pub(crate) max_streams: u32,
    /// Most bytes one batch's reads may return.
    pub(crate) max_read: u64,
    /// The bytes the node holds for the batch's reply: what the batch
    /// declared ([`BatchHead::reply_bytes`]) as far as the principal's
    /// budget allows. Its reads may take no more.
    ///
    /// [`BatchHead::reply_bytes`]: crate::proto::BatchHead::reply_bytes
    pub(crate) reply_bytes: u64,
}
