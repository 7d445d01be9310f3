//! Random fills by the node's cuRAND (`LeaseDevice::rand_fill`): a tenant
//! ships no kernel for them.

use cuda_core::cudarc::driver::DevicePtr;
use cuda_core::rand::rand_generator;

use super::{bind, CudaDevice};
use crate::device::error::{map, range};
use crate::device::{core_fill, fill_bytes, DeviceError};
use crate::lock;
use crate::proto::{Dtype, RandSpec, Status, StreamId};

impl CudaDevice {
    /// `LeaseDevice::rand_fill` on this device: the range checked, the
    /// buffer's uses ordered like a launch's (`use_on`), and the fill
    /// enqueued on the stream's generator.
    pub(super) fn enqueue_rand_fill(
        &mut self,
        stream: StreamId,
        r: &RandSpec,
    ) -> Result<(), DeviceError> {
        let sid = stream;
        let stream = self.stream(stream)?;
        let bytes = fill_bytes(r).map_err(|e| DeviceError::new(Status::BadRequest, e))?;
        range(self.buffer(r.dst.buf)?.len(), r.dst.offset, bytes)?;
        self.use_on(r.dst.buf, sid, &stream)?;
        let (base, _use) = Self::raw(self.buffer(r.dst.buf)?)
            .as_cuda_slice()
            .device_ptr(&stream);
        let addr = base + r.dst.offset;
        bind(&self.device)?;
        let generator =
            rand_generator(&stream).map_err(|e| map(Status::LaunchFailed, "random fill", e))?;
        let mut generator = lock(&generator);
        let len = r.len as usize;
        // SAFETY: the address is this context's live buffer at an offset
        // whose `len` elements lie inside it (checked above, as the node's
        // plan did), on the stream the generator is bound to; the buffer's
        // uses on other streams are ordered before this fill and its free
        // after it (`use_on`, as for a launch).
        let done = unsafe {
            match r.dtype {
                Dtype::F32 => generator.fill(&core_fill(r, |v| v as f32), addr, len),
                Dtype::F64 => generator.fill(&core_fill(r, |v| v), addr, len),
            }
        };
        done.map_err(|e| map(Status::LaunchFailed, "random fill", e))
    }
}
