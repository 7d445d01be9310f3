//! Clients with `ClientConfig::busy_poll`: their QUIC endpoint runs on a
//! thread of their own (a client outlives the runtime it connected on),
//! and their pipelines run as without it, on the node's path and on a
//! direct lease, from a runtime of one thread.

use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use cuda_async::prelude::*;
use cuda_async::{Kernel, LaunchConfig, Module};
use cuda_lease::client::Client;
use cuda_lease::remote::LeaseBackend;
use cuda_lease_node::node::Node;

const KERNELS: &str = r#"
extern "C" __global__ void axpy(float a, const float* x, float* y, unsigned n) {}
"#;

fn axpy() -> Kernel {
    Module::cuda(KERNELS, &[]).unwrap().kernel("axpy").unwrap()
}

/// How many threads of this process are busy-polling clients' endpoints.
fn io_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|tasks| {
            tasks
                .filter_map(Result::ok)
                .filter(|t| {
                    std::fs::read_to_string(t.path().join("comm"))
                        .is_ok_and(|name| name.trim() == "cuda-lease-io")
                })
                .count()
        })
        .unwrap_or(0)
}

/// `a * 1 + 2` over 64 floats on `remote` (uploaded, `axpy`, downloaded),
/// failing after 30 s.
async fn axpy_on(remote: &cuda_async::RemotePolicy, a: f32) -> Vec<f32> {
    let n = 64u32;
    let k = axpy();
    let y = h2d(vec![1.0f32; n as usize])
        .zip(h2d(vec![2.0f32; n as usize]))
        // SAFETY: axpy touches x[0..n) and y[0..n); both hold n floats.
        .then(move |(x, y)| unsafe {
            launch(&k, LaunchConfig::for_num_elems(n), (a, Arc::new(x), y, n))
        })
        .then(|(_, _, y, _)| d2h(y))
        .schedule(remote)
        .unwrap();
    tokio::time::timeout(Duration::from_secs(30), y)
        .await
        .expect("the pipeline never finished")
        .expect("the pipeline")
        .to_vec()
        .unwrap()
}

async fn pipelines_with_busy_poll(direct: bool) {
    let mut cfg = memory_config(1 << 28);
    cfg.direct_leases = direct;
    let node = Node::spawn_local(cfg).await.expect("node");
    let config = client_config(&node)
        .direct(direct)
        .busy_poll(Some(Duration::from_millis(2)));
    // Connected on a runtime that is gone before the client is used: the
    // endpoint lives on its own thread, not on the caller's runtime.
    let addr = node.addr();
    let client = tokio::task::spawn_blocking(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(Client::connect(addr, &config))
    })
    .await
    .unwrap()
    .expect("connect");
    let client = Arc::new(client);
    if cfg!(target_os = "linux") {
        assert!(io_threads() >= 1, "no endpoint thread");
    }
    let lease = tokio::time::timeout(Duration::from_secs(30), lease_of(&client, 64 << 20))
        .await
        .expect("the lease never came");
    assert_eq!(lease.is_direct(), direct);
    let remote = policy_of(&lease);
    for round in 0..20u8 {
        let a = f32::from(round);
        assert_eq!(
            axpy_on(&remote, a).await,
            vec![a + 2.0; 64],
            "round {round}"
        );
    }
    lease.free().await.unwrap();
    drop(client);
    node.shutdown().await;
}

#[tokio::test]
async fn a_busy_polling_client_runs_pipelines_through_the_node() {
    pipelines_with_busy_poll(false).await;
}

#[tokio::test]
async fn a_busy_polling_client_runs_pipelines_on_a_direct_lease() {
    pipelines_with_busy_poll(true).await;
}

/// A busy-polling client's lease awaits its submissions' replies on the
/// client's endpoint thread: its pipelines finish with the runtime the
/// backend was made on already shut down.
#[tokio::test]
async fn a_busy_polling_lease_awaits_its_replies_on_its_endpoint_thread() {
    let node = Node::spawn_local(memory_config(1 << 28))
        .await
        .expect("node");
    let config = client_config(&node).busy_poll(Some(Duration::from_millis(2)));
    let client = Arc::new(
        Client::connect(node.addr(), &config)
            .await
            .expect("connect"),
    );
    let lease = lease_of(&client, 64 << 20).await;
    let gone = tokio::runtime::Runtime::new().unwrap();
    let handle = gone.handle().clone();
    // Dropping a runtime blocks, which this runtime's thread must not.
    tokio::task::spawn_blocking(move || drop(gone))
        .await
        .unwrap();
    let backend = LeaseBackend::new(lease.session(), handle);
    let remote = cuda_async::RemotePolicy::new(&backend);
    assert_eq!(axpy_on(&remote, 3.0).await, vec![5.0; 64]);
    drop(remote);
    drop(backend);
    lease.free().await.unwrap();
    node.shutdown().await;
}
