//! Leases whose worker serves their BATCHes directly (LEASE_DIRECT): the
//! same pipelines give the same results with no BATCH through the node,
//! large transfers (still through the node) keep their place in the
//! lease's order, and the worker takes only the lease's own ticket.

use std::sync::Arc;

use crate::common::*;
use cuda_async::prelude::*;
use cuda_async::{DeviceBuffer, Kernel, LaunchConfig, Module, RemotePolicy};
use cuda_lease::client::{Client, Lease};
use cuda_lease::proto::{
    self, from_body, to_body, DirectGrant, DirectHello, Header, LeaseAlloc, LeaseGrant, LeaseRef,
    Opcode, Status,
};
use cuda_lease_node::node::Node;

const KERNELS: &str = r#"
extern "C" __global__ void axpy(float a, const float* x, float* y, unsigned n) {}
extern "C" __global__ void fill(float* out, float v, unsigned n) {}
extern "C" __global__ void __fault() {}
extern "C" __global__ void __hang() {}
"#;

fn kernel(name: &str) -> Kernel {
    Module::cuda(KERNELS, &[]).unwrap().kernel(name).unwrap()
}

/// A node that serves leases directly.
async fn direct_node() -> Node {
    let mut cfg = memory_config(1 << 28);
    cfg.direct_leases = true;
    Node::spawn_local(cfg).await.expect("node")
}

/// A lease on a new client that asks for direct leases; its policy.
async fn direct_lease(node: &Node, data_path_min: usize) -> (Lease, RemotePolicy) {
    let cfg = client_config(node)
        .direct(true)
        .data_path_min_bytes(data_path_min);
    let client = Arc::new(Client::connect(node.addr(), &cfg).await.expect("connect"));
    let lease = lease_of(&client, 64 << 20).await;
    let policy = policy_of(&lease);
    (lease, policy)
}

/// `fill` writing `v` over all of `buf` (`n` floats) on `remote`, from a
/// module new to the lease when `padded` names a round (large: its
/// message takes a while to arrive, so later requests overtake it).
fn overwrite(
    buf: &Arc<DeviceBuffer<f32>>,
    v: f32,
    n: usize,
    padded: Option<u8>,
    remote: &RemotePolicy,
) -> impl std::future::Future<Output = cuda_async::Result<(Arc<DeviceBuffer<f32>>, f32, u32)>> {
    let fill = match padded {
        None => kernel("fill"),
        Some(round) => {
            let padding = format!("// round {round}\n{}", "// padding\n".repeat(400_000));
            Module::cuda(format!("{padding}{KERNELS}"), &[])
                .unwrap()
                .kernel("fill")
                .unwrap()
        }
    };
    // SAFETY: the in-memory device's `fill` writes out[0..n) of an n-float buffer.
    unsafe {
        launch(
            &fill,
            LaunchConfig::for_num_elems(n as u32),
            (buf.clone(), v, n as u32),
        )
    }
    .schedule(remote)
    .unwrap()
}

/// A kernel whose message takes a while to arrive (a module new to the
/// lease, large) writing `v` over `buf`, and a download of `buf` submitted
/// right after it (whose own requests would overtake it): what the
/// download saw.
async fn slow_overwrite_then_read(
    buf: Arc<DeviceBuffer<f32>>,
    v: f32,
    n: usize,
    round: u8,
    remote: &RemotePolicy,
) -> Vec<f32> {
    let done = overwrite(&buf, v, n, Some(round), remote);
    let read = d2h(buf).schedule(remote).unwrap();
    let (done, got) = tokio::join!(done, read);
    done.unwrap();
    got.unwrap().to_vec().unwrap()
}

fn node_batches(node: &Node) -> u64 {
    let t = node.metrics_text();
    let all = metric(&t, "gpu_batch_total").unwrap_or(0);
    // (Read after the total, and counted before it: never above the node's.)
    all.saturating_sub(metric(&t, "gpu_batch_direct_total").unwrap_or(0))
}

/// `y = a*x + y` on the lease, then downloaded.
async fn axpy(x: Vec<f32>, y: Vec<f32>, a: f32, remote: &RemotePolicy) -> Vec<f32> {
    let n = x.len() as u32;
    let k = kernel("axpy");
    h2d(x)
        .zip(h2d(y))
        // SAFETY: axpy touches x[0..n) and y[0..n); both hold n floats.
        .then(move |(x, y)| unsafe {
            launch(&k, LaunchConfig::for_num_elems(n), (a, Arc::new(x), y, n))
        })
        .then(|(_, _, y, _)| d2h(y))
        .schedule(remote)
        .unwrap()
        .await
        .unwrap()
        .to_vec()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_lease_runs_its_pipelines_with_no_batch_through_the_node() {
    let node = direct_node().await;
    let (lease, remote) = direct_lease(&node, usize::MAX).await;
    assert!(lease.is_direct());
    let before = node_batches(&node);
    for (n, seed) in [(1000usize, 7u64), (1, 3), (4097, 11)] {
        let (x, y) = (random_f32(n, seed), random_f32(n, seed * 31));
        let want: Vec<f32> = x.iter().zip(&y).map(|(x, y)| 1.5 * x + y).collect();
        assert_eq!(axpy(x, y, 1.5, &remote).await, want, "n = {n}");
    }
    // Many tasks at once: each gets its own result.
    let remote = Arc::new(remote);
    let tasks: Vec<_> = (0..16u64)
        .map(|i| {
            let remote = remote.clone();
            tokio::spawn(async move {
                let (x, y) = (random_f32(300, i + 1), random_f32(300, i + 100));
                let want: Vec<f32> = x.iter().zip(&y).map(|(x, y)| -2.0 * x + y).collect();
                (axpy(x, y, -2.0, &remote).await, want)
            })
        })
        .collect();
    for t in tasks {
        let (got, want) = t.await.unwrap();
        assert_eq!(got, want);
    }
    assert_eq!(node_batches(&node), before, "a BATCH went through the node");
    // The node answers for what the lease holds, though its batches did
    // not pass it: a kept buffer, and the module's source once.
    let module = KERNELS.len() as u64;
    let kept = h2d(vec![0f32; 1024])
        .schedule(&*remote)
        .unwrap()
        .await
        .unwrap();
    assert_eq!(lease.query().await.unwrap().allocated, module + 4096);
    drop(kept);
    assert!(
        eventually(std::time::Duration::from_secs(5), || async {
            lease.query().await.unwrap().allocated == module
        })
        .await,
        "{:?}",
        lease.query().await.unwrap()
    );
    lease.free().await.unwrap();
    node.shutdown().await;
}

/// A second direct lease of one client names a module the client sent to
/// the node before by its hash alone: its worker has not loaded it, asks
/// for the source, and the client sends the batch again with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_module_new_to_a_direct_leases_worker_is_sent_again_with_its_source() {
    let node = direct_node().await;
    let cfg = client_config(&node).direct(true);
    let client = Arc::new(Client::connect(node.addr(), &cfg).await.expect("connect"));
    for (i, vram) in [(1u64, 1u64 << 20), (2, 1 << 21)] {
        let lease = lease_of(&client, vram).await;
        assert!(lease.is_direct());
        let (x, y) = (random_f32(64, i), random_f32(64, i + 10));
        let want: Vec<f32> = x.iter().zip(&y).map(|(x, y)| 0.5 * x + y).collect();
        assert_eq!(axpy(x, y, 0.5, &policy_of(&lease)).await, want, "lease {i}");
        lease.free().await.unwrap();
    }
    node.shutdown().await;
}

/// A batch whose module takes longer to load than the direct
/// connection may stay silent (a slow compile, 6 s against 5 s) runs: the
/// worker's endpoint keeps answering while its device loop compiles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_lease_keeps_its_connection_while_its_worker_compiles() {
    let node = direct_node().await;
    let (lease, remote) = direct_lease(&node, usize::MAX).await;
    assert!(lease.is_direct());
    // The test double takes 6 s to load this module (`compile-ms`).
    let slow = Module::cuda(format!("// compile-ms: 6000\n{KERNELS}"), &[])
        .unwrap()
        .kernel("fill")
        .unwrap();
    let n = 256u32;
    let out = h2d(vec![0f32; n as usize])
        // SAFETY: `fill` writes out[0..n) of an n-float buffer.
        .then(move |b| unsafe { launch(&slow, LaunchConfig::for_num_elems(n), (b, 2.5f32, n)) })
        .then(|(b, _, _)| d2h(b))
        .schedule(&remote)
        .unwrap()
        .await
        .expect("the pipeline across the slow compile")
        .to_vec()
        .unwrap();
    assert_eq!(out, vec![2.5f32; n as usize]);
    // The connection is still the lease's: later batches take it.
    assert_eq!(
        axpy(vec![1.0; 8], vec![1.0; 8], 2.0, &remote).await,
        vec![3.0; 8]
    );
    assert_eq!(node_batches(&node), 0, "a batch went through the node");
    lease.free().await.unwrap();
    node.shutdown().await;
}

/// Large transfers go through the node, after the batches before them:
/// a download submitted with a kernel still in flight sees its writes, and
/// a download submitted before a kernel does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_leases_streamed_transfers_keep_their_place_in_its_order() {
    let node = direct_node().await;
    let (lease, remote) = direct_lease(&node, 1 << 20).await;
    assert!(lease.is_direct());
    let n = 1 << 20;
    for round in 0..3u8 {
        let floats: Vec<f32> = (0..n)
            .map(|i| (i % 999) as f32 + f32::from(round))
            .collect();
        let buf = Arc::new(
            h2d(floats.clone())
                .schedule(&remote)
                .unwrap()
                .await
                .unwrap(),
        );
        let read = d2h(buf.clone()).schedule(&remote).unwrap();
        let (got, done) = tokio::join!(read, overwrite(&buf, -1.0, n, None, &remote));
        done.unwrap();
        assert!(
            got.unwrap().to_vec().unwrap() == floats,
            "round {round}: the download saw the later kernel's writes"
        );
        let got = slow_overwrite_then_read(buf, -2.0, n, round, &remote).await;
        assert!(
            got.iter().all(|v| *v == -2.0),
            "round {round}: the download ran before the earlier kernel"
        );
    }
    lease.free().await.unwrap();
    node.shutdown().await;
}

/// A batch that arrives late (a large new module) runs before the later
/// batch that arrives first: the worker orders them by number.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_leases_batches_run_in_number_order_whatever_order_they_arrive_in() {
    let node = direct_node().await;
    let (lease, remote) = direct_lease(&node, usize::MAX).await;
    assert!(lease.is_direct());
    let n = 4096usize;
    for round in 0..3u8 {
        let buf = Arc::new(
            h2d(vec![1.0f32; n])
                .schedule(&remote)
                .unwrap()
                .await
                .unwrap(),
        );
        let got = slow_overwrite_then_read(buf, -3.0, n, round, &remote).await;
        assert!(
            got.iter().all(|v| *v == -3.0),
            "round {round}: the download ran before the earlier kernel"
        );
    }
    lease.free().await.unwrap();
    node.shutdown().await;
}

/// A kernel fault on the direct path fails the lease as on the node's:
/// its later batches are refused, and the node reports it poisoned.
#[tokio::test]
async fn a_fault_on_a_direct_lease_poisons_it_for_the_node_too() {
    let node = direct_node().await;
    let (lease, remote) = direct_lease(&node, usize::MAX).await;
    assert!(lease.is_direct());
    fault_on(&remote).await;
    let e = h2d(vec![1u8; 16])
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap_err();
    assert!(
        matches!(
            e.remote_kind(),
            Some(cuda_async::RemoteErrorKind::LeasePoisoned)
        ),
        "{e}"
    );
    assert_eq!(
        lease.query().await.unwrap().state,
        cuda_lease::proto::LeaseState::Poisoned
    );
    node.shutdown().await;
}

/// The node learns what a direct lease holds, and that a fault ended it,
/// from the lease's worker, with no request of the lease's client: its
/// batches do not pass the node.
#[tokio::test]
async fn the_node_learns_a_direct_leases_usage_and_fault_unasked() {
    let node = direct_node().await;
    let (lease, remote) = direct_lease(&node, usize::MAX).await;
    let id = lease.id();
    let kept = h2d(vec![0f32; 1024])
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    until("the node sees the lease's 4096 bytes", || {
        node.lease_usage(&id).is_some_and(|u| u.allocated == 4096)
    })
    .await;
    fault_on(&remote).await;
    until("the node fails the lease", || {
        node.lease_usage(&id).is_none()
    })
    .await;
    drop(kept);
    node.shutdown().await;
}

/// Launches the in-memory device's fault kernel on `remote`, which fails
/// it as a launch failure.
async fn fault_on(remote: &RemotePolicy) {
    let fault = kernel("__fault");
    // SAFETY: the in-memory device's fault kernel touches nothing.
    let e = unsafe { launch(&fault, LaunchConfig::for_num_elems(1), ()) }
        .schedule(remote)
        .unwrap()
        .await
        .unwrap_err();
    assert!(
        matches!(
            e.remote_kind(),
            Some(cuda_async::RemoteErrorKind::LaunchFailed)
        ),
        "{e}"
    );
}

/// Waits until `done` says so, for at most 10 s (then fails, naming `what`).
async fn until(what: &str, done: impl Fn() -> bool) {
    let start = std::time::Instant::now();
    while !done() {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(10),
            "not within 10 s: {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// Work on a direct lease when the lease expires fails as expired, not
/// as a lost connection (the node ends the worker, whose connection drops
/// with it).
#[tokio::test]
async fn work_in_flight_on_a_direct_lease_fails_as_expired_when_it_expires() {
    let mut cfg = memory_config(1 << 26);
    cfg.direct_leases = true;
    let fx = Fixture::with_config(cfg).manual_clock().start().await;
    let client = Client::connect(fx.node.addr(), &client_config(&fx.node).direct(true))
        .await
        .unwrap();
    let lease = Lease::builder()
        .min_vram(1 << 16)
        .ttl(std::time::Duration::from_secs(5))
        .auto_renew(false)
        .on(Arc::new(client))
        .await
        .unwrap();
    assert!(lease.is_direct());
    let hang = kernel("__hang");
    let op = h2d(vec![1u8; 64])
        // SAFETY: `__hang` takes no arguments and touches nothing.
        .then(move |b| unsafe { launch(&hang, LaunchConfig::for_num_elems(1), ()) }.map(|()| b))
        .then(d2h);
    let task = tokio::spawn(op.schedule(&policy_of(&lease)).unwrap());
    // (Whether its BATCH reached the worker or not: the worker hangs in
    // it, so nothing there can say; either way it fails as expired.)
    fx.clock().advance(std::time::Duration::from_secs(6));
    // (Noticed within the connection's idle timeout, 5 s.)
    let e = tokio::time::timeout(std::time::Duration::from_secs(30), task)
        .await
        .expect("the in-flight pipeline hung")
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(
            e.remote_kind(),
            Some(cuda_async::RemoteErrorKind::LeaseExpired)
        ),
        "{e}"
    );
    fx.shutdown().await;
}

/// One request on `conn`: its reply's header and body.
async fn ask(conn: &quinn::Connection, op: Opcode, body: &[u8]) -> (Header, Vec<u8>) {
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let h = Header::request(op, 1, body.len() as u32, 0);
    proto::write_frame(&mut send, &h, body, &[]).await.unwrap();
    send.finish().unwrap();
    let f = proto::read_frame(&mut recv, &proto::Limits::default())
        .await
        .unwrap();
    (f.header, f.body)
}

/// A QUIC connection to a direct grant's worker, its certificate pinned.
async fn to_worker(grant: &DirectGrant) -> quinn::Connection {
    to_worker_conn(grant).await.unwrap()
}

async fn to_worker_conn(grant: &DirectGrant) -> Result<quinn::Connection, quinn::ConnectionError> {
    let cert = rustls::pki_types::CertificateDer::from(grant.cert_der.clone());
    let trust = cuda_lease::tls::ServerTrust {
        roots: &[cert],
        sha256: None,
    };
    let qcfg = cuda_lease::tls::client_config(trust, None, &Default::default()).unwrap();
    let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    ep.set_default_client_config(qcfg);
    let addr: std::net::SocketAddr = grant.addr.parse().unwrap();
    let conn = ep.connect(addr, "127.0.0.1").unwrap().await;
    std::mem::forget(ep);
    conn
}

#[tokio::test]
async fn the_worker_takes_only_its_leases_ticket_and_the_node_no_batch_of_it() {
    let mut cfg = memory_config(1 << 28);
    cfg.direct_leases = true;
    cfg.max_bytes_per_principal = 32 << 20;
    let node = Node::spawn_local(cfg).await.expect("node");
    let conn = raw_authed_conn(&node).await;
    let alloc = to_body(&LeaseAlloc {
        min_vram: 1 << 20,
        ttl_secs: 60,
    });
    let (h, body) = ask(&conn, Opcode::LeaseAlloc, &alloc).await;
    assert_eq!(h.status, Status::Ok);
    let lease = from_body::<LeaseGrant>(&body).unwrap().lease;
    let (h, body) = ask(&conn, Opcode::LeaseDirect, &to_body(&LeaseRef { lease })).await;
    assert_eq!(h.status, Status::Ok);
    let grant: DirectGrant = from_body(&body).unwrap();
    // Once only.
    let (h, _) = ask(&conn, Opcode::LeaseDirect, &to_body(&LeaseRef { lease })).await;
    assert_eq!(h.status, Status::BadRequest);
    // A wrong ticket, or the right one for another lease: refused.
    let mut wrong = grant.ticket;
    wrong[0] ^= 1;
    let other = cuda_lease::proto::LeaseId::random();
    for (lease, ticket) in [(lease, wrong), (other, grant.ticket)] {
        let w = to_worker(&grant).await;
        let (h, _) = ask(&w, Opcode::Hello, &to_body(&DirectHello { lease, ticket })).await;
        assert_eq!(h.status, Status::Unauthorized);
        // And the connection is closed: nothing else is served on it.
        assert!(w.closed().await.to_string().contains("ticket"));
    }
    // A BATCH before the HELLO is refused too.
    let body = to_body(&proto::Batch {
        lease,
        seq: 1,
        modules: vec![],
        commands: vec![],
    });
    let w = to_worker(&grant).await;
    let (h, _) = ask(&w, Opcode::Batch, &body).await;
    assert_eq!(h.status, Status::Unauthorized);
    // The ticket opens it; the node takes none of the lease's BATCHes.
    let w = to_worker(&grant).await;
    let (h, _) = ask(
        &w,
        Opcode::Hello,
        &to_body(&DirectHello {
            lease,
            ticket: grant.ticket,
        }),
    )
    .await;
    assert_eq!(h.status, Status::Ok);
    let (h, _) = ask(&conn, Opcode::Batch, &body).await;
    assert_eq!(h.status, Status::BadRequest);
    // The worker does (an empty batch numbered 1).
    let (h, _) = ask(&w, Opcode::Batch, &body).await;
    assert_eq!(h.status, Status::Ok);
    // A request over the lease's bytes in flight is refused on its header,
    // its data never read.
    let (mut send, mut recv) = w.open_bi().await.unwrap();
    let h = Header::request(Opcode::Batch, 2, body.len() as u32, 64 << 20);
    proto::write_frame(&mut send, &h, &body, &[]).await.unwrap();
    send.finish().unwrap();
    let f = proto::read_frame(&mut recv, &proto::Limits::default())
        .await
        .unwrap();
    assert_eq!(f.header.status, Status::CapacityExceeded);
    // Eight connections at once (this one and seven that never say
    // HELLO); a ninth is refused before its handshake.
    let idle: Vec<_> = futures::future::join_all((0..7).map(|_| to_worker_conn(&grant))).await;
    assert!(idle.iter().all(Result::is_ok));
    assert!(to_worker_conn(&grant).await.is_err());
    node.shutdown().await;
}

#[tokio::test]
async fn a_node_without_direct_leases_serves_a_lease_that_asked_itself() {
    let mut cfg = memory_config(1 << 26);
    cfg.direct_leases = false;
    let node = Node::spawn_local(cfg).await.unwrap();
    let (lease, remote) = direct_lease(&node, usize::MAX).await;
    assert!(!lease.is_direct());
    let (x, y) = (random_f32(100, 1), random_f32(100, 2));
    let want: Vec<f32> = x.iter().zip(&y).map(|(x, y)| 3.0 * x + y).collect();
    assert_eq!(axpy(x, y, 3.0, &remote).await, want);
    lease.free().await.unwrap();
    node.shutdown().await;
}

#[tokio::test]
async fn direct_leases_workers_bind_in_the_port_range_and_a_lease_without_a_free_port_takes_the_node_path(
) {
    // A port free now, for the range of one port.
    let port = std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .expect("a free port")
        .port();
    let mut cfg = memory_config(1 << 28);
    cfg.direct_leases = true;
    cfg.direct_ports = Some((port, port));
    let node = Node::spawn_local(cfg).await.unwrap();
    let client = Arc::new(
        Client::connect(node.addr(), &client_config(&node).direct(true))
            .await
            .expect("connect"),
    );
    let first = lease_of(&client, 16 << 20).await;
    assert!(first.is_direct());
    // Its worker holds the range's one port: the next lease's worker finds
    // none free, and the node serves that lease's batches.
    let second = lease_of(&client, 16 << 20).await;
    assert!(
        !second.is_direct(),
        "no free port in the range: the node's path"
    );
    let (x, y) = (random_f32(100, 1), random_f32(100, 2));
    let want: Vec<f32> = x.iter().zip(&y).map(|(x, y)| 3.0 * x + y).collect();
    for lease in [&first, &second] {
        let remote = policy_of(lease);
        assert_eq!(axpy(x.clone(), y.clone(), 3.0, &remote).await, want);
    }
    first.free().await.unwrap();
    second.free().await.unwrap();
    node.shutdown().await;
}

#[tokio::test]
async fn a_direct_leases_batches_count_in_the_nodes_metrics() {
    let node = direct_node().await;
    let (lease, remote) = direct_lease(&node, usize::MAX).await;
    assert!(lease.is_direct());
    let before = batches(&node);
    let out = h2d(vec![1f32; 16])
        .then(d2h)
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    assert_eq!(out.to_vec().unwrap(), vec![1f32; 16]);
    // The node learns it from the worker at its next reaper tick.
    until("the node counts the direct lease's batch", || {
        batches(&node).0 > before.0
    })
    .await;
    let now = batches(&node);
    assert_eq!(node_batches(&node), 0, "a batch went through the node");
    // An allocation, its write and its read, and the buffer's free.
    assert!(now.1 - before.1 >= 3, "{before:?} -> {now:?}");
    lease.free().await.unwrap();
    node.shutdown().await;
}

/// Sends a BATCH of `lease` declaring `data` bytes of data on `conn` and
/// all of them: its reply's status and message.
async fn batch_with_data(
    conn: &quinn::Connection,
    lease: cuda_lease::proto::LeaseId,
    data: usize,
) -> (Status, String) {
    let body = to_body(&proto::Batch {
        lease,
        seq: 0,
        modules: vec![],
        commands: vec![],
    });
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let h = Header::request(Opcode::Batch, 1, body.len() as u32, data as u32);
    let _ = proto::write_frame(&mut send, &h, &body, &vec![0u8; data]).await;
    let _ = send.finish();
    let f = proto::read_frame(&mut recv, &proto::Limits::default())
        .await
        .unwrap();
    let message = from_body::<proto::ErrorBody>(&f.body)
        .map(|e| e.message)
        .unwrap_or_default();
    (f.header.status, message)
}

/// Sends `probe` until its status is (`want`) or is not (`!want`)
/// CAPACITY_EXCEEDED: another stream's request reached its worker.
async fn until_capacity<F: std::future::Future<Output = (Status, String)>>(
    want: bool,
    probe: impl Fn() -> F,
) {
    for _ in 0..1000 {
        if (probe().await.0 == Status::CapacityExceeded) == want {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("the probe never saw capacity exceeded == {want}");
}

#[tokio::test]
async fn a_principals_bytes_in_flight_are_one_budget_across_its_direct_leases_and_the_node() {
    let mut cfg = memory_config(1 << 28);
    cfg.direct_leases = true;
    cfg.max_bytes_per_principal = 8 << 20;
    let node = Node::spawn_local(cfg).await.expect("node");
    let conn = raw_authed_conn(&node).await;
    let mut leases = Vec::new();
    for _ in 0..3 {
        let alloc = to_body(&LeaseAlloc {
            min_vram: 1 << 20,
            ttl_secs: 60,
        });
        let (h, body) = ask(&conn, Opcode::LeaseAlloc, &alloc).await;
        assert_eq!(h.status, Status::Ok);
        leases.push(from_body::<LeaseGrant>(&body).unwrap().lease);
    }
    // Two leases served by their workers; the third by the node.
    let mut workers = Vec::new();
    for &lease in &leases[..2] {
        let (h, body) = ask(&conn, Opcode::LeaseDirect, &to_body(&LeaseRef { lease })).await;
        assert_eq!(h.status, Status::Ok);
        let grant: DirectGrant = from_body(&body).unwrap();
        let w = to_worker(&grant).await;
        let hello = to_body(&DirectHello {
            lease,
            ticket: grant.ticket,
        });
        assert_eq!(ask(&w, Opcode::Hello, &hello).await.0.status, Status::Ok);
        workers.push(w);
    }
    // The first lease's worker holds a request of 6 MiB whose data is still
    // coming.
    let body = to_body(&proto::Batch {
        lease: leases[0],
        seq: 0,
        modules: vec![],
        commands: vec![],
    });
    let (mut held, _reply) = workers[0].open_bi().await.unwrap();
    let h = Header::request(Opcode::Batch, 1, body.len() as u32, 6 << 20);
    proto::write_frame(&mut held, &h, &body, &[]).await.unwrap();
    until_capacity(true, || batch_with_data(&workers[0], leases[0], 6 << 20)).await;
    // The other direct lease and the node's lease see those bytes: 6 MiB
    // more would pass the principal's 8.
    let (status, why) = batch_with_data(&workers[1], leases[1], 6 << 20).await;
    assert_eq!(status, Status::CapacityExceeded, "{why}");
    assert!(why.contains("max_bytes_per_principal"), "{why}");
    let (status, why) = batch_with_data(&conn, leases[2], 6 << 20).await;
    assert_eq!(status, Status::CapacityExceeded, "{why}");
    // Within the budget, they are served.
    let (status, why) = batch_with_data(&workers[1], leases[1], 1 << 20).await;
    assert_ne!(status, Status::CapacityExceeded, "{why}");
    // Once the held request is cut off, its bytes are given back.
    held.reset(0u32.into()).unwrap();
    until_capacity(false, || batch_with_data(&workers[1], leases[1], 6 << 20)).await;
    let (status, why) = batch_with_data(&conn, leases[2], 6 << 20).await;
    assert_ne!(status, Status::CapacityExceeded, "{why}");
    node.shutdown().await;
}
