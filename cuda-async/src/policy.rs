//! Scheduling policies: which stream an op runs on.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cuda_core::cudarc::driver::CudaStream;
use cuda_core::{Device, MemPool, Result};

use crate::context::ExecutionContext;
use crate::reactor::{slot_for, CompletionMode, StreamSlot};
use crate::stream_pool::PerDevice;

pub use crate::stream_pool::{StreamPool, DEFAULT_POOL_STREAMS};

/// Picks the execution context (the "kitchen") for the next submission.
///
/// Object safe: policies are passed as `&dyn SchedulingPolicy` or
/// `Arc<dyn SchedulingPolicy>`.
pub trait SchedulingPolicy: Send + Sync + fmt::Debug {
    /// The context the next submission should run on.
    ///
    /// # Errors
    /// Whatever stops the policy from providing a context (no driver, a
    /// lost remote session...).
    fn select(&self) -> Result<ExecutionContext>;

    /// This policy, with its ops' allocations on `pool`'s device coming
    /// from `pool` instead of the device's current pool: `zeros`, `h2d`,
    /// `d2d`, `to_device`, every op that allocates (a graph capture, which
    /// runs on no policy, takes its buffers from a pool inside
    /// [`MemPool::allocate_in`](crate::MemPool::allocate_in)). Two
    /// workloads on two pools keep their memory apart, and each pool's
    /// statistics ([`MemPool::stats`](crate::MemPool::stats)) count its
    /// workload alone. Allocations on other devices (arms a
    /// [`DevicePool`](crate::DevicePool) spreads) are not affected.
    ///
    /// # Errors
    /// At `select`: [`Error::InvalidArgument`](crate::Error::InvalidArgument)
    /// for a remote policy (a lease's memory is the node's).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use cuda_async::prelude::*;
    /// use cuda_async::{Device, MemPool, MemPoolOptions, StreamPoolRoundRobin};
    /// let dev = Device::new(0)?;
    /// let pool = MemPool::new(&dev, MemPoolOptions::default())?;
    /// let policy = StreamPoolRoundRobin::default_for(&dev)?.with_mem_pool(pool.clone());
    /// let buf = zeros::<f32>(1 << 20).sync_with(&policy)?;
    /// assert!(pool.stats()?.used >= 4 << 20);
    /// # drop(buf);
    /// # Ok::<(), cuda_async::Error>(())
    /// ```
    fn with_mem_pool(self, pool: MemPool) -> WithMemPool<Self>
    where
        Self: Sized,
    {
        WithMemPool { policy: self, pool }
    }
}

/// A policy whose ops allocate from a chosen memory pool
/// ([`SchedulingPolicy::with_mem_pool`]).
#[derive(Debug, Clone)]
pub struct WithMemPool<P> {
    policy: P,
    pool: MemPool,
}

impl<P> WithMemPool<P> {
    /// The pool.
    pub fn mem_pool(&self) -> &MemPool {
        &self.pool
    }

    /// The policy it wraps.
    pub fn policy(&self) -> &P {
        &self.policy
    }
}

impl<P: SchedulingPolicy> SchedulingPolicy for WithMemPool<P> {
    fn select(&self) -> Result<ExecutionContext> {
        self.policy.select()?.with_mem_pool(self.pool.clone())
    }
}

/// Round-robin over a [`StreamPool`]: consecutive submissions go to
/// consecutive streams, so independent work overlaps.
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// let policy = StreamPoolRoundRobin::default_for(&cuda_async::Device::new(0)?)?;
/// let v = value(41).map(|x| x + 1).schedule(&policy)?;
/// # Ok::<(), cuda_async::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct StreamPoolRoundRobin {
    pool: Arc<StreamPool>,
    completion: CompletionMode,
}

impl StreamPoolRoundRobin {
    /// Round-robin over the process-wide pool of `device`.
    ///
    /// # Errors
    /// As [`StreamPool::default_for`].
    pub fn default_for(device: &Device) -> Result<Self> {
        Ok(StreamPoolRoundRobin {
            pool: StreamPool::default_for(device)?,
            completion: CompletionMode::from_env(),
        })
    }

    /// Round-robin over a new private pool of `n` streams.
    ///
    /// # Errors
    /// As [`StreamPool::new`].
    pub fn new(device: &Device, n: usize) -> Result<Self> {
        Ok(StreamPoolRoundRobin {
            pool: StreamPool::new(device, n)?,
            completion: CompletionMode::from_env(),
        })
    }

    /// The pool.
    pub fn pool(&self) -> &Arc<StreamPool> {
        &self.pool
    }

    /// The same pool, with futures completed by `mode`.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use cuda_async::{CompletionMode, Device, StreamPoolRoundRobin};
    /// let p = StreamPoolRoundRobin::default_for(&Device::new(0)?)?
    ///     .with_completion(CompletionMode::HostCallback);
    /// # Ok::<(), cuda_async::Error>(())
    /// ```
    pub fn with_completion(mut self, mode: CompletionMode) -> Self {
        self.completion = mode;
        self
    }

    /// How futures scheduled by this policy complete.
    pub fn completion(&self) -> CompletionMode {
        self.completion
    }
}

impl StreamPoolRoundRobin {
    /// A context on this thread's stream of the pool: each thread is given
    /// one pool stream (round-robin, on its first call) and keeps it. Used
    /// by blocking `.sync()`, so that threads that each launch and wait do
    /// not queue behind each other's work, and a thread's consecutive ops
    /// stay on one stream.
    pub(crate) fn select_for_thread(&self) -> ExecutionContext {
        use std::cell::Cell;
        thread_local!(static AFFINITY: Cell<usize> = const { Cell::new(usize::MAX) });
        let i = AFFINITY.with(|a| {
            if a.get() == usize::MAX {
                a.set(self.pool.next_index());
            }
            a.get()
        }) % self.pool.streams().len();
        let s = self.pool.streams()[i].clone();
        ExecutionContext::new(self.pool.device().clone(), s, self.pool.clone())
    }
}

impl SchedulingPolicy for StreamPoolRoundRobin {
    fn select(&self) -> Result<ExecutionContext> {
        let i = self.pool.next_index();
        let s = self.pool.streams()[i].clone();
        let ctx = ExecutionContext::new(self.pool.device().clone(), s, self.pool.clone());
        Ok(if self.completion.uses_reactor() {
            ctx.with_completion(self.completion, self.pool.slot(i))
        } else {
            ctx
        })
    }
}

/// Every submission on one stream (serialised; concurrent combinators still
/// fork onto the device's default pool).
#[derive(Debug, Clone)]
pub struct SingleStream {
    stream: Arc<CudaStream>,
    pool: Arc<StreamPool>,
    completion: CompletionMode,
    slot: Option<Arc<StreamSlot>>,
}

impl SingleStream {
    /// Uses `stream`, which may come from other code (interop).
    ///
    /// # Errors
    /// As [`StreamPool::default_for`].
    pub fn new(stream: Arc<CudaStream>) -> Result<Self> {
        let pool = StreamPool::default_for(&Device::of_stream(&stream))?;
        Ok(SingleStream {
            stream,
            pool,
            completion: CompletionMode::HostCallback,
            slot: None,
        }
        .with_completion(CompletionMode::from_env()))
    }

    /// The same stream, with futures completed by `mode`.
    pub fn with_completion(mut self, mode: CompletionMode) -> Self {
        self.completion = mode;
        self.slot = if mode.uses_reactor() {
            slot_for(self.pool.device(), &self.stream)
        } else {
            None
        };
        self
    }

    /// The stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl SchedulingPolicy for SingleStream {
    fn select(&self) -> Result<ExecutionContext> {
        let ctx = ExecutionContext::new(
            self.pool.device().clone(),
            self.stream.clone(),
            self.pool.clone(),
        );
        Ok(ctx.with_completion(self.completion, self.slot.clone()))
    }
}

static DEFAULT_DEVICE: AtomicUsize = AtomicUsize::new(0);

/// Sets the device that `.sync()` and `.await` use (process-wide; default 0).
///
/// # Errors
/// [`Error::NoSuchDevice`](crate::Error::NoSuchDevice) for an ordinal
/// past the last device; [`Error::NoDriver`](crate::Error::NoDriver)
/// without a driver.
pub fn set_default_device(ordinal: usize) -> Result<()> {
    Device::new(ordinal)?;
    DEFAULT_DEVICE.store(ordinal, Ordering::Relaxed);
    Ok(())
}

/// The ordinal `.sync()` and `.await` use.
pub fn default_device() -> usize {
    DEFAULT_DEVICE.load(Ordering::Relaxed)
}

/// The default policy of the default device: round-robin over its
/// process-wide pool.
///
/// # Errors
/// As [`StreamPool::default_for`] and [`Device::new`].
pub fn default_policy() -> Result<Arc<StreamPoolRoundRobin>> {
    static POLICIES: PerDevice<Arc<StreamPoolRoundRobin>> = PerDevice::new();
    let ordinal = default_device();
    POLICIES.get_or_try_init(ordinal, || {
        Ok(Arc::new(StreamPoolRoundRobin::default_for(&Device::new(
            ordinal,
        )?)?))
    })
}
