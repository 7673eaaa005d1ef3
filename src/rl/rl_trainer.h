// The RL trainer (RL.md): rollouts from the low-precision sampler (sampler.h), rewards from a
// verifiable task (task.h), and a policy-gradient step on the trainer's model (recipe stage
// rl_trainer) corrected for the sampler/trainer mismatch.
//
// One step (RlTrainer::step):
//   1. P prompts (task.make_example(seed, step * P + i), each prefixed by kEndOfDocumentToken as
//      in the corpus), each repeated G times: B = P * G sequences; the sampler generates them
//      (temperature, top_p 1, no top-k; stop at '\n' or end of document).
//   2. Reward r of each completion (the bytes before the first non-byte token), task.score.
//   3. Advantage A_i = r_i - mean of its group (divided by the group's std + 1e-6 with
//      std_normalize).
//   4. The trainer's forward over prompt + completion (targets on the completion tokens only; MoE:
//      the sampler's experts replayed with routing_replay) gives logp_trainer of every sampled
//      token; the per-token loss weights below go into Model::backward (the weighted
//      cross-entropy: d loss / d(-logp_t) = weight_t), then one AdamW update (train/optimizer.h).
//   5. The sampler copies the new weights (Sampler::refresh).
//
// Loss (rl_loss.h has the formulas as tested pure functions; default: on-policy, one update per
// batch):
//   w_t   = min(exp(logp_trainer_t - logp_sampler_t), C)       (constant; C = is_cap = 2)
//   loss  = - sum_t w_t * A_i * logp_trainer_t / N            (N = completion tokens of the batch)
// importance = mask: w_t = 1 inside [mask_low, is_cap], else the token is dropped from the sum and
// from N; importance = none: w_t = 1.
// PPO (ppo_epochs > 1): the batch is reused for ppo_epochs updates; the ratio to the first
// epoch's trainer policy r_t = exp(logp_t - logp_old_t) is clipped PPO-style (clip_low,
// clip_high), the importance weight uses logp_old:
//   loss  = - sum_t w_t * min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A) / N
// KL to the reference policy (the starting weights, kl_coef > 0): + kl_coef * sum_t k3_t / N with
// k3_t = exp(logp_ref - logp) - (logp_ref - logp) - 1.
//
// Metrics of every step (StepMetrics, to the progress line and JSONL): mean and std reward, K3
// divergence E[rho - log rho - 1] with rho = pi_trainer / pi_sampler over the sampled tokens,
// max |logp_trainer - logp_sampler|, the fraction of tokens truncated (w capped at C) or masked,
// mean entropy of the sampling distribution, mean completion length, sampler and trainer tokens/s.
//
// MoE: the model's auxiliary load-balancing and z losses stay in the objective with their config
// coefficients (Model::backward adds their gradients); with routing replay the trainer's router
// still gets gradients through the gate weights (RL.md).
//
// Precision (RL.md): the sampler's model runs the recipe's rl_sampler stage, the trainer's
// forward the rl_trainer Fprop (the same quantizer contract; the recipe validation enforces it
// unless allow_sampler_mismatch), its backward the rl_trainer Dgrad/Wgrad. The MoE router and
// the LM head stay BF16 in every preset (high_precision).
#pragma once

#include "model/model.h"
#include "rl/rl_loss.h"
#include "rl/sampler.h"
#include "rl/task.h"
#include "train/optimizer.h"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fourbit::rl {


struct RlConfig {
  int prompts_per_step = 16;  // P
  int group_size = 8;         // G (completions per prompt)
  int max_new_tokens = 16;
  int max_len = 0;            // positions per sequence (prompt + completion); 0: min(max_seq, 128)
  double temperature = 1.0;
  double lr = 1e-4;           // constant after warmup
  int warmup_steps = 0;
  train::AdamWConfig adamw{.beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.0, .grad_clip = 1.0};
  ImportanceMode importance = ImportanceMode::kTruncate;
  double is_cap = 2.0;        // C
  double mask_low = 0.5;      // kMask: the kept ratio range is [mask_low, is_cap]
  bool std_normalize = false;
  int ppo_epochs = 1;
  double clip_low = 0.2, clip_high = 0.2;
  double kl_coef = 0.0;
  bool routing_replay = true;  // MoE only
  bool fast_decode = true;     // CUDA: SamplerOptions::fast_decode (false: a mismatch diagnostic)
  uint64_t seed = 0;           // prompts and sampling draws
  void validate() const;       // throws naming the field
  LossOptions loss_options() const;  // the loss fields as rl_loss.h takes them
};
nlohmann::json to_json(const RlConfig& c);

struct StepMetrics {
  int64_t step = 0;
  double reward_mean = 0, reward_std = 0;
  double k3 = 0;                 // E[rho - log rho - 1], rho = pi_trainer / pi_sampler
  double max_abs_logp_diff = 0;  // max |logp_trainer - logp_sampler|
  double mean_abs_logp_diff = 0;
  double clipped_fraction = 0;   // truncated (w capped) or masked tokens / tokens
  double ppo_clipped_fraction = 0;  // last epoch's tokens clipped by PPO (0 with one epoch)
  double kl_ref = 0;             // mean K3 to the reference (kl_coef > 0)
  double entropy = 0;            // mean entropy of the sampling distribution per token
  double completion_len = 0;     // mean tokens per completion
  double stopped_fraction = 0;   // completions that ended with a stop token
  double loss = 0;               // the surrogate loss value of the last epoch
  double grad_norm = 0;
  double lr = 0;
  int64_t sampled_tokens = 0;    // completion tokens of the batch
  double sampler_tokens_per_s = 0, trainer_tokens_per_s = 0;
  double sampler_s = 0, trainer_s = 0;
  bool applied = true;           // false: a non-finite gradient norm skipped the update
};
nlohmann::json to_json(const StepMetrics& m);
std::string progress_line(const StepMetrics& m);  // one line for people

// Where the trainer's weights start.
struct RlModelOptions {
  Device device = Device::kCpu;
  DType cpu_dtype = DType::kF32;
  uint64_t init_seed = 0;  // the fresh initialization when no start model is given
  void* stream = nullptr;
};

class RlTrainer {
 public:
  // The trainer's model (config, recipe) with the weights of `start` (same config; may be null:
  // a fresh model from init_seed), a sampler of the same recipe, and the task. `task` must
  // outlive the trainer.
  RlTrainer(model::ModelConfig config, recipe::ResolvedRecipe recipe, const RlModelOptions& model_options,
            const Task& task, const RlConfig& config_rl, const model::Model* start = nullptr);
  ~RlTrainer();

  StepMetrics step();
  int64_t steps() const { return step_; }

  // Mean reward of n held-out prompts (a Philox stream disjoint from training's), one completion
  // each, greedy (temperature 0) unless temperature > 0.
  double evaluate(int n_prompts, double temperature = 0.0);

  model::Model& model() { return *model_; }
  Sampler& sampler() { return *sampler_; }
  const train::AdamW& optimizer() const { return *opt_; }
  const RlConfig& config() const { return cfg_; }

  // The prompt of example `ex` as tokens: kEndOfDocumentToken then its bytes.
  static std::vector<int32_t> prompt_tokens(const Example& ex);
  // The completion as text: its bytes up to the first non-byte token.
  static std::string completion_text(const std::vector<int32_t>& tokens);

 private:
  RlConfig cfg_;
  const Task& task_;
  int max_len_ = 0;
  int row_tile_ = 1;
  std::unique_ptr<model::Model> model_, reference_;
  std::unique_ptr<Sampler> sampler_;
  std::unique_ptr<train::AdamW> opt_;
  int64_t step_ = 0;
  uint64_t eval_calls_ = 0;
};

}  // namespace fourbit::rl
