//! The client's view of the fleet ([`Fleet`]): the registry read once,
//! then followed by an etcd watch, and leases placed on it.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{ConnectOptions, EventType, GetOptions, WatchOptions};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use super::placement::{rank, Need};
use super::record::nodes_prefix;
use super::{lock, NodeRecord, DEFAULT_PREFIX};
use cuda_lease::client::{Client, ClientConfig, Error, ErrorKind, Lease, LeaseBuilder};

/// How a client finds the fleet and trusts its nodes ([`Fleet::connect`]).
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// etcd endpoints (`http://127.0.0.1:2379`).
    pub endpoints: Vec<String>,
    /// The registry's key prefix ([`DEFAULT_PREFIX`]).
    pub prefix: String,
    /// How to trust and authenticate to every node: roots (the nodes' CA),
    /// server name, token. With [`FleetConfig::trust_registry`] the
    /// registry's fingerprint replaces the roots, per node.
    pub client: Option<ClientConfig>,
    /// Trust each node's certificate by its record's SHA-256. Off by default:
    /// whoever can write the registry's prefix could send this client to their node.
    pub trust_registry: bool,
    /// Labels a node must carry to be chosen.
    pub labels: BTreeMap<String, String>,
    /// How long connecting to etcd may take (default 2 s).
    pub connect_timeout: Duration,
}

impl FleetConfig {
    /// The fleet registered in etcd at `endpoints` under [`DEFAULT_PREFIX`].
    pub fn new<S: Into<String>>(endpoints: impl IntoIterator<Item = S>) -> Self {
        Self {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            prefix: DEFAULT_PREFIX.into(),
            client: None,
            trust_registry: false,
            labels: BTreeMap::new(),
            connect_timeout: Duration::from_secs(2),
        }
    }

    /// Sets the key prefix.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Sets how nodes are trusted and authenticated to.
    pub fn client(mut self, config: ClientConfig) -> Self {
        self.client = Some(config);
        self
    }

    /// Trusts nodes by the registry's fingerprints (see the field).
    pub fn trust_registry(mut self, on: bool) -> Self {
        self.trust_registry = on;
        self
    }

    /// Places leases only on nodes labelled `key=value` (repeat for more).
    pub fn label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }
}

/// Why the fleet could not be followed or a lease placed.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// etcd could not be reached or answered with an error.
    #[error("etcd: {0}")]
    Etcd(String),
    /// The configuration cannot work.
    #[error("config: {0}")]
    Config(String),
    /// No registered node fits the lease (VRAM, protocol, labels).
    #[error("no node fits a lease of {min_vram} bytes ({registered} nodes registered)")]
    NoNodeFits {
        /// The VRAM asked for.
        min_vram: u64,
        /// Nodes in the registry.
        registered: usize,
    },
    /// Every fitting node was tried and none took the lease (full or
    /// unreachable): node names with their errors, in the order tried.
    #[error("no node took the lease: {}", summary(.0))]
    Exhausted(Vec<(String, Error)>),
    /// A node refused the lease for a reason the next node would share
    /// (credentials, configuration): not tried further.
    #[error("node {node}: {source}")]
    Node {
        /// The node's name.
        node: String,
        /// Its error.
        #[source]
        source: Error,
    },
}

fn summary(tried: &[(String, Error)]) -> String {
    tried
        .iter()
        .map(|(n, e)| format!("{n}: {e}"))
        .collect::<Vec<_>>()
        .join("; ")
}

fn etcd(e: etcd_client::Error) -> FleetError {
    FleetError::Etcd(e.to_string())
}

type View = Arc<BTreeMap<String, NodeRecord>>;

/// The fleet as the registry describes it, and the place to lease from. The
/// view is what etcd said last, kept current by a watch (unchanged while etcd
/// is unreachable, read anew once it is back). Cheap to clone: clones share
/// one view, one watch and the node connections.
#[derive(Debug, Clone)]
pub struct Fleet {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    cfg: FleetConfig,
    view: watch::Receiver<View>,
    follower: JoinHandle<()>,
    /// One connection per node, reused by its leases.
    clients: Mutex<HashMap<String, (NodeRecord, Arc<Client>)>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.follower.abort();
    }
}

impl Fleet {
    /// Reads the registry and starts following it; call inside a tokio runtime.
    ///
    /// # Errors
    ///
    /// [`FleetError::Etcd`] when etcd cannot be reached;
    /// [`FleetError::Config`] without endpoints, or without a client
    /// configuration while the registry is not trusted.
    pub async fn connect(cfg: FleetConfig) -> Result<Fleet, FleetError> {
        if cfg.endpoints.is_empty() {
            return Err(FleetError::Config("no etcd endpoints".into()));
        }
        if cfg.client.is_none() && !cfg.trust_registry {
            return Err(FleetError::Config(
                "a fleet needs a ClientConfig (roots, token) unless it trusts the registry's fingerprints".into(),
            ));
        }
        let mut etcd_client = connect_etcd(&cfg).await?;
        let prefix = nodes_prefix(&cfg.prefix);
        let (view, revision) = snapshot(&mut etcd_client, &prefix).await?;
        let (tx, rx) = watch::channel(Arc::new(view));
        let follower = tokio::spawn(follow(cfg.clone(), etcd_client, prefix, revision, tx));
        Ok(Fleet {
            inner: Arc::new(Inner {
                cfg,
                view: rx,
                follower,
                clients: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// The registered nodes, by name.
    pub fn nodes(&self) -> Vec<NodeRecord> {
        self.inner.view.borrow().values().cloned().collect()
    }

    /// The node registered as `name`.
    pub fn node(&self, name: &str) -> Option<NodeRecord> {
        self.inner.view.borrow().get(name).cloned()
    }

    /// Waits (woken by the watch) at most `timeout` for `pred` to hold for
    /// the registered nodes; whether it held.
    pub async fn wait_until(
        &self,
        timeout: Duration,
        mut pred: impl FnMut(&[NodeRecord]) -> bool,
    ) -> bool {
        let mut rx = self.inner.view.clone();
        let check = async {
            loop {
                let nodes: Vec<NodeRecord> = rx.borrow_and_update().values().cloned().collect();
                if pred(&nodes) {
                    return true;
                }
                if rx.changed().await.is_err() {
                    return false;
                }
            }
        };
        tokio::time::timeout(timeout, check).await.unwrap_or(false)
    }

    /// Leases on a node that fits `builder` (its VRAM, this client's protocol
    /// version, the configured labels), least loaded first (fewest leases,
    /// then most reservable VRAM), moving on when a node is full or silent.
    /// The fleet's client configuration replaces the builder's.
    ///
    /// # Errors
    ///
    /// [`FleetError::NoNodeFits`], [`FleetError::Exhausted`], or
    /// [`FleetError::Node`] for an error the next node would give too
    /// (credentials, say).
    pub async fn lease(&self, builder: LeaseBuilder) -> Result<Lease, FleetError> {
        self.lease_placed(builder, |nodes, need| {
            rank(nodes, need).into_iter().map(|n| n.name).collect()
        })
        .await
    }

    /// As [`Fleet::lease`], trying in order the nodes `place` names given the
    /// registered nodes and the lease's need ([`Need::fits`] is the default's
    /// filter). Unregistered names are skipped.
    ///
    /// # Errors
    ///
    /// As [`Fleet::lease`]; [`FleetError::NoNodeFits`] when `place` names
    /// none.
    pub async fn lease_placed(
        &self,
        builder: LeaseBuilder,
        place: impl FnOnce(&[NodeRecord], &Need) -> Vec<String>,
    ) -> Result<Lease, FleetError> {
        let need = Need {
            min_vram: builder.vram(),
            labels: self.inner.cfg.labels.clone(),
        };
        let nodes = self.nodes();
        let order = place(&nodes, &need);
        let mut tried = Vec::new();
        for name in order {
            let Some(node) = nodes.iter().find(|n| n.name == name) else {
                continue;
            };
            match self.lease_on(node, builder.clone()).await {
                Ok(lease) => return Ok(lease),
                Err(e) if next_may_work(&e) => {
                    debug!(node = %node.name, error = %e, "fleet: lease refused; trying the next node");
                    tried.push((node.name.clone(), e));
                }
                Err(e) => {
                    return Err(FleetError::Node {
                        node: node.name.clone(),
                        source: e,
                    })
                }
            }
        }
        if tried.is_empty() {
            return Err(FleetError::NoNodeFits {
                min_vram: need.min_vram,
                registered: nodes.len(),
            });
        }
        Err(FleetError::Exhausted(tried))
    }

    /// Leases on `node` over the fleet's connection (made on first use and once lost).
    async fn lease_on(&self, node: &NodeRecord, builder: LeaseBuilder) -> Result<Lease, Error> {
        let (client, fresh) = self.client_of(node).await?;
        match builder.clone().on(client).await {
            Err(e) if !fresh && matches!(e.kind(), ErrorKind::Disconnected(_)) => {
                // The cached connection died under us: once more, anew.
                lock(&self.inner.clients).remove(&node.name);
                let (client, _) = self.client_of(node).await?;
                builder.on(client).await
            }
            r => r,
        }
    }

    /// The connection to `node`, and whether it was just made.
    async fn client_of(&self, node: &NodeRecord) -> Result<(Arc<Client>, bool), Error> {
        if let Some((rec, c)) = lock(&self.inner.clients).get(&node.name) {
            if rec.address == node.address && rec.cert_sha256 == node.cert_sha256 && !c.is_closed()
            {
                return Ok((c.clone(), false));
            }
        }
        let config = self.config_for(node)?;
        let client = Arc::new(Client::connect(node.address, &config).await?);
        lock(&self.inner.clients).insert(node.name.clone(), (node.clone(), client.clone()));
        Ok((client, true))
    }

    /// How this client connects to `node`.
    fn config_for(&self, node: &NodeRecord) -> Result<ClientConfig, Error> {
        let cfg = &self.inner.cfg;
        if !cfg.trust_registry {
            return cfg
                .client
                .clone()
                .ok_or_else(|| Error::new(ErrorKind::Config, "the fleet has no ClientConfig"));
        }
        let sha = node.fingerprint_bytes().ok_or_else(|| {
            Error::new(
                ErrorKind::Config,
                format!(
                    "node {}: the registry's certificate fingerprint {:?} is not a SHA-256",
                    node.name, node.cert_sha256
                ),
            )
        })?;
        Ok(match &cfg.client {
            Some(c) => c.clone().pin_sha256(sha),
            None => ClientConfig::pinned_sha256(sha),
        })
    }
}

/// Whether another node may take a lease this one refused (full or unreachable).
fn next_may_work(e: &Error) -> bool {
    matches!(e.kind(), ErrorKind::Capacity | ErrorKind::Disconnected(_))
}

async fn connect_etcd(cfg: &FleetConfig) -> Result<etcd_client::Client, FleetError> {
    let opts = ConnectOptions::new()
        .with_connect_timeout(cfg.connect_timeout)
        .with_timeout(cfg.connect_timeout);
    etcd_client::Client::connect(&cfg.endpoints, Some(opts))
        .await
        .map_err(etcd)
}

/// Every record under `prefix`, and the revision they were read at.
async fn snapshot(
    client: &mut etcd_client::Client,
    prefix: &str,
) -> Result<(BTreeMap<String, NodeRecord>, i64), FleetError> {
    let resp = client
        .get(prefix, Some(GetOptions::new().with_prefix()))
        .await
        .map_err(etcd)?;
    let revision = resp.header().map_or(0, |h| h.revision());
    let mut view = BTreeMap::new();
    for kv in resp.kvs() {
        if let Some(r) = parse(kv.key(), kv.value(), prefix) {
            view.insert(r.name.clone(), r);
        }
    }
    Ok((view, revision))
}

/// A record whose key and value agree; `None` (and a warning) otherwise.
fn parse(key: &[u8], value: &[u8], prefix: &str) -> Option<NodeRecord> {
    let name = String::from_utf8_lossy(key.strip_prefix(prefix.as_bytes())?).into_owned();
    match NodeRecord::from_json(value) {
        Ok(r) if r.name == name => Some(r),
        Ok(r) => {
            warn!(key = %String::from_utf8_lossy(key), name = %r.name, "fleet: a record under another node's name; ignored");
            None
        }
        Err(e) => {
            warn!(key = %String::from_utf8_lossy(key), error = %e, "fleet: not a node record; ignored");
            None
        }
    }
}

/// Follows the registry from `revision`, applying watch events to the view;
/// when the watch fails (etcd gone, history compacted), reconnects, rereads
/// the registry and watches from there.
async fn follow(
    cfg: FleetConfig,
    mut client: etcd_client::Client,
    prefix: String,
    mut revision: i64,
    tx: watch::Sender<View>,
) {
    let mut failures = 0u32;
    loop {
        // (The fleet aborts this task when its last clone goes.)
        let e = watch_from(&mut client, &prefix, &mut revision, &tx).await;
        if failures == 0 {
            warn!(error = %e, "fleet: lost the registry's watch; following it again when etcd answers");
        }
        loop {
            failures += 1;
            tokio::time::sleep(Duration::from_millis(100) * failures.min(10)).await;
            let Ok(mut c) = connect_etcd(&cfg).await else {
                continue;
            };
            if let Ok((view, rev)) = snapshot(&mut c, &prefix).await {
                tx.send_replace(Arc::new(view));
                revision = rev;
                client = c;
                failures = 0;
                break;
            }
        }
    }
}

/// Watches `prefix` after `revision` until the watch fails; returns why.
async fn watch_from(
    client: &mut etcd_client::Client,
    prefix: &str,
    revision: &mut i64,
    tx: &watch::Sender<View>,
) -> FleetError {
    let opts = WatchOptions::new()
        .with_prefix()
        .with_start_revision(*revision + 1);
    let mut stream = match client.watch(prefix, Some(opts)).await {
        Ok(s) => s,
        Err(e) => return etcd(e),
    };
    loop {
        let resp = match stream.message().await {
            Ok(Some(r)) => r,
            Ok(None) => return FleetError::Etcd("the watch ended".into()),
            Err(e) => return etcd(e),
        };
        if resp.canceled() {
            return FleetError::Etcd(format!(
                "the watch was cancelled: {} (compacted at {})",
                resp.cancel_reason(),
                resp.compact_revision()
            ));
        }
        if resp.events().is_empty() {
            continue;
        }
        tx.send_modify(|view| {
            let view = Arc::make_mut(view);
            for ev in resp.events() {
                let Some(kv) = ev.kv() else { continue };
                match ev.event_type() {
                    EventType::Put => {
                        if let Some(r) = parse(kv.key(), kv.value(), prefix) {
                            view.insert(r.name.clone(), r);
                        }
                    }
                    EventType::Delete => {
                        if let Some(name) = kv.key().strip_prefix(prefix.as_bytes()) {
                            view.remove(String::from_utf8_lossy(name).as_ref());
                        }
                    }
                }
            }
        });
        if let Some(h) = resp.header() {
            *revision = h.revision();
        }
    }
}
