//! BATCH: the modules it names, its commands and their ops, and its checks.

use serde::{Deserialize, Serialize};

#[cfg(doc)]
use super::Status;
use super::{
    bounded, GemmSpec, Id, LaunchArg, LaunchSpec, LeaseId, ModuleHash, Operand, ProtoError,
    RandSpec, SourceKind, StreamId, MAX_BATCH_OPS,
};

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

/// What one command does: the protocol's one command type (client encodes,
/// node checks, worker runs). Ids are client-named: a creating command
/// (`Alloc`, an event's first `Record`) names an id unused in the lease; the
/// others name one made by an earlier command of this or an earlier batch.
/// Decoded, a launch's name and scalars borrow from the message
/// (`Op<'static>` owns them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Op<'a> {
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
        len: u64,
    },
    /// Read `len` bytes of `buf` at `offset` into the reply data, in command order.
    Read {
        /// Source.
        buf: Id,
        /// Byte offset.
        offset: u64,
        /// Bytes.
        len: u64,
    },
    /// Free a buffer (after its queued uses, on any stream) or an event.
    Free {
        /// The buffer or event.
        id: Id,
    },
    /// Launch a kernel.
    Launch(#[serde(borrow)] LaunchSpec<'a>),
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
    /// Copy `len` bytes from `src` to another buffer's `dst`.
    Copy {
        /// Source.
        src: Operand,
        /// Destination (in a buffer other than `src`'s).
        dst: Operand,
        /// Bytes.
        len: u64,
    },
    /// Start timer `timer` (a new id) when the GPU reaches this point.
    TimerStart {
        /// New timer id.
        timer: Id,
    },
    /// End timer `timer`: the GPU-measured nanoseconds since its start (a
    /// little-endian `u64`) go to the reply data in command order, as a
    /// read's bytes do. The timer is gone after.
    TimerEnd {
        /// A started timer.
        timer: Id,
    },
    /// Begin graph `graph` (a new id): the batch's next commands, on any
    /// stream, up to [`Op::GraphEnd`] are its body. In a body `Alloc`s run
    /// now, `Free`s wait for the graph's own free, and every other command
    /// runs at each [`Op::GraphLaunch`], not now. A body cannot read
    /// (`Read`, timers), begin or launch a graph, or fill with cuRAND
    /// ([`Op::allowed_in_body`]).
    GraphBegin {
        /// New graph id.
        graph: Id,
    },
    /// End the body of graph `graph`.
    GraphEnd {
        /// The graph being recorded.
        graph: Id,
    },
    /// Replay graph `graph` in order on the command's stream. A buffer a
    /// live graph uses cannot be freed: free the graph first
    /// (`Free { id: graph }`, which also runs the body's frees).
    GraphLaunch {
        /// The graph.
        graph: Id,
    },
    /// A matrix product by the node's cuBLAS (no kernel shipped).
    Gemm(Box<GemmSpec>),
    /// Random values by the node's cuRAND (no kernel shipped).
    RandFill(RandSpec),
    /// Begin prepared submission `prepared` (a new id): a body up to the
    /// [`Op::GraphEnd`] naming it, kept as a graph's is (its `Alloc`s run
    /// now, its `Free`s wait for its own free, the rest runs at each
    /// [`Op::Run`]), except that its `Write`s take their bytes from each
    /// run's data, its `Read`s go to each run's reply, and its commands run
    /// one by one instead of as a captured graph. The body's `Write` bytes
    /// sent with it are not kept, and its reads add nothing to this batch's
    /// reply. A body cannot time itself, begin, launch or run a graph, or
    /// fill with cuRAND ([`Op::allowed_in_body`]).
    PrepareBegin {
        /// New id.
        prepared: Id,
    },
    /// Run prepared submission `prepared` in order on the command's stream,
    /// its body's writes taking the next `inputs` bytes of the batch's data
    /// (in body order) and its reads adding `outputs` bytes to the reply.
    /// Both must equal the body's totals.
    Run {
        /// The prepared submission.
        prepared: Id,
        /// The bytes its body's writes take.
        inputs: u64,
        /// The bytes its body's reads return.
        outputs: u64,
    },
}

impl Op<'_> {
    /// Bytes the op adds to the reply data (a read's, or [`TIMER_BYTES`]).
    pub fn reply_len(&self) -> u64 {
        match self {
            Op::Read { len, .. } => *len,
            Op::TimerEnd { .. } => TIMER_BYTES as u64,
            Op::Run { outputs, .. } => *outputs,
            Op::Alloc { .. }
            | Op::Write { .. }
            | Op::Free { .. }
            | Op::Launch(_)
            | Op::Record { .. }
            | Op::Wait { .. }
            | Op::Fill { .. }
            | Op::Copy { .. }
            | Op::TimerStart { .. }
            | Op::GraphBegin { .. }
            | Op::GraphEnd { .. }
            | Op::GraphLaunch { .. }
            | Op::Gemm(_)
            | Op::RandFill(_)
            | Op::PrepareBegin { .. } => 0,
        }
    }

    /// Calls `f` with each buffer the op uses and whether it may write it (a
    /// launch may write all its buffers). A `Free` is not a use (its id may
    /// name an event or a graph).
    pub fn buffers(&self, mut f: impl FnMut(Id, bool)) {
        match self {
            Op::Alloc { buf, .. } | Op::Read { buf, .. } => f(*buf, false),
            Op::Write { buf, .. } | Op::Fill { buf, .. } => f(*buf, true),
            Op::Copy { src, dst, .. } => {
                f(src.buf, false);
                f(dst.buf, true);
            }
            Op::Launch(l) => {
                for a in &l.args {
                    if let LaunchArg::Mem { buf, .. } = a {
                        f(*buf, true);
                    }
                }
            }
            Op::Gemm(g) => {
                f(g.a.buf, false);
                f(g.b.buf, false);
                f(g.c.buf, true);
            }
            Op::RandFill(r) => f(r.dst.buf, true),
            Op::Free { .. }
            | Op::Record { .. }
            | Op::Wait { .. }
            | Op::TimerStart { .. }
            | Op::TimerEnd { .. }
            | Op::GraphBegin { .. }
            | Op::GraphEnd { .. }
            | Op::GraphLaunch { .. }
            | Op::PrepareBegin { .. }
            | Op::Run { .. } => {}
        }
    }

    /// Calls `f` with each id the op names (a launch's buffers included).
    pub fn for_each_id(&self, mut f: impl FnMut(Id)) {
        match self {
            Op::Free { id } => f(*id),
            Op::Record { event } | Op::Wait { event } => f(*event),
            Op::TimerStart { timer } | Op::TimerEnd { timer } => f(*timer),
            Op::GraphBegin { graph } | Op::GraphEnd { graph } | Op::GraphLaunch { graph } => {
                f(*graph)
            }
            Op::PrepareBegin { prepared } | Op::Run { prepared, .. } => f(*prepared),
            // These name buffers alone.
            Op::Alloc { .. }
            | Op::Write { .. }
            | Op::Read { .. }
            | Op::Launch(_)
            | Op::Fill { .. }
            | Op::Copy { .. }
            | Op::Gemm(_)
            | Op::RandFill(_) => self.buffers(|id, _| f(id)),
        }
    }

    /// What may sit in the body of a graph ([`Op::GraphBegin`]) or, with
    /// `prepared`, of a prepared submission ([`Op::PrepareBegin`]): the one
    /// rule, which the client checks as it records a body and the worker as
    /// it plans one. `Err` names what keeps the op out.
    ///
    /// A body is kept and replayed (captured as a CUDA graph where the
    /// device can), so it cannot
    /// - read into the reply, unless prepared (each run's reply takes a
    ///   prepared body's reads; a graph returns nothing),
    /// - time itself (a timer's end replies now),
    /// - begin a body (bodies do not nest), launch a graph or run a
    ///   prepared submission,
    /// - fill with cuRAND: cuRAND's host API fails inside a stream capture,
    ///   so a body holding such a fill could never be captured (fill before
    ///   recording the body, as locally).
    ///
    /// A [`Op::GraphEnd`] is allowed: it ends the body (the worker refuses
    /// one naming another graph). A body's `Free`s run with the body's own
    /// free.
    pub fn allowed_in_body(&self, prepared: bool) -> Result<(), NotInBody> {
        match self {
            Op::Read { .. } if !prepared => Err(NotInBody::Read),
            Op::TimerStart { .. } | Op::TimerEnd { .. } => Err(NotInBody::Timer),
            Op::GraphBegin { .. } | Op::PrepareBegin { .. } => Err(NotInBody::Begin),
            Op::GraphLaunch { .. } | Op::Run { .. } => Err(NotInBody::Launch),
            Op::RandFill(_) => Err(NotInBody::RandFill),
            Op::Alloc { .. }
            | Op::Write { .. }
            | Op::Read { .. }
            | Op::Free { .. }
            | Op::Launch(_)
            | Op::Record { .. }
            | Op::Wait { .. }
            | Op::Fill { .. }
            | Op::Copy { .. }
            | Op::GraphEnd { .. }
            | Op::Gemm(_) => Ok(()),
        }
    }
}

/// What keeps a command out of a graph's or a prepared submission's body
/// ([`Op::allowed_in_body`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotInBody {
    /// A `Read` in a graph's body: a graph returns nothing (read its
    /// output after a launch).
    Read,
    /// `TimerStart`, `TimerEnd`: a timer's end replies now.
    Timer,
    /// `GraphBegin`, `PrepareBegin`: bodies do not nest.
    Begin,
    /// `GraphLaunch`, `Run`.
    Launch,
    /// `RandFill`: cuRAND's host API fails inside a stream capture.
    RandFill,
}

impl NotInBody {
    /// What the body cannot do, as in "the body of graph 7 cannot {what}".
    pub fn what(self) -> &'static str {
        match self {
            NotInBody::Read => "read into the reply: read the graph's output after a launch",
            NotInBody::Timer => "time itself",
            NotInBody::Begin => "begin another graph",
            NotInBody::Launch => "launch a graph",
            NotInBody::RandFill => "fill with cuRAND: fill before recording the body",
        }
    }
}

impl std::fmt::Display for NotInBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.what())
    }
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
    commands
        .iter()
        .enumerate()
        .filter(move |(_, c)| match (&c.op, body) {
            (Op::PrepareBegin { prepared }, None) => {
                body = Some(*prepared);
                false
            }
            (Op::GraphEnd { graph }, Some(p)) if *graph == p => {
                body = None;
                false
            }
            (
                Op::Alloc { .. }
                | Op::Write { .. }
                | Op::Read { .. }
                | Op::Free { .. }
                | Op::Launch(_)
                | Op::Record { .. }
                | Op::Wait { .. }
                | Op::Fill { .. }
                | Op::Copy { .. }
                | Op::TimerStart { .. }
                | Op::TimerEnd { .. }
                | Op::GraphBegin { .. }
                | Op::GraphEnd { .. }
                | Op::GraphLaunch { .. }
                | Op::Gemm(_)
                | Op::RandFill(_)
                | Op::PrepareBegin { .. }
                | Op::Run { .. },
                b,
            ) => b.is_none(),
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
        match &c.op {
            Op::Alloc { size: 0, .. } => {
                return Err(ProtoError::Invalid(format!(
                    "command {i}: zero-sized allocation"
                )))
            }
            Op::Write { len, .. } | Op::Run { inputs: len, .. } => need = need.saturating_add(*len),
            Op::Launch(spec) => {
                spec.validate(false)
                    .map_err(|e| ProtoError::Invalid(format!("command {i}: {e}")))?;
                if !modules.contains(&spec.module) {
                    return Err(ProtoError::Invalid(format!(
                        "command {i}: module {} is not in the batch's modules",
                        spec.module
                    )));
                }
            }
            Op::Alloc { .. }
            | Op::Read { .. }
            | Op::Free { .. }
            | Op::Record { .. }
            | Op::Wait { .. }
            | Op::Fill { .. }
            | Op::Copy { .. }
            | Op::TimerStart { .. }
            | Op::TimerEnd { .. }
            | Op::GraphBegin { .. }
            | Op::GraphEnd { .. }
            | Op::GraphLaunch { .. }
            | Op::Gemm(_)
            | Op::RandFill(_)
            | Op::PrepareBegin { .. } => {}
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Dtype, RandDist};

    /// One op of each kind, with the rule for a graph's body and a prepared
    /// one's (`None`: allowed).
    fn every_op() -> Vec<(Op<'static>, Option<NotInBody>, Option<NotInBody>)> {
        let (a, b) = (Id(1), Id(2));
        let at = |buf| Operand::new(buf, 0);
        let launch = LaunchSpec {
            module: ModuleHash([0; 32]),
            kernel: "k".into(),
            grid: [1; 3],
            block: [1; 3],
            shared_mem: 0,
            args: vec![LaunchArg::Mem { buf: a, offset: 0 }],
        };
        let gemm = GemmSpec {
            dtype: Dtype::F32,
            a: at(a),
            b: at(a),
            c: at(b),
            m: 1,
            n: 1,
            k: 1,
            ld: [1; 3],
            transpose: [false; 2],
            scalars: [1f64.to_bits(), 0],
            batch: 1,
            strides: [0; 3],
        };
        let rand = RandSpec {
            dtype: Dtype::F32,
            dst: at(a),
            len: 2,
            seed: 1,
            dist: RandDist::Uniform,
        };
        use NotInBody::{Begin, Launch, RandFill, Read, Timer};
        vec![
            (Op::Alloc { buf: a, size: 8 }, None, None),
            (
                Op::Write {
                    buf: a,
                    offset: 0,
                    len: 8,
                },
                None,
                None,
            ),
            (
                Op::Read {
                    buf: a,
                    offset: 0,
                    len: 8,
                },
                Some(Read),
                None,
            ),
            (Op::Free { id: a }, None, None),
            (Op::Launch(launch), None, None),
            (Op::Record { event: b }, None, None),
            (Op::Wait { event: b }, None, None),
            (
                Op::Fill {
                    buf: a,
                    offset: 0,
                    len: 8,
                    value: 0,
                },
                None,
                None,
            ),
            (
                Op::Copy {
                    src: at(a),
                    dst: at(b),
                    len: 8,
                },
                None,
                None,
            ),
            (Op::TimerStart { timer: b }, Some(Timer), Some(Timer)),
            (Op::TimerEnd { timer: b }, Some(Timer), Some(Timer)),
            (Op::GraphBegin { graph: b }, Some(Begin), Some(Begin)),
            (Op::GraphEnd { graph: b }, None, None),
            (Op::GraphLaunch { graph: b }, Some(Launch), Some(Launch)),
            (Op::Gemm(Box::new(gemm)), None, None),
            (Op::RandFill(rand), Some(RandFill), Some(RandFill)),
            (Op::PrepareBegin { prepared: b }, Some(Begin), Some(Begin)),
            (
                Op::Run {
                    prepared: b,
                    inputs: 0,
                    outputs: 0,
                },
                Some(Launch),
                Some(Launch),
            ),
        ]
    }

    #[test]
    fn a_body_holds_no_read_of_a_graph_timer_nested_body_launch_or_curand_fill() {
        // One of each kind (a new kind fails to compile here).
        let kind = |op: &Op<'_>| match op {
            Op::Alloc { .. } => 0,
            Op::Write { .. } => 1,
            Op::Read { .. } => 2,
            Op::Free { .. } => 3,
            Op::Launch(_) => 4,
            Op::Record { .. } => 5,
            Op::Wait { .. } => 6,
            Op::Fill { .. } => 7,
            Op::Copy { .. } => 8,
            Op::TimerStart { .. } => 9,
            Op::TimerEnd { .. } => 10,
            Op::GraphBegin { .. } => 11,
            Op::GraphEnd { .. } => 12,
            Op::GraphLaunch { .. } => 13,
            Op::Gemm(_) => 14,
            Op::RandFill(_) => 15,
            Op::PrepareBegin { .. } => 16,
            Op::Run { .. } => 17,
        };
        let ops = every_op();
        let kinds: Vec<usize> = ops.iter().map(|(op, ..)| kind(op)).collect();
        assert_eq!(kinds, (0..18).collect::<Vec<_>>());
        for (op, graph, prepared) in ops {
            assert_eq!(op.allowed_in_body(false).err(), graph, "{op:?} in a graph");
            assert_eq!(op.allowed_in_body(true).err(), prepared, "{op:?} prepared");
        }
        assert_eq!(NotInBody::RandFill.to_string(), NotInBody::RandFill.what());
        assert!(NotInBody::RandFill.what().contains("cuRAND"));
    }
}
