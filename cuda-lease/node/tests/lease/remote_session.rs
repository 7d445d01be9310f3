//! The lease as a `cuda-async` remote session ([`LeaseBackend`]), against an
//! embedded node with the in-memory device: a `cuda-async` recording goes
//! out as one BATCH, its reads land in host buffers that need no driver,
//! queued frees reach the node, and failures come back as `cuda-async`'s
//! remote error variants.

use cuda_async::RemoteErrorExt;
use std::time::Duration;

use crate::common::*;
use cuda_async::remote::{proto::LaunchArg, Id, Op, Recording, RemoteCompletion};
use cuda_async::{HostBuffer, LaunchConfig, RemoteSession};
use cuda_lease::client::Lease;
use cuda_lease::remote::LeaseBackend;

const KERNELS: &str = r#"
extern "C" __global__ void fill(float* out, float v, unsigned n) {}
extern "C" __global__ void axpy(float a, const float* x, float* y, unsigned n) {}
extern "C" __global__ void __fault() {}
"#;

fn config(n: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(64), 1, 1),
        block_dim: (64, 1, 1),
        shared_mem_bytes: 0,
    }
}

async fn outcome(done: &RemoteCompletion) -> cuda_async::Result<()> {
    for _ in 0..10_000 {
        if let Some(r) = done.outcome() {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("the submission never completed");
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[tokio::test]
async fn a_recording_is_one_batch_and_its_reads_land_in_host_buffers() {
    let fx = Fixture::node_path(1 << 20).lease(1 << 16).start().await;
    let (node, lease) = (&fx.node, fx.lease());
    let session = LeaseBackend::current(lease.session());
    assert!(
        session.describe().starts_with("lease "),
        "{}",
        session.describe()
    );
    let kernels = cuda_async::Module::cuda(KERNELS, &[]).unwrap();
    let axpy = kernels.kernel("axpy").unwrap();
    let fill = kernels.kernel("fill").unwrap();
    let n = 300u32;
    let x: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
    let before = metric(&node.metrics_text(), "gpu_batch_total").unwrap();

    let mut rec = Recording::new();
    let (bx, by) = (session.fresh_id(), session.fresh_id());
    let size = u64::from(n) * 4;
    for id in [bx, by] {
        rec.push(0, Op::Alloc { buf: Id(id), size });
    }
    rec.write(0, bx, 0, &bytes(&x));
    let buf = |id| LaunchArg::Mem {
        buf: Id(id),
        offset: 0,
    };
    let scalar = |b: [u8; 4]| LaunchArg::bytes(b);
    rec.launch(
        0,
        &fill,
        &config(n),
        vec![buf(by), scalar(1f32.to_le_bytes()), scalar(n.to_le_bytes())],
    );
    rec.launch(
        0,
        &axpy,
        &config(n),
        vec![
            scalar(4f32.to_le_bytes()),
            buf(bx),
            buf(by),
            scalar(n.to_le_bytes()),
        ],
    );
    let slot = rec.read(0, by, 0, size);
    let y = HostBuffer::<f32>::remote(slot).unwrap();
    assert!(y.as_slice().is_err(), "no data before the reply");
    let done = RemoteCompletion::new();
    session.submit(rec, done.clone());
    outcome(&done).await.unwrap();
    let want: Vec<f32> = x.iter().map(|v| 4.0 * v + 1.0).collect();
    assert_eq!(y.to_vec().unwrap(), want);
    let after = metric(&node.metrics_text(), "gpu_batch_total").unwrap();
    assert_eq!(after - before, 1, "one message for the whole recording");

    // Dropped buffers: their frees reach the node (alone, at once: no
    // message is in flight). (The lease also holds the module's source
    // bytes.)
    let held = lease.query().await.unwrap().allocated;
    assert_eq!(held, 2 * size + KERNELS.len() as u64);
    let ledger = session.ledger().unwrap();
    for id in [bx, by] {
        if ledger.free(id) {
            session.submit(Recording::new(), RemoteCompletion::new());
        }
    }
    assert!(
        eventually(Duration::from_secs(5), || async {
            lease.query().await.unwrap().allocated == held - 2 * size
        })
        .await,
        "the queued frees did not reach the node"
    );
    fx.free_and_shutdown().await;
}

#[tokio::test]
async fn failures_come_back_as_cuda_async_remote_errors() {
    let fx = Fixture::node_path(1 << 20)
        .manual_clock()
        .lease_with(
            Lease::builder()
                .min_vram(4096)
                .ttl(Duration::from_secs(30))
                .auto_renew(false),
        )
        .start()
        .await;
    let (client, lease, clock) = (fx.client(), fx.lease(), fx.clock());
    let session = LeaseBackend::current(lease.session());
    let run = |rec: Recording| {
        let session = session.clone();
        async move {
            let done = RemoteCompletion::new();
            session.submit(rec, done.clone());
            outcome(&done).await
        }
    };
    // Beyond the reservation.
    let mut rec = Recording::new();
    rec.push(
        0,
        Op::Alloc {
            buf: Id(session.fresh_id()),
            size: 1 << 20,
        },
    );
    let e = run(rec).await.unwrap_err();
    assert!(
        matches!(e.remote_kind(), Some(cuda_async::RemoteErrorKind::Capacity)),
        "{e}"
    );
    // A module that does not compile: the node's log.
    let bad = cuda_async::Module::cuda("#error no\n__global__ void k() {}", &[]).unwrap();
    let mut rec = Recording::new();
    rec.launch(0, &bad.kernel("k").unwrap(), &config(1), vec![]);
    let e = run(rec).await.unwrap_err();
    assert!(
        matches!(e.remote(), Some(e) if matches!(e.kind(), cuda_async::RemoteErrorKind::LoadFailed) && e.message().contains("NVRTC log")),
        "{e}"
    );
    // A kernel fault.
    let kernels = cuda_async::Module::cuda(KERNELS, &[]).unwrap();
    let mut rec = Recording::new();
    rec.launch(0, &kernels.kernel("__fault").unwrap(), &config(1), vec![]);
    let e = run(rec).await.unwrap_err();
    assert!(
        matches!(
            e.remote_kind(),
            Some(cuda_async::RemoteErrorKind::LaunchFailed)
        ),
        "{e}"
    );
    // Expiry, on a fresh lease.
    let lease = Lease::builder()
        .min_vram(4096)
        .ttl(Duration::from_secs(5))
        .auto_renew(false)
        .on(client.clone())
        .await
        .unwrap();
    let session = LeaseBackend::current(lease.session());
    clock.advance(Duration::from_secs(6));
    let mut rec = Recording::new();
    rec.push(
        0,
        Op::Alloc {
            buf: Id(session.fresh_id()),
            size: 4,
        },
    );
    let done = RemoteCompletion::new();
    session.submit(rec, done.clone());
    let e = outcome(&done).await.unwrap_err();
    assert!(
        matches!(
            e.remote_kind(),
            Some(cuda_async::RemoteErrorKind::LeaseExpired)
        ),
        "{e}"
    );
    fx.shutdown().await;
}

#[test]
fn a_plain_fn_main_leases_records_and_waits_with_no_runtime_of_its_own() {
    // The node needs a runtime; the client side below has none.
    let node_rt = tokio::runtime::Runtime::new().unwrap();
    let fx = node_rt.block_on(Fixture::node_path(1 << 20).start());
    let node = &fx.node;
    let builder = Lease::builder()
        .min_vram(1 << 16)
        .config(client_config(node));
    let remote = cuda_lease::remote::BlockingLease::connect(builder, node.addr()).unwrap();
    let session = remote.session();
    let mut rec = Recording::new();
    let id = session.fresh_id();
    rec.push(
        0,
        Op::Alloc {
            buf: Id(id),
            size: 16,
        },
    );
    rec.push(
        0,
        Op::Fill {
            buf: Id(id),
            offset: 4,
            len: 8,
            value: 7,
        },
    );
    let host = HostBuffer::<u32>::remote(rec.read(0, id, 0, 16)).unwrap();
    let done = RemoteCompletion::new();
    session.submit(rec, done.clone());
    let mut waited = 0;
    while done.outcome().is_none() {
        assert!(waited < 10_000, "never completed");
        std::thread::sleep(Duration::from_millis(1));
        waited += 1;
    }
    done.outcome().unwrap().unwrap();
    assert_eq!(host.to_vec().unwrap(), [0, 0x0707_0707, 0x0707_0707, 0]);
    remote.free().unwrap();
    // Inside a runtime the blocking forms work too (they block the
    // calling thread, never panic): connect, free, and a drop.
    node_rt.block_on(async {
        for free in [true, false] {
            let b = Lease::builder()
                .min_vram(1 << 16)
                .config(client_config(node));
            let remote = cuda_lease::remote::BlockingLease::connect(b, node.addr()).unwrap();
            if free {
                remote.free().unwrap();
            } else {
                drop(remote);
            }
        }
    });
    node_rt.block_on(fx.shutdown());
}
