//! Streamed transfers of every shape, and a transfer cut off midway.

use super::*;

/// The chunk size of streamed transfers (the node's ring slot).
const CHUNK: usize = 2 << 20;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(151) >> 5) as u8 ^ seed)
        .collect()
}

#[tokio::test]
async fn streamed_transfers_of_every_shape_round_trip() {
    let fx = Fixture::memory(64 << 20).start().await;
    let node = &fx.node;
    // Striped over 3 connections from 1 byte up, and never striped.
    for config in [
        client_config(node).stripes(3, 1),
        client_config(node).stripes(1, 0),
    ] {
        let client = Arc::new(Client::connect(node.addr(), &config).await.unwrap());
        transfers_of_every_shape(client).await;
    }
    fx.shutdown().await;
}

async fn transfers_of_every_shape(client: Arc<Client>) {
    const SIZE: usize = 6 * CHUNK + 4096;
    let lease = lease_of(&client, SIZE as u64).await;
    let s = lease.session();
    let buf = s.alloc(SIZE as u64).await.unwrap();
    let mut model = vec![0u8; SIZE];
    for (i, (offset, len)) in [
        (0, 0),
        (7, 1),
        (100, CHUNK - 1),
        (CHUNK, CHUNK),
        (3, CHUNK + 1),
        (4096 - 5, 5 * CHUNK + 123),
        (0, SIZE),
        (SIZE, 0),
    ]
    .into_iter()
    .enumerate()
    {
        let data = pattern(len, i as u8);
        s.write(&buf, offset as u64, &data).await.unwrap();
        model[offset..offset + len].copy_from_slice(&data);
        let back = s.read(&buf, offset as u64, len as u32).await.unwrap();
        assert!(back == data, "case {i}: {len} bytes at {offset} differ");
    }
    let all = s.read(&buf, 0, SIZE as u32).await.unwrap();
    assert!(all == model, "whole buffer differs from the model");
    // Out of range: refused before any data moves, the lease stays usable.
    let e = s
        .write(&buf, SIZE as u64 - 3, &[1, 2, 3, 4])
        .await
        .unwrap_err();
    assert!(e.to_string().contains("outside"), "{e}");
    let e = s.read(&buf, SIZE as u64 - 3, 4).await.unwrap_err();
    assert!(e.to_string().contains("outside"), "{e}");
    assert_eq!(s.read(&buf, 7, 1).await.unwrap(), model[7..8].to_vec());
    drop(buf);
    lease.free().await.unwrap();
}

/// How far the node has surely taken a MEM_WRITE cut off after `cut`
/// bytes, once it is midway: the whole chunks before the cut.
fn taken_up_to(cut: usize) -> usize {
    cut / CHUNK * CHUNK
}

/// Waits until the node is midway through a MEM_WRITE on `conn` (its only
/// transfer) that was cut off after `part`: it holds a ring slot for the
/// chunk the cut falls in. Past the first chunk, that is when the worker
/// has the last whole chunk before the cut (read back from `buf`): the node
/// hands the chunks over in order, and takes the next chunk's slot before
/// the worker gets the last. Inside the first chunk, nothing reaches the
/// worker; the node taking data into the chunk's slot shows instead as
/// QUIC flow-control credit for this stream (MAX_STREAM_DATA), which it
/// sends once it has read an eighth of the stream's window, well under
/// the 1 MiB sent.
async fn wait_midway(s: &Session, buf: &LeaseBuffer, conn: &quinn::Connection, part: &[u8]) {
    let at = taken_up_to(part.len());
    if at > 0 {
        let tail = &part[at - 8..at];
        wait_until(
            Duration::from_secs(10),
            &format!(
                "the worker to have the {at} bytes before a cut at {}",
                part.len()
            ),
            || async { s.read(buf, at as u64 - 8, 8).await.unwrap() == tail },
        )
        .await;
    } else {
        wait_until(
            Duration::from_secs(10),
            "the node to read data of a transfer cut inside its first chunk",
            || async { conn.stats().frame_rx.max_stream_data > 0 },
        )
        .await;
    }
}

#[tokio::test]
async fn a_transfer_cut_off_midway_frees_what_it_held_and_the_lease_stays_usable() {
    const SIZE: usize = 8 * CHUNK;
    let fx = Fixture::memory(64 << 20).lease(SIZE as u64).start().await;
    let (node, lease) = (&fx.node, fx.lease());
    let s = lease.session();
    let buf = s.alloc(SIZE as u64).await.unwrap();
    // Cut-off writes of each shape, then more cut inside the first chunk
    // (quick ones): 16 in a row, each cut while the node holds a ring slot
    // for it. Had each kept even one slot, the ring (16 slots) would run
    // dry and the writes below would hang.
    let shapes = [CHUNK / 2, 3 * CHUNK + 5, 7 * CHUNK + 1, 5 * CHUNK];
    for (i, cut) in shapes.into_iter().chain([CHUNK / 2; 12]).enumerate() {
        let conn = raw_authed_conn(node).await;
        let (mut send, _recv) = conn.open_bi().await.unwrap();
        let body = proto::to_body(&proto::MemWrite {
            lease: lease.id(),
            buf: buf.id(),
            offset: 0,
            after: 0,
        });
        let h = Header::request(Opcode::MemWrite, 2, body.len() as u32, SIZE as u32);
        // Bytes of its own (unlike any earlier cut's), so the node's
        // progress shows in the buffer.
        let part = pattern(cut, 0xC0 + i as u8);
        let at = taken_up_to(cut);
        if at > 0 {
            let before = s.read(&buf, at as u64 - 8, 8).await.unwrap();
            assert_ne!(before, part[at - 8..at], "cut {i}: pick another seed");
        }
        proto::write_frame(&mut send, &h, &body, &part)
            .await
            .unwrap();
        wait_midway(&s, &buf, &conn, &part).await;
        conn.close(0u32.into(), b"gone");
    }
    let data = pattern(SIZE, 3);
    let done = tokio::time::timeout(Duration::from_secs(20), async {
        for _ in 0..3 {
            s.write(&buf, 0, &data).await.unwrap();
            let back = s.read(&buf, 0, SIZE as u32).await.unwrap();
            assert!(back == data, "read-back differs after cut-off transfers");
        }
    })
    .await;
    assert!(
        done.is_ok(),
        "the lease stopped serving after cut-off transfers"
    );
    assert_eq!(lease.query().await.unwrap().state, LeaseState::Active);
    drop(buf);
    fx.free_and_shutdown().await;
}
