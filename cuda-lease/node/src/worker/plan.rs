//! The batch planner: what a BATCH's commands do to its lease's ids,
//! streams and reservation, decided in the worker before any is enqueued;
//! pure logic over the lease's state and its [`Charges`].

use super::messages::BatchLimits;
use super::objects::{GraphIds, IdKind, LeaseObjects};
use crate::device::{fill_bytes, gemm_spans};
use crate::proto::{IdMap, IdSet};

mod graphs;
use crate::proto::{
    Command, GemmSpec, Id, LaunchArg, Op, OpError, RandSpec, Status, StreamId, FIRST_NODE_ID,
    TIMER_BYTES,
};

/// A command's effect on the lease's ids, applied when it ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Effect {
    None,
    Create(Id, IdKind),
    Free(Id),
}

/// What a batch's commands do to the lease, up to the first command
/// refused (the commands before it are enqueued).
#[derive(Debug)]
pub(super) struct Plan {
    pub(super) effects: Vec<Effect>,
    /// Allocations charged to the lease, by command index.
    pub(super) charged: Vec<(usize, u64)>,
    /// Graphs made and freed, by command index.
    pub(super) graphs: Vec<(usize, GraphChange)>,
    pub(super) error: Option<OpError>,
}

/// A graph a command made (with what it holds) or freed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum GraphChange {
    Made(Id, GraphIds),
    Freed(Id),
}

/// What a plan charges as it goes: allocations to the lease's reservation,
/// reads to the bytes the node holds for the batch's reply. A refusal fails
/// the command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Charges {
    /// Bytes of the reservation taken.
    pub(super) allocated: u64,
    /// The lease's reservation.
    pub(super) reserved: u64,
    /// Bytes held for the reply.
    pub(super) held: u64,
    /// Bytes the batch's reads took of them.
    pub(super) read: u64,
}

impl Charges {
    /// An allocation of `bytes`, to the reservation.
    pub(super) fn alloc(&mut self, bytes: u64) -> Result<(), Refusal> {
        let after = self.allocated.saturating_add(bytes);
        if after > self.reserved {
            return Err((
                Status::CapacityExceeded,
                format!(
                    "lease reserved {} bytes, {} allocated, {bytes} more asked",
                    self.reserved, self.allocated
                ),
            ));
        }
        self.allocated = after;
        Ok(())
    }

    /// `bytes` of reply data, to the bytes held.
    fn reply(&mut self, bytes: u64) -> Result<(), Refusal> {
        self.read = self.read.saturating_add(bytes);
        if self.read > self.held {
            return Err((
                Status::CapacityExceeded,
                format!(
                    "read: the node holds {} bytes for this batch's reply (the reads the \
                     batch declared, as far as the principal's max_bytes_per_principal \
                     allows); its reads pass them",
                    self.held
                ),
            ));
        }
        Ok(())
    }
}

/// Plans `commands` over `state`: each command is checked against the
/// ids, streams and limits left by the commands before it; the first one
/// refused ends the plan with its error.
pub(super) fn plan(
    limits: &BatchLimits,
    state: &LeaseObjects,
    commands: &[Command<'_>],
    charges: &mut Charges,
) -> Plan {
    let mut planner = Planner {
        limits,
        state,
        charges,
        overlay: IdMap::default(),
        live: state.ids.len(),
        streams: state.streams.clone(),
        read_total: 0,
        open: None,
        graph_overlay: IdMap::default(),
        graph_changes: Vec::new(),
    };
    let mut p = Plan {
        effects: Vec::with_capacity(commands.len()),
        charged: Vec::new(),
        graphs: Vec::new(),
        error: None,
    };
    for (i, c) in commands.iter().enumerate() {
        // (A body's own `GraphBegin` is refused as nested first.)
        let ends = match planner.open {
            None => graphs::body_ends(commands, i),
            Some(_) => Ok(()),
        };
        let step = ends.and_then(|()| {
            let step = planner.graph_step(i, c)?;
            match step {
                Some(s) => Ok(s),
                None => planner.step(c),
            }
        });
        match step {
            Ok(step) => {
                planner.apply(step.effect, c.stream);
                if let Some(size) = step.charged {
                    p.charged.push((i, size));
                }
                p.effects.push(step.effect);
            }
            Err((status, message)) => {
                p.error = Some(OpError {
                    index: i as u32,
                    status,
                    message: format!("command {i}: {message}"),
                });
                break;
            }
        }
    }
    p.graphs = planner.graph_changes;
    p
}

/// One planned command.
struct Step {
    effect: Effect,
    /// An allocation charged to the lease.
    charged: Option<u64>,
}

impl Step {
    fn effect(effect: Effect) -> Self {
        Step {
            effect,
            charged: None,
        }
    }
}

type Refusal = (Status, String);

/// The lease as the commands planned so far leave it.
struct Planner<'s> {
    limits: &'s BatchLimits,
    state: &'s LeaseObjects,
    charges: &'s mut Charges,
    /// The batch's own creations (`Some`) and frees (`None`).
    overlay: IdMap<Id, Option<IdKind>>,
    live: usize,
    streams: IdSet<StreamId>,
    read_total: u64,
    /// The graph whose body is being planned.
    open: Option<(Id, GraphIds)>,
    /// The batch's own graphs (`Some`) and graph frees (`None`).
    graph_overlay: IdMap<Id, Option<GraphIds>>,
    graph_changes: Vec<(usize, GraphChange)>,
}

impl Planner<'_> {
    /// What `id` is after the commands planned so far: the batch's own
    /// creations and frees over the lease's state.
    fn kind(&self, id: Id) -> Option<IdKind> {
        match self.overlay.get(&id) {
            Some(k) => *k,
            None => self.state.ids.get(&id).copied(),
        }
    }

    fn apply(&mut self, effect: Effect, stream: StreamId) {
        match effect {
            Effect::Create(id, k) => {
                self.overlay.insert(id, Some(k));
                self.live += 1;
            }
            Effect::Free(id) => {
                self.overlay.insert(id, None);
                self.live -= 1;
            }
            Effect::None => {}
        }
        self.streams.insert(stream);
    }

    /// The size of buffer `id`.
    fn buffer(&self, id: Id) -> Result<u64, Refusal> {
        match self.kind(id) {
            Some(IdKind::Buffer(n)) => Ok(n),
            Some(k) => Err((
                Status::BadRequest,
                format!("{id} is {}, not a buffer", k.noun()),
            )),
            None => Err((Status::NotFound, format!("unknown id {id}"))),
        }
    }

    /// Whether `event` names an event (`Ok(true)`), nothing (`Ok(false)`),
    /// or a buffer (refused).
    fn event(&self, event: Id) -> Result<bool, Refusal> {
        match self.kind(event) {
            Some(IdKind::Event) => Ok(true),
            Some(k) => Err((
                Status::BadRequest,
                format!("{event} is {}, not an event", k.noun()),
            )),
            None => Ok(false),
        }
    }

    /// Checks that `id` is free to name something new.
    fn fresh(&self, id: Id) -> Result<(), Refusal> {
        if id.0 >= FIRST_NODE_ID {
            return Err((
                Status::BadRequest,
                format!("id {id} is reserved for the node"),
            ));
        }
        if self.kind(id).is_some() {
            return Err((Status::BadRequest, format!("id {id} is already in use")));
        }
        if self.live >= self.limits.max_ids as usize {
            return Err((
                Status::CapacityExceeded,
                format!("more than {} live ids in one lease", self.limits.max_ids),
            ));
        }
        Ok(())
    }

    /// A read of `len` bytes within the buffer, charged as reply data before it
    /// is read (the bytes are held until the reply is taken).
    fn read(&mut self, buf: Id, offset: u64, len: u64) -> Result<(), Refusal> {
        in_range(self.buffer(buf)?, offset, len)?;
        self.reply_bytes(len)
    }

    /// `len` bytes of reply data: within the reply's data limit and the
    /// principal's byte budget.
    fn reply_bytes(&mut self, len: u64) -> Result<(), Refusal> {
        self.read_total = self.read_total.saturating_add(len);
        if self.read_total > self.limits.max_read {
            return Err((
                Status::BadRequest,
                "reads exceed the reply data limit".into(),
            ));
        }
        self.charges.reply(len)
    }

    /// A launch's buffer arguments name buffers of the lease, at offsets
    /// within them.
    fn launch_args(&self, args: &[LaunchArg<'_>]) -> Result<(), Refusal> {
        for a in args {
            match a {
                LaunchArg::Scalar(_) => {}
                LaunchArg::Mem { buf, offset } => in_range(self.buffer(*buf)?, *offset, 0)?,
                LaunchArg::Input(_) | LaunchArg::Output => {
                    return Err((Status::BadRequest, "Input/Output are for GPU_SUBMIT".into()))
                }
            }
        }
        Ok(())
    }

    /// Checks a GEMM's shapes against its buffers: each matrix lies in its
    /// buffer at an offset of whole elements, and `C` overlaps neither `A`
    /// nor `B`.
    fn gemm(&self, g: &GemmSpec) -> Result<(), Refusal> {
        let bad = |m: String| (Status::BadRequest, m);
        let bytes = gemm_spans(g).map_err(bad)?;
        let size = g.dtype.size();
        let mut spans = [(Id(0), 0u64, 0u64); 3];
        for (i, (name, o)) in g.operands().into_iter().enumerate() {
            if o.offset % size != 0 {
                return Err(bad(format!(
                    "gemm: {name} starts at byte {}, not at a whole element of {size} bytes",
                    o.offset
                )));
            }
            in_range(self.buffer(o.buf)?, o.offset, bytes[i])
                .map_err(|(s, m)| (s, format!("gemm: {name}: {m}")))?;
            spans[i] = (o.buf, o.offset, o.offset + bytes[i]);
        }
        let c = spans[2];
        for (name, s) in [("A", spans[0]), ("B", spans[1])] {
            if s.0 == c.0 && s.1 < c.2 && c.1 < s.2 {
                return Err(bad(format!("gemm: C overlaps {name} in buffer {}", c.0)));
            }
        }
        Ok(())
    }

    /// Checks a random fill against its buffer: it lies inside it, at an
    /// offset of whole elements.
    fn rand_fill(&self, r: &RandSpec) -> Result<(), Refusal> {
        let bad = |m: String| (Status::BadRequest, m);
        let bytes = fill_bytes(r).map_err(bad)?;
        let size = r.dtype.size();
        if !r.dst.offset.is_multiple_of(size) {
            return Err(bad(format!(
                "random fill: starts at byte {}, not at a whole element of {size} bytes",
                r.dst.offset
            )));
        }
        in_range(self.buffer(r.dst.buf)?, r.dst.offset, bytes)
            .map_err(|(s, m)| (s, format!("random fill: {m}")))?;
        Ok(())
    }

    fn step(&mut self, c: &Command<'_>) -> Result<Step, Refusal> {
        let stream = c.stream;
        if !self.streams.contains(&stream) && self.streams.len() >= self.limits.max_streams as usize
        {
            return Err((
                Status::CapacityExceeded,
                format!(
                    "stream {stream} would be more than the lease's limit of {} streams",
                    self.limits.max_streams
                ),
            ));
        }
        let effect = match &c.op {
            Op::Alloc { buf, size } => {
                self.fresh(*buf)?;
                self.charges.alloc(*size)?;
                return Ok(Step {
                    effect: Effect::Create(*buf, IdKind::Buffer(*size)),
                    charged: Some(*size),
                });
            }
            Op::Write { buf, offset, len }
            | Op::Fill {
                buf, offset, len, ..
            } => in_range(self.buffer(*buf)?, *offset, *len).map(|()| Effect::None)?,
            Op::Read { buf, offset, len } => {
                self.read(*buf, *offset, *len).map(|()| Effect::None)?
            }
            Op::Free { id } if self.kind(*id).is_none() => {
                return Err((Status::NotFound, format!("unknown id {id}")))
            }
            Op::Free { id } => Effect::Free(*id),
            Op::Launch(spec) => self.launch_args(&spec.args).map(|()| Effect::None)?,
            Op::Copy { src, dst, len } => {
                in_range(self.buffer(src.buf)?, src.offset, *len)?;
                in_range(self.buffer(dst.buf)?, dst.offset, *len)?;
                if src.buf == dst.buf {
                    let src = src.buf;
                    return Err((Status::BadRequest, format!("a copy from {src} to itself")));
                }
                Effect::None
            }
            Op::Record { event } if self.event(*event)? => Effect::None,
            Op::Record { event } => self
                .fresh(*event)
                .map(|()| Effect::Create(*event, IdKind::Event))?,
            Op::Wait { event } if !self.event(*event)? => {
                return Err((Status::NotFound, format!("unknown id {event}")))
            }
            Op::Wait { .. } => Effect::None,
            Op::TimerStart { timer } => self
                .fresh(*timer)
                .map(|()| Effect::Create(*timer, IdKind::Timer))?,
            Op::TimerEnd { timer } => {
                match self.kind(*timer) {
                    Some(IdKind::Timer) => {}
                    Some(_) => return Err((Status::BadRequest, format!("{timer} is not a timer"))),
                    None => return Err((Status::NotFound, format!("unknown id {timer}"))),
                }
                self.reply_bytes(TIMER_BYTES as u64)?;
                Effect::Free(*timer)
            }
            Op::Gemm(g) => self.gemm(g).map(|()| Effect::None)?,
            Op::RandFill(r) => self.rand_fill(r).map(|()| Effect::None)?,
            // Planned by `graph_step`.
            Op::GraphBegin { .. }
            | Op::GraphEnd { .. }
            | Op::GraphLaunch { .. }
            | Op::PrepareBegin { .. }
            | Op::Run { .. } => {
                return Err((Status::Internal, "a graph command planned twice".into()))
            }
        };
        Ok(Step::effect(effect))
    }
}

/// Checks that `offset + len` lies within a buffer of `size` bytes.
pub(super) fn in_range(size: u64, offset: u64, len: u64) -> Result<(), Refusal> {
    if offset.checked_add(len).is_none_or(|end| end > size) {
        return Err((
            Status::BadRequest,
            format!("range {offset}+{len} is outside a buffer of {size} bytes"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
