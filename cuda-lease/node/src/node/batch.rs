//! Running a BATCH: the modules it loads, its place in the lease's order, the
//! worker call and the commit of its effects.

use std::sync::Arc;

use super::auth::lease_of;
use super::order::{Arrival, Place, Stalled};
use super::plan::{plan, Charges, Effect, GraphChange, Plan, PlanLimits};
use super::submit::BudgetTurn;
use super::{fail_lease, HeldData, IdKind, LeaseSlot, LeaseState, ModuleSource, Reply, Shared};
use crate::lease_table::Principal;
use crate::lock;
use crate::proto::{
    self, from_body, Batch, BatchReply, LeaseId, ModuleHash, Op, OpError, Opcode, SourceKind,
    Status,
};
use crate::stamps::{self, stamp, Point};
use crate::worker::{
    SentRequest, WorkerBatchReply, WorkerError, WorkerLoad, FLAG_HELD, FLAG_STAMPS,
};

/// The reply for a lease whose worker died or hung during a request: the
/// lease's own error if it expired or was freed meanwhile, else the lease is
/// failed.
pub(super) fn worker_lost(shared: &Shared, lease: &LeaseId, e: &WorkerError) -> Reply {
    let status = match e {
        WorkerError::Hung(_) => Status::LaunchFailed,
        _ => Status::LeasePoisoned,
    };
    // Expired or freed meanwhile (the reaper ended the worker)?
    if let Err(te) = shared.table().get(lease, shared.now()) {
        return te.into();
    }
    fail_lease(shared, lease, &e.to_string());
    Reply::err(status, format!("lease poisoned: {e}"))
}

/// A module the lease's worker must load before the batch's commands.
pub(super) struct Load {
    pub(super) hash: ModuleHash,
    pub(super) source: ModuleSource,
    /// The source came with the batch (not from the node's cache): it is
    /// cached once the lease was charged for it and loaded it.
    pub(super) sent: bool,
}

/// The modules of `b` the lease has not loaded, with their sources (from
/// the batch, checked against their hashes, or the node's cache); the
/// batch's data after its module sources is returned too. Nothing enters
/// the node's cache here.
pub(super) fn modules_to_load<'d>(
    shared: &Shared,
    state: &LeaseState,
    b: &Batch<'_>,
    data: &'d [u8],
) -> Result<(Vec<Load>, &'d [u8]), Reply> {
    let mut rest = data;
    let mut loads = Vec::new();
    for m in &b.modules {
        let given = match &m.source {
            Some(t) => {
                let (text, tail) = rest.split_at(t.len as usize);
                rest = tail;
                let text_str = std::str::from_utf8(text).map_err(|_| {
                    Reply::err(Status::BadRequest, format!("module {}: not UTF-8", m.hash))
                })?;
                let actual = ModuleHash::of(&t.kind, text_str);
                if actual != m.hash {
                    return Err(Reply::err(
                        Status::BadRequest,
                        format!("module {}: its source hashes to {actual}", m.hash),
                    ));
                }
                Some(Arc::new((t.kind.clone(), text.to_vec())))
            }
            None => None,
        };
        if state.modules.contains_key(&m.hash) {
            continue;
        }
        // What the node keeps (perhaps already compiled) wins.
        let kept = lock(&shared.modules).get(&m.hash);
        let (source, sent) = match (kept, given) {
            (Some(k), _) => (Some(k), false),
            (None, g) => (g, true),
        };
        let Some(source) = source else {
            return Err(Reply::err(
                Status::UnknownModule,
                format!(
                    "module {} is not on this node: send the batch again with its source",
                    m.hash
                ),
            ));
        };
        loads.push(Load {
            hash: m.hash,
            source,
            sent,
        });
    }
    Ok((loads, rest))
}

/// Index of the first command of `b` that launches `hash` (0 if none).
pub(super) fn first_use(b: &Batch<'_>, hash: ModuleHash) -> u32 {
    b.commands
        .iter()
        .position(|c| matches!(&c.op, Op::Launch(s) if s.module == hash))
        .unwrap_or(0) as u32
}

/// Runs a batch after its lease's earlier numbered batches (see
/// [`Batch::seq`]), however long they take: only the end of the lease, or
/// of the connection that carries its batches with one of them missing,
/// ends the wait. `conn` is the connection `b` came on.
#[allow(clippy::too_many_arguments)]
pub(super) async fn run_in_order(
    shared: &Arc<Shared>,
    who: &Principal,
    conn: usize,
    b: &Batch<'_>,
    wire: &[u8],
    data: &[u8],
    turn: Option<&mut BudgetTurn>,
) -> Result<BatchOut, Reply> {
    if b.seq == 0 {
        stamp(Point::BatchInOrder);
        return run_batch(shared, who, b, wire, data, turn, None).await;
    }
    if b.seq == u64::MAX {
        return Err(Reply::err(
            Status::BadRequest,
            format!("batch number {} has no successor: numbers wrap", b.seq),
        ));
    }
    let slot = lease_of(shared, who, &b.lease)?;
    let (arrival, mut place) = slot.order.arrive(b.seq, conn);
    if arrival == Arrival::Passed {
        // A client fills a number the node may not have seen (a message
        // refused before it was read, or dropped in flight) with an empty
        // batch: answered at once if the number ran or is on the node.
        if b.commands.is_empty() && b.modules.is_empty() {
            let empty = BatchReply {
                completed: 0,
                error: None,
            };
            return Ok((empty, Vec::new(), None));
        }
        return Err(Reply::err(
            Status::BadRequest,
            format!(
                "batch number {} of the lease has run already, or is on the node",
                b.seq
            ),
        ));
    }
    place
        .turn()
        .await
        .map_err(|e| stalled(shared, &b.lease, e))?;
    stamp(Point::BatchInOrder);
    run_batch(shared, who, b, wire, data, turn, Some(place)).await
}

/// The reply to a request whose wait for the lease's order ended without
/// its predecessors.
pub(super) fn stalled(shared: &Shared, lease: &LeaseId, e: Stalled) -> Reply {
    match e {
        Stalled::Ended => match shared.table().get(lease, shared.now()) {
            Err(te) => te.into(),
            Ok(_) => Reply::err(Status::LeaseNotFound, format!("lease {lease} ended")),
        },
        Stalled::Disconnected { missing } => Reply::err(
            Status::BadRequest,
            format!(
                "batch {missing} of the lease never came: the connection that carried \
                 the lease's batches closed"
            ),
        ),
    }
}

/// A batch's reply, its reads' bytes, or the worker's hold of them.
pub(super) type BatchOut = (BatchReply, Vec<u8>, Option<HeldData>);

/// Runs `b`, whose commands encode to `wire` (forwarded to the worker as
/// they are when the node accepts every one of them). The bytes its reads
/// return are charged to `turn` as they are planned.
///
/// The lease's exec lock is held to plan the batch and send it to the
/// worker, not while its work runs: what it creates exists for the batches
/// planned after it at once, and `place` (its place in the lease's order)
/// is given up once it is sent. Its reply comes when its own work is done;
/// what did not run is then undone.
#[allow(clippy::too_many_arguments)]
pub(super) async fn run_batch(
    shared: &Arc<Shared>,
    who: &Principal,
    b: &Batch<'_>,
    wire: &[u8],
    data: &[u8],
    turn: Option<&mut BudgetTurn>,
    place: Option<Place<'_>>,
) -> Result<BatchOut, Reply> {
    let lease = &b.lease;
    let slot = lease_of(shared, who, lease)?;
    let exec = slot.exec.lock().await;
    stamp(Point::BatchLocked);
    // Re-check: the lease may have died while we waited.
    shared.table().get(lease, shared.now())?;
    let prepared = prepare(shared, &slot.state(), b, data, turn);
    let (loads, writes, p) = match prepared {
        Ok(prepared) => prepared,
        Err(reply) => {
            // Sent again with its sources, the batch keeps its place.
            if let (Some(place), Status::UnknownModule) = (place, reply.status) {
                place.withdraw();
            }
            return Err(reply);
        }
    };
    stamp(Point::BatchPlanned);
    let ran = if loads.len() + p.effects.len() > 0 {
        let work = Work {
            b,
            wire,
            loads: &loads,
            writes: &writes[..p.write_bytes],
            planned: p.effects.len(),
        };
        apply_planned(&slot, b, &loads, &p);
        let sent = send_work(shared, &slot, &work).await;
        // The next batch plans and goes to the worker while this one runs.
        drop(place);
        drop(exec);
        let ran = match sent {
            Ok(sent) => receive_work(shared, who, &work, sent).await,
            Err(e) => Err(e),
        };
        undo_unrun(
            shared,
            &slot,
            b,
            &loads,
            &p,
            ran.as_ref().unwrap_or(&Ran::default()),
        );
        ran?
    } else {
        drop(place);
        drop(exec);
        undo_unrun(shared, &slot, b, &loads, &p, &Ran::default());
        Ran::default()
    };
    stamp(Point::NodeCommitted);
    let held = ran.held.map(|(request, len)| HeldData {
        slot: slot.clone(),
        request,
        len,
        read: 0,
    });
    Ok((
        BatchReply {
            completed: ran.completed as u32,
            error: ran.error.or(p.error),
        },
        ran.out,
        held,
    ))
}

/// The modules a batch loads (charged to the lease's reservation before
/// anything runs), the data its writes take, and the plan of its commands.
fn prepare<'d>(
    shared: &Shared,
    state: &LeaseState,
    b: &Batch<'_>,
    data: &'d [u8],
    turn: Option<&mut BudgetTurn>,
) -> Result<(Vec<Load>, &'d [u8], Plan), Reply> {
    let lease = &b.lease;
    let (loads, writes) = modules_to_load(shared, state, b, data)?;
    let mut charged = 0u64;
    for l in &loads {
        let len = l.source.1.len() as u64;
        let r = shared.table().charge(lease, len, shared.now());
        if let Err(e) = r {
            shared.table().credit(lease, charged);
            return Err(Reply::err(
                e.status,
                format!("module {}: {}", l.hash, e.message),
            ));
        }
        charged += len;
    }
    let limits = PlanLimits {
        max_ids: shared.cfg.max_ids_per_lease,
        max_streams: shared.cfg.max_streams_per_lease,
        max_read: u64::from(shared.cfg.limits.max_data),
    };
    let mut charges = NodeCharges {
        shared,
        lease,
        now: shared.now(),
        turn,
    };
    let p = plan(limits, state, &b.commands, &mut charges);
    Ok((loads, writes, p))
}

/// What goes to the worker: the loads, then the planned commands.
struct Work<'a> {
    b: &'a Batch<'a>,
    wire: &'a [u8],
    loads: &'a [Load],
    writes: &'a [u8],
    /// How many of the batch's commands were planned (the rest refused).
    planned: usize,
}

/// What the worker ran.
#[derive(Default)]
struct Ran {
    /// Modules loaded.
    loaded: usize,
    /// Commands completed.
    completed: usize,
    /// The reads' bytes.
    out: Vec<u8>,
    /// Or, for a large reply, their length and the worker request whose
    /// reply the worker keeps them for.
    held: Option<(u64, u64)>,
    /// The worker's failure, by the command (or module) it names.
    error: Option<OpError>,
}

/// Sends the work to the lease's worker (in the lease's order: the caller
/// holds its exec lock).
async fn send_work<'s>(
    shared: &Arc<Shared>,
    slot: &'s LeaseSlot,
    w: &Work<'_>,
) -> Result<SentRequest<'s>, Reply> {
    let lease = &w.b.lease;
    let n_loads = w.loads.len();
    let mut parts: Vec<&[u8]> = Vec::with_capacity(n_loads + 1);
    let mut worker_loads = Vec::with_capacity(n_loads);
    for l in w.loads {
        worker_loads.push(WorkerLoad {
            hash: l.hash,
            kind: l.source.0.clone(),
            len: l.source.1.len() as u32,
        });
        parts.push(&l.source.1);
    }
    parts.push(w.writes);
    // The worker's message is the loads, then the commands as the client
    // encoded them (the same postcard as `WorkerBatch`); only a batch the
    // node stops early has its accepted part encoded anew.
    let mut body = Vec::new();
    proto::postcard_encode(&worker_loads, &mut body);
    if w.planned == w.b.commands.len() {
        body.extend_from_slice(w.wire);
    } else {
        let accepted = &w.b.commands[..w.planned];
        proto::encode_commands(&mut body, accepted.len(), accepted);
    }
    let flags = if stamps::enabled() { FLAG_STAMPS } else { 0 };
    slot.worker
        .send(Opcode::Batch, flags, &body, &parts, shared.cfg.op_timeout)
        .await
        .map_err(|e| worker_lost(shared, lease, &e))
}

/// Reads what the worker ran of the work; modules it loaded enter the
/// node's cache.
async fn receive_work(
    shared: &Arc<Shared>,
    who: &Principal,
    w: &Work<'_>,
    sent: SentRequest<'_>,
) -> Result<Ran, Reply> {
    let lease = &w.b.lease;
    let n_loads = w.loads.len();
    let res = sent.reply().await;
    let frame = res.map_err(|e| worker_lost(shared, lease, &e))?;
    if frame.header.status != Status::Ok {
        let f = from_body::<crate::device::DeviceError>(&frame.body)
            .map(|f| f.message)
            .unwrap_or_default();
        return Err(Reply::err(frame.header.status, format!("worker: {f}")));
    }
    let reply: WorkerBatchReply = from_body(&frame.body)
        .map_err(|e| Reply::err(Status::Internal, format!("worker reply: {e}")))?;
    if let Some(times) = reply.stamps {
        let points = [
            Point::WorkerRead,
            Point::WorkerEnqueued,
            Point::WorkerDone,
            Point::WorkerReplying,
        ];
        for (p, t) in points.into_iter().zip(times) {
            stamps::stamp_at(p, t);
        }
    }
    let done = reply.completed as usize;
    let loaded = done.min(n_loads);
    keep_modules(shared, who, &w.loads[..loaded], reply.compiled);
    let completed = done.saturating_sub(n_loads).min(w.planned);
    let error = reply.error.map(|e| {
        if e.sticky {
            fail_lease(shared, lease, &e.message);
        }
        if done < n_loads {
            // A module failed to load: nothing of the batch ran.
            let hash = w.loads[done].hash;
            OpError {
                index: first_use(w.b, hash),
                status: e.status,
                message: format!("module {hash}: {}", e.message),
            }
        } else {
            OpError {
                index: completed as u32,
                status: e.status,
                message: format!("command {completed}: {}", e.message),
            }
        }
    });
    let held = (frame.header.flags & FLAG_HELD != 0)
        .then(|| (frame.header.request_id, u64::from(frame.header.data_len)));
    Ok(Ran {
        loaded,
        completed,
        out: frame.data,
        held,
        error,
    })
}

/// Modules loaded and charged to this lease: now the node may keep them
/// for everyone, as this principal's (compiled PTX replaces its CUDA C).
fn keep_modules(
    shared: &Shared,
    who: &Principal,
    loaded: &[Load],
    compiled: Vec<(ModuleHash, String)>,
) {
    let mut cache = lock(&shared.modules);
    let (cap, share) = (
        shared.cfg.module_cache_bytes,
        shared.cfg.module_cache_bytes_per_principal,
    );
    for l in loaded.iter().filter(|l| l.sent) {
        if cache.get(&l.hash).is_none() {
            cache.insert(l.hash, l.source.clone(), who, cap, share);
        }
    }
    for (hash, ptx) in compiled {
        shared.metrics.modules_compiled.inc();
        if loaded.iter().any(|l| l.hash == hash) {
            let entry = Arc::new((SourceKind::Ptx, ptx.into_bytes()));
            cache.insert(hash, entry, who, cap, share);
        }
    }
}

/// What a batch sent to the worker will make, in the lease's state now:
/// the batches planned after it may name it (if it does not run, they fail
/// on the worker, naming it). Frees wait for the reply ([`undo_unrun`]).
fn apply_planned(slot: &LeaseSlot, b: &Batch<'_>, loads: &[Load], p: &Plan) {
    let mut state = slot.state();
    for l in loads {
        state.modules.insert(l.hash, l.source.1.len() as u64);
    }
    for (c, effect) in b.commands.iter().zip(&p.effects) {
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

/// Once the worker answered: undoes what [`apply_planned`] made and did
/// not run (giving its charges back), and applies the frees that ran.
fn undo_unrun(
    shared: &Shared,
    slot: &LeaseSlot,
    b: &Batch<'_>,
    loads: &[Load],
    p: &Plan,
    ran: &Ran,
) {
    let lease = &b.lease;
    // A lease's state, then the table: the order `prepare` takes them in
    // (the table is charged while the state is held).
    let mut state = slot.state();
    let mut table = shared.table();
    for (i, l) in loads.iter().enumerate() {
        if i >= ran.loaded {
            state.modules.remove(&l.hash);
            table.credit(lease, l.source.1.len() as u64);
        }
    }
    for (i, size) in &p.charged {
        if *i >= ran.completed {
            table.credit(lease, *size);
        }
    }
    // In command order: a batch may free an id and make it again.
    for (i, effect) in p.effects.iter().enumerate() {
        match *effect {
            Effect::Create(id, _) if i >= ran.completed => {
                state.ids.remove(&id);
            }
            Effect::Create(id, k) => {
                state.ids.insert(id, k);
            }
            Effect::Free(id) if i < ran.completed => {
                if let Some(IdKind::Buffer(n)) = state.ids.remove(&id) {
                    table.credit(lease, n);
                }
            }
            _ => {}
        }
    }
    for (i, change) in &p.graphs {
        match change {
            // Not made: its kept bytes' charge goes back.
            GraphChange::Made(g, ids) if *i >= ran.completed => {
                state.graphs.remove(g);
                table.credit(lease, ids.kept);
            }
            GraphChange::Freed(g) if *i < ran.completed => {
                if let Some(ids) = state.graphs.remove(g) {
                    table.credit(lease, ids.kept);
                    for f in ids.frees {
                        if let Some(IdKind::Buffer(n)) = state.ids.remove(&f) {
                            table.credit(lease, n);
                        }
                    }
                }
            }
            _ => {}
        }
    }
}

/// What a plan charges on the node: allocations to the lease's reservation
/// in the lease table, read bytes to the principal's byte budget.
struct NodeCharges<'a, 't> {
    shared: &'a Shared,
    lease: &'a LeaseId,
    now: std::time::Duration,
    turn: Option<&'t mut BudgetTurn>,
}

impl Charges for NodeCharges<'_, '_> {
    fn alloc(&mut self, bytes: u64) -> Result<(), (Status, String)> {
        self.shared
            .table()
            .charge(self.lease, bytes, self.now)
            .map_err(|e| (e.status, e.message))
    }

    fn reply(&mut self, bytes: u64) -> Result<(), String> {
        match self.turn.as_deref_mut() {
            Some(t) => t.grow(bytes),
            None => Ok(()),
        }
    }
}
