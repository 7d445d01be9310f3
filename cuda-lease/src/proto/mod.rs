//! The wire protocol: a fixed, versioned header, a `postcard` body and raw bytes.
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

use std::fmt;

use serde::{Deserialize, Serialize};

/// The four magic bytes that open every frame.
pub const MAGIC: [u8; 4] = *b"CULS";
/// The protocol version this crate speaks.
pub const VERSION: u8 = 2;
/// Size of the fixed header in bytes.
pub const HEADER_LEN: usize = 28;
/// Header flag set on replies.
pub const FLAG_REPLY: u16 = 1;
/// ALPN protocol id used on the QUIC connection. It names the framing (the
/// fixed header's layout, unchanged since version 1), not the protocol
/// version: a peer of another version still connects and gets a clear
/// error from the header's version byte.
pub const ALPN: &[u8] = b"cuda-lease/1";

/// Most kernel arguments a launch may carry.
pub const MAX_KERNEL_ARGS: usize = 64;
/// Largest by-value kernel argument in bytes.
pub const MAX_SCALAR_ARG: usize = 4096;
/// Most operations one batch may carry.
pub const MAX_BATCH_OPS: usize = 4096;
/// Longest kernel name.
pub const MAX_KERNEL_NAME: usize = 1024;

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
    /// Allocate device memory under a client-named id ([`MemAlloc`]).
    MemAlloc = 16,
    /// Copy data bytes into device memory, streamed ([`MemWrite`]).
    MemWrite = 17,
    /// Copy device memory back, streamed; the reply's data holds it ([`MemRead`]).
    MemRead = 18,
    /// Free a buffer or an event ([`IdOp`]).
    MemFree = 19,
    /// Run a pipeline: commands on several streams, one reply when they
    /// are done ([`Batch`] -> [`BatchReply`]).
    Batch = 23,
    /// Stateless one-shot kernel call ([`GpuSubmit`]); the reply's data is the output.
    GpuSubmit = 32,
}

impl Opcode {
    /// Every opcode, for tests and tables.
    pub const ALL: [Opcode; 12] = [
        Opcode::Hello,
        Opcode::GetInventory,
        Opcode::LeaseAlloc,
        Opcode::LeaseRenew,
        Opcode::LeaseFree,
        Opcode::LeaseQuery,
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
    /// Malformed frame, unknown version or opcode, or invalid arguments.
    BadRequest = 7,
    /// No such lease, handle or kernel.
    NotFound = 8,
    /// An earlier kernel fault (or a dead worker) poisoned the lease.
    LeasePoisoned = 9,
    /// A node-side failure not caused by the request.
    Internal = 10,
    /// A batch names a module the node does not have and carries no
    /// source for it: nothing ran; send it again with the source.
    UnknownModule = 11,
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

    /// Decodes and checks a header: magic, version, opcode, reserved bits and
    /// both lengths against `limits`.
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
    /// Decodes a frame held entirely in `bytes` (used by tests and fuzzing;
    /// streams use [`read_frame`]). Trailing bytes are an error.
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
        let mut out = Vec::with_capacity(HEADER_LEN + self.body.len() + self.data.len());
        out.extend_from_slice(&self.header.encode());
        out.extend_from_slice(&self.body);
        out.extend_from_slice(&self.data);
        out
    }
}

/// Serializes a message body with postcard.
pub fn to_body<T: Serialize + ?Sized>(msg: &T) -> Vec<u8> {
    // Serializing our own plain-data types into a Vec cannot fail.
    postcard::to_allocvec(msg).unwrap_or_default()
}

/// Deserializes a body, rejecting trailing bytes.
///
/// # Errors
///
/// [`ProtoError::Body`] when the bytes are not exactly one `T`.
pub fn from_body<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, ProtoError> {
    let (msg, rest) =
        postcard::take_from_bytes::<T>(body).map_err(|e| ProtoError::Body(e.to_string()))?;
    if !rest.is_empty() {
        return Err(ProtoError::Body(format!("{} trailing bytes", rest.len())));
    }
    Ok(msg)
}

/// Reads one frame from an async stream, checking limits before allocating.
///
/// # Errors
///
/// `io::ErrorKind::InvalidData` wrapping a [`ProtoError`] for bad frames;
/// other I/O errors as they come.
///
/// # Cancel safety
///
/// Not cancel safe: a dropped read leaves the stream mid-frame.
pub async fn read_frame<R>(r: &mut R, limits: &Limits) -> std::io::Result<Frame>
where
    R: tokio::io::AsyncRead + Unpin + ?Sized,
{
    use tokio::io::AsyncReadExt;
    let (header, body) = read_head(r, limits).await?;
    let mut data = vec![0u8; header.data_len as usize];
    r.read_exact(&mut data).await?;
    Ok(Frame { header, body, data })
}

/// Reads a frame's header and body, leaving its data in the stream (for
/// readers that stream the data on); the lengths are checked against
/// `limits` before anything is allocated.
///
/// # Errors
///
/// As [`read_frame`].
///
/// # Cancel safety
///
/// Not cancel safe: a dropped read loses the bytes read so far.
pub async fn read_head<R>(r: &mut R, limits: &Limits) -> std::io::Result<(Header, Vec<u8>)>
where
    R: tokio::io::AsyncRead + Unpin + ?Sized,
{
    use tokio::io::AsyncReadExt;
    let header = read_header(r, limits).await?;
    let mut body = vec![0u8; header.body_len as usize];
    r.read_exact(&mut body).await?;
    Ok((header, body))
}

/// Reads a frame's fixed header alone, checked against `limits`.
///
/// # Errors
///
/// As [`read_frame`].
///
/// # Cancel safety
///
/// Not cancel safe: a dropped read loses the bytes read so far.
pub async fn read_header<R>(r: &mut R, limits: &Limits) -> std::io::Result<Header>
where
    R: tokio::io::AsyncRead + Unpin + ?Sized,
{
    use tokio::io::AsyncReadExt;
    let mut hb = [0u8; HEADER_LEN];
    r.read_exact(&mut hb).await?;
    Header::decode(&hb, limits).map_err(invalid_data)
}

/// Writes one frame to an async stream without joining its parts.
///
/// # Errors
///
/// I/O errors of the stream.
///
/// # Cancel safety
///
/// Not cancel safe: a dropped write leaves a partial frame.
pub async fn write_frame<W>(
    w: &mut W,
    header: &Header,
    body: &[u8],
    data: &[u8],
) -> std::io::Result<()>
where
    W: tokio::io::AsyncWrite + Unpin + ?Sized,
{
    write_frame_parts(w, header, body, &[data]).await
}

/// [`write_frame`] with the data in parts, written back to back (never
/// joined in memory unless the whole frame is small).
///
/// # Errors
///
/// I/O errors of the stream.
///
/// # Cancel safety
///
/// Not cancel safe: a dropped write leaves a partial frame.
pub async fn write_frame_parts<W>(
    w: &mut W,
    header: &Header,
    body: &[u8],
    parts: &[&[u8]],
) -> std::io::Result<()>
where
    W: tokio::io::AsyncWrite + Unpin + ?Sized,
{
    use tokio::io::AsyncWriteExt;
    let head = header.encode();
    let len = head.len() + body.len() + parts.iter().map(|p| p.len()).sum::<usize>();
    if len <= SMALL_FRAME {
        // One write: on a QUIC stream each write takes the connection's
        // lock and wakes its driver, which may send what it has so far as
        // a packet of its own (a header alone, then the body...); on a
        // worker's pipe the reader wakes to a whole frame.
        let mut frame = Vec::with_capacity(len);
        frame.extend_from_slice(&head);
        frame.extend_from_slice(body);
        for p in parts {
            frame.extend_from_slice(p);
        }
        w.write_all(&frame).await?;
    } else {
        w.write_all(&head).await?;
        w.write_all(body).await?;
        for p in parts {
            w.write_all(p).await?;
        }
    }
    w.flush().await
}

/// Frames up to this size are written by [`write_frame_parts`] in one write
/// (copied together first); larger ones part by part, never joined.
pub const SMALL_FRAME: usize = 64 << 10;

/// Blocking [`read_frame`] for the worker process.
///
/// # Errors
///
/// As [`read_frame`].
pub fn read_frame_blocking<R: std::io::Read + ?Sized>(
    r: &mut R,
    limits: &Limits,
) -> std::io::Result<Frame> {
    let header = read_header_blocking(r, limits)?;
    read_rest_blocking(r, header)
}

/// Blocking read of a frame's header alone, checked against `limits`.
///
/// # Errors
///
/// As [`read_frame`].
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

/// Blocking [`write_frame`] for the worker process.
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

fn invalid_data(e: ProtoError) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, e)
}

/// Extracts a [`ProtoError`] from an I/O error made by the frame readers.
pub fn proto_error(e: &std::io::Error) -> Option<&ProtoError> {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<ProtoError>())
}

macro_rules! id_type {
    ($(#[$m:meta])* $name:ident) => {
        $(#[$m])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        pub struct $name(pub [u8; 16]);

        impl $name {
            /// A fresh 128-bit id from the operating system's random source.
            ///
            /// # Panics
            ///
            /// If the operating system has no random source.
            pub fn random() -> Self {
                let mut b = [0u8; 16];
                getrandom::fill(&mut b).expect("operating system random source");
                Self(b)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({self})", stringify!($name))
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                for b in self.0 {
                    write!(f, "{b:02x}")?;
                }
                Ok(())
            }
        }

        impl std::str::FromStr for $name {
            type Err = ProtoError;
            fn from_str(s: &str) -> Result<Self, ProtoError> {
                let s = s.trim();
                if s.len() != 32 || !s.is_ascii() {
                    return Err(ProtoError::Invalid("expected 32 hex digits".into()));
                }
                let mut b = [0u8; 16];
                for (i, byte) in b.iter_mut().enumerate() {
                    *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16)
                        .map_err(|e| ProtoError::Invalid(e.to_string()))?;
                }
                Ok(Self(b))
            }
        }
    };
}

id_type!(
    /// A 128-bit random, unguessable lease id. Knowing it is the capability
    /// to use (and always to free) the lease.
    LeaseId
);

/// A client-named id of a buffer or an event in a lease. The client picks
/// it (a per-lease counter); ids are names, not secrets: a lease is usable
/// only by the principal that made it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Id(pub u64);

impl fmt::Debug for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Id({})", self.0)
    }
}

impl fmt::Display for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// A client-named stream of a lease; the node makes streams on demand, up
/// to its per-lease limit.
pub type StreamId = u32;

/// Most options one CUDA C module may carry.
pub const MAX_MODULE_OPTIONS: usize = 64;
/// Longest NVRTC option.
pub const MAX_OPTION_LEN: usize = 1024;

/// What a module's source text is.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum SourceKind {
    /// PTX, JIT-loaded by the node's driver.
    Ptx,
    /// CUDA C, compiled by the node's NVRTC for the node's own GPU.
    Cuda {
        /// NVRTC options (at most [`MAX_MODULE_OPTIONS`], each at most
        /// [`MAX_OPTION_LEN`] bytes).
        #[serde(deserialize_with = "bounded::options")]
        options: Vec<String>,
    },
}

/// A module's name on the wire: the SHA-256 of its kind, options and text
/// ([`ModuleHash::of`]). A collision-resistant hash, because the node caches
/// modules node-wide by it: naming a hash is only useful to a client that
/// knows the source.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ModuleHash(pub [u8; 32]);

impl ModuleHash {
    /// The hash of a module: SHA-256 over a tag for the kind, each option
    /// followed by a NUL, a NUL, then the text.
    pub fn of(kind: &SourceKind, text: &str) -> Self {
        let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
        match kind {
            SourceKind::Ptx => ctx.update(b"ptx\0"),
            SourceKind::Cuda { options } => {
                ctx.update(b"cuda\0");
                for o in options {
                    ctx.update(o.as_bytes());
                    ctx.update(b"\0");
                }
                ctx.update(b"\0");
            }
        }
        ctx.update(text.as_bytes());
        let mut out = [0u8; 32];
        out.copy_from_slice(ctx.finish().as_ref());
        Self(out)
    }
}

impl fmt::Debug for ModuleHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ModuleHash({self})")
    }
}

impl fmt::Display for ModuleHash {
    /// The first 16 hex digits (enough to tell modules apart in messages).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// Error reply body (every non-OK status).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// Human-readable reason; for LOAD_FAILED, the JIT log.
    pub message: String,
}

/// HELLO request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Bearer token (empty when relying on mutual TLS).
    pub token: String,
    /// Free-form client name for logs.
    pub client: String,
}

/// HELLO reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloOk {
    /// The node's name.
    pub node: String,
}

/// One device as reported by GET_INVENTORY.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// CUDA ordinal.
    pub ordinal: u32,
    /// Marketing name.
    pub name: String,
    /// Total memory in bytes.
    pub total_bytes: u64,
    /// Free memory in bytes as the driver reports it now.
    pub free_bytes: u64,
    /// Compute capability (major, minor).
    pub compute_capability: (u32, u32),
}

/// GET_INVENTORY reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inventory {
    /// The node's name.
    pub node: String,
    /// Devices served.
    pub devices: Vec<DeviceInfo>,
    /// Bytes that new leases may still reserve.
    pub reservable_bytes: u64,
    /// Leases alive now.
    pub active_leases: u32,
}

/// LEASE_ALLOC request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseAlloc {
    /// VRAM to reserve, in bytes.
    pub min_vram: u64,
    /// Requested TTL in seconds (the node may cap it).
    pub ttl_secs: u32,
}

/// LEASE_ALLOC and LEASE_RENEW reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseGrant {
    /// The lease.
    pub lease: LeaseId,
    /// Bumped by every renew.
    pub generation: u64,
    /// Reserved bytes.
    pub reserved: u64,
    /// Granted TTL in milliseconds from now.
    pub ttl_ms: u64,
}

/// LEASE_RENEW request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRenew {
    /// The lease.
    pub lease: LeaseId,
    /// New TTL in seconds from now.
    pub ttl_secs: u32,
}

/// Body of LEASE_FREE and LEASE_QUERY.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRef {
    /// The lease.
    pub lease: LeaseId,
}

/// State of a lease in [`LeaseStatus`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LeaseState {
    /// Usable.
    Active,
    /// Failed by a kernel fault or a dead worker; only LEASE_FREE works.
    Poisoned,
}

/// LEASE_QUERY reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseStatus {
    /// The lease.
    pub lease: LeaseId,
    /// Current generation.
    pub generation: u64,
    /// Reserved bytes.
    pub reserved: u64,
    /// Bytes allocated now.
    pub allocated: u64,
    /// Milliseconds left before expiry.
    pub remaining_ms: u64,
    /// State.
    pub state: LeaseState,
}

/// MEM_ALLOC request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemAlloc {
    /// The lease.
    pub lease: LeaseId,
    /// The new buffer's id (not in use in the lease).
    pub buf: Id,
    /// Bytes (non-zero).
    pub size: u64,
}

/// MEM_WRITE request; the frame's data is written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemWrite {
    /// The lease.
    pub lease: LeaseId,
    /// Target buffer.
    pub buf: Id,
    /// Byte offset into it.
    pub offset: u64,
}

/// MEM_READ request; the reply's data holds the bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemRead {
    /// The lease.
    pub lease: LeaseId,
    /// Source buffer.
    pub buf: Id,
    /// Byte offset into it.
    pub offset: u64,
    /// Bytes to read.
    pub len: u32,
}

/// MEM_FREE request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdOp {
    /// The lease.
    pub lease: LeaseId,
    /// The buffer or event to free.
    pub id: Id,
}

/// One kernel argument.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum KernelArg {
    /// Bytes passed by value (an `int`, a `float`, a small struct; at most
    /// [`MAX_SCALAR_ARG`], refused on the length prefix).
    Scalar(#[serde(deserialize_with = "bounded::scalar")] Vec<u8>),
    /// The device address of a buffer of the lease plus a byte offset.
    Mem {
        /// The buffer.
        buf: Id,
        /// Byte offset added to its address.
        offset: u64,
    },
    /// GPU_SUBMIT only: the address of input number `n`.
    Input(u32),
    /// GPU_SUBMIT only: the address of the output buffer.
    Output,
}

impl KernelArg {
    /// A 32-bit scalar.
    pub fn u32(v: u32) -> Self {
        KernelArg::Scalar(v.to_le_bytes().to_vec())
    }
    /// A 64-bit scalar.
    pub fn u64(v: u64) -> Self {
        KernelArg::Scalar(v.to_le_bytes().to_vec())
    }
    /// A 32-bit float scalar.
    pub fn f32(v: f32) -> Self {
        KernelArg::Scalar(v.to_le_bytes().to_vec())
    }
    /// The address of a buffer.
    pub fn mem(buf: Id) -> Self {
        KernelArg::Mem { buf, offset: 0 }
    }
}

/// Launch geometry and arguments.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaunchSpec {
    /// Module holding the kernel, by content (listed in the batch's
    /// `modules`).
    pub module: ModuleHash,
    /// Kernel (entry) name.
    pub kernel: String,
    /// Grid dimensions (each non-zero).
    pub grid: [u32; 3],
    /// Block dimensions (each non-zero).
    pub block: [u32; 3],
    /// Dynamic shared memory bytes.
    pub shared_mem: u32,
    /// Arguments in order (at most [`MAX_KERNEL_ARGS`], refused on the
    /// length prefix).
    #[serde(deserialize_with = "bounded::kernel_args")]
    pub args: Vec<KernelArg>,
}

impl LaunchSpec {
    /// Checks names, geometry and arguments.
    ///
    /// # Errors
    ///
    /// [`ProtoError::Invalid`] naming the broken rule.
    pub fn validate(&self, submit: bool) -> Result<(), ProtoError> {
        LaunchView::from(self).validate(submit)
    }
}

fn validate_launch(
    kernel: &str,
    grid: [u32; 3],
    block: [u32; 3],
    args: &[ArgView<'_>],
    submit: bool,
) -> Result<(), ProtoError> {
    let bad = |m: &str| Err(ProtoError::Invalid(m.into()));
    if kernel.is_empty() || kernel.len() > MAX_KERNEL_NAME || kernel.contains('\0') {
        return bad("kernel name must be 1..=1024 bytes without NUL");
    }
    if grid.contains(&0) || block.contains(&0) {
        return bad("grid and block dimensions must be non-zero");
    }
    if args.len() > MAX_KERNEL_ARGS {
        return bad("too many kernel arguments");
    }
    for a in args {
        match a {
            ArgView::Scalar(b) if b.is_empty() || b.len() > MAX_SCALAR_ARG => {
                return bad("scalar arguments must be 1..=4096 bytes")
            }
            ArgView::Input(_) | ArgView::Output if !submit => {
                return bad("Input/Output arguments are for GPU_SUBMIT only")
            }
            ArgView::Mem { .. } if submit => return bad("GPU_SUBMIT has no lease memory"),
            _ => {}
        }
    }
    Ok(())
}

/// Most modules one batch may name.
pub const MAX_BATCH_MODULES: usize = 64;

/// A module's source carried in a batch's data.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModuleText {
    /// PTX or CUDA C (with its options).
    pub kind: SourceKind,
    /// Bytes of text taken from the batch data.
    pub len: u32,
}

/// A module a batch uses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModuleUse {
    /// Its content hash ([`ModuleHash::of`] the source).
    pub hash: ModuleHash,
    /// The source, the first time this node sees the module (the node
    /// checks that it hashes to `hash`); `None` when the client believes
    /// the node has it, which the node answers with
    /// [`Status::UnknownModule`] if it does not.
    pub source: Option<ModuleText>,
}

/// What one command does. Ids are client-named: a command that creates
/// (`Alloc`, the first `Record` of an event) names an id not in use in the
/// lease; the others name one created by an earlier command of this or an
/// earlier batch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Op {
    /// Allocate `size` zeroed bytes as buffer `buf`.
    Alloc {
        /// New buffer id.
        buf: Id,
        /// Bytes (non-zero).
        size: u64,
    },
    /// Write the next `len` bytes of the batch data into `buf` at `offset`.
    Write {
        /// Target.
        buf: Id,
        /// Byte offset.
        offset: u64,
        /// Bytes taken from the batch data.
        len: u32,
    },
    /// Read `len` bytes of `buf` at `offset`; they are appended to the
    /// reply data, in command order.
    Read {
        /// Source.
        buf: Id,
        /// Byte offset.
        offset: u64,
        /// Bytes.
        len: u32,
    },
    /// Free a buffer (after every use of it queued on any stream) or an
    /// event.
    Free {
        /// The buffer or event.
        id: Id,
    },
    /// Launch a kernel.
    Launch(LaunchSpec),
    /// Record event `event` on the command's stream (made on first use).
    Record {
        /// The event.
        event: Id,
    },
    /// Make the command's stream wait for the last record of `event`.
    Wait {
        /// The event.
        event: Id,
    },
    /// Set `len` bytes of `buf` at `offset` to `value`.
    Fill {
        /// Target.
        buf: Id,
        /// Byte offset.
        offset: u64,
        /// Bytes.
        len: u64,
        /// The byte.
        value: u8,
    },
    /// Copy `len` bytes from `src` at `src_offset` to another buffer `dst`
    /// at `dst_offset`.
    Copy {
        /// Source.
        src: Id,
        /// Byte offset in the source.
        src_offset: u64,
        /// Destination (not `src`).
        dst: Id,
        /// Byte offset in the destination.
        dst_offset: u64,
        /// Bytes.
        len: u64,
    },
}

/// One command of a batch: an op on a client-named stream of the lease.
/// Each stream runs its commands in order; different streams run
/// concurrently, ordered by events and by the buffers they share (a use
/// that conflicts with an earlier one, a write against any use, runs after
/// it, whatever the streams).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Command {
    /// The stream (made on first use, up to the node's per-lease limit).
    pub stream: StreamId,
    /// What to do.
    pub op: Op,
}

/// BATCH request: a pipeline in one message. The frame's data holds the
/// module sources (in `modules` order) and then the `Write` payloads (in
/// command order), back to back. The reply comes when every command ran.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    /// The lease.
    pub lease: LeaseId,
    /// The batch's place in its lease's order (1, 2, 3, ...; 0: none). The
    /// node runs a lease's numbered batches in this order, whatever order
    /// they arrive in over QUIC's independent streams (it waits a bounded
    /// time for a missing one), so a batch sent before the reply to its
    /// predecessor can name what the predecessor creates.
    pub seq: u64,
    /// Modules the launches name (at most [`MAX_BATCH_MODULES`]).
    #[serde(deserialize_with = "bounded::modules")]
    pub modules: Vec<ModuleUse>,
    /// Commands (at most [`MAX_BATCH_OPS`]: a longer list is refused on
    /// its length prefix, before any command is decoded).
    #[serde(deserialize_with = "bounded::commands")]
    pub commands: Vec<Command>,
}

impl Batch {
    /// Checks counts, launches, module names and that the data length
    /// matches.
    ///
    /// # Errors
    ///
    /// [`ProtoError::Invalid`].
    pub fn validate(&self, data_len: usize) -> Result<(), ProtoError> {
        let commands: Vec<CommandView<'_>> = self.commands.iter().map(CommandView::from).collect();
        validate_batch(&self.modules, &commands, data_len)
    }
}

/// [`Batch::validate`] of a batch's modules and (borrowed) commands.
pub(crate) fn validate_batch(
    modules: &[ModuleUse],
    commands: &[CommandView<'_>],
    data_len: usize,
) -> Result<(), ProtoError> {
    if commands.len() > MAX_BATCH_OPS {
        return Err(ProtoError::Invalid("too many commands".into()));
    }
    if modules.len() > MAX_BATCH_MODULES {
        return Err(ProtoError::Invalid("too many modules".into()));
    }
    let mut need: u64 = 0;
    for (i, m) in modules.iter().enumerate() {
        if modules[..i].iter().any(|o| o.hash == m.hash) {
            return Err(ProtoError::Invalid(format!(
                "module {} listed twice",
                m.hash
            )));
        }
        if let Some(t) = &m.source {
            need += u64::from(t.len);
        }
    }
    for (i, c) in commands.iter().enumerate() {
        match &c.op {
            OpView::Alloc { size: 0, .. } => {
                return Err(ProtoError::Invalid(format!(
                    "command {i}: zero-sized allocation"
                )))
            }
            OpView::Write { len, .. } => need += u64::from(*len),
            OpView::Launch(spec) => {
                spec.validate(false)
                    .map_err(|e| ProtoError::Invalid(format!("command {i}: {e}")))?;
                if !modules.iter().any(|m| m.hash == spec.module) {
                    return Err(ProtoError::Invalid(format!(
                        "command {i}: module {} is not in the batch's modules",
                        spec.module
                    )));
                }
            }
            _ => {}
        }
    }
    if need != data_len as u64 {
        return Err(ProtoError::Invalid(format!(
            "batch data is {data_len} bytes but its modules and writes take {need}"
        )));
    }
    Ok(())
}

/// A [`Command`] that borrows its kernel name and scalar arguments: it
/// encodes to the same bytes, and decodes from a message without
/// allocating them (the node plans and the worker runs these).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct CommandView<'a> {
    pub(crate) stream: StreamId,
    #[serde(borrow)]
    pub(crate) op: OpView<'a>,
}

/// [`Op`], borrowed: the same variants in the same order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub(crate) enum OpView<'a> {
    Alloc {
        buf: Id,
        size: u64,
    },
    Write {
        buf: Id,
        offset: u64,
        len: u32,
    },
    Read {
        buf: Id,
        offset: u64,
        len: u32,
    },
    Free {
        id: Id,
    },
    Launch(#[serde(borrow)] LaunchView<'a>),
    Record {
        event: Id,
    },
    Wait {
        event: Id,
    },
    Fill {
        buf: Id,
        offset: u64,
        len: u64,
        value: u8,
    },
    Copy {
        src: Id,
        src_offset: u64,
        dst: Id,
        dst_offset: u64,
        len: u64,
    },
}

/// [`LaunchSpec`], borrowed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct LaunchView<'a> {
    pub(crate) module: ModuleHash,
    pub(crate) kernel: &'a str,
    pub(crate) grid: [u32; 3],
    pub(crate) block: [u32; 3],
    pub(crate) shared_mem: u32,
    #[serde(borrow, deserialize_with = "bounded::arg_views")]
    pub(crate) args: Vec<ArgView<'a>>,
}

impl LaunchView<'_> {
    /// As [`LaunchSpec::validate`].
    pub(crate) fn validate(&self, submit: bool) -> Result<(), ProtoError> {
        validate_launch(self.kernel, self.grid, self.block, &self.args, submit)
    }
}

/// [`KernelArg`], borrowed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum ArgView<'a> {
    Scalar(&'a [u8]),
    Mem { buf: Id, offset: u64 },
    Input(u32),
    Output,
}

impl<'a> From<&'a KernelArg> for ArgView<'a> {
    fn from(a: &'a KernelArg) -> Self {
        match a {
            KernelArg::Scalar(b) => ArgView::Scalar(b),
            KernelArg::Mem { buf, offset } => ArgView::Mem {
                buf: *buf,
                offset: *offset,
            },
            KernelArg::Input(n) => ArgView::Input(*n),
            KernelArg::Output => ArgView::Output,
        }
    }
}

impl<'a> From<&'a LaunchSpec> for LaunchView<'a> {
    fn from(l: &'a LaunchSpec) -> Self {
        LaunchView {
            module: l.module,
            kernel: &l.kernel,
            grid: l.grid,
            block: l.block,
            shared_mem: l.shared_mem,
            args: l.args.iter().map(ArgView::from).collect(),
        }
    }
}

impl<'a> From<&'a Command> for CommandView<'a> {
    fn from(c: &'a Command) -> Self {
        let op = match &c.op {
            Op::Alloc { buf, size } => OpView::Alloc {
                buf: *buf,
                size: *size,
            },
            Op::Write { buf, offset, len } => OpView::Write {
                buf: *buf,
                offset: *offset,
                len: *len,
            },
            Op::Read { buf, offset, len } => OpView::Read {
                buf: *buf,
                offset: *offset,
                len: *len,
            },
            Op::Free { id } => OpView::Free { id: *id },
            Op::Launch(l) => OpView::Launch(l.into()),
            Op::Record { event } => OpView::Record { event: *event },
            Op::Wait { event } => OpView::Wait { event: *event },
            Op::Fill {
                buf,
                offset,
                len,
                value,
            } => OpView::Fill {
                buf: *buf,
                offset: *offset,
                len: *len,
                value: *value,
            },
            Op::Copy {
                src,
                src_offset,
                dst,
                dst_offset,
                len,
            } => OpView::Copy {
                src: *src,
                src_offset: *src_offset,
                dst: *dst,
                dst_offset: *dst_offset,
                len: *len,
            },
        };
        CommandView {
            stream: c.stream,
            op,
        }
    }
}

/// A decoded BATCH whose commands borrow from the message.
#[cfg(feature = "node")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BatchView<'a> {
    pub(crate) lease: LeaseId,
    pub(crate) seq: u64,
    pub(crate) modules: Vec<ModuleUse>,
    pub(crate) commands: Vec<CommandView<'a>>,
}

#[cfg(feature = "node")]
impl<'a> BatchView<'a> {
    /// Decodes a BATCH body, and returns with it the bytes of its
    /// `commands` as they came (a postcard `Vec<Command>`): a node forwards
    /// them to its worker without encoding them again.
    ///
    /// # Errors
    ///
    /// [`ProtoError::Body`] as [`from_body`].
    pub(crate) fn decode(body: &'a [u8]) -> Result<(Self, &'a [u8]), ProtoError> {
        let (head, wire) = postcard::take_from_bytes::<BatchHead>(body)
            .map_err(|e| ProtoError::Body(e.to_string()))?;
        let commands = decode_commands(wire)?;
        let batch = BatchView {
            lease: head.lease,
            seq: head.seq,
            modules: head.modules,
            commands,
        };
        Ok((batch, wire))
    }

    /// The view of `b`.
    pub(crate) fn of(b: &'a Batch) -> Self {
        BatchView {
            lease: b.lease,
            seq: b.seq,
            modules: b.modules.clone(),
            commands: b.commands.iter().map(CommandView::from).collect(),
        }
    }

    /// As [`Batch::validate`].
    pub(crate) fn validate(&self, data_len: usize) -> Result<(), ProtoError> {
        validate_batch(&self.modules, &self.commands, data_len)
    }
}

/// The fields of [`Batch`] before its commands, in its order.
#[cfg(feature = "node")]
#[derive(Deserialize)]
struct BatchHead {
    lease: LeaseId,
    seq: u64,
    #[serde(deserialize_with = "bounded::modules")]
    modules: Vec<ModuleUse>,
}

/// A batch's commands alone, borrowed, encoded as in [`Batch`] (the node
/// to worker message carries them so).
#[cfg(feature = "node")]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Commands<'a>(
    #[serde(borrow, deserialize_with = "bounded::command_views")] pub(crate) Vec<CommandView<'a>>,
);

/// Appends `commands` (`n` of them) to `out` as postcard encodes a
/// `Vec<Command>` of the same commands: the inverse of
/// [`decode_commands`], without serde (the client encodes every
/// submission's commands on the round trip's path). The tests
/// `the_command_codec_agrees_with_serde` and `the_wire_form_is_the_protocols`
/// hold it to postcard's bytes.
pub(crate) fn encode_commands<'a>(
    out: &mut Vec<u8>,
    n: usize,
    commands: impl IntoIterator<Item = CommandView<'a>>,
) {
    put_varint(out, n as u64);
    for c in commands {
        encode_command(out, &c);
    }
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

fn encode_command(out: &mut Vec<u8>, c: &CommandView<'_>) {
    let v = |out: &mut Vec<u8>, x: u64| put_varint(out, x);
    v(out, c.stream.into());
    match &c.op {
        OpView::Alloc { buf, size } => {
            v(out, 0);
            v(out, buf.0);
            v(out, *size);
        }
        OpView::Write { buf, offset, len } => {
            v(out, 1);
            v(out, buf.0);
            v(out, *offset);
            v(out, (*len).into());
        }
        OpView::Read { buf, offset, len } => {
            v(out, 2);
            v(out, buf.0);
            v(out, *offset);
            v(out, (*len).into());
        }
        OpView::Free { id } => {
            v(out, 3);
            v(out, id.0);
        }
        OpView::Launch(l) => {
            v(out, 4);
            out.extend_from_slice(&l.module.0);
            put_bytes(out, l.kernel.as_bytes());
            for d in l.grid.iter().chain(&l.block) {
                v(out, (*d).into());
            }
            v(out, l.shared_mem.into());
            v(out, l.args.len() as u64);
            for a in &l.args {
                match a {
                    ArgView::Scalar(b) => {
                        v(out, 0);
                        put_bytes(out, b);
                    }
                    ArgView::Mem { buf, offset } => {
                        v(out, 1);
                        v(out, buf.0);
                        v(out, *offset);
                    }
                    ArgView::Input(n) => {
                        v(out, 2);
                        v(out, (*n).into());
                    }
                    ArgView::Output => v(out, 3),
                }
            }
        }
        OpView::Record { event } => {
            v(out, 5);
            v(out, event.0);
        }
        OpView::Wait { event } => {
            v(out, 6);
            v(out, event.0);
        }
        OpView::Fill {
            buf,
            offset,
            len,
            value,
        } => {
            v(out, 7);
            v(out, buf.0);
            v(out, *offset);
            v(out, *len);
            out.push(*value);
        }
        OpView::Copy {
            src,
            src_offset,
            dst,
            dst_offset,
            len,
        } => {
            v(out, 8);
            v(out, src.0);
            v(out, *src_offset);
            v(out, dst.0);
            v(out, *dst_offset);
            v(out, *len);
        }
    }
}

/// Decodes a batch's command list (a postcard `Vec<Command>`, the whole of
/// `wire`) as borrowed views, without serde: what the serde derive of
/// [`Commands`] does, value for value and error for error (the test
/// `the_command_codec_agrees_with_serde` holds it to that on every
/// command kind and on damaged input), in a third of the time. The node
/// and the worker each decode every BATCH's commands once, on the round
/// trip's path.
///
/// The list's length is refused over [`MAX_BATCH_OPS`], and a launch's
/// argument count over [`MAX_KERNEL_ARGS`], on the length prefix, before
/// any element is decoded.
///
/// # Errors
///
/// [`ProtoError::Body`] for input serde would refuse, or trailing bytes.
#[cfg(feature = "node")]
pub(crate) fn decode_commands(wire: &[u8]) -> Result<Vec<CommandView<'_>>, ProtoError> {
    let mut r = WireReader { b: wire };
    let n = r.len()?;
    if n > MAX_BATCH_OPS {
        return Err(r.error("too many commands"));
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let stream = r.u32()?;
        let op = match r.u32()? {
            0 => OpView::Alloc {
                buf: Id(r.u64()?),
                size: r.u64()?,
            },
            1 => OpView::Write {
                buf: Id(r.u64()?),
                offset: r.u64()?,
                len: r.u32()?,
            },
            2 => OpView::Read {
                buf: Id(r.u64()?),
                offset: r.u64()?,
                len: r.u32()?,
            },
            3 => OpView::Free { id: Id(r.u64()?) },
            4 => {
                let module = ModuleHash(r.take(32)?.try_into().expect("32 bytes"));
                let kernel =
                    std::str::from_utf8(r.bytes()?).map_err(|_| r.error("a name is not UTF-8"))?;
                let grid = [r.u32()?, r.u32()?, r.u32()?];
                let block = [r.u32()?, r.u32()?, r.u32()?];
                let shared_mem = r.u32()?;
                let n = r.len()?;
                if n > MAX_KERNEL_ARGS {
                    return Err(r.error("too many kernel arguments"));
                }
                let mut args = Vec::with_capacity(n);
                for _ in 0..n {
                    args.push(match r.u32()? {
                        0 => ArgView::Scalar(r.bytes()?),
                        1 => ArgView::Mem {
                            buf: Id(r.u64()?),
                            offset: r.u64()?,
                        },
                        2 => ArgView::Input(r.u32()?),
                        3 => ArgView::Output,
                        _ => return Err(r.error("unknown argument kind")),
                    });
                }
                OpView::Launch(LaunchView {
                    module,
                    kernel,
                    grid,
                    block,
                    shared_mem,
                    args,
                })
            }
            5 => OpView::Record {
                event: Id(r.u64()?),
            },
            6 => OpView::Wait {
                event: Id(r.u64()?),
            },
            7 => OpView::Fill {
                buf: Id(r.u64()?),
                offset: r.u64()?,
                len: r.u64()?,
                value: r.take(1)?[0],
            },
            8 => OpView::Copy {
                src: Id(r.u64()?),
                src_offset: r.u64()?,
                dst: Id(r.u64()?),
                dst_offset: r.u64()?,
                len: r.u64()?,
            },
            _ => return Err(r.error("unknown command kind")),
        };
        out.push(CommandView { stream, op });
    }
    if !r.b.is_empty() {
        return Err(ProtoError::Body(format!("{} trailing bytes", r.b.len())));
    }
    Ok(out)
}

/// Postcard's encoding read by hand: unsigned integers as LEB128 varints
/// of at most their type's width (a longer one, or one whose last byte
/// overflows the type, is refused as postcard refuses it), `u8` as one
/// byte, byte strings and sequences after a varint length.
#[cfg(feature = "node")]
struct WireReader<'a> {
    b: &'a [u8],
}

#[cfg(feature = "node")]
impl<'a> WireReader<'a> {
    fn error(&self, what: &str) -> ProtoError {
        ProtoError::Body(format!("{what} ({} bytes left)", self.b.len()))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], ProtoError> {
        if n > self.b.len() {
            return Err(self.error("truncated"));
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }

    /// A varint of at most `max` bytes whose last byte is at most `last`.
    #[inline]
    fn varint(&mut self, max: usize, last: u8) -> Result<u64, ProtoError> {
        let mut out = 0u64;
        for i in 0..max {
            let Some((&v, rest)) = self.b.split_first() else {
                return Err(self.error("truncated"));
            };
            self.b = rest;
            out |= u64::from(v & 0x7f) << (7 * i);
            if v & 0x80 == 0 {
                if i == max - 1 && v > last {
                    return Err(self.error("bad varint"));
                }
                return Ok(out);
            }
        }
        Err(self.error("bad varint"))
    }

    fn u32(&mut self) -> Result<u32, ProtoError> {
        // 5 bytes; the last carries 4 bits.
        self.varint(5, 0x0f).map(|v| v as u32)
    }

    fn u64(&mut self) -> Result<u64, ProtoError> {
        // 10 bytes; the last carries 1 bit.
        self.varint(10, 0x01)
    }

    fn len(&mut self) -> Result<usize, ProtoError> {
        self.u64().map(|v| v as usize)
    }

    fn bytes(&mut self) -> Result<&'a [u8], ProtoError> {
        let n = self.len()?;
        self.take(n)
    }
}

/// The failure that stopped a batch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpError {
    /// Index of the failed command.
    pub index: u32,
    /// Why.
    pub status: Status,
    /// Details (the compile or JIT log for LOAD_FAILED).
    pub message: String,
}

/// BATCH reply (status OK whenever the batch was accepted; a command's
/// failure is in `error`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchReply {
    /// Commands that ran (`0..completed`); what they created stays valid.
    /// The reply data holds the reads among them, in order.
    pub completed: u32,
    /// The command that stopped the batch, if any: commands after it did
    /// not run. `index == completed`, except for a kernel fault found when
    /// waiting for the batch (`completed` is then every command enqueued,
    /// and the lease is poisoned).
    pub error: Option<OpError>,
}

/// GPU_SUBMIT request: a stateless kernel call. The frame's data holds the
/// PTX (`ptx_len` bytes) followed by each input (`input_lens`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuSubmit {
    /// Kernel name.
    pub kernel: String,
    /// Grid dimensions.
    pub grid: [u32; 3],
    /// Block dimensions.
    pub block: [u32; 3],
    /// Dynamic shared memory bytes.
    pub shared_mem: u32,
    /// Arguments; [`KernelArg::Input`] and [`KernelArg::Output`] name buffers.
    #[serde(deserialize_with = "bounded::kernel_args")]
    pub args: Vec<KernelArg>,
    /// PTX length at the start of the data.
    pub ptx_len: u32,
    /// Input lengths, in order, after the PTX.
    #[serde(deserialize_with = "bounded::input_lens")]
    pub input_lens: Vec<u32>,
    /// Output buffer size; the reply's data.
    pub output_size: u32,
    /// Byte the output buffer is filled with before the launch.
    pub output_fill: u8,
}

impl GpuSubmit {
    /// Checks geometry, arguments and the data length.
    ///
    /// # Errors
    ///
    /// [`ProtoError::Invalid`].
    pub fn validate(&self, data_len: usize, limits: &Limits) -> Result<(), ProtoError> {
        let args: Vec<ArgView<'_>> = self.args.iter().map(ArgView::from).collect();
        validate_launch(&self.kernel, self.grid, self.block, &args, true)?;
        if self.input_lens.len() > MAX_KERNEL_ARGS {
            return Err(ProtoError::Invalid("too many inputs".into()));
        }
        if self.output_size == 0 || self.output_size > limits.max_data {
            return Err(ProtoError::Invalid(
                "output size must be 1..=max_data".into(),
            ));
        }
        for a in &self.args {
            if let KernelArg::Input(n) = a {
                if *n as usize >= self.input_lens.len() {
                    return Err(ProtoError::Invalid(format!("no input {n}")));
                }
            }
        }
        let need: u64 =
            u64::from(self.ptx_len) + self.input_lens.iter().map(|l| u64::from(*l)).sum::<u64>();
        if need != data_len as u64 {
            return Err(ProtoError::Invalid(
                "data length does not match ptx + inputs".into(),
            ));
        }
        Ok(())
    }
}

/// Deserializers that check a sequence's length prefix against its limit
/// before decoding (or allocating for) any element: a 1 MiB body of
/// one-byte entries cannot make the node decode a million of them.
mod bounded {
    use std::marker::PhantomData;

    use serde::de::{Deserialize, Deserializer, Error, SeqAccess, Visitor};

    use super::{
        Command, KernelArg, ModuleUse, MAX_BATCH_MODULES, MAX_BATCH_OPS, MAX_KERNEL_ARGS,
        MAX_SCALAR_ARG,
    };

    struct Bounded<T>(usize, PhantomData<T>);

    impl<'de, T: Deserialize<'de>> Visitor<'de> for Bounded<T> {
        type Value = Vec<T>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "a sequence of at most {} elements", self.0)
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
            let hint = seq.size_hint().unwrap_or(0);
            if hint > self.0 {
                return Err(A::Error::invalid_length(hint, &self));
            }
            let mut v = Vec::with_capacity(hint);
            while let Some(x) = seq.next_element()? {
                if v.len() == self.0 {
                    return Err(A::Error::invalid_length(self.0 + 1, &self));
                }
                v.push(x);
            }
            Ok(v)
        }
    }

    fn at_most<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
        d: D,
        max: usize,
    ) -> Result<Vec<T>, D::Error> {
        d.deserialize_seq(Bounded(max, PhantomData))
    }

    pub(super) fn commands<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Command>, D::Error> {
        at_most(d, MAX_BATCH_OPS)
    }

    pub(super) fn arg_views<'de: 'a, 'a, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Vec<super::ArgView<'a>>, D::Error> {
        at_most(d, MAX_KERNEL_ARGS)
    }

    #[cfg(feature = "node")]
    pub(super) fn command_views<'de: 'a, 'a, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Vec<super::CommandView<'a>>, D::Error> {
        at_most(d, MAX_BATCH_OPS)
    }

    pub(super) fn modules<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<ModuleUse>, D::Error> {
        at_most(d, MAX_BATCH_MODULES)
    }

    pub(super) fn kernel_args<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<KernelArg>, D::Error> {
        at_most(d, MAX_KERNEL_ARGS)
    }

    pub(super) fn input_lens<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u32>, D::Error> {
        at_most(d, MAX_KERNEL_ARGS)
    }

    pub(super) fn options<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
        let v: Vec<String> = at_most(d, super::MAX_MODULE_OPTIONS)?;
        if v.iter().any(|o| o.len() > super::MAX_OPTION_LEN) {
            return Err(D::Error::custom("NVRTC option too long"));
        }
        Ok(v)
    }

    pub(super) fn scalar<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        at_most(d, MAX_SCALAR_ARG)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip() {
        let h = Header::request(Opcode::Batch, 7, 3, 4);
        let back = Header::decode(&h.encode(), &Limits::default()).unwrap();
        assert_eq!(h, back);
    }

    #[test]
    fn limits_checked_in_header() {
        let h = Header::request(Opcode::MemWrite, 1, 0, u32::MAX);
        let err = Header::decode(&h.encode(), &Limits::default()).unwrap_err();
        assert!(matches!(err, ProtoError::DataTooLarge { .. }));
    }

    #[test]
    #[cfg(feature = "node")]
    fn a_batchs_commands_come_back_as_they_were_encoded() {
        let batch = Batch {
            lease: LeaseId::random(),
            seq: 7,
            modules: vec![ModuleUse {
                hash: ModuleHash([3; 32]),
                source: None,
            }],
            commands: vec![
                Command {
                    stream: 1,
                    op: Op::Alloc {
                        buf: Id(5),
                        size: 64,
                    },
                },
                Command {
                    stream: 2,
                    op: Op::Launch(LaunchSpec {
                        module: ModuleHash([3; 32]),
                        kernel: "k".into(),
                        grid: [1, 2, 3],
                        block: [4, 5, 6],
                        shared_mem: 0,
                        args: vec![KernelArg::u32(9), KernelArg::mem(Id(5))],
                    }),
                },
            ],
        };
        let body = to_body(&batch);
        let (back, wire) = BatchView::decode(&body).unwrap();
        assert_eq!(back, BatchView::of(&batch));
        assert_eq!(wire, &to_body(&batch.commands)[..]);
        assert_eq!(to_body(&Commands(back.commands.clone())), wire);
        assert_eq!(from_body::<Batch>(&body).unwrap(), batch);
        // Trailing bytes are refused as by `from_body`.
        let mut long = body.clone();
        long.push(0);
        assert!(BatchView::decode(&long).is_err());
    }

    /// One command of every kind, and a launch with every kind of argument.
    #[cfg(feature = "node")]
    fn every_command() -> Vec<Command> {
        let id = |n| Id(n);
        let big = u64::MAX - 3;
        [
            Op::Alloc {
                buf: id(1),
                size: 1 << 40,
            },
            Op::Write {
                buf: id(1),
                offset: big,
                len: u32::MAX,
            },
            Op::Read {
                buf: id(300),
                offset: 0,
                len: 128,
            },
            Op::Free { id: id(big) },
            Op::Launch(LaunchSpec {
                module: ModuleHash([0xa5; 32]),
                kernel: "kernel_\u{e9}".into(),
                grid: [1, 70_000, u32::MAX],
                block: [128, 1, 1],
                shared_mem: 49_152,
                args: vec![
                    KernelArg::Scalar(vec![1, 2, 3, 4, 5, 6, 7, 8, 9]),
                    KernelArg::mem(id(1)),
                    KernelArg::Mem {
                        buf: id(2),
                        offset: big,
                    },
                    KernelArg::Input(3),
                    KernelArg::Output,
                    KernelArg::Scalar(Vec::new()),
                ],
            }),
            Op::Record { event: id(9) },
            Op::Wait { event: id(9) },
            Op::Fill {
                buf: id(1),
                offset: 7,
                len: 9,
                value: 0xfe,
            },
            Op::Copy {
                src: id(1),
                src_offset: 1,
                dst: id(2),
                dst_offset: 2,
                len: 3,
            },
        ]
        .into_iter()
        .enumerate()
        .map(|(i, op)| Command {
            stream: [0, 1, 200, u32::MAX][i % 4],
            op,
        })
        .collect()
    }

    /// `decode_commands` against the serde derive it stands in for: equal
    /// values, or both refused.
    #[cfg(feature = "node")]
    fn agrees_with_serde(wire: &[u8]) {
        let fast = decode_commands(wire);
        let serde = from_body::<Commands<'_>>(wire);
        match (&fast, &serde) {
            (Ok(a), Ok(Commands(b))) => assert_eq!(a, b, "input {wire:?}"),
            (Err(_), Err(_)) => {}
            _ => panic!("decode_commands {fast:?} but serde {serde:?} for {wire:?}"),
        }
    }

    #[test]
    #[cfg(feature = "node")]
    fn the_command_codec_agrees_with_serde() {
        let commands = every_command();
        let wire = to_body(&commands);
        let mut ours = Vec::new();
        encode_commands(
            &mut ours,
            commands.len(),
            commands.iter().map(CommandView::from),
        );
        assert_eq!(ours, wire);
        let back = decode_commands(&wire).unwrap();
        assert_eq!(
            back,
            commands.iter().map(CommandView::from).collect::<Vec<_>>()
        );
        // Every cut, every one-byte change, and one byte too many.
        for n in 0..wire.len() {
            agrees_with_serde(&wire[..n]);
        }
        for i in 0..wire.len() {
            for v in [0x00, 0x01, 0x0f, 0x10, 0x7f, 0x80, 0xff, wire[i] ^ 0x01] {
                let mut bad = wire.clone();
                bad[i] = v;
                agrees_with_serde(&bad);
            }
        }
        let mut long = wire.clone();
        long.push(0);
        agrees_with_serde(&long);
        // Varints at their width's edge: the last byte's spare bits set, and
        // one byte too long (a u32 stream id, then a u64 buffer id).
        for stream in [
            &[0xff, 0xff, 0xff, 0xff, 0x0f][..],
            &[0xff, 0xff, 0xff, 0xff, 0x10],
        ] {
            let mut w = vec![1];
            w.extend_from_slice(stream);
            w.extend_from_slice(&[3, 5]);
            agrees_with_serde(&w);
        }
        for id in [&[0xff; 9][..], &[0xff; 10][..]] {
            let mut w = vec![1, 0, 3];
            w.extend_from_slice(id);
            w.push(0x01);
            agrees_with_serde(&w);
            w.pop();
            w.push(0x02);
            agrees_with_serde(&w);
        }
        // Counts over the limits are refused before anything is decoded.
        let many = to_body(&((MAX_BATCH_OPS + 1) as u64));
        assert!(decode_commands(&many).is_err());
        // Pseudo-random bytes behind a plausible start.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..20_000 {
            let len = (x % 64) as usize;
            let mut w = vec![(x >> 8) as u8 % 4];
            for _ in 0..len {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                w.push((x >> 24) as u8);
            }
            agrees_with_serde(&w);
        }
    }

    #[test]
    fn ids_parse_and_print() {
        let id = LeaseId::random();
        assert_eq!(id.to_string().parse::<LeaseId>().unwrap(), id);
        assert_ne!(LeaseId::random(), LeaseId::random());
    }
}
