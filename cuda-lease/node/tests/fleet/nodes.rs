//! The fleet on a real etcd: nodes register with their inventory, a
//! client follows the registry and places leases by reservable VRAM, a
//! killed node leaves within its TTL, etcd can go away and come back, and
//! many clients' leases spread over the nodes with none lost.
//!
//! Needs an `etcd` binary (Debian's `etcd-server`; `.ci/run` installs it):
//! `$CUDA_LEASE_TEST_ETCD`, else `etcd` on the `PATH`. Each test starts its
//! own etcd on free loopback ports with a temporary data directory, and
//! stops every process it started by its PID.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::etcd::*;
use crate::common::*;
use cuda_lease::client::{ClientConfig, ErrorKind, Lease};
use cuda_lease_fleet::{fingerprint, Fleet, FleetConfig, FleetError, NodeRecord};
use cuda_lease_node::node::{Node, NodeConfig};

const MIB: u64 = 1 << 20;

/// An embedded node with the in-memory device of `capacity` bytes,
/// registered as `name`.
async fn node(
    etcd: &Etcd,
    name: &str,
    capacity: u64,
    adjust: impl FnOnce(&mut NodeConfig),
) -> Node {
    let mut cfg = memory_config(capacity);
    cfg.name = name.into();
    cfg.registry = Some(registry(etcd, Duration::from_secs(5)));
    adjust(&mut cfg);
    Node::start(cfg).await.expect("start a node")
}

fn names(nodes: &[NodeRecord]) -> Vec<String> {
    nodes.iter().map(|n| n.name.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_register_their_inventory_and_leave_at_shutdown() {
    let etcd = Etcd::start().await;
    let a = node(&etcd, "a", 64 * MIB, |c| {
        c.registry
            .as_mut()
            .unwrap()
            .labels
            .insert("zone".into(), "x".into());
    })
    .await;
    let b = node(&etcd, "b", 128 * MIB, |_| {}).await;
    let c = node(&etcd, "c", 256 * MIB, |_| {}).await;
    let fleet = follow(&etcd).await;
    until(&fleet, "three nodes", |n| n.len() == 3).await;
    assert_eq!(names(&fleet.nodes()), ["a", "b", "c"]);

    for (n, cap) in [(&a, 64 * MIB), (&b, 128 * MIB), (&c, 256 * MIB)] {
        let r = fleet
            .nodes()
            .into_iter()
            .find(|r| r.address == n.addr())
            .unwrap();
        assert_eq!(r.cert_sha256, fingerprint(n.cert_der()), "{}", r.name);
        assert_eq!(
            (r.capacity_bytes, r.reservable_bytes, r.active_leases),
            (cap, cap, 0)
        );
        assert_eq!(r.protocol, cuda_lease::proto::VERSION);
        assert_eq!(r.devices.len(), 1);
        assert_eq!(r.devices[0].total_bytes, cap);
    }
    assert_eq!(
        fleet
            .node("a")
            .unwrap()
            .labels
            .get("zone")
            .map(String::as_str),
        Some("x")
    );

    // A lease shows in the record once the node writes it again.
    let lease = fleet
        .lease(Lease::builder().min_vram(200 * MIB))
        .await
        .unwrap();
    assert_eq!(lease.client().node_name(), "c");
    assert_eq!(lease.client().addr(), c.addr(), "only c has 200 MiB");
    until(&fleet, "c's lease in its record", |n| {
        n.iter()
            .any(|r| r.name == "c" && r.active_leases == 1 && r.reservable_bytes == 56 * MIB)
    })
    .await;
    lease.free().await.unwrap();
    until(&fleet, "c's lease gone from its record", |n| {
        n.iter().any(|r| r.name == "c" && r.active_leases == 0)
    })
    .await;

    // A node shut down leaves at once (its etcd lease is revoked), long
    // before its 5 s TTL would run out.
    let t = Instant::now();
    b.shutdown().await;
    until(&fleet, "b gone", |n| n.iter().all(|r| r.name != "b")).await;
    let gone = t.elapsed();
    println!("a shut-down node left the registry in {gone:?}");
    // Before the 5 s TTL could have run out (etcd expires a lease at its
    // TTL at the earliest), with room for a loaded machine's shutdown.
    assert!(gone < Duration::from_millis(4500), "{gone:?}");
    a.shutdown().await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placement_follows_reservable_vram_and_moves_past_a_full_node() {
    let etcd = Etcd::start().await;
    let small = node(&etcd, "small", 64 * MIB, |_| {}).await;
    let big = node(&etcd, "big", 256 * MIB, |_| {}).await;
    let mid = node(&etcd, "mid", 128 * MIB, |_| {}).await;
    let fleet = follow(&etcd).await;
    until(&fleet, "three nodes", |n| n.len() == 3).await;

    // Least loaded, then most room: big first.
    let first = fleet
        .lease(Lease::builder().min_vram(200 * MIB))
        .await
        .unwrap();
    assert_eq!(first.client().addr(), big.addr());
    until(&fleet, "big's record to show its lease", |n| {
        n.iter()
            .any(|r| r.name == "big" && r.reservable_bytes == 56 * MIB)
    })
    .await;
    // 100 MiB: small is too small, big is full now: mid.
    let second = fleet
        .lease(Lease::builder().min_vram(100 * MIB))
        .await
        .unwrap();
    assert_eq!(second.client().addr(), mid.addr());
    until(&fleet, "mid's record to show its lease", |n| {
        n.iter()
            .any(|r| r.name == "mid" && r.reservable_bytes == 28 * MIB)
    })
    .await;
    // Nothing left for 100 MiB anywhere, as the registry says.
    match fleet.lease(Lease::builder().min_vram(100 * MIB)).await {
        Err(FleetError::NoNodeFits {
            min_vram,
            registered,
        }) => {
            assert_eq!((min_vram, registered), (100 * MIB, 3));
        }
        other => panic!("expected NoNodeFits, got {other:?}"),
    }

    // A placement of the user's own that names a node without room first
    // (as a stale view would): the node refuses with Capacity and the next
    // one takes the lease.
    let third = fleet
        .lease_placed(Lease::builder().min_vram(60 * MIB), |_, _| {
            vec!["big".into(), "nowhere".into(), "small".into()]
        })
        .await
        .unwrap();
    assert_eq!(third.client().addr(), small.addr());
    // Every node named, every one full: the errors name each node tried.
    match fleet
        .lease_placed(Lease::builder().min_vram(60 * MIB), |_, _| {
            vec!["big".into(), "mid".into()]
        })
        .await
    {
        Err(FleetError::Exhausted(tried)) => {
            assert_eq!(
                tried.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
                ["big", "mid"]
            );
            assert!(
                tried.iter().all(|(_, e)| e.kind() == ErrorKind::Capacity),
                "{tried:?}"
            );
        }
        other => panic!("expected Exhausted, got {other:?}"),
    }

    // Labels: only labelled nodes are chosen.
    let labelled = follow_with(etcd.fleet_config().label("gpu", "h100")).await;
    assert!(matches!(
        labelled.lease(Lease::builder().min_vram(MIB)).await,
        Err(FleetError::NoNodeFits { .. })
    ));

    for l in [first, second, third] {
        l.free().await.unwrap();
    }
    for n in [small, big, mid] {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_registry_pins_nothing_and_a_pinned_fingerprint_must_match() {
    let etcd = Etcd::start().await;
    let n = node(&etcd, "n", 64 * MIB, |_| {}).await;
    // Without trusting the registry, the client's own roots decide: this
    // node's own certificate works...
    let own = follow_with(FleetConfig::new([etcd.url()]).client(client_config(&n))).await;
    until(&own, "the node", |r| r.len() == 1).await;
    own.lease(Lease::builder().min_vram(MIB))
        .await
        .unwrap()
        .free()
        .await
        .unwrap();
    // ...another certificate does not.
    let other = cuda_lease_node::tls::self_signed(&["localhost".into()]).unwrap();
    let stranger = follow_with(
        FleetConfig::new([etcd.url()])
            .client(ClientConfig::pinned(other.leaf().clone()).token(TOKEN)),
    )
    .await;
    until(&stranger, "the node", |r| r.len() == 1).await;
    let e = stranger
        .lease(Lease::builder().min_vram(MIB))
        .await
        .unwrap_err();
    assert!(matches!(e, FleetError::Exhausted(_)), "{e}");
    // A pin by fingerprint (what trusting the registry does per node):
    // another fingerprint is refused in the handshake, the node's own is
    // served.
    let record = own.node("n").unwrap();
    let mut wrong = record.fingerprint_bytes().unwrap();
    wrong[0] ^= 1;
    let e = cuda_lease::Client::connect(n.addr(), &ClientConfig::pinned_sha256(wrong).token(TOKEN))
        .await
        .unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Disconnected(_)), "{e}");
    let right = ClientConfig::pinned_sha256(record.fingerprint_bytes().unwrap()).token(TOKEN);
    let c = cuda_lease::Client::connect(n.addr(), &right).await.unwrap();
    c.inventory().await.unwrap();
    // A fleet needs roots or trust in the registry.
    assert!(matches!(
        Fleet::connect(FleetConfig::new([etcd.url()])).await,
        Err(FleetError::Config(_))
    ));
    n.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_node_leaves_the_registry_within_its_ttl() {
    let etcd = Etcd::start().await;
    let ttl = Duration::from_secs(2);
    let dir = std::env::temp_dir().join(format!("cuda-lease-fleet-kill-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut child = Command::new(worker_exe())
        .args(["--listen", "127.0.0.1:0", "--dev", "--memory-device", "64M"])
        .args(["--name", "doomed", "--tokens", TOKEN, "--prestart", "0"])
        .args(["--etcd", &etcd.url(), "--registry-ttl", "2s"])
        .arg("--advertise")
        .arg(format!("127.0.0.1:{}", free_port()))
        .arg("--dev-cert-out")
        .arg(dir.join("cert.pem"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start cuda-lease-node");
    let fleet = follow(&etcd).await;
    let registered = fleet
        .wait_until(Duration::from_secs(20), |n| n.len() == 1)
        .await;
    if !registered {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the node never registered");
    }
    let t = Instant::now();
    child.kill().unwrap(); // SIGKILL: no goodbye to etcd.
    child.wait().unwrap();
    let gone = fleet
        .wait_until(ttl + Duration::from_secs(6), |n| n.is_empty())
        .await;
    let took = t.elapsed();
    let _ = std::fs::remove_dir_all(&dir);
    println!("a SIGKILLed node left the registry after {took:?} (TTL {ttl:?})");
    assert!(gone, "the killed node is still registered after {took:?}");
    // etcd checks expiries about twice a second, and its watch event and
    // the fleet's client run beside a loaded test: a few seconds past the
    // TTL, not a day.
    assert!(took <= ttl + Duration::from_secs(4), "{took:?} > TTL + 4 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_lost_and_back_nodes_register_again_and_leases_keep_working() {
    let mut etcd = Etcd::start().await;
    let a = node(&etcd, "a", 64 * MIB, |_| {}).await;
    let b = node(&etcd, "b", 64 * MIB, |_| {}).await;
    let c = node(&etcd, "c", 64 * MIB, |_| {}).await;
    let fleet = follow(&etcd).await;
    until(&fleet, "three nodes", |n| n.len() == 3).await;
    let held = fleet.lease(Lease::builder().min_vram(MIB)).await.unwrap();

    etcd.kill();
    // The nodes serve on without etcd: a lease held works, and the fleet
    // places a new one from the view it has.
    held.query().await.unwrap();
    let during = fleet.lease(Lease::builder().min_vram(MIB)).await.unwrap();
    during.query().await.unwrap();

    // etcd back with nothing in it: every node registers again and the
    // client follows the new registry.
    etcd.restart_empty().await;
    // A new client reads what the new etcd holds.
    let back = Instant::now();
    let fresh = follow(&etcd).await;
    until(&fresh, "the nodes registered again", |n| n.len() == 3).await;
    println!(
        "the nodes registered again {:?} after etcd came back",
        back.elapsed()
    );
    until(&fleet, "the client's view of the new registry", |n| {
        n.len() == 3 && n.iter().map(|r| r.active_leases).sum::<u32>() == 2
    })
    .await;
    held.query().await.unwrap();
    during.free().await.unwrap();
    held.free().await.unwrap();
    fleet
        .lease(Lease::builder().min_vram(MIB))
        .await
        .unwrap()
        .free()
        .await
        .unwrap();
    for n in [a, b, c] {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_clients_lease_twenty_times_each_over_three_nodes_none_lost() {
    const CLIENTS: usize = 32;
    const LEASES: usize = 20;
    let etcd = Etcd::start().await;
    let tune = |c: &mut NodeConfig| {
        c.max_leases_per_principal = 64;
        c.prestart_workers = 4;
        // 640 leases in a few seconds by one principal: past the default
        // rate of worker starts, which is for tenants, not stress tests.
        c.worker_starts_per_principal_per_second = 10_000.0;
        c.worker_start_burst_per_principal = 10_000;
    };
    let nodes = [
        node(&etcd, "a", 256 * MIB, tune).await,
        node(&etcd, "b", 256 * MIB, tune).await,
        node(&etcd, "c", 256 * MIB, tune).await,
    ];
    let addrs: Vec<_> = nodes.iter().map(Node::addr).collect();
    let t = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..CLIENTS {
        let cfg = etcd.fleet_config();
        tasks.push(tokio::spawn(async move {
            let fleet = follow_with(cfg).await;
            assert!(fleet.wait_until(PROMPT, |n| n.len() == 3).await);
            let mut placed = Vec::new();
            for _ in 0..LEASES {
                let lease = fleet
                    .lease(Lease::builder().min_vram(MIB).auto_renew(false))
                    .await
                    .unwrap();
                lease.query().await.unwrap();
                placed.push(lease.client().addr());
                lease.free().await.unwrap();
            }
            placed
        }));
    }
    let mut per_node = [0usize; 3];
    for t in tasks {
        for addr in t.await.unwrap() {
            per_node[addrs.iter().position(|a| *a == addr).unwrap()] += 1;
        }
    }
    println!(
        "{} leases in {:?}, per node {per_node:?}",
        CLIENTS * LEASES,
        t.elapsed()
    );
    assert_eq!(per_node.iter().sum::<usize>(), CLIENTS * LEASES);
    assert!(per_node.iter().all(|&n| n > 0), "{per_node:?}");
    for n in nodes {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_lists_the_fleet_and_leases_on_it() {
    let etcd = Etcd::start().await;
    let n = node(&etcd, "gpu-7", 64 * MIB, |c| {
        c.registry
            .as_mut()
            .unwrap()
            .labels
            .insert("zone".into(), "a".into());
    })
    .await;
    let fleet = follow(&etcd).await;
    until(&fleet, "the node", |r| r.len() == 1).await;
    let cli = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_cuda-lease"))
            .args([
                "--token",
                TOKEN,
                "fleet",
                "--etcd",
                &etcd.url(),
                "--trust-registry",
            ])
            .args(args)
            .output()
            .expect("run cuda-lease");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "cuda-lease fleet {args:?}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        text
    };
    let ls = tokio::task::block_in_place(|| cli(&["ls"]));
    let line = ls
        .lines()
        .find(|l| l.starts_with("gpu-7"))
        .unwrap_or_else(|| panic!("{ls}"));
    assert!(line.contains(&n.addr().to_string()), "{line}");
    assert!(
        line.contains("0.1 GiB") && line.ends_with("zone=a"),
        "{line}"
    );
    let leased =
        tokio::task::block_in_place(|| cli(&["lease", "--min-vram", "1M", "--label", "zone=a"]));
    assert!(
        leased.contains("reserved 1048576 bytes on node gpu-7"),
        "{leased}"
    );
    assert!(leased.ends_with("freed\n"), "{leased}");
    n.shutdown().await;
}
