// One RL run as a reusable stage: `fourbit rl` runs it from the command line, and the default job
// (`fourbit run`) runs it after pretraining, from the pretrained checkpoint. It builds the policy
// (a checkpoint or a fresh model), the recipe (with the --sampler-recipe override), the task and
// the trainer (rl/rl_trainer.h); measures the held-out reward before and after; prints a progress
// line per step; writes OUT/rl_metrics.jsonl (one JSON object per step) and OUT/rl_checkpoint.
#pragma once

#include "core/tensor.h"
#include "rl/rl_trainer.h"

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace fourbit::cli {

struct RlStageOptions {
  std::string ckpt;                   // start from this checkpoint; empty: a fresh model
  std::string preset = "tiny";        // fresh model: config preset and --set overrides
  std::vector<std::string> model_sets;
  std::string recipe;                 // empty: the checkpoint's recipe (fresh: e2e4)
  std::vector<std::string> recipe_sets;
  std::string sampler_recipe = "recipe";  // bf16 | nvfp4 | recipe (recipe::with_sampler_precision)
  std::string task = "add:digits=3";
  int steps = 50;
  int eval_prompts = 256;             // held-out prompts for the reward before / after (0: skip)
  rl::RlConfig rl;
  Device device = Device::kCpu;
  uint64_t init_seed = 0;             // fresh model initialization
  std::string out_dir;                // empty: write nothing
  std::string csv_path;               // one CSV row per step (the gpu-test.sh benchmark format); "" none
  int log_every = 1;                  // progress lines every N steps (the JSONL gets every step)
  std::string label = "rl";           // prefix of the printed lines
};

struct RlStageResult {
  double reward_before = -1, reward_after = -1;  // held-out greedy reward (-1: not measured)
  double train_reward_first = 0, train_reward_last = 0;  // mean over the first / last 10% of steps
  double k3_mean = 0, k3_max = 0;
  double max_abs_logp_diff = 0;
  double sampler_tokens_per_s = 0, trainer_tokens_per_s = 0;  // means over the steps
  int steps = 0;
  double seconds = 0;
  std::string recipe_name;
  nlohmann::json to_json() const;
};

RlStageResult run_rl_stage(const RlStageOptions& options);

// The default job's RL stage (`fourbit run`, after pretraining): from the pretrained e2e4
// checkpoint `ckpt`, RL on a harder arithmetic task than the corpus teaches (add:digits=3: 1- to
// 3-digit operands; the corpus has 2) with the NVFP4 sampler of the e2e4 recipe; on CUDA also the
// same run (same seed, same steps) with one activation amax per pass (nvfp4-tensor-amax), with NVFP4
// weights and BF16 activations (nvfp4-weights) and with
// a BF16 sampler, for comparison. Prints and returns a report
// (held-out greedy reward before / after, training reward first / last steps, K3 divergence, max
// |dlogp|, throughput), also written to OUT/rl_report.txt; runs under OUT/rl-<sampler>/.
//   CPU:  8 prompts x 8 completions, 16 steps, lr 1e-4, 64 held-out prompts;
//   CUDA: 32 prompts x 8 completions, 60 steps, lr 3e-5, 512 held-out prompts.
std::string run_default_rl_stage(const std::string& ckpt, Device device, const std::string& out, uint64_t seed);

// "cpu", "cuda", "auto" (CUDA when built with it and a GPU is present).
Device parse_rl_device(std::string_view name);

}  // namespace fourbit::cli
