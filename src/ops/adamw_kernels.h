// Launch interface of the optimizer kernels (adamw_kernels.cu), used by adamw.cpp. Plain
// arguments only; validation and messages live on the host side.
//
// Both kernels take a batch of tensors in one launch (a model's optimizer step has one per
// parameter tensor: ~75 for GPT-2 small, each once a launch, left the GPU idle between the small
// kernels while the host issued the next; tools/ktrace, session 27). A batch is passed by value
// (kernel parameters); each tensor owns a run of CTAs, [first_block, first_block + blocks), and
// does in it exactly what a launch of `blocks` CTAs for that tensor alone would, so the results
// are the same bits however the tensors are batched.
#pragma once

#include "ops/kernel_types.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fourbit::ops::kernels {

// One tensor's AdamW update: params, grads, m, v [n] f32; params_bf16 [n] or null.
struct AdamWSegment {
  float* params;
  const float* grads;
  float* m;
  float* v;
  uint16_t* params_bf16;
  int64_t n;
  int32_t first_block, blocks;  // filled by launch_adamw
  float lr, beta1, beta2, eps, weight_decay, grad_scale;
  float bias_correction1, bias_correction2;  // 1 - beta^step, computed on the host
};
constexpr int kAdamWBatch = 32;  // 32 x 88 bytes: within the 4 KB of kernel parameters
struct AdamWBatch {
  AdamWSegment seg[kAdamWBatch];
  int count = 0;
};
// One launch for every segment of the batch (count >= 1; empty tensors are skipped).
void launch_adamw(AdamWBatch& batch, cudaStream_t stream);

// One tensor's share of the gradient norm: x [n] f32 or bf16, summed by `blocks` CTAs into
// partials[first_block, first_block + blocks). CTA b of the tensor takes the 8-element groups
// b*T, b*T + blocks*T, ... (T threads). The caller picks blocks as a function of n only, so that
// the result does not depend on the device.
struct SumsqSegment {
  const void* x;
  int64_t n;
  int32_t first_block, blocks;
  FloatType type;
};
constexpr int kSumsqBatch = 64;
struct SumsqBatch {
  SumsqSegment seg[kSumsqBatch];
  int count = 0;
};
// partials[first_block + b] for every segment and b < blocks, one launch (count >= 1; the
// segments' runs of CTAs are consecutive from 0, first_block ascending: a later batch passes
// partials already offset to its first tensor's).
void launch_sumsq_partials(const SumsqBatch& batch, double* partials, cudaStream_t stream);

// norm[0] = f32(sqrt(sum of partials[0, count) in order)).
void launch_norm_from_partials(const double* partials, int64_t count, float* norm,
                               cudaStream_t stream);

}  // namespace fourbit::ops::kernels
