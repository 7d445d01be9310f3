//! The baseline the service is measured against: the same math with
//! cudarc called synchronously from `spawn_blocking`, one stream and one
//! cuBLAS handle per blocking thread, as a careful user without
//! `cuda-async` would write it (`--baseline`).

use std::cell::RefCell;
use std::sync::Arc;

use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};

use crate::model::{HostWeights, CLASSES, D_IN, HIDDEN, KERNELS};

/// What fails in the baseline, as text (it answers a 500 with it).
pub type BaselineError = String;

fn err(what: &str, e: impl std::fmt::Debug) -> BaselineError {
    format!("{what}: {e:?}")
}

/// The weights on GPU 0 and the kernels' module, shared by every
/// blocking thread.
#[derive(Debug)]
pub struct Baseline {
    ctx: Arc<CudaContext>,
    module: Arc<CudaModule>,
    w1: CudaSlice<f32>,
    b1: CudaSlice<f32>,
    w2: CudaSlice<f32>,
}

/// A blocking thread's own stream, cuBLAS handle and kernels.
struct Lane {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    bias_relu: CudaFunction,
    softmax: CudaFunction,
}

thread_local! {
    static LANE: RefCell<Option<Lane>> = const { RefCell::new(None) };
}

/// A column-major product `C (m x n) = A (m x k) * B (k x n)`.
fn product(m: usize, n: usize, k: usize) -> GemmConfig<f32> {
    GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_N,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: m as i32,
        n: n as i32,
        k: k as i32,
        alpha: 1.0,
        lda: m as i32,
        ldb: k as i32,
        beta: 0.0,
        ldc: m as i32,
    }
}

impl Baseline {
    /// Uploads `weights` to GPU 0 and compiles the kernels (NVRTC).
    ///
    /// # Errors
    ///
    /// No driver or GPU, a failed upload or compile.
    pub fn new(weights: &HostWeights) -> Result<Arc<Self>, BaselineError> {
        let ctx = CudaContext::new(0).map_err(|e| err("cuInit/cuCtx", e))?;
        let s = ctx.default_stream();
        let up = |v: &[f32]| s.clone_htod(v).map_err(|e| err("upload", e));
        let (w1, b1, w2) = (up(&weights.w1)?, up(&weights.b1)?, up(&weights.w2)?);
        s.synchronize().map_err(|e| err("synchronize", e))?;
        let ptx = cudarc::nvrtc::compile_ptx(KERNELS).map_err(|e| err("nvrtc", e))?;
        let module = ctx.load_module(ptx).map_err(|e| err("load module", e))?;
        Ok(Arc::new(Baseline {
            ctx,
            module,
            w1,
            b1,
            w2,
        }))
    }

    fn lane(&self) -> Result<Lane, BaselineError> {
        let stream = self.ctx.new_stream().map_err(|e| err("stream", e))?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| err("cublasCreate", e))?;
        let f = |name| self.module.load_function(name).map_err(|e| err(name, e));
        Ok(Lane {
            bias_relu: f("bias_relu")?,
            softmax: f("softmax_columns")?,
            stream,
            blas,
        })
    }

    /// The forward pass of `n` samples on this thread's stream, waited
    /// for: `CLASSES` probabilities a sample. Blocks the calling thread.
    ///
    /// # Errors
    ///
    /// A driver or cuBLAS error, named.
    pub fn forward(&self, x: &[f32], n: usize) -> Result<Vec<f32>, BaselineError> {
        LANE.with(|cell| {
            let mut cell = cell.borrow_mut();
            if cell.is_none() {
                *cell = Some(self.lane()?);
            }
            let lane = cell.as_ref().expect("made above");
            self.run(lane, x, n)
        })
    }

    fn run(&self, lane: &Lane, x: &[f32], n: usize) -> Result<Vec<f32>, BaselineError> {
        let s = &lane.stream;
        let x = s.clone_htod(x).map_err(|e| err("upload", e))?;
        let mut hid = s
            .alloc_zeros::<f32>(HIDDEN * n)
            .map_err(|e| err("alloc", e))?;
        let mut z = s
            .alloc_zeros::<f32>(CLASSES * n)
            .map_err(|e| err("alloc", e))?;
        let (h, c, cols) = (HIDDEN as u32, CLASSES as u32, n as u32);
        // SAFETY: the slices hold what each product reads and writes
        // (HIDDEN x D_IN, D_IN x n, HIDDEN x n; CLASSES x HIDDEN, HIDDEN x
        // n, CLASSES x n), and the kernels touch hid[0..h*cols),
        // b1[0..h) and z[0..c*cols), which they hold.
        unsafe {
            lane.blas
                .gemm(product(HIDDEN, n, D_IN), &self.w1, &x, &mut hid)
                .map_err(|e| err("cublasSgemm", e))?;
            s.launch_builder(&lane.bias_relu)
                .arg(&mut hid)
                .arg(&self.b1)
                .arg(&h)
                .arg(&cols)
                .launch(LaunchConfig::for_num_elems(h * cols))
                .map_err(|e| err("bias_relu", e))?;
            lane.blas
                .gemm(product(CLASSES, n, HIDDEN), &self.w2, &hid, &mut z)
                .map_err(|e| err("cublasSgemm", e))?;
            s.launch_builder(&lane.softmax)
                .arg(&mut z)
                .arg(&c)
                .arg(&cols)
                .launch(LaunchConfig::for_num_elems(cols))
                .map_err(|e| err("softmax_columns", e))?;
        }
        s.clone_dtoh(&z).map_err(|e| err("download", e))
    }
}
