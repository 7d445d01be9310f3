//! How QUIC uses the network: [`TransportSettings`] (MTU, segmentation
//! offload, socket buffers, flow-control windows), with presets for loopback,
//! a datacenter network with jumbo frames and a WAN, and the UDP socket and
//! quinn endpoint built from them; [`BusyPoll`], an endpoint on a thread
//! of its own kept awake while requests are in flight.
//!
//! Both ends take the settings: the node's `cuda_lease_node::NodeConfig::transport`,
//! a client's [`ClientConfig::transport`](crate::ClientConfig::transport). Each
//! end's settings govern what it sends and how much it lets its peer send, so
//! mismatched settings still connect, at the speed of the more limited side.
//!
//! # Examples
//!
//! ```
//! use cuda_lease::TransportSettings;
//!
//! let lo = TransportSettings::loopback();
//! assert!(!lo.segmentation_offload);
//! lo.validate().unwrap();
//! // A preset by name, as the command-line programs' `--transport` takes it.
//! assert_eq!(TransportSettings::preset("loopback"), Some(lo));
//! ```

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use quinn::VarInt;
use socket2::{Domain, Protocol, Socket, Type};

mod busy;

#[cfg(feature = "backend")]
pub(crate) use busy::start_on;
pub use busy::{BusyPoll, InFlight};

/// Reads `recv`'s end if it has come, without waiting. quinn answers a
/// receive stream dropped before its end was read with a STOP_SENDING
/// frame to the peer and a wake-up of the connection's driver, though
/// every byte the peer sent was read: call this once a message has been
/// read to its declared length (its end usually comes with its last
/// bytes). Bytes past that length, if any, are dropped.
pub fn read_end_if_here(recv: &mut quinn::RecvStream) {
    let _ = futures::FutureExt::now_or_never(recv.read_chunk(usize::MAX, true));
}

/// The smallest UDP payload QUIC allows, and quinn's default initial MTU.
pub const MIN_MTU: u16 = 1200;

/// The largest [`TransportSettings::initial_mtu`] accepted (larger ones can
/// fail the handshake); start at this or lower and let MTU discovery raise it.
pub const MAX_INITIAL_MTU: u16 = 9000;

/// The largest UDP payload over IPv4 (65,535 less the IP and UDP headers),
/// the MTU discovery bound of [`TransportSettings::loopback`].
pub const MAX_UDP_PAYLOAD_V4: u16 = 65_507;

/// The largest MTU usable with segmentation offload on: quinn sends up to 10
/// datagrams at once and the kernel refuses a batch over 64 KiB, after which
/// quinn judges the path a black hole and falls back to 1,200 bytes.
pub const MAX_MTU_WITH_SEGMENTATION_OFFLOAD: u16 = MAX_UDP_PAYLOAD_V4 / 10;

/// How one end of a connection uses the network (see the module docs).
///
/// [`TransportSettings::default`] is quinn's defaults with the system's
/// socket buffers. The presets ([`loopback`], [`datacenter_jumbo`], [`wan`])
/// are starting points for their network; [`TransportSettings::validate`]
/// refuses combinations known to fail.
///
/// Memory: a connection may hold [`send_window`](Self::send_window) bytes of
/// unacknowledged writes plus
/// [`connection_receive_window`](Self::connection_receive_window) bytes sent
/// ahead of the reader; a node's worst case is that times its connections.
///
/// [`loopback`]: TransportSettings::loopback
/// [`datacenter_jumbo`]: TransportSettings::datacenter_jumbo
/// [`wan`]: TransportSettings::wan
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TransportSettings {
    /// The UDP payload size a connection starts with, in bytes
    /// ([`MIN_MTU`] to [`MAX_INITIAL_MTU`]). A path that cannot carry it
    /// loses packets until quinn falls back to [`MIN_MTU`].
    pub initial_mtu: u16,
    /// The largest UDP payload MTU discovery probes for, in bytes; `None` turns
    /// discovery off (the connection keeps [`initial_mtu`](Self::initial_mtu)).
    /// quinn's default is 1,452. It also bounds the largest payload this end
    /// accepts ([`largest_accepted_payload`](Self::largest_accepted_payload)).
    pub mtu_discovery_max: Option<u16>,
    /// UDP generic segmentation offload (several datagrams per send) where the
    /// kernel has it; needs an MTU of at most [`MAX_MTU_WITH_SEGMENTATION_OFFLOAD`].
    pub segmentation_offload: bool,
    /// The UDP socket's send buffer (`SO_SNDBUF`) in bytes, or `None` for the
    /// system's default; capped by the kernel at `net.core.wmem_max` (logged).
    pub socket_send_buffer: Option<usize>,
    /// The UDP socket's receive buffer (`SO_RCVBUF`) in bytes, or `None` for
    /// the system's default; capped by the kernel at `net.core.rmem_max` (logged).
    pub socket_receive_buffer: Option<usize>,
    /// Bytes the peer may send on one stream ahead of the reader, so at most
    /// this per stream per round trip (quinn's default: 1,250,000).
    pub stream_receive_window: u64,
    /// Bytes the peer may send on all streams of a connection ahead of the
    /// readers (quinn's default: 2^62 - 1, no limit beyond the streams').
    pub connection_receive_window: u64,
    /// Bytes of writes a connection keeps until they are acknowledged
    /// (quinn's default 10,000,000); writers wait past it.
    pub send_window: u64,
}

/// Settings that cannot work (see [`TransportSettings::validate`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("transport settings: {0}")]
pub struct TransportSettingsError(pub String);

/// The names [`TransportSettings::preset`] knows, in the order documented.
pub const PRESETS: [&str; 4] = ["default", "loopback", "datacenter", "wan"];

/// quinn's default stream receive window (100 Mbit/s for 100 ms).
const QUINN_STREAM_WINDOW: u64 = 1_250_000;

/// quinn's default largest UDP payload accepted from a peer.
const QUINN_MAX_UDP_PAYLOAD: u16 = 1472;

impl Default for TransportSettings {
    /// quinn's defaults with the system's socket buffers.
    fn default() -> Self {
        Self {
            initial_mtu: MIN_MTU,
            mtu_discovery_max: Some(1452),
            segmentation_offload: true,
            socket_send_buffer: None,
            socket_receive_buffer: None,
            stream_receive_window: QUINN_STREAM_WINDOW,
            connection_receive_window: VarInt::MAX.into_inner(),
            send_window: 8 * QUINN_STREAM_WINDOW,
        }
    }
}

impl TransportSettings {
    /// Both ends on one host (loopback, MTU 64 KiB): start at 9,000 bytes and
    /// let discovery reach the largest IPv4 UDP payload (65,507), offload off
    /// (it cannot carry such datagrams), 4 MiB socket buffers, and windows for
    /// a few GiB/s over half a millisecond that stay below the socket buffer
    /// (2 MiB per stream, 8 MiB per connection, 16 MiB unacknowledged); larger
    /// windows lose datagrams in the receiving socket under load. Large
    /// datagrams flow only towards an end with these settings too.
    pub fn loopback() -> Self {
        Self {
            initial_mtu: MAX_INITIAL_MTU,
            mtu_discovery_max: Some(MAX_UDP_PAYLOAD_V4),
            segmentation_offload: false,
            socket_send_buffer: Some(4 << 20),
            socket_receive_buffer: Some(4 << 20),
            stream_receive_window: 2 << 20,
            connection_receive_window: 8 << 20,
            send_window: 16 << 20,
        }
    }

    /// A datacenter network with jumbo frames (a 9,000-byte MTU) end to end:
    /// start at 1,200 bytes and let discovery find up to
    /// [`MAX_MTU_WITH_SEGMENTATION_OFFLOAD`] (a path without jumbo frames keeps
    /// what it carries) with offload on, and [`TransportSettings::loopback`]'s
    /// socket buffers and windows (25 Gbit/s over half a millisecond).
    pub fn datacenter_jumbo() -> Self {
        Self {
            initial_mtu: MIN_MTU,
            mtu_discovery_max: Some(MAX_MTU_WITH_SEGMENTATION_OFFLOAD),
            segmentation_offload: true,
            ..Self::loopback()
        }
    }

    /// A wide-area network: quinn's MTU defaults with offload, 4 MiB socket
    /// buffers for bursts, and windows for 1 Gbit/s over 100 ms.
    pub fn wan() -> Self {
        Self {
            socket_send_buffer: Some(4 << 20),
            socket_receive_buffer: Some(4 << 20),
            stream_receive_window: 16 << 20,
            connection_receive_window: 64 << 20,
            send_window: 64 << 20,
            ..Self::default()
        }
    }

    /// The preset named `name` (one of [`PRESETS`]), or `None`.
    pub fn preset(name: &str) -> Option<Self> {
        match name {
            "default" => Some(Self::default()),
            "loopback" => Some(Self::loopback()),
            "datacenter" => Some(Self::datacenter_jumbo()),
            "wan" => Some(Self::wan()),
            _ => None,
        }
    }

    /// Checks the settings against what is known to fail.
    ///
    /// # Errors
    ///
    /// An initial MTU outside [`MIN_MTU`]..=[`MAX_INITIAL_MTU`]; a
    /// discovery bound below the initial MTU or above 65,527; an MTU above
    /// [`MAX_MTU_WITH_SEGMENTATION_OFFLOAD`] with segmentation offload on;
    /// a window of 0 or above 2^62 - 1; a socket buffer of 0.
    pub fn validate(&self) -> Result<(), TransportSettingsError> {
        let fail = |m: String| Err(TransportSettingsError(m));
        if !(MIN_MTU..=MAX_INITIAL_MTU).contains(&self.initial_mtu) {
            return fail(format!(
                "initial MTU {} is outside {MIN_MTU}..={MAX_INITIAL_MTU} (start lower and let discovery raise it)",
                self.initial_mtu
            ));
        }
        let top = match self.mtu_discovery_max {
            Some(m) if m < self.initial_mtu => {
                return fail(format!(
                    "MTU discovery bound {m} is below the initial MTU {}",
                    self.initial_mtu
                ))
            }
            Some(m) if m > 65_527 => {
                return fail(format!("MTU discovery bound {m} is above 65527"))
            }
            Some(m) => m,
            None => self.initial_mtu,
        };
        if self.segmentation_offload && top > MAX_MTU_WITH_SEGMENTATION_OFFLOAD {
            return fail(format!(
                "an MTU of {top} needs segmentation offload off (at most {MAX_MTU_WITH_SEGMENTATION_OFFLOAD} with it on: \
                 larger send batches fail and the connection falls back to {MIN_MTU})"
            ));
        }
        for (name, w) in [
            ("stream receive window", self.stream_receive_window),
            ("connection receive window", self.connection_receive_window),
            ("send window", self.send_window),
        ] {
            if w == 0 || w > VarInt::MAX.into_inner() {
                return fail(format!("{name} {w} is outside 1..=2^62-1"));
            }
        }
        if self.socket_send_buffer == Some(0) || self.socket_receive_buffer == Some(0) {
            return fail("a socket buffer of 0 bytes".into());
        }
        Ok(())
    }

    /// quinn's transport configuration with these settings (the rest at
    /// quinn's defaults).
    ///
    /// # Errors
    ///
    /// [`TransportSettings::validate`]'s.
    pub fn quinn_config(&self) -> Result<quinn::TransportConfig, TransportSettingsError> {
        self.validate()?;
        let var = |v: u64| VarInt::from_u64(v).unwrap_or(VarInt::MAX);
        let mut t = quinn::TransportConfig::default();
        t.initial_mtu(self.initial_mtu)
            .mtu_discovery_config(self.mtu_discovery_max.map(|m| {
                let mut d = quinn::MtuDiscoveryConfig::default();
                d.upper_bound(m);
                d
            }))
            .enable_segmentation_offload(self.segmentation_offload)
            .stream_receive_window(var(self.stream_receive_window))
            .receive_window(var(self.connection_receive_window))
            .send_window(self.send_window);
        Ok(t)
    }

    /// A UDP socket bound to `addr` with these socket buffers (dual-stack
    /// where `addr` is IPv6).
    ///
    /// # Errors
    ///
    /// Socket errors (the address is taken, a buffer size refused).
    pub fn bind_udp(&self, addr: SocketAddr) -> io::Result<std::net::UdpSocket> {
        let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
        if addr.is_ipv6() {
            if let Err(e) = socket.set_only_v6(false) {
                tracing::debug!(%e, "the UDP socket stays IPv6 only");
            }
        }
        if let Some(n) = self.socket_send_buffer {
            socket.set_send_buffer_size(n)?;
            check_buffer("send", n, socket.send_buffer_size()?, "wmem_max");
        }
        if let Some(n) = self.socket_receive_buffer {
            socket.set_recv_buffer_size(n)?;
            check_buffer("receive", n, socket.recv_buffer_size()?, "rmem_max");
        }
        socket.bind(&addr.into())?;
        Ok(socket.into())
    }

    /// A quinn endpoint on a socket of [`TransportSettings::bind_udp`],
    /// serving `server` if given. Needs a tokio runtime.
    ///
    /// # Errors
    ///
    /// Socket errors, or no tokio runtime.
    pub fn endpoint(
        &self,
        addr: SocketAddr,
        server: Option<quinn::ServerConfig>,
    ) -> io::Result<quinn::Endpoint> {
        self.endpoint_on(addr, server, None)
    }

    /// [`TransportSettings::endpoint`] whose tasks, socket and timers live
    /// on `runtime`, or on the current tokio runtime with `None`.
    ///
    /// # Errors
    ///
    /// As [`TransportSettings::endpoint`].
    pub fn endpoint_on(
        &self,
        addr: SocketAddr,
        server: Option<quinn::ServerConfig>,
        runtime: Option<Arc<dyn quinn::Runtime>>,
    ) -> io::Result<quinn::Endpoint> {
        let socket = self.bind_udp(addr)?;
        let runtime = match runtime {
            Some(r) => r,
            None => quinn::default_runtime()
                .ok_or_else(|| io::Error::other("no async runtime found"))?,
        };
        let mut config = quinn::EndpointConfig::default();
        config
            .max_udp_payload_size(self.largest_accepted_payload())
            .map_err(io::Error::other)?;
        quinn::Endpoint::new(config, server, socket, runtime)
    }

    /// The largest UDP payload this end accepts, as it tells its peer (quinn's
    /// `max_udp_payload_size`): the largest MTU these settings may reach, at
    /// least quinn's default of 1,472. A peer sends no larger datagrams, so a
    /// large MTU needs these settings on both ends.
    pub fn largest_accepted_payload(&self) -> u16 {
        self.mtu_discovery_max
            .unwrap_or(self.initial_mtu)
            .max(self.initial_mtu)
            .max(QUINN_MAX_UDP_PAYLOAD)
    }
}

/// Logs a warning when the kernel granted a socket buffer smaller than
/// `asked` (Linux reports twice what it grants for its own bookkeeping).
fn check_buffer(which: &str, asked: usize, reported: usize, sysctl: &str) {
    let granted = if cfg!(target_os = "linux") {
        reported / 2
    } else {
        reported
    };
    if granted < asked {
        tracing::warn!(
            asked,
            granted,
            "the kernel capped the UDP {which} buffer; raise net.core.{sysctl} to allow more"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_is_valid_and_named() {
        for name in PRESETS {
            let s = TransportSettings::preset(name).expect(name);
            s.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
            s.quinn_config().unwrap();
        }
        assert_eq!(TransportSettings::preset("nope"), None);
        assert_eq!(
            TransportSettings::preset("datacenter"),
            Some(TransportSettings::datacenter_jumbo())
        );
    }

    #[test]
    fn known_failures_are_refused() {
        let lo = TransportSettings::loopback();
        let gso_big_mtu = TransportSettings {
            segmentation_offload: true,
            ..lo.clone()
        };
        let e = gso_big_mtu.validate().unwrap_err();
        assert!(e.0.contains("segmentation offload off"), "{e}");
        let gso_ok = TransportSettings {
            mtu_discovery_max: Some(MAX_MTU_WITH_SEGMENTATION_OFFLOAD),
            initial_mtu: 1200,
            segmentation_offload: true,
            ..lo.clone()
        };
        gso_ok.validate().unwrap();
        let huge_initial = TransportSettings {
            initial_mtu: 12_000,
            ..lo.clone()
        };
        assert!(huge_initial.validate().is_err());
        let bound_below = TransportSettings {
            mtu_discovery_max: Some(1300),
            initial_mtu: 1400,
            ..TransportSettings::default()
        };
        assert!(bound_below.validate().is_err());
        let no_discovery = TransportSettings {
            mtu_discovery_max: None,
            ..lo.clone()
        };
        no_discovery.validate().unwrap();
        let zero_window = TransportSettings {
            stream_receive_window: 0,
            ..lo
        };
        assert!(zero_window.validate().is_err());
    }
}
