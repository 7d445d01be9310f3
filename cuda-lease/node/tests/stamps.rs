//! The stamps of a submission's path: one awaited op on an embedded node
//! (the memory device) reaches every point, in path order. Alone in its
//! binary: the stamps are process-wide.

mod common;

use common::*;
use cuda_async::prelude::*;
use cuda_lease::stamps::{self, Point};

#[test]
fn one_awaited_op_reaches_every_point_in_order() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let fx = Fixture::memory(1 << 20).lease(1 << 16).start().await;
        let policy = fx.policy();
        stamps::set_enabled(true);
        stamps::clear();
        stamps::stamp(Point::Start);
        let out = h2d(vec![7u8; 64])
            .then(d2h)
            .schedule(&policy)
            .unwrap()
            .await
            .unwrap();
        stamps::stamp(Point::End);
        let s = stamps::take();
        stamps::set_enabled(false);
        assert_eq!(out.to_vec().unwrap(), vec![7u8; 64]);

        let missing: Vec<&str> = Point::ALL
            .iter()
            .filter(|p| s.at(**p).is_none())
            .map(|p| p.name())
            .collect();
        assert!(missing.is_empty(), "points not reached: {missing:?}");
        // Path order: each point is stamped after the one before it
        // happened (the `sent` points before their writes start).
        for w in Point::ALL.windows(2) {
            assert!(
                s.at(w[0]) <= s.at(w[1]),
                "{} after {}: {s:?}",
                w[0].name(),
                w[1].name()
            );
        }
        fx.free_and_shutdown().await;
    });
}
