//! Remote lease execution, the client's side: leases of GPUs on cuda-lease
//! nodes over QUIC, and a leased GPU as a backend of cuda-async's ops.
//!
//! The node that serves leases (and the command-line programs) is the
//! `cuda-lease-node` crate; this crate needs no GPU, driver or CUDA toolkit.
//!
//! - [`client`]: [`client::Lease`], [`client::Session`], batches and the
//!   one-shot [`client::Client::gpu_call`].
//! - [`remote`]: a lease as a cuda-async backend (`RemotePolicy` runs the
//!   same `DeviceOp`s on a leased GPU).
//! - [`proto`]: the versioned wire format (fixed header, postcard bodies,
//!   raw byte payloads, typed status codes), re-exported from
//!   `cuda-lease-proto`.
//! - [`tls`] and [`transport`]: TLS 1.3 trust and the QUIC settings, both
//!   ends' types.
//! - [`clock`]: the injectable monotonic clock leases are timed on
//!   ([`clock::ManualClock`] moves it by hand in tests).
//!
//! Test and measurement helpers, not part of the API: `ptx` (feature
//! `test-util`), hand-written test kernels (iota, vector add, a faulting
//! kernel); `stamps`, fixed points of a submission's path for the bench
//! report's remote rows.
//!
//! # Features
//!
//! `backend` (default): the cuda-async backend ([`remote`]). Without it the
//! crate is the plain client, without cuda-async.
//! `test-util`: the test kernels above, for tests, examples and benchmarks.
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
pub mod proto;
#[cfg(feature = "test-util")]
pub mod ptx;
#[cfg(feature = "backend")]
pub mod remote;
// Public for the node and the bench report's remote rows, which take the
// stamps of their submissions. Not API.
#[doc(hidden)]
pub mod stamps;
pub mod tls;
pub mod transport;
pub mod units;

pub use client::{Client, ClientConfig, Error, GpuCall, Lease, Session};
pub use transport::TransportSettings;

/// Compiles the README's Rust snippets as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
