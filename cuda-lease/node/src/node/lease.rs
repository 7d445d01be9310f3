//! What the node holds for one lease: worker, loaded modules, batch order.

use std::collections::HashMap;
use std::sync::Mutex as StdMutex;

use crate::lock;
use crate::order;
use crate::proto::ModuleHash;
use crate::worker::{Usage, WorkerProcess};

/// A lease's loaded modules (the node decides what a batch loads) and its
/// holdings at the worker's last reply (the worker keeps the ids, streams
/// and graphs, and checks every command against them).
#[derive(Debug, Default)]
pub(super) struct LeaseView {
    /// Loaded modules, each with the source bytes charged to the lease.
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
    /// Page-locked host memory the lease's worker keeps as the staging of
    /// the lease's prepared submissions, in bytes (on a GPU node; not
    /// charged to the reservation: a worker keeps at most 64 MiB of it,
    /// and runs a body it could not stage by replaying its commands).
    pub staging: u64,
}

#[derive(Debug)]
pub(super) struct LeaseSlot {
    pub(super) worker: WorkerProcess,
    /// Serializes sends to the worker (not the work) so batches plan in order.
    pub(super) exec: tokio::sync::Mutex<()>,
    /// Lock order: a lease's state, then the lease table, never the reverse.
    pub(super) state: StdMutex<LeaseView>,
    /// The order of its numbered batches (see [`Batch::seq`](crate::proto::Batch::seq)).
    pub(super) order: order::LeaseOrder,
    /// Its worker serves its BATCHes (LEASE_DIRECT): the node takes none.
    pub(super) direct: std::sync::atomic::AtomicBool,
    /// The reaper is asking its worker what it holds (direct leases: one
    /// question at a time).
    pub(super) refreshing: std::sync::atomic::AtomicBool,
    /// What its worker's direct path had served at the last refresh
    /// (counted into the node's metrics by the difference).
    pub(super) served: StdMutex<crate::worker::DirectServed>,
    /// Its worker's seat in its principal's shared budget (direct leases;
    /// after `worker`: given back once the worker is gone).
    pub(super) seat: StdMutex<Option<crate::budget::Seat>>,
}

impl LeaseSlot {
    /// The lease is gone: ends its worker and fails its order's waiters.
    pub(super) fn end(&self) {
        self.order.update(order::OrderState::end);
        self.worker.kill();
    }

    /// Whether its worker serves its BATCHes.
    pub(super) fn is_direct(&self) -> bool {
        self.direct.load(std::sync::atomic::Ordering::Acquire)
    }

    pub(super) fn served(&self) -> std::sync::MutexGuard<'_, crate::worker::DirectServed> {
        self.served.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn state(&self) -> std::sync::MutexGuard<'_, LeaseView> {
        lock(&self.state)
    }
}
