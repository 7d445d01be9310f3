//! `cuda-lease-node`: the GPU node daemon. Also the default worker executable
//! (it runs the worker loop when `CUDA_LEASE_WORKER` is set).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{CommandFactory, Parser};
use cuda_lease_node::log;
use cuda_lease_node::node::{Node, NodeConfig, TlsSource};
use cuda_lease_node::transport_args::TransportArgs;
use cuda_lease_node::worker::{main_if_worker, DeviceSpec, WorkerSpec};

/// Leases slices of a GPU's memory to remote clients over QUIC.
#[derive(Debug, Parser)]
#[command(name = "cuda-lease-node", version)]
struct Args {
    /// QUIC listen address.
    #[arg(long, default_value = "0.0.0.0:7070", env = "CUDA_LEASE_NODE_LISTEN")]
    listen: SocketAddr,
    /// Prometheus metrics HTTP address (omit for none).
    #[arg(long, env = "CUDA_LEASE_NODE_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
    /// The bulk-data channel (large transfers over TLS on TCP): `same` for
    /// TCP on the QUIC address and port, an address, or `off` (transfers
    /// stay on QUIC).
    #[arg(long, default_value = "same", env = "CUDA_LEASE_NODE_BULK_LISTEN")]
    bulk_listen: cuda_lease_node::node::BulkListen,
    /// Development mode: generate a self-signed certificate and write it to `--dev-cert-out`.
    #[arg(long, env = "CUDA_LEASE_NODE_DEV")]
    dev: bool,
    /// Where `--dev` writes the certificate clients pin.
    #[arg(
        long,
        default_value = "cuda-lease-node-cert.pem",
        env = "CUDA_LEASE_NODE_DEV_CERT_OUT"
    )]
    dev_cert_out: PathBuf,
    /// Extra names (DNS or IP) for the `--dev` certificate, besides localhost and 127.0.0.1.
    #[arg(
        long = "dev-san",
        env = "CUDA_LEASE_NODE_DEV_SAN",
        value_delimiter = ','
    )]
    dev_san: Vec<String>,
    /// PEM certificate chain (production).
    #[arg(long, requires = "key", env = "CUDA_LEASE_NODE_CERT")]
    cert: Option<PathBuf>,
    /// PEM private key (production).
    #[arg(long, requires = "cert", env = "CUDA_LEASE_NODE_KEY")]
    key: Option<PathBuf>,
    /// PEM CA certificates for mutual TLS clients.
    #[arg(long, env = "CUDA_LEASE_NODE_CLIENT_CA")]
    client_ca: Option<PathBuf>,
    /// File with one bearer token per line: `SECRET`, or `NAME SECRET` to
    /// name its principal (what logs show and leases belong to).
    #[arg(long, env = "CUDA_LEASE_NODE_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// Comma-separated bearer tokens (prefer the environment variable or a file).
    #[arg(long, env = "CUDA_LEASE_TOKENS", hide_env_values = true)]
    tokens: Option<String>,
    /// A principal that may free any lease (repeat for several).
    #[arg(long, env = "CUDA_LEASE_NODE_ADMIN", value_delimiter = ',')]
    admin: Vec<String>,
    /// Accept clients without credentials (development only).
    #[arg(long, env = "CUDA_LEASE_NODE_ALLOW_ANONYMOUS")]
    allow_anonymous: bool,
    /// Let leases' workers serve their BATCHes over QUIC themselves
    /// (LEASE_DIRECT; each such lease's worker binds a UDP port of its own
    /// on the listen address; see --direct-ports). On by default;
    /// `--direct-leases=false` has the node serve every BATCH itself.
    #[arg(
        long,
        env = "CUDA_LEASE_NODE_DIRECT_LEASES",
        default_value_t = true,
        num_args = 0..=1,
        default_missing_value = "true",
        action = clap::ArgAction::Set
    )]
    direct_leases: bool,
    /// The UDP ports workers bind for direct leases, `FIRST-LAST` (both
    /// included; default: any free port). A worker that finds none free
    /// leaves its lease on the node's path.
    #[arg(long, env = "CUDA_LEASE_NODE_DIRECT_PORTS", value_parser = port_range)]
    direct_ports: Option<(u16, u16)>,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0, env = "CUDA_LEASE_NODE_DEVICE")]
    device: usize,
    /// Use the in-memory test double with this much memory instead of a GPU (`1G`, `512M`, or
    /// bytes; it runs the test kernels of `cuda_lease::ptx` on the host; other kernels do
    /// nothing).
    #[arg(long, value_parser = cuda_lease::units::parse_bytes, env = "CUDA_LEASE_NODE_MEMORY_DEVICE")]
    memory_device: Option<u64>,
    /// Memory leases may reserve in total (`70G`, or bytes; default: free memory at start
    /// minus headroom).
    #[arg(long, value_parser = cuda_lease::units::parse_bytes, env = "CUDA_LEASE_NODE_CAPACITY")]
    capacity: Option<u64>,
    /// Longest TTL granted (`1h`, `90s`, or seconds).
    #[arg(long, default_value = "1h", value_parser = cuda_lease::units::parse_secs, env = "CUDA_LEASE_NODE_MAX_TTL")]
    max_ttl: Duration,
    /// Worker processes for GPU_SUBMIT.
    #[arg(long, default_value_t = 2, env = "CUDA_LEASE_NODE_SUBMIT_WORKERS")]
    submit_workers: usize,
    /// Workers started ahead of LEASE_ALLOC.
    #[arg(long, default_value_t = 1, env = "CUDA_LEASE_NODE_PRESTART")]
    prestart: usize,
    /// How long a worker may take for one request before it is deemed hung (`60s`, `2m`, or
    /// seconds).
    #[arg(long, default_value = "60s", value_parser = cuda_lease::units::parse_secs, env = "CUDA_LEASE_NODE_OP_TIMEOUT")]
    op_timeout: Duration,
    /// A folder of CUDA headers tenants' CUDA C may `#include` (repeat for
    /// several; for example the toolkit's `include`). The compiler can read
    /// these folders and no other file of this machine.
    #[arg(
        long = "cuda-include",
        env = "CUDA_LEASE_NODE_CUDA_INCLUDE",
        value_delimiter = ','
    )]
    cuda_include: Vec<PathBuf>,
    /// How long one CUDA C compile may take before it is killed (`5s`, or milliseconds).
    #[arg(long, default_value = "5000", value_parser = cuda_lease::units::parse_millis, env = "CUDA_LEASE_NODE_COMPILE_TIMEOUT_MS")]
    compile_timeout_ms: Duration,
    /// Node name reported to clients.
    #[arg(long, default_value = "cuda-lease-node", env = "CUDA_LEASE_NODE_NAME")]
    name: String,
    /// Microseconds the node and each worker poll a worker pipe without
    /// sleeping before they block (lower batch latency for some CPU time);
    /// default: 1000 on hosts with 8 or more cores, else 0.
    #[arg(long, env = "CUDA_LEASE_NODE_WORKER_SPIN_US")]
    worker_spin_us: Option<u64>,
    /// Log lines: `text` (in colour only on a terminal) or `json` (one
    /// object per line, for a log collector).
    #[arg(long, value_enum, default_value_t = log::LogFormat::Text, env = "CUDA_LEASE_NODE_LOG_FORMAT")]
    log_format: log::LogFormat,
    /// A TOML file of settings: each a flag's long name (`memory-device =
    /// "1G"`, `admin = ["ops"]`). A flag beats its environment variable,
    /// which beats the file.
    #[arg(long, env = "CUDA_LEASE_NODE_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    transport: TransportArgs,
    #[cfg(feature = "fleet")]
    #[command(flatten)]
    registry: RegistryArgs,
}

/// Joining a fleet: the node registers itself in etcd.
#[cfg(feature = "fleet")]
#[derive(Debug, clap::Args)]
struct RegistryArgs {
    /// etcd endpoints to register this node in (`http://10.0.0.2:2379`;
    /// comma-separated, or repeat the flag): the node joins that fleet.
    #[arg(long, env = "CUDA_LEASE_NODE_ETCD", value_delimiter = ',')]
    etcd: Vec<String>,
    /// The fleet's key prefix in etcd.
    #[arg(long, default_value = cuda_lease_fleet::DEFAULT_PREFIX, env = "CUDA_LEASE_NODE_ETCD_PREFIX")]
    etcd_prefix: String,
    /// The address clients reach this node at, as the registry gives it
    /// (default: `--listen`, which must then not be `0.0.0.0`).
    #[arg(long, env = "CUDA_LEASE_NODE_ADVERTISE")]
    advertise: Option<SocketAddr>,
    /// How long a node that died stays in the registry (`10s`, `1m`, or
    /// seconds).
    #[arg(long, default_value = "10s", value_parser = cuda_lease::units::parse_secs, env = "CUDA_LEASE_NODE_REGISTRY_TTL")]
    registry_ttl: Duration,
    /// A label clients can place leases by, `KEY=VALUE` (comma-separated,
    /// or repeat the flag).
    #[arg(long, env = "CUDA_LEASE_NODE_LABEL", value_delimiter = ',')]
    label: Vec<String>,
}

#[cfg(feature = "fleet")]
impl RegistryArgs {
    /// The registration these flags ask for (`None` without `--etcd`).
    fn config(self) -> Result<Option<cuda_lease_fleet::RegistryConfig>, String> {
        if self.etcd.is_empty() {
            return Ok(None);
        }
        let mut r = cuda_lease_fleet::RegistryConfig::new(self.etcd);
        r.prefix = self.etcd_prefix;
        r.advertise = self.advertise;
        r.ttl = self.registry_ttl;
        for l in self.label {
            let (k, v) = l
                .split_once('=')
                .ok_or_else(|| format!("--label {l:?}: want KEY=VALUE"))?;
            r.labels.insert(k.trim().to_string(), v.trim().to_string());
        }
        Ok(Some(r))
    }
}

fn main() {
    main_if_worker();
    return_freed_memory();
    // Before any thread starts (it sets environment variables).
    let argv: Vec<_> = std::env::args_os().collect();
    if let Err(e) = cuda_lease_node::config_file::load_into_env(
        &Args::command(),
        &argv,
        "CUDA_LEASE_NODE_CONFIG",
    ) {
        eprintln!("cuda-lease-node: {e}");
        std::process::exit(2);
    }
    let args = Args::parse();
    log::init_log_as("info", args.log_format);
    if let Err(e) = run(args) {
        eprintln!("cuda-lease-node: {e}");
        std::process::exit(1);
    }
}

/// Maps large buffers (often payloads a peer cut off) individually rather
/// than from malloc's arenas, where glibc's growing threshold would let a
/// tokio thread's arena keep them for good. Process-wide, so only the
/// program sets it.
fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes malloc's tuning; called before any
    // other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 10);
    }
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let device = match args.memory_device {
        Some(capacity) => DeviceSpec::Memory { capacity },
        None => DeviceSpec::Cuda {
            ordinal: args.device,
        },
    };
    let mut worker = WorkerSpec::current_exe(device)?;
    if let Some(us) = args.worker_spin_us {
        worker.spin = std::time::Duration::from_micros(us);
    }
    worker.compile.include_dirs = args.cuda_include;
    worker.compile.timeout = args.compile_timeout_ms;
    let mut cfg = NodeConfig::new(worker);
    cfg.listen = args.listen;
    cfg.metrics_listen = args.metrics_listen;
    cfg.bulk = args.bulk_listen;
    cfg.name = args.name;
    cfg.allow_anonymous = args.allow_anonymous;
    cfg.direct_leases = args.direct_leases;
    cfg.direct_ports = args.direct_ports;
    cfg.client_ca = args.client_ca;
    cfg.capacity = args.capacity;
    if args.memory_device.is_some() {
        // No worker contexts to keep memory back for on the test double.
        cfg.headroom = 0;
    }
    cfg.max_ttl = args.max_ttl;
    cfg.submit_workers = args.submit_workers;
    cfg.prestart_workers = args.prestart;
    cfg.op_timeout = args.op_timeout;
    cfg.transport = args.transport.settings()?;
    #[cfg(feature = "fleet")]
    {
        cfg.registry = args.registry.config()?;
    }
    if let Some(t) = args.tokens {
        cfg.tokens.extend(
            t.split(',')
                .map(str::trim)
                .filter(|t| !t.is_empty())
                .map(String::from),
        );
    }
    if let Some(f) = args.token_file {
        let text = std::fs::read_to_string(&f).map_err(|e| format!("{}: {e}", f.display()))?;
        // `SECRET` (a principal named token-N) or `NAME SECRET`.
        for line in text.lines().map(str::trim) {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            match line.split_once(char::is_whitespace) {
                Some((name, secret)) => cfg
                    .named_tokens
                    .push((name.to_string(), secret.trim().to_string())),
                None => cfg.tokens.push(line.to_string()),
            }
        }
    }
    cfg.admins.extend(args.admin);
    cfg.tls = match (args.cert, args.key, args.dev) {
        (Some(cert), Some(key), _) => TlsSource::Files { cert, key },
        (_, _, true) => {
            let mut names = vec!["localhost".to_string(), "127.0.0.1".to_string()];
            names.extend(args.dev_san);
            TlsSource::SelfSigned {
                names,
                write_pem: Some(args.dev_cert_out),
            }
        }
        _ => return Err("give --cert and --key, or --dev for a self-signed certificate".into()),
    };
    tokio::runtime::Runtime::new()?.block_on(async move {
        let node = Node::start(cfg).await?;
        match node.bulk_addr() {
            Some(b) => eprintln!(
                "cuda-lease-node listening on {} (QUIC), bulk data on {b} (TCP)",
                node.addr()
            ),
            None => eprintln!("cuda-lease-node listening on {}", node.addr()),
        }
        wait_for_signal().await;
        tracing::info!("shutting down");
        node.shutdown().await;
        Ok(())
    })
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    // Without a SIGTERM handler, Ctrl-C alone.
    let mut term = signal(SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        Some(_) = async { term.as_mut()?.recv().await } => {}
    }
}

/// `FIRST-LAST` (or one port) as an inclusive range of ports.
fn port_range(s: &str) -> Result<(u16, u16), String> {
    let (a, b) = s.split_once('-').unwrap_or((s, s));
    let port = |p: &str| {
        p.trim()
            .parse::<u16>()
            .map_err(|e| format!("{p:?} is not a port: {e}"))
    };
    let (first, last) = (port(a)?, port(b)?);
    if first == 0 || first > last {
        return Err(format!("{s:?}: FIRST-LAST with 0 < FIRST <= LAST"));
    }
    Ok((first, last))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_durations_take_units_and_plain_numbers_keep_their_meaning() {
        let a = Args::parse_from([
            "cuda-lease-node",
            "--dev",
            "--memory-device",
            "1G",
            "--max-ttl",
            "90s",
            "--op-timeout",
            "2m",
            "--compile-timeout-ms",
            "5s",
        ]);
        assert_eq!(a.memory_device, Some(1 << 30));
        assert_eq!(a.max_ttl, Duration::from_secs(90));
        assert_eq!(a.op_timeout, Duration::from_secs(120));
        assert_eq!(a.compile_timeout_ms, Duration::from_secs(5));
        let a = Args::parse_from(["cuda-lease-node", "--dev", "--capacity", "4096"]);
        assert_eq!(a.capacity, Some(4096));
        assert_eq!(a.max_ttl, Duration::from_secs(3600));
        assert_eq!(a.compile_timeout_ms, Duration::from_millis(5000));
        let e = Args::try_parse_from(["cuda-lease-node", "--dev", "--max-ttl", "1w"]).unwrap_err();
        assert!(e.to_string().contains("unknown duration unit"), "{e}");
    }

    #[test]
    fn direct_leases_are_a_switch_and_their_ports_take_a_range() {
        let a = Args::parse_from(["cuda-lease-node", "--dev"]);
        assert!(a.direct_leases);
        assert_eq!(a.direct_ports, None);
        let a = Args::parse_from(["cuda-lease-node", "--dev", "--direct-leases"]);
        assert!(a.direct_leases);
        let a = Args::parse_from(["cuda-lease-node", "--dev", "--direct-leases=true"]);
        assert!(a.direct_leases);
        let a = Args::parse_from(["cuda-lease-node", "--dev", "--direct-leases=false"]);
        assert!(!a.direct_leases);
        let a = Args::parse_from(["cuda-lease-node", "--dev", "--direct-ports", "40000-40099"]);
        assert_eq!(a.direct_ports, Some((40000, 40099)));
        let a = Args::parse_from(["cuda-lease-node", "--dev", "--direct-ports", "40000"]);
        assert_eq!(a.direct_ports, Some((40000, 40000)));
        for bad in ["40099-40000", "0-10", "a-b", "70000"] {
            let e = Args::try_parse_from(["cuda-lease-node", "--dev", "--direct-ports", bad]);
            assert!(e.is_err(), "{bad}");
        }
    }
}
