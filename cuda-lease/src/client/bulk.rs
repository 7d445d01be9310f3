//! The client's side of the bulk-data channel: large MEM_WRITE and
//! MEM_READ over TLS on TCP ([`ClientConfig::bulk`](super::ClientConfig::bulk)).
//!
//! The first large transfer asks the node for tickets (BULK_OPEN, on the
//! authenticated QUIC connection) and opens that many TLS connections to
//! the node's bulk port, each presenting one ticket. A node without the
//! channel, or a channel that cannot be reached, leaves the client on QUIC
//! for good. Connections are pooled between transfers (one request at a
//! time each) and dropped after an error or when they have idled long
//! enough that the node may have closed them.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use super::error::{config_error, from_status, lost, protocol_error};
use super::{Client, Error};
use crate::proto::{
    self, from_body, BulkOpen, BulkTickets, ErrorBody, Header, Opcode, Status, MAX_BULK_TICKETS,
};
use crate::tls;

/// Read through a buffer: rustls reads 4 KiB at a time, so without one a
/// 2 MiB chunk costs 512 system calls.
type Tls = TlsStream<tokio::io::BufReader<TcpStream>>;

/// A bulk-data connection taken from the pool, with its turn: at most
/// [`BulkChannel::most`] are taken at once, so the client never opens more
/// connections than that however many transfers run at once (the others
/// wait for a turn).
pub(super) struct Conn {
    tls: Tls,
    _turn: tokio::sync::OwnedSemaphorePermit,
}

/// Bulk-data connections a client opens at most: its stripes, and at
/// least this many (a node allows 16 per principal by default).
pub(super) const MIN_BULK_CONNECTIONS: usize = 8;

/// The read buffer under each bulk connection's TLS.
const READ_BUFFER: usize = 256 << 10;

/// A pooled connection is not reused after idling this long (the node
/// closes idle ones after two minutes).
const REUSE_WITHIN: Duration = Duration::from_secs(60);

/// The node's bulk-data channel as this client reaches it.
pub(super) struct BulkChannel {
    addr: SocketAddr,
    connector: TlsConnector,
    name: ServerName<'static>,
    /// Idle connections (no turn held), newest last.
    idle: StdMutex<Vec<(Tls, Instant)>>,
    /// The turns of taken connections.
    turns: Arc<tokio::sync::Semaphore>,
    most: usize,
}

impl std::fmt::Debug for BulkChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BulkChannel")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// The bulk-data channel for an upload (`up`) or download of `len`
    /// bytes: `None` below
    /// [`ClientConfig::data_path_min_bytes`](super::ClientConfig::data_path_min_bytes),
    /// when [`ClientConfig::bulk`](super::ClientConfig::bulk) leaves that
    /// direction on QUIC, or when the node has no channel (asked once).
    pub(super) async fn bulk_for(&self, up: bool, len: usize) -> Option<&BulkChannel> {
        let bulk = self.config.bulk;
        let wanted = if up {
            bulk.uploads()
        } else {
            bulk.downloads(len, self.config.stripe_min_bytes.max(1))
        };
        if !wanted || len < self.config.data_path_min_bytes.max(1) {
            return None;
        }
        self.bulk
            .get_or_init(|| async {
                match BulkChannel::open(self).await {
                    Ok(b) => Some(b),
                    Err(e) => {
                        tracing::debug!(error = %e, "no bulk-data channel: transfers stay on QUIC");
                        None
                    }
                }
            })
            .await
            .as_ref()
    }

    /// One MEM_WRITE or MEM_READ on a bulk connection; a MEM_READ's data
    /// lands in `into`. The outer error: the connection is unusable; the
    /// inner one: the node refused the request (the connection is fine).
    async fn bulk_exchange(
        &self,
        conn: &mut Conn,
        opcode: Opcode,
        body: &[u8],
        data: &[u8],
        into: &mut [u8],
    ) -> Result<Result<(), Error>, Error> {
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let lost = |e: std::io::Error| match proto::proto_error(&e) {
            Some(p) => protocol_error(p.to_string()),
            None => lost(&self.conn, format!("bulk-data connection: {e}")),
        };
        let h = Header::request(opcode, id, body.len() as u32, data.len() as u32);
        proto::write_frame(&mut conn.tls, &h, body, data)
            .await
            .map_err(lost)?;
        conn.tls.flush().await.map_err(lost)?;
        let (header, reply_body) = proto::read_head(&mut conn.tls, &self.limits)
            .await
            .map_err(lost)?;
        if header.request_id != id || !header.is_reply() {
            return Err(protocol_error("bulk-data reply does not match the request"));
        }
        if header.status != Status::Ok {
            if header.data_len != 0 {
                return Err(protocol_error("a refusal with data"));
            }
            let msg = from_body::<ErrorBody>(&reply_body)
                .map(|b| b.message)
                .unwrap_or_default();
            return Ok(Err(from_status(header.status, msg)));
        }
        if header.data_len as usize != into.len() {
            return Err(protocol_error(format!(
                "bulk-data reply has {} bytes of data, {} expected",
                header.data_len,
                into.len()
            )));
        }
        conn.tls.read_exact(into).await.map_err(lost)?;
        Ok(Ok(()))
    }

    /// Runs `requests` (each a MEM_WRITE or MEM_READ body, its data, and
    /// where its reply's data goes) in turn on one bulk-data connection,
    /// until one fails; the connection goes back to the pool unless it
    /// broke.
    pub(super) async fn bulk_run<'a>(
        &self,
        mut conn: Conn,
        requests: impl IntoIterator<Item = (Opcode, Vec<u8>, &'a [u8], &'a mut [u8])>,
    ) -> Result<(), Error> {
        let mut result = Ok(());
        for (op, body, data, into) in requests {
            match self.bulk_exchange(&mut conn, op, &body, data, into).await {
                Ok(Ok(())) => {}
                Ok(Err(refused)) => {
                    result = Err(refused);
                    break;
                }
                Err(broken) => return Err(broken.with_node(self.addr)),
            }
        }
        if let Some(Some(bulk)) = self.bulk.get() {
            bulk.give_back(conn);
        }
        result.map_err(|e| e.with_node(self.addr))
    }
}

impl BulkChannel {
    /// Asks for the node's channel and opens the first connections (one
    /// per stripe) into the pool.
    async fn open(client: &Client) -> Result<BulkChannel, Error> {
        let name = ServerName::try_from(client.config.server_name.clone())
            .map_err(|e| config_error(format!("server name for the bulk-data channel: {e}")))?;
        let connector = TlsConnector::from(
            tls::bulk_client_config(client.config.trust()).map_err(config_error)?,
        );
        let stripes = client.config.stripes.max(1);
        let most = stripes.max(MIN_BULK_CONNECTIONS);
        let mut bulk = BulkChannel {
            addr: client.addr,
            connector,
            name,
            idle: StdMutex::new(Vec::new()),
            turns: Arc::new(tokio::sync::Semaphore::new(most)),
            most,
        };
        let first = bulk.connect(client, stripes).await?;
        let now = Instant::now();
        *bulk.idle.get_mut().unwrap_or_else(|e| e.into_inner()) =
            first.into_iter().map(|c| (c, now)).collect();
        Ok(bulk)
    }

    /// `n` connections (at most [`BulkChannel::most`]), once that many
    /// turns are free: pooled ones first, new ones for the rest.
    pub(super) async fn take(&self, client: &Client, n: usize) -> Result<Vec<Conn>, Error> {
        let n = n.clamp(1, self.most);
        // All of a transfer's turns at once: two transfers never hold part
        // of what each needs.
        let turns = self
            .turns
            .clone()
            .acquire_many_owned(n as u32)
            .await
            .map_err(|_| protocol_error("the bulk-data pool is closed"))?;
        let mut tls = Vec::with_capacity(n);
        {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            idle.retain(|(_, since)| since.elapsed() < REUSE_WITHIN);
            while tls.len() < n {
                match idle.pop() {
                    Some((c, _)) => tls.push(c),
                    None => break,
                }
            }
        }
        if tls.len() < n {
            let more = self.connect(client, n - tls.len()).await?;
            tls.extend(more);
        }
        // One turn with each connection.
        let count = tls.len();
        let mut rest = Some(turns);
        let mut out = Vec::with_capacity(count);
        for (i, tls) in tls.into_iter().enumerate() {
            let turn = match rest.as_mut() {
                Some(r) if i + 1 < count => r.split(1),
                _ => rest.take(),
            };
            let turn = turn.ok_or_else(|| protocol_error("a bulk-data turn went missing"))?;
            out.push(Conn { tls, _turn: turn });
        }
        Ok(out)
    }

    /// A connection back into the pool (its turn is free again).
    fn give_back(&self, conn: Conn) {
        self.idle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((conn.tls, Instant::now()));
    }

    /// Opens `n` new connections: tickets in one BULK_OPEN, then the
    /// connections at once, within the client's connect timeout.
    async fn connect(&self, client: &Client, n: usize) -> Result<Vec<Tls>, Error> {
        let n = n.clamp(1, usize::from(MAX_BULK_TICKETS));
        let t: BulkTickets = client
            .call(Opcode::BulkOpen, &BulkOpen { count: n as u8 })
            .await?;
        if t.tickets.len() != n {
            return Err(protocol_error(format!(
                "BULK_OPEN gave {} tickets, {n} asked",
                t.tickets.len()
            )));
        }
        let addr = SocketAddr::new(self.addr.ip(), t.port);
        let opens = t.tickets.iter().map(|ticket| async move {
            let tcp = TcpStream::connect(addr).await?;
            tcp.set_nodelay(true)?;
            let tcp = tokio::io::BufReader::with_capacity(READ_BUFFER, tcp);
            let mut tls = self.connector.connect(self.name.clone(), tcp).await?;
            tls.write_all(ticket).await?;
            tls.flush().await?;
            let mut answer = [1u8];
            tls.read_exact(&mut answer).await?;
            if answer[0] != 0 {
                return Err(std::io::Error::other("the node refused the ticket"));
            }
            Ok::<_, std::io::Error>(tls)
        });
        let all = tokio::time::timeout(
            client.config.connect_timeout,
            futures::future::join_all(opens),
        )
        .await
        .map_err(|_| {
            lost(
                &client.conn,
                format!("the bulk-data channel at {addr} did not open within the connect timeout"),
            )
        })?;
        all.into_iter()
            .map(|r| r.map_err(|e| lost(&client.conn, format!("bulk-data channel at {addr}: {e}"))))
            .collect()
    }
}

/// Shared by striped transfers: the payload of a write that stripe tasks
/// read from several threads.
#[cfg_attr(not(feature = "backend"), allow(dead_code))]
pub(crate) type SharedBytes = Arc<dyn AsRef<[u8]> + Send + Sync>;
