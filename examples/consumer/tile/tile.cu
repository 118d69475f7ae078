// tile: out = p.scale * in + p.bias over a rows x cols row-major float matrix. Each block brings
// one kBlock-wide box of a row into shared memory with a TMA load through the caller's tensor
// map (CuTe's SM90_TMA_LOAD_2D, from cubinstore's public alias @cubinstore//third_party/cutlass:cute).
// The parameters are what a library passes: scalars, then a struct by value and a CUtensorMap
// (both __grid_constant__), then a pointer; BUILD.bazel declares them in this order.
#include <cuda.h>

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>

namespace consumer {

// 12 bytes, 4-byte aligned: `struct:12:4` in BUILD.bazel.
struct Affine {
  float scale;
  float bias;
  int ld_out;  // elements between two rows of `out`
};

template <int kBlock>
__global__ void __launch_bounds__(kBlock) rowscale(int rows, int cols, const __grid_constant__ Affine p,
                                                  const __grid_constant__ CUtensorMap in, float* out) {
  __shared__ alignas(128) float box[kBlock];
  __shared__ uint64_t loaded;
  const int row = blockIdx.y;
  const int col0 = blockIdx.x * kBlock;
  if (threadIdx.x == 0) {
    cute::initialize_barrier(loaded, 1);
    // A box past the matrix's edge is zero-filled and still counts its full bytes.
    cute::set_barrier_transaction_bytes(loaded, sizeof(box));
    cute::SM90_TMA_LOAD_2D::copy(&in, &loaded, static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL),
                                 box, col0, row);
  }
  __syncthreads();
  cute::wait_barrier(loaded, 0);
  const int col = col0 + threadIdx.x;
  if (row < rows && col < cols) out[static_cast<long long>(row) * p.ld_out + col] = p.scale * box[threadIdx.x] + p.bias;
}

template __global__ void rowscale<BLOCK>(int, int, const __grid_constant__ Affine, const __grid_constant__ CUtensorMap,
                                         float*);

}  // namespace consumer
