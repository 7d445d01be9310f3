//! The node: QUIC endpoint, auth, lease table, reaper, worker supervision and
//! metrics. The node process never touches CUDA; each lease's work runs in its
//! own worker process ([`crate::worker`]).

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use rustls::pki_types::CertificateDer;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

mod handshake;
mod stream;

pub use handshake::REJECTED_LOG_INTERVAL;

use crate::clock::{Clock, MonotonicClock};
use crate::hops::{self, HopTimer};
use crate::lease_table::{LeaseTable, Principal, TableError};
use crate::metrics::Metrics;
use crate::proto::{
    self, from_body, to_body, ArgView, Batch, BatchReply, BatchView, Command, CommandView,
    DeviceInfo, ErrorBody, Frame, GpuSubmit, Header, Hello, HelloOk, Id, IdOp, Inventory,
    LeaseAlloc, LeaseGrant, LeaseId, LeaseRef, LeaseRenew, Limits, MemAlloc, ModuleHash, Op,
    OpError, OpView, Opcode, SourceKind, Status, StreamId,
};
use crate::tls::{self, Identity, TlsError};
use crate::worker::{
    WorkerBatchReply, WorkerError, WorkerFailure, WorkerLoad, WorkerProcess, WorkerSpec,
};
use handshake::{HandshakeLimits, Handshakes, Peer, Source};

/// Where the node's TLS certificate comes from.
#[derive(Debug, Clone)]
pub enum TlsSource {
    /// Generate a self-signed certificate for these names at start-up;
    /// clients pin it ([`Node::cert_der`], or the PEM file written to
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
    /// Longest a numbered batch waits for its lease's earlier numbers to
    /// arrive before it runs anyway (a client that dropped a batch before
    /// sending it leaves a gap).
    pub reorder_window: Duration,
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
    /// Longest a connection may go without a principal (its TLS handshake
    /// and HELLO); then it is closed.
    pub hello_timeout: Duration,
    /// Most connections waiting for HELLO (no principal yet) on the node;
    /// more are refused before their TLS handshake.
    pub max_unauthenticated: usize,
    /// Most connections waiting for HELLO from one source address (an IPv4
    /// address or an IPv6 /64); more are refused before their TLS
    /// handshake.
    pub max_unauthenticated_per_source: usize,
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
    /// Monotonic clock for TTLs (inject a [`crate::clock::ManualClock`] in tests).
    pub clock: Arc<dyn Clock>,
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
            reply_timeout: Duration::from_secs(30),
            max_submits_per_principal: 1,
            max_requests_per_principal: 512,
            max_bytes_per_principal: 1 << 30,
            reorder_window: Duration::from_secs(2),
            max_streams_per_lease: 8,
            max_ids_per_lease: 1 << 16,
            module_cache_bytes: 64 << 20,
            module_cache_bytes_per_principal: 16 << 20,
            hello_timeout: Duration::from_secs(5),
            max_unauthenticated: 256,
            max_unauthenticated_per_source: 32,
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
            clock: Arc::new(MonotonicClock::new()),
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

/// What a client-named id of a lease is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IdKind {
    /// A buffer of this many bytes (charged to the lease).
    Buffer(u64),
    /// An event.
    Event,
}

/// A lease's client-named objects, as the node tracks them.
#[derive(Debug, Default)]
struct LeaseState {
    ids: HashMap<Id, IdKind>,
    /// Modules loaded in the lease's worker, with the source bytes charged
    /// to the lease for each (a loaded module costs device memory too).
    modules: HashMap<ModuleHash, u64>,
    /// Streams the lease has used.
    streams: HashSet<StreamId>,
}

struct LeaseSlot {
    worker: WorkerProcess,
    /// Serializes a lease's requests: plan, run on the worker, commit.
    exec: tokio::sync::Mutex<()>,
    state: StdMutex<LeaseState>,
    /// The next batch number to run (see [`Batch::seq`]).
    next_seq: tokio::sync::watch::Sender<u64>,
}

impl LeaseSlot {
    fn state(&self) -> std::sync::MutexGuard<'_, LeaseState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A module's source (or the PTX compiled from it).
type ModuleSource = Arc<(SourceKind, Vec<u8>)>;

/// Module sources loaded by leases, by content hash, so a lease need not
/// resend what another lease (or an earlier one) sent. Each entry belongs
/// to the principal whose lease was charged for it and loaded it. Bounded
/// in bytes node-wide and per principal: a principal over its share
/// evicts its own oldest entries, and when the node is full the oldest
/// entries of the largest holder go, so one tenant's modules never evict a
/// smaller holder's.
#[derive(Debug, Default)]
struct ModuleCache {
    map: HashMap<ModuleHash, (ModuleSource, Principal)>,
    /// Each principal's entries, oldest first, and their bytes.
    shares: HashMap<Principal, (std::collections::VecDeque<ModuleHash>, u64)>,
    bytes: u64,
}

impl ModuleCache {
    fn get(&self, hash: &ModuleHash) -> Option<ModuleSource> {
        self.map.get(hash).map(|(s, _)| s.clone())
    }

    fn remove(&mut self, hash: &ModuleHash) {
        let Some((source, owner)) = self.map.remove(hash) else {
            return;
        };
        let len = source.1.len() as u64;
        self.bytes -= len;
        if let Some((order, bytes)) = self.shares.get_mut(&owner) {
            order.retain(|h| h != hash);
            *bytes -= len;
            if order.is_empty() {
                self.shares.remove(&owner);
            }
        }
    }

    /// Evicts `owner`'s oldest entry; false if it has none.
    fn evict_oldest_of(&mut self, owner: &Principal) -> bool {
        let oldest = self.shares.get(owner).and_then(|(o, _)| o.front().copied());
        match oldest {
            Some(h) => {
                self.remove(&h);
                true
            }
            None => false,
        }
    }

    fn share(&self, owner: &Principal) -> u64 {
        self.shares.get(owner).map_or(0, |(_, b)| *b)
    }

    /// Keeps `entry` for `hash` as `owner`'s (replacing what was kept:
    /// compiled PTX replaces the CUDA C it came from), within `cap` bytes
    /// node-wide and `share_cap` for `owner`.
    fn insert(
        &mut self,
        hash: ModuleHash,
        entry: ModuleSource,
        owner: &Principal,
        cap: u64,
        share_cap: u64,
    ) {
        let len = entry.1.len() as u64;
        let share_cap = share_cap.min(cap);
        if len > share_cap {
            return;
        }
        self.remove(&hash);
        while self.share(owner) + len > share_cap {
            if !self.evict_oldest_of(owner) {
                break;
            }
        }
        while self.bytes + len > cap {
            let largest = self
                .shares
                .iter()
                .max_by_key(|(_, (_, b))| *b)
                .map(|(p, _)| p.clone());
            if !largest.is_some_and(|p| self.evict_oldest_of(&p)) {
                break;
            }
        }
        self.bytes += len;
        let (order, bytes) = self.shares.entry(owner.clone()).or_default();
        order.push_back(hash);
        *bytes += len;
        self.map.insert(hash, (entry, owner.clone()));
    }
}

impl std::fmt::Debug for LeaseSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseSlot")
            .field("worker", &self.worker)
            .finish_non_exhaustive()
    }
}

type Slot = Arc<LeaseSlot>;

struct Shared {
    cfg: NodeConfig,
    /// Secret and principal of every accepted token.
    tokens: Vec<(Vec<u8>, Principal)>,
    table: StdMutex<LeaseTable<Slot>>,
    submit: Vec<tokio::sync::Mutex<Option<WorkerProcess>>>,
    submit_next: AtomicUsize,
    prestarted: tokio::sync::Mutex<Vec<WorkerProcess>>,
    refilling: AtomicBool,
    /// The latest device figures (from the probe, then from idle workers).
    device: StdMutex<DeviceInfo>,
    /// GPU_SUBMIT turns per principal.
    submits: StdMutex<HashMap<Principal, Arc<tokio::sync::Semaphore>>>,
    /// Requests and bytes in flight per principal.
    budgets: StdMutex<HashMap<Principal, (usize, u64)>>,
    modules: StdMutex<ModuleCache>,
    /// Connections waiting for HELLO and failed HELLOs.
    handshakes: Arc<Handshakes>,
    metrics: Metrics,
}

impl Shared {
    fn now(&self) -> Duration {
        self.cfg.clock.now()
    }

    fn table(&self) -> std::sync::MutexGuard<'_, LeaseTable<Slot>> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A running node. Dropping it stops serving and kills every worker;
/// [`Node::shutdown`] does the same and waits for the workers to exit.
pub struct Node {
    addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    cert: CertificateDer<'static>,
    endpoint: quinn::Endpoint,
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("addr", &self.addr)
            .field("metrics_addr", &self.metrics_addr)
            .finish()
    }
}

/// A server reply before framing.
struct Reply {
    status: Status,
    body: Vec<u8>,
    data: Vec<u8>,
}

impl Reply {
    fn ok<T: serde::Serialize>(msg: &T) -> Self {
        Self {
            status: Status::Ok,
            body: to_body(msg),
            data: Vec::new(),
        }
    }
    fn empty() -> Self {
        Self {
            status: Status::Ok,
            body: Vec::new(),
            data: Vec::new(),
        }
    }
    fn err(status: Status, message: impl Into<String>) -> Self {
        Self {
            status,
            body: to_body(&ErrorBody {
                message: message.into(),
            }),
            data: Vec::new(),
        }
    }
}

impl From<TableError> for Reply {
    fn from(e: TableError) -> Self {
        Reply::err(e.status, e.message)
    }
}

impl From<proto::ProtoError> for Reply {
    fn from(e: proto::ProtoError) -> Self {
        Reply::err(Status::BadRequest, e.to_string())
    }
}

impl Node {
    /// Starts a node as configured: probes the device through a worker,
    /// binds the QUIC endpoint and the metrics port, and starts the reaper.
    /// Must be called inside a tokio runtime.
    ///
    /// # Errors
    ///
    /// [`NodeError`]; a machine without a driver gives
    /// `NodeError::Device("... no NVIDIA driver found")` for a CUDA device.
    pub async fn start(cfg: NodeConfig) -> Result<Node, NodeError> {
        let identity = match &cfg.tls {
            TlsSource::SelfSigned { names, write_pem } => {
                let id = Identity::self_signed(names)?;
                if let Some(p) = write_pem {
                    tls::write_cert_pem(p, id.leaf())?;
                    info!(path = %p.display(), "wrote self-signed certificate for clients to pin");
                }
                id
            }
            TlsSource::Files { cert, key } => Identity::from_pem_files(cert, key)?,
            TlsSource::Identity(id) => id.clone(),
        };
        let client_ca = cfg.client_ca.as_deref().map(tls::load_certs).transpose()?;
        if cfg.tokens.is_empty()
            && cfg.named_tokens.is_empty()
            && client_ca.is_none()
            && !cfg.allow_anonymous
        {
            return Err(NodeError::Config(
                "no credentials: configure tokens, a client CA, or allow anonymous access".into(),
            ));
        }
        let server_cfg = tls::server_config(&identity, client_ca.as_deref())?;

        // Probe the device; the probe becomes the first submit worker.
        let probe = WorkerProcess::spawn(&cfg.worker, cfg.worker_start_timeout)
            .await
            .map_err(|e| NodeError::Device(e.to_string()))?;
        let info = probe.info().clone();
        let capacity = cfg
            .capacity
            .unwrap_or(info.free_bytes.saturating_sub(cfg.headroom));
        info!(device = %info.name, total = info.total_bytes, free = info.free_bytes, capacity, "device probed");
        // Start every submit worker now, so that their contexts are already
        // counted in the device's free memory when leases are measured.
        let mut submit = Vec::new();
        let mut probe = Some(probe);
        for _ in 0..cfg.submit_workers {
            let w = match probe.take() {
                Some(p) => p,
                None => WorkerProcess::spawn(&cfg.worker, cfg.worker_start_timeout)
                    .await
                    .map_err(|e| NodeError::Device(e.to_string()))?,
            };
            submit.push(tokio::sync::Mutex::new(Some(w)));
        }
        if let Some(p) = probe {
            p.kill_and_wait().await;
        }

        let endpoint = quinn::Endpoint::server(server_cfg, cfg.listen)?;
        let addr = endpoint.local_addr()?;
        let shared = Arc::new(Shared {
            tokens: cfg
                .tokens
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    (
                        t.as_bytes().to_vec(),
                        Principal::from(format!("token-{}", i + 1)),
                    )
                })
                .chain(
                    cfg.named_tokens
                        .iter()
                        .map(|(n, t)| (t.as_bytes().to_vec(), Principal::from(n.as_str()))),
                )
                .collect(),
            table: StdMutex::new(LeaseTable::new(capacity, cfg.max_ttl)),
            submit,
            submit_next: AtomicUsize::new(0),
            prestarted: tokio::sync::Mutex::new(Vec::new()),
            refilling: AtomicBool::new(false),
            device: StdMutex::new(info.clone()),
            submits: StdMutex::default(),
            budgets: StdMutex::default(),
            modules: StdMutex::default(),
            handshakes: Handshakes::new(HandshakeLimits {
                max_unauthenticated: cfg.max_unauthenticated,
                max_unauthenticated_per_source: cfg.max_unauthenticated_per_source,
                max_failed_hellos_per_source: cfg.max_failed_hellos_per_source,
            }),
            metrics: Metrics::default(),
            cfg,
        });
        let mut tasks = Vec::new();
        let mut metrics_addr = None;
        if let Some(m) = shared.cfg.metrics_listen {
            let listener = tokio::net::TcpListener::bind(m).await?;
            metrics_addr = Some(listener.local_addr()?);
            let s = shared.clone();
            tasks.push(tokio::spawn(crate::metrics::serve(listener, move || {
                let t = s.table();
                s.metrics.render(t.allocated_total(), t.len() as u64)
            })));
        }
        tasks.push(tokio::spawn(reaper(shared.clone())));
        tasks.push(tokio::spawn(accept_loop(shared.clone(), endpoint.clone())));
        refill(shared.clone());
        info!(%addr, ?metrics_addr, "node listening");
        Ok(Node {
            addr,
            metrics_addr,
            cert: identity.leaf().clone(),
            endpoint,
            shared,
            tasks,
        })
    }

    /// Runs a node inside this process on 127.0.0.1:0 with a fresh
    /// self-signed certificate (for tests, examples and demos). The listen
    /// address, TLS source and metrics address of `cfg` are overridden; the
    /// metrics endpoint is on 127.0.0.1:0.
    ///
    /// Workers are separate processes even here: `cfg.worker.program` must
    /// call [`crate::worker::main_if_worker`] (use the `cuda-lease-node`
    /// binary, or the current executable if its `main` calls it).
    ///
    /// # Errors
    ///
    /// As [`Node::start`].
    pub async fn spawn_local(mut cfg: NodeConfig) -> Result<Node, NodeError> {
        cfg.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        cfg.metrics_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
        cfg.tls = TlsSource::SelfSigned {
            names: vec!["localhost".into(), "127.0.0.1".into()],
            write_pem: None,
        };
        Node::start(cfg).await
    }

    /// The QUIC address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The metrics HTTP address, if any.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// The node's TLS certificate (DER), for clients to pin.
    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert
    }

    /// The rendered metrics.
    pub fn metrics_text(&self) -> String {
        let t = self.shared.table();
        self.shared
            .metrics
            .render(t.allocated_total(), t.len() as u64)
    }

    /// Stops accepting, frees every lease (ending its worker) and waits for
    /// the workers to exit.
    pub async fn shutdown(mut self) {
        self.endpoint.close(0u32.into(), b"node shutting down");
        for t in self.tasks.drain(..) {
            t.abort();
        }
        let now = self.shared.now();
        let leases = self.shared.table().drain(now);
        for (id, slot) in leases {
            slot.worker.kill_and_wait().await;
            Metrics::inc(&self.shared.metrics.lease_dropped);
            info!(lease = %id, "lease freed at shutdown");
        }
        for w in self.shared.prestarted.lock().await.drain(..) {
            w.kill_and_wait().await;
        }
        for s in &self.shared.submit {
            if let Some(w) = s.lock().await.take() {
                w.kill_and_wait().await;
            }
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), self.endpoint.wait_idle()).await;
        info!("node stopped");
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.endpoint.close(0u32.into(), b"node dropped");
        for t in &self.tasks {
            t.abort();
        }
        let now = self.shared.now();
        for (_, slot) in self.shared.table().drain(now) {
            slot.worker.kill();
        }
        if let Ok(mut p) = self.shared.prestarted.try_lock() {
            p.clear();
        }
        for s in &self.shared.submit {
            if let Ok(mut w) = s.try_lock() {
                w.take();
            }
        }
    }
}

fn refill(shared: Arc<Shared>) {
    if shared.cfg.prestart_workers == 0 || shared.refilling.swap(true, Ordering::SeqCst) {
        return;
    }
    tokio::spawn(async move {
        loop {
            if shared.prestarted.lock().await.len() >= shared.cfg.prestart_workers {
                break;
            }
            match WorkerProcess::spawn(&shared.cfg.worker, shared.cfg.worker_start_timeout).await {
                Ok(w) => shared.prestarted.lock().await.push(w),
                Err(e) => {
                    warn!(error = %e, "could not pre-start a worker");
                    break;
                }
            }
        }
        shared.refilling.store(false, Ordering::SeqCst);
    });
}

async fn take_worker(shared: &Arc<Shared>) -> Result<WorkerProcess, WorkerError> {
    let ready = {
        let mut pool = shared.prestarted.lock().await;
        let mut found = None;
        while let Some(w) = pool.pop() {
            if w.exited().is_none() {
                found = Some(w);
                break;
            }
        }
        found
    };
    refill(shared.clone());
    match ready {
        Some(w) => Ok(w),
        None => WorkerProcess::spawn(&shared.cfg.worker, shared.cfg.worker_start_timeout).await,
    }
}

async fn reaper(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(shared.cfg.reaper_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        shared.handshakes.flush_log();
        let now = shared.now();
        let expired = shared.table().expire(now);
        for (id, slot) in expired {
            // Same step that marked it dead: end the worker, which frees
            // its memory, modules and context.
            slot.worker.kill();
            Metrics::inc(&shared.metrics.lease_dropped);
            info!(lease = %id, "lease expired; worker ended");
        }
        let live = shared.table().payloads();
        for (id, slot) in live {
            // Idle workers only: a busy one is watched by its call's timeout.
            let Ok(_guard) = slot.exec.try_lock() else {
                continue;
            };
            if let Some(why) = slot.worker.exited() {
                fail_lease(&shared, &id, &format!("worker {why}"));
            }
        }
    }
}

fn fail_lease(shared: &Shared, id: &LeaseId, reason: &str) {
    let now = shared.now();
    if let Some(slot) = shared.table().poison(id, reason, now) {
        slot.worker.kill();
        Metrics::inc(&shared.metrics.lease_dropped);
        warn!(lease = %id, reason, "lease failed");
    }
}

async fn accept_loop(shared: Arc<Shared>, endpoint: quinn::Endpoint) {
    while let Some(incoming) = endpoint.accept().await {
        let remote = incoming.remote_address();
        // A place among the connections waiting for HELLO, before the TLS
        // handshake costs anything.
        let Some(place) = shared.handshakes.wait(Source::of(remote.ip())) else {
            debug!(%remote, "refused: too many connections waiting for HELLO");
            incoming.refuse();
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
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
        });
    }
}

/// Answers a request refused on its header (and body), telling the peer to
/// stop sending the rest: nothing more of it is read.
async fn refuse(
    send: &mut quinn::SendStream,
    recv: &mut quinn::RecvStream,
    req: &Header,
    reply: &Reply,
) {
    let _ = recv.stop(0u32.into());
    let h = Header::reply(req, reply.status, reply.body.len() as u32, 0);
    if proto::write_frame(send, &h, &reply.body, &[]).await.is_ok() {
        let _ = send.finish();
    }
}

/// The largest HELLO body the node reads from a connection that has not
/// authenticated; such a connection may send nothing else, and nothing it
/// declares beyond this is allocated or read.
pub const PREAUTH_MAX_BODY: u32 = 4096;

async fn serve_stream(
    shared: Arc<Shared>,
    peer: Arc<Peer>,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
) {
    let limits = shared.cfg.limits;
    let mut hop = HopTimer::start("node", Opcode::Hello, 0);
    let mut turn = None;
    let head = tokio::time::timeout(Duration::from_secs(60), async {
        let header = proto::read_header(&mut recv, &limits).await?;
        let Some(who) = peer.get() else {
            if header.opcode == Opcode::Hello
                && !header.is_reply()
                && header.body_len <= PREAUTH_MAX_BODY
                && header.data_len == 0
            {
                let mut body = vec![0u8; header.body_len as usize];
                tokio::io::AsyncReadExt::read_exact(&mut recv, &mut body).await?;
                return Ok(Ok((header, body)));
            }
            // Refused on the header alone: nothing declared is read.
            let msg = if header.opcode == Opcode::Hello {
                format!("HELLO over {PREAUTH_MAX_BODY} bytes, or with data")
            } else {
                "send HELLO with a valid token first".to_string()
            };
            return Ok(Err((header, Reply::err(Status::Unauthorized, msg))));
        };
        // The principal's budget, before anything declared is allocated
        // (streamed transfers hold only the worker's ring).
        let streamed = matches!(header.opcode, Opcode::MemWrite | Opcode::MemRead);
        let bytes = u64::from(header.body_len)
            + if streamed {
                0
            } else {
                u64::from(header.data_len)
            };
        match BudgetTurn::take(&shared, who, bytes) {
            Ok(t) => turn = Some(t),
            Err(r) => return Ok(Err((header, r))),
        }
        let mut body = vec![0u8; header.body_len as usize];
        tokio::io::AsyncReadExt::read_exact(&mut recv, &mut body).await?;
        Ok(Ok((header, body)))
    })
    .await;
    let head = match head {
        Ok(Ok(Err((header, reply)))) => {
            refuse(&mut send, &mut recv, &header, &reply).await;
            if header.opcode == Opcode::Hello && peer.get().is_none() {
                close_after_failed_hello(&shared, &peer, &mut send).await;
            }
            return;
        }
        Ok(Ok(Ok(x))) => Ok(Ok(x)),
        Ok(Err(e)) => Ok(Err(e)),
        Err(elapsed) => Err(elapsed),
    };
    // Held until the reply has been written or dropped: it also carries
    // the bytes of the reply (charged by `dispatch` before the work runs).
    let mut turn = turn;
    let read = match head {
        // Bulk transfers stream through the worker's shared ring.
        Ok(Ok((header, body)))
            if !header.is_reply()
                && matches!(header.opcode, Opcode::MemWrite | Opcode::MemRead) =>
        {
            stream::serve(&shared, &peer, header, body, send, recv, hop).await;
            return;
        }
        Ok(Ok((header, body))) => {
            let rest = async {
                // Grown as the bytes arrive, never allocated whole up front.
                let want = header.data_len as usize;
                let mut data = Vec::with_capacity(want.min(1 << 20));
                while data.len() < want {
                    let Some(chunk) = recv
                        .read_chunk(want - data.len(), true)
                        .await
                        .map_err(std::io::Error::other)?
                    else {
                        return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
                    };
                    data.extend_from_slice(&chunk.bytes);
                }
                Ok(data)
            };
            tokio::time::timeout(Duration::from_secs(60), rest)
                .await
                .map(|r| r.map(|data| Frame { header, body, data }))
        }
        Ok(Err(e)) => Ok(Err(e)),
        Err(elapsed) => Err(elapsed),
    };
    // A peer of another protocol version gets its answer in its own
    // version's header (the layout is the same), so it can read the reason.
    let mut reply_version = None;
    let mut failed_hello = false;
    let (req, reply) = match read {
        Ok(Ok(frame)) => {
            if let Some(t) = &mut hop {
                t.mark("read");
                t.set_op(frame.header.opcode, frame.data.len() as u64);
            }
            let reply = dispatch(&shared, &peer, &frame, turn.as_mut()).await;
            failed_hello = frame.header.opcode == Opcode::Hello
                && reply.status != Status::Ok
                && peer.get().is_none();
            if let Some(t) = &mut hop {
                t.mark("dispatch");
                let bytes = frame.data.len().max(reply.data.len()) as u64;
                t.set_op(frame.header.opcode, bytes);
            }
            (frame.header, reply)
        }
        Ok(Err(e)) => {
            let msg = match proto::proto_error(&e) {
                Some(p) => {
                    // Version 1 had this header layout; later ones may not.
                    if let proto::ProtoError::UnsupportedVersion(1) = p {
                        reply_version = Some(1);
                    }
                    p.to_string()
                }
                None => format!("bad frame: {e}"),
            };
            debug!(error = %msg, "rejected frame");
            (
                Header::request(Opcode::Hello, 0, 0, 0),
                Reply::err(Status::BadRequest, msg),
            )
        }
        Err(_) => (
            Header::request(Opcode::Hello, 0, 0, 0),
            Reply::err(Status::BadRequest, "request timed out"),
        ),
    };
    let h = Header::reply(
        &req,
        reply.status,
        reply.body.len() as u32,
        reply.data.len() as u32,
    );
    let sent = tokio::time::timeout(shared.cfg.reply_timeout, async {
        let written = match reply_version {
            Some(v) => {
                let mut frame = h.encode().to_vec();
                frame[4] = v;
                frame.extend_from_slice(&reply.body);
                tokio::io::AsyncWriteExt::write_all(&mut send, &frame).await
            }
            None => proto::write_frame(&mut send, &h, &reply.body, &reply.data).await,
        };
        if written.is_ok() {
            let _ = send.finish();
            hops::mark(&mut hop, "reply");
            let _ = send.stopped().await;
        }
    })
    .await;
    if sent.is_err() {
        // A reply nobody reads is the client's loss, not the node's memory.
        debug!("reply not read within the reply timeout: dropped");
        let _ = send.reset(0u32.into());
    }
    if failed_hello {
        close_after_failed_hello(&shared, &peer, &mut send).await;
    }
}

/// Closes a connection whose HELLO failed, once its reply has arrived (or
/// after a short wait): a connection gets one try.
async fn close_after_failed_hello(shared: &Shared, peer: &Peer, send: &mut quinn::SendStream) {
    let wait = shared.cfg.reply_timeout.min(Duration::from_secs(1));
    let _ = tokio::time::timeout(wait, send.stopped()).await;
    peer.close_unauthenticated("HELLO failed");
}

/// The principal of `token`, comparing against every token without early
/// exit on content.
fn token_principal(shared: &Shared, token: &str) -> Option<Principal> {
    let t = token.as_bytes();
    let mut found = None;
    for (known, principal) in &shared.tokens {
        let mut diff = (known.len() != t.len()) as u8;
        for (i, b) in known.iter().enumerate() {
            diff |= b ^ t.get(i).copied().unwrap_or(0);
        }
        if diff == 0 {
            found = Some(principal.clone());
        }
    }
    found
}

/// The principal of a client certificate: `cert-` and the first 16 hex
/// digits of its SHA-256.
fn cert_principal(conn: &quinn::Connection) -> Option<Principal> {
    let certs = conn
        .peer_identity()?
        .downcast::<Vec<CertificateDer<'static>>>()
        .ok()?;
    let leaf = certs.first()?;
    let digest = ring::digest::digest(&ring::digest::SHA256, leaf.as_ref());
    let hex: String = digest.as_ref()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Some(Principal::from(format!("cert-{hex}")))
}

/// The connection's principal, or UNAUTHORIZED.
fn principal(peer: &Peer) -> Result<&Principal, Reply> {
    peer.get()
        .ok_or_else(|| Reply::err(Status::Unauthorized, "send HELLO with a valid token first"))
}

/// What the owner check is asked with: admins see every lease.
fn owner_filter<'a>(shared: &Shared, who: &'a Principal) -> Option<&'a str> {
    if shared.cfg.admins.iter().any(|a| **a == **who) {
        None
    } else {
        Some(who)
    }
}

/// The slot of lease `id` if it is `who`'s (else NOT_FOUND, as for an
/// unknown id) and usable.
fn lease_of(shared: &Shared, who: &Principal, id: &LeaseId) -> Result<Slot, Reply> {
    let mut t = shared.table();
    t.check_owner(id, Some(who))?;
    Ok(t.get(id, shared.now())?)
}

/// Serves one request; `turn` (the principal's budget turn of this
/// request) is charged the bytes of the reply before the work that makes
/// them runs.
async fn dispatch(
    shared: &Arc<Shared>,
    peer: &Peer,
    f: &Frame,
    turn: Option<&mut BudgetTurn>,
) -> Reply {
    match dispatch_inner(shared, peer, f, turn).await {
        Ok(r) | Err(r) => r,
    }
}

async fn dispatch_inner(
    shared: &Arc<Shared>,
    peer: &Peer,
    f: &Frame,
    turn: Option<&mut BudgetTurn>,
) -> Result<Reply, Reply> {
    let op = f.header.opcode;
    if f.header.is_reply() {
        return Err(Reply::err(Status::BadRequest, "a reply is not a request"));
    }
    if !matches!(op, Opcode::MemWrite | Opcode::Batch | Opcode::GpuSubmit) && !f.data.is_empty() {
        return Err(Reply::err(
            Status::BadRequest,
            format!("{op:?} takes no data"),
        ));
    }
    if op == Opcode::Hello {
        let h: Hello = from_body(&f.body)?;
        // Client-supplied: escaped before it reaches a log line.
        let client = h.client.escape_debug().to_string();
        let hello_ok = || {
            Ok(Reply::ok(&HelloOk {
                node: shared.cfg.name.clone(),
            }))
        };
        if peer.get().is_some() {
            return hello_ok();
        }
        // Token checks are rationed per source address.
        if !shared.handshakes.take_check(peer.source) {
            shared.handshakes.rejected(&client, peer.remote(), false);
            return Err(Reply::err(
                Status::Unauthorized,
                "too many failed HELLOs from this address: try again later",
            ));
        }
        let who = token_principal(shared, &h.token).or_else(|| {
            shared
                .cfg
                .allow_anonymous
                .then(|| Principal::from("anonymous"))
        });
        if let Some(who) = who {
            shared.handshakes.authenticated(peer.source);
            let who = peer.authenticate(who);
            debug!(%client, principal = %who, "authenticated");
            return hello_ok();
        }
        shared.handshakes.rejected(&client, peer.remote(), true);
        return Err(Reply::err(Status::Unauthorized, "invalid token"));
    }
    let who = principal(peer)?.clone();
    let now = shared.now();
    match op {
        Opcode::Hello => unreachable!("handled above"),
        Opcode::LeaseFree => {
            let r: LeaseRef = from_body(&f.body)?;
            shared
                .table()
                .check_owner(&r.lease, owner_filter(shared, &who))?;
            lease_free(shared, &r.lease).await
        }
        Opcode::GetInventory => inventory(shared).await,
        Opcode::LeaseAlloc => lease_alloc(shared, &who, from_body(&f.body)?).await,
        Opcode::LeaseRenew => {
            let r: LeaseRenew = from_body(&f.body)?;
            if r.ttl_secs == 0 {
                return Err(Reply::err(Status::BadRequest, "ttl must be at least 1 s"));
            }
            let g = {
                let mut t = shared.table();
                t.check_owner(&r.lease, Some(&who))?;
                t.renew(&r.lease, Duration::from_secs(u64::from(r.ttl_secs)), now)?
            };
            Ok(Reply::ok(&LeaseGrant {
                lease: r.lease,
                generation: g.generation,
                reserved: g.reserved,
                ttl_ms: ms(g.deadline.saturating_sub(now)),
            }))
        }
        Opcode::LeaseQuery => {
            let r: LeaseRef = from_body(&f.body)?;
            let t = shared.table();
            t.check_owner(&r.lease, Some(&who))?;
            Ok(Reply::ok(&t.status(&r.lease, now)?))
        }
        Opcode::MemAlloc => {
            let m: MemAlloc = from_body(&f.body)?;
            let op = Op::Alloc {
                buf: m.buf,
                size: m.size,
            };
            single(shared, &who, m.lease, op).await
        }
        // Served as streams by `stream::serve`, never dispatched whole.
        Opcode::MemWrite | Opcode::MemRead => Err(Reply::err(
            Status::Internal,
            format!("{op:?} is served as a stream"),
        )),
        Opcode::MemFree => {
            let m: IdOp = from_body(&f.body)?;
            single(shared, &who, m.lease, Op::Free { id: m.id }).await
        }
        Opcode::Batch => {
            // With hop timings on: the node's phases of this batch.
            let mut hop = HopTimer::start("node-batch", op, f.data.len() as u64);
            let (b, wire) = BatchView::decode(&f.body)?;
            b.validate(f.data.len())?;
            hops::mark(&mut hop, "decode");
            Metrics::inc(&shared.metrics.batch_total);
            shared
                .metrics
                .batch_commands
                .fetch_add(b.commands.len() as u64, Ordering::Relaxed);
            let (reply, data) =
                run_in_order(shared, &who, &b, wire, &f.data, &mut hop, turn).await?;
            let body = to_body(&reply);
            hops::mark(&mut hop, "reply");
            Ok(Reply {
                status: Status::Ok,
                body,
                data,
            })
        }
        Opcode::GpuSubmit => {
            // The output is held for the reply: charged before anything runs.
            let s: GpuSubmit = from_body(&f.body)?;
            if let Some(t) = turn {
                t.grow(u64::from(s.output_size))
                    .map_err(|m| Reply::err(Status::CapacityExceeded, format!("output: {m}")))?;
            }
            let _turn = submit_turn(shared, &who).await;
            submit(shared, f).await
        }
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A single session op: a one-command batch on stream 0 whose failure
/// becomes the reply status.
async fn single(
    shared: &Arc<Shared>,
    who: &Principal,
    lease: LeaseId,
    op: Op,
) -> Result<Reply, Reply> {
    let batch = Batch {
        lease,
        seq: 0,
        modules: Vec::new(),
        commands: vec![Command { stream: 0, op }],
    };
    batch.validate(0)?;
    let wire = to_body(&batch.commands);
    let (reply, _) = run_batch(
        shared,
        who,
        &BatchView::of(&batch),
        &wire,
        &[],
        &mut None,
        None,
    )
    .await?;
    match reply.error {
        Some(e) => Err(Reply::err(e.status, e.message)),
        None => Ok(Reply::empty()),
    }
}

async fn inventory(shared: &Arc<Shared>) -> Result<Reply, Reply> {
    // Fresh figures from an idle submit worker; never wait for a busy one
    // (a tenant's slow GPU_SUBMIT must not delay anyone else's inventory):
    // then the last figures seen are served.
    let idle = shared.submit.iter().find_map(|m| m.try_lock().ok());
    if let Some(mut slot) = idle {
        if let Ok(w) = ensure_worker(shared, &mut slot).await {
            if let Ok(f) = w
                .call(Opcode::GetInventory, &[], &[], shared.cfg.op_timeout)
                .await
            {
                if let Ok(info) = from_body::<DeviceInfo>(&f.body) {
                    *shared.device.lock().unwrap_or_else(|e| e.into_inner()) = info;
                }
            }
        }
    }
    let device = shared
        .device
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let t = shared.table();
    Ok(Reply::ok(&Inventory {
        node: shared.cfg.name.clone(),
        devices: vec![device],
        reservable_bytes: t.reservable(),
        active_leases: t.len() as u32,
    }))
}

/// The node's and the principal's lease-count limits.
fn lease_limits(shared: &Shared, t: &LeaseTable<Slot>, who: &Principal) -> Result<(), Reply> {
    if t.len() >= shared.cfg.max_leases {
        return Err(Reply::err(
            Status::CapacityExceeded,
            format!(
                "the node holds its limit of {} leases",
                shared.cfg.max_leases
            ),
        ));
    }
    let held = t.owned_count(who);
    if held >= shared.cfg.max_leases_per_principal {
        return Err(Reply::err(
            Status::CapacityExceeded,
            format!("principal {who} holds {held} leases, its limit (max_leases_per_principal)"),
        ));
    }
    Ok(())
}

async fn lease_alloc(
    shared: &Arc<Shared>,
    who: &Principal,
    req: LeaseAlloc,
) -> Result<Reply, Reply> {
    if req.ttl_secs == 0 {
        return Err(Reply::err(Status::BadRequest, "ttl must be at least 1 s"));
    }
    {
        let t = shared.table();
        t.check_fits(req.min_vram)?;
        lease_limits(shared, &t, who)?;
    }
    let worker = take_worker(shared)
        .await
        .map_err(|e| Reply::err(Status::Internal, e.to_string()))?;
    let free = worker.info().free_bytes;
    let id = LeaseId::random();
    let slot = Arc::new(LeaseSlot {
        worker,
        exec: tokio::sync::Mutex::new(()),
        state: StdMutex::new(LeaseState::default()),
        next_seq: tokio::sync::watch::Sender::new(1),
    });
    let now = shared.now();
    let ttl = Duration::from_secs(u64::from(req.ttl_secs));
    let granted = {
        // Checked again under the lock that grants: concurrent requests
        // cannot pass the limits together.
        let mut t = shared.table();
        lease_limits(shared, &t, who).and_then(|()| {
            t.grant(
                id,
                req.min_vram,
                ttl,
                now,
                Some(free),
                Some(who.clone()),
                slot.clone(),
            )
            .map_err(Reply::from)
        })
    };
    match granted {
        Ok(g) => {
            Metrics::inc(&shared.metrics.lease_acquired);
            info!(lease = %id, principal = %who, reserved = g.reserved, ttl = ?ttl, "lease granted");
            Ok(Reply::ok(&LeaseGrant {
                lease: id,
                generation: g.generation,
                reserved: g.reserved,
                ttl_ms: ms(g.deadline - now),
            }))
        }
        Err(e) => {
            slot.worker.kill();
            Err(e)
        }
    }
}

async fn lease_free(shared: &Arc<Shared>, id: &LeaseId) -> Result<Reply, Reply> {
    let now = shared.now();
    let removed = shared.table().remove(id, now);
    match removed {
        Some(slot) => {
            // Wait for the exit so the memory is back when the reply arrives.
            slot.worker.kill_and_wait().await;
            Metrics::inc(&shared.metrics.lease_dropped);
            info!(lease = %id, "lease freed");
            Ok(Reply::empty())
        }
        None => match shared.table().forget(id)? {
            true => Ok(Reply::empty()),
            false => Err(Reply::err(Status::NotFound, format!("no lease {id}"))),
        },
    }
}

/// A command's effect on the lease's ids, applied when it ran.
#[derive(Debug, Clone, Copy)]
enum Effect {
    None,
    Create(Id, IdKind),
    Free(Id),
}

/// What a batch's commands do to the lease, up to the first command the
/// node refuses (the commands before it go to the worker).
struct Plan {
    effects: Vec<Effect>,
    /// Bytes of the batch's write payloads the planned commands take.
    write_bytes: usize,
    /// Allocations charged to the lease, by command index.
    charged: Vec<(usize, u64)>,
    error: Option<OpError>,
}

/// What `id` is after the commands planned so far: the batch's own
/// creations and frees over the lease's state.
fn kind_of(overlay: &HashMap<Id, Option<IdKind>>, state: &LeaseState, id: Id) -> Option<IdKind> {
    match overlay.get(&id) {
        Some(k) => *k,
        None => state.ids.get(&id).copied(),
    }
}

fn plan(
    shared: &Shared,
    lease: &LeaseId,
    state: &LeaseState,
    commands: &[CommandView<'_>],
    mut turn: Option<&mut BudgetTurn>,
) -> Plan {
    let mut overlay: HashMap<Id, Option<IdKind>> = HashMap::new();
    let mut live = state.ids.len();
    let mut streams = state.streams.clone();
    let mut p = Plan {
        effects: Vec::with_capacity(commands.len()),
        write_bytes: 0,
        charged: Vec::new(),
        error: None,
    };
    let mut read_total: u64 = 0;
    let now = shared.now();
    let cfg = &shared.cfg;
    for (i, c) in commands.iter().enumerate() {
        let fail = |status: Status, message: String| OpError {
            index: i as u32,
            status,
            message: format!("command {i}: {message}"),
        };
        let kind = |id: Id| kind_of(&overlay, state, id);
        let buffer = |id: Id| match kind(id) {
            Some(IdKind::Buffer(n)) => Ok(n),
            Some(IdKind::Event) => Err(fail(
                Status::BadRequest,
                format!("{id} is an event, not a buffer"),
            )),
            None => Err(fail(Status::NotFound, format!("unknown id {id}"))),
        };
        let in_range = |size: u64, offset: u64, len: u64| {
            if offset.checked_add(len).is_none_or(|end| end > size) {
                return Err(fail(
                    Status::BadRequest,
                    format!("range {offset}+{len} is outside a buffer of {size} bytes"),
                ));
            }
            Ok(())
        };
        let fresh = |id: Id| {
            if kind(id).is_some() {
                return Err(fail(
                    Status::BadRequest,
                    format!("id {id} is already in use"),
                ));
            }
            if live >= cfg.max_ids_per_lease {
                return Err(fail(
                    Status::CapacityExceeded,
                    format!("more than {} live ids in one lease", cfg.max_ids_per_lease),
                ));
            }
            Ok(())
        };
        let stream = c.stream;
        let step = (|| -> Result<Effect, OpError> {
            if !streams.contains(&stream) && streams.len() >= cfg.max_streams_per_lease {
                return Err(fail(
                    Status::CapacityExceeded,
                    format!(
                        "stream {stream} would be more than the lease's limit of {} streams",
                        cfg.max_streams_per_lease
                    ),
                ));
            }
            Ok(match &c.op {
                OpView::Alloc { buf, size } => {
                    fresh(*buf)?;
                    shared
                        .table()
                        .charge(lease, *size, now)
                        .map_err(|e| fail(e.status, e.message))?;
                    p.charged.push((i, *size));
                    Effect::Create(*buf, IdKind::Buffer(*size))
                }
                OpView::Write { buf, offset, len } => {
                    in_range(buffer(*buf)?, *offset, u64::from(*len))?;
                    p.write_bytes += *len as usize;
                    Effect::None
                }
                OpView::Read { buf, offset, len } => {
                    in_range(buffer(*buf)?, *offset, u64::from(*len))?;
                    read_total += u64::from(*len);
                    if read_total > u64::from(cfg.limits.max_data) {
                        return Err(fail(
                            Status::BadRequest,
                            "reads exceed the reply data limit".into(),
                        ));
                    }
                    // The bytes are held for the reply until it is taken:
                    // charged to the principal before they are read.
                    if let Some(t) = turn.as_deref_mut() {
                        t.grow(u64::from(*len))
                            .map_err(|m| fail(Status::CapacityExceeded, format!("read: {m}")))?;
                    }
                    Effect::None
                }
                OpView::Free { id } => {
                    if kind(*id).is_none() {
                        return Err(fail(Status::NotFound, format!("unknown id {id}")));
                    }
                    Effect::Free(*id)
                }
                OpView::Launch(spec) => {
                    for a in &spec.args {
                        match a {
                            ArgView::Scalar(_) => {}
                            ArgView::Mem { buf, offset } => in_range(buffer(*buf)?, *offset, 0)?,
                            ArgView::Input(_) | ArgView::Output => {
                                return Err(fail(
                                    Status::BadRequest,
                                    "Input/Output are for GPU_SUBMIT".into(),
                                ))
                            }
                        }
                    }
                    Effect::None
                }
                OpView::Fill {
                    buf, offset, len, ..
                } => {
                    in_range(buffer(*buf)?, *offset, *len)?;
                    Effect::None
                }
                OpView::Copy {
                    src,
                    src_offset,
                    dst,
                    dst_offset,
                    len,
                } => {
                    in_range(buffer(*src)?, *src_offset, *len)?;
                    in_range(buffer(*dst)?, *dst_offset, *len)?;
                    if src == dst {
                        return Err(fail(
                            Status::BadRequest,
                            format!("a copy from {src} to itself"),
                        ));
                    }
                    Effect::None
                }
                OpView::Record { event } => {
                    let effect = match kind(*event) {
                        Some(IdKind::Event) => Effect::None,
                        Some(IdKind::Buffer(_)) => {
                            return Err(fail(
                                Status::BadRequest,
                                format!("{event} is a buffer, not an event"),
                            ))
                        }
                        None => {
                            fresh(*event)?;
                            Effect::Create(*event, IdKind::Event)
                        }
                    };
                    effect
                }
                OpView::Wait { event } => {
                    match kind(*event) {
                        Some(IdKind::Event) => {}
                        Some(IdKind::Buffer(_)) => {
                            return Err(fail(
                                Status::BadRequest,
                                format!("{event} is a buffer, not an event"),
                            ))
                        }
                        None => return Err(fail(Status::NotFound, format!("unknown id {event}"))),
                    }
                    Effect::None
                }
            })
        })();
        match step {
            Ok(effect) => {
                match effect {
                    Effect::Create(id, k) => {
                        overlay.insert(id, Some(k));
                        live += 1;
                    }
                    Effect::Free(id) => {
                        overlay.insert(id, None);
                        live -= 1;
                    }
                    Effect::None => {}
                }
                streams.insert(stream);
                p.effects.push(effect);
            }
            Err(e) => {
                p.error = Some(e);
                break;
            }
        }
    }
    p
}

/// The reply for a lease whose worker died or hung during a request: the
/// lease's own error if it expired or was freed meanwhile, else the lease is
/// failed.
fn worker_lost(shared: &Shared, lease: &LeaseId, e: &WorkerError) -> Reply {
    let status = match e {
        WorkerError::Hung(_) => Status::LaunchFailed,
        _ => Status::LeasePoisoned,
    };
    // Expired or freed meanwhile (the reaper ended the worker)?
    if let Err(te) = shared.table().get(lease, shared.now()) {
        return te.into();
    }
    fail_lease(shared, lease, &e.to_string());
    Reply::err(status, format!("lease poisoned: {e}"))
}

/// A module the lease's worker must load before the batch's commands.
struct Load {
    hash: ModuleHash,
    source: ModuleSource,
    /// The source came with the batch (not from the node's cache): it is
    /// cached once the lease was charged for it and loaded it.
    sent: bool,
}

/// The modules of `b` the lease has not loaded, with their sources (from
/// the batch, checked against their hashes, or the node's cache); the
/// batch's data after its module sources is returned too. Nothing enters
/// the node's cache here.
fn modules_to_load<'d>(
    shared: &Shared,
    state: &LeaseState,
    b: &BatchView<'_>,
    data: &'d [u8],
) -> Result<(Vec<Load>, &'d [u8]), Reply> {
    let mut rest = data;
    let mut loads = Vec::new();
    for m in &b.modules {
        let given = match &m.source {
            Some(t) => {
                let (text, tail) = rest.split_at(t.len as usize);
                rest = tail;
                let text_str = std::str::from_utf8(text).map_err(|_| {
                    Reply::err(Status::BadRequest, format!("module {}: not UTF-8", m.hash))
                })?;
                let actual = ModuleHash::of(&t.kind, text_str);
                if actual != m.hash {
                    return Err(Reply::err(
                        Status::BadRequest,
                        format!("module {}: its source hashes to {actual}", m.hash),
                    ));
                }
                Some(Arc::new((t.kind.clone(), text.to_vec())))
            }
            None => None,
        };
        if state.modules.contains_key(&m.hash) {
            continue;
        }
        // What the node keeps (perhaps already compiled) wins.
        let kept = shared
            .modules
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&m.hash);
        let (source, sent) = match (kept, given) {
            (Some(k), _) => (Some(k), false),
            (None, g) => (g, true),
        };
        let Some(source) = source else {
            return Err(Reply::err(
                Status::UnknownModule,
                format!(
                    "module {} is not on this node: send the batch again with its source",
                    m.hash
                ),
            ));
        };
        loads.push(Load {
            hash: m.hash,
            source,
            sent,
        });
    }
    Ok((loads, rest))
}

/// Index of the first command of `b` that launches `hash` (0 if none).
fn first_use(b: &BatchView<'_>, hash: ModuleHash) -> u32 {
    b.commands
        .iter()
        .position(|c| matches!(&c.op, OpView::Launch(s) if s.module == hash))
        .unwrap_or(0) as u32
}

/// Runs a batch after its lease's earlier numbered batches (see
/// [`Batch::seq`]), waiting at most the reorder window for them.
async fn run_in_order(
    shared: &Arc<Shared>,
    who: &Principal,
    b: &BatchView<'_>,
    wire: &[u8],
    data: &[u8],
    hop: &mut Option<HopTimer>,
    turn: Option<&mut BudgetTurn>,
) -> Result<(BatchReply, Vec<u8>), Reply> {
    if b.seq == 0 {
        hops::mark(hop, "order");
        return run_batch(shared, who, b, wire, data, hop, turn).await;
    }
    // The lease's next number after this batch; the last u64 has none (it
    // would wrap to 0 and make the owner's next batch wait the window).
    let Some(after) = b.seq.checked_add(1) else {
        return Err(Reply::err(
            Status::BadRequest,
            format!("batch number {} has no successor: numbers wrap", b.seq),
        ));
    };
    let slot = lease_of(shared, who, &b.lease)?;
    let mut next = slot.next_seq.subscribe();
    let window = shared.cfg.reorder_window;
    if tokio::time::timeout(window, next.wait_for(|n| *n >= b.seq))
        .await
        .is_err()
    {
        debug!(lease = %b.lease, seq = b.seq, "earlier batches missing: running anyway");
    }
    hops::mark(hop, "order");
    let r = run_batch(shared, who, b, wire, data, hop, turn).await;
    // Sent again with its sources, the batch keeps its place.
    if !matches!(&r, Err(reply) if reply.status == Status::UnknownModule) {
        slot.next_seq.send_if_modified(|n| {
            let advance = *n <= b.seq;
            if advance {
                *n = after;
            }
            advance
        });
    }
    r
}

/// Runs `b`, whose commands encode to `wire` (forwarded to the worker as
/// they are when the node accepts every one of them). The bytes its reads
/// return are charged to `turn` as they are planned.
async fn run_batch(
    shared: &Arc<Shared>,
    who: &Principal,
    b: &BatchView<'_>,
    wire: &[u8],
    data: &[u8],
    hop: &mut Option<HopTimer>,
    turn: Option<&mut BudgetTurn>,
) -> Result<(BatchReply, Vec<u8>), Reply> {
    let lease = &b.lease;
    let slot = lease_of(shared, who, lease)?;
    let _exec = slot.exec.lock().await;
    hops::mark(hop, "lock");
    // Re-check: the lease may have died while we waited.
    shared.table().get(lease, shared.now())?;
    let (loads, writes, p) = {
        let state = slot.state();
        let (loads, writes) = modules_to_load(shared, &state, b, data)?;
        // Module bytes count against the reservation, before anything runs.
        let mut charged = 0u64;
        for l in &loads {
            let len = l.source.1.len() as u64;
            let r = shared.table().charge(lease, len, shared.now());
            if let Err(e) = r {
                shared.table().credit(lease, charged);
                return Err(Reply::err(
                    e.status,
                    format!("module {}: {}", l.hash, e.message),
                ));
            }
            charged += len;
        }
        let p = plan(shared, lease, &state, &b.commands, turn);
        (loads, writes, p)
    };
    let n_loads = loads.len();
    let mut parts: Vec<&[u8]> = Vec::with_capacity(n_loads + 1);
    let mut worker_loads = Vec::with_capacity(n_loads);
    for l in &loads {
        worker_loads.push(WorkerLoad {
            hash: l.hash,
            kind: l.source.0.clone(),
            len: l.source.1.len() as u32,
        });
        parts.push(&l.source.1);
    }
    parts.push(&writes[..p.write_bytes]);
    let planned = p.effects.len();
    let mut error = p.error;
    let mut completed = 0usize;
    let mut loaded = 0usize;
    let mut out = Vec::new();
    hops::mark(hop, "plan");
    if n_loads + planned > 0 {
        // The worker's message is the loads, then the commands as the
        // client encoded them (the same postcard as `WorkerBatch`); only
        // a batch the node stops early has its accepted part encoded anew.
        let mut body = to_body(&worker_loads);
        if planned == b.commands.len() {
            body.extend_from_slice(wire);
        } else {
            body.extend_from_slice(&to_body(&b.commands[..planned]));
        }
        hops::mark(hop, "encode");
        let res = slot
            .worker
            .call_parts(Opcode::Batch, &body, &parts, shared.cfg.op_timeout)
            .await;
        hops::mark(hop, "worker");
        let frame = match res {
            Ok(frame) => frame,
            Err(e) => return Err(worker_lost(shared, lease, &e)),
        };
        let reply: WorkerBatchReply = from_body(&frame.body)
            .map_err(|e| Reply::err(Status::Internal, format!("worker reply: {e}")))?;
        let done = reply.completed as usize;
        loaded = done.min(n_loads);
        // Loaded and charged to this lease: now the node may keep them for
        // everyone, as this principal's (compiled PTX replaces its CUDA C).
        let mut cache = shared.modules.lock().unwrap_or_else(|e| e.into_inner());
        let (cap, share) = (
            shared.cfg.module_cache_bytes,
            shared.cfg.module_cache_bytes_per_principal,
        );
        for l in loads[..loaded].iter().filter(|l| l.sent) {
            if cache.get(&l.hash).is_none() {
                cache.insert(l.hash, l.source.clone(), who, cap, share);
            }
        }
        for (hash, ptx) in reply.compiled {
            Metrics::inc(&shared.metrics.modules_compiled);
            if loads[..loaded].iter().any(|l| l.hash == hash) {
                let entry = Arc::new((SourceKind::Ptx, ptx.into_bytes()));
                cache.insert(hash, entry, who, cap, share);
            }
        }
        drop(cache);
        completed = done.saturating_sub(n_loads).min(planned);
        out = frame.data;
        if let Some(e) = reply.error {
            if e.sticky {
                fail_lease(shared, lease, &e.message);
            }
            error = Some(if done < n_loads {
                // A module failed to load: nothing of the batch ran.
                let hash = loads[done].hash;
                OpError {
                    index: first_use(b, hash),
                    status: e.status,
                    message: format!("module {hash}: {}", e.message),
                }
            } else {
                OpError {
                    index: completed as u32,
                    status: e.status,
                    message: format!("command {completed}: {}", e.message),
                }
            });
        }
    }
    // Commit what ran; give back the charges of what did not.
    let mut table = shared.table();
    let mut state = slot.state();
    for (i, l) in loads.iter().enumerate() {
        let len = l.source.1.len() as u64;
        if i < loaded {
            state.modules.insert(l.hash, len);
        } else {
            table.credit(lease, len);
        }
    }
    for (i, size) in &p.charged {
        if *i >= completed {
            table.credit(lease, *size);
        }
    }
    for (c, effect) in b.commands.iter().zip(&p.effects).take(completed) {
        state.streams.insert(c.stream);
        match *effect {
            Effect::Create(id, k) => {
                state.ids.insert(id, k);
            }
            Effect::Free(id) => {
                if let Some(IdKind::Buffer(n)) = state.ids.remove(&id) {
                    table.credit(lease, n);
                }
            }
            Effect::None => {}
        }
    }
    hops::mark(hop, "commit");
    Ok((
        BatchReply {
            completed: completed as u32,
            error,
        },
        out,
    ))
}

async fn ensure_worker<'a>(
    shared: &Shared,
    slot: &'a mut Option<WorkerProcess>,
) -> Result<&'a WorkerProcess, WorkerError> {
    if slot.as_ref().is_some_and(|w| w.exited().is_some()) {
        *slot = None;
    }
    if slot.is_none() {
        *slot =
            Some(WorkerProcess::spawn(&shared.cfg.worker, shared.cfg.worker_start_timeout).await?);
    }
    slot.as_ref()
        .ok_or_else(|| WorkerError::Start("no worker".into()))
}

/// One request of a principal in flight, with the bytes it holds in the
/// node (body and unstreamed data, then the reply's data); given back when
/// dropped, after the reply was written or dropped.
struct BudgetTurn {
    shared: Arc<Shared>,
    who: Principal,
    bytes: u64,
}

/// Why `bytes` more do not fit beside the `held` bytes of `who`.
fn over_bytes(shared: &Shared, who: &Principal, held: u64, bytes: u64) -> Option<String> {
    (held.saturating_add(bytes) > shared.cfg.max_bytes_per_principal).then(|| {
        format!(
            "principal {who} has {held} bytes in flight; {bytes} more would pass its limit of {} \
             (max_bytes_per_principal)",
            shared.cfg.max_bytes_per_principal
        )
    })
}

impl BudgetTurn {
    fn take(shared: &Arc<Shared>, who: &Principal, bytes: u64) -> Result<Self, Reply> {
        let mut m = shared.budgets.lock().unwrap_or_else(|e| e.into_inner());
        let (requests, held) = m.entry(who.clone()).or_insert((0, 0));
        if *requests >= shared.cfg.max_requests_per_principal {
            return Err(Reply::err(
                Status::CapacityExceeded,
                format!(
                    "principal {who} has {requests} requests in flight, its limit \
                     (max_requests_per_principal)"
                ),
            ));
        }
        if let Some(why) = over_bytes(shared, who, *held, bytes) {
            return Err(Reply::err(Status::CapacityExceeded, why));
        }
        *requests += 1;
        *held += bytes;
        Ok(BudgetTurn {
            shared: shared.clone(),
            who: who.clone(),
            bytes,
        })
    }

    /// Charges `more` bytes to this request (the reply's data, before the
    /// work that makes it runs); the reason if they do not fit.
    fn grow(&mut self, more: u64) -> Result<(), String> {
        let mut m = self
            .shared
            .budgets
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let Some((_, held)) = m.get_mut(&self.who) else {
            return Err(format!("principal {} has no budget entry", self.who));
        };
        if let Some(why) = over_bytes(&self.shared, &self.who, *held, more) {
            return Err(why);
        }
        *held += more;
        self.bytes += more;
        Ok(())
    }
}

impl Drop for BudgetTurn {
    fn drop(&mut self) {
        let mut m = self
            .shared
            .budgets
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some((requests, held)) = m.get_mut(&self.who) {
            *requests -= 1;
            *held -= self.bytes;
            if *requests == 0 {
                m.remove(&self.who);
            }
        }
    }
}

/// Waits for one of the principal's GPU_SUBMIT turns (at most
/// `max_submits_per_principal` in flight): a tenant's extra submits queue
/// behind its own, never taking every submit worker from other tenants.
async fn submit_turn(shared: &Shared, who: &Principal) -> tokio::sync::OwnedSemaphorePermit {
    let sem = shared
        .submits
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(who.clone())
        .or_insert_with(|| {
            Arc::new(tokio::sync::Semaphore::new(
                shared.cfg.max_submits_per_principal.max(1),
            ))
        })
        .clone();
    sem.acquire_owned()
        .await
        .expect("the per-principal semaphore is never closed")
}

async fn submit(shared: &Arc<Shared>, f: &Frame) -> Result<Reply, Reply> {
    Metrics::inc(&shared.metrics.submit_total);
    let r = submit_inner(shared, f).await;
    match &r {
        Ok(reply) => {
            shared
                .metrics
                .submit_output_bytes
                .fetch_add(reply.data.len() as u64, Ordering::Relaxed);
        }
        Err(_) => Metrics::inc(&shared.metrics.submit_errors),
    }
    r
}

async fn submit_inner(shared: &Arc<Shared>, f: &Frame) -> Result<Reply, Reply> {
    let s: GpuSubmit = from_body(&f.body)?;
    s.validate(f.data.len(), &shared.cfg.limits)?;
    if shared.submit.is_empty() {
        return Err(Reply::err(
            Status::Internal,
            "this node has no submit workers",
        ));
    }
    // Prefer an idle worker, else wait on the next in turn.
    let n = shared.submit.len();
    let start = shared.submit_next.fetch_add(1, Ordering::Relaxed);
    let mut guard = None;
    for k in 0..n {
        if let Ok(g) = shared.submit[(start + k) % n].try_lock() {
            guard = Some(g);
            break;
        }
    }
    let mut guard = match guard {
        Some(g) => g,
        None => shared.submit[start % n].lock().await,
    };
    let w = ensure_worker(shared, &mut guard)
        .await
        .map_err(|e| Reply::err(Status::Internal, e.to_string()))?;
    match w
        .call(Opcode::GpuSubmit, &f.body, &f.data, shared.cfg.op_timeout)
        .await
    {
        Ok(frame) if frame.header.status == Status::Ok => Ok(Reply {
            status: Status::Ok,
            body: Vec::new(),
            data: frame.data,
        }),
        Ok(frame) => {
            let fail: WorkerFailure = from_body(&frame.body).unwrap_or(WorkerFailure {
                status: frame.header.status,
                message: "worker error".into(),
                sticky: false,
            });
            if fail.sticky {
                // The worker's context is poisoned: replace it.
                if let Some(w) = guard.take() {
                    w.kill();
                }
            }
            Err(Reply::err(fail.status, fail.message))
        }
        Err(e) => {
            guard.take();
            Err(Reply::err(Status::LaunchFailed, e.to_string()))
        }
    }
}
