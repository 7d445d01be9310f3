//! Benchmarks of `cuda-async` against raw cudarc: the measured paths and
//! their statistics, shared by the criterion benches (`benches/*.rs`, one
//! `benchmark_group` per topic) and the one-run comparison report
//! (`src/bin/report.rs`, shipped in the GPU bundle as `bench-report`).
//!
//! - [`raw`]: the baselines written directly against cudarc: launch +
//!   synchronize, a minimal `cuLaunchHostFunc` + `AtomicWaker` future,
//!   two-stream fork/join with events, graph capture/replay, pinned copies.
//! - [`fixture`]: the device, kernels and streams, and one iteration of
//!   every raw and library path.
//! - [`measure`]: interleaved timing (warm-up, then the raw and library
//!   paths alternated rep by rep), the throughput drivers, and the report's
//!   comparisons, topic by topic.
//! - [`library`]: the `blas` topic: cuBLAS products as ops against
//!   cudarc's `CudaBlas` calls.
//! - [`remote`]: the remote topics: an embedded lease node on loopback
//!   (GPU 0, or the in-memory device) against raw quinn.
//! - [`report`]: rows, goals, the markdown table and the JSON file.
//! - [`stats`]: median and percentiles.
//!
//! Machines are noisy: every figure that matters is a ratio of medians
//! measured side by side in one process, never an absolute time compared
//! across runs.

pub mod fixture;
pub mod kernels;
pub mod library;
pub mod measure;
pub mod raw;
pub mod remote;
pub mod report;
pub mod stats;

pub use fixture::{AwaitPath, Copies, Fixture, SyncPath};
pub use kernels::Kernels;
pub use measure::Config;
pub use report::{Goal, Row, Unit};
pub use stats::Summary;

/// Any error of a bench: the library's, the driver's, or the bench's own.
pub type BenchError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// `Result` with a [`BenchError`].
pub type Result<T> = std::result::Result<T, BenchError>;

/// The fixture for a criterion bench, or `None` (with the reason on stderr)
/// on a machine without a usable GPU, so `cargo bench` skips instead of
/// failing there.
pub fn bench_fixture() -> Option<Fixture> {
    match Fixture::new() {
        Ok(fx) => Some(fx),
        Err(e) => {
            eprintln!("benches: skipping, no usable GPU: {e}");
            None
        }
    }
}

/// The tokio runtime the async comparisons run on: multi-threaded, 4
/// workers.
///
/// # Errors
/// If the runtime cannot be built (threads cannot be spawned).
pub fn tokio_runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(measure::TOKIO_WORKERS)
        .thread_name("bench-worker")
        .build()?)
}
