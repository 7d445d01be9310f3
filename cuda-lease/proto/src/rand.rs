//! A random fill by the node's own cuRAND ([`Op::RandFill`]; no kernel
//! shipped), checked against its buffer like every command's ranges.
//!
//! [`Op::RandFill`]: crate::Op::RandFill

use serde::{Deserialize, Serialize};

use crate::{Dtype, Operand};

/// What a [`RandSpec`] draws.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RandDist {
    /// Uniform on `(0, 1]`.
    Uniform,
    /// Normal, with its mean and standard deviation as `f64` bits
    /// (`f64::to_bits`; an `f32` fill takes them as `f32`).
    Normal {
        /// The mean.
        mean: u64,
        /// The standard deviation.
        std_dev: u64,
    },
}

/// `len` random elements written at `dst`, from a generator restarted at
/// `seed` (cuRAND's Philox on a GPU): the same seed gives the same values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RandSpec {
    /// The element type.
    pub dtype: Dtype,
    /// Where the first element goes.
    pub dst: Operand,
    /// Elements written (even for a normal fill: they come in pairs).
    pub len: u64,
    /// The generator's seed.
    pub seed: u64,
    /// The distribution.
    pub dist: RandDist,
}

impl RandSpec {
    /// Bytes written, `None` past 2^64.
    pub fn bytes(&self) -> Option<u64> {
        self.len.checked_mul(self.dtype.size())
    }
}
