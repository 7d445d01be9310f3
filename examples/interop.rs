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

    let uniform = random_fill()?;
    println!(
        "interop: ops ran on a cudarc stream and its data round-tripped; cuRAND filled {uniform} \
         floats in a pipeline"
    );
    Ok(())
}

/// Another library inside a pipeline: cuRAND fills a buffer through
/// `on_stream`, then our ops read it on whatever stream they run.
fn random_fill() -> Result<usize, Box<dyn std::error::Error>> {
    use cuda_async::cudarc::curand::{result as curand, sys};
    use cuda_async::foreign::{on_stream, writes};
    // SAFETY: only loads the library.
    if !unsafe { sys::is_culib_present() } {
        return Err("cuRAND (libcurand) not found: install the CUDA toolkit's cuRAND".into());
    }
    /// A cuRAND generator handle, used by one call at a time.
    struct Generator(sys::curandGenerator_t);
    // SAFETY: cuRAND generators may move between threads; this one is used
    // by one call at a time (the op below, then the destroy after it).
    unsafe impl Send for Generator {}

    let generator = Generator(curand::create_generator()?);
    let n = 1 << 16;
    // ANCHOR: foreign
    let fill = zeros::<f32>(n).then(move |buf| {
        on_stream("curandGenerateUniform", writes(buf), move |stream, out| {
            // SAFETY: `out` addresses `n` floats, ordered on `stream`; the
            // generator comes back with the op's output and is destroyed
            // after its work (the sync below).
            unsafe {
                curand::set_stream(generator.0, stream.cu_stream() as _).and_then(|()| {
                    curand::generate::uniform_f32(generator.0, out.addr() as *mut f32, out.len())
                })
            }
            .map_err(|e| cuda_async::Error::Library {
                call: "curandGenerateUniform",
                status: format!("{:?}", e.0),
            })?;
            Ok(generator)
        })
    });
    let (buf, generator) = fill.sync()?;
    let host = d2h(buf).sync()?;
    // ANCHOR_END: foreign
    // SAFETY: its work is done (synchronized above); used by nothing else.
    unsafe { curand::destroy_generator(generator.0) }?;
    let v = host.to_vec()?;
    if !v.iter().all(|x| *x > 0.0 && *x <= 1.0) || v.windows(2).all(|w| w[0] == w[1]) {
        return Err("cuRAND's uniform fill is not in (0, 1]".into());
    }
    Ok(v.len())
}
