//! The node's side of TLS 1.3: a self-signed development identity and the
//! server configurations of the QUIC endpoint and bulk-data channel. The
//! client's side and [`Identity`] are `cuda_lease::tls`, re-exported here.

use std::sync::Arc;
use std::time::Duration;

pub use cuda_lease::tls::*;

use cuda_lease::proto::ALPN;
use cuda_lease::transport::TransportSettings;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

fn err(e: impl std::fmt::Display) -> TlsError {
    TlsError(e.to_string())
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A fresh self-signed certificate for `names` (DNS names or IP addresses).
///
/// # Errors
/// When rcgen rejects a name.
pub fn self_signed(names: &[String]) -> Result<Identity, TlsError> {
    let ck = rcgen::generate_simple_self_signed(names.to_vec()).map_err(err)?;
    Ok(Identity {
        chain: vec![ck.cert.der().clone()],
        key: PrivateKeyDer::Pkcs8(rustls::pki_types::PrivatePkcs8KeyDer::from(
            ck.key_pair.serialize_der(),
        )),
    })
}

/// The QUIC server configuration: TLS 1.3, our ALPN, `transport`'s settings,
/// and optional client certificates checked against `client_ca`.
pub fn server_config(
    identity: &Identity,
    client_ca: Option<&[CertificateDer<'static>]>,
    transport: &TransportSettings,
) -> Result<quinn::ServerConfig, TlsError> {
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(err)?;
    let builder = match client_ca {
        Some(cas) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in cas {
                roots.add(c.clone()).map_err(err)?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider(),
            )
            .allow_unauthenticated()
            .build()
            .map_err(err)?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut tls = builder
        .with_single_cert(identity.chain.clone(), identity.key.clone_key())
        .map_err(err)?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    tls.max_early_data_size = 0;
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls).map_err(err)?;
    let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    let mut transport = transport.quinn_config().map_err(err)?;
    transport
        .max_concurrent_bidi_streams(256u32.into())
        .max_concurrent_uni_streams(0u32.into())
        .max_idle_timeout(Some(Duration::from_secs(60).try_into().map_err(err)?));
    cfg.transport_config(Arc::new(transport));
    Ok(cfg)
}

/// The bulk-data channel's TLS server configuration: TLS 1.3, its own ALPN,
/// no client certificates (the QUIC-issued ticket names the principal).
pub(crate) fn bulk_server_config(
    identity: &Identity,
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(err)?
        .with_no_client_auth()
        .with_single_cert(identity.chain.clone(), identity.key.clone_key())
        .map_err(err)?;
    tls.alpn_protocols = vec![cuda_lease::proto::BULK_ALPN.to_vec()];
    Ok(Arc::new(tls))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::pki_types::pem::PemObject;

    #[test]
    fn pem_round_trip() {
        let id = self_signed(&["localhost".into()]).unwrap();
        let pem = cert_pem(id.leaf());
        let back = CertificateDer::from_pem_slice(pem.as_bytes()).unwrap();
        assert_eq!(&back, id.leaf());
    }
}
