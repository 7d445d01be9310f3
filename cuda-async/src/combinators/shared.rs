use std::fmt;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use cuda_core::cudarc::driver::{sys, CudaEvent};
use cuda_core::{Error, Result};

use crate::context::ExecutionContext;
use crate::op::{impl_into_future, DeviceOp};

/// A once-cell that runs an initialiser from its stored input the first
/// time it is asked, and hands clones of the result to everyone after.
///
/// The state machine behind [`Shared`], separate from any GPU work so it can
/// be tested on its own: `Pending(input)` -> `Ready(value)` or
/// `Failed(error)`; a panicking initialiser leaves it `Poisoned` (and the
/// panic continues in the caller that ran it).
pub struct SharedCell<I, T> {
    state: Mutex<CellState<I, T>>,
}

enum CellState<I, T> {
    Pending(I),
    Running,
    Ready(T),
    Failed(Error),
    Poisoned,
}

impl<I, T> fmt::Debug for SharedCell<I, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match &*self.state.lock().unwrap_or_else(|e| e.into_inner()) {
            CellState::Pending(_) => "Pending",
            CellState::Running => "Running",
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
        }
    }

    /// Runs `init` on the input if nobody has yet (holding the cell's lock,
    /// so concurrent callers wait for it), then returns a clone of the value.
    ///
    /// # Errors
    /// The initialiser's error (to every caller), or
    /// [`Error::SharedPoisoned`] if it panicked.
    pub fn get_or_init(&self, init: impl FnOnce(I) -> Result<T>) -> Result<T> {
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match std::mem::replace(&mut *g, CellState::Running) {
            CellState::Pending(input) => match catch_unwind(AssertUnwindSafe(|| init(input))) {
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
                    resume_unwind(panic)
                }
            },
            CellState::Ready(v) => {
                let out = v.clone();
                *g = CellState::Ready(v);
                Ok(out)
            }
            CellState::Failed(e) => {
                *g = CellState::Failed(e.clone());
                Err(e)
            }
            // `Running` can only be seen by a re-entrant call from `init`.
            CellState::Poisoned | CellState::Running => {
                *g = CellState::Poisoned;
                Err(Error::SharedPoisoned)
            }
        }
    }
}

/// The producer's output and the event recorded after its work.
type Produced<T> = (T, Arc<CudaEvent>);

/// Op for [`DeviceOpExt::shared`](crate::DeviceOpExt::shared): cloneable,
/// runs once.
///
/// The first execution (on any clone, on any stream) enqueues the inner op
/// and records an event after it; every later execution makes its own
/// stream wait on that event and returns a clone of the output.
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct Shared<O: DeviceOp> {
    cell: Arc<SharedCell<O, Produced<O::Output>>>,
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
    O::Output: Clone,
{
    pub(crate) fn new(op: O) -> Self {
        Shared {
            cell: Arc::new(SharedCell::new(op)),
        }
    }
}

impl<O: DeviceOp> DeviceOp for Shared<O>
where
    O::Output: Clone,
{
    type Output = O::Output;

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<O::Output> {
        let mut first = false;
        let (out, ev) = self.cell.get_or_init(|op| {
            first = true;
            // SAFETY: the producer's retained values go into this context,
            // whose executor keeps them until its stream passes the work;
            // consumers wait on the event recorded after it.
            let out = unsafe { op.execute(ctx) }?;
            let ev = ctx
                .stream()
                .record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(|e| Error::driver("cuEventRecord", e))?;
            Ok((out, Arc::new(ev)))
        })?;
        if !first {
            ctx.stream()
                .wait(&ev)
                .map_err(|e| Error::driver("cuStreamWaitEvent", e))?;
        }
        Ok(out)
    }
}

impl_into_future!(impl[O: DeviceOp] for Shared<O> where O::Output: Clone);

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
