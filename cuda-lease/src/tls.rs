//! TLS 1.3 set-up of the client (rustls with the `ring` provider), the
//! identity type both ends use, and PEM files.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{client::WantsClientCert, ConfigBuilder};

use crate::proto::ALPN;
use crate::transport::TransportSettings;

/// A TLS set-up failure.
#[derive(Debug, thiserror::Error)]
#[error("tls: {0}")]
pub struct TlsError(pub String);

fn err(e: impl std::fmt::Display) -> TlsError {
    TlsError(e.to_string())
}

/// A certificate chain and its private key.
#[derive(Debug)]
pub struct Identity {
    /// Certificate chain, leaf first.
    pub chain: Vec<CertificateDer<'static>>,
    /// Private key.
    pub key: PrivateKeyDer<'static>,
}

impl Clone for Identity {
    fn clone(&self) -> Self {
        Self {
            chain: self.chain.clone(),
            key: self.key.clone_key(),
        }
    }
}

impl Identity {
    /// Loads a PEM certificate chain and a PEM private key.
    ///
    /// # Errors
    ///
    /// When a file cannot be read or holds no certificate or key.
    pub fn from_pem_files(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        let chain = load_certs(cert)?;
        let key = PrivateKeyDer::from_pem_file(key)
            .map_err(|e| err(format!("{}: {e}", key.display())))?;
        Ok(Self { chain, key })
    }

    /// The leaf certificate.
    pub fn leaf(&self) -> &CertificateDer<'static> {
        &self.chain[0]
    }
}

/// Loads every certificate of a PEM file.
///
/// # Errors
///
/// When the file cannot be read or holds no certificate.
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| err(format!("{}: {e}", path.display())))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(format!("{}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(err(format!("{}: no certificate", path.display())));
    }
    Ok(certs)
}

/// Writes a certificate as PEM (what clients pin).
///
/// # Errors
///
/// I/O errors.
pub fn write_cert_pem(path: &Path, cert: &CertificateDer<'_>) -> std::io::Result<()> {
    std::fs::write(path, cert_pem(cert))
}

/// Encodes a certificate as PEM text.
pub fn cert_pem(cert: &CertificateDer<'_>) -> String {
    const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut b64 = String::new();
    for chunk in cert.as_ref().chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |acc, (i, b)| acc | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..4 {
            if i <= chunk.len() {
                b64.push(B64[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                b64.push('=');
            }
        }
    }
    let mut out = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).unwrap_or_default());
        out.push('\n');
    }
    out.push_str("-----END CERTIFICATE-----\n");
    out
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Which node certificates a client accepts: one signed by (or equal to)
/// one of `roots` for the server name, or, when `sha256` is given, exactly
/// the certificate with that SHA-256 (DER), whatever its names.
#[derive(Debug, Clone, Copy)]
pub struct ServerTrust<'a> {
    /// Certificates (or their issuers) to accept.
    pub roots: &'a [CertificateDer<'static>],
    /// The one certificate to accept, by the SHA-256 of its DER.
    pub sha256: Option<[u8; 32]>,
}

impl ServerTrust<'_> {
    fn builder(self) -> Result<ConfigBuilder<rustls::ClientConfig, WantsClientCert>, TlsError> {
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(err)?;
        if let Some(want) = self.sha256 {
            return Ok(builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(Sha256Pin {
                    want,
                    algs: provider().signature_verification_algorithms,
                })));
        }
        let mut store = rustls::RootCertStore::empty();
        for c in self.roots {
            store.add(c.clone()).map_err(err)?;
        }
        Ok(builder.with_root_certificates(store))
    }
}

/// Accepts exactly the certificate whose SHA-256 is `want` (a fingerprint pin,
/// as a fleet's registry gives) and checks the handshake's signature with it.
#[derive(Debug)]
struct Sha256Pin {
    want: [u8; 32],
    algs: rustls::crypto::WebPkiSupportedAlgorithms,
}

impl rustls::client::danger::ServerCertVerifier for Sha256Pin {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let got = ring::digest::digest(&ring::digest::SHA256, end_entity.as_ref());
        if got.as_ref() == self.want {
            Ok(rustls::client::danger::ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::ApplicationVerificationFailure,
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algs)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algs)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.algs.supported_schemes()
    }
}

/// The QUIC client configuration: trusts what `trust` says (pin the node's
/// certificate by passing just it as the roots, or by its SHA-256),
/// presents `identity` for mutual TLS, and uses `transport`'s settings.
pub fn client_config(
    trust: ServerTrust<'_>,
    identity: Option<&Identity>,
    transport: &TransportSettings,
) -> Result<quinn::ClientConfig, TlsError> {
    let builder = trust.builder()?;
    let mut tls = match identity {
        Some(id) => builder
            .with_client_auth_cert(id.chain.clone(), id.key.clone_key())
            .map_err(err)?,
        None => builder.with_no_client_auth(),
    };
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(err)?;
    let mut cfg = quinn::ClientConfig::new(Arc::new(crypto));
    let mut transport = transport.quinn_config().map_err(err)?;
    transport
        .keep_alive_interval(Some(Duration::from_secs(5)))
        .max_idle_timeout(Some(Duration::from_secs(60).try_into().map_err(err)?));
    cfg.transport_config(Arc::new(transport));
    Ok(cfg)
}

/// The bulk-data channel's TLS config: trusts what the QUIC connection trusts.
pub(crate) fn bulk_client_config(
    trust: ServerTrust<'_>,
) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let mut tls = trust.builder()?.with_no_client_auth();
    tls.alpn_protocols = vec![crate::proto::BULK_ALPN.to_vec()];
    Ok(Arc::new(tls))
}
