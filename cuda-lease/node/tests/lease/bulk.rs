//! The bulk-data channel (large MEM_WRITE / MEM_READ over TLS on TCP):
//! transfers on it are byte-exact and counted by the node, a node or client
//! with it off keeps them on QUIC, a ticket opens one connection once and
//! only for its own principal, and a refused request leaves the connection
//! working. In-memory device, no GPU.

use std::sync::Arc;

use crate::common::*;
use cuda_lease::client::{BulkUse, Client, ErrorKind, Session};
use cuda_lease::proto::{
    self, from_body, to_body, BulkOpen, BulkTickets, Header, Limits, MemRead, Opcode, Status,
};
use cuda_lease_node::node::{BulkListen, Node};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The node's chunk: one slot of its ring with a worker.
const CHUNK: usize = 2 << 20;

/// The node's bulk-data counters: (connections, bytes).
fn bulk_counts(node: &Node) -> (u64, u64) {
    let t = node.metrics_text();
    (
        metric(&t, "gpu_bulk_connections_total").expect("gpu_bulk_connections_total"),
        metric(&t, "gpu_bulk_data_bytes_total").expect("gpu_bulk_data_bytes_total"),
    )
}

/// A client with `stripes` stripes from 1 MiB up, the bulk channel for
/// `bulk`, on `node`.
async fn client(node: &Node, stripes: usize, bulk: BulkUse) -> Arc<Client> {
    let cfg = client_config(node).stripes(stripes, 1 << 20).bulk(bulk);
    Arc::new(Client::connect(node.addr(), &cfg).await.expect("connect"))
}

/// Writes `n` random bytes at an odd offset of a fresh buffer and reads
/// them back; checks they match.
async fn write_read(s: &Session, n: usize, seed: u64) {
    let offset = 3u64;
    let buf = s.alloc(n as u64 + 7).await.expect("alloc");
    let bytes = random_bytes(n, seed);
    s.write(&buf, offset, &bytes).await.expect("write");
    let back = s.read(&buf, offset, n as u32).await.expect("read");
    assert!(
        back == bytes,
        "{n} bytes at offset {offset} came back changed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_on_the_bulk_channel_are_byte_exact_and_counted() {
    let fx = Fixture::memory(1 << 30).start().await;
    assert!(
        fx.node.bulk_addr().is_some(),
        "the channel is on by default"
    );
    for (stripes, bulk, ways) in [
        (1, BulkUse::All, 2),
        (4, BulkUse::All, 2),
        (4, BulkUse::Uploads, 1),
    ] {
        let c = client(&fx.node, stripes, bulk).await;
        let lease = lease_of(&c, 256 << 20).await;
        let s = lease.session();
        for (i, n) in [1 << 20, CHUNK - 1, CHUNK + 1, (64 << 20) + 123]
            .into_iter()
            .enumerate()
        {
            let before = bulk_counts(&fx.node).1;
            write_read(&s, n, i as u64).await;
            let moved = bulk_counts(&fx.node).1 - before;
            assert_eq!(
                moved,
                ways * n as u64,
                "{n} bytes over the channel {ways} ways, {stripes} stripes, {bulk:?}"
            );
        }
        // Below the threshold a transfer stays on QUIC.
        let before = bulk_counts(&fx.node).1;
        write_read(&s, (1 << 20) - 1, 9).await;
        assert_eq!(
            bulk_counts(&fx.node).1,
            before,
            "small transfers stay on QUIC"
        );
    }
    let (conns, _) = bulk_counts(&fx.node);
    assert!(
        (3..=9).contains(&conns),
        "one connection for one stripe, four for four, pooled between transfers: {conns}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_only_downloads_large_enough_to_stripe_take_the_channel() {
    let fx = Fixture::memory(1 << 30).start().await;
    let cfg = client_config(&fx.node).stripes(4, 16 << 20);
    assert_eq!(cfg.bulk, BulkUse::Large);
    let c = Arc::new(
        Client::connect(fx.node.addr(), &cfg)
            .await
            .expect("connect"),
    );
    let lease = lease_of(&c, 256 << 20).await;
    // The write each time, the read only at 16 MiB and up.
    for (n, ways) in [(CHUNK + 1, 1), ((16 << 20) + 5, 2)] {
        let before = bulk_counts(&fx.node).1;
        write_read(&lease.session(), n, 3).await;
        let moved = bulk_counts(&fx.node).1 - before;
        assert_eq!(moved, ways * n as u64, "{n} bytes over the channel");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_channel_off_on_either_side_transfers_stay_on_quic() {
    let fx = Fixture::memory(1 << 30)
        .config(|c| c.bulk = BulkListen::Off)
        .start()
        .await;
    assert!(fx.node.bulk_addr().is_none());
    let c = client(&fx.node, 4, BulkUse::All).await;
    let lease = lease_of(&c, 256 << 20).await;
    write_read(&lease.session(), (16 << 20) + 5, 1).await;
    assert_eq!(bulk_counts(&fx.node), (0, 0));

    let fx = Fixture::memory(1 << 30).start().await;
    let c = client(&fx.node, 4, BulkUse::Off).await;
    let lease = lease_of(&c, 256 << 20).await;
    write_read(&lease.session(), (16 << 20) + 5, 2).await;
    assert_eq!(bulk_counts(&fx.node), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_transfer_leaves_the_connection_working() {
    let fx = Fixture::memory(1 << 30).start().await;
    let c = client(&fx.node, 1, BulkUse::All).await;
    let lease = lease_of(&c, 256 << 20).await;
    let s = lease.session();
    let buf = s.alloc(4 << 20).await.unwrap();
    // Past the end: the node drains the data and answers.
    let e = s
        .write(&buf, 1, &vec![7u8; 4 << 20])
        .await
        .expect_err("out of range");
    assert_eq!(e.kind(), ErrorKind::InvalidRequest, "{e}");
    let e = s.read(&buf, 1, 4 << 20).await.expect_err("out of range");
    assert_eq!(e.kind(), ErrorKind::InvalidRequest, "{e}");
    write_read(&s, 4 << 20, 3).await;
    assert_eq!(
        bulk_counts(&fx.node).0,
        1,
        "the same connection carried the refusals and the transfers after them"
    );
}

/// A TLS connection to the node's bulk port that presented `ticket`, and
/// the node's one-byte answer (0: accepted).
async fn redeem(
    node: &Node,
    port: u16,
    ticket: &[u8],
) -> (tokio_rustls::client::TlsStream<tokio::net::TcpStream>, u8) {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(node.cert_der().clone()).unwrap();
    let mut tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    tls.alpn_protocols = vec![proto::BULK_ALPN.to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(tls));
    let tcp = tokio::net::TcpStream::connect((node.addr().ip(), port))
        .await
        .unwrap();
    let mut s = connector
        .connect("localhost".try_into().unwrap(), tcp)
        .await
        .unwrap();
    s.write_all(ticket).await.unwrap();
    s.flush().await.unwrap();
    let mut answer = [9u8];
    // A refused ticket is answered, then the connection closes.
    s.read_exact(&mut answer).await.unwrap();
    (s, answer[0])
}

async fn tickets(c: &Client, count: u8) -> BulkTickets {
    let (body, _) = c
        .request(Opcode::BulkOpen, &to_body(&BulkOpen { count }), &[])
        .await
        .expect("BULK_OPEN");
    from_body(&body).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ticket_opens_one_connection_once_for_its_own_principal() {
    let fx = Fixture::memory(1 << 30)
        .config(|c| c.tokens.push("other-secret".into()))
        .start()
        .await;
    let owner = connect(&fx.node).await;
    let lease = lease_of(&owner, 64 << 20).await;
    let buf = lease.session().alloc(1 << 20).await.unwrap();
    let other = connect_as(&fx.node, "other-secret").await;

    let t = tickets(&other, 2).await;
    assert_eq!(t.port, fx.node.bulk_addr().unwrap().port());
    let (_, ok) = redeem(&fx.node, t.port, &t.tickets[0]).await;
    assert_eq!(ok, 0, "a fresh ticket opens a connection");
    let (_, again) = redeem(&fx.node, t.port, &t.tickets[0]).await;
    assert_ne!(again, 0, "a used ticket is refused");
    let (_, made_up) = redeem(&fx.node, t.port, &[0x42; proto::BULK_TICKET_LEN]).await;
    assert_ne!(made_up, 0, "a made-up ticket is refused");

    // The other principal's connection cannot read the owner's buffer.
    let (mut conn, ok) = redeem(&fx.node, t.port, &t.tickets[1]).await;
    assert_eq!(ok, 0);
    let body = to_body(&MemRead {
        lease: lease.id(),
        buf: buf.id(),
        offset: 0,
        len: 1 << 20,
        after: 0,
    });
    let h = Header::request(Opcode::MemRead, 1, body.len() as u32, 0);
    proto::write_frame(&mut conn, &h, &body, &[]).await.unwrap();
    conn.flush().await.unwrap();
    let (reply, _) = proto::read_head(&mut conn, &Limits::default())
        .await
        .unwrap();
    assert_ne!(reply.status, Status::Ok, "another principal's lease");
    assert_eq!(reply.data_len, 0, "no data of another principal's lease");

    // Asking is bounded: BULK_OPEN takes 1 to 16 tickets at a time.
    let e = other
        .request(Opcode::BulkOpen, &to_body(&BulkOpen { count: 17 }), &[])
        .await
        .expect_err("17 tickets");
    assert_eq!(e.kind(), ErrorKind::InvalidRequest, "{e}");
}
