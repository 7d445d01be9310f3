//! One pipeline function, written once, run on the local GPU and on a GPU
//! leased from a node: both results are checked against the CPU and the
//! times printed side by side.
//!
//! ```text
//! cargo run --release --example remote_pipeline                  # embedded node on 127.0.0.1
//! cargo run --release --example remote_pipeline -- --node 10.0.0.5:7070 --token SECRET --cert node-cert.pem
//! ```
//!
//! Without `--node` an embedded node is started on 127.0.0.1:0: on this
//! machine's GPU when it has one, else on the in-memory test device (host
//! code standing in for the kernel, so the remote half still runs: the
//! bytes travel, the node plans and runs the commands). Without a GPU the
//! local half is skipped, with a line saying so. The embedded node's
//! worker processes re-run this executable, which is why `main` calls
//! `cuda_lease_node::main_if_worker` first.

use std::error::Error;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use cuda_async::prelude::*;
use cuda_async::{HostBuffer, Kernel, LaunchConfig, Module, RemotePolicy};
use cuda_lease::client::{ClientConfig, Lease};
use cuda_lease::remote::BlockingLease;
use cuda_lease_node::node::{Node, NodeConfig};
use cuda_lease_node::worker::{main_if_worker, DeviceSpec, WorkerSpec};

const KERNELS: &str = r#"
extern "C" __global__ void axpy(float a, const float* x, float* y, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"#;

/// `a * x + y`, downloaded: the same function for every backend.
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

fn main() {
    main_if_worker();
    if let Err(e) = run() {
        eprintln!("remote_pipeline: {e}");
        std::process::exit(1);
    }
}

struct Args {
    node: Option<std::net::SocketAddr>,
    token: Option<String>,
    cert: Option<PathBuf>,
}

const USAGE: &str = "\
remote_pipeline: runs one pipeline (a * x + y on 1M floats) on the local GPU and on a GPU
leased from a node, checks both against the CPU and prints their times.

usage: remote_pipeline [--node ADDR --token TOKEN --cert PEM]

  --node ADDR    a lease node (host:port); without it an embedded node starts on
                 127.0.0.1, on this machine's GPU or, without one, on the in-memory
                 test device (the remote half then runs without a GPU)
  --token TOKEN  the node's bearer token
  --cert PEM     the node's certificate (the file `cuda-lease-node --dev` writes)
  -h, --help     this text
";

fn args() -> Result<Args, Box<dyn Error>> {
    let mut a = Args {
        node: None,
        token: None,
        cert: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--node" => a.node = Some(value()?.parse()?),
            "--token" => a.token = Some(value()?),
            "--cert" => a.cert = Some(value()?.into()),
            "-h" | "--help" => {
                print!("{USAGE}");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other} (--help lists them)").into()),
        }
    }
    Ok(a)
}

/// `n` pseudo-random floats in [-100, 100) (xorshift, no dependencies).
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

/// Checks `got` against the CPU's `a * x + y`. A GPU may fuse the multiply
/// and the add (one rounding instead of two), so the bound is a few ulps of
/// the terms, not of the result (which can cancel).
fn check(what: &str, got: &[f32], x: &[f32], y: &[f32], a: f32) -> Result<(), Box<dyn Error>> {
    for (i, ((g, x), y)) in got.iter().zip(x).zip(y).enumerate() {
        let want = a * x + y;
        let scale = (a * x).abs() + y.abs();
        if (g - want).abs() > 4.0 * f32::EPSILON * scale.max(f32::MIN_POSITIVE) {
            return Err(format!("{what}: element {i} is {g}, the CPU says {want}").into());
        }
    }
    Ok(())
}

/// The median of `runs` timed runs of `f`, after one warm-up.
fn time<T>(
    runs: usize,
    mut f: impl FnMut() -> Result<T, Box<dyn Error>>,
) -> Result<(T, Duration), Box<dyn Error>> {
    let mut out = f()?;
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t = Instant::now();
        out = f()?;
        times.push(t.elapsed());
    }
    times.sort();
    Ok((out, times[runs / 2]))
}

fn run() -> Result<(), Box<dyn Error>> {
    let args = args()?;
    let n = 1 << 20;
    let (x, y, a) = (random(n, 7), random(n, 11), 2.5f32);
    let axpy = Module::cuda(KERNELS, &[])?.kernel("axpy")?;
    let gpu = cuda_async::driver_present() && cuda_async::device_count().unwrap_or(0) > 0;

    // The local GPU, when there is one.
    let local = if gpu {
        let (out, t) = time(10, || Ok(pipeline(x.clone(), y.clone(), a, &axpy).sync()?))?;
        check("local", out.as_slice()?, &x, &y, a)?;
        Some(t)
    } else {
        println!("local: skipped: no NVIDIA GPU or driver on this machine");
        None
    };

    // A leased GPU: a node given with --node, or an embedded one.
    let node_rt = tokio::runtime::Runtime::new()?;
    let (builder, addr, node, device) = match args.node {
        Some(addr) => {
            let cert = args
                .cert
                .ok_or("--node needs --cert (the node's certificate, PEM)")?;
            let token = args.token.ok_or("--node needs --token")?;
            let config = ClientConfig::from_pem_file(&cert)?.token(token);
            (
                Lease::builder().config(config),
                addr,
                None,
                format!("node {addr}"),
            )
        }
        None => {
            let spec = if gpu {
                DeviceSpec::Cuda { ordinal: 0 }
            } else {
                DeviceSpec::Memory { capacity: 1 << 30 }
            };
            let device = if gpu {
                "this machine's GPU"
            } else {
                "the in-memory test device (no GPU here)"
            };
            let mut cfg = NodeConfig::new(WorkerSpec::current_exe(spec)?);
            cfg.tokens = vec!["demo-token".into()];
            let node = node_rt.block_on(Node::spawn_local(cfg))?;
            let config = ClientConfig::pinned(node.cert_der().clone()).token("demo-token");
            let addr = node.addr();
            (
                Lease::builder().config(config),
                addr,
                Some(node),
                format!("an embedded node on {addr}, {device}"),
            )
        }
    };
    // A lease with its own I/O thread: this `fn main` has no async runtime.
    let lease = BlockingLease::connect(builder.min_vram(64 << 20), addr)?;
    let remote = RemotePolicy::new(&lease);
    let (out, remote_t) = time(10, || {
        Ok(pipeline(x.clone(), y.clone(), a, &axpy).sync_with(&remote)?)
    })?;
    check("remote", out.as_slice()?, &x, &y, a)?;
    lease.free()?;
    if let Some(node) = node {
        node_rt.block_on(node.shutdown());
    }

    let mib = (3 * n * 4) as f64 / (1 << 20) as f64;
    println!(
        "pipeline: h2d x, h2d y, axpy, d2h y of {n} floats ({mib:.0} MiB moved), median of 10"
    );
    match local {
        Some(t) => println!("  local GPU:  {t:>12?}  correct"),
        None => println!("  local GPU:  {:>12}  (no GPU)", "-"),
    }
    println!("  leased GPU: {remote_t:>12?}  correct  ({device})");
    println!(
        "remote_pipeline: {} the CPU",
        if local.is_some() {
            "both results match"
        } else {
            "the leased GPU's result matches"
        }
    );
    Ok(())
}
