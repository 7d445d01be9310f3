//! The node's configuration, certificate source and start-up errors.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::{Clock, MonotonicClock};
use crate::proto::Limits;
use crate::tls::{Identity, TlsError};
use crate::transport::TransportSettings;
use crate::worker::WorkerSpec;

/// Where the node's TLS certificate comes from.
#[derive(Debug, Clone)]
pub enum TlsSource {
    /// A self-signed certificate generated at start-up; clients pin it
    /// ([`Node::cert_der`](crate::node::Node::cert_der) or `write_pem`).
    SelfSigned {
        /// DNS names / IP addresses in the certificate.
        names: Vec<String>,
        /// Where to write the certificate as PEM for clients.
        write_pem: Option<PathBuf>,
    },
    /// A certificate chain and key from PEM files.
    Files {
        /// Chain, leaf first.
        cert: PathBuf,
        /// Private key.
        key: PathBuf,
    },
    /// An identity already in memory.
    Identity(Identity),
}

/// Node configuration. Start from [`NodeConfig::new`].
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// QUIC listen address.
    pub listen: SocketAddr,
    /// Prometheus HTTP listen address (`None`: no metrics endpoint).
    pub metrics_listen: Option<SocketAddr>,
    /// Name reported to clients.
    pub name: String,
    /// Accepted bearer tokens, each its own principal named `token-1`,
    /// `token-2`, ... (logs show names, never secrets).
    pub tokens: Vec<String>,
    /// Accepted bearer tokens with principal names, `(name, secret)`.
    pub named_tokens: Vec<(String, String)>,
    /// Principals that may free any lease; others use and free only their own.
    pub admins: Vec<String>,
    /// Most live leases (and so lease worker processes) on the node.
    pub max_leases: usize,
    /// Most live leases one principal may hold.
    pub max_leases_per_principal: usize,
    /// Lease worker starts per second per principal (bucket refill rate); a
    /// LEASE_ALLOC past it gets CAPACITY_EXCEEDED before a worker is taken.
    pub worker_starts_per_principal_per_second: f64,
    /// The bucket's size: worker starts one principal may burst.
    pub worker_start_burst_per_principal: u32,
    /// Most GPU_SUBMITs in flight per principal (more wait), so one tenant
    /// cannot occupy every submit worker.
    pub max_submits_per_principal: usize,
    /// Most requests in flight per principal, all connections (more refused).
    pub max_requests_per_principal: usize,
    /// Most request bytes (bodies, unstreamed data) per principal in the
    /// node; a request past it is refused on its header, before allocation.
    pub max_bytes_per_principal: u64,
    /// Longest the node waits for a client to take a reply (or chunk);
    /// then the reply is dropped and its stream reset.
    pub reply_timeout: Duration,
    /// Most streams one lease may use (made on demand).
    pub max_streams_per_lease: usize,
    /// Most live ids (buffers and events) one lease may hold.
    pub max_ids_per_lease: usize,
    /// Bytes of module source cached node-wide by content hash (entered
    /// once a lease was charged for and loaded it).
    pub module_cache_bytes: u64,
    /// Module cache bytes per principal; past it its oldest entries go.
    pub module_cache_bytes_per_principal: u64,
    /// Longest a request's data may stall before the request is dropped
    /// (all its data must arrive within 60 s regardless).
    pub payload_stall_timeout: Duration,
    /// Longest a connection may lack a principal (TLS handshake, HELLO); then closed.
    pub hello_timeout: Duration,
    /// Most connections waiting for HELLO node-wide; more are refused pre-TLS.
    pub max_unauthenticated: usize,
    /// Most connections waiting for HELLO per source (IPv4 address or IPv6
    /// /64); more wait in the handshake queue before their TLS handshake.
    pub max_unauthenticated_per_source: usize,
    /// Most connections in the handshake queue node-wide; more are refused
    /// ("node busy": the client retries within its connect timeout). A queued
    /// one waits up to `hello_timeout` for a place, then has `hello_timeout`
    /// for its handshake and HELLO.
    pub max_queued_handshakes: usize,
    /// Most connections from one source address in the handshake queue.
    pub max_queued_handshakes_per_source: usize,
    /// Wrong-token HELLOs per second per source (burst the same); past it
    /// HELLO gets UNAUTHORIZED unchecked. A failed HELLO closes its connection.
    pub max_failed_hellos_per_source: u32,
    /// Accept clients without credentials (development only).
    pub allow_anonymous: bool,
    /// Leases may have their worker serve their BATCHes directly
    /// (LEASE_DIRECT), off the node's path (default on; off: the node
    /// serves every lease's BATCHes itself). Their requests count in their
    /// principal's budgets as the node's own do.
    pub direct_leases: bool,
    /// The UDP ports leases' workers bind for their direct path, first to
    /// last, both included (default `None`: a free port the system picks).
    /// Open these in a firewall between clients and the node. A worker
    /// that finds none of them free serves no direct path: its lease's
    /// BATCHes go through the node.
    pub direct_ports: Option<(u16, u16)>,
    /// TLS certificate.
    pub tls: TlsSource,
    /// CA certificates (PEM) for mutual TLS; clients they certify need no token.
    pub client_ca: Option<PathBuf>,
    /// How worker processes are started.
    pub worker: WorkerSpec,
    /// Bytes leases may reserve (`None`: free memory at start-up minus `headroom`).
    pub capacity: Option<u64>,
    /// Bytes kept back from the device's free memory (contexts of workers).
    pub headroom: u64,
    /// Longest TTL granted.
    pub max_ttl: Duration,
    /// How often the reaper looks for expired leases and dead workers.
    pub reaper_interval: Duration,
    /// Longest a worker may take for one request before it is deemed hung.
    pub op_timeout: Duration,
    /// Longest a worker may take to start (create its context).
    pub worker_start_timeout: Duration,
    /// Worker processes serving GPU_SUBMIT and inventory.
    pub submit_workers: usize,
    /// Workers pre-started so LEASE_ALLOC need not wait for a context.
    pub prestart_workers: usize,
    /// Frame size limits.
    pub limits: Limits,
    /// QUIC settings (default: quinn's); its windows bound each connection's memory.
    pub transport: TransportSettings,
    /// Where the bulk-data channel listens (default [`BulkListen::SamePort`]).
    pub bulk: BulkListen,
    /// Most bulk-data connections one principal may hold open.
    pub max_bulk_connections_per_principal: usize,
    /// Monotonic clock for TTLs (inject a [`crate::clock::ManualClock`] in tests).
    pub clock: Arc<dyn Clock>,
    /// The fleet's etcd registry to register in (`None`: none).
    #[cfg(feature = "fleet")]
    pub registry: Option<crate::fleet::RegistryConfig>,
}

/// Where a node's bulk-data channel (TLS over TCP) listens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BulkListen {
    /// No bulk-data channel: transfers stay on QUIC.
    Off,
    /// TCP on the QUIC address and port (on port 0: QUIC's port, or another
    /// free one if TCP's is taken).
    SamePort,
    /// TCP on this address.
    At(SocketAddr),
}

impl std::str::FromStr for BulkListen {
    type Err = String;

    /// `off`, `same` (the QUIC port) or an address such as `0.0.0.0:4434`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(BulkListen::Off),
            "same" => Ok(BulkListen::SamePort),
            a => a.parse().map(BulkListen::At).map_err(|e| {
                format!("bulk listen address {a:?}: {e} (or `off`, or `same` for the QUIC port)")
            }),
        }
    }
}

impl NodeConfig {
    /// Defaults: listen on 127.0.0.1:0, self-signed certificate for
    /// `localhost`/`127.0.0.1`, no metrics endpoint, no tokens, 1 h max TTL,
    /// 100 ms reaper, 60 s op timeout, 2 submit workers, 1 pre-started worker.
    pub fn new(worker: WorkerSpec) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            metrics_listen: None,
            name: "cuda-lease-node".into(),
            tokens: Vec::new(),
            named_tokens: Vec::new(),
            admins: Vec::new(),
            max_leases: 256,
            max_leases_per_principal: 16,
            worker_starts_per_principal_per_second: 10.0,
            worker_start_burst_per_principal: 40,
            reply_timeout: Duration::from_secs(30),
            max_submits_per_principal: 1,
            max_requests_per_principal: 512,
            max_bytes_per_principal: 1 << 30,
            max_streams_per_lease: 8,
            max_ids_per_lease: 1 << 16,
            module_cache_bytes: 64 << 20,
            module_cache_bytes_per_principal: 16 << 20,
            payload_stall_timeout: Duration::from_secs(10),
            hello_timeout: Duration::from_secs(5),
            max_unauthenticated: 256,
            max_unauthenticated_per_source: 32,
            max_queued_handshakes: 4096,
            max_queued_handshakes_per_source: 1024,
            max_failed_hellos_per_source: 5,
            allow_anonymous: false,
            direct_leases: true,
            direct_ports: None,
            tls: TlsSource::SelfSigned {
                names: vec!["localhost".into(), "127.0.0.1".into()],
                write_pem: None,
            },
            client_ca: None,
            worker,
            capacity: None,
            headroom: 256 << 20,
            max_ttl: Duration::from_secs(3600),
            reaper_interval: Duration::from_millis(100),
            op_timeout: Duration::from_secs(60),
            worker_start_timeout: Duration::from_secs(60),
            submit_workers: 2,
            prestart_workers: 1,
            limits: Limits::default(),
            transport: TransportSettings::default(),
            bulk: BulkListen::SamePort,
            max_bulk_connections_per_principal: 16,
            clock: Arc::new(MonotonicClock::new()),
            #[cfg(feature = "fleet")]
            registry: None,
        }
    }
}

/// Why the node could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// TLS set-up.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// Sockets and files.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// The probe worker failed (for example "no NVIDIA driver found").
    #[error("device: {0}")]
    Device(String),
    /// The configuration is inconsistent.
    #[error("config: {0}")]
    Config(String),
}
