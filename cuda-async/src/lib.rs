//! `cuda-async`: lazy, composable, async GPU work over CUDA.
//!
//! Describe work as a [`DeviceOp`] (a recipe), compose with
//! [`then`](DeviceOpExt::then), [`map`](DeviceOpExt::map),
//! [`zip`](DeviceOpExt::zip), [`shared`](DeviceOpExt::shared),
//! [`value`], [`with_context`], [`join_all`], [`boxed`](DeviceOpExt::boxed),
//! and choose where and how it runs last: `.sync()` in a script, `.await` in
//! an async service, `.sync_on(&stream)` on a stream another library owns,
//! `.schedule(&policy)` for a chosen [`SchedulingPolicy`].
//!
//! # Examples
//!
//! ```no_run
//! use cuda_async::prelude::*;
//! let x = vec![1.0f32, 2.0, 3.0];
//! let back = h2d(x.clone()).then(d2h).sync()?;
//! assert_eq!(back.as_slice()?, &x[..]);
//! # Ok::<(), cuda_async::Error>(())
//! ```
//!
//! In a tokio service (any executor works; the crate does not depend on one):
//!
//! ```no_run
//! # async fn f() -> Result<(), cuda_async::Error> {
//! use cuda_async::prelude::*;
//! let buf = h2d(vec![0u8; 1 << 20]).await?;
//! let host = d2h(buf).await?;
//! # Ok(()) }
//! ```
//!
//! See `ARCHITECTURE.md` for how an op flows from description to stream to
//! completion, and the safety invariants with the tests that check them.

#![warn(missing_docs)]

pub mod combinators;
#[cfg(doctest)]
mod compile_fail;

/// The book's chapters whose Rust blocks stand alone: `cargo test --doc`
/// compiles them (GPU snippets are `no_run`).
#[cfg(doctest)]
mod book {
    #[doc = include_str!("../../book/src/ops.md")]
    struct Ops;
    #[doc = include_str!("../../book/src/async.md")]
    struct Async;
    #[doc = include_str!("../../book/src/errors.md")]
    struct Errors;
    #[doc = include_str!("../../book/src/scheduling.md")]
    struct Scheduling;
}
#[cfg(feature = "blas")]
pub mod blas;
mod buffer;
mod completion;
mod context;
mod exec;
#[cfg(feature = "fft")]
pub mod fft;
pub mod foreign;
mod future;
mod globals;
pub mod graph;
mod handoff;
mod host;
mod host_step;
pub mod launch;
mod macros;
pub mod memory;
mod multi;
mod op;
mod pinned_host;
pub mod policy;
#[cfg(feature = "rand")]
pub mod rand;
mod reactor;
pub mod remote;
mod spread;
mod stream_pool;
mod submit;
mod sync;
mod view;
mod waker;

pub use buffer::DeviceBuffer;
pub use combinators::{join_all, value, with_context, zip_all, BoxedOp, GpuTime, Shared, Timed};
pub use context::ExecutionContext;
/// Typed launchers for the kernels of a CUDA C file, generated at compile
/// time.
///
/// `kernels!("kernels/saxpy.cu")` reads the file (the path is relative to
/// the calling crate's directory; the crate rebuilds when the file
/// changes), parses every `extern "C" __global__` signature and generates,
/// in the scope of the call:
/// - per kernel, an `unsafe fn` of the same name taking a
///   [`LaunchConfig`] and the kernel's parameters, typed, and returning the
///   lazy launch op (the same op [`launch`](fn@launch) builds, on every backend);
/// - `module()`, the file's [`Module`], e.g. to compile it at start-up with
///   `module().load_on(&device)?`.
///
/// The source is embedded in the binary and compiled by NVRTC on each
/// device's first launch (through `cuda-core`'s cache).
/// `kernels!("kernels/saxpy.cu", ptx = "kernels/saxpy.ptx")` embeds a
/// precompiled PTX instead (JIT-compiled by the driver, no NVRTC needed);
/// the signatures still come from the `.cu`.
///
/// | C parameter | Rust parameter |
/// | --- | --- |
/// | `const T*` (a buffer the kernel reads) | anything [`BufferIn<T>`]: `DeviceBuffer<T>`, `&DeviceBuffer<T>`, `&mut DeviceBuffer<T>`, `Arc<DeviceBuffer<T>>` |
/// | `T*` (a buffer the kernel may write) | [`BufferOut<T>`]: `DeviceBuffer<T>` or `&mut DeviceBuffer<T>` |
/// | `T` by value | the Rust scalar |
///
/// `T` is `float` (`f32`), `double` (`f64`), `char`/`int8_t` (`i8`),
/// `unsigned char`/`uint8_t` (`u8`), `short`/`int16_t`, `unsigned short`,
/// `int`/`int32_t` (`i32`), `unsigned`/`uint32_t` (`u32`), `long long`/
/// `int64_t` (`i64`), `unsigned long long`/`uint64_t` (`u64`) or `size_t`
/// (`usize`). `__restrict__`, `volatile`, `const` in either position,
/// comments and preprocessor lines are fine. Templates, structs by value,
/// unknown types, `__half`, pointers to pointers and more than 12
/// parameters are compile errors naming the kernel and the parameter, as is
/// a missing file. Kernels declared without `extern "C"` (C++ names) are
/// skipped.
///
/// The launchers are `unsafe`: the kernel is arbitrary device code, and
/// only the caller knows that it stays inside its buffers. What is checked
/// at compile time: the argument count, the scalar types, the buffer
/// element types, and that buffers the kernel may write are not shared.
///
/// # Examples
///
/// With a `.cu` file holding
/// `extern "C" __global__ void saxpy(float a, const float* x, float* y, int n)`
/// (among others):
///
/// ```no_run
/// mod k {
///     // Relative to the crate's directory (this one is in cuda-async's tests).
///     cuda_async::kernels!("tests/kernels/typed.cu");
/// }
/// use cuda_async::prelude::*;
/// use cuda_async::LaunchConfig;
///
/// let n = 1 << 20;
/// let (x, y) = (h2d(vec![1.0f32; n]), h2d(vec![2.0f32; n]));
/// let out = x
///     .zip(y)
///     // SAFETY: saxpy touches x[0..n) and y[0..n); both hold n floats.
///     .then(move |(x, y)| unsafe {
///         k::saxpy(LaunchConfig::for_num_elems(n as u32), 3.0, x, y, n as i32)
///     })
///     .then(|(_, _, y, _)| d2h(y))
///     .sync()?;
/// assert!(out.as_slice()?.iter().all(|&v| v == 5.0));
/// // k::saxpy(cfg, 3.0, &x, &y, n): error, `&DeviceBuffer<f32>` cannot be
/// // passed where the kernel writes a buffer of `f32`.
/// # Ok::<(), cuda_async::Error>(())
/// ```
pub use cuda_async_macros::kernels;
/// The half-precision types (`half::bf16`, `half::f16`) that buffers hold
/// and, with `blas`, `blas::gemm` multiplies (feature `half`).
#[cfg(feature = "half")]
pub use cuda_core::half;
pub use cuda_core::GraphUpdate;
pub use cuda_core::{
    auto_peer_access, can_access_peer, cudarc, device_count, devices, driver_present,
    enable_peer_access, hardware_queues, nvrtc_compilations, set_auto_peer_access,
    set_hardware_queues, AnyBitPattern, CudaStream, Device, DeviceAttribute, DeviceInfo,
    DeviceRepr, Error, Kernel, LaunchConfig, MemPool, MemPoolOptions, MemPoolStats, Module,
    ModuleSource, PinnedBuffer, RemoteFailure, Result, SharedPinnedBuffer, UseMark,
    ValidAsZeroBits, DEFAULT_HARDWARE_QUEUES, MAX_HARDWARE_QUEUES,
};
pub use future::{run_on, DeviceFuture};
pub use globals::{read_global, write_global, ReadGlobal, WriteGlobal};
pub use graph::{CudaGraph, DeviceScalar, GraphLaunch, OwnedGraphLaunch, SetScalar, UpdateOutput};
pub use host_step::{
    host_step, host_step_each, host_step_with, HostResult, HostStep, HostStepEach, HostStepWith,
};
pub use launch::{
    check_launch_config, launch, BufferIn, BufferOut, DynArg, DynArgs, KernelArg, KernelArgs,
};
#[doc(hidden)]
pub use macros::__private;
pub use memory::{copy_d2d, copy_d2h, copy_h2d, d2d, d2h, h2d, memset, zeros};
pub use multi::{to_device, DeviceLoad, DevicePool, PlaceFn, Placement, ToDevice};
pub use op::{DeviceOp, DeviceOpExt, OutputOf};
pub use pinned_host::PinnedHost;
pub use policy::{
    default_device, default_policy, set_default_device, SchedulingPolicy, SingleStream, StreamPool,
    StreamPoolRoundRobin, WithMemPool,
};
pub use reactor::CompletionMode;
pub use remote::proto::{Credentials, Disconnect, RemoteError, RemoteErrorKind};
pub use remote::RemoteErrorExt;
pub use remote::{HostBuffer, RemotePolicy, RemoteSession};
pub use submit::{Enqueued, SubmitThread};
pub use view::{DeviceSlice, DeviceSliceMut, DeviceSource, DeviceTarget};

/// Everything needed to build and run ops: `use cuda_async::prelude::*;`.
pub mod prelude {
    pub use crate::combinators::{join_all, value, with_context, zip_all, BoxedOp};
    pub use crate::launch::launch;
    pub use crate::memory::{copy_d2d, copy_d2h, copy_h2d, d2d, d2h, h2d, memset, zeros};
    pub use crate::op::{DeviceOp, DeviceOpExt};
    pub use crate::policy::{SchedulingPolicy, SingleStream, StreamPoolRoundRobin};
    pub use crate::remote::{RemoteErrorExt, RemotePolicy};
}
