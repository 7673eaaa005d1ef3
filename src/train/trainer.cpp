// The pretraining loop (trainer.h).
#include "train/trainer.h"

#include "core/check.h"
#include "core/device.h"
#include "core/log.h"
#include "io/atomic_file.h"
#include "model/config.h"
#include "rl/byte_tokens.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

namespace fourbit::train {
namespace fs = std::filesystem;

namespace {

constexpr int kCorpusPaddedVocab = 384;  // rl/byte_tokens.h: 257 ids padded to a multiple of 128

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const int64_t t = (int64_t)std::llround(s);
  if (t >= 3600) return fmt::format("{}h{:02}m", t / 3600, (t / 60) % 60);
  if (t >= 60) return fmt::format("{}m{:02}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

std::string format_rate(double x) {
  if (x >= 1e6) return fmt::format("{:.2f}M", x / 1e6);
  if (x >= 1e3) return fmt::format("{:.1f}k", x / 1e3);
  return fmt::format("{:.0f}", x);
}

// The first non-finite activation or gradient, as the model's check reports it.
template <typename F>
std::string locate(F&& check, std::string_view none) {
  try {
    check();
  } catch (const Error& e) {
    return e.what();
  }
  return std::string(none);
}

double json_number(const nlohmann::json& j) {
  return j.is_number() ? j.get<double>() : std::numeric_limits<double>::quiet_NaN();
}

// JSON has no NaN: non-finite numbers are written as null.
nlohmann::json finite_or_null(double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr); }

}  // namespace

std::string_view nan_policy_name(NanPolicy p) { return p == NanPolicy::kStop ? "stop" : "skip"; }

NanPolicy parse_nan_policy(std::string_view name) {
  if (name == "stop") return NanPolicy::kStop;
  if (name == "skip") return NanPolicy::kSkip;
  throw Error(fmt::format("unknown --nan-policy '{}': use stop or skip", name));
}

Device parse_device(std::string_view name) {
  if (name == "cpu") return Device::kCpu;
  if (name == "cuda") {
    FOURBIT_CHECK(cuda_device_count() > 0,
                  "--device cuda: no CUDA device is usable ({}); use --device cpu or auto",
                  built_with_cuda() ? "no GPU or driver found" : "this build has no CUDA");
    return Device::kCuda;
  }
  if (name == "auto") return cuda_device_count() > 0 ? Device::kCuda : Device::kCpu;
  throw Error(fmt::format("unknown --device '{}': use cpu, cuda or auto", name));
}

model::ModelConfig TrainConfig::model_config_resolved() const {
  model::ModelConfig c;
  if (model_config.empty()) {
    c = model::preset(preset);
  } else {
    std::ifstream f(model_config);
    FOURBIT_CHECK(f.good(), "cannot read the model config file '{}'", model_config);
    nlohmann::json j;
    try {
      f >> j;
    } catch (const nlohmann::json::exception& e) {
      throw Error(fmt::format("model config '{}' is not valid JSON: {}", model_config, e.what()));
    }
    c = model::config_from_json(j.contains("config") ? j["config"] : j);
  }
  bool vocab_set = false;
  for (const std::string& s : sets) vocab_set |= s.rfind("vocab=", 0) == 0;
  if (data.data.empty() && !vocab_set && c.vocab < rl::kByteVocabSize) c.vocab = kCorpusPaddedVocab;
  model::apply_sets(c, sets);
  if (data.data.empty()) {
    FOURBIT_CHECK(c.vocab >= rl::kByteVocabSize,
                  "model vocab {} is too small for the built-in corpus (byte tokens and the "
                  "end-of-document id need {}): --set vocab=384",
                  c.vocab, rl::kByteVocabSize);
  }
  FOURBIT_CHECK(data.seq_len <= c.max_seq,
                "--seq-len {} exceeds the model's max_seq {}: lower --seq-len or --set max_seq={}",
                data.seq_len, c.max_seq, data.seq_len);
  c.validate();
  return c;
}

recipe::Recipe TrainConfig::recipe_resolved() const {
  recipe::Recipe r;
  bool is_preset = false;
  for (std::string_view p : recipe::preset_names()) is_preset |= p == recipe;
  if (is_preset) {
    r = recipe::preset(recipe);
  } else {
    FOURBIT_CHECK(fs::exists(recipe),
                  "--recipe '{}' is neither a recipe preset ({}) nor an existing recipe file",
                  recipe, fmt::join(recipe::preset_names(), ", "));
    r = recipe::load_recipe_file(recipe);
  }
  recipe::apply_sets(r, recipe_sets);
  return r;
}

nlohmann::json to_json(const TrainConfig& c) {
  nlohmann::json j;
  j["preset"] = c.preset;
  j["model_config"] = c.model_config;
  j["sets"] = c.sets;
  j["recipe"] = c.recipe;
  j["recipe_sets"] = c.recipe_sets;
  j["device"] = std::string(device_name(c.device));
  j["seed"] = c.seed;
  j["data"] = {{"data", c.data.data},          {"val_data", c.data.val_data},
               {"val_fraction", c.data.val_fraction}, {"seed", c.data.seed},
               {"batch_size", c.data.batch_size},     {"seq_len", c.data.seq_len}};
  j["grad_accum"] = c.grad_accum;
  j["recompute_activations"] = c.recompute_activations;
  j["steps"] = c.steps;
  Schedule s = c.schedule;
  s.total_steps = c.steps;
  j["schedule"] = to_json(s);
  j["optimizer"] = to_json(c.optimizer);
  j["eval_every"] = c.eval_every;
  j["eval_batches"] = c.eval_batches;
  j["save_every"] = c.save_every;
  j["out_dir"] = c.out_dir;
  j["nan_policy"] = std::string(nan_policy_name(c.nan_policy));
  j["max_bad_steps"] = c.max_bad_steps;
  return j;
}

nlohmann::json resume_fingerprint(const TrainConfig& c) {
  const nlohmann::json full = to_json(c);
  nlohmann::json f;
  f["data"] = full["data"];
  f["grad_accum"] = full["grad_accum"];
  f["seed"] = full["seed"];
  f["schedule"] = full["schedule"];
  f["schedule"].erase("total_steps");
  f["optimizer"] = full["optimizer"];
  return f;
}

nlohmann::json TrainSummary::to_json() const {
  return {{"steps", steps},
          {"bad_steps", bad_steps},
          {"tokens_seen", tokens_seen},
          {"first_loss", finite_or_null(first_loss)},
          {"final_train_loss", finite_or_null(final_train_loss)},
          {"final_val_loss", finite_or_null(final_val_loss)},
          {"seconds", seconds},
          {"tokens_per_second", tokens_per_second},
          {"mfu", mfu},
          {"peak_device_bytes", peak_device_bytes},
          {"interrupted", interrupted}};
}

// ---- Trainer -----------------------------------------------------------------------------------

Trainer::Trainer(TrainConfig config, std::FILE* progress, DataParallelFactory data_parallel)
    : config_(std::move(config)), progress_(progress) {
  FOURBIT_CHECK(config_.steps >= 1, "--steps must be >= 1, got {}", config_.steps);
  FOURBIT_CHECK(config_.grad_accum >= 1, "--grad-accum must be >= 1, got {}", config_.grad_accum);
  FOURBIT_CHECK(config_.eval_every >= 0 && config_.eval_batches >= 1,
                "--eval-every must be >= 0 and --eval-batches >= 1, got {} and {}",
                config_.eval_every, config_.eval_batches);
  FOURBIT_CHECK(config_.max_bad_steps >= 0, "--max-bad-steps must be >= 0, got {}",
                config_.max_bad_steps);
  config_.schedule.total_steps = config_.steps;
  if (config_.schedule.warmup_steps > config_.steps) config_.schedule.warmup_steps = config_.steps;
  config_.schedule.validate();

  const model::ModelConfig mc = config_.model_config_resolved();
  config_.data.vocab = mc.vocab;
  data_ = make_data_sources(config_.data);
  FOURBIT_CHECK(mc.vocab >= data_.min_vocab, "model vocab {} is smaller than the data needs ({})",
                mc.vocab, data_.min_vocab);
  const recipe::ResolvedRecipe rr = recipe::resolve(config_.recipe_resolved(), mc.recipe_shape());
  model::ModelOptions mo;
  mo.device = config_.device;
  mo.seed = config_.seed;
  mo.max_batch = (int)config_.data.batch_size;
  mo.max_seq = (int)config_.data.seq_len;
  mo.recompute_activations = config_.recompute_activations;
  model_ = std::make_unique<model::Model>(mc, rr, mo);
  if (data_parallel) {
    dp_ = data_parallel(*model_, config_.optimizer);
    FOURBIT_CHECK(config_.grad_accum % dp_->world_size() == 0,
                  "--grad-accum {} (micro-batches per step over all ranks) must be a multiple of "
                  "the number of ranks {}: use --grad-accum {}",
                  config_.grad_accum, dp_->world_size(),
                  (config_.grad_accum + dp_->world_size() - 1) / dp_->world_size() * dp_->world_size());
    if (dp_->rank() != 0) progress_ = nullptr;
  } else {
    optimizer_ = std::make_unique<AdamW>(*model_, config_.optimizer);
  }
  const int64_t B = config_.data.batch_size, T = config_.data.seq_len;
  inputs_ = Tensor::zeros({B, T}, DType::kI32, Device::kCpu);
  targets_ = Tensor::zeros({B, T}, DType::kI32, Device::kCpu);
  if (!config_.out_dir.empty()) {
    std::error_code ec;
    fs::create_directories(config_.out_dir, ec);
    FOURBIT_CHECK(!ec, "cannot create the run directory '{}': {}", config_.out_dir, ec.message());
  }
  if (config_.device == Device::kCuda) reset_device_memory_peak();
  start_ = std::chrono::steady_clock::now();
}

Trainer::~Trainer() {
  if (metrics_ != nullptr) std::fclose(metrics_);
}

void Trainer::write_metrics(const nlohmann::json& line) {
  if (config_.out_dir.empty() || rank() != 0) return;
  if (metrics_ == nullptr) {
    const std::string path = config_.out_dir + "/metrics.jsonl";
    const bool fresh = step_ == 0 || !fs::exists(path);
    metrics_ = std::fopen(path.c_str(), fresh ? "w" : "a");
    FOURBIT_CHECK(metrics_ != nullptr, "cannot open the metrics file '{}' for writing", path);
    if (fresh) {
      const nlohmann::json head = {{"type", "run"},
                                   {"recipe", config_.recipe},
                                   {"model", model_->config().name},
                                   {"config", to_json(config_)}};
      std::fputs((head.dump() + "\n").c_str(), metrics_);
    }
  }
  std::fputs((line.dump() + "\n").c_str(), metrics_);
  std::fflush(metrics_);
}

double Trainer::flops_per_token() const {
  const model::ModelConfig& c = model_->config();
  const int64_t VC = (int64_t)c.vocab * c.d_model;
  const double matmul = (double)model_->table().n_active_params() - (c.tied_embeddings ? 0 : VC);
  return 6.0 * matmul + 6.0 * c.n_layers * (double)config_.data.seq_len * c.d_model;
}

StepMetrics Trainer::step() {
  const auto t0 = std::chrono::steady_clock::now();
  const int accum = config_.grad_accum;
  StepMetrics m;
  m.step = step_ + 1;
  m.lr = config_.schedule.at(step_);
  model_->zero_grads();
  bool bad = false;
  for (int micro = 0; micro < accum; ++micro) {
    data_.train->next(inputs_, targets_);
    if (micro % world_size() != rank()) continue;  // another rank's micro-batch
    if (bad) continue;  // keep the data stream where an unbroken step would leave it
    model::ForwardOptions fo;
    fo.stage = model::TrainingStage::kPretrain;
    fo.step = (uint64_t)(step_ * accum + micro);
    fo.check_finite = false;
    fo.loss_gradient_scale = 1.0 / accum;  // the backward's loss_scale below: one read of the logits
    const model::LossInfo li = model_->forward(inputs_, targets_, fo);
    if (!std::isfinite(li.loss)) {
      bad = true;
      m.loss = li.loss;
      m.bad_report = fmt::format(
          "micro-batch {}: loss {}: {}", micro, li.loss,
          locate([&] { model_->check_activations_finite(); }, "(every activation is finite)"));
    }
    if (lockstep()) {
      // The backward is a collective: every rank must know now whether any rank's loss was bad.
      double any_bad = bad ? 1.0 : 0.0;
      dp_->all_reduce_sum(std::span<double>(&any_bad, 1));
      if (!bad && any_bad > 0) {
        bad = true;
        m.bad_report = "a micro-batch of another rank had a non-finite loss (that rank reports it)";
      }
    }
    if (bad) continue;
    model::BackwardOptions bo;
    bo.loss_scale = 1.0 / accum;
    model_->backward(bo);
    m.loss += li.loss / accum;
    m.ce += li.ce / accum;
  }
  if (dp_) {
    // The step's mean losses over all ranks; a bad micro-batch anywhere makes the step bad
    // everywhere (the ranks must take the same decision).
    double sums[3] = {bad ? 0.0 : m.loss, bad ? 0.0 : m.ce, bad ? 1.0 : 0.0};
    dp_->all_reduce_sum(sums);
    if (!bad && sums[2] > 0) {
      bad = true;
      m.loss = std::numeric_limits<double>::quiet_NaN();
      m.bad_report = "a micro-batch of another rank had a non-finite loss (that rank reports it)";
    } else if (!bad) {
      m.loss = sums[0];
      m.ce = sums[1];
    }
  }
  for (int64_t s : config_.inject_nan_steps) {
    if (s == m.step && !bad) {
      const TensorView g = model_->grads().view(0);
      const float nan = std::numeric_limits<float>::quiet_NaN();
      FOURBIT_CHECK(g.dtype == DType::kF32, "inject_nan_steps needs f32 gradients");
      float host_nan = nan;
      copy_tensor(TensorView::contiguous(g.data, DType::kF32, {1}, g.device),
                  TensorView::contiguous(&host_nan, DType::kF32, {1}, Device::kCpu));
    }
  }
  if (!bad) {
    const StepResult r = dp_ ? dp_->optimizer_step(m.lr) : optimizer_->step(m.lr);
    m.grad_norm = r.grad_norm;
    m.clip_scale = r.clip_scale;
    if (!r.applied) {
      bad = true;
      m.bad_report = fmt::format(
          "gradient norm {}: {}", r.grad_norm,
          locate([&] { model_->check_grads_finite(); }, "(every gradient is finite)"));
    } else {
      model_->update_router_bias();
      if (dp_) dp_->after_update(*model_);
    }
  }
  m.applied = !bad;
  ++step_;
  const int64_t tokens = config_.data.batch_size * config_.data.seq_len * accum;
  tokens_seen_ += tokens;
  tokens_this_process_ += tokens;
  m.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  train_seconds_ += m.seconds;
  window_seconds_ += m.seconds;
  window_tokens_ += tokens;
  losses_.push_back(bad ? std::numeric_limits<double>::quiet_NaN() : m.loss);

  nlohmann::json line = {{"type", "train"},
                         {"step", m.step},
                         {"loss", finite_or_null(m.loss)},
                         {"ce", finite_or_null(m.ce)},
                         {"lr", m.lr},
                         {"grad_norm", finite_or_null(m.grad_norm)},
                         {"clip_scale", finite_or_null(m.clip_scale)},
                         {"tokens", tokens_seen_},
                         {"step_seconds", m.seconds},
                         {"tokens_per_second", tokens / m.seconds}};
  if (config_.device == Device::kCuda) line["mfu"] = tokens / m.seconds * flops_per_token() / kPeakFlops;
  if (bad) {
    line["skipped"] = true;
    line["bad"] = m.bad_report;
  }
  write_metrics(line);

  if (bad) {
    ++bad_steps_;
    if (config_.nan_policy == NanPolicy::kStop) {
      throw Error(fmt::format(
          "step {}: non-finite values, the update was not applied ({}). Policy --nan-policy stop: "
          "the model and optimizer state are those after step {}{}. Rerun with --nan-policy skip "
          "to skip such steps, or lower --lr.",
          m.step, m.bad_report, m.step - 1,
          !config_.out_dir.empty() && fs::exists(config_.out_dir + "/checkpoint")
              ? fmt::format("; the last checkpoint in '{}/checkpoint' is intact", config_.out_dir)
              : ""));
    }
    log_warn("step {}: skipped (non-finite values: {}); {} bad step(s) so far, at most {}", m.step,
             m.bad_report, bad_steps_, config_.max_bad_steps);
    FOURBIT_CHECK(bad_steps_ <= config_.max_bad_steps,
                  "stopping after {} bad steps (more than --max-bad-steps {}); the last: step {}: "
                  "{}",
                  bad_steps_, config_.max_bad_steps, m.step, m.bad_report);
  }
  if (config_.log_every > 0 && (step_ % config_.log_every == 0 || step_ == config_.steps))
    print_progress(m);
  return m;
}

void Trainer::print_progress(const StepMetrics& m) {
  if (progress_ == nullptr) return;
  const double tps = window_seconds_ > 0 ? window_tokens_ / window_seconds_ : 0;
  const int64_t done = tokens_this_process_ / (config_.data.batch_size * config_.data.seq_len *
                                               config_.grad_accum);
  const double per_step = done > 0 ? train_seconds_ / done : 0;
  std::string mfu;
  if (config_.device == Device::kCuda)
    mfu = fmt::format(" | MFU {:.1f}%", 100.0 * tps * flops_per_token() / kPeakFlops);
  std::fprintf(progress_,
               "[%s] step %*lld/%lld | loss %.4f | lr %.2e | gnorm %.3f | %s tok/s%s | ETA %s\n",
               config_.recipe.c_str(), (int)std::to_string(config_.steps).size(),
               (long long)m.step, (long long)config_.steps, m.loss, m.lr, m.grad_norm,
               format_rate(tps).c_str(), mfu.c_str(),
               format_duration(per_step * (double)(config_.steps - step_)).c_str());
  std::fflush(progress_);
  window_seconds_ = 0;
  window_tokens_ = 0;
}

EvalMetrics Trainer::evaluate() {
  const auto t0 = std::chrono::steady_clock::now();
  EvalMetrics e;
  e.step = step_;
  data_.val->reset();
  model::ForwardOptions fo;
  fo.stage = model::TrainingStage::kPretrain;
  fo.step = 0;
  fo.check_finite = false;
  fo.for_backward = false;
  int64_t forwards = 0;
  for (int64_t i = 0; i < config_.eval_batches; ++i) {
    data_.val->next(inputs_, targets_);
    if (i % world_size() != rank()) continue;  // another rank's batch
    const model::LossInfo li = model_->forward(inputs_, targets_, fo);
    ++forwards;
    e.loss += li.loss / (double)config_.eval_batches;
    e.ce += li.ce / (double)config_.eval_batches;
  }
  if (lockstep()) {
    // Ranks with fewer batches repeat their last one (the last batch read when they had none),
    // uncounted, until every rank has run the same number of forwards.
    const int64_t rounds = (config_.eval_batches + world_size() - 1) / world_size();
    for (; forwards < rounds; ++forwards) model_->forward(inputs_, targets_, fo);
  }
  if (dp_) {
    double sums[2] = {e.loss, e.ce};
    dp_->all_reduce_sum(sums);
    e.loss = sums[0];
    e.ce = sums[1];
  }
  last_eval_ = e;
  write_metrics({{"type", "eval"},
                 {"step", e.step},
                 {"val_loss", finite_or_null(e.loss)},
                 {"val_ce", finite_or_null(e.ce)},
                 {"tokens", tokens_seen_}});
  if (config_.log_every > 0 && progress_ != nullptr) {
    std::fprintf(progress_, "[%s] eval at step %lld | val loss %.4f\n", config_.recipe.c_str(),
                 (long long)e.step, e.loss);
    std::fflush(progress_);
  }
  train_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return e;
}

CheckpointState Trainer::checkpoint_state() const {
  CheckpointState s;
  s.step = step_;
  s.tokens_seen = tokens_seen_;
  s.train = to_json(config_);
  s.train["fingerprint"] = resume_fingerprint(config_);
  s.rng = {{"generator", "philox4x32-10"},
           {"model_seed", config_.seed},
           {"data_seed", config_.data.seed},
           {"next_sr_step", step_ * config_.grad_accum}};
  s.data = {{"train", data_.train->state()}, {"val", data_.val->state()}};
  nlohmann::json losses = nlohmann::json::array();
  const size_t keep = losses_.size() < 10 ? losses_.size() : 10;
  for (size_t i = losses_.size() - keep; i < losses_.size(); ++i) losses.push_back(finite_or_null(losses_[i]));
  const TrainSummary sum = summary();
  s.metrics = {{"bad_steps", bad_steps_},
               {"first_loss", finite_or_null(sum.first_loss)},
               {"recent_losses", losses},
               {"last_val_loss", last_eval_ ? finite_or_null(last_eval_->loss) : nlohmann::json(nullptr)},
               {"last_val_step", last_eval_ ? last_eval_->step : -1}};
  return s;
}

void Trainer::save(const std::string& dir, const SaveOptions& options) const {
  if (dp_) {
    dp_->save(dir, *model_, checkpoint_state(), options);
  } else {
    save_checkpoint(dir, *model_, optimizer_.get(), checkpoint_state(), options);
  }
}

void Trainer::resume(const std::string& dir) {
  const CheckpointInfo peek = read_checkpoint_info(dir);
  FOURBIT_CHECK(peek.state.train.contains("fingerprint"),
                "checkpoint '{}' has no train config fingerprint: it was not written by the "
                "trainer and cannot resume a run",
                dir);
  if (auto d = first_json_difference(peek.state.train["fingerprint"], resume_fingerprint(config_))) {
    throw Error(fmt::format("checkpoint '{}' does not match this run's training settings: {} "
                            "(checkpoint vs this run); use the checkpoint's settings or start a "
                            "new --out directory",
                            dir, *d));
  }
  const CheckpointInfo info =
      dp_ ? dp_->load(dir, *model_) : load_checkpoint(dir, *model_, optimizer_.get());
  data_.train->restore(info.state.data.at("train"));
  step_ = info.state.step;
  tokens_seen_ = info.state.tokens_seen;
  const nlohmann::json& met = info.state.metrics;
  bad_steps_ = met.value("bad_steps", (int64_t)0);
  losses_.clear();
  // The summary's first loss, then the recent losses (what final_train_loss averages).
  if (met.contains("first_loss") && step_ > (int64_t)met["recent_losses"].size())
    losses_.push_back(json_number(met["first_loss"]));
  for (const nlohmann::json& l : met.at("recent_losses")) losses_.push_back(json_number(l));
  if (met.value("last_val_step", (int64_t)-1) >= 0)
    last_eval_ = EvalMetrics{met["last_val_step"].get<int64_t>(), json_number(met["last_val_loss"]), 0};
  const int64_t saved_steps = info.state.train.value("steps", config_.steps);
  if (saved_steps != config_.steps) {
    log_warn("resuming a run of {} steps as a run of {} steps: the learning-rate schedule changes "
             "from here on",
             saved_steps, config_.steps);
  }
  // Metrics: keep what the checkpoint's run had written up to its step.
  if (!config_.out_dir.empty() && rank() == 0) {
    const std::string path = config_.out_dir + "/metrics.jsonl";
    std::ifstream in(path);
    std::string kept, line;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      try {
        const nlohmann::json j = nlohmann::json::parse(line);
        if (j.value("step", (int64_t)0) > step_) continue;
      } catch (const nlohmann::json::exception&) {
        continue;  // a torn last line of a killed run
      }
      kept += line + "\n";
    }
    in.close();
    io::write_file_atomically(path, kept);
  }
  log_info("resumed from '{}' at step {} ({} tokens seen)", dir, step_, tokens_seen_);
}

TrainSummary Trainer::summary() const {
  TrainSummary s;
  s.steps = step_;
  s.bad_steps = bad_steps_;
  s.tokens_seen = tokens_seen_;
  s.first_loss = losses_.empty() ? std::nan("") : losses_.front();
  double sum = 0;
  int n = 0;
  for (size_t i = losses_.size(); i-- > 0 && n < 10;) {
    if (std::isfinite(losses_[i])) {
      sum += losses_[i];
      ++n;
    }
  }
  s.final_train_loss = n > 0 ? sum / n : std::nan("");
  s.final_val_loss = last_eval_ ? last_eval_->loss : std::nan("");
  s.seconds = train_seconds_;
  s.tokens_per_second = train_seconds_ > 0 ? tokens_this_process_ / train_seconds_ : 0;
  if (config_.device == Device::kCuda) {
    s.mfu = s.tokens_per_second * flops_per_token() / kPeakFlops;
    s.peak_device_bytes = device_memory_stats().used_peak;
  }
  return s;
}

TrainSummary Trainer::run(std::optional<int64_t> until) {
  const int64_t target = until.value_or(config_.steps);
  FOURBIT_CHECK(target <= config_.steps, "Trainer::run: until {} exceeds --steps {}", target,
                config_.steps);
  const std::string ckpt = config_.out_dir.empty() ? "" : config_.out_dir + "/checkpoint";
  bool interrupted = false;
  while (step_ < target) {
    double stop = stop_flag_ != nullptr && stop_flag_->load() ? 1.0 : 0.0;
    if (dp_) dp_->all_reduce_sum(std::span<double>(&stop, 1));  // every rank stops at one step
    if (stop > 0) {
      interrupted = true;
      log_warn("stopping at step {} on request{}", step_,
               ckpt.empty() ? "" : fmt::format("; checkpoint in '{}' (continue with --resume)", ckpt));
      break;
    }
    step();
    if (config_.eval_every > 0 && step_ % config_.eval_every == 0) evaluate();
    if (!ckpt.empty() && config_.save_every > 0 && step_ % config_.save_every == 0) save(ckpt);
  }
  if (!interrupted && (!last_eval_ || last_eval_->step != step_)) evaluate();
  if (!ckpt.empty()) save(ckpt);
  TrainSummary s = summary();
  s.interrupted = interrupted;
  if (!config_.out_dir.empty()) write_metrics({{"type", "summary"}, {"step", step_}, {"summary", s.to_json()}});
  return s;
}

}  // namespace fourbit::train
