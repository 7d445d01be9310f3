//! Order statistics of samples: medians and percentiles.
//!
//! Benchmarks on shared machines have long upper tails (preemption, driver
//! housekeeping), so every figure the report compares is a median, with the
//! 10th and 90th percentiles kept to show the spread.

/// The `p`-th percentile (`0.0..=100.0`) of `samples`, by linear
/// interpolation between the two nearest ranks of the sorted samples (the
/// definition of NumPy's default `percentile`).
///
/// Returns `None` for no samples or a `p` outside `0..=100`; NaN samples are
/// ignored.
///
/// # Examples
///
/// ```
/// use benches::stats::percentile;
/// assert_eq!(percentile(&[4.0, 1.0, 3.0, 2.0], 50.0), Some(2.5));
/// assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0, 5.0], 75.0), Some(4.0));
/// ```
pub fn percentile(samples: &[f64], p: f64) -> Option<f64> {
    if !(0.0..=100.0).contains(&p) {
        return None;
    }
    let mut v: Vec<f64> = samples.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let rank = p / 100.0 * (v.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    let frac = rank - lo as f64;
    Some(v[lo] + (v[hi] - v[lo]) * frac)
}

/// The median of `samples` (the mean of the two middle ones for an even
/// count); `None` for no samples.
///
/// # Examples
///
/// ```
/// assert_eq!(benches::stats::median(&[5.0, 1.0, 3.0]), Some(3.0));
/// ```
pub fn median(samples: &[f64]) -> Option<f64> {
    percentile(samples, 50.0)
}

/// Median and spread of one measured path.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    /// The median.
    pub median: f64,
    /// The 10th percentile.
    pub p10: f64,
    /// The 90th percentile.
    pub p90: f64,
    /// How many samples.
    pub n: usize,
}

impl Summary {
    /// Summarises `samples`; `None` when there are none.
    ///
    /// # Examples
    ///
    /// ```
    /// let s = benches::stats::Summary::of(&[1.0, 2.0, 3.0, 4.0, 100.0]).unwrap();
    /// assert_eq!((s.median, s.n), (3.0, 5));
    /// ```
    pub fn of(samples: &[f64]) -> Option<Self> {
        let n = samples.iter().filter(|x| !x.is_nan()).count();
        Some(Summary {
            median: median(samples)?,
            p10: percentile(samples, 10.0)?,
            p90: percentile(samples, 90.0)?,
            n,
        })
    }

    /// Every statistic multiplied by `k` (e.g. a per-replay time to a
    /// per-node time).
    pub fn scaled(self, k: f64) -> Self {
        Summary {
            median: self.median * k,
            p10: self.p10 * k,
            p90: self.p90 * k,
            n: self.n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[7.0]), Some(7.0));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn median_ignores_nan_and_is_robust_to_outliers() {
        assert_eq!(median(&[1.0, f64::NAN, 2.0, 3.0]), Some(2.0));
        assert_eq!(median(&[f64::NAN]), None);
        assert_eq!(median(&[10.0, 11.0, 12.0, 1e9]), Some(11.5));
    }

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let v: Vec<f64> = (1..=11).map(f64::from).collect(); // 1..=11
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 100.0), Some(11.0));
        assert_eq!(percentile(&v, 10.0), Some(2.0));
        assert_eq!(percentile(&v, 90.0), Some(10.0));
        assert_eq!(percentile(&v, 25.0), Some(3.5));
        let w = [1.0, 2.0];
        assert_eq!(percentile(&w, 75.0), Some(1.75));
    }

    #[test]
    fn percentiles_reject_out_of_range_p_and_do_not_depend_on_order() {
        assert_eq!(percentile(&[1.0], -1.0), None);
        assert_eq!(percentile(&[1.0], 100.5), None);
        let a = [5.0, 3.0, 9.0, 1.0, 7.0];
        let b = [1.0, 3.0, 5.0, 7.0, 9.0];
        for p in [0.0, 10.0, 33.0, 50.0, 90.0, 100.0] {
            assert_eq!(percentile(&a, p), percentile(&b, p));
        }
    }

    #[test]
    fn summary_orders_its_statistics() {
        let v: Vec<f64> = (0..1000).map(|i| ((i * 7919) % 1000) as f64).collect();
        let s = Summary::of(&v).unwrap();
        assert!(s.p10 <= s.median && s.median <= s.p90);
        assert_eq!(s.n, 1000);
        assert_eq!(s.scaled(0.5).median, s.median * 0.5);
        assert!(Summary::of(&[]).is_none());
    }
}
