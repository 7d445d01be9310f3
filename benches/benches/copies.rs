//! `copies`: 256 MiB pinned host-to-device and device-to-host copies:
//! `copy_h2d`/`copy_d2h` ops vs raw `cuMemcpyHtoDAsync`/`cuMemcpyDtoHAsync`
//! (criterion reports GB/s).
//!
//! Skips (exit 0) on a machine without a GPU.

use benches::measure::COPY_BYTES;
use criterion::{Criterion, Throughput};

fn main() {
    let Some(fx) = benches::bench_fixture() else {
        return;
    };
    let mut cp = fx
        .copies(COPY_BYTES)
        .expect("256 MiB pinned and device buffers");
    let mut c = Criterion::default().configure_from_args();
    let mut g = c.benchmark_group("copies");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(cp.bytes() as u64));
    g.bench_function("raw_h2d_256MiB", |b| b.iter(|| cp.raw_h2d().unwrap()));
    g.bench_function("ops_copy_h2d_256MiB", |b| b.iter(|| cp.lib_h2d().unwrap()));
    g.bench_function("raw_d2h_256MiB", |b| b.iter(|| cp.raw_d2h().unwrap()));
    g.bench_function("ops_copy_d2h_256MiB", |b| b.iter(|| cp.lib_d2h().unwrap()));
    g.finish();
    c.final_summary();
}
