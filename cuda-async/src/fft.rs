//! cuFFT transforms as ops (feature `fft`): ordered against every other
//! use of their buffers, on the op's stream, with the stream's plan for
//! the transform's shape made once ([`cuda_core::fft::fft_plan`]).
//!
//! [`Fft`] describes the transform: [`Fft::forward`] and [`Fft::inverse`]
//! (complex to complex), [`Fft::r2c`] and [`Fft::c2r`], of `n` points or
//! `(nx, ny)` (`nx` rows of `ny`), [`Fft::batched`] for several in a row,
//! all in `f32` with [`Complex32`] values. A real-to-complex transform
//! writes `n / 2 + 1` values per row of the last dimension, and a
//! complex-to-real one reads as many. cuFFT does not scale: the inverse of
//! a forward transform of `n` points gives the input times `n`.
//!
//! # Examples
//!
//! ```no_run
//! use cuda_async::fft::{fft, Complex32, Fft};
//! use cuda_async::prelude::*;
//!
//! // The spectrum of a real signal of 8 points: 5 complex values.
//! let signal: Vec<f32> = (0..8).map(|i| (i as f32).sin()).collect();
//! let spectrum = h2d(signal)
//!     .zip(zeros::<Complex32>(5))
//!     .then(|(x, y)| fft(Fft::r2c(8), x, y))
//!     .then(|(_, y)| d2h(y))
//!     .sync()?;
//! assert_eq!(spectrum.to_vec()?.len(), 5);
//! # Ok::<(), cuda_async::Error>(())
//! ```

use std::fmt;

use cuda_core::fft::{fft_plan, under_capture};
pub use cuda_core::fft::{Complex32, Fft, FftDims, FftKind};
use cuda_core::Result;

use crate::context::ExecutionContext;
use crate::foreign::{reads, run_foreign, writes, ForeignPtr, Reads, StreamUses, Writes};
use crate::op::{impl_into_future, DeviceOp};
use crate::view::{DeviceSource, DeviceTarget};

mod sealed {
    pub trait Sealed {}
    impl<I, O> Sealed for super::Fft<I, O> {}
}

/// How a transform uses its input `S`: a complex-to-complex or
/// real-to-complex transform reads it (a buffer, `&` one or a view); a
/// complex-to-real transform, which cuFFT lets overwrite its input, writes
/// it (an owned buffer, `&mut` one or a writable view).
///
/// ```compile_fail
/// use cuda_async::fft::{fft, Complex32, Fft};
/// use cuda_async::DeviceBuffer;
///
/// // A complex-to-real transform overwrites its input: `&` is refused.
/// fn inverse(x: &DeviceBuffer<Complex32>, y: DeviceBuffer<f32>) {
///     let _ = fft(Fft::c2r(8), x, y);
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{S}` cannot be the input of an `{Self}`",
    note = "a complex-to-real transform (`Fft::c2r`) overwrites its input: pass an owned \
            buffer, `&mut` one or a writable view; the other kinds read a buffer, `&` one or a \
            view"
)]
pub trait FftInput<S>: sealed::Sealed {
    /// The input's element.
    #[doc(hidden)]
    type Element;
    /// The input's use by the call.
    #[doc(hidden)]
    type Use: StreamUses<Ptrs = ForeignPtr<Self::Element>, Inner = S>;
    /// The elements of the input.
    #[doc(hidden)]
    fn len(input: &S) -> usize;
    /// The input as the call's use.
    #[doc(hidden)]
    fn uses(input: S) -> Self::Use;
}

impl<S: DeviceSource<Complex32>> FftInput<S> for Fft<Complex32, Complex32> {
    type Element = Complex32;
    type Use = Reads<Complex32, S>;
    fn len(input: &S) -> usize {
        input.range().len()
    }
    fn uses(input: S) -> Self::Use {
        reads(input)
    }
}

impl<S: DeviceSource<f32>> FftInput<S> for Fft<f32, Complex32> {
    type Element = f32;
    type Use = Reads<f32, S>;
    fn len(input: &S) -> usize {
        input.range().len()
    }
    fn uses(input: S) -> Self::Use {
        reads(input)
    }
}

impl<S: DeviceTarget<Complex32>> FftInput<S> for Fft<Complex32, f32> {
    type Element = Complex32;
    type Use = Writes<Complex32, S>;
    fn len(input: &S) -> usize {
        input.range().len()
    }
    fn uses(input: S) -> Self::Use {
        writes(input)
    }
}

/// Op for [`fft`].
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct FftOp<I, O, S, D> {
    plan: Fft<I, O>,
    input: S,
    output: D,
}

impl<I, O, S, D> fmt::Debug for FftOp<I, O, S, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FftOp")
            .field("plan", &self.plan)
            .finish_non_exhaustive()
    }
}

/// Transforms `input` into `output` with cuFFT on the op's stream; yields
/// `(input, output)` back.
///
/// `output` is an owned buffer, `&mut` one or a writable view. `input` is
/// a buffer, `&` one or a view for [`Fft::forward`], [`Fft::inverse`] and
/// [`Fft::r2c`]; for [`Fft::c2r`], which cuFFT lets overwrite its input,
/// an owned buffer, `&mut` one or a writable view, whose values are
/// undefined after the transform. The lengths are checked against the
/// transform before anything runs (an error names the argument that does
/// not fit); a longer buffer is used from its start.
///
/// # Errors
///
/// [`Error::InvalidArgument`](cuda_core::Error::InvalidArgument) for a
/// transform that does not fit its buffers (or a dimension or batch of 0);
/// [`Error::NoLibrary`](cuda_core::Error::NoLibrary) when cuFFT cannot be
/// loaded; [`Error::Capture`](cuda_core::Error::Capture) when cuFFT refuses
/// a call inside a graph capture;
/// [`Error::NeedsLocalStream`](cuda_core::Error::NeedsLocalStream) on a
/// remote context (a lease has no cuFFT command).
///
/// # Examples
///
/// ```no_run
/// use cuda_async::fft::{fft, Complex32, Fft};
/// use cuda_async::prelude::*;
///
/// // Forward then inverse: the input back, times 4.
/// let c = Complex32::new;
/// let x = vec![c(1.0, 0.0), c(0.0, 1.0), c(0.0, 0.0), c(2.0, 0.0)];
/// let back = h2d(x)
///     .zip(zeros::<Complex32>(4))
///     .then(|(x, y)| fft(Fft::forward(4), x, y))
///     .then(|(x, y)| fft(Fft::inverse(4), y, x))
///     .then(|(_, x)| d2h(x))
///     .sync()?;
/// assert!((back.to_vec()?[3].re - 8.0).abs() < 1e-5);
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub fn fft<I, O, S, D>(plan: Fft<I, O>, input: S, output: D) -> FftOp<I, O, S, D>
where
    Fft<I, O>: FftInput<S, Element = I>,
    D: DeviceTarget<O>,
{
    FftOp {
        plan,
        input,
        output,
    }
}

impl<I, O, S, D> DeviceOp for FftOp<I, O, S, D>
where
    Fft<I, O>: FftInput<S, Element = I>,
    D: DeviceTarget<O>,
    S: Send,
{
    type Output = (S, D);

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<(S, D)> {
        let plan = self.plan;
        plan.check(
            <Fft<I, O> as FftInput<S>>::len(&self.input),
            self.output.range().len(),
        )?;
        let uses = (
            <Fft<I, O> as FftInput<S>>::uses(self.input),
            writes::<O, D>(self.output),
        );
        run_foreign(ctx, "fft (cuFFT)", &uses, |stream, (input, output)| {
            let handle = fft_plan(stream, &plan)?;
            let mut handle = handle.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: the addresses hold what `plan` reads and writes
            // (checked above against the uses' lengths), in two buffers
            // or disjoint views (a use reads or writes its own), on the
            // stream the plan is bound to, ordered against their other
            // uses by `run_foreign` (a C2R input is written); the stream's
            // context is current.
            unsafe { handle.exec(&plan, input.addr(), output.addr()) }
                .map_err(|e| under_capture(stream, e, "a cuFFT transform"))
        })?;
        Ok(uses.into_inner())
    }
}
impl_into_future!(impl[I, O, S, D] for FftOp<I, O, S, D> where
    Fft<I, O>: FftInput<S, Element = I>,
    D: DeviceTarget<O>,
    S: Send,
);

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    use super::*;
    use crate::prelude::*;
    use crate::remote::{Recording, RemoteCompletion, RemotePolicy, RemoteSession};
    use crate::Error;

    /// A session that runs nothing and answers at once.
    #[derive(Debug, Default)]
    struct Idle {
        next: AtomicU64,
    }

    impl RemoteSession for Idle {
        fn describe(&self) -> String {
            "idle".into()
        }
        fn fresh_id(&self) -> u64 {
            self.next.fetch_add(1, Ordering::Relaxed) + 1
        }
        fn submit(&self, _: Recording, done: RemoteCompletion) {
            done.complete();
        }
    }

    fn invalid(e: Error) -> String {
        match e {
            Error::InvalidArgument(m) => m,
            e => panic!("not an InvalidArgument: {e}"),
        }
    }

    /// Lengths are checked before anything else, with errors naming the
    /// argument; a transform that fits needs a local stream and says so
    /// on a lease.
    #[test]
    fn lengths_are_checked_first_and_a_lease_has_no_cufft() {
        let remote = RemotePolicy::new(&Arc::new(Idle::default()));
        let c = |n| zeros::<Complex32>(n).sync_with(&remote).unwrap();
        let r = |n| zeros::<f32>(n).sync_with(&remote).unwrap();
        let e = invalid(
            fft(Fft::forward(16), c(10), c(16))
                .sync_with(&remote)
                .unwrap_err(),
        );
        assert!(
            e.contains("fft input holds 10 elements, the plan reads 16"),
            "{e}"
        );
        let x = r(16);
        let e = invalid(fft(Fft::r2c(16), &x, c(8)).sync_with(&remote).unwrap_err());
        assert!(
            e.contains("fft output holds 8 elements, the plan writes 9"),
            "{e}"
        );
        let e = invalid(
            fft(Fft::c2r((4, 8)).batched(2), c(39), r(64))
                .sync_with(&remote)
                .unwrap_err(),
        );
        assert!(
            e.contains("input holds 39 elements, the plan reads 40"),
            "{e}"
        );
        let e = invalid(
            fft(Fft::forward(0), c(1), c(1))
                .sync_with(&remote)
                .unwrap_err(),
        );
        assert!(e.contains("0 points"), "{e}");
        let mut y = c(9);
        let e = fft(Fft::r2c(16), &x, &mut y)
            .sync_with(&remote)
            .unwrap_err();
        assert!(
            matches!(&e, Error::NeedsLocalStream { op, .. } if op == "fft (cuFFT)"),
            "{e}"
        );
        let e = fft(Fft::inverse((2, 2)), c(4), c(4))
            .sync_with(&remote)
            .unwrap_err();
        assert!(matches!(&e, Error::NeedsLocalStream { .. }), "{e}");
    }
}
