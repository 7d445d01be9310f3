//! The service on a fleet (`--etcd`, feature `fleet`): three nodes on the
//! in-memory device register in a real etcd; the service leases two of
//! them, answers correctly, keeps answering when one of its nodes shuts
//! down (the requests run on the other lease), and leases the third node
//! in its place.
//!
//! Needs an `etcd` binary (Debian's `etcd-server`; `.ci/run` installs it):
//! `$CUDA_LEASE_TEST_ETCD`, else `etcd` on the `PATH`.

mod common;
// The node tests' etcd helper (a real etcd per test, the fleet followed on
// its watch), shared by path as `cuda-async/tests/suite` is.
#[path = "../../../cuda-lease/node/tests/common/etcd.rs"]
#[allow(dead_code, unreachable_pub)]
mod etcd;

use std::time::Duration;

use common::*;
use cuda_async_service::model::{random, HostWeights, CLASSES, D_IN};
use cuda_lease_fleet::NodeRecord;
use cuda_lease_node::{DeviceSpec, Node, NodeConfig, WorkerSpec};
use etcd::{follow, registry, until, Etcd};

/// The token the nodes know the service by (`etcd::Etcd::fleet_config`'s).
const TOKEN: &str = "fleet-test";

/// A node on the in-memory device (its worker is the service binary),
/// registered in `etcd` as `name`.
async fn node(etcd: &Etcd, name: &str) -> Node {
    let mut cfg = NodeConfig::new(WorkerSpec {
        program: service_exe(),
        args: Vec::new(),
        device: DeviceSpec::Memory { capacity: 1 << 30 },
        spin: Duration::ZERO,
        compile: Default::default(),
    });
    cfg.name = name.into();
    cfg.tokens = vec![TOKEN.into()];
    cfg.registry = Some(registry(etcd, Duration::from_secs(5)));
    Node::start(cfg).await.expect("start a node")
}

/// The nodes with a lease, by name.
fn leased(nodes: &[NodeRecord]) -> Vec<String> {
    let mut v: Vec<_> = nodes
        .iter()
        .filter(|n| n.active_leases > 0)
        .map(|n| n.name.clone())
        .collect();
    v.sort();
    v
}

/// `rounds` requests of 3 samples, each answered 200 with the model's
/// outputs.
async fn answers(svc: std::net::SocketAddr, rounds: usize) {
    let weights = HostWeights::random(1);
    let x = random(3 * D_IN, 7, 1.0);
    let want = weights.reference(&x, 3);
    tokio::task::spawn_blocking(move || {
        for i in 0..rounds {
            let (status, got, body) = infer_binary(svc, &x);
            assert_eq!(
                status,
                200,
                "request {i}: {}",
                String::from_utf8_lossy(&body)
            );
            assert_eq!(got.len(), 3 * CLASSES);
            assert_close(&got, &want);
        }
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_service_leases_two_nodes_and_replaces_one_that_shuts_down() {
    let etcd = Etcd::start().await;
    let fleet = follow(&etcd).await;
    let mut nodes = Vec::new();
    for name in ["a", "b", "c"] {
        nodes.push((name, node(&etcd, name).await));
    }
    until(&fleet, "three nodes", |n| n.len() == 3).await;

    let svc = Running::with(&[
        "--etcd",
        &etcd.url(),
        "--trust-registry",
        "--token",
        TOKEN,
        "--fleet-leases",
        "2",
    ]);
    until(&fleet, "two nodes leased", |n| leased(n).len() == 2).await;
    answers(svc.addr, 20).await;

    // Shut down a node the service leases: the requests after it run on
    // the other lease, and the idle node is leased in its place.
    let before = leased(&fleet.nodes());
    let idle = ["a", "b", "c"]
        .into_iter()
        .find(|n| !before.iter().any(|b| b == n))
        .unwrap();
    let gone = before[0].clone();
    let at = nodes.iter().position(|(n, _)| *n == gone).unwrap();
    nodes.remove(at).1.shutdown().await;
    answers(svc.addr, 20).await;
    until(&fleet, "the idle node leased", |n| {
        n.iter().any(|r| r.name == idle && r.active_leases == 1)
    })
    .await;
    answers(svc.addr, 20).await;

    // A clean stop frees the leases.
    let status = tokio::task::spawn_blocking(move || svc.stop())
        .await
        .unwrap();
    assert!(status.success(), "{status}");
    until(&fleet, "no leases", |n| leased(n).is_empty()).await;
    for (_, n) in nodes {
        n.shutdown().await;
    }
}
