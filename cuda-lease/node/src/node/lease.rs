//! What the node holds for one lease: its worker, the modules it loaded,
//! and the order of its batches.

use std::collections::HashMap;
use std::sync::Mutex as StdMutex;

use super::order;
use crate::lock;
use crate::proto::ModuleHash;
use crate::worker::{Usage, WorkerProcess};

/// What the node keeps of a lease's state: the modules it loaded (the
/// node decides what a batch loads) and what it held at its worker's last
/// reply (the worker keeps its ids, streams and graphs, and checks every
/// command against them).
#[derive(Debug, Default)]
pub(super) struct LeaseView {
    /// Modules loaded in the lease's worker, with the source bytes charged
    /// to the lease for each (a loaded module costs device memory too).
    pub(super) modules: HashMap<ModuleHash, u64>,
    /// What the lease held when its worker last answered a batch.
    pub(super) usage: Usage,
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
    /// Serializes a lease's requests to its worker: a batch is planned
    /// there in the order it was sent (never held while their work runs).
    pub(super) exec: tokio::sync::Mutex<()>,
    /// What the node keeps of the lease. Lock order: a lease's state,
    /// then the node's lease table (never the other way round).
    pub(super) state: StdMutex<LeaseView>,
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

    pub(super) fn state(&self) -> std::sync::MutexGuard<'_, LeaseView> {
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
