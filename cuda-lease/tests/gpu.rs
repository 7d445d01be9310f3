//! GPU tests: run on a machine with an NVIDIA driver (no toolkit needed):
//!
//! ```text
//! cargo test -p cuda-lease --test gpu -- --ignored --test-threads=1
//! ```
//!
//! Worker processes run the `cuda-lease-node` binary, found as described in
//! `common::worker_exe` (`$CUDA_LEASE_WORKER_EXE`, next to this test binary,
//! one folder up, or where cargo built it). Without a driver every test fails
//! with "no NVIDIA driver found".

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use cuda_lease::client::{BatchBuilder, Error, GpuCall, Lease};
use cuda_lease::node::{Node, NodeConfig};
use cuda_lease::proto::{HandleRef, KernelArg, LaunchSpec, LeaseState};
use cuda_lease::ptx::{grid_for, BLOCK, TEST_KERNELS};
use cuda_lease::worker::{DeviceSpec, WorkerSpec};

fn gpu_config() -> NodeConfig {
    let mut cfg = NodeConfig::new(WorkerSpec {
        program: worker_exe(),
        args: Vec::new(),
        device: DeviceSpec::Cuda { ordinal: 0 },
    });
    cfg.tokens = vec![TOKEN.into()];
    cfg.submit_workers = 2;
    cfg.prestart_workers = 1;
    cfg.op_timeout = Duration::from_secs(30);
    cfg
}

async fn gpu_node(cfg: NodeConfig) -> Node {
    match Node::spawn_local(cfg).await {
        Ok(n) => n,
        Err(e) => panic!(
            "could not start a GPU node (worker {}): {e}",
            worker_exe().display()
        ),
    }
}

/// Deterministic pseudo-random f32s (xorshift), no extra dependencies.
fn random_f32(n: usize, seed: u64) -> Vec<f32> {
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

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bytes_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn bytes_u32(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn iota_call(n: u32) -> GpuCall {
    let mut call = GpuCall::new(TEST_KERNELS, "iota", grid_for(n), BLOCK, n * 4)
        .arg(KernelArg::Output)
        .arg(KernelArg::u32(n));
    call.output_fill = 0xFF; // poison: any element not written reads 0xFFFFFFFF
    call
}

fn check_iota(out: &[u8], n: u32) {
    let v = bytes_u32(out);
    assert_eq!(v.len(), n as usize);
    for (i, x) in v.iter().enumerate() {
        assert_eq!(*x, i as u32, "iota[{i}]");
    }
}

#[tokio::test]
#[ignore = "needs an NVIDIA GPU"]
async fn submit_iota_and_vadd() {
    let node = gpu_node(gpu_config()).await;
    let client = connect(&node).await;
    let inv = client.inventory().await.unwrap();
    eprintln!("device: {:?}", inv.devices);
    let n = (1 << 20) + 17;
    check_iota(&client.gpu_call(&iota_call(n)).await.unwrap(), n);

    let a = random_f32(n as usize, 1);
    let b = random_f32(n as usize, 2);
    let mut call = GpuCall::new(TEST_KERNELS, "vadd", grid_for(n), BLOCK, n * 4)
        .input(f32_bytes(&a))
        .input(f32_bytes(&b))
        .arg(KernelArg::Output)
        .arg(KernelArg::u32(n));
    call.output_fill = 0xFF;
    let c = bytes_f32(&client.gpu_call(&call).await.unwrap());
    for i in 0..n as usize {
        assert_eq!(c[i], a[i] + b[i], "vadd[{i}]");
    }
    // A bad module reports the JIT log.
    let bad = GpuCall::new(".version 7.0\n.target sm_70\nthis is not ptx", "k", 1, 1, 4);
    let err = client.gpu_call(&bad).await.unwrap_err();
    assert!(matches!(err, Error::LoadFailed(_)), "{err:?}");
    eprintln!("{err}");
    node.shutdown().await;
}

#[tokio::test]
#[ignore = "needs an NVIDIA GPU"]
async fn session_batch_iota_and_vadd() {
    let node = gpu_node(gpu_config()).await;
    let client = connect(&node).await;
    let n: u32 = 100_003;
    let bytes = u64::from(n) * 4;
    let lease = Lease::builder()
        .min_vram(8 * bytes)
        .ttl(Duration::from_secs(60))
        .on(client)
        .await
        .unwrap();
    let s = lease.session();
    let a = random_f32(n as usize, 3);
    let b = random_f32(n as usize, 4);
    let mut batch = BatchBuilder::new();
    let m = batch.load_module(TEST_KERNELS);
    let da = batch.alloc(bytes);
    let db = batch.alloc(bytes);
    let dc = batch.alloc(bytes);
    let di = batch.alloc(bytes);
    batch.write(da, 0, &f32_bytes(&a));
    batch.write(db, 0, &f32_bytes(&b));
    batch.write(dc, 0, &vec![0xFF; bytes as usize]);
    batch.write(di, 0, &vec![0xFF; bytes as usize]);
    let mem = |h: HandleRef| KernelArg::Mem {
        handle: h,
        offset: 0,
    };
    let spec = |kernel: &str, args| LaunchSpec {
        module: m,
        kernel: kernel.into(),
        grid: [grid_for(n), 1, 1],
        block: [BLOCK, 1, 1],
        shared_mem: 0,
        args,
    };
    batch.launch(spec(
        "vadd",
        vec![mem(da), mem(db), mem(dc), KernelArg::u32(n)],
    ));
    batch.launch(spec("iota", vec![mem(di), KernelArg::u32(n)]));
    batch.sync();
    let rc = batch.read(dc, 0, bytes as u32);
    let ri = batch.read(di, 0, bytes as u32);
    let out = s.batch(&batch).await.unwrap();
    let c = bytes_f32(out.read(rc).unwrap());
    for i in 0..n as usize {
        assert_eq!(c[i], a[i] + b[i], "vadd[{i}]");
    }
    check_iota(out.read(ri).unwrap(), n);

    // The same through single session ops with RAII handles.
    let module = s.load_module(TEST_KERNELS).await.unwrap();
    let buf = s.alloc(bytes).await.unwrap();
    s.write(&buf, 0, &vec![0xFF; bytes as usize]).await.unwrap();
    s.launch(
        &module,
        "iota",
        [grid_for(n), 1, 1],
        [BLOCK, 1, 1],
        vec![buf.arg(), KernelArg::u32(n)],
    )
    .await
    .unwrap();
    s.sync().await.unwrap();
    check_iota(&s.read(&buf, 0, bytes as u32).await.unwrap(), n);
    drop((module, buf));
    lease.free().await.unwrap();
    node.shutdown().await;
}

#[tokio::test]
#[ignore = "needs an NVIDIA GPU"]
async fn expiry_returns_vram() {
    let mut cfg = gpu_config();
    cfg.prestart_workers = 0; // a pre-started worker's context would blur the numbers
    let node = gpu_node(cfg).await;
    let client = connect(&node).await;
    let free = |c: Arc<cuda_lease::Client>| async move {
        c.inventory().await.unwrap().devices[0].free_bytes
    };
    let before = free(client.clone()).await;
    let size: u64 = 1 << 30;
    let mut lease = Lease::builder()
        .min_vram(size)
        .ttl(Duration::from_secs(2))
        .on(client.clone())
        .await
        .unwrap();
    lease.stop_renewing();
    let s = lease.session();
    let buf = s.alloc(size).await.unwrap();
    let during = free(client.clone()).await;
    eprintln!("free before {before}, with 1 GiB leased {during}");
    assert!(
        before.saturating_sub(during) >= size,
        "allocation not visible: {before} -> {during}"
    );
    // Expires 2 s after the grant; teardown within 1 s of that.
    tokio::time::sleep(Duration::from_millis(3200)).await;
    assert!(matches!(
        s.read(&buf, 0, 4).await,
        Err(Error::LeaseExpired(_))
    ));
    let after = free(client.clone()).await;
    eprintln!("free after expiry {after}");
    assert!(
        after + (64 << 20) >= before,
        "VRAM not returned: before {before}, after {after}"
    );
    assert_eq!(
        lease.query().await.unwrap_err(),
        Error::LeaseExpired(format!("lease {} expired", lease.id()))
    );
    drop(buf);
    node.shutdown().await;
}

#[tokio::test]
#[ignore = "needs an NVIDIA GPU"]
async fn fault_in_one_lease_leaves_others_correct() {
    let node = gpu_node(gpu_config()).await;
    let client = connect(&node).await;
    let n: u32 = 65_536;
    let bytes = u64::from(n) * 4;
    let a = Lease::builder()
        .min_vram(1 << 20)
        .on(client.clone())
        .await
        .unwrap();
    let b = Lease::builder()
        .min_vram(4 * bytes)
        .on(client.clone())
        .await
        .unwrap();

    let sb = b.session();
    let b_task = tokio::spawn(async move {
        let module = sb.load_module(TEST_KERNELS).await.unwrap();
        let x = random_f32(n as usize, 5);
        let y = random_f32(n as usize, 6);
        let (dx, dy, dz) = (
            sb.alloc(bytes).await.unwrap(),
            sb.alloc(bytes).await.unwrap(),
            sb.alloc(bytes).await.unwrap(),
        );
        sb.write(&dx, 0, &f32_bytes(&x)).await.unwrap();
        sb.write(&dy, 0, &f32_bytes(&y)).await.unwrap();
        for round in 0..50 {
            let mut batch = BatchBuilder::new();
            batch.write(HandleRef::Id(dz.handle()), 0, &vec![0xFF; bytes as usize]);
            batch.launch(LaunchSpec {
                module: HandleRef::Id(module.handle()),
                kernel: "vadd".into(),
                grid: [grid_for(n), 1, 1],
                block: [BLOCK, 1, 1],
                shared_mem: 0,
                args: vec![dx.arg(), dy.arg(), dz.arg(), KernelArg::u32(n)],
            });
            batch.sync();
            let r = batch.read(HandleRef::Id(dz.handle()), 0, bytes as u32);
            let out = sb.batch(&batch).await.unwrap();
            let z = bytes_f32(out.read(r).unwrap());
            for i in 0..n as usize {
                assert_eq!(z[i], x[i] + y[i], "round {round} element {i}");
            }
        }
    });

    let sa = a.session();
    let module = sa.load_module(TEST_KERNELS).await.unwrap();
    // A request's reply comes when its work is done: the fault is its error.
    let err = sa
        .launch(&module, "fault", [1, 1, 1], [1, 1, 1], vec![])
        .await
        .unwrap_err();
    assert!(matches!(err, Error::LaunchFailed(_)), "{err:?}");
    let err = sa.alloc(16).await.unwrap_err();
    assert!(
        matches!(err, Error::LeasePoisoned(ref m) if m.contains("lease poisoned")),
        "{err:?}"
    );
    assert_eq!(a.query().await.unwrap().state, LeaseState::Poisoned);

    b_task.await.unwrap();
    // Stateless submits are unaffected too.
    check_iota(&client.gpu_call(&iota_call(4096)).await.unwrap(), 4096);
    drop(module);
    a.free().await.unwrap();
    b.free().await.unwrap();
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs an NVIDIA GPU"]
async fn many_clients_submit_concurrently() {
    let mut cfg = gpu_config();
    cfg.submit_workers = 4;
    // One token for all 32 clients: let its submits use every worker.
    cfg.max_submits_per_principal = 4;
    let node = Arc::new(gpu_node(cfg).await);
    let mut tasks = Vec::new();
    for c in 0..32u32 {
        let node = node.clone();
        tasks.push(tokio::spawn(async move {
            let client = connect(&node).await;
            for k in 0..100u32 {
                let n = 1000 + c * 7 + k;
                let out = client.gpu_call(&iota_call(n)).await.unwrap();
                check_iota(&out, n);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let m = node.metrics_text();
    assert_eq!(metric(&m, "gpu_submit_total"), Some(3200), "{m}");
    assert_eq!(metric(&m, "gpu_submit_errors"), Some(0), "{m}");
}

/// Random bytes (xorshift), no extra dependencies.
fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
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

#[tokio::test]
#[ignore = "needs an NVIDIA GPU"]
async fn large_and_odd_transfers_round_trip_byte_exact() {
    let node = gpu_node(gpu_config()).await;
    // Striped over 4 connections (the default from 8 MiB) and not at all.
    for config in [client_config(&node), client_config(&node).stripes(1, 0)] {
        let client = Arc::new(
            cuda_lease::Client::connect(node.addr(), &config)
                .await
                .unwrap(),
        );
        large_and_odd_transfers(client).await;
    }
    node.shutdown().await;
}

async fn large_and_odd_transfers(client: Arc<cuda_lease::Client>) {
    let size: u64 = 256 << 20;
    let lease = Lease::builder()
        .min_vram(size + (1 << 20))
        .ttl(Duration::from_secs(60))
        .on(client.clone())
        .await
        .unwrap();
    let s = lease.session();
    let buf = s.alloc(size).await.unwrap();
    let data = random_bytes(size as usize, 0x5eed);
    s.write(&buf, 0, &data).await.unwrap();
    let back = s.read(&buf, 0, size as u32).await.unwrap();
    assert!(back == data, "256 MiB did not round-trip");
    // Odd sizes at odd offsets, and an empty transfer, against a fresh
    // small buffer (zeroed by allocation).
    let small = s.alloc(100_003).await.unwrap();
    let odd = random_bytes(65_537, 7);
    s.write(&small, 12_345, &odd).await.unwrap();
    s.write(&small, 3, &[]).await.unwrap();
    let all = s.read(&small, 0, 100_003).await.unwrap();
    assert!(all[..12_345].iter().all(|&b| b == 0));
    assert_eq!(&all[12_345..12_345 + 65_537], &odd[..]);
    assert!(all[12_345 + 65_537..].iter().all(|&b| b == 0));
    assert_eq!(s.read(&small, 100_003, 0).await.unwrap(), Vec::<u8>::new());
    // Out of range is an error, not a crash, and the lease stays usable.
    assert!(s.read(&small, 100_000, 4).await.is_err());
    assert!(s.write(&small, 100_000, &[1, 2, 3, 4]).await.is_err());
    assert_eq!(s.read(&small, 12_345, 4).await.unwrap(), odd[..4].to_vec());
    drop((buf, small));
    lease.free().await.unwrap();
}
