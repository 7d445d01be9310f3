//! Large transfers of `cuda-async` submissions on a lease take the data
//! path (streamed, striped MEM_WRITE and MEM_READ), not the BATCH message:
//! byte-exact at the sizes around the node's chunk, striped and not, in
//! order with the lease's other submissions, and a failure leaves the
//! lease working. In-memory device, no GPU.

use std::sync::Arc;

use crate::common::*;
use cuda_async::prelude::*;
use cuda_async::{DeviceBuffer, Kernel, LaunchConfig, Module, RemotePolicy};
use cuda_lease::client::{Client, Lease};
use cuda_lease::proto::{self, Opcode};
use cuda_lease_node::node::Node;

/// The node's chunk: one slot of its ring with a worker.
const CHUNK: usize = 2 << 20;

/// What `f` sent in BATCH messages: (messages, commands).
async fn sent_by<T>(node: &Node, f: impl std::future::Future<Output = T>) -> (T, (u64, u64)) {
    let before = batches(node);
    let out = f.await;
    let after = batches(node);
    (out, (after.0 - before.0, after.1 - before.1))
}

/// A client whose submissions send transfers of `min` bytes and more on
/// the data path, striped over `stripes` connections from 1 MiB up.
async fn client(node: &Node, min: usize, stripes: usize) -> Arc<Client> {
    let cfg = client_config(node)
        .stripes(stripes, 1 << 20)
        .data_path_min_bytes(min);
    Arc::new(Client::connect(node.addr(), &cfg).await.expect("connect"))
}

async fn on(node: &Node, min: usize, stripes: usize) -> (Lease, RemotePolicy) {
    let lease = lease_of(&client(node, min, stripes).await, 256 << 20).await;
    let policy = policy_of(&lease);
    (lease, policy)
}

/// `bytes` through `h2d` then `d2h` in one submission, and back.
async fn round_trip(bytes: &[u8], remote: &RemotePolicy) -> Vec<u8> {
    let back = h2d(bytes.to_vec())
        .then(d2h)
        .schedule(remote)
        .unwrap()
        .await
        .unwrap();
    back.to_vec().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_and_downloads_on_the_data_path_are_byte_exact() {
    let fx = Fixture::node_path(1 << 30).start().await;
    for stripes in [1, 4] {
        let (_lease, remote) = on(&fx.node, 1, stripes).await;
        for (i, n) in [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, (64 << 20) + 123]
            .into_iter()
            .enumerate()
        {
            let bytes = random_bytes(n, 7 + i as u64);
            // h2d then d2h in one submission: both transfers stream.
            assert!(
                round_trip(&bytes, &remote).await == bytes,
                "{n} bytes, {stripes} stripe(s)"
            );
            // And in submissions of their own, with a device copy between.
            let buf = h2d(bytes.clone()).schedule(&remote).unwrap().await.unwrap();
            let copy = d2d(buf).schedule(&remote).unwrap().await.unwrap();
            let back = d2h(copy).schedule(&remote).unwrap().await.unwrap();
            assert!(
                back.to_vec().unwrap() == bytes,
                "{n} bytes apart, {stripes} stripe(s)"
            );
        }
    }
    fx.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_read_lands_in_the_buffer_it_is_given_used_again() {
    let fx = Fixture::node_path(1 << 30).start().await;
    for stripes in [1, 4] {
        let lease = lease_of(&client(&fx.node, 1, stripes).await, 64 << 20).await;
        let s = lease.session();
        let n = (8 << 20) + 5;
        let buf = s.alloc(n as u64).await.unwrap();
        let mut out = vec![0u8; n];
        for seed in [1, 2] {
            let bytes = random_bytes(n, seed);
            s.write(&buf, 0, &bytes).await.unwrap();
            out = s.read_into(&buf, 0, out).await.unwrap();
            assert!(out == bytes, "seed {seed}, {stripes} stripe(s)");
        }
        // From an offset, into a shorter buffer.
        let tail = s.read_into(&buf, 3, vec![0u8; 16]).await.unwrap();
        assert_eq!(tail, out[3..19]);
        drop(buf);
        lease.free().await.unwrap();
    }
    fx.shutdown().await;
}

#[tokio::test]
async fn a_large_upload_leaves_the_message_and_a_small_one_does_not() {
    let fx = Fixture::node_path(1 << 28).start().await;
    let (lease, remote) = on(&fx.node, 1 << 20, 1).await;
    let module_free = lease.query().await.unwrap().allocated;
    // Small: one BATCH (allocation, write, read, free), as always.
    let small = random_bytes(1000, 1);
    let (back, sent) = sent_by(&fx.node, round_trip(&small, &remote)).await;
    assert_eq!(back, small);
    assert_eq!(sent, (1, 4));
    // Large upload alone: its allocation goes alone, the bytes as
    // MEM_WRITEs, then an empty BATCH takes the upload's place in the
    // lease's order.
    let big = random_bytes(3 << 20, 2);
    let (buf, sent) = sent_by(&fx.node, async {
        h2d(big.clone()).schedule(&remote).unwrap().await.unwrap()
    })
    .await;
    assert_eq!(sent, (2, 1));
    // Large download alone: an empty BATCH orders it after the lease's
    // earlier submissions, then MEM_READs; the buffer's free follows alone
    // once the download is done (no other message is in flight).
    let ledger = remote.session().ledger().unwrap();
    let (back, sent) = sent_by(&fx.node, async {
        let back = d2h(buf).schedule(&remote).unwrap().await.unwrap();
        let idle = tokio::task::spawn_blocking(move || {
            ledger.wait_idle(std::time::Duration::from_secs(10))
        });
        assert!(idle.await.unwrap(), "frees still going");
        back
    })
    .await;
    assert_eq!(sent, (2, 1));
    assert!(back.to_vec().unwrap() == big);
    // Nothing left behind.
    wait_until(
        std::time::Duration::from_secs(5),
        "the buffers freed",
        || async { lease.query().await.unwrap().allocated == module_free },
    )
    .await;
    fx.shutdown().await;
}

/// A lease reports its memory as a local pool does (LEASE_QUERY's
/// `mem_stats`): the buffers a remote policy makes count in `used`, and
/// `used_high` keeps the most at once after some are freed; `reserved`
/// is the lease's reservation.
#[tokio::test]
async fn a_lease_reports_its_memory_as_a_pool_does() {
    let fx = Fixture::node_path(1 << 28).start().await;
    let (lease, remote) = on(&fx.node, 1 << 20, 1).await;
    let base = lease.query().await.unwrap();
    let a = zeros::<u8>(1 << 20)
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    let b = zeros::<u8>(3 << 20)
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    let s = lease.mem_stats().await.unwrap();
    let peak = base.allocated + (4 << 20);
    assert_eq!((s.used, s.used_high), (peak, peak), "{s:?}");
    assert_eq!(
        (s.reserved, s.reserved_high),
        (base.reserved, base.reserved)
    );
    drop(b);
    let after = base.allocated + (1 << 20);
    wait_until(
        std::time::Duration::from_secs(5),
        "the 3 MiB buffer freed",
        || async { lease.query().await.unwrap().allocated == after },
    )
    .await;
    let s = lease.mem_stats().await.unwrap();
    assert_eq!((s.used, s.used_high), (after, peak), "{s:?}");
    drop(a);
    fx.shutdown().await;
}

/// The in-memory device's `fill(float* out, float v, unsigned n)`, in a
/// module whose source starts with `padding` (a module sent with its
/// first launch makes that message as large as its source).
fn fill_kernel(padding: &str) -> Kernel {
    let source =
        format!("{padding}extern \"C\" __global__ void fill(float* out, float v, unsigned n) {{}}");
    Module::cuda(source, &[]).unwrap().kernel("fill").unwrap()
}

/// Schedules `fill` writing `v` over all of `buf` (`n` floats).
fn overwrite(
    fill: &Kernel,
    buf: &Arc<DeviceBuffer<f32>>,
    v: f32,
    n: usize,
    remote: &RemotePolicy,
) -> impl std::future::Future<Output = cuda_async::Result<(Arc<DeviceBuffer<f32>>, f32, u32)>> {
    // SAFETY: the in-memory device's `fill` writes out[0..n) of an n-float buffer.
    unsafe {
        launch(
            fill,
            LaunchConfig::for_num_elems(n as u32),
            (buf.clone(), v, n as u32),
        )
    }
    .schedule(remote)
    .unwrap()
}

/// `floats` uploaded (awaited) to a buffer of its own.
async fn uploaded(floats: &[f32], remote: &RemotePolicy) -> Arc<DeviceBuffer<f32>> {
    Arc::new(
        h2d(floats.to_vec())
            .schedule(remote)
            .unwrap()
            .await
            .unwrap(),
    )
}

/// Submissions made while a streamed one runs its steps run after it, in
/// the order of their calls: a download of a buffer, then a kernel that
/// overwrites it, submitted together: the download sees the buffer
/// before the kernel, the next one after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn later_submissions_wait_for_a_streamed_one() {
    let fx = Fixture::node_path(1 << 28).start().await;
    let (_lease, remote) = on(&fx.node, 1 << 20, 4).await;
    let fill = fill_kernel("");
    let n = 2 << 20;
    for round in 0..2u8 {
        let floats: Vec<f32> = (0..n)
            .map(|i| (i % 1000) as f32 + f32::from(round))
            .collect();
        let buf = uploaded(&floats, &remote).await;
        let read = d2h(buf.clone()).schedule(&remote).unwrap();
        let (got, done) = tokio::join!(read, overwrite(&fill, &buf, -1.0, n, &remote));
        done.unwrap();
        assert!(
            got.unwrap().to_vec().unwrap() == floats,
            "round {round}: the download saw the later kernel's writes"
        );
        let after = d2h(buf).schedule(&remote).unwrap().await.unwrap();
        assert!(
            after.to_vec().unwrap().iter().all(|v| *v == -1.0),
            "round {round}"
        );
        // The other way round: a streamed download submitted after a
        // kernel still in flight sees the kernel's writes. (The kernel's
        // module is new and large, so its message takes a while to
        // arrive: the download's own requests would overtake it.)
        let buf = uploaded(&floats, &remote).await;
        let padding = format!("// round {round}\n{}", "// padding\n".repeat(400_000));
        let slow_fill = fill_kernel(&padding);
        let done = overwrite(&slow_fill, &buf, -2.0, n, &remote);
        let read = d2h(buf).schedule(&remote).unwrap();
        let (done, got) = tokio::join!(done, read);
        done.unwrap();
        assert!(
            got.unwrap().to_vec().unwrap().iter().all(|v| *v == -2.0),
            "round {round}: the download ran before the earlier kernel"
        );
    }
    fx.shutdown().await;
}

/// An upload whose allocation fails (the lease is too small) fails its
/// submission with the capacity error, and the lease works after it.
#[tokio::test]
async fn a_failed_streamed_submission_leaves_the_lease_working() {
    let fx = Fixture::node_path(1 << 28).start().await;
    let c = client(&fx.node, 1, 1).await;
    let lease = lease_of(&c, 4 << 20).await;
    let remote = policy_of(&lease);
    let e = h2d(random_bytes(8 << 20, 4))
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap_err();
    assert_eq!(
        e.remote_kind(),
        Some(cuda_async::RemoteErrorKind::Capacity),
        "{e}"
    );
    let bytes = random_bytes(2 << 20, 5);
    assert!(round_trip(&bytes, &remote).await == bytes);
    fx.shutdown().await;
}

// A MEM_WRITE or MEM_READ that names a numbered batch (`after`) runs on
// the node once that batch has, whatever order they arrive in: what lets
// a streamed submission send a batch and its transfers at once.

fn batch_body(lease: cuda_lease::proto::LeaseId, seq: u64, ops: Vec<proto::Op<'_>>) -> Vec<u8> {
    proto::to_body(&proto::Batch {
        lease,
        seq,
        modules: vec![],
        commands: ops
            .into_iter()
            .map(|op| proto::Command { stream: 0, op })
            .collect(),
    })
}

fn read_after(lease: cuda_lease::proto::LeaseId, buf: u64, len: u32, after: u64) -> Vec<u8> {
    proto::to_body(&proto::MemRead {
        lease,
        buf: proto::Id(buf),
        offset: 0,
        len,
        after,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_that_follow_a_batch_wait_for_it() {
    let fx = Fixture::node_path(1 << 30).lease(1 << 20).start().await;
    let (client, id) = (fx.client().clone(), fx.lease().id());
    // Batch 2 makes buffer #7 and fills it; the node holds it until batch
    // 1 runs, and the read of #7 (sent first) until batch 2 has run.
    let mut read = {
        let client = client.clone();
        tokio::spawn(async move {
            client
                .request(Opcode::MemRead, &read_after(id, 7, 64, 2), &[])
                .await
        })
    };
    let fill = proto::Op::Fill {
        buf: proto::Id(7),
        offset: 0,
        len: 64,
        value: 0x3C,
    };
    let second = {
        let client = client.clone();
        let body = batch_body(
            id,
            2,
            vec![
                proto::Op::Alloc {
                    buf: proto::Id(7),
                    size: 64,
                },
                fill,
            ],
        );
        tokio::spawn(async move { client.request(Opcode::Batch, &body, &[]).await })
    };
    // Without its batch the read is still waiting (a read that did not
    // wait would have been refused: #7 does not exist yet).
    let early = tokio::time::timeout(std::time::Duration::from_millis(300), &mut read).await;
    assert!(
        early.is_err(),
        "the read did not wait for batch 2: {early:?}"
    );
    let first = batch_body(id, 1, vec![]);
    client.request(Opcode::Batch, &first, &[]).await.unwrap();
    second.await.unwrap().unwrap();
    let (_, data) = read.await.unwrap().unwrap();
    assert_eq!(data, vec![0x3C; 64]);
    // A write that follows batch 3 (which frees #7 and makes it again)
    // lands in the new buffer.
    let write = proto::to_body(&proto::MemWrite {
        lease: id,
        buf: proto::Id(7),
        offset: 8,
        after: 3,
    });
    let written = {
        let client = client.clone();
        tokio::spawn(async move { client.request(Opcode::MemWrite, &write, b"followed").await })
    };
    let third = batch_body(
        id,
        3,
        vec![
            proto::Op::Free { id: proto::Id(7) },
            proto::Op::Alloc {
                buf: proto::Id(7),
                size: 64,
            },
        ],
    );
    client.request(Opcode::Batch, &third, &[]).await.unwrap();
    written.await.unwrap().unwrap();
    let (_, data) = client
        .request(Opcode::MemRead, &read_after(id, 7, 16, 3), &[])
        .await
        .unwrap();
    assert_eq!(&data, b"\0\0\0\0\0\0\0\0followed");
    fx.free_and_shutdown().await;
}

/// A transfer that follows a batch that has not come waits for it, with
/// no time bound, until it can never come: the connection that carries
/// the lease's batches closed without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_that_follows_a_batch_that_never_comes_fails_when_its_connection_closes() {
    let fx = Fixture::node_path(1 << 30).lease(1 << 20).start().await;
    let (owner, id) = (fx.client().clone(), fx.lease().id());
    // The lease's batches come on the owner's connection: batch 2, then
    // its connection closes with batch 1 never sent.
    let second = batch_body(id, 2, vec![]);
    let second = {
        let owner = owner.clone();
        tokio::spawn(async move { owner.request(Opcode::Batch, &second, &[]).await })
    };
    let other = connect(&fx.node).await;
    let mut read = {
        let other = other.clone();
        tokio::spawn(async move {
            other
                .request(Opcode::MemRead, &read_after(id, 7, 64, 2), &[])
                .await
        })
    };
    let early = tokio::time::timeout(std::time::Duration::from_millis(500), &mut read).await;
    assert!(early.is_err(), "the read did not wait: {early:?}");
    owner.close();
    let _ = second.await.unwrap();
    let err = tokio::time::timeout(std::time::Duration::from_secs(5), read)
        .await
        .expect("the read still waits after the connection closed")
        .unwrap()
        .unwrap_err();
    assert_eq!(err.kind(), cuda_lease::client::ErrorKind::InvalidRequest);
    assert!(err.message().contains("batch 1"), "{}", err.message());
    fx.shutdown().await;
}

/// `timed` on a leased GPU: the node times the op and the nanoseconds
/// come back in the reply, in command order between the reads around
/// them, on the message path and when the op's transfers stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timed_ops_are_timed_by_the_node_between_the_reads_around_them() {
    let fx = Fixture::node_path(1 << 30).start().await;
    // Everything in the message; then transfers of 1 KiB and more stream.
    for min in [usize::MAX, 1024] {
        let (_lease, remote) = on(&fx.node, min, 1).await;
        let (a, b) = (random_bytes(4096, 1), random_bytes(64, 2));
        let (x, y) = (
            h2d(a.clone()).schedule(&remote).unwrap().await.unwrap(),
            h2d(b.clone()).schedule(&remote).unwrap().await.unwrap(),
        );
        // A read, the timer's end, another read: one submission.
        let ((va, t), vb) = d2h(&x)
            .then(|v| d2d(&x).map(move |_| v))
            .timed()
            .then(|(v, t)| d2h(&y).map(move |w| ((v, t), w)))
            .schedule(&remote)
            .unwrap()
            .await
            .unwrap();
        assert!(va.to_vec().unwrap() == a, "min {min}: the first read");
        assert!(
            vb.to_vec().unwrap() == b,
            "min {min}: the read after the timer"
        );
        let d = t.elapsed().unwrap();
        assert!(d < std::time::Duration::from_secs(10), "min {min}: {d:?}");
        // Timers end with their op: the lease holds no timer ids after.
        let (_, t) = zeros::<u8>(16)
            .timed()
            .schedule(&remote)
            .unwrap()
            .await
            .unwrap();
        t.elapsed().unwrap();
    }
    fx.shutdown().await;
}

/// Many tasks' streamed pipelines at once on one lease (uploads on the
/// bulk-data channel): the client opens no more connections than its
/// pool allows (the node refuses a principal's connections past its
/// limit), the others wait for a turn, and every pipeline gets its own
/// bytes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_tasks_streamed_pipelines_share_the_bulk_channel() {
    let fx = Fixture::node_path(1 << 30).start().await;
    let (lease, remote) = {
        let lease = lease_of(&client(&fx.node, 1 << 20, 2).await, 512 << 20).await;
        let policy = policy_of(&lease);
        (lease, Arc::new(policy))
    };
    let tasks: Vec<_> = (0..48u64)
        .map(|t| {
            let remote = remote.clone();
            tokio::spawn(async move {
                for round in 0..2 {
                    let bytes = random_bytes(1 << 20, t * 10 + round);
                    assert!(
                        round_trip(&bytes, &remote).await == bytes,
                        "task {t} round {round}"
                    );
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    drop(lease);
    fx.shutdown().await;
}
