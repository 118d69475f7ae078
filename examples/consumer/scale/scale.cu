// scale: x[i] = a * x[i] for i < n, one instantiation per element type.
#if defined(DTYPE_f32)
using T = float;
#define SCALE_ENTRY scale_f32
#elif defined(DTYPE_f64)
using T = double;
#define SCALE_ENTRY scale_f64
#else
#error "define DTYPE_f32 or DTYPE_f64"
#endif

extern "C" __global__ void __launch_bounds__(256) SCALE_ENTRY(int n, T a, T* __restrict__ x) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] = a * x[i];
}
