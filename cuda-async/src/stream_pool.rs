//! [`StreamPool`]: a fixed set of streams on one device, which policies
//! hand out and concurrent arms fork onto, and the process-wide pool of
//! each device.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cuda_core::cudarc::driver::CudaStream;
use cuda_core::{Device, Error, Result};

use crate::reactor::StreamSlot;

/// The default number of streams in a device's pool.
pub const DEFAULT_POOL_STREAMS: usize = 4;

/// A fixed set of streams on one device, handed out round-robin.
pub struct StreamPool {
    device: Device,
    streams: Vec<Arc<CudaStream>>,
    slots: OnceLock<Vec<Option<Arc<StreamSlot>>>>,
    next: AtomicUsize,
}

impl fmt::Debug for StreamPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamPool")
            .field("device", &self.device.ordinal())
            .field("streams", &self.streams.len())
            .finish()
    }
}

impl StreamPool {
    /// A new pool of `n` fresh non-blocking streams.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `n == 0`; a driver error if a stream
    /// cannot be created.
    pub fn new(device: &Device, n: usize) -> Result<Arc<Self>> {
        if n == 0 {
            return Err(Error::InvalidArgument(
                "a stream pool needs at least one stream".into(),
            ));
        }
        let streams = (0..n)
            .map(|_| device.new_stream())
            .collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(StreamPool {
            device: device.clone(),
            streams,
            slots: OnceLock::new(),
            next: AtomicUsize::new(0),
        }))
    }

    /// The process-wide pool of `device` ([`DEFAULT_POOL_STREAMS`] streams),
    /// created on first use. Every thread shares it.
    ///
    /// # Errors
    /// As [`StreamPool::new`].
    pub fn default_for(device: &Device) -> Result<Arc<Self>> {
        static POOLS: PerDevice<Arc<StreamPool>> = PerDevice::new();
        POOLS.get_or_try_init(device.ordinal(), || {
            StreamPool::new(device, DEFAULT_POOL_STREAMS)
        })
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The streams, in round-robin order.
    pub fn streams(&self) -> &[Arc<CudaStream>] {
        &self.streams
    }

    /// Number of streams.
    pub fn len(&self) -> usize {
        self.streams.len()
    }

    /// Always false: a pool has at least one stream.
    pub fn is_empty(&self) -> bool {
        self.streams.is_empty()
    }

    /// The reactor slots of the streams (created on first use).
    pub(crate) fn slot(&self, i: usize) -> Option<Arc<StreamSlot>> {
        self.slots
            .get_or_init(|| {
                self.streams
                    .iter()
                    .map(|s| StreamSlot::new(&self.device, s))
                    .collect()
            })
            .get(i)
            .cloned()
            .flatten()
    }

    /// The next index in round-robin order.
    pub fn next_index(&self) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed) % self.streams.len()
    }

    /// The stream for concurrent arm `arm` (1-based) of work forked from
    /// `parent`: the pool streams after `parent`'s, wrapping, skipping
    /// `parent` itself. Returns `None` when the arm must share `parent`
    /// (a pool of one stream).
    pub fn fork_stream(&self, parent: &CudaStream, arm: usize) -> Option<&Arc<CudaStream>> {
        let parent_pos = self
            .streams
            .iter()
            .position(|s| s.cu_stream() == parent.cu_stream());
        fork_index(self.streams.len(), parent_pos, arm).map(|i| &self.streams[i])
    }
}

/// Which pool stream arm `arm` (1-based) of a fork runs on: the streams
/// after the parent's, wrapping, never the parent's own (`None`: share the
/// parent, for a pool of one). A parent outside the pool (interop) forks
/// onto streams 0, 1, 2...
pub(crate) fn fork_index(n: usize, parent_pos: Option<usize>, arm: usize) -> Option<usize> {
    debug_assert!(arm >= 1 && n >= 1);
    match parent_pos {
        Some(_) if n == 1 => None,
        Some(p) => Some((p + 1 + (arm - 1) % (n - 1)) % n),
        None => Some((arm - 1) % n),
    }
}

/// One value per device ordinal, created once and then read without a lock
/// (for the first [`PerDevice::FAST`] ordinals; a locked map beyond).
pub(crate) struct PerDevice<T> {
    fast: [OnceLock<T>; PerDevice::<()>::FAST],
    rest: Mutex<Option<HashMap<usize, T>>>,
}

impl<T> PerDevice<T> {
    const FAST: usize = 16;

    pub(crate) const fn new() -> Self {
        PerDevice {
            fast: [const { OnceLock::new() }; PerDevice::<()>::FAST],
            rest: Mutex::new(None),
        }
    }
}

impl<T: Clone> PerDevice<T> {
    /// The value for `ordinal`, created by `init` the first time (under the
    /// lock, so once even when threads race).
    pub(crate) fn get_or_try_init(
        &self,
        ordinal: usize,
        init: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        if let Some(v) = self.fast.get(ordinal).and_then(OnceLock::get) {
            return Ok(v.clone());
        }
        let mut rest = self.rest.lock().unwrap_or_else(|e| e.into_inner());
        let map = rest.get_or_insert_with(HashMap::new);
        let v = match map.get(&ordinal) {
            Some(v) => v.clone(),
            None => {
                let v = init()?;
                map.insert(ordinal, v.clone());
                v
            }
        };
        if let Some(slot) = self.fast.get(ordinal) {
            let _ = slot.set(v.clone());
        }
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::fork_index;

    #[test]
    fn forks_never_land_on_the_parent_and_spread_evenly() {
        for n in 2..=8 {
            for p in 0..n {
                let mut hits = vec![0usize; n];
                for arm in 1..=(n - 1) * 10 {
                    let i = fork_index(n, Some(p), arm).unwrap();
                    assert_ne!(i, p, "arm {arm} of parent {p} in a pool of {n}");
                    hits[i] += 1;
                }
                for (i, h) in hits.iter().enumerate() {
                    assert_eq!(
                        *h,
                        if i == p { 0 } else { 10 },
                        "pool {n}, parent {p}: {hits:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn per_device_values_are_made_once_and_errors_are_not_kept() {
        use super::PerDevice;
        use std::sync::atomic::{AtomicUsize, Ordering};
        static CACHE: PerDevice<usize> = PerDevice::new();
        let made = AtomicUsize::new(0);
        for ordinal in [0usize, 3, 40, 0, 3, 40] {
            let v = CACHE
                .get_or_try_init(ordinal, || {
                    made.fetch_add(1, Ordering::SeqCst);
                    Ok(ordinal * 10)
                })
                .unwrap();
            assert_eq!(v, ordinal * 10);
        }
        assert_eq!(made.load(Ordering::SeqCst), 3);
        let e = CACHE.get_or_try_init(7, || Err(cuda_core::Error::NoDriver));
        assert!(e.is_err());
        assert_eq!(CACHE.get_or_try_init(7, || Ok(70)).unwrap(), 70);
    }

    #[test]
    fn a_pool_of_one_shares_the_parent() {
        assert_eq!(fork_index(1, Some(0), 1), None);
        assert_eq!(fork_index(1, None, 3), Some(0));
    }

    #[test]
    fn foreign_parents_fork_onto_the_pool_in_order() {
        let got: Vec<_> = (1..=6).map(|a| fork_index(4, None, a).unwrap()).collect();
        assert_eq!(got, vec![0, 1, 2, 3, 0, 1]);
    }
}
