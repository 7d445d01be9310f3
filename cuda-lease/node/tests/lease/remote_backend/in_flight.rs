//! Submissions in flight: dropped futures, many tasks on one lease, faults, the futures crate, blocking waits with a timeout.

use super::*;

/// A waker that notifies: a future polled with it tells when it would be
/// polled again.
#[derive(Default)]
struct Woken(tokio::sync::Notify);

impl std::task::Wake for Woken {
    fn wake(self: Arc<Self>) {
        self.0.notify_one();
    }
}

#[tokio::test]
async fn a_remote_future_dropped_in_flight_frees_only_after_the_node_s_work() {
    let fx = Fixture::node_path(1 << 22)
        .config(|cfg| cfg.op_timeout = Duration::from_secs(10))
        .lease(1 << 21)
        .start()
        .await;
    let (node, remote) = (&fx.node, fx.policy());
    let hang = Module::cuda(HANG, &[]).unwrap().kernel("__hang").unwrap();
    let bytes = 1usize << 20;
    let vram_before = vram_allocated(node);
    let before = batches(node);
    // The buffer is the output: in use by the queued (here: endless) work.
    let mut fut = zeros::<u8>(bytes)
        // SAFETY: the host double's hang kernel touches nothing.
        .then(move |b| unsafe { launch(&hang, cfg(1), ()) }.map(move |()| b))
        .schedule(&remote)
        .unwrap();
    // Polled until its message reached the node (which runs it: it hangs).
    tokio::select! {
        _ = &mut fut => panic!("the hang returned"),
        reached = eventually(Duration::from_secs(10), || async { batches(node).0 > before.0 }) => {
            assert!(reached, "the submission never reached the node");
        }
    }
    assert!(fut.is_submitted());
    let t = std::time::Instant::now();
    drop(fut);
    // (A drop that waited for the work would wait for the 10 s hang.)
    assert!(t.elapsed() < Duration::from_secs(1), "drop blocked");
    // The free waits for the work's reply. A submission sent now would
    // carry it, were it queued (queued frees lead the next message); one
    // is sent (its first poll sends it) and reaches the node, where it
    // waits behind the work: one message of one command, no free.
    let sent = batches(node);
    let mut probe = zeros::<u8>(16).schedule(&remote).unwrap();
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    assert!(std::future::Future::poll(std::pin::Pin::new(&mut probe), &mut cx).is_pending());
    let probe = tokio::spawn(probe);
    reached(node, sent).await;
    assert_eq!(
        batches(node),
        (sent.0 + 1, sent.1 + 1),
        "the dropped buffer's free went out before the work was over"
    );
    // Once the work is over (the hang times out after 10 s, which fails the
    // lease), the buffer is freed: the node's accounting is back where it
    // was. A leak fails here. (The failed lease lets go of all it held, so
    // this sees the node's release, not the client's free: a client that
    // forgets its frees is caught by `a_buffer_dropped_while_its_op_is_queued_is_freed_after_it`
    // and the pipeline test's end-of-test check.)
    assert!(
        eventually(Duration::from_secs(20), || async {
            vram_allocated(node) == vram_before
        })
        .await,
        "never freed: the node still holds {} bytes (before: {vram_before})",
        vram_allocated(node)
    );
    // The probe waited behind the work, and failed with its lease.
    assert!(probe.await.unwrap().is_err());

    // mem::forget: the buffer leaks (never freed early, never freed).
    let fx2 = Fixture::node_path(1 << 22).lease(1 << 21).start().await;
    let (lease2, remote2) = (fx2.lease(), fx2.policy());
    let mut fut = zeros::<u8>(bytes).schedule(&remote2).unwrap();
    // Exactly one poll: it sends the submission. Its waker is woken once
    // the reply has come and the session has settled what it created.
    let replied = Arc::new(Woken::default());
    let waker = std::task::Waker::from(replied.clone());
    let mut cx = std::task::Context::from_waker(&waker);
    assert!(std::future::Future::poll(std::pin::Pin::new(&mut fut), &mut cx).is_pending());
    std::mem::forget(fut);
    tokio::time::timeout(Duration::from_secs(10), replied.0.notified())
        .await
        .expect("the forgotten submission was never answered");
    // The allocation ran; then nothing frees it: a later submission on the
    // session runs (a free queued by then would go before it, in the same
    // message), and the forgotten buffer is still there beside it.
    assert_eq!(lease2.query().await.unwrap().allocated, bytes as u64);
    let sent = batches(&fx2.node);
    let probe = zeros::<u8>(16).schedule(&remote2).unwrap().await.unwrap();
    assert_eq!(batches(&fx2.node), (sent.0 + 1, sent.1 + 1));
    assert_eq!(lease2.query().await.unwrap().allocated, bytes as u64 + 16);
    drop(probe);
    fx2.shutdown().await;
    fx.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_tasks_sharing_one_lease_all_get_their_own_results() {
    let fx = Fixture::node_path(1 << 24).lease(1 << 23).start().await;
    let remote = Arc::new(fx.policy());
    let k = Arc::new(kernels());
    let tasks: Vec<_> = (0..64u64)
        .map(|t| {
            let (remote, k) = (remote.clone(), k.clone());
            tokio::spawn(async move {
                for round in 0..5 {
                    let n = 100 + (t as usize * 7 + round) % 300;
                    let (x, y) = (random_f32(n, t * 1000 + round as u64), random_f32(n, t + 1));
                    let a = t as f32 - round as f32;
                    let out = pipeline(x.clone(), y.clone(), a, &k)
                        .schedule(&*remote)
                        .unwrap()
                        .await
                        .unwrap();
                    assert_eq!(
                        out.to_vec().unwrap(),
                        reference(&x, &y, a),
                        "task {t} round {round}"
                    );
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    fx.shutdown().await;
}

#[tokio::test]
async fn a_kernel_fault_fails_its_lease_and_leaves_other_leases_working() {
    let fx = Fixture::node_path(1 << 22).lease(1 << 20).start().await;
    let b = lease_on(&fx.node, 1 << 20).await;
    let (on_a, on_b) = (fx.policy(), policy_of(&b));
    let k = kernels();
    // A pipeline on A is in flight with the fault behind it in one message.
    let (x, y) = (random_f32(500, 1), random_f32(500, 2));
    let fault = k.fault.clone();
    let e = pipeline(x.clone(), y.clone(), 1.0, &k)
        // SAFETY: the host double's fault kernel touches nothing.
        .then(move |h| unsafe { launch(&fault, cfg(1), ()) }.map(move |()| h))
        .schedule(&on_a)
        .unwrap()
        .await
        .unwrap_err();
    assert!(
        matches!(e.remote_kind(), Some(ErrorKind::LaunchFailed)),
        "{e}"
    );
    // A's later submissions fail too: its context is gone.
    let e = h2d(vec![1u8; 4])
        .then(d2h)
        .schedule(&on_a)
        .unwrap()
        .await
        .unwrap_err();
    assert!(
        matches!(e.remote_kind(), Some(ErrorKind::LeasePoisoned)),
        "{e}"
    );
    // B, on the same node, is unaffected.
    let out = pipeline(x.clone(), y.clone(), 3.0, &k)
        .schedule(&on_b)
        .unwrap()
        .await
        .unwrap();
    assert_eq!(out.to_vec().unwrap(), reference(&x, &y, 3.0));
    fx.shutdown().await;
}

/// `DeviceFuture`s are plain futures: `futures`' combinators drive them on
/// any executor, here a `FuturesUnordered` (results as they complete) and
/// `join_all` (results in order), and a `Stream` of a batch's results.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_futures_compose_with_the_futures_crate() {
    use futures::stream::{FuturesUnordered, StreamExt};

    let fx = Fixture::node_path(1 << 24).lease(1 << 23).start().await;
    let remote = fx.policy();
    let k = kernels();
    let inputs: Vec<(Vec<f32>, Vec<f32>, f32)> = (0..16u64)
        .map(|i| {
            let n = 50 + i as usize * 13;
            (random_f32(n, i), random_f32(n, i + 100), i as f32 * 0.5)
        })
        .collect();
    let run = |i: usize| {
        let (x, y, a) = inputs[i].clone();
        pipeline(x, y, a, &k).schedule(&remote).unwrap()
    };
    // As they complete: each result still matches its own input.
    let mut unordered: FuturesUnordered<_> = (0..inputs.len())
        .map(|i| {
            let f = run(i);
            async move { (i, f.await) }
        })
        .collect();
    let mut seen = vec![false; inputs.len()];
    while let Some((i, out)) = unordered.next().await {
        let (x, y, a) = &inputs[i];
        assert_eq!(out.unwrap().to_vec().unwrap(), reference(x, y, *a), "{i}");
        seen[i] = true;
    }
    assert!(seen.iter().all(|&s| s));
    // In order.
    let outs = futures::future::join_all((0..inputs.len()).map(run)).await;
    for (i, out) in outs.into_iter().enumerate() {
        let (x, y, a) = &inputs[i];
        assert_eq!(out.unwrap().to_vec().unwrap(), reference(x, y, *a), "{i}");
    }
    // A stream of results, at most 4 submissions in flight.
    let total: usize = futures::stream::iter(0..inputs.len())
        .map(run)
        .buffered(4)
        .map(|out| out.unwrap().to_vec().unwrap().len())
        .fold(0, |acc, n| async move { acc + n })
        .await;
    assert_eq!(total, inputs.iter().map(|(x, _, _)| x.len()).sum::<usize>());
    fx.free_and_shutdown().await;
}

#[test]
fn a_blocking_wait_with_a_timeout_returns_while_the_submission_still_runs() {
    let node_rt = tokio::runtime::Runtime::new().unwrap();
    let fx = node_rt.block_on(Fixture::node_path(1 << 22).start());
    let node = &fx.node;
    let builder = Lease::builder()
        .min_vram(1 << 20)
        .config(client_config(node));
    let lease = BlockingLease::connect(builder, node.addr()).unwrap();
    let remote = RemotePolicy::new(&lease);
    // Done in time: the output, as with `sync_with`.
    let v = h2d(vec![5u8; 64])
        .then(d2h)
        .sync_with_timeout(&remote, Duration::from_secs(10))
        .unwrap();
    assert_eq!(v.to_vec().unwrap(), vec![5u8; 64]);
    // A submission that never ends on the node: the wait ends at its bound.
    let hang = Module::cuda(HANG, &[]).unwrap().kernel("__hang").unwrap();
    let t = std::time::Instant::now();
    // SAFETY: the host double's hang kernel touches nothing.
    let e = unsafe { launch(&hang, cfg(1), ()) }
        .sync_with_timeout(&remote, Duration::from_millis(200))
        .unwrap_err();
    let waited = t.elapsed();
    assert!(
        matches!(e, Error::Timeout { waited } if waited == Duration::from_millis(200)),
        "{e}"
    );
    assert!(e.to_string().contains("wait longer"), "{e}");
    assert!(
        waited >= Duration::from_millis(200) && waited < Duration::from_secs(5),
        "returned after {waited:?}"
    );
    drop(remote);
    drop(lease);
    node_rt.block_on(fx.shutdown());
}
