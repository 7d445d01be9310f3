//! Library calls on a lease, run by the node's libraries: GEMM against a
//! CPU product, and random fills.

use super::*;

/// `C = alpha * op(A) * op(B) + beta * C` for every product of `g`,
/// column-major, on the CPU (in f64).
fn cpu_gemm<T: Copy + Into<f64>>(g: &Gemm<T>, a: &[T], b: &[T], c: &[T]) -> Vec<f64> {
    let mut out: Vec<f64> = c.iter().map(|v| (*v).into()).collect();
    for p in 0..g.batch {
        let (oa, ob, oc) = (p * g.stride_a, p * g.stride_b, p * g.stride_c);
        for j in 0..g.n {
            for i in 0..g.m {
                let sum: f64 = (0..g.k)
                    .map(|l| {
                        let av = a[oa
                            + if g.transpose_a {
                                l + i * g.lda
                            } else {
                                i + l * g.lda
                            }];
                        let bv = b[ob
                            + if g.transpose_b {
                                j + l * g.ldb
                            } else {
                                l + j * g.ldb
                            }];
                        av.into() * bv.into()
                    })
                    .sum();
                let at = oc + i + j * g.ldc;
                out[at] = g.alpha.into() * sum + g.beta.into() * out[at];
            }
        }
    }
    out
}

fn close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
            "{what}: element {i} is {g}, the CPU says {w}"
        );
    }
}

/// A GEMM on a lease is one command the node runs with its own library
/// (here the in-memory device's host product): no kernel is shipped, and
/// every transpose, alpha and beta, a strided batch and a view of C come
/// back as the CPU computes them, one message each.
#[tokio::test]
async fn a_gemm_runs_on_a_lease_by_the_nodes_library() {
    let fx = Fixture::node_path(1 << 22).lease(1 << 20).start().await;
    let (node, remote) = (&fx.node, fx.policy());
    let (m, n, k) = (7, 5, 3);
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        let mut g = Gemm::<f32>::new(m, n, k).alpha(1.5).beta(-0.5);
        if ta {
            g = g.transpose_a();
        }
        if tb {
            g = g.transpose_b();
        }
        let (av, bv, cv) = (
            random_f32(m * k, 1),
            random_f32(k * n, 2),
            random_f32(m * n, 3),
        );
        let before = batches(node);
        let got = h2d(av.clone())
            .zip(h2d(bv.clone()))
            .zip(h2d(cv.clone()))
            .then(move |((a, b), c)| gemm(g, a, b, c))
            .then(|(_, _, c)| d2h(c))
            .schedule(&remote)
            .unwrap()
            .await
            .unwrap();
        let got: Vec<f64> = got.to_vec().unwrap().into_iter().map(f64::from).collect();
        close(
            &got,
            &cpu_gemm(&g, &av, &bv, &cv),
            &format!("transposes {ta}/{tb}"),
        );
        assert_eq!(batches(node).0 - before.0, 1, "one message");
    }
    // Three f64 products of 4x2 by 2x3, C the middle of a larger buffer.
    let g = Gemm::<f64>::new(4, 3, 2).batched(3);
    let av: Vec<f64> = random_f32(3 * 8, 4).into_iter().map(f64::from).collect();
    let bv: Vec<f64> = random_f32(3 * 6, 5).into_iter().map(f64::from).collect();
    let mut c = h2d(vec![9.0f64; 3 * 12 + 8])
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    let view = c.slice_mut(4..4 + 3 * 12).unwrap();
    let (a, b) = (av.clone(), bv.clone());
    h2d(a)
        .zip(h2d(b))
        .then(move |(a, b)| gemm(g, a, b, view))
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    let got = d2h(&c)
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap()
        .to_vec()
        .unwrap();
    assert!(
        got[..4].iter().chain(&got[4 + 36..]).all(|v| *v == 9.0),
        "outside the view"
    );
    close(
        &got[4..40],
        &cpu_gemm(&g, &av, &bv, &[0.0; 36]),
        "a batch into a view",
    );
    // Inside a graph kept on the node: C += A * B at every replay.
    let g = Gemm::<f32>::new(6, 6, 6).beta(1.0);
    let (av, bv) = (random_f32(36, 6), random_f32(36, 7));
    let a = Arc::new(h2d(av.clone()).schedule(&remote).unwrap().await.unwrap());
    let b = Arc::new(h2d(bv.clone()).schedule(&remote).unwrap().await.unwrap());
    let c = zeros::<f32>(36).schedule(&remote).unwrap().await.unwrap();
    let graph = value(c)
        .then(move |c| gemm(g, a.clone(), b.clone(), c))
        .map(|(_, _, c)| c)
        .graph_with_async(&remote)
        .unwrap()
        .await
        .expect("a gemm captures on a lease");
    let mut want = vec![0.0f32; 36];
    for replay in 1..=2 {
        graph.launch().schedule(&remote).unwrap().await.unwrap();
        want = cpu_gemm(&g, &av, &bv, &want)
            .into_iter()
            .map(|v| v as f32)
            .collect();
        let got = d2h(graph.output())
            .schedule(&remote)
            .unwrap()
            .await
            .unwrap();
        let got: Vec<f64> = got.to_vec().unwrap().into_iter().map(f64::from).collect();
        let want: Vec<f64> = want.iter().map(|v| f64::from(*v)).collect();
        close(&got, &want, &format!("replay {replay}"));
    }
    drop(graph);
    fx.shutdown().await;
}

/// A bf16 and an f16 GEMM on a lease are one command each, multiplied by
/// the node's library as the CPU does, up to one rounding of C to the
/// half type.
#[tokio::test]
async fn a_half_gemm_runs_on_a_lease_by_the_nodes_library() {
    use cuda_async::half::{bf16, f16};
    let fx = Fixture::node_path(1 << 22).lease(1 << 20).start().await;
    let (node, remote) = (&fx.node, fx.policy());
    let (m, n, k) = (7, 5, 3);
    let g = Gemm::<bf16>::new(m, n, k)
        .transpose_a()
        .alpha(bf16::from_f32(1.5))
        .beta(bf16::from_f32(-0.5));
    let half = |n, seed| -> Vec<bf16> {
        random_f32(n, seed)
            .into_iter()
            .map(bf16::from_f32)
            .collect()
    };
    let (av, bv, cv) = (half(m * k, 1), half(k * n, 2), half(m * n, 3));
    let before = batches(node);
    let got = h2d(av.clone())
        .zip(h2d(bv.clone()))
        .zip(h2d(cv.clone()))
        .then(move |((a, b), c)| gemm(g, a, b, c))
        .then(|(_, _, c)| d2h(c))
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    assert_eq!(batches(node).0 - before.0, 1, "one message");
    let got: Vec<f64> = got.to_vec().unwrap().into_iter().map(f64::from).collect();
    let want = cpu_gemm(&g, &av, &bv, &cv);
    for (i, (got, want)) in got.iter().zip(&want).enumerate() {
        // bf16 keeps 8 significant bits: one rounding is within 2^-8.
        assert!(
            (got - want).abs() <= 4e-3 * want.abs() + 1e-6,
            "bf16 element {i} is {got}, the CPU says {want}"
        );
    }
    // Two f16 products of 2x2.
    let g = Gemm::<f16>::new(2, 2, 2).batched(2);
    let av: Vec<f16> = [1.0, 2.0, 3.0, 4.0, 0.5, 0.25, -1.0, 2.0]
        .map(f16::from_f32)
        .into();
    let got = h2d(av.clone())
        .zip(h2d(av.clone()))
        .zip(zeros::<f16>(8))
        .then(move |((a, b), c)| gemm(g, a, b, c))
        .then(|(_, _, c)| d2h(c))
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    let got: Vec<f64> = got.to_vec().unwrap().into_iter().map(f64::from).collect();
    // Exact in f16: small integers and quarters.
    assert_eq!(got, cpu_gemm(&g, &av, &av, &[f16::ZERO; 8]));
    fx.shutdown().await;
}

/// A random fill on a lease is one command the node's generator runs (the
/// in-memory device's host generator here): values in range, the same
/// seed gives the same values, a normal fill has about its mean and
/// deviation, a view's fill leaves the rest of its buffer alone, and a
/// fill the node finds outside its buffer is refused by name.
#[tokio::test]
async fn a_random_fill_runs_on_a_lease_by_the_nodes_library() {
    use cuda_async::rand::{normal, uniform};
    let fx = Fixture::node_path(1 << 22).lease(1 << 20).start().await;
    let remote = fx.policy();
    let filled = |seed: u64| {
        let remote = &remote;
        async move {
            zeros::<f32>(1000)
                .then(move |x| uniform(seed, x))
                .then(d2h)
                .schedule(remote)
                .unwrap()
                .await
                .unwrap()
                .to_vec()
                .unwrap()
        }
    };
    let u = filled(7).await;
    assert!(u.iter().all(|v| *v > 0.0 && *v <= 1.0), "{:?}", &u[..4]);
    assert_eq!(filled(7).await, u, "the same seed, the same values");
    assert_ne!(filled(8).await, u);
    let n = zeros::<f64>(20_000)
        .then(|x| normal(3, 2.0, 0.5, x))
        .then(d2h)
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap()
        .to_vec()
        .unwrap();
    let mean = n.iter().sum::<f64>() / n.len() as f64;
    let var = n.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n.len() as f64;
    assert!((mean - 2.0).abs() < 0.02, "mean {mean}");
    assert!((var.sqrt() - 0.5).abs() < 0.02, "deviation {}", var.sqrt());
    let mut x = zeros::<f32>(30).schedule(&remote).unwrap().await.unwrap();
    uniform(1, x.slice_mut(10..20).unwrap())
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    let x = d2h(&x)
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap()
        .to_vec()
        .unwrap();
    assert!(x[..10].iter().chain(&x[20..]).all(|v| *v == 0.0));
    assert!(x[10..20].iter().all(|v| *v > 0.0));
    fx.shutdown().await;
}
