// The training optimizer: AdamW over a Model's FP32 master weights (ops/adamw.h per parameter
// tensor), global gradient-norm clipping, decoupled weight decay with a per-tensor decay mask, and
// the learning-rate schedules (linear warmup, then cosine or warmup-stable-decay (WSD) or constant).
//
// Usage (pretraining and the RL trainer alike):
//   train::AdamW opt(model, train::AdamWConfig{...});
//   for each step:
//     model.zero_grads();
//     for each micro-batch: model.forward(...); model.backward({.loss_scale = 1.0 / micro});
//     train::StepResult r = opt.step(schedule.at(opt.steps()));
//     if (!r.applied) ...   // a non-finite gradient norm: nothing was changed (see below)
//
// Invariants.
//   * The moments exp_avg (m) and exp_avg_sq (v) are ParamBuffers laid out by the model's table, in
//     the master dtype (f32; f64 for an f64 CPU model), on the model's device, zero before step 1.
//   * step() first computes the global L2 norm of all trainable gradients (router bias buffers are
//     not trained). If it is NaN or Inf, step() returns applied = false and changes NOTHING
//     (parameters, moments and the step count are untouched), so the caller's NaN policy can skip
//     the step or stop with the state intact. Otherwise it scales the gradients by
//     clip_grad_scale(norm, grad_clip) (torch.nn.utils.clip_grad_norm_), updates every trainable
//     tensor with its own weight decay (mask below) and bias correction step steps()+1, writes the
//     BF16 compute copy in the same pass on CUDA (so no params_changed() is needed), and counts
//     the step.
//   * Decay mask: a tensor decays iff its ParamSpec::weight_decay (linear, router, expert and untied
//     LM-head weights) or, with decay_embeddings, it is the embedding; norms never decay.
//   * Deterministic: the norm and the updates are fixed-order (ops/adamw.h), so a resumed run
//     (moments and steps() restored, see checkpoint.h) continues bit for bit.
//   * step() does not zero the gradients; the caller does (model.zero_grads()) before accumulating.
#pragma once

#include "core/tensor.h"
#include "model/model.h"
#include "ops/adamw.h"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace fourbit::train {

struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;      // decoupled; only on the tensors of the decay mask
  double grad_clip = 1.0;         // max global L2 norm; <= 0: no clipping
  bool decay_embeddings = false;  // also decay the token embedding (tied LM head included)
  void* stream = nullptr;         // cudaStream_t of the model (CUDA)
};

struct StepResult {
  double grad_norm = 0;    // global L2 norm of the gradients before clipping
  double clip_scale = 1;   // the factor applied to the gradients (1: no clipping)
  bool applied = false;    // false: the norm was not finite and nothing changed
};

class AdamW {
 public:
  // Allocates the two moments (zero) on the model's device. The model must outlive the optimizer.
  AdamW(model::Model& model, const AdamWConfig& config);

  // One update with learning rate `lr` (see the invariants above). Synchronizes (reads the norm).
  StepResult step(double lr);
  // The global gradient norm of the current gradients, without updating (synchronizes).
  double grad_norm();

  int64_t steps() const { return steps_; }  // updates applied so far
  const AdamWConfig& config() const { return config_; }
  bool decays(int row) const { return decay_[(size_t)row]; }  // the decay mask, by table row
  const model::ParamBuffer& exp_avg() const { return m_; }
  const model::ParamBuffer& exp_avg_sq() const { return v_; }

  // Restores a saved state (checkpoint.h): the step count; the moments are written through
  // exp_avg() / exp_avg_sq() views.
  void set_steps(int64_t steps);

 private:
  model::Model& model_;
  AdamWConfig config_;
  model::ParamBuffer m_, v_;
  std::vector<bool> decay_;
  std::vector<int> trainable_;  // table rows that are updated
  Tensor norm_, workspace_;     // [1] f32/f64 on the model's device; CUDA reduction scratch
  int64_t steps_ = 0;
};

// The pieces of AdamW::step that a sharded optimizer (dist/zero_optimizer.h: ZeRO-1, each rank
// updating a slice of the flat parameter space) reuses, so that both run the same math.
// Throws naming the field when the config is invalid (betas in [0, 1), eps and weight_decay finite
// and >= 0, grad_clip finite).
void validate(const AdamWConfig& config);
// The decay mask of one table row (see the invariants above).
bool adamw_decays(const model::ParamSpec& spec, const AdamWConfig& config);
// The start of a step from its global gradient norm: a non-finite norm gives applied = false and a
// NaN clip scale (the caller then changes nothing); otherwise clip_scale = the clipping factor of
// ops::clip_grad_scale and applied = true.
StepResult step_result_for_norm(double grad_norm, const AdamWConfig& config);
// The per-tensor arguments of ops::adamw_update for update number `step` (1-based) of a tensor
// with (decay) or without weight decay, gradients scaled by grad_scale (clipping).
ops::AdamWParams adamw_update_params(const AdamWConfig& config, double lr, int64_t step, bool decay,
                                     float grad_scale);

// ---- learning-rate schedules -----------------------------------------------------------------
enum class ScheduleKind : uint8_t {
  kCosine,    // warmup, then cosine from lr to min_lr at total_steps
  kWsd,       // warmup, constant lr, then a linear decay to min_lr over the last decay_fraction
  kConstant,  // warmup, then constant lr
};
std::string_view schedule_kind_name(ScheduleKind k);  // "cosine", "wsd", "constant"
ScheduleKind parse_schedule_kind(std::string_view name);  // throws listing the names

// at(s) is the learning rate of update s (0-based: the (s+1)-th update), for 0 <= s; past
// total_steps it stays at the final value.
//   warmup (s < warmup_steps):   lr * (s + 1) / warmup_steps
//   cosine:   p = (s - warmup) / (total - warmup) clamped to [0, 1]
//             min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2
//   wsd:      decay_start = total - round(decay_fraction * total) (at least warmup);
//             lr until decay_start, then lr + (min_lr - lr) * (s - decay_start + 1) / (total -
//             decay_start), reaching min_lr at the last update s = total - 1
//   constant: lr
struct Schedule {
  ScheduleKind kind = ScheduleKind::kCosine;
  double lr = 3e-4;
  double min_lr = 3e-5;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double decay_fraction = 0.2;  // wsd only

  double at(int64_t step) const;
  void validate() const;  // throws naming the field
};

nlohmann::json to_json(const AdamWConfig& c);
nlohmann::json to_json(const Schedule& s);
AdamWConfig adamw_config_from_json(const nlohmann::json& j);
Schedule schedule_from_json(const nlohmann::json& j);

}  // namespace fourbit::train
