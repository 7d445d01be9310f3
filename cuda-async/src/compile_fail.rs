//! Compile-fail checks, run by `cargo test --doc`. Each failing snippet has
//! a compiling twin that differs only in the offending part, and names the
//! error code it must fail with, so it cannot fail for an unrelated reason.
//!
//! A non-`Send` value cannot go into an op (ops cross threads):
//!
//! ```compile_fail,E0277
//! use cuda_async::prelude::*;
//! let _op = value(std::rc::Rc::new(1));
//! ```
//! ```
//! use cuda_async::prelude::*;
//! let _op = value(std::sync::Arc::new(1));
//! ```
//!
//! nor be captured by a combinator's closure:
//!
//! ```compile_fail,E0277
//! use cuda_async::prelude::*;
//! let rc = std::rc::Rc::new(1);
//! let _op = value(1).map(move |x| x + *rc);
//! ```
//! ```
//! use cuda_async::prelude::*;
//! let arc = std::sync::Arc::new(1);
//! let _op = value(1).map(move |x| x + *arc);
//! ```
//!
//! A borrowed buffer cannot outlive a spawned future (spawning needs
//! `'static`, and the op borrows the buffer):
//!
//! ```compile_fail,E0597
//! use cuda_async::prelude::*;
//! fn spawn<F: std::future::IntoFuture + Send + 'static>(_f: F) {}
//! fn f(_b: cuda_async::DeviceBuffer<f32>) {
//!     let buf = _b;
//!     spawn(d2h(&buf));
//! }
//! ```
//! ```
//! use cuda_async::prelude::*;
//! fn spawn<F: std::future::IntoFuture + Send + 'static>(_f: F) {}
//! fn f(_b: cuda_async::DeviceBuffer<f32>) {
//!     let buf = _b;
//!     spawn(d2h(buf));
//! }
//! ```
//!
//! Launching a kernel is `unsafe` (the kernel is arbitrary device code):
//!
//! ```compile_fail,E0133
//! use cuda_async::prelude::*;
//! fn f(k: &cuda_async::Kernel, cfg: cuda_async::LaunchConfig) {
//!     let _op = launch(k, cfg, (1u32,));
//! }
//! ```
//! ```
//! use cuda_async::prelude::*;
//! fn f(k: &cuda_async::Kernel, cfg: cuda_async::LaunchConfig) {
//!     // SAFETY: a doc example that is never run.
//!     let _op = unsafe { launch(k, cfg, (1u32,)) };
//! }
//! ```
//!
//! A device buffer of a non-`Send` element type is not `Send`:
//!
//! ```compile_fail,E0277
//! fn send<T: Send>(_t: T) {}
//! fn f(b: cuda_async::DeviceBuffer<std::rc::Rc<u8>>) { send(b) }
//! ```
//! ```
//! fn send<T: Send>(_t: T) {}
//! fn f(b: cuda_async::DeviceBuffer<u8>) { send(b) }
//! ```
//!
//! Host reads of GPU-written data need a type where every bit pattern is
//! valid: no `bool` that a memset or a kernel set to 2.
//!
//! ```compile_fail,E0277
//! use cuda_async::prelude::*;
//! let _op = zeros::<bool>(4).then(|b| memset(b, 2)).then(d2h);
//! ```
//! ```
//! use cuda_async::prelude::*;
//! let _op = zeros::<u8>(4).then(|b| memset(b, 2)).then(d2h);
//! ```
//!
//! A hand-written op is awaitable only with its `IntoFuture` half (one
//! line of [`awaitable!`](crate::awaitable)): without it, the `DeviceOp`
//! impl itself does not compile, rather than `.await` failing somewhere
//! later.
//!
//! ```compile_fail,E0277
//! use cuda_async::{DeviceOp, ExecutionContext, Result};
//! struct Answer;
//! impl DeviceOp for Answer {
//!     type Output = u32;
//!     unsafe fn execute(self, _ctx: &mut ExecutionContext) -> Result<u32> { Ok(42) }
//! }
//! ```
//! ```
//! use cuda_async::{DeviceOp, ExecutionContext, Result};
//! struct Answer;
//! impl DeviceOp for Answer {
//!     type Output = u32;
//!     unsafe fn execute(self, _ctx: &mut ExecutionContext) -> Result<u32> { Ok(42) }
//! }
//! cuda_async::awaitable!(Answer);
//! ```
//!
//! In generic code, `O::Output` is ambiguous (`IntoFuture` has an `Output`
//! too); [`OutputOf`](crate::OutputOf) names the op's:
//!
//! ```compile_fail,E0221
//! use cuda_async::DeviceOp;
//! async fn run<O: DeviceOp>(op: O) -> cuda_async::Result<O::Output> { op.await }
//! ```
//! ```
//! use cuda_async::DeviceOp;
//! async fn run<O: DeviceOp>(op: O) -> cuda_async::Result<cuda_async::OutputOf<O>> { op.await }
//! ```
