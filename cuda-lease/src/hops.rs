//! Per-hop timings of the data path, for measuring where a request's time
//! goes: client, QUIC, node, node-to-worker pipe, worker, device. A remote
//! `DeviceOp` submission adds a `client-submit` line: translating its
//! recording, encoding the message, waiting for the reply, and completing
//! the future's signal.
//!
//! Off unless the environment variable `CUDA_LEASE_HOP_TIMES` is set (to
//! anything) in the node's, the worker's and the client's process; then each
//! hop prints one line per request to stderr:
//!
//! ```text
//! hop=node op=MemWrite bytes=268435456 read_us=612003 dispatch_us=201122 reply_us=35
//! ```
//!
//! A BATCH adds a `node-batch` line with the node's own phases of it:
//! `decode` (and check), `order` (behind the lease's earlier batches),
//! `lock` (the lease's turn), `plan`, `encode` (the worker's message),
//! `worker` (the call, pipes included), `commit` and `reply`.
//!
//! Every line also carries `at_us`, the hop's start on the host's
//! monotonic clock (`CLOCK_MONOTONIC`, shared by the client's, the node's
//! and the workers' processes), so the hops of one request can be laid out
//! on one time line. `cuda-lease/scripts/hop-summary LOG` turns such a log
//! into a table of medians per hop, operation and field;
//! `cuda-lease/scripts/hop-timeline LOG` lays out the hops of each
//! request a program marked with a `hop=bench` line ([`emit`], [`now_us`])
//! on one time line and prints the median offset of every phase end. When off, the cost is one relaxed
//! load of a cached flag per request. When on, lines are handed to a
//! logger thread ([`emit`]) and printed off the request's path, so the
//! timings they report are barely disturbed by the printing itself.

use std::sync::mpsc::{channel, Sender};
use std::sync::OnceLock;
use std::time::Instant;

use crate::proto::Opcode;

/// Whether `CUDA_LEASE_HOP_TIMES` is set (read once per process).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("CUDA_LEASE_HOP_TIMES").is_some())
}

/// Prints `line` to stderr from a logger thread (the caller only queues
/// it). Lines still queued when the process exits may be lost.
pub fn emit(line: String) {
    static LOGGER: OnceLock<Option<Sender<String>>> = OnceLock::new();
    let tx = LOGGER.get_or_init(|| {
        let (tx, rx) = channel::<String>();
        std::thread::Builder::new()
            .name("cuda-lease-hops".into())
            .spawn(move || {
                for line in rx {
                    eprintln!("{line}");
                }
            })
            .ok()
            .map(|_| tx)
    });
    match tx {
        Some(tx) => {
            if let Err(e) = tx.send(line) {
                eprintln!("{}", e.0);
            }
        }
        None => eprintln!("{line}"),
    }
}

/// Microseconds on the host's monotonic clock (`CLOCK_MONOTONIC`): the same
/// clock in every process of the host, so hops of one request in the
/// client, the node and a worker can be compared.
pub fn now_us() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC exists on
    // every Linux kernel this crate runs on.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000
        + u64::try_from(ts.tv_nsec).unwrap_or(0) / 1000
}

/// Times the phases of one request at one hop; printed when dropped.
pub(crate) struct HopTimer {
    hop: &'static str,
    op: Opcode,
    bytes: u64,
    at_us: u64,
    last: Instant,
    fields: Vec<(&'static str, u128)>,
}

impl HopTimer {
    /// A timer if timings are on, else `None` (so the hot path pays a
    /// branch).
    pub(crate) fn start(hop: &'static str, op: Opcode, bytes: u64) -> Option<Self> {
        enabled().then(|| HopTimer {
            hop,
            op,
            bytes,
            at_us: now_us(),
            last: Instant::now(),
            fields: Vec::with_capacity(4),
        })
    }

    /// Ends the phase `field` (the time since the last mark or the start).
    pub(crate) fn mark(&mut self, field: &'static str) {
        let now = Instant::now();
        self.fields
            .push((field, now.duration_since(self.last).as_micros()));
        self.last = now;
    }

    /// Sets the operation and size once they are known.
    pub(crate) fn set_op(&mut self, op: Opcode, bytes: u64) {
        self.op = op;
        self.bytes = bytes;
    }
}

impl Drop for HopTimer {
    fn drop(&mut self) {
        let mut line = format!(
            "hop={} op={:?} bytes={} at_us={}",
            self.hop, self.op, self.bytes, self.at_us
        );
        for (f, us) in &self.fields {
            line.push_str(&format!(" {f}_us={us}"));
        }
        emit(line);
    }
}

/// Marks `field` on an optional timer.
pub(crate) fn mark(t: &mut Option<HopTimer>, field: &'static str) {
    if let Some(t) = t {
        t.mark(field);
    }
}
