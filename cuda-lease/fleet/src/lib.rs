//! A fleet of nodes on etcd: nodes register themselves, clients discover
//! them and place leases on them.
//!
//! A node with a [`RegistryConfig`] (`cuda-lease-node --etcd
//! http://127.0.0.1:2379`) writes a [`NodeRecord`] under `PREFIX/nodes/NAME`,
//! attached to an etcd lease kept alive at a third of its TTL, and rewrites it
//! on change (at most once per [`RegistryConfig::min_update_interval`]). A
//! node that dies leaves when its etcd lease runs out; one that loses etcd
//! keeps serving and registers again when etcd is back; one shut down with
//! `cuda_lease_node::Node::shutdown` leaves at once.
//!
//! A client's [`Fleet`] reads the registry, follows it with an etcd watch (no
//! polling) and places leases: [`Fleet::lease`] tries the nodes that fit,
//! least loaded first; [`Fleet::lease_placed`] takes the order from a
//! function of the user's. The [`Lease`](cuda_lease::client::Lease) it
//! returns is the one every remote policy takes.
//!
//! # Features
//!
//! `backend` (default): [`FleetPolicy`], cuda-async's ops over leases on
//! several nodes; without it, discovery and placement over the plain client.
//! Building needs `protoc` (Debian: `protobuf-compiler`) for `etcd-client`.
//!
//! # Trust
//!
//! The registry holds no secrets, only what any client of a node learns.
//! Whoever can write the prefix can point clients elsewhere, so a client
//! trusts a node's certificate by the registry's fingerprint only with
//! [`FleetConfig::trust_registry`]; otherwise it checks every node against
//! its own [`ClientConfig`](cuda_lease::client::ClientConfig) roots.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use cuda_lease::client::{ClientConfig, Lease};
//! use cuda_lease_fleet::{Fleet, FleetConfig};
//!
//! let roots = ClientConfig::from_pem_file("ca.pem".as_ref())?.token("secret");
//! let fleet = Fleet::connect(FleetConfig::new(["http://127.0.0.1:2379"]).client(roots)).await?;
//! for node in fleet.nodes() {
//!     println!("{} at {}: {} bytes free", node.name, node.address, node.reservable_bytes);
//! }
//! let lease = fleet.lease(Lease::builder().min_vram(1 << 30)).await?;
//! # drop(lease); Ok(()) }
//! ```

mod discovery;
mod placement;
#[cfg(feature = "backend")]
mod policy;
mod record;

pub use discovery::{Fleet, FleetConfig, FleetError};
pub use placement::Need;
#[cfg(feature = "backend")]
pub use policy::{lost, FleetPolicy, FleetPolicyConfig, NodeStats};
pub use record::{fingerprint, DeviceRecord, NodeRecord, RegistryConfig, DEFAULT_PREFIX};

/// Locks a std mutex, taking it over from a holder that panicked (no update
/// of the fleet's state is left half done).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
