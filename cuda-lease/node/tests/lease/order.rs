//! A lease's submissions run in the order the client made them, decided by
//! the channel and never by a clock: slow work (a delayed kernel, a large
//! module) holds the work behind it for as long as it takes, and the work
//! behind it then sees its writes; a freed lease fails what waits on it at
//! once. In-memory device (its `delay(ms)` kernel), no GPU.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::*;
use cuda_async::prelude::*;
use cuda_async::{DeviceBuffer, Kernel, LaunchConfig, Module, RemotePolicy};
use cuda_lease::client::{Client, Lease};
use cuda_lease::proto::{
    self, Id, LaunchArg, LaunchSpec, ModuleHash, Op, Opcode, Operand, ScalarBytes, SourceKind,
};
use cuda_lease_node::node::Node;

/// How long the slow work takes: longer than any reorder window a timer
/// would use.
const SLOW_MS: u32 = 3000;

/// A client sending transfers of 1 MiB and more on the data path, striped
/// over 4 connections.
async fn on(node: &Node) -> (Lease, RemotePolicy) {
    let cfg = client_config(node)
        .stripes(4, 1 << 20)
        .data_path_min_bytes(1 << 20);
    let client = Arc::new(Client::connect(node.addr(), &cfg).await.expect("connect"));
    let lease = lease_of(&client, 256 << 20).await;
    let policy = policy_of(&lease);
    (lease, policy)
}

const DELAY_SRC: &str = "extern \"C\" __global__ void delay(unsigned ms) {}\n\
                         extern \"C\" __global__ void fill(float* out, float v, unsigned n) {}";

fn kernels() -> (Kernel, Kernel) {
    let m = Module::cuda(DELAY_SRC, &[]).unwrap();
    (m.kernel("delay").unwrap(), m.kernel("fill").unwrap())
}

/// One submission: `delay(ms)`, then `fill` writes `v` over `big` and
/// `small`.
fn slow_fill(
    (delay, fill): &(Kernel, Kernel),
    ms: u32,
    big: &Arc<DeviceBuffer<f32>>,
    small: &Arc<DeviceBuffer<f32>>,
    v: f32,
) -> impl DeviceOp<Output = ()> {
    let one = LaunchConfig::for_num_elems(1);
    let (nb, ns) = (big.len() as u32, small.len() as u32);
    let (fill2, big, small) = (fill.clone(), big.clone(), small.clone());
    let fill = fill.clone();
    // SAFETY: the in-memory device's `delay` touches no memory; its `fill`
    // writes out[0..n) of an n-float buffer.
    unsafe { launch(delay, one, (ms,)) }
        // SAFETY: as above.
        .then(move |_| unsafe { launch(&fill, LaunchConfig::for_num_elems(nb), (big, v, nb)) })
        .then(move |_| unsafe { launch(&fill2, LaunchConfig::for_num_elems(ns), (small, v, ns)) })
        .map(|_| ())
}

async fn uploaded(n: usize, v: f32, remote: &RemotePolicy) -> Arc<DeviceBuffer<f32>> {
    Arc::new(h2d(vec![v; n]).schedule(remote).unwrap().await.unwrap())
}

/// A kernel that runs 3 s, then a small (message) and a large (data
/// path) download of what it writes, submitted while it runs: both wait
/// for it, however long it takes, and see its writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn downloads_submitted_behind_a_slow_kernel_wait_for_it_and_see_its_writes() {
    let fx = Fixture::node_path(1 << 30).start().await;
    let (_lease, remote) = on(&fx.node).await;
    let k = kernels();
    let big = uploaded(4 << 20, 1.0, &remote).await;
    let small = uploaded(16, 1.0, &remote).await;
    let t = Instant::now();
    let slow = slow_fill(&k, SLOW_MS, &big, &small, -3.0)
        .schedule(&remote)
        .unwrap();
    let small_read = d2h(small.clone()).schedule(&remote).unwrap();
    let big_read = d2h(big.clone()).schedule(&remote).unwrap();
    let (slow, s, b) = tokio::join!(slow, small_read, big_read);
    slow.unwrap();
    assert!(t.elapsed() >= Duration::from_millis(u64::from(SLOW_MS)));
    let s = s.unwrap().to_vec().unwrap();
    assert!(s.iter().all(|v| *v == -3.0), "the small download: {s:?}");
    let b = b.expect("the large download").to_vec().unwrap();
    assert!(
        b.iter().all(|v| *v == -3.0),
        "the large download ran before the kernel"
    );
    fx.shutdown().await;
}

/// A kernel in a new 4 MiB module (its message takes a while to arrive
/// and load), then a download of what it writes, submitted together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_download_behind_a_large_module_sees_its_kernel_s_writes() {
    let fx = Fixture::node_path(1 << 30).start().await;
    let (_lease, remote) = on(&fx.node).await;
    let n = 2 << 20;
    for round in 0..3 {
        let padding = format!("// round {round}\n{}", "// padding\n".repeat(400_000));
        let source = format!(
            "{padding}extern \"C\" __global__ void fill(float* out, float v, unsigned n) {{}}"
        );
        assert!(source.len() >= 4 << 20);
        let fill = Module::cuda(source, &[]).unwrap().kernel("fill").unwrap();
        let buf = uploaded(n, 1.0, &remote).await;
        // SAFETY: the in-memory device's `fill` writes out[0..n) of an
        // n-float buffer.
        let done = unsafe {
            launch(
                &fill,
                LaunchConfig::for_num_elems(n as u32),
                (buf.clone(), -2.0f32, n as u32),
            )
        }
        .schedule(&remote)
        .unwrap();
        let read = d2h(buf).schedule(&remote).unwrap();
        let (done, got) = tokio::join!(done, read);
        done.unwrap();
        assert!(
            got.unwrap().to_vec().unwrap().iter().all(|v| *v == -2.0),
            "round {round}: the download ran before the kernel"
        );
    }
    fx.shutdown().await;
}

fn module_use() -> (ModuleHash, proto::ModuleUse) {
    let kind = SourceKind::Cuda {
        options: Vec::new(),
    };
    let hash = ModuleHash::of(&kind, DELAY_SRC);
    let text = proto::ModuleText {
        kind,
        len: DELAY_SRC.len() as u32,
    };
    (
        hash,
        proto::ModuleUse {
            hash,
            source: Some(text),
        },
    )
}

fn batch_body(
    lease: proto::LeaseId,
    seq: u64,
    modules: Vec<proto::ModuleUse>,
    ops: Vec<Op<'_>>,
) -> Vec<u8> {
    proto::to_body(&proto::Batch {
        lease,
        seq,
        modules,
        commands: ops
            .into_iter()
            .map(|op| proto::Command { stream: 0, op })
            .collect(),
    })
}

fn read_after(lease: proto::LeaseId, buf: u64, len: u32, after: u64) -> Vec<u8> {
    proto::to_body(&proto::MemRead {
        lease,
        buf: Id(buf),
        offset: 0,
        len,
        after,
    })
}

/// On the wire: batch 1 makes buffer #7, runs 3 s, then fills #7; batch 2
/// copies #7 into a buffer #8 it makes; a read of #7 follows batch 1 and
/// a read of #8 follows batch 2. Sent at once, the later ones first: each
/// waits for what it follows (the ids it names exist by then), and the
/// reads see the fill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_and_transfers_behind_a_slow_batch_use_its_ids() {
    let fx = Fixture::node_path(1 << 30).lease(1 << 20).start().await;
    let (client, id) = (fx.client().clone(), fx.lease().id());
    let spawn = |op: Opcode, body: Vec<u8>, data: Vec<u8>| {
        let client = client.clone();
        tokio::spawn(async move { client.request(op, &body, &data).await })
    };
    let read8 = spawn(Opcode::MemRead, read_after(id, 8, 64, 2), Vec::new());
    let read7 = spawn(Opcode::MemRead, read_after(id, 7, 64, 1), Vec::new());
    let second = spawn(
        Opcode::Batch,
        batch_body(
            id,
            2,
            vec![],
            vec![
                Op::Alloc {
                    buf: Id(8),
                    size: 64,
                },
                Op::Copy {
                    src: Operand::new(Id(7), 0),
                    dst: Operand::new(Id(8), 0),
                    len: 64,
                },
            ],
        ),
        Vec::new(),
    );
    let (hash, module) = module_use();
    let ms = SLOW_MS.to_le_bytes();
    let first = batch_body(
        id,
        1,
        vec![module],
        vec![
            Op::Alloc {
                buf: Id(7),
                size: 64,
            },
            Op::Launch(LaunchSpec {
                module: hash,
                kernel: Cow::Borrowed("delay"),
                grid: [1, 1, 1],
                block: [1, 1, 1],
                shared_mem: 0,
                args: vec![LaunchArg::Scalar(ScalarBytes::borrowed(&ms))],
            }),
            Op::Fill {
                buf: Id(7),
                offset: 0,
                len: 64,
                value: 0x3C,
            },
        ],
    );
    let t = Instant::now();
    let first = spawn(Opcode::Batch, first, DELAY_SRC.as_bytes().to_vec());
    let (reply, _) = first.await.unwrap().unwrap();
    let reply: proto::BatchReply = proto::from_body(&reply).unwrap();
    assert_eq!(reply.error, None);
    let (reply, _) = second.await.unwrap().unwrap();
    let reply: proto::BatchReply = proto::from_body(&reply).unwrap();
    assert_eq!(reply.error, None, "batch 2 ran before batch 1");
    assert!(t.elapsed() >= Duration::from_millis(u64::from(SLOW_MS)));
    assert_eq!(read7.await.unwrap().unwrap().1, vec![0x3C; 64]);
    assert_eq!(read8.await.unwrap().unwrap().1, vec![0x3C; 64]);
    fx.free_and_shutdown().await;
}

/// A batch number the node never sees (its message was refused before it
/// was read, say) is filled by an empty batch of the same number: the
/// node answers it at once once the number has run, and runs it in its
/// turn otherwise.
#[tokio::test]
async fn an_empty_batch_fills_a_number_in_turn_and_passes_a_number_that_ran() {
    let fx = Fixture::node_path(1 << 30).lease(1 << 20).start().await;
    let (client, id) = (fx.client().clone(), fx.lease().id());
    let fill_in = batch_body(id, 1, vec![], vec![]);
    client.request(Opcode::Batch, &fill_in, &[]).await.unwrap();
    let second = batch_body(
        id,
        2,
        vec![],
        vec![Op::Alloc {
            buf: Id(3),
            size: 8,
        }],
    );
    client.request(Opcode::Batch, &second, &[]).await.unwrap();
    // Number 1 again, empty: answered at once.
    client.request(Opcode::Batch, &fill_in, &[]).await.unwrap();
    // Number 2 again, with commands: refused (it ran).
    let e = client
        .request(Opcode::Batch, &second, &[])
        .await
        .unwrap_err();
    assert!(e.message().contains("has run already"), "{e}");
    fx.free_and_shutdown().await;
}

/// Freeing a lease while a streamed pipeline (a large upload, a slow
/// kernel, a large download) is in flight: the pipeline and a submission
/// made after the free fail as freed, long before the 60 s kernel could
/// end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn freeing_a_lease_fails_what_is_in_flight_and_what_follows_at_once() {
    let fx = Fixture::node_path(1 << 30).start().await;
    let (lease, remote) = on(&fx.node).await;
    let k = kernels();
    let big = uploaded(4 << 20, 1.0, &remote).await;
    let small = uploaded(16, 1.0, &remote).await;
    let before = batches(&fx.node);
    let in_flight = tokio::spawn(
        h2d(vec![2.0f32; 4 << 20])
            .then({
                let op = slow_fill(&k, 60_000, &big, &small, -3.0);
                move |up| op.map(move |()| up)
            })
            .then(d2h)
            .schedule(&remote)
            .unwrap(),
    );
    // The slow kernel's batch is on the node (after the upload's
    // allocation).
    wait_until(Duration::from_secs(20), "the pipeline's batch", || async {
        batches(&fx.node).0 > before.0 + 1
    })
    .await;
    let t = Instant::now();
    lease.free().await.unwrap();
    let e = h2d(vec![1u8; 4 << 20])
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
    assert_eq!(
        e.remote_kind(),
        Some(cuda_async::RemoteErrorKind::LeaseFreed),
        "{e}"
    );
    let e = in_flight.await.unwrap().unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
    assert!(e.remote_kind().is_some(), "{e}");
    fx.shutdown().await;
}

/// Two tasks' independent slow kernels on one lease overlap, as they do on
/// two streams of a local pool: the node plans and sends the second while
/// the first runs, and the worker answers each when its own work is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tasks_slow_kernels_overlap_on_one_lease() {
    let fx = Fixture::node_path(1 << 30).start().await;
    let (_lease, remote) = on(&fx.node).await;
    let (delay, _) = kernels();
    let one = LaunchConfig::for_num_elems(1);
    let run = |ms: u32| {
        // SAFETY: the in-memory device's `delay` touches no memory.
        unsafe { launch(&delay, one, (ms,)) }
            .schedule(&remote)
            .unwrap()
    };
    // The module is on the node before the clock starts.
    run(0).await.unwrap();
    // Run one after the other they take at least 6 s; overlapped, 3 s and
    // what the loaded machine adds.
    let slow = Duration::from_millis(3000);
    let t = Instant::now();
    let (a, b) = tokio::join!(run(3000), run(3000));
    let wall = t.elapsed();
    a.unwrap();
    b.unwrap();
    assert!(wall >= slow, "{wall:?}");
    assert!(
        wall < Duration::from_secs(5),
        "two independent 3 s kernels took {wall:?} on one lease: they did not overlap"
    );
    fx.shutdown().await;
}
