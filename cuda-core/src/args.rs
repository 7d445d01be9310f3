//! Kernel argument lists built at run time, in storage reused by every
//! launch, and their launch ([`Kernel::launch_with`]): one driver call,
//! no allocation once the storage has grown, the list checked against the
//! kernel's PTX parameters first.
//!
//! For callers that learn a kernel's arguments only at run time and launch
//! many times (a server that runs kernels others describe); `cuda-async`'s `DynArgs` builds such
//! a list per launch and orders its buffers itself.

use std::ffi::c_void;

use cudarc::driver::{result, CudaStream, DevicePtr, LaunchConfig};

use crate::buffer::DeviceBuffer;
use crate::device::Device;
use crate::error::{DriverResultExt, Error, Result};
use crate::module::{Kernel, ParamClass};
use crate::raw::check_same_context;

/// Storage for run-time kernel argument lists, reused by every list
/// [`ArgList::start`] begins: the values in 8-byte aligned words, where each
/// starts, its size and class for the parameter check, and the driver's
/// array of pointers (filled only during a launch).
#[derive(Debug, Default)]
pub struct ArgList {
    words: Vec<u64>,
    at: Vec<usize>,
    specs: Vec<(usize, ParamClass, &'static str)>,
    /// Empty except inside [`Kernel::launch_with`].
    ptrs: Vec<*mut c_void>,
}

impl ArgList {
    /// Empty storage.
    pub fn new() -> Self {
        Self::default()
    }

    /// Begins a new argument list for a launch on `stream`, in this
    /// storage (the last list is forgotten).
    pub fn start<'a>(&'a mut self, stream: &'a CudaStream) -> Args<'a> {
        self.words.clear();
        self.at.clear();
        self.specs.clear();
        Args { list: self, stream }
    }

    /// Appends a value's bytes in fresh 8-byte aligned words.
    fn push_value(&mut self, value: &[u8]) {
        let start = self.words.len();
        self.at.push(start);
        self.words.resize(start + value.len().div_ceil(8), 0);
        for (j, chunk) in value.chunks(8).enumerate() {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.words[start + j] = u64::from_ne_bytes(w);
        }
        self.specs.push((value.len(), ParamClass::Bits, "bytes"));
    }
}

/// A kernel argument list being built for a launch on one stream (see
/// [`ArgList::start`]); the buffers it names are borrowed until it is
/// launched with [`Kernel::launch_with`].
#[derive(Debug)]
pub struct Args<'a> {
    list: &'a mut ArgList,
    stream: &'a CudaStream,
}

impl<'a> Args<'a> {
    /// Appends bytes passed by value (a scalar or a struct, in the byte
    /// order the kernel expects); checked at launch as `bytes` of their
    /// length against a parameter of that size.
    pub fn push_bytes(&mut self, value: &[u8]) {
        self.list.push_value(value);
    }

    /// Appends the device address of `buffer` plus `offset` bytes (an
    /// 8-byte integer parameter, checked at launch as a `device address`).
    ///
    /// The launch is not ordered by the buffer's use events here: see
    /// [`Kernel::launch_with`]'s `# Safety`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `offset` is past the buffer's end or
    /// the buffer is of another device than the launch's stream; nothing is
    /// appended then.
    pub fn push_buffer(&mut self, buffer: &'a DeviceBuffer<u8>, offset: usize) -> Result<()> {
        if offset > buffer.len() {
            return Err(Error::InvalidArgument(format!(
                "kernel argument {}: offset {offset} is past the end of a buffer of {} bytes",
                self.list.at.len(),
                buffer.len()
            )));
        }
        buffer.same_context(self.stream)?;
        // (cudarc's own tracking, where a context has it on: waits for its
        // last write on the launch's stream, records a read when dropped.)
        let (base, _read) = buffer.as_cuda_slice().device_ptr(self.stream);
        let l = &mut *self.list;
        l.at.push(l.words.len());
        l.words.push(base + offset as u64);
        l.specs.push((8, ParamClass::Int, "device address"));
        Ok(())
    }

    /// How many arguments it has.
    pub fn len(&self) -> usize {
        self.list.at.len()
    }

    /// Whether it has none.
    pub fn is_empty(&self) -> bool {
        self.list.at.is_empty()
    }

    /// Each argument's `(bytes, class, kind)`, as [`Kernel::check_args`]
    /// takes them.
    pub fn specs(&self) -> &[(usize, ParamClass, &'static str)] {
        &self.list.specs
    }
}

impl Kernel {
    /// Launches this kernel on `device` with `config` and the run-time
    /// argument list `args`, on the stream the list was started for: one
    /// `cuLaunchKernel`, without allocating once the list's storage has
    /// grown. The list is checked against the kernel's PTX parameter list
    /// first, as `cuda-async`'s `DynArgs` are: the list must be known, and
    /// the count and each argument's size must match
    /// ([`Kernel::check_args`]).
    ///
    /// The kernel must be loaded on `device` ([`Kernel::load_on`]) for a
    /// CUDA C module's parameter list to be known. The stream's context
    /// must be current on this thread (the driver's error otherwise); the
    /// launch configuration is the driver's to check.
    ///
    /// # Errors
    /// [`Error::ArgumentMismatch`] (parameter list unknown, count or size
    /// mismatch) and [`Error::InvalidArgument`] (a stream of another
    /// device), both before any driver call; as [`Kernel::load_on`]; the
    /// driver's error naming `cuLaunchKernel`.
    ///
    /// # Safety
    /// The kernel is arbitrary device code, and its launch is ordered by
    /// its stream alone. The caller guarantees that, given these arguments
    /// and this configuration, it accesses only memory inside the buffers
    /// passed (from their offsets to their ends), and that the launch is
    /// ordered against the buffers' other uses as the write it may be:
    /// each buffer's [`DeviceBuffer::before_write`] before, and its
    /// [`DeviceBuffer::after_write`] on this stream after, before anything
    /// could depend on the buffer's events and before it is dropped (its
    /// free waits only for recorded uses).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use cuda_core::{ArgList, Device, DeviceBuffer, LaunchConfig, Module};
    /// let dev = Device::new(0)?;
    /// let stream = dev.new_stream()?;
    /// let k = Module::cuda(r#"extern "C" __global__ void fill(unsigned char* p, unsigned char v) {
    ///     p[threadIdx.x] = v; }"#, &[])?.kernel("fill")?;
    /// k.load_on(&dev)?;
    /// dev.context().bind_to_thread().map_err(|e| cuda_core::Error::driver("cuCtxSetCurrent", e))?;
    /// let buf = DeviceBuffer::<u8>::zeros(&stream, 32)?;
    /// let mut storage = ArgList::new();
    /// let mut args = storage.start(&stream);
    /// args.push_buffer(&buf, 0)?;
    /// args.push_bytes(&[7]);
    /// let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 };
    /// buf.before_write(&stream)?;
    /// // SAFETY: 32 threads write p[0..32) of a 32-byte buffer; the launch
    /// // is ordered by `before_write` above and recorded just below.
    /// unsafe { k.launch_with(&dev, &cfg, args) }?;
    /// buf.after_write(&stream)?;
    /// # Ok::<(), cuda_core::Error>(())
    /// ```
    pub unsafe fn launch_with(
        &self,
        device: &Device,
        config: &LaunchConfig,
        args: Args<'_>,
    ) -> Result<()> {
        let Args { list, stream } = args;
        check_same_context("a kernel", device.context(), stream)?;
        let func = self.function_on(device)?;
        if self.params().is_none() {
            return Err(Error::ArgumentMismatch {
                kernel: self.name().into(),
                detail: "the kernel's parameter list could not be read from its PTX, and \
                         run-time arguments are only launched against a known list"
                    .into(),
            });
        }
        self.check_args(&list.specs)?;
        let base = list.words.as_mut_ptr();
        list.ptrs.clear();
        // In bounds: each index is where an argument's words start, taken
        // before `words` grew past it.
        list.ptrs.extend(
            list.at
                .iter()
                .map(|&i| base.wrapping_add(i).cast::<c_void>()),
        );
        // SAFETY: `func` is this kernel's function in `device`'s context,
        // which `stream` belongs to (checked above), and the `Kernel` keeps
        // its module loaded. The argument count and each argument's size
        // equal the kernel's parameters (checked above), so the driver
        // reads from each pointer in `ptrs` exactly the bytes of one
        // argument's words, which stay untouched until the call returns
        // (the driver copies the values at the launch). Buffer addresses
        // come from live buffers of this context, borrowed by `args`. What
        // the kernel does with memory, and the launch's ordering against
        // the buffers' other uses, are the caller's contract (`# Safety`).
        let launched = unsafe {
            result::launch_kernel(
                func.cu_function(),
                config.grid_dim,
                config.block_dim,
                config.shared_mem_bytes,
                stream.cu_stream(),
                &mut list.ptrs,
            )
        };
        list.ptrs.clear();
        launched.call("cuLaunchKernel")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // An `Args` needs a stream (a driver), so the layout is tested on the
    // storage it writes to.
    #[test]
    fn values_are_laid_out_in_aligned_words_each_at_its_own_start() {
        let mut l = ArgList::new();
        l.push_value(&[1, 2, 3, 4]);
        l.push_value(&[9; 12]);
        l.push_value(&7u64.to_ne_bytes());
        assert_eq!(l.at, vec![0, 1, 3]);
        assert_eq!(l.words.len(), 4);
        let bytes: Vec<u8> = l.words.iter().flat_map(|w| w.to_ne_bytes()).collect();
        assert_eq!(&bytes[..4], &[1, 2, 3, 4]);
        assert_eq!(&bytes[4..8], &[0; 4], "the rest of a word is zero");
        assert_eq!(&bytes[8..20], &[9; 12]);
        assert_eq!(&bytes[24..32], &7u64.to_ne_bytes());
        assert_eq!(
            l.specs.iter().map(|s| s.0).collect::<Vec<_>>(),
            vec![4, 12, 8]
        );
        assert!(l.ptrs.is_empty());
    }

    #[test]
    fn argument_lists_are_checked_against_the_ptx_parameters() {
        let m = crate::Module::ptx(
            ".visible .entry k(\n .param .u64 k_param_0,\n .param .f32 k_param_1\n)\n{ ret; }",
        )
        .unwrap();
        let k = m.kernel("k").unwrap();
        let mut l = ArgList::new();
        l.specs.push((8, ParamClass::Int, "device address"));
        l.push_value(&1.5f32.to_ne_bytes());
        assert!(k.check_args(&l.specs).is_ok());
        l.push_value(&[0]);
        assert!(matches!(
            k.check_args(&l.specs),
            Err(Error::ArgumentMismatch { .. })
        ));
        let mut short = ArgList::new();
        short.specs.push((8, ParamClass::Int, "device address"));
        short.push_value(&[0; 2]);
        assert!(matches!(
            k.check_args(&short.specs),
            Err(Error::ArgumentMismatch { .. })
        ));
    }
}
