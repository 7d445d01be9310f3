//! The memory primitives as a remote context records them: commands that
//! name the session's buffers by id, with the bytes of uploads in the
//! submission's message and downloads received from its reply.

use std::ops::Range;

use cuda_core::cudarc::driver::DeviceRepr;
use cuda_core::{AnyBitPattern, Result};

use super::context::RemoteContext;
use super::proto::{Id, Op, Operand};
use crate::buffer::DeviceBuffer;
use crate::host::HostBuffer;
use crate::memory::{as_bytes, byte_range, HostSource};
use crate::pinned_host::PinnedHost;

impl RemoteContext {
    /// Records the allocation of a buffer and the write of `src` into it:
    /// owned data is kept by the recording as it is, borrowed data copied.
    pub(crate) fn upload<T: DeviceRepr, S: HostSource<T>>(
        &mut self,
        src: S,
    ) -> Result<DeviceBuffer<T>> {
        let len = src.host_slice().len();
        let dst = self.alloc::<T>(len)?;
        let (stream, id) = (self.stream(), self.id_of(&dst)?);
        if len != 0 {
            match src.into_kept() {
                Ok(bytes) => self.recording.write_kept(stream, id, 0, bytes),
                Err(src) => self
                    .recording
                    .write(stream, id, 0, as_bytes(src.host_slice())),
            }
        }
        Ok(dst)
    }

    /// Records the write of `values` into `dst` from element `at` on.
    pub(crate) fn write_elems<T: DeviceRepr>(
        &mut self,
        dst: &DeviceBuffer<T>,
        at: usize,
        values: &[T],
    ) -> Result<()> {
        let (stream, id) = (self.stream(), self.id_of(dst)?);
        let (offset, _) = byte_range::<T>(&(at..at));
        self.recording.write(stream, id, offset, as_bytes(values));
        Ok(())
    }

    /// Records a read of elements `range` of `src`, received straight into
    /// the returned buffer's storage from the reply.
    pub(crate) fn download<T: AnyBitPattern>(
        &mut self,
        src: &DeviceBuffer<T>,
        range: Range<usize>,
    ) -> Result<HostBuffer<T>> {
        let (stream, id) = (self.stream(), self.id_of(src)?);
        let (at, len) = byte_range::<T>(&range);
        let slot = self.recording.read(stream, id, at, len);
        HostBuffer::remote(slot)
    }

    /// Records a read of elements `range` of `src`, copied into `dst` on
    /// reply (the op owns or shares `dst` until then).
    pub(crate) fn download_into<T: AnyBitPattern, H: PinnedHost<T>>(
        &mut self,
        src: &DeviceBuffer<T>,
        range: Range<usize>,
        dst: &mut H,
    ) -> Result<()> {
        let (stream, id) = (self.stream(), self.id_of(src)?);
        let (at, len) = byte_range::<T>(&range);
        let slot = self.recording.read(stream, id, at, len);
        let fill = dst.reply_filler()?;
        self.on_reply(move || fill(&slot));
        Ok(())
    }

    /// Records the write of `src`'s contents (as they are now) into
    /// elements `range` of `dst`.
    pub(crate) fn upload_from<T: DeviceRepr, H: PinnedHost<T>>(
        &mut self,
        src: &mut H,
        dst: &DeviceBuffer<T>,
        range: Range<usize>,
    ) -> Result<()> {
        let (stream, id) = (self.stream(), self.id_of(dst)?);
        if !range.is_empty() {
            let (at, _) = byte_range::<T>(&range);
            let recording = &mut self.recording;
            src.with_contents(&mut |v| recording.write(stream, id, at, as_bytes(v)))?;
        }
        Ok(())
    }

    /// Records a copy of elements `from` of `src` into elements `to` of
    /// `dst` (of the same length).
    pub(crate) fn copy<T>(
        &mut self,
        src: &DeviceBuffer<T>,
        from: Range<usize>,
        dst: &DeviceBuffer<T>,
        to: Range<usize>,
    ) -> Result<()> {
        let ((src_at, len), (dst_at, _)) = (byte_range::<T>(&from), byte_range::<T>(&to));
        let (stream, sid, did) = (self.stream(), self.id_of(src)?, self.id_of(dst)?);
        if len > 0 {
            let (src, dst) = (Operand::new(Id(sid), src_at), Operand::new(Id(did), dst_at));
            self.recording.push(stream, Op::Copy { src, dst, len });
        }
        Ok(())
    }

    /// Records a fill of every byte of elements `range` of `buf` with
    /// `value`.
    pub(crate) fn fill<T>(
        &mut self,
        buf: &DeviceBuffer<T>,
        range: Range<usize>,
        value: u8,
    ) -> Result<()> {
        let (stream, id) = (self.stream(), self.id_of(buf)?);
        let (offset, len) = byte_range::<T>(&range);
        if len > 0 {
            let buf = Id(id);
            self.recording.push(
                stream,
                Op::Fill {
                    buf,
                    offset,
                    len,
                    value,
                },
            );
        }
        Ok(())
    }
}
