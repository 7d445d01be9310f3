//! Host memory that downloads land in: [`HostBuffer`] (pinned memory filled
//! by a local DMA, or plain memory filled from a remote reply), the aligned
//! storage a remote read is received into ([`ReadSlot`], [`ReadBuf`]), and
//! the host destination a remote read is copied to on reply.

use std::fmt;
use std::marker::PhantomData;
use std::mem::{align_of, size_of};
use std::sync::{Arc, OnceLock};

use cuda_core::{AnyBitPattern, Error, PinnedBuffer, Result};

/// A download's host result: pinned memory filled by a local DMA, or plain
/// memory filled from a remote reply. Needs no driver to exist.
///
/// Reading it before its op completed waits for the DMA locally and is an
/// error remotely (the batch may not even have been sent).
pub struct HostBuffer<T> {
    inner: HostInner<T>,
}

enum HostInner<T> {
    Pinned(PinnedBuffer<T>),
    Remote {
        slot: Arc<ReadSlot>,
        _t: PhantomData<fn() -> T>,
    },
}

impl<T: AnyBitPattern> fmt::Debug for HostBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let home = match &self.inner {
            HostInner::Pinned(_) => "pinned",
            HostInner::Remote { .. } => "remote reply",
        };
        f.debug_struct("HostBuffer")
            .field("len", &self.len())
            .field("home", &home)
            .finish()
    }
}

impl<T: AnyBitPattern> From<PinnedBuffer<T>> for HostBuffer<T> {
    fn from(p: PinnedBuffer<T>) -> Self {
        HostBuffer {
            inner: HostInner::Pinned(p),
        }
    }
}

impl<T: AnyBitPattern> HostBuffer<T> {
    /// The host result of a remote read of `slot.len()` bytes.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the slot's length is not a whole
    /// number of `T`s, or `T` needs more than 16-byte alignment.
    pub fn remote(slot: Arc<ReadSlot>) -> Result<Self> {
        if size_of::<T>() == 0 || !slot.len().is_multiple_of(size_of::<T>()) || align_of::<T>() > 16
        {
            return Err(Error::InvalidArgument(format!(
                "a read of {} bytes is not a whole number of {}",
                slot.len(),
                std::any::type_name::<T>()
            )));
        }
        Ok(HostBuffer {
            inner: HostInner::Remote {
                slot,
                _t: PhantomData,
            },
        })
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match &self.inner {
            HostInner::Pinned(p) => p.len(),
            HostInner::Remote { slot, .. } => slot.len() / size_of::<T>(),
        }
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements: locally after waiting for the DMA; remotely once the
    /// reply arrived.
    ///
    /// # Errors
    ///
    /// Locally, an error of the copy; remotely,
    /// [`Error::InvalidArgument`] when read before its submission
    /// completed.
    pub fn as_slice(&self) -> Result<&[T]> {
        match &self.inner {
            HostInner::Pinned(p) => p.as_slice(),
            HostInner::Remote { slot, .. } => {
                let bytes = slot.bytes().ok_or_else(|| {
                    Error::InvalidArgument(
                        "a remote download was read before its submission completed".into(),
                    )
                })?;
                // SAFETY: the storage is 16-byte aligned (checked against
                // T's alignment in `remote`), holds `len * size_of::<T>()`
                // initialised bytes, and any bit pattern is a valid `T`.
                Ok(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), self.len()) })
            }
        }
    }

    /// The elements, copied out.
    ///
    /// # Errors
    ///
    /// As [`HostBuffer::as_slice`].
    pub fn to_vec(&self) -> Result<Vec<T>> {
        self.as_slice().map(<[T]>::to_vec)
    }

    /// The pinned buffer of a local download (for [`copy_h2d`] and
    /// interop).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a remote download, whose bytes are
    /// plain memory.
    ///
    /// [`copy_h2d`]: crate::copy_h2d
    pub fn into_pinned(self) -> Result<PinnedBuffer<T>> {
        match self.inner {
            HostInner::Pinned(p) => Ok(p),
            HostInner::Remote { .. } => Err(Error::InvalidArgument(
                "a remote download has no pinned buffer".into(),
            )),
        }
    }

    /// Whether the data is there: locally, no DMA into it is pending;
    /// remotely, the reply arrived.
    ///
    /// # Errors
    ///
    /// Locally, the sticky error if the GPU faulted before the copy ended.
    pub fn is_idle(&self) -> Result<bool> {
        match &self.inner {
            HostInner::Pinned(p) => p.is_idle(),
            HostInner::Remote { slot, .. } => Ok(slot.bytes().is_some()),
        }
    }

    /// True when the data came from a remote reply.
    pub fn is_remote(&self) -> bool {
        matches!(self.inner, HostInner::Remote { .. })
    }
}

/// Where the bytes of one remote read land: storage aligned for any
/// element type, filled once by the session when the reply arrives.
pub struct ReadSlot {
    len: usize,
    bytes: OnceLock<Box<[u128]>>,
}

impl fmt::Debug for ReadSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadSlot")
            .field("len", &self.len)
            .field("received", &self.bytes.get().is_some())
            .finish()
    }
}

impl ReadSlot {
    pub(crate) fn new(len: usize) -> Self {
        ReadSlot {
            len,
            bytes: OnceLock::new(),
        }
    }

    /// Bytes the read returns.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty read.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Receives the read's bytes: `fill` writes all `len()` of them
    /// straight into the slot's storage (from the network, say), which
    /// becomes visible once it returns `Ok`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if the slot was filled already; `fill`'s
    /// error otherwise.
    pub fn receive(&self, fill: impl FnOnce(&mut [u8]) -> Result<()>) -> Result<()> {
        let mut buf = self.buffer();
        fill(buf.as_mut())?;
        self.commit(buf)
    }

    /// Storage for this read's bytes, to be filled (by an asynchronous
    /// receive, say) and then handed back with [`ReadSlot::commit`]. A
    /// large one is backed by huge pages where the kernel offers them
    /// ([`cuda_core::hostmem::prefer_huge_pages`]).
    pub fn buffer(&self) -> ReadBuf {
        let words = vec![0u128; self.len.div_ceil(16)].into_boxed_slice();
        cuda_core::hostmem::prefer_huge_pages(&words);
        ReadBuf {
            words,
            len: self.len,
        }
    }

    /// Makes a filled [`ReadSlot::buffer`] the slot's bytes.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] if the slot was filled already or `buf`
    /// is not of its length.
    pub fn commit(&self, buf: ReadBuf) -> Result<()> {
        if buf.len != self.len {
            return Err(Error::InvalidArgument(
                "a read buffer of another length".into(),
            ));
        }
        self.bytes
            .set(buf.words)
            .map_err(|_| Error::InvalidArgument("a read slot was filled twice".into()))
    }

    /// The bytes, once received.
    pub fn bytes(&self) -> Option<&[u8]> {
        let words = self.bytes.get()?;
        // SAFETY: the storage holds at least `len` initialised bytes and
        // lives as long as `self`.
        Some(unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), self.len) })
    }
}

/// Storage for one read's bytes, aligned for any element type (see
/// [`ReadSlot::buffer`]).
pub struct ReadBuf {
    words: Box<[u128]>,
    len: usize,
}

impl fmt::Debug for ReadBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadBuf").field("len", &self.len).finish()
    }
}

impl AsMut<[u8]> for ReadBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: `words` is `len.div_ceil(16) * 16 >= len` bytes, any byte
        // value is a valid `u128` byte, and the borrow is tied to `self`.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), self.len) }
    }
}

/// Where a remote read is copied on reply: `len` bytes of host memory that
/// the submission's output owns and nothing else touches until the output
/// is handed out (which happens after the copy).
pub(crate) struct HostPtr(pub(crate) *mut u8, pub(crate) usize);

// SAFETY: the memory is owned by the submission's output, which nothing
// accesses until the reply steps have run; the pointer only moves to the
// thread that runs them.
unsafe impl Send for HostPtr {}

impl HostPtr {
    pub(crate) fn fill_from(self, slot: &ReadSlot) {
        if let Some(bytes) = slot.bytes() {
            let n = bytes.len().min(self.1);
            // SAFETY: `self.0` addresses `self.1` writable bytes (see the
            // type's contract); `bytes` is another allocation.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.0, n) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_slots_are_aligned_for_any_element_type() {
        let slot = ReadSlot::new(40);
        slot.receive(|b| {
            b.fill(0);
            Ok(())
        })
        .unwrap();
        assert_eq!(slot.bytes().unwrap().as_ptr() as usize % 16, 0);
    }
}
