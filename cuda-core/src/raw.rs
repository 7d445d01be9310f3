//! The few raw driver calls this crate makes itself, bypassing cudarc's
//! safe wrappers where those would skip work: cudarc's `bind_to_thread`
//! first returns (and clears) any error a destructor deferred in the
//! context, so a wait issued through it can silently not happen. Ordering
//! that memory safety depends on goes through here instead.

use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaStream, DriverError};

use crate::error::{Error, Result};

/// Makes `ctx` current on this thread (raw `cuCtxSetCurrent`).
pub(crate) fn set_current(ctx: &CudaContext) -> Result<()> {
    // SAFETY: `cu_ctx` is a live context handle (we hold its Arc owner).
    unsafe { sys::cuCtxSetCurrent(ctx.cu_ctx()) }
        .result()
        .map_err(|e| Error::driver("cuCtxSetCurrent", e))
}

/// Fails unless `stream` belongs to `ctx`, naming both devices: `what` is
/// the object used on the stream ("a buffer", "a graph").
pub(crate) fn check_same_context(what: &str, ctx: &CudaContext, stream: &CudaStream) -> Result<()> {
    if stream.context().cu_ctx() == ctx.cu_ctx() {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{what} of device {} used on a stream of device {}",
            ctx.ordinal(),
            stream.context().ordinal()
        )))
    }
}

/// An event without timing, owned; destroyed on drop (the driver releases
/// it once pending work that records or waits on it is done).
#[derive(Debug)]
pub(crate) struct RawEvent(sys::CUevent);

// SAFETY: a CUevent handle may be used from any thread (the driver API is
// thread-safe); we own it exclusively and destroy it once.
unsafe impl Send for RawEvent {}
// SAFETY: as above; shared references only pass the handle to thread-safe
// driver calls.
unsafe impl Sync for RawEvent {}

impl RawEvent {
    /// Creates an event in `ctx`.
    pub(crate) fn new(ctx: &CudaContext) -> Result<Self> {
        set_current(ctx)?;
        let mut ev = std::ptr::null_mut();
        // SAFETY: writes one handle through a valid pointer.
        unsafe { sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) }
            .result()
            .map_err(|e| Error::driver("cuEventCreate", e))?;
        Ok(RawEvent(ev))
    }

    /// Records the event after the work enqueued so far on `stream`.
    pub(crate) fn record(&self, stream: &CudaStream) -> Result<()> {
        // SAFETY: both handles are live (we own the event; the caller's Arc
        // keeps the stream).
        unsafe { sys::cuEventRecord(self.0, stream.cu_stream()) }
            .result()
            .map_err(|e| Error::driver("cuEventRecord", e))
    }

    /// Whether the work before the event's last record is done (`Ok(false)`:
    /// still running; `Err`: it will not complete normally).
    pub(crate) fn query(&self) -> std::result::Result<bool, DriverError> {
        // SAFETY: a query of a live event we own.
        match unsafe { sys::cuEventQuery(self.0) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            code => Err(DriverError(code)),
        }
    }

    /// [`RawEvent::query`] as the reclaimer's readiness.
    pub(crate) fn readiness(&self) -> crate::reclaim::Readiness {
        use crate::reclaim::Readiness;
        match self.query() {
            Ok(true) => Readiness::Ready,
            Ok(false) => Readiness::Pending,
            Err(_) => Readiness::Failed,
        }
    }

    /// Blocks the calling thread until the work before the last record is done.
    pub(crate) fn synchronize(&self) -> std::result::Result<(), DriverError> {
        // SAFETY: a wait on a live event we own.
        unsafe { sys::cuEventSynchronize(self.0) }.result()
    }

    /// Makes `stream` wait for the event's last record.
    pub(crate) fn wait_on(&self, stream: &CudaStream) -> std::result::Result<(), DriverError> {
        // SAFETY: both handles are live; flags 0 is the only defined value.
        unsafe { sys::cuStreamWaitEvent(stream.cu_stream(), self.0, 0) }.result()
    }
}

impl Drop for RawEvent {
    fn drop(&mut self) {
        // SAFETY: we own the handle and destroy it once; destroying an
        // event with pending records or waits is allowed (released later).
        unsafe { sys::cuEventDestroy_v2(self.0) };
    }
}

/// An event shared by the uses it marks (see [`crate::UseMark`]), taken
/// from its context's pool and given back to it, not destroyed, when the
/// last share is dropped; so marking an op's uses creates no event in the
/// steady state.
///
/// A shared event is recorded once ([`MarkEvent`]) and never again while
/// shared: a record would move every share's point in the stream.
#[derive(Debug)]
pub(crate) struct PooledEvent {
    ev: ManuallyDrop<RawEvent>,
    /// The event's context, retained while the event lives (so the pool
    /// never keeps or hands out an event of a destroyed context).
    ctx: Arc<CudaContext>,
}

/// An event shared by several uses.
pub(crate) type SharedEvent = Arc<MarkEvent>;

/// One clock of [`tick`]s (a cache line each, so that streams of other
/// shards do not share it).
#[repr(align(128))]
struct Clock(AtomicU64);

/// The clocks of [`tick`]: a stream's is one of these, chosen by its
/// handle's address.
static CLOCKS: [Clock; 64] = [const { Clock(AtomicU64::new(0)) }; 64];

/// The next tick of `stream`'s clock (`stream`: the handle's address). Two
/// ticks of one stream are ordered as they were taken, and what the
/// thread that took the smaller did before it happens before what the
/// thread that took the larger does after it: a use noted at one tick was
/// enqueued before an event whose record was enqueued after a later one.
pub(crate) fn tick(stream: usize) -> u64 {
    let shard = (stream as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 58;
    CLOCKS[shard as usize].0.fetch_add(1, Ordering::AcqRel)
}

/// [`MarkEvent::from`] of an event whose record is not enqueued yet.
const NOT_YET: u64 = u64::MAX;

/// The event of a [`crate::UseMark`]: recorded when it is made, or, for a
/// mark of a [`crate::MarkScope`], deferred: recorded on its stream when
/// the scope is flushed or the moment anything needs it
/// ([`MarkEvent::event`]), whichever comes first. A deferred record comes
/// after every use it marks (each was enqueued before the mark was used),
/// so waiting for it waits for them. Never recorded twice.
#[derive(Debug)]
pub(crate) struct MarkEvent {
    ev: PooledEvent,
    /// Where a deferred record goes (kept alive while the event lives).
    stream: Option<Arc<CudaStream>>,
    recorded: std::sync::OnceLock<Result<()>>,
    /// The [`tick`] of its stream taken just before its record was
    /// enqueued; [`NOT_YET`] before.
    from: AtomicU64,
    /// Set once a wait or query saw the record's work done: it stays done
    /// (the event is not recorded again while this lives), so later waits
    /// and queries make no driver call.
    done: AtomicBool,
}

impl MarkEvent {
    /// An event of `stream`'s context, recorded on it now.
    pub(crate) fn recorded(stream: &CudaStream) -> Result<MarkEvent> {
        let ev = PooledEvent::take(stream.context())?;
        let from = tick(stream.cu_stream() as usize);
        ev.record(stream)?;
        Ok(MarkEvent {
            ev,
            stream: None,
            recorded: std::sync::OnceLock::from(Ok(())),
            from: AtomicU64::new(from),
            done: AtomicBool::new(false),
        })
    }

    /// An event of `stream`'s context, to be recorded on it later.
    pub(crate) fn deferred(stream: &Arc<CudaStream>) -> Result<MarkEvent> {
        Ok(MarkEvent {
            ev: PooledEvent::take(stream.context())?,
            stream: Some(stream.clone()),
            recorded: std::sync::OnceLock::new(),
            from: AtomicU64::new(NOT_YET),
            done: AtomicBool::new(false),
        })
    }

    /// Whether the event's record is enqueued on its stream after the work
    /// of a use of that stream noted at its tick `noted` (taken after the
    /// use was enqueued), so that waiting for the event waits for that
    /// use: its record was enqueued after a later tick, or is still to
    /// come. Another thread may enqueue a use on the stream between an
    /// event's record and the notes of the uses it marks; that use is not
    /// followed.
    pub(crate) fn follows(&self, noted: u64) -> bool {
        // A read-modify-write: a record not yet begun is ordered after it,
        // so after the noted use.
        let from = self.from.fetch_add(0, Ordering::AcqRel);
        from == NOT_YET || from > noted
    }

    /// Whether the event is recorded (or its record failed).
    pub(crate) fn is_recorded(&self) -> bool {
        self.recorded.get().is_some()
    }

    /// The stream of a deferred event.
    pub(crate) fn deferred_on(&self) -> Option<&Arc<CudaStream>> {
        self.stream.as_ref()
    }

    /// The event, recorded (now, if it was deferred and is not yet). A
    /// failed record fails every call: nothing may take an event never
    /// recorded for one that was.
    pub(crate) fn event(&self) -> Result<&RawEvent> {
        let r = self.recorded.get_or_init(|| match &self.stream {
            Some(s) => {
                self.from
                    .swap(tick(s.cu_stream() as usize), Ordering::AcqRel);
                self.ev.record(s)
            }
            None => Err(Error::InvalidArgument("an event never recorded".into())),
        });
        r.clone().map(|()| &*self.ev)
    }

    /// Makes `stream` wait for the event.
    pub(crate) fn wait_on(&self, stream: &CudaStream) -> Result<()> {
        self.event()?
            .wait_on(stream)
            .map_err(|e| Error::driver("cuStreamWaitEvent", e))
    }

    /// Blocks until the work before the event is done.
    pub(crate) fn synchronize(&self) -> Result<()> {
        // A query first: waiting on an event already passed costs several
        // times what asking does (a blocking wait's setup in the driver).
        if self.query()? {
            return Ok(());
        }
        self.event()?
            .synchronize()
            .map_err(|e| Error::driver("cuEventSynchronize", e))?;
        self.done.store(true, Ordering::Release);
        Ok(())
    }

    /// Whether the work before the event is done (never waits; `Err`: it
    /// will not complete normally).
    pub(crate) fn query(&self) -> Result<bool> {
        if self.done.load(Ordering::Acquire) {
            return Ok(true);
        }
        let done = self
            .event()?
            .query()
            .map_err(|e| Error::driver("cuEventQuery", e))?;
        if done {
            self.done.store(true, Ordering::Release);
        }
        Ok(done)
    }

    /// [`MarkEvent::query`] as the reclaimer's readiness; failed when the
    /// event could not be recorded.
    pub(crate) fn readiness(&self) -> crate::reclaim::Readiness {
        use crate::reclaim::Readiness;
        match self.query() {
            Ok(true) => Readiness::Ready,
            Ok(false) => Readiness::Pending,
            Err(_) => Readiness::Failed,
        }
    }
}

impl std::ops::Deref for PooledEvent {
    type Target = RawEvent;

    fn deref(&self) -> &RawEvent {
        &self.ev
    }
}

impl PooledEvent {
    /// An event of `ctx`: a pooled one, or a new one when the pool has none.
    /// Its last record (if any) is of an earlier use that nothing refers to
    /// any more; the caller records it before sharing it.
    pub(crate) fn take(ctx: &Arc<CudaContext>) -> Result<PooledEvent> {
        let pooled = lock_pool().take(ctx.cu_ctx() as usize);
        let ev = match pooled {
            Some(ev) => ev,
            None => RawEvent::new(ctx)?,
        };
        Ok(PooledEvent {
            ev: ManuallyDrop::new(ev),
            ctx: ctx.clone(),
        })
    }
}

impl Drop for PooledEvent {
    fn drop(&mut self) {
        // SAFETY: taken once, here; `self.ev` is not used again.
        let ev = unsafe { ManuallyDrop::take(&mut self.ev) };
        // A pending record or wait is fine: the next owner's record
        // replaces the event's state, and waits enqueued before it keep the
        // state they saw.
        lock_pool().give(&self.ctx, ev);
    }
}

/// Most idle events a context's pool keeps; more are destroyed.
const POOL_MAX: usize = 1024;

/// Idle events by context: each entry holds its context, so its handle
/// cannot be reused by another context while the entry exists. An entry
/// whose context nothing else holds is emptied and dropped (its events
/// destroyed, then its context released) the next time the pool is used.
#[derive(Default)]
struct EventPool {
    /// (Events first: a dropped entry destroys them before it releases
    /// their context.)
    by_ctx: Vec<(Vec<RawEvent>, Arc<CudaContext>)>,
}

impl EventPool {
    fn take(&mut self, ctx: usize) -> Option<RawEvent> {
        self.by_ctx
            .iter_mut()
            .find(|(_, c)| c.cu_ctx() as usize == ctx)
            .and_then(|(evs, _)| evs.pop())
    }

    fn give(&mut self, ctx: &Arc<CudaContext>, ev: RawEvent) {
        let raw = ctx.cu_ctx() as usize;
        // Contexts only the pool still holds: no stream or event of theirs
        // is left (each holds its context), so their idle events go.
        self.by_ctx
            .retain(|(_, c)| c.cu_ctx() as usize == raw || Arc::strong_count(c) > 1);
        match self
            .by_ctx
            .iter_mut()
            .find(|(_, c)| c.cu_ctx() as usize == raw)
        {
            Some((evs, _)) if evs.len() < POOL_MAX => evs.push(ev),
            Some(_) => drop(ev),
            None => self.by_ctx.push((vec![ev], ctx.clone())),
        }
    }
}

fn lock_pool() -> std::sync::MutexGuard<'static, EventPool> {
    static POOL: Mutex<EventPool> = Mutex::new(EventPool { by_ctx: Vec::new() });
    POOL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The error of a stream whose work will not complete normally (a sticky
/// fault, a lost device, a destroyed stream); `None` while it is running or
/// done. A raw `cuStreamQuery`, so an error another call deferred in the
/// context cannot hide the answer.
pub fn stream_error(stream: &CudaStream) -> Option<Error> {
    if !crate::device::driver_present() || set_current(stream.context()).is_err() {
        return None;
    }
    // SAFETY: the caller's reference keeps the stream alive; the query has
    // no other precondition.
    match unsafe { sys::cuStreamQuery(stream.cu_stream()) } {
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_NOT_READY => None,
        code => Some(Error::driver("cuStreamQuery", DriverError(code))),
    }
}
