// Optimizer kernels: the AdamW update (elementwise, 8 elements per thread and step, optional
// fused bf16 copy) and the two-stage sum of squares behind the global gradient norm.
#include "ops/adamw_kernels.h"

#include "core/error.h"
#include "ops/kernel_support.cuh"

namespace fourbit::ops::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kSumThreads = 256;
constexpr int kNormThreads = 1024;

__global__ void adamw_kernel(AdamWArgs a, bool vec) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x * 8;
  for (int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 8; i < a.n; i += stride) {
    float p[8], g[8], m[8], v[8];
    load8(a.params, i, a.n, vec, p);
    load8(a.grads, i, a.n, vec, g);
    load8(a.m, i, a.n, vec, m);
    load8(a.v, i, a.n, vec, v);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float gs = g[k] * a.grad_scale;
      m[k] = a.beta1 * m[k] + (1.0f - a.beta1) * gs;
      v[k] = a.beta2 * v[k] + (1.0f - a.beta2) * (gs * gs);
      const float m_hat = m[k] / a.bias_correction1;
      const float v_hat = v[k] / a.bias_correction2;
      p[k] = p[k] - a.lr * (m_hat / (sqrtf(v_hat) + a.eps) + a.weight_decay * p[k]);
    }
    store8(a.params, i, a.n, vec, p);
    store8(a.m, i, a.n, vec, m);
    store8(a.v, i, a.n, vec, v);
    if (a.params_bf16) store8(a.params_bf16, i, a.n, vec, p);
  }
}

template <typename T>
__global__ void __launch_bounds__(kSumThreads)
    sumsq_kernel(const T* __restrict__ x, int64_t n, bool vec, double* __restrict__ partials) {
  __shared__ double scratch[32];
  double acc = 0.0;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x * 8;
  for (int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 8; i < n; i += stride) {
    float v[8];
    load8(x, i, n, vec, v);
#pragma unroll
    for (int k = 0; k < 8; ++k) acc = fma((double)v[k], (double)v[k], acc);
  }
  acc = block_sum(acc, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

__global__ void __launch_bounds__(kNormThreads)
    norm_kernel(const double* __restrict__ partials, int64_t count, float* __restrict__ norm) {
  __shared__ double scratch[32];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
  acc = block_sum(acc, scratch);
  if (threadIdx.x == 0) norm[0] = (float)sqrt(acc);
}

}  // namespace

void launch_adamw(const AdamWArgs& a, cudaStream_t stream) {
  if (a.n == 0) return;
  const bool vec = is_aligned16(a.params) && is_aligned16(a.grads) && is_aligned16(a.m) &&
                   is_aligned16(a.v) && (!a.params_bf16 || is_aligned16(a.params_bf16));
  adamw_kernel<<<grid_for((a.n + 7) / 8, kThreads), kThreads, 0, stream>>>(a, vec);
  FOURBIT_CUDA_CHECK_LAUNCH();
}

void launch_sumsq_partials(const void* x, FloatType type, int64_t n, int64_t blocks,
                           double* partials, cudaStream_t stream) {
  const bool vec = is_aligned16(x);
  with_float_type(type, [&](auto t) {
    using T = decltype(t);
    sumsq_kernel<T><<<(unsigned)blocks, kSumThreads, 0, stream>>>(static_cast<const T*>(x), n,
                                                                  vec, partials);
  });
  FOURBIT_CUDA_CHECK_LAUNCH();
}

void launch_norm_from_partials(const double* partials, int64_t count, float* norm,
                               cudaStream_t stream) {
  norm_kernel<<<1, kNormThreads, 0, stream>>>(partials, count, norm);
  FOURBIT_CUDA_CHECK_LAUNCH();
}

}  // namespace fourbit::ops::kernels
