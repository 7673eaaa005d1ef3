// ZeRO-1 data parallelism: AdamW with its moments sharded over the ranks of a communicator.
//
// Every rank holds the whole model (master weights, gradients, the BF16 compute copy on CUDA) and
// runs forward/backward on its own micro-batches, accumulating into model.grads() as the trainer
// does. The flat parameter space of the table (model/params.h: one buffer, rows at aligned
// offsets) is cut into `world` contiguous shards (FlatPartition); rank r owns shard r: it keeps
// only that slice of AdamW's m and v (1/world of the optimizer memory) and updates only that
// slice of the master weights. One step (ZeroAdamW::step):
//   1. reduce-scatter the gradients: shard r of every rank's grads is summed (in place, into
//      shard r of this rank's grads buffer). The caller scales the backward so that the SUM over
//      ranks is the gradient of the objective (loss_scale = 1 / (micro-batches of the step over
//      all ranks)): no extra division, and the same scaling as a single-rank run that accumulates
//      those micro-batches.
//   2. the global L2 norm: each rank's sum of squares over the trainable elements of its shard
//      (float64, element by element), all-reduced (float64), square-rooted, rounded to the master
//      dtype as train::AdamW's norm is. Not finite: StepResult::applied = false and NOTHING
//      changes on any rank (master weights, moments, step count; every rank sees the same norm,
//      so they agree). Otherwise clip_grad_scale(norm, grad_clip) as train::AdamW.
//   3. ops::adamw_update on every piece (trainable row cut by the shard) with the row's own
//      weight decay (train::adamw_decays) and train::adamw_update_params: the same math as
//      train::AdamW::step element for element.
//   4. all-gather the master weights (in place), then model.params_changed() (the BF16 copy).
// Gaps between rows and non-trainable rows (the router bias) are never updated; all-gather copies
// each element from the rank that owns it.
//
// Equality with one rank: with the same total gradient, steps 2-4 produce bit for bit the
// parameters of train::AdamW (the elementwise update is the same, the norm is summed in float64
// in another order, then rounded to f32/f64). The gradient itself differs from a one-rank run by
// the order of float additions (rank-order sum of per-rank partial sums).
//
// Expert parallelism (DataParallelOptions::expert_parallel) changes nothing here: a rank's gradient
// rows of the experts it does not own are zero, so the reduce-scatter's rank sum is still the
// one-rank gradient, and the all-gather hands every rank the updated experts.
//
// Not done: overlapping the reduce-scatter with the backward (the model's backward is one call
// that does not report finished layers), a BF16 all-gather of the compute copy, sharding the expert
// parameters themselves (each rank holding only its experts' weights, gradients and moments).
#pragma once

#include "dist/communicator.h"
#include "model/model.h"
#include "train/optimizer.h"

#include <cstdint>
#include <vector>

namespace fourbit::dist {

// Contiguous shards of [0, total): shard r = [offsets[r], offsets[r] + counts[r]); every shard
// but the trailing ones has the same size (a multiple of `align` elements), shards past the end
// are empty.
struct FlatPartition {
  int64_t total = 0;
  std::vector<int64_t> offsets, counts;  // [world]
  static FlatPartition even(int64_t total, int world, int64_t align);
  int world() const { return (int)counts.size(); }
};

// One trainable row's slice inside a shard: flat elements [begin, end) of row `row`.
struct ShardPiece {
  int row = 0;
  int64_t begin = 0, end = 0;
};

class ZeroAdamW {
 public:
  // Allocates this rank's slices of m and v (zero) on the model's device. `comm` must work on the
  // model's device; model and comm must outlive the optimizer. Every rank's model must have the
  // same table (the same config).
  ZeroAdamW(model::Model& model, Communicator& comm, const train::AdamWConfig& config);

  // One update (collective; see the top of the file). Synchronizes.
  train::StepResult step(double lr);

  int64_t steps() const { return steps_; }
  void set_steps(int64_t steps);
  const train::AdamWConfig& config() const { return config_; }
  const FlatPartition& partition() const { return partition_; }
  int64_t shard_begin() const { return partition_.offsets[(size_t)comm_.rank()]; }
  int64_t shard_end() const { return shard_begin() + partition_.counts[(size_t)comm_.rank()]; }
  const std::vector<ShardPiece>& pieces() const { return pieces_; }
  const TensorView& exp_avg_shard() const { return m_.view(); }     // [shard size]
  const TensorView& exp_avg_sq_shard() const { return v_.view(); }  // [shard size]
  int64_t state_bytes() const { return m_.nbytes() + v_.nbytes(); }  // this rank's moments

  // Checkpoints (dist/checkpoint.h). gather_state: collective, every rank receives the full
  // moments into m_full / v_full (laid out by the model's table, the master dtype, any device).
  // load_state: local, copies this rank's slice out of full moments (resharding on load).
  void gather_state(const model::ParamBuffer& m_full, const model::ParamBuffer& v_full);
  void load_state(const model::ParamBuffer& m_full, const model::ParamBuffer& v_full);

 private:
  double shard_sum_of_squares();

  model::Model& model_;
  Communicator& comm_;
  train::AdamWConfig config_;
  FlatPartition partition_;
  std::vector<ShardPiece> pieces_;
  std::vector<bool> decay_;  // by table row
  Tensor m_, v_;             // [shard size] master dtype, model's device
  Tensor norm_, workspace_;  // CUDA: [1] f32 and the reduction scratch of ops::global_grad_norm
  int64_t steps_ = 0;
};

}  // namespace fourbit::dist
