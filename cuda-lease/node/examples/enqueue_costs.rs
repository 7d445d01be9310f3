//! What a worker's enqueue costs on this host, call by call: the driver
//! calls a batch is made of, timed alone; one kernel launch three ways
//! (`cuLaunchKernel` alone, `cuda-core`'s checked `launch_with`, and
//! [`CudaDevice`]'s launch command as a lease's worker runs it), in turns
//! in one thread, so the host's drift over time is the same for all three;
//! then a graph replay and its download through [`CudaDevice`] (each
//! replay on the next of four streams, as a lease's round-robin client
//! sends them, and all on one stream).
//!
//! ```text
//! cargo run --release -p cuda-lease-node --example enqueue_costs [ITERS]
//! ```
//!
//! Needs an NVIDIA GPU (device 0). Prints medians in microseconds.

use std::time::Instant;

use cuda_core::cudarc::driver::sys;
use cuda_lease::proto::{Id, LaunchArg, LaunchSpec, ModuleHash, SourceKind, StreamId};
use cuda_lease::ptx::{grid_for, BLOCK, TEST_KERNELS};
use cuda_lease_node::device::{CudaDevice, DeviceError, LeaseDevice};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Floats in the chain's buffers (the report's replay row uses 256).
const N: u32 = 256;
const BYTES: u64 = N as u64 * 4;
const X: Id = Id(1);
const Y: Id = Id(2);
const GRAPH: Id = Id(3);

fn main() -> Result<()> {
    let iters: usize = std::env::args()
        .nth(1)
        .map_or(Ok(2000), |s| s.parse())
        .map_err(|e| format!("ITERS: {e}"))?;
    let mut dev = CudaDevice::open(0).map_err(err)?;
    println!("median us over {iters} calls (device 0)");
    driver_calls(iters)?;
    let hash = ModuleHash::of(&SourceKind::Ptx, TEST_KERNELS);
    dev.load_module(hash, &SourceKind::Ptx, TEST_KERNELS)
        .map_err(err)?;
    dev.alloc(0, X, BYTES).map_err(err)?;
    dev.alloc(0, Y, BYTES).map_err(err)?;
    launches(&mut dev, hash, iters)?;
    let ones: Vec<u8> = (0..N).flat_map(|_| 1.0f32.to_le_bytes()).collect();
    // The chain's body: the upload, the zeroing, 17 launches of y += x.
    let captured = dev
        .capture_graph(GRAPH, &[0], &mut |d| {
            d.write(0, X, 0, &ones)?;
            d.fill(0, Y, 0, BYTES, 0)?;
            for _ in 0..17 {
                d.launch(0, &vadd(hash))?;
            }
            Ok(())
        })
        .map_err(err)?;
    if !captured {
        return Err("the device did not capture the graph".into());
    }
    let gap = std::time::Duration::from_micros(50);
    for (label, streams, gap) in [
        ("4 streams, round robin", 4, None),
        ("one stream", 1, None),
        (
            "4 streams, 50 us of spinning before each",
            4,
            Some((gap, Wait::Spin)),
        ),
        (
            "4 streams, 50 us of runtime turns before each",
            4,
            Some((gap, Wait::Turns)),
        ),
        (
            "4 streams, the thread asleep 50 us before each",
            4,
            Some((gap, Wait::Sleep)),
        ),
    ] {
        replays(&mut dev, label, streams, gap, iters)?;
    }
    Ok(())
}

/// Launches per block in [`launches`]: the report's chain has 17.
const BLOCK_LAUNCHES: usize = 17;

/// One launch of `vadd` over the chain's buffers, timed three ways in
/// turns (a block of [`BLOCK_LAUNCHES`] each, then a wait for the GPU):
/// the driver's call alone on a stream of its own, `cuda-core`'s
/// `launch_with` (the checks and the argument list the worker's launch
/// goes through), and the worker's launch command on `dev`'s stream 0
/// (its lease's checks and its buffers' ordering, sealed as a batch).
fn launches(dev: &mut CudaDevice, module: ModuleHash, iters: usize) -> Result<()> {
    let device = cuda_core::Device::new(0)?;
    let kernel = cuda_core::Module::ptx(TEST_KERNELS)?.kernel("vadd")?;
    kernel.load_on(&device)?;
    let func = kernel.function_on(&device)?.cu_function();
    let stream = device.new_stream()?;
    let x = cuda_core::DeviceBuffer::<u8>::zeros(&stream, BYTES as usize)?;
    let y = cuda_core::DeviceBuffer::<u8>::zeros(&stream, BYTES as usize)?;
    stream.synchronize()?;
    let config = cuda_core::cudarc::driver::LaunchConfig {
        grid_dim: (grid_for(N), 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    // The driver's own buffers for its launches.
    let (mut px, mut py) = (0, 0);
    // SAFETY: allocations and a memset of sizes we own, freed below.
    unsafe {
        sys::cuMemAlloc_v2(&raw mut px, BYTES as usize).result()?;
        sys::cuMemAlloc_v2(&raw mut py, BYTES as usize).result()?;
        sys::cuMemsetD8_v2(px, 0, BYTES as usize).result()?;
        sys::cuMemsetD8_v2(py, 0, BYTES as usize).result()?;
    }
    let mut storage = cuda_core::ArgList::new();
    let spec = vadd(module);
    let blocks = iters.div_ceil(BLOCK_LAUNCHES) + 5;
    let mut t = [const { Vec::new() }; 3];
    for b in 0..blocks {
        for (way, times) in t.iter_mut().enumerate() {
            for _ in 0..BLOCK_LAUNCHES {
                let t0 = Instant::now();
                match way {
                    0 => {
                        let n = N;
                        let mut params = [
                            (&raw const px).cast_mut().cast::<std::ffi::c_void>(),
                            (&raw const py).cast_mut().cast(),
                            (&raw const py).cast_mut().cast(),
                            (&raw const n).cast_mut().cast(),
                        ];
                        // SAFETY: vadd(x, y, out, n) over buffers of n
                        // floats, live until the stream is waited for below.
                        unsafe {
                            sys::cuLaunchKernel(
                                func,
                                config.grid_dim.0,
                                1,
                                1,
                                config.block_dim.0,
                                1,
                                1,
                                0,
                                stream.cu_stream(),
                                params.as_mut_ptr(),
                                std::ptr::null_mut(),
                            )
                        }
                        .result()?;
                    }
                    1 => {
                        let mut args = storage.start(&stream);
                        args.push_buffer(&x, 0)?;
                        args.push_buffer(&y, 0)?;
                        args.push_buffer(&y, 0)?;
                        args.push_bytes(&N.to_le_bytes());
                        // SAFETY: as above.
                        unsafe { kernel.launch_with(&device, &config, args) }?;
                    }
                    _ => dev.launch(0, &spec).map_err(err)?,
                }
                if b >= 5 {
                    times.push(t0.elapsed());
                }
            }
            if way == 2 {
                let ticket = dev.seal(0);
                while dev.poll_sealed(ticket).is_none() {}
            } else {
                stream.synchronize()?;
            }
        }
    }
    // SAFETY: the stream was waited for after the last launch.
    unsafe {
        sys::cuMemFree_v2(px).result()?;
        sys::cuMemFree_v2(py).result()?;
    }
    let [raw, core, worker] = t.map(median);
    println!(
        "one launch, {BLOCK_LAUNCHES} in a row, in turns: cuLaunchKernel {raw:.2}, \
         cuda-core launch_with {core:.2}, the worker's launch command {worker:.2}"
    );
    Ok(())
}

/// How the thread waits before a replay, as a worker waits for its next batch.
#[derive(Clone, Copy)]
enum Wait {
    /// A spin loop, no system call.
    Spin,
    /// Turns of a current-thread tokio runtime (`block_on(yield_now())`,
    /// each polling its I/O driver: a system call), as a direct lease's
    /// worker spins between batches.
    Turns,
    /// Asleep.
    Sleep,
}

/// `y = x + y` over the chain's buffers.
fn vadd(module: ModuleHash) -> LaunchSpec<'static> {
    LaunchSpec {
        module,
        kernel: "vadd".into(),
        grid: [grid_for(N), 1, 1],
        block: [BLOCK, 1, 1],
        shared_mem: 0,
        args: vec![
            LaunchArg::mem(X),
            LaunchArg::mem(Y),
            LaunchArg::mem(Y),
            LaunchArg::u32(N),
        ],
    }
}

/// The worker's replay batch, `iters` times: the graph's launch, the
/// download of `y`, the seal, then polls until the batch is done; after
/// a wait of `gap.0` each, if given, as `gap.1` says.
fn replays(
    dev: &mut CudaDevice,
    label: &str,
    streams: u32,
    gap: Option<(std::time::Duration, Wait)>,
    iters: usize,
) -> Result<()> {
    let mut t = [const { Vec::new() }; 4];
    let warm = iters.min(100);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    for i in 0..iters + warm {
        let s = (i as u32 % streams) as StreamId;
        if let Some((d, wait)) = gap {
            let t = Instant::now();
            match wait {
                Wait::Sleep => std::thread::sleep(d),
                Wait::Spin => {
                    while t.elapsed() < d {
                        std::hint::spin_loop();
                    }
                }
                Wait::Turns => {
                    while t.elapsed() < d {
                        rt.block_on(tokio::task::yield_now());
                    }
                }
            }
        }
        let t0 = Instant::now();
        dev.launch_graph(s, GRAPH).map_err(err)?;
        let t1 = Instant::now();
        dev.read(s, Y, 0, BYTES, 0).map_err(err)?;
        let t2 = Instant::now();
        let ticket = dev.seal(BYTES as usize);
        let t3 = Instant::now();
        let out = loop {
            if let Some(r) = dev.poll_sealed(ticket) {
                break r.map_err(err)?;
            }
        };
        let t4 = Instant::now();
        let y = f32::from_le_bytes(out[4..8].try_into()?);
        if y != 17.0 {
            return Err(format!("replay {i}: y[1] = {y}, not 17").into());
        }
        if i >= warm {
            for (v, (a, b)) in t.iter_mut().zip([(t0, t1), (t1, t2), (t2, t3), (t3, t4)]) {
                v.push(b - a);
            }
        }
    }
    let [launch, read, seal, done] = t.map(median);
    println!(
        "replay batch, {label}: launch_graph {launch:.1}, read {read:.1}, seal {seal:.1}, \
         then done after {done:.1}"
    );
    Ok(())
}

/// The driver calls alone, on two streams of the current context.
fn driver_calls(iters: usize) -> Result<()> {
    let a = new_stream()?;
    let b = new_stream()?;
    let ev = new_event()?;
    let mut host = std::ptr::null_mut();
    // SAFETY: allocations and copies of sizes we own; every handle is
    // live until the end of this function.
    unsafe {
        sys::cuMemHostAlloc(&raw mut host, BYTES as usize, 0).result()?;
        let mut dptr = 0;
        sys::cuMemAlloc_v2(&raw mut dptr, BYTES as usize).result()?;
        let record = time(iters, || {
            sys::cuEventRecord(ev, a).result().map_err(Into::into)
        })?;
        let create = time(iters, || {
            let e = new_event()?;
            sys::cuEventRecord(e, a).result()?;
            sys::cuEventDestroy_v2(e).result().map_err(Into::into)
        })?;
        sys::cuEventRecord(ev, a).result()?;
        let wait = time(iters, || {
            sys::cuStreamWaitEvent(b, ev, 0)
                .result()
                .map_err(Into::into)
        })?;
        sys::cuStreamSynchronize(b).result()?;
        let query = time(iters, || sys::cuEventQuery(ev).result().map_err(Into::into))?;
        let copy = time(iters, || {
            sys::cuMemcpyDtoHAsync_v2(host, dptr, BYTES as usize, a)
                .result()
                .map_err(Into::into)
        })?;
        sys::cuStreamSynchronize(a).result()?;
        println!(
            "driver: cuEventRecord {record:.1}, cuEventCreate+Record+Destroy {create:.1}, \
             cuStreamWaitEvent {wait:.1}, cuEventQuery (done) {query:.1}, \
             cuMemcpyDtoHAsync {BYTES} B {copy:.1}"
        );
        sys::cuMemFree_v2(dptr).result()?;
        sys::cuMemFreeHost(host).result()?;
        sys::cuEventDestroy_v2(ev).result()?;
        sys::cuStreamDestroy_v2(a).result()?;
        sys::cuStreamDestroy_v2(b).result()?;
    }
    Ok(())
}

fn new_stream() -> Result<sys::CUstream> {
    let mut s = std::ptr::null_mut();
    let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
    // SAFETY: creates a stream in the current context.
    unsafe { sys::cuStreamCreate(&raw mut s, flags) }.result()?;
    Ok(s)
}

fn new_event() -> Result<sys::CUevent> {
    let mut e = std::ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    // SAFETY: creates an event in the current context.
    unsafe { sys::cuEventCreate(&raw mut e, flags) }.result()?;
    Ok(e)
}

/// The median of `iters` timed calls of `f` (after up to 100 untimed).
fn time(iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut v = Vec::with_capacity(iters);
    let warm = iters.min(100);
    for i in 0..iters + warm {
        let t = Instant::now();
        f()?;
        if i >= warm {
            v.push(t.elapsed());
        }
    }
    Ok(median(v))
}

fn median(mut v: Vec<std::time::Duration>) -> f64 {
    v.sort_unstable();
    v.get(v.len() / 2)
        .map_or(f64::NAN, |d| d.as_secs_f64() * 1e6)
}

fn err(e: DeviceError) -> Box<dyn std::error::Error> {
    e.to_string().into()
}
