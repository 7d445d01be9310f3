//! cuBLAS matrix products ([`gemm`]) and matrix-vector products ([`gemv`])
//! as ops (feature `blas`): ordered against every
//! other use of their buffers, on the op's stream, with the stream's
//! cuBLAS handle made once ([`cuda_core::blas::blas_handle`]). Products
//! run through cuBLASLt with one plan per shape, made on its first product
//! and kept by the handle ([`cuda_core::blas::BlasHandle::gemm`]).
//!
//! Matrices are column-major, as cuBLAS takes them. A row-major
//! `C = A * B` (`A` of `m` x `k`) is the column-major `C^T = B^T * A^T`:
//! `gemm(Gemm::new(n, m, k), b, a, c)`.

use std::fmt;
use std::marker::PhantomData;

use cuda_core::blas::blas_handle;
pub use cuda_core::blas::{BlasScalar, Gemm, Gemv};
use cuda_core::Result;

use crate::context::ExecutionContext;
use crate::foreign::{reads, run_foreign, writes, Reads, StreamUses, Writes};
use crate::op::{impl_into_future, DeviceOp};
use crate::remote::RemoteContext;
use crate::view::{DeviceSource, DeviceTarget};

/// The lease protocol's name of `T`.
/// What a product reads (`a`, `b`) and writes (`c`).
type Uses<T, A, B, C> = (Reads<T, A>, Reads<T, B>, Writes<T, C>);

/// Op for [`gemm`].
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct GemmOp<T, A, B, C> {
    g: Gemm<T>,
    a: A,
    b: B,
    c: C,
    _t: PhantomData<fn() -> T>,
}

impl<T: fmt::Debug, A, B, C> fmt::Debug for GemmOp<T, A, B, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GemmOp")
            .field("gemm", &self.g)
            .finish_non_exhaustive()
    }
}

/// `C = alpha * op(A) * op(B) + beta * C` with cuBLAS on the op's stream
/// (or a strided batch of such products: [`Gemm::batched`]); yields
/// `(a, b, c)` back.
///
/// `a` and `b` are buffers, `&` buffers or views; `c` an owned buffer,
/// `&mut` one or a writable view. The shapes are checked against their
/// lengths before anything runs (an error names the matrix that does not
/// fit). `f32` and `f64`; with the `half` feature also `half::bf16` and
/// `half::f16` (the product is accumulated in `f32` and `C` rounded to
/// the half type once; `alpha` and `beta` reach cuBLAS as `f32`).
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a shape that does not fit its buffer;
/// [`Error::NoLibrary`] when cuBLAS cannot be loaded.
///
/// On a remote context a product (of any of the four element types) is
/// one command that the node runs with its own cuBLAS (no kernel is
/// shipped), after checking the shapes against the buffers again.
///
/// [`Error::InvalidArgument`]: cuda_core::Error::InvalidArgument
/// [`Error::NoLibrary`]: cuda_core::Error::NoLibrary
///
/// # Examples
///
/// ```no_run
/// use cuda_async::blas::{gemm, Gemm};
/// use cuda_async::prelude::*;
///
/// // (2x3) * (3x2), column-major.
/// let a = h2d(vec![1.0f32, 4.0, 2.0, 5.0, 3.0, 6.0]);
/// let b = h2d(vec![1.0f32, 0.0, 1.0, 0.0, 1.0, 0.0]);
/// let c = a
///     .zip(b)
///     .zip(zeros::<f32>(4))
///     .then(|((a, b), c)| gemm(Gemm::new(2, 2, 3), a, b, c))
///     .then(|(_, _, c)| d2h(c))
///     .sync()?;
/// assert_eq!(c.to_vec()?, [4.0, 10.0, 2.0, 5.0]);
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub fn gemm<T, A, B, C>(g: Gemm<T>, a: A, b: B, c: C) -> GemmOp<T, A, B, C>
where
    T: BlasScalar,
    A: DeviceSource<T>,
    B: DeviceSource<T>,
    C: DeviceTarget<T>,
{
    GemmOp {
        g,
        a,
        b,
        c,
        _t: PhantomData,
    }
}

impl<T, A, B, C> DeviceOp for GemmOp<T, A, B, C>
where
    T: BlasScalar,
    A: DeviceSource<T>,
    B: DeviceSource<T>,
    C: DeviceTarget<T>,
{
    type Output = (A, B, C);

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<(A, B, C)> {
        let g = self.g;
        g.check(
            self.a.range().len(),
            self.b.range().len(),
            self.c.range().len(),
        )?;
        let uses: Uses<T, A, B, C> = (reads(self.a), reads(self.b), writes(self.c));
        let remote = |r: &mut RemoteContext, uses: &Uses<T, A, B, C>| {
            let (a, b, c) = uses;
            r.gemm(&g, a.view(), b.view(), c.view())
        };
        ctx.library_call("gemm", &uses, remote, |stream, (a, b, c)| {
            let handle = blas_handle(stream)?;
            let mut handle = handle.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: the addresses hold what `g` reads and writes (checked
            // above against the uses' lengths), on the stream the handle is
            // bound to, ordered against their other uses by the context;
            // the stream's context is current.
            unsafe { handle.gemm(&g, a.addr(), b.addr(), c.addr()) }
        })?;
        Ok(uses.into_inner())
    }
}
impl_into_future!(impl[T, A, B, C] for GemmOp<T, A, B, C> where
    T: BlasScalar,
    A: DeviceSource<T>,
    B: DeviceSource<T>,
    C: DeviceTarget<T>,
);

/// Op for [`gemv`].
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct GemvOp<T, A, X, Y> {
    g: Gemv<T>,
    a: A,
    x: X,
    y: Y,
    _t: PhantomData<fn() -> T>,
}

impl<T: fmt::Debug, A, X, Y> fmt::Debug for GemvOp<T, A, X, Y> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GemvOp")
            .field("gemv", &self.g)
            .finish_non_exhaustive()
    }
}

/// `y = alpha * op(A) * x + beta * y` with cuBLAS on the op's stream;
/// yields `(a, x, y)` back.
///
/// `a` and `x` are buffers, `&` buffers or views; `y` an owned buffer,
/// `&mut` one or a writable view. The shapes are checked against their
/// lengths before anything runs. `f32` and `f64`; with the `half`
/// feature also `half::bf16` and `half::f16`, as a one-column
/// `cublasGemmEx` (cuBLAS has no half-precision gemv; `f32` accumulation).
///
/// # Errors
///
/// As [`gemm`], and [`Error::NeedsLocalStream`] on a remote context.
///
/// [`Error::NeedsLocalStream`]: cuda_core::Error::NeedsLocalStream
///
/// # Examples
///
/// ```no_run
/// use cuda_async::blas::{gemv, Gemv};
/// use cuda_async::prelude::*;
///
/// // A 2x3 (column-major) times x = (1, 1, 1).
/// let a = h2d(vec![1.0f32, 4.0, 2.0, 5.0, 3.0, 6.0]);
/// let y = a
///     .zip(h2d(vec![1.0f32; 3]))
///     .zip(zeros::<f32>(2))
///     .then(|((a, x), y)| gemv(Gemv::new(2, 3), a, x, y))
///     .then(|(_, _, y)| d2h(y))
///     .sync()?;
/// assert_eq!(y.to_vec()?, [6.0, 15.0]);
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub fn gemv<T, A, X, Y>(g: Gemv<T>, a: A, x: X, y: Y) -> GemvOp<T, A, X, Y>
where
    T: BlasScalar,
    A: DeviceSource<T>,
    X: DeviceSource<T>,
    Y: DeviceTarget<T>,
{
    GemvOp {
        g,
        a,
        x,
        y,
        _t: PhantomData,
    }
}

impl<T, A, X, Y> DeviceOp for GemvOp<T, A, X, Y>
where
    T: BlasScalar,
    A: DeviceSource<T>,
    X: DeviceSource<T>,
    Y: DeviceTarget<T>,
{
    type Output = (A, X, Y);

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<(A, X, Y)> {
        let g = self.g;
        g.check(
            self.a.range().len(),
            self.x.range().len(),
            self.y.range().len(),
        )?;
        let uses: (Reads<T, A>, Reads<T, X>, Writes<T, Y>) =
            (reads(self.a), reads(self.x), writes(self.y));
        run_foreign(ctx, "gemv", &uses, |stream, (a, x, y)| {
            let handle = blas_handle(stream)?;
            let mut handle = handle.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: the addresses hold what `g` reads and writes (checked
            // above against the uses' lengths), on the stream the handle is
            // bound to, ordered against their other uses by `run_foreign`;
            // the stream's context is current.
            unsafe { handle.gemv(&g, a.addr(), x.addr(), y.addr()) }
        })?;
        Ok(uses.into_inner())
    }
}
impl_into_future!(impl[T, A, X, Y] for GemvOp<T, A, X, Y> where
    T: BlasScalar,
    A: DeviceSource<T>,
    X: DeviceSource<T>,
    Y: DeviceTarget<T>,
);
