//! The transport settings over QUIC on loopback (in-memory device): a
//! client and a node with the same or with mismatched settings connect and
//! move bytes exactly, on one connection and striped; settings known to
//! fail are refused before anything is bound.

mod common;

use std::sync::Arc;

use common::*;
use cuda_lease::client::{Client, ErrorKind};
use cuda_lease::node::{Node, NodeError};
use cuda_lease::TransportSettings;

/// Bytes moved each way: several MiB (above every stream window of the
/// presets' smallest, 1.25 MB) and an odd tail.
const BYTES: usize = (3 << 20) + 123;

/// A node with `node`'s settings and a client with `client`'s (one
/// connection, then striped over 2): inventory, a lease, MEM_WRITE and
/// MEM_READ byte-exact.
async fn serve_with(node: TransportSettings, client: TransportSettings) {
    let what = format!("node {node:?}, client {client:?}");
    let fx = Fixture::memory(64 << 20)
        .config(|c| c.transport = node)
        .start()
        .await;
    let data: Vec<u8> = (0..BYTES).map(|i| (i * 7 + i / 4093) as u8).collect();
    for cfg in [
        client_config(&fx.node)
            .transport(client.clone())
            .stripes(1, 0),
        client_config(&fx.node)
            .transport(client.clone())
            .stripes(2, 1 << 20),
    ] {
        let c = Arc::new(
            Client::connect(fx.node.addr(), &cfg)
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}")),
        );
        assert_eq!(c.inventory().await.unwrap().devices.len(), 1, "{what}");
        let lease = lease_of(&c, 16 << 20).await;
        let s = lease.session();
        let buf = s.alloc(BYTES as u64 + 1).await.unwrap();
        s.write(&buf, 1, &data).await.unwrap();
        let back = s.read(&buf, 1, BYTES as u32).await.unwrap();
        assert!(back == data, "{what}: MEM_READ differs from MEM_WRITE");
        drop(buf);
        lease.free().await.unwrap();
    }
    fx.shutdown().await;
}

#[tokio::test]
async fn loopback_settings_on_both_ends_serve() {
    serve_with(TransportSettings::loopback(), TransportSettings::loopback()).await;
}

#[tokio::test]
async fn mismatched_settings_still_serve() {
    serve_with(TransportSettings::default(), TransportSettings::loopback()).await;
    serve_with(TransportSettings::loopback(), TransportSettings::default()).await;
    serve_with(
        TransportSettings::datacenter_jumbo(),
        TransportSettings::wan(),
    )
    .await;
}

#[tokio::test]
async fn settings_known_to_fail_are_refused() {
    // A 65,507-byte MTU with segmentation offload on would fall back to
    // 1,200 bytes once running: refused up front instead.
    let bad = TransportSettings {
        segmentation_offload: true,
        ..TransportSettings::loopback()
    };
    let mut cfg = memory_config(1 << 20);
    cfg.transport = bad.clone();
    match Node::spawn_local(cfg).await {
        Err(NodeError::Config(m)) => assert!(m.contains("segmentation offload"), "{m}"),
        other => panic!("expected a config error, got {other:?}"),
    }
    let fx = Fixture::memory(1 << 20).start().await;
    let err = Client::connect(fx.node.addr(), &client_config(&fx.node).transport(bad))
        .await
        .unwrap_err();
    assert!(matches!(err.kind(), ErrorKind::Config), "{err:?}");
    fx.shutdown().await;
}
