//! Typed device buffers.
//!
//! `DeviceBuffer<T>` wraps cudarc's `CudaSlice<T>` rather than replacing it,
//! for two reasons: its destructor frees with `cuMemFreeAsync` on its
//! stream after waiting on the events of its last read and write on any
//! stream (so a buffer dropped while a kernel on another stream still uses
//! it is freed only after that kernel: invariant 2), and interop code that
//! holds `CudaSlice`s can pass them in and out for free. The wrapper adds
//! what `CudaSlice` lacks: `Send`/`Sync` only when `T` is, a `DeviceRepr`
//! bound at construction, and room for the remote backend's buffers.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};

use crate::device::Device;
use crate::error::{DriverResultExt, Error, Result};

/// A typed buffer in device memory.
///
/// Its contents are only reachable through work on a stream (copies,
/// kernels); all such work is ordered by cudarc's per-buffer events, so a
/// buffer can be handed out while the GPU still writes it.
pub struct DeviceBuffer<T> {
    slice: CudaSlice<T>,
    _marker: PhantomData<T>,
}

impl<T> fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("type", &std::any::type_name::<T>())
            .field("len", &self.slice.len())
            .field("device", &self.slice.ordinal())
            .finish()
    }
}

impl<T: DeviceRepr> DeviceBuffer<T> {
    /// Takes ownership of a cudarc slice.
    pub fn from_cuda_slice(slice: CudaSlice<T>) -> Self {
        DeviceBuffer {
            slice,
            _marker: PhantomData,
        }
    }

    /// Allocates `len` zeroed elements, stream-ordered on `stream`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the byte size overflows; a driver error
    /// (e.g. out of memory) naming the failing call.
    pub fn zeros(stream: &Arc<CudaStream>, len: usize) -> Result<Self>
    where
        T: ValidAsZeroBits,
    {
        check_len::<T>(len)?;
        let slice = stream.alloc_zeros::<T>(len).call("cuMemAllocAsync")?;
        Ok(Self::from_cuda_slice(slice))
    }

    /// Allocates `len` elements with unspecified contents.
    ///
    /// # Errors
    /// As [`DeviceBuffer::zeros`].
    ///
    /// # Safety
    /// The contents are uninitialised device memory: a kernel that reads
    /// them before writing reads garbage (not host UB, but wrong results).
    /// Callers make sure every element is written before it is read.
    pub unsafe fn uninit(stream: &Arc<CudaStream>, len: usize) -> Result<Self> {
        check_len::<T>(len)?;
        // SAFETY: forwarded to the caller (see `# Safety`).
        let slice = unsafe { stream.alloc::<T>(len) }.call("cuMemAllocAsync")?;
        Ok(Self::from_cuda_slice(slice))
    }
}

impl<T> DeviceBuffer<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.slice.len()
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.slice.len() == 0
    }

    /// Size in bytes.
    pub fn num_bytes(&self) -> usize {
        self.slice.num_bytes()
    }

    /// The device the memory is on.
    pub fn device(&self) -> Device {
        Device::of_stream(self.slice.stream())
    }

    /// The stream the buffer was allocated on (its free is ordered there).
    pub fn home_stream(&self) -> &Arc<CudaStream> {
        self.slice.stream()
    }

    /// The cudarc slice, for interop and kernel arguments.
    pub fn as_cuda_slice(&self) -> &CudaSlice<T> {
        &self.slice
    }

    /// The cudarc slice, mutably (kernel arguments that write).
    pub fn as_cuda_slice_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }

    /// Gives the cudarc slice back.
    pub fn into_cuda_slice(self) -> CudaSlice<T> {
        self.slice
    }
}

pub(crate) fn check_len<T>(len: usize) -> Result<usize> {
    len.checked_mul(std::mem::size_of::<T>())
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{len} elements of {} bytes overflow the address space",
                std::mem::size_of::<T>()
            ))
        })
}
