//! BATCH: the modules it names, its commands and their ops, and its checks.

use serde::{Deserialize, Serialize};

#[cfg(doc)]
use super::Status;
use super::{bounded, LeaseId, ModuleHash, Op, ProtoError, SourceKind, StreamId, MAX_BATCH_OPS};

/// Bytes an [`Op::TimerEnd`] adds to the reply data.
pub const TIMER_BYTES: usize = 8;

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
    /// The source, the first time this node sees the module (checked
    /// against `hash`); `None` when the client believes the node has it
    /// (else the node answers [`Status::UnknownModule`]).
    pub source: Option<ModuleText>,
}

/// Ids from here up are the node's own (a client's are refused).
pub const FIRST_NODE_ID: u64 = 1 << 63;

/// One command of a batch: an op on a client-named stream of the lease.
/// Each stream runs its commands in order; streams run concurrently, ordered
/// by events and shared buffers (a write runs after any earlier use of its
/// buffer, and any use after an earlier write, whatever the streams).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Command<'a> {
    /// The stream.
    pub stream: StreamId,
    /// What to do.
    #[serde(borrow)]
    pub op: Op<'a>,
}

/// BATCH request: a pipeline in one message, answered when every command ran.
/// The frame's data holds the module sources (in `modules` order), then the
/// `Write` payloads and [`Op::Run`] inputs (in command order). On the wire the summed
/// [`Op::reply_len`] comes between `modules` and `commands`: the node reads up
/// to it ([`BatchHead`]), budgets the reply by it and forwards the commands
/// undecoded to the worker, which holds the reads to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch<'a> {
    /// The lease.
    pub lease: LeaseId,
    /// The batch's place in its lease's order (1, 2, 3, ...; 0: none). The
    /// node runs numbered batches in this order whatever order they arrive
    /// in, a batch waiting for its predecessors while they can still come
    /// (until the lease ends or their connection closes); so a batch may name
    /// what an unanswered predecessor creates. An empty batch of a number
    /// that ran or is on the node is answered at once: a client fills the
    /// number of a message it dropped with one.
    pub seq: u64,
    /// Modules the launches name (at most [`MAX_BATCH_MODULES`]).
    pub modules: Vec<ModuleUse>,
    /// Commands (at most [`MAX_BATCH_OPS`], refused on the length prefix).
    pub commands: Vec<Command<'a>>,
}

/// The commands whose replies come with their batch (with their index):
/// all but those of a prepared submission's body, which reply at each
/// [`Op::Run`] instead.
pub fn replying_now<'c, 'a>(
    commands: &'c [Command<'a>],
) -> impl Iterator<Item = (usize, &'c Command<'a>)> {
    let mut body = None;
    commands.iter().enumerate().filter(move |(_, c)| {
        // A prepared body runs from its begin to the end naming it.
        if let (Op::PrepareBegin { prepared }, None) = (&c.op, body) {
            body = Some(*prepared);
            return false;
        }
        if let (Op::GraphEnd { graph }, Some(p)) = (&c.op, body) {
            if *graph == p {
                body = None;
                return false;
            }
        }
        body.is_none()
    })
}

/// The bytes `commands` add to their reply's data (see [`Op::reply_len`]
/// and [`replying_now`]).
pub fn reply_bytes(commands: &[Command<'_>]) -> u64 {
    replying_now(commands).fold(0u64, |n, (_, c)| n.saturating_add(c.op.reply_len()))
}

/// A BATCH's head as written ([`BatchHead`] as read). A nested struct is
/// its fields in order on the wire, so a batch is its head, then its commands.
#[derive(Serialize)]
pub(crate) struct HeadRef<'m> {
    pub(crate) lease: LeaseId,
    pub(crate) seq: u64,
    pub(crate) modules: &'m [ModuleUse],
    pub(crate) reply_bytes: u64,
}

// A batch is its head, then its commands: postcard writes a tuple as its
// fields in order, as it does a struct.
impl Serialize for Batch<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let head = HeadRef {
            lease: self.lease,
            seq: self.seq,
            modules: &self.modules,
            reply_bytes: reply_bytes(&self.commands),
        };
        (head, &self.commands).serialize(s)
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Batch<'a> {
    /// The head's reply bytes are dropped: the commands give them.
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let (head, commands) = <(BatchHead, super::CommandList<'a>)>::deserialize(d)?;
        Ok(Batch {
            lease: head.lease,
            seq: head.seq,
            modules: head.modules,
            commands: commands.0,
        })
    }
}

/// A BATCH's fields before its commands ([`BatchHead::decode`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchHead {
    /// [`Batch::lease`].
    pub lease: LeaseId,
    /// [`Batch::seq`].
    pub seq: u64,
    /// [`Batch::modules`].
    #[serde(deserialize_with = "bounded::at_most::<_, _, MAX_BATCH_MODULES>")]
    pub modules: Vec<ModuleUse>,
    /// The bytes the commands' reads return: what the node holds for the
    /// reply (the worker refuses the read that would pass it).
    pub reply_bytes: u64,
}

impl BatchHead {
    /// Checks the modules (none twice) and that their sources fit in
    /// `data_len`; returns the sources' bytes (the writes' payloads follow).
    ///
    /// # Errors
    ///
    /// [`ProtoError::Invalid`].
    pub fn validate(&self, data_len: usize) -> Result<usize, ProtoError> {
        let sources = validate_modules(&self.modules)?;
        writes_len(sources, data_len)?;
        Ok(sources as usize)
    }

    /// Each module's source as the batch carries it in `data` (`None`: named
    /// by hash alone), checked to be UTF-8 and to hash to its name; then the
    /// writes' payloads that follow the sources.
    ///
    /// # Errors
    ///
    /// [`ProtoError::Invalid`], naming the module; the data too short.
    #[allow(clippy::type_complexity)]
    pub fn sources<'d>(
        &self,
        data: &'d [u8],
    ) -> Result<(Vec<Option<(&SourceKind, &'d str)>>, &'d [u8]), ProtoError> {
        let mut rest = data;
        let mut out = Vec::with_capacity(self.modules.len());
        for m in &self.modules {
            let Some(t) = &m.source else {
                out.push(None);
                continue;
            };
            if rest.len() < t.len as usize {
                return Err(ProtoError::Invalid("batch data too short".into()));
            }
            let (text, tail) = rest.split_at(t.len as usize);
            rest = tail;
            let text = std::str::from_utf8(text)
                .map_err(|_| ProtoError::Invalid(format!("module {}: not UTF-8", m.hash)))?;
            let actual = ModuleHash::of(&t.kind, text);
            if actual != m.hash {
                return Err(ProtoError::Invalid(format!(
                    "module {}: its source hashes to {actual}",
                    m.hash
                )));
            }
            out.push(Some((&t.kind, text)));
        }
        Ok((out, rest))
    }
}

impl Batch<'_> {
    /// Checks counts, launches, module names and the data length.
    ///
    /// # Errors
    ///
    /// [`ProtoError::Invalid`].
    pub fn validate(&self, data_len: usize) -> Result<(), ProtoError> {
        let sources = validate_modules(&self.modules)?;
        let hashes: Vec<ModuleHash> = self.modules.iter().map(|m| m.hash).collect();
        validate_commands(&hashes, &self.commands, writes_len(sources, data_len)?)
    }
}

/// Checks a module list (count, no duplicates); returns its sources' bytes.
fn validate_modules(modules: &[ModuleUse]) -> Result<u64, ProtoError> {
    if modules.len() > MAX_BATCH_MODULES {
        return Err(ProtoError::Invalid("too many modules".into()));
    }
    let mut sources: u64 = 0;
    for (i, m) in modules.iter().enumerate() {
        if modules[..i].iter().any(|o| o.hash == m.hash) {
            return Err(ProtoError::Invalid(format!(
                "module {} listed twice",
                m.hash
            )));
        }
        if let Some(t) = &m.source {
            sources += u64::from(t.len);
        }
    }
    Ok(sources)
}

/// Checks commands: count, no zero-sized allocation, valid launches naming one
/// of `modules`, writes' payloads totalling `writes_len` (the data after sources).
///
/// # Errors
///
/// [`ProtoError::Invalid`].
pub fn validate_commands(
    modules: &[ModuleHash],
    commands: &[Command<'_>],
    writes_len: u64,
) -> Result<(), ProtoError> {
    if commands.len() > MAX_BATCH_OPS {
        return Err(ProtoError::Invalid("too many commands".into()));
    }
    let mut need: u64 = 0;
    for (i, c) in commands.iter().enumerate() {
        need = need.saturating_add(c.op.data_len());
        if let Op::Alloc { size: 0, .. } = c.op {
            return Err(ProtoError::Invalid(format!(
                "command {i}: zero-sized allocation"
            )));
        }
        if let Op::Launch(spec) = &c.op {
            spec.validate(false)
                .map_err(|e| ProtoError::Invalid(format!("command {i}: {e}")))?;
            if !modules.contains(&spec.module) {
                return Err(ProtoError::Invalid(format!(
                    "command {i}: module {} is not in the batch's modules",
                    spec.module
                )));
            }
        }
    }
    if need != writes_len {
        return Err(ProtoError::Invalid(format!(
            "the batch's writes take {need} bytes but {writes_len} follow its modules' sources"
        )));
    }
    Ok(())
}

/// The bytes of a batch's data after its modules' `sources`.
fn writes_len(sources: u64, data_len: usize) -> Result<u64, ProtoError> {
    (data_len as u64).checked_sub(sources).ok_or_else(|| {
        ProtoError::Invalid(format!(
            "batch data is {data_len} bytes but its modules' sources take {sources}"
        ))
    })
}
