//! Per-hop timings of the data path as `tracing` spans, for measuring where
//! a request's time goes: client, QUIC, node, node-to-worker pipe, worker,
//! device.
//!
//! Each hop of a request is a span at the target [`TARGET`]
//! (`cuda_lease::hop`), level TRACE, named after the hop: `client` (one
//! request/reply), `client-submit` (a remote `DeviceOp` submission:
//! translating its recording, encoding the message, waiting for the reply,
//! completing the future's signal), `node` (a request at the node),
//! `node-batch` (the node's phases of a BATCH: `decode` and check, `order`
//! behind the lease's earlier batches, `lock` the lease's turn, `plan`,
//! `encode` the worker's message, `worker` the call, pipes included,
//! `commit` and `reply`), `node-send` (a chunk of a streamed read onto
//! QUIC), `node-worker` (the node's side of a worker call), `worker` (the
//! worker's side) and `worker-batch` (the worker's enqueue and finish of a
//! batch, with each command's enqueue time in `steps`). A span carries
//! `at_us`, its start on the host's monotonic clock ([`now_us`]:
//! `CLOCK_MONOTONIC`, shared by the client's, the node's and the workers'
//! processes, so the hops of one request can be laid out on one time line),
//! one `*_us` field per phase, recorded as each phase ends, and `op` and
//! `bytes`, recorded when the hop ends.
//!
//! # Turning them on
//!
//! Like any span, through a filter: `RUST_LOG=cuda_lease::hop=trace` (or
//! `cuda_lease::hop[node-batch]=trace` for one hop; a program's own log
//! keeps `RUST_LOG`'s other directives, see [`log_filter`]);
//! `CUDA_LEASE_HOP_TIMES=1` ([`ENV`]) is short for that directive. The node
//! program (`cuda-lease-node`), the `cuda-lease` program, the node's worker
//! processes and this crate's examples print the hop spans through
//! [`layer`] (with the `node` or `cli` feature; [`init_from_env`] for a
//! program that prints nothing else): one line per hop to stderr when it
//! ends, formatted on the request's path and written from a logger thread
//! off it, so the timings are barely disturbed by the printing itself:
//!
//! ```text
//! node-batch{at_us=3606017871 decode_us=3 order_us=0 lock_us=0 plan_us=2 encode_us=0 worker_us=88 commit_us=0 reply_us=0 op=Batch bytes=4096}: close
//! ```
//!
//! Any other subscriber sees the same spans. `cuda-lease/scripts/hop-summary
//! LOG` turns such a log into a table of medians per hop, operation and
//! field; `cuda-lease/scripts/hop-timeline LOG` lays out the hops of each
//! request a program marked with a `hop=bench` line ([`emit`], [`now_us`])
//! on one time line and prints the median offset of every phase end.
//!
//! When off, the cost is tracing's check of a disabled span: a relaxed
//! load of the maximum level (or of the callsite's cached interest) per
//! hop; no clock is read.
//!
//! The spans format their lines on the request's path, which moves what
//! they measure by microseconds per hop; [`stamps`] records fixed points
//! of a submission's path with one clock read each, for measurements the
//! printing would disturb.

use std::time::Instant;

use tracing::field::Empty;
use tracing::Span;

use crate::proto::Opcode;

/// The target of every hop span and of [`emit`]'s lines.
pub const TARGET: &str = "cuda_lease::hop";

/// The environment variable that, set (to anything), turns the hop spans on
/// as the directive `cuda_lease::hop=trace` in `RUST_LOG` does.
pub const ENV: &str = "CUDA_LEASE_HOP_TIMES";

/// Whether hop spans are on (a subscriber takes TRACE at [`TARGET`]).
pub fn enabled() -> bool {
    tracing::enabled!(target: TARGET, tracing::Level::TRACE)
}

/// Emits `line` (a program's own `hop=...` mark, see the module docs) as a
/// TRACE event at [`TARGET`]; [`layer`] prints it as it is.
pub fn emit(line: String) {
    tracing::trace!(target: TARGET, "{line}");
}

/// Microseconds on the host's monotonic clock (`CLOCK_MONOTONIC`): the same
/// clock in every process of the host, so hops of one request in the
/// client, the node and a worker can be compared.
pub fn now_us() -> u64 {
    now_ns() / 1000
}

/// Nanoseconds on the host's monotonic clock (as [`now_us`]).
pub(crate) fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC exists on
    // every Linux kernel this crate runs on.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

/// The timed hops; each names its span and declares its phases. A
/// client-only build times only the client's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(feature = "node"), allow(dead_code))]
pub(crate) enum Hop {
    /// One request and its reply, at the client.
    Client,
    /// A remote `DeviceOp` submission, at the client.
    ClientSubmit,
    /// A request at the node.
    Node,
    /// A BATCH at the node.
    NodeBatch,
    /// A chunk of a streamed MEM_READ, onto QUIC.
    NodeSend,
    /// A worker call, at the node.
    NodeWorker,
    /// A request at the worker.
    Worker,
    /// A batch's enqueue and finish at the worker.
    WorkerBatch,
}

/// A disabled-or-not span of one hop, with its phase fields declared.
macro_rules! hop_span {
    ($name:literal $(, $phase:ident)*) => {
        tracing::trace_span!(
            target: TARGET,
            $name,
            at_us = Empty,
            $($phase = Empty,)*
            op = Empty,
            bytes = Empty
        )
    };
}

impl Hop {
    fn span(self) -> Span {
        match self {
            Hop::Client => hop_span!("client", send_us, reply_us),
            Hop::ClientSubmit => hop_span!("client-submit", encode_us, reply_us, complete_us),
            Hop::Node => hop_span!("node", read_us, dispatch_us, reply_us),
            Hop::NodeBatch => hop_span!(
                "node-batch",
                decode_us,
                order_us,
                lock_us,
                plan_us,
                encode_us,
                worker_us,
                commit_us,
                reply_us
            ),
            Hop::NodeSend => hop_span!("node-send", quic_us),
            Hop::NodeWorker => hop_span!("node-worker", pipe_send_us, pipe_reply_us),
            Hop::Worker => hop_span!("worker", pipe_read_us, device_us, pipe_write_us),
            Hop::WorkerBatch => tracing::trace_span!(
                target: TARGET,
                "worker-batch",
                at_us = Empty,
                enqueue_us = Empty,
                finish_us = Empty,
                op = Empty,
                bytes = Empty,
                ops = Empty,
                steps = Empty
            ),
        }
    }
}

/// Times the phases of one request at one hop onto its span, which closes
/// when this is dropped.
#[derive(Debug)]
pub(crate) struct HopTimer {
    span: Span,
    op: Opcode,
    bytes: u64,
    last: Instant,
}

impl HopTimer {
    /// A timer on an enabled span of `hop`, else `None` (so the hot path
    /// pays a disabled span's check and a branch).
    pub(crate) fn start(hop: Hop, op: Opcode, bytes: u64) -> Option<Self> {
        let span = hop.span();
        if span.is_disabled() {
            return None;
        }
        span.record("at_us", now_us());
        Some(HopTimer {
            span,
            op,
            bytes,
            last: Instant::now(),
        })
    }

    /// Ends the phase `phase` (the time since the last mark or the start):
    /// records it as the field `{phase}_us`, which the hop must declare.
    pub(crate) fn mark(&mut self, phase: &str) {
        let now = Instant::now();
        let us = now.duration_since(self.last).as_micros() as u64;
        self.last = now;
        let field = self.span.metadata().and_then(|m| {
            m.fields()
                .iter()
                .find(|f| f.name().strip_suffix("_us") == Some(phase))
        });
        debug_assert!(
            field.is_some(),
            "hop span {:?} declares no phase {phase:?}",
            self.span.metadata().map(|m| m.name())
        );
        if let Some(f) = field {
            self.span.record(&f, us);
        }
    }

    /// Sets the operation and size once they are known (recorded when the
    /// hop ends).
    pub(crate) fn set_op(&mut self, op: Opcode, bytes: u64) {
        self.op = op;
        self.bytes = bytes;
    }

    /// The hop's span, to record a field it declares.
    #[cfg_attr(not(feature = "node"), allow(dead_code))]
    pub(crate) fn span(&self) -> &Span {
        &self.span
    }
}

impl Drop for HopTimer {
    fn drop(&mut self) {
        self.span.record("op", tracing::field::debug(self.op));
        self.span.record("bytes", self.bytes);
    }
}

/// Marks `phase` on an optional timer.
pub(crate) fn mark(t: &mut Option<HopTimer>, phase: &str) {
    if let Some(t) = t {
        t.mark(phase);
    }
}

#[cfg(any(feature = "node", feature = "cli"))]
mod print;
pub mod stamps;
#[cfg(any(feature = "node", feature = "cli"))]
pub use print::{format_layer, init_from_env, init_log, init_log_as, layer, log_filter, LogFormat};
