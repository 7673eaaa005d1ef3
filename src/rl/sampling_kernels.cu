// The CUDA sampling kernel (sampling_kernels.h): per draw one CTA of kThreads threads; thread i
// owns the consecutive ids [i * chunk, (i + 1) * chunk). Pass 1: the row max; pass 2: sum of
// exp(z - max) and of exp(z - max) * z (for the entropy); thread 0 combines the per-thread
// partials in thread order (fixed order: deterministic); pass 3: per-thread probability mass,
// an exclusive prefix over threads in order, and the one thread whose [prefix, prefix + mass)
// holds u walks its ids in order to the first whose cumulative mass exceeds u.
#include "rl/sampling_kernels.h"

#include "core/error.h"

#include <cfloat>

namespace fourbit::rl::kernels {

namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    sample_rows_kernel(const float* __restrict__ logits, int64_t vocab, const int32_t* __restrict__ rows,
                       const double* __restrict__ u_in, double inv_t, int32_t* __restrict__ tokens,
                       float* __restrict__ logprobs, float* __restrict__ entropies) {
  __shared__ double part[kThreads];
  __shared__ double part2[kThreads];
  __shared__ double row_max, row_lse, row_entropy;
  __shared__ int64_t chosen, last_positive[kThreads];
  const int tid = threadIdx.x;
  const int draw = blockIdx.x;
  const float* row = logits + (int64_t)rows[draw] * vocab;
  const int64_t chunk = (vocab + kThreads - 1) / kThreads;
  const int64_t lo = tid * chunk < vocab ? tid * chunk : vocab;
  const int64_t hi = lo + chunk < vocab ? lo + chunk : vocab;

  // Pass 1: max of z.
  double m = -DBL_MAX;
  bool any = false;
  for (int64_t v = lo; v < hi; ++v) {
    const double z = (double)row[v] * inv_t;
    if (!any || z > m) m = z;
    any = true;
  }
  part[tid] = any ? m : -DBL_MAX;
  __syncthreads();
  if (tid == 0) {
    double mm = part[0];
    for (int i = 1; i < kThreads; ++i) mm = part[i] > mm ? part[i] : mm;
    row_max = mm;
  }
  __syncthreads();
  m = row_max;

  // Pass 2: s = sum exp(z - m), e = sum exp(z - m) (z - m).
  double s = 0, e = 0;
  for (int64_t v = lo; v < hi; ++v) {
    const double d = (double)row[v] * inv_t - m;
    const double p = exp(d);
    s += p;
    if (p > 0) e += p * d;
  }
  part[tid] = s;
  part2[tid] = e;
  __syncthreads();
  if (tid == 0) {
    double ss = 0, ee = 0;
    for (int i = 0; i < kThreads; ++i) {
      ss += part[i];
      ee += part2[i];
    }
    const double log_s = log(ss);
    row_lse = m + log_s;
    // H = -sum p (z - lse) with p = exp(z - m) / s: -(e / s - log s).
    row_entropy = log_s - ee / ss;
    chosen = -1;
  }
  __syncthreads();
  const double lse = row_lse;

  // Pass 3: the mass of each thread's ids, the prefix, and the walk.
  double mass = 0;
  int64_t lastp = -1;
  for (int64_t v = lo; v < hi; ++v) {
    const double p = exp((double)row[v] * inv_t - lse);
    mass += p;
    if (p > 0) lastp = v;
  }
  part[tid] = mass;
  last_positive[tid] = lastp;
  __syncthreads();
  if (tid == 0) {  // exclusive prefix in thread order, in place
    double run = 0;
    for (int i = 0; i < kThreads; ++i) {
      const double x = part[i];
      part[i] = run;
      run += x;
    }
  }
  __syncthreads();
  const double u = u_in[draw];
  const double start = part[tid];
  if (mass > 0 && u >= start && u < start + mass) {
    double cum = start;
    int64_t pick = -1;
    for (int64_t v = lo; v < hi; ++v) {
      const double p = exp((double)row[v] * inv_t - lse);
      cum += p;
      if (u < cum && p > 0) {
        pick = v;
        break;
      }
    }
    chosen = pick >= 0 ? pick : lastp;  // the walk's rounding fell short: the chunk's last positive
  }
  __syncthreads();
  if (tid == 0) {
    int64_t t = chosen;
    if (t < 0) {  // u beyond the rounded total: the last token with positive probability
      for (int i = kThreads - 1; i >= 0 && t < 0; --i) t = last_positive[i];
      if (t < 0) t = 0;
    }
    tokens[draw] = (int32_t)t;
    logprobs[draw] = (float)((double)row[t] * inv_t - lse);
    entropies[draw] = (float)row_entropy;
  }
}

}  // namespace

void launch_sample_rows(const SampleRowsArgs& a, cudaStream_t stream) {
  if (a.n <= 0) return;
  sample_rows_kernel<<<a.n, kThreads, 0, stream>>>(a.logits, a.vocab, a.rows, a.u, a.inv_temperature, a.tokens,
                                                   a.logprobs, a.entropies);
  FOURBIT_CUDA_CHECK_LAUNCH();
}

}  // namespace fourbit::rl::kernels
