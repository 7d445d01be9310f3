//! [`PinnedHost`]: the host memory [`copy_h2d`](crate::copy_h2d) reads and
//! [`copy_d2h`](crate::copy_d2h) writes, owned ([`PinnedBuffer`]) or shared
//! with graphs ([`SharedPinnedBuffer`]).

use std::sync::Arc;

use cuda_core::cudarc::driver::CudaStream;
use cuda_core::{PinnedBuffer, Result, SharedPinnedBuffer};

use crate::host::{HostPtr, ReadSlot};

/// Fills host memory from a remote read's reply.
pub(crate) type ReplyFiller = Box<dyn FnOnce(&ReadSlot) + Send>;

mod sealed {
    pub trait Sealed {}
}

/// Pinned host memory a copy reads from or writes into: a [`PinnedBuffer`],
/// which the op owns while it runs and hands back, or a
/// [`SharedPinnedBuffer`] (a clone of the handle), which a graph can
/// capture: its copies then act at each replay, on what the host left in
/// the memory (see [`SharedPinnedBuffer`]).
///
/// # Examples
///
/// A graph that uploads new input at each replay:
///
/// ```no_run
/// use cuda_async::prelude::*;
/// use cuda_async::{Device, PinnedBuffer};
/// let dev = Device::new(0)?;
/// let input = PinnedBuffer::filled(&dev, 1024, 0.0f32)?.into_shared();
/// let graph = zeros::<f32>(1024)
///     .then({
///         let input = input.clone();
///         move |buf| copy_h2d(input, buf)
///     })
///     .map(|(_, buf)| buf)
///     .graph()?;
/// for step in 0..3 {
///     input.write(|v| v.fill(step as f32))?; // waits for the last replay's read
///     graph.launch().sync()?;
///     let first = d2h(graph.output().slice(..1)?).sync()?.to_vec()?;
///     assert_eq!(first, [step as f32]);
/// }
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub trait PinnedHost<T>: sealed::Sealed + Send + 'static {
    /// Number of elements.
    fn host_len(&self) -> usize;

    /// Enqueues the GPU use `enqueue` makes of the memory on `stream`,
    /// ordered and recorded as the type does it.
    ///
    /// # Safety
    /// As [`PinnedBuffer::begin_use`]: `enqueue` enqueues on `stream` only
    /// work that accesses at most `host_len()` elements, writing them only
    /// if `gpu_writes`.
    #[doc(hidden)]
    unsafe fn enqueue_use(
        &mut self,
        stream: &Arc<CudaStream>,
        gpu_writes: bool,
        enqueue: &mut dyn FnMut(*mut T) -> Result<()>,
    ) -> Result<()>;

    /// Calls `f` with the contents (for a remote upload, which copies them
    /// into the message).
    #[doc(hidden)]
    fn with_contents(&self, f: &mut dyn FnMut(&[T])) -> Result<()>;

    /// What fills the memory from a remote read's reply, run once the reply
    /// has come (the op owns or shares the memory until then).
    #[doc(hidden)]
    fn reply_filler(&mut self) -> Result<ReplyFiller>;
}

impl<T> sealed::Sealed for PinnedBuffer<T> {}
impl<T> sealed::Sealed for SharedPinnedBuffer<T> {}

impl<T: Send + 'static> PinnedHost<T> for PinnedBuffer<T> {
    fn host_len(&self) -> usize {
        self.len()
    }

    unsafe fn enqueue_use(
        &mut self,
        stream: &Arc<CudaStream>,
        _gpu_writes: bool,
        enqueue: &mut dyn FnMut(*mut T) -> Result<()>,
    ) -> Result<()> {
        // SAFETY: forwarded to our caller; `record_use` follows.
        let ptr = unsafe { self.begin_use(stream) }?;
        let enqueued = enqueue(ptr);
        let recorded = self.record_use(stream);
        enqueued.and(recorded)
    }

    fn with_contents(&self, f: &mut dyn FnMut(&[T])) -> Result<()> {
        f(self.as_slice()?);
        Ok(())
    }

    fn reply_filler(&mut self) -> Result<ReplyFiller> {
        // Waits for earlier local copies of the buffer; it is then the op's
        // own until the output is handed out, after the reply.
        let dst = self.as_mut_slice()?;
        let into = HostPtr(dst.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(dst));
        Ok(Box::new(move |slot| into.fill_from(slot)))
    }
}

impl<T: Send + 'static> PinnedHost<T> for SharedPinnedBuffer<T> {
    fn host_len(&self) -> usize {
        self.len()
    }

    unsafe fn enqueue_use(
        &mut self,
        stream: &Arc<CudaStream>,
        gpu_writes: bool,
        enqueue: &mut dyn FnMut(*mut T) -> Result<()>,
    ) -> Result<()> {
        // SAFETY: forwarded to our caller.
        unsafe { SharedPinnedBuffer::enqueue_use(self, stream, gpu_writes, enqueue) }
    }

    fn with_contents(&self, f: &mut dyn FnMut(&[T])) -> Result<()> {
        self.read(|v| f(v))
    }

    fn reply_filler(&mut self) -> Result<ReplyFiller> {
        let shared = self.clone();
        Ok(Box::new(move |slot| {
            // Under the gate, like any host access (a fault leaves the
            // memory as it was; the submission reports it).
            let _ = shared.write(|v| {
                let into = HostPtr(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v));
                into.fill_from(slot);
            });
        }))
    }
}
