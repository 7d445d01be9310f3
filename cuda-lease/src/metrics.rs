//! Prometheus metrics in the text exposition format, served over plain HTTP.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// The node's counters. Gauges computed from the lease table are passed to
/// [`Metrics::render`].
#[derive(Debug, Default)]
pub struct Metrics {
    /// Leases granted.
    pub lease_acquired: AtomicU64,
    /// Leases ended (freed, expired, failed or shut down).
    pub lease_dropped: AtomicU64,
    /// GPU_SUBMIT requests served.
    pub submit_total: AtomicU64,
    /// GPU_SUBMIT requests that failed.
    pub submit_errors: AtomicU64,
    /// Output bytes returned by GPU_SUBMIT.
    pub submit_output_bytes: AtomicU64,
    /// BATCH requests (one per round trip of a pipeline).
    pub batch_total: AtomicU64,
    /// Commands carried by BATCH requests.
    pub batch_commands: AtomicU64,
    /// CUDA C modules compiled by workers (each kept node-wide as PTX).
    pub modules_compiled: AtomicU64,
}

impl Metrics {
    /// Adds one to a counter.
    pub fn inc(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Renders all metrics; `vram_allocated` and `active_leases` are gauges.
    pub fn render(&self, vram_allocated: u64, active_leases: u64) -> String {
        let mut s = String::new();
        let mut put = |name: &str, kind: &str, help: &str, v: u64| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        };
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        put(
            "gpu_lease_acquired",
            "counter",
            "Leases granted.",
            get(&self.lease_acquired),
        );
        put(
            "gpu_lease_dropped",
            "counter",
            "Leases ended.",
            get(&self.lease_dropped),
        );
        put(
            "gpu_submit_total",
            "counter",
            "GPU_SUBMIT requests.",
            get(&self.submit_total),
        );
        put(
            "gpu_submit_errors",
            "counter",
            "Failed GPU_SUBMIT requests.",
            get(&self.submit_errors),
        );
        put(
            "gpu_submit_output_bytes",
            "counter",
            "Output bytes returned by GPU_SUBMIT.",
            get(&self.submit_output_bytes),
        );
        put(
            "gpu_batch_total",
            "counter",
            "BATCH requests (round trips of pipelines).",
            get(&self.batch_total),
        );
        put(
            "gpu_batch_commands_total",
            "counter",
            "Commands carried by BATCH requests.",
            get(&self.batch_commands),
        );
        put(
            "gpu_modules_compiled_total",
            "counter",
            "CUDA C modules compiled by NVRTC (kept node-wide as PTX).",
            get(&self.modules_compiled),
        );
        put(
            "gpu_vram_allocated_bytes",
            "gauge",
            "Bytes allocated by leases.",
            vram_allocated,
        );
        put(
            "gpu_lease_active",
            "gauge",
            "Leases alive now.",
            active_leases,
        );
        s
    }
}

/// Serves `GET /metrics` on `listener` until the task is aborted; `render`
/// produces the body.
pub(crate) async fn serve<F>(listener: TcpListener, render: F)
where
    F: Fn() -> String + Send + Sync + 'static,
{
    let render = std::sync::Arc::new(render);
    loop {
        let Ok((mut sock, _)) = listener.accept().await else {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let render = render.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 8192];
            let mut n = 0;
            let read = async {
                while n < buf.len() {
                    let m = sock.read(&mut buf[n..]).await?;
                    if m == 0 {
                        break;
                    }
                    n += m;
                    if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                std::io::Result::Ok(())
            };
            if tokio::time::timeout(std::time::Duration::from_secs(5), read)
                .await
                .is_err()
            {
                return;
            }
            let req = String::from_utf8_lossy(&buf[..n]);
            let resp = if req.starts_with("GET /metrics") || req.starts_with("GET / ") {
                let body = render();
                format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                )
            } else {
                "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    .to_string()
            };
            let _ = sock.write_all(resp.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}
