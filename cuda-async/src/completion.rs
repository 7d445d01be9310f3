//! The completion handoff between the GPU and a [`DeviceFuture`]:
//! a flag, an error slot and a waker, shared by the future and the one host
//! callback enqueued after its work.
//!
//! The host callback (on the driver's callback thread) only stores the flag
//! and wakes: no CUDA call, no allocation, no lock. Because the driver never
//! runs host functions after a sticky fault, a watchdog thread fails futures
//! whose stream reports such an error, so nothing hangs.
//!
//! [`DeviceFuture`]: crate::DeviceFuture

use std::sync::OnceLock;
use std::task::Waker;

use cuda_core::Error;

use crate::sync::{AtomicU8, Ordering};
use crate::waker::AtomicWaker;

const PENDING: u8 = 0;
const DONE: u8 = 1;
const FAILED: u8 = 2;

/// What a future checks when polled.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Status {
    Pending,
    Done,
    Failed,
}

/// How long a consumer woken by a nudge ([`Completion::nudge`]) spins for
/// the finish before it waits again: about the time a reply takes to be
/// read once its first bytes are in, so the finish finds the consumer
/// awake instead of waking it a second time.
pub(crate) const NUDGE_SPIN: std::time::Duration = std::time::Duration::from_micros(30);

/// Shared completion state of one submission.
#[derive(Debug)]
pub(crate) struct Completion {
    state: AtomicU8,
    /// 1 from a nudge until a consumer takes it ([`Completion::spin_if_nudged`]).
    nudged: AtomicU8,
    error: OnceLock<Error>,
    waker: AtomicWaker,
}

impl Completion {
    pub(crate) fn new() -> Self {
        Completion {
            state: AtomicU8::new(PENDING),
            nudged: AtomicU8::new(0),
            error: OnceLock::new(),
            waker: AtomicWaker::new(),
        }
    }

    /// Producer: the GPU passed the submission. Sets the flag, then wakes.
    pub(crate) fn complete(&self) {
        if self
            .state
            .compare_exchange(PENDING, DONE, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.waker.wake();
        }
    }

    /// Producer: the submission can never complete (sticky fault).
    pub(crate) fn fail(&self, error: Error) {
        let _ = self.error.set(error);
        if self
            .state
            .compare_exchange(PENDING, FAILED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.waker.wake();
        }
    }

    /// Producer: wakes the registered waker without finishing (it is taken
    /// out, as a finish takes it): a consumer parked on the submission runs
    /// again, spins a little for the finish ([`Completion::spin_if_nudged`]),
    /// and registers anew if it has not come. A spurious wake-up,
    /// never a lost one: a finish after it wakes whatever is registered then.
    pub(crate) fn nudge(&self) {
        self.nudged.store(1, Ordering::Release);
        self.waker.wake();
    }

    /// Consumer: if a nudge woke it and the submission is still pending,
    /// takes the nudge and spins (yielding its core) until it finishes or
    /// `budget` passes, at most once per nudge. Only a nudged consumer
    /// spins: it was woken because the finish is close, and a finish that
    /// finds it parked wakes it a second time.
    pub(crate) fn spin_if_nudged(&self, budget: std::time::Duration) {
        if self.is_finished()
            || self.nudged.load(Ordering::Relaxed) == 0
            || self.nudged.swap(0, Ordering::AcqRel) == 0
        {
            return;
        }
        let start = std::time::Instant::now();
        while !self.is_finished() && start.elapsed() < budget {
            // Yields, not a bare spin: on a machine with few cores the
            // thread finishing it may need this one's core.
            std::thread::yield_now();
        }
    }

    /// Consumer: registers `waker`, then re-checks the flag.
    pub(crate) fn poll_status(&self, waker: &Waker) -> Status {
        let s = self.status();
        if s != Status::Pending {
            return s;
        }
        self.waker.register(waker);
        self.status()
    }

    pub(crate) fn status(&self) -> Status {
        match self.state.load(Ordering::Acquire) {
            PENDING => Status::Pending,
            DONE => Status::Done,
            _ => Status::Failed,
        }
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.state.load(Ordering::Acquire) != PENDING
    }

    /// The error of a failed submission.
    pub(crate) fn error(&self) -> Error {
        self.error
            .get()
            .cloned()
            .unwrap_or_else(|| Error::InvalidArgument("submission failed without an error".into()))
    }
}

#[cfg(not(all(cuda_async_loom, test)))]
pub(crate) mod watchdog {
    //! Fails futures whose stream hit a sticky error (the driver never runs
    //! their host callbacks), and remembers that the process is poisoned.
    //!
    //! Submissions register `(completion, stream)`; the watchdog thread wakes
    //! every `TICK` while any is registered, forgets finished ones, and asks
    //! each stream with pending work for its status (`cuStreamQuery`). It
    //! sleeps (parked, no CPU) while nothing is registered.

    use std::sync::{Arc, Mutex, OnceLock};
    use std::thread::Thread;
    use std::time::Duration;

    use cuda_core::cudarc::driver::{sys, CudaStream};
    use cuda_core::Error;

    use super::Completion;
    use crate::sync::{AtomicUsize, Ordering};

    const TICK: Duration = Duration::from_millis(20);
    const SHARDS: usize = 16;

    struct Entry {
        completion: Arc<Completion>,
        stream: Arc<CudaStream>,
    }

    /// One shard: a slab of entries with a generation per slot, so a key
    /// held by a future never removes a later entry that reused its slot.
    #[derive(Default)]
    struct Shard {
        slots: Vec<(u32, Option<Entry>)>,
        free: Vec<u32>,
    }

    impl Shard {
        fn insert(&mut self, e: Entry) -> (u32, u32) {
            match self.free.pop() {
                Some(i) => {
                    let slot = &mut self.slots[i as usize];
                    slot.0 = slot.0.wrapping_add(1);
                    slot.1 = Some(e);
                    (i, slot.0)
                }
                None => {
                    self.slots.push((0, Some(e)));
                    ((self.slots.len() - 1) as u32, 0)
                }
            }
        }

        fn remove(&mut self, i: u32, generation: u32) -> Option<Entry> {
            let slot = self.slots.get_mut(i as usize)?;
            if slot.0 != generation || slot.1.is_none() {
                return None;
            }
            self.free.push(i);
            slot.1.take()
        }
    }

    /// Identifies one registration; the future removes it when it finishes.
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct WatchKey {
        shard: u16,
        index: u32,
        generation: u32,
    }

    struct Registry {
        shards: Vec<Mutex<Shard>>,
        count: AtomicUsize,
        thread: Thread,
    }

    static POISON: OnceLock<Error> = OnceLock::new();

    /// The sticky error, once any stream of the process reported one.
    pub(crate) fn poisoned() -> Option<Error> {
        POISON.get().cloned()
    }

    /// Records a sticky error seen anywhere (a failed sync, say).
    pub(crate) fn note_error(e: &Error) {
        if e.is_sticky() {
            let _ = POISON.set(e.clone());
        }
    }

    fn registry() -> &'static Registry {
        static REG: OnceLock<Registry> = OnceLock::new();
        REG.get_or_init(|| {
            let thread = std::thread::Builder::new()
                .name("cuda-async-watchdog".into())
                .spawn(run)
                .expect("failed to spawn the cuda-async watchdog thread")
                .thread()
                .clone();
            Registry {
                shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
                count: AtomicUsize::new(0),
                thread,
            }
        })
    }

    fn shard_index() -> usize {
        use std::cell::Cell;
        thread_local!(static IDX: Cell<usize> = const { Cell::new(usize::MAX) });
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        IDX.with(|i| {
            if i.get() == usize::MAX {
                i.set(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % SHARDS);
            }
            i.get()
        })
    }

    /// Watches `completion` until [`unwatch`] (or until it finishes, for a
    /// future that was forgotten).
    pub(crate) fn watch(completion: &Arc<Completion>, stream: &Arc<CudaStream>) -> WatchKey {
        let reg = registry();
        let shard = shard_index();
        let (index, generation) = reg.shards[shard]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(Entry {
                completion: completion.clone(),
                stream: stream.clone(),
            });
        if reg.count.fetch_add(1, Ordering::AcqRel) == 0 {
            reg.thread.unpark();
        }
        WatchKey {
            shard: shard as u16,
            index,
            generation,
        }
    }

    /// Removes a registration (the future finished or was dropped). The
    /// entry's references are dropped on the calling thread.
    pub(crate) fn unwatch(key: WatchKey) {
        let reg = registry();
        let removed = reg.shards[key.shard as usize]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key.index, key.generation);
        if removed.is_some() {
            reg.count.fetch_sub(1, Ordering::AcqRel);
        }
    }

    fn run() {
        // Blocks until `registry()`'s initialiser (which spawned us) is done.
        let reg = registry();
        loop {
            if reg.count.load(Ordering::Acquire) == 0 {
                // `watch` unparks us when the count leaves zero; an unpark
                // that comes first makes this park return at once.
                std::thread::park();
                continue;
            }
            std::thread::sleep(TICK);
            tick(reg);
        }
    }

    fn tick(reg: &Registry) {
        // Distinct streams with pending work (one Arc clone per stream, not
        // per entry); finished entries of forgotten futures are dropped.
        let mut streams: Vec<Arc<CudaStream>> = Vec::new();
        let mut removed = 0usize;
        for shard in &reg.shards {
            let mut g = shard.lock().unwrap_or_else(|e| e.into_inner());
            let Shard { slots, free } = &mut *g;
            for (i, slot) in slots.iter_mut().enumerate() {
                let finished = match &slot.1 {
                    Some(e) if e.completion.is_finished() => true,
                    Some(e) => {
                        if !streams
                            .iter()
                            .any(|s| s.cu_stream() == e.stream.cu_stream())
                        {
                            streams.push(e.stream.clone());
                        }
                        false
                    }
                    None => false,
                };
                if finished {
                    slot.1 = None;
                    free.push(i as u32);
                    removed += 1;
                }
            }
        }
        if removed > 0 {
            reg.count.fetch_sub(removed, Ordering::AcqRel);
        }
        let failed: Vec<(sys::CUstream, Error)> = streams
            .iter()
            .filter_map(|s| {
                stream_fault(s)
                    .or_else(poisoned)
                    .map(|e| (s.cu_stream(), e))
            })
            .collect();
        if failed.is_empty() {
            return;
        }
        for shard in &reg.shards {
            let g = shard.lock().unwrap_or_else(|e| e.into_inner());
            for e in g.slots.iter().filter_map(|(_, e)| e.as_ref()) {
                if let Some((_, err)) = failed.iter().find(|(s, _)| *s == e.stream.cu_stream()) {
                    e.completion.fail(err.clone());
                }
            }
        }
    }

    /// The error of a stream whose work will not complete normally, noted
    /// (sticky codes poison the process). Shared with the reactor.
    pub(crate) fn stream_fault(s: &CudaStream) -> Option<Error> {
        let e = cuda_core::stream_error(s)?;
        note_error(&e);
        Some(e)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// Slab logic without streams: a stand-in entry type would need a
        /// live stream, so this checks the generations through `Shard`'s
        /// slot bookkeeping with entries that are inserted and removed.
        #[test]
        fn a_stale_key_never_removes_a_newer_entry() {
            let mut sh = Shard::default();
            // Slots are reused with a new generation.
            sh.slots.push((0, None));
            sh.free.push(0);
            sh.slots[0].0 = 7;
            assert!(
                sh.remove(0, 7).is_none(),
                "an empty slot has nothing to remove"
            );
            assert!(sh.remove(0, 6).is_none());
            assert!(sh.remove(5, 0).is_none(), "out of range is a no-op");
        }
    }
}

#[cfg(all(test, not(cuda_async_loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;
    use std::task::Wake;

    struct Counter(AtomicUsize);
    impl Wake for Counter {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn pending_until_completed_then_woken_once() {
        let c = Completion::new();
        let count = Arc::new(Counter(AtomicUsize::new(0)));
        let w = Waker::from(count.clone());
        assert_eq!(c.poll_status(&w), Status::Pending);
        c.complete();
        c.complete();
        assert_eq!(count.0.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(c.poll_status(&w), Status::Done);
    }

    #[test]
    fn fail_carries_the_error_and_first_outcome_wins() {
        let c = Completion::new();
        c.fail(Error::InvalidArgument("x".into()));
        c.complete();
        assert_eq!(c.status(), Status::Failed);
        assert!(c.error().to_string().contains("x"));
        let d = Completion::new();
        d.complete();
        d.fail(Error::InvalidArgument("late".into()));
        assert_eq!(d.status(), Status::Done);
    }

    /// A consumer woken by a nudge finds the finish that follows it without
    /// a second wake-up; one not nudged returns at once.
    #[test]
    fn a_nudged_consumer_spins_until_the_finish() {
        let c = Arc::new(Completion::new());
        let start = std::time::Instant::now();
        c.spin_if_nudged(std::time::Duration::from_secs(30));
        assert!(start.elapsed() < std::time::Duration::from_secs(10));
        assert_eq!(c.status(), Status::Pending);
        let count = Arc::new(Counter(AtomicUsize::new(0)));
        let w = Waker::from(count.clone());
        assert_eq!(c.poll_status(&w), Status::Pending);
        c.nudge();
        assert_eq!(count.0.load(std::sync::atomic::Ordering::SeqCst), 1);
        let producer = {
            let c = c.clone();
            std::thread::spawn(move || {
                // Finishes once the consumer has taken the nudge (it spins).
                while c.nudged.load(Ordering::Acquire) != 0 {
                    std::thread::yield_now();
                }
                c.complete();
            })
        };
        // A budget no loaded machine runs out: the finish decides.
        c.spin_if_nudged(std::time::Duration::from_secs(60));
        assert_eq!(c.status(), Status::Done, "returned before the finish");
        producer.join().unwrap();
        // The nudge was taken: a later call does not spin.
        let d = Completion::new();
        d.spin_if_nudged(std::time::Duration::from_secs(30));
        assert_eq!(d.status(), Status::Pending);
    }

    #[test]
    fn completion_from_another_thread_wakes_the_registered_waker() {
        for _ in 0..1000 {
            let c = Arc::new(Completion::new());
            let count = Arc::new(Counter(AtomicUsize::new(0)));
            let w = Waker::from(count.clone());
            let c2 = c.clone();
            let t = std::thread::spawn(move || c2.complete());
            let first = c.poll_status(&w);
            t.join().unwrap();
            // Either the poll saw completion, or the producer woke us.
            let woken = count.0.load(std::sync::atomic::Ordering::SeqCst);
            assert!(first == Status::Done || woken == 1, "lost wake-up");
            assert_eq!(c.status(), Status::Done);
        }
    }
}
