// train/trainer.h on the CPU with a very small model on the built-in corpus: the loss falls;
// resume is bit-exact (N steps straight == k steps + save + load into a fresh trainer + N - k
// steps: every loss and every parameter and moment bitwise); the NaN policy (an injected NaN
// gradient: stop throws naming the tensor and leaves the state unchanged, skip continues and
// counts, max_bad_steps stops); a resume with different training settings is refused naming the
// field; gradient accumulation equals one big batch; metrics.jsonl lines are well-formed.
#include "train/trainer.h"

#include "train/compare.h"

#include "io/token_shards.h"
#include "rl/synthetic_corpus.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace fourbit::train {
namespace {

namespace fs = std::filesystem;

std::string temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / fmt::format("fourbit_trainer_{}_{}", ::getpid(), name);
  fs::remove_all(p);
  return p.string();
}

TrainConfig small_config() {
  TrainConfig c;
  c.preset = "tiny";
  c.sets = {"d_model=64", "n_heads=1", "n_kv_heads=1", "d_ff=128", "n_layers=2", "max_seq=32"};
  c.data.batch_size = 4;
  c.data.seq_len = 32;
  c.steps = 12;
  c.schedule.lr = 3e-3;
  c.schedule.min_lr = 3e-4;
  c.schedule.warmup_steps = 2;
  c.eval_every = 0;
  c.eval_batches = 2;
  c.log_every = 0;
  return c;
}

std::vector<uint8_t> bytes_of(const TensorView& v) {
  std::vector<uint8_t> out((size_t)v.nbytes());
  std::memcpy(out.data(), v.data, out.size());
  return out;
}

TEST(Trainer, LossFallsOnTheBuiltInCorpus) {
  TrainConfig c = small_config();
  c.steps = 40;
  c.eval_every = 20;
  Trainer t(c, nullptr);
  EXPECT_EQ(t.model().config().vocab, 384);  // raised for the corpus' 257 ids
  const EvalMetrics before = t.evaluate();
  const TrainSummary s = t.run();
  EXPECT_EQ(s.steps, 40);
  EXPECT_EQ(s.tokens_seen, 40 * 4 * 32);
  EXPECT_EQ(s.bad_steps, 0);
  // Uniform over 384 ids is ln 384 = 5.95; the corpus' bytes are far from uniform.
  EXPECT_GT(before.loss, 5.5);
  EXPECT_LT(s.final_train_loss, s.first_loss - 1.5);
  EXPECT_LT(s.final_val_loss, before.loss - 1.5);
}

TEST(Trainer, ResumeIsBitExact) {
  for (const char* recipe : {"bf16", "e2e4"}) {
    SCOPED_TRACE(recipe);
    TrainConfig c = small_config();
    c.recipe = recipe;
    c.steps = 6;
    c.grad_accum = 2;
    c.schedule.kind = ScheduleKind::kWsd;
    Trainer straight(c, nullptr);
    straight.run();

    const std::string dir = temp_dir(std::string("resume_") + recipe);
    TrainConfig c1 = c;
    c1.out_dir = dir;
    {
      Trainer first(c1, nullptr);
      first.run(3);  // saves dir/checkpoint at its end
    }
    Trainer second(c1, nullptr);
    second.resume(dir + "/checkpoint");
    EXPECT_EQ(second.current_step(), 3);
    second.run();
    // Every loss bitwise: the first three restored from the checkpoint, the last three computed.
    const std::vector<double>& a = straight.train_losses();
    const std::vector<double>& b = second.train_losses();
    ASSERT_EQ(a.size(), 6u);
    ASSERT_EQ(b.size(), 6u);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), 6 * sizeof(double)), 0)
        << a[3] << " vs " << b[3] << ", " << a[5] << " vs " << b[5];
    EXPECT_EQ(bytes_of(second.model().params().flat()), bytes_of(straight.model().params().flat()));
    EXPECT_EQ(bytes_of(second.optimizer().exp_avg().flat()),
              bytes_of(straight.optimizer().exp_avg().flat()));
    EXPECT_EQ(bytes_of(second.optimizer().exp_avg_sq().flat()),
              bytes_of(straight.optimizer().exp_avg_sq().flat()));
    EXPECT_EQ(second.tokens_seen(), straight.tokens_seen());
    // metrics.jsonl: one run line, then steps 1..6 exactly once each.
    std::ifstream in(dir + "/metrics.jsonl");
    std::string line;
    std::vector<int64_t> steps;
    while (std::getline(in, line)) {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (j["type"] == "train") steps.push_back(j["step"].get<int64_t>());
    }
    EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
    fs::remove_all(dir);
  }
}

TEST(Trainer, RefusesResumeWithOtherSettings) {
  const std::string dir = temp_dir("refuse");
  TrainConfig c = small_config();
  c.steps = 2;
  c.out_dir = dir;
  Trainer(c, nullptr).run();
  TrainConfig other = c;
  other.data.batch_size = 2;
  Trainer t(other, nullptr);
  try {
    t.resume(dir + "/checkpoint");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("data.batch_size: 4 vs 2"), std::string::npos) << e.what();
  }
  TrainConfig wider = c;
  wider.sets.push_back("d_ff=192");
  Trainer w(wider, nullptr);
  try {
    w.resume(dir + "/checkpoint");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("d_ff: 128 vs 192"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(Trainer, NanPolicyStopLeavesStateIntact) {
  TrainConfig c = small_config();
  c.steps = 4;
  c.inject_nan_steps = {3};
  Trainer t(c, nullptr);
  t.step();
  t.step();
  const std::vector<uint8_t> params = bytes_of(t.model().params().flat());
  const std::vector<uint8_t> m = bytes_of(t.optimizer().exp_avg().flat());
  try {
    t.step();
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("step 3"), std::string::npos) << w;
    EXPECT_NE(w.find("embedding.weight"), std::string::npos) << w;  // the poisoned tensor
    EXPECT_NE(w.find("--nan-policy skip"), std::string::npos) << w;
  }
  EXPECT_EQ(bytes_of(t.model().params().flat()), params);
  EXPECT_EQ(bytes_of(t.optimizer().exp_avg().flat()), m);
  EXPECT_EQ(t.optimizer().steps(), 2);
}

TEST(Trainer, NanPolicySkipCountsAndStops) {
  TrainConfig c = small_config();
  c.steps = 6;
  c.nan_policy = NanPolicy::kSkip;
  c.max_bad_steps = 2;
  c.inject_nan_steps = {2, 4};
  Trainer t(c, nullptr);
  const TrainSummary s = t.run();
  EXPECT_EQ(s.bad_steps, 2);
  EXPECT_EQ(t.optimizer().steps(), 4);
  EXPECT_TRUE(std::isnan(t.train_losses()[1]));
  EXPECT_TRUE(std::isfinite(s.final_train_loss));
  t.model().check_params_finite();

  c.inject_nan_steps = {1, 2, 3};
  Trainer t2(c, nullptr);
  try {
    t2.run();
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--max-bad-steps 2"), std::string::npos) << e.what();
  }
  EXPECT_EQ(t2.current_step(), 3);
}

TEST(Trainer, GradientAccumulationMatchesOneBatch) {
  // Two micro-batches of 2 sequences vs one batch of 4: the same data (the corpus source reads
  // rows in order), the same gradient up to float summation order.
  TrainConfig a = small_config();
  a.steps = 1;
  a.data.batch_size = 2;
  a.grad_accum = 2;
  TrainConfig b = small_config();
  b.steps = 1;
  Trainer ta(a, nullptr), tb(b, nullptr);
  const StepMetrics ma = ta.step(), mb = tb.step();
  EXPECT_NEAR(ma.loss, mb.loss, 1e-5);
  EXPECT_NEAR(ma.grad_norm, mb.grad_norm, 1e-4 * mb.grad_norm);
}

TEST(Trainer, TokenShardsWithHoldoutResumeBitExact) {
  // Two llm.c shards of corpus tokens; 10% of each held out for validation.
  const std::string dir = temp_dir("shards");
  fs::create_directories(dir + "/data");
  rl::SyntheticCorpus corpus;
  rl::CorpusReader reader(corpus, rl::CorpusSplit::kTrain);
  for (int s = 0; s < 2; ++s) {
    std::vector<int32_t> tokens(6000);
    reader.fill_tokens(std::span<int32_t>(tokens));
    io::write_token_shard(fmt::format("{}/data/train_{}.bin", dir, s), tokens, io::TokenWidth::kU16);
  }
  TrainConfig c = small_config();
  c.data.data = dir + "/data/*.bin";
  c.data.val_fraction = 0.1;
  c.sets.push_back("vocab=384");
  c.steps = 6;
  Trainer straight(c, nullptr);
  straight.run();
  EXPECT_LT(straight.summary().final_val_loss, std::log(384.0));

  TrainConfig c1 = c;
  c1.out_dir = dir + "/run";
  Trainer(c1, nullptr).run(2);
  Trainer second(c1, nullptr);
  second.resume(dir + "/run/checkpoint");
  second.run();
  EXPECT_EQ(std::memcmp(second.train_losses().data(), straight.train_losses().data(),
                        6 * sizeof(double)), 0);
  EXPECT_EQ(bytes_of(second.model().params().flat()), bytes_of(straight.model().params().flat()));
  // Data of another shard set is refused on resume.
  TrainConfig other = c1;
  other.data.data = dir + "/data/train_0.bin";
  Trainer t(other, nullptr);
  try {
    t.resume(dir + "/run/checkpoint");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("data.data"), std::string::npos) << e.what();
  }
  // A vocabulary smaller than the shards' tokens is refused when opening them.
  TrainConfig small_vocab = c;
  small_vocab.sets.back() = "vocab=128";
  EXPECT_THROW(Trainer(small_vocab, nullptr), Error);
  fs::remove_all(dir);
}

TEST(Trainer, StopFlagSavesAndResumeFinishesBitExact) {
  TrainConfig c = small_config();
  c.steps = 6;
  Trainer straight(c, nullptr);
  straight.run();
  const std::string dir = temp_dir("stop");
  TrainConfig c1 = c;
  c1.out_dir = dir;
  std::atomic<bool> stop{false};
  {
    Trainer t(c1, nullptr);
    t.set_stop_flag(&stop);
    t.step();
    t.step();
    stop.store(true);  // as the SIGINT handler of `fourbit pretrain` does
    const TrainSummary s = t.run();
    EXPECT_TRUE(s.interrupted);
    EXPECT_EQ(s.steps, 2);
  }
  EXPECT_EQ(read_checkpoint_info(dir + "/checkpoint").state.step, 2);
  Trainer r(c1, nullptr);
  r.resume(dir + "/checkpoint");
  const TrainSummary s = r.run();
  EXPECT_FALSE(s.interrupted);
  EXPECT_EQ(bytes_of(r.model().params().flat()), bytes_of(straight.model().params().flat()));
  fs::remove_all(dir);
}

// compare_recipes resolves every recipe before the first run: an unknown one fails at once,
// naming it, and no run (no output directory) was started.
TEST(Trainer, CompareRefusesAnUnknownRecipeBeforeAnyRun) {
  TrainConfig c = small_config();
  const std::string root = temp_dir("compare_unknown");
  try {
    compare_recipes(c, {"bf16", "no-such-recipe"}, root, nullptr);
    FAIL() << "an unknown recipe was accepted";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("no-such-recipe"), std::string::npos) << what;
    EXPECT_NE(what.find("no run was started"), std::string::npos) << what;
  }
  EXPECT_FALSE(fs::exists(fs::path(root) / "bf16"));
}

}  // namespace
}  // namespace fourbit::train
