//! CPU tests: what must hold with or without a GPU.

use std::future::IntoFuture;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;
use std::task::Poll;

use cuda_async::prelude::*;
use cuda_async::remote::{Op, Recording, RemoteCompletion};
use cuda_async::{DeviceBuffer, DeviceFuture, Error, PinnedBuffer, RemoteSession};
use static_assertions::{assert_impl_all, assert_not_impl_any};

// Send/Sync are earned: buffers are Send/Sync exactly when their elements are.
assert_impl_all!(DeviceBuffer<f32>: Send, Sync);
assert_impl_all!(PinnedBuffer<f32>: Send, Sync);
assert_impl_all!(cuda_async::HostBuffer<f32>: Send, Sync);
assert_not_impl_any!(DeviceBuffer<std::rc::Rc<u8>>: Send, Sync);
assert_not_impl_any!(PinnedBuffer<std::rc::Rc<u8>>: Send, Sync);
assert_not_impl_any!(PinnedBuffer<std::cell::Cell<u8>>: Sync);
// Futures and ops can be spawned on multi-threaded executors.
assert_impl_all!(DeviceFuture<cuda_async::combinators::Value<i32>>: Send, Unpin);
assert_impl_all!(cuda_async::combinators::Value<i32>: Send);
assert_impl_all!(cuda_async::combinators::Shared<cuda_async::combinators::Value<i32>>: Send, Sync, Clone);
assert_impl_all!(BoxedOp<'static, i32>: Send);
assert_not_impl_any!(BoxedOp<'static, i32>: Sync);
assert_impl_all!(dyn cuda_async::SchedulingPolicy: Send, Sync);
assert_impl_all!(Error: Send, Sync, Clone, std::error::Error);
// Kernels are descriptions: shared across threads, cloned into closures.
assert_impl_all!(cuda_async::Kernel: Send, Sync, Clone);
assert_impl_all!(cuda_async::Module: Send, Sync, Clone, Eq);
assert_impl_all!(cuda_async::MemPool: Send, Sync, Clone, Eq);

fn poll_once<F: std::future::Future + Unpin>(mut f: F) -> Poll<F::Output> {
    let mut cx = futures_test::task::noop_context();
    std::pin::Pin::new(&mut f).poll(&mut cx)
}

/// With a driver, these succeed; without one (CI), each returns
/// `Error::NoDriver` instead of panicking. Both branches assert.
#[test]
fn without_a_driver_every_entry_point_is_an_error_not_a_panic() {
    let present = cuda_async::driver_present();
    let check = |what: &str, r: Result<(), Error>| match (present, r) {
        (true, Ok(())) => {}
        (false, Err(Error::NoDriver)) => {}
        (p, r) => panic!("{what}: driver present={p}, got {r:?}"),
    };
    check("devices", cuda_async::devices().map(|_| ()));
    check("device_count", cuda_async::device_count().map(|_| ()));
    check("Device::new", cuda_async::Device::new(0).map(|_| ()));
    check("default_policy", cuda_async::default_policy().map(|_| ()));
    check("DevicePool::all", cuda_async::DevicePool::all().map(|_| ()));
    check(
        "MemPool::new",
        cuda_async::Device::new(0)
            .and_then(|d| cuda_async::MemPool::new(&d, Default::default()))
            .map(|_| ()),
    );
    check(
        "a policy on a chosen pool",
        cuda_async::Device::new(0)
            .and_then(|d| {
                let pool = cuda_async::MemPool::default_of(&d)?;
                let policy = StreamPoolRoundRobin::default_for(&d)?.with_mem_pool(pool);
                value(1).sync_with(&policy)
            })
            .map(|_| ()),
    );
    check("sync", value(1).sync().map(|_| ()));
    check(
        "await",
        match poll_once(value(1).into_future()) {
            Poll::Ready(r) => r.map(|_| ()),
            Poll::Pending => panic!("a value op with no GPU work must not stay pending"),
        },
    );
    if !present {
        let e = value(1).sync().unwrap_err().to_string();
        assert!(e.starts_with("no NVIDIA driver found"), "{e}");
    }
}

/// A remote session that answers every submission at once (its reads come
/// back zeroed) and counts what reached it: the ids handed out, the
/// submissions and their commands, the frees.
#[derive(Debug, Default)]
struct Counting {
    ids: AtomicU64,
    submissions: AtomicUsize,
    commands: AtomicUsize,
    frees: AtomicUsize,
    /// Per submission: the thread that submitted it and the sizes it
    /// allocated.
    submitted: std::sync::Mutex<Vec<(Option<String>, Vec<u64>)>>,
}

impl Counting {
    /// (ids, submissions, commands, frees) so far.
    fn seen(&self) -> (u64, usize, usize, usize) {
        (
            self.ids.load(SeqCst),
            self.submissions.load(SeqCst),
            self.commands.load(SeqCst),
            self.frees.load(SeqCst),
        )
    }
}

impl RemoteSession for Counting {
    fn describe(&self) -> String {
        "counting".into()
    }
    fn fresh_id(&self) -> u64 {
        self.ids.fetch_add(1, SeqCst) + 1
    }
    fn submit(&self, r: Recording, done: RemoteCompletion) {
        for slot in r.reads() {
            slot.receive(|b| {
                b.fill(0);
                Ok(())
            })
            .unwrap();
        }
        self.commands.fetch_add(r.commands().len(), SeqCst);
        let frees = r
            .commands()
            .iter()
            .filter(|c| matches!(c.op, Op::Free { .. }));
        self.frees.fetch_add(frees.count(), SeqCst);
        self.submissions.fetch_add(1, SeqCst);
        let allocs = r.commands().iter().filter_map(|c| match c.op {
            Op::Alloc { size, .. } => Some(size),
            _ => None,
        });
        self.submitted.lock().unwrap().push((
            std::thread::current().name().map(str::to_owned),
            allocs.collect(),
        ));
        done.complete();
    }
}

#[test]
fn a_future_dropped_before_its_first_poll_enqueues_nothing() {
    let session = Arc::new(Counting::default());
    let remote = RemotePolicy::new(&session);
    let op = || h2d(vec![1.0f32; 16]).then(d2h).map(|h| h.len());
    // Built, scheduled and dropped unpolled: nothing reaches the session.
    let fut = op().schedule(&remote).unwrap();
    assert!(!fut.is_submitted());
    drop(fut);
    assert_eq!(session.seen(), (0, 0, 0, 0), "an unpolled future sent work");
    // The same future polled once does send it (the count sees a submission).
    let mut fut = op().schedule(&remote).unwrap();
    assert!(poll_once(&mut fut).is_ready());
    let (ids, submissions, commands, _) = session.seen();
    assert_eq!(submissions, 1);
    assert!(ids >= 1 && commands >= 3, "{:?}", session.seen());
    // With no policy (the default one, resolved at the first poll): built
    // and dropped without a driver call, so no error either.
    let fut = op().into_device_future();
    assert!(!fut.is_submitted());
    drop(fut);
}

#[test]
fn ops_are_lazy_values_that_live_in_collections_and_cross_threads() {
    let session = Arc::new(Counting::default());
    let remote = RemotePolicy::new(&session);
    let ran = Arc::new(AtomicUsize::new(0));
    let ops: Vec<BoxedOp<'static, usize>> = (0..4)
        .map(|i| {
            let ran = ran.clone();
            h2d(vec![7u8; i + 1])
                .then(d2h)
                .map(move |h| {
                    ran.fetch_add(1, SeqCst);
                    h.len() * 2
                })
                .boxed()
        })
        .collect();
    // Moved to another thread and back: still only descriptions.
    let ops = std::thread::spawn(move || ops).join().unwrap();
    assert_eq!(ran.load(SeqCst), 0, "building an op ran it");
    assert_eq!(session.seen(), (0, 0, 0, 0), "building an op sent it");
    // Run: every closure once, all four arms in one message.
    let outs = join_all(ops).sync_with(&remote).unwrap();
    assert_eq!(outs, [2, 4, 6, 8]);
    assert_eq!(ran.load(SeqCst), 4);
    assert_eq!(session.seen().1, 1, "{:?}", session.seen());
}

/// Runs `f` on a thread with a 256 KiB stack: a chain that recursed per
/// link would overflow it within a few thousand links.
fn on_a_small_stack<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::Builder::new()
        .stack_size(256 << 10)
        .spawn(f)
        .unwrap()
        .join()
        .unwrap()
}

#[test]
fn a_boxed_chain_built_in_a_loop_runs_and_drops_without_recursing() {
    let links = 200_000u64;
    let sum = on_a_small_stack(move || {
        let session = Arc::new(Counting::default());
        let remote = RemotePolicy::new(&session);
        let chain = || {
            let mut op = value(0u64).boxed();
            for i in 1..=links {
                op = if i % 2 == 0 {
                    op.then(move |x| value(x + i)).boxed()
                } else {
                    op.map(move |x| x + i).boxed()
                };
            }
            op
        };
        // Built and dropped unrun: its steps are dropped in a loop too.
        drop(chain());
        chain().sync_with(&remote).unwrap()
    });
    assert_eq!(sum, links * (links + 1) / 2);
}

/// A value that counts itself in its `Arc`.
#[derive(Clone, Debug)]
struct Counted<const N: usize>(Arc<()>, [u64; N]);

/// A closure capture aligned beyond the chain's buffer.
#[derive(Clone, Copy)]
#[repr(align(64))]
struct Wide(u64);

/// An op that fails, naming its step.
struct Fails(&'static str);

impl DeviceOp for Fails {
    type Output = Counted<1>;

    unsafe fn execute(
        self,
        _ctx: &mut cuda_async::ExecutionContext,
    ) -> cuda_async::Result<Counted<1>> {
        Err(Error::InvalidArgument(self.0.into()))
    }
}
cuda_async::awaitable!(Fails);

#[test]
fn a_boxed_chain_that_fails_or_panics_midway_drops_each_value_once() {
    let session = Arc::new(Counting::default());
    let remote = RemotePolicy::new(&session);
    let tok = Arc::new(());
    // Values in the slot and out of it (16 elements: 136 bytes), captures
    // in place and boxed (over-aligned), then a failure or a panic with
    // steps left to run, each holding a count.
    let chain = |end: u8| {
        let (t1, t2, t3, t4) = (tok.clone(), tok.clone(), tok.clone(), tok.clone());
        let wide = Wide(5);
        let op = value(Counted(tok.clone(), [1; 1]))
            .boxed()
            .map(move |c| Counted(t1, [c.1[0] + wide.0; 16]))
            .then(move |c| {
                drop(t2);
                value(Counted(c.0, [c.1[15]; 1]))
            })
            .then(move |c: Counted<1>| {
                let _held = t4;
                assert!(end != b'p', "the step panics");
                drop(c);
                Fails(if end == b'e' { "step 3" } else { "never" })
            });
        let rest = op.map(move |c| (t3, c));
        assert_eq!(Arc::strong_count(&tok), 6, "the built chain holds five");
        rest
    };
    let err = chain(b'e').sync_with(&remote).unwrap_err();
    assert!(err.to_string().contains("step 3"), "{err}");
    assert_eq!(
        Arc::strong_count(&tok),
        1,
        "a value leaked or dropped twice"
    );
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        chain(b'p').sync_with(&remote)
    }));
    assert!(panicked.is_err());
    assert_eq!(
        Arc::strong_count(&tok),
        1,
        "a value leaked or dropped twice"
    );
    drop(chain(b'e'));
    assert_eq!(Arc::strong_count(&tok), 1, "an unrun chain leaked");
    // And one that runs to the end hands out its value with its counts.
    let ok = value(Counted(tok.clone(), [2; 16]))
        .boxed()
        .map(|c| Counted(c.0, [c.1[3] + Wide(1).0; 3]))
        .sync_with(&remote)
        .unwrap();
    assert_eq!((Arc::strong_count(&tok), ok.1), (2, [3; 3]));
}

/// Kernel values are made with no driver and no GPU (a GPU-less client can
/// build them); nothing compiles until a device runs them.
#[test]
fn modules_and_kernels_are_made_without_a_driver() {
    let src = r#"extern "C" __global__ void scale(float* x, float a) { x[threadIdx.x] *= a; }"#;
    let m = cuda_async::Module::cuda(src, &[])
        .unwrap()
        .named("scale.cu");
    let k = m.kernel("scale").unwrap();
    let k2 = k.clone();
    std::thread::spawn(move || assert_eq!(k2.name(), "scale"))
        .join()
        .unwrap();
    assert_eq!(k.module().name(), "scale.cu");
    // Hashes differ when source or options differ, not when only the name does.
    let other_opts = cuda_async::Module::cuda(src, &["-lineinfo"]).unwrap();
    let other_src = cuda_async::Module::cuda(format!("{src}\n"), &[]).unwrap();
    assert_ne!(m.hash(), other_opts.hash());
    assert_ne!(m.hash(), other_src.hash());
    assert_eq!(m.hash(), cuda_async::Module::cuda(src, &[]).unwrap().hash());
    // Building an op with it needs no driver either; running one does.
    // SAFETY: never launched on a GPU here (no driver: an error; with one,
    // `scale` touches x[0..1) of a 1-element buffer).
    let op = zeros::<f32>(1).then(move |x| unsafe {
        launch(&k, cuda_async::LaunchConfig::for_num_elems(1), (x, 2.0f32))
    });
    if !cuda_async::driver_present() {
        assert!(matches!(op.sync(), Err(Error::NoDriver)));
        // A host step needs a stream, so a driver, too.
        let step = cuda_async::host_step(|| 1u8);
        assert!(matches!(step.sync(), Err(Error::NoDriver)));
    }
}

/// The typed launchers of `tests/kernels/typed.cu` (see `gpu.rs` for them
/// running).
mod typed {
    cuda_async::kernels!("tests/kernels/typed.cu");
}

/// The same signature source with a precompiled PTX embedded instead.
mod typed_ptx {
    cuda_async::kernels!("tests/kernels/scale.cu", ptx = "tests/kernels/scale.ptx");
}

#[test]
fn kernels_macro_generates_a_typed_launcher_per_kernel_of_the_file() {
    let m = typed::module();
    for name in ["saxpy", "block_sums", "transpose", "blend", "spin_stamp"] {
        assert!(m.kernel(name).is_ok(), "{name}");
    }
    // The launchers' signatures, as a user sees them (not run: no GPU here).
    type Saxpy<'a> = (f32, &'a DeviceBuffer<f32>, DeviceBuffer<f32>, i32);
    fn saxpy(x: &DeviceBuffer<f32>, y: DeviceBuffer<f32>) -> impl DeviceOp<Output = Saxpy<'_>> {
        // SAFETY: never executed.
        unsafe { typed::saxpy(cuda_async::LaunchConfig::for_num_elems(4), 2.0, x, y, 4) }
    }
    fn blend<'a>(
        a: std::sync::Arc<DeviceBuffer<f32>>,
        b: &'a DeviceBuffer<f64>,
        mask: &'a mut DeviceBuffer<i32>,
        out: DeviceBuffer<f32>,
    ) -> impl DeviceOp + 'a {
        // SAFETY: never executed.
        unsafe {
            typed::blend(
                cuda_async::LaunchConfig::for_num_elems(4),
                a,
                b,
                mask,
                out,
                0.5,
                0.25,
                4,
            )
        }
    }
    let _ = (saxpy, blend);
    // The `ptx =` form embeds the PTX: its parameter list is known now.
    let m = typed_ptx::module();
    assert!(matches!(m.source(), cuda_async::ModuleSource::Ptx(_)));
    assert_eq!(m.kernel("scale").unwrap().params().map(<[_]>::len), Some(4));
}

/// Library ops check their shapes before anything runs; a GEMM and a
/// random fill are one command each on a remote context, and the others
/// name themselves when they need a local stream (a remote context has
/// none).
#[test]
fn library_and_foreign_ops_check_shapes_first_and_run_remotely_or_need_a_local_stream() {
    use cuda_async::blas::{gemm, Gemm};
    use cuda_async::foreign::{on_stream, reads, writes};
    let session = Arc::new(Counting::default());
    let remote = RemotePolicy::new(&session);
    let buf = |n| zeros::<f32>(n).sync_with(&remote).unwrap();
    let (a, b, c) = (buf(12), buf(5), buf(8));
    let e = gemm(Gemm::new(4, 2, 3), &a, &b, c)
        .sync_with(&remote)
        .unwrap_err();
    assert!(
        matches!(&e, cuda_async::Error::InvalidArgument(m) if m.contains("B holds 5 elements")),
        "{e}"
    );
    // A product that fits is one command on a remote context: the node
    // runs it with its own cuBLAS.
    let (b, c) = (buf(6), buf(8));
    let before = session.seen().2;
    gemm(Gemm::new(4, 2, 3), &a, &b, c)
        .sync_with(&remote)
        .expect("a remote gemm is recorded");
    assert_eq!(session.seen().2, before + 1, "one command");
    let e = on_stream("cusparse spmv", (reads(&a), writes(buf(4))), |_, _| Ok(()))
        .sync_with(&remote)
        .unwrap_err();
    assert!(
        matches!(&e, cuda_async::Error::NeedsLocalStream { op, .. } if op == "cusparse spmv"),
        "{e}"
    );
    use cuda_async::blas::{gemv, Gemv};
    let e = gemv(Gemv::new(4, 3), &a, buf(2), buf(4))
        .sync_with(&remote)
        .unwrap_err();
    assert!(
        matches!(&e, cuda_async::Error::InvalidArgument(m) if m.contains("x holds 2 elements")),
        "{e}"
    );
    let e = gemv(Gemv::new(4, 3), &a, buf(3), buf(4))
        .sync_with(&remote)
        .unwrap_err();
    assert!(
        matches!(&e, cuda_async::Error::NeedsLocalStream { op, .. } if op == "gemv"),
        "{e}"
    );
    use cuda_async::rand::{normal, uniform};
    let e = normal(1, 0.0f32, 1.0, buf(7))
        .sync_with(&remote)
        .unwrap_err();
    assert!(
        matches!(&e, cuda_async::Error::InvalidArgument(m) if m.contains("7 elements")),
        "{e}"
    );
    // A fill that fits is one command too: the node's cuRAND fills it.
    let x = buf(7);
    let before = session.seen().2;
    uniform(1, x)
        .sync_with(&remote)
        .expect("a remote fill is recorded");
    assert_eq!(session.seen().2, before + 1, "one command");
}

/// A bf16 or f16 GEMM on a remote context is one command, as an f32 one
/// is (its shapes still checked first); a half GEMV needs a local stream
/// as every gemv does.
#[test]
fn a_half_gemm_on_a_remote_context_is_one_command() {
    use cuda_async::blas::{gemm, gemv, Gemm, Gemv};
    use cuda_async::half::{bf16, f16};
    let session = Arc::new(Counting::default());
    let remote = RemotePolicy::new(&session);
    let bf = |n| zeros::<bf16>(n).sync_with(&remote).unwrap();
    let (a, b, c) = (bf(12), bf(5), bf(8));
    let e = gemm(Gemm::new(4, 2, 3), &a, &b, c)
        .sync_with(&remote)
        .unwrap_err();
    assert!(
        matches!(&e, Error::InvalidArgument(m) if m.contains("B holds 5 elements")),
        "{e}"
    );
    let (b, mut c) = (bf(6), bf(8));
    let before = session.seen().2;
    gemm(Gemm::new(4, 2, 3), &a, &b, &mut c)
        .sync_with(&remote)
        .expect("a remote bf16 product is recorded");
    assert_eq!(session.seen().2, before + 1, "one command");
    let h = |n| zeros::<f16>(n).sync_with(&remote).unwrap();
    let (a, b, c) = (h(12), h(12), h(12));
    let before = session.seen().2;
    gemm(Gemm::new(2, 2, 2).batched(3), a, b, c)
        .sync_with(&remote)
        .expect("a remote f16 batch is recorded");
    assert_eq!(session.seen().2, before + 1, "one command");
    let (a, x, y) = (h(12), h(3), h(4));
    let e = gemv(Gemv::new(4, 3), a, x, y)
        .sync_with(&remote)
        .unwrap_err();
    assert!(
        matches!(&e, Error::NeedsLocalStream { op, .. } if op == "gemv"),
        "{e}"
    );
}

#[test]
fn an_idle_submit_thread_lets_the_caller_enqueue_at_once_in_order() {
    let session = Arc::new(Counting::default());
    let remote = RemotePolicy::new(&session);
    let submit = cuda_async::SubmitThread::new().unwrap();
    let me = std::thread::current().name().map(str::to_owned);
    let futs: Vec<_> = (0..8usize)
        .map(|i| {
            let f = submit.enqueue(
                h2d(vec![1.0f32; i + 1])
                    .then(d2h)
                    .schedule(&remote)
                    .unwrap(),
            );
            // Sent before `enqueue` returned, from this thread.
            assert_eq!(session.seen().1, i + 1);
            f
        })
        .collect();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        for (i, f) in futs.into_iter().enumerate() {
            assert_eq!(f.await.unwrap().len(), i + 1);
        }
    });
    let submitted = session.submitted.lock().unwrap();
    let expected: Vec<_> = (1..=8).map(|n| (me.clone(), vec![4 * n])).collect();
    assert_eq!(*submitted, expected);
}

#[test]
fn a_busy_submit_thread_enqueues_what_it_is_handed_in_order() {
    let session = Arc::new(Counting::default());
    let remote = RemotePolicy::new(&session);
    // (Allocated on this thread: the first submission.)
    let a = zeros::<f32>(1).sync_with(&remote).unwrap();
    let submit = Arc::new(cuda_async::SubmitThread::new().unwrap());
    // An op that holds the enqueuing (inline, on another thread) until
    // released: what is handed over meanwhile goes to the thread.
    let (started, wait_started) = std::sync::mpsc::channel();
    let (release, gate) = std::sync::mpsc::channel::<()>();
    let blocker = h2d(vec![0.0f32; 100]).then(move |b| {
        started.send(()).unwrap();
        gate.recv().unwrap();
        d2h(b)
    });
    let blocker = blocker.schedule(&remote).unwrap();
    let holder = {
        let submit = submit.clone();
        std::thread::spawn(move || submit.enqueue(blocker))
    };
    wait_started.recv().unwrap();
    let op = |i: usize| h2d(vec![1.0f32; i + 1]).then(d2h).map(|h| h.len());
    let futs: Vec<_> = (0..32)
        .map(|i| submit.enqueue(op(i).schedule(&remote).unwrap()))
        .collect();
    // Handed over and dropped at once: enqueued all the same.
    drop(submit.enqueue(op(32).schedule(&remote).unwrap()));
    // An op that fails when enqueued fails its future.
    let reads = (cuda_async::foreign::reads(a),);
    let local_only = cuda_async::foreign::on_stream("cusparse spmv", reads, |_, _| Ok(()));
    let failed = submit.enqueue(local_only.schedule(&remote).unwrap());
    assert_eq!(session.seen().1, 1, "only the allocation was sent");
    release.send(()).unwrap();
    let blocked = holder.join().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let lens = rt.block_on(async {
        assert_eq!(blocked.await.unwrap().len(), 100);
        let mut lens = Vec::new();
        for f in futs {
            lens.push(f.await.unwrap());
        }
        let e = failed.await.unwrap_err();
        assert!(matches!(&e, Error::NeedsLocalStream { .. }), "{e}");
        lens
    });
    assert_eq!(lens, (1..=32).collect::<Vec<_>>());
    drop(submit);
    // (Then the free of `a`, which the failed op dropped.)
    let submitted = &session.submitted.lock().unwrap()[1..35];
    let sizes: Vec<Vec<u64>> = submitted.iter().map(|s| s.1.clone()).collect();
    let mut expected = vec![vec![400]];
    expected.extend((1..=33).map(|n| vec![4 * n]));
    assert_eq!(sizes, expected, "in the order handed, the dropped one too");
    assert!(
        submitted[1..]
            .iter()
            .all(|(t, _)| t.as_deref() == Some("cuda-async-submit")),
        "{submitted:?}"
    );
}
