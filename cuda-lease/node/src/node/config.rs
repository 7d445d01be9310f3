//! The node's configuration: [`NodeConfig`], where its certificate comes from,
//! and why it could not start.

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
    /// Generate a self-signed certificate for these names at start-up;
    /// clients pin it ([`Node::cert_der`](crate::node::Node::cert_der), or the PEM file written to
    /// `write_pem`).
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
    /// Accepted bearer tokens, each its own principal, named `token-1`,
    /// `token-2`, ... in order (names are what logs show; never secrets).
    pub tokens: Vec<String>,
    /// Accepted bearer tokens with the names of their principals
    /// `(name, secret)`.
    pub named_tokens: Vec<(String, String)>,
    /// Principals that may free any lease (operators); everyone else may
    /// free and use only the leases they made.
    pub admins: Vec<String>,
    /// Most live leases (and so lease worker processes) on the node.
    pub max_leases: usize,
    /// Most live leases one principal may hold.
    pub max_leases_per_principal: usize,
    /// Lease worker processes one principal may have started per second
    /// (a token bucket, refilled at this rate); a LEASE_ALLOC past it is
    /// refused as CAPACITY_EXCEEDED saying so, before a worker is taken.
    pub worker_starts_per_principal_per_second: f64,
    /// The bucket's size: lease worker starts one principal may make at
    /// once after a pause.
    pub worker_start_burst_per_principal: u32,
    /// Most GPU_SUBMITs one principal may have in flight at once (more wait
    /// for their turn), so one tenant cannot occupy every submit worker.
    pub max_submits_per_principal: usize,
    /// Most requests one principal may have in flight at once, over all
    /// its connections (more are refused).
    pub max_requests_per_principal: usize,
    /// Most request bytes (bodies and unstreamed data) one principal may
    /// have in the node at once; a request that would pass it is refused on
    /// its header, before anything it declares is allocated.
    pub max_bytes_per_principal: u64,
    /// Longest the node waits for a client to take a reply (or a chunk of
    /// a streamed one); after that the reply is dropped and its stream
    /// reset, so unread replies never hold the node's memory.
    pub reply_timeout: Duration,
    /// Most streams one lease may use (made on demand).
    pub max_streams_per_lease: usize,
    /// Most live ids (buffers and events) one lease may hold.
    pub max_ids_per_lease: usize,
    /// Bytes of module source the node keeps, node-wide, by content hash
    /// (a module enters it once a lease was charged for it and loaded it).
    pub module_cache_bytes: u64,
    /// Most bytes of the node's module cache one principal's modules may
    /// hold; past it the principal's own oldest entries go.
    pub module_cache_bytes_per_principal: u64,
    /// Longest a request's data may stop arriving before the request is
    /// dropped with what it held (its whole data must arrive within 60 s
    /// in any case).
    pub payload_stall_timeout: Duration,
    /// Longest a connection may go without a principal (its TLS handshake
    /// and HELLO); then it is closed.
    pub hello_timeout: Duration,
    /// Most connections waiting for HELLO (no principal yet) on the node;
    /// more are refused before their TLS handshake.
    pub max_unauthenticated: usize,
    /// Most connections waiting for HELLO from one source address (an IPv4
    /// address or an IPv6 /64); more wait for a place, before their TLS
    /// handshake, in the handshake queue.
    pub max_unauthenticated_per_source: usize,
    /// Most connections waiting in the handshake queue for a place among
    /// those waiting for HELLO, node-wide. A queued connection waits at
    /// most `hello_timeout` for a place, then has `hello_timeout` from
    /// then for its handshake and HELLO; one arriving when the queue is full is refused at once, and
    /// the client names it "node busy" and retries within its connect
    /// timeout.
    pub max_queued_handshakes: usize,
    /// Most connections from one source address in the handshake queue.
    pub max_queued_handshakes_per_source: usize,
    /// Failed HELLOs (tokens checked and found wrong) allowed per second
    /// from one source address, and at most that many at once; over it a
    /// HELLO is answered UNAUTHORIZED without its token being checked. Each
    /// failed HELLO closes its connection.
    pub max_failed_hellos_per_source: u32,
    /// Accept clients without credentials (development only).
    pub allow_anonymous: bool,
    /// TLS certificate.
    pub tls: TlsSource,
    /// CA certificates (PEM file) for mutual TLS: a client presenting a
    /// certificate signed by one of them needs no token.
    pub client_ca: Option<PathBuf>,
    /// How worker processes are started.
    pub worker: WorkerSpec,
    /// Bytes leases may reserve in total. `None`: the device's free memory at
    /// start-up minus `headroom`.
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
    /// Workers started ahead of time so LEASE_ALLOC need not wait for a
    /// context to be created.
    pub prestart_workers: usize,
    /// Frame size limits.
    pub limits: Limits,
    /// How the node's QUIC endpoint uses the network (MTU, segmentation
    /// offload, socket buffers, windows); default: quinn's defaults. The
    /// windows bound what each connection may hold in the node.
    pub transport: TransportSettings,
    /// Where the bulk-data channel listens: large MEM_WRITE / MEM_READ
    /// over TLS on TCP, which moves several times what QUIC does on the
    /// same host. Default [`BulkListen::SamePort`].
    pub bulk: BulkListen,
    /// Most bulk-data connections one principal may hold open.
    pub max_bulk_connections_per_principal: usize,
    /// Monotonic clock for TTLs (inject a [`crate::clock::ManualClock`] in tests).
    pub clock: Arc<dyn Clock>,
    /// Register the node in a fleet's etcd registry (`None`: no
    /// registration).
    #[cfg(feature = "fleet")]
    pub registry: Option<crate::fleet::RegistryConfig>,
}

/// Where a node's bulk-data channel (TLS over TCP) listens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BulkListen {
    /// No bulk-data channel: transfers stay on QUIC.
    Off,
    /// TCP on the QUIC listen address and port (for a node on port 0, the
    /// port QUIC got, or another free one if TCP has that one taken).
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
