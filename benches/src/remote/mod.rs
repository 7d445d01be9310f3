//! The remote rows: a lease node embedded in this process, on loopback,
//! against the raw transport measured in the same run (quinn with the
//! node's TLS and transport settings, no protocol:
//! [`raw`]).
//!
//! Topics ([`TOPICS`]):
//! - `remote_alloc`: lease-allocation latency, with a pre-started worker
//!   and cold (worker start and context creation); no raw side. It sleeps
//!   to let the worker pool refill ([`RemoteConfig::refill`]).
//! - `remote`: the one-kernel BATCH round trip (launch, reply when done),
//!   MEM_WRITE / MEM_READ of 256 MiB on one connection and striped, the
//!   20-op chain, one awaited launch, an awaited `h2d` and `d2h` of
//!   256 MiB, (with a GPU) a remote `zip` of two 1 ms spins, and the raw
//!   transports against each other: quinn striped over four connections
//!   and with [`cuda_lease::TransportSettings::loopback`] against its
//!   defaults, and against TCP on loopback (no goals).
//! - `remote_chain` (only when named): the raw 64 B round trip and the
//!   chain rows alone (e.g. to profile the node's command path).
//! - `remote_launch` (only when named): one awaited launch on kept
//!   buffers, remote and local, interleaved with the raw 64 B round trip:
//!   a submission's fixed cost, with no bulk bytes; and what one more
//!   launch in a submission costs, remote against local.
//! - `remote_pool` (only when named): whether a lease behaves like a local
//!   stream pool for many tokio tasks: two tasks' independent ~1 s kernels
//!   against one alone, 64 tasks' pipelines of 1 MiB (kernel only; up,
//!   kernel, down; transfers only), lease against local, and those tasks'
//!   1 MiB transfers against one bulk `h2d` and `d2h` on the lease
//!   ([`PoolConfig`] sets the sizes).
//!
//! With [`DeviceSpec::Memory`] (`REPORT_REMOTE_DEVICE=memory`) the workers
//! drive the in-memory test double instead of a GPU, so the node, QUIC and
//! pipe path can be measured on a machine without one; it runs only the
//! test kernels it knows, on the host, and the rows that need a local GPU
//! say so.
//!
//! Workers are processes of [`RemoteConfig::worker`], which must call
//! [`cuda_lease_node::main_if_worker`] first thing (`bench-report` does).
//! Everything is measured from `block_on`'s thread of the topic's runtime;
//! with [`RemoteConfig::in_task`] from a task on it instead (as a tokio
//! service awaits its ops); that makes the raw round trip faster but not
//! the remote chain, so the chain row's ratio is higher there.

mod baselines;
mod chain;
mod pool;
pub mod raw;
mod steps;
mod transfers;

pub use pool::PoolConfig;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cuda_lease::client::{BulkUse, Client, ClientConfig};
use cuda_lease_node::node::{Node, NodeConfig};
use cuda_lease_node::worker::{DeviceSpec, WorkerSpec};
use tokio::runtime::Runtime;

use crate::measure::Config;
use crate::report::{Row, Unit};
use crate::stats::Summary;
use crate::Result;

/// The remote topics, in the order they run.
pub const TOPICS: [&str; 5] = [
    "remote_alloc",
    "remote",
    "remote_chain",
    "remote_launch",
    "remote_pool",
];

/// Remote topics that run only when `REPORT_ONLY` names them (each repeats
/// a part of `remote` on its own).
pub const ON_REQUEST: [&str; 3] = ["remote_chain", "remote_launch", "remote_pool"];

/// Bytes of the bulk transfers (MEM_WRITE / MEM_READ, raw, `h2d` / `d2h`)
/// in the report.
pub const XFER_BYTES: u64 = 256 << 20;

/// Device memory of a memory-device worker in the report: room for the
/// 256 MiB buffers plus the node's default headroom.
pub const MEMORY_CAPACITY: u64 = 2 << 30;

/// How the remote topics run.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteConfig {
    /// The device the node's workers drive: GPU 0, or the in-memory device.
    pub device: DeviceSpec,
    /// The worker executable (it calls [`cuda_lease_node::main_if_worker`]).
    pub worker: PathBuf,
    /// The workers' pipe spin budget; `None`: the node's default
    /// (`cuda_lease_node::spin::default_spin`).
    pub spin: Option<Duration>,
    /// Round trips per latency row (2000 in the report; the chain rows
    /// keep at most 500).
    pub iters: usize,
    /// MEM_WRITE / MEM_READ and raw transfers per rate row (5).
    pub xfer_iters: usize,
    /// Bytes per bulk transfer ([`XFER_BYTES`]).
    pub bytes: u64,
    /// How long `remote_alloc` waits for the worker pool to refill (2 s).
    pub refill: Duration,
    /// Measure from a task on the runtime instead of `block_on`'s thread.
    pub in_task: bool,
    /// The transport settings of the node, its clients and the raw quinn
    /// they are compared with (`REPORT_TRANSPORT`: a preset's name,
    /// `loopback` by default: the report runs on loopback).
    pub transport: (String, cuda_lease::TransportSettings),
    /// Connections of the striped client (`REPORT_STRIPES`, else the
    /// client's default).
    pub stripes: usize,
    /// Stamp the points of the awaited launch's, the chain's and the
    /// replay's paths and print where their time went, step by step
    /// (`cuda_lease::stamps`: one clock read per point, about 20 per
    /// submission), in a pass of their own after the timed one, which
    /// runs without stamping; on unless `REPORT_STAMPS=0`.
    pub stamps: bool,
    /// The sizes of `remote_pool` ([`PoolConfig::new`] at the report's
    /// scale).
    pub pool: PoolConfig,
    /// Cores the workers are pinned to (`taskset -c` runs them), or none.
    pub worker_cpus: Option<String>,
    /// Worker threads of a runtime of their own for the node and the raw
    /// servers (as a node process has its own), or none: the servers share
    /// the report's runtime with the clients.
    pub server_threads: Option<usize>,
    /// Leases' workers serve their BATCHes themselves, the default
    /// (`REPORT_DIRECT=0`: the node runs without direct leases and serves
    /// every BATCH).
    pub direct: bool,
    /// A task on the report's runtime yields in a loop for the whole run
    /// (`REPORT_CLIENT_SPIN=1`), so one of its threads never sleeps: what
    /// waking the runtime costs the clients, and the raw references on the
    /// same runtime.
    pub client_spin: bool,
    /// The clients' [`ClientConfig::busy_poll`] (`REPORT_BUSY_POLL_US`:
    /// microseconds; off by default): each client's endpoint on a thread
    /// of its own, kept awake while a request of the client is in
    /// flight; the raw quinn references' clients busy-poll the same way
    /// ([`raw::busy_poll`]), and their servers keep polling after each
    /// request for the workers' spin.
    pub busy_poll: Option<Duration>,
}

impl RemoteConfig {
    /// The report's settings: GPU 0 (or the memory device with
    /// `REPORT_REMOTE_DEVICE=memory`), 2000 round trips and 5 transfers of
    /// 256 MiB at `REPORT_SCALE=1`, workers from the current executable,
    /// `REPORT_REMOTE_SPIN_US` for their spin, `REPORT_REMOTE_IN_TASK=1`
    /// to measure from a task, `REPORT_TRANSPORT` for the transport preset,
    /// `REPORT_STRIPES` for the striped client's connections and
    /// `REPORT_STAMPS=0` to leave the paths unstamped, and
    /// `REPORT_REMOTE_WORKER_CPUS` (a `taskset -c` list) to start the
    /// workers pinned to those cores, and `REPORT_SERVER_THREADS` to run
    /// the node and the raw servers on a runtime of their own with that
    /// many worker threads, `REPORT_CLIENT_SPIN=1` and
    /// `REPORT_BUSY_POLL_US` (see their fields).
    ///
    /// # Errors
    /// If a variable has a value it cannot take, or the current
    /// executable's path is unknown.
    pub fn from_env(cfg: &Config) -> Result<Self> {
        let device = match std::env::var("REPORT_REMOTE_DEVICE").ok().as_deref() {
            None | Some("" | "cuda") => DeviceSpec::Cuda { ordinal: 0 },
            Some("memory") => DeviceSpec::Memory {
                capacity: MEMORY_CAPACITY,
            },
            Some(other) => {
                return Err(format!(
                    "REPORT_REMOTE_DEVICE must be `cuda` or `memory`, got `{other}`"
                )
                .into())
            }
        };
        let spin = match std::env::var("REPORT_REMOTE_SPIN_US") {
            Err(_) => None,
            Ok(s) => Some(Duration::from_micros(s.trim().parse().map_err(|_| {
                format!("REPORT_REMOTE_SPIN_US must be a number of microseconds, got `{s}`")
            })?)),
        };
        let name = std::env::var("REPORT_TRANSPORT").unwrap_or_else(|_| "loopback".into());
        let settings = cuda_lease::TransportSettings::preset(&name).ok_or_else(|| {
            format!(
                "REPORT_TRANSPORT must be one of {:?}, got `{name}`",
                cuda_lease::transport::PRESETS
            )
        })?;
        let stripes = match std::env::var("REPORT_STRIPES") {
            Err(_) => cuda_lease::client::DEFAULT_STRIPES,
            Ok(s) => s
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| {
                    format!("REPORT_STRIPES must be a positive number of connections, got `{s}`")
                })?,
        };
        Ok(RemoteConfig {
            transport: (name, settings),
            stripes,
            device,
            worker: std::env::current_exe()?,
            spin,
            iters: cfg.reps(2000, 20),
            xfer_iters: cfg.reps(5, 1),
            bytes: XFER_BYTES,
            refill: Duration::from_secs(2),
            worker_cpus: std::env::var("REPORT_REMOTE_WORKER_CPUS").ok(),
            server_threads: match std::env::var("REPORT_SERVER_THREADS") {
                Ok(s) => Some(s.parse().ok().filter(|&n: &usize| n > 0).ok_or_else(|| {
                    format!("REPORT_SERVER_THREADS must be a positive number of threads, got `{s}`")
                })?),
                Err(_) => None,
            },
            in_task: std::env::var_os("REPORT_REMOTE_IN_TASK").is_some_and(|v| v == "1"),
            direct: std::env::var_os("REPORT_DIRECT").is_none_or(|v| v != "0"),
            client_spin: std::env::var_os("REPORT_CLIENT_SPIN").is_some_and(|v| v == "1"),
            busy_poll: match std::env::var("REPORT_BUSY_POLL_US") {
                Err(_) => None,
                Ok(s) => Some(Duration::from_micros(s.trim().parse().map_err(|_| {
                    format!("REPORT_BUSY_POLL_US must be a number of microseconds, got `{s}`")
                })?)),
            },
            stamps: std::env::var_os("REPORT_STAMPS").is_none_or(|v| v != "0"),
            pool: PoolConfig::new(cfg),
        })
    }

    /// Whether the workers drive the in-memory device (no kernels run, no
    /// local GPU rows).
    pub fn memory(&self) -> bool {
        matches!(self.device, DeviceSpec::Memory { .. })
    }
}

/// What every remote topic uses: the settings and two clients of the node.
#[derive(Debug)]
struct Ctx {
    cfg: RemoteConfig,
    /// One QUIC connection, no bulk-data channel: the BATCH, unstriped
    /// and chain rows.
    client: Arc<Client>,
    /// The default client (striped, the bulk-data channel on): what a user
    /// gets, the `h2d` / `d2h` rows.
    striped: Arc<Client>,
    /// Striped over QUIC alone (the bulk-data channel off): the striped
    /// MEM rows, and the comparison of the two paths.
    quic_striped: Arc<Client>,
    /// How many stripes `striped` uses.
    stripes: usize,
}

/// An embedded lease node with its clients and runtime, started once and
/// shared by the remote topics of a run.
#[derive(Debug)]
pub struct Bench {
    rt: Runtime,
    /// The node's and the raw servers' own runtime
    /// ([`RemoteConfig::server_threads`]), if any.
    servers: Option<Runtime>,
    node: Option<Node>,
    ctx: Arc<Ctx>,
    device: String,
}

impl Bench {
    /// Starts the node (its workers drive `cfg.device`) on loopback and
    /// connects its clients.
    ///
    /// # Errors
    /// If the runtime, the node or a connection cannot be started.
    pub fn start(cfg: RemoteConfig) -> Result<Self> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?;
        if cfg.client_spin {
            rt.spawn(async {
                loop {
                    tokio::task::yield_now().await;
                }
            });
        }
        let mut worker = WorkerSpec::current_exe(cfg.device.clone())?;
        worker.program = cfg.worker.clone();
        if let Some(cpus) = &cfg.worker_cpus {
            worker.args = [cpus.into(), worker.program.clone().into_os_string()]
                .into_iter()
                .chain(worker.args)
                .collect();
            worker.args.insert(0, "-c".into());
            worker.program = "taskset".into();
            detail(format_args!("workers pinned to cores {cpus}"));
        }
        if let Some(spin) = cfg.spin {
            worker.spin = spin;
        }
        detail(format_args!("worker pipe spin: {:?}", worker.spin));
        detail(format_args!("transport settings: {}", cfg.transport.0));
        // Stamping costs a lease's submissions (about 20 clock reads and
        // the worker's stamps in each reply): the timed passes run
        // without it, and the steps come from passes of their own.
        cuda_lease::stamps::set_enabled(false);
        let mut node_cfg = NodeConfig::new(worker);
        node_cfg.transport = cfg.transport.1.clone();
        node_cfg.tokens = vec!["bench".into()];
        node_cfg.submit_workers = 1;
        node_cfg.prestart_workers = 1;
        node_cfg.direct_leases = cfg.direct;
        if !cfg.direct {
            detail(format_args!(
                "the node serves every BATCH itself (REPORT_DIRECT=0)"
            ));
        }
        let servers = match cfg.server_threads {
            Some(n) => {
                detail(format_args!(
                    "the node and the raw servers on {n} runtime threads of their own"
                ));
                Some(
                    tokio::runtime::Builder::new_multi_thread()
                        .worker_threads(n)
                        .thread_name("bench-server")
                        .enable_all()
                        .build()?,
                )
            }
            None => None,
        };
        raw::serve_on(servers.as_ref().map(|s| s.handle().clone()));
        // The raw servers spin after each request as the workers do.
        raw::busy_poll(
            cfg.busy_poll,
            cfg.spin.unwrap_or_else(cuda_lease_node::spin::default_spin),
        );
        let node = servers
            .as_ref()
            .unwrap_or(&rt)
            .block_on(Node::spawn_local(node_cfg))?;
        let (ctx, device) = rt.block_on(async {
            let config = ClientConfig::pinned(node.cert_der().clone())
                .token("bench")
                .transport(cfg.transport.1.clone())
                .stripes(cfg.stripes, cuda_lease::client::DEFAULT_STRIPE_MIN_BYTES)
                .direct(cfg.direct)
                .busy_poll(cfg.busy_poll);
            if let Some(limit) = cfg.busy_poll {
                detail(format_args!(
                    "clients busy-poll for up to {limit:?}, the raw quinn references' too (their servers as the workers spin)"
                ));
            }
            let single = config.clone().stripes(1, 0).bulk(BulkUse::Off);
            let client = Arc::new(Client::connect(node.addr(), &single).await?);
            let striped = Arc::new(Client::connect(node.addr(), &config).await?);
            let quic_striped =
                Arc::new(Client::connect(node.addr(), &config.clone().bulk(BulkUse::Off)).await?);
            let inv = client.inventory().await?;
            let dev = inv.devices.first().ok_or("the node reports no device")?;
            detail(format_args!(
                "device: {} ({} bytes free)",
                dev.name, dev.free_bytes
            ));
            let ctx = Ctx {
                cfg,
                client,
                striped,
                quic_striped,
                stripes: config.stripes,
            };
            Ok::<_, crate::BenchError>((ctx, dev.name.clone()))
        })?;
        Ok(Bench {
            rt,
            servers,
            node: Some(node),
            ctx: Arc::new(ctx),
            device,
        })
    }

    /// The node's device, as its inventory names it.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// Measures remote topic `topic` (one of [`TOPICS`]).
    ///
    /// # Errors
    /// An unknown topic, or the first error of a measurement.
    pub fn run(&self, topic: &str) -> Result<Vec<Row>> {
        let topic: &'static str = TOPICS
            .into_iter()
            .find(|t| *t == topic)
            .ok_or_else(|| format!("unknown remote topic `{topic}`"))?;
        let ctx = self.ctx.clone();
        let fut = async move {
            match topic {
                "remote_alloc" => transfers::alloc_rows(&ctx).await,
                "remote" => remote_rows(&ctx).await,
                "remote_chain" => chain::chain_only(&ctx).await,
                "remote_launch" => chain::launch_only(&ctx).await,
                _ => pool::pool_rows(&ctx).await,
            }
        };
        self.block_on(fut)
    }

    fn block_on<F>(&self, fut: F) -> Result<Vec<Row>>
    where
        F: Future<Output = Result<Vec<Row>>> + Send + 'static,
    {
        if self.ctx.cfg.in_task {
            self.rt.block_on(async {
                tokio::spawn(fut)
                    .await
                    .unwrap_or_else(|e| Err(format!("the bench task failed: {e}").into()))
            })
        } else {
            self.rt.block_on(fut)
        }
    }

    /// Shuts the node down (its workers exit).
    pub fn shutdown(mut self) {
        if let Some(node) = self.node.take() {
            self.servers
                .as_ref()
                .unwrap_or(&self.rt)
                .block_on(node.shutdown());
        }
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        // Raw servers made later start on their caller's runtime again:
        // this bench's server runtime goes with it.
        raw::serve_on(None);
    }
}

/// The `remote` topic: the raw baselines, the lease's BATCH and transfer
/// rows, the striped rows, the chain rows, then the raw transports against
/// each other, in that order.
async fn remote_rows(ctx: &Ctx) -> Result<Vec<Row>> {
    let raw = baselines::raw_baseline(ctx).await?;
    let lease = transfers::lease_rows(ctx).await?;
    let striped = transfers::striped_rates(ctx).await?;
    let chain = chain::chain_bench(ctx).await?;
    let mut rows = transfers::rows(ctx, &raw, &lease, &striped);
    rows.extend(chain::rows("remote", &chain, &raw));
    rows.push(baselines::raw_striping_row(ctx, &raw, true));
    rows.push(baselines::raw_striping_row(ctx, &raw, false));
    rows.extend(baselines::transport_rows(ctx, &raw));
    rows.push(baselines::relay_row(&raw));
    rows.extend(baselines::awake_row(&raw));
    Ok(rows)
}

/// One progress line of the remote topics, on stderr.
fn detail(line: std::fmt::Arguments<'_>) {
    eprintln!("[bench-report]   remote: {line}");
}

/// Where `name`'s time went, step by step, on stderr: for each point of
/// the path its submissions reached, the median time from the point
/// before it (`cuda_lease::stamps`), and their sum.
fn detail_steps(name: &str, runs: &[cuda_lease::stamps::Stamps]) {
    print_steps(name, runs.len(), &steps::lease_steps(runs), |p| p.name());
}

/// `steps` of `n` runs on stderr, as [`detail_steps`] prints them, each
/// step named by where it ends (`label`).
fn print_steps<P: Copy>(
    name: &str,
    n: usize,
    steps: &[steps::Step<P>],
    label: impl Fn(P) -> &'static str,
) {
    if steps.is_empty() {
        return;
    }
    let line: Vec<String> = steps
        .iter()
        .map(|s| format!("{} +{:.1}", label(s.to), s.median_us))
        .collect();
    let sum: f64 = steps.iter().map(|s| s.median_us).sum();
    detail(format_args!(
        "{name}, step by step (median us from the point before, n={n}): {} (sum {sum:.1})",
        line.join(", ")
    ));
}

/// `name`'s samples on stderr: n, median, p99, min, max.
fn detail_times(name: &str, v: &[Duration]) {
    let mut v = v.to_vec();
    v.sort();
    if v.is_empty() {
        return;
    }
    let p = |q: f64| v[(((v.len() - 1) as f64 * q).round() as usize).min(v.len() - 1)];
    detail(format_args!(
        "{name}: n={} median {:?} p99 {:?} min {:?} max {:?}",
        v.len(),
        p(0.5),
        p(0.99),
        v[0],
        v[v.len() - 1]
    ));
}

/// The statistics of `v` in `unit` (a time unit).
fn times(unit: Unit, v: &[Duration]) -> Option<Summary> {
    let scale = match unit {
        Unit::Millis => 1e3,
        _ => 1e6,
    };
    let x: Vec<f64> = v.iter().map(|d| d.as_secs_f64() * scale).collect();
    Summary::of(&x)
}

/// The statistics of the rates (GiB/s) of moving `bytes` in each of `v`.
fn rates(bytes: u64, v: &[Duration]) -> Option<Summary> {
    let x: Vec<f64> = v.iter().map(|d| gib_s(bytes, *d)).collect();
    Summary::of(&x)
}

/// `bytes` in `d`, in GiB/s.
fn gib_s(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / (1u64 << 30) as f64
}

/// `a - b` of the medians (no spread: it is not one path's samples).
fn difference(a: Summary, b: Summary) -> Summary {
    Summary {
        median: a.median - b.median,
        p10: f64::NAN,
        p90: f64::NAN,
        n: a.n.min(b.n),
    }
}

/// `bytes` in words (`256 MiB`, `1 KiB`, `100 B`).
fn size_label(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}
