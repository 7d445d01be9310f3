//! How remote work ends when its lease or its node does: work in flight
//! fails with a kind that says why (this client freed the lease, the
//! lease expired, the node shut down), never hangs; connecting fails
//! within its timeout, naming the address; missing and refused
//! credentials are told apart.

use std::time::{Duration, Instant};

use crate::common::*;
use cuda_async::prelude::*;
use cuda_async::{
    Disconnect, Error, HostBuffer, Kernel, LaunchConfig, Module, RemoteErrorKind as Kind,
};
use cuda_lease::client::{Client, ClientConfig, Credentials, ErrorKind, Lease};

/// Longest a failure may take to arrive once its cause happened.
const PROMPT: Duration = Duration::from_secs(10);

/// A kernel the in-memory device runs forever (until its worker ends).
fn hang() -> Kernel {
    Module::cuda("extern \"C\" __global__ void __hang() {}", &[])
        .unwrap()
        .kernel("__hang")
        .unwrap()
}

/// A pipeline that is in flight until its lease's worker ends, awaited
/// on a task.
fn in_flight(fx: &Fixture) -> tokio::task::JoinHandle<Result<HostBuffer<u8>, Error>> {
    let hang = hang();
    let op = h2d(vec![1u8; 64])
        // SAFETY: `__hang` takes no arguments and touches nothing.
        .then(move |b| unsafe { launch(&hang, LaunchConfig::for_num_elems(1), ()) }.map(|()| b))
        .then(d2h);
    let scheduled = op.schedule(&fx.policy()).unwrap();
    tokio::spawn(scheduled)
}

/// Waits until the node has the pipeline's BATCH (it hangs in it from
/// then on).
async fn reached_node(fx: &Fixture) {
    let node = &fx.node;
    let arrived = eventually(PROMPT, || async {
        metric(&metrics_http(node).await, "gpu_batch_total").unwrap_or(0) >= 1
    })
    .await;
    assert!(arrived, "the pipeline never reached the node");
}

/// Waits for `task` (at most [`PROMPT`]) and returns its remote error.
async fn failure(
    task: tokio::task::JoinHandle<Result<HostBuffer<u8>, Error>>,
) -> cuda_async::RemoteError {
    let r = tokio::time::timeout(PROMPT, task)
        .await
        .expect("the in-flight pipeline hung")
        .unwrap();
    let e = r.expect_err("the pipeline cannot succeed");
    eprintln!("in flight: {e}");
    e.remote()
        .cloned()
        .unwrap_or_else(|| panic!("not remote: {e}"))
}

#[tokio::test]
async fn work_in_flight_fails_as_freed_when_this_client_frees_the_lease() {
    let mut fx = Fixture::node_path(1 << 20).lease(1 << 16).start().await;
    let task = in_flight(&fx);
    reached_node(&fx).await;
    let lease = fx.take_lease();
    let id = lease.id();
    lease.free().await.unwrap();
    let e = failure(task).await;
    assert_eq!(e.kind(), Kind::LeaseFreed, "{e}");
    assert!(e.message().contains("in flight"), "{e}");
    assert_eq!(e.lease(), Some(id.to_string().as_str()), "{e}");
    assert!(e.to_string().contains("lease freed by this client"), "{e}");
    fx.shutdown().await;
}

#[tokio::test]
async fn work_in_flight_fails_as_expired_when_the_lease_expires() {
    let fx = Fixture::node_path(1 << 20)
        .manual_clock()
        .lease_with(
            Lease::builder()
                .min_vram(1 << 16)
                .ttl(Duration::from_secs(5))
                .auto_renew(false),
        )
        .start()
        .await;
    let task = in_flight(&fx);
    reached_node(&fx).await;
    fx.clock().advance(Duration::from_secs(6));
    let e = failure(task).await;
    assert_eq!(e.kind(), Kind::LeaseExpired, "{e}");
    assert!(e.node().is_some() && e.lease().is_some(), "{e}");
    fx.shutdown().await;
}

#[tokio::test]
async fn work_in_flight_fails_as_node_shutdown_when_the_node_shuts_down() {
    let fx = Fixture::node_path(1 << 20).lease(1 << 16).start().await;
    let task = in_flight(&fx);
    reached_node(&fx).await;
    let (node, rest) = fx.into_node();
    node.shutdown().await;
    let e = failure(task).await;
    assert_eq!(
        e.kind(),
        Kind::Disconnected(Disconnect::NodeShutdown),
        "{e}"
    );
    assert!(!e.is_retryable(), "{e}");
    drop(rest);
}

#[tokio::test]
async fn connecting_where_no_node_answers_fails_within_the_timeout_naming_the_address() {
    // A port nothing listens on: bound, then released.
    let addr = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let fx = Fixture::node_path(1 << 20).start().await;
    let config = client_config(&fx.node).connect_timeout(Duration::from_millis(300));
    let t = Instant::now();
    let Err(e) = Client::connect(addr, &config).await else {
        panic!("nobody is there");
    };
    let took = t.elapsed();
    eprintln!("connect: {e} after {took:?}");
    assert_eq!(
        e.kind(),
        ErrorKind::Disconnected(Disconnect::ConnectTimeout),
        "{e}"
    );
    assert!(took < Duration::from_secs(3), "took {took:?}");
    assert!(e.to_string().contains(&addr.to_string()), "{e}");
    assert!(e.is_retryable());
    fx.shutdown().await;
}

#[tokio::test]
async fn no_credentials_and_refused_credentials_are_told_apart() {
    let fx = Fixture::node_path(1 << 20).start().await;
    let bare = ClientConfig::pinned(fx.node.cert_der().clone());
    let none = Client::connect(fx.node.addr(), &bare).await.err().unwrap();
    let wrong = Client::connect(fx.node.addr(), &bare.clone().token("not-the-token"))
        .await
        .err()
        .unwrap();
    eprintln!("no token: {none}\nwrong token: {wrong}");
    assert_eq!(
        none.kind(),
        ErrorKind::Unauthorized(Credentials::Missing),
        "{none}"
    );
    assert_eq!(
        wrong.kind(),
        ErrorKind::Unauthorized(Credentials::Refused),
        "{wrong}"
    );
    for e in [&none, &wrong] {
        assert!(e.to_string().contains(&fx.node.addr().to_string()), "{e}");
    }
    fx.shutdown().await;
}
