// AdamW over a Model's parameter table and the learning-rate schedules (see optimizer.h).
#include "train/optimizer.h"

#include "core/check.h"
#include "ops/adamw.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <numbers>

namespace fourbit::train {

void validate(const AdamWConfig& config) {
  FOURBIT_CHECK(config.beta1 >= 0 && config.beta1 < 1 && config.beta2 >= 0 && config.beta2 < 1,
                "AdamW: beta1 and beta2 must lie in [0, 1), got {} and {}", config.beta1,
                config.beta2);
  FOURBIT_CHECK(std::isfinite(config.eps) && config.eps >= 0,
                "AdamW: eps must be finite and >= 0, got {}", config.eps);
  FOURBIT_CHECK(std::isfinite(config.weight_decay) && config.weight_decay >= 0,
                "AdamW: weight_decay must be finite and >= 0, got {}", config.weight_decay);
  FOURBIT_CHECK(std::isfinite(config.grad_clip),
                "AdamW: grad_clip must be finite (<= 0 disables clipping), got {}",
                config.grad_clip);
}

bool adamw_decays(const model::ParamSpec& s, const AdamWConfig& config) {
  const bool decay = s.kind != model::ParamKind::kNorm &&
                     (s.weight_decay ||
                      (config.decay_embeddings && s.kind == model::ParamKind::kEmbedding));
  return decay && s.trainable;
}

StepResult step_result_for_norm(double grad_norm, const AdamWConfig& config) {
  StepResult r;
  r.grad_norm = grad_norm;
  if (!std::isfinite(grad_norm)) {
    r.clip_scale = std::nan("");
    r.applied = false;
    return r;
  }
  r.clip_scale = ops::clip_grad_scale((float)grad_norm, (float)config.grad_clip);
  r.applied = true;
  return r;
}

ops::AdamWParams adamw_update_params(const AdamWConfig& config, double lr, int64_t step, bool decay,
                                     float grad_scale) {
  ops::AdamWParams a;
  a.lr = (float)lr;
  a.beta1 = (float)config.beta1;
  a.beta2 = (float)config.beta2;
  a.eps = (float)config.eps;
  a.weight_decay = decay ? (float)config.weight_decay : 0.0f;
  a.step = step;
  a.grad_scale = grad_scale;
  return a;
}

AdamW::AdamW(model::Model& model, const AdamWConfig& config) : model_(model), config_(config) {
  validate(config);
  const model::ParamTable& table = model.table();
  const model::ParamBuffer& params = model.params();
  m_ = model::ParamBuffer(table, params.dtype(), params.device());
  v_ = model::ParamBuffer(table, params.dtype(), params.device());
  for (int i = 0; i < table.size(); ++i) {
    const model::ParamSpec& s = table.row(i);
    decay_.push_back(adamw_decays(s, config));
    if (s.trainable) trainable_.push_back(i);
  }
  const Device dev = params.device();
  norm_ = Tensor::zeros({1}, dev == Device::kCuda ? DType::kF32 : params.dtype(), dev);
  if (dev == Device::kCuda) {
    std::vector<TensorView> grads;
    for (int i : trainable_) grads.push_back(model.grads().view(i));
    const int64_t bytes = ops::grad_norm_workspace_bytes(grads);
    workspace_ = Tensor::zeros({(bytes + 15) / 16 * 16}, DType::kU8, dev);
  }
}

double AdamW::grad_norm() {
  std::vector<TensorView> grads;
  grads.reserve(trainable_.size());
  for (int i : trainable_) grads.push_back(model_.grads().view(i));
  ops::global_grad_norm(norm_, grads, workspace_.defined() ? workspace_.view() : TensorView{},
                        config_.stream);
  if (norm_.device() == Device::kCuda) {
    Tensor host = norm_.to(Device::kCpu);  // synchronizing copy
    return (double)host.ptr<float>()[0];
  }
  return norm_.dtype() == DType::kF64 ? norm_.ptr<double>()[0] : (double)norm_.ptr<float>()[0];
}

StepResult AdamW::step(double lr) {
  FOURBIT_CHECK(std::isfinite(lr) && lr >= 0, "AdamW::step: lr must be finite and >= 0, got {}",
                lr);
  StepResult r = step_result_for_norm(grad_norm(), config_);
  if (!r.applied) return r;
  const float scale = (float)r.clip_scale;
  const model::ParamBuffer& compute = model_.compute_params();
  const bool write_bf16 = compute.dtype() == DType::kBF16 && &compute != &model_.params();
  std::vector<ops::AdamWUpdate> updates;
  updates.reserve(trainable_.size());
  for (int i : trainable_) {
    updates.push_back({model_.params().view(i), model_.grads().view(i), m_.view(i), v_.view(i),
                       write_bf16 ? compute.view(i) : TensorView{},
                       adamw_update_params(config_, lr, steps_ + 1, decay_[(size_t)i], scale)});
  }
  ops::adamw_update_many(updates, config_.stream);
  ++steps_;
  r.applied = true;
  return r;
}

void AdamW::set_steps(int64_t steps) {
  FOURBIT_CHECK(steps >= 0, "AdamW::set_steps: steps must be >= 0, got {}", steps);
  steps_ = steps;
}

// ---- schedules ---------------------------------------------------------------------------------

std::string_view schedule_kind_name(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::kCosine: return "cosine";
    case ScheduleKind::kWsd: return "wsd";
    case ScheduleKind::kConstant: return "constant";
  }
  return "?";
}

ScheduleKind parse_schedule_kind(std::string_view name) {
  for (ScheduleKind k : {ScheduleKind::kCosine, ScheduleKind::kWsd, ScheduleKind::kConstant})
    if (schedule_kind_name(k) == name) return k;
  throw Error(fmt::format("unknown learning-rate schedule '{}': use cosine, wsd or constant",
                          name));
}

void Schedule::validate() const {
  FOURBIT_CHECK(std::isfinite(lr) && lr >= 0, "schedule: lr must be finite and >= 0, got {}", lr);
  FOURBIT_CHECK(std::isfinite(min_lr) && min_lr >= 0 && min_lr <= lr,
                "schedule: min_lr must lie in [0, lr = {}], got {}", lr, min_lr);
  FOURBIT_CHECK(total_steps >= 1, "schedule: total_steps must be >= 1, got {}", total_steps);
  FOURBIT_CHECK(warmup_steps >= 0 && warmup_steps <= total_steps,
                "schedule: warmup_steps must lie in [0, total_steps = {}], got {}", total_steps,
                warmup_steps);
  FOURBIT_CHECK(decay_fraction >= 0 && decay_fraction <= 1,
                "schedule: decay_fraction must lie in [0, 1], got {}", decay_fraction);
}

double Schedule::at(int64_t step) const {
  FOURBIT_CHECK(step >= 0, "schedule: step must be >= 0, got {}", step);
  if (step < warmup_steps) return lr * (double)(step + 1) / (double)warmup_steps;
  switch (kind) {
    case ScheduleKind::kConstant: return lr;
    case ScheduleKind::kCosine: {
      const int64_t span = total_steps - warmup_steps;
      double p = span <= 0 ? 1.0 : (double)(step - warmup_steps) / (double)span;
      p = p < 0 ? 0 : p > 1 ? 1 : p;
      return min_lr + (lr - min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * p));
    }
    case ScheduleKind::kWsd: {
      int64_t decay_start = total_steps - (int64_t)std::llround(decay_fraction * (double)total_steps);
      if (decay_start < warmup_steps) decay_start = warmup_steps;
      if (step < decay_start) return lr;
      const int64_t span = total_steps - decay_start;
      if (span <= 0) return lr;
      double p = (double)(step - decay_start + 1) / (double)span;
      p = p > 1 ? 1 : p;
      return lr + (min_lr - lr) * p;
    }
  }
  return lr;
}

nlohmann::json to_json(const AdamWConfig& c) {
  return {{"beta1", c.beta1},
          {"beta2", c.beta2},
          {"eps", c.eps},
          {"weight_decay", c.weight_decay},
          {"grad_clip", c.grad_clip},
          {"decay_embeddings", c.decay_embeddings}};
}

nlohmann::json to_json(const Schedule& s) {
  return {{"kind", std::string(schedule_kind_name(s.kind))},
          {"lr", s.lr},
          {"min_lr", s.min_lr},
          {"warmup_steps", s.warmup_steps},
          {"total_steps", s.total_steps},
          {"decay_fraction", s.decay_fraction}};
}

AdamWConfig adamw_config_from_json(const nlohmann::json& j) {
  AdamWConfig c;
  c.beta1 = j.at("beta1").get<double>();
  c.beta2 = j.at("beta2").get<double>();
  c.eps = j.at("eps").get<double>();
  c.weight_decay = j.at("weight_decay").get<double>();
  c.grad_clip = j.at("grad_clip").get<double>();
  c.decay_embeddings = j.at("decay_embeddings").get<bool>();
  return c;
}

Schedule schedule_from_json(const nlohmann::json& j) {
  Schedule s;
  s.kind = parse_schedule_kind(j.at("kind").get<std::string>());
  s.lr = j.at("lr").get<double>();
  s.min_lr = j.at("min_lr").get<double>();
  s.warmup_steps = j.at("warmup_steps").get<int64_t>();
  s.total_steps = j.at("total_steps").get<int64_t>();
  s.decay_fraction = j.at("decay_fraction").get<double>();
  s.validate();
  return s;
}

}  // namespace fourbit::train
