//! cuFFT transforms as ops, against a naive DFT on the CPU: 1-D complex
//! forward and the inverse round trip (batched, not a power of two), real
//! to complex, complex to real, 2-D complex and real to complex, and a
//! transform captured into a graph and replayed on new input.

use cuda_async::fft::{fft, Complex32, Fft};
use cuda_async::prelude::*;
use cuda_async::{AnyBitPattern, DeviceBuffer, PinnedBuffer};

use crate::suite::{dev, Rng};

/// A complex value in f64, for the references.
type C64 = (f64, f64);

fn wide(v: &[Complex32]) -> Vec<C64> {
    v.iter()
        .map(|c| (f64::from(c.re), f64::from(c.im)))
        .collect()
}

fn narrow(v: &[C64]) -> Vec<Complex32> {
    v.iter()
        .map(|(re, im)| Complex32::new(*re as f32, *im as f32))
        .collect()
}

fn real(v: &[f32]) -> Vec<C64> {
    v.iter().map(|x| (f64::from(*x), 0.0)).collect()
}

/// Values in [-1, 1).
fn random(rng: &mut Rng, n: usize) -> Vec<f32> {
    rng.f32s(n).into_iter().map(|v| v / 100.0).collect()
}

fn random_complex(rng: &mut Rng, n: usize) -> Vec<Complex32> {
    random(rng, 2 * n)
        .chunks(2)
        .map(|p| Complex32::new(p[0], p[1]))
        .collect()
}

/// The DFT of `x` (`n` points at `stride` apart from `at`), with the sign
/// of the exponent `sign` (-1 forward, +1 inverse, unscaled), written to
/// `out` at the same places.
fn dft_strided(x: &[C64], out: &mut [C64], at: usize, n: usize, stride: usize, sign: f64) {
    for k in 0..n {
        let mut sum = (0.0, 0.0);
        for j in 0..n {
            let phase = sign * 2.0 * std::f64::consts::PI * ((j * k) % n) as f64 / n as f64;
            let (s, c) = phase.sin_cos();
            let (re, im) = x[at + j * stride];
            sum.0 += re * c - im * s;
            sum.1 += re * s + im * c;
        }
        out[at + k * stride] = sum;
    }
}

/// `batch` 1-D DFTs of `n` points, one after the other.
fn dft(x: &[C64], n: usize, sign: f64) -> Vec<C64> {
    let mut out = vec![(0.0, 0.0); x.len()];
    for b in 0..x.len() / n {
        dft_strided(x, &mut out, b * n, n, 1, sign);
    }
    out
}

/// `batch` 2-D DFTs of `nx` rows of `ny` points: the rows, then the
/// columns.
fn dft_2d(x: &[C64], nx: usize, ny: usize, sign: f64) -> Vec<C64> {
    let rows = dft(x, ny, sign);
    let mut out = vec![(0.0, 0.0); x.len()];
    for b in 0..x.len() / (nx * ny) {
        for col in 0..ny {
            dft_strided(&rows, &mut out, b * nx * ny + col, nx, ny, sign);
        }
    }
    out
}

/// The first `ny / 2 + 1` values of each row of `rows` rows of `ny`.
fn half_rows(x: &[C64], ny: usize) -> Vec<C64> {
    x.chunks(ny)
        .flat_map(|row| row[..ny / 2 + 1].iter().copied())
        .collect()
}

/// Within 1e-3 of the largest magnitude of `want`.
fn close(got: &[C64], want: &[C64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want
        .iter()
        .map(|(re, im)| re.hypot(*im))
        .fold(1.0f64, f64::max);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g.0 - w.0).hypot(g.1 - w.1);
        assert!(
            err <= 1e-3 * scale,
            "{what}: element {i} is {g:?}, the CPU says {w:?} (scale {scale})"
        );
    }
}

fn upload<T: cuda_async::DeviceRepr + Copy + Send + Sync + 'static>(v: &[T]) -> DeviceBuffer<T> {
    h2d(v.to_vec()).sync().expect("h2d")
}

fn download<T: AnyBitPattern>(b: &DeviceBuffer<T>) -> Vec<T> {
    d2h(b).sync().expect("d2h").to_vec().expect("host read")
}

/// A zeroed buffer of `n` elements.
fn zeroed<T: cuda_async::DeviceRepr + cuda_async::cudarc::driver::ValidAsZeroBits + Send>(
    n: usize,
) -> DeviceBuffer<T> {
    zeros::<T>(n).sync().expect("zeros")
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_1d_complex_transform_matches_the_dft_and_the_inverse_round_trips() {
    let mut rng = Rng::new();
    for (n, batch) in [(64usize, 1usize), (100, 3), (7, 2)] {
        let xv = random_complex(&mut rng, n * batch);
        let x = upload(&xv);
        let (_, y) = fft(Fft::forward(n).batched(batch), &x, zeroed(n * batch))
            .sync()
            .expect("forward");
        let want = dft(&wide(&xv), n, -1.0);
        close(
            &wide(&download(&y)),
            &want,
            &format!("forward n={n} x{batch}"),
        );
        // The inverse gives the input times n (cuFFT does not scale); it
        // writes over the input's buffer.
        let (_, back) = fft(Fft::inverse(n).batched(batch), &y, x)
            .sync()
            .expect("inverse");
        let scaled: Vec<C64> = wide(&xv)
            .into_iter()
            .map(|(re, im)| (re * n as f64, im * n as f64))
            .collect();
        close(
            &wide(&download(&back)),
            &scaled,
            &format!("round trip n={n} x{batch}"),
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_real_to_complex_transform_writes_the_first_half_of_the_dft() {
    let mut rng = Rng::new();
    for (n, batch) in [(30usize, 2usize), (31, 1), (256, 4)] {
        let xv = random(&mut rng, n * batch);
        let x = upload(&xv);
        let (_, y) = fft(Fft::r2c(n).batched(batch), &x, zeroed(batch * (n / 2 + 1)))
            .sync()
            .expect("r2c");
        let want = half_rows(&dft(&real(&xv), n, -1.0), n);
        close(&wide(&download(&y)), &want, &format!("r2c n={n} x{batch}"));
        assert_eq!(download(&x), xv, "r2c reads its input only");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_complex_to_real_transform_inverts_the_half_spectrum() {
    let mut rng = Rng::new();
    for (n, batch) in [(30usize, 2usize), (31, 1), (128, 3)] {
        let xv = random(&mut rng, n * batch);
        // The half spectrum of a real signal, from the CPU.
        let spectrum = narrow(&half_rows(&dft(&real(&xv), n, -1.0), n));
        let (_, y) = fft(
            Fft::c2r(n).batched(batch),
            upload(&spectrum),
            zeroed(n * batch),
        )
        .sync()
        .expect("c2r");
        let scaled: Vec<C64> = xv.iter().map(|v| (f64::from(*v) * n as f64, 0.0)).collect();
        close(
            &real(&download(&y)),
            &scaled,
            &format!("c2r n={n} x{batch}"),
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn two_dimensional_transforms_match_the_dft_of_rows_then_columns() {
    let mut rng = Rng::new();
    let (nx, ny, batch) = (6usize, 10usize, 2usize);
    let xv = random_complex(&mut rng, nx * ny * batch);
    let x = upload(&xv);
    let (_, y) = fft(
        Fft::forward((nx, ny)).batched(batch),
        &x,
        zeroed(nx * ny * batch),
    )
    .sync()
    .expect("2-D forward");
    let want = dft_2d(&wide(&xv), nx, ny, -1.0);
    close(&wide(&download(&y)), &want, "2-D forward");
    let (_, back) = fft(Fft::inverse((nx, ny)).batched(batch), &y, x)
        .sync()
        .expect("2-D inverse");
    let k = (nx * ny) as f64;
    let scaled: Vec<C64> = wide(&xv)
        .into_iter()
        .map(|(re, im)| (re * k, im * k))
        .collect();
    close(&wide(&download(&back)), &scaled, "2-D round trip");

    // Real to complex: ny / 2 + 1 values per row of the 2-D DFT.
    let (nx, ny) = (4usize, 9usize);
    let rv = random(&mut rng, nx * ny);
    let (_, h) = fft(Fft::r2c((nx, ny)), upload(&rv), zeroed(nx * (ny / 2 + 1)))
        .sync()
        .expect("2-D r2c");
    let want = half_rows(&dft_2d(&real(&rv), nx, ny, -1.0), ny);
    close(&wide(&download(&h)), &want, "2-D r2c");
    // And back to the signal, times nx * ny.
    let (_, r) = fft(Fft::c2r((nx, ny)), h, zeroed(nx * ny))
        .sync()
        .expect("2-D c2r");
    let k = (nx * ny) as f64;
    let scaled: Vec<C64> = rv.iter().map(|v| (f64::from(*v) * k, 0.0)).collect();
    close(&real(&download(&r)), &scaled, "2-D c2r");
}

/// A transform inside `op.graph()`: the plan is made during the capture
/// and the execution is captured; each replay transforms what the host
/// last wrote into the shared pinned input.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_captured_transform_replays_on_new_input() {
    let mut rng = Rng::new();
    let n = 96usize;
    let input = PinnedBuffer::filled(&dev(), n, Complex32::default())
        .unwrap()
        .into_shared();
    let inp = input.clone();
    let graph = zeros::<Complex32>(n)
        .zip(zeros::<Complex32>(n))
        .then(move |(x, y)| copy_h2d(inp, x).map(move |(_, x)| (x, y)))
        .then(|(x, y)| fft(Fft::forward(n), x, y))
        .graph()
        .expect("a cuFFT transform captures");
    for replay in 0..3 {
        let xv = random_complex(&mut rng, n);
        input.write(|v| v.copy_from_slice(&xv)).unwrap();
        graph.launch().sync().expect("replay");
        let want = dft(&wide(&xv), n, -1.0);
        close(
            &wide(&download(&graph.output().1)),
            &want,
            &format!("replay {replay}"),
        );
    }
}
