//! Remote lease execution: a GPU node that leases VRAM slices over QUIC, and
//! the client that uses them.
//!
//! - [`proto`]: the versioned wire format (fixed header, postcard bodies,
//!   raw byte payloads, typed status codes).
//! - [`node`]: the node (QUIC + TLS 1.3, bearer tokens or mutual TLS, lease
//!   table with TTL reaper, one worker process per lease, Prometheus
//!   metrics). Also embeddable: [`node::Node::spawn_local`].
//! - [`worker`]: the worker processes that own CUDA contexts, and the
//!   [`worker::main_if_worker`] hook every worker executable calls first.
//! - [`sandbox`]: tenants' CUDA C checked (options, includes) and compiled
//!   in a confined child process that cannot read the node's files.
//! - [`spin`]: bounded busy-polling of the worker pipes (latency), and the
//!   default of [`WorkerSpec::spin`].
//! - [`device`]: the device layer ([`device::CudaDevice`] and the in-memory
//!   test double [`device::MemoryDevice`]).
//! - [`client`]: [`client::Lease`], [`client::Session`], batches and the
//!   one-shot [`client::Client::gpu_call`].
//! - [`lease_table`] and [`clock`]: lease bookkeeping on an injectable
//!   monotonic clock ([`NodeConfig::clock`]; [`clock::ManualClock`] moves
//!   it by hand in tests).
//!
//! Test and measurement helpers, behind the `test-util` feature (not part
//! of the API): `ptx`, hand-written test kernels (iota, vector add, a
//! faulting kernel). The `stamps` module times fixed points of a
//! submission's path for the bench report's remote rows (whose raw
//! transports, the ceilings every remote row is a ratio to, are in the
//! `benches` crate).
//!
//! # Features
//!
//! `node` (default): the node, its workers and device layer (on `cuda-core`
//! and `cuda-async`), the lease table and metrics.
//! `cli` (default): the `cuda-lease-node` and `cuda-lease` programs (clap,
//! tracing-subscriber). A client-only user sets `default-features = false`
//! and keeps [`client`], [`proto`] and [`tls`]: no CUDA layer, no process
//! supervision, no certificate generation.
//! `test-util`: the test kernels above, for this crate's tests, examples
//! and benchmarks.
//!
//! # Examples
//!
//! ```no_run
//! use cuda_lease::client::{ClientConfig, Lease};
//! use std::time::Duration;
//! # async fn demo(addr: std::net::SocketAddr) -> Result<(), cuda_lease::client::Error> {
//! let config = ClientConfig::from_pem_file("node-cert.pem".as_ref())?.token("secret");
//! let lease = Lease::builder()
//!     .min_vram(64 << 20)
//!     .ttl(Duration::from_secs(30))
//!     .config(config)
//!     .connect(addr)
//!     .await?;
//! let session = lease.session();
//! let buf = session.alloc(1024).await?;
//! session.write(&buf, 0, &[1u8; 1024]).await?;
//! assert_eq!(session.read(&buf, 0, 4).await?, vec![1, 1, 1, 1]);
//! lease.free().await?;
//! # Ok(()) }
//! ```

pub mod client;
pub mod clock;
#[cfg(feature = "cli")]
pub mod config_file;
#[cfg(feature = "node")]
pub mod device;
#[cfg(feature = "fleet")]
pub mod fleet;
#[cfg(feature = "node")]
pub mod lease_table;
#[cfg(any(feature = "node", feature = "cli"))]
pub mod log;
#[cfg(feature = "node")]
pub mod metrics;
#[cfg(feature = "node")]
pub mod node;
pub mod proto;
#[cfg(feature = "test-util")]
pub mod ptx;
#[cfg(feature = "backend")]
pub mod remote;
#[cfg(feature = "node")]
pub mod sandbox;
#[cfg(feature = "node")]
mod shm;
#[cfg(feature = "node")]
pub mod spin;
// Public for the bench report's remote rows (`benches/src/remote/`), which
// take the stamps of their submissions. Not API.
#[doc(hidden)]
pub mod stamps;
pub mod tls;
pub mod transport;
pub mod units;
#[cfg(feature = "node")]
pub mod worker;

pub use client::{Client, ClientConfig, Error, GpuCall, Lease, Session};
#[cfg(feature = "node")]
pub use node::{Node, NodeConfig};
pub use transport::TransportSettings;
#[cfg(feature = "node")]
pub use worker::{main_if_worker, DeviceSpec, WorkerSpec};

/// Compiles the README's Rust snippets as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// Compiles the book's fleet chapter as doctests.
#[cfg(all(doctest, feature = "fleet", feature = "backend"))]
#[doc = include_str!("../../book/src/fleet.md")]
pub struct BookFleetDoctests;

/// Compiles the book's remote chapter as doctests (it uses both crates).
#[cfg(all(doctest, feature = "backend"))]
#[doc = include_str!("../../book/src/remote.md")]
pub struct BookRemoteDoctests;
