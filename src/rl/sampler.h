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
// CUDA. Fast decode: at construction the sampler builds the model's sampler weights
// (Model::refresh_sampler_weights; rebuilt by every refresh()), so that passes of at most
// gemm::kDecodeMaxTokens (64) tokens run the dense linear layers through the decode GEMV, with no
// token tile and, in dense models, as one CUDA graph per step. Where the decode GEMV does not
// implement the rl_sampler recipe (e.g. MXFP8), or in an MoE model whose rl_sampler stage quantizes
// (its grouped expert GEMMs keep the 128-token passes below), the copy is released, the reason is
// logged once, and every pass takes the emulated path (fast_decode() is false).
// The cache batch Bc: B, when fast decode is on and B <= 64 (decode steps: B <= 64 tokens, the
// fast path), or without a quantizing rl_sampler stage; otherwise B padded with idle sequences
// (n_new = 0) to a multiple of the row tile 128, because the emulated path's quantize kernels take
// whole tiles of token rows (model.h).
// Prefill of the right-aligned [Bc, L] prompt matrix (L = longest prompt): one pass when it can
// run (Bc * L <= 64: fast path; or Bc * L a multiple of the row tile, or no tile: emulated);
// otherwise (fast decode, Bc = B not a whole tile) in chunks of t = 64 / Bc columns, each a fast
// pass of Bc * t <= 64 tokens (the first chunk takes the remainder, so the last is whole). In a
// chunk, sequence b's real tokens are a suffix of the chunk's columns (n_new[b] may be 0); every
// sequence's last prompt token lies in the last column, so only the last chunk's logits are
// sampled. Chunking was chosen over padding Tq up to a whole tile: it needs no extra rows and fits
// any cache length. SamplerOptions::prefill_chunk_len forces chunks (any device), which lets the
// CPU tests compare chunked and one-pass prefill.
// The draws do not depend on Bc or on the chunking (they are keyed by (seed, call, b, t)); the
// logits do only through summation order and, with NVFP4 activations, the per-pass activation
// scale (which already differs between the sampler's passes and the trainer's forward).
// The rollout case (temperature > 0, top_p = 1, no top-k) samples on the GPU (sample_rows_cuda:
// the host's draws u, FP64, the same inverse CDF), so only B tokens and log-probs cross PCIe per
// step; top-k, top-p and greedy copy the [B, V] logits to the host and sample there.
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
  // > 0: prefill in chunks of at most this many prompt columns (see the top of the file), on any
  // device; 0: one pass where it can run. On CUDA a chunk that needs it is narrowed to the fast
  // path's 64 / Bc columns.
  int prefill_chunk_len = 0;
  // CUDA: keep sampler weights and run passes of <= 64 tokens on the decode GEMV (the top of this
  // file). false: every pass takes the emulated path (the trainer's kernels), a diagnostic that
  // separates what the decode kernels' summation order costs in sampler/trainer mismatch.
  bool fast_decode = true;
};

// Timing and counts of the last generate().
struct SamplerStats {
  int64_t sequences = 0;
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  int prefill_passes = 0;  // forward passes of the prefill (> 1: chunked)
  int decode_steps = 0;
  // Passes (prefill and decode) of at most gemm::kDecodeMaxTokens tokens with fast_decode() on:
  // the passes forward_cached runs through the decode GEMV (model.h).
  int fast_passes = 0;
  double seconds = 0;  // wall clock of the whole call (prefill, decode, sampling)
  double tokens_per_second() const { return seconds > 0 ? (double)generated_tokens / seconds : 0; }
};

class Sampler {
 public:
  // A model of `config` under `recipe` (resolved for config.recipe_shape()); its weights are the
  // seeded initialization until refresh(). On CUDA, builds the sampler weights (fast_decode()).
  Sampler(model::ModelConfig config, recipe::ResolvedRecipe recipe, const SamplerOptions& options);

  model::Model& model() { return *model_; }
  const model::Model& model() const { return *model_; }
  int max_len() const { return max_len_; }

  // Copies the trainer's master weights (same config; any device) and refreshes the compute copy
  // and, with fast decode, the sampler weights; the next generate() quantizes the activations under
  // the rl_sampler stage.
  void refresh(const model::Model& trainer);
  // Whether the model holds sampler weights (CUDA, a recipe the decode GEMV implements; see the top
  // of the file): passes of at most 64 tokens then run the decode GEMV. After changing the model's
  // weights or recipe through model(), call model().refresh_sampler_weights() (or refresh()).
  bool fast_decode() const { return model_->has_sampler_weights(); }

  // B = prompts.size() completions; call = the index of this call (keys the random draws; use the
  // RL step). Every prompt non-empty, of at most max_len - 1 tokens.
  std::vector<Rollout> generate(std::span<const std::vector<int32_t>> prompts,
                                const SamplingOptions& options, uint64_t call);

  const SamplerStats& last_stats() const { return stats_; }

 private:
  int cache_batch(int batch) const;
  // Prefill chunk width (columns) for cache batch Bc and longest prompt L: L = one pass.
  int prefill_chunk(int Bc, int L) const;

  SamplerOptions options_;
  std::unique_ptr<model::Model> model_;
  int max_len_ = 0;
  int row_tile_ = 1;  // the emulated path's passes take multiples of this many tokens
  std::optional<model::KvCache> cache_;
  SamplerStats stats_;
};

}  // namespace fourbit::rl
