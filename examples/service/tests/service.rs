//! The service on the in-memory lease device (no GPU needed): a request
//! answered correctly (JSON and binary), a bad body answered 400, a full
//! queue answered 503, metrics, and a clean stop on SIGTERM.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use cuda_async::RemotePolicy;
use cuda_async_service::model::{random, HostWeights, Model, CLASSES, D_IN};
use cuda_async_service::{router, Backend, Options, Service};
use cuda_lease::client::{ClientConfig, Lease};
use cuda_lease::remote::LeaseBackend;
use cuda_lease_node::{DeviceSpec, Node, NodeConfig, WorkerSpec};

#[test]
fn a_request_is_answered_a_bad_body_is_a_400_and_sigterm_stops_it_cleanly() {
    let svc = Running::start(&[]);
    let weights = HostWeights::random(1);
    let x = random(3 * D_IN, 42, 1.0);
    let want = weights.reference(&x, 3);

    let (status, body) = request(
        svc.addr,
        "POST",
        "/infer",
        "application/json",
        &json_body(&x),
    );
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let got: Vec<f32> = v["outputs"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|f| f.as_f64().unwrap() as f32)
        })
        .collect();
    assert_close(&got, &want);

    let (status, got, _) = infer_binary(svc.addr, &x);
    assert_eq!(status, 200);
    assert_eq!(got.len(), 3 * CLASSES);
    assert_close(&got, &want);

    let bad = serde_json::to_vec(&serde_json::json!({ "inputs": [[1.0, 2.0]] })).unwrap();
    let (status, body) = request(svc.addr, "POST", "/infer", "application/json", &bad);
    assert_eq!(status, 400);
    let msg = String::from_utf8_lossy(&body);
    assert!(msg.starts_with("inputs[0]: 2 values"), "{msg}");

    let (status, body) = request(svc.addr, "GET", "/metrics", "text/plain", b"");
    assert_eq!(status, 200);
    let text = String::from_utf8_lossy(&body);
    assert!(text.contains("service_responses_ok_total 2"), "{text}");
    assert!(
        text.contains("service_responses_bad_request_total 1"),
        "{text}"
    );
    assert!(
        text.contains("service_gpu_pipeline_seconds_count"),
        "{text}"
    );

    // A request whose body is still coming when SIGTERM arrives is
    // answered; then the service exits 0. (`100 Continue` says the server
    // has the head and waits for the body.)
    let mut s = TcpStream::connect(svc.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body = json_body(&x);
    let mut h = head("POST", "/infer", "application/json", &body);
    h.truncate(h.len() - 2);
    h.extend_from_slice(b"expect: 100-continue\r\n\r\n");
    s.write_all(&h).unwrap();
    let mut interim = Vec::new();
    while !interim.ends_with(b"\r\n\r\n") {
        let mut b = [0u8];
        s.read_exact(&mut b).unwrap();
        interim.push(b[0]);
    }
    assert!(interim.starts_with(b"HTTP/1.1 100"), "{interim:?}");
    sigterm(&svc.child);
    s.write_all(&body).unwrap();
    let (status, _) = response(s);
    assert_eq!(status, 200, "the request in flight is answered");
    let exit = svc.stop();
    assert!(exit.success(), "{exit:?}");
}

#[test]
fn with_batching_on_each_request_gets_its_own_rows() {
    let svc = Running::start(&["--batch-window-us", "2000", "--max-batch", "8"]);
    let weights = HostWeights::random(1);
    let threads: Vec<_> = (0..6u64)
        .map(|k| {
            let addr = svc.addr;
            let n = 1 + (k as usize % 3);
            let x = random(n * D_IN, 100 + k, 1.0);
            let want = weights.reference(&x, n);
            std::thread::spawn(move || {
                let (status, got, body) = infer_binary(addr, &x);
                assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
                assert_close(&got, &want);
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert!(svc.stop().success());
}

/// A full queue is answered 503 at once, and admits again once a slot is
/// free. In process: the test holds the queue's one slot itself.
#[test]
fn a_full_queue_is_answered_503_at_once() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // The node's workers run the service binary (it starts as a
        // worker when the node asks it to).
        let mut cfg = NodeConfig::new(WorkerSpec {
            program: service_exe(),
            ..WorkerSpec::current_exe(DeviceSpec::Memory { capacity: 1 << 28 }).unwrap()
        });
        cfg.tokens = vec!["t".into()];
        cfg.capacity = Some(1 << 28);
        let node = Node::spawn_local(cfg).await.unwrap();
        let config = ClientConfig::pinned(node.cert_der().clone()).token("t");
        let lease = Lease::builder()
            .min_vram(64 << 20)
            .config(config)
            .connect(node.addr())
            .await
            .unwrap();
        let remote = Arc::new(RemotePolicy::new(&LeaseBackend::current(lease.session())));
        let model = Model::upload(&HostWeights::random(1), &*remote)
            .await
            .unwrap();
        let options = Options {
            queue: 1,
            ..Options::default()
        };
        let backend = Backend::Ops {
            model,
            policy: remote,
            submit: Some(Arc::new(cuda_async::SubmitThread::new().unwrap())),
            graphs: None,
        };
        let service = Service::new(backend, options);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = router(service.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        let body = json_body(&random(D_IN, 7, 1.0));
        let ask = move || {
            let body = body.clone();
            tokio::task::spawn_blocking(move || {
                request(addr, "POST", "/infer", "application/json", &body)
            })
        };
        // The one slot is taken: answered 503 at once.
        let slot = service.try_admit().expect("a free slot");
        let (status, body) = ask().await.unwrap();
        assert_eq!(status, 503, "{}", String::from_utf8_lossy(&body));
        assert!(service.try_admit().is_none());
        // Free again: answered.
        drop(slot);
        let (status, body) = ask().await.unwrap();
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        drop(lease);
        node.shutdown().await;
    });
}
