//! The stamps of a submission's path: one awaited op on an embedded node
//! (the memory device) reaches every point of its path, in path order, on
//! a lease its worker serves directly (the default) and on the node's path. Alone in
//! its binary, one test at a time: the stamps are process-wide.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use cuda_async::prelude::*;
use cuda_async::RemotePolicy;
use cuda_lease::client::Client;
use cuda_lease::stamps::{self, Point, Stamps};

/// The tests' turns: the stamps are process-wide.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The points only a lease served by its worker reaches.
const DIRECT_ONLY: [Point; 3] = [
    Point::DirectRead,
    Point::DirectHanded,
    Point::DirectAnswered,
];

/// The points only the node's path of a batch reaches.
const NODE_ONLY: [Point; 11] = [
    Point::NodeStart,
    Point::NodeRead,
    Point::BatchDecoded,
    Point::BatchInOrder,
    Point::BatchLocked,
    Point::BatchPrepared,
    Point::WorkerCall,
    Point::PipeReply,
    Point::WorkerReplied,
    Point::NodeCommitted,
    Point::NodeReplied,
];

/// One awaited upload and download on `policy`, stamped.
async fn stamped_op(policy: &RemotePolicy) -> Stamps {
    stamps::set_enabled(true);
    stamps::clear();
    stamps::stamp(Point::Start);
    let out = h2d(vec![7u8; 64])
        .then(d2h)
        .schedule(policy)
        .unwrap()
        .await
        .unwrap();
    stamps::stamp(Point::End);
    let s = stamps::take();
    stamps::set_enabled(false);
    assert_eq!(out.to_vec().unwrap(), vec![7u8; 64]);
    s
}

/// Every point but `skipped` was reached, each after the one before it
/// (the `sent` points before their writes start), and none of `skipped`.
fn assert_path(s: &Stamps, skipped: &[Point]) {
    let path: Vec<Point> = Point::ALL
        .into_iter()
        .filter(|p| !skipped.contains(p))
        .collect();
    // The names of `points` that were reached (or not).
    let named = |points: &[Point], reached: bool| -> Vec<&str> {
        points
            .iter()
            .filter(|p| s.at(**p).is_some() == reached)
            .map(|p| p.name())
            .collect()
    };
    let missing = named(&path, false);
    assert!(missing.is_empty(), "points not reached: {missing:?}");
    let strays = named(skipped, true);
    assert!(strays.is_empty(), "points off the path reached: {strays:?}");
    for w in path.windows(2) {
        assert!(
            s.at(w[0]) <= s.at(w[1]),
            "{} after {}: {s:?}",
            w[0].name(),
            w[1].name()
        );
    }
}

#[test]
fn one_awaited_op_on_the_nodes_path_reaches_every_point_in_order() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let fx = Fixture::node_path(1 << 20).lease(1 << 16).start().await;
        let s = stamped_op(&fx.policy()).await;
        assert_path(&s, &DIRECT_ONLY);
        fx.free_and_shutdown().await;
    });
}

#[test]
fn one_awaited_op_on_a_direct_lease_reaches_its_workers_points_in_order() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let fx = Fixture::memory(1 << 20).start().await;
        let client = Arc::new(
            Client::connect(fx.node.addr(), &client_config(&fx.node))
                .await
                .unwrap(),
        );
        let lease = lease_of(&client, 1 << 16).await;
        assert!(lease.is_direct());
        let s = stamped_op(&policy_of(&lease)).await;
        assert_path(&s, &NODE_ONLY);
        lease.free().await.unwrap();
        fx.shutdown().await;
    });
}
