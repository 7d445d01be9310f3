//! The per-principal byte budget, and GPU_SUBMIT on the submit workers.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{Reply, Shared};
use crate::device::DeviceError;
use crate::lease_table::Principal;
use crate::lock;
use crate::proto::{from_body, Frame, GpuSubmit, Opcode, Status};
use crate::worker::WorkerProcess;

/// One in-flight request of a principal and the bytes it holds in the node
/// (body and unstreamed data, then reply data); given back on drop.
pub(super) struct BudgetTurn {
    pub(super) shared: Arc<Shared>,
    pub(super) who: Principal,
    pub(super) bytes: u64,
}

/// Why `bytes` more do not fit beside the `held` bytes of `who`.
pub(super) fn over_bytes(
    shared: &Shared,
    who: &Principal,
    held: u64,
    bytes: u64,
) -> Option<String> {
    (held.saturating_add(bytes) > shared.cfg.max_bytes_per_principal).then(|| {
        format!(
            "principal {who} has {held} bytes in flight; {bytes} more would pass its limit of {} \
             (max_bytes_per_principal)",
            shared.cfg.max_bytes_per_principal
        )
    })
}

impl BudgetTurn {
    pub(super) fn take(shared: &Arc<Shared>, who: &Principal, bytes: u64) -> Result<Self, Reply> {
        let mut m = lock(&shared.budgets);
        let (requests, held) = m.entry(who.clone()).or_insert((0, 0));
        if *requests >= shared.cfg.max_requests_per_principal {
            return Err(Reply::err(
                Status::CapacityExceeded,
                format!(
                    "principal {who} has {requests} requests in flight, its limit \
                     (max_requests_per_principal)"
                ),
            ));
        }
        if let Some(why) = over_bytes(shared, who, *held, bytes) {
            return Err(Reply::err(Status::CapacityExceeded, why));
        }
        *requests += 1;
        *held += bytes;
        Ok(BudgetTurn {
            shared: shared.clone(),
            who: who.clone(),
            bytes,
        })
    }

    /// Charges `more` reply bytes before the work runs; the reason if no fit.
    pub(super) fn grow(&mut self, more: u64) -> Result<(), String> {
        let mut m = lock(&self.shared.budgets);
        let Some((_, held)) = m.get_mut(&self.who) else {
            return Err(format!("principal {} has no budget entry", self.who));
        };
        if let Some(why) = over_bytes(&self.shared, &self.who, *held, more) {
            return Err(why);
        }
        *held += more;
        self.bytes += more;
        Ok(())
    }

    /// Charges as many of `want` bytes as fit now; returns how many.
    pub(super) fn grow_up_to(&mut self, want: u64) -> u64 {
        let mut m = lock(&self.shared.budgets);
        let Some((_, held)) = m.get_mut(&self.who) else {
            return 0;
        };
        let left = self
            .shared
            .cfg
            .max_bytes_per_principal
            .saturating_sub(*held);
        let more = want.min(left);
        *held += more;
        self.bytes += more;
        more
    }

    /// Gives back `bytes` of this request's charge.
    pub(super) fn release(&mut self, bytes: u64) {
        let bytes = bytes.min(self.bytes);
        let mut m = lock(&self.shared.budgets);
        if let Some((_, held)) = m.get_mut(&self.who) {
            *held -= bytes;
            self.bytes -= bytes;
        }
    }
}

impl Drop for BudgetTurn {
    fn drop(&mut self) {
        let mut m = lock(&self.shared.budgets);
        if let Some((requests, held)) = m.get_mut(&self.who) {
            *requests -= 1;
            *held -= self.bytes;
            if *requests == 0 {
                m.remove(&self.who);
            }
        }
    }
}

/// Waits for one of the principal's `max_submits_per_principal` GPU_SUBMIT
/// turns, so one tenant never takes every submit worker.
pub(super) async fn submit_turn(
    shared: &Shared,
    who: &Principal,
) -> tokio::sync::OwnedSemaphorePermit {
    let sem = lock(&shared.submits)
        .entry(who.clone())
        .or_insert_with(|| {
            Arc::new(tokio::sync::Semaphore::new(
                shared.cfg.max_submits_per_principal.max(1),
            ))
        })
        .clone();
    sem.acquire_owned()
        .await
        .expect("the per-principal semaphore is never closed")
}

pub(super) async fn submit(shared: &Arc<Shared>, f: &Frame) -> Result<Reply, Reply> {
    shared.metrics.submit_total.inc();
    let r = submit_inner(shared, f).await;
    match &r {
        Ok(reply) => shared
            .metrics
            .submit_output_bytes
            .inc_by(reply.data.len() as u64),
        Err(_) => shared.metrics.submit_errors.inc(),
    };
    r
}

pub(super) async fn submit_inner(shared: &Arc<Shared>, f: &Frame) -> Result<Reply, Reply> {
    let s: GpuSubmit<'_> = from_body(&f.body)?;
    s.validate(f.data.len(), &shared.cfg.limits)?;
    if shared.submit.is_empty() {
        return Err(Reply::err(
            Status::Internal,
            "this node has no submit workers",
        ));
    }
    // Prefer an idle worker, else wait on the next in turn.
    let n = shared.submit.len();
    let start = shared.submit_next.fetch_add(1, Ordering::Relaxed);
    let idle = (0..n).find_map(|k| shared.submit[(start + k) % n].try_lock().ok());
    let mut guard = match idle {
        Some(g) => g,
        None => shared.submit[start % n].lock().await,
    };
    let w = WorkerProcess::ensure(
        &mut guard,
        &shared.cfg.worker,
        shared.cfg.worker_start_timeout,
    )
    .await
    .map_err(|e| Reply::err(Status::Internal, e.to_string()))?;
    match w
        .call(Opcode::GpuSubmit, &f.body, &f.data, shared.cfg.op_timeout)
        .await
    {
        Ok(frame) if frame.header.status == Status::Ok => Ok(Reply {
            data: frame.data,
            ..Reply::empty()
        }),
        Ok(frame) => {
            let fail: DeviceError = from_body(&frame.body)
                .unwrap_or(DeviceError::new(frame.header.status, "worker error"));
            if fail.sticky {
                // The worker's context is poisoned: replace it.
                if let Some(w) = guard.take() {
                    w.kill();
                }
            }
            Err(Reply::err(fail.status, fail.message))
        }
        Err(e) => {
            guard.take();
            Err(Reply::err(Status::LaunchFailed, e.to_string()))
        }
    }
}
