// Element codecs: E2M1 (FP4), E4M3 and E5M2 (FP8), E8M0 (power-of-two scales) and BF16.
// Bit-exact, host and device, following ../shared/docs/NUMERICS.md sections 1.1-1.4 and 9.1-9.5.
//
// Encoding (FP32 -> code) is round-to-nearest-even with CUDA hardware semantics:
//  * signed zero keeps its sign (-0.0 -> the negative-zero code where the format has one);
//  * subnormals of the target are produced (E2M1 0.5; E4M3 down to 2^-9; E5M2 down to 2^-16);
//  * Saturation::kSatFinite (what every GPU conversion does): finite overflow and +-Inf become
//    +-max finite; Saturation::kNoSat (ml_dtypes, CUDA __NV_NOSAT): overflow becomes NaN (E4M3)
//    or +-Inf (E5M2); E2M1 has neither and always saturates;
//  * NaN input: E2M1 -> 0x7 (+6), E4M3 -> 0x7F, E5M2 -> 0x7F, E8M0 -> 0xFF, BF16 -> 0x7FFF.
//    fourbit rejects NaN/Inf in tensors before quantizing them, but the codecs still define it.
// Stochastic rounding (…_sr) follows Transformer Engine's software emulation of cvt.rs (NUMERICS
// 1.4): t = |x| + u * step(|x|), then truncate t onto the grid and saturate, with 8 random bits
// per element, except that the dither is centred: u = (rbits8 + 1/2) / 256 instead of TE's
// rbits8 / 256. TE's choice makes P(round up) = floor(256 f) / 256 for a fraction f of the step,
// a systematic downward drift of about step/512 per element that fourbit's unbiasedness test
// detects over a million draws; the centred dither gives P = round(256 f) / 256, zero drift on
// average (the error for one fixed f stays below step/512).
#pragma once

#include "formats/fp_ops.h"

#include <cstdint>

namespace fourbit::formats {

enum class Saturation : uint8_t { kSatFinite, kNoSat };

// A small IEEE-like float format with a sign bit (E2M1, E4M3, E5M2).
struct MiniFloat {
  int exp_bits;
  int man_bits;
  int bias;
  int emin;       // exponent of the smallest normal (1 - bias)
  int emax;       // exponent of the largest finite value's binade
  int max_code;   // code (sign clear) of the largest finite value
  int nan_code;   // code returned for NaN input (sign clear); -1 if the format has none
  int inf_code;   // code of +Inf; -1 if the format has none
};

inline constexpr MiniFloat kE2M1{2, 1, 1, 0, 2, 0x7, -1, -1};
inline constexpr MiniFloat kE4M3{4, 3, 7, -6, 8, 0x7E, 0x7F, -1};
inline constexpr MiniFloat kE5M2{5, 2, 15, -14, 15, 0x7B, 0x7F, 0x7C};

inline constexpr float kE2M1Max = 6.0f;
inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kE5M2Max = 57344.0f;

// Round |x| (finite, >= 0) to the format's grid with RNE; returns the magnitude code, which may
// exceed max_code (overflow) only if the caller did not saturate first.
template <const MiniFloat& F>
FOURBIT_HD uint32_t minifloat_magnitude_code_rn(float a) {
  const uint32_t bits = f32_bits(a);
  int e = (int)(bits >> 23) - 127;  // floor(log2 a) for normal a; FP32 subnormals are << emin
  if (e < F.emin) e = F.emin;
  if (e > F.emax + 1) return 0xFFFFu;  // far beyond the largest binade: overflow
  // Adding M = 2^(23 + qe) rounds a to a multiple of the quantum 2^qe (RNE, exact otherwise);
  // the difference of the bit patterns is that multiple as an integer.
  const int qe = e - F.man_bits;
  const float magic = pow2_f32(23 + qe);
  const uint32_t n = f32_bits(add_rn(a, magic)) - f32_bits(magic);
  // ((e + bias - 1) << m) + n covers subnormals (e = emin, n < 2^m), normals and the carry into
  // the next binade (n = 2^(m+1)).
  return ((uint32_t)(e + F.bias - 1) << F.man_bits) + n;
}

template <const MiniFloat& F>
FOURBIT_HD uint8_t encode_minifloat_rn(float x, Saturation sat = Saturation::kSatFinite) {
  const uint32_t bits = f32_bits(x);
  const uint32_t sign_bit = 1u << (F.exp_bits + F.man_bits);
  const uint32_t sign = (bits >> 31) ? sign_bit : 0u;
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) {  // NaN
    return (uint8_t)(F.nan_code >= 0 ? F.nan_code : F.max_code);  // E2M1: +6 (CUDA)
  }
  uint32_t code;
  if (abs_bits == 0x7F800000u) {
    code = 0xFFFFu;  // Inf: treated as overflow
  } else {
    code = minifloat_magnitude_code_rn<F>(f32_from_bits(abs_bits));
  }
  if (code > (uint32_t)F.max_code) {
    if (sat == Saturation::kSatFinite || (F.nan_code < 0 && F.inf_code < 0)) {
      code = (uint32_t)F.max_code;
    } else if (F.inf_code >= 0) {
      code = (uint32_t)F.inf_code;
    } else {
      code = (uint32_t)F.nan_code;
    }
  }
  return (uint8_t)(code | sign);
}

template <const MiniFloat& F>
FOURBIT_HD float decode_minifloat(uint8_t code) {
  const uint32_t sign = (code >> (F.exp_bits + F.man_bits)) & 1u;
  const uint32_t mag = code & ((1u << (F.exp_bits + F.man_bits)) - 1u);
  const uint32_t exp_field = mag >> F.man_bits;
  const uint32_t man = mag & ((1u << F.man_bits) - 1u);
  float v;
  if (F.nan_code >= 0 && (int)mag == F.nan_code) {
    v = f32_from_bits(0x7FC00000u);
  } else if (F.inf_code >= 0 && exp_field == (1u << F.exp_bits) - 1u) {
    v = man == 0 ? f32_from_bits(0x7F800000u) : f32_from_bits(0x7FC00000u);
  } else {
    const int significand = (int)(exp_field == 0 ? man : man + (1u << F.man_bits));
    const int e = (exp_field == 0 ? 1 : (int)exp_field) - F.bias - F.man_bits;
    v = (float)significand * pow2_f32(e);  // exact: small integer times a power of two
  }
  return sign ? -v : v;
}

// Stochastic rounding of x onto the format's grid with 8 random bits (TE software emulation).
template <const MiniFloat& F>
FOURBIT_HD uint8_t encode_minifloat_sr(float x, uint32_t rbits8) {
  const uint32_t bits = f32_bits(x);
  const uint32_t sign_bit = 1u << (F.exp_bits + F.man_bits);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
    return (uint8_t)(F.nan_code >= 0 ? F.nan_code : F.max_code);
  }
  const uint32_t sign = (bits >> 31) ? sign_bit : 0u;
  const float a = abs_f32(x);
  // Grid spacing at a value v: 2^(max(floor(log2 v), emin) - man_bits).
  auto step_exponent = [](float v) {
    int e = (int)(f32_bits(v) >> 23) - 127;
    if (e < F.emin) e = F.emin;
    return e - F.man_bits;
  };
  const float max_value = decode_minifloat<F>((uint8_t)F.max_code);
  if (!(a < max_value)) return (uint8_t)(F.max_code | sign);  // saturates (covers Inf)
  const float u = (float)(2u * (rbits8 & 0xFFu) + 1u) * (1.0f / 512.0f);  // exact
  const float t = fma_rn(u, pow2_f32(step_exponent(a)), a);
  if (!(t < max_value)) return (uint8_t)(F.max_code | sign);
  // Truncate t onto the grid: floor(t / step_t) * step_t. t * 2^-qe is exact (power-of-two
  // scaling) and below 2^(man_bits + 1), so the integer conversion is the floor.
  const int qe = step_exponent(t);
  const uint32_t n = (uint32_t)mul_rn(t, pow2_f32(-qe));
  const int e = qe + F.man_bits;
  const uint32_t code = ((uint32_t)(e + F.bias - 1) << F.man_bits) + n;
  return (uint8_t)((code > (uint32_t)F.max_code ? (uint32_t)F.max_code : code) | sign);
}

// --- E2M1 -------------------------------------------------------------------------------------
FOURBIT_HD uint8_t encode_e2m1_rn(float x) { return encode_minifloat_rn<kE2M1>(x); }
// The same function as encode_e2m1_rn in fewer instructions (what the CUDA kernels use): adding
// M = 2^22, 2^23 or 2^24 to |x| < 2, < 4, >= 4 rounds it (RNE) to the E2M1 grid spacing of its
// range (0.5, 1, 2); the bit difference counts grid steps, offset by the range's first code.
// Tested equal to the generic encoder on a dense sweep (test_formats_element).
FOURBIT_HD uint8_t encode_e2m1_rn_fast(float x) {
  const uint32_t bits = f32_bits(x);
  const float a = f32_from_bits(bits & 0x7FFFFFFFu);
  if (a != a) return 0x7;  // NaN -> +6 (CUDA)
  const uint32_t magic_bits = a < 2.0f ? 0x4A800000u : (a < 4.0f ? 0x4B000000u : 0x4B800000u);
  const uint32_t first_code = (magic_bits - 0x4A800000u) >> 22;  // 0, 2, 4
  const uint32_t n = f32_bits(add_rn(a, f32_from_bits(magic_bits))) - magic_bits + first_code;
  return (uint8_t)((n < 7u ? n : 7u) | ((bits >> 28) & 0x8u));
}

// The E2M1 magic number for |x| = a in [0, 6]: 2^22, 2^23 + 2 or 2^24 + 8 for a < 2, < 4, >= 4,
// from a's exponent field clamped below at that of 1.0 (three integer instructions, no compare
// and select). Adding it to a rounds a to the E2M1 spacing of its range (0.5, 1, 2) and leaves the
// code, offset by the range's first code (0, 2, 4), in the low three bits of the sum.
FOURBIT_HD float e2m1_magic(float a) {
  const uint32_t b = f32_bits(a);
  const uint32_t range = ((b > 0x3F800000u ? b : 0x3F800000u) >> 23) - 127u;  // 0, 1, 2
  return f32_from_bits(0x4A800000u + range * 0x00800002u);
}

// Code = the low three bits of a magic sum, with x's sign in bit 3: x's bits 31..28 shifted
// down, bits 2..0 replaced (a single three-input logic instruction).
FOURBIT_HD uint32_t e2m1_with_sign(uint32_t magic_sum_bits, float x) {
  const uint32_t top = f32_bits(x) >> 28;
#if defined(__CUDA_ARCH__)
  uint32_t r;  // (sum & 7) | (top & ~7): spelled as lop3, which the compiler would split in two
  asm("lop3.b32 %0, %1, %2, 7, 0xE4;" : "=r"(r) : "r"(magic_sum_bits), "r"(top));
  return r;
#else
  return top ^ ((top ^ magic_sum_bits) & 0x7u);
#endif
}

FOURBIT_HD float abs_fast(float x) {
#if defined(__CUDA_ARCH__)
  return fabsf(x);  // folds into the using instruction as an operand modifier
#else
  return abs_f32(x);
#endif
}

// encode_e2m1_rn for any x that is not NaN, in about nine instructions (what the CUDA kernels
// use): |x| is clamped to 6 (saturation, Inf included), then e2m1_magic rounds it (RNE). For NaN
// it returns sign | 7 instead of 0x7; the kernels never feed it NaN (their inputs are checked
// finite and the element multipliers are finite and positive).
FOURBIT_HD uint32_t encode_e2m1_rn_not_nan(float x) {
  const float a = fmin_ieee(abs_fast(x), 6.0f);
  return e2m1_with_sign(f32_bits(add_rn(a, e2m1_magic(a))), x);
}

// encode_e2m1_sr for any x that is not NaN (NaN gives sign | 7), in about fifteen instructions:
// a = min(|x|, 6) (a >= 6 then always lands on code 7, as the saturation of the generic encoder);
// the dither u = (2 r + 1) / 512 is built from bits (1 + u has r in mantissa bits 22..15 and bit
// 14 set; subtracting 1 is exact); t = fma(u, step(a), a) is the generic encoder's t; and the
// floor of t onto the grid of t's range is the magic addition of e2m1_magic rounded toward zero
// (t < 8 always). Tested equal to encode_e2m1_sr for every rbits on a dense sweep.
FOURBIT_HD uint32_t encode_e2m1_sr_not_nan(float x, uint32_t rbits8) {
  const float a = fmin_ieee(abs_fast(x), 6.0f);
  const uint32_t ab = f32_bits(a);
  // step(a) = 2^(max(floor(log2 a), 0) - 1): 0.5, 1 or 2.
  const float step = f32_from_bits(((ab > 0x3F800000u ? ab : 0x3F800000u) & 0xFF800000u) - 0x00800000u);
  const float u = add_rn(f32_from_bits(0x3F804000u | ((rbits8 & 0xFFu) << 15)), -1.0f);
  const float t = fma_rn(u, step, a);
  return e2m1_with_sign(f32_bits(add_rz(t, e2m1_magic(t))), x);
}

// The E2M1 value of encode_e2m1_rn_not_nan(x) / encode_e2m1_sr_not_nan(x, rbits8), without the
// code: the grid point of the magic sum (sum - magic is exact: both lie in the magic's binade) with
// x's sign (a zero result keeps it, as the code's sign bit does). decode_e2m1(code) equals it for
// every x that is not NaN (tested on dense sweeps); the CUDA kernels that write only the
// scaled-domain BF16 copy use these and skip packing and decoding codes.
FOURBIT_HD float e2m1_with_sign_of(float grid, float x) {
  return f32_from_bits(f32_bits(grid) | (f32_bits(x) & 0x80000000u));
}
FOURBIT_HD float e2m1_value_rn_not_nan(float x) {
  const float a = fmin_ieee(abs_fast(x), 6.0f);
  const float m = e2m1_magic(a);
  return e2m1_with_sign_of(add_rn(add_rn(a, m), -m), x);
}
FOURBIT_HD float e2m1_value_sr_not_nan(float x, uint32_t rbits8) {
  const float a = fmin_ieee(abs_fast(x), 6.0f);
  const uint32_t ab = f32_bits(a);
  const float step = f32_from_bits(((ab > 0x3F800000u ? ab : 0x3F800000u) & 0xFF800000u) - 0x00800000u);
  const float u = add_rn(f32_from_bits(0x3F804000u | ((rbits8 & 0xFFu) << 15)), -1.0f);
  const float t = fma_rn(u, step, a);
  const float m = e2m1_magic(t);
  return e2m1_with_sign_of(add_rn(add_rz(t, m), -m), x);
}

FOURBIT_HD uint8_t encode_e2m1_sr(float x, uint32_t rbits8) {
  return encode_minifloat_sr<kE2M1>(x, rbits8);
}
FOURBIT_HD float decode_e2m1(uint8_t code) { return decode_minifloat<kE2M1>(code & 0xF); }

// --- E4M3 (OCP fn) ----------------------------------------------------------------------------
// On the device the saturating conversion is the hardware's cvt.rn.satfinite.e4m3x2.f32, which
// the software encoder models bit for bit (tested against the CUDA host functions); NaN inputs,
// which fourbit never encodes, are left to the hardware there.
FOURBIT_HD uint8_t encode_e4m3_rn(float x, Saturation sat = Saturation::kSatFinite) {
#if defined(__CUDA_ARCH__)
  if (sat == Saturation::kSatFinite) {
    uint16_t d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(0.0f), "f"(x));
    return (uint8_t)(d & 0xFF);
  }
#endif
  return encode_minifloat_rn<kE4M3>(x, sat);
}
FOURBIT_HD uint8_t encode_e4m3_sr(float x, uint32_t rbits8) {
  return encode_minifloat_sr<kE4M3>(x, rbits8);
}
FOURBIT_HD float decode_e4m3(uint8_t code) {
#if defined(__CUDA_ARCH__)
  // Exact through FP16 (every E4M3 value is an FP16 value), two instructions.
  uint32_t h2;
  float f;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((uint16_t)code));
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((uint16_t)(h2 & 0xFFFF)));
  return f;
#else
  return decode_minifloat<kE4M3>(code);
#endif
}

// --- E5M2 -------------------------------------------------------------------------------------
FOURBIT_HD uint8_t encode_e5m2_rn(float x, Saturation sat = Saturation::kSatFinite) {
  return encode_minifloat_rn<kE5M2>(x, sat);
}
FOURBIT_HD float decode_e5m2(uint8_t code) { return decode_minifloat<kE5M2>(code); }

// --- E8M0 -------------------------------------------------------------------------------------
// Unsigned power of two 2^(code - 127); code 0 = 2^-127 (an FP32 subnormal), 0xFF = NaN.
enum class E8m0Rounding : uint8_t { kTowardZero, kUp };

// Conversion of a value to E8M0 (CUDA __nv_cvt_float_to_e8m0 with __NV_SATFINITE; |x| is used).
FOURBIT_HD uint8_t encode_e8m0(float x, E8m0Rounding rounding) {
  const uint32_t bits = f32_bits(x) & 0x7FFFFFFFu;
  if (bits > 0x7F800000u) return 0xFF;   // NaN
  if (bits == 0x7F800000u) return 0xFE;  // Inf saturates
  uint32_t exponent = bits >> 23;
  const uint32_t mantissa = bits & 0x7FFFFFu;
  if (rounding == E8m0Rounding::kUp && mantissa > 0 && exponent != 0xFE &&
      !(exponent == 0 && mantissa <= 0x400000u)) {
    ++exponent;
  }
  return (uint8_t)exponent;
}

FOURBIT_HD float decode_e8m0(uint8_t code) {
  if (code == 0xFF) return f32_from_bits(0x7FC00000u);
  if (code == 0) return f32_from_bits(0x00400000u);
  return f32_from_bits((uint32_t)code << 23);
}

// 1 / decode_e8m0(code), exact (Transformer Engine exp2f_rcp): 2^(127 - code).
FOURBIT_HD float e8m0_reciprocal(uint8_t code) {
  if (code == 0xFF) return f32_from_bits(0x7FC00000u);
  if (code == 0xFE) return f32_from_bits(0x00400000u);
  return f32_from_bits((uint32_t)(254 - code) << 23);
}

// --- BF16 -------------------------------------------------------------------------------------
FOURBIT_HD uint16_t encode_bf16_rn(float x) {
  const uint32_t u = f32_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;  // canonical NaN (CUDA)
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
// Stochastic rounding to BF16 with 16 random bits: add them below the kept bits and truncate.
FOURBIT_HD uint16_t encode_bf16_sr(float x, uint32_t rbits16) {
  const uint32_t u = f32_bits(x);
  if ((u & 0x7FFFFFFFu) >= 0x7F800000u) return encode_bf16_rn(x);  // NaN, Inf unchanged
  return (uint16_t)((u + (rbits16 & 0xFFFFu)) >> 16);
}
FOURBIT_HD float decode_bf16(uint16_t b) { return f32_from_bits((uint32_t)b << 16); }
FOURBIT_HD float round_to_bf16(float x) { return decode_bf16(encode_bf16_rn(x)); }

// --- FP4 packing ------------------------------------------------------------------------------
// Two E2M1 codes per byte: the element with the lower index in bits 3..0.
FOURBIT_HD uint8_t pack_e2m1x2(uint8_t even, uint8_t odd) {
  return (uint8_t)((even & 0xF) | ((odd & 0xF) << 4));
}
FOURBIT_HD uint8_t unpack_e2m1(uint8_t byte, int index_in_byte) {
  return index_in_byte ? (byte >> 4) : (byte & 0xF);
}

}  // namespace fourbit::formats
