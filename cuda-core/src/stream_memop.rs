//! Stream memory operations: a stream writes a value into memory itself,
//! in order with its other work, with no kernel (`cuStreamWriteValue64`).
//!
//! A stream that writes a number into [`MappedHostMemory`](crate::MappedHostMemory)
//! after some work tells the host that the work is done, without a host
//! callback.

use cudarc::driver::{sys, CudaStream};

use crate::device::{Device, DeviceAttribute};
use crate::error::{DriverResultExt, Result};

impl Device {
    /// Whether streams on this device can write 64-bit values
    /// ([`stream_write_value_64`]): the driver's
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS`.
    ///
    /// # Errors
    /// A driver error naming `cuDeviceGetAttribute`.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// let dev = cuda_core::Device::new(0)?;
    /// if !dev.can_use_64_bit_stream_mem_ops()? {
    ///     println!("falling back to host callbacks");
    /// }
    /// # Ok::<(), cuda_core::Error>(())
    /// ```
    pub fn can_use_64_bit_stream_mem_ops(&self) -> Result<bool> {
        self.attribute(DeviceAttribute::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS)
            .map(|v| v != 0)
    }
}

/// Enqueues on `stream`, after the work already on it, the write of
/// `value` into the 8 bytes at device address `dptr`
/// (`cuStreamWriteValue64` with the default flags: the write is preceded by
/// a memory fence, so everything the stream's earlier work wrote is visible
/// before the value is).
///
/// Check [`Device::can_use_64_bit_stream_mem_ops`] first: without it the
/// call fails.
///
/// # Errors
/// A driver error naming `cuStreamWriteValue64`.
///
/// # Safety
/// `dptr` is a device address, valid in `stream`'s context, of 8 writable
/// bytes aligned to 8 (a word of [`MappedHostMemory`](crate::MappedHostMemory),
/// say), and those bytes stay allocated until the stream has executed the
/// write. Until then, nothing reads or writes them except atomically (the
/// host through an [`AtomicU64`](std::sync::atomic::AtomicU64)).
#[inline]
pub unsafe fn stream_write_value_64(
    stream: &CudaStream,
    dptr: sys::CUdeviceptr,
    value: u64,
) -> Result<()> {
    // SAFETY: the stream is live (the caller's reference); the caller
    // vouches for `dptr` as above; flags 0 is the default write.
    unsafe { sys::cuStreamWriteValue64_v2(stream.cu_stream(), dptr, value, 0) }
        .result()
        .call("cuStreamWriteValue64")
}
