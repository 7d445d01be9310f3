//! The fleet on a real etcd (feature `fleet`): `nodes` the registry and
//! placement of leases, `policy` one policy over the fleet's nodes.

#[path = "../common/mod.rs"]
mod common;

mod nodes;
mod policy;
