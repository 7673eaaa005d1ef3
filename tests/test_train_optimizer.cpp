// train/optimizer.h: the learning-rate schedules' values, the weight-decay mask, the update against
// ops::adamw_update applied by hand (clipping included), and a non-finite gradient leaving every
// parameter, moment and the step count untouched.
#include "train/optimizer.h"

#include "model_test_util.h"
#include "ops/adamw.h"

#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <numbers>

namespace fourbit::train {
namespace {

using model::testing::small_dense;
using model::testing::small_moe;
using model::testing::resolved;

TEST(Schedule, CosineWarmupValues) {
  Schedule s{ScheduleKind::kCosine, 1.0, 0.1, 10, 110, 0.2};
  s.validate();
  EXPECT_DOUBLE_EQ(s.at(0), 0.1);
  EXPECT_DOUBLE_EQ(s.at(4), 0.5);
  EXPECT_DOUBLE_EQ(s.at(9), 1.0);
  EXPECT_DOUBLE_EQ(s.at(10), 1.0);                       // p = 0
  EXPECT_NEAR(s.at(60), 0.1 + 0.9 * 0.5, 1e-15);         // p = 1/2
  EXPECT_NEAR(s.at(35), 0.1 + 0.45 * (1 + std::cos(std::numbers::pi / 4)), 1e-15);
  EXPECT_DOUBLE_EQ(s.at(110), 0.1);
  EXPECT_DOUBLE_EQ(s.at(1000), 0.1);
  for (int64_t i = 10; i < 110; ++i) EXPECT_LE(s.at(i + 1), s.at(i));
}

TEST(Schedule, WsdAndConstantValues) {
  Schedule s{ScheduleKind::kWsd, 2.0, 0.0, 5, 100, 0.2};
  EXPECT_DOUBLE_EQ(s.at(0), 0.4);
  EXPECT_DOUBLE_EQ(s.at(5), 2.0);
  EXPECT_DOUBLE_EQ(s.at(79), 2.0);                       // decay starts at 100 - 20 = 80
  EXPECT_DOUBLE_EQ(s.at(80), 2.0 - 2.0 * 1.0 / 20);
  EXPECT_DOUBLE_EQ(s.at(89), 1.0);
  EXPECT_DOUBLE_EQ(s.at(99), 0.0);
  Schedule c{ScheduleKind::kConstant, 0.5, 0.0, 0, 10, 0.2};
  EXPECT_DOUBLE_EQ(c.at(0), 0.5);
  EXPECT_DOUBLE_EQ(c.at(50), 0.5);
  EXPECT_EQ(parse_schedule_kind("wsd"), ScheduleKind::kWsd);
  EXPECT_THROW(parse_schedule_kind("linear"), Error);
  Schedule bad = s;
  bad.min_lr = 3.0;
  try {
    bad.validate();
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("min_lr"), std::string::npos);
  }
  EXPECT_EQ(schedule_from_json(to_json(s)).at(85), s.at(85));
}

TEST(AdamW, DecayMask) {
  const model::ModelConfig c = small_moe(model::LoadBalancing::kBias);
  model::Model m(c, resolved(c), {});
  AdamW opt(m, {});
  AdamW opt_emb(m, AdamWConfig{.decay_embeddings = true});
  const model::ParamTable& t = m.table();
  int n_decay = 0;
  for (int i = 0; i < t.size(); ++i) {
    const model::ParamSpec& s = t.row(i);
    const bool expect = s.kind == model::ParamKind::kLinear || s.kind == model::ParamKind::kRouter ||
                        s.kind == model::ParamKind::kExpert || s.kind == model::ParamKind::kLmHead;
    EXPECT_EQ(opt.decays(i), expect) << s.name;
    EXPECT_EQ(opt_emb.decays(i), expect || s.kind == model::ParamKind::kEmbedding) << s.name;
    n_decay += expect;
  }
  EXPECT_GT(n_decay, 4);
  EXPECT_FALSE(opt.decays(t.index_of("final_norm.weight")));
  EXPECT_FALSE(opt.decays(t.index_of("embedding.weight")));
  EXPECT_FALSE(opt.decays(t.index_of("blocks.1.moe.router.bias")));
}

std::vector<float> host(const TensorView& v) {
  std::vector<float> out((size_t)v.numel());
  std::memcpy(out.data(), v.data, out.size() * sizeof(float));
  return out;
}

TEST(AdamW, StepMatchesOpsWithClippingAndMask) {
  const model::ModelConfig c = small_dense(false);
  model::Model m(c, resolved(c), model::ModelOptions{.max_batch = 2});
  model::testing::Batch b = model::testing::make_batch(2, 8, c.vocab, 7);
  m.forward(b.tokens, b.targets);
  m.backward();
  // The expected update by hand, on copies.
  model::ParamBuffer p(m.table(), DType::kF32, Device::kCpu), g(m.table(), DType::kF32, Device::kCpu);
  copy_tensor(p.flat(), m.params().flat());
  copy_tensor(g.flat(), m.grads().flat());
  double sum = 0;
  for (int i = 0; i < m.table().size(); ++i)
    for (float x : host(g.view(i))) sum += (double)x * x;
  const double norm = std::sqrt(sum);
  const AdamWConfig cfg{.weight_decay = 0.5, .grad_clip = norm / 3};
  AdamW opt(m, cfg);
  const StepResult r = opt.step(1e-2);
  ASSERT_TRUE(r.applied);
  EXPECT_NEAR(r.grad_norm, norm, 1e-6 * norm);
  EXPECT_NEAR(r.clip_scale, 1.0 / 3, 1e-5);
  EXPECT_EQ(opt.steps(), 1);
  for (int i = 0; i < m.table().size(); ++i) {
    const model::ParamSpec& s = m.table().row(i);
    Tensor mm = Tensor::zeros(s.shape, DType::kF32, Device::kCpu);
    Tensor vv = Tensor::zeros(s.shape, DType::kF32, Device::kCpu);
    ops::AdamWParams a;
    a.lr = 1e-2f;
    a.weight_decay = opt.decays(i) ? 0.5f : 0.0f;
    a.grad_scale = ops::clip_grad_scale((float)r.grad_norm, (float)cfg.grad_clip);
    ops::adamw_update(p.view(i), g.view(i), mm, vv, {}, a);
    EXPECT_EQ(host(p.view(i)), host(m.params().view(i))) << s.name;
    EXPECT_EQ(host(mm), host(opt.exp_avg().view(i))) << s.name;
    EXPECT_EQ(host(vv), host(opt.exp_avg_sq().view(i))) << s.name;
  }
}

TEST(AdamW, NonFiniteGradientChangesNothing) {
  const model::ModelConfig c = small_dense();
  model::Model m(c, resolved(c), model::ModelOptions{.max_batch = 2});
  model::testing::Batch b = model::testing::make_batch(2, 8, c.vocab, 3);
  AdamW opt(m, {});
  m.forward(b.tokens, b.targets);
  m.backward();
  ASSERT_TRUE(opt.step(1e-3).applied);
  const std::vector<float> p0 = host(m.params().flat()), m0 = host(opt.exp_avg().flat()),
                           v0 = host(opt.exp_avg_sq().flat());
  m.zero_grads();
  m.forward(b.tokens, b.targets);
  m.backward();
  m.grads().view(3).ptr<float>()[1] = std::numeric_limits<float>::quiet_NaN();
  const StepResult r = opt.step(1e-3);
  EXPECT_FALSE(r.applied);
  EXPECT_TRUE(std::isnan(r.grad_norm));
  EXPECT_EQ(opt.steps(), 1);
  EXPECT_EQ(host(m.params().flat()), p0);
  EXPECT_EQ(host(opt.exp_avg().flat()), m0);
  EXPECT_EQ(host(opt.exp_avg_sq().flat()), v0);
}

}  // namespace
}  // namespace fourbit::train
