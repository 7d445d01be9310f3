//! Principals from tokens and client certificates, and the owner check on
//! every lease request.

use rustls::pki_types::CertificateDer;

use super::handshake::Peer;
use super::{Reply, Shared, Slot};
use crate::lease_table::Principal;
use crate::proto::{LeaseId, Status};

/// The principal of `token`, compared with every token without early exit.
pub(super) fn token_principal(shared: &Shared, token: &str) -> Option<Principal> {
    let mut found = None;
    for (known, principal) in &shared.tokens {
        if crate::same_secret(known, token.as_bytes()) {
            found = Some(principal.clone());
        }
    }
    found
}

/// A client certificate's principal: `cert-` and 16 hex digits of its SHA-256.
pub(super) fn cert_principal(conn: &quinn::Connection) -> Option<Principal> {
    let certs = conn
        .peer_identity()?
        .downcast::<Vec<CertificateDer<'static>>>()
        .ok()?;
    let leaf = certs.first()?;
    let digest = ring::digest::digest(&ring::digest::SHA256, leaf.as_ref());
    let hex: String = digest.as_ref()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Some(Principal::from(format!("cert-{hex}")))
}

/// The connection's principal, or UNAUTHORIZED.
pub(super) fn principal(peer: &Peer) -> Result<&Principal, Reply> {
    peer.get()
        .ok_or_else(|| Reply::err(Status::Unauthorized, "send HELLO with a valid token first"))
}

/// What the owner check is asked with: admins see every lease.
pub(super) fn owner_filter<'a>(shared: &Shared, who: &'a Principal) -> Option<&'a str> {
    if shared.cfg.admins.iter().any(|a| **a == **who) {
        None
    } else {
        Some(who)
    }
}

/// The slot of lease `id` if usable and `who`'s (else NOT_FOUND, as unknown).
pub(super) fn lease_of(shared: &Shared, who: &Principal, id: &LeaseId) -> Result<Slot, Reply> {
    let t = shared.table();
    t.check_owner(id, Some(who))?;
    Ok(t.get(id, shared.now())?)
}
