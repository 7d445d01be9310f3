//! The request and reply bodies, the ids they name, and kernel launches.

use std::borrow::Cow;
use std::fmt;

use serde::{Deserialize, Serialize};

use super::{
    bounded, Limits, ProtoError, ScalarBytes, Status, MAX_KERNEL_ARGS, MAX_KERNEL_NAME,
    MAX_SCALAR_ARG,
};

/// A random, unguessable 128-bit lease id: the capability to use (and
/// always to free) the lease.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LeaseId(pub [u8; 16]);

impl LeaseId {
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

impl fmt::Debug for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LeaseId({self})")
    }
}

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl std::str::FromStr for LeaseId {
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

/// A buffer or event id in a lease, picked by the client (a per-lease
/// counter). A name, not a secret: only the lease's principal may use it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Id(pub u64);

impl fmt::Display for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// A client-named stream of a lease, made on demand up to the node's limit.
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
/// ([`ModuleHash::of`]). Collision-resistant, as the node caches modules
/// node-wide by it: naming one is useful only to a client knowing the source.
/// Encoded as a byte string (length 32, then the bytes), copied in one go.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModuleHash(pub [u8; 32]);

impl Serialize for ModuleHash {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for ModuleHash {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Bytes;
        impl<'de> serde::de::Visitor<'de> for Bytes {
            type Value = ModuleHash;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("32 bytes")
            }
            fn visit_bytes<E: serde::de::Error>(self, b: &[u8]) -> Result<ModuleHash, E> {
                b.try_into()
                    .map(ModuleHash)
                    .map_err(|_| E::invalid_length(b.len(), &self))
            }
        }
        d.deserialize_bytes(Bytes)
    }
}

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
        self.0[..8].iter().try_for_each(|b| write!(f, "{b:02x}"))
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

/// Bytes of a bulk-data ticket.
pub const BULK_TICKET_LEN: usize = 32;
/// Most tickets one BULK_OPEN asks for.
pub const MAX_BULK_TICKETS: u8 = 16;

/// BULK_OPEN request: tickets for `count` bulk-data connections.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BulkOpen {
    /// Connections the client will open (at most [`MAX_BULK_TICKETS`]).
    pub count: u8,
}

/// BULK_OPEN reply: the channel's TCP port (on the node's address) and one
/// single-use ticket per connection, opening it as the asking principal
/// within a short time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BulkTickets {
    /// The channel's TCP port.
    pub port: u16,
    /// One ticket per connection, sent first on it (after TLS).
    pub tickets: Vec<[u8; BULK_TICKET_LEN]>,
}

/// Bytes of a [`DirectGrant::ticket`].
pub const DIRECT_TICKET_LEN: usize = 32;

/// LEASE_DIRECT reply: where the lease's worker serves the lease's BATCHes
/// over QUIC. The client pins `cert_der` (a certificate made for this lease
/// alone) and opens each connection with a HELLO whose token is the ticket
/// ([`DirectHello`]); the node keeps serving everything else of the lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectGrant {
    /// The worker's UDP address (`ip:port`).
    pub addr: String,
    /// The worker's certificate (DER).
    pub cert_der: Vec<u8>,
    /// The connection's credential.
    pub ticket: [u8; DIRECT_TICKET_LEN],
}

/// HELLO on a lease's direct connection ([`DirectGrant`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectHello {
    /// The lease.
    pub lease: LeaseId,
    /// The grant's ticket.
    pub ticket: [u8; DIRECT_TICKET_LEN],
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
    /// Its limits.
    pub limits: DeviceLimits,
}

/// The numbers programs size their work by, as a node's device reports
/// them (`cuda_core::DeviceInfo`'s); 0 where unknown.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceLimits {
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// Threads per warp.
    pub warp_size: u32,
    /// Most threads in one block.
    pub max_threads_per_block: u32,
    /// Most threads resident on one multiprocessor.
    pub max_threads_per_multiprocessor: u32,
    /// Shared memory one block may use without opting in, in bytes.
    pub shared_memory_per_block: u32,
    /// Shared memory one block may use when its kernel opts in, in bytes.
    pub shared_memory_per_block_optin: u32,
    /// Shared memory of one multiprocessor, in bytes.
    pub shared_memory_per_multiprocessor: u32,
    /// L2 cache, in bytes.
    pub l2_cache_bytes: u32,
    /// Width of the memory bus, in bits.
    pub memory_bus_width_bits: u32,
    /// Peak SM clock in kHz.
    pub clock_khz: u32,
    /// Peak memory clock in kHz.
    pub memory_clock_khz: u32,
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
    /// Bytes allocated (buffers, loaded modules' sources, graphs' kept
    /// uploads) as of the worker's last answered batch.
    pub allocated: u64,
    /// The most bytes the lease has had allocated at once, as reported.
    pub allocated_high: u64,
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
    /// The numbered batch ([`Batch::seq`](super::Batch::seq)) this write
    /// follows (0: none): the node waits for it while it can still come, so
    /// a client may send the batch allocating `buf` and this write at once.
    pub after: u64,
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
    /// The numbered batch this read follows (0: none), as [`MemWrite::after`].
    pub after: u64,
}

/// MEM_FREE request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdOp {
    /// The lease.
    pub lease: LeaseId,
    /// The buffer or event to free.
    pub id: Id,
}

/// One kernel argument; decoded, its bytes borrow (`LaunchArg<'static>` owns them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum LaunchArg<'a> {
    /// Bytes passed by value (at most [`MAX_SCALAR_ARG`]).
    Scalar(#[serde(borrow, deserialize_with = "bounded::scalar")] ScalarBytes<'a>),
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

impl LaunchArg<'static> {
    /// Bytes passed by value (copied; inline up to 16 bytes).
    pub fn bytes(b: impl AsRef<[u8]>) -> Self {
        LaunchArg::Scalar(ScalarBytes::copied(b.as_ref()))
    }
    /// A 32-bit scalar.
    pub fn u32(v: u32) -> Self {
        Self::bytes(v.to_le_bytes())
    }
    /// A 64-bit scalar.
    pub fn u64(v: u64) -> Self {
        Self::bytes(v.to_le_bytes())
    }
    /// A 32-bit float scalar.
    pub fn f32(v: f32) -> Self {
        Self::bytes(v.to_le_bytes())
    }
    /// The address of a buffer.
    pub fn mem(buf: Id) -> Self {
        LaunchArg::Mem { buf, offset: 0 }
    }
}

/// Launch geometry and arguments. Decoded, its name and scalars borrow from
/// the message (`LaunchSpec<'static>` owns them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaunchSpec<'a> {
    /// Module holding the kernel (listed in the batch's `modules`).
    pub module: ModuleHash,
    /// Kernel (entry) name.
    #[serde(borrow)]
    pub kernel: Cow<'a, str>,
    /// Grid dimensions (each non-zero).
    pub grid: [u32; 3],
    /// Block dimensions (each non-zero).
    pub block: [u32; 3],
    /// Dynamic shared memory bytes.
    pub shared_mem: u32,
    /// Arguments in order (at most [`MAX_KERNEL_ARGS`], refused on the length prefix).
    #[serde(borrow, deserialize_with = "bounded::at_most::<_, _, MAX_KERNEL_ARGS>")]
    pub args: Vec<LaunchArg<'a>>,
}

impl LaunchSpec<'_> {
    /// Checks names, geometry and arguments.
    ///
    /// # Errors
    ///
    /// [`ProtoError::Invalid`] naming the broken rule.
    pub fn validate(&self, submit: bool) -> Result<(), ProtoError> {
        validate_launch(&self.kernel, self.grid, self.block, &self.args, submit)
    }
}

fn validate_launch(
    kernel: &str,
    grid: [u32; 3],
    block: [u32; 3],
    args: &[LaunchArg<'_>],
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
            LaunchArg::Scalar(b) if b.is_empty() || b.len() > MAX_SCALAR_ARG => {
                return bad("scalar arguments must be 1..=4096 bytes")
            }
            LaunchArg::Input(_) | LaunchArg::Output if !submit => {
                return bad("Input/Output arguments are for GPU_SUBMIT only")
            }
            LaunchArg::Mem { .. } if submit => return bad("GPU_SUBMIT has no lease memory"),
            _ => {}
        }
    }
    Ok(())
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
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchReply {
    /// Commands that ran (`0..completed`); what they created stays valid.
    /// The reply data holds the reads among them, in order.
    pub completed: u32,
    /// The command that stopped the batch, if any; later ones did not run.
    /// `index == completed`, except for a kernel fault found when waiting
    /// (then `completed` counts every enqueued command; the lease is poisoned).
    pub error: Option<OpError>,
}

/// GPU_SUBMIT request: a stateless kernel call. The frame's data holds the
/// PTX (`ptx_len` bytes) followed by each input (`input_lens`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuSubmit<'a> {
    /// Kernel name.
    #[serde(borrow)]
    pub kernel: Cow<'a, str>,
    /// Grid dimensions.
    pub grid: [u32; 3],
    /// Block dimensions.
    pub block: [u32; 3],
    /// Dynamic shared memory bytes.
    pub shared_mem: u32,
    /// Arguments; [`LaunchArg::Input`] and [`LaunchArg::Output`] name buffers.
    #[serde(borrow, deserialize_with = "bounded::at_most::<_, _, MAX_KERNEL_ARGS>")]
    pub args: Vec<LaunchArg<'a>>,
    /// PTX length at the start of the data.
    pub ptx_len: u32,
    /// Input lengths, in order, after the PTX.
    #[serde(deserialize_with = "bounded::at_most::<_, _, MAX_KERNEL_ARGS>")]
    pub input_lens: Vec<u32>,
    /// Output buffer size; the reply's data.
    pub output_size: u32,
    /// Byte the output buffer is filled with before the launch.
    pub output_fill: u8,
}

impl GpuSubmit<'_> {
    /// Checks geometry, arguments and the data length.
    ///
    /// # Errors
    ///
    /// [`ProtoError::Invalid`].
    pub fn validate(&self, data_len: usize, limits: &Limits) -> Result<(), ProtoError> {
        let bad = |m: &str| Err(ProtoError::Invalid(m.into()));
        validate_launch(&self.kernel, self.grid, self.block, &self.args, true)?;
        if self.input_lens.len() > MAX_KERNEL_ARGS {
            return bad("too many inputs");
        }
        if self.output_size == 0 || self.output_size > limits.max_data {
            return bad("output size must be 1..=max_data");
        }
        for a in &self.args {
            if let LaunchArg::Input(n) = a {
                if *n as usize >= self.input_lens.len() {
                    return Err(ProtoError::Invalid(format!("no input {n}")));
                }
            }
        }
        let need: u64 =
            u64::from(self.ptx_len) + self.input_lens.iter().map(|l| u64::from(*l)).sum::<u64>();
        if need != data_len as u64 {
            return bad("data length does not match ptx + inputs");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_parse_and_print() {
        let id = LeaseId::random();
        assert_eq!(id.to_string().parse::<LeaseId>().unwrap(), id);
        assert_ne!(LeaseId::random(), LeaseId::random());
    }

    #[test]
    fn a_module_hash_is_one_byte_string_of_32() {
        let h = ModuleHash::of(&SourceKind::Ptx, "// a module");
        let wire = postcard::to_allocvec(&h).unwrap();
        assert_eq!(wire.len(), 33);
        assert_eq!((wire[0], &wire[1..]), (32, &h.0[..]));
        assert_eq!(postcard::from_bytes::<ModuleHash>(&wire).unwrap(), h);
        // Another length is refused.
        let mut short = wire.clone();
        short[0] = 31;
        short.pop();
        assert!(postcard::from_bytes::<ModuleHash>(&short).is_err());
        let mut long = wire;
        long[0] = 33;
        long.push(0);
        assert!(postcard::from_bytes::<ModuleHash>(&long).is_err());
    }
}
