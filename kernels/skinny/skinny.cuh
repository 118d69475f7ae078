// skinny_bf16_tn: D = A * B^T for few rows of A (decode: M of 1 to a few dozen), bf16 in,
// fp32 accumulate, bf16 out. Such a product is bound by reading B once; the gemm family's
// tiles (64 rows of A at least, TMA stages, a split-K reduction through L2 when N has few
// tiles) spend their time on fixed costs instead. Here each CTA owns 8 * J rows of B (J
// n-groups of 8) over the whole of K, so no partial sums leave the CTA:
//
// - its WARPS warps take the K chunks (32 elements) in turn, chunk c to warp c % WARPS;
// - a lane loads 16 contiguous bytes of a B row (8 bf16) and of each A row it needs, with
//   no shared-memory staging: mma.sync m16n8k16 consumes them from registers. The
//   order of K inside an mma does not change a dot product, so lane (g, t) feeds its 8
//   elements at k = 8t..8t+7 as the fragment's k = {2t, 2t+1, 2t+8, 2t+9} of one mma and
//   the same of a second (see README.md, "fragments");
// - a warp loads UNROLL chunks as one batch and holds two batches, so the next is in flight
//   while the mmas consume this one: up to 2 * UNROLL * J * 512 bytes of B a warp;
// - the warps' fp32 sums meet in shared memory and are added in warp order (the same bits on
//   every launch), and the CTA stores its rows < M, columns < N of D.
//
// The grid is one CTA per BM x BN block of D, blocks along N fastest (blockIdx.x modulo the
// blocks of N); each block of rows of A reads B again, so the selection uses this kernel only
// where M fits one.
//
// kAnyRows (family `skinny_any`) reads rows at any element address, so a contiguous B with K off
// 8 (rows 2 * K bytes apart) is read in place rather than copied: a lane's 16 bytes at p lie in
// the two aligned 16-byte chunks at p & ~15, both of which hold bytes of its own (the second
// only when p is off 16, and is then loaded), so nothing outside the operand's rows is touched.
// Both chunks stay raw in registers until the batch is multiplied, where they are shifted into
// place: a batch's loads are still all in flight at once, and a point needs twice the
// registers per chunk (its grid halves UNROLL).
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

namespace cubinstore::skinny {

template <int kGroups_, int kMTiles_, int kWarps_, int kUnroll_, bool kAnyRows_ = false>
struct Config {
  static constexpr int kGroups = kGroups_;  // n-groups of 8 rows of B a CTA
  static constexpr int kMTiles = kMTiles_;  // m16 tiles of A a CTA
  static constexpr int kWarps = kWarps_;    // warps a CTA, splitting K
  static constexpr int kUnroll = kUnroll_;  // K chunks a warp loads at once
  static constexpr bool kAnyRows = kAnyRows_;  // rows at any element address (two chunks a load)
  static constexpr int kParts = kAnyRows ? 2 : 1;  // aligned 16-byte chunks held per load
  // B bypasses L1 (read once), except where a lane's second chunk is its neighbour's first:
  // L1 then serves the second request instead of L2.
  static constexpr bool kOnceB = !kAnyRows;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRows = 16 * kMTiles;  // rows of A (and D) a CTA
  static constexpr int kCols = 8 * kGroups;   // rows of B (columns of D) a CTA
  static constexpr int kChunk = 32;           // K elements a warp consumes per chunk (two mmas)
  static_assert(kThreads == 256 || kThreads == 512, "8 or 16 warps a CTA");
  static_assert(kWarps * kRows * kCols * 4 <= 48 * 1024, "the warps' partial sums exceed 48 KiB of static shared memory");
};

// One 16-byte load of 8 bf16; a false `in` gives zeros and touches no memory. The loads are
// volatile, like the mma, so they stay in program order: a batch is issued whole before the
// mmas of the previous one (ptxas otherwise sinks each load to its use and keeps one chunk in
// flight). `kOnce` (B, read once) keeps it out of L1, where A's rows (read by every CTA) stay.
#define CUBINSTORE_SKINNY_LOAD(hint)                                                                        \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %5, 0;\nmov.b32 %0, 0;\nmov.b32 %1, 0;\nmov.b32 %2, 0;\nmov.b32 %3, 0;\n" \
  "@p ld.global.nc" hint ".v4.u32 {%0, %1, %2, %3}, [%4];\n}"
template <bool kOnce>
__device__ __forceinline__ uint4 load_16(const __nv_bfloat16* p, bool in) {
  uint4 v;
  if constexpr (kOnce) {
    asm volatile(CUBINSTORE_SKINNY_LOAD(".L1::no_allocate")
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "r"(static_cast<int>(in)));
  } else {
    asm volatile(CUBINSTORE_SKINNY_LOAD("")
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "r"(static_cast<int>(in)));
  }
  return v;
}
#undef CUBINSTORE_SKINNY_LOAD

// D (16 x 8, fp32) += A (16 x 16, row) * B (16 x 8, col), PTX ISA "mma.m16n8k16".
__device__ __forceinline__ void mma_16x8x16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                            uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Loads chunks first, first + kW * 32, ... (kU of them) of this lane's B and A rows. Rows read
// at any address (kAnyRows) start at the aligned chunk below (`*_row` is then that pointer);
// their second chunk is loaded only where the row is off 16 bytes (`*_shift`, bytes).
template <class Cfg>
__device__ __forceinline__ void load_batch(uint4 (&bv)[Cfg::kUnroll][Cfg::kGroups][Cfg::kParts],
                                           uint4 (&av)[Cfg::kUnroll][Cfg::kMTiles][2][Cfg::kParts],
                                           const __nv_bfloat16* const (&b_row)[Cfg::kGroups],
                                           const bool (&b_in)[Cfg::kGroups], const int (&b_shift)[Cfg::kGroups],
                                           const __nv_bfloat16* const (&a_row)[Cfg::kMTiles][2],
                                           const bool (&a_in)[Cfg::kMTiles][2], const int (&a_shift)[Cfg::kMTiles][2],
                                           int first, int t, int k) {
#pragma unroll
  for (int u = 0; u < Cfg::kUnroll; ++u) {
    const int col = first + u * Cfg::kWarps * Cfg::kChunk;  // the chunk's first K element
    const bool k_in = col + 8 * t < k;  // k % 8 == 0 here: a lane's 8 elements are all in or all out
#pragma unroll
    for (int j = 0; j < Cfg::kGroups; ++j) {
      bv[u][j][0] = load_16<Cfg::kOnceB>(b_row[j] + col, k_in && b_in[j]);
      if constexpr (Cfg::kAnyRows)
        bv[u][j][1] = load_16<Cfg::kOnceB>(b_row[j] + col + 8, k_in && b_in[j] && b_shift[j]);
    }
#pragma unroll
    for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        av[u][mt][h][0] = load_16<false>(a_row[mt][h] + col, k_in && a_in[mt][h]);
        if constexpr (Cfg::kAnyRows)
          av[u][mt][h][1] = load_16<false>(a_row[mt][h] + col + 8, k_in && a_in[mt][h] && a_shift[mt][h]);
      }
  }
}

// Bytes [shift, shift + 16) of the 32 in (lo, hi); shift is even (bf16 rows). Selects rather
// than an indexed array, which would go through local memory.
__device__ __forceinline__ uint4 realign(const uint4& lo, const uint4& hi, int shift) {
  const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  const int words = shift >> 2;
  const uint32_t bits = (shift & 2) * 8;
  uint32_t s[5];
#pragma unroll
  for (int i = 0; i < 5; ++i) {
    s[i] = w[i];
#pragma unroll
    for (int c = 1; c < 4; ++c) s[i] = words == c ? w[i + c] : s[i];
  }
  return make_uint4(__funnelshift_r(s[0], s[1], bits), __funnelshift_r(s[1], s[2], bits),
                    __funnelshift_r(s[2], s[3], bits), __funnelshift_r(s[3], s[4], bits));
}

// A lane's 8 elements of one load: the chunk itself, or (kAnyRows) its two chunks shifted into place.
template <class Cfg>
__device__ __forceinline__ uint4 piece(const uint4 (&parts)[Cfg::kParts], int shift) {
  if constexpr (Cfg::kAnyRows) {
    return realign(parts[0], parts[1], shift);
  } else {
    return parts[0];
  }
}

template <class Cfg>
__device__ __forceinline__ void multiply_batch(float (&acc)[Cfg::kMTiles][Cfg::kGroups][4],
                                               const uint4 (&bv)[Cfg::kUnroll][Cfg::kGroups][Cfg::kParts],
                                               const uint4 (&av)[Cfg::kUnroll][Cfg::kMTiles][2][Cfg::kParts],
                                               const int (&b_shift)[Cfg::kGroups],
                                               const int (&a_shift)[Cfg::kMTiles][2]) {
#pragma unroll
  for (int u = 0; u < Cfg::kUnroll; ++u)
#pragma unroll
    for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
      const uint4 a_top = piece<Cfg>(av[u][mt][0], a_shift[mt][0]);
      const uint4 a_bottom = piece<Cfg>(av[u][mt][1], a_shift[mt][1]);
#pragma unroll
      for (int j = 0; j < Cfg::kGroups; ++j) {
        // Elements 8t+0..3 as fragment k {2t, 2t+1, 2t+8, 2t+9}, then 8t+4..7 likewise.
        const uint4 bj = piece<Cfg>(bv[u][j], b_shift[j]);
        mma_16x8x16(acc[mt][j], a_top.x, a_bottom.x, a_top.y, a_bottom.y, bj.x, bj.y);
        mma_16x8x16(acc[mt][j], a_top.z, a_bottom.z, a_top.w, a_bottom.w, bj.z, bj.w);
      }
    }
}

// The 1 to 7 elements of a row at p (K's last, past its last whole group of 8), then zeros; a
// false `in` gives zeros. Element by element: 16 bytes from p could cross the operand's end.
__device__ __forceinline__ uint4 load_tail(const __nv_bfloat16* p, int count, bool in) {
  uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int e = 0; e < 7; ++e)
    if (in && e < count) w[e >> 1] |= static_cast<uint32_t>(__bfloat16_as_ushort(p[e])) << (16 * (e & 1));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// a: M x K, row stride lda; b: N x K, row stride ldb (elements; rows 16-byte aligned, so
// strides are multiples of 8, unless kAnyRows: any address, any stride; any K); d: M x N, contiguous.
template <class Cfg>
__device__ __forceinline__ void skinny_tn(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b,
                                          __nv_bfloat16* __restrict__ d, int m, int n, int k, int lda, int ldb) {
  constexpr int kJ = Cfg::kGroups, kMT = Cfg::kMTiles, kW = Cfg::kWarps, kU = Cfg::kUnroll;
  __shared__ float partial[kW][Cfg::kRows][Cfg::kCols];

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;  // the fragment's group: a row of A (and of A + 8), a row of B
  const int t = lane & 3;   // its 8 elements of each chunk start at k = 8t
  const int n_blocks = (n + Cfg::kCols - 1) / Cfg::kCols;
  const int n0 = static_cast<int>(blockIdx.x % n_blocks) * Cfg::kCols;
  const int m0 = static_cast<int>(blockIdx.x / n_blocks) * Cfg::kRows;

  // Rows past M or N are never stored; their loads are skipped (zeros) rather than clamped.
  // The tail below reads K's last elements one by one from these; the loop reads whole chunks
  // from `*_aligned` (the same pointers, unless kAnyRows: the aligned chunk at or below).
  const __nv_bfloat16* b_row[kJ];
  const __nv_bfloat16* b_aligned[kJ];
  bool b_in[kJ];
  int b_shift[kJ];
#pragma unroll
  for (int j = 0; j < kJ; ++j) {
    const int row = n0 + 8 * j + g;
    b_in[j] = row < n;
    b_row[j] = b + static_cast<int64_t>(b_in[j] ? row : 0) * ldb + 8 * t;
    b_shift[j] = Cfg::kAnyRows ? static_cast<int>(reinterpret_cast<uintptr_t>(b_row[j]) & 15) : 0;
    b_aligned[j] = b_row[j] - b_shift[j] / 2;
  }
  const __nv_bfloat16* a_row[kMT][2];
  const __nv_bfloat16* a_aligned[kMT][2];
  bool a_in[kMT][2];
  int a_shift[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = m0 + 16 * mt + 8 * h + g;
      a_in[mt][h] = row < m;
      a_row[mt][h] = a + static_cast<int64_t>(a_in[mt][h] ? row : 0) * lda + 8 * t;
      a_shift[mt][h] = Cfg::kAnyRows ? static_cast<int>(reinterpret_cast<uintptr_t>(a_row[mt][h]) & 15) : 0;
      a_aligned[mt][h] = a_row[mt][h] - a_shift[mt][h] / 2;
    }
  }

  float acc[kMT][kJ][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int j = 0; j < kJ; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][j][i] = 0.0f;

  // K off 8: its last 1..7 elements first, in the lanes whose group of 8 starts at k8, of the
  // warp the loop would give that chunk (a warp-uniform branch: the mma needs the whole warp).
  // Before the loop, so that none of this is live while the loop's batches are.
  const int k8 = k & ~7;
  const int tail_col = k8 & ~(Cfg::kChunk - 1);
  if (k8 < k && warp == (tail_col / Cfg::kChunk) % kW) {
    const bool mine = tail_col + 8 * t == k8;
    uint4 bt[1][kJ][1];
    uint4 at[1][kMT][2][1];
#pragma unroll
    for (int j = 0; j < kJ; ++j) bt[0][j][0] = load_tail(b_row[j] + tail_col, k - k8, mine && b_in[j]);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        at[0][mt][h][0] = load_tail(a_row[mt][h] + tail_col, k - k8, mine && a_in[mt][h]);
    multiply_batch<Config<kJ, kMT, kW, 1>>(acc, bt, at, b_shift, a_shift);  // element loads: in place
  }

  // Two batches in registers: the next is in flight while the mmas consume this one. The loop
  // covers K's whole groups of 8 (k8).
  constexpr int kStep = kW * kU * Cfg::kChunk;  // K a warp advances per batch
  constexpr int kP = Cfg::kParts;
  uint4 b0[kU][kJ][kP], b1[kU][kJ][kP];
  uint4 a0[kU][kMT][2][kP], a1[kU][kMT][2][kP];
  int first = warp * Cfg::kChunk;  // the warp's first K element of the batch in b0/a0
  load_batch<Cfg>(b0, a0, b_aligned, b_in, b_shift, a_aligned, a_in, a_shift, first, t, k8);
  for (;;) {
    load_batch<Cfg>(b1, a1, b_aligned, b_in, b_shift, a_aligned, a_in, a_shift, first + kStep, t, k8);
    multiply_batch<Cfg>(acc, b0, a0, b_shift, a_shift);
    if ((first += kStep) >= k8) break;
    load_batch<Cfg>(b0, a0, b_aligned, b_in, b_shift, a_aligned, a_in, a_shift, first + kStep, t, k8);
    multiply_batch<Cfg>(acc, b1, a1, b_shift, a_shift);
    if ((first += kStep) >= k8) break;
  }

  // The accumulator fragment: (row g, columns 2t, 2t+1) and (row g + 8, the same columns).
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      float* top = &partial[warp][16 * mt + g][8 * j + 2 * t];
      float* bottom = &partial[warp][16 * mt + g + 8][8 * j + 2 * t];
      top[0] = acc[mt][j][0];
      top[1] = acc[mt][j][1];
      bottom[0] = acc[mt][j][2];
      bottom[1] = acc[mt][j][3];
    }
  __syncthreads();

  const int rows = min(Cfg::kRows, m - m0);
  for (int i = threadIdx.x; i < rows * Cfg::kCols; i += Cfg::kThreads) {
    const int r = i / Cfg::kCols;
    const int c = i % Cfg::kCols;
    if (n0 + c >= n) continue;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kW; ++w) sum += partial[w][r][c];
    d[static_cast<int64_t>(m0 + r) * n + n0 + c] = __float2bfloat16_rn(sum);
  }
}

}  // namespace cubinstore::skinny
