//! The node's side of a worker: starting the process, the pipes and shared ring
//! it is reached through, requests with a time bound, and the kill.

use std::process::Stdio;
use std::sync::Arc;
use std::sync::Mutex as StdMutex;
use std::time::Duration;

use tokio::io::BufReader;
use tokio::process::{Child, ChildStdin, Command};

use super::messages::{HeldRead, FLAG_HELD};
use super::{WorkerSpec, SPIN_ENV, WORKER_ENV, WORKER_LIMITS};
use crate::device::DeviceError;
use crate::lock;
use crate::proto::{self, from_body, DeviceInfo, Frame, Header, Opcode, Status};
use crate::shm::{ShmRing, SHM_ENV};
use crate::stamps::{stamp, Point};

/// Kernel buffer size requested for each pipe between node and worker: the
/// default `/proc/sys/fs/pipe-max-size`, so a large transfer wakes the
/// reader less often than with Linux's 64 KiB default.
pub const PIPE_BUFFER_BYTES: usize = 1 << 20;

/// Grows the kernel buffer of the pipe behind `fd` to [`PIPE_BUFFER_BYTES`]
/// (best effort: a smaller system limit only costs throughput).
fn grow_pipe(fd: std::os::fd::BorrowedFd<'_>) {
    use std::os::fd::AsRawFd;
    // SAFETY: `fd` is borrowed, so open for the call; F_SETPIPE_SZ takes one
    // `int`, which we pass, and touches no memory of ours.
    let r = unsafe {
        libc::fcntl(
            fd.as_raw_fd(),
            libc::F_SETPIPE_SZ,
            PIPE_BUFFER_BYTES as std::ffi::c_int,
        )
    };
    if r < 0 {
        tracing::debug!(
            error = %std::io::Error::last_os_error(),
            "could not grow a worker pipe; keeping the default size"
        );
    }
}

/// Why talking to a worker failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum WorkerError {
    /// It could not start (the message says why, e.g. "no NVIDIA driver found").
    #[error("worker failed to start: {0}")]
    Start(String),
    /// It exited or its pipe broke.
    #[error("worker died: {0}")]
    Dead(String),
    /// It did not answer in time and was killed.
    #[error("worker hung for {0:?} and was killed")]
    Hung(Duration),
}

/// The request side of the pipes: requests reach the worker in the order
/// they are written here.
pub(super) struct WorkerIo {
    stdin: ChildStdin,
    next_id: u64,
}

/// Requests sent and not yet answered, by request id. Replies come in any
/// order (a batch is answered when its work is done); whichever caller
/// holds the reply side reads them and hands each to its request.
#[derive(Default)]
struct Waiting {
    replies: std::collections::HashMap<u64, tokio::sync::oneshot::Sender<Frame>>,
    /// The reply side broke (the worker died, or a reply was cut short):
    /// no reply comes any more.
    broken: Option<String>,
}

/// The read end of the worker's stdout, read with `read` first and the
/// reactor's readiness only when that finds nothing (Tokio's own pipe waits
/// for the reactor after each read that emptied it, even with the next
/// reply already there: a reactor turn and a task wake-up per reply).
pub(super) struct PipeReader(tokio::io::unix::AsyncFd<std::fs::File>);

impl PipeReader {
    /// Takes over the read end of a pipe (made non-blocking here).
    fn new(fd: std::os::fd::OwnedFd) -> std::io::Result<Self> {
        use std::os::fd::AsRawFd;
        // SAFETY: `fd` is an open descriptor owned here; F_GETFL/F_SETFL
        // change only its status flags.
        unsafe {
            let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
            if flags < 0 || libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) < 0
            {
                return Err(std::io::Error::last_os_error());
            }
        }
        let file = std::fs::File::from(fd);
        // SAFETY: a `File` owns its descriptor: it stays open, and is the
        // same one, until the `AsyncFd` (which owns the `File`) is dropped.
        let fd = unsafe { tokio::io::unix::AsyncFd::register(file) }?;
        Ok(PipeReader(fd))
    }
}

impl tokio::io::AsyncRead for PipeReader {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::io::Read;
        use std::task::Poll;
        loop {
            match self.0.get_ref().read(buf.initialize_unfilled()) {
                Ok(n) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() != std::io::ErrorKind::WouldBlock => {
                    return Poll::Ready(Err(e));
                }
                Err(_) => {}
            }
            // Empty: wait for the reactor. Readiness it reported before
            // the read above is stale; clear it and read again (nothing is
            // lost: a write after the clear sets it anew).
            match self.0.poll_read_ready(cx) {
                Poll::Ready(Ok(mut guard)) => guard.clear_ready(),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// The node's side of one worker process.
pub(crate) struct WorkerProcess {
    io: tokio::sync::Mutex<WorkerIo>,
    /// The reply side of the pipes, read by one caller at a time.
    replies: tokio::sync::Mutex<BufReader<PipeReader>>,
    waiting: StdMutex<Waiting>,
    child: StdMutex<Option<Child>>,
    info: DeviceInfo,
    pid: Option<u32>,
    /// The bulk-data ring shared with the process.
    ring: Arc<ShmRing>,
    /// How long to poll for a reply before awaiting it ([`crate::spin`]).
    spin: Duration,
}

impl std::fmt::Debug for WorkerProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerProcess")
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

impl WorkerProcess {
    /// The worker in `slot`, started (up to `timeout`) when the slot is
    /// empty or its worker has exited.
    pub(crate) async fn ensure<'a>(
        slot: &'a mut Option<WorkerProcess>,
        spec: &WorkerSpec,
        timeout: Duration,
    ) -> Result<&'a WorkerProcess, WorkerError> {
        if slot.as_ref().is_some_and(|w| w.exited().is_some()) {
            *slot = None;
        }
        match slot {
            Some(w) => Ok(w),
            None => Ok(slot.insert(WorkerProcess::spawn(spec, timeout).await?)),
        }
    }

    /// Starts a worker and waits (up to `timeout`) for it to report its device.
    pub(crate) async fn spawn(spec: &WorkerSpec, timeout: Duration) -> Result<Self, WorkerError> {
        let ring = ShmRing::create()
            .map_err(|e| WorkerError::Start(format!("creating the shared ring: {e}")))?;
        let mut cmd = Command::new(&spec.program);
        cmd.args(&spec.args)
            .env(WORKER_ENV, spec.device.to_env())
            .env(SHM_ENV, ring.path())
            .env(SPIN_ENV, spec.spin.as_micros().to_string())
            .envs(spec.compile.to_env())
            // Workers run tenants' work: the node's tokens stay behind.
            .env_remove("CUDA_LEASE_TOKENS")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .map_err(|e| WorkerError::Start(format!("{}: {e}", spec.program.display())))?;
        let pid = child.id();
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(WorkerError::Start("no pipes".into()));
        };
        grow_pipe(std::os::fd::AsFd::as_fd(&stdin));
        grow_pipe(std::os::fd::AsFd::as_fd(&stdout));
        let stdout = stdout
            .into_owned_fd()
            .and_then(PipeReader::new)
            .map_err(|e| WorkerError::Start(format!("the worker's stdout: {e}")))?;
        let mut stdout = BufReader::with_capacity(PIPE_BUFFER_BYTES, stdout);
        // A worker that fails to start is killed as `child` drops.
        let frame = tokio::time::timeout(timeout, proto::read_frame(&mut stdout, &WORKER_LIMITS))
            .await
            .map_err(|_| WorkerError::Start(format!("no answer within {timeout:?}")))?
            .map_err(|e| {
                WorkerError::Start(format!(
                    "{e} (does {} call cuda_lease_node::worker::main_if_worker()?)",
                    spec.program.display()
                ))
            })?;
        if frame.header.status != Status::Ok {
            let msg = from_body::<DeviceError>(&frame.body)
                .map(|f| f.message)
                .unwrap_or_default();
            return Err(WorkerError::Start(msg));
        }
        let info: DeviceInfo = from_body(&frame.body)
            .map_err(|e| WorkerError::Start(format!("bad ready frame: {e}")))?;
        // The worker mapped the ring before it said it was ready.
        ring.unlink();
        Ok(Self {
            ring: Arc::new(ring),
            io: tokio::sync::Mutex::new(WorkerIo { stdin, next_id: 1 }),
            replies: tokio::sync::Mutex::new(stdout),
            waiting: StdMutex::new(Waiting::default()),
            child: StdMutex::new(Some(child)),
            info,
            pid,
            spin: spec.spin,
        })
    }

    /// The bulk-data ring shared with this worker.
    pub(crate) fn ring(&self) -> &Arc<ShmRing> {
        &self.ring
    }

    /// The device as reported at start-up.
    pub(crate) fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Sends one request and waits up to `timeout` for the reply; on timeout
    /// the worker is killed. Calls on one worker run one at a time, in order.
    pub(crate) async fn call(
        &self,
        opcode: Opcode,
        body: &[u8],
        data: &[u8],
        timeout: Duration,
    ) -> Result<Frame, WorkerError> {
        self.send(opcode, 0, body, &[data], timeout)
            .await?
            .reply()
            .await
    }

    /// Up to `len` bytes, from `offset`, of the data the worker kept for
    /// its reply to request `request` ([`FLAG_HELD`]); `len` 0 drops it
    /// (so does reading its last byte).
    pub(crate) async fn read_held(
        &self,
        request: u64,
        offset: u64,
        len: u32,
        timeout: Duration,
    ) -> Result<Vec<u8>, WorkerError> {
        let body = proto::to_body(&HeldRead {
            request,
            offset,
            len,
        });
        let f = self
            .send(Opcode::Batch, FLAG_HELD, &body, &[], timeout)
            .await?
            .reply()
            .await?;
        Ok(f.data)
    }

    /// Sends one request with header flags `flags`; [`SentRequest::reply`]
    /// waits for its reply (up to `timeout` from now; then the worker is
    /// killed). Requests reach the worker in the order of these calls; replies
    /// may come in any order, so a caller may send before the last reply.
    pub(crate) async fn send(
        &self,
        opcode: Opcode,
        flags: u16,
        body: &[u8],
        parts: &[&[u8]],
        timeout: Duration,
    ) -> Result<SentRequest<'_>, WorkerError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let mut io = self.io.lock().await;
        io.next_id += 1;
        let id = io.next_id;
        {
            let mut w = lock(&self.waiting);
            if let Some(why) = &w.broken {
                return Err(WorkerError::Dead(why.clone()));
            }
            w.replies.insert(id, tx);
        }
        let mut h = Header::request(opcode, id, body.len() as u32, len as u32);
        h.flags |= flags;
        stamp(Point::WorkerCall);
        let written = tokio::time::timeout_at(
            deadline,
            proto::write_frame_parts(&mut io.stdin, &h, body, parts),
        )
        .await;
        drop(io);
        match written {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(self.give_up(&e.to_string())),
            Err(_) => {
                // Part of a request may be in the pipe: nothing after it
                // could be read right.
                self.give_up("a request was cut short");
                return Err(WorkerError::Hung(timeout));
            }
        }
        Ok(SentRequest {
            worker: self,
            id,
            rx,
            deadline,
            timeout,
        })
    }

    /// No reply comes any more (`why`): every waiting request fails, and
    /// the process is killed. Returns the error a request sees.
    fn give_up(&self, why: &str) -> WorkerError {
        {
            let mut w = lock(&self.waiting);
            w.broken.get_or_insert_with(|| why.to_owned());
            // Dropped senders: their requests see the break.
            w.replies.clear();
        }
        self.kill();
        WorkerError::Dead(why.to_owned())
    }

    /// Why no reply comes any more.
    fn broken(&self) -> WorkerError {
        let why = lock(&self.waiting)
            .broken
            .clone()
            .unwrap_or_else(|| "the worker's replies stopped".into());
        WorkerError::Dead(why)
    }

    /// Reads replies (holding the reply side) until request `id`'s, handing
    /// the others to their requests.
    async fn read_until(
        &self,
        id: u64,
        mut stdout: tokio::sync::MutexGuard<'_, BufReader<PipeReader>>,
    ) -> Result<Frame, WorkerError> {
        // A reply cut short by a drop of this future would leave the pipe
        // mid-frame: the worker is then killed.
        let mut guard = KillUnlessDone(Some(self));
        loop {
            if stdout.buffer().is_empty() {
                use std::os::fd::AsRawFd;
                let fd = stdout.get_ref().0.as_raw_fd();
                crate::spin::readable_within_async(fd, self.spin).await;
            }
            let f = match read_reply(&mut *stdout).await {
                Ok(f) => f,
                Err(e) => {
                    guard.0 = None;
                    return Err(self.give_up(&e.to_string()));
                }
            };
            stamp(Point::PipeReply);
            let to = lock(&self.waiting).replies.remove(&f.header.request_id);
            if f.header.request_id == id {
                guard.0 = None;
                return Ok(f);
            }
            if let Some(tx) = to {
                let _ = tx.send(f);
            }
        }
    }

    /// Kills the process (idempotent); the exit is reaped in the background.
    pub(crate) fn kill(&self) {
        let child = lock(&self.child).take();
        if let Some(mut child) = child {
            let _ = child.start_kill();
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let _ = child.wait().await;
                });
            }
        }
    }

    /// Kills the process and waits until it has exited (so its GPU memory is back).
    pub(crate) async fn kill_and_wait(&self) {
        let child = lock(&self.child).take();
        if let Some(mut child) = child {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }

    /// `Some(reason)` when the process has exited or was killed.
    pub(crate) fn exited(&self) -> Option<String> {
        let mut guard = lock(&self.child);
        match guard.as_mut() {
            None => Some("killed".into()),
            Some(c) => match c.try_wait() {
                Ok(Some(status)) => Some(format!("exited with {status}")),
                Ok(None) => None,
                Err(e) => Some(e.to_string()),
            },
        }
    }
}

/// A request written to a worker, whose reply is yet to come.
pub(crate) struct SentRequest<'a> {
    worker: &'a WorkerProcess,
    id: u64,
    rx: tokio::sync::oneshot::Receiver<Frame>,
    deadline: tokio::time::Instant,
    timeout: Duration,
}

impl SentRequest<'_> {
    /// Waits for the reply until the request's deadline, then kills the worker.
    pub(crate) async fn reply(mut self) -> Result<Frame, WorkerError> {
        let worker = self.worker;
        let id = self.id;
        let rx = &mut self.rx;
        let exchange = async {
            loop {
                tokio::select! {
                    biased;
                    r = &mut *rx => return r.map_err(|_| worker.broken()),
                    stdout = worker.replies.lock() => {
                        // Handed over (or broken) while we waited for the
                        // reply side: the receiver has it.
                        if !lock(&worker.waiting).replies.contains_key(&id) {
                            continue;
                        }
                        return worker.read_until(id, stdout).await;
                    }
                }
            }
        };
        let r = tokio::time::timeout_at(self.deadline, exchange).await;
        stamp(Point::WorkerReplied);
        r.unwrap_or_else(|_| {
            lock(&worker.waiting).replies.remove(&id);
            worker.kill();
            Err(WorkerError::Hung(self.timeout))
        })
    }
}

/// Reads a worker's reply: a held one ([`FLAG_HELD`]) has no data on the
/// pipe (its `data_len` says how much the worker keeps).
async fn read_reply<R>(r: &mut R) -> std::io::Result<Frame>
where
    R: tokio::io::AsyncRead + Unpin,
{
    use tokio::io::AsyncReadExt;
    let (header, body) = proto::read_head(r, &WORKER_LIMITS).await?;
    let mut data = Vec::new();
    if header.flags & FLAG_HELD == 0 {
        data.resize(header.data_len as usize, 0);
        r.read_exact(&mut data).await?;
    }
    Ok(Frame { header, body, data })
}

/// Kills the worker when dropped while armed (a reply read cut short).
struct KillUnlessDone<'a>(Option<&'a WorkerProcess>);

impl Drop for KillUnlessDone<'_> {
    fn drop(&mut self) {
        if let Some(w) = self.0.take() {
            w.give_up("a reply was cut short");
        }
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::os::fd::{AsFd, AsRawFd};

    #[tokio::test]
    async fn the_pipe_reader_reads_what_is_there_waits_for_the_rest_and_sees_the_end() {
        use std::io::Write;
        use tokio::io::AsyncReadExt;
        let (r, mut w) = std::io::pipe().expect("pipe");
        let mut reader = PipeReader::new(r.into()).expect("reader");
        w.write_all(b"abc").expect("write");
        let mut got = [0u8; 3];
        reader.read_exact(&mut got).await.expect("there already");
        assert_eq!(&got, b"abc");
        // Nothing there: the read waits for the writer (a thread, later).
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            w.write_all(b"defg").expect("write");
            // Dropped: the end of the pipe.
        });
        let mut rest = Vec::new();
        reader.read_to_end(&mut rest).await.expect("to the end");
        assert_eq!(rest, b"defg");
        writer.join().expect("writer");
    }

    fn pipe_size(fd: std::os::fd::BorrowedFd<'_>) -> std::ffi::c_int {
        // SAFETY: `fd` is borrowed and open for the call; F_GETPIPE_SZ
        // takes no argument and touches no memory of ours.
        unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETPIPE_SZ) }
    }

    #[test]
    fn pipes_are_grown_up_to_the_system_limit() {
        let (reader, writer) = std::io::pipe().unwrap();
        let before = pipe_size(reader.as_fd());
        grow_pipe(writer.as_fd());
        let after = pipe_size(reader.as_fd());
        let max: usize = std::fs::read_to_string("/proc/sys/fs/pipe-max-size")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        if max >= PIPE_BUFFER_BYTES {
            assert_eq!(after as usize, PIPE_BUFFER_BYTES);
        } else {
            assert_eq!(after, before, "a refused resize leaves the pipe as it was");
        }
    }
}
