// The RL sampler (RL.md "The loop", step 1): batched generation with the model's KV cache, under
// the recipe's rl_sampler stage (NVFP4 weights and activations in e2e4), from its own model
// instance whose weights refresh() copies from the trainer after every optimizer step.
//
// Generation. generate() takes B prompts (token ids, B <= SamplerOptions::max_batch), prefills
// them together (right-aligned, Model::forward_cached), then decodes one token per active
// sequence and step until every sequence has sampled a stop token, reached max_new_tokens, or
// filled the cache (max_len positions). A sequence that sampled a stop token keeps it as its last
// token (it was sampled: it has a log-probability and the trainer trains on it).
//
// The sampling distribution of one step (sampling_distribution): z = logits / temperature; with
// top_k > 0 only the k largest z stay (ties: the lower id); with top_p < 1 only the smallest set
// of most probable tokens (in order of decreasing probability, ties: the lower id) whose
// probability under the softmax of the kept z reaches top_p; the distribution is the softmax of
// z over the kept tokens. Every sampled token comes with its log-probability under exactly that
// distribution (z_t - logsumexp of the kept z, in double) and the distribution's entropy.
// temperature = 0 is greedy (the lowest id among the largest logits; log-probability 0, entropy
// 0). RL training rollouts use temperature 1, top_p 1, top_k 0 (RL.md), so that the trainer's
// recomputation log_softmax(logits) is the same distribution.
//
// Randomness. Draw t of sequence b in call `call` is the uniform double in [0, 1) built from
// words 0 and 1 (53 bits) of Philox block counter (b << 32 | t) of the stream
// (SamplingOptions::seed, kSamplerStreamSalt ^ call): a pure function of (seed, call, b, t), so a
// rollout replays exactly, and the host code that maps it to a token is the same whatever device
// ran the model (the logits are copied to the host; identical logits give identical tokens).
// The inverse CDF walks the kept tokens in increasing id order.
//
// Routing (MoE). Every rollout carries the experts each position it fed to the model was routed
// to in every MoE block: host i32 [prompt_len + n_tokens - 1, n_moe_layers, top_k] (the last
// sampled token is never fed), exactly the rows the trainer's forward sees as inputs, for routing
// replay (ForwardOptions::forced_expert_ids).
//
// CUDA. Quantized recipes need the token count of a pass to be a multiple of the quantizers'
// row tile (model.h): the KV cache batch is padded with idle sequences (n_new = 0) to a multiple
// of 128 on CUDA when the rl_sampler stage quantizes any linear layer. The rollout case
// (temperature > 0, top_p = 1, no top-k) samples on the GPU (sample_rows_cuda: the host's draws
// u, FP64, the same inverse CDF), so only B tokens and log-probs cross PCIe per step; top-k,
// top-p and greedy copy the [B, V] logits to the host and sample there.
#pragma once

#include "model/model.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

namespace fourbit::rl {

inline constexpr uint64_t kSamplerStreamSalt = 0x53414D504C455200ull;  // "SAMPLER\0"

struct SamplingOptions {
  double temperature = 1.0;  // >= 0; 0 = greedy
  double top_p = 1.0;        // (0, 1]
  int top_k = 0;             // >= 0; 0 = every token
  int max_new_tokens = 32;   // >= 1
  std::vector<int32_t> stop_tokens;  // a sampled stop token ends its sequence (and is kept)
  uint64_t seed = 0;
  // Throws naming the field when a value is out of range (vocab: the model's vocabulary, for the
  // stop tokens).
  void validate(int64_t vocab) const;
};

// One completion of one prompt.
struct Rollout {
  std::vector<int32_t> tokens;    // [n] sampled tokens, the stop token included when stopped
  std::vector<float> logprobs;    // [n] log-probability of each under the distribution sampled from
  std::vector<float> entropies;   // [n] entropy (nats) of that distribution
  bool stopped = false;           // ended by a stop token (false: max_new_tokens or max_len)
  // MoE only: [prompt_len + n - 1, n_moe_layers, top_k] experts of every fed position.
  std::vector<int32_t> expert_ids;
};

// The distribution one step samples from (see the top of the file). ids: the kept tokens in
// increasing order; logprobs: their log-probabilities (sum of exp = 1).
struct TokenDistribution {
  std::vector<int32_t> ids;
  std::vector<double> logprobs;
  double entropy = 0;
  bool greedy = false;  // temperature 0: ids holds the argmax only, logprob 0
};
// logits: [V] of one sequence.
void sampling_distribution(std::span<const double> logits, const SamplingOptions& options,
                           TokenDistribution& out);
// The token at uniform draw u in [0, 1) (inverse CDF in increasing id order); returns the index
// into dist.ids.
size_t sample_index(const TokenDistribution& dist, double u);
// The uniform draw of sequence b, step t of call `call` (see the top of the file).
double sampler_uniform(uint64_t seed, uint64_t call, uint64_t b, uint64_t t);

// The CUDA kernel of the rollout case (sampling_kernels.h): draw i reads row rows[i] of the
// device f32 logits [R, V], samples softmax(logits / temperature) over the whole vocabulary at
// u[i], and writes tokens[i], logprobs[i], entropies[i] (host spans). temperature > 0, top_p = 1,
// no top-k: the same tokens as sampling_distribution + sample_index on the host (up to FP64
// summation order). Throws in a build without CUDA. Synchronizes `stream`.
void sample_rows_cuda(const TensorView& logits, std::span<const int32_t> rows, std::span<const double> u,
                      double temperature, std::span<int32_t> tokens, std::span<float> logprobs,
                      std::span<float> entropies, void* stream = nullptr);

struct SamplerOptions {
  Device device = Device::kCpu;
  DType cpu_dtype = DType::kF32;
  int max_batch = 1;   // sequences per generate()
  int max_len = 0;     // positions per sequence (prompt + completion); 0: config.max_seq
  void* stream = nullptr;
  bool cpu_bf16_rounding = false;  // ModelOptions::cpu_bf16_rounding of the sampler's model
};

// Timing and counts of the last generate().
struct SamplerStats {
  int64_t sequences = 0;
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  int decode_steps = 0;
  double seconds = 0;  // wall clock of the whole call (prefill, decode, sampling)
  double tokens_per_second() const { return seconds > 0 ? (double)generated_tokens / seconds : 0; }
};

class Sampler {
 public:
  // A model of `config` under `recipe` (resolved for config.recipe_shape()); its weights are the
  // seeded initialization until refresh() or load().
  Sampler(model::ModelConfig config, recipe::ResolvedRecipe recipe, const SamplerOptions& options);

  model::Model& model() { return *model_; }
  const model::Model& model() const { return *model_; }
  int max_len() const { return max_len_; }

  // Copies the trainer's master weights (same config; any device) and refreshes the compute copy;
  // the next generate() quantizes them under the rl_sampler stage.
  void refresh(const model::Model& trainer);

  // B = prompts.size() completions; call = the index of this call (keys the random draws; use the
  // RL step). Every prompt non-empty, of at most max_len - 1 tokens.
  std::vector<Rollout> generate(std::span<const std::vector<int32_t>> prompts,
                                const SamplingOptions& options, uint64_t call);

  const SamplerStats& last_stats() const { return stats_; }

 private:
  int cache_batch(int batch) const;

  SamplerOptions options_;
  std::unique_ptr<model::Model> model_;
  int max_len_ = 0;
  int row_tile_ = 1;  // the cache batch is a multiple of this
  std::optional<model::KvCache> cache_;
  SamplerStats stats_;
};

}  // namespace fourbit::rl
