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
    let fx = Fixture::memory(1 << 22).lease(1 << 20).start().await;
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

/// `C = alpha * op(A) * op(B) + beta * C` for every product of `g`,
/// column-major, on the CPU (in f64).
fn cpu_gemm<T: Copy + Into<f64>>(g: &Gemm<T>, a: &[T], b: &[T], c: &[T]) -> Vec<f64> {
    let mut out: Vec<f64> = c.iter().map(|v| (*v).into()).collect();
    for p in 0..g.batch {
        let (oa, ob, oc) = (p * g.stride_a, p * g.stride_b, p * g.stride_c);
        for j in 0..g.n {
            for i in 0..g.m {
                let sum: f64 = (0..g.k)
                    .map(|l| {
                        let av = a[oa
                            + if g.transpose_a {
                                l + i * g.lda
                            } else {
                                i + l * g.lda
                            }];
                        let bv = b[ob
                            + if g.transpose_b {
                                j + l * g.ldb
                            } else {
                                l + j * g.ldb
                            }];
                        av.into() * bv.into()
                    })
                    .sum();
                let at = oc + i + j * g.ldc;
                out[at] = g.alpha.into() * sum + g.beta.into() * out[at];
            }
        }
    }
    out
}

fn close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
            "{what}: element {i} is {g}, the CPU says {w}"
        );
    }
}

/// A GEMM on a lease is one command the node runs with its own library
/// (here the in-memory device's host product): no kernel is shipped, and
/// every transpose, alpha and beta, a strided batch and a view of C come
/// back as the CPU computes them, one message each.
#[tokio::test]
async fn a_gemm_runs_on_a_lease_by_the_nodes_library() {
    let fx = Fixture::memory(1 << 22).lease(1 << 20).start().await;
    let (node, remote) = (&fx.node, fx.policy());
    let (m, n, k) = (7, 5, 3);
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        let mut g = Gemm::<f32>::new(m, n, k).alpha(1.5).beta(-0.5);
        if ta {
            g = g.transpose_a();
        }
        if tb {
            g = g.transpose_b();
        }
        let (av, bv, cv) = (
            random_f32(m * k, 1),
            random_f32(k * n, 2),
            random_f32(m * n, 3),
        );
        let before = batches(node);
        let got = h2d(av.clone())
            .zip(h2d(bv.clone()))
            .zip(h2d(cv.clone()))
            .then(move |((a, b), c)| gemm(g, a, b, c))
            .then(|(_, _, c)| d2h(c))
            .schedule(&remote)
            .unwrap()
            .await
            .unwrap();
        let got: Vec<f64> = got.to_vec().unwrap().into_iter().map(f64::from).collect();
        close(
            &got,
            &cpu_gemm(&g, &av, &bv, &cv),
            &format!("transposes {ta}/{tb}"),
        );
        assert_eq!(batches(node).0 - before.0, 1, "one message");
    }
    // Three f64 products of 4x2 by 2x3, C the middle of a larger buffer.
    let g = Gemm::<f64>::new(4, 3, 2).batched(3);
    let av: Vec<f64> = random_f32(3 * 8, 4).into_iter().map(f64::from).collect();
    let bv: Vec<f64> = random_f32(3 * 6, 5).into_iter().map(f64::from).collect();
    let mut c = h2d(vec![9.0f64; 3 * 12 + 8])
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    let view = c.slice_mut(4..4 + 3 * 12).unwrap();
    let (a, b) = (av.clone(), bv.clone());
    h2d(a)
        .zip(h2d(b))
        .then(move |(a, b)| gemm(g, a, b, view))
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    let got = d2h(&c)
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap()
        .to_vec()
        .unwrap();
    assert!(
        got[..4].iter().chain(&got[4 + 36..]).all(|v| *v == 9.0),
        "outside the view"
    );
    close(
        &got[4..40],
        &cpu_gemm(&g, &av, &bv, &[0.0; 36]),
        "a batch into a view",
    );
    // Inside a graph kept on the node: C += A * B at every replay.
    let g = Gemm::<f32>::new(6, 6, 6).beta(1.0);
    let (av, bv) = (random_f32(36, 6), random_f32(36, 7));
    let a = Arc::new(h2d(av.clone()).schedule(&remote).unwrap().await.unwrap());
    let b = Arc::new(h2d(bv.clone()).schedule(&remote).unwrap().await.unwrap());
    let c = zeros::<f32>(36).schedule(&remote).unwrap().await.unwrap();
    let graph = value(c)
        .then(move |c| gemm(g, a.clone(), b.clone(), c))
        .map(|(_, _, c)| c)
        .graph_with_async(&remote)
        .unwrap()
        .await
        .expect("a gemm captures on a lease");
    let mut want = vec![0.0f32; 36];
    for replay in 1..=2 {
        graph.launch().schedule(&remote).unwrap().await.unwrap();
        want = cpu_gemm(&g, &av, &bv, &want)
            .into_iter()
            .map(|v| v as f32)
            .collect();
        let got = d2h(graph.output())
            .schedule(&remote)
            .unwrap()
            .await
            .unwrap();
        let got: Vec<f64> = got.to_vec().unwrap().into_iter().map(f64::from).collect();
        let want: Vec<f64> = want.iter().map(|v| f64::from(*v)).collect();
        close(&got, &want, &format!("replay {replay}"));
    }
    drop(graph);
    fx.shutdown().await;
}

#[tokio::test]
async fn a_chain_of_twenty_ops_is_one_message() {
    let fx = Fixture::memory(1 << 22).lease(1 << 20).start().await;
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
    let fx = Fixture::memory(1 << 22)
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
        .map_err(cuda_lease::remote::to_cuda_error)
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
    let fx = Fixture::memory(1 << 22).lease(1 << 20).start().await;
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
    let fx = Fixture::memory(1 << 22).lease(1 << 20).start().await;
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
    let fx = Fixture::memory(1 << 22).manual_clock().start().await;
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

/// A waker that notifies: a future polled with it tells when it would be
/// polled again.
#[derive(Default)]
struct Woken(tokio::sync::Notify);

impl std::task::Wake for Woken {
    fn wake(self: Arc<Self>) {
        self.0.notify_one();
    }
}

#[tokio::test]
async fn a_remote_future_dropped_in_flight_frees_only_after_the_node_s_work() {
    let fx = Fixture::memory(1 << 22)
        .config(|cfg| cfg.op_timeout = Duration::from_secs(2))
        .lease(1 << 21)
        .start()
        .await;
    let (node, lease, remote) = (&fx.node, fx.lease(), fx.policy());
    let hang = Module::cuda(HANG, &[]).unwrap().kernel("__hang").unwrap();
    let bytes = 1usize << 20;
    let vram_before = vram_allocated(node);
    let before = batches(node);
    // The buffer is the output: in use by the queued (here: endless) work.
    let mut fut = zeros::<u8>(bytes)
        // SAFETY: the host double's hang kernel touches nothing.
        .then(move |b| unsafe { launch(&hang, cfg(1), ()) }.map(move |()| b))
        .schedule(&remote)
        .unwrap();
    // Polled until its message reached the node (which runs it: it hangs).
    tokio::select! {
        _ = &mut fut => panic!("the hang returned"),
        reached = eventually(Duration::from_secs(10), || async { batches(node).0 > before.0 }) => {
            assert!(reached, "the submission never reached the node");
        }
    }
    assert!(fut.is_submitted());
    let t = std::time::Instant::now();
    drop(fut);
    assert!(t.elapsed() < Duration::from_millis(50), "drop blocked");
    // The free waits for the work's reply. A submission sent now would
    // carry it, were it queued (queued frees lead the next message); one
    // is sent (its first poll sends it) and reaches the node, where it
    // waits behind the work: one message of one command, no free.
    let sent = batches(node);
    let mut probe = zeros::<u8>(16).schedule(&remote).unwrap();
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    assert!(std::future::Future::poll(std::pin::Pin::new(&mut probe), &mut cx).is_pending());
    let probe = tokio::spawn(probe);
    reached(node, sent).await;
    assert_eq!(
        batches(node),
        (sent.0 + 1, sent.1 + 1),
        "the dropped buffer's free went out before the work was over"
    );
    let allocated = lease.query().await.unwrap().allocated;
    assert!(
        allocated >= bytes as u64,
        "freed early: {allocated} bytes left"
    );
    // Once the work is over (the hang times out after 2 s, which fails the
    // lease), the buffer is freed: the node's accounting is back where it
    // was. A leak fails here. (The failed lease lets go of all it held, so
    // this sees the node's release, not the client's free: a client that
    // forgets its frees is caught by `a_buffer_dropped_while_its_op_is_queued_is_freed_after_it`
    // and the pipeline test's end-of-test check.)
    assert!(
        eventually(Duration::from_secs(20), || async {
            vram_allocated(node) == vram_before
        })
        .await,
        "never freed: the node still holds {} bytes (before: {vram_before})",
        vram_allocated(node)
    );
    // The probe waited behind the work, and failed with its lease.
    assert!(probe.await.unwrap().is_err());

    // mem::forget: the buffer leaks (never freed early, never freed).
    let fx2 = Fixture::memory(1 << 22).lease(1 << 21).start().await;
    let (lease2, remote2) = (fx2.lease(), fx2.policy());
    let mut fut = zeros::<u8>(bytes).schedule(&remote2).unwrap();
    // Exactly one poll: it sends the submission. Its waker is woken once
    // the reply has come and the session has settled what it created.
    let replied = Arc::new(Woken::default());
    let waker = std::task::Waker::from(replied.clone());
    let mut cx = std::task::Context::from_waker(&waker);
    assert!(std::future::Future::poll(std::pin::Pin::new(&mut fut), &mut cx).is_pending());
    std::mem::forget(fut);
    tokio::time::timeout(Duration::from_secs(10), replied.0.notified())
        .await
        .expect("the forgotten submission was never answered");
    // The allocation ran; then nothing frees it: a later submission on the
    // session runs (a free queued by then would go before it, in the same
    // message), and the forgotten buffer is still there beside it.
    assert_eq!(lease2.query().await.unwrap().allocated, bytes as u64);
    let sent = batches(&fx2.node);
    let probe = zeros::<u8>(16).schedule(&remote2).unwrap().await.unwrap();
    assert_eq!(batches(&fx2.node), (sent.0 + 1, sent.1 + 1));
    assert_eq!(lease2.query().await.unwrap().allocated, bytes as u64 + 16);
    drop(probe);
    fx2.shutdown().await;
    fx.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_tasks_sharing_one_lease_all_get_their_own_results() {
    let fx = Fixture::memory(1 << 24).lease(1 << 23).start().await;
    let remote = Arc::new(fx.policy());
    let k = Arc::new(kernels());
    let tasks: Vec<_> = (0..64u64)
        .map(|t| {
            let (remote, k) = (remote.clone(), k.clone());
            tokio::spawn(async move {
                for round in 0..5 {
                    let n = 100 + (t as usize * 7 + round) % 300;
                    let (x, y) = (random_f32(n, t * 1000 + round as u64), random_f32(n, t + 1));
                    let a = t as f32 - round as f32;
                    let out = pipeline(x.clone(), y.clone(), a, &k)
                        .schedule(&*remote)
                        .unwrap()
                        .await
                        .unwrap();
                    assert_eq!(
                        out.to_vec().unwrap(),
                        reference(&x, &y, a),
                        "task {t} round {round}"
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

#[tokio::test]
async fn a_kernel_fault_fails_its_lease_and_leaves_other_leases_working() {
    let fx = Fixture::memory(1 << 22).lease(1 << 20).start().await;
    let b = lease_on(&fx.node, 1 << 20).await;
    let (on_a, on_b) = (fx.policy(), policy_of(&b));
    let k = kernels();
    // A pipeline on A is in flight with the fault behind it in one message.
    let (x, y) = (random_f32(500, 1), random_f32(500, 2));
    let fault = k.fault.clone();
    let e = pipeline(x.clone(), y.clone(), 1.0, &k)
        // SAFETY: the host double's fault kernel touches nothing.
        .then(move |h| unsafe { launch(&fault, cfg(1), ()) }.map(move |()| h))
        .schedule(&on_a)
        .unwrap()
        .await
        .unwrap_err();
    assert!(
        matches!(e.remote_kind(), Some(ErrorKind::LaunchFailed)),
        "{e}"
    );
    // A's later submissions fail too: its context is gone.
    let e = h2d(vec![1u8; 4])
        .then(d2h)
        .schedule(&on_a)
        .unwrap()
        .await
        .unwrap_err();
    assert!(
        matches!(e.remote_kind(), Some(ErrorKind::LeasePoisoned)),
        "{e}"
    );
    // B, on the same node, is unaffected.
    let out = pipeline(x.clone(), y.clone(), 3.0, &k)
        .schedule(&on_b)
        .unwrap()
        .await
        .unwrap();
    assert_eq!(out.to_vec().unwrap(), reference(&x, &y, 3.0));
    fx.shutdown().await;
}

/// `DeviceFuture`s are plain futures: `futures`' combinators drive them on
/// any executor, here a `FuturesUnordered` (results as they complete) and
/// `join_all` (results in order), and a `Stream` of a batch's results.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_futures_compose_with_the_futures_crate() {
    use futures::stream::{FuturesUnordered, StreamExt};

    let fx = Fixture::memory(1 << 24).lease(1 << 23).start().await;
    let remote = fx.policy();
    let k = kernels();
    let inputs: Vec<(Vec<f32>, Vec<f32>, f32)> = (0..16u64)
        .map(|i| {
            let n = 50 + i as usize * 13;
            (random_f32(n, i), random_f32(n, i + 100), i as f32 * 0.5)
        })
        .collect();
    let run = |i: usize| {
        let (x, y, a) = inputs[i].clone();
        pipeline(x, y, a, &k).schedule(&remote).unwrap()
    };
    // As they complete: each result still matches its own input.
    let mut unordered: FuturesUnordered<_> = (0..inputs.len())
        .map(|i| {
            let f = run(i);
            async move { (i, f.await) }
        })
        .collect();
    let mut seen = vec![false; inputs.len()];
    while let Some((i, out)) = unordered.next().await {
        let (x, y, a) = &inputs[i];
        assert_eq!(out.unwrap().to_vec().unwrap(), reference(x, y, *a), "{i}");
        seen[i] = true;
    }
    assert!(seen.iter().all(|&s| s));
    // In order.
    let outs = futures::future::join_all((0..inputs.len()).map(run)).await;
    for (i, out) in outs.into_iter().enumerate() {
        let (x, y, a) = &inputs[i];
        assert_eq!(out.unwrap().to_vec().unwrap(), reference(x, y, *a), "{i}");
    }
    // A stream of results, at most 4 submissions in flight.
    let total: usize = futures::stream::iter(0..inputs.len())
        .map(run)
        .buffered(4)
        .map(|out| out.unwrap().to_vec().unwrap().len())
        .fold(0, |acc, n| async move { acc + n })
        .await;
    assert_eq!(total, inputs.iter().map(|(x, _, _)| x.len()).sum::<usize>());
    fx.free_and_shutdown().await;
}

#[test]
fn a_blocking_wait_with_a_timeout_returns_while_the_submission_still_runs() {
    let node_rt = tokio::runtime::Runtime::new().unwrap();
    let fx = node_rt.block_on(Fixture::memory(1 << 22).start());
    let node = &fx.node;
    let builder = Lease::builder()
        .min_vram(1 << 20)
        .config(client_config(node));
    let lease = BlockingLease::connect(builder, node.addr()).unwrap();
    let remote = RemotePolicy::new(&lease);
    // Done in time: the output, as with `sync_with`.
    let v = h2d(vec![5u8; 64])
        .then(d2h)
        .sync_with_timeout(&remote, Duration::from_secs(10))
        .unwrap();
    assert_eq!(v.to_vec().unwrap(), vec![5u8; 64]);
    // A submission that never ends on the node: the wait ends at its bound.
    let hang = Module::cuda(HANG, &[]).unwrap().kernel("__hang").unwrap();
    let t = std::time::Instant::now();
    // SAFETY: the host double's hang kernel touches nothing.
    let e = unsafe { launch(&hang, cfg(1), ()) }
        .sync_with_timeout(&remote, Duration::from_millis(200))
        .unwrap_err();
    let waited = t.elapsed();
    assert!(
        matches!(e, Error::Timeout { waited } if waited == Duration::from_millis(200)),
        "{e}"
    );
    assert!(e.to_string().contains("wait longer"), "{e}");
    assert!(
        waited >= Duration::from_millis(200) && waited < Duration::from_secs(5),
        "returned after {waited:?}"
    );
    drop(remote);
    drop(lease);
    node_rt.block_on(fx.shutdown());
}

/// Views of buffers travel to a leased GPU as the buffer's id and a byte
/// offset: a kernel reads one view and writes another, a memset fills a
/// third, a download reads a fourth; the rest of each buffer is untouched.
#[tokio::test]
async fn views_travel_to_a_leased_gpu_as_offsets() {
    let fx = Fixture::memory(1 << 22).lease(1 << 20).start().await;
    let remote = fx.policy();
    let k = kernels();
    let x = h2d((0..16).map(|i| i as f32).collect::<Vec<_>>())
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    let mut y = h2d(vec![1.0f32; 16])
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    {
        let (head, tail) = y.split_at_mut(8).unwrap();
        // SAFETY: axpy touches x[0..4) and y[0..4) of its views, 4 floats
        // each.
        let op = unsafe {
            launch(
                &k.axpy,
                cfg(4),
                (
                    2.0f32,
                    x.slice(4..8).unwrap(),
                    tail.split_at(4).unwrap().1,
                    4u32,
                ),
            )
        };
        op.schedule(&remote).unwrap().await.unwrap();
        memset(head.split_at(2).unwrap().1.split_at(2).unwrap().0, 0)
            .schedule(&remote)
            .unwrap()
            .await
            .unwrap();
    }
    let part = d2h(y.slice(1..16).unwrap())
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    let mut want = [1.0f32; 16];
    want[2..4].fill(0.0);
    for (i, v) in want[12..16].iter_mut().enumerate() {
        *v = 2.0 * (4 + i) as f32 + 1.0;
    }
    assert_eq!(part.as_slice().unwrap(), &want[1..]);
    // Device copies out of and into views.
    copy_d2d(x.slice(0..3).unwrap(), y.slice_mut(13..16).unwrap())
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    let copied = d2d(y.slice(12..16).unwrap())
        .then(d2h)
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    assert_eq!(copied.as_slice().unwrap(), &[want[12], 0.0, 1.0, 2.0]);
    // Out of range: an error naming the range and the buffer's length.
    let e = x.slice(10..17).unwrap_err().to_string();
    assert!(e.contains("of a buffer of 16"), "{e}");
    fx.free_and_shutdown().await;
}

/// A graph captured on a lease is kept by the node: capturing runs nothing
/// but its allocations; 100 launches, each one message of one command
/// after an input changed by `update`, give what an eager run gives; a
/// download in the op is refused by name; a recapture changes the work;
/// the graph is `WrongHome` on another lease; a launch in flight when the
/// graph is dropped completes, and the node's memory is back where it was
/// once the graph and its buffers are gone.
#[test]
fn a_graph_captured_on_a_lease_is_kept_by_the_node_and_launched_in_one_command() {
    let node_rt = tokio::runtime::Runtime::new().unwrap();
    let fx = node_rt.block_on(Fixture::memory(1 << 24).start());
    let node = &fx.node;
    let connect = || {
        let builder = Lease::builder()
            .min_vram(1 << 20)
            .config(client_config(node));
        BlockingLease::connect(builder, node.addr()).unwrap()
    };
    let (lease, other) = (connect(), connect());
    let remote = RemotePolicy::new(&lease).with_streams(2);
    let k = kernels();
    let n = 300usize;
    let base = vram_allocated(node);
    let x = h2d(vec![0.0f32; n]).sync_with(&remote).unwrap();

    // c = x + (2x + y), y zeroed at each launch, on two streams.
    let op = |a: f32, x: DeviceBuffer<f32>| {
        let (axpy, vadd) = (k.axpy.clone(), k.vadd.clone());
        let m = n as u32;
        zeros::<f32>(n)
            .zip(zeros::<f32>(n))
            .then(move |(y, c)| {
                // SAFETY: axpy touches x and y [0..m); both hold m floats.
                unsafe { launch(&axpy, cfg(m), (a, x, y, m)) }.map(move |(_, x, y, _)| (x, y, c))
            })
            .then(move |(x, y, c)| {
                // SAFETY: vadd touches a, b, c [0..m); all hold m floats.
                unsafe { launch(&vadd, cfg(m), (x, Arc::new(y), c, m)) }.map(|(x, _, c, _)| (x, c))
            })
    };
    let before = batches(node);
    let mut graph = op(2.0, x).graph_with(&remote).unwrap();
    assert_eq!(batches(node).0 - before.0, 1, "one message to capture");
    assert!(graph.home().contains("lease"), "{}", graph.home());
    assert!(graph.device().is_none());
    let c = d2h(&graph.output().1).sync_with(&remote).unwrap();
    assert!(
        c.to_vec().unwrap().iter().all(|&v| v == 0.0),
        "capture runs nothing"
    );

    for i in 0..100 {
        let xs = vec![i as f32; n];
        graph
            .update(move |(x, c)| {
                h2d(xs)
                    .then(move |t| copy_d2d(t, x))
                    .map(move |(_, x)| (x, c))
            })
            .sync_with(&remote)
            .unwrap();
        let sent = batches(node);
        graph.launch().sync_with(&remote).unwrap();
        let after = batches(node);
        assert_eq!((after.0 - sent.0, after.1 - sent.1), (1, 1), "launch {i}");
        let c = d2h(&graph.output().1).sync_with(&remote).unwrap();
        assert!(
            c.to_vec().unwrap().iter().all(|&v| v == 3.0 * i as f32),
            "launch {i}: {:?}",
            &c.to_vec().unwrap()[..2]
        );
    }
    // The same op run eagerly gives the same.
    let x = h2d(vec![7.0f32; n]).sync_with(&remote).unwrap();
    let (_, c) = op(2.0, x).sync_with(&remote).unwrap();
    assert_eq!(
        d2h(c).sync_with(&remote).unwrap().to_vec().unwrap(),
        vec![21.0; n]
    );

    // A `DeviceScalar` the graph reads, set between launches: c = s + x.
    let mut step = cuda_async::DeviceScalar::new(0.0f32)
        .sync_with(&remote)
        .unwrap();
    let one = h2d(vec![0.5f32]).sync_with(&remote).unwrap();
    let vadd = k.vadd.clone();
    let scalar = step.buffer();
    // SAFETY: vadd touches a, b, c [0..1); all hold one float.
    let stepped = unsafe {
        launch(
            &vadd,
            cfg(1),
            (
                scalar,
                &one,
                zeros::<f32>(1).sync_with(&remote).unwrap(),
                1u32,
            ),
        )
    }
    .map(|(_, _, c, _)| c)
    .graph_with(&remote)
    .unwrap();
    for t in 0..5 {
        step.set(t as f32).sync_with(&remote).unwrap();
        let c = stepped
            .launch()
            .then(|()| d2h(stepped.output()))
            .sync_with(&remote)
            .unwrap();
        assert_eq!(c.to_vec().unwrap(), [t as f32 + 0.5], "step {t}");
    }
    drop(stepped);
    drop((step, one));

    // A download cannot be kept on the node: refused by name, nothing sent.
    // The frees of what was just dropped ride on this submission, so no
    // flush of them goes while the batches are counted.
    let carrier = zeros::<u8>(1).sync_with(&remote).unwrap();
    let sent = batches(node);
    let e = zeros::<f32>(4).then(d2h).graph_with(&remote).unwrap_err();
    assert!(
        matches!(&e, Error::Capture(m) if m.contains("download")),
        "{e}"
    );
    assert_eq!(batches(node).0, sent.0);
    drop(carrier);

    // Recaptured with a = 5: c = x + 5x.
    graph.recapture(|(x, _)| op(5.0, x)).expect("recaptured");
    graph.launch().sync_with(&remote).unwrap();
    let c = d2h(&graph.output().1).sync_with(&remote).unwrap();
    assert!(c.to_vec().unwrap().iter().all(|&v| v == 6.0 * 99.0));

    // Another lease's graph.
    let e = graph
        .launch()
        .sync_with(&RemotePolicy::new(&other))
        .unwrap_err();
    assert!(matches!(e, Error::WrongHome { .. }), "{e}");

    // Dropped with a launch in flight: the launch is sent first, then the
    // graph's free.
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    {
        use std::future::Future;
        let pending = graph.launch().schedule(&remote).unwrap();
        let mut pending = std::pin::pin!(pending);
        let _ = rt.block_on(std::future::poll_fn(|cx| {
            std::task::Poll::Ready(pending.as_mut().poll(cx))
        }));
    }
    drop(graph);
    // What is left: the module's source, charged while it is loaded.
    let want = base + KERNELS.len() as u64;
    let settled = node_rt.block_on(eventually(Duration::from_secs(5), || async {
        vram_allocated(node) == want
    }));
    assert!(
        settled,
        "{} bytes held, {want} wanted",
        vram_allocated(node)
    );
    drop((lease, other));
    node_rt.block_on(fx.shutdown());
}

/// A lease that expires with a graph kept on its node: the next launch
/// fails with `LeaseExpired`, and the node holds nothing of the lease
/// (the graph, its buffers and its kept upload bytes went with it).
#[tokio::test]
async fn a_graph_kept_on_the_node_goes_with_its_lease() {
    let fx = Fixture::memory(1 << 22).manual_clock().start().await;
    let (node, clock) = (&fx.node, fx.clock());
    let base = vram_allocated(node);
    let (_short, remote) = short_lease(node, 1 << 16).await;
    // An upload in the body: its bytes are kept with the graph.
    let graph = h2d(vec![3u32; 256])
        .then(d2d)
        .graph_with_async(&remote)
        .unwrap()
        .await
        .unwrap();
    graph.launch().schedule(&remote).unwrap().await.unwrap();
    assert!(vram_allocated(node) > base);
    clock.advance(Duration::from_secs(6));
    let e = graph.launch().schedule(&remote).unwrap().await.unwrap_err();
    assert!(
        matches!(e.remote_kind(), Some(ErrorKind::LeaseExpired)),
        "{e}"
    );
    let gone = eventually(Duration::from_secs(5), || async {
        vram_allocated(node) == base
    })
    .await;
    assert!(gone, "{} bytes held, {base} before", vram_allocated(node));
    drop(graph);
    fx.shutdown().await;
}
