//! The transport settings over QUIC on loopback (in-memory device): a
//! client and a node with the same or with mismatched settings connect and
//! move bytes exactly, on one connection and striped; settings known to
//! fail are refused before anything is bound.

use std::sync::Arc;

use crate::common::*;
use cuda_lease::client::{Client, ErrorKind};
use cuda_lease::TransportSettings;
use cuda_lease_node::node::{Node, NodeError};

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

/// The shipped `deploy/node.toml` names only flags the node has, with
/// values its flags take (a copy with a memory device and a development
/// certificate starts and serves); an unknown setting stops the node with
/// a message naming it.
#[cfg(feature = "cli")]
#[test]
fn the_shipped_node_config_is_one_the_node_takes() {
    use std::process::{Command, Stdio};
    let node = env!("CARGO_BIN_EXE_cuda-lease-node");
    let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/node.toml");
    let out = Command::new(node)
        .args(["--config", shipped, "--help"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Its values parse: the same file, with what needs no certificate,
    // token file or GPU, serves until stopped.
    let dir = std::env::temp_dir().join(format!("cuda-lease-deploy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = std::fs::read_to_string(shipped).unwrap();
    let local: String = text
        .lines()
        .map(|l| match l.split(" = ").next() {
            Some("cert") => "dev = true".to_owned(),
            Some("key") => format!("dev-cert-out = \"{}\"", dir.join("c.pem").display()),
            Some("token-file") => "allow-anonymous = true".to_owned(),
            Some("cuda-include") => "memory-device = \"64M\"".to_owned(),
            Some("listen") => "listen = \"127.0.0.1:0\"".to_owned(),
            Some("metrics-listen") => "metrics-listen = \"127.0.0.1:0\"".to_owned(),
            Some("log-format") => "log-format = \"json\"".to_owned(),
            _ => l.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n");
    let file = dir.join("node.toml");
    std::fs::write(&file, local).unwrap();
    let mut child = Command::new(node)
        .arg("--config")
        .arg(&file)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Its log, then the line saying where it listens, on stderr.
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        let mut log = Vec::new();
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if line.contains("listening on") {
                let _ = tx.send((line, log));
                return;
            }
            log.push(line);
        }
    });
    let got = rx.recv_timeout(std::time::Duration::from_secs(30));
    let _ = child.kill();
    let _ = child.wait();
    let (line, log) = got.expect("the node did not say where it listens within 30 s");
    assert!(line.contains("listening on 127.0.0.1:"), "{line:?}");
    // `log-format = "json"`: one JSON object per log line.
    assert!(!log.is_empty());
    assert!(
        log.iter()
            .all(|l| l.starts_with("{\"timestamp\"") && l.ends_with('}')),
        "{log:#?}"
    );
    // An unknown setting is named.
    std::fs::write(&file, "listen = \"127.0.0.1:0\"\nbogus = 1\n").unwrap();
    let out = Command::new(node)
        .arg("--config")
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown setting `bogus`"), "{err}");
}
