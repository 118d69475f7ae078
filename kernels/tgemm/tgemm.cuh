// tgemm: a templated, persistent, warp-specialised Hopper GEMM written the way
// template kernel libraries write theirs: one `CUTLASS_GLOBAL` function
// template (so each instantiation is a *local* symbol of its CUBIN), scalars
// before the tensor maps in the parameter list, and one translation unit per
// instantiation generated from tgemm.cu.tmpl.
//
//   D (M x N, bf16, row-major) = diag(scale_a) * (A * B^T) * diag(scale_b)
//   A: M x K, B: N x K, both K-major (rows contiguous), fp32 accumulation.
//
// Dtype `bf16`: bf16 A and B, wgmma m64nNk16. Dtype `e4m3`: fp8 A and B (read
// through UINT8 tensor maps), wgmma m64nNk32, and the per-stage partial sums
// are added into fp32 registers ("promotion"), since the tensor core's own fp8
// accumulator keeps only about 14 bits. A null scale pointer means all ones.
//
// CTA = 3 warpgroups: warpgroup 0 is the TMA producer (one thread), 1 and 2
// the wgmma consumers, each owning BM/2 rows of the block tile. The grid is
// persistent: CTA c takes tiles c, c + gridDim.x, ... in an L2-friendly order.
// The launch contract is in kernels/tgemm/README.md.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cutlass/detail/helper_macros.hpp>

#include "kernels/gemm/sm90_ptx.cuh"

// wgmma and setmaxnreg exist only in the arch-specific target: refuse to build
// an empty kernel for plain sm_90 or anything else.
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "tgemm needs -arch=sm_90a (wgmma, setmaxnreg)"
#endif

namespace cubinstore::tgemm {

// Operand types, as tags: their names are what the demangled entry shows.
struct bf16 {};
struct e4m3 {};

using cute::SM90::GMMA::Major;
using cute::SM90::GMMA::ScaleOut;

template <class Dtype, int N>
struct Mma;
template <> struct Mma<bf16, 64> { using type = cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_SS<Major::K, Major::K>; };
template <> struct Mma<bf16, 128> { using type = cute::SM90::GMMA::MMA_64x128x16_F32BF16BF16_SS<Major::K, Major::K>; };
template <> struct Mma<bf16, 192> { using type = cute::SM90::GMMA::MMA_64x192x16_F32BF16BF16_SS<Major::K, Major::K>; };
template <> struct Mma<bf16, 256> { using type = cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<Major::K, Major::K>; };
template <> struct Mma<e4m3, 64> { using type = cute::SM90::GMMA::MMA_64x64x32_F32E4M3E4M3_SS_TN<>; };
template <> struct Mma<e4m3, 128> { using type = cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_SS_TN<>; };
template <> struct Mma<e4m3, 192> { using type = cute::SM90::GMMA::MMA_64x192x32_F32E4M3E4M3_SS_TN<>; };
template <> struct Mma<e4m3, 256> { using type = cute::SM90::GMMA::MMA_64x256x32_F32E4M3E4M3_SS_TN<>; };

template <class Dtype>
struct Elem;
template <> struct Elem<bf16> { static constexpr int kBytes = 2; static constexpr bool kPromote = false; };
template <> struct Elem<e4m3> { static constexpr int kBytes = 1; static constexpr bool kPromote = true; };

template <class Dtype_, int BM_, int BN_, int BK_, int STAGES_>
struct Config {
  using Dtype = Dtype_;
  static constexpr int kBM = BM_, kBN = BN_, kBK = BK_, kStages = STAGES_;
  static constexpr int kElemBytes = Elem<Dtype_>::kBytes;
  static constexpr bool kPromote = Elem<Dtype_>::kPromote;
  static constexpr int kThreads = 384;
  static constexpr int kConsumers = 2;
  static constexpr int kWgRows = kBM / kConsumers;  // tile rows per consumer warpgroup
  static constexpr int kMmaM = kWgRows / 64;        // m64 wgmmas per consumer per k step
  static constexpr int kAccPerMma = kBN / 2;        // fp32 registers of one m64 x BN wgmma
  static constexpr int kAcc = kMmaM * kAccPerMma;
  // Every k step of wgmma reads 32 bytes of K (k16 bf16, k32 fp8): four per
  // 128-byte swizzled row.
  static constexpr int kRowElems = 128 / kElemBytes;
  static constexpr int kABytes = kBM * 128;
  static constexpr int kBBytes = kBN * 128;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kGroupM = 8;  // tile rows rastered together, for L2 reuse of B
  // The launch formula of README.md and BUILD.bazel: 1024 for aligning the
  // ring to the swizzle pattern, then per stage its A and B boxes and two
  // mbarriers.
  static constexpr int kSmemBytes = 1024 + kStages * (kStageBytes + 16);
  // fp8 with room for two partial accumulators (BN = 128): stage s+1's wgmmas
  // run while stage s's partials are added, instead of draining every stage.
  static constexpr bool kTwoParts = kPromote && 3 * kAcc <= 192;

  // A stage is exactly one 128-byte swizzle row of K, so the shared-memory
  // formula is the same for every dtype (bf16 BK=64, fp8 BK=128).
  static_assert(kBK * kElemBytes == 128, "BK * sizeof(element) must be 128 bytes: 64 for bf16, 128 for e4m3");
  static_assert(kBM == 128 || kBM == 256, "BM must be 128 or 256");
  static_assert(kBN == 64 || kBN == 128 || kBN == 192 || kBN == 256, "BN must be 64, 128, 192 or 256");
  static_assert(kStages >= 2, "STAGES must be at least 2");
  // Promotion keeps a second accumulator of the same size live.
  static_assert(kAcc * (kTwoParts ? 3 : kPromote ? 2 : 1) <= 192, "accumulators exceed the consumers' 232 registers");
  static_assert(kSmemBytes <= 232448, "shared memory exceeds the sm_90 limit of 227 KiB");
};

template <class Op, std::size_t... I>
__device__ __forceinline__ void wgmma(uint64_t desc_a, uint64_t desc_b, float* acc, ScaleOut scale,
                                      std::index_sequence<I...>) {
  Op::fma(desc_a, desc_b, acc[I]..., scale);
}

// Keeps the compiler from moving reads or writes of accumulator registers
// across the wgmma fences and waits that order them (CUTLASS does the same).
template <int N>
__device__ __forceinline__ void fence_regs(float* r) {
#pragma unroll
  for (int i = 0; i < N; ++i) cute::warpgroup_fence_operand(r[i]);
}

__device__ __forceinline__ int cdiv(int a, int b) { return (a + b - 1) / b; }

// Tile t of the persistent order -> (tm, tn): groups of kGroupM tile rows are
// walked column by column, so the CTAs running at one time share B panels.
template <class C>
__device__ __forceinline__ void tile_coords(int t, int tiles_m, int tiles_n, int& tm, int& tn) {
  const int span = C::kGroupM * tiles_n;
  const int first = (t / span) * C::kGroupM;
  const int rows = min(tiles_m - first, C::kGroupM);
  const int within = t % span;
  tm = first + within % rows;
  tn = within / rows;
}

// One stage of wgmmas of a consumer into `dst` (kMmaM blocks of m64 x BN),
// committed as one batch. With `overwrite`, the first k step ignores dst's old
// contents (scale-d = 0): the stage's partial sums for fp8 promotion.
template <class C, bool overwrite>
__device__ __forceinline__ void issue_stage(float* dst, uint32_t a_base, uint32_t b_base) {
  using Op = typename Mma<typename C::Dtype, C::kBN>::type;
  fence_regs<C::kAcc>(dst);
  cute::warpgroup_arrive();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const uint64_t desc_b = sm90::smem_desc_sw128(b_base + kk * 32);
#pragma unroll
    for (int mi = 0; mi < C::kMmaM; ++mi) {
      const uint64_t desc_a = sm90::smem_desc_sw128(a_base + mi * 64 * 128 + kk * 32);
      const ScaleOut scale = (overwrite && kk == 0) ? ScaleOut::Zero : ScaleOut::One;
      wgmma<Op>(desc_a, desc_b, dst + mi * C::kAccPerMma, scale, std::make_index_sequence<C::kAccPerMma>{});
    }
  }
  cute::warpgroup_commit_batch();
  fence_regs<C::kAcc>(dst);
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Epilogue of one consumer warpgroup: its kWgRows x BN block of the tile,
// scaled, rounded to bf16 and stored. In the wgmma accumulator layout lane l
// of warp w holds rows 16w + l/4 (+8) and columns 8j + 2(l%4) + {0,1} of each
// 8-column block j; a 4x4 transpose inside each quad of lanes gives every lane
// 8 consecutive columns, so each row is written with 16-byte stores.
template <class C>
__device__ __forceinline__ void store_tile(const float* acc, __nv_bfloat16* d, int m, int n, int row0,
                                           int col0, const float* scale_a, const float* scale_b, int lane,
                                           int warp) {
  const int q = lane % 4;
  const bool vec_ok = (n % 8) == 0;  // 16-byte aligned rows (d itself is 16-byte aligned)
#pragma unroll
  for (int mi = 0; mi < C::kMmaM; ++mi) {
    const int rbase = row0 + mi * 64 + warp * 16 + lane / 4;
    float sa[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = rbase + 8 * h;
      sa[h] = (scale_a != nullptr && row < m) ? __ldg(scale_a + row) : 1.0f;
    }
#pragma unroll
    for (int g = 0; g < C::kBN / 32; ++g) {
      float sb[4][2];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = col0 + 8 * (4 * g + jj) + 2 * q + c;
          sb[jj][c] = (scale_b != nullptr && col < n) ? __ldg(scale_b + col) : 1.0f;
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t p[4];
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const float* a = acc + mi * C::kAccPerMma + 4 * (4 * g + jj) + 2 * h;
          p[jj] = pack_bf16x2(a[0] * sa[h] * sb[jj][0], a[1] * sa[h] * sb[jj][1]);
        }
        // Transpose p across the quad: afterwards lane q holds, in order, the
        // pairs of lanes 0..3 for block 4g + q. Two butterfly rounds (xor 2,
        // xor 1); each lane replaces the two slots whose bit differs from its
        // own, with selects rather than run-time register indices.
        {
          const bool hi = (q & 2) != 0;
          const uint32_t r0 = __shfl_xor_sync(0xffffffffu, hi ? p[0] : p[2], 2);
          const uint32_t r1 = __shfl_xor_sync(0xffffffffu, hi ? p[1] : p[3], 2);
          p[0] = hi ? r0 : p[0];
          p[1] = hi ? r1 : p[1];
          p[2] = hi ? p[2] : r0;
          p[3] = hi ? p[3] : r1;
        }
        {
          const bool odd = (q & 1) != 0;
          const uint32_t r0 = __shfl_xor_sync(0xffffffffu, odd ? p[0] : p[1], 1);
          const uint32_t r1 = __shfl_xor_sync(0xffffffffu, odd ? p[2] : p[3], 1);
          p[0] = odd ? r0 : p[0];
          p[2] = odd ? r1 : p[2];
          p[1] = odd ? p[1] : r0;
          p[3] = odd ? p[3] : r1;
        }
        const int row = rbase + 8 * h;
        const int col = col0 + 8 * (4 * g + q);
        if (row >= m || col >= n) continue;
        __nv_bfloat16* dst = d + static_cast<size_t>(row) * static_cast<size_t>(n) + col;
        if (vec_ok) {
          // n % 8 == 0 and col % 8 == 0, so all 8 columns are in bounds.
          *reinterpret_cast<uint4*>(dst) = make_uint4(p[0], p[1], p[2], p[3]);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            if (col + e < n) {
              const uint32_t w = p[e / 2];
              const unsigned short bits = static_cast<unsigned short>((e % 2) ? (w >> 16) : (w & 0xffffu));
              dst[e] = __ushort_as_bfloat16(bits);
            }
          }
        }
      }
    }
  }
}

template <class C>
__device__ __forceinline__ void run(uint32_t m_, uint32_t n_, uint32_t k_, const float* scale_a,
                                    const float* scale_b, const CUtensorMap& tma_a, const CUtensorMap& tma_b,
                                    __nv_bfloat16* d) {
  extern __shared__ uint8_t smem_raw[];
  const int m = static_cast<int>(m_), n = static_cast<int>(n_), k = static_cast<int>(k_);

  // A launch with less dynamic shared memory than the formula would overrun
  // the ring: fail loudly instead.
  uint32_t dyn_smem;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
  if (dyn_smem < static_cast<uint32_t>(C::kSmemBytes)) __trap();

  // The 128-byte swizzle needs 1024-byte aligned stage buffers.
  uint8_t* base = smem_raw + ((1024 - (sm90::smem_addr(smem_raw) & 1023)) & 1023);
  uint8_t* s_a = base;
  uint8_t* s_b = base + C::kStages * C::kABytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(s_b + C::kStages * C::kBBytes);
  uint64_t* empty = full + C::kStages;

  const int wg = static_cast<int>(threadIdx.x) / 128;
  const int tid = static_cast<int>(threadIdx.x) % 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kStages; ++s) {
      sm90::mbar_init(&full[s], 1);
      sm90::mbar_init(&empty[s], C::kConsumers);
    }
    sm90::fence_mbar_init();
  }
  __syncthreads();

  const int tiles_m = cdiv(m, C::kBM);
  const int tiles_n = cdiv(n, C::kBN);
  const int tiles = tiles_m * tiles_n;
  const int kblocks = cdiv(k, C::kBK);

  if (wg == 0) {
    sm90::regs_dealloc<40>();
    if (tid == 0) {
      sm90::tma_prefetch_desc(&tma_a);
      sm90::tma_prefetch_desc(&tma_b);
      int stage = 0;
      uint32_t phase = 0;
      for (int t = static_cast<int>(blockIdx.x); t < tiles; t += static_cast<int>(gridDim.x)) {
        int tm, tn;
        tile_coords<C>(t, tiles_m, tiles_n, tm, tn);
        for (int kb = 0; kb < kblocks; ++kb) {
          // A fresh barrier counts as having completed the phase before 0, so
          // the first pass over the ring does not block.
          sm90::mbar_wait(&empty[stage], phase ^ 1);
          // Boxes partly outside A or B still deliver their full size (zeros).
          sm90::mbar_arrive_expect_tx(&full[stage], C::kStageBytes);
          const int kc = kb * C::kBK;
          sm90::tma_load_2d(s_a + stage * C::kABytes, &tma_a, &full[stage], kc, tm * C::kBM);
          sm90::tma_load_2d(s_b + stage * C::kBBytes, &tma_b, &full[stage], kc, tn * C::kBN);
          if (++stage == C::kStages) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
    }
  } else {
    sm90::regs_alloc<232>();
    using Op = typename Mma<typename C::Dtype, C::kBN>::type;
    constexpr int kSteps = 4;  // 32-byte k steps per 128-byte stage row
    const int cw = wg - 1;     // rows [cw * kWgRows, (cw + 1) * kWgRows) of the tile
    const int warp = tid / 32;
    const int lane = tid % 32;
    float acc[C::kAcc];
    // Per-stage partial sums (fp8 promotion); unused for bf16.
    float part[C::kPromote ? C::kAcc : 1];
    float part1[C::kTwoParts ? C::kAcc : 1];  // the second partial buffer (kTwoParts)
    int stage = 0;
    uint32_t phase = 0;
    for (int t = static_cast<int>(blockIdx.x); t < tiles; t += static_cast<int>(gridDim.x)) {
      int tm, tn;
      tile_coords<C>(t, tiles_m, tiles_n, tm, tn);
#pragma unroll
      for (int i = 0; i < C::kAcc; ++i) acc[i] = 0.0f;
      fence_regs<C::kAcc>(acc);

      int prev_stage = -1;
      if constexpr (C::kTwoParts) {
        // Partials alternate between part0 (even k blocks) and part1 (odd);
        // the batch of one is in flight while the other is added into acc.
        auto next = [&]() {
          if (++stage == C::kStages) {
            stage = 0;
            phase ^= 1;
          }
        };
        auto fold = [&](float* part, int st) {  // its batch has completed
          fence_regs<C::kAcc>(part);
          if (tid == 0) sm90::mbar_arrive(&empty[st]);
#pragma unroll
          for (int i = 0; i < C::kAcc; ++i) acc[i] += part[i];
        };
        auto a_of = [&](int st) { return sm90::smem_addr(s_a + st * C::kABytes) + cw * C::kWgRows * 128; };
        auto b_of = [&](int st) { return sm90::smem_addr(s_b + st * C::kBBytes); };
        // Every path waits the same way, so ptxas can see which batch each
        // wait retires: one batch is outstanding at the top of each half.
        if (kblocks > 0) {
          int kb = 0, prev = stage;
          sm90::mbar_wait(&full[stage], phase);
          issue_stage<C, true>(part, a_of(stage), b_of(stage));
          next();
          while (true) {
            if (++kb == kblocks) {
              cute::warpgroup_wait<0>();
              fold(part, prev);
              break;
            }
            int cur = stage;
            sm90::mbar_wait(&full[cur], phase);
            issue_stage<C, true>(part1, a_of(cur), b_of(cur));
            next();
            cute::warpgroup_wait<1>();
            fold(part, prev);
            prev = cur;
            if (++kb == kblocks) {
              cute::warpgroup_wait<0>();
              fold(part1, prev);
              break;
            }
            cur = stage;
            sm90::mbar_wait(&full[cur], phase);
            issue_stage<C, true>(part, a_of(cur), b_of(cur));
            next();
            cute::warpgroup_wait<1>();
            fold(part1, prev);
            prev = cur;
          }
        }
      } else
      for (int kb = 0; kb < kblocks; ++kb) {
        sm90::mbar_wait(&full[stage], phase);
        const uint32_t a_base = sm90::smem_addr(s_a + stage * C::kABytes) + cw * C::kWgRows * 128;
        const uint32_t b_base = sm90::smem_addr(s_b + stage * C::kBBytes);
        float* dst = C::kPromote ? part : acc;
        if constexpr (C::kPromote) fence_regs<C::kAcc>(part);
        cute::warpgroup_arrive();
#pragma unroll
        for (int kk = 0; kk < kSteps; ++kk) {
          // Each k step is 32 bytes further along the 128-byte swizzled row.
          const uint64_t desc_b = sm90::smem_desc_sw128(b_base + kk * 32);
#pragma unroll
          for (int mi = 0; mi < C::kMmaM; ++mi) {
            const uint64_t desc_a = sm90::smem_desc_sw128(a_base + mi * 64 * 128 + kk * 32);
            // Promotion: the stage's first step overwrites the partial sums.
            const ScaleOut scale = (C::kPromote && kk == 0) ? ScaleOut::Zero : ScaleOut::One;
            wgmma<Op>(desc_a, desc_b, dst + mi * C::kAccPerMma, scale,
                      std::make_index_sequence<C::kAccPerMma>{});
          }
        }
        cute::warpgroup_commit_batch();
        if constexpr (C::kPromote) {
          // The partial sums are needed now: wait for this stage's batch,
          // free the stage, then add in fp32 (the other consumer's wgmmas keep
          // the tensor cores busy meanwhile).
          cute::warpgroup_wait<0>();
          fence_regs<C::kAcc>(part);
          if (tid == 0) sm90::mbar_arrive(&empty[stage]);
#pragma unroll
          for (int i = 0; i < C::kAcc; ++i) acc[i] += part[i];
        } else {
          fence_regs<C::kAcc>(acc);
          if (prev_stage >= 0) {
            // Keep one batch in flight; the one before it has finished
            // reading its stage, which can be refilled.
            cute::warpgroup_wait<1>();
            if (tid == 0) sm90::mbar_arrive(&empty[prev_stage]);
          }
          prev_stage = stage;
        }
        if (++stage == C::kStages) {
          stage = 0;
          phase ^= 1;
        }
      }
      if constexpr (!C::kPromote) {
        cute::warpgroup_wait<0>();
        fence_regs<C::kAcc>(acc);
        if (prev_stage >= 0 && tid == 0) sm90::mbar_arrive(&empty[prev_stage]);
      }
      store_tile<C>(acc, d, m, n, tm * C::kBM + cw * C::kWgRows, tn * C::kBN, scale_a, scale_b, lane, warp);
    }
  }
}

// The entry. Scalars come before the tensor maps on purpose, as in library
// kernels: nvcc 13.0 puts the parameters at offsets 0, 4, 8, 16, 24, 112,
// 240, 368 (.nv.info), not where 64-byte alignment alone would put the maps.
// `__launch_bounds__(384, 1)` gives the entry register cap setmaxnreg needs.
template <class Dtype, int BM, int BN, int BK, int STAGES>
CUTLASS_GLOBAL void __launch_bounds__(384, 1)
    tgemm_impl(uint32_t m, uint32_t n, uint32_t k, const float* scale_a, const float* scale_b,
               const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,
               __nv_bfloat16* d) {
  run<Config<Dtype, BM, BN, BK, STAGES>>(m, n, k, scale_a, scale_b, tma_a, tma_b, d);
}

}  // namespace cubinstore::tgemm
