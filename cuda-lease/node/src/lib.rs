//! The cuda-lease node: a QUIC server that leases slices of its GPUs, one
//! worker process per lease, and the `cuda-lease-node` and `cuda-lease`
//! programs. The client, wire protocol and cuda-async backend are the
//! `cuda-lease` crate.
//!
//! - [`node`]: QUIC + TLS 1.3, tokens or mutual TLS, TTL reaper, metrics;
//!   embeddable via [`Node::spawn_local`].
//! - [`worker`]: CUDA-owning workers; their executables call [`main_if_worker`] first.
//! - [`sandbox`]: tenants' CUDA C compiled in a child that cannot read the node's files.
//! - [`spin`]: bounded busy-polling of worker pipes ([`WorkerSpec::spin`]).
//! - [`device`]: [`device::CudaDevice`] and the test double [`device::MemoryDevice`].
//! - [`lease_table`]: lease bookkeeping on an injectable clock ([`NodeConfig::clock`]).
//! - [`tls`]: the node's certificates and server configurations.
//!
//! # Features
//!
//! `cli` (default): the two programs (clap) and their `--config` files.
//! `fleet`: the node registers in etcd (`NodeConfig::registry`) and
//! `cuda-lease` lists and leases on a fleet; needs `protoc` to build.
//!
//! # Examples
//!
//! An embedded node on 127.0.0.1 with the in-memory device, and a lease:
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

// Client-crate modules used as the node's own.
use cuda_lease::{clock, proto, stamps, transport};
#[cfg(feature = "fleet")]
use cuda_lease_fleet as fleet;

pub use node::{Node, NodeConfig};
pub use worker::{main_if_worker, DeviceSpec, WorkerSpec};

/// Locks a std mutex, recovering it from a panicked holder (the node's
/// updates are never left half done).
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

/// Compiles the book's remote chapter as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../../book/src/remote.md")]
pub struct BookRemoteDoctests;
