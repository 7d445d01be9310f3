//! `blas`: cuBLAS products as ops against cudarc's own `CudaBlas` calls on
//! a stream: one large product in f32 and in bf16, a chain of small ones,
//! and that chain replayed from a graph.

use std::cell::RefCell;
use std::sync::Arc;

use cuda_async::blas::{gemm, BlasScalar, Gemm};
use cuda_async::cudarc::cublas::{self, CudaBlas};
use cuda_async::cudarc::driver::CudaSlice;
use cuda_async::half::bf16;
use cuda_async::prelude::*;
use cuda_async::{DeviceBuffer, ValidAsZeroBits};

use crate::fixture::Fixture;
use crate::measure::{interleaved, Config};
use crate::report::{Goal, Row, Unit};
use crate::stats::Summary;
use crate::Result;

/// The large product's size (`n` x `n` times `n` x `n`).
pub const LARGE: usize = 4096;
/// The small products' size.
pub const SMALL: usize = 64;
/// Small products in a chain.
pub const CHAIN: usize = 1000;

/// cudarc's configuration of the same product as `g`.
fn raw_cfg<T: BlasScalar>(g: &Gemm<T>) -> cublas::GemmConfig<T> {
    cublas::GemmConfig {
        transa: cublas::sys::cublasOperation_t::CUBLAS_OP_N,
        transb: cublas::sys::cublasOperation_t::CUBLAS_OP_N,
        m: g.m as i32,
        n: g.n as i32,
        k: g.k as i32,
        alpha: g.alpha,
        lda: g.lda as i32,
        ldb: g.ldb as i32,
        beta: g.beta,
        ldc: g.ldc as i32,
    }
}

/// An element type both sides multiply: an op's ([`BlasScalar`]) that
/// cudarc's `CudaBlas` multiplies too (`CudaBlas: cublas::Gemm<T>`).
trait Element: BlasScalar + ValidAsZeroBits {
    /// `v` in this type.
    fn of(v: f32) -> Self;
}

impl Element for f32 {
    fn of(v: f32) -> Self {
        v
    }
}

impl Element for bf16 {
    fn of(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

/// Square operands of `n` x `n` for both sides: cudarc slices for the raw
/// path, buffers for the ops.
struct Operands<T> {
    raw: (CudaSlice<T>, CudaSlice<T>, RefCell<CudaSlice<T>>),
    a: Arc<DeviceBuffer<T>>,
    b: Arc<DeviceBuffer<T>>,
    c: RefCell<DeviceBuffer<T>>,
}

impl<T: Element> Operands<T>
where
    CudaBlas: cublas::Gemm<T>,
{
    fn new(fx: &Fixture, n: usize) -> Result<Self> {
        let s = &fx.stream;
        // Quarters up to 1.5: exact in every element type.
        let x: Vec<T> = (0..n * n).map(|i| T::of((i % 7) as f32 * 0.25)).collect();
        let raw = (
            s.clone_htod(&x)?,
            s.clone_htod(&x)?,
            RefCell::new(s.alloc_zeros::<T>(n * n)?),
        );
        let up = |v: &[T]| h2d(v.to_vec()).sync_on(s);
        Ok(Operands {
            raw,
            a: Arc::new(up(&x)?),
            b: Arc::new(up(&x)?),
            c: RefCell::new(zeros::<T>(n * n).sync_on(s)?),
        })
    }

    /// `count` raw products on the fixture's stream, then one synchronize.
    fn raw(&self, fx: &Fixture, blas: &CudaBlas, g: &Gemm<T>, count: usize) -> Result<()> {
        let (a, b, c) = (&self.raw.0, &self.raw.1, &mut *self.raw.2.borrow_mut());
        for _ in 0..count {
            // SAFETY: the slices hold n x n elements each, as `g` reads and
            // writes.
            unsafe { cublas::Gemm::gemm(blas, raw_cfg(g), a, b, c) }?;
        }
        fx.stream.synchronize()?;
        Ok(())
    }

    /// `count` products as ops chained with `then`, then `sync_on`.
    fn ops(&self, fx: &Fixture, g: Gemm<T>, count: usize) -> Result<()> {
        let mut c = self.c.borrow_mut();
        chain(&self.a, &self.b, &mut c, g, count).sync_on(&fx.stream)?;
        Ok(())
    }
}

/// `count` products `c = a * b` as one op.
fn chain<'a, T: BlasScalar>(
    a: &'a Arc<DeviceBuffer<T>>,
    b: &'a Arc<DeviceBuffer<T>>,
    c: &'a mut DeviceBuffer<T>,
    g: Gemm<T>,
    count: usize,
) -> BoxedOp<'a, ()> {
    let mut op = value((&**a, &**b, c)).boxed();
    for _ in 0..count {
        op = op.then(move |(a, b, c)| gemm(g, a, b, c)).boxed();
    }
    op.map(|_| ()).boxed()
}

fn per(v: &[f64], k: usize) -> Option<Summary> {
    Summary::of(v).map(|s| s.scaled(1.0 / k as f64))
}

/// One `LARGE`^3 product of `T`, raw and as an op, interleaved: the
/// TFLOP/s of each (raw first).
fn large<T: Element>(fx: &Fixture, cfg: &Config, blas: &CudaBlas) -> Result<[Option<Summary>; 2]>
where
    CudaBlas: cublas::Gemm<T>,
{
    let ops = Operands::<T>::new(fx, LARGE)?;
    let g = Gemm::<T>::new(LARGE, LARGE, LARGE);
    let t = interleaved(
        cfg.reps(3, 1),
        cfg.reps(20, 3),
        &mut [&mut || ops.raw(fx, blas, &g, 1), &mut || ops.ops(fx, g, 1)],
    )?;
    let tflops = |v: &Vec<f64>| {
        Summary::of(
            &v.iter()
                .map(|us| g.flops() / (us * 1e-6) / 1e12)
                .collect::<Vec<_>>(),
        )
    };
    Ok([tflops(&t[0]), tflops(&t[1])])
}

/// The `blas` topic's rows.
///
/// # Errors
/// The first error of any path (cuBLAS missing included).
pub fn blas(fx: &Fixture, cfg: &Config) -> Result<Vec<Row>> {
    let g = "blas";
    let blas = CudaBlas::new(fx.stream.clone())?;
    // One large product in f32, then in bf16 (each freed before the next).
    let [f32_raw, f32_lib] = large::<f32>(fx, cfg, &blas)?;
    let [bf16_raw, bf16_lib] = large::<bf16>(fx, cfg, &blas)?;
    // A chain of small products, eager and replayed.
    let small = Operands::<f32>::new(fx, SMALL)?;
    let gs = Gemm::<f32>::new(SMALL, SMALL, SMALL);
    let graph = {
        let (a, b) = (small.a.clone(), small.b.clone());
        let c = zeros::<f32>(SMALL * SMALL).sync_on(&fx.stream)?;
        let mut op = value((a, b, c)).boxed();
        for _ in 0..CHAIN {
            op = op.then(move |(a, b, c)| gemm(gs, a, b, c)).boxed();
        }
        op.graph()?
    };
    let c = interleaved(
        cfg.reps(3, 1),
        cfg.reps(30, 5),
        &mut [
            &mut || small.raw(fx, &blas, &gs, CHAIN),
            &mut || small.ops(fx, gs, CHAIN),
            &mut || Ok(graph.launch().sync_on(&fx.stream)?),
        ],
    )?;
    Ok(vec![
        Row::new(
            g,
            "GEMM 4096^3 f32, TFLOP/s: `blas::gemm` op vs cudarc's `CudaBlas::gemm` on a stream",
            Unit::TflopsPerSec,
        )
        .raw(f32_raw)
        .lib(f32_lib)
        .goal(Goal::AtLeast(0.98)),
        Row::new(
            g,
            "GEMM 4096^3 bf16 (f32 compute), TFLOP/s: `blas::gemm` op vs cudarc's `CudaBlas::gemm` on a stream",
            Unit::TflopsPerSec,
        )
        .raw(bf16_raw)
        .lib(bf16_lib)
        .goal(Goal::AtLeast(0.98)),
        Row::new(
            g,
            "1,000 GEMMs 64^3 chained + sync, per call: ops (`then` + `boxed`) vs raw calls + one sync",
            Unit::Micros,
        )
        .raw(per(&c[0], CHAIN))
        .lib(per(&c[1], CHAIN))
        .goal(Goal::AtMost(1.05)),
        Row::new(
            g,
            "1,000 GEMMs 64^3 + sync, per call: replayed from a graph vs eager ops",
            Unit::Micros,
        )
        .raw(per(&c[1], CHAIN))
        .lib(per(&c[2], CHAIN))
        .goal(Goal::AtMost(0.5)),
    ])
}
