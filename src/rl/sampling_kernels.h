// Launch interface of the CUDA sampling kernel (sampling_kernels.cu), used by sampler.cpp: one
// CTA per sampled row draws a token from softmax(logits / temperature) over the whole vocabulary
// (the RL rollout case: top_p = 1, no top-k) by the inverse CDF in increasing id order at a
// uniform draw u that the host computed (sampler_uniform, so the draws are those of the CPU
// path), and writes the token, its log-probability and the distribution's entropy.
//
// Numerics: FP64 throughout (z = logit * inv_temperature, the max, sum of exp(z - max), the
// cumulative mass), as the host reference (sampler.cpp: sampling_distribution + sample_index)
// does; only the summation order differs (per-thread chunks of consecutive ids, then a
// fixed-order CTA combination), so the token differs from the host's only when u lies within
// ~1e-15 of a CDF boundary. If the walk ends without crossing u (rounding), the last token with
// positive probability is taken, as on the host. Deterministic. Plain arguments only; .cu files
// cannot include fmt (ops/CONVENTIONS.md).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fourbit::rl::kernels {

struct SampleRowsArgs {
  const float* logits;    // [n_logit_rows, vocab] f32, contiguous (row stride = vocab)
  int64_t vocab;
  const int32_t* rows;    // [n] which logits row each draw reads
  const double* u;        // [n] uniform draws in [0, 1)
  int n;
  double inv_temperature;  // > 0
  int32_t* tokens;        // [n] out
  float* logprobs;        // [n] out: z_token - logsumexp(z)
  float* entropies;       // [n] out: -sum p log p (nats)
};
void launch_sample_rows(const SampleRowsArgs& a, cudaStream_t stream);

}  // namespace fourbit::rl::kernels
