// `fourbit pretrain`: one pretraining run (train/trainer.h) with a live progress line, metrics in
// OUT/metrics.jsonl, a checkpoint in OUT/checkpoint (resumable with --resume), and a summary.
// Started by `fourbit launch -n N` (or torchrun / mpirun), each process is one rank of a
// data-parallel run (dist/data_parallel.h), optionally expert-parallel for MoE models
// (--expert-parallel); rank 0 prints and writes.
#include "cli/commands.h"
#include "cli/train_options.h"
#include "core/log.h"
#include "dist/data_parallel.h"
#include "model/config.h"

#include <atomic>
#include <csignal>
#include <filesystem>

namespace fourbit::cli {

namespace {

// Ctrl-C / SIGTERM: finish the current step, save the checkpoint, exit; a second one kills.
std::atomic<bool> g_stop{false};
extern "C" void on_stop_signal(int sig) {
  g_stop.store(true);
  std::signal(sig, SIG_DFL);
}

struct PretrainArgs {
  TrainArgs train;
  bool resume = false;
  std::string resume_from;
  bool expert_parallel = false;
};

void run_pretrain(PretrainArgs& a) {
  train::TrainConfig c = finish_train_config(a.train);
  if (c.out_dir.empty()) c.out_dir = "runs/pretrain";
  // Under `fourbit launch` (or torchrun / mpirun): one rank of a data-parallel run. The
  // communicator comes first: it selects this rank's GPU before the model allocates.
  const std::unique_ptr<dist::Communicator> comm = dist::communicator_from_environment(c.device);
  if (comm) {
    dist::quiet_unless_rank0(comm->rank());
    log_info("data parallel: {} ranks (ZeRO-1{}); --grad-accum {} micro-batches per step over all "
             "ranks",
             comm->size(), a.expert_parallel ? ", experts split over the ranks" : "", c.grad_accum);
  } else if (a.expert_parallel) {
    log_warn("--expert-parallel: this is a one-process run, so every expert runs here (start it "
             "with `fourbit launch -n N -- pretrain ...` to split the experts over N ranks)");
  }
  dist::DataParallelOptions dp;
  dp.expert_parallel = a.expert_parallel;
  train::Trainer t(c, comm && comm->rank() != 0 ? nullptr : stderr,
                   comm ? dist::data_parallel(*comm, dp) : train::DataParallelFactory{});
  const model::Model& m = t.model();
  log_info("model '{}': {} parameters ({} active), vocab {}, {} layers, d_model {}; recipe {}; "
           "device {}; {} tokens per step",
           m.config().name, m.table().n_params(), m.table().n_active_params(), m.config().vocab,
           m.config().n_layers, m.config().d_model, c.recipe, device_name(c.device),
           c.data.batch_size * c.data.seq_len * c.grad_accum);
  std::string from = a.resume_from;
  if (a.resume && from.empty()) from = c.out_dir + "/checkpoint";
  if (!from.empty()) {
    if (std::filesystem::exists(from) || !a.resume_from.empty()) {
      t.resume(from);
    } else {
      log_info("--resume: no checkpoint at '{}' yet, starting a new run", from);
    }
  }
  if (t.current_step() == 0 && std::filesystem::exists(c.out_dir + "/checkpoint")) {
    log_warn("'{}/checkpoint' exists and this is a new run: its first save replaces it (use "
             "--resume to continue that run instead)",
             c.out_dir);
  }
  g_stop.store(false);
  t.set_stop_flag(&g_stop);
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
  const train::TrainSummary s = t.run();
  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
  if (t.rank() == 0) std::printf("%s\n", s.to_json().dump(2).c_str());
  log_info("metrics: {}/metrics.jsonl, checkpoint: {}/checkpoint", c.out_dir, c.out_dir);
}

}  // namespace

Command add_pretrain_command(CLI::App& app) {
  auto args = std::make_shared<PretrainArgs>();
  CLI::App* sub = app.add_subcommand("pretrain", "Pretrain a model under a precision recipe");
  args->train.config.out_dir = "runs/pretrain";
  add_train_options(sub, args->train);
  sub->add_option("--out,-o", args->train.config.out_dir,
                  "run directory (metrics.jsonl, checkpoint/)")->capture_default_str()
      ->group("Run");
  sub->add_flag("--resume", args->resume, "continue from OUT/checkpoint if it exists")
      ->group("Run");
  sub->add_option("--resume-from", args->resume_from, "continue from this checkpoint directory")
      ->group("Run");
  sub->add_flag("--expert-parallel", args->expert_parallel,
                "MoE under `fourbit launch -n N`: split the routed experts over the N ranks (tokens "
                "travel to their experts' ranks by all-to-all) instead of running every expert on "
                "every rank")
      ->group("Run");
  return {sub, [args] { run_pretrain(*args); }};
}

}  // namespace fourbit::cli
