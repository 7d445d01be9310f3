//! The service on a fleet (`--etcd`, feature `fleet`): the model
//! uploaded once on each of several leases, each on its own node, and
//! every pipeline run on the lease with the fewest in flight.
//!
//! A pipeline uses the weights, and a remote buffer's work runs on the
//! node that holds it, so one lease per node with its own copy of the
//! weights is what spreads requests over the nodes (a single
//! `FleetPolicy` would place every forward pass on the node that holds
//! the one copy). A lease whose node is lost (disconnected, or the lease
//! expired, freed or poisoned) leaves at once: the request it failed runs
//! again on another lease, and a background task leases on a node not in
//! use, uploads the weights there, and adds it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use cuda_async::{RemotePolicy, SchedulingPolicy};
use cuda_lease::client::Lease;
use cuda_lease::remote::LeaseBackend;
use cuda_lease_fleet::{Fleet, FleetError};
use tokio::sync::Notify;

use crate::model::{HostWeights, Model};

/// How a [`Replicas`] leases.
#[derive(Debug, Clone)]
pub struct FleetOptions {
    /// Leases held, each on another node (fewer while the fleet has fewer
    /// nodes that fit; the rest are taken as nodes come).
    pub leases: usize,
    /// VRAM of each lease.
    pub vram: u64,
    /// Streams of each lease's policy.
    pub streams: u32,
}

/// One lease with the model's weights on it.
#[derive(Debug)]
pub struct Replica {
    node: String,
    model: Model,
    policy: Arc<dyn SchedulingPolicy>,
    in_flight: AtomicUsize,
    lease: Mutex<Option<Lease>>,
}

impl Replica {
    /// The node the lease is on.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The model, uploaded on this lease.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The policy over this lease's streams.
    pub fn policy(&self) -> &dyn SchedulingPolicy {
        &*self.policy
    }
}

/// A replica picked for one pipeline: counted in flight until dropped.
#[derive(Debug)]
pub struct Picked(Arc<Replica>);

impl std::ops::Deref for Picked {
    type Target = Replica;
    fn deref(&self) -> &Replica {
        &self.0
    }
}

impl Drop for Picked {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The model on leases of a fleet (see the module).
#[derive(Debug)]
pub struct Replicas {
    fleet: Fleet,
    options: FleetOptions,
    weights: HostWeights,
    live: Mutex<Vec<Arc<Replica>>>,
    /// Wakes the task that replaces lost leases.
    lost: Arc<Notify>,
    turn: AtomicUsize,
}

impl Replicas {
    /// Leases up to `options.leases` nodes of `fleet` (one lease a node)
    /// and uploads `weights` on each; a task on the current runtime keeps
    /// the count up afterwards.
    ///
    /// # Errors
    ///
    /// When no node could be leased.
    pub async fn start(
        fleet: Fleet,
        options: FleetOptions,
        weights: HostWeights,
    ) -> Result<Arc<Self>, String> {
        let replicas = Arc::new(Replicas {
            fleet,
            options,
            weights,
            live: Mutex::default(),
            lost: Arc::default(),
            turn: AtomicUsize::new(0),
        });
        let mut why = String::from("no node registered");
        while replicas.count() < replicas.options.leases {
            match replicas.add().await {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    why = e;
                    break;
                }
            }
        }
        if replicas.count() == 0 {
            return Err(format!("--etcd: no lease on the fleet: {why}"));
        }
        tokio::spawn(keep_up(Arc::downgrade(&replicas)));
        Ok(replicas)
    }

    fn live(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Replica>>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Leases held now.
    pub fn count(&self) -> usize {
        self.live().len()
    }

    /// The nodes leased now.
    pub fn nodes(&self) -> Vec<String> {
        self.live().iter().map(|r| r.node.clone()).collect()
    }

    /// The replica with the fewest pipelines in flight (ties taken in
    /// turn), counted in flight until the returned guard drops; `None`
    /// with no lease alive.
    pub fn pick(&self) -> Option<Picked> {
        let live = self.live();
        let from = self.turn.fetch_add(1, Ordering::Relaxed);
        let r = (0..live.len())
            .map(|i| &live[(from + i) % live.len()])
            .min_by_key(|r| r.in_flight.load(Ordering::Acquire))?
            .clone();
        r.in_flight.fetch_add(1, Ordering::AcqRel);
        Some(Picked(r))
    }

    /// Takes `r` out of the rotation and has a replacement leased.
    pub fn lose(&self, r: &Replica, why: &cuda_async::Error) {
        let mut live = self.live();
        let before = live.len();
        live.retain(|o| !std::ptr::eq(&**o, r));
        if live.len() < before {
            eprintln!(
                "service: the lease on node {} is lost ({why}); replacing it",
                r.node
            );
            drop(live);
            self.lost.notify_one();
        }
    }

    /// Leases one node not in use and adds it: `Ok(false)` when every
    /// registered node that fits is in use.
    async fn add(&self) -> Result<bool, String> {
        let used = self.nodes();
        let builder = Lease::builder().min_vram(self.options.vram);
        let mut node = None;
        let placed = self
            .fleet
            .lease_placed(builder, |nodes, need| {
                let mut fits: Vec<_> = nodes
                    .iter()
                    .filter(|n| need.fits(n) && !used.contains(&n.name))
                    .collect();
                fits.sort_by_key(|n| (n.active_leases, std::cmp::Reverse(n.reservable_bytes)));
                node = fits.first().map(|n| n.name.clone());
                node.iter().cloned().collect()
            })
            .await;
        let lease = match placed {
            Ok(lease) => lease,
            Err(FleetError::NoNodeFits { .. }) => return Ok(false),
            Err(e) => return Err(e.to_string()),
        };
        let node = node.unwrap_or_default();
        let backend = LeaseBackend::current(lease.session());
        let policy: Arc<dyn SchedulingPolicy> =
            Arc::new(RemotePolicy::new(&backend).with_streams(self.options.streams));
        let model = match Model::upload(&self.weights, &*policy).await {
            Ok(m) => m,
            Err(e) => {
                let _ = lease.free().await;
                return Err(format!("uploading the weights on node {node}: {e}"));
            }
        };
        self.live().push(Arc::new(Replica {
            node,
            model,
            policy,
            in_flight: AtomicUsize::new(0),
            lease: Mutex::new(Some(lease)),
        }));
        Ok(true)
    }

    /// Frees every lease (the service is stopping).
    pub async fn free(&self) {
        let all: Vec<_> = self.live().drain(..).collect();
        for r in all {
            let lease = r.lease.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(lease) = lease {
                let _ = lease.free().await;
            }
        }
    }
}

impl Drop for Replicas {
    fn drop(&mut self) {
        // Ends the task that keeps the count up.
        self.lost.notify_one();
    }
}

/// Keeps `options.leases` leases: after a loss, and while short, leases
/// a node not in use; waits for the registry to change (a node joining or
/// freeing room) when none fits, and for a second after a failed try.
async fn keep_up(replicas: Weak<Replicas>) {
    loop {
        let Some(r) = replicas.upgrade() else { return };
        if r.count() >= r.options.leases {
            let lost = r.lost.clone();
            drop(r);
            lost.notified().await;
            continue;
        }
        match r.add().await {
            Ok(true) => {}
            Ok(false) => {
                let used = r.nodes();
                let need = r.options.vram;
                let fleet = r.fleet.clone();
                drop(r);
                // A node that is not in use and has room.
                fleet
                    .wait_until(Duration::from_secs(5), |nodes| {
                        nodes
                            .iter()
                            .any(|n| !used.contains(&n.name) && n.reservable_bytes >= need)
                    })
                    .await;
            }
            Err(e) => {
                eprintln!("service: leasing a replacement: {e}");
                drop(r);
                // A back-off, not an order: a node that refused (full,
                // unreachable) is not asked again at once; nothing waits
                // on this but the next try.
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}
