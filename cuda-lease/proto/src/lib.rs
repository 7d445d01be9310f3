//! The wire protocol of `cuda-lease`, without I/O: messages, commands, their
//! encoding and framing.
//!
//! Every message (request or reply) is one frame: this fixed, versioned
//! header, a `postcard` body, then raw bytes (PTX, buffer contents) as-is.
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 4 | magic `b"CULS"` |
//! | 4 | 1 | version ([`VERSION`]) |
//! | 5 | 1 | opcode ([`Opcode`]) |
//! | 6 | 2 | flags ([`FLAG_REPLY`] on replies) |
//! | 8 | 2 | status ([`Status`], zero on requests) |
//! | 10 | 2 | reserved, must be zero |
//! | 12 | 8 | request id |
//! | 20 | 4 | body length (postcard bytes) |
//! | 24 | 4 | data length (raw bytes: PTX, buffers) |
//!
//! Integers are little-endian. Both lengths are checked against [`Limits`]
//! *before* anything is allocated. Unknown versions and opcodes are rejected
//! with [`Status::BadRequest`].
//!
//! Over QUIC each request has its own bidirectional stream: the client writes
//! one frame and finishes; the node answers with one. Node and workers use
//! the same framing over pipes.

mod batch;
mod bounded;
mod codec;
mod error;
mod frame;
mod gemm;
mod ids;
mod messages;
mod module;
mod op;
mod rand;
mod scalar;

pub use batch::{
    reply_bytes, replying_now, validate_commands, Batch, BatchHead, Command, ModuleText, ModuleUse,
    FIRST_NODE_ID, MAX_BATCH_MODULES, TIMER_BYTES,
};
pub use codec::{
    command_count, encode_batch_head, encode_commands, postcard_decode, postcard_encode,
    CommandList, CommandSpares,
};
pub use error::{Credentials, Disconnect, RemoteError, RemoteErrorKind};
pub use frame::{
    from_body, invalid_data, proto_error, read_header_blocking, read_rest_blocking, to_body,
    write_frame_blocking, Frame, Header, Limits, Opcode, ProtoError, Status, ALPN, BULK_ALPN,
    CLOSE_NODE_SHUTDOWN, DIRECT_STAMPS, FLAG_REPLY, FLAG_STAMPS, HEADER_LEN, MAGIC, SMALL_FRAME,
    VERSION,
};
pub use gemm::{Dtype, GemmSpec, Operand};
pub use ids::{IdHasher, IdMap, IdSet};
pub use messages::{
    BatchReply, BulkOpen, BulkTickets, DeviceInfo, DeviceLimits, DirectGrant, DirectHello,
    ErrorBody, GpuSubmit, Hello, HelloOk, Id, IdOp, Inventory, LaunchArg, LaunchSpec, LeaseAlloc,
    LeaseGrant, LeaseId, LeaseRef, LeaseRenew, LeaseState, LeaseStatus, MemAlloc, MemRead,
    MemWrite, ModuleHash, OpError, SourceKind, StreamId, BULK_TICKET_LEN, DIRECT_TICKET_LEN,
    MAX_BULK_TICKETS, MAX_MODULE_OPTIONS, MAX_OPTION_LEN,
};
pub use module::ModuleSpec;
pub use op::{NotInBody, Op, Role};
pub use rand::{RandDist, RandSpec};
pub use scalar::ScalarBytes;

/// Most kernel arguments a launch may carry.
pub const MAX_KERNEL_ARGS: usize = 64;
/// Largest by-value kernel argument in bytes.
pub const MAX_SCALAR_ARG: usize = 4096;
/// Most operations one batch may carry.
pub const MAX_BATCH_OPS: usize = 4096;
/// Longest kernel name.
pub const MAX_KERNEL_NAME: usize = 1024;
