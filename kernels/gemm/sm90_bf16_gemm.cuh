// Warp-specialised, persistent Hopper GEMM: D (M x N, bf16, row-major) =
// A (M x K, bf16, K-major) * B (N x K, bf16, K-major)^T, fp32 accumulation.
//
// One CTA = 3 warpgroups. Warpgroup 0 is the producer: one thread issues TMA
// loads of A and B tiles into a STAGES-deep ring of shared-memory buffers,
// each guarded by a "full" and an "empty" mbarrier. Warpgroups 1 and 2 are
// consumers: each owns BM/2 rows of the block tile and issues wgmma
// (m64 x BN x k16, both operands from shared memory) over every stage.
// With CLUSTER_M = 2 the two CTAs of a cluster work on vertically adjacent
// tiles that share the B tile; each CTA loads half of it and multicasts that
// half to both CTAs.
//
// The grid is persistent: cluster c processes work units c, c + clusters, ...
// A work unit is (tile row, tile column, K split); with splits > 1 the CTAs
// of one tile but the last split write fp32 partials to `workspace` and count
// themselves in `counters`; the last split waits for them (and resets the
// count to zero), adds them to its own in split order and writes D.
// splits == 0 is stream-K: one to two waves of tiles are dealt out to the
// clusters as equal ranges of K blocks (see Walk), reduced the same way.
// With SWAP = 1 the host passes B and A in each other's place (m = N, n = M) and
// the tiles are stored transposed into D (store_tile_swapped_tma, store_tile_swapped_staged, store_tile_swapped).
// See kernels/gemm/README.md for the launch contract.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/arch/mma_sm90_gmma_ext.hpp>

#include "kernels/gemm/sm90_ptx.cuh"

namespace cubinstore::gemm {

using cute::SM90::GMMA::Major;

template <int N>
struct WgmmaOp;
// m64 x N x k16, both operands K-major in shared memory. N beyond the multiples of 64 (the
// swapped tiles' rows of A) come from CuTe's extended atoms.
#define CUBINSTORE_GEMM_WGMMA(N)                                                            \
  template <>                                                                               \
  struct WgmmaOp<N> {                                                                       \
    using type = cute::SM90::GMMA::MMA_64x##N##x16_F32BF16BF16_SS<Major::K, Major::K>;      \
  };
// Every multiple of 8 up to 256: the N a swapped tile may have (GemmConfig checks the same).
CUBINSTORE_GEMM_WGMMA(8) CUBINSTORE_GEMM_WGMMA(16) CUBINSTORE_GEMM_WGMMA(24) CUBINSTORE_GEMM_WGMMA(32)
CUBINSTORE_GEMM_WGMMA(40) CUBINSTORE_GEMM_WGMMA(48) CUBINSTORE_GEMM_WGMMA(56) CUBINSTORE_GEMM_WGMMA(64)
CUBINSTORE_GEMM_WGMMA(72) CUBINSTORE_GEMM_WGMMA(80) CUBINSTORE_GEMM_WGMMA(88) CUBINSTORE_GEMM_WGMMA(96)
CUBINSTORE_GEMM_WGMMA(104) CUBINSTORE_GEMM_WGMMA(112) CUBINSTORE_GEMM_WGMMA(120) CUBINSTORE_GEMM_WGMMA(128)
CUBINSTORE_GEMM_WGMMA(136) CUBINSTORE_GEMM_WGMMA(144) CUBINSTORE_GEMM_WGMMA(152) CUBINSTORE_GEMM_WGMMA(160)
CUBINSTORE_GEMM_WGMMA(168) CUBINSTORE_GEMM_WGMMA(176) CUBINSTORE_GEMM_WGMMA(184) CUBINSTORE_GEMM_WGMMA(192)
CUBINSTORE_GEMM_WGMMA(200) CUBINSTORE_GEMM_WGMMA(208) CUBINSTORE_GEMM_WGMMA(216) CUBINSTORE_GEMM_WGMMA(224)
CUBINSTORE_GEMM_WGMMA(232) CUBINSTORE_GEMM_WGMMA(240) CUBINSTORE_GEMM_WGMMA(248) CUBINSTORE_GEMM_WGMMA(256)
#undef CUBINSTORE_GEMM_WGMMA

// Expands the accumulator array into the atom's N/2 register operands.
template <class Op, std::size_t... I>
__device__ __forceinline__ void wgmma(uint64_t desc_a, uint64_t desc_b, float* acc,
                                      std::index_sequence<I...>) {
  Op::fma(desc_a, desc_b, acc[I]..., cute::SM90::GMMA::ScaleOut::One);
}

template <int BM_, int BN_, int BK_, int STAGES_, int CLUSTER_M_, int SWAP_ = 0, int CLUSTER_K_ = 1>
struct Config {
  static constexpr int kBM = BM_;
  static constexpr int kBN = BN_;
  static constexpr int kBK = BK_;
  static constexpr int kStages = STAGES_;
  static constexpr int kClusterM = CLUSTER_M_;
  // SWAP = 1: the host passes B as the kernel's A and A as its B (m = N, n = M), so the tile's
  // BN runs along the caller's M (any multiple of 8: few or odd rows of A pad less), and the
  // kernel stores its result transposed, D[col][row] with rows of m elements.
  static constexpr bool kSwap = SWAP_ != 0;
  // CLUSTER_K = 2 or 4: the CTAs of a cluster take equal shares of one tile's K blocks, and the
  // others put their accumulators into the first's shared memory (distributed shared memory)
  // instead of the split-K round trip through global memory; the first adds them and stores D.
  // The family gemm_kc (kernels/gemm/BUILD.bazel) sets it.
  static constexpr int kClusterK = CLUSTER_K_;
  static constexpr int kClusterSize = CLUSTER_M_ * CLUSTER_K_;  // CTAs a cluster
  static constexpr int kPartialFloats = BM_ * BN_;
  static constexpr int kPartialsBytes = (CLUSTER_K_ - 1) * kPartialFloats * 4;  // the peers' buffers, one each
  static constexpr int kRedBytes = CLUSTER_K_ > 1 ? kPartialsBytes + 16 : 0;      // and two mbarriers

  // BM = 64 (small-M problems): one consumer warpgroup, so no padded rows are multiplied.
  static constexpr int kConsumers = BM_ == 64 ? 1 : 2;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kWgRows = kBM / kConsumers;  // rows of the tile per consumer
  static constexpr int kMmaM = kWgRows / 64;        // m64 wgmma rows per consumer
  static constexpr int kAccPerMma = kBN / 2;        // fp32 registers of one m64 x BN wgmma
  static constexpr int kAcc = kMmaM * kAccPerMma;
  static constexpr int kSubK = kBK / 64;  // 128-byte swizzle atoms (64 bf16) along K
  static constexpr int kABytes = kBM * kBK * 2;
  static constexpr int kBBytes = kBN * kBK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kBRowsPerCta = kBN / kClusterM;
  // Cluster rows grouped together in the tile order, so that concurrently
  // running tiles share A and B panels in L2.
  static constexpr int kGroupM = 8;
  // Split-K: the reducer (the last split) takes this many K blocks more than an even share, about
  // 1.5 us of main loop (5 blocks of 64x128x64): the other splits then publish their partials
  // while it still multiplies, not after it has finished (benchmarks/gemm_split_cost.py).
  static constexpr int kReducerLead = (5 * 64 * 128 * 64 + kBM * kBN * kBK - 1) / (kBM * kBN * kBK);
  // D leaves through shared memory in 64 x 64 boxes (8 KiB): two a consumer, taking turns so
  // that one is filled while TMA reads the other, where they fit and a tile has an even number
  // of them (the turns then restart at each tile without a counter); else one.
  // Swapped: one box of BN rows of D (the tile's columns) by 64 of its columns (an m64 block).
  static constexpr int kDBoxBytes = kSwap ? kBN * 128 : 64 * 128;
  static constexpr int kFixedBytes = 1024 + kStages * kStageBytes + 2 * kStages * 8 + kRedBytes;
  static constexpr int kDBoxes =
      !kSwap && kFixedBytes + 2 * kConsumers * kDBoxBytes <= 232448 && (kMmaM * kBN / 64) % 2 == 0 ? 2 : 1;
  // Must match the formula in README.md and cubinstore/ops/gemm.py.
  static constexpr int kSmemBytes = kFixedBytes + kDBoxes * kConsumers * kDBoxBytes;

  static_assert(kBM == 64 || kBM == 128 || kBM == 256, "BM must be 64, 128 or 256");
  static_assert(kSwap ? kBN % 8 == 0 && kBN <= 256 : kBN == 64 || kBN == 128 || kBN == 192 || kBN == 256,
                "BN must be 64, 128, 192 or 256 (with SWAP = 1, a multiple of 8 up to 256)");
  static_assert(kBK == 64 || kBK == 128, "BK must be 64 or 128");
  static_assert(kClusterM == 1 || kClusterM == 2 || kClusterM == 4, "CLUSTER_M must be 1, 2 or 4");
  static_assert(kClusterK == 1 || ((kClusterK == 2 || kClusterK == 4) && kClusterM == 1 && !kSwap),
                "CLUSTER_K must be 1, or 2 or 4 with CLUSTER_M = 1 and SWAP = 0");
  static_assert(kAcc <= 128, "accumulator tile too large for 232 registers per thread");
  static_assert(kStages >= 2, "STAGES must be at least 2");
  static_assert(kSmemBytes <= 232448, "shared memory exceeds the sm_90 limit of 227 KiB");
  // Each CTA multicasts an equal slice of B's rows. A slice may start on any 128-byte row:
  // TMA swizzles by the shared-memory address, so the pattern stays whole across slices.
  static_assert(kBN % kClusterM == 0, "BN must be a multiple of CLUSTER_M");
};

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

template <class C>
struct Schedule {
  int tiles_m, tiles_n, units_m, kblocks, splits, units;

  __device__ __forceinline__ Schedule(int m, int n, int k, int splits_) {
    tiles_m = ceil_div(m, C::kBM);
    tiles_n = ceil_div(n, C::kBN);
    units_m = ceil_div(tiles_m, C::kClusterM);
    kblocks = ceil_div(k, C::kBK);
    splits = splits_ > 0 ? splits_ : 1;  // stream-K (0) walks whole tiles
    units = units_m * tiles_n * splits;
  }

  // Work unit -> tile (tm, tn) of this CTA and its K-block range [kb0, kb1).
  __device__ __forceinline__ void decode(int u, uint32_t rank, int& tm, int& tn, int& split,
                                         int& kb0, int& kb1) const {
    split = u % splits;
    const int t = u / splits;
    const int span = C::kGroupM * tiles_n;
    const int first = (t / span) * C::kGroupM;
    const int rows = min(units_m - first, C::kGroupM);
    const int within = t % span;
    tm = (first + within % rows) * C::kClusterM + static_cast<int>(rank);
    tn = within / rows;
    // The reducer's lead, leaving every other split at least one K block.
    const int lead = splits > 1 ? max(0, min(C::kReducerLead, kblocks - splits)) : 0;
    const int even = kblocks - lead;
    kb0 = static_cast<int>(static_cast<long long>(split) * even / splits);
    kb1 = split == splits - 1 ? kblocks : static_cast<int>(static_cast<long long>(split + 1) * even / splits);
  }
};

// One piece of work of a CTA: K blocks [kb0, kb1) of tile (tm, tn), piece `slot` of the
// `nslots` that tile is cut into (1: the CTA owns the whole tile and stores D itself).
struct Piece {
  int tm, tn, kb0, kb1, slot, nslots;
  long long tile_start;  // stream-K: the tile's first iteration in the stream-K range; -1: a whole or split-K unit
};

// The sequence of pieces of one cluster, the same for its producer and consumers.
//
// splits >= 1 (split-K): units u = cluster, cluster + clusters, ... of the schedule.
// splits == 0 (stream-K): the tiles (cluster units) in schedule order are cut in two parts.
// The K blocks of the first P - dp tiles, I in all, are dealt out as contiguous ranges,
// cluster g taking [g I / G, (g + 1) I / G) (G = min(clusters, I)); then the last dp tiles
// go whole, round robin, as with splits = 1. dp is all but the last one to two waves of
// tiles, so every cluster does the same work to within one K block, and the cut tiles come
// first, their sums overlapping the whole tiles instead of ending the kernel. A tile whose
// K blocks span several clusters has one piece (slot) per cluster, in K order.
template <class C>
struct Walk {
  const Schedule<C>& sched;
  int cluster, clusters, rank;
  int u, u_end, u_step;       // whole (or split-K) units still to do: u, u + u_step, ... < u_end
  int sk_clusters;            // G
  long long sk_iters, i, i1;  // I, and this cluster's remaining stream-K range [i, i1)

  __device__ __forceinline__ Walk(const Schedule<C>& s, int cluster_, int clusters_, uint32_t rank_, int splits)
      : sched(s), cluster(cluster_), clusters(clusters_), rank(static_cast<int>(rank_)), u_end(s.units),
        u_step(clusters_) {
    if (splits > 0) {
      u = cluster;
      sk_clusters = 1;
      sk_iters = i = i1 = 0;
      return;
    }
    const int waves = s.units / clusters;
    const int dp = waves >= 2 ? (waves - 1) * clusters : 0;
    u = s.units - dp + cluster;
    sk_iters = static_cast<long long>(s.units - dp) * s.kblocks;
    sk_clusters = static_cast<int>(min(static_cast<long long>(clusters), sk_iters));
    i = start(cluster);
    i1 = cluster < sk_clusters ? start(cluster + 1) : i;
  }

  __device__ __forceinline__ long long start(int g) const {
    return g >= sk_clusters ? sk_iters : static_cast<long long>(g) * sk_iters / sk_clusters;
  }
  // The cluster whose range holds stream-K iteration j: the last g with start(g) <= j.
  __device__ __forceinline__ int owner(long long j) const {
    return static_cast<int>(((j + 1) * sk_clusters - 1) / sk_iters);
  }

  __device__ __forceinline__ bool next(Piece& p) {
    int split;
    if (i < i1) {
      const int kblocks = sched.kblocks;
      const long long t = i / kblocks;
      p.tile_start = t * kblocks;
      int kb_unused0, kb_unused1;
      sched.decode(static_cast<int>(t), static_cast<uint32_t>(rank), p.tm, p.tn, split, kb_unused0, kb_unused1);
      p.kb0 = static_cast<int>(i - p.tile_start);
      p.kb1 = static_cast<int>(min(i1 - p.tile_start, static_cast<long long>(kblocks)));
      const int first = owner(p.tile_start);
      p.slot = cluster - first;
      p.nslots = owner(p.tile_start + kblocks - 1) - first + 1;
      i = p.tile_start + p.kb1;
      return true;
    }
    if (u >= u_end) return false;
    sched.decode(u, static_cast<uint32_t>(rank), p.tm, p.tn, split, p.kb0, p.kb1);
    p.slot = split;
    p.nslots = sched.splits;
    p.tile_start = -1;
    u += u_step;
    return true;
  }

  // Where piece `s` (not the reducer) of the tile of `p` keeps its fp32 partial, in BM x BN
  // blocks. Split-K: one block per (tile, split) but the last split, the reducer. Stream-K: one
  // per CTA, for the first piece of its range (a piece of a slot above 0 starts a range: the
  // tile began in an earlier one).
  __device__ __forceinline__ size_t partial_block(const Piece& p, int s) const {
    if (p.tile_start < 0) {
      const int tile = p.tm * sched.tiles_n + p.tn;
      return static_cast<size_t>(tile) * (sched.splits - 1) + s;
    }
    const int g = owner(p.tile_start) + s;
    return static_cast<size_t>(g) * C::kClusterM + rank;
  }
};

// CLUSTER_K > 1: K rank r of the cluster takes the r-th of CLUSTER_K equal shares of the piece's K
// blocks (the producer and the consumers of a CTA the same).
template <class C>
__device__ __forceinline__ void take_k_share(Piece& p, int krank) {
  if constexpr (C::kClusterK > 1) {
    const int kb0 = p.kb0, span = p.kb1 - p.kb0;
    p.kb0 = kb0 + span * krank / C::kClusterK;
    p.kb1 = kb0 + span * (krank + 1) / C::kClusterK;
  }
}

template <class C>
__device__ __forceinline__ void release_stage(uint64_t* empty, int stage, int tid) {
  if constexpr (C::kClusterM == 1) {
    if (tid == 0) sm90::mbar_arrive(&empty[stage]);
  } else {
    // The stage is refilled by multicasts from every CTA of the cluster, so
    // each of their producers must learn that this consumer is done with it.
    if (tid < C::kClusterM) sm90::mbar_arrive_cluster(&empty[stage], static_cast<uint32_t>(tid));
  }
}

// An unswapped consumer's m64 block `mi`, columns 64 c .. 64 c + 63, into a 64 x 64 staging box in the
// 128-byte swizzle (the eight rows a warp writes at once fall in 32 different banks). Warp w writes
// the box's rows 16 w .. 16 w + 15: the wgmma accumulator layout
// (lane l holds rows l / 4 and l / 4 + 8 of its warp's 16, columns 8 j + 2 (l % 4) + {0, 1}).
template <class C>
__device__ __forceinline__ void fill_box(const float* acc, uint8_t* box, int mi, int c, int lane, int warp) {
#pragma unroll
  for (int jl = 0; jl < 8; ++jl) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp * 16 + lane / 4 + 8 * h;
      const int j = 8 * c + jl;
      const float v0 = acc[mi * C::kAccPerMma + 4 * j + 2 * h];
      const float v1 = acc[mi * C::kAccPerMma + 4 * j + 2 * h + 1];
      const int byte = row * 128 + ((jl ^ (row & 7)) << 4) + (lane % 4) * 4;
      *reinterpret_cast<__nv_bfloat162*>(box + byte) = __floats2bfloat162_rn(v0, v1);
    }
  }
}

// SWAP = 0 without TMA (N not a multiple of 8, or D off 16 bytes): per m64 block and 64 columns, each
// warp puts its 16 rows in the consumer's staging box (fill_box, as store_tile_tma), then writes those rows
// out itself, 32 consecutive elements of one row an instruction (64 contiguous bytes, bounds
// checked). A warp reads back only the rows it wrote, so a __syncwarp orders it. Element pairs
// stored straight from the accumulators (what this replaced) scatter each instruction over 8 rows
// of D, 2 bytes in every 4: on the H100 such shapes took 1.4x the model's estimate.
template <class C>
__device__ __forceinline__ void store_tile_staged(const float* acc, __nv_bfloat16* d, int m, int n, uint8_t* box,
                                                  int row0, int col0, int lane, int warp) {
  static_assert(!C::kSwap && C::kBN % 64 == 0, "the staged store is the unswapped tiles'");
#pragma unroll
  for (int mi = 0; mi < C::kMmaM; ++mi) {
#pragma unroll
    for (int c = 0; c < C::kBN / 64; ++c) {
      __syncwarp();  // this warp's rows of the previous box are written out
      fill_box<C>(acc, box, mi, c, lane, warp);
      __syncwarp();
      const int r0 = row0 + 64 * mi + warp * 16, c0 = col0 + 64 * c;
      const int rows = min(16, m - r0);  // the same for the whole warp
      __nv_bfloat16* out = d + static_cast<size_t>(r0) * static_cast<size_t>(n) + c0;
      const uint8_t* src = box + warp * 16 * 128;
#pragma unroll 1
      for (int r = 0; r < rows; ++r, out += n, src += 128) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int col = lane + 32 * half;  // chunk col / 8 of box row 16 warp + r sits at chunk (col / 8) ^ (r % 8)
          if (c0 + col < n) out[col] = *reinterpret_cast<const __nv_bfloat16*>(src + (((col / 8) ^ (r & 7)) << 4) + (col % 8) * 2);
        }
      }
    }
  }
}

// D's rows of one consumer through TMA: per m64 block and 64 columns, the bf16 values go into
// the consumer's staging box in the 128-byte swizzle (so the 8 rows a warp writes at once hit
// 32 different banks), and one thread stores the box; the TMA engine clips it at M and N and
// writes whole lines while the consumer goes on to its next tile. With two boxes they take turns
// (a tile has an even number of stores, so the last of one tile and the first of the next use
// different boxes): a box is refilled once the store before the latest has read it, so one
// store is read while the next box is filled.
template <class C>
__device__ __forceinline__ void store_tile_tma(const float* acc, const CUtensorMap& tma_d, uint8_t* boxes,
                                               int row0, int col0, int lane, int warp, int tid, int cw) {
  const uint32_t barrier = 2 + static_cast<uint32_t>(cw);  // one named barrier per consumer warpgroup
#pragma unroll
  for (int mi = 0; mi < C::kMmaM; ++mi) {
#pragma unroll
    for (int c = 0; c < C::kBN / 64; ++c) {
      uint8_t* box = boxes + ((mi * (C::kBN / 64) + c) % C::kDBoxes) * C::kDBoxBytes;
      if (tid == 0) sm90::bulk_wait_group_read<C::kDBoxes - 1>();
      sm90::named_barrier_sync(barrier, 128);
      fill_box<C>(acc, box, mi, c, lane, warp);
      sm90::fence_proxy_async_smem();
      sm90::named_barrier_sync(barrier, 128);
      if (tid == 0) {
        sm90::tma_store_2d(&tma_d, box, col0 + 64 * c, row0 + 64 * mi);
        sm90::bulk_commit_group();
      }
    }
  }
}

// Two floats as the bf16 pair of one 32-bit register (the low half holds `lo`).
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// A swapped consumer's m64 block `mi` into its BN-row staging box in the 128-byte swizzle: the
// accumulators of one warp's 8 x 8 block (8 tile rows, 8 tile columns) go transposed with stmatrix:
// stored row c (D's row 8 j + c) is the 8 tile rows of that block as 16 bytes, the chunk
// (2 warp + h) ^ (c & 7) of box row 8 j + c. Every warp writes into every row of the box.
template <class C>
__device__ __forceinline__ void fill_box_swapped(const float* acc, uint8_t* box, int mi, int lane, int warp) {
  const uint32_t base = sm90::smem_addr(box);
  // Lane 8 i + r addresses row r of matrix i; matrix i of a store is (column block j + i / 2, h = i % 2).
  const int r = lane % 8;
  const int half = (lane / 8) % 2;
  const int jstep = lane / 16;
  auto row_addr = [&](int j, int h) -> uint32_t {
    const int c = 8 * j + r;
    return base + static_cast<uint32_t>(c * 128 + (((2 * warp + h) ^ r) << 4));
  };
  const float* a = acc + mi * C::kAccPerMma;
#pragma unroll
  for (int j = 0; j + 1 < C::kBN / 8; j += 2) {
    sm90::stmatrix_x4_trans(row_addr(j + jstep, half), pack_bf16x2(a[4 * j], a[4 * j + 1]),
                            pack_bf16x2(a[4 * j + 2], a[4 * j + 3]), pack_bf16x2(a[4 * j + 4], a[4 * j + 5]),
                            pack_bf16x2(a[4 * j + 6], a[4 * j + 7]));
  }
  if constexpr ((C::kBN / 8) % 2 == 1) {
    constexpr int j = C::kBN / 8 - 1;
    sm90::stmatrix_x2_trans(row_addr(j, half), pack_bf16x2(a[4 * j], a[4 * j + 1]),
                            pack_bf16x2(a[4 * j + 2], a[4 * j + 3]));
  }
}

// SWAP = 1 through TMA: per m64 block, the consumer's 64 tile rows become the 64 columns of a
// BN-row box of D (fill_box_swapped), and one thread stores the box at (row0 + 64 mi, col0);
// `tma_d` maps D with a (64, BN) box, so the store ends at this tile's last row of D and is
// clipped at M and N.
template <class C>
__device__ __forceinline__ void store_tile_swapped_tma(const float* acc, const CUtensorMap& tma_d, uint8_t* box,
                                                       int row0, int col0, int lane, int warp, int tid, int cw) {
  const uint32_t barrier = 2 + static_cast<uint32_t>(cw);
#pragma unroll
  for (int mi = 0; mi < C::kMmaM; ++mi) {
    if (tid == 0) sm90::bulk_wait_group_read<0>();
    sm90::named_barrier_sync(barrier, 128);
    fill_box_swapped<C>(acc, box, mi, lane, warp);
    sm90::fence_proxy_async_smem();
    sm90::named_barrier_sync(barrier, 128);
    if (tid == 0) {
      sm90::tma_store_2d(&tma_d, box, row0 + 64 * mi, col0);
      sm90::bulk_commit_group();
    }
  }
}

// SWAP = 1 without TMA (D's rows, the kernel's m, not a multiple of 8, or D off 16 bytes) on a
// two-consumer tile: per m64 block the box is filled as for TMA, and after the warpgroup's barrier
// (every warp wrote into every row) warp w writes out the box rows w, w + 4, ...: 64 consecutive
// elements of a row of D, 32 an instruction (64 contiguous bytes), bounds checked. On the H100
// (2026-12-06) 0.90-1.02 of the element stores' time with clusters of 4 (128x200), 0.95-1.05 without.
template <class C>
__device__ __forceinline__ void store_tile_swapped_staged(const float* acc, __nv_bfloat16* d, int m, int n,
                                                          uint8_t* box, int row0, int col0, int lane, int warp,
                                                          int cw) {
  const uint32_t barrier = 2 + static_cast<uint32_t>(cw);
#pragma unroll
  for (int mi = 0; mi < C::kMmaM; ++mi) {
    sm90::named_barrier_sync(barrier, 128);  // the previous block's rows are written out
    fill_box_swapped<C>(acc, box, mi, lane, warp);
    sm90::named_barrier_sync(barrier, 128);
    const int e0 = row0 + 64 * mi;  // D's column of the box's first element
    const int rows = min(C::kBN, n - col0);
#pragma unroll 1
    for (int c = warp; c < rows; c += 4) {
      __nv_bfloat16* out = d + static_cast<size_t>(col0 + c) * static_cast<size_t>(m) + e0;
      const uint8_t* src = box + c * 128;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int e = lane + 32 * half;  // chunk e / 8 of box row c sits at chunk (e / 8) ^ (c % 8)
        if (e0 + e < m) out[e] = *reinterpret_cast<const __nv_bfloat16*>(src + (((e / 8) ^ (c & 7)) << 4) + (e % 8) * 2);
      }
    }
  }
}

// SWAP = 1 without TMA on a one-consumer tile (BM = 64): each element alone, bounds checked; the 8 lanes
// of a tile column write 8 consecutive elements of a row of D. (Staged through the box, such a tile
// took 3-13% longer on the H100, 2026-12-06: its only consumer waits at both barriers.)
template <class C>
__device__ __forceinline__ void store_tile_swapped(const float* acc, __nv_bfloat16* d, int m, int n,
                                                   int row0, int col0, int lane, int warp) {
#pragma unroll
  for (int mi = 0; mi < C::kMmaM; ++mi) {
#pragma unroll
    for (int j = 0; j < C::kBN / 8; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // Lane l holds tile rows l / 4 and l / 4 + 8 of its warp's 16, columns 8 j + 2 (l % 4) + {0, 1}:
        // (row, col) is D[col][row], rows of m elements.
        const int row = row0 + mi * 64 + warp * 16 + lane / 4 + 8 * h;
        const int col = col0 + 8 * j + 2 * (lane % 4);
        if (row >= m) continue;
        const float v0 = acc[mi * C::kAccPerMma + 4 * j + 2 * h];
        const float v1 = acc[mi * C::kAccPerMma + 4 * j + 2 * h + 1];
        if (col < n) d[static_cast<size_t>(col) * static_cast<size_t>(m) + row] = __float2bfloat16_rn(v0);
        if (col + 1 < n) d[static_cast<size_t>(col + 1) * static_cast<size_t>(m) + row] = __float2bfloat16_rn(v1);
      }
    }
  }
}

template <class C>
__device__ __forceinline__ void gemm_tn(const CUtensorMap& tma_a, const CUtensorMap& tma_b, const CUtensorMap& tma_d,
                                        __nv_bfloat16* d, int m, int n, int k, float* workspace,
                                        int* counters, int splits) {
  extern __shared__ uint8_t smem_raw[];
  // 128-byte swizzle needs 1024-byte aligned stage buffers; the offset is the
  // same in every CTA, as multicast requires.
  uint8_t* base = smem_raw + ((1024 - (sm90::smem_addr(smem_raw) & 1023)) & 1023);
  uint8_t* s_a = base;
  uint8_t* s_b = base + C::kStages * C::kABytes;
  uint8_t* s_d = s_b + C::kStages * C::kBBytes;  // kDBoxes staging boxes a consumer, 1024-byte aligned
  // CLUSTER_K > 1: the peers' partials (kBM x kBN fp32 each) and two mbarriers (red_full: the
  // reducer's, every partial is in; red_empty: each peer's, the reducer has read them).
  float* s_red = reinterpret_cast<float*>(s_d + C::kDBoxes * C::kConsumers * C::kDBoxBytes);
  uint64_t* full = reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(s_red) + C::kPartialsBytes);
  uint64_t* empty = full + C::kStages;
  uint64_t* red_full = empty + C::kStages;
  uint64_t* red_empty = red_full + 1;

  const int wg = static_cast<int>(threadIdx.x) / 128;
  const int tid = static_cast<int>(threadIdx.x) % 128;
  const uint32_t rank = C::kClusterM > 1 ? sm90::cluster_ctarank() : 0u;  // along M (B multicast)
  const int krank = C::kClusterK > 1 ? static_cast<int>(sm90::cluster_ctarank()) : 0;  // along K

  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kStages; ++s) {
      sm90::mbar_init(&full[s], 1);
      sm90::mbar_init(&empty[s], C::kConsumers * C::kClusterM);
    }
    if constexpr (C::kClusterK > 1) {
      sm90::mbar_init(red_full, (C::kClusterK - 1) * C::kConsumers * 128);
      sm90::mbar_init(red_empty, C::kConsumers * 128);
    }
    sm90::fence_mbar_init();
  }
  if constexpr (C::kClusterSize > 1) {
    sm90::cluster_sync();
  } else {
    __syncthreads();
  }

  if constexpr (C::kClusterK > 1) splits = 1;  // the cluster is the split
  const Schedule<C> sched(m, n, k, splits);
  // TMA stores D when its rows are 16-byte multiples and it starts on 16 bytes (README: the
  // host then passes tma_d); otherwise the consumers store it element pairs at a time.
  // Swapped, D's rows have m elements.
  const bool tma_store = ((C::kSwap ? m : n) & 7) == 0 && (reinterpret_cast<uintptr_t>(d) & 15) == 0;
  const int cluster_id = static_cast<int>(blockIdx.x) / C::kClusterSize;
  const int clusters = static_cast<int>(gridDim.x) / C::kClusterSize;

  if (wg == 0) {
    // Producer: one thread issues all loads; the rest of the warpgroup idles.
    // With one consumer (256 threads) the entry's own register cap already fits it.
    if constexpr (C::kConsumers > 1) sm90::regs_dealloc<40>();
    if (tid == 0) {
      sm90::tma_prefetch_desc(&tma_a);
      sm90::tma_prefetch_desc(&tma_b);
      int stage = 0;
      uint32_t phase = 0;
      Walk<C> walk(sched, cluster_id, clusters, rank, splits);
      Piece piece;
      while (walk.next(piece)) {
        take_k_share<C>(piece, krank);
        const int tm = piece.tm, tn = piece.tn;
        for (int kb = piece.kb0; kb < piece.kb1; ++kb) {
          // A fresh barrier counts as having completed the phase before
          // phase 0, so the first pass over the ring does not block.
          sm90::mbar_wait(&empty[stage], phase ^ 1);
          sm90::mbar_arrive_expect_tx(&full[stage], C::kStageBytes);
          uint8_t* a_dst = s_a + stage * C::kABytes;
          uint8_t* b_dst = s_b + stage * C::kBBytes;
#pragma unroll
          for (int j = 0; j < C::kSubK; ++j) {
            const int kc = kb * C::kBK + j * 64;
            sm90::tma_load_2d(a_dst + j * C::kBM * 128, &tma_a, &full[stage], kc, tm * C::kBM);
            if constexpr (C::kClusterM == 1) {
              sm90::tma_load_2d(b_dst + j * C::kBN * 128, &tma_b, &full[stage], kc, tn * C::kBN);
            } else {
              const int r0 = static_cast<int>(rank) * C::kBRowsPerCta;
              sm90::tma_load_2d_multicast(b_dst + j * C::kBN * 128 + r0 * 128, &tma_b,
                                          &full[stage], kc, tn * C::kBN + r0,
                                          static_cast<uint16_t>((1u << C::kClusterM) - 1));
            }
          }
          if (++stage == C::kStages) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
    }
  } else {
    if constexpr (C::kConsumers > 1) sm90::regs_alloc<232>();
    const int cw = wg - 1;  // consumer index: rows [cw * kWgRows, (cw + 1) * kWgRows) of the tile
    const int ct = cw * 128 + tid;
    const int warp = tid / 32;
    const int lane = tid % 32;
    float acc[C::kAcc];
    int stage = 0;
    uint32_t phase = 0;
    Walk<C> walk(sched, cluster_id, clusters, rank, splits);
    Piece piece;
    uint32_t red_phase = 0;  // CLUSTER_K > 1: tiles done, mod 2
    while (walk.next(piece)) {
      take_k_share<C>(piece, krank);
      const int tm = piece.tm, tn = piece.tn;
#pragma unroll
      for (int i = 0; i < C::kAcc; ++i) acc[i] = 0.0f;

      int prev_stage = -1;
      for (int kb = piece.kb0; kb < piece.kb1; ++kb) {
        sm90::mbar_wait(&full[stage], phase);
        cute::warpgroup_arrive();
        const uint32_t a_base = sm90::smem_addr(s_a + stage * C::kABytes) + cw * C::kWgRows * 128;
        const uint32_t b_base = sm90::smem_addr(s_b + stage * C::kBBytes);
#pragma unroll
        for (int j = 0; j < C::kSubK; ++j) {
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) {
            // Each k16 step is 32 bytes further along the 128-byte swizzled row.
            const uint64_t desc_b = sm90::smem_desc_sw128(b_base + j * C::kBN * 128 + kk * 32);
#pragma unroll
            for (int mi = 0; mi < C::kMmaM; ++mi) {
              const uint64_t desc_a =
                  sm90::smem_desc_sw128(a_base + j * C::kBM * 128 + mi * 64 * 128 + kk * 32);
              wgmma<typename WgmmaOp<C::kBN>::type>(desc_a, desc_b, acc + mi * C::kAccPerMma,
                                                    std::make_index_sequence<C::kAccPerMma>{});
            }
          }
        }
        cute::warpgroup_commit_batch();
        if (prev_stage >= 0) {
          // Keep one batch in flight; the one before it has finished reading
          // its stage, which can be refilled.
          cute::warpgroup_wait<1>();
          release_stage<C>(empty, prev_stage, tid);
        }
        prev_stage = stage;
        if (++stage == C::kStages) {
          stage = 0;
          phase ^= 1;
        }
      }
      cute::warpgroup_wait<0>();
      if (prev_stage >= 0) release_stage<C>(empty, prev_stage, tid);

      // The second CTA of a cluster at the bottom edge has no rows here.
      if (tm >= sched.tiles_m) continue;

      if constexpr (C::kClusterK > 1) {
        // A peer (K rank above 0) puts its accumulators into its buffer in the reducer's s_red once
        // the reducer has read the previous tile's, each thread's float4s where the same thread of
        // the reducer reads them, and goes on; each thread's release orders its own stores. The
        // reducer adds them to its own in rank order (so D gets the same bits on every launch) and
        // stores D.
        constexpr int kConsumerThreads = C::kConsumers * 128;
        if (krank != 0) {
          sm90::mbar_wait_cluster(red_empty, red_phase ^ 1);
          const uint32_t dst = sm90::mapa(sm90::smem_addr(s_red + (krank - 1) * C::kPartialFloats), 0) +
                               static_cast<uint32_t>(ct) * 16;
#pragma unroll
          for (int r = 0; r < C::kAcc / 4; ++r) {
            sm90::st_cluster_v4(dst + r * kConsumerThreads * 16, acc[4 * r], acc[4 * r + 1], acc[4 * r + 2],
                                acc[4 * r + 3]);
          }
          sm90::mbar_arrive_release_cluster(red_full, 0);
          red_phase ^= 1;
          continue;
        }
        sm90::mbar_wait_cluster(red_full, red_phase);
#pragma unroll
        for (int peer = 1; peer < C::kClusterK; ++peer) {
          const float4* part = reinterpret_cast<const float4*>(s_red + (peer - 1) * C::kPartialFloats);
#pragma unroll
          for (int r = 0; r < C::kAcc / 4; ++r) {
            const float4 v = part[r * kConsumerThreads + ct];
            acc[4 * r] += v.x;
            acc[4 * r + 1] += v.y;
            acc[4 * r + 2] += v.z;
            acc[4 * r + 3] += v.w;
          }
        }
#pragma unroll
        for (int peer = 1; peer < C::kClusterK; ++peer) sm90::mbar_arrive_release_cluster(red_empty, peer);
        red_phase ^= 1;
      }

      if (piece.nslots > 1) {
        // The tile is cut in pieces (split-K or stream-K). One piece, fixed by the walk, is the
        // reducer: split-K's last split (the highest unit: every other piece of its tile has a
        // lower unit, which its cluster reaches first, so waiting for them cannot deadlock),
        // stream-K's slot 0 (the last piece of its cluster's range, where the others are the
        // first pieces of theirs). The others write their fp32 partial and publish it; the
        // reducer waits until all have, and adds them to its own in slot order, so D gets the
        // same bits on every launch. No ticket: nothing but the partials is on the critical path.
        constexpr int kConsumerThreads = C::kConsumers * 128;
        constexpr size_t kBlock = static_cast<size_t>(C::kBM) * C::kBN;
        int* published = counters + tm * sched.tiles_n + tn;
        const int mine = piece.slot;
        const bool reducer = piece.tile_start < 0 ? mine == piece.nslots - 1 : mine == 0;
        // Float4 r of a thread holds rows first_row + 64 (r / (BN / 8)) and 8 below it: rows at or
        // past M are never stored, so their partials are neither written nor read (at M = 1 that
        // is all but 4 threads' share of each partial). Not with 128 accumulators a thread: the
        // two flags cost those tiles a spill.
        const int first_row = tm * C::kBM + cw * C::kWgRows + warp * 16 + lane / 4;
        const bool live0 = first_row < m, live1 = first_row + 64 < m;  // m64 blocks 0 and 1 (BM = 256)
        auto live = [&](int r) { return C::kAcc == 128 || (r < C::kAccPerMma / 4 ? live0 : live1); };
        // Publishing is one thread's release after the consumers' barrier, and reading one
        // thread's acquire before it: the barrier carries the other threads' stores and loads
        // (a fence in every thread, MEMBAR.SC.GPU, is not needed for this order).
        if (!reducer) {
          float4* own = reinterpret_cast<float4*>(workspace + walk.partial_block(piece, mine) * kBlock);
#pragma unroll
          for (int r = 0; r < C::kAcc / 4; ++r) {
            if (!live(r)) continue;
            __stcg(own + r * kConsumerThreads + ct,
                   make_float4(acc[4 * r], acc[4 * r + 1], acc[4 * r + 2], acc[4 * r + 3]));
          }
          sm90::named_barrier_sync(1, kConsumerThreads);
          if (ct == 0) sm90::red_add_release_gpu(published, 1);
          continue;
        }
        if (ct == 0) {
          while (sm90::ld_acquire_gpu(published) < piece.nslots - 1) __nanosleep(64);
          *published = 0;  // every other piece is done with it: zero for the next launch
        }
        sm90::named_barrier_sync(1, kConsumerThreads);
        // The others: split-K's slots below the reducer's, stream-K's above it.
        const int from = mine == 0 ? 1 : 0, to = mine == 0 ? piece.nslots : mine;
        for (int sl = from; sl < to; ++sl) {
          const float4* part = reinterpret_cast<const float4*>(workspace + walk.partial_block(piece, sl) * kBlock);
#pragma unroll
          for (int r = 0; r < C::kAcc / 4; ++r) {
            if (!live(r)) continue;
            const float4 v = __ldcg(part + r * kConsumerThreads + ct);
            acc[4 * r] += v.x;
            acc[4 * r + 1] += v.y;
            acc[4 * r + 2] += v.z;
            acc[4 * r + 3] += v.w;
          }
        }
      }
      const int row0 = tm * C::kBM + cw * C::kWgRows, col0 = tn * C::kBN;
      if (!tma_store) {
        if constexpr (C::kSwap) {
          if constexpr (C::kConsumers > 1) {
            store_tile_swapped_staged<C>(acc, d, m, n, s_d + cw * C::kDBoxBytes, row0, col0, lane, warp, cw);
          } else {
            store_tile_swapped<C>(acc, d, m, n, row0, col0, lane, warp);
          }
        } else {
          store_tile_staged<C>(acc, d, m, n, s_d + cw * C::kDBoxes * C::kDBoxBytes, row0, col0, lane, warp);
        }
      } else if constexpr (C::kSwap) {  // each store path is compiled only for the tiles that use it
        store_tile_swapped_tma<C>(acc, tma_d, s_d + cw * C::kDBoxBytes, row0, col0, lane, warp, tid, cw);
      } else {
        store_tile_tma<C>(acc, tma_d, s_d + cw * C::kDBoxes * C::kDBoxBytes, row0, col0, lane, warp, tid, cw);
      }
    }
    // The staging box must outlive the stores that read it; D is complete when the kernel is.
    if (tma_store && tid == 0) sm90::bulk_wait_group<0>();
  }

  __syncwarp();  // reconverge each warp for the .aligned cluster barrier
  if constexpr (C::kClusterSize > 1) {
    // Peers multicast into this CTA's shared memory (or write its s_red) and arrive on its
    // barriers until their last stage: no CTA leaves before all are done.
    sm90::cluster_sync();
  }
}

}  // namespace cubinstore::gemm
