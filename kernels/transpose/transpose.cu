// transpose: out (cols x rows) = in (rows x cols)^T, both row-major.
// Tiles are staged through shared memory described by CuTe layouts: the
// padded smem layout avoids bank conflicts on the column-wise reads.
#include <cuda_bf16.h>

#include <cute/tensor.hpp>

#if defined(DTYPE_f32)
using T = float;
#define TRANSPOSE_ENTRY transpose_f32
#elif defined(DTYPE_bf16)
using T = __nv_bfloat16;
#define TRANSPOSE_ENTRY transpose_bf16
#else
#error "define DTYPE_f32 or DTYPE_bf16"
#endif

#ifndef TILE
#error "define TILE (tile edge in elements)"
#endif

namespace {

constexpr int kTile = TILE;
constexpr int kBlockX = 32;
constexpr int kBlockY = 8;

}  // namespace

extern "C" __global__ void __launch_bounds__(kBlockX * kBlockY)
TRANSPOSE_ENTRY(const T* __restrict__ in, T* __restrict__ out, int rows, int cols) {
  using namespace cute;
  __shared__ T smem[kTile * (kTile + 1)];
  // (row, col) within a tile; the +1 pad shifts each row by one bank.
  auto tile_layout = make_layout(make_shape(Int<kTile>{}, Int<kTile>{}),
                                 make_stride(Int<kTile + 1>{}, Int<1>{}));
  Tensor s = make_tensor(make_smem_ptr(smem), tile_layout);

  Tensor gin = make_tensor(make_gmem_ptr(in), make_shape(rows, cols), make_stride(cols, 1));
  Tensor gout = make_tensor(make_gmem_ptr(out), make_shape(cols, rows), make_stride(rows, 1));

  const int row0 = blockIdx.y * kTile;
  const int col0 = blockIdx.x * kTile;

  for (int r = threadIdx.y; r < kTile; r += kBlockY) {
    for (int c = threadIdx.x; c < kTile; c += kBlockX) {
      if (row0 + r < rows && col0 + c < cols) s(r, c) = gin(row0 + r, col0 + c);
    }
  }
  __syncthreads();
  // Write out[col][row]: consecutive threads write consecutive rows of `in`.
  for (int c = threadIdx.y; c < kTile; c += kBlockY) {
    for (int r = threadIdx.x; r < kTile; r += kBlockX) {
      if (row0 + r < rows && col0 + c < cols) gout(col0 + c, row0 + r) = s(r, c);
    }
  }
}
