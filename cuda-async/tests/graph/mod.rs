//! GPU tests of CUDA graphs of ops (local backend only: graphs are local).

use std::sync::Arc;

use cuda_async::prelude::*;
use cuda_async::{BoxedOp, DeviceBuffer, Error, Kernel};

use crate::suite::{cfg, dev, Rng};

const N: usize = 4096;

/// `times` axpy launches `y = a * x + y`, one op each.
fn axpy_chain(
    k: &Kernel,
    x: &Arc<DeviceBuffer<f32>>,
    y: DeviceBuffer<f32>,
    a: f32,
    times: usize,
) -> BoxedOp<'static, DeviceBuffer<f32>> {
    let n = y.len() as u32;
    let mut op = value(y).boxed();
    for _ in 0..times {
        let (k, x) = (k.clone(), x.clone());
        // SAFETY: axpy touches x[0..n) and y[0..n); both hold n floats.
        op = op
            .then(move |y| unsafe { launch(&k, cfg(n), (a, x, y, n)) })
            .map(|(_, _, y, _)| y)
            .boxed();
    }
    op
}

/// 55 ops: two arms of 25 launches each in a zip (y += 0.5 x; z -= 0.25
/// x), then z = y + 1.
fn pipeline(
    ks: &crate::suite::Kernels,
    x: &Arc<DeviceBuffer<f32>>,
    y: DeviceBuffer<f32>,
    z: DeviceBuffer<f32>,
) -> impl DeviceOp<Output = (DeviceBuffer<f32>, DeviceBuffer<f32>)> {
    let n = y.len() as u32;
    let copy_add = ks.copy_add.clone();
    axpy_chain(&ks.axpy, x, y, 0.5, 25)
        .zip(axpy_chain(&ks.axpy, x, z, -0.25, 25))
        // SAFETY: copy_add reads y[0..n) and writes z[0..n).
        .then(move |(y, z)| unsafe { launch(&copy_add, cfg(n), (y, z, 1.0f32, n)) })
        .map(|(y, z, _, _)| (y, z))
}

/// The CPU's `pipeline`, `replays` times (NVRTC fuses axpy into an FMA).
fn reference(x: &[f32], y: &mut [f32], z: &mut [f32], replays: usize) {
    for _ in 0..replays {
        for i in 0..x.len() {
            for _ in 0..25 {
                y[i] = 0.5f32.mul_add(x[i], y[i]);
                z[i] = (-0.25f32).mul_add(x[i], z[i]);
            }
            z[i] = y[i] + 1.0;
        }
    }
}

fn upload(v: &[f32]) -> DeviceBuffer<f32> {
    h2d(v.to_vec()).sync().expect("h2d")
}

fn download(b: &DeviceBuffer<f32>) -> Vec<f32> {
    d2h(b).sync().expect("d2h").to_vec().expect("host read")
}

pub(crate) fn replay_equals_eager_for_a_chain_of_55_ops_with_a_zip() {
    let ks = crate::kernels();
    let mut rng = Rng::new();
    let (xv, yv, zv) = (rng.f32s(N), rng.f32s(N), rng.f32s(N));
    let x = Arc::new(upload(&xv));
    // Eager.
    let (ey, ez) = pipeline(&ks, &x, upload(&yv), upload(&zv)).sync().unwrap();
    let (ey, ez) = (download(&ey), download(&ez));
    let (mut ry, mut rz) = (yv.clone(), zv.clone());
    reference(&xv, &mut ry, &mut rz, 1);
    assert_eq!(ey, ry, "eager y vs the CPU");
    assert_eq!(ez, rz, "eager z vs the CPU");
    // Captured: nothing runs until a replay.
    let graph = pipeline(&ks, &x, upload(&yv), upload(&zv)).graph().unwrap();
    println!(
        "graph: {} nodes, buffers (used, written) {:?}",
        graph.node_count(),
        graph.buffers()
    );
    assert!(graph.node_count() >= 51, "{} nodes", graph.node_count());
    assert_eq!(graph.buffers(), (3, 2));
    assert_eq!(download(&graph.output().0), yv, "capture ran nothing");
    graph.launch().sync().unwrap();
    assert_eq!(download(&graph.output().0), ey, "replay y vs eager");
    assert_eq!(download(&graph.output().1), ez, "replay z vs eager");
    // Replays go on from there, awaited too.
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async { graph.launch().await }).unwrap();
    graph.launch().sync().unwrap();
    reference(&xv, &mut ry, &mut rz, 2);
    assert_eq!(download(&graph.output().0), ry, "three replays, y");
    assert_eq!(download(&graph.output().1), rz, "three replays, z");
}

pub(crate) fn handles_dropped_after_capture_then_1000_replays() {
    let ks = crate::kernels();
    let mut rng = Rng::new();
    let (xv, yv, zv) = (rng.f32s(N), rng.f32s(N), rng.f32s(N));
    let x = Arc::new(upload(&xv));
    // z's handle is dropped inside the op, x's right after the capture:
    // the graph keeps both.
    let mut graph = pipeline(&ks, &x, upload(&yv), upload(&zv))
        .map(|(y, z)| {
            drop(z);
            y
        })
        .graph()
        .unwrap();
    drop(x);
    for _ in 0..1000 {
        graph.launch().sync().unwrap();
    }
    let y = graph.take_output().unwrap();
    let (mut ry, mut rz) = (yv, zv);
    reference(&xv, &mut ry, &mut rz, 1000);
    assert_eq!(download(&y), ry, "y after 1000 replays");
    // The output outlives the graph; the graph's other memory is freed
    // after its last replay.
    drop(graph);
    assert_eq!(download(&y), ry, "y after the graph is gone");
}

pub(crate) fn a_replay_on_one_stream_is_seen_by_an_op_on_another() {
    let ks = crate::kernels();
    let d = dev();
    let (a, b) = (d.new_stream().unwrap(), d.new_stream().unwrap());
    let spin = ks.spin.clone();
    let copy_add = ks.copy_add.clone();
    let src = Arc::new(upload(&vec![1.0; N]));
    let n = N as u32;
    // 20 ms of spinning, then out = src + 41.
    let graph = zeros::<u64>(2)
        // SAFETY: spin writes stamps[0..2) of a 2-element buffer.
        .then(move |s| unsafe { launch(&spin, cfg(1), (20_000_000u64, s)) })
        .zip(zeros::<f32>(N))
        // SAFETY: copy_add reads src[0..n) and writes out[0..n).
        .then(move |(_, out)| unsafe { launch(&copy_add, cfg(n), (src, out, 41.0f32, n)) })
        .map(|(_, out, _, _)| out)
        .graph()
        .unwrap();
    for round in 0..3 {
        // SAFETY: the replay's buffers order their own later uses; nothing
        // reads host memory here.
        unsafe { graph.launch().async_on(&a) }.unwrap();
        // On stream b, without any host wait in between: ordered after the
        // replay by the output buffer's events.
        let out = d2h(graph.output()).sync_on(&b).unwrap();
        assert!(
            out.as_slice().unwrap().iter().all(|v| *v == 42.0),
            "round {round}: stream b read before the replay wrote"
        );
        // The graph's zeros node clears it again at the next replay.
        // SAFETY: as above.
        unsafe { graph.launch().async_on(&b) }.unwrap();
        let again = d2h(graph.output()).sync_on(&a).unwrap();
        assert!(again.as_slice().unwrap().iter().all(|v| *v == 42.0));
    }
}

pub(crate) fn what_cannot_be_captured_is_an_error_and_ops_work_after() {
    let ks = crate::kernels();
    // A download into host memory.
    let e = h2d(vec![1.0f32; 16]).then(d2h).graph().unwrap_err();
    println!("d2h in a capture: {e}");
    assert!(matches!(&e, Error::Capture(m) if m.contains("d2h")), "{e}");
    // A panic inside a `then` closure.
    let r = std::panic::catch_unwind(|| {
        zeros::<f32>(16)
            .then(|_| -> cuda_async::combinators::Value<()> { panic!("inside a capture") })
            .graph()
    });
    assert!(r.is_err(), "the panic goes on");
    // The same kinds of ops still run and capture.
    let host = h2d(vec![2.0f32; 16]).then(d2h).sync().unwrap();
    assert_eq!(host.as_slice().unwrap(), &[2.0; 16]);
    let x = Arc::new(upload(&[1.0; 16]));
    let g = axpy_chain(&ks.axpy, &x, upload(&[0.0; 16]), 2.0, 3)
        .graph()
        .unwrap();
    g.launch().sync().unwrap();
    assert_eq!(download(g.output()), vec![6.0; 16]);
    // A replay inside another capture.
    let e = value(()).then(|()| g.launch()).graph().unwrap_err();
    assert!(
        matches!(&e, Error::Capture(m) if m.contains("another graph")),
        "{e}"
    );
    g.launch().sync().unwrap();
    assert_eq!(download(g.output()), vec![12.0; 16]);
}

const DECODE: &str = r#"
extern "C" __global__ void decode_step(const unsigned* step, float* state, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) state[i] = state[i] * 0.5f + (float)(*step + i % 3);
}
"#;

pub(crate) fn a_decode_loop_sets_a_device_scalar_before_each_of_100_replays() {
    let k = cuda_async::Module::cuda(DECODE, &[])
        .unwrap()
        .kernel("decode_step")
        .unwrap();
    let n = N as u32;
    let mut step = cuda_async::DeviceScalar::new(7u32).sync().unwrap();
    let start: Vec<f32> = Rng::new().f32s(N);
    let state = upload(&start);
    let graph = {
        let kk = k.clone();
        let s = step.buffer();
        value(state)
            // SAFETY: decode_step reads step[0] and touches state[0..n).
            .then(move |st| unsafe { launch(&kk, cfg(n), (s, st, n)) })
            .map(|(_, st, _)| st)
            .then(move |st| unsafe {
                // SAFETY: as above.
                launch(&k, cfg(n), (s, st, n))
            })
            .map(|(_, st, _)| st)
            .graph()
            .unwrap()
    };
    assert_eq!(
        graph.buffers(),
        (2, 1),
        "the scalar is read, the state written"
    );
    let mut cpu = start;
    for t in 0..100u32 {
        step.set(t * 3).sync().unwrap();
        graph.launch().sync().unwrap();
        for _ in 0..2 {
            for (i, v) in cpu.iter_mut().enumerate() {
                *v = v.mul_add(0.5, (t * 3 + i as u32 % 3) as f32);
            }
        }
        assert_eq!(download(graph.output()), cpu, "step {t}");
    }
    // Set and replay without a host wait in between, awaited.
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        step.set(1000).await?;
        graph.launch().await
    })
    .unwrap();
    for _ in 0..2 {
        for (i, v) in cpu.iter_mut().enumerate() {
            *v = v.mul_add(0.5, (1000 + i as u32 % 3) as f32);
        }
    }
    assert_eq!(
        download(graph.output()),
        cpu,
        "after an awaited set + replay"
    );
}

pub(crate) fn recapture_updates_in_place_or_reinstantiates() {
    let ks = crate::kernels();
    let x = Arc::new(upload(&[1.0; N]));
    let mut graph = axpy_chain(&ks.axpy, &x, upload(&[0.0; N]), 2.0, 4)
        .graph()
        .unwrap();
    graph.launch().sync().unwrap();
    assert_eq!(download(graph.output()), vec![8.0; N]);
    // The same four launches with another scalar: in place.
    let how = graph
        .recapture(|y| axpy_chain(&ks.axpy, &x, y, 0.5, 4))
        .unwrap();
    assert_eq!(how, cuda_async::GraphUpdate::InPlace);
    graph.launch().sync().unwrap();
    assert_eq!(download(graph.output()), vec![10.0; N]);
    // Two launches instead of four: a new graph.
    let how = graph
        .recapture(|y| axpy_chain(&ks.axpy, &x, y, 1.0, 2))
        .unwrap();
    assert_eq!(how, cuda_async::GraphUpdate::Reinstantiated);
    drop(x);
    for _ in 0..3 {
        graph.launch().sync().unwrap();
    }
    assert_eq!(download(graph.output()), vec![16.0; N]);
    // New data in the captured buffer between replays.
    let host = cuda_async::PinnedBuffer::filled(&dev(), N, 100.0f32).unwrap();
    graph
        .update(|y| copy_h2d(host, y).map(|(_, y)| y))
        .sync()
        .unwrap();
    graph.launch().sync().unwrap();
    assert_eq!(download(graph.output()), vec![102.0; N]);
}

pub(crate) fn replays_from_four_threads_are_ordered() {
    let ks = crate::kernels();
    let n = N as u32;
    let add = ks.add_u32.clone();
    // x += 1, non-atomically: overlapping replays would lose increments.
    let x = zeros::<u32>(N).sync().unwrap();
    let graph = value(x)
        // SAFETY: add_u32 touches x[0..n) of an n-element buffer.
        .then(move |x| unsafe { launch(&add, cfg(n), (x, 1u32, n)) })
        .map(|(x, _, _)| x)
        .graph()
        .unwrap();
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                let stream = dev().new_stream().unwrap();
                for _ in 0..50 {
                    // SAFETY: the replay's buffers order their later uses.
                    unsafe { graph.launch().async_on(&stream) }.unwrap();
                }
                stream.synchronize().unwrap();
            });
        }
    });
    let out = d2h(graph.output()).sync().unwrap();
    assert!(
        out.as_slice().unwrap().iter().all(|v| *v == 200),
        "lost increments"
    );
}

pub(crate) fn graph_on_captures_on_the_callers_stream() {
    let ks = crate::kernels();
    let theirs = dev().new_stream().unwrap();
    let x = Arc::new(upload(&[1.0; N]));
    let graph = axpy_chain(&ks.axpy, &x, upload(&[0.0; N]), 3.0, 2)
        .zip(axpy_chain(&ks.axpy, &x, upload(&[0.0; N]), 1.0, 1))
        .graph_on(&theirs)
        .unwrap();
    // The caller's stream is not left capturing, and works.
    let host = h2d(vec![5u8; 8]).then(d2h).sync_on(&theirs).unwrap();
    assert_eq!(host.as_slice().unwrap(), &[5; 8]);
    graph.launch().sync_on(&theirs).unwrap();
    graph.launch().sync().unwrap();
    assert_eq!(download(&graph.output().0), vec![12.0; N]);
    assert_eq!(download(&graph.output().1), vec![2.0; N]);
}
