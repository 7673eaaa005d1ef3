// The data-parallel trainer (train::Trainer with dist::DataParallel hooks, ZeRO-1 underneath) with
// in-process ranks on the CPU:
//   * 2 and 4 ranks follow the 1-rank run's losses over 20 steps (same --grad-accum 4: the same
//     micro-batches, split over the ranks), dense and MoE (with the auxiliary-loss-free router
//     bias, which the ranks must keep equal);
//   * every rank ends with the same weights, bit for bit;
//   * a checkpoint saved at 4 ranks is in the 1-rank format and resumes at 4, 2 and 1 ranks;
//     each continues to the losses of the uninterrupted run (at 4 ranks bit for bit);
//   * a NaN gradient (inject_nan_steps) is skipped by every rank together;
//   * expert parallelism (DataParallelOptions::expert_parallel) follows the one-rank run too, with
//     even and uneven expert ranges, and its checkpoints resume at any rank count.
// Tolerance: the ranks' gradient sum differs from the one-rank accumulation only in the order of
// float32 additions; over 20 AdamW steps that moved the losses by at most 9e-8 relative (printed
// by the test); we allow 1e-5 relative.
#include "dist/data_parallel.h"
#include "dist/in_process_communicator.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>

namespace fourbit::dist {
namespace {

namespace fs = std::filesystem;
using train::TrainConfig;
using train::Trainer;

TrainConfig small_config(bool moe) {
  TrainConfig c;
  c.preset = "tiny";
  c.sets = {"d_model=64", "n_heads=1", "n_kv_heads=1", "d_ff=128", "n_layers=2", "max_seq=32"};
  if (moe) {
    for (const char* s : {"moe.layers=1", "moe.n_experts=4", "moe.top_k=2", "moe.expert_d_ff=32",
                          "moe.load_balancing=bias", "moe.bias_update_rate=0.01"})
      c.sets.push_back(s);
  }
  c.data.batch_size = 2;
  c.data.seq_len = 32;
  c.grad_accum = 4;
  c.steps = 20;
  c.schedule.lr = 3e-3;
  c.schedule.min_lr = 3e-4;
  c.schedule.warmup_steps = 2;
  c.eval_every = 10;
  c.eval_batches = 3;
  c.log_every = 0;
  return c;
}

DataParallelOptions expert_parallel() {
  DataParallelOptions o;
  o.expert_parallel = true;
  return o;
}

// The MoE config without evaluation, for `steps` steps.
TrainConfig short_moe_run(int64_t steps) {
  TrainConfig c = small_config(true);
  c.steps = steps;
  c.eval_every = 0;
  return c;
}

std::string temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("fourbit_dist_dp_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p.string();
}

std::vector<float> params_of(Trainer& t) {
  const TensorView& f = t.model().params().flat();
  return std::vector<float>(f.ptr<float>(), f.ptr<float>() + f.numel());
}

struct RunResult {
  std::vector<double> losses;
  double val_loss = 0;
  std::vector<float> params;  // rank 0's
};

// `world` in-process ranks (world 0: the plain one-rank Trainer) running `c` until `until`,
// optionally resuming from `resume_from` first.
// With options.expert_parallel, each rank also checks that its model runs its share of the experts
// and that those experts processed rows.
RunResult run(const TrainConfig& c, int world, int64_t until, const std::string& resume_from = "",
              DataParallelOptions options = {}) {
  RunResult out;
  if (world == 0) {
    Trainer t(c, nullptr);
    if (!resume_from.empty()) t.resume(resume_from);
    const train::TrainSummary s = t.run(until);
    out = {t.train_losses(), s.final_val_loss, params_of(t)};
    return out;
  }
  std::vector<std::vector<float>> params((size_t)world);
  std::vector<std::vector<double>> losses((size_t)world);
  std::mutex mu;
  run_ranks(world, [&](Communicator& comm) {
    Trainer t(c, nullptr, data_parallel(comm, options));
    EXPECT_EQ(t.world_size(), world);
    if (!resume_from.empty()) t.resume(resume_from);
    const train::TrainSummary s = t.run(until);
    const auto* experts = dynamic_cast<const ExpertParallelModel*>(t.model().routed_experts());
    EXPECT_EQ(experts != nullptr, options.expert_parallel) << "rank " << comm.rank();
    if (experts != nullptr) {
      const ExpertPartition want = ExpertPartition::contiguous(t.model().config().moe.n_experts, world);
      EXPECT_EQ(experts->first_local_expert(), want.first[(size_t)comm.rank()]);
      EXPECT_EQ(experts->n_local_experts(), want.n_local(comm.rank()));
      for (int mi = 0; mi < t.model().config().n_moe_layers(); ++mi)
        EXPECT_GT(experts->rows_processed(mi), 0) << "rank " << comm.rank() << "'s experts got no rows";
    }
    std::lock_guard<std::mutex> lk(mu);
    params[(size_t)comm.rank()] = params_of(t);
    losses[(size_t)comm.rank()] = t.train_losses();
    if (comm.rank() == 0) out.val_loss = s.final_val_loss;
  });
  for (int r = 1; r < world; ++r) {
    EXPECT_TRUE(params[(size_t)r] == params[0]) << "rank " << r << "'s weights differ from rank 0's";
    // Bitwise (a skipped step logs NaN, which == would call different).
    EXPECT_TRUE(losses[(size_t)r].size() == losses[0].size() &&
                std::memcmp(losses[(size_t)r].data(), losses[0].data(),
                            losses[0].size() * sizeof(double)) == 0)
        << "rank " << r << " logged other losses";
  }
  out.losses = losses[0];
  out.params = params[0];
  return out;
}

void expect_losses_close(const std::vector<double>& got, const std::vector<double>& want,
                         const std::string& what, double rel = 1e-5) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << what << " step " << i + 1;
    const double d = std::abs(got[i] - want[i]) / std::abs(want[i]);
    worst = std::max(worst, d);
    EXPECT_LE(d, rel) << what << " step " << i + 1 << ": " << got[i] << " vs " << want[i];
  }
  std::printf("%s: max relative loss deviation from one rank over %zu steps: %.3g\n", what.c_str(),
              got.size(), worst);
}

TEST(DistDataParallel, TwoAndFourRanksMatchOneRankOver20Steps) {
  for (bool moe : {false, true}) {
    const TrainConfig c = small_config(moe);
    const RunResult one = run(c, 0, 20);
    ASSERT_EQ(one.losses.size(), 20u);
    EXPECT_LT(one.losses.back(), one.losses.front() - 0.5) << "the run should learn";
    for (int world : {2, 4}) {
      const std::string what = fmt::format("{} at {} ranks", moe ? "moe" : "dense", world);
      const RunResult dp = run(c, world, 20);
      expect_losses_close(dp.losses, one.losses, what);
      EXPECT_NEAR(dp.val_loss, one.val_loss, 1e-5 * one.val_loss) << what;
      double worst = 0;
      for (size_t i = 0; i < one.params.size(); ++i)
        worst = std::max(worst, (double)std::abs(dp.params[i] - one.params[i]));
      EXPECT_LT(worst, 3e-3 * 20) << what;  // lr 3e-3 per step at most
    }
  }
}

// Expert parallelism: every rank routes its own micro-batches, each rank's experts run on the rows
// of all ranks. The same losses as one rank (4 experts: 2 a rank at 2 ranks, 1 at 4; 5 experts:
// uneven ranges 3 + 2 and 2 + 1 + 1 + 1), the evaluation included (3 batches over 4 ranks: rank 3
// repeats a batch to keep the collectives in step); every rank ends with the same weights.
TEST(DistDataParallel, ExpertParallelMatchesOneRankOver20Steps) {
  const DataParallelOptions ep = expert_parallel();
  for (int experts : {4, 5}) {
    TrainConfig c = small_config(true);
    c.sets.push_back(fmt::format("moe.n_experts={}", experts));
    const RunResult one = run(c, 0, 20);
    ASSERT_EQ(one.losses.size(), 20u);
    for (int world : {2, 4}) {
      const std::string what = fmt::format("{} experts, expert parallel at {} ranks", experts, world);
      const RunResult r = run(c, world, 20, "", ep);
      expect_losses_close(r.losses, one.losses, what);
      EXPECT_NEAR(r.val_loss, one.val_loss, 1e-5 * one.val_loss) << what;
      double worst = 0;
      for (size_t i = 0; i < one.params.size(); ++i)
        worst = std::max(worst, (double)std::abs(r.params[i] - one.params[i]));
      EXPECT_LT(worst, 3e-3 * 20) << what;
    }
  }
}

TEST(DistDataParallel, ExpertParallelCheckpointResumes) {
  const DataParallelOptions ep = expert_parallel();
  const TrainConfig c = short_moe_run(8);
  const RunResult straight = run(c, 2, 8, "", ep);
  const std::string dir = temp_dir("ep_ckpt");
  TrainConfig saving = c;
  saving.out_dir = dir;
  run(saving, 2, 4, "", ep);
  for (int world : {2, 0}) {
    const std::string what = fmt::format("resumed at {} rank(s)", world == 0 ? 1 : world);
    TrainConfig resumed = c;
    resumed.out_dir = temp_dir(fmt::format("ep_resume{}", world));
    const RunResult r = run(resumed, world, 8, dir + "/checkpoint", world == 0 ? DataParallelOptions{} : ep);
    ASSERT_EQ(r.losses.size(), 8u) << what;
    const std::vector<double> tail(r.losses.end() - 4, r.losses.end());
    const std::vector<double> want(straight.losses.end() - 4, straight.losses.end());
    if (world == 2) {
      EXPECT_EQ(tail, want) << what << ": must continue the expert-parallel run bit for bit";
      EXPECT_TRUE(r.params == straight.params) << what;
    } else {
      expect_losses_close(tail, want, what);
    }
    fs::remove_all(resumed.out_dir);
  }
  fs::remove_all(dir);
}

// Expert parallelism makes the backward a collective: a rank whose forward gives a non-finite loss
// must not skip a backward that the others run. Rank 1's final norm weight is NaN, so all its
// losses are: every rank must agree after each forward and skip the step together (without the
// agreement the ranks' next collectives do not match and the in-process communicator throws).
TEST(DistDataParallel, ExpertParallelRanksSkipABadLossTogether) {
  const DataParallelOptions ep = expert_parallel();
  TrainConfig c = short_moe_run(3);
  c.nan_policy = train::NanPolicy::kSkip;
  std::vector<std::vector<double>> losses(2);
  run_ranks(2, [&](Communicator& comm) {
    Trainer t(c, nullptr, data_parallel(comm, ep));
    if (comm.rank() == 1) {
      const TensorView w = t.model().param("final_norm.weight");
      ASSERT_EQ(w.dtype, DType::kF32);
      w.ptr<float>()[0] = std::numeric_limits<float>::quiet_NaN();
      t.model().params_changed();
    }
    t.run(3);
    losses[(size_t)comm.rank()] = t.train_losses();
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(losses[(size_t)r].size(), 3u) << "rank " << r;
    for (double l : losses[(size_t)r]) EXPECT_TRUE(std::isnan(l)) << "rank " << r << " applied a step";
  }
}

TEST(DistDataParallel, ExpertParallelRefusesWhatItCannotSplit) {
  const DataParallelOptions ep = expert_parallel();
  auto error_of = [&](const TrainConfig& c, int world) -> std::string {
    try {
      run(c, world, 1, "", ep);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  const std::string dense = error_of(small_config(false), 2);
  EXPECT_NE(dense.find("no MoE blocks"), std::string::npos) << dense;
  TrainConfig two = small_config(true);
  two.sets.push_back("moe.n_experts=2");
  const std::string few = error_of(two, 4);
  EXPECT_NE(few.find("2 experts cannot be split over 4 ranks"), std::string::npos) << few;
}

TEST(DistDataParallel, GradAccumMustBeAMultipleOfTheRanks) {
  TrainConfig c = small_config(false);
  c.grad_accum = 3;
  try {
    run(c, 2, 1);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--grad-accum 4"), std::string::npos) << e.what();
  }
}

TEST(DistDataParallel, CheckpointFromFourRanksResumesAtFourTwoAndOne) {
  TrainConfig c = small_config(true);
  c.steps = 8;
  c.eval_every = 0;
  const RunResult straight1 = run(c, 0, 8);
  const RunResult straight4 = run(c, 4, 8);
  const std::string dir = temp_dir("reshard");
  TrainConfig saving = c;
  saving.out_dir = dir;
  run(saving, 4, 4);  // saves dir/checkpoint at step 4
  const std::string ckpt = dir + "/checkpoint";
  // The one-rank format: a plain load into a one-rank optimizer works and has full moments.
  const train::CheckpointInfo info = train::read_checkpoint_info(ckpt);
  EXPECT_EQ(info.state.step, 4);
  {
    Trainer plain(c, nullptr);
    plain.resume(ckpt);
    double m2 = 0;
    const TensorView& m = plain.optimizer().exp_avg().flat();
    for (int64_t i = 0; i < m.numel(); ++i) m2 += (double)m.ptr<float>()[i] * m.ptr<float>()[i];
    EXPECT_GT(m2, 0) << "the gathered first moments are empty";
  }
  for (int world : {4, 2, 0}) {
    const std::string what = fmt::format("resumed at {} rank(s)", world == 0 ? 1 : world);
    TrainConfig resumed = c;
    resumed.out_dir = temp_dir(fmt::format("resume{}", world));
    const RunResult r = run(resumed, world, 8, ckpt);
    ASSERT_EQ(r.losses.size(), 8u) << what;  // steps 1-4 from the checkpoint's summary, 5-8 run
    const std::vector<double> tail(r.losses.end() - 4, r.losses.end());
    if (world == 4) {
      const std::vector<double> want(straight4.losses.end() - 4, straight4.losses.end());
      EXPECT_EQ(tail, want) << what << ": a 4-rank resume must continue the 4-rank run bit for bit";
      EXPECT_TRUE(r.params == straight4.params) << what;
    }
    const std::vector<double> want(straight1.losses.end() - 4, straight1.losses.end());
    expect_losses_close(tail, want, what);
    fs::remove_all(resumed.out_dir);
  }
  // Only rank 0 wrote metrics: one run header, steps 1..4 once.
  std::ifstream in(dir + "/metrics.jsonl");
  std::string line;
  int runs = 0, trains = 0;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    runs += j["type"] == "run";
    trains += j["type"] == "train";
  }
  EXPECT_EQ(runs, 1);
  EXPECT_EQ(trains, 4);
  fs::remove_all(dir);
}

TEST(DistDataParallel, NanGradientIsSkippedByEveryRank) {
  TrainConfig c = small_config(false);
  c.steps = 4;
  c.eval_every = 0;
  c.nan_policy = train::NanPolicy::kSkip;
  c.inject_nan_steps = {2};
  const RunResult one = run(c, 0, 4);
  const RunResult two = run(c, 2, 4);
  ASSERT_EQ(two.losses.size(), 4u);
  EXPECT_TRUE(std::isnan(two.losses[1]));
  EXPECT_TRUE(std::isnan(one.losses[1]));
  expect_losses_close({two.losses[0], two.losses[2], two.losses[3]},
                      {one.losses[0], one.losses[2], one.losses[3]}, "nan skip at 2 ranks");
}

}  // namespace
}  // namespace fourbit::dist
