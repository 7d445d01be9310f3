//! Views of part of a [`DeviceBuffer`]: [`DeviceSlice`] (read) and
//! [`DeviceSliceMut`] (written), what `d_a + i * n` is in CUDA C. A view
//! borrows its buffer, so the borrow checker keeps writable views apart:
//! [`DeviceBuffer::split_at_mut`] and [`DeviceBuffer::chunks_mut`] hand out
//! disjoint ones, and a buffer with a writable view cannot be used
//! otherwise until the view is gone.
//!
//! A view is a kernel argument (a pointer to its first element), the
//! target of [`memset`](crate::memset) and [`copy_h2d`](crate::copy_h2d),
//! the source of [`d2h`](crate::d2h), [`copy_d2h`](crate::copy_d2h) and
//! [`d2d`](crate::d2d), either end of [`copy_d2d`](crate::copy_d2d), and
//! remotely the buffer's id plus a byte offset. A view's use waits only
//! for the uses of the buffer that overlap it, so disjoint views written
//! on two streams run at once (see `ARCHITECTURE.md`).

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Bound, Range, RangeBounds};

use cuda_core::cudarc::driver::CudaView;
use cuda_core::{Error, Result};

use crate::buffer::DeviceBuffer;

/// Elements `range` of a buffer of `len`, checked.
fn bounds(range: impl RangeBounds<usize>, len: usize) -> Result<Range<usize>> {
    let start = match range.start_bound() {
        Bound::Included(&s) => Some(s),
        Bound::Excluded(&s) => s.checked_add(1),
        Bound::Unbounded => Some(0),
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.checked_add(1),
        Bound::Excluded(&e) => Some(e),
        Bound::Unbounded => Some(len),
    };
    match (start, end) {
        (Some(s), Some(e)) if s <= e && e <= len => Ok(s..e),
        _ => Err(Error::InvalidArgument(format!(
            "a view of elements {:?}..{:?} of a buffer of {len}",
            range.start_bound(),
            range.end_bound()
        ))),
    }
}

/// A read-only view of elements `start..start + len` of a
/// [`DeviceBuffer`]: [`DeviceBuffer::slice`].
pub struct DeviceSlice<'a, T> {
    pub(crate) buf: &'a DeviceBuffer<T>,
    pub(crate) start: usize,
    pub(crate) len: usize,
    /// The local buffer's elements, for a launch.
    pub(crate) view: Option<CudaView<'a, T>>,
}

/// Elements `r` of a local buffer as a cudarc view (none for a remote one).
fn local_view<T>(buf: &DeviceBuffer<T>, r: Range<usize>) -> Option<CudaView<'_, T>> {
    buf.local()
        .ok()
        .and_then(|b| b.as_cuda_slice().try_slice(r))
}

impl<'a, T> DeviceSlice<'a, T> {
    fn new(buf: &'a DeviceBuffer<T>, r: Range<usize>) -> Self {
        DeviceSlice {
            view: local_view(buf, r.clone()),
            buf,
            start: r.start,
            len: r.len(),
        }
    }
}

impl<T> Clone for DeviceSlice<'_, T> {
    fn clone(&self) -> Self {
        DeviceSlice::new(self.buf, self.start..self.start + self.len)
    }
}

impl<T> fmt::Debug for DeviceSlice<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceSlice")
            .field("start", &self.start)
            .field("len", &self.len)
            .field("of", &self.buf.len())
            .finish()
    }
}

/// A writable view of elements `start..start + len` of a
/// [`DeviceBuffer`]: [`DeviceBuffer::slice_mut`],
/// [`DeviceBuffer::split_at_mut`], [`DeviceBuffer::chunks_mut`]. It holds
/// its range exclusively: no other view of the buffer overlaps it.
pub struct DeviceSliceMut<'a, T> {
    pub(crate) buf: &'a DeviceBuffer<T>,
    pub(crate) start: usize,
    pub(crate) len: usize,
    /// The local buffer's elements, for a launch.
    pub(crate) view: Option<CudaView<'a, T>>,
    _exclusive: PhantomData<&'a mut DeviceBuffer<T>>,
}

impl<T> fmt::Debug for DeviceSliceMut<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceSliceMut")
            .field("start", &self.start)
            .field("len", &self.len)
            .field("of", &self.buf.len())
            .finish()
    }
}

/// What both kinds of view answer.
macro_rules! view_common {
    ($view:ident) => {
        impl<T> $view<'_, T> {
            /// Number of elements.
            pub fn len(&self) -> usize {
                self.len
            }

            /// True for an empty view.
            pub fn is_empty(&self) -> bool {
                self.len == 0
            }

            /// Index of its first element in the buffer.
            pub fn start(&self) -> usize {
                self.start
            }
        }
    };
}
view_common!(DeviceSlice);
view_common!(DeviceSliceMut);

impl<'a, T> DeviceSlice<'a, T> {
    /// The buffer it views.
    pub fn buffer(&self) -> &'a DeviceBuffer<T> {
        self.buf
    }

    /// A view of part of this view (`range` relative to it).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `range` is outside the view.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<DeviceSlice<'a, T>> {
        let r = bounds(range, self.len)?;
        Ok(DeviceSlice::new(
            self.buf,
            self.start + r.start..self.start + r.end,
        ))
    }
}

impl<'a, T> DeviceSliceMut<'a, T> {
    fn new(buf: &'a DeviceBuffer<T>, r: Range<usize>) -> Self {
        DeviceSliceMut {
            view: local_view(buf, r.clone()),
            buf,
            start: r.start,
            len: r.len(),
            _exclusive: PhantomData,
        }
    }

    /// The same elements, read-only, for as long as this view is borrowed.
    pub fn as_slice(&self) -> DeviceSlice<'_, T> {
        DeviceSlice::new(self.buf, self.start..self.start + self.len)
    }

    /// Splits the view in two at `mid` (relative to it): `..mid` and
    /// `mid..`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `mid` is past the view's end.
    pub fn split_at(self, mid: usize) -> Result<(DeviceSliceMut<'a, T>, DeviceSliceMut<'a, T>)> {
        if mid > self.len {
            return Err(Error::InvalidArgument(format!(
                "splitting a view of {} elements at {mid}",
                self.len
            )));
        }
        let at = self.start + mid;
        Ok((
            DeviceSliceMut::new(self.buf, self.start..at),
            DeviceSliceMut::new(self.buf, at..self.start + self.len),
        ))
    }
}

impl<T> DeviceBuffer<T> {
    /// A read-only view of elements `range` (any range syntax: `a..b`,
    /// `a..`, `..`, `a..=b`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `range` is outside the buffer.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use cuda_async::prelude::*;
    /// let buf = h2d((0..8u32).collect::<Vec<_>>()).sync()?;
    /// let tail = d2h(buf.slice(5..)?).sync()?;
    /// assert_eq!(tail.as_slice()?, &[5, 6, 7]);
    /// # Ok::<(), cuda_async::Error>(())
    /// ```
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<DeviceSlice<'_, T>> {
        let r = bounds(range, self.len())?;
        Ok(DeviceSlice::new(self, r))
    }

    /// A writable view of elements `range`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `range` is outside the buffer.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<DeviceSliceMut<'_, T>> {
        let r = bounds(range, self.len())?;
        Ok(DeviceSliceMut::new(self, r))
    }

    /// Two writable views, `..mid` and `mid..`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `mid` is past the end.
    pub fn split_at_mut(
        &mut self,
        mid: usize,
    ) -> Result<(DeviceSliceMut<'_, T>, DeviceSliceMut<'_, T>)> {
        let len = self.len();
        self.slice_mut(..)?.split_at(mid.min(len + 1))
    }

    /// Writable views of `chunk` elements each (the last one shorter if
    /// `chunk` does not divide the length), in order: one per stream of
    /// a `join_all`, say.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a `chunk` of 0.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use cuda_async::prelude::*;
    /// let mut buf = zeros::<u8>(10).sync()?;
    /// let parts = buf.chunks_mut(4)?;
    /// assert_eq!(parts.iter().map(|p| p.len()).collect::<Vec<_>>(), [4, 4, 2]);
    /// # Ok::<(), cuda_async::Error>(())
    /// ```
    pub fn chunks_mut(&mut self, chunk: usize) -> Result<Vec<DeviceSliceMut<'_, T>>> {
        if chunk == 0 {
            return Err(Error::InvalidArgument("chunks of 0 elements".into()));
        }
        let len = self.len();
        let this: &DeviceBuffer<T> = self;
        Ok((0..len)
            .step_by(chunk)
            .map(|s| DeviceSliceMut::new(this, s..(s + chunk).min(len)))
            .collect())
    }
}

/// What a download reads: a whole buffer (owned, borrowed or `Arc`ed) or
/// a view of one.
pub trait DeviceSource<T>: Send {
    /// The buffer.
    fn buffer(&self) -> &DeviceBuffer<T>;
    /// The elements read.
    fn range(&self) -> Range<usize>;
}

impl<T, B: std::borrow::Borrow<DeviceBuffer<T>> + Send> DeviceSource<T> for B {
    fn buffer(&self) -> &DeviceBuffer<T> {
        self.borrow()
    }
    fn range(&self) -> Range<usize> {
        0..self.borrow().len()
    }
}

impl<T: Sync> DeviceSource<T> for DeviceSlice<'_, T> {
    fn buffer(&self) -> &DeviceBuffer<T> {
        self.buf
    }
    fn range(&self) -> Range<usize> {
        self.start..self.start + self.len
    }
}

impl<T: Send + Sync> DeviceSource<T> for DeviceSliceMut<'_, T> {
    fn buffer(&self) -> &DeviceBuffer<T> {
        self.buf
    }
    fn range(&self) -> Range<usize> {
        self.start..self.start + self.len
    }
}

/// What an op writes in place: a whole buffer (owned or `&mut`) or a
/// writable view of one. The op holds it exclusively and yields it back.
pub trait DeviceTarget<T>: Send {
    /// The buffer.
    fn buffer(&self) -> &DeviceBuffer<T>;
    /// The elements written.
    fn range(&self) -> Range<usize>;
}

impl<T: Send> DeviceTarget<T> for DeviceBuffer<T> {
    fn buffer(&self) -> &DeviceBuffer<T> {
        self
    }
    fn range(&self) -> Range<usize> {
        0..self.len()
    }
}

impl<T: Send> DeviceTarget<T> for &mut DeviceBuffer<T> {
    fn buffer(&self) -> &DeviceBuffer<T> {
        self
    }
    fn range(&self) -> Range<usize> {
        0..self.len()
    }
}

impl<T: Send + Sync> DeviceTarget<T> for DeviceSliceMut<'_, T> {
    fn buffer(&self) -> &DeviceBuffer<T> {
        self.buf
    }
    fn range(&self) -> Range<usize> {
        self.start..self.start + self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_follow_range_syntax_and_refuse_what_is_outside() {
        assert_eq!(bounds(2..5, 8).unwrap(), 2..5);
        assert_eq!(bounds(..3, 8).unwrap(), 0..3);
        assert_eq!(bounds(6.., 8).unwrap(), 6..8);
        assert_eq!(bounds(.., 8).unwrap(), 0..8);
        assert_eq!(bounds(1..=7, 8).unwrap(), 1..8);
        assert_eq!(bounds(8..8, 8).unwrap(), 8..8);
        for bad in [bounds(2..9, 8), bounds(9.., 8), bounds(1..=8, 8)] {
            let e = bad.unwrap_err().to_string();
            assert!(e.contains("of a buffer of 8"), "{e}");
        }
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = bounds(5..2, 8);
        assert!(reversed.is_err());
        assert!(bounds(0..=usize::MAX, 8).is_err());
    }
}
