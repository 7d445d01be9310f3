//! The token bucket behind per-source and per-principal rate limits.

use std::time::{Duration, Instant};

/// Tokens refilled at `rate` a second up to `burst`, taken one at a time.
#[derive(Debug, Clone, Copy)]
pub(super) struct TokenBucket {
    left: f64,
    at: Instant,
}

impl TokenBucket {
    /// A full bucket of `burst` tokens at `now`.
    pub(super) fn full(burst: f64, now: Instant) -> Self {
        Self {
            left: burst,
            at: now,
        }
    }

    fn refill(&mut self, rate: f64, burst: f64, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.left = (self.left + dt * rate).min(burst);
        self.at = now;
    }

    /// Takes a token; when none is left, how long until one is.
    pub(super) fn take(&mut self, rate: f64, burst: f64, now: Instant) -> Result<(), Duration> {
        self.refill(rate, burst, now);
        if self.left >= 1.0 {
            self.left -= 1.0;
            return Ok(());
        }
        let wait = if rate > 0.0 {
            (1.0 - self.left) / rate
        } else {
            f64::INFINITY
        };
        Err(Duration::try_from_secs_f64(wait).unwrap_or(Duration::MAX))
    }

    /// Takes a token now or reserves one due within `max_wait` (going into
    /// debt): `Ok(wait)`, or `Err` with how long until one is free.
    pub(super) fn take_within(
        &mut self,
        rate: f64,
        burst: f64,
        now: Instant,
        max_wait: Duration,
    ) -> Result<Duration, Duration> {
        match self.take(rate, burst, now) {
            Ok(()) => Ok(Duration::ZERO),
            Err(wait) if wait <= max_wait => {
                self.left -= 1.0;
                Ok(wait)
            }
            Err(wait) => Err(wait),
        }
    }

    /// Gives a token back (up to `burst`).
    pub(super) fn give_back(&mut self, rate: f64, burst: f64, now: Instant) {
        self.refill(rate, burst, now);
        self.left = (self.left + 1.0).min(burst);
    }

    /// Whether the bucket is full at `now` (so it can be forgotten).
    pub(super) fn is_full(&self, rate: f64, burst: f64, now: Instant) -> bool {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.left + dt * rate >= burst
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_gives_its_burst_then_its_rate() {
        let t0 = Instant::now();
        let mut b = TokenBucket::full(3.0, t0);
        for _ in 0..3 {
            b.take(10.0, 3.0, t0).unwrap();
        }
        let wait = b.take(10.0, 3.0, t0).unwrap_err();
        assert!((wait.as_secs_f64() - 0.1).abs() < 1e-9, "{wait:?}");
        // 0.25 s later: 2.5 tokens, 2 taken.
        let t1 = t0 + Duration::from_millis(250);
        b.take(10.0, 3.0, t1).unwrap();
        b.take(10.0, 3.0, t1).unwrap();
        assert!(b.take(10.0, 3.0, t1).is_err());
        b.give_back(10.0, 3.0, t1);
        b.take(10.0, 3.0, t1).unwrap();
        assert!(!b.is_full(10.0, 3.0, t1));
        assert!(b.is_full(10.0, 3.0, t1 + Duration::from_secs(1)));
    }

    #[test]
    fn a_token_within_the_wait_is_reserved_and_later_ones_wait_longer() {
        let t0 = Instant::now();
        let mut b = TokenBucket::full(1.0, t0);
        let max = Duration::from_millis(250);
        assert_eq!(b.take_within(10.0, 1.0, t0, max), Ok(Duration::ZERO));
        let w1 = b.take_within(10.0, 1.0, t0, max).unwrap();
        let w2 = b.take_within(10.0, 1.0, t0, max).unwrap();
        assert!((w1.as_secs_f64() - 0.1).abs() < 1e-9, "{w1:?}");
        assert!((w2.as_secs_f64() - 0.2).abs() < 1e-9, "{w2:?}");
        // The next would wait 0.3 s: refused, told when to retry.
        let e = b.take_within(10.0, 1.0, t0, max).unwrap_err();
        assert!((e.as_secs_f64() - 0.3).abs() < 1e-9, "{e:?}");
    }
}
