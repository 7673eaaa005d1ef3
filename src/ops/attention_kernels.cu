// Causal GQA attention on BF16 tensor cores: FlashAttention-2 style forward and backward, and a
// simple FP32 KV-cache decode kernel. Launch interface in attention_kernels.h; contract in
// attention.h.
//
// Tensor-core path (mma.sync.m16n8k16 BF16 x BF16 -> FP32, operands fed by ldmatrix from
// shared-memory tiles whose rows are padded by 16 bytes, which makes every ldmatrix phase hit 8
// distinct 16-byte bank groups). A CTA is 4 warps; each warp owns kM m-blocks of 16 rows of the
// CTA's tile, so no cross-warp reduction is ever needed. Every kernel is one template over kM:
// kM = 1 (the CTA sizes below) or kM = 2 ("wide", D = 64 only, chosen per kernel by
// AttentionOptions::tiles: CTAs of 128 rows, each B fragment read from shared memory serves two
// m-blocks). Measured on the H100 (bench/notes-train.md, session 16): the wide forward is ~9%
// faster and the default for D = 64; the wide backward kernels were slower together.
//   forward     CTA = 64 queries of one (b, h). Q's fragments stay in registers (kM = 1); key/value tiles
//               of 64 rows stream through a 2-stage cp.async pipeline; S = Q K^T and the online
//               softmax (running max and sum, FP32, exp2 with log2(e) folded into the scale) stay
//               in registers; P is rounded to bf16 and reused directly as the A operand of P V
//               (the accumulator layout of two adjacent 8-column blocks is the A-fragment layout).
//               Only tiles on the causal diagonal are masked. The T x T scores never reach memory.
//   backward    three kernels, no atomics (deterministic):
//               1. delta: D_i = rowsum(dout * out) in FP32 into a [B, H, T] scratch;
//               2. dk/dv: CTA = 64 keys of one (b, kv head); it loops over the query heads of
//                  the group and the query tiles at or after its keys, recomputing
//                  S^T = K Q^T and dP^T = V dO^T, then P^T = exp(S^T - lse), dS^T = P^T (dP^T - D),
//                  dV += P^T dO, dK += dS^T Q, all in registers (query tile 64 rows for D = 64,
//                  32 for D = 128 to stay within 255 registers);
//               3. dq: CTA = 64 queries of one (b, h), looping over key tiles like the forward:
//                  recomputes S and dP, dQ += dS K.
//               The separate dq pass costs two extra small GEMMs per tile (Q K^T, dO V^T) against
//               FlashAttention-2's atomic dq, and buys bitwise reproducible gradients.
//               With AttentionRopeBackward, the dK and dQ stores rotate their rows back through
//               RoPE first (rope_backward_rows; the bits of a separate rope_backward pass).
// Heaviest CTAs first: for the causal mask, the last query tiles (forward, dq) and the first key
// tiles (dk/dv) do the most work, so they are given the lowest block indices.
//
// Hopper (sm_90a) variants of the forward, dK/dV and dQ kernels on warpgroup MMA (wgmma), chosen
// by AttentionOptions::wgmma_forward / wgmma_backward (the default where they can run): same
// tiling of the work, one warpgroup a CTA, each tile product one wgmma with operands in
// 128-byte-swizzled shared memory (see the section "backward on Hopper warpgroup MMA" and
// core/wgmma.cuh). The backward ones come pipelined (kOverlap, AttentionOptions::
// wgmma_overlap: each iteration's last product runs on into the next; the default), and all
// three with fast exponentials (kFastExp, AttentionOptions::wgmma_fast_exp: ex2.approx.ftz; opt-in).
//
// Decode: one CTA per (b, kv head, 16 query rows, cache split); FP32 scalar math on key/value tiles
// of 64 positions staged in shared memory, online softmax per row. With a workspace, launches of
// fewer than 6 CTAs per SM (small batches: Llama-1.1B at batch 1 has 4 kv heads, 4 CTAs) split the
// cache into up to 6 x SMs / groups ranges of whole tiles (flash-decoding); each CTA leaves its
// partial (acc, max, sum) in the scratch and the last to finish (atomic counter) merges them in
// split order, so the result does not depend on which CTA finished last.
#include "ops/attention_kernels.h"

#include "core/pdl.cuh"
#include "core/error.h"
#include "core/wgmma.cuh"
#include "core/rope_math.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace fourbit::ops::kernels {
namespace {

constexpr int kThreads = 128;  // 4 warps
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 64;      // query rows (forward, dq) or key rows (dk/dv) per CTA; key tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// --- PTX wrappers --------------------------------------------------------------------------------

using wgmma::smem_u32;

// 16 bytes global -> shared, asynchronously; zero-fills (reads nothing) when !valid.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c[16x8] += a[16x16] . b[16x8], BF16 inputs, FP32 accumulators.
// Fragment layouts (lane = 4 g + t): a = {(g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)},
// b = {(k 2t..2t+1, n g), (k 2t+8.., n g)}, c = {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)}.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats -> bf16x2 (round to nearest even), `lo` in the low half (the lower column index).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
// The four A-operand registers of k-step kc (reduction columns 16 kc ..) from FP32 accumulators in
// the C layout, rounded to bf16.
template <int NB>
__device__ __forceinline__ void pack_a(uint32_t (&a)[4], const float (&p)[NB][4], int kc) {
  a[0] = pack_bf16(p[2 * kc][0], p[2 * kc][1]);
  a[1] = pack_bf16(p[2 * kc][2], p[2 * kc][3]);
  a[2] = pack_bf16(p[2 * kc + 1][0], p[2 * kc + 1][1]);
  a[3] = pack_bf16(p[2 * kc + 1][2], p[2 * kc + 1][3]);
}

__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xFFFF0000u); }

// --- shared-memory tiles -------------------------------------------------------------------------

// A tile of kRows rows of D bf16, each row padded to D + 8 elements.
template <int D>
struct TileLayout {
  static constexpr int kStride = D + 8;  // elements
  template <int kRows>
  static constexpr int elems() { return kRows * kStride; }
};

// A tile is named by a uint16_t* (padded rows, TileLayout: the mma.sync kernels) or by a uint32_t
// shared address (the 128-byte-swizzled layout of the wgmma kernels, core/wgmma.cuh); the
// loaders below take either. tile_step: what to add to a tile's name for the next tile of kRows.
template <int D, int kRows, typename Tile>
constexpr int tile_step() {
  return std::is_same_v<Tile, uint32_t> ? kRows * D * 2 : TileLayout<D>::template elems<kRows>();
}

// Async-loads rows [row0, row0 + kRows) of one head's [T, D] sequence (row r at base + r * stride)
// into a padded tile; rows at or beyond n_rows are zero-filled.
template <int D, int kRows>
__device__ __forceinline__ void load_tile(uint16_t* tile, const uint16_t* base, int64_t stride,
                                          int row0, int n_rows, int tid) {
  constexpr int kChunksPerRow = D / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kChunks % kThreads == 0, "tile chunks must divide evenly over the CTA");
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int c = tid + i * kThreads;
    const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    const bool valid = row0 + r < n_rows;
    const uint16_t* src = valid ? base + (int64_t)(row0 + r) * stride + col : base;
    cp_async_16(smem_u32(tile + r * TileLayout<D>::kStride + col), src, valid);
  }
}

// The same into the swizzled tile at shared address `tile`.
template <int D, int kRows>
__device__ __forceinline__ void load_tile(uint32_t tile, const uint16_t* base, int64_t stride, int row0,
                                          int n_rows, int tid) {
  constexpr int kChunksPerRow = D / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kChunks % kThreads == 0, "tile chunks must divide evenly over the CTA");
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int c = tid + i * kThreads;
    const int r = c / kChunksPerRow, chunk = c % kChunksPerRow;
    const bool valid = row0 + r < n_rows;
    const uint16_t* src = valid ? base + (int64_t)(row0 + r) * stride + chunk * 8 : base;
    cp_async_16(tile + wgmma::swizzled_offset<kRows>(r, chunk), src, valid);
  }
}

// A fragment of the 16x16 block (rows m0.., cols k0..) of a row-major tile.
template <int D>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const uint16_t* tile, int m0, int k0,
                                       int lane) {
  const int r = m0 + (lane & 15), c = k0 + (lane >> 4) * 8;
  ldsm_x4(a, smem_u32(tile + r * TileLayout<D>::kStride + c));
}

// B fragments of two n-blocks (n0..n0+7 -> b[0], b[1]; n0+8..n0+15 -> b[2], b[3]) for the k-chunk
// k0..k0+15, from a tile stored n-major (row = n, k contiguous): K for Q K^T, Q for K Q^T, ...
template <int D>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const uint16_t* tile, int n0, int k0,
                                          int lane) {
  const int r = n0 + (lane & 7) + (lane >> 4) * 8, c = k0 + ((lane >> 3) & 1) * 8;
  ldsm_x4(b, smem_u32(tile + r * TileLayout<D>::kStride + c));
}

// The same fragments from a tile stored k-major (row = k, n contiguous): V for P V, dO for P^T dO,
// Q for dS^T Q, K for dS K.
template <int D>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const uint16_t* tile, int k0, int n0,
                                          int lane) {
  const int r = k0 + (lane & 7) + ((lane >> 3) & 1) * 8, c = n0 + (lane >> 4) * 8;
  ldsm_x4_trans(b, smem_u32(tile + r * TileLayout<D>::kStride + c));
}

// A warp owns kM m-blocks of 16 rows: kM = 1 in the "narrow" kernels, kM = 2 in the "wide" ones
// (D = 64, AttentionOptions::tiles). Every B fragment read from shared memory serves the warp's kM
// m-blocks, so kM = 2 halves the shared-memory traffic per mma (the kernels are bound by ldmatrix,
// bench/notes-train.md, session 15) for more registers and fewer CTAs an SM.
constexpr int kWideM = 2;
template <int kM>
constexpr int rows_per_cta() {  // queries (forward, dq) or keys (dk/dv) of a CTA: 64 or 128
  return kWarps * 16 * kM;
}

// acc[m][16 x 8 kNBlocks] += A (rows m0 + 16 m.., D; a row-major tile) . B^T, B an n-major tile
// (rows n).
template <int D, int kM, int kNBlocks>
__device__ __forceinline__ void gemm_a_tile_bt(float (&acc)[kM][kNBlocks][4], const uint16_t* a_tile,
                                               int m0, const uint16_t* b_tile, int lane) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[kM][4];
#pragma unroll
    for (int mi = 0; mi < kM; ++mi) load_a<D>(a[mi], a_tile, m0 + 16 * mi, kk * 16, lane);
#pragma unroll
    for (int nb = 0; nb < kNBlocks / 2; ++nb) {
      uint32_t b[4];
      load_b_nk<D>(b, b_tile, nb * 16, kk * 16, lane);
#pragma unroll
      for (int mi = 0; mi < kM; ++mi) {
        mma_bf16(acc[mi][2 * nb], a[mi], b[0], b[1]);
        mma_bf16(acc[mi][2 * nb + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

// acc[m][16 x D] += P[m] (16 x 16 kKBlocks, given as FP32 accumulators in C layout) . B, B a
// k-major tile (rows = the reduction index). P is rounded to bf16 here.
template <int D, int kM, int kKBlocks>
__device__ __forceinline__ void gemm_acc_b(float (&acc)[kM][D / 8][4], const float (&p)[kM][kKBlocks][4],
                                           const uint16_t* b_tile, int lane) {
#pragma unroll
  for (int kc = 0; kc < kKBlocks / 2; ++kc) {
    uint32_t a[kM][4];
#pragma unroll
    for (int mi = 0; mi < kM; ++mi) pack_a(a[mi], p[mi], kc);
#pragma unroll
    for (int nd = 0; nd < D / 16; ++nd) {
      uint32_t b[4];
      load_b_kn<D>(b, b_tile, kc * 16, nd * 16, lane);
#pragma unroll
      for (int mi = 0; mi < kM; ++mi) {
        mma_bf16(acc[mi][2 * nd], a[mi], b[0], b[1]);
        mma_bf16(acc[mi][2 * nd + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

// Writes a warp's 16 x D FP32 accumulator block (times `mul`) as bf16 to rows [row0, row0 + 16)
// of a strided sequence, staged through 16 tile rows `w` that no other warp reads any more, so
// that global stores are 16 bytes wide. Rows at or beyond n_rows are skipped.
template <int D>
__device__ __forceinline__ void store_rows(const float (&acc)[D / 8][4], float mul, uint16_t* w,
                                           int lane, uint16_t* base, int64_t stride, int row0,
                                           int n_rows) {
  constexpr int S = TileLayout<D>::kStride;
  const int g = lane >> 2, t = lane & 3;
  __syncwarp();
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd) {
    const int c = nd * 8 + 2 * t;
    *reinterpret_cast<uint32_t*>(w + g * S + c) = pack_bf16(acc[nd][0] * mul, acc[nd][1] * mul);
    *reinterpret_cast<uint32_t*>(w + (g + 8) * S + c) =
        pack_bf16(acc[nd][2] * mul, acc[nd][3] * mul);
  }
  __syncwarp();
  constexpr int kChunksPerRow = D / 8;
#pragma unroll
  for (int i = 0; i < 16 * kChunksPerRow / 32; ++i) {
    const int c = lane + i * 32;
    const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    if (row0 + r < n_rows) {
      *reinterpret_cast<uint4*>(base + (int64_t)(row0 + r) * stride + col) =
          *reinterpret_cast<const uint4*>(w + r * S + col);
    }
  }
}

// RoPE's backward rotation of a warp's 16 x D gradient block before store_rows (attention.h
// AttentionOptions::rope_backward): each value, times `mul`, is rounded to BF16 as store_rows would
// store it, then pair (i, i + D/2) of each row is rotated by -angle (core/rope_math.cuh) in FP32,
// exactly as rope_kernel does on the stored tensor; the caller then stores with mul = 1 (which
// rounds the rotated values to BF16, as rope_kernel's store). A thread holds columns c and c + D/2
// of its rows in n-blocks nd and nd + D/16, so the pairs never leave its registers. pos: the
// positions of this sequence's tokens, [n_rows].
template <int D>
__device__ __forceinline__ void rope_backward_rows(float (&acc)[D / 8][4], float mul,
                                                   const AttentionRopeBackward& rope,
                                                   const int32_t* pos, int row0, int n_rows,
                                                   int lane) {
  static_assert(D / 2 <= kAttentionRopeMaxPairs, "inv_freq holds D / 2 frequencies");
  const int g = lane >> 2, t = lane & 3;
  int32_t p[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) p[r] = row0 + g + 8 * r < n_rows ? pos[row0 + g + 8 * r] : 0;
#pragma unroll
  for (int nd = 0; nd < D / 16; ++nd)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float c, s;
      core::rope_cos_sin(p[e >> 1], rope.inv_freq[nd * 8 + 2 * t + (e & 1)], true, c, s);
      float lo = __bfloat162float(__float2bfloat16_rn(acc[nd][e] * mul));
      float hi = __bfloat162float(__float2bfloat16_rn(acc[nd + D / 16][e] * mul));
      core::rope_rotate(lo, hi, c, s);
      acc[nd][e] = lo;
      acc[nd + D / 16][e] = hi;
    }
}

// store_rows of a dK or dQ block (times `scale`), rotated back through RoPE first when kRope (a
// separate instantiation, so the plain kernels' code is as without RoPE). pos: the positions of
// the block's sequence, [n_rows].
template <int D, bool kRope>
__device__ __forceinline__ void store_grad_rows(float (&acc)[D / 8][4], float scale,
                                                const AttentionRopeBackward& rope, const int32_t* pos,
                                                uint16_t* w, int lane, uint16_t* base, int64_t stride,
                                                int row0, int n_rows) {
  if constexpr (kRope) {
    rope_backward_rows<D>(acc, scale, rope, pos, row0, n_rows, lane);
    scale = 1.0f;
  }
  store_rows<D>(acc, scale, w, lane, base, stride, row0, n_rows);
}

// --- pieces shared by the forward and backward kernels ------------------------------------------

// 2^x: exp2f, or with kFtz one MUFU.EX2 (ex2.approx.ftz, the instruction exp2f is built on, 2 ulp)
// without exp2f's scaling around it for subnormal results, which become 0 (a probability below
// 2^-126 adds nothing to a row sum that includes the row's maximum, 1). The wgmma kernels take
// it with kFastExp: in session 23's ncu profile of the dK/dV kernel (issue-bound) exp2f's extra
// instructions were most of the 148 non-fused FP32 instructions a warp issued per tile pair.
template <bool kFtz>
__device__ __forceinline__ float softmax_exp2(float x) {
  if constexpr (kFtz) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  } else {
    return exp2f(x);
  }
}

// Online-softmax step for one warp's 16-row block and a 64-key tile: rows g (r = 0) and g + 8
// (r = 1), a row's 64 scores in the 4 threads of a quad. s becomes P (unnormalized, FP32), o is
// rescaled; row_sum holds this thread's columns only (reduced in finish_softmax_rows). kFtz: the
// exponentials by softmax_exp2<true>.
template <int D, bool kFtz = false>
__device__ __forceinline__ void online_softmax_step(float (&s)[kTile / 8][4], float (&o)[D / 8][4],
                                                    float (&row_max)[2], float (&row_sum)[2],
                                                    float sl2) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = row_max[r];
#pragma unroll
    for (int nb = 0; nb < kTile / 8; ++nb) mx = fmaxf(mx, fmaxf(s[nb][2 * r], s[nb][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_scaled = mx == -INFINITY ? 0.0f : mx * sl2;
    const float alpha = softmax_exp2<kFtz>(row_max[r] * sl2 - m_scaled);
    row_max[r] = mx;
    float sum = 0.0f;
#pragma unroll
    for (int nb = 0; nb < kTile / 8; ++nb) {
      s[nb][2 * r] = softmax_exp2<kFtz>(fmaf(s[nb][2 * r], sl2, -m_scaled));
      s[nb][2 * r + 1] = softmax_exp2<kFtz>(fmaf(s[nb][2 * r + 1], sl2, -m_scaled));
      sum += s[nb][2 * r] + s[nb][2 * r + 1];
    }
    row_sum[r] = row_sum[r] * alpha + sum;
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) {
      o[nd][2 * r] *= alpha;
      o[nd][2 * r + 1] *= alpha;
    }
  }
}

// The end of the forward for one warp's 16-row block starting at query row0: lse of rows < T
// (lse_row: the [T] row of lse for this (b, h)), o divided by the row sums.
template <int D>
__device__ __forceinline__ void finish_softmax_rows(float (&o)[D / 8][4], const float (&row_max)[2],
                                                    const float (&row_sum)[2], float sl2, float* lse_row,
                                                    int row0, int T, int g, int t) {
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = row_sum[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv[r] = 1.0f / l;
    const int row = row0 + g + r * 8;
    if (t == 0 && row < T) lse_row[row] = (row_max[r] * sl2 + log2f(l)) * kLn2;
  }
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd) {
    o[nd][0] *= inv[0];
    o[nd][1] *= inv[0];
    o[nd][2] *= inv[1];
    o[nd][3] *= inv[1];
  }
}

// dK/dV kernels: asynchronously loads query rows [q0, q0 + kQ) of head h (Q and dO tiles, padded or
// swizzled; lse and D_i; rows at or beyond T zero-filled) and commits them as one cp.async group.
template <int D, int kQ, typename Tile>
__device__ __forceinline__ void load_query_tile(Tile q_dst, Tile do_dst, float* lse_dst, float* delta_dst,
                                                const AttentionBackwardArgs& a, const float* delta, int b,
                                                int h, int q0, int tid) {
  const int T = a.dims.seq, H = a.dims.heads;
  load_tile<D, kQ>(q_dst, a.q + b * a.q_stride.b + h * a.q_stride.h, a.q_stride.t, q0, T, tid);
  load_tile<D, kQ>(do_dst, a.dout + b * a.dout_stride.b + h * a.dout_stride.h, a.dout_stride.t, q0, T,
                   tid);
  if (tid < 2 * kQ) {
    const int r = tid % kQ;
    const bool valid = q0 + r < T;
    const int64_t off = ((int64_t)b * H + h) * T + (valid ? q0 + r : 0);
    if (tid < kQ) {
      cp_async_4(smem_u32(lse_dst + r), a.lse + off, valid);
    } else {
      cp_async_4(smem_u32(delta_dst + r), delta + off, valid);
    }
  }
  cp_async_commit();
}

// Async-loads key and value rows [row0, row0 + kTile) of one kv head into k_dst / v_dst (padded or
// swizzled) and commits them, with any earlier uncommitted loads, as one cp.async group.
template <int D, typename Tile>
__device__ __forceinline__ void load_kv_tiles(Tile k_dst, Tile v_dst, const uint16_t* k_base, const uint16_t* v_base,
                                              int64_t k_stride, int64_t v_stride, int row0, int T, int tid) {
  load_tile<D, kTile>(k_dst, k_base, k_stride, row0, T, tid);
  load_tile<D, kTile>(v_dst, v_base, v_stride, row0, T, tid);
  cp_async_commit();
}

// Forward and dQ kernels: the key/value tile pipeline. Before key tile j is used (buffer j & 1 of
// k_s / v_s, kTile rows each, padded or swizzled), tile j + 1 is issued into the other buffer,
// tile j is waited for (and, swizzled, made visible to wgmma's async proxy), and the CTA
// synchronizes.
template <int D, typename Tile>
__device__ __forceinline__ void advance_kv_tiles(Tile k_s, Tile v_s, const uint16_t* k_base,
                                                 const uint16_t* v_base, int64_t k_stride,
                                                 int64_t v_stride, int j, int n_tiles, int T, int tid) {
  constexpr int kStep = tile_step<D, kTile, Tile>();
  const int buf = j & 1;
  if (j + 1 < n_tiles) {
    load_kv_tiles<D>(k_s + (buf ^ 1) * kStep, v_s + (buf ^ 1) * kStep, k_base, v_base, k_stride, v_stride,
                     (j + 1) * kTile, T, tid);
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
  if constexpr (std::is_same_v<Tile, uint32_t>) wgmma::fence_proxy_async();
  __syncthreads();
}

// --- forward -------------------------------------------------------------------------------------

template <int D, int kM>
constexpr int forward_smem_bytes() {  // Q, 2 x K, 2 x V
  constexpr int kRows = rows_per_cta<kM>();
  return (TileLayout<D>::template elems<kRows>() + 4 * TileLayout<D>::template elems<kTile>()) * 2;
}

template <int D, int kM>
__global__ void __launch_bounds__(kThreads) attention_forward_kernel(const AttentionForwardArgs a) {
  constexpr int kRows = rows_per_cta<kM>();
  constexpr int kQElems = TileLayout<D>::template elems<kRows>();
  constexpr int S = TileLayout<D>::kStride;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint16_t* q_s = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* k_s = q_s + kQElems;                                    // [2][kTile][S]
  uint16_t* v_s = k_s + 2 * TileLayout<D>::template elems<kTile>();  // [2][kTile][S]

  const AttentionDims& d = a.dims;
  const int T = d.seq;
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (d.heads / d.kv_heads);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int m0 = m_block * kRows;
  const int warp_row0 = warp * 16 * kM;  // this warp's first row of the tile
  const int warp_q0 = m0 + warp_row0;

  const uint16_t* k_base = a.k + b * a.k_stride.b + hk * a.k_stride.h;
  const uint16_t* v_base = a.v + b * a.v_stride.b + hk * a.v_stride.h;
  load_tile<D, kRows>(q_s, a.q + b * a.q_stride.b + h * a.q_stride.h, a.q_stride.t, m0, T, tid);
  load_kv_tiles<D>(k_s, v_s, k_base, v_base, a.k_stride.t, a.v_stride.t, 0, T, tid);

  const float sl2 = d.scale * kLog2e;
  float o[kM][D / 8][4];
  float row_max[kM][2], row_sum[kM][2];
#pragma unroll
  for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[mi][i][0] = o[mi][i][1] = o[mi][i][2] = o[mi][i][3] = 0.0f;
    row_max[mi][0] = row_max[mi][1] = -INFINITY;
    row_sum[mi][0] = row_sum[mi][1] = 0.0f;  // partial: this thread's columns, reduced at the end
  }
  // kM = 1 keeps the warp's Q fragments in registers; kM = 2 re-reads them per key tile (the
  // registers are spent on the second m-block).
  uint32_t qf[kM == 1 ? D / 16 : 1][4];

  // Key tiles 0 .. the one holding key min(m0 + kRows, T) - 1.
  const int n_tiles = (min(m0 + kRows, T) - 1) / kTile + 1;
  for (int j = 0; j < n_tiles; ++j) {
    const int buf = j & 1;
    advance_kv_tiles<D>(k_s, v_s, k_base, v_base, a.k_stride.t, a.v_stride.t, j, n_tiles, T, tid);
    // Warp-uniform: every key of the tile follows every query of this warp: nothing to add.
    if (j * kTile <= warp_q0 + 16 * kM - 1) {
      const uint16_t* kt = k_s + buf * TileLayout<D>::template elems<kTile>();
      const uint16_t* vt = v_s + buf * TileLayout<D>::template elems<kTile>();
      // S = Q K^T for this warp's rows and the tile's 64 keys.
      float sc[kM][kTile / 8][4];
#pragma unroll
      for (int mi = 0; mi < kM; ++mi)
#pragma unroll
        for (int i = 0; i < kTile / 8; ++i) sc[mi][i][0] = sc[mi][i][1] = sc[mi][i][2] = sc[mi][i][3] = 0.0f;
      if constexpr (kM == 1) {
        if (j == 0) {
#pragma unroll
          for (int kk = 0; kk < D / 16; ++kk) load_a<D>(qf[kk], q_s, warp_row0, kk * 16, lane);
        }
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
          for (int nb = 0; nb < kTile / 16; ++nb) {
            uint32_t bf[4];
            load_b_nk<D>(bf, kt, nb * 16, kk * 16, lane);
            mma_bf16(sc[0][2 * nb], qf[kk], bf[0], bf[1]);
            mma_bf16(sc[0][2 * nb + 1], qf[kk], bf[2], bf[3]);
          }
        }
      } else {
        gemm_a_tile_bt<D, kM, kTile / 8>(sc, q_s, warp_row0, kt, lane);
      }
      if (j * kTile + kTile - 1 > warp_q0) {  // a tile on the diagonal: key > query is masked
#pragma unroll
        for (int mi = 0; mi < kM; ++mi)
#pragma unroll
          for (int nb = 0; nb < kTile / 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int qi = warp_q0 + mi * 16 + g + (e >> 1) * 8;
              const int key = j * kTile + nb * 8 + 2 * t + (e & 1);
              if (key > qi) sc[mi][nb][e] = -INFINITY;
            }
      }
#pragma unroll
      for (int mi = 0; mi < kM; ++mi) online_softmax_step<D>(sc[mi], o[mi], row_max[mi], row_sum[mi], sl2);
      gemm_acc_b<D, kM, kTile / 8>(o, sc, vt, lane);  // O += P V
    }
    __syncthreads();  // before this buffer is refilled
  }

#pragma unroll
  for (int mi = 0; mi < kM; ++mi) {
    finish_softmax_rows<D>(o[mi], row_max[mi], row_sum[mi], sl2, a.lse + ((int64_t)b * d.heads + h) * T,
                           warp_q0 + mi * 16, T, g, t);
    // Q's rows of this warp were only read by this warp: its stage.
    const int row_l = warp_row0 + mi * 16;
    store_rows<D>(o[mi], 1.0f, q_s + row_l * S, lane, a.out + b * a.out_stride.b + h * a.out_stride.h,
                  a.out_stride.t, m0 + row_l, T);
  }
}

// --- backward: D_i = rowsum(dout * out) ---------------------------------------------------------

// D / 8 threads a row, 8 elements (two 16-byte loads: out and dout) each, summed across the
// row's threads by shuffles in a fixed order. Rows in delta's (b, h, t) order, so that the threads
// writing a warp's rows write adjacent floats. (One warp a row, 4 bytes a lane, ran at ~1 TB/s.)
template <int D>
__global__ void __launch_bounds__(kThreads) attention_delta_kernel(const AttentionBackwardArgs a,
                                                                   float* delta) {
  constexpr int kRowThreads = D / 8;  // 8 (D 64) or 16 (D 128): a power of two dividing 32
  const AttentionDims& d = a.dims;
  const int64_t n_rows = (int64_t)d.batch * d.heads * d.seq;
  const int64_t row = ((int64_t)blockIdx.x * kThreads + threadIdx.x) / kRowThreads;
  const int part = (int)(threadIdx.x % kRowThreads);
  float sum = 0.0f;
  if (row < n_rows) {
    const int t = (int)(row % d.seq);
    const int64_t bh = row / d.seq;
    const int h = (int)(bh % d.heads), b = (int)(bh / d.heads);
    const uint4 ov = *reinterpret_cast<const uint4*>(a.out + b * a.out_stride.b + t * a.out_stride.t +
                                                     h * a.out_stride.h + part * 8);
    const uint4 gv = *reinterpret_cast<const uint4*>(a.dout + b * a.dout_stride.b + t * a.dout_stride.t +
                                                     h * a.dout_stride.h + part * 8);
    const uint32_t o[4] = {ov.x, ov.y, ov.z, ov.w}, g[4] = {gv.x, gv.y, gv.z, gv.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      sum = fmaf(bf16_lo(o[k]), bf16_lo(g[k]), sum);
      sum = fmaf(bf16_hi(o[k]), bf16_hi(g[k]), sum);
    }
  }
#pragma unroll
  for (int off = kRowThreads / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (row < n_rows && part == 0) delta[row] = sum;
}

// --- backward: dK, dV ----------------------------------------------------------------------------

// Query rows per inner tile of the dk/dv kernel: 64 for the narrow kernel at D = 64; 32 for
// D = 128 (dK and dV, 64 + 64 FP32 registers a thread, plus S^T and dP^T within the register
// file) and for the wide one (two m-blocks of S^T and dP^T).
template <int D, int kM>
constexpr int dkdv_query_tile() {
  return D == 128 || kM == 2 ? 32 : 64;
}

template <int D, int kM>
constexpr int dkdv_smem_bytes() {
  constexpr int kQ = dkdv_query_tile<D, kM>();
  constexpr int kKeys = rows_per_cta<kM>();
  return (2 * TileLayout<D>::template elems<kKeys>() + 4 * TileLayout<D>::template elems<kQ>()) * 2 +
         4 * kQ * 4;  // K, V, 2 x (Q, dO) tiles; 2 x (lse, D_i)
}

template <int D, int kM, bool kRope>
__global__ void __launch_bounds__(kThreads) attention_dkdv_kernel(const AttentionBackwardArgs a,
                                                                  const float* delta) {
  constexpr int kKeys = rows_per_cta<kM>();
  constexpr int kQ = dkdv_query_tile<D, kM>();
  constexpr int kKvElems = TileLayout<D>::template elems<kKeys>();
  constexpr int kQElems = TileLayout<D>::template elems<kQ>();
  constexpr int S = TileLayout<D>::kStride;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint16_t* k_s = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* v_s = k_s + kKvElems;
  uint16_t* q_s = v_s + kKvElems;      // [2][kQ][S]
  uint16_t* do_s = q_s + 2 * kQElems;  // [2][kQ][S]
  float* lse_s = reinterpret_cast<float*>(do_s + 2 * kQElems);  // [2][kQ]
  float* delta_s = lse_s + 2 * kQ;                               // [2][kQ]

  const AttentionDims& d = a.dims;
  const int T = d.seq;
  const int group = d.heads / d.kv_heads;
  const int n_block = blockIdx.x;  // the first key blocks see the most queries: launched first
  const int hk = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = n_block * kKeys;
  const int warp_row0 = warp * 16 * kM;
  const int warp_key0 = n0 + warp_row0;

  load_tile<D, kKeys>(k_s, a.k + b * a.k_stride.b + hk * a.k_stride.h, a.k_stride.t, n0, T, tid);
  load_tile<D, kKeys>(v_s, a.v + b * a.v_stride.b + hk * a.v_stride.h, a.v_stride.t, n0, T, tid);
  cp_async_commit();

  const int i_begin = n0 / kQ;              // earlier query tiles lie entirely before the keys
  const int n_qtiles = (T + kQ - 1) / kQ;
  const int per_head = n_qtiles - i_begin;  // >= 1 because n0 < T
  const int total = group * per_head;
  auto issue = [&](int it, int buf) {
    load_query_tile<D, kQ>(q_s + buf * kQElems, do_s + buf * kQElems, lse_s + buf * kQ,
                           delta_s + buf * kQ, a, delta, b, hk * group + it / per_head,
                           (i_begin + it % per_head) * kQ, tid);
  };
  issue(0, 0);

  const float sl2 = d.scale * kLog2e;
  float dk[kM][D / 8][4], dv[kM][D / 8][4];
#pragma unroll
  for (int mi = 0; mi < kM; ++mi)
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[mi][i][e] = dv[mi][i][e] = 0.0f;

  for (int it = 0; it < total; ++it) {
    const int buf = it & 1;
    if (it + 1 < total) {
      issue(it + 1, buf ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int q0 = (i_begin + it % per_head) * kQ;
    // Warp-uniform: every query of the tile precedes this warp's keys (P = 0): nothing to add.
    if (q0 + kQ - 1 >= warp_key0) {
      const uint16_t* qt = q_s + buf * kQElems;
      const uint16_t* dot = do_s + buf * kQElems;
      const float* lse_t = lse_s + buf * kQ;
      const float* delta_t = delta_s + buf * kQ;

      // S^T = K Q^T and dP^T = V dO^T for this warp's keys and the tile's kQ queries.
      float st[kM][kQ / 8][4], dpt[kM][kQ / 8][4];
#pragma unroll
      for (int mi = 0; mi < kM; ++mi)
#pragma unroll
        for (int i = 0; i < kQ / 8; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) st[mi][i][e] = dpt[mi][i][e] = 0.0f;
      gemm_a_tile_bt<D, kM, kQ / 8>(st, k_s, warp_row0, qt, lane);
      gemm_a_tile_bt<D, kM, kQ / 8>(dpt, v_s, warp_row0, dot, lane);

      // P^T = exp(S^T - lse) where query >= key and query < T, else 0; dS^T = P^T (dP^T - D).
#pragma unroll
      for (int mi = 0; mi < kM; ++mi)
#pragma unroll
        for (int nb = 0; nb < kQ / 8; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = warp_key0 + mi * 16 + g + (e >> 1) * 8;
            const int ql = nb * 8 + 2 * t + (e & 1);
            const int qi = q0 + ql;
            const bool valid = qi >= key && qi < T;
            const float p = valid ? exp2f(fmaf(st[mi][nb][e], sl2, -lse_t[ql] * kLog2e)) : 0.0f;
            st[mi][nb][e] = p;
            dpt[mi][nb][e] = p * (dpt[mi][nb][e] - delta_t[ql]);
          }
      gemm_acc_b<D, kM, kQ / 8>(dv, st, dot, lane);  // dV += P^T dO
      gemm_acc_b<D, kM, kQ / 8>(dk, dpt, qt, lane);  // dK += dS^T Q
    }
    __syncthreads();  // before this buffer is refilled
  }

  // All reads of K and V are done (the loop ended on a barrier): a warp's own rows are its stage.
#pragma unroll
  for (int mi = 0; mi < kM; ++mi) {
    const int row_l = warp_row0 + mi * 16;
    store_grad_rows<D, kRope>(dk[mi], d.scale, a.rope, a.rope.positions + (int64_t)b * T, k_s + row_l * S,
                              lane, a.dk + b * a.dk_stride.b + hk * a.dk_stride.h, a.dk_stride.t, n0 + row_l, T);
    store_rows<D>(dv[mi], 1.0f, v_s + row_l * S, lane, a.dv + b * a.dv_stride.b + hk * a.dv_stride.h,
                  a.dv_stride.t, n0 + row_l, T);
  }
}

// --- backward: dQ --------------------------------------------------------------------------------

template <int D, int kM>
constexpr int dq_smem_bytes() {  // Q, dO, 2 x K, 2 x V
  constexpr int kRows = rows_per_cta<kM>();
  return (2 * TileLayout<D>::template elems<kRows>() + 4 * TileLayout<D>::template elems<kTile>()) * 2;
}

template <int D, int kM, bool kRope>
__global__ void __launch_bounds__(kThreads) attention_dq_kernel(const AttentionBackwardArgs a,
                                                                const float* delta) {
  constexpr int kRows = rows_per_cta<kM>();
  constexpr int kQElems = TileLayout<D>::template elems<kRows>();
  constexpr int kKElems = TileLayout<D>::template elems<kTile>();
  constexpr int S = TileLayout<D>::kStride;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint16_t* q_s = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* do_s = q_s + kQElems;
  uint16_t* k_s = do_s + kQElems;     // [2][kTile][S]
  uint16_t* v_s = k_s + 2 * kKElems;  // [2][kTile][S]

  const AttentionDims& d = a.dims;
  const int T = d.seq;
  const int m_block = gridDim.x - 1 - blockIdx.x;  // the last queries see the most keys: first
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (d.heads / d.kv_heads);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int m0 = m_block * kRows;
  const int warp_row0 = warp * 16 * kM;
  const int warp_q0 = m0 + warp_row0;

  const uint16_t* k_base = a.k + b * a.k_stride.b + hk * a.k_stride.h;
  const uint16_t* v_base = a.v + b * a.v_stride.b + hk * a.v_stride.h;
  load_tile<D, kRows>(q_s, a.q + b * a.q_stride.b + h * a.q_stride.h, a.q_stride.t, m0, T, tid);
  load_tile<D, kRows>(do_s, a.dout + b * a.dout_stride.b + h * a.dout_stride.h, a.dout_stride.t, m0, T,
                      tid);
  load_kv_tiles<D>(k_s, v_s, k_base, v_base, a.k_stride.t, a.v_stride.t, 0, T, tid);

  // This thread's rows (g and g + 8 of each of its warp's m-blocks): lse (times log2 e) and D_i.
  float lse2[kM][2], dlt[kM][2];
#pragma unroll
  for (int mi = 0; mi < kM; ++mi)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp_q0 + mi * 16 + g + r * 8;
      const int64_t off = ((int64_t)b * d.heads + h) * T + row;
      lse2[mi][r] = row < T ? a.lse[off] * kLog2e : 0.0f;
      dlt[mi][r] = row < T ? delta[off] : 0.0f;
    }

  const float sl2 = d.scale * kLog2e;
  float dq[kM][D / 8][4];
#pragma unroll
  for (int mi = 0; mi < kM; ++mi)
#pragma unroll
    for (int i = 0; i < D / 8; ++i) dq[mi][i][0] = dq[mi][i][1] = dq[mi][i][2] = dq[mi][i][3] = 0.0f;

  // Key tiles 0 .. the one holding key min(m0 + kRows, T) - 1.
  const int n_tiles = (min(m0 + kRows, T) - 1) / kTile + 1;
  for (int j = 0; j < n_tiles; ++j) {
    const int buf = j & 1;
    advance_kv_tiles<D>(k_s, v_s, k_base, v_base, a.k_stride.t, a.v_stride.t, j, n_tiles, T, tid);
    // Warp-uniform: the tile's first key follows every query of this warp (P = 0): skip.
    if (j * kTile <= warp_q0 + 16 * kM - 1) {
      const uint16_t* kt = k_s + buf * kKElems;
      const uint16_t* vt = v_s + buf * kKElems;
      float sc[kM][kTile / 8][4], dp[kM][kTile / 8][4];
#pragma unroll
      for (int mi = 0; mi < kM; ++mi)
#pragma unroll
        for (int i = 0; i < kTile / 8; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) sc[mi][i][e] = dp[mi][i][e] = 0.0f;
      gemm_a_tile_bt<D, kM, kTile / 8>(sc, q_s, warp_row0, kt, lane);   // S = Q K^T
      gemm_a_tile_bt<D, kM, kTile / 8>(dp, do_s, warp_row0, vt, lane);  // dP = dO V^T
#pragma unroll
      for (int mi = 0; mi < kM; ++mi)
#pragma unroll
        for (int nb = 0; nb < kTile / 8; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int qi = warp_q0 + mi * 16 + g + (e >> 1) * 8;
            const int key = j * kTile + nb * 8 + 2 * t + (e & 1);
            const bool valid = key <= qi && qi < T;
            const float p = valid ? exp2f(fmaf(sc[mi][nb][e], sl2, -lse2[mi][e >> 1])) : 0.0f;
            dp[mi][nb][e] = p * (dp[mi][nb][e] - dlt[mi][e >> 1]);  // dS
          }
      gemm_acc_b<D, kM, kTile / 8>(dq, dp, kt, lane);  // dQ += dS K
    }
    __syncthreads();
  }

  // Q's rows of this warp were only read by this warp: its stage.
#pragma unroll
  for (int mi = 0; mi < kM; ++mi) {
    const int row_l = warp_row0 + mi * 16;
    store_grad_rows<D, kRope>(dq[mi], d.scale, a.rope, a.rope.positions + (int64_t)b * T, q_s + row_l * S,
                              lane, a.dq + b * a.dq_stride.b + h * a.dq_stride.h, a.dq_stride.t, m0 + row_l, T);
  }
}

// --- backward on Hopper warpgroup MMA (wgmma, sm_90a) ---------------------------------------------
//
// The same dK/dV and dQ passes (after the same delta kernel; no atomics, deterministic) with a CTA
// of one warpgroup (the 4 warps) and each tile product one asynchronous wgmma over the whole CTA
// tile, its operands read from 128-byte-swizzled shared-memory tiles (core/wgmma.cuh). The
// mma.sync kernels above read every B fragment once per warp: 4x the shared-memory traffic per
// product, which bounds them (bench/notes-train.md, session 15). Here a product reads its
// operands once per warpgroup, and P^T / dS^T (dS for dQ) go from accumulators to register A
// operands as before. Within an iteration the products overlap the softmax: S^T and dP^T are two
// commit groups, P^T is computed while dP^T runs, and dV += P^T dO runs while dS^T is computed.
//   dK/dV: 64 keys a CTA; query tiles of 64 (D = 64) or 32 (D = 128: dK and dV take 128
//          accumulator registers a thread) in a 2-stage cp.async pipeline, K and V A operands
//          from shared memory.
//   dQ:    64 queries a CTA; key/value tiles of 64 in a 2-stage pipeline, Q and dO A operands from
//          shared memory.
// Masking happens only on tiles that cross the diagonal or the end of the sequence. Rows at or
// beyond T are zero-filled: their products are finite and never stored or used unmasked.
// The FP32 accumulation order inside a wgmma is the hardware's, so the bits differ from the
// mma.sync kernels' (same tolerances; still the same bits run to run).

constexpr int kSmemAlign = 1024;  // swizzled tiles start on 1024-byte boundaries

template <int D>
constexpr int wg_dkdv_query_tile() {
  return D == 64 ? 64 : 32;
}

template <int D>
constexpr int wg_dkdv_smem_bytes() {  // K, V, 2 x (Q, dO), 2 x (lse, D_i) + alignment slack
  constexpr int kQ = wg_dkdv_query_tile<D>();
  return kSmemAlign + 2 * kTile * D * 2 + 4 * kQ * D * 2 + 4 * kQ * 4;
}

template <int D>
constexpr int wg_dq_smem_bytes() {  // Q, dO, 2 x K, 2 x V + alignment slack
  return kSmemAlign + 6 * kTile * D * 2;
}

// The first kSmemAlign-aligned byte of the dynamic shared memory (allocated kSmemAlign bytes larger).
__device__ __forceinline__ unsigned char* aligned_smem(unsigned char* raw) {
  const uint32_t a = smem_u32(raw);
  return raw + (((a + kSmemAlign - 1) & ~uint32_t(kSmemAlign - 1)) - a);
}

// acc[64 x N] (=) A B^T over the D reduction columns: A and B swizzled [kRowsA, D] / [N, D] tiles,
// both read K-major; the first k-step overwrites acc. Issues the wgmmas only (no fence or commit).
template <int D, int N, int kRowsA>
__device__ __forceinline__ void issue_tile_ss(float (&acc)[N / 8][4], uint32_t a_tile, uint32_t b_tile) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wgmma::mma_ss<N>(acc, wgmma::k_major<kRowsA>(a_tile, kk), wgmma::k_major<N>(b_tile, kk), kk > 0);
}

// acc[64 x 8 NB] += P B as one commit group: P's FP32 accumulators (C layout, 16 KC columns) are
// rounded into the register A operands a (which must stay untouched until the group's wait), B is
// a swizzled [16 KC, 8 NB] tile read MN-major. The fence also covers acc's own updates by ordinary
// instructions (the forward's rescaling).
template <int NB, int KC>
__device__ __forceinline__ void issue_regs_group(float (&acc)[NB][4], uint32_t (&a)[KC][4], const float (&p)[2 * KC][4],
                                                 uint32_t b_tile) {
#pragma unroll
  for (int kc = 0; kc < KC; ++kc) pack_a(a[kc], p, kc);
  wgmma::wgmma_fence();
#pragma unroll
  for (int kc = 0; kc < KC; ++kc) wgmma::mma_rs<8 * NB>(acc, a[kc], wgmma::mn_major<16 * KC>(b_tile, kc));
  wgmma::wgmma_commit();
}

// Waits for every product in flight, pins the registers they wrote or read, then the CTA barrier:
// after it, the shared-memory tiles those products read may be refilled or reused.
template <typename... R>
__device__ __forceinline__ void finish_products(R&... r) {
  wgmma::wgmma_wait<0>();
  wgmma::registers_fence(r...);
  __syncthreads();
}

// kOverlap: dK += dS^T Q of iteration it runs on while iteration it + 1 starts (S^T and dP^T are
// issued behind it); query tile it + 1 is loaded only once that product has read buffer it - 1, so
// its load overlaps half an iteration instead of a whole one. The same products in the same order
// on every accumulator: the same bits.
// kFastExp: the exponentials by softmax_exp2<true> (ex2.approx.ftz).
template <int D, bool kRope, bool kOverlap, bool kFastExp>
__global__ void __launch_bounds__(kThreads) attention_dkdv_wgmma_kernel(const AttentionBackwardArgs a,
                                                                        const float* delta) {
  constexpr int kKeys = kTile;
  constexpr int kQ = wg_dkdv_query_tile<D>();
  constexpr uint32_t kKvBytes = kKeys * D * 2, kQBytes = kQ * D * 2;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* base_ptr = aligned_smem(smem_raw);
  const uint32_t base = smem_u32(base_ptr);
  const uint32_t k_s = base, v_s = base + kKvBytes;
  const uint32_t q_s = v_s + kKvBytes;        // [2] swizzled [kQ, D]
  const uint32_t do_s = q_s + 2 * kQBytes;    // [2] swizzled [kQ, D]
  float* lse_s = reinterpret_cast<float*>(base_ptr + 2 * kKvBytes + 4 * kQBytes);  // [2][kQ]
  float* delta_s = lse_s + 2 * kQ;                                                  // [2][kQ]

  const AttentionDims& d = a.dims;
  const int T = d.seq;
  const int group = d.heads / d.kv_heads;
  const int n_block = blockIdx.x;  // the first key blocks see the most queries: launched first
  const int hk = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = n_block * kKeys;
  const int key_lo = n0 + warp * 16 + g;  // this thread's key rows: key_lo and key_lo + 8

  load_tile<D, kKeys>(k_s, a.k + b * a.k_stride.b + hk * a.k_stride.h, a.k_stride.t, n0, T, tid);
  load_tile<D, kKeys>(v_s, a.v + b * a.v_stride.b + hk * a.v_stride.h, a.v_stride.t, n0, T, tid);
  cp_async_commit();

  const int i_begin = n0 / kQ;              // earlier query tiles lie entirely before the keys
  const int n_qtiles = (T + kQ - 1) / kQ;
  const int per_head = n_qtiles - i_begin;  // >= 1 because n0 < T
  const int total = group * per_head;
  auto issue = [&](int it, int buf) {
    load_query_tile<D, kQ>(q_s + buf * kQBytes, do_s + buf * kQBytes, lse_s + buf * kQ, delta_s + buf * kQ, a,
                           delta, b, hk * group + it / per_head, (i_begin + it % per_head) * kQ, tid);
  };
  issue(0, 0);

  const float sl2 = d.scale * kLog2e;
  float dk[D / 8][4], dv[D / 8][4], st[kQ / 8][4], dpt[kQ / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.0f;
#pragma unroll
  for (int i = 0; i < kQ / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) st[i][e] = dpt[i][e] = 0.0f;
  uint32_t pa[kQ / 16][4], dsa[kQ / 16][4];

  // A do-while: the loop runs at least once (total >= 1), and the compiler sees it (a path that
  // skips the loop would join the wgmmas still in flight after it, which serializes them).
  int it = 0;
  do {
    const int buf = it & 1;
    if constexpr (kOverlap) {
      cp_async_wait<0>();
    } else if (it + 1 < total) {
      issue(it + 1, buf ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    wgmma::fence_proxy_async();
    __syncthreads();
    const int q0 = (i_begin + it % per_head) * kQ;
    const uint32_t qt = q_s + buf * kQBytes, dot = do_s + buf * kQBytes;
    const float* lse_t = lse_s + buf * kQ;
    const float* delta_t = delta_s + buf * kQ;

    // S^T = K Q^T, then dP^T = V dO^T: two groups.
    wgmma::wgmma_fence();
    issue_tile_ss<D, kQ, kKeys>(st, k_s, qt);
    wgmma::wgmma_commit();
    issue_tile_ss<D, kQ, kKeys>(dpt, v_s, dot);
    wgmma::wgmma_commit();

    // P^T = exp(S^T - lse) where query >= key and query < T, else 0 (while dP^T runs).
    const bool edge = q0 < n0 + kKeys || q0 + kQ > T;
    wgmma::wgmma_wait<1>();
    wgmma::registers_fence(st);
    if constexpr (kOverlap) {
      // The previous iteration's dV and dK products are done too (groups complete in order).
      wgmma::registers_fence(dv, dk, pa, dsa);
      __syncthreads();  // every warp is past them: buffer buf ^ 1 may be refilled
      if (it + 1 < total) issue(it + 1, buf ^ 1);
    }
#pragma unroll
    for (int nb = 0; nb < kQ / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int ql = nb * 8 + 2 * t + (e & 1);
        float p = softmax_exp2<kFastExp>(fmaf(st[nb][e], sl2, -lse_t[ql] * kLog2e));
        if (edge) {
          const int qi = q0 + ql, key = key_lo + (e >> 1) * 8;
          if (!(qi >= key && qi < T)) p = 0.0f;
        }
        st[nb][e] = p;
      }
    issue_regs_group(dv, pa, st, dot);  // dV += P^T dO (while dS^T is computed)

    // dS^T = P^T (dP^T - D).
    wgmma::wgmma_wait<1>();
    wgmma::registers_fence(dpt);
#pragma unroll
    for (int nb = 0; nb < kQ / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) dpt[nb][e] = st[nb][e] * (dpt[nb][e] - delta_t[nb * 8 + 2 * t + (e & 1)]);
    issue_regs_group(dk, dsa, dpt, qt);  // dK += dS^T Q
    if constexpr (!kOverlap) finish_products(dv, dk, pa, dsa);  // before this buffer is refilled
  } while (++it < total);
  if constexpr (kOverlap) finish_products(dv, dk, pa, dsa);  // the buffers may become the stage

  // Every product is done and the loop ended on a barrier: the query buffers are the stage, 16
  // padded rows a warp.
  constexpr int S = TileLayout<D>::kStride;
  static_assert(kThreads / 32 * 16 * S * 2 <= 4 * (int)kQBytes, "the stage fits the query buffers");
  uint16_t* stage = reinterpret_cast<uint16_t*>(base_ptr + 2 * kKvBytes) + warp * 16 * S;
  const int row0 = n0 + warp * 16;
  store_grad_rows<D, kRope>(dk, d.scale, a.rope, a.rope.positions + (int64_t)b * T, stage, lane,
                            a.dk + b * a.dk_stride.b + hk * a.dk_stride.h, a.dk_stride.t, row0, T);
  store_rows<D>(dv, 1.0f, stage, lane, a.dv + b * a.dv_stride.b + hk * a.dv_stride.h, a.dv_stride.t, row0, T);
}

// kOverlap: dQ += dS K of tile j runs on while tile j + 1's S and dP are issued behind it; tile
// j + 1 is loaded once that product has read buffer j - 1 (after the first wait of iteration j).
// The same products in the same order on dq: the same bits.
// kFastExp: as in the dK/dV kernel.
template <int D, bool kRope, bool kOverlap, bool kFastExp>
__global__ void __launch_bounds__(kThreads) attention_dq_wgmma_kernel(const AttentionBackwardArgs a,
                                                                      const float* delta) {
  constexpr int kRows = kTile;   // queries of the CTA
  constexpr int kKeys = kTile;   // keys of a tile
  constexpr uint32_t kRowBytes = kRows * D * 2, kTileBytes = kKeys * D * 2;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* base_ptr = aligned_smem(smem_raw);
  const uint32_t base = smem_u32(base_ptr);
  const uint32_t q_s = base, do_s = base + kRowBytes;
  const uint32_t k_s = do_s + kRowBytes;      // [2] swizzled [kKeys, D]
  const uint32_t v_s = k_s + 2 * kTileBytes;  // [2] swizzled [kKeys, D]

  const AttentionDims& d = a.dims;
  const int T = d.seq;
  const int m_block = gridDim.x - 1 - blockIdx.x;  // the last queries see the most keys: first
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (d.heads / d.kv_heads);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int m0 = m_block * kRows;
  const int q_lo = m0 + warp * 16 + g;  // this thread's query rows: q_lo and q_lo + 8

  const uint16_t* k_base = a.k + b * a.k_stride.b + hk * a.k_stride.h;
  const uint16_t* v_base = a.v + b * a.v_stride.b + hk * a.v_stride.h;
  load_tile<D, kRows>(q_s, a.q + b * a.q_stride.b + h * a.q_stride.h, a.q_stride.t, m0, T, tid);
  load_tile<D, kRows>(do_s, a.dout + b * a.dout_stride.b + h * a.dout_stride.h, a.dout_stride.t,
                               m0, T, tid);
  load_kv_tiles<D>(k_s, v_s, k_base, v_base, a.k_stride.t, a.v_stride.t, 0, T, tid);

  float lse2[2], dlt[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = q_lo + r * 8;
    const int64_t off = ((int64_t)b * d.heads + h) * T + row;
    lse2[r] = row < T ? a.lse[off] * kLog2e : 0.0f;
    dlt[r] = row < T ? delta[off] : 0.0f;
  }

  const float sl2 = d.scale * kLog2e;
  float dq[D / 8][4], s[kKeys / 8][4], dp[kKeys / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.0f;
#pragma unroll
  for (int i = 0; i < kKeys / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[i][e] = dp[i][e] = 0.0f;
  uint32_t dsa[kKeys / 16][4];

  // Key tiles 0 .. the one holding key min(m0 + kRows, T) - 1.
  const int n_tiles = (min(m0 + kRows, T) - 1) / kKeys + 1;
  int j = 0;
  do {  // at least once (n_tiles >= 1): a do-while, as in the dK/dV kernel
    const int buf = j & 1;
    if constexpr (kOverlap) {
      cp_async_wait<0>();
      wgmma::fence_proxy_async();
      __syncthreads();
    } else {
      advance_kv_tiles<D>(k_s, v_s, k_base, v_base, a.k_stride.t, a.v_stride.t, j, n_tiles, T, tid);
    }
    const uint32_t kt = k_s + buf * kTileBytes, vt = v_s + buf * kTileBytes;

    // S = Q K^T, then dP = dO V^T: two groups.
    wgmma::wgmma_fence();
    issue_tile_ss<D, kKeys, kRows>(s, q_s, kt);
    wgmma::wgmma_commit();
    issue_tile_ss<D, kKeys, kRows>(dp, do_s, vt);
    wgmma::wgmma_commit();

    // P = exp(S - lse) where key <= query < T, else 0 (while dP runs).
    const bool edge = j * kKeys + kKeys - 1 > m0 || m0 + kRows > T;
    wgmma::wgmma_wait<1>();
    wgmma::registers_fence(s);
    if constexpr (kOverlap) {
      // The previous tile's dQ product is done too (groups complete in order).
      wgmma::registers_fence(dq, dsa);
      __syncthreads();  // every warp is past it: buffer buf ^ 1 may be refilled
      if (j + 1 < n_tiles)
        load_kv_tiles<D>(k_s + (buf ^ 1) * kTileBytes, v_s + (buf ^ 1) * kTileBytes, k_base, v_base, a.k_stride.t,
                         a.v_stride.t, (j + 1) * kKeys, T, tid);
    }
#pragma unroll
    for (int nb = 0; nb < kKeys / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float p = softmax_exp2<kFastExp>(fmaf(s[nb][e], sl2, -lse2[e >> 1]));
        if (edge) {
          const int qi = q_lo + (e >> 1) * 8, key = j * kKeys + nb * 8 + 2 * t + (e & 1);
          if (!(key <= qi && qi < T)) p = 0.0f;
        }
        s[nb][e] = p;
      }
    // dS = P (dP - D), then dQ += dS K.
    wgmma::wgmma_wait<0>();
    wgmma::registers_fence(dp);
#pragma unroll
    for (int nb = 0; nb < kKeys / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[nb][e] = s[nb][e] * (dp[nb][e] - dlt[e >> 1]);
    issue_regs_group(dq, dsa, dp, kt);
    if constexpr (!kOverlap) finish_products(dq, dsa);  // before this buffer is refilled
  } while (++j < n_tiles);
  if constexpr (kOverlap) finish_products(dq, dsa);  // the buffers may become the stage

  // The loop ended on a barrier after its last product: the key buffers are the stage.
  constexpr int S = TileLayout<D>::kStride;
  static_assert(kThreads / 32 * 16 * S * 2 <= 4 * (int)kTileBytes, "the stage fits the key/value buffers");
  uint16_t* stage = reinterpret_cast<uint16_t*>(base_ptr + 2 * kRowBytes) + warp * 16 * S;
  store_grad_rows<D, kRope>(dq, d.scale, a.rope, a.rope.positions + (int64_t)b * T, stage, lane,
                            a.dq + b * a.dq_stride.b + h * a.dq_stride.h, a.dq_stride.t, m0 + warp * 16, T);
}

template <int D>
constexpr int wg_forward_smem_bytes() {  // Q, 2 x K, 2 x V + alignment slack
  return kSmemAlign + 5 * kTile * D * 2;
}

// The forward on warpgroup MMA: 64 queries a CTA (one warpgroup), key/value tiles of 64 in a
// 2-stage cp.async pipeline; S = Q K^T with Q and K from swizzled shared memory, the online softmax
// of the mma.sync kernel on the accumulators (the same layout), then O += P V with P from registers
// and V read MN-major.
//
// (A software-pipelined variant, FlashAttention-3's intra-warpgroup overlap, was measured in
// session 23: S of the next tile issued with O += P V and exponentiated while that runs. It needed
// 162 registers instead of 126 at D 64, so 3 CTAs an SM instead of 4, and was slower: H200, gpt2-124m
// B 32, 0.226 vs 0.217 ms; 1.3b 0.258 vs 0.259. Removed.)
// kFastExp: as in the dK/dV kernel.
template <int D, bool kFastExp>
__global__ void __launch_bounds__(kThreads) attention_forward_wgmma_kernel(const AttentionForwardArgs a) {
  constexpr int kRows = kTile;  // queries of the CTA
  constexpr int kKeys = kTile;  // keys of a tile
  constexpr uint32_t kRowBytes = kRows * D * 2, kTileBytes = kKeys * D * 2;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* base_ptr = aligned_smem(smem_raw);
  const uint32_t base = smem_u32(base_ptr);
  const uint32_t q_s = base;
  const uint32_t k_s = q_s + kRowBytes;       // [2] swizzled [kKeys, D]
  const uint32_t v_s = k_s + 2 * kTileBytes;  // [2] swizzled [kKeys, D]

  const AttentionDims& d = a.dims;
  const int T = d.seq;
  const int m_block = gridDim.x - 1 - blockIdx.x;  // the last queries see the most keys: first
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (d.heads / d.kv_heads);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int m0 = m_block * kRows;
  const int warp_q0 = m0 + warp * 16;  // this warp's first query row

  const uint16_t* k_base = a.k + b * a.k_stride.b + hk * a.k_stride.h;
  const uint16_t* v_base = a.v + b * a.v_stride.b + hk * a.v_stride.h;
  // Key tiles 0 .. the one holding key min(m0 + kRows, T) - 1.
  const int n_tiles = (min(m0 + kRows, T) - 1) / kKeys + 1;
  load_tile<D, kRows>(q_s, a.q + b * a.q_stride.b + h * a.q_stride.h, a.q_stride.t, m0, T, tid);
  load_kv_tiles<D>(k_s, v_s, k_base, v_base, a.k_stride.t, a.v_stride.t, 0, T, tid);

  const float sl2 = d.scale * kLog2e;
  float o[D / 8][4], s[kKeys / 8][4];
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
#pragma unroll
  for (int i = 0; i < kKeys / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
  uint32_t pa[kKeys / 16][4];

  for (int j = 0; j < n_tiles; ++j) {
    const int buf = j & 1;
    advance_kv_tiles<D>(k_s, v_s, k_base, v_base, a.k_stride.t, a.v_stride.t, j, n_tiles, T, tid);
    const uint32_t kt = k_s + buf * kTileBytes, vt = v_s + buf * kTileBytes;

    wgmma::wgmma_fence();
    issue_tile_ss<D, kKeys, kRows>(s, q_s, kt);
    wgmma::wgmma_commit();
    wgmma::wgmma_wait<0>();
    wgmma::registers_fence(s);
    if (j * kKeys + kKeys - 1 > warp_q0) {  // a tile on this warp's diagonal: key > query is masked
#pragma unroll
      for (int nb = 0; nb < kKeys / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qi = warp_q0 + g + (e >> 1) * 8, key = j * kKeys + nb * 8 + 2 * t + (e & 1);
          if (key > qi) s[nb][e] = -INFINITY;
        }
    }
    online_softmax_step<D, kFastExp>(s, o, row_max, row_sum, sl2);
    issue_regs_group(o, pa, s, vt);  // O += P V (o was rescaled by ordinary instructions: fenced)
    finish_products(o, pa);          // before this buffer is refilled
  }

  finish_softmax_rows<D>(o, row_max, row_sum, sl2, a.lse + ((int64_t)b * d.heads + h) * T, warp_q0, T, g, t);
  // The loop ended on a barrier after its last product: the key buffers are the stage.
  constexpr int S = TileLayout<D>::kStride;
  static_assert(kThreads / 32 * 16 * S * 2 <= 2 * (int)kTileBytes, "the stage fits the key buffers");
  uint16_t* stage = reinterpret_cast<uint16_t*>(base_ptr + kRowBytes) + warp * 16 * S;
  store_rows<D>(o, 1.0f, stage, lane, a.out + b * a.out_stride.b + h * a.out_stride.h, a.out_stride.t, warp_q0, T);
}

// --- decode --------------------------------------------------------------------------------------

constexpr int kDecodeRows = 16;  // query rows (heads of a group x new tokens) per CTA
constexpr int kDecodeKeys = 64;  // cache positions per shared-memory tile

template <int D>
struct alignas(16) DecodeSmem {
  float q[kDecodeRows][D];                    // q * scale * log2(e)
  uint32_t k[kDecodeKeys][D / 2 + 1];         // bf16 pairs; the odd row length avoids conflicts
  uint32_t v[kDecodeKeys][D / 2];             // bf16 pairs
  float p[kDecodeRows][kDecodeKeys];          // scores, then probabilities
  float alpha[kDecodeRows];
  float m[kDecodeRows], l[kDecodeRows];
  int pos[kDecodeRows];                       // query position; -1: inactive row
};

// splits > 1: CTA (x, hk, b * splits + s) covers the cache positions [s, s + 1) * keys_per_split
// and leaves its partial softmax in a.partials; the last CTA of (x, hk, b) to finish merges them.
template <int D>
__global__ void __launch_bounds__(kThreads) attention_decode_kernel(const AttentionDecodeArgs a, int splits,
                                                                    int keys_per_split) {
  __shared__ DecodeSmem<D> sm;
  __shared__ bool is_last;
  core::pdl_allow_dependents();  // a PDL-launched consumer (the decode GEMV) may start loading its weights
  core::pdl_wait_for_producer();  // launched with PDL (core/pdl.cuh): nothing is read before this
  const AttentionDims& d = a.dims;
  const int Tq = d.seq;
  const int group = d.heads / d.kv_heads;
  const int hk = blockIdx.y, b = (int)blockIdx.z / splits, split = (int)blockIdx.z % splits;
  const int key_begin = split * keys_per_split;
  const int row_begin = blockIdx.x * kDecodeRows;  // flat row = t * group + (h - hk * group)
  const int n_rows = group * Tq;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int len = min(max(a.cache_lengths[b], 0), a.cache_capacity);
  const float sl2 = d.scale * kLog2e;

  // The K/V tiles go through registers: this thread's 16-byte pieces of a tile are loaded one tile
  // ahead (the first one before q is staged, so that the two loads overlap), then stored to shared
  // memory when the tile's turn comes. Keys at or past len read as zeros (and are masked).
  static_assert(kDecodeKeys * D / 8 % kThreads == 0, "decode tile chunks must divide evenly");
  constexpr int kTileLoads = kDecodeKeys * D / 8 / kThreads;
  const uint16_t* k_base = a.k_cache + b * a.k_stride.b + hk * a.k_stride.h;
  const uint16_t* v_base = a.v_cache + b * a.v_stride.b + hk * a.v_stride.h;
  uint4 k_next[kTileLoads], v_next[kTileLoads];
  auto load_tile = [&](int c0) {
#pragma unroll
    for (int it = 0; it < kTileLoads; ++it) {
      const int i = tid + it * kThreads;
      const int c = i / (D / 8), col = (i % (D / 8)) * 8;
      k_next[it] = v_next[it] = make_uint4(0, 0, 0, 0);
      if (c0 + c < len) {
        k_next[it] = *reinterpret_cast<const uint4*>(k_base + (int64_t)(c0 + c) * a.k_stride.t + col);
        v_next[it] = *reinterpret_cast<const uint4*>(v_base + (int64_t)(c0 + c) * a.v_stride.t + col);
      }
    }
  };
  load_tile(key_begin);

  if (tid < kDecodeRows) {
    const int flat = row_begin + tid;
    const int pos = len - Tq + flat / group;
    sm.pos[tid] = flat < n_rows && pos >= 0 ? pos : -1;
    sm.m[tid] = -INFINITY;
    sm.l[tid] = 0.0f;
  }
  for (int i = tid; i < kDecodeRows * D; i += kThreads) {
    const int r = i / D, c = i % D;
    const int flat = row_begin + r;
    float x = 0.0f;
    if (flat < n_rows) {
      const int tq = flat / group, h = hk * group + flat % group;
      const uint16_t bits = a.q[b * a.q_stride.b + tq * a.q_stride.t + h * a.q_stride.h + c];
      x = __uint_as_float((uint32_t)bits << 16) * sl2;
    }
    sm.q[r][c] = x;
  }

  // Output accumulators: this thread owns column pair cp of rows r0, r0 + kRowStep, ...
  constexpr int kPairs = D / 2;
  constexpr int kRowStep = kThreads / kPairs;
  constexpr int kRowsPerThread = kDecodeRows / kRowStep;
  const int cp = tid % kPairs, r0 = tid / kPairs;
  float acc[kRowsPerThread][2];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) acc[i][0] = acc[i][1] = 0.0f;

  __syncthreads();
  int max_pos = -1;
#pragma unroll
  for (int r = 0; r < kDecodeRows; ++r) max_pos = max(max_pos, sm.pos[r]);
  const int last_key = min(max_pos, key_begin + keys_per_split - 1);  // keys_per_split: multiple of 64

  for (int c0 = key_begin; c0 <= last_key; c0 += kDecodeKeys) {
#pragma unroll
    for (int it = 0; it < kTileLoads; ++it) {
      const int i = tid + it * kThreads;
      const int c = i / (D / 8), col = (i % (D / 8)) * 8;
      const uint4 kv = k_next[it];
      uint32_t* kd = &sm.k[c][col / 2];
      kd[0] = kv.x; kd[1] = kv.y; kd[2] = kv.z; kd[3] = kv.w;
      *reinterpret_cast<uint4*>(&sm.v[c][col / 2]) = v_next[it];
    }
    if (c0 + kDecodeKeys <= last_key) load_tile(c0 + kDecodeKeys);  // in flight during this tile
    __syncthreads();
    // Scores (already in log2 units): thread -> key c, rows rr, rr + 2, ... Every row's dot product
    // runs as one FMA chain in element order; the rows' chains are interleaved (independent, and
    // each key pair is read from shared memory once for all of them).
    {
      constexpr int kRowsPerKey = kThreads / kDecodeKeys;
      constexpr int kMyRows = kDecodeRows / kRowsPerKey;
      const int c = tid % kDecodeKeys, rr = tid / kDecodeKeys;
      float s[kMyRows];
#pragma unroll
      for (int j = 0; j < kMyRows; ++j) s[j] = 0.0f;
#pragma unroll 4
      for (int i = 0; i < D / 2; ++i) {
        const uint32_t kk = sm.k[c][i];
        const float klo = bf16_lo(kk), khi = bf16_hi(kk);
#pragma unroll
        for (int j = 0; j < kMyRows; ++j) {
          const float2 qq = *reinterpret_cast<const float2*>(&sm.q[rr + j * kRowsPerKey][2 * i]);
          s[j] = fmaf(qq.x, klo, s[j]);
          s[j] = fmaf(qq.y, khi, s[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < kMyRows; ++j) {
        const int r = rr + j * kRowsPerKey;
        sm.p[r][c] = c0 + c <= sm.pos[r] ? s[j] : -INFINITY;
      }
    }
    __syncthreads();
    // Online softmax: warp w owns rows w, w + 4, ...
    for (int r = warp; r < kDecodeRows; r += kWarps) {
      const float s0 = sm.p[r][lane], s1 = sm.p[r][lane + 32];
      float mx = fmaxf(s0, s1);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_old = sm.m[r];
      const float m_new = fmaxf(m_old, mx);
      const float base = m_new == -INFINITY ? 0.0f : m_new;
      const float p0 = exp2f(s0 - base), p1 = exp2f(s1 - base);
      float sum = p0 + p1;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      sm.p[r][lane] = p0;
      sm.p[r][lane + 32] = p1;
      __syncwarp();
      if (lane == 0) {
        const float alpha = exp2f(m_old - base);
        sm.alpha[r] = alpha;
        sm.l[r] = sm.l[r] * alpha + sum;
        sm.m[r] = m_new;
      }
    }
    __syncthreads();
    // P V: per row the same FMA chain over the keys in order; the rows' chains are interleaved and
    // each value pair is read once for all of this thread's rows.
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const float alpha = sm.alpha[r0 + i * kRowStep];
      acc[i][0] *= alpha;
      acc[i][1] *= alpha;
    }
#pragma unroll 4
    for (int c = 0; c < kDecodeKeys; ++c) {
      const uint32_t vv = sm.v[c][cp];
      const float vlo = bf16_lo(vv), vhi = bf16_hi(vv);
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        const float p = sm.p[r0 + i * kRowStep][c];
        acc[i][0] = fmaf(p, vlo, acc[i][0]);
        acc[i][1] = fmaf(p, vhi, acc[i][1]);
      }
    }
    __syncthreads();  // before the next tile overwrites k, v, p
  }

  if (splits == 1) {
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int r = r0 + i * kRowStep;
      const int flat = row_begin + r;
      if (flat >= n_rows) continue;
      const int tq = flat / group, h = hk * group + flat % group;
      const bool active = sm.pos[r] >= 0;
      const float inv = active ? 1.0f / sm.l[r] : 0.0f;
      uint16_t* o = a.out + b * a.out_stride.b + tq * a.out_stride.t + h * a.out_stride.h;
      *reinterpret_cast<uint32_t*>(o + 2 * cp) = pack_bf16(acc[i][0] * inv, acc[i][1] * inv);
    }
    return;
  }

  // Split: the partial (acc relative to the running max m, m, l) of each row to the scratch, laid
  // out [group][split][row][D + 2] with group = (b * Hkv + hk) * gridDim.x + blockIdx.x.
  constexpr int kStride = D + 2;
  const int64_t grp = ((int64_t)b * d.kv_heads + hk) * gridDim.x + blockIdx.x;
  float* mine = a.partials + (grp * splits + split) * kDecodeRows * kStride;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int r = r0 + i * kRowStep;
    __stcg(reinterpret_cast<float2*>(mine + r * kStride + 2 * cp), make_float2(acc[i][0], acc[i][1]));
  }
  if (tid < kDecodeRows) {
    __stcg(mine + tid * kStride + D, sm.m[tid]);
    __stcg(mine + tid * kStride + D + 1, sm.l[tid]);
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) is_last = atomicAdd(a.counters + grp, 1u) == (unsigned)(splits - 1);
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  // Merge in split order: M = max m_s, L = sum l_s 2^(m_s - M), out = sum acc_s 2^(m_s - M) / L.
  // The partials of kMergeBatch splits are loaded together before they are folded in (in split
  // order, the same operations as one split at a time): one L2 round trip per batch, not one (or
  // three) per split; at batch 1 and a 512-token cache the split count is 9.
  constexpr int kMergeBatch = 8;
  const float* all = a.partials + grp * splits * kDecodeRows * kStride;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int r = r0 + i * kRowStep;
    const int flat = row_begin + r;
    if (flat >= n_rows) continue;
    float m_max = -INFINITY;
    for (int s0 = 0; s0 < splits; s0 += kMergeBatch) {
      float m_s[kMergeBatch];
#pragma unroll
      for (int q = 0; q < kMergeBatch; ++q)
        m_s[q] = s0 + q < splits ? __ldcg(all + ((s0 + q) * kDecodeRows + r) * kStride + D) : -INFINITY;
#pragma unroll
      for (int q = 0; q < kMergeBatch; ++q) m_max = fmaxf(m_max, m_s[q]);
    }
    float l_sum = 0.0f, x0 = 0.0f, x1 = 0.0f;
    if (m_max != -INFINITY) {
      for (int s0 = 0; s0 < splits; s0 += kMergeBatch) {
        float m_s[kMergeBatch], l_s[kMergeBatch];
        float2 v[kMergeBatch];
#pragma unroll
        for (int q = 0; q < kMergeBatch; ++q) {
          m_s[q] = -INFINITY;
          l_s[q] = 0.0f;
          v[q] = make_float2(0.0f, 0.0f);
          if (s0 + q < splits) {
            const float* part = all + ((s0 + q) * kDecodeRows + r) * kStride;
            m_s[q] = __ldcg(part + D);
            l_s[q] = __ldcg(part + D + 1);
            v[q] = __ldcg(reinterpret_cast<const float2*>(part + 2 * cp));
          }
        }
#pragma unroll
        for (int q = 0; q < kMergeBatch; ++q) {
          if (m_s[q] == -INFINITY) continue;  // no key of this split reached the row (or past the last split)
          const float w = exp2f(m_s[q] - m_max);
          l_sum = fmaf(l_s[q], w, l_sum);
          x0 = fmaf(v[q].x, w, x0);
          x1 = fmaf(v[q].y, w, x1);
        }
      }
    }
    const int tq = flat / group, h = hk * group + flat % group;
    const float inv = sm.pos[r] >= 0 && l_sum > 0.0f ? 1.0f / l_sum : 0.0f;
    uint16_t* o = a.out + b * a.out_stride.b + tq * a.out_stride.t + h * a.out_stride.h;
    *reinterpret_cast<uint32_t*>(o + 2 * cp) = pack_bf16(x0 * inv, x1 * inv);
  }
  if (tid == 0) a.counters[grp] = 0u;  // ready for the next call
}

// --- launch helpers ------------------------------------------------------------------------------

template <typename Kernel>
void set_smem(Kernel kernel, int bytes) {
  FOURBIT_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

template <int D, int kM>
void forward_m(const AttentionForwardArgs& a, cudaStream_t stream) {
  const dim3 grid((a.dims.seq + rows_per_cta<kM>() - 1) / rows_per_cta<kM>(), a.dims.heads, a.dims.batch);
  constexpr int smem = forward_smem_bytes<D, kM>();
  set_smem(attention_forward_kernel<D, kM>, smem);
  attention_forward_kernel<D, kM><<<grid, kThreads, smem, stream>>>(a);
  FOURBIT_CUDA_CHECK_LAUNCH();
}

template <int D>
void forward_d(const AttentionForwardArgs& a, cudaStream_t stream) {
  if (a.wgmma) {
    const dim3 grid((a.dims.seq + kTile - 1) / kTile, a.dims.heads, a.dims.batch);
    constexpr int smem = wg_forward_smem_bytes<D>();
    const auto kernel = a.wgmma_fast_exp ? attention_forward_wgmma_kernel<D, true> : attention_forward_wgmma_kernel<D, false>;
    set_smem(kernel, smem);
    kernel<<<grid, kThreads, smem, stream>>>(a);
    FOURBIT_CUDA_CHECK_LAUNCH();
    return;
  }
  if constexpr (D == 64) {
    if (a.wide) return forward_m<D, kWideM>(a, stream);
  }
  forward_m<D, 1>(a, stream);
}

// dK/dV with kM m-blocks a warp; D_i is in `delta`.
// kRope: the instantiation with RoPE's backward in the dK store (a.rope.positions set).
template <int D, int kM, bool kRope>
void dkdv_m(const AttentionBackwardArgs& a, const float* delta, cudaStream_t stream) {
  const AttentionDims& d = a.dims;
  const int n_blocks = (d.seq + rows_per_cta<kM>() - 1) / rows_per_cta<kM>();
  constexpr int smem = dkdv_smem_bytes<D, kM>();
  set_smem(attention_dkdv_kernel<D, kM, kRope>, smem);
  attention_dkdv_kernel<D, kM, kRope><<<dim3(n_blocks, d.kv_heads, d.batch), kThreads, smem, stream>>>(a, delta);
  FOURBIT_CUDA_CHECK_LAUNCH();
}

// dQ with kM m-blocks a warp; D_i is in `delta`.
template <int D, int kM, bool kRope>
void dq_m(const AttentionBackwardArgs& a, const float* delta, cudaStream_t stream) {
  const AttentionDims& d = a.dims;
  const int n_blocks = (d.seq + rows_per_cta<kM>() - 1) / rows_per_cta<kM>();
  constexpr int smem = dq_smem_bytes<D, kM>();
  set_smem(attention_dq_kernel<D, kM, kRope>, smem);
  attention_dq_kernel<D, kM, kRope><<<dim3(n_blocks, d.heads, d.batch), kThreads, smem, stream>>>(a, delta);
  FOURBIT_CUDA_CHECK_LAUNCH();
}

// dK/dV then dQ with kM m-blocks a warp for each (kDkdvM, kDqM), with or without RoPE's backward.
template <int D, int kDkdvM, int kDqM>
void dkdv_dq(const AttentionBackwardArgs& a, const float* delta, cudaStream_t stream) {
  if (a.rope.positions != nullptr) {
    dkdv_m<D, kDkdvM, true>(a, delta, stream);
    dq_m<D, kDqM, true>(a, delta, stream);
  } else {
    dkdv_m<D, kDkdvM, false>(a, delta, stream);
    dq_m<D, kDqM, false>(a, delta, stream);
  }
}

// The warpgroup-MMA dK/dV and dQ kernels, with or without RoPE's backward in the stores.
template <int D, bool kRope, bool kOverlap, bool kFastExp>
void dkdv_dq_wgmma_variant(const AttentionBackwardArgs& a, const float* delta, cudaStream_t stream) {
  const AttentionDims& d = a.dims;
  const int n_blocks = (d.seq + kTile - 1) / kTile;
  constexpr int dkdv_smem = wg_dkdv_smem_bytes<D>();
  set_smem(attention_dkdv_wgmma_kernel<D, kRope, kOverlap, kFastExp>, dkdv_smem);
  attention_dkdv_wgmma_kernel<D, kRope, kOverlap, kFastExp>
      <<<dim3(n_blocks, d.kv_heads, d.batch), kThreads, dkdv_smem, stream>>>(a, delta);
  FOURBIT_CUDA_CHECK_LAUNCH();
  constexpr int dq_smem = wg_dq_smem_bytes<D>();
  set_smem(attention_dq_wgmma_kernel<D, kRope, kOverlap, kFastExp>, dq_smem);
  attention_dq_wgmma_kernel<D, kRope, kOverlap, kFastExp>
      <<<dim3(n_blocks, d.heads, d.batch), kThreads, dq_smem, stream>>>(a, delta);
  FOURBIT_CUDA_CHECK_LAUNCH();
}

template <int D, bool kRope, bool kOverlap>
void dkdv_dq_wgmma_overlap(const AttentionBackwardArgs& a, const float* delta, cudaStream_t stream) {
  if (a.wgmma_fast_exp) return dkdv_dq_wgmma_variant<D, kRope, kOverlap, true>(a, delta, stream);
  dkdv_dq_wgmma_variant<D, kRope, kOverlap, false>(a, delta, stream);
}

template <int D, bool kRope>
void dkdv_dq_wgmma_rope(const AttentionBackwardArgs& a, const float* delta, cudaStream_t stream) {
  if (a.wgmma_overlap) return dkdv_dq_wgmma_overlap<D, kRope, true>(a, delta, stream);
  dkdv_dq_wgmma_overlap<D, kRope, false>(a, delta, stream);
}

template <int D>
void backward_d(const AttentionBackwardArgs& a, float* delta, cudaStream_t stream) {
  const AttentionDims& d = a.dims;
  const int64_t rows = (int64_t)d.batch * d.seq * d.heads;
  const int64_t delta_threads = rows * (D / 8);
  attention_delta_kernel<D><<<(unsigned)((delta_threads + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      a, delta);
  FOURBIT_CUDA_CHECK_LAUNCH();
  if (a.wgmma) {
    if (a.rope.positions != nullptr) return dkdv_dq_wgmma_rope<D, true>(a, delta, stream);
    return dkdv_dq_wgmma_rope<D, false>(a, delta, stream);
  }
  if constexpr (D == 64) {
    if (a.wide_dkdv && a.wide_dq) return dkdv_dq<D, kWideM, kWideM>(a, delta, stream);
    if (a.wide_dkdv) return dkdv_dq<D, kWideM, 1>(a, delta, stream);
    if (a.wide_dq) return dkdv_dq<D, 1, kWideM>(a, delta, stream);
  }
  dkdv_dq<D, 1, 1>(a, delta, stream);
}

template <int D>
void decode_d(const AttentionDecodeArgs& a, cudaStream_t stream) {
  const AttentionDims& d = a.dims;
  const int rows = (d.heads / d.kv_heads) * d.seq;
  const int row_blocks = (rows + kDecodeRows - 1) / kDecodeRows;
  const int64_t groups = (int64_t)row_blocks * d.kv_heads * d.batch;
  // Split the cache while the launch has fewer than a.max_ctas CTAs (attention.cpp: 6 per SM).
  const int64_t target = a.max_ctas;
  const int tiles = (a.cache_capacity + kDecodeKeys - 1) / kDecodeKeys;
  int splits = 1;
  if (a.partials != nullptr && a.counters != nullptr && groups < target && tiles > 1) {
    splits = (int)std::min<int64_t>(tiles, target / groups);
  }
  // Whole tiles per split, no empty trailing split; one split covers every tile (at least one).
  const int tiles_per_split = std::max(1, (tiles + splits - 1) / splits);
  if (splits > 1) splits = (tiles + tiles_per_split - 1) / tiles_per_split;
  const int keys_per_split = tiles_per_split * kDecodeKeys;
  const dim3 grid(row_blocks, d.kv_heads, (unsigned)(d.batch * splits));
  FOURBIT_CUDA_CHECK(core::launch_pdl(attention_decode_kernel<D>, grid, dim3(kThreads), 0, stream, a, splits,
                                      keys_per_split));
  FOURBIT_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool attention_head_dim_supported(int head_dim) { return head_dim == 64 || head_dim == 128; }

bool attention_wgmma_available() {
#if defined(FOURBIT_CUDA_SM90A)
  int dev = 0;
  FOURBIT_CUDA_CHECK(cudaGetDevice(&dev));
  static thread_local int cached_device = -1;
  static thread_local bool cached = false;
  if (dev != cached_device) {
    int major = 0, minor = 0;
    FOURBIT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    FOURBIT_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    cached = major == 9 && minor == 0;
    cached_device = dev;
  }
  return cached;
#else
  return false;
#endif
}

void launch_attention_forward(const AttentionForwardArgs& a, cudaStream_t stream) {
  if (a.dims.head_dim == 64) forward_d<64>(a, stream);
  else forward_d<128>(a, stream);
}

void launch_attention_backward(const AttentionBackwardArgs& a, cudaStream_t stream) {
  const AttentionDims& d = a.dims;
  // D_i scratch, ordered on the stream: freed (asynchronously) after the kernels that read it, also
  // when a launch throws.
  struct Scratch {
    void* p = nullptr;
    cudaStream_t s;
    ~Scratch() {
      if (p) cudaFreeAsync(p, s);
    }
  } delta{nullptr, stream};
  FOURBIT_CUDA_CHECK(
      cudaMallocAsync(&delta.p, sizeof(float) * (size_t)d.batch * d.heads * d.seq, stream));
  if (d.head_dim == 64) backward_d<64>(a, static_cast<float*>(delta.p), stream);
  else backward_d<128>(a, static_cast<float*>(delta.p), stream);
}

void launch_attention_decode(const AttentionDecodeArgs& a, cudaStream_t stream) {
  if (a.dims.head_dim == 64) decode_d<64>(a, stream);
  else decode_d<128>(a, stream);
}

}  // namespace fourbit::ops::kernels
