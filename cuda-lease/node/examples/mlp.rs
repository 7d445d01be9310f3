//! A two-layer MLP forward pass as one pipeline of ops: a cuBLAS GEMM, bias
//! and ReLU (a CUDA C kernel), a second GEMM and a softmax (another
//! kernel), on a batch of 256. The same function runs on the local GPU and
//! on a GPU leased from an embedded node; both are checked against a CPU
//! reference and against each other, bit for bit.
//!
//! ```text
//! cargo run --release -p cuda-lease-node --example mlp
//! ```
//!
//! Matrices are column-major, as cuBLAS takes them: a batch is a matrix
//! with one column per sample. On the lease each GEMM is one command that
//! the node runs with its own cuBLAS; the two kernels travel as CUDA C and
//! the node compiles them for its GPU. The embedded node's worker processes
//! re-run this executable, which is why `main` calls
//! `cuda_lease_node::main_if_worker` first.

use std::error::Error;
use std::sync::Arc;

use cuda_async::blas::{gemm, Gemm};
use cuda_async::prelude::*;
use cuda_async::{DeviceBuffer, HostBuffer, Kernel, LaunchConfig, Module, SchedulingPolicy};
use cuda_lease::client::{ClientConfig, Lease};
use cuda_lease::remote::BlockingLease;
use cuda_lease_node::{main_if_worker, DeviceSpec, Node, NodeConfig, WorkerSpec};

/// Inputs, hidden units, classes, samples.
const D_IN: usize = 512;
const HIDDEN: usize = 256;
const CLASSES: usize = 10;
const BATCH: usize = 256;

// ANCHOR: kernels
const KERNELS: &str = r#"
// h (rows x cols, column-major) = max(h + b[row], 0)
extern "C" __global__ void bias_relu(float* h, const float* b, unsigned rows, unsigned cols) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * cols) h[i] = fmaxf(h[i] + b[i % rows], 0.0f);
}
// Each column of z (rows x cols) becomes its softmax.
extern "C" __global__ void softmax_columns(float* z, unsigned rows, unsigned cols) {
    unsigned j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= cols) return;
    float* c = z + j * rows;
    float m = c[0];
    for (unsigned i = 1; i < rows; i++) m = fmaxf(m, c[i]);
    float sum = 0.0f;
    for (unsigned i = 0; i < rows; i++) { c[i] = expf(c[i] - m); sum += c[i]; }
    for (unsigned i = 0; i < rows; i++) c[i] /= sum;
}
"#;
// ANCHOR_END: kernels

/// The weights, uploaded once to the backend they serve.
struct Weights {
    w1: Arc<DeviceBuffer<f32>>,
    b1: Arc<DeviceBuffer<f32>>,
    w2: Arc<DeviceBuffer<f32>>,
}

// ANCHOR: forward
/// `softmax(W2 * relu(W1 * x + b1))` for a batch `x` (`D_IN` x `BATCH`),
/// downloaded: the same function for every backend.
fn forward(
    w: &Weights,
    x: Vec<f32>,
    bias_relu: &Kernel,
    softmax: &Kernel,
) -> impl DeviceOp<Output = HostBuffer<f32>> {
    let (w1, b1, w2) = (w.w1.clone(), w.b1.clone(), w.w2.clone());
    let (bias_relu, softmax) = (bias_relu.clone(), softmax.clone());
    let (h, c, n) = (HIDDEN as u32, CLASSES as u32, BATCH as u32);
    h2d(x)
        .zip(zeros::<f32>(HIDDEN * BATCH))
        // H = W1 * X
        .then(move |(x, hid)| gemm(Gemm::new(HIDDEN, BATCH, D_IN), w1, x, hid))
        // SAFETY: bias_relu touches hid[0..h*n) and b1[0..h); they hold that.
        .then(move |(_, _, hid)| unsafe {
            launch(
                &bias_relu,
                LaunchConfig::for_num_elems(h * n),
                (hid, b1, h, n),
            )
        })
        // Z = W2 * H
        .then(move |(hid, _, _, _)| {
            zeros::<f32>(CLASSES * BATCH)
                .then(move |z| gemm(Gemm::new(CLASSES, BATCH, HIDDEN), w2, hid, z))
        })
        // SAFETY: softmax_columns touches z[0..c*n); it holds that.
        .then(move |(_, _, z)| unsafe {
            launch(&softmax, LaunchConfig::for_num_elems(n), (z, c, n))
        })
        .then(|(z, _, _)| d2h(z))
}
// ANCHOR_END: forward

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

/// `n` pseudo-random floats in [-scale, scale) (xorshift, no dependencies).
fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// The forward pass on the CPU, in f64.
fn reference(w1: &[f32], b1: &[f32], w2: &[f32], x: &[f32]) -> Vec<f64> {
    let mut out = vec![0.0f64; CLASSES * BATCH];
    for j in 0..BATCH {
        let hid: Vec<f64> = (0..HIDDEN)
            .map(|i| {
                let s: f64 = (0..D_IN)
                    .map(|l| f64::from(w1[i + l * HIDDEN]) * f64::from(x[l + j * D_IN]))
                    .sum();
                (s + f64::from(b1[i])).max(0.0)
            })
            .collect();
        let z: Vec<f64> = (0..CLASSES)
            .map(|i| {
                (0..HIDDEN)
                    .map(|l| f64::from(w2[i + l * CLASSES]) * hid[l])
                    .sum()
            })
            .collect();
        let m = z.iter().cloned().fold(f64::MIN, f64::max);
        let sum: f64 = z.iter().map(|v| (v - m).exp()).sum();
        for i in 0..CLASSES {
            out[i + j * CLASSES] = (z[i] - m).exp() / sum;
        }
    }
    out
}

fn upload(v: &[f32], on: &impl SchedulingPolicy) -> Result<Arc<DeviceBuffer<f32>>, Box<dyn Error>> {
    Ok(Arc::new(h2d(v.to_vec()).sync_with(on)?))
}

fn run() -> Result<(), Box<dyn Error>> {
    if !cuda_async::driver_present() || cuda_async::device_count().unwrap_or(0) == 0 {
        return Err("needs an NVIDIA GPU and its driver".into());
    }
    let (w1, b1, w2) = (
        random(HIDDEN * D_IN, 1, 0.05),
        random(HIDDEN, 2, 0.1),
        random(CLASSES * HIDDEN, 3, 0.1),
    );
    let x = random(D_IN * BATCH, 4, 1.0);
    let module = Module::cuda(KERNELS, &[])?;
    let (bias_relu, softmax) = (
        module.kernel("bias_relu")?,
        module.kernel("softmax_columns")?,
    );
    let want = reference(&w1, &b1, &w2, &x);

    // The local GPU.
    let local = cuda_async::StreamPoolRoundRobin::new(&cuda_async::Device::new(0)?, 4)?;
    let weights = Weights {
        w1: upload(&w1, &local)?,
        b1: upload(&b1, &local)?,
        w2: upload(&w2, &local)?,
    };
    let here = forward(&weights, x.clone(), &bias_relu, &softmax).sync_with(&local)?;

    // A GPU leased from an embedded node on 127.0.0.1 (this machine's).
    let rt = tokio::runtime::Runtime::new()?;
    let mut cfg = NodeConfig::new(WorkerSpec::current_exe(DeviceSpec::Cuda { ordinal: 0 })?);
    cfg.tokens = vec!["demo-token".into()];
    let node = rt.block_on(Node::spawn_local(cfg))?;
    let config = ClientConfig::pinned(node.cert_der().clone()).token("demo-token");
    let lease = BlockingLease::connect(
        Lease::builder().min_vram(64 << 20).config(config),
        node.addr(),
    )?;
    let remote = cuda_async::RemotePolicy::new(&lease);
    let weights = Weights {
        w1: upload(&w1, &remote)?,
        b1: upload(&b1, &remote)?,
        w2: upload(&w2, &remote)?,
    };
    let there = forward(&weights, x, &bias_relu, &softmax).sync_with(&remote)?;
    drop(weights);
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
