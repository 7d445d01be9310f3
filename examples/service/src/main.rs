//! `service`: the MLP inference service over HTTP (see the crate's docs).
//!
//! ```text
//! cargo run --release -p cuda-async-service -- --listen 127.0.0.1:8080
//! curl -s 127.0.0.1:8080/metrics
//! ```
//!
//! The first line it prints is `listening on ADDR`. SIGTERM (or Ctrl-C)
//! stops it after the requests in flight are answered; it exits 0, or 1
//! after a sticky GPU fault lost its context.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use cuda_async::{Device, RemotePolicy, SchedulingPolicy, StreamPoolRoundRobin};
use cuda_async_service::baseline::Baseline;
use cuda_async_service::model::{HostWeights, Model};
use cuda_async_service::{router, Backend, Graphs, Options, Service};
use cuda_lease::client::{ClientConfig, Lease};
use cuda_lease::remote::LeaseBackend;
use cuda_lease_node::{DeviceSpec, Node, NodeConfig, WorkerSpec};

/// The MLP inference service: POST /infer, GET /metrics, GET /healthz.
#[derive(Debug, Parser)]
#[command(name = "service", version)]
struct Args {
    /// Address to listen on (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Streams of the local pool (the local GPU, device 0).
    #[arg(long, default_value_t = 4)]
    streams: usize,
    /// Run on a leased GPU: a node's address, or `embedded` for a node
    /// this process starts on 127.0.0.1.
    #[arg(long)]
    lease: Option<String>,
    /// The embedded node's device: `cuda` (GPU 0) or `memory` (the
    /// in-memory test device, which computes on the host).
    #[arg(long, default_value = "cuda")]
    embedded_device: String,
    /// Run on leases of a fleet whose nodes register in etcd at these
    /// endpoints (comma-separated): `--fleet-leases` leases, one a node,
    /// the weights on each. Needs the `fleet` feature.
    #[arg(long, value_delimiter = ',', conflicts_with = "lease")]
    etcd: Vec<String>,
    /// Leases held on the fleet (`--etcd`), each on another node.
    #[arg(long, default_value_t = 2)]
    fleet_leases: usize,
    /// Trust a fleet's nodes by the certificate fingerprints in its
    /// registry (`--etcd`) instead of `--cert`'s roots.
    #[arg(long)]
    trust_registry: bool,
    /// The node's certificate (PEM), for `--lease ADDR`; the roots the
    /// nodes' certificates chain to, for `--etcd`.
    #[arg(long)]
    cert: Option<PathBuf>,
    /// The token the node knows this tenant by, for `--lease ADDR` and
    /// `--etcd`.
    #[arg(long, env = "CUDA_LEASE_TOKEN")]
    token: Option<String>,
    /// Requests admitted at once; more are answered 503.
    #[arg(long, default_value_t = 1024)]
    queue: usize,
    /// Dynamic batching: how long a batch waits for company at most while
    /// the GPU is busy (0: each request alone).
    #[arg(long, default_value_t = 0)]
    batch_window_us: u64,
    /// Batches running at once before a new batch waits for company (for
    /// at most the window).
    #[arg(long, default_value_t = 1)]
    batches_in_flight: usize,
    /// Samples a batch (and a request) at most.
    #[arg(long, default_value_t = 256)]
    max_batch: usize,
    /// The weights' seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Enqueue every pipeline from one thread (`false`: from the task of
    /// each request, on any runtime thread).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    submit_thread: bool,
    /// CUDA graphs a batch size (sizes rounded up to a power of two): a
    /// request replays a captured forward pass instead of enqueuing its
    /// ops one by one; 0: no graphs. Local pool only (default there: 8;
    /// on a lease: none).
    #[arg(long)]
    graphs: Option<usize>,
    /// Runtime threads (default: one a core).
    #[arg(long)]
    workers: Option<usize>,
    /// Serve with the baseline instead of the ops: cudarc called from
    /// `spawn_blocking`, one stream per blocking thread (GPU 0).
    #[arg(long, conflicts_with_all = ["lease", "etcd"])]
    baseline: bool,
}

/// What must live as long as the service: an embedded node, a lease, the
/// fleet's leases.
#[derive(Default)]
struct Keep {
    node: Option<Node>,
    lease: Option<Lease>,
    #[cfg(feature = "fleet")]
    fleet: Option<Arc<cuda_async_service::fleet::Replicas>>,
}

fn main() {
    cuda_lease_node::main_if_worker();
    let args = Args::parse();
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = args.workers {
        rt.worker_threads(n);
    }
    let rt = match rt.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("service: starting the runtime: {e}");
            std::process::exit(1);
        }
    };
    let code = match rt.block_on(run(args)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("service: {e}");
            1
        }
    };
    std::process::exit(code);
}

async fn run(args: Args) -> Result<i32, Box<dyn std::error::Error>> {
    let mut keep = Keep::default();
    let weights = HostWeights::random(args.seed);
    let graphs = graphs(&args)?;
    let submit = if args.submit_thread && !args.baseline {
        Some(Arc::new(cuda_async::SubmitThread::new()?))
    } else {
        None
    };
    let backend = if args.baseline {
        Backend::Blocking(Baseline::new(&weights)?)
    } else if !args.etcd.is_empty() {
        fleet(&args, weights, submit, &mut keep).await?
    } else {
        let policy = policy(&args, &mut keep).await?;
        let model = Model::upload(&weights, &*policy).await?;
        Backend::Ops {
            model,
            policy,
            submit,
            graphs,
        }
    };
    let options = Options {
        queue: args.queue,
        batch_window: Duration::from_micros(args.batch_window_us),
        max_batch: args.max_batch,
        batches_in_flight: args.batches_in_flight,
    };
    let service = Service::new(backend, options);
    let mut fatal = service.fatal();
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    println!("listening on {}", listener.local_addr()?);
    let stop = async move {
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending().await,
            }
        };
        tokio::select! {
            () = term => {}
            _ = tokio::signal::ctrl_c() => {}
            _ = fatal.wait_for(Option::is_some) => {}
        }
    };
    axum::serve(listener, router(service.clone()))
        .with_graceful_shutdown(stop)
        .await?;
    let failed = service.fatal().borrow().is_some();
    drop(service);
    if let Some(lease) = keep.lease.take() {
        let _ = lease.free().await;
    }
    #[cfg(feature = "fleet")]
    if let Some(fleet) = keep.fleet.take() {
        fleet.free().await;
    }
    if let Some(node) = keep.node.take() {
        node.shutdown().await;
    }
    Ok(i32::from(failed))
}

/// Graphs a batch size, as the flags ask: 8 by default on the local pool,
/// none on a lease (its graphs would live on the node, and the service's
/// graphs upload from and download into this host's pinned memory).
fn graphs(args: &Args) -> Result<Option<Graphs>, String> {
    let remote = args.lease.is_some() || !args.etcd.is_empty();
    match (args.graphs, remote) {
        (Some(0), _) | (None, true) => Ok(None),
        (Some(_), true) => Err("--graphs: the local pool only (not with --lease or --etcd)".into()),
        (Some(n), false) => Ok(Some(Graphs::new(n))),
        (None, false) => Ok(Some(Graphs::new(8))),
    }
}

/// The ops on leases of the fleet `--etcd` names.
#[cfg(feature = "fleet")]
async fn fleet(
    args: &Args,
    weights: HostWeights,
    submit: Option<Arc<cuda_async::SubmitThread>>,
    keep: &mut Keep,
) -> Result<Backend, Box<dyn std::error::Error>> {
    use cuda_async_service::fleet::{FleetOptions, Replicas};
    use cuda_lease_fleet::{Fleet, FleetConfig};

    let token = args.token.as_ref().ok_or("--etcd needs --token")?;
    let client = match (&args.cert, args.trust_registry) {
        (Some(cert), _) => ClientConfig::from_pem_file(cert)?,
        // Replaced per node by the registry's fingerprint.
        (None, true) => ClientConfig::pinned_sha256([0; 32]),
        (None, false) => return Err("--etcd needs --cert or --trust-registry".into()),
    };
    let config = FleetConfig::new(args.etcd.iter().cloned())
        .client(client.token(token.clone()))
        .trust_registry(args.trust_registry);
    let fleet = Fleet::connect(config).await?;
    let options = FleetOptions {
        leases: args.fleet_leases.max(1),
        vram: 256 << 20,
        streams: u32::try_from(args.streams).map_err(|_| "--streams: too many")?,
    };
    let replicas = Replicas::start(fleet, options, weights).await?;
    keep.fleet = Some(replicas.clone());
    Ok(Backend::Fleet { replicas, submit })
}

#[cfg(not(feature = "fleet"))]
async fn fleet(
    _: &Args,
    _: HostWeights,
    _: Option<Arc<cuda_async::SubmitThread>>,
    _: &mut Keep,
) -> Result<Backend, Box<dyn std::error::Error>> {
    Err("--etcd: this service was built without the fleet (cargo build -p cuda-async-service --features fleet)".into())
}

/// The policy the flags ask for.
async fn policy(
    args: &Args,
    keep: &mut Keep,
) -> Result<Arc<dyn SchedulingPolicy>, Box<dyn std::error::Error>> {
    let Some(at) = &args.lease else {
        let pool = StreamPoolRoundRobin::new(&Device::new(0)?, args.streams)?;
        return Ok(Arc::new(pool));
    };
    let (addr, config) = if at == "embedded" {
        let device = match args.embedded_device.as_str() {
            "cuda" => DeviceSpec::Cuda { ordinal: 0 },
            "memory" => DeviceSpec::Memory { capacity: 1 << 30 },
            other => return Err(format!("--embedded-device {other}: cuda or memory").into()),
        };
        let mut cfg = NodeConfig::new(WorkerSpec::current_exe(device)?);
        cfg.tokens = vec!["service".into()];
        let node = Node::spawn_local(cfg).await?;
        let config = ClientConfig::pinned(node.cert_der().clone()).token("service");
        let addr = node.addr();
        keep.node = Some(node);
        (addr, config)
    } else {
        let addr: SocketAddr = at.parse().map_err(|e| format!("--lease {at}: {e}"))?;
        let cert = args.cert.as_ref().ok_or("--lease ADDR needs --cert")?;
        let token = args.token.as_ref().ok_or("--lease ADDR needs --token")?;
        (
            addr,
            ClientConfig::from_pem_file(cert)?.token(token.clone()),
        )
    };
    let lease = Lease::builder()
        .min_vram(256 << 20)
        .config(config)
        .connect(addr)
        .await?;
    let backend = LeaseBackend::current(lease.session());
    keep.lease = Some(lease);
    let streams = u32::try_from(args.streams).map_err(|_| "--streams: too many")?;
    Ok(Arc::new(RemotePolicy::new(&backend).with_streams(streams)))
}
