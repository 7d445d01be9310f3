//! The lease table with an injected clock: grant, renew, expiry,
//! generation, capacity.

use std::time::Duration;

use cuda_lease::clock::{Clock, ManualClock};
use cuda_lease::proto::{LeaseId, LeaseState, Status};
use cuda_lease_node::lease_table::LeaseTable;

const S: Duration = Duration::from_secs(1);

fn table() -> (LeaseTable<u32>, ManualClock) {
    (
        LeaseTable::new(1000, Duration::from_secs(3600)),
        ManualClock::new(),
    )
}

#[test]
fn grant_renew_generation_and_expiry() {
    let (mut t, clock) = table();
    let id = LeaseId::random();
    let g = t
        .grant(id, 100, 10 * S, clock.now(), None, None, 7)
        .unwrap();
    assert_eq!((g.generation, g.reserved, g.deadline), (1, 100, 10 * S));
    clock.advance(5 * S);
    let g = t.renew(&id, 10 * S, clock.now()).unwrap();
    assert_eq!((g.generation, g.deadline), (2, 15 * S));
    // Renewing with a shorter TTL never shortens the lease.
    let g = t.renew(&id, S, clock.now()).unwrap();
    assert_eq!((g.generation, g.deadline), (3, 15 * S));
    clock.advance(9 * S);
    assert_eq!(t.get(&id, clock.now()).unwrap(), 7);
    assert!(t.expire(clock.now()).is_empty());
    clock.advance(S);
    // At the deadline: refused before the reaper runs, then reaped.
    assert_eq!(
        t.get(&id, clock.now()).unwrap_err().status,
        Status::LeaseExpired
    );
    assert_eq!(t.expire(clock.now()), vec![(id, 7)]);
    assert_eq!(t.reservable(), 1000);
    assert_eq!(
        t.renew(&id, S, clock.now()).unwrap_err().status,
        Status::LeaseExpired
    );
    assert_eq!(
        t.status(&id, clock.now()).unwrap_err().status,
        Status::LeaseExpired
    );
    assert_eq!(t.forget(&id).unwrap_err().status, Status::LeaseExpired);
}

#[test]
fn ttl_is_capped() {
    let mut t: LeaseTable<()> = LeaseTable::new(10, Duration::from_secs(60));
    let g = t
        .grant(
            LeaseId::random(),
            1,
            1000 * S,
            Duration::ZERO,
            None,
            None,
            (),
        )
        .unwrap();
    assert_eq!(g.deadline, 60 * S);
}

#[test]
fn capacity_of_table_and_lease() {
    let (mut t, clock) = table();
    let a = LeaseId::random();
    t.grant(a, 600, 10 * S, clock.now(), None, None, 1).unwrap();
    let err = t
        .grant(LeaseId::random(), 500, 10 * S, clock.now(), None, None, 2)
        .unwrap_err();
    assert_eq!(err.status, Status::CapacityExceeded);
    assert_eq!(t.reservable(), 400);
    t.set_allocated(&a, 600);
    assert_eq!(t.allocated_total(), 600);
    assert_eq!(
        t.grant(LeaseId::random(), 0, S, clock.now(), None, None, 3)
            .unwrap_err()
            .status,
        Status::BadRequest
    );
}

#[test]
fn reservations_never_exceed_device_free_memory() {
    let (mut t, clock) = table();
    let a = LeaseId::random();
    t.grant(a, 300, 10 * S, clock.now(), Some(900), None, 1)
        .unwrap();
    // The device has 500 free, of which 300 are promised to A (unallocated).
    let err = t
        .grant(
            LeaseId::random(),
            300,
            10 * S,
            clock.now(),
            Some(500),
            None,
            2,
        )
        .unwrap_err();
    assert_eq!(err.status, Status::CapacityExceeded);
    t.grant(
        LeaseId::random(),
        200,
        10 * S,
        clock.now(),
        Some(500),
        None,
        3,
    )
    .unwrap();
    // Once A allocates, its memory is no longer free on the device nor outstanding.
    t.set_allocated(&a, 300);
    assert_eq!(t.outstanding(), 200);
}

#[test]
fn poison_remove_and_tombstones() {
    let (mut t, clock) = table();
    let a = LeaseId::random();
    let b = LeaseId::random();
    t.grant(a, 100, 10 * S, clock.now(), None, None, 1).unwrap();
    t.grant(b, 100, 10 * S, clock.now(), None, None, 2).unwrap();
    assert_eq!(t.poison(&a, "illegal address", clock.now()), Some(1));
    assert_eq!(t.reservable(), 900);
    let err = t.get(&a, clock.now()).unwrap_err();
    assert_eq!(err.status, Status::LeasePoisoned);
    assert!(err.message.contains("lease poisoned: illegal address"));
    assert_eq!(
        t.status(&a, clock.now()).unwrap().state,
        LeaseState::Poisoned
    );
    assert!(t.forget(&a).unwrap());
    assert_eq!(
        t.get(&a, clock.now()).unwrap_err().status,
        Status::LeaseNotFound
    );
    assert_eq!(t.remove(&b, clock.now()), Some(2));
    assert_eq!(t.remove(&b, clock.now()), None);
    assert!(t.is_empty());
    // Tombstones are forgotten after a while.
    clock.advance(Duration::from_secs(601));
    t.expire(clock.now());
    assert!(!t.forget(&b).unwrap());
}
