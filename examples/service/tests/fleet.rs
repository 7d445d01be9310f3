//! The service on a fleet (`--etcd`, feature `fleet`): three nodes on the
//! in-memory device register in a real etcd; the service leases two of
//! them, answers correctly, keeps answering when one of its nodes shuts
//! down (the requests run on the other lease), and leases the third node
//! in its place.
//!
//! Needs an `etcd` binary (Debian's `etcd-server`; `.ci/run` installs it):
//! `$CUDA_LEASE_TEST_ETCD`, else `etcd` on the `PATH`.

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use cuda_async_service::model::{random, HostWeights, CLASSES, D_IN};
use cuda_lease::client::ClientConfig;
use cuda_lease_fleet::{Fleet, FleetConfig, NodeRecord, RegistryConfig};
use cuda_lease_node::{DeviceSpec, Node, NodeConfig, WorkerSpec};

const TOKEN: &str = "fleet-test";
/// Longest a registry change may take to reach the test.
const PROMPT: Duration = Duration::from_secs(20);

/// A real etcd on free loopback ports with its own data directory,
/// stopped (by its PID) when dropped.
struct Etcd {
    child: Child,
    dir: PathBuf,
    url: String,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Etcd {
    fn start() -> Etcd {
        let bin = std::env::var_os("CUDA_LEASE_TEST_ETCD")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("etcd"));
        let dir = std::env::temp_dir().join(format!("service-fleet-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let url = format!("http://127.0.0.1:{}", free_port());
        let peer = format!("http://127.0.0.1:{}", free_port());
        let child = Command::new(bin)
            .args(["--name", "service-test", "--data-dir"])
            .arg(dir.join("data"))
            .args([
                "--listen-client-urls",
                &url,
                "--advertise-client-urls",
                &url,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &format!("service-test={peer}")])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("etcd.log")).unwrap())
            .spawn()
            .expect("start etcd (Debian: etcd-server; or set CUDA_LEASE_TEST_ETCD)");
        Etcd { child, dir, url }
    }

    /// The fleet as a client sees it, once etcd answers.
    async fn follow(&self) -> Fleet {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let cfg = FleetConfig::new([self.url.clone()])
                .trust_registry(true)
                .client(ClientConfig::pinned_sha256([0; 32]).token(TOKEN));
            match Fleet::connect(cfg).await {
                Ok(f) => return f,
                Err(e) => assert!(Instant::now() < deadline, "etcd does not answer: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

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
    let mut r = RegistryConfig::new([etcd.url.clone()]);
    r.ttl = Duration::from_secs(5);
    r.min_update_interval = Duration::from_millis(50);
    cfg.registry = Some(r);
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

/// Waits (on the registry's watch) until `pred` holds.
async fn until(fleet: &Fleet, what: &str, pred: impl FnMut(&[NodeRecord]) -> bool) {
    assert!(
        fleet.wait_until(PROMPT, pred).await,
        "waited {PROMPT:?} for {what}; the fleet shows {:?}",
        fleet.nodes()
    );
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
    let etcd = Etcd::start();
    let fleet = etcd.follow().await;
    let mut nodes = Vec::new();
    for name in ["a", "b", "c"] {
        nodes.push((name, node(&etcd, name).await));
    }
    until(&fleet, "three nodes", |n| n.len() == 3).await;

    let svc = Running::with(&[
        "--etcd",
        &etcd.url,
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
