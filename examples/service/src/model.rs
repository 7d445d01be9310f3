//! The model the service serves: a two-layer MLP,
//! `softmax(W2 * relu(W1 * x + b1))`, as one pipeline of ops (a cuBLAS
//! GEMM, a bias+ReLU kernel, a second GEMM, a softmax kernel) for a batch
//! of any size.
//!
//! Matrices are column-major, as cuBLAS takes them: a batch of `n`
//! samples is `D_IN` x `n` with one column a sample, so the samples' rows
//! laid end to end are the batch, and the output's columns are the
//! samples' class probabilities, `CLASSES` each, end to end.

use std::sync::Arc;

use cuda_async::blas::{gemm, Gemm};
use cuda_async::prelude::*;
use cuda_async::{
    CudaGraph, Device, DeviceBuffer, DeviceFuture, GpuTime, HostBuffer, Kernel, LaunchConfig,
    Module, Result, SchedulingPolicy, SharedPinnedBuffer, SubmitThread,
};

/// Inputs a sample.
pub const D_IN: usize = 512;
/// Hidden units.
pub const HIDDEN: usize = 256;
/// Classes (outputs a sample).
pub const CLASSES: usize = 10;

// ANCHOR: kernels
/// The model's two kernels, in CUDA C (compiled by NVRTC locally, by the
/// node on a lease).
pub const KERNELS: &str = r#"
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

/// The weights on the host, pseudo-random from a seed.
#[derive(Debug, Clone)]
pub struct HostWeights {
    /// `HIDDEN` x `D_IN`.
    pub w1: Vec<f32>,
    /// `HIDDEN`.
    pub b1: Vec<f32>,
    /// `CLASSES` x `HIDDEN`.
    pub w2: Vec<f32>,
}

impl HostWeights {
    /// Weights drawn from `seed` (the same seed, the same weights).
    pub fn random(seed: u64) -> Self {
        HostWeights {
            w1: random(HIDDEN * D_IN, seed.wrapping_mul(3).wrapping_add(1), 0.05),
            b1: random(HIDDEN, seed.wrapping_mul(3).wrapping_add(2), 0.1),
            w2: random(CLASSES * HIDDEN, seed.wrapping_mul(3).wrapping_add(3), 0.1),
        }
    }

    /// The forward pass of `n` samples (`x`, `D_IN` each) on the CPU, in
    /// `f64`: `CLASSES` probabilities a sample.
    pub fn reference(&self, x: &[f32], n: usize) -> Vec<f64> {
        let mut out = vec![0.0f64; CLASSES * n];
        for j in 0..n {
            let hid: Vec<f64> = (0..HIDDEN)
                .map(|i| {
                    let s: f64 = (0..D_IN)
                        .map(|l| f64::from(self.w1[i + l * HIDDEN]) * f64::from(x[l + j * D_IN]))
                        .sum();
                    (s + f64::from(self.b1[i])).max(0.0)
                })
                .collect();
            let z: Vec<f64> = (0..CLASSES)
                .map(|i| {
                    (0..HIDDEN)
                        .map(|l| f64::from(self.w2[i + l * CLASSES]) * hid[l])
                        .sum()
                })
                .collect();
            let m = z.iter().copied().fold(f64::MIN, f64::max);
            let sum: f64 = z.iter().map(|v| (v - m).exp()).sum();
            for i in 0..CLASSES {
                out[i + j * CLASSES] = (z[i] - m).exp() / sum;
            }
        }
        out
    }
}

/// `n` pseudo-random floats in `[-scale, scale)` (xorshift).
pub fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
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

/// The model on one backend: its weights uploaded once, its kernels.
#[derive(Debug, Clone)]
pub struct Model {
    w1: Arc<DeviceBuffer<f32>>,
    b1: Arc<DeviceBuffer<f32>>,
    w2: Arc<DeviceBuffer<f32>>,
    bias_relu: Kernel,
    softmax: Kernel,
}

impl Model {
    /// Uploads `weights` through `policy` (they live where its ops run).
    ///
    /// # Errors
    ///
    /// An upload's error, or the kernels' module's.
    pub async fn upload(weights: &HostWeights, policy: &dyn SchedulingPolicy) -> Result<Self> {
        let up = |v: &[f32]| h2d(v.to_vec()).schedule(policy);
        let w1 = Arc::new(up(&weights.w1)?.await?);
        let b1 = Arc::new(up(&weights.b1)?.await?);
        let w2 = Arc::new(up(&weights.w2)?.await?);
        let module = Module::cuda(KERNELS, &[])?;
        Ok(Model {
            w1,
            b1,
            w2,
            bias_relu: module.kernel("bias_relu")?,
            softmax: module.kernel("softmax_columns")?,
        })
    }

    // ANCHOR: forward
    /// The forward pass of `n` samples (`x`: `D_IN` floats each, end to
    /// end), downloaded: `CLASSES` probabilities a sample.
    pub fn forward(&self, x: Vec<f32>, n: usize) -> impl DeviceOp<Output = HostBuffer<f32>> {
        self.layers(h2d(x), n).then(d2h)
    }

    /// The layers on the `D_IN` x `n` input `x` makes: the `CLASSES` x `n`
    /// output, on the device.
    fn layers(
        &self,
        x: impl DeviceOp<Output = DeviceBuffer<f32>>,
        n: usize,
    ) -> impl DeviceOp<Output = DeviceBuffer<f32>> {
        let (w1, b1, w2) = (self.w1.clone(), self.b1.clone(), self.w2.clone());
        let (bias_relu, softmax) = (self.bias_relu.clone(), self.softmax.clone());
        let (h, c, cols) = (HIDDEN as u32, CLASSES as u32, n as u32);
        x.zip(zeros::<f32>(HIDDEN * n))
            // H = W1 * X
            .then(move |(x, hid)| gemm(Gemm::new(HIDDEN, n, D_IN), w1, x, hid))
            // SAFETY: bias_relu touches hid[0..h*cols) and b1[0..h); they
            // hold that.
            .then(move |(_, _, hid)| unsafe {
                launch(
                    &bias_relu,
                    LaunchConfig::for_num_elems(h * cols),
                    (hid, b1, h, cols),
                )
            })
            // Z = W2 * H
            .then(move |(hid, _, _, _)| {
                zeros::<f32>(CLASSES * n)
                    .then(move |z| gemm(Gemm::new(CLASSES, n, HIDDEN), w2, hid, z))
            })
            // SAFETY: softmax_columns touches z[0..c*cols); it holds that.
            .then(move |(_, _, z)| unsafe {
                launch(&softmax, LaunchConfig::for_num_elems(cols), (z, c, cols))
            })
            .map(|(z, _, _)| z)
    }
    // ANCHOR_END: forward
}

impl Model {
    /// The forward pass of `n` samples captured as a CUDA graph on the
    /// default device (where [`Model::upload`] put the weights on the
    /// local pool): each replay uploads what the host last wrote into the
    /// graph's input, runs the layers and downloads into its output. A
    /// request then costs one graph launch instead of an enqueue per op.
    ///
    /// # Errors
    ///
    /// Pinned memory, the capture's or an op's errors.
    pub fn capture(&self, n: usize) -> Result<ForwardGraph> {
        let device = Device::new(0)?;
        let input = SharedPinnedBuffer::filled(&device, D_IN * n, 0.0f32)?;
        let output = SharedPinnedBuffer::filled(&device, CLASSES * n, 0.0f32)?;
        let (inp, out) = (input.clone(), output.clone());
        let x = zeros::<f32>(D_IN * n)
            .then(move |x| copy_h2d(inp, x))
            .map(|(_, x)| x);
        let graph = self
            .layers(x, n)
            .then(move |z| copy_d2h(z, out))
            .map(|_| ())
            .graph()?;
        Ok(ForwardGraph {
            n,
            graph: Arc::new(graph),
            input,
            output,
        })
    }
}

/// A forward pass captured for `n` samples ([`Model::capture`]). Its
/// replays share its input and output memory, so it serves one request
/// at a time.
#[derive(Debug)]
pub struct ForwardGraph {
    n: usize,
    graph: Arc<CudaGraph<()>>,
    input: SharedPinnedBuffer<f32>,
    output: SharedPinnedBuffer<f32>,
}

impl ForwardGraph {
    /// The samples a replay runs.
    pub fn samples(&self) -> usize {
        self.n
    }

    /// Runs `x` (`D_IN` values a sample, at most [`ForwardGraph::samples`]
    /// samples; the rest of the input is zeros) on `policy`, the replay
    /// launched by `submit` when given: the first `CLASSES` values a
    /// sample of the output, and the replay's GPU time.
    ///
    /// # Errors
    ///
    /// `x` longer than the graph's input; the replay's errors.
    pub async fn run(
        &self,
        x: &[f32],
        policy: &dyn SchedulingPolicy,
        submit: Option<&SubmitThread>,
    ) -> Result<(Vec<f32>, GpuTime)> {
        let samples = x.len() / D_IN;
        if !x.len().is_multiple_of(D_IN) || samples > self.n {
            return Err(cuda_async::Error::InvalidArgument(format!(
                "{} inputs for a graph of {} samples of {D_IN}",
                x.len(),
                self.n
            )));
        }
        self.input.write(|v| {
            v[..x.len()].copy_from_slice(x);
            v[x.len()..].fill(0.0);
        })?;
        let replay = self.graph.launch_owned().timed().schedule(policy)?;
        let ((), t) = enqueue(submit, replay).await?;
        let out = self.output.read(|v| v[..samples * CLASSES].to_vec())?;
        Ok((out, t))
    }
}

/// Runs a scheduled op: enqueued by `submit` when given, else by the
/// awaiting task; its output once the GPU is done.
///
/// # Errors
///
/// The op's.
pub async fn enqueue<O: DeviceOp + 'static>(
    submit: Option<&SubmitThread>,
    op: DeviceFuture<O>,
) -> Result<<O as DeviceOp>::Output> {
    match submit {
        Some(s) => s.enqueue(op).await,
        None => op.await,
    }
}
