use std::fmt;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex};

use cuda_core::{Error, Result};

use crate::context::{DoneEvent, ExecutionContext};
use crate::op::{impl_into_future, DeviceOp};

/// A once-cell that runs an initialiser from its stored input the first
/// time it is asked, and hands clones of the result to everyone after.
///
/// The state machine behind [`Shared`], separate from any GPU work so it can
/// be tested on its own: `Pending(input)` -> `Running` -> `Ready(value)` or
/// `Failed(error)`; a panicking initialiser leaves it `Poisoned` (and the
/// panic continues in the caller that ran it). The initialiser runs without
/// the cell's lock held: concurrent callers wait for it on a condition
/// variable (for as long as it takes to *enqueue* the shared op, not to run
/// it on the GPU), and a call from inside the initialiser (a shared op that
/// contains itself) gets an error instead of a deadlock.
pub struct SharedCell<I, T> {
    state: Mutex<CellState<I, T>>,
    done: Condvar,
}

enum CellState<I, T> {
    Pending(I),
    Running(std::thread::ThreadId),
    Ready(T),
    Failed(Error),
    Poisoned,
}

impl<I, T> fmt::Debug for SharedCell<I, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match &*self.state.lock().unwrap_or_else(|e| e.into_inner()) {
            CellState::Pending(_) => "Pending",
            CellState::Running(_) => "Running",
            CellState::Ready(_) => "Ready",
            CellState::Failed(_) => "Failed",
            CellState::Poisoned => "Poisoned",
        };
        f.debug_struct("SharedCell").field("state", &s).finish()
    }
}

impl<I, T: Clone> SharedCell<I, T> {
    /// A cell holding the initialiser's input.
    pub fn new(input: I) -> Self {
        SharedCell {
            state: Mutex::new(CellState::Pending(input)),
            done: Condvar::new(),
        }
    }

    /// Runs `init` on the input if nobody has yet, then returns a clone of
    /// the value; callers that arrive while another runs `init` wait for it.
    ///
    /// # Errors
    /// The initialiser's error (to every caller); [`Error::SharedPoisoned`]
    /// if it panicked; [`Error::InvalidArgument`] if called from inside its
    /// own initialiser.
    pub fn get_or_init(&self, init: impl FnOnce(I) -> Result<T>) -> Result<T> {
        let me = std::thread::current().id();
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match &*g {
                CellState::Ready(v) => return Ok(v.clone()),
                CellState::Failed(e) => return Err(e.clone()),
                CellState::Poisoned => return Err(Error::SharedPoisoned),
                CellState::Running(t) if *t == me => {
                    return Err(Error::InvalidArgument(
                        "a shared op was executed from inside its own execution".into(),
                    ))
                }
                CellState::Running(_) => {
                    g = self.done.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                CellState::Pending(_) => break,
            }
        }
        let CellState::Pending(input) = std::mem::replace(&mut *g, CellState::Running(me)) else {
            unreachable!("checked above")
        };
        drop(g);
        let outcome = catch_unwind(AssertUnwindSafe(|| init(input)));
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let result = match outcome {
            Ok(Ok(v)) => {
                *g = CellState::Ready(v.clone());
                Ok(v)
            }
            Ok(Err(e)) => {
                *g = CellState::Failed(e.clone());
                Err(e)
            }
            Err(panic) => {
                *g = CellState::Poisoned;
                drop(g);
                self.done.notify_all();
                resume_unwind(panic)
            }
        };
        drop(g);
        self.done.notify_all();
        result
    }
}

/// The producer's output, the event recorded after its work, and the
/// backend it ran on (its key and name).
type Produced<T> = (T, DoneEvent, (usize, String));

/// Op for [`DeviceOpExt::shared`](crate::DeviceOpExt::shared): cloneable,
/// runs once.
///
/// The first execution (on any clone, on any stream) enqueues the inner op
/// and records an event after it; every later execution makes its own
/// stream wait on that event and returns a clone of the output.
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct Shared<O: DeviceOp> {
    cell: Arc<SharedCell<O, Produced<<O as DeviceOp>::Output>>>,
}

impl<O: DeviceOp> Clone for Shared<O> {
    fn clone(&self) -> Self {
        Shared {
            cell: self.cell.clone(),
        }
    }
}

impl<O: DeviceOp> fmt::Debug for Shared<O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared").field("cell", &self.cell).finish()
    }
}

impl<O: DeviceOp> Shared<O>
where
    <O as DeviceOp>::Output: Clone,
{
    pub(crate) fn new(op: O) -> Self {
        Shared {
            cell: Arc::new(SharedCell::new(op)),
        }
    }
}

impl<O: DeviceOp> DeviceOp for Shared<O>
where
    <O as DeviceOp>::Output: Clone,
{
    type Output = <O as DeviceOp>::Output;

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<<O as DeviceOp>::Output> {
        let mut first = false;
        let (out, ev, home) = self.cell.get_or_init(|op| {
            first = true;
            // SAFETY: the producer's retained values go into this context,
            // whose executor keeps them until its stream passes the work;
            // consumers wait on the event recorded after it.
            let out = unsafe { op.execute(ctx) }?;
            let home = (ctx.backend_key(), ctx.describe());
            // Freed (remotely) when the last clone goes.
            let ev = ctx.record_done()?;
            Ok((out, ev, home))
        })?;
        if home.0 != ctx.backend_key() {
            // Its buffers live on the producer's backend, and nothing can
            // order this backend's work after it.
            return Err(Error::WrongHome {
                buffer: format!("{} (where the shared op ran)", home.1),
                context: ctx.describe(),
            });
        }
        if !first {
            // (Already finished locally: nothing to order after, and the
            // execution may enqueue nothing at all.)
            ctx.wait_done(&ev)?;
        }
        Ok(out)
    }
}

impl_into_future!(impl[O: DeviceOp] for Shared<O> where <O as DeviceOp>::Output: Clone);

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn runs_once_for_one_caller() {
        let runs = AtomicUsize::new(0);
        let cell = SharedCell::new(20);
        for _ in 0..3 {
            let v = cell
                .get_or_init(|x| {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok(x + 22)
                })
                .unwrap();
            assert_eq!(v, 42);
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    fn threads(n: usize) {
        let runs = Arc::new(AtomicUsize::new(0));
        let cell = Arc::new(SharedCell::new(String::from("v")));
        let hs: Vec<_> = (0..n)
            .map(|_| {
                let (runs, cell) = (runs.clone(), cell.clone());
                std::thread::spawn(move || {
                    cell.get_or_init(|s| {
                        runs.fetch_add(1, Ordering::SeqCst);
                        std::thread::yield_now();
                        Ok(Arc::new(s + "!"))
                    })
                    .unwrap()
                })
            })
            .collect();
        let outs: Vec<Arc<String>> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert!(outs.iter().all(|o| Arc::ptr_eq(o, &outs[0]) && **o == "v!"));
    }

    #[test]
    fn runs_once_from_2_threads() {
        threads(2);
    }

    #[test]
    fn runs_once_from_1000_threads() {
        threads(1000);
    }

    #[test]
    fn errors_reach_every_caller() {
        let cell: SharedCell<(), u8> = SharedCell::new(());
        let e1 = cell
            .get_or_init(|_| Err(Error::InvalidArgument("bad".into())))
            .unwrap_err();
        let e2 = cell.get_or_init(|_| Ok(1)).unwrap_err();
        assert!(e1.to_string().contains("bad") && e2.to_string().contains("bad"));
    }

    #[test]
    fn a_re_entrant_call_is_an_error_not_a_deadlock() {
        let cell: Arc<SharedCell<(), u8>> = Arc::new(SharedCell::new(()));
        let c = cell.clone();
        let inner = cell.get_or_init(move |_| {
            let e = c.get_or_init(|_| Ok(2)).unwrap_err();
            assert!(e.to_string().contains("inside its own execution"), "{e}");
            Ok(1)
        });
        assert_eq!(inner.unwrap(), 1);
    }

    #[test]
    fn waiters_see_the_value_of_a_slow_initialiser() {
        let cell: Arc<SharedCell<(), u8>> = Arc::new(SharedCell::new(()));
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let c = cell.clone();
        let runner = std::thread::spawn(move || {
            c.get_or_init(|_| {
                started_tx.send(()).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(50));
                Ok(9)
            })
        });
        started_rx.recv().unwrap();
        assert_eq!(
            cell.get_or_init(|_| Ok(0)).unwrap(),
            9,
            "the waiter must not run init"
        );
        assert_eq!(runner.join().unwrap().unwrap(), 9);
    }

    #[test]
    fn a_panicking_initialiser_poisons_the_cell() {
        let cell: Arc<SharedCell<(), u8>> = Arc::new(SharedCell::new(()));
        let c = cell.clone();
        let r = std::thread::spawn(move || c.get_or_init(|_| panic!("init failed"))).join();
        assert!(r.is_err(), "the panic propagates to the caller that ran it");
        assert!(matches!(
            cell.get_or_init(|_| Ok(1)),
            Err(Error::SharedPoisoned)
        ));
    }
}
