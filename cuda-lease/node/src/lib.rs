#![doc = include_str!("../README.md")]

#[cfg(feature = "cli")]
pub(crate) mod budget;
pub mod config_file;
pub mod device;
pub mod lease_table;
pub mod log;
pub mod metrics;
pub mod node;
pub(crate) mod order;
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

/// Whether `given` is the secret `known`, compared without an early exit
/// (a mismatch takes as long wherever it is).
pub(crate) fn same_secret(known: &[u8], given: &[u8]) -> bool {
    let mut diff = u8::from(known.len() != given.len());
    for (i, b) in known.iter().enumerate() {
        diff |= b ^ given.get(i).copied().unwrap_or(0);
    }
    diff == 0
}

/// Compiles the book's fleet chapter as doctests.
#[cfg(all(doctest, feature = "fleet"))]
#[doc = include_str!("../../../book/src/fleet.md")]
pub struct BookFleetDoctests;

/// Compiles the book's remote chapter as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../../book/src/remote.md")]
pub struct BookRemoteDoctests;
