//! After any failed submission the lease keeps working: one test per
//! failure point, each a `cuda-async` pipeline (or, where the user API
//! cannot express the mistake, a raw recording on the same session) that
//! the node refuses, then a good pipeline on the same lease, then the
//! node's accounting of the lease, back at its level before the failure
//! (less what the commands that ran freed).
//!
//! The rule held here: the reply says which commands ran; what exists
//! after a failed submission is what those commands created and did not
//! free, and the client frees only that.

use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use cuda_async::prelude::*;
use cuda_async::remote::proto::Operand;
use cuda_async::remote::{Id, Op, Recording, RemoteCompletion};
use cuda_async::{
    DeviceBuffer, Kernel, LaunchConfig, Module, RemoteErrorKind as ErrorKind, RemotePolicy,
    RemoteSession,
};
use cuda_lease_node::node::{LeaseUsage, NodeConfig};

const KERNELS: &str = r#"
extern "C" __global__ void axpy(float a, const float* x, float* y, unsigned n) {}
extern "C" __global__ void fill(float* out, float v, unsigned n) {}
"#;

/// Asserts that `r` failed remotely as `kind`, its message naming the
/// lease and the node and saying each of `says`.
fn assert_fails<T>(r: cuda_async::Result<T>, kind: ErrorKind, says: &[&str]) {
    let Err(e) = r else {
        panic!("expected a {kind:?} failure, got success");
    };
    let text = e.to_string();
    eprintln!("failure: {text}");
    let remote = e
        .remote()
        .unwrap_or_else(|| panic!("not a remote error: {text}"));
    assert_eq!(remote.kind(), kind, "{text}");
    assert!(
        remote.lease().is_some() && remote.node().is_some(),
        "names no lease or node: {text}"
    );
    for s in says {
        assert!(text.contains(s), "{text:?} does not say {s:?}");
    }
}

/// A node with the in-memory device and a lease of 1 MiB on it.
async fn fixture(adjust: impl FnOnce(&mut NodeConfig)) -> Fixture {
    Fixture::memory(1 << 24)
        .config(adjust)
        .lease(1 << 20)
        .start()
        .await
}

fn kernels() -> (Kernel, Kernel) {
    let m = Module::cuda(KERNELS, &[]).unwrap();
    (m.kernel("axpy").unwrap(), m.kernel("fill").unwrap())
}

/// `y = 2x + 1` on the lease, in one message: correct data.
async fn good_pipeline(remote: &RemotePolicy) {
    let (axpy, fill) = kernels();
    let x = random_f32(300, 5);
    let n = x.len() as u32;
    let cfg = LaunchConfig::for_num_elems(n);
    let y = h2d(x.clone())
        .zip(zeros::<f32>(n as usize))
        .then(move |(x, y)| {
            // SAFETY: fill writes y[0..n); y holds n floats.
            unsafe { launch(&fill, cfg, (y, 1f32, n)) }.map(move |(y, _, _)| (x, y))
        })
        // SAFETY: axpy touches x[0..n) and y[0..n); both hold n floats.
        .then(move |(x, y)| unsafe { launch(&axpy, cfg, (2f32, Arc::new(x), y, n)) })
        .then(|(_, _, y, _)| d2h(y))
        .schedule(remote)
        .unwrap()
        .await
        .unwrap();
    let want: Vec<f32> = x.iter().map(|v| 2.0 * v + 1.0).collect();
    assert_eq!(y.to_vec().unwrap(), want);
}

/// What the node holds for the fixture's lease, asked after a query (a
/// direct lease's worker tells the node what it holds when asked).
async fn usage(fx: &Fixture) -> LeaseUsage {
    fx.lease().query().await.expect("the lease is alive");
    fx.node
        .lease_usage(&fx.lease().id())
        .expect("the lease is alive")
}

/// A good pipeline, then the node's accounting: `want` once the frees
/// queued by the failure (if any) have reached the node.
async fn works_and_holds(fx: &Fixture, remote: &RemotePolicy, want: LeaseUsage) {
    good_pipeline(remote).await;
    let settled = eventually(Duration::from_secs(5), || async { usage(fx).await == want }).await;
    assert!(
        settled,
        "the node holds {:?}, not {want:?}, after the failure",
        usage(fx).await
    );
    // And the lease's status says so too.
    let status = fx.lease().query().await.unwrap();
    assert_eq!(status.allocated, want.allocated);
}

/// A policy of one stream on the fixture's lease, warmed up: its module
/// loaded and stream 0 used, so the accounting before a failure is the
/// lease's steady level.
async fn warm(fx: &Fixture) -> (RemotePolicy, LeaseUsage) {
    let remote = fx.policy().with_streams(1);
    good_pipeline(&remote).await;
    let settled = eventually(Duration::from_secs(5), || async {
        usage(fx).await.buffers == 0
    })
    .await;
    assert!(settled, "the warm-up left {:?}", usage(fx).await);
    (remote, usage(fx).await)
}

/// The session behind the fixture's policy (the same one the pipelines
/// use, so its queued frees are theirs).
fn session_of(remote: &RemotePolicy) -> Arc<dyn RemoteSession> {
    remote.session().clone()
}

#[tokio::test]
async fn a_module_that_does_not_compile_leaves_nothing_behind() {
    let fx = fixture(|_| {}).await;
    let (remote, before) = warm(&fx).await;
    let bad = Module::cuda(
        "#error the user's own words\n__global__ void k(float* p) {}",
        &[],
    )
    .unwrap();
    let k = bad.kernel("k").unwrap();
    // The uploaded buffer is the pipeline's output: dropped only when the
    // failed future is, after the reply.
    let r: cuda_async::Result<DeviceBuffer<f32>> = h2d(vec![1f32; 64])
        // SAFETY: k takes one pointer and touches nothing.
        .then(move |x| unsafe { launch(&k, LaunchConfig::for_num_elems(64), (x,)) })
        .map(|(x,)| x)
        .schedule(&remote)
        .unwrap()
        .await;
    assert_fails(
        r,
        ErrorKind::LoadFailed,
        &["line 1: #error the user's own words"],
    );
    works_and_holds(&fx, &remote, before).await;
    fx.free_and_shutdown().await;
}

#[tokio::test]
async fn an_unknown_kernel_stops_the_batch_where_it_was_launched() {
    let fx = fixture(|_| {}).await;
    let (remote, before) = warm(&fx).await;
    let nope = Module::cuda(KERNELS, &[]).unwrap().kernel("nope").unwrap();
    // The upload runs, the launch does not, nor the download and the
    // free recorded after it.
    let r = h2d(vec![1f32; 64])
        // SAFETY: a kernel that does not exist runs nothing.
        .then(move |x| unsafe { launch(&nope, LaunchConfig::for_num_elems(64), (x,)) })
        .then(|(x,)| d2h(x))
        .schedule(&remote)
        .unwrap()
        .await;
    assert_fails(r, ErrorKind::InvalidRequest, &["no kernel nope"]);
    works_and_holds(&fx, &remote, before).await;
    fx.free_and_shutdown().await;
}

#[tokio::test]
async fn wrong_kernel_arguments_stop_the_batch_at_the_launch() {
    let fx = fixture(|_| {}).await;
    let (remote, before) = warm(&fx).await;
    let (axpy, fill) = kernels();
    let cfg = LaunchConfig::for_num_elems(64);
    // Too few arguments; the buffer outlives the submission.
    let r = h2d(vec![1f32; 64])
        // SAFETY: refused before it runs.
        .then(move |x| unsafe { launch(&axpy, cfg, (x, 64u32)) })
        .map(|(x, _)| x)
        .schedule(&remote)
        .unwrap()
        .await;
    assert_fails(r, ErrorKind::InvalidRequest, &["wrong arguments for axpy"]);
    works_and_holds(&fx, &remote, before).await;
    // A scalar of the wrong size (8 bytes for a float).
    let r = zeros::<f32>(64)
        // SAFETY: refused before it runs.
        .then(move |y| unsafe { launch(&fill, cfg, (y, 1f64, 64u32)) })
        .then(|(y, _, _)| d2h(y))
        .schedule(&remote)
        .unwrap()
        .await;
    assert_fails(r, ErrorKind::InvalidRequest, &["wrong arguments for fill"]);
    works_and_holds(&fx, &remote, before).await;
    fx.free_and_shutdown().await;
}

#[tokio::test]
async fn an_allocation_beyond_the_lease_keeps_what_ran_before_it() {
    let fx = fixture(|_| {}).await;
    let (remote, before) = warm(&fx).await;
    // Two uploads run; the third allocation is beyond the lease.
    let r = h2d(vec![1f32; 1000])
        .zip(h2d(vec![2f32; 1000]))
        .zip(zeros::<f32>(1 << 20))
        .map(|((a, b), c)| (a, b, c))
        .schedule(&remote)
        .unwrap()
        .await;
    assert_fails(r, ErrorKind::Capacity, &["command "]);
    works_and_holds(&fx, &remote, before).await;
    fx.free_and_shutdown().await;
}

#[tokio::test]
async fn an_out_of_range_copy_keeps_what_ran_before_it() {
    let fx = fixture(|_| {}).await;
    let (remote, before) = warm(&fx).await;
    // The user API sizes its copies; a raw recording on the same session
    // does not: two buffers allocated, then a copy past the end of one.
    let session = session_of(&remote);
    let (a, b) = (session.fresh_id(), session.fresh_id());
    let mut rec = Recording::new();
    for id in [a, b] {
        rec.push(
            0,
            Op::Alloc {
                buf: Id(id),
                size: 64,
            },
        );
    }
    rec.push(
        0,
        Op::Copy {
            src: Operand::new(Id(a), 32),
            dst: Operand::new(Id(b), 0),
            len: 64,
        },
    );
    rec.push(0, Op::Free { id: Id(a) });
    let done = RemoteCompletion::new();
    session.submit(rec, done.clone());
    let r = wait(&done).await;
    assert_fails(
        r,
        ErrorKind::InvalidRequest,
        &["command 2", "outside a buffer of 64 bytes"],
    );
    // Both buffers exist (their allocations ran): the recording's free of
    // `a` did not run, so the session sends it again; `b`'s owner drops
    // it, as a failed pipeline drops its buffers (queued in the ledger:
    // it leads the next message).
    session.ledger().unwrap().free(b);
    works_and_holds(&fx, &remote, before).await;
    fx.free_and_shutdown().await;
}

#[tokio::test]
async fn too_many_streams_stops_the_batch_at_the_first_command_beyond() {
    let fx = fixture(|c| c.max_streams_per_lease = 1).await;
    let (remote, before) = warm(&fx).await;
    // A policy of two streams: the zip's second arm is on stream 1.
    let two = fx.policy().with_streams(2);
    let r = h2d(vec![1f32; 64])
        .zip(h2d(vec![2f32; 64]))
        .schedule(&two)
        .unwrap()
        .await;
    assert_fails(r, ErrorKind::Capacity, &["limit of 1 streams"]);
    works_and_holds(&fx, &remote, before).await;
    fx.free_and_shutdown().await;
}

#[tokio::test]
async fn too_many_ids_stops_the_batch_at_the_first_id_beyond() {
    let fx = fixture(|c| c.max_ids_per_lease = 4).await;
    let (remote, before) = warm(&fx).await;
    // Five buffers alive at once: the fifth is refused, four were made.
    let r = zeros::<f32>(16)
        .zip(zeros::<f32>(16))
        .zip(zeros::<f32>(16))
        .zip(zeros::<f32>(16))
        .zip(zeros::<f32>(16))
        .schedule(&remote)
        .unwrap()
        .await;
    assert_fails(r, ErrorKind::Capacity, &["more than 4 live ids"]);
    works_and_holds(&fx, &remote, before).await;
    fx.free_and_shutdown().await;
}

#[tokio::test]
async fn a_free_racing_a_use_stops_the_use_and_keeps_the_free() {
    let fx = fixture(|_| {}).await;
    let (remote, before) = warm(&fx).await;
    // A buffer that lives on the node.
    let buf = h2d(vec![3f32; 64])
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    let session = session_of(&remote);
    let id = buf.remote_id(&session).unwrap();
    // Its free is queued (it leads the next message), and a raw recording
    // races it with a read of the buffer: the free runs, the read does not.
    session.ledger().unwrap().free(id);
    let mut rec = Recording::new();
    let _slot = rec.read(0, id, 0, 16);
    let done = RemoteCompletion::new();
    session.submit(rec, done.clone());
    let r = wait(&done).await;
    assert_fails(r, ErrorKind::InvalidRequest, &["command 1", "unknown id"]);
    // The buffer is gone: its owner's drop frees nothing more.
    std::mem::forget(buf);
    works_and_holds(&fx, &remote, before).await;
    fx.free_and_shutdown().await;
}

/// The outcome of a submission handed to a session by hand.
async fn wait(done: &RemoteCompletion) -> cuda_async::Result<()> {
    for _ in 0..10_000 {
        if let Some(r) = done.outcome() {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("the submission never completed");
}
