//! `zip`: two ~1 ms spin kernels: `zip` (concurrent arms) vs the two in
//! sequence vs raw two-stream fork/join, and one spin for reference.
//!
//! Skips (exit 0) on a machine without a GPU.

use criterion::Criterion;

fn main() {
    let Some(fx) = benches::bench_fixture() else {
        return;
    };
    let mut c = Criterion::default().configure_from_args();
    let mut g = c.benchmark_group("zip");
    g.sample_size(50);
    g.bench_function("raw_one_spin", |b| b.iter(|| fx.raw_spin().unwrap()));
    g.bench_function("ops_one_spin", |b| b.iter(|| fx.lib_spin().unwrap()));
    g.bench_function("ops_zip_two_spins", |b| b.iter(|| fx.lib_zip2().unwrap()));
    g.bench_function("ops_then_two_spins", |b| b.iter(|| fx.lib_seq2().unwrap()));
    g.bench_function("raw_fork_join_two_spins", |b| {
        b.iter(|| fx.raw_fork_join2().unwrap())
    });
    g.finish();
    c.final_summary();
}
