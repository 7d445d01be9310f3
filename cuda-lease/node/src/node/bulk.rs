//! The bulk-data channel: MEM_WRITE and MEM_READ over TLS on TCP.
//!
//! Large transfers use TCP (kernel segmentation and pacing); control stays
//! on QUIC. BULK_OPEN on the authenticated QUIC connection yields tickets;
//! each opens one TLS connection as that principal, once, within
//! [`TICKET_TTL`], carrying MEM_WRITE / MEM_READ frames in turn, served by
//! [`super::stream`] under the same checks and budgets.
//!
//! Bounds: connections without a redeemed ticket count as waiting for
//! HELLO (`max_unauthenticated`) and close after `hello_timeout`; each
//! principal holds at most `max_bulk_connections_per_principal` connections
//! and twice that many unused tickets; idle connections close after
//! [`IDLE_TIMEOUT`].

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, warn};

use super::handshake::{Admission, Source};
use super::stream::{send_reply, serve_request, DataIn, DataOut};
use super::submit::BudgetTurn;
use super::{Reply, Shared};
use crate::lease_table::Principal;
use crate::lock;
use crate::proto::{self, BulkOpen, BulkTickets, Opcode, Status, BULK_TICKET_LEN};

/// How long a ticket opens a connection.
pub(super) const TICKET_TTL: Duration = Duration::from_secs(30);
/// How long a bulk connection may sit between requests.
pub(super) const IDLE_TIMEOUT: Duration = Duration::from_secs(120);

type Ticket = [u8; BULK_TICKET_LEN];

/// A bulk connection's socket, buffered (rustls reads 4 KiB at a time).
type Tcp = tokio::io::BufReader<TcpStream>;

/// The read buffer under each bulk connection's TLS.
pub(crate) const READ_BUFFER: usize = 256 << 10;

/// The channel's port and its tickets.
#[derive(Debug, Default)]
pub(super) struct Tickets {
    /// The TCP port (0: the channel is off).
    port: std::sync::atomic::AtomicU16,
    state: StdMutex<TicketState>,
}

#[derive(Debug, Default)]
struct TicketState {
    /// Unused tickets: whose, and until when.
    unused: HashMap<Ticket, (Principal, Duration)>,
    open: HashMap<Principal, usize>,
}

impl Tickets {
    fn state(&self) -> std::sync::MutexGuard<'_, TicketState> {
        lock(&self.state)
    }

    fn port(&self) -> u16 {
        self.port.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// BULK_OPEN: `count` tickets for `who`.
pub(super) fn open(shared: &Shared, who: &Principal, body: &[u8]) -> Result<Reply, Reply> {
    let m: BulkOpen = proto::from_body(body)?;
    let port = shared.bulk.port();
    if port == 0 {
        return Err(Reply::err(
            Status::NotFound,
            "this node has no bulk-data channel (started with --bulk-listen off)",
        ));
    }
    if m.count == 0 || m.count > proto::MAX_BULK_TICKETS {
        return Err(Reply::err(
            Status::BadRequest,
            format!(
                "BULK_OPEN asks for {} tickets; 1 to {} may be asked at once",
                m.count,
                proto::MAX_BULK_TICKETS
            ),
        ));
    }
    let now = shared.now();
    let most = shared.cfg.max_bulk_connections_per_principal;
    let mut st = shared.bulk.state();
    st.unused.retain(|_, (_, until)| *until > now);
    let held = st.unused.values().filter(|(p, _)| p == who).count();
    if held + usize::from(m.count) > 2 * most {
        return Err(Reply::err(
            Status::CapacityExceeded,
            format!(
                "principal {who} holds {held} unused bulk-data tickets; {} more would pass \
                 twice its connection limit of {most} (max_bulk_connections_per_principal)",
                m.count
            ),
        ));
    }
    let mut tickets = Vec::with_capacity(usize::from(m.count));
    for _ in 0..m.count {
        let mut t = [0u8; BULK_TICKET_LEN];
        getrandom::fill(&mut t)
            .map_err(|e| Reply::err(Status::Internal, format!("random ticket: {e}")))?;
        st.unused.insert(t, (who.clone(), now + TICKET_TTL));
        tickets.push(t);
    }
    Ok(Reply::ok(&BulkTickets { port, tickets }))
}

/// Binds the channel's listener (`quic`: the QUIC address); `None` if off.
pub(super) async fn bind(
    shared: &Shared,
    quic: SocketAddr,
) -> std::io::Result<Option<TcpListener>> {
    let listener = match shared.cfg.bulk {
        super::BulkListen::Off => return Ok(None),
        super::BulkListen::At(a) => TcpListener::bind(a).await?,
        super::BulkListen::SamePort => match TcpListener::bind(quic).await {
            Ok(l) => l,
            // A node on an ephemeral port takes any free TCP port.
            Err(_) if shared.cfg.listen.port() == 0 => {
                TcpListener::bind(SocketAddr::new(quic.ip(), 0)).await?
            }
            Err(e) => {
                return Err(std::io::Error::new(
                    e.kind(),
                    format!(
                        "binding the bulk-data channel on TCP {quic}: {e} (choose another \
                         address with --bulk-listen, or turn it off)"
                    ),
                ))
            }
        },
    };
    let port = listener.local_addr()?.port();
    shared
        .bulk
        .port
        .store(port, std::sync::atomic::Ordering::Relaxed);
    Ok(Some(listener))
}

/// Accepts bulk-data connections until the node stops.
pub(super) async fn accept_loop(shared: Arc<Shared>, listener: TcpListener, acceptor: TlsAcceptor) {
    loop {
        let (tcp, from) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                warn!(error = %e, "bulk-data accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // Counted and queued with connections awaiting HELLO.
        let admission = shared.handshakes.wait(Source::of(from.ip()));
        if let Admission::Busy = admission {
            debug!(%from, "bulk-data connection refused: the handshake queue is full");
            continue;
        }
        let shared = shared.clone();
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            let queue_deadline = tokio::time::Instant::now() + shared.cfg.hello_timeout;
            let waiting = match admission {
                Admission::Now(place) => place,
                Admission::Queued(q) => match q.place(queue_deadline).await {
                    Some(place) => place,
                    None => {
                        debug!(%from, "bulk-data connection refused: no place by the deadline");
                        return;
                    }
                },
                Admission::Busy => return,
            };
            let opened =
                tokio::time::timeout(shared.cfg.hello_timeout, redeem(&shared, &acceptor, tcp))
                    .await;
            drop(waiting);
            let (tls, open) = match opened {
                Ok(Ok(x)) => x,
                Ok(Err(why)) => {
                    debug!(%from, %why, "bulk-data connection refused");
                    return;
                }
                Err(_) => {
                    debug!(%from, "bulk-data connection closed: no ticket by the deadline");
                    return;
                }
            };
            shared.metrics.bulk_connections.inc();
            serve(&shared, &open.who, tls).await;
        });
    }
}

/// An open bulk-data connection, counted against its principal's limit.
struct OpenConn<'a> {
    tickets: &'a Tickets,
    who: Principal,
}

impl Drop for OpenConn<'_> {
    fn drop(&mut self) {
        let mut st = self.tickets.state();
        if let Some(n) = st.open.get_mut(&self.who) {
            *n -= 1;
            if *n == 0 {
                st.open.remove(&self.who);
            }
        }
    }
}

/// The TLS handshake, then the ticket: the connection's principal (counted
/// as open) or why not. Answers one byte: 0 accepted, else it closes.
async fn redeem<'a>(
    shared: &'a Shared,
    acceptor: &TlsAcceptor,
    tcp: TcpStream,
) -> Result<(TlsStream<Tcp>, OpenConn<'a>), String> {
    let _ = tcp.set_nodelay(true);
    let mut tls = acceptor
        .accept(tokio::io::BufReader::with_capacity(READ_BUFFER, tcp))
        .await
        .map_err(|e| format!("TLS: {e}"))?;
    let mut ticket = [0u8; BULK_TICKET_LEN];
    tls.read_exact(&mut ticket)
        .await
        .map_err(|e| format!("reading the ticket: {e}"))?;
    let now = shared.now();
    let taken = {
        let mut st = shared.bulk.state();
        match st.unused.remove(&ticket) {
            Some((who, until)) if until > now => {
                let open = st.open.entry(who.clone()).or_insert(0);
                if *open >= shared.cfg.max_bulk_connections_per_principal {
                    Err(format!(
                        "principal {who} has {open} bulk-data connections open, its limit"
                    ))
                } else {
                    *open += 1;
                    Ok(OpenConn {
                        tickets: &shared.bulk,
                        who,
                    })
                }
            }
            Some(_) => Err("expired ticket".to_string()),
            None => Err("unknown ticket".to_string()),
        }
    };
    let answer = [u8::from(taken.is_err())];
    let wrote = async {
        tls.write_all(&answer).await?;
        tls.flush().await
    }
    .await;
    match (taken, wrote) {
        (Ok(open), Ok(())) => Ok((tls, open)),
        // Dropping `open` gives its place back.
        (Ok(_), Err(e)) => Err(format!("answering the ticket: {e}")),
        (Err(why), _) => {
            let _ = tls.shutdown().await;
            Err(why)
        }
    }
}

/// Serves `who`'s requests in turn until the connection closes, breaks,
/// idles out or sends anything but MEM_WRITE or MEM_READ.
async fn serve(shared: &Arc<Shared>, who: &Principal, tls: TlsStream<Tcp>) {
    let (r, w) = tokio::io::split(tls);
    let mut input = BulkIn {
        r,
        timeout: shared.cfg.reply_timeout,
    };
    let mut out = w;
    loop {
        let header = match tokio::time::timeout(
            IDLE_TIMEOUT,
            proto::read_header(&mut input.r, &shared.cfg.limits),
        )
        .await
        {
            Ok(Ok(h)) => h,
            _ => break,
        };
        if header.is_reply() || !matches!(header.opcode, Opcode::MemWrite | Opcode::MemRead) {
            let reply = Reply::err(
                Status::Malformed,
                format!(
                    "the bulk-data channel carries MEM_WRITE and MEM_READ requests, not {:?}",
                    header.opcode
                ),
            );
            let _ = send_reply(&mut out, &header, &reply).await && out.flush().await.is_ok();
            break;
        }
        let turn = BudgetTurn::take(shared, who, u64::from(header.body_len));
        let mut body = vec![0u8; header.body_len as usize];
        if input.r.read_exact(&mut body).await.is_err() {
            break;
        }
        let done = match turn {
            Ok(_turn) => {
                // Counted before the reply so the client sees it.
                let asked = match header.opcode {
                    Opcode::MemRead => proto::from_body::<proto::MemRead>(&body)
                        .map(|m| u64::from(m.len))
                        .unwrap_or(0),
                    _ => u64::from(header.data_len),
                };
                shared.metrics.bulk_bytes.inc_by(asked);
                serve_request(shared, who, &header, &body, &mut out, &mut input).await
                    && out.flush().await.is_ok()
            }
            Err(reply) => {
                input.refuse(u64::from(header.data_len)).await;
                send_reply(&mut out, &header, &reply).await && out.flush().await.is_ok()
            }
        };
        if !done {
            break;
        }
    }
    let _ = out.shutdown().await;
}

struct BulkIn {
    r: ReadHalf<TlsStream<Tcp>>,
    /// Longest a refused request's data may take to drain.
    timeout: Duration,
}

impl DataIn for BulkIn {
    async fn read_exact(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        self.r.read_exact(buf).await.map(drop)
    }

    async fn refuse(&mut self, remaining: u64) {
        // TCP cannot stop one request's data: drain it so replies follow.
        let mut rest = (&mut self.r).take(remaining);
        let _ = tokio::time::timeout(
            self.timeout,
            tokio::io::copy(&mut rest, &mut tokio::io::sink()),
        )
        .await;
    }
}

/// A reply cut off ends the connection: the request's serving returns
/// false, and the loop stops.
impl DataOut for WriteHalf<TlsStream<Tcp>> {
    fn abort(&mut self) {}
}
