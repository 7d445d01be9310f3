//! The failures of remote lease execution: one type, [`RemoteError`], for
//! every layer. `cuda-lease`'s client returns it and `cuda-async`'s `Error`
//! carries it whole as `Error::Remote` (`cuda_async::RemoteErrorExt` reads it
//! back), so kind, words and place reach the user unmapped.

use std::fmt;

/// Why the node or the client refused or lost a remote request. New kinds
/// may be added: match with a wildcard arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RemoteErrorKind {
    /// The node does not know the lease: freed (by any client of its
    /// principal), expired and reaped, or never granted.
    LeaseNotFound,
    /// This client freed or dropped the lease with the request in flight.
    LeaseFreed,
    /// The lease's TTL ran out; everything in it is gone.
    LeaseExpired,
    /// A kernel fault (or a worker that died) ended the lease's GPU state.
    LeasePoisoned,
    /// The request exceeds the lease's reservation, or the node's capacity
    /// or per-principal limits.
    Capacity,
    /// The node refused the credentials, or the lease belongs to another
    /// principal.
    Unauthorized(Credentials),
    /// The connection to the node is gone, or could not be made.
    Disconnected(Disconnect),
    /// The node called a request malformed, or its reply is not understood:
    /// a library bug (or version mismatch), not the caller's.
    Protocol,
    /// The node refused one command of a submission (unknown buffer, event
    /// or kernel, out-of-range copy or read, arguments unfit for the kernel).
    InvalidRequest,
    /// A module did not compile or load on the node; the message holds the log.
    LoadFailed,
    /// The node lacks a module and was not sent its source (the client resends it).
    ModuleUnknown,
    /// A launch failed on the node, or a kernel faulted.
    LaunchFailed,
    /// The node failed for a reason of its own.
    NodeInternal,
    /// The client's configuration (TLS, address, token) is unusable.
    Config,
}

/// What credentials a refused client gave.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Credentials {
    /// None: no token and no client certificate.
    Missing,
    /// Some, and the node refused them (or they are another principal's).
    Refused,
}

/// Why a connection ended or was never made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Disconnect {
    /// The node closed the connection (it is shutting down).
    NodeShutdown,
    /// The network or the peer failed (reset, idle timeout, TLS failure).
    Network,
    /// No node answered at the address within the connect timeout.
    ConnectTimeout,
    /// The node refused connections before the handshake for the whole connect
    /// timeout: too many handshakes waiting (from this address, or node-wide).
    NodeBusy,
}

/// A failure of remote lease execution: its [`kind`](Self::kind), the
/// node's or client's words, and the lease and node, when known.
///
/// # Examples
///
/// ```
/// use cuda_lease_proto::{RemoteError, RemoteErrorKind};
/// let e = RemoteError::new(RemoteErrorKind::LeaseExpired, "ttl ran out")
///     .with_lease("9f2c")
///     .with_node("10.0.0.7:4433");
/// assert_eq!(e.kind(), RemoteErrorKind::LeaseExpired);
/// assert!(!e.is_retryable());
/// assert_eq!(
///     e.to_string(),
///     "lease expired: ttl ran out (lease 9f2c on node 10.0.0.7:4433; its buffers are gone: \
///      lease again, with a longer TTL or auto-renew)"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteError {
    kind: RemoteErrorKind,
    message: String,
    lease: Option<String>,
    node: Option<String>,
}

impl RemoteError {
    /// An error of `kind` with the node's or the client's `message`.
    pub fn new(kind: RemoteErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            lease: None,
            node: None,
        }
    }

    /// Names the lease the error happened in (unless one is named already).
    #[must_use]
    pub fn with_lease(mut self, lease: impl fmt::Display) -> Self {
        self.lease.get_or_insert_with(|| lease.to_string());
        self
    }

    /// Names the node the error happened on (unless one is named already).
    #[must_use]
    pub fn with_node(mut self, node: impl fmt::Display) -> Self {
        self.node.get_or_insert_with(|| node.to_string());
        self
    }

    /// What went wrong.
    pub fn kind(&self) -> RemoteErrorKind {
        self.kind
    }

    /// The node's or the client's words (a compile log for
    /// [`RemoteErrorKind::LoadFailed`]).
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The lease, when known.
    pub fn lease(&self) -> Option<&str> {
        self.lease.as_deref()
    }

    /// The node's address, when known.
    pub fn node(&self) -> Option<&str> {
        self.node.as_deref()
    }

    /// Whether the same request, sent again later unchanged (after
    /// reconnecting), can succeed: capacity, or a connection lost to the
    /// network or to a node that did not answer. A gone, expired or poisoned
    /// lease needs a new lease; a refused or malformed request, a change.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self.kind,
            RemoteErrorKind::Capacity
                | RemoteErrorKind::Disconnected(
                    Disconnect::Network | Disconnect::ConnectTimeout | Disconnect::NodeBusy
                )
        )
    }

    /// Whether the node or the lease is gone (disconnected; the lease
    /// expired, freed, not found or poisoned): nothing more runs on this
    /// lease, and the failure was not the request's own.
    pub fn lease_gone(&self) -> bool {
        matches!(
            self.kind,
            RemoteErrorKind::Disconnected(_)
                | RemoteErrorKind::LeaseExpired
                | RemoteErrorKind::LeaseFreed
                | RemoteErrorKind::LeaseNotFound
                | RemoteErrorKind::LeasePoisoned
        )
    }

    /// What to do about it, in a few words.
    pub fn hint(&self) -> &'static str {
        use RemoteErrorKind as K;
        match self.kind {
            K::LeaseNotFound => "lease again: the node no longer has this lease",
            K::LeaseFreed => "this client freed the lease: lease again to submit more",
            K::LeaseExpired => "its buffers are gone: lease again, with a longer TTL or auto-renew",
            K::LeasePoisoned => {
                "a kernel faulted in this lease: fix the kernel or its arguments, then lease again"
            }
            K::Capacity => {
                "stay within the lease's limits (free buffers, fewer streams or ids), lease \
                 more, or retry later"
            }
            K::Unauthorized(Credentials::Missing) => {
                "give a token (--token, CUDA_LEASE_TOKEN) or a client certificate"
            }
            K::Unauthorized(Credentials::Refused) => {
                "check the token or client certificate, and that the lease is yours"
            }
            K::Disconnected(Disconnect::NodeShutdown) => {
                "the node shut down: its leases are gone; lease again from a running node"
            }
            K::Disconnected(Disconnect::Network) => {
                "check that the node is up and reachable, then reconnect"
            }
            K::Disconnected(Disconnect::ConnectTimeout) => {
                "no node answered: check the address and that the node is running"
            }
            K::Disconnected(Disconnect::NodeBusy) => {
                "the node is busy with handshakes: retry later, or open fewer connections at once"
            }
            K::Protocol => "a bug or a version mismatch between client and node: report it",
            K::InvalidRequest => "fix the command the message names",
            K::LoadFailed => "fix the module: the compiler's log is above",
            K::ModuleUnknown => "send the module's source with the batch",
            K::LaunchFailed => "fix the kernel or its launch configuration",
            K::NodeInternal => "the node failed on its own: retry, or check the node's log",
            K::Config => "fix the client's configuration",
        }
    }

    fn kind_text(&self) -> &'static str {
        use RemoteErrorKind as K;
        match self.kind {
            K::LeaseNotFound => "lease not found",
            K::LeaseFreed => "lease freed by this client",
            K::LeaseExpired => "lease expired",
            K::LeasePoisoned => "lease poisoned",
            K::Capacity => "capacity exceeded",
            K::Unauthorized(Credentials::Missing) => "unauthorized: no credentials given",
            K::Unauthorized(Credentials::Refused) => "unauthorized",
            K::Disconnected(Disconnect::NodeShutdown) => "disconnected: the node shut down",
            K::Disconnected(Disconnect::Network) => "disconnected",
            K::Disconnected(Disconnect::ConnectTimeout) => "connect timed out",
            K::Disconnected(Disconnect::NodeBusy) => "node busy",
            K::Protocol => "protocol error",
            K::InvalidRequest => "request refused",
            K::LoadFailed => "module load failed",
            K::ModuleUnknown => "unknown module",
            K::LaunchFailed => "launch failed",
            K::NodeInternal => "node error",
            K::Config => "config",
        }
    }
}

impl fmt::Display for RemoteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // A node's message may already start with the kind's words.
        let kind = self.kind_text();
        if self.message.starts_with(kind) {
            write!(f, "{} (", self.message)?;
        } else {
            write!(f, "{kind}: {} (", self.message)?;
        }
        match (&self.lease, &self.node) {
            (Some(l), Some(n)) => write!(f, "lease {l} on node {n}; ")?,
            (Some(l), None) => write!(f, "lease {l}; ")?,
            (None, Some(n)) => write!(f, "node {n}; ")?,
            (None, None) => {}
        }
        write!(f, "{})", self.hint())
    }
}

impl std::error::Error for RemoteError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_words_a_hint_and_a_retry_answer() {
        use RemoteErrorKind as K;
        // (kind, retryable)
        let kinds = [
            (K::LeaseNotFound, false),
            (K::LeaseFreed, false),
            (K::LeaseExpired, false),
            (K::LeasePoisoned, false),
            (K::Capacity, true),
            (K::Unauthorized(Credentials::Missing), false),
            (K::Unauthorized(Credentials::Refused), false),
            (K::Disconnected(Disconnect::NodeShutdown), false),
            (K::Disconnected(Disconnect::Network), true),
            (K::Disconnected(Disconnect::ConnectTimeout), true),
            (K::Disconnected(Disconnect::NodeBusy), true),
            (K::Protocol, false),
            (K::InvalidRequest, false),
            (K::LoadFailed, false),
            (K::ModuleUnknown, false),
            (K::LaunchFailed, false),
            (K::NodeInternal, false),
            (K::Config, false),
        ];
        let mut texts = std::collections::HashSet::new();
        for (kind, retry) in kinds {
            let e = RemoteError::new(kind, "m").with_lease("L").with_node("N");
            let s = e.to_string();
            assert!(s.contains("lease L on node N"), "{s}");
            assert!(s.contains(e.hint()), "{s}");
            assert_eq!(e.is_retryable(), retry, "{kind:?}");
            assert!(
                texts.insert(e.kind_text()),
                "{kind:?} reads like another kind"
            );
        }
    }

    #[test]
    fn the_kind_is_not_said_twice() {
        let e = RemoteError::new(
            RemoteErrorKind::LeasePoisoned,
            "lease poisoned: illegal address",
        );
        assert!(
            e.to_string()
                .starts_with("lease poisoned: illegal address ("),
            "{e}"
        );
    }

    #[test]
    fn the_first_lease_and_node_named_stay() {
        let e = RemoteError::new(RemoteErrorKind::Protocol, "x")
            .with_lease("a")
            .with_lease("b")
            .with_node("n1")
            .with_node("n2");
        assert_eq!((e.lease(), e.node()), (Some("a"), Some("n1")));
    }
}
