//! What a node writes in the registry ([`NodeRecord`]), where, and how a
//! node is configured to write it ([`RegistryConfig`]).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use rustls::pki_types::CertificateDer;
use serde::{Deserialize, Serialize};

/// The registry's default key prefix (records under `/cuda-lease/nodes/`).
pub const DEFAULT_PREFIX: &str = "/cuda-lease/";

/// One node as the registry holds it (JSON under `PREFIX/nodes/NAME`):
/// what a client needs to choose it and reach it, and nothing secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    /// The node's name (unique in the fleet: the key's last part).
    pub name: String,
    /// Where clients reach its QUIC endpoint.
    pub address: SocketAddr,
    /// SHA-256 of its TLS certificate (DER), lowercase hex ([`fingerprint`]).
    pub cert_sha256: String,
    /// Its devices.
    pub devices: Vec<DeviceRecord>,
    /// Bytes leases may reserve on it in all.
    pub capacity_bytes: u64,
    /// Bytes new leases may still reserve.
    pub reservable_bytes: u64,
    /// Leases alive on it.
    pub active_leases: u32,
    /// The protocol version it speaks ([`cuda_lease::proto::VERSION`]).
    pub protocol: u8,
    /// The operator's labels (`zone=a`, `gpu=h100`, ...).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// One device of a [`NodeRecord`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceRecord {
    /// CUDA ordinal on the node.
    pub ordinal: u32,
    /// Marketing name.
    pub name: String,
    /// Total memory in bytes.
    pub total_bytes: u64,
    /// Compute capability (major, minor).
    pub compute_capability: (u32, u32),
}

impl NodeRecord {
    /// The record's key under `prefix`.
    pub fn key(prefix: &str, name: &str) -> String {
        format!("{}{name}", nodes_prefix(prefix))
    }

    /// The record as the registry stores it.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// A record read from the registry.
    ///
    /// # Errors
    ///
    /// The JSON error of a value that is not a record.
    pub fn from_json(value: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(value)
    }

    /// The certificate fingerprint as bytes (`None` unless 64 hex digits).
    pub fn fingerprint_bytes(&self) -> Option<[u8; 32]> {
        let s = self.cert_sha256.as_bytes();
        if s.len() != 64 {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, pair) in s.chunks(2).enumerate() {
            let hex = std::str::from_utf8(pair).ok()?;
            out[i] = u8::from_str_radix(hex, 16).ok()?;
        }
        Some(out)
    }
}

/// The SHA-256 of a certificate (DER) in lowercase hex, as records carry it.
pub fn fingerprint(cert: &CertificateDer<'_>) -> String {
    ring::digest::digest(&ring::digest::SHA256, cert.as_ref())
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Where `prefix`'s records live: `PREFIX/nodes/` (adding a missing `/`).
pub(crate) fn nodes_prefix(prefix: &str) -> String {
    format!("{}/nodes/", prefix.strip_suffix('/').unwrap_or(prefix))
}

/// How a node registers itself in etcd (`cuda_lease_node::NodeConfig::registry`).
#[derive(Debug, Clone)]
pub struct RegistryConfig {
    /// etcd endpoints (`http://127.0.0.1:2379`).
    pub endpoints: Vec<String>,
    /// Key prefix ([`DEFAULT_PREFIX`]).
    pub prefix: String,
    /// TTL of the node's etcd lease (at least 1 s; default 10 s): a dead node
    /// leaves the registry this long after its last keep-alive, sent every
    /// third of it.
    pub ttl: Duration,
    /// The address written in the record. `None`: the node's QUIC
    /// address, which must then not be unspecified (`0.0.0.0`).
    pub advertise: Option<SocketAddr>,
    /// Labels written in the record, for placement.
    pub labels: BTreeMap<String, String>,
    /// Least time between two writes of the record (default 500 ms): a
    /// change waits at most this long to reach the registry.
    pub min_update_interval: Duration,
    /// How long connecting to etcd may take before the node retries (default 2 s).
    pub connect_timeout: Duration,
}

impl RegistryConfig {
    /// Registration with etcd at `endpoints`, with the defaults above.
    pub fn new<S: Into<String>>(endpoints: impl IntoIterator<Item = S>) -> Self {
        Self {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            prefix: DEFAULT_PREFIX.into(),
            ttl: Duration::from_secs(10),
            advertise: None,
            labels: BTreeMap::new(),
            min_update_interval: Duration::from_millis(500),
            connect_timeout: Duration::from_secs(2),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> NodeRecord {
        NodeRecord {
            name: "gpu-7".into(),
            address: "10.0.0.7:4433".parse().unwrap(),
            cert_sha256: "ab".repeat(32),
            devices: vec![DeviceRecord {
                ordinal: 0,
                name: "NVIDIA H100 80GB HBM3".into(),
                total_bytes: 80 << 30,
                compute_capability: (9, 0),
            }],
            capacity_bytes: 79 << 30,
            reservable_bytes: 40 << 30,
            active_leases: 3,
            protocol: cuda_lease::proto::VERSION,
            labels: [("zone".to_string(), "a".to_string())].into(),
        }
    }

    #[test]
    fn a_record_round_trips_through_its_json() {
        let r = record();
        assert_eq!(NodeRecord::from_json(r.to_json().as_bytes()).unwrap(), r);
        assert_eq!(r.fingerprint_bytes(), Some([0xab; 32]));
    }

    #[test]
    fn keys_live_under_the_prefix_with_or_without_its_slash() {
        assert_eq!(NodeRecord::key("/f/", "a"), "/f/nodes/a");
        assert_eq!(NodeRecord::key("/f", "a"), "/f/nodes/a");
    }

    #[test]
    fn a_bad_fingerprint_is_none() {
        let mut r = record();
        r.cert_sha256 = "zz".repeat(32);
        assert_eq!(r.fingerprint_bytes(), None);
        r.cert_sha256 = "ab".into();
        assert_eq!(r.fingerprint_bytes(), None);
    }
}
