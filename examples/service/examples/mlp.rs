//! The service's model on its own: a two-layer MLP forward pass as one
//! pipeline of ops (a cuBLAS GEMM, bias and ReLU as a CUDA C kernel, a
//! second GEMM, a softmax kernel) on a batch of 256, on the local GPU and
//! on a GPU leased from an embedded node; both are checked against a CPU
//! reference and against each other, bit for bit.
//!
//! ```text
//! cargo run --release -p cuda-async-service --example mlp
//! ```
//!
//! The model (`cuda_async_service::model`) is one function for every
//! backend: on the lease each GEMM is one command that the node runs with
//! its own cuBLAS, and the two kernels travel as CUDA C that the node
//! compiles for its GPU. The embedded node's worker processes re-run this
//! executable, which is why `main` calls `cuda_lease_node::main_if_worker`
//! first.

use std::error::Error;

use cuda_async::prelude::*;
use cuda_async_service::model::{random, HostWeights, Model, CLASSES, D_IN, HIDDEN};
use cuda_lease::client::{ClientConfig, Lease};
use cuda_lease::remote::BlockingLease;
use cuda_lease_node::{main_if_worker, DeviceSpec, Node, NodeConfig, WorkerSpec};

/// Samples.
const BATCH: usize = 256;

fn main() {
    main_if_worker();
    if std::env::args().len() > 1 {
        println!(
            "mlp: runs a two-layer MLP forward pass (GEMM, bias+ReLU, GEMM, softmax) on a batch \
             of {BATCH} on the local GPU and on a GPU leased from an embedded node, and checks \
             both against the CPU and against each other. Needs an NVIDIA GPU and its driver; \
             takes no arguments."
        );
        return;
    }
    if let Err(e) = run() {
        eprintln!("mlp: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn Error>> {
    if !cuda_async::driver_present() || cuda_async::device_count().unwrap_or(0) == 0 {
        return Err("needs an NVIDIA GPU and its driver".into());
    }
    let weights = HostWeights::random(1);
    let x = random(D_IN * BATCH, 4, 1.0);
    let want = weights.reference(&x, BATCH);
    let rt = tokio::runtime::Runtime::new()?;

    // The local GPU.
    let local = cuda_async::StreamPoolRoundRobin::new(&cuda_async::Device::new(0)?, 4)?;
    let model = rt.block_on(Model::upload(&weights, &local))?;
    let here = model.forward(x.clone(), BATCH).sync_with(&local)?;

    // A GPU leased from an embedded node on 127.0.0.1 (this machine's).
    let mut cfg = NodeConfig::new(WorkerSpec::current_exe(DeviceSpec::Cuda { ordinal: 0 })?);
    cfg.tokens = vec!["demo-token".into()];
    let node = rt.block_on(Node::spawn_local(cfg))?;
    let config = ClientConfig::pinned(node.cert_der().clone()).token("demo-token");
    let lease = BlockingLease::connect(
        Lease::builder().min_vram(64 << 20).config(config),
        node.addr(),
    )?;
    let remote = cuda_async::RemotePolicy::new(&lease);
    let model = rt.block_on(Model::upload(&weights, &remote))?;
    let there = model.forward(x, BATCH).sync_with(&remote)?;
    drop(model);
    lease.free()?;
    rt.block_on(node.shutdown());

    let (here, there) = (here.to_vec()?, there.to_vec()?);
    for (what, got) in [("local", &here), ("leased", &there)] {
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            if (f64::from(*g) - w).abs() > 1e-3 * w.abs().max(1e-6) {
                return Err(format!("{what}: element {i} is {g}, the CPU says {w}").into());
            }
        }
    }
    let same = here
        .iter()
        .zip(&there)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    if !same {
        return Err("the local and the leased results differ in their bits".into());
    }
    println!(
        "mlp: {BATCH} samples through {D_IN} -> {HIDDEN} (ReLU) -> {CLASSES} (softmax): local and \
         leased match the CPU within 1e-3 and each other bit for bit"
    );
    Ok(())
}
