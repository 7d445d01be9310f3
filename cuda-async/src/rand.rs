//! cuRAND random fills as ops (feature `rand`): ordered against every other
//! use of their buffer, on the op's stream, with the stream's generator
//! made once ([`cuda_core::rand::rand_generator`]).
//!
//! A fill restarts the generator at its seed: the same seed gives the same
//! values whatever ran before it and on whichever stream.
//!
//! # Examples
//!
//! ```no_run
//! use cuda_async::blas::{gemv, Gemv};
//! use cuda_async::prelude::*;
//! use cuda_async::rand::{normal, uniform};
//!
//! // y = W x, with W (64x256) normal and x uniform, made on the GPU.
//! let y = zeros::<f32>(64 * 256)
//!     .then(|w| normal(1, 0.0, 0.1, w))
//!     .zip(zeros::<f32>(256).then(|x| uniform(2, x)))
//!     .zip(zeros::<f32>(64))
//!     .then(|((w, x), y)| gemv(Gemv::new(64, 256), w, x, y))
//!     .then(|(_, _, y)| d2h(y))
//!     .sync()?;
//! assert_eq!(y.to_vec()?.len(), 64);
//! # Ok::<(), cuda_async::Error>(())
//! ```

use std::fmt;
use std::marker::PhantomData;

use cuda_core::rand::rand_generator;
pub use cuda_core::rand::{Distribution, Fill, RandScalar};
use cuda_core::Result;

use crate::context::ExecutionContext;
use crate::foreign::{writes, StreamUses, Writes};
use crate::op::{impl_into_future, DeviceOp};
use crate::remote::RemoteContext;
use crate::view::DeviceTarget;

/// Op for [`fill`], [`uniform`] and [`normal`].
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct FillOp<T, D> {
    f: Fill<T>,
    dst: D,
    _t: PhantomData<fn() -> T>,
}

impl<T: fmt::Debug, D> fmt::Debug for FillOp<T, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FillOp")
            .field("fill", &self.f)
            .finish_non_exhaustive()
    }
}

/// Fills `dst` (an owned buffer, `&mut` one or a writable view) with
/// random values of `f` by cuRAND on the op's stream; yields `dst` back.
///
/// # Errors
///
/// [`Error::InvalidArgument`](cuda_core::Error::InvalidArgument) for a
/// fill that does not fit its buffer (a normal fill of an odd length);
/// [`Error::NoLibrary`](cuda_core::Error::NoLibrary) when cuRAND cannot be
/// loaded; [`Error::Capture`](cuda_core::Error::Capture) inside a graph
/// capture (cuRAND's host API fails there: fill before capturing);
/// [`Error::NeedsLocalStream`](cuda_core::Error::NeedsLocalStream) for a
/// fill that is not `f32` or `f64` on a remote context. On a remote
/// context the node fills the buffer with its own cuRAND (the in-memory
/// test device with a host generator: the same seed gives the same values
/// there, not cuRAND's).
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// use cuda_async::rand::{fill, Fill};
///
/// let x = zeros::<f32>(1 << 20)
///     .then(|x| fill(Fill::normal(42, 0.0, 1.0), x))
///     .then(d2h)
///     .sync()?;
/// let mean = x.to_vec()?.iter().sum::<f32>() / (1 << 20) as f32;
/// assert!(mean.abs() < 0.01);
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub fn fill<T, D>(f: Fill<T>, dst: D) -> FillOp<T, D>
where
    T: RandScalar,
    D: DeviceTarget<T>,
{
    FillOp {
        f,
        dst,
        _t: PhantomData,
    }
}

/// [`fill`] with values uniform on `(0, 1]` from `seed`.
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// use cuda_async::rand::uniform;
///
/// let x = zeros::<f64>(1000).then(|x| uniform(7, x)).then(d2h).sync()?;
/// assert!(x.to_vec()?.iter().all(|v| *v > 0.0 && *v <= 1.0));
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub fn uniform<T, D>(seed: u64, dst: D) -> FillOp<T, D>
where
    T: RandScalar,
    D: DeviceTarget<T>,
{
    fill(Fill::uniform(seed), dst)
}

/// [`fill`] with normal values of `mean` and `std_dev` from `seed` (the
/// length of `dst` must be even: cuRAND makes them in pairs).
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// use cuda_async::rand::normal;
///
/// let w = zeros::<f32>(256 * 256)
///     .then(|w| normal(1, 0.0, 0.05, w))
///     .sync()?;
/// # let _ = w;
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub fn normal<T, D>(seed: u64, mean: T, std_dev: T, dst: D) -> FillOp<T, D>
where
    T: RandScalar,
    D: DeviceTarget<T>,
{
    fill(Fill::normal(seed, mean, std_dev), dst)
}

impl<T, D> DeviceOp for FillOp<T, D>
where
    T: RandScalar,
    D: DeviceTarget<T>,
{
    type Output = D;

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<D> {
        let f = self.f;
        f.check(self.dst.range().len())?;
        let uses: Writes<T, D> = writes(self.dst);
        let remote = |r: &mut RemoteContext, out: &Writes<T, D>| r.rand_fill(&f, out.view());
        ctx.library_call("random fill", &uses, remote, |stream, out| {
            let generator = rand_generator(stream)?;
            let mut generator = generator.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: the address holds `out.len()` elements (checked above
            // against the fill), on the stream the generator is bound to,
            // ordered against its other uses by the context; the stream's
            // context is current.
            unsafe { generator.fill(&f, out.addr(), out.len()) }
        })?;
        Ok(uses.into_inner())
    }
}
impl_into_future!(impl[T, D] for FillOp<T, D> where
    T: RandScalar,
    D: DeviceTarget<T>,
);
