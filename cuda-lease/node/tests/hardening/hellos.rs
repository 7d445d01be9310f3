//! Connections that do not say hello, failed hellos and their flood.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_never_send_hello_are_closed_at_the_hello_deadline() {
    // Round 2, attack 1: 1,000 connections that never sent HELLO were all
    // still open after 90 s (about 50 KiB of the node each).
    let _one = ONE_AT_A_TIME.lock().await;
    let mut cfg = memory_config(1 << 20);
    cfg.hello_timeout = Duration::from_millis(300);
    cfg.max_unauthenticated = 1024;
    cfg.max_unauthenticated_per_source = 1024;
    let fx = Fixture::with_config(cfg).start().await;
    let node = &fx.node;
    let ep = endpoint_on(node, [127, 0, 0, 1]);
    let mut idle = Vec::new();
    for _ in 0..300 {
        idle.push(dial(&ep, node).await.unwrap());
    }
    let start = std::time::Instant::now();
    let all_closed = eventually(Duration::from_secs(3), || async {
        idle.iter().all(|c| c.close_reason().is_some())
    })
    .await;
    let open = idle.iter().filter(|c| c.close_reason().is_none()).count();
    eprintln!(
        "300 connections without HELLO, deadline 300 ms: {open} still open {:.1} s after the last connected",
        start.elapsed().as_secs_f64()
    );
    assert!(all_closed, "{open} of 300 still open");
    for c in &idle {
        match c.close_reason() {
            Some(quinn::ConnectionError::ApplicationClosed(a)) => {
                assert_eq!(&a.reason[..], b"no HELLO by the deadline")
            }
            other => panic!("closed for another reason: {other:?}"),
        }
    }
    // A well-behaved tenant connects and is served.
    let client = connect(node).await;
    client.inventory().await.unwrap();
    fx.shutdown().await;
}

#[tokio::test]
async fn a_failed_hello_closes_the_connection() {
    // Round 2, attack 2: one connection sent 770,893 wrong tokens in 10 s
    // and was never closed.
    let _one = ONE_AT_A_TIME.lock().await;
    let fx = Fixture::memory(1 << 20).start().await;
    let node = &fx.node;
    let ep = endpoint_on(node, [127, 0, 0, 1]);
    let conn = dial(&ep, node).await.unwrap();
    let first = hello(&conn, "wrong").await;
    assert_eq!(
        first,
        Some((Status::Unauthorized, "invalid token".to_string()))
    );
    // A second try, even with the right token, finds the connection closed.
    let second = hello(&conn, TOKEN).await;
    let closed = closed_within(&conn, Duration::from_secs(3)).await;
    eprintln!("after a failed HELLO: second HELLO {second:?}, connection closed {closed}");
    assert!(closed && second.is_none(), "{second:?}");
    assert!(matches!(
        conn.close_reason(),
        Some(quinn::ConnectionError::ApplicationClosed(a)) if &a.reason[..] == b"HELLO failed"
    ));
    fx.shutdown().await;
}

/// What a [`wrong_token_flood`] has done so far.
#[derive(Debug, Default)]
struct Flood {
    /// Tokens the node checked and found wrong.
    checked: AtomicU64,
    /// HELLOs refused without a check (over the source's allowance).
    unchecked: AtomicU64,
    /// HELLOs sent.
    tries: AtomicU64,
    /// Set by the test: the flood may stop (once `time` has passed).
    enough: AtomicBool,
}

/// Sends wrong tokens from `ip` for `time` and until `flood.enough` is set,
/// dialling again whenever the node closed the connection; counts into
/// `flood` as it goes. Returns how long it ran.
async fn wrong_token_flood(node: &Node, ip: [u8; 4], time: Duration, flood: &Flood) -> Duration {
    let ep = endpoint_on(node, ip);
    let mut conn = dial(&ep, node).await.unwrap();
    let start = std::time::Instant::now();
    while start.elapsed() < time || !flood.enough.load(Ordering::SeqCst) {
        flood.tries.fetch_add(1, Ordering::SeqCst);
        match hello(&conn, "wrong").await {
            Some((Status::Unauthorized, m)) if m == "invalid token" => {
                flood.checked.fetch_add(1, Ordering::SeqCst);
            }
            Some((Status::Unauthorized, _)) => {
                flood.unchecked.fetch_add(1, Ordering::SeqCst);
            }
            Some(other) => panic!("{other:?}"),
            None => {
                let _ = closed_within(&conn, Duration::from_secs(1)).await;
            }
        }
        if conn.close_reason().is_some() {
            conn = dial(&ep, node).await.unwrap();
        }
    }
    start.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_hellos_are_rate_limited_per_source() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut cfg = memory_config(1 << 20);
    cfg.max_failed_hellos_per_source = 5;
    let fx = Fixture::with_config(cfg).start().await;
    let node = &fx.node;
    let flood = Flood::default();
    let attack = wrong_token_flood(node, [127, 0, 0, 2], Duration::from_millis(1500), &flood);
    // A well-behaved tenant from another address connects and is served
    // while the attack goes on: once the attacker's address has spent its
    // allowance (a HELLO of it was refused unchecked), and before the
    // attack stops (it goes on until the tenant is done).
    let tenant = async {
        wait_until(
            Duration::from_secs(10),
            "a HELLO of the attack refused unchecked",
            || async { flood.unchecked.load(Ordering::SeqCst) > 0 },
        )
        .await;
        let t = std::time::Instant::now();
        let c = connect(node).await;
        c.inventory().await.unwrap();
        let served = t.elapsed();
        flood.enough.store(true, Ordering::SeqCst);
        (served, flood.tries.load(Ordering::SeqCst))
    };
    let (ran, (served, tries_when_served)) = tokio::join!(attack, tenant);
    let [checked, unchecked, tries] =
        [&flood.checked, &flood.unchecked, &flood.tries].map(|n| n.load(Ordering::SeqCst));
    eprintln!(
        "wrong tokens from one address for {ran:.1?}: {tries} HELLOs, {checked} checked, \
         {unchecked} refused unchecked; another tenant connected and served in {served:?}, \
         after {tries_when_served} of them"
    );
    // 5 at once, then 5 a second.
    let allowed = 5 + (5.0 * ran.as_secs_f64()).ceil() as u64 + 1;
    assert!(checked <= allowed, "{checked} tokens checked in {ran:?}");
    assert!(unchecked > 0);
    // Served while the flood goes on (it stops only once the tenant is).
    assert!(served < Duration::from_secs(5), "{served:?}");
    fx.shutdown().await;
}

#[tokio::test]
async fn failed_hellos_are_logged_at_most_once_per_interval() {
    // Round 2, attack 2: one WARN line per wrong token, 112 MB of log in
    // 10 s.
    let _one = ONE_AT_A_TIME.lock().await;
    let log = captured_log();
    let mut cfg = memory_config(1 << 20);
    // Every token checked: the log's own limit is what is tested here.
    cfg.max_failed_hellos_per_source = 100_000;
    let fx = Fixture::with_config(cfg).start().await;
    let node = &fx.node;
    let lines = || {
        String::from_utf8_lossy(&log.lock().unwrap())
            .lines()
            .filter(|l| l.contains("rejected credentials"))
            .count()
    };
    let before = lines();
    let ep = endpoint_on(node, [127, 0, 0, 5]);
    let mut conn = dial(&ep, node).await.unwrap();
    let mut failed = 0;
    while failed < 200 {
        match hello(&conn, "wrong").await {
            Some((Status::Unauthorized, _)) => failed += 1,
            Some(other) => panic!("{other:?}"),
            None => conn = dial(&ep, node).await.unwrap(),
        }
    }
    let logged = lines() - before;
    eprintln!("200 wrong tokens: {logged} log lines");
    assert!((1..=2).contains(&logged), "{logged} lines");
    fx.shutdown().await;
}
