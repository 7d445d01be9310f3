//! [`Session`]: work on a lease, with RAII [`LeaseBuffer`]s and single
//! requests (alloc, write, read, load, launch).

use std::sync::Arc;

use super::connection::ReplyInto;
use super::lease::LeaseInner;
use super::{Client, Error, ModuleSpec, Recorder};
use crate::proto::{to_body, Id, LaunchArg, LeaseId, MemAlloc, Opcode};

/// Work on a lease: RAII buffers, single requests, and the [`Recorder`]
/// for whole pipelines in one message. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Session {
    pub(crate) inner: Arc<LeaseInner>,
}

/// A buffer in a lease, named by a client-picked id; freed (in the
/// background, after every queued use) when dropped.
#[derive(Debug)]
pub struct LeaseBuffer {
    inner: Arc<LeaseInner>,
    id: Id,
    size: u64,
}

impl LeaseBuffer {
    /// The buffer's id (for kernel arguments and recorded commands).
    pub fn id(&self) -> Id {
        self.id
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// This buffer as a kernel argument.
    pub fn arg(&self) -> LaunchArg<'static> {
        LaunchArg::mem(self.id)
    }
}

impl Drop for LeaseBuffer {
    fn drop(&mut self) {
        self.inner.free_in_background(self.id);
    }
}

impl Session {
    /// The lease id.
    pub fn lease_id(&self) -> LeaseId {
        self.inner.id
    }

    /// The node's address.
    pub fn node_addr(&self) -> std::net::SocketAddr {
        self.inner.client.addr
    }

    /// A fresh id of this lease (for commands recorded by hand).
    pub fn fresh_id(&self) -> Id {
        self.inner.fresh_id()
    }

    /// The client this session's lease lives on.
    pub fn client(&self) -> &Arc<Client> {
        &self.inner.client
    }

    /// A recorder for a pipeline sent as one message.
    pub fn recorder(&self) -> Recorder {
        Recorder {
            inner: self.inner.clone(),
            modules: Vec::new(),
            commands: Vec::new(),
            writes: Vec::new(),
        }
    }

    /// Allocates `size` zeroed bytes (one request).
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Capacity`](crate::client::ErrorKind::Capacity) beyond the reservation.
    pub async fn alloc(&self, size: u64) -> Result<LeaseBuffer, Error> {
        let buf = self.inner.fresh_id();
        let body = to_body(&MemAlloc {
            lease: self.inner.id,
            buf,
            size,
        });
        self.inner
            .req_with(Opcode::MemAlloc, &body, &[], ReplyInto::Owned)
            .await?;
        Ok(LeaseBuffer {
            inner: self.inner.clone(),
            id: buf,
            size,
        })
    }

    /// Copies `bytes` into `buf` at `offset` (streamed, striped when large).
    ///
    /// # Errors
    ///
    /// [`ErrorKind::InvalidRequest`](crate::client::ErrorKind::InvalidRequest) out of bounds.
    pub async fn write(&self, buf: &LeaseBuffer, offset: u64, bytes: &[u8]) -> Result<(), Error> {
        self.write_id(buf.id, offset, bytes).await
    }

    /// Copies `bytes` into buffer `buf` at `offset`.
    ///
    /// # Errors
    ///
    /// As [`Session::write`].
    pub async fn write_id(&self, buf: Id, offset: u64, bytes: &[u8]) -> Result<(), Error> {
        let to = self.target(buf, offset, 0);
        self.inner
            .guard(self.inner.client.striped_write(to, bytes))
            .await
    }

    /// [`Session::write_id`] of bytes the stripes share (so each stripe
    /// of a bulk-data transfer runs on its own task), on the node after the
    /// lease's batch number `after` (0: none; see
    /// [`MemWrite::after`](crate::proto::MemWrite::after)).
    #[cfg(feature = "backend")]
    pub(crate) async fn write_id_shared(
        &self,
        buf: Id,
        offset: u64,
        after: u64,
        bytes: super::bulk::SharedBytes,
    ) -> Result<(), Error> {
        let to = self.target(buf, offset, after);
        self.inner
            .guard(self.inner.client.write_shared(to, bytes))
            .await
    }

    fn target(&self, buf: Id, offset: u64, after: u64) -> super::stripe::Target {
        super::stripe::Target {
            lease: self.inner.id,
            buf,
            offset,
            after,
        }
    }

    /// Reads `len` bytes of `buf` at `offset` (streamed, striped when large).
    ///
    /// # Errors
    ///
    /// [`ErrorKind::InvalidRequest`](crate::client::ErrorKind::InvalidRequest)
    /// for a range outside the buffer.
    pub async fn read(&self, buf: &LeaseBuffer, offset: u64, len: u32) -> Result<Vec<u8>, Error> {
        self.read_id(buf.id, offset, len).await
    }

    /// Reads `len` bytes of buffer `buf` at `offset`.
    ///
    /// # Errors
    ///
    /// As [`Session::read`].
    pub async fn read_id(&self, buf: Id, offset: u64, len: u32) -> Result<Vec<u8>, Error> {
        let out = vec![0u8; len as usize];
        cuda_core::hostmem::prefer_huge_pages(&out);
        self.read_id_after(buf, offset, 0, out).await
    }

    /// Reads as many bytes of `buf` at `offset` as `out` holds, straight
    /// into `out`, and gives it back: a destination used again skips the
    /// page faults and zeroing of a fresh one, which a large [`Session::read`]
    /// pays on each call.
    ///
    /// ```no_run
    /// # async fn f(s: &cuda_lease::client::Session, big: &cuda_lease::client::LeaseBuffer) -> Result<(), cuda_lease::client::Error> {
    /// let mut out = vec![0u8; 64 << 20];
    /// for _ in 0..10 {
    ///     out = s.read_into(big, 0, out).await?;
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`Session::read`].
    pub async fn read_into<B>(&self, buf: &LeaseBuffer, offset: u64, out: B) -> Result<B, Error>
    where
        B: AsMut<[u8]> + Send + 'static,
    {
        self.read_id_after(buf.id, offset, 0, out).await
    }

    /// [`Session::read_into`] of buffer `buf`, on the node after the
    /// lease's batch number `after` (0: none; see
    /// [`MemRead::after`](crate::proto::MemRead::after)).
    pub(crate) async fn read_id_after<B>(
        &self,
        buf: Id,
        offset: u64,
        after: u64,
        out: B,
    ) -> Result<B, Error>
    where
        B: AsMut<[u8]> + Send + 'static,
    {
        let to = self.target(buf, offset, after);
        self.inner
            .guard(self.inner.client.striped_read_to(to, out))
            .await
    }

    /// The smallest transfer that leaves a submission's message for the
    /// data path ([`ClientConfig::data_path_min_bytes`](super::ClientConfig::data_path_min_bytes)).
    #[cfg(feature = "backend")]
    pub(crate) fn stream_min_bytes(&self) -> usize {
        self.inner.client.config.data_path_min_bytes
    }

    /// Loads a PTX module now (one request), so a bad one fails here with
    /// its JIT log. Launches carry modules themselves: this is only a
    /// warm-up.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::LoadFailed`](crate::client::ErrorKind::LoadFailed) with the JIT log.
    pub async fn load_module(&self, ptx: &str) -> Result<ModuleSpec, Error> {
        let module = ModuleSpec::ptx(ptx);
        self.load(&module).await?;
        Ok(module)
    }

    /// Loads (CUDA C: compiles on the node) `module` now.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::LoadFailed`](crate::client::ErrorKind::LoadFailed) with the compile or JIT log.
    pub async fn load(&self, module: &ModuleSpec) -> Result<(), Error> {
        let mut rec = self.recorder();
        rec.use_module(module);
        rec.submit().await?.ok().map(drop)
    }

    /// Launches a kernel on stream 0 and waits for it (one request).
    ///
    /// # Errors
    ///
    /// [`ErrorKind::LaunchFailed`](crate::client::ErrorKind::LaunchFailed) (a fault: the lease is then poisoned),
    /// [`ErrorKind::InvalidRequest`](crate::client::ErrorKind::InvalidRequest) for an unknown kernel.
    pub async fn launch(
        &self,
        module: &ModuleSpec,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        args: Vec<LaunchArg<'static>>,
    ) -> Result<(), Error> {
        let mut rec = self.recorder();
        rec.launch(0, module, kernel, grid, block, args);
        rec.submit().await?.ok().map(drop)
    }
}
