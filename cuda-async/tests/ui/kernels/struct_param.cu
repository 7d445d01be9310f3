struct Params { float a; unsigned n; };
extern "C" __global__ void apply(float* x, struct Params p) {}
