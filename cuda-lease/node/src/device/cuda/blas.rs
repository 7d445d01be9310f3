//! Matrix products by the node's cuBLAS (`LeaseDevice::gemm`): a tenant
//! ships no kernel for them.

use cuda_core::blas::{blas_handle, BlasScalar, Gemm};
use cuda_core::cudarc::driver::DevicePtr;

use super::CudaDevice;
use crate::device::error::{driver, map, range};
use crate::device::DeviceError;
use crate::proto::{Dtype, GemmSpec, Status, StreamId};

/// `g` as `cuda-core` takes it, in `T`.
fn core_gemm<T: BlasScalar>(g: &GemmSpec, scalar: impl Fn(f64) -> T) -> Gemm<T> {
    let mut c = Gemm::<T>::new(g.m as usize, g.n as usize, g.k as usize);
    [c.lda, c.ldb, c.ldc] = g.ld.map(|v| v as usize);
    [c.transpose_a, c.transpose_b] = g.transpose;
    c.alpha = scalar(g.alpha());
    c.beta = scalar(g.beta());
    c.batch = g.batch as usize;
    [c.stride_a, c.stride_b, c.stride_c] = g.strides.map(|v| v as usize);
    c
}

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
        let extents = g
            .extents()
            .map_err(|e| DeviceError::new(Status::BadRequest, e))?;
        for (i, (_, o, _)) in g.operands().into_iter().enumerate() {
            range(
                self.buffer(o.buf)?.len(),
                o.offset,
                extents[i].saturating_mul(g.dtype.size()),
            )?;
        }
        for (_, o, _) in g.operands() {
            self.use_on(o.buf, sid, &stream)?;
        }
        let mut addrs = [0u64; 3];
        for (addr, (_, o, _)) in addrs.iter_mut().zip(g.operands()) {
            let (base, _use) = Self::raw(self.buffer(o.buf)?)
                .as_cuda_slice()
                .device_ptr(&stream);
            *addr = base + o.offset;
        }
        self.device
            .context()
            .bind_to_thread()
            .map_err(|e| driver(Status::Internal, "cuCtxSetCurrent", e))?;
        let handle = blas_handle(&stream).map_err(|e| map(Status::LaunchFailed, "gemm", e))?;
        let mut handle = handle.lock().unwrap_or_else(|e| e.into_inner());
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
