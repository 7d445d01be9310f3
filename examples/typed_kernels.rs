//! Typed kernel launchers generated from CUDA C at compile time.
//!
//! `cargo run --release --example typed_kernels`
//!
//! `kernels!` reads `kernels/typed_kernels.cu` when this example is
//! compiled and generates `k::axpby` and `k::row_sums`: functions whose
//! parameters are the kernels' own, typed (`const float*` is a buffer the
//! kernel reads, `float*` one it writes, `unsigned` a `u32`). A wrong
//! argument count or type, or a shared buffer where the kernel writes, is a
//! compile error at the call.

use cuda_async::prelude::*;
use cuda_async::{zip, Device, LaunchConfig};

// ANCHOR: kernels
mod k {
    // Relative to this crate's directory; the crate rebuilds when it changes.
    cuda_async::kernels!("kernels/typed_kernels.cu");
}
// ANCHOR_END: kernels

fn main() {
    examples::no_arguments(
        "typed_kernels",
        "launches kernels through launchers generated from CUDA C at compile time (axpby, then row sums of a 512x300 matrix) and checks them against the CPU. Needs an NVIDIA GPU and its driver; prints the device and `correct`.",
    );
    if let Err(e) = run() {
        eprintln!("typed_kernels: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), cuda_async::Error> {
    let (rows, cols) = (512u32, 300u32);
    let n = rows * cols;
    let x: Vec<f32> = (0..n).map(|i| (i % 97) as f32 * 0.25).collect();
    let y: Vec<f32> = (0..n).map(|i| (i % 13) as f32 - 6.0).collect();
    let (a, b) = (2.0f32, -0.5f32);

    // ANCHOR: launch
    let dev = Device::new(0)?;
    k::module().load_on(&dev)?; // compile the file now (NVRTC), not in the first launch
    let row_cfg = LaunchConfig::for_num_elems(rows);
    let sums = zip!(h2d(x.clone()), h2d(y.clone()), zeros::<f32>(rows as usize))
        // SAFETY: axpby touches x[0..n) and y[0..n); both hold n floats.
        .then(move |(x, y, sums)| unsafe {
            k::axpby(LaunchConfig::for_num_elems(n), a, x, b, y, n).map(move |r| (r, sums))
        })
        // SAFETY: row_sums reads m[0..rows*cols) and writes sums[0..rows).
        .then(move |((_, _, _, y, _), sums)| unsafe { k::row_sums(row_cfg, y, sums, rows, cols) })
        .then(|(_, sums, _, _)| d2h(sums))
        .sync()?;
    // ANCHOR_END: launch

    let sums = sums.as_slice()?;
    let mut worst = 0.0f32;
    for r in 0..rows as usize {
        let want: f32 = (0..cols as usize)
            .map(|c| a * x[r * cols as usize + c] + b * y[r * cols as usize + c])
            .sum();
        worst = worst.max((sums[r] - want).abs() / want.abs().max(1.0));
    }
    if worst > 1e-4 {
        eprintln!("typed_kernels: row sums off by up to {worst:e} (relative)");
        std::process::exit(1);
    }
    println!(
        "typed_kernels: axpby then row_sums of a {rows}x{cols} matrix on {}: correct",
        dev.info()?.name
    );
    Ok(())
}
