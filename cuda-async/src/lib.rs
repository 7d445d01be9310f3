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
mod buffer;
mod completion;
mod context;
mod exec;
mod future;
mod handoff;
pub mod launch;
pub mod memory;
mod op;
pub mod policy;
mod reactor;
pub mod remote;
mod sync;
mod waker;

pub use buffer::DeviceBuffer;
pub use combinators::{join_all, value, with_context, zip_all, BoxedOp, Shared};
pub use context::ExecutionContext;
pub use cuda_core::{
    cudarc, device_count, devices, driver_present, nvrtc_compilations, CudaStream, Device,
    DeviceInfo, DeviceRepr, Error, Kernel, LaunchConfig, Module, ModuleSource, PinnedBuffer,
    Result, ValidAsZeroBits,
};
pub use future::{run_on, DeviceFuture};
pub use launch::{check_launch_config, launch, DynArg, DynArgs, KernelArg, KernelArgs};
pub use memory::{copy_d2h, copy_h2d, d2d, d2h, h2d, memset, zeros};
pub use op::{DeviceOp, DeviceOpExt, OutputOf};
pub use policy::{
    default_device, default_policy, set_default_device, SchedulingPolicy, SingleStream, StreamPool,
    StreamPoolRoundRobin,
};
pub use reactor::CompletionMode;
pub use remote::{HostBuffer, RemotePolicy, RemoteSession};

/// Everything needed to build and run ops: `use cuda_async::prelude::*;`.
pub mod prelude {
    pub use crate::combinators::{join_all, value, with_context, zip_all, BoxedOp};
    pub use crate::launch::launch;
    pub use crate::memory::{copy_d2h, copy_h2d, d2d, d2h, h2d, memset, zeros};
    pub use crate::op::{DeviceOp, DeviceOpExt};
    pub use crate::policy::{SchedulingPolicy, SingleStream, StreamPoolRoundRobin};
    pub use crate::remote::RemotePolicy;
}
