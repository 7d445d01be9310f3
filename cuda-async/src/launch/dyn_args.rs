//! Kernel argument lists built at run time: [`DynArgs`] of [`DynArg`]s.

use std::fmt;

use cuda_core::cudarc::driver::{CudaStream, CudaView, LaunchArgs, PushKernelArg};
use cuda_core::{Error, Kernel, ParamClass, Result, UseMark};

use super::{KernelArgs, WireArg, PTR};
use crate::buffer::DeviceBuffer;
use crate::remote::{Id, RemoteContext};

/// One kernel argument chosen at run time (see [`DynArgs`]).
pub enum DynArg<'a> {
    /// Bytes passed by value (a scalar or a struct, little-endian as the
    /// kernel expects); their length must equal the PTX parameter's size.
    Bytes(Vec<u8>),
    /// The device address of `buffer` plus `offset` bytes. The kernel may
    /// read or write it: the launch is ordered after every earlier use of
    /// the buffer and recorded as a write.
    Buffer {
        /// The buffer.
        buffer: &'a DeviceBuffer<u8>,
        /// Byte offset into it (at most its length).
        offset: usize,
    },
}

impl fmt::Debug for DynArg<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DynArg::Bytes(b) => write!(f, "Bytes({} bytes)", b.len()),
            DynArg::Buffer { buffer, offset } => {
                write!(f, "Buffer {{ len: {}, offset: {offset} }}", buffer.len())
            }
        }
    }
}

enum DynSlot<'a> {
    /// Byte values in 8-byte aligned storage (the driver reads the
    /// parameter's size from it, which the check makes equal to `len`).
    Bytes { words: Box<[u64]>, len: usize },
    Buffer {
        buffer: &'a DeviceBuffer<u8>,
        offset: usize,
        /// The local address (`None` for a remote buffer).
        view: Option<CudaView<'a, u8>>,
    },
}

/// A kernel argument list built at run time, for callers that learn it
/// only then (a lease node's worker, an interpreter, a plugin host), where
/// [`KernelArgs`] tuples fix it at compile time.
///
/// Checked as strictly as tuples, and more: the kernel's PTX parameter list
/// must be known (so a kernel whose PTX could not be parsed is refused),
/// the count must match, and each byte argument must be exactly its
/// parameter's size (device addresses are 8-byte integers).
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// use cuda_async::{DeviceBuffer, DynArg, DynArgs, LaunchConfig, Module};
/// let k = Module::cuda(r#"extern "C" __global__ void fill(unsigned char* p, unsigned char v) {
///     p[threadIdx.x] = v; }"#, &[])?.kernel("fill")?;
/// let buf: DeviceBuffer<u8> = zeros::<u8>(32).sync()?;
/// let args = DynArgs::new(vec![DynArg::Buffer { buffer: &buf, offset: 0 }, DynArg::Bytes(vec![7])])?;
/// let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 };
/// // SAFETY: 32 threads write p[0..32) of a 32-byte buffer.
/// unsafe { launch(&k, cfg, args) }.sync()?;
/// assert_eq!(d2h(&buf).sync()?.to_vec()?, vec![7u8; 32]);
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub struct DynArgs<'a> {
    slots: Vec<DynSlot<'a>>,
}

impl fmt::Debug for DynArgs<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DynArgs")
            .field("len", &self.slots.len())
            .finish()
    }
}

impl<'a> DynArgs<'a> {
    /// The argument list `args`, in order.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if a buffer offset is past the buffer's
    /// end, or a byte argument is empty.
    pub fn new(args: Vec<DynArg<'a>>) -> Result<Self> {
        let slots = args
            .into_iter()
            .enumerate()
            .map(|(i, a)| match a {
                DynArg::Bytes(b) if b.is_empty() => Err(Error::InvalidArgument(format!(
                    "kernel argument {i} is empty"
                ))),
                DynArg::Bytes(b) => {
                    let mut words = vec![0u64; b.len().div_ceil(8)].into_boxed_slice();
                    for (j, byte) in b.iter().enumerate() {
                        words[j / 8] |= u64::from(*byte) << (8 * (j % 8));
                    }
                    Ok(DynSlot::Bytes {
                        words,
                        len: b.len(),
                    })
                }
                DynArg::Buffer { buffer, offset } => {
                    if offset > buffer.len() {
                        return Err(Error::InvalidArgument(format!(
                            "kernel argument {i}: offset {offset} is past the end of a buffer of \
                             {} bytes",
                            buffer.len()
                        )));
                    }
                    let view = match buffer.local() {
                        Ok(b) => b.as_cuda_slice().try_slice(offset..),
                        Err(_) => None,
                    };
                    Ok(DynSlot::Buffer {
                        buffer,
                        offset,
                        view,
                    })
                }
            })
            .collect::<Result<_>>()?;
        Ok(DynArgs { slots })
    }

    fn buffers(&self) -> impl Iterator<Item = &DeviceBuffer<u8>> {
        self.slots.iter().filter_map(|s| match s {
            DynSlot::Buffer { buffer, .. } => Some(*buffer),
            DynSlot::Bytes { .. } => None,
        })
    }
}

impl KernelArgs for DynArgs<'_> {
    fn check(&self, kernel: &Kernel) -> Result<()> {
        if kernel.params().is_none() {
            return Err(Error::ArgumentMismatch {
                kernel: kernel.name().into(),
                detail: "the kernel's parameter list could not be read from its PTX, and \
                         run-time arguments are only launched against a known list"
                    .into(),
            });
        }
        let specs: Vec<_> = self
            .slots
            .iter()
            .map(|s| match s {
                DynSlot::Bytes { len, .. } => (*len, ParamClass::Bits, "bytes"),
                DynSlot::Buffer { .. } => (PTR.0, PTR.1, "device address"),
            })
            .collect();
        kernel.check_args(&specs)
    }
    fn push_all<'b>(&'b mut self, args: &mut LaunchArgs<'b>) {
        for s in &self.slots {
            match s {
                DynSlot::Bytes { words, .. } => {
                    args.arg(&words[0]);
                }
                DynSlot::Buffer { view, .. } => {
                    args.arg(
                        view.as_ref()
                            .expect("a local buffer (checked by before_all)"),
                    );
                }
            }
        }
    }
    fn before_all(&self, stream: &CudaStream) -> Result<()> {
        self.buffers()
            .try_for_each(|b| b.local_on(stream)?.before_write(stream))
    }
    fn after_all(&self, mark: &UseMark<'_>) -> Result<()> {
        let mut first = Ok(());
        for b in self.buffers() {
            if let Err(e) = b.expect_local().after_write_with(mark) {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }
    fn remote_all(&self, ctx: &RemoteContext) -> Result<Vec<WireArg>> {
        self.slots
            .iter()
            .map(|s| match s {
                DynSlot::Bytes { words, len } => {
                    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
                    Ok(WireArg::bytes(&bytes[..*len]))
                }
                DynSlot::Buffer { buffer, offset, .. } => Ok(WireArg::Mem {
                    buf: Id(ctx.id_of(buffer)?),
                    offset: *offset as u64,
                }),
            })
            .collect()
    }
}
