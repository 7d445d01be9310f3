//! `overhead`: one empty kernel, blocking: raw cudarc launch + synchronize
//! vs `op.sync_on(&s)` vs `op.sync()`; a trivial `value(..)` op; a 10-op
//! `then` chain vs 10 raw launches + one synchronize.
//!
//! Skips (exit 0) on a machine without a GPU.

use std::hint::black_box;

use criterion::Criterion;

fn main() {
    let Some(fx) = benches::bench_fixture() else {
        return;
    };
    let mut c = Criterion::default().configure_from_args();
    let mut g = c.benchmark_group("overhead");
    g.bench_function("raw_launch_sync", |b| {
        b.iter(|| fx.raw_launch_sync().unwrap())
    });
    g.bench_function("ops_sync_on", |b| b.iter(|| fx.lib_sync_on().unwrap()));
    g.bench_function("ops_sync", |b| b.iter(|| fx.lib_sync().unwrap()));
    g.bench_function("raw_idle_sync", |b| b.iter(|| fx.raw_idle_sync().unwrap()));
    g.bench_function("ops_value_sync", |b| {
        b.iter(|| black_box(fx.lib_value_sync(black_box(7)).unwrap()))
    });
    g.bench_function("raw_10_launches_1_sync", |b| {
        b.iter(|| fx.raw_chain10().unwrap())
    });
    g.bench_function("ops_10_op_then_chain", |b| {
        b.iter(|| fx.lib_chain10().unwrap())
    });
    g.finish();
    c.final_summary();
}
