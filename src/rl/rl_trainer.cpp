// The RL trainer (rl_trainer.h): rollouts, rewards, group advantages, the importance-corrected
// per-token weights of the policy-gradient loss, and the AdamW step through the model's weighted
// cross-entropy backward.
#include "rl/rl_trainer.h"

#include "core/check.h"
#include "rl/byte_tokens.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

namespace fourbit::rl {

namespace {

constexpr uint64_t kEvalSeedSalt = 0x4556414C00000000ull;  // "EVAL": held-out prompts
constexpr uint64_t kEvalCallBit = 1ull << 62;               // sampler calls of evaluate()

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void copy_weights(model::Model& dst, const model::Model& src, std::string_view what) {
  const model::ParamBuffer& s = src.params();
  const model::ParamBuffer& d = dst.params();
  FOURBIT_CHECK(s.size() == d.size() && s.flat().numel() == d.flat().numel() && s.dtype() == d.dtype(),
                "RlTrainer: the {} model '{}' ({} tensors, {} elements, {}) does not match the config "
                "'{}' ({} tensors, {} elements, {})", what, src.config().name, s.size(), s.flat().numel(),
                dtype_name(s.dtype()), dst.config().name, d.size(), d.flat().numel(), dtype_name(d.dtype()));
  copy_tensor(d.flat(), s.flat());
  dst.params_changed();
}

std::vector<double> host_f64(const TensorView& t) {
  std::vector<double> out((size_t)t.numel());
  Tensor host;
  TensorView v = t;
  if (t.device != Device::kCpu) {
    host = Tensor::empty(t.shape, t.dtype, Device::kCpu);
    copy_tensor(host.view(), t);
    v = host.view();
  }
  if (v.dtype == DType::kF64) {
    std::copy(v.ptr<const double>(), v.ptr<const double>() + v.numel(), out.begin());
  } else {
    FOURBIT_CHECK(v.dtype == DType::kF32, "RlTrainer: expected f32 or f64 losses, got {}", v.describe());
    std::copy(v.ptr<const float>(), v.ptr<const float>() + v.numel(), out.begin());
  }
  return out;
}

}  // namespace

LossOptions RlConfig::loss_options() const {
  LossOptions o;
  o.importance = importance;
  o.is_cap = is_cap;
  o.mask_low = mask_low;
  o.ppo = ppo_epochs > 1;
  o.clip_low = clip_low;
  o.clip_high = clip_high;
  o.kl_coef = kl_coef;
  return o;
}

void RlConfig::validate() const {
  FOURBIT_CHECK(prompts_per_step >= 1, "rl: prompts_per_step must be >= 1, got {}", prompts_per_step);
  FOURBIT_CHECK(group_size >= 2, "rl: group_size must be >= 2 (the advantage is relative to the group), got {}",
                group_size);
  FOURBIT_CHECK(max_new_tokens >= 1, "rl: max_new_tokens must be >= 1, got {}", max_new_tokens);
  FOURBIT_CHECK(max_len >= 0, "rl: max_len must be >= 0 (0: automatic), got {}", max_len);
  FOURBIT_CHECK(temperature > 0 && std::isfinite(temperature),
                "rl: temperature must be > 0 for training rollouts (the trainer recomputes softmax(logits "
                "/ T) only for T = 1), got {}", temperature);
  FOURBIT_CHECK(temperature == 1.0, "rl: temperature {} is not supported for training: the trainer's "
                "log-probabilities are those of softmax(logits) (temperature 1); use 1", temperature);
  FOURBIT_CHECK(lr > 0 && std::isfinite(lr), "rl: lr must be > 0, got {}", lr);
  FOURBIT_CHECK(warmup_steps >= 0, "rl: warmup_steps must be >= 0, got {}", warmup_steps);
  FOURBIT_CHECK(is_cap >= 1, "rl: is_cap (C) must be >= 1, got {}", is_cap);
  FOURBIT_CHECK(mask_low > 0 && mask_low <= 1, "rl: mask_low must lie in (0, 1], got {}", mask_low);
  FOURBIT_CHECK(ppo_epochs >= 1, "rl: ppo_epochs must be >= 1, got {}", ppo_epochs);
  FOURBIT_CHECK(clip_low > 0 && clip_low < 1 && clip_high > 0,
                "rl: PPO clip range must satisfy 0 < clip_low < 1 and clip_high > 0, got {} / {}", clip_low,
                clip_high);
  FOURBIT_CHECK(kl_coef >= 0, "rl: kl_coef must be >= 0, got {}", kl_coef);
}

nlohmann::json to_json(const RlConfig& c) {
  return {{"prompts_per_step", c.prompts_per_step}, {"group_size", c.group_size},
          {"max_new_tokens", c.max_new_tokens},     {"max_len", c.max_len},
          {"temperature", c.temperature},           {"lr", c.lr},
          {"warmup_steps", c.warmup_steps},         {"adamw", train::to_json(c.adamw)},
          {"importance", importance_mode_name(c.importance)},
          {"is_cap", c.is_cap},                     {"mask_low", c.mask_low},
          {"std_normalize", c.std_normalize},       {"ppo_epochs", c.ppo_epochs},
          {"clip_low", c.clip_low},                 {"clip_high", c.clip_high},
          {"kl_coef", c.kl_coef},                   {"routing_replay", c.routing_replay}, {"fast_decode", c.fast_decode},
          {"seed", c.seed}};
}

nlohmann::json to_json(const StepMetrics& m) {
  return {{"step", m.step},
          {"reward_mean", m.reward_mean},
          {"reward_std", m.reward_std},
          {"k3", m.k3},
          {"max_abs_logp_diff", m.max_abs_logp_diff},
          {"mean_abs_logp_diff", m.mean_abs_logp_diff},
          {"clipped_fraction", m.clipped_fraction},
          {"ppo_clipped_fraction", m.ppo_clipped_fraction},
          {"kl_ref", m.kl_ref},
          {"entropy", m.entropy},
          {"completion_len", m.completion_len},
          {"stopped_fraction", m.stopped_fraction},
          {"loss", m.loss},
          {"grad_norm", m.grad_norm},
          {"lr", m.lr},
          {"sampled_tokens", m.sampled_tokens},
          {"sampler_tokens_per_s", m.sampler_tokens_per_s},
          {"trainer_tokens_per_s", m.trainer_tokens_per_s},
          {"sampler_s", m.sampler_s},
          {"trainer_s", m.trainer_s},
          {"applied", m.applied}};
}

std::string progress_line(const StepMetrics& m) {
  return fmt::format(
      "rl step {:5d} | reward {:.3f} (std {:.3f}) | k3 {:.2e} | max|dlogp| {:.2e} | clipped {:.3f} | "
      "entropy {:.3f} | len {:.1f} | grad {:.3f}{} | sampler {:.0f} tok/s | trainer {:.0f} tok/s",
      m.step, m.reward_mean, m.reward_std, m.k3, m.max_abs_logp_diff, m.clipped_fraction, m.entropy,
      m.completion_len, m.grad_norm, m.applied ? "" : " (skipped: non-finite)", m.sampler_tokens_per_s,
      m.trainer_tokens_per_s);
}

std::vector<int32_t> RlTrainer::prompt_tokens(const Example& ex) {
  std::vector<int32_t> t;
  t.reserve(ex.prompt.size() + 1);
  t.push_back(kEndOfDocumentToken);
  for (char ch : ex.prompt) t.push_back((int32_t)(unsigned char)ch);
  return t;
}

std::string RlTrainer::completion_text(const std::vector<int32_t>& tokens) {
  std::string s;
  for (int32_t t : tokens) {
    if (t < 0 || t >= kByteTokenCount) break;
    s.push_back((char)(unsigned char)t);
  }
  return s;
}

RlTrainer::RlTrainer(model::ModelConfig config, recipe::ResolvedRecipe recipe, const RlModelOptions& mo,
                     const Task& task, const RlConfig& rl, const model::Model* start)
    : cfg_(rl), task_(task) {
  cfg_.validate();
  FOURBIT_CHECK(config.vocab >= kByteVocabSize,
                "rl: the model's vocabulary ({}) must hold the byte-level tokens and the end-of-document "
                "token ({}); set vocab >= {} (e.g. --set vocab=384)", config.vocab, kByteVocabSize,
                kByteVocabSize);
  max_len_ = cfg_.max_len > 0 ? cfg_.max_len : std::min(config.max_seq, 128);
  FOURBIT_CHECK(max_len_ >= 2 && max_len_ <= config.max_seq,
                "rl: max_len {} must lie in [2, the model's max_seq {}]", max_len_, config.max_seq);
  const int B = cfg_.prompts_per_step * cfg_.group_size;
  if (mo.device == Device::kCuda) row_tile_ = 128;  // the quantize kernels' token tile (model.h)

  model::ModelOptions options;
  options.device = mo.device;
  options.cpu_dtype = mo.cpu_dtype;
  options.seed = mo.init_seed;
  options.max_batch = B;
  // The activation arena holds B x max_seq tokens: the longest sequence (max_len - 1 inputs) plus
  // the padding that makes B x T a whole number of row tiles.
  options.max_seq = std::min(config.max_seq, max_len_ + (row_tile_ > 1 ? row_tile_ : 0));
  options.stream = mo.stream;
  model_ = std::make_unique<model::Model>(config, recipe, options);
  if (start != nullptr) copy_weights(*model_, *start, "start");
  if (cfg_.kl_coef > 0) {
    reference_ = std::make_unique<model::Model>(config, recipe, options);
    copy_weights(*reference_, *model_, "reference");
  }
  SamplerOptions so;
  so.device = mo.device;
  so.cpu_dtype = mo.cpu_dtype;
  so.max_batch = B;
  so.max_len = max_len_;
  so.stream = mo.stream;
  so.fast_decode = cfg_.fast_decode;
  sampler_ = std::make_unique<Sampler>(std::move(config), std::move(recipe), so);
  sampler_->refresh(*model_);
  train::AdamWConfig ac = cfg_.adamw;
  ac.stream = mo.stream;
  opt_ = std::make_unique<train::AdamW>(*model_, ac);
}

RlTrainer::~RlTrainer() = default;

double RlTrainer::evaluate(int n_prompts, double temperature) {
  FOURBIT_CHECK(n_prompts >= 1, "RlTrainer::evaluate: n_prompts must be >= 1, got {}", n_prompts);
  const int B = cfg_.prompts_per_step * cfg_.group_size;
  SamplingOptions so;
  so.temperature = temperature;
  so.max_new_tokens = cfg_.max_new_tokens;
  so.stop_tokens = {(int32_t)(unsigned char)kEndOfAnswer, kEndOfDocumentToken};
  so.seed = cfg_.seed;
  double total = 0;
  for (int first = 0; first < n_prompts; first += B) {
    const int n = std::min(B, n_prompts - first);
    std::vector<Example> ex((size_t)n);
    std::vector<std::vector<int32_t>> prompts((size_t)n);
    for (int i = 0; i < n; ++i) {
      task_.make_example(cfg_.seed ^ kEvalSeedSalt, (uint64_t)(first + i), ex[(size_t)i]);
      prompts[(size_t)i] = prompt_tokens(ex[(size_t)i]);
      FOURBIT_CHECK((int)prompts[(size_t)i].size() + cfg_.max_new_tokens <= max_len_,
                    "rl: prompt '{}' ({} tokens) plus max_new_tokens {} exceeds max_len {}; raise max_len",
                    ex[(size_t)i].prompt, prompts[(size_t)i].size(), cfg_.max_new_tokens, max_len_);
    }
    const std::vector<Rollout> r = sampler_->generate(prompts, so, kEvalCallBit | eval_calls_++);
    for (int i = 0; i < n; ++i) total += task_.score(ex[(size_t)i], completion_text(r[(size_t)i].tokens));
  }
  return total / n_prompts;
}

StepMetrics RlTrainer::step() {
  const model::ModelConfig& c = model_->config();
  const int P = cfg_.prompts_per_step, G = cfg_.group_size, B = P * G;
  StepMetrics m;
  m.step = step_;

  // ---- 1. rollouts -------------------------------------------------------------------------------
  std::vector<Example> ex((size_t)P);
  std::vector<std::vector<int32_t>> prompts((size_t)B);
  for (int p = 0; p < P; ++p) {
    task_.make_example(cfg_.seed, (uint64_t)(step_ * P + p), ex[(size_t)p]);
    const std::vector<int32_t> t = prompt_tokens(ex[(size_t)p]);
    FOURBIT_CHECK((int)t.size() + cfg_.max_new_tokens <= max_len_,
                  "rl: prompt '{}' ({} tokens) plus max_new_tokens {} exceeds max_len {}; raise max_len",
                  ex[(size_t)p].prompt, t.size(), cfg_.max_new_tokens, max_len_);
    for (int g = 0; g < G; ++g) prompts[(size_t)(p * G + g)] = t;
  }
  SamplingOptions so;
  so.temperature = cfg_.temperature;
  so.max_new_tokens = cfg_.max_new_tokens;
  so.stop_tokens = {(int32_t)(unsigned char)kEndOfAnswer, kEndOfDocumentToken};
  so.seed = cfg_.seed;
  const std::vector<Rollout> rollouts = sampler_->generate(prompts, so, (uint64_t)step_);
  m.sampler_s = sampler_->last_stats().seconds;
  m.sampler_tokens_per_s = sampler_->last_stats().tokens_per_second();

  // ---- 2-3. rewards and advantages -----------------------------------------------------------------
  std::vector<double> reward((size_t)B), adv((size_t)B);
  for (int i = 0; i < B; ++i)
    reward[(size_t)i] = task_.score(ex[(size_t)(i / G)], completion_text(rollouts[(size_t)i].tokens));
  double rsum = 0, rsq = 0;
  for (double r : reward) rsum += r;
  m.reward_mean = rsum / B;
  for (double r : reward) rsq += (r - m.reward_mean) * (r - m.reward_mean);
  m.reward_std = std::sqrt(rsq / B);
  for (int p = 0; p < P; ++p) {
    double mean = 0, var = 0;
    for (int g = 0; g < G; ++g) mean += reward[(size_t)(p * G + g)];
    mean /= G;
    for (int g = 0; g < G; ++g) var += std::pow(reward[(size_t)(p * G + g)] - mean, 2);
    const double sd = std::sqrt(var / G);
    for (int g = 0; g < G; ++g) {
      double a = reward[(size_t)(p * G + g)] - mean;
      if (cfg_.std_normalize) a /= sd + 1e-6;
      adv[(size_t)(p * G + g)] = a;
    }
  }

  // ---- 4. the trainer's batch ----------------------------------------------------------------------
  int T = 1;
  int64_t n_tok = 0, fed = 0, stopped = 0;
  double entropy = 0;
  for (int i = 0; i < B; ++i) {
    const Rollout& r = rollouts[(size_t)i];
    T = std::max(T, (int)(prompts[(size_t)i].size() + r.tokens.size() - 1));
    n_tok += (int64_t)r.tokens.size();
    fed += (int64_t)(prompts[(size_t)i].size() + r.tokens.size() - 1);
    stopped += r.stopped;
    for (float e : r.entropies) entropy += e;
  }
  while (((int64_t)B * T) % row_tile_ != 0) ++T;  // quantized CUDA passes: whole row tiles
  FOURBIT_CHECK(T <= model_->max_seq(), "rl: the trainer's batch needs {} positions per sequence (padded so "
                "that batch x positions is a multiple of {}), beyond its {}; use prompts_per_step x "
                "group_size a multiple of {}", T, row_tile_, model_->max_seq(), row_tile_);
  m.sampled_tokens = n_tok;
  m.entropy = n_tok > 0 ? entropy / (double)n_tok : 0;
  m.completion_len = (double)n_tok / B;
  m.stopped_fraction = (double)stopped / B;

  const int64_t N = (int64_t)B * T;
  std::vector<int32_t> tokens((size_t)N, 0), targets((size_t)N, -1);
  std::vector<int32_t> seq_of_row;  // per sampled token: its row in [B*T]
  std::vector<double> lp_s, a_tok;  // per sampled token: sampler log-prob, advantage
  seq_of_row.reserve((size_t)n_tok);
  lp_s.reserve((size_t)n_tok);
  a_tok.reserve((size_t)n_tok);
  const bool replay = c.is_moe() && cfg_.routing_replay;
  const int64_t rr = c.is_moe() ? (int64_t)c.n_moe_layers() * c.moe.top_k : 0;
  std::vector<int32_t> routes(replay ? (size_t)(N * rr) : 0);
  for (size_t j = 0; j < routes.size(); ++j) routes[j] = (int32_t)(j % (size_t)c.moe.top_k);  // padding rows
  for (int i = 0; i < B; ++i) {
    const std::vector<int32_t>& p = prompts[(size_t)i];
    const Rollout& r = rollouts[(size_t)i];
    const int Pn = (int)p.size(), L = Pn + (int)r.tokens.size();  // the whole sequence
    auto at = [&](int t) { return t < Pn ? p[(size_t)t] : r.tokens[(size_t)(t - Pn)]; };
    for (int t = 0; t + 1 < L; ++t) {
      tokens[(size_t)(i * T + t)] = at(t);
      if (t + 1 >= Pn) {
        targets[(size_t)(i * T + t)] = at(t + 1);
        seq_of_row.push_back(i * T + t);
        lp_s.push_back(r.logprobs[(size_t)(t + 1 - Pn)]);
        a_tok.push_back(adv[(size_t)i]);
      }
    }
    if (replay) {
      FOURBIT_CHECK((int64_t)r.expert_ids.size() == (int64_t)(L - 1) * rr,
                    "rl: rollout {} carries {} expert ids for {} fed positions", i, r.expert_ids.size(), L - 1);
      std::copy(r.expert_ids.begin(), r.expert_ids.end(), routes.begin() + (ptrdiff_t)((int64_t)i * T * rr));
    }
  }
  const TensorView tv = TensorView::contiguous(tokens.data(), DType::kI32, Shape{B, T}, Device::kCpu);
  const TensorView gv = TensorView::contiguous(targets.data(), DType::kI32, Shape{B, T}, Device::kCpu);
  model::ForwardOptions fo;
  fo.stage = model::TrainingStage::kRlTrainer;
  if (replay)
    fo.forced_expert_ids = TensorView::contiguous(routes.data(), DType::kI32, Shape{N, c.n_moe_layers(), c.moe.top_k},
                                                  Device::kCpu);

  std::vector<double> lp_ref;
  const auto t_train = Clock::now();
  if (reference_) {
    fo.step = (uint64_t)step_;
    model::ForwardOptions ref_fo = fo;
    ref_fo.for_backward = false;  // log-probabilities only
    reference_->forward(tv, gv, ref_fo);
    const std::vector<double> l = host_f64(reference_->token_losses());
    lp_ref.resize(seq_of_row.size());
    for (size_t j = 0; j < seq_of_row.size(); ++j) lp_ref[j] = -l[(size_t)seq_of_row[j]];
  }

  // ---- 4-5. epochs: forward, weights, backward, update ---------------------------------------------
  const size_t n = seq_of_row.size();
  const LossOptions lo = cfg_.loss_options();
  std::vector<double> lp_old;
  ImportanceWeights iw;
  std::vector<float> weights((size_t)N, 0.0f);
  m.lr = cfg_.warmup_steps > 0 && step_ < cfg_.warmup_steps ? cfg_.lr * (double)(step_ + 1) / cfg_.warmup_steps
                                                             : cfg_.lr;
  for (int e = 0; e < cfg_.ppo_epochs; ++e) {
    model_->zero_grads();
    fo.step = (uint64_t)(step_ * cfg_.ppo_epochs + e);
    model_->forward(tv, gv, fo);
    const std::vector<double> l = host_f64(model_->token_losses());
    std::vector<double> lp(n);
    for (size_t j = 0; j < n; ++j) lp[j] = -l[(size_t)seq_of_row[j]];
    if (e == 0) {  // the mismatch metrics and the (constant) importance weights
      lp_old = lp;
      iw = importance_weights(lp_old, lp_s, lo);
      m.k3 = iw.k3;
      m.max_abs_logp_diff = iw.max_abs_diff;
      m.mean_abs_logp_diff = iw.mean_abs_diff;
      m.clipped_fraction = n > 0 ? (double)iw.clipped / (double)n : 0;
    }
    const TokenWeights tw = token_weights(lp, lp_old, a_tok, lp_ref, iw, lo);
    if (e == 0) m.kl_ref = tw.kl_ref;
    m.loss = tw.loss;
    m.ppo_clipped_fraction = n > 0 ? (double)tw.ppo_clipped / (double)n : 0;
    std::fill(weights.begin(), weights.end(), 0.0f);
    for (size_t j = 0; j < n; ++j) weights[(size_t)seq_of_row[j]] = (float)tw.weight[j];
    model::BackwardOptions bo;
    bo.token_weights = TensorView::contiguous(weights.data(), DType::kF32, Shape{N}, Device::kCpu);
    model_->backward(bo);
    const train::StepResult sr = opt_->step(m.lr);
    m.grad_norm = sr.grad_norm;
    m.applied = m.applied && sr.applied;
  }
  m.trainer_s = seconds_since(t_train);
  m.trainer_tokens_per_s = m.trainer_s > 0 ? (double)(fed * cfg_.ppo_epochs) / m.trainer_s : 0;
  sampler_->refresh(*model_);
  ++step_;
  return m;
}

}  // namespace fourbit::rl
