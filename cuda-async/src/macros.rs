//! `macro_rules!` macros of the crate ([`zip!`](crate::zip!),
//! [`launch!`](crate::launch!)) and the `__private` support of the
//! generated code of [`kernels!`](crate::kernels).

/// Runs 2 to 12 ops concurrently, each on its own stream of the pool
/// (forked from the parent stream and joined back with events), and
/// produces the tuple of their outputs: [`zip_all`](crate::zip_all) with
/// the arms written out.
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// use cuda_async::zip;
/// let (a, b, c, d) = zip!(zeros::<f32>(8), h2d(vec![1u8; 4]), value(3), zeros::<u32>(2)).sync()?;
/// assert_eq!((a.len(), b.len(), c, d.len()), (8, 4, 3, 2));
/// # Ok::<(), cuda_async::Error>(())
/// ```
#[macro_export]
macro_rules! zip {
    ($only:expr $(,)?) => {
        ::core::compile_error!("zip! takes 2 to 12 ops (one op needs no zip)")
    };
    ($($op:expr),+ $(,)?) => {
        $crate::zip_all(($($op,)+))
    };
}

/// A kernel launch with its parts named: `launch!(kernel: &k, config: cfg,
/// args: [a, b, c])` is `launch(&k, cfg, (a, b, c))`, for kernels loaded
/// at run time (the typed launchers of [`kernels!`](crate::kernels) need
/// neither). It is `unsafe` as [`launch`](crate::launch()) is: write it inside
/// an `unsafe` block and say why the kernel stays inside its buffers.
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// use cuda_async::{LaunchConfig, Module};
/// let k = Module::cuda(r#"extern "C" __global__ void fill(float* x, float v, unsigned n) {
///     unsigned i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] = v; }"#, &[])?
///     .kernel("fill")?;
/// let n = 1024u32;
/// let out = zeros::<f32>(n as usize)
///     // SAFETY: `fill` writes x[0..n), and x has n elements.
///     .then(move |x| unsafe {
///         cuda_async::launch!(kernel: &k, config: LaunchConfig::for_num_elems(n), args: [x, 2.5f32, n])
///     })
///     .then(|(x, _, _)| d2h(x))
///     .sync()?;
/// assert!(out.as_slice()?.iter().all(|&v| v == 2.5));
/// # Ok::<(), cuda_async::Error>(())
/// ```
#[macro_export]
macro_rules! launch {
    (kernel: $kernel:expr, config: $config:expr, args: [$($arg:expr),* $(,)?] $(,)?) => {
        $crate::launch($kernel, $config, ($($arg,)*))
    };
}

/// Support for the code [`kernels!`](crate::kernels) generates. Not a
/// public API: it changes without notice.
#[doc(hidden)]
pub mod __private {
    use std::sync::OnceLock;

    pub use crate::launch::{BufferIn, BufferOut, Launch};
    pub use cuda_core::{Kernel, LaunchConfig, Module};

    /// The embedded CUDA C source of one `kernels!` file and its kernels,
    /// made on first use (compiled by NVRTC on each device's first launch,
    /// through `cuda-core`'s cache).
    #[derive(Debug)]
    pub struct ModuleCell {
        source: &'static str,
        names: &'static [&'static str],
        ptx: bool,
        made: OnceLock<(Module, Vec<Kernel>)>,
    }

    impl ModuleCell {
        /// The cell of `source`, whose kernels are `names`.
        pub const fn new(source: &'static str, names: &'static [&'static str]) -> Self {
            ModuleCell {
                source,
                names,
                ptx: false,
                made: OnceLock::new(),
            }
        }

        /// The cell of precompiled PTX `text` (JIT-compiled by the driver,
        /// no NVRTC), whose kernels are `names`.
        pub const fn new_ptx(text: &'static str, names: &'static [&'static str]) -> Self {
            ModuleCell {
                source: text,
                names,
                ptx: true,
                made: OnceLock::new(),
            }
        }

        fn made(&self) -> &(Module, Vec<Kernel>) {
            self.made.get_or_init(|| {
                // The macro checked at compile time what these can fail on:
                // no NUL byte in the text, names read from the source (and
                // found as `.entry`s in the PTX).
                let module = if self.ptx {
                    Module::ptx(self.source)
                } else {
                    Module::cuda(self.source, &[])
                }
                .expect("kernels!: the module text was checked at compile time");
                let kernels = self
                    .names
                    .iter()
                    .map(|n| {
                        module
                            .kernel(n)
                            .expect("kernels!: kernel names come from the source")
                    })
                    .collect();
                (module, kernels)
            })
        }

        /// The module (e.g. to `load_on` a device at start-up).
        pub fn module(&self) -> Module {
            self.made().0.clone()
        }

        /// Kernel `i` of the file, in source order.
        pub fn kernel(&self, i: usize) -> &Kernel {
            &self.made().1[i]
        }
    }
}
