//! MEM_WRITE and MEM_READ as streams: the data moves in chunks of one ring
//! slot ([`SLOT_BYTES`]) between QUIC and the lease's worker, so receiving
//! chunk k+1 overlaps the worker's copy of chunk k (and, reading, the
//! worker fills chunk k+1 while chunk k goes out on QUIC). The node holds at
//! most the worker's ring, whatever the size. Header and body are checked
//! (authentication, lease, handle, range) before any data is read.
//!
//! Each chunk is one short worker call under the lease's exec lock, so
//! concurrent transfers on one lease (stripes over several connections)
//! interleave chunk by chunk instead of waiting for each other.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc;

use super::auth::{lease_of, principal};
use super::batch::worker_lost;
use super::handshake::Peer;
use super::{fail_lease, IdKind, Reply, Shared, Slot as LeaseRef};
use crate::hops::{self, Hop, HopTimer};
use crate::proto::{self, from_body, Header, Id, LeaseId, MemRead, MemWrite, Opcode, Status};
use crate::shm::{ShmRing, Slot, SLOTS, SLOT_BYTES};
use crate::worker::ChunkOp;

/// Serves one MEM_WRITE or MEM_READ whose header and body have been read;
/// `recv` holds the data that follows (MEM_WRITE).
pub(super) async fn serve(
    shared: &Arc<Shared>,
    peer: &Peer,
    header: Header,
    body: Vec<u8>,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    mut hop: Option<HopTimer>,
) {
    if let Some(t) = &mut hop {
        t.mark("read");
        t.set_op(header.opcode, u64::from(header.data_len));
    }
    let done = if header.opcode == Opcode::MemWrite {
        let reply = match write(shared, peer, &header, &body, &mut recv).await {
            Ok(r) | Err(r) => r,
        };
        hops::mark(&mut hop, "dispatch");
        send_reply(&mut send, &header, &reply).await
    } else {
        // Nothing follows a MEM_READ request.
        if header.data_len != 0 {
            let reply = Reply::err(Status::BadRequest, "MemRead takes no data");
            send_reply(&mut send, &header, &reply).await
        } else {
            if let Some(t) = &mut hop {
                let len = from_body::<MemRead>(&body).map(|m| m.len).unwrap_or(0);
                t.set_op(header.opcode, u64::from(len));
            }
            read(shared, peer, &header, &body, &mut send).await
        }
    };
    if done {
        let _ = send.finish();
        hops::mark(&mut hop, "reply");
        drop(hop);
        if tokio::time::timeout(shared.cfg.reply_timeout, send.stopped())
            .await
            .is_err()
        {
            let _ = send.reset(0u32.into());
        }
    }
}

/// Writes a whole reply frame; false if the stream broke.
async fn send_reply(send: &mut quinn::SendStream, req: &Header, reply: &Reply) -> bool {
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

/// Checks authentication, the lease and the buffer, and that
/// `offset + len` lies inside it.
fn check(
    shared: &Shared,
    peer: &Peer,
    lease: &LeaseId,
    buf: Id,
    offset: u64,
    len: u64,
) -> Result<LeaseRef, Reply> {
    let slot = lease_of(shared, principal(peer)?, lease)?;
    let size = match slot.state().ids.get(&buf) {
        Some(IdKind::Buffer(size)) => *size,
        Some(IdKind::Event) => {
            return Err(Reply::err(
                Status::BadRequest,
                format!("{buf} is an event, not a buffer"),
            ))
        }
        None => return Err(Reply::err(Status::NotFound, format!("no buffer {buf}"))),
    };
    if offset.checked_add(len).is_none_or(|end| end > size) {
        return Err(Reply::err(
            Status::BadRequest,
            format!("range {offset}+{len} is outside a buffer of {size} bytes"),
        ));
    }
    Ok(slot)
}

/// One chunk on the worker, under the lease's exec lock.
async fn chunk(
    shared: &Shared,
    lease: &LeaseId,
    slot: &LeaseRef,
    opcode: Opcode,
    op: ChunkOp,
) -> Result<(), Reply> {
    let _exec = slot.exec.lock().await;
    // The lease may have died while we waited.
    shared.table().get(lease, shared.now())?;
    match slot.worker.chunk(opcode, op, shared.cfg.op_timeout).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => {
            if e.sticky {
                fail_lease(shared, lease, &e.message);
            }
            Err(Reply::err(e.status, e.message))
        }
        Err(e) => Err(worker_lost(shared, lease, &e)),
    }
}

async fn write(
    shared: &Arc<Shared>,
    peer: &Peer,
    header: &Header,
    body: &[u8],
    recv: &mut quinn::RecvStream,
) -> Result<Reply, Reply> {
    let len = u64::from(header.data_len);
    let checked = from_body::<MemWrite>(body)
        .map_err(Reply::from)
        .and_then(|m| check(shared, peer, &m.lease, m.buf, m.offset, len).map(|s| (m, s)));
    let (m, slot) = match checked {
        Ok(x) => x,
        Err(r) => {
            // Refuse the data instead of reading it.
            let _ = recv.stop(0u32.into());
            return Err(r);
        }
    };
    let ring = slot.worker.ring().clone();
    let failed = AtomicBool::new(false);
    let (tx, mut rx) = mpsc::channel::<(Slot, u64, u32)>(SLOTS);
    let reader = async {
        let tx = tx;
        let mut at = 0u64;
        while at < len {
            if failed.load(Ordering::Relaxed) {
                let _ = recv.stop(0u32.into());
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
        while let Some((s, at, n)) = rx.recv().await {
            if result.is_ok() {
                let op = ChunkOp {
                    id: m.buf,
                    offset: m.offset + at,
                    slot: s.index(),
                    len: n,
                };
                result = chunk(shared, &m.lease, &slot, Opcode::MemWrite, op).await;
                if result.is_err() {
                    failed.store(true, Ordering::Relaxed);
                }
            }
            // The slot goes back to the ring once the worker has copied it.
            drop(s);
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
    peer: &Peer,
    header: &Header,
    body: &[u8],
    send: &mut quinn::SendStream,
) -> bool {
    let (m, slot) = match check_read(shared, peer, body) {
        Ok(x) => x,
        Err(r) => return send_reply(send, header, &r).await,
    };
    let len = u64::from(m.len);
    let ring = slot.worker.ring().clone();
    let fill = |at: u64| fill_chunk(shared, &ring, &slot, &m, len, at);
    // The first chunk before the header, so an early failure is a reply.
    let first = if len == 0 {
        None
    } else {
        match fill(0).await {
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
    send_chunks(shared, send, first, len, fill).await
}

/// A MEM_READ's body, decoded and checked (size limit, then lease, handle
/// and range), with the lease it reads.
fn check_read(shared: &Shared, peer: &Peer, body: &[u8]) -> Result<(MemRead, LeaseRef), Reply> {
    from_body::<MemRead>(body)
        .map_err(Reply::from)
        .and_then(|m| {
            if m.len > shared.cfg.limits.max_data {
                return Err(Reply::err(
                    Status::BadRequest,
                    format!(
                        "MEM_READ of {} bytes is over the {} byte limit",
                        m.len, shared.cfg.limits.max_data
                    ),
                ));
            }
            check(shared, peer, &m.lease, m.buf, m.offset, u64::from(m.len)).map(|s| (m, s))
        })
}

/// Has the worker fill a ring slot with the chunk of `m` (`len` bytes in
/// all) that starts `at` bytes in; returns the slot and the chunk's length.
async fn fill_chunk(
    shared: &Shared,
    ring: &Arc<ShmRing>,
    slot: &LeaseRef,
    m: &MemRead,
    len: u64,
    at: u64,
) -> Result<(Slot, u32), Reply> {
    let s = ring.acquire().await;
    let n = (len - at).min(SLOT_BYTES as u64) as u32;
    let op = ChunkOp {
        id: m.buf,
        offset: m.offset + at,
        slot: s.index(),
        len: n,
    };
    chunk(shared, &m.lease, slot, Opcode::MemRead, op)
        .await
        .map(|()| (s, n))
}

/// Sends a MEM_READ's data after its header, `first` (the chunk at 0)
/// already filled: `fill` fills the next chunks while the earlier ones go
/// out on QUIC. Returns whether the data went out whole.
async fn send_chunks<F, Fut>(
    shared: &Shared,
    send: &mut quinn::SendStream,
    first: (Slot, u32),
    len: u64,
    fill: F,
) -> bool
where
    F: Fn(u64) -> Fut,
    Fut: Future<Output = Result<(Slot, u32), Reply>>,
{
    let (tx, mut rx) = mpsc::channel::<(Slot, u32)>(SLOTS);
    let stop = AtomicBool::new(false);
    let producer = async {
        let tx = tx;
        if tx.send(first).await.is_err() {
            return Ok(());
        }
        let mut at = u64::from(SLOT_BYTES as u32).min(len);
        while at < len && !stop.load(Ordering::Relaxed) {
            let c = fill(at).await?;
            at += u64::from(c.1);
            if tx.send(c).await.is_err() {
                break;
            }
        }
        Ok::<(), Reply>(())
    };
    let consumer = async {
        while let Some((s, n)) = rx.recv().await {
            let mut hop = HopTimer::start(Hop::NodeSend, Opcode::MemRead, u64::from(n));
            // A client that stops reading loses the reply after the reply
            // timeout, instead of holding the lease's ring slots.
            let wrote = tokio::time::timeout(
                shared.cfg.reply_timeout,
                send.write_all(&s.bytes()[..n as usize]),
            )
            .await;
            if !matches!(wrote, Ok(Ok(()))) {
                stop.store(true, Ordering::Relaxed);
                let _ = send.reset(0u32.into());
                return false;
            }
            hops::mark(&mut hop, "quic");
        }
        true
    };
    let (produced, sent) = tokio::join!(producer, consumer);
    match produced {
        Ok(()) => sent,
        Err(r) => {
            // The header promised the data: end the stream with an error
            // the client sees as a reset.
            tracing::debug!(status = ?r.status, "MEM_READ failed mid-stream");
            let _ = send.reset(1u32.into());
            false
        }
    }
}
