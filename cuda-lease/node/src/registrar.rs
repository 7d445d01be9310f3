//! The node's registry task: keeps the node's record in etcd under a
//! kept-alive etcd lease, rewrites it on change, survives etcd outages, and
//! revokes the lease on shutdown.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, PutOptions};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use cuda_lease_fleet::{NodeRecord, RegistryConfig};

/// What the node holds now, as a record.
pub(crate) type Snapshot = Arc<dyn Fn() -> NodeRecord + Send + Sync>;

/// The running registration. Dropping it stops the task and the record
/// expires with its etcd lease; [`Registrar::leave`] removes it at once.
#[derive(Debug)]
pub(crate) struct Registrar {
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

/// Starts registering the node that `snapshot` describes.
pub(crate) fn spawn(cfg: RegistryConfig, snapshot: Snapshot) -> Registrar {
    let (stop, stopped) = oneshot::channel();
    let task = tokio::spawn(run(cfg, snapshot, stopped));
    Registrar {
        stop: Some(stop),
        task,
    }
}

impl Registrar {
    /// Removes the record now (revokes the etcd lease), waiting at most 2 s.
    pub(crate) async fn leave(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), &mut self.task).await;
    }
}

impl Drop for Registrar {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn run(cfg: RegistryConfig, snapshot: Snapshot, mut stop: oneshot::Receiver<()>) {
    let key = NodeRecord::key(&cfg.prefix, &snapshot().name);
    let mut prev_lease = None;
    let mut failures = 0u32;
    let max_backoff = (cfg.ttl / 3).clamp(Duration::from_millis(200), Duration::from_secs(2));
    loop {
        match session(
            &cfg,
            &key,
            &snapshot,
            &mut stop,
            &mut prev_lease,
            &mut failures,
        )
        .await
        {
            Ok(()) => return,
            Err(e) => {
                // Loud once, then quiet until it works again.
                if failures == 0 {
                    warn!(error = %e, endpoints = ?cfg.endpoints, "registry: etcd unreachable; serving on, registering again when it is back");
                } else {
                    debug!(error = %e, "registry: still no etcd");
                }
                failures += 1;
            }
        }
        let backoff = (Duration::from_millis(100) * failures.min(20)).min(max_backoff);
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = &mut stop => return,
        }
    }
}

/// One etcd connection: grants a lease, writes the record under it and keeps
/// both current until etcd fails (`Err`) or the node leaves (`Ok`).
async fn session(
    cfg: &RegistryConfig,
    key: &str,
    snapshot: &Snapshot,
    stop: &mut oneshot::Receiver<()>,
    prev_lease: &mut Option<i64>,
    failures: &mut u32,
) -> Result<(), etcd_client::Error> {
    let request_timeout = cfg.connect_timeout.max(cfg.ttl / 3);
    let opts = ConnectOptions::new()
        .with_connect_timeout(cfg.connect_timeout)
        .with_timeout(request_timeout);
    let mut client = Client::connect(&cfg.endpoints, Some(opts)).await?;
    let ttl_secs = cfg.ttl.as_secs().max(1) as i64;
    let lease = client.lease_grant(ttl_secs, None).await?.id();
    let put = || Some(PutOptions::new().with_lease(lease));

    let mut record = snapshot();
    if let Some(kv) = client.get(key, None).await?.kvs().first() {
        let ours = prev_lease.is_some_and(|p| p == kv.lease());
        match NodeRecord::from_json(kv.value()) {
            Ok(other) if !ours && other.address != record.address => warn!(
                name = %record.name, other = %other.address,
                "registry: another node is registered under this name; taking the name over"
            ),
            _ => {}
        }
    }
    client.put(key, record.to_json(), put()).await?;
    if let Some(old) = prev_lease.replace(lease) {
        // The record moved to the new lease.
        let _ = client.lease_revoke(old).await;
    }
    if *failures > 0 {
        info!(name = %record.name, "registry: registered again");
    } else {
        info!(name = %record.name, key, ttl_secs, "registry: registered");
    }
    *failures = 0;

    let (mut keeper, mut answers) = client.lease_keep_alive(lease).await?;
    let mut keep_alive = tokio::time::interval(cfg.ttl / 3);
    let mut check = tokio::time::interval(cfg.min_update_interval.max(Duration::from_millis(10)));
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = keep_alive.tick() => {
                keeper.keep_alive().await?;
                let answer = tokio::time::timeout(request_timeout, answers.message())
                    .await
                    .map_err(|_| etcd_client::Error::LeaseKeepAliveError("no answer".into()))??;
                match answer {
                    Some(a) if a.ttl() > 0 => {}
                    _ => return Err(etcd_client::Error::LeaseKeepAliveError(
                        "the etcd lease expired".into(),
                    )),
                }
            }
            _ = check.tick() => {
                let now = snapshot();
                if now != record {
                    client.put(key, now.to_json(), put()).await?;
                    record = now;
                }
            }
            _ = &mut *stop => {
                let _ = tokio::time::timeout(Duration::from_secs(1), client.lease_revoke(lease)).await;
                info!(name = %record.name, "registry: left");
                return Ok(());
            }
        }
    }
}
