//! A matrix product the node runs with its own cuBLAS ([`Op::Gemm`]): the
//! tenant ships no kernel, and the node checks the shapes against the
//! buffers' sizes as it checks every command's ranges.
//!
//! [`Op::Gemm`]: crate::Op::Gemm

use serde::{Deserialize, Serialize};

use crate::Id;

/// The element type of a [`GemmSpec`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Dtype {
    /// `f32`.
    F32,
    /// `f64`.
    F64,
}

impl Dtype {
    /// Bytes of one element.
    pub fn size(self) -> u64 {
        match self {
            Dtype::F32 => 4,
            Dtype::F64 => 8,
        }
    }
}

/// A matrix of a [`GemmSpec`]: a buffer of the lease and the byte offset
/// of its first element.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Operand {
    /// The buffer.
    pub buf: Id,
    /// Byte offset of the first element.
    pub offset: u64,
}

/// `C = alpha * op(A) * op(B) + beta * C`, column-major as cuBLAS takes
/// it, with `op(A)` of `m` x `k`, `op(B)` of `k` x `n` and `C` of `m` x
/// `n`; or `batch` such products, each matrix `stride` elements after the
/// last.
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
    /// `alpha` and `beta` as `f64` bits (`f64::to_bits`; an `f32` call
    /// takes them as `f32`).
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

    /// The operands `A`, `B`, `C` with the (rows, columns) each is stored
    /// as.
    pub fn operands(&self) -> [(&'static str, Operand, (u64, u64)); 3] {
        let stored = |t: bool, r: u64, c: u64| if t { (c, r) } else { (r, c) };
        [
            ("A", self.a, stored(self.transpose[0], self.m, self.k)),
            ("B", self.b, stored(self.transpose[1], self.k, self.n)),
            ("C", self.c, (self.m, self.n)),
        ]
    }

    /// The elements each of `A`, `B` and `C` spans from its first, checked:
    /// every leading dimension covers its matrix's rows, `C`'s matrices of
    /// a batch do not overlap, and every value fits cuBLAS's `int`.
    ///
    /// # Errors
    ///
    /// What does not fit, naming the matrix.
    pub fn extents(&self) -> Result<[u64; 3], String> {
        if self.batch == 0 {
            return Err("gemm: a batch of 0 products".into());
        }
        let int = i32::MAX as u64;
        for (name, v) in [
            ("m", self.m),
            ("n", self.n),
            ("k", self.k),
            ("batch", self.batch),
        ]
        .into_iter()
        .chain(["lda", "ldb", "ldc"].into_iter().zip(self.ld))
        {
            if v > int {
                return Err(format!(
                    "gemm: {name} ({v}) is beyond what cuBLAS takes (i32)"
                ));
            }
        }
        let mut out = [0; 3];
        for (i, (name, _, (rows, cols))) in self.operands().into_iter().enumerate() {
            let (ld, stride) = (self.ld[i], self.strides[i]);
            if ld < rows.max(1) {
                return Err(format!(
                    "gemm: the leading dimension of {name} is {ld}, below its {rows} rows"
                ));
            }
            let one = if rows == 0 || cols == 0 {
                0
            } else {
                ld * (cols - 1) + rows
            };
            out[i] = if self.batch > 1 && one > 0 {
                if i == 2 && stride < one {
                    return Err(format!(
                        "gemm: the stride of C ({stride}) makes its {} matrices overlap (each \
                         spans {one})",
                        self.batch
                    ));
                }
                stride
                    .checked_mul(self.batch - 1)
                    .and_then(|s| s.checked_add(one))
                    .ok_or_else(|| format!("gemm: {name} spans more than 2^64 elements"))?
            } else {
                one
            };
        }
        Ok(out)
    }
}
