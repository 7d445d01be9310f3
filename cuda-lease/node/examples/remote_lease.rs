//! One command: start an embedded node on 127.0.0.1, lease a slice of the
//! GPU through it and run a kernel (vector add), checking the result.
//!
//! ```text
//! cargo run -p cuda-lease-node --example remote_lease
//! ```
//!
//! The node's worker processes re-run this executable, which is why `main`
//! calls [`cuda_lease_node::main_if_worker`] first.

use std::time::Duration;

use cuda_lease::client::{ClientConfig, Lease, ModuleSpec};
use cuda_lease::proto::LaunchArg;
use cuda_lease::ptx::{grid_for, BLOCK, TEST_KERNELS};
use cuda_lease_node::node::{Node, NodeConfig};
use cuda_lease_node::worker::{main_if_worker, DeviceSpec, WorkerSpec};

fn main() {
    main_if_worker();
    if let Some(arg) = std::env::args().nth(1) {
        if arg == "-h" || arg == "--help" {
            println!(
                "remote_lease: starts a lease node on 127.0.0.1 in this process, leases a slice of \
                 GPU 0 through it and runs a vector add of 2^20 floats there, checking the result. \
                 Needs an NVIDIA GPU and its driver (remote_pipeline runs without one); prints the \
                 node's address and `correct`.\n\nUsage: cargo run -p cuda-lease-node --example remote_lease"
            );
            return;
        }
        eprintln!("remote_lease: unknown argument {arg} (it takes none; --help says what it does)");
        std::process::exit(2);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    if let Err(e) = rt.block_on(run()) {
        eprintln!("remote_lease: {e}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut cfg = NodeConfig::new(WorkerSpec::current_exe(DeviceSpec::Cuda { ordinal: 0 })?);
    cfg.tokens = vec!["demo-token".into()];
    cfg.submit_workers = 1;
    cfg.prestart_workers = 0;
    let node = Node::spawn_local(cfg).await?;
    println!(
        "embedded node on {} (metrics on {:?})",
        node.addr(),
        node.metrics_addr()
    );

    let config = ClientConfig::pinned(node.cert_der().clone()).token("demo-token");
    let n: u32 = 1 << 20;
    let bytes = u64::from(n) * 4;
    let lease = Lease::builder()
        .min_vram(4 * bytes)
        .ttl(Duration::from_secs(30))
        .config(config)
        .connect(node.addr())
        .await?;
    println!("lease {} reserved {} bytes", lease.id(), lease.reserved());

    let a: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let b: Vec<f32> = (0..n).map(|i| 1000.0 - i as f32).collect();
    let to_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();

    // One round trip: the module (by content; its PTX goes along the first
    // time), allocations, uploads, the launch and the download.
    let module = ModuleSpec::ptx(TEST_KERNELS);
    let mut rec = lease.session().recorder();
    let (da, db, dc) = (
        rec.alloc(0, bytes),
        rec.alloc(0, bytes),
        rec.alloc(0, bytes),
    );
    rec.write(0, da, 0, &to_bytes(&a));
    rec.write(0, db, 0, &to_bytes(&b));
    rec.launch(
        0,
        &module,
        "vadd",
        [grid_for(n), 1, 1],
        [BLOCK, 1, 1],
        vec![
            LaunchArg::mem(da),
            LaunchArg::mem(db),
            LaunchArg::mem(dc),
            LaunchArg::u32(n),
        ],
    );
    let read = rec.read(0, dc, 0, bytes as u32);
    let t = std::time::Instant::now();
    let out = rec.submit().await?.ok()?;
    let elapsed = t.elapsed();
    let c = out.read(read).ok_or("no output")?;
    let wrong = c
        .chunks_exact(4)
        .enumerate()
        .filter(|(i, x)| f32::from_le_bytes([x[0], x[1], x[2], x[3]]) != a[*i] + b[*i])
        .count();
    lease.free().await?;
    node.shutdown().await;
    if wrong != 0 {
        return Err(format!("{wrong} of {n} results are wrong").into());
    }
    println!("vadd of {n} floats through a lease: correct ({elapsed:?} for the batch)");
    Ok(())
}
