//! The lease as its worker holds it: the ids its client named, its streams
//! and graphs, and what it has allocated of its reservation.

use super::messages::{BatchLimits, Usage, WorkerLoad};
use super::objects::{IdKind, LeaseObjects};
use super::plan::{in_range, plan, Charges, Effect, GraphChange, Plan};
use crate::device::DeviceError;
use crate::proto::{validate_commands, Command, Id, ModuleHash, Status};

/// The lease of a worker.
#[derive(Debug, Default)]
pub(super) struct WorkerLease {
    objects: LeaseObjects,
    /// Bytes charged to the reservation.
    allocated: u64,
    /// Why its context is dead (a fault's sticky error), once it is.
    pub(super) poisoned: Option<String>,
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
            None => return Err(crate::device::not_found("buffer", buf)),
        };
        in_range(size, offset, len).map_err(|(status, m)| DeviceError::new(status, m))
    }

    /// What the lease holds now, with `staging`, the device's staging of
    /// its prepared bodies.
    pub(super) fn usage(&self, staging: u64) -> Usage {
        let s = &self.objects;
        let (ids, buffers, graphs) = (s.ids.len() as u32, s.ids.buffers, s.graphs.len() as u32);
        Usage {
            allocated: self.allocated,
            buffers,
            events: ids.saturating_sub(buffers + graphs),
            graphs,
            streams: s.streams.len() as u32,
            staging,
        }
    }
}
