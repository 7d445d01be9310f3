//! The node's CPU suite in one binary (the in-memory device, no GPU):
//! each module is one area. The suites that need a process of their own
//! are binaries of their own: `stamps` (process-wide stamps), `hardening`
//! and `cut_payloads` (they measure the process's memory), `bursts` (it
//! times a p99), `fleet` (needs etcd), `gpu` (needs a GPU).

#[path = "../common/mod.rs"]
mod common;

mod bulk;
mod busy_poll;
mod data_path;
mod direct;
mod failures;
mod lease_end;
mod lease_table;
mod loopback;
mod order;
mod protocol_v2;
mod remote_backend;
mod remote_session;
mod sandbox;
mod transport;
