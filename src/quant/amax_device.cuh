// Device helpers for the NVFP4 global amaxes (nvcc only, header-only): the plain amax of a tensor
// and the amax of its column-wise random Hadamard transform, exactly as quant::amax_cuda computes
// them. Shared by the global-amax kernels (quantize_kernels.cu) and by producers that compute the
// amaxes of the tensor they write (ops: swiglu_forward / swiglu_backward_inplace with
// OutputAmaxes), so that the quantizer can skip its own pass over the tensor
// (CudaQuantizeOptions::given_rowwise_amax / given_colwise_amax) and get the same bits.
//
// Definitions (NUMERICS.md 3.4; quant/reference.cpp is the ground truth):
//   plain amax    = max |x| over the tensor, NaN left out (fmaxf), Inf kept;
//   RHT amax      = max over 16-row column segments s of max_i |bf16(RN(0.25 * (signs * s) H)_i)|.
// RN to FP32 and then to BF16 are monotone and odd, so max_i |round(y_i)| = round(max_i |y_i|):
// the rounding is applied once per segment (rht_segment_amax) instead of to each of its values.
// Both amaxes are non-negative floats, whose bit patterns order like their values, so they are
// published with an integer atomicMax into device floats that the caller zeroed, or (the global
// amax kernels with a ticket: publish_amaxes_ticket) written once by the kernel's last CTA.
#pragma once

#include "formats/element.h"
#include "formats/fp_ops.h"
#include "quant/block_math.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace fourbit::quant::device {

// v <- (v with the signs of sign_mask) H, unscaled and unrounded (rht16_forward's first steps:
// bit i of sign_mask negates v[i]).
__device__ __forceinline__ void rht16_signs_and_butterfly(float v[16], uint16_t sign_mask) {
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    v[i] = __uint_as_float(__float_as_uint(v[i]) ^ (((uint32_t)sign_mask << (31 - i)) & 0x80000000u));
  }
  fwht16(v);
}

// max_i |rht16_forward(v)_i| of one 16-value column segment (v is overwritten).
__device__ __forceinline__ float rht_segment_amax(float v[16], uint16_t sign_mask) {
  rht16_signs_and_butterfly(v, sign_mask);
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) m = fmaxf(m, formats::abs_f32(v[i]));
  return __bfloat162float(__float2bfloat16_rn(formats::mul_rn(m, 0.25f)));
}

// Both values maxed over the warp (butterfly: every lane gets the results).
__device__ __forceinline__ void warp_max2(float& a, float& b) {
  for (int off = 16; off > 0; off >>= 1) {
    a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, off));
    b = fmaxf(b, __shfl_xor_sync(0xFFFFFFFFu, b, off));
  }
}

// The end of a global-amax reduction: a warp max of this thread's amaxes, one atomicMax per warp,
// and the non-finite flag (bit `nonfinite_bit` ORed into *error_flags when `bad`). Every lane of
// the warp must call it. col_amax and error_flags may be null.
__device__ __forceinline__ void publish_amaxes(float a_row, float a_col, float* row_amax, float* col_amax,
                                               bool bad, int* error_flags, int nonfinite_bit) {
  warp_max2(a_row, a_col);
  if ((threadIdx.x & 31) == 0) {
    atomicMax(reinterpret_cast<unsigned int*>(row_amax), __float_as_uint(a_row));
    if (col_amax) atomicMax(reinterpret_cast<unsigned int*>(col_amax), __float_as_uint(a_col));
  }
  if (bad && error_flags) atomicOr(error_flags, nonfinite_bit);
}

// A global-amax reduction that needs no zeroed outputs (AmaxTicket, quantize_kernels.h): each CTA
// stores its (row, column) maxima in ticket->partial[blockIdx.x] and takes a ticket; the CTA that
// takes the last one reduces all partials and stores the two amaxes with plain stores, then sets
// the count back to 0 for the ticket's next use. The maxima are those of publish_amaxes (a max of
// non-negative floats does not depend on the order): the same bits, without a fill launch before
// the kernel. Every thread of the CTA must call it (it has barriers); blockDim.x <= 1024.
__device__ __forceinline__ void publish_amaxes_ticket(float a_row, float a_col, float* row_amax, float* col_amax,
                                                      bool bad, int* error_flags, int nonfinite_bit,
                                                      unsigned int* count, float2* partial) {
  __shared__ float2 warp_max[32];
  __shared__ bool last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
  auto block_reduce = [&](float2 v) {  // every thread gets the CTA's maxima
    warp_max2(v.x, v.y);
    if (lane == 0) warp_max[warp] = v;
    __syncthreads();
    float2 m = make_float2(0.0f, 0.0f);
    for (int w = 0; w < n_warps; ++w) m = make_float2(fmaxf(m.x, warp_max[w].x), fmaxf(m.y, warp_max[w].y));
    __syncthreads();  // warp_max may be reused
    return m;
  };
  if (bad && error_flags) atomicOr(error_flags, nonfinite_bit);
  const float2 mine = block_reduce(make_float2(a_row, a_col));
  if (threadIdx.x == 0) {
    partial[blockIdx.x] = mine;
    __threadfence();  // the partial is visible before the ticket says so
    last = atomicAdd(count, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  float2 m = make_float2(0.0f, 0.0f);
  for (unsigned int b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
    const float2 v = __ldcg(partial + b);  // from L2: written by other CTAs
    m = make_float2(fmaxf(m.x, v.x), fmaxf(m.y, v.y));
  }
  m = block_reduce(m);
  if (threadIdx.x == 0) {
    *row_amax = m.x;
    if (col_amax) *col_amax = m.y;
    *count = 0u;  // ready for the next kernel that takes this ticket (same stream: after this one)
  }
}

}  // namespace fourbit::quant::device
