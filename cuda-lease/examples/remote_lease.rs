//! One command: start an embedded node on 127.0.0.1, lease a slice of the
//! GPU through it and run a kernel (vector add), checking the result.
//!
//! ```text
//! cargo run -p cuda-lease --example remote_lease
//! ```
//!
//! The node's worker processes re-run this executable, which is why `main`
//! calls [`cuda_lease::main_if_worker`] first.

use std::time::Duration;

use cuda_lease::client::{BatchBuilder, ClientConfig, Lease};
use cuda_lease::node::{Node, NodeConfig};
use cuda_lease::proto::{KernelArg, LaunchSpec};
use cuda_lease::ptx::{grid_for, BLOCK, TEST_KERNELS};
use cuda_lease::worker::{main_if_worker, DeviceSpec, WorkerSpec};

fn main() {
    main_if_worker();
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

    // One round trip: load, allocate, upload, launch, sync, download.
    let mut batch = BatchBuilder::new();
    let module = batch.load_module(TEST_KERNELS);
    let (da, db, dc) = (batch.alloc(bytes), batch.alloc(bytes), batch.alloc(bytes));
    batch.write(da, 0, &to_bytes(&a));
    batch.write(db, 0, &to_bytes(&b));
    batch.launch(LaunchSpec {
        module,
        kernel: "vadd".into(),
        grid: [grid_for(n), 1, 1],
        block: [BLOCK, 1, 1],
        shared_mem: 0,
        args: vec![
            KernelArg::Mem {
                handle: da,
                offset: 0,
            },
            KernelArg::Mem {
                handle: db,
                offset: 0,
            },
            KernelArg::Mem {
                handle: dc,
                offset: 0,
            },
            KernelArg::u32(n),
        ],
    });
    batch.sync();
    let read = batch.read(dc, 0, bytes as u32);
    let t = std::time::Instant::now();
    let out = lease.session().batch(&batch).await?;
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
