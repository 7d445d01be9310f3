//! Good pipelines after failures, the data path, and a lease that runs like
//! a stream pool.

use super::*;

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
    let fixture = rt.block_on(Fixture::with_config(gpu_node_path_config()).start());
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

/// A graph replayed on stream 0 right after a kernel that writes the
/// graph's input on another stream, in the same batch, waits for that
/// kernel: the worker orders the replay after its buffers' uses on other
/// streams (on stream 0 itself, the stream's order does).
#[tokio::test]
#[ignore = "needs an NVIDIA GPU"]
async fn a_graph_replay_waits_for_its_input_written_on_another_stream() {
    let fx = gpu_lease(64 << 20).await;
    let s = fx.session();
    let slow = ModuleSpec::cuda(SLOW_KERNEL, &[]);
    let m = ModuleSpec::ptx(TEST_KERNELS);
    let n: u32 = 4096;
    let bytes = u64::from(n) * 4;
    let mem = LaunchArg::mem;
    let ones = f32_bytes(&vec![1.0; n as usize]);
    // The graph: y = x + x.
    let mut rec = s.recorder();
    let x = rec.alloc(0, bytes);
    let y = rec.alloc(0, bytes);
    rec.write(0, x, 0, &ones);
    let g = rec.graph_begin(0);
    rec.launch(
        0,
        &m,
        "vadd",
        [grid_for(n), 1, 1],
        [BLOCK, 1, 1],
        vec![mem(x), mem(x), mem(y), LaunchArg::u32(n)],
    );
    rec.graph_end(0, g);
    rec.submit().await.unwrap().ok().unwrap();
    for writer in [1, 2, 0] {
        // x = 1, then (on `writer`) 50 ms later x = -3, then the replay on
        // stream 0 and the download of y: y = -6 once the replay waits.
        let mut rec = s.recorder();
        rec.write(0, x, 0, &ones);
        rec.launch(
            writer,
            &slow,
            "slow_fill",
            [8, 1, 1],
            [256, 1, 1],
            vec![LaunchArg::u32(50), mem(x), LaunchArg::u32(n)],
        );
        rec.graph_launch(0, g);
        let r = rec.read(0, y, 0, bytes as u32);
        let out = rec.submit().await.unwrap().ok().unwrap();
        let got = bytes_f32(out.read(r).unwrap());
        let early = got.iter().filter(|v| **v != -6.0).count();
        assert_eq!(
            early, 0,
            "x written on stream {writer}: the replay read it early (y[0] = {})",
            got[0]
        );
    }
    fx.shutdown().await;
}

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
