//! What graphs kept natively on this device need around a capture and a
//! replay (`LeaseDevice::capture_graph` and `launch_graph` in `ops`).

use std::sync::Arc;

use cuda_async::CudaStream;

use super::CudaDevice;
use crate::device::error::map;
use crate::device::DeviceError;
use crate::proto::{Id, Status};

impl CudaDevice {
    /// Records every pending buffer use in its buffer's events (see
    /// [`CudaDevice::flush_use`]).
    pub(super) fn flush_all(&mut self) -> Result<(), DeviceError> {
        let ids: Vec<Id> = self.pending.keys().copied().collect();
        for id in ids {
            self.flush_use(id)?;
        }
        Ok(())
    }

    /// The stream a capture's allocations go to (outside the capture).
    pub(super) fn capture_alloc_stream(&mut self) -> Result<Arc<CudaStream>, DeviceError> {
        if let Some(s) = &self.capture_alloc {
            return Ok(s.clone());
        }
        let s = self
            .device
            .new_stream()
            .map_err(|e| map(Status::Internal, "creating a stream", e))?;
        self.capture_alloc = Some(s.clone());
        Ok(s)
    }
}
