//! Attacks on the node from the hardening issue, one test each, against a
//! real node on loopback with the in-memory device. Memory is the node's
//! (it runs in this process): peak VmRSS sampled every millisecond while
//! the attack runs. The tests take turns so that one's allocations do not
//! show in another's figure.

#[path = "../common/mod.rs"]
mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use cuda_lease::client::{ErrorKind, Lease};
use cuda_lease::proto::{self, Header, Opcode, Status};
use cuda_lease_node::node::Node;

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test]
async fn unauthenticated_payloads_are_never_read_or_allocated() {
    let _one = ONE_AT_A_TIME.lock().await;
    // 8 streams of a connection that never authenticated, each declaring a
    // 512 MiB payload and sending 64 MiB: the node refuses each on its
    // header and reads nothing declared.
    let fx = Fixture::node_path(1 << 20).start().await;
    let node = &fx.node;
    let peak = PeakRss::start();
    let chunk = vec![0x41u8; 1 << 20];
    let mut tasks = Vec::new();
    for i in 0..8u64 {
        let (mut send, mut recv) = attacker_conn(node).await;
        let chunk = chunk.clone();
        tasks.push(tokio::spawn(async move {
            let op = if i % 2 == 0 {
                Opcode::Batch
            } else {
                Opcode::Hello
            };
            let h = Header::request(op, i, 16, 512 << 20);
            let mut sent = 0usize;
            let write = async {
                proto::write_frame(&mut send, &h, &[0u8; 16], &[]).await?;
                while sent < 64 << 20 {
                    tokio::io::AsyncWriteExt::write_all(&mut send, &chunk).await?;
                    sent += chunk.len();
                }
                Ok::<(), std::io::Error>(())
            };
            let _ = tokio::time::timeout(Duration::from_secs(10), write).await;
            let reply = tokio::time::timeout(
                Duration::from_secs(10),
                proto::read_frame(&mut recv, &proto::Limits::default()),
            )
            .await;
            (
                sent,
                reply.ok().and_then(|r| r.ok()).map(|f| f.header.status),
            )
        }));
    }
    for t in tasks {
        let (sent, status) = t.await.unwrap();
        assert_eq!(status, Some(Status::Unauthorized), "sent {sent} bytes");
        assert!(sent < 64 << 20, "the node read a whole refused payload");
    }
    let grown = peak.stop();
    eprintln!("RSS peak growth {} KiB", grown / 1024);
    assert!(grown < 48 << 20, "RSS grew by {grown} bytes");
    // The node still serves a well-behaved client.
    let client = connect(node).await;
    assert_eq!(client.inventory().await.unwrap().active_leases, 0);
    fx.shutdown().await;
}

/// A BATCH body of `n` three-byte commands (stream 0, `Record` (variant
/// 5) of event 1) for `lease`.
fn huge_batch_body(lease: proto::LeaseId, n: u32) -> Vec<u8> {
    let mut body = proto::to_body(&proto::Batch {
        lease,
        seq: 0,
        modules: vec![],
        commands: vec![],
    });
    body.pop(); // the empty list's length prefix
    let mut len = n;
    loop {
        let b = (len & 0x7f) as u8;
        len >>= 7;
        if len == 0 {
            body.push(b);
            break;
        }
        body.push(b | 0x80);
    }
    for _ in 0..n {
        body.extend_from_slice(&[0, 5, 1]);
    }
    body
}

#[tokio::test]
async fn batches_are_refused_on_their_op_count_before_decoding() {
    let _one = ONE_AT_A_TIME.lock().await;
    // Attack 3: a BATCH of 1,000,000 one-byte ops was decoded in full (96
    // bytes each, 104 MB) before the 4,096-op limit refused it.
    let fx = Fixture::node_path(1 << 20).lease(4096).start().await;
    let (client, lease) = (fx.client(), fx.lease());
    let body = Arc::new(huge_batch_body(lease.id(), 300_000));
    assert!(body.len() < 1 << 20, "fits the node's body limit");
    let decoded = proto::from_body::<proto::Batch<'_>>(&body);
    assert!(decoded.is_err(), "300,000 commands must not decode");
    let peak = PeakRss::start();
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (client, body) = (client.clone(), body.clone());
        // (the body is shared: what grows is the node's memory and quinn's)
        tasks.push(tokio::spawn(async move {
            client.request(Opcode::Batch, &body, &[]).await
        }));
    }
    for t in tasks {
        match t.await.unwrap() {
            Err(ref e) if matches!(e.kind(), ErrorKind::Protocol) => {}
            other => panic!("expected a protocol error (MALFORMED), got {other:?}"),
        }
    }
    let grown = peak.stop();
    eprintln!("RSS peak growth {} KiB", grown / 1024);
    assert!(grown < 64 << 20, "RSS grew by {grown} bytes");
    // 4096 commands still decode and run.
    let ok = huge_batch_body(lease.id(), 4096);
    client.request(Opcode::Batch, &ok, &[]).await.unwrap();
    fx.free_and_shutdown().await;
}

#[tokio::test]
async fn leases_per_principal_and_per_node_are_limited() {
    // Attack 4: 100 one-byte leases were granted in 120 ms, each with its
    // own worker process (3 -> 103 processes).
    let _one = ONE_AT_A_TIME.lock().await;
    let mut cfg = node_path_config(1 << 20);
    cfg.max_leases_per_principal = 4;
    cfg.max_leases = 6;
    cfg.tokens = vec!["t1".into(), "t2".into()];
    let fx = Fixture::with_config(cfg).start().await;
    let node = &fx.node;
    let a = connect_as(node, "t1").await;
    let b = connect_as(node, "t2").await;
    let lease =
        |c: &Arc<cuda_lease::Client>| Lease::builder().min_vram(1).auto_renew(false).on(c.clone());
    let mut held = Vec::new();
    let mut refused = 0;
    for _ in 0..100 {
        match lease(&a).await {
            Ok(l) => held.push(l),
            Err(e) if e.kind() == ErrorKind::Capacity => {
                let m = e.message();
                assert!(m.contains("token-1") && m.contains("limit"), "{m}");
                refused += 1;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!((held.len(), refused), (4, 96));
    // The other principal gets the node's remaining two, then the node's limit.
    held.push(lease(&b).await.unwrap());
    held.push(lease(&b).await.unwrap());
    match lease(&b).await {
        Err(e) if e.kind() == ErrorKind::Capacity => {
            let m = e.message();
            assert!(m.contains("node"), "{m}")
        }
        other => panic!("expected the node's limit, got {other:?}"),
    }
    // Freeing one makes room again.
    held.pop().unwrap().free().await.unwrap();
    held.push(lease(&b).await.unwrap());
    for l in held {
        l.free().await.unwrap();
    }
    fx.shutdown().await;
}

#[tokio::test]
async fn module_bytes_count_against_the_reservation() {
    // Attack 5: 64 modules of 1 MiB loaded into a 1-byte lease, which still
    // reported 0 bytes allocated.
    let _one = ONE_AT_A_TIME.lock().await;
    let fx = Fixture::node_path(16 << 20).client().start().await;
    let client = fx.client();
    let mut ptx = String::from(
        ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry k()\n{\n ret;\n}\n",
    );
    while ptx.len() < 1 << 20 {
        ptx.push_str("// padding padding padding padding padding padding padding\n");
    }
    let tiny = lease_of(client, 1).await;
    match tiny.session().load_module(&ptx).await {
        Err(ref e) if matches!(e.kind(), ErrorKind::Capacity) => {}
        other => panic!("a 1 MiB module fit a 1-byte lease: {other:?}"),
    }
    let lease = lease_of(client, 3 << 20).await;
    let s = lease.session();
    // Modules are content: the same text twice is loaded and charged once,
    // each different text once more.
    let variant = |i: usize| format!("{ptx}// variant {i}\n");
    let _m1 = s.load_module(&variant(1)).await.unwrap();
    let _m1_again = s.load_module(&variant(1)).await.unwrap();
    let after_one = lease.query().await.unwrap().allocated;
    assert!((1 << 20..2 << 20).contains(&after_one), "{after_one}");
    let _m2 = s.load_module(&variant(2)).await.unwrap();
    assert!(matches!(
        s.load_module(&variant(3)).await,
        Err(ref e) if matches!(e.kind(), ErrorKind::Capacity)
    ));
    assert!(lease.query().await.unwrap().allocated >= 2 << 20);
    tiny.free().await.unwrap();
    lease.free().await.unwrap();
    fx.shutdown().await;
}

#[tokio::test]
async fn replies_nobody_reads_are_dropped_after_the_reply_timeout() {
    // Attack 6: a GPU_SUBMIT with a 64 MiB output whose reply was never
    // read held 262 MB of the node for 80 s, past the idle timeout.
    let _one = ONE_AT_A_TIME.lock().await;
    let mut cfg = node_path_config(256 << 20);
    cfg.reply_timeout = Duration::from_secs(1);
    let fx = Fixture::with_config(cfg).start().await;
    let node = &fx.node;
    let conn = raw_authed_conn(node).await;
    let before = rss_bytes();
    let ptx = ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry k()\n{\n ret;\n}\n";
    let mut unread = Vec::new();
    for i in 0..4u64 {
        let req = proto::GpuSubmit {
            kernel: "k".into(),
            grid: [1, 1, 1],
            block: [1, 1, 1],
            shared_mem: 0,
            args: vec![],
            ptx_len: ptx.len() as u32,
            input_lens: vec![],
            output_size: 64 << 20,
            output_fill: 0x55,
        };
        let body = proto::to_body(&req);
        let (mut send, recv) = conn.open_bi().await.unwrap();
        let h = Header::request(
            Opcode::GpuSubmit,
            10 + i,
            body.len() as u32,
            ptx.len() as u32,
        );
        proto::write_frame(&mut send, &h, &body, ptx.as_bytes())
            .await
            .unwrap();
        send.finish().unwrap();
        unread.push(recv); // never read
    }
    // The four replies exist (the node counts their bytes once made)...
    assert!(
        eventually(Duration::from_secs(20), || async {
            metric(&node.metrics_text(), "gpu_submit_output_bytes_total") >= Some(4 * (64 << 20))
        })
        .await,
        "the four 64 MiB replies were never made"
    );
    // ...and are dropped at the reply timeout (1 s): the node resets each
    // one's stream, which shows here without reading a byte of it (the
    // attack held them for 80 s; 20 s is for a loaded 2-core machine).
    let start = std::time::Instant::now();
    for (i, r) in unread.iter_mut().enumerate() {
        let reset = tokio::time::timeout(Duration::from_secs(20), r.received_reset())
            .await
            .unwrap_or_else(|_| panic!("unread reply {i} was not dropped within 20 s"));
        assert_eq!(reset, Ok(Some(0u32.into())), "unread reply {i}");
    }
    let dropped = start.elapsed();
    // Their memory went with them: the node drops a reply as it resets its
    // stream (polled briefly, for the allocator to give the pages back).
    wait_until(
        Duration::from_secs(5),
        "RSS under +48 MiB once the unread replies were reset",
        || async { rss_bytes().saturating_sub(before) < 48 << 20 },
    )
    .await;
    eprintln!(
        "4 unread 64 MiB replies reset {:.1} s after they were made; RSS then +{} KiB",
        dropped.as_secs_f64(),
        rss_bytes().saturating_sub(before) / 1024
    );
    // The node still serves.
    let client = connect(node).await;
    client.inventory().await.unwrap();
    fx.shutdown().await;
}

#[tokio::test]
async fn one_tenants_hanging_submits_do_not_delay_another_tenant() {
    // Attack 7: two GPU_SUBMITs that never finish delayed another tenant's
    // GET_INVENTORY and GPU_SUBMIT by 9.5 s (the op timeout): the two
    // shared submit workers also served the inventory.
    let _one = ONE_AT_A_TIME.lock().await;
    let mut cfg = node_path_config(1 << 20);
    cfg.submit_workers = 2;
    // Twice the 2.5 s the other tenant's requests are allowed below, so a
    // request held up by a hang (for the op timeout) fails the test.
    cfg.op_timeout = Duration::from_secs(5);
    cfg.tokens = vec!["ta".into(), "tb".into()];
    let fx = Fixture::with_config(cfg).start().await;
    let node = &fx.node;
    let a = connect_as(node, "ta").await;
    let b = connect_as(node, "tb").await;
    let ptx = ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry __hang()\n{\n ret;\n}\n.visible .entry k()\n{\n ret;\n}\n";
    let hang = cuda_lease::GpuCall::new(ptx, "__hang", 1, 1, 4);
    let mut hung = Vec::new();
    for _ in 0..2 {
        let (a, hang) = (a.clone(), hang.clone());
        hung.push(tokio::spawn(async move { a.gpu_call(&hang).await }));
    }
    // The hang holds a submit worker before the other tenant asks (the
    // node counts a GPU_SUBMIT once it has its turn and runs it).
    assert!(
        eventually(Duration::from_secs(10), || async {
            metric(&node.metrics_text(), "gpu_submit_total") >= Some(1)
        })
        .await,
        "the hanging submits never reached the node"
    );
    let t = std::time::Instant::now();
    b.inventory().await.unwrap();
    let inventory = t.elapsed();
    let t = std::time::Instant::now();
    let out = b
        .gpu_call(&cuda_lease::GpuCall::new(ptx, "k", 1, 1, 4))
        .await
        .unwrap();
    let submit = t.elapsed();
    eprintln!("other tenant: inventory {inventory:?}, submit {submit:?}");
    assert_eq!(out.len(), 4);
    assert!(inventory < Duration::from_millis(2500), "{inventory:?}");
    assert!(submit < Duration::from_millis(2500), "{submit:?}");
    // The hanging tenant's submits fail after the op timeout, one after the
    // other (the second waited for the first's turn).
    for h in hung {
        assert!(h.await.unwrap().is_err());
    }
    fx.shutdown().await;
}

/// Log lines the node writes, captured (the first test that asks installs
/// the subscriber for this test binary).
fn captured_log() -> Arc<std::sync::Mutex<Vec<u8>>> {
    static LOG: std::sync::OnceLock<Arc<std::sync::Mutex<Vec<u8>>>> = std::sync::OnceLock::new();
    LOG.get_or_init(|| {
        let buf: Arc<std::sync::Mutex<Vec<u8>>> = Arc::default();
        let sink = buf.clone();
        let _ = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || LogSink(sink.clone()))
            .try_init();
        buf
    })
    .clone()
}

struct LogSink(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for LogSink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn client_strings_cannot_forge_log_lines() {
    // Attack 8: a client name with a newline and an ANSI escape wrote a
    // forged line into the node's log.
    let _one = ONE_AT_A_TIME.lock().await;
    let log = captured_log();
    let fx = Fixture::node_path(1 << 20).start().await;
    let node = &fx.node;
    let evil = "x\n2026-01-01T00:00:00Z  INFO cuda_lease_node::node: FORGED lease granted\x1b[31m";
    for token in ["wrong", TOKEN] {
        let mut cfg = client_config(node).token(token);
        cfg.client_name = evil.into();
        let _ = cuda_lease::Client::connect(node.addr(), &cfg).await;
    }
    fx.shutdown().await;
    let text = String::from_utf8_lossy(&log.lock().unwrap()).into_owned();
    assert!(text.contains("rejected credentials"), "{text}");
    assert!(
        text.contains("FORGED"),
        "the client name is logged (escaped): {text}"
    );
    for line in text.lines() {
        // The name stays inside its own line, escaped.
        assert!(
            !line.starts_with("2026-01-01T00:00:00Z"),
            "forged line: {line:?}"
        );
    }
    assert!(!text.contains('\x1b'), "a raw escape reached the log");
}

/// A BATCH header on a new stream of `conn` declaring 128 MiB of data
/// (more than the tests' byte budget), then 16 bytes of body; the reply.
async fn declare_128_mib(conn: &quinn::Connection, id: u64) -> proto::Frame {
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let h = Header::request(Opcode::Batch, id, 16, 128 << 20);
    proto::write_frame(&mut send, &h, &[0u8; 16], &[])
        .await
        .unwrap();
    proto::read_frame(&mut recv, &proto::Limits::default())
        .await
        .unwrap()
}

#[tokio::test]
async fn requests_and_bytes_in_flight_are_limited_per_principal() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut cfg = node_path_config(1 << 20);
    cfg.max_requests_per_principal = 64;
    cfg.max_bytes_per_principal = 100 << 20;
    let fx = Fixture::with_config(cfg).start().await;
    let node = &fx.node;
    let conn = raw_authed_conn(node).await;
    // A request declaring more than the principal's byte budget is refused
    // on its header.
    let peak = PeakRss::start();
    let f = declare_128_mib(&conn, 1).await;
    assert_eq!(f.header.status, Status::CapacityExceeded);
    // Stalled requests (a header declaring 1 MiB, then nothing) hold the
    // principal's turns: of 80, the 16 past its 64 turns are refused at
    // once (without their data), the others wait for their data.
    let mut sends = Vec::new();
    let mut replies = tokio::task::JoinSet::new();
    for i in 0..80u64 {
        let (mut send, mut recv) = conn.open_bi().await.unwrap();
        let h = Header::request(Opcode::Batch, 100 + i, 16, 1 << 20);
        proto::write_frame(&mut send, &h, &[0u8; 16], &[])
            .await
            .unwrap();
        sends.push(send);
        replies.spawn(async move {
            proto::read_frame(&mut recv, &proto::Limits::default())
                .await
                .map(|f| f.header.status)
        });
    }
    // The refusals come (a stalled request would only be answered at the
    // node's 60 s read timeout)...
    let mut refused = 0;
    while refused < 16 {
        match tokio::time::timeout(Duration::from_secs(10), replies.join_next()).await {
            Ok(Some(Ok(Ok(Status::CapacityExceeded)))) => refused += 1,
            Ok(other) => panic!("unexpected reply {other:?}"),
            Err(_) => panic!("{refused} of 80 requests refused: none more within 10 s"),
        }
    }
    // ...and the node holds the other 64: asked by a request over the
    // whole byte budget (refused on its header, taking no turn), it counts
    // the principal's requests in flight.
    let f = declare_128_mib(&conn, 999).await;
    assert_eq!(f.header.status, Status::CapacityExceeded);
    let why = proto::from_body::<proto::ErrorBody>(&f.body)
        .unwrap()
        .message;
    let stalled = replies.len();
    assert!(
        replies.try_join_next().is_none(),
        "a stalled request was answered"
    );
    eprintln!(
        "stalled {stalled}, refused {refused}, RSS +{} KiB; the node: {why}",
        peak.stop() / 1024
    );
    assert_eq!((stalled, refused), (64, 16));
    assert!(why.contains(" has 64 requests in flight"), "{why}");
    drop((replies, sends));
    conn.close(0u32.into(), b"done");
    // Turns come back with the streams; a well-behaved client is served.
    // Nothing shows when the node has seen the streams end, so its
    // requests are refused (over the limit) until then.
    let client = connect(node).await;
    wait_until(
        Duration::from_secs(10),
        "a request of the principal served after its stalled streams ended",
        || async {
            match client.inventory().await {
                Ok(_) => true,
                Err(e) if matches!(e.kind(), ErrorKind::Capacity) => false,
                Err(e) => panic!("{e}"),
            }
        },
    )
    .await;
    fx.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_hundred_connections_and_32_clients_times_1000_requests_lose_nothing() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut cfg = node_path_config(64 << 20);
    cfg.max_leases_per_principal = 32;
    // 500 connecting at once from one address: more than the default caps
    // on connections waiting for HELLO.
    cfg.max_unauthenticated = 1024;
    cfg.max_unauthenticated_per_source = 1024;
    // 500 TLS handshakes at once take longer than the default HELLO
    // deadline on a 2-core machine in a debug build.
    cfg.hello_timeout = Duration::from_secs(60);
    // 500 handshakes' first datagrams at once overflow the default socket
    // buffer; each lost one costs its client a retransmission timeout.
    cfg.transport = cuda_lease::TransportSettings {
        socket_receive_buffer: Some(8 << 20),
        ..cuda_lease::TransportSettings::default()
    };
    let fx = Fixture::with_config(cfg).start().await;
    let node = &fx.node;
    let t = std::time::Instant::now();
    // 500 connections at once, each authenticated and served.
    let mut tasks = Vec::new();
    for _ in 0..500 {
        // 500 handshakes at once take more than the default connect
        // timeout in a debug build on 2 cores; none may be lost.
        let cfg = client_config(node).connect_timeout(Duration::from_secs(120));
        let addr = node.addr();
        tasks.push(tokio::spawn(async move {
            let c = cuda_lease::Client::connect(addr, &cfg).await?;
            c.inventory().await.map(|_| c)
        }));
    }
    let mut conns = Vec::new();
    for t in tasks {
        conns.push(t.await.unwrap().expect("a connection was refused or lost"));
    }
    assert_eq!(conns.len(), 500);
    eprintln!("500 connections authenticated in {:?}", t.elapsed());
    drop(conns);
    // 32 clients x 1000 requests, each answered with the right lease.
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let client = connect(node).await;
        tasks.push(tokio::spawn(async move {
            let lease = lease_of(&client, 4096).await;
            for _ in 0..1000 {
                let st = lease.query().await.unwrap();
                assert_eq!(st.lease, lease.id());
            }
            lease.free().await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    fx.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_thousand_fuzzed_frames_then_a_good_client_is_served() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut cfg = node_path_config(1 << 20);
    // Garbage within the HELLO deadline (which has its own test).
    cfg.hello_timeout = Duration::from_secs(120);
    let fx = Fixture::with_config(cfg).start().await;
    let node = &fx.node;
    let authed = raw_authed_conn(node).await;
    let next = Arc::new(AtomicU64::new(0));
    let undecodable = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for w in 0..32u64 {
        let (next, undecodable) = (next.clone(), undecodable.clone());
        // Half the workers share an authenticated connection, half have
        // their own unauthenticated one (a new one after a failed HELLO,
        // which closes it).
        let unauthed = (w % 2 == 1).then(|| endpoint_on(node, [127, 0, 0, 1]));
        let mut conn = match &unauthed {
            None => authed.clone(),
            Some(ep) => dial(ep, node).await.unwrap(),
        };
        let addr = node.addr();
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= 20_000 {
                    break;
                }
                // xorshift from the frame number: reproducible.
                let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                let mut rnd = move || {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x
                };
                let body: Vec<u8> = (0..rnd() % 200).map(|_| rnd() as u8).collect();
                let data: Vec<u8> = (0..rnd() % 3000).map(|_| rnd() as u8).collect();
                let mut h = Header::request(Opcode::Hello, i, body.len() as u32, data.len() as u32)
                    .encode();
                h[5] = (rnd() % 20) as u8; // any opcode byte, valid or not
                let Ok((mut send, mut recv)) = conn.open_bi().await else {
                    break;
                };
                let _ = send.write_all(&h).await;
                let _ = send.write_all(&body).await;
                let _ = send.write_all(&data).await;
                let _ = send.finish();
                let reply = tokio::time::timeout(
                    Duration::from_secs(20),
                    proto::read_frame(&mut recv, &proto::Limits::default()),
                )
                .await;
                if !matches!(reply, Ok(Ok(_))) {
                    undecodable.fetch_add(1, Ordering::Relaxed);
                }
                if let Some(ep) = &unauthed {
                    if h[5] == Opcode::Hello as u8 {
                        let _ = tokio::time::timeout(Duration::from_secs(5), conn.closed()).await;
                        conn = ep.connect(addr, "localhost").unwrap().await.unwrap();
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    eprintln!(
        "20000 fuzzed frames, {} without a decodable reply",
        undecodable.load(Ordering::Relaxed)
    );
    assert_eq!(undecodable.load(Ordering::Relaxed), 0);
    // A well-behaved client is served.
    let client = connect(node).await;
    let lease = lease_of(&client, 4096).await;
    let s = lease.session();
    let buf = s.alloc(8).await.unwrap();
    s.write(&buf, 0, b"survived").await.unwrap();
    assert_eq!(s.read(&buf, 0, 8).await.unwrap(), b"survived");
    drop(buf);
    lease.free().await.unwrap();
    fx.shutdown().await;
}

mod budgets;
mod hellos;
