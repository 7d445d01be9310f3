//! The op suite both backends run: each test takes the policy it runs
//! under, a local GPU's (`cuda-async/tests/gpu.rs`) or a leased GPU's
//! through an embedded node (`cuda-lease/node/tests/gpu.rs`), with the same
//! inputs and checks. Included by path from both test crates.

#![allow(dead_code, unreachable_pub)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use cuda_async::cudarc::driver::LaunchConfig;
use cuda_async::prelude::*;
use cuda_async::{Device, DeviceBuffer, Error, Kernel, Module, PinnedBuffer};

pub const KERNELS: &str = r#"
extern "C" __global__ void axpy(float a, const float* x, float* y, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
extern "C" __global__ void add_u32(unsigned* x, unsigned v, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += v;
}
extern "C" __global__ void copy_add(const float* src, float* dst, float v, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i] + v;
}
extern "C" __global__ void spin(unsigned long long ns, unsigned long long* stamps) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    t = t0;
    while (t - t0 < ns) { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); }
    if (threadIdx.x == 0 && blockIdx.x == 0) { stamps[0] = t0; stamps[1] = t; }
}
extern "C" __global__ void fault(int* p) {
    volatile int* bad = (volatile int*)(0x10ull);
    *bad = *p;
}
"#;

pub struct Kernels {
    pub axpy: Kernel,
    pub add_u32: Kernel,
    pub copy_add: Kernel,
    pub spin: Kernel,
    pub fault: Kernel,
}

pub fn dev() -> Device {
    Device::new(0).expect("a CUDA device")
}

pub fn kernels() -> Kernels {
    let m = Module::cuda(KERNELS, &[]).unwrap().named("gpu-tests.cu");
    Kernels {
        axpy: m.kernel("axpy").unwrap(),
        add_u32: m.kernel("add_u32").unwrap(),
        copy_add: m.kernel("copy_add").unwrap(),
        spin: m.kernel("spin").unwrap(),
        fault: m.kernel("fault").unwrap(),
    }
}

/// xorshift64*, seeded from the clock (the seed is printed for replay).
pub struct Rng(pub u64);
impl Rng {
    pub fn new() -> Self {
        let seed = std::env::var("GPU_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
                    | 1
            });
        eprintln!("GPU_TEST_SEED={seed}");
        Rng(seed)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn f32s(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 200.0 - 100.0)
            .collect()
    }
    pub fn u32s(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| (self.next() >> 32) as u32).collect()
    }
}

pub fn cfg(n: u32) -> LaunchConfig {
    LaunchConfig::for_num_elems(n.max(1))
}

/// Run by both backends' GPU tests.
pub fn h2d_d2h_round_trips_random_data_of_many_sizes(p: &dyn SchedulingPolicy) {
    let mut rng = Rng::new();
    for n in [0usize, 1, 7, 4096, 1_000_003] {
        let x = rng.f32s(n);
        let back = h2d(x.clone()).then(d2h).sync_with(p).unwrap();
        assert_eq!(back.as_slice().unwrap(), &x[..], "f32 n={n}");
        let u: Vec<u8> = rng.u32s(n).into_iter().map(|v| v as u8).collect();
        let back = h2d(u.as_slice())
            .then(d2h)
            .sync_with(p)
            .unwrap()
            .to_vec()
            .unwrap();
        assert_eq!(back, u, "u8 n={n}");
    }
}

/// Run by both backends' GPU tests.
pub fn zeros_memset_and_d2d_match_the_cpu(p: &dyn SchedulingPolicy) {
    let mut rng = Rng::new();
    let n = 10_001;
    // Poison first so unwritten elements would show.
    let z = h2d(vec![0xDEAD_BEEFu32; n])
        .then(|b| memset(b, 0))
        .then(d2h)
        .sync_with(p)
        .unwrap();
    assert!(z.as_slice().unwrap().iter().all(|&v| v == 0));
    let z = zeros::<u64>(n).then(d2h).sync_with(p).unwrap();
    assert!(z.as_slice().unwrap().iter().all(|&v| v == 0));
    let m = zeros::<u32>(n)
        .then(|b| memset(b, 0xAB))
        .then(d2h)
        .sync_with(p)
        .unwrap();
    assert!(m.as_slice().unwrap().iter().all(|&v| v == 0xABAB_ABAB));
    let x = rng.u32s(n);
    let src = h2d(x.clone()).sync_with(p).unwrap();
    let copy = d2d(&src).then(d2h).sync_with(p).unwrap();
    assert_eq!(copy.as_slice().unwrap(), &x[..]);
    let copy2 = d2d(Arc::new(src)).then(d2h).sync_with(p).unwrap();
    assert_eq!(copy2.to_vec().unwrap(), x);
}

/// Run by both backends' GPU tests.
pub fn pinned_copies_fill_poisoned_buffers_and_check_lengths(p: &dyn SchedulingPolicy) {
    let mut rng = Rng::new();
    let d = dev();
    let n = 65_537;
    let x = rng.f32s(n);
    let src = PinnedBuffer::from_slice(&d, &x).unwrap();
    let dst = zeros::<f32>(n).sync_with(p).unwrap();
    let poisoned = PinnedBuffer::filled(&d, n, f32::NAN).unwrap();
    let (_src, dev_buf) = copy_h2d(src, dst).sync_with(p).unwrap();
    let (_dev_buf, back) = copy_d2h(dev_buf, poisoned).sync_with(p).unwrap();
    assert_eq!(back.as_slice().unwrap(), &x[..]);

    let short = PinnedBuffer::filled(&d, n - 1, 0.0f32).unwrap();
    let buf = zeros::<f32>(n).sync_with(p).unwrap();
    let e = copy_d2h(buf, short).sync_with(p).unwrap_err();
    assert!(
        e.to_string()
            .contains("source has 65537 elements, destination 65536"),
        "{e}"
    );
}

/// Run by both backends' GPU tests.
pub fn launch_axpy_matches_the_cpu(p: &dyn SchedulingPolicy) {
    let k = kernels();
    let mut rng = Rng::new();
    let n = 1 << 20;
    let (x, y) = (rng.f32s(n), rng.f32s(n));
    let a = 2.5f32;
    let axpy = k.axpy.clone();
    let out = h2d(x.clone())
        .zip(h2d(y.clone()))
        // SAFETY: axpy touches x[0..n) and y[0..n); both have n elements.
        .then(move |(x, y)| unsafe { launch(&axpy, cfg(n as u32), (a, x, y, n as u32)) })
        .then(|(_, _, y, _)| d2h(y))
        .sync_with(p)
        .unwrap();
    let want: Vec<f32> = x.iter().zip(&y).map(|(x, y)| a.mul_add(*x, *y)).collect();
    assert_eq!(out.as_slice().unwrap(), &want[..]);
}

/// Run by both backends' GPU tests.
pub fn then_and_map_chain_ten_launches_in_order(p: &dyn SchedulingPolicy) {
    let k = kernels();
    let mut rng = Rng::new();
    let n = 4099u32;
    let x = rng.u32s(n as usize);
    let mut op: BoxedOp<'static, DeviceBuffer<u32>> = h2d(x.clone()).boxed();
    for step in 1..=10u32 {
        let add = k.add_u32.clone();
        // SAFETY: add_u32 touches x[0..n); the buffer has n elements.
        op = op
            .then(move |b| unsafe { launch(&add, cfg(n), (b, step, n)) })
            .map(|(b, _, _)| b)
            .boxed();
    }
    let out = op.then(d2h).sync_with(p).unwrap();
    let want: Vec<u32> = x.iter().map(|v| v.wrapping_add(55)).collect();
    assert_eq!(out.as_slice().unwrap(), &want[..]);
}

/// Run by both backends' GPU tests.
pub fn value_with_context_and_boxed_compose(p: &dyn SchedulingPolicy) {
    assert_eq!(value(20).map(|x| x * 2 + 2).sync_with(p).unwrap(), 42);
    let (remote, ord) =
        with_context(|ctx| value((ctx.is_remote(), ctx.device().map(|d| d.ordinal()).ok())))
            .sync_with(p)
            .unwrap();
    // A remote context has no local device; a local one is device 0.
    assert_eq!(ord, (!remote).then_some(0));
    let ops: Vec<BoxedOp<'static, u32>> = (0..5u32)
        .map(|i| value(i).map(move |v| v * v).boxed())
        .collect();
    assert_eq!(join_all(ops).sync_with(p).unwrap(), vec![0, 1, 4, 9, 16]);
}

pub fn spin_op(k: &Kernel, ns: u64) -> impl DeviceOp<Output = DeviceBuffer<u64>> {
    let spin = k.clone();
    // SAFETY: spin writes stamps[0..2); the buffer has 2 elements.
    zeros::<u64>(2)
        .then(move |s| unsafe { launch(&spin, cfg(1), (ns, s)) })
        .map(|(_, s)| s)
}

/// The two `%globaltimer` stamps a spin wrote.
pub fn stamps(p: &dyn SchedulingPolicy, b: DeviceBuffer<u64>) -> (u64, u64) {
    let v = d2h(b).sync_with(p).unwrap().to_vec().unwrap();
    (v[0], v[1])
}

/// Drains the local device (allocations made before a concurrency test
/// must not be waited on by its arms); a remote policy's blocking calls
/// return after the node drained its streams.
fn settle() {
    if let Ok(d) = Device::new(0) {
        d.context().synchronize().unwrap();
    }
}

/// Run by both backends' GPU tests.
pub fn zip_arms_run_concurrently_on_different_streams(p: &dyn SchedulingPolicy) {
    let k = kernels();
    // Warm up (module load, pool creation).
    let _ = spin_op(&k.spin, 1000)
        .zip(spin_op(&k.spin, 1000))
        .sync_with(p)
        .unwrap();
    let ms = 1_000_000;
    // The stamp buffers are allocated (and every stream drained) before the
    // zips, so the arms only launch: an allocation inside an arm can be made
    // to wait on another stream by the memory pool when it reuses a block
    // freed there (its internal dependencies), which is not what this tests.
    let spin_on = |b: DeviceBuffer<u64>| {
        let spin = k.spin.clone();
        // SAFETY: spin writes stamps[0..2); the buffer has 2 elements.
        unsafe { launch(&spin, cfg(1), (ms, b)) }.map(|(_, b)| b)
    };
    let fresh = |n: usize| -> Vec<DeviceBuffer<u64>> {
        let v: Vec<_> = (0..n)
            .map(|_| zeros::<u64>(2).sync_with(p).unwrap())
            .collect();
        settle();
        v
    };
    let mut bufs = fresh(2).into_iter();
    let (a, b) = (bufs.next().unwrap(), bufs.next().unwrap());
    let t = Instant::now();
    let (a, b) = spin_on(a).zip(spin_on(b)).sync_with(p).unwrap();
    let wall = t.elapsed();
    let ((a0, a1), (b0, b1)) = (stamps(p, a), stamps(p, b));
    eprintln!(
        "zip of two 1 ms spins: {wall:?}; arm intervals overlap by {} us",
        (a1.min(b1) as i64 - a0.max(b0) as i64) / 1000
    );
    // The GPU's own clock shows the two kernels running at the same time.
    assert!(
        a0 < b1 && b0 < a1,
        "arms did not overlap: a=[{a0},{a1}] b=[{b0},{b1}]"
    );
    assert!(a1 - a0 >= ms && b1 - b0 >= ms);

    // Four arms of zip_all, all overlapping with the first.
    let mut bufs = fresh(4).into_iter();
    let mut next = || spin_on(bufs.next().unwrap());
    let (r0, r1, r2, r3) = zip_all((next(), next(), next(), next()))
        .sync_with(p)
        .unwrap();
    let iv: Vec<(u64, u64)> = [r0, r1, r2, r3].into_iter().map(|b| stamps(p, b)).collect();
    for (i, w) in iv.iter().enumerate().skip(1) {
        assert!(
            w.0 < iv[0].1 && iv[0].0 < w.1,
            "arm {i} did not overlap arm 0: {iv:?}"
        );
    }
}

/// Run by both backends' GPU tests.
pub fn join_all_is_concurrent_and_ordered(p: &dyn SchedulingPolicy) {
    let k = kernels();
    let mut rng = Rng::new();
    let inputs: Vec<Vec<u32>> = (0..16).map(|i| rng.u32s(1000 + i)).collect();
    let ops: Vec<_> = inputs
        .iter()
        .enumerate()
        .map(|(i, x)| {
            let add = k.add_u32.clone();
            let n = x.len() as u32;
            h2d(x.clone())
                // SAFETY: add_u32 touches x[0..n); the buffer has n elements.
                .then(move |b| unsafe { launch(&add, cfg(n), (b, i as u32, n)) })
                .then(|(b, _, _)| d2h(b))
        })
        .collect();
    let outs = join_all(ops).sync_with(p).unwrap();
    for (i, (x, o)) in inputs.iter().zip(&outs).enumerate() {
        let want: Vec<u32> = x.iter().map(|v| v.wrapping_add(i as u32)).collect();
        assert_eq!(o.as_slice().unwrap(), &want[..], "arm {i}");
    }
    // Buffers first, streams drained: arms that only launch (see the zip test).
    let bufs: Vec<_> = (0..3)
        .map(|_| zeros::<u64>(2).sync_with(p).unwrap())
        .collect();
    settle();
    let arms = bufs
        .into_iter()
        .map(|b| {
            let spin = k.spin.clone();
            // SAFETY: spin writes stamps[0..2); the buffer has 2 elements.
            unsafe { launch(&spin, cfg(1), (1_000_000u64, b)) }.map(|(_, b)| b)
        })
        .collect();
    let iv: Vec<(u64, u64)> = join_all(arms)
        .sync_with(p)
        .unwrap()
        .into_iter()
        .map(|b| stamps(p, b))
        .collect();
    // Every pair overlaps, both ways: each arm starts before the other ends
    // (arms run one after another, in any order, fail this).
    for (i, a) in iv.iter().enumerate() {
        for (j, b) in iv.iter().enumerate().skip(i + 1) {
            assert!(
                a.0 < b.1 && b.0 < a.1,
                "join_all arms {i} and {j} did not overlap: {iv:?}"
            );
        }
    }
}

/// Run by both backends' GPU tests.
pub fn shared_runs_once_and_consumers_on_other_streams_see_its_result(p: &dyn SchedulingPolicy) {
    let k = kernels();
    let mut rng = Rng::new();
    let n = 1 << 18;
    let x = rng.f32s(n);
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let spin = k.spin.clone();
    let ca = k.copy_add.clone();
    // The producer spins 2 ms before writing, so a consumer that did not wait
    // for it would read the zeros.
    let producer = zeros::<u64>(2)
        // SAFETY: spin writes stamps[0..2) of a 2-element buffer.
        .then(move |s| unsafe { launch(&spin, cfg(1), (2_000_000u64, s)) })
        .then(move |_| h2d(x.clone()).map(move |b| (b, x)))
        .map(move |(b, x)| {
            r.fetch_add(1, Ordering::SeqCst);
            (Arc::new(b), Arc::new(x))
        })
        .shared();
    let consumer = |v: f32| {
        let ca = ca.clone();
        producer.clone().then(move |(src, x)| {
            // SAFETY: copy_add reads src[0..n) and writes dst[0..n); both have n elements.
            zeros::<f32>(n)
                .then(move |dst| unsafe { launch(&ca, cfg(n as u32), (src, dst, v, n as u32)) })
                .then(|(_, dst, _, _)| d2h(dst))
                .map(move |h| (h, x))
        })
    };
    let ((h1, x1), (h2, x2)) = consumer(1.0).zip(consumer(2.0)).sync_with(p).unwrap();
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the shared op ran more than once"
    );
    let w1: Vec<f32> = x1.iter().map(|v| v + 1.0).collect();
    let w2: Vec<f32> = x2.iter().map(|v| v + 2.0).collect();
    assert_eq!(h1.as_slice().unwrap(), &w1[..]);
    assert_eq!(h2.as_slice().unwrap(), &w2[..]);
}

/// Run by both backends' GPU tests. Remotely the node checks the argument
/// list (against the PTX it compiled) and answers with the same detail.
pub fn run_time_argument_lists_launch_with_offsets_and_are_checked(p: &dyn SchedulingPolicy) {
    use cuda_async::{DynArg, DynArgs};
    let k = kernels();
    // add_u32(x, v, n) on bytes 16.. of a 64-byte buffer: elements 4..8 += 5.
    let buf = zeros::<u8>(64).sync_with(p).unwrap();
    let args = DynArgs::new(vec![
        DynArg::Buffer {
            buffer: &buf,
            offset: 16,
        },
        DynArg::Bytes(5u32.to_le_bytes().to_vec()),
        DynArg::Bytes(4u32.to_le_bytes().to_vec()),
    ])
    .unwrap();
    // SAFETY: 4 elements of u32 at byte offset 16 of a 64-byte buffer.
    unsafe { launch(&k.add_u32, cfg(4), args) }
        .sync_with(p)
        .unwrap();
    let out = d2h(&buf).sync_with(p).unwrap().to_vec().unwrap();
    let words: Vec<u32> = out
        .chunks(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(words, [0, 0, 0, 0, 5, 5, 5, 5, 0, 0, 0, 0, 0, 0, 0, 0]);
    // A wrong size or count is refused before anything is launched.
    let bad = DynArgs::new(vec![
        DynArg::Buffer {
            buffer: &buf,
            offset: 0,
        },
        DynArg::Bytes(vec![5]),
        DynArg::Bytes(4u32.to_le_bytes().to_vec()),
    ])
    .unwrap();
    // SAFETY: never launched: the check rejects it.
    let e = unsafe { launch(&k.add_u32, cfg(4), bad) }
        .sync_with(p)
        .unwrap_err();
    // (Remotely the node refuses the launch command: the same words, as a
    // refused request of the lease.)
    assert!(
        matches!(
            e,
            Error::ArgumentMismatch { .. } | Error::InvalidArgument(_)
        ) || e.remote_kind() == Some(cuda_async::RemoteErrorKind::InvalidRequest),
        "{e}"
    );
    assert!(e.to_string().contains("add_u32"), "{e}");
    assert!(e.to_string().contains("argument 1"), "{e}");
    let short = DynArgs::new(vec![DynArg::Buffer {
        buffer: &buf,
        offset: 0,
    }])
    .unwrap();
    // SAFETY: never launched: the check rejects it.
    let e = unsafe { launch(&k.add_u32, cfg(4), short) }
        .sync_with(p)
        .unwrap_err();
    assert!(e.to_string().contains("3 argument(s), 1 given"), "{e}");
    assert!(DynArgs::new(vec![DynArg::Buffer {
        buffer: &buf,
        offset: 65
    }])
    .is_err());
}

/// Run by both backends' GPU tests: 64 tokio tasks share `p`.
pub fn tokio_64_tasks_x_1000_awaited_ops_are_all_correct(p: Arc<dyn SchedulingPolicy>) {
    let k = kernels();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    let t = Instant::now();
    rt.block_on(async {
        let mut tasks = Vec::new();
        for task in 0..64u32 {
            let add = k.add_u32.clone();
            let p = p.clone();
            tasks.push(tokio::spawn(async move {
                let mut counter = h2d(vec![task * 1_000_000]).schedule(&*p)?.await?;
                for i in 0..1000u32 {
                    // SAFETY: add_u32 touches counter[0..1) of a 1-element buffer.
                    let (c, _, _) = unsafe { launch(&add, cfg(1), (counter, 1u32, 1u32)) }
                        .schedule(&*p)?
                        .await?;
                    counter = c;
                    if i % 250 == 249 {
                        let v = d2h(&counter).schedule(&*p)?.await?.to_vec()?;
                        assert_eq!(v[0], task * 1_000_000 + i + 1, "task {task} op {i}");
                    }
                }
                let v = d2h(counter).schedule(&*p)?.await?.to_vec()?;
                Ok::<u32, Error>(v[0])
            }));
        }
        for (task, h) in tasks.into_iter().enumerate() {
            assert_eq!(h.await.unwrap().unwrap(), task as u32 * 1_000_000 + 1000);
        }
    });
    let dt = t.elapsed();
    eprintln!(
        "64 tasks x 1000 awaited launches (+ checks): {dt:?}, {:.0} ops/s",
        64_000.0 / dt.as_secs_f64()
    );
}

/// The typed launchers `kernels!` generates for `tests/kernels/typed.cu`.
/// Each test crate that includes the suite defines them (`kernels!` paths
/// are relative to the calling crate's directory).
pub(crate) use crate::suite_kernels::typed;

/// Four kernels of a `.cu` file launched through their generated typed
/// functions (a saxpy, a block reduction with dynamic shared memory, a 2-D
/// transpose, and one with three inputs of three types and scalars),
/// checked against the CPU on random data.
pub fn typed_launchers_match_the_cpu_on_random_data(p: &dyn SchedulingPolicy) {
    let mut rng = Rng::new();
    // saxpy
    let n = 10_007usize;
    let (x, y) = (rng.f32s(n), rng.f32s(n));
    // NVRTC contracts `a * x[i] + y[i]` into one fused multiply-add.
    let want: Vec<f32> = x
        .iter()
        .zip(&y)
        .map(|(x, y)| 1.5f32.mul_add(*x, *y))
        .collect();
    let got = h2d(x.clone())
        .zip(h2d(y))
        // SAFETY: saxpy touches x[0..n) and y[0..n); both hold n floats.
        .then(move |(x, y)| unsafe { typed::saxpy(cfg(n as u32), 1.5, x, y, n as i32) })
        .then(|(_, _, y, _)| d2h(y))
        .sync_with(p)
        .unwrap();
    assert_eq!(got.to_vec().unwrap(), want, "saxpy");

    // block_sums: 256-thread blocks, one partial sum each.
    let threads = 256u32;
    let blocks = (n as u32).div_ceil(threads);
    let sums_cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: threads * 4,
    };
    let got = h2d(x.clone())
        .zip(zeros::<f32>(blocks as usize))
        // SAFETY: reads x[0..n), writes partial[0..blocks), uses
        // blockDim.x floats of shared memory (given).
        .then(move |(x, partial)| unsafe { typed::block_sums(sums_cfg, x, partial, n as u32) })
        .then(|(_, partial, _)| d2h(partial))
        .sync_with(p)
        .unwrap()
        .to_vec()
        .unwrap();
    for (b, got) in got.iter().enumerate() {
        let lo = b * threads as usize;
        let want: f32 = x[lo..(lo + threads as usize).min(n)].iter().sum();
        assert!(
            (got - want).abs() <= 1e-3 * want.abs().max(1.0),
            "block {b}: {got} vs {want}"
        );
    }

    // transpose on a 2-D grid of 16x16 blocks.
    let (rows, cols) = (37usize, 53usize);
    let m = rng.f32s(rows * cols);
    let t_cfg = LaunchConfig {
        grid_dim: ((cols as u32).div_ceil(16), (rows as u32).div_ceil(16), 1),
        block_dim: (16, 16, 1),
        shared_mem_bytes: 0,
    };
    let got = h2d(m.clone())
        .zip(zeros::<f32>(rows * cols))
        // SAFETY: in and out hold rows * cols floats; the kernel checks r, c.
        .then(move |(a, out)| unsafe { typed::transpose(t_cfg, a, out, rows as i32, cols as i32) })
        .then(|(_, out, _, _)| d2h(out))
        .sync_with(p)
        .unwrap()
        .to_vec()
        .unwrap();
    for r in 0..rows {
        for c in 0..cols {
            assert_eq!(got[c * rows + r], m[r * cols + c], "transpose ({r}, {c})");
        }
    }

    // blend: f32, f64 and i32 inputs, f32 and f64 scalars, a u64 length.
    let a = rng.f32s(n);
    let b: Vec<f64> = rng.f32s(n).into_iter().map(f64::from).collect();
    let mask: Vec<i32> = rng
        .u32s(n)
        .into_iter()
        .map(|v| (v % 3 != 0) as i32)
        .collect();
    let (wa, wb) = (0.75f32, -2.5f64);
    let want: Vec<f32> = (0..n)
        .map(|i| {
            if mask[i] != 0 {
                (f64::from(wa) * f64::from(a[i]) + wb * b[i]) as f32
            } else {
                0.0
            }
        })
        .collect();
    let got = h2d(a)
        .map(Arc::new)
        .zip(h2d(b))
        .zip(h2d(mask))
        .zip(zeros::<f32>(n))
        // SAFETY: every buffer holds n elements; the kernel checks i < n.
        .then(move |(((a, b), mask), out)| unsafe {
            typed::blend(cfg(n as u32), a, b, mask, out, wa, wb, n as u64)
        })
        .then(|(_, _, _, out, _, _, _)| d2h(out))
        .sync_with(p)
        .unwrap()
        .to_vec()
        .unwrap();
    for i in 0..n {
        assert!(
            (got[i] - want[i]).abs() <= 1e-5 * want[i].abs().max(1.0),
            "blend {i}: {} vs {}",
            got[i],
            want[i]
        );
    }
}

/// `zip!` of four arms, each a 5 ms spin through the typed launcher: the
/// GPU's clock shows all four running at once.
pub fn zip_macro_of_four_typed_spins_overlaps_on_the_gpu(p: &dyn SchedulingPolicy) {
    // SAFETY: spin_stamp writes stamps[0..2); each buffer has 2 elements.
    let spin =
        |s: DeviceBuffer<u64>, ns: u64| unsafe { typed::spin_stamp(cfg(1), s, ns) }.map(|(s, _)| s);
    // The stamp buffers are allocated (and the device drained) before the
    // zips, so the arms only launch (see the zip test above).
    let fresh = || -> Vec<DeviceBuffer<u64>> {
        let v = (0..4)
            .map(|_| zeros::<u64>(2).sync_with(p).unwrap())
            .collect();
        settle();
        v
    };
    let zip4 = |ns: u64| {
        let mut bufs = fresh().into_iter();
        let mut next = || bufs.next().expect("four buffers");
        let (a, b, c, d) = (next(), next(), next(), next());
        cuda_async::zip!(spin(a, ns), spin(b, ns), spin(c, ns), spin(d, ns))
            .sync_with(p)
            .unwrap()
    };
    // Warm up (module load, streams).
    let _ = zip4(1000);
    let (a, b, c, d) = zip4(5_000_000);
    let s: Vec<(u64, u64)> = [a, b, c, d].into_iter().map(|x| stamps(p, x)).collect();
    let last_start = s.iter().map(|x| x.0).max().unwrap();
    let first_end = s.iter().map(|x| x.1).min().unwrap();
    eprintln!(
        "zip! of four 5 ms spins: all four ran together for {} us",
        (first_end as i64 - last_start as i64) / 1000
    );
    assert!(
        last_start < first_end,
        "the four arms did not all overlap: {s:?}"
    );
}

/// `timed` measures a 1 ms spin within 10 % (its own `%globaltimer`
/// stamps are the reference), and a zip of two overlapping 1 ms spins as
/// one span that covers both arms. On a leased GPU the node times it.
pub fn timed_measures_a_one_ms_spin_on_the_gpu_within_ten_percent(p: &dyn SchedulingPolicy) {
    use std::time::Duration;
    let k = kernels();
    let ms = 1_000_000u64;
    // Warm up (module load, pools).
    let _ = spin_op(&k.spin, 1000).timed().sync_with(p).unwrap();
    // A 20 ms spin first keeps the GPU busy while the timed op is
    // enqueued, so the span holds GPU work alone: a host thread held up
    // between the timer's start and the spin's launch (a worker preempted
    // on a loaded host, for a scheduler's time slice of a few ms) would
    // otherwise count as the GPU's idle time.
    let timed_spin = k.spin.clone();
    let (lead, (s, t)) = spin_op(&k.spin, 20 * ms)
        .then(move |lead| spin_op(&timed_spin, ms).timed().map(|st| (lead, st)))
        .sync_with(p)
        .unwrap();
    drop(lead);
    let (start, end) = stamps(p, s);
    let spun = Duration::from_nanos(end - start);
    let timed = t.elapsed().unwrap();
    println!("1 ms spin: timed {timed:?}, its own stamps {spun:?}");
    assert!(spun >= Duration::from_millis(1));
    let ratio = timed.as_secs_f64() / spun.as_secs_f64();
    // A sanitizer instruments the op's other work (its memset): there the
    // time may only be longer.
    let sanitized = std::env::var("CUDA_ASYNC_TEST_SANITIZER").is_ok_and(|t| !t.is_empty());
    let ok = if sanitized {
        ratio >= 0.9
    } else {
        (0.9..=1.1).contains(&ratio)
    };
    assert!(ok, "timed {timed:?} vs spun {spun:?}");
    // Two arms forked onto other streams join back before the end.
    let ((a, b), t) = spin_op(&k.spin, ms)
        .zip(spin_op(&k.spin, ms))
        .timed()
        .sync_with(p)
        .unwrap();
    let ((a0, a1), (b0, b1)) = (stamps(p, a), stamps(p, b));
    let span = Duration::from_nanos(a1.max(b1) - a0.min(b0));
    let timed = t.elapsed().unwrap();
    println!("zip of two 1 ms spins: timed {timed:?}, the arms' span {span:?}");
    assert!(
        timed >= span.mul_f64(0.9),
        "timed {timed:?} vs span {span:?}"
    );
}
