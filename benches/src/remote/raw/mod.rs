//! The transports' own ceilings, with no protocol on top, so every remote
//! measurement can be stated as a ratio to what the host's network stack
//! does in the same run:
//!
//! - [`RawQuinn`]: raw quinn with exactly the node's TLS and, by default,
//!   its transport settings ([`RawQuinn::start_with`] takes others, e.g.
//!   [`TransportSettings::loopback`](cuda_lease::TransportSettings::loopback)).
//!   An echo-style server on 127.0.0.1:0 and `n` client connections to it.
//!   Requests are a bidirectional stream each (as the node's are): an
//!   8-byte little-endian count of bytes wanted back, then any payload; the
//!   server reads the stream to its end, then writes the wanted number of
//!   bytes and finishes. [`RawQuinn::start_relayed`]'s server first sends
//!   the whole request through a child process (`cat`, on pipes) and reads
//!   it back: the cost of crossing a process boundary both ways, as a
//!   lease's requests cross to its worker process and its replies back.
//! - [`RawTcp`]: one plain TCP connection (`tokio::net`, no TLS) to an
//!   echo-style server on 127.0.0.1:0, the host's reference for bulk
//!   bytes. A request is a 16-byte header (the bytes that follow and the
//!   bytes wanted back, little-endian), then its payload; the reply is the
//!   wanted bytes.
//!
//! # Examples
//!
//! ```no_run
//! # async fn demo() -> Result<(), benches::remote::raw::BoxError> {
//! let raw = benches::remote::raw::RawQuinn::start(1).await?;
//! let rtt = raw.round_trip(64).await?; // 64 B out, 64 B back, a new stream
//! let up = raw.send(256 << 20, 1).await?; // 256 MiB client -> server
//! println!("{rtt:?}, {:.2} GiB/s", (256u64 << 20) as f64 / up.as_secs_f64() / (1u64 << 30) as f64);
//! let tcp = benches::remote::raw::RawTcp::start().await?;
//! let down = tcp.receive(256 << 20).await?; // 256 MiB server -> client
//! # Ok(()) }
//! ```

pub mod legs;
mod quic;
mod tcp;

pub use quic::RawQuinn;
pub use tcp::RawTcp;

/// The error of the baselines' calls (TLS, socket and connection errors).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A chunk of bulk data written or read per call.
const CHUNK: usize = 1 << 20;

/// The runtime the raw servers start on (see [`serve_on`]).
static SERVERS: std::sync::Mutex<Option<tokio::runtime::Handle>> = std::sync::Mutex::new(None);

/// Starts the raw servers made from now on on `servers` (as the bench runs
/// its lease node on a runtime of its own, as a node process has), or,
/// with `None`, on the runtime of the caller of `start` (the default).
pub fn serve_on(servers: Option<tokio::runtime::Handle>) {
    *SERVERS.lock().unwrap_or_else(|e| e.into_inner()) = servers;
}

/// The runtime [`serve_on`] names, if any.
fn servers() -> Option<tokio::runtime::Handle> {
    SERVERS.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// How the raw quinn references poll (see [`busy_poll`]).
static BUSY: std::sync::Mutex<Option<Awake>> = std::sync::Mutex::new(None);

/// Raw quinn kept awake as a lease's ends are (see [`busy_poll`]).
#[derive(Clone, Copy, Debug)]
struct Awake {
    /// The client's `BusyPoll` limit.
    client: std::time::Duration,
    /// How long the server keeps polling after each request.
    server_spin: std::time::Duration,
}

/// Gives the raw quinn clients made from now on a
/// [`BusyPoll`](cuda_lease::transport::BusyPoll) of up to `client`, as a
/// lease's client has with `ClientConfig::busy_poll`: their endpoint on a
/// thread of its own, kept awake while a request is in flight, and each
/// reply read there. Their servers' endpoint and tasks then run on a
/// thread of their own too, which keeps polling while a request is in
/// flight and for `server_spin` after each one, as a lease's worker polls
/// for its spin budget after each message (zero: it sleeps between
/// requests). `None` (the default): on the callers' runtimes.
pub fn busy_poll(client: Option<std::time::Duration>, server_spin: std::time::Duration) {
    *BUSY.lock().unwrap_or_else(|e| e.into_inner()) = client.map(|client| Awake {
        client,
        server_spin,
    });
}

/// What [`busy_poll`] set, if anything.
fn busy() -> Option<Awake> {
    *BUSY.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use cuda_lease::TransportSettings;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn raw_tcp_moves_what_it_says() {
        let tcp = RawTcp::start().await.unwrap();
        tcp.round_trip(64).await.unwrap();
        tcp.send((3 << 20) + 5).await.unwrap();
        tcp.receive((3 << 20) + 7).await.unwrap();
        tcp.round_trip(0).await.unwrap();
        tcp.close().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn raw_quinn_runs_with_each_preset() {
        for t in [
            TransportSettings::default(),
            TransportSettings::loopback(),
            TransportSettings::datacenter_jumbo(),
        ] {
            let q = RawQuinn::start_with(2, &t).await.unwrap();
            q.round_trip(64).await.unwrap();
            q.send((2 << 20) + 1, 2).await.unwrap();
            q.receive((2 << 20) + 3, 1).await.unwrap();
            q.close().await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_raw_exchange_stamps_every_leg() {
        use legs::Leg;
        let q = RawQuinn::start(1).await.unwrap();
        legs::set_enabled(true);
        legs::clear();
        legs::stamp(Leg::Start);
        let r = q.round_trip(64).await;
        legs::stamp(Leg::End);
        let at = legs::take();
        legs::set_enabled(false);
        r.unwrap();
        for leg in Leg::ALL {
            assert_ne!(at[leg as usize], 0, "{} was not stamped", leg.name());
        }
        q.close().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn raw_quinn_relayed_through_a_child_moves_what_it_says() {
        let q = RawQuinn::start_relayed(1, &TransportSettings::default())
            .await
            .unwrap();
        for (out, back) in [(64, 64), (2320, 1060), ((1 << 20) + 9, 3)] {
            q.request_reply(out, back).await.unwrap();
        }
        q.close().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn raw_quinn_with_a_busy_polling_client_moves_what_it_says() {
        busy_poll(
            Some(std::time::Duration::from_millis(2)),
            std::time::Duration::from_millis(1),
        );
        let q = RawQuinn::start(2).await;
        busy_poll(None, std::time::Duration::ZERO);
        let q = q.unwrap();
        assert!(q.busy_polls(), "the client did not take the busy poller");
        q.round_trip(64).await.unwrap();
        q.request_reply(2320, 1060).await.unwrap();
        q.send((2 << 20) + 1, 2).await.unwrap();
        q.receive((2 << 20) + 3, 1).await.unwrap();
        q.close().await;
    }
}
