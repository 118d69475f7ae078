// skinny_bf16_tn: D = A * B^T for few rows of A on Hopper, through mma.sync (see skinny.cuh
// and kernels/skinny/README.md). One translation unit per instantiation: the defines BM, BN,
// WARPS and UNROLL pick the CTA's rows of A (a multiple of 16) and of B (of 8), its warps and
// the K chunks each warp loads at once; ANY_ROWS=1 (family `skinny_any`) reads rows at any
// element address and stride.
#include "kernels/skinny/skinny.cuh"

#if !defined(BM) || !defined(BN) || !defined(WARPS) || !defined(UNROLL)
#error "define BM, BN, WARPS and UNROLL (e.g. -DBM=16 -DBN=32 -DWARPS=8 -DUNROLL=2)"
#endif
#if BM % 16 || BN % 8
#error "BM must be a multiple of 16 and BN of 8"
#endif

#ifndef ANY_ROWS
#define ANY_ROWS 0
#endif

using SkinnyConfig = cubinstore::skinny::Config<BN / 8, BM / 16, WARPS, UNROLL, ANY_ROWS != 0>;

// Residency is part of the launch contract (the selection model counts waves with it): an SM
// holds 512 threads of it, two CTAs of 8 warps or one of 16, which the registers allow while a
// thread uses at most 128 (a GPU test checks the driver's occupancy). A min-blocks launch bound
// would say so to ptxas, but ptxas then spills (32-88 bytes) where it otherwise needs 104-108.
extern "C" __global__ void __launch_bounds__(SkinnyConfig::kThreads)
skinny_bf16_tn(const __nv_bfloat16* a, const __nv_bfloat16* b, __nv_bfloat16* d, int m, int n, int k, int lda,
               int ldb) {
  cubinstore::skinny::skinny_tn<SkinnyConfig>(a, b, d, m, n, k, lda, ldb);
}
