//! Where a remote row's time goes: the steps between the points its
//! submissions reached (`cuda_lease::stamps` for a lease's, the raw
//! references' [`legs`](super::raw::legs) for raw quinn's).

use cuda_lease::stamps::{Point, Stamps};

/// The points a run reached, given in path order with their times (`None`:
/// not reached), as (point, time) pairs. A point stamped before the one
/// before it (by another submission, say) is left out.
pub(super) fn in_order<P>(points: impl IntoIterator<Item = (P, Option<u64>)>) -> Vec<(P, u64)> {
    let mut out: Vec<(P, u64)> = Vec::new();
    for (p, t) in points {
        if let Some(t) = t {
            if out.last().is_none_or(|&(_, last)| t >= last) {
                out.push((p, t));
            }
        }
    }
    out
}

/// A lease submission's reached points ([`in_order`]).
fn stamped(s: &Stamps) -> Vec<(Point, u64)> {
    in_order(Point::ALL.map(|p| (p, s.at(p))))
}

/// One step of a path: from one reached point to the next, its median
/// over the submissions that reached both in a row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Step<P> {
    /// Where the step starts.
    pub(super) from: P,
    /// Where it ends (the next point the submissions reached).
    pub(super) to: P,
    /// The median time between the two, in microseconds.
    pub(super) median_us: f64,
    /// How many submissions had this step.
    pub(super) count: usize,
}

/// The steps of `runs` (each its reached points, [`in_order`]) in path
/// order: for each pair of consecutive points the runs reached, the median
/// time between them. Steps that fewer than half the runs had are left
/// out (a point another submission stamped meanwhile, say).
pub(super) fn steps<P: Copy + Ord>(runs: &[Vec<(P, u64)>]) -> Vec<Step<P>> {
    let mut by_step: Vec<((P, P), Vec<u64>)> = Vec::new();
    for run in runs {
        for pair in run.windows(2) {
            let key = (pair[0].0, pair[1].0);
            let d = pair[1].1 - pair[0].1;
            match by_step.iter_mut().find(|(k, _)| *k == key) {
                Some((_, v)) => v.push(d),
                None => by_step.push((key, vec![d])),
            }
        }
    }
    let mut out: Vec<Step<P>> = by_step
        .into_iter()
        .filter(|(_, v)| v.len() * 2 >= runs.len())
        .map(|((from, to), mut v)| {
            v.sort_unstable();
            Step {
                from,
                to,
                median_us: v[v.len() / 2] as f64 / 1000.0,
                count: v.len(),
            }
        })
        .collect();
    out.sort_by_key(|s| (s.from, s.to));
    out
}

/// The steps of a lease's stamped submissions ([`steps`]).
pub(super) fn lease_steps(runs: &[Stamps]) -> Vec<Step<Point>> {
    steps(&runs.iter().map(stamped).collect::<Vec<_>>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use cuda_lease::stamps::POINTS;

    fn run(points: &[(Point, u64)]) -> Stamps {
        let mut s = Stamps([None; POINTS]);
        for &(p, t) in points {
            s.0[p as usize] = Some(t);
        }
        s
    }

    #[test]
    fn steps_are_the_medians_between_consecutive_reached_points() {
        let runs = [
            run(&[
                (Point::Start, 0),
                (Point::ClientSent, 1_000),
                (Point::End, 5_000),
            ]),
            run(&[
                (Point::Start, 0),
                (Point::ClientSent, 3_000),
                (Point::End, 4_000),
            ]),
            run(&[
                (Point::Start, 0),
                (Point::ClientSent, 2_000),
                (Point::End, 9_000),
            ]),
        ];
        let s = lease_steps(&runs);
        assert_eq!(s.len(), 2);
        assert_eq!(
            (s[0].from, s[0].to, s[0].median_us),
            (Point::Start, Point::ClientSent, 2.0)
        );
        assert_eq!(
            (s[1].from, s[1].to, s[1].median_us),
            (Point::ClientSent, Point::End, 4.0)
        );
        assert_eq!(s[1].count, 3);
    }

    #[test]
    fn a_point_out_of_order_is_left_out_and_rare_steps_dropped() {
        // NodeRead stamped before NodeStart: another request's, left out.
        let odd = run(&[
            (Point::Start, 10),
            (Point::NodeStart, 20),
            (Point::NodeRead, 5),
            (Point::End, 40),
        ]);
        assert_eq!(
            stamped(&odd).iter().map(|p| p.0).collect::<Vec<_>>(),
            [Point::Start, Point::NodeStart, Point::End]
        );
        let plain = run(&[(Point::Start, 0), (Point::End, 7_000)]);
        let s = lease_steps(&[plain, plain, plain, odd]);
        assert_eq!(s.len(), 1, "{s:?}");
        assert_eq!(
            (s[0].from, s[0].to, s[0].median_us),
            (Point::Start, Point::End, 7.0)
        );
    }
}
