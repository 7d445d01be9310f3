//! `throughput`: 4, 64 and 256 tokio tasks (4 workers) x N awaited empty
//! kernels: `DeviceFuture` over the default pool vs the raw host-callback
//! future round-robin over 4 raw streams; and 4 threads x N blocking waits:
//! `.sync()` vs raw launch + synchronize.
//!
//! Skips (exit 0) on a machine without a GPU.

use std::sync::Arc;
use std::time::Duration;

use benches::measure::{await_throughput, sync_throughput, SYNC_THREADS, THROUGHPUT_TASKS};
use benches::{AwaitPath, SyncPath};
use criterion::{BenchmarkId, Criterion, Throughput};

/// Awaits per task (and waits per thread) in one batch.
const N: usize = 100;

fn main() {
    let Some(fx) = benches::bench_fixture() else {
        return;
    };
    let fx = Arc::new(fx);
    let rt = benches::tokio_runtime().expect("a tokio runtime");
    let mut c = Criterion::default().configure_from_args();
    let mut g = c.benchmark_group("throughput");
    g.sample_size(10);
    for tasks in THROUGHPUT_TASKS {
        g.throughput(Throughput::Elements((tasks * N) as u64));
        for (name, path) in [
            ("raw_hostfn_future", AwaitPath::RawHostFn),
            ("ops_device_future", AwaitPath::Lib),
        ] {
            g.bench_with_input(BenchmarkId::new(name, tasks), &tasks, |b, &tasks| {
                b.iter_custom(|iters| {
                    (0..iters)
                        .map(|_| await_throughput(&rt, &fx, tasks, N, path).expect("awaits"))
                        .sum::<Duration>()
                })
            });
        }
    }
    g.throughput(Throughput::Elements((SYNC_THREADS * N) as u64));
    for (name, path) in [
        ("raw_launch_sync_threads", SyncPath::Raw),
        ("ops_sync_threads", SyncPath::Lib),
    ] {
        g.bench_with_input(
            BenchmarkId::new(name, SYNC_THREADS),
            &SYNC_THREADS,
            |b, &threads| {
                b.iter_custom(|iters| {
                    (0..iters)
                        .map(|_| sync_throughput(&fx, threads, N, path).expect("waits"))
                        .sum::<Duration>()
                })
            },
        );
    }
    g.finish();
    c.final_summary();
}
