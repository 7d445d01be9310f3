//! The client: a QUIC connection to a node, leases with background renewal,
//! sessions with RAII memory and module handles, batches, and the stateless
//! [`Client::gpu_call`].

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use rustls::pki_types::CertificateDer;
use serde::{de::DeserializeOwned, Serialize};
use tokio::task::JoinHandle;

use crate::hops::{self, HopTimer};
use crate::proto::{
    self, from_body, to_body, Batch, BatchReply, Command, CommandView, ErrorBody, GpuSubmit,
    Header, Hello, HelloOk, Id, IdOp, Inventory, KernelArg, LaunchSpec, LeaseAlloc, LeaseGrant,
    LeaseId, LeaseRef, LeaseRenew, LeaseStatus, Limits, MemAlloc, MemRead, MemWrite, ModuleHash,
    ModuleText, ModuleUse, Op, OpError, Opcode, SourceKind, Status, StreamId,
};
use crate::tls::{self, Identity};

/// Client-side errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// Credentials were rejected.
    #[error("unauthorized: {0}")]
    Unauthorized(String),
    /// The lease's TTL ran out.
    #[error("lease expired: {0}")]
    LeaseExpired(String),
    /// A kernel fault or dead worker poisoned the lease; free it and lease again.
    #[error("{0}")]
    LeasePoisoned(String),
    /// The request exceeds the reservation or the node's capacity.
    #[error("capacity exceeded: {0}")]
    CapacityExceeded(String),
    /// A module did not load; holds the compile or JIT log.
    #[error("module load failed: {0}")]
    LoadFailed(String),
    /// The node does not have a module and was not sent its source
    /// ([`Recorder::submit`] resends with it by itself).
    #[error("unknown module: {0}")]
    UnknownModule(String),
    /// A launch or kernel failed.
    #[error("launch failed: {0}")]
    LaunchFailed(String),
    /// Reading device memory failed.
    #[error("read failed: {0}")]
    ReadFailed(String),
    /// No such lease, handle or kernel.
    #[error("not found: {0}")]
    NotFound(String),
    /// The node rejected the request as malformed.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The connection is gone or could not be made.
    #[error("disconnected: {0}")]
    Disconnected(String),
    /// The node replied with something this client does not understand.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// TLS or local configuration problem.
    #[error("config: {0}")]
    Config(String),
    /// A node-side failure.
    #[error("node error: {0}")]
    Internal(String),
}

impl Error {
    /// Maps a reply status and message to an error.
    pub fn from_status(status: Status, message: String) -> Self {
        match status {
            Status::Unauthorized => Error::Unauthorized(message),
            Status::LoadFailed => Error::LoadFailed(message),
            Status::LaunchFailed => Error::LaunchFailed(message),
            Status::ReadFailed => Error::ReadFailed(message),
            Status::LeaseExpired => Error::LeaseExpired(message),
            Status::CapacityExceeded => Error::CapacityExceeded(message),
            Status::BadRequest => Error::BadRequest(message),
            Status::NotFound => Error::NotFound(message),
            Status::LeasePoisoned => Error::LeasePoisoned(message),
            Status::UnknownModule => Error::UnknownModule(message),
            Status::Ok | Status::Internal => Error::Internal(message),
        }
    }
}

fn disconnected(e: impl std::fmt::Display) -> Error {
    Error::Disconnected(e.to_string())
}

/// How to reach and trust a node.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Certificates trusted for the node (pin the node's own certificate).
    pub roots: Vec<CertificateDer<'static>>,
    /// Name the node's certificate is checked against.
    pub server_name: String,
    /// Bearer token sent in HELLO.
    pub token: Option<String>,
    /// Client certificate for mutual TLS.
    pub identity: Option<Identity>,
    /// Frame limits for replies.
    pub limits: Limits,
    /// Name sent in HELLO (for the node's logs).
    pub client_name: String,
    /// Connections a large MEM_WRITE or MEM_READ is striped over (at least
    /// 1; see [`ClientConfig::stripes`]).
    pub stripes: usize,
    /// The smallest transfer that is striped.
    pub stripe_min_bytes: usize,
}

/// Default [`ClientConfig::stripes`]: on an H100 host (16 cores, loopback)
/// raw quinn moved 3.1 to 3.8x as much over four connections as over one;
/// on a 2-core machine four moved 0.93x (no loss worth a second default).
pub const DEFAULT_STRIPES: usize = 4;

/// Default [`ClientConfig::stripe_min_bytes`]: 8 MiB (smaller transfers
/// take one round trip on one connection).
pub const DEFAULT_STRIPE_MIN_BYTES: usize = 8 << 20;

impl ClientConfig {
    /// Trusts exactly `cert` (the node's certificate), checked as `localhost`.
    pub fn pinned(cert: CertificateDer<'static>) -> Self {
        Self {
            roots: vec![cert],
            server_name: "localhost".into(),
            token: None,
            identity: None,
            limits: Limits {
                max_body: 16 << 20,
                max_data: u32::MAX,
            },
            client_name: "cuda-lease-client".into(),
            stripes: DEFAULT_STRIPES,
            stripe_min_bytes: DEFAULT_STRIPE_MIN_BYTES,
        }
    }

    /// Trusts the certificates of a PEM file (the file `cuda-lease-node --dev` writes, or a CA).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] when the file cannot be read.
    pub fn from_pem_file(path: &Path) -> Result<Self, Error> {
        let mut certs = tls::load_certs(path).map_err(|e| Error::Config(e.to_string()))?;
        let mut c = Self::pinned(certs.remove(0));
        c.roots.extend(certs);
        Ok(c)
    }

    /// Sets the bearer token.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Sets the name checked against the node's certificate.
    pub fn server_name(mut self, name: impl Into<String>) -> Self {
        self.server_name = name.into();
        self
    }

    /// Stripes MEM_WRITE and MEM_READ of at least `min_bytes` over `n`
    /// connections (`n` of 1 turns striping off). One QUIC connection is
    /// CPU-bound (about 0.4 to 0.5 GiB/s on an H100 host); several move data
    /// in parallel where the client and the node have cores to spare. The
    /// extra connections are opened (and authenticated) on the first
    /// striped transfer.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn demo(cfg: cuda_lease::ClientConfig) {
    /// let cfg = cfg.stripes(8, 16 << 20); // 8 connections from 16 MiB up
    /// let single = cfg.clone().stripes(1, 0); // never stripe
    /// # }
    /// ```
    pub fn stripes(mut self, n: usize, min_bytes: usize) -> Self {
        self.stripes = n.max(1);
        self.stripe_min_bytes = min_bytes;
        self
    }
}

/// A connection to a node. Requests may run concurrently (one QUIC stream each).
#[derive(Debug)]
pub struct Client {
    endpoint: quinn::Endpoint,
    conn: quinn::Connection,
    next_id: AtomicU64,
    limits: Limits,
    node: String,
    /// Where the node is and how to log in again (for the stripes).
    addr: SocketAddr,
    config: ClientConfig,
    /// The extra connections of striped transfers, opened on first use.
    stripe_conns: tokio::sync::OnceCell<Vec<quinn::Connection>>,
    /// Modules this node was sent (or had) in a batch that it accepted:
    /// later batches name them by hash alone.
    known_modules: std::sync::Mutex<std::collections::HashSet<ModuleHash>>,
}

impl Client {
    /// Connects and authenticates (HELLO).
    ///
    /// # Errors
    ///
    /// [`Error::Disconnected`] when the node cannot be reached or the TLS
    /// handshake fails, [`Error::Unauthorized`] for bad credentials.
    ///
    /// # Cancel safety
    ///
    /// Cancelling drops the half-made connection; nothing is leased.
    pub async fn connect(addr: SocketAddr, config: &ClientConfig) -> Result<Client, Error> {
        let qcfg = tls::client_config(&config.roots, config.identity.as_ref())
            .map_err(|e| Error::Config(e.to_string()))?;
        let bind: SocketAddr = if addr.is_ipv6() {
            "[::]:0".parse()
        } else {
            "0.0.0.0:0".parse()
        }
        .map_err(|e: std::net::AddrParseError| Error::Config(e.to_string()))?;
        let mut endpoint = quinn::Endpoint::client(bind).map_err(disconnected)?;
        endpoint.set_default_client_config(qcfg);
        let conn = endpoint
            .connect(addr, &config.server_name)
            .map_err(disconnected)?
            .await
            .map_err(disconnected)?;
        let mut client = Client {
            endpoint,
            conn,
            next_id: AtomicU64::new(1),
            limits: config.limits,
            node: String::new(),
            addr,
            config: config.clone(),
            stripe_conns: tokio::sync::OnceCell::new(),
            known_modules: std::sync::Mutex::default(),
        };
        let ok = client.hello(&client.conn).await?;
        client.node = ok.node;
        Ok(client)
    }

    async fn hello(&self, conn: &quinn::Connection) -> Result<HelloOk, Error> {
        let hello = Hello {
            token: self.config.token.clone().unwrap_or_default(),
            client: self.config.client_name.clone(),
        };
        let (body, _) = self
            .request_on(conn, Opcode::Hello, &to_body(&hello), &[], None)
            .await?;
        from_body(&body).map_err(|e| Error::Protocol(e.to_string()))
    }

    /// The connections a transfer of `len` bytes is striped over: just the
    /// main one below the threshold; else the main one and the extra ones,
    /// opened and authenticated on first use.
    async fn stripe_set(&self, len: usize) -> Result<Vec<&quinn::Connection>, Error> {
        let n = self.config.stripes.max(1);
        if n == 1 || len < self.config.stripe_min_bytes.max(1) {
            return Ok(vec![&self.conn]);
        }
        let extra = self
            .stripe_conns
            .get_or_try_init(|| async {
                let mut v = Vec::with_capacity(n - 1);
                for _ in 1..n {
                    let conn = self
                        .endpoint
                        .connect(self.addr, &self.config.server_name)
                        .map_err(disconnected)?
                        .await
                        .map_err(disconnected)?;
                    self.hello(&conn).await?;
                    v.push(conn);
                }
                Ok::<_, Error>(v)
            })
            .await?;
        Ok(std::iter::once(&self.conn).chain(extra).collect())
    }

    /// The node's name.
    pub fn node_name(&self) -> &str {
        &self.node
    }

    /// Sends one raw frame and returns the reply's body and data; a non-OK
    /// status becomes an [`Error`].
    ///
    /// # Errors
    ///
    /// As described by the reply status, or [`Error::Disconnected`].
    pub async fn request(
        &self,
        opcode: Opcode,
        body: &[u8],
        data: &[u8],
    ) -> Result<(Vec<u8>, Vec<u8>), Error> {
        self.request_on(&self.conn, opcode, body, data, None).await
    }

    /// [`Client::request`] on `conn`; with `into`, the reply's data is read
    /// straight into it (its length must match) and the returned data is
    /// empty.
    async fn request_on(
        &self,
        conn: &quinn::Connection,
        opcode: Opcode,
        body: &[u8],
        data: &[u8],
        into: Option<&mut [u8]>,
    ) -> Result<(Vec<u8>, Vec<u8>), Error> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        exchange(conn, &self.limits, id, opcode, body, data, into).await
    }

    /// Writes `bytes` to memory at `offset`, striped over the connections
    /// of [`ClientConfig::stripes`] when large enough.
    async fn striped_write(
        &self,
        lease: LeaseId,
        buf: Id,
        offset: u64,
        bytes: &[u8],
    ) -> Result<(), Error> {
        let conns = self.stripe_set(bytes.len()).await?;
        let parts = stripe_bounds(bytes.len(), conns.len());
        let futs = conns.iter().zip(&parts).map(|(conn, r)| {
            let body = to_body(&MemWrite {
                lease,
                buf,
                offset: offset + r.start as u64,
            });
            async move {
                self.request_on(conn, Opcode::MemWrite, &body, &bytes[r.clone()], None)
                    .await
            }
        });
        for r in join_all(futs.collect()).await {
            r?;
        }
        Ok(())
    }

    /// Reads `len` bytes of memory at `offset`, striped like
    /// [`Client::striped_write`], into one buffer.
    async fn striped_read(
        &self,
        lease: LeaseId,
        buf: Id,
        offset: u64,
        len: u32,
    ) -> Result<Vec<u8>, Error> {
        let conns = self.stripe_set(len as usize).await?;
        let parts = stripe_bounds(len as usize, conns.len());
        if parts.len() == 1 {
            let mut out = vec![0u8; len as usize];
            let body = to_body(&MemRead {
                lease,
                buf,
                offset,
                len,
            });
            self.request_on(conns[0], Opcode::MemRead, &body, &[], Some(&mut out))
                .await?;
            return Ok(out);
        }
        // One task per stripe, so the connections' reads (and copies, and
        // the page faults of a fresh buffer) run on several threads, all
        // into one buffer. Measured on an H100 host: one task reading all
        // four stripes got 1.7x one connection; a task per stripe reading
        // into its own buffer and a concatenation, 1.6 to 1.8x.
        let out = Arc::new(StripeBuffer::new(len as usize));
        let tasks: Vec<_> = conns
            .iter()
            .zip(&parts)
            .map(|(conn, r)| {
                let conn = (*conn).clone();
                let limits = self.limits;
                let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                let body = to_body(&MemRead {
                    lease,
                    buf,
                    offset: offset + r.start as u64,
                    len: r.len() as u32,
                });
                let (out, r) = (out.clone(), r.clone());
                tokio::spawn(async move {
                    // SAFETY: the stripes' ranges are disjoint (from
                    // `stripe_bounds`), and this task is the only one
                    // that touches this range.
                    let part = unsafe { out.range_mut(r) };
                    exchange(&conn, &limits, id, Opcode::MemRead, &body, &[], Some(part))
                        .await
                        .map(drop)
                })
            })
            .collect();
        let mut first_err = None;
        for t in tasks {
            let r = t
                .await
                .unwrap_or_else(|e| Err(Error::Disconnected(format!("stripe task: {e}"))));
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        Arc::try_unwrap(out)
            .map(StripeBuffer::into_inner)
            .map_err(|_| Error::Protocol("a stripe task outlived its transfer".into()))
    }

    async fn call<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        op: Opcode,
        req: &Req,
    ) -> Result<Rep, Error> {
        let (body, _) = self.request(op, &to_body(req), &[]).await?;
        from_body(&body).map_err(|e| Error::Protocol(e.to_string()))
    }

    /// `f` of the modules this client believes the node has.
    fn with_known_modules<R>(
        &self,
        f: impl FnOnce(&std::collections::HashSet<ModuleHash>) -> R,
    ) -> R {
        f(&self.known_modules.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn learn_modules(&self, hashes: impl IntoIterator<Item = ModuleHash>) {
        self.known_modules
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(hashes);
    }

    /// The node's devices and free capacity.
    ///
    /// # Errors
    ///
    /// As [`Client::request`].
    pub async fn inventory(&self) -> Result<Inventory, Error> {
        self.call(Opcode::GetInventory, &()).await
    }

    /// Frees a lease by id alone (always allowed, even unauthenticated).
    ///
    /// # Errors
    ///
    /// [`Error::NotFound`] for an unknown lease.
    pub async fn free_lease(&self, lease: LeaseId) -> Result<(), Error> {
        self.request(Opcode::LeaseFree, &to_body(&LeaseRef { lease }), &[])
            .await
            .map(drop)
    }

    /// Runs a kernel as a pure function: inputs in, output bytes out, nothing
    /// left on the node (GPU_SUBMIT).
    ///
    /// # Errors
    ///
    /// [`Error::LoadFailed`], [`Error::LaunchFailed`], [`Error::BadRequest`], ...
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons the reply; the node still runs the call
    /// to completion and frees its buffers.
    pub async fn gpu_call(&self, call: &GpuCall) -> Result<Vec<u8>, Error> {
        let req = GpuSubmit {
            kernel: call.kernel.clone(),
            grid: call.grid,
            block: call.block,
            shared_mem: call.shared_mem,
            args: call.args.clone(),
            ptx_len: call.ptx.len() as u32,
            input_lens: call.inputs.iter().map(|i| i.len() as u32).collect(),
            output_size: call.output_size,
            output_fill: call.output_fill,
        };
        let mut data =
            Vec::with_capacity(call.ptx.len() + call.inputs.iter().map(Vec::len).sum::<usize>());
        data.extend_from_slice(call.ptx.as_bytes());
        for i in &call.inputs {
            data.extend_from_slice(i);
        }
        let (_, out) = self
            .request(Opcode::GpuSubmit, &to_body(&req), &data)
            .await?;
        Ok(out)
    }

    /// Closes the connection (leases are not freed: their TTL runs out).
    pub fn close(&self) {
        self.conn.close(0u32.into(), b"bye");
    }

    /// Waits until the connection's packets are flushed after [`Client::close`].
    pub async fn wait_idle(&self) {
        self.endpoint.wait_idle().await;
    }
}

/// A stateless kernel call for [`Client::gpu_call`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuCall {
    /// PTX text.
    pub ptx: String,
    /// Kernel name.
    pub kernel: String,
    /// Grid dimensions.
    pub grid: [u32; 3],
    /// Block dimensions.
    pub block: [u32; 3],
    /// Dynamic shared memory.
    pub shared_mem: u32,
    /// Arguments; use [`KernelArg::Input`] and [`KernelArg::Output`] for buffers.
    pub args: Vec<KernelArg>,
    /// Input buffers.
    pub inputs: Vec<Vec<u8>>,
    /// Output size in bytes.
    pub output_size: u32,
    /// Byte the output is filled with before the launch.
    pub output_fill: u8,
}

impl GpuCall {
    /// A call of `kernel` in `ptx` with a 1-D launch and no arguments yet.
    pub fn new(
        ptx: impl Into<String>,
        kernel: impl Into<String>,
        grid: u32,
        block: u32,
        output_size: u32,
    ) -> Self {
        Self {
            ptx: ptx.into(),
            kernel: kernel.into(),
            grid: [grid, 1, 1],
            block: [block, 1, 1],
            shared_mem: 0,
            args: Vec::new(),
            inputs: Vec::new(),
            output_size,
            output_fill: 0,
        }
    }

    /// Appends an argument.
    pub fn arg(mut self, a: KernelArg) -> Self {
        self.args.push(a);
        self
    }

    /// Appends an input buffer and returns its argument.
    pub fn input(mut self, bytes: Vec<u8>) -> Self {
        let n = self.inputs.len() as u32;
        self.inputs.push(bytes);
        self.args.push(KernelArg::Input(n));
        self
    }
}

/// Builds a [`Lease`].
#[derive(Debug, Clone)]
pub struct LeaseBuilder {
    min_vram: u64,
    ttl: Duration,
    auto_renew: bool,
    config: Option<ClientConfig>,
}

struct LeaseInner {
    client: Arc<Client>,
    id: LeaseId,
    reserved: u64,
    ttl: Duration,
    generation: AtomicU64,
    expired: AtomicBool,
    freed: AtomicBool,
    /// The next id this client picks for the lease.
    next_id: AtomicU64,
    /// The next batch number (see [`Batch::seq`]).
    next_seq: AtomicU64,
}

impl std::fmt::Debug for LeaseInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseInner")
            .field("id", &self.id)
            .field("reserved", &self.reserved)
            .finish()
    }
}

impl LeaseInner {
    async fn req(&self, op: Opcode, body: &[u8], data: &[u8]) -> Result<(Vec<u8>, Vec<u8>), Error> {
        self.guard(self.client.request(op, body, data)).await
    }

    /// [`LeaseInner::req`] with the reply's data going where `into` says.
    async fn req_with(
        &self,
        op: Opcode,
        body: &[u8],
        data: &[u8],
        into: ReplyInto<'_, '_>,
    ) -> Result<(Vec<u8>, Vec<u8>), Error> {
        let client = &self.client;
        let id = client.next_id.fetch_add(1, Ordering::Relaxed);
        let r = exchange_into(&client.conn, &client.limits, id, op, body, data, into);
        self.guard(r).await
    }

    /// Runs a request of this lease: refused once the lease was freed, and
    /// an expiry it reports is remembered.
    async fn guard<T>(
        &self,
        request: impl std::future::Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        if self.freed.load(Ordering::SeqCst) {
            return Err(Error::NotFound("lease was freed".into()));
        }
        let r = request.await;
        if let Err(Error::LeaseExpired(_)) = &r {
            self.expired.store(true, Ordering::SeqCst);
        }
        r
    }

    /// A fresh id of this lease (the client names everything).
    fn fresh_id(&self) -> Id {
        Id(self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    fn free_in_background(self: &Arc<Self>, id: Id) {
        if self.freed.load(Ordering::SeqCst) || self.expired.load(Ordering::SeqCst) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let inner = self.clone();
        rt.spawn(async move {
            let body = to_body(&IdOp {
                lease: inner.id,
                id,
            });
            let _ = inner.req(Opcode::MemFree, &body, &[]).await;
        });
    }
}

/// A lease on a node: reserved VRAM with a TTL, renewed in the background at
/// about 75 % of the TTL. Dropping it frees the lease in the background (if a
/// tokio runtime is running); [`Lease::free`] frees it and waits. If the
/// client crashes, the TTL frees everything.
#[derive(Debug)]
pub struct Lease {
    inner: Arc<LeaseInner>,
    renew: Option<JoinHandle<()>>,
}

impl Lease {
    /// A builder: 256 MiB, 60 s TTL, auto-renew on.
    pub fn builder() -> LeaseBuilder {
        LeaseBuilder {
            min_vram: 256 << 20,
            ttl: Duration::from_secs(60),
            auto_renew: true,
            config: None,
        }
    }

    /// The lease id (the capability to use and free it).
    pub fn id(&self) -> LeaseId {
        self.inner.id
    }

    /// Reserved bytes.
    pub fn reserved(&self) -> u64 {
        self.inner.reserved
    }

    /// The generation of the last grant or renewal.
    pub fn generation(&self) -> u64 {
        self.inner.generation.load(Ordering::SeqCst)
    }

    /// True once the node reported the lease expired.
    pub fn is_expired(&self) -> bool {
        self.inner.expired.load(Ordering::SeqCst)
    }

    /// The connection this lease uses.
    pub fn client(&self) -> &Arc<Client> {
        &self.inner.client
    }

    /// Renews now for the lease's TTL.
    ///
    /// # Errors
    ///
    /// [`Error::LeaseExpired`] when too late.
    pub async fn renew(&self) -> Result<LeaseGrant, Error> {
        renew(&self.inner).await
    }

    /// Asks the node about this lease.
    ///
    /// # Errors
    ///
    /// As [`Client::request`].
    pub async fn query(&self) -> Result<LeaseStatus, Error> {
        let (b, _) = self
            .inner
            .req(
                Opcode::LeaseQuery,
                &to_body(&LeaseRef {
                    lease: self.inner.id,
                }),
                &[],
            )
            .await?;
        from_body(&b).map_err(|e| Error::Protocol(e.to_string()))
    }

    /// A session on this lease's stream.
    pub fn session(&self) -> Session {
        Session {
            inner: self.inner.clone(),
        }
    }

    /// Stops renewing without freeing (for tests of TTL expiry).
    pub fn stop_renewing(&mut self) {
        if let Some(t) = self.renew.take() {
            t.abort();
        }
    }

    /// Frees the lease now; the node ends its worker and returns its memory
    /// before replying.
    ///
    /// # Errors
    ///
    /// [`Error::NotFound`] / [`Error::LeaseExpired`] when it is already gone.
    pub async fn free(mut self) -> Result<(), Error> {
        self.stop_renewing();
        self.inner.freed.store(true, Ordering::SeqCst);
        self.inner.client.free_lease(self.inner.id).await
    }

    /// Forgets the lease without freeing it (as if the client crashed).
    pub fn leak(mut self) {
        self.stop_renewing();
        self.inner.freed.store(true, Ordering::SeqCst);
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.stop_renewing();
        if self.inner.freed.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let client = self.inner.client.clone();
            let id = self.inner.id;
            rt.spawn(async move {
                let _ = client.free_lease(id).await;
            });
        }
    }
}

async fn renew(inner: &LeaseInner) -> Result<LeaseGrant, Error> {
    let ttl_secs = inner.ttl.as_secs().max(1) as u32;
    let body = to_body(&LeaseRenew {
        lease: inner.id,
        ttl_secs,
    });
    let (b, _) = inner.req(Opcode::LeaseRenew, &body, &[]).await?;
    let g: LeaseGrant = from_body(&b).map_err(|e| Error::Protocol(e.to_string()))?;
    inner.generation.store(g.generation, Ordering::SeqCst);
    Ok(g)
}

impl LeaseBuilder {
    /// VRAM to reserve in bytes.
    pub fn min_vram(mut self, bytes: u64) -> Self {
        self.min_vram = bytes;
        self
    }

    /// TTL (whole seconds, at least 1).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl.max(Duration::from_secs(1));
        self
    }

    /// Renew in the background at ~75 % of the TTL (default on).
    pub fn auto_renew(mut self, on: bool) -> Self {
        self.auto_renew = on;
        self
    }

    /// How to trust and authenticate to the node (required by [`LeaseBuilder::connect`]).
    pub fn config(mut self, config: ClientConfig) -> Self {
        self.config = Some(config);
        self
    }

    /// Connects to `addr` and leases.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] without a config, connection errors, or the lease's:
    /// [`Error::CapacityExceeded`], [`Error::Unauthorized`].
    pub async fn connect(self, addr: SocketAddr) -> Result<Lease, Error> {
        let config = self
            .config
            .clone()
            .ok_or_else(|| Error::Config("LeaseBuilder needs a ClientConfig".into()))?;
        let client = Arc::new(Client::connect(addr, &config).await?);
        self.on(client).await
    }

    /// Leases over an existing connection.
    ///
    /// # Errors
    ///
    /// As [`LeaseBuilder::connect`].
    pub async fn on(self, client: Arc<Client>) -> Result<Lease, Error> {
        let req = LeaseAlloc {
            min_vram: self.min_vram,
            ttl_secs: self.ttl.as_secs().max(1) as u32,
        };
        let g: LeaseGrant = client.call(Opcode::LeaseAlloc, &req).await?;
        let inner = Arc::new(LeaseInner {
            client,
            id: g.lease,
            reserved: g.reserved,
            ttl: self.ttl,
            generation: AtomicU64::new(g.generation),
            expired: AtomicBool::new(false),
            freed: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
            next_seq: AtomicU64::new(1),
        });
        let renew_task = self.auto_renew.then(|| {
            let weak: Weak<LeaseInner> = Arc::downgrade(&inner);
            let period = Duration::from_millis(g.ttl_ms.max(1000) * 3 / 4);
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(period).await;
                    let Some(inner) = weak.upgrade() else { return };
                    if inner.freed.load(Ordering::SeqCst) {
                        return;
                    }
                    match renew(&inner).await {
                        Ok(_) => {}
                        Err(Error::Disconnected(_)) => {}
                        Err(e) => {
                            tracing::warn!(lease = %inner.id, error = %e, "renewal stopped");
                            return;
                        }
                    }
                }
            })
        });
        Ok(Lease {
            inner,
            renew: renew_task,
        })
    }
}

/// Work on a lease: RAII buffers, single requests, and the [`Recorder`]
/// for whole pipelines in one message. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Session {
    inner: Arc<LeaseInner>,
}

/// A buffer in a lease, named by a client-picked id; freed (in the
/// background, after every queued use) when dropped.
#[derive(Debug)]
pub struct DeviceBuffer {
    inner: Arc<LeaseInner>,
    id: Id,
    size: u64,
}

impl DeviceBuffer {
    /// The buffer's id (for kernel arguments and recorded commands).
    pub fn id(&self) -> Id {
        self.id
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// This buffer as a kernel argument.
    pub fn arg(&self) -> KernelArg {
        KernelArg::mem(self.id)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        self.inner.free_in_background(self.id);
    }
}

/// A module as a description: its source (PTX, or CUDA C with NVRTC
/// options) and its content hash. It belongs to no node: a batch that
/// uses it carries the source the first time a node needs it, and the node
/// compiles CUDA C with its own NVRTC for its own GPU. Cheap to clone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Module {
    hash: ModuleHash,
    kind: SourceKind,
    text: Arc<str>,
}

impl Module {
    /// A PTX module.
    pub fn ptx(text: impl Into<Arc<str>>) -> Self {
        Self::new(SourceKind::Ptx, text.into())
    }

    /// A CUDA C module with NVRTC options (the node adds its GPU's
    /// architecture unless an option names one).
    pub fn cuda(source: impl Into<Arc<str>>, options: &[&str]) -> Self {
        let options = options.iter().map(|o| (*o).to_owned()).collect();
        Self::new(SourceKind::Cuda { options }, source.into())
    }

    fn new(kind: SourceKind, text: Arc<str>) -> Self {
        Self {
            hash: ModuleHash::of(&kind, &text),
            kind,
            text,
        }
    }

    /// The content hash that names it on the wire.
    pub fn hash(&self) -> ModuleHash {
        self.hash
    }

    /// What its text is.
    pub fn kind(&self) -> &SourceKind {
        &self.kind
    }

    /// Its source text.
    pub fn text(&self) -> &str {
        &self.text
    }
}

/// A read recorded in a [`Recorder`]: where its bytes are in the reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadSlot {
    command: usize,
    len: u32,
}

/// Records commands on client-named streams of a lease and sends them as
/// one BATCH: one round trip for the whole pipeline. Ids are picked here
/// (the lease's counter), so a command can name what an earlier command of
/// this or an earlier submission made without waiting for a reply, and a
/// second recording can be sent before the first one's reply is back.
///
/// ```no_run
/// # async fn demo(session: cuda_lease::Session) -> Result<(), cuda_lease::Error> {
/// use cuda_lease::client::Module;
/// use cuda_lease::proto::KernelArg;
/// let module = Module::cuda(
///     r#"extern "C" __global__ void axpy(float a, const float* x, float* y, unsigned n) {
///         unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
///         if (i < n) y[i] = a * x[i] + y[i];
///     }"#,
///     &[],
/// );
/// let x: Vec<u8> = [1.0f32; 256].iter().flat_map(|v| v.to_le_bytes()).collect();
/// let mut rec = session.recorder();
/// let (bx, by) = (rec.alloc(0, 1024), rec.alloc(1, 1024));
/// rec.write(0, bx, 0, &x);
/// let ready = rec.record(0); // stream 1 waits for stream 0's upload
/// rec.wait(1, ready);
/// rec.launch(1, &module, "axpy", [1, 1, 1], [256, 1, 1], vec![
///     KernelArg::f32(2.0), KernelArg::mem(bx), KernelArg::mem(by), KernelArg::u32(256),
/// ]);
/// let y = rec.read(1, by, 0, 1024);
/// let reply = rec.submit().await?.ok()?;
/// assert_eq!(reply.read(y).unwrap()[..4], 2.0f32.to_le_bytes());
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Recorder {
    inner: Arc<LeaseInner>,
    modules: Vec<Module>,
    commands: Vec<Command>,
    writes: Vec<u8>,
}

impl Recorder {
    fn push(&mut self, stream: StreamId, op: Op) {
        self.commands.push(Command { stream, op });
    }

    /// A fresh id of this lease (for [`Op::Alloc`] or a first
    /// [`Op::Record`] pushed by hand).
    pub fn fresh_id(&self) -> Id {
        self.inner.fresh_id()
    }

    /// Allocates `size` zeroed bytes; the id names the buffer from now on
    /// (it is not freed by itself: record [`Recorder::free`]).
    pub fn alloc(&mut self, stream: StreamId, size: u64) -> Id {
        let buf = self.fresh_id();
        self.push(stream, Op::Alloc { buf, size });
        buf
    }

    /// Writes `bytes` into `buf` at `offset` (copied into the message now).
    pub fn write(&mut self, stream: StreamId, buf: Id, offset: u64, bytes: &[u8]) -> &mut Self {
        self.writes.extend_from_slice(bytes);
        let len = bytes.len() as u32;
        self.push(stream, Op::Write { buf, offset, len });
        self
    }

    /// Reads `len` bytes of `buf` at `offset`; the bytes are in the reply
    /// ([`Submitted::read`]).
    pub fn read(&mut self, stream: StreamId, buf: Id, offset: u64, len: u32) -> ReadSlot {
        self.push(stream, Op::Read { buf, offset, len });
        ReadSlot {
            command: self.commands.len() - 1,
            len,
        }
    }

    /// Frees a buffer (after every queued use of it) or an event.
    pub fn free(&mut self, stream: StreamId, id: Id) -> &mut Self {
        self.push(stream, Op::Free { id });
        self
    }

    /// Launches `kernel` of `module`; the module's source goes with this
    /// message if the node may not have it.
    pub fn launch(
        &mut self,
        stream: StreamId,
        module: &Module,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        args: Vec<KernelArg>,
    ) -> &mut Self {
        self.launch_spec(
            stream,
            module,
            LaunchSpec {
                module: module.hash,
                kernel: kernel.into(),
                grid,
                block,
                shared_mem: 0,
                args,
            },
        )
    }

    /// Launches with a full [`LaunchSpec`] (its `module` is set from
    /// `module`).
    pub fn launch_spec(
        &mut self,
        stream: StreamId,
        module: &Module,
        mut spec: LaunchSpec,
    ) -> &mut Self {
        spec.module = module.hash;
        self.use_module(module);
        self.push(stream, Op::Launch(spec));
        self
    }

    /// Lists `module` in the message (a launch does this itself; alone, it
    /// loads the module, so a bad one fails now with its log).
    pub fn use_module(&mut self, module: &Module) -> &mut Self {
        if !self.modules.iter().any(|m| m.hash == module.hash) {
            self.modules.push(module.clone());
        }
        self
    }

    /// Sets `len` bytes of `buf` at `offset` to `value`.
    pub fn fill(
        &mut self,
        stream: StreamId,
        buf: Id,
        offset: u64,
        len: u64,
        value: u8,
    ) -> &mut Self {
        self.push(
            stream,
            Op::Fill {
                buf,
                offset,
                len,
                value,
            },
        );
        self
    }

    /// Copies `len` bytes from `src` at `src_offset` to another buffer
    /// `dst` at `dst_offset`.
    pub fn copy(
        &mut self,
        stream: StreamId,
        (src, src_offset): (Id, u64),
        (dst, dst_offset): (Id, u64),
        len: u64,
    ) -> &mut Self {
        self.push(
            stream,
            Op::Copy {
                src,
                src_offset,
                dst,
                dst_offset,
                len,
            },
        );
        self
    }

    /// Records a new event on `stream` and returns it.
    pub fn record(&mut self, stream: StreamId) -> Id {
        let event = self.fresh_id();
        self.push(stream, Op::Record { event });
        event
    }

    /// Records `event` again on `stream` (waits name the latest record).
    pub fn record_again(&mut self, stream: StreamId, event: Id) -> &mut Self {
        self.push(stream, Op::Record { event });
        self
    }

    /// Makes `stream` wait for the last record of `event`.
    pub fn wait(&mut self, stream: StreamId, event: Id) -> &mut Self {
        self.push(stream, Op::Wait { event });
        self
    }

    /// Appends a command built by hand.
    pub fn command(&mut self, stream: StreamId, op: Op) -> &mut Self {
        self.push(stream, op);
        self
    }

    /// The slots of the reads recorded so far, in order.
    pub fn read_slots(&self) -> Vec<ReadSlot> {
        self.commands
            .iter()
            .enumerate()
            .filter_map(|(i, c)| match c.op {
                Op::Read { len, .. } => Some(ReadSlot { command: i, len }),
                _ => None,
            })
            .collect()
    }

    /// Commands recorded so far.
    pub fn len(&self) -> usize {
        self.commands.len()
    }

    /// True when nothing is recorded.
    pub fn is_empty(&self) -> bool {
        self.commands.is_empty() && self.modules.is_empty()
    }

    /// Sends everything recorded as one message; the future resolves with
    /// the node's reply once every command ran (or one failed). The
    /// message is built and numbered when this is called (the recorder may
    /// be changed or submitted again afterwards): the node runs a lease's
    /// submissions in the order of these calls, so a second recording may
    /// be sent before this one's reply arrives and name what it creates.
    /// A submission dropped before its first poll is never sent; the
    /// node then waits its reorder window (2 s by default) before running
    /// the lease's later ones.
    ///
    /// A module the client believes the node has travels without its
    /// source; if the node answers UNKNOWN_MODULE (nothing ran), the
    /// message is sent once more with every source.
    ///
    /// # Errors
    ///
    /// Errors of the request itself (lease gone, disconnected, malformed).
    /// A failing command is not an error here: see [`Submitted::ok`].
    ///
    /// # Cancel safety
    ///
    /// Dropping the future after its first poll abandons the reply; the
    /// node runs the batch anyway.
    pub fn submit(
        &self,
    ) -> impl std::future::Future<Output = Result<Submitted, Error>> + Send + 'static {
        let message = self.numbered();
        let reads = self.read_slots();
        async move {
            let (reply, data) = message.send(None).await?;
            Ok(Submitted {
                completed: reply.completed as usize,
                error: reply.error,
                reads,
                data,
            })
        }
    }

    /// [`Recorder::submit`], with the reads received straight into `dests`
    /// (one per read, in order, each exactly its read's length) instead of
    /// the reply's own buffer: no copy on the client. The destinations come
    /// back with the reply; those of reads that did not run are untouched.
    ///
    /// # Errors
    ///
    /// [`Error::BadRequest`] when `dests` do not match the reads; the rest
    /// as [`Recorder::submit`].
    pub fn submit_into<D>(
        &self,
        mut dests: Vec<D>,
    ) -> impl std::future::Future<Output = Result<(Submitted, Vec<D>), Error>> + Send + 'static
    where
        D: AsMut<[u8]> + Send + 'static,
    {
        let reads = self.read_slots();
        let shape_ok = reads.len() == dests.len()
            && reads
                .iter()
                .zip(dests.iter_mut())
                .all(|(r, d)| d.as_mut().len() == r.len as usize);
        self.numbered().send_into(shape_ok.then_some(reads), dests)
    }

    /// The message, numbered now: the node runs the lease's batches in the
    /// order of these calls, whatever order they are polled or arrive in.
    fn numbered(&self) -> Message {
        Message::numbered(
            &self.inner,
            &self.modules,
            &self.commands[..],
            self.writes.clone(),
        )
    }
}

fn into<'a, 'b>(parts: Option<&'a mut [&'b mut [u8]]>) -> ReplyInto<'a, 'b> {
    match parts {
        Some(p) => ReplyInto::Parts(p),
        None => ReplyInto::Owned,
    }
}

/// One numbered BATCH, with what a resend with every source needs.
pub(crate) struct Message {
    inner: Arc<LeaseInner>,
    body: Vec<u8>,
    data: Vec<u8>,
    modules: Vec<Module>,
    writes: usize,
}

impl Message {
    /// The BATCH of `commands` (encoded as [`Batch`] encodes its
    /// `Vec<Command>`), launching from `modules`, with `writes` as its
    /// payloads; numbered now: the node runs a lease's batches in the order
    /// of these calls, whatever order they are polled or arrive in. The
    /// sources of modules the node may lack go first in the data.
    fn numbered<C: EncodeCommands>(
        inner: &Arc<LeaseInner>,
        modules: &[Module],
        commands: C,
        writes: Vec<u8>,
    ) -> Message {
        let seq = inner.next_seq.fetch_add(1, Ordering::Relaxed);
        let mut data = Vec::new();
        let uses = inner.client.with_known_modules(|known| {
            modules
                .iter()
                .map(|m| {
                    let send = !known.contains(&m.hash);
                    let source = send.then(|| {
                        data.extend_from_slice(m.text.as_bytes());
                        ModuleText {
                            kind: m.kind.clone(),
                            len: m.text.len() as u32,
                        }
                    });
                    ModuleUse {
                        hash: m.hash,
                        source,
                    }
                })
                .collect()
        });
        let mut body = to_body(&BatchHeadRef {
            lease: inner.id,
            seq,
            modules: uses,
        });
        commands.encode_into(&mut body);
        let len = writes.len();
        if data.is_empty() {
            data = writes;
        } else {
            data.extend_from_slice(&writes);
        }
        Message {
            inner: inner.clone(),
            body,
            data,
            modules: modules.to_vec(),
            writes: len,
        }
    }

    /// Sends it, the reply's reads received straight into `dests` (one
    /// per read of `reads`, which is `None` when they do not match).
    pub(crate) async fn send_into<D>(
        self,
        reads: Option<Vec<ReadSlot>>,
        mut dests: Vec<D>,
    ) -> Result<(Submitted, Vec<D>), Error>
    where
        D: AsMut<[u8]>,
    {
        let Some(reads) = reads else {
            return Err(Error::BadRequest(
                "the destinations do not match the recorded reads".into(),
            ));
        };
        let reply = {
            let mut parts: Vec<&mut [u8]> = dests.iter_mut().map(|d| d.as_mut()).collect();
            self.send(Some(&mut parts)).await?.0
        };
        let submitted = Submitted {
            completed: reply.completed as usize,
            error: reply.error,
            reads,
            data: Vec::new(),
        };
        Ok((submitted, dests))
    }

    /// Sends it (again with every source if the node answers
    /// UNKNOWN_MODULE); the reply's data goes into `parts` when given.
    async fn send(
        &self,
        mut parts: Option<&mut [&mut [u8]]>,
    ) -> Result<(BatchReply, Vec<u8>), Error> {
        let (body, data) = (&self.body, &self.data);
        let r = self
            .inner
            .req_with(Opcode::Batch, body, data, into(parts.as_deref_mut()))
            .await;
        let (reply, data) = match r {
            Err(Error::UnknownModule(_)) => {
                // The node lost (or never had) a module: send the same
                // message again with every source.
                let writes = &data[data.len() - self.writes..];
                let (body, all) = with_every_source(body, &self.modules, writes)?;
                self.inner
                    .req_with(Opcode::Batch, &body, &all, into(parts))
                    .await?
            }
            r => r?,
        };
        let reply: BatchReply = from_body(&reply).map_err(|e| Error::Protocol(e.to_string()))?;
        let learned = self.modules.iter().map(|m| m.hash);
        self.inner.client.learn_modules(learned);
        Ok((reply, data))
    }
}

/// A batch message (`body`, its data ending in `writes`) again, with the
/// source of every module.
fn with_every_source(
    body: &[u8],
    modules: &[Module],
    writes: &[u8],
) -> Result<(Vec<u8>, Vec<u8>), Error> {
    let mut batch: Batch = from_body(body).map_err(|e| Error::Protocol(e.to_string()))?;
    let mut data = Vec::with_capacity(writes.len());
    for (u, m) in batch.modules.iter_mut().zip(modules) {
        data.extend_from_slice(m.text.as_bytes());
        u.source = Some(ModuleText {
            kind: m.kind.clone(),
            len: m.text.len() as u32,
        });
    }
    data.extend_from_slice(writes);
    Ok((to_body(&batch), data))
}

/// The reply to a [`Recorder::submit`].
#[derive(Debug, Clone)]
pub struct Submitted {
    completed: usize,
    error: Option<OpError>,
    reads: Vec<ReadSlot>,
    data: Vec<u8>,
}

impl Submitted {
    /// Commands that ran, in order (`0..completed`): what they created
    /// stays valid even when a later command failed.
    pub fn completed(&self) -> usize {
        self.completed
    }

    /// The command that stopped the batch: its index, status and message.
    pub fn error(&self) -> Option<&OpError> {
        self.error.as_ref()
    }

    /// `Ok(self)` when every command ran, else the failing command's error
    /// (its message names its index).
    ///
    /// # Errors
    ///
    /// The error of the command that stopped the batch.
    pub fn ok(self) -> Result<Self, Error> {
        match &self.error {
            Some(e) => Err(Error::from_status(e.status, e.message.clone())),
            None => Ok(self),
        }
    }

    /// The bytes of a read, if its command ran (they were received
    /// straight into the reply's one buffer: no copy here).
    pub fn read(&self, slot: ReadSlot) -> Option<&[u8]> {
        if slot.command >= self.completed {
            return None;
        }
        let mut start = 0usize;
        for r in &self.reads {
            if r.command >= self.completed {
                return None;
            }
            let end = start + r.len as usize;
            if *r == slot {
                return self.data.get(start..end);
            }
            start = end;
        }
        None
    }
}

impl Session {
    /// The lease id.
    pub fn lease_id(&self) -> LeaseId {
        self.inner.id
    }

    /// A fresh id of this lease (for commands recorded by hand).
    pub fn fresh_id(&self) -> Id {
        self.inner.fresh_id()
    }

    /// The client this session's lease lives on.
    pub fn client(&self) -> &Arc<Client> {
        &self.inner.client
    }

    /// A recorder for a pipeline sent as one message.
    pub fn recorder(&self) -> Recorder {
        Recorder {
            inner: self.inner.clone(),
            modules: Vec::new(),
            commands: Vec::new(),
            writes: Vec::new(),
        }
    }

    /// The BATCH of `commands` (they serialize as the protocol's
    /// `Vec<Command>` does), launching from `modules`, with `writes` as the
    /// writes' payloads, numbered now (see [`Recorder::submit`]); send it
    /// with [`Message::send_into`].
    #[cfg(feature = "backend")]
    pub(crate) fn message<C: EncodeCommands>(
        &self,
        modules: &[Module],
        commands: C,
        writes: Vec<u8>,
    ) -> Message {
        Message::numbered(&self.inner, modules, commands, writes)
    }

    /// Allocates `size` zeroed bytes (one request).
    ///
    /// # Errors
    ///
    /// [`Error::CapacityExceeded`] beyond the reservation.
    pub async fn alloc(&self, size: u64) -> Result<DeviceBuffer, Error> {
        let buf = self.inner.fresh_id();
        let body = to_body(&MemAlloc {
            lease: self.inner.id,
            buf,
            size,
        });
        self.inner.req(Opcode::MemAlloc, &body, &[]).await?;
        Ok(DeviceBuffer {
            inner: self.inner.clone(),
            id: buf,
            size,
        })
    }

    /// Copies `bytes` into `buf` at `offset` (streamed, striped when large).
    ///
    /// # Errors
    ///
    /// [`Error::BadRequest`] out of bounds.
    pub async fn write(&self, buf: &DeviceBuffer, offset: u64, bytes: &[u8]) -> Result<(), Error> {
        self.write_id(buf.id, offset, bytes).await
    }

    /// Copies `bytes` into buffer `buf` at `offset`.
    ///
    /// # Errors
    ///
    /// As [`Session::write`].
    pub async fn write_id(&self, buf: Id, offset: u64, bytes: &[u8]) -> Result<(), Error> {
        self.inner
            .guard(
                self.inner
                    .client
                    .striped_write(self.inner.id, buf, offset, bytes),
            )
            .await
    }

    /// Reads `len` bytes of `buf` at `offset` (streamed, striped when large).
    ///
    /// # Errors
    ///
    /// [`Error::ReadFailed`], [`Error::BadRequest`].
    pub async fn read(&self, buf: &DeviceBuffer, offset: u64, len: u32) -> Result<Vec<u8>, Error> {
        self.read_id(buf.id, offset, len).await
    }

    /// Reads `len` bytes of buffer `buf` at `offset`.
    ///
    /// # Errors
    ///
    /// As [`Session::read`].
    pub async fn read_id(&self, buf: Id, offset: u64, len: u32) -> Result<Vec<u8>, Error> {
        self.inner
            .guard(
                self.inner
                    .client
                    .striped_read(self.inner.id, buf, offset, len),
            )
            .await
    }

    /// Loads a PTX module now (one request), so a bad one fails here with
    /// its JIT log. Launches carry modules themselves: this is only a
    /// warm-up.
    ///
    /// # Errors
    ///
    /// [`Error::LoadFailed`] with the JIT log.
    pub async fn load_module(&self, ptx: &str) -> Result<Module, Error> {
        let module = Module::ptx(ptx);
        self.load(&module).await?;
        Ok(module)
    }

    /// Loads (CUDA C: compiles on the node) `module` now.
    ///
    /// # Errors
    ///
    /// [`Error::LoadFailed`] with the compile or JIT log.
    pub async fn load(&self, module: &Module) -> Result<(), Error> {
        let mut rec = self.recorder();
        rec.use_module(module);
        rec.submit().await?.ok().map(drop)
    }

    /// Launches a kernel on stream 0 and waits for it (one request).
    ///
    /// # Errors
    ///
    /// [`Error::LaunchFailed`] (a fault: the lease is then poisoned),
    /// [`Error::NotFound`] for an unknown kernel.
    pub async fn launch(
        &self,
        module: &Module,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        args: Vec<KernelArg>,
    ) -> Result<(), Error> {
        let mut rec = self.recorder();
        rec.launch(0, module, kernel, grid, block, args);
        rec.submit().await?.ok().map(drop)
    }
}

/// One allocation that several stripe tasks fill, each in its own range.
struct StripeBuffer {
    ptr: *mut u8,
    len: usize,
    buf: std::cell::UnsafeCell<Vec<u8>>,
}

// SAFETY: the buffer owns a `Vec<u8>` (which is `Send`); it is reached from
// several threads only through `range_mut`, whose contract makes the ranges
// disjoint, so sharing it is sharing disjoint `&mut [u8]`s (which are
// `Send`), and `into_inner` needs sole ownership.
unsafe impl Send for StripeBuffer {}
// SAFETY: as above.
unsafe impl Sync for StripeBuffer {}

impl StripeBuffer {
    fn new(len: usize) -> Self {
        let mut v = vec![0u8; len];
        StripeBuffer {
            ptr: v.as_mut_ptr(),
            len,
            buf: std::cell::UnsafeCell::new(v),
        }
    }

    /// # Safety
    /// No two slices returned for overlapping ranges may be alive at once,
    /// and `r` lies inside the buffer.
    #[allow(clippy::mut_from_ref)] // disjoint ranges, by the contract above
    unsafe fn range_mut(&self, r: std::ops::Range<usize>) -> &mut [u8] {
        assert!(
            r.start <= r.end && r.end <= self.len,
            "range outside the buffer"
        );
        // SAFETY: inside the allocation (checked), which lives as long as
        // `self` and is never moved (the `Vec` is not touched until
        // `into_inner`); disjointness is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.len()) }
    }

    fn into_inner(self) -> Vec<u8> {
        self.buf.into_inner()
    }
}

/// Where a reply's data goes.
enum ReplyInto<'a, 'b> {
    /// A new `Vec`, returned.
    Owned,
    /// This slice, whose length must be the data's.
    Exact(&'a mut [u8]),
    /// These slices in turn, up to the data's length (the reads of a
    /// batch that stopped early fill only the first ones).
    Parts(&'a mut [&'b mut [u8]]),
}

/// One request on a new stream of `conn` and its reply (see
/// [`Client::request`]); with `into`, the reply's data lands there.
async fn exchange(
    conn: &quinn::Connection,
    limits: &Limits,
    id: u64,
    opcode: Opcode,
    body: &[u8],
    data: &[u8],
    into: Option<&mut [u8]>,
) -> Result<(Vec<u8>, Vec<u8>), Error> {
    let into = match into {
        Some(out) => ReplyInto::Exact(out),
        None => ReplyInto::Owned,
    };
    exchange_into(conn, limits, id, opcode, body, data, into).await
}

async fn exchange_into(
    conn: &quinn::Connection,
    limits: &Limits,
    id: u64,
    opcode: Opcode,
    body: &[u8],
    data: &[u8],
    into: ReplyInto<'_, '_>,
) -> Result<(Vec<u8>, Vec<u8>), Error> {
    let mut hop = HopTimer::start("client", opcode, data.len() as u64);
    let (mut send, mut recv) = conn.open_bi().await.map_err(disconnected)?;
    let h = Header::request(opcode, id, body.len() as u32, data.len() as u32);
    proto::write_frame(&mut send, &h, body, data)
        .await
        .map_err(disconnected)?;
    send.finish().map_err(disconnected)?;
    hops::mark(&mut hop, "send");
    let read_err = |e: std::io::Error| match proto::proto_error(&e) {
        Some(p) => Error::Protocol(p.to_string()),
        None => disconnected(e),
    };
    let (header, reply_body) = proto::read_head(&mut recv, limits)
        .await
        .map_err(read_err)?;
    if header.status != Status::Ok {
        let msg = from_body::<ErrorBody>(&reply_body)
            .map(|b| b.message)
            .unwrap_or_default();
        return Err(Error::from_status(header.status, msg));
    }
    if header.request_id != id || !header.is_reply() {
        return Err(Error::Protocol("reply does not match the request".into()));
    }
    let mut owned = Vec::new();
    let want = header.data_len as usize;
    let mismatch =
        |have: usize| Error::Protocol(format!("reply has {want} bytes of data, {have} expected"));
    match into {
        ReplyInto::Exact(out) if out.len() == want => {
            tokio::io::AsyncReadExt::read_exact(&mut recv, out)
                .await
                .map_err(read_err)?;
        }
        ReplyInto::Exact(out) => return Err(mismatch(out.len())),
        ReplyInto::Owned => {
            owned = vec![0u8; want];
            tokio::io::AsyncReadExt::read_exact(&mut recv, &mut owned)
                .await
                .map_err(read_err)?;
        }
        ReplyInto::Parts(parts) => {
            let room: usize = parts.iter().map(|p| p.len()).sum();
            if want > room {
                return Err(mismatch(room));
            }
            let mut left = want;
            for part in parts.iter_mut() {
                if left == 0 {
                    break;
                }
                if part.len() > left {
                    return Err(Error::Protocol("a read was cut in the reply".into()));
                }
                tokio::io::AsyncReadExt::read_exact(&mut recv, part)
                    .await
                    .map_err(read_err)?;
                left -= part.len();
            }
        }
    }
    if let Some(t) = &mut hop {
        t.mark("reply");
        t.set_op(opcode, (data.len() + header.data_len as usize) as u64);
    }
    Ok((reply_body, owned))
}

/// Splits `len` bytes into at most `n` contiguous ranges whose inner
/// bounds fall on 2 MiB (the node's chunk size); one empty range for 0.
fn stripe_bounds(len: usize, n: usize) -> Vec<std::ops::Range<usize>> {
    const ALIGN: usize = 2 << 20;
    let per = len.div_ceil(n.max(1)).div_ceil(ALIGN).max(1) * ALIGN;
    let mut out = Vec::new();
    let mut start = 0;
    loop {
        let end = (start + per).min(len);
        out.push(start..end);
        start = end;
        if start >= len {
            return out;
        }
    }
}

/// Polls every future on this task until all are done (no spawning, so
/// they may borrow).
async fn join_all<F: std::future::Future>(futs: Vec<F>) -> Vec<F::Output> {
    let mut futs: Vec<std::pin::Pin<Box<F>>> = futs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in futs.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *o = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().flatten().collect()
}

/// The fields of a [`Batch`] before its commands, in its order: a BATCH
/// body is these, then the commands ([`EncodeCommands`]), the same bytes
/// as the [`Batch`] of the same values.
#[derive(serde::Serialize)]
struct BatchHeadRef {
    lease: LeaseId,
    seq: u64,
    modules: Vec<ModuleUse>,
}

/// Commands a BATCH carries without owning them, appended to its body in
/// the protocol's encoding (as postcard encodes the `Vec<Command>` of the
/// same commands).
pub(crate) trait EncodeCommands {
    /// Appends the commands to `out`.
    fn encode_into(&self, out: &mut Vec<u8>);
}

impl EncodeCommands for &[Command] {
    fn encode_into(&self, out: &mut Vec<u8>) {
        proto::encode_commands(out, self.len(), self.iter().map(CommandView::from));
    }
}

#[cfg(test)]
mod batch_ref_tests {
    use super::*;
    use crate::proto::{Id, Op};

    #[test]
    fn a_borrowed_batch_encodes_to_the_same_bytes_as_a_batch() {
        let commands = vec![
            Command {
                stream: 1,
                op: Op::Alloc {
                    buf: Id(7),
                    size: 64,
                },
            },
            Command {
                stream: 2,
                op: Op::Free { id: Id(7) },
            },
        ];
        let modules = vec![ModuleUse {
            hash: ModuleHash([3; 32]),
            source: None,
        }];
        let lease = LeaseId([9; 16]);
        let owned = Batch {
            lease,
            seq: 42,
            modules: modules.clone(),
            commands: commands.clone(),
        };
        let mut borrowed = to_body(&BatchHeadRef {
            lease,
            seq: 42,
            modules,
        });
        (&commands[..]).encode_into(&mut borrowed);
        assert_eq!(borrowed, to_body(&owned));
        assert_eq!(from_body::<Batch>(&borrowed).unwrap(), owned);
    }
}

#[cfg(test)]
mod stripe_tests {
    use super::stripe_bounds;

    #[test]
    fn stripes_cover_the_range_in_aligned_parts() {
        const M: usize = 2 << 20;
        assert_eq!(stripe_bounds(0, 4), vec![0..0]);
        assert_eq!(stripe_bounds(5, 4), vec![0..5]);
        assert_eq!(
            stripe_bounds(8 * M, 4),
            vec![0..2 * M, 2 * M..4 * M, 4 * M..6 * M, 6 * M..8 * M]
        );
        assert_eq!(
            stripe_bounds(3 * M + 1, 4),
            vec![0..M, M..2 * M, 2 * M..3 * M, 3 * M..3 * M + 1]
        );
        for (len, n) in [(1, 1), (M - 1, 3), (256 * M / 2 + 7, 4), (9 * M, 8)] {
            let parts = stripe_bounds(len, n);
            assert!(parts.len() <= n);
            assert_eq!(parts[0].start, 0);
            assert_eq!(parts.last().unwrap().end, len);
            for w in parts.windows(2) {
                assert_eq!(w[0].end, w[1].start);
                assert_eq!(w[0].end % M, 0);
            }
        }
    }
}
