//! An HTTP inference service built on `cuda-async` ops: `POST /infer`
//! runs the MLP forward pass of [`model`] on the samples of a request (or
//! of a batch of requests, with dynamic batching on) as one pipeline, and
//! answers with each sample's class probabilities.
//!
//! - **Bodies.** JSON `{"inputs": [[f32; 512], ...]}` answered with
//!   `{"outputs": [[f32; 10], ...]}`; or, with `Content-Type:
//!   application/octet-stream`, the samples' `f32`s little-endian end to
//!   end, answered the same way in binary. A body that is not that is a
//!   400 naming what is wrong.
//! - **Back-pressure.** At most [`Options::queue`] requests are admitted
//!   (waiting or running); one more is answered 503 at once.
//! - **Dynamic batching** ([`Options::batch_window`] above zero): requests
//!   are run as one pipeline of up to [`Options::max_batch`] samples (one
//!   GEMM for all of them), and each response gets its rows. A batch goes
//!   at once with the requests that have arrived while fewer than
//!   [`Options::batches_in_flight`] batches run; otherwise it waits for
//!   company until one of them ends, it is full, or the window has passed
//!   since its first request.
//! - **Errors.** A failed pipeline is a 500 with the error; a sticky GPU
//!   fault (the context is lost) also stops the service (see
//!   [`Service::fatal`]), which exits non-zero.
//! - **Metrics.** `GET /metrics`: Prometheus text, request latency and GPU
//!   time per pipeline (histograms) and responses by status.
//! - **Backends** ([`Backend`]): the ops on any scheduling policy (the
//!   local pool, a lease), or the [`baseline`]: the same math with cudarc
//!   called from `spawn_blocking`.

pub mod baseline;
#[cfg(feature = "fleet")]
pub mod fleet;
pub mod model;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use cuda_async::prelude::*;
use cuda_async::SchedulingPolicy;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};
use tokio::sync::{mpsc, oneshot, Notify, OwnedSemaphorePermit, Semaphore};

use model::{ForwardGraph, Model, CLASSES, D_IN};

/// How the service runs requests.
#[derive(Debug, Clone)]
pub struct Options {
    /// Requests admitted at once (waiting or running); more are answered
    /// 503.
    pub queue: usize,
    /// Requests arriving within this window run as one batch; zero: each
    /// request runs alone.
    pub batch_window: Duration,
    /// Samples a batch (and a request) at most.
    pub max_batch: usize,
    /// Batches running at once before a new one waits for company (at
    /// most the window).
    pub batches_in_flight: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            queue: 1024,
            batch_window: Duration::ZERO,
            max_batch: 256,
            batches_in_flight: 1,
        }
    }
}

/// A request's samples on their way to a batch, and where its rows go.
struct Job {
    x: Vec<f32>,
    n: usize,
    reply: oneshot::Sender<Result<Vec<f32>, String>>,
}

/// What runs a pipeline.
pub enum Backend {
    /// The model's ops, scheduled on `policy` (where its weights live).
    Ops {
        /// The model, uploaded through `policy`.
        model: Model,
        /// Where its pipelines run.
        policy: Arc<dyn SchedulingPolicy>,
        /// The thread that enqueues every pipeline (`None`: each request's
        /// task enqueues its own). One thread making the driver calls
        /// serves more requests than every executor thread making them at
        /// once (the CUDA driver serializes them).
        submit: Option<Arc<cuda_async::SubmitThread>>,
        /// Forward passes captured as CUDA graphs, by batch size (`None`:
        /// every pipeline is enqueued op by op). Local pool only.
        graphs: Option<Graphs>,
    },
    /// The model's ops on leases of a fleet, each with its own copy of the
    /// weights ([`fleet`]): a pipeline runs on the lease with the fewest
    /// in flight, and again on another when its node is lost.
    #[cfg(feature = "fleet")]
    Fleet {
        /// The leases.
        replicas: Arc<fleet::Replicas>,
        /// As for [`Backend::Ops`].
        submit: Option<Arc<cuda_async::SubmitThread>>,
    },
    /// cudarc from `spawn_blocking` ([`baseline`]).
    Blocking(Arc<baseline::Baseline>),
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Backend::Ops { policy, .. } => write!(f, "ops on {policy:?}"),
            #[cfg(feature = "fleet")]
            Backend::Fleet { replicas, .. } => write!(f, "ops on {:?}", replicas.nodes()),
            Backend::Blocking(_) => f.write_str("cudarc from spawn_blocking"),
        }
    }
}

/// The service: the model on its backend, the admission bound, the batcher
/// and the metrics.
pub struct Service {
    backend: Backend,
    options: Options,
    admission: Arc<Semaphore>,
    batcher: Option<mpsc::UnboundedSender<Job>>,
    metrics: Metrics,
    fatal: tokio::sync::watch::Sender<Option<String>>,
    stopping: AtomicBool,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service")
            .field("backend", &self.backend)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl Service {
    /// A service running pipelines on `backend`. With batching on, its
    /// batcher runs on the current tokio runtime.
    ///
    /// # Panics
    ///
    /// With batching on, outside a tokio runtime.
    pub fn new(backend: Backend, options: Options) -> Arc<Self> {
        let (batcher, jobs) = if options.batch_window.is_zero() {
            (None, None)
        } else {
            let (tx, rx) = mpsc::unbounded_channel();
            (Some(tx), Some(rx))
        };
        let service = Arc::new(Service {
            backend,
            admission: Arc::new(Semaphore::new(options.queue)),
            options,
            batcher,
            metrics: Metrics::new(),
            fatal: tokio::sync::watch::channel(None).0,
            stopping: AtomicBool::new(false),
        });
        if let Some(jobs) = jobs {
            tokio::spawn(batch_loop(Arc::downgrade(&service), jobs));
        }
        service
    }

    /// Admits one request, or `None` when [`Options::queue`] are in
    /// already. The request is admitted while the permit lives.
    pub fn try_admit(&self) -> Option<OwnedSemaphorePermit> {
        self.admission.clone().try_acquire_owned().ok()
    }

    /// Becomes `Some(error)` when a sticky GPU fault lost the service's
    /// context: the service should stop (and exit non-zero).
    pub fn fatal(&self) -> tokio::sync::watch::Receiver<Option<String>> {
        self.fatal.subscribe()
    }

    /// Runs `n` samples: in a batch, or as a pipeline of their own.
    async fn infer(self: &Arc<Self>, x: Vec<f32>, n: usize) -> Result<Vec<f32>, String> {
        match &self.batcher {
            Some(batcher) => {
                let (reply, rows) = oneshot::channel();
                batcher
                    .send(Job { x, n, reply })
                    .map_err(|_| "the batcher stopped".to_string())?;
                rows.await
                    .map_err(|_| "the batch was dropped".to_string())?
            }
            None => self.run(x, n).await,
        }
    }

    /// One pipeline of `n` samples (timed on the GPU, on ops).
    async fn run(&self, x: Vec<f32>, n: usize) -> Result<Vec<f32>, String> {
        let out = match &self.backend {
            Backend::Ops {
                model,
                policy,
                submit,
                graphs,
            } => {
                self.ops(model, &**policy, submit.as_deref(), graphs.as_ref(), x, n)
                    .await
            }
            #[cfg(feature = "fleet")]
            Backend::Fleet { replicas, submit } => {
                // Each lost lease leaves the rotation: at most as many
                // tries as leases were held, and one more.
                let mut tries = replicas.count() + 1;
                loop {
                    let Some(r) = replicas.pick() else {
                        return Err("no lease of the fleet is alive".into());
                    };
                    let (model, policy) = (r.model(), r.policy());
                    match self
                        .ops(model, policy, submit.as_deref(), None, x.clone(), n)
                        .await
                    {
                        Err(e) if cuda_lease_fleet::lost(&e) && tries > 1 => {
                            replicas.lose(&r, &e);
                            tries -= 1;
                        }
                        out => break out,
                    }
                }
            }
            Backend::Blocking(b) => {
                let b = b.clone();
                return tokio::task::spawn_blocking(move || b.forward(&x, n))
                    .await
                    .map_err(|e| e.to_string())?;
            }
        };
        out.map_err(|e: cuda_async::Error| {
            if e.is_sticky() && !self.stopping.swap(true, Ordering::AcqRel) {
                eprintln!("service: the GPU context is lost, stopping: {e}");
                let _ = self.fatal.send(Some(e.to_string()));
            }
            e.to_string()
        })
    }

    /// The forward pass of `n` samples on `model`'s ops: a lent graph's
    /// replay, or the ops enqueued one by one.
    async fn ops(
        &self,
        model: &Model,
        policy: &dyn SchedulingPolicy,
        submit: Option<&cuda_async::SubmitThread>,
        graphs: Option<&Graphs>,
        x: Vec<f32>,
        n: usize,
    ) -> cuda_async::Result<Vec<f32>> {
        let lent = match graphs {
            Some(graphs) => graphs.lend(model, n).await?,
            None => None,
        };
        let (out, t) = match lent {
            Some(mut lent) => match lent.graph().run(&x, policy, submit).await {
                Ok(r) => r,
                Err(e) => {
                    lent.discard();
                    return Err(e);
                }
            },
            None => {
                let op = model.forward(x, n).timed().schedule(policy)?;
                let (out, t) = model::enqueue(submit, op).await?;
                (out.to_vec()?, t)
            }
        };
        if let Ok(gpu) = t.elapsed() {
            self.metrics.gpu.observe(gpu.as_secs_f64());
        }
        Ok(out)
    }
}

/// Forward graphs ([`Model::capture`]) by batch size, a request's size
/// rounded up to a power of two (its padding columns are zeros and their
/// outputs dropped), so a service keeps a few sizes. A graph serves one
/// request at a time; a size has at most `per_size` graphs, captured on
/// first need, and a request finding every one of its size busy runs op by
/// op.
#[derive(Debug)]
pub struct Graphs {
    /// By size: the graphs not in use, and how many exist.
    sizes: Mutex<HashMap<usize, (Vec<ForwardGraph>, usize)>>,
    per_size: usize,
}

impl Graphs {
    /// At most `per_size` graphs a batch size.
    pub fn new(per_size: usize) -> Self {
        Graphs {
            sizes: Mutex::default(),
            per_size,
        }
    }

    fn sizes(&self) -> std::sync::MutexGuard<'_, HashMap<usize, (Vec<ForwardGraph>, usize)>> {
        self.sizes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A graph for `n` samples, captured now if its size has fewer than
    /// `per_size`; `None` when all of its size are in use.
    async fn lend(&self, model: &Model, n: usize) -> cuda_async::Result<Option<Lent<'_>>> {
        let size = n.max(1).next_power_of_two();
        {
            let mut sizes = self.sizes();
            let (free, made) = sizes.entry(size).or_default();
            if let Some(g) = free.pop() {
                return Ok(Some(Lent {
                    graphs: self,
                    graph: Some(g),
                }));
            }
            if *made >= self.per_size {
                return Ok(None);
            }
            *made += 1;
        }
        let model = model.clone();
        let captured = tokio::task::spawn_blocking(move || model.capture(size))
            .await
            .unwrap_or_else(|e| Err(cuda_async::Error::InvalidArgument(e.to_string())));
        match captured {
            Ok(g) => Ok(Some(Lent {
                graphs: self,
                graph: Some(g),
            })),
            Err(e) => {
                self.forget(size);
                Err(e)
            }
        }
    }

    fn forget(&self, size: usize) {
        if let Some((_, made)) = self.sizes().get_mut(&size) {
            *made -= 1;
        }
    }
}

/// A graph lent to one request: back to its size's free list when
/// dropped (also mid-request: a later request's input write waits for the
/// replays launched before it), or gone after [`Lent::discard`].
struct Lent<'a> {
    graphs: &'a Graphs,
    graph: Option<ForwardGraph>,
}

impl Lent<'_> {
    fn graph(&self) -> &ForwardGraph {
        self.graph.as_ref().expect("lent until dropped")
    }

    /// Drops the graph (its replay failed) instead of giving it back.
    fn discard(&mut self) {
        if let Some(g) = self.graph.take() {
            self.graphs.forget(g.samples());
        }
    }
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        if let Some(g) = self.graph.take() {
            let mut sizes = self.graphs.sizes();
            sizes.entry(g.samples()).or_default().0.push(g);
        }
    }
}

/// Collects jobs into batches of up to `max_batch` samples and runs each
/// batch as one pipeline, as its own task. A batch goes at once with the
/// jobs already queued while fewer than `batches_in_flight` run; else it
/// waits for more until a running batch ends, it is full, or the window
/// has passed since its first job.
async fn batch_loop(service: std::sync::Weak<Service>, mut jobs: mpsc::UnboundedReceiver<Job>) {
    let mut next: Option<Job> = None;
    let running = Arc::new(AtomicUsize::new(0));
    let ended = Arc::new(Notify::new());
    loop {
        let first = match next.take() {
            Some(j) => j,
            None => match jobs.recv().await {
                Some(j) => j,
                None => return,
            },
        };
        let Some(svc) = service.upgrade() else {
            return;
        };
        let o = &svc.options;
        let (max, busy) = (o.max_batch, o.batches_in_flight.max(1));
        let deadline = tokio::time::Instant::now() + o.batch_window;
        let mut rows = first.n;
        let mut batch = vec![first];
        // What has arrived already.
        while next.is_none() && rows < max {
            match jobs.try_recv() {
                Ok(j) => add(&mut batch, &mut rows, max, j, &mut next),
                Err(_) => break,
            }
        }
        // The GPU is busy: company, until a batch ends or the window passes.
        while next.is_none() && rows < max && running.load(Ordering::Acquire) >= busy {
            let end = ended.notified();
            if running.load(Ordering::Acquire) < busy {
                break;
            }
            tokio::select! {
                j = jobs.recv() => match j {
                    Some(j) => add(&mut batch, &mut rows, max, j, &mut next),
                    None => break,
                },
                () = end => {}
                () = tokio::time::sleep_until(deadline) => break,
            }
        }
        running.fetch_add(1, Ordering::AcqRel);
        let (running, ended) = (running.clone(), ended.clone());
        tokio::spawn(async move {
            let mut x = Vec::with_capacity(rows * D_IN);
            for j in &mut batch {
                x.append(&mut j.x);
            }
            let out = svc.run(x, rows).await;
            running.fetch_sub(1, Ordering::AcqRel);
            ended.notify_one();
            let mut at = 0;
            for j in batch {
                let mine = match &out {
                    Ok(all) => Ok(all[at * CLASSES..(at + j.n) * CLASSES].to_vec()),
                    Err(e) => Err(e.clone()),
                };
                at += j.n;
                let _ = j.reply.send(mine);
            }
        });
    }
}

/// Adds `j` to `batch` if its rows fit, else keeps it for the next one.
fn add(batch: &mut Vec<Job>, rows: &mut usize, max: usize, j: Job, next: &mut Option<Job>) {
    if *rows + j.n <= max {
        *rows += j.n;
        batch.push(j);
    } else {
        *next = Some(j);
    }
}

/// The service's routes: `POST /infer`, `GET /metrics`, `GET /healthz`.
pub fn router(service: Arc<Service>) -> Router {
    Router::new()
        .route("/infer", post(infer))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .with_state(service)
}

/// The body's form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    Json,
    Binary,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonRequest {
    inputs: Vec<Vec<f32>>,
}

#[derive(serde::Serialize)]
struct JsonResponse {
    outputs: Vec<Vec<f32>>,
}

/// The samples of a body, end to end, and how many: or what is wrong.
fn parse(form: Form, body: &[u8], max: usize) -> Result<(Vec<f32>, usize), String> {
    let (x, n) = match form {
        Form::Binary => {
            let row = D_IN * 4;
            if body.is_empty() || !body.len().is_multiple_of(row) {
                return Err(format!(
                    "body: {} bytes is not a whole number of samples of {D_IN} f32s ({row} bytes)",
                    body.len()
                ));
            }
            let x: Vec<f32> = body
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (x, body.len() / row)
        }
        Form::Json => {
            let req: JsonRequest =
                serde_json::from_slice(body).map_err(|e| format!("body: {e}"))?;
            if let Some((i, r)) = req.inputs.iter().enumerate().find(|(_, r)| r.len() != D_IN) {
                return Err(format!(
                    "inputs[{i}]: {} values, a sample has {D_IN}",
                    r.len()
                ));
            }
            let n = req.inputs.len();
            (req.inputs.concat(), n)
        }
    };
    if n == 0 {
        return Err("inputs: no samples".into());
    }
    if n > max {
        return Err(format!("inputs: {n} samples, at most {max} a request"));
    }
    if let Some(i) = x.iter().position(|v| !v.is_finite()) {
        return Err(format!(
            "inputs[{}][{}]: not a finite number",
            i / D_IN,
            i % D_IN
        ));
    }
    Ok((x, n))
}

async fn infer(State(svc): State<Arc<Service>>, headers: HeaderMap, body: Bytes) -> Response {
    let start = Instant::now();
    let (status, response) = answer(&svc, &headers, &body).await;
    svc.metrics.latency.observe(start.elapsed().as_secs_f64());
    svc.metrics.count(status);
    (status, response).into_response()
}

async fn answer(svc: &Arc<Service>, headers: &HeaderMap, body: &[u8]) -> (StatusCode, Response) {
    let Some(_admitted) = svc.try_admit() else {
        let busy = format!("busy: {} requests in already\n", svc.options.queue);
        return (StatusCode::SERVICE_UNAVAILABLE, busy.into_response());
    };
    let binary = headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/octet-stream"));
    let form = if binary { Form::Binary } else { Form::Json };
    let (x, n) = match parse(form, body, svc.options.max_batch) {
        Ok(v) => v,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("{e}\n").into_response()),
    };
    let out = match svc.infer(x, n).await {
        Ok(out) => out,
        Err(e) => {
            let msg = format!("the pipeline failed: {e}\n");
            return (StatusCode::INTERNAL_SERVER_ERROR, msg.into_response());
        }
    };
    let response = match form {
        Form::Binary => {
            let bytes: Vec<u8> = out.iter().flat_map(|v| v.to_le_bytes()).collect();
            ([(header::CONTENT_TYPE, "application/octet-stream")], bytes).into_response()
        }
        Form::Json => {
            let outputs = out.chunks_exact(CLASSES).map(<[f32]>::to_vec).collect();
            axum::Json(JsonResponse { outputs }).into_response()
        }
    };
    (StatusCode::OK, response)
}

async fn metrics(State(svc): State<Arc<Service>>) -> Response {
    let mut text = String::new();
    match prometheus_client::encoding::text::encode(&mut text, &svc.metrics.registry) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// The service's metrics.
struct Metrics {
    registry: Registry,
    latency: Histogram,
    gpu: Histogram,
    ok: Counter,
    bad: Counter,
    busy: Counter,
    failed: Counter,
}

impl Metrics {
    fn new() -> Self {
        let mut registry = Registry::with_prefix("service");
        let latency = Histogram::new(exponential_buckets(0.000_1, 2.0, 18));
        let gpu = Histogram::new(exponential_buckets(0.000_01, 2.0, 20));
        let (ok, bad, busy, failed): (Counter, Counter, Counter, Counter) = Default::default();
        registry.register_with_unit(
            "request",
            "Time from a request's body read to its response",
            Unit::Seconds,
            latency.clone(),
        );
        registry.register_with_unit(
            "gpu_pipeline",
            "GPU time of one pipeline (a request, or a batch of them)",
            Unit::Seconds,
            gpu.clone(),
        );
        for (name, help, c) in [
            ("responses_ok", "Requests answered 200", &ok),
            ("responses_bad_request", "Requests answered 400", &bad),
            (
                "responses_busy",
                "Requests answered 503 (queue full)",
                &busy,
            ),
            ("responses_failed", "Requests answered 500", &failed),
        ] {
            registry.register(name, help, c.clone());
        }
        Metrics {
            registry,
            latency,
            gpu,
            ok,
            bad,
            busy,
            failed,
        }
    }

    fn count(&self, status: StatusCode) {
        let c = match status {
            StatusCode::OK => &self.ok,
            StatusCode::BAD_REQUEST => &self.bad,
            StatusCode::SERVICE_UNAVAILABLE => &self.busy,
            _ => &self.failed,
        };
        c.inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_checked_with_errors_naming_the_field() {
        let row = vec![0.5f32; D_IN];
        let json = serde_json::to_vec(&serde_json::json!({ "inputs": [row, row] })).unwrap();
        let (x, n) = parse(Form::Json, &json, 4).unwrap();
        assert_eq!((x.len(), n), (2 * D_IN, 2));
        let short = serde_json::json!({ "inputs": [row, vec![1.0f32; 3]] });
        let e = parse(Form::Json, &serde_json::to_vec(&short).unwrap(), 4).unwrap_err();
        assert!(e.starts_with("inputs[1]: 3 values"), "{e}");
        let e = parse(Form::Json, b"{\"input\": []}", 4).unwrap_err();
        assert!(e.contains("unknown field `input`"), "{e}");
        let e = parse(Form::Json, b"{\"inputs\": []}", 4).unwrap_err();
        assert!(e.starts_with("inputs: no samples"), "{e}");
        let e = parse(Form::Json, &json, 1).unwrap_err();
        assert!(e.contains("at most 1"), "{e}");
        let bytes: Vec<u8> = row.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(parse(Form::Binary, &bytes, 4).unwrap().1, 1);
        let e = parse(Form::Binary, &bytes[..100], 4).unwrap_err();
        assert!(e.starts_with("body: 100 bytes"), "{e}");
        let mut nan = bytes.clone();
        nan[8..12].copy_from_slice(&f32::NAN.to_le_bytes());
        let e = parse(Form::Binary, &nan, 4).unwrap_err();
        assert!(e.starts_with("inputs[0][2]"), "{e}");
    }
}
