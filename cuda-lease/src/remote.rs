//! A leased GPU as a backend of `cuda-async`: [`LeaseSession`] implements
//! [`cuda_async::RemoteSession`] on the [`Recorder`]
//! of protocol 2.
//!
//! A [`Recording`] of `cuda-async` becomes one BATCH: its client-named ids
//! and streams map one to one, kernels travel as descriptions (the
//! `cuda-core` module's source, named by its SHA-256; the node compiles
//! CUDA C), and the frees of dropped buffers queued since the last message
//! go first. The reply's reads land in the recording's
//! [`ReadSlot`](cuda_async::remote::ReadSlot)s, then the submission's
//! [`RemoteCompletion`] completes; a failure fails it with the matching
//! `cuda-async` error.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use cuda_async::remote::{Recording, RemoteArg, RemoteCommand, RemoteCompletion};
use cuda_async::{ModuleSource, RemoteSession};

use crate::client::{Error, Lease, Module, Recorder, Session};
use crate::hops::{self, HopTimer};
use crate::proto::{Id, KernelArg, LaunchSpec, ModuleHash, Opcode};

/// How long a queued free waits for a message to ride on before it is
/// sent alone.
const FREE_FLUSH_DELAY: Duration = Duration::from_millis(2);

/// A lease as a remote session of `cuda-async`. Cheap to share
/// (`Arc<LeaseSession>`); its I/O runs on the tokio runtime it was made on.
#[derive(Debug)]
pub struct LeaseSession {
    me: Weak<LeaseSession>,
    session: Session,
    runtime: tokio::runtime::Handle,
    name: String,
    frees: Mutex<Vec<u64>>,
    flush_scheduled: AtomicBool,
    /// Modules seen, by the address of their `cuda-core` description, so a
    /// module's source is hashed once.
    modules: Mutex<Vec<(cuda_async::Module, Module)>>,
}

impl LeaseSession {
    /// A session on `session`'s lease whose I/O runs on `runtime`.
    pub fn new(session: Session, runtime: tokio::runtime::Handle) -> Arc<Self> {
        let id = session.lease_id().to_string();
        let name = format!(
            "lease {}... on node {}",
            &id[..8],
            session.client().node_name()
        );
        Arc::new_cyclic(|me| LeaseSession {
            me: me.clone(),
            session,
            runtime,
            name,
            frees: Mutex::new(Vec::new()),
            flush_scheduled: AtomicBool::new(false),
            modules: Mutex::new(Vec::new()),
        })
    }

    /// A session on `session`'s lease on the current tokio runtime.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime.
    pub fn current(session: Session) -> Arc<Self> {
        Self::new(session, tokio::runtime::Handle::current())
    }

    /// The wire form of a `cuda-core` module (hashed once per module).
    fn module(&self, m: &cuda_async::Module) -> Module {
        let mut seen = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, w)) = seen
            .iter()
            .find(|(k, _)| k.hash() == m.hash() && k.source() == m.source())
        {
            return w.clone();
        }
        let wire = match m.source() {
            ModuleSource::Cuda { source, options } => {
                let opts: Vec<&str> = options.iter().map(String::as_str).collect();
                Module::cuda(source.as_str(), &opts)
            }
            other => Module::ptx(other.text()),
        };
        seen.push((m.clone(), wire.clone()));
        wire
    }

    /// The BATCH of `recording`, after the queued frees.
    ///
    /// The writes' payloads stay in the recording's data (sent as they are,
    /// see [`LeaseSession::submit`]); the recorder holds only their
    /// commands.
    fn translate(&self, recording: &Recording) -> Recorder {
        let mut rec = self.session.recorder();
        for id in std::mem::take(&mut *self.frees.lock().unwrap_or_else(|e| e.into_inner())) {
            rec.free(0, Id(id));
        }
        for c in recording.commands() {
            match c {
                RemoteCommand::Alloc { stream, id, bytes } => {
                    rec.command(
                        *stream,
                        crate::proto::Op::Alloc {
                            buf: Id(*id),
                            size: *bytes,
                        },
                    );
                }
                RemoteCommand::Write {
                    stream,
                    id,
                    offset,
                    len,
                } => {
                    rec.write_later(*stream, Id(*id), *offset, *len as u32);
                }
                RemoteCommand::Read {
                    stream,
                    id,
                    offset,
                    len,
                } => {
                    rec.read(*stream, Id(*id), *offset, *len as u32);
                }
                RemoteCommand::Fill {
                    stream,
                    id,
                    offset,
                    len,
                    value,
                } => {
                    rec.fill(*stream, Id(*id), *offset, *len, *value);
                }
                RemoteCommand::Copy {
                    stream,
                    src,
                    dst,
                    len,
                } => {
                    rec.copy(*stream, (Id(src.0), src.1), (Id(dst.0), dst.1), *len);
                }
                RemoteCommand::Free { stream, id } => {
                    rec.free(*stream, Id(*id));
                }
                RemoteCommand::Launch {
                    stream,
                    kernel,
                    config,
                    args,
                } => {
                    let module = self.module(kernel.module());
                    let c = config;
                    let spec = LaunchSpec {
                        module: ModuleHash([0; 32]),
                        kernel: kernel.name().to_owned(),
                        grid: [c.grid_dim.0, c.grid_dim.1, c.grid_dim.2],
                        block: [c.block_dim.0, c.block_dim.1, c.block_dim.2],
                        shared_mem: c.shared_mem_bytes,
                        args: args
                            .iter()
                            .map(|a| match a {
                                RemoteArg::Bytes(b) => KernelArg::Scalar(b.clone()),
                                RemoteArg::Buffer { id, offset } => KernelArg::Mem {
                                    buf: Id(*id),
                                    offset: *offset,
                                },
                            })
                            .collect(),
                    };
                    rec.launch_spec(*stream, &module, spec);
                }
                RemoteCommand::Record { stream, event } => {
                    rec.record_again(*stream, Id(*event));
                }
                RemoteCommand::Wait { stream, event } => {
                    rec.wait(*stream, Id(*event));
                }
            }
        }
        rec
    }

    /// Sends the queued frees alone, soon, unless a message takes them
    /// first.
    fn schedule_flush(&self) {
        if self.flush_scheduled.swap(true, Ordering::AcqRel) {
            return;
        }
        let Some(this) = self.me.upgrade() else {
            return;
        };
        self.runtime.spawn(async move {
            tokio::time::sleep(FREE_FLUSH_DELAY).await;
            this.flush_scheduled.store(false, Ordering::Release);
            let rec = this.translate(&Recording::new());
            if !rec.is_empty() {
                // A free that fails (the lease is gone) has nothing to free.
                let _ = rec.submit().await;
            }
        });
    }
}

/// The `cuda-async` error of a failed request or command.
pub fn to_cuda_error(e: Error) -> cuda_async::Error {
    use cuda_async::Error as E;
    match e {
        Error::LeaseExpired(m) => E::LeaseExpired(m),
        Error::CapacityExceeded(m) => E::CapacityExceeded(m),
        Error::Disconnected(m) => E::Disconnected(m),
        Error::Unauthorized(m) => E::Unauthorized(m),
        Error::LoadFailed(m) | Error::UnknownModule(m) => E::LoadFailed(m),
        Error::LaunchFailed(m) | Error::LeasePoisoned(m) => E::LaunchFailed(m),
        Error::NotFound(m) | Error::BadRequest(m) | Error::ReadFailed(m) => E::InvalidArgument(m),
        other => E::Other(Arc::new(other)),
    }
}

impl RemoteSession for LeaseSession {
    fn describe(&self) -> String {
        self.name.clone()
    }

    fn fresh_id(&self) -> u64 {
        self.session.fresh_id().0
    }

    fn submit(&self, mut recording: Recording, done: RemoteCompletion) {
        // With hop timings on: this side's share, printed when it is done.
        let mut hop = HopTimer::start("client-submit", Opcode::Batch, 0);
        let rec = self.translate(&recording);
        hops::mark(&mut hop, "translate");
        // The reads are received straight into their slots' storage, and
        // the writes' payloads go out as recorded (not copied again).
        let bufs: Vec<_> = recording.reads().iter().map(|s| s.buffer()).collect();
        let writes = recording.take_data();
        // Numbered now, in the order of these calls.
        let reply = rec.submit_into_with(bufs, Some(writes));
        hops::mark(&mut hop, "encode");
        // A task dropped unrun (its runtime shut down with the lease) fails
        // the submission instead of leaving it pending forever.
        let done = FailOnDrop(Some(done));
        let mut task = Box::pin(async move {
            let (done, mut hop) = (done, hop);
            let outcome = async {
                let (reply, bufs) = reply.await?;
                hops::mark(&mut hop, "reply");
                reply.ok()?;
                for (slot, buf) in recording.reads().iter().zip(bufs) {
                    slot.commit(buf)
                        .map_err(|e| Error::Protocol(e.to_string()))?;
                }
                Ok::<(), Error>(())
            };
            let r = outcome.await;
            done.finish(r.map_err(to_cuda_error));
            hops::mark(&mut hop, "complete");
        });
        // The first poll runs here, on the submitting thread: it opens the
        // QUIC stream and writes the message, so the request leaves without
        // first waking a runtime worker for it (a cross-thread wake-up on
        // the round trip's path). Waiting for the reply goes on as a task of
        // the session's runtime, which polls again with its own waker.
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        if task.as_mut().poll(&mut cx).is_pending() {
            self.runtime.spawn(task);
        }
    }

    fn free(&self, id: u64) {
        self.frees
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(id);
        // Rides on the next submission, or goes alone shortly.
        self.schedule_flush();
    }
}

/// A submission's completion, failed with `Disconnected` if dropped before
/// it was finished.
struct FailOnDrop(Option<RemoteCompletion>);

impl FailOnDrop {
    fn finish(mut self, r: cuda_async::Result<()>) {
        if let Some(done) = self.0.take() {
            match r {
                Ok(()) => done.complete(),
                Err(e) => done.fail(e),
            }
        }
    }
}

impl Drop for FailOnDrop {
    fn drop(&mut self) {
        if let Some(done) = self.0.take() {
            done.fail(cuda_async::Error::Disconnected(
                "the session's I/O stopped (its lease was dropped) before the reply".into(),
            ));
        }
    }
}

impl cuda_async::remote::AsRemoteSession for RemoteLease {
    fn remote_session(&self) -> Arc<dyn RemoteSession> {
        self.session.clone()
    }
}

/// A lease with its own I/O thread, for programs with no async runtime: a
/// plain `fn main` leases, records and waits without tokio in sight.
///
/// The lease is renewed in the background (as [`Lease`] does) and freed
/// when this is dropped or [`RemoteLease::free`]d.
///
/// ```no_run
/// # fn main() -> Result<(), cuda_lease::Error> {
/// use cuda_lease::client::{ClientConfig, Lease};
/// use cuda_lease::remote::RemoteLease;
/// let config = ClientConfig::from_pem_file("node-cert.pem".as_ref())?.token("...");
/// let builder = Lease::builder().min_vram(64 << 20).config(config);
/// let remote = RemoteLease::connect_blocking(builder, "10.0.0.5:7070".parse().unwrap())?;
/// let session = remote.session(); // a cuda_async::RemoteSession
/// # let _ = session;
/// remote.free()?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct RemoteLease {
    session: Arc<LeaseSession>,
    lease: Option<Lease>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl RemoteLease {
    /// Connects and leases as `builder` says, on a new I/O thread owned by
    /// the returned value.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] when called inside an async runtime (use
    /// [`LeaseBuilder::connect`](crate::client::LeaseBuilder::connect) and
    /// [`LeaseSession::current`] there), or when the I/O thread cannot
    /// start; otherwise as [`LeaseBuilder::connect`](crate::client::LeaseBuilder::connect).
    pub fn connect_blocking(
        builder: crate::client::LeaseBuilder,
        addr: std::net::SocketAddr,
    ) -> Result<Self, Error> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(Error::Config(
                "connect_blocking inside an async runtime: use LeaseBuilder::connect and \
                 LeaseSession::current"
                    .into(),
            ));
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("cuda-lease-io")
            .enable_all()
            .build()
            .map_err(|e| Error::Config(format!("starting the I/O thread: {e}")))?;
        let lease = runtime.block_on(builder.connect(addr))?;
        let session = LeaseSession::new(lease.session(), runtime.handle().clone());
        Ok(RemoteLease {
            session,
            lease: Some(lease),
            runtime: Some(runtime),
        })
    }

    /// The remote session of `cuda-async` on this lease.
    pub fn session(&self) -> Arc<LeaseSession> {
        self.session.clone()
    }

    /// The lease.
    pub fn lease(&self) -> &Lease {
        self.lease.as_ref().expect("present until dropped")
    }

    /// Frees the lease and waits for the node's answer.
    ///
    /// # Errors
    ///
    /// As [`Lease::free`].
    pub fn free(mut self) -> Result<(), Error> {
        let (Some(lease), Some(rt)) = (self.lease.take(), self.runtime.as_ref()) else {
            return Ok(());
        };
        rt.block_on(lease.free())
    }
}

impl Drop for RemoteLease {
    fn drop(&mut self) {
        let Some(rt) = self.runtime.take() else {
            return;
        };
        let lease = self.lease.take();
        let end = move || {
            if let Some(lease) = lease {
                // Best effort: the TTL frees it anyway.
                let _ = rt.block_on(lease.free());
            }
        };
        if tokio::runtime::Handle::try_current().is_ok() {
            // Never block an async caller's thread.
            std::thread::spawn(end);
        } else {
            end();
        }
    }
}
