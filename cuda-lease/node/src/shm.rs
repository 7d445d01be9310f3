//! The bulk-data ring a node shares with one worker process, and the
//! shared files it and the principals' budgets ([`crate::budget`]) live in.
//!
//! MEM_WRITE and MEM_READ data skips the pipe: both sides map a file of
//! [`SLOTS`] slots of [`SLOT_BYTES`] (in `/dev/shm` where it exists), and
//! each chunk travels as a slot number in a pipe message.
//!
//! On the node a slot is held by one [`Slot`] guard until the worker's
//! reply; the worker touches a slot only while serving a message naming it.
//! The pipe orders the accesses.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use memmap2::MmapRaw;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::lock;

/// Bytes per slot: the chunk size of streamed transfers.
pub(crate) const SLOT_BYTES: usize = 2 << 20;
/// Slots per ring (per worker).
pub(crate) const SLOTS: usize = 16;
/// The environment variable that gives a worker the ring's path.
pub(crate) const SHM_ENV: &str = "CUDA_LEASE_WORKER_SHM";

const RING_BYTES: usize = SLOT_BYTES * SLOTS;

fn map(file: &File, len: usize) -> std::io::Result<MmapRaw> {
    let map = MmapRaw::map_raw(file)?;
    if map.len() < len {
        return Err(std::io::Error::other(format!(
            "shared file is {} bytes, expected {len}",
            map.len()
        )));
    }
    Ok(map)
}

/// The node's side of a ring: the mapping and the free slots.
#[derive(Debug)]
pub(crate) struct ShmRing {
    map: MmapRaw,
    path: PathBuf,
    free: Mutex<Vec<u32>>,
    permits: Arc<Semaphore>,
}

/// Creates a file of `len` zero bytes readable only by this user (in
/// `/dev/shm` where it exists) and maps it; the file is removed again if
/// it cannot be sized or mapped. The caller removes it when done.
pub(crate) fn create_shared(len: usize) -> std::io::Result<(MmapRaw, PathBuf)> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let mut nonce = [0u8; 8];
    getrandom::fill(&mut nonce).map_err(|e| std::io::Error::other(e.to_string()))?;
    let path = dir.join(format!(
        "cuda-lease-{}-{}-{:016x}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed),
        u64::from_le_bytes(nonce)
    ));
    let mut opts = OpenOptions::new();
    opts.read(true).write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let file = opts.open(&path)?;
    match file.set_len(len as u64).and_then(|()| map(&file, len)) {
        Ok(m) => Ok((m, path)),
        Err(e) => {
            let _ = std::fs::remove_file(&path);
            Err(e)
        }
    }
}

/// Maps the file another process made with [`create_shared`], which must
/// hold at least `len` bytes.
pub(crate) fn open_shared(path: &Path, len: usize) -> std::io::Result<MmapRaw> {
    let file = OpenOptions::new().read(true).write(true).open(path)?;
    map(&file, len)
}

impl ShmRing {
    /// Creates and maps a ring file readable only by this user; removed on
    /// drop, or by [`ShmRing::unlink`] once the worker mapped it.
    pub(crate) fn create() -> std::io::Result<Self> {
        let (map, path) = create_shared(RING_BYTES)?;
        Ok(ShmRing {
            map,
            path,
            free: Mutex::new((0..SLOTS as u32).rev().collect()),
            permits: Arc::new(Semaphore::new(SLOTS)),
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Removes the file; both mappings stay valid.
    pub(crate) fn unlink(&self) {
        let _ = std::fs::remove_file(&self.path);
    }

    pub(crate) async fn acquire(self: &Arc<Self>) -> Slot {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .expect("the ring's semaphore is never closed");
        self.slot_of(permit)
    }

    pub(crate) fn try_acquire(self: &Arc<Self>) -> Option<Slot> {
        let permit = self.permits.clone().try_acquire_owned().ok()?;
        Some(self.slot_of(permit))
    }

    fn slot_of(self: &Arc<Self>, permit: OwnedSemaphorePermit) -> Slot {
        let index = lock(&self.free)
            .pop()
            .expect("a permit implies a free slot");
        Slot {
            ring: self.clone(),
            index,
            _permit: permit,
        }
    }
}

impl Drop for ShmRing {
    fn drop(&mut self) {
        self.unlink();
    }
}

/// One slot of a ring, held exclusively on the node's side.
pub(crate) struct Slot {
    ring: Arc<ShmRing>,
    index: u32,
    // Dropped after `Drop::drop` has returned the index to the free list.
    _permit: OwnedSemaphorePermit,
}

impl Slot {
    /// The slot's number, as told to the worker.
    pub(crate) fn index(&self) -> u32 {
        self.index
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: the slot lies inside the mapping (index < SLOTS, which is
        // RING_BYTES long); this guard is its only holder in this process,
        // and the worker touches it only while the node awaits its reply to
        // a message naming it (during which the node does not use it).
        unsafe {
            std::slice::from_raw_parts(
                self.ring.map.as_ptr().add(self.index as usize * SLOT_BYTES),
                SLOT_BYTES,
            )
        }
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`; `&mut self` makes this the only reference
        // in this process.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.ring
                    .map
                    .as_mut_ptr()
                    .add(self.index as usize * SLOT_BYTES),
                SLOT_BYTES,
            )
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        lock(&self.ring.free).push(self.index);
    }
}

/// The worker's side of a ring.
pub(crate) struct WorkerRing {
    map: MmapRaw,
}

impl WorkerRing {
    /// Maps the ring the node created at `path`.
    pub(crate) fn open(path: &Path) -> std::io::Result<Self> {
        Ok(WorkerRing {
            map: open_shared(path, RING_BYTES)?,
        })
    }

    /// The whole ring's address and length (to register it with a device).
    pub(crate) fn raw_parts(&mut self) -> (*mut u8, usize) {
        (self.map.as_mut_ptr(), RING_BYTES)
    }

    /// The first `len` bytes of slot `index`, while serving a message naming it.
    ///
    /// # Errors
    /// A slot number or length out of range.
    pub(crate) fn slot(&mut self, index: u32, len: u32) -> Result<&mut [u8], String> {
        if index as usize >= SLOTS || len as usize > SLOT_BYTES {
            return Err(format!("slot {index} / length {len} out of range"));
        }
        // SAFETY: inside the mapping (checked above); the node does not
        // touch the slot while it waits for our reply to this message, and
        // `&mut self` keeps this the only reference in this process.
        Ok(unsafe {
            std::slice::from_raw_parts_mut(
                self.map.as_mut_ptr().add(index as usize * SLOT_BYTES),
                len as usize,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn slots_are_exclusive_and_shared_with_the_other_side() {
        let ring = Arc::new(ShmRing::create().unwrap());
        let mut worker = WorkerRing::open(ring.path()).unwrap();
        ring.unlink();
        let mut a = ring.acquire().await;
        let b = ring.acquire().await;
        assert_ne!(a.index(), b.index());
        a.bytes_mut()[..5].copy_from_slice(b"hello");
        assert_eq!(&worker.slot(a.index(), 5).unwrap()[..], b"hello");
        worker.slot(b.index(), 3).unwrap().copy_from_slice(b"abc");
        assert_eq!(&b.bytes()[..3], b"abc");
        assert!(worker.slot(SLOTS as u32, 1).is_err());
        assert!(worker.slot(0, SLOT_BYTES as u32 + 1).is_err());
        // All slots taken: the next waits until one is given back.
        let mut held = vec![a, b];
        for _ in 2..SLOTS {
            held.push(ring.acquire().await);
        }
        let waiting = tokio::time::timeout(std::time::Duration::from_millis(50), ring.acquire());
        assert!(waiting.await.is_err());
        let freed = held.pop().unwrap().index();
        assert_eq!(ring.acquire().await.index(), freed);
    }
}
