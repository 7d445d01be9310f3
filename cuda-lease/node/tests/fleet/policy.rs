//! One policy over a fleet on a real etcd: submissions spread over the
//! nodes, buffers keep their work on their node, a killed node's work
//! fails (or runs again elsewhere) and never hangs, a fleet without room
//! makes submissions wait, a node shut down hands its work over.
//!
//! Needs an `etcd` binary, as `nodes.rs` does (`common::etcd`).

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::etcd::*;
use crate::common::*;
use cuda_async::prelude::*;
use cuda_async::{DeviceBuffer, RemoteErrorKind};
use cuda_lease::client::ClientConfig;
use cuda_lease_fleet::{
    fingerprint, Fleet, FleetPolicy, FleetPolicyConfig, NodeRecord, DEFAULT_PREFIX,
};
use cuda_lease_node::node::Node;

const MIB: u64 = 1 << 20;

/// The share test measures how work spreads over nodes that share this
/// machine's cores: it runs alone; the others run together.
static ALONE: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// An embedded node with the in-memory device, registered as `name`.
async fn node(etcd: &Etcd, name: &str) -> Node {
    let mut cfg = memory_config(256 * MIB);
    cfg.name = name.into();
    cfg.max_leases_per_principal = 64;
    cfg.registry = Some(registry(etcd, Duration::from_secs(5)));
    Node::start(cfg).await.expect("start a node")
}

/// A node program with the in-memory device, registered as `name` with a
/// 2 s TTL: a process of its own, to be killed.
fn node_process(etcd: &Etcd, name: &str) -> Child {
    let dir = std::env::temp_dir().join(format!("cuda-lease-policy-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    Command::new(worker_exe())
        .args([
            "--listen",
            "127.0.0.1:0",
            "--dev",
            "--memory-device",
            "256M",
        ])
        .args(["--name", name, "--tokens", TOKEN, "--prestart", "0"])
        .args(["--etcd", &etcd.url(), "--registry-ttl", "2s"])
        .arg("--dev-cert-out")
        .arg(dir.join("cert.pem"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start cuda-lease-node")
}

/// Kills `children` (SIGKILL) and waits for them.
fn kill_all(children: &mut [Child]) {
    for c in children {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// An etcd, embedded nodes named `names`, and a client that sees them all.
async fn fleet_of(names: &[&str]) -> (Etcd, Vec<Node>, Fleet) {
    let etcd = Etcd::start().await;
    let mut nodes = Vec::new();
    for name in names {
        nodes.push(node(&etcd, name).await);
    }
    let fleet = follow(&etcd).await;
    until(&fleet, "every node", |n| n.len() == names.len()).await;
    (etcd, nodes, fleet)
}

/// An etcd, node processes named `names`, and a client that sees them all.
async fn process_fleet_of(names: &[&str]) -> (Etcd, Vec<Child>, Fleet) {
    let etcd = Etcd::start().await;
    let mut children: Vec<Child> = names.iter().map(|n| node_process(&etcd, n)).collect();
    let fleet = follow(&etcd).await;
    if !fleet
        .wait_until(Duration::from_secs(20), |n| n.len() == names.len())
        .await
    {
        kill_all(&mut children);
        panic!("the node processes never registered");
    }
    (etcd, children, fleet)
}

fn config(leases: usize) -> FleetPolicyConfig {
    FleetPolicyConfig {
        leases,
        max_leases: leases,
        vram: 16 * MIB,
        wait: Duration::from_secs(10),
        ..FleetPolicyConfig::default()
    }
}

/// One pipeline: `n` words tagged with `tag` up and back.
async fn round_trip(policy: &FleetPolicy, tag: u32) -> Result<(), cuda_async::Error> {
    let words: Vec<u32> = (0..64).map(|i| tag.wrapping_mul(7919) ^ i).collect();
    let back = h2d(words.clone()).then(d2h).schedule(policy)?.await?;
    assert_eq!(back.to_vec()?, words, "pipeline {tag}: wrong data");
    Ok(())
}

/// `tasks` tasks of `each` pipelines on `policy`, every one checked.
async fn run_tasks(policy: &FleetPolicy, tasks: u32, each: u32) {
    let mut handles = Vec::new();
    for task in 0..tasks {
        let p = policy.clone();
        handles.push(tokio::spawn(async move {
            for i in 0..each {
                round_trip(&p, task * 1000 + i).await.unwrap();
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_share_sixty_four_tasks_of_fifty_pipelines_evenly() {
    let _alone = ALONE.write().await;
    let (_etcd, nodes, fleet) = fleet_of(&["a", "b", "c"]).await;
    let policy = FleetPolicy::new(&fleet, config(3)).await.unwrap();
    let mut held = policy.nodes();
    held.sort();
    assert_eq!(held, ["a", "b", "c"], "one lease on each node");
    let t = Instant::now();
    run_tasks(&policy, 64, 50).await;
    let stats = policy.stats();
    let shares: Vec<u64> = stats.iter().map(|s| s.completed).collect();
    println!("3,200 pipelines in {:?}: {stats:?}", t.elapsed());
    assert_eq!(shares.iter().sum::<u64>(), 3200);
    let even = 3200.0 / 3.0;
    for s in &stats {
        let off = (s.completed as f64 - even).abs() / even;
        assert!(
            off <= 0.2,
            "{} ran {} of 3,200 ({:.0} % off even)",
            s.node,
            s.completed,
            off * 100.0
        );
    }
    policy.close().await;
    for n in nodes {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_on_a_buffer_goes_to_the_buffers_node() {
    let _together = ALONE.read().await;
    let (_etcd, nodes, fleet) = fleet_of(&["a", "b"]).await;
    let policy = FleetPolicy::new(&fleet, config(2)).await.unwrap();
    let words: Vec<u32> = (0..256).collect();
    let kept: Arc<DeviceBuffer<u32>> =
        Arc::new(h2d(words.clone()).schedule(&policy).unwrap().await.unwrap());
    let home: Vec<_> = policy
        .stats()
        .into_iter()
        .filter(|s| s.completed == 1)
        .map(|s| s.node)
        .collect();
    assert_eq!(home.len(), 1);
    // Twenty reads of it, concurrently: each must go where it lives (on
    // the other node the buffer's id names nothing, and the read fails).
    let mut reads = Vec::new();
    for _ in 0..20 {
        let b = kept.clone();
        let p = policy.clone();
        reads.push(tokio::spawn(
            async move { d2h(b).schedule(&p).unwrap().await },
        ));
    }
    for r in reads {
        assert_eq!(r.await.unwrap().unwrap().to_vec().unwrap(), words);
    }
    let stats = policy.stats();
    for s in &stats {
        let want = if s.node == home[0] { 21 } else { 0 };
        assert_eq!(s.completed, want, "{stats:?}");
    }
    drop(kept);
    policy.close().await;
    for n in nodes {
        n.shutdown().await;
    }
}

/// Waits (at most `limit`) until `policy` holds two live leases again,
/// none on `victim`; panics saying `what` otherwise.
async fn replaced(policy: &FleetPolicy, victim: &str, limit: Duration, what: &str) {
    let done = async {
        loop {
            let n = policy.nodes();
            if n.len() == 2 && !n.iter().any(|x| x == victim) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(limit, done).await.expect(what);
}

/// One pipeline of a run: its start, its end, and its error's kind.
type Run = (Instant, Instant, Option<RemoteErrorKind>);

/// Runs `tasks` tasks of pipelines until `stop`; returns each task's runs.
fn run_until(
    policy: &FleetPolicy,
    tasks: u32,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Vec<Run>>> {
    (0..tasks)
        .map(|task| {
            let p = policy.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut out = Vec::new();
                let mut i = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let start = Instant::now();
                    let r = tokio::time::timeout(
                        Duration::from_secs(20),
                        round_trip(&p, task * 100_000 + i),
                    )
                    .await
                    .expect("a pipeline hung");
                    let kind = r.err().map(|e| match e.remote_kind() {
                        Some(kind) => kind,
                        None => panic!("pipeline failed with {e}"),
                    });
                    out.push((start, Instant::now(), kind));
                    i += 1;
                }
                out
            })
        })
        .collect()
}

/// A policy of two leases on `fleet` that runs work failed with its node
/// again (twice), and eight tasks running pipelines on it until `stop`.
async fn retrying_run(
    fleet: &Fleet,
) -> (
    FleetPolicy,
    Arc<std::sync::atomic::AtomicBool>,
    Vec<tokio::task::JoinHandle<Vec<Run>>>,
) {
    let policy = FleetPolicy::new(
        fleet,
        FleetPolicyConfig {
            retry: 2,
            ..config(2)
        },
    )
    .await
    .unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let tasks = run_until(&policy, 8, stop.clone());
    (policy, stop, tasks)
}

/// Stops the tasks of [`retrying_run`]; their runs' failures.
async fn failures(
    stop: &std::sync::atomic::AtomicBool,
    tasks: Vec<tokio::task::JoinHandle<Vec<Run>>>,
) -> (usize, Vec<RemoteErrorKind>) {
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut runs = Vec::new();
    for t in tasks {
        runs.extend(t.await.unwrap());
    }
    let failed = runs.iter().filter_map(|r| r.2).collect();
    (runs.len(), failed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_node_fails_its_work_without_retry_and_hands_it_over_with_retry() {
    let _together = ALONE.read().await;
    let (_etcd, mut children, fleet) = process_fleet_of(&["k1", "k2", "k3"]).await;
    for retry in [0, 2] {
        let policy = FleetPolicy::new(&fleet, FleetPolicyConfig { retry, ..config(2) })
            .await
            .unwrap();
        let victim = policy.nodes()[0].clone();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let tasks = run_until(&policy, 8, stop.clone());
        tokio::time::sleep(Duration::from_millis(500)).await;
        let i = ["k1", "k2", "k3"]
            .iter()
            .position(|n| *n == victim)
            .unwrap();
        let killed = Instant::now();
        children[i].kill().unwrap();
        children[i].wait().unwrap();
        // Run on until the policy holds two live leases again, without the
        // victim, then a little more.
        replaced(
            &policy,
            &victim,
            Duration::from_secs(15),
            "the lease on the killed node was never replaced",
        )
        .await;
        let replaced_after = killed.elapsed();
        tokio::time::sleep(Duration::from_millis(300)).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut runs = Vec::new();
        for t in tasks {
            runs.extend(t.await.unwrap());
        }
        let failed: Vec<_> = runs.iter().filter_map(|r| r.2).collect();
        let spanning = runs.iter().filter(|r| r.0 < killed && r.1 > killed);
        let last_spanning = spanning.map(|r| r.1 - killed).max().unwrap_or_default();
        println!(
            "retry {retry}: {} pipelines, {} failed {:?}, {} retried; lease replaced {replaced_after:?} after the kill; the last pipeline in flight at the kill ended {last_spanning:?} after it",
            runs.len(),
            failed.len(),
            failed.first(),
            policy.retries()
        );
        if retry == 0 {
            assert!(
                !failed.is_empty(),
                "work in flight on the killed node must fail"
            );
            assert!(
                failed
                    .iter()
                    .all(|k| matches!(k, RemoteErrorKind::Disconnected(_))),
                "{failed:?}"
            );
        } else {
            assert!(
                failed.is_empty(),
                "with retry every pipeline completes: {failed:?}"
            );
            assert!(policy.retries() >= 1);
        }
        policy.close().await;
        if retry == 0 {
            // Wait for the victim to leave the registry before the next round.
            until(&fleet, "the victim gone", |n| {
                n.iter().all(|r| r.name != victim)
            })
            .await;
        }
    }
    kill_all(&mut children);
}

/// A node that stops answering for a moment (here: stopped with SIGSTOP
/// past its registry TTL, so it also leaves the registry) keeps its lease
/// when it answers again: the policy buries a silent node's lease only
/// after every query over 3 s went unanswered. The node is stopped for
/// about 1.5 s after its record expires: three of the policy's 0.5 s
/// queries at least, against the first alone (the policy's rule before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_silent_for_a_moment_keeps_its_lease() {
    let _together = ALONE.read().await;
    let (_etcd, mut children, fleet) = process_fleet_of(&["s1", "s2"]).await;
    let policy = FleetPolicy::new(&fleet, config(2)).await.unwrap();
    let mut held = policy.nodes();
    held.sort();
    assert_eq!(held, ["s1", "s2"]);
    round_trip(&policy, 1).await.unwrap();
    let victim = &children[0];
    let pid = victim.id() as libc::pid_t;
    // SAFETY: signals to a child process of this test, alive until killed below.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    until(&fleet, "the stopped node out of the registry", |n| {
        n.iter().all(|r| r.name != "s1")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    until(&fleet, "the node back in the registry", |n| {
        n.iter().any(|r| r.name == "s1")
    })
    .await;
    let mut held = policy.nodes();
    held.sort();
    assert_eq!(held, ["s1", "s2"], "the silent node's lease was dropped");
    run_tasks(&policy, 4, 10).await;
    assert!(
        policy
            .stats()
            .iter()
            .any(|s| s.node == "s1" && s.completed > 1),
        "the node took work again: {:?}",
        policy.stats()
    );
    policy.close().await;
    kill_all(&mut children);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffer_on_a_dead_node_fails_naming_the_node_and_the_buffer() {
    let _together = ALONE.read().await;
    let (_etcd, mut children, fleet) = process_fleet_of(&["d1", "d2"]).await;
    let policy = FleetPolicy::new(
        &fleet,
        FleetPolicyConfig {
            retry: 2,
            ..config(2)
        },
    )
    .await
    .unwrap();
    let kept: DeviceBuffer<u32> = h2d(vec![5u32; 64])
        .schedule(&policy)
        .unwrap()
        .await
        .unwrap();
    let home = policy
        .stats()
        .into_iter()
        .find(|s| s.completed == 1)
        .unwrap()
        .node;
    let i = ["d1", "d2"].iter().position(|n| *n == home).unwrap();
    children[i].kill().unwrap();
    children[i].wait().unwrap();
    let gone = async {
        while policy.nodes().contains(&home) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    // Its record expires after 2 s; its lease goes after 3 s of silence more.
    tokio::time::timeout(Duration::from_secs(20), gone)
        .await
        .expect("the dead node's lease stayed");
    let e = d2h(kept).schedule(&policy).unwrap().await.unwrap_err();
    let text = e.to_string();
    println!("{text}");
    assert!(
        matches!(e.remote_kind(), Some(RemoteErrorKind::Disconnected(_))),
        "{e}"
    );
    assert!(
        text.contains(&format!("node {home} is gone")) && text.contains("buffers #"),
        "{text}"
    );
    // Work that needs no buffer of the dead node goes on elsewhere.
    round_trip(&policy, 1).await.unwrap();
    policy.close().await;
    kill_all(&mut children);
}

/// Waits until `policy` holds no live lease.
async fn gave_up(policy: &FleetPolicy) {
    let none = async {
        while !policy.nodes().is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(PROMPT, none)
        .await
        .expect("the policy kept a lease on a node that left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_node_submissions_wait_for_one_then_time_out() {
    let _together = ALONE.read().await;
    let etcd = Etcd::start().await;
    let first = node(&etcd, "first").await;
    let fleet = follow(&etcd).await;
    until(&fleet, "the node", |n| n.len() == 1).await;
    let policy = FleetPolicy::new(
        &fleet,
        FleetPolicyConfig {
            wait: Duration::from_secs(1),
            ..config(1)
        },
    )
    .await
    .unwrap();
    round_trip(&policy, 1).await.unwrap();
    // The only node drains: it leaves the registry, its lease ends.
    first.shutdown().await;
    until(&fleet, "the node gone", |n| n.is_empty()).await;
    gave_up(&policy).await;
    let t = Instant::now();
    let e = round_trip(&policy, 2).await.unwrap_err();
    let waited = t.elapsed();
    println!("with no node a submission waited {waited:?}, then: {e}");
    assert!(e.remote_kind() == Some(RemoteErrorKind::Capacity), "{e}");
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    policy.close().await;

    // With a longer wait, a node that arrives meanwhile takes the work.
    let patient = FleetPolicy::new(&fleet, config(1)).await;
    assert!(patient.is_err(), "no node: no lease");
    let second = node(&etcd, "second").await;
    until(&fleet, "the second node", |n| n.len() == 1).await;
    let policy = FleetPolicy::new(&fleet, config(1)).await.unwrap();
    second.shutdown().await;
    until(&fleet, "the second node gone", |n| n.is_empty()).await;
    gave_up(&policy).await;
    let waiting = {
        let p = policy.clone();
        tokio::spawn(async move { round_trip(&p, 3).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "the submission waits for a node");
    let third = node(&etcd, "third").await;
    waiting.await.unwrap().unwrap();
    assert_eq!(policy.nodes(), ["third"]);
    policy.close().await;
    third.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_node_hands_its_work_over_and_etcd_may_restart_meanwhile() {
    let _together = ALONE.read().await;
    let mut etcd = Etcd::start().await;
    let a = node(&etcd, "a").await;
    let b = node(&etcd, "b").await;
    let c = node(&etcd, "c").await;
    let fleet = follow(&etcd).await;
    until(&fleet, "three nodes", |n| n.len() == 3).await;
    let (policy, stop, tasks) = retrying_run(&fleet).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // etcd goes away and comes back empty: the run goes on.
    etcd.restart_empty().await;
    until(&fleet, "the nodes registered again", |n| n.len() == 3).await;
    assert_eq!(policy.nodes().len(), 2, "etcd's restart cost no lease");
    // A node the policy uses shuts down gracefully.
    let victim = policy.nodes()[0].clone();
    let drained = Instant::now();
    let (gone, keep): (Vec<Node>, Vec<Node>) = [a, b, c].into_iter().partition(|n| {
        fleet
            .nodes()
            .iter()
            .any(|r| r.name == victim && r.address == n.addr())
    });
    for n in gone {
        n.shutdown().await;
    }
    replaced(
        &policy,
        &victim,
        Duration::from_secs(10),
        "the drained node's lease was never replaced",
    )
    .await;
    println!(
        "the drained node's lease was replaced {:?} after its shutdown began",
        drained.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (runs, failed) = failures(&stop, tasks).await;
    println!(
        "{runs} pipelines, {} retried, failed: {failed:?}",
        policy.retries()
    );
    assert!(failed.is_empty(), "{failed:?}");
    policy.close().await;
    for n in keep {
        n.shutdown().await;
    }
}

/// A node whose lease the policy lost can stay listed a while (its record
/// outlives it, or the registry's watch lags): the replacement goes to a
/// live node, not first to the dead one. Here node "a"'s record is the
/// test's own, without a TTL, and a connection attempt waits two minutes:
/// trying "a" first would hold the replacement past the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_node_still_listed_is_tried_last() {
    let _together = ALONE.read().await;
    let etcd = Etcd::start().await;
    let mut cfg = memory_config(256 * MIB);
    cfg.name = "a".into();
    cfg.max_leases_per_principal = 64;
    let a = Node::start(cfg).await.expect("start a node");
    let record = NodeRecord {
        name: "a".into(),
        address: a.addr(),
        cert_sha256: fingerprint(a.cert_der()),
        devices: Vec::new(),
        // The most room of the three: ranked first while listed.
        capacity_bytes: 1 << 40,
        reservable_bytes: 1 << 40,
        active_leases: 0,
        protocol: cuda_lease::proto::VERSION,
        labels: Default::default(),
    };
    let mut kv = etcd_client::Client::connect([etcd.url()], None)
        .await
        .expect("connect to etcd");
    kv.put(NodeRecord::key(DEFAULT_PREFIX, "a"), record.to_json(), None)
        .await
        .expect("write a's record");
    let b = node(&etcd, "b").await;
    let c = node(&etcd, "c").await;
    let fleet = follow_with(
        etcd.fleet_config().client(
            ClientConfig::pinned_sha256([0; 32])
                .token(TOKEN)
                .connect_timeout(Duration::from_secs(120)),
        ),
    )
    .await;
    until(&fleet, "three nodes", |n| n.len() == 3).await;
    let (policy, stop, tasks) = retrying_run(&fleet).await;
    assert_eq!(policy.nodes(), ["a", "b"], "placed as ranked");
    // Work in flight on "a" fails with it, and work sent there afterwards
    // fails at once: either buries its lease.
    a.shutdown().await;
    assert!(
        fleet.nodes().iter().any(|n| n.name == "a"),
        "a's record stays"
    );
    replaced(
        &policy,
        "a",
        Duration::from_secs(30),
        "the lost lease was replaced only after trying the dead node",
    )
    .await;
    assert_eq!(policy.nodes(), ["b", "c"]);
    let (_, failed) = failures(&stop, tasks).await;
    assert!(failed.is_empty(), "{failed:?}");
    policy.close().await;
    b.shutdown().await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_policy_grows_up_to_its_limit() {
    let _together = ALONE.read().await;
    let (_etcd, nodes, fleet) = fleet_of(&["a", "b", "c"]).await;
    let policy = FleetPolicy::new(
        &fleet,
        FleetPolicyConfig {
            leases: 1,
            max_leases: 2,
            grow_at: 2,
            streams: 1,
            ..config(1)
        },
    )
    .await
    .unwrap();
    assert_eq!(policy.nodes().len(), 1);
    run_tasks(&policy, 16, 40).await;
    let held = policy.nodes();
    println!(
        "after a busy run the policy holds leases on {held:?}: {:?}",
        policy.stats()
    );
    assert_eq!(held.len(), 2, "grown to its limit, not past it");
    assert_ne!(held[0], held[1], "the new lease went to another node");
    policy.close().await;
    for n in nodes {
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_with_waits_on_a_plain_thread() {
    let _together = ALONE.read().await;
    let (_etcd, nodes, fleet) = fleet_of(&["a", "b"]).await;
    let policy = FleetPolicy::new(&fleet, config(2)).await.unwrap();
    let p = policy.clone();
    // A thread of no runtime: `sync_with` blocks it, the runtime's tasks
    // carry the I/O.
    let sums = std::thread::spawn(move || {
        (0..20u32)
            .map(|i| {
                let out = h2d(vec![i; 128]).then(d2h).sync_with(&p).unwrap();
                out.to_vec().unwrap().iter().sum::<u32>()
            })
            .collect::<Vec<_>>()
    });
    let sums = tokio::task::spawn_blocking(move || sums.join().unwrap())
        .await
        .unwrap();
    assert_eq!(sums, (0..20u32).map(|i| i * 128).collect::<Vec<_>>());
    assert_eq!(policy.stats().iter().map(|s| s.completed).sum::<u64>(), 20);
    policy.close().await;
    for n in nodes {
        n.shutdown().await;
    }
}
