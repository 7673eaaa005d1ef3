// Data-parallel training: the train::DataParallelHooks of one rank, built on a Communicator and the
// ZeRO-1 optimizer (zero_optimizer.h), and the communicator a `fourbit pretrain` process gets from
// its environment (launcher.h sets it; torchrun and mpirun variables are understood too).
//
// Semantics (see train/trainer.h, DataParallelHooks): --grad-accum counts the micro-batches of a
// step over all ranks, rank r runs micro-batches r, r + R, ...; the gradients' rank sum is the
// one-rank gradient; ZeRO-1 updates; the router bias (the only non-trained buffer) is broadcast
// from rank R - 1, whose micro-batch is the step's last, as a one-rank run updates it from its last
// micro-batch. A run at R ranks therefore follows the one-rank run with the same --grad-accum up
// to float summation order. With DataParallelOptions::expert_parallel the ranks also split an MoE
// model's routed experts (expert_parallel.h); the trainer then keeps their forwards in lockstep
// (train::DataParallelHooks::lockstep_forwards), and the run still follows the one-rank run.
//
// Checkpoints: the one-rank format of train/checkpoint.h. Saving gathers the sharded moments to
// full tensors on every rank (an all_gather: transiently the one-rank optimizer memory), rank 0
// writes the directory (atomically, as save_checkpoint does) and every rank waits for it (barrier).
// Loading reads the full checkpoint on every rank and keeps this rank's shard of the moments, so a
// checkpoint saved at any number of ranks (1 included) loads at any other.
#pragma once

#include "dist/communicator.h"
#include "dist/expert_parallel.h"
#include "dist/zero_optimizer.h"
#include "train/trainer.h"

#include <memory>
#include <optional>
#include <string>

namespace fourbit::dist {

struct DataParallelOptions {
  // MoE models: split the routed experts over the ranks (expert parallelism, ExpertParallelModel in
  // expert_parallel.h) instead of running every expert on every rank's own tokens. The parameters
  // stay replicated and ZeRO-1-updated as above; each rank's expert GEMMs see only its experts,
  // with the rows of every rank. The trainer then keeps the ranks' forwards in lockstep.
  bool expert_parallel = false;
};

class DataParallel final : public train::DataParallelHooks {
 public:
  DataParallel(Communicator& comm, model::Model& model, const train::AdamWConfig& config,
               const DataParallelOptions& options = {});
  ~DataParallel() override;  // detaches the expert parallelism from the model

  int rank() const override { return comm_.rank(); }
  int world_size() const override { return comm_.size(); }
  void all_reduce_sum(std::span<double> values) override;
  train::StepResult optimizer_step(double lr) override;
  void after_update(model::Model& model) override;
  void save(const std::string& dir, model::Model& model, const train::CheckpointState& state,
            const train::SaveOptions& options) override;
  train::CheckpointInfo load(const std::string& dir, model::Model& model) override;
  bool lockstep_forwards() const override { return experts_ != nullptr; }

  ZeroAdamW& optimizer() { return zero_; }
  // The expert parallelism attached to the model (null without DataParallelOptions::expert_parallel).
  const ExpertParallelModel* experts() const { return experts_.get(); }

 private:
  Communicator& comm_;
  model::Model& model_;
  ZeroAdamW zero_;
  std::unique_ptr<ExpertParallelModel> experts_;
};

// The factory for train::Trainer (the communicator must outlive the trainer).
train::DataParallelFactory data_parallel(Communicator& comm, DataParallelOptions options = {});

// Where this process sits in a multi-process run, from the environment:
//   fourbit launch:  RANK, WORLD_SIZE, LOCAL_RANK (+ FOURBIT_NCCL_ID_FILE, see launcher.h)
//   torchrun:        the same names (LOCAL_WORLD_SIZE, MASTER_ADDR/PORT ignored)
//   mpirun (Open MPI): OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK
// nullopt when none is set or the world size is 1. Throws on inconsistent values, naming them.
struct RankEnvironment {
  int rank = 0, world_size = 1, local_rank = 0;
  std::string source;  // "RANK/WORLD_SIZE" or "OMPI_COMM_WORLD_*"
};
std::optional<RankEnvironment> rank_environment();

// The communicator of this process: null for a single-process run; for several ranks a
// NcclCommunicator on GPU local_rank (selects that device) when the build has NCCL and the
// device is CUDA; otherwise an Error saying what is missing.
std::unique_ptr<Communicator> communicator_from_environment(Device device);

// Rank-aware logging for a multi-process run: ranks other than 0 log warnings and errors only.
void quiet_unless_rank0(int rank);

}  // namespace fourbit::dist
