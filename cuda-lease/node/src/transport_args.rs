//! The command-line programs' transport flags ([`TransportArgs`]): a
//! preset, then overrides of its fields.

use cuda_lease::transport::{TransportSettings, TransportSettingsError};

/// A preset of [`TransportSettings`] by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum TransportPreset {
    /// quinn's defaults ([`TransportSettings::default`]).
    #[default]
    Default,
    /// Both ends on one host ([`TransportSettings::loopback`]).
    Loopback,
    /// Jumbo frames end to end ([`TransportSettings::datacenter_jumbo`]).
    Datacenter,
    /// A wide-area network ([`TransportSettings::wan`]).
    Wan,
}

impl TransportPreset {
    /// The preset's settings.
    pub fn settings(self) -> TransportSettings {
        match self {
            Self::Default => TransportSettings::default(),
            Self::Loopback => TransportSettings::loopback(),
            Self::Datacenter => TransportSettings::datacenter_jumbo(),
            Self::Wan => TransportSettings::wan(),
        }
    }
}

/// On or off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Switch {
    /// On.
    On,
    /// Off.
    Off,
}

/// An MTU discovery bound: bytes, or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiscoveryBound(pub Option<u16>);

fn discovery_bound(s: &str) -> Result<DiscoveryBound, String> {
    match s {
        "off" => Ok(DiscoveryBound(None)),
        n => n
            .parse()
            .map(|n| DiscoveryBound(Some(n)))
            .map_err(|e| format!("`{n}`: {e} (bytes, or `off`)")),
    }
}

/// The transport flags both programs take (flatten into a clap parser).
///
/// # Examples
///
/// ```
/// use clap::Parser;
/// use cuda_lease_node::transport_args::TransportArgs;
///
/// #[derive(Parser)]
/// struct Args {
///     #[command(flatten)]
///     transport: TransportArgs,
/// }
///
/// let a = Args::parse_from(["prog", "--transport", "loopback", "--mtu-max", "16384"]);
/// let s = a.transport.settings().unwrap();
/// assert_eq!(s.mtu_discovery_max, Some(16384));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct TransportArgs {
    /// Transport settings to start from: `default` (quinn's), `loopback`
    /// (both ends on one host), `datacenter` (jumbo frames) or
    /// `wan`; the flags below override single settings.
    #[arg(long, value_enum, default_value_t = TransportPreset::Default, env = "CUDA_LEASE_TRANSPORT")]
    pub transport: TransportPreset,
    /// Initial MTU (UDP payload bytes, 1200 to 9000).
    #[arg(long, env = "CUDA_LEASE_MTU")]
    pub mtu: Option<u16>,
    /// Largest MTU that discovery probes for (UDP payload bytes), or `off`.
    #[arg(long, value_parser = discovery_bound, env = "CUDA_LEASE_MTU_MAX")]
    pub mtu_max: Option<DiscoveryBound>,
    /// UDP segmentation offload (`on` needs an MTU of at most 6550).
    #[arg(long, value_enum, env = "CUDA_LEASE_GSO")]
    pub gso: Option<Switch>,
    /// UDP socket send and receive buffers, in bytes.
    #[arg(long, env = "CUDA_LEASE_SOCKET_BUFFER_BYTES")]
    pub socket_buffer_bytes: Option<usize>,
    /// Bytes a peer may send on one stream ahead of the reader.
    #[arg(long, env = "CUDA_LEASE_STREAM_WINDOW_BYTES")]
    pub stream_window_bytes: Option<u64>,
    /// Bytes a peer may send on one connection ahead of the readers.
    #[arg(long, env = "CUDA_LEASE_CONN_WINDOW_BYTES")]
    pub conn_window_bytes: Option<u64>,
    /// Bytes of writes kept until acknowledged, per connection.
    #[arg(long, env = "CUDA_LEASE_SEND_WINDOW_BYTES")]
    pub send_window_bytes: Option<u64>,
}

impl TransportArgs {
    /// The preset with the overrides applied, validated.
    ///
    /// # Errors
    /// [`TransportSettings::validate`]'s.
    pub fn settings(&self) -> Result<TransportSettings, TransportSettingsError> {
        let mut s = self.transport.settings();
        if let Some(m) = self.mtu {
            s.initial_mtu = m;
        }
        if let Some(DiscoveryBound(m)) = self.mtu_max {
            s.mtu_discovery_max = m;
        }
        if let Some(g) = self.gso {
            s.segmentation_offload = g == Switch::On;
        }
        if let Some(n) = self.socket_buffer_bytes {
            s.socket_send_buffer = Some(n);
            s.socket_receive_buffer = Some(n);
        }
        if let Some(n) = self.stream_window_bytes {
            s.stream_receive_window = n;
        }
        if let Some(n) = self.conn_window_bytes {
            s.connection_receive_window = n;
        }
        if let Some(n) = self.send_window_bytes {
            s.send_window = n;
        }
        s.validate()?;
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Args {
        #[command(flatten)]
        transport: TransportArgs,
    }

    /// The settings of `args`, flags separated by spaces.
    fn parse(args: &str) -> Result<TransportSettings, String> {
        let a = Args::try_parse_from(std::iter::once("prog").chain(args.split_whitespace()))
            .map_err(|e| e.to_string())?;
        a.transport.settings().map_err(|e| e.to_string())
    }

    #[test]
    fn no_flags_are_the_defaults() {
        assert_eq!(parse("").unwrap(), TransportSettings::default());
    }

    #[test]
    fn every_preset_parses_to_its_settings() {
        for (name, want) in [
            ("default", TransportSettings::default()),
            ("loopback", TransportSettings::loopback()),
            ("datacenter", TransportSettings::datacenter_jumbo()),
            ("wan", TransportSettings::wan()),
        ] {
            assert_eq!(
                parse(&format!("--transport {name}")).unwrap(),
                want,
                "{name}"
            );
            assert_eq!(TransportSettings::preset(name), Some(want));
        }
        assert!(parse("--transport fast").is_err());
    }

    #[test]
    fn overrides_apply_over_the_preset() {
        let s = parse(
            "--transport loopback --mtu 4000 --mtu-max off --gso on --socket-buffer-bytes 1048576 \
             --stream-window-bytes 1000 --conn-window-bytes 2000 --send-window-bytes 3000",
        )
        .unwrap();
        assert_eq!(
            s,
            TransportSettings {
                initial_mtu: 4000,
                mtu_discovery_max: None,
                segmentation_offload: true,
                socket_send_buffer: Some(1 << 20),
                socket_receive_buffer: Some(1 << 20),
                stream_receive_window: 1000,
                connection_receive_window: 2000,
                send_window: 3000,
            }
        );
        let s = parse("--mtu-max 6000 --gso off").unwrap();
        assert_eq!(s.mtu_discovery_max, Some(6000));
        assert!(!s.segmentation_offload);
    }

    #[test]
    fn impossible_combinations_are_refused() {
        // The loopback preset's 65,507-byte bound with offload on.
        let e = parse("--transport loopback --gso on").unwrap_err();
        assert!(e.contains("segmentation offload off"), "{e}");
        assert!(parse("--mtu 12000").is_err());
        assert!(parse("--mtu-max big").is_err());
        assert!(parse("--gso maybe").is_err());
    }
}
