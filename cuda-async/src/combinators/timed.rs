//! [`DeviceOpExt::timed`](crate::DeviceOpExt::timed): the GPU time of
//! what an op enqueues, between two events on its stream (on a leased
//! GPU, the node's two events, measured there).

use std::fmt;
use std::time::Duration;

use crate::context::{ExecutionContext, TimerPoints};
use crate::op::{impl_into_future, DeviceOp};
use crate::Result;

/// An op that also measures, on the GPU, the time its work takes:
/// [`DeviceOpExt::timed`](crate::DeviceOpExt::timed).
#[must_use = "ops do nothing until executed"]
pub struct Timed<A> {
    op: A,
}

impl<A> Timed<A> {
    pub(crate) fn new(op: A) -> Self {
        Timed { op }
    }
}

impl<A> fmt::Debug for Timed<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Timed").finish_non_exhaustive()
    }
}

/// The GPU time between two points of a stream (the start and the end of
/// a [`timed`](crate::DeviceOpExt::timed) op), known once the stream has
/// passed the end.
pub struct GpuTime {
    points: TimerPoints,
}

impl fmt::Debug for GpuTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuTime").finish_non_exhaustive()
    }
}

impl GpuTime {
    /// The time between the two points, as the GPU measured it (about
    /// 0.5 us resolution). Waits for the stream to pass the end point if
    /// it has not yet; after the op's `.sync()` or `.await` it has.
    ///
    /// # Errors
    /// A driver error, named (a fault of the timed work, say).
    pub fn elapsed(&self) -> Result<Duration> {
        self.points.elapsed()
    }
}

impl<A: DeviceOp> DeviceOp for Timed<A> {
    type Output = (<A as DeviceOp>::Output, GpuTime);

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<<Self as DeviceOp>::Output> {
        let timer = ctx.timer_start()?;
        // SAFETY: same context and caller contract, forwarded.
        let out = unsafe { self.op.execute(ctx) }?;
        let points = ctx.timer_end(timer)?;
        Ok((out, GpuTime { points }))
    }
}

impl_into_future!(impl[A] for Timed<A> where A: DeviceOp);
