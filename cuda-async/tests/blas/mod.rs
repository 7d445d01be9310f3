//! cuBLAS products as ops and the foreign-call op, against CPU references:
//! every transpose with alpha and beta, f32, f64, bf16 and f16, views,
//! strided batches, products in `zip` arms on two streams, a captured graph of
//! products, and a foreign call's write seen by an op on another stream.

use std::sync::Arc;

use cuda_async::blas::{gemm, gemv, BlasScalar, Gemm, Gemv};
use cuda_async::cudarc::driver::result;
use cuda_async::foreign::{on_stream, reads, writes};
use cuda_async::prelude::*;
use cuda_async::{AnyBitPattern, DeviceBuffer, Error};

use crate::suite::{cfg, dev, Rng};

/// `C = alpha * op(A) * op(B) + beta * C`, column-major, on the CPU (in
/// f64, whatever `T`).
fn reference<T: BlasScalar + Into<f64>>(g: &Gemm<T>, a: &[T], b: &[T], c: &[T]) -> Vec<f64> {
    let mut out: Vec<f64> = c.iter().map(|v| (*v).into()).collect();
    for batch in 0..g.batch {
        let (oa, ob, oc) = (batch * g.stride_a, batch * g.stride_b, batch * g.stride_c);
        for j in 0..g.n {
            for i in 0..g.m {
                let mut sum = 0.0f64;
                for l in 0..g.k {
                    let av = if g.transpose_a {
                        a[oa + l + i * g.lda]
                    } else {
                        a[oa + i + l * g.lda]
                    };
                    let bv = if g.transpose_b {
                        b[ob + j + l * g.ldb]
                    } else {
                        b[ob + l + j * g.ldb]
                    };
                    sum += av.into() * bv.into();
                }
                let at = oc + i + j * g.ldc;
                out[at] = g.alpha.into() * sum + g.beta.into() * out[at];
            }
        }
    }
    out
}

fn wide(v: &[f32]) -> Vec<f64> {
    v.iter().map(|x| f64::from(*x)).collect()
}

fn close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-3 * (1.0 + w.abs()),
            "{what}: element {i} is {g}, the CPU says {w}"
        );
    }
}

fn upload<T: cuda_async::DeviceRepr + Copy + Send + Sync + 'static>(v: &[T]) -> DeviceBuffer<T> {
    h2d(v.to_vec()).sync().expect("h2d")
}

fn download<T: AnyBitPattern>(b: &DeviceBuffer<T>) -> Vec<T> {
    d2h(b).sync().expect("d2h").to_vec().expect("host read")
}

fn random<T: From<f32>>(rng: &mut Rng, n: usize) -> Vec<T> {
    rng.f32s(n)
        .into_iter()
        .map(|v| T::from(v / 100.0))
        .collect()
}

fn every_transpose<T>(rng: &mut Rng)
where
    T: BlasScalar + Into<f64> + From<f32> + AnyBitPattern,
{
    let (m, n, k) = (37, 29, 41);
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        let mut g = Gemm::<T>::new(m, n, k)
            .alpha(T::from(1.5))
            .beta(T::from(-0.5));
        if ta {
            g = g.transpose_a();
        }
        if tb {
            g = g.transpose_b();
        }
        let (av, bv, cv) = (
            random::<T>(rng, m * k),
            random::<T>(rng, k * n),
            random::<T>(rng, m * n),
        );
        let (a, b, c) = (upload(&av), upload(&bv), upload(&cv));
        let (_, _, c) = gemm(g, &a, &b, c).sync().expect("gemm");
        let got: Vec<f64> = download(&c).into_iter().map(Into::into).collect();
        close(
            &got,
            &reference(&g, &av, &bv, &cv),
            &format!("transposes {ta}/{tb}"),
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gemm_f32_and_f64_match_the_cpu_for_every_transpose() {
    let mut rng = Rng::new();
    every_transpose::<f32>(&mut rng);
    every_transpose::<f64>(&mut rng);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gemm_writes_a_view_and_runs_strided_batches() {
    let mut rng = Rng::new();
    // C is the middle 4x4 of a 32-element buffer; the rest stays.
    let g = Gemm::<f32>::new(4, 4, 8);
    let (av, bv) = (random::<f32>(&mut rng, 32), random::<f32>(&mut rng, 32));
    let (a, b) = (upload(&av), upload(&bv));
    let mut c = upload(&[9.0f32; 32]);
    let view = c.slice_mut(8..24).unwrap();
    gemm(g, &a, &b, view).sync().expect("gemm into a view");
    let got = download(&c);
    assert!(
        got[..8].iter().chain(&got[24..]).all(|v| *v == 9.0),
        "outside the view"
    );
    let want = reference(&g, &av, &bv, &[0.0f32; 16]);
    close(&wide(&got[8..24]), &want, "view");
    // 5 products of 6x3 by 3x7, one call.
    let g = Gemm::<f64>::new(6, 7, 3).batched(5);
    let (av, bv) = (
        random::<f64>(&mut rng, 5 * 18),
        random::<f64>(&mut rng, 5 * 21),
    );
    let (_, _, c) = gemm(
        g,
        upload(&av),
        upload(&bv),
        zeros::<f64>(5 * 42).sync().unwrap(),
    )
    .sync()
    .expect("batched gemm");
    close(
        &download(&c),
        &reference(&g, &av, &bv, &[0.0; 5 * 42]),
        "batched",
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gemms_in_zip_arms_run_on_two_streams_and_both_match() {
    let mut rng = Rng::new();
    let g = Gemm::<f32>::new(64, 64, 64);
    let (av, bv) = (random::<f32>(&mut rng, 4096), random::<f32>(&mut rng, 4096));
    let (a, b) = (Arc::new(upload(&av)), Arc::new(upload(&bv)));
    let arm = |x: &Arc<DeviceBuffer<f32>>, y: &Arc<DeviceBuffer<f32>>| {
        let (x, y) = (x.clone(), y.clone());
        zeros::<f32>(4096)
            .then(move |c| gemm(g, x, y, c))
            .map(|(_, _, c)| c)
    };
    let (ab, ba) = arm(&a, &b).zip(arm(&b, &a)).sync().expect("zip of gemms");
    let z = [0.0f32; 4096];
    close(&wide(&download(&ab)), &reference(&g, &av, &bv, &z), "A*B");
    close(&wide(&download(&ba)), &reference(&g, &bv, &av, &z), "B*A");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_captured_graph_of_gemms_replays() {
    let mut rng = Rng::new();
    let g = Gemm::<f32>::new(16, 16, 16).beta(1.0);
    let (av, bv) = (random::<f32>(&mut rng, 256), random::<f32>(&mut rng, 256));
    let (a, b) = (Arc::new(upload(&av)), Arc::new(upload(&bv)));
    // C += A * B, twice a replay: C is made before the capture, so the
    // replays add up.
    let c = zeros::<f32>(256).sync().unwrap();
    let graph = value(c)
        .then(move |c| gemm(g, a.clone(), b.clone(), c).then(move |(a, b, c)| gemm(g, a, b, c)))
        .map(|(_, _, c)| c)
        .graph()
        .expect("gemm captures");
    for _ in 0..3 {
        graph.launch().sync().expect("replay");
    }
    let mut want = vec![0.0f32; 256];
    for _ in 0..6 {
        want = reference(&g, &av, &bv, &want)
            .into_iter()
            .map(|v| v as f32)
            .collect();
    }
    close(
        &wide(&download(graph.output())),
        &wide(&want),
        "six products from three replays",
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_foreign_write_is_seen_by_an_op_on_another_stream() {
    let ks = crate::kernels();
    let d = dev();
    let (sa, sb) = (d.new_stream().unwrap(), d.new_stream().unwrap());
    let n = 1 << 20;
    for round in 0..3 {
        let src = upload(&vec![round as u8 + 1; n]);
        let dst = zeros::<u8>(n).sync().unwrap();
        let stamps = zeros::<u64>(2).sync().unwrap();
        let spin = ks.spin.clone();
        // On stream a: 20 ms of spinning, then the "library" copies.
        // SAFETY: spin writes stamps[0..2).
        let op = unsafe { launch(&spin, cfg(1), (20_000_000u64, stamps)) }.then(move |_| {
            on_stream("copy", (reads(src), writes(dst)), |stream, (s, d)| {
                // SAFETY: both addresses hold `n` bytes, ordered on `stream`.
                unsafe {
                    result::memcpy_dtod_async(d.addr(), s.addr(), s.len(), stream.cu_stream())
                }
                .map_err(|e| Error::driver("cuMemcpyDtoDAsync", e))
            })
        });
        // SAFETY: the outputs order their own later uses; no host read.
        let ((_src, dst), ()) = unsafe { op.async_on(&sa) }.unwrap();
        // On stream b, with no host wait: after the copy, by dst's events.
        let out = d2h(&dst).sync_on(&sb).unwrap();
        assert!(
            out.as_slice()
                .unwrap()
                .iter()
                .all(|v| *v == round as u8 + 1),
            "round {round}: stream b read before the foreign call wrote"
        );
    }
}

/// A GEMM marks its three buffers with one event: another stream's later
/// uses of each still wait for it (writes of `A` and `B` for its reads, a
/// read of `C` for its write), behind 20 ms of spinning before it.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn each_buffer_of_a_gemm_orders_another_streams_later_use() {
    let ks = crate::kernels();
    let d = dev();
    let (sa, sb) = (d.new_stream().unwrap(), d.new_stream().unwrap());
    let mut rng = Rng::new();
    let g = Gemm::<f32>::new(64, 64, 64);
    for round in 0..3 {
        let (av, bv) = (random::<f32>(&mut rng, 4096), random::<f32>(&mut rng, 4096));
        let (a, b) = (upload(&av), upload(&bv));
        let c = zeros::<f32>(4096).sync().unwrap();
        let stamps = zeros::<u64>(2).sync().unwrap();
        let spin = ks.spin.clone();
        // On stream a: 20 ms of spinning, then the product.
        // SAFETY: spin writes stamps[0..2).
        let op = unsafe { launch(&spin, cfg(1), (20_000_000u64, stamps)) }
            .then(move |_| gemm(g, a, b, c));
        // SAFETY: the outputs order their own later uses; no host read.
        let (a, b, c) = unsafe { op.async_on(&sa) }.unwrap();
        // On stream b, with no host wait: zeroing A and B must wait for
        // the product's reads, and reading C for its write.
        let ((a, b), out) = memset(a, 0)
            .zip(memset(b, 0))
            .zip(d2h(&c))
            .sync_on(&sb)
            .unwrap();
        let z = [0.0f32; 4096];
        close(
            &wide(out.as_slice().unwrap()),
            &reference(&g, &av, &bv, &z),
            &format!("round {round}: C read on stream b"),
        );
        assert!(download(&a).iter().chain(&download(&b)).all(|v| *v == 0.0));
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn seventy_streams_each_get_a_handle_and_multiply_right() {
    let mut rng = Rng::new();
    let g = Gemm::<f32>::new(8, 8, 8);
    let (av, bv) = (random::<f32>(&mut rng, 64), random::<f32>(&mut rng, 64));
    let (a, b) = (Arc::new(upload(&av)), Arc::new(upload(&bv)));
    let want = reference(&g, &av, &bv, &[0.0f32; 64]);
    let d = dev();
    let streams: Vec<_> = (0..70).map(|_| d.new_stream().unwrap()).collect();
    // Every stream gets a handle on its first product and keeps it.
    for round in 0..2 {
        for (i, s) in streams.iter().enumerate() {
            let c = zeros::<f32>(64).sync_on(s).unwrap();
            let (_, _, c) = gemm(g, a.clone(), b.clone(), c).sync_on(s).unwrap();
            let got: Vec<f64> = download(&c).into_iter().map(f64::from).collect();
            close(&got, &want, &format!("round {round}, stream {i}"));
        }
    }
}

/// `y = alpha * op(A) * x + beta * y` on the CPU, in f64.
fn gemv_reference<T: BlasScalar + Into<f64>>(g: &Gemv<T>, a: &[T], x: &[T], y: &[T]) -> Vec<f64> {
    let (_, ny) = g.vector_lens();
    (0..ny)
        .map(|i| {
            let sum: f64 = if g.transpose {
                (0..g.m)
                    .map(|l| a[l + i * g.lda].into() * x[l].into())
                    .sum()
            } else {
                (0..g.n)
                    .map(|l| a[i + l * g.lda].into() * x[l].into())
                    .sum()
            };
            g.alpha.into() * sum + g.beta.into() * y[i].into()
        })
        .collect()
}

fn gemv_both_ways<T>(rng: &mut Rng)
where
    T: BlasScalar + Into<f64> + From<f32> + AnyBitPattern,
{
    let (m, n, lda) = (37, 23, 40);
    for transpose in [false, true] {
        let mut g = Gemv::<T>::new(m, n)
            .lda(lda)
            .alpha(T::from(1.5))
            .beta(T::from(-0.5));
        if transpose {
            g = g.transpose();
        }
        let (nx, ny) = g.vector_lens();
        let (av, xv) = (random::<T>(rng, lda * n), random::<T>(rng, nx));
        // y is the middle of a larger buffer; the rest stays.
        let yv = random::<T>(rng, ny + 8);
        let (a, x) = (upload(&av), upload(&xv));
        let mut y = upload(&yv);
        let view = y.slice_mut(4..4 + ny).unwrap();
        gemv(g, &a, &x, view).sync().expect("gemv");
        let got: Vec<f64> = download(&y).into_iter().map(Into::into).collect();
        let want = gemv_reference(&g, &av, &xv, &yv[4..4 + ny]);
        close(
            &got[4..4 + ny],
            &want,
            &format!("gemv, transposed {transpose}"),
        );
        let around: Vec<f64> = yv[..4]
            .iter()
            .chain(&yv[4 + ny..])
            .map(|v| (*v).into())
            .collect();
        let got_around: Vec<f64> = got[..4].iter().chain(&got[4 + ny..]).copied().collect();
        assert_eq!(got_around, around, "outside the view of y");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gemv_f32_and_f64_match_the_cpu_both_ways_into_a_view() {
    let mut rng = Rng::new();
    gemv_both_ways::<f32>(&mut rng);
    gemv_both_ways::<f64>(&mut rng);
}

/// Half-precision results against the CPU: cuBLAS accumulates in f32 and
/// rounds each output to the half type once (a relative error up to 2^-8
/// for bf16, 2^-11 for f16), so every element is within 1e-2 of the
/// result's largest magnitude.
fn close_half(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(1e-6f64, |m, w| m.max(w.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-2 * scale,
            "{what}: element {i} is {g}, the CPU says {w} (largest {scale})"
        );
    }
}

/// `n` values in [-1, 1] rounded to the half type: the CPU reference
/// multiplies the same rounded values the GPU reads.
fn halves<T>(rng: &mut Rng, n: usize, from: fn(f32) -> T) -> Vec<T> {
    rng.f32s(n).into_iter().map(|v| from(v / 100.0)).collect()
}

fn half_products<T>(rng: &mut Rng, from: fn(f32) -> T)
where
    T: BlasScalar + Into<f64> + AnyBitPattern,
{
    let (m, n, k) = (64, 48, 80);
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        let mut g = Gemm::<T>::new(m, n, k).alpha(from(1.5)).beta(from(-0.5));
        if ta {
            g = g.transpose_a();
        }
        if tb {
            g = g.transpose_b();
        }
        let (av, bv, cv) = (
            halves(rng, m * k, from),
            halves(rng, k * n, from),
            halves(rng, m * n, from),
        );
        let (a, b, c) = (upload(&av), upload(&bv), upload(&cv));
        let (_, _, c) = gemm(g, &a, &b, c).sync().expect("half gemm");
        let got: Vec<f64> = download(&c).into_iter().map(Into::into).collect();
        close_half(
            &got,
            &reference(&g, &av, &bv, &cv),
            &format!("{} transposes {ta}/{tb}", T::NAME),
        );
    }
    // 3 products in one call (`cublasGemmStridedBatchedEx`), C read too.
    let g = Gemm::<T>::new(m, n, k).batched(3).beta(T::ONE);
    let (av, bv, cv) = (
        halves(rng, 3 * m * k, from),
        halves(rng, 3 * k * n, from),
        halves(rng, 3 * m * n, from),
    );
    let (_, _, c) = gemm(g, upload(&av), upload(&bv), upload(&cv))
        .sync()
        .expect("batched half gemm");
    let got: Vec<f64> = download(&c).into_iter().map(Into::into).collect();
    close_half(
        &got,
        &reference(&g, &av, &bv, &cv),
        &format!("{} batch of 3", T::NAME),
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gemm_bf16_and_f16_match_the_cpu_for_every_transpose_and_a_batch() {
    use cuda_async::half::{bf16, f16};
    let mut rng = Rng::new();
    half_products::<bf16>(&mut rng, bf16::from_f32);
    half_products::<f16>(&mut rng, f16::from_f32);
}

fn half_gemv_both_ways<T>(rng: &mut Rng, from: fn(f32) -> T)
where
    T: BlasScalar + Into<f64> + AnyBitPattern,
{
    let (m, n, lda) = (37, 23, 40);
    for transpose in [false, true] {
        let mut g = Gemv::<T>::new(m, n)
            .lda(lda)
            .alpha(from(1.5))
            .beta(from(-0.5));
        if transpose {
            g = g.transpose();
        }
        let (nx, ny) = g.vector_lens();
        let (av, xv) = (halves(rng, lda * n, from), halves(rng, nx, from));
        // y is the middle of a larger buffer; the rest stays.
        let yv = halves(rng, ny + 8, from);
        let (a, x) = (upload(&av), upload(&xv));
        let mut y = upload(&yv);
        let view = y.slice_mut(4..4 + ny).unwrap();
        gemv(g, &a, &x, view).sync().expect("half gemv");
        let got: Vec<f64> = download(&y).into_iter().map(Into::into).collect();
        let want = gemv_reference(&g, &av, &xv, &yv[4..4 + ny]);
        close_half(
            &got[4..4 + ny],
            &want,
            &format!("{} gemv, transposed {transpose}", T::NAME),
        );
        let around: Vec<f64> = yv[..4]
            .iter()
            .chain(&yv[4 + ny..])
            .map(|v| (*v).into())
            .collect();
        let got_around: Vec<f64> = got[..4].iter().chain(&got[4 + ny..]).copied().collect();
        assert_eq!(got_around, around, "outside the view of y");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gemv_bf16_and_f16_match_the_cpu_both_ways_into_a_view() {
    use cuda_async::half::{bf16, f16};
    let mut rng = Rng::new();
    half_gemv_both_ways::<bf16>(&mut rng, bf16::from_f32);
    half_gemv_both_ways::<f16>(&mut rng, f16::from_f32);
}
