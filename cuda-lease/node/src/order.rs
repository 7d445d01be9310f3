//! A lease's order of numbered batches ([`Batch::seq`](crate::proto::Batch)):
//! each runs after every lower number, whatever the arrival order. No
//! clock: a batch (or a transfer following one) waits while its
//! predecessors can still come, and fails only when the lease ended or the
//! carrying connection closed with a predecessor missing (read requests
//! always run to their end, so only a number that never arrived stalls).

use std::collections::BTreeSet;

use tokio::sync::watch;

/// Where a lease's numbered batches stand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OrderState {
    /// The next number to run: every lower one has run.
    next: u64,
    /// Numbers at or above `next` on the node (read, waiting or running).
    arrived: BTreeSet<u64>,
    /// The connection that carries the lease's batches.
    session: Session,
    /// The lease is gone (freed, expired or failed).
    ended: bool,
}

/// The connection a lease's numbered batches come on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Session {
    /// No batch yet: one may still come on any connection.
    Unknown,
    /// Open, by the connection's stable id.
    Open(usize),
    /// It closed: numbers that have not arrived never will.
    Closed,
}

/// Why a wait for earlier batches ended without them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Stalled {
    /// The lease is gone.
    Ended,
    /// Batch `missing` never arrived and the carrying connection closed.
    Disconnected {
        /// The first number that never came.
        missing: u64,
    },
}

/// What arriving with a number means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arrival {
    /// The number is ahead (or next): the batch waits for its turn.
    InLine,
    /// The number has run, or another batch of it is on the node.
    Passed,
}

impl Default for OrderState {
    fn default() -> Self {
        OrderState {
            next: 1,
            arrived: BTreeSet::new(),
            session: Session::Unknown,
            ended: false,
        }
    }
}

impl OrderState {
    /// Batch `seq` arrived on connection `conn`.
    pub(crate) fn arrive(&mut self, seq: u64, conn: usize) -> Arrival {
        if !self.ended {
            self.session = Session::Open(conn);
        }
        if seq < self.next || !self.arrived.insert(seq) {
            return Arrival::Passed;
        }
        Arrival::InLine
    }

    /// Batch `seq` leaves. With `ran` (ran or refused in its turn) the order
    /// moves on; otherwise it no longer counts as arrived.
    pub(crate) fn leave(&mut self, seq: u64, ran: bool) {
        self.arrived.remove(&seq);
        if ran && self.next == seq {
            self.next = seq + 1;
            let next = self.next;
            self.arrived.retain(|s| *s >= next);
        }
    }

    pub(crate) fn closed(&mut self, conn: usize) {
        if self.session == Session::Open(conn) {
            self.session = Session::Closed;
        }
    }

    /// The lease is gone: every wait ends.
    pub(crate) fn end(&mut self) {
        self.ended = true;
    }

    /// Whether every number below `upto` has run (`Ok(true)`), may still
    /// (`Ok(false)`), or never will.
    pub(crate) fn reached(&self, upto: u64) -> Result<bool, Stalled> {
        if self.next >= upto {
            return Ok(true);
        }
        if self.ended {
            return Err(Stalled::Ended);
        }
        if self.session == Session::Closed {
            let missing = self.first_missing();
            if missing < upto {
                return Err(Stalled::Disconnected { missing });
            }
        }
        Ok(false)
    }

    /// The lowest number at or above `next` that is not on the node.
    fn first_missing(&self) -> u64 {
        let mut m = self.next;
        for s in self.arrived.range(self.next..) {
            if *s != m {
                break;
            }
            m += 1;
        }
        m
    }
}

/// A lease's [`OrderState`], shared with the requests that wait on it.
#[derive(Debug, Default)]
pub(crate) struct LeaseOrder(watch::Sender<OrderState>);

impl LeaseOrder {
    /// Whether no numbered batch has come yet.
    pub(crate) fn untouched(&self) -> bool {
        let s = self.0.borrow();
        s.next == 1 && s.arrived.is_empty()
    }

    /// Changes the state and wakes the waiters.
    pub(crate) fn update(&self, f: impl FnOnce(&mut OrderState)) {
        self.0.send_modify(f);
    }

    /// Waits, unbounded, until every number below `upto` has run.
    pub(crate) async fn reached(&self, upto: u64) -> Result<(), Stalled> {
        let mut rx = self.0.subscribe();
        let mut outcome = Ok(());
        // The sender lives as long as `self`, so it cannot close under us.
        let _ = rx
            .wait_for(|s| match s.reached(upto) {
                Ok(done) => done,
                Err(e) => {
                    outcome = Err(e);
                    true
                }
            })
            .await;
        outcome
    }

    /// Batch `seq` arrived on `conn`: its [`Place`], held until dropped.
    pub(crate) fn arrive(&self, seq: u64, conn: usize) -> (Arrival, Place<'_>) {
        let mut arrival = Arrival::Passed;
        self.update(|s| arrival = s.arrive(seq, conn));
        let place = Place {
            order: self,
            seq,
            held: arrival == Arrival::InLine,
            ran: false,
        };
        (arrival, place)
    }
}

/// A batch's place in its lease's order; on drop the batch leaves.
#[derive(Debug)]
pub(crate) struct Place<'a> {
    order: &'a LeaseOrder,
    seq: u64,
    held: bool,
    ran: bool,
}

impl Place<'_> {
    pub(crate) async fn turn(&mut self) -> Result<(), Stalled> {
        self.order.reached(self.seq).await?;
        self.ran = true;
        Ok(())
    }

    /// The batch will be resent: gives up its turn and its arrival.
    pub(crate) fn withdraw(mut self) {
        self.ran = false;
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        if self.held {
            let (seq, ran) = (self.seq, self.ran);
            self.order.update(|s| s.leave(seq, ran));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_run_in_number_order_whatever_order_they_arrive_in() {
        let mut s = OrderState::default();
        assert_eq!(s.arrive(3, 1), Arrival::InLine);
        assert_eq!(s.arrive(2, 1), Arrival::InLine);
        assert_eq!(s.reached(2), Ok(false));
        assert_eq!(s.reached(1), Ok(true));
        assert_eq!(s.arrive(1, 1), Arrival::InLine);
        s.leave(1, true);
        assert_eq!(s.reached(2), Ok(true));
        assert_eq!(s.reached(3), Ok(false));
        // Leaving out of turn moves nothing.
        s.leave(3, true);
        assert_eq!(s.reached(3), Ok(false));
        s.leave(2, true);
        assert_eq!(s.reached(3), Ok(true));
        assert_eq!(s.arrive(2, 1), Arrival::Passed);
        // A second batch of a number on the node does not take its place.
        assert_eq!(s.arrive(4, 1), Arrival::InLine);
        assert_eq!(s.arrive(4, 1), Arrival::Passed);
    }

    #[test]
    fn a_slow_predecessor_is_waited_for_however_long_it_takes() {
        let mut s = OrderState::default();
        s.arrive(1, 1);
        s.arrive(2, 1);
        // No clock: only the predecessor leaving moves the follower.
        for _ in 0..1000 {
            assert_eq!(s.reached(2), Ok(false));
        }
        s.leave(1, true);
        assert_eq!(s.reached(2), Ok(true));
    }

    #[test]
    fn a_missing_predecessor_fails_followers_once_its_connection_closed() {
        let mut s = OrderState::default();
        s.arrive(2, 7);
        s.arrive(4, 7);
        s.closed(8);
        assert_eq!(s.reached(4), Ok(false), "another connection closed");
        s.closed(7);
        assert_eq!(s.reached(2), Err(Stalled::Disconnected { missing: 1 }));
        // Arrived predecessors still run: a follower of them waits.
        let mut s = OrderState::default();
        s.arrive(1, 7);
        s.arrive(2, 7);
        s.arrive(4, 7);
        s.closed(7);
        assert_eq!(s.reached(2), Ok(false));
        assert_eq!(s.reached(3), Ok(false));
        assert_eq!(s.reached(4), Err(Stalled::Disconnected { missing: 3 }));
        s.leave(1, true);
        s.leave(2, true);
        assert_eq!(s.reached(3), Ok(true));
        // A batch arriving on a new connection reopens the session.
        s.arrive(3, 9);
        assert_eq!(s.reached(4), Ok(false));
    }

    #[test]
    fn a_withdrawn_batch_counts_as_missing_again() {
        let mut s = OrderState::default();
        s.arrive(1, 7);
        s.arrive(2, 7);
        s.leave(1, false);
        s.closed(7);
        assert_eq!(s.reached(2), Err(Stalled::Disconnected { missing: 1 }));
    }

    #[test]
    fn the_end_of_the_lease_ends_every_wait() {
        let mut s = OrderState::default();
        s.arrive(1, 7);
        s.arrive(2, 7);
        s.end();
        assert_eq!(s.reached(2), Err(Stalled::Ended));
        assert_eq!(s.reached(1), Ok(true));
    }

    #[tokio::test]
    async fn a_place_dropped_in_turn_lets_the_next_run() {
        let order = LeaseOrder::default();
        let (a2, mut p2) = order.arrive(2, 1);
        assert_eq!(a2, Arrival::InLine);
        let waiter = async {
            p2.turn().await.unwrap();
            drop(p2);
        };
        let first = async {
            let (_, mut p1) = order.arrive(1, 1);
            p1.turn().await.unwrap();
        };
        tokio::join!(waiter, first);
        assert_eq!(order.0.borrow().next, 3);
        // Withdrawn: the order does not move.
        let (_, mut p3) = order.arrive(3, 1);
        p3.turn().await.unwrap();
        p3.withdraw();
        assert_eq!(order.0.borrow().next, 3);
    }

    #[tokio::test]
    async fn ending_the_lease_wakes_a_waiter() {
        let order = LeaseOrder::default();
        let (_, mut p) = order.arrive(5, 1);
        let wait = p.turn();
        let end = async {
            tokio::task::yield_now().await;
            order.update(OrderState::end);
        };
        let (r, ()) = tokio::join!(wait, end);
        assert_eq!(r, Err(Stalled::Ended));
    }
}
