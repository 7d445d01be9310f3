//! Half-precision products (feature `half`): `half::bf16` and `half::f16`
//! elements with `f32` compute, through `cublasGemmEx`.

use std::ffi::c_void;
use std::ptr;

use super::*;

/// `A`, `B` and `C` in a half type, `f32` compute: `cublasGemmEx` and
/// `cublasGemmStridedBatchedEx` for products, and the same call with one
/// column for matrix-vector products (cuBLAS has no half-precision gemv).
macro_rules! half_scalar {
    ($t:ident, $element:ident, $data:ident) => {
        impl BlasScalar for half::$t {
            const ZERO: Self = half::$t::ZERO;
            const ONE: Self = half::$t::ONE;
            const NAME: &'static str = stringify!($t);
            const ELEMENT: Element = Element::$element;

            fn to_f64(self) -> f64 {
                f64::from(self.to_f32())
            }

            unsafe fn gemm(
                h: sys::cublasHandle_t,
                g: &Gemm<Self>,
                a: u64,
                b: u64,
                c: u64,
            ) -> Result<()> {
                let (ta, tb) = (op(g.transpose_a), op(g.transpose_b));
                let [m, n, k, lda, ldb, ldc] = g.dims_c_int()?;
                // `CUBLAS_COMPUTE_32F` takes `f32` scalars; these live to
                // the end of the call.
                let (alpha_f32, beta_f32) = (g.alpha.to_f32(), g.beta.to_f32());
                let alpha = ptr::from_ref(&alpha_f32).cast::<c_void>();
                let beta = ptr::from_ref(&beta_f32).cast::<c_void>();
                let data = sys::cudaDataType::$data;
                let compute = sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
                let algo = sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
                if g.batch == 1 {
                    // SAFETY: the caller's contract; alpha and beta are host
                    // `f32`s (the handle's pointer mode is host) that outlive
                    // the call, as the compute type requires.
                    unsafe {
                        result::gemm_ex(
                            h,
                            ta,
                            tb,
                            m,
                            n,
                            k,
                            alpha,
                            a as *const c_void,
                            data,
                            lda,
                            b as *const c_void,
                            data,
                            ldb,
                            beta,
                            c as *mut c_void,
                            data,
                            ldc,
                            compute,
                            algo,
                        )
                    }
                    .map_err(|e| failed("cublasGemmEx", e.0))
                } else {
                    let [sa, sb, sc] = g.strides_c_longlong()?;
                    let batch = c_int::try_from(g.batch)
                        .map_err(|_| too_large("the batch count", g.batch))?;
                    // SAFETY: as above, for every matrix of the batch.
                    unsafe {
                        result::gemm_strided_batched_ex(
                            h,
                            ta,
                            tb,
                            m,
                            n,
                            k,
                            alpha,
                            a as *const c_void,
                            data,
                            lda,
                            sa,
                            b as *const c_void,
                            data,
                            ldb,
                            sb,
                            beta,
                            c as *mut c_void,
                            data,
                            ldc,
                            sc,
                            batch,
                            compute,
                            algo,
                        )
                    }
                    .map_err(|e| failed("cublasGemmStridedBatchedEx", e.0))
                }
            }

            unsafe fn gemv(
                h: sys::cublasHandle_t,
                g: &Gemv<Self>,
                a: u64,
                x: u64,
                y: u64,
            ) -> Result<()> {
                let Some(p) = g.as_gemm() else {
                    return Ok(());
                };
                // SAFETY: the caller's contract, which the product meets:
                // `A` is the same matrix, and `x` and `y` are its
                // one-column `B` and `C` (contiguous, as gemv's are).
                unsafe { Self::gemm(h, &p, a, x, y) }
            }
        }
    };
}

half_scalar!(bf16, Bf16, CUDA_R_16BF);
half_scalar!(f16, F16, CUDA_R_16F);
