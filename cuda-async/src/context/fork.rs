//! Fork/join of concurrent arms across pool streams.
//!
//! Arm 0 runs on the parent stream. Each other arm runs on another pool
//! stream that first waits on an event recorded on the parent (so it sees
//! everything enqueued before the fork); at the end the parent waits on an
//! event recorded on each arm's stream. Under a device pool that spreads
//! arms, an arm's stream may be another device's: the same events order
//! it, across contexts.
//!
//! On a remote context the same shape is recorded as commands: a `Record`
//! of a client-named event on the parent's stream, a `Wait` for it at the
//! start of each arm's recording on another stream of the policy, a
//! `Record` at each arm's end and a `Wait` for each of those on the parent,
//! then the events' frees. The arms' recordings are appended in order; the
//! node runs them on its streams concurrently.

use cuda_core::cudarc::driver::{sys, CudaEvent, CudaStream};
use cuda_core::{Error, Result};

use super::ExecutionContext;

pub(crate) struct Fork {
    fork_event: Option<CudaEvent>,
    joins: Vec<CudaEvent>,
    /// Remote: the fork event's id and the arms' join events.
    remote_fork: Option<u64>,
    remote_joins: Vec<u64>,
    /// The first failure to record an arm's end (that arm's retained values
    /// were leaked, since the parent cannot be ordered after it).
    error: Option<Error>,
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
            remote_fork: None,
            remote_joins: Vec::new(),
            error: None,
        }
    }

    /// The context for arm `arm` (>= 1).
    pub(crate) fn arm(
        &mut self,
        parent: &mut ExecutionContext,
        arm: usize,
    ) -> Result<ExecutionContext> {
        if let Some(r) = parent.as_remote() {
            return Ok(ExecutionContext::new_remote(
                r.fork_arm(arm, &mut self.remote_fork),
            ));
        }
        // Remotely (this stage), arms record in order on the parent's stream.
        let (Some(pstream), Ok(pool)) = (parent.work_stream(), parent.pool()) else {
            return Ok(parent.fork(None));
        };
        // Under a pool that spreads arms, the arm may go to another device:
        // the same events order it (the driver waits on an event of
        // another context).
        let arm_ctx = match parent.spread().and_then(|s| s.arm_context(arm)) {
            Some(ctx) => ctx?,
            None => match pool.fork_stream(pstream, arm) {
                Some(s) if s.cu_stream() != pstream.cu_stream() => parent.fork(Some(s.clone())),
                _ => return Ok(parent.fork(None)),
            },
        };
        if self.fork_event.is_none() {
            self.fork_event = Some(record(pstream)?);
        }
        let ev = self.fork_event.as_ref().expect("recorded above");
        arm_ctx
            .work_stream()
            .expect("a local context")
            .wait(ev)
            .map_err(|e| Error::driver("cuStreamWaitEvent", e))?;
        Ok(arm_ctx)
    }

    /// Ends arm `child`: its retained values join the parent's, once its
    /// stream's end is recorded for the join. If that record fails, the
    /// arm's retained values are leaked (nothing can order their release
    /// after the arm's work) and [`Fork::join`] reports the error.
    pub(crate) fn end(&mut self, parent: &mut ExecutionContext, mut child: ExecutionContext) {
        // The arm's use marks, before its stream is joined.
        if let Err(e) = child.flush_marks() {
            self.error.get_or_insert(e);
        }
        if let Some(arm) = child.as_remote() {
            if let Some(ev) = parent.remote_ref().and_then(|p| arm.end_arm(p.stream())) {
                self.remote_joins.push(ev);
            }
            parent.absorb(child);
            return;
        }
        let (Some(cs), Some(ps)) = (child.work_stream(), parent.work_stream()) else {
            parent.absorb(child);
            return;
        };
        if cs.cu_stream() == ps.cu_stream() {
            parent.absorb(child);
            return;
        }
        match record(cs) {
            Ok(ev) => {
                self.joins.push(ev);
                parent.absorb(child);
            }
            Err(e) => {
                std::mem::forget(child.take_retained());
                self.error.get_or_insert(e);
            }
        }
    }

    /// Makes the parent stream wait for every arm. On failure the parent's
    /// retained values are leaked (they may include arms' values that the
    /// parent stream is not ordered after).
    pub(crate) fn join(self, parent: &mut ExecutionContext) -> Result<()> {
        if let Some(r) = parent.as_remote() {
            r.join_arms(self.remote_fork, &self.remote_joins);
            return Ok(());
        }
        for ev in &self.joins {
            let Some(stream) = parent.work_stream() else {
                break;
            };
            if let Err(e) = stream.wait(ev) {
                std::mem::forget(parent.take_retained());
                return Err(Error::driver("cuStreamWaitEvent", e));
            }
        }
        match self.error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
