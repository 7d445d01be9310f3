//! The wire protocol of `cuda-lease`, without I/O: its messages and
//! commands, their encoding and the frame around them.
//!
//! A fixed, versioned header, a `postcard` body and raw bytes.
//!
//! Every message (request or reply) is one frame:
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
//! All integers are little-endian. The body and data lengths are checked
//! against [`Limits`] *before* anything is allocated, so a hostile length can
//! never make the reader allocate more than the limits allow. Raw payloads
//! (PTX text, buffer contents) travel after the body as-is, never through
//! serde. Unknown versions and opcodes are rejected with
//! [`Status::BadRequest`].
//!
//! Over QUIC, each request uses its own bidirectional stream: the client
//! writes one frame and finishes, the node answers with one frame. The node
//! and its worker processes speak the same framing over pipes.

mod batch;
mod bounded;
mod codec;
mod error;
mod frame;
mod gemm;
mod messages;
mod module;
mod rand;
mod scalar;

pub use batch::{
    reply_bytes, validate_commands, Batch, BatchHead, Command, ModuleText, ModuleUse, Op,
    FIRST_NODE_ID, MAX_BATCH_MODULES, TIMER_BYTES,
};
pub use codec::{
    command_count, encode_batch_head, encode_commands, postcard_decode, postcard_encode,
    CommandList,
};
pub use error::{Credentials, Disconnect, RemoteError, RemoteErrorKind};
pub use frame::{
    from_body, invalid_data, proto_error, read_header_blocking, read_rest_blocking, to_body,
    write_frame_blocking, Frame, Header, Limits, Opcode, ProtoError, Status, ALPN, BULK_ALPN,
    CLOSE_NODE_SHUTDOWN, FLAG_REPLY, HEADER_LEN, MAGIC, SMALL_FRAME, VERSION,
};
pub use gemm::{Dtype, GemmSpec, Operand};
pub use messages::{
    BatchReply, BulkOpen, BulkTickets, DeviceInfo, DeviceLimits, ErrorBody, GpuSubmit, Hello,
    HelloOk, Id, IdOp, Inventory, LaunchArg, LaunchSpec, LeaseAlloc, LeaseGrant, LeaseId, LeaseRef,
    LeaseRenew, LeaseState, LeaseStatus, MemAlloc, MemRead, MemWrite, ModuleHash, OpError,
    SourceKind, StreamId, BULK_TICKET_LEN, MAX_BULK_TICKETS, MAX_MODULE_OPTIONS, MAX_OPTION_LEN,
};
pub use module::ModuleSpec;
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
