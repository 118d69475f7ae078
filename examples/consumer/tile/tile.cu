// tile: rows of a row-major matrix scaled by a per-row factor, CuTe's integer types from
// cubinstore's bundled CUTLASS headers (the public alias @cubinstore//third_party/cutlass:cute).
#include <cute/numeric/int.hpp>

namespace consumer {

template <int kBlock>
__global__ void __launch_bounds__(kBlock) rowscale(cute::int32_t rows, cute::int32_t cols, const float* factors,
                                                  float* x) {
  const cute::int64_t row = blockIdx.x;
  if (row >= rows) return;
  for (cute::int32_t c = threadIdx.x; c < cols; c += kBlock) x[row * cols + c] *= factors[row];
}

template __global__ void rowscale<BLOCK>(cute::int32_t, cute::int32_t, const float*, float*);

}  // namespace consumer
