//! The lease as its worker holds it: the ids its client named, its streams
//! and graphs, and what it has allocated of its reservation.

use serde::{Deserialize, Serialize};

use super::messages::WorkerLoad;
use super::plan::{in_range, plan, Charges, Effect, GraphChange, Plan};
use crate::device::DeviceError;
use crate::proto::{validate_commands, Command, Id, ModuleHash, Status, StreamId};
pub(super) use crate::proto::{IdMap, IdSet};

/// What a client-named id of a lease is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum IdKind {
    /// A buffer of this many bytes (charged to the lease).
    Buffer(u64),
    /// An event.
    Event,
    /// A started timer.
    Timer,
    /// A graph (its body is in [`LeaseObjects::graphs`]).
    Graph,
}

impl IdKind {
    /// What it is, for messages: "a buffer", "an event"...
    pub(super) fn noun(self) -> &'static str {
        match self {
            IdKind::Buffer(_) => "a buffer",
            IdKind::Event => "an event",
            IdKind::Timer => "a timer",
            IdKind::Graph => "a graph",
        }
    }
}

/// What a graph of a lease holds on to.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct GraphIds {
    /// The ids its body names: none of them can be freed while it lives.
    pub(super) uses: IdSet<Id>,
    /// The frees its body asked for, run with its own.
    pub(super) frees: Vec<Id>,
    /// Its body's upload bytes, kept by the worker for its replays and
    /// charged to the lease's reservation.
    pub(super) kept: u64,
}

/// A lease's live ids, with a count of its buffers.
#[derive(Debug, Default)]
pub(super) struct Ids {
    map: IdMap<Id, IdKind>,
    buffers: u32,
}

impl Ids {
    pub(super) fn get(&self, id: &Id) -> Option<&IdKind> {
        self.map.get(id)
    }

    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    pub(super) fn insert(&mut self, id: Id, k: IdKind) -> Option<IdKind> {
        let old = self.map.insert(id, k);
        self.count(Some(k), old);
        old
    }

    pub(super) fn remove(&mut self, id: &Id) -> Option<IdKind> {
        let old = self.map.remove(id);
        self.count(None, old);
        old
    }

    fn count(&mut self, new: Option<IdKind>, old: Option<IdKind>) {
        let buffer = |k: Option<IdKind>| u32::from(matches!(k, Some(IdKind::Buffer(_))));
        self.buffers = self.buffers + buffer(new) - buffer(old);
    }
}

/// A lease's client-named objects: its ids, streams and graphs.
#[derive(Debug, Default)]
pub(super) struct LeaseObjects {
    pub(super) ids: Ids,
    /// Streams the lease has used.
    pub(super) streams: IdSet<StreamId>,
    /// The lease's live graphs.
    pub(super) graphs: IdMap<Id, GraphIds>,
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

/// The lease of a worker.
#[derive(Debug, Default)]
pub(super) struct WorkerLease {
    objects: LeaseObjects,
    /// Bytes charged to the reservation.
    allocated: u64,
}

/// What a batch was planned to do: the bytes charged for its modules (in
/// load order) and the plan of its commands.
#[derive(Debug)]
pub(super) struct Planned {
    pub(super) loads: Vec<u64>,
    pub(super) plan: Plan,
}

impl Planned {
    /// Commands planned (the ones after them refused).
    pub(super) fn commands(&self) -> usize {
        self.plan.effects.len()
    }
}

impl WorkerLease {
    /// Checks a batch (its commands against its module list and the
    /// `writes_len` bytes of its writes), charges its modules' sources
    /// (`loads`) and plans its commands; what the plan creates exists at once
    /// for later batches. `Err` refuses the whole batch, nothing charged.
    pub(super) fn plan(
        &mut self,
        limits: &BatchLimits,
        modules: &[ModuleHash],
        loads: &[WorkerLoad],
        commands: &[Command<'_>],
        writes_len: u64,
    ) -> Result<Planned, DeviceError> {
        validate_commands(modules, commands, writes_len)
            .map_err(|e| DeviceError::new(Status::BadRequest, e.to_string()))?;
        let mut charges = Charges {
            allocated: self.allocated,
            reserved: limits.reserved,
            held: limits.reply_bytes,
            read: 0,
        };
        for l in loads {
            charges.alloc(l.len.into()).map_err(|(status, m)| {
                DeviceError::new(status, format!("module {}: {m}", l.hash))
            })?;
        }
        let plan = plan(limits, &self.objects, commands, &mut charges);
        self.allocated = charges.allocated;
        self.apply(commands, &plan);
        Ok(Planned {
            loads: loads.iter().map(|l| u64::from(l.len)).collect(),
            plan,
        })
    }

    /// What a planned batch will make, in the lease's state now: the
    /// batches planned after it may name it (if it does not run, they fail
    /// on the device, naming it). Frees wait for [`WorkerLease::settle`].
    fn apply(&mut self, commands: &[Command<'_>], p: &Plan) {
        let state = &mut self.objects;
        for (c, effect) in commands.iter().zip(&p.effects) {
            state.streams.insert(c.stream);
            if let Effect::Create(id, k) = *effect {
                state.ids.insert(id, k);
            }
        }
        for (_, change) in &p.graphs {
            if let GraphChange::Made(g, ids) = change {
                state.graphs.insert(*g, ids.clone());
            }
        }
    }

    /// Once a batch's work is done (`loaded` modules loaded, `completed`
    /// commands run): undoes what [`WorkerLease::plan`] made that did not run,
    /// giving its charges back, and applies the frees that ran.
    pub(super) fn settle(&mut self, planned: &Planned, loaded: usize, completed: usize) {
        let p = &planned.plan;
        let state = &mut self.objects;
        let mut credit = |n: u64| self.allocated = self.allocated.saturating_sub(n);
        for len in planned.loads.iter().skip(loaded) {
            credit(*len);
        }
        for (i, size) in &p.charged {
            if *i >= completed {
                credit(*size);
            }
        }
        // In command order: a batch may free an id and make it again.
        for (i, effect) in p.effects.iter().enumerate() {
            match *effect {
                Effect::Create(id, _) if i >= completed => {
                    state.ids.remove(&id);
                }
                Effect::Create(id, k) => {
                    state.ids.insert(id, k);
                }
                Effect::Free(id) if i < completed => {
                    if let Some(IdKind::Buffer(n)) = state.ids.remove(&id) {
                        credit(n);
                    }
                }
                _ => {}
            }
        }
        for (i, change) in &p.graphs {
            match change {
                // Not made: its kept bytes' charge goes back.
                GraphChange::Made(g, ids) if *i >= completed => {
                    state.graphs.remove(g);
                    credit(ids.kept);
                }
                GraphChange::Freed(g) if *i < completed => {
                    if let Some(ids) = state.graphs.remove(g) {
                        credit(ids.kept);
                        for f in ids.frees {
                            if let Some(IdKind::Buffer(n)) = state.ids.remove(&f) {
                                credit(n);
                            }
                        }
                    }
                }
                _ => {}
            }
        }
    }

    /// Checks that a streamed transfer's `offset + len` lies in buffer `buf`.
    pub(super) fn check_range(&self, buf: Id, offset: u64, len: u64) -> Result<(), DeviceError> {
        let size = match self.objects.ids.get(&buf) {
            Some(IdKind::Buffer(size)) => *size,
            Some(k) => {
                let why = format!("{buf} is {}, not a buffer", k.noun());
                return Err(DeviceError::new(Status::BadRequest, why));
            }
            None => {
                return Err(DeviceError::new(
                    Status::NotFound,
                    format!("no buffer {buf}"),
                ))
            }
        };
        in_range(size, offset, len).map_err(|(status, m)| DeviceError::new(status, m))
    }

    /// What the lease holds now.
    pub(super) fn usage(&self) -> Usage {
        let s = &self.objects;
        let (ids, buffers, graphs) = (s.ids.len() as u32, s.ids.buffers, s.graphs.len() as u32);
        Usage {
            allocated: self.allocated,
            buffers,
            events: ids.saturating_sub(buffers + graphs),
            graphs,
            streams: s.streams.len() as u32,
        }
    }
}
