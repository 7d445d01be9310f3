//! Matrix products by the node's cuBLAS (`LeaseDevice::gemm`): a tenant
//! ships no kernel for them.

use cuda_core::blas::blas_handle;
use cuda_core::cudarc::driver::DevicePtr;

use super::{bind, CudaDevice};
use crate::device::error::{map, range};
use crate::device::{core_gemm, gemm_spans, DeviceError};
use crate::lock;
use crate::proto::{Dtype, GemmSpec, Status, StreamId};

impl CudaDevice {
    /// `LeaseDevice::gemm` on this device: the operands' ranges checked,
    /// their uses ordered like a launch's (`use_on`), and the product
    /// enqueued on the stream's cuBLAS handle.
    pub(super) fn enqueue_gemm(
        &mut self,
        stream: StreamId,
        g: &GemmSpec,
    ) -> Result<(), DeviceError> {
        let sid = stream;
        let stream = self.stream(stream)?;
        let bytes = gemm_spans(g).map_err(|e| DeviceError::new(Status::BadRequest, e))?;
        for (i, (_, o)) in g.operands().into_iter().enumerate() {
            range(self.buffer(o.buf)?.len(), o.offset, bytes[i])?;
        }
        for (_, o) in g.operands() {
            self.use_on(o.buf, sid, &stream)?;
        }
        let mut addrs = [0u64; 3];
        for (addr, (_, o)) in addrs.iter_mut().zip(g.operands()) {
            let (base, _use) = Self::raw(self.buffer(o.buf)?)
                .as_cuda_slice()
                .device_ptr(&stream);
            *addr = base + o.offset;
        }
        bind(&self.device)?;
        let handle = blas_handle(&stream).map_err(|e| map(Status::LaunchFailed, "gemm", e))?;
        let mut handle = lock(&handle);
        let [a, b, c] = addrs;
        // SAFETY: the addresses are this context's live buffers at offsets
        // whose matrices lie inside them (checked above against the spec's
        // extents, as the node's plan did), on the stream the handle is
        // bound to; their uses on other streams are ordered before this
        // product and their frees after it (`use_on`, as for a launch).
        let done = unsafe {
            match g.dtype {
                Dtype::F32 => handle.gemm(&core_gemm(g, |v| v as f32), a, b, c),
                Dtype::F64 => handle.gemm(&core_gemm(g, |v| v), a, b, c),
            }
        };
        done.map_err(|e| map(Status::LaunchFailed, "gemm", e))
    }
}
