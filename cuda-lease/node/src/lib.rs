//! The cuda-lease node: a QUIC server that leases slices of its GPUs, each
//! lease served by a worker process of its own, and the command-line
//! programs (`cuda-lease-node`, `cuda-lease`).
//!
//! The client, the wire protocol and the cuda-async backend are the
//! `cuda-lease` crate; this crate is what runs on a GPU host.
//!
//! - [`node`]: the node (QUIC + TLS 1.3, bearer tokens or mutual TLS, lease
//!   table with TTL reaper, one worker process per lease, Prometheus
//!   metrics). Also embeddable: [`Node::spawn_local`].
//! - [`worker`]: the worker processes that own CUDA contexts, and the
//!   [`main_if_worker`] hook every worker executable calls first.
//! - [`sandbox`]: tenants' CUDA C checked (options, includes) and compiled
//!   in a confined child process that cannot read the node's files.
//! - [`spin`]: bounded busy-polling of the worker pipes (latency), and the
//!   default of [`WorkerSpec::spin`].
//! - [`device`]: the device layer ([`device::CudaDevice`] and the in-memory
//!   test double [`device::MemoryDevice`]).
//! - [`lease_table`]: lease bookkeeping on an injectable monotonic clock
//!   ([`NodeConfig::clock`]; `cuda_lease::clock::ManualClock` moves it by
//!   hand in tests).
//! - [`tls`]: the node's certificates and server configurations.
//!
//! # Features
//!
//! `cli` (default): the `cuda-lease-node` and `cuda-lease` programs (clap)
//! and their `--config` files.
//! `fleet`: the node registers itself in etcd (`NodeConfig::registry`),
//! and the `cuda-lease` program lists and leases on a fleet. Needs `protoc`
//! at build time.
//!
//! # Examples
//!
//! An embedded node on 127.0.0.1 with the in-memory test device, and a lease
//! on it:
//!
//! ```no_run
//! use cuda_lease::client::{ClientConfig, Lease};
//! use cuda_lease_node::{DeviceSpec, Node, NodeConfig, WorkerSpec};
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! // Worker processes are this executable again: call the hook first.
//! cuda_lease_node::main_if_worker();
//! let device = DeviceSpec::Memory { capacity: 1 << 30 };
//! let mut cfg = NodeConfig::new(WorkerSpec::current_exe(device)?);
//! cfg.tokens = vec!["secret".into()];
//! let node = Node::spawn_local(cfg).await?;
//! let lease = Lease::builder()
//!     .min_vram(64 << 20)
//!     .config(ClientConfig::pinned(node.cert_der().clone()).token("secret"))
//!     .connect(node.addr())
//!     .await?;
//! lease.free().await?;
//! node.shutdown().await;
//! # Ok(()) }
//! ```

#[cfg(feature = "cli")]
pub mod config_file;
pub mod device;
mod ids;
pub mod lease_table;
pub mod log;
pub mod metrics;
pub mod node;
#[cfg(feature = "fleet")]
mod registrar;
pub mod sandbox;
mod shm;
pub mod spin;
pub mod tls;
#[cfg(feature = "cli")]
pub mod transport_args;
pub mod worker;

// The client crate's modules the node's code names as its own.
use cuda_lease::{clock, proto, stamps, transport};
#[cfg(feature = "fleet")]
use cuda_lease_fleet as fleet;

pub use node::{Node, NodeConfig};
pub use worker::{main_if_worker, DeviceSpec, WorkerSpec};

/// Locks a std mutex, taking it over from a holder that panicked (every
/// lock of the node does so: no update of its state is left half done).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Compiles the README's Rust snippets as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// Compiles the book's fleet chapter as doctests.
#[cfg(all(doctest, feature = "fleet"))]
#[doc = include_str!("../../../book/src/fleet.md")]
pub struct BookFleetDoctests;

/// Compiles the book's remote chapter as doctests (it uses the client, the
/// node and cuda-async).
#[cfg(doctest)]
#[doc = include_str!("../../../book/src/remote.md")]
pub struct BookRemoteDoctests;
