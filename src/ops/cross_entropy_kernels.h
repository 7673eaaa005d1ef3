// Launch interface of the softmax cross-entropy kernels (cross_entropy_kernels.cu), used by
// cross_entropy.cpp. Plain arguments only; validation and messages live on the host side.
#pragma once

#include "ops/kernel_types.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fourbit::ops::kernels {

struct CrossEntropyArgs {
  const void* logits;     // [N, V] logits_type
  void* dlogits;          // [N, V] dlogits_type; null: no backward. May equal logits (in place).
  float* losses;          // [N]; null: not written
  float* mean_loss;       // [1]; null: not computed (needs losses)
  const int32_t* targets; // [N]
  FloatType logits_type, dlogits_type;
  int64_t n_rows, vocab;
  float dloss_scale;
  const float* row_weights;  // [N]; null: every row's gradient weight is 1
  int* error_flag;        // device int: kErrIndexOutOfRange
  float* lse_out = nullptr;       // [N]; null: not written (0 for an ignored row)
  const float* lse_in = nullptr;  // [N]; non-null: no pass 1, the backward uses these lse
  bool sfu_exp = false;           // exp on the special-function unit (ex2.approx) instead of expf
};
void launch_cross_entropy(const CrossEntropyArgs& a, cudaStream_t stream);

}  // namespace fourbit::ops::kernels
