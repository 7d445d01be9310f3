//! Streams, made on first use, and the waits at a batch's end.

use std::sync::Arc;

use cuda_async::{CudaStream, Error};

use super::CudaDevice;
use crate::device::error::{map, too_many_streams};
use crate::device::{DeviceError, MAX_DEVICE_STREAMS};
use crate::proto::{Status, StreamId};

impl CudaDevice {
    pub(super) fn stream(&mut self, id: StreamId) -> Result<Arc<CudaStream>, DeviceError> {
        let s = match self.streams.get(&id) {
            Some(s) => s.clone(),
            None => {
                if self.streams.len() >= MAX_DEVICE_STREAMS {
                    return Err(too_many_streams());
                }
                let s = self.new_stream()?;
                self.streams.insert(id, s.clone());
                s
            }
        };
        self.touch(&s);
        Ok(s)
    }

    fn new_stream(&self) -> Result<Arc<CudaStream>, DeviceError> {
        self.device
            .new_stream()
            .map_err(|e| map(Status::Internal, "creating a stream", e))
    }

    /// The stream a graph capture's allocations go to (outside the capture).
    pub(super) fn capture_alloc_stream(&mut self) -> Result<Arc<CudaStream>, DeviceError> {
        if let Some(s) = &self.capture_alloc {
            return Ok(s.clone());
        }
        let s = self.new_stream()?;
        self.capture_alloc = Some(s.clone());
        Ok(s)
    }

    /// Notes that this batch enqueues work on `s` (see
    /// [`CudaDevice::sync_touched`]).
    pub(super) fn touch(&mut self, s: &Arc<CudaStream>) {
        if !self.touched.iter().any(|t| Arc::ptr_eq(t, s)) {
            self.touched.push(s.clone());
        }
    }

    /// Waits for, and forgets, the streams this batch enqueued work on (earlier
    /// batches' work was waited for at their ends); a failure is sticky (a
    /// kernel fault). Only these: an idle stream's synchronize is not free, and
    /// a lease's round-robin policy keeps four streams, one busy per submission.
    ///
    /// With a batch arena, the arena makes the same waits in the same order, so
    /// it knows its copies are done (downloads readable, bytes reusable).
    pub(super) fn sync_touched(&mut self) -> Result<(), DeviceError> {
        let touched = std::mem::take(&mut self.touched);
        match &mut self.arena {
            Some(arena) => arena.synchronize(&touched).map_err(sync_failed),
            None => touched.iter().try_for_each(|s| sync(s)),
        }
    }

    /// Waits for every stream; a failure is sticky (a kernel fault).
    pub(super) fn sync_all(&mut self) -> Result<(), DeviceError> {
        self.streams.values().try_for_each(|s| sync(s))
    }
}

/// Waits for `s`; a failure is sticky (a kernel fault).
fn sync(s: &CudaStream) -> Result<(), DeviceError> {
    s.synchronize()
        .map_err(|e| sync_failed(Error::driver("cuStreamSynchronize", e)))
}

/// A failed wait for a stream: sticky (a kernel fault).
fn sync_failed(e: Error) -> DeviceError {
    let mut d = map(Status::LaunchFailed, "cuStreamSynchronize", e);
    d.sticky = true;
    d
}
