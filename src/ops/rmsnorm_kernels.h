// Launch interface of the RMSNorm kernels (rmsnorm_kernels.cu), used by rmsnorm.cpp. Plain
// arguments only; validation and messages live on the host side.
#pragma once

#include "ops/kernel_types.h"
#include "ops/output_amax.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fourbit::ops::kernels {

inline constexpr int kRmsnormMaxCols = 16384;  // 1024 threads x 2 groups of 8 columns

struct RmsnormForwardArgs {
  void* y;             // [N, C] act_type
  float* rstd;         // [N]
  const void* x;       // [N, C] act_type
  const void* weight;  // [C] weight_type
  FloatType act_type, weight_type;
  int64_t n_rows;
  int cols;
  float eps;
};
void launch_rmsnorm_forward(const RmsnormForwardArgs& a, cudaStream_t stream);

// Rows are processed in n_chunks chunks of rows_per_chunk (the last may be shorter); chunk b
// writes its partial dweight sums to partial[b, :] and a second kernel adds them to dweight in
// chunk order.
struct RmsnormBackwardArgs {
  void* dx;            // [N, C] act_type
  float* dweight;      // [C]
  float* partial;      // [n_chunks, C] workspace
  const void* dy;      // [N, C] act_type
  const void* x;       // [N, C] act_type
  const void* weight;  // [C] weight_type
  const float* rstd;   // [N]
  FloatType act_type, weight_type;
  int64_t n_rows;
  int cols;
  int64_t n_chunks, rows_per_chunk;
  bool accumulate = false;  // dx += (dx rounded to act_type) instead of dx =
  // With accumulate, bf16, C <= kRmsnormAmaxMaxCols, n_rows and rows_per_chunk multiples of 16:
  // also the amaxes of the accumulated dx (amaxes.amax null: none).
  OutputAmaxes amaxes{};
};
inline constexpr int kRmsnormAmaxMaxCols = 2048;  // 16 x 256 threads x 16 B = 64 KB of segment slots
void launch_rmsnorm_backward(const RmsnormBackwardArgs& a, cudaStream_t stream);

}  // namespace fourbit::ops::kernels
