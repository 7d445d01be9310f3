//! [`RawTcp`]: one plain TCP connection on loopback and its echo-style
//! server (see the module docs of [`super`]).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;

use super::{BoxError, CHUNK};

/// A TCP echo-style server on 127.0.0.1:0 and one connection to it.
/// Requests on the connection take turns.
#[derive(Debug)]
pub struct RawTcp {
    conn: Mutex<TcpStream>,
    task: tokio::task::JoinHandle<()>,
}

impl RawTcp {
    /// Starts the server and connects to it (`TCP_NODELAY` on both ends,
    /// so small requests are not held back). Needs a tokio runtime.
    ///
    /// # Errors
    /// Socket errors.
    pub async fn start() -> Result<Self, BoxError> {
        let listener = std::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let task = {
            // On the servers' runtime, if one is named (`serve_on`).
            let servers = super::servers();
            let _on = servers.as_ref().map(tokio::runtime::Handle::enter);
            let listener = TcpListener::from_std(listener)?;
            tokio::spawn(async move {
                while let Ok((stream, _)) = listener.accept().await {
                    tokio::spawn(serve(stream));
                }
            })
        };
        let conn = TcpStream::connect(addr).await?;
        conn.set_nodelay(true)?;
        Ok(RawTcp {
            conn: Mutex::new(conn),
            task,
        })
    }

    /// One request/reply: `bytes` out, `bytes` back. Returns the round
    /// trip.
    ///
    /// # Errors
    /// Connection errors.
    pub async fn round_trip(&self, bytes: usize) -> Result<Duration, BoxError> {
        self.request(bytes as u64, bytes as u64).await
    }

    /// Sends `total` bytes to the server and waits for its (empty) reply.
    /// Returns the elapsed time.
    ///
    /// # Errors
    /// Connection errors.
    pub async fn send(&self, total: u64) -> Result<Duration, BoxError> {
        self.request(total, 0).await
    }

    /// Receives `total` bytes from the server. Returns the elapsed time.
    ///
    /// # Errors
    /// Connection errors.
    pub async fn receive(&self, total: u64) -> Result<Duration, BoxError> {
        self.request(0, total).await
    }

    /// Sends `out` payload bytes, asking for `back`; reads them all.
    async fn request(&self, out: u64, back: u64) -> Result<Duration, BoxError> {
        let mut conn = self.conn.lock().await;
        let t = Instant::now();
        // The header and the first chunk in one write, the rest chunk by
        // chunk.
        let first = (out as usize).min(CHUNK);
        let mut buf = Vec::with_capacity(16 + first);
        buf.extend_from_slice(&out.to_le_bytes());
        buf.extend_from_slice(&back.to_le_bytes());
        buf.resize(16 + first, 0x5A);
        conn.write_all(&buf).await?;
        let mut left = out - first as u64;
        while left > 0 {
            let n = (left as usize).min(first);
            conn.write_all(&buf[16..16 + n]).await?;
            left -= n as u64;
        }
        read_discard(&mut conn, back).await?;
        Ok(t.elapsed())
    }

    /// Closes the connection and stops the server.
    pub async fn close(self) {
        let mut conn = self.conn.into_inner();
        let _ = conn.shutdown().await;
        self.task.abort();
    }
}

/// Reads and drops exactly `n` bytes.
async fn read_discard(conn: &mut TcpStream, mut n: u64) -> Result<(), BoxError> {
    let mut buf = vec![0u8; (n as usize).min(CHUNK)];
    while n > 0 {
        let want = (n as usize).min(buf.len());
        let got = conn.read(&mut buf[..want]).await?;
        if got == 0 {
            return Err(format!("the connection ended with {n} bytes to come").into());
        }
        n -= got as u64;
    }
    Ok(())
}

/// Serves one connection's requests until it ends.
async fn serve(mut conn: TcpStream) {
    let result: Result<(), BoxError> = async {
        conn.set_nodelay(true)?;
        let mut chunk = Vec::new();
        loop {
            let mut head = [0u8; 16];
            match conn.read_exact(&mut head).await {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e.into()),
            }
            let [out, back] = [&head[..8], &head[8..]]
                .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()));
            read_discard(&mut conn, out).await?;
            // No larger than the reply (a 64 B reply fills 64 bytes).
            chunk.resize((back as usize).min(CHUNK).max(chunk.len()), 0xA5);
            let mut left = back;
            while left > 0 {
                let n = (left as usize).min(chunk.len());
                conn.write_all(&chunk[..n]).await?;
                left -= n as u64;
            }
        }
    }
    .await;
    drop(result);
}
