//! GPU tests of `cuda-core`'s graphs, and of its ranged memsets, staging arena,
//! run-time argument launches, mapped host memory with stream writes, and
//! copies to and from module globals (ignored without a GPU; the bundle runs
//! them: `scripts/gpu-bundle`, then `target/gpu-bundle/run`).
//!
//! The buffers here are plain cudarc slices and the context's cudarc event
//! tracking is off, so what is captured is exactly the work enqueued (the
//! capture layer knows nothing of buffers; see `cuda_core::graph`).

use std::sync::Arc;

use cuda_core::cudarc::driver::{sys, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use cuda_core::graph::is_capturing;
use cuda_core::{Device, Error, Graph, GraphUpdate, Kernel, Module};

const SRC: &str = r#"
extern "C" __global__ void mul2(float* x, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * 2.0f;
}
extern "C" __global__ void add(float* x, float a, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] + a;
}
"#;

const N: usize = 4096;

struct Fixture {
    dev: Device,
    mul2: Kernel,
    add: Kernel,
}

fn fixture() -> Fixture {
    let dev = Device::new(0).expect("device 0");
    // SAFETY: this binary's buffers are plain cudarc slices ordered by the
    // tests themselves (one stream each, or explicit synchronizes).
    unsafe { dev.context().disable_event_tracking() };
    let m = Module::cuda(SRC, &[]).expect("module");
    let (mul2, add) = (m.kernel("mul2").unwrap(), m.kernel("add").unwrap());
    mul2.load_on(&dev).unwrap();
    add.load_on(&dev).unwrap();
    Fixture { dev, mul2, add }
}

fn drv(call: &'static str) -> impl FnOnce(cuda_core::cudarc::driver::DriverError) -> Error {
    move |e| Error::driver(call, e)
}

impl Fixture {
    fn upload(&self, s: &Arc<CudaStream>, v: &[f32]) -> CudaSlice<f32> {
        let x = s.clone_htod(v).expect("htod");
        s.synchronize().unwrap();
        x
    }

    fn download(&self, s: &Arc<CudaStream>, x: &CudaSlice<f32>) -> Vec<f32> {
        let v = s.clone_dtoh(x).expect("dtoh");
        s.synchronize().unwrap();
        v
    }

    fn mul2(&self, s: &Arc<CudaStream>, x: &mut CudaSlice<f32>) -> cuda_core::Result<()> {
        let f = self.mul2.function_on(&self.dev)?;
        let n = N as u32;
        let mut b = s.launch_builder(f);
        b.arg(x).arg(&n);
        // SAFETY: mul2(float*, unsigned) over n = x.len() elements.
        unsafe { b.launch(LaunchConfig::for_num_elems(n)) }
            .map(drop)
            .map_err(drv("cuLaunchKernel"))
    }

    fn add(&self, s: &Arc<CudaStream>, x: &mut CudaSlice<f32>, a: f32) -> cuda_core::Result<()> {
        let f = self.add.function_on(&self.dev)?;
        let n = N as u32;
        let mut b = s.launch_builder(f);
        b.arg(x).arg(&a).arg(&n);
        // SAFETY: add(float*, float, unsigned) over n = x.len() elements.
        unsafe { b.launch(LaunchConfig::for_num_elems(n)) }
            .map(drop)
            .map_err(drv("cuLaunchKernel"))
    }

    /// 50 launches: mul2, add 1, mul2, add 2, ... (order matters).
    fn chain(&self, s: &Arc<CudaStream>, x: &mut CudaSlice<f32>) -> cuda_core::Result<()> {
        for k in 0..25 {
            self.mul2(s, x)?;
            self.add(s, x, (k % 3) as f32)?;
        }
        Ok(())
    }
}

fn start() -> Vec<f32> {
    (0..N).map(|i| (i % 7) as f32 * 0.25).collect()
}

fn reference(mut v: Vec<f32>, replays: usize) -> Vec<f32> {
    for _ in 0..replays {
        for k in 0..25 {
            for x in &mut v {
                *x = *x * 2.0 + (k % 3) as f32;
            }
        }
    }
    v
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_captured_chain_replays_like_eager_launches_on_any_stream() {
    let fx = fixture();
    let (cap, other) = (fx.dev.new_stream().unwrap(), fx.dev.new_stream().unwrap());
    // Eager, for the reference.
    let mut x = fx.upload(&cap, &start());
    fx.chain(&cap, &mut x).unwrap();
    let eager = fx.download(&cap, &x);
    assert_eq!(eager, reference(start(), 1), "eager launches vs the CPU");
    // Captured: nothing runs while capturing.
    let mut y = fx.upload(&cap, &start());
    let graph = Graph::capture(&cap, |s| fx.chain(s, &mut y)).unwrap();
    assert_eq!(graph.node_count(), 50);
    assert!(!is_capturing(&cap).unwrap());
    assert_eq!(fx.download(&cap, &y), start(), "capture ran nothing");
    // One replay on another stream equals the eager run.
    graph.launch_on(&other).unwrap();
    assert_eq!(fx.download(&other, &y), eager, "replay on another stream");
    // A second replay, on the capture stream, continues from there.
    graph.launch_on(&cap).unwrap();
    assert_eq!(
        fx.download(&cap, &y),
        reference(start(), 2),
        "second replay"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn recapture_updates_in_place_or_reinstantiates() {
    let fx = fixture();
    let s = fx.dev.new_stream().unwrap();
    let mut x = fx.upload(&s, &vec![0.0; N]);
    let mut graph = Graph::capture(&s, |s| fx.add(s, &mut x, 1.0)).unwrap();
    graph.launch_on(&s).unwrap();
    assert!(fx.download(&s, &x).iter().all(|v| *v == 1.0));
    // Same topology, another scalar: in place.
    let how = graph.recapture(&s, |s| fx.add(s, &mut x, 2.0)).unwrap();
    assert_eq!(how, GraphUpdate::InPlace);
    graph.launch_on(&s).unwrap();
    assert!(fx.download(&s, &x).iter().all(|v| *v == 3.0));
    // Two nodes instead of one: instantiated anew.
    let how = graph
        .recapture(&s, |s| {
            fx.add(s, &mut x, 10.0)?;
            fx.mul2(s, &mut x)
        })
        .unwrap();
    assert_eq!(how, GraphUpdate::Reinstantiated);
    assert_eq!(graph.node_count(), 2);
    graph.launch_on(&s).unwrap();
    assert!(fx.download(&s, &x).iter().all(|v| *v == 26.0));
    // A failed recapture leaves the graph as it was.
    let e = graph
        .recapture(&s, |s| {
            s.synchronize()
                .map_err(|e| Error::driver("cuStreamSynchronize", e))
        })
        .unwrap_err();
    assert!(!is_capturing(&s).unwrap(), "{e}");
    graph.launch_on(&s).unwrap();
    assert!(fx.download(&s, &x).iter().all(|v| *v == 72.0));
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn work_that_cannot_be_captured_is_an_error_and_the_stream_works_after() {
    let fx = fixture();
    let s = fx.dev.new_stream().unwrap();
    let mut x = fx.upload(&s, &vec![0.0; N]);
    // A synchronize inside the capture.
    let e = Graph::capture(&s, |s| {
        fx.add(s, &mut x, 1.0)?;
        s.synchronize()
            .map_err(|e| Error::driver("cuStreamSynchronize", e))
    })
    .unwrap_err();
    println!("synchronize in a capture: {e}");
    assert!(e.to_string().contains("cuStreamSynchronize"), "{e}");
    assert!(!is_capturing(&s).unwrap());
    // Nested captures on one stream.
    let e = Graph::capture(&s, |s| Graph::capture(s, |_| Ok(())).map(drop)).unwrap_err();
    assert!(
        matches!(&e, Error::Capture(m) if m.contains("already capturing")),
        "{e}"
    );
    assert!(!is_capturing(&s).unwrap());
    // An empty capture is a graph of no nodes, or a clear error.
    match Graph::capture(&s, |_| Ok(())) {
        Ok(g) => assert_eq!(g.node_count(), 0),
        Err(e) => assert!(matches!(e, Error::Capture(_)), "{e}"),
    }
    // The stream works, and nothing captured ran.
    fx.add(&s, &mut x, 5.0).unwrap();
    assert!(fx.download(&s, &x).iter().all(|v| *v == 5.0));
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_panic_inside_a_capture_ends_it() {
    let fx = fixture();
    let s = fx.dev.new_stream().unwrap();
    let mut x = fx.upload(&s, &vec![0.0; N]);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Graph::capture(&s, |s| {
            fx.add(s, &mut x, 1.0)?;
            panic!("in the middle of a capture");
        })
    }));
    assert!(r.is_err(), "the panic goes on");
    assert!(!is_capturing(&s).unwrap(), "the guard ended the capture");
    fx.add(&s, &mut x, 2.0).unwrap();
    assert!(fx.download(&s, &x).iter().all(|v| *v == 2.0));
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn capture_mode_is_thread_local_other_threads_allocate_meanwhile() {
    let fx = fixture();
    let s = fx.dev.new_stream().unwrap();
    let mut x = fx.upload(&s, &vec![0.0; N]);
    let ctx = fx.dev.context().clone();
    let graph = Graph::capture(&s, |s| {
        fx.add(s, &mut x, 1.0)?;
        // A synchronous allocation (a "potentially unsafe" call) on another
        // thread while this one captures: allowed in thread-local mode.
        std::thread::spawn(move || {
            ctx.bind_to_thread()?;
            // SAFETY: a plain allocation, freed right after, no other use.
            unsafe {
                let p = cuda_core::cudarc::driver::result::malloc_sync(1 << 20)?;
                cuda_core::cudarc::driver::result::free_sync(p)
            }
        })
        .join()
        .expect("thread")
        .map_err(|e| Error::driver("cuMemAlloc on another thread", e))
    })
    .unwrap();
    graph.launch_on(&s).unwrap();
    assert!(fx.download(&s, &x).iter().all(|v| *v == 1.0));
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_graph_dropped_with_replays_in_flight_lets_them_finish() {
    let fx = fixture();
    let s = fx.dev.new_stream().unwrap();
    let mut x = fx.upload(&s, &start());
    let graph = Graph::capture(&s, |s| fx.chain(s, &mut x)).unwrap();
    for _ in 0..3 {
        graph.launch_on(&s).unwrap();
    }
    drop(graph);
    assert_eq!(fx.download(&s, &x), reference(start(), 3));
}

/// What the driver does with events and allocations inside a capture, as
/// input for capturing `cuda-async` ops (whose buffers order themselves with
/// events). Prints one line per case; asserts only that every stream works
/// afterwards.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn probe_events_and_allocations_inside_a_capture() {
    let fx = fixture();
    let (a, b, c) = (
        fx.dev.new_stream().unwrap(),
        fx.dev.new_stream().unwrap(),
        fx.dev.new_stream().unwrap(),
    );
    let code = |r: sys::CUresult| format!("{r:?}");
    let event = || {
        let mut e = std::ptr::null_mut();
        // SAFETY: writes one handle.
        unsafe { sys::cuEventCreate(&mut e, 2) }.result().unwrap();
        e
    };
    let begin = |s: &CudaStream| {
        // SAFETY: a live stream of the current context.
        unsafe {
            sys::cuStreamBeginCapture_v2(
                s.cu_stream(),
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .result()
        .unwrap()
    };
    // A graph a probe capture returned (null when it made none).
    let destroy = |g: sys::CUgraph| {
        if !g.is_null() {
            // SAFETY: ours, destroyed once.
            unsafe { sys::cuGraphDestroy(g) };
        }
    };
    let end = |s: &CudaStream| {
        let mut g = std::ptr::null_mut();
        // SAFETY: ends this thread's capture on a live stream.
        let r = unsafe { sys::cuStreamEndCapture(s.cu_stream(), &mut g) };
        (r, g)
    };
    fx.dev.context().bind_to_thread().unwrap();
    let mut x = fx.upload(&a, &vec![0.0; N]);

    // 1. A wait on an event recorded outside the capture (flags 0), then
    //    with CU_EVENT_WAIT_EXTERNAL.
    let outside = event();
    // SAFETY: live handles.
    unsafe { sys::cuEventRecord(outside, a.cu_stream()) }
        .result()
        .unwrap();
    for flags in [0u32, 1] {
        begin(&b);
        // SAFETY: live handles.
        let w = unsafe { sys::cuStreamWaitEvent(b.cu_stream(), outside, flags) };
        let k = fx.add(&b, &mut x, 1.0).err().map(|e| e.to_string());
        let (r, g) = end(&b);
        println!(
            "probe: wait(flags {flags}) on an event recorded outside: wait {}, then launch {:?}, end capture {}",
            code(w),
            k,
            code(r)
        );
        destroy(g);
    }

    // 2. An event recorded inside the capture, used after it ended.
    let inside = event();
    begin(&b);
    fx.add(&b, &mut x, 1.0).unwrap();
    // SAFETY: live handles.
    let rec = unsafe { sys::cuEventRecord(inside, b.cu_stream()) };
    let (r, g) = end(&b);
    // SAFETY: live handles.
    let q = unsafe { sys::cuEventQuery(inside) };
    // SAFETY: live handles.
    let w = unsafe { sys::cuStreamWaitEvent(c.cu_stream(), inside, 0) };
    println!(
        "probe: record inside a capture {}, end {}; afterwards query {}, wait on another stream {}",
        code(rec),
        code(r),
        code(q),
        code(w)
    );
    destroy(g);

    // 3. A stream-ordered allocation inside the capture (a graph memory
    //    node), replayed twice without a free in between.
    begin(&b);
    let mut p: sys::CUdeviceptr = 0;
    // SAFETY: writes one pointer; b is capturing.
    let al = unsafe { sys::cuMemAllocAsync(&mut p, 4096, b.cu_stream()) };
    let (r, g) = end(&b);
    let mut line = format!(
        "probe: cuMemAllocAsync in a capture {}, end {}",
        code(al),
        code(r)
    );
    if !g.is_null() {
        let mut exec = std::ptr::null_mut();
        // SAFETY: a live graph.
        let i = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, g, 0) };
        line += &format!(", instantiate {}", code(i));
        if i == sys::CUresult::CUDA_SUCCESS {
            // SAFETY: live handles.
            let l1 = unsafe { sys::cuGraphLaunch(exec, c.cu_stream()) };
            // SAFETY: live handles.
            let l2 = unsafe { sys::cuGraphLaunch(exec, c.cu_stream()) };
            let s = c.synchronize().err().map(|e| format!("{e:?}"));
            line += &format!(", launch {} then {} (sync {s:?})", code(l1), code(l2));
            // SAFETY: the allocation the graph made; freed once.
            let f = unsafe { sys::cuMemFreeAsync(p, c.cu_stream()) };
            line += &format!(", free {}", code(f));
            c.synchronize().unwrap();
            // SAFETY: ours.
            unsafe { sys::cuGraphExecDestroy(exec) };
        }
        // SAFETY: ours.
        unsafe { sys::cuGraphDestroy(g) };
    }
    println!("{line}");

    // 4. cudarc's event tracking on: a launch through its launch builder
    //    inside a capture, then the slice used outside it.
    // SAFETY: re-enabled for this case only; slices made now get events.
    unsafe { fx.dev.context().enable_event_tracking() };
    let mut t = a.alloc_zeros::<f32>(N).unwrap();
    a.synchronize().unwrap();
    begin(&b);
    let k = fx.add(&b, &mut t, 1.0).err().map(|e| e.to_string());
    let (r, g) = end(&b);
    let later = fx.add(&c, &mut t, 1.0).err().map(|e| e.to_string());
    let sync = c.synchronize().err().map(|e| format!("{e:?}"));
    println!(
        "probe: cudarc tracking on, launch in a capture {k:?}, end {}; a later launch on another stream {later:?}, sync {sync:?}",
        code(r)
    );
    destroy(g);
    drop(t);
    // SAFETY: back to this binary's setting.
    unsafe { fx.dev.context().disable_event_tracking() };

    for s in [&a, &b, &c] {
        assert!(!is_capturing(s).unwrap());
        s.synchronize().unwrap();
    }
    fx.add(&a, &mut x, 1.0).unwrap();
    fx.download(&a, &x);
    // SAFETY: ours, once.
    unsafe {
        sys::cuEventDestroy_v2(outside);
        sys::cuEventDestroy_v2(inside);
    }
}

// The safe layer a lease node's worker drives a GPU through: ranged
// memsets, batched pinned staging and launches from run-time argument
// lists, each ordered by the caller with the buffer's use events.

const FILL_SRC: &str = r#"
extern "C" __global__ void fill(unsigned char* p, unsigned char v, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = v;
}
"#;

/// The bytes of `buf`, downloaded through a pooled pinned buffer.
fn bytes_of(dev: &Device, buf: &cuda_core::DeviceBuffer<u8>, s: &Arc<CudaStream>) -> Vec<u8> {
    let mut host = cuda_core::PinnedBuffer::filled(dev, buf.len(), 0u8).unwrap();
    host.download_from(buf, 0, s).unwrap();
    host.to_vec().unwrap()
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn memset_unordered_sets_exactly_its_range_and_refuses_others_before_the_driver() {
    let dev = Device::new(0).unwrap();
    let s = dev.new_stream().unwrap();
    let mut buf = cuda_core::DeviceBuffer::<u8>::zeros(&s, 64).unwrap();
    buf.before_write(&s).unwrap();
    buf.memset_unordered(16..32, 0xab, &s).unwrap();
    buf.memset_unordered(40..40, 0xcd, &s).unwrap();
    buf.after_write(&s).unwrap();
    let got = bytes_of(&dev, &buf, &s);
    let mut want = vec![0u8; 64];
    want[16..32].fill(0xab);
    assert_eq!(got, want);
    for bad in [0..65, 64..65, usize::MAX - 1..usize::MAX] {
        let e = buf.memset_unordered(bad, 1, &s).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    }
    assert_eq!(
        bytes_of(&dev, &buf, &s),
        want,
        "refused memsets wrote nothing"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_staging_arena_round_trips_a_batch_and_guards_its_ranges() {
    let dev = Device::new(0).unwrap();
    let (a, b) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let mut buf = cuda_core::DeviceBuffer::<u8>::zeros(&a, 256).unwrap();
    let mut arena = cuda_core::StagingArena::new(&dev, 4096).unwrap();
    assert_eq!(arena.len(), 4096);

    // Upload on `a`, then download on `b` ordered by the buffer's events.
    let data: Vec<u8> = (0..100u8).collect();
    let slot = arena.reserve(data.len()).unwrap();
    buf.before_write(&a).unwrap();
    arena.upload(slot, &data, &mut buf, 7, &a).unwrap();
    buf.after_write(&a).unwrap();
    let slot = arena.reserve(120).unwrap();
    buf.before_read(&b).unwrap();
    let read = arena.download(slot, &buf, 0, &b).unwrap();
    buf.after_read(&b).unwrap();
    assert!(arena.used() >= 100 + 120);
    assert!(
        matches!(arena.read(read), Err(Error::InvalidArgument(_))),
        "not readable before the wait"
    );
    // `b` is not named: the arena waits for it anyway.
    arena.synchronize(std::slice::from_ref(&a)).unwrap();
    assert_eq!(arena.used(), 0);
    let got = arena.read(read).unwrap();
    assert_eq!(&got[..7], &[0; 7]);
    assert_eq!(&got[7..107], &data[..]);
    assert_eq!(&got[107..], &[0; 13]);

    // Out of range, wrong length, stale slots: refused before any copy.
    let slot = arena.reserve(8).unwrap();
    let e = arena.upload(slot, &[1; 8], &mut buf, 250, &a).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    let slot = arena.reserve(8).unwrap();
    let e = arena.upload(slot, &[1; 4], &mut buf, 0, &a).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    let stale = arena.reserve(8).unwrap();
    arena.synchronize(&[a.clone(), b.clone()]).unwrap();
    let e = arena.download(stale, &buf, 0, &a).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    // Reads end at the next reservation.
    assert!(arena.reserve(arena.len() + 1).is_none());
    let _ = arena.reserve(1).unwrap();
    assert!(arena.read(read).is_err());
    assert_eq!(
        &bytes_of(&dev, &buf, &a)[7..107],
        &data[..],
        "nothing else was written"
    );
}

/// An arena's end recorded with a stream its copies did not run on marks
/// that stream's work too: not done, nor passed by a stream waiting on it,
/// while a host function holds the stream; `mark_end` alone does not wait
/// for it.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn an_arena_end_marked_with_more_streams_waits_for_their_work() {
    let dev = Device::new(0).unwrap();
    let (a, held, waiter) = (
        dev.new_stream().unwrap(),
        dev.new_stream().unwrap(),
        dev.new_stream().unwrap(),
    );
    let mut buf = cuda_core::DeviceBuffer::<u8>::zeros(&a, 64).unwrap();
    a.synchronize().unwrap();
    let mut arena = cuda_core::StagingArena::new(&dev, 4096).unwrap();
    let hold = |s: &CudaStream| {
        let (release, until) = std::sync::mpsc::channel::<()>();
        cuda_core::launch_host_callback(s, move || {
            let _ = until.recv();
        })
        .unwrap();
        release
    };
    let mut upload = |arena: &mut cuda_core::StagingArena| {
        let slot = arena.reserve(8).unwrap();
        arena.upload(slot, &[7; 8], &mut buf, 0, &a).unwrap();
    };

    upload(&mut arena);
    let release = hold(&held);
    let end = arena.mark_end_with(&[held.clone(), held.clone()]).unwrap();
    end.wait_on(&waiter).unwrap();
    let passed = dev.context().new_event(None).unwrap();
    passed.record(&waiter).unwrap();
    a.synchronize().unwrap();
    assert!(!end.is_done().unwrap(), "the held stream's work is marked");
    assert!(
        !passed.try_is_complete().unwrap(),
        "a stream waiting on the end waits for the held stream"
    );
    release.send(()).unwrap();
    arena.settle(end).unwrap();
    passed.synchronize().unwrap();

    // Without the stream named, the end is the copies' alone.
    upload(&mut arena);
    let release = hold(&held);
    let end = arena.mark_end().unwrap();
    a.synchronize().unwrap();
    assert!(end.is_done().unwrap(), "the held stream is not waited for");
    release.send(()).unwrap();
    arena.settle(end).unwrap();
    held.synchronize().unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn launches_from_run_time_argument_lists_are_checked_and_reuse_their_storage() {
    let dev = Device::new(0).unwrap();
    let s = dev.new_stream().unwrap();
    let k = Module::cuda(FILL_SRC, &[]).unwrap().kernel("fill").unwrap();
    k.load_on(&dev).unwrap();
    dev.context().bind_to_thread().unwrap();
    let buf = cuda_core::DeviceBuffer::<u8>::zeros(&s, 64).unwrap();
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (64, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut storage = cuda_core::ArgList::new();
    for (offset, value) in [(0usize, 1u8), (16, 2), (48, 3)] {
        let mut args = storage.start(&s);
        args.push_buffer(&buf, offset).unwrap();
        args.push_bytes(&[value]);
        args.push_bytes(&(64 - offset as u32).to_le_bytes());
        assert_eq!(args.len(), 3);
        buf.before_write(&s).unwrap();
        // SAFETY: `fill` writes p[0..n) with n = 64 - offset bytes left in
        // the buffer past `offset`; ordered by the buffer's events.
        unsafe { k.launch_with(&dev, &cfg, args) }.unwrap();
        buf.after_write(&s).unwrap();
    }
    let got = bytes_of(&dev, &buf, &s);
    let mut want = vec![1u8; 64];
    want[16..].fill(2);
    want[48..].fill(3);
    assert_eq!(got, want);

    // Mismatches fail before the driver: count, size, offset.
    let mut args = storage.start(&s);
    args.push_buffer(&buf, 0).unwrap();
    args.push_bytes(&[9]);
    // SAFETY: refused before any launch.
    let e = unsafe { k.launch_with(&dev, &cfg, args) }.unwrap_err();
    assert!(matches!(e, Error::ArgumentMismatch { .. }), "{e:?}");
    let mut args = storage.start(&s);
    args.push_buffer(&buf, 0).unwrap();
    args.push_bytes(&[9, 9]);
    args.push_bytes(&64u32.to_le_bytes());
    // SAFETY: refused before any launch.
    let e = unsafe { k.launch_with(&dev, &cfg, args) }.unwrap_err();
    assert!(matches!(e, Error::ArgumentMismatch { .. }), "{e:?}");
    let mut args = storage.start(&s);
    let e = args.push_buffer(&buf, 65).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    assert!(args.is_empty());
    assert_eq!(
        bytes_of(&dev, &buf, &s),
        want,
        "refused launches ran nothing"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn device_info_reports_the_numbers_programs_size_work_by() {
    use cuda_core::DeviceAttribute as A;
    let dev = Device::new(0).unwrap();
    let info = dev.info().unwrap();
    println!("{info:#?}");
    // Every NVIDIA GPU this library runs on (compute capability 7.0 and up).
    assert_eq!(info.warp_size, 32);
    assert_eq!(info.max_threads_per_block, 1024);
    assert_eq!(info.shared_memory_per_block, 48 << 10);
    assert!(info.shared_memory_per_block_optin >= info.shared_memory_per_block);
    assert!(info.shared_memory_per_multiprocessor >= info.shared_memory_per_block_optin);
    assert!(info.max_threads_per_multiprocessor >= 1024);
    assert!(info.multiprocessors > 0 && info.l2_cache_bytes > 0 && info.memory_bus_width_bits > 0);
    // The typed query answers what the fields hold, and what they do not.
    let sms = dev
        .attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .unwrap();
    assert_eq!(sms as u32, info.multiprocessors);
    let engines = dev
        .attribute(A::CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT)
        .unwrap();
    assert!(engines >= 1, "{engines} copy engines");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_stream_writes_values_into_mapped_host_memory() {
    use std::sync::atomic::Ordering;
    let dev = Device::new(0).unwrap();
    assert!(matches!(
        cuda_core::MappedHostMemory::zeroed(&dev, 0),
        Err(Error::InvalidArgument(_))
    ));
    let mem = cuda_core::MappedHostMemory::zeroed(&dev, 4096).unwrap();
    assert_eq!(mem.bytes(), 4096);
    for bad in [4, 4092, 4096, usize::MAX] {
        assert!(mem.atomic_u64(bad).is_err(), "offset {bad}");
    }
    let (first, word) = (mem.atomic_u64(0).unwrap(), mem.atomic_u64(64).unwrap());
    assert_eq!(word.load(Ordering::Acquire), 0, "zeroed");
    if !dev.can_use_64_bit_stream_mem_ops().unwrap() {
        println!("no 64-bit stream memory operations on this device");
        return;
    }
    let s = dev.new_stream().unwrap();
    // SAFETY: an aligned word of mapped memory that outlives the write
    // (the stream is synchronized below), read only atomically.
    unsafe { cuda_core::stream_write_value_64(&s, mem.device_ptr() + 64, 7) }.unwrap();
    s.synchronize().unwrap();
    assert_eq!(word.load(Ordering::Acquire), 7);
    assert_eq!(first.load(Ordering::Acquire), 0, "only the addressed word");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn pinned_buffers_copy_to_and_from_module_globals() {
    use cuda_core::PinnedBuffer;
    let dev = Device::new(0).unwrap();
    let m = Module::cuda(
        "__device__ unsigned g[4]; extern \"C\" __global__ void k() {}",
        &[],
    )
    .unwrap();
    let g = m.global_on(&dev, "g").unwrap();
    let s = dev.new_stream().unwrap();
    let mut src = PinnedBuffer::from_slice(&dev, &[1u32, 2, 3, 4]).unwrap();
    src.upload_to_global(&g, &s).unwrap();
    // SAFETY: the download below overwrites all 4 elements before any read.
    let mut dst = unsafe { PinnedBuffer::<u32>::uninit(&dev, 4) }.unwrap();
    dst.download_from_global(&g, &s).unwrap();
    assert_eq!(dst.as_slice().unwrap(), &[1, 2, 3, 4], "waits for the copy");
    // Another size than the global's: refused, nothing enqueued.
    let mut short = PinnedBuffer::filled(&dev, 3, 9u32).unwrap();
    let e = short.download_from_global(&g, &s).unwrap_err().to_string();
    assert!(e.contains("16 bytes"), "{e}");
    assert!(short.upload_to_global(&g, &s).is_err());
    assert_eq!(short.as_slice().unwrap(), &[9, 9, 9]);
}

/// A stream's cuBLAS handle gets its workspace when it is made, from the
/// memory pool in scope then (cuBLAS allocates none of its own), sized for
/// the device.
#[cfg(feature = "blas")]
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_blas_handles_workspace_comes_from_the_pool_in_scope() {
    use cuda_core::blas::{blas_handle, BLAS_WORKSPACE, BLAS_WORKSPACE_HOPPER};
    use cuda_core::{MemPool, MemPoolOptions};
    let fx = fixture();
    let pool = MemPool::new(&fx.dev, MemPoolOptions::default()).unwrap();
    let stream = fx.dev.new_stream().unwrap();
    let before = pool.stats().unwrap().used;
    let handle = pool.allocate_in(|| blas_handle(&stream)).unwrap();
    stream.synchronize().unwrap();
    let bytes = handle.lock().unwrap().workspace_bytes();
    let want = if fx.dev.compute_capability().unwrap().0 >= 9 {
        BLAS_WORKSPACE_HOPPER
    } else {
        BLAS_WORKSPACE
    };
    assert_eq!(bytes, want);
    let used = pool.stats().unwrap().used;
    assert!(
        used >= before + bytes as u64,
        "the pool in scope holds {used} bytes (was {before}); the workspace is {bytes}"
    );
}

/// A library handle made while its stream is captured is the graph's: the
/// same stream outside the capture, or in another capture, gets another
/// one (sharing it would share its workspace with the graph's replays).
#[cfg(feature = "blas")]
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_blas_handle_made_inside_a_capture_stays_with_its_graph() {
    use cuda_core::blas::blas_handle;
    use cuda_core::TrackedGraph;
    let fx = fixture();
    let (stream, alloc) = (fx.dev.new_stream().unwrap(), fx.dev.new_stream().unwrap());
    let capture = || {
        let mut inside = Vec::new();
        let graph = TrackedGraph::capture(&stream, &[], &alloc, |s| {
            inside.push(blas_handle(s)?);
            inside.push(blas_handle(s)?);
            Ok(())
        })
        .unwrap();
        (graph, inside)
    };
    let (graph, first) = capture();
    assert!(Arc::ptr_eq(&first[0], &first[1]), "one handle a capture");
    let outside = blas_handle(&stream).unwrap();
    assert!(!Arc::ptr_eq(&first[0], &outside));
    assert!(Arc::ptr_eq(&outside, &blas_handle(&stream).unwrap()));
    let (again, second) = capture();
    assert!(!Arc::ptr_eq(&first[0], &second[0]));
    assert!(!Arc::ptr_eq(&outside, &second[0]));
    drop((graph, again));
}

/// A handle runs each product shape through a cuBLASLt plan made on the
/// shape's first product and kept; an address aligned less than the plan
/// assumed gets a plan of its own, and both multiply right.
#[cfg(feature = "blas")]
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_blas_handle_plans_each_shape_once_and_multiplies_right_at_any_alignment() {
    use cuda_core::blas::{blas_handle, Gemm};
    use cuda_core::cudarc::driver::DevicePtr;
    let fx = fixture();
    let stream = fx.dev.new_stream().unwrap();
    let (m, n, k) = (33, 17, 9);
    let g = Gemm::<f32>::new(m, n, k).alpha(0.5);
    // One element more than a product needs: the second runs one element
    // in, at 4-byte alignment.
    let a_host: Vec<f32> = (0..=m * k).map(|i| (i % 5) as f32 - 2.0).collect();
    let b_host: Vec<f32> = (0..=k * n).map(|i| (i % 7) as f32 * 0.25).collect();
    let (a, b) = (fx.upload(&stream, &a_host), fx.upload(&stream, &b_host));
    let c = stream.alloc_zeros::<f32>(m * n + 1).unwrap();
    let handle = blas_handle(&stream).unwrap();
    let addr = |x: &CudaSlice<f32>, at: u64| x.device_ptr(&stream).0 + 4 * at;
    let product = |at: u64| {
        let mut h = handle.lock().unwrap();
        // SAFETY: each buffer holds its matrix from element `at` on; the
        // stream orders the calls; the device's context is current.
        unsafe { h.gemm(&g, addr(&a, at), addr(&b, at), addr(&c, at)) }.unwrap();
        let got = fx.download(&stream, &c);
        let at = at as usize;
        for j in 0..n {
            for i in 0..m {
                let want: f32 = (0..k)
                    .map(|l| a_host[at + i + l * m] * b_host[at + l + j * k])
                    .sum::<f32>()
                    * 0.5;
                let v = got[at + i + j * m];
                assert!(
                    (v - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "C[{i},{j}] = {v}, want {want}"
                );
            }
        }
        h.planned_shapes()
    };
    assert_eq!(product(0), 1, "the first product makes the shape's plan");
    assert_eq!(product(1), 2, "a less aligned address is another plan");
    assert_eq!(product(0), 2, "the first plan is kept");
}

// One event marks all of an op's buffer uses (`UseMark`).

const SLOW3_SRC: &str = r#"
extern "C" __global__ void slow3(const unsigned char* a, unsigned char* b, unsigned char* c,
                                 unsigned n, long long spin) {
    long long t0 = clock64();
    while (clock64() - t0 < spin) {}
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { b[i] = a[i] + 1; c[i] = a[i] + 2; }
}
"#;

/// Device 0, two streams of it and `slow3` loaded there (its context
/// current).
fn slow3_on_two_streams() -> (Device, Arc<CudaStream>, Arc<CudaStream>, Kernel) {
    let dev = Device::new(0).unwrap();
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let k = Module::cuda(SLOW3_SRC, &[])
        .unwrap()
        .kernel("slow3")
        .unwrap();
    k.load_on(&dev).unwrap();
    dev.context().bind_to_thread().unwrap();
    (dev, s1, s2, k)
}

/// Launches `slow3` on `s`: it spins about 100M clocks, then writes
/// `b = a + 1` and `c = a + 2` over the buffers' common length. The caller
/// orders and records the uses.
fn launch_slow3(
    k: &Kernel,
    dev: &Device,
    s: &Arc<CudaStream>,
    a: &cuda_core::DeviceBuffer<u8>,
    b: &mut cuda_core::DeviceBuffer<u8>,
    c: &mut cuda_core::DeviceBuffer<u8>,
) {
    let f = k.function_on(dev).unwrap();
    let (n, spin) = (a.len().min(b.len()).min(c.len()) as u32, 100_000_000i64);
    let mut l = s.launch_builder(f);
    l.arg(a.as_cuda_slice())
        .arg(b.as_cuda_slice_mut())
        .arg(c.as_cuda_slice_mut())
        .arg(&n)
        .arg(&spin);
    // SAFETY: slow3 reads a[0..n) and writes b[0..n), c[0..n), within the
    // three buffers' lengths.
    unsafe { l.launch(LaunchConfig::for_num_elems(n)) }.unwrap();
}

/// Another thread's read enqueued on the stream after an op's mark was
/// recorded, and noted before the op's own read of the same buffer, is
/// still waited for: a later write on another stream does not overwrite
/// the buffer under it. (The interleaving of two threads on one stream,
/// played on one: the mark of op B is recorded first, then op A runs and
/// notes its read, then B notes its read of the same buffer.)
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_read_noted_after_another_ops_mark_was_recorded_is_still_waited_for() {
    use cuda_core::{DeviceBuffer, UseMark};
    let (dev, s1, s2, k) = slow3_on_two_streams();
    let n = 1usize << 16;
    let x = DeviceBuffer::<u8>::zeros(&s1, n).unwrap();
    let mut y = DeviceBuffer::<u8>::zeros(&s1, n).unwrap();
    y.before_write(&s1).unwrap();
    y.memset_unordered(0..n, 40, &s1).unwrap();
    y.after_write(&s1).unwrap();
    let mut b = DeviceBuffer::<u8>::zeros(&s1, n).unwrap();
    let mut c = DeviceBuffer::<u8>::zeros(&s1, n).unwrap();
    // Op B reads `x` and `y`: its mark's event is recorded at its first
    // use.
    x.before_read(&s1).unwrap();
    y.before_read(&s1).unwrap();
    let mark_b = UseMark::new(&s1);
    x.after_read_with(&mark_b).unwrap();
    // Op A reads `y` (after a spin) into `b` and `c`, and notes it.
    y.before_read(&s1).unwrap();
    b.before_write(&s1).unwrap();
    c.before_write(&s1).unwrap();
    launch_slow3(&k, &dev, &s1, &y, &mut b, &mut c);
    let mark_a = UseMark::new(&s1);
    y.after_read_with(&mark_a).unwrap();
    b.after_write_with(&mark_a).unwrap();
    c.after_write_with(&mark_a).unwrap();
    // Op B notes its read of `y` now: its event comes before A's read.
    y.after_read_with(&mark_b).unwrap();
    // A write of `y` on stream 2 waits for A's read, with no host wait.
    y.before_write(&s2).unwrap();
    y.memset_unordered(0..n, 0, &s2).unwrap();
    y.after_write(&s2).unwrap();
    assert_eq!(bytes_of(&dev, &b, &s2), vec![41; n], "b");
    assert_eq!(bytes_of(&dev, &y, &s2), vec![0; n], "y");
}

/// An op that reads `a` and writes `b` and `c` on one stream, recorded
/// with one mark: another stream's write of `a` still waits for the read,
/// and its reads of `b` and `c` for the writes (the kernel spins first, so
/// an unordered use would see old bytes or change what the op reads).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn one_mark_orders_another_streams_uses_of_each_of_three_buffers() {
    use cuda_core::{DeviceBuffer, MarkScope, UseMark};
    let (dev, s1, s2, k) = slow3_on_two_streams();
    let n = 1usize << 16;
    // Rounds 3-5 with a scope's mark: its event is recorded only when
    // stream 2's first use needs it, still after the kernel.
    for round in 0..6u8 {
        let scope = MarkScope::new();
        let v = 10 * (round % 3 + 1);
        let mut a = DeviceBuffer::<u8>::zeros(&s1, n).unwrap();
        a.before_write(&s1).unwrap();
        a.memset_unordered(0..n, v, &s1).unwrap();
        a.after_write(&s1).unwrap();
        let mut b = DeviceBuffer::<u8>::zeros(&s1, n).unwrap();
        let mut c = DeviceBuffer::<u8>::zeros(&s1, n).unwrap();
        a.before_read(&s1).unwrap();
        b.before_write(&s1).unwrap();
        c.before_write(&s1).unwrap();
        launch_slow3(&k, &dev, &s1, &a, &mut b, &mut c);
        let scoped = round >= 3;
        let mark = if scoped {
            scope.mark(&s1)
        } else {
            UseMark::new(&s1)
        };
        a.after_read_with(&mark).unwrap();
        b.after_write_with(&mark).unwrap();
        c.after_write_with(&mark).unwrap();
        let recorded = format!("recorded: {}", !scoped);
        assert!(format!("{mark:?}").contains(&recorded), "{mark:?}");
        // On stream 2, with no host wait.
        a.before_write(&s2).unwrap();
        a.memset_unordered(0..n, 0, &s2).unwrap();
        a.after_write(&s2).unwrap();
        assert_eq!(bytes_of(&dev, &b, &s2), vec![v + 1; n], "round {round}: b");
        assert_eq!(bytes_of(&dev, &c, &s2), vec![v + 2; n], "round {round}: c");
        assert_eq!(bytes_of(&dev, &a, &s2), vec![0; n], "round {round}: a");
    }
}
