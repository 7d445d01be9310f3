//! [`DeviceError`], the checks every device shares, and the mapping of
//! `cuda-core` errors to statuses.

use std::collections::HashMap;

use cuda_async::Error;

use super::MAX_DEVICE_STREAMS;
use crate::proto::{Id, Status};

/// A failed device operation, also a worker's answer to a failed request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
#[error("{status}: {message}")]
pub struct DeviceError {
    /// Status to report.
    pub status: Status,
    /// Details (the JIT log for LOAD_FAILED).
    pub message: String,
    /// True when the device context is unusable afterwards (a kernel fault):
    /// the lease is poisoned and its worker ended.
    pub sticky: bool,
}

impl DeviceError {
    /// A non-sticky error.
    pub fn new(status: Status, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            sticky: false,
        }
    }

    /// A sticky error (the context is gone).
    pub fn sticky(status: Status, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            sticky: true,
        }
    }
}

pub(super) fn range(
    len: usize,
    offset: u64,
    n: u64,
) -> Result<std::ops::Range<usize>, DeviceError> {
    let end = offset
        .checked_add(n)
        .filter(|e| *e <= len as u64)
        .ok_or_else(|| {
            DeviceError::new(
                Status::BadRequest,
                format!("range {offset}+{n} is outside a buffer of {len} bytes"),
            )
        })?;
    Ok(offset as usize..end as usize)
}

pub(crate) fn not_found(what: &str, id: impl std::fmt::Display) -> DeviceError {
    DeviceError::new(Status::NotFound, format!("no {what} {id}"))
}

/// Refuses a new id that names something already.
pub(super) fn check_fresh(taken: bool, id: impl std::fmt::Display) -> Result<(), DeviceError> {
    if taken {
        return Err(DeviceError::new(
            Status::BadRequest,
            format!("id {id} is already in use"),
        ));
    }
    Ok(())
}

/// Refuses a GPU_SUBMIT argument (input or output) in a lease's launch.
pub(super) fn submit_only() -> DeviceError {
    DeviceError::new(Status::BadRequest, "Input/Output are for GPU_SUBMIT")
}

/// Refuses an event id that names a buffer.
pub(super) fn check_event(is_buffer: bool, event: Id) -> Result<(), DeviceError> {
    if is_buffer {
        return Err(DeviceError::new(
            Status::BadRequest,
            format!("{event} is a buffer, not an event"),
        ));
    }
    Ok(())
}

pub(super) fn same_buffer() -> DeviceError {
    DeviceError::new(
        Status::BadRequest,
        "a copy's source and destination are one buffer",
    )
}

pub(super) fn too_many_streams() -> DeviceError {
    DeviceError::new(
        Status::CapacityExceeded,
        format!("more than {MAX_DEVICE_STREAMS} streams"),
    )
}

/// The buffer a memory kernel argument names, its offset checked against
/// the buffer's length.
pub(super) fn mem_arg<B, S: std::hash::BuildHasher>(
    buffers: &HashMap<Id, B, S>,
    id: Id,
    offset: u64,
    len: impl Fn(&B) -> usize,
) -> Result<&B, DeviceError> {
    let b = buffers.get(&id).ok_or_else(|| not_found("buffer", id))?;
    if offset > len(b) as u64 {
        return Err(DeviceError::new(
            Status::BadRequest,
            "argument offset past buffer end",
        ));
    }
    Ok(b)
}

/// Maps a `cuda-core` error: a sticky one (kernel fault) becomes sticky
/// LAUNCH_FAILED whatever the op; the rest get a status by kind, or `status`.
pub(super) fn map(status: Status, what: &str, e: Error) -> DeviceError {
    let status = match &e {
        e if e.is_sticky() => {
            return DeviceError::sticky(Status::LaunchFailed, format!("{what}: {e}"))
        }
        e if e.is_out_of_memory() => Status::CapacityExceeded,
        Error::Compile { .. } | Error::NoNvrtc => Status::LoadFailed,
        Error::KernelNotFound { .. } => Status::NotFound,
        Error::ArgumentMismatch { .. } | Error::InvalidArgument(_) => Status::BadRequest,
        _ => status,
    };
    DeviceError::new(status, format!("{what}: {e}"))
}

pub(super) fn driver(
    status: Status,
    call: &'static str,
    e: cuda_core::cudarc::driver::DriverError,
) -> DeviceError {
    map(status, call, Error::driver(call, e))
}
