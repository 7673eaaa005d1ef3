// `fourbit run`: the main job on its built-in default, no download and no argument needed.
//
// Stage 1 (pretraining): the same model pretrained on the built-in synthetic corpus under each
// recipe (default e2e4 next to the bf16 baseline), the final train/val loss gap table printed and
// written to OUT/comparison.txt, the curves to OUT/loss.svg, one run directory per recipe
// (OUT/<recipe>/metrics.jsonl, OUT/<recipe>/checkpoint).
//   CPU: the `tiny` preset narrowed to d_model 128 / d_ff 384 / 2 heads (a ~2-core machine trains it
//        in a few minutes for both recipes), T = 64, B = 8, 150 steps;
//   GPU: `gpt2-124m` with the byte vocabulary (vocab 384), T = 512, B = 16, 600 steps.
// Stage 2 (RL, src/cli/run_rl_stage.cpp): from the pretrained e2e4 checkpoint, RL on add:digits=3
// with the NVFP4 sampler and the BF16 sampler (on a GPU also NVFP4 weights with BF16 activations),
// same seed: reward before / after and K3 divergence, OUT/rl_report.txt, curves in OUT/rl.svg.
// Later stages are appended as one function each, called from run_default_job in order; each
// takes the pretraining result (the checkpoints) and adds its own lines to the report.
#include "cli/commands.h"
#include "cli/compare_command.h"
#include "cli/run_rl_stage.h"
#include "cli/train_options.h"
#include "core/log.h"

#include <chrono>

namespace fourbit::cli {

namespace {

struct RunArgs {
  std::string device = "auto";
  std::string out = "runs";
  std::string recipes = "bf16,e2e4";
  std::string preset;            // empty: by device (see above)
  std::vector<std::string> sets;  // replace the device default's --set list when given
  int64_t steps = 0;             // 0: by device
  int64_t batch_size = 0, seq_len = 0;
  double lr = 0;
  uint64_t seed = 0;
};

// The pretraining configuration of the default job on `device` (overridable from the CLI).
train::TrainConfig default_pretrain_config(const RunArgs& a, Device device) {
  train::TrainConfig c;
  c.device = device;
  c.seed = a.seed;
  c.schedule.kind = train::ScheduleKind::kCosine;
  c.optimizer.weight_decay = 0.1;
  c.optimizer.grad_clip = 1.0;
  if (device == Device::kCpu) {
    c.preset = "tiny";
    c.sets = {"d_model=128", "n_heads=2", "n_kv_heads=1", "d_ff=384"};
    c.data.batch_size = 8;
    c.data.seq_len = 64;
    c.steps = 150;
    c.schedule.lr = 3e-3;
    c.schedule.warmup_steps = 15;
    c.eval_every = 50;
    c.eval_batches = 8;
    c.log_every = 25;
  } else {
    c.preset = "gpt2-124m";
    c.sets = {"vocab=384"};
    c.data.batch_size = 16;
    c.data.seq_len = 512;
    c.steps = 600;
    c.schedule.lr = 1.5e-3;
    c.schedule.warmup_steps = 60;
    c.eval_every = 100;
    c.eval_batches = 8;
    c.log_every = 50;
  }
  c.schedule.min_lr = 0.1 * c.schedule.lr;
  if (!a.preset.empty()) {
    c.preset = a.preset;
    c.sets.clear();
  }
  if (!a.sets.empty()) c.sets = a.sets;
  if (a.steps > 0) {
    c.steps = a.steps;
    c.schedule.warmup_steps = std::max<int64_t>(1, a.steps / 10);
    c.eval_every = std::max<int64_t>(1, a.steps / 3);
    c.log_every = std::max<int64_t>(1, a.steps / 6);
  }
  if (a.batch_size > 0) c.data.batch_size = a.batch_size;
  if (a.seq_len > 0) c.data.seq_len = a.seq_len;
  if (a.lr > 0) {
    c.schedule.lr = a.lr;
    c.schedule.min_lr = 0.1 * a.lr;
  }
  return c;
}

// Stage 1. Returns the runs (their checkpoints feed the later stages).
std::vector<train::RecipeRun> run_pretrain_stage(const RunArgs& a, Device device) {
  const train::TrainConfig c = default_pretrain_config(a, device);
  log_info("fourbit run, stage 1: pretraining '{}'{} on the built-in corpus on {}, recipes {}: {} "
           "steps of {} x {} tokens; runs under '{}'",
           c.preset, c.sets.empty() ? "" : fmt::format(" (--set {})", fmt::join(c.sets, " ")),
           device_name(device), a.recipes, c.steps, c.data.batch_size, c.data.seq_len, a.out);
  return compare_and_report(c, split_list(a.recipes), a.out);
}

void run_default_job(const RunArgs& a) {
  const auto t0 = std::chrono::steady_clock::now();
  const Device device = train::parse_device(a.device);
  const std::vector<train::RecipeRun> pretrained = run_pretrain_stage(a, device);
  // ---- stage 2: RL (src/cli/run_rl_stage.cpp) from the pretrained e2e4 checkpoint -----------------
  for (const train::RecipeRun& r : pretrained)
    if (train::recipe_label(r.recipe) == "e2e4") run_default_rl_stage(r.out_dir + "/checkpoint", device, a.out, a.seed);
  // ---- end of stage 2 ------------------------------------------------------------------------------
  std::fflush(stdout);  // the stages' tables (stdout) before this line (stderr)
  log_info("fourbit run: done in {:.0f} s", std::chrono::duration<double>(
                                                 std::chrono::steady_clock::now() - t0).count());
}

}  // namespace

Command add_run_command(CLI::App& app) {
  auto args = std::make_shared<RunArgs>();
  CLI::App* sub = app.add_subcommand(
      "run", "The main job on its built-in default: pretrain a small model under e2e4 and bf16 "
             "on the built-in corpus and compare the losses");
  sub->add_option("--device", args->device, "cpu, cuda or auto (CUDA when a GPU is present; it "
                  "then trains a larger model)")->capture_default_str();
  sub->add_option("--out,-o", args->out, "where the runs go")->capture_default_str();
  sub->add_option("--recipes", args->recipes, "comma-separated recipes; the first is the baseline")
      ->capture_default_str();
  sub->add_option("--preset", args->preset, "model preset instead of the device's default");
  sub->add_option("--set", args->sets, "model field overrides key=value (replace the default's)");
  sub->add_option("--steps", args->steps, "optimizer steps per recipe (default: by device)");
  sub->add_option("--batch-size,-b", args->batch_size, "sequences per step (default: by device)");
  sub->add_option("--seq-len,-t", args->seq_len, "tokens per sequence (default: by device)");
  sub->add_option("--lr", args->lr, "peak learning rate (default: by device)");
  sub->add_option("--seed", args->seed, "model initialization seed")->capture_default_str();
  return {sub, [args] { run_default_job(*args); }};
}

}  // namespace fourbit::cli
