//! A thousand pipelines spread over a fleet of GPU nodes by one
//! `FleetPolicy`, each checked against the CPU; with `--chaos` one node is
//! killed midway and its work runs again elsewhere.
//!
//! ```text
//! cargo run --release -p cuda-lease-node --features fleet --example fleet -- --local --chaos
//! cargo run --release -p cuda-lease-node --features fleet --example fleet -- --etcd http://10.0.0.2:2379 --token SECRET --cert fleet-ca.pem
//! ```
//!
//! `--local` starts a small fleet here: an etcd (the `etcd` program on the
//! `PATH`; Debian: `etcd-server`) on 127.0.0.1 and three nodes, each a
//! process of its own (this executable again), on this machine's GPU or,
//! without one, on the in-memory test device.

use std::error::Error;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_async::prelude::*;
use cuda_async::{HostBuffer, Kernel, LaunchConfig, Module};
use cuda_lease::client::ClientConfig;
use cuda_lease_fleet::{Fleet, FleetConfig, FleetPolicy, FleetPolicyConfig, RegistryConfig};
use cuda_lease_node::node::{Node, NodeConfig, TlsSource};
use cuda_lease_node::worker::{main_if_worker, DeviceSpec, WorkerSpec};

const KERNELS: &str = r#"
extern "C" __global__ void axpy(float a, const float* x, float* y, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"#;

const USAGE: &str = "\
fleet: runs pipelines (a * x + y on 4,096 floats) spread over a fleet of GPU nodes by one
FleetPolicy, checks each against the CPU, and prints per-node counts, retries and wall time.

usage: fleet (--local | --etcd URL (--cert PEM | --trust-registry) [--token TOKEN]) [--chaos] [--pipelines N]

  --local           start a local fleet: an etcd (the `etcd` program on the PATH) and three
                    nodes on 127.0.0.1, each a process, on this machine's GPU or, without
                    one, on the in-memory test device
  --etcd URL        the fleet's etcd endpoints (comma-separated)
  --cert PEM        the certificate (or CA) the nodes' certificates are checked against
  --trust-registry  trust each node by the fingerprint in its registry record instead
  --token TOKEN     the nodes' bearer token
  --chaos           kill one node (SIGKILL; --local only) midway: its work runs again
                    on the others
  --pipelines N     how many pipelines (default 1000)
  -h, --help        this text
";

const LOCAL_TOKEN: &str = "fleet-demo";

struct Args {
    local: bool,
    etcd: Vec<String>,
    cert: Option<PathBuf>,
    trust_registry: bool,
    token: Option<String>,
    chaos: bool,
    pipelines: usize,
}

fn args() -> Result<Args, Box<dyn Error>> {
    let mut a = Args {
        local: false,
        etcd: Vec::new(),
        cert: None,
        trust_registry: false,
        token: None,
        chaos: false,
        pipelines: 1000,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--local" => a.local = true,
            "--etcd" => a.etcd = value()?.split(',').map(String::from).collect(),
            "--cert" => a.cert = Some(value()?.into()),
            "--trust-registry" => a.trust_registry = true,
            "--token" => a.token = Some(value()?),
            "--chaos" => a.chaos = true,
            "--pipelines" => a.pipelines = value()?.parse()?,
            "-h" | "--help" => {
                print!("{USAGE}");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other} (--help lists them)").into()),
        }
    }
    if a.local != a.etcd.is_empty() {
        return Err("give --local or --etcd URL (--help says more)".into());
    }
    if a.chaos && !a.local {
        return Err("--chaos kills a node of a --local fleet only".into());
    }
    Ok(a)
}

fn main() {
    main_if_worker();
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("--node-process") {
        // A node of a --local fleet: NAME ETCD_URL.
        if let Err(e) = node_process(&argv[2], &argv[3]) {
            eprintln!("fleet node {}: {e}", argv[2]);
            std::process::exit(1);
        }
        return;
    }
    if let Err(e) = run() {
        eprintln!("fleet: {e}");
        std::process::exit(1);
    }
}

fn gpu() -> bool {
    cuda_async::driver_present() && cuda_async::device_count().unwrap_or(0) > 0
}

/// Runs one node of a local fleet until killed.
fn node_process(name: &str, etcd: &str) -> Result<(), Box<dyn Error>> {
    let spec = if gpu() {
        DeviceSpec::Cuda { ordinal: 0 }
    } else {
        DeviceSpec::Memory { capacity: 1 << 30 }
    };
    let mut cfg = NodeConfig::new(WorkerSpec::current_exe(spec)?);
    cfg.name = name.into();
    cfg.tokens = vec![LOCAL_TOKEN.into()];
    cfg.capacity = Some(1 << 30);
    cfg.prestart_workers = 2;
    cfg.tls = TlsSource::SelfSigned {
        names: vec!["localhost".into(), "127.0.0.1".into()],
        write_pem: None,
    };
    let mut registry = RegistryConfig::new([etcd]);
    registry.ttl = Duration::from_secs(2);
    cfg.registry = Some(registry);
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let _node = Node::start(cfg).await?;
        std::future::pending::<()>().await;
        Ok::<(), Box<dyn Error>>(())
    })
}

/// A local fleet: an etcd and three node processes, stopped on drop.
struct LocalFleet {
    etcd: Child,
    nodes: Vec<(String, Child)>,
    dir: PathBuf,
    url: String,
}

impl LocalFleet {
    fn start() -> Result<LocalFleet, Box<dyn Error>> {
        let port = |()| -> std::io::Result<u16> {
            Ok(std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port())
        };
        let (client, peer) = (port(())?, port(())?);
        let dir =
            std::env::temp_dir().join(format!("cuda-lease-fleet-example-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let etcd = Command::new("etcd")
            .args(["--name", "fleet-example", "--data-dir"])
            .arg(dir.join("etcd"))
            .args([
                "--listen-client-urls",
                &url,
                "--advertise-client-urls",
                &url,
            ])
            .args([
                "--listen-peer-urls",
                &peer_url,
                "--initial-advertise-peer-urls",
                &peer_url,
            ])
            .args(["--initial-cluster", &format!("fleet-example={peer_url}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("starting etcd: {e} (install etcd: Debian's etcd-server)"))?;
        let mut fleet = LocalFleet {
            etcd,
            nodes: Vec::new(),
            dir,
            url,
        };
        for name in ["node-a", "node-b", "node-c"] {
            let child = Command::new(std::env::current_exe()?)
                .args(["--node-process", name, &fleet.url])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()?;
            fleet.nodes.push((name.to_string(), child));
        }
        Ok(fleet)
    }

    /// Kills node `name` (SIGKILL: no goodbye to etcd or its clients).
    fn kill(&mut self, name: &str) {
        if let Some((_, c)) = self.nodes.iter_mut().find(|(n, _)| n == name) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for LocalFleet {
    fn drop(&mut self) {
        for (_, c) in &mut self.nodes {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = self.etcd.kill();
        let _ = self.etcd.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `a * x + y`, downloaded.
fn pipeline(
    x: Vec<f32>,
    y: Vec<f32>,
    a: f32,
    axpy: &Kernel,
) -> impl DeviceOp<Output = HostBuffer<f32>> {
    let n = x.len() as u32;
    let axpy = axpy.clone();
    h2d(x)
        .zip(h2d(y))
        // SAFETY: axpy touches x[0..n) and y[0..n); both hold n floats.
        .then(move |(x, y)| unsafe { launch(&axpy, LaunchConfig::for_num_elems(n), (a, x, y, n)) })
        .then(|(_, _, y, _)| d2h(y))
}

/// `n` pseudo-random floats in [-100, 100) (xorshift).
fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 200.0 - 100.0
        })
        .collect()
}

/// Checks `got` against the CPU's `a * x + y` (a GPU may fuse the multiply
/// and the add: the bound is a few ulps of the terms).
fn check(i: usize, got: &[f32], x: &[f32], y: &[f32], a: f32) -> Result<(), String> {
    for (j, ((g, x), y)) in got.iter().zip(x).zip(y).enumerate() {
        let want = a * x + y;
        let scale = (a * x).abs() + y.abs();
        if (g - want).abs() > 4.0 * f32::EPSILON * scale.max(f32::MIN_POSITIVE) {
            return Err(format!(
                "pipeline {i}: element {j} is {g}, the CPU says {want}"
            ));
        }
    }
    Ok(())
}

fn run() -> Result<(), Box<dyn Error>> {
    let args = args()?;
    let rt = tokio::runtime::Runtime::new()?;
    let mut local = if args.local {
        Some(LocalFleet::start()?)
    } else {
        None
    };
    let endpoints = match &local {
        Some(l) => vec![l.url.clone()],
        None => args.etcd.clone(),
    };
    let client = match (&local, &args.cert) {
        (Some(_), _) => ClientConfig::pinned_sha256([0; 32]).token(LOCAL_TOKEN),
        (None, Some(cert)) => {
            let mut c = ClientConfig::from_pem_file(cert)?;
            c.token = args.token.clone();
            c
        }
        (None, None) if args.trust_registry => {
            let mut c = ClientConfig::pinned_sha256([0; 32]);
            c.token = args.token.clone();
            c
        }
        (None, None) => return Err("--etcd needs --cert or --trust-registry".into()),
    };
    let trust = local.is_some() || args.trust_registry;
    let axpy = Module::cuda(KERNELS, &[])?.kernel("axpy")?;
    let n = args.pipelines;
    rt.block_on(async {
        // etcd and the nodes take a moment to come up.
        let fleet = {
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let cfg = FleetConfig::new(endpoints.clone())
                    .client(client.clone())
                    .trust_registry(trust);
                match Fleet::connect(cfg).await {
                    Ok(f) => break f,
                    Err(e) if Instant::now() > deadline => return Err(e.into()),
                    Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
        };
        let want = if local.is_some() { 3 } else { 1 };
        if !fleet.wait_until(Duration::from_secs(20), |nodes| nodes.len() >= want).await {
            return Err(format!("fewer than {want} nodes registered within 20 s").into());
        }
        let device = fleet.nodes()[0].devices.first().map(|d| d.name.clone()).unwrap_or_default();
        println!("fleet: {} nodes registered ({device})", fleet.nodes().len());
        let cfg = FleetPolicyConfig {
            leases: fleet.nodes().len().min(3),
            max_leases: fleet.nodes().len().min(3),
            vram: 64 << 20,
            retry: if args.chaos { 2 } else { 0 },
            ..FleetPolicyConfig::default()
        };
        let policy = FleetPolicy::new(&fleet, cfg).await?;
        let t = Instant::now();
        let next = Arc::new(AtomicUsize::new(0));
        let done = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..32 {
            let (policy, axpy, next, done) = (policy.clone(), axpy.clone(), next.clone(), done.clone());
            tasks.push(tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        return Ok::<(), String>(());
                    }
                    let (x, y, a) = (random(4096, 2 * i as u64 + 7), random(4096, 2 * i as u64 + 8), 0.5 + (i % 7) as f32);
                    let out = pipeline(x.clone(), y.clone(), a, &axpy)
                        .schedule(&policy)
                        .map_err(|e| e.to_string())?
                        .await
                        .map_err(|e| format!("pipeline {i}: {e}"))?;
                    check(i, out.as_slice().map_err(|e| e.to_string())?, &x, &y, a)?;
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
        let mut killed = None;
        if args.chaos {
            while done.load(Ordering::Relaxed) < n / 2 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let victim = policy.nodes()[0].clone();
            if let Some(l) = local.as_mut() {
                l.kill(&victim);
            }
            println!("fleet: killed {victim} after {} pipelines", done.load(Ordering::Relaxed));
            killed = Some((victim, Instant::now()));
        }
        for task in tasks {
            task.await??;
        }
        let wall = t.elapsed();
        for s in policy.stats() {
            println!(
                "fleet: {:<8} {:>5} pipelines{}",
                s.node,
                s.completed,
                if s.live { "" } else { " (lost)" }
            );
        }
        println!("fleet: {} retried on another node", policy.retries());
        if let Some((victim, at)) = &killed {
            match policy.first_retry_done() {
                Some(first) if first > *at => println!(
                    "fleet: the first pipeline retried after {victim}'s death completed {:.2?} after the kill",
                    first - *at
                ),
                _ => println!("fleet: no pipeline was in flight on {victim} when it died"),
            }
        }
        println!("fleet: {n} pipelines correct in {wall:.2?}");
        policy.close().await;
        Ok::<(), Box<dyn Error>>(())
    })?;
    drop(local);
    Ok(())
}
