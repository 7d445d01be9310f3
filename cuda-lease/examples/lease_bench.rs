//! Loopback measurements against the real device through an embedded node:
//! lease-allocation latency (cold and with a pre-started worker), the round
//! trip of a one-kernel BATCH (launch + sync), and MEM_WRITE / MEM_READ
//! throughput for 256 MiB.
//!
//! ```text
//! cargo run --release -p cuda-lease --example lease_bench
//! ```
//!
//! With `--memory-device` (or `LEASE_BENCH_DEVICE=memory`) the workers drive
//! the in-memory test double instead of a GPU, so the node, QUIC and pipe
//! path can be measured on a machine without one; kernels are not run there.
//! `--transfers-only` skips the lease-allocation measurements (they sleep to
//! let the worker pool refill). `LEASE_BENCH_ITERS` sets the BATCH
//! iterations (default 2000), `LEASE_BENCH_XFER_ITERS` the MEM_WRITE /
//! MEM_READ iterations (default 5).
//!
//! ```text
//! cargo run --release -p cuda-lease --example lease_bench -- --memory-device --transfers-only
//! ```

use std::time::{Duration, Instant};

use cuda_lease::client::{BatchBuilder, Client, ClientConfig, Lease};
use cuda_lease::node::{Node, NodeConfig};
use cuda_lease::proto::{HandleRef, KernelArg, LaunchSpec};
use cuda_lease::ptx::TEST_KERNELS;
use cuda_lease::worker::{main_if_worker, DeviceSpec, WorkerSpec};

fn main() {
    main_if_worker();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    if let Err(e) = rt.block_on(run()) {
        eprintln!("lease_bench: {e}");
        std::process::exit(1);
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn report(name: &str, mut v: Vec<Duration>) {
    v.sort();
    println!(
        "{name}: n={} median {:?} p99 {:?} min {:?} max {:?}",
        v.len(),
        percentile(&v, 0.5),
        percentile(&v, 0.99),
        v[0],
        v[v.len() - 1]
    );
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let iters: usize = std::env::var("LEASE_BENCH_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    let xfer_iters: usize = std::env::var("LEASE_BENCH_XFER_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5)
        .max(1);
    let args: Vec<String> = std::env::args().skip(1).collect();
    let memory = args.iter().any(|a| a == "--memory-device")
        || std::env::var("LEASE_BENCH_DEVICE").is_ok_and(|v| v == "memory");
    let transfers_only = args.iter().any(|a| a == "--transfers-only");
    let device = if memory {
        // Room for the 256 MiB buffer plus the node's default headroom.
        DeviceSpec::Memory { capacity: 2 << 30 }
    } else {
        DeviceSpec::Cuda { ordinal: 0 }
    };
    let mut cfg = NodeConfig::new(WorkerSpec::current_exe(device)?);
    cfg.tokens = vec!["bench".into()];
    cfg.submit_workers = 1;
    cfg.prestart_workers = 1;
    let node = Node::spawn_local(cfg).await?;
    let config = ClientConfig::pinned(node.cert_der().clone()).token("bench");
    let client = std::sync::Arc::new(Client::connect(node.addr(), &config).await?);
    let inv = client.inventory().await?;
    println!(
        "device: {} ({} bytes free)",
        inv.devices[0].name, inv.devices[0].free_bytes
    );

    if !transfers_only {
        lease_alloc_bench(&client).await?;
    }
    transfer_bench(&client, iters, xfer_iters).await?;
    node.shutdown().await;
    Ok(())
}

/// Lease allocation: with a pre-started worker, then cold (worker start +
/// context creation).
async fn lease_alloc_bench(
    client: &std::sync::Arc<Client>,
) -> Result<(), Box<dyn std::error::Error>> {
    tokio::time::sleep(Duration::from_secs(2)).await; // let the pre-started worker come up
    let mut warm = Vec::new();
    let mut cold = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let l = Lease::builder()
            .min_vram(1 << 20)
            .on(client.clone())
            .await?;
        warm.push(t.elapsed());
        l.free().await?;
        tokio::time::sleep(Duration::from_secs(2)).await; // refill
    }
    for _ in 0..5 {
        let t = Instant::now();
        let a = Lease::builder()
            .min_vram(1 << 20)
            .on(client.clone())
            .await?;
        let b = Lease::builder()
            .min_vram(1 << 20)
            .on(client.clone())
            .await?; // pool is empty now
        cold.push(t.elapsed());
        a.free().await?;
        b.free().await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    report("LEASE_ALLOC with a pre-started worker", warm);
    report(
        "two LEASE_ALLOCs, the second cold (worker start + context)",
        cold,
    );
    Ok(())
}

/// One-kernel BATCH round trip, then MEM_WRITE / MEM_READ of 256 MiB.
async fn transfer_bench(
    client: &std::sync::Arc<Client>,
    iters: usize,
    xfer_iters: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    let size: u64 = 256 << 20;
    let lease = Lease::builder()
        .min_vram(size + (16 << 20))
        .ttl(Duration::from_secs(120))
        .on(client.clone())
        .await?;
    let s = lease.session();
    let module = s.load_module(TEST_KERNELS).await?;
    let out = s.alloc(4096).await?;

    // One-kernel BATCH: launch + sync.
    let mut batch = BatchBuilder::new();
    batch.launch(LaunchSpec {
        module: HandleRef::Id(module.handle()),
        kernel: "iota".into(),
        grid: [1, 1, 1],
        block: [256, 1, 1],
        shared_mem: 0,
        args: vec![out.arg(), KernelArg::u32(256)],
    });
    batch.sync();
    for _ in 0..100 {
        s.batch(&batch).await?;
    }
    let mut rtt = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        s.batch(&batch).await?;
        rtt.push(t.elapsed());
    }
    report("one-kernel BATCH (launch + sync) round trip", rtt);

    // MEM_WRITE / MEM_READ of 256 MiB.
    let big = s.alloc(size).await?;
    let data = vec![0x5Au8; size as usize];
    s.write(&big, 0, &data).await?; // warm-up
    let mut w = Vec::new();
    for _ in 0..xfer_iters {
        let t = Instant::now();
        s.write(&big, 0, &data).await?;
        w.push(t.elapsed());
    }
    w.sort();
    let med = w[w.len() / 2];
    println!(
        "MEM_WRITE 256 MiB: median {med:?} = {:.2} GiB/s (best {:?})",
        size as f64 / med.as_secs_f64() / (1u64 << 30) as f64,
        w[0]
    );
    let mut r = Vec::new();
    for _ in 0..xfer_iters {
        let t = Instant::now();
        let back = s.read(&big, 0, size as u32).await?;
        r.push(t.elapsed());
        assert!(
            back == data,
            "MEM_READ returned other bytes than MEM_WRITE wrote"
        );
    }
    r.sort();
    let med = r[r.len() / 2];
    println!(
        "MEM_READ 256 MiB: median {med:?} = {:.2} GiB/s (best {:?})",
        size as f64 / med.as_secs_f64() / (1u64 << 30) as f64,
        r[0]
    );

    drop((big, out, module));
    lease.free().await?;
    Ok(())
}
