#![doc = include_str!("../README.md")]

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
