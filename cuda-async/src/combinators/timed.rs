//! [`DeviceOpExt::timed`](crate::DeviceOpExt::timed): the GPU time of
//! what an op enqueues, between two events on its stream (on a leased
//! GPU, the node's two events, measured there).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use cuda_core::cudarc::driver::{sys, CudaEvent};

use crate::context::ExecutionContext;
use crate::host::ReadSlot;
use crate::op::{impl_into_future, DeviceOp};
use crate::remote::{Id, Op};
use crate::{Error, Result};

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
    points: Points,
}

enum Points {
    /// Two events of the local stream.
    Local { start: CudaEvent, end: CudaEvent },
    /// The nanoseconds the node measured, in the reply.
    Remote(Arc<ReadSlot>),
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
        let (start, end) = match &self.points {
            Points::Local { start, end } => (start, end),
            Points::Remote(slot) => {
                let ns = slot
                    .bytes()
                    .and_then(|b| <[u8; 8]>::try_from(b).ok())
                    .ok_or_else(|| {
                        Error::InvalidArgument("the node's GPU time has not arrived".into())
                    })?;
                return Ok(Duration::from_nanos(u64::from_le_bytes(ns)));
            }
        };
        end.synchronize()
            .map_err(|e| Error::driver("cuEventSynchronize", e))?;
        let ms = start
            .elapsed_ms(end)
            .map_err(|e| Error::driver("cuEventElapsedTime", e))?;
        Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
    }
}

impl<A: DeviceOp> DeviceOp for Timed<A> {
    type Output = (<A as DeviceOp>::Output, GpuTime);

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<<Self as DeviceOp>::Output> {
        if let Some(r) = ctx.as_remote() {
            // The node starts a timer, runs the op's commands, ends the
            // timer and puts the nanoseconds in the reply.
            let (stream, timer) = (r.stream(), r.session().fresh_id());
            r.recording()
                .push(stream, Op::TimerStart { timer: Id(timer) });
            // SAFETY: same context and caller contract, forwarded.
            let out = unsafe { self.op.execute(ctx) }?;
            let r = ctx
                .as_remote()
                .ok_or_else(|| Error::InvalidArgument("timed: the op left the lease".into()))?;
            let slot = r.recording().timer_end(stream, timer);
            let points = Points::Remote(slot);
            return Ok((out, GpuTime { points }));
        }
        let stream = ctx.cuda_stream_for("timed (GPU timing)")?.clone();
        if cuda_core::graph::is_capturing(&stream)? {
            return Err(Error::Capture(
                "timed() cannot be captured into a graph: time a graph's launch instead".into(),
            ));
        }
        let event = || {
            stream
                .context()
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| Error::driver("cuEventCreate", e))
        };
        let (start, end) = (event()?, event()?);
        start
            .record(&stream)
            .map_err(|e| Error::driver("cuEventRecord", e))?;
        // SAFETY: same context and caller contract, forwarded.
        let out = unsafe { self.op.execute(ctx) }?;
        // Work the op forked onto other streams has joined this one.
        end.record(&stream)
            .map_err(|e| Error::driver("cuEventRecord", e))?;
        let points = Points::Local { start, end };
        Ok((out, GpuTime { points }))
    }
}

impl_into_future!(impl[A] for Timed<A> where A: DeviceOp);
