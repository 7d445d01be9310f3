//! A batch of independent pipelines spread over every visible GPU with a
//! `DevicePool`, checked, with each device's share and throughput printed.
//! On a host with one GPU it runs there and says so.
//!
//! `cargo run --release --example multi_gpu`

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use cuda_async::prelude::*;
use cuda_async::{DeviceLoad, DevicePool, LaunchConfig, Module};

// A few hundred microseconds of arithmetic per element block, so that
// spreading pipelines over devices has something to overlap.
const BURN: &str = r#"
extern "C" __global__ void burn(float* x, unsigned n, unsigned rounds) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    for (unsigned r = 0; r < rounds; ++r) v = v * 0.5f + 1.0f;
    x[i] = v;
}
"#;

/// What `burn` computes for one element (the same float operations; a
/// fused multiply-add gives the same result, `v * 0.5` being exact).
fn burn_cpu(mut v: f32, rounds: u32) -> f32 {
    for _ in 0..rounds {
        v = v * 0.5 + 1.0;
    }
    v
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() {
    examples::no_arguments(
        "multi_gpu",
        "spreads 64 independent pipelines over every visible GPU with a DevicePool and checks them, printing each device's share and the wall time. Needs one or more NVIDIA GPUs (on one it says so).",
    );
    if let Err(e) = run().await {
        eprintln!("multi_gpu: {e}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), cuda_async::Error> {
    let ordinals: Vec<usize> = (0..cuda_async::device_count()?).collect();
    let burn = Module::cuda(BURN, &[])?.named("burn.cu").kernel("burn")?;
    // Compile on every device before any task launches (see `Module`'s
    // Performance section).
    for &o in &ordinals {
        burn.load_on(&cuda_async::Device::new(o)?)?;
    }
    // Round-robin, counting where each pipeline goes.
    let placed: Arc<Vec<AtomicUsize>> =
        Arc::new(ordinals.iter().map(|_| AtomicUsize::new(0)).collect());
    let turn = AtomicUsize::new(0);
    let counts = placed.clone();
    let gpus = Arc::new(
        DevicePool::new(&ordinals)?.place_with(move |loads: &[DeviceLoad]| {
            let i = turn.fetch_add(1, Ordering::Relaxed) % loads.len();
            counts[i].fetch_add(1, Ordering::Relaxed);
            i
        }),
    );

    let (pipelines, n, rounds) = (64usize, 1u32 << 16, 20_000u32);
    // The inputs take 7 values: their results, once, on the CPU.
    let want: Arc<Vec<f32>> = Arc::new((0..7).map(|v| burn_cpu(v as f32, rounds)).collect());
    let t = Instant::now();
    let mut tasks = Vec::new();
    for p in 0..pipelines {
        let (burn, gpus, want) = (burn.clone(), gpus.clone(), want.clone());
        tasks.push(tokio::spawn(async move {
            let x: Vec<f32> = (0..n).map(|i| ((i + p as u32) % 7) as f32).collect();
            // ANCHOR: pipeline
            let out = h2d(x.clone())
                // SAFETY: burn touches x[0..n), and x has n elements.
                .then(move |x| unsafe {
                    launch(&burn, LaunchConfig::for_num_elems(n), (x, n, rounds))
                })
                .then(|(x, _, _)| d2h(x))
                .schedule(&*gpus)?
                .await?;
            // ANCHOR_END: pipeline
            let ok = out
                .as_slice()?
                .iter()
                .zip(&x)
                .all(|(got, x)| *got == want[*x as usize]);
            Ok::<bool, cuda_async::Error>(ok)
        }));
    }
    let mut correct = 0;
    for task in tasks {
        if task.await.expect("task panicked")? {
            correct += 1;
        }
    }
    let wall = t.elapsed();
    if correct != pipelines {
        eprintln!(
            "multi_gpu: {} of {pipelines} pipelines wrong",
            pipelines - correct
        );
        std::process::exit(1);
    }
    if ordinals.len() == 1 {
        println!("multi_gpu: one GPU visible: every pipeline ran on device 0");
    }
    for (o, c) in ordinals.iter().zip(placed.iter()) {
        let c = c.load(Ordering::Relaxed);
        println!(
            "  device {o}: {c} pipelines, {:.1} pipelines/s",
            c as f64 / wall.as_secs_f64()
        );
    }
    println!(
        "multi_gpu: {pipelines} pipelines on {} GPU(s) correct in {wall:?}",
        ordinals.len()
    );
    Ok(())
}
