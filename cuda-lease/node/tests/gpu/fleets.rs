//! GPU nodes found through etcd, and a fleet policy over two of them
//! (feature `fleet`).

use super::*;

/// Two nodes on this GPU register in a real etcd (the bundle carries one:
/// `$CUDA_LEASE_TEST_ETCD`); a client finds both through the registry,
/// with the GPU's own inventory, and runs one pipeline on a lease of each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an NVIDIA GPU"]
async fn two_gpu_nodes_found_through_etcd_run_a_pipeline_each() {
    use common::etcd::*;
    let etcd = Etcd::start().await;
    let mut nodes = Vec::new();
    for name in ["gpu-a", "gpu-b"] {
        let mut cfg = gpu_config();
        cfg.name = name.into();
        cfg.capacity = Some(1 << 30);
        cfg.registry = Some(registry(&etcd, Duration::from_secs(5)));
        nodes.push(Node::start(cfg).await.expect("start a GPU node"));
    }
    let fleet = follow(&etcd).await;
    until(&fleet, "both GPU nodes", |n| n.len() == 2).await;
    for r in fleet.nodes() {
        let d = &r.devices[0];
        println!(
            "{} at {}: {} sm_{}{}, {} bytes reservable",
            r.name,
            r.address,
            d.name,
            d.compute_capability.0,
            d.compute_capability.1,
            r.reservable_bytes
        );
        assert!(
            d.compute_capability.0 >= 5 && d.total_bytes > 1 << 30,
            "{r:?}"
        );
        assert_eq!(r.reservable_bytes, 1 << 30);
    }
    for (name, node) in ["gpu-a", "gpu-b"].into_iter().zip(&nodes) {
        let lease = fleet
            .lease_placed(
                Lease::builder().min_vram(64 << 20),
                |_, _| vec![name.into()],
            )
            .await
            .unwrap();
        assert_eq!(lease.client().addr(), node.addr());
        good_pipeline_on(&policy_of(&lease)).await;
        lease.free().await.unwrap();
    }
    for n in nodes {
        n.shutdown().await;
    }
}

/// `y = 2x + 1` on `x`, downloaded.
fn axpb_op(
    k: &cuda_async::Kernel,
    x: Vec<f32>,
) -> impl cuda_async::DeviceOp<Output = cuda_async::HostBuffer<f32>> {
    use cuda_async::prelude::*;
    let n = x.len() as u32;
    let k = k.clone();
    let cfg = cuda_async::LaunchConfig::for_num_elems(n);
    h2d(x)
        .zip(zeros::<f32>(n as usize))
        // SAFETY: axpb writes y[0..n) and reads x[0..n); both hold n floats.
        .then(move |(x, y)| unsafe { launch(&k, cfg, (y, x, n)) })
        .then(|(y, _, _)| d2h(y))
}

/// `count` pipelines of `axpb_op` over `tasks` tasks, task `t` on
/// `policies[t % len]`, each checked; their wall time.
async fn axpb_pipelines<P>(policies: &[Arc<P>], count: usize, tasks: usize) -> Duration
where
    P: cuda_async::SchedulingPolicy + Send + Sync + 'static,
{
    use cuda_async::prelude::*;
    let k = cuda_async::Module::cuda(
        "extern \"C\" __global__ void axpb(float* y, const float* x, unsigned n) {\n\
         unsigned i = blockIdx.x * blockDim.x + threadIdx.x;\n\
         if (i < n) y[i] = 2.0f * x[i] + 1.0f;\n}\n",
        &[],
    )
    .unwrap()
    .kernel("axpb")
    .unwrap();
    // One warm-up each: the module reaches every lease before timing.
    for p in policies {
        axpb_op(&k, vec![1.0; 16])
            .schedule(&**p)
            .unwrap()
            .await
            .unwrap();
    }
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let t = std::time::Instant::now();
    let mut handles = Vec::new();
    for task in 0..tasks {
        let (p, k, next) = (
            policies[task % policies.len()].clone(),
            k.clone(),
            next.clone(),
        );
        handles.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= count {
                    return;
                }
                let x: Vec<f32> = (0..65536).map(|j| (i * 7 + j) as f32 * 0.25).collect();
                let want: Vec<f32> = x.iter().map(|v| 2.0 * v + 1.0).collect();
                let y = axpb_op(&k, x).schedule(&*p).unwrap().await.unwrap();
                assert_eq!(y.to_vec().unwrap(), want, "pipeline {i}");
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    t.elapsed()
}

/// Two node processes on this GPU, found through etcd: independent
/// pipelines through one `FleetPolicy` keep pace with the same pipelines
/// through one `RemotePolicy` per node driven by hand (printed: the ratio
/// of their throughputs), and a run with one node killed midway completes,
/// every result right.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs an NVIDIA GPU"]
async fn a_fleet_policy_over_two_gpu_nodes_keeps_pace_and_survives_a_killed_node() {
    use common::etcd::*;
    use cuda_lease_fleet::{FleetPolicy, FleetPolicyConfig};
    let etcd = Etcd::start().await;
    let dir = std::env::temp_dir().join(format!("cuda-lease-gpu-fleet-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut children: Vec<std::process::Child> = ["gpu-a", "gpu-b"]
        .iter()
        .map(|name| {
            std::process::Command::new(worker_exe())
                .args(["--listen", "127.0.0.1:0", "--dev", "--capacity", "2G"])
                .args(["--name", name, "--tokens", TOKEN, "--prestart", "1"])
                .args(["--etcd", &etcd.url(), "--registry-ttl", "2s"])
                .arg("--dev-cert-out")
                .arg(dir.join(format!("{name}.pem")))
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("start cuda-lease-node")
        })
        .collect();
    let kill_all = |children: &mut Vec<std::process::Child>| {
        for c in children.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    };
    let fleet = follow(&etcd).await;
    if !fleet
        .wait_until(Duration::from_secs(60), |n| n.len() == 2)
        .await
    {
        kill_all(&mut children);
        panic!("the GPU nodes never registered");
    }
    let cfg = FleetPolicyConfig {
        leases: 2,
        max_leases: 2,
        vram: 512 << 20,
        ..FleetPolicyConfig::default()
    };
    let policy = Arc::new(FleetPolicy::new(&fleet, cfg.clone()).await.unwrap());
    let mut by_hand = Vec::new();
    let mut hand_leases = Vec::new();
    for name in ["gpu-a", "gpu-b"] {
        let lease = fleet
            .lease_placed(Lease::builder().min_vram(512 << 20), |_, _| {
                vec![name.into()]
            })
            .await
            .unwrap();
        by_hand.push(Arc::new(policy_of(&lease)));
        hand_leases.push(lease);
    }
    let (count, tasks) = (512, 16);
    let mut fleet_best = Duration::MAX;
    let mut hand_best = Duration::MAX;
    for _ in 0..3 {
        fleet_best =
            fleet_best.min(axpb_pipelines(std::slice::from_ref(&policy), count, tasks).await);
        hand_best = hand_best.min(axpb_pipelines(&by_hand, count, tasks).await);
    }
    let ratio = hand_best.as_secs_f64() / fleet_best.as_secs_f64();
    println!(
        "{count} pipelines over {tasks} tasks, best of 3: fleet policy {fleet_best:?}, one RemotePolicy per node by hand {hand_best:?}: throughput ratio {ratio:.3} (goal >= 0.9)"
    );
    println!("per node: {:?}", policy.stats());
    assert!(
        ratio > 0.5,
        "the fleet policy runs at {ratio:.3}x the hand-driven policies"
    );
    drop(by_hand);
    for l in hand_leases {
        l.free().await.unwrap();
    }
    policy.close().await;

    // One node killed midway: every pipeline completes, right.
    let policy = Arc::new(
        FleetPolicy::new(&fleet, FleetPolicyConfig { retry: 2, ..cfg })
            .await
            .unwrap(),
    );
    let victim = policy.nodes()[0].clone();
    let run = {
        let p = policy.clone();
        tokio::spawn(async move { axpb_pipelines(&[p], 600, 16).await })
    };
    let started = std::time::Instant::now();
    while policy.stats().iter().map(|s| s.completed).sum::<u64>() < 150 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the run did not start"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let i = if victim == "gpu-a" { 0 } else { 1 };
    let killed = std::time::Instant::now();
    children[i].kill().unwrap();
    children[i].wait().unwrap();
    let wall = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the run with a killed node hung")
        .unwrap();
    let first = policy.first_retry_done().map(|t| t - killed);
    println!(
        "killed {victim} mid-run: 600 pipelines correct in {wall:?}, {} retried, the first retried one done {first:?} after the kill; per node: {:?}",
        policy.retries(),
        policy.stats()
    );
    policy.close().await;
    kill_all(&mut children);
    let _ = std::fs::remove_dir_all(&dir);
}
