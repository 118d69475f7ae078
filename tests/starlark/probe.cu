// The source of the Starlark analysis tests' targets; analysis never compiles it.
extern "C" __global__ void probe_f32(int n, float a, float* x) {
  if (static_cast<int>(threadIdx.x) < n) x[threadIdx.x] *= a;
}
