//! [`GpuCall`]: the description of a stateless kernel call.

use crate::proto::LaunchArg;

/// A stateless kernel call for [`Client::gpu_call`](super::Client::gpu_call).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuCall {
    /// PTX text.
    pub ptx: String,
    /// Kernel name.
    pub kernel: String,
    /// Grid dimensions.
    pub grid: [u32; 3],
    /// Block dimensions.
    pub block: [u32; 3],
    /// Dynamic shared memory.
    pub shared_mem: u32,
    /// Arguments; use [`LaunchArg::Input`] and [`LaunchArg::Output`] for buffers.
    pub args: Vec<LaunchArg<'static>>,
    /// Input buffers.
    pub inputs: Vec<Vec<u8>>,
    /// Output size in bytes.
    pub output_size: u32,
    /// Byte the output is filled with before the launch.
    pub output_fill: u8,
}

impl GpuCall {
    /// A call of `kernel` in `ptx` with a 1-D launch and no arguments yet.
    pub fn new(
        ptx: impl Into<String>,
        kernel: impl Into<String>,
        grid: u32,
        block: u32,
        output_size: u32,
    ) -> Self {
        Self {
            ptx: ptx.into(),
            kernel: kernel.into(),
            grid: [grid, 1, 1],
            block: [block, 1, 1],
            shared_mem: 0,
            args: Vec::new(),
            inputs: Vec::new(),
            output_size,
            output_fill: 0,
        }
    }

    /// Appends an argument.
    pub fn arg(mut self, a: LaunchArg<'static>) -> Self {
        self.args.push(a);
        self
    }

    /// Appends an input buffer and returns its argument.
    pub fn input(mut self, bytes: Vec<u8>) -> Self {
        let n = self.inputs.len() as u32;
        self.inputs.push(bytes);
        self.args.push(LaunchArg::Input(n));
        self
    }
}
