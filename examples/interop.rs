//! Interop: run ops on a stream another CUDA library owns (here, a stream
//! made with cudarc directly), mixing our ops with that library's calls.
//!
//! `cargo run --release --example interop`

use cuda_async::cudarc::driver::CudaContext;
use cuda_async::prelude::*;

fn main() {
    examples::no_arguments(
        "interop",
        "runs ops on a stream made with cudarc directly, between that library's own calls, and checks the data's round trip. Needs an NVIDIA GPU and its driver; prints one line on success.",
    );
    if let Err(e) = run() {
        eprintln!("interop: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    // Fails with a clear error (not a panic) on a machine without a driver.
    cuda_async::Device::new(0)?;
    // ANCHOR: interop
    // Their code: a context and stream made with cudarc.
    let ctx = CudaContext::new(0)?;
    let theirs = ctx.new_stream()?;
    let their_buf = theirs.clone_htod(&[1.0f32, 2.0, 3.0, 4.0])?;

    // Our ops, on their stream: ordered with their work, no extra sync.
    let ours = cuda_async::DeviceBuffer::from_cuda_slice(their_buf);
    let copied = d2d(&ours).then(d2h).sync_on(&theirs)?;
    // ANCHOR_END: interop

    let got = copied.to_vec()?;
    if got != [1.0, 2.0, 3.0, 4.0] {
        eprintln!("interop: got {got:?}");
        std::process::exit(1);
    }
    // And back: hand our buffer to their API.
    let back = theirs.clone_dtoh(ours.local()?.as_cuda_slice())?;
    assert_eq!(back, got);
    println!("interop: ops ran on a cudarc stream and its data round-tripped");
    Ok(())
}
