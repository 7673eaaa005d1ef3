// Per-block quantizer arithmetic shared, bit for bit, by the CPU reference (reference.cpp) and
// the CUDA kernels (quantize_kernels.cu). Every FP32 operation is spelled out in the order that
// ../shared/docs/NUMERICS.md prescribes; the comments cite its sections.
#pragma once

#include "core/hd.h"
#include "formats/element.h"
#include "formats/fp_ops.h"

#include <cstdint>

namespace fourbit::quant {

using formats::add_rn;
using formats::div_rn;
using formats::mul_rn;
using formats::sub_rn;

// ---------------------------------------------------------------------------------------------
// NVFP4, amax-to-6 (Transformer Engine kernel order, NUMERICS 3.2)
// ---------------------------------------------------------------------------------------------

// The per-tensor "global" constant C = 6 * E4M3 max = 2688 (TE). For unbiased stochastic rounding
// (NUMERICS 1.4, the 16/17 adjustment) the elements are additionally scaled by 16/17 before
// rounding: block scales still come from C, but the element multiplier and the decode use
// C' = f32(2688 * 16 / 17). A block maximum whose E4M3 scale rounded down (by at most 1/17) then
// lands at <= 6 * (16/17) * (17/16) = 6 instead of up to 6.375, so SR never saturates it.
inline constexpr float kNvfp4GlobalConstant = 2688.0f;
inline constexpr float kNvfp4GlobalConstantUnbiasedSr = 2529.8823529411765f;  // f32(2688*16/17)
inline constexpr uint32_t kRcp6Bits = 0x3E2AAAABu;  // f32(1/6)

struct Nvfp4TensorScales {
  float s_enc;       // global encode scale min(C / A, FLT_MAX), 1 when A is 0 or Inf
  float s_dec;       // RN(1 / s_enc)
  float s_enc_rcp6;  // f32(s_enc * f32(1/6)), the per-block multiplier of the block amax
  float s_dec_elem;  // decode scale used by the element multiplier: s_dec, or RN(1 / RN(C' / A))
};

FOURBIT_HD float nvfp4_global_encode_scale(float amax, float constant) {
  float s_enc = formats::fmin_ieee(div_rn(constant, amax), formats::kFloatMax);
  if (amax == 0.0f || s_enc == 0.0f) s_enc = 1.0f;
  return s_enc;
}

// scale_constant: C for the block scales (2688); element_constant: C or C' (16/17 adjusted).
FOURBIT_HD Nvfp4TensorScales nvfp4_tensor_scales(float amax, float scale_constant,
                                                 float element_constant) {
  Nvfp4TensorScales s;
  s.s_enc = nvfp4_global_encode_scale(amax, scale_constant);
  s.s_dec = formats::rcp_rn(s.s_enc);
  s.s_enc_rcp6 = mul_rn(s.s_enc, formats::f32_from_bits(kRcp6Bits));
  s.s_dec_elem = element_constant == scale_constant
                     ? s.s_dec
                     : formats::rcp_rn(nvfp4_global_encode_scale(amax, element_constant));
  return s;
}

// E4M3 block scale s_b from the block amax: e4m3_satfinite(a_b * (S_enc * f32(1/6))).
FOURBIT_HD uint8_t nvfp4_block_scale(float block_amax, const Nvfp4TensorScales& ts) {
  const float t = mul_rn(block_amax, ts.s_enc_rcp6);
  return formats::encode_e4m3_rn(formats::fmin_ieee(t, formats::kFloatMax));
}

// Element multiplier e_b = min(1 / (s_b * S_dec), FLT_MAX); s_b = 0 gives FLT_MAX (TE kernel).
// (S_dec is s_dec_elem: the 16/17-adjusted one for unbiased SR.)
FOURBIT_HD float nvfp4_element_multiplier(uint8_t block_scale, const Nvfp4TensorScales& ts) {
  const float denom = mul_rn(formats::decode_e4m3(block_scale), ts.s_dec_elem);
  return formats::fmin_ieee(formats::rcp_rn(denom), formats::kFloatMax);
}

FOURBIT_HD uint8_t nvfp4_encode_element(float x, float multiplier, bool stochastic,
                                        uint32_t rbits8) {
  const float y = mul_rn(x, multiplier);
  return stochastic ? formats::encode_e2m1_sr(y, rbits8) : formats::encode_e2m1_rn(y);
}

// The per-tensor decode scale A * f32(1 / C): what multiplies a GEMM over scaled-domain operands.
FOURBIT_HD float nvfp4_global_decode_scale(float amax, float global_constant) {
  return mul_rn(amax, div_rn(1.0f, global_constant));
}

// Dequantized value: f32(q * s_b) (exact) times the global decode scale. Transformer Engine's
// dequantize kernel (NUMERICS 3.5) computes q * f32(f32(s_b * A) * f32(1 / C)) instead, whose
// intermediate s_b * A overflows FP32 to Inf (and 0 * Inf = NaN) once A > FLT_MAX / 448 ~ 7.6e35;
// this order never overflows (|q * s_b| <= 2688) and differs from TE's by at most an ulp.
FOURBIT_HD float nvfp4_dequantize_element(uint8_t code, uint8_t block_scale, float amax,
                                          float global_constant) {
  const float scaled = mul_rn(formats::decode_e2m1(code), formats::decode_e4m3(block_scale));
  return mul_rn(scaled, nvfp4_global_decode_scale(amax, global_constant));
}

// ---------------------------------------------------------------------------------------------
// NVFP4, Four Over Six (fouroversix reference algorithm, NUMERICS 5.1)
// ---------------------------------------------------------------------------------------------

enum class FourOverSixMetric : uint8_t { kMse, kMae, kAbsMax };

inline constexpr float kFourOverSixGlobalConstant = 1536.0f;  // 6 * 256
inline constexpr float kFourOverSixGlobalConstantUnbiasedSr = 1445.6470588235295f;  // f32(1536*16/17)

// Division by the Four Over Six decode constant C without a division: the dequantization divides
// every element by C. For C = 1536 and C = f32(1536 * 16/17) and |a| in [2^-64, 2^64), the
// reciprocal R = RN(1 / C) with one FMA correction, q = RN(a R), q' = RN(q + RN(a - q C) R), equals
// RN(a / C): test_quant_reference checks every significand at both ends of that range, and the
// operations scale exactly by powers of two in between (no intermediate is subnormal at the low
// end nor overflows at the high end: checked there too); a = +-0 gives +-0. Outside it (tiny,
// huge, Inf, NaN) and for any other C, div_rn. rcp_c = 0 marks a constant without that proof.
inline constexpr uint32_t kFourOverSixFastDivMinBits = 0x1F800000u;  // 2^-64
inline constexpr uint32_t kFourOverSixFastDivEndBits = 0x5F800000u;  // 2^64

FOURBIT_HD float four_over_six_constant_reciprocal(float c) {
  const bool proven = c == kFourOverSixGlobalConstant || c == kFourOverSixGlobalConstantUnbiasedSr;
  return proven ? formats::rcp_rn(c) : 0.0f;
}

// RN(a / c), bit for bit; rcp_c = four_over_six_constant_reciprocal(c).
FOURBIT_HD float four_over_six_div_constant(float a, float c, float rcp_c) {
  const uint32_t bits = formats::f32_bits(a), mag = bits & 0x7FFFFFFFu;
  if (rcp_c != 0.0f && (mag == 0 || mag - kFourOverSixFastDivMinBits <
                                        kFourOverSixFastDivEndBits - kFourOverSixFastDivMinBits)) {
    const float q = mul_rn(a, rcp_c);
    const float q1 = formats::fma_rn(formats::fma_rn(-q, c, a), rcp_c, q);
    // q1 has the sign of a except for a = -0 (q1 = +0): a / c keeps the sign of a.
    return formats::f32_from_bits(formats::f32_bits(q1) | (bits & 0x80000000u));
  }
  return div_rn(a, c);
}

struct FourOverSixTensorScales {
  float amax;      // A
  float constant;  // element/decode constant: 6 * 256, or times 16/17 for unbiased SR
  float rcp_constant;  // four_over_six_constant_reciprocal(constant)
  float encode;    // f32(6 * 256 / A): block scales
  float decode;    // f32(1 / f32(constant / A)): element multiplier
  bool zero;       // A == 0: every scale and code is 0
};

FOURBIT_HD FourOverSixTensorScales four_over_six_tensor_scales(float amax, float scale_constant,
                                                               float element_constant) {
  FourOverSixTensorScales s;
  s.amax = amax;
  s.constant = element_constant;
  s.rcp_constant = four_over_six_constant_reciprocal(element_constant);
  s.zero = !(amax > 0.0f);
  s.encode = s.zero ? 0.0f : div_rn(scale_constant, amax);
  s.decode = s.zero ? 0.0f : div_rn(1.0f, div_rn(element_constant, amax));
  return s;
}

struct FourOverSixScalePair {
  uint8_t map6;  // E4M3 scale that maps the block max to 6
  uint8_t map4;  // E4M3 scale that maps the block max to 4 (1.5x larger)
};

FOURBIT_HD FourOverSixScalePair four_over_six_scales(float block_amax,
                                                     const FourOverSixTensorScales& ts) {
  if (ts.zero) return {0, 0};
  const float base = mul_rn(div_rn(block_amax, 6.0f), ts.encode);
  return {formats::encode_e4m3_rn(base), formats::encode_e4m3_rn(mul_rn(base, 1.5f))};
}

// Element multiplier f32(1 / f32(decode * s)); 0 when the scale is 0 (every code becomes +0).
FOURBIT_HD float four_over_six_multiplier(uint8_t scale, const FourOverSixTensorScales& ts) {
  const float s = formats::decode_e4m3(scale);
  if (s == 0.0f || ts.zero) return 0.0f;
  return div_rn(1.0f, mul_rn(ts.decode, s));
}

FOURBIT_HD uint8_t four_over_six_encode_element(float x, float multiplier, bool stochastic,
                                                uint32_t rbits8) {
  if (multiplier == 0.0f) return 0;
  const float y = mul_rn(x, multiplier);
  return stochastic ? formats::encode_e2m1_sr(y, rbits8) : formats::encode_e2m1_rn(y);
}

// The reference's dequantization used for the error metric: ((q * s) * A) / C.
FOURBIT_HD float four_over_six_dequantize_element(uint8_t code, uint8_t scale,
                                                  const FourOverSixTensorScales& ts) {
  const float qs = mul_rn(formats::decode_e2m1(code), formats::decode_e4m3(scale));
  return div_rn(mul_rn(qs, ts.amax), ts.constant);
}

// Combines partial errors (2D tiles: per-row sums combined in row order).
FOURBIT_HD float four_over_six_combine_errors(float total, float part, FourOverSixMetric metric) {
  return metric == FourOverSixMetric::kAbsMax ? formats::fmax_ieee(total, part)
                                              : add_rn(total, part);
}

// One element's error term: (q - x)^2, |q - x| or |q - x| for MSE, MAE and max-abs. Terms may be
// computed in parallel; combining them (four_over_six_combine_errors) from 0 in element order is
// four_over_six_accumulate_error's sequential sum exactly.
FOURBIT_HD float four_over_six_error_term(float dequantized, float x, FourOverSixMetric metric) {
  const float diff = sub_rn(dequantized, x);
  return metric == FourOverSixMetric::kMse ? mul_rn(diff, diff) : formats::abs_f32(diff);
}

// Accumulates one element's error into `err` (sequential FP32, element order fixed by caller).
FOURBIT_HD float four_over_six_accumulate_error(float err, float dequantized, float x,
                                                FourOverSixMetric metric) {
  return four_over_six_combine_errors(err, four_over_six_error_term(dequantized, x, metric), metric);
}

// ---------------------------------------------------------------------------------------------
// MXFP8: E4M3 elements, E8M0 scale per 32 (NUMERICS 2.2-2.4)
// ---------------------------------------------------------------------------------------------

enum class MxScaleRule : uint8_t {
  kRoundUp,  // "RCEIL": code = ceil_e8m0(amax * f32(1/448)) (TE, cuBLAS, MXFP8 paper) — default
  kFloor,    // OCP MX v1.0: floor(log2 amax) - 8, elements saturate
};

inline constexpr uint32_t kRcp448Bits = 0x3B124925u;  // f32(1/448), slightly above 1/448

FOURBIT_HD uint8_t mxfp8_scale_code(float block_amax, MxScaleRule rule) {
  if (rule == MxScaleRule::kRoundUp) {
    return formats::encode_e8m0(mul_rn(block_amax, formats::f32_from_bits(kRcp448Bits)),
                                formats::E8m0Rounding::kUp);
  }
  const uint32_t bits = formats::f32_bits(block_amax) & 0x7FFFFFFFu;
  if (bits >= 0x7F800000u) return 0xFF;  // non-finite amax: NaN block
  int unbiased = (int)(bits >> 23) - 127 - 8;
  if (unbiased < -127) unbiased = -127;
  if (unbiased > 128) unbiased = 128;
  return (uint8_t)(unbiased + 127);
}

FOURBIT_HD uint8_t mxfp8_encode_element(float x, uint8_t scale_code, bool stochastic,
                                        uint32_t rbits8) {
  const float y = mul_rn(x, formats::e8m0_reciprocal(scale_code));
  return stochastic ? formats::encode_e4m3_sr(y, rbits8) : formats::encode_e4m3_rn(y);
}

// TE dequantize: f32(2^(code-127) * P).
FOURBIT_HD float mxfp8_dequantize_element(uint8_t code, uint8_t scale_code) {
  return mul_rn(formats::decode_e8m0(scale_code), formats::decode_e4m3(code));
}

// ---------------------------------------------------------------------------------------------
// FP8 E4M3 with FP32 scales: per tensor, 1x128 or 128x128 blocks (NUMERICS 6, TE reference
// quantize_scale_calc.py): encode scale = 448 / amax (1 when amax is 0, FLT_MAX when the
// quotient overflows), optionally rounded down to a power of two; the stored scale is its
// reciprocal (the decode scale, "scale_inv").
// ---------------------------------------------------------------------------------------------

FOURBIT_HD float fp8_encode_scale(float amax, bool pow2) {
  if (amax == 0.0f) return 1.0f;
  float scale = div_rn(formats::kE4M3Max, amax);
  if (!formats::is_finite_f32(scale)) scale = formats::kFloatMax;
  if (pow2) scale = formats::f32_from_bits(formats::f32_bits(scale) & 0xFF800000u);
  return scale;
}

FOURBIT_HD uint8_t fp8_encode_element(float x, float encode_scale, bool stochastic,
                                      uint32_t rbits8) {
  const float y = mul_rn(x, encode_scale);
  return stochastic ? formats::encode_e4m3_sr(y, rbits8) : formats::encode_e4m3_rn(y);
}

FOURBIT_HD float fp8_dequantize_element(uint8_t code, float decode_scale) {
  return mul_rn(formats::decode_e4m3(code), decode_scale);
}

// ---------------------------------------------------------------------------------------------
// Random Hadamard transform, 16 points (NUMERICS 3.4): y = x H with H = (1/4) diag(s) H16.
// Computed as sign flip, the in-place fast Walsh-Hadamard butterfly in FP32 (stages h = 1, 2, 4,
// 8), times 1/4, then rounded to BF16: a fixed operation order, so CPU and GPU agree bit for bit.
// ---------------------------------------------------------------------------------------------

// Transformer Engine's fixed sign vector as a mask (bit i set iff s_i = -1).
inline constexpr uint16_t kRhtFixedSignMask = 0xD7E8;

FOURBIT_HD void fwht16(float v[16]) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int h = 1; h < 16; h <<= 1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int i = 0; i < 16; ++i) {
      if (i & h) continue;
      const float a = v[i], b = v[i + h];
      v[i] = add_rn(a, b);
      v[i + h] = sub_rn(a, b);
    }
  }
}

// In place: v <- bf16(v H). Values are returned as FP32 holding BF16-representable numbers.
FOURBIT_HD void rht16_forward(float v[16], uint16_t sign_mask) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < 16; ++i) {
    if ((sign_mask >> i) & 1u) v[i] = -v[i];
  }
  fwht16(v);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < 16; ++i) v[i] = formats::round_to_bf16(mul_rn(v[i], 0.25f));
}

// In place: v <- v H^T (the exact inverse in real arithmetic; FP32, no BF16 rounding).
FOURBIT_HD void rht16_inverse(float v[16], uint16_t sign_mask) {
  fwht16(v);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < 16; ++i) {
    v[i] = mul_rn(v[i], 0.25f);
    if ((sign_mask >> i) & 1u) v[i] = -v[i];
  }
}

}  // namespace fourbit::quant
