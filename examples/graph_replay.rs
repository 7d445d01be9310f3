//! CUDA graphs of ops: a chain of 100 kernels and a decode-style loop, run
//! eagerly and as a graph replay, timed side by side and checked against
//! the CPU.
//!
//! `cargo run --release --example graph_replay`

use std::time::{Duration, Instant};

use cuda_async::prelude::*;
use cuda_async::{BoxedOp, Device, DeviceBuffer, DeviceScalar, Kernel, LaunchConfig, Module};

// ANCHOR: kernels
const KERNELS: &str = r#"
extern "C" __global__ void scale_add(float* x, float a, float b, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * a + b;
}
// One step of a decode-style loop: reads the step counter from the device.
extern "C" __global__ void decode_step(const unsigned* step, float* state, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) state[i] = state[i] * 0.5f + (float)(*step + i % 3);
}
"#;
// ANCHOR_END: kernels

const N: u32 = 1 << 14;
const CHAIN: usize = 100;
const DECODE_KERNELS: usize = 8;
const DECODE_STEPS: u32 = 100;

fn main() {
    examples::no_arguments(
        "graph_replay",
        "captures a chain of 100 kernels and a decode loop as CUDA graphs, replays them, and checks the replays against eager runs and the CPU, printing both timings. Needs an NVIDIA GPU and its driver.",
    );
    if let Err(e) = run() {
        eprintln!("graph_replay: {e}");
        std::process::exit(1);
    }
}

/// `CHAIN` launches of `x = x * 0.5 + 1`, one op each.
fn chain(k: &Kernel, x: DeviceBuffer<f32>) -> BoxedOp<'static, DeviceBuffer<f32>> {
    let mut op = value(x).boxed();
    for _ in 0..CHAIN {
        let k = k.clone();
        op = op
            // SAFETY: scale_add touches x[0..N) of an N-element buffer.
            .then(move |x| unsafe {
                launch(&k, LaunchConfig::for_num_elems(N), (x, 0.5f32, 1.0f32, N))
            })
            .map(|(x, _, _, _)| x)
            .boxed();
    }
    op
}

// ANCHOR: decode
/// One decode step: `DECODE_KERNELS` launches that read the step counter.
fn decode<'a>(
    k: &Kernel,
    step: &'a DeviceBuffer<u32>,
    state: DeviceBuffer<f32>,
) -> BoxedOp<'a, DeviceBuffer<f32>> {
    let mut op = value(state).boxed();
    for _ in 0..DECODE_KERNELS {
        let k = k.clone();
        op = op
            // SAFETY: decode_step reads step[0] and touches state[0..N).
            .then(move |s| unsafe { launch(&k, LaunchConfig::for_num_elems(N), (step, s, N)) })
            .map(|(_, s, _)| s)
            .boxed();
    }
    op
}
// ANCHOR_END: decode

fn cpu_chain(x: &mut [f32]) {
    for _ in 0..CHAIN {
        x.iter_mut().for_each(|v| *v = v.mul_add(0.5, 1.0));
    }
}

fn cpu_decode(state: &mut [f32], t: u32) {
    for _ in 0..DECODE_KERNELS {
        for (i, v) in state.iter_mut().enumerate() {
            *v = v.mul_add(0.5, (t + i as u32 % 3) as f32);
        }
    }
}

fn check(what: &str, got: &[f32], want: &[f32]) -> Result<(), cuda_async::Error> {
    if got == want {
        Ok(())
    } else {
        Err(cuda_async::Error::InvalidArgument(format!(
            "{what}: the GPU's result differs from the CPU's"
        )))
    }
}

fn per(d: Duration, n: usize) -> f64 {
    d.as_secs_f64() * 1e6 / n as f64
}

fn run() -> Result<(), cuda_async::Error> {
    let dev = Device::new(0)?;
    let m = Module::cuda(KERNELS, &[])?.named("graph_replay.cu");
    m.load_on(&dev)?;
    let (scale_add, decode_step) = (m.kernel("scale_add")?, m.kernel("decode_step")?);
    let start: Vec<f32> = (0..N).map(|i| (i % 17) as f32).collect();
    let reps = 50;

    // 1. A chain of 100 kernels: eager (100 launches) vs one graph replay.
    let mut x = Some(h2d(start.clone()).sync()?);
    for _ in 0..5 {
        x = Some(chain(&scale_add, x.take().expect("x")).sync()?);
    }
    let t = Instant::now();
    for _ in 0..reps {
        x = Some(chain(&scale_add, x.take().expect("x")).sync()?);
    }
    let eager = t.elapsed();
    // ANCHOR: capture
    let graph = chain(&scale_add, h2d(start.clone()).sync()?).graph()?; // nothing runs yet
    graph.launch().sync()?; // 100 kernels, one driver call
                            // ANCHOR_END: capture
    let mut want = start.clone();
    cpu_chain(&mut want);
    check(
        "chain, one replay",
        &d2h(graph.output()).sync()?.to_vec()?,
        &want,
    )?;
    for _ in 0..5 {
        graph.launch().sync()?;
    }
    let t = Instant::now();
    for _ in 0..reps {
        graph.launch().sync()?;
    }
    let replay = t.elapsed();
    for _ in 0..5 + reps {
        cpu_chain(&mut want);
    }
    check(
        "chain, replays",
        &d2h(graph.output()).sync()?.to_vec()?,
        &want,
    )?;
    println!(
        "100-kernel chain + sync: eager {:.1} us ({:.2} us per kernel), graph replay {:.1} us ({:.2} us per kernel)",
        per(eager, reps),
        per(eager, reps * CHAIN),
        per(replay, reps),
        per(replay, reps * CHAIN)
    );

    // 2. A decode loop: each step sets the step counter, then runs 8 kernels.
    // ANCHOR: decode_loop
    let mut step = DeviceScalar::new(0u32).sync()?;
    let mut state = Some(h2d(start.clone()).sync()?);
    let mut cpu = start.clone();
    let mut eager = Duration::ZERO;
    for s in 0..DECODE_STEPS {
        let t = Instant::now();
        step.set(s).sync()?;
        state = Some(decode(&decode_step, step.buffer(), state.take().expect("state")).sync()?);
        eager += t.elapsed();
        cpu_decode(&mut cpu, s);
    }
    check(
        "decode, eager",
        &d2h(state.as_ref().expect("state")).sync()?.to_vec()?,
        &cpu,
    )?;

    let graph = decode(&decode_step, step.buffer(), h2d(start.clone()).sync()?).graph()?;
    let mut cpu = start.clone();
    let mut replays = Duration::ZERO;
    for s in 0..DECODE_STEPS {
        let t = Instant::now();
        step.set(s).sync()?; // the captured kernels read the new value
        graph.launch().sync()?;
        replays += t.elapsed();
        cpu_decode(&mut cpu, s);
        // Checked at every step.
        check(
            "decode, replay",
            &d2h(graph.output()).sync()?.to_vec()?,
            &cpu,
        )?;
    }
    // ANCHOR_END: decode_loop
    println!(
        "decode loop, {DECODE_KERNELS} kernels per step: eager {:.1} us per step, graph replay {:.1} us per step (set + replay + sync)",
        per(eager, DECODE_STEPS as usize),
        per(replays, DECODE_STEPS as usize)
    );
    println!(
        "graph_replay: a {CHAIN}-kernel chain and {DECODE_STEPS} decode steps on {}: replays match eager runs and the CPU: correct",
        dev.info()?.name
    );
    Ok(())
}
