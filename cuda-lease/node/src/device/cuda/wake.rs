//! Waking the worker when a sealed batch is done, so a worker past its spin
//! budget sleeps instead of polling on a timer: an armed batch's end (its
//! done events, or its arena's) is waited for on the wake's own stream,
//! followed by a host function that
//! counts one on an `eventfd` the worker polls beside its pipe. The lease's
//! streams never wait for a host function.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use cuda_async::CudaStream;

use super::sealed::InFlight;
use super::{driver, map, CudaDevice};
use crate::device::{DeviceError, Ticket};
use crate::proto::Status;

/// The descriptor and the stream of a device's wake-ups.
#[derive(Debug)]
pub(super) struct Wake {
    /// Counts one per armed batch done; kept open by the host functions
    /// not yet run.
    fd: Arc<OwnedFd>,
    stream: Arc<CudaStream>,
}

impl Wake {
    fn new(device: &cuda_async::Device) -> Result<Self, DeviceError> {
        let fd = crate::spin::eventfd()
            .map_err(|e| DeviceError::new(Status::Internal, format!("eventfd: {e}")))?;
        let fd = Arc::new(fd);
        let stream = device
            .context()
            .new_stream()
            .map_err(|e| driver(Status::Internal, "cuStreamCreate", e))?;
        Ok(Wake { fd, stream })
    }

    /// Counts one on the descriptor once `batch` is done.
    fn arm(&self, batch: &InFlight) -> Result<(), DeviceError> {
        batch.wait_on(&self.stream)?;
        let fd = self.fd.clone();
        cuda_core::launch_host_callback(&self.stream, move || {
            let one = 1u64;
            // SAFETY: writes the 8 bytes of `one` to the eventfd, which
            // `fd` keeps open; a full counter only fails the write (the
            // reader is due anyway).
            let _ = unsafe { libc::write(fd.as_raw_fd(), (&raw const one).cast(), 8) };
        })
        .map_err(|e| map(Status::Internal, "cuLaunchHostFunc", e))
    }
}

impl CudaDevice {
    /// Arms a wake-up for sealed batch `ticket` (see
    /// `LeaseDevice::wake_when_done`).
    pub(super) fn arm_wake(&mut self, ticket: Ticket) -> Option<RawFd> {
        // A failed batch is answered at its first poll: nothing to wait for.
        let Some(Ok(batch)) = self.sealed.get(&ticket) else {
            return None;
        };
        if self.wake.is_none() {
            self.wake = Wake::new(&self.device).ok();
        }
        let wake = self.wake.as_ref()?;
        // Not armed (a dead context, say): the worker polls instead.
        wake.arm(batch).ok()?;
        Some(wake.fd.as_raw_fd())
    }
}
