//! Graphs kept natively on this device: a body captured once into a CUDA
//! graph (`cuda-core`'s `TrackedGraph`, which logs the buffers it uses and
//! orders each replay as a use of each), replayed with one `cuGraphLaunch`.

use std::sync::Arc;

use cuda_async::CudaStream;
use cuda_core::TrackedGraph;

use super::CudaDevice;
use crate::device::error::map;
use crate::device::{DeviceError, LeaseDevice};
use crate::proto::{Id, Status, StreamId};

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
    fn capture_alloc_stream(&mut self) -> Result<Arc<CudaStream>, DeviceError> {
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

    /// `LeaseDevice::capture_graph` on this device.
    pub(super) fn capture_native(
        &mut self,
        graph: Id,
        streams: &[StreamId],
        enqueue: &mut dyn FnMut(&mut dyn LeaseDevice) -> Result<(), DeviceError>,
    ) -> Result<bool, DeviceError> {
        let Some((&first, rest)) = streams.split_first() else {
            return Ok(false);
        };
        // Made before the capture starts (no stream is created inside it).
        let main = self.stream(first)?;
        let side = rest
            .iter()
            .map(|s| self.stream(*s))
            .collect::<Result<Vec<_>, _>>()?;
        let alloc = self.capture_alloc_stream()?;
        // Uses before the capture are recorded outside it.
        self.flush_all()?;
        let mut failed = None;
        self.capturing = true;
        let captured = TrackedGraph::capture(&main, &side, &alloc, |_| {
            // The body's uses are logged for the graph before it ends.
            let r = enqueue(self).and_then(|()| self.flush_all());
            r.map_err(|e| {
                let message = e.message.clone();
                failed = Some(e);
                cuda_core::Error::Capture(message)
            })
        });
        self.capturing = false;
        if let Some(e) = failed {
            return Err(e);
        }
        let captured = captured.map_err(|e| map(Status::Internal, "graph capture", e))?;
        self.graphs.insert(graph, captured);
        Ok(true)
    }

    /// `LeaseDevice::launch_graph` on this device.
    pub(super) fn launch_native(&mut self, stream: StreamId, graph: Id) -> Result<(), DeviceError> {
        let stream = self.stream(stream)?;
        // Pending uses elsewhere are recorded, so the replay waits for them.
        self.flush_all()?;
        let g = self.graphs.get(&graph).ok_or_else(|| {
            DeviceError::new(Status::NotFound, format!("no graph {graph} on this device"))
        })?;
        g.launch_on(&stream)
            .map_err(|e| map(Status::LaunchFailed, "cuGraphLaunch", e))
    }
}
