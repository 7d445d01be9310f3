//! cuFFT: fast Fourier transforms on a stream (feature `fft`).
//!
//! [`Fft`] describes one transform (or a batch of them): complex to
//! complex forward or inverse, real to complex, or complex to real, of one
//! or two dimensions, in `f32`. It checks itself against the lengths of
//! its buffers before anything runs. [`fft_plan`] gives the cuFFT plan of
//! a stream for that shape, made and bound to the stream on first use and
//! kept (a transform costs the library call, not a plan's creation). The
//! raw calls are here; `cuda-async`'s `fft` module orders them against
//! every other use of their buffers.
//!
//! Layouts are cuFFT's packed ones: a 2-D transform of `(nx, ny)` reads
//! `nx` rows of `ny` elements each, row after row; a real-to-complex
//! transform writes `ny / 2 + 1` complex values per row (the others are
//! their conjugates), and a complex-to-real one reads as many. Transforms
//! of a batch follow each other. cuFFT does not scale: an inverse of a
//! forward transform of `n` points gives the input times `n`.

use std::ffi::{c_int, c_longlong};
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cufft::{result, sys};
use cudarc::driver::{CudaStream, DeviceRepr, ValidAsZeroBits};

use crate::per_stream::{failed, PerStream};
use crate::{AnyBitPattern, Error, Result};

/// The library's name in errors.
const CUFFT: &str = "cuFFT (libcufft)";

/// cuFFT's sign of the exponent of a forward transform.
const CUFFT_FORWARD: c_int = -1;
/// cuFFT's sign of the exponent of an inverse transform.
const CUFFT_INVERSE: c_int = 1;

/// Whether cuFFT can be loaded on this machine (asked once: the answer is
/// kept).
pub fn fft_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to load the library; no cuFFT call is made.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// A complex `f32`, laid out as cuFFT's `cufftComplex` (`float2`: the real
/// part, then the imaginary part, 8-byte aligned).
#[repr(C, align(8))]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Complex32 {
    /// The real part.
    pub re: f32,
    /// The imaginary part.
    pub im: f32,
}

impl Complex32 {
    /// `re + im i`.
    pub const fn new(re: f32, im: f32) -> Self {
        Self { re, im }
    }
}

// SAFETY: plain old data of two `f32`s with no padding (8 bytes, align 8),
// as `float2` on the device.
unsafe impl DeviceRepr for Complex32 {}
// SAFETY: all-zero bits are `0 + 0i`.
unsafe impl ValidAsZeroBits for Complex32 {}
// SAFETY: two `f32`s and no padding: every bit pattern is a value.
unsafe impl AnyBitPattern for Complex32 {}

/// What an [`Fft`] computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FftKind {
    /// Complex to complex, `exp(-2 pi i jk / n)`.
    Forward,
    /// Complex to complex, `exp(+2 pi i jk / n)`, unscaled.
    Inverse,
    /// Real to complex (forward): `n / 2 + 1` values along the last
    /// dimension.
    R2C,
    /// Complex to real (inverse, unscaled), from `n / 2 + 1` values along
    /// the last dimension. cuFFT overwrites its input.
    C2R,
}

/// The points of one transform: `One(n)`, or `Two(nx, ny)` for `nx` rows
/// of `ny` elements (row after row). `usize` and `(usize, usize)` convert
/// into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FftDims {
    /// A 1-D transform of `n` points.
    One(usize),
    /// A 2-D transform of `nx` rows of `ny` points.
    Two(usize, usize),
}

impl From<usize> for FftDims {
    fn from(n: usize) -> Self {
        FftDims::One(n)
    }
}

impl From<(usize, usize)> for FftDims {
    fn from((nx, ny): (usize, usize)) -> Self {
        FftDims::Two(nx, ny)
    }
}

impl fmt::Display for FftDims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FftDims::One(n) => write!(f, "{n}"),
            FftDims::Two(nx, ny) => write!(f, "{nx}x{ny}"),
        }
    }
}

/// One transform, or a batch of them, in `f32`: input elements `I`,
/// output elements `O` ([`Complex32`] or `f32`, by kind):
///
/// - [`Fft::forward`] and [`Fft::inverse`]: [`Complex32`] to [`Complex32`];
/// - [`Fft::r2c`]: `f32` to [`Complex32`];
/// - [`Fft::c2r`]: [`Complex32`] to `f32`.
pub struct Fft<I, O> {
    kind: FftKind,
    dims: FftDims,
    batch: usize,
    _t: PhantomData<fn() -> (I, O)>,
}

impl<I, O> Clone for Fft<I, O> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<I, O> Copy for Fft<I, O> {}

impl<I, O> PartialEq for Fft<I, O> {
    fn eq(&self, other: &Self) -> bool {
        (self.kind, self.dims, self.batch) == (other.kind, other.dims, other.batch)
    }
}

impl<I, O> Eq for Fft<I, O> {}

impl<I, O> fmt::Debug for Fft<I, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fft")
            .field("kind", &self.kind)
            .field("dims", &self.dims)
            .field("batch", &self.batch)
            .finish()
    }
}

impl Fft<Complex32, Complex32> {
    /// A forward complex-to-complex transform of `dims` (`n` or
    /// `(nx, ny)`).
    pub fn forward(dims: impl Into<FftDims>) -> Self {
        Self::of(FftKind::Forward, dims.into())
    }

    /// An inverse complex-to-complex transform of `dims`, unscaled: the
    /// inverse of a forward transform gives the input times its points.
    pub fn inverse(dims: impl Into<FftDims>) -> Self {
        Self::of(FftKind::Inverse, dims.into())
    }
}

impl Fft<f32, Complex32> {
    /// A real-to-complex (forward) transform of `dims`: it writes
    /// `n / 2 + 1` complex values per row of the last dimension.
    pub fn r2c(dims: impl Into<FftDims>) -> Self {
        Self::of(FftKind::R2C, dims.into())
    }
}

impl Fft<Complex32, f32> {
    /// A complex-to-real (inverse, unscaled) transform of `dims`: it reads
    /// `n / 2 + 1` complex values per row of the last dimension, and cuFFT
    /// overwrites them.
    pub fn c2r(dims: impl Into<FftDims>) -> Self {
        Self::of(FftKind::C2R, dims.into())
    }
}

/// A plan's shape: transforms of one cuFFT type, points and batch (a
/// forward and an inverse complex transform share their plan).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct PlanKey {
    kind: PlanType,
    dims: FftDims,
    batch: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum PlanType {
    C2C,
    R2C,
    C2R,
}

impl PlanType {
    fn cufft(self) -> sys::cufftType {
        match self {
            PlanType::C2C => sys::cufftType::CUFFT_C2C,
            PlanType::R2C => sys::cufftType::CUFFT_R2C,
            PlanType::C2R => sys::cufftType::CUFFT_C2R,
        }
    }
}

impl<I, O> Fft<I, O> {
    fn of(kind: FftKind, dims: FftDims) -> Self {
        Self {
            kind,
            dims,
            batch: 1,
            _t: PhantomData,
        }
    }

    /// `batch` transforms, one after the other in the input and the output.
    pub fn batched(mut self, batch: usize) -> Self {
        self.batch = batch;
        self
    }

    /// What the transform computes.
    pub fn kind(&self) -> FftKind {
        self.kind
    }

    /// The points of one transform.
    pub fn dims(&self) -> FftDims {
        self.dims
    }

    /// The transforms in the batch.
    pub fn batch(&self) -> usize {
        self.batch
    }

    fn key(&self) -> PlanKey {
        let kind = match self.kind {
            FftKind::Forward | FftKind::Inverse => PlanType::C2C,
            FftKind::R2C => PlanType::R2C,
            FftKind::C2R => PlanType::C2R,
        };
        PlanKey {
            kind,
            dims: self.dims,
            batch: self.batch,
        }
    }

    /// The elements the transform reads (of `I`) and writes (of `O`),
    /// batch included.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a dimension or a batch of 0, or
    /// counts beyond `usize`.
    pub fn lens(&self) -> Result<[usize; 2]> {
        let bad = |what: String| Err(Error::InvalidArgument(format!("fft: {what}")));
        let (rows, last) = match self.dims {
            FftDims::One(n) => {
                if n == 0 {
                    return bad("a transform of 0 points (n is 0)".into());
                }
                (1, n)
            }
            FftDims::Two(nx, ny) => {
                if nx == 0 || ny == 0 {
                    return bad(format!(
                        "a transform of {nx}x{ny} points (nx and ny must be at least 1)"
                    ));
                }
                (nx, ny)
            }
        };
        if self.batch == 0 {
            return bad("a batch of 0 transforms (at least 1)".into());
        }
        let overflow = || {
            Error::InvalidArgument(format!(
                "fft: {} transforms of {} points: the element count overflows usize",
                self.batch, self.dims
            ))
        };
        let count = |per_row: usize| {
            rows.checked_mul(per_row)
                .and_then(|v| v.checked_mul(self.batch))
                .ok_or_else(overflow)
        };
        let full = count(last)?;
        let half = count(last / 2 + 1)?;
        Ok(match self.kind {
            FftKind::Forward | FftKind::Inverse => [full, full],
            FftKind::R2C => [full, half],
            FftKind::C2R => [half, full],
        })
    }

    /// Checks the transform against an input of `input` elements and an
    /// output of `output` elements; a buffer may be longer than the
    /// transform uses (it uses the first elements).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the argument that does not fit,
    /// or as [`Fft::lens`].
    pub fn check(&self, input: usize, output: usize) -> Result<()> {
        let [need_in, need_out] = self.lens()?;
        let what = |v: &str| match (self.kind, v) {
            (FftKind::R2C, "input") | (FftKind::C2R, "output") => "real",
            _ => "complex",
        };
        for (name, verb, holds, need) in [
            ("input", "reads", input, need_in),
            ("output", "writes", output, need_out),
        ] {
            if holds < need {
                return Err(Error::InvalidArgument(format!(
                    "fft {name} holds {holds} elements, the plan {verb} {need} ({} values: \
                     {} transform(s) of {} points)",
                    what(name),
                    self.batch,
                    self.dims,
                )));
            }
        }
        Ok(())
    }
}

/// A cuFFT plan bound to one stream ([`fft_plan`]): one shape of transform.
#[derive(Debug)]
pub struct FftPlan {
    handle: sys::cufftHandle,
    key: PlanKey,
}

// SAFETY: a cuFFT plan may be used from any thread as long as calls on it
// do not overlap; every `FftPlan` lives behind a `Mutex` (`fft_plan` hands
// out `Arc<Mutex<FftPlan>>` only), so they never do.
unsafe impl Send for FftPlan {}

impl FftPlan {
    /// Enqueues `f` on the plan's stream: reads the input at device address
    /// `input`, writes the output at `output`.
    ///
    /// # Safety
    ///
    /// `input` and `output` address live device memory of the plan's
    /// context holding what `f` reads and writes ([`Fft::check`] passed for
    /// their lengths), apart from each other, and ordered against their
    /// other uses by the caller: nothing else writes the input or uses the
    /// output meanwhile (and, for [`FftKind::C2R`], which cuFFT lets
    /// overwrite its input, nothing else uses the input meanwhile). The
    /// plan's context is current.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `f` is not the shape the plan was
    /// made for; a cuFFT status naming the call.
    pub unsafe fn exec<I, O>(&mut self, f: &Fft<I, O>, input: u64, output: u64) -> Result<()> {
        if f.key() != self.key {
            return Err(Error::InvalidArgument(format!(
                "fft: the plan was made for {:?}, not {:?}",
                self.key,
                f.key()
            )));
        }
        let h = self.handle;
        match f.kind {
            FftKind::Forward | FftKind::Inverse => {
                let dir = if f.kind == FftKind::Forward {
                    CUFFT_FORWARD
                } else {
                    CUFFT_INVERSE
                };
                // SAFETY: the caller's contract; the plan is a live C2C plan
                // of `f`'s shape (checked above).
                unsafe { result::exec_c2c(h, input as *mut _, output as *mut _, dir) }
                    .map_err(|e| failed("cufftExecC2C", e.0))
            }
            // SAFETY: as above, an R2C plan.
            FftKind::R2C => unsafe { result::exec_r2c(h, input as *mut _, output as *mut _) }
                .map_err(|e| failed("cufftExecR2C", e.0)),
            // SAFETY: as above, a C2R plan.
            FftKind::C2R => unsafe { result::exec_c2r(h, input as *mut _, output as *mut _) }
                .map_err(|e| failed("cufftExecC2R", e.0)),
        }
    }
}

/// Makes a plan of `key` bound to `stream` (the stream's context current).
fn make_plan(stream: &CudaStream, key: PlanKey) -> Result<FftPlan> {
    let too_large =
        |v: usize| Error::InvalidArgument(format!("fft: {v} is beyond what cuFFT takes (i64)"));
    let long = |v: usize| c_longlong::try_from(v).map_err(|_| too_large(v));
    let (rank, mut n) = match key.dims {
        FftDims::One(n) => (1, [long(n)?, 0]),
        FftDims::Two(nx, ny) => (2, [long(nx)?, long(ny)?]),
    };
    let batch = long(key.batch)?;
    let handle = result::create().map_err(|e| failed("cufftCreate", e.0))?;
    // SAFETY: `handle` was just made; `n` holds `rank` sizes.
    match unsafe { shape_plan(handle, stream, key, rank, &mut n, batch) } {
        Ok(()) => Ok(FftPlan { handle, key }),
        Err(e) => {
            // SAFETY: made above, never used for a transform, not kept.
            let _ = unsafe { result::destroy(handle) };
            Err(e)
        }
    }
}

/// Makes `handle` a plan of `key` (sizes `n[..rank]`, `batch`) bound to
/// `stream`.
///
/// # Safety
///
/// `handle` is a fresh cuFFT handle; `rank` is 1 or 2; the stream's
/// context is current.
unsafe fn shape_plan(
    handle: sys::cufftHandle,
    stream: &CudaStream,
    key: PlanKey,
    rank: c_int,
    n: &mut [c_longlong; 2],
    batch: c_longlong,
) -> Result<()> {
    // SAFETY: the caller's contract; `n` holds `rank` sizes; null
    // embeddings select the packed layout (strides and distances are then
    // ignored).
    unsafe {
        result::make_plan_many64(
            handle,
            rank,
            n.as_mut_ptr(),
            std::ptr::null_mut(),
            1,
            0,
            std::ptr::null_mut(),
            1,
            0,
            key.kind.cufft(),
            batch,
        )
    }
    .map_err(|e| failed("cufftMakePlanMany64", e.0))?;
    // SAFETY: a live plan; the stream belongs to the current context. A
    // plan is used only for the stream of its key (a stream made later at a
    // freed one's address is that stream).
    unsafe { result::set_stream(handle, stream.cu_stream() as _) }
        .map_err(|e| failed("cufftSetStream", e.0))
}

/// The cuFFT plan of `stream` for `f`'s shape, made on its first use and
/// bound to it (also while the stream is being captured into a graph),
/// then kept for the process's life: one per stream and shape a transform
/// ran with. A forward and an inverse complex transform share their plan.
///
/// # Errors
///
/// [`Error::NoLibrary`] when cuFFT cannot be loaded; as [`Fft::lens`];
/// [`Error::Capture`] when cuFFT cannot make the plan while the stream is
/// being captured; a cuFFT status if the plan cannot be made otherwise.
pub fn fft_plan<I, O>(stream: &CudaStream, f: &Fft<I, O>) -> Result<Arc<Mutex<FftPlan>>> {
    static PLANS: OnceLock<PerStream<FftPlan, PlanKey>> = OnceLock::new();
    if !fft_present() {
        return Err(Error::NoLibrary { library: CUFFT });
    }
    f.lens()?;
    let key = f.key();
    PLANS
        .get_or_init(PerStream::new)
        .get_keyed(stream, key, || make_plan(stream, key))
        .map_err(|e| under_capture(stream, e, "making a cuFFT plan"))
}

/// `e` as an [`Error::Capture`] naming `what` when `stream` is being
/// captured into a graph (where cuFFT may refuse what it does outside
/// one); `e` itself otherwise.
pub fn under_capture(stream: &CudaStream, e: Error, what: &str) -> Error {
    match (&e, crate::graph::is_capturing(stream)) {
        (Error::Library { .. }, Ok(true)) => Error::Capture(format!(
            "{what} failed inside a stream capture ({e}): run the fft outside the graph"
        )),
        _ => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(r: Result<()>) -> String {
        r.unwrap_err().to_string()
    }

    #[test]
    fn lengths_follow_the_kind_and_the_last_dimension() {
        assert_eq!(Fft::forward(16).lens().unwrap(), [16, 16]);
        assert_eq!(Fft::inverse((4, 6)).batched(3).lens().unwrap(), [72, 72]);
        assert_eq!(Fft::r2c(16).lens().unwrap(), [16, 9]);
        assert_eq!(Fft::r2c(15).lens().unwrap(), [15, 8]);
        assert_eq!(Fft::c2r(16).batched(2).lens().unwrap(), [18, 32]);
        assert_eq!(Fft::r2c((4, 6)).lens().unwrap(), [24, 16]);
        assert_eq!(Fft::c2r((3, 5)).batched(2).lens().unwrap(), [18, 30]);
        assert_eq!(Fft::forward(1).lens().unwrap(), [1, 1]);
    }

    #[test]
    fn shapes_are_checked_before_any_call() {
        Fft::forward(16).check(16, 16).unwrap();
        Fft::forward(16).check(20, 17).unwrap();
        let short_in = e(Fft::forward(16).check(10, 16));
        assert!(
            short_in.contains("fft input holds 10 elements, the plan reads 16"),
            "{short_in}"
        );
        let short_out = e(Fft::r2c(16).batched(2).check(32, 17));
        assert!(
            short_out.contains("fft output holds 17 elements, the plan writes 18")
                && short_out.contains("complex"),
            "{short_out}"
        );
        Fft::c2r((4, 8)).check(20, 32).unwrap();
        let c2r = e(Fft::c2r((4, 8)).check(19, 32));
        assert!(
            c2r.contains(
                "fft input holds 19 elements, the plan reads 20 (complex values: 1 \
                          transform(s) of 4x8 points)"
            ),
            "{c2r}"
        );
        let real = e(Fft::c2r((4, 8)).check(20, 31));
        assert!(
            real.contains("output holds 31") && real.contains("(real values"),
            "{real}"
        );
    }

    #[test]
    fn empty_and_overflowing_shapes_are_refused_by_name() {
        assert!(e(Fft::forward(0).check(0, 0)).contains("n is 0"));
        assert!(e(Fft::r2c((4, 0)).check(0, 0)).contains("nx and ny"));
        assert!(e(Fft::forward(4).batched(0).check(4, 4)).contains("batch of 0"));
        let huge = e(Fft::forward((usize::MAX / 2, 3)).check(0, 0));
        assert!(huge.contains("overflows usize"), "{huge}");
        let huge = e(Fft::c2r(8).batched(usize::MAX / 4).check(0, 0));
        assert!(huge.contains("overflows usize"), "{huge}");
    }

    #[test]
    fn forward_and_inverse_share_their_plan() {
        assert_eq!(Fft::forward(8).key(), Fft::inverse(8).key());
        assert_ne!(Fft::forward(8).key(), Fft::forward(8).batched(2).key());
        assert_ne!(Fft::r2c(8).key(), Fft::c2r(8).key());
        assert_ne!(Fft::forward((2, 4)).key(), Fft::forward((4, 2)).key());
    }

    #[test]
    fn complex_is_laid_out_as_float2() {
        assert_eq!(std::mem::size_of::<Complex32>(), 8);
        assert_eq!(std::mem::align_of::<Complex32>(), 8);
        assert_eq!(
            std::mem::size_of::<Complex32>(),
            std::mem::size_of::<sys::cufftComplex>()
        );
    }
}
