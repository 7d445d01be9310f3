//! `await_latency`: one empty kernel awaited from one task on a 4-worker
//! tokio runtime: the minimal raw `cuLaunchHostFunc` + `AtomicWaker`
//! future vs `DeviceFuture` (and raw launch + synchronize as the floor).
//!
//! Each sample is `iters` awaits in a row inside one spawned task.
//! Skips (exit 0) on a machine without a GPU.

use std::sync::Arc;

use benches::measure::await_throughput;
use benches::AwaitPath;
use criterion::Criterion;

fn main() {
    let Some(fx) = benches::bench_fixture() else {
        return;
    };
    let fx = Arc::new(fx);
    let rt = benches::tokio_runtime().expect("a tokio runtime");
    let mut c = Criterion::default().configure_from_args();
    let mut g = c.benchmark_group("await_latency");
    for (name, path) in [
        ("raw_launch_sync", AwaitPath::RawSync),
        ("raw_hostfn_future", AwaitPath::RawHostFn),
        ("ops_device_future", AwaitPath::Lib),
    ] {
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                await_throughput(&rt, &fx, 1, iters as usize, path).expect("awaits")
            })
        });
    }
    g.finish();
    c.final_summary();
}
