//! Many pipelines in flight from a tokio service; no thread blocks on the
//! GPU: each `.await` is woken by a host callback.
//!
//! `cargo run --release --example tokio_pipelines`

use std::time::Instant;

use cuda_async::prelude::*;
use cuda_async::{Device, LaunchConfig, Module};

const SAXPY: &str = r#"
extern "C" __global__ void saxpy(float a, const float* x, float* y, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"#;

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() {
    examples::no_arguments(
        "tokio_pipelines",
        "runs 256 pipelines (upload, kernel, download) concurrently from a tokio service, each awaited, and checks every result. Needs an NVIDIA GPU and its driver; prints the count and the wall time.",
    );
    if let Err(e) = run().await {
        eprintln!("tokio_pipelines: {e}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), cuda_async::Error> {
    let dev = Device::new(0)?;
    let saxpy = Module::cuda(SAXPY, &[])?
        .named("saxpy.cu")
        .kernel("saxpy")?;
    // Compile before spawning: a first launch inside a task would block
    // its executor thread for the whole NVRTC compile.
    saxpy.load_on(&dev)?;
    let pipelines = 256usize;
    let n = 4096u32;
    let t = Instant::now();
    let mut tasks = Vec::new();
    for p in 0..pipelines {
        let saxpy = saxpy.clone();
        tasks.push(tokio::spawn(async move {
            let a = p as f32;
            let x: Vec<f32> = (0..n).map(|i| i as f32).collect();
            let y: Vec<f32> = (0..n).map(|i| (i % 13) as f32).collect();
            // ANCHOR: pipeline
            let out = h2d(x.clone())
                .zip(h2d(y.clone()))
                // SAFETY: saxpy touches x[0..n), y[0..n); both have n elements.
                .then(move |(x, y)| unsafe {
                    launch(&saxpy, LaunchConfig::for_num_elems(n), (a, x, y, n))
                })
                .then(|(_, _, y, _)| d2h(y))
                .await?;
            // ANCHOR_END: pipeline
            let ok = out
                .as_slice()?
                .iter()
                .enumerate()
                .all(|(i, v)| *v == a.mul_add(x[i], y[i]));
            Ok::<bool, cuda_async::Error>(ok)
        }));
    }
    let mut correct = 0;
    for t in tasks {
        if t.await.expect("task panicked")? {
            correct += 1;
        }
    }
    let dt = t.elapsed();
    if correct != pipelines {
        eprintln!(
            "tokio_pipelines: {} of {pipelines} pipelines wrong",
            pipelines - correct
        );
        std::process::exit(1);
    }
    println!("tokio_pipelines: {pipelines} concurrent pipelines correct in {dt:?}");
    Ok(())
}
