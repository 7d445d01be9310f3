//! The protocol's one command type, [`Op`]: its variants, what each does to
//! a lease's state (ids made, used and freed, reply bytes), and what may sit
//! in a graph's or a prepared submission's body ([`Op::allowed_in_body`]).

use serde::{Deserialize, Serialize};

use super::{GemmSpec, Id, LaunchArg, LaunchSpec, Operand, RandSpec, TIMER_BYTES};

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
    /// The command's [`Role`]: where a new command is placed once.
    pub fn role(&self) -> Role {
        match *self {
            Op::Alloc { buf, size } => Role::Alloc { buf, size },
            Op::Free { id } => Role::Free(id),
            Op::Write { buf, offset, len } => Role::Write { buf, offset, len },
            Op::Read { buf, offset, len } => Role::Read { buf, offset, len },
            Op::GraphBegin { graph: id } => Role::Begin {
                id,
                prepared: false,
            },
            Op::PrepareBegin { prepared: id } => Role::Begin { id, prepared: true },
            Op::GraphEnd { graph } => Role::End(graph),
            Op::GraphLaunch { graph } => Role::Launch(graph),
            Op::Run {
                prepared,
                inputs,
                outputs,
            } => Role::Run {
                id: prepared,
                inputs,
                outputs,
            },
            Op::Launch(_)
            | Op::Record { .. }
            | Op::Wait { .. }
            | Op::Fill { .. }
            | Op::Copy { .. }
            | Op::TimerStart { .. }
            | Op::TimerEnd { .. }
            | Op::Gemm(_)
            | Op::RandFill(_) => Role::Plain,
        }
    }

    /// The range of a buffer the op sets whatever it held before (a
    /// write's, a fill's): its buffer, offset and length.
    pub fn sets(&self) -> Option<(Id, u64, u64)> {
        match *self {
            Op::Write { buf, offset, len }
            | Op::Fill {
                buf, offset, len, ..
            } => Some((buf, offset, len)),
            Op::Alloc { .. }
            | Op::Read { .. }
            | Op::Free { .. }
            | Op::Launch(_)
            | Op::Record { .. }
            | Op::Wait { .. }
            | Op::Copy { .. }
            | Op::TimerStart { .. }
            | Op::TimerEnd { .. }
            | Op::GraphBegin { .. }
            | Op::GraphEnd { .. }
            | Op::GraphLaunch { .. }
            | Op::Gemm(_)
            | Op::RandFill(_)
            | Op::PrepareBegin { .. }
            | Op::Run { .. } => None,
        }
    }

    /// Bytes of the batch's data the op takes (a write's, a run's inputs).
    pub fn data_len(&self) -> u64 {
        match self.role() {
            Role::Write { len, .. } => len,
            Role::Run { inputs, .. } => inputs,
            Role::Alloc { .. }
            | Role::Free(_)
            | Role::Read { .. }
            | Role::Begin { .. }
            | Role::End(_)
            | Role::Launch(_)
            | Role::Plain => 0,
        }
    }

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

/// A command's part in a batch's data and reply and in the bodies a lease
/// keeps (graphs and prepared submissions), the one classification the
/// client's routing and the worker's planner and replays share
/// ([`Op::role`]): a command other than these is [`Role::Plain`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Allocates `size` bytes as `buf` (in a body: now, not at each launch).
    Alloc {
        /// The new buffer.
        buf: Id,
        /// Bytes.
        size: u64,
    },
    /// Frees `id`: a buffer, an event, a graph or a prepared submission
    /// (in a body: with the body's own free).
    Free(Id),
    /// Writes the batch's next `len` bytes of data into `buf` at `offset`
    /// (in a prepared body: each run's data).
    Write {
        /// Target.
        buf: Id,
        /// Byte offset.
        offset: u64,
        /// Bytes.
        len: u64,
    },
    /// Reads `len` bytes of `buf` at `offset` into the reply (in a
    /// prepared body: each run's reply).
    Read {
        /// Source.
        buf: Id,
        /// Byte offset.
        offset: u64,
        /// Bytes.
        len: u64,
    },
    /// Begins the body of graph `id`, or of prepared submission `id`.
    Begin {
        /// The new graph or prepared submission.
        id: Id,
        /// A prepared submission's body.
        prepared: bool,
    },
    /// Ends the body of `id`.
    End(Id),
    /// Replays graph `id`.
    Launch(Id),
    /// Runs prepared submission `id`, its writes taking `inputs` bytes of
    /// the batch's data and its reads adding `outputs` to the reply.
    Run {
        /// The prepared submission.
        id: Id,
        /// Bytes of data.
        inputs: u64,
        /// Bytes of reply.
        outputs: u64,
    },
    /// Any other command: it touches only its buffers and events (a body
    /// keeps it and runs it at each launch or run).
    Plain,
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

#[cfg(test)]
mod tests;
