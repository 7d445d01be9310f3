//! [`BusyPoll`]: a QUIC endpoint on a thread of its own that keeps polling
//! the network while a request is in flight.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// How long the endpoint's thread waits, once its client is gone, for the
/// endpoint's tasks to end (the connections' close to go out).
const DRAIN: Duration = Duration::from_secs(3);

/// A busy poller: a QUIC endpoint on a thread of its own, which keeps
/// polling the network while a request is in flight instead of sleeping.
/// It is what [`ClientConfig::busy_poll`](crate::ClientConfig::busy_poll)
/// gives a client, and it serves any quinn endpoint the same way (the
/// bench's raw references use it, so that they are measured as the
/// clients are).
///
/// A sleeping runtime has to be woken twice per request: when the caller
/// writes a request (the connection's driver task runs on a parked thread)
/// and when the reply's packet arrives (a thread parked in the OS's poll).
/// Each wake is a thread's wake-up, which costs several microseconds on a
/// virtual machine. The endpoint's thread, while it is busy, yields in a
/// loop: between its tasks it polls the network with no timeout, so it
/// takes the request's write and the reply's packet as they come, at the
/// price of one busy core while requests are in flight.
///
/// # Examples
///
/// ```no_run
/// use std::time::Duration;
/// use cuda_lease::transport::BusyPoll;
/// use cuda_lease::TransportSettings;
///
/// # async fn demo(conn_to: std::net::SocketAddr) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// // Busy for up to 2 ms after each request begins.
/// let busy = BusyPoll::new(Some(Duration::from_millis(2)))?;
/// let endpoint = TransportSettings::default().endpoint_on(
///     "127.0.0.1:0".parse()?,
///     None,
///     busy.runtime(),
/// )?;
/// # let config: quinn::ClientConfig = unimplemented!();
/// let conn = endpoint.connect_with(config, conn_to, "localhost")?.await?;
/// // One exchange: written from this thread, its reply read on the
/// // endpoint's thread, which is kept awake until it is done.
/// let reply = busy
///     .run(async move {
///         let (mut send, mut recv) = conn.open_bi().await?;
///         send.write_all(b"ping").await?;
///         send.finish()?;
///         Ok::<_, Box<dyn std::error::Error + Send + Sync>>(recv.read_to_end(64).await?)
///     })
///     .await??;
/// # drop(reply);
/// # Ok(()) }
/// ```
///
/// Off ([`BusyPoll::new`] with `None`), it starts nothing. On, its thread
/// ends once this is dropped and the endpoint's tasks are through (up to
/// 3 s later).
#[derive(Debug)]
pub struct BusyPoll {
    /// `None`: off.
    on: Option<On>,
}

#[derive(Debug)]
struct On {
    state: Arc<State>,
    /// The endpoint thread's runtime.
    rt: tokio::runtime::Handle,
}

#[derive(Debug)]
struct State {
    /// How long the poller keeps going after the latest request began.
    limit: Duration,
    /// When the poller's clock starts (the requests' start times count
    /// from it).
    epoch: Instant,
    /// Requests in flight.
    in_flight: AtomicUsize,
    /// When the latest request began, in ns since `epoch`.
    latest: AtomicU64,
    /// The poller is waiting on `wake` (or about to).
    asleep: AtomicBool,
    /// The client is gone: the poller ends.
    closed: AtomicBool,
    /// Polls the poller made (each a yield): what tests watch. Counted in
    /// tests only: a write every turn would move this cache line, which
    /// every request's `enter` writes, back and forth between cores.
    #[cfg(test)]
    polls: AtomicU64,
    wake: Notify,
}

/// One request in flight ([`BusyPoll::enter`]); the poller keeps going
/// while any lives (up to its limit).
#[must_use = "the request counts as in flight while this lives"]
#[derive(Debug)]
pub struct InFlight(Option<Arc<State>>);

impl BusyPoll {
    /// Busy polling for up to `limit` after each request begins, on a
    /// thread started now; `None` or zero: off (nothing is started, and
    /// every method does what it would with no poller).
    ///
    /// # Errors
    /// If the thread or its runtime cannot be started.
    pub fn new(limit: Option<Duration>) -> std::io::Result<Self> {
        let Some(limit) = limit.filter(|d| !d.is_zero()) else {
            return Ok(Self { on: None });
        };
        let state = Arc::new(State {
            limit,
            epoch: Instant::now(),
            in_flight: AtomicUsize::new(0),
            latest: AtomicU64::new(0),
            asleep: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            #[cfg(test)]
            polls: AtomicU64::new(0),
            wake: Notify::new(),
        });
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = rt.handle().clone();
        let polled = Arc::clone(&state);
        std::thread::Builder::new()
            .name("cuda-lease-io".into())
            .spawn(move || {
                rt.block_on(poll(polled));
                // The endpoint's tasks end once its connections are closed
                // and drained; a bounded wait for them.
                let deadline = Instant::now() + DRAIN;
                while rt.metrics().num_alive_tasks() > 0 && Instant::now() < deadline {
                    rt.block_on(async { tokio::time::sleep(Duration::from_millis(1)).await });
                }
            })?;
        Ok(Self {
            on: Some(On { state, rt: handle }),
        })
    }

    /// The quinn runtime to make the endpoint with (see
    /// [`TransportSettings::endpoint_on`](super::TransportSettings::endpoint_on)):
    /// the busy thread's, or `None` (off) for the caller's.
    pub fn runtime(&self) -> Option<Arc<dyn quinn::Runtime>> {
        self.handle()
            .map(|rt| Arc::new(OnThread(rt)) as Arc<dyn quinn::Runtime>)
    }

    /// The busy thread's runtime, if on: where a task that awaits replies
    /// is woken with no sleeping thread to wake.
    pub fn handle(&self) -> Option<tokio::runtime::Handle> {
        self.on.as_ref().map(|on| on.rt.clone())
    }

    /// Counts a request in flight until the guard is dropped, and wakes
    /// the poller.
    pub fn enter(&self) -> InFlight {
        let Some(on) = &self.on else {
            return InFlight(None);
        };
        let state = &on.state;
        state.in_flight.fetch_add(1, Ordering::SeqCst);
        state.latest.fetch_max(state.now(), Ordering::SeqCst);
        if state.asleep.swap(false, Ordering::SeqCst) {
            state.wake.notify_one();
        }
        InFlight(Some(Arc::clone(state)))
    }

    /// Runs `task` (a whole exchange: a request written, then its reply
    /// read) as a request in flight, counted from this call, so that its
    /// reply is read on the busy thread: polled once on this thread (what it
    /// writes goes out with no thread woken), then finished as a task of the
    /// busy thread, which wakes the caller once with the result. Off, `task`
    /// is simply awaited.
    ///
    /// `task` is not moved again once this returns (boxed when on, mapped
    /// in place when off): a whole exchange's future is kilobytes.
    ///
    /// # Errors
    /// If the busy thread's runtime ended before `task` did (it does not
    /// while `self` lives: the thread ends only after `self` is dropped).
    ///
    /// # Panics
    /// If `task` panics (the panic is carried to the caller).
    pub fn run<T: Send + 'static>(
        &self,
        task: impl Future<Output = T> + Send + 'static,
    ) -> impl Future<Output = std::io::Result<T>> + Send + 'static {
        use futures::future::{Either, FutureExt};
        let Some(rt) = self.handle() else {
            return Either::Left(task.map(Ok));
        };
        let request = self.enter();
        let task: Pin<Box<dyn Future<Output = T> + Send>> = Box::pin(task.map(move |v| {
            drop(request);
            v
        }));
        Either::Right(async move {
            let task = match start_on(&rt, task) {
                Ok(v) => return Ok(v),
                Err(task) => task,
            };
            match task.await {
                Ok(v) => Ok(v),
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Err(_) => Err(std::io::Error::other("the endpoint's busy thread ended")),
            }
        })
    }

    /// Whether it is on (a thread was started).
    pub fn is_on(&self) -> bool {
        self.on.is_some()
    }

    /// How many times the poller has yielded so far (0 when off).
    #[cfg(test)]
    fn polls(&self) -> u64 {
        self.on
            .as_ref()
            .map_or(0, |on| on.state.polls.load(Ordering::SeqCst))
    }
}

impl Drop for BusyPoll {
    fn drop(&mut self) {
        if let Some(on) = &self.on {
            on.state.closed.store(true, Ordering::SeqCst);
            on.state.wake.notify_one();
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(state) = &self.0 {
            state.in_flight.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl State {
    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Whether the poller should keep going: a request is in flight and
    /// the latest began less than `limit` ago.
    fn busy(&self) -> bool {
        self.in_flight.load(Ordering::SeqCst) > 0
            && self
                .now()
                .saturating_sub(self.latest.load(Ordering::SeqCst))
                < u64::try_from(self.limit.as_nanos()).unwrap_or(u64::MAX)
    }
}

/// The poller: yields while [`State::busy`] (the runtime polls the network
/// with no timeout between yields), else waits to be woken by the next
/// request; ends once the client is gone.
async fn poll(state: Arc<State>) {
    loop {
        while state.busy() && !state.closed.load(Ordering::SeqCst) {
            #[cfg(test)]
            state.polls.fetch_add(1, Ordering::Relaxed);
            tokio::task::yield_now().await;
        }
        let woken = state.wake.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        state.asleep.store(true, Ordering::SeqCst);
        if state.closed.load(Ordering::SeqCst) {
            return;
        }
        // A request that began after the loop above looked, before
        // `asleep` was set, did not wake the poller: look again.
        if state.busy() {
            state.asleep.store(false, Ordering::SeqCst);
            continue;
        }
        woken.await;
    }
}

/// Polls `task` once on this thread (what it writes goes out with no
/// thread woken), then, if it is not done, spawns the rest on `rt`.
pub(crate) fn start_on<T: Send + 'static>(
    rt: &tokio::runtime::Handle,
    mut task: Pin<Box<dyn Future<Output = T> + Send>>,
) -> Result<T, tokio::task::JoinHandle<T>> {
    let first = task
        .as_mut()
        .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()));
    match first {
        std::task::Poll::Ready(v) => Ok(v),
        std::task::Poll::Pending => Err(rt.spawn(task)),
    }
}

/// quinn's tokio runtime on the busy thread's runtime: the endpoint's
/// tasks, socket and timers live there, whichever runtime calls it.
#[derive(Debug)]
struct OnThread(tokio::runtime::Handle);

impl quinn::Runtime for OnThread {
    fn new_timer(&self, at: Instant) -> Pin<Box<dyn quinn::AsyncTimer>> {
        let _on = self.0.enter();
        quinn::TokioRuntime.new_timer(at)
    }

    fn spawn(&self, future: Pin<Box<dyn Future<Output = ()> + Send>>) {
        drop(self.0.spawn(future));
    }

    fn wrap_udp_socket(
        &self,
        socket: std::net::UdpSocket,
    ) -> std::io::Result<Arc<dyn quinn::AsyncUdpSocket>> {
        let _on = self.0.enter();
        quinn::TokioRuntime.wrap_udp_socket(socket)
    }

    fn now(&self) -> Instant {
        let _on = self.0.enter();
        quinn::TokioRuntime.now()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Waits until `f` holds (looking every 100 us), failing after 30 s.
    async fn until(mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !f() {
            assert!(Instant::now() < deadline, "the condition never held");
            tokio::time::sleep(Duration::from_micros(100)).await;
        }
    }

    fn state(busy: &BusyPoll) -> Arc<State> {
        Arc::clone(&busy.on.as_ref().expect("on").state)
    }

    #[tokio::test]
    async fn polls_while_a_request_is_in_flight_and_sleeps_after() {
        let busy = BusyPoll::new(Some(Duration::from_secs(60))).expect("thread");
        let s = state(&busy);
        until(|| s.asleep.load(Ordering::SeqCst)).await;
        assert_eq!(busy.polls(), 0, "polled before a request");
        let request = busy.enter();
        // It polls while the request is in flight...
        until(|| busy.polls() > 100).await;
        drop(request);
        // ...and goes to sleep once none is: its count stops.
        until(|| s.asleep.load(Ordering::SeqCst)).await;
        let asleep_at = busy.polls();
        for _ in 0..1000 {
            tokio::task::yield_now().await;
        }
        assert_eq!(busy.polls(), asleep_at, "polled with nothing in flight");
        // A later request wakes it.
        let again = busy.enter();
        until(|| busy.polls() > asleep_at + 100).await;
        drop(again);
    }

    #[tokio::test]
    async fn stops_after_its_limit_with_a_request_still_in_flight() {
        let busy = BusyPoll::new(Some(Duration::from_millis(1))).expect("thread");
        let s = state(&busy);
        until(|| s.asleep.load(Ordering::SeqCst)).await;
        // The request wakes the poller (`enter` clears `asleep`, which
        // only the poller sets); the poller sleeps again once the limit
        // has passed, the request still in flight.
        let _request = busy.enter();
        until(|| s.asleep.load(Ordering::SeqCst)).await;
        let asleep_at = busy.polls();
        for _ in 0..1000 {
            tokio::task::yield_now().await;
        }
        assert_eq!(busy.polls(), asleep_at, "polled past its limit");
    }

    #[tokio::test]
    async fn its_thread_ends_when_its_client_is_gone() {
        let busy = BusyPoll::new(Some(Duration::from_secs(60))).expect("thread");
        let s = state(&busy);
        drop(busy.enter());
        drop(busy);
        // The thread's poller holds the other reference; it drops it as
        // it ends.
        until(|| Arc::strong_count(&s) == 1).await;
    }

    /// The name of the thread a task runs on, after a first pending poll.
    async fn thread_after_a_pending_poll() -> Option<String> {
        let mut first = true;
        std::future::poll_fn(|cx| {
            if std::mem::take(&mut first) {
                cx.waker().wake_by_ref();
                std::task::Poll::Pending
            } else {
                std::task::Poll::Ready(())
            }
        })
        .await;
        std::thread::current().name().map(str::to_owned)
    }

    #[tokio::test]
    async fn run_finishes_a_pending_task_on_the_busy_thread_counted_in_flight() {
        let busy = BusyPoll::new(Some(Duration::from_secs(60))).expect("thread");
        let s = state(&busy);
        let seen = Arc::clone(&s);
        let (name, in_flight) = busy
            .run(async move {
                let name = thread_after_a_pending_poll().await;
                (name, seen.in_flight.load(Ordering::SeqCst))
            })
            .await
            .expect("ran");
        assert_eq!(name.as_deref(), Some("cuda-lease-io"));
        assert_eq!(in_flight, 1, "the task did not count as in flight");
        until(|| s.in_flight.load(Ordering::SeqCst) == 0).await;
        // A task ready at its first poll finishes here.
        let here = std::thread::current().name().map(str::to_owned);
        let ready = busy
            .run(async { std::thread::current().name().map(str::to_owned) })
            .await
            .expect("ran");
        assert_eq!(ready, here);
    }

    #[tokio::test]
    async fn run_carries_a_panic_and_off_runs_in_place() {
        let busy = BusyPoll::new(Some(Duration::from_secs(60))).expect("thread");
        let caught = tokio::spawn(async move {
            busy.run(async {
                thread_after_a_pending_poll().await;
                panic!("the task's own panic");
            })
            .await
        })
        .await
        .expect_err("the panic was not carried");
        assert!(caught.is_panic());
        let off = BusyPoll::new(None).expect("off");
        let here = std::thread::current().name().map(str::to_owned);
        let name = off.run(thread_after_a_pending_poll()).await.expect("ran");
        assert_eq!(name, here);
    }

    #[test]
    fn off_counts_nothing() {
        let busy = BusyPoll::new(None).expect("off");
        assert!(busy.runtime().is_none());
        drop(busy.enter());
        assert_eq!(busy.polls(), 0);
        assert!(BusyPoll::new(Some(Duration::ZERO))
            .expect("off")
            .on
            .is_none());
    }
}
