//! A matrix product by the node's own cuBLAS ([`Op::Gemm`]; no kernel
//! shipped). The node checks shapes against buffer sizes by `cuda-core`'s rules.
//!
//! [`Op::Gemm`]: crate::Op::Gemm

use serde::{Deserialize, Serialize};

use crate::Id;

/// The element type of a [`GemmSpec`] or a random fill
/// ([`RandSpec`](crate::RandSpec): `f32` and `f64` only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Dtype {
    /// `f32`.
    F32,
    /// `f64`.
    F64,
    /// `bf16` (a product accumulates in `f32`, as `cuda-core`'s does).
    Bf16,
    /// `f16` (a product accumulates in `f32`).
    F16,
}

impl Dtype {
    /// Bytes of one element.
    pub fn size(self) -> u64 {
        match self {
            Dtype::F32 => 4,
            Dtype::F64 => 8,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }

    /// The type's name (`"bf16"`).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F64 => "f64",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        }
    }
}

/// A buffer of the lease and a byte offset (a [`GemmSpec`] matrix, a copy's end).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Operand {
    /// The buffer.
    pub buf: Id,
    /// Byte offset (of the first element).
    pub offset: u64,
}

impl Operand {
    /// `offset` bytes into `buf`.
    pub fn new(buf: Id, offset: u64) -> Self {
        Operand { buf, offset }
    }
}

/// `C = alpha * op(A) * op(B) + beta * C`, column-major as cuBLAS takes it;
/// or `batch` such products, each matrix `strides` elements after the last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GemmSpec {
    /// The element type.
    pub dtype: Dtype,
    /// `A`.
    pub a: Operand,
    /// `B`.
    pub b: Operand,
    /// `C` (written; read too unless `beta` is zero).
    pub c: Operand,
    /// Rows of `op(A)` and `C`.
    pub m: u64,
    /// Columns of `op(B)` and `C`.
    pub n: u64,
    /// Columns of `op(A)`, rows of `op(B)`.
    pub k: u64,
    /// Leading dimensions of `A`, `B` and `C`.
    pub ld: [u64; 3],
    /// Whether `A` and `B` are used transposed.
    pub transpose: [bool; 2],
    /// `alpha` and `beta` as `f64::to_bits`, converted to the element type
    /// (exact for values of that type).
    pub scalars: [u64; 2],
    /// Products in the call (1: one).
    pub batch: u64,
    /// Elements between the matrices of a batch: `A`, `B`, `C`.
    pub strides: [u64; 3],
}

impl GemmSpec {
    /// `alpha`.
    pub fn alpha(&self) -> f64 {
        f64::from_bits(self.scalars[0])
    }

    /// `beta`.
    pub fn beta(&self) -> f64 {
        f64::from_bits(self.scalars[1])
    }

    /// The operands `A`, `B`, `C` by name.
    pub fn operands(&self) -> [(&'static str, Operand); 3] {
        [("A", self.a), ("B", self.b), ("C", self.c)]
    }
}
