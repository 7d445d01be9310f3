//! Prometheus metrics: the node's counters and gauges in a
//! [`prometheus_client`] registry, served as OpenMetrics text on
//! `GET /metrics`. The crate's README lists the names.

use std::convert::Infallible;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, ALLOW, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};
use tokio::net::TcpListener;
use tracing::debug;

/// The content type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE_OPENMETRICS: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A monotonic counter; adding is one relaxed atomic add.
pub type Counter = prometheus_client::metrics::counter::Counter<u64, AtomicU64>;

type GaugeU64 = Gauge<u64, AtomicU64>;

/// The node's metrics and registry; lease-table gauges are passed to
/// [`Metrics::render`].
#[derive(Debug, Default)]
pub struct Metrics {
    /// Leases granted.
    pub lease_acquired: Counter,
    /// Leases ended (freed, expired, failed or shut down).
    pub lease_dropped: Counter,
    /// GPU_SUBMIT requests served.
    pub submit_total: Counter,
    /// GPU_SUBMIT requests that failed.
    pub submit_errors: Counter,
    /// Output bytes returned by GPU_SUBMIT.
    pub submit_output_bytes: Counter,
    /// BATCH requests (one per round trip of a pipeline).
    pub batch_total: Counter,
    /// Commands carried by BATCH requests.
    pub batch_commands: Counter,
    /// Of `batch_total`, those a lease's worker served on its direct path
    /// (learned from the worker at the node's next look at the lease).
    pub batch_direct: Counter,
    /// CUDA C modules compiled by workers (on the node's path each is
    /// kept node-wide as PTX; a direct lease's worker keeps its own).
    pub modules_compiled: Counter,
    /// Connections of the bulk-data channel opened with a ticket.
    pub bulk_connections: Counter,
    /// MEM_WRITE / MEM_READ data bytes on the bulk-data channel (counted at start).
    pub bulk_bytes: Counter,
    /// Connections that waited in the handshake queue for a HELLO place.
    pub handshakes_queued: Counter,
    /// Connections refused pre-handshake (queue full, or no place in time).
    pub handshakes_refused: Counter,
    /// Lease worker processes started (one per granted LEASE_ALLOC).
    pub worker_starts: Counter,
    /// LEASE_ALLOCs refused over their principal's worker-start rate.
    pub worker_starts_refused: Counter,
    vram_allocated: GaugeU64,
    lease_active: GaugeU64,
    /// Connections holding a HELLO place.
    pub handshakes_waiting: GaugeU64,
    /// Every metric above, registered on the first render.
    registry: std::sync::OnceLock<Registry>,
}

impl Metrics {
    fn registry(&self) -> Registry {
        let mut registry = Registry::default();
        let r = &mut registry;
        // Base names: the encoder appends the unit and `_total`.
        let counters = [
            (
                "gpu_lease_acquired",
                "Leases granted.",
                &self.lease_acquired,
            ),
            ("gpu_lease_dropped", "Leases ended.", &self.lease_dropped),
            ("gpu_submit", "GPU_SUBMIT requests.", &self.submit_total),
            (
                "gpu_submit_errors",
                "Failed GPU_SUBMIT requests.",
                &self.submit_errors,
            ),
            (
                "gpu_batch",
                "BATCH requests (round trips of pipelines).",
                &self.batch_total,
            ),
            (
                "gpu_batch_commands",
                "Commands carried by BATCH requests.",
                &self.batch_commands,
            ),
            (
                "gpu_batch_direct",
                "Of gpu_batch, those served by a lease's worker directly (LEASE_DIRECT).",
                &self.batch_direct,
            ),
            (
                "gpu_modules_compiled",
                "CUDA C modules compiled by NVRTC (on the node's path kept node-wide as PTX).",
                &self.modules_compiled,
            ),
            (
                "gpu_bulk_connections",
                "Connections of the bulk-data channel (TLS over TCP) opened with a ticket.",
                &self.bulk_connections,
            ),
            (
                "gpu_handshakes_queued",
                "Connections that waited in the handshake queue for a place among those waiting for HELLO.",
                &self.handshakes_queued,
            ),
            (
                "gpu_handshakes_refused",
                "Connections refused before their handshake (queue full, or no place by the HELLO deadline).",
                &self.handshakes_refused,
            ),
            (
                "gpu_worker_starts",
                "Lease worker processes taken for granted LEASE_ALLOCs.",
                &self.worker_starts,
            ),
            (
                "gpu_worker_starts_refused",
                "LEASE_ALLOCs refused over their principal's worker-start rate.",
                &self.worker_starts_refused,
            ),
        ];
        for (name, help, c) in counters {
            r.register(name, help, c.clone());
        }
        r.register_with_unit(
            "gpu_submit_output",
            "Output bytes returned by GPU_SUBMIT.",
            Unit::Bytes,
            self.submit_output_bytes.clone(),
        );
        r.register_with_unit(
            "gpu_bulk_data",
            "Data of MEM_WRITE and MEM_READ requests served over the bulk-data channel.",
            Unit::Bytes,
            self.bulk_bytes.clone(),
        );
        r.register_with_unit(
            "gpu_vram_allocated",
            "Bytes allocated by leases.",
            Unit::Bytes,
            self.vram_allocated.clone(),
        );
        r.register(
            "gpu_lease_active",
            "Leases alive now.",
            self.lease_active.clone(),
        );
        r.register(
            "gpu_handshakes_waiting",
            "Connections between arrival and HELLO holding a place now (the queue not counted).",
            self.handshakes_waiting.clone(),
        );
        let build = Family::<[(&'static str, &'static str); 1], GaugeU64>::default();
        build
            .get_or_create(&[("version", env!("CARGO_PKG_VERSION"))])
            .set(1);
        r.register(
            "cuda_lease_build_info",
            "The cuda-lease version of this node (always 1).",
            build,
        );
        registry
    }

    /// Renders all metrics as [`CONTENT_TYPE_OPENMETRICS`], with the gauges' values.
    pub fn render(&self, vram_allocated: u64, active_leases: u64) -> String {
        self.vram_allocated.set(vram_allocated);
        self.lease_active.set(active_leases);
        let mut s = String::new();
        let registry = self.registry.get_or_init(|| self.registry());
        prometheus_client::encoding::text::encode(&mut s, registry)
            .expect("writing to a String does not fail");
        s
    }
}

/// How long a client may take to send a request's headers.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Serves `GET`/`HEAD /metrics` over HTTP/1.1 until aborted; `render`
/// produces the body. Other paths get 404, other methods 405.
pub(crate) async fn serve<F>(listener: TcpListener, render: F)
where
    F: Fn() -> String + Send + Sync + 'static,
{
    let render = Arc::new(render);
    loop {
        let sock = match listener.accept().await {
            Ok((sock, _)) => sock,
            Err(e) => {
                debug!(error = %e, "metrics accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let render = render.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let render = render.clone();
                async move { Ok::<_, Infallible>(respond(&req, &*render)) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(sock), svc);
            if let Err(e) = conn.await {
                debug!(error = %e, "metrics connection ended");
            }
        });
    }
}

fn respond<B>(req: &Request<B>, render: &dyn Fn() -> String) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, body: String| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        r
    };
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = reply(StatusCode::METHOD_NOT_ALLOWED, String::new());
        r.headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    if req.uri().path() != "/metrics" {
        return reply(StatusCode::NOT_FOUND, String::new());
    }
    let mut r = reply(StatusCode::OK, render());
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static(CONTENT_TYPE_OPENMETRICS),
    );
    r
}
