//! One submission of a fleet policy ([`Placement`]): a remote session that
//! records without a node and runs where it is placed when it is sent.

use std::any::Any;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use cuda_async::remote::{Ledger, Recording, RemoteCompletion};
use cuda_async::{RemoteErrorExt, RemoteSession};

use super::{lost, node_lost, Member, Shared};
use crate::lock;
use cuda_lease::client::{Error, ErrorKind};

/// Where a submission runs once placed (shared with the tasks running it).
type At = Arc<Mutex<Option<Arc<Member>>>>;

/// One submission's session: records anywhere, runs where it is placed.
#[derive(Debug)]
pub(super) struct Placement {
    shared: Arc<Shared>,
    at: At,
    /// Ids of earlier submissions' buffers it uses.
    adopted: Mutex<Vec<u64>>,
}

impl Placement {
    /// A submission of the policy of `shared`, not placed yet.
    pub(super) fn new(shared: Arc<Shared>) -> Self {
        Placement {
            shared,
            at: Arc::new(Mutex::new(None)),
            adopted: Mutex::new(Vec::new()),
        }
    }

    fn at(&self) -> Option<Arc<Member>> {
        lock(&self.at).clone()
    }

    /// The error of a submission whose buffers are on a dead node.
    fn lost_buffers(&self, m: &Member) -> cuda_async::Error {
        let ids: Vec<String> = lock(&self.adopted)
            .iter()
            .map(|i| format!("#{i}"))
            .collect();
        m.gone(format_args!(
            "is gone, and with it the buffers {} this submission uses",
            ids.join(", ")
        ))
    }
}

impl RemoteSession for Placement {
    fn describe(&self) -> String {
        match self.at() {
            Some(m) => format!("{} (fleet policy)", m.session.describe()),
            None => "a fleet policy's submission, not placed yet".into(),
        }
    }

    fn fresh_id(&self) -> u64 {
        self.shared.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn submit(&self, recording: Recording, done: RemoteCompletion) {
        if recording.is_empty() {
            // The ledger's call for the queued frees: its lease's.
            match self.at() {
                Some(m) if m.is_live() => m.session.submit(recording, done),
                _ => done.complete(),
            }
            return;
        }
        let (shared, at) = (self.shared.clone(), self.at.clone());
        let adopted = !lock(&self.adopted).is_empty();
        match self.at() {
            Some(m) if !m.is_live() => done.fail(self.lost_buffers(&m)),
            Some(m) => run_on(shared, at, m, recording, done, 0, adopted),
            None => match shared.least_loaded() {
                Some(m) => run_on(shared, at, m, recording, done, 0, adopted),
                None => {
                    let rt = shared.runtime.clone();
                    rt.spawn(place_later(shared, at, recording, done, 0));
                }
            },
        }
    }

    fn ledger(&self) -> Option<Arc<Ledger>> {
        // Its buffers live on the lease it was placed on.
        self.at()
            .filter(|m| m.is_live())
            .and_then(|m| m.session.ledger())
    }

    fn accepts(&self, owner: &Arc<dyn RemoteSession>, id: u64) -> bool {
        let owner: &dyn Any = &**owner;
        let Some(other) = owner.downcast_ref::<Placement>() else {
            return false;
        };
        if !Arc::ptr_eq(&other.shared, &self.shared) {
            return false;
        }
        let Some(there) = other.at() else {
            return false;
        };
        let mut at = lock(&self.at);
        match &*at {
            Some(here) if !Arc::ptr_eq(here, &there) => return false,
            Some(_) => {}
            None => *at = Some(there),
        }
        lock(&self.adopted).push(id);
        true
    }
}

/// Sends `recording` on `m`, forwarding the outcome to `done`; if the node
/// failed and the submission may run again, runs it on another live lease.
fn run_on(
    shared: Arc<Shared>,
    at: At,
    m: Arc<Member>,
    recording: Recording,
    done: RemoteCompletion,
    attempt: u32,
    adopted: bool,
) {
    *lock(&at) = Some(m.clone());
    let again = (!adopted && attempt < shared.cfg.retry).then(|| recording.duplicate());
    let inner = RemoteCompletion::new();
    m.in_flight.fetch_add(1, Ordering::AcqRel);
    m.given.fetch_add(1, Ordering::Relaxed);
    m.session.submit(recording, inner.clone());
    let rt = shared.runtime.clone();
    rt.spawn(async move {
        let r = inner.finished().await;
        m.in_flight.fetch_sub(1, Ordering::AcqRel);
        shared.count(&m.node.name, r.is_ok());
        match r {
            Ok(()) => {
                if attempt > 0 {
                    let mut first = lock(&shared.first_retry_done);
                    first.get_or_insert_with(std::time::Instant::now);
                }
                done.complete();
            }
            Err(e) if lost(&e) => {
                shared.bury(&m, &e.to_string());
                match again {
                    Some(rec) => {
                        shared.retries.fetch_add(1, Ordering::Relaxed);
                        place_later(shared, at, rec, done, attempt + 1).await;
                    }
                    None => done.fail(node_lost(&m, e)),
                }
            }
            Err(e) => done.fail(e),
        }
    });
}

/// Places `recording` once the policy has a live lease (it had none, or the
/// submission runs again), waiting at most the configured `wait`.
async fn place_later(
    shared: Arc<Shared>,
    at: At,
    recording: Recording,
    done: RemoteCompletion,
    attempt: u32,
) {
    let deadline = tokio::time::Instant::now() + shared.cfg.wait;
    loop {
        let signals = shared.clone();
        let added = signals.added.notified();
        if let Some(m) = shared.least_loaded() {
            run_on(shared, at, m, recording, done, attempt, false);
            return;
        }
        let closed = shared.closed.load(Ordering::Acquire);
        if closed || tokio::time::timeout_at(deadline, added).await.is_err() {
            let e = Error::new(
                ErrorKind::Capacity,
                format!(
                    "no lease of the fleet policy took the submission within {:?}",
                    shared.cfg.wait
                ),
            );
            done.fail(cuda_async::Error::from_remote(e));
            return;
        }
    }
}
