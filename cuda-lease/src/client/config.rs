//! How a client reaches and trusts a node: [`ClientConfig`] (roots, server
//! name, token or client certificate, frame limits, striping, transport
//! settings).

use super::error::config_error;
use std::path::Path;

use rustls::pki_types::CertificateDer;

use super::Error;
use crate::proto::Limits;
use crate::tls::{self, Identity};
use crate::transport::TransportSettings;

/// How to reach and trust a node.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Certificates trusted for the node (pin the node's own certificate).
    pub roots: Vec<CertificateDer<'static>>,
    /// When set, the node's certificate is trusted if and only if its
    /// SHA-256 (DER) is this, whatever `roots` and `server_name` say (see
    /// [`ClientConfig::pin_sha256`]).
    pub cert_sha256: Option<[u8; 32]>,
    /// Name the node's certificate is checked against.
    pub server_name: String,
    /// Bearer token sent in HELLO.
    pub token: Option<String>,
    /// Client certificate for mutual TLS.
    pub identity: Option<Identity>,
    /// Frame limits for replies.
    pub limits: Limits,
    /// Name sent in HELLO (for the node's logs).
    pub client_name: String,
    /// Connections a large MEM_WRITE or MEM_READ is striped over (at least
    /// 1; see [`ClientConfig::stripes`]).
    pub stripes: usize,
    /// The smallest transfer that is striped.
    pub stripe_min_bytes: usize,
    /// The smallest write or read of a `cuda-async` submission that leaves
    /// its message for the data path (streamed, striped MEM_WRITE and
    /// MEM_READ; see [`ClientConfig::data_path_min_bytes`]).
    pub data_path_min_bytes: usize,
    /// How long connecting (QUIC handshake and HELLO) may take before it
    /// fails as [`Disconnect::ConnectTimeout`](crate::client::Disconnect::ConnectTimeout)
    /// ([`DEFAULT_CONNECT_TIMEOUT`]).
    pub connect_timeout: std::time::Duration,
    /// How the client's QUIC endpoint uses the network (MTU, segmentation
    /// offload, socket buffers, windows); default: quinn's defaults.
    pub transport: TransportSettings,
    /// Which transfers of at least [`ClientConfig::data_path_min_bytes`]
    /// take the node's bulk-data channel (TLS over TCP) when the node has
    /// one; default [`BulkUse::Large`]. See [`ClientConfig::bulk`].
    pub bulk: BulkUse,
    /// Ask each lease's node to have the lease's worker serve its BATCHes
    /// over a QUIC connection of their own (LEASE_DIRECT), off the node's
    /// path; default on. A node that does not (run with
    /// `--direct-leases=false`) serves them itself; a worker this client
    /// cannot reach (a firewall in between) costs one wait of at most
    /// [`DIRECT_CONNECT_TIMEOUT`](crate::client::DIRECT_CONNECT_TIMEOUT),
    /// after which the client's leases take the node's path. See
    /// [`Lease::is_direct`].
    ///
    /// [`Lease::is_direct`]: crate::client::Lease::is_direct
    pub direct: bool,
    /// Run the client's endpoint on a thread of its own that keeps
    /// polling the network while a request is in flight, for at most this
    /// long after the latest request began; default `None` (off: the
    /// endpoint runs on the caller's runtime). See
    /// [`ClientConfig::busy_poll`].
    pub busy_poll: Option<std::time::Duration>,
}

/// Which large transfers a client moves over a node's bulk-data channel
/// (TLS over TCP) instead of QUIC ([`ClientConfig::bulk`]). The channel
/// moves one large transfer faster than striped QUIC; QUIC gives each of
/// many tasks' mid-size transfers a stream of its own, where the channel's
/// transfers at once share at most the client's stripe count or 8
/// connections and wait for one beyond that.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BulkUse {
    /// None: every transfer over QUIC.
    Off,
    /// Uploads (MEM_WRITE) only; every download over QUIC.
    Uploads,
    /// Uploads, and downloads large enough to be striped (at least
    /// [`ClientConfig::stripe_min_bytes`]); smaller downloads over QUIC.
    #[default]
    Large,
    /// Uploads and downloads.
    All,
}

impl BulkUse {
    /// Whether an upload takes the channel.
    pub fn uploads(self) -> bool {
        self != BulkUse::Off
    }

    /// Whether a download of `len` bytes takes the channel, downloads of
    /// at least `striped` bytes being striped.
    pub fn downloads(self, len: usize, striped: usize) -> bool {
        match self {
            BulkUse::Off | BulkUse::Uploads => false,
            BulkUse::Large => len >= striped,
            BulkUse::All => true,
        }
    }
}

/// Default [`ClientConfig::stripes`]: four connections move several times
/// what one moves where both ends have cores to spare, and lose little
/// where they do not.
pub const DEFAULT_STRIPES: usize = 4;

/// Default [`ClientConfig::stripe_min_bytes`]: 8 MiB (smaller transfers
/// take one round trip on one connection).
pub const DEFAULT_STRIPE_MIN_BYTES: usize = 8 << 20;

/// Default [`ClientConfig::data_path_min_bytes`]: 1 MiB.
pub const DEFAULT_DATA_PATH_MIN_BYTES: usize = 1 << 20;

/// Default [`ClientConfig::connect_timeout`]: 5 s.
pub const DEFAULT_CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

impl ClientConfig {
    /// Trusts exactly `cert` (the node's certificate), checked as `localhost`.
    pub fn pinned(cert: CertificateDer<'static>) -> Self {
        Self {
            roots: vec![cert],
            cert_sha256: None,
            server_name: "localhost".into(),
            token: None,
            identity: None,
            limits: Limits {
                max_body: 16 << 20,
                max_data: u32::MAX,
            },
            client_name: "cuda-lease-client".into(),
            stripes: DEFAULT_STRIPES,
            stripe_min_bytes: DEFAULT_STRIPE_MIN_BYTES,
            data_path_min_bytes: DEFAULT_DATA_PATH_MIN_BYTES,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            transport: TransportSettings::default(),
            bulk: BulkUse::Large,
            direct: true,
            busy_poll: None,
        }
    }

    /// Trusts the certificates of a PEM file (the file `cuda-lease-node --dev` writes, or a CA).
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Config`](crate::client::ErrorKind::Config) when the file cannot be read.
    pub fn from_pem_file(path: &Path) -> Result<Self, Error> {
        let mut certs = tls::load_certs(path).map_err(config_error)?;
        let mut c = Self::pinned(certs.remove(0));
        c.roots.extend(certs);
        Ok(c)
    }

    /// Trusts exactly the certificate whose SHA-256 (over its DER) is
    /// `sha256`, instead of the roots and server name: a pin by
    /// fingerprint (`cuda_lease_fleet::fingerprint` writes one), for a
    /// node whose certificate the client has not seen but whose
    /// fingerprint it got from a source it trusts.
    ///
    /// ```
    /// use cuda_lease::client::ClientConfig;
    /// let config = ClientConfig::pinned_sha256([0x5a; 32]).token("secret");
    /// assert_eq!(config.cert_sha256, Some([0x5a; 32]));
    /// ```
    pub fn pin_sha256(mut self, sha256: [u8; 32]) -> Self {
        self.cert_sha256 = Some(sha256);
        self
    }

    /// A configuration that trusts exactly the certificate whose SHA-256
    /// is `sha256` ([`ClientConfig::pin_sha256`]), with the defaults of
    /// [`ClientConfig::pinned`] otherwise.
    pub fn pinned_sha256(sha256: [u8; 32]) -> Self {
        let mut c = Self::pinned(CertificateDer::from(Vec::new()));
        c.roots.clear();
        c.pin_sha256(sha256)
    }

    /// What the TLS set-up trusts.
    pub(crate) fn trust(&self) -> tls::ServerTrust<'_> {
        tls::ServerTrust {
            roots: &self.roots,
            sha256: self.cert_sha256,
        }
    }

    /// Sets how long connecting may take.
    pub fn connect_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Sets how the client's QUIC endpoint uses the network.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn demo(cfg: cuda_lease::ClientConfig) {
    /// // The node is on the same host.
    /// let cfg = cfg.transport(cuda_lease::TransportSettings::loopback());
    /// # }
    /// ```
    pub fn transport(mut self, settings: TransportSettings) -> Self {
        self.transport = settings;
        self
    }

    /// Chooses which large transfers take the node's bulk-data channel.
    /// By default ([`BulkUse::Large`]) large MEM_WRITEs (every upload of
    /// a submission's data path, and
    /// [`Session::write`](crate::client::Session::write) of at least
    /// [`ClientConfig::data_path_min_bytes`]) and the MEM_READs large
    /// enough to be striped go over TLS on TCP to the node's bulk port,
    /// striped over [`ClientConfig::stripes`] connections, while every
    /// other message stays on QUIC. The
    /// connections are opened on first use with single-use tickets the
    /// node gives over the authenticated QUIC connection, and kept for
    /// later transfers. A node without the channel moves everything over
    /// QUIC. A firewall must let TCP through to the node's bulk port (by
    /// default the QUIC port's number).
    ///
    /// # Examples
    ///
    /// ```
    /// # fn demo(cfg: cuda_lease::ClientConfig) {
    /// use cuda_lease::client::BulkUse;
    /// let cfg = cfg.bulk(BulkUse::Off); // everything over QUIC
    /// # }
    /// ```
    pub fn bulk(mut self, use_: BulkUse) -> Self {
        self.bulk = use_;
        self
    }

    /// Sets the bearer token.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Sets [`ClientConfig::direct`]: leases' BATCHes go to their workers.
    pub fn direct(mut self, direct: bool) -> Self {
        self.direct = direct;
        self
    }

    /// Sets [`ClientConfig::busy_poll`]: the client's QUIC endpoint runs
    /// on a thread of its own (`cuda-lease-io`), which keeps polling the
    /// network while a request is in flight, for at most `limit` after
    /// the latest request began. `None` or zero turns it off (the
    /// endpoint runs on the caller's tokio runtime).
    ///
    /// A runtime whose threads sleep between requests must wake one to
    /// send a request and one to take its reply; on a virtual machine each
    /// wake-up costs several microseconds. The endpoint's thread, kept
    /// awake, takes both at once. It costs a thread for each client that
    /// has it on, busy while requests are in flight (and up to `limit` for
    /// one that takes longer); a lease's requests count on its client. Use
    /// it where a request's latency matters more than a core, with a
    /// `limit` around the replies you wait for (a long kernel's reply
    /// gains nothing from it). With it on, a client can be used from any
    /// runtime, and outlives the runtime it connected on. The same
    /// poller serves any quinn endpoint:
    /// [`BusyPoll`](crate::transport::BusyPoll).
    ///
    /// ```
    /// use std::time::Duration;
    /// use cuda_lease::client::ClientConfig;
    /// let config = ClientConfig::pinned_sha256([0x5a; 32])
    ///     .busy_poll(Some(Duration::from_millis(2)));
    /// assert_eq!(config.busy_poll, Some(Duration::from_millis(2)));
    /// ```
    pub fn busy_poll(mut self, limit: Option<std::time::Duration>) -> Self {
        self.busy_poll = limit;
        self
    }

    /// Sets the name checked against the node's certificate.
    pub fn server_name(mut self, name: impl Into<String>) -> Self {
        self.server_name = name.into();
        self
    }

    /// Stripes MEM_WRITE and MEM_READ of at least `min_bytes` over `n`
    /// connections (`n` of 1 turns striping off). One QUIC connection is
    /// CPU-bound; several move data
    /// in parallel where the client and the node have cores to spare. The
    /// extra connections are opened (and authenticated) on the first
    /// striped transfer.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn demo(cfg: cuda_lease::ClientConfig) {
    /// let cfg = cfg.stripes(8, 16 << 20); // 8 connections from 16 MiB up
    /// let single = cfg.clone().stripes(1, 0); // never stripe
    /// # }
    /// ```
    pub fn stripes(mut self, n: usize, min_bytes: usize) -> Self {
        self.stripes = n.max(1);
        self.stripe_min_bytes = min_bytes;
        self
    }

    /// Sends the writes and reads of at least `min_bytes` of a `cuda-async`
    /// submission on a lease (`h2d`, `d2h`...) on the data path, as
    /// streamed MEM_WRITEs and MEM_READs (striped from
    /// [`ClientConfig::stripes`]' size up), instead of inside the
    /// submission's message; `usize::MAX` keeps every byte in the message.
    /// A submission with such a transfer takes up to three round trips
    /// (its allocations, its data, its commands) instead of one, and the
    /// lease's later submissions wait for it to end; its data moves at the
    /// transport's speed instead of crossing the node whole.
    ///
    /// # Examples
    ///
    /// ```
    /// # fn demo(cfg: cuda_lease::ClientConfig) {
    /// let cfg = cfg.data_path_min_bytes(4 << 20); // from 4 MiB up
    /// let in_message = cfg.clone().data_path_min_bytes(usize::MAX); // never
    /// # }
    /// ```
    pub fn data_path_min_bytes(mut self, min_bytes: usize) -> Self {
        self.data_path_min_bytes = min_bytes;
        self
    }
}
