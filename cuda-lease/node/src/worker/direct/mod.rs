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
//! at once; their bodies, data and reply bytes, until the reply is
//! written, are charged to the principal's budget (shared with the node
//! and the principal's other leases' workers, [`crate::budget`]); a
//! request past either is refused on its header, before its data is read. At most [`MAX_DIRECT_CONNECTIONS`] connections at once, each
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

use crate::budget::{SeatHandle, WorkerBudget};
use crate::lock;
use crate::order::LeaseOrder;
use crate::proto::{Header, LeaseId, Status, DIRECT_TICKET_LEN};
use crate::transport::TransportSettings;

mod serve;

use serve::{serve, Served};

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
    /// The lease's seat in its principal's budget, which its requests'
    /// bytes are charged to (up to `limits.max_bytes`).
    pub(crate) budget: SeatHandle,
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
    /// CUDA C modules the worker compiled for them.
    pub(crate) compiled: u64,
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
    /// bytes held at once by all the principal's requests (the node's and
    /// its direct leases' workers').
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
            compiled: self.served.compiled.load(Ordering::Relaxed),
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
            budget: Arc::new(WorkerBudget::open(&o.budget, limits.max_bytes)?),
            requests: Semaphore::new(limits.max_requests as usize),
            poisoned: AtomicBool::new(false),
            handed: Mutex::new(Vec::new()),
            any_handed: AtomicBool::new(false),
            notify: Notify::new(),
            batches: AtomicU64::new(0),
            commands: AtomicU64::new(0),
            compiled: AtomicU64::new(0),
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
