//! cuBLAS: matrix products on a stream (feature `blas`).
//!
//! [`Gemm`] describes one product (or a strided batch of them) and checks
//! it against the lengths of its buffers before anything runs;
//! [`blas_handle`] gives the cuBLAS handle of a stream, made and bound to
//! it on first use and kept (a product costs the library call, not a
//! handle's creation). The raw calls are here; `cuda-async`'s `blas` module
//! orders them against every other use of their buffers.
//!
//! Matrices are column-major, as cuBLAS takes them: element `(i, j)` of a
//! matrix with leading dimension `ld` is at `i + j * ld`.
//!
//! With the `half` feature, `half::bf16` and `half::f16` (re-exported as
//! `cuda_core::half`) are elements too: `A`, `B` and `C` are
//! held in the half type, and cuBLAS (`cublasGemmEx`) multiplies and
//! accumulates in `f32`, rounding `C` to the half type once. `alpha` and
//! `beta` are given in the element type and passed to cuBLAS as `f32`
//! (exactly: every half value is an `f32`), as its `f32` compute type
//! requires.

use std::ffi::{c_int, c_longlong};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::{result, sys};
use cudarc::driver::{CudaStream, DevicePtr, DeviceRepr};

use crate::per_stream::{failed, PerStream};
use crate::{DeviceBuffer, Error, Result};

/// The library's name in errors.
const CUBLAS: &str = "cuBLAS (libcublas)";

/// Whether cuBLAS can be loaded on this machine (asked once: the answer
/// is kept).
pub fn blas_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to load the library; no cuBLAS call is made.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// An element type cuBLAS multiplies: `f32` and `f64`; with the `half`
/// feature also `half::bf16` and `half::f16` (`f32` accumulation, see the
/// [module](self)).
pub trait BlasScalar: DeviceRepr + Copy + Send + Sync + PartialEq + 'static {
    /// Zero.
    const ZERO: Self;
    /// One.
    const ONE: Self;
    /// The type's name in errors (`"f32"`, `"bf16"`, ...).
    #[doc(hidden)]
    const NAME: &'static str;

    /// Which element it is (for the cuBLASLt types of its products).
    #[doc(hidden)]
    const ELEMENT: Element;

    /// The value as `f64` (exact for every type).
    #[doc(hidden)]
    fn to_f64(self) -> f64;

    /// One product (`batch` is 1) or a strided batch; pointers are device
    /// addresses of the first elements.
    ///
    /// # Safety
    ///
    /// `a`, `b` and `c` address live device memory of the handle's
    /// context holding what `g` reads and writes ([`Gemm::check`] passed
    /// for their lengths), and nothing else uses `c` meanwhile.
    #[doc(hidden)]
    unsafe fn gemm(h: sys::cublasHandle_t, g: &Gemm<Self>, a: u64, b: u64, c: u64) -> Result<()>;

    /// One matrix-vector product; pointers are device addresses of the
    /// first elements.
    ///
    /// # Safety
    ///
    /// `a`, `x` and `y` address live device memory of the handle's
    /// context holding what `g` reads and writes ([`Gemv::check`] passed
    /// for their lengths), and nothing else uses `y` meanwhile.
    #[doc(hidden)]
    unsafe fn gemv(h: sys::cublasHandle_t, g: &Gemv<Self>, a: u64, x: u64, y: u64) -> Result<()>;
}

/// The element types of [`BlasScalar`].
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Element {
    /// `f32`.
    F32,
    /// `f64`.
    F64,
    /// `half::bf16`.
    Bf16,
    /// `half::f16`.
    F16,
}

fn op(transpose: bool) -> sys::cublasOperation_t {
    if transpose {
        sys::cublasOperation_t::CUBLAS_OP_T
    } else {
        sys::cublasOperation_t::CUBLAS_OP_N
    }
}

macro_rules! blas_scalar {
    ($t:ident, $element:ident, $one:literal, $gemm:ident, $batched:ident, $gemv:ident, $call:literal, $batched_call:literal, $gemv_call:literal) => {
        impl BlasScalar for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = $one;
            const NAME: &'static str = stringify!($t);
            const ELEMENT: Element = Element::$element;

            fn to_f64(self) -> f64 {
                f64::from(self)
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
                if g.batch == 1 {
                    // SAFETY: the caller's contract; alpha and beta are host
                    // values (the handle's pointer mode is host).
                    unsafe {
                        result::$gemm(
                            h,
                            ta,
                            tb,
                            m,
                            n,
                            k,
                            &g.alpha,
                            a as *const $t,
                            lda,
                            b as *const $t,
                            ldb,
                            &g.beta,
                            c as *mut $t,
                            ldc,
                        )
                    }
                    .map_err(|e| failed($call, e.0))
                } else {
                    let [sa, sb, sc] = g.strides_c_longlong()?;
                    let batch = c_int::try_from(g.batch)
                        .map_err(|_| too_large("the batch count", g.batch))?;
                    // SAFETY: as above, for every matrix of the batch.
                    unsafe {
                        result::$batched(
                            h,
                            ta,
                            tb,
                            m,
                            n,
                            k,
                            &g.alpha,
                            a as *const $t,
                            lda,
                            sa,
                            b as *const $t,
                            ldb,
                            sb,
                            &g.beta,
                            c as *mut $t,
                            ldc,
                            sc,
                            batch,
                        )
                    }
                    .map_err(|e| failed($batched_call, e.0))
                }
            }

            unsafe fn gemv(
                h: sys::cublasHandle_t,
                g: &Gemv<Self>,
                a: u64,
                x: u64,
                y: u64,
            ) -> Result<()> {
                let [m, n, lda] = g.dims_c_int()?;
                // SAFETY: the caller's contract; alpha and beta are host
                // values (the handle's pointer mode is host); the vectors
                // are contiguous.
                unsafe {
                    result::$gemv(
                        h,
                        op(g.transpose),
                        m,
                        n,
                        &g.alpha,
                        a as *const $t,
                        lda,
                        x as *const $t,
                        1,
                        &g.beta,
                        y as *mut $t,
                        1,
                    )
                }
                .map_err(|e| failed($gemv_call, e.0))
            }
        }
    };
}

blas_scalar!(
    f32,
    F32,
    1.0,
    sgemm,
    sgemm_strided_batched,
    sgemv,
    "cublasSgemm_v2",
    "cublasSgemmStridedBatched",
    "cublasSgemv_v2"
);
blas_scalar!(
    f64,
    F64,
    1.0,
    dgemm,
    dgemm_strided_batched,
    dgemv,
    "cublasDgemm_v2",
    "cublasDgemmStridedBatched",
    "cublasDgemv_v2"
);

#[cfg(feature = "half")]
mod half_gemm;
mod lt;

/// The stored shape of an operand that is `rows` x `cols` once applied:
/// swapped when it is transposed.
fn stored(transpose: bool, rows: usize, cols: usize) -> (usize, usize) {
    if transpose {
        (cols, rows)
    } else {
        (rows, cols)
    }
}

fn too_large(what: &str, v: usize) -> Error {
    Error::InvalidArgument(format!("{what} ({v}) is beyond what cuBLAS takes (i32)"))
}

/// The named sizes as cuBLAS's integer type `I`.
fn fits<I, const N: usize>(named: [(&str, usize); N]) -> Result<[I; N]>
where
    I: TryFrom<usize> + Copy + Default,
{
    let mut out = [I::default(); N];
    for (o, (name, v)) in out.iter_mut().zip(named) {
        *o = I::try_from(v).map_err(|_| too_large(name, v))?;
    }
    Ok(out)
}

/// The elements a `rows` x `cols` matrix with leading dimension `ld`
/// spans, or why it cannot be.
fn span(name: &str, rows: usize, cols: usize, ld: usize) -> std::result::Result<usize, String> {
    if ld < rows.max(1) {
        return Err(format!(
            "the leading dimension of {name} is {ld}, below its {rows} rows"
        ));
    }
    if rows == 0 || cols == 0 {
        return Ok(0);
    }
    ld.checked_mul(cols - 1)
        .and_then(|v| v.checked_add(rows))
        .ok_or_else(|| format!("{name} spans more elements than there are"))
}

/// A matrix product `C = alpha * op(A) * op(B) + beta * C`, column-major,
/// with `op(A)` of `m` x `k`, `op(B)` of `k` x `n` and `C` of `m` x `n`;
/// or a batch of them, each matrix `stride` elements after the last.
///
/// # Examples
///
/// ```
/// use cuda_core::blas::Gemm;
/// // A 4x3 (column-major) times B 3x2 into C 4x2.
/// let g = Gemm::<f32>::new(4, 2, 3);
/// assert_eq!((g.lda, g.ldb, g.ldc), (4, 3, 4));
/// g.check(12, 6, 8).unwrap();
/// let e = g.check(12, 5, 8).unwrap_err();
/// assert!(e.to_string().contains("B holds 5 elements"), "{e}");
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gemm<T> {
    /// Rows of `op(A)` and of `C`.
    pub m: usize,
    /// Columns of `op(B)` and of `C`.
    pub n: usize,
    /// Columns of `op(A)`, rows of `op(B)`.
    pub k: usize,
    /// `op(A)` is `A` transposed (`A` is `k` x `m`).
    pub transpose_a: bool,
    /// `op(B)` is `B` transposed (`B` is `n` x `k`).
    pub transpose_b: bool,
    /// The product's factor.
    pub alpha: T,
    /// `C`'s factor (zero: `C` is only written).
    pub beta: T,
    /// Leading dimension of `A` (at least its rows).
    pub lda: usize,
    /// Leading dimension of `B`.
    pub ldb: usize,
    /// Leading dimension of `C` (at least `m`).
    pub ldc: usize,
    /// How many products (1: one).
    pub batch: usize,
    /// Elements from one `A` of the batch to the next.
    pub stride_a: usize,
    /// Elements from one `B` of the batch to the next.
    pub stride_b: usize,
    /// Elements from one `C` of the batch to the next.
    pub stride_c: usize,
}

impl<T: BlasScalar> Gemm<T> {
    /// `C = A * B` with `A` of `m` x `k`, `B` of `k` x `n`, packed (each
    /// leading dimension is its matrix's rows).
    pub fn new(m: usize, n: usize, k: usize) -> Self {
        Gemm {
            m,
            n,
            k,
            transpose_a: false,
            transpose_b: false,
            alpha: T::ONE,
            beta: T::ZERO,
            lda: m.max(1),
            ldb: k.max(1),
            ldc: m.max(1),
            batch: 1,
            stride_a: m * k,
            stride_b: k * n,
            stride_c: m * n,
        }
    }

    /// `op(A)` is `A` transposed: `A` is stored `k` x `m` (its leading
    /// dimension becomes `k`, packed).
    #[must_use]
    pub fn transpose_a(mut self) -> Self {
        self.transpose_a = true;
        self.lda = self.k.max(1);
        self
    }

    /// `op(B)` is `B` transposed: `B` is stored `n` x `k` (its leading
    /// dimension becomes `n`, packed).
    #[must_use]
    pub fn transpose_b(mut self) -> Self {
        self.transpose_b = true;
        self.ldb = self.n.max(1);
        self
    }

    /// Sets `alpha`.
    #[must_use]
    pub fn alpha(mut self, alpha: T) -> Self {
        self.alpha = alpha;
        self
    }

    /// Sets `beta` (non-zero: `C` is read too).
    #[must_use]
    pub fn beta(mut self, beta: T) -> Self {
        self.beta = beta;
        self
    }

    /// `count` products of packed matrices stored one after another.
    #[must_use]
    pub fn batched(mut self, count: usize) -> Self {
        self.batch = count;
        self.stride_a = self.lda * self.a_shape().1;
        self.stride_b = self.ldb * self.b_shape().1;
        self.stride_c = self.ldc * self.n;
        self
    }

    /// Rows and columns of `A` as stored.
    fn a_shape(&self) -> (usize, usize) {
        stored(self.transpose_a, self.m, self.k)
    }

    /// Rows and columns of `B` as stored.
    fn b_shape(&self) -> (usize, usize) {
        stored(self.transpose_b, self.k, self.n)
    }

    /// Whether `C` is read (`beta` is not zero).
    pub fn reads_c(&self) -> bool {
        self.beta != T::ZERO
    }

    /// Floating-point operations of the whole call (`2 m n k` a product).
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64 * self.batch as f64
    }

    /// The elements each of `A`, `B` and `C` spans from its first one (a
    /// whole batch), checked: every leading dimension covers its matrix's
    /// rows, `C`'s matrices do not overlap, and every size fits cuBLAS's
    /// integers (the arithmetic is checked too: the sizes may come from
    /// another machine).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming what does not fit.
    pub fn extents(&self) -> Result<[usize; 3]> {
        let bad = |what: String| Error::InvalidArgument(format!("gemm: {what}"));
        if self.batch == 0 {
            return Err(bad("a batch of 0 products".into()));
        }
        self.dims_c_int()?;
        if self.batch > 1 {
            self.strides_c_longlong()?;
        }
        let mut out = [0; 3];
        for (i, (name, (rows, cols), ld, stride)) in self.matrices().into_iter().enumerate() {
            let one = span(name, rows, cols, ld).map_err(bad)?;
            out[i] = if self.batch > 1 && one > 0 {
                if stride < one && name == "C" {
                    return Err(bad(format!(
                        "the stride of C ({stride}) makes its {} matrices overlap (each spans {one})",
                        self.batch
                    )));
                }
                stride
                    .checked_mul(self.batch - 1)
                    .and_then(|v| v.checked_add(one))
                    .ok_or_else(|| bad(format!("{name} spans more elements than there are")))?
            } else {
                one
            };
        }
        Ok(out)
    }

    /// `A`, `B` and `C`: name, stored shape, leading dimension, stride.
    fn matrices(&self) -> [(&'static str, (usize, usize), usize, usize); 3] {
        [
            ("A", self.a_shape(), self.lda, self.stride_a),
            ("B", self.b_shape(), self.ldb, self.stride_b),
            ("C", (self.m, self.n), self.ldc, self.stride_c),
        ]
    }

    /// Checks the call against buffers of `a`, `b` and `c` elements: every
    /// matrix of the batch lies inside its buffer, as [`Gemm::extents`]
    /// has it.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the argument that does not fit.
    pub fn check(&self, a: usize, b: usize, c: usize) -> Result<()> {
        let extents = self.extents()?;
        for (((name, (rows, cols), ld, stride), need), len) in
            self.matrices().into_iter().zip(extents).zip([a, b, c])
        {
            if len < need {
                return Err(Error::InvalidArgument(format!(
                    "gemm: {name} holds {len} elements, the call reads {need} ({rows}x{cols}, \
                     leading dimension {ld}{})",
                    if self.batch > 1 {
                        format!(", {} matrices {stride} apart", self.batch)
                    } else {
                        String::new()
                    }
                )));
            }
        }
        Ok(())
    }

    fn dims_c_int(&self) -> Result<[c_int; 6]> {
        fits([
            ("m", self.m),
            ("n", self.n),
            ("k", self.k),
            ("lda", self.lda),
            ("ldb", self.ldb),
            ("ldc", self.ldc),
        ])
    }

    fn strides_c_longlong(&self) -> Result<[c_longlong; 3]> {
        fits([
            ("stride_a", self.stride_a),
            ("stride_b", self.stride_b),
            ("stride_c", self.stride_c),
        ])
    }
}

/// A matrix-vector product `y = alpha * op(A) * x + beta * y`,
/// column-major, with `A` of `m` x `n` (leading dimension `lda`) and `x`,
/// `y` contiguous: `x` of `n` elements and `y` of `m` (the other way round
/// when `A` is transposed).
///
/// # Examples
///
/// ```
/// use cuda_core::blas::Gemv;
/// // A 4x3 times x of 3 into y of 4.
/// let g = Gemv::<f32>::new(4, 3);
/// g.check(12, 3, 4).unwrap();
/// let e = g.check(12, 2, 4).unwrap_err();
/// assert!(e.to_string().contains("x holds 2 elements"), "{e}");
/// // Transposed: x of 4, y of 3.
/// g.transpose().check(12, 4, 3).unwrap();
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gemv<T> {
    /// Rows of `A` as stored.
    pub m: usize,
    /// Columns of `A` as stored.
    pub n: usize,
    /// Leading dimension of `A` (at least `m`).
    pub lda: usize,
    /// Whether `A` is used transposed.
    pub transpose: bool,
    /// The product's factor.
    pub alpha: T,
    /// `y`'s factor (zero: `y` is not read).
    pub beta: T,
}

impl<T: BlasScalar> Gemv<T> {
    /// `y = A * x` with `A` of `m` x `n`, tightly packed.
    pub fn new(m: usize, n: usize) -> Self {
        Self {
            m,
            n,
            lda: m,
            transpose: false,
            alpha: T::ONE,
            beta: T::ZERO,
        }
    }

    /// Uses `A` transposed: `y = A^T * x`.
    pub fn transpose(mut self) -> Self {
        self.transpose = true;
        self
    }

    /// Sets the leading dimension of `A`.
    pub fn lda(mut self, lda: usize) -> Self {
        self.lda = lda;
        self
    }

    /// Sets `alpha`.
    pub fn alpha(mut self, alpha: T) -> Self {
        self.alpha = alpha;
        self
    }

    /// Sets `beta`.
    pub fn beta(mut self, beta: T) -> Self {
        self.beta = beta;
        self
    }

    /// Elements of `x` and of `y` the call uses.
    pub fn vector_lens(&self) -> (usize, usize) {
        if self.transpose {
            (self.m, self.n)
        } else {
            (self.n, self.m)
        }
    }

    /// Floating-point operations of the call (`2 m n`).
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64
    }

    /// Checks the call against buffers of `a`, `x` and `y` elements.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the argument that does not fit.
    pub fn check(&self, a: usize, x: usize, y: usize) -> Result<()> {
        let bad = |what: String| Err(Error::InvalidArgument(format!("gemv: {what}")));
        let (m, n, ld) = (self.m, self.n, self.lda);
        let need = span("A", m, n, ld).map_err(|e| Error::InvalidArgument(format!("gemv: {e}")))?;
        if a < need {
            return bad(format!(
                "A holds {a} elements, the call reads {need} ({m}x{n}, leading dimension {ld})"
            ));
        }
        let (nx, ny) = self.vector_lens();
        for (name, len, need) in [("x", x, nx), ("y", y, ny)] {
            if len < need {
                return bad(format!(
                    "{name} holds {len} elements, the call uses {need} (A is {m}x{n}{})",
                    if self.transpose { ", transposed" } else { "" }
                ));
            }
        }
        self.dims_c_int()?;
        Ok(())
    }

    fn dims_c_int(&self) -> Result<[c_int; 3]> {
        fits([("m", self.m), ("n", self.n), ("lda", self.lda)])
    }

    /// The same product as a one-column [`Gemm`] (`x` is its `B`, `y` its
    /// `C`), or `None` when nothing is multiplied (`m` or `n` is 0: `y` is
    /// left as it is, as cuBLAS's gemv leaves it).
    #[cfg(feature = "half")]
    fn as_gemm(&self) -> Option<Gemm<T>> {
        if self.m == 0 || self.n == 0 {
            return None;
        }
        let (rows, k) = if self.transpose {
            (self.n, self.m)
        } else {
            (self.m, self.n)
        };
        let mut p = Gemm::new(rows, 1, k).alpha(self.alpha).beta(self.beta);
        if self.transpose {
            p = p.transpose_a();
        }
        p.lda = self.lda;
        Some(p)
    }
}

/// A cuBLAS handle bound to one stream ([`blas_handle`]), with the
/// workspace it was given and the stream's cuBLASLt plans (products run
/// through `cublasLtMatmul` with each shape's algorithm chosen once; see
/// [`BlasHandle::gemm`]).
#[derive(Debug)]
pub struct BlasHandle {
    handle: sys::cublasHandle_t,
    /// Its workspace (`cublasSetWorkspace`): used by the handle's calls
    /// only, all on its stream; freed only if the handle is dropped (a
    /// handle a graph kept, once its replays are done).
    workspace: DeviceBuffer<u8>,
    /// The workspace's device address.
    workspace_at: u64,
    /// The stream the handle is bound to.
    stream: cudarc::driver::sys::CUstream,
    /// `None` where cuBLASLt is missing.
    lt: Option<lt::Lt>,
}

// SAFETY: a cuBLAS handle may be used from any thread as long as calls on
// it do not overlap; every `BlasHandle` lives behind a `Mutex`
// (`blas_handle` hands out `Arc<Mutex<BlasHandle>>` only), so they never do.
unsafe impl Send for BlasHandle {}

impl BlasHandle {
    /// The bytes of the handle's workspace.
    pub fn workspace_bytes(&self) -> usize {
        self.workspace.len()
    }

    /// Enqueues `g` on the handle's stream: through cuBLASLt with the
    /// plan of its shape (made on the shape's first product and kept:
    /// its descriptors and the algorithm cuBLASLt's heuristic picks for
    /// it, the addresses' alignment and the workspace), else (no
    /// cuBLASLt, an empty product, a shape it has no algorithm for, more
    /// than 256 shapes) through the legacy call (`cublasSgemm_v2`, ...).
    ///
    /// # Safety
    ///
    /// As [`BlasScalar::gemm`]: the addresses hold what `g` reads and
    /// writes, in the handle's context, and are ordered against their
    /// other uses by the caller; the handle's context is current.
    pub unsafe fn gemm<T: BlasScalar>(
        &mut self,
        g: &Gemm<T>,
        a: u64,
        b: u64,
        c: u64,
    ) -> Result<()> {
        if let Some(lt) = &mut self.lt {
            let workspace = (self.workspace_at, self.workspace.len());
            // SAFETY: the caller's contract; the workspace is this
            // handle's, used only on its stream, one call at a time (the
            // handle is behind a lock).
            let done = unsafe { lt.gemm(g, [a, b, c], workspace, self.stream as _) };
            if let Some(r) = done {
                return r;
            }
        }
        // SAFETY: the caller's contract.
        unsafe { T::gemm(self.handle, g, a, b, c) }
    }

    /// The product shapes the handle has cuBLASLt plans for.
    pub fn planned_shapes(&self) -> usize {
        self.lt.as_ref().map_or(0, lt::Lt::planned)
    }

    /// Enqueues `g` on the handle's stream.
    ///
    /// # Safety
    ///
    /// As [`BlasScalar::gemv`]: the addresses hold what `g` reads and
    /// writes, in the handle's context, and are ordered against their
    /// other uses by the caller; the handle's context is current.
    pub unsafe fn gemv<T: BlasScalar>(
        &mut self,
        g: &Gemv<T>,
        a: u64,
        x: u64,
        y: u64,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { T::gemv(self.handle, g, a, x, y) }
    }
}

/// The cuBLAS handle of `stream`, made on its first use and bound to it
/// (also while the stream is being captured into a graph), then kept for
/// the process's life: one per stream a product ran on. Handles are never
/// destroyed: `cublasDestroy` synchronizes the device, and run on a
/// background thread it made the process crash at exit under
/// compute-sanitizer.
///
/// The handle's workspace is allocated when the handle is made, from the
/// memory pool the stream's allocations use then (a
/// [`MemPool::allocate_in`](crate::MemPool::allocate_in) scope's, or the
/// device's), stream-ordered, and given to cuBLAS
/// (`cublasSetWorkspace`), so cuBLAS allocates none of its own, inside a
/// graph capture either: [`BLAS_WORKSPACE_HOPPER`] on devices of compute
/// capability 9.0 and later, [`BLAS_WORKSPACE`] before (NVIDIA's
/// recommended sizes).
///
/// # Errors
///
/// [`Error::NoLibrary`] when cuBLAS cannot be loaded; a cuBLAS status if
/// the handle cannot be made.
pub fn blas_handle(stream: &Arc<CudaStream>) -> Result<Arc<Mutex<BlasHandle>>> {
    static HANDLES: OnceLock<PerStream<BlasHandle>> = OnceLock::new();
    if !blas_present() {
        return Err(Error::NoLibrary { library: CUBLAS });
    }
    HANDLES.get_or_init(PerStream::new).get(stream, || {
        let handle = result::create_handle().map_err(|e| failed("cublasCreate_v2", e.0))?;
        // SAFETY: `handle` was just made; the stream belongs to the current
        // context. A handle is used only for the stream of its key (a
        // stream made later at a freed one's address is that stream).
        unsafe { result::set_stream(handle, stream.cu_stream() as _) }
            .map_err(|e| failed("cublasSetStream_v2", e.0))?;
        let workspace = workspace_for(stream)?;
        let ptr = workspace.as_cuda_slice().device_ptr(stream).0;
        // SAFETY: the workspace is device memory of the stream's context,
        // allocated before any of the handle's calls in the stream's order,
        // and lives as long as the handle (kept in it).
        unsafe { sys::cublasSetWorkspace_v2(handle, ptr as *mut _, workspace.len()) }
            .result()
            .map_err(|e| failed("cublasSetWorkspace_v2", e.0))?;
        Ok(BlasHandle {
            handle,
            workspace,
            workspace_at: ptr,
            stream: stream.cu_stream(),
            lt: lt::Lt::new(),
        })
    })
}

/// The workspace of a cuBLAS handle on devices of compute capability 9.0
/// and later (bytes).
pub const BLAS_WORKSPACE_HOPPER: usize = 32 << 20;

/// The workspace of a cuBLAS handle on earlier devices (bytes).
pub const BLAS_WORKSPACE: usize = 4 << 20;

/// A workspace for a handle of `stream`, sized for its device.
fn workspace_for(stream: &Arc<CudaStream>) -> Result<DeviceBuffer<u8>> {
    let (major, _) = stream
        .context()
        .compute_capability()
        .map_err(|e| Error::driver("cuDeviceGetAttribute", e))?;
    let bytes = if major >= 9 {
        BLAS_WORKSPACE_HOPPER
    } else {
        BLAS_WORKSPACE
    };
    // SAFETY: cuBLAS writes a workspace before it reads it; nothing else
    // reads it.
    unsafe { DeviceBuffer::<u8>::uninit(stream, bytes) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_checked_before_any_call() {
        let g = Gemm::<f32>::new(4, 2, 3);
        g.check(12, 6, 8).unwrap();
        let e = |r: Result<()>| r.unwrap_err().to_string();
        assert!(e(g.check(11, 6, 8)).contains("A holds 11"));
        assert!(e(g.check(12, 6, 7)).contains("C holds 7"));
        let t = Gemm::<f32>::new(4, 2, 3).transpose_a().transpose_b();
        assert_eq!((t.lda, t.ldb), (3, 2));
        t.check(12, 6, 8).unwrap();
        let mut ld = Gemm::<f64>::new(4, 2, 3);
        ld.lda = 3;
        assert!(e(ld.check(12, 6, 8)).contains("leading dimension of A is 3, below its 4 rows"));
        let b = Gemm::<f32>::new(2, 2, 2).batched(3);
        assert_eq!((b.stride_a, b.stride_c), (4, 4));
        b.check(12, 12, 12).unwrap();
        assert!(e(b.check(12, 12, 11)).contains("3 matrices 4 apart"));
        let mut overlap = b;
        overlap.stride_c = 2;
        assert!(e(overlap.check(12, 12, 12)).contains("overlap"));
        assert!(e(Gemm::<f32>::new(2, 2, 2).batched(0).check(4, 4, 4)).contains("batch of 0"));
        let huge = Gemm::<f32>::new(1 << 31, 1, 1);
        assert!(e(huge.check(1 << 31, 1, 1 << 31)).contains("m (2147483648)"));
        // A stride whose batch spans more than there are elements is an
        // error, not a wrapped extent that small buffers would pass.
        let mut wraps = Gemm::<f32>::new(2, 2, 2).batched(5);
        wraps.stride_a = 1 << 62;
        assert!(e(wraps.check(8, 20, 20)).contains("A spans more elements"));
    }

    #[test]
    fn flops_and_whether_c_is_read() {
        let g = Gemm::<f32>::new(4, 2, 3);
        assert_eq!(g.flops(), 48.0);
        assert!(!g.reads_c());
        assert!(g.beta(1.0).reads_c());
        assert_eq!(g.batched(2).flops(), 96.0);
    }

    #[cfg(feature = "half")]
    #[test]
    fn half_types_widen_exactly_and_read_c_only_for_a_nonzero_beta() {
        use half::{bf16, f16};
        assert_eq!((bf16::NAME, f16::NAME, f32::NAME), ("bf16", "f16", "f32"));
        assert_eq!(bf16::ONE.to_f64(), 1.0);
        assert_eq!(f16::ZERO.to_f64(), 0.0);
        // bf16 keeps 8 significant bits, f16 11: both are f32s exactly.
        assert_eq!(bf16::from_f32(1.5).to_f64(), 1.5);
        assert_eq!(f16::from_f32(-0.333_251_95).to_f64(), -0.333_251_953_125);
        let g = Gemm::<bf16>::new(64, 48, 80);
        assert!(!g.reads_c());
        assert!(!g.beta(bf16::NEG_ZERO).reads_c(), "-0 is zero");
        assert!(g.beta(bf16::from_f32(-0.5)).reads_c());
        let b = Gemm::<f16>::new(64, 48, 80).batched(3);
        assert_eq!(
            b.extents().unwrap(),
            [3 * 64 * 80, 3 * 80 * 48, 3 * 64 * 48]
        );
    }

    #[cfg(feature = "half")]
    #[test]
    fn a_half_gemv_is_a_one_column_gemm_over_the_same_buffers() {
        use half::bf16;
        let (m, n, lda) = (37, 23, 40);
        let alpha = bf16::from_f32(1.5);
        let v = Gemv::<bf16>::new(m, n)
            .lda(lda)
            .alpha(alpha)
            .beta(bf16::ONE);
        let p = v.as_gemm().unwrap();
        assert_eq!((p.m, p.n, p.k, p.lda, p.ldb, p.ldc), (m, 1, n, lda, n, m));
        assert!(!p.transpose_a && !p.transpose_b);
        assert_eq!((p.alpha, p.beta, p.batch), (alpha, bf16::ONE, 1));
        // The product reads exactly what the gemv checks: A, x, y.
        let a = lda * (n - 1) + m;
        v.check(a, n, m).unwrap();
        p.check(a, n, m).unwrap();
        assert!(p.check(a - 1, n, m).is_err());
        assert!(p.check(a, n - 1, m).is_err());
        assert!(p.check(a, n, m - 1).is_err());
        // Transposed: y = A^T x, x of m and y of n.
        let t = v.transpose().as_gemm().unwrap();
        assert_eq!((t.m, t.n, t.k, t.lda, t.ldb, t.ldc), (n, 1, m, lda, m, n));
        assert!(t.transpose_a && !t.transpose_b);
        t.check(a, m, n).unwrap();
        assert!(t.check(a, m, n - 1).is_err());
        // Nothing to multiply: no call, y stays.
        assert!(Gemv::<bf16>::new(0, 3).as_gemm().is_none());
        assert!(Gemv::<bf16>::new(3, 0).transpose().as_gemm().is_none());
    }
}
