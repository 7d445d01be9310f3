//! Leases: [`LeaseBuilder`], [`Lease`] with its background renewal, and the
//! state a lease's sessions, buffers and batches share.

use super::error::{config_error, ErrorKind};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::task::JoinHandle;

use super::connection::{exchange, ReplyInto};
use super::direct::Opened;
use super::{Client, ClientConfig, Error, Session};
use crate::proto::{
    to_body, Id, IdOp, LeaseAlloc, LeaseGrant, LeaseId, LeaseRef, LeaseRenew, LeaseStatus, Opcode,
};

/// Builds a [`Lease`].
#[derive(Debug, Clone)]
pub struct LeaseBuilder {
    min_vram: u64,
    ttl: Duration,
    auto_renew: bool,
    config: Option<ClientConfig>,
}

pub(crate) struct LeaseInner {
    pub(super) client: Arc<Client>,
    pub(super) id: LeaseId,
    reserved: u64,
    ttl: Duration,
    generation: AtomicU64,
    expired: AtomicBool,
    freed: AtomicBool,
    /// The next id this client picks for the lease.
    next_id: AtomicU64,
    /// The next batch number (see [`Batch::seq`](crate::proto::Batch::seq)).
    pub(super) next_seq: AtomicU64,
    /// The lease's worker's own connection, where its BATCHes go
    /// ([`ClientConfig::direct`](super::ClientConfig::direct)).
    direct: Option<quinn::Connection>,
}

impl std::fmt::Debug for LeaseInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseInner")
            .field("id", &self.id)
            .field("reserved", &self.reserved)
            .finish()
    }
}

impl LeaseInner {
    /// One request of this lease ([`LeaseInner::guard`]), the reply's data
    /// going where `into` says.
    pub(super) async fn req_with(
        &self,
        op: Opcode,
        body: &[u8],
        data: &[u8],
        into: ReplyInto<'_, '_>,
    ) -> Result<(Vec<u8>, Vec<u8>), Error> {
        let client = &self.client;
        let id = client.next_id.fetch_add(1, Ordering::Relaxed);
        let (conn, direct) = match (&self.direct, op) {
            (Some(direct), Opcode::Batch) => (direct, true),
            _ => (&client.conn, false),
        };
        // Pinned here and guarded by reference, and the rare path boxed:
        // the future is not copied into `guard`'s (a submission's future
        // is moved whole, so its size is paid on every one).
        let r = std::pin::pin!(async {
            let _busy = client.busy.enter();
            match exchange(conn, &client.limits, id, op, body, data, into).await {
                Err(e) if direct && matches!(e.kind(), ErrorKind::Disconnected(_)) => {
                    Err(Box::pin(self.why_direct_lost(e)).await)
                }
                r => r,
            }
        });
        self.guard(r).await
    }

    /// Why the lease's worker connection was lost: the lease's end as the
    /// node reports it (its worker ends with it), else `lost` itself.
    async fn why_direct_lost(&self, lost: Error) -> Error {
        let asked = self
            .client
            .call::<_, LeaseStatus>(Opcode::LeaseQuery, &LeaseRef { lease: self.id })
            .await;
        match asked {
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::LeaseExpired | ErrorKind::LeaseNotFound | ErrorKind::LeasePoisoned
                ) =>
            {
                e
            }
            Ok(s) if s.state == crate::proto::LeaseState::Poisoned => Error::new(
                ErrorKind::LeasePoisoned,
                format!("lease {} poisoned: its worker ended", self.id),
            ),
            _ => lost,
        }
    }

    /// Runs a request of this lease: refused once the lease was freed, and
    /// an expiry it reports is remembered. A request in flight when this
    /// client freed the lease fails as [`ErrorKind::LeaseFreed`], whatever
    /// the node made of it (its lease gone, its worker ended).
    pub(super) async fn guard<T>(
        &self,
        request: impl std::future::Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        let freed = || Error::new(ErrorKind::LeaseFreed, "this client freed the lease");
        if self.freed.load(Ordering::SeqCst) {
            return Err(self.named(freed()));
        }
        let r = request.await;
        match r {
            Err(e) if self.freed.load(Ordering::SeqCst) => Err(self.named(Error::new(
                ErrorKind::LeaseFreed,
                format!(
                    "this client freed the lease while the request was in flight ({})",
                    e.message()
                ),
            ))),
            Err(e) if e.kind() == ErrorKind::LeaseExpired => {
                self.expired.store(true, Ordering::SeqCst);
                Err(self.named(e))
            }
            r => r.map_err(|e| self.named(e)),
        }
    }

    /// `e`, naming this lease and its node.
    pub(super) fn named(&self, e: Error) -> Error {
        e.with_lease(self.id).with_node(self.client.addr)
    }

    /// A fresh id of this lease (the client names everything).
    pub(super) fn fresh_id(&self) -> Id {
        Id(self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    pub(super) fn free_in_background(self: &Arc<Self>, id: Id) {
        if self.freed.load(Ordering::SeqCst) || self.expired.load(Ordering::SeqCst) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let inner = self.clone();
        rt.spawn(async move {
            let body = to_body(&IdOp {
                lease: inner.id,
                id,
            });
            let _ = inner
                .req_with(Opcode::MemFree, &body, &[], ReplyInto::Owned)
                .await;
        });
    }
}

/// A lease on a node: reserved VRAM with a TTL, renewed in the background at
/// about 75 % of the TTL. Dropping it frees the lease in the background (if a
/// tokio runtime is running); [`Lease::free`] frees it and waits. If the
/// client crashes, the TTL frees everything.
#[derive(Debug)]
pub struct Lease {
    inner: Arc<LeaseInner>,
    renew: Option<JoinHandle<()>>,
}

impl Lease {
    /// A builder: 256 MiB, 60 s TTL, auto-renew on.
    pub fn builder() -> LeaseBuilder {
        LeaseBuilder {
            min_vram: 256 << 20,
            ttl: Duration::from_secs(60),
            auto_renew: true,
            config: None,
        }
    }

    /// Whether the lease's worker serves its BATCHes over a connection of
    /// their own ([`ClientConfig::direct`](super::ClientConfig::direct)).
    pub fn is_direct(&self) -> bool {
        self.inner.direct.is_some()
    }

    /// The lease id (the capability to use and free it).
    pub fn id(&self) -> LeaseId {
        self.inner.id
    }

    /// Reserved bytes.
    pub fn reserved(&self) -> u64 {
        self.inner.reserved
    }

    /// The generation of the last grant or renewal.
    pub fn generation(&self) -> u64 {
        self.inner.generation.load(Ordering::SeqCst)
    }

    /// The connection this lease uses.
    pub fn client(&self) -> &Arc<Client> {
        &self.inner.client
    }

    /// Renews now for the lease's TTL.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::LeaseExpired`](crate::client::ErrorKind::LeaseExpired) when too late.
    pub async fn renew(&self) -> Result<LeaseGrant, Error> {
        renew(&self.inner).await
    }

    /// Asks the node about this lease.
    ///
    /// # Errors
    ///
    /// As [`Client::request`].
    pub async fn query(&self) -> Result<LeaseStatus, Error> {
        let inner = &self.inner;
        inner.guard(inner.client.query_lease(inner.id)).await
    }

    /// The lease's memory in the form of a local pool's statistics
    /// ([`MemPool::stats`](cuda_core::MemPool::stats)), from
    /// [`Lease::query`]: `used` and `used_high` are the bytes allocated now
    /// and at most; `reserved` and `reserved_high` the lease's reservation
    /// (the node holds it whole from the grant on).
    ///
    /// # Errors
    ///
    /// As [`Lease::query`].
    pub async fn mem_stats(&self) -> Result<cuda_core::MemPoolStats, Error> {
        let st = self.query().await?;
        Ok(cuda_core::MemPoolStats {
            used: st.allocated,
            used_high: st.allocated_high,
            reserved: st.reserved,
            reserved_high: st.reserved,
        })
    }

    /// A session on this lease's stream.
    pub fn session(&self) -> Session {
        Session {
            inner: self.inner.clone(),
        }
    }

    /// Stops renewing without freeing (for tests of TTL expiry).
    pub fn stop_renewing(&mut self) {
        if let Some(t) = self.renew.take() {
            t.abort();
        }
    }

    /// Frees the lease now; the node ends its worker and returns its memory
    /// before replying.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::LeaseNotFound`](crate::client::ErrorKind::LeaseNotFound) or
    /// [`ErrorKind::LeaseExpired`](crate::client::ErrorKind::LeaseExpired) when it is already gone.
    pub async fn free(mut self) -> Result<(), Error> {
        self.stop_renewing();
        self.inner.freed.store(true, Ordering::SeqCst);
        self.inner.client.free_lease(self.inner.id).await
    }

    /// Forgets the lease without freeing it (as if the client crashed).
    pub fn leak(mut self) {
        self.stop_renewing();
        self.inner.freed.store(true, Ordering::SeqCst);
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.stop_renewing();
        if self.inner.freed.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let client = self.inner.client.clone();
            let id = self.inner.id;
            rt.spawn(async move {
                let _ = client.free_lease(id).await;
            });
        }
    }
}

async fn renew(inner: &LeaseInner) -> Result<LeaseGrant, Error> {
    let ttl_secs = inner.ttl.as_secs().max(1) as u32;
    let renew = LeaseRenew {
        lease: inner.id,
        ttl_secs,
    };
    let g: LeaseGrant = inner
        .guard(inner.client.call(Opcode::LeaseRenew, &renew))
        .await?;
    inner.generation.store(g.generation, Ordering::SeqCst);
    Ok(g)
}

impl LeaseBuilder {
    /// The VRAM this builder reserves (what a fleet places by).
    pub fn vram(&self) -> u64 {
        self.min_vram
    }

    /// VRAM to reserve in bytes.
    pub fn min_vram(mut self, bytes: u64) -> Self {
        self.min_vram = bytes;
        self
    }

    /// TTL (whole seconds, at least 1).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl.max(Duration::from_secs(1));
        self
    }

    /// Renew in the background at ~75 % of the TTL (default on).
    pub fn auto_renew(mut self, on: bool) -> Self {
        self.auto_renew = on;
        self
    }

    /// How to trust and authenticate to the node (required by [`LeaseBuilder::connect`]).
    pub fn config(mut self, config: ClientConfig) -> Self {
        self.config = Some(config);
        self
    }

    /// Connects to `addr` and leases.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Config`](crate::client::ErrorKind::Config) without a config, connection errors, or the lease's:
    /// [`ErrorKind::Capacity`](crate::client::ErrorKind::Capacity), [`ErrorKind::Unauthorized`](crate::client::ErrorKind::Unauthorized).
    pub async fn connect(self, addr: SocketAddr) -> Result<Lease, Error> {
        let config = self
            .config
            .clone()
            .ok_or_else(|| config_error("LeaseBuilder needs a ClientConfig"))?;
        let client = Arc::new(Client::connect(addr, &config).await?);
        self.on(client).await
    }

    /// Leases over an existing connection.
    ///
    /// # Errors
    ///
    /// As [`LeaseBuilder::connect`].
    pub async fn on(self, client: Arc<Client>) -> Result<Lease, Error> {
        let req = LeaseAlloc {
            min_vram: self.min_vram,
            ttl_secs: self.ttl.as_secs().max(1) as u32,
        };
        let (g, direct) = loop {
            let g: LeaseGrant = client.call(Opcode::LeaseAlloc, &req).await?;
            if !client.config.direct || client.workers_unreachable.load(Ordering::Relaxed) {
                break (g, None);
            }
            match super::direct::open(&client, g.lease).await {
                Ok(Opened::Direct(conn)) => break (g, Some(conn)),
                Ok(Opened::Node) => break (g, None),
                Ok(Opened::Unreachable(e)) => {
                    // The node serves this lease's batches through its
                    // worker now, which this client cannot reach (a
                    // firewall, say): the lease goes, and this client's
                    // leases take the node's path from now on.
                    tracing::warn!(
                        lease = %g.lease, error = %e,
                        "a lease's worker cannot be reached: leasing again on the node's path"
                    );
                    client.workers_unreachable.store(true, Ordering::Relaxed);
                    let _ = client.free_lease(g.lease).await;
                }
                Err(e) => {
                    // Freed now, not left held until its TTL runs out.
                    let _ = client.free_lease(g.lease).await;
                    return Err(e);
                }
            }
        };
        let inner = Arc::new(LeaseInner {
            client,
            id: g.lease,
            reserved: g.reserved,
            ttl: self.ttl,
            generation: AtomicU64::new(g.generation),
            expired: AtomicBool::new(false),
            freed: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
            next_seq: AtomicU64::new(1),
            direct,
        });
        let renew_task = self.auto_renew.then(|| {
            let weak: Weak<LeaseInner> = Arc::downgrade(&inner);
            let period = Duration::from_millis(g.ttl_ms.max(1000) * 3 / 4);
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(period).await;
                    let Some(inner) = weak.upgrade() else { return };
                    if inner.freed.load(Ordering::SeqCst) {
                        return;
                    }
                    match renew(&inner).await {
                        Ok(_) => {}
                        Err(e) if matches!(e.kind(), ErrorKind::Disconnected(_)) => {}
                        Err(e) => {
                            tracing::warn!(lease = %inner.id, error = %e, "renewal stopped");
                            return;
                        }
                    }
                }
            })
        });
        Ok(Lease {
            inner,
            renew: renew_task,
        })
    }
}
