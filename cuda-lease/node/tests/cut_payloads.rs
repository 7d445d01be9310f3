//! Requests whose payload is cut off: clients declare a large BATCH
//! payload, send part of it and disconnect. The node must give back what
//! each such request held, and its memory must level off over rounds of
//! them. Memory is the node's: it runs in this process, with the clients,
//! whose payload is one buffer shared by all.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use cuda_lease::proto::{self, Header, Opcode, Status};
use cuda_lease_node::node::Node;

/// The tests take turns: one's payloads would show in the other's RSS.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The data a cut-off BATCH declares.
const DECLARED: usize = 64 << 20;
/// Clients cut off at once, per round.
const CLIENTS: usize = 5;
const ROUNDS: usize = 10;
/// The principal's byte budget: one round's cut-off requests fit.
const BUDGET: u64 = (CLIENTS * DECLARED) as u64 + (32 << 20);

/// What client `k` of round `r` sends before it disconnects: 1/16 to 15/16
/// of the declared data, half on average (a transfer breaks anywhere).
fn cut_at(r: usize, k: usize) -> usize {
    DECLARED / 16 * (1 + (r * CLIENTS + k) * 7 % 15)
}

/// A QUIC client endpoint that trusts the node. Its connections time out
/// after 3 s without packets (the node's own limit is longer; the
/// shorter one holds): a connection whose close the node never got ends
/// there, not after a minute. A live connection sends keep-alives.
fn endpoint(node: &Node) -> quinn::Endpoint {
    let mut transport = quinn::TransportConfig::default();
    transport.max_idle_timeout(Some(Duration::from_secs(3).try_into().unwrap()));
    transport.keep_alive_interval(Some(Duration::from_millis(500)));
    endpoint_with(node, [127, 0, 0, 1], Some(transport))
}

/// A new connection from `ep`, authenticated with the test token.
async fn authed(ep: &quinn::Endpoint, node: &Node) -> quinn::Connection {
    let conn = ep.connect(node.addr(), "localhost").unwrap().await.unwrap();
    let body = proto::to_body(&proto::Hello {
        token: TOKEN.into(),
        client: "cut payloads test".into(),
    });
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let h = Header::request(Opcode::Hello, 1, body.len() as u32, 0);
    proto::write_frame(&mut send, &h, &body, &[]).await.unwrap();
    send.finish().unwrap();
    let f = proto::read_frame(&mut recv, &proto::Limits::default())
        .await
        .unwrap();
    assert_eq!(f.header.status, Status::Ok);
    conn
}

/// Whether the node holds nothing for the test principal's requests, as
/// it says when refusing, on its header, a request declaring more than
/// the principal's whole budget ("principal P has N bytes in flight; ..."
/// or, while its turns are what is full, "... has N requests in flight").
async fn nothing_in_flight(conn: &quinn::Connection) -> bool {
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let over = u32::try_from(BUDGET + (16 << 20)).unwrap();
    let h = Header::request(Opcode::Batch, 7, 16, over);
    proto::write_frame(&mut send, &h, &[0u8; 16], &[])
        .await
        .unwrap();
    let f = proto::read_frame(&mut recv, &proto::Limits::default())
        .await
        .unwrap();
    assert_eq!(f.header.status, Status::CapacityExceeded);
    let msg = proto::from_body::<proto::ErrorBody>(&f.body)
        .unwrap()
        .message;
    assert!(msg.contains(" in flight"), "unexpected refusal: {msg}");
    msg.contains(" has 0 bytes in flight")
}

/// One client: the BATCH `batch`, declaring `DECLARED` bytes of data of
/// which it sends `sent` (from the shared `payload`); then it closes its
/// connection.
async fn cut_off(conn: quinn::Connection, batch: Arc<Vec<u8>>, payload: Arc<Vec<u8>>, sent: usize) {
    let (mut send, _recv) = conn.open_bi().await.unwrap();
    let h = Header::request(Opcode::Batch, 100, batch.len() as u32, DECLARED as u32);
    proto::write_frame(&mut send, &h, &batch, &payload[..sent])
        .await
        .unwrap();
    conn.close(0u32.into(), b"cut off");
}

/// malloc's own figures (glibc): what is in use, and what it keeps free in
/// its arenas (freed, not given back to the system).
fn malloc_figures() -> String {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 only reads malloc's statistics.
        let m = unsafe { libc::mallinfo2() };
        format!(
            "malloc: {} MiB in use, {} MiB free in its arenas, {} MiB mapped",
            m.uordblks >> 20,
            m.fordblks >> 20,
            m.hblkhd >> 20
        )
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    String::new()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_after_cut_payloads_levels_off() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut cfg = node_path_config(256 << 20);
    cfg.max_bytes_per_principal = BUDGET;
    let fx = Fixture::with_config(cfg)
        .lease(DECLARED as u64)
        .start()
        .await;
    let (node, lease) = (&fx.node, fx.lease());
    // The batch every client sends: a write of the whole declared data
    // into a buffer of the lease.
    let buf = proto::Id(1);
    let batch = |op| {
        proto::to_body(&proto::Batch {
            lease: lease.id(),
            seq: 0,
            modules: vec![],
            commands: vec![proto::Command { stream: 0, op }],
        })
    };
    let size = DECLARED as u64;
    let alloc = batch(proto::Op::Alloc { buf, size });
    fx.client()
        .request(Opcode::Batch, &alloc, &[])
        .await
        .unwrap();
    let len = DECLARED as u64;
    let write = Arc::new(batch(proto::Op::Write {
        buf,
        offset: 0,
        len,
    }));
    let payload = Arc::new(vec![0x5au8; DECLARED / 16 * 15]);
    let ep = endpoint(node);
    let probe = authed(&ep, node).await;
    let start = Instant::now();
    let mut rss = Vec::new();
    for round in 0..ROUNDS {
        let mut clients = Vec::new();
        for k in 0..CLIENTS {
            let conn = authed(&ep, node).await;
            let sent = cut_at(round, k);
            clients.push(tokio::spawn(cut_off(
                conn,
                write.clone(),
                payload.clone(),
                sent,
            )));
        }
        for c in clients {
            c.await.unwrap();
        }
        // Settled: every byte the cut-off requests held is given back.
        let t = Instant::now();
        wait_until(
            Duration::from_secs(20),
            "the cut-off requests' bytes given back",
            || nothing_in_flight(&probe),
        )
        .await;
        let settled = t.elapsed();
        let now = rss_bytes();
        eprintln!(
            "round {:>2} ({:>5.1?}): RSS {:>4} MiB, settled in {settled:.1?}; {}",
            round + 1,
            start.elapsed(),
            now >> 20,
            malloc_figures()
        );
        rss.push(now);
    }
    let mib: Vec<_> = rss.iter().map(|r| r >> 20).collect();
    eprintln!("RSS per round (MiB): {mib:?}");
    let last = &rss[ROUNDS - 5..];
    // (with the payloads grown by doubling: 34 to 50 MiB on a 2-core
    // machine, freed memory piling up in malloc's arenas; 5 to 8 MiB
    // with them read into one block of the declared length)
    let spread = last.iter().max().unwrap() - last.iter().min().unwrap();
    assert!(
        spread <= 16 << 20,
        "RSS moved by {} MiB over the last 5 rounds: {mib:?}",
        spread >> 20
    );
    // The lease is untouched and still served.
    assert_eq!(node.lease_usage(&lease.id()).unwrap().buffers, 1);
    probe.close(0u32.into(), b"done");
    fx.free_and_shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_that_stops_arriving_is_dropped_at_the_stall_timeout() {
    let _one = ONE_AT_A_TIME.lock().await;
    // A client that stops sending in the middle of a payload, its
    // connection alive: the request held its bytes until the 60 s limit
    // on the whole payload (or until the connection's idle timeout, for a
    // client gone without its close reaching the node).
    let mut cfg = node_path_config(64 << 20);
    // Long enough for the probe below to see the bytes held before they
    // are dropped, on a loaded machine too.
    cfg.payload_stall_timeout = Duration::from_secs(3);
    cfg.max_bytes_per_principal = BUDGET;
    let fx = Fixture::with_config(cfg).start().await;
    let node = &fx.node;
    let ep = endpoint(node);
    let probe = authed(&ep, node).await;
    let conn = authed(&ep, node).await;
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let h = Header::request(Opcode::Batch, 100, 16, DECLARED as u32);
    let part = vec![0x5au8; DECLARED / 4];
    proto::write_frame(&mut send, &h, &[0u8; 16], &part)
        .await
        .unwrap();
    wait_until(
        Duration::from_secs(10),
        "the payload's bytes taken",
        || async { !nothing_in_flight(&probe).await },
    )
    .await;
    let t = Instant::now();
    wait_until(
        Duration::from_secs(10),
        "the stalled payload dropped",
        || nothing_in_flight(&probe),
    )
    .await;
    let f = proto::read_frame(&mut recv, &proto::Limits::default())
        .await
        .unwrap();
    let msg = proto::from_body::<proto::ErrorBody>(&f.body)
        .unwrap()
        .message;
    eprintln!(
        "a payload stalled after {} of {} MiB, stall timeout 3 s: dropped {:?} after its \
         bytes were seen held; the client read: {msg}",
        part.len() >> 20,
        DECLARED >> 20,
        t.elapsed()
    );
    assert!(msg.contains("no data for"), "{msg}");
    // The connection is alive and served.
    assert!(conn.close_reason().is_none());
    assert!(nothing_in_flight(&conn).await);
    drop(send);
    probe.close(0u32.into(), b"done");
    fx.shutdown().await;
}
