//! The node's module source cache, shared by leases, bounded per principal.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::lease_table::Principal;
use crate::proto::{ModuleHash, SourceKind};

/// A module's source (or the PTX compiled from it).
pub(super) type ModuleSource = Arc<(SourceKind, Vec<u8>)>;

/// Module sources loaded by leases, by content hash, so no lease resends
/// what any lease sent. Each entry belongs to the principal whose lease was
/// charged for and loaded it. Bounded in bytes node-wide and per principal:
/// a principal over its share evicts its own oldest entries; a full node
/// evicts the largest holder's oldest, never a smaller holder's.
#[derive(Debug, Default)]
pub(super) struct ModuleCache {
    map: HashMap<ModuleHash, (ModuleSource, Principal)>,
    /// Each principal's entries, oldest first, and their bytes.
    shares: HashMap<Principal, (VecDeque<ModuleHash>, u64)>,
    bytes: u64,
}

impl ModuleCache {
    pub(super) fn get(&self, hash: &ModuleHash) -> Option<ModuleSource> {
        self.map.get(hash).map(|(s, _)| s.clone())
    }

    pub(super) fn remove(&mut self, hash: &ModuleHash) {
        let Some((source, owner)) = self.map.remove(hash) else {
            return;
        };
        let len = source.1.len() as u64;
        self.bytes -= len;
        if let Some((order, bytes)) = self.shares.get_mut(&owner) {
            order.retain(|h| h != hash);
            *bytes -= len;
            if order.is_empty() {
                self.shares.remove(&owner);
            }
        }
    }

    /// Evicts `owner`'s oldest entry; false if it has none.
    fn evict_oldest_of(&mut self, owner: &Principal) -> bool {
        let oldest = self.shares.get(owner).and_then(|(o, _)| o.front().copied());
        match oldest {
            Some(h) => {
                self.remove(&h);
                true
            }
            None => false,
        }
    }

    fn share(&self, owner: &Principal) -> u64 {
        self.shares.get(owner).map_or(0, |(_, b)| *b)
    }

    /// Keeps `entry` for `hash` as `owner`'s (compiled PTX replaces its CUDA
    /// C), within `cap` bytes node-wide and `share_cap` for `owner`.
    pub(super) fn insert(
        &mut self,
        hash: ModuleHash,
        entry: ModuleSource,
        owner: &Principal,
        cap: u64,
        share_cap: u64,
    ) {
        let len = entry.1.len() as u64;
        let share_cap = share_cap.min(cap);
        if len > share_cap {
            return;
        }
        self.remove(&hash);
        while self.share(owner) + len > share_cap {
            if !self.evict_oldest_of(owner) {
                break;
            }
        }
        while self.bytes + len > cap {
            let largest = self
                .shares
                .iter()
                .max_by_key(|(_, (_, b))| *b)
                .map(|(p, _)| p.clone());
            if !largest.is_some_and(|p| self.evict_oldest_of(&p)) {
                break;
            }
        }
        self.bytes += len;
        let (order, bytes) = self.shares.entry(owner.clone()).or_default();
        order.push_back(hash);
        *bytes += len;
        self.map.insert(hash, (entry, owner.clone()));
    }
}
