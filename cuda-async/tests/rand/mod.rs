//! cuRAND fills as ops: the distributions' moments, the same seed giving
//! the same values on two streams (`zip` arms) and after other fills, a
//! fill that writes only its view, and a fill inside a capture refused by
//! name.

use cuda_async::prelude::*;
use cuda_async::rand::{fill, normal, uniform, Fill};
use cuda_async::{AnyBitPattern, DeviceBuffer};

fn download<T: AnyBitPattern>(b: &DeviceBuffer<T>) -> Vec<T> {
    d2h(b).sync().expect("d2h").to_vec().expect("host read")
}

/// Mean and standard deviation.
fn moments(v: impl Iterator<Item = f64> + Clone) -> (f64, f64) {
    let n = v.clone().count() as f64;
    let mean = v.clone().sum::<f64>() / n;
    let var = v.map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
    (mean, var.sqrt())
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn uniform_and_normal_fills_have_their_distributions_moments() {
    let n = 1 << 20;
    let u = download(
        &zeros::<f32>(n)
            .then(|x| uniform(11, x))
            .sync()
            .expect("uniform f32"),
    );
    assert!(u.iter().all(|v| *v > 0.0 && *v <= 1.0), "uniform on (0, 1]");
    let (m, s) = moments(u.iter().map(|v| f64::from(*v)));
    assert!((m - 0.5).abs() < 0.005, "uniform mean {m}");
    assert!(
        (s - (1.0f64 / 12.0).sqrt()).abs() < 0.005,
        "uniform deviation {s}"
    );
    let g = download(
        &zeros::<f64>(n)
            .then(|x| normal(12, 3.0, 2.0, x))
            .sync()
            .expect("normal f64"),
    );
    let (m, s) = moments(g.iter().copied());
    assert!((m - 3.0).abs() < 0.01, "normal mean {m}");
    assert!((s - 2.0).abs() < 0.01, "normal deviation {s}");
    let g = download(
        &zeros::<f32>(n)
            .then(|x| fill(Fill::normal(13, -1.0, 0.5), x))
            .sync()
            .expect("normal f32"),
    );
    let (m, s) = moments(g.iter().map(|v| f64::from(*v)));
    assert!(
        (m + 1.0).abs() < 0.01 && (s - 0.5).abs() < 0.01,
        "normal f32: {m}, {s}"
    );
    let u = download(
        &zeros::<f64>(n)
            .then(|x| uniform(14, x))
            .sync()
            .expect("uniform f64"),
    );
    assert!(
        u.iter().all(|v| *v > 0.0 && *v <= 1.0),
        "uniform f64 on (0, 1]"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn the_same_seed_gives_the_same_values_on_two_streams_and_after_other_fills() {
    let n = 1 << 16;
    let (a, b) = zeros::<f32>(n)
        .then(|x| uniform(5, x))
        .zip(zeros::<f32>(n).then(|x| uniform(5, x)))
        .sync()
        .expect("two arms");
    let first = download(&a);
    assert_eq!(first, download(&b), "the same seed on two streams");
    let c = zeros::<f32>(n).then(|x| uniform(6, x)).sync().unwrap();
    assert_ne!(first, download(&c), "another seed");
    let d = zeros::<f32>(n).then(|x| uniform(5, x)).sync().unwrap();
    assert_eq!(first, download(&d), "the seed again, after another fill");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_fill_writes_only_its_view() {
    let mut buf = h2d(vec![9.0f32; 64]).sync().unwrap();
    let view = buf.slice_mut(16..48).unwrap();
    normal(3, 0.0, 1.0, view).sync().expect("fill a view");
    let got = download(&buf);
    assert!(
        got[..16].iter().chain(&got[48..]).all(|v| *v == 9.0),
        "outside the view: {got:?}"
    );
    assert!(
        got[16..48].iter().all(|v| v.is_finite() && *v != 9.0),
        "inside the view: {got:?}"
    );
}

/// cuRAND's host API fails inside a stream capture: a fill in a captured op
/// is refused with an error that names it, and a graph that reads a buffer
/// filled before the capture replays.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_fill_inside_a_capture_is_refused_by_name() {
    let n = 4096;
    let e = zeros::<f32>(n)
        .then(|x| uniform(31, x))
        .graph()
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(&e, cuda_async::Error::Capture(m) if m.contains("cuRAND fill")),
        "{e}"
    );
    // Filled before, then captured: the graph reads the fill's values.
    let x = zeros::<f32>(n).then(|x| uniform(31, x)).sync().unwrap();
    let want = download(&x);
    let graph = value(x).then(d2d).graph().expect("a copy captures");
    graph.launch().sync().expect("replay");
    assert_eq!(download(graph.output()), want);
}
