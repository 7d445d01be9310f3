// The kernels of examples/typed_kernels.rs: `cuda_async::kernels!` reads
// this file at compile time and generates a typed Rust launcher for each.

// y = a * x + b * y
extern "C" __global__ void axpby(float a, const float* __restrict__ x,
                                 float b, float* __restrict__ y, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + b * y[i];
}

// sums[r] = m[r][0] + ... + m[r][cols - 1], one thread per row.
extern "C" __global__ void row_sums(const float* m, float* sums,
                                    unsigned rows, unsigned cols) {
    unsigned r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float s = 0.0f;
    for (unsigned c = 0; c < cols; ++c) s += m[r * cols + c];
    sums[r] = s;
}
