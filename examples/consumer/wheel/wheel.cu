// wheel: y = alpha * x in CUTLASS's half type, the headers from an installed Python package
// (`headers.pip` in MODULE.bazel: the nvidia-cutlass wheel's include folder, found by name).
#include <cutlass/numeric_types.h>

extern "C" __global__ void __launch_bounds__(256) scale_half(int n, float alpha, cutlass::half_t* x) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = cutlass::half_t(alpha * float(x[i]));
}
