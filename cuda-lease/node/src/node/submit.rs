//! The per-principal byte budget, and GPU_SUBMIT on the submit workers.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{Reply, Shared};
use crate::budget::{fits, BudgetFile, Seat};
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
pub(super) fn over_bytes(shared: &Shared, who: &Principal, held: u64, bytes: u64) -> String {
    format!(
        "principal {who} has {held} bytes in flight; {bytes} more would pass its limit of {} \
         (max_bytes_per_principal)",
        shared.cfg.max_bytes_per_principal
    )
}

/// The shared counters of `who`'s direct leases, if it has one (called
/// under the budgets' lock).
fn shared_budget(shared: &Shared, who: &Principal) -> Option<Arc<BudgetFile>> {
    lock(&shared.direct_budgets).get(who)?.upgrade()
}

/// Charges up to `want` more bytes to `who`, which holds `held` on the
/// node: all or none, or as many as fit when `partial`; how many. Called
/// under the budgets' lock. With direct leases the limit is on what the
/// node and their workers hold together.
fn charge(shared: &Shared, who: &Principal, held: &mut u64, want: u64, partial: bool) -> u64 {
    let limit = shared.cfg.max_bytes_per_principal;
    let took = match shared_budget(shared, who) {
        Some(file) => file.charge(want, limit, partial),
        None => fits(*held, want, limit, partial),
    };
    *held += took;
    took
}

/// Gives back `bytes` of what `who` holds on the node (under the lock).
fn give_back(shared: &Shared, who: &Principal, held: &mut u64, bytes: u64) {
    *held -= bytes;
    if let Some(file) = shared_budget(shared, who) {
        file.release(bytes);
    }
}

/// What `who` holds, for a refusal's message (under the budgets' lock).
fn in_flight(shared: &Shared, who: &Principal, held: u64) -> u64 {
    shared_budget(shared, who).map_or(held, |f| f.total())
}

/// A seat in `who`'s shared counters for a direct lease's worker, made
/// with the principal's first direct lease; `None` when all are taken.
pub(super) fn direct_seat(shared: &Shared, who: &Principal) -> std::io::Result<Option<Seat>> {
    let budgets = lock(&shared.budgets);
    let mut files = lock(&shared.direct_budgets);
    files.retain(|_, f| f.strong_count() > 0);
    let file = match files.get(who).and_then(std::sync::Weak::upgrade) {
        Some(f) => f,
        None => {
            let held = budgets.get(who).map_or(0, |(_, held)| *held);
            let seats = shared.cfg.max_leases_per_principal.clamp(1, 1 << 16) as u32 * 2;
            let f = Arc::new(BudgetFile::create(seats, held)?);
            files.insert(who.clone(), Arc::downgrade(&f));
            f
        }
    };
    Ok(file.seat())
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
        if bytes > 0 && charge(shared, who, held, bytes, false) == 0 {
            let why = over_bytes(shared, who, in_flight(shared, who, *held), bytes);
            if *requests == 0 {
                m.remove(who);
            }
            return Err(Reply::err(Status::CapacityExceeded, why));
        }
        *requests += 1;
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
        if more > 0 && charge(&self.shared, &self.who, held, more, false) == 0 {
            let now = in_flight(&self.shared, &self.who, *held);
            return Err(over_bytes(&self.shared, &self.who, now, more));
        }
        self.bytes += more;
        Ok(())
    }

    /// Charges as many of `want` bytes as fit now; returns how many.
    pub(super) fn grow_up_to(&mut self, want: u64) -> u64 {
        let mut m = lock(&self.shared.budgets);
        let Some((_, held)) = m.get_mut(&self.who) else {
            return 0;
        };
        let more = charge(&self.shared, &self.who, held, want, true);
        self.bytes += more;
        more
    }

    /// Gives back `bytes` of this request's charge.
    pub(super) fn release(&mut self, bytes: u64) {
        let bytes = bytes.min(self.bytes);
        let mut m = lock(&self.shared.budgets);
        if let Some((_, held)) = m.get_mut(&self.who) {
            give_back(&self.shared, &self.who, held, bytes);
            self.bytes -= bytes;
        }
    }
}

impl Drop for BudgetTurn {
    fn drop(&mut self) {
        let mut m = lock(&self.shared.budgets);
        if let Some((requests, held)) = m.get_mut(&self.who) {
            *requests -= 1;
            give_back(&self.shared, &self.who, held, self.bytes);
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
