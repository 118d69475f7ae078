// The axpy body, shared by every instantiation of the family.
#pragma once

namespace cubinstore {

template <typename T, int kVec>
__device__ __forceinline__ void axpy(int n, T a, const T* __restrict__ x, T* __restrict__ y) {
  // Each thread owns kVec consecutive elements; the last block handles the tail.
  const long long first = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
#pragma unroll
  for (int v = 0; v < kVec; ++v) {
    const long long i = first + v;
    if (i < n) y[i] = a * x[i] + y[i];
  }
}

}  // namespace cubinstore
