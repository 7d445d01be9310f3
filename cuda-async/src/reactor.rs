//! The completion reactor: futures complete when a per-stream sequence word,
//! written by the stream itself (`cuStreamWriteValue64` into pinned,
//! device-mapped host memory), reaches their number.
//!
//! Submissions on one stream complete in order, so one word per stream
//! serves them all: a submission takes the stream's next sequence number
//! and enqueues the write of that number after its work, under one lock, so
//! numbers reach the word in increasing order. `word >= n` then means the
//! stream passed submission `n`'s work (the write carries a system-scope
//! memory fence, so everything the work wrote is visible first).
//!
//! One reactor thread watches the words of all streams with pending
//! submissions. It spins briefly while work is in flight, then backs off to
//! short sleeps, and parks (no CPU) when nothing is in flight. A future also
//! checks its word itself when polled, so work that is already done
//! completes without a hop through the reactor. While parked in back-off,
//! the reactor asks pending streams for sticky errors (the word never moves
//! after a fault) and fails their futures.

use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

use cuda_core::cudarc::driver::{sys, CudaStream};
use cuda_core::{Device, Error, MappedHostMemory, Result};

use crate::completion::Completion;
use crate::handoff::{IdleGate, SeqQueue};

/// How a [`DeviceFuture`](crate::DeviceFuture) learns that its work is done.
///
/// Chosen per policy ([`crate::StreamPoolRoundRobin::with_completion`],
/// [`crate::SingleStream::with_completion`]); the process default comes
/// from the `CUDA_ASYNC_COMPLETION` environment variable (`callback`,
/// `reactor`, or `reactor-spin:MICROS`), else [`CompletionMode::DEFAULT`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompletionMode {
    /// One `cuLaunchHostFunc` callback per submission flips the flag and
    /// wakes the task. Always available. Throughput is capped by the
    /// driver's single callback thread per context.
    HostCallback,
    /// The stream writes a sequence number into pinned memory; the reactor
    /// thread (or the future's own poll) sees it.
    Reactor,
    /// As `Reactor`, and the first poll after submitting spins on the word
    /// for up to this long before returning `Pending`, but only when nothing
    /// else was in flight on the stream (trades up to this much
    /// executor-thread time for latency on short ops; never spins behind a
    /// queue).
    ReactorInlineSpin(Duration),
    /// A remote session's reply completes the future (the mode of every
    /// remote context; not a choice of local policies, which treat it as
    /// `HostCallback`).
    Reply,
}

impl CompletionMode {
    /// The default when nothing is configured: see the book's performance
    /// chapter for the measurements behind it.
    pub const DEFAULT: CompletionMode =
        CompletionMode::ReactorInlineSpin(Duration::from_micros(20));

    /// Parses `callback`, `reactor`, `reactor-spin:MICROS`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for anything else.
    ///
    /// # Examples
    ///
    /// ```
    /// use cuda_async::CompletionMode;
    /// use std::time::Duration;
    /// assert_eq!(CompletionMode::parse("callback")?, CompletionMode::HostCallback);
    /// assert_eq!(CompletionMode::parse("reactor-spin:20")?,
    ///            CompletionMode::ReactorInlineSpin(Duration::from_micros(20)));
    /// assert!(CompletionMode::parse("nope").is_err());
    /// # Ok::<(), cuda_async::Error>(())
    /// ```
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim() {
            "callback" | "host-callback" => Ok(CompletionMode::HostCallback),
            "reactor" => Ok(CompletionMode::Reactor),
            other => match other.strip_prefix("reactor-spin:").map(str::parse::<u64>) {
                Some(Ok(us)) => Ok(CompletionMode::ReactorInlineSpin(Duration::from_micros(us))),
                _ => Err(Error::InvalidArgument(format!(
                    "unknown completion mode `{other}` (expected callback, reactor or \
                     reactor-spin:MICROS)"
                ))),
            },
        }
    }

    /// The process default: `CUDA_ASYNC_COMPLETION` if set and valid, else
    /// [`CompletionMode::DEFAULT`].
    pub fn from_env() -> Self {
        static MODE: OnceLock<CompletionMode> = OnceLock::new();
        *MODE.get_or_init(|| match std::env::var("CUDA_ASYNC_COMPLETION") {
            Ok(s) => CompletionMode::parse(&s).unwrap_or_else(|e| {
                eprintln!("cuda-async: {e}; using {:?}", CompletionMode::DEFAULT);
                CompletionMode::DEFAULT
            }),
            Err(_) => CompletionMode::DEFAULT,
        })
    }

    pub(crate) fn uses_reactor(self) -> bool {
        !matches!(self, CompletionMode::HostCallback | CompletionMode::Reply)
    }
}

/// One stream's sequence word and its pending submissions.
pub(crate) struct StreamSlot {
    /// Host view of the pinned, device-mapped word.
    word: &'static AtomicU64,
    dptr: sys::CUdeviceptr,
    stream: Arc<CudaStream>,
    inner: Mutex<SeqQueue>,
    pending: AtomicUsize,
}

impl fmt::Debug for StreamSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamSlot")
            .field("word", &self.word.load(Ordering::Relaxed))
            .field("pending", &self.pending.load(Ordering::Relaxed))
            .finish()
    }
}

impl StreamSlot {
    /// A slot for `stream`, or `None` if the device cannot write 64-bit
    /// values from a stream or mapped memory cannot be had (then the
    /// callback is used).
    pub(crate) fn new(device: &Device, stream: &Arc<CudaStream>) -> Option<Arc<StreamSlot>> {
        let ok = device.can_use_64_bit_stream_mem_ops().unwrap_or(false);
        if !ok {
            return None;
        }
        let (word, dptr) = words::take(device).ok()?;
        let slot = Arc::new(StreamSlot {
            word,
            dptr,
            stream: stream.clone(),
            inner: Mutex::new(SeqQueue::default()),
            pending: AtomicUsize::new(0),
        });
        reactor().add(slot.clone());
        Some(slot)
    }

    /// The last sequence number the stream has passed.
    #[inline]
    pub(crate) fn reached(&self) -> u64 {
        self.word.load(Ordering::Acquire)
    }

    /// Enqueues the write of the next sequence number after the work already
    /// on the stream, and registers `completion` to be completed when the
    /// word reaches it. Returns the number.
    pub(crate) fn signal(&self, completion: &Arc<Completion>) -> Result<u64> {
        let mut q = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let seq = q.next_seq();
        // SAFETY: `dptr` is the device address of an 8-byte aligned word of
        // pinned memory mapped for the stream's device (portable to all its
        // contexts) that is never freed (`words`), and the host only reads
        // it atomically (`word`).
        unsafe { cuda_core::stream_write_value_64(&self.stream, self.dptr, seq) }?;
        q.push(seq, completion.clone());
        drop(q);
        self.pending.fetch_add(1, Ordering::AcqRel);
        let r = reactor();
        if r.gate.add() {
            r.thread.unpark();
        }
        Ok(seq)
    }

    /// Completes every waiter whose number the word has reached; returns
    /// how many.
    fn drain(&self) -> usize {
        if self.pending.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let reached = self.reached();
        let n = self
            .inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .complete_upto(reached);
        if n > 0 {
            self.pending.fetch_sub(n, Ordering::AcqRel);
        }
        n
    }

    /// Fails every waiter (the stream hit a sticky error).
    fn fail_all(&self, e: &Error) -> usize {
        let n = self
            .inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .fail_all(e);
        self.pending.fetch_sub(n, Ordering::AcqRel);
        n
    }
}

/// Pinned, device-mapped words, carved 64 bytes apart (one cache line each)
/// from 4 KiB pages that live for the rest of the process
/// ([`MappedHostMemory::leak`]: a stream may write a word at any later time).
mod words {
    use super::*;

    struct Page {
        mem: &'static MappedHostMemory,
        used: usize,
        ordinal: usize,
    }

    const PAGE: usize = 4096;
    const STRIDE: usize = 64;

    pub(super) fn take(device: &Device) -> Result<(&'static AtomicU64, sys::CUdeviceptr)> {
        static PAGES: Mutex<Vec<Page>> = Mutex::new(Vec::new());
        let mut pages = PAGES.lock().unwrap_or_else(|e| e.into_inner());
        let idx = match pages
            .iter()
            .position(|p| p.ordinal == device.ordinal() && p.used < PAGE)
        {
            Some(i) => i,
            None => {
                pages.push(Page {
                    mem: MappedHostMemory::zeroed(device, PAGE)?.leak(),
                    used: 0,
                    ordinal: device.ordinal(),
                });
                pages.len() - 1
            }
        };
        let p = &mut pages[idx];
        let off = p.used;
        p.used += STRIDE;
        // The host only accesses the word atomically; the GPU writes it
        // whole (`off` is 64-byte aligned inside the page).
        let word = p.mem.atomic_u64(off)?;
        Ok((word, p.mem.device_ptr() + off as u64))
    }
}

struct Reactor {
    slots: Mutex<Vec<Arc<StreamSlot>>>,
    generation: AtomicUsize,
    gate: IdleGate,
    thread: Thread,
}

fn reactor() -> &'static Reactor {
    static R: OnceLock<Reactor> = OnceLock::new();
    R.get_or_init(|| {
        let thread = std::thread::Builder::new()
            .name("cuda-async-reactor".into())
            .spawn(run)
            .expect("failed to spawn the cuda-async reactor thread")
            .thread()
            .clone();
        Reactor {
            slots: Mutex::new(Vec::new()),
            generation: AtomicUsize::new(0),
            gate: IdleGate::new(),
            thread,
        }
    })
}

impl Reactor {
    fn add(&self, slot: Arc<StreamSlot>) {
        self.slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(slot);
        self.generation.fetch_add(1, Ordering::AcqRel);
    }
}

/// Spins (PAUSE) this many rounds with nothing completing before backing off.
const SPIN_ROUNDS: u32 = 4_000;
/// Then yields this many rounds.
const YIELD_ROUNDS: u32 = 200;
/// Then sleeps this long per round.
const BACKOFF_SLEEP: Duration = Duration::from_micros(200);
/// How often pending streams are asked for sticky errors while backing off.
const FAULT_CHECK: Duration = Duration::from_millis(20);

fn run() {
    // Blocks until `reactor()`'s initialiser (which spawned us) is done.
    let r = reactor();
    let mut slots: Vec<Arc<StreamSlot>> = Vec::new();
    let mut seen_generation = usize::MAX;
    let mut idle: u32 = 0;
    let mut last_fault_check = Instant::now();
    loop {
        if !r.gate.busy() {
            // Nothing in flight: sleep until a submission unparks us.
            if r.gate.prepare_sleep() {
                std::thread::park();
            }
            r.gate.awake();
            idle = 0;
            continue;
        }
        let g = r.generation.load(Ordering::Acquire);
        if g != seen_generation {
            slots = r.slots.lock().unwrap_or_else(|e| e.into_inner()).clone();
            seen_generation = g;
        }
        let done: usize = slots.iter().map(|s| s.drain()).sum();
        if done > 0 {
            r.gate.finished(done);
            idle = 0;
            continue;
        }
        idle = idle.saturating_add(1);
        if idle < SPIN_ROUNDS {
            std::hint::spin_loop();
        } else if idle < SPIN_ROUNDS + YIELD_ROUNDS {
            std::thread::yield_now();
        } else {
            if last_fault_check.elapsed() >= FAULT_CHECK {
                last_fault_check = Instant::now();
                let failed: usize = slots.iter().map(check_fault).sum();
                if failed > 0 {
                    r.gate.finished(failed);
                    continue;
                }
            }
            // Work is in flight but slow: nap, or until a new submission
            // unparks us.
            r.gate.prepare_nap();
            std::thread::park_timeout(BACKOFF_SLEEP);
            r.gate.awake();
        }
    }
}

fn check_fault(s: &Arc<StreamSlot>) -> usize {
    if s.pending.load(Ordering::Acquire) == 0 {
        return 0;
    }
    let err = crate::completion::watchdog::poisoned()
        .or_else(|| crate::completion::watchdog::stream_fault(&s.stream));
    match err {
        Some(e) => s.fail_all(&e),
        None => 0,
    }
}

/// Slots of streams that other code made, cached by handle.
pub(crate) fn slot_for(device: &Device, stream: &Arc<CudaStream>) -> Option<Arc<StreamSlot>> {
    static FOREIGN: Mutex<Vec<(usize, Arc<StreamSlot>)>> = Mutex::new(Vec::new());
    let key = stream.cu_stream() as usize;
    let mut v = FOREIGN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, s)) = v
        .iter()
        .find(|(k, s)| *k == key && Arc::ptr_eq(&s.stream, stream))
    {
        return Some(s.clone());
    }
    let s = StreamSlot::new(device, stream)?;
    v.push((key, s.clone()));
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse() {
        assert_eq!(
            CompletionMode::parse("reactor").unwrap(),
            CompletionMode::Reactor
        );
        assert_eq!(
            CompletionMode::parse(" callback ").unwrap(),
            CompletionMode::HostCallback
        );
        assert!(CompletionMode::parse("reactor-spin:x").is_err());
        assert!(CompletionMode::Reactor.uses_reactor());
        assert!(!CompletionMode::HostCallback.uses_reactor());
    }
}
