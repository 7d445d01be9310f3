//! A module's `__device__` (and `__constant__`) variables as stream-ordered
//! ops: [`read_global`] and [`write_global`], what `cudaMemcpyFromSymbol`
//! and `cudaMemcpyToSymbol` do.
//!
//! The copies are ordered on the op's stream, after the ops before them
//! in the chain, like a launch. A global is not a tracked buffer: kernels
//! that use it on other streams are ordered against these copies only if
//! they are in the same chain (`then`), not by the variable itself.

use std::fmt;
use std::marker::PhantomData;

use cuda_core::cudarc::driver::DeviceRepr;
use cuda_core::{AnyBitPattern, Error, Module, ModuleGlobal, PinnedBuffer, Result};

use crate::context::ExecutionContext;
use crate::host::HostBuffer;
use crate::op::{impl_into_future, DeviceOp};

/// Op for [`read_global`].
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct ReadGlobal<T> {
    module: Module,
    name: String,
    _t: PhantomData<fn() -> T>,
}

impl<T> fmt::Debug for ReadGlobal<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadGlobal")
            .field("name", &self.name)
            .finish()
    }
}

/// Reads the `__device__` (or `__constant__`) variable `name` of `module`
/// as `T`s, into a [`HostBuffer`]: on the op's stream, after the ops before
/// it (the module is loaded on the device first if it is not yet).
///
/// # Errors
/// At execution: a module without that global, or whose global's size is
/// not a whole number of `T`s ([`Error::InvalidArgument`]); on a remote
/// policy, [`Error::NeedsLocalStream`] naming the op.
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// use cuda_async::{read_global, write_global, Module};
/// let m = Module::cuda("__device__ unsigned hits; extern \"C\" __global__ void k() {}", &[])?;
/// let hits = write_global(&m, "hits", vec![7u32])
///     .then(|_| read_global::<u32>(&m, "hits"))
///     .sync()?;
/// assert_eq!(hits.as_slice()?, &[7]);
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub fn read_global<T: AnyBitPattern>(module: &Module, name: &str) -> ReadGlobal<T> {
    ReadGlobal {
        module: module.clone(),
        name: name.to_owned(),
        _t: PhantomData,
    }
}

/// The global `name` of `module` on the context's device, for `op`.
fn global_of(
    ctx: &ExecutionContext,
    module: &Module,
    name: &str,
    op: &str,
) -> Result<ModuleGlobal> {
    ctx.cuda_stream_for(op)?;
    module.global_on(ctx.device()?, name)
}

impl<T: AnyBitPattern> DeviceOp for ReadGlobal<T> {
    type Output = HostBuffer<T>;

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<HostBuffer<T>> {
        let g = global_of(ctx, &self.module, &self.name, "read_global")?;
        let size = std::mem::size_of::<T>().max(1);
        if g.bytes() % size != 0 {
            return Err(Error::InvalidArgument(format!(
                "global `{}` is {} bytes, not a whole number of {}-byte elements",
                self.name,
                g.bytes(),
                size
            )));
        }
        let stream = ctx.cuda_stream()?.clone();
        // SAFETY: the copy enqueued below overwrites every element (it
        // refuses a buffer of another size than the global), and host
        // access waits for its recorded use; on error the buffer is dropped
        // unread.
        let mut dst = unsafe { PinnedBuffer::<T>::uninit(ctx.device()?, g.bytes() / size) }?;
        if g.bytes() == 0 {
            return Ok(dst.into());
        }
        dst.download_from_global(&g, &stream)?;
        Ok(dst.into())
    }
}
impl_into_future!(impl[T: AnyBitPattern] for ReadGlobal<T>);

/// Op for [`write_global`].
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct WriteGlobal<T> {
    module: Module,
    name: String,
    values: Vec<T>,
}

impl<T> fmt::Debug for WriteGlobal<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WriteGlobal")
            .field("name", &self.name)
            .field("len", &self.values.len())
            .finish()
    }
}

/// Writes `values` into the `__device__` variable `name` of `module`, on
/// the op's stream after the ops before it; `values` must fill the
/// variable exactly.
///
/// # Errors
/// At execution: a module without that global, or `values` of another size
/// than the global ([`Error::InvalidArgument`], naming both sizes); on a
/// remote policy, [`Error::NeedsLocalStream`] naming the op.
pub fn write_global<T: DeviceRepr + Copy + Send + Sync + 'static>(
    module: &Module,
    name: &str,
    values: Vec<T>,
) -> WriteGlobal<T> {
    WriteGlobal {
        module: module.clone(),
        name: name.to_owned(),
        values,
    }
}

impl<T: DeviceRepr + Copy + Send + Sync + 'static> DeviceOp for WriteGlobal<T> {
    type Output = ();

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<()> {
        let g = global_of(ctx, &self.module, &self.name, "write_global")?;
        let bytes = std::mem::size_of_val(&self.values[..]);
        if bytes != g.bytes() {
            return Err(Error::InvalidArgument(format!(
                "global `{}` is {} bytes; {} bytes were given",
                self.name,
                g.bytes(),
                bytes
            )));
        }
        if bytes == 0 {
            return Ok(());
        }
        let stream = ctx.cuda_stream()?.clone();
        let mut src = PinnedBuffer::from_slice(ctx.device()?, &self.values)?;
        // The buffer's drop waits for the copy's recorded use.
        src.upload_to_global(&g, &stream)
    }
}
impl_into_future!(impl[T: DeviceRepr + Copy + Send + Sync + 'static] for WriteGlobal<T>);
