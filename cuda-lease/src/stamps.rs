//! Time stamps at fixed points of a submission's path, cheap enough to leave
//! on while measuring: a stamp is one clock read and one atomic store; off
//! (the default), a point costs one relaxed load of a flag.
//!
//! Each [`Point`] keeps the last time any submission of the process reached
//! it, so the stamps describe one submission when the process runs one at a
//! time with the client and the node in it (an embedded node). The lease's
//! worker, another process, stamps its own points of a batch (from
//! [`Point::WorkerRead`] to [`Point::WorkerReplying`]) on the same clock when
//! the node's request asks, and returns them with its reply; the node enters
//! them ([`stamp_at`]). A lease its worker serves directly (LEASE_DIRECT)
//! stamps those and its own points ([`Point::DirectRead`],
//! [`Point::DirectHanded`], [`Point::DirectAnswered`]) when the client's
//! request asks ([`FLAG_STAMPS`](crate::proto::FLAG_STAMPS)); the client
//! enters them. A measurement turns stamping on ([`set_enabled`]),
//! [`clear`]s before each submission, stamps [`Point::Start`] and
//! [`Point::End`] itself around it, and [`take`]s the stamps.
//!
//! ```
//! use cuda_lease::stamps::{self, Point};
//! stamps::set_enabled(true);
//! let mut runs = Vec::new();
//! for _ in 0..3 {
//!     stamps::clear();
//!     stamps::stamp(Point::Start);
//!     // ... await one submission on a lease of an embedded node ...
//!     stamps::stamp(Point::End);
//!     runs.push(stamps::take());
//! }
//! stamps::set_enabled(false);
//! let (start, end) = (runs[0].at(Point::Start), runs[0].at(Point::End));
//! assert!(start <= end);
//! ```

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Nanoseconds on the host's monotonic clock (`CLOCK_MONOTONIC`): the
/// clock of every stamp, the same in every process of the host.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC exists on
    // every Linux kernel this crate runs on.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

/// Declares [`Point`], its [`Point::ALL`] and its [`Point::name`]s.
macro_rules! points {
    ($($(#[$doc:meta])* $point:ident = $name:literal,)*) => {
        /// The points of a submission's path, in the order a submission reaches them.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum Point {
            $($(#[$doc])* $point,)*
        }

        impl Point {
            /// Every point, in path order.
            pub const ALL: [Point; POINTS] = [$(Point::$point,)*];

            /// A short name (`node-read`, say).
            pub fn name(self) -> &'static str {
                match self {
                    $(Point::$point => $name,)*
                }
            }
        }
    };
}

points! {
    /// The measurement's own start (stamped by the caller).
    Start = "start",
    /// The lease's session takes the recording (the op's first poll recorded it).
    ClientSubmit = "client-submit",
    /// The recording is encoded as one message and numbered in the lease's
    /// order (its stream is opened next).
    ClientEncoded = "client-encoded",
    /// The request's stream is open and its write starts (stamped before the
    /// write so every node point follows it: the bytes may reach the node first).
    ClientSent = "client-sent",
    /// The node's task for the request's stream starts (the request crossed the wire).
    NodeStart = "node-start",
    /// The node has read the request whole.
    NodeRead = "node-read",
    /// The node has decoded the BATCH's head and checked its modules.
    BatchDecoded = "batch-decoded",
    /// The lease's earlier batches have run (the batch's turn in the lease's order).
    BatchInOrder = "batch-in-order",
    /// The node holds the lease's execution lock.
    BatchLocked = "batch-locked",
    /// The node has settled the batch's modules and held its reply's
    /// bytes (the lease's worker checks and plans its commands).
    BatchPrepared = "batch-prepared",
    /// The node's call to the lease's worker starts (the batch's commands as they came).
    WorkerCall = "worker-call",
    /// A lease served by its worker (LEASE_DIRECT): the worker has read
    /// the request whole (stamped by the worker).
    DirectRead = "direct-read",
    /// The worker has checked the batch and handed it to its device loop
    /// (stamped by the worker, direct leases).
    DirectHanded = "direct-handed",
    /// The worker has read the batch's header from its pipe (stamped by the worker).
    WorkerRead = "worker-read",
    /// The worker has decoded the batch and planned it against the lease
    /// (stamped by the worker).
    WorkerPlanned = "worker-planned",
    /// The worker has enqueued the batch's commands on the device
    /// (stamped by the worker; sealing it comes next).
    WorkerLaunched = "worker-launched",
    /// The worker has enqueued and sealed the batch's commands (stamped by the worker).
    WorkerEnqueued = "worker-enqueued",
    /// The worker has seen the batch's work done (stamped by the worker).
    WorkerDone = "worker-done",
    /// The worker starts encoding and writing its reply (stamped by the worker).
    WorkerReplying = "worker-replying",
    /// The worker's reply to a batch on its direct path is in hand and its
    /// write starts (stamped by the worker, direct leases).
    DirectAnswered = "direct-answered",
    /// The node has read a reply of the worker from its pipe.
    PipeReply = "pipe-reply",
    /// The node has read the worker's reply.
    WorkerReplied = "worker-replied",
    /// The node has committed the batch's effects to the lease's state.
    NodeCommitted = "node-committed",
    /// The node's reply is encoded and its QUIC write starts (see [`Point::ClientSent`]).
    NodeReplied = "node-replied",
    /// The client has read the reply's header (the reply crossed the wire).
    ClientReply = "client-reply",
    /// The client has read and checked the whole reply.
    ClientReplyRead = "client-reply-read",
    /// The submission's reads are delivered; its completion is signalled next.
    ClientDone = "client-done",
    /// The measurement's end: the awaited output is in hand (stamped by the caller).
    End = "end",
}

/// How many [`Point`]s there are.
pub const POINTS: usize = Point::End as usize + 1;

/// The points a lease's worker stamps a batch at, in the order its reply
/// carries their times (a time of 0: a point it did not reach). A direct
/// reply's stamps are these between [`Point::DirectHanded`] and
/// [`Point::DirectAnswered`].
pub const WORKER_POINTS: [Point; 6] = [
    Point::WorkerRead,
    Point::WorkerPlanned,
    Point::WorkerLaunched,
    Point::WorkerEnqueued,
    Point::WorkerDone,
    Point::WorkerReplying,
];

static ENABLED: AtomicBool = AtomicBool::new(false);
static AT: [AtomicU64; POINTS] = [const { AtomicU64::new(0) }; POINTS];

/// Turns stamping on or off for the whole process.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Records that a submission reached `point` now (when stamping is on).
#[inline]
pub fn stamp(point: Point) {
    if ENABLED.load(Ordering::Relaxed) {
        // Never 0: 0 means not reached.
        AT[point as usize].store(now_ns().max(1), Ordering::Relaxed);
    }
}

/// Whether stamping is on in this process.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Records that a submission reached `point` at `ns` (a [`now_ns`] time,
/// taken by another process of the host), when stamping is on.
pub fn stamp_at(point: Point, ns: u64) {
    if enabled() {
        AT[point as usize].store(ns.max(1), Ordering::Relaxed);
    }
}

/// Forgets every point's time.
pub fn clear() {
    for at in &AT {
        at.store(0, Ordering::Relaxed);
    }
}

/// The points' times (nanoseconds on the host's monotonic clock; `None`
/// for a point not reached since the last [`clear`]), then [`clear`]s.
pub fn take() -> Stamps {
    Stamps(std::array::from_fn(|i| {
        let ns = AT[i].swap(0, Ordering::Relaxed);
        (ns != 0).then_some(ns)
    }))
}

/// The times of one submission's points (see [`take`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stamps(pub [Option<u64>; POINTS]);

impl Stamps {
    /// When `point` was reached, in nanoseconds on the host's clock.
    pub fn at(&self, point: Point) -> Option<u64> {
        self.0[point as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_are_taken_once_and_only_when_enabled() {
        // One test touches the process-wide stamps, so none races it.
        set_enabled(false);
        clear();
        stamp(Point::NodeRead);
        assert_eq!(take().at(Point::NodeRead), None);
        set_enabled(true);
        stamp(Point::NodeRead);
        set_enabled(false);
        assert!(take().at(Point::NodeRead).is_some());
        assert_eq!(take().at(Point::NodeRead), None, "take clears");
    }
}
