// Launch interface of the RoPE kernel (rope_kernels.cu), used by rope.cpp. Plain arguments only;
// validation and messages live on the host side.
#pragma once

#include "ops/kernel_types.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fourbit::ops::kernels {

inline constexpr int kRopeMaxHeadDim = 512;

// One [N, heads, D] view: element (n, h, d) at data[n * stride_n + h * stride_h + d].
struct RopeTensor {
  void* data = nullptr;  // null with heads = 0: absent
  int64_t stride_n = 0, stride_h = 0;
  int heads = 0;
};

struct RopeArgs {
  RopeTensor q_out, k_out, q_in, k_in;  // out may equal in (in place)
  const int32_t* positions;             // [N]
  FloatType type;
  int64_t n_rows;
  int head_dim;
  bool inverse;  // rotate by -angle (the backward)
  // inv_freq[i] = f32(pow(f64(theta), -2i / D)) for i < D / 2, computed on the host by the CPU
  // reference's own function (rope.cpp), so the kernel evaluates no pow per token.
  float inv_freq[kRopeMaxHeadDim / 2];
  // KV-cache append (optional; rope.h rope_forward_inplace_append): k_cache null means none.
  void* k_cache = nullptr;          // [B, t_max, k heads, D] contiguous, the type of q
  void* v_cache = nullptr;          // same shape
  RopeTensor v_in;                  // [N, k heads, D]
  const int32_t* write_pos = nullptr;  // [N]
  int64_t rows_per_seq = 1, t_max = 0;
};
void launch_rope(const RopeArgs& a, cudaStream_t stream);

// rope.h rope_cos_sin_table: table f32 [n_rows, head_dim / 2, 2].
struct RopeTableArgs {
  float* table = nullptr;
  const int32_t* positions = nullptr;  // [n_rows]
  int64_t n_rows = 0;
  int head_dim = 0;
  float inv_freq[kRopeMaxHeadDim / 2];  // as RopeArgs::inv_freq
};
void launch_rope_table(const RopeTableArgs& a, cudaStream_t stream);

}  // namespace fourbit::ops::kernels
