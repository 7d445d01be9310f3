//! A fleet of nodes on etcd: nodes register themselves, clients discover
//! them and place leases on them.
//!
//! A node started with a [`RegistryConfig`] (`cuda-lease-node --etcd
//! http://127.0.0.1:2379`) writes one [`NodeRecord`] under
//! `PREFIX/nodes/NAME`, attached to an etcd lease that it keeps alive at a
//! third of its TTL: its address, its certificate's SHA-256 fingerprint,
//! its devices, the VRAM leases may still reserve, its live leases, its
//! protocol version and its labels, written again when they change (at
//! most once per [`RegistryConfig::min_update_interval`]). A node that dies
//! leaves the registry when its etcd lease runs out; a node that loses etcd
//! keeps serving its leases and registers again when etcd is back; a node
//! shut down with `cuda_lease_node::Node::shutdown` leaves at
//! once.
//!
//! A client's [`Fleet`] reads the registry once, then follows it with an
//! etcd watch from the revision it read (no polling), and places leases:
//! [`Fleet::lease`] tries the nodes that fit (enough reservable VRAM, this
//! client's protocol version, the labels asked for), least loaded first,
//! and moves on to the next on a full node or one that does not answer;
//! [`Fleet::lease_placed`] takes the order from a function of the user's.
//! The [`Lease`](cuda_lease::client::Lease) it returns is the one every remote
//! policy takes.
//!
//! # Features
//!
//! `backend` (default): [`FleetPolicy`], cuda-async's ops over leases on
//! several nodes. Without it the crate is discovery and placement over the
//! plain client. Building needs `protoc` (Debian: `protobuf-compiler`):
//! `etcd-client` generates its gRPC code at build time.
//!
//! # Trust
//!
//! The registry holds no secrets: no tokens, no keys, only what any client
//! of a node learns from it. Whoever can write to the prefix can point
//! clients at another address, so a client trusts a node's certificate
//! from the registry's fingerprint only when told to
//! ([`FleetConfig::trust_registry`]); otherwise it checks every node
//! against its own [`ClientConfig`](cuda_lease::client::ClientConfig) roots, as
//! a client of one node does.
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

/// Locks a std mutex, taking it over from a holder that panicked (every
/// lock of the fleet does so: no update of its state is left half done).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
