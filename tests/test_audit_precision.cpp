// The precision audit (audit/audit.h): the error/bias definitions on known inputs, the full audit
// of small dense and MoE models (every GEMM of every stage observed, plain recipes measure zero,
// quantized ones the quantizer's error), an independent float64 recomputation of one quantized
// GEMM's output error, row sampling, and the sampled training audit.
#include "audit/audit.h"

#include "model_test_util.h"
#include "quant/quantize.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <map>

namespace fourbit::audit {
namespace {

using model::ModelConfig;
using model::testing::make_batch;
using recipe::Gemm;
using recipe::Stage;

model::ModelOptions cpu_options(uint64_t seed, int B, int T) {
  model::ModelOptions o;
  o.seed = seed;
  o.max_batch = B;
  o.max_seq = T;
  return o;
}

// Widths that are multiples of the NVFP4 / MXFP8 blocks.
ModelConfig dense_config() {
  ModelConfig c = model::testing::small_dense();
  c.d_model = 32;
  c.d_ff = 64;
  c.validate();
  return c;
}

ModelConfig moe_config() {
  ModelConfig c = model::testing::small_moe();
  c.d_model = 32;
  c.d_ff = 64;
  c.moe.expert_d_ff = 32;
  c.validate();
  return c;
}

recipe::ResolvedRecipe all_blocks(const ModelConfig& c, std::string_view name) {
  recipe::Recipe r = recipe::preset(name);
  r.high_precision.last_blocks = 0;
  return recipe::resolve(r, c.recipe_shape());
}

TEST(AuditStats, ErrorAndBiasDefinitions) {
  const std::vector<float> x = {1, -2, 3, 4};
  std::vector<float> shrunk(x.size()), ortho = {1 + 0.2f, -2 + 0.1f, 3, 4};
  for (size_t i = 0; i < x.size(); ++i) shrunk[i] = 0.9f * x[i];
  ErrorStats s;
  s.add(shrunk.data(), x.data(), 4);
  EXPECT_NEAR(s.rel_error(), 0.1, 1e-7);
  EXPECT_NEAR(s.rel_bias(), -0.1, 1e-7);  // shrinkage is negative
  // (0.2, 0.1, 0, 0) is orthogonal to x: no bias, error ||d|| / ||x||.
  ErrorStats o;
  o.add(ortho.data(), x.data(), 4);
  EXPECT_NEAR(o.rel_bias(), 0.0, 1e-7);
  EXPECT_NEAR(o.rel_error(), std::sqrt(0.05 / 30.0), 1e-7);
  // Pooling: merge equals adding both at once.
  ErrorStats both = s;
  both.merge(o);
  EXPECT_EQ(both.count, 8);
  EXPECT_NEAR(both.rel_error(), std::sqrt((0.01 * 30 + 0.05) / 60.0), 1e-7);
  ErrorStats zero;
  zero.add(x.data(), x.data(), 0);
  EXPECT_EQ(zero.rel_error(), 0.0);
}

std::map<Stage, std::map<Gemm, int>> counts(const AuditReport& r) {
  std::map<Stage, std::map<Gemm, int>> c;
  for (const GemmAudit& g : r.gemms) ++c[g.stage][g.gemm];
  return c;
}

TEST(AuditRun, PlainRecipeMeasuresZeroAndEveryGemmIsSeen) {
  const ModelConfig c = dense_config();
  const int B = 2, T = 16;
  model::Model m(c, all_blocks(c, "bf16"), cpu_options(3, B, T));
  const auto batch = make_batch(B, T, c.vocab, 5);
  const AuditReport r = run_audit(m, batch.tokens, batch.targets, {}, "bf16");
  // 2 blocks x (qkv, attn_out, mlp_up, mlp_down) + lm_head = 9 linear layers.
  const auto n = counts(r);
  EXPECT_EQ(n.at(Stage::kPretrainForward).at(Gemm::kFprop), 9);
  EXPECT_EQ(n.at(Stage::kPretrainBackward).at(Gemm::kDgrad), 9);
  EXPECT_EQ(n.at(Stage::kPretrainBackward).at(Gemm::kWgrad), 9);
  EXPECT_EQ(n.at(Stage::kRlTrainer).at(Gemm::kFprop), 9);
  EXPECT_EQ(n.at(Stage::kRlTrainer).at(Gemm::kWgrad), 9);
  EXPECT_EQ(n.at(Stage::kRlSampler).at(Gemm::kFprop), 9);
  EXPECT_EQ(r.gemms.size(), 9u * 7);
  for (const GemmAudit& g : r.gemms) {
    SCOPED_TRACE(g.layer);
    EXPECT_EQ(g.a.format, "plain");
    EXPECT_EQ(g.a.stats.rel_error(), 0.0);
    EXPECT_EQ(g.b.stats.rel_error(), 0.0);
    EXPECT_EQ(g.output.rel_error(), 0.0);
    EXPECT_GT(g.a.stats.sum_sq_ref, 0.0);
    EXPECT_GT(g.output.sum_sq_ref, 0.0);
  }
  // The model's gradients are left zero.
  for (double v : model::testing::values(m.grads().flat())) ASSERT_EQ(v, 0.0);
  // lm_head fprop: [B*T, d_model] x [vocab, d_model].
  const GemmAudit& head = r.gemms[8];
  EXPECT_EQ(head.layer, "lm_head");
  EXPECT_EQ(head.m, B * T);
  EXPECT_EQ(head.n, c.vocab);
  EXPECT_EQ(head.k, c.d_model);
}

TEST(AuditRun, Nvfp4ErrorsMatchTheQuantizerAndAFloat64Recomputation) {
  const ModelConfig c = dense_config();
  const int B = 2, T = 16;
  model::Model m(c, all_blocks(c, "nvfp4"), cpu_options(4, B, T));
  const auto batch = make_batch(B, T, c.vocab, 6);
  // Keep the operands of blocks.0.mlp_down's pretraining fprop for an independent recomputation.
  Tensor x_copy, w_copy;
  quant::QuantConfig xq, wq;
  GemmAuditor auditor;
  m.set_gemm_observer([&](const model::GemmObservation& obs) {
    if (obs.layer == "blocks.0.mlp_down" && obs.stage == Stage::kPretrainForward) {
      x_copy = Tensor::empty(obs.a.shape, DType::kF32, Device::kCpu);
      w_copy = Tensor::empty(obs.b.shape, DType::kF32, Device::kCpu);
      copy_tensor(x_copy.view(), obs.a);
      copy_tensor(w_copy.view(), obs.b);
      xq = *obs.recipe->fprop_x.quant;
      wq = *obs.recipe->fprop_w.quant;
    }
    auditor.observe(obs);
  });
  m.zero_grads();
  m.forward(batch.tokens, batch.targets);
  m.backward();
  m.set_gemm_observer({});
  const std::vector<GemmAudit> gemms = auditor.take();
  ASSERT_EQ(gemms.size(), 27u);
  for (const GemmAudit& g : gemms) {
    SCOPED_TRACE(g.layer + " " + std::string(recipe::gemm_name(g.gemm)));
    for (const OperandAudit* op : {&g.a, &g.b}) {
      if (op->format == "plain") continue;
      EXPECT_NE(op->format.find("nvfp4"), std::string::npos);
      // NVFP4's relative error on Gaussian-like data is ~0.1 (README: 0.095 RN, 0.137 SR).
      EXPECT_GT(op->stats.rel_error(), 0.02);
      EXPECT_LT(op->stats.rel_error(), 0.35);
      EXPECT_LE(std::abs(op->stats.rel_bias()), op->stats.rel_error());
    }
    if (g.a.format == "plain" && g.b.format == "plain") {
      EXPECT_EQ(g.output.rel_error(), 0.0);  // e.g. lm_head, high precision in every recipe
    } else {
      EXPECT_GT(g.output.rel_error(), 1e-3);
      EXPECT_LT(g.output.rel_error(), 0.5);
    }
  }
  // Wgrad operands are column-wise (quantized along the tokens), Dgrad's weight too.
  for (const GemmAudit& g : gemms) {
    if (g.gemm == Gemm::kWgrad) {
      EXPECT_TRUE(g.a.colwise && g.b.colwise);
    }
    if (g.gemm == Gemm::kDgrad) {
      EXPECT_TRUE(!g.a.colwise && g.b.colwise);
    }
  }
  // Round-to-nearest weights shrink: the mean bias of the fprop weights is negative.
  double bias = 0;
  int n = 0;
  for (const GemmAudit& g : gemms) {
    if (g.gemm == Gemm::kFprop && g.b.format != "plain" && g.b.format.find("sr") == std::string::npos)
      bias += g.b.stats.rel_bias(), ++n;
  }
  ASSERT_GT(n, 0);
  EXPECT_LT(bias / n, 0.0);

  // Independent: float64 products of the dequantized operands vs of the originals.
  ASSERT_TRUE(x_copy.defined());
  const GemmAudit* down = nullptr;
  for (const GemmAudit& g : gemms)
    if (g.layer == "blocks.0.mlp_down" && g.gemm == Gemm::kFprop) down = &g;
  ASSERT_NE(down, nullptr);
  // The model's fprop draws operand i from stream sr.stream + i; both are round-to-nearest here.
  ASSERT_EQ(xq.rounding, quant::Rounding::kNearest);
  ASSERT_EQ(wq.rounding, quant::Rounding::kNearest);
  const Tensor xd = quant::dequantize_to_source_reference(quant::quantize_reference(x_copy, xq, {true, false}, {}), false);
  const Tensor wd = quant::dequantize_to_source_reference(quant::quantize_reference(w_copy, wq, {true, false}, {}), false);
  const int64_t M = x_copy.shape()[0], K = x_copy.shape()[1], N = w_copy.shape()[0];
  double sd = 0, sr = 0, dot = 0, sx = 0, sxd = 0;
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double yq = 0, y = 0;
      for (int64_t k = 0; k < K; ++k) {
        yq += (double)xd.ptr<float>()[i * K + k] * wd.ptr<float>()[j * K + k];
        y += (double)x_copy.ptr<float>()[i * K + k] * w_copy.ptr<float>()[j * K + k];
      }
      sd += (yq - y) * (yq - y);
      sr += y * y;
      dot += (yq - y) * y;
    }
  }
  for (int64_t i = 0; i < M * K; ++i) {
    const double d = (double)xd.ptr<float>()[i] - x_copy.ptr<float>()[i];
    sx += d * d;
    sxd += (double)x_copy.ptr<float>()[i] * x_copy.ptr<float>()[i];
  }
  EXPECT_NEAR(down->output.rel_error(), std::sqrt(sd / sr), 1e-4 * std::sqrt(sd / sr));
  EXPECT_NEAR(down->output.rel_bias(), dot / sr, 1e-4);
  EXPECT_DOUBLE_EQ(down->a.stats.rel_error(), std::sqrt(sx / sxd));
}

TEST(AuditRun, MoeExpertsAndTheReport) {
  const ModelConfig c = moe_config();
  const int B = 2, T = 16;
  model::Model m(c, all_blocks(c, "nvfp4"), cpu_options(7, B, T));
  const auto batch = make_batch(B, T, c.vocab, 8);
  AuditOptions o;
  o.stages = {Stage::kPretrainForward, Stage::kPretrainBackward};
  const AuditReport r = run_audit(m, batch.tokens, batch.targets, o, "nvfp4");
  int expert_gemms = 0;
  for (const GemmAudit& g : r.gemms) {
    EXPECT_TRUE(g.stage == Stage::kPretrainForward || g.stage == Stage::kPretrainBackward);
    if (g.groups > 1) {
      ++expert_gemms;
      EXPECT_EQ(g.groups, c.moe.n_experts);
      EXPECT_TRUE(std::isfinite(g.output.rel_error()));
      EXPECT_GT(g.b.stats.count, 0);
    }
  }
  EXPECT_EQ(expert_gemms, 2 * 3);  // expert_up and expert_down: fprop, dgrad, wgrad
  const std::string table = r.table();
  EXPECT_NE(table.find("blocks.1.expert_up"), std::string::npos);
  EXPECT_NE(table.find("== pretrain_backward =="), std::string::npos);
  EXPECT_NE(table.find("summary"), std::string::npos);
  const nlohmann::json j = r.to_json();
  EXPECT_EQ(j["stages"]["pretrain_forward"].size() + j["stages"]["pretrain_backward"].size(), r.gemms.size());
  EXPECT_TRUE(j["stages"]["pretrain_forward"][0]["operands"][0].contains("rel_bias"));
  EXPECT_FALSE(j["summary"].empty());
}

TEST(AuditTraining, SampledEveryNStepsOnASubsetOfLayersAndRows) {
  const ModelConfig c = dense_config();
  const int B = 2, T = 16;
  model::Model m(c, all_blocks(c, "nvfp4"), cpu_options(9, B, T));
  const auto batch = make_batch(B, T, c.vocab, 10);
  TrainingAuditOptions o;
  o.every = 2;
  o.max_rows = 16;
  o.layer_stride = 3;
  TrainingAudit audit(o);
  std::vector<TrainingAuditMetrics> got;
  for (uint64_t step = 1; step <= 4; ++step) {
    const bool on = audit.begin_step(m, step);
    EXPECT_EQ(on, step % 2 == 0);
    m.zero_grads();
    model::ForwardOptions fo;
    fo.step = step;
    m.forward(batch.tokens, batch.targets, fo);
    m.backward();
    const auto metrics = audit.end_step(m);
    EXPECT_EQ(metrics.has_value(), on);
    if (metrics) got.push_back(*metrics);
  }
  ASSERT_EQ(got.size(), 2u);
  for (const TrainingAuditMetrics& mt : got) {
    EXPECT_EQ(mt.gemms, 9);  // 27 GEMM calls, one in 3
    double max_out = 0;
    for (const auto& p : mt.per_gemm) max_out = std::max(max_out, p.max_output_error);
    EXPECT_GT(max_out, 1e-3);
    const nlohmann::json j = mt.to_json();
    EXPECT_EQ(j["audit/step"], mt.step);
    EXPECT_FALSE(mt.line().empty());
  }
  EXPECT_THROW(TrainingAudit({.every = 0}), Error);
  // Row sampling: 32 token rows, 16 measured.
  GemmAuditor auditor(GemmAuditor::Options{16, 1, 0});
  auditor.attach(m);
  m.forward(batch.tokens, batch.targets);
  GemmAuditor::detach(m);
  for (const GemmAudit& g : auditor.results()) EXPECT_EQ(g.rows_used, 16);
}

}  // namespace
}  // namespace fourbit::audit
