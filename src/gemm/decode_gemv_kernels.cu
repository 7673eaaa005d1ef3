// CUDA kernels of the decode GEMV (interface, work split and invariants: decode_gemv_kernels.h).
//
// Tensor-core GEMV: y[B, N] = alpha_eff * x[B, K] . W[N, K]^T with mma.sync m16n8k16 (FP32
// accumulation): W rows are the mma's M (16 per warp), tokens its N (8 per n-tile), K its K.
// A dot product does not depend on the order of its K terms, so each thread feeds the mma's k slots
// {2t, 2t+1, 2t+8, 2t+9} (t = lane % 4) with whatever K elements it loaded, as long as the x
// fragment it feeds comes from the same K elements. That lets every thread load 16 contiguous bytes
// of a weight row (128-bit loads, 64 contiguous bytes per row per warp instruction) and use them as
// they are:
//   - BF16 weights: thread t owns the 8-element pieces c = t + 4p (p = 0..3) of each 128-element
//     chunk; piece elements (0,1),(2,3) feed one k-step, (4,5),(6,7) the next.
//   - NVFP4 weights: thread t owns the 16 bytes 16t.. of each row's 64-byte chunk (elements
//     32t..32t+31, pieces c = 4t + p, scale blocks 2t and 2t+1). A 32-bit word holds one piece
//     (8 nibbles); the even and the odd nibbles are rebuilt as E4M3 bytes (sign << 7 | magnitude
//     << 2 is exactly e2m1 * 2^-6 in E4M3) and converted by the hardware (cvt e4m3x2 -> f16x2)
//     into the pairs (n0,n2), (n4,n6), (n1,n3), (n5,n7), then multiplied by 64 * s_b (FP16, exact:
//     e2m1 * s_b has at most 6 significant bits and lies in [2^-10, 2688]). The x pieces are
//     staged in shared memory in the same order [x0,x2,x4,x6,x1,x3,x5,x7].
// Precision: when x is NVFP4 scaled-domain (x_amax given) its values are exact in FP16 too, so the
// mma runs in FP16 (no conversion of the weights); otherwise (BF16 x) the exact FP16 weight values
// are converted to BF16 (exact) and the mma runs in BF16. Either way the products are exact and the
// sums FP32: the result equals the exact emulation (dequantize to BF16 + cuBLASLt) up to the order
// of the FP32 additions. alpha_eff = f32(f32(alpha * d_x) * d_w), the emulation's epilogue scalar.
//
// Performance (H200, `fourbit bench decode`, bench/results/results-2026-12-03-90ba38d-*): the
// weight bytes dominate (BF16 2 bytes per value, NVFP4 0.5625). BF16 streams at ~3.6 TB/s once a
// GEMV is large (lm_head 73% of copy bandwidth at batch 1) but the 2-23 MB layers of a 1.1B model
// take 5-13 us (bench/results/results-2026-12-04-cefea66-*; 21 us for the 2048 x 5632 one before
// its splits were capped at a cluster): ncu shows them latency-bound (0.5 waves, ~73% of cycles
// without an eligible warp; each CTA waits for one load round trip, then the split-K partials'
// round trip), and their times move 10-20% with the register allocation. NVFP4 at batch 1
// streams at only ~1.5 TB/s marginal (lm_head 30-39% of copy bandwidth). ncu (H100, session 29,
// bench/notes-decode.md) shows it bound by per-CTA latency like the small layers: 157 registers
// (3 CTAs an SM), one long-scoreboard wait per warp for the first chunk (17% of the samples) in a
// CTA that then works only 8 chunks, the cluster sum's barrier and membar 15%, and the 2-byte scale
// loads fetching 4x the sectors they use. Ruled out before (session 9): building the FP16 pairs
// without cvt changed nothing, and a ring depth of 8 gained only 4-6% on the large layers. Knobs: kDecodeWarps, kDecodeChunk, the ring depth,
// plan_decode_gemv's CTAs per SM and minimum chunks per split, and the L2::256B prefetch.
//
// Shared memory: x of one chunk, [8 * NT tokens][16 pieces of 16 bytes], double-buffered (staged
// launches: one such tile per chunk of the split, dynamic shared memory); a piece
// is stored at a swizzled slot so that the eight threads of each quarter-warp read eight distinct
// 16-byte bank groups (no bank conflicts; derivation at piece_slot).
#include "gemm/decode_gemv_kernels.h"

#include "core/pdl.cuh"
#include "core/rope_math.cuh"

#include "core/error.h"
#include "core/sm_count.h"
#include "formats/element.h"
#include "formats/fp_ops.h"
#include "quant/block_math.h"
#include "quant/format.h"

#include <cooperative_groups.h>

#include <algorithm>
#include <map>
#include <string>
#include <tuple>
#include <utility>

namespace fourbit::gemm::kernels {
namespace cg = cooperative_groups;
namespace {

constexpr int kThreads = kDecodeWarps * 32;
constexpr int kPieces = kDecodeChunk / 8;  // 16-byte x pieces per token row of a chunk
constexpr uint32_t kF16x2Sixtyfour = 0x54005400u;  // (64, 64) in FP16

__device__ __forceinline__ uint32_t cvt_e4m3x2_to_f16x2(uint32_t v16) {
  uint32_t d;
  const unsigned short s = (unsigned short)(v16 & 0xFFFFu);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(s));
  return d;
}

__device__ __forceinline__ uint32_t mul_f16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// (lo, hi) f16 pair -> (lo, hi) bf16 pair; exact for the values used here.
__device__ __forceinline__ uint32_t f16x2_to_bf16x2(uint32_t h) {
  float lo, hi;
  asm("{\n\t.reg .f16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
      : "=f"(lo), "=f"(hi)
      : "r"(h));
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// (lo, hi) bf16 pair -> (lo, hi) f16 pair (round to nearest; exact for NVFP4 scaled-domain values).
__device__ __forceinline__ uint32_t bf16x2_to_f16x2(uint32_t b) {
  const float lo = __uint_as_float(b << 16), hi = __uint_as_float(b & 0xFFFF0000u);
  uint32_t d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

template <bool kF16>
__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, uint32_t b0, uint32_t b1) {
  if constexpr (kF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// Streaming 16-byte weight load: read once, so no L1 allocation; ask L2 to fetch 256 bytes (the
// rest of this row's next chunks, which this CTA reads next).
__device__ __forceinline__ uint4 ldg_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t& word(uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Swizzled 16-byte slot of piece c (0..15) of `token` in a chunk's shared x tile. A quarter-warp
// (8 lanes: g in {2q, 2q+1}, t = 0..3) reads pieces of one p:
//   NVFP4: c = 4t + p, so c & 7 = 4 (t & 1) + p and bit 3 of c = t >> 1. The slot's bank group
//          (slot & 7) has bit 0 = p0 ^ g0, bit 1 = p1 ^ t1, bit 2 = t0: 8 distinct groups.
//   BF16:  c = t + 4p, so c & 7 = t + 4 (p & 1); the slot's bit 2 = p0 ^ g0: 8 distinct groups.
template <DecodeWeightFormat F>
__device__ __forceinline__ int piece_slot(int token, int c) {
  if constexpr (F == DecodeWeightFormat::kNvfp4) {
    return c ^ (((c >> 3) & 1) << 1) ^ (token & 1);
  } else {
    return c ^ ((token & 1) << 2);
  }
}

// Eight bf16 elements e .. e + 7 of a row at src (src points at element e) one at a time, zeros
// from K on: the unaligned or ragged-end path of the 16-byte loads.
__device__ __forceinline__ uint4 load_bf16x8_tail(const uint16_t* src, int64_t e, int64_t K) {
  uint4 v;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t lo = e + 2 * j < K ? src[2 * j] : 0u;
    const uint32_t hi = e + 2 * j + 1 < K ? src[2 * j + 1] : 0u;
    word(v, j) = lo | (hi << 16);
  }
  return v;
}

// One thread's weights of one chunk: rows g and g + 8 of its warp (weight rows row0 and row0 +
// row_step: 8, or a pair launch's two rows of one output pair: "Pair launches" below).
template <DecodeWeightFormat F>
struct WeightRegs;
template <>
struct WeightRegs<DecodeWeightFormat::kBf16> {
  uint4 w[2][4];  // [row][p]: piece t + 4p
};
template <>
struct WeightRegs<DecodeWeightFormat::kNvfp4> {
  uint4 w[2];       // [row]: 32 nibbles, elements 32t .. 32t + 31
  uint32_t s[2];    // [row]: e4m3 scales of blocks 2t (low byte) and 2t + 1
};

struct GemvShape {
  int64_t N, K;
  bool vec_w, vec_x;
  bool vec_s = false;  // NVFP4: a thread's two scale bytes are one aligned 16-bit load
};

__device__ __forceinline__ void load_weights(const DecodeGemvParams& p, const GemvShape& sh, int64_t row0,
                                             int64_t row_step, int t, int64_t k0,
                                             WeightRegs<DecodeWeightFormat::kBf16>& r) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t row = row0 + row_step * i;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int64_t e = k0 + 8 * t + 32 * q;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (row < sh.N) {
        const uint16_t* src = p.w_bf16 + row * p.ldw + e;
        if (sh.vec_w && e + 8 <= sh.K) {
          v = ldg_stream(src);
        } else {
          v = load_bf16x8_tail(src, e, sh.K);
        }
      }
      r.w[i][q] = v;
    }
  }
}

__device__ __forceinline__ void load_weights(const DecodeGemvParams& p, const GemvShape& sh, int64_t row0,
                                             int64_t row_step, int t, int64_t k0,
                                             WeightRegs<DecodeWeightFormat::kNvfp4>& r) {
  const int64_t row_bytes = (sh.K + 1) / 2, n_scales = (sh.K + 15) / 16;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t row = row0 + row_step * i;
    uint4 v = make_uint4(0, 0, 0, 0);
    uint32_t s = 0;
    if (row < sh.N) {
      const int64_t b0 = k0 / 2 + 16 * t;
      const uint8_t* src = p.w_data + row * row_bytes + b0;
      if (sh.vec_w && b0 + 16 <= row_bytes) {
        v = ldg_stream(src);
      } else {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const uint32_t byte = b0 + j < row_bytes ? src[j] : 0u;
          word(v, j / 4) |= byte << (8 * (j % 4));
        }
      }
      const int64_t sb = k0 / 16 + 2 * t;  // even: with n_scales even, sb < n_scales covers sb + 1
      const uint8_t* ss = p.w_scales + row * n_scales + sb;
      if (sh.vec_s) {
        s = sb < n_scales ? (uint32_t)__ldg(reinterpret_cast<const unsigned short*>(ss)) : 0u;
      } else {
        s = (sb < n_scales ? (uint32_t)__ldg(ss) : 0u) | ((sb + 1 < n_scales ? (uint32_t)__ldg(ss + 1) : 0u) << 8);
      }
    }
    r.w[i] = v;
    r.s[i] = s;
  }
}

// One 16-byte x piece: elements e .. e + 7 of `token` (zeros past K and past the batch).
__device__ __forceinline__ uint4 load_x_piece(const DecodeGemvParams& p, const GemvShape& sh, int token, int64_t e) {
  uint4 v = make_uint4(0, 0, 0, 0);
  if (token < p.B) {
    const uint16_t* src = p.x + token * p.ldx + e;
    if (sh.vec_x && e + 8 <= sh.K) {
      v = __ldg(reinterpret_cast<const uint4*>(src));
    } else {
      v = load_bf16x8_tail(src, e, sh.K);
    }
  }
  return v;
}

// Stores piece c of `token` into a chunk's x tile, in the order and precision the weights use.
template <DecodeWeightFormat F, bool kXF16>
__device__ __forceinline__ void store_x_piece(uint4 v, uint4* tile, int token, int c) {
  if constexpr (F == DecodeWeightFormat::kNvfp4) {
    // [x0..x7] -> [x0, x2, x4, x6, x1, x3, x5, x7], the order of the decoded weight pairs.
    uint4 o;
    o.x = __byte_perm(v.x, v.y, 0x5410);
    o.y = __byte_perm(v.z, v.w, 0x5410);
    o.z = __byte_perm(v.x, v.y, 0x7632);
    o.w = __byte_perm(v.z, v.w, 0x7632);
    if constexpr (kXF16) {
      o.x = bf16x2_to_f16x2(o.x);
      o.y = bf16x2_to_f16x2(o.y);
      o.z = bf16x2_to_f16x2(o.z);
      o.w = bf16x2_to_f16x2(o.w);
    }
    v = o;
  }
  tile[token * kPieces + piece_slot<F>(token, c)] = v;
}

// x of one chunk: NT pieces per thread (8 NT tokens x 16 pieces over 128 threads).
template <int NT>
struct XRegs {
  uint4 v[NT];
};

template <int NT>
__device__ __forceinline__ void load_x(const DecodeGemvParams& p, const GemvShape& sh, int64_t k0, XRegs<NT>& r) {
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    const int idx = (int)threadIdx.x + i * kThreads;
    r.v[i] = load_x_piece(p, sh, idx / kPieces, k0 + 8 * (idx % kPieces));
  }
}

template <DecodeWeightFormat F, bool kXF16, int NT>
__device__ __forceinline__ void store_x(const XRegs<NT>& r, uint4* tile) {
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    const int idx = (int)threadIdx.x + i * kThreads;
    store_x_piece<F, kXF16>(r.v[i], tile, idx / kPieces, idx % kPieces);
  }
}

// Staged launches: x of chunks c_begin .. c_begin + n_chunks - 1 into consecutive chunk tiles of
// NT * 8 * kPieces pieces each; loads are issued four at a time before their stores. load_piece(token,
// e) returns the 16-byte piece of elements e .. e + 7 of `token` (zeros past K and the batch).
template <DecodeWeightFormat F, bool kXF16, int NT, typename LoadPiece>
__device__ __forceinline__ void stage_x_with(const LoadPiece& load_piece, int c_begin, int n_chunks, uint4* tiles) {
  constexpr int kTilePieces = NT * 8 * kPieces;
  const int total = n_chunks * kTilePieces;
  for (int i0 = (int)threadIdx.x; i0 < total; i0 += 4 * kThreads) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int idx = i0 + u * kThreads, chunk = idx / kTilePieces, within = idx % kTilePieces;
      v[u] = idx < total ? load_piece(within / kPieces, (int64_t)(c_begin + chunk) * kDecodeChunk + 8 * (within % kPieces))
                         : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int idx = i0 + u * kThreads, chunk = idx / kTilePieces, within = idx % kTilePieces;
      if (idx < total) store_x_piece<F, kXF16>(v[u], tiles + chunk * kTilePieces, within / kPieces, within % kPieces);
    }
  }
}

template <DecodeWeightFormat F, bool kXF16, int NT>
__device__ __forceinline__ void stage_x(const DecodeGemvParams& p, const GemvShape& sh, int c_begin, int n_chunks,
                                        uint4* tiles) {
  stage_x_with<F, kXF16, NT>([&](int token, int64_t e) { return load_x_piece(p, sh, token, e); }, c_begin, n_chunks,
                             tiles);
}

template <bool kXF16, int NT>
__device__ __forceinline__ void compute_chunk(float (&acc)[NT][4], const WeightRegs<DecodeWeightFormat::kNvfp4>& w,
                                              const uint4* tile, int g, int t) {
  uint32_t sc[2][2];  // [row][block]: (64 s_b, 64 s_b) in FP16
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t s2 = mul_f16x2(cvt_e4m3x2_to_f16x2(w.s[i]), kF16x2Sixtyfour);
    sc[i][0] = __byte_perm(s2, s2, 0x1010);
    sc[i][1] = __byte_perm(s2, s2, 0x3232);
  }
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    uint32_t a[2][4];  // [row]: pairs (n0,n2), (n4,n6), (n1,n3), (n5,n7)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t wd = word(w.w[i], q);
      const uint32_t even = ((wd << 4) & 0x80808080u) | ((wd << 2) & 0x1C1C1C1Cu);
      const uint32_t odd = (wd & 0x80808080u) | ((wd >> 2) & 0x1C1C1C1Cu);
      const uint32_t s = sc[i][q >> 1];
      a[i][0] = mul_f16x2(cvt_e4m3x2_to_f16x2(even), s);
      a[i][1] = mul_f16x2(cvt_e4m3x2_to_f16x2(even >> 16), s);
      a[i][2] = mul_f16x2(cvt_e4m3x2_to_f16x2(odd), s);
      a[i][3] = mul_f16x2(cvt_e4m3x2_to_f16x2(odd >> 16), s);
      if constexpr (!kXF16) {
#pragma unroll
        for (int j = 0; j < 4; ++j) a[i][j] = f16x2_to_bf16x2(a[i][j]);
      }
    }
    const int c = 4 * t + q;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int token = 8 * j + g;
      const uint4 xv = tile[token * kPieces + piece_slot<DecodeWeightFormat::kNvfp4>(token, c)];
      mma_16816<kXF16>(acc[j], a[0][0], a[1][0], a[0][1], a[1][1], xv.x, xv.y);
      mma_16816<kXF16>(acc[j], a[0][2], a[1][2], a[0][3], a[1][3], xv.z, xv.w);
    }
  }
}

template <bool kXF16, int NT>
__device__ __forceinline__ void compute_chunk(float (&acc)[NT][4], const WeightRegs<DecodeWeightFormat::kBf16>& w,
                                              const uint4* tile, int g, int t) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int c = t + 4 * q;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int token = 8 * j + g;
      const uint4 xv = tile[token * kPieces + piece_slot<DecodeWeightFormat::kBf16>(token, c)];
      mma_16816<false>(acc[j], w.w[0][q].x, w.w[1][q].x, w.w[0][q].y, w.w[1][q].y, xv.x, xv.y);
      mma_16816<false>(acc[j], w.w[0][q].z, w.w[1][q].z, w.w[0][q].w, w.w[1][q].w, xv.z, xv.w);
    }
  }
}

// ops::swiglu_forward's output for gate g and up u: bf16(g * sigmoid(g) * u), sigmoid(g) =
// 1 / (1 + exp(-g)), in that order.
__device__ __forceinline__ uint16_t swiglu_bits(float g, float u) {
  const float sig = 1.0f / (1.0f + expf(-g));
  return formats::encode_bf16_rn(g * sig * u);
}

__device__ __forceinline__ void store_y(const DecodeGemvParams& p, int token, int64_t row, float v) {
  if (p.y_bf16) {
    uint16_t out = formats::encode_bf16_rn(v);
    if (p.residual != nullptr) {  // exactly ops::add_inplace on the bf16 result
      out = formats::encode_bf16_rn(formats::add_rn(formats::decode_bf16(out), formats::decode_bf16(__ldcg(p.residual + token * p.ldr + row))));
    }
    static_cast<uint16_t*>(p.y)[token * p.ldy + row] = out;
  } else {
    static_cast<float*>(p.y)[token * p.ldy + row] = v;
  }
}

// Epilogue scalar of the exact emulation for one token: f32(f32(alpha * d_x) * d_w), d_x from the
// token's own amax when x has one per row (x_amax_per_row).
template <DecodeWeightFormat F>
__device__ __forceinline__ float alpha_eff(const DecodeGemvParams& p, int token) {
  float alpha = p.alpha;
  if (p.x_amax != nullptr) {
    alpha = formats::mul_rn(alpha, quant::nvfp4_global_decode_scale(p.x_amax[p.x_amax_per_row ? token : 0], p.x_constant));
  }
  if constexpr (F == DecodeWeightFormat::kNvfp4) {
    alpha = formats::mul_rn(alpha, quant::nvfp4_global_decode_scale(*p.w_amax, p.w_constant));
  }
  return alpha;
}

// ---- Pair launches: the SwiGLU (DecodeGemvParams::swiglu_half) and RoPE (rope_half) epilogues ----
// Each output pair is two rows of W a distance `step` apart: a gate row and its up row (step =
// swiglu_half), or rows d and d + D/2 of one attention head (step = D/2). W's rows form spans of
// 2 step rows (one span for the SwiGLU, one per head for RoPE) of which a row block of 64 rows takes
// 32 pairs: block b computes the pairs base(b) + q, q < 32, with base(b) = (b / (span / 64)) span +
// (b % (span / 64)) 32. Thread (g, t) of warp w loads pair 8 w + g's two rows as its rows g and
// g + 8 (row_step = step), so its accumulator elements e and e + 2 are the two sums of one (token,
// pair). The split partials keep the plain launch's rows (16 w + g + 8 i of the block), where
// pair q is rows decode_pair_row(q) and that + 8 (decode_gemv_kernels.h).
enum class PairKind : uint8_t { kNone, kSwiglu, kRope };
constexpr int kPairsPerCta = kDecodeRowsPerCta / 2;

template <PairKind kPair>
__device__ __forceinline__ int64_t pair_step(const DecodeGemvParams& p) {
  return kPair == PairKind::kSwiglu ? p.swiglu_half : (int64_t)p.rope_half;
}
// The first row of pair 0 of row block `block` (decode_gemv_kernels.h decode_pair_base).
template <PairKind kPair>
__device__ __forceinline__ int64_t pair_base(const DecodeGemvParams& p, int64_t block) {
  return decode_pair_base(pair_step<kPair>(p), block);
}

// Output pair q of row block `block` for `token`, from the pair's FP32 results lo (the first row)
// and hi (the second), alpha_eff applied. Both are rounded to bf16 first, as the GEMV's own output
// would be; then
//   kSwiglu: y[token][32 block + q] = ops::swiglu_forward(gate = lo, up = hi);
//   kRope: rows r = base + q and r + D/2 of y: q and k rows rotated as ops::rope_forward_inplace
//     rotates them (core/rope_math.cuh, the step's (cos, sin) table), v rows as they are; k and v
//     rows also go to the KV cache at the token's write position, as rope_forward_inplace_append
//     writes them.
template <PairKind kPair>
__device__ __forceinline__ void store_pair(const DecodeGemvParams& p, int token, int64_t block, int q, float lo,
                                           float hi) {
  float l = formats::decode_bf16(formats::encode_bf16_rn(lo));
  float h = formats::decode_bf16(formats::encode_bf16_rn(hi));
  uint16_t* y = static_cast<uint16_t*>(p.y) + token * p.ldy;
  if constexpr (kPair == PairKind::kSwiglu) {
    y[pair_base<kPair>(p, block) + q] = swiglu_bits(l, h);  // the span is the whole y: base = 32 block
  } else {
    const int64_t r = pair_base<kPair>(p, block) + q, step = p.rope_half;
    if (r < p.rope_rotated_rows) {
      const int d = (int)(r % (2 * step));  // < D/2: the pair's frequency
      const float* cs = p.rope_cos_sin + ((int64_t)token * step + d) * 2;
      core::rope_rotate(l, h, cs[0], cs[1]);
    }
    const uint16_t lb = formats::encode_bf16_rn(l), hb = formats::encode_bf16_rn(h);
    y[r] = lb;
    y[r + step] = hb;
    if (r >= p.rope_q_rows && p.k_cache != nullptr) {
      const int32_t wp = p.write_pos[token];
      if (wp >= 0 && wp < p.t_max) {
        const int64_t kv_rows = p.rope_rotated_rows - p.rope_q_rows;
        const bool is_k = r < p.rope_rotated_rows;
        uint16_t* cache = (is_k ? p.k_cache : p.v_cache) +
                          ((int64_t)(token / p.rows_per_seq) * p.t_max + wp) * kv_rows +
                          (is_k ? r - p.rope_q_rows : r - p.rope_rotated_rows);
        cache[0] = lb;
        cache[step] = hb;
      }
    }
  }
}

// The global path's sum (sum_split_partials) of a pair launch: pair i (token i / kPairsPerCta,
// pair i % kPairsPerCta of the row block), kBatch pairs a thread at once, each of its two sums
// 0 + p_0 + p_1 + ... in split order. Kept apart from sum_split_partials on purpose: one template
// for both (outputs of 1 or 2 rows) changed the plain kernels' allocation from 152-159 registers
// to 128 with spills (ptxas, session 31), and those kernels' times follow their registers.
template <DecodeWeightFormat F, PairKind kPair, int kBatch>
__device__ __forceinline__ void sum_split_pairs(const DecodeGemvParams& p, int64_t row_base, int splits) {
  const float alpha0 = alpha_eff<F>(p, 0);
  const int total = p.B * kPairsPerCta;
  for (int i0 = (int)threadIdx.x; i0 < total; i0 += kBatch * kThreads) {
    float sg[kBatch], su[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) sg[u] = su[u] = 0.0f;
    for (int s = 0; s < splits; ++s) {
      float vg[kBatch], vu[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = i0 + u * kThreads;
        const float* src = p.partials + ((int64_t)s * p.B + i / kPairsPerCta) * p.N + row_base +
                           decode_pair_row(i % kPairsPerCta);
        vg[u] = i < total ? __ldcg(src) : 0.0f;
        vu[u] = i < total ? __ldcg(src + 8) : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        sg[u] = formats::add_rn(sg[u], vg[u]);
        su[u] = formats::add_rn(su[u], vu[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = i0 + u * kThreads, token = i / kPairsPerCta;
      if (i < total) {
        const float a = p.x_amax_per_row ? alpha_eff<F>(p, token) : alpha0;
        store_pair<kPair>(p, token, row_base / kDecodeRowsPerCta, i % kPairsPerCta, formats::mul_rn(sg[u], a),
                          formats::mul_rn(su[u], a));
      }
    }
  }
}

// The last-arriving CTA's sum of a row block's split partials (global path of finish()): output i
// (token i / kDecodeRowsPerCta, row row_base + i % kDecodeRowsPerCta) = 0 + p_0 + p_1 + ... in
// split order, then alpha_eff. A thread owns kSumBatch outputs (i0 + u * kThreads) whose loads of
// one split are in flight together: one L2 round trip per split, not per split and output (at 64
// tokens a thread owns 64 * 64 / 128 = 32 outputs: all of them in one batch). Batching splits as
// well (16 per round trip) was measured and not kept: it changed the kernels' register allocation
// and the e2e4 step was 2-4% slower, and with the plan's cluster cap no launch of the 1.1B shape at
// 1-16 tokens comes here (bench/notes-decode.md).
template <DecodeWeightFormat F, int kSumBatch = 32>
__device__ __forceinline__ void sum_split_partials(const DecodeGemvParams& p, int64_t row_base, int total,
                                                   int splits) {
  const float alpha0 = alpha_eff<F>(p, 0);
  for (int i0 = (int)threadIdx.x; i0 < total; i0 += kSumBatch * kThreads) {
    float sum[kSumBatch];
#pragma unroll
    for (int u = 0; u < kSumBatch; ++u) sum[u] = 0.0f;
    for (int s = 0; s < splits; ++s) {
      float v[kSumBatch];
#pragma unroll
      for (int u = 0; u < kSumBatch; ++u) {
        const int i = i0 + u * kThreads;
        const int64_t row = row_base + i % kDecodeRowsPerCta;
        const bool valid = i < total && row < p.N;
        v[u] = valid && s < splits ? __ldcg(p.partials + ((int64_t)s * p.B + i / kDecodeRowsPerCta) * p.N + row)
                                   : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kSumBatch; ++u) {
        if (s < splits) sum[u] = formats::add_rn(sum[u], v[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kSumBatch; ++u) {
      const int i = i0 + u * kThreads, token = i / kDecodeRowsPerCta;
      const int64_t row = row_base + i % kDecodeRowsPerCta;
      if (i < total && row < p.N) {
        store_y(p, token, row, formats::mul_rn(sum[u], p.x_amax_per_row ? alpha_eff<F>(p, token) : alpha0));
      }
    }
  }
}

// The split-order sums of kRows elements idx[r] of the cluster's partials (each CTA's shared
// `partial`), over distributed shared memory: every split's loads first (one round trip, not one
// per split), then 0 + p_0 + p_1 + ...: the global path's sums exactly.
template <int kRows>
__device__ __forceinline__ void cluster_split_sums(cg::cluster_group& cluster, float* partial, const int (&idx)[kRows],
                                                   int splits, float (&sum)[kRows]) {
  float v[kRows][kDecodeClusterMax];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int s2 = 0; s2 < kDecodeClusterMax; ++s2) v[r][s2] = s2 < splits ? cluster.map_shared_rank(partial, s2)[idx[r]] : 0.0f;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    sum[r] = 0.0f;
#pragma unroll
    for (int s2 = 0; s2 < kDecodeClusterMax; ++s2) {
      if (s2 < splits) sum[r] = formats::add_rn(sum[r], v[r][s2]);
    }
  }
}

// f(token, row, value) for each of a thread's accumulator elements that lies inside y: element e of
// n-tile j is token 8j + 2t + (e & 1), row row0 + 8 (e >> 1).
template <int NT, typename F>
__device__ __forceinline__ void for_each_output(const DecodeGemvParams& p, const float (&acc)[NT][4], int64_t row0,
                                                int t, const F& f) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int token = 8 * j + 2 * t + (e & 1);
      const int64_t row = row0 + 8 * (e >> 1);
      if (token < p.B && row < p.N) f(token, row, acc[j][e]);
    }
}

// The epilogue of both kernels: alpha_eff, then y directly (one split) or through the split-K
// partials, summed in split order by the row block's last-arriving CTA.
// `split` is this CTA's split (its partials slice), `row_block` its row block (its arrival counter);
// kSumBatch: sum_split_partials' outputs a thread sums at once (the chain's 8 tokens need 4).
// kPair: a pair launch's epilogue (store_pair), or none.
template <DecodeWeightFormat F, int NT, int kSumBatch = 32, PairKind kPair = PairKind::kNone>
__device__ __forceinline__ void finish(const DecodeGemvParams& p, const float (&acc)[NT][4], int64_t row0,
                                       int64_t row_base, int t, int splits, int split, int row_block) {
  __shared__ bool is_last;
  const float alpha0 = alpha_eff<F>(p, 0);
  auto alpha = [&](int token) { return p.x_amax_per_row ? alpha_eff<F>(p, token) : alpha0; };

  // Accumulator element e of n-tile j: token 8j + 2t + (e & 1), row row0 + 8 (e >> 1).
  if (splits == 1) {
    if constexpr (kPair != PairKind::kNone) {  // elements e and e + 2: the two sums of one pair
      const int local = (int)(row0 - row_base), q = 8 * (local / 16) + local % 16;  // local = 16 w + g
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int token = 8 * j + 2 * t + e;
          if (token < p.B) {
            store_pair<kPair>(p, token, row_base / kDecodeRowsPerCta, q, formats::mul_rn(acc[j][e], alpha(token)),
                              formats::mul_rn(acc[j][e + 2], alpha(token)));
          }
        }
    } else {
      for_each_output(p, acc, row0, t,
                      [&](int token, int64_t row, float v) { store_y(p, token, row, formats::mul_rn(v, alpha(token))); });
    }
    return;
  }
  float* part = p.partials + (int64_t)split * p.B * p.N;
  for_each_output(p, acc, row0, t, [&](int token, int64_t row, float v) { __stcg(part + token * p.N + row, v); });
  // One fence for the CTA, in thread 0 after the CTA barrier (fences are cumulative: they order the
  // partials every thread stored before the barrier), as cooperative groups' grid sync does; a fence
  // in every thread would also wait for each thread's outstanding weight loads (the chain's ring).
  // The last CTA's fence after its ticket orders the partials' loads that follow the second barrier.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    is_last = atomicAdd(p.counters + row_block, 1u) == (unsigned)(splits - 1);
    if (is_last) __threadfence();
  }
  __syncthreads();
  if (!is_last) return;
  if constexpr (kPair != PairKind::kNone) {
    sum_split_pairs<F, kPair, kSumBatch / 4>(p, row_base, splits);
  } else {
    sum_split_partials<F, kSumBatch>(p, row_base, p.B * kDecodeRowsPerCta, splits);
  }
  if (threadIdx.x == 0) p.counters[row_block] = 0u;
}

// The epilogue of a cluster launch (plan.cluster; cluster = the row block's `splits` CTAs, rank =
// blockIdx.y): every CTA leaves its partial sums in shared memory, and after a cluster barrier
// each CTA finishes a share of the row block's (token, row) outputs, reading the splits' partials
// over distributed shared memory and summing them in split order: the global path's sums exactly.
// A second barrier keeps every CTA's shared memory alive until all reads are done.
template <DecodeWeightFormat F, int NT, PairKind kPair = PairKind::kNone>
__device__ __forceinline__ void finish_cluster(const DecodeGemvParams& p, const float (&acc)[NT][4], int64_t row0,
                                               int64_t row_base, int t, int splits) {
  __shared__ float partial[NT * 8 * kDecodeRowsPerCta];  // [token][row within the block]
  const int local0 = (int)(row0 - row_base);
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) partial[(8 * j + 2 * t + (e & 1)) * kDecodeRowsPerCta + local0 + 8 * (e >> 1)] = acc[j][e];
  const float alpha0 = alpha_eff<F>(p, 0);  // as in finish()
  auto alpha = [&](int token) { return p.x_amax_per_row ? alpha_eff<F>(p, token) : alpha0; };
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  const int rank = (int)cluster.block_rank();
  if constexpr (kPair != PairKind::kNone) {  // one (token, pair) a thread: its two rows' sums
    for (int i = rank * kThreads + (int)threadIdx.x; i < p.B * kPairsPerCta; i += splits * kThreads) {
      const int token = i / kPairsPerCta, q = i % kPairsPerCta, r = token * kDecodeRowsPerCta + decode_pair_row(q);
      const int idx[2] = {r, r + 8};
      float sum[2];
      cluster_split_sums(cluster, partial, idx, splits, sum);
      store_pair<kPair>(p, token, row_base / kDecodeRowsPerCta, q, formats::mul_rn(sum[0], alpha(token)),
                        formats::mul_rn(sum[1], alpha(token)));
    }
  } else {
    for (int i = rank * kThreads + (int)threadIdx.x; i < p.B * kDecodeRowsPerCta; i += splits * kThreads) {
      const int token = i / kDecodeRowsPerCta, local = i % kDecodeRowsPerCta;
      const int64_t row = row_base + local;
      if (row >= p.N) continue;
      const int idx[1] = {i};
      float sum[1];
      cluster_split_sums(cluster, partial, idx, splits, sum);
      store_y(p, token, row, formats::mul_rn(sum[0], alpha(token)));
    }
  }
  cluster.sync();
}

template <DecodeWeightFormat F>
__device__ __forceinline__ GemvShape gemv_shape(const DecodeGemvParams& p) {
  GemvShape sh;
  sh.N = p.N;
  sh.K = p.K;
  sh.vec_x = p.ldx % 8 == 0 && (reinterpret_cast<uintptr_t>(p.x) & 15) == 0;
  if constexpr (F == DecodeWeightFormat::kNvfp4) {
    sh.vec_w = ((p.K + 1) / 2) % 16 == 0 && (reinterpret_cast<uintptr_t>(p.w_data) & 15) == 0;
    sh.vec_s = ((p.K + 15) / 16) % 2 == 0 && (reinterpret_cast<uintptr_t>(p.w_scales) & 1) == 0;
  } else {
    sh.vec_w = p.ldw % 8 == 0 && (reinterpret_cast<uintptr_t>(p.w_bf16) & 15) == 0;
  }
  return sh;
}

// Batches above 16 tokens: x double-buffered per chunk, the next chunk's weights loaded while the
// current one is computed (one barrier per chunk).
template <DecodeWeightFormat F, bool kXF16, int NT>
__global__ void __launch_bounds__(kThreads) decode_gemv_kernel(const DecodeGemvParams p, int chunks,
                                                               int chunks_per_split, int splits) {
  __shared__ __align__(16) uint4 tile[2][NT * 8 * kPieces];
  const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t row_base = (int64_t)blockIdx.x * kDecodeRowsPerCta;
  const int64_t row0 = row_base + warp * 16 + g;
  const GemvShape sh = gemv_shape<F>(p);
  const int c_begin = (int)blockIdx.y * chunks_per_split;
  const int c_end = min(chunks, c_begin + chunks_per_split);

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

  WeightRegs<F> cur, next;
  XRegs<NT> xr;
  core::pdl_allow_dependents();
  load_weights(p, sh, row0, 8, t, (int64_t)c_begin * kDecodeChunk, cur);  // weights: no producer
  core::pdl_wait_for_producer();  // x, x_amax, the residual and y come from earlier kernels
  load_x<NT>(p, sh, (int64_t)c_begin * kDecodeChunk, xr);
  store_x<F, kXF16, NT>(xr, tile[0]);
  __syncthreads();
  for (int c = c_begin; c < c_end; ++c) {
    const int buf = (c - c_begin) & 1;
    const bool more = c + 1 < c_end;
    if (more) {
      load_weights(p, sh, row0, 8, t, (int64_t)(c + 1) * kDecodeChunk, next);
      load_x<NT>(p, sh, (int64_t)(c + 1) * kDecodeChunk, xr);
    }
    compute_chunk<kXF16, NT>(acc, cur, tile[buf], g, t);
    if (more) store_x<F, kXF16, NT>(xr, tile[buf ^ 1]);
    __syncthreads();
    cur = next;
  }

  finish<F, NT>(p, acc, row0, row_base, t, splits, (int)blockIdx.y, (int)blockIdx.x);
}

// Weight chunks a staged launch keeps in flight per thread (the register ring): NVFP4 holds 10
// registers per chunk, BF16 32.
template <DecodeWeightFormat F>
constexpr int kRingDepth = F == DecodeWeightFormat::kNvfp4 ? 4 : 2;

// Batches of up to 16 tokens (plan.staged): the loads of the first kRingDepth chunks' weights go
// out first, then x of the whole split is staged in shared memory (dynamic, chunks_per_split
// tiles), one barrier, and the chunks are computed with each ring slot reloaded kRingDepth chunks
// ahead as soon as it is consumed.
// kPair: a pair launch (a thread's two weight rows are one output pair's, "Pair launches" above).
// Pair launches are held to 3 CTAs an SM (at most 168 registers; they take 123-139), as the plain
// ones are by their own allocation (152-159): left alone, ptxas gave the pair kernels up to 213
// registers (2 CTAs an SM). Plain launches keep the unspecified minimum (0): an explicit 1 gives
// them 200-209 registers.
template <DecodeWeightFormat F, bool kXF16, int NT, PairKind kPair>
__global__ void __launch_bounds__(kThreads, kPair == PairKind::kNone ? 0 : 3) decode_gemv_staged_kernel(const DecodeGemvParams p, int chunks,
                                                                      int chunks_per_split, int splits,
                                                                      bool cluster) {
  extern __shared__ __align__(16) uint4 x_tiles[];  // [chunks_per_split][NT * 8 tokens][kPieces]
  constexpr int kTilePieces = NT * 8 * kPieces;
  constexpr int D = kRingDepth<F>;
  const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t row_base = (int64_t)blockIdx.x * kDecodeRowsPerCta;
  const int64_t row0 = row_base + warp * 16 + g;  // the output rows (partials)
  int64_t w_row0 = row0, w_step = 8;
  if constexpr (kPair != PairKind::kNone) {
    w_row0 = pair_base<kPair>(p, blockIdx.x) + warp * 8 + g;
    w_step = pair_step<kPair>(p);
  }
  const GemvShape sh = gemv_shape<F>(p);
  const int c_begin = (int)blockIdx.y * chunks_per_split;
  const int c_end = min(chunks, c_begin + chunks_per_split);

  WeightRegs<F> ring[D];
  core::pdl_allow_dependents();
#pragma unroll
  for (int d = 0; d < D; ++d) {
    if (c_begin + d < c_end) load_weights(p, sh, w_row0, w_step, t, (int64_t)(c_begin + d) * kDecodeChunk, ring[d]);
  }
  // The weights have no producer in the stream: their loads above overlap the kernel before (PDL);
  // x, x_amax, the residual and y belong to earlier kernels.
  core::pdl_wait_for_producer();
  stage_x<F, kXF16, NT>(p, sh, c_begin, c_end - c_begin, x_tiles);
  __syncthreads();

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  for (int c = c_begin; c < c_end; c += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      if (c + d < c_end) {
        compute_chunk<kXF16, NT>(acc, ring[d], x_tiles + (c + d - c_begin) * kTilePieces, g, t);
        if (c + d + D < c_end) load_weights(p, sh, w_row0, w_step, t, (int64_t)(c + d + D) * kDecodeChunk, ring[d]);
      }
    }
  }

  if (cluster) {
    finish_cluster<F, NT, kPair>(p, acc, row0, row_base, t, splits);
  } else {
    finish<F, NT, 32, kPair>(p, acc, row0, row_base, t, splits, (int)blockIdx.y, (int)blockIdx.x);
  }
}

// Launches `kernel` through core::launch_pdl (PDL unless `pdl` is false; with cluster_y > 1 as
// clusters of (1, cluster_y, 1) CTAs) and checks the launch.
template <typename... KernelArgs, typename... Args>
void launch_ex(void (*kernel)(KernelArgs...), dim3 grid, int threads, int smem_bytes, unsigned cluster_y,
               bool pdl, cudaStream_t stream, Args&&... args) {
  const core::PdlLaunch how{grid, dim3((unsigned)threads), (size_t)smem_bytes, cluster_y, pdl};
  FOURBIT_CUDA_CHECK(core::launch_pdl(how, stream, kernel, std::forward<Args>(args)...));
}

// A staged launch, as a cluster of plan.splits CTAs along grid.y when plan.cluster.
template <DecodeWeightFormat F, bool kXF16, int NT, PairKind kPair = PairKind::kNone>
void launch_staged(const DecodeGemvParams& p, const DecodeGemvPlan& plan, cudaStream_t stream) {
  // 32 KB of x (plan_decode_gemv) plus the cluster epilogue's static partials (16 KB at 64 tokens)
  // can pass the 48 KB that a launch may use without opting in.
  static const bool opted_in = [] {
    FOURBIT_CUDA_CHECK(cudaFuncSetAttribute(decode_gemv_staged_kernel<F, kXF16, NT, kPair>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024));
    return true;
  }();
  (void)opted_in;
  launch_ex(decode_gemv_staged_kernel<F, kXF16, NT, kPair>, dim3((unsigned)plan.row_blocks, (unsigned)plan.splits),
            kThreads, plan.x_smem_bytes, plan.cluster ? (unsigned)plan.splits : 1u, core::pdl_enabled(), stream, p, plan.chunks,
            plan.chunks_per_split, plan.splits, plan.cluster);
}

// A pair launch (1 or 2 n-tiles: at most kDecodePairMaxTokens tokens).
template <DecodeWeightFormat F, bool kXF16, PairKind kPair>
void launch_pairs(const DecodeGemvParams& p, const DecodeGemvPlan& plan, cudaStream_t stream) {
  if (plan.n_tiles == 1) {
    launch_staged<F, kXF16, 1, kPair>(p, plan, stream);
  } else {
    launch_staged<F, kXF16, 2, kPair>(p, plan, stream);
  }
}

template <DecodeWeightFormat F, bool kXF16>
void launch_typed(const DecodeGemvParams& p, const DecodeGemvPlan& plan, cudaStream_t stream) {
  const dim3 grid((unsigned)plan.row_blocks, (unsigned)plan.splits);
  // Pair launches: decode_gemv.cpp allows at most kDecodePairMaxTokens tokens, so staged.
  if (p.swiglu_half > 0) {
    launch_pairs<F, kXF16, PairKind::kSwiglu>(p, plan, stream);
    return;
  }
  if (p.rope_half > 0) {
    launch_pairs<F, kXF16, PairKind::kRope>(p, plan, stream);
    return;
  }
  if (plan.staged) {
    switch (plan.n_tiles) {
      case 1: launch_staged<F, kXF16, 1>(p, plan, stream); break;
      case 2: launch_staged<F, kXF16, 2>(p, plan, stream); break;
      case 4: launch_staged<F, kXF16, 4>(p, plan, stream); break;
      default: launch_staged<F, kXF16, 8>(p, plan, stream); break;
    }
    return;
  }
  auto kernel = plan.n_tiles == 1   ? decode_gemv_kernel<F, kXF16, 1>
                : plan.n_tiles == 2 ? decode_gemv_kernel<F, kXF16, 2>
                : plan.n_tiles == 4 ? decode_gemv_kernel<F, kXF16, 4>
                                    : decode_gemv_kernel<F, kXF16, 8>;
  launch_ex(kernel, grid, kThreads, 0, 1u, core::pdl_enabled(), stream, p, plan.chunks, plan.chunks_per_split, plan.splits);
}

// ---- activation quantization -------------------------------------------------------------------

constexpr int kQuantThreads = 256;

// One element into a thread's running amax; NaN and Inf set `bad` instead.
__device__ __forceinline__ void accumulate_amax(float& m, bool& bad, uint16_t bits) {
  const float a = formats::abs_f32(formats::decode_bf16(bits));
  if (!(a <= formats::kFloatMax)) {
    bad = true;
  } else {
    m = formats::fmax_ieee(m, a);
  }
}

// The CTA's maximum of the threads' running amaxes (returned in every thread); a `bad` thread ORs
// the non-finite flag when `report` is set.
__device__ float cta_amax(const DecodeQuantizeParams& p, float m, bool bad, bool report) {
  __shared__ float warp_max[kQuantThreads / 32];
  __shared__ float result;
  for (int off = 16; off > 0; off >>= 1) m = formats::fmax_ieee(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  if (bad && report && p.error_flags != nullptr) atomicOr(p.error_flags, quant::kDeviceErrNonFinite);
  __syncthreads();
  if (threadIdx.x == 0) {
    float b = 0.0f;
    for (int w = 0; w < kQuantThreads / 32; ++w) b = formats::fmax_ieee(b, warp_max[w]);
    result = b;
  }
  __syncthreads();
  return result;
}

// What produces the quantizer's input from x (DecodeQuantizeParams::norm_weight / swiglu).
enum class Producer { kNone, kNorm, kSwiglu };

// Element (r, c) as the quantizer sees it: x itself; (kNorm) the RMSNorm output
// bf16(f32(x * rstd[r]) * w[c]); or (kSwiglu) bf16(g * sigmoid(g) * u) with g = x[r, c] and
// u = x[r, K + c], sigmoid(g) = 1 / (1 + exp(-g)). Each computed as ops::rmsnorm_forward /
// ops::swiglu_forward compute it (same operations in the same order, no contraction possible).
template <Producer P>
__device__ __forceinline__ float quantizer_input(const DecodeQuantizeParams& p, int64_t r, int64_t c,
                                                 const float* rstd) {
  const float x = formats::decode_bf16(p.x[r * p.ldx + c]);
  if constexpr (P == Producer::kNone) {
    return x;
  } else if constexpr (P == Producer::kNorm) {
    return formats::decode_bf16(formats::encode_bf16_rn(x * rstd[r] * p.norm_weight[c]));
  } else {
    return formats::decode_bf16(swiglu_bits(x, formats::decode_bf16(p.x[r * p.ldx + p.K + c])));
  }
}

template <Producer P>
__global__ void __launch_bounds__(kQuantThreads) amax_partial_kernel(const DecodeQuantizeParams p) {
  static_assert(P != Producer::kNorm, "the fused norm runs in the single launch only");
  core::pdl_allow_dependents();
  core::pdl_wait_for_producer();
  const int64_t n = (int64_t)p.B * p.K;
  float m = 0.0f;
  bool bad = false;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    if constexpr (P == Producer::kNone) {
      accumulate_amax(m, bad, p.x[(i / p.K) * p.ldx + i % p.K]);
    } else {
      accumulate_amax(m, bad, formats::encode_bf16_rn(quantizer_input<P>(p, i / p.K, i % p.K, nullptr)));
    }
  }
  const float b = cta_amax(p, m, bad, true);
  if (threadIdx.x == 0) p.partials[blockIdx.x] = b;
}

// Quantizes x given the global amax (the reference's nvfp4_quantize_1d per 16-element block,
// round to nearest) and writes the scaled-domain values. Element-parallel: the 16 lanes of each
// half-warp own one block (lane l its element l); the block amax is a 16-lane max, and the Four
// Over Six errors are per-lane terms that every lane then sums in element order, so the result is
// the sequential reference's bit for bit. The CTA covers kQuantThreads / 16 consecutive blocks per
// round; rounds advance by gridDim.x such groups.
constexpr int kQuantBlocksPerCta = kQuantThreads / 16;

template <Producer P>
__device__ void quantize_x_elements(const DecodeQuantizeParams& p, float amax, const float* rstd) {
  const quant::Nvfp4TensorScales ts = quant::nvfp4_tensor_scales(amax, p.scale_constant, p.element_constant);
  const quant::FourOverSixTensorScales ts46 =
      quant::four_over_six_tensor_scales(amax, p.scale_constant, p.element_constant);
  const auto metric = (quant::FourOverSixMetric)p.four_over_six_metric;
  const int64_t n_blocks = (p.K + 15) / 16, total = (int64_t)p.B * n_blocks;
  const int e = (int)threadIdx.x % 16;
  // The loop bound is uniform over the warp (its two blocks are i and i + 1, both tested inside):
  // every lane reaches every shuffle.
  for (int64_t base = (int64_t)blockIdx.x * kQuantBlocksPerCta + threadIdx.x / 32 * 2; base < total;
       base += (int64_t)gridDim.x * kQuantBlocksPerCta) {
    const int64_t i = base + (threadIdx.x % 32) / 16;
    const int64_t r = i / n_blocks, c0 = (i % n_blocks) * 16;
    const int n = i < total ? (int)min((int64_t)16, p.K - c0) : 0;
    const bool valid = e < n;
    const float v = valid ? quantizer_input<P>(p, r, c0 + e, rstd) : 0.0f;
    float block_amax = formats::abs_f32(v);
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) {
      block_amax = formats::fmax_ieee(block_amax, __shfl_xor_sync(0xFFFFFFFFu, block_amax, off, 16));
    }
    uint8_t s = 0;
    float mult = 0.0f;
    if (!p.four_over_six) {
      s = quant::nvfp4_block_scale(block_amax, ts);
      mult = quant::nvfp4_element_multiplier(s, ts);
    } else {
      const quant::FourOverSixScalePair pair = quant::four_over_six_scales(block_amax, ts46);
      const uint8_t cand[2] = {pair.map6, pair.map4};
      float err[2] = {0.0f, 0.0f};
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const uint8_t q =
            quant::four_over_six_encode_element(v, quant::four_over_six_multiplier(cand[k], ts46), false, 0u);
        const float term =
            quant::four_over_six_error_term(quant::four_over_six_dequantize_element(q, cand[k], ts46), v, metric);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const float tj = __shfl_sync(0xFFFFFFFFu, term, j, 16);
          if (j < n) err[k] = quant::four_over_six_combine_errors(err[k], tj, metric);
        }
      }
      s = err[1] < err[0] ? pair.map4 : pair.map6;
      mult = quant::four_over_six_multiplier(s, ts46);
    }
    if (valid) {
      const uint8_t q = p.four_over_six ? quant::four_over_six_encode_element(v, mult, false, 0u)
                                        : quant::nvfp4_encode_element(v, mult, false, 0u);
      p.xs[r * p.K + c0 + e] = formats::encode_bf16_rn(formats::mul_rn(formats::decode_e2m1(q), formats::decode_e4m3(s)));
    }
  }
}

// Grid size of the quantization pass: one CTA per kQuantBlocksPerCta blocks, at most 1024.
inline int quantize_ctas(const DecodeQuantizeParams& p) {
  const int64_t blocks = (int64_t)p.B * ((p.K + 15) / 16);
  return (int)std::clamp<int64_t>((blocks + kQuantBlocksPerCta - 1) / kQuantBlocksPerCta, 1, 1024);
}

template <Producer P>
__global__ void __launch_bounds__(kQuantThreads) quantize_x_kernel(const DecodeQuantizeParams p, int n_partials) {
  __shared__ float s_amax;
  core::pdl_allow_dependents();
  core::pdl_wait_for_producer();
  if (threadIdx.x < 32) {  // n_partials <= kDecodeAmaxPartials = 64: two per lane, then a warp max
    float m = 0.0f;
    for (int i = (int)threadIdx.x; i < n_partials; i += 32) m = formats::fmax_ieee(m, p.partials[i]);
    for (int off = 16; off > 0; off >>= 1) m = formats::fmax_ieee(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
    if (threadIdx.x == 0) {
      s_amax = m;
      if (blockIdx.x == 0) *p.amax_out = m;
    }
  }
  __syncthreads();
  quantize_x_elements<P>(p, s_amax, nullptr);
}

// Small activations (B * K <= kRedundantAmaxElements): one launch. Every CTA reduces the global
// amax of the whole x itself (at most 32 KB, read from L2 with 16-byte loads, four in flight per
// thread) and then quantizes its own blocks. The amax is a max: the same value in every CTA,
// whatever the order.
constexpr int64_t kRedundantAmaxElements = 16384;
static_assert(kDecodeFusedNormElements <= kRedundantAmaxElements, "the fused norm runs in the single launch");

// kNorm: the RMSNorm of every row first, replaying ops::rmsnorm_forward's block reduction. That
// kernel runs a block of T = norm_threads threads per row; its thread t sums the squares of its
// groups j * T + t (8 columns each, j < norm_groups) in one FMA chain from zero, each warp sums by
// an xor tree (ops::kernels::warp_sum), and the T / 32 warp sums are added in order from zero
// (ops::kernels::block_sum). Here the (row, t) pairs are spread over the CTA, pair P = r * T + t
// on thread P % kQuantThreads: T is a multiple of 32, so each warp holds whole virtual warps and
// its xor tree is theirs. Every thread issues all its loads first (at most kNormPairsPerThread
// pairs: decode_quantize_can_fuse_norm), then sums; thread r < B adds row r's warp sums.
constexpr int kNormPairsPerThread = 8;
static_assert(kNormPairsPerThread * kQuantThreads == kDecodeFusedNormPairs, "decode_quantize_can_fuse_norm's bound");

__device__ __forceinline__ uint4 load_x8(const uint16_t* at) {
  if ((reinterpret_cast<uintptr_t>(at) & 15) == 0) return __ldg(reinterpret_cast<const uint4*>(at));
  return load_bf16x8_tail(at, 0, 8);  // misaligned row: element by element, all 8 present
}

__device__ __forceinline__ float element_of(const uint4& v, int e) {
  const uint32_t w = word(v, e / 2);
  return formats::decode_bf16((uint16_t)(e % 2 ? w >> 16 : w & 0xFFFFu));
}

// One (row, thread) pair's share of ops::rmsnorm_forward's sum of squares: its J groups of 8
// columns in one FMA chain from zero, then the warp's xor tree (every lane gets the warp's sum).
__device__ __forceinline__ float norm_pair_sum(const uint4 (&xv)[2], int J) {
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    if (j >= J) break;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float v = element_of(xv[j], e);
      ss = fmaf(v, v, ss);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xFFFFFFFFu, ss, o);
  return ss;
}

// Row r's 1 / rms from its T / 32 warp sums, added in order from zero (ops::rmsnorm_forward).
__device__ __forceinline__ float norm_row_rstd(const float* warp_sums, int r, int T, int64_t K, float eps) {
  float total = 0.0f;
  for (int v = 0; v < T / 32; ++v) total += warp_sums[r * (T / 32) + v];
  return 1.0f / sqrtf(total / (float)K + eps);
}

__device__ void norm_rows(const DecodeQuantizeParams& p, float* rstd, float* warp_sums, float& m, bool& bad) {
  const int T = p.norm_threads, J = p.norm_groups, tid = (int)threadIdx.x, lane = tid % 32;
  const int pairs = p.B * T;
  uint4 xv[kNormPairsPerThread][2];
#pragma unroll
  for (int i = 0; i < kNormPairsPerThread; ++i) {
    const int P = tid + i * kQuantThreads;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      xv[i][j] = make_uint4(0, 0, 0, 0);
      const int64_t c = (int64_t)(j * T + P % T) * 8;
      if (P < pairs && j < J && c < p.K) xv[i][j] = load_x8(p.x + (int64_t)(P / T) * p.ldx + c);
    }
  }
#pragma unroll
  for (int i = 0; i < kNormPairsPerThread; ++i) {
    const int P = tid + i * kQuantThreads;
    if (i * kQuantThreads >= pairs) break;  // uniform over the CTA
    const float ss = norm_pair_sum(xv[i], J);
    if (lane == 0 && P < pairs) warp_sums[P / 32] = ss;
  }
  __syncthreads();
  if (tid < p.B) rstd[tid] = norm_row_rstd(warp_sums, tid, T, p.K, p.norm_eps);
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kNormPairsPerThread; ++i) {
    const int P = tid + i * kQuantThreads;
    if (P >= pairs) break;
    const float rs = rstd[P / T];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int64_t c = (int64_t)(j * T + P % T) * 8;
      if (j >= J || c >= p.K) break;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        accumulate_amax(m, bad, formats::encode_bf16_rn(element_of(xv[i][j], e) * rs * p.norm_weight[c + e]));
      }
    }
  }
}

// With per_row_amax, blockIdx.y picks a row and the CTA solves that row alone
// (decode_quantize_row).
template <Producer P>
__global__ void __launch_bounds__(kQuantThreads) quantize_x_redundant_amax_kernel(const DecodeQuantizeParams p_all) {
  const DecodeQuantizeParams p = p_all.per_row_amax ? decode_quantize_row(p_all, (int)blockIdx.y) : p_all;
  __shared__ float rstd[P == Producer::kNorm ? kDecodeMaxTokens : 1];
  __shared__ float warp_sums[P == Producer::kNorm ? kNormPairsPerThread * kQuantThreads / 32 : 1];
  core::pdl_allow_dependents();
  core::pdl_wait_for_producer();
  float m = 0.0f;
  bool bad = false;
  if constexpr (P == Producer::kNorm) {
    norm_rows(p, rstd, warp_sums, m, bad);
  } else if constexpr (P == Producer::kSwiglu) {
    if (p.K % 8 == 0 && p.ldx % 8 == 0 && (reinterpret_cast<uintptr_t>(p.x) & 15) == 0) {
      // Gate and up as 16-byte loads, four pairs in flight per thread.
      const int64_t per_row = p.K / 8, total = (int64_t)p.B * per_row;
      for (int64_t i0 = threadIdx.x; i0 < total; i0 += 4 * kQuantThreads) {
        uint4 g[4], u[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int64_t i = i0 + k * kQuantThreads;
          g[k] = u[k] = make_uint4(0, 0, 0, 0);  // swiglu(0, 0) = 0 leaves the amax as it is
          if (i < total) {
            const uint16_t* row = p.x + (i / per_row) * p.ldx + (i % per_row) * 8;
            g[k] = __ldg(reinterpret_cast<const uint4*>(row));
            u[k] = __ldg(reinterpret_cast<const uint4*>(row + p.K));
          }
        }
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
          for (int e = 0; e < 8; ++e) accumulate_amax(m, bad, swiglu_bits(element_of(g[k], e), element_of(u[k], e)));
      }
    } else {
      for (int64_t i = threadIdx.x; i < (int64_t)p.B * p.K; i += kQuantThreads) {
        accumulate_amax(m, bad, formats::encode_bf16_rn(quantizer_input<P>(p, i / p.K, i % p.K, nullptr)));
      }
    }
  } else if (p.K % 8 == 0 && p.ldx % 8 == 0 && (reinterpret_cast<uintptr_t>(p.x) & 15) == 0) {
    const int64_t per_row = p.K / 8, total = (int64_t)p.B * per_row;
    for (int64_t i0 = threadIdx.x; i0 < total; i0 += 4 * kQuantThreads) {
      uint4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int64_t i = i0 + u * kQuantThreads;
        v[u] = i < total ? __ldg(reinterpret_cast<const uint4*>(p.x + (i / per_row) * p.ldx + (i % per_row) * 8))
                         : make_uint4(0, 0, 0, 0);  // zeros leave the amax as it is
      }
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          accumulate_amax(m, bad, (uint16_t)(word(v[u], w) & 0xFFFFu));
          accumulate_amax(m, bad, (uint16_t)(word(v[u], w) >> 16));
        }
    }
  } else {
    for (int r = 0; r < p.B; ++r) {
      const uint16_t* row = p.x + (int64_t)r * p.ldx;
      for (int64_t c = threadIdx.x; c < p.K; c += blockDim.x) accumulate_amax(m, bad, row[c]);
    }
  }
  const float amax = cta_amax(p, m, bad, blockIdx.x == 0);  // every CTA saw the same x: one report
  if (blockIdx.x == 0 && threadIdx.x == 0) *p.amax_out = amax;
  quantize_x_elements<P>(p, amax, rstd);
}

// ---- decode chain (decode_gemv_kernels.h) -------------------------------------------------------

// Grid-wide barrier of the chain's persistent grid: thread 0 of each CTA arrives on bar[0]; the last
// to arrive resets it and advances the generation bar[1], which the others poll. The fences before
// the arrival and after the release make every CTA's writes of the link visible to every CTA after.
__device__ __forceinline__ void chain_grid_barrier(unsigned* bar) {
  __syncthreads();
  if (threadIdx.x == 0) {
    volatile unsigned* generation = bar + 1;
    const unsigned gen = *generation;  // cannot advance before this CTA arrives
    __threadfence();
    if (atomicAdd(bar, 1u) == gridDim.x - 1) {
      atomicExch(bar, 0u);
      __threadfence();
      atomicAdd(bar + 1, 1u);
    } else {
      while (*generation == gen) __nanosleep(32);
    }
    __threadfence();
  }
  __syncthreads();
}

// The rows' 1 / rms of a kNorm link, in ops::rmsnorm_forward's order (as norm_rows replays it for
// the quantizer, here on the chain's kThreads threads): pair P = r * T + t on thread P % kThreads,
// each pair's squares summed in one FMA chain over its groups j * T + t (8 columns each), the xor
// tree of the warp (T is a multiple of 32: a warp holds one virtual warp), then row r's T / 32 warp
// sums in order from zero. x is read through L2 (an earlier link of this launch wrote it); four
// pairs' loads are in flight at a time (the weight ring holds most registers).
__device__ void chain_norm_rstd(const DecodeChainLink& k, float* rstd, float* warp_sums) {
  const int T = k.norm_threads, J = k.norm_groups, B = k.g.B, tid = (int)threadIdx.x, lane = tid % 32;
  const int64_t K = k.g.K;
  const int pairs = B * T;
  constexpr int kBatch = 4;
  for (int P0 = 0; P0 < pairs; P0 += kBatch * kThreads) {
    uint4 xv[kBatch][2];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int P = P0 + tid + i * kThreads;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int64_t c = (int64_t)(j * T + P % T) * 8;
        xv[i][j] = P < pairs && j < J && c < K
                       ? __ldcg(reinterpret_cast<const uint4*>(k.g.x + (int64_t)(P / T) * k.g.ldx + c))
                       : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int P = P0 + tid + i * kThreads;
      if (P0 + i * kThreads >= pairs) break;  // uniform over the CTA
      const float ss = norm_pair_sum(xv[i], J);
      if (lane == 0 && P < pairs) warp_sums[P / 32] = ss;
    }
  }
  __syncthreads();
  if (tid < B) rstd[tid] = norm_row_rstd(warp_sums, tid, T, K, k.norm_eps);
  __syncthreads();
}

// One 16-byte piece of a link's x (elements e .. e + 7 of `token`) as its producer makes it; the
// host checked K % 8 == 0 and 16-byte aligned rows (decode_chain_supported), so a piece is all in
// or all out.
__device__ __forceinline__ uint4 chain_x_piece(const DecodeChainLink& k, const float* rstd, int token, int64_t e) {
  uint4 v = make_uint4(0, 0, 0, 0);
  if (token >= k.g.B || e >= k.g.K) return v;
  const uint16_t* row = k.g.x + token * k.g.ldx;
  const uint4 a = __ldcg(reinterpret_cast<const uint4*>(row + e));
  if (k.producer == DecodeChainProducer::kNone) return a;
  if (k.producer == DecodeChainProducer::kNorm) {
    const float rs = rstd[token];
    float w[8];  // the norm weight need not be 16-byte aligned (a slice of the parameter buffer)
#pragma unroll
    for (int j = 0; j < 8; ++j) w[j] = __ldg(k.norm_weight + e + j);
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // ops::rmsnorm_forward's bf16(f32(x * rstd) * w)
      const uint32_t lo = formats::encode_bf16_rn(element_of(a, 2 * q) * rs * w[2 * q]);
      const uint32_t hi = formats::encode_bf16_rn(element_of(a, 2 * q + 1) * rs * w[2 * q + 1]);
      word(v, q) = lo | (hi << 16);
    }
    return v;
  }
  const uint4 u = __ldcg(reinterpret_cast<const uint4*>(row + k.g.K + e));  // kSwiglu: the up half
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t lo = swiglu_bits(element_of(a, 2 * q), element_of(u, 2 * q));
    const uint32_t hi = swiglu_bits(element_of(a, 2 * q + 1), element_of(u, 2 * q + 1));
    word(v, q) = lo | (hi << 16);
  }
  return v;
}

// Item `item` of a link: its row block, its split, and the chunks c_begin .. c_begin + n - 1 of K.
struct ChainItem {
  int row_block, split, c_begin, n;
};
__device__ __forceinline__ ChainItem chain_item(const DecodeChainLink& k, int item) {
  ChainItem it;
  it.row_block = item / k.splits;
  it.split = item % k.splits;
  it.c_begin = it.split * k.chunks_per_split;
  it.n = min(k.chunks, it.c_begin + k.chunks_per_split) - it.c_begin;
  return it;
}

// This CTA's items in stream order: items blockIdx.x, + gridDim.x, ... of link 0, then of link 1,
// and so on. From (link, item) to the CTA's next (link, item); link == n_links past the last.
__device__ __forceinline__ void chain_next_item(const DecodeChainParams& p, int& link, int& item) {
  item += (int)gridDim.x;
  while (link < p.n_links && item >= p.links[link].row_blocks * p.links[link].splits) {
    ++link;
    item = (int)blockIdx.x;
  }
}

// Where a CTA's weight stream stands: chunk `c` of its item `item` of link `link` (it: that item).
// Items are padded to a multiple of the ring depth D (positions it.n .. pad - 1 load nothing) so
// that chunk c of every item sits in ring slot c % D.
template <int D>
struct ChainCursor {
  int link = 0, item = 0, c = 0, pad = 0;
  ChainItem it{};

  __device__ __forceinline__ void settle(const DecodeChainParams& p) {
    c = 0;
    if (link < p.n_links) {
      it = chain_item(p.links[link], item);
      pad = (it.n + D - 1) / D * D;
    }
  }
  __device__ __forceinline__ void start(const DecodeChainParams& p) {
    link = 0;
    item = (int)blockIdx.x - (int)gridDim.x;
    chain_next_item(p, link, item);
    settle(p);
  }
  __device__ __forceinline__ void advance(const DecodeChainParams& p) {
    if (++c == pad) {
      chain_next_item(p, link, item);
      settle(p);
    }
  }
  // The weights of the current position into `slot` (nothing past the end or in the padding).
  template <DecodeWeightFormat F>
  __device__ __forceinline__ void load(const DecodeChainParams& p, int warp, int g, int t, WeightRegs<F>& slot) const {
    if (link >= p.n_links || c >= it.n) return;
    const DecodeChainLink& k = p.links[link];
    const int64_t row0 = (int64_t)it.row_block * kDecodeRowsPerCta + warp * 16 + g;
    load_weights(k.g, gemv_shape<F>(k.g), row0, 8, t, (int64_t)(it.c_begin + c) * kDecodeChunk, slot);
  }
};

// L2 prefetches (no registers, nothing a fence waits for) of the first p.prefetch_chunks chunks
// of this CTA's item after (link, item), which may lie in a later link. One 128-byte line a thread
// and chunk: BF16 rows are 256 bytes a chunk (two threads a row), NVFP4 rows 64 bytes of data
// (threads 0-63) and 8 of scales (threads 64-127).
template <DecodeWeightFormat F>
__device__ __forceinline__ void chain_prefetch_next(const DecodeChainParams& p, int link, int item) {
  chain_next_item(p, link, item);
  if (link >= p.n_links) return;
  const DecodeChainLink& k = p.links[link];
  const ChainItem it = chain_item(k, item);
  const int64_t row = (int64_t)it.row_block * kDecodeRowsPerCta + (int)threadIdx.x % kDecodeRowsPerCta;
  const int part = (int)threadIdx.x / kDecodeRowsPerCta;
  if (row >= k.g.N) return;
  for (int c = it.c_begin; c < it.c_begin + min(it.n, p.prefetch_chunks); ++c) {
    const int64_t k0 = (int64_t)c * kDecodeChunk;
    const void* at;
    if constexpr (F == DecodeWeightFormat::kNvfp4) {
      at = part == 0 ? (const void*)(k.g.w_data + row * ((k.g.K + 1) / 2) + k0 / 2)
                     : (const void*)(k.g.w_scales + row * ((k.g.K + 15) / 16) + k0 / 16);
    } else {
      at = k.g.w_bf16 + row * k.g.ldw + min(k0 + 64 * part, k.g.K - 1);
    }
    asm volatile("prefetch.global.L2 [%0];" ::"l"(at));
  }
}

// The chain (decode_gemv_kernels.h): links in order with a grid barrier between them; the weight
// ring runs D chunks ahead over items and links alike (ChainCursor), and (prefetch_chunks) each CTA
// prefetches its next item's first chunks into L2 as it starts an item, so that the ring's loads of
// them hit L2 while the CTA finishes its item, sums split partials and waits at a barrier (its
// fences wait for the ring's loads: without the prefetch those came from HBM with nothing else in
// flight). ring_per_item: the ring's loads of an item's first chunks wait for the item's start
// (after the previous finish and barrier, L2 hits after the prefetch) instead, so that no fence
// waits for them. The cursor visits the same positions in the same order either way.
template <DecodeWeightFormat F>
__global__ void __launch_bounds__(kThreads, 3) decode_chain_kernel(const __grid_constant__ DecodeChainParams p) {
  extern __shared__ __align__(16) uint4 x_tiles[];  // [chunks_per_split][8 tokens][kPieces]
  __shared__ float rstd[kDecodeChainMaxTokens];
  __shared__ float warp_sums[kDecodeChainMaxNormWarps];
  constexpr int kTilePieces = 8 * kPieces;
  constexpr int D = kRingDepth<F>;
  const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32, g = lane / 4, t = lane % 4;

  WeightRegs<F> ring[D];
  ChainCursor<D> loads;
  loads.start(p);
  if (p.prefetch_chunks > 0) chain_prefetch_next<F>(p, 0, (int)blockIdx.x - (int)gridDim.x);  // the first item
#pragma unroll
  for (int d = 0; d < D; ++d) {
    loads.template load<F>(p, warp, g, t, ring[d]);
    loads.advance(p);
  }
  core::pdl_wait_for_producer();  // x and the residuals of the first link come from earlier kernels

  bool ring_ready = true;  // the ring holds the current item's first D chunks (or their loads are out)
  for (int L = 0; L < p.n_links; ++L) {
    if (L > 0) {
      chain_grid_barrier(p.barrier);
      // Every CTA has arrived, so all are resident: a dependent kernel launched now (PDL) cannot
      // take the place of a CTA that the barrier waits for.
      if (L == 1) core::pdl_allow_dependents();
    }
    const DecodeChainLink& k = p.links[L];
    const int items = k.row_blocks * k.splits;
    bool have_rstd = false;
    for (int item = (int)blockIdx.x; item < items; item += (int)gridDim.x) {
      const ChainItem it = chain_item(k, item);
      const int n = it.n;
      const int64_t row_base = (int64_t)it.row_block * kDecodeRowsPerCta, row0 = row_base + warp * 16 + g;
      if (p.prefetch_chunks > 0) chain_prefetch_next<F>(p, L, item);
      if (!ring_ready) {  // ring_per_item: this item's first chunks, deferred past the previous finish
#pragma unroll
        for (int d = 0; d < D; ++d) {
          loads.template load<F>(p, warp, g, t, ring[d]);
          loads.advance(p);
        }
        ring_ready = true;
      }
      __syncthreads();  // the previous item is done with the x tiles
      if (k.producer == DecodeChainProducer::kNorm && !have_rstd) {
        chain_norm_rstd(k, rstd, warp_sums);
        have_rstd = true;
      }
      stage_x_with<F, false, 1>([&](int token, int64_t e) { return chain_x_piece(k, rstd, token, e); }, it.c_begin,
                                n, x_tiles);
      __syncthreads();
      float acc[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
      const int pad = (n + D - 1) / D * D;  // the item's positions in the cursor's stream
      for (int c0 = 0; c0 < n; c0 += D) {
#pragma unroll
        for (int d = 0; d < D; ++d) {
          if (c0 + d < n) compute_chunk<false, 1>(acc, ring[d], x_tiles + (c0 + d) * kTilePieces, g, t);
          // Position c0 + d + D: this item's (a chunk or padding) or, from pad on, the next item's.
          if (!p.ring_per_item || c0 + d + D < pad) {
            loads.template load<F>(p, warp, g, t, ring[d]);
            loads.advance(p);
          }
        }
      }
      finish<F, 1, kDecodeChainMaxTokens * kDecodeRowsPerCta / kThreads>(k.g, acc, row0, row_base, t, k.splits,
                                                                         it.split, it.row_block);
      ring_ready = !p.ring_per_item;
    }
  }
}

}  // namespace

void launch_decode_gemv(const DecodeGemvParams& p, const DecodeGemvPlan& plan, cudaStream_t stream) {
  if (p.format == DecodeWeightFormat::kBf16) {
    launch_typed<DecodeWeightFormat::kBf16, false>(p, plan, stream);
  } else if (p.x_amax != nullptr) {
    launch_typed<DecodeWeightFormat::kNvfp4, true>(p, plan, stream);
  } else {
    launch_typed<DecodeWeightFormat::kNvfp4, false>(p, plan, stream);
  }
}

void launch_decode_quantize_x(const DecodeQuantizeParams& p, cudaStream_t stream) {
  const bool pdl = core::pdl_enabled() && core::pdl_setting() != "no-quant";
  if (p.per_row_amax) {
    if (p.norm_weight != nullptr || p.K <= kRedundantAmaxElements) {
      // One launch: blockIdx.y = the row, each row's CTAs as for a one-row tensor.
      const dim3 grid((unsigned)quantize_ctas(decode_quantize_row(p, 0)), (unsigned)p.B);
      const auto kernel = p.norm_weight != nullptr ? quantize_x_redundant_amax_kernel<Producer::kNorm>
                          : p.swiglu               ? quantize_x_redundant_amax_kernel<Producer::kSwiglu>
                                                   : quantize_x_redundant_amax_kernel<Producer::kNone>;
      launch_ex(kernel, grid, kQuantThreads, 0, 1u, pdl, stream, p);
      return;
    }
    // Rows longer than the single launch takes: the two-launch path, one row at a time.
    for (int b = 0; b < p.B; ++b) launch_decode_quantize_x(decode_quantize_row(p, b), stream);
    return;
  }
  const int64_t n = (int64_t)p.B * p.K;
  const dim3 grid((unsigned)quantize_ctas(p));
  if (p.norm_weight != nullptr) {  // decode_gemv.cpp checked the fused norm's conditions
    launch_ex(quantize_x_redundant_amax_kernel<Producer::kNorm>, grid, kQuantThreads, 0, 1u, pdl, stream, p);
    return;
  }
  const bool swiglu = p.swiglu;
  if (n <= kRedundantAmaxElements) {
    launch_ex(swiglu ? quantize_x_redundant_amax_kernel<Producer::kSwiglu> : quantize_x_redundant_amax_kernel<Producer::kNone>,
              grid, kQuantThreads, 0, 1u, pdl, stream, p);
    return;
  }
  const int amax_ctas = (int)std::clamp<int64_t>((n + kQuantThreads * 8 - 1) / (kQuantThreads * 8), 1,
                                                  kDecodeAmaxPartials);
  launch_ex(swiglu ? amax_partial_kernel<Producer::kSwiglu> : amax_partial_kernel<Producer::kNone>,
            dim3((unsigned)amax_ctas), kQuantThreads, 0, 1u, pdl, stream, p);
  launch_ex(swiglu ? quantize_x_kernel<Producer::kSwiglu> : quantize_x_kernel<Producer::kNone>, grid, kQuantThreads,
            0, 1u, pdl, stream, p, amax_ctas);
}

int launch_decode_chain(const DecodeChainParams& c, DecodeWeightFormat format, int per_sm, cudaStream_t stream) {
  int smem = 0;
  for (int i = 0; i < c.n_links; ++i) smem = std::max(smem, c.links[i].chunks_per_split * kDecodeXTileBytes);
  auto kernel = format == DecodeWeightFormat::kNvfp4 ? decode_chain_kernel<DecodeWeightFormat::kNvfp4>
                                                     : decode_chain_kernel<DecodeWeightFormat::kBf16>;
  // CTAs an SM holds, by (device, kernel, shared memory): asked once, not at every launch.
  int device = 0;
  FOURBIT_CUDA_CHECK(cudaGetDevice(&device));
  thread_local std::map<std::tuple<int, const void*, int>, int> occupancies;
  int& occupancy = occupancies[{device, reinterpret_cast<const void*>(kernel), smem}];
  if (occupancy == 0) {
    FOURBIT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occupancy, kernel, kThreads, smem));
    if (occupancy < 1) {
      throw Error("decode chain: no CTA of " + std::to_string(smem) + " bytes of shared memory fits an SM");
    }
  }
  const int grid = current_device_sm_count() * (per_sm > 0 ? std::min(per_sm, occupancy) : occupancy);
  launch_ex(kernel, dim3((unsigned)grid), kThreads, smem, 1u, core::pdl_enabled(), stream, c);
  return grid;
}

}  // namespace fourbit::gemm::kernels
