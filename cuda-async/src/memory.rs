//! Memory ops: allocation, copies in every direction, memset.
//!
//! Downloads land in [`PinnedBuffer`]s (page-locked, not write-combined):
//! the copy is truly asynchronous, and the buffer's contents can only be
//! reached after the copy is done (invariant 3), whatever the caller does.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use cuda_core::cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use cuda_core::{AnyBitPattern, PinnedBuffer, Result};

use crate::buffer::DeviceBuffer;
use crate::context::ExecutionContext;
use crate::host::HostBuffer;
use crate::op::{impl_into_future, DeviceOp};
use crate::pinned_host::PinnedHost;
use crate::view::{DeviceSource, DeviceTarget};

/// The bytes of `v` (what a copy to the device transfers).
pub(crate) fn as_bytes<T: DeviceRepr>(v: &[T]) -> &[u8] {
    // SAFETY: `DeviceRepr` types are plain data copied to the device byte
    // for byte; the slice covers exactly `v`'s memory, borrowed as long.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
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
        ctx.alloc_zeroed(self.len)
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
        ctx.upload(self.src)
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
        ctx.download(self.src.buffer(), self.src.range())
    }
}
impl_into_future!(impl[T: AnyBitPattern, B: DeviceSource<T>] for D2H<T, B>);

/// Elements `range` of `T`s as (byte offset, bytes).
pub(crate) fn byte_range<T>(range: &std::ops::Range<usize>) -> (u64, u64) {
    let size = std::mem::size_of::<T>() as u64;
    (range.start as u64 * size, range.len() as u64 * size)
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
/// At execution: [`Error::InvalidArgument`](crate::Error::InvalidArgument) if the lengths differ.
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
        ctx.download_into(self.src.buffer(), range, &mut self.dst)?;
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
/// At execution: [`Error::InvalidArgument`](crate::Error::InvalidArgument) if the lengths differ.
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
        ctx.upload_from(&mut self.src, self.dst.buffer(), range)?;
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
        // SAFETY: fully written by the copy enqueued next.
        let dst = unsafe { ctx.alloc_uninit::<T>(range.len()) }?;
        let len = range.len();
        // (A source of another home fails in the copy, before any use.)
        ctx.copy(src, range, &dst, 0..len)?;
        Ok(dst)
    }
}
impl_into_future!(impl[T: DeviceRepr + Send, B: DeviceSource<T>] for D2D<T, B>);

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
/// At execution: [`Error::InvalidArgument`](crate::Error::InvalidArgument) if the lengths differ or the
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
        ctx.copy(
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
        ctx.fill(self.buf.buffer(), self.buf.range(), self.byte)?;
        Ok(self.buf)
    }
}
impl_into_future!(impl[T: AnyBitPattern, B: DeviceTarget<T>] for Memset<T, B>);
