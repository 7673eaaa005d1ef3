// Export of one training step for independent cross-checks (tools/torch_crosscheck.py builds the
// same model in PyTorch from these files and compares): the weights, a seeded batch, and what
// fourbit computed from them (losses, logits, every gradient, the MoE routing).
//
// The folder holds raw little-endian arrays and a manifest:
//   manifest.json   {"format_version": 1, "config": <config JSON>, "recipe": name, "device",
//                    "dtype" (of logits/grads), "batch": B, "seq": T, "seed",
//                    "loss": {"loss", "ce", "aux", "z", "n_valid"},
//                    "params": [{"name", "shape", "offset", "kind", "trainable"}, ...],
//                    "files": {"params": "params.f32", ...}}
//   params.f32      every parameter row, FP32, concatenated in table order (offset = elements)
//   grads.<dtype>   the gradients, same layout (zeros for the non-trainable router bias)
//   tokens.i32, targets.i32   [B, T]
//   logits.<dtype>  [B * T, V]
//   expert_ids.i32  [B * T, n_moe_layers, top_k] (MoE models)
// <dtype> is f64 for a CPU float64 run, f32 otherwise (bf16 values widened).
#pragma once

#include "model/config.h"

#include <cstdint>
#include <string>

namespace fourbit::model {

struct DumpOptions {
  std::string recipe = "bf16";  // a recipe preset
  Device device = Device::kCpu;
  DType cpu_dtype = DType::kF64;
  int batch = 2;
  int seq = 32;
  uint64_t seed = 1;       // weights
  uint64_t data_seed = 2;  // tokens and targets (every 7th target ignored)
};

// Builds the model, runs forward and backward on a seeded batch and writes the folder (created if
// needed). Returns the objective.
double dump_model_step(const ModelConfig& config, const DumpOptions& options, const std::string& dir);

}  // namespace fourbit::model
