// Optimizer kernels: the AdamW update (elementwise, 8 elements per thread and step, optional
// fused bf16 copy) and the two-stage sum of squares behind the global gradient norm, each over a
// batch of tensors per launch (adamw_kernels.h: every tensor's CTAs do what a launch for it
// alone would).
#include "ops/adamw_kernels.h"

#include "core/error.h"
#include "ops/kernel_support.cuh"

namespace fourbit::ops::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kSumThreads = 256;
constexpr int kNormThreads = 1024;

// The segment whose run of CTAs holds blockIdx.x: the last one with first_block <= blockIdx.x
// (first_block ascending).
template <typename Segment>
__device__ __forceinline__ int segment_of_block(const Segment* seg, int count) {
  const int b = (int)blockIdx.x;
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (seg[mid].first_block <= b) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

__global__ void __launch_bounds__(kThreads) adamw_kernel(AdamWBatch batch) {
  const AdamWSegment& a = batch.seg[segment_of_block(batch.seg, batch.count)];
  const bool vec = is_aligned16(a.params) && is_aligned16(a.grads) && is_aligned16(a.m) &&
                   is_aligned16(a.v) && (!a.params_bf16 || is_aligned16(a.params_bf16));
  const int64_t block = (int64_t)blockIdx.x - a.first_block;
  const int64_t stride = (int64_t)a.blocks * blockDim.x * 8;
  for (int64_t i = (block * blockDim.x + threadIdx.x) * 8; i < a.n; i += stride) {
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
__device__ __forceinline__ double sumsq_slice(const T* __restrict__ x, int64_t n, int64_t block, int64_t blocks) {
  const bool vec = is_aligned16(x);
  double acc = 0.0;
  const int64_t stride = blocks * blockDim.x * 8;
  for (int64_t i = (block * blockDim.x + threadIdx.x) * 8; i < n; i += stride) {
    float v[8];
    load8(x, i, n, vec, v);
#pragma unroll
    for (int k = 0; k < 8; ++k) acc = fma((double)v[k], (double)v[k], acc);
  }
  return acc;
}

__global__ void __launch_bounds__(kSumThreads) sumsq_kernel(SumsqBatch batch, double* __restrict__ partials) {
  __shared__ double scratch[32];
  const SumsqSegment& s = batch.seg[segment_of_block(batch.seg, batch.count)];
  const int64_t block = (int64_t)blockIdx.x - s.first_block;
  double acc = s.type == FloatType::kBF16
                   ? sumsq_slice(static_cast<const bf16_t*>(s.x), s.n, block, s.blocks)
                   : sumsq_slice(static_cast<const float*>(s.x), s.n, block, s.blocks);
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

void launch_adamw(AdamWBatch& batch, cudaStream_t stream) {
  // Each tensor's CTAs: as many as its own launch had (grid_for), empty tensors none.
  int kept = 0;
  int64_t blocks = 0;
  for (int i = 0; i < batch.count; ++i) {
    AdamWSegment s = batch.seg[i];
    if (s.n == 0) continue;
    s.first_block = (int32_t)blocks;
    s.blocks = (int32_t)grid_for((s.n + 7) / 8, kThreads);
    blocks += s.blocks;
    batch.seg[kept++] = s;
  }
  batch.count = kept;
  if (kept == 0) return;
  adamw_kernel<<<(unsigned)blocks, kThreads, 0, stream>>>(batch);
  FOURBIT_CUDA_CHECK_LAUNCH();
}

void launch_sumsq_partials(const SumsqBatch& batch, double* partials, cudaStream_t stream) {
  const SumsqSegment& last = batch.seg[batch.count - 1];
  sumsq_kernel<<<(unsigned)(last.first_block + last.blocks), kSumThreads, 0, stream>>>(batch, partials);
  FOURBIT_CUDA_CHECK_LAUNCH();
}

void launch_norm_from_partials(const double* partials, int64_t count, float* norm,
                               cudaStream_t stream) {
  norm_kernel<<<1, kNormThreads, 0, stream>>>(partials, count, norm);
  FOURBIT_CUDA_CHECK_LAUNCH();
}

}  // namespace fourbit::ops::kernels
