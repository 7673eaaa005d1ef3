// model config and parameter table (cpu): presets and their parameter counts, validation messages
// that name the field, --set, JSON round trips, the table's layout, initialization (seeded,
// identical across dtypes, the documented standard deviations).
#include "model/config.h"
#include "model/params.h"

#include "model_test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>

namespace fourbit::model {
namespace {

using testing::small_moe;

void expect_error_naming(const std::function<void()>& f, const std::string& field) {
  try {
    f();
    ADD_FAILURE() << "expected an error naming " << field;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
  }
}

TEST(ModelConfig, PresetsValidateAndHaveTheirParameterCounts) {
  for (std::string_view name : preset_names()) {
    const ModelConfig c = preset(name);
    EXPECT_EQ(c.name, name);
    EXPECT_NO_THROW(c.validate());
    EXPECT_NO_THROW(ParamTable::build(c));
  }
  // GPT-2 small's shape: 123.6M with the padded vocabulary (GPT-2's 124.4M minus the learned
  // positions, plus the padding rows).
  const ParamTable gpt2 = ParamTable::build(preset("gpt2-124m"));
  EXPECT_EQ(gpt2.n_params(), 50304LL * 768 + 12LL * (2 * 768 + 3 * 768 * 768 + 768 * 768 + 3 * 768 * 2048) + 768);
  EXPECT_NEAR((double)gpt2.n_params(), 123.6e6, 0.1e6);
  // SwiGLU at d_ff 2048 has exactly the parameters of GPT-2's 4d GELU MLP.
  EXPECT_EQ(3 * 768 * 2048, 2 * 768 * 3072);
  // The MoE preset: the active parameters match gpt2-124m's, plus the routers.
  const ModelConfig moe = preset("gpt2-124m-moe8");
  const ParamTable moe_table = ParamTable::build(moe);
  EXPECT_EQ(moe.moe.expert_d_ff * moe.moe.top_k, preset("gpt2-124m").d_ff);
  EXPECT_EQ(moe_table.n_active_params(), gpt2.n_params() + 12LL * 8 * 768);
  EXPECT_EQ(moe_table.n_params(), gpt2.n_params() + 12LL * (8 * 3 * 768 * 1024 - 3 * 768 * 2048 + 8 * 768));
  EXPECT_EQ(preset("1.3b").head_dim(), 128);
  EXPECT_EQ(ParamTable::build(preset("1.3b")).n_params(), 1317373952);
  EXPECT_EQ(ParamTable::build(preset("350m")).n_params(), 350405632);
  EXPECT_EQ(preset("tiny").head_dim(), 64);
}

TEST(ModelConfig, ValidationNamesTheField) {
  ModelConfig c = preset("tiny");
  c.n_kv_heads = 3;
  expect_error_naming([&] { c.validate(); }, "n_kv_heads");
  c = preset("tiny");
  c.n_heads = 5;
  expect_error_naming([&] { c.validate(); }, "n_heads");
  c = preset("tiny");
  c.d_model = 4 * 6;  // head_dim 6 is fine; 4 * 5 = 20 -> head_dim 5 is odd
  EXPECT_NO_THROW(c.validate());
  c.d_model = 20;
  expect_error_naming([&] { c.validate(); }, "even");
  c = preset("moe-tiny");
  c.moe.top_k = 9;
  expect_error_naming([&] { c.validate(); }, "moe.top_k");
  c = preset("moe-tiny");
  c.moe.layers = {3, 1};
  expect_error_naming([&] { c.validate(); }, "moe.layers");
  c = preset("moe-tiny");
  c.moe.layers = {4};
  expect_error_naming([&] { c.validate(); }, "moe.layers");
  c = preset("moe-tiny");
  c.moe.n_shared_experts = 2;
  expect_error_naming([&] { c.validate(); }, "moe.n_shared_experts");
  c = preset("tiny");
  c.moe.n_experts = 4;
  expect_error_naming([&] { c.validate(); }, "moe.n_experts");
  expect_error_naming([] { preset("gpt5"); }, "tiny");
}

TEST(ModelConfig, SetsAndJsonRoundTrip) {
  ModelConfig c = preset("tiny");
  apply_sets(c, {"n_layers=6", "moe.layers=1,3-5", "moe.n_experts=8", "moe.top_k=2",
                 "moe.expert_d_ff=128", "moe.load_balancing=bias", "tied_embeddings=false",
                 "rope_theta=500000"});
  EXPECT_EQ(c.n_layers, 6);
  EXPECT_EQ(c.moe.layers, (std::vector<int>{1, 3, 4, 5}));
  EXPECT_EQ(c.moe.load_balancing, LoadBalancing::kBias);
  EXPECT_FALSE(c.tied_embeddings);
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.name, "tiny+set");
  const nlohmann::json j = to_json(c);
  EXPECT_EQ(config_from_json(j), c);
  EXPECT_EQ(config_from_json(nlohmann::json::parse(j.dump())), c);
  for (std::string_view name : preset_names()) EXPECT_EQ(config_from_json(to_json(preset(name))), preset(name));
  ModelConfig all = preset("tiny");
  apply_sets(all, {"moe.layers=all", "moe.n_experts=4", "moe.top_k=1", "moe.expert_d_ff=64"});
  EXPECT_EQ(all.moe.layers, (std::vector<int>{0, 1, 2, 3}));

  expect_error_naming([&] { apply_set(c, "d_modl=3"); }, "d_modl");
  expect_error_naming([&] { apply_set(c, "d_model=abc"); }, "d_model");
  expect_error_naming([&] { apply_set(c, "moe.load_balancing=random"); }, "moe.load_balancing");
  nlohmann::json bad = to_json(preset("tiny"));
  bad["n_kv_head"] = 2;
  expect_error_naming([&] { config_from_json(bad); }, "n_kv_head");
  bad = to_json(preset("tiny"));
  bad["n_kv_heads"] = 3;
  expect_error_naming([&] { config_from_json(bad); }, "n_kv_heads");
  EXPECT_NE(settable_keys_help().find("moe.z_loss_coef"), std::string::npos);
  EXPECT_NE(describe(preset("moe-tiny")).find("moe.top_k"), std::string::npos);
}

TEST(ModelParams, TableLayoutKindsAndDecay) {
  const ModelConfig c = small_moe(LoadBalancing::kBias);
  const ParamTable t = ParamTable::build(c);
  const int64_t C = c.d_model;
  EXPECT_EQ(t.find("embedding.weight").shape, (Shape{c.vocab, C}));
  EXPECT_EQ(t.find("blocks.0.attn.qkv.weight").shape, (Shape{(2 + 2 * 1) * 8, C}));
  EXPECT_EQ(t.find("blocks.0.attn.out.weight").shape, (Shape{C, 16}));
  EXPECT_EQ(t.find("blocks.0.mlp.up.weight").shape, (Shape{2 * c.d_ff, C}));
  EXPECT_EQ(t.find("blocks.1.moe.experts.up.weight").shape, (Shape{4, 24, C}));
  EXPECT_EQ(t.find("blocks.1.moe.experts.down.weight").shape, (Shape{4, C, 12}));
  EXPECT_EQ(t.find("blocks.1.moe.shared.up.weight").shape, (Shape{24, C}));
  EXPECT_EQ(t.find("blocks.1.moe.router.weight").kind, ParamKind::kRouter);
  EXPECT_FALSE(t.find("blocks.1.moe.router.bias").trainable);
  EXPECT_EQ(t.find("blocks.1.moe.experts.up.weight").linear_kind, recipe::LinearKind::kExpertUp);
  EXPECT_EQ(t.find("blocks.1.moe.shared.down.weight").linear_kind, recipe::LinearKind::kMlpDown);
  EXPECT_FALSE(t.find("embedding.weight").weight_decay);
  EXPECT_FALSE(t.find("final_norm.weight").weight_decay);
  EXPECT_TRUE(t.find("blocks.0.attn.qkv.weight").weight_decay);
  EXPECT_THROW(t.find("lm_head.weight"), Error);  // tied
  EXPECT_NO_THROW(ParamTable::build(testing::small_dense(false)).find("lm_head.weight"));
  // Offsets are aligned, increasing and non-overlapping.
  int64_t end = 0;
  for (const ParamSpec& p : t.rows()) {
    EXPECT_EQ(p.offset % ParamTable::kAlignElements, 0) << p.name;
    EXPECT_GE(p.offset, end) << p.name;
    end = p.offset + p.numel();
  }
  EXPECT_LE(end, t.total_elements());
  EXPECT_NE(t.table().find("blocks.1.moe.router.bias"), std::string::npos);
}

TEST(ModelParams, InitializationIsSeededAndIdenticalAcrossDtypes) {
  const ModelConfig c = preset("tiny");
  const ParamTable t = ParamTable::build(c);
  ParamBuffer a(t, DType::kF32, Device::kCpu), b(t, DType::kF32, Device::kCpu), d(t, DType::kF64, Device::kCpu);
  ParamBuffer other(t, DType::kF32, Device::kCpu);
  init_params(t, a, 7);
  init_params(t, b, 7);
  init_params(t, d, 7);
  init_params(t, other, 8);
  EXPECT_EQ(std::memcmp(a.flat().data, b.flat().data, (size_t)a.flat().nbytes()), 0);
  EXPECT_NE(std::memcmp(a.flat().data, other.flat().data, (size_t)a.flat().nbytes()), 0);
  for (int64_t i = 0; i < t.total_elements(); ++i)
    ASSERT_EQ((double)a.flat().ptr<float>()[i], d.flat().ptr<double>()[i]) << "element " << i;
  // Standard deviations: 0.02, residual projections 0.02 / sqrt(2 L); norms are ones.
  auto stddev = [&](std::string_view name) {
    const TensorView v = a.view(t.index_of(name));
    double s = 0, s2 = 0;
    for (int64_t i = 0; i < v.numel(); ++i) {
      s += v.ptr<float>()[i];
      s2 += (double)v.ptr<float>()[i] * v.ptr<float>()[i];
    }
    const double mean = s / v.numel();
    return std::sqrt(s2 / v.numel() - mean * mean);
  };
  EXPECT_NEAR(stddev("blocks.0.attn.qkv.weight"), 0.02, 0.0005);
  EXPECT_NEAR(stddev("blocks.2.mlp.down.weight"), 0.02 / std::sqrt(8.0), 0.0003);
  EXPECT_NEAR(stddev("embedding.weight"), 0.02, 0.0005);
  const TensorView norm = a.view(t.index_of("blocks.1.mlp_norm.weight"));
  for (int64_t i = 0; i < norm.numel(); ++i) EXPECT_EQ(norm.ptr<float>()[i], 1.0f);
  EXPECT_EQ(a.view(t.index_of("blocks.0.attn.qkv.weight")).ptr<float>()[5],
            (float)init_normal_value(7, "blocks.0.attn.qkv.weight", 5, 0.02));
}

}  // namespace
}  // namespace fourbit::model
