//! The op suite of `cuda-async`, run over a lease of this GPU.

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
    let policy = cuda_async::RemotePolicy::new(backend.lease.as_ref().unwrap()).with_mem_pool(pool);
    let e = policy.select().unwrap_err();
    assert!(
        matches!(&e, cuda_async::Error::InvalidArgument(m) if m.contains("GPU 0") && m.contains("lease")),
        "{e}"
    );
}

/// A random fill on a lease runs by the node's cuRAND and gives the same
/// bits as the same fill locally on this GPU (Philox restarted at the
/// seed): f32 uniform, f64 normal; a fill inside a remote
/// capture is refused by name, as locally.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_random_fill_on_a_lease_matches_the_local_one_bit_for_bit() {
    use cuda_async::prelude::*;
    use cuda_async::rand::{normal, uniform};
    let backend = RemoteBackend::start();
    let remote = &backend.policy;
    let local =
        cuda_async::StreamPoolRoundRobin::new(&cuda_async::Device::new(0).unwrap(), 2).unwrap();
    let uniform_op = || zeros::<f32>(4096).then(|x| uniform(11, x)).then(d2h);
    let here = uniform_op().sync_with(&local).unwrap().to_vec().unwrap();
    let there = uniform_op().sync_with(remote).unwrap().to_vec().unwrap();
    assert!(here.iter().all(|v| *v > 0.0 && *v <= 1.0));
    assert_eq!(
        here.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        there.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        "f32 uniform"
    );
    let normal_op = || {
        zeros::<f64>(10_000)
            .then(|x| normal(5, 1.0, 2.0, x))
            .then(d2h)
    };
    let here = normal_op().sync_with(&local).unwrap().to_vec().unwrap();
    let there = normal_op().sync_with(remote).unwrap().to_vec().unwrap();
    assert_eq!(
        here.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        there.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        "f64 normal"
    );
    let e = zeros::<f32>(64)
        .then(|x| uniform(1, x))
        .graph_with(remote)
        .unwrap_err();
    assert!(
        matches!(&e, cuda_async::Error::Capture(m) if m.contains("cuRAND")),
        "{e}"
    );
}

/// A GEMM on a lease runs by the node's cuBLAS and gives the same bits
/// as the same call locally on this GPU: f32 with transposes, alpha and
/// beta, an f64 strided batch, a bf16 product, and a product inside a
/// remote graph.
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
    use cuda_async::half::bf16;
    let g = Gemm::<bf16>::new(64, 48, 80).alpha(bf16::from_f32(0.5));
    let half = |n, seed| -> Vec<bf16> {
        random_f32(n, seed)
            .into_iter()
            .map(bf16::from_f32)
            .collect()
    };
    let (av, bv) = (half(64 * 80, 8), half(80 * 48, 9));
    let op = || {
        let (a, b) = (av.clone(), bv.clone());
        h2d(a)
            .zip(h2d(b))
            .zip(zeros::<bf16>(64 * 48))
            .then(move |((a, b), c)| gemm(g, a, b, c))
            .then(|(_, _, c)| d2h(c))
    };
    let here = op().sync_with(&local).unwrap().to_vec().unwrap();
    let there = op().sync_with(remote).unwrap().to_vec().unwrap();
    assert!(here.iter().any(|v| v.to_f32() != 0.0));
    assert_eq!(
        here.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        there.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        "bf16"
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
    let node = &backend.fixture.as_ref().unwrap().node;
    let sent = batches(node).0;
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
    // The buffer's free waits for the spin's reply: a free sent at the
    // drop would be a second message. (A window for it to show, not a
    // wait for anything.)
    std::thread::sleep(std::time::Duration::from_millis(100));
    let during = batches(node).0;
    assert!(
        during <= sent + 1,
        "freed while the GPU work was queued: {} messages after the submission's",
        during - sent - 1
    );
    // After the spin, the queued frees run (the lease's figures are its
    // worker's at its last answered batch).
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
    let backend =
        RemoteBackend::start_with(|b| b.ttl(std::time::Duration::from_secs(1)).auto_renew(false));
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

/// Prepared bodies' page-locked staging stays within the worker's cap
/// (64 MiB): a body of 40 MiB of uploads is staged, a second one would
/// pass the cap and is not (it runs by replaying its commands); both run
/// right, and the node reports the staging kept.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn prepared_staging_stays_within_the_workers_cap() {
    use cuda_async::prelude::*;
    let backend = RemoteBackend::start();
    let remote = &backend.policy;
    let k = suite::kernels();
    let n = 10 << 20; // 40 MiB of f32
    let m = 16u32;
    // y[0..16) = 0.5 x[0..16), downloaded; x is uploaded whole.
    let op = move |x: Vec<f32>| {
        let axpy = k.axpy.clone();
        h2d(x)
            .zip(zeros::<f32>(m as usize))
            // SAFETY: axpy touches x[0..m) and y[0..m); x holds n >= m
            // floats, y m.
            .then(move |(x, y)| unsafe { launch(&axpy, suite::cfg(m), (0.5f32, x, y, m)) })
            .then(|(_, _, y, _)| d2h(y))
    };
    let input = |seed: f32| {
        (0..n)
            .map(|i| seed + (i % 977) as f32)
            .collect::<Vec<f32>>()
    };
    let want = |x: &[f32]| {
        x[..m as usize]
            .iter()
            .map(|v| 0.5 * v)
            .collect::<Vec<f32>>()
    };
    let lease = backend.lease.as_ref().unwrap().lease();
    let node = &backend.fixture.as_ref().unwrap().node;
    // What the worker keeps once `graphs` prepared bodies are settled (a
    // query first: on a direct lease it has the node ask the worker).
    let staging = |graphs: usize| {
        backend.rt.block_on(lease.query()).unwrap();
        let u = node.lease_usage(&lease.id()).unwrap();
        assert_eq!(u.graphs, graphs, "{u:?}");
        u.staging
    };
    let a = op(vec![0.0; n]).prepare().sync_with(remote).unwrap();
    assert_eq!(a.inputs(), [4 * n as u64]);
    let one = staging(1);
    assert!(
        one >= 4 * n as u64,
        "a body of 40 MiB of uploads kept {one} bytes"
    );
    let b = op(vec![0.0; n]).prepare().sync_with(remote).unwrap();
    // The second body's staging would pass 64 MiB: it is not kept.
    let two = staging(2);
    assert!(two <= 64 << 20, "prepared staging grew to {two} bytes");
    assert_eq!(two, one);
    for (i, p) in [&b, &a, &b].into_iter().enumerate() {
        let x = input(i as f32);
        let out = p.run(&[&x[..]]).unwrap().sync_with(remote).unwrap();
        assert_eq!(out.to_vec::<f32>(0).unwrap(), want(&x), "run {i}");
    }
    assert_eq!(staging(2), one);
}

/// A prepared submission of two uploads, two arms on two streams, a join
/// and a download runs with new inputs bit-identical to the same op run
/// eagerly on this GPU, from one thread and from four at once (the runs
/// share the body's buffers: each must see its own inputs).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_prepared_submission_runs_with_new_inputs_bit_identical_to_eager_runs() {
    use cuda_async::prelude::*;
    let backend = RemoteBackend::start();
    let remote = cuda_async::RemotePolicy::new(backend.lease.as_ref().unwrap()).with_streams(2);
    let local = cuda_async::default_policy().unwrap();
    let k = suite::kernels();
    let n = 1 << 14;
    let m = n as u32;
    // y1 = 1.5 x1, y2 = -0.5 x2, then y2 = 2 y1 + y2; y2 downloaded.
    let op = move |a: Vec<f32>, b: Vec<f32>| {
        let (ka, kb, kc) = (k.axpy.clone(), k.axpy.clone(), k.axpy.clone());
        h2d(a)
            .zip(h2d(b))
            .zip(zeros::<f32>(n).zip(zeros::<f32>(n)))
            .then(move |((x1, x2), (y1, y2))| {
                // SAFETY: axpy touches x and y [0..m); all hold m floats.
                let arm1 = unsafe { launch(&ka, suite::cfg(m), (1.5f32, x1, y1, m)) };
                // SAFETY: as above.
                let arm2 = unsafe { launch(&kb, suite::cfg(m), (-0.5f32, x2, y2, m)) };
                arm1.zip(arm2)
            })
            // SAFETY: as above.
            .then(move |((_, _, y1, _), (_, _, y2, _))| unsafe {
                launch(&kc, suite::cfg(m), (2.0f32, y1, y2, m))
            })
            .then(|(_, _, y2, _)| d2h(y2))
    };
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let prepared = op(vec![0.0; n], vec![0.0; n])
        .prepare()
        .sync_with(&remote)
        .unwrap();
    assert_eq!(prepared.inputs(), [4 * n as u64, 4 * n as u64]);
    assert_eq!(prepared.outputs(), [4 * n as u64]);
    let mut rng = suite::Rng::new();
    let cases: Vec<(Vec<f32>, Vec<f32>)> = (0..12).map(|_| (rng.f32s(n), rng.f32s(n))).collect();
    let want: Vec<Vec<u32>> = cases
        .iter()
        .map(|(a, b)| {
            let y = op(a.clone(), b.clone()).sync_with(&*local).unwrap();
            bits(&y.to_vec().unwrap())
        })
        .collect();
    assert!(want[0] != want[1]);
    let run = |i: usize| {
        let (a, b) = &cases[i];
        let out = prepared
            .run(&[&a[..], &b[..]])
            .unwrap()
            .sync_with(&remote)
            .unwrap();
        assert!(bits(&out.to_vec::<f32>(0).unwrap()) == want[i], "run {i}");
    };
    for i in 0..4 {
        let t = std::time::Instant::now();
        run(i);
        eprintln!("prepared run {i}, awaited: {:?}", t.elapsed());
    }
    // Five runs in one submission: on a GPU node each of the first four
    // finds the instances before it taken and captures another (at most
    // four), and the fifth replays one by one; each gets its own outputs.
    let one = |i: usize| prepared.run(&[&cases[i].0[..], &cases[i].1[..]]).unwrap();
    let ((((o0, o1), o2), o3), o4) = one(0)
        .zip(one(1))
        .zip(one(2))
        .zip(one(3))
        .zip(one(4))
        .sync_with(&remote)
        .unwrap();
    for (i, o) in [o0, o1, o2, o3, o4].iter().enumerate() {
        assert!(
            bits(&o.to_vec::<f32>(0).unwrap()) == want[i],
            "zipped run {i}"
        );
    }
    std::thread::scope(|s| {
        for t in 0..4 {
            let run = &run;
            s.spawn(move || {
                for r in 0..2 {
                    run(4 + 2 * t + r);
                }
            });
        }
    });
}
