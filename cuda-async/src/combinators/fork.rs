//! Fork/join of concurrent arms across pool streams.
//!
//! Arm 0 runs on the parent stream. Each other arm runs on another pool
//! stream that first waits on an event recorded on the parent (so it sees
//! everything enqueued before the fork); at the end the parent waits on an
//! event recorded on each arm's stream.

use std::sync::Arc;

use cuda_core::cudarc::driver::{sys, CudaEvent, CudaStream};
use cuda_core::{Error, Result};

use crate::context::ExecutionContext;

pub(crate) struct Fork {
    fork_event: Option<CudaEvent>,
    joins: Vec<CudaEvent>,
}

fn record(stream: &CudaStream) -> Result<CudaEvent> {
    stream
        .record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
        .map_err(|e| Error::driver("cuEventRecord", e))
}

impl Fork {
    pub(crate) fn new() -> Self {
        Fork {
            fork_event: None,
            joins: Vec::new(),
        }
    }

    /// The context for arm `arm` (>= 1).
    pub(crate) fn arm(
        &mut self,
        parent: &ExecutionContext,
        arm: usize,
    ) -> Result<ExecutionContext> {
        let pstream = parent.stream();
        let stream: Arc<CudaStream> = match parent.pool().fork_stream(pstream, arm) {
            Some(s) if s.cu_stream() != pstream.cu_stream() => s.clone(),
            _ => return Ok(parent.fork(pstream.clone())),
        };
        if self.fork_event.is_none() {
            self.fork_event = Some(record(pstream)?);
        }
        let ev = self.fork_event.as_ref().expect("recorded above");
        stream
            .wait(ev)
            .map_err(|e| Error::driver("cuStreamWaitEvent", e))?;
        Ok(parent.fork(stream))
    }

    /// Ends arm `child`: its retained values join the parent's.
    pub(crate) fn end(
        &mut self,
        parent: &mut ExecutionContext,
        child: ExecutionContext,
    ) -> Result<()> {
        let same = child.stream().cu_stream() == parent.stream().cu_stream();
        let r = if same {
            Ok(())
        } else {
            record(child.stream()).map(|ev| self.joins.push(ev))
        };
        parent.absorb(child);
        r
    }

    /// Makes the parent stream wait for every arm.
    pub(crate) fn join(self, parent: &ExecutionContext) -> Result<()> {
        for ev in &self.joins {
            parent
                .stream()
                .wait(ev)
                .map_err(|e| Error::driver("cuStreamWaitEvent", e))?;
        }
        Ok(())
    }
}
