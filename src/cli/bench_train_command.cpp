// `fourbit bench train`: training steps per recipe at gpt2-124m and 1.3b shapes (train/bench.h).
// It hangs under the `bench` command that bench_command.cpp creates; commands.cpp registers it
// ahead of `bench` so that its run callback is the one selected.
#include "cli/commands.h"
#include "cli/compare_command.h"
#include "core/check.h"
#include "train/bench.h"
#include "train/trainer.h"

namespace fourbit::cli {

Command add_bench_train_command(CLI::App& app) {
  CLI::App* bench = app.get_subcommand("bench");
  struct Args {
    train::TrainBenchOptions o;
    std::string presets = "gpt2-124m,1.3b";
    std::string recipes = "bf16,fp8,mxfp8,nvfp4,e2e4";
    std::string device = "cuda";
  };
  auto a = std::make_shared<Args>();
  CLI::App* sub = bench->add_subcommand(
      "train", "Training steps per recipe at gpt2-124m and 1.3b shapes: tokens/s, MFU, peak memory");
  sub->add_option("--presets", a->presets, "comma-separated model presets")->capture_default_str();
  sub->add_option("--recipes", a->recipes, "comma-separated recipe presets")->capture_default_str();
  sub->add_option("--set", a->o.sets, "model field override for every preset (repeatable)");
  sub->add_option("--batch-size,-b", a->o.batch_size, "B (default 32, 16 above 400M parameters)");
  sub->add_option("--seq-len,-t", a->o.seq_len, "T (default 1024)");
  sub->add_option("--warmup", a->o.warmup, "untimed steps")->capture_default_str();
  sub->add_option("--steps", a->o.steps, "timed steps (median)")->capture_default_str();
  sub->add_option("--device", a->device, "cuda (cpu: small presets, for testing)")
      ->capture_default_str();
  sub->add_option("--csv", a->o.csv_path, "also write the rows as CSV");
  sub->add_flag("--keep-wgrad-inputs", a->o.keep_wgrad_inputs,
                "keep every Wgrad input X at full precision and quantize each GEMM operand in its "
                "own pass (the path before the fused training passes: for A/B comparisons)");
  sub->add_flag("--recompute", a->o.recompute,
                "recompute the norms, qkv and the MLP's gate_up and SwiGLU in the backward "
                "(ModelOptions::recompute_activations: less memory, one more GEMM pair a block)");
  return {sub, [a] {
            a->o.presets = split_list(a->presets);
            a->o.recipes = split_list(a->recipes);
            FOURBIT_CHECK(a->device == "cuda" || a->device == "cpu",
                          "bench train: --device must be cuda or cpu, got '{}'", a->device);
            a->o.device = a->device == "cuda" ? Device::kCuda : Device::kCpu;
            std::fputs(train::train_bench_table(train::run_train_bench(a->o)).c_str(), stdout);
          }};
}

}  // namespace fourbit::cli
