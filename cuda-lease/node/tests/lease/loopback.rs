//! QUIC loopback tests of the node with the in-memory test double device
//! ([`cuda_lease_node::device::MemoryDevice`]): kernels are not run here, but every
//! lease still gets its own worker process.

use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use cuda_lease::client::{
    Client, ClientConfig, ErrorKind, GpuCall, Lease, LeaseBuffer, ModuleSpec, Session,
};
use cuda_lease::proto::{self, Header, LaunchArg, LeaseState, Opcode, Status};

const PTX: &str = ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry iota(.param .u64 out, .param .u32 n)\n{\n ret;\n}\n.visible .entry __fault()\n{\n ret;\n}\n.visible .entry __exit()\n{\n ret;\n}\n.visible .entry __hang()\n{\n ret;\n}\n";

#[tokio::test]
async fn auth_rejection() {
    let fx = Fixture::memory(1 << 20).start().await;
    let node = &fx.node;
    let bad = ClientConfig::pinned(node.cert_der().clone()).token("wrong");
    let err = Client::connect(node.addr(), &bad).await.unwrap_err();
    assert!(matches!(err.kind(), ErrorKind::Unauthorized(_)), "{err:?}");
    let none = ClientConfig::pinned(node.cert_der().clone());
    assert!(matches!(
        Client::connect(node.addr(), &none).await,
        Err(ref e) if matches!(e.kind(), ErrorKind::Unauthorized(_))
    ));
    // A client that trusts a different certificate cannot connect at all.
    let other = cuda_lease_node::tls::self_signed(&["localhost".into()]).unwrap();
    let wrong_pin = ClientConfig::pinned(other.leaf().clone()).token(TOKEN);
    assert!(matches!(
        Client::connect(node.addr(), &wrong_pin).await,
        Err(ref e) if matches!(e.kind(), ErrorKind::Disconnected(_))
    ));
    let ok = connect(node).await;
    assert_eq!(ok.inventory().await.unwrap().devices.len(), 1);
    fx.shutdown().await;
}

#[tokio::test]
async fn metrics_endpoint() {
    let fx = Fixture::memory(1 << 20).start().await;
    let get = metrics_http(&fx.node).await;
    assert!(get.starts_with("HTTP/1.1 200 OK\r\n"), "{get}");
    assert!(
        get.contains("\n# TYPE gpu_lease_acquired counter\n"),
        "{get}"
    );
    assert!(
        get.contains("\n# TYPE gpu_vram_allocated_bytes gauge\n"),
        "{get}"
    );
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(
        metric(
            &get,
            &format!("cuda_lease_build_info{{version=\"{version}\"}}")
        ),
        Some(1),
        "{get}"
    );
    assert_eq!(metric(&get, "gpu_lease_active"), Some(0), "{get}");
    assert!(get.trim_end().ends_with("# EOF"), "{get}");
    let close = "Host: x\r\nConnection: close\r\n";
    let other = metrics_request(&fx.node, &format!("GET /other HTTP/1.1\r\n{close}\r\n")).await;
    assert!(other.starts_with("HTTP/1.1 404 "), "{other}");
    let post = metrics_request(
        &fx.node,
        &format!("POST /metrics HTTP/1.1\r\n{close}Content-Length: 0\r\n\r\n"),
    )
    .await;
    assert!(post.starts_with("HTTP/1.1 405 "), "{post}");
    assert!(
        post.to_ascii_lowercase().contains("allow: get, head"),
        "{post}"
    );
    assert!(!post.contains("# TYPE"), "{post}");
    assert!(get.contains("application/openmetrics-text"), "{get}");
    assert!(
        get.contains("\n# UNIT gpu_submit_output_bytes bytes\n"),
        "{get}"
    );
    assert_eq!(metric(&get, "gpu_modules_compiled_total"), Some(0), "{get}");
    let head = metrics_request(&fx.node, &format!("HEAD /metrics HTTP/1.1\r\n{close}\r\n")).await;
    assert!(
        head.starts_with("HTTP/1.1 200 ") && !head.contains("# TYPE"),
        "{head}"
    );
    let junk = metrics_request(&fx.node, "NOT HTTP\r\n\r\n").await;
    assert!(!junk.contains("# TYPE"), "{junk}");
    fx.shutdown().await;
}

#[tokio::test]
async fn lease_alloc_renew_free() {
    let mut fx = Fixture::memory(1 << 20)
        .lease_with(
            Lease::builder()
                .min_vram(4096)
                .ttl(Duration::from_secs(30))
                .auto_renew(false),
        )
        .start()
        .await;
    let (client, lease) = (fx.client().clone(), fx.take_lease());
    assert_eq!(lease.generation(), 1);
    assert_eq!(lease.reserved(), 4096);
    let g = lease.renew().await.unwrap();
    assert_eq!(g.generation, 2);
    let st = lease.query().await.unwrap();
    assert_eq!(st.generation, 2);
    assert_eq!(st.state, LeaseState::Active);
    let inv = client.inventory().await.unwrap();
    assert_eq!(inv.active_leases, 1);
    assert_eq!(inv.reservable_bytes, (1 << 20) - 4096);
    let id = lease.id();
    lease.free().await.unwrap();
    let inv = client.inventory().await.unwrap();
    assert_eq!(inv.active_leases, 0);
    assert_eq!(inv.reservable_bytes, 1 << 20);
    assert!(matches!(
        client.free_lease(id).await,
        Err(ref e) if matches!(e.kind(), ErrorKind::LeaseNotFound)
    ));
    let m = metrics_http(&fx.node).await;
    assert_eq!(metric(&m, "gpu_lease_acquired_total"), Some(1), "{m}");
    assert_eq!(metric(&m, "gpu_lease_dropped_total"), Some(1), "{m}");
    fx.shutdown().await;
}

#[tokio::test]
async fn auto_renew_keeps_lease_alive() {
    // The node runs on a manual clock; the client renews every 3/4 of the
    // 1 s TTL of real time. Each renewal seen, the node's clock moves 0.9 s:
    // after three, the lease has lived 2.7 s of node time, past its TTL
    // twice over, and only the renewals kept it.
    let fx = Fixture::memory(1 << 20)
        .manual_clock()
        .lease_with(Lease::builder().min_vram(1024).ttl(Duration::from_secs(1)))
        .start()
        .await;
    let (lease, clock) = (fx.lease(), fx.clock());
    let first = lease.generation();
    for round in 1..=3 {
        assert!(
            eventually(Duration::from_secs(10), || async {
                lease.generation() >= first + round
            })
            .await,
            "renewal {round} never came (generation {})",
            lease.generation()
        );
        clock.advance(Duration::from_millis(900));
        assert_eq!(
            lease.query().await.unwrap().state,
            LeaseState::Active,
            "after renewal {round}"
        );
    }
    fx.free_and_shutdown().await;
}

#[tokio::test]
async fn capacity_accounting() {
    let fx = Fixture::memory(1 << 20).lease(768 << 10).start().await;
    let (client, a) = (fx.client(), fx.lease());
    let err = Lease::builder()
        .min_vram(512 << 10)
        .auto_renew(false)
        .on(client.clone())
        .await
        .unwrap_err();
    assert!(matches!(err.kind(), ErrorKind::Capacity), "{err:?}");
    let s = a.session();
    let b1 = s.alloc(512 << 10).await.unwrap();
    let err = s.alloc(300 << 10).await.unwrap_err();
    assert!(matches!(err.kind(), ErrorKind::Capacity), "{err:?}");
    assert_eq!(a.query().await.unwrap().allocated, 512 << 10);
    let m = metrics_http(&fx.node).await;
    assert_eq!(metric(&m, "gpu_vram_allocated_bytes"), Some(512 << 10));
    drop(b1); // RAII free in the background
    assert!(
        eventually(Duration::from_secs(5), || async {
            a.query().await.unwrap().allocated == 0
        })
        .await
    );
    let _b2 = s.alloc(768 << 10).await.unwrap();
    // In a batch: the allocation exceeds the reservation and stops the batch.
    let mut b = s.recorder();
    b.alloc(0, 1);
    let err = b.submit().await.unwrap().ok().unwrap_err();
    assert!(matches!(err.kind(), ErrorKind::Capacity), "{err:?}");
    assert_eq!(a.query().await.unwrap().allocated, 768 << 10);
    fx.free_and_shutdown().await;
}

#[tokio::test]
async fn expiry_tears_down_with_injected_clock() {
    let fx = Fixture::memory(1 << 20)
        .manual_clock()
        .lease_with(
            Lease::builder()
                .min_vram(4096)
                .ttl(Duration::from_secs(10))
                .auto_renew(false),
        )
        .start()
        .await;
    let (node, client, lease, clock) = (&fx.node, fx.client(), fx.lease(), fx.clock());
    // A second lease, of 5 s, left to the node: the reaper pass that ends
    // it shows that the reaper has looked at the clock since it moved.
    Lease::builder()
        .min_vram(4096)
        .ttl(Duration::from_secs(5))
        .auto_renew(false)
        .on(client.clone())
        .await
        .unwrap()
        .leak();
    let s = lease.session();
    let buf = s.alloc(1000).await.unwrap();
    clock.advance(Duration::from_secs(9));
    wait_until(
        Duration::from_secs(10),
        "a reaper pass at 9 s to end the 5 s lease",
        || async { metric(&node.metrics_text(), "gpu_lease_dropped_total") >= Some(1) },
    )
    .await;
    // The same pass left the 10 s lease alone.
    assert_eq!(lease.query().await.unwrap().state, LeaseState::Active);
    clock.advance(Duration::from_secs(1));
    // Dead at once for requests, and torn down by the reaper (its worker
    // killed and reaped) soon after.
    assert!(matches!(
        s.read(&buf, 0, 4).await,
        Err(ref e) if matches!(e.kind(), ErrorKind::LeaseExpired)
    ));
    assert!(
        eventually(Duration::from_secs(10), || async {
            let m = node.metrics_text();
            metric(&m, "gpu_lease_dropped_total") == Some(2)
                && metric(&m, "gpu_vram_allocated_bytes") == Some(0)
        })
        .await
    );
    let inv = client.inventory().await.unwrap();
    assert_eq!(inv.active_leases, 0);
    assert_eq!(inv.reservable_bytes, 1 << 20);
    assert!(
        matches!(lease.renew().await, Err(ref e) if matches!(e.kind(), ErrorKind::LeaseExpired))
    );
    drop(buf);
    fx.shutdown().await;
}

#[tokio::test]
async fn disconnect_does_not_free() {
    // The client is the test's own: it is closed and dropped below.
    let fx = Fixture::memory(1 << 20).manual_clock().start().await;
    let (node, clock) = (&fx.node, fx.clock());
    let a = connect(node).await;
    let lease = Lease::builder()
        .min_vram(4096)
        .ttl(Duration::from_secs(5))
        .auto_renew(false)
        .on(a.clone())
        .await
        .unwrap();
    let id = lease.id();
    lease.leak();
    a.close();
    drop(a);
    // A bounded wait, not an event: the node keeps nothing per connection
    // and shows nothing when one ends (no counter, no reply to a closed
    // connection), so nothing proves it has handled this close. 200 ms is
    // far more than loopback takes to deliver it (well under 1 ms); a node
    // that freed the lease on the close would show it by then.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let b = connect(node).await;
    assert_eq!(b.inventory().await.unwrap().active_leases, 1);
    clock.advance(Duration::from_secs(6));
    assert!(
        eventually(Duration::from_secs(2), || async {
            b.inventory().await.unwrap().active_leases == 0
        })
        .await
    );
    assert!(matches!(
        b.free_lease(id).await,
        Err(ref e) if matches!(e.kind(), ErrorKind::LeaseExpired)
    ));
    fx.shutdown().await;
}

#[tokio::test]
async fn cross_lease_access_denied() {
    let mut fx = Fixture::memory(1 << 20).lease(4096).start().await;
    let a = fx.take_lease();
    let b = fx.another_lease(4096).await;
    let secret = a.session().alloc(16).await.unwrap();
    a.session()
        .write(&secret, 0, b"sixteen byte key")
        .await
        .unwrap();
    let sb = b.session();
    assert!(matches!(
        sb.read_id(secret.id(), 0, 16).await,
        Err(ref e) if matches!(e.kind(), ErrorKind::InvalidRequest)
    ));
    assert!(matches!(
        sb.write_id(secret.id(), 0, b"x").await,
        Err(ref e) if matches!(e.kind(), ErrorKind::InvalidRequest)
    ));
    // Ids are per lease: B's id of the same number names nothing of A's.
    let mut batch = sb.recorder();
    batch.read(0, secret.id(), 0, 16);
    let reply = batch.submit().await.unwrap();
    assert!(matches!(reply.ok(), Err(ref e) if matches!(e.kind(), ErrorKind::InvalidRequest)));
    assert_eq!(
        a.session().read(&secret, 0, 16).await.unwrap(),
        b"sixteen byte key"
    );
    // Out-of-bounds access inside one's own lease is refused too.
    assert!(matches!(
        a.session().read(&secret, 8, 16).await,
        Err(ref e) if matches!(e.kind(), ErrorKind::InvalidRequest)
    ));
    drop(secret);
    a.free().await.unwrap();
    b.free().await.unwrap();
    fx.shutdown().await;
}

#[tokio::test]
async fn a_transfer_is_checked_against_the_lease_whatever_its_length() {
    // The lease's worker checks a streamed transfer's buffer and whole
    // range before it copies anything: an empty one too (which the client
    // never sends, and copies nothing).
    let fx = Fixture::memory(1 << 20).lease(4096).start().await;
    let (client, lease) = (fx.client().clone(), fx.lease().id());
    let s = fx.lease().session();
    let buf = s.alloc(16).await.unwrap();
    let transfer = |id: u64, offset: u64, len: usize| {
        let client = client.clone();
        async move {
            let (buf, after) = (proto::Id(id), 0);
            let write = proto::MemWrite {
                lease,
                buf,
                offset,
                after,
            };
            let (body, data) = (proto::to_body(&write), vec![1; len]);
            let w = client.request(Opcode::MemWrite, &body, &data).await;
            let read = proto::MemRead {
                lease,
                buf,
                offset,
                len: len as u32,
                after,
            };
            let r = client
                .request(Opcode::MemRead, &proto::to_body(&read), &[])
                .await;
            (w.map(|_| ()), r.map(|_| ()))
        }
    };
    for len in [0, 4] {
        for (id, offset, why) in [(999, 0, "no buffer #999"), (buf.id().0, 17, "range 17+")] {
            let (w, r) = transfer(id, offset, len).await;
            for e in [w.unwrap_err(), r.unwrap_err()] {
                assert!(e.to_string().contains(why), "{len} bytes: {e}");
            }
        }
        let (w, r) = transfer(buf.id().0, 12, len).await;
        w.unwrap();
        r.unwrap();
    }
    drop(buf);
    fx.free_and_shutdown().await;
}

#[tokio::test]
async fn batch_runs_in_order_with_one_reply() {
    let fx = Fixture::memory(1 << 20).lease(1 << 16).start().await;
    let s = fx.session();
    let m = ModuleSpec::ptx(PTX);
    let mut b = s.recorder();
    let x = b.alloc(0, 64);
    b.write(0, x, 0, &[7u8; 64]);
    b.launch(
        0,
        &m,
        "iota",
        [1, 1, 1],
        [32, 1, 1],
        vec![LaunchArg::mem(x), LaunchArg::u32(16)],
    );
    let r = b.read(0, x, 8, 8);
    let out = b.submit().await.unwrap().ok().unwrap();
    // The test double runs `iota` on the host: x[i] = i over the 7s.
    assert_eq!(out.read(r).unwrap(), &[2, 0, 0, 0, 3, 0, 0, 0]);
    // The client named the buffer: later requests use that name.
    assert_eq!(s.read_id(x, 4, 2).await.unwrap(), vec![1, 0]);
    // Unknown kernel and a bad module.
    let mut b = s.recorder();
    b.launch(0, &m, "nope", [1, 1, 1], [32, 1, 1], vec![]);
    assert!(matches!(
        b.submit().await.unwrap().ok(),
        Err(ref e) if matches!(e.kind(), ErrorKind::InvalidRequest)
    ));
    let err = s.load_module("garbage").await.unwrap_err();
    assert!(
        matches!(err, ref e if matches!(e.kind(), ErrorKind::LoadFailed) && e.message().contains("ptxas")),
        "{err:?}"
    );
    fx.free_and_shutdown().await;
}

#[tokio::test]
async fn large_write_and_read_round_trip() {
    // 24 MiB: many QUIC flow-control windows and many fills of even a grown
    // worker pipe, in both directions; the bytes must come back unchanged.
    const LEN: usize = 24 << 20;
    let fx = Fixture::memory(64 << 20)
        .lease(LEN as u64 + 4096)
        .start()
        .await;
    let s = fx.session();
    let buf = s.alloc(LEN as u64 + 4096).await.unwrap();
    let data: Vec<u8> = (0..LEN).map(|i| (i.wrapping_mul(131) >> 7) as u8).collect();
    s.write(&buf, 4096, &data).await.unwrap();
    let back = s.read(&buf, 4096, LEN as u32).await.unwrap();
    assert!(back == data, "read-back differs from what was written");
    // A read straddling the written range sees the zeroed head.
    let head = s.read(&buf, 4090, 12).await.unwrap();
    assert_eq!(head, [&[0u8; 6][..], &data[..6]].concat());
    drop(buf);
    fx.free_and_shutdown().await;
}

#[tokio::test]
async fn kernel_fault_poisons_only_that_lease() {
    let mut fx = Fixture::memory(1 << 20).lease(4096).start().await;
    let a = fx.take_lease();
    let b = fx.another_lease(4096).await;
    let client = fx.client();
    let sa = a.session();
    let ma = sa.load_module(PTX).await.unwrap();
    // A request's reply comes when its work is done: the fault is its error.
    let err = sa
        .launch(&ma, "__fault", [1, 1, 1], [1, 1, 1], vec![])
        .await
        .unwrap_err();
    assert!(matches!(err.kind(), ErrorKind::LaunchFailed), "{err:?}");
    let err = sa.alloc(16).await.unwrap_err();
    assert!(
        matches!(err, ref e if matches!(e.kind(), ErrorKind::LeasePoisoned) && e.message().contains("lease poisoned")),
        "{err:?}"
    );
    assert_eq!(a.query().await.unwrap().state, LeaseState::Poisoned);
    // B keeps working.
    let sb = b.session();
    let buf = sb.alloc(4).await.unwrap();
    sb.write(&buf, 0, &[1, 2, 3, 4]).await.unwrap();
    assert_eq!(sb.read(&buf, 0, 4).await.unwrap(), vec![1, 2, 3, 4]);
    // The poisoned lease's reservation is back; freeing it still works.
    assert_eq!(
        client.inventory().await.unwrap().reservable_bytes,
        (1 << 20) - 4096
    );
    drop(ma);
    a.free().await.unwrap();
    drop(buf);
    b.free().await.unwrap();
    fx.shutdown().await;
}

#[tokio::test]
async fn dead_and_hung_workers_fail_their_lease() {
    let fx = Fixture::node_path(1 << 20)
        .config(|cfg| cfg.op_timeout = Duration::from_secs(3))
        .lease(4096)
        .start()
        .await;
    let (client, a) = (fx.client(), fx.lease());
    let sa = a.session();
    let m = sa.load_module(PTX).await.unwrap();
    let err = sa
        .launch(&m, "__exit", [1, 1, 1], [1, 1, 1], vec![])
        .await
        .unwrap_err();
    assert!(matches!(err.kind(), ErrorKind::LeasePoisoned), "{err:?}");
    assert!(
        matches!(sa.alloc(4).await, Err(ref e) if matches!(e.kind(), ErrorKind::LeasePoisoned))
    );

    let b = fx.another_lease(4096).await;
    let sb = b.session();
    let m = sb.load_module(PTX).await.unwrap();
    let err = sb
        .launch(&m, "__hang", [1, 1, 1], [1, 1, 1], vec![])
        .await
        .unwrap_err();
    assert!(
        matches!(err, ref e if matches!(e.kind(), ErrorKind::LaunchFailed) && e.message().contains("hung")),
        "{err:?}"
    );
    assert!(
        matches!(sb.alloc(4).await, Err(ref e) if matches!(e.kind(), ErrorKind::LeasePoisoned))
    );
    assert_eq!(client.inventory().await.unwrap().active_leases, 0);
    drop(m);
    fx.shutdown().await;
}

#[tokio::test]
async fn garbage_on_the_wire_leaves_node_serving() {
    let fx = Fixture::memory(1 << 20).lease(4096).start().await;
    let (node, lease) = (&fx.node, fx.lease());
    let attacker = connect(node).await;
    let limits = proto::Limits {
        max_body: 1 << 20,
        max_data: u32::MAX,
    };
    let mut bad_version = Header::request(Opcode::Hello, 1, 0, 0).encode();
    bad_version[4] = 9;
    let mut bad_opcode = Header::request(Opcode::Hello, 1, 0, 0).encode();
    bad_opcode[5] = 200;
    let huge = Header::request(Opcode::MemWrite, 1, 0, u32::MAX).encode();
    let bad_body = {
        let mut f = Header::request(Opcode::Hello, 1, 3, 0).encode().to_vec();
        f.extend_from_slice(&[0xff, 0xff, 0xff]);
        f
    };
    let cases: Vec<Vec<u8>> = vec![
        b"hello there, this is not a frame at all!".to_vec(),
        bad_version.to_vec(),
        bad_opcode.to_vec(),
        huge.to_vec(),
        bad_body,
        vec![0u8; 5],
    ];
    for junk in cases {
        let (mut send, mut recv) = attacker_conn(node).await;
        send.write_all(&junk).await.unwrap();
        send.finish().unwrap();
        let f = proto::read_frame(&mut recv, &limits).await.unwrap();
        assert_eq!(f.header.status, Status::Malformed, "{junk:?}");
    }
    // A version 1 peer is told why, in a header it can read.
    let (mut send, mut recv) = attacker_conn(node).await;
    let mut v1 = Header::request(Opcode::GetInventory, 5, 0, 0).encode();
    v1[4] = 1;
    send.write_all(&v1).await.unwrap();
    send.finish().unwrap();
    let mut head = [0u8; proto::HEADER_LEN];
    recv.read_exact(&mut head).await.unwrap();
    assert_eq!(head[4], 1, "the reply speaks version 1");
    head[4] = proto::VERSION;
    let h = Header::decode(&head, &limits).unwrap();
    assert_eq!(h.status, Status::BadRequest);
    let mut body = vec![0u8; h.body_len as usize];
    recv.read_exact(&mut body).await.unwrap();
    let msg = proto::from_body::<proto::ErrorBody>(&body).unwrap().message;
    let speaks = format!(
        "unsupported protocol version 1: this node speaks {}",
        proto::VERSION
    );
    assert_eq!(msg, speaks);
    // The attacker's own authenticated connection and the victim still work.
    assert!(attacker.inventory().await.is_ok());
    let s = lease.session();
    let buf = s.alloc(8).await.unwrap();
    s.write(&buf, 0, b"survived").await.unwrap();
    assert_eq!(s.read(&buf, 0, 8).await.unwrap(), b"survived");
    drop(buf);
    fx.free_and_shutdown().await;
}

#[tokio::test]
async fn unauthenticated_connections_can_do_nothing_but_hello() {
    let mut fx = Fixture::memory(1 << 20).lease(4096).start().await;
    let lease = fx.take_lease();
    let (node, client) = (&fx.node, fx.client());
    let id = lease.id();
    lease.leak();
    let limits = proto::Limits::default();
    let (mut send, mut recv) = attacker_conn(node).await;
    let h = Header::request(Opcode::GetInventory, 5, 0, 0);
    proto::write_frame(&mut send, &h, &[], &[]).await.unwrap();
    send.finish().unwrap();
    let f = proto::read_frame(&mut recv, &limits).await.unwrap();
    assert_eq!(f.header.status, Status::Unauthorized);
    assert_eq!(f.header.request_id, 5);
    let (mut send, mut recv) = attacker_conn(node).await;
    let body = proto::to_body(&proto::LeaseRef { lease: id });
    let h = Header::request(Opcode::LeaseFree, 6, body.len() as u32, 0);
    proto::write_frame(&mut send, &h, &body, &[]).await.unwrap();
    send.finish().unwrap();
    let f = proto::read_frame(&mut recv, &limits).await.unwrap();
    assert_eq!(f.header.status, Status::Unauthorized);
    assert_eq!(client.inventory().await.unwrap().active_leases, 1);
    fx.shutdown().await;
}

#[tokio::test]
async fn gpu_submit_on_test_double() {
    let fx = Fixture::memory(1 << 20).client().start().await;
    let client = fx.client();
    let call = GpuCall::new(PTX, "iota", 1, 32, 20)
        .arg(LaunchArg::Output)
        .arg(LaunchArg::u32(4));
    let mut call = call;
    call.output_fill = 0xAB;
    // The test double runs `iota` on the host: 4 words, then the fill.
    let mut want: Vec<u8> = (0..4u32).flat_map(u32::to_le_bytes).collect();
    want.extend([0xAB; 4]);
    assert_eq!(client.gpu_call(&call).await.unwrap(), want);
    let bad = GpuCall::new("not ptx", "iota", 1, 1, 4);
    assert!(matches!(
        client.gpu_call(&bad).await,
        Err(ref e) if matches!(e.kind(), ErrorKind::LoadFailed)
    ));
    let bad_input = GpuCall::new(PTX, "iota", 1, 1, 4).arg(LaunchArg::Input(3));
    assert!(matches!(
        client.gpu_call(&bad_input).await,
        Err(ref e) if matches!(e.kind(), ErrorKind::InvalidRequest)
    ));
    let m = metrics_http(&fx.node).await;
    assert_eq!(metric(&m, "gpu_submit_total"), Some(3), "{m}");
    assert_eq!(metric(&m, "gpu_submit_errors_total"), Some(2), "{m}");
    assert_eq!(metric(&m, "gpu_submit_output_bytes_total"), Some(20), "{m}");
    // A faulting submit fails alone; its worker is replaced and the next submit works.
    let fault = GpuCall::new(PTX, "__fault", 1, 1, 4);
    assert!(matches!(
        client.gpu_call(&fault).await,
        Err(ref e) if matches!(e.kind(), ErrorKind::LaunchFailed)
    ));
    assert_eq!(client.gpu_call(&call).await.unwrap(), want);
    fx.shutdown().await;
}

#[tokio::test]
async fn mutual_tls_needs_no_token() {
    use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, KeyPair};
    use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let client_key = KeyPair::generate().unwrap();
    let mut client_params = CertificateParams::new(vec!["client.example".to_string()]).unwrap();
    client_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let client_cert = client_params.signed_by(&client_key, &ca, &ca_key).unwrap();

    let dir = std::env::temp_dir().join(format!("cuda-lease-mtls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, ca.pem()).unwrap();
    let fx = Fixture::memory(1 << 20)
        .config(|cfg| cfg.client_ca = Some(ca_file))
        .start()
        .await;
    let node = &fx.node;

    let mut with_cert = ClientConfig::pinned(node.cert_der().clone());
    with_cert.identity = Some(cuda_lease::tls::Identity {
        chain: vec![client_cert.der().clone()],
        key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(client_key.serialize_der())),
    });
    let client = Client::connect(node.addr(), &with_cert).await.unwrap();
    assert_eq!(client.inventory().await.unwrap().active_leases, 0);
    // Without a certificate or token: refused.
    let plain = ClientConfig::pinned(node.cert_der().clone());
    assert!(matches!(
        Client::connect(node.addr(), &plain).await,
        Err(ref e) if matches!(e.kind(), ErrorKind::Unauthorized(_))
    ));
    fx.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

mod principals;
mod transfers;

/// A submission's future is moved whole (into the caller's task, into a
/// box): nested `async` wrappers once made a recorder's 5 KiB.
#[tokio::test]
async fn a_recorded_submission_stays_small() {
    let fx = Fixture::memory(1 << 20).lease(1 << 16).start().await;
    let s = fx.session();
    let mut b = s.recorder();
    let x = b.alloc(0, 64);
    b.read(0, x, 0, 8);
    let submitted = b.submit();
    let size = std::mem::size_of_val(&submitted);
    assert!(size <= 2048, "Recorder::submit's future is {size} bytes");
    submitted.await.unwrap().ok().unwrap();
    let mut b = s.recorder();
    b.read(0, x, 0, 8);
    let submitted = b.submit_into(vec![vec![0u8; 8]]);
    let size = std::mem::size_of_val(&submitted);
    assert!(
        size <= 2048,
        "Recorder::submit_into's future is {size} bytes"
    );
    let (reply, dests) = submitted.await.unwrap();
    reply.ok().unwrap();
    assert_eq!(dests, vec![vec![0u8; 8]]);
    fx.free_and_shutdown().await;
}
