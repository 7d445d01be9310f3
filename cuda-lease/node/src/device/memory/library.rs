//! The test double's library calls, on the host: a matrix product
//! ([`GemmSpec`], computed in `f64`, rounded once to the spec's element
//! type) and random fills ([`RandSpec`], from a host generator: the same
//! seed gives the same values here, not cuRAND's).

use cuda_core::half::{bf16, f16};

use crate::proto::{Dtype, GemmSpec, RandDist, RandSpec};

/// Element `i` of `bytes` as `f64`.
fn load(d: Dtype, bytes: &[u8], i: u64) -> f64 {
    let at = (i * d.size()) as usize;
    let two = || [bytes[at], bytes[at + 1]];
    match d {
        Dtype::F32 => f64::from(f32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())),
        Dtype::F64 => f64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()),
        Dtype::Bf16 => bf16::from_le_bytes(two()).to_f64(),
        Dtype::F16 => f16::from_le_bytes(two()).to_f64(),
    }
}

fn store(d: Dtype, bytes: &mut [u8], i: u64, v: f64) {
    let at = (i * d.size()) as usize;
    match d {
        Dtype::F32 => bytes[at..at + 4].copy_from_slice(&(v as f32).to_le_bytes()),
        Dtype::F64 => bytes[at..at + 8].copy_from_slice(&v.to_le_bytes()),
        Dtype::Bf16 => bytes[at..at + 2].copy_from_slice(&bf16::from_f64(v).to_le_bytes()),
        Dtype::F16 => bytes[at..at + 2].copy_from_slice(&f16::from_f64(v).to_le_bytes()),
    }
}

/// `C = alpha * op(A) * op(B) + beta * C` for every product of `g`; `a`,
/// `b` and `c` start at their operands' first elements and span what
/// [`gemm_spans`](crate::device::gemm_spans) says (checked by the caller).
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

/// The next number of a SplitMix64 sequence at `state`.
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A value uniform on `(0, 1]`.
fn unit(state: &mut u64) -> f64 {
    ((next(state) >> 11) + 1) as f64 / (1u64 << 53) as f64
}

/// Writes the `r.len` values of `r` into `out` (which starts at its first
/// element): uniform, or normal in pairs (Box-Muller), from a generator
/// started at the seed.
pub(super) fn host_fill(r: &RandSpec, out: &mut [u8]) {
    let mut state = r.seed;
    let mut i = 0;
    while i < r.len {
        match r.dist {
            RandDist::Uniform => {
                store(r.dtype, out, i, unit(&mut state));
                i += 1;
            }
            RandDist::Normal { mean, std_dev } => {
                let (mean, std_dev) = (f64::from_bits(mean), f64::from_bits(std_dev));
                let (u, v) = (unit(&mut state), unit(&mut state));
                let radius = (-2.0 * u.ln()).sqrt() * std_dev;
                let angle = std::f64::consts::TAU * v;
                store(r.dtype, out, i, mean + radius * angle.cos());
                if i + 1 < r.len {
                    store(r.dtype, out, i + 1, mean + radius * angle.sin());
                }
                i += 2;
            }
        }
    }
}
