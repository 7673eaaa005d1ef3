// `fourbit bench model`: one training step (forward + backward) of real-size models on the GPU,
// per recipe: time per layer type (attention, MLP, MoE, LM head + loss, embedding) and the share of
// the step spent in GEMMs, attention kernels, operand quantization and the rest; tokens/s.
//
// How it is measured. The step runs once with a profiler attached (model/profile.h) that records
// CUDA events around every op the model brackets: linear layers (operand quantization + GEMM, plus
// the per-call allocation of the quantized operands that gemm::linear_* does today), attention
// kernels, and everything else. The quantization inside the linear brackets is timed separately by
// replaying every operand quantization of the step (same shapes, configs and orientations, same
// allocation pattern as gemm/linear.cpp) on random data with CUDA events; GEMM time = linear time -
// quantization time. "rest" is everything else plus host gaps (the step time minus the bracketed
// GPU time). tokens/s comes from the median of `reps` unprofiled steps.
// Needs a CUDA build and a GPU.
#pragma once

#include <string>
#include <vector>

namespace fourbit::model {

struct ModelBenchOptions {
  int reps = 3;               // timed unprofiled steps (median), after one warm-up step
  std::string shape_filter;   // only the shapes whose name contains this text
  std::string recipe_filter;  // only the recipes whose name contains this text
  std::string csv_path;       // optional: also write the table as CSV
};

struct ModelBenchRow {
  std::string shape;    // "gpt2-124m (B 8, T 1024)"
  std::string recipe;   // bf16, fp8, nvfp4, e2e4
  std::string section;  // attention, mlp, moe, lm_head+loss, embedding, step
  int layers = 0;       // blocks of that type (1 for lm_head+loss, embedding and step)
  double ms_per_layer = 0;  // forward + backward of one layer (profiled step)
  double ms = 0;            // all layers of the type
  double gemm_ms = 0, attention_ms = 0, quant_ms = 0, other_ms = 0;
  double tokens_per_s = 0;  // step row only (unprofiled)
};

std::vector<ModelBenchRow> run_model_bench(const ModelBenchOptions& options);

}  // namespace fourbit::model
