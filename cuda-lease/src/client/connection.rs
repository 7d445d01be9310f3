//! The QUIC connection to a node ([`Client`]) and its request/reply
//! plumbing: one request per bidirectional stream, a reply's data read into
//! a new buffer or straight into the caller's.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use super::error::{config_error, disconnected, from_status, lost, protocol_error};
use super::{ClientConfig, Error, GpuCall};
use super::{Credentials, Disconnect, ErrorKind};
use crate::proto::{
    self, from_body, to_body, ErrorBody, GpuSubmit, Header, Hello, HelloOk, Inventory, LeaseId,
    LeaseRef, LeaseStatus, Limits, ModuleHash, Opcode, Status, DIRECT_STAMPS, FLAG_STAMPS,
};
use crate::stamps::{self, stamp, stamp_at, Point};
use crate::tls;

/// A connection to a node. Requests may run concurrently (one QUIC stream each).
#[derive(Debug)]
pub struct Client {
    pub(super) endpoint: quinn::Endpoint,
    pub(super) conn: quinn::Connection,
    pub(super) next_id: AtomicU64,
    pub(super) limits: Limits,
    node: String,
    /// Where the node is and how to log in again (for the stripes).
    pub(super) addr: SocketAddr,
    pub(super) config: ClientConfig,
    /// The extra connections of striped transfers, opened on first use.
    pub(super) stripe_conns: tokio::sync::OnceCell<Vec<quinn::Connection>>,
    /// The stripe connection the next one-stripe transfer on the data
    /// path takes (they take every stripe connection in turn).
    pub(super) next_stripe: std::sync::atomic::AtomicUsize,
    /// The node's bulk-data channel, asked for on the first large
    /// transfer (`None`: off, or the node has none).
    pub(super) bulk: tokio::sync::OnceCell<Option<super::bulk::BulkChannel>>,
    /// Modules this node was sent (or had) in a batch that it accepted:
    /// later batches name them by hash alone.
    known_modules: std::sync::Mutex<crate::proto::IdSet<ModuleHash>>,
    /// The endpoint's own thread, kept awake while requests are in flight
    /// ([`ClientConfig::busy_poll`]), or none.
    pub(super) busy: crate::transport::BusyPoll,
    /// Set once a lease's worker could not be reached from here: later
    /// leases of this client take the node's path.
    pub(super) workers_unreachable: std::sync::atomic::AtomicBool,
}

impl Client {
    /// Connects and authenticates (HELLO).
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Disconnected`](crate::client::ErrorKind::Disconnected) when the node cannot be reached or the TLS
    /// handshake fails, [`ErrorKind::Unauthorized`](crate::client::ErrorKind::Unauthorized) for bad credentials.
    ///
    /// # Cancel safety
    ///
    /// Cancelling drops the half-made connection; nothing is leased.
    pub async fn connect(addr: SocketAddr, config: &ClientConfig) -> Result<Client, Error> {
        config.transport.validate().map_err(config_error)?;
        let qcfg = tls::client_config(config.trust(), config.identity.as_ref(), &config.transport)
            .map_err(config_error)?;
        let bind: SocketAddr = if addr.is_ipv6() {
            "[::]:0".parse()
        } else {
            "0.0.0.0:0".parse()
        }
        .map_err(|e: std::net::AddrParseError| config_error(e.to_string()))?;
        let busy = crate::transport::BusyPoll::new(config.busy_poll).map_err(disconnected)?;
        let mut endpoint = config
            .transport
            .endpoint_on(bind, None, busy.runtime())
            .map_err(disconnected)?;
        endpoint.set_default_client_config(qcfg);
        let timeout = config.connect_timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        let refused = std::sync::atomic::AtomicU32::new(0);
        let connect = async {
            let conn = dial(&endpoint, addr, &config.server_name, &refused).await?;
            Self::logged_in(endpoint.clone(), conn, addr, config, busy).await
        };
        match tokio::time::timeout_at(deadline, connect).await {
            Ok(r) => r.map_err(|e| e.with_node(addr)),
            Err(_) => Err(connect_timed_out(addr, timeout, refused.into_inner())),
        }
    }

    /// The client of `conn`, once HELLO is answered.
    async fn logged_in(
        endpoint: quinn::Endpoint,
        conn: quinn::Connection,
        addr: SocketAddr,
        config: &ClientConfig,
        busy: crate::transport::BusyPoll,
    ) -> Result<Client, Error> {
        let mut client = Client {
            endpoint,
            conn,
            next_id: AtomicU64::new(1),
            limits: config.limits,
            node: String::new(),
            addr,
            config: config.clone(),
            stripe_conns: tokio::sync::OnceCell::new(),
            next_stripe: std::sync::atomic::AtomicUsize::new(0),
            bulk: tokio::sync::OnceCell::new(),
            known_modules: std::sync::Mutex::default(),
            busy,
            workers_unreachable: std::sync::atomic::AtomicBool::new(false),
        };
        let ok = client.hello(&client.conn).await;
        let no_credentials = config.token.is_none() && config.identity.is_none();
        let ok = match ok {
            Err(e) if no_credentials && matches!(e.kind(), ErrorKind::Unauthorized(_)) => {
                return Err(Error::new(
                    ErrorKind::Unauthorized(Credentials::Missing),
                    format!(
                        "the node requires credentials and none were given ({})",
                        e.message()
                    ),
                ))
            }
            other => other?,
        };
        client.node = ok.node;
        Ok(client)
    }

    pub(super) async fn hello(&self, conn: &quinn::Connection) -> Result<HelloOk, Error> {
        let hello = Hello {
            token: self.config.token.clone().unwrap_or_default(),
            client: self.config.client_name.clone(),
        };
        let (body, _) = self
            .request_on(conn, Opcode::Hello, &to_body(&hello), &[], None)
            .await?;
        from_body(&body).map_err(protocol_error)
    }

    /// The runtime of the client's own endpoint thread
    /// ([`ClientConfig::busy_poll`]), if it has one: a task there that
    /// awaits this client's replies is woken on a thread that is awake.
    #[cfg(feature = "backend")]
    pub(crate) fn io_runtime(&self) -> Option<tokio::runtime::Handle> {
        self.busy.handle()
    }

    /// The client's busy poller ([`ClientConfig::busy_poll`]; off without it).
    #[cfg(feature = "backend")]
    pub(crate) fn busy(&self) -> &crate::transport::BusyPoll {
        &self.busy
    }

    /// Runs `request` (a whole exchange: written, then its reply read) so
    /// that, on a client with an endpoint thread of its own, its reply is
    /// read there: polled once on this thread (the request is written
    /// with no thread woken), then finished as a task of that thread,
    /// which wakes the caller once with the result. Without the thread it
    /// is simply awaited.
    pub(super) fn on_io<T: Send + 'static>(
        &self,
        request: impl std::future::Future<Output = Result<T, Error>> + Send + 'static,
    ) -> impl std::future::Future<Output = Result<T, Error>> + Send + 'static {
        let addr = self.addr;
        futures::FutureExt::map(self.busy.run(request), move |r| {
            r.unwrap_or_else(|e| Err(disconnected(e).with_node(addr)))
        })
    }

    /// The node's name.
    pub fn node_name(&self) -> &str {
        &self.node
    }

    /// The node's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sends one raw frame and returns the reply's body and data; a non-OK
    /// status becomes an [`Error`].
    ///
    /// # Errors
    ///
    /// As described by the reply status, or [`ErrorKind::Disconnected`](crate::client::ErrorKind::Disconnected).
    pub async fn request(
        &self,
        opcode: Opcode,
        body: &[u8],
        data: &[u8],
    ) -> Result<(Vec<u8>, Vec<u8>), Error> {
        self.request_on(&self.conn, opcode, body, data, None).await
    }

    /// [`Client::request`] on `conn`; with `into`, the reply's data is read
    /// straight into it (its length must match) and the returned data is
    /// empty.
    pub(super) async fn request_on(
        &self,
        conn: &quinn::Connection,
        opcode: Opcode,
        body: &[u8],
        data: &[u8],
        into: Option<&mut [u8]>,
    ) -> Result<(Vec<u8>, Vec<u8>), Error> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let into = into.map_or(ReplyInto::Owned, ReplyInto::Exact);
        let _busy = self.busy.enter();
        exchange(conn, &self.limits, id, opcode, body, data, into)
            .await
            .map_err(|e| e.with_node(self.addr))
    }

    pub(crate) async fn call<Req: serde::Serialize, Rep: serde::de::DeserializeOwned>(
        &self,
        op: Opcode,
        req: &Req,
    ) -> Result<Rep, Error> {
        let (body, _) = self.request(op, &to_body(req), &[]).await?;
        from_body(&body).map_err(protocol_error)
    }

    /// The modules this client believes the node has.
    pub(super) fn known_modules(
        &self,
    ) -> std::sync::MutexGuard<'_, crate::proto::IdSet<ModuleHash>> {
        self.known_modules.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The node's devices and free capacity.
    ///
    /// # Errors
    ///
    /// As [`Client::request`].
    pub async fn inventory(&self) -> Result<Inventory, Error> {
        self.call(Opcode::GetInventory, &()).await
    }

    /// Frees a lease by id alone (always allowed, even unauthenticated).
    ///
    /// # Errors
    ///
    /// [`ErrorKind::LeaseNotFound`](crate::client::ErrorKind::LeaseNotFound) for an unknown lease.
    pub async fn free_lease(&self, lease: LeaseId) -> Result<(), Error> {
        self.request(Opcode::LeaseFree, &to_body(&LeaseRef { lease }), &[])
            .await
            .map(drop)
    }

    /// A lease's state by id (one LEASE_QUERY on this connection): what
    /// [`Lease::query`](crate::client::Lease::query) asks, for a caller that
    /// holds only the connection.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::LeaseNotFound`](crate::client::ErrorKind::LeaseNotFound) for an unknown lease or one of
    /// another principal; as [`Client::request`].
    pub async fn query_lease(&self, lease: LeaseId) -> Result<LeaseStatus, Error> {
        self.call(Opcode::LeaseQuery, &LeaseRef { lease }).await
    }

    /// Runs a kernel as a pure function: inputs in, output bytes out, nothing
    /// left on the node (GPU_SUBMIT).
    ///
    /// # Errors
    ///
    /// [`ErrorKind::LoadFailed`](crate::client::ErrorKind::LoadFailed), [`ErrorKind::LaunchFailed`](crate::client::ErrorKind::LaunchFailed), [`ErrorKind::InvalidRequest`](crate::client::ErrorKind::InvalidRequest), ...
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons the reply; the node still runs the call
    /// to completion and frees its buffers.
    pub async fn gpu_call(&self, call: &GpuCall) -> Result<Vec<u8>, Error> {
        let req = GpuSubmit {
            kernel: call.kernel.as_str().into(),
            grid: call.grid,
            block: call.block,
            shared_mem: call.shared_mem,
            args: call.args.clone(),
            ptx_len: call.ptx.len() as u32,
            input_lens: call.inputs.iter().map(|i| i.len() as u32).collect(),
            output_size: call.output_size,
            output_fill: call.output_fill,
        };
        let mut data =
            Vec::with_capacity(call.ptx.len() + call.inputs.iter().map(Vec::len).sum::<usize>());
        data.extend_from_slice(call.ptx.as_bytes());
        for i in &call.inputs {
            data.extend_from_slice(i);
        }
        let (_, out) = self
            .request(Opcode::GpuSubmit, &to_body(&req), &data)
            .await?;
        Ok(out)
    }

    /// Whether the connection is gone (closed by either side, or lost).
    pub fn is_closed(&self) -> bool {
        self.conn.close_reason().is_some()
    }

    /// Closes the connection (leases are not freed: their TTL runs out).
    pub fn close(&self) {
        self.conn.close(0u32.into(), b"bye");
    }

    /// Waits until the connection's packets are flushed after [`Client::close`].
    pub async fn wait_idle(&self) {
        self.endpoint.wait_idle().await;
    }
}

/// Where a reply's data goes.
pub(super) enum ReplyInto<'a, 'b> {
    /// A new `Vec`, returned.
    Owned,
    /// This slice, whose length must be the data's.
    Exact(&'a mut [u8]),
    /// These slices in turn, up to the data's length (the reads of a
    /// batch that stopped early fill only the first ones).
    Parts(&'a mut [&'b mut [u8]]),
}

/// One request on a new stream of `conn` and its reply (see
/// [`Client::request`]); the reply's data lands as `into` says.
pub(super) async fn exchange(
    conn: &quinn::Connection,
    limits: &Limits,
    id: u64,
    opcode: Opcode,
    body: &[u8],
    data: &[u8],
    into: ReplyInto<'_, '_>,
) -> Result<(Vec<u8>, Vec<u8>), Error> {
    let lost = |e: &dyn std::fmt::Display| lost(conn, e);
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| lost(&e))?;
    let mut h = Header::request(opcode, id, body.len() as u32, data.len() as u32);
    if opcode == Opcode::Batch && stamps::enabled() {
        h.flags |= FLAG_STAMPS;
    }
    stamp(Point::ClientSent);
    proto::write_frame(&mut send, &h, body, data)
        .await
        .map_err(|e| lost(&e))?;
    send.finish().map_err(|e| lost(&e))?;
    let read_err = |e: std::io::Error| match proto::proto_error(&e) {
        Some(p) => protocol_error(p.to_string()),
        None => lost(&e),
    };
    let mut reply = ReplyReader {
        recv: &mut recv,
        rest: bytes::Bytes::new(),
    };
    let mut hb = [0u8; proto::HEADER_LEN];
    reply.fill(&mut hb).await.map_err(read_err)?;
    let header = Header::decode(&hb, limits).map_err(|e| read_err(proto::invalid_data(e)))?;
    let mut reply_body = vec![0u8; header.body_len as usize];
    reply.fill(&mut reply_body).await.map_err(read_err)?;
    stamp(Point::ClientReply);
    if header.status != Status::Ok {
        let msg = from_body::<ErrorBody>(&reply_body)
            .map(|b| b.message)
            .unwrap_or_default();
        return Err(from_status(header.status, msg));
    }
    if header.request_id != id || !header.is_reply() {
        return Err(protocol_error("reply does not match the request"));
    }
    if header.flags & FLAG_STAMPS != 0 {
        enter_stamps(&mut reply_body)?;
    }
    let mut owned = Vec::new();
    let want = header.data_len as usize;
    let mismatch =
        |have: usize| protocol_error(format!("reply has {want} bytes of data, {have} expected"));
    match into {
        ReplyInto::Exact(out) if out.len() == want => {
            reply.fill(out).await.map_err(read_err)?;
        }
        ReplyInto::Exact(out) => return Err(mismatch(out.len())),
        ReplyInto::Owned => {
            owned = vec![0u8; want];
            reply.fill(&mut owned).await.map_err(read_err)?;
        }
        ReplyInto::Parts(parts) => {
            let room: usize = parts.iter().map(|p| p.len()).sum();
            if want > room {
                return Err(mismatch(room));
            }
            let mut left = want;
            for part in parts.iter_mut() {
                if left == 0 {
                    break;
                }
                if part.len() > left {
                    return Err(protocol_error("a read was cut in the reply"));
                }
                reply.fill(part).await.map_err(read_err)?;
                left -= part.len();
            }
        }
    }
    reply.end_if_here();
    Ok((reply_body, owned))
}

/// A reply's stream, read a received chunk at a time: each read takes the
/// connection's lock once, and a small reply's header, body and data
/// usually come in one chunk, where reading them field by field would
/// take the lock (and may wake the connection's driver) once per field.
struct ReplyReader<'a> {
    recv: &'a mut quinn::RecvStream,
    /// What the last chunk held beyond the field it was read for.
    rest: bytes::Bytes,
}

impl ReplyReader<'_> {
    /// Fills `out` from what is left of the last chunk, then from new
    /// chunks, keeping what a chunk holds beyond `out` for the next field
    /// (a small reply's body and data usually come with its header).
    async fn fill(&mut self, out: &mut [u8]) -> std::io::Result<()> {
        let n = self.rest.len().min(out.len());
        out[..n].copy_from_slice(&self.rest.split_to(n));
        let mut at = n;
        while at < out.len() {
            let chunk = match self.recv.read_chunk(usize::MAX, true).await {
                Ok(Some(chunk)) => chunk.bytes,
                Ok(None) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Err(e) => return Err(e.into()),
            };
            let k = chunk.len().min(out.len() - at);
            out[at..at + k].copy_from_slice(&chunk[..k]);
            at += k;
            if k < chunk.len() {
                self.rest = chunk.slice(k..);
            }
        }
        Ok(())
    }

    /// The reply read whole: reads the stream's end if it has come (see
    /// [`read_end_if_here`](crate::transport::read_end_if_here)).
    fn end_if_here(&mut self) {
        if self.rest.is_empty() {
            crate::transport::read_end_if_here(self.recv);
        }
    }
}

/// Enters the worker's stamps that a stamped direct BATCH reply's body
/// ends with ([`FLAG_STAMPS`]) and cuts them off it.
fn enter_stamps(body: &mut Vec<u8>) -> Result<(), Error> {
    const _: () = assert!(stamps::WORKER_POINTS.len() + 3 == DIRECT_STAMPS);
    let Some(start) = body.len().checked_sub(DIRECT_STAMPS * 8) else {
        return Err(protocol_error("a stamped reply without its stamps"));
    };
    let at = [Point::DirectRead, Point::DirectHanded]
        .into_iter()
        .chain(stamps::WORKER_POINTS)
        .chain([Point::DirectAnswered]);
    for (point, t) in at.zip(body[start..].chunks_exact(8)) {
        let mut ns = [0u8; 8];
        ns.copy_from_slice(t);
        // 0: a point the worker did not reach.
        match u64::from_le_bytes(ns) {
            0 => {}
            ns => stamp_at(point, ns),
        }
    }
    body.truncate(start);
    Ok(())
}

/// The error of a connect that did not finish within `timeout`, after
/// `refused` refusals before the handshake (the node was busy).
pub(super) fn connect_timed_out(
    addr: SocketAddr,
    timeout: std::time::Duration,
    refused: u32,
) -> Error {
    let e = if refused > 0 {
        Error::new(
            ErrorKind::Disconnected(Disconnect::NodeBusy),
            format!(
                "node busy: too many handshakes from this address; {addr} refused the \
                 connection {refused} times within {timeout:?}"
            ),
        )
    } else {
        Error::new(
            ErrorKind::Disconnected(Disconnect::ConnectTimeout),
            format!("no node answered at {addr} within {timeout:?}"),
        )
    };
    e.with_node(addr)
}

/// A QUIC connection to `addr`, made again with backoff (20 ms doubling
/// to 1 s, with jitter) each time the node refuses it before its
/// handshake: a node refuses when its queue of handshakes is full, and
/// serves the connection once earlier ones are through. The caller
/// bounds the time (its connect timeout); `refused` counts the refusals.
pub(super) async fn dial(
    endpoint: &quinn::Endpoint,
    addr: SocketAddr,
    server_name: &str,
    refused: &std::sync::atomic::AtomicU32,
) -> Result<quinn::Connection, Error> {
    let mut backoff = std::time::Duration::from_millis(20);
    loop {
        let connecting = endpoint
            .connect(addr, server_name)
            .map_err(|e| config_error(e).with_node(addr))?;
        match connecting.await {
            Ok(conn) => return Ok(conn),
            Err(quinn::ConnectionError::ConnectionClosed(c))
                if c.error_code == quinn::TransportErrorCode::CONNECTION_REFUSED =>
            {
                refused.fetch_add(1, Ordering::Relaxed);
                // Jitter of up to half the backoff, so a burst of clients
                // refused together does not come back together.
                let nanos = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.subsec_nanos());
                let jitter = backoff.mul_f64(f64::from(nanos % 1000) / 2000.0);
                tokio::time::sleep(backoff + jitter).await;
                backoff = (backoff * 2).min(std::time::Duration::from_secs(1));
            }
            Err(e) => return Err(disconnected(e)),
        }
    }
}
