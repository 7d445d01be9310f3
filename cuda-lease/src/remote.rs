//! A leased GPU as a backend of `cuda-async`: [`LeaseBackend`] implements
//! [`cuda_async::RemoteSession`] on a [`Session`] of the lease protocol
//! ([`proto::VERSION`](crate::proto::VERSION)).
//!
//! A [`Recording`] of `cuda-async` becomes one BATCH, encoded straight from
//! it (the bytes of the [`Recorder`](crate::client::Recorder)'s commands,
//! without building them): client-named ids and streams map one to one,
//! kernels travel as descriptions (the `cuda-core` module's source, named by
//! its SHA-256; the node compiles CUDA C), and the frees of dropped buffers
//! queued since the last message go first. The reply's reads land in the
//! recording's [`ReadSlot`](cuda_async::remote::ReadSlot)s, then the
//! submission's [`RemoteCompletion`] completes; a failure fails it with the
//! matching `cuda-async` error.
//!
//! # What a failed submission leaves behind
//!
//! Exactly what the commands that ran (`0..completed`, from the reply)
//! created and did not free; frees follow `cuda_async::remote::Ledger`. A
//! buffer or event whose creating command did not run (a module that does
//! not compile refuses the whole batch; a refused command stops it there) is
//! forgotten: dropping it sends nothing; a free that did not run is sent
//! again. So the next submission, and the lease's accounting on the node,
//! see the failed one stopped where the reply says.

use std::future::Future;
use std::sync::{Arc, Mutex, Weak};

use crate::client::{
    config_error, protocol_error, Error, ErrorKind, Lease, Message, ModuleSpec, Session, Submitted,
};
use crate::proto::{Command, LeaseId};
use crate::stamps::{stamp, Point};
use cuda_async::remote::{Ledger, Ran, Recording, RemoteCompletion, Sent};
use cuda_async::{RemoteErrorExt, RemoteSession};
use std::net::SocketAddr;

mod reading;
mod streamed;

use reading::Reading;

/// A lease as a remote session of `cuda-async`. Cheap to share
/// (`Arc<LeaseBackend>`); its I/O runs on the tokio runtime it was made on,
/// except that a client with [`ClientConfig::busy_poll`] awaits its
/// submissions' replies on its own endpoint thread.
///
/// [`ClientConfig::busy_poll`]: crate::client::ClientConfig::busy_poll
#[derive(Debug)]
pub struct LeaseBackend {
    me: Weak<LeaseBackend>,
    session: Session,
    runtime: tokio::runtime::Handle,
    /// Where a submission's reply is awaited: the client's endpoint
    /// thread if it busy-polls (the reply wakes the task on the thread
    /// that took its packet), else `runtime`.
    replies: tokio::runtime::Handle,
    /// Whether `replies` is the client's endpoint thread.
    busy_reader: bool,
    name: String,
    /// Queued frees and the ids they wait for or forget (see the module's docs).
    ledger: Arc<Ledger>,
    /// Buffers that streamed downloads are reading (see [`reading`](self::reading)).
    reading: Mutex<Reading>,
}

/// Most bytes a submission's future may take (see `submit_now`).
const TASK_BYTES_MAX: usize = 4096;

impl LeaseBackend {
    /// A session on `session`'s lease whose I/O runs on `runtime`.
    pub fn new(session: Session, runtime: tokio::runtime::Handle) -> Arc<Self> {
        let id = session.lease_id().to_string();
        let name = format!(
            "lease {}... on node {}",
            &id[..8],
            session.client().node_name()
        );
        let busy = session.client().io_runtime();
        let busy_reader = busy.is_some();
        let replies = busy.unwrap_or_else(|| runtime.clone());
        Arc::new_cyclic(|me| LeaseBackend {
            me: me.clone(),
            session,
            runtime,
            replies,
            busy_reader,
            name,
            ledger: Arc::new(Ledger::new()),
            reading: Mutex::new(Reading::default()),
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

    fn reading(&self) -> std::sync::MutexGuard<'_, Reading> {
        self.reading.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends the queued frees (when `numbered`), then `commands` (launching
    /// from `modules`), as one BATCH with `writes` as payloads, numbered in the
    /// lease's order (`numbered`) or outside it (see `Message::new`: only the
    /// allocations of fresh buffers); the reads land in `dests` (one per read
    /// command). Returns its number (0 outside; fixed now, whenever the future
    /// is polled) and the future that sends it, which settles what ran in the
    /// ledger before it is ready (for a dropped future, see `Settle`).
    fn send_as<D>(
        &self,
        numbered: bool,
        commands: &[Command<'static>],
        modules: &[ModuleSpec],
        writes: Vec<u8>,
        dests: Vec<D>,
    ) -> (
        u64,
        impl Future<Output = Result<(Submitted, Vec<D>), Error>> + Send + 'static,
    )
    where
        D: AsMut<[u8]> + Send + 'static,
    {
        // Frees taken and message numbered under one lock: see `Ledger::send`.
        let (sent, message) = self.ledger.send(!numbered, commands, |frees| {
            Message::new(
                &self.session.inner,
                numbered,
                modules,
                frees,
                commands,
                writes,
            )
        });
        self.sent_message(sent, message, dests)
    }

    /// The queued frees alone, as one numbered BATCH; `None` when none are
    /// queued (a message took them first: no empty batch is sent).
    fn send_queued_frees(&self) -> Option<impl Future<Output = ()> + Send + 'static> {
        let (sent, message) = self.ledger.send_frees(|frees| {
            Message::new(&self.session.inner, true, &[], frees, &[], Vec::new())
        })?;
        let reply = self.sent_message(sent, message, Vec::<Vec<u8>>::new()).1;
        // A free that fails (the lease is gone) has nothing to free.
        Some(async move {
            let _ = reply.await;
        })
    }

    /// Sends the queued frees alone, now, as a task of the session's runtime.
    fn spawn_queued_frees(&self) {
        if let Some(reply) = self.send_queued_frees() {
            self.runtime.spawn(reply);
        }
    }

    /// Sends `message` (whose ids are `sent`): its number, and its reply's
    /// future, which settles `sent` first (see [`LeaseBackend::send_as`]).
    fn sent_message<D>(
        &self,
        sent: Sent,
        message: Message,
        dests: Vec<D>,
    ) -> (
        u64,
        impl Future<Output = Result<(Submitted, Vec<D>), Error>> + Send + 'static,
    )
    where
        D: AsMut<[u8]> + Send + 'static,
    {
        let seq = message.seq();
        let mut settle = Settle {
            me: self.me.clone(),
            sent: Some(sent),
            polled: false,
        };
        // The exchange's future is made in place, not moved in: it is the
        // bulk of this one's size.
        let settled = async move {
            settle.polled = true;
            // The reads' slots are not needed: their bytes land in `dests`.
            let r = message.send_into(Some(Vec::new()), dests).await;
            settle.reply(r.as_ref().ok().map(|(s, _)| s));
            r
        };
        (seq, settled)
    }

    /// Settles what ran of `sent` (`None`: nothing the client knows of),
    /// and sends the queued frees when the ledger says they should go.
    fn settle(&self, sent: &Sent, reply: Option<&Submitted>) {
        let ran = reply.map(|s| Ran {
            completed: s.completed() as u32,
            refused: s.error().map(|e| e.index),
        });
        if self.ledger.settle(sent, ran) {
            self.spawn_queued_frees();
        }
    }

    /// Sends `recording` as one message (no transfer on the data path).
    fn submit_now(&self, mut recording: Recording, done: FailOnDrop) {
        stamp(Point::ClientSubmit);
        // Counted in flight from here, not from the write: a busy poller
        // asleep since the last reply wakes while the message is encoded,
        // and polls by the time the write needs it (the exchange counts
        // itself before this is dropped).
        let _early = self.session.client().busy().enter();
        // Reads land straight in their slots' storage; writes go out as recorded.
        let reads = recording.take_reads();
        let bufs: Vec<_> = reads.iter().map(|s| s.buffer()).collect();
        let writes = recording.take_data();
        // An awaiter on another thread than the reply's reader (outside a
        // tokio task: `block_on`'s thread, `sync()`'s; or any, when the
        // client's busy thread reads the reply) is woken as the reply
        // arrives, not only once it is read. A task of the runtime that
        // reads it is not: it runs after the reader on the same thread.
        let elsewhere = self.busy_reader || tokio::task::try_id().is_none();
        let nudge = match &done.done {
            Some(d) if elsewhere => Some(Arc::new(Nudge::new(d.clone()))),
            _ => None,
        };
        // Numbered now, in call order; it waits for the earlier streamed
        // downloads of buffers it uses (numbered and checked under one lock:
        // see `reading`).
        let (reply, waits) = {
            let reading = self.reading();
            let commands = recording.commands();
            let (_, reply) = self.send_as(true, commands, recording.modules(), writes, bufs);
            (reply, reading.conflicts(commands))
        };
        stamp(Point::ClientEncoded);
        // `reply` mapped in place: an `async` block awaiting it would hold
        // a second copy of it, moved whole with the task.
        let task = Box::pin(futures::FutureExt::map(reply, move |r| {
            let mut done = done;
            let r = r.and_then(|(reply, bufs)| {
                stamp(Point::ClientReplyRead);
                reply.ok()?;
                for (slot, buf) in reads.iter().zip(bufs) {
                    slot.commit(buf).map_err(protocol_error)?;
                }
                Ok::<(), Error>(())
            });
            // Freed before the completion, not after: an awaiter woken by
            // it builds its next submission at once.
            drop(reads);
            stamp(Point::ClientDone);
            done.finish(r);
        }));
        // Every submission moves it whole (into its box, then into a
        // task): nested `async` wrappers once made it 20 KiB.
        debug_assert!(
            std::mem::size_of_val(&*task) <= TASK_BYTES_MAX,
            "a submission's future grew to {} bytes",
            std::mem::size_of_val(&*task)
        );
        if !waits.is_empty() {
            self.replies.spawn(async move {
                reading::done(waits).await;
                task.await;
            });
        } else {
            // The first poll runs here, on the submitting thread: it opens
            // the QUIC stream and writes the message with no cross-thread
            // wake-up of a runtime worker. The reply is awaited as a task of
            // the runtime (of the client's endpoint thread, if it has one).
            // A task left running is detached: it finishes `done` itself.
            let task: std::pin::Pin<Box<dyn Future<Output = ()> + Send>> = match nudge {
                Some(nudge) => Box::pin(Nudging {
                    task,
                    nudge: Some(nudge),
                    polled: false,
                }),
                None => task,
            };
            drop(crate::transport::start_on(&self.replies, task));
        }
        // The rest of the recording (its commands and modules) is freed
        // here, on the thread that recorded it, once its message is encoded
        // or written: freed by the reply's thread, its memory would go to
        // that thread's allocator caches, and every submission recorded
        // here would allocate from the shared heap instead.
        drop(recording);
    }
}

/// A submission's reply task whose first wake-up after its first poll
/// (for a message written whole by then: its reply's first bytes) also
/// nudges the submission's completion ([`RemoteCompletion::nudge`]): a
/// thread parked on it starts waking while the reply is read, so its
/// wake-up overlaps the read instead of following it. Later wake-ups are
/// the task's alone. The task still reads the reply and completes the
/// submission whoever awaits it (or none).
struct Nudging {
    task: std::pin::Pin<Box<dyn Future<Output = ()> + Send>>,
    /// Until given.
    nudge: Option<Arc<Nudge>>,
    /// Whether the first poll (the submitting thread's: it writes the
    /// message) is done; wake-ups after it are the reply's.
    polled: bool,
}

/// The nudge of one submission, given once (by whichever wake-up comes first).
struct Nudge {
    done: RemoteCompletion,
    given: std::sync::atomic::AtomicBool,
}

impl Nudge {
    fn new(done: RemoteCompletion) -> Self {
        Nudge {
            done,
            given: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

/// The task's waker while the nudge is not given.
struct NudgeWaker {
    nudge: Arc<Nudge>,
    task: std::task::Waker,
}

impl std::task::Wake for NudgeWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // The awaiter's thread starts waking while the task reads.
        if !self
            .nudge
            .given
            .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            self.nudge.done.nudge();
        }
        self.task.wake_by_ref();
    }
}

impl Future for Nudging {
    type Output = ();

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        let this = &mut *self;
        if this
            .nudge
            .as_ref()
            .is_some_and(|n| n.given.load(std::sync::atomic::Ordering::Acquire))
        {
            this.nudge = None;
        }
        match &this.nudge {
            Some(nudge) if this.polled => {
                let waker = std::task::Waker::from(Arc::new(NudgeWaker {
                    nudge: nudge.clone(),
                    task: cx.waker().clone(),
                }));
                this.task
                    .as_mut()
                    .poll(&mut std::task::Context::from_waker(&waker))
            }
            _ => {
                this.polled = true;
                this.task.as_mut().poll(cx)
            }
        }
    }
}

impl RemoteSession for LeaseBackend {
    fn describe(&self) -> String {
        self.name.clone()
    }

    fn fresh_id(&self) -> u64 {
        self.session.fresh_id().0
    }

    fn submit(&self, recording: Recording, done: RemoteCompletion) {
        // A submission dropped unsent or unanswered (its runtime shut down
        // with the lease) fails instead of staying pending forever.
        let mut done = FailOnDrop {
            done: Some(done),
            lease: self.session.lease_id(),
            node: self.session.node_addr(),
        };
        if recording.is_empty() {
            // The ledger's call for the queued frees, alone.
            match self.send_queued_frees() {
                Some(reply) => {
                    self.runtime.spawn(async move {
                        reply.await;
                        done.finish(Ok(()));
                    });
                }
                None => done.finish(Ok(())),
            }
            return;
        }
        self.submit_or_stream(recording, done);
    }

    fn ledger(&self) -> Option<Arc<Ledger>> {
        Some(self.ledger.clone())
    }
}

/// A submission's completion, failed as [`ErrorKind::LeaseFreed`] if dropped
/// unfinished (the lease was freed or dropped, stopping the session's I/O).
#[derive(Debug)]
struct FailOnDrop {
    done: Option<RemoteCompletion>,
    lease: LeaseId,
    node: SocketAddr,
}

impl FailOnDrop {
    /// Completes the submission with `r` (an error names the lease and the
    /// node), unless it is completed already.
    fn finish(&mut self, r: Result<(), Error>) {
        if let Some(done) = self.done.take() {
            match r {
                Ok(()) => done.complete(),
                Err(e) => done.fail(cuda_async::Error::from_remote(
                    e.with_lease(self.lease).with_node(self.node),
                )),
            }
        }
    }
}

impl Drop for FailOnDrop {
    fn drop(&mut self) {
        self.finish(Err(Error::new(
            ErrorKind::LeaseFreed,
            "the lease was freed or dropped before the reply came",
        )));
    }
}

/// Settles a sent message's ids in the ledger exactly once: with its reply,
/// or when its future is dropped. Dropped before its first poll, nothing of
/// it ran (an empty batch fills its place in the order): its frees are asked
/// again and its creations never existed. Dropped after it was sent, its
/// reply is never read: the ledger forgets it (its creations are never freed).
struct Settle {
    me: Weak<LeaseBackend>,
    sent: Option<Sent>,
    polled: bool,
}

impl Settle {
    fn reply(&mut self, reply: Option<&Submitted>) {
        if let (Some(sent), Some(me)) = (self.sent.take(), self.me.upgrade()) {
            me.settle(&sent, reply);
        }
    }
}

impl Drop for Settle {
    fn drop(&mut self) {
        let Some(me) = self.me.upgrade() else {
            return;
        };
        match self.sent.take() {
            Some(sent) if self.polled => me.ledger.forget(sent),
            Some(sent) => me.settle(&sent, None),
            None => {}
        }
    }
}

impl cuda_async::remote::AsRemoteSession for BlockingLease {
    fn remote_session(&self) -> Arc<dyn RemoteSession> {
        self.session.clone()
    }
}

/// A lease with its own I/O thread, for programs with no async runtime (a
/// plain `fn main`). The lease is renewed in the background (as [`Lease`]
/// does) and freed when this is dropped or [`BlockingLease::free`]d.
///
/// ```no_run
/// # fn main() -> Result<(), cuda_lease::Error> {
/// use cuda_lease::client::{ClientConfig, Lease};
/// use cuda_lease::remote::BlockingLease;
/// let config = ClientConfig::from_pem_file("node-cert.pem".as_ref())?.token("...");
/// let builder = Lease::builder().min_vram(64 << 20).config(config);
/// let remote = BlockingLease::connect(builder, "10.0.0.5:7070".parse().unwrap())?;
/// let session = remote.session(); // a cuda_async::RemoteSession
/// # let _ = session;
/// remote.free()?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct BlockingLease {
    session: Arc<LeaseBackend>,
    lease: Option<Lease>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl BlockingLease {
    /// Connects and leases as `builder` says, on new I/O threads owned by the
    /// returned value (up to four, as many as the host has cores: a striped
    /// transfer's connections move data in parallel).
    ///
    /// Inside an async runtime it blocks the calling thread until the lease
    /// is granted; there [`LeaseBuilder::connect`](crate::client::LeaseBuilder::connect)
    /// and [`LeaseBackend::current`] do not block.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Config`] when the I/O thread cannot start; otherwise as
    /// [`LeaseBuilder::connect`](crate::client::LeaseBuilder::connect).
    pub fn connect(
        builder: crate::client::LeaseBuilder,
        addr: std::net::SocketAddr,
    ) -> Result<Self, Error> {
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(crate::client::DEFAULT_STRIPES);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("cuda-lease-io")
            .enable_all()
            .build()
            .map_err(|e| config_error(format!("starting the I/O thread: {e}")))?;
        let lease = match blocking(|| runtime.block_on(builder.connect(addr))) {
            Ok(lease) => lease,
            Err(e) => {
                // Dropping a runtime blocks, which an async caller's thread must not.
                runtime.shutdown_background();
                return Err(e);
            }
        };
        let session = LeaseBackend::new(lease.session(), runtime.handle().clone());
        Ok(BlockingLease {
            session,
            lease: Some(lease),
            runtime: Some(runtime),
        })
    }

    /// The remote session of `cuda-async` on this lease.
    pub fn session(&self) -> Arc<LeaseBackend> {
        self.session.clone()
    }

    /// The lease.
    pub fn lease(&self) -> &Lease {
        self.lease.as_ref().expect("present until dropped")
    }

    /// Frees the lease and waits for the node's answer (inside an async
    /// runtime, blocking the calling thread). Submissions still in flight
    /// fail as [`ErrorKind::LeaseFreed`].
    ///
    /// # Errors
    ///
    /// As [`Lease::free`].
    pub fn free(mut self) -> Result<(), Error> {
        let (Some(lease), Some(rt)) = (self.lease.take(), self.runtime.as_ref()) else {
            return Ok(());
        };
        blocking(|| rt.block_on(lease.free()))
    }
}

/// Runs `f`, which blocks on this lease's own I/O runtime: on this thread,
/// or on a scoped helper thread when this thread runs an async runtime
/// (where blocking on another runtime panics).
fn blocking<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    if tokio::runtime::Handle::try_current().is_err() {
        return f();
    }
    std::thread::scope(|s| match s.spawn(f).join() {
        Ok(v) => v,
        Err(panic) => std::panic::resume_unwind(panic),
    })
}

impl Drop for BlockingLease {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::task::{Context, Poll, Wake, Waker};

    /// Records, at each wake-up, whether the submission was still pending.
    struct Seen(Mutex<Vec<bool>>, RemoteCompletion);
    impl Wake for Seen {
        fn wake(self: Arc<Self>) {
            let pending = self.1.outcome().is_none();
            self.0.lock().unwrap().push(pending);
        }
    }

    #[test]
    fn a_parked_awaiter_is_woken_when_the_reply_arrives_then_when_it_is_read() {
        let done = RemoteCompletion::new();
        let seen = Arc::new(Seen(Mutex::new(Vec::new()), done.clone()));
        let awaiter = Waker::from(seen.clone());
        assert!(done
            .poll_outcome(&mut Context::from_waker(&awaiter))
            .is_pending());
        // The reply's task: the reply arrives on `rx`; reading it completes.
        let (tx, rx) = futures::channel::oneshot::channel::<()>();
        let d = done.clone();
        let task = Box::pin(async move {
            let _ = rx.await;
            d.complete();
        });
        let mut nudging = Box::pin(Nudging {
            task,
            nudge: Some(Arc::new(Nudge::new(done.clone()))),
            polled: false,
        });
        // The submitting thread's poll, then the runtime's.
        let noop = &mut Context::from_waker(Waker::noop());
        assert!(nudging.as_mut().poll(noop).is_pending());
        struct Flag(AtomicBool);
        impl Wake for Flag {
            fn wake(self: Arc<Self>) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let woken = Arc::new(Flag(AtomicBool::new(false)));
        let task_waker = Waker::from(woken.clone());
        assert!(nudging
            .as_mut()
            .poll(&mut Context::from_waker(&task_waker))
            .is_pending());
        assert!(seen.0.lock().unwrap().is_empty(), "nothing has arrived");
        tx.send(()).unwrap();
        // The awaiter was woken with the reply still unread, and the task too.
        assert_eq!(*seen.0.lock().unwrap(), [true]);
        assert!(woken.0.load(Ordering::SeqCst));
        // It polls, finds it pending and waits again; the task reads it.
        assert!(done
            .poll_outcome(&mut Context::from_waker(&awaiter))
            .is_pending());
        assert_eq!(
            nudging.as_mut().poll(&mut Context::from_waker(&task_waker)),
            Poll::Ready(())
        );
        assert_eq!(*seen.0.lock().unwrap(), [true, false]);
    }
}
