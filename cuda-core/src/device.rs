//! Device inventory and the process-wide context per device.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaStream};

use crate::error::{DriverResultExt, Error, Result};

/// Whether `libcuda` can be loaded. Cached after the first call.
///
/// cudarc panics when a driver function is called and `libcuda` is missing;
/// every entry point of this crate checks this first and returns
/// [`Error::NoDriver`] instead.
pub fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` only tries to dlopen the library by name and
    // drops the handle; it has no preconditions.
    *PRESENT.get_or_init(|| unsafe { cudarc::driver::sys::is_culib_present() })
}

/// Whether `libnvrtc` can be loaded. Cached after the first call.
pub fn nvrtc_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: as for `driver_present`: a dlopen probe with no preconditions.
    *PRESENT.get_or_init(|| unsafe { cudarc::nvrtc::sys::is_culib_present() })
}

/// Returns `Err(Error::NoDriver)` unless the driver library is loadable.
pub fn require_driver() -> Result<()> {
    if driver_present() {
        Ok(())
    } else {
        Err(Error::NoDriver)
    }
}

/// Set once this crate has started the driver (every path to a device
/// goes through [`device_count`]).
static STARTED: AtomicBool = AtomicBool::new(false);

/// The environment variable the driver reads for its hardware queues.
const QUEUES_ENV: &str = "CUDA_DEVICE_MAX_CONNECTIONS";

/// The most hardware work queues a device takes.
pub const MAX_HARDWARE_QUEUES: u32 = 32;

/// The driver's default number of hardware work queues per device.
pub const DEFAULT_HARDWARE_QUEUES: u32 = 8;

/// Sets how many hardware work queues each device gets
/// (`CUDA_DEVICE_MAX_CONNECTIONS`, 8 by default, at most 32). Streams
/// share these queues: with more busy streams than queues, work of two
/// streams that landed on one queue runs in turn, so N-way overlap
/// needs N queues (and a pool of more than N streams: see
/// `StreamPoolRoundRobin::new` in `cuda-async`). The driver reads it once,
/// when it starts: call this first thing in `main`, before any other
/// thread runs and before any device is opened. It overrides the
/// variable if the environment set it.
///
/// # Errors
/// [`Error::InvalidArgument`] for 0 or more than [`MAX_HARDWARE_QUEUES`],
/// or once this process has started the driver (too late to take
/// effect).
///
/// # Examples
///
/// ```no_run
/// // 32 kernels on 32 streams run at once, not 8 at a time.
/// cuda_core::set_hardware_queues(32)?;
/// let dev = cuda_core::Device::new(0)?;
/// # Ok::<(), cuda_core::Error>(())
/// ```
pub fn set_hardware_queues(n: u32) -> Result<()> {
    if !(1..=MAX_HARDWARE_QUEUES).contains(&n) {
        return Err(Error::InvalidArgument(format!(
            "set_hardware_queues({n}): a device takes 1 to {MAX_HARDWARE_QUEUES} hardware queues"
        )));
    }
    if STARTED.load(Ordering::Acquire) {
        return Err(Error::InvalidArgument(format!(
            "set_hardware_queues({n}) comes too late: this process has started the CUDA \
             driver, which reads {QUEUES_ENV} once; call it first thing in main"
        )));
    }
    std::env::set_var(QUEUES_ENV, n.to_string());
    Ok(())
}

/// The hardware work queues per device the driver took when this crate
/// started it (or, before that, would take): `CUDA_DEVICE_MAX_CONNECTIONS`,
/// else [`DEFAULT_HARDWARE_QUEUES`].
pub fn hardware_queues() -> u32 {
    TAKEN.get().copied().unwrap_or_else(queues_from_env)
}

/// What the driver took, read when this crate started it.
static TAKEN: OnceLock<u32> = OnceLock::new();

fn queues_from_env() -> u32 {
    std::env::var(QUEUES_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|n| (1..=MAX_HARDWARE_QUEUES).contains(n))
        .unwrap_or(DEFAULT_HARDWARE_QUEUES)
}

/// How many CUDA devices the driver reports.
///
/// # Errors
/// [`Error::NoDriver`] without a driver; a driver error if `cuInit` fails.
pub fn device_count() -> Result<usize> {
    require_driver()?;
    STARTED.store(true, Ordering::Release);
    TAKEN.get_or_init(queues_from_env);
    let n = CudaContext::device_count().call("cuDeviceGetCount")?;
    Ok(n.max(0) as usize)
}

/// One GPU, through its primary context; cheap to clone.
///
/// `Device::new(n)` returns the same context for the same ordinal
/// everywhere in the process.
#[derive(Clone)]
pub struct Device {
    ctx: Arc<CudaContext>,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.ordinal())
            .finish()
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.ctx, &other.ctx) || self.ctx.cu_ctx() == other.ctx.cu_ctx()
    }
}
impl Eq for Device {}

/// A snapshot of one device's properties.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The driver's ordinal.
    pub ordinal: usize,
    /// The marketing name (e.g. `NVIDIA H100 80GB HBM3`).
    pub name: String,
    /// Compute capability, (major, minor).
    pub compute_capability: (u32, u32),
    /// Total device memory in bytes.
    pub total_memory: usize,
    /// Free device memory in bytes at the time of the query.
    pub free_memory: usize,
    /// Streaming multiprocessors (SMs).
    pub multiprocessors: u32,
    /// Threads per warp.
    pub warp_size: u32,
    /// Most threads in one block.
    pub max_threads_per_block: u32,
    /// Most threads resident on one multiprocessor.
    pub max_threads_per_multiprocessor: u32,
    /// Shared memory one block may use without opting in, in bytes.
    pub shared_memory_per_block: usize,
    /// Shared memory one block may use when its kernel opts in to more
    /// (`cuFuncSetAttribute`), in bytes.
    pub shared_memory_per_block_optin: usize,
    /// Shared memory of one multiprocessor, in bytes.
    pub shared_memory_per_multiprocessor: usize,
    /// L2 cache, in bytes.
    pub l2_cache_bytes: usize,
    /// Width of the memory bus, in bits.
    pub memory_bus_width_bits: u32,
    /// Peak SM clock in kHz (`None` where the driver no longer reports it).
    pub clock_khz: Option<u32>,
    /// Peak memory clock in kHz (`None` where the driver no longer reports
    /// it).
    pub memory_clock_khz: Option<u32>,
}

/// A device attribute for [`Device::attribute`] (the driver's
/// `CUdevice_attribute`).
pub use cudarc::driver::sys::CUdevice_attribute as DeviceAttribute;

fn contexts() -> &'static Mutex<Vec<Option<Device>>> {
    static CONTEXTS: OnceLock<Mutex<Vec<Option<Device>>>> = OnceLock::new();
    CONTEXTS.get_or_init(|| Mutex::new(Vec::new()))
}

impl Device {
    /// The device with this ordinal (its primary context, retained once per
    /// process).
    ///
    /// # Errors
    /// [`Error::NoDriver`] without a driver, [`Error::NoSuchDevice`] for an
    /// ordinal past the last device, a driver error if the context cannot be
    /// created.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// let dev = cuda_core::Device::new(0)?;
    /// println!("{}", dev.info()?.name);
    /// # Ok::<(), cuda_core::Error>(())
    /// ```
    pub fn new(ordinal: usize) -> Result<Self> {
        require_driver()?;
        let mut slots = contexts().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(Some(dev)) = slots.get(ordinal) {
            return Ok(dev.clone());
        }
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::NoSuchDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).call("cuDevicePrimaryCtxRetain")?;
        // SAFETY: cudarc's per-slice event tracking is turned off for the
        // context this crate opens: every buffer made here orders its own
        // uses with its own events (`DeviceBuffer`, `PinnedBuffer`), so
        // cudarc's tracking only duplicated that work; and its waits break
        // CUDA graph captures (a wait on an event recorded outside a capture
        // invalidates it). Contexts of streams made by other code
        // (`Device::of_stream`) keep their own setting.
        unsafe { ctx.disable_event_tracking() };
        let dev = Device { ctx };
        if slots.len() <= ordinal {
            slots.resize(ordinal + 1, None);
        }
        slots[ordinal] = Some(dev.clone());
        Ok(dev)
    }

    /// The device that owns `stream` (for streams created by other code).
    pub fn of_stream(stream: &CudaStream) -> Self {
        Device {
            ctx: stream.context().clone(),
        }
    }

    /// The driver ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The cudarc context (for interop with code that uses cudarc directly).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Keeps up to `bytes` of freed stream-ordered memory reserved in the
    /// device's default memory pool across synchronizations.
    ///
    /// The driver's default (0) hands freed memory back to the system at
    /// every synchronization, so the first allocation after one maps memory
    /// again (about 140 us for a small buffer on an H100, against 20 us
    /// from a warm pool). A long-lived process that allocates and
    /// synchronizes in a loop (a server of remote GPUs) keeps it instead; the
    /// memory stays reserved to this process until it exits or the
    /// threshold is lowered.
    ///
    /// # Errors
    /// A driver error.
    pub fn set_mem_pool_release_threshold(&self, bytes: u64) -> Result<()> {
        use cudarc::driver::sys;
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::driver("cuCtxSetCurrent", e))?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `pool` is a valid out-pointer; the device handle is live
        // with its context.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device()) }
            .result()
            .map_err(|e| Error::driver("cuDeviceGetDefaultMemPool", e))?;
        let mut value = bytes;
        // SAFETY: the attribute takes a pointer to a u64 (cuuint64_t).
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut value as *mut u64).cast(),
            )
        }
        .result()
        .map_err(|e| Error::driver("cuMemPoolSetAttribute", e))
    }

    /// Creates a new non-blocking stream on this device.
    ///
    /// # Errors
    /// A driver error if `cuStreamCreate` fails.
    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        self.ctx.new_stream().call("cuStreamCreate")
    }

    /// Name, compute capability and memory of this device.
    ///
    /// # Errors
    /// A driver error if a query fails.
    pub fn info(&self) -> Result<DeviceInfo> {
        use DeviceAttribute as A;
        let name = self.ctx.name().call("cuDeviceGetName")?;
        let (major, minor) = self.ctx.compute_capability().call("cuDeviceGetAttribute")?;
        let (free_memory, total_memory) = self.ctx.mem_get_info().call("cuMemGetInfo")?;
        let count = |a: A| self.attribute(a).map(|v| v.max(0) as u32);
        let bytes = |a: A| self.attribute(a).map(|v| v.max(0) as usize);
        Ok(DeviceInfo {
            ordinal: self.ordinal(),
            name,
            compute_capability: (major as u32, minor as u32),
            total_memory,
            free_memory,
            multiprocessors: count(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            warp_size: count(A::CU_DEVICE_ATTRIBUTE_WARP_SIZE)?,
            max_threads_per_block: count(A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
            max_threads_per_multiprocessor: count(
                A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR,
            )?,
            shared_memory_per_block: bytes(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK)?,
            shared_memory_per_block_optin: bytes(
                A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )?,
            shared_memory_per_multiprocessor: bytes(
                A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
            )?,
            l2_cache_bytes: bytes(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?,
            memory_bus_width_bits: count(A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)?,
            // Deprecated attributes: a driver may stop answering them.
            clock_khz: count(A::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)
                .ok()
                .filter(|&v| v > 0),
            memory_clock_khz: count(A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)
                .ok()
                .filter(|&v| v > 0),
        })
    }

    /// One attribute of the device, as the driver reports it
    /// (`cuDeviceGetAttribute`): for the ones [`DeviceInfo`] does not hold.
    ///
    /// # Errors
    /// A driver error, named (an attribute this driver does not know).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use cuda_core::{Device, DeviceAttribute};
    /// let dev = Device::new(0)?;
    /// let async_engines = dev.attribute(DeviceAttribute::CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT)?;
    /// println!("{async_engines} copy engines");
    /// # Ok::<(), cuda_core::Error>(())
    /// ```
    pub fn attribute(&self, attribute: DeviceAttribute) -> Result<i32> {
        self.ctx.attribute(attribute).call("cuDeviceGetAttribute")
    }

    /// `(major, minor)` compute capability.
    ///
    /// # Errors
    /// A driver error if the query fails.
    pub fn compute_capability(&self) -> Result<(u32, u32)> {
        let (major, minor) = self.ctx.compute_capability().call("cuDeviceGetAttribute")?;
        Ok((major as u32, minor as u32))
    }

    /// `(free, total)` device memory in bytes.
    ///
    /// # Errors
    /// A driver error if the query fails.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().call("cuMemGetInfo")
    }
}

/// The properties of every device the driver reports.
///
/// # Errors
/// [`Error::NoDriver`] without a driver; a driver error if a query fails.
///
/// # Examples
///
/// ```no_run
/// for d in cuda_core::devices()? {
///     println!("{}: {} sm_{}{}", d.ordinal, d.name, d.compute_capability.0, d.compute_capability.1);
/// }
/// # Ok::<(), cuda_core::Error>(())
/// ```
pub fn devices() -> Result<Vec<DeviceInfo>> {
    (0..device_count()?)
        .map(|i| Device::new(i)?.info())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hardware_queues_are_bounded_and_set_only_before_the_driver_starts() {
        for bad in [0, MAX_HARDWARE_QUEUES + 1] {
            let e = set_hardware_queues(bad).unwrap_err().to_string();
            assert!(e.contains("1 to 32"), "{e}");
        }
        if !STARTED.load(Ordering::Acquire) {
            set_hardware_queues(12).unwrap();
            assert_eq!(hardware_queues(), 12);
            // What the driver takes is fixed when it starts.
            if device_count().is_ok() {
                std::env::set_var(QUEUES_ENV, "3");
                assert_eq!(hardware_queues(), 12);
            }
        }
        // Once the driver has started (or was asked to), too late.
        let _ = device_count();
        if driver_present() {
            let e = set_hardware_queues(16).unwrap_err().to_string();
            assert!(e.contains("too late"), "{e}");
        }
    }

    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        if driver_present() {
            return; // this check is about machines without a driver
        }
        assert!(matches!(Device::new(0), Err(Error::NoDriver)));
        assert!(matches!(devices(), Err(Error::NoDriver)));
        assert!(matches!(device_count(), Err(Error::NoDriver)));
    }
}
