//! LEASE_DIRECT: a lease's worker serves the lease's BATCHes over QUIC
//! itself (see `worker::direct`); the node keeps the rest of the lease
//! (its grant, renewals, frees, single ops, streamed transfers and reaper).

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::auth::lease_of;
use super::batch::worker_lost;
use super::handshake::Peer;
use super::{fail_lease, Reply, Shared};
use crate::device::DeviceError;
use crate::lease_table::Principal;
use crate::proto::{
    from_body, to_body, DirectGrant, LeaseId, LeaseRef, Opcode, Status, DIRECT_TICKET_LEN,
};
use crate::worker::{DirectLimits, DirectOpen, DirectPort, DirectServed, Usage};

/// Updates what a direct lease holds from its worker (its batches do not
/// pass the node, whose view is otherwise as of the lease's last node
/// request); nothing for other leases.
pub(super) async fn refresh(
    shared: &Arc<Shared>,
    who: &Principal,
    lease: &LeaseId,
) -> Result<(), Reply> {
    // A lease that is gone, failed or not the asker's is the status's to
    // report.
    let Ok(slot) = lease_of(shared, who, lease) else {
        return Ok(());
    };
    refresh_slot(shared, lease, &slot).await
}

/// [`refresh`] of `lease` (its `slot`), which the caller may see.
pub(super) async fn refresh_slot(
    shared: &Arc<Shared>,
    lease: &LeaseId,
    slot: &super::Slot,
) -> Result<(), Reply> {
    if !slot.is_direct() {
        return Ok(());
    }
    let asked = slot
        .worker
        .call(Opcode::LeaseQuery, &[], &[], shared.cfg.op_timeout)
        .await;
    let f = match asked {
        Ok(f) => f,
        Err(e) => {
            // The lease fails with its worker; its status says so.
            worker_lost(shared, lease, &e);
            return Ok(());
        }
    };
    let (usage, poisoned, served): (Usage, Option<String>, DirectServed) = from_body(&f.body)
        .map_err(|e| Reply::err(Status::Internal, format!("worker reply: {e}")))?;
    // The batches its worker served since the last answer count as the
    // node's own do.
    let seen = std::mem::replace(&mut *slot.served(), served);
    let metrics = &shared.metrics;
    let batches = served.batches.saturating_sub(seen.batches);
    // The part first: `gpu_batch` less `gpu_batch_direct` never counts a
    // direct batch as the node's own, whenever the two are read.
    metrics.batch_direct.inc_by(batches);
    metrics.batch_total.inc_by(batches);
    metrics
        .batch_commands
        .inc_by(served.commands.saturating_sub(seen.commands));
    metrics
        .modules_compiled
        .inc_by(served.compiled.saturating_sub(seen.compiled));
    slot.state().usage = usage;
    shared.table().set_allocated(lease, usage.allocated);
    if let Some(why) = poisoned {
        // A fault on its direct path: the lease fails as on the node's.
        fail_lease(shared, lease, &why);
    }
    Ok(())
}

/// Opens lease `body`'s direct path: before its first BATCH, once.
pub(super) async fn open(
    shared: &Arc<Shared>,
    who: &Principal,
    peer: &Peer,
    body: &[u8],
) -> Result<Reply, Reply> {
    let r: LeaseRef = from_body(body)?;
    if !shared.cfg.direct_leases {
        return Err(Reply::err(
            Status::BadRequest,
            "this node serves no lease directly (it runs without --direct-leases)",
        ));
    }
    let slot = lease_of(shared, who, &r.lease)?;
    // Switched under the lease's exec lock: no BATCH is on its way to the worker.
    let _exec = slot.exec.lock().await;
    if slot.is_direct() {
        return Err(Reply::err(
            Status::BadRequest,
            format!("lease {} is served directly already", r.lease),
        ));
    }
    if !slot.order.untouched() || !slot.state().modules.is_empty() {
        return Err(Reply::err(
            Status::BadRequest,
            "LEASE_DIRECT comes before the lease's first BATCH",
        ));
    }
    let internal = |e: String| Reply::err(Status::Internal, e);
    // The address the client reached the node at, which it can reach again.
    let ip = peer.local_ip().unwrap_or(shared.cfg.listen.ip());
    let identity =
        crate::tls::self_signed(&[ip.to_string()]).map_err(|e| internal(e.to_string()))?;
    let mut ticket = [0u8; DIRECT_TICKET_LEN];
    getrandom::fill(&mut ticket).map_err(|e| internal(format!("random ticket: {e}")))?;
    let reserved = shared.table().reservation(&r.lease, shared.now())?;
    // Its requests count in its principal's budget beside its other leases'.
    let seat = super::submit::direct_seat(shared, who)
        .map_err(|e| internal(format!("the principal's shared budget: {e}")))?
        .ok_or_else(|| internal(format!("principal {who} has no free budget seat")))?;
    let cfg = &shared.cfg;
    let cert_der = identity.chain[0].to_vec();
    let open = DirectOpen {
        bind: SocketAddr::new(cfg.listen.ip(), 0),
        ports: cfg.direct_ports,
        cert_der: cert_der.clone(),
        key_der: identity.key.secret_der().to_vec(),
        ticket,
        lease: r.lease,
        limits: DirectLimits {
            reserved,
            max_ids: cfg.max_ids_per_lease as u32,
            max_streams: cfg.max_streams_per_lease as u32,
            max_body: cfg.limits.max_body,
            max_data: cfg.limits.max_data,
            max_bytes: cfg.max_bytes_per_principal,
            max_requests: cfg.max_requests_per_principal as u32,
        },
        budget: seat.handle(),
        transport: cfg.transport.clone(),
    };
    let f = slot
        .worker
        .call(Opcode::LeaseDirect, &to_body(&open), &[], cfg.op_timeout)
        .await
        .map_err(|e| worker_lost(shared, &r.lease, &e))?;
    if f.header.status != Status::Ok {
        let message = from_body::<DeviceError>(&f.body)
            .map(|e| e.message)
            .unwrap_or_default();
        return Err(Reply::err(f.header.status, message));
    }
    let port: DirectPort =
        from_body(&f.body).map_err(|e| internal(format!("worker reply: {e}")))?;
    *crate::lock(&slot.seat) = Some(seat);
    slot.direct.store(true, Ordering::Release);
    Ok(Reply::ok(&DirectGrant {
        addr: SocketAddr::new(ip, port.port).to_string(),
        cert_der,
        ticket,
    }))
}
