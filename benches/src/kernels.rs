//! The two kernels every comparison uses: an empty one (pure launch and
//! completion overhead) and a ~1 ms spin on the GPU's global timer (for
//! concurrency: two of them overlap or they do not).
//!
//! They are loaded from hand-written PTX, so the report needs no NVRTC on
//! the GPU host; if the driver rejects the PTX, the same kernels are
//! compiled from CUDA C with NVRTC instead.

use cuda_async::cudarc::driver::CudaFunction;
use cuda_async::{Device, Kernel, LaunchConfig, Module, Result};

/// PTX of `empty()` and `spin(u64 ns)`. ISA 7.0 / sm_70: any driver of the
/// last years JIT-compiles it for newer GPUs (H100, H200).
pub const PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry empty()
{
	ret;
}

.visible .entry spin(
	.param .u64 spin_param_0
)
{
	.reg .pred 	%p<2>;
	.reg .b64 	%rd<5>;

	ld.param.u64 	%rd1, [spin_param_0];
	mov.u64 	%rd2, %globaltimer;
$L__spin_loop:
	mov.u64 	%rd3, %globaltimer;
	sub.s64 	%rd4, %rd3, %rd2;
	setp.lt.u64 	%p1, %rd4, %rd1;
	@%p1 bra 	$L__spin_loop;
	ret;
}
"#;

/// The same kernels in CUDA C (the NVRTC fallback).
pub const CUDA_SOURCE: &str = r#"
extern "C" __global__ void empty() {}
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"#;

/// How long the spin kernel runs, in nanoseconds (~1 ms).
pub const SPIN_NS: u64 = 1_000_000;

/// One block of one thread: the launch configuration of both kernels.
pub const ONE_THREAD: LaunchConfig = LaunchConfig {
    grid_dim: (1, 1, 1),
    block_dim: (1, 1, 1),
    shared_mem_bytes: 0,
};

/// The loaded kernels.
#[derive(Debug, Clone)]
pub struct Kernels {
    /// `empty()`: does nothing.
    pub empty: Kernel,
    /// `spin(ns)`: busy-waits `ns` nanoseconds of the GPU's global timer.
    pub spin: Kernel,
    /// `empty` on the fixture's device, for the raw cudarc baselines.
    pub empty_fn: CudaFunction,
    /// `spin` on the fixture's device, for the raw cudarc baselines.
    pub spin_fn: CudaFunction,
    /// Where they came from: `"ptx"` or `"nvrtc"`.
    pub source: &'static str,
}

impl Kernels {
    /// Loads the kernels on `device` (PTX first, NVRTC as the fallback).
    ///
    /// # Errors
    /// The NVRTC error if both ways fail (the PTX error is printed to
    /// stderr).
    pub fn load(device: &Device) -> Result<Self> {
        // Load eagerly: a report must not time the first compile.
        let ptx = Module::ptx(PTX)?.named("benches.ptx");
        let (module, source) = match ptx.load_on(device) {
            Ok(m) => (m.clone(), "ptx"),
            Err(ptx_err) => {
                eprintln!("benches: the PTX kernels did not load ({ptx_err}); trying NVRTC");
                let cuda = Module::cuda(CUDA_SOURCE, &[])?.named("benches.cu");
                cuda.load_on(device)?;
                (cuda, "nvrtc")
            }
        };
        let (empty, spin) = (module.kernel("empty")?, module.kernel("spin")?);
        Ok(Kernels {
            empty_fn: empty.function_on(device)?.clone(),
            spin_fn: spin.function_on(device)?.clone(),
            empty,
            spin,
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ptx_declares_both_kernels_with_the_expected_parameters() {
        let entries = cuda_core::parse_ptx_entries(PTX);
        assert_eq!(entries.get("empty").map(Vec::len), Some(0));
        let spin: Vec<usize> = entries["spin"].iter().map(|p| p.size).collect();
        assert_eq!(spin, vec![8]);
        assert!(entries["spin"][0].accepts(8, cuda_core::ParamClass::Int));
    }

    #[test]
    fn the_cuda_fallback_defines_the_same_kernels() {
        for name in ["void empty()", "void spin(unsigned long long ns)"] {
            assert!(CUDA_SOURCE.contains(name), "{name}");
        }
    }
}
