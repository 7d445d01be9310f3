//! cuRAND: random fills on a stream (feature `rand`).
//!
//! [`Fill`] describes one fill (a seed and a distribution) and checks it
//! against the length of its buffer before anything runs;
//! [`rand_generator`] gives the cuRAND generator of a stream, made and
//! bound to it on first use and kept. A fill restarts the generator at its
//! seed, so the same seed gives the same values whatever ran before it and
//! on whichever stream. Fills cannot be captured into graphs: cuRAND's
//! host API fails inside a stream capture, so [`rand_generator`] refuses. The raw calls are here; `cuda-async`'s `rand`
//! module orders them against every other use of their buffers.

use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::curand::{result, sys};
use cudarc::driver::{CudaStream, DeviceRepr};

use crate::per_stream::{failed, PerStream};
use crate::{Error, Result};

/// The library's name in errors.
const CURAND: &str = "cuRAND (libcurand)";

/// Whether cuRAND can be loaded on this machine (asked once: the answer is
/// kept).
pub fn rand_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to load the library; no cuRAND call is made.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// An element type cuRAND fills: `f32` and `f64`.
pub trait RandScalar: DeviceRepr + Copy + Send + Sync + PartialEq + fmt::Debug + 'static {
    /// Whether the value is finite.
    #[doc(hidden)]
    fn finite(self) -> bool;

    /// The value as `f64` (exact for both types).
    #[doc(hidden)]
    fn to_f64(self) -> f64;

    /// Fills `n` elements at device address `out` from generator `g`.
    ///
    /// # Safety
    ///
    /// `out` addresses `n` elements of live device memory of the
    /// generator's context that nothing else uses meanwhile.
    #[doc(hidden)]
    unsafe fn fill(
        g: sys::curandGenerator_t,
        d: Distribution<Self>,
        out: u64,
        n: usize,
    ) -> Result<()>;
}

macro_rules! rand_scalar {
    ($t:ty, $uniform:ident, $normal:ident, $ucall:literal, $ncall:literal) => {
        impl RandScalar for $t {
            fn finite(self) -> bool {
                self.is_finite()
            }

            fn to_f64(self) -> f64 {
                f64::from(self)
            }

            unsafe fn fill(
                g: sys::curandGenerator_t,
                d: Distribution<Self>,
                out: u64,
                n: usize,
            ) -> Result<()> {
                let out = out as *mut $t;
                match d {
                    // SAFETY: the caller's contract.
                    Distribution::Uniform => unsafe { result::generate::$uniform(g, out, n) }
                        .map_err(|e| failed($ucall, e.0)),
                    Distribution::Normal { mean, std_dev } => {
                        // SAFETY: the caller's contract; `n` is even
                        // (checked by `Fill::check`).
                        unsafe { result::generate::$normal(g, out, n, mean, std_dev) }
                            .map_err(|e| failed($ncall, e.0))
                    }
                }
            }
        }
    };
}

rand_scalar!(
    f32,
    uniform_f32,
    normal_f32,
    "curandGenerateUniform",
    "curandGenerateNormal"
);
rand_scalar!(
    f64,
    uniform_f64,
    normal_f64,
    "curandGenerateUniformDouble",
    "curandGenerateNormalDouble"
);

/// The distribution of a [`Fill`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Distribution<T> {
    /// Uniform on `(0, 1]`.
    Uniform,
    /// Normal with this mean and standard deviation.
    Normal {
        /// The mean.
        mean: T,
        /// The standard deviation.
        std_dev: T,
    },
}

/// One random fill of a buffer: a seed and a [`Distribution`]. The
/// generator is cuRAND's Philox4x32-10, restarted at the seed for every
/// fill.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fill<T> {
    seed: u64,
    dist: Distribution<T>,
}

impl<T: RandScalar> Fill<T> {
    /// Values uniform on `(0, 1]`.
    pub fn uniform(seed: u64) -> Self {
        Self {
            seed,
            dist: Distribution::Uniform,
        }
    }

    /// Normal values of `mean` and `std_dev`. cuRAND makes them in pairs:
    /// the buffer's length must be even.
    pub fn normal(seed: u64, mean: T, std_dev: T) -> Self {
        Self {
            seed,
            dist: Distribution::Normal { mean, std_dev },
        }
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The distribution.
    pub fn distribution(&self) -> Distribution<T> {
        self.dist
    }

    /// Checks the fill against a buffer of `len` elements.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an odd length with a normal
    /// distribution, or a mean or deviation that is not finite.
    pub fn check(&self, len: usize) -> Result<()> {
        if let Distribution::Normal { mean, std_dev } = self.dist {
            if !mean.finite() || !std_dev.finite() {
                return Err(Error::InvalidArgument(format!(
                    "random fill: the normal distribution's mean ({mean:?}) and standard \
                     deviation ({std_dev:?}) must be finite"
                )));
            }
            if len % 2 == 1 {
                return Err(Error::InvalidArgument(format!(
                    "random fill: cuRAND makes normal values in pairs, and the buffer holds \
                     {len} elements (an odd count): fill one element more, or one less"
                )));
            }
        }
        Ok(())
    }
}

/// A cuRAND generator bound to one stream ([`rand_generator`]).
#[derive(Debug)]
pub struct RandGenerator {
    generator: sys::curandGenerator_t,
}

// SAFETY: a cuRAND generator may be used from any thread as long as calls
// on it do not overlap; every `RandGenerator` lives behind a `Mutex`
// (`rand_generator` hands out `Arc<Mutex<RandGenerator>>` only), so they
// never do.
unsafe impl Send for RandGenerator {}

impl RandGenerator {
    /// Enqueues fill `f` of `len` elements at device address `out` on the
    /// generator's stream, from the start of `f`'s seed.
    ///
    /// # Safety
    ///
    /// `out` addresses `len` elements of live device memory of the
    /// generator's context ([`Fill::check`] passed for `len`), ordered
    /// against its other uses by the caller; the context is current.
    pub unsafe fn fill<T: RandScalar>(&mut self, f: &Fill<T>, out: u64, len: usize) -> Result<()> {
        let g = self.generator;
        // SAFETY: `g` is a live generator (kept for the process's life).
        unsafe { result::set_seed(g, f.seed) }
            .map_err(|e| failed("curandSetPseudoRandomGeneratorSeed", e.0))?;
        // SAFETY: as above.
        unsafe { result::set_offset(g, 0) }.map_err(|e| failed("curandSetGeneratorOffset", e.0))?;
        // SAFETY: the caller's contract.
        unsafe { T::fill(g, f.dist, out, len) }
    }
}

/// The cuRAND generator of `stream`, made on its first use and bound to it,
/// then kept for the process's life: one per stream a fill ran on.
///
/// # Errors
///
/// [`Error::NoLibrary`] when cuRAND cannot be loaded; [`Error::Capture`]
/// on a stream being captured into a graph (cuRAND's host API fails
/// there); a cuRAND status if the generator cannot be made.
pub fn rand_generator(stream: &CudaStream) -> Result<Arc<Mutex<RandGenerator>>> {
    static GENERATORS: OnceLock<PerStream<RandGenerator>> = OnceLock::new();
    if !rand_present() {
        return Err(Error::NoLibrary { library: CURAND });
    }
    let make = || {
        // Philox: counter-based, so a seed needs no state set-up kernel.
        let generator =
            result::create_generator_kind(sys::curandRngType_t::CURAND_RNG_PSEUDO_PHILOX4_32_10)
                .map_err(|e| failed("curandCreateGenerator", e.0))?;
        // SAFETY: `generator` was just made; the stream belongs to the
        // current context. A generator is used only for the stream it was
        // made for.
        unsafe { result::set_stream(generator, stream.cu_stream() as _) }
            .map_err(|e| failed("curandSetStream", e.0))?;
        Ok(RandGenerator { generator })
    };
    if crate::graph::is_capturing(stream)? {
        return Err(Error::Capture(
            "a cuRAND fill cannot be captured (cuRAND's host API fails inside a stream \
             capture): fill the buffer before capturing"
                .into(),
        ));
    }
    GENERATORS.get_or_init(PerStream::new).get(stream, make)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fills_are_checked_before_any_call() {
        assert!(Fill::<f32>::uniform(1).check(7).is_ok());
        assert!(Fill::normal(1, 0.0f32, 1.0).check(8).is_ok());
        let odd = Fill::normal(1, 0.0f32, 1.0)
            .check(7)
            .unwrap_err()
            .to_string();
        assert!(odd.contains("7 elements") && odd.contains("pairs"), "{odd}");
        let nan = Fill::normal(1, f64::NAN, 1.0)
            .check(8)
            .unwrap_err()
            .to_string();
        assert!(nan.contains("finite"), "{nan}");
    }
}
