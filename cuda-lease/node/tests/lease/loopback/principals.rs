//! Principals cannot see each other's leases; the test double runs the test kernels.

use super::*;

#[tokio::test]
async fn a_principal_cannot_see_use_renew_or_free_another_principals_lease() {
    // Attack 2: token B read, overwrote and renewed A's lease given its id,
    // and a connection with no token freed it.
    let fx = Fixture::memory(1 << 20)
        .manual_clock()
        .config(|cfg| {
            cfg.tokens.clear();
            cfg.named_tokens = vec![
                ("alice".into(), "secret-a".into()),
                ("bob".into(), "secret-b".into()),
                ("ops".into(), "secret-ops".into()),
            ];
            cfg.admins = vec!["ops".into()];
        })
        .start()
        .await;
    let node = &fx.node;
    let alice = connect_as(node, "secret-a").await;
    let bob = connect_as(node, "secret-b").await;
    let lease = lease_of(&alice, 4096).await;
    let s = lease.session();
    let buf = s.alloc(64).await.unwrap();
    s.write(&buf, 0, b"SECRET-OF-TENANT-A").await.unwrap();
    let id = lease.id();
    let handle = buf.id();
    refused_as_unknown(&bob, id, handle).await;
    // Alice's data is untouched and her lease alive.
    assert_eq!(s.read(&buf, 0, 18).await.unwrap(), b"SECRET-OF-TENANT-A");
    assert_eq!(lease.query().await.unwrap().state, LeaseState::Active);
    // An operator may free it.
    let ops = connect_as(node, "secret-ops").await;
    ops.free_lease(id).await.unwrap();
    assert!(s.read(&buf, 0, 18).await.is_err());
    // Freed, it is still not Bob's to learn about: every op is answered
    // as for an id that never existed (not "was freed").
    refused_as_unknown(&bob, id, handle).await;
    drop(buf);
    lease.leak();
    // Nor is an expired lease ("expired" would say it existed).
    let short = Lease::builder()
        .min_vram(4096)
        .ttl(Duration::from_secs(5))
        .auto_renew(false)
        .on(alice.clone())
        .await
        .unwrap();
    let (short_id, short_buf) = (short.id(), short.session().alloc(16).await.unwrap().id());
    fx.clock().advance(Duration::from_secs(6));
    let dead = eventually(Duration::from_secs(5), || async {
        matches!(short.query().await, Err(e) if e.kind() == ErrorKind::LeaseExpired)
    })
    .await;
    assert!(dead, "the short lease never expired");
    refused_as_unknown(&bob, short_id, short_buf).await;
    short.leak();
    fx.shutdown().await;
}

/// Every op `bob` can name lease `id` (and its buffer `buf`) in is refused
/// exactly as for a lease that never existed: LEASE_NOT_FOUND, "no lease
/// ID", whatever state the lease is in.
async fn refused_as_unknown(bob: &Client, id: proto::LeaseId, buf: proto::Id) {
    let read = |seq| proto::Batch {
        lease: id,
        seq,
        modules: vec![],
        commands: vec![proto::Command {
            stream: 0,
            op: proto::Op::Read {
                buf,
                offset: 0,
                len: 16,
            },
        }],
    };
    let requests: Vec<(&str, Opcode, Vec<u8>, &[u8])> = vec![
        (
            "MEM_READ",
            Opcode::MemRead,
            proto::to_body(&proto::MemRead {
                lease: id,
                buf,
                offset: 0,
                len: 16,
                after: 0,
            }),
            &[],
        ),
        (
            "MEM_WRITE",
            Opcode::MemWrite,
            proto::to_body(&proto::MemWrite {
                lease: id,
                buf,
                offset: 0,
                after: 0,
            }),
            b"pwned",
        ),
        (
            "MEM_ALLOC",
            Opcode::MemAlloc,
            proto::to_body(&proto::MemAlloc {
                lease: id,
                buf: proto::Id(9999),
                size: 64,
            }),
            &[],
        ),
        (
            "MEM_FREE",
            Opcode::MemFree,
            proto::to_body(&proto::IdOp { lease: id, id: buf }),
            &[],
        ),
        (
            "LEASE_RENEW",
            Opcode::LeaseRenew,
            proto::to_body(&proto::LeaseRenew {
                lease: id,
                ttl_secs: 3600,
            }),
            &[],
        ),
        (
            "LEASE_QUERY",
            Opcode::LeaseQuery,
            proto::to_body(&proto::LeaseRef { lease: id }),
            &[],
        ),
        (
            "LEASE_FREE",
            Opcode::LeaseFree,
            proto::to_body(&proto::LeaseRef { lease: id }),
            &[],
        ),
        ("BATCH seq 0", Opcode::Batch, proto::to_body(&read(0)), &[]),
        ("BATCH seq 1", Opcode::Batch, proto::to_body(&read(1)), &[]),
    ];
    for (what, op, body, data) in requests {
        match bob.request(op, &body, data).await {
            Err(e) if e.kind() == ErrorKind::LeaseNotFound => {
                assert_eq!(e.message(), format!("no lease {id}"), "{what}: {e}")
            }
            other => {
                panic!("{what}: expected LEASE_NOT_FOUND as for an unknown lease, got {other:?}")
            }
        }
    }
}

#[tokio::test]
async fn the_test_double_runs_the_test_kernels_so_data_flow_is_checked_without_a_gpu() {
    // `iota` and `vadd` of `cuda_lease::ptx::TEST_KERNELS` run on the host
    // in the in-memory device: the same batch gives the same bytes as on a
    // GPU, and an out-of-range access faults the lease like one.
    let fx = Fixture::memory(1 << 20).lease(1 << 16).start().await;
    let (lease, s) = (fx.lease(), fx.session());
    let n = 1000u32;
    let a: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let m = ModuleSpec::ptx(cuda_lease::ptx::TEST_KERNELS);
    let mut b = s.recorder();
    let x = b.alloc(0, u64::from(n) * 4);
    let y = b.alloc(0, u64::from(n) * 4);
    let z = b.alloc(0, u64::from(n) * 4);
    b.write(0, x, 0, &bytes(&a));
    let grid = [cuda_lease::ptx::grid_for(n), 1, 1];
    let block = [cuda_lease::ptx::BLOCK, 1, 1];
    let mem = LaunchArg::mem;
    b.launch(0, &m, "iota", grid, block, vec![mem(y), LaunchArg::u32(n)]);
    b.launch(
        0,
        &m,
        "vadd",
        grid,
        block,
        vec![mem(x), mem(x), mem(z), LaunchArg::u32(n)],
    );
    let ry = b.read(0, y, 0, n * 4);
    let rz = b.read(0, z, 0, n * 4);
    let out = b.submit().await.unwrap().ok().unwrap();
    let iota: Vec<u32> = out
        .read(ry)
        .unwrap()
        .chunks(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(iota, (0..n).collect::<Vec<_>>());
    let sum: Vec<f32> = out
        .read(rz)
        .unwrap()
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(sum, a.iter().map(|v| v + v).collect::<Vec<_>>());
    // Writing past a buffer faults the lease, as on a GPU.
    let mut bad = s.recorder();
    let small = bad.alloc(0, 8);
    bad.launch(
        0,
        &m,
        "iota",
        grid,
        block,
        vec![mem(small), LaunchArg::u32(64)],
    );
    assert!(bad.submit().await.unwrap().ok().is_err());
    assert_eq!(lease.query().await.unwrap().state, LeaseState::Poisoned);
    fx.free_and_shutdown().await;
}
