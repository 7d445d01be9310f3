//! Views as offsets, and graphs kept on the node.

use super::*;

/// Views of buffers travel to a leased GPU as the buffer's id and a byte
/// offset: a kernel reads one view and writes another, a memset fills a
/// third, a download reads a fourth; the rest of each buffer is untouched.
#[tokio::test]
async fn views_travel_to_a_leased_gpu_as_offsets() {
    let fx = Fixture::node_path(1 << 22).lease(1 << 20).start().await;
    let remote = fx.policy();
    let k = kernels();
    let x = h2d((0..16).map(|i| i as f32).collect::<Vec<_>>())
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    let mut y = h2d(vec![1.0f32; 16])
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    {
        let (head, tail) = y.split_at_mut(8).unwrap();
        // SAFETY: axpy touches x[0..4) and y[0..4) of its views, 4 floats
        // each.
        let op = unsafe {
            launch(
                &k.axpy,
                cfg(4),
                (
                    2.0f32,
                    x.slice(4..8).unwrap(),
                    tail.split_at(4).unwrap().1,
                    4u32,
                ),
            )
        };
        op.schedule(&remote).unwrap().await.unwrap();
        memset(head.split_at(2).unwrap().1.split_at(2).unwrap().0, 0)
            .schedule(&remote)
            .unwrap()
            .await
            .unwrap();
    }
    let part = d2h(y.slice(1..16).unwrap())
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    let mut want = [1.0f32; 16];
    want[2..4].fill(0.0);
    for (i, v) in want[12..16].iter_mut().enumerate() {
        *v = 2.0 * (4 + i) as f32 + 1.0;
    }
    assert_eq!(part.as_slice().unwrap(), &want[1..]);
    // Device copies out of and into views.
    copy_d2d(x.slice(0..3).unwrap(), y.slice_mut(13..16).unwrap())
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    let copied = d2d(y.slice(12..16).unwrap())
        .then(d2h)
        .schedule(&remote)
        .unwrap()
        .await
        .unwrap();
    assert_eq!(copied.as_slice().unwrap(), &[want[12], 0.0, 1.0, 2.0]);
    // Out of range: an error naming the range and the buffer's length.
    let e = x.slice(10..17).unwrap_err().to_string();
    assert!(e.contains("of a buffer of 16"), "{e}");
    fx.free_and_shutdown().await;
}

/// A graph captured on a lease is kept by the node: capturing runs nothing
/// but its allocations; 100 launches, each one message of one command
/// after an input changed by `update`, give what an eager run gives; a
/// download in the op is refused by name; a recapture changes the work;
/// the graph is `WrongHome` on another lease; a launch in flight when the
/// graph is dropped completes, and the node's memory is back where it was
/// once the graph and its buffers are gone.
#[test]
fn a_graph_captured_on_a_lease_is_kept_by_the_node_and_launched_in_one_command() {
    let node_rt = tokio::runtime::Runtime::new().unwrap();
    let fx = node_rt.block_on(Fixture::node_path(1 << 24).start());
    let node = &fx.node;
    let connect = || {
        let builder = Lease::builder()
            .min_vram(1 << 20)
            .config(client_config(node));
        BlockingLease::connect(builder, node.addr()).unwrap()
    };
    let (lease, other) = (connect(), connect());
    let remote = RemotePolicy::new(&lease).with_streams(2);
    let k = kernels();
    let n = 300usize;
    let base = vram_allocated(node);
    let x = h2d(vec![0.0f32; n]).sync_with(&remote).unwrap();

    // c = x + (2x + y), y zeroed at each launch, on two streams.
    let op = |a: f32, x: DeviceBuffer<f32>| {
        let (axpy, vadd) = (k.axpy.clone(), k.vadd.clone());
        let m = n as u32;
        zeros::<f32>(n)
            .zip(zeros::<f32>(n))
            .then(move |(y, c)| {
                // SAFETY: axpy touches x and y [0..m); both hold m floats.
                unsafe { launch(&axpy, cfg(m), (a, x, y, m)) }.map(move |(_, x, y, _)| (x, y, c))
            })
            .then(move |(x, y, c)| {
                // SAFETY: vadd touches a, b, c [0..m); all hold m floats.
                unsafe { launch(&vadd, cfg(m), (x, Arc::new(y), c, m)) }.map(|(x, _, c, _)| (x, c))
            })
    };
    let before = batches(node);
    let mut graph = op(2.0, x).graph_with(&remote).unwrap();
    assert_eq!(batches(node).0 - before.0, 1, "one message to capture");
    assert!(graph.home().contains("lease"), "{}", graph.home());
    assert!(graph.device().is_none());
    let c = d2h(&graph.output().1).sync_with(&remote).unwrap();
    assert!(
        c.to_vec().unwrap().iter().all(|&v| v == 0.0),
        "capture runs nothing"
    );

    for i in 0..100 {
        let xs = vec![i as f32; n];
        graph
            .update(move |(x, c)| {
                h2d(xs)
                    .then(move |t| copy_d2d(t, x))
                    .map(move |(_, x)| (x, c))
            })
            .sync_with(&remote)
            .unwrap();
        let sent = batches(node);
        graph.launch().sync_with(&remote).unwrap();
        let after = batches(node);
        assert_eq!((after.0 - sent.0, after.1 - sent.1), (1, 1), "launch {i}");
        let c = d2h(&graph.output().1).sync_with(&remote).unwrap();
        assert!(
            c.to_vec().unwrap().iter().all(|&v| v == 3.0 * i as f32),
            "launch {i}: {:?}",
            &c.to_vec().unwrap()[..2]
        );
    }
    // The same op run eagerly gives the same.
    let x = h2d(vec![7.0f32; n]).sync_with(&remote).unwrap();
    let (_, c) = op(2.0, x).sync_with(&remote).unwrap();
    assert_eq!(
        d2h(c).sync_with(&remote).unwrap().to_vec().unwrap(),
        vec![21.0; n]
    );

    // A `DeviceScalar` the graph reads, set between launches: c = s + x.
    let mut step = cuda_async::DeviceScalar::new(0.0f32)
        .sync_with(&remote)
        .unwrap();
    let one = h2d(vec![0.5f32]).sync_with(&remote).unwrap();
    let vadd = k.vadd.clone();
    let scalar = step.buffer();
    // SAFETY: vadd touches a, b, c [0..1); all hold one float.
    let stepped = unsafe {
        launch(
            &vadd,
            cfg(1),
            (
                scalar,
                &one,
                zeros::<f32>(1).sync_with(&remote).unwrap(),
                1u32,
            ),
        )
    }
    .map(|(_, _, c, _)| c)
    .graph_with(&remote)
    .unwrap();
    for t in 0..5 {
        step.set(t as f32).sync_with(&remote).unwrap();
        let c = stepped
            .launch()
            .then(|()| d2h(stepped.output()))
            .sync_with(&remote)
            .unwrap();
        assert_eq!(c.to_vec().unwrap(), [t as f32 + 0.5], "step {t}");
    }
    drop(stepped);
    drop((step, one));

    // A download cannot be kept on the node: refused by name, nothing sent.
    // The frees of what was just dropped have all reached the node first
    // (the graph's, then what it held), so none goes while the batches are
    // counted.
    let ledger = cuda_async::RemoteSession::ledger(&*lease.session()).unwrap();
    assert!(
        ledger.wait_idle(Duration::from_secs(10)),
        "frees still going"
    );
    let sent = batches(node);
    let e = zeros::<f32>(4).then(d2h).graph_with(&remote).unwrap_err();
    assert!(
        matches!(&e, Error::Capture(m) if m.contains("download")),
        "{e}"
    );
    assert_eq!(batches(node).0, sent.0);

    // Recaptured with a = 5: c = x + 5x.
    graph.recapture(|(x, _)| op(5.0, x)).expect("recaptured");
    graph.launch().sync_with(&remote).unwrap();
    let c = d2h(&graph.output().1).sync_with(&remote).unwrap();
    assert!(c.to_vec().unwrap().iter().all(|&v| v == 6.0 * 99.0));

    // Another lease's graph.
    let e = graph
        .launch()
        .sync_with(&RemotePolicy::new(&other))
        .unwrap_err();
    assert!(matches!(e, Error::WrongHome { .. }), "{e}");

    // Dropped with a launch in flight: the launch is sent first, then the
    // graph's free.
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    {
        use std::future::Future;
        let pending = graph.launch().schedule(&remote).unwrap();
        let mut pending = std::pin::pin!(pending);
        let _ = rt.block_on(std::future::poll_fn(|cx| {
            std::task::Poll::Ready(pending.as_mut().poll(cx))
        }));
    }
    drop(graph);
    // What is left: the module's source, charged while it is loaded.
    let want = base + KERNELS.len() as u64;
    let settled = node_rt.block_on(eventually(Duration::from_secs(5), || async {
        vram_allocated(node) == want
    }));
    assert!(
        settled,
        "{} bytes held, {want} wanted",
        vram_allocated(node)
    );
    drop((lease, other));
    node_rt.block_on(fx.shutdown());
}

/// A lease that expires with a graph kept on its node: the next launch
/// fails with `LeaseExpired`, and the node holds nothing of the lease
/// (the graph, its buffers and its kept upload bytes went with it).
#[tokio::test]
async fn a_graph_kept_on_the_node_goes_with_its_lease() {
    let fx = Fixture::node_path(1 << 22).manual_clock().start().await;
    let (node, clock) = (&fx.node, fx.clock());
    let base = vram_allocated(node);
    let (_short, remote) = short_lease(node, 1 << 16).await;
    // An upload in the body: its bytes are kept with the graph.
    let graph = h2d(vec![3u32; 256])
        .then(d2d)
        .graph_with_async(&remote)
        .unwrap()
        .await
        .unwrap();
    graph.launch().schedule(&remote).unwrap().await.unwrap();
    assert!(vram_allocated(node) > base);
    clock.advance(Duration::from_secs(6));
    let e = graph.launch().schedule(&remote).unwrap().await.unwrap_err();
    assert!(
        matches!(e.remote_kind(), Some(ErrorKind::LeaseExpired)),
        "{e}"
    );
    let gone = eventually(Duration::from_secs(5), || async {
        vram_allocated(node) == base
    })
    .await;
    assert!(gone, "{} bytes held, {base} before", vram_allocated(node));
    drop(graph);
    fx.shutdown().await;
}

/// A graph shared by `Arc` replays from spawned tasks, directly and
/// through a `SubmitThread` (`launch_owned` is a `'static` op): every
/// replay runs once, each after the one before (y += x at each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graph_shared_by_arc_replays_from_other_tasks_and_a_submit_thread() {
    let fx = Fixture::node_path(1 << 22).lease(1 << 20).start().await;
    let remote = Arc::new(fx.policy());
    let k = kernels();
    let up = |v: Vec<f32>| h2d(v).schedule(&*remote).unwrap();
    let (x, y) = (
        up(vec![1.0; 4]).await.unwrap(),
        up(vec![0.0; 4]).await.unwrap(),
    );
    // SAFETY: axpy touches x and y [0..4); both hold 4 floats.
    let graph = unsafe { launch(&k.axpy, cfg(4), (1.0f32, x, y, 4u32)) }
        .graph_with_async(&remote)
        .unwrap()
        .await
        .unwrap();
    let graph = Arc::new(graph);
    let submit = Arc::new(cuda_async::SubmitThread::new().unwrap());
    let tasks: Vec<_> = (0..4)
        .map(|t| {
            let (graph, remote, submit) = (graph.clone(), remote.clone(), submit.clone());
            tokio::spawn(async move {
                for _ in 0..5 {
                    let op = graph.launch_owned().schedule(&*remote).unwrap();
                    if t % 2 == 0 {
                        submit.enqueue(op).await.unwrap();
                    } else {
                        op.await.unwrap();
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let y = d2h(&graph.output().2)
        .schedule(&*remote)
        .unwrap()
        .await
        .unwrap();
    assert_eq!(y.to_vec().unwrap(), [20.0; 4]);
    drop(graph);
    fx.free_and_shutdown().await;
}
