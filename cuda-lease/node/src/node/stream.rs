//! MEM_WRITE and MEM_READ as streams: data moves in ring-slot chunks
//! ([`SLOT_BYTES`]) between the network and the lease's worker, overlapping
//! transfer and copy; the node holds at most the worker's ring. Header and
//! body (authentication, lease) are checked before any data is read; the
//! worker checks handle and range with the first chunk, before copying.
//!
//! Chunks ready at once (up to [`MAX_CHUNKS_PER_CALL`]) go to the worker in
//! one short call under the exec lock, so concurrent stripes on one lease
//! interleave, and a pipe round trip is paid per group, not per chunk.
//!
//! Serves both QUIC streams ([`serve`]) and bulk-data connections
//! ([`super::bulk`]) through [`DataIn`] and [`DataOut`].

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc;

use tokio::io::{AsyncWrite, AsyncWriteExt};

use super::auth::{lease_of, principal};
use super::batch::{stalled, worker_lost};
use super::handshake::Peer;
use super::{fail_lease, Reply, Shared, Slot as LeaseRef};
use crate::device::DeviceError;
use crate::lease_table::Principal;
use crate::order::Stalled;
use crate::proto::{self, from_body, to_body, Header, LeaseId, MemRead, MemWrite, Opcode, Status};
use crate::shm::{ShmRing, Slot, SLOTS, SLOT_BYTES};
use crate::worker::{ChunkOp, ChunkOps, FLAG_AFTER, MAX_CHUNKS_PER_CALL};

/// Serves one MEM_WRITE or MEM_READ whose header and body were read.
pub(super) async fn serve(
    shared: &Arc<Shared>,
    peer: &Peer,
    header: Header,
    body: Vec<u8>,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
) {
    let done = match principal(peer) {
        Ok(who) => serve_request(shared, who, &header, &body, &mut send, &mut recv).await,
        Err(reply) => {
            recv.refuse(u64::from(header.data_len)).await;
            send_reply(&mut send, &header, &reply).await
        }
    };
    if done {
        let _ = send.finish();
        if tokio::time::timeout(shared.cfg.reply_timeout, send.stopped())
            .await
            .is_err()
        {
            let _ = send.reset(0u32.into());
        }
    }
}

/// [`serve`] for principal `who` on any [`DataIn`] / [`DataOut`]; returns
/// whether the reply went out whole.
pub(super) async fn serve_request(
    shared: &Arc<Shared>,
    who: &Principal,
    header: &Header,
    body: &[u8],
    send: &mut impl DataOut,
    recv: &mut impl DataIn,
) -> bool {
    if header.opcode == Opcode::MemWrite {
        let reply = match write(shared, who, header, body, recv).await {
            Ok(r) | Err(r) => r,
        };
        send_reply(send, header, &reply).await
    } else if header.data_len != 0 {
        // Nothing follows a MEM_READ request.
        recv.refuse(u64::from(header.data_len)).await;
        let reply = Reply::err(Status::BadRequest, "MemRead takes no data");
        send_reply(send, header, &reply).await
    } else {
        read(shared, who, header, body, send).await
    }
}

/// Where a MEM_WRITE's data comes from.
pub(super) trait DataIn: Send {
    fn read_exact(&mut self, buf: &mut [u8]) -> impl Future<Output = std::io::Result<()>> + Send;
    /// Declines the `remaining` unread bytes so the reply can follow.
    fn refuse(&mut self, remaining: u64) -> impl Future<Output = ()> + Send;
}

/// Where a reply (and a MEM_READ's data) goes.
pub(super) trait DataOut: AsyncWrite + Unpin + Send {
    /// Cuts off a reply whose promised data will not come.
    fn abort(&mut self);
}

impl DataIn for quinn::RecvStream {
    async fn read_exact(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        quinn::RecvStream::read_exact(self, buf)
            .await
            .map_err(std::io::Error::other)
    }

    async fn refuse(&mut self, _remaining: u64) {
        // QUIC can tell the peer to stop sending.
        let _ = self.stop(0u32.into());
    }
}

impl DataOut for quinn::SendStream {
    fn abort(&mut self) {
        let _ = self.reset(1u32.into());
    }
}

/// Writes a whole reply frame; false if the stream broke.
pub(super) async fn send_reply(send: &mut impl DataOut, req: &Header, reply: &Reply) -> bool {
    let h = Header::reply(
        req,
        reply.status,
        reply.body.len() as u32,
        reply.data.len() as u32,
    );
    proto::write_frame(send, &h, &reply.body, &reply.data)
        .await
        .is_ok()
}

/// Chunks on the worker in one call, sent (not run) under the exec lock.
async fn chunks(
    shared: &Shared,
    lease: &LeaseId,
    slot: &LeaseRef,
    opcode: Opcode,
    ops: ChunkOps,
) -> Result<(), Reply> {
    let exec = slot.exec.lock().await;
    shared.table().get(lease, shared.now())?;
    let sent = slot
        .worker
        .send(opcode, 0, &to_body(&ops), &[], shared.cfg.op_timeout)
        .await;
    drop(exec);
    let f = async { sent?.reply().await }
        .await
        .map_err(|e| worker_lost(shared, lease, &e))?;
    if f.header.status == Status::Ok {
        return Ok(());
    }
    let e = from_body::<DeviceError>(&f.body)
        .unwrap_or_else(|e| DeviceError::new(Status::Internal, format!("bad worker reply: {e}")));
    if e.sticky {
        fail_lease(shared, lease, &e.message);
    }
    Err(Reply::err(e.status, e.message))
}

async fn write(
    shared: &Arc<Shared>,
    who: &Principal,
    header: &Header,
    body: &[u8],
    recv: &mut impl DataIn,
) -> Result<Reply, Reply> {
    let len = u64::from(header.data_len);
    let checked = match from_body::<MemWrite>(body) {
        Ok(m) => follow(shared, who, &m.lease, m.after)
            .await
            .and_then(|()| lease_of(shared, who, &m.lease))
            .map(|s| (m, s)),
        Err(e) => Err(Reply::from(e)),
    };
    let (m, slot) = match checked {
        Ok(x) => x,
        Err(r) => {
            recv.refuse(len).await;
            return Err(r);
        }
    };
    // The worker checks the range with the first chunk (alone if none).
    let range = Some((m.buf, m.offset, len));
    if len == 0 {
        let ops = ChunkOps { range, ops: vec![] };
        chunks(shared, &m.lease, &slot, Opcode::MemWrite, ops).await?;
        return Ok(Reply::empty());
    }
    let ring = slot.worker.ring().clone();
    let failed = AtomicBool::new(false);
    let (tx, mut rx) = mpsc::channel::<(Slot, u64, u32)>(SLOTS);
    let reader = async {
        let tx = tx;
        let mut at = 0u64;
        while at < len {
            if failed.load(Ordering::Relaxed) {
                recv.refuse(len - at).await;
                return Ok(());
            }
            let mut s = ring.acquire().await;
            let n = (len - at).min(SLOT_BYTES as u64) as usize;
            if let Err(e) = recv.read_exact(&mut s.bytes_mut()[..n]).await {
                return Err(format!(
                    "the transfer was cut off after {at} of {len} bytes: {e}"
                ));
            }
            if tx.send((s, at, n as u32)).await.is_err() {
                return Ok(());
            }
            at += n as u64;
        }
        Ok(())
    };
    let forwarder = async {
        let mut result = Ok(());
        let mut range = range;
        let mut group = Vec::with_capacity(MAX_CHUNKS_PER_CALL);
        while let Some(first) = rx.recv().await {
            group.push(first);
            group.extend(std::iter::from_fn(|| rx.try_recv().ok()).take(MAX_CHUNKS_PER_CALL - 1));
            if result.is_ok() {
                let ops = group
                    .iter()
                    .map(|(s, at, n)| ChunkOp {
                        id: m.buf,
                        offset: m.offset + at,
                        slot: s.index(),
                        len: *n,
                    })
                    .collect();
                let ops = ChunkOps {
                    range: range.take(),
                    ops,
                };
                result = chunks(shared, &m.lease, &slot, Opcode::MemWrite, ops).await;
                if result.is_err() {
                    failed.store(true, Ordering::Relaxed);
                }
            }
            // Slots return to the ring once copied.
            group.clear();
        }
        result
    };
    let (received, forwarded) = tokio::join!(reader, forwarder);
    forwarded?;
    received.map_err(|e| Reply::err(Status::BadRequest, e))?;
    Ok(Reply::empty())
}

/// Streams a MEM_READ; returns whether the reply went out whole.
async fn read(
    shared: &Arc<Shared>,
    who: &Principal,
    header: &Header,
    body: &[u8],
    send: &mut impl DataOut,
) -> bool {
    let (m, slot) = match check_read(shared, who, body).await {
        Ok(x) => x,
        Err(r) => return send_reply(send, header, &r).await,
    };
    let len = u64::from(m.len);
    let ring = slot.worker.ring().clone();
    // The first chunks before the header, so an early failure is a reply.
    let first = if len == 0 {
        // The worker checks the range (else with the first chunks).
        let ops = ChunkOps {
            range: Some((m.buf, m.offset, 0)),
            ops: vec![],
        };
        if let Err(r) = chunks(shared, &m.lease, &slot, Opcode::MemRead, ops).await {
            return send_reply(send, header, &r).await;
        }
        None
    } else {
        match fill_chunks(shared, &ring, &slot, &m, len, 0).await {
            Ok(c) => Some(c),
            Err(r) => return send_reply(send, header, &r).await,
        }
    };
    let h = Header::reply(header, Status::Ok, 0, m.len);
    if proto::write_frame(send, &h, &[], &[]).await.is_err() {
        return false;
    }
    let Some(first) = first else {
        return true;
    };
    send_chunks(shared, send, first, ring, slot, m).await
}

/// A MEM_READ's body and lease, checked (size, then the lease once its
/// `after` batch ran); the worker checks handle and range.
async fn check_read(
    shared: &Shared,
    who: &Principal,
    body: &[u8],
) -> Result<(MemRead, LeaseRef), Reply> {
    let m = from_body::<MemRead>(body)?;
    if m.len > shared.cfg.limits.max_data {
        return Err(Reply::err(
            Status::BadRequest,
            format!(
                "MEM_READ of {} bytes is over the {} byte limit",
                m.len, shared.cfg.limits.max_data
            ),
        ));
    }
    follow(shared, who, &m.lease, m.after).await?;
    let slot = lease_of(shared, who, &m.lease)?;
    Ok((m, slot))
}

/// Waits, unbounded, until the lease's batch `after` has run (see
/// [`MemWrite::after`]; 0: no wait). Fails only if the lease ends or the batch
/// can never come.
async fn follow(
    shared: &Shared,
    who: &Principal,
    lease: &LeaseId,
    after: u64,
) -> Result<(), Reply> {
    if after == 0 {
        return Ok(());
    }
    let slot = lease_of(shared, who, lease)?;
    let upto = after.saturating_add(1);
    if slot.is_direct() {
        // Its worker orders its batches: it answers once `after` is handed
        // to its device (or never will be). The worker ends with the lease.
        let body = to_body(&upto);
        let f = slot
            .worker
            .send(Opcode::Batch, FLAG_AFTER, &body, &[], shared.cfg.max_ttl)
            .await
            .map_err(|e| worker_lost(shared, lease, &e))?
            .reply()
            .await
            .map_err(|e| worker_lost(shared, lease, &e))?;
        return match f.header.status {
            Status::Ok => Ok(()),
            _ => Err(stalled(shared, lease, Stalled::Ended)),
        };
    }
    slot.order
        .reached(upto)
        .await
        .map_err(|e| stalled(shared, lease, e))
}

/// Most chunks of a MEM_READ filled per worker call; slots stay held until
/// sent, so larger groups starve the lease's other stripes.
const READ_GROUP: usize = 4;

/// Has the worker fill `m`'s chunks from offset `at` in one call: one
/// awaited slot plus those free now (up to [`READ_GROUP`]). Returns the
/// slots and chunk lengths in order.
async fn fill_chunks(
    shared: &Shared,
    ring: &Arc<ShmRing>,
    slot: &LeaseRef,
    m: &MemRead,
    len: u64,
    at: u64,
) -> Result<Vec<(Slot, u32)>, Reply> {
    let mut group = vec![ring.acquire().await];
    let chunks_left = (len - at).div_ceil(SLOT_BYTES as u64);
    let more = chunks_left.min(READ_GROUP as u64) as usize - 1;
    group.extend(std::iter::from_fn(|| ring.try_acquire()).take(more));
    let mut out = Vec::with_capacity(group.len());
    let mut ops = Vec::with_capacity(group.len());
    let mut next = at;
    for s in group {
        let n = (len - next).min(SLOT_BYTES as u64) as u32;
        ops.push(ChunkOp {
            id: m.buf,
            offset: m.offset + next,
            slot: s.index(),
            len: n,
        });
        out.push((s, n));
        next += u64::from(n);
    }
    let ops = ChunkOps {
        range: (at == 0).then_some((m.buf, m.offset, len)),
        ops,
    };
    chunks(shared, &m.lease, slot, Opcode::MemRead, ops)
        .await
        .map(|()| out)
}

/// Sends a MEM_READ's data: `first` is filled; a task of its own fills the
/// rest while this one writes earlier chunks, so the next fill is asked
/// for as soon as the last is done, however long a write (and, on the
/// bulk-data channel, its encryption) takes. Returns whether all went out.
async fn send_chunks(
    shared: &Arc<Shared>,
    send: &mut impl DataOut,
    first: Vec<(Slot, u32)>,
    ring: Arc<ShmRing>,
    slot: LeaseRef,
    m: MemRead,
) -> bool {
    let (tx, mut rx) = mpsc::channel::<(Slot, u32)>(SLOTS);
    let filler = shared.clone();
    let producer = tokio::spawn(async move {
        let shared = filler;
        let len = u64::from(m.len);
        let mut group = first;
        let mut at = 0u64;
        loop {
            for c in group {
                at += u64::from(c.1);
                // The writer stopped: no more fills.
                if tx.send(c).await.is_err() {
                    return Ok(());
                }
            }
            if at >= len {
                return Ok::<(), Reply>(());
            }
            group = fill_chunks(&shared, &ring, &slot, &m, len, at).await?;
        }
    });
    while let Some((s, n)) = rx.recv().await {
        // A client that stops reading must not hold the ring.
        let wrote = tokio::time::timeout(
            shared.cfg.reply_timeout,
            send.write_all(&s.bytes()[..n as usize]),
        )
        .await;
        if !matches!(wrote, Ok(Ok(()))) {
            // Dropping the receiver ends the fills (and frees their slots).
            send.abort();
            return false;
        }
    }
    match producer.await {
        Ok(Ok(())) => return true,
        Ok(Err(r)) => tracing::debug!(status = ?r.status, "MEM_READ failed mid-stream"),
        Err(e) => tracing::warn!(error = %e, "a MEM_READ's fills ended abnormally"),
    }
    // The header promised the data: reset the stream.
    send.abort();
    false
}
