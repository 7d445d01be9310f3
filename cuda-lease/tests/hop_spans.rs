//! The per-hop timings as `tracing` spans: with a subscriber that takes the
//! hop target, a batch over the memory-device node closes a `node-batch`
//! span with every phase of it recorded, and the client's hops too.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::Subscriber;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

/// Appends what it is given to a shared buffer.
struct LogSink(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A closed span: its name and its fields, in the order recorded.
type Closed = (String, Vec<(String, String)>);

/// Keeps the fields of hop spans and hands them over when they close.
struct Capture(Arc<Mutex<Vec<Closed>>>);

struct Fields(Vec<(String, String)>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push((field.name().to_owned(), format!("{value:?}")));
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut f = Fields(Vec::new());
        attrs.record(&mut f);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(f);
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            if let Some(f) = span.extensions_mut().get_mut::<Fields>() {
                values.record(f);
            }
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(&id) {
            let fields = span
                .extensions_mut()
                .remove::<Fields>()
                .map_or_else(Vec::new, |f| f.0);
            self.0
                .lock()
                .unwrap()
                .push((span.name().to_owned(), fields));
        }
    }
}

#[test]
fn a_batch_closes_a_node_batch_span_with_its_phases() {
    let closed: Arc<Mutex<Vec<Closed>>> = Arc::default();
    let filter = tracing_subscriber::filter::Targets::new()
        .with_target(cuda_lease::hops::TARGET, tracing::Level::TRACE);
    // And the lines the hop layer prints, for the scripts that read them.
    let log: Arc<Mutex<Vec<u8>>> = Arc::default();
    let sink = log.clone();
    let subscriber = tracing_subscriber::registry()
        .with(Capture(closed.clone()).with_filter(filter.clone()))
        .with(cuda_lease::hops::format_layer(move || LogSink(sink.clone())).with_filter(filter));
    // Global: the node's tasks run on the runtime's threads.
    tracing::subscriber::set_global_default(subscriber).unwrap();
    assert!(cuda_lease::hops::enabled());

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let fx = Fixture::memory(1 << 20).lease(1 << 16).start().await;
        let buf = fx.session().alloc(4096).await.unwrap();
        fx.session().write(&buf, 0, &[7; 64]).await.unwrap();
        // One BATCH: an allocation, a write and a read of it.
        let mut rec = fx.session().recorder();
        let b = rec.alloc(0, 256);
        rec.write(0, b, 0, &[1; 256]);
        rec.read(0, b, 0, 256);
        let done = rec.submit().await.unwrap();
        assert!(done.error().is_none(), "{:?}", done.error());
        fx.free_and_shutdown().await;
    });

    let closed = closed.lock().unwrap();
    let field = |f: &[(String, String)], name: &str| {
        f.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    };
    let batches: Vec<_> = closed.iter().filter(|(n, _)| n == "node-batch").collect();
    assert!(!batches.is_empty(), "no node-batch span closed: {closed:?}");
    // The batch that reached the worker (the alloc) has every phase.
    let (_, f) = batches
        .iter()
        .find(|(_, f)| field(f, "worker_us").is_some())
        .unwrap_or_else(|| panic!("no node-batch span called the worker: {batches:?}"));
    let phases: Vec<&str> = f
        .iter()
        .map(|(k, _)| k.as_str())
        .filter(|k| k.ends_with("_us") && *k != "at_us")
        .collect();
    assert_eq!(
        phases,
        [
            "decode_us",
            "order_us",
            "lock_us",
            "plan_us",
            "encode_us",
            "worker_us",
            "commit_us",
            "reply_us"
        ],
        "{f:?}"
    );
    for (k, v) in f.iter().filter(|(k, _)| k.ends_with("_us")) {
        assert!(v.parse::<u64>().is_ok(), "{k}={v}");
    }
    let at = field(f, "at_us").unwrap().parse::<u64>().unwrap();
    assert!(at > 0 && at <= cuda_lease::hops::now_us(), "at_us={at}");
    assert_eq!(field(f, "op").as_deref(), Some("Batch"), "{f:?}");
    assert!(field(f, "bytes").is_some(), "{f:?}");

    // The client's side: each request, and the write's node hop.
    let client = closed.iter().filter(|(n, _)| n == "client").count();
    assert!(client >= 2, "client spans: {closed:?}");
    assert!(
        closed.iter().any(|(n, f)| n == "node"
            && field(f, "op").as_deref() == Some("MemWrite")
            && field(f, "reply_us").is_some()),
        "no node span of the MEM_WRITE: {closed:?}"
    );

    // `scripts/hop-summary` reads the printed lines into the same phases.
    let log = String::from_utf8(log.lock().unwrap().clone()).unwrap();
    assert!(log.contains("node-batch{at_us="), "{log}");
    let path = std::env::temp_dir().join(format!("cuda-lease-hops-{}.log", std::process::id()));
    std::fs::write(&path, &log).unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/hop-summary");
    let out = match std::process::Command::new("python3")
        .arg(script)
        .arg(&path)
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            eprintln!("python3 not run ({e}): hop-summary not checked");
            return;
        }
    };
    let _ = std::fs::remove_file(&path);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{table}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        table.lines().any(|l| l.contains("| node-batch |")
            && l.contains("decode ")
            && l.contains("worker ")
            && l.contains("reply ")),
        "{table}"
    );
}
