//! The hasher of maps keyed by a lease's ids, streams and module hashes: a
//! multiply per word, not SipHash. A map of one client's ids lives in that
//! client, or in its lease's worker, so colliding ids slow only their
//! owner.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// A multiply-and-rotate hasher over 8-byte words.
#[derive(Debug, Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            let mut b = [0u8; 8];
            b.copy_from_slice(w);
            self.write_u64(u64::from_le_bytes(b));
        }
        for b in words.remainder() {
            self.write_u64(u64::from(*b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x517c_c1b7_2722_0a95);
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(n.into());
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

/// A map keyed by a lease's ids, streams or modules.
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;
/// A set of a lease's ids, streams or modules.
pub type IdSet<K> = HashSet<K, BuildHasherDefault<IdHasher>>;

#[cfg(test)]
#[test]
fn ids_spread_over_the_top_and_bottom_bits() {
    use std::hash::BuildHasher;
    // hashbrown picks a bucket by the low bits and tags it with the top
    // seven: both must tell sequential ids apart.
    let b = BuildHasherDefault::<IdHasher>::default();
    let hashes: Vec<u64> = (0..256u64).map(|i| b.hash_one(crate::Id(i))).collect();
    let low: HashSet<u64> = hashes.iter().map(|h| h & 0xff).collect();
    let top: HashSet<u64> = hashes.iter().map(|h| h >> 57).collect();
    assert!(low.len() > 128, "{} low bytes", low.len());
    assert!(top.len() > 64, "{} top tags", top.len());
}
