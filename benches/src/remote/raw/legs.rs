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

/// The points of a raw exchange, in the order it reaches them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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

/// For each leg after the first, the median time from the leg before it
/// over the `runs` that reached both in order, in microseconds (`None`
/// where fewer than half did).
pub fn medians(runs: &[[u64; 6]]) -> Vec<(Leg, Option<f64>)> {
    Leg::ALL
        .windows(2)
        .map(|w| {
            let (a, b) = (w[0] as usize, w[1] as usize);
            let mut d: Vec<u64> = runs
                .iter()
                .filter(|r| r[a] != 0 && r[b] >= r[a])
                .map(|r| r[b] - r[a])
                .collect();
            d.sort_unstable();
            let median = (!d.is_empty() && d.len() * 2 >= runs.len())
                .then(|| d[d.len() / 2] as f64 / 1000.0);
            (w[1], median)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_take_each_leg_from_the_one_before() {
        let runs = [
            [10, 20, 40, 41, 60, 70],
            [10, 22, 42, 44, 64, 80],
            [10, 24, 44, 45, 62, 72],
        ];
        let m = medians(&runs);
        let us: Vec<_> = m
            .iter()
            .map(|(_, v)| v.map(|v| (v * 1000.0).round() as u64))
            .collect();
        assert_eq!(us, [Some(12), Some(20), Some(1), Some(19), Some(10)]);
        assert_eq!(m[1].0, Leg::ServerRead);
    }

    #[test]
    fn a_leg_missing_in_most_runs_has_no_median() {
        let runs = [
            [10, 20, 0, 0, 60, 70],
            [10, 20, 30, 0, 60, 70],
            [10, 20, 0, 0, 60, 70],
        ];
        let m = medians(&runs);
        assert_eq!(m[1].1, None);
        assert_eq!(m[0].1, Some(0.01));
    }
}
