//! Where a remote row's time goes: the steps between the points
//! (`cuda_lease::stamps`) its submissions reached.

use cuda_lease::stamps::{Point, Stamps};

/// The reached points in path order, each with its time. A point
/// stamped before the one before it (by another submission, say) is
/// left out.
fn in_order(s: &Stamps) -> Vec<(Point, u64)> {
    let mut out: Vec<(Point, u64)> = Vec::new();
    for p in Point::ALL {
        if let Some(t) = s.at(p) {
            if out.last().is_none_or(|&(_, last)| t >= last) {
                out.push((p, t));
            }
        }
    }
    out
}

/// One step of a path: from one reached point to the next, its median
/// over the submissions that reached both in a row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Step {
    /// Where the step starts.
    pub(super) from: Point,
    /// Where it ends (the next point the submissions reached).
    pub(super) to: Point,
    /// The median time between the two, in microseconds.
    pub(super) median_us: f64,
    /// How many submissions had this step.
    pub(super) count: usize,
}

/// The steps of `runs` in path order: for each pair of consecutive points
/// the submissions reached, the median time between them. Steps that
/// fewer than half the runs had are left out (a point another submission
/// stamped meanwhile, say).
pub(super) fn steps(runs: &[Stamps]) -> Vec<Step> {
    let mut by_step: Vec<((Point, Point), Vec<u64>)> = Vec::new();
    for run in runs {
        for pair in in_order(run).windows(2) {
            let key = (pair[0].0, pair[1].0);
            let d = pair[1].1 - pair[0].1;
            match by_step.iter_mut().find(|(k, _)| *k == key) {
                Some((_, v)) => v.push(d),
                None => by_step.push((key, vec![d])),
            }
        }
    }
    let mut out: Vec<Step> = by_step
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
        let s = steps(&runs);
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
            in_order(&odd).iter().map(|p| p.0).collect::<Vec<_>>(),
            [Point::Start, Point::NodeStart, Point::End]
        );
        let plain = run(&[(Point::Start, 0), (Point::End, 7_000)]);
        let s = steps(&[plain, plain, plain, odd]);
        assert_eq!(s.len(), 1, "{s:?}");
        assert_eq!(
            (s[0].from, s[0].to, s[0].median_us),
            (Point::Start, Point::End, 7.0)
        );
    }
}
