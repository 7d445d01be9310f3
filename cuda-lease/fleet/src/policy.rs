//! One `cuda-async` policy over leases on several nodes of a fleet
//! ([`FleetPolicy`]).
//!
//! Each [`select`](SchedulingPolicy::select) makes a *placement*: a session
//! of its own that records without a node and picks one when its submission
//! is sent, or earlier when an op uses an earlier submission's buffer. Ids
//! are the policy's, unique over all its leases, so a recording is valid on
//! any of them until placed.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use cuda_async::{ExecutionContext, RemoteErrorExt, RemoteSession, SchedulingPolicy};
use tokio::sync::Notify;
use tracing::{debug, info, warn};

use super::placement::{fresh_first, rank};
use super::{lock, Fleet, FleetError, NodeRecord};
use cuda_lease::client::{Disconnect, Error, ErrorKind, Lease};
use cuda_lease::remote::LeaseBackend;
use submission::Placement;

/// A fleet policy's first id: far above a lease session's own (counted from
/// 1), so the two never meet on a node.
const FIRST_ID: u64 = 1 << 62;

mod submission;

/// How a [`FleetPolicy`] leases and places.
#[derive(Debug, Clone)]
pub struct FleetPolicyConfig {
    /// Leases held when the fleet has room, on distinct nodes while there are
    /// enough; dead ones are replaced to keep this many (default 2).
    pub leases: usize,
    /// Most leases: one more is taken when every lease has
    /// [`FleetPolicyConfig::grow_at`] submissions in flight (default: `leases`).
    pub max_leases: usize,
    /// Submissions in flight on every lease at which the policy grows (default 8).
    pub grow_at: usize,
    /// VRAM of each lease (default 256 MiB).
    pub vram: u64,
    /// TTL of each lease (renewed in the background; default 60 s).
    pub ttl: Duration,
    /// Streams per lease that submissions and concurrent arms spread over (default 4).
    pub streams: u32,
    /// Longest a submission waits for a lease when the policy has none
    /// alive (then it fails with the capacity kind; default 30 s).
    pub wait: Duration,
    /// How often a submission that failed with its node (disconnected or
    /// lease kinds) runs again on another lease, if it uses no earlier
    /// submission's buffer (default 0: never). With retry on, each such
    /// submission keeps a copy of its upload bytes until it completes.
    pub retry: u32,
}

impl Default for FleetPolicyConfig {
    fn default() -> Self {
        Self {
            leases: 2,
            max_leases: 2,
            grow_at: 8,
            vram: 256 << 20,
            ttl: Duration::from_secs(60),
            streams: 4,
            wait: Duration::from_secs(30),
            retry: 0,
        }
    }
}

/// What a [`FleetPolicy`] did per node ([`FleetPolicy::stats`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeStats {
    /// The node.
    pub node: String,
    /// Submissions that completed there.
    pub completed: u64,
    /// Submissions that failed there.
    pub failed: u64,
    /// Whether the policy holds a live lease there now.
    pub live: bool,
}

/// A `cuda-async` scheduling policy over leases on several nodes of a
/// [`Fleet`]: each submission (with all its concurrent arms) runs on one
/// lease, the live one with the least work in flight, or the one holding
/// a buffer it uses. `schedule`, `.await` and `sync_with` work as with a
/// `RemotePolicy`.
///
/// When a node dies (its record leaves the registry, or a submission fails
/// with the disconnected or lease kinds), its lease is replaced on another
/// node and its work in flight fails (or runs elsewhere, per
/// [`FleetPolicyConfig::retry`]); a submission using a buffer there fails
/// naming the node and buffers. With no live lease, submissions wait (at
/// most [`FleetPolicyConfig::wait`]).
///
/// ```no_run
/// # async fn demo(fleet: cuda_lease_fleet::Fleet) -> Result<(), Box<dyn std::error::Error>> {
/// use cuda_async::prelude::*;
/// use cuda_lease_fleet::{FleetPolicy, FleetPolicyConfig};
///
/// let cfg = FleetPolicyConfig { leases: 3, retry: 1, ..FleetPolicyConfig::default() };
/// let policy = FleetPolicy::new(&fleet, cfg).await?;
/// let out = h2d(vec![1u32; 256]).then(d2h).schedule(&policy)?.await?;
/// assert_eq!(out.to_vec()?, vec![1u32; 256]);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct FleetPolicy {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    fleet: Fleet,
    cfg: FleetPolicyConfig,
    runtime: tokio::runtime::Handle,
    members: Mutex<Vec<Arc<Member>>>,
    /// Nodes (name, address) whose lease was buried: placed after every
    /// other node until a lease there is held again.
    lost_nodes: Mutex<Vec<(String, std::net::SocketAddr)>>,
    stats: Mutex<Vec<NodeStats>>,
    /// A lease was added (waiting submissions look again).
    added: Notify,
    /// Wakes the supervisor (a death, a reason to grow, the policy's end);
    /// shared with it, as it holds the policy only weakly.
    wake: Arc<Notify>,
    grow: AtomicBool,
    next_id: AtomicU64,
    next_stream: AtomicUsize,
    retries: AtomicU64,
    first_retry_done: Mutex<Option<std::time::Instant>>,
    closed: AtomicBool,
}

/// One lease of the policy.
#[derive(Debug)]
struct Member {
    node: NodeRecord,
    lease: Mutex<Option<Lease>>,
    session: Arc<LeaseBackend>,
    in_flight: AtomicUsize,
    /// Submissions given to it in all.
    given: AtomicU64,
    dead: AtomicBool,
    /// Since when its node, out of the registry, has let every query go
    /// unanswered (`None`: listed, or it answered the latest).
    silent_since: Mutex<Option<std::time::Instant>>,
}

/// How long one query of a node that left the registry is waited for.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// How long a node out of the registry may leave every query unanswered
/// (two at least) before its lease goes: a live node that is slow for a
/// moment (a loaded host while etcd is away) keeps it, and gets no new
/// work meanwhile.
const SILENCE_MAX: Duration = Duration::from_secs(3);

/// What a node that left the registry said to a query of its lease.
enum Probe {
    Answered,
    /// An error: the lease or the connection is gone.
    Refused,
    /// Nothing within [`PROBE_TIMEOUT`].
    Silent,
}

impl Member {
    fn is_live(&self) -> bool {
        !self.dead.load(Ordering::Acquire)
    }

    /// The disconnected kind, naming this lease's node: "node NAME `what`".
    fn gone(&self, what: std::fmt::Arguments<'_>) -> cuda_async::Error {
        let message = format!("node {} {what}", self.node.name);
        let e = Error::new(ErrorKind::Disconnected(Disconnect::Network), message);
        cuda_async::Error::from_remote(e.with_node(self.node.address))
    }

    /// Queries the lease's node, waiting at most [`PROBE_TIMEOUT`].
    async fn probe(&self) -> Probe {
        let lease = lock(&self.lease)
            .as_ref()
            .map(|l| (l.client().clone(), l.id()));
        let Some((client, id)) = lease else {
            return Probe::Refused;
        };
        match tokio::time::timeout(PROBE_TIMEOUT, client.query_lease(id)).await {
            Ok(Ok(_)) => Probe::Answered,
            Ok(Err(_)) => Probe::Refused,
            Err(_) => Probe::Silent,
        }
    }

    /// Whether its node has let a query go unanswered since it last answered.
    fn is_silent(&self) -> bool {
        lock(&self.silent_since).is_some()
    }
}

impl FleetPolicy {
    /// Leases [`FleetPolicyConfig::leases`] leases and starts looking after
    /// them. Must be called inside a tokio runtime, whose tasks do the I/O.
    ///
    /// # Errors
    ///
    /// The fleet's error when not a single lease could be placed.
    pub async fn new(fleet: &Fleet, cfg: FleetPolicyConfig) -> Result<FleetPolicy, FleetError> {
        let cfg = FleetPolicyConfig {
            leases: cfg.leases.max(1),
            max_leases: cfg.max_leases.max(cfg.leases.max(1)),
            grow_at: cfg.grow_at.max(1),
            streams: cfg.streams.max(1),
            ..cfg
        };
        let shared = Arc::new(Shared {
            fleet: fleet.clone(),
            cfg,
            runtime: tokio::runtime::Handle::current(),
            members: Mutex::new(Vec::new()),
            lost_nodes: Mutex::new(Vec::new()),
            stats: Mutex::new(Vec::new()),
            added: Notify::new(),
            wake: Arc::new(Notify::new()),
            grow: AtomicBool::new(false),
            next_id: AtomicU64::new(FIRST_ID),
            next_stream: AtomicUsize::new(0),
            retries: AtomicU64::new(0),
            first_retry_done: Mutex::new(None),
            closed: AtomicBool::new(false),
        });
        let mut first_error = None;
        for _ in 0..shared.cfg.leases {
            if let Err(e) = shared.add_member().await {
                first_error.get_or_insert(e);
                break;
            }
        }
        if shared.live().is_empty() {
            return Err(first_error.unwrap_or(FleetError::NoNodeFits {
                min_vram: shared.cfg.vram,
                registered: fleet.nodes().len(),
            }));
        }
        tokio::spawn(supervise(
            Arc::downgrade(&shared),
            shared.wake.clone(),
            fleet.clone(),
        ));
        Ok(FleetPolicy { shared })
    }

    /// The nodes the policy holds live leases on.
    pub fn nodes(&self) -> Vec<String> {
        self.shared
            .live()
            .iter()
            .map(|m| m.node.name.clone())
            .collect()
    }

    /// What ran where: one entry per node the policy ever leased on.
    pub fn stats(&self) -> Vec<NodeStats> {
        let live = self.nodes();
        let mut s = lock(&self.shared.stats).clone();
        for n in &mut s {
            n.live = live.contains(&n.node);
        }
        s
    }

    /// Submissions run again on another lease after their node failed.
    pub fn retries(&self) -> u64 {
        self.shared.retries.load(Ordering::Relaxed)
    }

    /// When the first retried submission completed (`None` until one did).
    pub fn first_retry_done(&self) -> Option<std::time::Instant> {
        *lock(&self.shared.first_retry_done)
    }

    /// Frees every lease; submissions made afterwards fail.
    pub async fn close(&self) {
        self.shared.closed.store(true, Ordering::Release);
        self.shared.wake.notify_one();
        let members: Vec<_> = std::mem::take(&mut *lock(&self.shared.members));
        for m in members {
            m.dead.store(true, Ordering::Release);
            let lease = lock(&m.lease).take();
            if let Some(l) = lease {
                let _ = l.free().await;
            }
        }
    }
}

impl SchedulingPolicy for FleetPolicy {
    fn select(&self) -> cuda_async::Result<ExecutionContext> {
        let slot: Arc<dyn RemoteSession> = Arc::new(Placement::new(self.shared.clone()));
        let streams = self.shared.cfg.streams;
        let stream =
            (self.shared.next_stream.fetch_add(1, Ordering::Relaxed) % streams as usize) as u32;
        Ok(ExecutionContext::remote(slot, stream, streams))
    }
}

impl Shared {
    fn live(&self) -> Vec<Arc<Member>> {
        lock(&self.members)
            .iter()
            .filter(|m| m.is_live())
            .cloned()
            .collect()
    }

    fn count(&self, node: &str, ok: bool) {
        let mut s = lock(&self.stats);
        let i = match s.iter().position(|n| n.node == node) {
            Some(i) => i,
            None => {
                s.push(NodeStats {
                    node: node.to_string(),
                    ..NodeStats::default()
                });
                s.len() - 1
            }
        };
        if ok {
            s[i].completed += 1;
        } else {
            s[i].failed += 1;
        }
    }

    /// The live lease to place on: among those with at most four rounds of
    /// streams more in flight than the least loaded, the one given the least
    /// so far (equal nodes share evenly; one further behind gets nothing until
    /// it catches up). Asks the supervisor to grow when it has `grow_at` in
    /// flight.
    fn least_loaded(&self) -> Option<Arc<Member>> {
        let members = lock(&self.members);
        // A lease whose node is silent gets work only when every one is.
        let heard = members.iter().any(|m| m.is_live() && !m.is_silent());
        let live = members
            .iter()
            .filter(|m| m.is_live() && !(heard && m.is_silent()));
        let least = live
            .clone()
            .map(|m| m.in_flight.load(Ordering::Relaxed))
            .min();
        let window = least.unwrap_or(0) + 4 * self.cfg.streams as usize;
        let best = live
            .filter(|m| m.in_flight.load(Ordering::Relaxed) <= window)
            .min_by_key(|m| m.given.load(Ordering::Relaxed))
            .cloned();
        if let Some(b) = &best {
            if b.in_flight.load(Ordering::Relaxed) >= self.cfg.grow_at
                && members.len() < self.cfg.max_leases
                && !self.grow.swap(true, Ordering::AcqRel)
            {
                self.wake.notify_one();
            }
        }
        best
    }

    /// Leases once more, preferring a node the policy does not use yet, and
    /// trying a node whose lease it lost last ([`fresh_first`]).
    async fn add_member(&self) -> Result<(), FleetError> {
        let used: Vec<String> = self.live().iter().map(|m| m.node.name.clone()).collect();
        let lost = lock(&self.lost_nodes).clone();
        let builder = Lease::builder().min_vram(self.cfg.vram).ttl(self.cfg.ttl);
        let lease = self
            .fleet
            .lease_placed(builder, |nodes, need| {
                fresh_first(rank(nodes, need), &used, &lost)
            })
            .await?;
        let addr = lease.client().addr();
        let node = self
            .fleet
            .nodes()
            .into_iter()
            .find(|n| n.address == addr)
            .ok_or_else(|| FleetError::Config(format!("the node at {addr} left the registry")))?;
        lock(&self.lost_nodes).retain(|(name, at)| *name != node.name || *at != node.address);
        let session = LeaseBackend::new(lease.session(), self.runtime.clone());
        info!(node = %node.name, lease = %lease.id(), "fleet policy: leased");
        lock(&self.members).push(Arc::new(Member {
            node,
            lease: Mutex::new(Some(lease)),
            session,
            in_flight: AtomicUsize::new(0),
            given: AtomicU64::new(0),
            dead: AtomicBool::new(false),
            silent_since: Mutex::new(None),
        }));
        self.added.notify_waiters();
        Ok(())
    }

    /// Marks `m` dead (no new work; the supervisor replaces it) and closes its
    /// connection, so its work in flight fails now, not at the network's timeout.
    fn bury(&self, m: &Member, why: &str) {
        if m.dead.swap(true, Ordering::AcqRel) {
            return;
        }
        warn!(node = %m.node.name, why, "fleet policy: lease lost; replacing it");
        {
            let mut lost = lock(&self.lost_nodes);
            let node = (m.node.name.clone(), m.node.address);
            if !lost.contains(&node) {
                lost.push(node);
            }
        }
        if let Some(l) = lock(&m.lease).as_ref() {
            l.client().close();
        }
        self.wake.notify_one();
    }

    /// One supervisor round; whether to look again soon (a wanted lease
    /// could not be had, or a node that left the registry still answers or
    /// has not been silent long).
    async fn tend(&self) -> bool {
        // A node that left the registry is asked directly: a dead one does
        // not answer (else its work in flight waits for the network's
        // timeout); a live one does (etcd lost its data, say, or it is
        // shutting down) and is asked again soon, until listed again or
        // gone. One that refuses (its lease or connection is gone) is
        // buried now; one that stays silent, once every query it was sent
        // over `SILENCE_MAX` went unanswered.
        let registered = self.fleet.nodes();
        // A lost node the registry no longer lists needs no place in the
        // order: the list stays as long as the registry at most.
        lock(&self.lost_nodes).retain(|(name, at)| {
            registered
                .iter()
                .any(|n| n.name == *name && n.address == *at)
        });
        let mut look_again = false;
        for m in self.live() {
            let listed = registered
                .iter()
                .any(|n| n.name == m.node.name && n.address == m.node.address);
            if listed {
                *lock(&m.silent_since) = None;
                continue;
            }
            match m.probe().await {
                Probe::Answered => {
                    *lock(&m.silent_since) = None;
                    look_again = true;
                }
                Probe::Refused => self.bury(&m, "its node left the registry and refuses queries"),
                Probe::Silent => {
                    let now = std::time::Instant::now();
                    let since = *lock(&m.silent_since).get_or_insert(now);
                    if now.duration_since(since) >= SILENCE_MAX {
                        self.bury(&m, "its node left the registry and does not answer");
                    } else {
                        look_again = true;
                    }
                }
            }
        }
        // Dead leases are leaked: their node's TTL ends them there.
        let dead: Vec<Arc<Member>> = {
            let mut members = lock(&self.members);
            let (dead, live): (Vec<_>, Vec<_>) = members.drain(..).partition(|m| !m.is_live());
            *members = live;
            dead
        };
        for m in dead {
            let lease = lock(&m.lease).take();
            if let Some(l) = lease {
                l.leak();
            }
        }
        let want = if self.grow.swap(false, Ordering::AcqRel) {
            (self.live().len() + 1).min(self.cfg.max_leases)
        } else {
            self.cfg.leases
        };
        while self.live().len() < want {
            if let Err(e) = self.add_member().await {
                debug!(error = %e, "fleet policy: no lease to add now");
                return true;
            }
        }
        look_again
    }
}

/// Whether `e` says the node or lease that ran the work is gone
/// (disconnected; lease expired, freed, not found or poisoned), not the
/// work's own fault: the work may run again on another lease.
pub fn lost(e: &cuda_async::Error) -> bool {
    e.remote().is_some_and(Error::lease_gone)
}

/// The error of work in flight on a node the policy gave up: the
/// disconnected kind naming the node, whatever the session saw.
fn node_lost(m: &Member, e: cuda_async::Error) -> cuda_async::Error {
    match e.remote_kind() {
        Some(ErrorKind::Disconnected(_)) => e,
        _ => m.gone(format_args!("was lost with this submission in flight: {e}")),
    }
}

/// Keeps the policy's leases: buries those of nodes that left the registry,
/// drops dead ones and replaces them (or grows on demand) up to the
/// configured count. Holds the policy weakly and ends with it.
async fn supervise(shared: Weak<Shared>, wake: Arc<Notify>, fleet: Fleet) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let soon = {
            let Some(s) = shared.upgrade() else { return };
            if s.closed.load(Ordering::Acquire) {
                return;
            }
            s.tend().await
        };
        let before = fleet.nodes();
        let changed = fleet.wait_until(Duration::from_secs(3600), |n| n != before.as_slice());
        // Again soon (after `backoff`, doubling), or as soon as something changes.
        tokio::select! {
            _ = tokio::time::sleep(backoff), if soon => {}
            _ = wake.notified() => {}
            _ = changed => {}
        }
        backoff = if soon {
            (backoff * 2).min(Duration::from_secs(2))
        } else {
            Duration::from_millis(100)
        };
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The supervisor ends on its next look.
        self.wake.notify_one();
    }
}
