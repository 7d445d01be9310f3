//! Prepared submissions kept on the node.

use super::*;
use cuda_async::remote::Prepared;

/// `y = a*x` with `x` uploaded and `y` zeroed at each run; downloads `y`,
/// then `x`.
async fn prepare_axpy(remote: &RemotePolicy, k: &Kernels, n: usize) -> Prepared {
    let axpy = k.axpy.clone();
    let m = n as u32;
    h2d(vec![0f32; n])
        .zip(zeros::<f32>(n))
        // SAFETY: axpy touches x and y [0..m); both hold m floats.
        .then(move |(x, y)| unsafe { launch(&axpy, cfg(m), (3.0f32, x, y, m)) })
        .then(|(_, x, y, _)| d2h(y).then(move |y| d2h(x).map(move |x| (y, x))))
        .prepare()
        .schedule(remote)
        .unwrap()
        .await
        .unwrap()
}

/// A prepared submission is recorded and sent once, and runs nothing but
/// its allocations then; each run is one message of one command with the
/// new input bytes, whose reply brings its outputs in body order; runs
/// from several tasks each get their own results; inputs of the wrong
/// shape and what a body cannot hold are refused by name with nothing
/// sent; dropped with a run in flight, the run completes and the node
/// holds nothing of it after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepared_submission_runs_by_id_with_new_inputs_in_one_command() {
    let fx = Fixture::node_path(1 << 22).lease(1 << 20).start().await;
    let node = &fx.node;
    let remote = Arc::new(fx.policy());
    let k = kernels();
    let n = 64;
    let base = vram_allocated(node);
    let before = batches(node);
    let prepared = prepare_axpy(&remote, &k, n).await;
    assert_eq!(batches(node).0 - before.0, 1, "one message to prepare");
    assert_eq!(prepared.inputs(), [4 * n as u64]);
    assert_eq!(prepared.outputs(), [4 * n as u64, 4 * n as u64]);
    // Write, fill, launch, two reads, and the zip's fork and join events.
    assert_eq!(prepared.commands(), 8);
    // Its two buffers (and the kernels' module) are on the node.
    assert_eq!(
        vram_allocated(node),
        base + 8 * n as u64 + KERNELS.len() as u64
    );

    for i in 0..20 {
        let x = vec![i as f32; n];
        let sent = batches(node);
        let out = prepared
            .run(&[&x[..]])
            .unwrap()
            .schedule(&*remote)
            .unwrap()
            .await
            .unwrap();
        let after = batches(node);
        assert_eq!((after.0 - sent.0, after.1 - sent.1), (1, 1), "run {i}");
        assert_eq!(out.len(), 2);
        assert_eq!(
            out.to_vec::<f32>(0).unwrap(),
            vec![3.0 * i as f32; n],
            "run {i}"
        );
        assert_eq!(out.to_vec::<f32>(1).unwrap(), x, "run {i}");
        assert!(out.to_vec::<f32>(2).is_err());
    }

    // Runs from several tasks at once: each gets its own input's results.
    let prepared = Arc::new(prepared);
    let tasks: Vec<_> = (0..4)
        .map(|t| {
            let (prepared, remote) = (prepared.clone(), remote.clone());
            tokio::spawn(async move {
                for r in 0..5 {
                    let v = (10 * t + r) as f32;
                    let run = prepared.run(&[&vec![v; n][..]]).unwrap();
                    let out = run.schedule(&*remote).unwrap().await.unwrap();
                    assert_eq!(out.to_vec::<f32>(0).unwrap(), vec![3.0 * v; n]);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }

    // Refused before anything is sent.
    let sent = batches(node);
    let e = prepared.run(&[&[1f32; 3][..]]).unwrap_err().to_string();
    assert!(e.contains("inputs of [256] bytes; given [12]"), "{e}");
    let e = prepared.run::<f32>(&[]).unwrap_err().to_string();
    assert!(e.contains("given []"), "{e}");
    let e = zeros::<f32>(4)
        .timed()
        .prepare()
        .schedule(&*remote)
        .unwrap()
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::Capture(m) if m.contains("timed()") && m.contains("prepared")),
        "{e}"
    );
    assert_eq!(batches(node).0, sent.0);

    // Dropped with a run in flight: the run completes, then the node frees
    // it and its buffers.
    let run = prepared.run(&[&vec![1f32; n][..]]).unwrap();
    let pending = run.schedule(&*remote).unwrap();
    drop(prepared);
    let out = pending.await.unwrap();
    assert_eq!(out.to_vec::<f32>(0).unwrap(), vec![3.0; n]);
    let want = base + KERNELS.len() as u64;
    let settled = eventually(Duration::from_secs(5), || async {
        vram_allocated(node) == want
    })
    .await;
    assert!(
        settled,
        "{} bytes held, {want} wanted",
        vram_allocated(node)
    );
    fx.free_and_shutdown().await;
}

/// A submission that prepares a body with a download and, beside it,
/// downloads a buffer large enough for the data path: the prepared body's
/// read takes no place among the submission's reads (it returns nothing
/// until a run), so the large download lands whole where it belongs.
#[tokio::test]
async fn a_prepared_body_beside_a_download_on_the_data_path_keeps_the_reads_apart() {
    let fx = Fixture::node_path(1 << 24).lease(1 << 23).start().await;
    let remote = fx.policy();
    let n = 2 << 20;
    let big = h2d((0..n).map(|i| i as u8).collect::<Vec<_>>())
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    let (prepared, back) = h2d(vec![0u32; 8])
        .then(d2h)
        .prepare()
        .zip(d2h(&big))
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    let back = back.to_vec().unwrap();
    assert_eq!(back.len(), n);
    assert!(back.iter().enumerate().all(|(i, &b)| b == i as u8));
    let out = prepared
        .run(&[&[5u32; 8][..]])
        .unwrap()
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    assert_eq!(out.to_vec::<u32>(0).unwrap(), [5; 8]);
    drop((prepared, big));
    fx.free_and_shutdown().await;
}
