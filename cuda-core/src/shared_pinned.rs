//! Pinned host memory shared by the host and the GPU work that replays:
//! the buffer a CUDA graph uploads from, or downloads into, at each replay.
//!
//! A [`PinnedBuffer`] is protected by ownership: a copy takes it and gives
//! it back, so no host reference is alive while the GPU uses it. A graph
//! breaks that: it replays its copies whenever it is launched, through a
//! shared reference. A [`SharedPinnedBuffer`] is the form a graph can
//! hold. Host access goes through closures ([`SharedPinnedBuffer::read`],
//! [`SharedPinnedBuffer::write`]) that hold the buffer's gate, after
//! waiting for the GPU uses they conflict with; every GPU use, each graph
//! replay included, is enqueued holding the same gate. So no GPU use starts
//! while a closure runs, and a closure starts only once the GPU uses it
//! conflicts with are done.

use std::cell::UnsafeCell;
use std::fmt;
use std::sync::Arc;

use cudarc::driver::{CudaStream, DeviceRepr};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::pinned::PinnedBuffer;
use crate::tracking::{is_capture_stream, keep_with_graph, log_use, UseRecord, WHOLE};

/// Pinned host memory that the host and graphs share: clone the handle into
/// the ops a graph captures (`copy_h2d` from it, `copy_d2h` into it) and
/// the copies act at each replay, reading or writing what the host left
/// there. Host access is through closures that wait for the GPU first;
/// the memory lives until the last handle and the last graph that uses it
/// are gone (and its last GPU use is done).
///
/// A closure must not launch a graph that uses the same buffer (the launch
/// waits for the closure: a deadlock).
///
/// # Examples
///
/// ```no_run
/// use cuda_core::{Device, PinnedBuffer};
/// let dev = Device::new(0)?;
/// let input = PinnedBuffer::filled(&dev, 4, 0.0f32)?.into_shared();
/// input.write(|v| v.copy_from_slice(&[1.0, 2.0, 3.0, 4.0]))?;
/// assert_eq!(input.read(|v| v[3])?, 4.0);
/// # Ok::<(), cuda_core::Error>(())
/// ```
pub struct SharedPinnedBuffer<T> {
    inner: Arc<Inner<T>>,
}

struct Inner<T> {
    /// Reached only while holding `uses`' gate.
    buf: UnsafeCell<PinnedBuffer<T>>,
    /// The GPU uses (eager and captured) and the gate.
    uses: Arc<UseRecord>,
    len: usize,
}

// SAFETY: the buffer inside is only reached while holding the gate (one
// thread at a time), and moving or sharing it moves or shares `T`s.
unsafe impl<T: Send> Send for Inner<T> {}
// SAFETY: as above: `&Inner` gives access to `T`s only under the gate.
unsafe impl<T: Send> Sync for Inner<T> {}

impl<T> Clone for SharedPinnedBuffer<T> {
    fn clone(&self) -> Self {
        SharedPinnedBuffer {
            inner: self.inner.clone(),
        }
    }
}

impl<T> fmt::Debug for SharedPinnedBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedPinnedBuffer")
            .field("type", &std::any::type_name::<T>())
            .field("len", &self.inner.len)
            .finish()
    }
}

impl<T: Send + 'static> PinnedBuffer<T> {
    /// Makes the buffer shareable with graphs (see [`SharedPinnedBuffer`]).
    pub fn into_shared(self) -> SharedPinnedBuffer<T> {
        SharedPinnedBuffer::from(self)
    }
}

impl<T: Send + 'static> From<PinnedBuffer<T>> for SharedPinnedBuffer<T> {
    fn from(buf: PinnedBuffer<T>) -> Self {
        let len = buf.len();
        SharedPinnedBuffer {
            inner: Arc::new(Inner {
                buf: UnsafeCell::new(buf),
                uses: Arc::new(UseRecord::with_gate()),
                len,
            }),
        }
    }
}

impl<T: DeviceRepr + Copy + Send + 'static> SharedPinnedBuffer<T> {
    /// Allocates `len` shared pinned elements, filled with `value`.
    ///
    /// # Errors
    /// As [`PinnedBuffer::filled`].
    pub fn filled(device: &Device, len: usize, value: T) -> Result<Self> {
        Ok(PinnedBuffer::filled(device, len, value)?.into_shared())
    }
}

impl<T: Send + 'static> SharedPinnedBuffer<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// Runs `f` on the contents once the GPU writes into them enqueued so
    /// far are done (a graph replay that downloads into the buffer, say);
    /// no GPU use starts while `f` runs.
    ///
    /// # Errors
    /// The sticky error, if the GPU faulted before finishing a use; an
    /// error if a GPU use could not be recorded.
    pub fn read<R>(&self, f: impl FnOnce(&[T]) -> R) -> Result<R> {
        let _gate = self.inner.uses.hold();
        self.inner.uses.wait_host(false)?;
        // SAFETY: the gate is held: no other host access, and no GPU use is
        // enqueued, until it is released.
        let buf = unsafe { &*self.inner.buf.get() };
        Ok(f(buf.as_slice()?))
    }

    /// Runs `f` on the contents, mutably, once every GPU use enqueued so
    /// far is done; no GPU use starts while `f` runs.
    ///
    /// # Errors
    /// As [`SharedPinnedBuffer::read`].
    pub fn write<R>(&self, f: impl FnOnce(&mut [T]) -> R) -> Result<R> {
        let _gate = self.inner.uses.hold();
        self.inner.uses.wait_host(true)?;
        // SAFETY: as in `read`; the gate makes this the only reference.
        let buf = unsafe { &mut *self.inner.buf.get() };
        Ok(f(buf.as_mut_slice()?))
    }

    /// Copies the contents into a `Vec` (waiting as `read` does).
    ///
    /// # Errors
    /// As [`SharedPinnedBuffer::read`].
    pub fn to_vec(&self) -> Result<Vec<T>>
    where
        T: Clone,
    {
        self.read(<[T]>::to_vec)
    }

    /// Enqueues a GPU use of the memory on `stream`: `enqueue` gets the
    /// pointer and enqueues the work (a copy). Outside a capture the work
    /// is ordered after the conflicting earlier uses and recorded; inside
    /// a graph capture it is logged, and each replay of the graph is
    /// ordered and recorded instead (the graph keeps the memory alive).
    /// The gate is held throughout.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `stream` is of another context; a
    /// driver error, named; what `enqueue` returns.
    ///
    /// # Safety
    /// `enqueue` enqueues work on `stream` only, that accesses at most
    /// `len()` elements through the pointer, and writes them only if
    /// `gpu_writes`.
    pub unsafe fn enqueue_use<R>(
        &self,
        stream: &Arc<CudaStream>,
        gpu_writes: bool,
        enqueue: impl FnOnce(*mut T) -> Result<R>,
    ) -> Result<R> {
        let uses = &self.inner.uses;
        let _gate = uses.hold();
        // SAFETY: the gate is held (see `read`).
        let buf = unsafe { &mut *self.inner.buf.get() };
        crate::raw::check_same_context("a shared pinned buffer", buf.context(), stream)?;
        if is_capture_stream(stream) {
            log_use(uses, gpu_writes);
            keep_with_graph(stream, self.inner.clone()).map_err(|_| {
                Error::Capture("the capture log was lost while keeping a host buffer".into())
            })?;
            return enqueue(buf.raw_ptr());
        }
        uses.before(stream, gpu_writes, WHOLE)?;
        // SAFETY: forwarded to our caller; `record_use` follows.
        let ptr = unsafe { buf.begin_use(stream) }?;
        let out = enqueue(ptr);
        let own = buf.record_use(stream);
        let shared = uses.record(&crate::UseMark::new(stream), gpu_writes, WHOLE);
        let out = out?;
        own.and(shared)?;
        Ok(out)
    }
}
