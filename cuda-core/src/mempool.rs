//! Memory pools: where stream-ordered device memory comes from.
//!
//! Every [`DeviceBuffer`](crate::DeviceBuffer) is allocated stream-ordered
//! (`cuMemAllocAsync`) from a memory pool of its device. By default that is
//! the device's *current* pool (the driver's default pool unless
//! [`Device::set_mem_pool`] changed it). A [`MemPool`] is a handle to one
//! pool: its statistics (bytes in use and reserved, now and at their high
//! marks), its release threshold, and a scope
//! ([`MemPool::allocate_in`]) inside which this thread's allocations on
//! the pool's device come from it instead: `cuda-async` runs a policy's ops
//! in that scope when the policy was given a pool.
//!
//! A pool created here ([`MemPool::new`]) is destroyed after its last
//! handle is dropped. Every buffer allocated from it holds a handle until
//! its free is enqueued, and the destroy waits (on the reclaimer thread)
//! until those frees have run, so a pool is never destroyed with memory
//! outstanding (a buffer given away raw, `DeviceBuffer::into_cuda_slice`,
//! keeps its pool for the life of the process).

use std::cell::RefCell;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{sys, CudaSlice, CudaStream, DeviceRepr, DriverError};

use crate::error::DriverResultExt;
use crate::{Device, Result};

/// What to create a pool with ([`MemPool::new`]).
///
/// # Examples
///
/// ```
/// let opts = cuda_core::MemPoolOptions::default()
///     .release_threshold(64 << 20)
///     .max_size(1 << 30);
/// assert_eq!(opts.max_size, Some(1 << 30));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemPoolOptions {
    /// Bytes of freed memory the pool keeps reserved across
    /// synchronizations (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`; the driver's
    /// default, 0, hands freed memory back at every synchronization).
    pub release_threshold: Option<u64>,
    /// The most bytes the pool may reserve (`maxSize`; `None`: the
    /// driver's limit, about the device's memory).
    pub max_size: Option<usize>,
}

impl MemPoolOptions {
    /// Sets [`MemPoolOptions::release_threshold`].
    pub fn release_threshold(mut self, bytes: u64) -> Self {
        self.release_threshold = Some(bytes);
        self
    }

    /// Sets [`MemPoolOptions::max_size`].
    pub fn max_size(mut self, bytes: usize) -> Self {
        self.max_size = Some(bytes);
        self
    }
}

/// A pool's statistics, in bytes ([`MemPool::stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemPoolStats {
    /// Allocated from the pool and not yet freed (a free counts once it
    /// has run on its stream).
    pub used: u64,
    /// The most `used` has been since the pool was made or its high marks
    /// were reset ([`MemPool::reset_high_marks`]).
    pub used_high: u64,
    /// Backed by device memory now: in use, plus freed memory the pool
    /// keeps (see the release threshold).
    pub reserved: u64,
    /// The most `reserved` has been since the last reset.
    pub reserved_high: u64,
}

/// A memory pool of one device: the driver's default pool of a device, its
/// current pool, or one created here. Cloning shares the handle.
///
/// # Examples
///
/// ```no_run
/// use cuda_core::{Device, MemPool, MemPoolOptions};
/// let dev = Device::new(0)?;
/// let pool = MemPool::new(&dev, MemPoolOptions::default().release_threshold(256 << 20))?;
/// let stream = dev.new_stream()?;
/// let buf = pool.allocate_in(|| cuda_core::DeviceBuffer::<f32>::zeros(&stream, 1 << 20))?;
/// stream.synchronize()?;
/// assert!(pool.stats()?.used >= 4 << 20);
/// drop(buf);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct MemPool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    raw: RawPool,
    device: Device,
    /// Created here: destroyed with the last handle.
    owned: bool,
}

/// A `CUmemoryPool`, which the driver lets any thread use.
#[derive(Clone, Copy, PartialEq, Eq)]
struct RawPool(sys::CUmemoryPool);
// SAFETY: a pool handle is an opaque driver object, usable from any
// thread (the driver synchronizes its use).
unsafe impl Send for RawPool {}
// SAFETY: as for `Send`.
unsafe impl Sync for RawPool {}

impl Drop for PoolInner {
    /// The last handle: every buffer of the pool has enqueued its free
    /// (each holds a handle until then). The pool is destroyed on the
    /// reclaimer thread once those frees have run (nothing in use), never
    /// before: the driver mishandles a pool destroyed with memory
    /// outstanding. If that state cannot be read, the pool is leaked.
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let (raw, device) = (self.raw, self.device.clone());
        crate::reclaim::defer_until(
            move || match used_now(raw) {
                Ok(0) => crate::reclaim::Readiness::Ready,
                Ok(_) => crate::reclaim::Readiness::Pending,
                Err(_) => crate::reclaim::Readiness::Failed,
            },
            move || destroy(raw, &device),
        );
    }
}

/// Destroys a pool created by `cuMemPoolCreate`, once, with nothing of it
/// in use.
fn destroy(raw: RawPool, device: &Device) {
    let _ = crate::raw::set_current(device.context());
    // SAFETY: as the doc says (the caller's contract: `PoolInner`'s drop).
    let _ = unsafe { sys::cuMemPoolDestroy(raw.0) };
}

/// `CU_MEMPOOL_ATTR_USED_MEM_CURRENT` of `raw`.
fn used_now(raw: RawPool) -> std::result::Result<u64, DriverError> {
    let mut value = 0u64;
    // SAFETY: the attribute is a cuuint64_t, written through a valid
    // pointer; `raw` is a live pool (destroyed only after this says 0).
    unsafe {
        sys::cuMemPoolGetAttribute(
            raw.0,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
            (&mut value as *mut u64).cast(),
        )
    }
    .result()?;
    Ok(value)
}

impl fmt::Debug for MemPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemPool")
            .field("device", &self.inner.device.ordinal())
            .field("owned", &self.inner.owned)
            .finish_non_exhaustive()
    }
}

impl PartialEq for MemPool {
    /// The same driver pool.
    fn eq(&self, other: &Self) -> bool {
        self.inner.raw == other.inner.raw
    }
}
impl Eq for MemPool {}

/// The pools made current with [`Device::set_mem_pool`], kept alive while
/// they are (a device's current pool must not be destroyed under it).
fn current_pools() -> &'static Mutex<Vec<MemPool>> {
    static CURRENT: OnceLock<Mutex<Vec<MemPool>>> = OnceLock::new();
    CURRENT.get_or_init(Mutex::default)
}

impl MemPool {
    /// Creates a pool of device memory on `device`.
    ///
    /// # Errors
    /// [`Error::NoDriver`](crate::Error::NoDriver) without a driver; the
    /// driver's error from `cuMemPoolCreate` (a device without memory pool
    /// support, a `max_size` it refuses) or from setting the threshold.
    pub fn new(device: &Device, options: MemPoolOptions) -> Result<Self> {
        crate::device::require_driver()?;
        crate::raw::set_current(device.context())?;
        // SAFETY: all-zero is a valid `CUmemPoolProps` (plain integers,
        // enums whose 0 is a valid variant, a null pointer); the fields
        // that matter are set below.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        props.location = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device.context().cu_device(),
        };
        props.maxSize = options.max_size.unwrap_or(0);
        let mut raw: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: valid out-pointer and properties, read during the call.
        unsafe { sys::cuMemPoolCreate(&mut raw, &props) }
            .result()
            .call("cuMemPoolCreate")?;
        let pool = MemPool {
            inner: Arc::new(PoolInner {
                raw: RawPool(raw),
                device: device.clone(),
                owned: true,
            }),
        };
        if let Some(bytes) = options.release_threshold {
            pool.set_release_threshold(bytes)?;
        }
        Ok(pool)
    }

    /// The driver's default pool of `device` (what allocations use unless
    /// [`Device::set_mem_pool`] made another current).
    ///
    /// # Errors
    /// No driver; the driver's error.
    pub fn default_of(device: &Device) -> Result<Self> {
        crate::device::require_driver()?;
        let mut raw: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: valid out-pointer; live device handle.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut raw, device.context().cu_device()) }
            .result()
            .call("cuDeviceGetDefaultMemPool")?;
        Ok(Self::found(device, raw))
    }

    /// The pool `device`'s allocations come from now (outside any
    /// [`MemPool::allocate_in`] scope).
    ///
    /// # Errors
    /// No driver; the driver's error.
    pub fn current_of(device: &Device) -> Result<Self> {
        crate::device::require_driver()?;
        let mut raw: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: valid out-pointer; live device handle.
        unsafe { sys::cuDeviceGetMemPool(&mut raw, device.context().cu_device()) }
            .result()
            .call("cuDeviceGetMemPool")?;
        Ok(Self::found(device, raw))
    }

    /// A handle to an existing pool: the one this process made current,
    /// if it is, else an unowned handle.
    fn found(device: &Device, raw: sys::CUmemoryPool) -> Self {
        let current = current_pools().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = current.iter().find(|p| p.inner.raw.0 == raw) {
            return p.clone();
        }
        MemPool {
            inner: Arc::new(PoolInner {
                raw: RawPool(raw),
                device: device.clone(),
                owned: false,
            }),
        }
    }

    /// The pool's device.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// The driver's handle (for interop; valid while this handle lives).
    pub fn cu_pool(&self) -> sys::CUmemoryPool {
        self.inner.raw.0
    }

    fn get(&self, attr: sys::CUmemPool_attribute) -> Result<u64> {
        let mut value = 0u64;
        // SAFETY: every attribute read here is a cuuint64_t (or a u64
        // threshold), written through a valid pointer.
        unsafe {
            sys::cuMemPoolGetAttribute(self.inner.raw.0, attr, (&mut value as *mut u64).cast())
        }
        .result()
        .call("cuMemPoolGetAttribute")?;
        Ok(value)
    }

    fn set(&self, attr: sys::CUmemPool_attribute, mut value: u64) -> Result<()> {
        // SAFETY: as in `get`; the driver reads the u64 during the call.
        unsafe {
            sys::cuMemPoolSetAttribute(self.inner.raw.0, attr, (&mut value as *mut u64).cast())
        }
        .result()
        .call("cuMemPoolSetAttribute")
    }

    /// The pool's statistics now. A free counts once it has run on its
    /// stream: synchronize first for exact numbers after frees.
    ///
    /// # Errors
    /// The driver's error.
    pub fn stats(&self) -> Result<MemPoolStats> {
        use sys::CUmemPool_attribute as A;
        Ok(MemPoolStats {
            used: self.get(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            used_high: self.get(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
            reserved: self.get(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            reserved_high: self.get(A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
        })
    }

    /// Resets both high marks to the current values.
    ///
    /// # Errors
    /// The driver's error.
    pub fn reset_high_marks(&self) -> Result<()> {
        use sys::CUmemPool_attribute as A;
        // The driver accepts only 0, which resets the mark to the current
        // value.
        self.set(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)?;
        self.set(A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0)
    }

    /// Bytes of freed memory the pool keeps across synchronizations.
    ///
    /// # Errors
    /// The driver's error.
    pub fn release_threshold(&self) -> Result<u64> {
        self.get(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
    }

    /// Keeps up to `bytes` of freed memory reserved across synchronizations
    /// (see [`Device::set_mem_pool_release_threshold`] for why).
    ///
    /// # Errors
    /// The driver's error.
    pub fn set_release_threshold(&self, bytes: u64) -> Result<()> {
        self.set(
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            bytes,
        )
    }

    /// Hands freed memory back until the pool reserves at most `keep`
    /// bytes more than it has in use.
    ///
    /// # Errors
    /// The driver's error.
    pub fn trim_to(&self, keep: usize) -> Result<()> {
        // SAFETY: a live pool handle.
        unsafe { sys::cuMemPoolTrimTo(self.inner.raw.0, keep) }
            .result()
            .call("cuMemPoolTrimTo")
    }

    /// Runs `f` with this thread's device allocations on the pool's device
    /// coming from this pool ([`DeviceBuffer::zeros`](crate::DeviceBuffer::zeros)
    /// and [`DeviceBuffer::uninit`](crate::DeviceBuffer::uninit), and so every
    /// op of `cuda-async` that allocates). Allocations on other devices are
    /// not affected. Scopes nest: the innermost wins, and the outer one is
    /// back when `f` returns (or panics).
    pub fn allocate_in<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Restore(Option<MemPool>);
        impl Drop for Restore {
            fn drop(&mut self) {
                let outer = self.0.take();
                SCOPE.with(|s| *s.borrow_mut() = outer);
            }
        }
        let outer = SCOPE.with(|s| s.replace(Some(self.clone())));
        let _restore = Restore(outer);
        f()
    }
}

impl Device {
    /// Makes `pool` (a pool of this device) the one this device's
    /// allocations come from by default, for every stream of the process
    /// (`cuDeviceSetMemPool`). A pool made current lives until the process
    /// exits, even after another is made current (allocations made from it
    /// meanwhile may still be in use).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a pool
    /// of another device; the driver's error.
    pub fn set_mem_pool(&self, pool: &MemPool) -> Result<()> {
        if pool.device().ordinal() != self.ordinal() {
            return Err(crate::Error::InvalidArgument(format!(
                "a memory pool of GPU {} cannot be GPU {}'s current pool",
                pool.device().ordinal(),
                self.ordinal()
            )));
        }
        let mut current = current_pools().lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: a live device handle and a live pool of that device.
        unsafe { sys::cuDeviceSetMemPool(self.context().cu_device(), pool.cu_pool()) }
            .result()
            .call("cuDeviceSetMemPool")?;
        // Kept for the life of the process, even once another pool is
        // current: allocations made while it was current hold no handle
        // (they come from `cuMemAllocAsync`), and a pool must not be
        // destroyed with allocations outstanding (see `alloc`).
        if !current.contains(pool) {
            current.push(pool.clone());
        }
        Ok(())
    }

    /// The pool this device's allocations come from now
    /// ([`MemPool::current_of`]).
    ///
    /// # Errors
    /// As [`MemPool::current_of`].
    pub fn mem_pool(&self) -> Result<MemPool> {
        MemPool::current_of(self)
    }
}

thread_local! {
    /// The pool of the innermost [`MemPool::allocate_in`] scope.
    static SCOPE: RefCell<Option<MemPool>> = const { RefCell::new(None) };
}

/// The pool of this thread's [`MemPool::allocate_in`] scope, if it is a
/// pool of `stream`'s device: where an allocation on `stream` comes from.
/// Read on the allocating thread (a capture allocates on a helper thread,
/// which has no scope of its own).
pub(crate) fn scoped_for(stream: &CudaStream) -> Option<MemPool> {
    SCOPE.with(|s| {
        s.borrow()
            .as_ref()
            .filter(|p| p.device().context().cu_ctx() == stream.context().cu_ctx())
            .cloned()
    })
}

/// `len` elements of uninitialised stream-ordered memory on `stream`: from
/// `pool` (a pool of `stream`'s device, [`scoped_for`]) when given, else
/// from the device's current pool (cudarc's `alloc`). Returns the pool
/// handle the allocation must keep until its free has run: the driver
/// mishandles a pool destroyed with an allocation outstanding (measured on
/// an H100, driver 580: a later `cuMemPoolDestroy` faults inside libcuda).
///
/// # Safety
/// As `CudaStream::alloc`: the contents are uninitialised.
pub(crate) unsafe fn alloc<T: DeviceRepr>(
    stream: &Arc<CudaStream>,
    len: usize,
    pool: Option<MemPool>,
) -> std::result::Result<(CudaSlice<T>, Option<MemPool>), DriverError> {
    let bytes = len * std::mem::size_of::<T>();
    match pool {
        Some(pool) if bytes > 0 => {
            stream.context().bind_to_thread()?;
            let mut ptr: sys::CUdeviceptr = 0;
            // SAFETY: a valid out-pointer; `pool` is a live pool of the
            // stream's device (held here), `stream` a live stream.
            unsafe {
                sys::cuMemAllocFromPoolAsync(&mut ptr, bytes, pool.cu_pool(), stream.cu_stream())
            }
            .result()?;
            // SAFETY: `ptr` is a fresh allocation of `bytes` bytes of this
            // stream's context, owned by the slice from now on (freed by
            // `cuMemFreeAsync` on drop, as cudarc's own allocations).
            Ok((unsafe { stream.upgrade_device_ptr(ptr, len) }, Some(pool)))
        }
        // SAFETY: forwarded to our caller.
        _ => Ok((unsafe { stream.alloc::<T>(len) }?, None)),
    }
}
