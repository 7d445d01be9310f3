//! A lease's own connection to its worker (LEASE_DIRECT): its BATCHes go
//! there, everything else of the lease to the node.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;

use super::connection::{exchange, ReplyInto};
use super::error::{disconnected, protocol_error};
use super::{Client, Error, ErrorKind};
use crate::proto::{to_body, DirectGrant, DirectHello, LeaseId, LeaseRef, Opcode};
use crate::tls::{self, ServerTrust};

/// How often a lease's worker connection is kept alive.
const DIRECT_KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(1);

/// How long a lease's worker connection may be silent before it counts as
/// lost (and a request on it fails with the lease's end, as the node says).
/// The worker answers while it compiles a module, too.
const DIRECT_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Asks the node for `lease`'s direct path and connects to it; `None` when
/// the node serves the lease's batches itself (it has no direct leases).
pub(super) async fn open(
    client: &Client,
    lease: LeaseId,
) -> Result<Option<quinn::Connection>, Error> {
    let grant: DirectGrant = match client.call(Opcode::LeaseDirect, &LeaseRef { lease }).await {
        Ok(g) => g,
        Err(e) if matches!(e.kind(), ErrorKind::InvalidRequest | ErrorKind::Protocol) => {
            tracing::debug!(%lease, error = %e, "the node serves the lease's batches itself");
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    let addr: SocketAddr = grant
        .addr
        .parse()
        .map_err(|e| protocol_error(format!("direct address {:?}: {e}", grant.addr)))?;
    let digest = ring::digest::digest(&ring::digest::SHA256, &grant.cert_der);
    let mut sha256 = [0u8; 32];
    sha256.copy_from_slice(digest.as_ref());
    let trust = ServerTrust {
        roots: &[],
        sha256: Some(sha256),
    };
    let mut qcfg = tls::client_config(trust, None, &client.config.transport)
        .map_err(super::error::config_error)?;
    // A worker that ends (its lease expired, freed or failed) drops the
    // connection without closing it: noticed within the idle timeout.
    let mut transport = client
        .config
        .transport
        .quinn_config()
        .map_err(super::error::config_error)?;
    transport
        .keep_alive_interval(Some(DIRECT_KEEP_ALIVE))
        .max_idle_timeout(Some(
            DIRECT_IDLE_TIMEOUT
                .try_into()
                .map_err(super::error::config_error)?,
        ));
    qcfg.transport_config(std::sync::Arc::new(transport));
    let name = addr.ip().to_string();
    let connecting = client
        .endpoint
        .connect_with(qcfg, addr, &name)
        .map_err(disconnected)?;
    let conn = tokio::time::timeout(client.config.connect_timeout, connecting)
        .await
        .map_err(|_| disconnected(format!("the lease's worker at {addr} did not answer")))?
        .map_err(disconnected)?;
    let hello = DirectHello {
        lease,
        ticket: grant.ticket,
    };
    let id = client.next_id.fetch_add(1, Ordering::Relaxed);
    exchange(
        &conn,
        &client.limits,
        id,
        Opcode::Hello,
        &to_body(&hello),
        &[],
        ReplyInto::Owned,
    )
    .await?;
    Ok(Some(conn))
}
