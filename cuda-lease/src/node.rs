//! The node: QUIC endpoint, auth, lease table, reaper, worker supervision and
//! metrics. The node process never touches CUDA; each lease's work runs in its
//! own worker process ([`crate::worker`]).

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex as StdMutex, OnceLock};
use std::time::Duration;

use rustls::pki_types::CertificateDer;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

mod stream;

use crate::clock::{Clock, MonotonicClock};
use crate::hops::{self, HopTimer};
use crate::lease_table::{LeaseTable, Principal, TableError};
use crate::metrics::Metrics;
use crate::proto::{
    self, from_body, to_body, Batch, BatchOp, BatchReply, DeviceInfo, ErrorBody, Frame, GpuSubmit,
    Handle, HandleOp, HandleRef, HandleReply, Header, Hello, HelloOk, Inventory, KernelArg,
    LeaseAlloc, LeaseGrant, LeaseId, LeaseRef, LeaseRenew, Limits, MemAlloc, OpError, OpResult,
    Opcode, Status,
};
use crate::tls::{self, Identity, TlsError};
use crate::worker::{
    WorkerArg, WorkerBatch, WorkerBatchReply, WorkerError, WorkerFailure, WorkerOp, WorkerProcess,
    WorkerSpec,
};

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HandleKind {
    /// Memory of this many bytes.
    Mem(u64),
    /// A module of this many bytes of PTX (charged to the lease like
    /// memory: a loaded module costs device memory too).
    Module(u64),
}

impl HandleKind {
    /// The bytes charged to the lease for it.
    fn bytes(self) -> u64 {
        match self {
            HandleKind::Mem(b) | HandleKind::Module(b) => b,
        }
    }
}

struct LeaseSlot {
    worker: WorkerProcess,
    /// Serializes a lease's requests: plan, run on the worker, commit.
    exec: tokio::sync::Mutex<()>,
    handles: StdMutex<HashMap<Handle, HandleKind>>,
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
        let shared = shared.clone();
        tokio::spawn(async move {
            let conn = match incoming.await {
                Ok(c) => c,
                Err(e) => {
                    debug!(error = %e, "handshake failed");
                    return;
                }
            };
            let peer: Arc<Peer> = Arc::default();
            if let Some(p) = cert_principal(&conn) {
                let _ = peer.set(p);
            }
            debug!(remote = %conn.remote_address(), principal = ?peer.get(), "connection");
            loop {
                let (send, recv) = match conn.accept_bi().await {
                    Ok(s) => s,
                    Err(_) => break,
                };
                let shared = shared.clone();
                let peer = peer.clone();
                tokio::spawn(async move { serve_stream(shared, peer, send, recv).await });
            }
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
            return;
        }
        Ok(Ok(Ok(x))) => Ok(Ok(x)),
        Ok(Err(e)) => Ok(Err(e)),
        Err(elapsed) => Err(elapsed),
    };
    let _turn = turn;
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
            // A module must fit its lease's reservation before its bytes
            // are read.
            if header.opcode == Opcode::ModuleLoad && peer.get().is_some() {
                let room = from_body::<LeaseRef>(&body)
                    .map_err(Reply::from)
                    .and_then(|r| {
                        let who = principal(&peer)?;
                        let mut t = shared.table();
                        t.check_owner(&r.lease, Some(who))?;
                        Ok(t.check_room(&r.lease, u64::from(header.data_len), shared.now())?)
                    });
                if let Err(reply) = room {
                    refuse(&mut send, &mut recv, &header, &reply).await;
                    return;
                }
            }
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
    let (req, reply) = match read {
        Ok(Ok(frame)) => {
            if let Some(t) = &mut hop {
                t.mark("read");
                t.set_op(frame.header.opcode, frame.data.len() as u64);
            }
            let reply = dispatch(&shared, &peer, &frame).await;
            if let Some(t) = &mut hop {
                t.mark("dispatch");
                let bytes = frame.data.len().max(reply.data.len()) as u64;
                t.set_op(frame.header.opcode, bytes);
            }
            (frame.header, reply)
        }
        Ok(Err(e)) => {
            let msg = match proto::proto_error(&e) {
                Some(p) => p.to_string(),
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
        if proto::write_frame(&mut send, &h, &reply.body, &reply.data)
            .await
            .is_ok()
        {
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

/// Who is on a connection: set once, by a client certificate or HELLO.
type Peer = OnceLock<Principal>;

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

async fn dispatch(shared: &Arc<Shared>, peer: &Peer, f: &Frame) -> Reply {
    match dispatch_inner(shared, peer, f).await {
        Ok(r) | Err(r) => r,
    }
}

async fn dispatch_inner(shared: &Arc<Shared>, peer: &Peer, f: &Frame) -> Result<Reply, Reply> {
    let op = f.header.opcode;
    if f.header.is_reply() {
        return Err(Reply::err(Status::BadRequest, "a reply is not a request"));
    }
    if !matches!(
        op,
        Opcode::MemWrite | Opcode::ModuleLoad | Opcode::Batch | Opcode::GpuSubmit
    ) && !f.data.is_empty()
    {
        return Err(Reply::err(
            Status::BadRequest,
            format!("{op:?} takes no data"),
        ));
    }
    if op == Opcode::Hello {
        let h: Hello = from_body(&f.body)?;
        // Client-supplied: escaped before it reaches a log line.
        let client = h.client.escape_debug().to_string();
        let who = peer.get().cloned().or_else(|| {
            token_principal(shared, &h.token).or_else(|| {
                shared
                    .cfg
                    .allow_anonymous
                    .then(|| Principal::from("anonymous"))
            })
        });
        if let Some(who) = who {
            let who = peer.get_or_init(|| who);
            debug!(%client, principal = %who, "authenticated");
            return Ok(Reply::ok(&HelloOk {
                node: shared.cfg.name.clone(),
            }));
        }
        warn!(%client, "rejected credentials");
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
            single(
                shared,
                &who,
                m.lease,
                BatchOp::MemAlloc { size: m.size },
                &[],
            )
            .await
        }
        // Served as streams by `stream::serve`, never dispatched whole.
        Opcode::MemWrite | Opcode::MemRead => Err(Reply::err(
            Status::Internal,
            format!("{op:?} is served as a stream"),
        )),
        Opcode::MemFree => {
            let m: HandleOp = from_body(&f.body)?;
            single(
                shared,
                &who,
                m.lease,
                BatchOp::MemFree {
                    target: HandleRef::Id(m.handle),
                },
                &[],
            )
            .await
        }
        Opcode::ModuleLoad => {
            let m: LeaseRef = from_body(&f.body)?;
            single(
                shared,
                &who,
                m.lease,
                BatchOp::ModuleLoad {
                    len: f.data.len() as u32,
                },
                &f.data,
            )
            .await
        }
        Opcode::Launch => {
            let m: proto::Launch = from_body(&f.body)?;
            single(shared, &who, m.lease, BatchOp::Launch(m.spec), &[]).await
        }
        Opcode::Sync => {
            let m: LeaseRef = from_body(&f.body)?;
            single(shared, &who, m.lease, BatchOp::Sync, &[]).await
        }
        Opcode::Batch => {
            let b: Batch = from_body(&f.body)?;
            b.validate(f.data.len())?;
            let (reply, data) = run_batch(shared, &who, &b.lease, &b.ops, &f.data).await?;
            Ok(Reply {
                status: Status::Ok,
                body: to_body(&reply),
                data,
            })
        }
        Opcode::GpuSubmit => {
            let _turn = submit_turn(shared, &who).await;
            submit(shared, f).await
        }
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A single session op: a one-op batch whose failure becomes the reply status.
async fn single(
    shared: &Arc<Shared>,
    who: &Principal,
    lease: LeaseId,
    op: BatchOp,
    data: &[u8],
) -> Result<Reply, Reply> {
    let batch = Batch {
        lease,
        ops: vec![op],
    };
    batch.validate(data.len())?;
    let (reply, _) = run_batch(shared, who, &lease, &batch.ops, data).await?;
    if let Some(e) = reply.error {
        return Err(Reply::err(e.status, e.message));
    }
    Ok(match reply.results.first() {
        Some(OpResult::Handle(h)) => Reply::ok(&HandleReply { handle: *h }),
        _ => Reply::empty(),
    })
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
        handles: StdMutex::new(HashMap::new()),
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

/// The worker's id of a v1 handle (its first 8 bytes).
pub(crate) fn worker_id(h: Handle) -> proto::Id {
    let mut b = [0u8; 8];
    b.copy_from_slice(&h.0[..8]);
    proto::Id(u64::from_le_bytes(b))
}

/// The worker's name of a v1 module handle.
fn worker_module(h: Handle) -> proto::ModuleHash {
    let mut b = [0u8; 32];
    b[..16].copy_from_slice(&h.0);
    proto::ModuleHash(b)
}

/// The event a v1 SYNC records (the batch's end waits for every stream).
const SYNC_EVENT: proto::Id = proto::Id(u64::MAX);

fn resolve(
    handles: &HashMap<Handle, HandleKind>,
    made: &[Option<(Handle, HandleKind)>],
    freed: &HashSet<Handle>,
    r: &HandleRef,
    want: Option<HandleKind>,
    i: usize,
) -> Result<(Handle, HandleKind), OpError> {
    let fail = |status: Status, message: &str| OpError {
        index: i as u32,
        status,
        message: message.into(),
    };
    let found = match r {
        HandleRef::Id(h) => handles
            .get(h)
            .map(|k| (*h, *k))
            .or_else(|| made.iter().flatten().find(|(m, _)| m == h).copied()),
        HandleRef::Op(n) => made.get(*n as usize).copied().flatten(),
    };
    match found {
        Some((h, k)) if !freed.contains(&h) => match (want, k) {
            (None, _)
            | (Some(HandleKind::Module(_)), HandleKind::Module(_))
            | (Some(HandleKind::Mem(_)), HandleKind::Mem(_)) => Ok((h, k)),
            _ => Err(fail(Status::BadRequest, "handle is of the wrong kind")),
        },
        _ => Err(fail(Status::NotFound, "no such handle in this lease")),
    }
}

/// A planned worker op, its result, and the handle it makes.
type PlannedOp = (WorkerOp, OpResult, Option<(Handle, HandleKind)>);

struct Plan {
    ops: Vec<WorkerOp>,
    results: Vec<OpResult>,
    /// Allocations charged to the lease, by op index.
    charged: Vec<(usize, Handle, HandleKind)>,
    data_used: usize,
    error: Option<OpError>,
}

fn plan(
    shared: &Shared,
    lease: &LeaseId,
    slot: &LeaseSlot,
    ops: &[BatchOp],
    data_len: usize,
) -> Result<Plan, Reply> {
    let handles = slot
        .handles
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let mut made: Vec<Option<(Handle, HandleKind)>> = Vec::with_capacity(ops.len());
    let mut freed: HashSet<Handle> = HashSet::new();
    let mut p = Plan {
        ops: Vec::new(),
        results: Vec::new(),
        charged: Vec::new(),
        data_used: 0,
        error: None,
    };
    let mut read_total: u64 = 0;
    let now = shared.now();
    for (i, op) in ops.iter().enumerate() {
        let fail = |status: Status, message: String| OpError {
            index: i as u32,
            status,
            message,
        };
        let mem = Some(HandleKind::Mem(0));
        let step: Result<PlannedOp, OpError> = (|| match op {
            BatchOp::MemAlloc { size } => {
                shared
                    .table()
                    .charge(lease, *size, now)
                    .map_err(|e| fail(e.status, e.message))?;
                let h = Handle::random();
                p.charged.push((i, h, HandleKind::Mem(*size)));
                Ok((
                    WorkerOp::Alloc {
                        stream: 0,
                        id: worker_id(h),
                        size: *size,
                    },
                    OpResult::Handle(h),
                    Some((h, HandleKind::Mem(*size))),
                ))
            }
            BatchOp::MemWrite {
                target,
                offset,
                len,
            } => {
                let (h, _) = resolve(&handles, &made, &freed, target, mem, i)?;
                p.data_used += *len as usize;
                Ok((
                    WorkerOp::Write {
                        stream: 0,
                        id: worker_id(h),
                        offset: *offset,
                        len: *len,
                    },
                    OpResult::Done,
                    None,
                ))
            }
            BatchOp::MemRead {
                source,
                offset,
                len,
            } => {
                let (h, _) = resolve(&handles, &made, &freed, source, mem, i)?;
                read_total += u64::from(*len);
                if read_total > u64::from(shared.cfg.limits.max_data) {
                    return Err(fail(
                        Status::BadRequest,
                        "reads exceed the reply data limit".into(),
                    ));
                }
                Ok((
                    WorkerOp::Read {
                        stream: 0,
                        id: worker_id(h),
                        offset: *offset,
                        len: *len,
                    },
                    OpResult::Read(*len),
                    None,
                ))
            }
            BatchOp::MemFree { target } => {
                let (h, kind) = resolve(&handles, &made, &freed, target, None, i)?;
                freed.insert(h);
                let op = match kind {
                    HandleKind::Mem(_) => WorkerOp::Free {
                        stream: 0,
                        id: worker_id(h),
                    },
                    HandleKind::Module(_) => WorkerOp::UnloadModule {
                        hash: worker_module(h),
                    },
                };
                Ok((op, OpResult::Done, None))
            }
            BatchOp::ModuleLoad { len } => {
                // Module bytes count against the reservation.
                shared
                    .table()
                    .charge(lease, u64::from(*len), now)
                    .map_err(|e| fail(e.status, e.message))?;
                let h = Handle::random();
                let kind = HandleKind::Module(u64::from(*len));
                p.charged.push((i, h, kind));
                p.data_used += *len as usize;
                Ok((
                    WorkerOp::LoadModule {
                        hash: worker_module(h),
                        kind: proto::SourceKind::Ptx,
                        len: *len,
                    },
                    OpResult::Handle(h),
                    Some((h, kind)),
                ))
            }
            BatchOp::Launch(spec) => {
                let (module, _) = resolve(
                    &handles,
                    &made,
                    &freed,
                    &spec.module,
                    Some(HandleKind::Module(0)),
                    i,
                )?;
                let mut args = Vec::with_capacity(spec.args.len());
                for a in &spec.args {
                    args.push(match a {
                        KernelArg::Scalar(b) => WorkerArg::Scalar(b.clone()),
                        KernelArg::Mem { handle, offset } => {
                            let (h, _) = resolve(&handles, &made, &freed, handle, mem, i)?;
                            WorkerArg::Mem {
                                id: worker_id(h),
                                offset: *offset,
                            }
                        }
                        KernelArg::Input(_) | KernelArg::Output => {
                            return Err(fail(
                                Status::BadRequest,
                                "Input/Output are for GPU_SUBMIT".into(),
                            ))
                        }
                    });
                }
                let d = [
                    spec.grid[0],
                    spec.grid[1],
                    spec.grid[2],
                    spec.block[0],
                    spec.block[1],
                    spec.block[2],
                    spec.shared_mem,
                ];
                Ok((
                    WorkerOp::Launch {
                        stream: 0,
                        module: worker_module(module),
                        kernel: spec.kernel.clone(),
                        dims: d,
                        args,
                    },
                    OpResult::Done,
                    None,
                ))
            }
            BatchOp::Sync => Ok((
                WorkerOp::Record {
                    stream: 0,
                    event: SYNC_EVENT,
                },
                OpResult::Done,
                None,
            )),
        })();
        match step {
            Ok((wop, res, new)) => {
                p.ops.push(wop);
                p.results.push(res);
                made.push(new);
            }
            Err(e) => {
                p.error = Some(e);
                break;
            }
        }
    }
    debug_assert!(p.data_used <= data_len);
    Ok(p)
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

async fn run_batch(
    shared: &Arc<Shared>,
    who: &Principal,
    lease: &LeaseId,
    ops: &[BatchOp],
    data: &[u8],
) -> Result<(BatchReply, Vec<u8>), Reply> {
    let slot = lease_of(shared, who, lease)?;
    let _exec = slot.exec.lock().await;
    // Re-check: the lease may have died while we waited.
    shared.table().get(lease, shared.now())?;
    let mut p = plan(shared, lease, &slot, ops, data.len())?;
    let mut out = Vec::new();
    let mut completed = 0usize;
    if !p.ops.is_empty() {
        let body = to_body(&WorkerBatch {
            ops: std::mem::take(&mut p.ops),
        });
        let res = slot
            .worker
            .call(
                Opcode::Batch,
                &body,
                &data[..p.data_used],
                shared.cfg.op_timeout,
            )
            .await;
        match res {
            Ok(frame) => {
                let reply: WorkerBatchReply = from_body(&frame.body)
                    .map_err(|e| Reply::err(Status::Internal, format!("worker reply: {e}")))?;
                completed = reply.completed as usize;
                out = frame.data;
                if let Some(e) = reply.error {
                    if e.sticky {
                        fail_lease(shared, lease, &e.message);
                    }
                    p.error = Some(OpError {
                        index: completed as u32,
                        status: e.status,
                        message: e.message,
                    });
                }
            }
            Err(e) => return Err(worker_lost(shared, lease, &e)),
        }
    }
    // Commit what ran; return charges of allocations that did not.
    let mut table = shared.table();
    let mut handles = slot.handles.lock().unwrap_or_else(|e| e.into_inner());
    for (i, h, kind) in &p.charged {
        if *i >= completed {
            table.credit(lease, kind.bytes());
        } else {
            handles.insert(*h, *kind);
        }
    }
    for op in ops.iter().take(completed) {
        if let BatchOp::MemFree { target } = op {
            let h = match target {
                HandleRef::Id(h) => Some(*h),
                HandleRef::Op(n) => match p.results.get(*n as usize) {
                    Some(OpResult::Handle(h)) => Some(*h),
                    _ => None,
                },
            };
            if let Some(kind) = h.and_then(|h| handles.remove(&h)) {
                table.credit(lease, kind.bytes());
            }
        }
    }
    p.results.truncate(completed);
    Ok((
        BatchReply {
            results: p.results,
            error: p.error,
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
/// node (body and unstreamed data); given back when dropped.
struct BudgetTurn {
    shared: Arc<Shared>,
    who: Principal,
    bytes: u64,
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
        if held.saturating_add(bytes) > shared.cfg.max_bytes_per_principal {
            return Err(Reply::err(
                Status::CapacityExceeded,
                format!(
                    "principal {who} has {held} bytes in flight; {bytes} more would pass its \
                     limit of {} (max_bytes_per_principal)",
                    shared.cfg.max_bytes_per_principal
                ),
            ));
        }
        *requests += 1;
        *held += bytes;
        Ok(BudgetTurn {
            shared: shared.clone(),
            who: who.clone(),
            bytes,
        })
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
