// Pretraining: the training loop over a Model under a recipe, with AdamW (optimizer.h), a
// learning-rate schedule, gradient accumulation, periodic evaluation on held-out data, metrics
// (JSONL), a live progress line, checkpoints (checkpoint.h) and a NaN/Inf policy. Used by
// `fourbit pretrain`, `fourbit compare` and the default job `fourbit run`.
//
// One step (Trainer::step):
//   zero the gradients; for each of grad_accum micro-batches: forward (stage pretrain, SR draws
//   keyed by step * grad_accum + micro) and backward with loss_scale 1 / grad_accum (the model
//   accumulates gradients across backward calls); then AdamW with lr = schedule.at(step) and
//   global-norm clipping. The step counter, the tokens seen and the data advance whether or not
//   the update is applied.
// Non-finite values: a micro-batch whose loss is not finite is reported with the first
// non-finite activation (layer and tensor name); a non-finite gradient norm with the first
// non-finite gradient tensor. The update is then NOT applied (optimizer.h: nothing changes), and
// the policy decides: kStop throws an Error carrying the report (state intact: the last checkpoint
// and the in-memory model are both valid); kSkip logs it and continues, throwing once more than
// max_bad_steps steps have been bad.
// Determinism: on the CPU a run is a pure function of its config (model init seed, data seed, SR
// draws keyed by step); a resumed run (load_checkpoint + data restore) continues bit for bit.
//
// MFU (CUDA only): model FLOPs per token / time over the H200's dense BF16 peak, 989 TFLOP/s
// (kPeakFlops; every recipe is measured against the BF16 peak, so a faster FP8 GEMM shows as a
// higher MFU). FLOPs per token = 6 * (active non-embedding parameters + the LM head's V x C) +
// 6 * n_layers * T * d_model (causal attention scores and values, forward and backward).
#pragma once

#include "core/tensor.h"
#include "model/model.h"
#include "train/checkpoint.h"
#include "train/data.h"
#include "train/optimizer.h"

#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace fourbit::train {

inline constexpr double kPeakFlops = 989e12;  // H100 / H200 SXM dense BF16 tensor-core peak, FLOP/s

enum class NanPolicy : uint8_t { kStop, kSkip };
std::string_view nan_policy_name(NanPolicy p);
NanPolicy parse_nan_policy(std::string_view name);  // "stop" | "skip"

struct TrainConfig {
  // Model and recipe.
  std::string preset = "tiny";     // model preset
  std::string model_config;        // a model config JSON file instead of the preset
  std::vector<std::string> sets;   // model --set key=value
  std::string recipe = "bf16";     // recipe preset or recipe JSON file
  std::vector<std::string> recipe_sets;
  Device device = Device::kCpu;
  uint64_t seed = 0;               // parameter init and stochastic rounding
  // Data.
  DataOptions data;                // batch_size (B) and seq_len (T) live here
  int grad_accum = 1;              // micro-batches per step
  // model::ModelOptions::recompute_activations: less activation memory for one more qkv and
  // mlp_up GEMM a block in the backward; the same bits, so not part of the resume fingerprint.
  bool recompute_activations = false;
  // Optimization.
  int64_t steps = 100;             // total optimizer steps (the schedule's total_steps)
  Schedule schedule;               // total_steps is overwritten by `steps`
  AdamWConfig optimizer;
  // Evaluation, logging, checkpoints.
  int64_t eval_every = 50;         // 0: only at the end
  int64_t eval_batches = 4;
  int64_t log_every = 10;          // progress line every N steps (and the last); 0: never
  int64_t save_every = 0;          // checkpoint every N steps (and at the end when out_dir is set)
  std::string out_dir;             // run directory: metrics.jsonl, checkpoint/; empty: none
  NanPolicy nan_policy = NanPolicy::kStop;
  int64_t max_bad_steps = 10;      // kSkip: more bad steps than this stops the run
  // Testing: poison one gradient element with NaN at these steps (after the backward).
  std::vector<int64_t> inject_nan_steps;

  // The model config this describes (preset or file, sets applied, and the vocabulary raised to
  // 384 when the built-in corpus needs >= 257 ids and the preset has fewer; validated).
  model::ModelConfig model_config_resolved() const;
  recipe::Recipe recipe_resolved() const;  // preset or file, sets applied
};

nlohmann::json to_json(const TrainConfig& c);
// The fields a resumed run must share with the run that saved (data, batch, seeds, schedule
// except total_steps, optimizer, grad_accum); first_json_difference over these names the field.
nlohmann::json resume_fingerprint(const TrainConfig& c);

struct StepMetrics {
  int64_t step = 0;          // 1-based index of this step
  double loss = 0;           // mean objective over the micro-batches
  double ce = 0;             // mean cross-entropy
  double lr = 0;
  double grad_norm = 0;
  double clip_scale = 1;
  bool applied = true;       // false: a bad (skipped) step
  std::string bad_report;    // what was non-finite
  double seconds = 0;        // wall time of the step
};

struct EvalMetrics {
  int64_t step = 0;
  double loss = 0;  // mean objective over the evaluation batches
  double ce = 0;
};

struct TrainSummary {
  int64_t steps = 0;
  int64_t bad_steps = 0;
  int64_t tokens_seen = 0;
  double first_loss = 0;
  double final_train_loss = 0;  // mean objective of the last min(10, steps) applied steps
  double final_val_loss = 0;    // the last evaluation
  double seconds = 0;           // training wall time of this process (evaluation included)
  double tokens_per_second = 0;
  double mfu = 0;               // CUDA only, else 0
  int64_t peak_device_bytes = 0;
  bool interrupted = false;     // run() stopped early on the stop flag (set_stop_flag)
  nlohmann::json to_json() const;
};

// Data parallelism: the hooks through which one rank's trainer meets the other ranks
// (dist/data_parallel.h implements them with a communicator and the ZeRO-1 optimizer). With them:
//   * grad_accum is the number of micro-batches of a step over ALL ranks and must be a multiple of
//     world_size(); every rank reads every micro-batch (so all ranks keep the same data position
//     and checkpoints do not depend on the number of ranks) and runs micro-batches rank, rank +
//     world, ... of each step with loss_scale 1 / grad_accum, so the SUM of the ranks' gradients
//     is the one-rank gradient. Losses and the bad-step flag are summed over the ranks; all ranks
//     take the same decisions (skip, stop, save).
//   * the optimizer update, checkpoint save and load go through the hooks (collectives);
//   * only rank 0 prints progress and writes metrics.jsonl and checkpoints.
//   * evaluation batches are split over the ranks the same way and their losses summed.
//   * with lockstep_forwards() (expert parallelism: every forward and backward is a collective)
//     every rank runs the same number of forwards and backwards: an evaluation rank without a
//     batch of its own repeats its last one (the loss is not counted), and a non-finite loss is
//     agreed on by all ranks right after the forward, so that all skip the rest of the step together.
class DataParallelHooks {
 public:
  virtual ~DataParallelHooks() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Sums host values over the ranks, in place.
  virtual void all_reduce_sum(std::span<double> values) = 0;
  // The optimizer update from this rank's gradients (train::AdamW semantics, StepResult included).
  virtual StepResult optimizer_step(double lr) = 0;
  // After an applied update and model.update_router_bias(): make the buffers that are not trained
  // (the router bias) equal on every rank.
  virtual void after_update(model::Model& model) = 0;
  // Checkpoints in the one-rank format (checkpoint.h), loadable at any number of ranks.
  virtual void save(const std::string& dir, model::Model& model, const CheckpointState& state,
                    const SaveOptions& options) = 0;
  virtual CheckpointInfo load(const std::string& dir, model::Model& model) = 0;
  // Whether the model's forward and backward are collectives (see above).
  virtual bool lockstep_forwards() const { return false; }
};
// Makes the hooks for a trainer's model (called once by the Trainer's constructor).
using DataParallelFactory =
    std::function<std::unique_ptr<DataParallelHooks>(model::Model& model, const AdamWConfig& config)>;

class Trainer {
 public:
  // Builds model, optimizer and data. With `progress` set, the progress line goes there. With
  // `data_parallel`, this is one rank of a data-parallel run (DataParallelHooks above).
  explicit Trainer(TrainConfig config, std::FILE* progress = stderr,
                   DataParallelFactory data_parallel = {});
  ~Trainer();

  // Resumes from a checkpoint directory (model, optimizer, step, data positions, metrics file
  // truncated to the checkpoint's step). Refuses a mismatching model config, recipe or resume
  // fingerprint, naming the field.
  void resume(const std::string& checkpoint_dir);
  // Saves a checkpoint (atomically) to `dir`.
  void save(const std::string& dir, const SaveOptions& options = {}) const;

  // One training step (see the top of the file); appends to metrics.jsonl.
  StepMetrics step();
  // Evaluation over eval_batches held-out batches (reset first); appends to metrics.jsonl.
  EvalMetrics evaluate();
  // Steps until `until` (default: config.steps), evaluating every eval_every steps and at the end,
  // saving every save_every and at the end (when out_dir is set). Returns the summary.
  // When the stop flag is set (checked before every step), it stops there: a checkpoint is saved
  // (out_dir set) and the summary says interrupted; `--resume` continues bit for bit.
  TrainSummary run(std::optional<int64_t> until = std::nullopt);
  // A flag (e.g. set by a SIGINT handler) that makes run() stop between steps; null: none.
  void set_stop_flag(const std::atomic<bool>* flag) { stop_flag_ = flag; }

  int64_t current_step() const { return step_; }
  int64_t tokens_seen() const { return tokens_seen_; }
  const TrainConfig& config() const { return config_; }
  model::Model& model() { return *model_; }
  // The one-rank optimizer (not in a data-parallel run, whose optimizer state is sharded).
  AdamW& optimizer() {
    FOURBIT_CHECK(optimizer_ != nullptr, "Trainer::optimizer: a data-parallel trainer has no "
                  "one-rank optimizer (its state is sharded over the ranks)");
    return *optimizer_;
  }
  int rank() const { return dp_ ? dp_->rank() : 0; }
  int world_size() const { return dp_ ? dp_->world_size() : 1; }
  // Whether every rank must run the same forwards and backwards (DataParallelHooks::lockstep_forwards).
  bool lockstep() const { return dp_ && dp_->lockstep_forwards(); }
  // The loss of every step of this process (NaN for a bad step); after resume() it starts with
  // the checkpoint's summary: its first loss (when not among the recent ones) and its last <= 10.
  const std::vector<double>& train_losses() const { return losses_; }
  double flops_per_token() const;
  TrainSummary summary() const;

 private:
  void write_metrics(const nlohmann::json& line);
  CheckpointState checkpoint_state() const;
  void print_progress(const StepMetrics& m);

  TrainConfig config_;
  std::FILE* progress_;
  std::unique_ptr<model::Model> model_;
  std::unique_ptr<AdamW> optimizer_;          // one rank
  std::unique_ptr<DataParallelHooks> dp_;     // data parallel (then optimizer_ is null)
  DataSources data_;
  Tensor inputs_, targets_;  // host i32 [B, T]
  int64_t step_ = 0, tokens_seen_ = 0, bad_steps_ = 0;
  std::vector<double> losses_;
  std::optional<EvalMetrics> last_eval_;
  std::FILE* metrics_ = nullptr;
  const std::atomic<bool>* stop_flag_ = nullptr;
  std::chrono::steady_clock::time_point start_;
  double train_seconds_ = 0;      // time in step() of this process
  int64_t tokens_this_process_ = 0;
  double window_seconds_ = 0;     // since the last progress line
  int64_t window_tokens_ = 0;
};

// Picks the device: "cpu", "cuda", or "auto" (CUDA when a GPU is present).
Device parse_device(std::string_view name);

}  // namespace fourbit::train
