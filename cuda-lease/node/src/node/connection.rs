//! Connections and streams: accepting, the pre-authentication gate, reading
//! requests within budget, writing replies within the reply timeout.

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
        // Take a HELLO place (or queue) before the TLS handshake costs anything.
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
            // The HELLO timeout runs from taking the place: a cut-short
            // handshake looks like a timeout, not a refusal clients retry.
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

/// The largest HELLO body read before authentication (nothing else is
/// accepted then, and nothing beyond it allocated or read).
pub const PREAUTH_MAX_BODY: u32 = 4096;

pub(super) async fn serve_stream(
    shared: Arc<Shared>,
    peer: Arc<Peer>,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
) {
    stamp(Point::NodeStart);
    // Held until the reply is written or dropped; also carries the reply's
    // bytes (charged by `dispatch` before the work runs).
    let mut turn = None;
    let head = tokio::time::timeout(
        Duration::from_secs(60),
        read_head(&shared, &peer, &mut recv, &mut turn),
    )
    .await;
    let read = match head {
        Ok(Ok(Head::Refused(header, reply))) => {
            // Refused on its header (and body): the rest is not read.
            let _ = recv.stop(0u32.into());
            if super::stream::send_reply(&mut send, &header, &reply).await {
                let _ = send.finish();
            }
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
            let read = read_data(&mut recv, header, body, shared.cfg.payload_stall_timeout).await;
            cuda_lease::transport::read_end_if_here(&mut recv);
            read
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

/// Reads a request's header and body: without a principal only a small
/// HELLO; with one, after taking the budget into `turn`.
async fn read_head(
    shared: &Arc<Shared>,
    peer: &Peer,
    recv: &mut quinn::RecvStream,
    turn: &mut Option<BudgetTurn>,
) -> std::io::Result<Head> {
    let header = proto::read_header(recv, &shared.cfg.limits).await?;
    if let Some(who) = peer.get() {
        // Streamed transfers hold only the worker's ring.
        let streamed = matches!(header.opcode, Opcode::MemWrite | Opcode::MemRead);
        let data = if streamed { 0 } else { header.data_len };
        match BudgetTurn::take(shared, who, u64::from(header.body_len) + u64::from(data)) {
            Ok(t) => *turn = Some(t),
            Err(r) => return Ok(Head::Refused(header, r)),
        }
    } else if header.opcode != Opcode::Hello
        || header.is_reply()
        || header.body_len > PREAUTH_MAX_BODY
        || header.data_len != 0
    {
        let msg = if header.opcode == Opcode::Hello {
            format!("HELLO over {PREAUTH_MAX_BODY} bytes, or with data")
        } else {
            "send HELLO with a valid token first".to_string()
        };
        return Ok(Head::Refused(header, Reply::err(Status::Unauthorized, msg)));
    }
    let mut body = vec![0u8; header.body_len as usize];
    tokio::io::AsyncReadExt::read_exact(recv, &mut body).await?;
    Ok(Head::Read(header, body))
}

/// Reads a request's data (within 60 s) into memory resident only as bytes
/// arrive: the first MiB, then the rest of the declared (already budgeted)
/// length in one reservation.
///
/// Never grown by doubling: freed 1-32 MiB blocks raise glibc's mmap
/// threshold and stay in the tokio threads' arenas. A block over 32 MiB is
/// always mapped, and unmapped whole when dropped.
///
/// A payload stalled for `stall` is dropped with what it held (else a
/// vanished client would hold it until the connection's idle timeout).
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
    /// A peer of another version gets its own version's header, to read why.
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
            let p = proto::proto_error(&e);
            let msg = p.map_or_else(|| format!("bad frame: {e}"), ToString::to_string);
            debug!(error = %msg, "rejected frame");
            let mut answer = refused(msg);
            // Version 1 shares this header layout; its peers do not know MALFORMED.
            if let Some(proto::ProtoError::UnsupportedVersion(1)) = p {
                answer.reply_version = Some(1);
                answer.reply.status = Status::BadRequest;
            }
            answer
        }
        Err(_) => refused("request timed out".into()),
    }
}

/// Writes the answer within the reply timeout, else resets it; held data is
/// read from the worker one part at a time as the stream takes it.
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
        Ok(Ok(())) => return,
        Ok(Err(e)) => debug!(error = %e, "reply not written: reset"),
        Err(_) => debug!("reply not read within the reply timeout: dropped"),
    }
    let _ = send.reset(0u32.into());
}

/// Writes a reply's header and body, then its held data part by part.
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

/// Closes a connection once its failed HELLO's reply arrived (or soon after).
pub(super) async fn close_after_failed_hello(
    shared: &Shared,
    peer: &Peer,
    send: &mut quinn::SendStream,
) {
    let wait = shared.cfg.reply_timeout.min(Duration::from_secs(1));
    let _ = tokio::time::timeout(wait, send.stopped()).await;
    peer.close_unauthenticated("HELLO failed");
}
