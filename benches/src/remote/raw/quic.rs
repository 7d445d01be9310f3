//! [`RawQuinn`]: raw quinn, an echo-style server and its connections.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Mutex;

use super::legs::{self, Leg};
use super::{BoxError, CHUNK};
use cuda_lease::tls::{client_config, ServerTrust};
use cuda_lease::transport::BusyPoll;
use cuda_lease::TransportSettings;
use cuda_lease_node::tls::{self_signed, server_config};

/// A raw quinn server and `n` connections to it (see the module docs).
#[derive(Debug)]
pub struct RawQuinn {
    server: quinn::Endpoint,
    client: quinn::Endpoint,
    conns: Vec<quinn::Connection>,
    task: tokio::task::JoinHandle<()>,
    /// The client endpoint's busy poller ([`super::busy_poll`]), or off.
    busy: BusyPoll,
}

impl Drop for RawQuinn {
    fn drop(&mut self) {
        // The accept loop holds the server's poller: its thread ends once
        // the loop and the requests' tasks are gone.
        self.task.abort();
    }
}

/// A raw server kept awake as a lease's worker is ([`super::busy_poll`]):
/// its poller, and how long it keeps polling after each request.
type Awake = Option<(Arc<BusyPoll>, Duration)>;

/// A child process the server relays each request through: the request
/// (its 8-byte count and payload) down the child's stdin and the same
/// bytes back from its stdout (`cat`: an echo that only crosses the
/// process boundary both ways, as a lease's commands cross to its worker
/// and its replies back), before the server replies.
#[derive(Debug)]
struct Relay {
    /// Killed when the relay is dropped (`kill_on_drop`).
    _child: tokio::process::Child,
    pipes: Mutex<(tokio::process::ChildStdin, tokio::process::ChildStdout)>,
}

impl Relay {
    fn start() -> Result<Relay, BoxError> {
        let mut child = tokio::process::Command::new("cat")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("starting `cat` for the relay: {e}"))?;
        let stdin = child.stdin.take().ok_or("no stdin")?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        Ok(Relay {
            _child: child,
            pipes: Mutex::new((stdin, stdout)),
        })
    }

    /// `msg` to the child and back (written and read at once: a message
    /// larger than the pipes would block otherwise).
    async fn echo(&self, msg: &[u8]) -> Result<Vec<u8>, BoxError> {
        let mut pipes = self.pipes.lock().await;
        let (stdin, stdout) = &mut *pipes;
        let mut back = vec![0u8; msg.len()];
        tokio::try_join!(
            async {
                stdin.write_all(msg).await?;
                stdin.flush().await
            },
            stdout.read_exact(&mut back),
        )?;
        Ok(back)
    }
}

impl RawQuinn {
    /// Starts the server on 127.0.0.1:0 and opens `connections` (at least
    /// one) client connections to it, with the default transport settings
    /// (as the node's default). Needs a tokio runtime.
    ///
    /// # Errors
    /// TLS or socket errors.
    pub async fn start(connections: usize) -> Result<Self, BoxError> {
        Self::start_with(connections, &TransportSettings::default()).await
    }

    /// As [`RawQuinn::start`], with `transport`'s settings on both ends.
    ///
    /// # Errors
    /// TLS or socket errors, or settings that
    /// [`TransportSettings::validate`] refuses.
    pub async fn start_with(
        connections: usize,
        transport: &TransportSettings,
    ) -> Result<Self, BoxError> {
        Self::start_inner(connections, transport, None, super::busy()).await
    }

    /// As [`RawQuinn::start_with`], with no busy polling whatever
    /// [`super::busy_poll`] says: client and server on the
    /// callers' runtimes, whose threads sleep between requests.
    ///
    /// # Errors
    /// As [`RawQuinn::start_with`].
    pub async fn start_asleep(
        connections: usize,
        transport: &TransportSettings,
    ) -> Result<Self, BoxError> {
        Self::start_inner(connections, transport, None, None).await
    }

    /// As [`RawQuinn::start_with`], with a server that relays each request
    /// through a child process and back before replying (see the module
    /// docs): the raw reference that crosses a process boundary, as a
    /// lease's requests cross to its worker.
    ///
    /// # Errors
    /// As [`RawQuinn::start_with`], or `cat` cannot be started.
    pub async fn start_relayed(
        connections: usize,
        transport: &TransportSettings,
    ) -> Result<Self, BoxError> {
        let relay = Some(Arc::new(Relay::start()?));
        Self::start_inner(connections, transport, relay, super::busy()).await
    }

    async fn start_inner(
        connections: usize,
        transport: &TransportSettings,
        relay: Option<Arc<Relay>>,
        busy: Option<super::Awake>,
    ) -> Result<Self, BoxError> {
        let id = self_signed(&["localhost".into()])?;
        let local = SocketAddr::from(([127, 0, 0, 1], 0));
        // With busy-polling clients, a server on a poller of its own that
        // keeps going for its spin after each request (the poller's limit
        // is twice that: it never cuts the spin short).
        let server_spin = busy.map_or(Duration::ZERO, |b| b.server_spin);
        let poller = Arc::new(BusyPoll::new(busy.map(|_| 2 * server_spin))?);
        let awake: Awake = poller.is_on().then(|| (Arc::clone(&poller), server_spin));
        let (server, addr, task) = {
            // The server's endpoint and tasks on its poller's thread, or
            // the servers' runtime, if one is named (`serve_on`).
            let servers = poller.handle().or_else(super::servers);
            let _on = servers.as_ref().map(tokio::runtime::Handle::enter);
            let server = transport.endpoint_on(
                local,
                Some(server_config(&id, None, transport)?),
                poller.runtime(),
            )?;
            drop(poller);
            let addr = server.local_addr()?;
            let accept = server.clone();
            // The server's tasks own the relay: its child goes with them.
            let task = tokio::spawn(async move {
                while let Some(incoming) = accept.accept().await {
                    let (relay, awake) = (relay.clone(), awake.clone());
                    tokio::spawn(async move {
                        let Ok(conn) = incoming.await else { return };
                        while let Ok((send, recv)) = conn.accept_bi().await {
                            tokio::spawn(serve(send, recv, relay.clone(), awake.clone()));
                        }
                    });
                }
            });
            (server, addr, task)
        };
        let busy = BusyPoll::new(busy.map(|b| b.client))?;
        let mut client = transport.endpoint_on(local, None, busy.runtime())?;
        client.set_default_client_config(client_config(
            ServerTrust {
                roots: &[id.leaf().clone()],
                sha256: None,
            },
            None,
            transport,
        )?);
        let mut conns = Vec::new();
        for _ in 0..connections.max(1) {
            conns.push(client.connect(addr, "localhost")?.await?);
        }
        Ok(RawQuinn {
            server,
            client,
            conns,
            task,
            busy,
        })
    }

    /// One request/reply on a new stream of the first connection: `bytes`
    /// out, `bytes` back. Returns the round trip.
    ///
    /// # Errors
    /// Connection errors.
    pub async fn round_trip(&self, bytes: usize) -> Result<Duration, BoxError> {
        self.request_reply(bytes, bytes).await
    }

    /// One request/reply on a new stream of the first connection: `out`
    /// bytes out, `back` bytes back (e.g. the sizes of a protocol
    /// message and its reply). Returns the round trip.
    ///
    /// # Errors
    /// Connection errors.
    pub async fn request_reply(&self, out: usize, back: usize) -> Result<Duration, BoxError> {
        let conn = self.conns[0].clone();
        let t = Instant::now();
        self.busy
            .run(async move { request(&conn, out as u64, back as u64).await })
            .await??;
        Ok(t.elapsed())
    }

    /// Whether the client endpoint busy-polls ([`super::busy_poll`]).
    pub fn busy_polls(&self) -> bool {
        self.busy.is_on()
    }

    /// Sends `total` bytes to the server, split evenly over the first
    /// `stripes` connections (one stream each, in parallel), and waits for
    /// each stream's (empty) reply. Returns the elapsed time.
    ///
    /// # Errors
    /// Connection errors.
    pub async fn send(&self, total: u64, stripes: usize) -> Result<Duration, BoxError> {
        self.striped(total, stripes, true).await
    }

    /// Receives `total` bytes from the server, as [`RawQuinn::send`] sends.
    ///
    /// # Errors
    /// Connection errors.
    pub async fn receive(&self, total: u64, stripes: usize) -> Result<Duration, BoxError> {
        self.striped(total, stripes, false).await
    }

    async fn striped(&self, total: u64, stripes: usize, up: bool) -> Result<Duration, BoxError> {
        let n = stripes.clamp(1, self.conns.len());
        let _in_flight = self.busy.enter();
        let t = Instant::now();
        let mut tasks = Vec::new();
        for (i, conn) in self.conns[..n].iter().enumerate() {
            let part = total / n as u64 + u64::from((i as u64) < total % n as u64);
            let conn = conn.clone();
            tasks.push(tokio::spawn(async move {
                if up {
                    request(&conn, part, 0).await
                } else {
                    request(&conn, 0, part).await
                }
            }));
        }
        for task in tasks {
            task.await??;
        }
        Ok(t.elapsed())
    }

    /// Closes the connections and the server.
    pub async fn close(self) {
        for c in &self.conns {
            c.close(0u32.into(), b"done");
        }
        self.client.wait_idle().await;
        self.server.close(0u32.into(), b"done");
        self.task.abort();
    }
}

/// Sends `out` payload bytes and asks for `back` bytes; reads them all.
async fn request(conn: &quinn::Connection, out: u64, back: u64) -> Result<(), BoxError> {
    let (mut send, mut recv) = conn.open_bi().await?;
    legs::stamp(Leg::Sent);
    // The count and the first chunk in one write (as the node's client
    // writes a whole small frame at once), the rest chunk by chunk.
    let first = (out as usize).min(CHUNK);
    let mut buf = Vec::with_capacity(8 + first);
    buf.extend_from_slice(&back.to_le_bytes());
    buf.resize(8 + first, 0x5A);
    send.write_all(&buf).await?;
    let mut left = out - first as u64;
    while left > 0 {
        let n = (left as usize).min(first);
        send.write_all(&buf[8..8 + n]).await?;
        left -= n as u64;
    }
    send.finish()?;
    let got = drain(&mut recv).await?;
    legs::stamp(Leg::ClientRead);
    if got != back {
        return Err(format!("asked for {back} bytes, got {got}").into());
    }
    Ok(())
}

/// Reads a stream to its end, counting (and dropping) the bytes.
async fn drain(recv: &mut quinn::RecvStream) -> Result<u64, BoxError> {
    let mut n = 0u64;
    while let Some(c) = recv.read_chunk(CHUNK, true).await? {
        n += c.bytes.len() as u64;
    }
    Ok(n)
}

async fn serve(
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    relay: Option<Arc<Relay>>,
    awake: Awake,
) {
    let _in_flight = awake.as_ref().map(|(poller, _)| poller.enter());
    let result: Result<(), BoxError> = async {
        let mut want = [0u8; 8];
        recv.read_exact(&mut want).await?;
        match &relay {
            // The whole request through the child and back.
            Some(relay) => {
                let mut msg = want.to_vec();
                while let Some(c) = recv.read_chunk(CHUNK, true).await? {
                    msg.extend_from_slice(&c.bytes);
                }
                legs::stamp(Leg::ServerRead);
                let back = relay.echo(&msg).await?;
                want.copy_from_slice(&back[..8]);
            }
            None => {
                drain(&mut recv).await?;
                legs::stamp(Leg::ServerRead);
            }
        }
        let mut left = u64::from_le_bytes(want);
        // No larger than the reply: a 64 B reply fills 64 bytes, not a
        // whole chunk (filling 1 MiB per request would add its time to
        // every raw round trip, which no lease request pays).
        let chunk = vec![0xA5u8; (left as usize).min(CHUNK)];
        legs::stamp(Leg::ServerReplying);
        while left > 0 {
            let n = (left as usize).min(CHUNK);
            send.write_all(&chunk[..n]).await?;
            left -= n as u64;
        }
        send.finish()?;
        let _ = send.stopped().await;
        Ok(())
    }
    .await;
    drop(result);
    // Polling on for the spin after the request, as a lease's worker does
    // (the timer only bounds how long a core spins; it orders nothing).
    if let Some((poller, spin)) = awake {
        let after = poller.enter();
        tokio::spawn(async move {
            tokio::time::sleep(spin).await;
            drop(after);
        });
    }
}
