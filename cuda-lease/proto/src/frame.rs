//! Framing: the fixed header, whole frames, postcard bodies and blocking
//! frame I/O.

use std::fmt;

use serde::{Deserialize, Serialize};

// Named by the docs of `Opcode`.
#[cfg(doc)]
use super::{
    Batch, BatchReply, BulkOpen, BulkTickets, DirectGrant, GpuSubmit, Hello, IdOp, Inventory,
    LeaseAlloc, LeaseGrant, LeaseRef, LeaseRenew, LeaseStatus, MemAlloc, MemRead, MemWrite,
};

/// The four magic bytes that open every frame.
pub const MAGIC: [u8; 4] = *b"CULS";
/// The protocol version this crate speaks.
pub const VERSION: u8 = 7;
/// Size of the fixed header in bytes.
pub const HEADER_LEN: usize = 28;
/// Header flag set on replies.
pub const FLAG_REPLY: u16 = 1;
/// Header flag of a BATCH request: the client is measuring where its time
/// goes (`cuda_lease::stamps`) and asks the server to stamp the batch too.
/// A lease's worker serving it directly (LEASE_DIRECT) does, and sets the
/// flag on its reply, whose body then ends with [`DIRECT_STAMPS`]
/// little-endian `u64` times (`CLOCK_MONOTONIC` nanoseconds) after the
/// reply message. A server that does not stamp ignores the flag.
pub const FLAG_STAMPS: u16 = 0x4000;
/// The stamps a stamped direct BATCH reply ends with ([`FLAG_STAMPS`]), in
/// order: the worker has read the request, handed it to its device loop,
/// the loop took it, decoded and planned it, enqueued its commands,
/// sealed it, saw it done, answered, and the reply's write starts.
pub const DIRECT_STAMPS: usize = 9;
/// ALPN of the QUIC connection. It names the framing (the header's layout),
/// not the protocol version: a peer of another version still connects and
/// gets a clear error from the header's version byte.
pub const ALPN: &[u8] = b"cuda-lease/1";

/// ALPN of the bulk-data channel (TLS over TCP).
pub const BULK_ALPN: &[u8] = b"cuda-lease-bulk/1";

/// QUIC close code of a node shutting down (or dropped); a client reports it
/// as [`Disconnect::NodeShutdown`](crate::Disconnect::NodeShutdown).
pub const CLOSE_NODE_SHUTDOWN: u32 = 0x501;

/// Size limits enforced by frame readers before they allocate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest postcard body accepted.
    pub max_body: u32,
    /// Largest raw data section accepted.
    pub max_data: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body: 1 << 20,
            max_data: 512 << 20,
        }
    }
}

/// Operation codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// Authenticate the connection with a bearer token ([`Hello`]).
    Hello = 1,
    /// Describe the node's devices ([`Inventory`]).
    GetInventory = 2,
    /// Reserve VRAM for a TTL ([`LeaseAlloc`] -> [`LeaseGrant`]).
    LeaseAlloc = 3,
    /// Extend a lease ([`LeaseRenew`] -> [`LeaseGrant`]).
    LeaseRenew = 4,
    /// Free a lease and everything in it ([`LeaseRef`]); allowed without auth.
    LeaseFree = 5,
    /// Describe a lease ([`LeaseRef`] -> [`LeaseStatus`]).
    LeaseQuery = 6,
    /// Bulk-data connection tickets, TLS over TCP ([`BulkOpen`] -> [`BulkTickets`]).
    BulkOpen = 7,
    /// Serve a lease's batches from its worker directly ([`LeaseRef`] ->
    /// [`DirectGrant`]): asked before the lease's first batch.
    LeaseDirect = 8,
    /// Allocate device memory under a client-named id ([`MemAlloc`]).
    MemAlloc = 16,
    /// Copy data bytes into device memory, streamed ([`MemWrite`]).
    MemWrite = 17,
    /// Copy device memory back, streamed; the reply's data holds it ([`MemRead`]).
    MemRead = 18,
    /// Free a buffer or an event ([`IdOp`]).
    MemFree = 19,
    /// Run a pipeline, one reply when done ([`Batch`] -> [`BatchReply`]).
    Batch = 23,
    /// Stateless one-shot kernel call ([`GpuSubmit`]); the reply's data is the output.
    GpuSubmit = 32,
}

impl Opcode {
    /// Every opcode, for tests and tables.
    pub const ALL: [Opcode; 14] = [
        Opcode::Hello,
        Opcode::GetInventory,
        Opcode::LeaseAlloc,
        Opcode::LeaseRenew,
        Opcode::LeaseFree,
        Opcode::LeaseQuery,
        Opcode::BulkOpen,
        Opcode::LeaseDirect,
        Opcode::MemAlloc,
        Opcode::MemWrite,
        Opcode::MemRead,
        Opcode::MemFree,
        Opcode::Batch,
        Opcode::GpuSubmit,
    ];

    /// Decodes an opcode byte.
    pub fn from_u8(v: u8) -> Option<Self> {
        Self::ALL.iter().copied().find(|op| *op as u8 == v)
    }
}

/// Typed status codes carried in reply headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(u16)]
pub enum Status {
    /// Success.
    Ok = 0,
    /// Missing or wrong credentials.
    Unauthorized = 1,
    /// The PTX did not load; the message holds the JIT log.
    LoadFailed = 2,
    /// A launch or the kernel itself failed (e.g. an illegal address).
    LaunchFailed = 3,
    /// Copying device memory back failed.
    ReadFailed = 4,
    /// The lease's TTL ran out.
    LeaseExpired = 5,
    /// The request would exceed the lease's reservation or the device.
    CapacityExceeded = 6,
    /// A request that breaks a rule of the protocol (a range, a count, an
    /// argument), or a command the node refuses.
    BadRequest = 7,
    /// No such buffer, event or kernel.
    NotFound = 8,
    /// An earlier kernel fault (or a dead worker) poisoned the lease.
    LeasePoisoned = 9,
    /// A node-side failure not caused by the request.
    Internal = 10,
    /// A batch names a module the node lacks, without its source: nothing ran.
    UnknownModule = 11,
    /// No such lease: freed, expired and reaped, or never granted.
    LeaseNotFound = 12,
    /// The request does not parse (truncated or oversized frame, unknown
    /// version or opcode, undecodable body): a client bug, not its caller's.
    Malformed = 13,
}

impl Status {
    /// Decodes a status; unknown values become [`Status::Internal`].
    pub fn from_u16(v: u16) -> Self {
        match v {
            0 => Status::Ok,
            1 => Status::Unauthorized,
            2 => Status::LoadFailed,
            3 => Status::LaunchFailed,
            4 => Status::ReadFailed,
            5 => Status::LeaseExpired,
            6 => Status::CapacityExceeded,
            7 => Status::BadRequest,
            8 => Status::NotFound,
            9 => Status::LeasePoisoned,
            11 => Status::UnknownModule,
            12 => Status::LeaseNotFound,
            13 => Status::Malformed,
            _ => Status::Internal,
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Status::Ok => "OK",
            Status::Unauthorized => "UNAUTHORIZED",
            Status::LoadFailed => "LOAD_FAILED",
            Status::LaunchFailed => "LAUNCH_FAILED",
            Status::ReadFailed => "READ_FAILED",
            Status::LeaseExpired => "LEASE_EXPIRED",
            Status::CapacityExceeded => "CAPACITY_EXCEEDED",
            Status::BadRequest => "BAD_REQUEST",
            Status::NotFound => "NOT_FOUND",
            Status::LeasePoisoned => "LEASE_POISONED",
            Status::Internal => "INTERNAL",
            Status::UnknownModule => "UNKNOWN_MODULE",
            Status::LeaseNotFound => "LEASE_NOT_FOUND",
            Status::Malformed => "MALFORMED",
        };
        f.write_str(s)
    }
}

/// Why a frame or body was rejected. Every variant maps to [`Status::BadRequest`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    /// The frame ended early.
    #[error("truncated frame")]
    Truncated,
    /// The magic bytes are wrong.
    #[error("bad magic")]
    BadMagic,
    /// The version is not [`VERSION`].
    #[error("unsupported protocol version {0}: this node speaks {VERSION}")]
    UnsupportedVersion(u8),
    /// The opcode is unknown.
    #[error("unknown opcode {0}")]
    UnknownOpcode(u8),
    /// The reserved field is not zero.
    #[error("reserved header bits set")]
    Reserved,
    /// The body is larger than [`Limits::max_body`].
    #[error("body of {len} bytes exceeds the limit of {max}")]
    BodyTooLarge {
        /// Announced length.
        len: u32,
        /// Limit.
        max: u32,
    },
    /// The data is larger than [`Limits::max_data`].
    #[error("data of {len} bytes exceeds the limit of {max}")]
    DataTooLarge {
        /// Announced length.
        len: u32,
        /// Limit.
        max: u32,
    },
    /// The postcard body did not decode, or has trailing bytes.
    #[error("malformed body: {0}")]
    Body(String),
    /// A decoded message breaks a rule (too many args, zero grid, ...).
    #[error("invalid message: {0}")]
    Invalid(String),
}

/// The fixed frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Operation.
    pub opcode: Opcode,
    /// Flags ([`FLAG_REPLY`]).
    pub flags: u16,
    /// Reply status ([`Status::Ok`] on requests).
    pub status: Status,
    /// Request id, echoed in the reply.
    pub request_id: u64,
    /// Length of the postcard body.
    pub body_len: u32,
    /// Length of the raw data.
    pub data_len: u32,
}

impl Header {
    /// A request header.
    pub fn request(opcode: Opcode, request_id: u64, body_len: u32, data_len: u32) -> Self {
        Self {
            opcode,
            flags: 0,
            status: Status::Ok,
            request_id,
            body_len,
            data_len,
        }
    }

    /// A reply header to `req`.
    pub fn reply(req: &Header, status: Status, body_len: u32, data_len: u32) -> Self {
        Self {
            opcode: req.opcode,
            flags: FLAG_REPLY,
            status,
            request_id: req.request_id,
            body_len,
            data_len,
        }
    }

    /// Encodes to the fixed 28 bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.opcode as u8;
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..10].copy_from_slice(&(self.status as u16).to_le_bytes());
        b[12..20].copy_from_slice(&self.request_id.to_le_bytes());
        b[20..24].copy_from_slice(&self.body_len.to_le_bytes());
        b[24..28].copy_from_slice(&self.data_len.to_le_bytes());
        b
    }

    /// Decodes a header, checking magic, version, opcode, reserved bits and limits.
    ///
    /// # Errors
    ///
    /// A [`ProtoError`] naming the first rule broken.
    pub fn decode(b: &[u8], limits: &Limits) -> Result<Self, ProtoError> {
        if b.len() < HEADER_LEN {
            return Err(ProtoError::Truncated);
        }
        if b[0..4] != MAGIC {
            return Err(ProtoError::BadMagic);
        }
        if b[4] != VERSION {
            return Err(ProtoError::UnsupportedVersion(b[4]));
        }
        let opcode = Opcode::from_u8(b[5]).ok_or(ProtoError::UnknownOpcode(b[5]))?;
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        if u16_at(10) != 0 {
            return Err(ProtoError::Reserved);
        }
        let mut id = [0u8; 8];
        id.copy_from_slice(&b[12..20]);
        let body_len = u32_at(20);
        let data_len = u32_at(24);
        if body_len > limits.max_body {
            return Err(ProtoError::BodyTooLarge {
                len: body_len,
                max: limits.max_body,
            });
        }
        if data_len > limits.max_data {
            return Err(ProtoError::DataTooLarge {
                len: data_len,
                max: limits.max_data,
            });
        }
        Ok(Self {
            opcode,
            flags: u16_at(6),
            status: Status::from_u16(u16_at(8)),
            request_id: u64::from_le_bytes(id),
            body_len,
            data_len,
        })
    }

    /// True on replies.
    pub fn is_reply(&self) -> bool {
        self.flags & FLAG_REPLY != 0
    }
}

/// A whole frame: header, postcard body and raw data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// The header (lengths match `body` and `data`).
    pub header: Header,
    /// Postcard bytes.
    pub body: Vec<u8>,
    /// Raw bytes.
    pub data: Vec<u8>,
}

impl Frame {
    /// Decodes a frame that is all of `bytes` (tests, fuzzing): trailing bytes fail.
    ///
    /// # Errors
    ///
    /// A [`ProtoError`]; never panics and never allocates more than the input.
    pub fn decode(bytes: &[u8], limits: &Limits) -> Result<Self, ProtoError> {
        let header = Header::decode(bytes, limits)?;
        let rest = &bytes[HEADER_LEN..];
        let body_len = header.body_len as usize;
        let data_len = header.data_len as usize;
        if rest.len() < body_len.saturating_add(data_len) {
            return Err(ProtoError::Truncated);
        }
        if rest.len() > body_len + data_len {
            return Err(ProtoError::Invalid("trailing bytes after frame".into()));
        }
        Ok(Self {
            header,
            body: rest[..body_len].to_vec(),
            data: rest[body_len..body_len + data_len].to_vec(),
        })
    }

    /// Encodes to one contiguous buffer.
    pub fn encode(&self) -> Vec<u8> {
        [&self.header.encode()[..], &self.body, &self.data].concat()
    }
}

/// Encodes a message body (postcard).
pub fn to_body<T: Serialize + ?Sized>(msg: &T) -> Vec<u8> {
    let mut out = Vec::new();
    super::postcard_encode(msg, &mut out);
    out
}

/// Decodes a body (postcard), rejecting trailing bytes.
///
/// # Errors
///
/// [`ProtoError::Body`] when the bytes are not exactly one `T`.
pub fn from_body<'a, T: Deserialize<'a>>(mut body: &'a [u8]) -> Result<T, ProtoError> {
    let msg: T = super::postcard_decode(&mut body)?;
    if !body.is_empty() {
        return Err(ProtoError::Body(format!("{} trailing bytes", body.len())));
    }
    Ok(msg)
}

/// Frames up to this size are copied together and written in one write by
/// `cuda-lease`'s `write_frame_parts`; larger ones part by part.
pub const SMALL_FRAME: usize = 64 << 10;

/// Blocking read of a frame's header alone, checked against `limits`.
///
/// # Errors
///
/// `InvalidData` wrapping a [`ProtoError`] for bad frames; other I/O errors as is.
pub fn read_header_blocking<R: std::io::Read + ?Sized>(
    r: &mut R,
    limits: &Limits,
) -> std::io::Result<Header> {
    let mut hb = [0u8; HEADER_LEN];
    r.read_exact(&mut hb)?;
    Header::decode(&hb, limits).map_err(invalid_data)
}

/// Blocking read of the body and data that follow `header` (read by
/// [`read_header_blocking`], whose limits bound the lengths).
///
/// # Errors
///
/// I/O errors of the reader.
pub fn read_rest_blocking<R: std::io::Read + ?Sized>(
    r: &mut R,
    header: Header,
) -> std::io::Result<Frame> {
    let mut body = vec![0u8; header.body_len as usize];
    r.read_exact(&mut body)?;
    let mut data = vec![0u8; header.data_len as usize];
    r.read_exact(&mut data)?;
    Ok(Frame { header, body, data })
}

/// Writes one frame to a blocking writer (the worker process's pipe).
///
/// # Errors
///
/// I/O errors of the writer.
pub fn write_frame_blocking<W: std::io::Write + ?Sized>(
    w: &mut W,
    header: &Header,
    body: &[u8],
    data: &[u8],
) -> std::io::Result<()> {
    w.write_all(&header.encode())?;
    w.write_all(body)?;
    w.write_all(data)?;
    w.flush()
}

/// The `InvalidData` I/O error carrying `e` ([`proto_error`] extracts it).
pub fn invalid_data(e: ProtoError) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, e)
}

/// Extracts a [`ProtoError`] from an I/O error made by the frame readers.
pub fn proto_error(e: &std::io::Error) -> Option<&ProtoError> {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<ProtoError>())
}
