//! Atomics used by the lock-free handoffs, swapped for loom's under
//! `cfg(cuda_async_loom)` so the model checker can explore them.

#[cfg(all(cuda_async_loom, test))]
pub(crate) use loom::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
#[cfg(all(cuda_async_loom, test))]
pub(crate) use loom::sync::Arc;

#[cfg(not(all(cuda_async_loom, test)))]
pub(crate) use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
#[cfg(not(all(cuda_async_loom, test)))]
pub(crate) use std::sync::Arc;

#[cfg(all(cuda_async_loom, test))]
pub(crate) use loom::cell::UnsafeCell;

/// `UnsafeCell` with loom's closure-style accessors.
#[cfg(not(all(cuda_async_loom, test)))]
#[derive(Debug)]
pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(all(cuda_async_loom, test)))]
impl<T> UnsafeCell<T> {
    pub(crate) fn new(v: T) -> Self {
        UnsafeCell(std::cell::UnsafeCell::new(v))
    }
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}
