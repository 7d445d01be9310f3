//! The remote topics on the in-memory device, with no GPU: every topic's
//! code path at tiny sizes (the library), and one topic through the
//! `bench-report` binary (topic selection, the worker re-exec, the table).

use std::process::Command;
use std::time::Duration;

use benches::remote::{self, Bench, PoolConfig, RemoteConfig};
use benches::report::{Goal, Report};
use cuda_lease_node::worker::DeviceSpec;

/// Tiny sizes and counts: seconds, not minutes.
fn tiny() -> RemoteConfig {
    RemoteConfig {
        device: DeviceSpec::Memory {
            capacity: 512 << 20, // the node keeps 256 MiB of headroom
        },
        // The report binary calls `main_if_worker`; a test harness does not.
        worker: env!("CARGO_BIN_EXE_report").into(),
        spin: None,
        iters: 4,
        xfer_iters: 1,
        bytes: 64 << 10,
        refill: Duration::from_millis(20),
        in_task: false,
        worker_cpus: None,
        server_threads: None,
        direct: false,
        client_spin: false,
        busy_poll: None,
        transport: ("loopback".into(), cuda_lease::TransportSettings::loopback()),
        stripes: cuda_lease::client::DEFAULT_STRIPES,
        stamps: true,
        pool: PoolConfig {
            tasks: 8,
            pipelines: 2,
            rounds: 1,
            spin: Duration::from_millis(50),
            spin_rounds: 1,
        },
    }
}

#[test]
fn every_remote_topic_runs_on_the_memory_device() {
    let bench = Bench::start(tiny()).expect("an embedded node with the memory device");
    assert!(bench.device().contains("Memory"), "{}", bench.device());
    let mut rows = Vec::new();
    for topic in remote::TOPICS {
        let got = bench
            .run(topic)
            .unwrap_or_else(|e| panic!("topic {topic}: {e}"));
        assert!(!got.is_empty(), "topic {topic} gave no rows");
        assert!(got.iter().all(|r| r.group == topic), "{got:?}");
        rows.extend(got);
    }
    bench.shutdown();
    // `remote_pool`'s kernel rows need a GPU: the memory device runs only
    // its test kernels.
    let pool: Vec<_> = rows.iter().filter(|r| r.group == "remote_pool").collect();
    assert_eq!(pool.len(), 5, "{pool:#?}");
    assert_eq!(
        pool.iter()
            .filter(|r| r.note.as_deref().is_some_and(|n| n.starts_with("n/a")))
            .count(),
        3,
        "{pool:#?}"
    );
    for r in rows
        .iter()
        .filter(|r| !r.note.as_deref().is_some_and(|n| n.starts_with("n/a")))
    {
        let lib = r
            .lib
            .unwrap_or_else(|| panic!("{}: no measured side", r.metric));
        assert!(lib.median > 0.0, "{}: {lib:?}", r.metric);
        if r.group != "remote_alloc" {
            assert!(
                r.ratio().is_some_and(f64::is_finite),
                "{}: no ratio",
                r.metric
            );
        }
    }
    // The remote topic's rows: BATCH, 4 transfers, the chain (no local GPU:
    // one row), the chain replayed from a graph kept on the node, the
    // chain run again as a prepared submission, one launch, one more launch in a submission, h2d and d2h each against
    // raw quinn and TCP, h2d and d2h over the bulk-data channel against
    // QUIC, raw striping up and down, the raw transports against each
    // other (6), raw quinn relayed through a child process against direct
    // and the BATCH against it; no spins.
    let remote: Vec<_> = rows.iter().filter(|r| r.group == "remote").collect();
    assert_eq!(remote.len(), 26, "{remote:#?}");
    assert_eq!(
        remote.iter().filter(|r| r.metric.contains("relay")).count(),
        2,
        "{remote:#?}"
    );
    assert!(remote
        .iter()
        .any(|r| r.metric.starts_with("one more launch in a submission")));
    assert!(remote
        .iter()
        .any(|r| r.metric.contains("replayed from a graph kept on the node")));
    assert!(remote
        .iter()
        .any(|r| r.metric.contains("run again as a prepared submission")));
    assert!(remote.iter().any(|r| r
        .metric
        .contains("bulk-data channel (TLS over TCP) vs QUIC")));
    // Raw against raw carries no goal.
    for r in remote.iter().filter(|r| r.metric.starts_with("raw quinn")) {
        assert_eq!(r.goal, Goal::None, "{}", r.metric);
    }
    assert!(remote
        .iter()
        .any(|r| r.metric.contains("loopback settings, vs TCP on loopback")));
    assert!(remote
        .iter()
        .any(|r| r.metric.contains("MEM_READ 64 KiB striped")));
    assert!(!remote.iter().any(|r| r.metric.contains("spin")));
    let table = Report {
        device: "remote: memory".into(),
        compute_capability: None,
        driver_version: None,
        kernels: "-",
        scale: 1.0,
        unix_time: 0,
        wall_s: 0.0,
        rows,
    };
    let md = table.markdown();
    assert!(md.contains("| one-kernel BATCH p50 vs raw quinn 64 B request/reply (interleaved) | "));
    assert!(table.json().contains("\"compute_capability\": null"));
}

#[test]
fn the_chain_and_launch_topics_run_on_leases_served_directly() {
    let bench = Bench::start(RemoteConfig {
        direct: true,
        ..tiny()
    })
    .expect("an embedded node with direct leases");
    for topic in ["remote_chain", "remote_launch"] {
        let got = bench
            .run(topic)
            .unwrap_or_else(|e| panic!("topic {topic}: {e}"));
        assert!(!got.is_empty(), "topic {topic} gave no rows");
        for r in &got {
            let lib = r
                .lib
                .unwrap_or_else(|| panic!("{}: no measured side", r.metric));
            assert!(lib.median > 0.0, "{}: {lib:?}", r.metric);
        }
    }
    bench.shutdown();
}

#[test]
fn the_report_binary_runs_a_remote_topic_without_a_gpu() {
    let dir = std::env::temp_dir().join(format!("benches-remote-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let json = dir.join("report.json");
    let out = Command::new(env!("CARGO_BIN_EXE_report"))
        .arg(&json)
        .env("REPORT_ONLY", "remote_launch")
        .env("REPORT_REMOTE_DEVICE", "memory")
        .env("REPORT_SCALE", "0.01")
        .env("REPORT_TIMEOUT_S", "120")
        .output()
        .expect("run bench-report");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("| one awaited launch on the lease vs 64 B request/reply (interleaved; no local GPU: remote alone) | "),
        "{stdout}"
    );
    let js = std::fs::read_to_string(&json).expect("the JSON file");
    assert!(js.contains("\"group\": \"remote_launch\""), "{js}");
    let _ = std::fs::remove_dir_all(&dir);
}
