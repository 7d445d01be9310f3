//! Bounds on unauthenticated connections, which cost a TLS session, a task
//! and, per HELLO, a token comparison (and a log line on failure). Limits:
//! `NodeConfig`'s `hello_timeout`, `max_unauthenticated*`,
//! `max_queued_handshakes*` and `max_failed_hellos_per_source`.
//!
//! * the TLS handshake counts against `hello_timeout`, which runs from when
//!   a HELLO place is taken; the queue for places is first come, first
//!   served, before the TLS handshake;
//! * a failed HELLO closes its connection after the reply; past the
//!   failed-HELLO rate, HELLO gets UNAUTHORIZED without a token check;
//! * failed HELLOs are logged at most once per [`REJECTED_LOG_INTERVAL`],
//!   with the count skipped since.
//!
//! A source is an IPv4 address or an IPv6 /64.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::warn;

use super::bucket::TokenBucket;

use crate::lease_table::Principal;
use crate::lock;

/// The shortest time between two log lines about rejected credentials.
pub const REJECTED_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Close code for a connection without a principal (no or failed HELLO).
pub(super) const CLOSE_UNAUTHENTICATED: u32 = 0x401;

/// Most sources with failed HELLOs remembered; past it full ones are forgotten.
const MAX_TRACKED_SOURCES: usize = 4096;

/// A source address as the limits count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Source(IpAddr);

impl Source {
    pub(super) fn of(ip: IpAddr) -> Self {
        match ip.to_canonical() {
            // Its /64.
            IpAddr::V6(v6) => {
                Source(Ipv6Addr::from_bits(v6.to_bits() & !(u64::MAX as u128)).into())
            }
            v4 => Source(v4),
        }
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            IpAddr::V6(v6) => write!(f, "{v6}/64"),
            v4 => write!(f, "{v4}"),
        }
    }
}

/// The limits, copied from the node's configuration.
#[derive(Debug, Clone, Copy)]
pub(super) struct HandshakeLimits {
    pub(super) max_unauthenticated: usize,
    pub(super) max_unauthenticated_per_source: usize,
    pub(super) max_queued: usize,
    pub(super) max_queued_per_source: usize,
    pub(super) max_failed_hellos_per_source: u32,
}

/// HELLO places, handshake queue, failed-HELLO allowances and log limiter.
#[derive(Debug)]
pub(super) struct Handshakes {
    limits: HandshakeLimits,
    /// Node-wide HELLO places (taken after the source's).
    places: Arc<Semaphore>,
    waiting: Mutex<Waiting>,
    failed: Mutex<HashMap<Source, TokenBucket>>,
    log: Mutex<RejectedLog>,
}

#[derive(Debug, Default)]
struct Waiting {
    sources: HashMap<Source, SourceWaiting>,
    /// Connections in the handshake queue, node-wide.
    queued: usize,
}

/// One source's connections waiting for HELLO or queued for a place.
#[derive(Debug)]
struct SourceWaiting {
    places: Arc<Semaphore>,
    /// Places held and connections queued: the entry goes at zero.
    users: usize,
    queued: usize,
}

#[derive(Debug, Default)]
struct RejectedLog {
    last: Option<Instant>,
    suppressed: u64,
}

impl RejectedLog {
    /// The rejections skipped since the last line, if a line is due now
    /// (the interval passed); the count starts again.
    fn take_due(&mut self, now: Instant) -> Option<u64> {
        let due = self
            .last
            .is_none_or(|t| now.saturating_duration_since(t) >= REJECTED_LOG_INTERVAL);
        due.then(|| {
            self.last = Some(now);
            std::mem::take(&mut self.suppressed)
        })
    }
}

/// What a new connection gets: a place, a queue slot, or `Busy` (refuse it).
pub(super) enum Admission {
    Now(WaitingPlace),
    Queued(QueuedHandshake),
    Busy,
}

impl Handshakes {
    pub(super) fn new(limits: HandshakeLimits) -> Arc<Self> {
        Arc::new(Self {
            places: Arc::new(Semaphore::new(limits.max_unauthenticated)),
            limits,
            waiting: Mutex::default(),
            failed: Mutex::default(),
            log: Mutex::default(),
        })
    }

    /// A HELLO place for `source`, else a queue slot, else `Busy` (queue full).
    pub(super) fn wait(self: &Arc<Self>, source: Source) -> Admission {
        let mut w = lock(&self.waiting);
        let Waiting { sources, queued } = &mut *w;
        let per_source = self.limits.max_unauthenticated_per_source;
        let s = sources.entry(source).or_insert_with(|| SourceWaiting {
            places: Arc::new(Semaphore::new(per_source)),
            users: 0,
            queued: 0,
        });
        // A released permit goes to a queued connection before a later one.
        if let Ok(mine) = s.places.clone().try_acquire_owned() {
            if let Ok(node) = self.places.clone().try_acquire_owned() {
                s.users += 1;
                return Admission::Now(WaitingPlace {
                    handshakes: self.clone(),
                    source,
                    _permits: (mine, node),
                });
            }
        }
        if *queued >= self.limits.max_queued || s.queued >= self.limits.max_queued_per_source {
            if s.users == 0 {
                sources.remove(&source);
            }
            return Admission::Busy;
        }
        s.users += 1;
        s.queued += 1;
        *queued += 1;
        Admission::Queued(QueuedHandshake {
            handshakes: self.clone(),
            source,
            places: s.places.clone(),
            dequeued: false,
        })
    }

    /// Connections holding a place among those waiting for HELLO now.
    pub(super) fn waiting(&self) -> usize {
        self.limits.max_unauthenticated - self.places.available_permits()
    }

    /// Counts off one user of `source`'s entry (and one queued, if `queued`).
    fn leave(&self, source: Source, queued: bool) {
        let mut w = lock(&self.waiting);
        if queued {
            w.queued -= 1;
        }
        if let Some(s) = w.sources.get_mut(&source) {
            s.users -= 1;
            if queued {
                s.queued -= 1;
            }
            if s.users == 0 {
                w.sources.remove(&source);
            }
        }
    }

    /// Takes one failed HELLO of `source`'s allowance before a token check
    /// (given back by [`Handshakes::authenticated`]); false: do not check.
    pub(super) fn take_check(&self, source: Source) -> bool {
        let now = Instant::now();
        let rate = f64::from(self.limits.max_failed_hellos_per_source);
        let mut m = lock(&self.failed);
        if m.len() >= MAX_TRACKED_SOURCES && !m.contains_key(&source) {
            m.retain(|_, a| !a.is_full(rate, rate, now));
        }
        m.entry(source)
            .or_insert(TokenBucket::full(rate, now))
            .take(rate, rate, now)
            .is_ok()
    }

    /// Gives back what [`Handshakes::take_check`] took: the HELLO was good.
    pub(super) fn authenticated(&self, source: Source) {
        let rate = f64::from(self.limits.max_failed_hellos_per_source);
        if let Some(a) = lock(&self.failed).get_mut(&source) {
            a.give_back(rate, rate, Instant::now());
        }
    }

    /// Logs a rejected HELLO (`checked`: wrong token; else over the
    /// source's allowance), at most once per [`REJECTED_LOG_INTERVAL`].
    pub(super) fn rejected(&self, client: &str, remote: std::net::SocketAddr, checked: bool) {
        let mut log = lock(&self.log);
        let Some(suppressed) = log.take_due(Instant::now()) else {
            log.suppressed += 1;
            return;
        };
        drop(log);
        let why = if checked {
            "invalid token"
        } else {
            "too many failed HELLOs from its address: token not checked"
        };
        warn!(%client, %remote, why, suppressed, "rejected credentials");
    }

    /// Logs the count of skipped rejections once the interval passed (reaper).
    pub(super) fn flush_log(&self) {
        let due = {
            let mut log = lock(&self.log);
            (log.suppressed > 0)
                .then(|| log.take_due(Instant::now()))
                .flatten()
        };
        let Some(suppressed) = due else { return };
        warn!(
            suppressed,
            "rejected credentials: {suppressed} more HELLOs since the last line"
        );
    }
}

/// A connection's HELLO place; given back on drop.
#[derive(Debug)]
pub(super) struct WaitingPlace {
    handshakes: Arc<Handshakes>,
    source: Source,
    /// The source's place and the node's (released after `drop`).
    _permits: (OwnedSemaphorePermit, OwnedSemaphorePermit),
}

impl Drop for WaitingPlace {
    fn drop(&mut self) {
        self.handshakes.leave(self.source, false);
    }
}

/// A connection's slot in the handshake queue; left on drop.
#[derive(Debug)]
pub(super) struct QueuedHandshake {
    handshakes: Arc<Handshakes>,
    source: Source,
    places: Arc<Semaphore>,
    /// It left the queue for a place.
    dequeued: bool,
}

impl QueuedHandshake {
    /// Waits until `deadline` for a HELLO place (source's, then node's).
    pub(super) async fn place(mut self, deadline: tokio::time::Instant) -> Option<WaitingPlace> {
        let take = async {
            let mine = self.places.clone().acquire_owned().await.ok()?;
            let node = self.handshakes.places.clone().acquire_owned().await.ok()?;
            Some((mine, node))
        };
        let permits = tokio::time::timeout_at(deadline, take)
            .await
            .ok()
            .flatten()?;
        // The place becomes a user of the source's entry before this
        // handle stops being one.
        {
            let mut w = lock(&self.handshakes.waiting);
            w.queued -= 1;
            if let Some(s) = w.sources.get_mut(&self.source) {
                s.queued -= 1;
                s.users += 1;
            }
        }
        self.dequeued = true;
        Some(WaitingPlace {
            handshakes: self.handshakes.clone(),
            source: self.source,
            _permits: permits,
        })
    }
}

impl Drop for QueuedHandshake {
    fn drop(&mut self) {
        self.handshakes.leave(self.source, !self.dequeued);
    }
}

/// A connection and its principal (set once, by client certificate or HELLO).
#[derive(Debug)]
pub(crate) struct Peer {
    principal: OnceLock<Principal>,
    pub(super) source: Source,
    conn: quinn::Connection,
    waiting: Mutex<Option<WaitingPlace>>,
}

impl Peer {
    pub(super) fn new(conn: quinn::Connection, place: WaitingPlace) -> Self {
        Peer {
            principal: OnceLock::new(),
            source: place.source,
            conn,
            waiting: Mutex::new(Some(place)),
        }
    }

    pub(super) fn get(&self) -> Option<&Principal> {
        self.principal.get()
    }

    /// Sets the principal (the first stays) and gives back the HELLO place.
    pub(super) fn authenticate(&self, who: Principal) -> &Principal {
        let p = self.principal.get_or_init(|| who);
        self.end();
        p
    }

    /// Gives back the HELLO place (authenticated or ended).
    pub(super) fn end(&self) {
        lock(&self.waiting).take();
    }

    /// The connection's id, unique among the node's open connections.
    pub(super) fn conn_id(&self) -> usize {
        self.conn.stable_id()
    }

    /// The node's address the connection came to, where known.
    pub(super) fn local_ip(&self) -> Option<std::net::IpAddr> {
        self.conn.local_ip()
    }

    pub(super) fn remote(&self) -> std::net::SocketAddr {
        self.conn.remote_address()
    }

    /// Closes the connection for want of a principal.
    pub(super) fn close_unauthenticated(&self, reason: &str) {
        self.conn
            .close(CLOSE_UNAUTHENTICATED.into(), reason.as_bytes());
        self.end();
    }
}

#[cfg(test)]
#[test]
fn an_ipv6_source_is_its_64_and_an_ipv4_one_its_address() {
    let of = |s: &str| Source::of(s.parse().unwrap()).to_string();
    assert_eq!(of("2001:db8:1:2:3:4:5:6"), "2001:db8:1:2::/64");
    assert_eq!(of("::ffff:10.0.0.7"), "10.0.0.7");
}
