//! Peer access between the GPUs of this process: whether two devices reach
//! each other's memory directly ([`can_access_peer`]), turning that access
//! on ([`enable_peer_access`]), and the process-wide switch that lets a
//! peer copy ([`DeviceBuffer::copy_to`](crate::DeviceBuffer::copy_to))
//! turn it on by itself ([`set_auto_peer_access`]).
//!
//! Without peer access a copy between two GPUs is staged by the driver and
//! runs at a fraction of the link (measured on two H200s joined by NVLink:
//! about 36 GB/s). With it the copy engines move the bytes over NVLink or
//! PCIe directly. Access is granted twice, because device memory comes
//! from two places: the contexts (`cuCtxEnablePeerAccess`, for
//! `cuMemAlloc` memory) and each device's memory pool
//! (`cuMemPoolSetAccess`, for the stream-ordered `cuMemAllocAsync` memory
//! every [`DeviceBuffer`](crate::DeviceBuffer) of this crate is made of:
//! the devices' current pools when a pair is enabled, and the pool of each
//! buffer a peer copy moves, for buffers of a [`MemPool`](crate::MemPool)
//! that is not current).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{sys, CudaContext};

use crate::{Device, Error, Result};

/// Whether device `a` can read and write device `b`'s memory directly
/// (`cuDeviceCanAccessPeer`): peer copies between them then go over
/// NVLink or PCIe without staging through host memory, once peer access
/// is enabled ([`enable_peer_access`]).
///
/// # Errors
/// A driver error.
pub fn can_access_peer(a: &Device, b: &Device) -> Result<bool> {
    can_reach(a.context(), b.context())
}

fn can_reach(a: &CudaContext, b: &CudaContext) -> Result<bool> {
    let mut yes = 0;
    // SAFETY: writes one int through a valid pointer; both device handles
    // come from live contexts.
    unsafe { sys::cuDeviceCanAccessPeer(&mut yes, a.cu_device(), b.cu_device()) }
        .result()
        .map_err(|e| Error::driver("cuDeviceCanAccessPeer", e))?;
    Ok(yes != 0)
}

/// Lets each of the two devices read and write the other's memory, in
/// both directions: their contexts (`cuCtxEnablePeerAccess`) and their
/// current memory pools (`cuMemPoolSetAccess`). Done once per pair of
/// contexts for the life of the process; later calls (from any thread)
/// return at once. The same device on both sides needs nothing.
///
/// Returns `false`, and changes nothing, when the devices cannot reach each
/// other ([`can_access_peer`] is false either way): copies between them
/// stay staged by the driver.
///
/// Peer access cannot be turned off again through this crate; a process
/// that must keep two devices apart sets
/// [`set_auto_peer_access(false)`](set_auto_peer_access) before its first
/// peer copy and never calls this.
///
/// # Errors
/// [`Error::PeerAccess`] naming the call the driver refused and both
/// devices (for example `CUDA_ERROR_TOO_MANY_PEERS` past the driver's
/// limit of peers per device); the pair may then be half enabled, which
/// leaves copies correct (only slower).
///
/// # Examples
///
/// ```no_run
/// let (gpu0, gpu1) = (cuda_core::Device::new(0)?, cuda_core::Device::new(1)?);
/// if cuda_core::enable_peer_access(&gpu0, &gpu1)? {
///     println!("GPU 0 and GPU 1 copy to each other directly");
/// }
/// # Ok::<(), cuda_core::Error>(())
/// ```
pub fn enable_peer_access(a: &Device, b: &Device) -> Result<bool> {
    enable_between(a.context(), b.context())
}

/// The pairs of contexts (addresses, the smaller first) whose access is
/// settled: `true` enabled, `false` not possible.
fn settled() -> &'static Mutex<HashMap<(usize, usize), bool>> {
    static PAIRS: OnceLock<Mutex<HashMap<(usize, usize), bool>>> = OnceLock::new();
    PAIRS.get_or_init(Mutex::default)
}

pub(crate) fn enable_between(a: &Arc<CudaContext>, b: &Arc<CudaContext>) -> Result<bool> {
    let (pa, pb) = (a.cu_ctx() as usize, b.cu_ctx() as usize);
    if pa == pb {
        return Ok(true);
    }
    let key = (pa.min(pb), pa.max(pb));
    // Held while the pair is enabled, so two threads never race on one
    // pair (the driver would answer the second with "already enabled").
    let mut pairs = settled().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&done) = pairs.get(&key) {
        return Ok(done);
    }
    let possible = can_reach(a, b)? && can_reach(b, a)?;
    if possible {
        grant(a, b)?;
        grant(b, a)?;
    }
    pairs.insert(key, possible);
    Ok(possible)
}

/// Lets `from`'s kernels and copies reach `to`'s memory: its context's
/// and its current pool's.
fn grant(from: &Arc<CudaContext>, to: &Arc<CudaContext>) -> Result<()> {
    let named = |call: &'static str| {
        move |code: cudarc::driver::DriverError| {
            Error::peer_access(call, from.ordinal(), to.ordinal(), code)
        }
    };
    from.bind_to_thread()
        .map_err(|e| Error::driver("cuCtxSetCurrent", e))?;
    // SAFETY: `to`'s context is live (held by the Arc); flags must be 0.
    match unsafe { sys::cuCtxEnablePeerAccess(to.cu_ctx(), 0) } {
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
        other => {
            return Err(named("cuCtxEnablePeerAccess")(cudarc::driver::DriverError(
                other,
            )))
        }
    }
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is a valid out-pointer; the device handle is live with
    // its context.
    unsafe { sys::cuDeviceGetMemPool(&mut pool, to.cu_device()) }
        .result()
        .map_err(named("cuDeviceGetMemPool"))?;
    grant_pool(pool, from, to)
}

/// The pools (addresses) whose memory a device (ordinal) was given.
fn granted_pools() -> &'static Mutex<std::collections::HashSet<(usize, i32)>> {
    static POOLS: OnceLock<Mutex<std::collections::HashSet<(usize, i32)>>> = OnceLock::new();
    POOLS.get_or_init(Mutex::default)
}

/// Lets `from` reach the memory of `pool`, a pool of `to`'s device, once.
fn grant_pool(
    pool: sys::CUmemoryPool,
    from: &Arc<CudaContext>,
    to: &Arc<CudaContext>,
) -> Result<()> {
    let mut granted = granted_pools().lock().unwrap_or_else(|e| e.into_inner());
    if !granted.insert((pool as usize, from.cu_device())) {
        return Ok(());
    }
    let access = sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: from.cu_device(),
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: one descriptor, read during the call; `pool` is a live pool
    // of `to`'s device.
    let set = unsafe { sys::cuMemPoolSetAccess(pool, &access, 1) }.result();
    if let Err(code) = set {
        granted.remove(&(pool as usize, from.cu_device()));
        return Err(Error::peer_access(
            "cuMemPoolSetAccess",
            from.ordinal(),
            to.ordinal(),
            code,
        ));
    }
    Ok(())
}

/// Lets `from` reach the pool that `ptr` (memory of `owner`'s device) was
/// allocated from, when it is pool memory: a [`MemPool`](crate::MemPool) a
/// policy chose is not the device's current pool, which
/// [`enable_peer_access`] covers.
fn grant_pool_of(
    ptr: sys::CUdeviceptr,
    owner: &Arc<CudaContext>,
    from: &Arc<CudaContext>,
) -> Result<()> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: the attribute is a pool handle, written through a valid
    // pointer; `ptr` addresses a live allocation of `owner`'s context.
    let asked = unsafe {
        sys::cuPointerGetAttribute(
            (&mut pool as *mut sys::CUmemoryPool).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
            ptr,
        )
    };
    // Not pool memory (or a driver without the attribute): nothing to add.
    if asked != sys::CUresult::CUDA_SUCCESS || pool.is_null() {
        return Ok(());
    }
    grant_pool(pool, from, owner)
}

const AUTO_UNSET: u8 = 0;
const AUTO_ON: u8 = 1;
const AUTO_OFF: u8 = 2;
static AUTO: AtomicU8 = AtomicU8::new(AUTO_UNSET);

/// Whether a peer copy enables peer access between its two devices by
/// itself (the default). Turned off by [`set_auto_peer_access`], or for
/// the whole process by the environment variable
/// `CUDA_ASYNC_PEER_ACCESS=off` (also `0` or `false`), read at the first
/// peer copy.
pub fn auto_peer_access() -> bool {
    match AUTO.load(Ordering::Relaxed) {
        AUTO_ON => true,
        AUTO_OFF => false,
        _ => {
            let off = std::env::var("CUDA_ASYNC_PEER_ACCESS").is_ok_and(|v| {
                matches!(
                    v.trim().to_ascii_lowercase().as_str(),
                    "off" | "0" | "false"
                )
            });
            let value = if off { AUTO_OFF } else { AUTO_ON };
            // A concurrent `set_auto_peer_access` wins over the environment.
            let _ = AUTO.compare_exchange(AUTO_UNSET, value, Ordering::Relaxed, Ordering::Relaxed);
            AUTO.load(Ordering::Relaxed) == AUTO_ON
        }
    }
}

/// Sets whether peer copies ([`DeviceBuffer::copy_to`](crate::DeviceBuffer::copy_to),
/// and `cuda_async::to_device` on it) enable peer access between their two
/// devices by themselves. Turning it off leaves pairs already enabled as
/// they are: it only stops new ones. With it off a copy between devices
/// whose access nobody enabled is staged by the driver.
///
/// # Examples
///
/// ```
/// cuda_core::set_auto_peer_access(false);
/// assert!(!cuda_core::auto_peer_access());
/// cuda_core::set_auto_peer_access(true);
/// ```
pub fn set_auto_peer_access(on: bool) {
    AUTO.store(if on { AUTO_ON } else { AUTO_OFF }, Ordering::Relaxed);
}

/// Before a copy from `src_ptr` (memory of `src`) to `dst_ptr` (memory
/// of `dst`): enables the contexts' peer access when the automatic switch
/// is on, and gives each device the pool of the other's buffer.
pub(crate) fn before_peer_copy(
    src: &Arc<CudaContext>,
    src_ptr: sys::CUdeviceptr,
    dst: &Arc<CudaContext>,
    dst_ptr: sys::CUdeviceptr,
) -> Result<()> {
    if src.cu_ctx() == dst.cu_ctx() || !auto_peer_access() || !enable_between(src, dst)? {
        return Ok(());
    }
    grant_pool_of(src_ptr, src, dst)?;
    grant_pool_of(dst_ptr, dst, src)
}
