//! Procedural macros of `cuda-async`: an implementation detail, used
//! through `cuda-async`'s re-exports, never directly.
//!
//! So far this crate holds the part every macro of it builds on: the
//! parser of CUDA C kernel signatures (`signature.rs`), which turns the
//! `extern "C" __global__` declarations of a `.cu` file into typed
//! parameter lists (which buffers a kernel reads, which it writes, which
//! scalars it takes). The kernel-module macro that generates typed
//! launchers from them comes next (issue 10).

// Used by the kernel-module macro, which lands next; tested on its own now.
#[cfg_attr(not(test), allow(dead_code))]
mod signature;
