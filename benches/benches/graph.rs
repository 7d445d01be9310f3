//! `graph`: a chain of 100 empty kernels: eager through ops vs raw eager
//! launches; its graph replay through ops (`op.graph()`, `graph.launch()`)
//! vs a raw cudarc graph replay.
//!
//! Skips (exit 0) on a machine without a GPU.

use benches::measure::GRAPH_NODES;
use criterion::{Criterion, Throughput};

fn main() {
    let Some(fx) = benches::bench_fixture() else {
        return;
    };
    let graph = fx.raw_graph(GRAPH_NODES).expect("graph capture");
    let ours = fx
        .lib_graph(GRAPH_NODES)
        .expect("graph capture through ops");
    let mut c = Criterion::default().configure_from_args();
    let mut g = c.benchmark_group("graph");
    g.throughput(Throughput::Elements(GRAPH_NODES as u64));
    g.bench_function("raw_graph_replay_100", |b| {
        b.iter(|| graph.replay_sync().unwrap())
    });
    g.bench_function("raw_eager_100", |b| {
        b.iter(|| fx.raw_eager(GRAPH_NODES).unwrap())
    });
    g.bench_function("ops_eager_100", |b| {
        b.iter(|| fx.lib_eager(GRAPH_NODES).unwrap())
    });
    g.bench_function("ops_graph_replay_100", |b| {
        b.iter(|| fx.lib_replay(&ours).unwrap())
    });
    g.finish();
    c.final_summary();
}
