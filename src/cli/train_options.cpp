// The training options shared by `pretrain`, `compare` and `run` (train_options.h).
#include "cli/train_options.h"

#include "model/config.h"
#include "recipe/recipe.h"

#include <fmt/format.h>

namespace fourbit::cli {

void add_train_options(CLI::App* sub, TrainArgs& a, bool with_recipe) {
  train::TrainConfig& c = a.config;
  sub->add_option("--preset", c.preset,
                  fmt::format("model preset: {}", fmt::join(model::preset_names(), ", ")))
      ->capture_default_str()->group("Model");
  sub->add_option("--config", c.model_config, "a model config JSON file instead of --preset")
      ->group("Model");
  sub->add_option("--set", c.sets, "model field override key=value (repeatable; `fourbit model "
                  "--keys` lists them)")->group("Model");
  if (with_recipe) {
    sub->add_option("--recipe", c.recipe,
                    fmt::format("precision recipe: a preset ({}) or a recipe JSON file",
                                fmt::join(recipe::preset_names(), ", ")))
        ->capture_default_str()->group("Model");
    sub->add_option("--recipe-set", c.recipe_sets, "recipe field override key=value (repeatable)")
        ->group("Model");
  }
  sub->add_option("--device", a.device, "cpu, cuda or auto (CUDA when a GPU is present)")
      ->capture_default_str()->group("Model");
  sub->add_option("--seed", c.seed, "parameter initialization and stochastic rounding seed")
      ->capture_default_str()->group("Model");

  sub->add_option("--data", c.data.data, "training token shards (llm.c format): a glob, a "
                  "directory or a file; default: the built-in synthetic corpus")->group("Data");
  sub->add_option("--val-data", c.data.val_data, "validation shards (default: hold out "
                  "--val-fraction of every training shard)")->group("Data");
  sub->add_option("--val-fraction", c.data.val_fraction, "held-out fraction of each shard")
      ->capture_default_str()->group("Data");
  sub->add_option("--data-seed", c.data.seed, "shuffling / corpus seed")->capture_default_str()
      ->group("Data");
  sub->add_option("--batch-size,-b", c.data.batch_size, "sequences per micro-batch (B)")
      ->capture_default_str()->group("Data");
  sub->add_option("--seq-len,-t", c.data.seq_len, "tokens per sequence (T)")
      ->capture_default_str()->group("Data");
  sub->add_option("--grad-accum", c.grad_accum, "micro-batches per optimizer step")
      ->capture_default_str()->group("Data");
  sub->add_flag("--recompute", c.recompute_activations,
                "recompute the norms, qkv and the MLP's gate_up and SwiGLU in the backward instead of "
                "keeping them (less activation memory, one more qkv and mlp_up GEMM a block; the same "
                "results)")
      ->group("Data");

  sub->add_option("--steps", c.steps, "optimizer steps")->capture_default_str()->group("Optimizer");
  sub->add_option("--lr", c.schedule.lr, "peak learning rate")->capture_default_str()
      ->group("Optimizer");
  sub->add_option("--min-lr-ratio", a.min_lr_ratio, "final learning rate / peak (cosine, wsd)")
      ->capture_default_str()->group("Optimizer");
  sub->add_option("--warmup", c.schedule.warmup_steps, "linear warmup steps")
      ->capture_default_str()->group("Optimizer");
  sub->add_option("--schedule", a.schedule, "cosine, wsd (warmup-stable-decay) or constant")
      ->capture_default_str()->group("Optimizer");
  sub->add_option("--decay-fraction", c.schedule.decay_fraction,
                  "wsd: fraction of the steps spent decaying")->capture_default_str()
      ->group("Optimizer");
  sub->add_option("--beta1", c.optimizer.beta1)->capture_default_str()->group("Optimizer");
  sub->add_option("--beta2", c.optimizer.beta2)->capture_default_str()->group("Optimizer");
  sub->add_option("--eps", c.optimizer.eps)->capture_default_str()->group("Optimizer");
  sub->add_option("--weight-decay", c.optimizer.weight_decay,
                  "decoupled weight decay of the linear weights (never norms; embeddings only "
                  "with --decay-embeddings)")->capture_default_str()->group("Optimizer");
  sub->add_flag("--decay-embeddings", c.optimizer.decay_embeddings,
                "also decay the token embedding")->group("Optimizer");
  sub->add_option("--grad-clip", c.optimizer.grad_clip, "max global gradient norm (0: off)")
      ->capture_default_str()->group("Optimizer");

  sub->add_option("--eval-every", c.eval_every, "evaluate every N steps (0: at the end only)")
      ->capture_default_str()->group("Run");
  sub->add_option("--eval-batches", c.eval_batches, "held-out batches per evaluation")
      ->capture_default_str()->group("Run");
  sub->add_option("--log-every", c.log_every, "progress line every N steps (0: none)")
      ->capture_default_str()->group("Run");
  sub->add_option("--save-every", c.save_every, "checkpoint every N steps (0: at the end only)")
      ->capture_default_str()->group("Run");
  sub->add_option("--nan-policy", a.nan_policy, "on NaN/Inf loss or gradients: stop, or skip "
                  "the step")->capture_default_str()->group("Run");
  sub->add_option("--max-bad-steps", c.max_bad_steps, "with --nan-policy skip: stop after more "
                  "bad steps than this")->capture_default_str()->group("Run");
  sub->add_option("--inject-nan-step", c.inject_nan_steps,
                  "testing: poison a gradient with NaN at this step (repeatable)")->group("Run");
}

train::TrainConfig finish_train_config(TrainArgs& a) {
  train::TrainConfig c = a.config;
  c.device = train::parse_device(a.device);
  c.schedule.kind = train::parse_schedule_kind(a.schedule);
  c.nan_policy = train::parse_nan_policy(a.nan_policy);
  FOURBIT_CHECK(a.min_lr_ratio >= 0 && a.min_lr_ratio <= 1,
                "--min-lr-ratio must lie in [0, 1], got {}", a.min_lr_ratio);
  c.schedule.min_lr = c.schedule.lr * a.min_lr_ratio;
  return c;
}

}  // namespace fourbit::cli
