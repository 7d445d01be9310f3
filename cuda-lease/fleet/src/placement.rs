//! Which nodes a lease may go to, and in which order ([`Need`], [`rank`]).

use std::collections::BTreeMap;

use super::NodeRecord;

/// What a lease needs of a node: VRAM (from the builder, filled in by
/// [`Fleet::lease`](super::Fleet::lease)) and labels (from
/// [`FleetConfig::labels`](super::FleetConfig::labels)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Need {
    /// Bytes the lease reserves.
    pub min_vram: u64,
    /// Labels a node must carry with these values.
    pub labels: BTreeMap<String, String>,
}

impl Need {
    /// Whether `node`'s record says it can take the lease: this client's
    /// protocol, `min_vram` bytes reservable and every label.
    pub fn fits(&self, node: &NodeRecord) -> bool {
        node.protocol == cuda_lease::proto::VERSION
            && node.reservable_bytes >= self.min_vram
            && self
                .labels
                .iter()
                .all(|(k, v)| node.labels.get(k) == Some(v))
    }
}

/// The nodes that fit `need`, least loaded first: fewest live leases, then
/// most reservable bytes, then by name (a stable order).
pub(crate) fn rank(nodes: &[NodeRecord], need: &Need) -> Vec<NodeRecord> {
    let mut fit: Vec<NodeRecord> = nodes.iter().filter(|n| need.fits(n)).cloned().collect();
    fit.sort_by(|a, b| {
        a.active_leases
            .cmp(&b.active_leases)
            .then(b.reservable_bytes.cmp(&a.reservable_bytes))
            .then(a.name.cmp(&b.name))
    });
    fit
}

/// The order in which a policy tries `ranked` (least loaded first) for one
/// more lease: nodes it holds no lease on, then those it does (`used`),
/// then those whose lease it lost (`lost`, by name and address), each
/// group in `ranked`'s order. A node that just failed may still be listed
/// for a while (its record outlives it, or the registry's watch lags): it
/// is tried last, so a replacement never waits on a dead node while a live
/// one fits.
#[cfg(feature = "backend")]
pub(crate) fn fresh_first(
    mut ranked: Vec<NodeRecord>,
    used: &[String],
    lost: &[(String, std::net::SocketAddr)],
) -> Vec<String> {
    let group = |n: &NodeRecord| {
        if lost
            .iter()
            .any(|(name, at)| *name == n.name && *at == n.address)
        {
            2
        } else if used.contains(&n.name) {
            1
        } else {
            0
        }
    };
    // Stable: within a group, `ranked`'s order stays.
    ranked.sort_by_key(group);
    ranked.into_iter().map(|n| n.name).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, reservable: u64, leases: u32) -> NodeRecord {
        NodeRecord {
            name: name.into(),
            address: "127.0.0.1:1".parse().unwrap(),
            cert_sha256: String::new(),
            devices: Vec::new(),
            capacity_bytes: 1 << 40,
            reservable_bytes: reservable,
            active_leases: leases,
            protocol: cuda_lease::proto::VERSION,
            labels: BTreeMap::new(),
        }
    }

    fn names(v: &[NodeRecord]) -> Vec<&str> {
        v.iter().map(|n| n.name.as_str()).collect()
    }

    #[test]
    fn least_loaded_first_then_most_room_and_a_full_node_never() {
        let nodes = [
            node("a", 100, 2),
            node("b", 50, 1),
            node("c", 80, 1),
            node("full", 9, 0),
        ];
        let need = Need {
            min_vram: 10,
            ..Need::default()
        };
        assert_eq!(names(&rank(&nodes, &need)), ["c", "b", "a"]);
    }

    #[cfg(feature = "backend")]
    #[test]
    fn fresh_nodes_first_then_used_ones_and_a_lost_one_last() {
        let mut lost = node("lost", 100, 0);
        lost.address = "127.0.0.1:2".parse().unwrap();
        let ranked = vec![
            lost.clone(),
            node("used", 100, 0),
            node("fresh", 50, 1),
            node("fresh2", 40, 2),
        ];
        let used = ["used".to_string(), "lost".to_string()];
        let gone = [("lost".to_string(), lost.address)];
        assert_eq!(
            fresh_first(ranked.clone(), &used, &gone),
            ["fresh", "fresh2", "used", "lost"]
        );
        // The same name at another address (the node came back elsewhere)
        // is not the lost one.
        let elsewhere = [("lost".to_string(), "127.0.0.1:3".parse().unwrap())];
        assert_eq!(
            fresh_first(ranked, &used, &elsewhere),
            ["fresh", "fresh2", "lost", "used"]
        );
    }

    #[test]
    fn labels_and_protocol_filter() {
        let mut a = node("a", 100, 0);
        a.labels.insert("zone".into(), "x".into());
        let mut old = node("old", 100, 0);
        old.protocol = cuda_lease::proto::VERSION - 1;
        old.labels.insert("zone".into(), "x".into());
        let b = node("b", 100, 0);
        let need = Need {
            min_vram: 1,
            labels: [("zone".to_string(), "x".to_string())].into(),
        };
        assert_eq!(names(&rank(&[a, old, b], &need)), ["a"]);
    }
}
