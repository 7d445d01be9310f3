//! Memory ops: allocation, copies in every direction, memset.
//!
//! Downloads land in [`PinnedBuffer`]s (page-locked, not write-combined):
//! the copy is truly asynchronous, and the buffer's contents can only be
//! reached after the copy is done (invariant 3), whatever the caller does.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use cuda_core::copy;
use cuda_core::cudarc::driver::{CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits};
use cuda_core::{AnyBitPattern, Error, PinnedBuffer, Result};

use crate::buffer::DeviceBuffer;
use crate::context::ExecutionContext;
use crate::host::HostBuffer;
use crate::op::{impl_into_future, DeviceOp};
use crate::pinned_host::PinnedHost;
use crate::remote::proto::Operand;
use crate::remote::{Id, Op};
use crate::view::{DeviceSource, DeviceTarget};

/// The bytes of `v` (what a copy to the device transfers).
pub(crate) fn as_bytes<T: DeviceRepr>(v: &[T]) -> &[u8] {
    // SAFETY: `DeviceRepr` types are plain data copied to the device byte
    // for byte; the slice covers exactly `v`'s memory, borrowed as long.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

fn bind(ctx: &ExecutionContext) -> Result<()> {
    ctx.device()?
        .context()
        .bind_to_thread()
        .map_err(|e| Error::driver("cuCtxSetCurrent", e))
}

fn same_len(what: &str, a: usize, b: usize) -> Result<()> {
    if a == b {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{what}: source has {a} elements, destination {b}"
        )))
    }
}

/// Op for [`zeros`].
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct Zeros<T> {
    len: usize,
    _t: PhantomData<fn() -> T>,
}

impl<T> fmt::Debug for Zeros<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Zeros").field("len", &self.len).finish()
    }
}

/// Allocates `len` zeroed elements on the device (stream-ordered).
///
/// # Errors
/// At execution: out of memory and other driver errors, named.
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// let buf = zeros::<f64>(1000).sync()?;
/// assert_eq!(buf.len(), 1000);
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(len: usize) -> Zeros<T> {
    Zeros {
        len,
        _t: PhantomData,
    }
}

impl<T: DeviceRepr + ValidAsZeroBits + Send> DeviceOp for Zeros<T> {
    type Output = DeviceBuffer<T>;

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<DeviceBuffer<T>> {
        if let Some(r) = ctx.as_remote() {
            return r.alloc(self.len);
        }
        DeviceBuffer::zeros_local(ctx.cuda_stream()?, self.len)
    }
}
impl_into_future!(impl[T: DeviceRepr + ValidAsZeroBits + Send] for Zeros<T>);

/// Host data that can be uploaded: `Vec<T>`, `Box<[T]>`, `Arc<[T]>`, `&[T]`.
pub trait HostSource<T>: Send {
    /// The elements.
    fn host_slice(&self) -> &[T];

    /// The data as bytes a remote submission may keep instead of copying
    /// (owned data); borrowed data gives itself back, to be copied.
    fn into_kept(self) -> std::result::Result<crate::remote::KeptBytes, Self>
    where
        Self: Sized,
    {
        Err(self)
    }
}

/// Owned elements as bytes (see [`HostSource::into_kept`]).
struct KeptElems<T, S>(S, PhantomData<fn() -> T>);

impl<T: DeviceRepr, S: AsRef<[T]>> AsRef<[u8]> for KeptElems<T, S> {
    fn as_ref(&self) -> &[u8] {
        as_bytes(self.0.as_ref())
    }
}

fn kept<T, S>(s: S) -> crate::remote::KeptBytes
where
    T: DeviceRepr + 'static,
    S: AsRef<[T]> + Send + Sync + 'static,
{
    Box::new(KeptElems(s, PhantomData))
}

impl<T: DeviceRepr + Send + Sync + 'static> HostSource<T> for Vec<T> {
    fn host_slice(&self) -> &[T] {
        self
    }
    fn into_kept(self) -> std::result::Result<crate::remote::KeptBytes, Self> {
        Ok(kept(self))
    }
}
impl<T: DeviceRepr + Send + Sync + 'static> HostSource<T> for Box<[T]> {
    fn host_slice(&self) -> &[T] {
        self
    }
    fn into_kept(self) -> std::result::Result<crate::remote::KeptBytes, Self> {
        Ok(kept(self))
    }
}
impl<T: DeviceRepr + Send + Sync + 'static> HostSource<T> for Arc<[T]> {
    fn host_slice(&self) -> &[T] {
        self
    }
    fn into_kept(self) -> std::result::Result<crate::remote::KeptBytes, Self> {
        Ok(kept(self))
    }
}
impl<T: Sync> HostSource<T> for &[T] {
    fn host_slice(&self) -> &[T] {
        self
    }
}

/// Op for [`h2d`].
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct H2D<T, S> {
    src: S,
    _t: PhantomData<fn() -> T>,
}

impl<T, S> fmt::Debug for H2D<T, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("H2D").finish_non_exhaustive()
    }
}

/// Uploads host data into a new device buffer.
///
/// The data is copied on the host into pinned staging memory (pooled per
/// device) and uploaded from there asynchronously, so enqueuing never waits
/// for the stream, and `src` is free to go as soon as the op is enqueued.
/// For large or repeated uploads, [`copy_h2d`] from a [`PinnedBuffer`] you
/// keep saves the host copy.
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// let buf = h2d(vec![1u16, 2, 3]).sync()?;
/// assert_eq!(buf.len(), 3);
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub fn h2d<T: DeviceRepr + Copy, S: HostSource<T>>(src: S) -> H2D<T, S> {
    H2D {
        src,
        _t: PhantomData,
    }
}

impl<T: DeviceRepr + Copy + Send, S: HostSource<T>> DeviceOp for H2D<T, S> {
    type Output = DeviceBuffer<T>;

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<DeviceBuffer<T>> {
        if let Some(r) = ctx.as_remote() {
            // The bytes travel with the submission: owned data is kept by
            // the recording as it is, borrowed data copied.
            let len = self.src.host_slice().len();
            let dst = r.alloc::<T>(len)?;
            let (stream, id) = (r.stream(), r.id_of(&dst)?);
            if len != 0 {
                match self.src.into_kept() {
                    Ok(bytes) => r.recording().write_kept(stream, id, 0, bytes),
                    Err(src) => r
                        .recording()
                        .write(stream, id, 0, as_bytes(src.host_slice())),
                }
            }
            return Ok(dst);
        }
        let src = self.src.host_slice();
        let stream = ctx.cuda_stream()?;
        // SAFETY: every element is written by the copy enqueued next, before
        // any later work on the buffer (its recorded write orders them).
        let mut dst = unsafe { cuda_core::DeviceBuffer::<T>::uninit(stream, src.len()) }?;
        // Through pinned staging: never blocks on the stream, and `src`
        // (even a borrowed slice of pinned memory) is free once this returns.
        cuda_core::staging::upload(src, &mut dst, stream)?;
        Ok(dst.into())
    }
}
impl_into_future!(impl[T: DeviceRepr + Copy + Send, S: HostSource<T>] for H2D<T, S>);

/// Op for [`d2h`].
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct D2H<T, B> {
    src: B,
    _t: PhantomData<fn() -> T>,
}

impl<T, B> fmt::Debug for D2H<T, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("D2H").finish_non_exhaustive()
    }
}

/// Downloads a device buffer (owned, borrowed or `Arc`ed), or a view of
/// one ([`DeviceBuffer::slice`]), into a new [`HostBuffer`] (pinned memory locally; a remote reply's bytes on a
/// leased GPU). The element type must accept any bit pattern
/// ([`AnyBitPattern`]): the GPU may have written anything. The result's contents are reachable only once the
/// copy is done (`as_slice` waits if needed; after `.sync()` or `.await`
/// it never does).
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// let v = h2d(vec![3i64; 5]).then(d2h).sync()?.to_vec()?;
/// assert_eq!(v, vec![3; 5]);
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub fn d2h<T: AnyBitPattern, B: DeviceSource<T>>(src: B) -> D2H<T, B> {
    D2H {
        src,
        _t: PhantomData,
    }
}

impl<T, B> DeviceOp for D2H<T, B>
where
    T: AnyBitPattern,
    B: DeviceSource<T>,
{
    type Output = HostBuffer<T>;

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<HostBuffer<T>> {
        let (src, range) = (self.src.buffer(), self.src.range());
        if let Some(r) = ctx.as_remote() {
            // Received straight into the result's storage from the reply.
            let (stream, id) = (r.stream(), r.id_of(src)?);
            let (at, len) = byte_range::<T>(&range);
            let slot = r.recording().read(stream, id, at, len);
            return HostBuffer::remote(slot);
        }
        // SAFETY: the copy enqueued next overwrites every element, and host
        // access to the buffer waits for that copy (its recorded use).
        let mut dst = unsafe { PinnedBuffer::uninit(ctx.device()?, range.len()) }?;
        enqueue_d2h(ctx, src, range, &mut dst)?;
        Ok(dst.into())
    }
}
impl_into_future!(impl[T: AnyBitPattern, B: DeviceSource<T>] for D2H<T, B>);

/// Elements `range` of `T`s as (byte offset, bytes).
fn byte_range<T>(range: &std::ops::Range<usize>) -> (u64, u64) {
    let size = std::mem::size_of::<T>() as u64;
    (range.start as u64 * size, range.len() as u64 * size)
}

/// Enqueues the download of elements `range` of `src` into `dst` (a
/// fresh pinned buffer of `d2h`, or `copy_d2h`'s destination), ordered
/// after `src`'s overlapping writes and recorded as a read of them and a
/// use of `dst`.
fn enqueue_d2h<T: AnyBitPattern, H: PinnedHost<T>>(
    ctx: &ExecutionContext,
    src: &DeviceBuffer<T>,
    range: std::ops::Range<usize>,
    dst: &mut H,
) -> Result<()> {
    same_len("device-to-host copy", range.len(), dst.host_len())?;
    if range.is_empty() {
        return Ok(());
    }
    let stream = ctx.cuda_stream()?;
    bind(ctx)?;
    let src = src.local_on(stream)?;
    src.before_read_range(stream, range.clone())?;
    let (at, bytes) = byte_range::<T>(&range);
    let mut copy = |host: *mut T| {
        // (cudarc's own tracking sees a read too.)
        let (dptr, _use) = src.as_cuda_slice().device_ptr(stream);
        // SAFETY: `host` addresses `range.len()` pinned elements that no
        // host code touches until the recorded use is done; `dptr + at` as
        // many inside `src`; `T` accepts any bits.
        unsafe { copy::dtoh_async(host.cast::<u8>(), dptr + at, bytes as usize, stream) }
    };
    // SAFETY: the copy writes `range.len()` elements on `stream`.
    let copied = unsafe { dst.enqueue_use(stream, true, &mut copy) };
    let read = src.after_read_range(stream, range);
    copied.and(read)
}

/// Op for [`copy_d2h`].
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct CopyD2H<T, B, H = PinnedBuffer<T>> {
    src: B,
    dst: H,
    _t: PhantomData<fn() -> T>,
}

impl<T, B, H: PinnedHost<T>> fmt::Debug for CopyD2H<T, B, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CopyD2H")
            .field("len", &self.dst.host_len())
            .finish()
    }
}

/// Downloads a buffer, or a view of one, into existing pinned memory (no
/// allocation): a [`PinnedBuffer`], or a
/// [`SharedPinnedBuffer`](crate::SharedPinnedBuffer) whose download a graph can capture and
/// repeat at each replay; yields the source and the destination back.
///
/// # Errors
/// At execution: [`Error::InvalidArgument`] if the lengths differ.
pub fn copy_d2h<T: AnyBitPattern, B: DeviceSource<T>, H: PinnedHost<T>>(
    src: B,
    dst: H,
) -> CopyD2H<T, B, H> {
    CopyD2H {
        src,
        dst,
        _t: PhantomData,
    }
}

impl<T: AnyBitPattern, B: DeviceSource<T>, H: PinnedHost<T>> DeviceOp for CopyD2H<T, B, H> {
    type Output = (B, H);

    unsafe fn execute(mut self, ctx: &mut ExecutionContext) -> Result<<Self as DeviceOp>::Output> {
        let range = self.src.range();
        same_len("device-to-host copy", range.len(), self.dst.host_len())?;
        let src = self.src.buffer();
        if let Some(r) = ctx.as_remote() {
            let (stream, id) = (r.stream(), r.id_of(src)?);
            let (at, len) = byte_range::<T>(&range);
            let slot = r.recording().read(stream, id, at, len);
            let fill = self.dst.reply_filler()?;
            r.on_reply(move || fill(&slot));
            return Ok((self.src, self.dst));
        }
        enqueue_d2h(ctx, src, range, &mut self.dst)?;
        Ok((self.src, self.dst))
    }
}
impl_into_future!(impl[T: AnyBitPattern, B: DeviceSource<T>, H: PinnedHost<T>] for CopyD2H<T, B, H>);

/// Op for [`copy_h2d`].
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct CopyH2D<T, D, H = PinnedBuffer<T>> {
    src: H,
    dst: D,
    _t: PhantomData<fn() -> T>,
}

impl<T, D: DeviceTarget<T>, H> fmt::Debug for CopyH2D<T, D, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CopyH2D")
            .field("dst", &self.dst.range())
            .finish()
    }
}

/// Uploads pinned memory into an existing device buffer, or a writable
/// view of one (truly asynchronous, no staging); yields both back. The
/// source is a [`PinnedBuffer`] (host writes to it wait until the copy has
/// read it), or a [`SharedPinnedBuffer`](crate::SharedPinnedBuffer),
/// whose upload a graph can capture and repeat at each replay, reading
/// what the host last wrote there.
///
/// # Errors
/// At execution: [`Error::InvalidArgument`] if the lengths differ.
pub fn copy_h2d<T: DeviceRepr, D: DeviceTarget<T>, H: PinnedHost<T>>(
    src: H,
    dst: D,
) -> CopyH2D<T, D, H> {
    CopyH2D {
        src,
        dst,
        _t: PhantomData,
    }
}

impl<T: DeviceRepr + Send, D: DeviceTarget<T>, H: PinnedHost<T>> DeviceOp for CopyH2D<T, D, H> {
    type Output = (H, D);

    unsafe fn execute(mut self, ctx: &mut ExecutionContext) -> Result<<Self as DeviceOp>::Output> {
        let range = self.dst.range();
        same_len("host-to-device copy", self.src.host_len(), range.len())?;
        let (at, bytes) = byte_range::<T>(&range);
        if let Some(r) = ctx.as_remote() {
            let (stream, id) = (r.stream(), r.id_of(self.dst.buffer())?);
            if !range.is_empty() {
                let recording = r.recording();
                self.src
                    .with_contents(&mut |v| recording.write(stream, id, at, as_bytes(v)))?;
            }
            return Ok((self.src, self.dst));
        }
        if !range.is_empty() {
            let stream = ctx.cuda_stream()?;
            bind(ctx)?;
            let dst = self.dst.buffer().local_on(stream)?;
            dst.before_write_range(stream, range.clone())?;
            let mut copy = |host: *mut T| {
                // (cudarc's own tracking sees a read: ours records the write.)
                let (dptr, _use) = dst.as_cuda_slice().device_ptr(stream);
                // SAFETY: `host` holds `range.len()` initialised pinned
                // elements that host code cannot mutate until the recorded
                // use completes; `dptr + at` addresses as many inside the
                // buffer (`range` lies inside it), held exclusively by this
                // op; live stream.
                unsafe { copy::htod_async(dptr + at, host.cast::<u8>(), bytes as usize, stream) }
            };
            // SAFETY: the copy reads `range.len()` elements on `stream`.
            let copied = unsafe { self.src.enqueue_use(stream, false, &mut copy) };
            let written = dst.after_write_range(stream, range);
            copied.and(written)?;
        }
        Ok((self.src, self.dst))
    }
}
impl_into_future!(impl[T: DeviceRepr + Send, D: DeviceTarget<T>, H: PinnedHost<T>] for CopyH2D<T, D, H>);

/// Op for [`d2d`].
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct D2D<T, B> {
    src: B,
    _t: PhantomData<fn() -> T>,
}

impl<T, B> fmt::Debug for D2D<T, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("D2D").finish_non_exhaustive()
    }
}

/// Copies a device buffer (or a view of one) into a new one on the same
/// device.
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// let a = h2d(vec![1u8, 2]).sync()?;
/// let b = d2d(&a).then(d2h).sync()?;
/// assert_eq!(b.as_slice()?, &[1, 2]);
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub fn d2d<T: DeviceRepr, B: DeviceSource<T>>(src: B) -> D2D<T, B> {
    D2D {
        src,
        _t: PhantomData,
    }
}

impl<T: DeviceRepr + Send, B: DeviceSource<T>> DeviceOp for D2D<T, B> {
    type Output = DeviceBuffer<T>;

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<DeviceBuffer<T>> {
        let (src, range) = (self.src.buffer(), self.src.range());
        let dst = if let Some(r) = ctx.as_remote() {
            r.alloc::<T>(range.len())?
        } else {
            // (A remote source fails in the copy below, before any use.)
            let stream = ctx.cuda_stream()?;
            // SAFETY: fully written by the copy enqueued next.
            unsafe { cuda_core::DeviceBuffer::<T>::uninit(stream, range.len()) }?.into()
        };
        let len = range.len();
        enqueue_d2d(ctx, src, range, &dst, 0..len)?;
        Ok(dst)
    }
}
impl_into_future!(impl[T: DeviceRepr + Send, B: DeviceSource<T>] for D2D<T, B>);

/// Enqueues a copy of elements `from` of `src` into elements `to` of `dst`
/// (of the same length, checked), ordered after the uses it conflicts with
/// and recorded as a read of `from` and a write of `to`; remotely, a copy
/// command.
fn enqueue_d2d<T>(
    ctx: &mut ExecutionContext,
    src: &DeviceBuffer<T>,
    from: std::ops::Range<usize>,
    dst: &DeviceBuffer<T>,
    to: std::ops::Range<usize>,
) -> Result<()> {
    same_len("device-to-device copy", from.len(), to.len())?;
    let ((src_at, bytes), (dst_at, _)) = (byte_range::<T>(&from), byte_range::<T>(&to));
    if let Some(r) = ctx.as_remote() {
        let (stream, sid, did) = (r.stream(), r.id_of(src)?, r.id_of(dst)?);
        if bytes > 0 {
            r.recording().push(
                stream,
                Op::Copy {
                    src: Operand::new(Id(sid), src_at),
                    dst: Operand::new(Id(did), dst_at),
                    len: bytes,
                },
            );
        }
        return Ok(());
    }
    let stream: &Arc<CudaStream> = ctx.cuda_stream()?;
    let (src, dst) = (src.local_on(stream)?, dst.local_on(stream)?);
    if bytes == 0 {
        return Ok(());
    }
    src.before_read_range(stream, from.clone())?;
    dst.before_write_range(stream, to.clone())?;
    {
        let (sptr, _read) = src.as_cuda_slice().device_ptr(stream);
        // (cudarc's own tracking sees a read: ours records the write.)
        let (dptr, _use) = dst.as_cuda_slice().device_ptr(stream);
        // SAFETY: both ranges lie inside their buffers (checked by the
        // range calls above), the destination's held exclusively by the
        // op; a live stream.
        unsafe { copy::dtod_async(dptr + dst_at, sptr + src_at, bytes as usize, stream) }?;
    }
    // One event after the copy marks both uses.
    let mark = cuda_core::UseMark::new(stream);
    let read = src.after_read_range_with(&mark, from);
    dst.after_write_range_with(&mark, to)?;
    read
}

/// Op for [`copy_d2d`].
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct CopyD2D<T, S, D> {
    src: S,
    dst: D,
    _t: PhantomData<fn() -> T>,
}

impl<T, S: DeviceSource<T>, D: DeviceTarget<T>> fmt::Debug for CopyD2D<T, S, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CopyD2D")
            .field("src", &self.src.range())
            .field("dst", &self.dst.range())
            .finish()
    }
}

/// Copies a buffer, or a view of one, into an existing buffer or a
/// writable view of one, on the same device; yields both back.
///
/// # Errors
/// At execution: [`Error::InvalidArgument`] if the lengths differ or the
/// buffers are on different devices (see [`to_device`](crate::to_device)).
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// let src = h2d(vec![1u8, 2, 3, 4]).sync()?;
/// let mut dst = zeros::<u8>(6).sync()?;
/// copy_d2d(src.slice(1..3)?, dst.slice_mut(4..)?).sync()?;
/// assert_eq!(d2h(dst).sync()?.as_slice()?, &[0, 0, 0, 0, 2, 3]);
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub fn copy_d2d<T: DeviceRepr, S: DeviceSource<T>, D: DeviceTarget<T>>(
    src: S,
    dst: D,
) -> CopyD2D<T, S, D> {
    CopyD2D {
        src,
        dst,
        _t: PhantomData,
    }
}

impl<T: DeviceRepr + Send, S: DeviceSource<T>, D: DeviceTarget<T>> DeviceOp for CopyD2D<T, S, D> {
    type Output = (S, D);

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<(S, D)> {
        enqueue_d2d(
            ctx,
            self.src.buffer(),
            self.src.range(),
            self.dst.buffer(),
            self.dst.range(),
        )?;
        Ok((self.src, self.dst))
    }
}
impl_into_future!(impl[T: DeviceRepr + Send, S: DeviceSource<T>, D: DeviceTarget<T>] for CopyD2D<T, S, D>);

/// Op for [`memset`].
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct Memset<T, B> {
    buf: B,
    byte: u8,
    _t: PhantomData<fn() -> T>,
}

impl<T, B: DeviceTarget<T>> fmt::Debug for Memset<T, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Memset")
            .field("range", &self.buf.range())
            .field("byte", &self.byte)
            .finish()
    }
}

/// Sets every byte of `buf` (an owned buffer, `&mut` one, or a writable
/// view, [`DeviceBuffer::slice_mut`]) to `byte`; yields it back. Only for
/// element types where every bit pattern is valid ([`AnyBitPattern`]).
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// let v = zeros::<u32>(4).then(|b| memset(b, 0xff)).then(d2h).sync()?.to_vec()?;
/// assert_eq!(v, vec![u32::MAX; 4]);
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub fn memset<T: AnyBitPattern, B: DeviceTarget<T>>(buf: B, byte: u8) -> Memset<T, B> {
    Memset {
        buf,
        byte,
        _t: PhantomData,
    }
}

impl<T: AnyBitPattern, B: DeviceTarget<T>> DeviceOp for Memset<T, B> {
    type Output = B;

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<B> {
        let range = self.buf.range();
        let (at, bytes) = byte_range::<T>(&range);
        let target = self.buf.buffer();
        if let Some(r) = ctx.as_remote() {
            let (stream, id) = (r.stream(), r.id_of(target)?);
            if bytes > 0 {
                r.recording().push(
                    stream,
                    Op::Fill {
                        buf: Id(id),
                        offset: at,
                        len: bytes,
                        value: self.byte,
                    },
                );
            }
            return Ok(self.buf);
        }
        let stream = ctx.cuda_stream()?;
        bind(ctx)?;
        if bytes > 0 {
            let buf = target.local_on(stream)?;
            buf.before_write_range(stream, range.clone())?;
            {
                // (cudarc's own tracking sees a read: ours records the write.)
                let (dptr, _use) = buf.as_cuda_slice().device_ptr(stream);
                // SAFETY: `dptr + at` addresses `bytes` bytes of a live
                // allocation (`range` lies inside the buffer), which this op
                // holds exclusively (an owned buffer, `&mut` or a writable
                // view).
                unsafe { copy::memset_d8_async(dptr + at, self.byte, bytes as usize, stream) }?;
            }
            buf.after_write_range(stream, range)?;
        }
        Ok(self.buf)
    }
}
impl_into_future!(impl[T: AnyBitPattern, B: DeviceTarget<T>] for Memset<T, B>);
