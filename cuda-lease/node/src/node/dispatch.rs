//! Requests by opcode: HELLO, inventory, lease alloc/renew/free, and
//! single lease operations.

use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use tracing::{debug, info};

use super::auth::{owner_filter, principal, token_principal};
use super::batch::{run_batch, run_in_order, Incoming};
use super::handshake::Peer;
use super::submit::{submit, submit_turn, BudgetTurn};
use super::{take_worker, LeaseSlot, LeaseView, Reply, Shared, Slot};
use crate::lease_table::{LeaseTable, Principal};
use crate::lock;
use crate::proto::{
    self, from_body, to_body, BatchHead, Command, DeviceInfo, Frame, GpuSubmit, Hello, HelloOk,
    IdOp, Inventory, LeaseAlloc, LeaseGrant, LeaseId, LeaseRef, LeaseRenew, MemAlloc, Op, Opcode,
    Status,
};
use crate::stamps::{stamp, Point};
use crate::worker::WorkerProcess;

/// Serves one request (`Ok` or `Err` is the reply); `turn` is charged the
/// reply's bytes before the work runs.
pub(super) async fn dispatch(
    shared: &Arc<Shared>,
    peer: &Peer,
    f: &Frame,
    turn: Option<&mut BudgetTurn>,
) -> Result<Reply, Reply> {
    let op = f.header.opcode;
    if f.header.is_reply() {
        return Err(Reply::err(Status::Malformed, "a reply is not a request"));
    }
    if !matches!(op, Opcode::MemWrite | Opcode::Batch | Opcode::GpuSubmit) && !f.data.is_empty() {
        return Err(Reply::err(
            Status::Malformed,
            format!("{op:?} takes no data"),
        ));
    }
    if op == Opcode::Hello {
        return hello(shared, peer, f);
    }
    let who = principal(peer)?.clone();
    match op {
        Opcode::Hello => unreachable!("handled above"),
        Opcode::LeaseFree => {
            let r: LeaseRef = from_body(&f.body)?;
            shared
                .table()
                .check_owner(&r.lease, owner_filter(shared, &who))?;
            lease_free(shared, &r.lease).await
        }
        Opcode::GetInventory => inventory(shared).await,
        Opcode::BulkOpen => super::bulk::open(shared, &who, &f.body),
        Opcode::LeaseDirect => super::direct::open(shared, &who, peer, &f.body).await,
        Opcode::LeaseAlloc => lease_alloc(shared, &who, from_body(&f.body)?).await,
        Opcode::LeaseRenew => lease_renew(shared, &who, f),
        Opcode::LeaseQuery => {
            let r: LeaseRef = from_body(&f.body)?;
            super::direct::refresh(shared, &who, &r.lease).await?;
            let t = shared.table();
            t.check_owner(&r.lease, Some(&who))?;
            Ok(Reply::ok(&t.status(&r.lease, shared.now())?))
        }
        Opcode::MemAlloc => {
            let m: MemAlloc = from_body(&f.body)?;
            let op = Op::Alloc {
                buf: m.buf,
                size: m.size,
            };
            single(shared, &who, m.lease, op).await
        }
        // Served as streams by `stream::serve`, never dispatched whole.
        Opcode::MemWrite | Opcode::MemRead => Err(Reply::err(
            Status::Internal,
            format!("{op:?} is served as a stream"),
        )),
        Opcode::MemFree => {
            let m: IdOp = from_body(&f.body)?;
            single(shared, &who, m.lease, Op::Free { id: m.id }).await
        }
        Opcode::Batch => batch(shared, &who, peer.conn_id(), f, turn).await,
        Opcode::GpuSubmit => gpu_submit(shared, &who, f, turn).await,
    }
}

/// HELLO: authenticates the connection by token, or confirms it is.
fn hello(shared: &Shared, peer: &Peer, f: &Frame) -> Result<Reply, Reply> {
    let h: Hello = from_body(&f.body)?;
    // Client-supplied: escaped before it reaches a log line.
    let client = h.client.escape_debug().to_string();
    let hello_ok = || {
        Ok(Reply::ok(&HelloOk {
            node: shared.cfg.name.clone(),
        }))
    };
    if peer.get().is_some() {
        return hello_ok();
    }
    if !shared.handshakes.take_check(peer.source) {
        shared.handshakes.rejected(&client, peer.remote(), false);
        return Err(Reply::err(
            Status::Unauthorized,
            "too many failed HELLOs from this address: try again later",
        ));
    }
    let who = token_principal(shared, &h.token).or_else(|| {
        shared
            .cfg
            .allow_anonymous
            .then(|| Principal::from("anonymous"))
    });
    if let Some(who) = who {
        shared.handshakes.authenticated(peer.source);
        let who = peer.authenticate(who);
        debug!(%client, principal = %who, "authenticated");
        return hello_ok();
    }
    shared.handshakes.rejected(&client, peer.remote(), true);
    Err(Reply::err(Status::Unauthorized, "invalid token"))
}

/// LEASE_RENEW, by the lease's owner.
fn lease_renew(shared: &Shared, who: &Principal, f: &Frame) -> Result<Reply, Reply> {
    let now = shared.now();
    let r: LeaseRenew = from_body(&f.body)?;
    if r.ttl_secs == 0 {
        return Err(Reply::err(Status::BadRequest, "ttl must be at least 1 s"));
    }
    let g = {
        let mut t = shared.table();
        t.check_owner(&r.lease, Some(who))?;
        t.renew(&r.lease, Duration::from_secs(u64::from(r.ttl_secs)), now)?
    };
    Ok(Reply::ok(&LeaseGrant {
        lease: r.lease,
        generation: g.generation,
        reserved: g.reserved,
        ttl_ms: ms(g.deadline.saturating_sub(now)),
    }))
}

/// BATCH: checks its head and runs it in the lease's order.
async fn batch(
    shared: &Arc<Shared>,
    who: &Principal,
    conn: usize,
    f: &Frame,
    turn: Option<&mut BudgetTurn>,
) -> Result<Reply, Reply> {
    let (head, wire) = BatchHead::decode(&f.body)?;
    head.validate(f.data.len())?;
    // Refused on its count before the worker decodes any.
    let commands = proto::command_count(wire)?;
    stamp(Point::BatchDecoded);
    shared.metrics.batch_total.inc();
    shared.metrics.batch_commands.inc_by(commands);
    let b = Incoming {
        head: &head,
        wire,
        commands,
        data: &f.data,
    };
    let (reply, data, held) = run_in_order(shared, who, conn, &b, turn).await?;
    Ok(Reply {
        data,
        held,
        ..Reply::ok(&reply)
    })
}

/// GPU_SUBMIT, in the principal's turn.
async fn gpu_submit(
    shared: &Arc<Shared>,
    who: &Principal,
    f: &Frame,
    turn: Option<&mut BudgetTurn>,
) -> Result<Reply, Reply> {
    // The output is held for the reply: charged before anything runs.
    let s: GpuSubmit<'_> = from_body(&f.body)?;
    if let Some(t) = turn {
        t.grow(u64::from(s.output_size))
            .map_err(|m| Reply::err(Status::CapacityExceeded, format!("output: {m}")))?;
    }
    let _turn = submit_turn(shared, who).await;
    submit(shared, f).await
}

pub(super) fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A single session op: a one-command batch on stream 0; failure is the status.
pub(super) async fn single(
    shared: &Arc<Shared>,
    who: &Principal,
    lease: LeaseId,
    op: Op<'_>,
) -> Result<Reply, Reply> {
    let commands = [Command { stream: 0, op }];
    let head = BatchHead {
        lease,
        seq: 0,
        modules: Vec::new(),
        reply_bytes: proto::reply_bytes(&commands),
    };
    let wire = to_body(&commands[..]);
    let b = Incoming {
        head: &head,
        wire: &wire,
        commands: 1,
        data: &[],
    };
    let (reply, _, _) = run_batch(shared, who, &b, None, None).await?;
    match reply.error {
        Some(e) => Err(Reply::err(e.status, e.message)),
        None => Ok(Reply::empty()),
    }
}

pub(super) async fn inventory(shared: &Arc<Shared>) -> Result<Reply, Reply> {
    // Fresh figures from an idle submit worker, else the last seen: a slow
    // GPU_SUBMIT must not delay anyone's inventory.
    let idle = shared.submit.iter().find_map(|m| m.try_lock().ok());
    if let Some(mut slot) = idle {
        if let Ok(w) = WorkerProcess::ensure(
            &mut slot,
            &shared.cfg.worker,
            shared.cfg.worker_start_timeout,
        )
        .await
        {
            if let Ok(f) = w
                .call(Opcode::GetInventory, &[], &[], shared.cfg.op_timeout)
                .await
            {
                if let Ok(info) = from_body::<DeviceInfo>(&f.body) {
                    *lock(&shared.device) = info;
                }
            }
        }
    }
    let device = lock(&shared.device).clone();
    let t = shared.table();
    Ok(Reply::ok(&Inventory {
        node: shared.cfg.name.clone(),
        devices: vec![device],
        reservable_bytes: t.reservable(),
        active_leases: t.len() as u32,
    }))
}

/// The node's and the principal's lease-count limits.
pub(super) fn lease_limits(
    shared: &Shared,
    t: &LeaseTable<Slot>,
    who: &Principal,
) -> Result<(), Reply> {
    if t.len() >= shared.cfg.max_leases {
        return Err(Reply::err(
            Status::CapacityExceeded,
            format!(
                "the node holds its limit of {} leases",
                shared.cfg.max_leases
            ),
        ));
    }
    let held = t.owned_count(who);
    if held >= shared.cfg.max_leases_per_principal {
        return Err(Reply::err(
            Status::CapacityExceeded,
            format!("principal {who} holds {held} leases, its limit (max_leases_per_principal)"),
        ));
    }
    Ok(())
}

pub(super) async fn lease_alloc(
    shared: &Arc<Shared>,
    who: &Principal,
    req: LeaseAlloc,
) -> Result<Reply, Reply> {
    if req.ttl_secs == 0 {
        return Err(Reply::err(Status::BadRequest, "ttl must be at least 1 s"));
    }
    {
        let t = shared.table();
        t.check_fits(req.min_vram)?;
        lease_limits(shared, &t, who)?;
    }
    shared.take_worker_start(who).await?;
    shared.metrics.worker_starts.inc();
    let worker = take_worker(shared)
        .await
        .map_err(|e| Reply::err(Status::Internal, e.to_string()))?;
    let free = worker.info().free_bytes;
    let id = LeaseId::random();
    let slot = Arc::new(LeaseSlot {
        worker,
        exec: tokio::sync::Mutex::new(()),
        state: StdMutex::new(LeaseView::default()),
        order: crate::order::LeaseOrder::default(),
        direct: std::sync::atomic::AtomicBool::new(false),
        refreshing: std::sync::atomic::AtomicBool::new(false),
        served: StdMutex::default(),
        seat: StdMutex::default(),
    });
    let now = shared.now();
    let ttl = Duration::from_secs(u64::from(req.ttl_secs));
    let granted = {
        // Re-checked under the granting lock against concurrent requests.
        let mut t = shared.table();
        lease_limits(shared, &t, who).and_then(|()| {
            t.grant(
                id,
                req.min_vram,
                ttl,
                now,
                Some(free),
                Some(who.clone()),
                slot.clone(),
            )
            .map_err(Reply::from)
        })
    };
    match granted {
        Ok(g) => {
            shared.metrics.lease_acquired.inc();
            info!(lease = %id, principal = %who, reserved = g.reserved, ttl = ?ttl, "lease granted");
            Ok(Reply::ok(&LeaseGrant {
                lease: id,
                generation: g.generation,
                reserved: g.reserved,
                ttl_ms: ms(g.deadline - now),
            }))
        }
        Err(e) => {
            slot.worker.kill();
            Err(e)
        }
    }
}

pub(super) async fn lease_free(shared: &Arc<Shared>, id: &LeaseId) -> Result<Reply, Reply> {
    let now = shared.now();
    let removed = shared.table().remove(id, now);
    match removed {
        Some(slot) => {
            // Wait for the exit so the memory is back by the reply.
            slot.order.update(crate::order::OrderState::end);
            slot.worker.kill_and_wait().await;
            shared.metrics.lease_dropped.inc();
            info!(lease = %id, "lease freed");
            Ok(Reply::empty())
        }
        None => match shared.table().forget(id)? {
            true => Ok(Reply::empty()),
            false => Err(Reply::err(Status::LeaseNotFound, format!("no lease {id}"))),
        },
    }
}

impl Shared {
    /// Takes one of `who`'s worker starts, waiting at most
    /// [`WORKER_START_WAIT`]; else says the principal is over its rate.
    pub(super) async fn take_worker_start(&self, who: &Principal) -> Result<(), Reply> {
        let rate = self.cfg.worker_starts_per_principal_per_second;
        let burst = f64::from(self.cfg.worker_start_burst_per_principal);
        let now = std::time::Instant::now();
        let taken = {
            let mut m = lock(&self.worker_starts);
            if m.len() >= 4096 && !m.contains_key(who) {
                m.retain(|_, b| !b.is_full(rate, burst, now));
            }
            m.entry(who.clone())
                .or_insert(super::bucket::TokenBucket::full(burst, now))
                .take_within(rate, burst, now, WORKER_START_WAIT)
        };
        let wait = taken.map_err(|wait| {
            self.metrics.worker_starts_refused.inc();
            Reply::err(
                Status::CapacityExceeded,
                format!(
                    "principal {who} is starting lease workers faster than the node allows \
                     (worker_starts_per_principal_per_second: {rate}, burst {burst}): \
                     try again in {} ms",
                    wait.as_millis().max(1)
                ),
            )
        })?;
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        Ok(())
    }
}

/// Longest a LEASE_ALLOC over its worker-start rate waits before refusal.
const WORKER_START_WAIT: Duration = Duration::from_secs(1);
