// Launch interface of the optimizer kernels (adamw_kernels.cu), used by adamw.cpp. Plain
// arguments only; validation and messages live on the host side.
#pragma once

#include "ops/kernel_types.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fourbit::ops::kernels {

struct AdamWArgs {
  float* params;          // [n]
  const float* grads;     // [n]
  float* m;               // [n]
  float* v;               // [n]
  uint16_t* params_bf16;  // [n] or null
  int64_t n;
  float lr, beta1, beta2, eps, weight_decay, grad_scale;
  float bias_correction1, bias_correction2;  // 1 - beta^step, computed on the host
};
void launch_adamw(const AdamWArgs& a, cudaStream_t stream);

// partials[b] = sum of x^2 over CTA b's slice of x (FP64), b < blocks: CTA b takes the 8-element
// groups b*T, b*T + blocks*T, ... (T threads). The caller picks blocks as a function of n only, so
// that the result does not depend on the device.
void launch_sumsq_partials(const void* x, FloatType type, int64_t n, int64_t blocks,
                           double* partials, cudaStream_t stream);

// norm[0] = f32(sqrt(sum of partials[0, count) in order)).
void launch_norm_from_partials(const double* partials, int64_t count, float* norm,
                               cudaStream_t stream);

}  // namespace fourbit::ops::kernels
