//! `cuda-lease`: command-line client (inventory, alloc, submit).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Parser, Subcommand};
use cuda_lease::client::{Client, ClientConfig, GpuCall, Lease};
use cuda_lease::proto::LaunchArg;
use cuda_lease_node::log;
use cuda_lease_node::transport_args::TransportArgs;

/// Talk to a cuda-lease node.
#[derive(Debug, Parser)]
#[command(name = "cuda-lease", version)]
struct Args {
    /// Node address.
    #[arg(long, default_value = "127.0.0.1:7070")]
    addr: SocketAddr,
    /// PEM certificate to trust (the node's `--dev` certificate, or its CA).
    #[arg(long, default_value = "cuda-lease-node-cert.pem")]
    cert: PathBuf,
    /// Name checked against the node's certificate.
    #[arg(long, default_value = "localhost")]
    server_name: String,
    /// Bearer token.
    #[arg(long, env = "CUDA_LEASE_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// How long connecting to the node may take (`5s`, `500ms`, or milliseconds).
    #[arg(
        long,
        visible_alias = "connect-timeout",
        default_value = "5000",
        value_parser = cuda_lease::units::parse_millis
    )]
    connect_timeout_ms: std::time::Duration,
    #[command(flatten)]
    transport: TransportArgs,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Show the node's devices and capacity.
    Inventory,
    /// Lease VRAM, print the lease, hold it, then free it.
    Alloc(Hold),
    /// Run a kernel once (GPU_SUBMIT) and write its output to stdout as hex or to a file.
    Submit {
        /// PTX file.
        #[arg(long)]
        ptx: PathBuf,
        /// Kernel name.
        #[arg(long)]
        kernel: String,
        /// Grid, `x[,y[,z]]`.
        #[arg(long, default_value = "1")]
        grid: String,
        /// Block, `x[,y[,z]]`.
        #[arg(long, default_value = "1")]
        block: String,
        /// Output size in bytes.
        #[arg(long)]
        output_size: u32,
        /// Arguments in order: `out`, `in:FILE`, `u32:N`, `i32:N`, `u64:N`, `f32:X`.
        #[arg(long = "arg")]
        args: Vec<String>,
        /// Write the output here instead of printing hex.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// A fleet of nodes registered in etcd: list them, or lease on the one
    /// that fits best (`--addr` is not used; `--cert` is the nodes' CA
    /// unless `--trust-registry`).
    #[cfg(feature = "fleet")]
    Fleet {
        #[command(flatten)]
        at: FleetArgs,
        #[command(subcommand)]
        cmd: FleetCmd,
    },
}

/// A lease to take, hold and free (`alloc`, `fleet lease`).
#[derive(Debug, clap::Args)]
struct Hold {
    /// Memory to reserve (`1G`, `512M`, or bytes).
    #[arg(long, value_parser = cuda_lease::units::parse_bytes)]
    min_vram: u64,
    /// TTL in seconds.
    #[arg(long, default_value_t = 60)]
    ttl: u64,
    /// Seconds to hold the lease before freeing it.
    #[arg(long, default_value_t = 0)]
    hold: u64,
}

/// Where the fleet's registry is, and how its nodes are trusted.
#[cfg(feature = "fleet")]
#[derive(Debug, clap::Args)]
struct FleetArgs {
    /// etcd endpoints (`http://10.0.0.2:2379`; comma-separated).
    #[arg(long, env = "CUDA_LEASE_ETCD", value_delimiter = ',', required = true)]
    etcd: Vec<String>,
    /// The fleet's key prefix in etcd.
    #[arg(long, default_value = cuda_lease_fleet::DEFAULT_PREFIX, env = "CUDA_LEASE_ETCD_PREFIX")]
    etcd_prefix: String,
    /// Trust each node's certificate by the fingerprint in its registry
    /// record, instead of `--cert` (only if the registry is as trusted as
    /// the nodes themselves).
    #[arg(long)]
    trust_registry: bool,
}

#[cfg(feature = "fleet")]
#[derive(Debug, Subcommand)]
enum FleetCmd {
    /// List the registered nodes: address, devices, reservable VRAM, leases.
    Ls,
    /// Lease VRAM on the least loaded node that fits, print where, hold
    /// the lease, then free it.
    Lease {
        #[command(flatten)]
        hold: Hold,
        /// Only nodes labelled `KEY=VALUE` (comma-separated, or repeat).
        #[arg(long, value_delimiter = ',')]
        label: Vec<String>,
    },
}

fn dims(s: &str) -> Result<[u32; 3], String> {
    let mut d = [1u32; 3];
    for (i, p) in s.split(',').enumerate() {
        if i >= 3 {
            return Err(format!("too many dimensions in {s:?}"));
        }
        d[i] = p.trim().parse().map_err(|e| format!("{s:?}: {e}"))?;
    }
    Ok(d)
}

fn main() {
    log::init_log_as("info", log::LogFormat::Text);
    let args = Args::parse();
    let r = tokio::runtime::Runtime::new()
        .map_err(Box::from)
        .and_then(|rt| rt.block_on(run(args)));
    if let Err(e) = r {
        eprintln!("cuda-lease: {e}");
        std::process::exit(1);
    }
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let mut config = match &args.cmd {
        // The pin is the registry's, node by node.
        #[cfg(feature = "fleet")]
        Cmd::Fleet { at, .. } if at.trust_registry => ClientConfig::pinned_sha256([0; 32]),
        _ => ClientConfig::from_pem_file(&args.cert)?.server_name(args.server_name),
    };
    config.token = args.token;
    config.connect_timeout = args.connect_timeout_ms;
    config.transport = args.transport.settings()?;
    #[cfg(feature = "fleet")]
    if let Cmd::Fleet { at, cmd } = args.cmd {
        return fleet::run(at, cmd, config).await;
    }
    let client = std::sync::Arc::new(Client::connect(args.addr, &config).await?);
    match args.cmd {
        Cmd::Inventory => inventory(&client).await?,
        Cmd::Alloc(h) => alloc(&client, h).await?,
        Cmd::Submit {
            ptx,
            kernel,
            grid,
            block,
            output_size,
            args: kargs,
            out,
        } => {
            let call = gpu_call(&ptx, kernel, &grid, &block, output_size, kargs)?;
            let bytes = client.gpu_call(&call).await?;
            write_output(out, &bytes)?;
        }
        #[cfg(feature = "fleet")]
        Cmd::Fleet { .. } => unreachable!("handled above"),
    }
    client.close();
    Ok(())
}

/// `fleet ls` and `fleet lease`.
#[cfg(feature = "fleet")]
mod fleet {
    use super::{FleetArgs, FleetCmd};
    use cuda_lease::client::ClientConfig;
    use cuda_lease_fleet::{Fleet, FleetConfig, NodeRecord};

    pub(super) async fn run(
        at: FleetArgs,
        cmd: FleetCmd,
        client: ClientConfig,
    ) -> Result<(), Box<dyn std::error::Error>> {
        let mut cfg = FleetConfig::new(at.etcd)
            .prefix(at.etcd_prefix)
            .trust_registry(at.trust_registry)
            .client(client);
        if let FleetCmd::Lease { label, .. } = &cmd {
            for l in label {
                let (k, v) = l
                    .split_once('=')
                    .ok_or_else(|| format!("--label {l:?}: want KEY=VALUE"))?;
                cfg = cfg.label(k.trim(), v.trim());
            }
        }
        let fleet = Fleet::connect(cfg).await?;
        match cmd {
            FleetCmd::Ls => {
                print!("{}", table(&fleet.nodes()));
                Ok(())
            }
            FleetCmd::Lease { hold, .. } => {
                let lease = fleet.lease(hold.builder()).await?;
                println!(
                    "lease {} reserved {} bytes on node {} ({})",
                    lease.id(),
                    lease.reserved(),
                    lease.client().node_name(),
                    lease.client().addr()
                );
                hold.hold_and_free(lease).await
            }
        }
    }

    /// One line per node: name, address, devices, reservable and total
    /// VRAM, leases, labels.
    fn table(nodes: &[NodeRecord]) -> String {
        let gib = |b: u64| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64);
        let mut out = format!(
            "{:<20} {:<22} {:<28} {:>12} {:>12} {:>6}  LABELS\n",
            "NAME", "ADDRESS", "DEVICES", "RESERVABLE", "CAPACITY", "LEASES"
        );
        for n in nodes {
            let devices = n
                .devices
                .iter()
                .map(|d| {
                    format!(
                        "{} (sm_{}{})",
                        d.name, d.compute_capability.0, d.compute_capability.1
                    )
                })
                .collect::<Vec<_>>()
                .join(", ");
            let labels = n
                .labels
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(",");
            out.push_str(&format!(
                "{:<20} {:<22} {:<28} {:>12} {:>12} {:>6}  {labels}\n",
                n.name,
                n.address.to_string(),
                devices,
                gib(n.reservable_bytes),
                gib(n.capacity_bytes),
                n.active_leases
            ));
        }
        if nodes.is_empty() {
            out.push_str("(no node registered)\n");
        }
        out
    }
}

/// `inventory`: prints the node and its devices.
async fn inventory(client: &Client) -> Result<(), Box<dyn std::error::Error>> {
    let inv = client.inventory().await?;
    println!(
        "node {} ({} active leases, {} bytes reservable)",
        inv.node, inv.active_leases, inv.reservable_bytes
    );
    for d in inv.devices {
        println!(
            "  device {}: {} sm_{}{} total {} free {}",
            d.ordinal,
            d.name,
            d.compute_capability.0,
            d.compute_capability.1,
            d.total_bytes,
            d.free_bytes
        );
    }
    Ok(())
}

/// `alloc`: takes a lease, holds it `hold` seconds, and frees it.
async fn alloc(client: &std::sync::Arc<Client>, h: Hold) -> Result<(), Box<dyn std::error::Error>> {
    let lease = h.builder().on(client.clone()).await?;
    println!(
        "lease {} reserved {} bytes (generation {})",
        lease.id(),
        lease.reserved(),
        lease.generation()
    );
    h.hold_and_free(lease).await
}

impl Hold {
    fn builder(&self) -> cuda_lease::client::LeaseBuilder {
        Lease::builder()
            .min_vram(self.min_vram)
            .ttl(Duration::from_secs(self.ttl))
    }

    /// Holds `lease` for `--hold` seconds, then frees it.
    async fn hold_and_free(&self, lease: Lease) -> Result<(), Box<dyn std::error::Error>> {
        tokio::time::sleep(Duration::from_secs(self.hold)).await;
        lease.free().await?;
        println!("freed");
        Ok(())
    }
}

/// `submit`'s call: PTX from `ptx`, parsed dimensions and `kind:value`
/// arguments, inputs read from their files.
fn gpu_call(
    ptx: &Path,
    kernel: String,
    grid: &str,
    block: &str,
    output_size: u32,
    kargs: Vec<String>,
) -> Result<GpuCall, Box<dyn std::error::Error>> {
    let text = std::fs::read_to_string(ptx).map_err(|e| format!("{}: {e}", ptx.display()))?;
    let mut call = GpuCall::new(text, kernel, 1, 1, output_size);
    call.grid = dims(grid)?;
    call.block = dims(block)?;
    for a in kargs {
        let (kind, v) = a.split_once(':').unwrap_or((a.as_str(), ""));
        call = match kind {
            "out" => call.arg(LaunchArg::Output),
            "in" => call.input(std::fs::read(v).map_err(|e| format!("{v}: {e}"))?),
            "u32" => call.arg(LaunchArg::u32(v.parse()?)),
            "i32" => call.arg(LaunchArg::bytes(v.parse::<i32>()?.to_le_bytes())),
            "u64" => call.arg(LaunchArg::u64(v.parse()?)),
            "f32" => call.arg(LaunchArg::f32(v.parse()?)),
            _ => return Err(format!("unknown argument {a:?}").into()),
        };
    }
    Ok(call)
}

/// Writes `submit`'s output to `out`, or prints it in hex, 32 bytes a line.
fn write_output(out: Option<PathBuf>, bytes: &[u8]) -> Result<(), Box<dyn std::error::Error>> {
    match out {
        Some(p) => std::fs::write(p, bytes)?,
        None => {
            for chunk in bytes.chunks(32) {
                println!(
                    "{}",
                    chunk.iter().map(|b| format!("{b:02x}")).collect::<String>()
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_durations_take_units() {
        let a = Args::parse_from(["cuda-lease", "inventory"]);
        assert_eq!(a.connect_timeout_ms, std::time::Duration::from_millis(5000));
        let a = Args::parse_from([
            "cuda-lease",
            "--connect-timeout",
            "2s",
            "alloc",
            "--min-vram",
            "512M",
        ]);
        assert_eq!(a.connect_timeout_ms, std::time::Duration::from_secs(2));
        assert!(matches!(a.cmd, Cmd::Alloc(ref h) if h.min_vram == 512 << 20));
        let a = Args::parse_from(["cuda-lease", "--connect-timeout-ms", "750", "inventory"]);
        assert_eq!(a.connect_timeout_ms, std::time::Duration::from_millis(750));
    }
}
