//! A submission's memory goes back on the thread that allocated it: the
//! recording is freed by its submitter once its message is written, not
//! by the task that reads the reply on the client's endpoint thread (freed
//! there, it fills that thread's allocator caches, and each submission
//! recorded on the first thread allocates from the shared heap instead).
//!
//! Its own test binary: it counts allocations with a global allocator.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use common::*;
use cuda_async::remote::{proto::LaunchArg, Id, Op, Recording, RemoteCompletion};
use cuda_async::{LaunchConfig, RemoteSession};
use cuda_lease::remote::LeaseBackend;

/// Allocations made on the tracked thread, by address (one per slot; a
/// collision forgets the older one, which only undercounts).
const SLOTS: usize = 1 << 16;
static ADDRS: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];
/// The tracked thread's tag, 0 when none is.
static TRACKED: AtomicU64 = AtomicU64::new(0);
/// Tracked allocations freed by another thread.
static FREED_ELSEWHERE: AtomicU64 = AtomicU64::new(0);
static NEXT_TAG: AtomicU64 = AtomicU64::new(1);
static ON: AtomicBool = AtomicBool::new(false);

thread_local! {
    static TAG: Cell<u64> = const { Cell::new(0) };
}

fn tag() -> u64 {
    TAG.with(|t| {
        if t.get() == 0 {
            t.set(NEXT_TAG.fetch_add(1, Ordering::Relaxed));
        }
        t.get()
    })
}

fn slot(p: *mut u8) -> &'static AtomicUsize {
    let a = p as usize;
    &ADDRS[(a >> 4 ^ a >> 20) % SLOTS]
}

struct Counting;

// SAFETY: every call is forwarded to `System` unchanged; the bookkeeping
// only reads and writes atomics (and a `const` thread-local with no
// destructor), and never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: forwarded as called.
        let p = unsafe { System.alloc(l) };
        if ON.load(Ordering::Relaxed) && !p.is_null() && tag() == TRACKED.load(Ordering::Relaxed) {
            slot(p).store(p as usize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        if ON.load(Ordering::Relaxed) {
            let s = slot(p);
            if s.load(Ordering::Relaxed) == p as usize {
                s.store(0, Ordering::Relaxed);
                if tag() != TRACKED.load(Ordering::Relaxed) {
                    FREED_ELSEWHERE.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        // SAFETY: forwarded as called.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const KERNELS: &str = r#"
extern "C" __global__ void axpy(float a, const float* x, float* y, unsigned n) {}
"#;

/// Tracked allocations freed by another thread than this one over `rounds`
/// submissions of `launches` launches each (awaited one by one).
async fn freed_elsewhere(session: &LeaseBackend, launches: usize, rounds: usize) -> u64 {
    let axpy = cuda_async::Module::cuda(KERNELS, &[])
        .unwrap()
        .kernel("axpy")
        .unwrap();
    let config = LaunchConfig::for_num_elems(64);
    let (x, y) = (session.fresh_id(), session.fresh_id());
    let mut rec = Recording::new();
    for id in [x, y] {
        rec.push(
            0,
            Op::Alloc {
                buf: Id(id),
                size: 256,
            },
        );
    }
    let done = RemoteCompletion::new();
    session.submit(rec, done.clone());
    done.finished().await.unwrap();
    let mem = |id| LaunchArg::Mem {
        buf: Id(id),
        offset: 0,
    };
    let before = FREED_ELSEWHERE.load(Ordering::Relaxed);
    for _ in 0..rounds {
        TRACKED.store(tag(), Ordering::Relaxed);
        ON.store(true, Ordering::Relaxed);
        let mut rec = Recording::new();
        for _ in 0..launches {
            let args = vec![
                LaunchArg::bytes(2f32.to_le_bytes()),
                mem(x),
                mem(y),
                LaunchArg::bytes(64u32.to_le_bytes()),
            ];
            rec.launch(0, &axpy, &config, args);
        }
        let done = RemoteCompletion::new();
        session.submit(rec, done.clone());
        done.finished().await.unwrap();
        ON.store(false, Ordering::Relaxed);
    }
    FREED_ELSEWHERE.load(Ordering::Relaxed) - before
}

// The test's body runs on its own thread, the reply's tasks on the
// runtime's workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recording_is_freed_where_it_was_made() {
    let fx = Fixture::memory(1 << 20).lease(1 << 16).start().await;
    let session = LeaseBackend::current(fx.lease().session());
    let rounds = 20;
    let one = freed_elsewhere(&session, 1, rounds).await;
    let forty = freed_elsewhere(&session, 40, rounds).await;
    // A launch's arguments are one allocation of the recording: 40 of them
    // freed by the reply's task would add 39 per round.
    assert!(
        forty < one + 5 * rounds as u64,
        "{forty} allocations freed elsewhere over {rounds} recordings of 40 \
         launches, {one} of 1 launch"
    );
    fx.free_and_shutdown().await;
}
