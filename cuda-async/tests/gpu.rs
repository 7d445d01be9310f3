//! GPU tests: every op and combinator against a CPU reference on fresh
//! random inputs, concurrency of `zip`, the cancellation invariants, a
//! sticky fault, and interop. Run on a GPU host with
//! `cargo test -p cuda-async --test gpu -- --include-ignored`
//! (or from the bundle: `scripts/gpu-bundle`).
//!
//! The ops and combinators tests live in `suite/mod.rs`, parameterised by
//! the policy: this file runs them on the local GPU and
//! `cuda-lease/node/tests/gpu.rs` runs the same functions on a leased GPU. The
//! tests kept here are local by nature: device inventory, NVRTC compiles and
//! their cache in this process, interop with a cudarc stream, the stream
//! gate used to hold local work in flight while a future is dropped or
//! forgotten, DMA into pinned memory, cross-stream frees of a local buffer,
//! upload staging, and a sticky fault of this process's context (the remote
//! counterparts are in `cuda-lease/tests`: drops in flight, expiry, faults).

use std::future::{Future, IntoFuture};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_async::cudarc::driver::{sys, CudaStream, LaunchConfig};
use cuda_async::prelude::*;
use cuda_async::{Device, Error, Module, PinnedBuffer};

mod blas;
mod fft;
mod graph;
mod rand;
mod suite;

/// The suite's typed launchers (`suite::typed`).
mod suite_kernels {
    pub(crate) mod typed {
        cuda_async::kernels!("tests/kernels/typed.cu");
    }
}

use suite::{cfg, dev, Kernels, Rng, KERNELS};

/// The local backend: the default device's round-robin policy.
fn local() -> Arc<StreamPoolRoundRobin> {
    cuda_async::default_policy().expect("a CUDA device")
}

fn kernels() -> Kernels {
    let k = suite::kernels();
    k.axpy.module().load_on(&dev()).expect("kernels compile");
    k
}

const GPU: &str = "needs an NVIDIA GPU";

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn inventory_reports_the_device() {
    let _ = GPU;
    let all = cuda_async::devices().unwrap();
    assert!(!all.is_empty());
    let d = &all[0];
    assert!(!d.name.is_empty() && d.total_memory > 0 && d.free_memory <= d.total_memory);
    assert!(d.compute_capability.0 >= 5, "{d:?}");
    eprintln!("{d:?}");
    assert!(matches!(
        Device::new(all.len()),
        Err(Error::NoSuchDevice { .. })
    ));
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn h2d_d2h_round_trips_random_data_of_many_sizes() {
    suite::h2d_d2h_round_trips_random_data_of_many_sizes(&*local());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn zeros_memset_and_d2d_match_the_cpu() {
    suite::zeros_memset_and_d2d_match_the_cpu(&*local());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn pinned_copies_fill_poisoned_buffers_and_check_lengths() {
    suite::pinned_copies_fill_poisoned_buffers_and_check_lengths(&*local());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn typed_launchers_match_the_cpu_on_random_data() {
    suite::typed_launchers_match_the_cpu_on_random_data(&*local());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn zip_macro_of_four_typed_spins_overlaps_on_the_gpu() {
    suite::zip_macro_of_four_typed_spins_overlaps_on_the_gpu(&*local());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn launch_axpy_matches_the_cpu() {
    suite::launch_axpy_matches_the_cpu(&*local());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn then_and_map_chain_ten_launches_in_order() {
    suite::then_and_map_chain_ten_launches_in_order(&*local());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn zip_arms_run_concurrently_on_different_streams() {
    let _ = kernels();
    suite::zip_arms_run_concurrently_on_different_streams(&*local());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn join_all_is_concurrent_and_ordered() {
    let _ = kernels();
    suite::join_all_is_concurrent_and_ordered(&*local());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn shared_runs_once_and_consumers_on_other_streams_see_its_result() {
    let _ = kernels();
    suite::shared_runs_once_and_consumers_on_other_streams_see_its_result(&*local());
}

/// The ops of one execution on one stream share one use event, recorded
/// after the last of them; a read of a buffer they wrote on another stream
/// before the execution ends (here a blocking `d2h` from a `map` closure)
/// waits for them: the event is recorded the moment the read needs it. The
/// writer spins 2 ms first, so a read that did not wait would see zeros.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_read_on_another_stream_waits_for_writes_earlier_in_the_execution() {
    let k = kernels();
    let n = 1 << 16;
    let other = dev().context().new_stream().unwrap();
    for _ in 0..5 {
        let (spin, ca, other) = (k.spin.clone(), k.copy_add.clone(), other.clone());
        let host = zeros::<u64>(2)
            .zip(h2d(vec![1.0f32; n]))
            .zip(zeros::<f32>(n))
            .then(move |((s, ones), x)| {
                // SAFETY: spin writes stamps[0..2) of a 2-element buffer.
                unsafe { launch(&spin, cfg(1), (2_000_000u64, s)) }.map(move |_| (ones, x))
            })
            .then(move |(ones, x)| {
                // SAFETY: copy_add reads src[0..n) and writes dst[0..n); both
                // have n elements.
                unsafe { launch(&ca, cfg(n as u32), (ones, x, 1.0f32, n as u32)) }
            })
            .map(move |(_, x, _, _)| d2h(&x).sync_on(&other))
            .sync_with(&*local())
            .unwrap()
            .unwrap();
        let y = host.to_vec().unwrap();
        assert!(y.iter().all(|v| *v == 2.0), "the read saw {:?}...", &y[..4]);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn value_with_context_and_boxed_compose() {
    suite::value_with_context_and_boxed_compose(&*local());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn bad_arguments_and_sources_give_clear_errors() {
    let k = kernels();
    let buf = zeros::<u32>(8).sync().unwrap();
    // Wrong count.
    // SAFETY: never launched: the argument check rejects it.
    let e = unsafe { launch(&k.add_u32, cfg(8), (buf,)) }
        .sync()
        .unwrap_err();
    assert!(matches!(e, Error::ArgumentMismatch { .. }), "{e}");
    assert!(
        e.to_string().contains("takes 3 argument(s), 1 given"),
        "{e}"
    );
    // Float where the kernel takes an unsigned int.
    let buf = zeros::<u32>(8).sync().unwrap();
    // SAFETY: never launched: the argument check rejects it.
    let e = unsafe { launch(&k.add_u32, cfg(8), (buf, 1.0f32, 8u32)) }
        .sync()
        .unwrap_err();
    assert!(e.to_string().contains("argument 1 is `f32`"), "{e}");
    // 64-bit scalar for a 32-bit parameter.
    let buf = zeros::<u32>(8).sync().unwrap();
    // SAFETY: never launched: the argument check rejects it.
    let e = unsafe { launch(&k.add_u32, cfg(8), (buf, 1u32, 8u64)) }
        .sync()
        .unwrap_err();
    assert!(e.to_string().contains("argument 2 is `u64`"), "{e}");
    // Bad launch config.
    let buf = zeros::<u32>(8).sync().unwrap();
    let bad = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (4096, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: never launched: the config check rejects it.
    let e = unsafe { launch(&k.add_u32, bad, (buf, 1u32, 8u32)) }
        .sync()
        .unwrap_err();
    assert!(e.to_string().contains("exceeds CUDA limits"), "{e}");
    // Unknown kernel (CUDA C: known once compiled), broken source, broken PTX.
    let m = Module::cuda(KERNELS, &[]).unwrap().named("gpu-tests.cu");
    let nope = m.kernel("nope").unwrap();
    let e = nope.load_on(&dev()).unwrap_err();
    match &e {
        Error::KernelNotFound {
            name,
            module,
            entries,
        } => {
            assert_eq!((name.as_str(), module.as_str()), ("nope", "gpu-tests.cu"));
            assert!(entries.iter().any(|n| n == "axpy"), "{entries:?}");
        }
        other => panic!("{other:?}"),
    }
    assert!(e.to_string().contains("axpy"), "{e}");
    // A launch of it fails the same way, never launches.
    // SAFETY: never launched: the kernel does not resolve.
    let e = unsafe { launch(&nope, LaunchConfig::for_num_elems(1), ()) }
        .sync()
        .unwrap_err();
    assert!(matches!(e, Error::KernelNotFound { .. }), "{e}");
    let broken = Module::cuda("extern \"C\" __global__ void f() { undeclared(); }", &[])
        .unwrap()
        .named("broken.cu");
    let e = broken.load_on(&dev()).unwrap_err();
    assert!(
        matches!(&e, Error::Compile { program, log } if program == "broken.cu" && log.contains("undeclared")),
        "{e}"
    );
    assert!(e.to_string().contains("broken.cu"), "{e}");
    // A compile error is cached: asking again does not recompile.
    let before = cuda_async::nvrtc_compilations();
    let e2 = broken.kernel("f").unwrap().load_on(&dev()).unwrap_err();
    assert!(matches!(e2, Error::Compile { .. }), "{e2}");
    assert_eq!(cuda_async::nvrtc_compilations(), before);
    let e = Module::ptx(
        ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry f() { bogus; }",
    )
    .unwrap()
    .named("bad.ptx")
    .load_on(&dev())
    .unwrap_err();
    // The driver's JIT refuses it: a compile error carrying the JIT's log,
    // or (a driver that gives no log) the failing call.
    match &e {
        Error::Compile { program, log } => {
            assert_eq!(program, "bad.ptx", "{e}");
            assert!(log.starts_with("cuModuleLoadData failed"), "{e}");
        }
        Error::Driver { call, .. } => assert_eq!(*call, "cuModuleLoadData", "{e}"),
        other => panic!("bad PTX: {other:?}"),
    }
    assert!(e.to_string().contains("cuModuleLoadData failed"), "{e}");
    // The same source in two values is compiled once: same function.
    let a = Module::cuda(KERNELS, &[]).unwrap().kernel("axpy").unwrap();
    let b = Module::cuda(KERNELS, &[]).unwrap().kernel("axpy").unwrap();
    assert_eq!(
        format!("{:?}", a.function_on(&dev()).unwrap()),
        format!("{:?}", b.function_on(&dev()).unwrap())
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn run_time_argument_lists_launch_with_offsets_and_are_checked() {
    let _ = kernels();
    suite::run_time_argument_lists_launch_with_offsets_and_are_checked(&*local());
}

const ONE_THREAD: LaunchConfig = LaunchConfig {
    grid_dim: (1, 1, 1),
    block_dim: (1, 1, 1),
    shared_mem_bytes: 0,
};

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn one_kernel_value_launched_from_many_threads_and_tasks_compiles_once() {
    // A source no other test compiles, so the count is this test's.
    let src = format!(
        "// unique {:?}\nextern \"C\" __global__ void inc(unsigned* x) {{ atomicAdd(x, 1u); }}",
        std::time::SystemTime::now()
    );
    let k = Module::cuda(src, &[])
        .unwrap()
        .named("inc.cu")
        .kernel("inc")
        .unwrap();
    let before = cuda_async::nvrtc_compilations();
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(8));
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let (k, barrier) = (k.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                // SAFETY: one thread of `inc` adds 1 to x[0]; x has one element.
                let out = zeros::<u32>(1)
                    .then(move |x| unsafe { launch(&k, ONE_THREAD, (x,)) })
                    .then(|(x,)| d2h(x))
                    .sync()
                    .unwrap();
                assert_eq!(out.as_slice().unwrap(), &[1]);
            })
        })
        .collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .build()
        .unwrap();
    let sums = rt.block_on(async {
        let tasks: Vec<_> = (0..16)
            .map(|_| {
                let k = k.clone();
                tokio::spawn(async move {
                    // SAFETY: as above.
                    let out = zeros::<u32>(1)
                        .then(move |x| unsafe { launch(&k, ONE_THREAD, (x,)) })
                        .then(|(x,)| d2h(x))
                        .into_device_future()
                        .await
                        .unwrap();
                    out.as_slice().unwrap()[0]
                })
            })
            .collect();
        let mut sums = Vec::new();
        for t in tasks {
            sums.push(t.await.unwrap());
        }
        sums
    });
    for t in threads {
        t.join().unwrap();
    }
    assert!(sums.iter().all(|&s| s == 1), "{sums:?}");
    assert_eq!(cuda_async::nvrtc_compilations() - before, 1);
    // The parameter list is known once it was loaded.
    assert_eq!(k.params().map(|p| p.len()), Some(1));
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn sync_on_and_async_on_a_stream_made_by_cudarc_directly() {
    let k = kernels();
    let mut rng = Rng::new();
    // Another library's stream: created with cudarc, not through this crate.
    let ctx = cuda_async::cudarc::driver::CudaContext::new(0).unwrap();
    let theirs: Arc<CudaStream> = ctx.new_stream().unwrap();
    let x = rng.u32s(5000);
    let add = k.add_u32.clone();
    let out = h2d(x.clone())
        // SAFETY: add_u32 touches x[0..5000) of a 5000-element buffer.
        .then(move |b| unsafe { launch(&add, cfg(5000), (b, 3u32, 5000u32)) })
        .then(|(b, _, _)| d2h(b))
        .sync_on(&theirs)
        .unwrap();
    let want: Vec<u32> = x.iter().map(|v| v.wrapping_add(3)).collect();
    assert_eq!(out.as_slice().unwrap(), &want[..]);
    // async_on: enqueue and return; the pinned result waits for itself.
    // SAFETY: the output is a HostBuffer (pinned), which waits for its copy.
    let host = unsafe { h2d(x.clone()).then(d2h).async_on(&theirs) }.unwrap();
    assert_eq!(host.as_slice().unwrap(), &x[..]);
    // A zip on their stream forks onto the pool and joins back to it.
    let (a, b) = h2d(vec![1u8; 10])
        .zip(h2d(vec![2u8; 10]))
        .then(|(a, b)| d2h(a).zip(d2h(b)))
        .sync_on(&theirs)
        .unwrap();
    assert_eq!(
        (a.to_vec().unwrap(), b.to_vec().unwrap()),
        (vec![1; 10], vec![2; 10])
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn tasks_on_many_threads_enqueue_through_one_submit_thread_and_get_their_own_results() {
    let add = kernels().add_u32;
    let pool = local();
    let submit = Arc::new(cuda_async::SubmitThread::new().unwrap());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(8)
        .build()
        .unwrap();
    rt.block_on(async {
        let tasks: Vec<_> = (0..64u32)
            .map(|t| {
                let (k, pool, submit) = (add.clone(), pool.clone(), submit.clone());
                tokio::spawn(async move {
                    for i in 0..50u32 {
                        let x: Vec<u32> = (0..1000).map(|j| j * 7 + t).collect();
                        let add = k.clone();
                        let op = h2d(x.clone())
                            // SAFETY: add_u32 touches x[0..1000) of a 1000-element buffer.
                            .then(move |b| unsafe { launch(&add, cfg(1000), (b, i, 1000u32)) })
                            .then(|(b, _, _)| d2h(b))
                            .schedule(&*pool)
                            .unwrap();
                        let out = submit.enqueue(op).await.unwrap();
                        let want: Vec<u32> = x.iter().map(|v| v + i).collect();
                        assert_eq!(out.as_slice().unwrap(), &want[..], "task {t}, pass {i}");
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
    });
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn tokio_64_tasks_x_1000_awaited_ops_are_all_correct() {
    let _ = kernels();
    suite::tokio_64_tasks_x_1000_awaited_ops_are_all_correct(local());
}

/// A pinned, device-mapped word that a stream can be made to wait on
/// (`cuStreamWaitValue32`): the stream stops until the host opens it.
struct Gate {
    host: *mut u32,
    dptr: sys::CUdeviceptr,
}
// SAFETY: the gate word is only written with volatile stores and read by the
// GPU; the pointer stays valid until `Drop`.
unsafe impl Send for Gate {}
// SAFETY: as for Send: shared access is volatile stores to one word.
unsafe impl Sync for Gate {}

impl Gate {
    fn new() -> Self {
        dev().context().bind_to_thread().unwrap();
        let mut p = std::ptr::null_mut();
        // SAFETY: plain allocation of 4 bytes of mapped pinned memory.
        unsafe {
            sys::cuMemHostAlloc(&mut p, 4, 0x02 /* DEVICEMAP */)
                .result()
                .unwrap()
        };
        let host = p as *mut u32;
        // SAFETY: `host` points to 4 writable bytes.
        unsafe { host.write_volatile(0) };
        let mut dptr = 0;
        // SAFETY: `p` is mapped pinned memory of this context.
        unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut dptr, p, 0)
                .result()
                .unwrap()
        };
        Gate { host, dptr }
    }
    fn close_on(&self, s: &CudaStream) {
        // SAFETY: `dptr` is a live mapped word; GEQ (0) waits until it is >= 1.
        unsafe {
            sys::cuStreamWaitValue32_v2(s.cu_stream(), self.dptr, 1, 0)
                .result()
                .unwrap()
        };
    }
    fn open(&self) {
        // SAFETY: `host` is valid for the gate's life.
        unsafe { self.host.write_volatile(1) };
    }
}

/// The compute-sanitizer tool the suite runs under, if any (the bundle's
/// `sanitize` script sets `CUDA_ASYNC_TEST_SANITIZER`).
fn under_sanitizer() -> Option<String> {
    std::env::var("CUDA_ASYNC_TEST_SANITIZER")
        .ok()
        .filter(|t| !t.is_empty())
}

/// Opens the gate after `secs` if the test has not, so a bug fails the test
/// instead of hanging it.
fn failsafe(g: &Arc<Gate>, secs: u64) -> Arc<std::sync::atomic::AtomicBool> {
    let fired = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (g, f) = (g.clone(), fired.clone());
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(secs));
        f.store(true, Ordering::SeqCst);
        g.open();
    });
    fired
}

fn drop_or_forget_in_flight(forget: bool) {
    let k = kernels();
    let d = dev();
    let mut rng = Rng::new();
    let n = 1 << 20;
    let gate = Arc::new(Gate::new());
    let fired = failsafe(&gate, 20);
    let gated: Arc<CudaStream> = d.new_stream().unwrap();
    gate.close_on(&gated);
    let policy = SingleStream::new(gated.clone()).unwrap();

    // A submission that reads a pinned source, a device input, writes a
    // device output and downloads it into pinned staging: all queued behind
    // the gate.
    let x = rng.f32s(n);
    let src = PinnedBuffer::from_slice(&d, &x).unwrap();
    let ca = k.copy_add.clone();
    let op = zeros::<f32>(n)
        .then(move |dst| copy_h2d(src, dst))
        .then(move |(_src, input)| zeros::<f32>(n).map(move |out| (input, out)))
        // SAFETY: copy_add reads input[0..n) and writes out[0..n); both have n elements.
        .then(move |(input, out)| unsafe {
            launch(&ca, cfg(n as u32), (input, out, 1.0f32, n as u32))
        })
        .then(|(_, out, _, _)| d2h(out));
    let mut fut = Box::pin(op.schedule(&policy).unwrap());
    let waker = futures_test::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    assert!(
        fut.as_mut().poll(&mut cx).is_pending(),
        "behind a closed gate"
    );
    let t = Instant::now();
    if forget {
        std::mem::forget(fut);
    } else {
        drop(fut);
    }
    let drop_time = t.elapsed();
    assert!(
        !fired.load(Ordering::SeqCst),
        "dropping blocked until the failsafe opened the gate"
    );
    if let Some(tool) = under_sanitizer() {
        // A sanitizer makes the probes' allocations wait behind the gate.
        // Under memcheck its own record of freed memory replaces them: the
        // gated work runs now, and a read or write of anything the drop
        // freed early is reported as an error of the run.
        eprintln!("under {tool}: no probes; the sanitizer checks the gated work's accesses");
        gate.open();
        gated.synchronize().unwrap();
        eprintln!(
            "drop/forget of an in-flight future returned in {drop_time:?} with the stream gated"
        );
        return;
    }

    // Try hard to get the dropped submission's memory reused while the gate
    // is still closed: allocate and fill device and pinned buffers of the same
    // sizes on other streams, and keep them.
    let mut device_probes = Vec::new();
    let mut pinned_probes = Vec::new();
    for i in 0..8u8 {
        let b = zeros::<u8>(n * 4)
            .then(move |b| memset(b, 0xA0 + i))
            .sync()
            .unwrap();
        device_probes.push((b, 0xA0 + i));
        pinned_probes.push((
            PinnedBuffer::filled(&d, n, f32::from(i) + 0.5).unwrap(),
            f32::from(i) + 0.5,
        ));
    }
    assert!(
        !fired.load(Ordering::SeqCst),
        "allocations blocked on the gated stream"
    );
    gate.open();
    gated.synchronize().unwrap();
    // Everything the gated work wrote has landed: none of it in a probe.
    for (b, byte) in device_probes {
        let v = d2h(b).sync().unwrap().to_vec().unwrap();
        assert!(
            v.iter().all(|&x| x == byte),
            "a device probe was overwritten: memory was reused early"
        );
    }
    for (p, val) in pinned_probes {
        assert!(
            p.as_slice().unwrap().iter().all(|&x| x == val),
            "a pinned probe was overwritten"
        );
    }
    eprintln!("drop/forget of an in-flight future returned in {drop_time:?} with the stream gated");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn dropping_a_polled_future_never_frees_in_flight_memory_or_blocks() {
    drop_or_forget_in_flight(false);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn forgetting_a_polled_future_never_frees_in_flight_memory_or_blocks() {
    drop_or_forget_in_flight(true);
}

/// Ops that enqueue nothing return while their stream is still held by a
/// gate (no synchronize, no completion signal); ops that enqueue work, and
/// `sync_on` of a caller's stream, still wait for the stream.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn ops_that_enqueue_nothing_return_without_waiting_for_their_stream() {
    let d = dev();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    // A shared op that has run and finished, on another stream.
    let done = h2d(vec![5u32; 4]).map(Arc::new).shared();
    done.clone().sync().unwrap();
    d.context().synchronize().unwrap();

    let gate = Arc::new(Gate::new());
    let fired = failsafe(&gate, 20);
    let held: Arc<CudaStream> = d.new_stream().unwrap();
    gate.close_on(&held);
    let policy = SingleStream::new(held.clone()).unwrap();
    let t = Instant::now();
    assert_eq!(value(42).sync_with(&policy).unwrap(), 42);
    let chain = value(1)
        .then(|x| value(x + 1))
        .map(|x| x * 2)
        .then(|x| value(x + 1));
    assert_eq!(chain.sync_with(&policy).unwrap(), 5);
    let buf = done.clone().sync_with(&policy).unwrap();
    assert_eq!(buf.len(), 4);
    let awaited = rt.block_on(async {
        let a = value(7u8).schedule(&policy).unwrap().await.unwrap();
        let b = done.clone().schedule(&policy).unwrap().await.unwrap();
        (a, b.len())
    });
    assert_eq!(awaited, (7, 4));
    assert!(
        !fired.load(Ordering::SeqCst),
        "an op with no GPU work waited for the held stream"
    );
    let quick = t.elapsed();

    // Work on the held stream waits for it: open the gate after 300 ms.
    let opener = {
        let gate = gate.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            gate.open();
        })
    };
    let t = Instant::now();
    let host = d2h(buf.clone()).sync_with(&policy).unwrap();
    let waited = t.elapsed();
    opener.join().unwrap();
    assert_eq!(host.to_vec().unwrap(), vec![5; 4]);
    assert!(
        waited >= Duration::from_millis(250),
        "a download on the held stream returned after {waited:?}"
    );
    println!("no-work ops: {quick:?} in all; a download behind the gate: {waited:?}");

    // `sync_on` of a caller's stream synchronizes it even with no op work.
    let gate2 = Arc::new(Gate::new());
    let _fired2 = failsafe(&gate2, 20);
    gate2.close_on(&held);
    let opener = {
        let gate = gate2.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            gate.open();
        })
    };
    let t = Instant::now();
    assert_eq!(value(3).sync_on(&held).unwrap(), 3);
    let waited = t.elapsed();
    opener.join().unwrap();
    assert!(
        waited >= Duration::from_millis(250),
        "sync_on returned after {waited:?} with its stream held"
    );
}

/// A `DevicePool` with least-loaded placement spreads submissions evenly
/// over the visible devices and counts each one in flight from placement
/// until its GPU work is done. (With one GPU, only the counting is checked.)
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_device_pool_places_submissions_and_counts_them_in_flight() {
    let pool = cuda_async::DevicePool::all()
        .unwrap()
        .with_placement(cuda_async::Placement::LeastLoaded);
    let n = pool.len();
    if n < 2 {
        eprintln!("one GPU visible: spreading over devices is not checked here (needs 2 GPUs)");
    }
    let k = kernels();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        // Placed (and counted) when scheduled, before any runs.
        let futures: Vec<_> = (0..2 * n)
            .map(|_| suite::spin_op(&k.spin, 20_000_000).schedule(&pool).unwrap())
            .collect();
        let loads = pool.loads();
        assert!(
            loads.iter().all(|l| l.in_flight == 2),
            "least-loaded placement: {loads:?}"
        );
        for f in futures {
            f.await.unwrap();
        }
    });
    let loads = pool.loads();
    assert!(
        loads.iter().all(|l| l.in_flight == 0),
        "after completion: {loads:?}"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn host_reads_of_a_download_wait_for_the_dma() {
    let d = dev();
    let mut rng = Rng::new();
    let gate = Arc::new(Gate::new());
    let fired = failsafe(&gate, 20);
    let gated = d.new_stream().unwrap();
    let x = rng.u32s(1 << 16);
    let buf = h2d(x.clone()).sync().unwrap();
    gate.close_on(&gated);
    let t = Instant::now();
    // SAFETY: the output is a HostBuffer (pinned), which waits for its own copy.
    let host = unsafe { d2h(buf).async_on(&gated) }.unwrap();
    let enqueued = t.elapsed();
    assert!(
        !fired.load(Ordering::SeqCst),
        "enqueueing the download took {enqueued:?}: it waited until the failsafe opened the gate"
    );
    assert!(
        !host.is_idle().unwrap(),
        "the download cannot be done behind a closed gate"
    );
    let g = gate.clone();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        g.open();
    });
    // Blocks until the DMA is done, then sees the data, never the garbage.
    assert_eq!(host.as_slice().unwrap(), &x[..]);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_buffer_dropped_while_another_stream_uses_it_is_freed_after_that_use() {
    let k = kernels();
    let d = dev();
    let mut rng = Rng::new();
    let n = 1 << 20;
    let x = rng.f32s(n);
    // Allocated (home stream) on the pool; used on a gated stream.
    let input = h2d(x.clone()).sync().unwrap();
    let gate = Arc::new(Gate::new());
    let fired = failsafe(&gate, 3);
    let gated = d.new_stream().unwrap();
    gate.close_on(&gated);
    let ca = k.copy_add.clone();
    let out = zeros::<f32>(n).sync().unwrap();
    // SAFETY: copy_add reads input[0..n), writes out[0..n); both have n elements.
    let (input, out, _, _) =
        unsafe { launch(&ca, cfg(n as u32), (input, out, 3.0f32, n as u32)).async_on(&gated) }
            .unwrap();
    // Freed on its home stream (a pool stream), which first waits for the
    // gated kernel's read (cudarc's events): so that home stream now waits
    // behind the gate too, and the probes use a stream of their own.
    drop(input);
    let probe_stream = d.new_stream().unwrap();
    let mut probes = Vec::new();
    for i in 0..8u8 {
        let b = zeros::<u8>(n * 4)
            .then(move |b| memset(b, 0x10 + i))
            .sync_on(&probe_stream)
            .unwrap();
        probes.push((b, 0x10 + i));
    }
    // The probes may legitimately wait for the gate: the memory pool may
    // order a reuse of the freed block after its free (internal
    // dependencies), which itself waits for the gated kernel. Then the
    // failsafe opened the gate, and the data checks below still hold.
    eprintln!(
        "probes waited for the gate: {}",
        fired.load(Ordering::SeqCst)
    );
    gate.open();
    let got = d2h(out).sync_on(&gated).unwrap();
    let want: Vec<f32> = x.iter().map(|v| v + 3.0).collect();
    assert_eq!(
        got.as_slice().unwrap(),
        &want[..],
        "the kernel read freed (reused) memory"
    );
    for (b, byte) in probes {
        let v = d2h(b).sync_on(&probe_stream).unwrap();
        assert!(
            v.as_slice().unwrap().iter().all(|&v| v == byte),
            "a probe was overwritten"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_buffer_read_on_two_streams_is_freed_after_both_reads() {
    let k = kernels();
    let d = dev();
    let mut rng = Rng::new();
    let n = 1 << 20;
    let x = rng.f32s(n);
    let input = Arc::new(h2d(x.clone()).sync().unwrap());
    let (g1, g2) = (Arc::new(Gate::new()), Arc::new(Gate::new()));
    let _f1 = failsafe(&g1, 5);
    let _f2 = failsafe(&g2, 20);
    let (s1, s2) = (d.new_stream().unwrap(), d.new_stream().unwrap());
    g1.close_on(&s1);
    g2.close_on(&s2);
    let read_on = |s: &Arc<CudaStream>, v: f32| {
        let ca = k.copy_add.clone();
        let out = zeros::<f32>(n).sync_on(s).unwrap();
        // SAFETY: copy_add reads input[0..n), writes out[0..n); both have n elements.
        let (_, out, _, _) =
            unsafe { launch(&ca, cfg(n as u32), (input.clone(), out, v, n as u32)).async_on(s) }
                .unwrap();
        out
    };
    let out1 = read_on(&s1, 1.0);
    let out2 = read_on(&s2, 2.0);
    // The last reference goes: the free must wait for BOTH readers.
    drop(input);
    // The second reader finishes; the first is still gated.
    g2.open();
    s2.synchronize().unwrap();
    // Allocate and fill probes: if the block had been freed after the second
    // reader only, they could take it and the first reader would read them.
    let probe_stream = d.new_stream().unwrap();
    let mut probes = Vec::new();
    for i in 0..8u8 {
        let b = zeros::<u8>(n * 4)
            .then(move |b| memset(b, 0x30 + i))
            .sync_on(&probe_stream)
            .unwrap();
        probes.push((b, 0x30 + i));
    }
    g1.open();
    let got1 = d2h(out1).sync_on(&s1).unwrap();
    let got2 = d2h(out2).sync_on(&s2).unwrap();
    let w1: Vec<f32> = x.iter().map(|v| v + 1.0).collect();
    let w2: Vec<f32> = x.iter().map(|v| v + 2.0).collect();
    assert_eq!(
        got1.as_slice().unwrap(),
        &w1[..],
        "the first reader read freed memory"
    );
    assert_eq!(got2.as_slice().unwrap(), &w2[..]);
    for (b, byte) in probes {
        let v = d2h(b).sync_on(&probe_stream).unwrap();
        assert!(v.as_slice().unwrap().iter().all(|&v| v == byte));
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn an_upload_is_staged_and_never_blocks_on_the_stream() {
    let d = dev();
    let mut rng = Rng::new();
    let x = rng.u32s(1 << 16);
    let mut pinned = PinnedBuffer::from_slice(&d, &x).unwrap();
    let gate = Arc::new(Gate::new());
    let fired = failsafe(&gate, 20);
    let gated = d.new_stream().unwrap();
    gate.close_on(&gated);
    // SAFETY: the output is a DeviceBuffer, which orders its own uses.
    let buf = unsafe { h2d(pinned.as_slice().unwrap()).async_on(&gated) }.unwrap();
    assert!(
        !fired.load(Ordering::SeqCst),
        "enqueuing the upload waited for the gated stream"
    );
    // The borrow has ended; the host may now change the pinned memory while
    // the upload is still queued behind the gate.
    for v in pinned.as_mut_slice().unwrap() {
        *v = 0xDEAD_BEEF;
    }
    gate.open();
    let back = d2h(buf).sync_on(&gated).unwrap();
    assert_eq!(
        back.as_slice().unwrap(),
        &x[..],
        "the upload read the pinned memory late"
    );
}

/// The sticky-fault test's name: it runs itself again, in a child process,
/// for the part that faults (a fault poisons every CUDA context of the
/// process, so it cannot share one with the other tests).
const STICKY_FAULT_TEST: &str = "a_sticky_fault_fails_that_op_and_later_ones_instead_of_hanging";

/// Set in the child process of the sticky-fault test.
const FAULT_CHILD: &str = "CUDA_ASYNC_FAULT_CHILD";

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_sticky_fault_fails_that_op_and_later_ones_instead_of_hanging() {
    if std::env::var_os(FAULT_CHILD).is_some() {
        return fault_child();
    }
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args([
            "--exact",
            STICKY_FAULT_TEST,
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(FAULT_CHILD, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("child stdout:\n{stdout}\nchild stderr:\n{stderr}");
    assert!(out.status.success(), "child failed");
    assert!(
        stdout.contains("CHILD: FAULT-HANDLED"),
        "child did not finish its checks"
    );
    assert!(
        stdout.contains("ILLEGAL_ADDRESS"),
        "the error should name the fault"
    );
}

const CANARY_TEST: &str = "memcheck_reports_a_kernel_reading_memory_freed_before_it_ran";
const CANARY_CHILD: &str = "CUDA_ASYNC_SANITIZER_CANARY_CHILD";
/// memcheck as the sanitize script runs it: stream-ordered frees are
/// tracked (without this, memory freed back to a pool stays valid to it).
const MEMCHECK_ARGS: [&str; 6] = [
    "--tool",
    "memcheck",
    "--report-api-errors",
    "no",
    "--track-stream-ordered-races",
    "use-after-free",
];

/// The drop and forget tests rely, under the sanitize script, on memcheck
/// reporting a kernel's access to memory freed while the kernel was still
/// queued (the bug they guard against). This checks that memcheck does,
/// on this host: a child process under memcheck makes that very mistake
/// with the raw driver, and memcheck must name it.
#[test]
#[ignore = "needs an NVIDIA GPU (and compute-sanitizer, or it says it did not run)"]
fn memcheck_reports_a_kernel_reading_memory_freed_before_it_ran() {
    if std::env::var_os(CANARY_CHILD).is_some() {
        return canary_child();
    }
    if let Some(tool) = under_sanitizer() {
        eprintln!("NOT RUN: already under {tool}; this test runs its own sanitizer");
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let out = match std::process::Command::new("compute-sanitizer")
        .args(MEMCHECK_ARGS)
        .arg(exe)
        .args([
            "--exact",
            CANARY_TEST,
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CANARY_CHILD, "1")
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            eprintln!(
                "NOT RUN: compute-sanitizer could not start ({e}); it comes with the CUDA toolkit"
            );
            return;
        }
    };
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("child under memcheck:\n{text}");
    assert!(
        text.contains("CANARY: freed, then ran"),
        "the child did not get to run its kernel"
    );
    assert!(
        text.contains("Use-after-free") || text.contains("Invalid __global__ read"),
        "memcheck did not report the read of freed memory"
    );
    assert!(
        !text.contains("ERROR SUMMARY: 0 errors"),
        "memcheck counted no error"
    );
}

/// The child half of the memcheck canary: frees (stream-ordered, on another
/// stream) the input of a kernel still queued behind a gate, then lets the
/// kernel run. Raw driver calls: the library cannot make this mistake.
fn canary_child() {
    let d = dev();
    let ctx = d.context().clone();
    ctx.bind_to_thread().unwrap();
    let ptx = cuda_async::cudarc::nvrtc::compile_ptx(KERNELS).unwrap();
    let module = ctx.load_module(ptx).unwrap();
    let f = module.load_function("copy_add").unwrap();
    let gate = Arc::new(Gate::new());
    let fired = failsafe(&gate, 20);
    let gated = d.new_stream().unwrap();
    let other = d.new_stream().unwrap();
    let n: u32 = 1 << 16;
    let bytes = n as usize * 4;
    let (mut src, mut dst): (sys::CUdeviceptr, sys::CUdeviceptr) = (0, 0);
    // SAFETY: raw allocations, a launch with matching arguments (copy_add
    // takes two float pointers of n elements, a float and n), and frees;
    // the early free of `src` is the deliberate bug memcheck must report.
    unsafe {
        sys::cuMemAllocAsync(&mut src, bytes, other.cu_stream())
            .result()
            .unwrap();
        sys::cuMemAllocAsync(&mut dst, bytes, other.cu_stream())
            .result()
            .unwrap();
        sys::cuMemsetD8Async(src, 0, bytes, other.cu_stream())
            .result()
            .unwrap();
        sys::cuStreamSynchronize(other.cu_stream())
            .result()
            .unwrap();
        gate.close_on(&gated);
        let mut v = 1.0f32;
        let mut nn = n;
        let mut params = [
            (&mut src as *mut sys::CUdeviceptr).cast::<std::ffi::c_void>(),
            (&mut dst as *mut sys::CUdeviceptr).cast(),
            (&mut v as *mut f32).cast(),
            (&mut nn as *mut u32).cast(),
        ];
        sys::cuLaunchKernel(
            f.cu_function(),
            n.div_ceil(256),
            1,
            1,
            256,
            1,
            1,
            0,
            gated.cu_stream(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
        .result()
        .unwrap();
        sys::cuMemFreeAsync(src, other.cu_stream())
            .result()
            .unwrap();
        sys::cuStreamSynchronize(other.cu_stream())
            .result()
            .unwrap();
        assert!(
            !fired.load(Ordering::SeqCst),
            "the free waited for the gated kernel"
        );
        gate.open();
        gated.synchronize().unwrap();
        println!("CANARY: freed, then ran");
        sys::cuMemFreeAsync(dst, gated.cu_stream())
            .result()
            .unwrap();
        gated.synchronize().unwrap();
    }
}

/// The child half of the sticky-fault test (not a test of its own: run by
/// that test in a process of its own).
fn fault_child() {
    let k = kernels();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let fault = k.fault.clone();
    let r = rt.block_on(async move {
        let p = zeros::<i32>(1).await?;
        // SAFETY: deliberately unsound kernel: this test checks the fault is reported.
        let r = tokio::time::timeout(
            Duration::from_secs(10),
            unsafe { launch(&fault, cfg(1), (p,)) }.into_future(),
        )
        .await;
        Ok::<_, Error>(r)
    });
    let r = r.expect("setup");
    let e = match r {
        Err(_) => panic!("CHILD: the faulting op hung"),
        Ok(Ok(_)) => panic!("CHILD: the faulting op succeeded"),
        Ok(Err(e)) => e,
    };
    println!("CHILD: awaited fault -> {e}");
    assert!(e.is_sticky(), "{e}");
    let later = zeros::<u8>(16).sync().unwrap_err();
    println!("CHILD: later sync -> {later}");
    assert!(later.is_sticky());
    let later_async = rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(10), value(1).into_future()).await
    });
    let later_async = later_async.expect("later await hung");
    println!(
        "CHILD: later await -> {:?}",
        later_async.as_ref().map_err(|e| e.to_string())
    );
    assert!(later_async.is_err());
    println!("CHILD: FAULT-HANDLED");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn graph_replay_equals_eager_for_a_chain_of_55_ops_with_a_zip() {
    graph::replay_equals_eager_for_a_chain_of_55_ops_with_a_zip();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn graph_keeps_buffers_whose_handles_were_dropped_over_1000_replays() {
    graph::handles_dropped_after_capture_then_1000_replays();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn graph_replay_on_one_stream_is_seen_by_an_op_on_another() {
    graph::a_replay_on_one_stream_is_seen_by_an_op_on_another();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn graph_capture_errors_leave_everything_working() {
    graph::what_cannot_be_captured_is_an_error_and_ops_work_after();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn graph_decode_loop_sets_a_device_scalar_before_each_of_100_replays() {
    graph::a_decode_loop_sets_a_device_scalar_before_each_of_100_replays();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn graph_recapture_updates_in_place_or_reinstantiates() {
    graph::recapture_updates_in_place_or_reinstantiates();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn graph_replays_from_four_threads_are_ordered() {
    graph::replays_from_four_threads_are_ordered();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn graph_on_captures_on_the_callers_stream() {
    graph::graph_on_captures_on_the_callers_stream();
}

/// `to_device`: a same-device copy on any host; with two GPUs, a peer copy
/// round-trips random data, runs only on the target device, and a device-0
/// buffer in a device-1 kernel stays an error naming both devices.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn to_device_copies_to_the_device_the_op_runs_on() {
    use cuda_async::{to_device, SingleStream};
    let mut rng = Rng::new();
    let data = rng.f32s(1 << 20);
    let d0 = dev();
    let a = h2d(data.clone())
        .sync_on(&d0.new_stream().unwrap())
        .unwrap();
    let on0 = SingleStream::new(d0.new_stream().unwrap()).unwrap();
    let same = to_device(&a, &d0).then(d2h).sync_with(&on0).unwrap();
    assert_eq!(same.as_slice().unwrap(), &data[..], "same-device copy");
    if cuda_async::device_count().unwrap() < 2 {
        eprintln!("one GPU visible: the peer copy is not checked here (needs 2 GPUs)");
        return;
    }
    let d1 = Device::new(1).unwrap();
    println!(
        "peer access 0 -> 1: {}",
        cuda_async::can_access_peer(&d0, &d1).unwrap()
    );
    let on1 = SingleStream::new(d1.new_stream().unwrap()).unwrap();
    let b = to_device(&a, &d1).sync_with(&on1).unwrap();
    let back = d2h(&b).sync_with(&on1).unwrap();
    assert_eq!(back.as_slice().unwrap(), &data[..], "peer copy 0 -> 1");
    // Back to device 0, and the source is still intact.
    let c = to_device(&b, &d0).then(d2h).sync_with(&on0).unwrap();
    assert_eq!(c.as_slice().unwrap(), &data[..], "peer copy 1 -> 0");
    // On the wrong device: an error, not a copy.
    let e = to_device(&a, &d1).sync_with(&on0).unwrap_err();
    assert!(e.to_string().contains("GPU 1"), "{e}");
    // A device-0 buffer in a device-1 kernel.
    let k = kernels();
    k.axpy.load_on(&d1).unwrap();
    let n = data.len() as u32;
    let y = zeros::<f32>(data.len()).sync_with(&on1).unwrap();
    // SAFETY: never launched: the buffer check fails first.
    let e = unsafe { launch(&k.axpy, cfg(n), (1.0f32, &a, y, n)) }
        .sync_with(&on1)
        .unwrap_err();
    assert!(
        e.to_string().contains("device 0") && e.to_string().contains("device 1"),
        "{e}"
    );
}

/// Peer access, on a host with two GPUs that reach each other: the first
/// `to_device` between them enables access on both contexts and both
/// memory pools (asked of the driver afterwards), and copies in both
/// directions, each issued while a kernel runs on both devices, are
/// byte-exact, three rounds; a kernel on the target device then reads the
/// copy. On one GPU it says it needs two (run it from the bundle's
/// `multi-gpu` script, under memcheck too).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn to_device_enables_peer_access_and_copies_exactly_beside_kernels() {
    use cuda_async::{can_access_peer, to_device, SingleStream};
    if cuda_async::device_count().unwrap() < 2 {
        eprintln!("one GPU visible: peer access is not checked here (needs 2 GPUs)");
        return;
    }
    let (d0, d1) = (dev(), Device::new(1).unwrap());
    let linked = can_access_peer(&d0, &d1).unwrap() && can_access_peer(&d1, &d0).unwrap();
    eprintln!("GPU 0 and GPU 1 reach each other: {linked}");
    let k = kernels();
    k.axpy.load_on(&d1).unwrap();
    let on = |d: &Device| SingleStream::new(d.new_stream().unwrap()).unwrap();
    let (on0, on1, spin0, spin1) = (on(&d0), on(&d1), on(&d0), on(&d1));
    let mut rng = Rng::new();
    let n = 16 << 20; // 64 MiB of f32 each way
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for round in 0..3 {
        let (x0, x1) = (rng.f32s(n), rng.f32s(n));
        let a = h2d(x0.clone()).sync_with(&on0).unwrap();
        let b = h2d(x1.clone()).sync_with(&on1).unwrap();
        let (s0, s1, ab, ba) = rt.block_on(async {
            tokio::join!(
                suite::spin_op(&k.spin, 2_000_000).schedule(&spin0).unwrap(),
                suite::spin_op(&k.spin, 2_000_000).schedule(&spin1).unwrap(),
                to_device(&a, &d1).schedule(&on1).unwrap(),
                to_device(&b, &d0).schedule(&on0).unwrap(),
            )
        });
        let (ab, ba) = (ab.unwrap(), ba.unwrap());
        let (s0, s1) = (s0.unwrap(), s1.unwrap());
        let got = d2h(&ab).sync_with(&on1).unwrap();
        assert!(
            bits(got.as_slice().unwrap()) == bits(&x0),
            "round {round}: 0 -> 1"
        );
        let got = d2h(&ba).sync_with(&on0).unwrap();
        assert!(
            bits(got.as_slice().unwrap()) == bits(&x1),
            "round {round}: 1 -> 0"
        );
        // A kernel on GPU 1 reads the copy: y = 1 * x + 0 is x, exactly.
        let y = zeros::<f32>(n).sync_with(&on1).unwrap();
        // SAFETY: axpy touches x[0..n) and y[0..n); both have n elements.
        let (_, _, y, _) = unsafe { launch(&k.axpy, cfg(n as u32), (1.0f32, &ab, y, n as u32)) }
            .sync_with(&on1)
            .unwrap();
        let got = d2h(y).sync_with(&on1).unwrap();
        assert!(
            bits(got.as_slice().unwrap()) == bits(&x0),
            "round {round}: kernel on 1"
        );
        let ((a0, a1), (b0, b1)) = (suite::stamps(&spin0, s0), suite::stamps(&spin1, s1));
        assert!(a1 - a0 >= 2_000_000 && b1 - b0 >= 2_000_000);
    }
    if !linked {
        eprintln!("the copies above were staged by the driver: access is not checked");
        return;
    }
    // The driver's own view: both contexts already reach each other, and
    // each pool lets the other device read and write.
    for (from, to) in [(&d0, &d1), (&d1, &d0)] {
        from.context().bind_to_thread().unwrap();
        // SAFETY: `to`'s context is live; flags must be 0.
        let again = unsafe { sys::cuCtxEnablePeerAccess(to.context().cu_ctx(), 0) };
        assert_eq!(
            again,
            sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
            "context of GPU {} to GPU {}",
            from.ordinal(),
            to.ordinal()
        );
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: valid out-pointer; live device handle.
        unsafe { sys::cuDeviceGetMemPool(&mut pool, to.context().cu_device()) }
            .result()
            .unwrap();
        let mut flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
        let mut at = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: from.context().cu_device(),
        };
        // SAFETY: valid pointers, read and written during the call.
        unsafe { sys::cuMemPoolGetAccess(&mut flags, pool, &mut at) }
            .result()
            .unwrap();
        assert_eq!(
            flags,
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            "pool of GPU {} seen from GPU {}",
            to.ordinal(),
            from.ordinal()
        );
    }
    assert!(cuda_async::enable_peer_access(&d0, &d1).unwrap());
    // A buffer of a pool that is not current (a policy's own): the copy
    // gives GPU 1 access to that pool as well, and is exact.
    let pool = cuda_async::MemPool::new(&d0, Default::default()).unwrap();
    let own = SingleStream::new(d0.new_stream().unwrap())
        .unwrap()
        .with_mem_pool(pool.clone());
    let x = rng.f32s(1 << 20);
    let a = h2d(x.clone()).sync_with(&own).unwrap();
    assert_eq!(pool_of(&a), pool.cu_pool());
    let got = to_device(&a, &d1).then(d2h).sync_with(&on1).unwrap();
    assert!(
        bits(got.as_slice().unwrap()) == bits(&x),
        "0 -> 1 from a chosen pool"
    );
    let mut flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
    let mut at = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: d1.context().cu_device(),
    };
    // SAFETY: valid pointers, read and written during the call.
    unsafe { sys::cuMemPoolGetAccess(&mut flags, pool.cu_pool(), &mut at) }
        .result()
        .unwrap();
    assert_eq!(
        flags,
        sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        "a chosen pool of GPU 0 seen from GPU 1"
    );
}

/// A `DevicePool` that spreads arms puts a zip's arms on two devices: each
/// arm's output lives on its own device, the two 20 ms spins overlap (the
/// wall time is under 1.5 spins, and each GPU's `%globaltimer` intervals
/// overlap), both devices count the submission in flight until it is
/// done, and a future dropped with its arms in flight on both devices frees
/// nothing early (run under memcheck). With one GPU the zip runs on it and
/// the spreading is not checked.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_device_pool_spreads_zip_arms_over_devices() {
    let pool = cuda_async::DevicePool::all().unwrap().spread_arms();
    let k = kernels();
    let ms20 = 20_000_000u64;
    // Warm up every device (module load, pools).
    for _ in 0..pool.len() {
        let _ = suite::spin_op(&k.spin, 1000)
            .zip(suite::spin_op(&k.spin, 1000))
            .sync_with(&pool)
            .unwrap();
    }
    if pool.len() < 2 {
        eprintln!("one GPU visible: arms on two devices are not checked here (needs 2 GPUs)");
        let (a, b) = suite::spin_op(&k.spin, 1000)
            .zip(suite::spin_op(&k.spin, 1000))
            .sync_with(&pool)
            .unwrap();
        assert_eq!(
            a.local().unwrap().device().ordinal(),
            b.local().unwrap().device().ordinal()
        );
        return;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let t = Instant::now();
    let (a, b) = rt.block_on(async {
        let f = suite::spin_op(&k.spin, ms20)
            .zip(suite::spin_op(&k.spin, ms20))
            .schedule(&pool)
            .unwrap();
        let mut f = std::pin::pin!(f);
        // Submitted on the first poll: both devices count it.
        let first = std::future::poll_fn(|cx| std::task::Poll::Ready(f.as_mut().poll(cx))).await;
        assert!(first.is_pending(), "20 ms spins cannot be done at once");
        let loads = pool.loads();
        assert!(
            loads.iter().filter(|l| l.in_flight > 0).count() >= 2,
            "both devices count the submission: {loads:?}"
        );
        f.await.unwrap()
    });
    let wall = t.elapsed();
    let loads = pool.loads();
    assert!(loads.iter().all(|l| l.in_flight == 0), "after: {loads:?}");
    let (da, db) = (
        a.local().unwrap().device().ordinal(),
        b.local().unwrap().device().ordinal(),
    );
    assert_ne!(da, db, "the arms ran on different devices");
    let on = |d: usize| {
        cuda_async::SingleStream::new(Device::new(d).unwrap().new_stream().unwrap()).unwrap()
    };
    let ((a0, a1), (b0, b1)) = (suite::stamps(&on(da), a), suite::stamps(&on(db), b));
    eprintln!(
        "zip of two 20 ms spins on GPUs {da} and {db}: {wall:?}; %globaltimer intervals overlap by {} us",
        (a1.min(b1) as i64 - a0.max(b0) as i64) / 1000
    );
    assert!(a1 - a0 >= ms20 && b1 - b0 >= ms20);
    assert!(
        wall < Duration::from_millis(30),
        "two 20 ms spins on two GPUs took {wall:?} (serial: 40 ms)"
    );
    assert!(
        a0 < b1 && b0 < a1,
        "arms did not overlap: a=[{a0},{a1}] b=[{b0},{b1}]"
    );
    // Dropped in flight: the arms' buffers (one per device) are freed
    // stream-ordered after their spins; memcheck sees no early free.
    rt.block_on(async {
        let f = suite::spin_op(&k.spin, ms20)
            .zip(suite::spin_op(&k.spin, ms20))
            .then(|(a, b)| d2h(a).zip(d2h(b)))
            .schedule(&pool)
            .unwrap();
        assert!(tokio::time::timeout(Duration::from_millis(1), f)
            .await
            .is_err());
    });
    for d in 0..pool.len() {
        Device::new(d).unwrap().context().synchronize().unwrap();
    }
    // Released by the background reclaimer once the completion is seen.
    let t = Instant::now();
    while pool.loads().iter().any(|l| l.in_flight > 0) && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(1));
    }
    let loads = pool.loads();
    assert!(
        loads.iter().all(|l| l.in_flight == 0),
        "after the drop: {loads:?}"
    );
}

/// `timed` measures a 1 ms spin within 10 % (its own `%globaltimer`
/// stamps are the reference), and a zip of two overlapping 1 ms spins as
/// one span that covers both arms.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn timed_measures_a_one_ms_spin_on_the_gpu_within_ten_percent() {
    suite::timed_measures_a_one_ms_spin_on_the_gpu_within_ten_percent(&*local());
}

/// `sync_timeout` returns at its bound while a 200 ms spin runs on; the
/// spin's buffer (dropped with the error) is freed only after the spin,
/// which then finishes, and the pool works after it.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn sync_timeout_returns_at_its_bound_and_the_work_finishes_safely() {
    let pool = local();
    let k = kernels();
    let _ = suite::spin_op(&k.spin, 1000).sync_with(&*pool).unwrap();
    let t = Instant::now();
    let e = suite::spin_op(&k.spin, 200_000_000)
        .sync_with_timeout(&*pool, Duration::from_millis(10))
        .unwrap_err();
    let waited = t.elapsed();
    assert!(matches!(e, cuda_async::Error::Timeout { .. }), "{e}");
    assert!(
        waited < Duration::from_millis(150),
        "returned after {waited:?}"
    );
    // In time: the output.
    let (a, b) = suite::stamps(
        &*pool,
        suite::spin_op(&k.spin, 1_000_000)
            .sync_with_timeout(&*pool, Duration::from_secs(10))
            .unwrap(),
    );
    assert!(b - a >= 1_000_000);
    // The timed-out spin ends; the device drains without an error.
    cuda_async::Device::new(0)
        .unwrap()
        .context()
        .synchronize()
        .unwrap();
}

const COUNTER: &str = r#"
__device__ unsigned counter;
extern "C" __global__ void bump(unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(&counter, 1u);
}
"#;

/// A `__device__` counter: written, bumped by 1,000 threads, read back, in
/// one chain; a missing global and a wrong size are errors naming them.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_device_global_is_written_bumped_by_a_kernel_and_read_back() {
    use cuda_async::{read_global, write_global};
    let pool = local();
    let m = Module::cuda(COUNTER, &[]).unwrap();
    let bump = m.kernel("bump").unwrap();
    let n = 1000u32;
    let m2 = m.clone();
    let got = write_global(&m, "counter", vec![100u32])
        // SAFETY: bump touches only the module's counter.
        .then(move |()| unsafe { launch(&bump, cfg(n), (n,)) })
        .then(move |_| read_global::<u32>(&m2, "counter"))
        .sync_with(&*pool)
        .unwrap();
    assert_eq!(got.as_slice().unwrap(), &[100 + n]);
    let e = read_global::<u32>(&m, "nope")
        .sync_with(&*pool)
        .unwrap_err();
    assert!(e.to_string().contains("no global `nope`"), "{e}");
    let e = write_global(&m, "counter", vec![1u64])
        .sync_with(&*pool)
        .unwrap_err();
    assert!(e.to_string().contains("4 bytes; 8 bytes"), "{e}");
    let e = read_global::<u64>(&m, "counter")
        .sync_with(&*pool)
        .unwrap_err();
    assert!(e.to_string().contains("whole number"), "{e}");
}

/// A host step between two kernels: it sees the first kernel's result
/// (downloaded before it into pinned memory) and the second kernel sees
/// what it wrote (uploaded after it); a panicking step is reported by its
/// result while the stream goes on; capture refuses host steps.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_host_step_between_two_kernels_sees_the_first_and_feeds_the_second() {
    use cuda_async::{host_step, host_step_with};
    let pool = local();
    let k = kernels();
    let n = 4096u32;
    let pinned = PinnedBuffer::filled(&dev(), n as usize, 0u32).unwrap();
    let (add1, add2) = (k.add_u32.clone(), k.add_u32.clone());
    let (back, seen) = h2d(vec![1u32; n as usize])
        // SAFETY: add_u32 touches x[0..n) of an n-element buffer.
        .then(move |x| unsafe { launch(&add1, cfg(n), (x, 5u32, n)) })
        .then(move |(x, _, _)| copy_d2h(x, pinned))
        .then(|(x, pinned)| {
            host_step_with(pinned, |v: &mut [u32]| {
                let seen: Vec<u32> = v.to_vec();
                v.iter_mut().for_each(|e| *e *= 10);
                seen
            })
            .then(move |(pinned, seen)| copy_h2d(pinned, x).map(move |(_, x)| (x, seen)))
        })
        .then(move |(x, seen)| {
            // SAFETY: as above.
            unsafe { launch(&add2, cfg(n), (x, 1u32, n)) }.map(move |(x, _, _)| (x, seen))
        })
        .then(|(x, seen)| d2h(x).map(move |h| (h, seen)))
        .sync_with(&*pool)
        .unwrap();
    let seen = seen.get().unwrap();
    assert!(
        seen.iter().all(|&v| v == 6),
        "the step saw {:?}",
        &seen[..4]
    );
    let back = back.as_slice().unwrap();
    assert!(
        back.iter().all(|&v| v == 61),
        "the second kernel saw {:?}",
        &back[..4]
    );

    // A panic is caught and reported by the result; the chain goes on.
    let (r, z) = host_step(|| -> u32 { panic!("boom in a host step") })
        .then(|r| zeros::<u8>(16).map(move |z| (r, z)))
        .sync_with(&*pool)
        .unwrap();
    assert_eq!(z.len(), 16);
    let e = r.get().unwrap_err();
    assert!(
        matches!(&e, Error::HostStep { op: "host_step", message } if message.contains("boom")),
        "{e}"
    );
    // The closure's value, in stream order after a kernel.
    let t = host_step(|| 42u64).sync_with(&*pool).unwrap();
    assert_eq!(t.get().unwrap(), 42);

    // A graph replays; a host step's closure runs once: refused, named.
    let e = zeros::<u8>(16)
        .then(|z| host_step(|| ()).map(move |_| z))
        .graph()
        .unwrap_err();
    assert!(
        matches!(&e, Error::Capture(m) if m.contains("host_step")),
        "{e}"
    );

    // `host_step_each` is captured: its closure runs at every replay.
    use std::sync::atomic::AtomicUsize;
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    let add = k.add_u32.clone();
    let graph = zeros::<u32>(n as usize)
        // SAFETY: add_u32 touches x[0..n) of an n-element buffer.
        .then(move |x| unsafe { launch(&add, cfg(n), (x, 1u32, n)) })
        .then(move |(x, _, _)| {
            cuda_async::host_step_each(move || {
                seen.fetch_add(1, Ordering::SeqCst);
            })
            .map(move |()| x)
        })
        .graph()
        .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 0, "capture runs nothing");
    for _ in 0..5 {
        graph.launch().sync_with(&*pool).unwrap();
    }
    assert_eq!(calls.load(Ordering::SeqCst), 5);
    drop(graph);
    // Eagerly: once.
    let seen = calls.clone();
    cuda_async::host_step_each(move || {
        seen.fetch_add(1, Ordering::SeqCst);
    })
    .sync_with(&*pool)
    .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 6);
}

/// A graph uploads from and downloads into shared pinned memory at each
/// replay: the host writes new input between replays and reads each
/// replay's output; a host read waits for the replay launched before it
/// (whose download follows a 20 ms spin); a plain `PinnedBuffer` copy is
/// refused in a capture, named.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn graph_replays_read_and_write_shared_pinned_memory() {
    let pool = local();
    let k = kernels();
    let n = 4096u32;
    let d = dev();
    let input = PinnedBuffer::filled(&d, n as usize, 0u32)
        .unwrap()
        .into_shared();
    let output = cuda_async::SharedPinnedBuffer::filled(&d, n as usize, 0u32).unwrap();

    // Refused with a plain pinned buffer, named.
    let plain = PinnedBuffer::filled(&d, n as usize, 0u32).unwrap();
    let e = zeros::<u32>(n as usize)
        .then(move |x| copy_h2d(plain, x))
        .graph()
        .unwrap_err();
    assert!(
        matches!(&e, Error::Capture(m) if m.contains("into_shared")),
        "{e}"
    );

    let (inp, outp) = (input.clone(), output.clone());
    let (spin, add) = (k.spin.clone(), k.add_u32.clone());
    let ms20 = 20_000_000u64;
    let graph = zeros::<u32>(n as usize)
        .zip(zeros::<u64>(2))
        .then(move |(x, s)| copy_h2d(inp, x).map(move |(_, x)| (x, s)))
        // SAFETY: spin writes s[0..2) of a 2-element buffer.
        .then(move |(x, s)| unsafe { launch(&spin, cfg(1), (ms20, s)) }.map(move |(_, s)| (x, s)))
        .then(move |(x, s)| {
            // SAFETY: add_u32 touches x[0..n) of an n-element buffer.
            unsafe { launch(&add, cfg(n), (x, 1u32, n)) }.map(move |(x, _, _)| (x, s))
        })
        .then(move |(x, s)| copy_d2h(x, outp).map(move |(x, _)| (x, s)))
        .graph()
        .unwrap();
    assert_eq!(input.to_vec().unwrap()[0], 0, "capture runs nothing");
    for step in 1..=4u32 {
        input.write(|v| v.fill(10 * step)).unwrap();
        graph.launch().sync_with(&*pool).unwrap();
        let out = output.to_vec().unwrap();
        assert!(
            out.iter().all(|&v| v == 10 * step + 1),
            "replay {step}: {:?}",
            &out[..4]
        );
    }

    // A read waits for the replay launched before it.
    input.write(|v| v.fill(100)).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        let f = graph.launch().schedule(&*pool).unwrap();
        let mut f = std::pin::pin!(f);
        let first = std::future::poll_fn(|cx| std::task::Poll::Ready(f.as_mut().poll(cx))).await;
        assert!(first.is_pending(), "a 20 ms spin cannot be done at once");
        let t = Instant::now();
        let seen = output.read(|v| (v[0], v[n as usize - 1])).unwrap();
        let waited = t.elapsed();
        assert_eq!(seen, (101, 101), "read before the replay's download ended");
        assert!(
            waited > Duration::from_millis(5),
            "the read waited only {waited:?}"
        );
        f.await.unwrap();
    });

    // Eager copies with shared memory, outside any graph.
    let x = h2d(vec![5u32; n as usize]).sync_with(&*pool).unwrap();
    let (x, _) = copy_d2h(x, output.clone()).sync_with(&*pool).unwrap();
    assert!(output.to_vec().unwrap().iter().all(|&v| v == 5));
    let (_, x) = copy_h2d(input.clone(), x).sync_with(&*pool).unwrap();
    assert!(d2h(x)
        .sync_with(&*pool)
        .unwrap()
        .to_vec()
        .unwrap()
        .iter()
        .all(|&v| v == 100));
    drop(graph);
    // The graph is gone: the handles alone keep the memory.
    assert_eq!(input.read(|v| v[7]).unwrap(), 100);
}

/// Views: kernels read and write parts of buffers (the pointer starts at
/// the view), a memset fills a view, downloads read views, and four
/// writable chunks of one buffer go to four concurrent arms; everything
/// outside the views is untouched.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn views_are_kernel_arguments_memset_targets_and_download_sources() {
    let pool = local();
    let k = kernels();
    let n = 1024usize;
    let src: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let x = h2d(src.clone()).sync_with(&*pool).unwrap();
    let mut y = h2d(vec![1.0f32; n]).sync_with(&*pool).unwrap();
    {
        let (_, tail) = y.split_at_mut(n / 2).unwrap();
        let m = (n / 4) as u32;
        // SAFETY: copy_add reads src[0..m) and writes dst[0..m); both views
        // hold n / 4 floats.
        unsafe {
            launch(
                &k.copy_add,
                cfg(m),
                (
                    x.slice(n / 4..n / 2).unwrap(),
                    tail.split_at(n / 4).unwrap().1,
                    0.5f32,
                    m,
                ),
            )
        }
        .sync_with(&*pool)
        .unwrap();
    }
    memset(y.slice_mut(10..20).unwrap(), 0)
        .sync_with(&*pool)
        .unwrap();
    let got = d2h(&y).sync_with(&*pool).unwrap().to_vec().unwrap();
    let mut want = vec![1.0f32; n];
    want[10..20].fill(0.0);
    for i in 0..n / 4 {
        want[3 * n / 4 + i] = src[n / 4 + i] + 0.5;
    }
    assert_eq!(got, want);
    let part = d2h(y.slice(3 * n / 4..).unwrap())
        .sync_with(&*pool)
        .unwrap();
    assert_eq!(part.as_slice().unwrap(), &want[3 * n / 4..]);
    let pinned = PinnedBuffer::filled(&dev(), 10, 7f32).unwrap();
    let (_, pinned) = copy_d2h(y.slice(5..15).unwrap(), pinned)
        .sync_with(&*pool)
        .unwrap();
    assert_eq!(pinned.as_slice().unwrap(), &want[5..15]);
    // Copies into views: from pinned memory, and from another view.
    copy_h2d(pinned, y.slice_mut(100..110).unwrap())
        .sync_with(&*pool)
        .unwrap();
    want.copy_within(5..15, 100);
    copy_d2d(x.slice(0..8).unwrap(), y.slice_mut(200..208).unwrap())
        .sync_with(&*pool)
        .unwrap();
    want[200..208].copy_from_slice(&src[0..8]);
    let copy = d2d(y.slice(96..212).unwrap())
        .then(d2h)
        .sync_with(&*pool)
        .unwrap();
    assert_eq!(copy.as_slice().unwrap(), &want[96..212]);
    assert_eq!(d2h(&y).sync_with(&*pool).unwrap().to_vec().unwrap(), want);

    // Four chunks of one buffer, each bumped by its own arm.
    let mut z = zeros::<u32>(4096).sync_with(&*pool).unwrap();
    {
        let arms: Vec<_> = z
            .chunks_mut(1024)
            .unwrap()
            .into_iter()
            .enumerate()
            .map(|(i, part)| {
                let add = k.add_u32.clone();
                // SAFETY: add_u32 touches part[0..1024) of a 1024-element view.
                unsafe { launch(&add, cfg(1024), (part, i as u32 + 1, 1024u32)) }.boxed()
            })
            .collect();
        join_all(arms).sync_with(&*pool).unwrap();
    }
    let z = d2h(z).sync_with(&*pool).unwrap().to_vec().unwrap();
    for (i, part) in z.chunks(1024).enumerate() {
        assert!(
            part.iter().all(|&v| v == i as u32 + 1),
            "chunk {i}: {:?}",
            &part[..4]
        );
    }
}

/// Two arms writing disjoint views of one buffer run at once (the GPU's
/// own clock shows the two spins overlap), and a read of the whole buffer
/// after them waits for both.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn disjoint_views_of_one_buffer_are_written_concurrently() {
    let pool = local();
    let k = kernels();
    let ms = 1_000_000u64;
    fn spin_view<'a>(
        k: &cuda_async::Kernel,
        part: cuda_async::DeviceSliceMut<'a, u64>,
        ns: u64,
    ) -> impl DeviceOp<Output = ()> + 'a {
        // SAFETY: spin writes stamps[0..2); the view has 2 elements.
        unsafe { launch(k, cfg(1), (ns, part)) }.map(|_| ())
    }
    let mut stamps = zeros::<u64>(4).sync_with(&*pool).unwrap();
    {
        // Warm up (module load, streams).
        let (a, b) = stamps.split_at_mut(2).unwrap();
        spin_view(&k.spin, a, 1000)
            .zip(spin_view(&k.spin, b, 1000))
            .sync_with(&*pool)
            .unwrap();
    }
    dev().context().synchronize().unwrap();
    {
        let (a, b) = stamps.split_at_mut(2).unwrap();
        spin_view(&k.spin, a, ms)
            .zip(spin_view(&k.spin, b, ms))
            .sync_with(&*pool)
            .unwrap();
    }
    let s = d2h(&stamps).sync_with(&*pool).unwrap().to_vec().unwrap();
    let ((a0, a1), (b0, b1)) = ((s[0], s[1]), (s[2], s[3]));
    eprintln!(
        "two 1 ms spins on disjoint views: overlap {} us",
        (a1.min(b1) as i64 - a0.max(b0) as i64) / 1000
    );
    assert!(a1 - a0 >= ms && b1 - b0 >= ms, "{s:?}");
    assert!(
        a0 < b1 && b0 < a1,
        "the views' writers did not overlap: a=[{a0},{a1}] b=[{b0},{b1}]"
    );
}

/// The pool a buffer's memory was allocated from
/// (`CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE`).
fn pool_of<T: cuda_async::DeviceRepr>(b: &cuda_async::DeviceBuffer<T>) -> sys::CUmemoryPool {
    use cuda_async::cudarc::driver::DevicePtr;
    let local = b.local().unwrap();
    let slice = local.as_cuda_slice();
    let (ptr, _g) = slice.device_ptr(slice.stream());
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: the attribute is a pool handle, written through a valid
    // pointer; `ptr` is a live allocation.
    unsafe {
        sys::cuPointerGetAttribute(
            (&mut pool as *mut sys::CUmemoryPool).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
            ptr,
        )
    }
    .result()
    .unwrap();
    pool
}

/// A chosen pool's statistics after a known sequence: zeros of 2 and 4 MiB
/// through a policy on the pool count 6 MiB in use (the device's default
/// pool sees none of it), the high mark stays at 6 MiB after the 4 MiB
/// buffer is freed, and a reset brings it down to 2 MiB; each buffer's
/// memory is the pool's (asked of the driver), and a round trip through
/// it returns the data.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn mem_pool_statistics_follow_a_known_sequence() {
    use cuda_async::{MemPool, MemPoolOptions};
    let d = dev();
    let pool = MemPool::new(&d, MemPoolOptions::default()).unwrap();
    let policy = (*local()).clone().with_mem_pool(pool.clone());
    let default = MemPool::default_of(&d).unwrap();
    d.context().synchronize().unwrap();
    let before = default.stats().unwrap().used;
    const MIB: u64 = 1 << 20;
    let a = zeros::<u8>(2 << 20).sync_with(&policy).unwrap();
    let b = zeros::<u8>(4 << 20).sync_with(&policy).unwrap();
    assert_eq!(
        pool_of(&a),
        pool.cu_pool(),
        "allocated from the chosen pool"
    );
    assert_ne!(pool_of(&a), default.cu_pool());
    let s = pool.stats().unwrap();
    assert_eq!((s.used, s.used_high), (6 * MIB, 6 * MIB), "{s:?}");
    assert!(s.reserved >= 6 * MIB, "{s:?}");
    assert_eq!(
        default.stats().unwrap().used,
        before,
        "the default pool is untouched"
    );
    drop(b);
    d.context().synchronize().unwrap();
    let s = pool.stats().unwrap();
    assert_eq!((s.used, s.used_high), (2 * MIB, 6 * MIB), "{s:?}");
    pool.reset_high_marks().unwrap();
    let s = pool.stats().unwrap();
    assert_eq!((s.used, s.used_high), (2 * MIB, 2 * MIB), "{s:?}");
    let data = Rng::new().f32s(1 << 16);
    let back = h2d(data.clone()).then(d2h).sync_with(&policy).unwrap();
    assert_eq!(back.as_slice().unwrap(), &data[..]);
    drop(a);
}

/// Two policies on two pools keep their allocations apart: each pool
/// counts its own policy's buffers (also inside a `zip`'s arms), and each
/// buffer's memory belongs to its policy's pool.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn mem_pool_two_policies_keep_their_allocations_apart() {
    use cuda_async::{MemPool, MemPoolOptions};
    let d = dev();
    let (pa, pb) = (
        MemPool::new(&d, MemPoolOptions::default()).unwrap(),
        MemPool::new(&d, MemPoolOptions::default()).unwrap(),
    );
    let a = (*local()).clone().with_mem_pool(pa.clone());
    let b = (*local()).clone().with_mem_pool(pb.clone());
    const MIB: u64 = 1 << 20;
    let (x, y) = zeros::<u8>(8 << 20)
        .zip(zeros::<u8>(2 << 20))
        .sync_with(&a)
        .unwrap();
    let z = zeros::<u8>(4 << 20).sync_with(&b).unwrap();
    assert_eq!(pa.stats().unwrap().used, 10 * MIB);
    assert_eq!(pb.stats().unwrap().used, 4 * MIB);
    assert_eq!(pool_of(&x), pa.cu_pool());
    assert_eq!(
        pool_of(&y),
        pa.cu_pool(),
        "a zip's arm allocates from the pool too"
    );
    assert_eq!(pool_of(&z), pb.cu_pool());
    drop((x, y, z));
    d.context().synchronize().unwrap();
    assert_eq!((pa.stats().unwrap().used, pb.stats().unwrap().used), (0, 0));
}

/// The release threshold: a pool that keeps nothing hands a freed 64 MiB
/// back at the next synchronization; one that keeps 256 MiB still
/// reserves it, until trimmed.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn mem_pool_release_threshold_is_honoured() {
    use cuda_async::{MemPool, MemPoolOptions};
    let d = dev();
    const MIB: u64 = 1 << 20;
    let cases = [(0u64, false), (256 * MIB, true)];
    for (threshold, kept) in cases {
        let pool =
            MemPool::new(&d, MemPoolOptions::default().release_threshold(threshold)).unwrap();
        assert_eq!(pool.release_threshold().unwrap(), threshold);
        let policy = (*local()).clone().with_mem_pool(pool.clone());
        let buf = zeros::<u8>(64 << 20).sync_with(&policy).unwrap();
        drop(buf);
        d.context().synchronize().unwrap();
        let s = pool.stats().unwrap();
        assert_eq!(s.used, 0, "{s:?}");
        assert_eq!(s.reserved >= 64 * MIB, kept, "threshold {threshold}: {s:?}");
        assert!(s.reserved_high >= 64 * MIB, "{s:?}");
        pool.trim_to(0).unwrap();
        assert_eq!(pool.stats().unwrap().reserved, 0, "trimmed");
    }
}

/// A pool whose every handle is dropped while an op that allocated from
/// it is still running on the GPU stays alive until the op and its
/// buffers are done: the op's result is right, its buffer (freed after
/// the last handle is gone) reads back intact (run under memcheck), and
/// pools made and destroyed afterwards are fine.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn mem_pool_dropped_while_an_op_allocates_stays_alive() {
    use cuda_async::{MemPool, MemPoolOptions};
    let k = kernels();
    let d = dev();
    let pool = MemPool::new(&d, MemPoolOptions::default()).unwrap();
    let raw = pool.cu_pool();
    let policy = (*local()).clone().with_mem_pool(pool);
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let data = Rng::new().f32s(1 << 20);
    let fut = suite::spin_op(&k.spin, 20_000_000)
        .zip(h2d(data.clone()))
        .schedule(&policy)
        .unwrap();
    // The policy held the pool's last handle (the running op's context
    // holds none after submission).
    drop(policy);
    let (_, buf) = rt.block_on(fut).unwrap();
    assert_eq!(pool_of(&buf), raw, "allocated from the dropped pool");
    let back = d2h(&buf).sync_with(&*local()).unwrap();
    assert_eq!(back.as_slice().unwrap(), &data[..]);
    drop(buf);
    d.context().synchronize().unwrap();
    // A pool destroyed while its memory was outstanding broke the driver
    // (H100, driver 580): the next pool's destroy faulted inside libcuda.
    // The buffers hold their pool until their frees have run, so these
    // are plain.
    for _ in 0..3 {
        drop(MemPool::new(&d, MemPoolOptions::default()).unwrap());
    }
}

/// Graph captures allocate from a pool too (inside `MemPool::allocate_in`),
/// and `Device::set_mem_pool` changes where every allocation of the device
/// comes from: the pool made current serves the default policy while it
/// is current (kept alive by the device though its handle is dropped),
/// and the default pool again once restored.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn mem_pool_serves_graph_captures_and_can_be_made_current() {
    use cuda_async::{MemPool, MemPoolOptions};
    let d = dev();
    let pool = MemPool::new(&d, MemPoolOptions::default()).unwrap();
    let g = pool.allocate_in(|| zeros::<u8>(2 << 20).graph()).unwrap();
    g.launch().sync().unwrap();
    assert_eq!(pool_of(g.output()), pool.cu_pool(), "the capture's buffer");
    assert!(pool.stats().unwrap().used >= 2 << 20);
    drop(g);
    let default = MemPool::default_of(&d).unwrap();
    let other = MemPool::new(&d, MemPoolOptions::default()).unwrap();
    let raw = other.cu_pool();
    d.set_mem_pool(&other).unwrap();
    assert_eq!(MemPool::current_of(&d).unwrap(), other);
    drop(other);
    let b = zeros::<u8>(1 << 20).sync().unwrap();
    assert_eq!(
        pool_of(&b),
        raw,
        "the current pool serves the default policy"
    );
    d.set_mem_pool(&default).unwrap();
    let c = zeros::<u8>(1 << 20).sync().unwrap();
    assert_eq!(pool_of(&c), default.cu_pool(), "restored");
    drop((b, c));
    d.context().synchronize().unwrap();
}
