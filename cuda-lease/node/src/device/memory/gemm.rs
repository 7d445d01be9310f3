//! The test double's matrix product: [`GemmSpec`] computed on the host, in
//! `f64`, stored as the spec's element type.

use crate::proto::{Dtype, GemmSpec};

/// Element `i` of `bytes` as `f64`.
fn load(d: Dtype, bytes: &[u8], i: u64) -> f64 {
    let at = (i * d.size()) as usize;
    match d {
        Dtype::F32 => f64::from(f32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())),
        Dtype::F64 => f64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()),
    }
}

fn store(d: Dtype, bytes: &mut [u8], i: u64, v: f64) {
    let at = (i * d.size()) as usize;
    match d {
        Dtype::F32 => bytes[at..at + 4].copy_from_slice(&(v as f32).to_le_bytes()),
        Dtype::F64 => bytes[at..at + 8].copy_from_slice(&v.to_le_bytes()),
    }
}

/// `C = alpha * op(A) * op(B) + beta * C` for every product of `g`; `a`,
/// `b` and `c` start at their operands' first elements and span what
/// [`GemmSpec::extents`] says (checked by the caller).
pub(super) fn host_gemm(g: &GemmSpec, a: &[u8], b: &[u8], c: &mut [u8]) {
    let d = g.dtype;
    let [lda, ldb, ldc] = g.ld;
    let [sa, sb, sc] = g.strides;
    let (alpha, beta) = (g.alpha(), g.beta());
    for p in 0..g.batch {
        let (oa, ob, oc) = (p * sa, p * sb, p * sc);
        for j in 0..g.n {
            for i in 0..g.m {
                let mut sum = 0.0;
                for l in 0..g.k {
                    let av = if g.transpose[0] {
                        load(d, a, oa + l + i * lda)
                    } else {
                        load(d, a, oa + i + l * lda)
                    };
                    let bv = if g.transpose[1] {
                        load(d, b, ob + j + l * ldb)
                    } else {
                        load(d, b, ob + l + j * ldb)
                    };
                    sum += av * bv;
                }
                let at = oc + i + j * ldc;
                // As cuBLAS: with beta zero, C is not read.
                let old = if beta == 0.0 {
                    0.0
                } else {
                    beta * load(d, c, at)
                };
                store(d, c, at, alpha * sum + old);
            }
        }
    }
}
