//! The lazy kernel-launch op and typed kernel arguments.

use std::fmt;
use std::sync::Arc;

use cuda_core::cudarc::driver::{CudaStream, LaunchArgs, LaunchConfig, PushKernelArg};
use cuda_core::{DeviceRepr, Error, Kernel, ParamClass, Result, UseMark};

use crate::buffer::DeviceBuffer;
use crate::context::ExecutionContext;
use crate::op::{impl_into_future, DeviceOp};
use crate::remote::{proto, Id, RemoteContext};

use crate::view::{DeviceSlice, DeviceSliceMut};

mod dyn_args;

pub use dyn_args::{DynArg, DynArgs};

/// A kernel argument as a remote launch carries it (the protocol's).
type WireArg = proto::LaunchArg<'static>;

/// One kernel argument: how it is passed and what it looks like to the
/// parameter check.
///
/// Implemented for scalars (by value), and for device buffers owned
/// (`DeviceBuffer<T>`, written and returned), borrowed (`&DeviceBuffer<T>`
/// read, `&mut DeviceBuffer<T>` written) or shared (`Arc<DeviceBuffer<T>>`,
/// read). Buffers are passed as device pointers, and the launch is ordered
/// after the buffer's earlier writes (and reads, for writers) on any stream,
/// then recorded as a read or a write. A kernel must not write through a
/// read-only argument (`&DeviceBuffer`, `Arc<DeviceBuffer>`): later readers
/// would not wait for that write.
pub trait KernelArg: Send {
    /// `(bytes, class, rust type name)` for the parameter check.
    fn spec(&self) -> (usize, ParamClass, &'static str);

    /// Pushes the argument onto a cudarc launch builder.
    fn push<'a>(&'a mut self, args: &mut LaunchArgs<'a>);

    /// Orders the launch on `stream` after the uses it conflicts with
    /// (buffers); called before the launch is enqueued.
    ///
    /// # Errors
    /// A buffer of another device; a driver error.
    fn before(&self, _stream: &CudaStream) -> Result<()> {
        Ok(())
    }

    /// Records the launch as a use (buffers); called right after it is
    /// enqueued on `mark`'s stream, with the mark every argument of the
    /// launch shares (one event for the launch: see [`UseMark`]).
    ///
    /// # Errors
    /// A driver error (the buffer then leaks rather than free early).
    fn after(&self, _mark: &UseMark<'_>) -> Result<()> {
        Ok(())
    }

    /// The argument of a launch recorded on a remote context: its bytes,
    /// or the remote buffer it names.
    ///
    /// # Errors
    /// A buffer that does not live on `ctx`'s session
    /// ([`Error::WrongHome`]); by default, [`Error::InvalidArgument`]: the
    /// argument type does not say how it travels.
    fn remote(&self, _ctx: &RemoteContext) -> Result<WireArg> {
        Err(Error::InvalidArgument(format!(
            "a kernel argument of type `{}` cannot be passed to a remote GPU",
            self.spec().2
        )))
    }
}

macro_rules! scalar_arg {
    ($($t:ty => $class:ident),* $(,)?) => {$(
        impl KernelArg for $t {
            fn spec(&self) -> (usize, ParamClass, &'static str) {
                (std::mem::size_of::<$t>(), ParamClass::$class, stringify!($t))
            }
            fn push<'a>(&'a mut self, args: &mut LaunchArgs<'a>) {
                args.arg(&*self);
            }
            fn remote(&self, _ctx: &RemoteContext) -> Result<WireArg> {
                Ok(WireArg::bytes(self.to_le_bytes()))
            }
        }
    )*};
}
scalar_arg!(
    u8 => Int, i8 => Int, u16 => Int, i16 => Int, u32 => Int, i32 => Int,
    u64 => Int, i64 => Int, usize => Int, isize => Int, f32 => Float, f64 => Float,
);

const PTR: (usize, ParamClass) = (8, ParamClass::Int);

impl<T: DeviceRepr + Send> KernelArg for DeviceBuffer<T> {
    fn spec(&self) -> (usize, ParamClass, &'static str) {
        (PTR.0, PTR.1, "DeviceBuffer<T>")
    }
    fn push<'a>(&'a mut self, args: &mut LaunchArgs<'a>) {
        args.arg(self.expect_local_mut().as_cuda_slice_mut());
    }
    fn before(&self, stream: &CudaStream) -> Result<()> {
        self.local_on(stream)?.before_write(stream)
    }
    fn after(&self, mark: &UseMark<'_>) -> Result<()> {
        self.expect_local().after_write_with(mark)
    }
    fn remote(&self, ctx: &RemoteContext) -> Result<WireArg> {
        buffer_arg(self, ctx)
    }
}

impl<T: DeviceRepr + Sync> KernelArg for &DeviceBuffer<T> {
    fn spec(&self) -> (usize, ParamClass, &'static str) {
        (PTR.0, PTR.1, "&DeviceBuffer<T>")
    }
    fn push<'a>(&'a mut self, args: &mut LaunchArgs<'a>) {
        args.arg(self.expect_local().as_cuda_slice());
    }
    fn before(&self, stream: &CudaStream) -> Result<()> {
        self.local_on(stream)?.before_read(stream)
    }
    fn after(&self, mark: &UseMark<'_>) -> Result<()> {
        self.expect_local().after_read_with(mark)
    }
    fn remote(&self, ctx: &RemoteContext) -> Result<WireArg> {
        buffer_arg(self, ctx)
    }
}

impl<T: DeviceRepr + Send> KernelArg for &mut DeviceBuffer<T> {
    fn spec(&self) -> (usize, ParamClass, &'static str) {
        (PTR.0, PTR.1, "&mut DeviceBuffer<T>")
    }
    fn push<'a>(&'a mut self, args: &mut LaunchArgs<'a>) {
        args.arg((**self).expect_local_mut().as_cuda_slice_mut());
    }
    fn before(&self, stream: &CudaStream) -> Result<()> {
        self.local_on(stream)?.before_write(stream)
    }
    fn after(&self, mark: &UseMark<'_>) -> Result<()> {
        self.expect_local().after_write_with(mark)
    }
    fn remote(&self, ctx: &RemoteContext) -> Result<WireArg> {
        buffer_arg(self, ctx)
    }
}

impl<T: DeviceRepr + Send + Sync> KernelArg for Arc<DeviceBuffer<T>> {
    fn spec(&self) -> (usize, ParamClass, &'static str) {
        (PTR.0, PTR.1, "Arc<DeviceBuffer<T>>")
    }
    fn push<'a>(&'a mut self, args: &mut LaunchArgs<'a>) {
        args.arg((**self).expect_local().as_cuda_slice());
    }
    fn before(&self, stream: &CudaStream) -> Result<()> {
        self.local_on(stream)?.before_read(stream)
    }
    fn after(&self, mark: &UseMark<'_>) -> Result<()> {
        self.expect_local().after_read_with(mark)
    }
    fn remote(&self, ctx: &RemoteContext) -> Result<WireArg> {
        buffer_arg(self, ctx)
    }
}

/// A view as a kernel argument: a pointer to its first element, the
/// launch ordered after the uses on other streams that overlap the view
/// (writes, for a read; every use, for a write) and recorded as a read
/// (`DeviceSlice`) or a write (`DeviceSliceMut`) of it, so disjoint views
/// of one buffer written on two streams run at once.
macro_rules! view_arg {
    ($view:ident, $before:ident, $after:ident) => {
        impl<T: DeviceRepr + Send + Sync> KernelArg for $view<'_, T> {
            fn spec(&self) -> (usize, ParamClass, &'static str) {
                (PTR.0, PTR.1, concat!(stringify!($view), "<T>"))
            }
            fn push<'a>(&'a mut self, args: &mut LaunchArgs<'a>) {
                args.arg(
                    self.view
                        .as_ref()
                        .expect("a local buffer (checked by before)"),
                );
            }
            fn before(&self, stream: &CudaStream) -> Result<()> {
                self.buf
                    .local_on(stream)?
                    .$before(stream, self.start..self.start + self.len)
            }
            fn after(&self, mark: &UseMark<'_>) -> Result<()> {
                self.buf
                    .expect_local()
                    .$after(mark, self.start..self.start + self.len)
            }
            fn remote(&self, ctx: &RemoteContext) -> Result<WireArg> {
                Ok(WireArg::Mem {
                    buf: Id(ctx.id_of(self.buf)?),
                    offset: (self.start * std::mem::size_of::<T>()) as u64,
                })
            }
        }
    };
}
view_arg!(DeviceSlice, before_read_range, after_read_range_with);
view_arg!(DeviceSliceMut, before_write_range, after_write_range_with);

/// A buffer argument a kernel only reads (`const T*` in CUDA C): any
/// handle to a [`DeviceBuffer<T>`]. The typed launchers of
/// [`kernels!`](crate::kernels) take these for `const T*` parameters.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be passed where the kernel reads a buffer of `{T}`",
    label = "expected a `DeviceBuffer<{T}>`, `&DeviceBuffer<{T}>`, `&mut DeviceBuffer<{T}>` or `Arc<DeviceBuffer<{T}>>`"
)]
pub trait BufferIn<T>: KernelArg {}
impl<T: DeviceRepr + Sync> BufferIn<T> for &DeviceBuffer<T> {}
impl<T: DeviceRepr + Send + Sync> BufferIn<T> for Arc<DeviceBuffer<T>> {}
impl<T: DeviceRepr + Send> BufferIn<T> for DeviceBuffer<T> {}
impl<T: DeviceRepr + Send> BufferIn<T> for &mut DeviceBuffer<T> {}
impl<T: DeviceRepr + Send + Sync> BufferIn<T> for DeviceSlice<'_, T> {}
impl<T: DeviceRepr + Send + Sync> BufferIn<T> for DeviceSliceMut<'_, T> {}

/// A buffer argument a kernel may write (`T*` in CUDA C): an owned or
/// exclusively borrowed [`DeviceBuffer<T>`], never a shared one (`&` or
/// `Arc`), whose other users would not be ordered after the write. The
/// typed launchers of [`kernels!`](crate::kernels) take these for `T*`
/// parameters.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be passed where the kernel writes a buffer of `{T}`",
    label = "expected a `DeviceBuffer<{T}>` or `&mut DeviceBuffer<{T}>`",
    note = "a `T*` parameter may be written by the kernel: pass the buffer by value or by `&mut`, not through `&` or `Arc`"
)]
pub trait BufferOut<T>: KernelArg {}
impl<T: DeviceRepr + Send> BufferOut<T> for DeviceBuffer<T> {}
impl<T: DeviceRepr + Send> BufferOut<T> for &mut DeviceBuffer<T> {}
impl<T: DeviceRepr + Send + Sync> BufferOut<T> for DeviceSliceMut<'_, T> {}

fn buffer_arg<T>(b: &DeviceBuffer<T>, ctx: &RemoteContext) -> Result<WireArg> {
    Ok(WireArg::Mem {
        buf: Id(ctx.id_of(b)?),
        offset: 0,
    })
}

/// A tuple of [`KernelArg`]s (0 to 12 of them).
pub trait KernelArgs: Send {
    /// Checks the arguments against the kernel's PTX parameter list.
    ///
    /// # Errors
    /// [`Error::ArgumentMismatch`] naming the first mismatch.
    fn check(&self, kernel: &Kernel) -> Result<()>;

    /// Pushes every argument, in order.
    fn push_all<'a>(&'a mut self, args: &mut LaunchArgs<'a>);

    /// [`KernelArg::before`] for every argument.
    ///
    /// # Errors
    /// The first argument's error.
    fn before_all(&self, stream: &CudaStream) -> Result<()>;

    /// [`KernelArg::after`] for every argument, with one mark (all of
    /// them, even after an error).
    ///
    /// # Errors
    /// The first argument's error.
    fn after_all(&self, mark: &UseMark<'_>) -> Result<()>;

    /// [`KernelArg::remote`] for every argument, in order.
    ///
    /// # Errors
    /// The first argument's error; by default, [`Error::InvalidArgument`]
    /// (an argument list that does not say how it travels).
    fn remote_all(&self, _ctx: &RemoteContext) -> Result<Vec<WireArg>> {
        Err(Error::InvalidArgument(
            "these kernel arguments cannot be passed to a remote GPU".into(),
        ))
    }
}

macro_rules! kernel_args {
    ($($name:ident $idx:tt),*) => {
        impl<$($name: KernelArg),*> KernelArgs for ($($name,)*) {
            fn check(&self, kernel: &Kernel) -> Result<()> {
                kernel.check_args(&[$(self.$idx.spec()),*])
            }
            #[allow(unused_variables)]
            fn push_all<'a>(&'a mut self, args: &mut LaunchArgs<'a>) {
                $( self.$idx.push(args); )*
            }
            #[allow(unused_variables)]
            fn before_all(&self, stream: &CudaStream) -> Result<()> {
                $( self.$idx.before(stream)?; )*
                Ok(())
            }
            #[allow(unused_variables, unused_mut)]
            fn after_all(&self, mark: &UseMark<'_>) -> Result<()> {
                let mut first = Ok(());
                $( if let Err(e) = self.$idx.after(mark) { if first.is_ok() { first = Err(e); } } )*
                first
            }
            #[allow(unused_variables)]
            fn remote_all(&self, ctx: &RemoteContext) -> Result<Vec<WireArg>> {
                Ok(vec![$(self.$idx.remote(ctx)?),*])
            }
        }
    };
}
kernel_args!();
kernel_args!(A 0);
kernel_args!(A 0, B 1);
kernel_args!(A 0, B 1, C 2);
kernel_args!(A 0, B 1, C 2, D 3);
kernel_args!(A 0, B 1, C 2, D 3, E 4);
kernel_args!(A 0, B 1, C 2, D 3, E 4, F 5);
kernel_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6);
kernel_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7);
kernel_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8);
kernel_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9);
kernel_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10);
kernel_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8, J 9, K 10, L 11);

/// The lazy kernel launch ([`launch`]); yields its arguments back (so owned
/// buffers flow on to the next op).
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct Launch<A> {
    kernel: Kernel,
    config: LaunchConfig,
    args: A,
}

impl<A> fmt::Debug for Launch<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Launch")
            .field("kernel", &self.kernel.name())
            .field("grid", &self.config.grid_dim)
            .field("block", &self.config.block_dim)
            .field("shared_mem_bytes", &self.config.shared_mem_bytes)
            .finish()
    }
}

/// A lazy launch of `kernel` with `config` and a tuple of `args`.
///
/// At execution the arguments are checked against the parameter list in
/// the kernel's PTX (count, sizes, integer vs float) and the launch
/// configuration against the hardware limits: mismatches are
/// [`Error::ArgumentMismatch`] / [`Error::InvalidArgument`], never a launch.
/// The kernel is resolved on the device the op runs on (the same `Kernel`
/// runs on any device a policy picks).
///
/// # Performance
/// The first launch of a kernel's module on a device compiles it there
/// (NVRTC, about 50 ms on an H100 host) inside the executing call: inside
/// `.await` that blocks the executor thread. Call
/// [`Kernel::load_on`](crate::Kernel::load_on) or
/// [`Module::load_on`](crate::Module::load_on) at start-up. Later launches
/// find the function without a lock.
///
/// # Safety
/// The kernel is arbitrary device code: the caller guarantees that, given
/// these arguments, it accesses only memory inside the buffers passed
/// (e.g. that a length argument matches the buffers' lengths), does not
/// write through read-only arguments (`&DeviceBuffer`, `Arc<DeviceBuffer>`:
/// they are recorded as reads), and does not race with itself. Out-of-bounds device accesses corrupt device memory or
/// fault the context (a sticky error: every later op fails).
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// use cuda_async::{Device, LaunchConfig, Module};
/// let m = Module::cuda(r#"extern "C" __global__ void add1(float* x, unsigned n) {
///     unsigned i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] += 1.0f; }"#, &[])?;
/// let k = m.kernel("add1")?;
/// k.load_on(&Device::new(0)?)?; // compile now, not inside the first launch
/// let n = 1000u32;
/// let out = h2d(vec![1.0f32; n as usize])
///     // SAFETY: `add1` touches x[0..n), and x has n elements.
///     .then(move |x| unsafe { launch(&k, LaunchConfig::for_num_elems(n), (x, n)) })
///     .then(|(x, _)| d2h(x))
///     .sync()?;
/// assert!(out.as_slice()?.iter().all(|&v| v == 2.0));
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub unsafe fn launch<A: KernelArgs>(kernel: &Kernel, config: LaunchConfig, args: A) -> Launch<A> {
    Launch {
        kernel: kernel.clone(),
        config,
        args,
    }
}

/// Checks a launch configuration against CUDA's limits: a non-empty grid
/// and block, at most 1024 threads per block, block z at most 64, grid y
/// and z at most 65535. [`launch`] checks every configuration this way
/// before enqueuing; code that launches through the driver itself (the
/// lease node's workers) uses it to fail the same way.
///
/// # Errors
/// [`Error::InvalidArgument`] naming the configuration and the limit.
///
/// # Examples
///
/// ```
/// use cuda_async::{check_launch_config, LaunchConfig};
/// let mut c = LaunchConfig::for_num_elems(1000);
/// assert!(check_launch_config(&c).is_ok());
/// c.block_dim = (2048, 1, 1);
/// assert!(check_launch_config(&c).is_err());
/// ```
pub fn check_launch_config(c: &LaunchConfig) -> Result<()> {
    let (gx, gy, gz) = c.grid_dim;
    let (bx, by, bz) = c.block_dim;
    let threads = bx as u64 * by as u64 * bz as u64;
    if gx == 0 || gy == 0 || gz == 0 || threads == 0 {
        return Err(Error::InvalidArgument(format!(
            "launch config has an empty grid {:?} or block {:?}",
            c.grid_dim, c.block_dim
        )));
    }
    if threads > 1024 || bz > 64 || gy > 65535 || gz > 65535 {
        return Err(Error::InvalidArgument(format!(
            "launch config exceeds CUDA limits: block {:?} ({threads} threads, max 1024, z max 64), \
             grid {:?} (y, z max 65535)",
            c.block_dim, c.grid_dim
        )));
    }
    Ok(())
}

impl<A: KernelArgs> DeviceOp for Launch<A> {
    type Output = A;

    unsafe fn execute(mut self, ctx: &mut ExecutionContext) -> Result<A> {
        ctx.launch(&self.kernel, self.config, &mut self.args)?;
        Ok(self.args)
    }
}
impl_into_future!(impl[A: KernelArgs] for Launch<A>);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_outside_cuda_limits_are_rejected() {
        let ok = LaunchConfig {
            grid_dim: (10, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        assert!(check_launch_config(&ok).is_ok());
        for bad in [
            LaunchConfig {
                grid_dim: (0, 1, 1),
                ..ok
            },
            LaunchConfig {
                block_dim: (0, 1, 1),
                ..ok
            },
            LaunchConfig {
                block_dim: (2048, 1, 1),
                ..ok
            },
            LaunchConfig {
                block_dim: (1, 1, 128),
                ..ok
            },
            LaunchConfig {
                grid_dim: (1, 70000, 1),
                ..ok
            },
        ] {
            let e = check_launch_config(&bad).unwrap_err().to_string();
            assert!(e.contains("launch config"), "{e}");
        }
    }

    #[test]
    fn scalar_specs_match_their_ptx_types() {
        assert_eq!(1.0f32.spec(), (4, ParamClass::Float, "f32"));
        assert_eq!(7u64.spec(), (8, ParamClass::Int, "u64"));
        assert_eq!((-1i8).spec().0, 1);
    }
}
