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
#[path = "../../../cuda-async/tests/suite/mod.rs"]
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
    fn start_with(adjust: impl FnOnce(LeaseBuilder) -> LeaseBuilder) -> Self {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let fixture = rt.block_on(Fixture::with_config(gpu_config()).start());
        let node = &fixture.node;
        let builder = adjust(
            Lease::builder()
                .min_vram(256 << 20)
                .config(client_config(node)),
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

mod over_a_lease {
    use super::*;

    macro_rules! remote_suite {
        ($($name:ident),* $(,)?) => {$(
            #[test]
            #[ignore = "needs an NVIDIA GPU"]
            fn $name() {
                let backend = RemoteBackend::start();
                suite::$name(&backend.policy);
            }
        )*};
    }

    remote_suite!(
        h2d_d2h_round_trips_random_data_of_many_sizes,
        zeros_memset_and_d2d_match_the_cpu,
        pinned_copies_fill_poisoned_buffers_and_check_lengths,
        launch_axpy_matches_the_cpu,
        then_and_map_chain_ten_launches_in_order,
        value_with_context_and_boxed_compose,
        run_time_argument_lists_launch_with_offsets_and_are_checked,
        zip_arms_run_concurrently_on_different_streams,
        join_all_is_concurrent_and_ordered,
        shared_runs_once_and_consumers_on_other_streams_see_its_result,
        typed_launchers_match_the_cpu_on_random_data,
        zip_macro_of_four_typed_spins_overlaps_on_the_gpu,
        timed_measures_a_one_ms_spin_on_the_gpu_within_ten_percent,
    );

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn tokio_64_tasks_x_1000_awaited_ops_are_all_correct() {
        let backend = RemoteBackend::start();
        let lease = backend.lease.as_ref().unwrap();
        suite::tokio_64_tasks_x_1000_awaited_ops_are_all_correct(Arc::new(
            cuda_async::RemotePolicy::new(lease),
        ));
    }

    /// A local memory pool cannot serve a remote policy: its `select`
    /// says why, naming the pool's GPU.
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn a_remote_policy_refuses_a_local_memory_pool() {
        use cuda_async::prelude::*;
        let backend = RemoteBackend::start();
        let pool = cuda_async::MemPool::default_of(&cuda_async::Device::new(0).unwrap()).unwrap();
        let policy =
            cuda_async::RemotePolicy::new(backend.lease.as_ref().unwrap()).with_mem_pool(pool);
        let e = policy.select().unwrap_err();
        assert!(
            matches!(&e, cuda_async::Error::InvalidArgument(m) if m.contains("GPU 0") && m.contains("lease")),
            "{e}"
        );
    }

    /// A GEMM on a lease runs by the node's cuBLAS and gives the same bits
    /// as the same call locally on this GPU: f32 with transposes, alpha and
    /// beta, an f64 strided batch, and a product inside a remote graph.
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn a_gemm_on_a_lease_matches_the_local_one_bit_for_bit() {
        use cuda_async::blas::{gemm, Gemm};
        use cuda_async::prelude::*;
        let backend = RemoteBackend::start();
        let remote = &backend.policy;
        let local =
            cuda_async::StreamPoolRoundRobin::new(&cuda_async::Device::new(0).unwrap(), 2).unwrap();
        let (m, n, k) = (96, 80, 112);
        let g = Gemm::<f32>::new(m, n, k)
            .transpose_a()
            .alpha(1.25)
            .beta(-0.5);
        let (av, bv, cv) = (
            random_f32(m * k, 1),
            random_f32(k * n, 2),
            random_f32(m * n, 3),
        );
        let op = || {
            let (a, b, c) = (av.clone(), bv.clone(), cv.clone());
            h2d(a)
                .zip(h2d(b))
                .zip(h2d(c))
                .then(move |((a, b), c)| gemm(g, a, b, c))
                .then(|(_, _, c)| d2h(c))
        };
        let here = op().sync_with(&local).unwrap().to_vec().unwrap();
        let there = op().sync_with(remote).unwrap().to_vec().unwrap();
        assert!(here.iter().any(|v| *v != 0.0));
        assert_eq!(
            here.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            there.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "f32, A transposed"
        );
        let g = Gemm::<f64>::new(16, 24, 8).transpose_b().batched(4);
        let av: Vec<f64> = random_f32(4 * 16 * 8, 4)
            .into_iter()
            .map(f64::from)
            .collect();
        let bv: Vec<f64> = random_f32(4 * 24 * 8, 5)
            .into_iter()
            .map(f64::from)
            .collect();
        let op = || {
            let (a, b) = (av.clone(), bv.clone());
            h2d(a)
                .zip(h2d(b))
                .zip(zeros::<f64>(4 * 16 * 24))
                .then(move |((a, b), c)| gemm(g, a, b, c))
                .then(|(_, _, c)| d2h(c))
        };
        let here = op().sync_with(&local).unwrap().to_vec().unwrap();
        let there = op().sync_with(remote).unwrap().to_vec().unwrap();
        assert_eq!(
            here.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            there.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "f64, a strided batch"
        );
        // Captured on the lease, replayed twice: C += A * B each time.
        let g = Gemm::<f32>::new(32, 32, 32).beta(1.0);
        let (a, b) = (random_f32(1024, 6), random_f32(1024, 7));
        let a = Arc::new(h2d(a).sync_with(remote).unwrap());
        let b = Arc::new(h2d(b).sync_with(remote).unwrap());
        let c = zeros::<f32>(1024).sync_with(remote).unwrap();
        let graph = value(c)
            .then(move |c| gemm(g, a.clone(), b.clone(), c))
            .map(|(_, _, c)| c)
            .graph_with(remote)
            .expect("a gemm captures on a lease");
        graph.launch().sync_with(remote).expect("replay 1");
        let once = d2h(graph.output())
            .sync_with(remote)
            .unwrap()
            .to_vec()
            .unwrap();
        graph.launch().sync_with(remote).expect("replay 2");
        let twice = d2h(graph.output())
            .sync_with(remote)
            .unwrap()
            .to_vec()
            .unwrap();
        for (i, (o, t)) in once.iter().zip(&twice).enumerate() {
            assert!(
                (2.0 * o - t).abs() <= 1e-4 * (1.0 + t.abs()),
                "element {i}: one replay {o}, two {t}"
            );
        }
        assert!(once.iter().any(|v| *v != 0.0));
    }

    /// Bytes the lease has allocated on the node now.
    fn allocated(backend: &RemoteBackend) -> u64 {
        let lease = backend.lease.as_ref().unwrap().lease();
        backend.rt.block_on(lease.query()).unwrap().allocated
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn a_remote_future_dropped_in_flight_frees_its_memory_after_the_gpu_work() {
        use cuda_async::prelude::*;
        use std::future::Future;
        let backend = RemoteBackend::start();
        let k = suite::kernels();
        // Warm up: the module is compiled and charged once.
        let _ = suite::spin_op(&k.spin, 1000)
            .sync_with(&backend.policy)
            .unwrap();
        let base = allocated(&backend);
        let bytes = 64usize << 20;
        let spin = k.spin.clone();
        // A 64 MiB buffer written by nothing, kept by a 300 ms spin's output.
        let mut fut = zeros::<u8>(bytes)
            .zip(zeros::<u64>(2))
            .then(move |(big, s)| {
                // SAFETY: spin writes stamps[0..2) of a 2-element buffer.
                unsafe { launch(&spin, suite::cfg(1), (300_000_000u64, s)) }.map(move |_| big)
            })
            .schedule(&backend.policy)
            .unwrap();
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(std::pin::Pin::new(&mut fut).poll(&mut cx).is_pending());
        let t = std::time::Instant::now();
        drop(fut);
        assert!(
            t.elapsed() < std::time::Duration::from_millis(20),
            "drop blocked"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
        let during = allocated(&backend);
        assert!(
            during >= base + bytes as u64,
            "freed while the GPU work was queued: {during} bytes, base {base}"
        );
        // After the spin, the queued frees run.
        let t = std::time::Instant::now();
        while allocated(&backend) > base {
            assert!(
                t.elapsed() < std::time::Duration::from_secs(10),
                "never freed"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn a_lease_expiring_mid_pipeline_fails_it_with_lease_expired() {
        use cuda_async::prelude::*;
        let backend = RemoteBackend::start_with(|b| {
            b.ttl(std::time::Duration::from_secs(1)).auto_renew(false)
        });
        let k = suite::kernels();
        let spin = k.spin.clone();
        let t = std::time::Instant::now();
        // Four seconds of spinning on a lease that ends after one.
        let e = zeros::<u64>(2)
            // SAFETY: spin writes stamps[0..2) of a 2-element buffer.
            .then(move |s| unsafe { launch(&spin, suite::cfg(1), (4_000_000_000u64, s)) })
            .sync_with(&backend.policy)
            .unwrap_err();
        assert!(
            matches!(
                e.remote_kind(),
                Some(cuda_async::RemoteErrorKind::LeaseExpired)
            ),
            "{e}"
        );
        eprintln!("lease expired mid-pipeline: failed after {:?}", t.elapsed());
    }

    /// A graph kept on the node, with zip arms on two streams: 20 launches,
    /// each after new inputs, are bit-identical to the same op run eagerly
    /// on the lease and on the local GPU.
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn a_graph_kept_on_the_node_replays_bit_identical_to_eager_runs() {
        use cuda_async::prelude::*;
        use cuda_async::DeviceBuffer;
        let backend = RemoteBackend::start();
        let remote = cuda_async::RemotePolicy::new(backend.lease.as_ref().unwrap()).with_streams(2);
        let local = cuda_async::default_policy().unwrap();
        let k = suite::kernels();
        let n = 1 << 16;
        let m = n as u32;
        // y1 = 1.5 x1 + 0, y2 = -0.5 x2 + 0 then y2 = 2 y1 + y2: two arms, a join.
        let op = move |x1: DeviceBuffer<f32>, x2: DeviceBuffer<f32>| {
            let (a, b, c) = (k.axpy.clone(), k.axpy.clone(), k.axpy.clone());
            zeros::<f32>(n)
                .zip(zeros::<f32>(n))
                .then(move |(y1, y2)| {
                    // SAFETY: axpy touches x and y [0..m); all hold m floats.
                    let arm1 = unsafe { launch(&a, suite::cfg(m), (1.5f32, x1, y1, m)) };
                    // SAFETY: as above.
                    let arm2 = unsafe { launch(&b, suite::cfg(m), (-0.5f32, x2, y2, m)) };
                    arm1.zip(arm2)
                })
                .then(move |((_, x1, y1, _), (_, x2, y2, _))| {
                    let y1 = std::sync::Arc::new(y1);
                    // SAFETY: as above.
                    unsafe { launch(&c, suite::cfg(m), (2.0f32, y1.clone(), y2, m)) }
                        .map(move |(_, _, y2, _)| (x1, x2, y1, y2))
                })
        };
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let eager = |p: &dyn SchedulingPolicy, a: &[f32], b: &[f32]| {
            let (x1, x2) = (
                h2d(a.to_vec()).sync_with(p).unwrap(),
                h2d(b.to_vec()).sync_with(p).unwrap(),
            );
            let (_, _, y1, y2) = op(x1, x2).sync_with(p).unwrap();
            let y1 = std::sync::Arc::try_unwrap(y1).ok().unwrap();
            (
                bits(&d2h(y1).sync_with(p).unwrap().to_vec().unwrap()),
                bits(&d2h(y2).sync_with(p).unwrap().to_vec().unwrap()),
            )
        };
        let zero = || zeros::<f32>(n).sync_with(&remote).unwrap();
        let mut graph = op(zero(), zero()).graph_with(&remote).unwrap();
        let mut rng = suite::Rng::new();
        for i in 0..20 {
            let (a, b) = (rng.f32s(n), rng.f32s(n));
            let (ua, ub) = (a.clone(), b.clone());
            graph
                .update(move |(x1, x2, y1, y2)| {
                    h2d(ua)
                        .zip(h2d(ub))
                        .then(move |(s1, s2)| copy_d2d(s1, x1).zip(copy_d2d(s2, x2)))
                        .map(move |((_, x1), (_, x2))| (x1, x2, y1, y2))
                })
                .sync_with(&remote)
                .unwrap();
            let t = std::time::Instant::now();
            graph.launch().sync_with(&remote).unwrap();
            if i % 5 == 0 {
                eprintln!(
                    "launch {i} of a graph kept on the node, awaited: {:?}",
                    t.elapsed()
                );
            }
            let out = graph.output();
            let replay = (
                bits(&d2h(&*out.2).sync_with(&remote).unwrap().to_vec().unwrap()),
                bits(&d2h(&out.3).sync_with(&remote).unwrap().to_vec().unwrap()),
            );
            assert!(
                replay == eager(&remote, &a, &b),
                "launch {i}: eager on the lease differs"
            );
            assert!(
                replay == eager(&*local, &a, &b),
                "launch {i}: eager locally differs"
            );
        }
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn a_buffer_used_where_it_does_not_live_is_an_error_naming_both_homes() {
        use cuda_async::prelude::*;
        let backend = RemoteBackend::start();
        let local = zeros::<u32>(64).sync().unwrap();
        let remote = zeros::<u32>(64).sync_with(&backend.policy).unwrap();
        // A local buffer in a remote op.
        let e = d2h(&local).sync_with(&backend.policy).unwrap_err();
        assert!(
            matches!(&e, cuda_async::Error::WrongHome { buffer, context }
                if buffer == "local GPU 0" && context.contains("lease")),
            "{e}"
        );
        // A remote buffer in local ops: a copy and a launch.
        let e = d2h(&remote).sync().unwrap_err();
        assert!(
            matches!(&e, cuda_async::Error::WrongHome { buffer, context }
                if buffer.contains("lease") && context == "local GPU 0"),
            "{e}"
        );
        let k = suite::kernels();
        // SAFETY: never launched (the home check fails first).
        let e = unsafe { launch(&k.add_u32, suite::cfg(64), (remote, 1u32, 64u32)) }
            .sync()
            .unwrap_err();
        assert!(matches!(e, cuda_async::Error::WrongHome { .. }), "{e}");
    }
}

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
    let fixture = rt.block_on(Fixture::with_config(gpu_config()).start());
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
    // The allocation, then the empty message ordering the download (and
    // perhaps the buffer's free, alone, after it).
    assert!((2..=3).contains(&msgs), "{msgs} BATCH messages");
    assert_eq!(bulk, n as u64, "the upload over the bulk-data channel");
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

/// CUDA C the client sends as source only: the node compiles it with its
/// own NVRTC for its own GPU.
const CUDA_KERNELS: &str = r#"
extern "C" __global__ void axpy(float a, const float* x, float* y, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
// A slow writer (the ordering test): every thread waits `ns` of GPU time,
// then writes `y[i] = i + 1`.
extern "C" __global__ void slow_iota(unsigned long long ns, float* y, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
    if (i < n) y[i] = (float)(i + 1);
}
extern "C" __global__ void spin(unsigned long long ns, unsigned long long* out) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
    out[0] = start;
    out[1] = now;
}
"#;

#[tokio::test]
#[ignore = "needs an NVIDIA GPU"]
async fn v2_cuda_c_compiled_on_the_node_and_random_data_round_trips() {
    let fx = gpu_lease(64 << 20).await;
    let (node, client, s) = (&fx.node, fx.client(), fx.session());
    let m = ModuleSpec::cuda(CUDA_KERNELS, &[]);
    let n: u32 = 1_000_003;
    let bytes = u64::from(n) * 4;
    let x = random_f32(n as usize, 11);
    let y = random_f32(n as usize, 12);
    let raw = random_bytes(5_000_001, 13);
    let mut rec = s.recorder();
    let (dx, dy, dr) = (
        rec.alloc(0, bytes),
        rec.alloc(1, bytes),
        rec.alloc(2, raw.len() as u64),
    );
    rec.write(0, dx, 0, &f32_bytes(&x));
    rec.write(1, dy, 0, &f32_bytes(&y));
    rec.write(2, dr, 0, &raw);
    let x_ready = rec.record(0);
    rec.wait(1, x_ready);
    rec.launch(
        1,
        &m,
        "axpy",
        [n.div_ceil(256), 1, 1],
        [256, 1, 1],
        vec![
            LaunchArg::f32(2.5),
            LaunchArg::mem(dx),
            LaunchArg::mem(dy),
            LaunchArg::u32(n),
        ],
    );
    let ry = rec.read(1, dy, 0, bytes as u32);
    let rr = rec.read(2, dr, 0, raw.len() as u32);
    let t = std::time::Instant::now();
    let out = rec.submit().await.unwrap().ok().unwrap();
    eprintln!(
        "CUDA C compiled on the node + 9 commands on 3 streams: {:?}",
        t.elapsed()
    );
    assert!(out.read(rr).unwrap() == &raw[..], "random bytes differ");
    let got = bytes_f32(out.read(ry).unwrap());
    for i in 0..n as usize {
        // NVRTC may fuse the multiply-add: one rounding instead of two.
        let want = 2.5 * x[i] + y[i];
        assert!(
            (got[i] - want).abs() <= 1e-5 * (1.0 + want.abs()),
            "axpy[{i}]: {} vs {want}",
            got[i]
        );
    }
    // Another lease names the module by hash alone: the node loads the
    // PTX it kept from the first compile, and NVRTC does not run again.
    let compiled = |node: &Node| metric(&node.metrics_text(), "gpu_modules_compiled_total");
    assert_eq!(compiled(node), Some(1));
    let other = Lease::builder()
        .min_vram(1 << 20)
        .on(client.clone())
        .await
        .unwrap();
    let t = std::time::Instant::now();
    other.session().load(&m).await.unwrap();
    eprintln!(
        "the same CUDA C in a second lease (node-wide PTX): {:?}",
        t.elapsed()
    );
    assert_eq!(compiled(node), Some(1), "compiled again");
    other.free().await.unwrap();
    // Fill and copy between buffers, across streams, on the GPU.
    let mut rec = s.recorder();
    let (fa, fb) = (rec.alloc(0, 1 << 20), rec.alloc(1, 1 << 20));
    rec.write(0, fa, 0, &raw[..1 << 20]);
    rec.fill(0, fa, 100, 1000, 0x5A);
    rec.copy(1, (fa, 0), (fb, 8), (1 << 20) - 8);
    let rb = rec.read(1, fb, 0, 1 << 20);
    let out = rec.submit().await.unwrap().ok().unwrap();
    let mut want = vec![0u8; 8];
    want.extend_from_slice(&raw[..(1 << 20) - 8]);
    want[108..1108].fill(0x5A);
    assert!(out.read(rb).unwrap() == &want[..], "fill + copy differ");
    // And through the streamed path, striped.
    let big = random_bytes(48 << 20, 14);
    let b = s.alloc(big.len() as u64).await.unwrap();
    s.write(&b, 0, &big).await.unwrap();
    assert!(s.read(&b, 0, big.len() as u32).await.unwrap() == big);
    drop(b);
    // A compile error comes back with NVRTC's log, naming the launch.
    let bad = ModuleSpec::cuda(
        "extern \"C\" __global__ void k(float* p) { p[0] = undeclared_thing; }",
        &[],
    );
    let mut rec = s.recorder();
    rec.launch(0, &bad, "k", [1, 1, 1], [1, 1, 1], vec![LaunchArg::mem(dx)]);
    let reply = rec.submit().await.unwrap();
    let e = reply.error().unwrap();
    eprintln!("compile error: {}", e.message);
    assert_eq!(
        (e.index, e.status),
        (0, cuda_lease::proto::Status::LoadFailed)
    );
    assert!(e.message.contains("undeclared_thing"), "{}", e.message);
    fx.free_and_shutdown().await;
}

#[tokio::test]
#[ignore = "needs an NVIDIA GPU"]
async fn v2_three_streams_of_a_lease_overlap_on_the_gpu() {
    let fx = gpu_lease(16 << 20).await;
    let s = fx.session();
    let m = ModuleSpec::cuda(CUDA_KERNELS, &[]);
    s.load(&m).await.unwrap(); // compile outside the measurement
    const SPIN_NS: u64 = 1_000_000;
    let mut best = None;
    for round in 0..3 {
        let mut rec = s.recorder();
        let mut reads = Vec::new();
        for stream in 0..3u32 {
            let out = rec.alloc(stream, 16);
            rec.launch(
                stream,
                &m,
                "spin",
                [1, 1, 1],
                [1, 1, 1],
                vec![LaunchArg::u64(SPIN_NS), LaunchArg::mem(out)],
            );
            reads.push(rec.read(stream, out, 0, 16));
            rec.free(stream, out);
        }
        let t = std::time::Instant::now();
        let reply = rec.submit().await.unwrap().ok().unwrap();
        let wall = t.elapsed();
        let spans: Vec<(u64, u64)> = reads
            .iter()
            .map(|r| {
                let b = reply.read(*r).unwrap();
                let w = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap());
                (w(0), w(1))
            })
            .collect();
        let first = spans.iter().map(|s| s.0).min().unwrap();
        let last = spans.iter().map(|s| s.1).max().unwrap();
        let latest_start = spans.iter().map(|s| s.0).max().unwrap();
        let earliest_end = spans.iter().map(|s| s.1).min().unwrap();
        let span_ns = last - first;
        eprintln!(
            "round {round}: 3 x {SPIN_NS} ns spins on 3 streams took {span_ns} ns of GPU time \
             ({:.2}x one spin); all three running together for {} ns; batch wall {wall:?}",
            span_ns as f64 / SPIN_NS as f64,
            earliest_end.saturating_sub(latest_start),
        );
        if latest_start < earliest_end {
            best = Some(span_ns);
        }
    }
    let span = best.expect("the three streams' spins never overlapped");
    assert!(
        span < 2 * SPIN_NS,
        "three 1 ms spins took {span} ns: not concurrent"
    );
    fx.free_and_shutdown().await;
}

/// Buffers order their uses across streams with no event commands: the
/// worker records a buffer's uses once per stream change (not per
/// launch), and a reader on another stream, then a writer on a third,
/// must still see the slow writer's data and not clobber it early.
#[tokio::test]
#[ignore = "needs an NVIDIA GPU"]
async fn v2_buffers_order_their_uses_across_streams_without_events() {
    let fx = gpu_lease(16 << 20).await;
    let s = fx.session();
    let m = ModuleSpec::cuda(CUDA_KERNELS, &[]);
    s.load(&m).await.unwrap();
    let n: u32 = 65_536;
    let bytes = u64::from(n) * 4;
    let grid = [n.div_ceil(256), 1, 1];
    for round in 0..3 {
        let mut rec = s.recorder();
        let y = rec.alloc(0, bytes);
        let z = rec.alloc(1, bytes);
        // 2 ms on stream 0, then y = 1..=n.
        rec.launch(
            0,
            &m,
            "slow_iota",
            grid,
            [256, 1, 1],
            vec![
                LaunchArg::u64(2_000_000),
                LaunchArg::mem(y),
                LaunchArg::u32(n),
            ],
        );
        // Stream 1 reads y: z = 2 y + 0.
        for _ in 0..3 {
            rec.launch(
                1,
                &m,
                "axpy",
                grid,
                [256, 1, 1],
                vec![
                    LaunchArg::f32(0.0),
                    LaunchArg::mem(z),
                    LaunchArg::mem(z),
                    LaunchArg::u32(n),
                ],
            );
        }
        rec.launch(
            1,
            &m,
            "axpy",
            grid,
            [256, 1, 1],
            vec![
                LaunchArg::f32(2.0),
                LaunchArg::mem(y),
                LaunchArg::mem(z),
                LaunchArg::u32(n),
            ],
        );
        // Stream 2 overwrites y only after stream 1 has read it.
        rec.fill(2, y, 0, bytes, 0);
        let rz = rec.read(1, z, 0, bytes as u32);
        let ry = rec.read(2, y, 0, bytes as u32);
        rec.free(0, y);
        rec.free(0, z);
        let out = rec.submit().await.unwrap().ok().unwrap();
        let got = bytes_f32(out.read(rz).unwrap());
        for (i, v) in got.iter().enumerate() {
            assert_eq!(*v, 2.0 * (i as f32 + 1.0), "round {round}: z[{i}]");
        }
        assert!(
            out.read(ry).unwrap().iter().all(|&b| b == 0),
            "round {round}: y was not overwritten after its reader"
        );
    }
    // A freed small buffer is handed out again by a later allocation of
    // its size (from the next batch on, sent here before the first one's
    // reply): zeroed, after its last writer, on another stream.
    for round in 0..3 {
        let mut first = s.recorder();
        let a = first.alloc(0, 1024);
        first.launch(
            0,
            &m,
            "slow_iota",
            [1, 1, 1],
            [256, 1, 1],
            vec![
                LaunchArg::u64(2_000_000),
                LaunchArg::mem(a),
                LaunchArg::u32(256),
            ],
        );
        let ra = first.read(0, a, 0, 1024);
        first.free(0, a);
        let first = first.submit();
        let mut second = s.recorder();
        let b = second.alloc(1, 1024);
        let rb = second.read(1, b, 0, 1024);
        second.free(1, b);
        let second = second.submit();
        let (first, second) = tokio::join!(first, second);
        let first = first.unwrap().ok().unwrap();
        let want: Vec<f32> = (1..=256).map(|i| i as f32).collect();
        assert_eq!(bytes_f32(first.read(ra).unwrap()), want, "round {round}");
        assert!(
            second
                .unwrap()
                .ok()
                .unwrap()
                .read(rb)
                .unwrap()
                .iter()
                .all(|&x| x == 0),
            "round {round}: a reused buffer was not zero"
        );
    }
    fx.free_and_shutdown().await;
}

/// The CUDA toolkit's header folder on this host, if there is one.
fn cuda_include_dir() -> Option<std::path::PathBuf> {
    let mut cands: Vec<std::path::PathBuf> = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(std::env::var_os)
        .map(|v| std::path::PathBuf::from(v).join("include"))
        .collect();
    cands.push("/usr/local/cuda/include".into());
    cands.into_iter().find(|d| d.join("cuda_fp16.h").is_file())
}

/// A template instantiated 2^40 times: no compiler finishes it.
const TEMPLATE_BOMB: &str = r#"
template <unsigned long long N, unsigned long long M> struct B {
    static constexpr unsigned long long v = B<N - 1, 2 * M>::v + B<N - 1, 2 * M + 1>::v;
};
template <unsigned long long M> struct B<0, M> { static constexpr unsigned long long v = M; };
extern "C" __global__ void k(unsigned long long* out) { out[0] = B<40, 1>::v; }
"#;

#[tokio::test]
#[ignore = "needs an NVIDIA GPU"]
async fn tenant_cuda_c_cannot_read_the_nodes_files_and_compiles_are_time_bounded() {
    let include = cuda_include_dir();
    let mut cfg = gpu_config();
    cfg.worker.compile.include_dirs = include.iter().cloned().collect();
    cfg.worker.compile.timeout = Duration::from_secs(3);
    let fx = Fixture::with_config(cfg)
        .lease_with(Lease::builder().min_vram(16 << 20))
        .start()
        .await;
    let s = fx.session();
    let secrets = node_secrets();
    let kernel = "extern \"C\" __global__ void k(float* p) { p[0] = 1.0f; }\n";
    let attacks: [(&str, &[&str]); 6] = [
        ("#include \"/etc/passwd\"\n", &[]),
        ("#include \"/proc/self/environ\"\n", &[]),
        ("#include \"/proc/self/cmdline\"\n", &[]),
        ("#include </dev/zero>\n", &[]),
        ("#include \"etc/passwd\"\n", &["-I/"]),
        ("#include <passwd>\n", &["-I/etc"]),
    ];
    for (head, options) in attacks {
        let m = ModuleSpec::cuda(format!("{head}{kernel}"), options);
        let t = std::time::Instant::now();
        let e = s.load(&m).await.unwrap_err();
        let text = e.to_string();
        eprintln!("{head:?} {options:?}: {:?}: {text}", t.elapsed());
        assert!(matches!(e.kind(), ErrorKind::LoadFailed), "{e}");
        assert!(t.elapsed() < Duration::from_secs(10));
        for line in &secrets {
            assert!(!text.contains(line.as_str()), "{head:?}: quotes {line:?}");
        }
    }
    // A compile that would never end is stopped at the bound.
    let t = std::time::Instant::now();
    let e = s
        .load(&ModuleSpec::cuda(TEMPLATE_BOMB, &[]))
        .await
        .unwrap_err();
    eprintln!("template bomb: {:?}: {e}", t.elapsed());
    assert!(e.to_string().contains("did not finish within 3s"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
    // The headers the node offers still compile, and run.
    let dir = include.expect("no CUDA include folder with cuda_fp16.h on this host");
    let fp16 = ModuleSpec::cuda(
        "#include <cuda_fp16.h>\n\
         extern \"C\" __global__ void k(float* p) { p[0] = __half2float(__float2half(1.5f)); }\n",
        &["--std=c++17"],
    );
    let t = std::time::Instant::now();
    s.load(&fp16).await.unwrap();
    eprintln!(
        "cuda_fp16.h from {}: compiled in {:?}",
        dir.display(),
        t.elapsed()
    );
    let buf = s.alloc(4).await.unwrap();
    s.launch(&fp16, "k", [1, 1, 1], [1, 1, 1], vec![buf.arg()])
        .await
        .unwrap();
    assert_eq!(s.read(&buf, 0, 4).await.unwrap(), 1.5f32.to_le_bytes());
    drop(buf);
    fx.free_and_shutdown().await;
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn the_confined_compiler_alone_cannot_read_the_nodes_files() {
    use cuda_lease_node::sandbox::{CompileSandbox, Compiler};
    // Past the source check (called directly): the confinement alone holds.
    let compiler = Compiler::new(CompileSandbox {
        include_dirs: cuda_include_dir().into_iter().collect(),
        ..CompileSandbox::default()
    })
    .with_program(worker_exe());
    let secrets = node_secrets();
    for path in ["/etc/passwd", "/proc/self/environ", "/proc/self/cmdline"] {
        let src = format!("#include \"{path}\"\nextern \"C\" __global__ void k() {{}}\n");
        let log = compiler
            .compile("attack", &src, &[], "compute_80")
            .unwrap_err();
        eprintln!("{path}: {log}");
        for line in &secrets {
            assert!(!log.contains(line.as_str()), "{path}: quotes {line:?}");
        }
    }
    let ptx = compiler
        .compile(
            "fp16",
            "#include <cuda_fp16.h>\nextern \"C\" __global__ void k(float* p) { p[0] = __half2float(__float2half(1.5f)); }\n",
            &[],
            "compute_80",
        )
        .unwrap();
    assert!(ptx.contains(".entry k"), "{ptx}");
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

/// Two nodes on this GPU register in a real etcd (the bundle carries one:
/// `$CUDA_LEASE_TEST_ETCD`); a client finds both through the registry,
/// with the GPU's own inventory, and runs one pipeline on a lease of each.
#[cfg(feature = "fleet")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an NVIDIA GPU"]
async fn two_gpu_nodes_found_through_etcd_run_a_pipeline_each() {
    use common::etcd::*;
    let etcd = Etcd::start().await;
    let mut nodes = Vec::new();
    for name in ["gpu-a", "gpu-b"] {
        let mut cfg = gpu_config();
        cfg.name = name.into();
        cfg.capacity = Some(1 << 30);
        cfg.registry = Some(registry(&etcd, Duration::from_secs(5)));
        nodes.push(Node::start(cfg).await.expect("start a GPU node"));
    }
    let fleet = follow(&etcd).await;
    until(&fleet, "both GPU nodes", |n| n.len() == 2).await;
    for r in fleet.nodes() {
        let d = &r.devices[0];
        println!(
            "{} at {}: {} sm_{}{}, {} bytes reservable",
            r.name,
            r.address,
            d.name,
            d.compute_capability.0,
            d.compute_capability.1,
            r.reservable_bytes
        );
        assert!(
            d.compute_capability.0 >= 5 && d.total_bytes > 1 << 30,
            "{r:?}"
        );
        assert_eq!(r.reservable_bytes, 1 << 30);
    }
    for (name, node) in ["gpu-a", "gpu-b"].into_iter().zip(&nodes) {
        let lease = fleet
            .lease_placed(
                Lease::builder().min_vram(64 << 20),
                |_, _| vec![name.into()],
            )
            .await
            .unwrap();
        assert_eq!(lease.client().addr(), node.addr());
        good_pipeline_on(&policy_of(&lease)).await;
        lease.free().await.unwrap();
    }
    for n in nodes {
        n.shutdown().await;
    }
}

/// `y = 2x + 1` on `x`, downloaded.
#[cfg(feature = "fleet")]
fn axpb_op(
    k: &cuda_async::Kernel,
    x: Vec<f32>,
) -> impl cuda_async::DeviceOp<Output = cuda_async::HostBuffer<f32>> {
    use cuda_async::prelude::*;
    let n = x.len() as u32;
    let k = k.clone();
    let cfg = cuda_async::LaunchConfig::for_num_elems(n);
    h2d(x)
        .zip(zeros::<f32>(n as usize))
        // SAFETY: axpb writes y[0..n) and reads x[0..n); both hold n floats.
        .then(move |(x, y)| unsafe { launch(&k, cfg, (y, x, n)) })
        .then(|(y, _, _)| d2h(y))
}

/// `count` pipelines of `axpb_op` over `tasks` tasks, task `t` on
/// `policies[t % len]`, each checked; their wall time.
#[cfg(feature = "fleet")]
async fn axpb_pipelines<P>(policies: &[Arc<P>], count: usize, tasks: usize) -> Duration
where
    P: cuda_async::SchedulingPolicy + Send + Sync + 'static,
{
    use cuda_async::prelude::*;
    let k = cuda_async::Module::cuda(
        "extern \"C\" __global__ void axpb(float* y, const float* x, unsigned n) {\n\
         unsigned i = blockIdx.x * blockDim.x + threadIdx.x;\n\
         if (i < n) y[i] = 2.0f * x[i] + 1.0f;\n}\n",
        &[],
    )
    .unwrap()
    .kernel("axpb")
    .unwrap();
    // One warm-up each: the module reaches every lease before timing.
    for p in policies {
        axpb_op(&k, vec![1.0; 16])
            .schedule(&**p)
            .unwrap()
            .await
            .unwrap();
    }
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let t = std::time::Instant::now();
    let mut handles = Vec::new();
    for task in 0..tasks {
        let (p, k, next) = (
            policies[task % policies.len()].clone(),
            k.clone(),
            next.clone(),
        );
        handles.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= count {
                    return;
                }
                let x: Vec<f32> = (0..65536).map(|j| (i * 7 + j) as f32 * 0.25).collect();
                let want: Vec<f32> = x.iter().map(|v| 2.0 * v + 1.0).collect();
                let y = axpb_op(&k, x).schedule(&*p).unwrap().await.unwrap();
                assert_eq!(y.to_vec().unwrap(), want, "pipeline {i}");
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    t.elapsed()
}

/// Two node processes on this GPU, found through etcd: independent
/// pipelines through one `FleetPolicy` keep pace with the same pipelines
/// through one `RemotePolicy` per node driven by hand (printed: the ratio
/// of their throughputs), and a run with one node killed midway completes,
/// every result right.
#[cfg(feature = "fleet")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs an NVIDIA GPU"]
async fn a_fleet_policy_over_two_gpu_nodes_keeps_pace_and_survives_a_killed_node() {
    use common::etcd::*;
    use cuda_lease_fleet::{FleetPolicy, FleetPolicyConfig};
    let etcd = Etcd::start().await;
    let dir = std::env::temp_dir().join(format!("cuda-lease-gpu-fleet-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut children: Vec<std::process::Child> = ["gpu-a", "gpu-b"]
        .iter()
        .map(|name| {
            std::process::Command::new(worker_exe())
                .args(["--listen", "127.0.0.1:0", "--dev", "--capacity", "2G"])
                .args(["--name", name, "--tokens", TOKEN, "--prestart", "1"])
                .args(["--etcd", &etcd.url(), "--registry-ttl", "2s"])
                .arg("--dev-cert-out")
                .arg(dir.join(format!("{name}.pem")))
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("start cuda-lease-node")
        })
        .collect();
    let kill_all = |children: &mut Vec<std::process::Child>| {
        for c in children.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    };
    let fleet = follow(&etcd).await;
    if !fleet
        .wait_until(Duration::from_secs(60), |n| n.len() == 2)
        .await
    {
        kill_all(&mut children);
        panic!("the GPU nodes never registered");
    }
    let cfg = FleetPolicyConfig {
        leases: 2,
        max_leases: 2,
        vram: 512 << 20,
        ..FleetPolicyConfig::default()
    };
    let policy = Arc::new(FleetPolicy::new(&fleet, cfg.clone()).await.unwrap());
    let mut by_hand = Vec::new();
    let mut hand_leases = Vec::new();
    for name in ["gpu-a", "gpu-b"] {
        let lease = fleet
            .lease_placed(Lease::builder().min_vram(512 << 20), |_, _| {
                vec![name.into()]
            })
            .await
            .unwrap();
        by_hand.push(Arc::new(policy_of(&lease)));
        hand_leases.push(lease);
    }
    let (count, tasks) = (512, 16);
    let mut fleet_best = Duration::MAX;
    let mut hand_best = Duration::MAX;
    for _ in 0..3 {
        fleet_best =
            fleet_best.min(axpb_pipelines(std::slice::from_ref(&policy), count, tasks).await);
        hand_best = hand_best.min(axpb_pipelines(&by_hand, count, tasks).await);
    }
    let ratio = hand_best.as_secs_f64() / fleet_best.as_secs_f64();
    println!(
        "{count} pipelines over {tasks} tasks, best of 3: fleet policy {fleet_best:?}, one RemotePolicy per node by hand {hand_best:?}: throughput ratio {ratio:.3} (goal >= 0.9)"
    );
    println!("per node: {:?}", policy.stats());
    assert!(
        ratio > 0.5,
        "the fleet policy runs at {ratio:.3}x the hand-driven policies"
    );
    drop(by_hand);
    for l in hand_leases {
        l.free().await.unwrap();
    }
    policy.close().await;

    // One node killed midway: every pipeline completes, right.
    let policy = Arc::new(
        FleetPolicy::new(&fleet, FleetPolicyConfig { retry: 2, ..cfg })
            .await
            .unwrap(),
    );
    let victim = policy.nodes()[0].clone();
    let run = {
        let p = policy.clone();
        tokio::spawn(async move { axpb_pipelines(&[p], 600, 16).await })
    };
    let started = std::time::Instant::now();
    while policy.stats().iter().map(|s| s.completed).sum::<u64>() < 150 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the run did not start"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let i = if victim == "gpu-a" { 0 } else { 1 };
    let killed = std::time::Instant::now();
    children[i].kill().unwrap();
    children[i].wait().unwrap();
    let wall = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the run with a killed node hung")
        .unwrap();
    let first = policy.first_retry_done().map(|t| t - killed);
    println!(
        "killed {victim} mid-run: 600 pipelines correct in {wall:?}, {} retried, the first retried one done {first:?} after the kill; per node: {:?}",
        policy.retries(),
        policy.stats()
    );
    policy.close().await;
    kill_all(&mut children);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
#[ignore = "needs an NVIDIA GPU"]
async fn after_a_compile_error_and_a_kernel_fault_good_pipelines_run() {
    use cuda_async::prelude::*;
    let mut fx = gpu_lease(64 << 20).await;
    let policy = fx.policy();
    good_pipeline_on(&policy).await;
    // The node's NVRTC refuses the module: a load failure with its log, and
    // the same lease runs the next pipeline.
    let bad = cuda_async::Module::cuda(
        "extern \"C\" __global__ void k(float* p) { p[0] = not_declared; }\n",
        &[],
    )
    .unwrap();
    let k = bad.kernel("k").unwrap();
    let e = h2d(vec![1f32; 64])
        // SAFETY: k would write p[0]; p holds 64 floats.
        .then(move |p| unsafe { launch(&k, cuda_async::LaunchConfig::for_num_elems(1), (p,)) })
        .schedule(&policy)
        .unwrap()
        .await
        .unwrap_err();
    eprintln!("compile error: {e}");
    assert_eq!(
        e.remote_kind(),
        Some(cuda_async::RemoteErrorKind::LoadFailed),
        "{e}"
    );
    assert!(e.to_string().contains("not_declared"), "{e}");
    good_pipeline_on(&policy).await;
    // A kernel fault ends the lease's worker: the lease is poisoned, and a
    // new lease of the same node runs the next pipeline.
    let faulty = cuda_async::Module::cuda(
        "extern \"C\" __global__ void wild(float* p) { p[1ull << 40] = 1.0f; }\n",
        &[],
    )
    .unwrap();
    let wild = faulty.kernel("wild").unwrap();
    let e = h2d(vec![1f32; 64])
        // SAFETY: none: the kernel writes far out of bounds on purpose; the
        // fault happens in the node's worker process, not in this one.
        .then(move |p| unsafe { launch(&wild, cuda_async::LaunchConfig::for_num_elems(1), (p,)) })
        .then(|(p,)| d2h(p))
        .schedule(&policy)
        .unwrap()
        .await
        .unwrap_err();
    eprintln!("fault: {e}");
    assert!(
        matches!(
            e.remote_kind(),
            Some(
                cuda_async::RemoteErrorKind::LaunchFailed
                    | cuda_async::RemoteErrorKind::LeasePoisoned
            )
        ),
        "{e}"
    );
    let e = h2d(vec![1u8; 4])
        .then(d2h)
        .schedule(&policy)
        .unwrap()
        .await
        .unwrap_err();
    assert_eq!(
        e.remote_kind(),
        Some(cuda_async::RemoteErrorKind::LeasePoisoned),
        "{e}"
    );
    let fresh = Lease::builder()
        .min_vram(64 << 20)
        .on(fx.client().clone())
        .await
        .unwrap();
    good_pipeline_on(&policy_of(&fresh)).await;
    fresh.free().await.unwrap();
    drop(fx.take_lease());
    fx.shutdown().await;
}

/// A large `copy_h2d` from a pinned buffer into a remote buffer an earlier
/// submission made leaves the message (no BATCH at all: the bytes go as
/// MEM_WRITEs on the bulk-data channel, after the earlier submissions),
/// lands after the memset before it, and reads back byte-exact.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_large_copy_into_a_kept_remote_buffer_takes_the_data_path() {
    use cuda_async::prelude::*;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let fixture = rt.block_on(Fixture::with_config(gpu_config()).start());
    let node = &fixture.node;
    let builder = Lease::builder()
        .min_vram(256 << 20)
        .config(client_config(node));
    let lease = cuda_lease::remote::BlockingLease::connect(builder, node.addr()).unwrap();
    let policy = cuda_async::RemotePolicy::new(&lease);
    let n = 64usize << 20;
    let bytes = random_bytes(n, 0x64);
    let dev = cuda_async::Device::new(0).unwrap();
    let pinned = cuda_async::PinnedBuffer::from_slice(&dev, &bytes).unwrap();
    // The kept buffer, made and set by earlier submissions.
    let kept = zeros::<u8>(n).sync_with(&policy).unwrap();
    let kept = memset(kept, 0xEE).sync_with(&policy).unwrap();
    let (b0, bulk0) = (
        batches(node).0,
        metric(&node.metrics_text(), "gpu_bulk_data_bytes_total").unwrap(),
    );
    let (_pinned, kept) = copy_h2d(pinned, kept).sync_with(&policy).unwrap();
    let msgs = batches(node).0 - b0;
    let bulk = metric(&node.metrics_text(), "gpu_bulk_data_bytes_total").unwrap() - bulk0;
    // One empty BATCH takes the copy's place in the lease's order.
    assert_eq!(msgs, 1, "the copy went in {msgs} BATCH messages");
    assert_eq!(bulk, n as u64, "bytes over the bulk-data channel");
    let back = d2h(kept).sync_with(&policy).unwrap();
    assert!(
        back.as_slice().unwrap() == &bytes[..],
        "the copy's bytes came back changed"
    );
    drop(lease);
    rt.block_on(fixture.shutdown());
}

/// A kernel that runs `ms` milliseconds (by the GPU's global timer), then
/// writes -3 over `out[0..n)`.
const SLOW_KERNEL: &str = r#"
extern "C" __global__ void slow_fill(unsigned ms, float* out, unsigned n) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    now = start;
    while (now - start < (unsigned long long)ms * 1000000ull) {
        __nanosleep(100000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    }
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        out[i] = -3.0f;
    }
}
"#;

/// A 5 s kernel writes a 16 MiB buffer; a small download and a 16 MiB
/// (data path) download of what it writes, submitted while it runs, wait
/// for it however long it takes and see its writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an NVIDIA GPU"]
async fn downloads_behind_a_five_second_kernel_see_its_writes() {
    use cuda_async::prelude::*;
    let fx = Fixture::with_config(gpu_config())
        .lease_with(Lease::builder().min_vram(256 << 20))
        .start()
        .await;
    let policy = fx.policy();
    let kernel = cuda_async::Module::cuda(SLOW_KERNEL, &[])
        .unwrap()
        .kernel("slow_fill")
        .unwrap();
    let n = 4usize << 20;
    let big = Arc::new(
        h2d(vec![1.0f32; n])
            .schedule(&policy)
            .unwrap()
            .await
            .unwrap(),
    );
    let small = Arc::new(
        h2d(vec![1.0f32; 16])
            .schedule(&policy)
            .unwrap()
            .await
            .unwrap(),
    );
    let t = std::time::Instant::now();
    let cfg = cuda_async::LaunchConfig {
        grid_dim: (132, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (b, s) = (big.clone(), small.clone());
    // SAFETY: `slow_fill` writes out[0..n) of an n-float buffer.
    let slow = unsafe { launch(&kernel, cfg, (5000u32, b, n as u32)) }
        .then({
            let kernel = kernel.clone();
            // SAFETY: as above, over the 16 floats of `small`.
            move |_| unsafe { launch(&kernel, cfg, (0u32, s, 16u32)) }
        })
        .schedule(&policy)
        .unwrap();
    let small_read = d2h(small.clone()).schedule(&policy).unwrap();
    let big_read = d2h(big.clone()).schedule(&policy).unwrap();
    let (slow, s, b) = tokio::join!(slow, small_read, big_read);
    slow.unwrap();
    let took = t.elapsed();
    assert!(took >= Duration::from_secs(5), "{took:?}");
    let s = s.expect("the small download").to_vec().unwrap();
    assert!(s.iter().all(|v| *v == -3.0), "the small download: {s:?}");
    let b = b.expect("the large download").to_vec().unwrap();
    assert!(
        b.iter().all(|v| *v == -3.0),
        "the large download ran before the kernel"
    );
    eprintln!("a 5 s kernel and two downloads behind it: {took:?}");
    fx.shutdown().await;
}

/// Two tokio tasks' independent 1 s kernels on one lease (4 streams) run
/// side by side on its GPU, as they do on two streams of a local pool: the
/// pair takes about as long as one kernel, not two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an NVIDIA GPU"]
async fn two_tasks_one_second_kernels_overlap_on_one_lease() {
    use cuda_async::prelude::*;
    let fx = Fixture::with_config(gpu_config())
        .lease_with(Lease::builder().min_vram(256 << 20))
        .start()
        .await;
    let policy = Arc::new(fx.policy());
    let kernel = cuda_async::Module::cuda(SLOW_KERNEL, &[])
        .unwrap()
        .kernel("slow_fill")
        .unwrap();
    let one = cuda_async::LaunchConfig::for_num_elems(1);
    let run = |ms: u32| {
        let (kernel, policy) = (kernel.clone(), policy.clone());
        async move {
            let out = h2d(vec![0.0f32; 1]).schedule(&*policy)?.await?;
            // SAFETY: `slow_fill` writes out[0..1) of a 1-float buffer.
            unsafe { launch(&kernel, one, (ms, out, 1u32)) }
                .schedule(&*policy)?
                .await
                .map(drop)
        }
    };
    // The module is compiled and loaded before the clock starts.
    run(0).await.unwrap();
    let t = std::time::Instant::now();
    run(1000).await.unwrap();
    let single = t.elapsed();
    let t = std::time::Instant::now();
    let (a, b) = tokio::join!(tokio::spawn(run(1000)), tokio::spawn(run(1000)));
    let pair = t.elapsed();
    a.unwrap().unwrap();
    b.unwrap().unwrap();
    eprintln!(
        "one 1 s kernel on a lease: {single:?}; two tasks' at once: {pair:?} ({:.2}x)",
        pair.as_secs_f64() / single.as_secs_f64()
    );
    assert!(
        pair.as_secs_f64() <= 1.1 * single.as_secs_f64(),
        "two tasks' 1 s kernels took {pair:?} on one lease, one took {single:?}: they did not overlap"
    );
    fx.shutdown().await;
}

/// Many tasks' pipelines that upload 1 MiB, run a kernel that overwrites
/// it after a millisecond, and download it (uploads and downloads on the
/// data path), all at once on one lease: every download sees its own
/// kernel's writes, whatever the other tasks' transfers do meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs an NVIDIA GPU"]
async fn many_tasks_streamed_pipelines_each_see_their_own_kernel() {
    use cuda_async::prelude::*;
    let fx = Fixture::with_config(gpu_config())
        .lease_with(Lease::builder().min_vram(1 << 30))
        .start()
        .await;
    let policy = Arc::new(fx.policy());
    let kernel = cuda_async::Module::cuda(SLOW_KERNEL, &[])
        .unwrap()
        .kernel("slow_fill")
        .unwrap();
    let n = 1usize << 18;
    let cfg = cuda_async::LaunchConfig {
        grid_dim: (132, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let tasks: Vec<_> = (0..32u32)
        .map(|t| {
            let (kernel, policy) = (kernel.clone(), policy.clone());
            tokio::spawn(async move {
                for round in 0..4u32 {
                    let up = vec![(t * 10 + round) as f32; n];
                    let k = kernel.clone();
                    let out = h2d(up)
                        // SAFETY: `slow_fill` writes out[0..n) of an n-float buffer.
                        .then(move |b| unsafe { launch(&k, cfg, (1u32, b, n as u32)) })
                        .then(|(_, b, _)| d2h(b))
                        .schedule(&*policy)
                        .unwrap()
                        .await
                        .unwrap()
                        .to_vec()
                        .unwrap();
                    let stale = out.iter().filter(|v| **v != -3.0).count();
                    assert_eq!(
                        stale, 0,
                        "task {t} round {round}: {stale} floats not written by its kernel"
                    );
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    fx.shutdown().await;
}
