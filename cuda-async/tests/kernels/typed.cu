// Kernels for the typed launchers of `cuda_async::kernels!` (tests).

// y = a * x + y
extern "C" __global__ void saxpy(float a, const float* __restrict__ x,
                                 float* __restrict__ y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

/* One partial sum per block, in dynamic shared memory
   (launch with blockDim.x * sizeof(float) bytes of it). */
extern "C" __global__ void block_sums(const float* x, float* partial, unsigned n) {
    extern __shared__ float s[];
    unsigned t = threadIdx.x;
    unsigned i = blockIdx.x * blockDim.x + t;
    s[t] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (unsigned w = blockDim.x / 2; w > 0; w /= 2) {
        if (t < w) s[t] += s[t + w];
        __syncthreads();
    }
    if (t == 0) partial[blockIdx.x] = s[0];
}

// out (cols x rows) = transpose of in (rows x cols), on a 2-D grid.
extern "C" __global__ void transpose(const float* in, float* out, int rows, int cols) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int r = blockIdx.y * blockDim.y + threadIdx.y;
    if (r < rows && c < cols) out[c * rows + r] = in[r * cols + c];
}

// Several inputs of several types, and scalars.
extern "C" __global__ void blend(const float* a, double const* b, const int* mask,
                                 float* out, float wa, double wb,
                                 unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = mask[i] ? (float)(wa * a[i] + wb * b[i]) : 0.0f;
}

// Spins for `ns` nanoseconds and records its start and end on the GPU's
// clock (for overlap checks).
extern "C" __global__ void spin_stamp(unsigned long long* stamps, unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
    stamps[0] = t0;
    stamps[1] = t;
}
