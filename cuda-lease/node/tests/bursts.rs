//! Bursts of connections against a real node on loopback (in-memory
//! device): honest clients past the per-source cap of connections waiting
//! for HELLO wait their turn in the handshake queue, the queue is bounded
//! (a full one is "node busy", which the client retries), and the limits
//! against unauthenticated floods hold. Lease churn is rate-limited per
//! principal. The tests take turns: each starts hundreds of connections.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use cuda_lease::client::{Client, Disconnect, ErrorKind};
use cuda_lease::proto::Status;

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Whether `e` is the node refusing a connection before its handshake.
fn refused(e: &quinn::ConnectionError) -> bool {
    matches!(e, quinn::ConnectionError::ConnectionClosed(c)
        if c.error_code == quinn::TransportErrorCode::CONNECTION_REFUSED)
}

/// `n` authenticated clients connecting at once from 127.0.0.1; how many
/// connected, and the first error.
async fn burst(node: &cuda_lease_node::node::Node, n: usize) -> (usize, Option<String>, Duration) {
    let cfg = client_config(node).connect_timeout(Duration::from_secs(60));
    let addr = node.addr();
    let t = Instant::now();
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let cfg = cfg.clone();
            tokio::spawn(async move { Client::connect(addr, &cfg).await })
        })
        .collect();
    let mut ok = Vec::new();
    let mut first_error = None;
    for t in tasks {
        match t.await.unwrap() {
            Ok(c) => ok.push(c),
            Err(e) => {
                first_error.get_or_insert(e.to_string());
            }
        }
    }
    let took = t.elapsed();
    // Each connection is authenticated: it is served.
    if let Some(c) = ok.last() {
        c.inventory().await.unwrap();
    }
    (ok.len(), first_error, took)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bursts_of_300_and_600_honest_clients_from_one_address_are_all_served() {
    // Measured against a node with the cap and no queue: of 300 clients
    // connecting at once from one address, 113 were refused.
    let _one = ONE_AT_A_TIME.lock().await;
    let mut cfg = memory_config(1 << 20);
    // The clients share this process's cores with the node: on a loaded
    // 2-core machine in a debug build, one of 600 was seen to get its
    // HELLO through only after the default 5 s deadline (a release build
    // serves all 600 in about 3.5 s with the defaults).
    cfg.hello_timeout = Duration::from_secs(30);
    let fx = Fixture::with_config(cfg).start().await;
    let node = &fx.node;
    for n in [300, 600] {
        let (ok, first_error, took) = burst(node, n).await;
        let queued = metric(&node.metrics_text(), "gpu_handshakes_queued_total").unwrap_or(0);
        eprintln!(
            "{n} clients at once from 127.0.0.1: {ok} served in {took:?} \
             ({queued} queued for a handshake so far); first error: {first_error:?}"
        );
        assert_eq!(ok, n, "first error: {first_error:?}");
        assert!(queued > 0, "the burst never met the per-source cap");
    }
    fx.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_caps_wait_in_a_bounded_queue() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut cfg = memory_config(1 << 20);
    cfg.max_unauthenticated = 12;
    cfg.max_unauthenticated_per_source = 8;
    cfg.max_queued_handshakes = 6;
    cfg.max_queued_handshakes_per_source = 4;
    cfg.hello_timeout = Duration::from_secs(20);
    let fx = Fixture::with_config(cfg).start().await;
    let node = &fx.node;
    let tenant = connect(node).await;
    // Dials from `ip`, all at once; their results as they come.
    let dials = |ip: [u8; 4], n: usize| {
        let ep = endpoint_on(node, ip);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        for _ in 0..n {
            let (ep, tx, addr) = (ep.clone(), tx.clone(), node.addr());
            tokio::spawn(async move {
                let _ = tx.send(ep.connect(addr, "localhost").unwrap().await);
            });
        }
        rx
    };
    // Takes `held` handshakes and `busy` refusals from `rx` (in any order).
    async fn take(
        rx: &mut tokio::sync::mpsc::UnboundedReceiver<
            Result<quinn::Connection, quinn::ConnectionError>,
        >,
        held: usize,
        busy: usize,
    ) -> Vec<quinn::Connection> {
        let mut conns = Vec::new();
        let mut refusals = 0;
        while conns.len() < held || refusals < busy {
            let r = tokio::time::timeout(Duration::from_secs(10), rx.recv())
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "waited 10 s with {} held and {refusals} refused (want {held} and {busy})",
                        conns.len()
                    )
                })
                .unwrap();
            match r {
                Ok(c) => conns.push(c),
                Err(e) if refused(&e) => refusals += 1,
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!((conns.len(), refusals), (held, busy));
        conns
    }
    // 127.0.0.2: 8 places (its cap), 4 queued (its queue's), 8 refused.
    let mut a = dials([127, 0, 0, 2], 20);
    let held_a = take(&mut a, 8, 8).await;
    // 127.0.0.3: 4 places (the node's cap), 2 queued (the node's queue),
    // 4 refused.
    let mut b = dials([127, 0, 0, 3], 10);
    let held_b = take(&mut b, 4, 4).await;
    assert!(
        a.try_recv().is_err() && b.try_recv().is_err(),
        "queued ones ended"
    );
    assert_eq!(
        metric(&node.metrics_text(), "gpu_handshakes_refused_total"),
        Some(12)
    );
    // An authenticated tenant is served meanwhile.
    tenant.inventory().await.unwrap();
    // The first address's connections say HELLO: their places go to its
    // queued ones, which now get their handshake.
    for c in &held_a {
        assert_eq!(hello(c, TOKEN).await.map(|r| r.0), Some(Status::Ok));
    }
    let more = take(&mut a, 4, 0).await;
    for c in &more {
        assert_eq!(hello(c, TOKEN).await.map(|r| r.0), Some(Status::Ok));
    }
    // The node's places freed go to the second address's queued ones.
    let more_b = take(&mut b, 2, 0).await;
    eprintln!(
        "caps 8 per source, 12 node-wide; queues 4 and 6: 127.0.0.2 held 8, queued 4, \
         refused 8; 127.0.0.3 held {}, queued {}, refused 4",
        held_b.len(),
        more_b.len()
    );
    assert_eq!(
        metric(&node.metrics_text(), "gpu_handshakes_queued_total"),
        Some(6)
    );
    fx.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_handshake_queue_is_node_busy_and_the_client_retries_until_served() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut cfg = memory_config(1 << 20);
    cfg.max_unauthenticated_per_source = 2;
    cfg.max_queued_handshakes_per_source = 1;
    cfg.hello_timeout = Duration::from_secs(4);
    let fx = Fixture::with_config(cfg).start().await;
    let node = &fx.node;
    // Two idle connections hold 127.0.0.1's places; a third waits in its
    // queue.
    let ep = endpoint_on(node, [127, 0, 0, 1]);
    let idle = [
        dial(&ep, node).await.unwrap(),
        dial(&ep, node).await.unwrap(),
    ];
    let queued = tokio::spawn({
        let (ep, addr) = (ep.clone(), node.addr());
        async move { ep.connect(addr, "localhost").unwrap().await }
    });
    wait_until(Duration::from_secs(10), "a queued handshake", || async {
        metric(&node.metrics_text(), "gpu_handshakes_queued_total") == Some(1)
    })
    .await;
    // A client with a short connect timeout is told why.
    let short = client_config(node).connect_timeout(Duration::from_secs(1));
    let e = Client::connect(node.addr(), &short).await.unwrap_err();
    eprintln!("connect against a full handshake queue: {e}");
    assert_eq!(
        e.kind(),
        ErrorKind::Disconnected(Disconnect::NodeBusy),
        "{e}"
    );
    assert!(e.to_string().contains("node busy"), "{e}");
    assert!(e.is_retryable());
    // One with time to wait retries until the idle ones are closed at
    // their HELLO deadline and the queue empties.
    let patient = client_config(node).connect_timeout(Duration::from_secs(20));
    let t = Instant::now();
    let c = Arc::new(Client::connect(node.addr(), &patient).await.unwrap());
    c.inventory().await.unwrap();
    eprintln!("a patient client got in after {:?}", t.elapsed());
    for i in &idle {
        assert!(closed_within(i, Duration::from_secs(5)).await);
    }
    let _ = queued.await;
    fx.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_idle_unauthenticated_connections_are_capped_and_end_at_the_deadline() {
    // With the queue: the per-source cap still bounds the connections
    // held between arrival and HELLO (the node's count, sampled), each is
    // closed at its HELLO deadline, and the queued ones are refused at
    // theirs.
    let _one = ONE_AT_A_TIME.lock().await;
    let mut cfg = memory_config(1 << 20);
    let deadline = Duration::from_secs(1);
    cfg.hello_timeout = deadline;
    let cap = cfg.max_unauthenticated_per_source as u64;
    let fx = Fixture::with_config(cfg).start().await;
    let node = &fx.node;
    let ep = endpoint_on(node, [127, 0, 0, 1]);
    let t = Instant::now();
    let tasks: Vec<_> = (0..1000)
        .map(|_| {
            let (ep, addr) = (ep.clone(), node.addr());
            tokio::spawn(async move {
                match ep.connect(addr, "localhost").unwrap().await {
                    // Handshake done, no HELLO sent: closed at the deadline
                    // (or, when the close is lost, at the client's idle
                    // timeout).
                    Ok(c) => {
                        c.closed().await;
                        Ok(())
                    }
                    Err(e) => Err(refused(&e)),
                }
            })
        })
        .collect();
    let done = std::sync::atomic::AtomicBool::new(false);
    let ended = async {
        let (mut sessions, mut refusals) = (0, 0);
        for task in tasks {
            match tokio::time::timeout(Duration::from_secs(90), task)
                .await
                .expect("a connection was neither closed nor refused in 90 s")
                .unwrap()
            {
                Ok(()) => sessions += 1,
                Err(r) => refusals += usize::from(r),
            }
        }
        done.store(true, Ordering::SeqCst);
        (sessions, refusals)
    };
    let sampled = async {
        let mut most = 0;
        while !done.load(Ordering::SeqCst) {
            let now = metric(&node.metrics_text(), "gpu_handshakes_waiting").unwrap_or(0);
            most = most.max(now);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        most
    };
    let ((sessions, refusals), most) = tokio::join!(ended, sampled);
    eprintln!(
        "1,000 idle connections from one address, deadline {deadline:?}: {sessions} got a TLS \
         session, {refusals} refused (the rest lost to the client's own timeout); the node held \
         at most {most} places at once; all ended on the client in {:?}",
        t.elapsed()
    );
    assert!(most <= cap, "{most} connections held at once (cap {cap})");
    assert!(refusals > 0);
    // Every place is given back. The node's side of a connection may end
    // after the client's (a client that gave up on its handshake first is
    // let go at the node's deadline), so the count is awaited, not read once.
    let drained = async {
        while metric(&node.metrics_text(), "gpu_handshakes_waiting") != Some(0) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), drained)
        .await
        .expect("the node still held handshake places 30 s after every connection ended");
    // A tenant gets in after.
    connect(node).await.inventory().await.unwrap();
    fx.shutdown().await;
}

/// `tasks` tasks per client looping LEASE_ALLOC + LEASE_FREE until
/// `until`: the leases granted, and the LEASE_ALLOCs refused over the
/// principal's worker-start rate.
async fn churn(clients: Vec<Arc<Client>>, tasks: usize, until: Instant) -> (u32, u32) {
    let loops: Vec<_> = (0..tasks)
        .flat_map(|_| clients.iter().cloned())
        .map(|c| {
            tokio::spawn(async move {
                let (mut granted, mut limited) = (0u32, 0u32);
                while Instant::now() < until {
                    match cuda_lease::client::Lease::builder()
                        .min_vram(4096)
                        .auto_renew(false)
                        .on(c.clone())
                        .await
                    {
                        Ok(l) => {
                            granted += 1;
                            l.free().await.unwrap();
                        }
                        Err(e) => {
                            assert_eq!(e.kind(), ErrorKind::Capacity, "{e}");
                            assert!(
                                e.to_string()
                                    .contains("worker_starts_per_principal_per_second"),
                                "{e}"
                            );
                            limited += 1;
                            tokio::task::yield_now().await;
                        }
                    }
                }
                (granted, limited)
            })
        })
        .collect();
    let (mut granted, mut limited) = (0, 0);
    for l in loops {
        let (g, r) = l.await.unwrap();
        granted += g;
        limited += r;
    }
    (granted, limited)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_worker_starts_are_rate_limited_per_principal() {
    // Measured without the limit: two principals looping LEASE_ALLOC +
    // LEASE_FREE from 16 tasks started about 1,200 workers a second.
    let _one = ONE_AT_A_TIME.lock().await;
    let mut cfg = memory_config(64 << 20);
    cfg.tokens = vec!["ta".into(), "tb".into()];
    cfg.worker_starts_per_principal_per_second = 10.0;
    cfg.worker_start_burst_per_principal = 10;
    let fx = Fixture::with_config(cfg).start().await;
    let node = &fx.node;
    let (a, b) = (connect_as(node, "ta").await, connect_as(node, "tb").await);
    let run = Duration::from_secs(2);
    let t = Instant::now();
    // (16 tasks each: more than the starts a principal may wait for, a
    // second's worth, so some are refused)
    let (granted, limited) = churn(vec![a, b], 16, t + run).await;
    let secs = t.elapsed().as_secs_f64();
    let starts = metric(&node.metrics_text(), "gpu_worker_starts_total").unwrap_or(0);
    eprintln!(
        "2 principals x 16 tasks churning leases for {secs:.1} s at 10/s, burst 10 each: \
         {granted} granted ({starts} worker starts), {limited} refused over the rate"
    );
    // Each principal: its burst, then its rate.
    // (plus one each: the timer that ends a wait for a token may fire a
    // hair after the bound is read)
    let most = 2.0 * (10.0 + 10.0 * secs) + 2.0;
    assert!(
        f64::from(granted) <= most,
        "{granted} leases in {secs:.1} s (at most {most})"
    );
    assert!(limited > 0);
    assert_eq!(starts, u64::from(granted));
    fx.shutdown().await;
}

/// The `q` quantile of `v` (sorted here).
fn quantile(v: &mut [Duration], q: f64) -> Duration {
    v.sort();
    v[((v.len() - 1) as f64 * q) as usize]
}

/// Small round trips (an 8-byte write and read) on `lease` until `until`.
async fn canary(s: &cuda_lease::client::Session, until: Instant) -> Vec<Duration> {
    let x = s.alloc(8).await.unwrap();
    let mut took = Vec::new();
    while Instant::now() < until {
        let t = Instant::now();
        s.write(&x, 0, b"canary!!").await.unwrap();
        assert_eq!(s.read(&x, 0, 8).await.unwrap(), b"canary!!");
        took.push(t.elapsed());
    }
    took
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_churn_at_the_default_rate_leaves_another_tenant_its_latency() {
    // Measured without the limit: the canary's p99 went from 0.96 ms to
    // 8.69 ms while two principals started about 1,200 workers a second.
    let _one = ONE_AT_A_TIME.lock().await;
    let mut cfg = memory_config(64 << 20);
    cfg.tokens = vec!["ta".into(), "tb".into(), "tc".into()];
    let (rate, burst) = (
        cfg.worker_starts_per_principal_per_second,
        f64::from(cfg.worker_start_burst_per_principal),
    );
    let fx = Fixture::with_config(cfg).start().await;
    let node = &fx.node;
    let (a, b) = (connect_as(node, "ta").await, connect_as(node, "tb").await);
    let c = connect_as(node, "tc").await;
    let lease = lease_of(&c, 4096).await;
    let s = lease.session();
    let mut idle = canary(&s, Instant::now() + Duration::from_millis(1500)).await;
    let run = Duration::from_secs(4);
    let t = Instant::now();
    let churning = tokio::spawn(churn(vec![a, b], 8, t + run));
    let mut busy = canary(&s, t + run).await;
    let (granted, _) = churning.await.unwrap();
    let secs = t.elapsed().as_secs_f64();
    let refused = metric(&node.metrics_text(), "gpu_worker_starts_refused_total").unwrap_or(0);
    let (idle50, idle99) = (quantile(&mut idle, 0.5), quantile(&mut idle, 0.99));
    let (busy50, busy99) = (quantile(&mut busy, 0.5), quantile(&mut busy, 0.99));
    eprintln!(
        "2 principals x 8 tasks churning leases for {secs:.1} s at the default rate \
         ({rate}/s, burst {burst}): {granted} workers started, {refused} LEASE_ALLOCs refused; \
         canary p50/p99 idle {idle50:?}/{idle99:?}, during the churn {busy50:?}/{busy99:?}"
    );
    let most = 2.0 * (burst + rate * secs);
    assert!(
        f64::from(granted) <= most,
        "{granted} workers in {secs:.1} s (at most {most})"
    );
    // A starvation guard only: the rate limit itself is checked above (the
    // churn's clients share the test's cores, so the canary's tail moves
    // with the machine's load; the 2x goal is measured in release builds on
    // an idle machine).
    assert!(
        busy99 <= (idle99 * 20).max(Duration::from_millis(500)),
        "canary p99 {busy99:?} during the churn, {idle99:?} idle"
    );
    lease.free().await.unwrap();
    fx.shutdown().await;
}
