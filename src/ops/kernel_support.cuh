// Device helpers shared by the dense ops' kernels (nvcc only): FP32 <-> storage conversion,
// 8-element row accesses (16-byte vector loads and stores where the row is aligned, scalar ones at
// a ragged end or on a misaligned row) and deterministic block reductions.
//
// BF16 is stored as uint16_t and converted with formats/element.h, the codec the CPU side uses:
// round to nearest even, NaN -> canonical 0x7FFF, so a cast gives the same bits on both sides.
#pragma once

#include "core/pdl.cuh"
#include "formats/element.h"
#include "ops/kernel_types.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <utility>

namespace fourbit::ops::kernels {

using bf16_t = uint16_t;

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_float<bf16_t>(bf16_t x) { return formats::decode_bf16(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ bf16_t from_float<bf16_t>(float x) { return formats::encode_bf16_rn(x); }

__host__ __device__ __forceinline__ bool is_aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// 8 consecutive elements at a 16-byte aligned address.
__device__ __forceinline__ void load8_aligned(const float* p, float v[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
__device__ __forceinline__ void load8_aligned(const bf16_t* p, float v[8]) {
  const uint4 a = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(w[i] << 16);
    v[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
  }
}
__device__ __forceinline__ void store8_aligned(float* p, const float v[8]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  *reinterpret_cast<float4*>(p + 4) = make_float4(v[4], v[5], v[6], v[7]);
}
// The hardware's cvt.rn.bf16x2.f32 (one instruction a pair) rounds as formats::encode_bf16_rn
// (round to nearest even, overflow to Inf, NaN -> 0x7FFF): the same bits as the scalar stores.
__device__ __forceinline__ void store8_aligned(bf16_t* p, const float v[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    memcpy(&w[i], &h, 4);
  }
  *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

// Elements [c, c + 8) of a row of n elements (c a multiple of 8); `vec`: the row pointer is
// 16-byte aligned. Missing elements past n read as 0 and are not written.
template <typename T>
__device__ __forceinline__ void load8(const T* row, int64_t c, int64_t n, bool vec, float v[8]) {
  if (vec && c + 8 <= n) {
    load8_aligned(row + c, v);
    return;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = c + k < n ? to_float(row[c + k]) : 0.0f;
}
template <typename T>
__device__ __forceinline__ void store8(T* row, int64_t c, int64_t n, bool vec, const float v[8]) {
  if (vec && c + 8 <= n) {
    store8_aligned(row + c, v);
    return;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k)
    if (c + k < n) row[c + k] = from_float<T>(v[k]);
}

// --- reductions ---------------------------------------------------------------------------------
// Butterfly (xor) shuffles: every lane ends with the same bits (each step adds two partial sums
// of the same shape, and FP addition is commutative), so results do not depend on the lane.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

// Sum over the CTA (blockDim.x a multiple of 32); every thread gets the same result, summed in a
// fixed order (deterministic). `scratch`: shared T[32]. All threads must call it.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T total = 0;
  for (int w = 0; w < n_warps; ++w) total += scratch[w];
  __syncthreads();  // scratch may be reused right away
  return total;
}

// Two block_sums in one pass (one pair of barriers): each component summed exactly as block_sum
// sums it, so the bits are block_sum's. `scratch`: shared float2[32].
__device__ __forceinline__ float2 block_sum2(float2 v, float2* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  v.x = warp_sum(v.x);
  v.y = warp_sum(v.y);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float2 total = make_float2(0.0f, 0.0f);
  for (int w = 0; w < n_warps; ++w) {
    total.x += scratch[w].x;
    total.y += scratch[w].y;
  }
  __syncthreads();  // scratch may be reused right away
  return total;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  v = warp_max(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float m = scratch[0];
  for (int w = 1; w < n_warps; ++w) m = fmaxf(m, scratch[w]);
  __syncthreads();
  return m;
}

// Runs f(T{}) with T the storage type named by t (float or bf16_t): runtime dtype -> template.
template <typename F>
void with_float_type(FloatType t, F&& f) {
  if (t == FloatType::kF32) {
    std::forward<F>(f)(float{});
  } else {
    std::forward<F>(f)(bf16_t{});
  }
}

// Grid size for a grid-stride loop over `items` with `threads` per CTA (at least 1 CTA).
inline unsigned grid_for(int64_t items, int threads, int64_t max_blocks = 16384) {
  int64_t b = (items + threads - 1) / threads;
  if (b < 1) b = 1;
  if (b > max_blocks) b = max_blocks;
  return (unsigned)b;
}

}  // namespace fourbit::ops::kernels
