//! The lease table: grants, renewals, expiry, generations and capacity
//! accounting. Pure bookkeeping with the time passed in; the node wraps it
//! in a mutex and acts on what it returns.

use std::collections::HashMap;
use std::time::Duration;

use crate::proto::{LeaseId, LeaseState, LeaseStatus, Status};

/// How long a dead lease is remembered so late requests get a precise status.
pub const TOMBSTONE_TTL: Duration = Duration::from_secs(600);
/// Most tombstones kept.
const MAX_TOMBSTONES: usize = 65_536;

/// Why a table operation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct TableError {
    /// Status to reply with.
    pub status: Status,
    /// Reason.
    pub message: String,
}

impl TableError {
    fn new(status: Status, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
}

/// A granted or renewed lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// Generation after this grant (1 on alloc, +1 per renew).
    pub generation: u64,
    /// Deadline on the table's clock.
    pub deadline: Duration,
    /// Reserved bytes.
    pub reserved: u64,
}

/// Who a lease belongs to: a token's name, or a client certificate's
/// fingerprint (see the node's trust model).
pub type Principal = std::sync::Arc<str>;

#[derive(Debug)]
struct Entry<W> {
    owner: Option<Principal>,
    generation: u64,
    deadline: Duration,
    reserved: u64,
    allocated: u64,
    /// The most `allocated` has been.
    allocated_high: u64,
    payload: W,
}

#[derive(Debug, Clone)]
struct Tombstone {
    owner: Option<Principal>,
    status: Status,
    reason: String,
    until: Duration,
}

/// Leases with their reservations; `W` is what the node keeps per lease (its worker).
#[derive(Debug)]
pub struct LeaseTable<W> {
    capacity: u64,
    max_ttl: Duration,
    reserved_total: u64,
    live: HashMap<LeaseId, Entry<W>>,
    dead: HashMap<LeaseId, Tombstone>,
}

impl<W: Clone> LeaseTable<W> {
    /// A table that may reserve at most `capacity` bytes in total and grants
    /// TTLs up to `max_ttl`.
    pub fn new(capacity: u64, max_ttl: Duration) -> Self {
        Self {
            capacity,
            max_ttl,
            reserved_total: 0,
            live: HashMap::new(),
            dead: HashMap::new(),
        }
    }

    /// Total bytes the table may reserve.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes still reservable.
    pub fn reservable(&self) -> u64 {
        self.capacity - self.reserved_total
    }

    /// Bytes allocated by all live leases.
    pub fn allocated_total(&self) -> u64 {
        self.live.values().map(|e| e.allocated).sum()
    }

    /// Reserved but not yet allocated bytes of all live leases.
    pub fn outstanding(&self) -> u64 {
        self.live.values().map(|e| e.reserved - e.allocated).sum()
    }

    /// Live leases.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    /// True when no lease is live.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// Checks that `min_vram` fits, without granting: CAPACITY_EXCEEDED
    /// when it does not, BAD_REQUEST for zero.
    pub fn check_fits(&self, min_vram: u64) -> Result<(), TableError> {
        if min_vram == 0 {
            return Err(TableError::new(
                Status::BadRequest,
                "min_vram must be non-zero",
            ));
        }
        if min_vram > self.reservable() {
            return Err(TableError::new(
                Status::CapacityExceeded,
                format!(
                    "asked for {min_vram} bytes, {} reservable",
                    self.reservable()
                ),
            ));
        }
        Ok(())
    }

    /// Grants a lease of `min_vram` bytes for `ttl` from `now`. The new
    /// reservation plus other leases' unallocated reservations must fit in
    /// `device_free` (measured now by the lease's fresh worker); errors as
    /// [`LeaseTable::check_fits`].
    #[allow(clippy::too_many_arguments)] // each is one fact of the grant
    pub fn grant(
        &mut self,
        id: LeaseId,
        min_vram: u64,
        ttl: Duration,
        now: Duration,
        device_free: Option<u64>,
        owner: Option<Principal>,
        payload: W,
    ) -> Result<Grant, TableError> {
        self.check_fits(min_vram)?;
        if let Some(free) = device_free {
            let need = min_vram.saturating_add(self.outstanding());
            if need > free {
                return Err(TableError::new(
                    Status::CapacityExceeded,
                    format!("device has {free} bytes free, {need} needed with other reservations"),
                ));
            }
        }
        if self.live.contains_key(&id) || self.dead.contains_key(&id) {
            return Err(TableError::new(Status::Internal, "lease id collision"));
        }
        let ttl = ttl.min(self.max_ttl);
        let deadline = now + ttl;
        self.reserved_total += min_vram;
        self.live.insert(
            id,
            Entry {
                owner,
                generation: 1,
                deadline,
                reserved: min_vram,
                allocated: 0,
                allocated_high: 0,
                payload,
            },
        );
        Ok(Grant {
            generation: 1,
            deadline,
            reserved: min_vram,
        })
    }

    fn entry(&self, id: &LeaseId, now: Duration) -> Result<&Entry<W>, TableError> {
        if let Some(t) = self.dead.get(id) {
            return Err(TableError::new(t.status, t.reason.clone()));
        }
        match self.live.get(id) {
            None => Err(TableError::new(
                Status::LeaseNotFound,
                format!("no lease {id}"),
            )),
            Some(e) if e.deadline <= now => Err(TableError::new(
                Status::LeaseExpired,
                format!("lease {id} expired"),
            )),
            Some(e) => Ok(e),
        }
    }

    fn entry_mut(&mut self, id: &LeaseId, now: Duration) -> Result<&mut Entry<W>, TableError> {
        self.entry(id, now)?;
        Ok(self.live.get_mut(id).expect("live, checked above"))
    }

    /// Checks that lease `id` (live or recently dead) is `who`'s; another
    /// principal's lease is reported exactly as an unknown one. `who` of
    /// `None` (node, admin) sees every lease; an ownerless lease is anyone's.
    /// NOT_FOUND otherwise, as for an id that does not exist.
    pub fn check_owner(&self, id: &LeaseId, who: Option<&str>) -> Result<(), TableError> {
        let owner = match (self.live.get(id), self.dead.get(id)) {
            (Some(e), _) => e.owner.as_deref(),
            (None, Some(t)) => t.owner.as_deref(),
            (None, None) => None,
        };
        match (owner, who) {
            (Some(o), Some(w)) if o != w => Err(TableError::new(
                Status::LeaseNotFound,
                format!("no lease {id}"),
            )),
            _ => Ok(()),
        }
    }

    /// Live leases owned by `who`.
    pub fn owned_count(&self, who: &str) -> usize {
        self.live
            .values()
            .filter(|e| e.owner.as_deref() == Some(who))
            .count()
    }

    /// The payload of a usable lease; NOT_FOUND, LEASE_EXPIRED (also
    /// before the reaper ran) or LEASE_POISONED for another.
    pub fn get(&self, id: &LeaseId, now: Duration) -> Result<W, TableError> {
        self.entry(id, now).map(|e| e.payload.clone())
    }

    /// Extends a lease to `now + ttl` and bumps its generation (errors as
    /// [`LeaseTable::get`]).
    pub fn renew(
        &mut self,
        id: &LeaseId,
        ttl: Duration,
        now: Duration,
    ) -> Result<Grant, TableError> {
        let ttl = ttl.min(self.max_ttl);
        let e = self.entry_mut(id, now)?;
        e.generation += 1;
        e.deadline = e.deadline.max(now + ttl);
        Ok(Grant {
            generation: e.generation,
            deadline: e.deadline,
            reserved: e.reserved,
        })
    }

    /// Describes a lease: NOT_FOUND, LEASE_EXPIRED; a poisoned lease is
    /// reported, not refused.
    pub fn status(&self, id: &LeaseId, now: Duration) -> Result<LeaseStatus, TableError> {
        if self
            .dead
            .get(id)
            .is_some_and(|t| t.status == Status::LeasePoisoned)
        {
            return Ok(LeaseStatus {
                lease: *id,
                generation: 0,
                reserved: 0,
                allocated: 0,
                allocated_high: 0,
                remaining_ms: 0,
                state: LeaseState::Poisoned,
            });
        }
        let e = self.entry(id, now)?;
        Ok(LeaseStatus {
            lease: *id,
            generation: e.generation,
            reserved: e.reserved,
            allocated: e.allocated,
            allocated_high: e.allocated_high,
            remaining_ms: u64::try_from((e.deadline - now).as_millis()).unwrap_or(u64::MAX),
            state: LeaseState::Active,
        })
    }

    /// The bytes a live lease reserved (errors as [`LeaseTable::get`]).
    pub fn reservation(&self, id: &LeaseId, now: Duration) -> Result<u64, TableError> {
        self.entry(id, now).map(|e| e.reserved)
    }

    /// Sets a live lease's allocated bytes as its worker reported (no-op if dead).
    pub fn set_allocated(&mut self, id: &LeaseId, bytes: u64) {
        if let Some(e) = self.live.get_mut(id) {
            e.allocated = bytes;
            e.allocated_high = e.allocated_high.max(bytes);
        }
    }

    fn bury(&mut self, id: LeaseId, status: Status, reason: String, now: Duration) -> Option<W> {
        let e = self.live.remove(&id)?;
        self.reserved_total -= e.reserved;
        let owner = e.owner.clone();
        if self.dead.len() >= MAX_TOMBSTONES {
            self.dead.retain(|_, t| t.until > now);
        }
        if self.dead.len() < MAX_TOMBSTONES {
            self.dead.insert(
                id,
                Tombstone {
                    owner,
                    status,
                    reason,
                    until: now + TOMBSTONE_TTL,
                },
            );
        }
        Some(e.payload)
    }

    /// Removes a live lease at once (explicit free, shutdown), returning its payload.
    pub fn remove(&mut self, id: &LeaseId, now: Duration) -> Option<W> {
        self.bury(
            *id,
            Status::LeaseNotFound,
            format!("lease {id} was freed"),
            now,
        )
    }

    /// Fails a lease: releases its reservation; later requests get
    /// LEASE_POISONED with `reason` until it is freed or forgotten.
    pub fn poison(&mut self, id: &LeaseId, reason: &str, now: Duration) -> Option<W> {
        self.bury(
            *id,
            Status::LeasePoisoned,
            format!("lease poisoned: {reason}"),
            now,
        )
    }

    /// LEASE_FREE of a dead lease: forgets a poisoned tombstone (`Ok(true)`),
    /// reports an expired or freed one (LEASE_EXPIRED or NOT_FOUND from the
    /// tombstone); an unknown id is `Ok(false)`.
    pub fn forget(&mut self, id: &LeaseId) -> Result<bool, TableError> {
        match self.dead.get(id) {
            None => Ok(false),
            Some(t) if t.status == Status::LeasePoisoned => {
                self.dead.remove(id);
                Ok(true)
            }
            Some(t) => Err(TableError::new(t.status, t.reason.clone())),
        }
    }

    /// Removes every lease whose deadline is at or before `now`, returning
    /// their ids and payloads, and forgets old tombstones.
    pub fn expire(&mut self, now: Duration) -> Vec<(LeaseId, W)> {
        let ids: Vec<LeaseId> = self
            .live
            .iter()
            .filter(|(_, e)| e.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        let out = ids
            .into_iter()
            .filter_map(|id| {
                let w = self.bury(id, Status::LeaseExpired, format!("lease {id} expired"), now)?;
                Some((id, w))
            })
            .collect();
        self.dead.retain(|_, t| t.until > now);
        out
    }

    /// Removes every live lease (shutdown).
    pub fn drain(&mut self, now: Duration) -> Vec<(LeaseId, W)> {
        let ids: Vec<LeaseId> = self.live.keys().copied().collect();
        ids.into_iter()
            .filter_map(|id| {
                self.bury(id, Status::LeaseNotFound, "node shut down".into(), now)
                    .map(|w| (id, w))
            })
            .collect()
    }

    /// Payloads of all live leases.
    pub fn payloads(&self) -> Vec<(LeaseId, W)> {
        self.live
            .iter()
            .map(|(id, e)| (*id, e.payload.clone()))
            .collect()
    }
}
