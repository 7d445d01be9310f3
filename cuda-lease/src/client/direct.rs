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

/// The longest a client waits for a lease's worker to answer its
/// connection (less when [`ClientConfig::connect_timeout`] is less): a
/// worker's port that cannot be reached from here (a firewall) costs this
/// once, then the client's leases take the node's path.
///
/// [`ClientConfig::connect_timeout`]: super::ClientConfig::connect_timeout
pub const DIRECT_CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// How a lease's BATCHes travel ([`open`]).
pub(super) enum Opened {
    /// Over the lease's own connection to its worker.
    Direct(quinn::Connection),
    /// Through the node: it serves the lease's batches itself.
    Node,
    /// The node granted a direct path, but its worker could not be reached
    /// from here (why): the lease cannot take either path and is freed.
    Unreachable(Error),
}

/// How long a lease's worker connection may be silent before it counts as
/// lost (and a request on it fails with the lease's end, as the node says).
/// The worker answers while it compiles a module, too.
const DIRECT_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Asks the node for `lease`'s direct path and connects to it:
/// [`Opened::Node`] when the node serves the lease's batches itself (it
/// runs without direct leases, or its worker could not open the path).
pub(super) async fn open(client: &Client, lease: LeaseId) -> Result<Opened, Error> {
    let grant: DirectGrant = match client.call(Opcode::LeaseDirect, &LeaseRef { lease }).await {
        Ok(g) => g,
        Err(e)
            if matches!(
                e.kind(),
                ErrorKind::InvalidRequest | ErrorKind::Protocol | ErrorKind::NodeInternal
            ) =>
        {
            tracing::debug!(%lease, error = %e, "the node serves the lease's batches itself");
            return Ok(Opened::Node);
        }
        Err(e) => return Err(e),
    };
    match connect(client, lease, grant).await {
        Ok(conn) => Ok(Opened::Direct(conn)),
        Err(e) if matches!(e.kind(), ErrorKind::Disconnected(_)) => Ok(Opened::Unreachable(e)),
        Err(e) => Err(e),
    }
}

/// Connects to the worker `grant` names and says HELLO for `lease`.
async fn connect(
    client: &Client,
    lease: LeaseId,
    grant: DirectGrant,
) -> Result<quinn::Connection, Error> {
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
    let wait = client.config.connect_timeout.min(DIRECT_CONNECT_TIMEOUT);
    let conn = tokio::time::timeout(wait, connecting)
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
    Ok(conn)
}
