//! Helpers shared by the integration tests.
#![allow(dead_code, unreachable_pub)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cuda_lease::client::{Client, ClientConfig, Lease, LeaseBuilder, Session};
use cuda_lease::clock::ManualClock;
use cuda_lease::proto::{self, Header, Opcode, Status};
use cuda_lease::remote::LeaseBackend;
use cuda_lease_node::node::{Node, NodeConfig};
use cuda_lease_node::worker::{DeviceSpec, WorkerSpec};

#[cfg(feature = "fleet")]
pub mod etcd;

pub const TOKEN: &str = "test-token";

/// The set-up every node test shares: an embedded node (by default with the
/// in-memory device, [`memory_config`]), optionally a client of it with the
/// test token, a lease on that client and a manual clock; torn down by
/// [`Fixture::shutdown`] or [`Fixture::free_and_shutdown`].
///
/// ```ignore
/// let f = Fixture::memory(1 << 20).lease(4096).start().await;
/// let s = f.session();
/// // ...
/// f.free_and_shutdown().await;
/// ```
#[derive(Debug)]
pub struct Fixture {
    pub node: Node,
    client: Option<Arc<Client>>,
    lease: Option<Lease>,
    clock: Option<ManualClock>,
}

/// Options of a [`Fixture`], applied by [`FixtureBuilder::start`].
#[derive(Debug)]
#[must_use = "a fixture starts with `.start().await`"]
pub struct FixtureBuilder {
    config: NodeConfig,
    client: bool,
    lease: Option<LeaseBuilder>,
    clock: Option<ManualClock>,
}

impl Fixture {
    /// A node with the in-memory device of `capacity` bytes.
    pub fn memory(capacity: u64) -> FixtureBuilder {
        Self::with_config(memory_config(capacity))
    }

    /// [`Fixture::memory`] on a node that serves every BATCH itself
    /// ([`node_path_config`]).
    pub fn node_path(capacity: u64) -> FixtureBuilder {
        Self::with_config(node_path_config(capacity))
    }

    /// A node of `config` (a GPU node, say).
    pub fn with_config(config: NodeConfig) -> FixtureBuilder {
        FixtureBuilder {
            config,
            client: false,
            lease: None,
            clock: None,
        }
    }

    /// The client connected with the test token.
    pub fn client(&self) -> &Arc<Client> {
        self.client
            .as_ref()
            .expect("fixture built without .client() or .lease(..)")
    }

    /// The fixture's lease.
    pub fn lease(&self) -> &Lease {
        self.lease
            .as_ref()
            .expect("fixture built without .lease(..), or its lease was taken")
    }

    /// Takes the fixture's lease (to free or leak it in the test itself).
    pub fn take_lease(&mut self) -> Lease {
        self.lease
            .take()
            .expect("fixture built without .lease(..), or its lease was taken")
    }

    /// A session on the fixture's lease.
    pub fn session(&self) -> Session {
        self.lease().session()
    }

    /// The node's manual clock.
    pub fn clock(&self) -> &ManualClock {
        self.clock
            .as_ref()
            .expect("fixture built without .manual_clock()")
    }

    /// Another lease of `vram` bytes on the fixture's client, not renewed.
    pub async fn another_lease(&self, vram: u64) -> Lease {
        lease_of(self.client(), vram).await
    }

    /// A `cuda-async` policy that runs ops on the fixture's lease.
    pub fn policy(&self) -> cuda_async::RemotePolicy {
        policy_of(self.lease())
    }

    /// The node, and the rest to drop when the test is done with it (a test
    /// that shuts the node down under its lease).
    pub fn into_node(self) -> (Node, impl Sized) {
        let Fixture {
            node,
            client,
            lease,
            clock,
        } = self;
        (node, (client, lease, clock))
    }

    /// Shuts the node down, then drops what is left (as a test that ends
    /// with `node.shutdown().await` did).
    pub async fn shutdown(self) {
        let (node, rest) = self.into_node();
        node.shutdown().await;
        drop(rest);
    }

    /// Frees the fixture's lease (which must succeed), then shuts down.
    pub async fn free_and_shutdown(mut self) {
        self.take_lease().free().await.unwrap();
        self.shutdown().await;
    }
}

impl FixtureBuilder {
    /// Adjusts the node's config.
    pub fn config(mut self, adjust: impl FnOnce(&mut NodeConfig)) -> Self {
        adjust(&mut self.config);
        self
    }

    /// The node runs on a [`ManualClock`] ([`Fixture::clock`]), reaped every
    /// 20 ms.
    pub fn manual_clock(mut self) -> Self {
        let clock = ManualClock::new();
        self.config.clock = Arc::new(clock.clone());
        self.config.reaper_interval = Duration::from_millis(20);
        self.clock = Some(clock);
        self
    }

    /// Connects a client with the test token ([`Fixture::client`]).
    pub fn client(mut self) -> Self {
        self.client = true;
        self
    }

    /// A lease of `vram` bytes without renewal, on the fixture's client.
    pub fn lease(self, vram: u64) -> Self {
        self.lease_with(Lease::builder().min_vram(vram).auto_renew(false))
    }

    /// A lease made by `builder`, on the fixture's client.
    pub fn lease_with(mut self, builder: LeaseBuilder) -> Self {
        self.client = true;
        self.lease = Some(builder);
        self
    }

    /// Starts the node, connects and leases.
    pub async fn start(self) -> Fixture {
        let node = match Node::spawn_local(self.config).await {
            Ok(node) => node,
            Err(e) => panic!(
                "could not start a node (worker {}): {e}",
                worker_exe().display()
            ),
        };
        let client = match self.client {
            true => Some(connect(&node).await),
            false => None,
        };
        let lease = match (self.lease, &client) {
            (Some(b), Some(c)) => Some(b.on(c.clone()).await.unwrap()),
            _ => None,
        };
        Fixture {
            node,
            client,
            lease,
            clock: self.clock,
        }
    }
}

/// A lease of `vram` bytes on `client`, not renewed.
pub async fn lease_of(client: &Arc<Client>, vram: u64) -> Lease {
    Lease::builder()
        .min_vram(vram)
        .auto_renew(false)
        .on(client.clone())
        .await
        .unwrap()
}

/// A lease of `vram` bytes, not renewed, on a new client of `node`.
pub async fn lease_on(node: &Node, vram: u64) -> Lease {
    lease_of(&connect(node).await, vram).await
}

/// A `cuda-async` policy that runs ops on `lease`.
pub fn policy_of(lease: &Lease) -> cuda_async::RemotePolicy {
    cuda_async::RemotePolicy::new(&LeaseBackend::current(lease.session()))
}

/// The worker executable: `$CUDA_LEASE_WORKER_EXE`, else `cuda-lease-node`
/// next to this test binary or one folder up (cargo's layout, or a bundle
/// folder holding both), else the path cargo built it at.
pub fn worker_exe() -> PathBuf {
    if let Some(p) = std::env::var_os("CUDA_LEASE_WORKER_EXE") {
        return p.into();
    }
    let name = format!("cuda-lease-node{}", std::env::consts::EXE_SUFFIX);
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            for cand in [dir.join(&name), dir.join("..").join(&name)] {
                if cand.is_file() {
                    return cand;
                }
            }
        }
    }
    PathBuf::from(env!("CARGO_BIN_EXE_cuda-lease-node"))
}

/// A node config with the in-memory test double device.
pub fn memory_config(capacity: u64) -> NodeConfig {
    let mut cfg = NodeConfig::new(WorkerSpec {
        program: worker_exe(),
        args: Vec::new(),
        device: DeviceSpec::Memory { capacity },
        spin: cuda_lease_node::spin::default_spin(),
        compile: Default::default(),
    });
    cfg.tokens = vec![TOKEN.into()];
    cfg.capacity = Some(capacity);
    cfg.submit_workers = 1;
    cfg.prestart_workers = 0;
    cfg
}

/// [`memory_config`] for a node that serves every BATCH itself (run with
/// `--direct-leases=false`): for tests of what passes through the node (its
/// raw BATCH handling, its per-batch metrics and stamps); the default path
/// (leases' workers serve their batches) has its own tests.
pub fn node_path_config(capacity: u64) -> NodeConfig {
    let mut cfg = memory_config(capacity);
    cfg.direct_leases = false;
    cfg
}

/// The tests' client settings; with `CUDA_LEASE_TEST_BUSY_POLL=1` the
/// clients busy-poll (`ClientConfig::busy_poll`, 2 ms).
pub fn client_config(node: &Node) -> ClientConfig {
    let busy = std::env::var_os("CUDA_LEASE_TEST_BUSY_POLL").is_some_and(|v| v == "1");
    ClientConfig::pinned(node.cert_der().clone())
        .token(TOKEN)
        .busy_poll(busy.then_some(Duration::from_millis(2)))
}

/// A client authenticated with `token` (not the default test token).
pub async fn connect_as(node: &Node, token: &str) -> Arc<Client> {
    let cfg = ClientConfig::pinned(node.cert_der().clone()).token(token);
    Arc::new(Client::connect(node.addr(), &cfg).await.expect("connect"))
}

pub async fn connect(node: &Node) -> Arc<Client> {
    Arc::new(
        Client::connect(node.addr(), &client_config(node))
            .await
            .expect("connect"),
    )
}

/// Polls `f` every 20 ms for up to `limit`.
pub async fn eventually<F, Fut>(limit: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < deadline {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// Polls `cond` every millisecond until it holds; panics naming `what` once
/// `limit` has passed, also when a poll of `cond` itself is still running
/// then (a request that hangs).
pub async fn wait_until<F, Fut>(limit: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let polls = async {
        while !cond().await {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    if tokio::time::timeout(limit, polls).await.is_err() {
        panic!("waited {limit:?} for {what}: it never happened");
    }
}

/// `GET /metrics` on the node's metrics port: the whole HTTP response.
pub async fn metrics_http(node: &Node) -> String {
    metrics_request(
        node,
        "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await
}

/// Sends `request` (raw HTTP/1.1, which should ask to close the connection)
/// to the node's metrics port and returns the whole response.
pub async fn metrics_request(node: &Node, request: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = node.metrics_addr().expect("metrics endpoint");
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .expect("metrics connect");
    s.write_all(request.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

pub fn metric(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l[name.len() + 1..].trim().parse().ok())
}

/// An authenticated raw QUIC connection (HELLO sent on its first stream).
pub async fn raw_authed_conn(node: &Node) -> quinn::Connection {
    let conn = raw_unauthed_conn(node).await;
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let body = cuda_lease::proto::to_body(&cuda_lease::proto::Hello {
        token: TOKEN.into(),
        client: "cut-off test".into(),
    });
    let h = cuda_lease::proto::Header::request(
        cuda_lease::proto::Opcode::Hello,
        1,
        body.len() as u32,
        0,
    );
    cuda_lease::proto::write_frame(&mut send, &h, &body, &[])
        .await
        .unwrap();
    send.finish().unwrap();
    let f = cuda_lease::proto::read_frame(&mut recv, &cuda_lease::proto::Limits::default())
        .await
        .unwrap();
    assert_eq!(f.header.status, cuda_lease::proto::Status::Ok);
    conn
}

/// A raw QUIC connection that never authenticates.
pub async fn raw_unauthed_conn(node: &Node) -> quinn::Connection {
    let ep = endpoint_on(node, [127, 0, 0, 1]);
    let conn = ep.connect(node.addr(), "localhost").unwrap().await.unwrap();
    std::mem::forget(ep);
    conn
}

/// A stream on a new connection that never authenticates.
pub async fn attacker_conn(node: &Node) -> (quinn::SendStream, quinn::RecvStream) {
    let conn = raw_unauthed_conn(node).await;
    let s = conn.open_bi().await.unwrap();
    std::mem::forget(conn);
    s
}

/// Deterministic pseudo-random f32s (xorshift), no extra dependencies.
pub fn random_f32(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 200.0 - 100.0
        })
        .collect()
}

/// Lines (8 bytes or more) of the files a tenant must never read back from
/// the node: `/etc/passwd`, the process's environment and command line.
/// Error texts are checked against them.
pub fn node_secrets() -> Vec<String> {
    ["/etc/passwd", "/proc/self/environ", "/proc/self/cmdline"]
        .iter()
        .flat_map(|p| {
            std::fs::read(p)
                .unwrap_or_default()
                .split(|b| *b == b'\n' || *b == 0)
                .filter(|l| l.len() >= 8)
                .map(|l| String::from_utf8_lossy(l).into_owned())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// VmRSS of this process, in bytes.
///
/// # Panics
///
/// Where `/proc/self/status` cannot be read or has no VmRSS line: the
/// memory checks would otherwise pass on a figure of 0.
pub fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status")
        .unwrap_or_else(|e| panic!("cannot measure RSS: /proc/self/status: {e}"));
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or_else(|| panic!("cannot measure RSS: no VmRSS line in /proc/self/status"));
    kib * 1024
}

/// Samples VmRSS every millisecond on a thread; `stop` gives the peak
/// growth over the value at `start`.
pub struct PeakRss {
    base: u64,
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl PeakRss {
    pub fn start() -> Self {
        let base = rss_bytes();
        let peak = Arc::new(AtomicU64::new(base));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s) = (peak.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                p.fetch_max(rss_bytes(), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        PeakRss {
            base,
            peak,
            stop,
            thread,
        }
    }

    pub fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("the RSS sampler panicked");
        self.peak
            .load(Ordering::Relaxed)
            .max(rss_bytes())
            .saturating_sub(self.base)
    }
}

/// `n` pseudo-random bytes from `seed` (xorshift64).
pub fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        out.extend_from_slice(&s.to_le_bytes());
    }
    out.truncate(n);
    out
}

/// BATCH messages the node ran, and the commands they carried.
pub fn batches(node: &Node) -> (u64, u64) {
    let t = node.metrics_text();
    (
        metric(&t, "gpu_batch_total").expect("gpu_batch_total"),
        metric(&t, "gpu_batch_commands_total").expect("gpu_batch_commands_total"),
    )
}

/// A QUIC client endpoint on `ip` (all of 127.0.0.0/8 is loopback), so a
/// test can choose the source address the node sees.
pub fn endpoint_on(node: &Node, ip: [u8; 4]) -> quinn::Endpoint {
    endpoint_with(node, ip, None)
}

/// [`endpoint_on`], its connections with `transport`'s settings (quinn's
/// defaults without).
pub fn endpoint_with(
    node: &Node,
    ip: [u8; 4],
    transport: Option<quinn::TransportConfig>,
) -> quinn::Endpoint {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(node.cert_der().clone()).unwrap();
    let mut tls = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![proto::ALPN.to_vec()];
    let qc = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
    let mut cfg = quinn::ClientConfig::new(Arc::new(qc));
    if let Some(t) = transport {
        cfg.transport_config(Arc::new(t));
    }
    let mut ep = quinn::Endpoint::client((ip, 0).into()).unwrap();
    ep.set_default_client_config(cfg);
    ep
}

/// A new connection from `ep` to the node.
pub async fn dial(
    ep: &quinn::Endpoint,
    node: &Node,
) -> Result<quinn::Connection, quinn::ConnectionError> {
    ep.connect(node.addr(), "localhost").unwrap().await
}

/// Sends HELLO with `token` on a new stream: the reply's status and
/// message, or `None` when the connection ended without one.
pub async fn hello(conn: &quinn::Connection, token: &str) -> Option<(Status, String)> {
    let body = proto::to_body(&proto::Hello {
        token: token.into(),
        client: "hardening test".into(),
    });
    let (mut send, mut recv) = conn.open_bi().await.ok()?;
    let h = Header::request(Opcode::Hello, 1, body.len() as u32, 0);
    proto::write_frame(&mut send, &h, &body, &[]).await.ok()?;
    let _ = send.finish();
    let f = tokio::time::timeout(
        Duration::from_secs(5),
        proto::read_frame(&mut recv, &proto::Limits::default()),
    )
    .await
    .ok()?
    .ok()?;
    let message = proto::from_body::<proto::ErrorBody>(&f.body)
        .map(|e| e.message)
        .unwrap_or_default();
    Some((f.header.status, message))
}

/// Whether `conn` was closed by the node within `limit`.
pub async fn closed_within(conn: &quinn::Connection, limit: Duration) -> bool {
    tokio::time::timeout(limit, conn.closed()).await.is_ok()
}
