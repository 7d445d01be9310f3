//! GPU tests: run on a machine with an NVIDIA driver (no toolkit needed):
//!
//! ```text
//! cargo test -p cuda-lease-node --test gpu -- --ignored --test-threads=1
//! ```
//!
//! Worker processes run the `cuda-lease-node` binary, found as described in
//! `common::worker_exe` (`$CUDA_LEASE_WORKER_EXE`, next to this test binary,
//! one folder up, or where cargo built it). Without a driver every test fails
//! with "no NVIDIA driver found".

#[path = "../common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use cuda_lease::client::{ErrorKind, GpuCall, Lease, LeaseBuilder, ModuleSpec};
use cuda_lease::proto::{LaunchArg, LeaseState};
use cuda_lease::ptx::{grid_for, BLOCK, TEST_KERNELS};
use cuda_lease_node::node::{Node, NodeConfig};
use cuda_lease_node::worker::{DeviceSpec, WorkerSpec};

/// The `cuda-async` op suite, run here over the remote backend (and by
/// `cuda-async/tests/gpu.rs` over the local one) with the same inputs and
/// checks.
#[path = "../../../../cuda-async/tests/suite/mod.rs"]
mod suite;

/// The suite's typed launchers (`suite::typed`).
mod suite_kernels {
    pub(crate) mod typed {
        cuda_async::kernels!("../../cuda-async/tests/kernels/typed.cu");
    }
}

/// The remote backend on this GPU: an embedded node, a lease with its own
/// I/O thread and a `RemotePolicy`, driven from a plain thread with
/// blocking calls.
struct RemoteBackend {
    policy: cuda_async::RemotePolicy,
    lease: Option<cuda_lease::remote::BlockingLease>,
    fixture: Option<Fixture>,
    rt: tokio::runtime::Runtime,
}

impl RemoteBackend {
    fn start() -> Self {
        Self::start_with(|b| b)
    }

    /// With the lease builder adjusted (a TTL, no renewal...).
    /// Leases' workers serve their batches (the default); with
    /// `CUDA_LEASE_TEST_DIRECT=0` the node does (the bundle runs the suite
    /// both ways).
    fn start_with(adjust: impl FnOnce(LeaseBuilder) -> LeaseBuilder) -> Self {
        let direct = std::env::var_os("CUDA_LEASE_TEST_DIRECT").is_none_or(|v| v != "0");
        let rt = tokio::runtime::Runtime::new().unwrap();
        let mut cfg = gpu_config();
        cfg.direct_leases = direct;
        let fixture = rt.block_on(Fixture::with_config(cfg).start());
        let node = &fixture.node;
        let builder = adjust(
            Lease::builder()
                .min_vram(256 << 20)
                .config(client_config(node).direct(direct)),
        );
        let lease = cuda_lease::remote::BlockingLease::connect(builder, node.addr()).unwrap();
        RemoteBackend {
            policy: cuda_async::RemotePolicy::new(&lease),
            lease: Some(lease),
            fixture: Some(fixture),
            rt,
        }
    }
}

impl Drop for RemoteBackend {
    fn drop(&mut self) {
        drop(self.lease.take());
        if let Some(fixture) = self.fixture.take() {
            self.rt.block_on(fixture.shutdown());
        }
    }
}

mod over_a_lease;

fn gpu_config() -> NodeConfig {
    let mut cfg = NodeConfig::new(WorkerSpec {
        program: worker_exe(),
        args: Vec::new(),
        device: DeviceSpec::Cuda { ordinal: 0 },
        spin: cuda_lease_node::spin::default_spin(),
        compile: Default::default(),
    });
    cfg.tokens = vec![TOKEN.into()];
    cfg.submit_workers = 2;
    cfg.prestart_workers = 1;
    cfg.op_timeout = Duration::from_secs(30);
    // Under compute-sanitizer (the bundle's `sanitize` sets this) every
    // process of the node, the compiler's child included, runs many times
    // slower: the node's time bounds stretch by this factor.
    let scale: u32 = std::env::var("CUDA_LEASE_TEST_TIMEOUT_SCALE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    cfg.op_timeout *= scale;
    cfg.worker.compile.timeout *= scale;
    cfg
}

/// [`gpu_config`] for a node that serves every BATCH itself: for tests
/// that count what passes through the node (its BATCH messages, its
/// module cache).
fn gpu_node_path_config() -> NodeConfig {
    let mut cfg = gpu_config();
    cfg.direct_leases = false;
    cfg
}

/// A GPU node, a client of it and a lease of `vram` bytes on it.
async fn gpu_lease(vram: u64) -> Fixture {
    Fixture::with_config(gpu_config())
        .lease_with(Lease::builder().min_vram(vram))
        .start()
        .await
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
        .arg(LaunchArg::Output)
        .arg(LaunchArg::u32(n));
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
    let fx = Fixture::with_config(gpu_config()).client().start().await;
    let client = fx.client();
    let inv = client.inventory().await.unwrap();
    eprintln!("device: {:?}", inv.devices);
    // The node reports what its GPU's programs size their work by, as the
    // local `DeviceInfo` does.
    let local = cuda_core::Device::new(0).unwrap().info().unwrap();
    let l = inv.devices[0].limits;
    assert_eq!(l.multiprocessors, local.multiprocessors);
    assert_eq!((l.warp_size, l.max_threads_per_block), (32, 1024), "{l:?}");
    assert_eq!(l.l2_cache_bytes as usize, local.l2_cache_bytes);
    let n = (1 << 20) + 17;
    check_iota(&client.gpu_call(&iota_call(n)).await.unwrap(), n);

    let a = random_f32(n as usize, 1);
    let b = random_f32(n as usize, 2);
    let mut call = GpuCall::new(TEST_KERNELS, "vadd", grid_for(n), BLOCK, n * 4)
        .input(f32_bytes(&a))
        .input(f32_bytes(&b))
        .arg(LaunchArg::Output)
        .arg(LaunchArg::u32(n));
    call.output_fill = 0xFF;
    let c = bytes_f32(&client.gpu_call(&call).await.unwrap());
    for i in 0..n as usize {
        assert_eq!(c[i], a[i] + b[i], "vadd[{i}]");
    }
    // A bad module reports the JIT log.
    let bad = GpuCall::new(".version 7.0\n.target sm_70\nthis is not ptx", "k", 1, 1, 4);
    let err = client.gpu_call(&bad).await.unwrap_err();
    assert!(matches!(err.kind(), ErrorKind::LoadFailed), "{err:?}");
    eprintln!("{err}");
    fx.shutdown().await;
}

#[tokio::test]
#[ignore = "needs an NVIDIA GPU"]
async fn session_batch_iota_and_vadd() {
    let n: u32 = 100_003;
    let bytes = u64::from(n) * 4;
    let fx = Fixture::with_config(gpu_config())
        .lease_with(
            Lease::builder()
                .min_vram(8 * bytes)
                .ttl(Duration::from_secs(60)),
        )
        .start()
        .await;
    let s = fx.session();
    let a = random_f32(n as usize, 3);
    let b = random_f32(n as usize, 4);
    let m = ModuleSpec::ptx(TEST_KERNELS);
    let mut batch = s.recorder();
    let da = batch.alloc(0, bytes);
    let db = batch.alloc(0, bytes);
    let dc = batch.alloc(0, bytes);
    let di = batch.alloc(0, bytes);
    batch.write(0, da, 0, &f32_bytes(&a));
    batch.write(0, db, 0, &f32_bytes(&b));
    batch.write(0, dc, 0, &vec![0xFF; bytes as usize]);
    batch.write(0, di, 0, &vec![0xFF; bytes as usize]);
    let mem = LaunchArg::mem;
    let (grid, block) = ([grid_for(n), 1, 1], [BLOCK, 1, 1]);
    batch.launch(
        0,
        &m,
        "vadd",
        grid,
        block,
        vec![mem(da), mem(db), mem(dc), LaunchArg::u32(n)],
    );
    batch.launch(0, &m, "iota", grid, block, vec![mem(di), LaunchArg::u32(n)]);
    let rc = batch.read(0, dc, 0, bytes as u32);
    let ri = batch.read(0, di, 0, bytes as u32);
    let out = batch.submit().await.unwrap().ok().unwrap();
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
        vec![buf.arg(), LaunchArg::u32(n)],
    )
    .await
    .unwrap();
    check_iota(&s.read(&buf, 0, bytes as u32).await.unwrap(), n);
    drop((module, buf));
    fx.free_and_shutdown().await;
}

#[tokio::test]
#[ignore = "needs an NVIDIA GPU"]
async fn expiry_returns_vram() {
    let fx = Fixture::with_config(gpu_config())
        // a pre-started worker's context would blur the numbers
        .config(|cfg| cfg.prestart_workers = 0)
        .client()
        .start()
        .await;
    let client = fx.client();
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
        Err(ref e) if matches!(e.kind(), ErrorKind::LeaseExpired)
    ));
    let after = free(client.clone()).await;
    eprintln!("free after expiry {after}");
    assert!(
        after + (64 << 20) >= before,
        "VRAM not returned: before {before}, after {after}"
    );
    let e = lease.query().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::LeaseExpired, "{e}");
    assert_eq!(e.message(), format!("lease {} expired", lease.id()));
    assert_eq!(e.lease(), Some(lease.id().to_string().as_str()), "{e}");
    drop(buf);
    fx.shutdown().await;
}

#[tokio::test]
#[ignore = "needs an NVIDIA GPU"]
async fn fault_in_one_lease_leaves_others_correct() {
    let mut fx = Fixture::with_config(gpu_config())
        .lease_with(Lease::builder().min_vram(1 << 20))
        .start()
        .await;
    let a = fx.take_lease();
    let client = fx.client();
    let n: u32 = 65_536;
    let bytes = u64::from(n) * 4;
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
            let mut batch = sb.recorder();
            batch.write(0, dz.id(), 0, &vec![0xFF; bytes as usize]);
            batch.launch(
                0,
                &module,
                "vadd",
                [grid_for(n), 1, 1],
                [BLOCK, 1, 1],
                vec![dx.arg(), dy.arg(), dz.arg(), LaunchArg::u32(n)],
            );
            let r = batch.read(0, dz.id(), 0, bytes as u32);
            let out = batch.submit().await.unwrap().ok().unwrap();
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
    assert!(matches!(err.kind(), ErrorKind::LaunchFailed), "{err:?}");
    let err = sa.alloc(16).await.unwrap_err();
    assert!(
        matches!(err, ref e if matches!(e.kind(), ErrorKind::LeasePoisoned) && e.message().contains("lease poisoned")),
        "{err:?}"
    );
    assert_eq!(a.query().await.unwrap().state, LeaseState::Poisoned);

    b_task.await.unwrap();
    // Stateless submits are unaffected too.
    check_iota(&client.gpu_call(&iota_call(4096)).await.unwrap(), 4096);
    drop(module);
    a.free().await.unwrap();
    b.free().await.unwrap();
    fx.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs an NVIDIA GPU"]
async fn many_clients_submit_concurrently() {
    let mut cfg = gpu_config();
    cfg.submit_workers = 4;
    // One token for all 32 clients: let its submits use every worker.
    cfg.max_submits_per_principal = 4;
    let fx = Arc::new(Fixture::with_config(cfg).start().await);
    let mut tasks = Vec::new();
    for c in 0..32u32 {
        let fx = fx.clone();
        tasks.push(tokio::spawn(async move {
            let client = connect(&fx.node).await;
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
    let m = fx.node.metrics_text();
    assert_eq!(metric(&m, "gpu_submit_total"), Some(3200), "{m}");
    assert_eq!(metric(&m, "gpu_submit_errors_total"), Some(0), "{m}");
}

/// Random bytes (xorshift), no extra dependencies.

#[tokio::test]
#[ignore = "needs an NVIDIA GPU"]
async fn large_and_odd_transfers_round_trip_byte_exact() {
    let fx = Fixture::with_config(gpu_config()).start().await;
    let node = &fx.node;
    // Striped over 4 connections (the default from 8 MiB) and not at all.
    for config in [client_config(node), client_config(node).stripes(1, 0)] {
        let client = Arc::new(
            cuda_lease::Client::connect(node.addr(), &config)
                .await
                .unwrap(),
        );
        large_and_odd_transfers(client).await;
    }
    fx.shutdown().await;
}

/// 1 GiB of random bytes through `h2d`, then `d2h`, on a lease, as a user
/// writes them: byte-exact, on the data path (each transfer a few small
/// messages, the bytes in streamed MEM_WRITEs and MEM_READs), with the
/// process's memory beyond the input and the output bounded (the node's
/// ring is 32 MiB per worker).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_gib_through_h2d_and_d2h_on_a_lease_is_byte_exact_and_streamed() {
    use cuda_async::prelude::*;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let fixture = rt.block_on(Fixture::with_config(gpu_node_path_config()).start());
    let node = &fixture.node;
    let builder = Lease::builder()
        .min_vram(1 << 31)
        .config(client_config(node));
    let lease = cuda_lease::remote::BlockingLease::connect(builder, node.addr()).unwrap();
    let policy = cuda_async::RemotePolicy::new(&lease);
    let n = 1usize << 30;
    let bytes = random_bytes(n, 0x1_0000_0001);
    // The peak of the process's RSS (node and client alike: the test runs
    // both) while `f` runs, over its value before.
    let peak_during = |f: &mut dyn FnMut()| {
        let peak = PeakRss::start();
        f();
        peak.stop()
    };
    let b0 = batches(node).0;
    let bulk_bytes = || metric(&node.metrics_text(), "gpu_bulk_data_bytes_total").unwrap();
    let bulk0 = bulk_bytes();
    let mut input = Some(bytes.clone());
    let (mut buf, mut up) = (None, Duration::ZERO);
    let rss_up = peak_during(&mut || {
        let t = std::time::Instant::now();
        // The op takes the input (moved, not copied).
        buf = Some(h2d(input.take().unwrap()).sync_with(&policy).unwrap());
        up = t.elapsed();
    });
    let (mut back, mut down) = (None, Duration::ZERO);
    let rss_down = peak_during(&mut || {
        let t = std::time::Instant::now();
        back = Some(d2h(buf.take().unwrap()).sync_with(&policy).unwrap());
        down = t.elapsed();
    });
    let back = back.unwrap();
    // The buffer's free goes alone once the download is done: counted
    // once every free has reached the node.
    let ledger = cuda_async::RemoteSession::ledger(&*lease.session()).unwrap();
    assert!(
        ledger.wait_idle(Duration::from_secs(30)),
        "frees still going"
    );
    let msgs = batches(node).0 - b0;
    let bulk = bulk_bytes() - bulk0;
    let gib = |d: Duration| n as f64 / d.as_secs_f64() / (1u64 << 30) as f64;
    println!(
        "1 GiB: h2d {up:?} ({:.2} GiB/s), d2h {down:?} ({:.2} GiB/s); {msgs} BATCH messages; \
         {} MiB over the bulk-data channel; peak RSS growth during h2d {} MiB, during d2h {} \
         MiB (the output: 1024)",
        gib(up),
        gib(down),
        bulk >> 20,
        rss_up >> 20,
        rss_down >> 20
    );
    assert!(
        back.as_slice().unwrap() == &bytes[..],
        "the bytes came back changed"
    );
    // The upload's allocation (outside the order) and its empty message
    // (its place in the order), the download's empty message ordering it,
    // and the buffer's free, alone, after it.
    assert_eq!(msgs, 4, "BATCH messages");
    assert_eq!(
        bulk,
        2 * n as u64,
        "the upload and the download over the bulk-data channel"
    );
    // Beyond the input (given to the op, which keeps it without a copy) or
    // the output: at most the node's ring and 64 MiB for the client and 64
    // for the node.
    let bound = (32 << 20) + (128 << 20);
    assert!(
        rss_up <= bound,
        "RSS grew {} MiB during the upload",
        rss_up >> 20
    );
    assert!(
        rss_down <= bound + (1 << 30),
        "RSS grew {} MiB during the download",
        rss_down >> 20
    );
    drop(back);
    drop(lease);
    rt.block_on(fixture.shutdown());
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

/// `y = 2x + 1` through cuda-async on `policy`: correct data.
async fn good_pipeline_on(policy: &cuda_async::RemotePolicy) {
    use cuda_async::prelude::*;
    let m = cuda_async::Module::cuda(
        "extern \"C\" __global__ void axpb(float* y, const float* x, unsigned n) {\n\
         unsigned i = blockIdx.x * blockDim.x + threadIdx.x;\n\
         if (i < n) y[i] = 2.0f * x[i] + 1.0f;\n}\n",
        &[],
    )
    .unwrap();
    let k = m.kernel("axpb").unwrap();
    let x: Vec<f32> = (0..4096).map(|i| i as f32 * 0.5).collect();
    let n = x.len() as u32;
    let cfg = cuda_async::LaunchConfig::for_num_elems(n);
    let y = h2d(x.clone())
        .zip(zeros::<f32>(n as usize))
        // SAFETY: axpb writes y[0..n) and reads x[0..n); both hold n floats.
        .then(move |(x, y)| unsafe { launch(&k, cfg, (y, x, n)) })
        .then(|(y, _, _)| d2h(y))
        .schedule(policy)
        .unwrap()
        .await
        .unwrap();
    let want: Vec<f32> = x.iter().map(|v| 2.0 * v + 1.0).collect();
    assert_eq!(y.to_vec().unwrap(), want);
}

mod cuda_c;
#[cfg(feature = "fleet")]
mod fleets;
mod order;
mod wake;
