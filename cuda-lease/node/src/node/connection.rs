//! Connections and their streams: accepting, the pre-authentication gate,
//! reading a request within its budget, writing the reply within the reply
//! timeout.

use std::sync::Arc;
use std::time::Duration;

use tracing::debug;

use super::auth::cert_principal;
use super::dispatch::dispatch;
use super::handshake::{Admission, Peer, Source};
use super::submit::BudgetTurn;
use super::{Reply, Shared};
use crate::proto::{self, Frame, Header, Opcode, Status};
use crate::stamps::{stamp, Point};

pub(super) async fn accept_loop(shared: Arc<Shared>, endpoint: quinn::Endpoint) {
    while let Some(incoming) = endpoint.accept().await {
        let remote = incoming.remote_address();
        // A place among the connections waiting for HELLO (or in the
        // queue for one) before the TLS handshake costs anything.
        let admission = shared.handshakes.wait(Source::of(remote.ip()));
        if let Admission::Busy = admission {
            debug!(%remote, "refused: the handshake queue is full");
            shared.metrics.handshakes_refused.inc();
            incoming.refuse();
            continue;
        }
        let shared = shared.clone();
        tokio::spawn(async move {
            let queue_deadline = tokio::time::Instant::now() + shared.cfg.hello_timeout;
            let place = match admission {
                Admission::Now(place) => place,
                Admission::Queued(queued) => {
                    shared.metrics.handshakes_queued.inc();
                    let Some(place) = queued.place(queue_deadline).await else {
                        debug!(%remote, "refused: no place by the HELLO deadline");
                        shared.metrics.handshakes_refused.inc();
                        incoming.refuse();
                        return;
                    };
                    place
                }
                Admission::Busy => return,
            };
            // A place is held at most the HELLO timeout, from when it is
            // taken: a connection that waited in the queue gets the whole
            // time for its handshake (cut short, its client would see the
            // handshake time out, not a refusal it retries).
            let deadline = tokio::time::Instant::now() + shared.cfg.hello_timeout;
            let conn = match tokio::time::timeout_at(deadline, incoming).await {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => {
                    debug!(error = %e, "handshake failed");
                    return;
                }
                Err(_) => {
                    debug!(%remote, "TLS handshake not done by the HELLO deadline");
                    return;
                }
            };
            let peer = Arc::new(Peer::new(conn.clone(), place));
            if let Some(p) = cert_principal(&conn) {
                peer.authenticate(p);
            }
            debug!(%remote, principal = ?peer.get(), "connection");
            let hello_deadline = tokio::time::sleep_until(deadline);
            tokio::pin!(hello_deadline);
            loop {
                tokio::select! {
                    s = conn.accept_bi() => {
                        let Ok((send, recv)) = s else { break };
                        let shared = shared.clone();
                        let peer = peer.clone();
                        tokio::spawn(async move { serve_stream(shared, peer, send, recv).await });
                    }
                    () = &mut hello_deadline, if peer.get().is_none() => {
                        if peer.get().is_none() {
                            debug!(%remote, "no HELLO by the deadline: closed");
                            peer.close_unauthenticated("no HELLO by the deadline");
                        }
                    }
                }
            }
            peer.end();
            // Batches that never arrived on it never will.
            let id = peer.conn_id();
            for (_, slot) in shared.table().payloads() {
                slot.order.update(|o| o.closed(id));
            }
        });
    }
}

/// Answers a request refused on its header (and body), telling the peer to
/// stop sending the rest: nothing more of it is read.
pub(super) async fn refuse(
    send: &mut quinn::SendStream,
    recv: &mut quinn::RecvStream,
    req: &Header,
    reply: &Reply,
) {
    let _ = recv.stop(0u32.into());
    let h = Header::reply(req, reply.status, reply.body.len() as u32, 0);
    if proto::write_frame(send, &h, &reply.body, &[]).await.is_ok() {
        let _ = send.finish();
    }
}

/// The largest HELLO body the node reads from a connection that has not
/// authenticated; such a connection may send nothing else, and nothing it
/// declares beyond this is allocated or read.
pub const PREAUTH_MAX_BODY: u32 = 4096;

pub(super) async fn serve_stream(
    shared: Arc<Shared>,
    peer: Arc<Peer>,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
) {
    stamp(Point::NodeStart);
    // Held until the reply has been written or dropped: it also carries
    // the bytes of the reply (charged by `dispatch` before the work runs).
    let mut turn = None;
    let head = tokio::time::timeout(
        Duration::from_secs(60),
        read_head(&shared, &peer, &mut recv, &mut turn),
    )
    .await;
    let read = match head {
        Ok(Ok(Head::Refused(header, reply))) => {
            refuse(&mut send, &mut recv, &header, &reply).await;
            if header.opcode == Opcode::Hello && peer.get().is_none() {
                close_after_failed_hello(&shared, &peer, &mut send).await;
            }
            return;
        }
        // Bulk transfers stream through the worker's shared ring.
        Ok(Ok(Head::Read(header, body)))
            if !header.is_reply()
                && matches!(header.opcode, Opcode::MemWrite | Opcode::MemRead) =>
        {
            super::stream::serve(&shared, &peer, header, body, send, recv).await;
            return;
        }
        Ok(Ok(Head::Read(header, body))) => {
            read_data(&mut recv, header, body, shared.cfg.payload_stall_timeout).await
        }
        Ok(Err(e)) => Ok(Err(e)),
        Err(elapsed) => Err(elapsed),
    };
    stamp(Point::NodeRead);
    let mut answer = answer(&shared, &peer, read, turn.as_mut()).await;
    write_reply(&shared, &mut send, &mut answer).await;
    if answer.failed_hello {
        close_after_failed_hello(&shared, &peer, &mut send).await;
    }
}

/// A request's header and body, or its refusal on the header.
enum Head {
    /// Read whole (the data, if any, follows).
    Read(Header, Vec<u8>),
    /// Refused on the header alone: nothing declared is read.
    Refused(Header, Reply),
}

/// Reads a request's header and body. Without a principal only a small
/// HELLO is read; with one, the principal's budget is taken (into `turn`)
/// before anything declared is allocated.
async fn read_head(
    shared: &Arc<Shared>,
    peer: &Peer,
    recv: &mut quinn::RecvStream,
    turn: &mut Option<BudgetTurn>,
) -> std::io::Result<Head> {
    let header = proto::read_header(recv, &shared.cfg.limits).await?;
    let Some(who) = peer.get() else {
        if header.opcode == Opcode::Hello
            && !header.is_reply()
            && header.body_len <= PREAUTH_MAX_BODY
            && header.data_len == 0
        {
            let mut body = vec![0u8; header.body_len as usize];
            tokio::io::AsyncReadExt::read_exact(recv, &mut body).await?;
            return Ok(Head::Read(header, body));
        }
        let msg = if header.opcode == Opcode::Hello {
            format!("HELLO over {PREAUTH_MAX_BODY} bytes, or with data")
        } else {
            "send HELLO with a valid token first".to_string()
        };
        return Ok(Head::Refused(header, Reply::err(Status::Unauthorized, msg)));
    };
    // Streamed transfers hold only the worker's ring.
    let streamed = matches!(header.opcode, Opcode::MemWrite | Opcode::MemRead);
    let bytes = u64::from(header.body_len)
        + if streamed {
            0
        } else {
            u64::from(header.data_len)
        };
    match BudgetTurn::take(shared, who, bytes) {
        Ok(t) => *turn = Some(t),
        Err(r) => return Ok(Head::Refused(header, r)),
    }
    let mut body = vec![0u8; header.body_len as usize];
    tokio::io::AsyncReadExt::read_exact(recv, &mut body).await?;
    Ok(Head::Read(header, body))
}

/// Reads a request's data (within 60 s) into memory that is resident only
/// as the bytes arrive: its first MiB, then, once that is full, the rest
/// of the declared length in one reservation (charged to the budget on
/// the header already) whose pages the arriving bytes fill.
///
/// Never grown by doubling: cut-off payloads then free blocks of 1 to
/// 32 MiB, glibc raises its mmap threshold to each such block's size (up
/// to 32 MiB) and serves those sizes from the tokio threads' arenas, which
/// keep what later cut-off payloads free (an embedded node: RSS 85 to
/// 120-180 MiB over 10 rounds of 5, with under 5 MiB in use). A block of
/// the declared length over 32 MiB is always mapped, and unmapped whole
/// when dropped.
///
/// A payload that stops arriving for `stall` is dropped with what it held
/// (a client gone without its close reaching the node would otherwise
/// hold it until the connection's idle timeout).
async fn read_data(
    recv: &mut quinn::RecvStream,
    header: Header,
    body: Vec<u8>,
    stall: Duration,
) -> Result<std::io::Result<Frame>, tokio::time::error::Elapsed> {
    let rest = async {
        let want = header.data_len as usize;
        let mut data = Vec::with_capacity(want.min(1 << 20));
        while data.len() < want {
            let next = tokio::time::timeout(stall, recv.read_chunk(want - data.len(), true))
                .await
                .map_err(|_| {
                    std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("no data for {stall:?}: payload dropped"),
                    )
                })?;
            let Some(chunk) = next.map_err(std::io::Error::other)? else {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
            };
            if data.len() + chunk.bytes.len() > data.capacity() {
                data.reserve_exact(want - data.len());
            }
            data.extend_from_slice(&chunk.bytes);
        }
        Ok(data)
    };
    tokio::time::timeout(Duration::from_secs(60), rest)
        .await
        .map(|r| r.map(|data| Frame { header, body, data }))
}

/// The reply to a request, and how to send it.
struct Answer {
    req: Header,
    reply: Reply,
    /// A peer of another protocol version gets its answer in its own
    /// version's header (the layout is the same), so it can read the
    /// reason.
    reply_version: Option<u8>,
    /// A HELLO that failed: the connection closes after the reply.
    failed_hello: bool,
}

/// Dispatches a request read whole, or answers why it could not be read.
async fn answer(
    shared: &Arc<Shared>,
    peer: &Peer,
    read: Result<std::io::Result<Frame>, tokio::time::error::Elapsed>,
    turn: Option<&mut BudgetTurn>,
) -> Answer {
    let refused = |msg: String| Answer {
        req: Header::request(Opcode::Hello, 0, 0, 0),
        reply: Reply::err(Status::Malformed, msg),
        reply_version: None,
        failed_hello: false,
    };
    match read {
        Ok(Ok(frame)) => {
            let (Ok(reply) | Err(reply)) = dispatch(shared, peer, &frame, turn).await;
            let failed_hello = frame.header.opcode == Opcode::Hello
                && reply.status != Status::Ok
                && peer.get().is_none();
            Answer {
                req: frame.header,
                reply,
                reply_version: None,
                failed_hello,
            }
        }
        Ok(Err(e)) => {
            let mut reply_version = None;
            let msg = match proto::proto_error(&e) {
                Some(p) => {
                    // Version 1 had this header layout; later ones may not.
                    if let proto::ProtoError::UnsupportedVersion(1) = p {
                        reply_version = Some(1);
                    }
                    p.to_string()
                }
                None => format!("bad frame: {e}"),
            };
            debug!(error = %msg, "rejected frame");
            let mut answer = Answer {
                reply_version,
                ..refused(msg)
            };
            if reply_version.is_some() {
                // A status an older peer knows (MALFORMED came later).
                answer.reply.status = Status::BadRequest;
            }
            answer
        }
        Err(_) => refused("request timed out".into()),
    }
}

/// Writes the answer within the reply timeout; a reply nobody reads by
/// then is reset, the client's loss, not the node's memory. A reply whose
/// data a lease's worker keeps is read from the worker a part at a time,
/// as the stream takes it: an unread reply holds a part on the node, not
/// its whole data.
async fn write_reply(shared: &Shared, send: &mut quinn::SendStream, a: &mut Answer) {
    let reply = &mut a.reply;
    let data_len = match &reply.held {
        Some(held) => held.len as u32,
        None => reply.data.len() as u32,
    };
    let h = Header::reply(&a.req, reply.status, reply.body.len() as u32, data_len);
    stamp(Point::NodeReplied);
    let sent = tokio::time::timeout(shared.cfg.reply_timeout, async {
        let written = match (a.reply_version, reply.held.as_mut()) {
            (Some(v), _) => {
                let mut frame = h.encode().to_vec();
                frame[4] = v;
                frame.extend_from_slice(&reply.body);
                tokio::io::AsyncWriteExt::write_all(send, &frame).await
            }
            (None, None) => proto::write_frame(send, &h, &reply.body, &reply.data).await,
            (None, Some(held)) => {
                write_held(send, &h, &reply.body, held, shared.cfg.op_timeout).await
            }
        };
        if written.is_ok() {
            let _ = send.finish();
            let _ = send.stopped().await;
        }
        written
    })
    .await;
    match sent {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            debug!(error = %e, "reply not written: reset");
            let _ = send.reset(0u32.into());
        }
        Err(_) => {
            debug!("reply not read within the reply timeout: dropped");
            let _ = send.reset(0u32.into());
        }
    }
}

/// Writes a reply's header and body, then its data as the worker that
/// keeps it hands it over, a part at a time.
async fn write_held(
    send: &mut quinn::SendStream,
    h: &Header,
    body: &[u8],
    held: &mut super::HeldData,
    timeout: Duration,
) -> std::io::Result<()> {
    send.write_all(&h.encode()).await?;
    send.write_all(body).await?;
    while let Some(part) = held.next(timeout).await {
        send.write_all(&part.map_err(std::io::Error::other)?)
            .await?;
    }
    Ok(())
}

/// Closes a connection whose HELLO failed, once its reply has arrived (or
/// after a short wait): a connection gets one try.
pub(super) async fn close_after_failed_hello(
    shared: &Shared,
    peer: &Peer,
    send: &mut quinn::SendStream,
) {
    let wait = shared.cfg.reply_timeout.min(Duration::from_secs(1));
    let _ = tokio::time::timeout(wait, send.stopped()).await;
    peer.close_unauthenticated("HELLO failed");
}
