//! [`Spread`]: the devices of a [`DevicePool`](crate::DevicePool) that a
//! submission's concurrent arms may go to, which its execution context
//! carries, and the in-flight count of each device.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cuda_core::Result;

use crate::context::ExecutionContext;
use crate::policy::{SchedulingPolicy, StreamPoolRoundRobin};

/// One device of a pool: its policy and its submissions in flight.
pub(crate) struct Member {
    pub(crate) policy: StreamPoolRoundRobin,
    pub(crate) in_flight: Arc<AtomicUsize>,
}

impl Member {
    /// A context on this device's pool, counted in flight here until the
    /// submission that retains it is done.
    pub(crate) fn context(&self) -> Result<ExecutionContext> {
        let mut ctx = self.policy.select()?;
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        ctx.retain(InFlight(self.in_flight.clone()));
        Ok(ctx)
    }
}

/// The devices a submission's concurrent arms may go to (a
/// [`DevicePool`](crate::DevicePool) with
/// [`DevicePool::spread_arms`](crate::DevicePool::spread_arms)), and the
/// index of the context's own.
#[derive(Clone)]
pub(crate) struct Spread {
    pub(crate) members: Arc<[Member]>,
    pub(crate) home: usize,
}

impl Spread {
    /// The context of concurrent arm `arm` (>= 1) when it goes to another
    /// device than its parent's: arm k of a submission on device i runs on
    /// device (i + k) mod n, on that device's next pool stream, counted in
    /// flight there until the submission is done. `None`: the arm stays on
    /// the parent's device.
    pub(crate) fn arm_context(&self, arm: usize) -> Option<Result<ExecutionContext>> {
        let target = (self.home + arm) % self.members.len();
        if target == self.home {
            return None;
        }
        Some(self.members[target].context().map(|ctx| {
            ctx.with_spread(Spread {
                members: self.members.clone(),
                home: target,
            })
        }))
    }
}

/// Counts a submission in flight on its device until dropped (it is
/// retained by the submission's context, so dropped once the GPU has
/// passed the work).
struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_flight_counts_drop_with_the_submission() {
        let n = Arc::new(AtomicUsize::new(1));
        drop(InFlight(n.clone()));
        assert_eq!(n.load(Ordering::Relaxed), 0);
    }
}
