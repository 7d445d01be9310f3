//! [`DevicePool`]: a scheduling policy over several GPUs of the process,
//! placing each submission on one of them; [`to_device`]: moving a buffer
//! to the device an op runs on.

use std::borrow::Borrow;
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cuda_core::cudarc::driver::DeviceRepr;
use cuda_core::{Device, Error, Result};

use crate::buffer::DeviceBuffer;
use crate::context::ExecutionContext;
use crate::op::impl_into_future;
use crate::policy::{SchedulingPolicy, StreamPoolRoundRobin};
use crate::spread::{Member, Spread};

/// Copies `src` (a buffer of any local GPU) into a new buffer on `device`,
/// which must be the device the op runs on (schedule the chain there: a
/// policy of that device, or a [`DevicePool`] placement). Across devices it
/// is a peer copy (`cuMemcpyPeerAsync`), ordered by events on both
/// devices: it waits for `src`'s last write, and `src`'s later writes and
/// its free wait for the copy. On the same device it is a plain
/// device-to-device copy.
///
/// Where [`can_access_peer`](crate::can_access_peer) says the two devices
/// reach each other, the first copy between them enables their peer access
/// (contexts and memory pools, both directions, once for the process), so
/// the copy engines move the bytes over NVLink or PCIe directly; where they
/// do not, the driver stages the copy. To keep devices apart, opt out with
/// [`set_auto_peer_access(false)`](crate::set_auto_peer_access) (or
/// `CUDA_ASYNC_PEER_ACCESS=off`) before the first copy: copies then stay
/// staged unless someone enables access with
/// [`enable_peer_access`](crate::enable_peer_access).
///
/// A buffer of device A used by a kernel on device B without it stays an
/// error naming both devices.
///
/// # Errors
/// At execution: [`Error::InvalidArgument`] when the op runs on another
/// device than `device`; [`Error::WrongHome`] for a remote buffer;
/// [`Error::NeedsLocalStream`] on a remote context; [`Error::PeerAccess`]
/// if the driver refuses peer access between the devices; driver errors.
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// use cuda_async::{to_device, Device, SingleStream};
/// let (gpu0, gpu1) = (Device::new(0)?, Device::new(1)?);
/// let a = h2d(vec![1.0f32; 1024]).sync()?; // on the default device, GPU 0
/// let on1 = SingleStream::new(gpu1.new_stream()?)?;
/// let back = to_device(&a, &gpu1).then(d2h).sync_with(&on1)?;
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub fn to_device<T: DeviceRepr, B: Borrow<DeviceBuffer<T>> + Send>(
    src: B,
    device: &Device,
) -> ToDevice<T, B> {
    ToDevice {
        src,
        device: device.clone(),
        _t: PhantomData,
    }
}

/// Op for [`to_device`].
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct ToDevice<T, B> {
    src: B,
    device: Device,
    _t: PhantomData<fn() -> T>,
}

impl<T, B> fmt::Debug for ToDevice<T, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToDevice")
            .field("device", &self.device.ordinal())
            .finish_non_exhaustive()
    }
}

impl<T: DeviceRepr + Send, B: Borrow<DeviceBuffer<T>> + Send> crate::DeviceOp for ToDevice<T, B> {
    type Output = DeviceBuffer<T>;

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<DeviceBuffer<T>> {
        let stream = ctx.cuda_stream_for("to_device")?;
        let here = stream.context().ordinal();
        let there = self.device.ordinal();
        if here != there {
            return Err(Error::InvalidArgument(format!(
                "to_device(.., GPU {there}) runs on a stream of GPU {here}: it copies onto the \
                 device it runs on, so run it with a policy of GPU {there}"
            )));
        }
        let src = self.src.borrow();
        let local = src.local().map_err(|_| Error::WrongHome {
            buffer: src.home(),
            context: ctx.describe(),
        })?;
        Ok(local.copy_to(stream)?.into())
    }
}
impl_into_future!(impl[T: DeviceRepr + Send, B: Borrow<DeviceBuffer<T>> + Send] for ToDevice<T, B>);

/// What a [`Placement`] sees of one device of a [`DevicePool`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceLoad {
    /// The device's ordinal.
    pub ordinal: usize,
    /// Submissions placed on it whose GPU work has not finished yet.
    pub in_flight: usize,
}

/// A user-supplied placement: given every device's load, in the pool's
/// order, the index (into that slice) of the device for the next
/// submission.
pub type PlaceFn = dyn Fn(&[DeviceLoad]) -> usize + Send + Sync;

/// How a [`DevicePool`] picks the device of each submission.
#[derive(Clone)]
pub enum Placement {
    /// Each device in turn.
    RoundRobin,
    /// The device with the fewest submissions in flight (ties in turn).
    LeastLoaded,
    /// The escape hatch: a closure that sees every device's load.
    Custom(Arc<PlaceFn>),
}

impl fmt::Debug for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::RoundRobin => f.write_str("RoundRobin"),
            Placement::LeastLoaded => f.write_str("LeastLoaded"),
            Placement::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

impl Placement {
    /// The index of the device for the submission numbered `turn`.
    fn pick(&self, loads: &[DeviceLoad], turn: usize) -> Result<usize> {
        let n = loads.len();
        if n == 0 {
            return Err(Error::InvalidArgument(
                "a device pool with no device".into(),
            ));
        }
        let i = match self {
            Placement::RoundRobin => turn % n,
            Placement::LeastLoaded => {
                let least = loads.iter().map(|l| l.in_flight).min().unwrap_or(0);
                // Among the least loaded, the next in turn.
                (0..n)
                    .map(|k| (turn + k) % n)
                    .find(|&i| loads[i].in_flight == least)
                    .unwrap_or(turn % n)
            }
            Placement::Custom(f) => f(loads),
        };
        if i >= n {
            return Err(Error::InvalidArgument(format!(
                "the device pool's placement picked device index {i}, but the pool has {n} \
                 devices (indices 0..{n})"
            )));
        }
        Ok(i)
    }
}

/// A scheduling policy over several devices: each submission (a whole
/// chain: every op of it runs on the device picked for it) goes to one
/// device's stream pool, chosen by its [`Placement`] (round-robin by
/// default).
///
/// A device's load is its submissions in flight: counted from placement
/// until the GPU has finished their work (or, for a submission that
/// enqueues nothing, until it returns). Buffers stay on the device that
/// made them: an op on another device uses them through [`to_device`] (a
/// peer copy); used directly, they are an error naming both devices.
///
/// By default the concurrent arms of a submission (`zip`, `join_all`) run
/// on its device's other streams. With [`DevicePool::spread_arms`] they go
/// to the pool's devices in turn, and the join waits for each device's
/// arm.
///
/// On a host with one GPU, [`DevicePool::all`] is a pool of that one.
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// use cuda_async::{DevicePool, Placement};
/// let gpus = DevicePool::all()?.with_placement(Placement::LeastLoaded);
/// // Eight independent pipelines, each placed on one device.
/// let outs: Vec<Vec<f32>> = (0..8)
///     .map(|i| h2d(vec![i as f32; 1024]).then(d2h).sync_with(&gpus)?.to_vec())
///     .collect::<Result<_, _>>()?;
/// assert_eq!(outs[3][0], 3.0);
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub struct DevicePool {
    /// Shared with the contexts of a pool that spreads arms.
    members: Arc<[Member]>,
    placement: Placement,
    next: AtomicUsize,
    /// Set by [`DevicePool::spread_arms`].
    spread_arms: bool,
}

impl fmt::Debug for DevicePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DevicePool")
            .field("loads", &self.loads())
            .field("placement", &self.placement)
            .field("spread_arms", &self.spread_arms)
            .finish()
    }
}

impl DevicePool {
    /// Every visible device, each with its default stream pool.
    ///
    /// # Errors
    /// No driver, or no device.
    pub fn all() -> Result<Self> {
        let n = cuda_core::device_count()?;
        Self::new(&(0..n).collect::<Vec<_>>())
    }

    /// The devices `ordinals` (in this order), each with its default
    /// stream pool.
    ///
    /// # Errors
    /// An empty or repeated list, no driver, or a device that does not
    /// exist.
    pub fn new(ordinals: &[usize]) -> Result<Self> {
        if ordinals.is_empty() {
            return Err(Error::InvalidArgument(
                "a device pool needs at least one device".into(),
            ));
        }
        for (i, o) in ordinals.iter().enumerate() {
            if ordinals[..i].contains(o) {
                return Err(Error::InvalidArgument(format!(
                    "device {o} is listed twice in a device pool"
                )));
            }
        }
        let members = ordinals
            .iter()
            .map(|&o| {
                let device = Device::new(o)?;
                Ok(Member {
                    policy: StreamPoolRoundRobin::default_for(&device)?,
                    in_flight: Arc::new(AtomicUsize::new(0)),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(DevicePool {
            members: members.into(),
            placement: Placement::RoundRobin,
            next: AtomicUsize::new(0),
            spread_arms: false,
        })
    }

    /// The same devices, with the concurrent arms of each submission
    /// (`zip`, `join_all`, `zip!`) spread over them: arm 0 runs on the
    /// submission's device, arm k on the pool's device after it k times
    /// (wrapping), each on that device's next pool stream; the join makes
    /// the submission's stream wait for an event of every arm, and each
    /// arm counts in flight on its device until the submission is done.
    ///
    /// An arm works on its own device: it makes its own buffers (`h2d`,
    /// `zeros`) or moves its inputs with [`to_device`]. A buffer of another
    /// device used directly in an arm is an error naming both devices. The
    /// arms' outputs stay on their devices. With one device, nothing
    /// changes.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use cuda_async::prelude::*;
    /// use cuda_async::DevicePool;
    /// let gpus = DevicePool::all()?.spread_arms();
    /// // Two independent halves, one per GPU (on a 2-GPU host).
    /// let (a, b) = h2d(vec![1.0f32; 1 << 20])
    ///     .then(d2h)
    ///     .zip(h2d(vec![2.0f32; 1 << 20]).then(d2h))
    ///     .sync_with(&gpus)?;
    /// assert_eq!((a.as_slice()?[0], b.as_slice()?[0]), (1.0, 2.0));
    /// # Ok::<(), cuda_async::Error>(())
    /// ```
    pub fn spread_arms(mut self) -> Self {
        self.spread_arms = true;
        self
    }

    /// The same devices, placing submissions by `placement`.
    pub fn with_placement(mut self, placement: Placement) -> Self {
        self.placement = placement;
        self
    }

    /// The same devices, placing each submission where `f` says: it gets
    /// every device's load, in the pool's order, and returns an index into
    /// that slice (an index out of range fails the submission).
    pub fn place_with(self, f: impl Fn(&[DeviceLoad]) -> usize + Send + Sync + 'static) -> Self {
        self.with_placement(Placement::Custom(Arc::new(f)))
    }

    /// Every device's load now, in the pool's order.
    pub fn loads(&self) -> Vec<DeviceLoad> {
        self.members
            .iter()
            .map(|m| DeviceLoad {
                ordinal: m.policy.pool().device().ordinal(),
                in_flight: m.in_flight.load(Ordering::Relaxed),
            })
            .collect()
    }

    /// How many devices the pool has.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Never true: a pool has at least one device.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }
}

impl SchedulingPolicy for DevicePool {
    fn select(&self) -> Result<ExecutionContext> {
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        let i = self.placement.pick(&self.loads(), turn)?;
        let ctx = self.members[i].context()?;
        Ok(if self.spread_arms && self.members.len() > 1 {
            ctx.with_spread(Spread {
                members: self.members.clone(),
                home: i,
            })
        } else {
            ctx
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loads(v: &[usize]) -> Vec<DeviceLoad> {
        v.iter()
            .enumerate()
            .map(|(ordinal, &in_flight)| DeviceLoad { ordinal, in_flight })
            .collect()
    }

    #[test]
    fn round_robin_takes_each_device_in_turn() {
        let l = loads(&[5, 0, 9]);
        let picks: Vec<usize> = (0..6)
            .map(|t| Placement::RoundRobin.pick(&l, t).unwrap())
            .collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn least_loaded_picks_the_fewest_in_flight_and_spreads_ties() {
        assert_eq!(
            Placement::LeastLoaded.pick(&loads(&[3, 1, 2]), 0).unwrap(),
            1
        );
        assert_eq!(
            Placement::LeastLoaded.pick(&loads(&[3, 1, 2]), 7).unwrap(),
            1
        );
        // Ties: the next in turn among the least loaded.
        let l = loads(&[0, 4, 0, 0]);
        let picks: Vec<usize> = (0..4)
            .map(|t| Placement::LeastLoaded.pick(&l, t).unwrap())
            .collect();
        assert_eq!(picks, [0, 2, 2, 3]);
    }

    #[test]
    fn a_custom_placement_is_checked() {
        let last = Placement::Custom(Arc::new(|l: &[DeviceLoad]| l.len() - 1));
        assert_eq!(last.pick(&loads(&[0, 0]), 0).unwrap(), 1);
        let bad = Placement::Custom(Arc::new(|l: &[DeviceLoad]| l.len()));
        let e = bad.pick(&loads(&[0, 0]), 0).unwrap_err().to_string();
        assert!(e.contains("index 2") && e.contains("2 devices"), "{e}");
        assert!(Placement::RoundRobin.pick(&[], 0).is_err());
    }

    #[test]
    fn a_pool_lists_each_device_once() {
        let e = DevicePool::new(&[]).unwrap_err().to_string();
        assert!(e.contains("at least one device"), "{e}");
        let e = DevicePool::new(&[0, 1, 0]).unwrap_err().to_string();
        assert!(e.contains("device 0 is listed twice"), "{e}");
    }
}
