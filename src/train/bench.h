// `fourbit bench train`: whole training steps (forward, backward, gradient norm, AdamW with the
// BF16 copy) of real-size models per recipe on the GPU: tokens/s, MFU (train/trainer.h: model
// FLOPs over the H100 / H200 SXM dense BF16 peak of 989 TFLOP/s), step time and peak device memory
// (fourbit tensors: the stream-ordered pool's used peak, reset before each recipe), with the
// activation arena and the quantized Wgrad inputs a forward keeps reported next to it.
//
// The shapes are those of /work/shared/docs/BENCHMARKS.md: gpt2-124m at T 1024, B 32 and 1.3b at
// T 1024, B 16 (or --batch / --seq-len). One model per shape (random tokens; the weights are
// initialized once) runs every recipe through Model::set_recipe, with a fresh optimizer each;
// `warmup` steps, then the median of `steps` timed steps (each ends in a synchronizing read of
// the gradient norm). The same step as Trainer::step without the data loader.
// The CPU (--device cpu, small presets only) runs the same code for testing.
#pragma once

#include "core/tensor.h"

#include <string>
#include <vector>

namespace fourbit::train {

struct TrainBenchOptions {
  std::vector<std::string> presets = {"gpt2-124m", "1.3b"};
  std::vector<std::string> recipes = {"bf16", "fp8", "mxfp8", "nvfp4", "e2e4"};
  std::vector<std::string> sets;  // model --set overrides applied to every preset
  int batch_size = 0;  // 0: by preset (32 for gpt2-124m and smaller, 16 above)
  int seq_len = 0;     // 0: 1024 (capped at the preset's max_seq)
  int warmup = 2;
  int steps = 5;
  Device device = Device::kCuda;
  std::string csv_path;
  bool keep_wgrad_inputs = false;  // model::ModelOptions::keep_wgrad_inputs
  bool recompute = false;          // model::ModelOptions::recompute_activations
};

struct TrainBenchRow {
  std::string preset, recipe;
  int batch_size = 0, seq_len = 0;
  int64_t params = 0;
  double step_ms = 0;  // median
  double tokens_per_s = 0;
  double mfu = 0;
  double peak_gib = 0;  // CUDA only
  // Where the memory goes (both devices): the activation arena (Model::activation_bytes) and the
  // quantized Wgrad inputs held at the end of a forward (Model::saved_wgrad_input_bytes).
  double arena_gib = 0;
  double saved_gib = 0;
  double loss = 0;      // of the last step (a sanity value)
};

std::vector<TrainBenchRow> run_train_bench(const TrainBenchOptions& options);
std::string train_bench_table(const std::vector<TrainBenchRow>& rows);

}  // namespace fourbit::train
