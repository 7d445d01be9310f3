//! `cuda-core`: the safe foundation of `cuda-async` over [`cudarc`].
//!
//! Device inventory, host callbacks on streams, modules as descriptions
//! (PTX text, or CUDA C compiled by NVRTC per device on first use, cached), typed device buffers,
//! self-protecting pinned host buffers, and one error type that names the
//! failing driver call. Nothing here is async.
//!
//! Without an NVIDIA driver every entry point returns [`Error::NoDriver`]
//! (cudarc would panic; we check first).
//!
//! # Examples
//!
//! ```no_run
//! use cuda_core::{Device, Module};
//! let dev = Device::new(0)?;
//! println!("{:?}", dev.info()?);
//! let m = Module::cuda(r#"extern "C" __global__ void k(int* p) { *p = 7; }"#, &[])?;
//! let k = m.kernel("k")?; // no driver needed up to here
//! k.load_on(&dev)?; // compiles for this device now (else: at first launch)
//! # Ok::<(), cuda_core::Error>(())
//! ```

pub mod arena;
pub mod args;
#[cfg(feature = "blas")]
pub mod blas;
pub mod buffer;
pub mod callback;
pub mod copy;
pub mod device;
pub mod error;
#[cfg(feature = "fft")]
pub mod fft;
mod global;
pub mod graph;
pub mod hostmem;
pub mod mapped;
pub mod mempool;
pub mod module;
pub mod peer;
#[cfg(any(feature = "blas", feature = "rand", feature = "fft"))]
mod per_stream;
pub mod pinned;
#[cfg(feature = "rand")]
pub mod rand;
mod raw;
pub mod reclaim;
pub mod registered;
pub mod remote;
pub mod shared_pinned;
pub mod staging;
pub mod stream_memop;
mod tracking;

pub use arena::{ArenaEnd, ArenaRead, ArenaSlot, StagingArena, ARENA_ALIGN};
pub use args::{ArgList, Args};
pub use buffer::{AnyBitPattern, DeviceBuffer};
pub use callback::{launch_host_callback, launch_host_fn_borrowed};
pub use device::{
    device_count, devices, driver_present, hardware_queues, nvrtc_present, set_hardware_queues,
    Device, DeviceAttribute, DeviceInfo, DEFAULT_HARDWARE_QUEUES, MAX_HARDWARE_QUEUES,
};
pub use error::{is_sticky, panic_message, Error, Result};
pub use global::ModuleGlobal;
pub use graph::{Graph, GraphUpdate, TrackedGraph};
pub use mapped::MappedHostMemory;
pub use mempool::{MemPool, MemPoolOptions, MemPoolStats};
pub use module::{
    compile_ptx, fnv1a64, nvrtc_compilations, parse_ptx_entries, Kernel, Module, ModuleSource,
    ParamClass, ParamSpec,
};
pub use peer::{auto_peer_access, can_access_peer, enable_peer_access, set_auto_peer_access};
pub use pinned::PinnedBuffer;
pub use raw::stream_error;
pub use registered::HostRegistration;
pub use remote::RemoteFailure;
pub use shared_pinned::SharedPinnedBuffer;
pub use stream_memop::stream_write_value_64;
pub use tracking::{MarkScope, UseMark};

/// The cudarc crate this is built on, for interop.
pub use cudarc;
pub use cudarc::driver::{
    CudaEvent, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, ValidAsZeroBits,
};
/// The half-precision types (`half::bf16`, `half::f16`) that buffers hold
/// and, with `blas`, GEMM multiplies (feature `half`).
#[cfg(feature = "half")]
pub use half;
