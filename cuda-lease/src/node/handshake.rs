//! Bounds on connections that have not authenticated. Such a connection
//! costs the node a TLS session and a task while it waits for HELLO, and
//! each HELLO with a token costs a comparison against every token and, when
//! it fails, a log line. So:
//!
//! * a connection with no principal `hello_timeout` after it arrived is
//!   closed (the TLS handshake counts against the same deadline);
//! * at most `max_unauthenticated` connections wait for HELLO node-wide,
//!   and `max_unauthenticated_per_source` from one source address; more
//!   are refused before their TLS handshake;
//! * a failed HELLO closes its connection (after its reply is written);
//! * each source address may have `max_failed_hellos_per_source` tokens
//!   checked and found wrong per second: over it a HELLO is answered
//!   UNAUTHORIZED and its connection closed without checking the token;
//! * failed HELLOs are logged at most once per [`REJECTED_LOG_INTERVAL`],
//!   with the count of those not logged since the last line.
//!
//! A source address is an IPv4 address, or the /64 prefix of an IPv6 one
//! (what one host usually holds).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use tracing::warn;

use crate::lease_table::Principal;

/// The shortest time between two log lines about rejected credentials.
pub const REJECTED_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// The application close code of a connection closed for want of a
/// principal (no HELLO in time, or a failed HELLO).
pub(super) const CLOSE_UNAUTHENTICATED: u32 = 0x401;

/// Most source addresses whose failed HELLOs are remembered; past it the
/// addresses whose allowance has fully refilled are forgotten.
const MAX_TRACKED_SOURCES: usize = 4096;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A source address as the limits count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Source(IpAddr);

impl Source {
    pub(super) fn of(ip: IpAddr) -> Self {
        match ip.to_canonical() {
            IpAddr::V6(v6) => {
                let s = v6.segments();
                Source(IpAddr::V6(Ipv6Addr::new(
                    s[0], s[1], s[2], s[3], 0, 0, 0, 0,
                )))
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
    pub(super) max_failed_hellos_per_source: u32,
}

/// Connections waiting for HELLO, failed-HELLO allowances and the log
/// limiter, node-wide.
#[derive(Debug)]
pub(super) struct Handshakes {
    limits: HandshakeLimits,
    waiting: Mutex<Waiting>,
    failed: Mutex<HashMap<Source, Allowance>>,
    log: Mutex<RejectedLog>,
}

#[derive(Debug, Default)]
struct Waiting {
    total: usize,
    per_source: HashMap<Source, usize>,
}

/// A token bucket of failed HELLOs: `max_failed_hellos_per_source` per
/// second, at most that many at once.
#[derive(Debug, Clone, Copy)]
struct Allowance {
    left: f64,
    at: Instant,
}

#[derive(Debug, Default)]
struct RejectedLog {
    last: Option<Instant>,
    suppressed: u64,
}

impl Handshakes {
    pub(super) fn new(limits: HandshakeLimits) -> Arc<Self> {
        Arc::new(Self {
            limits,
            waiting: Mutex::default(),
            failed: Mutex::default(),
            log: Mutex::default(),
        })
    }

    /// A place among the connections waiting for HELLO, or `None` when the
    /// node's or the source's are all taken.
    pub(super) fn wait(self: &Arc<Self>, source: Source) -> Option<WaitingPlace> {
        let mut w = lock(&self.waiting);
        let mine = w.per_source.get(&source).copied().unwrap_or(0);
        if w.total >= self.limits.max_unauthenticated
            || mine >= self.limits.max_unauthenticated_per_source
        {
            return None;
        }
        w.total += 1;
        w.per_source.insert(source, mine + 1);
        Some(WaitingPlace {
            handshakes: self.clone(),
            source,
        })
    }

    fn refill(&self, a: &mut Allowance, now: Instant) {
        let rate = f64::from(self.limits.max_failed_hellos_per_source);
        let dt = now.saturating_duration_since(a.at).as_secs_f64();
        a.left = (a.left + dt * rate).min(rate);
        a.at = now;
    }

    /// Takes one failed HELLO of `source`'s allowance before its token is
    /// checked (given back by [`Handshakes::authenticated`]); false when
    /// none is left: the token must not be checked.
    pub(super) fn take_check(&self, source: Source) -> bool {
        let now = Instant::now();
        let rate = f64::from(self.limits.max_failed_hellos_per_source);
        let mut m = lock(&self.failed);
        if m.len() >= MAX_TRACKED_SOURCES && !m.contains_key(&source) {
            m.retain(|_, a| {
                let dt = now.saturating_duration_since(a.at).as_secs_f64();
                a.left + dt * rate < rate
            });
        }
        let a = m.entry(source).or_insert(Allowance {
            left: rate,
            at: now,
        });
        self.refill(a, now);
        if a.left < 1.0 {
            return false;
        }
        a.left -= 1.0;
        true
    }

    /// Gives back what [`Handshakes::take_check`] took: the HELLO was good.
    pub(super) fn authenticated(&self, source: Source) {
        let now = Instant::now();
        let mut m = lock(&self.failed);
        if let Some(a) = m.get_mut(&source) {
            self.refill(a, now);
            a.left = (a.left + 1.0).min(f64::from(self.limits.max_failed_hellos_per_source));
        }
    }

    /// Logs a rejected HELLO (`checked`: its token was compared and found
    /// wrong; else it was refused over the source's allowance), at most
    /// one line per [`REJECTED_LOG_INTERVAL`].
    pub(super) fn rejected(&self, client: &str, remote: std::net::SocketAddr, checked: bool) {
        let now = Instant::now();
        let mut log = lock(&self.log);
        let due = log
            .last
            .is_none_or(|t| now.saturating_duration_since(t) >= REJECTED_LOG_INTERVAL);
        if !due {
            log.suppressed += 1;
            return;
        }
        let suppressed = std::mem::take(&mut log.suppressed);
        log.last = Some(now);
        drop(log);
        let why = if checked {
            "invalid token"
        } else {
            "too many failed HELLOs from its address: token not checked"
        };
        warn!(%client, %remote, why, suppressed, "rejected credentials");
    }

    /// Logs the count of rejected HELLOs not logged, once the interval
    /// since the last line has passed (the reaper calls this).
    pub(super) fn flush_log(&self) {
        let now = Instant::now();
        let mut log = lock(&self.log);
        if log.suppressed == 0
            || log
                .last
                .is_some_and(|t| now.saturating_duration_since(t) < REJECTED_LOG_INTERVAL)
        {
            return;
        }
        let suppressed = std::mem::take(&mut log.suppressed);
        log.last = Some(now);
        drop(log);
        warn!(
            suppressed,
            "rejected credentials: {suppressed} more HELLOs since the last line"
        );
    }
}

/// A connection's place among those waiting for HELLO; given back when
/// dropped.
#[derive(Debug)]
pub(super) struct WaitingPlace {
    handshakes: Arc<Handshakes>,
    source: Source,
}

impl Drop for WaitingPlace {
    fn drop(&mut self) {
        let mut w = lock(&self.handshakes.waiting);
        w.total -= 1;
        if let Some(n) = w.per_source.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                w.per_source.remove(&self.source);
            }
        }
    }
}

/// Who is on a connection (set once, by a client certificate or HELLO),
/// and the connection itself.
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

    /// The connection's principal, if it has one.
    pub(super) fn get(&self) -> Option<&Principal> {
        self.principal.get()
    }

    /// Sets the connection's principal (the first one set stays) and gives
    /// back its place among the connections waiting for HELLO.
    pub(super) fn authenticate(&self, who: Principal) -> &Principal {
        let p = self.principal.get_or_init(|| who);
        self.end();
        p
    }

    /// Gives back the connection's place among those waiting for HELLO
    /// (it authenticated, or ended).
    pub(super) fn end(&self) {
        lock(&self.waiting).take();
    }

    /// The connection's id, unique among the node's open connections.
    pub(super) fn conn_id(&self) -> usize {
        self.conn.stable_id()
    }

    /// The peer's address.
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
