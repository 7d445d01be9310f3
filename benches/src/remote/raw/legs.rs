//! Where a raw quinn request/reply's time goes: time stamps at the points
//! of [`RawQuinn`](super::RawQuinn)'s exchanges that match a lease's
//! (`cuda_lease::stamps`), on the same clock
//! ([`now_ns`]), so the two paths' wire legs
//! can be set side by side in one run.
//!
//! Off by default (a point then costs one relaxed load). Each [`Leg`]
//! keeps the last time any exchange reached it, so a measurement makes
//! its exchanges one at a time: [`clear`], one exchange, [`take`].
//!
//! ```
//! use benches::remote::raw::legs::{self, Leg};
//! legs::set_enabled(true);
//! legs::clear();
//! legs::stamp(Leg::Start);
//! // ... one raw request/reply ...
//! legs::stamp(Leg::End);
//! let at = legs::take();
//! assert!(at[Leg::Start as usize] <= at[Leg::End as usize]);
//! legs::set_enabled(false);
//! ```

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use cuda_lease::stamps::now_ns;

use super::super::steps::{in_order, Step};

/// The points of a raw exchange, in the order it reaches them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Leg {
    /// The measurement's own start (stamped by the caller).
    Start,
    /// The client's stream is open and its request's write starts (as a
    /// lease's `client-sent`).
    Sent,
    /// The server has read the request whole (as a direct lease's
    /// `direct-read`).
    ServerRead,
    /// The server's reply's write starts (as `direct-answered`).
    ServerReplying,
    /// The client has read the reply whole (as `client-reply`).
    ClientRead,
    /// The measurement's end: the caller has the result (stamped by the
    /// caller).
    End,
}

impl Leg {
    /// Every point, in order.
    pub const ALL: [Leg; 6] = [
        Leg::Start,
        Leg::Sent,
        Leg::ServerRead,
        Leg::ServerReplying,
        Leg::ClientRead,
        Leg::End,
    ];

    /// A short name (`server-read`, say).
    pub fn name(self) -> &'static str {
        match self {
            Leg::Start => "start",
            Leg::Sent => "sent",
            Leg::ServerRead => "server-read",
            Leg::ServerReplying => "server-replying",
            Leg::ClientRead => "client-read",
            Leg::End => "end",
        }
    }
}

static ENABLED: AtomicBool = AtomicBool::new(false);
static AT: [AtomicU64; 6] = [const { AtomicU64::new(0) }; 6];

/// Turns stamping on or off for every exchange of the process.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::SeqCst);
}

/// Stamps `leg` now, if stamping is on.
pub fn stamp(leg: Leg) {
    if ENABLED.load(Ordering::Relaxed) {
        AT[leg as usize].store(now_ns(), Ordering::SeqCst);
    }
}

/// Forgets every stamp.
pub fn clear() {
    for a in &AT {
        a.store(0, Ordering::SeqCst);
    }
}

/// The stamps since the last [`clear`], by [`Leg`] (0: not reached).
pub fn take() -> [u64; 6] {
    std::array::from_fn(|i| AT[i].load(Ordering::SeqCst))
}

/// The steps of `runs` (each a [`take`]): for each leg, the median time
/// from the leg reached before it (see the report's lease steps).
pub(in crate::remote) fn steps(runs: &[[u64; 6]]) -> Vec<Step<Leg>> {
    let reached: Vec<_> = runs
        .iter()
        .map(|at| in_order(Leg::ALL.map(|l| (l, Some(at[l as usize]).filter(|&t| t != 0)))))
        .collect();
    super::super::steps::steps(&reached)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `(to, median in ns)` of each step.
    fn ns(runs: &[[u64; 6]]) -> Vec<(Leg, u64)> {
        steps(runs)
            .iter()
            .map(|s| (s.to, (s.median_us * 1000.0).round() as u64))
            .collect()
    }

    #[test]
    fn medians_take_each_leg_from_the_one_before() {
        let runs = [
            [10, 20, 40, 41, 60, 70],
            [10, 22, 42, 44, 64, 80],
            [10, 24, 44, 45, 62, 72],
        ];
        let us: Vec<_> = ns(&runs).into_iter().map(|(_, v)| v).collect();
        assert_eq!(us, [12, 20, 1, 19, 10]);
        assert_eq!(steps(&runs)[1].to, Leg::ServerRead);
    }

    #[test]
    fn a_leg_missing_in_most_runs_has_no_median() {
        let runs = [
            [10, 20, 0, 0, 60, 70],
            [10, 20, 30, 0, 60, 70],
            [10, 20, 0, 0, 60, 70],
        ];
        let m = ns(&runs);
        assert!(m.iter().all(|&(to, _)| to != Leg::ServerRead), "{m:?}");
        assert_eq!(m[0], (Leg::Sent, 10));
    }
}
