//! Any stream-taking library inside a pipeline: [`on_stream`] orders the
//! buffers a foreign call reads and writes like every other op's, hands
//! the call the op's stream and the buffers' device addresses, and gives
//! the buffers back.

use std::fmt;
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::Arc;

use cuda_core::cudarc::driver::{CudaStream, DevicePtr as _};
use cuda_core::{Error, Result, UseMark};

use crate::context::ExecutionContext;
use crate::op::{impl_into_future, DeviceOp};
use crate::view::{DeviceSource, DeviceTarget};

/// The device address of the first element a foreign call uses, and how
/// many elements it may use from there.
///
/// An address is valid on the stream [`on_stream`] hands the call, until
/// the call returns: work enqueued there on it is ordered; anything else
/// (another stream, a later thread) is not.
pub struct ForeignPtr<T> {
    addr: u64,
    len: usize,
    _t: PhantomData<fn() -> T>,
}

impl<T> ForeignPtr<T> {
    /// The device address (a `CUdeviceptr`) of the first element.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// The elements from [`ForeignPtr::addr`] the call may use.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there is no element to use.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<T> Clone for ForeignPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for ForeignPtr<T> {}

impl<T> fmt::Debug for ForeignPtr<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ForeignPtr({:#x}, {} elements)", self.addr, self.len)
    }
}

/// What a foreign call does to its buffers: [`reads`], [`writes`], or a
/// tuple of them (up to six).
pub trait StreamUses: Send {
    /// The device addresses the call gets: a [`ForeignPtr`] per use, in a
    /// tuple like the uses'.
    type Ptrs: Copy;
    /// What the op yields back: each use's buffer or view.
    type Inner: Send;

    /// Orders the uses after the conflicting earlier uses of their buffers
    /// (on any stream), checks they live on `stream`'s device, and gives
    /// their addresses.
    #[doc(hidden)]
    fn begin(&self, stream: &CudaStream) -> Result<Self::Ptrs>;

    /// Records the uses, so later conflicting uses wait for the call's
    /// work: all of them marked by `mark`, one event recorded on its
    /// stream right after the call.
    #[doc(hidden)]
    fn end(&self, mark: &UseMark<'_>) -> Result<()>;

    /// The buffers or views back.
    #[doc(hidden)]
    fn into_inner(self) -> Self::Inner;
}

/// A buffer or view a foreign call reads ([`reads`]).
pub struct Reads<T, S> {
    src: S,
    _t: PhantomData<fn() -> T>,
}

/// A buffer or view a foreign call writes (and may read) ([`writes`]).
pub struct Writes<T, D> {
    dst: D,
    _t: PhantomData<fn() -> T>,
}

/// Declares that the call reads `src` (a buffer, `&` one, or a view).
pub fn reads<T, S: DeviceSource<T>>(src: S) -> Reads<T, S> {
    Reads {
        src,
        _t: PhantomData,
    }
}

/// Declares that the call writes `dst` (an owned buffer, `&mut` one, or a
/// writable view); it may read it too.
pub fn writes<T, D: DeviceTarget<T>>(dst: D) -> Writes<T, D> {
    Writes {
        dst,
        _t: PhantomData,
    }
}

impl<T, S: DeviceSource<T>> Reads<T, S> {
    /// The buffer read and the elements of it.
    #[cfg(any(feature = "blas", feature = "rand"))]
    pub(crate) fn view(&self) -> (&crate::DeviceBuffer<T>, std::ops::Range<usize>) {
        (self.src.buffer(), self.src.range())
    }
}

impl<T, D: DeviceTarget<T>> Writes<T, D> {
    /// The buffer written and the elements of it.
    #[cfg(any(feature = "blas", feature = "rand"))]
    pub(crate) fn view(&self) -> (&crate::DeviceBuffer<T>, std::ops::Range<usize>) {
        (self.dst.buffer(), self.dst.range())
    }
}

impl<T, S: DeviceSource<T>> fmt::Debug for Reads<T, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Reads({:?})", self.src.range())
    }
}

impl<T, D: DeviceTarget<T>> fmt::Debug for Writes<T, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Writes({:?})", self.dst.range())
    }
}

/// The address of elements `range` of `buf` on `stream`.
fn ptr_of<T>(
    buf: &crate::DeviceBuffer<T>,
    stream: &CudaStream,
    range: &Range<usize>,
) -> Result<ForeignPtr<T>> {
    let local = buf.local_on(stream)?;
    // (cudarc's own tracking sees a read; ours records the real use.)
    let (base, _use) = local.as_cuda_slice().device_ptr(stream);
    Ok(ForeignPtr {
        addr: base + (range.start * std::mem::size_of::<T>()) as u64,
        len: range.len(),
        _t: PhantomData,
    })
}

impl<T, S: DeviceSource<T>> StreamUses for Reads<T, S> {
    type Ptrs = ForeignPtr<T>;
    type Inner = S;

    fn begin(&self, stream: &CudaStream) -> Result<ForeignPtr<T>> {
        let (buf, range) = (self.src.buffer(), self.src.range());
        buf.local_on(stream)?
            .before_read_range(stream, range.clone())?;
        ptr_of(buf, stream, &range)
    }

    fn end(&self, mark: &UseMark<'_>) -> Result<()> {
        let (buf, range) = (self.src.buffer(), self.src.range());
        buf.local_on(mark.stream())?
            .after_read_range_with(mark, range)
    }

    fn into_inner(self) -> S {
        self.src
    }
}

impl<T, D: DeviceTarget<T>> StreamUses for Writes<T, D> {
    type Ptrs = ForeignPtr<T>;
    type Inner = D;

    fn begin(&self, stream: &CudaStream) -> Result<ForeignPtr<T>> {
        let (buf, range) = (self.dst.buffer(), self.dst.range());
        buf.local_on(stream)?
            .before_write_range(stream, range.clone())?;
        ptr_of(buf, stream, &range)
    }

    fn end(&self, mark: &UseMark<'_>) -> Result<()> {
        let (buf, range) = (self.dst.buffer(), self.dst.range());
        buf.local_on(mark.stream())?
            .after_write_range_with(mark, range)
    }

    fn into_inner(self) -> D {
        self.dst
    }
}

macro_rules! stream_uses_tuple {
    ($($u:ident $i:tt),+) => {
        impl<$($u: StreamUses),+> StreamUses for ($($u,)+) {
            type Ptrs = ($($u::Ptrs,)+);
            type Inner = ($($u::Inner,)+);

            fn begin(&self, stream: &CudaStream) -> Result<Self::Ptrs> {
                Ok(($(self.$i.begin(stream)?,)+))
            }

            fn end(&self, mark: &UseMark<'_>) -> Result<()> {
                // Every use is recorded, even after one fails: the call's
                // work may be enqueued.
                let mut first = Ok(());
                $(
                    let r = self.$i.end(mark);
                    if first.is_ok() {
                        first = r;
                    }
                )+
                first
            }

            fn into_inner(self) -> Self::Inner {
                ($(self.$i.into_inner(),)+)
            }
        }
    };
}

stream_uses_tuple!(A 0);
stream_uses_tuple!(A 0, B 1);
stream_uses_tuple!(A 0, B 1, C 2);
stream_uses_tuple!(A 0, B 1, C 2, D 3);
stream_uses_tuple!(A 0, B 1, C 2, D 3, E 4);
stream_uses_tuple!(A 0, B 1, C 2, D 3, E 4, F 5);

/// Op for [`on_stream`].
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct OnStream<U, F> {
    name: &'static str,
    uses: U,
    call: F,
}

impl<U: fmt::Debug, F> fmt::Debug for OnStream<U, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OnStream")
            .field("name", &self.name)
            .field("uses", &self.uses)
            .finish_non_exhaustive()
    }
}

/// Runs a foreign call (cuSOLVER, cuSPARSE, cuDNN, NCCL, another crate's
/// kernels) in a pipeline: the buffers it reads and writes are ordered
/// like every other op's, the call gets the op's stream and their device
/// addresses, and the op yields the buffers back with the call's result.
///
/// `call` runs on the host when the op is enqueued; it must enqueue its
/// GPU work on the stream it is given and use only the addresses it is
/// given, within their lengths: the library's own calls are `unsafe`, and
/// keeping to that is their safety contract. It must not synchronize in
/// ways a graph capture refuses if the op is captured ([`crate::CudaGraph`]).
///
/// `uses` is [`reads`], [`writes`], or a tuple of them; `name` names the op
/// in errors. On a remote context it fails with
/// [`Error::NeedsLocalStream`].
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// use cuda_async::cudarc::driver::result;
/// use cuda_async::foreign::{on_stream, reads, writes};
///
/// // A "library" that copies bytes with the driver, as cuSPARSE would
/// // take pointers and a stream.
/// let (src, dst) = zeros::<u8>(64).zip(zeros::<u8>(64)).sync()?;
/// let ((src, dst), ()) = on_stream("copy", (reads(src), writes(dst)), |stream, (s, d)| {
///     // SAFETY: both addresses hold 64 bytes, ordered on `stream`.
///     unsafe { result::memcpy_dtod_async(d.addr(), s.addr(), s.len(), stream.cu_stream()) }
///         .map_err(|e| cuda_async::Error::driver("cuMemcpyDtoDAsync", e))
/// })
/// .sync()?;
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub fn on_stream<U, F, R>(name: &'static str, uses: U, call: F) -> OnStream<U, F>
where
    U: StreamUses,
    F: FnOnce(&Arc<CudaStream>, U::Ptrs) -> Result<R> + Send,
    R: Send,
{
    OnStream { name, uses, call }
}

/// Runs `call` on `ctx`'s local stream between `uses`' ordering and their
/// recording; shared by [`on_stream`] and the library ops.
pub(crate) fn run_foreign<U: StreamUses, R>(
    ctx: &ExecutionContext,
    name: &str,
    uses: &U,
    call: impl FnOnce(&Arc<CudaStream>, U::Ptrs) -> Result<R>,
) -> Result<R> {
    let stream = ctx.cuda_stream_for(name)?;
    ctx.device()?
        .context()
        .bind_to_thread()
        .map_err(|e| Error::driver("cuCtxSetCurrent", e))?;
    let ptrs = uses.begin(stream)?;
    let r = call(stream, ptrs);
    // One event after the call marks every buffer's use.
    let recorded = uses.end(&ctx.mark(stream));
    let r = r?;
    recorded?;
    Ok(r)
}

impl<U, F, R> DeviceOp for OnStream<U, F>
where
    U: StreamUses,
    F: FnOnce(&Arc<CudaStream>, U::Ptrs) -> Result<R> + Send,
    R: Send,
{
    type Output = (U::Inner, R);

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<(U::Inner, R)> {
        let r = run_foreign(ctx, self.name, &self.uses, self.call)?;
        Ok((self.uses.into_inner(), r))
    }
}
impl_into_future!(impl[U, F, R] for OnStream<U, F> where
    U: StreamUses,
    F: FnOnce(&Arc<CudaStream>, U::Ptrs) -> Result<R> + Send,
    R: Send,
);
