//! `cuda-async` ops on a leased GPU: the same `DeviceOp` pipeline, written
//! once, runs through a `RemotePolicy` against an embedded node with the
//! in-memory device and its host test kernels, one message per submission.

use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use cuda_async::blas::{gemm, Gemm};
use cuda_async::prelude::*;
use cuda_async::{
    DeviceBuffer, Error, ExecutionContext, HostBuffer, Kernel, LaunchConfig, Module,
    RemoteErrorKind as ErrorKind,
};
use cuda_lease::client::Lease;
use cuda_lease::remote::{BlockingLease, LeaseBackend};
use cuda_lease_node::node::Node;

const KERNELS: &str = r#"
extern "C" __global__ void axpy(float a, const float* x, float* y, unsigned n) {}
extern "C" __global__ void vadd(const float* a, const float* b, float* c, unsigned n) {}
extern "C" __global__ void __fault() {}
"#;

#[derive(Clone)]
struct Kernels {
    axpy: Kernel,
    vadd: Kernel,
    fault: Kernel,
}

fn kernels() -> Kernels {
    let m = Module::cuda(KERNELS, &[]).unwrap();
    Kernels {
        axpy: m.kernel("axpy").unwrap(),
        vadd: m.kernel("vadd").unwrap(),
        fault: m.kernel("__fault").unwrap(),
    }
}

fn cfg(n: u32) -> LaunchConfig {
    LaunchConfig::for_num_elems(n)
}

/// The pipeline, written once for any backend: `c = x + (a*x + y)`, with
/// uploads, a zip, two launches, a device copy, an allocation and a
/// download.
fn pipeline(
    x: Vec<f32>,
    y: Vec<f32>,
    a: f32,
    k: &Kernels,
) -> impl DeviceOp<Output = HostBuffer<f32>> {
    let n = x.len() as u32;
    let (axpy, vadd) = (k.axpy.clone(), k.vadd.clone());
    h2d(x)
        .zip(h2d(y))
        .then(move |(x, y)| {
            let x = Arc::new(x);
            // SAFETY: axpy touches x[0..n) and y[0..n); both hold n floats.
            unsafe { launch(&axpy, cfg(n), (a, x.clone(), y, n)) }.map(move |(_, _, y, _)| (x, y))
        })
        .then(move |(x, y)| {
            d2d(y)
                .zip(zeros::<f32>(n as usize))
                .map(move |(y2, c)| (x, y2, c))
        })
        // SAFETY: vadd touches a, b, c [0..n); all hold n floats.
        .then(move |(x, y2, c)| unsafe { launch(&vadd, cfg(n), (x, Arc::new(y2), c, n)) })
        .then(|(_, _, c, _)| d2h(c))
}

fn reference(x: &[f32], y: &[f32], a: f32) -> Vec<f32> {
    x.iter().zip(y).map(|(x, y)| x + (a * x + y)).collect()
}

/// The node's `gpu_vram_allocated_bytes`: what its leases hold.
fn vram_allocated(node: &Node) -> u64 {
    metric(&node.metrics_text(), "gpu_vram_allocated_bytes").expect("gpu_vram_allocated_bytes")
}

#[tokio::test]
async fn a_pipeline_written_once_runs_on_a_leased_gpu_in_one_message() {
    let fx = Fixture::node_path(1 << 22).lease(1 << 20).start().await;
    let (node, lease) = (&fx.node, fx.lease());
    let remote = fx.policy();
    let k = kernels();
    for (n, seed) in [(1000usize, 7u64), (4097, 11), (1, 3)] {
        let (x, y) = (random_f32(n, seed), random_f32(n, seed * 31));
        let before = batches(node);
        let out = pipeline(x.clone(), y.clone(), 1.5, &k)
            .schedule(&remote)
            .unwrap()
            .await
            .unwrap();
        assert!(out.is_remote());
        assert_eq!(out.to_vec().unwrap(), reference(&x, &y, 1.5), "n = {n}");
        // Eleven ops and their frees: one message.
        assert_eq!(batches(node).0 - before.0, 1, "n = {n}");
    }
    // Empty buffers work as they do locally.
    let empty = h2d(Vec::<f32>::new())
        .then(d2h)
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    assert!(empty.is_empty() && empty.to_vec().unwrap().is_empty());
    let z: HostBuffer<u64> = zeros::<u64>(0)
        .then(|b| memset(b, 1))
        .then(d2d)
        .then(d2h)
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    assert!(z.is_empty());
    // `run_on` is the same, as one call.
    let (x, y) = (random_f32(64, 5), random_f32(64, 6));
    let out = cuda_async::run_on(pipeline(x.clone(), y.clone(), -2.0, &k), &remote)
        .await
        .unwrap();
    assert_eq!(out.to_vec().unwrap(), reference(&x, &y, -2.0));
    // Every buffer of the pipelines was freed on the node: the ones dropped
    // while recording within their own message, none left behind. What
    // stays charged is the module's source, once per lease.
    let module = KERNELS.len() as u64;
    assert!(
        eventually(Duration::from_secs(5), || async {
            lease.query().await.unwrap().allocated == module
        })
        .await,
        "node memory left allocated: {:?}",
        lease.query().await.unwrap()
    );
    fx.shutdown().await;
}

#[tokio::test]
async fn a_chain_of_twenty_ops_is_one_message() {
    let fx = Fixture::node_path(1 << 22).lease(1 << 20).start().await;
    let node = &fx.node;
    let remote = fx.policy();
    let k = kernels();
    let n = 512u32;
    let x = random_f32(n as usize, 99);
    // h2d, zeros, 17 launches, d2h: 20 ops.
    let mut chain = h2d(x.clone())
        .map(Arc::new)
        .zip(zeros::<f32>(n as usize))
        .boxed();
    for _ in 0..17 {
        let axpy = k.axpy.clone();
        chain = chain
            // SAFETY: axpy touches x[0..n) and y[0..n); both hold n floats.
            .then(move |(x, y)| unsafe { launch(&axpy, cfg(n), (0.5f32, x, y, n)) })
            .map(|(_, x, y, _)| (x, y))
            .boxed();
    }
    let chain = chain.then(|(_, y)| d2h(y));
    let before = batches(node);
    let out = chain.schedule(&remote).unwrap().await.unwrap();
    let after = batches(node);
    assert_eq!(after.0 - before.0, 1, "one message");
    assert!(after.1 - before.1 >= 20, "{} commands", after.1 - before.1);
    let want: Vec<f32> = x
        .iter()
        .map(|v| (0..17).fold(0.0f32, |acc, _| 0.5 * v + acc))
        .collect();
    assert_eq!(out.to_vec().unwrap(), want);
    fx.shutdown().await;
}

/// A hand-written op that enqueues on a local CUDA stream itself.
struct LocalOnly;

impl DeviceOp for LocalOnly {
    type Output = ();
    unsafe fn execute(self, ctx: &mut ExecutionContext) -> cuda_async::Result<()> {
        ctx.cuda_stream()?;
        Ok(())
    }
}
cuda_async::awaitable!(LocalOnly);

#[tokio::test]
async fn every_remote_failure_is_a_matchable_error() {
    let fx = Fixture::node_path(1 << 22)
        .manual_clock()
        .lease(1 << 16)
        .start()
        .await;
    let (node, clock) = (&fx.node, fx.clock());
    let remote = fx.policy();
    let k = kernels();

    // Beyond the lease's reservation.
    let e = zeros::<u8>(1 << 20)
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap_err();
    assert!(matches!(e.remote_kind(), Some(ErrorKind::Capacity)), "{e}");

    // A module that does not compile: the node's compile log comes back.
    let bad = Module::cuda("#error no\n__global__ void k() {}", &[])
        .unwrap()
        .kernel("k")
        .unwrap();
    // SAFETY: never runs (does not compile).
    let e = unsafe { launch(&bad, cfg(1), ()) }
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap_err();
    assert!(
        matches!(e.remote(), Some(r) if r.kind() == ErrorKind::LoadFailed && r.message().contains("NVRTC log")),
        "{e}"
    );

    // A kernel fault on the node.
    // SAFETY: the host double's fault kernel touches nothing.
    let e = unsafe { launch(&k.fault, cfg(1), ()) }
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap_err();
    assert!(
        matches!(e.remote_kind(), Some(ErrorKind::LaunchFailed)),
        "{e}"
    );

    // An op that needs a local CUDA stream names itself and the lease.
    let e = LocalOnly.schedule(&remote).unwrap().await.unwrap_err();
    match &e {
        Error::NeedsLocalStream { op, context } => {
            assert!(op.contains("CUDA stream"), "{e}");
            assert!(context.contains("lease"), "{e}");
        }
        other => panic!("{other}"),
    }
    // Module globals are local only for now: the op names itself.
    let m = Module::cuda(KERNELS, &[]).unwrap();
    let e = cuda_async::read_global::<u32>(&m, "counter")
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::NeedsLocalStream { op, .. } if op.contains("read_global")),
        "{e}"
    );
    // The node cannot run the client's closure: a host step names itself.
    let e = cuda_async::host_step(|| ())
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::NeedsLocalStream { op, .. } if op.contains("host_step")),
        "{e}"
    );
    let e = cuda_async::host_step_each(|| ())
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::NeedsLocalStream { op, .. } if op.contains("host_step_each")),
        "{e}"
    );
    // (`timed` runs on a lease: data_path.rs times ops on the node.)

    // Expiry, on a fresh lease.
    let (_short, expiring) = short_lease(node, 4096).await;
    clock.advance(Duration::from_secs(6));
    let e = h2d(vec![1u32; 4])
        .then(d2h)
        .schedule(&expiring)
        .unwrap()
        .await
        .unwrap_err();
    assert!(
        matches!(e.remote_kind(), Some(ErrorKind::LeaseExpired)),
        "{e}"
    );

    // A token the node does not know.
    let bad = cuda_lease::client::ClientConfig::pinned(node.cert_der().clone()).token("wrong");
    let e = cuda_lease::client::Client::connect(node.addr(), &bad)
        .await
        .map(|_| ())
        .map_err(cuda_async::Error::from_remote)
        .unwrap_err();
    assert!(
        matches!(e.remote_kind(), Some(ErrorKind::Unauthorized(_))),
        "{e}"
    );
    fx.shutdown().await;
}

#[tokio::test]
async fn a_buffer_of_another_lease_is_an_error_naming_both() {
    let fx = Fixture::memory(1 << 22).lease(1 << 16).start().await;
    let (a, b) = (fx.lease(), lease_on(&fx.node, 1 << 16).await);
    let (sa, sb) = (
        LeaseBackend::current(a.session()),
        LeaseBackend::current(b.session()),
    );
    let on_a = RemotePolicy::new(&sa);
    let on_b = RemotePolicy::new(&sb);
    let buf: DeviceBuffer<u32> = h2d(vec![7u32; 8]).schedule(&on_a).unwrap().await.unwrap();
    assert!(buf.is_remote());
    assert_eq!(buf.home(), cuda_async::RemoteSession::describe(&*sa));
    let e = d2h(&buf).schedule(&on_b).unwrap().await.unwrap_err();
    match &e {
        Error::WrongHome { buffer, context } => {
            assert_eq!(buffer, &cuda_async::RemoteSession::describe(&*sa), "{e}");
            assert!(
                context.contains(&cuda_async::RemoteSession::describe(&*sb)),
                "{e}"
            );
        }
        other => panic!("{other}"),
    }
    // On its own lease it is fine.
    let host = d2h(&buf).schedule(&on_a).unwrap().await.unwrap();
    assert_eq!(host.to_vec().unwrap(), vec![7; 8]);
    // A shared op ran on lease A; consuming it on lease B is an error.
    let shared = h2d(vec![1u8; 4]).map(Arc::new).shared();
    let ran = shared.clone().schedule(&on_a).unwrap().await.unwrap();
    assert_eq!(ran.len(), 4);
    let e = shared
        .clone()
        .then(d2h)
        .schedule(&on_b)
        .unwrap()
        .await
        .unwrap_err();
    match &e {
        Error::WrongHome { buffer, context } => {
            assert!(buffer.contains("where the shared op ran"), "{e}");
            assert!(
                context.contains(&cuda_async::RemoteSession::describe(&*sb)),
                "{e}"
            );
        }
        other => panic!("{other}"),
    }
    let again = shared.then(d2h).schedule(&on_a).unwrap().await.unwrap();
    assert_eq!(again.to_vec().unwrap(), vec![1; 4]);
    fx.shutdown().await;
}

#[tokio::test]
async fn a_buffer_dropped_while_its_op_is_queued_is_freed_after_it() {
    let fx = Fixture::node_path(1 << 22).lease(1 << 20).start().await;
    let (node, lease) = (&fx.node, fx.lease());
    let remote = fx.policy();
    // The buffer is dropped while the submission is recorded (d2h takes it
    // by value): its free joins the end of the same message, after the
    // read, so the read sees the data and the node ends with nothing.
    let (bytes, host) = (1usize << 16, 0xabu8);
    let before = batches(node);
    let out = zeros::<u8>(bytes)
        .then(move |b| memset(b, host))
        .then(d2h)
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    assert_eq!(batches(node).0 - before.0, 1);
    assert!(out.to_vec().unwrap().iter().all(|&v| v == host));
    assert_eq!(lease.query().await.unwrap().allocated, 0);
    // A buffer the caller keeps is allocated until dropped; then its free
    // reaches the node (with the next message or a flush).
    let kept = zeros::<u8>(bytes).schedule(&remote).unwrap().await.unwrap();
    assert_eq!(lease.query().await.unwrap().allocated, bytes as u64);
    drop(kept);
    assert!(
        eventually(Duration::from_secs(5), || async {
            lease.query().await.unwrap().allocated == 0
        })
        .await
    );
    fx.shutdown().await;
}

#[test]
fn a_plain_fn_main_runs_the_pipeline_blocking_and_sees_the_node_go() {
    let node_rt = tokio::runtime::Runtime::new().unwrap();
    let fx = node_rt.block_on(Fixture::memory(1 << 22).start());
    let node = &fx.node;
    let builder = Lease::builder()
        .min_vram(1 << 20)
        .config(client_config(node));
    let lease = BlockingLease::connect(builder, node.addr()).unwrap();
    let remote = RemotePolicy::new(&lease).with_streams(2);
    let k = kernels();
    let (x, y) = (random_f32(300, 1), random_f32(300, 2));
    let out = pipeline(x.clone(), y.clone(), 3.0, &k)
        .sync_with(&remote)
        .unwrap();
    assert_eq!(out.to_vec().unwrap(), reference(&x, &y, 3.0));
    // value, map, with_context and boxed record nothing: no message.
    let before = batches(node);
    let v = value(20)
        .map(|v| v * 2)
        .then(|v| with_context(move |ctx| value((v + 2, ctx.is_remote(), ctx.describe()))))
        .boxed()
        .sync_with(&remote)
        .unwrap();
    assert_eq!((v.0, v.1), (42, true));
    assert!(v.2.starts_with("stream "), "{}", v.2);
    assert_eq!(batches(node).0, before.0);
    // The node goes away: the next submission fails, it does not hang.
    node_rt.block_on(fx.shutdown());
    let e = h2d(vec![1u8; 4]).then(d2h).sync_with(&remote).unwrap_err();
    assert!(
        matches!(e.remote_kind(), Some(ErrorKind::Disconnected(_))),
        "{e}"
    );
}

#[tokio::test]
async fn zip_join_all_and_shared_give_the_right_results_on_a_lease() {
    let fx = Fixture::node_path(1 << 22).lease(1 << 20).start().await;
    let node = &fx.node;
    let remote = fx.policy();
    let k = kernels();
    let (x, y) = (random_f32(777, 41), random_f32(777, 43));
    // zip: two pipelines, one message.
    let before = batches(node);
    let (a, b) = pipeline(x.clone(), y.clone(), 2.0, &k)
        .zip(pipeline(y.clone(), x.clone(), -1.0, &k))
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    assert_eq!(batches(node).0 - before.0, 1);
    assert_eq!(a.to_vec().unwrap(), reference(&x, &y, 2.0));
    assert_eq!(b.to_vec().unwrap(), reference(&y, &x, -1.0));
    // join_all of boxed pipelines.
    let ops: Vec<BoxedOp<'static, HostBuffer<f32>>> = (0..5)
        .map(|i| pipeline(x.clone(), y.clone(), i as f32, &k).boxed())
        .collect();
    let outs = join_all(ops).schedule(&remote).unwrap().await.unwrap();
    for (i, o) in outs.iter().enumerate() {
        assert_eq!(o.to_vec().unwrap(), reference(&x, &y, i as f32), "arm {i}");
    }
    // shared: the producer runs once; both consumers read its buffer.
    let shared = h2d(x.clone()).map(Arc::new).shared();
    let (p, q) = shared
        .clone()
        .then(d2h)
        .zip(shared.clone().then(|b| d2d(b).then(d2h)))
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    assert_eq!(p.to_vec().unwrap(), x);
    assert_eq!(q.to_vec().unwrap(), x);
    // A later submission consumes the shared output again (no new upload).
    let again = shared.then(d2h).schedule(&remote).unwrap().await.unwrap();
    assert_eq!(again.to_vec().unwrap(), x);
    fx.shutdown().await;
}

const HANG: &str = r#"extern "C" __global__ void __hang() {}"#;

/// A submission that never finishes on the in-memory device (its worker
/// sleeps), polled once on its own task.
fn hanging(remote: &RemotePolicy) -> tokio::task::JoinHandle<cuda_async::Result<()>> {
    let hang = Module::cuda(HANG, &[]).unwrap().kernel("__hang").unwrap();
    // SAFETY: the host double's hang kernel touches nothing.
    let fut = unsafe { launch(&hang, cfg(1), ()) }
        .schedule(remote)
        .unwrap();
    tokio::spawn(async move { fut.await.map(drop) })
}

/// Waits until a submission sent after `before` (a [`batches`] reading)
/// has reached the node: it is pending there, not on its way.
async fn reached(node: &Node, before: (u64, u64)) {
    assert!(
        eventually(Duration::from_secs(10), || async {
            batches(node).0 > before.0
        })
        .await,
        "the submission never reached the node"
    );
}

/// A lease of `vram` bytes that expires 5 s (of the fixture's clock)
/// after it is made, never renewed, with its remote policy.
async fn short_lease(node: &Node, vram: u64) -> (Lease, RemotePolicy) {
    let short = Lease::builder()
        .min_vram(vram)
        .ttl(Duration::from_secs(5))
        .auto_renew(false)
        .on(connect(node).await)
        .await
        .unwrap();
    let policy = RemotePolicy::new(&LeaseBackend::current(short.session()));
    (short, policy)
}

#[tokio::test]
async fn a_pending_submission_fails_when_its_lease_expires_or_its_node_goes() {
    let fx = Fixture::node_path(1 << 22).manual_clock().start().await;
    let (node, clock) = (&fx.node, fx.clock());
    let (_short, remote) = short_lease(node, 1 << 16).await;
    let before = batches(node);
    let pending = hanging(&remote);
    reached(node, before).await;
    assert!(!pending.is_finished(), "the hang returned");
    clock.advance(Duration::from_secs(6));
    let e = tokio::time::timeout(Duration::from_secs(10), pending)
        .await
        .expect("a pending submission hung past its lease's expiry")
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(e.remote_kind(), Some(ErrorKind::LeaseExpired)),
        "{e}"
    );

    // The node goes away under a pending submission.
    let lease = lease_on(node, 1 << 16).await;
    let remote = policy_of(&lease);
    let before = batches(node);
    let pending = hanging(&remote);
    reached(node, before).await;
    assert!(!pending.is_finished(), "the hang returned");
    fx.shutdown().await;
    let e = tokio::time::timeout(Duration::from_secs(10), pending)
        .await
        .expect("a pending submission hung past its node's end")
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(e.remote_kind(), Some(ErrorKind::Disconnected(_))),
        "{e}"
    );
}

mod gemm;
mod graphs;
mod in_flight;
mod prepared;

/// Blocks the calling thread on `f` with no async runtime of its own (a
/// minimal executor: the waker unparks the thread).
fn block_on_no_runtime<F: std::future::Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    block_on_waking(f, &waker)
}

/// [`block_on_no_runtime`] with `waker`, which must unpark this thread.
fn block_on_waking<F: std::future::Future>(f: F, waker: &std::task::Waker) -> F::Output {
    let mut cx = std::task::Context::from_waker(waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let std::task::Poll::Ready(out) = f.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}

/// Records, at each wake-up of the awaiting thread, whether its submission
/// was still pending, and unparks the thread.
struct Seen {
    done: cuda_async::remote::RemoteCompletion,
    pending_at_wake: std::sync::Mutex<Vec<bool>>,
    thread: std::thread::Thread,
}

impl std::task::Wake for Seen {
    fn wake(self: Arc<Self>) {
        let pending = self.done.outcome().is_none();
        self.pending_at_wake.lock().unwrap().push(pending);
        self.thread.unpark();
    }
}

/// A submission awaited on a thread of no runtime (as `sync()` and
/// `block_on`'s thread await): that thread is woken as the reply arrives,
/// with the submission still pending (its reply is read meanwhile by the
/// session's runtime), then once more for the result unless it was in by
/// the time the thread looked. Over 50
/// submissions: the reply's first bytes could be in before the reply's
/// task first runs on the runtime (then it is read at once, with no
/// early wake-up), but not every time.
#[test]
fn a_thread_awaiting_a_submission_is_woken_as_its_reply_arrives() {
    use cuda_async::remote::{Id, Op, Recording, RemoteCompletion};
    use cuda_async::RemoteSession;
    use std::task::{Context, Waker};
    let node_rt = tokio::runtime::Runtime::new().unwrap();
    let fx = node_rt.block_on(Fixture::memory(1 << 22).lease(1 << 20).start());
    let backend = {
        let _in = node_rt.enter();
        LeaseBackend::current(fx.session())
    };
    let mut early = 0;
    for round in 0..50u8 {
        let id = backend.fresh_id();
        let mut rec = Recording::new();
        rec.push(
            0,
            Op::Alloc {
                buf: Id(id),
                size: 64,
            },
        );
        rec.write(0, id, 0, &[round; 64]);
        let slot = rec.read(0, id, 0, 64);
        rec.push(0, Op::Free { id: Id(id) });
        let done = RemoteCompletion::new();
        let seen = Arc::new(Seen {
            done: done.clone(),
            pending_at_wake: std::sync::Mutex::new(Vec::new()),
            thread: std::thread::current(),
        });
        let waker = Waker::from(seen.clone());
        // Registered before the submission: no wake-up can come first.
        assert!(done
            .poll_outcome(&mut Context::from_waker(&waker))
            .is_pending());
        backend.submit(rec, done.clone());
        block_on_waking(done.finished(), &waker).unwrap();
        let host = cuda_async::HostBuffer::<u8>::remote(slot).unwrap();
        assert_eq!(host.to_vec().unwrap(), vec![round; 64]);
        // [true]: woken early, the reply read by the time it looked;
        // [true, false]: woken early, then for the result; [false]: the
        // reply was read in the task's first run on the runtime.
        let wakes = seen.pending_at_wake.lock().unwrap().clone();
        assert!(!wakes.is_empty() && wakes.len() <= 2, "{wakes:?}");
        if wakes[0] {
            early += 1;
        }
    }
    println!("woken early (reply arrived, not yet read) in {early} of 50 submissions");
    assert!(
        early > 0,
        "the awaiting thread was never woken before its reply was read"
    );
    node_rt.block_on(fx.free_and_shutdown());
}

/// An op on a lease completes with its result however it is awaited: on a
/// thread with no runtime, on another runtime, and on the session's (the
/// session's runtime reads the reply).
#[test]
fn an_op_on_a_lease_completes_awaited_outside_its_sessions_runtime() {
    let node_rt = tokio::runtime::Runtime::new().unwrap();
    let fx = node_rt.block_on(Fixture::memory(1 << 22).lease(1 << 20).start());
    let remote = {
        let _in = node_rt.enter();
        fx.policy()
    };
    let op = |v: u32| h2d(vec![v; 256]).then(d2h);
    let check = |v: u32, out: cuda_async::Result<HostBuffer<u32>>| {
        assert_eq!(out.unwrap().to_vec().unwrap(), vec![v; 256]);
    };
    for v in 0..20 {
        check(v, block_on_no_runtime(op(v).schedule(&remote).unwrap()));
    }
    let other = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for v in 20..40 {
        check(v, other.block_on(op(v).schedule(&remote).unwrap()));
    }
    for v in 40..60 {
        check(v, node_rt.block_on(op(v).schedule(&remote).unwrap()));
    }
    node_rt.block_on(fx.free_and_shutdown());
}
