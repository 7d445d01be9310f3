//! Vector add, the script way: build a recipe, then `.sync()` it.
//!
//! `cargo run --release --example vecadd`

use cuda_async::prelude::*;
use cuda_async::{Device, LaunchConfig, Module};

// ANCHOR: kernel
const VECADD: &str = r#"
extern "C" __global__ void vecadd(const float* a, const float* b, float* c, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) c[i] = a[i] + b[i];
}
"#;
// ANCHOR_END: kernel

fn main() {
    examples::no_arguments(
        "vecadd",
        "adds two vectors of 2^20 floats on GPU 0 with one kernel and checks the sum against the CPU. Needs an NVIDIA GPU and its driver; prints the element count, the device and `correct`.",
    );
    if let Err(e) = run() {
        eprintln!("vecadd: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), cuda_async::Error> {
    let n: u32 = 1 << 20;
    // Inputs that differ per element, so a wrong index would show.
    let a: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 0.5).collect();
    let b: Vec<f32> = (0..n).map(|i| (i % 777) as f32 - 100.0).collect();

    // ANCHOR: recipe
    let dev = Device::new(0)?;
    let vecadd = Module::cuda(VECADD, &[])?
        .named("vecadd.cu")
        .kernel("vecadd")?;
    vecadd.load_on(&dev)?; // compile now (NVRTC), not inside the first launch
    let c = h2d(a.clone())
        .zip(h2d(b.clone())) // the two uploads run concurrently
        .then(move |(a, b)| zeros::<f32>(n as usize).map(move |c| (a, b, c)))
        // SAFETY: vecadd reads a[0..n), b[0..n) and writes c[0..n); all have n elements.
        .then(move |(a, b, c)| unsafe {
            launch(&vecadd, LaunchConfig::for_num_elems(n), (a, b, c, n))
        })
        .then(|(_, _, c, _)| d2h(c))
        // Nothing ran until here:
        .sync()?;
    // ANCHOR_END: recipe

    let c = c.as_slice()?;
    let bad = (0..n as usize).filter(|&i| c[i] != a[i] + b[i]).count();
    if bad > 0 {
        eprintln!("vecadd: {bad} of {n} elements wrong");
        std::process::exit(1);
    }
    println!("vecadd: {n} elements on {} correct", dev.info()?.name);
    Ok(())
}
