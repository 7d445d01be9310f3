//! What the node holds for one lease: its worker, the ids its client named,
//! and the order of its batches.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex as StdMutex;

use super::order;
use crate::lock;
use crate::proto::{Id, ModuleHash, StreamId};
use crate::worker::WorkerProcess;

/// What a client-named id of a lease is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum IdKind {
    /// A buffer of this many bytes (charged to the lease).
    Buffer(u64),
    /// An event.
    Event,
    /// A started timer.
    Timer,
    /// A graph (its body is in [`LeaseState::graphs`]).
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
    pub(super) uses: HashSet<Id>,
    /// The frees its body asked for, run with its own.
    pub(super) frees: Vec<Id>,
    /// Its body's upload bytes, kept by the worker for its replays and
    /// charged to the lease's reservation.
    pub(super) kept: u64,
}

/// A lease's client-named objects, as the node tracks them.
#[derive(Debug, Default)]
pub(super) struct LeaseState {
    pub(super) ids: HashMap<Id, IdKind>,
    /// Modules loaded in the lease's worker, with the source bytes charged
    /// to the lease for each (a loaded module costs device memory too).
    pub(super) modules: HashMap<ModuleHash, u64>,
    /// Streams the lease has used.
    pub(super) streams: HashSet<StreamId>,
    /// The lease's live graphs.
    pub(super) graphs: HashMap<Id, GraphIds>,
}

/// What a node holds for one lease ([`Node::lease_usage`](super::Node::lease_usage)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseUsage {
    /// Bytes charged to the lease (buffers and loaded modules' sources).
    pub allocated: u64,
    /// Live buffers.
    pub buffers: usize,
    /// Live events.
    pub events: usize,
    /// Live graphs.
    pub graphs: usize,
    /// Streams the lease has used.
    pub streams: usize,
    /// Modules loaded in the lease's worker.
    pub modules: usize,
}

pub(super) struct LeaseSlot {
    pub(super) worker: WorkerProcess,
    /// Serializes a lease's requests from planning to sending them to the
    /// worker (never held while their work runs).
    pub(super) exec: tokio::sync::Mutex<()>,
    /// What the lease holds. Lock order: a lease's state, then the node's
    /// lease table (never the other way round).
    pub(super) state: StdMutex<LeaseState>,
    /// The order of its numbered batches (see [`Batch::seq`](crate::proto::Batch::seq)).
    pub(super) order: order::LeaseOrder,
}

impl LeaseSlot {
    /// The lease is gone (freed, expired or failed): its worker is ended
    /// and every request waiting for its order fails now.
    pub(super) fn end(&self) {
        self.order.update(order::OrderState::end);
        self.worker.kill();
    }

    pub(super) fn state(&self) -> std::sync::MutexGuard<'_, LeaseState> {
        lock(&self.state)
    }
}

impl std::fmt::Debug for LeaseSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseSlot")
            .field("worker", &self.worker)
            .finish_non_exhaustive()
    }
}
