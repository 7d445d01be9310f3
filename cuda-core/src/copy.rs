//! The driver's asynchronous copies and byte fills, as raw calls on a
//! stream: device addresses and byte counts, with no range checks and no
//! ordering. The safe layers (buffers, pinned memory, the staging arena,
//! `cuda-async`'s memory ops) check ranges and order the memory's uses,
//! then enqueue the work through these.
//!
//! Every function returns the driver's error naming its call, and enqueues
//! nothing on error.

use std::ffi::c_void;

use cudarc::driver::{sys, CudaStream};

use crate::error::{DriverResultExt, Result};

/// Enqueues on `stream` a copy of `bytes` bytes from host `src` to device
/// `dst` (`cuMemcpyHtoDAsync`).
///
/// # Safety
/// `dst` addresses `bytes` bytes of device memory of `stream`'s context
/// that no other work uses until the copy is done; `src` addresses `bytes`
/// readable host bytes that stay allocated and unwritten until the copy is
/// done; `stream`'s context is current on this thread.
pub unsafe fn htod_async(
    dst: sys::CUdeviceptr,
    src: *const u8,
    bytes: usize,
    stream: &CudaStream,
) -> Result<()> {
    // SAFETY: the caller's contract above.
    unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast::<c_void>(), bytes, stream.cu_stream()) }
        .result()
        .call("cuMemcpyHtoDAsync")
}

/// Enqueues on `stream` a copy of `bytes` bytes from device `src` to host
/// `dst` (`cuMemcpyDtoHAsync`).
///
/// # Safety
/// `src` addresses `bytes` bytes of device memory of `stream`'s context
/// that no other work writes until the copy is done; `dst` addresses
/// `bytes` writable host bytes that stay allocated, and that the host
/// neither reads nor writes, until the copy is done; `stream`'s context is
/// current on this thread.
pub unsafe fn dtoh_async(
    dst: *mut u8,
    src: sys::CUdeviceptr,
    bytes: usize,
    stream: &CudaStream,
) -> Result<()> {
    // SAFETY: the caller's contract above.
    unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast::<c_void>(), src, bytes, stream.cu_stream()) }
        .result()
        .call("cuMemcpyDtoHAsync")
}

/// Enqueues on `stream` a copy of `bytes` bytes from device `src` to device
/// `dst` (`cuMemcpyDtoDAsync`).
///
/// # Safety
/// Both address `bytes` bytes of device memory of `stream`'s context (or
/// of a peer the context may access), the two ranges do not overlap, no
/// other work writes `src` or uses `dst` until the copy is done, and
/// `stream`'s context is current on this thread.
pub unsafe fn dtod_async(
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    bytes: usize,
    stream: &CudaStream,
) -> Result<()> {
    // SAFETY: the caller's contract above.
    unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream.cu_stream()) }
        .result()
        .call("cuMemcpyDtoDAsync")
}

/// Enqueues on `stream` a fill of `bytes` bytes at device `dst` with
/// `byte` (`cuMemsetD8Async`).
///
/// # Safety
/// `dst` addresses `bytes` bytes of device memory of `stream`'s context
/// that no other work uses until the fill is done, and `stream`'s context
/// is current on this thread.
pub unsafe fn memset_d8_async(
    dst: sys::CUdeviceptr,
    byte: u8,
    bytes: usize,
    stream: &CudaStream,
) -> Result<()> {
    // SAFETY: the caller's contract above.
    unsafe { sys::cuMemsetD8Async(dst, byte, bytes, stream.cu_stream()) }
        .result()
        .call("cuMemsetD8Async")
}
