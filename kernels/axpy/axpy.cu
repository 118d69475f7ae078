// axpy: y[i] = a * x[i] + y[i] for i < n.
// One translation unit per instantiation: DTYPE_<name> picks the element type
// and VEC the number of consecutive elements each thread handles.
#include "kernels/axpy/axpy.cuh"

#if defined(DTYPE_f32)
using T = float;
#define AXPY_ENTRY axpy_f32
#elif defined(DTYPE_f64)
using T = double;
#define AXPY_ENTRY axpy_f64
#else
#error "define DTYPE_f32 or DTYPE_f64"
#endif

#ifndef VEC
#error "define VEC (elements per thread)"
#endif

extern "C" __global__ void __launch_bounds__(256)
AXPY_ENTRY(int n, T a, const T* __restrict__ x, T* __restrict__ y) {
  cubinstore::axpy<T, VEC>(n, a, x, y);
}
