//! One principal's bytes in flight, counted across the node and the
//! workers of its direct leases.
//!
//! `max_bytes_per_principal` bounds what a principal's requests hold. On
//! the node's path the node counts them itself; a direct lease's requests
//! are held by its worker process, so a principal with a direct lease has
//! a [`BudgetFile`]: a shared file of counters that the node and those
//! workers charge against the one limit.
//!
//! - Cell 0 is everything the principal holds: the node's requests and
//!   every worker's. A charge is a compare-and-swap on it that fails past
//!   the limit, so the check and the charge are one step and no mix of
//!   processes passes the limit together.
//! - Cell `1 + i` is what the worker in seat `i` holds, added after its
//!   charge to cell 0 and taken away before its release from it; when the
//!   lease ends the node gives back what is left there ([`Seat`]'s drop),
//!   so a worker that died holding bytes does not keep them charged.
//!
//! The node creates the file with the principal's first direct lease
//! (with cell 0 at what the node holds for it then), hands each of its
//! workers the path and a seat, and removes the file with the last one.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use memmap2::MmapRaw;
use serde::{Deserialize, Serialize};

use crate::lock;
use crate::shm::{create_shared, open_shared};

const CELL: usize = std::mem::size_of::<AtomicU64>();

fn bytes_for(seats: u32) -> usize {
    (1 + seats as usize) * CELL
}

/// Cell `i` of `map` (which holds at least `i + 1` cells).
fn cell(map: &MmapRaw, i: usize) -> &AtomicU64 {
    debug_assert!((i + 1) * CELL <= map.len());
    // SAFETY: the mapping is page-aligned and at least `(i + 1) * CELL`
    // bytes long (checked when mapped: `open_shared`/`create_shared`), so
    // the cell is aligned and inside it; every process touches the file's
    // bytes only through atomics, and the mapping lives as long as `map`.
    unsafe { &*map.as_ptr().add(i * CELL).cast::<AtomicU64>() }
}

/// How many of `want` more bytes fit beside `held` under `limit`: all of
/// them or none (`partial` false), or as many as fit.
pub(crate) fn fits(held: u64, want: u64, limit: u64, partial: bool) -> u64 {
    let left = limit.saturating_sub(held);
    match partial {
        true => want.min(left),
        false if want <= left => want,
        false => 0,
    }
}

/// Adds to `c` what [`fits`] of `want`; what was added.
fn charge(c: &AtomicU64, want: u64, limit: u64, partial: bool) -> u64 {
    let mut took = 0;
    let _ = c.fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
        took = fits(now, want, limit, partial);
        (took > 0).then_some(now + took)
    });
    took
}

/// Takes up to `n` from `c`, never below zero.
fn give_back(c: &AtomicU64, n: u64) {
    let _ = c.fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
        Some(now.saturating_sub(n))
    });
}

/// The node's side of one principal's shared counters.
#[derive(Debug)]
pub(crate) struct BudgetFile {
    map: MmapRaw,
    path: PathBuf,
    free: Mutex<Vec<u32>>,
}

impl BudgetFile {
    /// A file of `seats` seats, its total at `held` (the bytes the node
    /// holds for the principal now).
    pub(crate) fn create(seats: u32, held: u64) -> std::io::Result<Self> {
        let (map, path) = create_shared(bytes_for(seats))?;
        cell(&map, 0).store(held, Ordering::Release);
        Ok(BudgetFile {
            map,
            path,
            free: Mutex::new((0..seats).rev().collect()),
        })
    }

    /// What the principal holds, the node's requests and its workers'.
    pub(crate) fn total(&self) -> u64 {
        cell(&self.map, 0).load(Ordering::Acquire)
    }

    /// Charges the node's `want` bytes (all or nothing, or as many as fit
    /// when `partial`) against `limit`; how many it charged.
    pub(crate) fn charge(&self, want: u64, limit: u64, partial: bool) -> u64 {
        charge(cell(&self.map, 0), want, limit, partial)
    }

    /// Gives back `n` bytes of the node's.
    pub(crate) fn release(&self, n: u64) {
        give_back(cell(&self.map, 0), n);
    }

    /// A seat for one worker, or `None` when every seat is taken.
    pub(crate) fn seat(self: &Arc<Self>) -> Option<Seat> {
        let index = lock(&self.free).pop()?;
        Some(Seat {
            file: self.clone(),
            index,
        })
    }
}

impl Drop for BudgetFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A worker's seat in a principal's [`BudgetFile`]; dropped when the lease
/// ends (after its worker was killed), giving back what it still holds.
#[derive(Debug)]
pub(crate) struct Seat {
    file: Arc<BudgetFile>,
    index: u32,
}

impl Seat {
    /// What the worker needs to open its side.
    pub(crate) fn handle(&self) -> SeatHandle {
        SeatHandle {
            path: self.file.path.clone(),
            seat: self.index,
        }
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        let left = cell(&self.file.map, 1 + self.index as usize).swap(0, Ordering::AcqRel);
        give_back(cell(&self.file.map, 0), left);
        lock(&self.file.free).push(self.index);
    }
}

/// Node -> worker: where its principal's counters are and its seat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SeatHandle {
    pub(crate) path: PathBuf,
    pub(crate) seat: u32,
}

/// A worker's side: charges its requests to its principal's total.
#[derive(Debug)]
pub(crate) struct WorkerBudget {
    map: MmapRaw,
    seat: usize,
    limit: u64,
}

impl WorkerBudget {
    /// Maps the counters `handle` names, charging against `limit`.
    pub(crate) fn open(handle: &SeatHandle, limit: u64) -> std::io::Result<Self> {
        let map = open_shared(Path::new(&handle.path), bytes_for(handle.seat + 1))?;
        Ok(WorkerBudget {
            map,
            seat: 1 + handle.seat as usize,
            limit,
        })
    }

    /// The principal's limit.
    pub(crate) fn limit(&self) -> u64 {
        self.limit
    }

    /// Charges `bytes` if they fit beside everything the principal holds;
    /// given back when the returned charge drops.
    pub(crate) fn charge(self: &Arc<Self>, bytes: u64) -> Option<Charged> {
        if bytes > 0 && charge(cell(&self.map, 0), bytes, self.limit, false) == 0 {
            return None;
        }
        cell(&self.map, self.seat).fetch_add(bytes, Ordering::AcqRel);
        Some(Charged {
            budget: self.clone(),
            bytes,
        })
    }
}

/// Bytes a worker holds for a request, charged to its principal.
#[derive(Debug)]
pub(crate) struct Charged {
    budget: Arc<WorkerBudget>,
    bytes: u64,
}

impl Drop for Charged {
    fn drop(&mut self) {
        give_back(cell(&self.budget.map, self.budget.seat), self.bytes);
        give_back(cell(&self.budget.map, 0), self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_and_the_node_share_one_limit_and_a_seat_gives_back_what_it_held() {
        let file = Arc::new(BudgetFile::create(2, 100).unwrap());
        let (a, b) = (file.seat().unwrap(), file.seat().unwrap());
        assert!(file.seat().is_none());
        let wa = Arc::new(WorkerBudget::open(&a.handle(), 1000).unwrap());
        let wb = Arc::new(WorkerBudget::open(&b.handle(), 1000).unwrap());
        let held = wa.charge(600).expect("fits beside the node's 100");
        assert!(wb.charge(400).is_none(), "700 held: 400 more pass 1000");
        let small = wb.charge(300).expect("fits exactly");
        assert_eq!(
            file.charge(1, 1000, false),
            0,
            "the node sees the workers' bytes"
        );
        drop(small);
        assert_eq!(file.charge(500, 1000, true), 300, "as much as fits");
        file.release(300);
        assert_eq!(file.total(), 700);
        // A worker that never gave back its 600: its seat does when it goes.
        std::mem::forget(held);
        drop(a);
        assert_eq!(file.total(), 100);
        assert!(file.seat().is_some());
        let path = file.path.clone();
        drop((b, wa, wb, file));
        assert!(!path.exists(), "removed with the last seat");
    }
}
