// Data-parallel trainer hooks, the environment's communicator, rank-aware logging
// (data_parallel.h).
#include "dist/data_parallel.h"

#include "core/check.h"
#include "core/env.h"
#include "core/log.h"
#include "train/checkpoint.h"

#if defined(FOURBIT_WITH_NCCL)
#include "dist/nccl_communicator.h"
#endif

#include <cstdlib>
#include <string>

namespace fourbit::dist {

DataParallel::DataParallel(Communicator& comm, model::Model& model, const train::AdamWConfig& config,
                           const DataParallelOptions& options)
    : comm_(comm), model_(model), zero_(model, comm, config) {
  if (options.expert_parallel) {
    experts_ = std::make_unique<ExpertParallelModel>(comm, model.config());
    model.set_routed_experts(experts_.get());
    log_info("expert parallel: rank {} runs experts [{}, {}) of {} in every MoE block", comm.rank(),
             experts_->first_local_expert(),
             experts_->first_local_expert() + experts_->n_local_experts(), model.config().moe.n_experts);
  }
}

DataParallel::~DataParallel() {
  if (experts_ && model_.routed_experts() == experts_.get()) model_.set_routed_experts(nullptr);
}

void DataParallel::all_reduce_sum(std::span<double> values) { all_reduce_sum_host(comm_, values); }

train::StepResult DataParallel::optimizer_step(double lr) { return zero_.step(lr); }

void DataParallel::after_update(model::Model& model) {
  const model::ParamTable& table = model.table();
  bool any = false;
  for (int i = 0; i < table.size(); ++i) {
    if (table.row(i).trainable) continue;
    comm_.broadcast(model.params().view(i), comm_.size() - 1);
    any = true;
  }
  if (any) model.params_changed();
}

void DataParallel::save(const std::string& dir, model::Model& model,
                        const train::CheckpointState& state, const train::SaveOptions& options) {
  // Rank 0 gathers into a one-rank AdamW (the format's writer), the others into plain buffers.
  std::unique_ptr<train::AdamW> full;
  model::ParamBuffer m, v;
  if (comm_.rank() == 0) {
    full = std::make_unique<train::AdamW>(model, zero_.config());
    zero_.gather_state(full->exp_avg(), full->exp_avg_sq());
    full->set_steps(zero_.steps());
  } else {
    m = model::ParamBuffer(model.table(), model.params().dtype(), model.params().device());
    v = model::ParamBuffer(model.table(), model.params().dtype(), model.params().device());
    zero_.gather_state(m, v);
  }
  // A failed save on rank 0 must not leave the others waiting: its outcome is all-reduced.
  double failed = 0;
  std::string error;
  if (comm_.rank() == 0) {
    try {
      train::save_checkpoint(dir, model, full.get(), state, options);
    } catch (const std::exception& e) {
      failed = 1;
      error = e.what();
    }
  }
  all_reduce_sum_host(comm_, std::span<double>(&failed, 1));
  FOURBIT_CHECK(failed == 0, "checkpoint save at '{}' failed on rank 0{}", dir,
                error.empty() ? "" : ": " + error);
}

train::CheckpointInfo DataParallel::load(const std::string& dir, model::Model& model) {
  train::AdamW full(model, zero_.config());
  train::CheckpointInfo info = train::load_checkpoint(dir, model, &full);
  zero_.load_state(full.exp_avg(), full.exp_avg_sq());
  zero_.set_steps(full.steps());
  comm_.barrier();
  return info;
}

train::DataParallelFactory data_parallel(Communicator& comm, DataParallelOptions options) {
  return [&comm, options](model::Model& model, const train::AdamWConfig& config) {
    return std::unique_ptr<train::DataParallelHooks>(new DataParallel(comm, model, config, options));
  };
}

namespace {

// A rank or world size from the launcher's environment.
std::optional<int> env_int(const char* name) { return fourbit::env_int(name, (1 << 20) - 1); }

}  // namespace

std::optional<RankEnvironment> rank_environment() {
  RankEnvironment e;
  if (auto ws = env_int("WORLD_SIZE")) {
    e.world_size = *ws;
    e.rank = env_int("RANK").value_or(-1);
    e.local_rank = env_int("LOCAL_RANK").value_or(e.rank);
    e.source = "RANK/WORLD_SIZE/LOCAL_RANK";
  } else if (auto ows = env_int("OMPI_COMM_WORLD_SIZE")) {
    e.world_size = *ows;
    e.rank = env_int("OMPI_COMM_WORLD_RANK").value_or(-1);
    e.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK").value_or(e.rank);
    e.source = "OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK";
  } else {
    return std::nullopt;
  }
  FOURBIT_CHECK(e.world_size >= 1 && e.rank >= 0 && e.rank < e.world_size && e.local_rank >= 0,
                "{}: rank {} of world size {} (local rank {}) is not valid: the rank must be set "
                "and lie in [0, world size)",
                e.source, e.rank, e.world_size, e.local_rank);
  if (e.world_size == 1) return std::nullopt;
  return e;
}

std::unique_ptr<Communicator> communicator_from_environment(Device device) {
  const std::optional<RankEnvironment> env = rank_environment();
  if (!env) return nullptr;
  FOURBIT_CHECK(device == Device::kCuda,
                "a {}-rank run ({}) needs --device cuda: data parallelism across processes runs "
                "over NCCL on GPUs (the CPU build tests it with in-process ranks only)",
                env->world_size, env->source);
#if defined(FOURBIT_WITH_NCCL)
  std::string id_file;
  if (const char* f = std::getenv("FOURBIT_NCCL_ID_FILE"); f != nullptr && *f != '\0') {
    id_file = f;
  } else {
    // torchrun / mpirun without fourbit launch: a file named after the rendezvous port (one host,
    // or a shared /tmp).
    const char* port = std::getenv("MASTER_PORT");
    const char* run = std::getenv("TORCHELASTIC_RUN_ID");
    FOURBIT_CHECK(port != nullptr,
                  "{}: set FOURBIT_NCCL_ID_FILE to a path on a file system every rank sees (the "
                  "NCCL unique id is exchanged through it), or run under `fourbit launch`",
                  env->source);
    id_file = std::string("/tmp/fourbit-nccl-id-") + port + (run ? std::string("-") + run : "");
  }
  return make_nccl_communicator(env->rank, env->world_size, env->local_rank, id_file);
#else
  FOURBIT_CHECK(false,
                "a {}-rank run ({}) needs NCCL, which this build does not have (configure with "
                "the CUDA toolkit's nccl.h and libnccl, see src/dist/CMakeLists.txt)",
                env->world_size, env->source);
  return nullptr;
#endif
}

void quiet_unless_rank0(int rank) {
  if (rank != 0 && log_level() < LogLevel::kWarn) set_log_level(LogLevel::kWarn);
}

}  // namespace fourbit::dist
