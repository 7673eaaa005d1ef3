// The RL stage (run_rl_stage.h): policy, recipe and task set-up, the step loop with progress
// lines and JSONL metrics, held-out reward before and after, and the final checkpoint.
#include "cli/run_rl_stage.h"

#include "core/check.h"
#include "core/device.h"
#include "core/log.h"
#include "io/atomic_file.h"
#include "model/config.h"
#include "rl/byte_tokens.h"
#include "train/checkpoint.h"
#include "train/plot.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>

namespace fourbit::cli {

Device parse_rl_device(std::string_view name) {
  if (name == "cpu") return Device::kCpu;
  if (name == "cuda") {
    FOURBIT_CHECK(built_with_cuda(), "--device cuda: this build has no CUDA (configure with -DFOURBIT_CUDA=ON)");
    return Device::kCuda;
  }
  FOURBIT_CHECK(name == "auto", "--device '{}': use cpu, cuda or auto", name);
  return built_with_cuda() && cuda_device_count() > 0 ? Device::kCuda : Device::kCpu;
}

nlohmann::json RlStageResult::to_json() const {
  return {{"reward_before", reward_before},
          {"reward_after", reward_after},
          {"train_reward_first", train_reward_first},
          {"train_reward_last", train_reward_last},
          {"k3_mean", k3_mean},
          {"k3_max", k3_max},
          {"max_abs_logp_diff", max_abs_logp_diff},
          {"sampler_tokens_per_s", sampler_tokens_per_s},
          {"trainer_tokens_per_s", trainer_tokens_per_s},
          {"steps", steps},
          {"seconds", seconds},
          {"recipe", recipe_name}};
}

RlStageResult run_rl_stage(const RlStageOptions& o) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  FOURBIT_CHECK(o.steps >= 0, "rl: --steps must be >= 0, got {}", o.steps);
  FOURBIT_CHECK(o.log_every >= 1, "rl: --log-every must be >= 1, got {}", o.log_every);

  // Policy and recipe.
  std::unique_ptr<model::Model> start;
  model::ModelConfig config;
  recipe::Recipe r;
  if (!o.ckpt.empty()) {
    FOURBIT_CHECK(std::filesystem::exists(o.ckpt), "rl: --ckpt '{}' does not exist (a checkpoint directory "
                  "written by `fourbit pretrain` or `fourbit rl --out`)", o.ckpt);
    FOURBIT_CHECK(o.model_sets.empty(), "rl: --set changes a fresh model's config; the checkpoint '{}' "
                  "fixes it", o.ckpt);
    start = train::load_model_from_checkpoint(o.ckpt, o.device);
    config = start->config();
    r = o.recipe.empty() ? start->recipe().recipe() : recipe::Recipe{};
  } else {
    config = model::preset(o.preset);
    if (config.vocab < rl::kByteVocabSize && o.model_sets.empty()) {
      log_info("rl: preset '{}' has vocab {} < {} (bytes + end of document); using vocab 384", o.preset,
               config.vocab, rl::kByteVocabSize);
      config.vocab = 384;
    }
    model::apply_sets(config, o.model_sets);
  }
  if (!o.recipe.empty() || o.ckpt.empty()) {
    const std::string name = o.recipe.empty() ? "e2e4" : o.recipe;
    r = std::filesystem::exists(name) ? recipe::load_recipe_file(name) : recipe::preset(name);
  }
  recipe::apply_sets(r, o.recipe_sets);
  r = recipe::with_sampler_precision(std::move(r), o.sampler_recipe);
  recipe::ResolvedRecipe resolved = recipe::resolve(r, config.recipe_shape());
  const std::unique_ptr<rl::Task> task = rl::make_task(o.task);

  rl::RlModelOptions mo;
  mo.device = o.device;
  mo.init_seed = o.init_seed;
  rl::RlTrainer trainer(config, resolved, mo, *task, o.rl, start.get());
  start.reset();  // the trainer holds copies of the weights
  RlStageResult res;
  res.recipe_name = r.name;
  log_info("{}: model '{}' ({}), recipe '{}' (sampler fprop = trainer fprop), task '{}', device {}, {} "
           "prompts x {} completions per step, {} steps", o.label, config.name,
           o.ckpt.empty() ? "fresh" : o.ckpt, r.name, task->spec(), device_name(o.device),
           o.rl.prompts_per_step, o.rl.group_size, o.steps);

  std::ofstream jsonl;
  if (!o.out_dir.empty()) {
    std::filesystem::create_directories(o.out_dir);
    const std::string path = o.out_dir + "/rl_metrics.jsonl";
    jsonl.open(path, std::ios::trunc);
    FOURBIT_CHECK(jsonl.good(), "rl: cannot write '{}'", path);
  }
  std::ofstream csv;
  if (!o.csv_path.empty()) {
    csv.open(o.csv_path, std::ios::trunc);
    FOURBIT_CHECK(csv.good(), "rl: cannot write --csv '{}'", o.csv_path);
    csv << "recipe,step,reward_mean,reward_std,k3,max_abs_logp_diff,clipped_fraction,entropy,completion_len,"
           "sampler_tokens_per_s,trainer_tokens_per_s\n";
  }
  if (o.eval_prompts > 0) {
    res.reward_before = trainer.evaluate(o.eval_prompts);
    std::printf("%s: held-out reward before RL %.4f (%d prompts, greedy)\n", o.label.c_str(), res.reward_before,
                o.eval_prompts);
    std::fflush(stdout);
  }
  std::vector<rl::StepMetrics> history;
  for (int s = 0; s < o.steps; ++s) {
    const rl::StepMetrics m = trainer.step();
    history.push_back(m);
    if (jsonl.is_open()) {
      jsonl << rl::to_json(m).dump() << "\n";
      jsonl.flush();
    }
    if (csv.is_open()) {
      csv << fmt::format("{},{},{:.6f},{:.6f},{:.6e},{:.6e},{:.6f},{:.6f},{:.3f},{:.1f},{:.1f}\n", r.name, m.step,
                         m.reward_mean, m.reward_std, m.k3, m.max_abs_logp_diff, m.clipped_fraction, m.entropy,
                         m.completion_len, m.sampler_tokens_per_s, m.trainer_tokens_per_s);
      csv.flush();
    }
    if (s % o.log_every == 0 || s + 1 == o.steps) {
      std::printf("%s: %s\n", o.label.c_str(), rl::progress_line(m).c_str());
      std::fflush(stdout);
    }
  }
  if (o.eval_prompts > 0) {
    res.reward_after = trainer.evaluate(o.eval_prompts);
    std::printf("%s: held-out reward after RL %.4f (before %.4f)\n", o.label.c_str(), res.reward_after,
                res.reward_before);
  }
  res.steps = o.steps;
  if (!history.empty()) {
    const int n = std::max(1, (int)history.size() / 10);
    for (int i = 0; i < n; ++i) {
      res.train_reward_first += history[(size_t)i].reward_mean / n;
      res.train_reward_last += history[history.size() - 1 - (size_t)i].reward_mean / n;
    }
    for (const rl::StepMetrics& m : history) {
      res.k3_mean += m.k3 / (double)history.size();
      res.k3_max = std::max(res.k3_max, m.k3);
      res.max_abs_logp_diff = std::max(res.max_abs_logp_diff, m.max_abs_logp_diff);
      res.sampler_tokens_per_s += m.sampler_tokens_per_s / (double)history.size();
      res.trainer_tokens_per_s += m.trainer_tokens_per_s / (double)history.size();
    }
  }
  if (!o.out_dir.empty()) {
    train::CheckpointState state;
    state.step = trainer.optimizer().steps();
    state.train = {{"rl", rl::to_json(trainer.config())}, {"task", task->spec()}, {"start", o.ckpt}};
    state.metrics = res.to_json();
    const std::string dir = o.out_dir + "/rl_checkpoint";
    train::save_checkpoint(dir, trainer.model(), &trainer.optimizer(), state);
    log_info("{}: metrics {}/rl_metrics.jsonl, checkpoint {}", o.label, o.out_dir, dir);
  }
  res.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return res;
}

std::string run_default_rl_stage(const std::string& ckpt, Device device, const std::string& out, uint64_t seed) {
  const bool gpu = device == Device::kCuda;
  RlStageOptions o;
  o.ckpt = ckpt;
  o.device = device;
  o.task = "add:digits=3";
  o.steps = gpu ? 60 : 16;
  o.eval_prompts = gpu ? 512 : 64;
  o.log_every = gpu ? 10 : 4;
  o.rl.prompts_per_step = gpu ? 32 : 8;
  o.rl.group_size = 8;
  o.rl.max_new_tokens = 6;  // up to 4 answer digits and the end-of-answer newline
  o.rl.max_len = 32;
  o.rl.lr = gpu ? 3e-5 : 1e-4;
  o.rl.seed = seed;
  // The NVFP4 sampler next to the BF16 one (same seed, steps and prompts), so the report and the
  // plot show what 4-bit sampling costs in reward and in trainer/sampler mismatch (K3).
  std::vector<std::string> samplers = {"nvfp4"};
  if (gpu) {
    samplers.push_back("nvfp4-tensor-amax");  // what the per-token activation amax buys in K3
    samplers.push_back("nvfp4-weights");
  }
  samplers.push_back("bf16");
  std::string report = fmt::format(
      "RL stage: from {} on {}, task {}, {} steps of {} x {} rollouts, lr {:g}; sampler fprop = trainer "
      "fprop per row (RL.md quantizer contract), trainer backward as the e2e4 recipe says\n"
      "{:<17} {:>14} {:>13} {:>14} {:>13} {:>10} {:>10} {:>12} {:>12} {:>8}\n",
      ckpt, device_name(device), o.task, o.steps, o.rl.prompts_per_step, o.rl.group_size, o.rl.lr, "sampler",
      "reward before", "reward after", "train first", "train last", "K3 mean", "K3 max", "max|dlogp|",
      "sampler tok/s", "seconds");
  for (const std::string& sampler : samplers) {
    o.sampler_recipe = sampler;
    o.out_dir = out + "/rl-" + sampler;
    o.label = "rl[" + sampler + "]";
    const RlStageResult r = run_rl_stage(o);
    report += fmt::format("{:<17} {:>14.4f} {:>13.4f} {:>14.4f} {:>13.4f} {:>10.2e} {:>10.2e} {:>12.2e} {:>12.0f} {:>8.0f}\n",
                          sampler, r.reward_before, r.reward_after, r.train_reward_first, r.train_reward_last,
                          r.k3_mean, r.k3_max, r.max_abs_logp_diff, r.sampler_tokens_per_s, r.seconds);
  }
  report += "(reward: held-out greedy accuracy; train first / last: mean sampled reward of the first / last 10% of "
            "steps; K3 = E[rho - log rho - 1], rho = pi_trainer / pi_sampler; RL.md targets K3 < 1e-3 for dense models)\n";
  // Reward and K3 per step of every sampler, side by side (train/plot.h).
  std::vector<train::LossSeries> curves;
  for (const std::string& sampler : samplers) {
    curves.push_back(train::read_loss_series(out + "/rl-" + sampler + "/rl_metrics.jsonl"));
    curves.back().label = "sampler " + sampler;
  }
  train::PlotOptions po;
  po.panels = train::rl_panels();
  po.title = fmt::format("RL on {} from the e2e4 checkpoint", o.task);
  io::write_file_atomically(out + "/rl.svg", train::render_loss_svg(curves, po));
  report += fmt::format("curves: {}/rl.svg (`fourbit plot {}/rl-*/rl_metrics.jsonl` redraws them)\n", out, out);
  std::printf("\n%s", report.c_str());
  std::filesystem::create_directories(out);
  std::ofstream f(out + "/rl_report.txt", std::ios::trunc);
  f << report;
  FOURBIT_CHECK(f.good(), "fourbit run: cannot write '{}/rl_report.txt'", out);
  return report;
}

}  // namespace fourbit::cli
