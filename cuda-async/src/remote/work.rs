//! The work primitives as a remote context records them: kernel launches
//! (the kernel travels as a description) and library calls the node runs
//! with its own libraries.

use cuda_core::cudarc::driver::LaunchConfig;
use cuda_core::{Kernel, Result};

use super::context::RemoteContext;
use crate::launch::KernelArgs;

impl RemoteContext {
    /// Records a launch of `kernel` with `args`. The arguments are checked
    /// here when the parameter list is known (PTX, or a module this process
    /// loaded); the node checks again against what it compiled.
    pub(crate) fn launch<A: KernelArgs>(
        &mut self,
        kernel: &Kernel,
        config: &LaunchConfig,
        args: &A,
    ) -> Result<()> {
        if kernel.params().is_some() {
            args.check(kernel)?;
        }
        let args = args.remote_all(self)?;
        let stream = self.stream();
        self.recording.launch(stream, kernel, config, args);
        Ok(())
    }
}

#[cfg(feature = "blas")]
mod blas {
    use std::ops::Range;

    use cuda_core::blas::{BlasScalar, Element, Gemm};
    use cuda_core::Result;

    use super::RemoteContext;
    use crate::buffer::DeviceBuffer;
    use crate::remote::proto::{Dtype, GemmSpec, Op};

    impl RemoteContext {
        /// Records `g` over `a`, `b` and `c` (buffers and the elements of
        /// each): the node runs it with its own cuBLAS and checks the
        /// shapes against the buffers again; the buffers order themselves
        /// there, as a launch's do.
        pub(crate) fn gemm<T: BlasScalar>(
            &mut self,
            g: &Gemm<T>,
            a: (&DeviceBuffer<T>, Range<usize>),
            b: (&DeviceBuffer<T>, Range<usize>),
            c: (&DeviceBuffer<T>, Range<usize>),
        ) -> Result<()> {
            let dtype = match T::ELEMENT {
                Element::F32 => Dtype::F32,
                Element::F64 => Dtype::F64,
                Element::Bf16 => Dtype::Bf16,
                Element::F16 => Dtype::F16,
            };
            let spec = GemmSpec {
                dtype,
                a: self.operand(a.0, a.1)?,
                b: self.operand(b.0, b.1)?,
                c: self.operand(c.0, c.1)?,
                m: g.m as u64,
                n: g.n as u64,
                k: g.k as u64,
                ld: [g.lda, g.ldb, g.ldc].map(|v| v as u64),
                transpose: [g.transpose_a, g.transpose_b],
                scalars: [g.alpha.to_f64().to_bits(), g.beta.to_f64().to_bits()],
                batch: g.batch as u64,
                strides: [g.stride_a, g.stride_b, g.stride_c].map(|v| v as u64),
            };
            let stream = self.stream();
            self.recording.push(stream, Op::Gemm(Box::new(spec)));
            Ok(())
        }
    }
}

#[cfg(feature = "rand")]
mod rand {
    use std::any::TypeId;
    use std::ops::Range;

    use cuda_core::rand::{Distribution, Fill, RandScalar};
    use cuda_core::{Error, Result};

    use super::RemoteContext;
    use crate::buffer::DeviceBuffer;
    use crate::remote::proto::{Dtype, Op, RandDist, RandSpec};

    impl RemoteContext {
        /// Records the random fill `f` of `dst` (a buffer and the elements
        /// of it): the node fills it with its own cuRAND; the buffer orders
        /// itself there, as a launch's do.
        ///
        /// # Errors
        /// [`Error::NeedsLocalStream`] for an element type other than `f32`
        /// and `f64` (what a node fills).
        pub(crate) fn rand_fill<T: RandScalar>(
            &mut self,
            f: &Fill<T>,
            dst: (&DeviceBuffer<T>, Range<usize>),
        ) -> Result<()> {
            let dtype = if TypeId::of::<T>() == TypeId::of::<f32>() {
                Dtype::F32
            } else if TypeId::of::<T>() == TypeId::of::<f64>() {
                Dtype::F64
            } else {
                return Err(Error::NeedsLocalStream {
                    op: "a random fill of this element type (a lease's node fills f32 and f64)"
                        .into(),
                    context: self.describe(),
                });
            };
            let dist = match f.distribution() {
                Distribution::Uniform => RandDist::Uniform,
                Distribution::Normal { mean, std_dev } => RandDist::Normal {
                    mean: mean.to_f64().to_bits(),
                    std_dev: std_dev.to_f64().to_bits(),
                },
            };
            let spec = RandSpec {
                dtype,
                len: dst.1.len() as u64,
                dst: self.operand(dst.0, dst.1)?,
                seed: f.seed(),
                dist,
            };
            let stream = self.stream();
            self.recording.push(stream, Op::RandFill(spec));
            Ok(())
        }
    }
}
