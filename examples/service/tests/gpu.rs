//! The service on a GPU (ignored here; the GPU bundle runs them): the
//! local pool, with and without batching and with graphs, the cudarc baseline, and a lease on an embedded node
//! of the same GPU, against the CPU reference and bit for bit against each
//! other.

mod common;

use common::*;
use cuda_async_service::model::{random, HostWeights, CLASSES, D_IN};

/// 64 samples through a running service, binary: the outputs.
fn outputs(svc: &Running, x: &[f32]) -> Vec<f32> {
    let (status, floats, body) = infer_binary(svc.addr, x);
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    floats
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn the_service_answers_on_the_local_gpu_and_on_a_lease_of_it_with_the_same_bits() {
    let n = 64;
    let x = random(n * D_IN, 9, 1.0);
    let want = HostWeights::random(1).reference(&x, n);
    let local = Running::with(&["--graphs", "0"]);
    let here = outputs(&local, &x);
    assert_eq!(here.len(), n * CLASSES);
    assert_close(&here, &want);
    assert!(local.stop().success());

    // Batches replay graphs too (by default).
    let batched = Running::with(&["--batch-window-us", "500"]);
    assert_close(&outputs(&batched, &x), &want);
    assert!(batched.stop().success());

    // Graphs (the default): two requests of one size replay one graph;
    // three samples replay a graph of four, its padding column dropped.
    let graphs = Running::with(&["--graphs", "1"]);
    let replayed = outputs(&graphs, &x);
    assert_close(&replayed, &want);
    assert_eq!(outputs(&graphs, &x), replayed, "a second replay differs");
    let three = outputs(&graphs, &x[..3 * D_IN]);
    assert_eq!(three.len(), 3 * CLASSES);
    assert_close(&three, &want[..3 * CLASSES]);
    assert!(graphs.stop().success());

    let baseline = Running::with(&["--baseline"]);
    assert_close(&outputs(&baseline, &x), &want);
    assert!(baseline.stop().success());

    let leased = Running::with(&["--lease", "embedded", "--embedded-device", "cuda"]);
    let there = outputs(&leased, &x);
    assert_eq!(here, there, "local and leased differ");
    assert!(leased.stop().success());
}
