// Device side of OutputAmaxes (output_amax.h) for the ops' kernels (nvcc only). A thread takes
// strips of 16 rows x 2 columns (one BF16 pair) of an output: it reads its inputs 4 bytes a row,
// 16 rows of loads in flight, computes and stores the pair of each row, and keeps the 16 values of
// each column in registers, so that it reduces the columns' Hadamard transforms itself
// (quant/amax_device.cuh): no shared memory and no barriers. A warp covers 64 consecutive
// columns (128 bytes of each of 16 rows per input).
//
// Measured first (cb6265f): 16 x 128 tiles staged in shared memory with two barriers per tile
// made the producers as much slower as the skipped amax passes had cost (bench/notes-train.md).
#pragma once

#include "core/sm_count.h"
#include "core/error.h"
#include "formats/element.h"
#include "formats/fp_ops.h"
#include "ops/error_flags.h"
#include "ops/output_amax.h"
#include "quant/amax_device.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace fourbit::ops::kernels {

constexpr int kAmaxThreads = 256;
constexpr int kStripRows = 16;

// Two bf16 values at p (4-byte aligned): the raw word, its two floats, and back. store_pair rounds
// by the hardware's cvt.rn.bf16x2.f32 (one instruction for the pair), which gives the bits of
// formats::encode_bf16_rn, the codec store8 uses (RNE, overflow to Inf, NaN -> 0x7FFF), and leaves
// lo and hi holding the stored values (what the amaxes are taken of).
__device__ __forceinline__ uint32_t load_word(const uint16_t* p) { return *reinterpret_cast<const uint32_t*>(p); }
__device__ __forceinline__ float lo_of(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_of(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }
// round_pair: the BF16 word of (lo, hi), leaving lo and hi holding its two values.
__device__ __forceinline__ uint32_t round_pair(float& lo, float& hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  uint32_t w;
  memcpy(&w, &h, 4);
  lo = lo_of(w);
  hi = hi_of(w);
  return w;
}
__device__ __forceinline__ void store_pair(uint16_t* p, float& lo, float& hi) {
  *reinterpret_cast<uint32_t*>(p) = round_pair(lo, hi);
}
// Folds a stored value into a thread's plain amax (NaN left out by fmaxf, Inf kept); a NaN or
// Inf sets `bad`.
__device__ __forceinline__ void fold_amax(float stored, float& amax, bool& bad) {
  const float x = formats::abs_f32(stored);
  bad |= !(x <= formats::kFloatMax);
  amax = fmaxf(amax, x);
}

// The strip loop of an amax kernel over an output of [n_rows, cols] (n_rows % 16 == 0, cols even):
// for each of the thread's strips, body(r0, c, v) computes the results of rows r0 .. r0 + 15,
// columns c and c + 1, into v[o][j][i] (output o of kOuts, column c + j, row r0 + i) and stores
// them with store_pair, which leaves v holding the stored BF16 values (a body must store every
// v it fills that way); the loop then folds those values into the plain amax
// and, when a.rht_amax is set, each column's transform into the RHT amax. Ends with the publish.
// A body loads all 16 rows before its first store: in the in-place ops the compiler could not
// move a load above a store to the same buffer, and the 16 round trips would run one by one.
template <int kOuts, typename Body>
__device__ __forceinline__ void amax_strip_loop(int64_t n_rows, int64_t cols, const OutputAmaxes& a,
                                                Body&& body) {
  const int64_t pairs = cols / 2, strips = (n_rows / kStripRows) * pairs;
  float row_amax = 0.0f, col_amax = 0.0f;
  bool bad = false;
  for (int64_t s = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; s < strips;
       s += (int64_t)gridDim.x * blockDim.x) {
    float v[kOuts][2][kStripRows];
    body((s / pairs) * kStripRows, (s % pairs) * 2, v);
#pragma unroll
    for (int o = 0; o < kOuts; ++o)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int i = 0; i < kStripRows; ++i) fold_amax(v[o][j][i], row_amax, bad);  // stored values (store_pair)
        if (a.rht_amax != nullptr) col_amax = fmaxf(col_amax, quant::device::rht_segment_amax(v[o][j], a.rht_sign_mask));
      }
  }
  quant::device::publish_amaxes(row_amax, col_amax, a.amax, a.rht_amax, bad, a.nonfinite_flag, kErrNonFinite);
}

// One thread per strip up to 8 CTAs per SM, then grid-stride.
inline unsigned amax_strip_grid(int64_t n_rows, int64_t cols) {
  const int sms = current_device_sm_count();
  const int64_t strips = (n_rows / kStripRows) * (cols / 2);
  const int64_t blocks = (strips + kAmaxThreads - 1) / kAmaxThreads;
  return (unsigned)std::max<int64_t>(1, std::min<int64_t>(blocks, (int64_t)sms * 8));
}

}  // namespace fourbit::ops::kernels
