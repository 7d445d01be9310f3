//! The ordering primitives of an execution context: an event recorded
//! after work and waited for by other work, and GPU timers. Each is a
//! CUDA event locally and a client-named event or timer of the session
//! remotely.

use std::sync::Arc;
use std::time::Duration;

use cuda_core::cudarc::driver::{sys, CudaEvent, CudaStream};
use cuda_core::{Error, Result};

use super::ExecutionContext;
use crate::host::ReadSlot;
use crate::remote::{RemoteEvent, RemoteStream};

/// An event recorded after work on a context ([`ExecutionContext::record_done`]),
/// which work on other streams of the same backend can wait for.
#[derive(Clone)]
pub(crate) enum DoneEvent {
    Local(Arc<CudaEvent>),
    /// Freed on the session when the last clone goes.
    Remote(Arc<RemoteEvent>),
}

/// A started GPU timer ([`ExecutionContext::timer_start`]).
pub(crate) enum TimerStart {
    Local {
        stream: Arc<CudaStream>,
        start: CudaEvent,
        end: CudaEvent,
    },
    Remote {
        stream: RemoteStream,
        timer: u64,
    },
}

/// The two points of a timer ([`ExecutionContext::timer_end`]).
pub(crate) enum TimerPoints {
    /// Two events of the local stream.
    Local { start: CudaEvent, end: CudaEvent },
    /// The nanoseconds the node measured, in the reply.
    Remote(Arc<ReadSlot>),
}

impl TimerPoints {
    /// The GPU time between the points; waits for a local end event.
    pub(crate) fn elapsed(&self) -> Result<Duration> {
        let (start, end) = match self {
            TimerPoints::Local { start, end } => (start, end),
            TimerPoints::Remote(slot) => {
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

impl ExecutionContext {
    /// Records an event after the work enqueued (or recorded) so far.
    pub(crate) fn record_done(&mut self) -> Result<DoneEvent> {
        if let Some(r) = self.as_remote() {
            return Ok(DoneEvent::Remote(Arc::new(r.record_event())));
        }
        let ev = self
            .cuda_stream()?
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| Error::driver("cuEventRecord", e))?;
        Ok(DoneEvent::Local(Arc::new(ev)))
    }

    /// Makes later work on this context wait for `ev` (an event of this
    /// backend: the caller checks). A local event already complete orders
    /// nothing (and enqueues nothing).
    pub(crate) fn wait_done(&mut self, ev: &DoneEvent) -> Result<()> {
        match (ev, self.as_remote()) {
            (DoneEvent::Remote(ev), Some(r)) => {
                r.wait_event(ev);
                Ok(())
            }
            (DoneEvent::Local(ev), None) if ev.is_complete() => Ok(()),
            (DoneEvent::Local(ev), None) => self
                .cuda_stream()?
                .wait(ev)
                .map_err(|e| Error::driver("cuStreamWaitEvent", e)),
            _ => Err(Error::InvalidArgument(
                "an event of another backend cannot order this work".into(),
            )),
        }
    }

    /// Starts a GPU timer before the work that follows on this stream.
    ///
    /// # Errors
    /// [`Error::Capture`] during a graph capture (time a replay instead);
    /// driver errors, named.
    pub(crate) fn timer_start(&mut self) -> Result<TimerStart> {
        if let Some(r) = self.as_remote() {
            let (stream, timer) = (r.stream(), r.timer_start());
            return Ok(TimerStart::Remote { stream, timer });
        }
        let stream = self.cuda_stream_for("timed (GPU timing)")?.clone();
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
        Ok(TimerStart::Local { stream, start, end })
    }

    /// Ends `timer` after the work enqueued since it started (work forked
    /// onto other streams has joined this one).
    pub(crate) fn timer_end(&mut self, timer: TimerStart) -> Result<TimerPoints> {
        match (timer, self.as_remote()) {
            (TimerStart::Remote { stream, timer }, Some(r)) => {
                Ok(TimerPoints::Remote(r.timer_end(stream, timer)))
            }
            (TimerStart::Local { stream, start, end }, None) => {
                end.record(&stream)
                    .map_err(|e| Error::driver("cuEventRecord", e))?;
                Ok(TimerPoints::Local { start, end })
            }
            _ => Err(Error::InvalidArgument(
                "timed: the op left its context".into(),
            )),
        }
    }
}
