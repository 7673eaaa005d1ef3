// Training checkpoints: one directory holding everything a run needs to continue bit for bit.
//
//   DIR/model.safetensors      the master parameters, one tensor per ParamTable row, named and
//                              shaped as in the table (F32; F64 for an f64 CPU model)
//   DIR/optimizer.safetensors  AdamW's moments: "<name>.exp_avg" and "<name>.exp_avg_sq" per
//                              trainable row (absent when saved without an optimizer)
//   DIR/state.json             {"format": "fourbit-checkpoint-1", "model": model config JSON,
//                               "recipe": resolved recipe JSON, "optimizer": AdamW config or null,
//                               "step", "tokens_seen", "train": the train config, "rng", "data":
//                               the data position (DataLoader::state() or the corpus positions),
//                               "metrics": a summary}
//
// Atomicity. save_checkpoint writes the three files into DIR.tmp-<pid> (each fsynced), fsyncs that
// directory, then atomically swaps it with DIR (Linux renameat2 RENAME_EXCHANGE; where the file
// system lacks it: rename DIR to DIR.old-<pid>, rename the new one to DIR) and removes the old
// one. A crash at any point leaves DIR either the previous checkpoint or the new one, complete;
// in the fallback's one window between its two renames DIR is missing and load_checkpoint names
// the DIR.old-<pid> directory that holds the previous checkpoint. Stale DIR.tmp-<pid> / DIR.old-<pid>
// directories of crashed saves are ignored by loading and removed by the next successful save
// (only those whose process no longer exists).
//
// Compatibility. Loading into an existing model (resume) refuses a checkpoint whose model config
// or resolved recipe differs, naming the first differing field; the trainer compares its own
// train config the same way (first_json_difference). load_model_from_checkpoint builds the model
// from the checkpoint's own config and recipe (for sampling, export, RL).
#pragma once

#include "core/tensor.h"
#include "model/model.h"
#include "train/optimizer.h"

#include <nlohmann/json.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace fourbit::train {

inline constexpr std::string_view kCheckpointFormat = "fourbit-checkpoint-1";

// The non-tensor state of a run (state.json besides model, recipe and optimizer config).
struct CheckpointState {
  int64_t step = 0;         // optimizer updates applied
  int64_t tokens_seen = 0;  // training tokens consumed (including those of skipped steps)
  nlohmann::json train = nlohmann::json::object();    // the train config (trainer.h)
  nlohmann::json rng = nlohmann::json::object();      // {"generator": "philox4x32-10", "seed", ...}
  nlohmann::json data = nlohmann::json::object();     // data position(s)
  nlohmann::json metrics = nlohmann::json::object();  // summary (last losses, bad steps, ...)
};

struct SaveOptions {
  // Test hook: called after each file of the new checkpoint is written and before the swap, with
  // the file name ("model.safetensors", "optimizer.safetensors", "state.json") and then "swap".
  // Throwing from it simulates a crash at that point.
  std::function<void(std::string_view stage)> hook;
};

// Writes a checkpoint of `model` (and `optimizer`, may be null) to `dir` atomically (see above).
void save_checkpoint(const std::string& dir, const model::Model& model, const AdamW* optimizer,
                     const CheckpointState& state, const SaveOptions& options = {});

// state.json of a checkpoint, validated (format, presence of the fields); the model config and the
// recipe parsed.
struct CheckpointInfo {
  std::string dir;
  model::ModelConfig config;
  recipe::ResolvedRecipe recipe;
  std::optional<AdamWConfig> optimizer;  // absent when saved without one
  CheckpointState state;
};
CheckpointInfo read_checkpoint_info(const std::string& dir);

// Resume: loads the parameters into `model` (then params_changed()) and, if `optimizer` is given,
// its moments and step count. The model's config and resolved recipe must equal the checkpoint's
// (else an Error naming the first differing field). Returns the checkpoint's info (state included).
CheckpointInfo load_checkpoint(const std::string& dir, model::Model& model, AdamW* optimizer);

// A new model with the checkpoint's config and recipe and its parameters, on `device` (the other
// options as given: max_batch, max_seq, stream, ...). Uses no optimizer state.
std::unique_ptr<model::Model> load_model_from_checkpoint(const std::string& dir, Device device,
                                                         model::ModelOptions options = {});

// The first place where two JSON values differ, as a path and both values ("d_model: 256 vs 128"),
// or nullopt when equal. Objects are compared key by key (sorted), arrays element by element.
std::optional<std::string> first_json_difference(const nlohmann::json& a, const nlohmann::json& b,
                                                 const std::string& path = "");

}  // namespace fourbit::train
