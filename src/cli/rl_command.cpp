// `fourbit rl`: RL with a low-precision sampler (RL.md) on a verifiable task, from a checkpoint or
// a fresh model: a progress line per step, OUT/rl_metrics.jsonl, OUT/rl_checkpoint, and a JSON
// summary (held-out reward before / after, K3 divergence, throughput). --sampler-recipe bf16 |
// nvfp4 runs the same seed with a BF16 or an NVFP4 sampler, to compare reward curves.
#include "cli/commands.h"
#include "cli/run_rl_stage.h"
#include "model/config.h"
#include "recipe/recipe.h"
#include "rl/task.h"

#include <fmt/format.h>

#include <cstdio>

namespace fourbit::cli {

namespace {

struct RlArgs {
  RlStageOptions stage;
  std::string device = "auto";
  std::string importance = "truncate";
};

}  // namespace

Command add_rl_command(CLI::App& app) {
  auto a = std::make_shared<RlArgs>();
  RlStageOptions& s = a->stage;
  rl::RlConfig& c = s.rl;
  s.out_dir = "runs/rl";
  CLI::App* sub = app.add_subcommand("rl", "RL on a verifiable task with a low-precision sampler (RL.md)");
  sub->add_option("--ckpt", s.ckpt, "start from this checkpoint directory (default: a fresh model)")->group("Model");
  sub->add_option("--preset", s.preset, fmt::format("fresh model preset: {}", fmt::join(model::preset_names(), ", ")))
      ->capture_default_str()->group("Model");
  sub->add_option("--set", s.model_sets, "fresh model config override key=value (repeatable)")->group("Model");
  sub->add_option("--recipe", s.recipe, fmt::format("precision recipe: a preset ({}) or a JSON file; default: the "
                                                    "checkpoint's (fresh: e2e4)", fmt::join(recipe::preset_names(), ", ")))
      ->group("Model");
  sub->add_option("--recipe-set", s.recipe_sets, "recipe field override key=value (repeatable)")->group("Model");
  sub->add_option("--sampler-recipe", s.sampler_recipe,
                  "the RL forward's precision (sampler and trainer alike): bf16, nvfp4 (per-token activation amax), "
                  "nvfp4-tensor-amax (one activation amax per pass), nvfp4-weights (NVFP4 weights, BF16 activations), "
                  "or recipe (as the recipe says)")
      ->capture_default_str()->group("Model");
  sub->add_option("--device", a->device, "cpu, cuda or auto")->capture_default_str()->group("Model");
  sub->add_option("--init-seed", s.init_seed, "fresh model initialization seed")->capture_default_str()->group("Model");

  sub->add_option("--task", s.task, "task spec, e.g. add:digits=3 (`fourbit tasks` lists them)")
      ->capture_default_str()->group("RL");
  sub->add_option("--steps", s.steps, "RL steps (one rollout batch each)")->capture_default_str()->group("RL");
  sub->add_option("--prompts", c.prompts_per_step, "prompts per step (P)")->capture_default_str()->group("RL");
  sub->add_option("--group", c.group_size, "completions per prompt (G)")->capture_default_str()->group("RL");
  sub->add_option("--max-new-tokens", c.max_new_tokens, "completion length limit")->capture_default_str()->group("RL");
  sub->add_option("--max-len", c.max_len, "positions per sequence, prompt included (0: min(max_seq, 128))")
      ->capture_default_str()->group("RL");
  sub->add_option("--seed", c.seed, "prompt and sampling seed")->capture_default_str()->group("RL");
  sub->add_option("--eval-prompts", s.eval_prompts, "held-out prompts for the reward before / after (0: skip)")
      ->capture_default_str()->group("RL");

  sub->add_option("--lr", c.lr, "learning rate (constant after warmup)")->capture_default_str()->group("Loss");
  sub->add_option("--warmup", c.warmup_steps, "linear warmup steps")->capture_default_str()->group("Loss");
  sub->add_option("--grad-clip", c.adamw.grad_clip, "max global gradient norm (<= 0: none)")
      ->capture_default_str()->group("Loss");
  sub->add_option("--weight-decay", c.adamw.weight_decay)->capture_default_str()->group("Loss");
  sub->add_option("--importance", a->importance,
                  "sampler/trainer correction: truncate (w = min(rho, C)), mask (drop tokens outside "
                  "[mask-low, C]) or none")->capture_default_str()->group("Loss");
  sub->add_option("--is-cap", c.is_cap, "C, the importance weight cap")->capture_default_str()->group("Loss");
  sub->add_option("--mask-low", c.mask_low, "lower end of the kept ratio range (mask)")->capture_default_str()->group("Loss");
  sub->add_flag("--std-norm", c.std_normalize, "divide advantages by the group's reward std")->group("Loss");
  sub->add_option("--ppo-epochs", c.ppo_epochs, "optimizer steps per rollout batch (> 1: PPO clipping)")
      ->capture_default_str()->group("Loss");
  sub->add_option("--clip-low", c.clip_low, "PPO clip epsilon below 1")->capture_default_str()->group("Loss");
  sub->add_option("--clip-high", c.clip_high, "PPO clip epsilon above 1 (e.g. 0.28)")->capture_default_str()->group("Loss");
  sub->add_option("--kl", c.kl_coef, "K3 KL penalty to the starting policy (0: off)")->capture_default_str()->group("Loss");
  sub->add_flag("!--no-fast-decode", c.fast_decode,
                "CUDA: run every sampler pass on the emulated path (the trainer's kernels) instead of the decode GEMV; "
                "a diagnostic of what the decode kernels' summation order adds to the mismatch")
      ->group("RL");
  sub->add_flag("!--no-routing-replay", c.routing_replay, "MoE: let the trainer's router choose the experts")
      ->group("Loss");

  sub->add_option("--out,-o", s.out_dir, "output directory (rl_metrics.jsonl, rl_checkpoint/); '' for none")
      ->capture_default_str()->group("Run");
  sub->add_option("--csv", s.csv_path, "also write one CSV row of metrics per step here")->group("Run");
  sub->add_option("--log-every", s.log_every, "progress line every N steps")->capture_default_str()->group("Run");
  return {sub, [a] {
            a->stage.device = parse_rl_device(a->device);
            a->stage.rl.importance = rl::parse_importance_mode(a->importance);
            const RlStageResult r = run_rl_stage(a->stage);
            std::printf("%s\n", r.to_json().dump(2).c_str());
          }};
}

}  // namespace fourbit::cli
