//! CUDA C compiled on the node: random data, streams that overlap, buffers
//! ordered across streams, the confined compiler.

use super::*;

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
    // The node's path: the node keeps the PTX for its other leases.
    let fx = Fixture::with_config(gpu_node_path_config())
        .lease_with(Lease::builder().min_vram(64 << 20))
        .start()
        .await;
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
                               // The node counts the compile, whichever path the lease takes (a
                               // query has the node ask a direct lease's worker).
    fx.lease().query().await.unwrap();
    let compiled = metric(&fx.node.metrics_text(), "gpu_modules_compiled_total");
    assert_eq!(compiled, Some(1), "the node's count of compiles");
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
