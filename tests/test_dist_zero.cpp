// ZeRO-1 (dist/zero_optimizer.h) with the in-process communicator: R = 1..4 ranks, each with a
// different slice of the batch, must reach the parameters of ONE rank training on the whole batch
// with train::AdamW; each rank keeps ~1/R of the optimizer memory; a non-finite gradient on one
// rank changes nothing on any rank.
//
// Tolerances. The ranks' gradient sum differs from the one-rank gradient only in the order of
// floating-point additions (per-rank partial sums over tokens, then a rank-order sum), i.e. by a
// few ulps of each gradient element; AdamW's normalized update m / (sqrt(v) + eps) turns a
// relative gradient error e into an update error of about lr * e. So in float64 the parameters
// agree to ~1e-14 relative (we allow 1e-10 * lr = 1e-12 absolute; measured <= 1e-14); in float32 to ~1e-6 * lr, except that
// an element whose gradient is pure rounding noise (|g| ~ 1e-7 |typical g|) can get a different
// sign and move by up to 2 lr per step: the f32 check allows 5e-3 * lr per element on all but
// 0.1% of the elements and bounds the rest by 2 lr * K.
#include "dist/in_process_communicator.h"
#include "dist/zero_optimizer.h"
#include "model_test_util.h"
#include "train/optimizer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <mutex>

namespace fourbit::dist {
namespace {

using model::Model;
using model::ModelConfig;
using model::ModelOptions;

constexpr int kB = 2, kT = 8;

ModelOptions options(DType dtype, int max_batch) {
  ModelOptions o;
  o.cpu_dtype = dtype;
  o.seed = 11;
  o.max_batch = max_batch;
  return o;
}

train::AdamWConfig adamw(double clip) {
  train::AdamWConfig c;
  c.weight_decay = 0.1;
  c.grad_clip = clip;
  return c;
}

TensorView rows(const Tensor& t, int64_t first, int64_t n) {
  return TensorView::contiguous(t.ptr<int32_t>() + first * kT, DType::kI32, {n, kT}, Device::kCpu);
}

std::vector<double> flat_values(const TensorView& v) { return model::testing::values(v); }

struct Case {
  int R, accum, steps;
  DType dtype;
  double clip;
};

// One rank on the whole batch; returns the final master weights.
std::vector<double> single_rank(const ModelConfig& c, const Case& k, const model::testing::Batch& batch) {
  const int n = k.R * k.accum * kB;
  Model m(c, model::testing::resolved(c), options(k.dtype, n));
  train::AdamW opt(m, adamw(k.clip));
  for (int s = 0; s < k.steps; ++s) {
    m.zero_grads();
    m.forward(batch.tokens, batch.targets);
    m.backward();
    const train::StepResult r = opt.step(1e-2);
    EXPECT_TRUE(r.applied);
  }
  return flat_values(m.params().flat());
}

// R ranks, rank r's micro-batch a is block r * accum + a of kB rows; returns every rank's weights.
std::vector<std::vector<double>> zero_ranks(const ModelConfig& c, const Case& k,
                                            const model::testing::Batch& batch,
                                            std::vector<int64_t>* state_bytes) {
  std::vector<std::vector<double>> out((size_t)k.R);
  state_bytes->assign((size_t)k.R, 0);
  run_ranks(k.R, [&](Communicator& comm) {
    Model m(c, model::testing::resolved(c), options(k.dtype, kB));
    ZeroAdamW opt(m, comm, adamw(k.clip));
    for (int s = 0; s < k.steps; ++s) {
      m.zero_grads();
      for (int a = 0; a < k.accum; ++a) {
        const int64_t block = comm.rank() * k.accum + a;
        m.forward(rows(batch.tokens, block * kB, kB), rows(batch.targets, block * kB, kB));
        model::BackwardOptions bo;
        bo.loss_scale = 1.0 / (k.R * k.accum);
        m.backward(bo);
      }
      const train::StepResult r = opt.step(1e-2);
      EXPECT_TRUE(r.applied);
    }
    out[(size_t)comm.rank()] = flat_values(m.params().flat());
    (*state_bytes)[(size_t)comm.rank()] = opt.state_bytes();
  });
  return out;
}

void check_case(const Case& k) {
  SCOPED_TRACE(fmt::format("R {} accum {} steps {} {} clip {}", k.R, k.accum, k.steps,
                           dtype_name(k.dtype), k.clip));
  const ModelConfig c = model::testing::small_dense(/*tied=*/false);
  // No ignored targets: the mean loss over the whole batch is then exactly the mean of the
  // micro-batches' means, which is what loss_scale 1 / (R accum) sums.
  const model::testing::Batch batch = model::testing::make_batch(k.R * k.accum * kB, kT, c.vocab, 5, 0);
  const std::vector<double> ref = single_rank(c, k, batch);
  std::vector<int64_t> state_bytes;
  const std::vector<std::vector<double>> got = zero_ranks(c, k, batch, &state_bytes);
  const double lr = 1e-2;
  for (int r = 0; r < k.R; ++r) {
    ASSERT_EQ(got[(size_t)r].size(), ref.size());
    // Every rank holds the same weights after the all-gather, bit for bit.
    EXPECT_EQ(got[(size_t)r], got[0]) << "rank " << r << " differs from rank 0";
  }
  double worst = 0;
  int64_t loose = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = std::abs(got[0][i] - ref[i]);
    worst = std::max(worst, d);
    if (k.dtype == DType::kF64) {
      ASSERT_LE(d, 1e-10 * lr) << "element " << i;
    } else {
      ASSERT_LE(d, 2 * lr * k.steps) << "element " << i;
      if (d > 5e-3 * lr) ++loose;
    }
  }
  if (k.dtype == DType::kF32) {
    EXPECT_LE(loose, (int64_t)ref.size() / 1000) << "worst " << worst;
  }
  // The moments: 2 x (shard size) elements per rank, ~1/R of the 2 x total of train::AdamW.
  const int64_t elem = k.dtype == DType::kF64 ? 8 : 4;
  const model::ParamTable table = model::ParamTable::build(c);
  const int64_t full = 2 * table.total_elements() * elem;
  int64_t sum = 0;
  for (int r = 0; r < k.R; ++r) {
    sum += state_bytes[(size_t)r];
    const int64_t per = (table.total_elements() + k.R - 1) / k.R;
    EXPECT_LE(state_bytes[(size_t)r], 2 * (per + model::ParamTable::kAlignElements) * elem)
        << "rank " << r << " holds more than its share of the optimizer state";
  }
  EXPECT_EQ(sum, full);
  std::printf("R %d accum %d %s clip %.2f: max |param - one-rank param| = %.3g (lr %.0e), "
              "optimizer bytes per rank %lld of %lld\n",
              k.R, k.accum, std::string(dtype_name(k.dtype)).c_str(), k.clip, worst, lr,
              (long long)state_bytes[0], (long long)full);
}

TEST(DistZero, PartitionCoversTheFlatSpaceInAlignedShards) {
  for (int world = 1; world <= 5; ++world) {
    for (int64_t total : {0LL, 64LL, 640LL, 6464LL}) {
      const FlatPartition p = FlatPartition::even(total, world, 64);
      int64_t next = 0;
      for (int r = 0; r < world; ++r) {
        EXPECT_EQ(p.offsets[(size_t)r], next);
        EXPECT_EQ(p.offsets[(size_t)r] % 64, 0);
        next += p.counts[(size_t)r];
      }
      EXPECT_EQ(next, total);
    }
  }
}

TEST(DistZero, F64MatchesOneRankOnTheWholeBatch) {
  for (int R = 1; R <= 4; ++R) check_case({R, 1, 3, DType::kF64, 1.0});
}

TEST(DistZero, F64GradAccumAndClipping) {
  // clip 0.05: the global norm (about 1 here) is clipped at every step, so a wrong cross-shard
  // norm would show.
  for (int R : {2, 3}) check_case({R, 2, 3, DType::kF64, 0.05});
}

TEST(DistZero, F32MatchesOneRankOnTheWholeBatch) {
  for (int R = 1; R <= 4; ++R) check_case({R, 1, 3, DType::kF32, 1.0});
  check_case({3, 2, 3, DType::kF32, 0.05});
}

TEST(DistZero, NonFiniteGradientOnOneRankChangesNothingAnywhere) {
  const ModelConfig c = model::testing::small_dense(false);
  const model::testing::Batch batch = model::testing::make_batch(3 * kB, kT, c.vocab, 7, 0);
  run_ranks(3, [&](Communicator& comm) {
    Model m(c, model::testing::resolved(c), options(DType::kF32, kB));
    ZeroAdamW opt(m, comm, adamw(1.0));
    auto train_step = [&](bool poison) {
      m.zero_grads();
      m.forward(rows(batch.tokens, comm.rank() * kB, kB), rows(batch.targets, comm.rank() * kB, kB));
      model::BackwardOptions bo;
      bo.loss_scale = 1.0 / 3;
      m.backward(bo);
      if (poison && comm.rank() == 1) m.grads().view(2).ptr<float>()[3] = std::numeric_limits<float>::quiet_NaN();
      return opt.step(1e-2);
    };
    ASSERT_TRUE(train_step(false).applied);
    const std::vector<double> p0 = flat_values(m.params().flat());
    const std::vector<double> m0 = flat_values(opt.exp_avg_shard()), v0 = flat_values(opt.exp_avg_sq_shard());
    const train::StepResult r = train_step(true);
    EXPECT_FALSE(r.applied) << "rank " << comm.rank();
    EXPECT_FALSE(std::isfinite(r.grad_norm));
    EXPECT_EQ(opt.steps(), 1);
    EXPECT_EQ(flat_values(m.params().flat()), p0) << "rank " << comm.rank();
    EXPECT_EQ(flat_values(opt.exp_avg_shard()), m0);
    EXPECT_EQ(flat_values(opt.exp_avg_sq_shard()), v0);
    // And the next clean step applies again on every rank.
    EXPECT_TRUE(train_step(false).applied);
    EXPECT_EQ(opt.steps(), 2);
  });
}

}  // namespace
}  // namespace fourbit::dist
