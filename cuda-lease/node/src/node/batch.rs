//! Running a BATCH: its modules, reply budget, place in the lease's order
//! and the worker call. The node reads only the head; the commands go to
//! the worker as encoded, which checks, plans and runs them.

use std::sync::Arc;

use super::auth::lease_of;
use super::submit::BudgetTurn;
use super::{fail_lease, HeldData, LeaseSlot, LeaseView, ModuleSource, Reply, Shared};
use crate::lease_table::Principal;
use crate::lock;
use crate::order::{Arrival, Place, Stalled};
use crate::proto::{
    from_body, BatchHead, BatchReply, LeaseId, ModuleHash, Opcode, SourceKind, Status,
};
use crate::stamps::{self, stamp, Point};
use crate::worker::{
    encode_worker_batch, BatchLimits, SentRequest, WorkerBatchReply, WorkerError, WorkerLoad,
    FLAG_HELD, FLAG_STAMPS,
};

/// The reply when a lease's worker died or hung mid-request: the lease's
/// own error if it expired or was freed meanwhile, else the lease fails.
pub(super) fn worker_lost(shared: &Shared, lease: &LeaseId, e: &WorkerError) -> Reply {
    let status = match e {
        WorkerError::Hung(_) => Status::LaunchFailed,
        _ => Status::LeasePoisoned,
    };
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
    /// Sent with the batch; cached once the lease was charged and loaded it.
    pub(super) sent: bool,
}

/// The modules of `b` the lease lacks, with sources (from the batch,
/// hash-checked, or the cache), and the data after them. Caches nothing.
pub(super) fn modules_to_load<'d>(
    shared: &Shared,
    state: &LeaseView,
    b: &BatchHead,
    data: &'d [u8],
) -> Result<(Vec<Load>, &'d [u8]), Reply> {
    let (sources, rest) = b.sources(data)?;
    let mut loads = Vec::new();
    for (m, given) in b.modules.iter().zip(sources) {
        if state.modules.contains_key(&m.hash) {
            continue;
        }
        // What the node keeps (perhaps already compiled) wins.
        let kept = lock(&shared.modules).get(&m.hash);
        let sent = kept.is_none();
        let given = given.map(|(kind, text)| Arc::new((kind.clone(), text.as_bytes().to_vec())));
        let Some(source) = kept.or(given) else {
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

/// A BATCH as read: head, command list as sent (with its count) and data.
pub(super) struct Incoming<'a> {
    pub(super) head: &'a BatchHead,
    pub(super) wire: &'a [u8],
    pub(super) commands: u64,
    pub(super) data: &'a [u8],
}

/// Runs a batch after its lease's earlier numbered batches (see
/// [`Batch::seq`](crate::proto::Batch::seq)), however long they take; only
/// the lease ending, or the carrying connection closing with one missing,
/// ends the wait. `conn` is `b`'s connection.
pub(super) async fn run_in_order(
    shared: &Arc<Shared>,
    who: &Principal,
    conn: usize,
    b: &Incoming<'_>,
    turn: Option<&mut BudgetTurn>,
) -> Result<BatchOut, Reply> {
    let (lease, seq) = (&b.head.lease, b.head.seq);
    let slot = lease_of(shared, who, lease)?;
    if slot.is_direct() {
        return Err(Reply::err(
            Status::BadRequest,
            format!("lease {lease}'s BATCHes go to its worker directly (LEASE_DIRECT)"),
        ));
    }
    if seq == 0 {
        stamp(Point::BatchInOrder);
        return run_batch(shared, who, b, turn, None).await;
    }
    if seq == u64::MAX {
        return Err(Reply::err(
            Status::BadRequest,
            format!("batch number {seq} has no successor: numbers wrap"),
        ));
    }
    let (arrival, mut place) = slot.order.arrive(seq, conn);
    if arrival == Arrival::Passed {
        // A client fills a number the node may not have seen with an empty
        // batch: answered at once if the number ran or is on the node.
        if b.commands == 0 && b.head.modules.is_empty() {
            return Ok((BatchReply::default(), Vec::new(), None));
        }
        return Err(Reply::err(
            Status::BadRequest,
            format!("batch number {seq} of the lease has run already, or is on the node"),
        ));
    }
    place.turn().await.map_err(|e| stalled(shared, lease, e))?;
    stamp(Point::BatchInOrder);
    run_batch(shared, who, b, turn, Some(place)).await
}

/// The reply when a wait for the lease's order ended unfulfilled.
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

/// Runs `b`: settles its modules and reply bytes (charged to `turn`), then
/// sends its commands to the worker, which checks and plans them.
///
/// The exec lock is held only to send: the worker plans in send order, so
/// what one batch creates exists for later ones, and `place` is given up
/// once sent. The reply comes when its own work is done.
pub(super) async fn run_batch(
    shared: &Arc<Shared>,
    who: &Principal,
    b: &Incoming<'_>,
    mut turn: Option<&mut BudgetTurn>,
    place: Option<Place<'_>>,
) -> Result<BatchOut, Reply> {
    let lease = &b.head.lease;
    let slot = lease_of(shared, who, lease)?;
    let exec = slot.exec.lock().await;
    stamp(Point::BatchLocked);
    let reserved = shared.table().reservation(lease, shared.now())?;
    let prepared = prepare(shared, &slot, b, turn.as_deref_mut());
    let (loads, writes, reply_bytes) = match prepared {
        Ok(prepared) => prepared,
        Err(reply) => {
            // Sent again with its sources, the batch keeps its place.
            if let (Some(place), Status::UnknownModule) = (place, reply.status) {
                place.withdraw();
            }
            return Err(reply);
        }
    };
    stamp(Point::BatchPrepared);
    let limits = BatchLimits {
        reserved,
        max_ids: shared.cfg.max_ids_per_lease as u32,
        max_streams: shared.cfg.max_streams_per_lease as u32,
        max_read: u64::from(shared.cfg.limits.max_data),
        reply_bytes,
    };
    let work = Work {
        b,
        loads: &loads,
        writes,
        limits,
    };
    let sent = send_work(shared, &slot, &work).await;
    drop(place);
    drop(exec);
    let ran = match sent {
        Ok(sent) => receive_work(shared, who, &slot, &work, sent).await,
        Err(e) => Err(e),
    };
    if let Some(t) = turn {
        // Unused reply bytes go back to the principal's budget.
        let used = ran.as_ref().map_or(0, |r| r.len);
        t.release(reply_bytes.saturating_sub(used));
    }
    if !matches!(&ran, Ok(r) if r.loaded == loads.len()) {
        // Modules the worker did not load are not the lease's.
        let loaded = ran.as_ref().map_or(0, |r| r.loaded);
        let mut state = slot.state();
        for l in &loads[loaded..] {
            state.modules.remove(&l.hash);
        }
    }
    let ran = ran?;
    stamp(Point::NodeCommitted);
    let held = ran.held.map(|(request, len)| HeldData {
        slot: slot.clone(),
        request,
        len,
        read: 0,
    });
    Ok((ran.reply, ran.out, held))
}

/// The modules a batch loads (marked loaded so later batches skip them),
/// its writes' data, and its reply bytes as declared, capped by the data
/// limit and `turn` (the worker refuses a read past them).
fn prepare<'d>(
    shared: &Shared,
    slot: &LeaseSlot,
    b: &Incoming<'d>,
    turn: Option<&mut BudgetTurn>,
) -> Result<(Vec<Load>, &'d [u8], u64), Reply> {
    let mut state = slot.state();
    let (loads, writes) = modules_to_load(shared, &state, b.head, b.data)?;
    let want = b
        .head
        .reply_bytes
        .min(u64::from(shared.cfg.limits.max_data));
    let held = match turn {
        Some(t) => t.grow_up_to(want),
        None => want,
    };
    for l in &loads {
        state.modules.insert(l.hash, l.source.1.len() as u64);
    }
    Ok((loads, writes, held))
}

/// What goes to the worker: loads, the lease's limits, then commands.
struct Work<'a> {
    b: &'a Incoming<'a>,
    loads: &'a [Load],
    writes: &'a [u8],
    limits: BatchLimits,
}

/// What the worker ran.
struct Ran {
    loaded: usize,
    /// Bytes of the reply's data (held in the worker, or in `out`).
    len: u64,
    reply: BatchReply,
    /// The reads' bytes.
    out: Vec<u8>,
    /// Or, for a large reply, their length and the holding worker request.
    held: Option<(u64, u64)>,
}

/// Sends the work to the lease's worker; the caller holds the exec lock.
async fn send_work<'s>(
    shared: &Arc<Shared>,
    slot: &'s LeaseSlot,
    w: &Work<'_>,
) -> Result<SentRequest<'s>, Reply> {
    let lease = &w.b.head.lease;
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
    let modules: Vec<ModuleHash> = w.b.head.modules.iter().map(|m| m.hash).collect();
    let mut body = Vec::with_capacity(w.b.wire.len() + 64);
    encode_worker_batch(&mut body, &worker_loads, &w.limits, &modules, w.b.wire);
    let flags = if stamps::enabled() { FLAG_STAMPS } else { 0 };
    slot.worker
        .send(Opcode::Batch, flags, &body, &parts, shared.cfg.op_timeout)
        .await
        .map_err(|e| worker_lost(shared, lease, &e))
}

/// Reads what the worker ran; caches loaded modules, updates usage.
async fn receive_work(
    shared: &Arc<Shared>,
    who: &Principal,
    slot: &LeaseSlot,
    w: &Work<'_>,
    sent: SentRequest<'_>,
) -> Result<Ran, Reply> {
    let lease = &w.b.head.lease;
    let res = sent.reply().await;
    let frame = res.map_err(|e| worker_lost(shared, lease, &e))?;
    if frame.header.status != Status::Ok {
        // Refused whole: nothing of it ran.
        let message = from_body::<crate::device::DeviceError>(&frame.body)
            .map(|f| f.message)
            .unwrap_or_default();
        if frame.header.status == Status::LeasePoisoned {
            // A fault on the lease's direct path, before the node heard of it.
            fail_lease(shared, lease, &message);
        }
        return Err(Reply::err(frame.header.status, message));
    }
    let reply: WorkerBatchReply = from_body(&frame.body)
        .map_err(|e| Reply::err(Status::Internal, format!("worker reply: {e}")))?;
    if let Some(times) = reply.stamps {
        // 0: a point the worker did not reach.
        let reached = stamps::WORKER_POINTS.into_iter().zip(times);
        for (p, t) in reached.filter(|&(_, t)| t != 0) {
            stamps::stamp_at(p, t);
        }
    }
    // Reply bytes were budgeted: a worker returning more is not believed.
    let len = u64::from(frame.header.data_len);
    if len > w.limits.reply_bytes {
        let e = WorkerError::Dead(format!(
            "it answered {len} reply bytes to a batch held {}",
            w.limits.reply_bytes
        ));
        return Err(worker_lost(shared, lease, &e));
    }
    let loaded = (reply.loaded as usize).min(w.loads.len());
    keep_modules(shared, who, &w.loads[..loaded], reply.compiled);
    {
        let mut state = slot.state();
        state.usage = reply.usage;
        shared.table().set_allocated(lease, reply.usage.allocated);
    }
    if let (true, Some(e)) = (reply.sticky, &reply.error) {
        fail_lease(shared, lease, &e.message);
    }
    let held = (frame.header.flags & FLAG_HELD != 0)
        .then(|| (frame.header.request_id, u64::from(frame.header.data_len)));
    Ok(Ran {
        loaded,
        len,
        reply: BatchReply {
            completed: reply.completed,
            error: reply.error,
        },
        out: frame.data,
        held,
    })
}

/// Caches modules the lease loaded and paid for, as `who`'s (PTX replaces
/// its CUDA C).
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
