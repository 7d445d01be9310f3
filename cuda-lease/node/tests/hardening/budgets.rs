//! Batch numbers, the module cache between tenants, and the byte budgets of
//! replies.

use super::*;

/// A BATCH of `commands` numbered `seq` in `lease`, with no data.
/// `op` on stream 0.
fn on0(op: proto::Op<'static>) -> proto::Command<'static> {
    proto::Command { stream: 0, op }
}

/// A read of the first `len` bytes of `buf`.
fn read_of(buf: proto::Id, len: u64) -> proto::Command<'static> {
    on0(proto::Op::Read {
        buf,
        offset: 0,
        len,
    })
}

fn numbered_batch(lease: proto::LeaseId, seq: u64, commands: Vec<proto::Command<'_>>) -> Vec<u8> {
    proto::to_body(&proto::Batch {
        lease,
        seq,
        modules: vec![],
        commands,
    })
}

#[tokio::test]
async fn batch_numbers_that_would_wrap_are_refused() {
    // A batch numbered u64::MAX would wrap the lease's next number to 0,
    // and the owner's next batch would wait for numbers that never come.
    let _one = ONE_AT_A_TIME.lock().await;
    let fx = Fixture::node_path(1 << 20).lease(4096).start().await;
    let (client, lease) = (fx.client(), fx.lease());
    let last = numbered_batch(lease.id(), u64::MAX, vec![]);
    let refused = client.request(Opcode::Batch, &last, &[]).await;
    // The owner's next batch runs at once.
    let alloc = on0(proto::Op::Alloc {
        buf: proto::Id(1),
        size: 64,
    });
    let t = std::time::Instant::now();
    let next = client
        .request(
            Opcode::Batch,
            &numbered_batch(lease.id(), 1, vec![alloc]),
            &[],
        )
        .await;
    let waited = t.elapsed();
    eprintln!(
        "batch u64::MAX: {:?}; the next batch (number 1) took {waited:?}",
        refused.as_ref().map(|_| "ran")
    );
    match refused {
        Err(e) if e.kind() == ErrorKind::InvalidRequest => {
            let m = e.message();
            assert!(m.contains(&u64::MAX.to_string()), "{m}")
        }
        other => panic!("expected BAD_REQUEST, got {other:?}"),
    }
    let (body, _) = next.unwrap();
    let reply: proto::BatchReply = proto::from_body(&body).unwrap();
    assert_eq!((reply.completed, reply.error), (1, None));
    assert!(waited < Duration::from_secs(1), "{waited:?}");
    fx.free_and_shutdown().await;
}

/// A PTX module with one empty kernel `k`, padded with comments to `len`
/// bytes; `tag` makes its text (and so its hash) its own.
fn padded_ptx(tag: &str, len: usize) -> String {
    let mut ptx = format!(
        ".version 7.0\n.target sm_70\n.address_size 64\n// {tag}\n.visible .entry k()\n{{\n ret;\n}}\n"
    );
    while ptx.len() < len {
        ptx.push_str("// padding padding padding padding padding padding padding\n");
    }
    ptx
}

/// A BATCH of `lease` that loads `modules` (with their sources when
/// `with_source`, else by hash alone) and runs nothing: body and data.
fn module_batch(lease: proto::LeaseId, modules: &[&str], with_source: bool) -> (Vec<u8>, Vec<u8>) {
    let mut uses = Vec::new();
    let mut data = Vec::new();
    for m in modules {
        uses.push(proto::ModuleUse {
            hash: proto::ModuleHash::of(&proto::SourceKind::Ptx, m),
            source: with_source.then_some(proto::ModuleText {
                kind: proto::SourceKind::Ptx,
                len: m.len() as u32,
            }),
        });
        if with_source {
            data.extend_from_slice(m.as_bytes());
        }
    }
    let body = proto::to_body(&proto::Batch {
        lease,
        seq: 0,
        modules: uses,
        commands: vec![],
    });
    (body, data)
}

#[tokio::test]
async fn refused_modules_are_not_cached_for_other_tenants() {
    // Round 2: a module refused with CAPACITY_EXCEEDED in a 1-byte lease
    // still entered the node-wide cache, and another tenant could then
    // load it by its hash alone.
    let _one = ONE_AT_A_TIME.lock().await;
    let mut cfg = node_path_config(16 << 20);
    cfg.tokens = vec!["ta".into(), "tb".into()];
    let fx = Fixture::with_config(cfg).start().await;
    let node = &fx.node;
    let a = connect_as(node, "ta").await;
    let b = connect_as(node, "tb").await;
    let module = padded_ptx("refused", 1 << 20);
    let tiny = lease_of(&a, 1).await;
    let (body, data) = module_batch(tiny.id(), &[&module], true);
    match a.request(Opcode::Batch, &body, &data).await {
        Err(ref e) if matches!(e.kind(), ErrorKind::Capacity) => {}
        other => panic!("a 1 MiB module fit a 1-byte lease: {other:?}"),
    }
    let lease_b = lease_of(&b, 4 << 20).await;
    let (body, _) = module_batch(lease_b.id(), &[&module], false);
    let by_hash = b.request(Opcode::Batch, &body, &[]).await;
    eprintln!(
        "another tenant's batch naming the refused module by hash: {}",
        match &by_hash {
            Ok(_) => "loaded from the cache".to_string(),
            Err(e) => format!("{e}"),
        }
    );
    assert!(
        matches!(by_hash, Err(ref e) if matches!(e.kind(), ErrorKind::ModuleUnknown)),
        "{by_hash:?}"
    );
    // Loaded by a lease that paid for it, the module is cached for others.
    let big = lease_of(&a, 4 << 20).await;
    let (body, data) = module_batch(big.id(), &[&module], true);
    a.request(Opcode::Batch, &body, &data).await.unwrap();
    b.request(
        Opcode::Batch,
        &module_batch(lease_b.id(), &[&module], false).0,
        &[],
    )
    .await
    .unwrap();
    for l in [tiny, lease_b, big] {
        l.free().await.unwrap();
    }
    fx.shutdown().await;
}

#[tokio::test]
async fn one_tenants_modules_evict_only_its_own_cache_entries() {
    // Round 2: 40 refused 2 MiB modules from one tenant evicted another
    // tenant's cached module. Scaled: a 4 MiB cache, 1 MiB per principal,
    // and 20 modules of 256 KiB that tenant A pays for and loads.
    let _one = ONE_AT_A_TIME.lock().await;
    let mut cfg = node_path_config(64 << 20);
    cfg.tokens = vec!["ta".into(), "tb".into()];
    cfg.module_cache_bytes = 4 << 20;
    cfg.module_cache_bytes_per_principal = 1 << 20;
    let fx = Fixture::with_config(cfg).start().await;
    let node = &fx.node;
    let a = connect_as(node, "ta").await;
    let b = connect_as(node, "tb").await;
    let mine = padded_ptx("tenant b", 64 << 10);
    let lease_b = lease_of(&b, 1 << 20).await;
    let (body, data) = module_batch(lease_b.id(), &[&mine], true);
    b.request(Opcode::Batch, &body, &data).await.unwrap();
    let lease_a = lease_of(&a, 8 << 20).await;
    for i in 0..20 {
        let m = padded_ptx(&format!("tenant a {i}"), 256 << 10);
        let (body, data) = module_batch(lease_a.id(), &[&m], true);
        a.request(Opcode::Batch, &body, &data).await.unwrap();
    }
    // B's module is still on the node: a new lease of B names it by hash.
    let again = lease_of(&b, 1 << 20).await;
    let (body, _) = module_batch(again.id(), &[&mine], false);
    let by_hash = b.request(Opcode::Batch, &body, &[]).await;
    // A's own most recent module is still cached too (its share is 1 MiB).
    let last = padded_ptx("tenant a 19", 256 << 10);
    let lease_a2 = lease_of(&a, 1 << 20).await;
    let (body, _) = module_batch(lease_a2.id(), &[&last], false);
    let a_last = a.request(Opcode::Batch, &body, &[]).await;
    eprintln!(
        "after tenant A loaded 5 MiB of modules into a 4 MiB cache: B's module by hash: {}; \
         A's last: {}",
        by_hash
            .as_ref()
            .map_or_else(|e| e.to_string(), |_| "cached".into()),
        a_last
            .as_ref()
            .map_or_else(|e| e.to_string(), |_| "cached".into()),
    );
    by_hash.unwrap();
    a_last.unwrap();
    for l in [lease_b, lease_a, again, lease_a2] {
        l.free().await.unwrap();
    }
    fx.shutdown().await;
}

/// A connection from 127.0.0.1 authenticated with `token`.
async fn raw_conn_as(node: &Node, token: &str) -> quinn::Connection {
    let conn = dial(&endpoint_on(node, [127, 0, 0, 1]), node)
        .await
        .unwrap();
    assert_eq!(hello(&conn, token).await.map(|r| r.0), Some(Status::Ok));
    conn
}

/// Sends a request on a new stream of `conn` and never reads the reply.
async fn send_unread(
    conn: &quinn::Connection,
    opcode: Opcode,
    id: u64,
    body: &[u8],
    data: &[u8],
) -> quinn::RecvStream {
    let (mut send, recv) = conn.open_bi().await.unwrap();
    let h = Header::request(opcode, id, body.len() as u32, data.len() as u32);
    proto::write_frame(&mut send, &h, body, data).await.unwrap();
    send.finish().unwrap();
    recv
}

#[tokio::test]
async fn batch_replies_count_against_the_principals_byte_budget() {
    // Round 2: a 1 MiB lease sent four BATCHes each reading 256 x 1 MiB of
    // its buffer and never read the replies: node RSS +1,024 MiB for 30 s.
    // Scaled: 4 x 32 x 1 MiB against a 16 MiB budget. (The reply timeout
    // is long: the replies are read only after the other tenant is served,
    // and one reset before that would free what the budget counts.)
    let _one = ONE_AT_A_TIME.lock().await;
    let mut cfg = node_path_config(64 << 20);
    cfg.tokens = vec!["ta".into(), "tb".into()];
    cfg.max_bytes_per_principal = 16 << 20;
    cfg.reply_timeout = Duration::from_secs(30);
    let fx = Fixture::with_config(cfg).start().await;
    let node = &fx.node;
    let a = connect_as(node, "ta").await;
    let b = connect_as(node, "tb").await;
    let lease = lease_of(&a, 1 << 20).await;
    let buf = proto::Id(1);
    let alloc = on0(proto::Op::Alloc { buf, size: 1 << 20 });
    a.request(
        Opcode::Batch,
        &numbered_batch(lease.id(), 0, vec![alloc]),
        &[],
    )
    .await
    .unwrap();
    let reads = numbered_batch(lease.id(), 0, vec![read_of(buf, 1 << 20); 32]);
    let conn = raw_conn_as(node, "ta").await;
    let peak = PeakRss::start();
    let mut unread = Vec::new();
    for i in 0..4 {
        unread.push(send_unread(&conn, Opcode::Batch, 100 + i, &reads, &[]).await);
    }
    // Another tenant is served meanwhile.
    let t = std::time::Instant::now();
    let other = lease_of(&b, 4096).await;
    let s = other.session();
    let x = s.alloc(8).await.unwrap();
    s.write(&x, 0, b"served!!").await.unwrap();
    assert_eq!(s.read(&x, 0, 8).await.unwrap(), b"served!!");
    let served = t.elapsed();
    // The node has answered all four: the heads of their replies are here
    // (their data, if any, stays unread), so whatever they hold in the
    // node is held now.
    let mut heads = Vec::new();
    for (i, r) in unread.iter_mut().enumerate() {
        let head = tokio::time::timeout(
            Duration::from_secs(20),
            proto::read_head(r, &proto::Limits::default()),
        )
        .await
        .unwrap_or_else(|_| panic!("batch {i} not answered within 20 s"))
        .unwrap();
        heads.push(head);
    }
    let grown = peak.stop();
    eprintln!(
        "4 unread BATCHes of 32 x 1 MiB reads, 16 MiB budget: node RSS peak +{} KiB; \
         another tenant served in {served:?}",
        grown / 1024
    );
    assert!(grown < 64 << 20, "RSS grew by {grown} bytes");
    // Served while the four replies are held (a tenant held up until they
    // are let go would wait for the 30 s reply timeout).
    assert!(served < Duration::from_secs(10), "{served:?}");
    // What was refused says so: the last batch's reply is small.
    let (header, body) = heads.pop().unwrap();
    assert_eq!(header.data_len, 0, "{header:?}");
    // (refused at its first read, or on its header when the budget is full)
    let (status, message) = match header.status {
        Status::Ok => {
            let reply: proto::BatchReply = proto::from_body(&body).unwrap();
            let e = reply.error.expect("refused");
            (e.status, e.message)
        }
        s => (
            s,
            proto::from_body::<proto::ErrorBody>(&body).unwrap().message,
        ),
    };
    assert_eq!(status, Status::CapacityExceeded, "{message}");
    assert!(message.contains("max_bytes_per_principal"), "{message}");
    drop(unread);
    drop(x);
    other.free().await.unwrap();
    lease.free().await.unwrap();
    fx.shutdown().await;
}

#[tokio::test]
async fn gpu_submit_outputs_count_against_the_principals_byte_budget() {
    // GPU_SUBMIT output held for a reply counted only against the reply
    // timeout. Four unread submits of 8 MiB outputs against a 12 MiB
    // budget: one runs, three are refused before running.
    let _one = ONE_AT_A_TIME.lock().await;
    let mut cfg = node_path_config(64 << 20);
    cfg.max_bytes_per_principal = 12 << 20;
    // Long: the first reply's output must stay counted until the last
    // submit is refused.
    cfg.reply_timeout = Duration::from_secs(30);
    let fx = Fixture::with_config(cfg).start().await;
    let node = &fx.node;
    let conn = raw_authed_conn(node).await;
    let ptx = ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry k()\n{\n ret;\n}\n";
    let req = proto::GpuSubmit {
        kernel: "k".into(),
        grid: [1, 1, 1],
        block: [1, 1, 1],
        shared_mem: 0,
        args: vec![],
        ptx_len: ptx.len() as u32,
        input_lens: vec![],
        output_size: 8 << 20,
        output_fill: 0x55,
    };
    let body = proto::to_body(&req);
    let mut replies = Vec::new();
    // In order: the first has run, its 8 MiB output held for its unread
    // reply (the node counts the output once made), before the others.
    replies.push(send_unread(&conn, Opcode::GpuSubmit, 10, &body, ptx.as_bytes()).await);
    wait_until(
        Duration::from_secs(10),
        "the first submit's 8 MiB output",
        || async { metric(&node.metrics_text(), "gpu_submit_output_bytes_total") >= Some(8 << 20) },
    )
    .await;
    for i in 1..4 {
        replies.push(send_unread(&conn, Opcode::GpuSubmit, 10 + i, &body, ptx.as_bytes()).await);
    }
    let mut statuses = Vec::new();
    for mut r in replies {
        let f = proto::read_frame(&mut r, &proto::Limits::default()).await;
        statuses.push(f.map(|f| f.header.status).ok());
    }
    eprintln!("4 submits of 8 MiB output, 12 MiB budget: {statuses:?}");
    let ok = statuses.iter().filter(|s| **s == Some(Status::Ok)).count();
    let refused = statuses
        .iter()
        .filter(|s| **s == Some(Status::CapacityExceeded))
        .count();
    assert_eq!((ok, refused), (1, 3));
    // Refused before running: the node ran only the first.
    assert_eq!(metric(&node.metrics_text(), "gpu_submit_total"), Some(1));
    fx.shutdown().await;
}

#[tokio::test]
async fn an_unread_large_batch_reply_holds_a_window_on_the_node_not_its_data() {
    // Measured before: on a 1 MiB lease, 4 BATCHes of 256 reads of the
    // same 1 MiB buffer, never read, made the node hold 1,024 MiB. Now
    // the lease's worker keeps a large reply's data and the node reads it
    // a part at a time as the client takes it.
    let _one = ONE_AT_A_TIME.lock().await;
    let mut cfg = node_path_config(64 << 20);
    cfg.reply_timeout = Duration::from_secs(20);
    let fx = Fixture::with_config(cfg).start().await;
    let node = &fx.node;
    let a = connect(node).await;
    let lease = lease_of(&a, 1 << 20).await;
    let buf = proto::Id(1);
    let pattern: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    let fill = vec![
        on0(proto::Op::Alloc { buf, size: 1 << 20 }),
        on0(proto::Op::Write {
            buf,
            offset: 0,
            len: 1 << 20,
        }),
    ];
    a.request(
        Opcode::Batch,
        &numbered_batch(lease.id(), 0, fill),
        &pattern,
    )
    .await
    .unwrap();
    let reads = numbered_batch(lease.id(), 0, vec![read_of(buf, 1 << 20); 256]);
    let conn = raw_authed_conn(node).await;
    let peak = PeakRss::start();
    let mut unread = Vec::new();
    for i in 0..4 {
        unread.push(send_unread(&conn, Opcode::Batch, 100 + i, &reads, &[]).await);
    }
    // Every reply has started (its head is here): the worker has run the
    // batch, and what the node holds for it, it holds now.
    let mut lens = Vec::new();
    for (i, r) in unread.iter_mut().enumerate() {
        let (h, _) = tokio::time::timeout(
            Duration::from_secs(20),
            proto::read_head(r, &proto::Limits::default()),
        )
        .await
        .unwrap_or_else(|_| panic!("batch {i} not answered within 20 s"))
        .unwrap();
        // (the reads past the reply's size limit, or past the principal's
        // byte budget, are refused: the batch stops there)
        assert_eq!(h.status, Status::Ok);
        assert!(h.data_len >= 128 << 20, "{h:?}");
        lens.push(h.data_len as usize);
    }
    // Time for the node to fill whatever it would buffer.
    let settled = metric(&node.metrics_text(), "gpu_batch_total");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let grown = peak.stop();
    eprintln!(
        "4 unread BATCH replies of 256 x 1 MiB reads ({} MiB of replies): node RSS peak +{} KiB \
         (batches {settled:?})",
        lens.iter().sum::<usize>() >> 20,
        grown / 1024
    );
    assert!(grown < 64 << 20, "RSS grew by {grown} bytes");
    // A reply read to its end is whole and right.
    let mut r = unread.pop().unwrap();
    let mut data = vec![0u8; lens[3]];
    tokio::io::AsyncReadExt::read_exact(&mut r, &mut data)
        .await
        .unwrap();
    for (k, part) in data.chunks(1 << 20).enumerate() {
        assert!(part == &pattern[..], "read {k} differs");
    }
    drop(unread);
    lease.free().await.unwrap();
    fx.shutdown().await;
}

#[tokio::test]
async fn a_batch_reads_no_more_than_its_head_declared() {
    // The node holds what a BATCH's head declares for its reply (it does
    // not decode the commands); the lease's worker refuses the read that
    // would pass it, and the commands before it run.
    let _one = ONE_AT_A_TIME.lock().await;
    let fx = Fixture::node_path(1 << 20).lease(4096).start().await;
    let (client, lease) = (fx.client(), fx.lease());
    let buf = proto::Id(1);
    let commands = [
        proto::Op::Alloc { buf, size: 16 },
        proto::Op::Read {
            buf,
            offset: 0,
            len: 4,
        },
        proto::Op::Read {
            buf,
            offset: 4,
            len: 8,
        },
    ]
    .map(on0);
    // (bytes declared, commands that run, bytes they read)
    for (declared, completed, read) in [(12, 3, 12), (11, 2, 4), (0, 1, 0)] {
        let mut body = Vec::new();
        proto::encode_batch_head(&mut body, lease.id(), 0, &[], declared);
        proto::encode_commands(&mut body, commands.len(), &commands);
        let (reply, data) = client.request(Opcode::Batch, &body, &[]).await.unwrap();
        let reply: proto::BatchReply = proto::from_body(&reply).unwrap();
        assert_eq!(reply.completed, completed, "{declared} declared: {reply:?}");
        assert_eq!(data.len(), read, "{declared} declared");
        if let Some(e) = reply.error {
            assert_eq!(e.index, completed, "{e:?}");
            assert_eq!(e.status, Status::CapacityExceeded, "{e:?}");
            assert!(
                e.message.contains(&format!("holds {declared} bytes")),
                "{e:?}"
            );
        }
        // The buffer made by the batch goes with it (the next makes it again).
        let free = [on0(proto::Op::Free { id: buf })];
        let mut body = Vec::new();
        proto::encode_batch_head(&mut body, lease.id(), 0, &[], 0);
        proto::encode_commands(&mut body, 1, &free);
        client.request(Opcode::Batch, &body, &[]).await.unwrap();
    }
    fx.free_and_shutdown().await;
}

#[tokio::test]
async fn a_batch_reply_holds_only_the_bytes_it_carries() {
    // The node holds a batch's declared reply bytes, as far as the
    // principal's budget allows, before it runs; once the reply is made,
    // what it does not carry (the reads refused past the budget) goes back
    // to the budget, even while the reply itself is unread.
    let _one = ONE_AT_A_TIME.lock().await;
    let mut cfg = node_path_config(64 << 20);
    cfg.max_bytes_per_principal = 16 << 20;
    cfg.reply_timeout = Duration::from_secs(30);
    let fx = Fixture::with_config(cfg).lease(8 << 20).start().await;
    let (client, lease) = (fx.client(), fx.lease());
    let buf = proto::Id(1);
    let alloc = on0(proto::Op::Alloc { buf, size: 8 << 20 });
    client
        .request(
            Opcode::Batch,
            &numbered_batch(lease.id(), 0, vec![alloc]),
            &[],
        )
        .await
        .unwrap();
    // Two reads of 8 MiB: the budget holds 16 MiB less the request's own
    // bytes, so the first runs and the second is refused.
    let reads = numbered_batch(lease.id(), 0, vec![read_of(buf, 8 << 20); 2]);
    let conn = raw_conn_as(&fx.node, TOKEN).await;
    let mut unread = send_unread(&conn, Opcode::Batch, 7, &reads, &[]).await;
    let (header, body) = proto::read_head(&mut unread, &proto::Limits::default())
        .await
        .unwrap();
    let reply: proto::BatchReply = proto::from_body(&body).unwrap();
    assert_eq!(reply.completed, 1, "{reply:?}");
    assert_eq!(header.data_len, 8 << 20);
    // Its 8 MiB stay held while unread; the rest of the budget is free: a
    // 4 MiB write fits beside it.
    let write = on0(proto::Op::Write {
        buf,
        offset: 0,
        len: 4 << 20,
    });
    let batch = numbered_batch(lease.id(), 0, vec![write]);
    let r = client
        .request(Opcode::Batch, &batch, &vec![3u8; 4 << 20])
        .await;
    assert!(r.is_ok(), "{r:?}");
    drop(unread);
    fx.free_and_shutdown().await;
}
