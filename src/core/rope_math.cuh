// The RoPE rotation of one (lo, hi) pair on the device (nvcc only), shared by the RoPE kernel
// (ops/rope_kernels.cu), the attention backward's epilogues (ops/attention_kernels.cu, which can
// rotate dq and dk back as they are stored) and the decode GEMV's RoPE epilogue (gemm, which sits
// beside ops and so finds it here, in core). One definition, so that all give the same bits: the
// FP32 recipe of ops/rope.h with every product and sum rounded on its own (no FMA contraction: the
// CPU f32 reference computes the same expressions).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fourbit::core {

// cos and sin of pair i's angle at position pos: angle = f32(f32(pos) * inv_freq_i). inverse: the
// backward's rotation by -angle (sin negated).
__device__ __forceinline__ void rope_cos_sin(int32_t pos, float inv_freq, bool inverse, float& c,
                                             float& s) {
  float sn;
  sincosf(__fmul_rn((float)pos, inv_freq), &sn, &c);
  s = inverse ? -sn : sn;
}

// (lo, hi) <- (lo c - hi s, hi c + lo s).
__device__ __forceinline__ void rope_rotate(float& lo, float& hi, float c, float s) {
  const float l = __fsub_rn(__fmul_rn(lo, c), __fmul_rn(hi, s));
  hi = __fadd_rn(__fmul_rn(hi, c), __fmul_rn(lo, s));
  lo = l;
}

}  // namespace fourbit::core
