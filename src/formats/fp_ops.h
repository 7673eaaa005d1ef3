// FP32 building blocks that give the same bits on the CPU and the GPU.
//
// Every arithmetic helper here is one IEEE-754 binary32 operation rounded to nearest-even, never
// contracted into an FMA: on the device through the __f*_rn intrinsics (which nvcc never fuses),
// on the host through plain operators compiled with -ffp-contract=off (set for the whole project).
// Bit casts go through std::bit_cast on the host and __float_as_uint on the device.
#pragma once

#include "core/hd.h"

#include <cstdint>
#if !defined(__CUDA_ARCH__)
#include <bit>
#include <cfenv>
#include <cmath>
#endif

namespace fourbit::formats {

FOURBIT_HD uint32_t f32_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  return std::bit_cast<uint32_t>(x);
#endif
}

FOURBIT_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}

FOURBIT_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

FOURBIT_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

FOURBIT_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

FOURBIT_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// 1 / a, correctly rounded (equal to div_rn(1, a); cheaper on the device).
FOURBIT_HD float rcp_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(a);
#else
  return 1.0f / a;
#endif
}

FOURBIT_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// a + b rounded toward zero (one IEEE operation; the device's FADD.RZ). The host switches the
// rounding mode around one volatile addition: it is only used by tests of the device encoders.
FOURBIT_HD float add_rz(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rz(a, b);
#else
  const int mode = std::fegetround();
  std::fesetround(FE_TOWARDZERO);
  volatile float va = a, vb = b;
  volatile float r = va + vb;
  std::fesetround(mode);
  return r;
#endif
}

// IEEE fminf/fmaxf semantics: a NaN operand is ignored (the other operand is returned).
FOURBIT_HD float fmin_ieee(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fminf(a, b);
#else
  return std::fmin(a, b);
#endif
}
FOURBIT_HD float fmax_ieee(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fmaxf(a, b);
#else
  return std::fmax(a, b);
#endif
}

FOURBIT_HD float abs_f32(float x) { return f32_from_bits(f32_bits(x) & 0x7FFFFFFFu); }
FOURBIT_HD bool is_nan_f32(float x) { return (f32_bits(x) & 0x7FFFFFFFu) > 0x7F800000u; }
FOURBIT_HD bool is_finite_f32(float x) { return (f32_bits(x) & 0x7F800000u) != 0x7F800000u; }

// 2^k for k in the FP32 normal range [-126, 127], built from bits (exact).
FOURBIT_HD float pow2_f32(int k) { return f32_from_bits((uint32_t)(k + 127) << 23); }

constexpr float kFloatMax = 3.40282346638528859812e+38F;

}  // namespace fourbit::formats
