//! The node: QUIC endpoint, auth, lease table, reaper, workers and metrics.
//! It never touches CUDA; each lease has its own worker ([`crate::worker`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use rustls::pki_types::CertificateDer;
use tokio::task::JoinHandle;
use tracing::{info, warn};

mod auth;
mod batch;
mod bucket;
mod bulk;
mod config;
mod connection;
mod direct;
mod dispatch;
mod handshake;
mod held;
mod lease;
mod modules;

mod stream;
mod submit;

use self::connection::accept_loop;
pub use config::{BulkListen, NodeConfig, NodeError, TlsSource};
pub use connection::PREAUTH_MAX_BODY;

pub use handshake::REJECTED_LOG_INTERVAL;

use crate::lease_table::{LeaseTable, Principal, TableError};
use crate::lock;
use crate::metrics::Metrics;
use crate::proto::{self, to_body, DeviceInfo, ErrorBody, LeaseId, Status};
use crate::tls::{self, Identity};
use crate::worker::{WorkerError, WorkerProcess};
use handshake::{HandshakeLimits, Handshakes};
use held::HeldData;
pub use lease::LeaseUsage;
use lease::{LeaseSlot, LeaseView};
use modules::{ModuleCache, ModuleSource};

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
    /// Lease worker starts per principal (a token bucket each).
    worker_starts: StdMutex<HashMap<Principal, bucket::TokenBucket>>,
    /// Requests and bytes in flight per principal.
    budgets: StdMutex<HashMap<Principal, (usize, u64)>>,
    /// The shared counters of principals with direct leases (lock order:
    /// `budgets`, then this).
    direct_budgets: StdMutex<HashMap<Principal, std::sync::Weak<crate::budget::BudgetFile>>>,
    modules: StdMutex<ModuleCache>,
    /// Connections waiting for HELLO and failed HELLOs.
    handshakes: Arc<Handshakes>,
    /// The bulk-data channel's port and tickets.
    bulk: bulk::Tickets,
    metrics: Metrics,
}

/// A running node. Dropping it stops serving and kills every worker;
/// [`Node::shutdown`] does the same and waits for the workers to exit.
pub struct Node {
    addr: SocketAddr,
    bulk_addr: Option<SocketAddr>,
    metrics_addr: Option<SocketAddr>,
    cert: CertificateDer<'static>,
    endpoint: quinn::Endpoint,
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
    /// The registration in a fleet's registry, if configured.
    #[cfg(feature = "fleet")]
    registrar: Option<crate::registrar::Registrar>,
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
    /// Data the worker keeps for this reply, read as the client takes it.
    held: Option<HeldData>,
}

impl Reply {
    fn new(status: Status, body: Vec<u8>) -> Self {
        Self {
            status,
            body,
            data: Vec::new(),
            held: None,
        }
    }
    fn ok<T: serde::Serialize>(msg: &T) -> Self {
        Self::new(Status::Ok, to_body(msg))
    }
    fn empty() -> Self {
        Self::new(Status::Ok, Vec::new())
    }
    fn err(status: Status, message: impl Into<String>) -> Self {
        let message = message.into();
        Self::new(status, to_body(&ErrorBody { message }))
    }
}

impl From<TableError> for Reply {
    fn from(e: TableError) -> Self {
        Reply::err(e.status, e.message)
    }
}

impl From<proto::ProtoError> for Reply {
    /// Unparsable: MALFORMED; parsable but breaking a protocol rule: BAD_REQUEST.
    fn from(e: proto::ProtoError) -> Self {
        let status = match e {
            proto::ProtoError::Invalid(_) => Status::BadRequest,
            _ => Status::Malformed,
        };
        Reply::err(status, e.to_string())
    }
}

/// The node's TLS identity (also the bulk channel's) and QUIC server
/// configuration; refuses a configuration without any credentials.
fn tls_setup(cfg: &NodeConfig) -> Result<(Identity, quinn::ServerConfig), NodeError> {
    let identity = match &cfg.tls {
        TlsSource::SelfSigned { names, write_pem } => {
            let id = tls::self_signed(names)?;
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
    cfg.transport
        .validate()
        .map_err(|e| NodeError::Config(e.to_string()))?;
    let server_cfg = tls::server_config(&identity, client_ca.as_deref(), &cfg.transport)?;
    Ok((identity, server_cfg))
}

type SubmitWorkers = Vec<tokio::sync::Mutex<Option<WorkerProcess>>>;

/// Probes the device through a worker (kept as the first submit worker) and
/// starts the pool; returns the device figures, lease capacity and pool.
async fn start_workers(cfg: &NodeConfig) -> Result<(DeviceInfo, u64, SubmitWorkers), NodeError> {
    let probe = WorkerProcess::spawn(&cfg.worker, cfg.worker_start_timeout)
        .await
        .map_err(|e| NodeError::Device(e.to_string()))?;
    let info = probe.info().clone();
    let capacity = cfg
        .capacity
        .unwrap_or(info.free_bytes.saturating_sub(cfg.headroom));
    info!(device = %info.name, total = info.total_bytes, free = info.free_bytes, capacity, "device probed");
    // All submit workers start now so their contexts are already counted
    // in the free memory leases are measured against.
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
    Ok((info, capacity, submit))
}

impl Shared {
    fn now(&self) -> Duration {
        self.cfg.clock.now()
    }

    fn table(&self) -> std::sync::MutexGuard<'_, LeaseTable<Slot>> {
        lock(&self.table)
    }

    /// The node's state at start: `capacity` lease bytes on `info`'s device.
    fn new(cfg: NodeConfig, capacity: u64, info: DeviceInfo, submit: SubmitWorkers) -> Self {
        Shared {
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
            device: StdMutex::new(info),
            submits: StdMutex::default(),
            worker_starts: StdMutex::default(),
            budgets: StdMutex::default(),
            direct_budgets: StdMutex::default(),
            modules: StdMutex::default(),
            handshakes: Handshakes::new(HandshakeLimits {
                max_unauthenticated: cfg.max_unauthenticated,
                max_unauthenticated_per_source: cfg.max_unauthenticated_per_source,
                max_queued: cfg.max_queued_handshakes,
                max_queued_per_source: cfg.max_queued_handshakes_per_source,
                max_failed_hellos_per_source: cfg.max_failed_hellos_per_source,
            }),
            bulk: bulk::Tickets::default(),
            metrics: Metrics::default(),
            cfg,
        }
    }

    /// The metrics text now, with the gauges read from the lease table.
    fn render_metrics(&self) -> String {
        self.metrics
            .handshakes_waiting
            .set(self.handshakes.waiting() as u64);
        let t = self.table();
        self.metrics.render(t.allocated_total(), t.len() as u64)
    }
}

/// Binds the configured metrics port, serving it among `tasks`; its address.
async fn serve_metrics(
    shared: &Arc<Shared>,
    tasks: &mut Vec<JoinHandle<()>>,
) -> Result<Option<SocketAddr>, NodeError> {
    let Some(m) = shared.cfg.metrics_listen else {
        return Ok(None);
    };
    let listener = tokio::net::TcpListener::bind(m).await?;
    let addr = listener.local_addr()?;
    let s = shared.clone();
    let serve = crate::metrics::serve(listener, move || s.render_metrics());
    tasks.push(tokio::spawn(serve));
    Ok(Some(addr))
}

impl Node {
    /// Starts a node: probes the device, binds the QUIC endpoint and metrics
    /// port, and starts the reaper. Needs a tokio runtime.
    ///
    /// # Errors
    /// [`NodeError`]; a machine without a driver gives
    /// `NodeError::Device("... no NVIDIA driver found")` for a CUDA device.
    pub async fn start(cfg: NodeConfig) -> Result<Node, NodeError> {
        let (identity, server_cfg) = tls_setup(&cfg)?;
        let (info, capacity, submit) = start_workers(&cfg).await?;
        let endpoint = cfg.transport.endpoint(cfg.listen, Some(server_cfg))?;
        let addr = endpoint.local_addr()?;
        #[cfg(feature = "fleet")]
        let advertise = registry_address(&cfg, addr)?;
        let shared = Arc::new(Shared::new(cfg, capacity, info, submit));
        let mut tasks = Vec::new();
        let metrics_addr = serve_metrics(&shared, &mut tasks).await?;
        let bulk_tcp = bulk::bind(&shared, addr).await?;
        let bulk_addr = bulk_tcp.as_ref().map(|l| l.local_addr()).transpose()?;
        if let Some(listener) = bulk_tcp {
            let acceptor = tokio_rustls::TlsAcceptor::from(tls::bulk_server_config(&identity)?);
            let accept = bulk::accept_loop(shared.clone(), listener, acceptor);
            tasks.push(tokio::spawn(accept));
        }
        tasks.push(tokio::spawn(reaper(shared.clone())));
        tasks.push(tokio::spawn(accept_loop(shared.clone(), endpoint.clone())));
        refill(shared.clone());
        info!(%addr, ?bulk_addr, ?metrics_addr, "node listening");
        Ok(Node {
            addr,
            bulk_addr,
            metrics_addr,
            cert: identity.leaf().clone(),
            endpoint,
            #[cfg(feature = "fleet")]
            registrar: advertise.map(|a| register(&shared, a, identity.leaf())),
            shared,
            tasks,
        })
    }

    /// Runs a node in this process on 127.0.0.1:0 (metrics too) with a fresh
    /// self-signed certificate, for tests and demos. Workers are still
    /// processes: `cfg.worker.program` must call [`crate::worker::main_if_worker`].
    ///
    /// # Errors
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

    /// The bulk-data channel's TCP address, if it is on.
    pub fn bulk_addr(&self) -> Option<SocketAddr> {
        self.bulk_addr
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
        self.shared.render_metrics()
    }

    /// What the node holds for lease `id` as of its last answered batch
    /// (`None` once gone); after a failed submission, what the commands that
    /// ran left (see [`cuda_lease::remote`]).
    pub fn lease_usage(&self, id: &LeaseId) -> Option<LeaseUsage> {
        let (slot, allocated) = {
            let t = self.shared.table();
            let now = self.shared.now();
            let allocated = t.status(id, now).ok()?.allocated;
            (t.get(id, now).ok()?, allocated)
        };
        let state = slot.state();
        let u = state.usage;
        Some(LeaseUsage {
            allocated,
            buffers: u.buffers as usize,
            events: u.events as usize,
            graphs: u.graphs as usize,
            streams: u.streams as usize,
            modules: state.modules.len(),
            staging: u.staging,
        })
    }

    /// Stops accepting, frees every lease and waits for the workers to exit.
    pub async fn shutdown(mut self) {
        #[cfg(feature = "fleet")]
        if let Some(r) = self.registrar.take() {
            // Leave the registry first so no client is sent here.
            r.leave().await;
        }
        self.endpoint
            .close(proto::CLOSE_NODE_SHUTDOWN.into(), b"node shutting down");
        self.tasks.drain(..).for_each(|t| t.abort());
        let now = self.shared.now();
        let leases = self.shared.table().drain(now);
        for (id, slot) in leases {
            slot.order.update(crate::order::OrderState::end);
            slot.worker.kill_and_wait().await;
            self.shared.metrics.lease_dropped.inc();
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
        self.endpoint
            .close(proto::CLOSE_NODE_SHUTDOWN.into(), b"node dropped");
        self.tasks.iter().for_each(JoinHandle::abort);
        let now = self.shared.now();
        for (_, slot) in self.shared.table().drain(now) {
            slot.end();
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

/// The address the registry record gives: the configured one, or the QUIC
/// address, which must then be reachable by clients.
#[cfg(feature = "fleet")]
fn registry_address(
    cfg: &NodeConfig,
    addr: SocketAddr,
) -> Result<Option<(SocketAddr, crate::fleet::RegistryConfig)>, NodeError> {
    let Some(r) = &cfg.registry else {
        return Ok(None);
    };
    if cfg.name.is_empty() || cfg.name.contains('/') {
        return Err(NodeError::Config(format!(
            "a registered node needs a name without '/' (got {:?})",
            cfg.name
        )));
    }
    let a = r.advertise.unwrap_or(addr);
    if a.ip().is_unspecified() || a.port() == 0 {
        return Err(NodeError::Config(format!(
            "the registry needs an address clients can reach, and the node listens on {addr}: set the address to advertise (`--advertise HOST:PORT`)"
        )));
    }
    Ok(Some((a, r.clone())))
}

/// Starts writing the node's record, as `address`, to the registry.
#[cfg(feature = "fleet")]
fn register(
    shared: &Arc<Shared>,
    (address, cfg): (SocketAddr, crate::fleet::RegistryConfig),
    cert: &CertificateDer<'static>,
) -> crate::registrar::Registrar {
    use crate::fleet::{fingerprint, DeviceRecord, NodeRecord};
    let cert_sha256 = fingerprint(cert);
    let labels = cfg.labels.clone();
    let s = shared.clone();
    let snapshot = Arc::new(move || {
        let d = lock(&s.device).clone();
        let t = s.table();
        NodeRecord {
            name: s.cfg.name.clone(),
            address,
            cert_sha256: cert_sha256.clone(),
            devices: vec![DeviceRecord {
                ordinal: d.ordinal,
                name: d.name,
                total_bytes: d.total_bytes,
                compute_capability: d.compute_capability,
            }],
            capacity_bytes: t.capacity(),
            reservable_bytes: t.reservable(),
            active_leases: u32::try_from(t.len()).unwrap_or(u32::MAX),
            protocol: proto::VERSION,
            labels: labels.clone(),
        }
    });
    crate::registrar::spawn(cfg, snapshot)
}

fn refill(shared: Arc<Shared>) {
    if shared.cfg.prestart_workers == 0 || shared.refilling.swap(true, Ordering::SeqCst) {
        return;
    }
    tokio::spawn(async move {
        while shared.prestarted.lock().await.len() < shared.cfg.prestart_workers {
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
    // Exited workers are popped and dropped (which kills them).
    let ready = {
        let mut pool = shared.prestarted.lock().await;
        std::iter::from_fn(|| pool.pop()).find(|w| w.exited().is_none())
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
            // Ending the worker frees its memory, modules and context.
            slot.end();
            shared.metrics.lease_dropped.inc();
            info!(lease = %id, "lease expired; worker ended");
        }
        let live = shared.table().payloads();
        for (id, slot) in live {
            if slot.is_direct() && !slot.refreshing.swap(true, Ordering::AcqRel) {
                // A direct lease's batches do not pass the node: what it
                // holds, and whether a fault ended it, come from its worker.
                let shared = shared.clone();
                tokio::spawn(async move {
                    let _ = direct::refresh_slot(&shared, &id, &slot).await;
                    slot.refreshing.store(false, Ordering::Release);
                });
                continue;
            }
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
        slot.end();
        shared.metrics.lease_dropped.inc();
        warn!(lease = %id, reason, "lease failed");
    }
}
