// gemm_bf16_tn: D = A * B^T on Hopper (sm_90a), bf16 in, fp32 accumulate,
// bf16 out. One translation unit per instantiation: the defines BM, BN, BK,
// STAGES and CLUSTER_M pick the block tile, the pipeline depth and the
// cluster size along M, and SWAP (0 or 1) whether the host passes B and A swapped and the
// kernel stores D transposed (see kernels/gemm/README.md).
#include "kernels/gemm/sm90_bf16_gemm.cuh"

#if !defined(BM) || !defined(BN) || !defined(BK) || !defined(STAGES) || !defined(CLUSTER_M) || !defined(SWAP)
#error "define BM, BN, BK, STAGES, CLUSTER_M and SWAP (e.g. -DBM=128 -DBN=256 -DBK=64 -DSTAGES=4 -DCLUSTER_M=1 -DSWAP=0)"
#endif

// wgmma and setmaxnreg exist only in the arch-specific target: refuse to build
// an empty kernel for plain sm_90 (or anything else).
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "gemm_bf16_tn needs -arch=sm_90a (wgmma, setmaxnreg)"
#endif

// CLUSTER_K (optional, default 1): 2 or 4 splits each tile's K between the CTAs of a cluster
// (Config's kClusterK): the family gemm_kc (kernels/gemm/BUILD.bazel).
#ifndef CLUSTER_K
#define CLUSTER_K 1
#endif

using GemmConfig = cubinstore::gemm::Config<BM, BN, BK, STAGES, CLUSTER_M, SWAP, CLUSTER_K>;

// The cluster shape is compiled in, so a plain launch (no cluster attribute)
// runs with it; the grid must be a multiple of CLUSTER_M x CLUSTER_K.
#if CLUSTER_M * CLUSTER_K > 1
#define GEMM_CLUSTER_DIMS __cluster_dims__(CLUSTER_M * CLUSTER_K, 1, 1)
#else
#define GEMM_CLUSTER_DIMS
#endif

// min blocks 1 gives the entry register cap that setmaxnreg needs.
extern "C" __global__ void __launch_bounds__(GemmConfig::kThreads, 1) GEMM_CLUSTER_DIMS
gemm_bf16_tn(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,
             const __grid_constant__ CUtensorMap tma_d, __nv_bfloat16* d, int m, int n, int k, float* workspace,
             int* counters, int splits) {
  cubinstore::gemm::gemm_tn<GemmConfig>(tma_a, tma_b, tma_d, d, m, n, k, workspace, counters, splits);
}
