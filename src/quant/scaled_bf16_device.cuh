// Device helpers for NVFP4 scaled-domain BF16 values (nvcc only, header-only): the branch-free
// E2M1 decode, the 16 scaled values q * s_b of a packed micro-block, and the 16-value BF16 store by
// the hardware's cvt.rn.bf16x2.f32. Shared by the quantizer's kernels (quantize_kernels.cu), which
// write the copies the emulated GEMMs read, and by the GEMM's own conversion of packed operands
// (gemm/gemm_kernels.cu), so both give the bits of quant::dequantize_bf16_scaled_reference.
//
// Invariants: e2m1_value(c) == formats::decode_e2m1(c) for every 4-bit code; q * s_b of an E2M1
// code and an E4M3 scale has at most 6 significant bits, so FP32 and BF16 hold it exactly and the
// hardware conversion's rounding never acts on these values (it equals encode_bf16_rn anyway:
// RNE, overflow to Inf, canonical NaN).
#pragma once

#include "formats/element.h"
#include "formats/fp_ops.h"

#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

namespace fourbit::quant {

// E2M1 value of a code (formats::decode_e2m1 without branches): magnitudes 0 and 0.5 for codes
// 0 and 1, else the FP32 with exponent and top mantissa bit taken from the code.
__device__ __forceinline__ float e2m1_value(uint32_t code) {
  const uint32_t m = code & 7u;
  const uint32_t mag = m < 2u ? m * 0x3F000000u : 0x3F000000u + (m << 22);
  return __uint_as_float(mag | ((code & 8u) << 28));
}

// Stores 16 values as BF16 (two 16-byte stores; dst 16-byte aligned). The conversion is the
// hardware's cvt.rn.bf16x2.f32, two values an instruction, which rounds like encode_bf16_rn.
__device__ __forceinline__ void store_bf16x16(uint16_t* dst, const float v[16]) {
  uint32_t w[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    memcpy(&w[i], &h, 4);
  }
  uint4* d = reinterpret_cast<uint4*>(dst);
  d[0] = make_uint4(w[0], w[1], w[2], w[3]);
  d[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

// NVFP4 scaled-domain values q * s_b of one packed micro-block (code i in bits 4i..4i+3 of the
// 8 bytes, little-endian) with E4M3 scale code `scale`: exact, see above.
__device__ __forceinline__ void nvfp4_scaled16(uint2 packed, uint8_t scale, float out[16]) {
  const float s = formats::decode_e4m3(scale);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const uint32_t word = i < 8 ? packed.x : packed.y;
    out[i] = formats::mul_rn(e2m1_value(word >> (4 * (i & 7))), s);
  }
}

}  // namespace fourbit::quant
