//! A lease's BATCHes served by its worker over QUIC, the node off their path.
//!
//! The node asks for it (LEASE_DIRECT on the pipe, with a certificate made
//! for the lease, a ticket and the lease's limits); the worker binds a UDP
//! socket on the node's address and serves QUIC from its device loop's
//! thread: a current-thread runtime that the loop runs whenever it waits
//! ([`DirectLink::turn`] while it spins, [`DirectLink::sleep`] while it
//! sleeps), so a batch reaches the device and its reply the wire with no
//! thread's wake-up between them. A connection's first stream must be a
//! HELLO carrying the lease and the ticket; after it, each stream carries
//! one BATCH of the lease. Its task checks a batch as the node would
//! (frame limits, the lease, its modules by hash, the reply bytes), waits
//! for its turn in the lease's order ([`LeaseOrder`], as the node's), and
//! hands it to the device loop, which plans and runs it like a batch from
//! the pipe and answers the task when its work is done. While the loop
//! loads a batch's modules (a compile may take up to the node's compile
//! limit) a helper thread runs the tasks instead ([`DirectLink::beside`]),
//! so the lease's connections keep answering.
//!
//! Bounds: at most [`DirectLimits::max_requests`] requests read or running
//! at once, and [`DirectLimits::max_bytes`] of their bodies, data and reply
//! bytes; a request past either is refused on its header, before its data
//! is read. At most [`MAX_DIRECT_CONNECTIONS`] connections at once, each
//! with [`DIRECT_HELLO_TIMEOUT`] for its handshake and HELLO.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::{oneshot, Notify, Semaphore};

use super::messages::{encode_worker_batch, BatchLimits, WorkerBatchReply, WorkerLoad};
use crate::device::DeviceError;
use crate::lock;
use crate::order::{Arrival, LeaseOrder, Stalled};
use crate::proto::{
    self, from_body, to_body, BatchHead, BatchReply, DirectHello, ErrorBody, Header, LeaseId,
    Limits, ModuleHash, Opcode, Status, DIRECT_STAMPS, DIRECT_TICKET_LEN, FLAG_STAMPS,
};
use crate::stamps::now_ns;
use crate::transport::TransportSettings;

/// Connections a lease's worker holds open at once (a client needs one;
/// it may reconnect); more are refused before their handshake.
pub(crate) const MAX_DIRECT_CONNECTIONS: usize = 8;

/// How long a new connection has for its handshake and its HELLO.
pub(crate) const DIRECT_HELLO_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Node -> worker (LEASE_DIRECT on the pipe): serve the lease's batches.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct DirectOpen {
    /// Where to bind: the node's address, and port 0 (any) unless `ports`.
    pub(crate) bind: SocketAddr,
    /// The ports to bind from, first to last (the first free one).
    pub(crate) ports: Option<(u16, u16)>,
    /// The lease's certificate and its PKCS#8 key (DER).
    pub(crate) cert_der: Vec<u8>,
    pub(crate) key_der: Vec<u8>,
    pub(crate) ticket: [u8; DIRECT_TICKET_LEN],
    pub(crate) lease: LeaseId,
    pub(crate) limits: DirectLimits,
    pub(crate) transport: TransportSettings,
}

/// What a lease's direct path has served since it opened (counts that
/// only grow), in the worker's answer to LEASE_QUERY.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct DirectServed {
    /// BATCHes accepted.
    pub(crate) batches: u64,
    /// Their commands.
    pub(crate) commands: u64,
}

/// The lease's limits on its direct path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct DirectLimits {
    /// The lease's reservation, in bytes.
    pub(crate) reserved: u64,
    /// Most live ids in the lease.
    pub(crate) max_ids: u32,
    /// Most streams the lease may use.
    pub(crate) max_streams: u32,
    /// Largest request body and data (the node's frame limits).
    pub(crate) max_body: u32,
    pub(crate) max_data: u32,
    /// Bytes of requests (body and data) and their replies' declared
    /// bytes held at once.
    pub(crate) max_bytes: u64,
    /// Requests read or running at once.
    pub(crate) max_requests: u32,
}

/// Worker -> node: the UDP port the lease's batches go to.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub(crate) struct DirectPort {
    pub(crate) port: u16,
}

/// What the lease's tasks hand the device loop.
pub(super) enum ToDevice {
    /// A batch to plan and run, as the node would send it, and where its
    /// answer goes.
    Batch {
        body: Vec<u8>,
        data: Vec<u8>,
        answer: oneshot::Sender<Answer>,
        /// The client asked for the batch's stamps ([`FLAG_STAMPS`]).
        stamps: bool,
    },
    /// An answer to the node's request `request` (an [`after`](DirectLink::after)).
    Pipe { request: Header, status: Status },
}

/// A device loop's answer to a batch: as it would write it on the pipe.
#[derive(Debug)]
pub(super) struct Answer {
    pub(super) status: Status,
    pub(super) body: Vec<u8>,
    pub(super) data: Vec<u8>,
}

/// A descriptor the runtime watches (it is owned elsewhere).
struct Watched(RawFd);

impl AsRawFd for Watched {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// While a batch runs and the device loop spins, it runs the direct path's
/// tasks at most this often (a turn costs a system call; the loop polls
/// the batch's GPU work between turns).
const TURN_GAP: Duration = Duration::from_micros(2);

/// Watches `fd` for reads on the current runtime.
///
/// `fd` must stay open while the watch lives: the worker's stdin does for
/// the worker's life, and the device's wake-up descriptor for the
/// device's, which the device loop drops after its [`DirectLink`].
fn watch(fd: RawFd) -> std::io::Result<AsyncFd<Watched>> {
    // SAFETY: `fd` is open and stays so while the watch lives (above); the
    // watch only registers it with the runtime's poller.
    unsafe { AsyncFd::register_with_interest(Watched(fd), Interest::READABLE) }
        .map_err(|e| e.into_parts().1)
}

/// The device loop's end of a lease's direct path: the runtime its tasks
/// run on, which the loop runs while it waits.
pub(super) struct DirectLink {
    // (Dropped in this order: the watches before their runtime.)
    /// The node's pipe (the worker's stdin), watched while the loop sleeps.
    pipe: AsyncFd<Watched>,
    /// The device's wake-up descriptor, once it armed one.
    wake: Option<AsyncFd<Watched>>,
    served: Arc<Served>,
    /// When [`DirectLink::turn`] last ran.
    last_turn: std::cell::Cell<std::time::Instant>,
    rt: tokio::runtime::Runtime,
}

/// A UDP socket on `bind`'s address: on `bind`'s port, or on the first
/// free port of `ports`.
fn bind_in(
    transport: &TransportSettings,
    bind: SocketAddr,
    ports: Option<(u16, u16)>,
) -> std::io::Result<std::net::UdpSocket> {
    let Some((first, last)) = ports else {
        return transport.bind_udp(bind);
    };
    for port in first..=last {
        match transport.bind_udp(SocketAddr::new(bind.ip(), port)) {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => continue,
            other => return other,
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!("no free UDP port in the direct-lease range {first}-{last}"),
    ))
}

impl DirectLink {
    /// The BATCHes this path has accepted and their commands, since it
    /// opened: what the node's `gpu_batch_total` and `gpu_batch_commands`
    /// count for the lease.
    pub(crate) fn served(&self) -> DirectServed {
        DirectServed {
            batches: self.served.batches.load(Ordering::Relaxed),
            commands: self.served.commands.load(Ordering::Relaxed),
        }
    }

    /// Binds, starts serving on a runtime of the calling thread (run by
    /// the link's waits) and returns the link and the port. `pipe`: the
    /// node's pipe, which the waits watch too.
    pub(super) fn open(o: DirectOpen, pipe: RawFd) -> std::io::Result<(Self, u16)> {
        let socket = bind_in(&o.transport, o.bind, o.ports)?;
        let port = socket.local_addr()?.port();
        let identity = crate::tls::Identity {
            chain: vec![o.cert_der.clone().into()],
            key: rustls::pki_types::PrivateKeyDer::Pkcs8(
                rustls::pki_types::PrivatePkcs8KeyDer::from(o.key_der.clone()),
            ),
        };
        let server = crate::tls::server_config(&identity, None, &o.transport)
            .map_err(std::io::Error::other)?;
        let limits = o.limits;
        let served = Served {
            lease: o.lease,
            ticket: o.ticket,
            limits,
            order: LeaseOrder::default(),
            known: Mutex::new(HashSet::new()),
            bytes: Semaphore::new(units(limits.max_bytes) as usize),
            requests: Semaphore::new(limits.max_requests as usize),
            poisoned: AtomicBool::new(false),
            handed: Mutex::new(Vec::new()),
            any_handed: AtomicBool::new(false),
            notify: Notify::new(),
            batches: AtomicU64::new(0),
            commands: AtomicU64::new(0),
        };
        let served = Arc::new(served);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let runtime: Arc<dyn quinn::Runtime> = Arc::new(quinn::TokioRuntime);
        let mut config = quinn::EndpointConfig::default();
        let _ = config.max_udp_payload_size(o.transport.largest_accepted_payload());
        let (endpoint, pipe) = {
            let _in = rt.enter();
            let endpoint = quinn::Endpoint::new(config, Some(server), socket, runtime)?;
            let pipe = watch(pipe)?;
            (endpoint, pipe)
        };
        rt.spawn(serve(served.clone(), endpoint));
        let link = DirectLink {
            pipe,
            wake: None,
            served,
            last_turn: std::cell::Cell::new(std::time::Instant::now()),
            rt,
        };
        Ok((link, port))
    }

    /// What was handed over since the last call, in order.
    pub(super) fn take(&self) -> Vec<ToDevice> {
        if !self.served.any_handed.swap(false, Ordering::Acquire) {
            return Vec::new();
        }
        std::mem::take(&mut *lock(&self.served.handed))
    }

    /// Answers the node's `request` (as a [`ToDevice::Pipe`]) once every
    /// batch numbered below `upto` has been handed over, or with why none
    /// will be.
    pub(super) fn after(&self, request: Header, upto: u64) {
        let served = self.served.clone();
        self.rt.spawn(async move {
            let status = match served.order.reached(upto).await {
                Ok(()) => Status::Ok,
                Err(_) => Status::LeaseNotFound,
            };
            served.hand(ToDevice::Pipe { request, status });
        });
    }

    /// Sends the device loop's answers to their tasks from inside the
    /// runtime (a task woken there costs no system call), which run and
    /// write their replies before this returns.
    pub(super) fn deliver(&self, answers: Vec<(oneshot::Sender<Answer>, Answer)>) {
        if answers.is_empty() {
            return;
        }
        self.rt.block_on(async move {
            for (to, answer) in answers {
                let _ = to.send(answer);
            }
            // Their tasks run before this yield returns.
            tokio::task::yield_now().await;
        });
    }

    /// Runs `f` (device work that may take long: a module's compile) while
    /// a helper thread runs the lease's tasks and I/O, so the lease's
    /// connections keep answering (their keep-alives, new requests, which
    /// wait their turn) until `f` returns. Without a thread to spare, `f`
    /// runs alone and the endpoint waits for it.
    pub(super) fn beside<R>(&self, f: impl FnOnce() -> R) -> R {
        /// Ends the helper's run when dropped (a panic in `f` too).
        struct Done<'a>(&'a Notify);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                // A permit: the helper returns even if not waiting yet.
                self.0.notify_one();
            }
        }
        let done = Notify::new();
        let rt = &self.rt;
        std::thread::scope(|s| {
            // (No helper: `f` runs alone; the permit is never taken.)
            let _ = std::thread::Builder::new()
                .name("direct-beside".into())
                .spawn_scoped(s, || rt.block_on(done.notified()));
            let _done = Done(&done);
            f()
        })
    }

    /// Whether the pipe can be read now.
    pub(super) fn pipe_ready(&self) -> bool {
        crate::spin::ready_now(&[self.pipe.get_ref().0])
    }

    /// Whether the pipe could be read when the runtime last polled its I/O
    /// (a turn's end: no system call while nothing came), checked by a
    /// poll when so and cleared when stale (the loop reads the pipe
    /// itself).
    fn pipe_seen(&self) -> bool {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match self.pipe.poll_read_ready(&mut cx) {
            std::task::Poll::Pending => false,
            // The read reports it.
            std::task::Poll::Ready(Err(_)) => true,
            std::task::Poll::Ready(Ok(mut seen)) => {
                let readable = self.pipe_ready();
                if !readable {
                    seen.clear_ready();
                }
                readable
            }
        }
    }

    /// After a turn: whether the pipe can be read or something was handed over.
    fn ready(&self) -> bool {
        self.handed() || self.pipe_seen()
    }

    /// Whether something was handed over and not yet taken.
    pub(super) fn handed(&self) -> bool {
        self.served.any_handed.load(Ordering::Acquire)
    }

    /// [`DirectLink::turn`], if [`TURN_GAP`] passed since the last turn
    /// (while a batch runs, the loop polls its GPU work between turns);
    /// else whether something was handed over.
    pub(super) fn turn_due(&self) -> bool {
        if self.last_turn.get().elapsed() < TURN_GAP {
            return self.handed();
        }
        self.turn()
    }

    /// Runs the lease's tasks that can run and the runtime's I/O once,
    /// without sleeping; whether the pipe can be read or something was
    /// handed over.
    pub(super) fn turn(&self) -> bool {
        self.rt.block_on(tokio::task::yield_now());
        self.last_turn.set(std::time::Instant::now());
        self.ready()
    }

    /// [`DirectLink::turn`]s until one says yes (true) or `budget` passed.
    pub(super) fn within(&self, budget: Duration) -> bool {
        let start = std::time::Instant::now();
        while start.elapsed() < budget {
            if self.turn() {
                return true;
            }
        }
        false
    }

    /// Runs the lease's tasks, sleeping while none can run, until the pipe
    /// can be read or something was handed over (true), or `wake` (an
    /// eventfd, whose count is taken) fired or `limit` passed (false).
    pub(super) fn sleep(&mut self, wake: Option<RawFd>, limit: Option<Duration>) -> bool {
        if let Some(fd) = wake {
            if self.wake.as_ref().map(|w| w.get_ref().0) != Some(fd) {
                let _in = self.rt.enter();
                self.wake = watch(fd).ok();
            }
        }
        let this = &*self;
        let watched = wake.and(this.wake.as_ref());
        this.rt.block_on(async {
            let until = limit.map(|l| tokio::time::Instant::now() + l);
            loop {
                if this.handed() || this.pipe_ready() {
                    return true;
                }
                let fired = async {
                    match watched {
                        Some(w) => w.readable().await.map(|mut g| {
                            crate::spin::take_count(w.get_ref().0);
                            g.clear_ready();
                        }),
                        None => std::future::pending().await,
                    }
                };
                let passed = async {
                    match until {
                        Some(t) => tokio::time::sleep_until(t).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    biased;
                    () = this.served.notify.notified() => {}
                    r = this.pipe.readable() => {
                        // Seen again by the poll above: tokio's readiness
                        // outlives the node's data, which the loop reads.
                        if let Ok(mut g) = r {
                            g.clear_ready();
                        }
                    }
                    _ = fired => return false,
                    () = passed => return false,
                }
            }
        })
    }
}

/// Budget units: KiB, so a semaphore counts any byte budget.
fn units(bytes: u64) -> u32 {
    u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX)
}

/// The lease's tasks' state.
struct Served {
    lease: LeaseId,
    ticket: [u8; DIRECT_TICKET_LEN],
    limits: DirectLimits,
    order: LeaseOrder,
    /// Modules handed to the device loop to load (or loaded).
    known: Mutex<HashSet<ModuleHash>>,
    bytes: Semaphore,
    requests: Semaphore,
    /// A fault poisoned the lease's context: later batches are refused.
    poisoned: AtomicBool,
    /// What was handed to the device loop and not yet taken, in order;
    /// `any_handed` says whether there is any, `notify` wakes a sleep.
    handed: Mutex<Vec<ToDevice>>,
    any_handed: AtomicBool,
    notify: Notify,
    /// BATCHes accepted on the path and their commands, since it opened
    /// (the node adds them to its metrics: [`DirectLink::served`]).
    batches: AtomicU64,
    commands: AtomicU64,
}

impl Served {
    fn hand(&self, work: ToDevice) {
        lock(&self.handed).push(work);
        self.any_handed.store(true, Ordering::Release);
        self.notify.notify_one();
    }

    fn frame_limits(&self) -> Limits {
        Limits {
            max_body: self.limits.max_body,
            max_data: self.limits.max_data,
        }
    }
}

async fn serve(served: Arc<Served>, endpoint: quinn::Endpoint) {
    let mut next_conn = 0usize;
    let open = Arc::new(Semaphore::new(MAX_DIRECT_CONNECTIONS));
    while let Some(incoming) = endpoint.accept().await {
        let Ok(place) = open.clone().try_acquire_owned() else {
            incoming.refuse();
            continue;
        };
        next_conn += 1;
        let served = served.clone();
        tokio::spawn(async move {
            connection(served, incoming, next_conn).await;
            drop(place);
        });
    }
}

async fn connection(served: Arc<Served>, incoming: quinn::Incoming, id: usize) {
    let opened = async {
        let conn = incoming.await.ok()?;
        let ok = hello(&served, &conn).await;
        Some((conn, ok))
    };
    let Ok(Some((conn, ok))) = tokio::time::timeout(DIRECT_HELLO_TIMEOUT, opened).await else {
        return;
    };
    if !ok {
        conn.close(1u32.into(), b"send HELLO with the lease's ticket first");
        return;
    }
    while let Ok((send, recv)) = conn.accept_bi().await {
        tokio::spawn(request(served.clone(), send, recv, id));
    }
    // Numbers that have not come on it never will.
    served.order.update(|s| s.closed(id));
}

/// Reads the connection's first stream: a HELLO with the lease's ticket.
async fn hello(served: &Served, conn: &quinn::Connection) -> bool {
    let Ok((mut send, mut recv)) = conn.accept_bi().await else {
        return false;
    };
    let small = Limits {
        max_body: 256,
        max_data: 0,
    };
    let Ok(proto::Frame {
        header: h, body, ..
    }) = proto::read_frame(&mut recv, &small).await
    else {
        return false;
    };
    let ok = h.opcode == Opcode::Hello
        && !h.is_reply()
        && from_body::<DirectHello>(&body).is_ok_and(|d| {
            d.lease == served.lease && crate::same_secret(&served.ticket, &d.ticket)
        });
    let status = if ok { Status::Ok } else { Status::Unauthorized };
    let reply = if ok {
        Vec::new()
    } else {
        to_body(&ErrorBody {
            message: "not this lease's ticket".into(),
        })
    };
    let rh = Header::reply(&h, status, reply.len() as u32, 0);
    let _ = crate::proto::write_frame(&mut send, &rh, &reply, &[]).await;
    let _ = send.finish();
    if !ok {
        // The refusal is read before the connection closes (bounded: a
        // peer that never reads it is closed on anyway).
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), send.stopped()).await;
    }
    ok
}

/// A refusal: status and message.
type Refusal = (Status, String);

fn refused(status: Status, message: impl Into<String>) -> Refusal {
    (status, message.into())
}

/// Serves one stream: one BATCH of the lease.
async fn request(
    served: Arc<Served>,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    conn: usize,
) {
    let Ok(h) = proto::read_header(&mut recv, &served.frame_limits()).await else {
        let _ = send.reset(0u32.into());
        return;
    };
    let r = run(&served, &h, &mut recv, conn).await;
    let stamps = r.as_ref().ok().and_then(|ran| ran.stamps);
    let (status, mut body, data) = match r {
        Ok(ran) => (Status::Ok, to_body(&ran.reply), ran.data),
        Err((status, message)) => (status, to_body(&ErrorBody { message }), Vec::new()),
    };
    if let Some(stamps) = stamps {
        // The last: the reply's write starts.
        for t in stamps.into_iter().chain([now_ns()]) {
            body.extend_from_slice(&t.to_le_bytes());
        }
    }
    let mut rh = Header::reply(&h, status, body.len() as u32, data.len() as u32);
    if stamps.is_some() {
        rh.flags |= FLAG_STAMPS;
    }
    if crate::proto::write_frame(&mut send, &rh, &body, &data)
        .await
        .is_ok()
    {
        let _ = send.finish();
        let _ = send.stopped().await;
    }
}

/// A batch that ran: its reply, its reads' data and, if the client asked
/// ([`FLAG_STAMPS`]), its stamps but the last (taken as the reply's write starts).
struct Ran {
    reply: BatchReply,
    data: Vec<u8>,
    stamps: Option<[u64; DIRECT_STAMPS - 1]>,
}

async fn run(
    served: &Served,
    h: &Header,
    recv: &mut quinn::RecvStream,
    conn: usize,
) -> Result<Ran, Refusal> {
    if h.opcode != Opcode::Batch || h.is_reply() {
        return Err(refused(
            Status::BadRequest,
            format!(
                "a lease's direct connection takes BATCH only, not {:?}",
                h.opcode
            ),
        ));
    }
    let Ok(_request) = served.requests.try_acquire() else {
        return Err(refused(
            Status::CapacityExceeded,
            format!(
                "{} requests of the lease are in flight, its limit",
                served.limits.max_requests
            ),
        ));
    };
    let over = |what: u64| {
        refused(
            Status::CapacityExceeded,
            format!(
                "{what} more bytes would pass the lease's {} in flight on its direct path",
                served.limits.max_bytes
            ),
        )
    };
    let declared = u64::from(h.body_len) + u64::from(h.data_len);
    let Ok(_held) = served.bytes.try_acquire_many(units(declared)) else {
        return Err(over(declared));
    };
    let mut body = vec![0u8; h.body_len as usize];
    let mut data = vec![0u8; h.data_len as usize];
    let read = async {
        recv.read_exact(&mut body).await?;
        recv.read_exact(&mut data).await
    };
    read.await
        .map_err(|e| refused(Status::BadRequest, format!("request cut short: {e}")))?;
    cuda_lease::transport::read_end_if_here(recv);
    let read_at = (h.flags & FLAG_STAMPS != 0).then(now_ns);
    let (head, wire) = BatchHead::decode(&body).map_err(bad)?;
    head.validate(data.len()).map_err(bad)?;
    let commands = proto::command_count(wire).map_err(bad)?;
    if head.lease == served.lease {
        served.batches.fetch_add(1, Ordering::Relaxed);
        served.commands.fetch_add(commands, Ordering::Relaxed);
    }
    if head.lease != served.lease {
        return Err(refused(
            Status::BadRequest,
            format!(
                "this connection serves lease {}, not {}",
                served.lease, head.lease
            ),
        ));
    }
    if served.poisoned.load(Ordering::Acquire) {
        return Err(refused(
            Status::LeasePoisoned,
            "lease poisoned: a fault ended its context",
        ));
    }
    let reply_bytes = head.reply_bytes.min(u64::from(served.limits.max_data));
    let Ok(_reply) = served.bytes.try_acquire_many(units(reply_bytes)) else {
        return Err(over(reply_bytes));
    };
    let seq = head.seq;
    if seq == u64::MAX {
        return Err(refused(
            Status::BadRequest,
            format!("batch number {seq} has no successor: numbers wrap"),
        ));
    }
    let mut place = None;
    if seq != 0 {
        let (arrival, p) = served.order.arrive(seq, conn);
        if arrival == Arrival::Passed {
            if commands == 0 && head.modules.is_empty() {
                return Ok(Ran {
                    reply: BatchReply::default(),
                    data: Vec::new(),
                    stamps: None,
                });
            }
            return Err(refused(
                Status::BadRequest,
                format!("batch number {seq} of the lease has run already, or is here"),
            ));
        }
        place = Some(p);
    }
    // Its modules are settled in its turn: the ones before it may load some.
    if let Some(p) = place.as_mut() {
        p.turn().await.map_err(stalled)?;
    }
    let Settled {
        loads,
        sources,
        writes,
    } = match modules(served, &head, &data) {
        Ok(m) => m,
        Err(r) => {
            if let (Some(p), Status::UnknownModule) = (place.take(), r.0) {
                // Sent again with its sources, the batch keeps its place.
                p.withdraw();
            }
            return Err(r);
        }
    };
    let limits = BatchLimits {
        reserved: served.limits.reserved,
        max_ids: served.limits.max_ids,
        max_streams: served.limits.max_streams,
        max_read: u64::from(served.limits.max_data),
        reply_bytes,
    };
    let hashes: Vec<ModuleHash> = head.modules.iter().map(|m| m.hash).collect();
    let mut worker_body = Vec::with_capacity(wire.len() + 64);
    encode_worker_batch(&mut worker_body, &loads, &limits, &hashes, wire);
    let mut worker_data =
        Vec::with_capacity(sources.iter().map(|s| s.len()).sum::<usize>() + writes.len());
    for s in &sources {
        worker_data.extend_from_slice(s);
    }
    worker_data.extend_from_slice(writes);
    drop(data);
    let (tx, rx) = oneshot::channel();
    served.hand(ToDevice::Batch {
        body: worker_body,
        data: worker_data,
        answer: tx,
        stamps: read_at.is_some(),
    });
    let handed_at = read_at.map(|_| now_ns());
    // Handed over: the device loop plans in this order.
    drop(place);
    let answer = rx
        .await
        .map_err(|_| refused(Status::Internal, "the worker's device loop is gone"))?;
    if answer.status != Status::Ok {
        forget(served, &loads);
        let message = from_body::<DeviceError>(&answer.body)
            .map(|e| e.message)
            .unwrap_or_default();
        return Err((answer.status, message));
    }
    let reply: WorkerBatchReply = from_body(&answer.body)
        .map_err(|e| refused(Status::Internal, format!("worker reply: {e}")))?;
    let loaded = (reply.loaded as usize).min(loads.len());
    forget(served, &loads[loaded..]);
    if reply.sticky && reply.error.is_some() {
        served.poisoned.store(true, Ordering::Release);
    }
    let stamps = read_at.zip(handed_at).map(|(read, handed)| {
        let [w0, w1, w2, w3, w4, w5] = reply.stamps.unwrap_or_default();
        [read, handed, w0, w1, w2, w3, w4, w5]
    });
    Ok(Ran {
        reply: BatchReply {
            completed: reply.completed,
            error: reply.error,
        },
        data: answer.data,
        stamps,
    })
}

fn bad(e: impl std::fmt::Display) -> Refusal {
    refused(Status::BadRequest, e.to_string())
}

fn stalled(e: Stalled) -> Refusal {
    match e {
        Stalled::Ended => refused(Status::LeaseNotFound, "the lease ended"),
        Stalled::Disconnected { missing } => refused(
            Status::BadRequest,
            format!(
                "batch {missing} of the lease never came: the connection that carried \
                 the lease's batches closed"
            ),
        ),
    }
}

/// Modules the device loop did not load are not the lease's.
fn forget(served: &Served, loads: &[WorkerLoad]) {
    let mut known = lock(&served.known);
    for l in loads {
        known.remove(&l.hash);
    }
}

/// A batch's modules to load, their sources, and its writes' data.
struct Settled<'d> {
    loads: Vec<WorkerLoad>,
    sources: Vec<&'d [u8]>,
    writes: &'d [u8],
}

/// The modules of `head` the lease lacks (marked known: later batches
/// skip them), their sources (hash-checked), and the writes' data.
fn modules<'d>(served: &Served, head: &BatchHead, data: &'d [u8]) -> Result<Settled<'d>, Refusal> {
    let (given, rest) = head.sources(data).map_err(bad)?;
    let mut loads = Vec::new();
    let mut sources = Vec::new();
    let mut known = lock(&served.known);
    for (m, given) in head.modules.iter().zip(given) {
        // (A batch names a module once: `BatchHead::validate`.)
        if known.contains(&m.hash) {
            continue;
        }
        let Some((kind, text)) = given else {
            return Err(refused(
                Status::UnknownModule,
                format!(
                    "module {} is not loaded in the lease: send the batch again with its source",
                    m.hash
                ),
            ));
        };
        loads.push(WorkerLoad {
            hash: m.hash,
            kind: kind.clone(),
            len: text.len() as u32,
        });
        sources.push(text.as_bytes());
    }
    for l in &loads {
        known.insert(l.hash);
    }
    Ok(Settled {
        loads,
        sources,
        writes: rest,
    })
}
