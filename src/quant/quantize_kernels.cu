// Fused CUDA quantizers: one pass over a BF16/FP32 source writes the row-wise and column-wise
// copies (packed values + scales, and/or the scaled-domain BF16 that the exact Hopper GEMM
// emulation consumes), with optional RHT and stochastic rounding. All arithmetic comes from
// block_math.h / formats/element.h, so results equal the CPU reference (reference.cpp) bit for bit.
//
// Structure (per CTA, one tile of kTileRows x kTileCols source elements):
//   1. the tile is loaded into shared memory with 16-byte loads;
//   2. "micro-blocks" of 16 elements are the unit of work: a row micro-block is 16 consecutive
//      elements of a row (blocks along K), a column micro-block 16 consecutive rows of one
//      column (blocks along M; for BF16 sources a thread takes two adjacent columns so that its
//      shared-memory reads are 4 bytes wide). Scale blocks of 32 (MXFP8) or 128 (FP8) elements,
//      16x16 (NVFP4 2D) or 128x128 (FP8 2D) tiles combine the micro-block amaxes through shared
//      memory; NVFP4 1D needs no second phase;
//   3. each micro-block is encoded and written: 8 bytes of packed FP4 or 16 bytes of E4M3, one
//      scale, and optionally 32 bytes of BF16.
// NVFP4 and FP8-tensor need the global amax before encoding: amax_kernel computes it (and the
// post-RHT column-wise amax) in a separate pass unless the caller supplies it.
// Non-finite inputs set bit 0 of the error flag; MXFP8 scaled-domain BF16 with a scale code
// outside [3, 246] (not exact in BF16) sets bit 1.
//
// Performance model (H200, 16384 x 8192 BF16 source = 134 M elements; bench/notes-quant-kernels.md
// keeps the measurements). NVFP4 1x16 row + column moves 2 B/element in and 2 x (0.5 + 1/16)
// B/element out = 419 MB, 0.10 ms at the 4.22 TB/s copy rate (the global-amax pass reads the
// source once more: 0.16 ms in all). Arithmetic, from the sm_90a SASS: the round-to-nearest E2M1
// encoder is ~9 instructions per element and orientation (FMUL, FMNMX, VIMNMX, SHF, IMAD, FADD,
// SHF, LOP3, a pack), plus ~1 BF16 unpack, ~0.6 for the block amax on BF16 pairs and ~2-3 per
// element for the per-block scale (E4M3 cvt, correctly rounded reciprocal), addresses and
// stores: ~14 x 2 orientations x 134 M / 32 = 117 M warp instructions, 0.11 ms at the full issue
// rate (132 SMs x 4 schedulers x 1.98 GHz), and half of them run on the half-rate ALU pipe, so
// the compute floor is about the memory floor. The measured 0.228 ms (amax given) is neither: a
// CTA loads its 16 KB tile, waits, computes, writes, with nothing in flight during its compute
// phase and a ~200-cycle dependent chain per micro-block (amax tree, E4M3 scale, reciprocal,
// encode), with at most 4 CTAs (32 warps) per SM. Persistent CTAs that prefetch the next tile
// with cp.async were tried and measured slower (bench/notes-quant-kernels.md).
// Writing scaled-domain BF16 costs per element one E2M1 decode (e2m1_value, branch-free), one
// FMUL and half a cvt.rn.bf16x2: the generic decode and software BF16 rounding used before cost
// ~17 instructions per element and were a third of the streaming kernel's time.
// Gradients (row SR + column RHT SR) add per 16 elements one Philox-4x32-10 (~100
// instructions) per orientation, the SR encoder (~15 per element) and, column-wise, the 16-point
// Walsh-Hadamard butterfly (64 FADD, 16 FMUL, 8 BF16x2 conversions): ~50 instructions per element
// in all, about 0.2 ms of issue. Four Over Six row-wise encodes each block three times and
// dequantizes two candidates, each divided by the constant C: the reciprocal and one FMA
// correction (four_over_six_div_constant, proven equal to div_rn; ~6 instructions with its range
// test) instead of div_rn (~10 and a slow-path branch); both candidates in one loop.
// Launches: every kernel but fill_normal is launched with programmatic dependent launch
// (core/pdl.cuh) and waits for its producer before anything else, so only its launch and CTA
// placement overlap the tail of the kernel before it (amax pass -> quantizer, one operand's
// quantizer -> the next one's); FOURBIT_PDL=0 turns it off for A/B runs.
#include "quant/quantize_kernels.h"

#include "core/fill.h"
#include "quant/amax_device.cuh"
#include "quant/scaled_bf16_device.cuh"

#include "core/sm_count.h"
#include "core/env.h"
#include "core/error.h"
#include "core/pdl.cuh"
#include "formats/element.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace fourbit::quant {
namespace {

using formats::abs_f32;
using formats::f32_bits;
using formats::f32_from_bits;
using kernels::DequantParams;
using kernels::OrientationOut;
using kernels::Params;
using kernels::kErrMxfp8NotExact;
using kernels::kErrNonFinite;

constexpr int kThreads = 256;

template <typename InT>
__device__ __forceinline__ float load_as_float(const InT* p);
template <>
__device__ __forceinline__ float load_as_float<float>(const float* p) { return *p; }
template <>
__device__ __forceinline__ float load_as_float<uint16_t>(const uint16_t* p) {
  return __uint_as_float((uint32_t)*p << 16);
}

__device__ __forceinline__ uint16_t e4m3x2(float lo, float hi) {
  uint16_t d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
}

// --- per-format encoding of one 16-element micro-block ------------------------------------------

struct Nvfp4Tensor {
  Nvfp4TensorScales ts;
  FourOverSixTensorScales ts46;
};

__device__ __forceinline__ Nvfp4Tensor nvfp4_tensor(const Params& p, const float* amax_ptr) {
  const float amax = *amax_ptr;
  return {nvfp4_tensor_scales(amax, p.nvfp4_scale_constant, p.nvfp4_element_constant),
          four_over_six_tensor_scales(amax, p.nvfp4_scale_constant, p.nvfp4_element_constant)};
}

// 16 random bytes for the micro-block starting at stored element `index` (a multiple of 16).
__device__ __forceinline__ Philox4x32Result micro_block_bits(const RandomStream& s, uint64_t index) {
  return s.block(index >> 4);
}
__device__ __forceinline__ uint32_t rbyte(const Philox4x32Result& r, int i) {
  return (r.v[i >> 2] >> (8 * (i & 3))) & 0xFFu;
}

// One E2M1 code of x * mult: formats' short encoders (tested equal to the generic ones).
// Four Over Six's zero multiplier (scale 0) gives +0, as four_over_six_encode_element.
__device__ __forceinline__ uint32_t e2m1_code(float x, float mult, bool four_over_six,
                                              bool stochastic, uint32_t rbits8) {
  const float y = formats::mul_rn(x, mult);
  const uint32_t q = stochastic ? formats::encode_e2m1_sr_not_nan(y, rbits8)
                                : formats::encode_e2m1_rn_not_nan(y);
  return four_over_six && mult == 0.0f ? 0u : q;
}

// Encodes 16 values with an NVFP4 scale already chosen; returns the packed 8 bytes. The rounding
// is decided once per micro-block (kStochastic): a run-time flag tested per element left one
// branch per element in the PTX, so the 16 independent encodes could not be interleaved.
template <bool kStochastic>
__device__ __forceinline__ uint2 nvfp4_encode16_as(const float v[16], float mult, bool four_over_six,
                                                   const Philox4x32Result& rb) {
  uint32_t w[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    w[i >> 3] |= e2m1_code(v[i], mult, four_over_six, kStochastic, rbyte(rb, i)) << (4 * (i & 7));
  }
  return make_uint2(w[0], w[1]);
}
__device__ __forceinline__ uint2 nvfp4_encode16(const float v[16], float mult, bool four_over_six,
                                                bool stochastic, const Philox4x32Result& rb) {
  return stochastic ? nvfp4_encode16_as<true>(v, mult, four_over_six, rb)
                    : nvfp4_encode16_as<false>(v, mult, four_over_six, rb);
}

// The scaled-domain values q * s_b of a micro-block that is written as BF16 only (no packed
// copy): the encoders' grid values (formats::e2m1_value_*_not_nan), so no codes are packed and
// decoded again. Bit for bit nvfp4_scaled16(nvfp4_encode16(v, mult, false, stochastic, rb),
// scale, out) (the formats tests compare the element functions on dense sweeps; test_quant_cuda
// compares the BF16-only copies with the reference).
template <bool kStochastic>
__device__ __forceinline__ void nvfp4_scaled16_direct_as(const float v[16], float mult, uint8_t scale,
                                                         const Philox4x32Result& rb, float out[16]) {
  const float s = formats::decode_e4m3(scale);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float y = formats::mul_rn(v[i], mult);
    const float q = kStochastic ? formats::e2m1_value_sr_not_nan(y, rbyte(rb, i)) : formats::e2m1_value_rn_not_nan(y);
    out[i] = formats::mul_rn(q, s);
  }
}
__device__ __forceinline__ void nvfp4_scaled16_direct(const float v[16], float mult, uint8_t scale,
                                                      bool stochastic, const Philox4x32Result& rb,
                                                      float out[16]) {
  if (stochastic) {
    nvfp4_scaled16_direct_as<true>(v, mult, scale, rb, out);
  } else {
    nvfp4_scaled16_direct_as<false>(v, mult, scale, rb, out);
  }
}

// --- BF16 pairs -----------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t bf16x2_max_nan(uint32_t a, uint32_t b) {
  __nv_bfloat162 x, y;
  memcpy(&x, &a, 4);
  memcpy(&y, &b, 4);
  const __nv_bfloat162 m = __hmax2_nan(x, y);
  uint32_t r;
  memcpy(&r, &m, 4);
  return r;
}
__device__ __forceinline__ uint32_t bf16x2_absmax_nan(uint32_t a, uint32_t b) {
  __nv_bfloat162 x, y;
  memcpy(&x, &a, 4);
  memcpy(&y, &b, 4);
  x = __habs2(x);
  y = __habs2(y);
  memcpy(&a, &x, 4);
  memcpy(&b, &y, 4);
  return bf16x2_max_nan(a, b);
}
// Element-wise max |.| of n BF16x2 words (a tree), NaN-propagating: a half is NaN or Inf exactly
// when one of its values is, else it is the exact amax of its values. |.| only at the leaves
// (each __habs2 is an instruction; the inner levels are non-negative already).
template <int n>
__device__ __forceinline__ uint32_t bf16x2_amax(const uint32_t* w) {
  uint32_t m[n / 2];
#pragma unroll
  for (int i = 0; i < n / 2; ++i) m[i] = bf16x2_absmax_nan(w[2 * i], w[2 * i + 1]);
#pragma unroll
  for (int h = n / 4; h >= 1; h /= 2) {
#pragma unroll
    for (int i = 0; i < h; ++i) m[i] = bf16x2_max_nan(m[i], m[i + h]);
  }
  return m[0];
}
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

// v <- bf16(v H) (block_math.h rht16_forward: the same operations; the final rounding to BF16 is
// the hardware conversion, two values per instruction, which rounds like encode_bf16_rn: RNE,
// overflow to Inf, canonical NaN 0x7FFF).
// v <- (v with the signs of sign_mask) H, unscaled and unrounded: quant/amax_device.cuh.
using device::rht16_signs_and_butterfly;
__device__ __forceinline__ void rht16_forward_fast(float v[16], uint16_t sign_mask) {
  rht16_signs_and_butterfly(v, sign_mask);
#pragma unroll
  for (int i = 0; i < 16; i += 2) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(formats::mul_rn(v[i], 0.25f),
                                                   formats::mul_rn(v[i + 1], 0.25f));
    uint32_t w;
    memcpy(&w, &h, 4);
    v[i] = bf16_lo(w);
    v[i + 1] = bf16_hi(w);
  }
}

// Four Over Six errors of both candidate scales over 16 values, in one loop (two independent
// chains; each accumulates sequentially, like the reference). The dequantization
// four_over_six_dequantize_element with the scales decoded once and the division by the constant
// done as four_over_six_div_constant (bit-identical to div_rn).
__device__ __forceinline__ void four_over_six_errors16(const float v[16], FourOverSixScalePair pair,
                                                       const FourOverSixTensorScales& ts,
                                                       FourOverSixMetric metric, bool stochastic,
                                                       const Philox4x32Result& rb, float& err6,
                                                       float& err4) {
  const float mult6 = four_over_six_multiplier(pair.map6, ts);
  const float mult4 = four_over_six_multiplier(pair.map4, ts);
  const float s6 = formats::decode_e4m3(pair.map6), s4 = formats::decode_e4m3(pair.map4);
  err6 = 0.0f;
  err4 = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const uint32_t q6 = e2m1_code(v[i], mult6, true, stochastic, rbyte(rb, i));
    const uint32_t q4 = e2m1_code(v[i], mult4, true, stochastic, rbyte(rb, i));
    const float deq6 = four_over_six_div_constant(
        formats::mul_rn(formats::mul_rn(e2m1_value(q6), s6), ts.amax), ts.constant, ts.rcp_constant);
    const float deq4 = four_over_six_div_constant(
        formats::mul_rn(formats::mul_rn(e2m1_value(q4), s4), ts.amax), ts.constant, ts.rcp_constant);
    err6 = four_over_six_accumulate_error(err6, deq6, v[i], metric);
    err4 = four_over_six_accumulate_error(err4, deq4, v[i], metric);
  }
}

// Encodes 16 values to E4M3 with multiplier `mult` (FP8) or E8M0 reciprocal (MXFP8).
__device__ __forceinline__ uint4 e4m3_encode16(const float v[16], float mult, bool stochastic,
                                               const Philox4x32Result& rb) {
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t word = 0;
#pragma unroll
    for (int k = 0; k < 4; k += 2) {
      const int i = 4 * j + k;
      const float a = formats::mul_rn(v[i], mult), b = formats::mul_rn(v[i + 1], mult);
      uint32_t pair;
      if (stochastic) {
        pair = (uint32_t)formats::encode_e4m3_sr(a, rbyte(rb, i)) |
               ((uint32_t)formats::encode_e4m3_sr(b, rbyte(rb, i + 1)) << 8);
      } else {
        pair = e4m3x2(a, b);
      }
      word |= pair << (8 * k);
    }
    w[j] = word;
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Scaled-domain values of 16 E4M3 codes times `decode`; with check_mx, a value that BF16 cannot
// hold exactly sets kErrMxfp8NotExact.
__device__ __forceinline__ void e4m3_scaled16(uint4 codes, float decode, float out[16], bool check_mx,
                                              int* error_flags) {
  const uint32_t w[4] = {codes.x, codes.y, codes.z, codes.w};
  bool inexact = false;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    out[i] = formats::mul_rn(formats::decode_e4m3((uint8_t)(w[i >> 2] >> (8 * (i & 3)))), decode);
    // A finite FP32 value is a BF16 value exactly when its low 16 bits are zero.
    if (check_mx) inexact |= (__float_as_uint(out[i]) & 0xFFFFu) != 0;
  }
  if (inexact) atomicOr(error_flags, kErrMxfp8NotExact);
}

// --- the tile kernel ---------------------------------------------------------------------------

// Writes `runs` staged runs of kBytes scales (run i at stage + i * kBytes) to dst + offset_of(i),
// one kBytes-wide store each when dst is kBytes-aligned (the offsets are multiples of kBytes),
// byte stores otherwise. The whole CTA calls it after the barrier that completed the stage.
template <int kBytes, typename OffsetOf>
__device__ __forceinline__ void store_staged_scales(const uint8_t* stage, int runs, uint8_t* dst,
                                                    OffsetOf offset_of) {
  static_assert(kBytes == 4 || kBytes == 8, "a run is one 4- or 8-byte word");
  using Word = std::conditional_t<kBytes == 8, uint2, uint32_t>;
  const bool aligned = (reinterpret_cast<uintptr_t>(dst) & (kBytes - 1)) == 0;
  for (int i = threadIdx.x; i < runs; i += blockDim.x) {
    uint8_t* out = dst + offset_of(i);
    if (aligned) {
      *reinterpret_cast<Word*>(out) = *reinterpret_cast<const Word*>(stage + i * kBytes);
    } else {
      for (int b = 0; b < kBytes; ++b) out[b] = stage[i * kBytes + b];
    }
  }
}

// Geometry of one CTA's tile and of its shared memory, per source type and format.
template <typename InT, Format F, bool kTwoD>
struct Tile {
  static constexpr int kRows = (F == Format::kFp8Block) ? 128 : 64;  // TR
  static constexpr int kCols = 128;                                  // TC
  static constexpr int kChunk = 16 / (int)sizeof(InT);   // elements per 16-byte chunk
  static constexpr int kMicroChunks = 16 / kChunk;       // chunks per 16-element micro-block
  static constexpr int kStride = kCols + kChunk;         // smem row, elements (one chunk of pad)
  static constexpr int kColPair = 4 / (int)sizeof(InT);  // columns per column task
  static constexpr int kRowTasks = kRows * kCols / 16;
  static constexpr int kColTasks = (kCols / kColPair) * (kRows / 16);
  static constexpr int kGroup = F == Format::kMxfp8 ? 2 : (F == Format::kFp8Block ? 8 : 1);
  static constexpr bool kSinglePhase = F == Format::kNvfp4 && !kTwoD;
  // Column-wise packed output staged per column: FP4 TR/2 bytes, E4M3 TR bytes, + 16 pad.
  static constexpr int kStageColBytes = (F == Format::kNvfp4 ? kRows / 2 : kRows);
  static constexpr int kStageStride = kStageColBytes + 16;
  static constexpr size_t kTileBytes = (size_t)kRows * kStride * sizeof(InT);
  static constexpr size_t kStageBytes = (size_t)kCols * kStageStride;
  static constexpr size_t kAmaxFloats =
      kSinglePhase ? 0 : (size_t)kRows * (kCols / 16) * 3 + (size_t)(kRows / 16) * kCols;
  // NVFP4 1x16 stages its scales too, so that they leave as one 8-byte store per row (TC/16
  // scales) and one 4-byte store per column (TR/16) instead of one byte store each.
  static constexpr size_t kScaleStageBytes = kSinglePhase ? (size_t)kRows * (kCols / 16) + (size_t)kCols * (kRows / 16) : 0;
  static constexpr size_t kSmemBytes =
      kTileBytes + kStageBytes + kAmaxFloats * sizeof(float) + kScaleStageBytes;
  // Byte offset of column c's micro-block mb in the stage. NVFP4's 8-byte slots are XOR-swizzled
  // by bits 3..4 of c: a half-warp's stores (columns 2t + j, t = 0..15, 96 bytes apart) then
  // hit 16 distinct 8-byte bank pairs instead of 4 (ncu: 5.4-way conflicts before).
  __device__ static int stage_offset(int c, int mb) {
    if constexpr (F == Format::kNvfp4) {
      static_assert(kStageColBytes == 32, "four 8-byte NVFP4 slots per staged column");
      return c * kStageStride + ((mb ^ (c >> 3)) & 3) * 8;
    } else {
      return c * kStageStride + mb * 16;
    }
  }

  // XOR swizzle of 16-byte chunks within a row: the kMicroChunks loads of a quarter-warp's eight
  // row micro-blocks then hit 32 distinct banks (chunk c of micro-block b: c ^ (b / 2 ...)).
  __device__ static int phys_chunk(int c) { return c ^ ((c >> 3) & (kMicroChunks - 1)); }
  __device__ static int element_offset(int r, int col) {
    return r * kStride + phys_chunk(col / kChunk) * kChunk + col % kChunk;
  }
};

// The variant fixes which options are compiled in: kRoundNearest has no stochastic rounding,
// Four Over Six or RHT code at all, kSrRht no Four Over Six (the gradients' SR + RHT path), kAll
// everything. Small kernels stay in the instruction cache (ncu on the H200 showed 44% of stall
// cycles waiting for instruction fetch with every option compiled in). kSrRhtBf16Only is kSrRht
// for calls whose two copies are scaled-domain BF16 only (the Hopper training's dY: no packed
// data, no scales): each value comes straight from the encoder's grid (nvfp4_scaled16_direct),
// with no codes packed and decoded again, and nothing is staged. kSrRhtRowGrid is kSrRht for
// calls whose row-wise copy is BF16 only and whose column-wise copy is packed (the forward's X):
// the row copy from the grid, the column copy encoded (FOURBIT_QUANT_X_ROW_GRID=0 turns it off).
enum Variant : int { kRoundNearest = 0, kSrRht = 1, kAll = 2, kSrRhtBf16Only = 3, kSrRhtRowGrid = 4 };

// The given amaxes' copies into their bundles (OrientationOut::amax_copy), by one thread; called by
// every quantize kernel after its PDL wait (the given amax is the producer's output).
__device__ __forceinline__ void store_amax_copies(const Params& p) {
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
    if (p.row.amax_copy != nullptr) *p.row.amax_copy = *p.row.amax;
    if (p.col.amax_copy != nullptr) *p.col.amax_copy = *p.col.amax;
  }
}

template <typename InT, Format F, bool kTwoD, int kVariant>
__global__ void __launch_bounds__(kThreads, 4) quantize_tile_kernel(Params p) {
  core::pdl_allow_dependents();  // launched with PDL (core/pdl.cuh): nothing is read before the wait
  core::pdl_wait_for_producer();
  store_amax_copies(p);
  constexpr bool kBf16Only = kVariant == kSrRhtBf16Only;
  constexpr bool kRowGrid = kBf16Only || kVariant == kSrRhtRowGrid;  // row copy from the grid
  const bool stochastic = kVariant != kRoundNearest && p.stochastic;
  const bool four_over_six = kVariant == kAll && p.four_over_six;
  const bool rht = kVariant != kRoundNearest && p.rht;
  using T = Tile<InT, F, kTwoD>;
  constexpr int TR = T::kRows, TC = T::kCols, kColPair = T::kColPair, kGroup = T::kGroup;
  static_assert(T::kRowTasks % kThreads == 0 && T::kColTasks % kThreads == 0, "tile/threads");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  InT* tile = reinterpret_cast<InT*>(smem_raw);
  uint8_t* stage = smem_raw + T::kTileBytes;                                   // [TC][stride]
  float* row_amax16 = reinterpret_cast<float*>(stage + T::kStageBytes);        // [TR][TC/16]
  uint8_t* row_scale_stage = reinterpret_cast<uint8_t*>(row_amax16 + T::kAmaxFloats);  // [TR][TC/16]
  uint8_t* col_scale_stage = row_scale_stage + TR * (TC / 16);                   // [TC][TR/16]
  float* col_amax16 = row_amax16 + TR * (TC / 16);                             // [TR/16][TC]
  float* err_rows = col_amax16 + (TR / 16) * TC;                               // [TR*TC/16][2]
  __shared__ uint8_t tile_choice[TR / 16][TC / 16];  // 4/6 2D: 1 = map to 4
  __shared__ uint8_t tile_scale_code[TR / 16][TC / 16];  // NVFP4 2D: each tile's E4M3 scale
  __shared__ float tile_multiplier[TR / 16][TC / 16];    // and element multiplier
  __shared__ float block_amax_2d;

  const int64_t r0 = (int64_t)blockIdx.y * TR;
  const int64_t c0 = (int64_t)blockIdx.x * TC;
  const int64_t M = p.rows, K = p.cols;
  const InT* src = static_cast<const InT*>(p.src);

  // 1. Load the tile (16-byte chunks, coalesced along rows, swizzled in shared memory).
  constexpr int kChunksPerRow = TC / T::kChunk;
#pragma unroll
  for (int chunk = threadIdx.x; chunk < TR * kChunksPerRow; chunk += kThreads) {
    const int r = chunk / kChunksPerRow, cc = chunk % kChunksPerRow;
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(src + (r0 + r) * K + c0 + cc * T::kChunk));
    *reinterpret_cast<uint4*>(tile + r * T::kStride + T::phys_chunk(cc) * T::kChunk) = v;
  }
  if (kTwoD && threadIdx.x == 0) block_amax_2d = 0.0f;
  __syncthreads();

  const bool do_row = p.row.data != nullptr || p.row.bf16 != nullptr;
  const bool do_col = p.col.data != nullptr || p.col.bf16 != nullptr;

  auto read_row16 = [&](int r, int b, float v[16]) {
#pragma unroll
    for (int j = 0; j < T::kMicroChunks; ++j) {
      const int c = b * T::kMicroChunks + j;
      const uint4 w = *reinterpret_cast<const uint4*>(tile + r * T::kStride + T::phys_chunk(c) * T::kChunk);
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if constexpr (sizeof(InT) == 2) {
          v[j * 8 + 2 * k] = __uint_as_float(words[k] << 16);
          v[j * 8 + 2 * k + 1] = __uint_as_float(words[k] & 0xFFFF0000u);
        } else {
          v[j * 4 + k] = __uint_as_float(words[k]);
        }
      }
    }
  };
  // Column pair cp (kColPair adjacent columns), rows mb*16 .. mb*16+15.
  auto read_cols16 = [&](int mb, int cp, float v[kColPair][16]) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(tile + T::element_offset(mb * 16 + i, cp * kColPair));
      if constexpr (sizeof(InT) == 2) {
        v[0][i] = __uint_as_float(w << 16);
        v[kColPair - 1][i] = __uint_as_float(w & 0xFFFF0000u);
      } else {
        v[0][i] = __uint_as_float(w);
      }
    }
  };
  // Calls fn(task, r, b, v) for each of this thread's row micro-blocks (row r, 16-column block b,
  // values v[16]) and fn(task, mb, cp, v) for each column task (rows mb*16.., columns
  // cp*kColPair.., values v[kColPair][16]).
  auto for_each_row_block = [&](auto&& fn) {
#pragma unroll 1
    for (int task = threadIdx.x; task < T::kRowTasks; task += kThreads) {
      const int r = task / (TC / 16), b = task % (TC / 16);
      float v[16];
      read_row16(r, b, v);
      fn(task, r, b, v);
    }
  };
  auto for_each_col_pair = [&](auto&& fn) {
#pragma unroll 1
    for (int task = threadIdx.x; task < T::kColTasks; task += kThreads) {
      const int mb = task / (TC / kColPair), cp = task % (TC / kColPair);
      float v[kColPair][16];
      read_cols16(mb, cp, v);
      fn(task, mb, cp, v);
    }
  };
  // Block amax; a NaN or Inf among the values sets `bad` (x * 0 is NaN exactly for those: one
  // FMA per element instead of a compare and a predicate OR).
  auto amax16 = [&](const float v[16], bool& bad) {
    float a = 0.0f, probe = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      a = fmaxf(a, fabsf(v[i]));
      probe = __fmaf_rn(v[i], 0.0f, probe);
    }
    bad |= probe != probe;
    return a;
  };
  // Writes the staged column-wise packed data: each column's TR/2 or TR bytes of this tile are
  // contiguous in the transposed output, so every 16-byte store fills half a 32-byte sector and
  // its neighbour lane the other half.
  auto flush_stage = [&]() {
    __syncthreads();
    if (p.col.data == nullptr) return;
    constexpr int kChunksPerCol = T::kStageColBytes / 16;
    const int64_t out_row_bytes = F == Format::kNvfp4 ? M / 2 : M;
    const int64_t out_col0 = F == Format::kNvfp4 ? r0 / 2 : r0;
    for (int t = threadIdx.x; t < TC * kChunksPerCol; t += kThreads) {
      const int c = t / kChunksPerCol, h = t % kChunksPerCol;
      uint4 chunk;
      if constexpr (F == Format::kNvfp4) {  // undo stage_offset's swizzle of the 8-byte slots
        const int sw = (c >> 3) & 3;
        chunk = *reinterpret_cast<const uint4*>(stage + c * T::kStageStride + (h ^ (sw >> 1)) * 16);
        if (sw & 1) chunk = make_uint4(chunk.z, chunk.w, chunk.x, chunk.y);
      } else {
        chunk = *reinterpret_cast<const uint4*>(stage + c * T::kStageStride + h * 16);
      }
      *reinterpret_cast<uint4*>(p.col.data + (c0 + c) * out_row_bytes + out_col0 + h * 16) = chunk;
    }
  };

  bool bad = false;

  if constexpr (T::kSinglePhase) {
    // --- NVFP4 1x16: one phase ---------------------------------------------------------------
    const Nvfp4Tensor nv_row = do_row ? nvfp4_tensor(p, p.row.amax) : Nvfp4Tensor{};
    const Nvfp4Tensor nv_col = do_col ? nvfp4_tensor(p, p.col.amax) : Nvfp4Tensor{};
    // Returns the packed codes; writes the BF16 values for the micro-block at stored (out_row,
    // out_col) of an [*, out_cols] matrix, and its scale to the shared-memory *scale_slot. The
    // grid-value path (nvfp4_scaled16_direct) only in kSrRhtBf16Only: compiled next to the encode
    // path in one kernel it made the gradients' SR + RHT launch slower (178 -> 232 us in `bench
    // train`, H100, session 16), with more live registers in the column task.
    // `grid` (a constant at each call site): this orientation is BF16 only and takes its values
    // from the grid, with no codes and no staged scale.
    auto encode = [&](const float v[16], float amax, const Nvfp4Tensor& t, const OrientationOut& out,
                      int64_t out_row, int64_t out_col, int64_t out_cols, uint8_t* scale_slot, bool grid) {
      const int64_t index = out_row * out_cols + out_col;
      Philox4x32Result rb{};
      if (stochastic) rb = micro_block_bits(out.sr, (uint64_t)index);
      if (kRowGrid && grid) {  // the BF16 copy alone: grid values, no codes, no staged scale
        const uint8_t s = nvfp4_block_scale(amax, t.ts);
        float sv[16];
        nvfp4_scaled16_direct(v, nvfp4_element_multiplier(s, t.ts), s, stochastic, rb, sv);
        store_bf16x16(out.bf16 + index, sv);
        return make_uint2(0u, 0u);
      }
      uint8_t s;
      float mult;
      if (four_over_six) {
        const FourOverSixScalePair pair = four_over_six_scales(amax, t.ts46);
        float e6, e4;
        four_over_six_errors16(v, pair, t.ts46, p.metric, stochastic, rb, e6, e4);
        s = e4 < e6 ? pair.map4 : pair.map6;
        mult = four_over_six_multiplier(s, t.ts46);
      } else {
        s = nvfp4_block_scale(amax, t.ts);
        mult = nvfp4_element_multiplier(s, t.ts);
      }
      const uint2 packed = nvfp4_encode16(v, mult, four_over_six, stochastic, rb);
      *scale_slot = s;
      if (out.bf16) {
        float sv[16];
        nvfp4_scaled16(packed, s, sv);
        store_bf16x16(out.bf16 + index, sv);
      }
      return packed;
    };
    // BF16 sources: block amaxes (and the NaN/Inf check) on BF16 pairs, two values an instruction.
    auto row_task = [&](int task) {
      const int r = task / (TC / 16), b = task % (TC / 16);
      float v[16];
      float amax;
      if constexpr (sizeof(InT) == 2) {
        uint32_t w[8];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint4 q = *reinterpret_cast<const uint4*>(tile + r * T::kStride + T::phys_chunk(2 * b + j) * T::kChunk);
          w[4 * j] = q.x, w[4 * j + 1] = q.y, w[4 * j + 2] = q.z, w[4 * j + 3] = q.w;
        }
        const uint32_t m2 = bf16x2_amax<8>(w);
        amax = bf16_lo(bf16x2_max_nan(m2, __byte_perm(m2, 0, 0x1032)));
        bad |= !(amax <= formats::kFloatMax);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[2 * k] = bf16_lo(w[k]), v[2 * k + 1] = bf16_hi(w[k]);
      } else {
        read_row16(r, b, v);
        amax = amax16(v, bad);
      }
      const uint2 packed = encode(v, amax, p.row.amax_per_row ? nvfp4_tensor(p, p.row.amax + r0 + r) : nv_row,
                                  p.row, r0 + r, c0 + b * 16, K, row_scale_stage + r * (TC / 16) + b, kRowGrid);
      if (!kRowGrid && p.row.data) *reinterpret_cast<uint2*>(p.row.data + ((r0 + r) * K + c0 + b * 16) / 2) = packed;
    };
    auto col_task = [&](int task) {
      const int mb = task / (TC / kColPair), cp = task % (TC / kColPair);
      float v[kColPair][16];
      float amax[kColPair];
      if constexpr (sizeof(InT) == 2) {
        uint32_t w[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) w[i] = *reinterpret_cast<const uint32_t*>(tile + T::element_offset(mb * 16 + i, cp * 2));
        const uint32_t m2 = bf16x2_amax<16>(w);
        amax[0] = bf16_lo(m2);
        amax[1] = bf16_hi(m2);
        if (!do_row) bad |= !(amax[0] <= formats::kFloatMax && amax[1] <= formats::kFloatMax);
#pragma unroll
        for (int i = 0; i < 16; ++i) v[0][i] = bf16_lo(w[i]), v[1][i] = bf16_hi(w[i]);
      } else {
        read_cols16(mb, cp, v);
        bool ignore = false;  // the row-wise pass (or below) reports non-finite inputs
        amax[0] = amax16(v[0], do_row ? ignore : bad);
      }
#pragma unroll
      for (int j = 0; j < kColPair; ++j) {
        const int c = cp * kColPair + j;
        if (rht) {
          rht16_forward_fast(v[j], p.rht_sign_mask);
          bool ignore = false;
          amax[j] = amax16(v[j], ignore);
        }
        const uint2 packed = encode(v[j], amax[j], nv_col, p.col, c0 + c, r0 + mb * 16, M,
                                    col_scale_stage + c * (TR / 16) + mb, kBf16Only);
        if constexpr (!kBf16Only) *reinterpret_cast<uint2*>(stage + T::stage_offset(c, mb)) = packed;
      }
    };
    if (do_row) {
#pragma unroll 1
      for (int task = threadIdx.x; task < T::kRowTasks; task += kThreads) row_task(task);
    }
    if (do_col) {
#pragma unroll 1
      for (int task = threadIdx.x; task < T::kColTasks; task += kThreads) col_task(task);
    }
    if constexpr (kBf16Only) {  // nothing staged: only the non-finite flag is left to report
      if (bad) atomicOr(p.error_flags, kErrNonFinite);
      return;
    }
    if (do_col) {
      flush_stage();  // (its barrier also completes the staged scales)
    } else {
      __syncthreads();
    }
    // The staged scales: row r's TC/16 bytes are contiguous at byte (r0 + r) * K / 16 + c0 / 16 of
    // the row-wise scales, column c's TR/16 at (c0 + c) * M / 16 + r0 / 16 of the column-wise
    // ones; K % TC == 0 and M % TR == 0 keep them 8- and 4-byte aligned when the base is.
    static_assert(TC / 16 == 8 && TR / 16 == 4, "one 8-byte store a row, one 4-byte store a column");
    if (do_row && p.row.scales)
      store_staged_scales<TC / 16>(row_scale_stage, TR, static_cast<uint8_t*>(p.row.scales),
                                   [&](int r) { return ((r0 + r) * K + c0) / 16; });
    if (do_col && p.col.scales)
      store_staged_scales<TR / 16>(col_scale_stage, TC, static_cast<uint8_t*>(p.col.scales),
                                   [&](int c) { return ((c0 + c) * M + r0) / 16; });
    if (bad) atomicOr(p.error_flags, kErrNonFinite);
  } else {
    // --- two phases: micro-block amaxes, then scale blocks ------------------------------------
    for_each_row_block([&](int task, int r, int b, float* v) {
      row_amax16[r * (TC / 16) + b] = amax16(v, bad);
    });
    if (!kTwoD && do_col) {
      for_each_col_pair([&](int task, int mb, int cp, float (*v)[16]) {
        bool ignore = false;
#pragma unroll
        for (int j = 0; j < kColPair; ++j) col_amax16[mb * TC + cp * kColPair + j] = amax16(v[j], ignore);
      });
    }
    if (bad) atomicOr(p.error_flags, kErrNonFinite);
    __syncthreads();
    if constexpr (kTwoD && F == Format::kFp8Block) {
      // One 128x128 block = the whole CTA tile.
      float a = 0.0f;
      for (int i = threadIdx.x; i < T::kRowTasks; i += kThreads) a = fmaxf(a, row_amax16[i]);
      for (int off = 16; off > 0; off >>= 1) a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, off));
      if ((threadIdx.x & 31) == 0) atomicMax(reinterpret_cast<unsigned int*>(&block_amax_2d), __float_as_uint(a));
      __syncthreads();
    }

    // Scale-block amax of a row micro-block (r, b) / column micro-block (mb, c).
    auto row_group_amax = [&](int r, int b) {
      if constexpr (kTwoD && F == Format::kNvfp4) {
        float a = 0.0f;
        const int rb = r / 16 * 16;
#pragma unroll
        for (int i = 0; i < 16; ++i) a = fmaxf(a, row_amax16[(rb + i) * (TC / 16) + b]);
        return a;
      } else if constexpr (kTwoD) {
        return block_amax_2d;
      } else {
        float a = 0.0f;
        const int g0 = b / kGroup * kGroup;
#pragma unroll
        for (int i = 0; i < kGroup; ++i) a = fmaxf(a, row_amax16[r * (TC / 16) + g0 + i]);
        return a;
      }
    };
    auto col_group_amax = [&](int mb, int c) {
      if constexpr (kTwoD) {
        return row_group_amax(mb * 16, c / 16);
      } else {
        float a = 0.0f;
        const int g0 = mb / kGroup * kGroup;
#pragma unroll
        for (int i = 0; i < kGroup; ++i) a = fmaxf(a, col_amax16[(g0 + i) * TC + c]);
        return a;
      }
    };

    if constexpr (F == Format::kNvfp4) {
      // NVFP4 16x16 tiles (weights). The column-wise copy is the transpose of the row-wise one:
      // same tile scales, and with SR the row-wise stream's draws, element by element.
      const Nvfp4Tensor t = nvfp4_tensor(p, do_row ? p.row.amax : p.col.amax);
      if (four_over_six) {
        // Four Over Six chooses per tile from per-row partial errors, summed in row order.
        for_each_row_block([&](int task, int r, int b, float* v) {
          Philox4x32Result rb{};
          if (stochastic) rb = micro_block_bits(p.row.sr, (uint64_t)((r0 + r) * K + c0 + b * 16));
          const FourOverSixScalePair pair = four_over_six_scales(row_group_amax(r, b), t.ts46);
          four_over_six_errors16(v, pair, t.ts46, p.metric, stochastic, rb, err_rows[task * 2 + 0],
                                 err_rows[task * 2 + 1]);
        });
        __syncthreads();
        for (int i = threadIdx.x; i < (TR / 16) * (TC / 16); i += kThreads) {
          const int tr = i / (TC / 16), b = i % (TC / 16);
          float e6 = 0.0f, e4 = 0.0f;
          for (int k = 0; k < 16; ++k) {
            const int task = (tr * 16 + k) * (TC / 16) + b;
            e6 = four_over_six_combine_errors(e6, err_rows[task * 2 + 0], p.metric);
            e4 = four_over_six_combine_errors(e4, err_rows[task * 2 + 1], p.metric);
          }
          tile_choice[tr][b] = e4 < e6 ? 1 : 0;
        }
        __syncthreads();
      }
      // Each tile's scale and element multiplier, computed once (not once per row of the tile).
      for (int i = threadIdx.x; i < (TR / 16) * (TC / 16); i += kThreads) {
        const int tr = i / (TC / 16), b = i % (TC / 16);
        const float a = row_group_amax(tr * 16, b);
        uint8_t s;
        float mult;
        if (four_over_six) {
          const FourOverSixScalePair pair = four_over_six_scales(a, t.ts46);
          s = tile_choice[tr][b] ? pair.map4 : pair.map6;
          mult = four_over_six_multiplier(s, t.ts46);
        } else {
          s = nvfp4_block_scale(a, t.ts);
          mult = nvfp4_element_multiplier(s, t.ts);
        }
        tile_scale_code[tr][b] = s;
        tile_multiplier[tr][b] = mult;
      }
      __syncthreads();
      auto tile_scale = [&](int tr, int b, float& mult) {
        mult = tile_multiplier[tr][b];
        return tile_scale_code[tr][b];
      };
      if (do_row) {
        for_each_row_block([&](int task, int r, int b, float* v) {
          float mult;
          const uint8_t s = tile_scale(r / 16, b, mult);
          const int64_t index = (r0 + r) * K + c0 + b * 16;
          Philox4x32Result rb{};
          if (stochastic) rb = micro_block_bits(p.row.sr, (uint64_t)index);
          const uint2 packed = nvfp4_encode16(v, mult, four_over_six, stochastic, rb);
          if (p.row.data) {
            *reinterpret_cast<uint2*>(p.row.data + index / 2) = packed;
            static_cast<uint8_t*>(p.row.scales)[index / 16] = s;
          }
          if (p.row.bf16) {
            float sv[16];
            nvfp4_scaled16(packed, s, sv);
            store_bf16x16(p.row.bf16 + index, sv);
          }
        });
      }
      if (do_col) {
for_each_col_pair([&](int task, int mb, int cp, float (*v)[16]) {
#pragma unroll
          for (int j = 0; j < kColPair; ++j) {
            const int c = cp * kColPair + j;
            float mult;
            const uint8_t s = tile_scale(mb, c / 16, mult);
            uint2 packed;
            if (stochastic) {
              uint32_t w[2] = {0, 0};
#pragma unroll
              for (int i = 0; i < 16; ++i) {
                const uint32_t rbits = p.row.sr.byte_at((uint64_t)((r0 + mb * 16 + i) * K + c0 + c));
                const uint8_t q = four_over_six ? four_over_six_encode_element(v[j][i], mult, true, rbits)
                                                  : nvfp4_encode_element(v[j][i], mult, true, rbits);
                w[i >> 3] |= (uint32_t)q << (4 * (i & 7));
              }
              packed = make_uint2(w[0], w[1]);
            } else {
              packed = nvfp4_encode16(v[j], mult, four_over_six, false, Philox4x32Result{});
            }
            const int64_t index = (c0 + c) * M + r0 + mb * 16;
            *reinterpret_cast<uint2*>(stage + T::stage_offset(c, mb)) = packed;
            if (p.col.scales) static_cast<uint8_t*>(p.col.scales)[index / 16] = s;
            if (p.col.bf16) {
              float sv[16];
              nvfp4_scaled16(packed, s, sv);
              store_bf16x16(p.col.bf16 + index, sv);
            }
          }
        });
        flush_stage();
      }
    } else {
      // MXFP8 (E8M0 per 32) and FP8 (FP32 decode scale per 128 / 128x128 / tensor).
      // FP8 per tensor and 128x128 (one block per CTA tile): one scale for the whole tile, its
      // encode and decode factors computed once per thread (not once per micro-block).
      constexpr bool kUniformScale = F == Format::kFp8Tensor || (F == Format::kFp8Block && kTwoD);
      float uniform_encode = 0.0f, uniform_decode = 0.0f;
      if constexpr (kUniformScale) {
        uniform_encode = fp8_encode_scale(F == Format::kFp8Tensor ? *p.row.amax : block_amax_2d, p.fp8_pow2);
        uniform_decode = formats::div_rn(1.0f, uniform_encode);
      }
      auto scale_for = [&](float group_amax, float& mult, float& decode, uint8_t& code) {
        if constexpr (F == Format::kMxfp8) {
          code = mxfp8_scale_code(group_amax, p.mx_rule);
          mult = formats::e8m0_reciprocal(code);
          decode = formats::decode_e8m0(code);
        } else if constexpr (kUniformScale) {
          mult = uniform_encode;  // group_amax is the block (or tensor) amax
          decode = uniform_decode;
        } else {
          mult = fp8_encode_scale(group_amax, p.fp8_pow2);
          decode = formats::div_rn(1.0f, mult);
        }
      };
      // Encodes one micro-block; returns the 16 E4M3 codes, writes the scale and BF16.
      auto encode = [&](const float v[16], float group_amax, const OrientationOut& out,
                        int64_t index, bool write_scale, int64_t scale_index) {
        float mult, decode;
        uint8_t code = 0;
        scale_for(group_amax, mult, decode, code);
        Philox4x32Result rb{};
        if (stochastic) rb = micro_block_bits(out.sr, (uint64_t)index);
        // MXFP8: x * 2^(127 - code) then RNE + saturate (TE order); FP8: x * encode scale.
        const uint4 codes = e4m3_encode16(v, mult, stochastic, rb);
        if (out.scales && write_scale) {
          if constexpr (F == Format::kMxfp8) {
            static_cast<uint8_t*>(out.scales)[scale_index] = code;
          } else {
            static_cast<float*>(out.scales)[scale_index] = decode;
          }
        }
        if (out.bf16) {
          float sv[16];
          e4m3_scaled16(codes, decode, sv, F == Format::kMxfp8, p.error_flags);
          store_bf16x16(out.bf16 + index, sv);
        }
        return codes;
      };
      if (do_row) {
        for_each_row_block([&](int task, int r, int b, float* v) {
          const int64_t gr = r0 + r, gc = c0 + b * 16;
          int64_t scale_index;
          bool write_scale;
          if constexpr (F == Format::kFp8Tensor) {
            scale_index = 0;
            write_scale = blockIdx.x == 0 && blockIdx.y == 0 && task == 0;
          } else if constexpr (kTwoD) {
            scale_index = (gr / 128) * (K / 128) + gc / 128;
            write_scale = task == 0;
          } else {
            constexpr int kBlock = F == Format::kMxfp8 ? 32 : 128;
            scale_index = gr * (K / kBlock) + gc / kBlock;
            write_scale = b % kGroup == 0;
          }
          const uint4 codes = encode(v, row_group_amax(r, b), p.row, gr * K + gc, write_scale, scale_index);
          if (p.row.data) *reinterpret_cast<uint4*>(p.row.data + gr * K + gc) = codes;
        });
      }
      if (do_col) {
for_each_col_pair([&](int task, int mb, int cp, float (*v)[16]) {
#pragma unroll
          for (int j = 0; j < kColPair; ++j) {
            const int c = cp * kColPair + j;
            const int64_t gc = c0 + c, gr = r0 + mb * 16;
            int64_t scale_index;
            bool write_scale;
            if constexpr (F == Format::kFp8Tensor) {
              scale_index = 0;
              write_scale = blockIdx.x == 0 && blockIdx.y == 0 && task == 0 && j == 0;
            } else if constexpr (kTwoD) {
              scale_index = (gc / 128) * (M / 128) + gr / 128;
              write_scale = task == 0 && j == 0;
            } else {
              constexpr int kBlock = F == Format::kMxfp8 ? 32 : 128;
              scale_index = gc * (M / kBlock) + gr / kBlock;
              write_scale = mb % kGroup == 0;
            }
            uint4 codes;
            if (kTwoD && stochastic) {
              // 2D FP8 with SR: the transpose of the row-wise copy, row-wise draws per element.
              float mult, decode;
              uint8_t code = 0;
              scale_for(col_group_amax(mb, c), mult, decode, code);
              uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
              for (int i = 0; i < 16; ++i) {
                const uint32_t rbits = p.row.sr.byte_at((uint64_t)((gr + i) * K + gc));
                w[i >> 2] |= (uint32_t)fp8_encode_element(v[j][i], mult, true, rbits) << (8 * (i & 3));
              }
              codes = make_uint4(w[0], w[1], w[2], w[3]);
              if (p.col.scales && write_scale) static_cast<float*>(p.col.scales)[scale_index] = decode;
              if (p.col.bf16) {
                float sv[16];
                e4m3_scaled16(codes, decode, sv, false, p.error_flags);
                store_bf16x16(p.col.bf16 + gc * M + gr, sv);
              }
            } else {
              codes = encode(v[j], col_group_amax(mb, c), p.col, gc * M + gr, write_scale, scale_index);
            }
            *reinterpret_cast<uint4*>(stage + T::stage_offset(c, mb)) = codes;
          }
        });
        flush_stage();
      }
    }
  }
}

// --- row-wise only: the streaming kernel ------------------------------------------------------------

// The row-wise-only cases of the 1D formats without Four Over Six (NVFP4 1x16, MXFP8 1x32, FP8
// 1x128, round to nearest or stochastic: the forward activations, the Dgrad gradient, and the
// quantize-dequantize feeding the Hopper GEMM emulation) need no tile (RHT applies only to
// column-wise copies): each thread reads one 16-element micro-block straight from global memory (two 16-byte
// loads of BF16, four of FP32; a warp reads one contiguous 1 KB / 2 KB span), the kGroup threads of
// a scale block (1, 2 or 8 consecutive lanes) combine their amaxes with shuffles, and each thread
// writes its packed codes, its share of the scales and optionally 32 bytes of scaled-domain BF16.
// Same arithmetic as the tile kernel (block_math.h), so the bits are the same; no shared memory,
// few registers, many loads in flight per SM. Needs rows * cols / 16 to be a multiple of 32 (whole
// warps: the host side guarantees whole tiles).
template <typename InT, Format F, bool kStochastic>
__global__ void __launch_bounds__(kThreads) rowwise_kernel(Params p) {
  core::pdl_allow_dependents();  // launched with PDL (core/pdl.cuh): nothing is read before the wait
  core::pdl_wait_for_producer();
  store_amax_copies(p);
  constexpr int kGroup = F == Format::kMxfp8 ? 2 : (F == Format::kFp8Block ? 8 : 1);
  const int64_t n_blocks = p.rows * (p.cols / 16);
  const int64_t g = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  if (g >= n_blocks) return;  // never splits a warp (n_blocks is a multiple of 32)
  const InT* src = static_cast<const InT*>(p.src) + g * 16;
  float v[16];
  if constexpr (sizeof(InT) == 2) {
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    const uint4 a = __ldg(s4), b = __ldg(s4 + 1);
    const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      v[2 * k] = __uint_as_float(w[k] << 16);
      v[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
    }
  } else {
    const float4* s4 = reinterpret_cast<const float4*>(src);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float4 x = __ldg(s4 + k);
      v[4 * k] = x.x;
      v[4 * k + 1] = x.y;
      v[4 * k + 2] = x.z;
      v[4 * k + 3] = x.w;
    }
  }
  float amax = 0.0f, probe = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    amax = fmaxf(amax, fabsf(v[i]));
    probe = __fmaf_rn(v[i], 0.0f, probe);  // NaN exactly when some value is NaN or Inf
  }
  if (probe != probe) atomicOr(p.error_flags, kErrNonFinite);
#pragma unroll
  for (int off = 1; off < kGroup; off <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
  Philox4x32Result rb{};
  if constexpr (kStochastic) rb = micro_block_bits(p.row.sr, (uint64_t)g * 16);

  if constexpr (F == Format::kNvfp4) {
    const float tensor_amax = p.row.amax[p.row.amax_per_row ? g / (p.cols / 16) : 0];
    const Nvfp4TensorScales ts = nvfp4_tensor_scales(tensor_amax, p.nvfp4_scale_constant, p.nvfp4_element_constant);
    const uint8_t s = nvfp4_block_scale(amax, ts);
    const float mult = nvfp4_element_multiplier(s, ts);
    if (p.row.scales) static_cast<uint8_t*>(p.row.scales)[g] = s;
    if (p.row.data == nullptr) {  // the BF16 copy alone: grid values, no codes
      float sv[16];
      nvfp4_scaled16_direct(v, mult, s, kStochastic, rb, sv);
      store_bf16x16(p.row.bf16 + g * 16, sv);
    } else {
      const uint2 packed = nvfp4_encode16(v, mult, false, kStochastic, rb);
      reinterpret_cast<uint2*>(p.row.data)[g] = packed;
      if (p.row.bf16) {
        float sv[16];
        nvfp4_scaled16(packed, s, sv);
        store_bf16x16(p.row.bf16 + g * 16, sv);
      }
    }
  } else {
    float mult, decode;
    uint8_t code = 0;
    if constexpr (F == Format::kMxfp8) {
      code = mxfp8_scale_code(amax, p.mx_rule);
      mult = formats::e8m0_reciprocal(code);
      decode = formats::decode_e8m0(code);
    } else {
      mult = fp8_encode_scale(amax, p.fp8_pow2);
      decode = formats::div_rn(1.0f, mult);
    }
    const uint4 codes = e4m3_encode16(v, mult, kStochastic, rb);
    if (p.row.data) reinterpret_cast<uint4*>(p.row.data)[g] = codes;
    if (p.row.scales && g % kGroup == 0) {
      if constexpr (F == Format::kMxfp8) {
        static_cast<uint8_t*>(p.row.scales)[g / kGroup] = code;
      } else {
        static_cast<float*>(p.row.scales)[g / kGroup] = decode;
      }
    }
    if (p.row.bf16) {
      float sv[16];
      e4m3_scaled16(codes, decode, sv, F == Format::kMxfp8, p.error_flags);
      store_bf16x16(p.row.bf16 + g * 16, sv);
    }
  }
}

template <typename InT, Format F>
void launch_rowwise(const Params& p, cudaStream_t stream) {
  const int64_t n_blocks = p.rows * (p.cols / 16);
  const unsigned grid = (unsigned)((n_blocks + kThreads - 1) / kThreads);
  if (grid == 0) return;
  if (p.stochastic) {
    FOURBIT_CUDA_CHECK(core::launch_pdl(rowwise_kernel<InT, F, true>, dim3(grid), dim3(kThreads), 0, stream, p));
  } else {
    FOURBIT_CUDA_CHECK(core::launch_pdl(rowwise_kernel<InT, F, false>, dim3(grid), dim3(kThreads), 0, stream, p));
  }
  FOURBIT_CUDA_CHECK_LAUNCH();
}

// --- global amax ---------------------------------------------------------------------------------

// The end of both global-amax kernels: quant/amax_device.cuh.
__device__ __forceinline__ void publish_amaxes(float a_row, float a_col, float* row_amax, float* col_amax,
                                               bool bad, int* error_flags) {
  device::publish_amaxes(a_row, a_col, row_amax, col_amax, bad, error_flags, kErrNonFinite);
}

// Each thread reduces a 16-row strip of kColPair columns: the plain amax (row-wise) and, when
// `rht`, the amax of the BF16-rounded Hadamard transform of each 16-row column segment.
template <typename InT>
__global__ void __launch_bounds__(kThreads) amax_kernel(const InT* src, int64_t rows, int64_t cols,
                                                        bool rht, uint16_t sign_mask,
                                                        float* row_amax, float* col_amax,
                                                        int* error_flags) {
  core::pdl_allow_dependents();  // launched with PDL (core/pdl.cuh): nothing is read before the wait
  core::pdl_wait_for_producer();
  constexpr int kColPair = 4 / sizeof(InT);
  const int64_t col_groups = cols / kColPair;
  const int64_t strips = (rows / 16) * col_groups;
  float a_row = 0.0f, a_col = 0.0f;
  bool bad = false;
  for (int64_t s = (int64_t)blockIdx.x * kThreads + threadIdx.x; s < strips;
       s += (int64_t)gridDim.x * kThreads) {
    const int64_t rb = s / col_groups, cg = s % col_groups;
#pragma unroll
    for (int j = 0; j < kColPair; ++j) {
      float v[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        v[i] = load_as_float(src + (rb * 16 + i) * cols + cg * kColPair + j);
        const float x = abs_f32(v[i]);
        bad |= !(x <= formats::kFloatMax);
        a_row = fmaxf(a_row, x);
      }
      if (rht) {
        rht16_forward_fast(v, sign_mask);
#pragma unroll
        for (int i = 0; i < 16; ++i) a_col = fmaxf(a_col, abs_f32(v[i]));
      }
    }
  }
  publish_amaxes(a_row, rht ? a_col : a_row, row_amax, col_amax, bad, error_flags);
}

// The same amaxes with RHT, the fast path (8-byte aligned source, a whole number of 8-byte chunks
// per row): each thread reduces a 16-row strip of kPer = 4 BF16 (2 FP32) columns read with 16
// independent 8-byte loads, so a warp reads 256 contiguous bytes of each of 16 rows (amax_kernel
// above reads 2 bytes a load). The column-wise amax is max |bf16(RN(0.25 y))| over the transformed
// segments y = fwht16(signs * x); RN to FP32 and then to BF16 are both monotone and odd, so
// max_i |round(y_i)| = round(max_i |y_i|): the rounding is applied once per segment to its max |y|
// instead of to each of its 16 values. Equal, bit for bit, to amax_kernel (NaN left out by fmaxf
// in both; Inf kept).
template <typename InT>
__global__ void __launch_bounds__(kThreads) amax_rht_kernel(const InT* src, int64_t rows, int64_t cols,
                                                            uint16_t sign_mask, float* row_amax,
                                                            float* col_amax, int* error_flags,
                                                            kernels::AmaxTicket ticket) {
  core::pdl_allow_dependents();  // launched with PDL (core/pdl.cuh): nothing is read before the wait
  core::pdl_wait_for_producer();
  constexpr int kPer = 8 / (int)sizeof(InT);
  const int64_t col_groups = cols / kPer;  // 8-byte chunks per row
  const int64_t strips = (rows / 16) * col_groups;
  float a_row = 0.0f, a_col = 0.0f;
  bool bad = false;
  for (int64_t s = (int64_t)blockIdx.x * kThreads + threadIdx.x; s < strips;
       s += (int64_t)gridDim.x * kThreads) {
    const int64_t rb = s / col_groups, cg = s % col_groups;
    const uint2* chunk = reinterpret_cast<const uint2*>(src + rb * 16 * cols) + cg;
    uint2 q[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) q[i] = __ldg(chunk + i * col_groups);
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      float v[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        if constexpr (sizeof(InT) == 2) {
          const uint32_t w = j < 2 ? q[i].x : q[i].y;
          v[i] = (j & 1) ? bf16_hi(w) : bf16_lo(w);
        } else {
          v[i] = __uint_as_float(j == 0 ? q[i].x : q[i].y);
        }
        const float x = abs_f32(v[i]);
        bad |= !(x <= formats::kFloatMax);
        a_row = fmaxf(a_row, x);
      }
      a_col = fmaxf(a_col, device::rht_segment_amax(v, sign_mask));
    }
  }
  if (ticket.count != nullptr) {
    device::publish_amaxes_ticket(a_row, a_col, row_amax, col_amax, bad, error_flags, kErrNonFinite,
                                  ticket.count, ticket.partial);
  } else {
    publish_amaxes(a_row, a_col, row_amax, col_amax, bad, error_flags);
  }
}

// Folds the 8 BF16 or 4 FP32 values of a 16-byte chunk into the running amax `a`; a NaN is left out
// (fmaxf) and an Inf kept, and either sets `bad`.
template <typename InT>
__device__ __forceinline__ void amax_chunk(const uint4& q, float& a, bool& bad) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (sizeof(InT) == 2) {
      const float lo = abs_f32(bf16_lo(w[k])), hi = abs_f32(bf16_hi(w[k]));
      bad |= !(lo <= formats::kFloatMax) || !(hi <= formats::kFloatMax);
      a = fmaxf(a, fmaxf(lo, hi));
    } else {
      const float x = abs_f32(__uint_as_float(w[k]));
      bad |= !(x <= formats::kFloatMax);
      a = fmaxf(a, x);
    }
  }
}

// The same amaxes without RHT (column-wise amax = row-wise amax) over the tensor as one flat
// array of 16-byte chunks: every load is 16 bytes wide and each thread keeps 4 in flight. A NaN
// is left out of the amax and an Inf kept, as in amax_kernel; either sets kErrNonFinite.
template <typename InT>
__global__ void __launch_bounds__(kThreads) amax_flat_kernel(const uint4* src, int64_t n_chunks,
                                                             float* row_amax, float* col_amax,
                                                             int* error_flags, kernels::AmaxTicket ticket) {
  core::pdl_allow_dependents();  // launched with PDL (core/pdl.cuh): nothing is read before the wait
  core::pdl_wait_for_producer();
  constexpr int kUnroll = 4;
  float a = 0.0f;
  bool bad = false;
  auto take = [&](const uint4& q) { amax_chunk<InT>(q, a, bad); };
  const int64_t stride = (int64_t)gridDim.x * kThreads;
  int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < n_chunks; i += kUnroll * stride) {
    uint4 q[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) q[u] = __ldg(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) take(q[u]);
  }
  for (; i < n_chunks; i += stride) take(__ldg(src + i));
  if (ticket.count != nullptr) {
    device::publish_amaxes_ticket(a, a, row_amax, col_amax, bad, error_flags, kErrNonFinite, ticket.count,
                                  ticket.partial);
    return;
  }
  for (int off = 16; off > 0; off >>= 1) a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, off));
  if ((threadIdx.x & 31) == 0) {
    atomicMax(reinterpret_cast<unsigned int*>(row_amax), __float_as_uint(a));
    if (col_amax) atomicMax(reinterpret_cast<unsigned int*>(col_amax), __float_as_uint(a));
  }
  if (bad) atomicOr(error_flags, kErrNonFinite);
}

// --- per-row amax (nvfp4_row_amax) ----------------------------------------------------------------

// One warp per row: lanes stride over the row in 16-byte loads (8 bf16 or 4 f32), then a warp max.
template <typename InT>
__global__ void __launch_bounds__(kThreads) row_amax_kernel(const InT* src, int64_t rows, int64_t cols,
                                                            float* row_amax, int* error_flags) {
  core::pdl_allow_dependents();  // launched with PDL (core/pdl.cuh): nothing is read before the wait
  core::pdl_wait_for_producer();
  constexpr int kPer = 16 / sizeof(InT);
  const int64_t r = (int64_t)blockIdx.x * (kThreads / 32) + threadIdx.x / 32;
  if (r >= rows) return;  // whole warps leave together
  const int lane = threadIdx.x % 32;
  const InT* row = src + r * cols;
  float a = 0.0f;
  bool bad = false;
  for (int64_t c = (int64_t)lane * kPer; c < cols; c += 32 * kPer) {
    amax_chunk<InT>(__ldg(reinterpret_cast<const uint4*>(row + c)), a, bad);
  }
  for (int off = 16; off > 0; off >>= 1) a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, off));
  if (lane == 0) row_amax[r] = a;
  if (bad) atomicOr(error_flags, kErrNonFinite);
}

// --- dequantize ------------------------------------------------------------------------------------

__global__ void fill_normal_kernel(void* dst, bool bf16, int64_t n, uint64_t seed) {
  const RandomStream rs{seed, 0x4E4F524Dull};
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float u1 = 1.0f - rs.uniform_at(2 * (uint64_t)i);
    const float u2 = rs.uniform_at(2 * (uint64_t)i + 1);
    const float x = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    if (bf16) {
      static_cast<uint16_t*>(dst)[i] = formats::encode_bf16_rn(x);
    } else {
      static_cast<float*>(dst)[i] = x;
    }
  }
}

__global__ void dequantize_kernel(DequantParams p) {
  core::pdl_allow_dependents();  // launched with PDL (core/pdl.cuh): nothing is read before the wait
  core::pdl_wait_for_producer();
  const int64_t n = p.rows * p.cols;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / p.cols, c = i % p.cols;
    float v = 0.0f;
    switch (p.format) {
      case Format::kNvfp4: {
        const uint8_t code = formats::unpack_e2m1(p.data[i / 2], (int)(i & 1));
        const uint8_t s = static_cast<const uint8_t*>(p.scales)[r * (p.cols / 16) + c / 16];
        v = nvfp4_dequantize_element(code, s, p.amax[p.amax_per_row ? r : 0], p.nvfp4_constant);
        break;
      }
      case Format::kMxfp8:
        v = mxfp8_dequantize_element(p.data[i], static_cast<const uint8_t*>(p.scales)[r * (p.cols / 32) + c / 32]);
        break;
      case Format::kFp8Block: {
        const float* s = static_cast<const float*>(p.scales);
        v = fp8_dequantize_element(p.data[i], p.block_2d ? s[(r / 128) * (p.cols / 128) + c / 128]
                                                         : s[r * (p.cols / 128) + c / 128]);
        break;
      }
      case Format::kFp8Tensor:
        v = fp8_dequantize_element(p.data[i], *static_cast<const float*>(p.scales));
        break;
    }
    p.out[i] = v;
  }
}

template <typename InT, Format F, bool kTwoD, int kVariant>
void launch_tile_kernel(const Params& p, cudaStream_t stream) {
  using T = Tile<InT, F, kTwoD>;
  auto kernel = quantize_tile_kernel<InT, F, kTwoD, kVariant>;
  static bool configured = false;  // per instantiation; the device is set once per process
  if (!configured) {
    FOURBIT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)T::kSmemBytes));
    configured = true;
  }
  const dim3 grid((unsigned)(p.cols / T::kCols), (unsigned)(p.rows / T::kRows));
  FOURBIT_CUDA_CHECK(core::launch_pdl(kernel, grid, dim3(kThreads), T::kSmemBytes, stream, p));
  FOURBIT_CUDA_CHECK_LAUNCH();
}

// Whether SR + RHT calls with BF16-only copies take kSrRhtBf16Only (default; measured on the H100
// in session 21: `bench quant` train dy with amax given 0.497 -> 0.410 ms, gpt2-124m nvfp4 step
// 85.1 -> 84.2 ms). FOURBIT_QUANT_SRRHT_DIRECT=0 takes kSrRht for A/B runs. Read once per process.
// (Launch bounds of 3 or 2 CTAs an SM instead of 4, 71-122 registers, were slower for both:
// kSrRht 0.516 / 0.554 ms, kSrRhtBf16Only 0.431 / 0.469 ms.)
bool sr_rht_bf16_direct() {
  static const bool on = env_switch("FOURBIT_QUANT_SRRHT_DIRECT") != 0;
  return on;
}

// Whether SR + RHT calls with a BF16-only row copy and a packed column copy (the forward's X) take
// kSrRhtRowGrid: on by default since session 23 (H100, bench quant "nvfp4 train x" 16384 x 8192:
// 0.405 -> 0.359 ms, 72.7% -> 82.0% of copy bandwidth; test_quant_cuda passes either way);
// FOURBIT_QUANT_X_ROW_GRID=0 takes kSrRht for A/B runs. Read once per process.
bool x_row_grid() {
  static const bool on = env_switch("FOURBIT_QUANT_X_ROW_GRID") != 0;
  return on;
}

template <typename InT, Format F, bool kTwoD>
void launch_tile(const Params& p, cudaStream_t stream) {
  if (p.four_over_six) {
    launch_tile_kernel<InT, F, kTwoD, kAll>(p, stream);
  } else if (p.stochastic || p.rht) {
    // Only NVFP4 1x16 has its own SR + RHT kernel (the gradients); the others take kAll.
    if constexpr (F == Format::kNvfp4 && !kTwoD) {
      const bool bf16_only = p.row.data == nullptr && p.row.scales == nullptr &&
                             p.col.data == nullptr && p.col.scales == nullptr;
      const bool row_bf16_col_packed = p.row.data == nullptr && p.row.scales == nullptr &&
                                       p.row.bf16 != nullptr && p.col.data != nullptr;
      if (bf16_only && sr_rht_bf16_direct()) {
        launch_tile_kernel<InT, F, kTwoD, kSrRhtBf16Only>(p, stream);
      } else if (row_bf16_col_packed && x_row_grid()) {
        launch_tile_kernel<InT, F, kTwoD, kSrRhtRowGrid>(p, stream);
      } else {
        launch_tile_kernel<InT, F, kTwoD, kSrRht>(p, stream);
      }
    } else {
      launch_tile_kernel<InT, F, kTwoD, kAll>(p, stream);
    }
  } else {
    launch_tile_kernel<InT, F, kTwoD, kRoundNearest>(p, stream);
  }
}

template <typename InT>
void launch_format(Format format, bool block_2d, const Params& p, cudaStream_t stream) {
  const bool row_only = p.col.data == nullptr && p.col.bf16 == nullptr;
  const bool whole_warps = (p.rows * (p.cols / 16)) % 32 == 0 && p.cols % 128 == 0;
  if (row_only && whole_warps && !block_2d && !p.four_over_six) {
    switch (format) {
      case Format::kNvfp4: launch_rowwise<InT, Format::kNvfp4>(p, stream); return;
      case Format::kMxfp8: launch_rowwise<InT, Format::kMxfp8>(p, stream); return;
      case Format::kFp8Block: launch_rowwise<InT, Format::kFp8Block>(p, stream); return;
      default: break;  // FP8 per tensor: the tile kernel
    }
  }
  switch (format) {
    case Format::kNvfp4:
      if (block_2d) {
        launch_tile<InT, Format::kNvfp4, true>(p, stream);
      } else {
        launch_tile<InT, Format::kNvfp4, false>(p, stream);
      }
      break;
    case Format::kMxfp8: launch_tile<InT, Format::kMxfp8, false>(p, stream); break;
    case Format::kFp8Block:
      if (block_2d) {
        launch_tile<InT, Format::kFp8Block, true>(p, stream);
      } else {
        launch_tile<InT, Format::kFp8Block, false>(p, stream);
      }
      break;
    case Format::kFp8Tensor: launch_tile<InT, Format::kFp8Tensor, false>(p, stream); break;
  }
}

}  // namespace

namespace kernels {

int tile_rows(Format format) { return format == Format::kFp8Block ? 128 : 64; }
int tile_cols(Format) { return 128; }

void launch_quantize(Format format, bool block_2d, bool bf16_source, const Params& p,
                     cudaStream_t stream) {
  if (bf16_source) {
    launch_format<uint16_t>(format, block_2d, p, stream);
  } else {
    launch_format<float>(format, block_2d, p, stream);
  }
}

void launch_amax(const void* src, bool bf16_source, int64_t rows, int64_t cols, bool rht,
                 uint16_t sign_mask, float* row_amax, float* col_amax, int* error_flags,
                 cudaStream_t stream, AmaxTicket ticket) {
  const int sms = current_device_sm_count();
  const int element_bytes = bf16_source ? 2 : 4;
  const int64_t bytes = rows * cols * element_bytes;
  const bool flat = !rht && bytes % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0;
  const bool rht_fast = rht && (cols * element_bytes) % 8 == 0 && reinterpret_cast<uintptr_t>(src) % 8 == 0;
  // The ticket reduction (no zeroed outputs needed) serves the two fast kernels; the general
  // amax_kernel and a call without a ticket publish with atomicMax into zeroed amaxes.
  // A ticket with fewer partials than the grid may have CTAs (another device's) is not taken.
  if (!(flat || rht_fast) || ticket.capacity < sms * 8) ticket = AmaxTicket{};
  if (ticket.count == nullptr) {
    device_fill_async(row_amax, 0, sizeof(float), stream);
    if (col_amax) device_fill_async(col_amax, 0, sizeof(float), stream);
  }
  if (flat) {
    const int64_t chunks = bytes / 16;
    const int blocks = (int)std::max<int64_t>(
        1, std::min<int64_t>((chunks + 4 * kThreads - 1) / (4 * kThreads), (int64_t)sms * 8));
    const uint4* s4 = static_cast<const uint4*>(src);
    if (bf16_source) {
      FOURBIT_CUDA_CHECK(core::launch_pdl(amax_flat_kernel<uint16_t>, dim3(blocks), dim3(kThreads), 0, stream, s4, chunks,
                                          row_amax, col_amax, error_flags, ticket));
    } else {
      FOURBIT_CUDA_CHECK(core::launch_pdl(amax_flat_kernel<float>, dim3(blocks), dim3(kThreads), 0, stream, s4, chunks,
                                          row_amax, col_amax, error_flags, ticket));
    }
    FOURBIT_CUDA_CHECK_LAUNCH();
    return;
  }
  if (rht_fast) {
    const int64_t strips = (rows / 16) * (cols * element_bytes / 8);
    const int blocks = (int)std::max<int64_t>(
        1, std::min<int64_t>((strips + kThreads - 1) / kThreads, (int64_t)sms * 8));
    if (bf16_source) {
      FOURBIT_CUDA_CHECK(core::launch_pdl(amax_rht_kernel<uint16_t>, dim3(blocks), dim3(kThreads), 0, stream,
                                          static_cast<const uint16_t*>(src), rows, cols, sign_mask,
                                          row_amax, col_amax, error_flags, ticket));
    } else {
      FOURBIT_CUDA_CHECK(core::launch_pdl(amax_rht_kernel<float>, dim3(blocks), dim3(kThreads), 0, stream,
                                          static_cast<const float*>(src), rows, cols, sign_mask,
                                          row_amax, col_amax, error_flags, ticket));
    }
    FOURBIT_CUDA_CHECK_LAUNCH();
    return;
  }
  const int64_t strips = (rows / 16) * cols;
  const int blocks = (int)std::min<int64_t>((strips + kThreads - 1) / kThreads, (int64_t)sms * 8);
  if (bf16_source) {
    FOURBIT_CUDA_CHECK(core::launch_pdl(amax_kernel<uint16_t>, dim3(blocks), dim3(kThreads), 0, stream,
                                        static_cast<const uint16_t*>(src), rows, cols, rht, sign_mask, row_amax,
                                        col_amax, error_flags));
  } else {
    FOURBIT_CUDA_CHECK(core::launch_pdl(amax_kernel<float>, dim3(blocks), dim3(kThreads), 0, stream,
                                        static_cast<const float*>(src), rows, cols, rht, sign_mask, row_amax,
                                        col_amax, error_flags));
  }
  FOURBIT_CUDA_CHECK_LAUNCH();
}

void launch_row_amax(const void* src, bool bf16_source, int64_t rows, int64_t cols, float* row_amax,
                     int* error_flags, cudaStream_t stream) {
  if (rows == 0) return;
  const unsigned blocks = (unsigned)((rows + kThreads / 32 - 1) / (kThreads / 32));
  if (bf16_source) {
    FOURBIT_CUDA_CHECK(core::launch_pdl(row_amax_kernel<uint16_t>, dim3(blocks), dim3(kThreads), 0, stream,
                                        static_cast<const uint16_t*>(src), rows, cols, row_amax, error_flags));
  } else {
    FOURBIT_CUDA_CHECK(core::launch_pdl(row_amax_kernel<float>, dim3(blocks), dim3(kThreads), 0, stream,
                                        static_cast<const float*>(src), rows, cols, row_amax, error_flags));
  }
  FOURBIT_CUDA_CHECK_LAUNCH();
}

void launch_dequantize(const DequantParams& p, cudaStream_t stream) {
  const int64_t n = p.rows * p.cols;
  const int blocks = (int)std::min<int64_t>((n + 255) / 256, 65536);
  FOURBIT_CUDA_CHECK(core::launch_pdl(dequantize_kernel, dim3(blocks), dim3(256), 0, stream, p));
  FOURBIT_CUDA_CHECK_LAUNCH();
}

void launch_fill_normal(void* dst, bool bf16, int64_t n, uint64_t seed, cudaStream_t stream) {
  const int blocks = (int)std::min<int64_t>((n + 255) / 256, 132 * 16);
  fill_normal_kernel<<<blocks, 256, 0, stream>>>(dst, bf16, n, seed);
  FOURBIT_CUDA_CHECK_LAUNCH();
}

}  // namespace kernels
}  // namespace fourbit::quant
