//! [`DeviceBuffer`]: device memory with one of two homes, a local GPU or a
//! remote session's GPU.

use std::fmt;
use std::marker::PhantomData;
use std::mem::size_of;
use std::sync::Arc;

use cuda_core::cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use cuda_core::{Error, Result};

use crate::remote::RemoteSession;

/// Device memory that lives on a local GPU (a cudarc slice that tracks its
/// uses on every stream) or on the GPU of a remote session (an id, a length
/// and the session).
///
/// Ops accept either and check that the buffer lives where the op runs: a
/// buffer of another home is [`Error::WrongHome`], naming both. Dropping a
/// buffer never frees memory the GPU may still use: locally the free is
/// ordered after the buffer's last use on every stream; remotely a free is
/// queued that reaches the node after every submitted use (a buffer
/// dropped while a submission is being recorded is freed at that
/// submission's end).
///
/// Interop with cudarc and other CUDA libraries goes through the local
/// home: [`DeviceBuffer::local`], [`DeviceBuffer::from_cuda_slice`].
pub struct DeviceBuffer<T> {
    home: Home<T>,
}

enum Home<T> {
    Local(cuda_core::DeviceBuffer<T>),
    Remote(RemoteBuffer<T>),
}

/// A buffer of a remote session: freed through the session on drop.
pub(crate) struct RemoteBuffer<T> {
    id: u64,
    len: usize,
    session: Arc<dyn RemoteSession>,
    _t: PhantomData<fn() -> T>,
}

impl<T> Drop for RemoteBuffer<T> {
    fn drop(&mut self) {
        crate::remote::free_remote(&self.session, self.id);
    }
}

impl<T> fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.home {
            Home::Local(b) => b.fmt(f),
            Home::Remote(r) => f
                .debug_struct("DeviceBuffer")
                .field("len", &r.len)
                .field("id", &r.id)
                .field("home", &r.session.describe())
                .finish(),
        }
    }
}

impl<T> From<cuda_core::DeviceBuffer<T>> for DeviceBuffer<T> {
    fn from(b: cuda_core::DeviceBuffer<T>) -> Self {
        DeviceBuffer {
            home: Home::Local(b),
        }
    }
}

/// Names a local buffer's home for errors.
pub(crate) fn local_home(device: usize) -> String {
    format!("local GPU {device}")
}

impl<T> DeviceBuffer<T> {
    /// A local buffer owning a cudarc slice (interop: memory another CUDA
    /// library allocated).
    pub fn from_cuda_slice(slice: CudaSlice<T>) -> Self
    where
        T: DeviceRepr,
    {
        cuda_core::DeviceBuffer::from_cuda_slice(slice).into()
    }

    /// A buffer of `len` elements that a remote session's GPU holds as
    /// `id`. Dropping it queues the free of `id` on `session`.
    ///
    /// For hand-written remote ops (see [`crate::remote::RemoteContext`]);
    /// the id must name an allocation of at least `len * size_of::<T>()`
    /// bytes recorded on that session, owned by nothing else.
    pub fn remote(session: Arc<dyn RemoteSession>, id: u64, len: usize) -> Self {
        DeviceBuffer {
            home: Home::Remote(RemoteBuffer {
                id,
                len,
                session,
                _t: PhantomData,
            }),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match &self.home {
            Home::Local(b) => b.len(),
            Home::Remote(r) => r.len,
        }
    }

    /// True when the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size in bytes.
    pub fn num_bytes(&self) -> usize {
        self.len() * size_of::<T>()
    }

    /// True when the buffer lives on a remote session's GPU.
    pub fn is_remote(&self) -> bool {
        matches!(self.home, Home::Remote(_))
    }

    /// Where the buffer lives, e.g. `local GPU 0` or
    /// `lease 1a2b3c4d... on node gpu-7`.
    pub fn home(&self) -> String {
        match &self.home {
            Home::Local(b) => local_home(b.device().ordinal()),
            Home::Remote(r) => r.session.describe(),
        }
    }

    /// The local buffer (cudarc interop: [`cuda_core::DeviceBuffer::as_cuda_slice`]
    /// and its use tracking).
    ///
    /// # Errors
    /// [`Error::WrongHome`] for a remote buffer.
    pub fn local(&self) -> Result<&cuda_core::DeviceBuffer<T>> {
        match &self.home {
            Home::Local(b) => Ok(b),
            Home::Remote(r) => Err(wrong_home(r.session.describe(), "a local GPU")),
        }
    }

    /// The local buffer, mutably.
    ///
    /// # Errors
    /// [`Error::WrongHome`] for a remote buffer.
    pub fn local_mut(&mut self) -> Result<&mut cuda_core::DeviceBuffer<T>> {
        match &mut self.home {
            Home::Local(b) => Ok(b),
            Home::Remote(r) => Err(wrong_home(r.session.describe(), "a local GPU")),
        }
    }

    /// The local buffer, by value.
    ///
    /// # Errors
    /// [`Error::WrongHome`] for a remote buffer (which is then dropped:
    /// its free is queued).
    pub fn into_local(self) -> Result<cuda_core::DeviceBuffer<T>> {
        match self.home {
            Home::Local(b) => Ok(b),
            Home::Remote(r) => Err(wrong_home(r.session.describe(), "a local GPU")),
        }
    }

    /// The local buffer an op on `stream` uses.
    ///
    /// # Errors
    /// [`Error::WrongHome`] for a remote buffer, naming the stream's device.
    pub(crate) fn local_on(&self, stream: &CudaStream) -> Result<&cuda_core::DeviceBuffer<T>> {
        match &self.home {
            Home::Local(b) => Ok(b),
            Home::Remote(r) => Err(wrong_home(
                r.session.describe(),
                &local_home(stream.context().ordinal()),
            )),
        }
    }

    /// The local buffer, mutably, for an op on `stream`.
    ///
    /// # Errors
    /// As [`DeviceBuffer::local_on`].
    pub(crate) fn local_mut_on(
        &mut self,
        stream: &CudaStream,
    ) -> Result<&mut cuda_core::DeviceBuffer<T>> {
        match &mut self.home {
            Home::Local(b) => Ok(b),
            Home::Remote(r) => Err(wrong_home(
                r.session.describe(),
                &local_home(stream.context().ordinal()),
            )),
        }
    }

    /// The local buffer after a home check passed (kernel arguments: `push`
    /// follows a successful `before`).
    pub(crate) fn expect_local(&self) -> &cuda_core::DeviceBuffer<T> {
        match &self.home {
            Home::Local(b) => b,
            Home::Remote(_) => panic!("a remote buffer passed a local launch's home check"),
        }
    }

    /// As [`DeviceBuffer::expect_local`], mutably.
    pub(crate) fn expect_local_mut(&mut self) -> &mut cuda_core::DeviceBuffer<T> {
        match &mut self.home {
            Home::Local(b) => b,
            Home::Remote(_) => panic!("a remote buffer passed a local launch's home check"),
        }
    }

    /// The id of a buffer an op of `session` uses.
    ///
    /// # Errors
    /// [`Error::WrongHome`] for a local buffer or one of another session.
    pub fn remote_id(&self, session: &Arc<dyn RemoteSession>) -> Result<u64> {
        match &self.home {
            Home::Remote(r)
                if same_session(&r.session, session) || session.accepts(&r.session, r.id) =>
            {
                Ok(r.id)
            }
            _ => Err(wrong_home(self.home(), &session.describe())),
        }
    }

    /// Allocates `len` zeroed elements on `stream`.
    pub(crate) fn zeros_local(stream: &Arc<CudaStream>, len: usize) -> Result<Self>
    where
        T: DeviceRepr + ValidAsZeroBits,
    {
        cuda_core::DeviceBuffer::zeros(stream, len).map(Self::from)
    }
}

/// Whether two session handles are the same session.
pub(crate) fn same_session(a: &Arc<dyn RemoteSession>, b: &Arc<dyn RemoteSession>) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
}

pub(crate) fn wrong_home(buffer: impl Into<String>, context: &str) -> Error {
    Error::WrongHome {
        buffer: buffer.into(),
        context: context.into(),
    }
}
