// recipe (cpu): every preset resolves as presets.cpp documents it (spot checks of each preset's key
// choices, and the gemm module's own presets as an independent statement of the same recipes); the
// high-precision exceptions (tail blocks with the rounding rule, first blocks, router, lm_head);
// resolution for dense and MoE shapes; what linear() returns per stage.
#include "recipe/recipe.h"
#include "recipe_test_util.h"

#include <gtest/gtest.h>

namespace fourbit::recipe {
namespace {

using quant::Format;
using quant::Rounding;
using testing::config;
using testing::dense;
using testing::expect_error;

constexpr Rounding kRn = Rounding::kNearest;
constexpr Rounding kSr = Rounding::kStochastic;

void expect_same(const gemm::OperandRecipe& got, const Precision& want, const char* what) {
  EXPECT_TRUE(same_precision(got.quant, want))
      << what << ": got " << describe(got.quant) << ", want " << describe(want);
}

void expect_same(const gemm::LinearRecipe& got, const gemm::LinearRecipe& want) {
  expect_same(got.fprop_x, want.fprop_x.quant, "fprop_x");
  expect_same(got.fprop_w, want.fprop_w.quant, "fprop_w");
  expect_same(got.dgrad_dy, want.dgrad_dy.quant, "dgrad_dy");
  expect_same(got.dgrad_w, want.dgrad_w.quant, "dgrad_w");
  expect_same(got.wgrad_dy, want.wgrad_dy.quant, "wgrad_dy");
  expect_same(got.wgrad_x, want.wgrad_x.quant, "wgrad_x");
}

const Precision& at(const Recipe& r, Stage s, Gemm g, Operand o) { return r.policy.at(s, g, o); }

TEST(RecipePresets, EveryPresetValidatesAndResolves) {
  ModelShape moe{8, {1, 3, 5, 6, 7}, true};
  for (std::string_view name : preset_names()) {
    SCOPED_TRACE(std::string(name));
    const Recipe r = preset(name);
    EXPECT_EQ(r.name, name);
    EXPECT_NO_THROW(r.validate());
    EXPECT_NO_THROW(resolve(r, dense(12)));
    const ResolvedRecipe rr = resolve(r, moe);
    EXPECT_TRUE(rr.sampler_mismatches().empty());
    EXPECT_FALSE(rr.table().empty());
  }
  expect_error([] { preset("nvfp5"); }, {"nvfp5", "bf16, fp8, mxfp8, nvfp4, nvfp4-46, e2e4"});
}

// with_sampler_precision (the --sampler-recipe variants, and `bench decode`'s nvfp4-weights): on
// every preset, the RL Fprop's input and weight slots of both RL stages become exactly the named
// precision (e2e4's NVFP4 sampler operands), every other slot stays, and the result validates.
TEST(RecipePresets, SamplerPrecisionVariants) {
  const Recipe e2e4 = preset("e2e4");
  const Precision nv_x = at(e2e4, Stage::kRlSampler, Gemm::kFprop, Operand::kInput);
  const Precision nv_w = at(e2e4, Stage::kRlSampler, Gemm::kFprop, Operand::kWeight);
  ASSERT_TRUE(nv_x.has_value() && nv_w.has_value());
  for (std::string_view name : preset_names()) {
    for (std::string_view which : {"bf16", "nvfp4", "nvfp4-tensor-amax", "nvfp4-weights", "recipe"}) {
      SCOPED_TRACE(std::string(name) + " + " + std::string(which));
      const Recipe base = preset(name);
      Recipe r;
      ASSERT_NO_THROW(r = with_sampler_precision(base, which));
      EXPECT_NO_THROW(resolve(r, dense(8)));
      if (which == "recipe") {
        EXPECT_TRUE(r == base);
        continue;
      }
      EXPECT_EQ(r.name, std::string(name) + "+sampler-" + std::string(which));
      Precision want_x = which == "nvfp4" || which == "nvfp4-tensor-amax" ? nv_x : Precision{};
      if (want_x && which == "nvfp4-tensor-amax") want_x->nvfp4_row_amax = false;
      const Precision want_w = which == "bf16" ? Precision{} : nv_w;
      for (Stage st : {Stage::kRlSampler, Stage::kRlTrainer}) {
        EXPECT_TRUE(same_precision(at(r, st, Gemm::kFprop, Operand::kInput), want_x));
        EXPECT_TRUE(same_precision(at(r, st, Gemm::kFprop, Operand::kWeight), want_w));
      }
      for (const Slot& slot : all_slots()) {
        const bool rl_fprop = (slot.stage == Stage::kRlSampler || slot.stage == Stage::kRlTrainer) &&
                              slot.gemm == Gemm::kFprop;
        if (!rl_fprop) {
          EXPECT_TRUE(same_precision(r.policy.at(slot), base.policy.at(slot)));
        }
      }
    }
  }
  expect_error([] { with_sampler_precision(preset("bf16"), "nvfp8"); }, {"nvfp8", "nvfp4-weights"});
}

TEST(RecipePresets, Bf16QuantizesNothing) {
  const ResolvedRecipe rr = resolve(preset("bf16"), dense(4));
  for (int b = 0; b < 4; ++b)
    for (const Slot& s : all_slots()) EXPECT_FALSE(rr.policy(b, LinearKind::kQkv).at(s).has_value());
}

// The gemm module states NVIDIA's NVFP4, DeepSeek's FP8 and MXFP8 on its own (gemm/linear.h);
// pretraining under our presets must be exactly those, in every quantized layer.
TEST(RecipePresets, PretrainingMatchesTheGemmModulesPresets) {
  const struct {
    const char* preset;
    gemm::LinearRecipe want;
  } cases[] = {{"nvfp4", gemm::LinearRecipe::nvfp4()},
               {"fp8", gemm::LinearRecipe::fp8_block()},
               {"mxfp8", gemm::LinearRecipe::mxfp8()},
               {"bf16", gemm::LinearRecipe::plain()}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.preset);
    const ResolvedRecipe rr = resolve(preset(c.preset), dense(12));
    for (LinearKind k : {LinearKind::kQkv, LinearKind::kAttnOut, LinearKind::kMlpUp, LinearKind::kMlpDown}) {
      expect_same(rr.pretrain_linear(0, k), c.want);
      expect_same(rr.pretrain_linear(9, k), c.want);
      expect_same(rr.pretrain_linear(11, k), gemm::LinearRecipe::plain());  // the BF16 tail
    }
  }
}

TEST(RecipePresets, Nvfp4IsNvidiasRecipe) {
  const Recipe r = preset("nvfp4");
  // NUMERICS.md 4.1 row by row.
  EXPECT_TRUE(same_precision(at(r, Stage::kPretrainForward, Gemm::kFprop, Operand::kInput),
                             config(Format::kNvfp4, false, kRn)));
  EXPECT_TRUE(same_precision(at(r, Stage::kPretrainForward, Gemm::kFprop, Operand::kWeight),
                             config(Format::kNvfp4, true, kRn)));
  EXPECT_TRUE(same_precision(at(r, Stage::kPretrainBackward, Gemm::kDgrad, Operand::kGradient),
                             config(Format::kNvfp4, false, kSr)));
  EXPECT_TRUE(same_precision(at(r, Stage::kPretrainBackward, Gemm::kDgrad, Operand::kWeight),
                             at(r, Stage::kPretrainForward, Gemm::kFprop, Operand::kWeight)));
  EXPECT_TRUE(same_precision(at(r, Stage::kPretrainBackward, Gemm::kWgrad, Operand::kGradient),
                             config(Format::kNvfp4, false, kSr, true)));
  EXPECT_TRUE(same_precision(at(r, Stage::kPretrainBackward, Gemm::kWgrad, Operand::kInput),
                             config(Format::kNvfp4, false, kRn, true)));
  EXPECT_EQ(at(r, Stage::kPretrainBackward, Gemm::kWgrad, Operand::kInput)->rht_signs,
            quant::HadamardSigns::kFixed);
  EXPECT_DOUBLE_EQ(r.high_precision.last_blocks_fraction, 0.15);
  // RL: the sampler runs the pretraining forward, the trainer the whole pretraining recipe.
  const ResolvedRecipe rr = resolve(r, dense(12));
  expect_same(rr.linear(Stage::kRlTrainer, 3, LinearKind::kMlpDown), rr.pretrain_linear(3, LinearKind::kMlpDown));
}

TEST(RecipePresets, Nvfp4FourOverSixOnWeightsAndActivationsOnly) {
  const Recipe r = preset("nvfp4-46");
  const Recipe base = preset("nvfp4");
  const auto is46 = [](const Precision& p) {
    return p && p->nvfp4_scale_rule == quant::Nvfp4ScaleRule::kFourOverSix &&
           p->four_over_six_metric == quant::FourOverSixMetric::kMse;
  };
  for (Stage s : {Stage::kPretrainForward, Stage::kRlSampler, Stage::kRlTrainer}) {
    EXPECT_TRUE(is46(at(r, s, Gemm::kFprop, Operand::kInput))) << stage_name(s);
    EXPECT_TRUE(is46(at(r, s, Gemm::kFprop, Operand::kWeight))) << stage_name(s);
  }
  for (Stage s : {Stage::kPretrainBackward, Stage::kRlTrainer}) {
    EXPECT_TRUE(is46(at(r, s, Gemm::kDgrad, Operand::kWeight)));  // the same quantized weight
    EXPECT_FALSE(is46(at(r, s, Gemm::kDgrad, Operand::kGradient)));
    EXPECT_FALSE(is46(at(r, s, Gemm::kWgrad, Operand::kGradient)));
    EXPECT_FALSE(is46(at(r, s, Gemm::kWgrad, Operand::kInput)));
  }
  // No 4/6 with RHT anywhere; otherwise exactly nvfp4.
  for (const Slot& s : all_slots()) {
    const Precision& p = r.policy.at(s);
    ASSERT_TRUE(p.has_value());
    EXPECT_FALSE(is46(p) && p->rht) << s.path();
    quant::QuantConfig plain = *p;
    plain.nvfp4_scale_rule = quant::Nvfp4ScaleRule::kAmaxTo6;
    EXPECT_TRUE(same_precision(plain, base.policy.at(s))) << s.path();
  }
}

TEST(RecipePresets, Fp8IsDeepSeekV3BlockScaling) {
  const Recipe r = preset("fp8");
  for (const Slot& s : all_slots()) {
    SCOPED_TRACE(s.path());
    const Precision& p = r.policy.at(s);
    ASSERT_TRUE(p.has_value());
    EXPECT_EQ(p->format, Format::kFp8Block);
    EXPECT_TRUE(p->fp8_pow2_scales);
    EXPECT_EQ(p->block_2d, s.operand == Operand::kWeight);  // W 128x128, X and dY 1x128
    // RN as DeepSeek, except the RL trainer's gradients (RL.md: unbiased backward).
    const bool sr = s.stage == Stage::kRlTrainer && s.operand == Operand::kGradient;
    EXPECT_EQ(p->rounding, sr ? kSr : kRn);
  }
}

TEST(RecipePresets, Mxfp8EverywhereRoundUp) {
  const Recipe r = preset("mxfp8");
  for (const Slot& s : all_slots()) {
    const Precision& p = r.policy.at(s);
    ASSERT_TRUE(p.has_value());
    EXPECT_EQ(p->format, Format::kMxfp8) << s.path();
    EXPECT_EQ(p->mx_scale_rule, quant::MxScaleRule::kRoundUp) << s.path();
    const bool sr = s.stage == Stage::kRlTrainer && s.operand == Operand::kGradient;
    EXPECT_EQ(p->rounding, sr ? kSr : kRn) << s.path();
  }
}

TEST(RecipePresets, E2e4IsTheFourStagePolicy) {
  const Recipe r = preset("e2e4");
  const Recipe nv = preset("nvfp4");
  // Pretraining: the NVIDIA recipe.
  for (const Slot& s : all_slots()) {
    if (s.stage == Stage::kPretrainForward || s.stage == Stage::kPretrainBackward) {
      EXPECT_TRUE(same_precision(r.policy.at(s), nv.policy.at(s))) << s.path();
    }
  }
  // Sampler: NVFP4 weights and activations, RN, 1x16 weights, a per-token amax on the activations;
  // the trainer's forward is identical.
  for (Operand o : {Operand::kInput, Operand::kWeight}) {
    quant::QuantConfig want = config(Format::kNvfp4, false, kRn);
    want.nvfp4_row_amax = o == Operand::kInput;
    EXPECT_TRUE(same_precision(at(r, Stage::kRlSampler, Gemm::kFprop, o), want));
    EXPECT_TRUE(same_precision(at(r, Stage::kRlTrainer, Gemm::kFprop, o),
                               at(r, Stage::kRlSampler, Gemm::kFprop, o)));
  }
  // Trainer backward: MXFP8, SR on the gradients.
  EXPECT_TRUE(same_precision(at(r, Stage::kRlTrainer, Gemm::kDgrad, Operand::kGradient),
                             config(Format::kMxfp8, false, kSr)));
  EXPECT_TRUE(same_precision(at(r, Stage::kRlTrainer, Gemm::kDgrad, Operand::kWeight),
                             config(Format::kMxfp8, false, kRn)));
  EXPECT_TRUE(same_precision(at(r, Stage::kRlTrainer, Gemm::kWgrad, Operand::kGradient),
                             config(Format::kMxfp8, false, kSr)));
  EXPECT_TRUE(same_precision(at(r, Stage::kRlTrainer, Gemm::kWgrad, Operand::kInput),
                             config(Format::kMxfp8, false, kRn)));
}

TEST(RecipePresets, LinearSetsOnlyTheGemmsOfTheStage) {
  const ResolvedRecipe rr = resolve(preset("e2e4"), dense(12));
  const gemm::LinearRecipe sampler = rr.linear(Stage::kRlSampler, 0, LinearKind::kQkv);
  EXPECT_TRUE(sampler.fprop_x.quant && sampler.fprop_w.quant);
  EXPECT_FALSE(sampler.dgrad_dy.quant || sampler.dgrad_w.quant || sampler.wgrad_dy.quant ||
               sampler.wgrad_x.quant);
  const gemm::LinearRecipe fwd = rr.linear(Stage::kPretrainForward, 0, LinearKind::kQkv);
  EXPECT_TRUE(fwd.fprop_w.quant && fwd.fprop_w.quant->block_2d);
  EXPECT_FALSE(fwd.dgrad_dy.quant);
  const gemm::LinearRecipe bwd = rr.linear(Stage::kPretrainBackward, 0, LinearKind::kQkv);
  EXPECT_FALSE(bwd.fprop_x.quant || bwd.fprop_w.quant);
  EXPECT_TRUE(bwd.wgrad_x.quant && bwd.wgrad_x.quant->rht);
  const gemm::LinearRecipe trainer = rr.linear(Stage::kRlTrainer, 0, LinearKind::kQkv);
  EXPECT_EQ(trainer.fprop_w.quant->block_2d, false);
  // The RL forward's activations carry a per-token amax (the sampler's contract), and the table
  // says so; the weights and the pretraining activations do not.
  EXPECT_TRUE(sampler.fprop_x.quant->nvfp4_row_amax && trainer.fprop_x.quant->nvfp4_row_amax);
  EXPECT_FALSE(sampler.fprop_w.quant->nvfp4_row_amax || fwd.fprop_x.quant->nvfp4_row_amax);
  EXPECT_NE(rr.table().find("per-token amax"), std::string::npos);
  EXPECT_EQ(trainer.dgrad_dy.quant->format, Format::kMxfp8);
}

// 15% of n_layers, rounded to nearest with halves up: 12 -> 1.8 -> 2 (the example of the spec).
TEST(RecipeHighPrecision, TailBlocksRoundToNearest) {
  const struct {
    int n_layers, tail;
  } cases[] = {{12, 2}, {10, 2}, {24, 4}, {4, 1}, {2, 0}, {1, 0}, {62, 9}, {52, 8}, {28, 4}, {20, 3}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.n_layers);
    EXPECT_EQ(HighPrecision{}.last_block_count(c.n_layers), c.tail);
    const ResolvedRecipe rr = resolve(preset("nvfp4"), dense(c.n_layers));
    for (int b = 0; b < c.n_layers; ++b) {
      EXPECT_EQ(rr.is_high_precision(b, LinearKind::kMlpUp), b >= c.n_layers - c.tail) << b;
      EXPECT_EQ(rr.policy(b, LinearKind::kMlpUp) == Policy::bf16(), b >= c.n_layers - c.tail) << b;
    }
  }
  const ResolvedRecipe rr = resolve(preset("nvfp4"), dense(12));
  bool listed = false;
  for (const HighPrecisionException& e : rr.exceptions()) listed = listed || e.what == "blocks 10-11";
  EXPECT_TRUE(listed);
}

TEST(RecipeHighPrecision, CountFirstBlocksAndKinds) {
  Recipe r = preset("nvfp4");
  r.high_precision.last_blocks = 3;
  r.high_precision.first_blocks = 1;
  const ResolvedRecipe rr = resolve(r, dense(12));
  for (int b = 0; b < 12; ++b) {
    EXPECT_EQ(rr.is_high_precision(b, LinearKind::kQkv), b == 0 || b >= 9) << b;
  }
  EXPECT_TRUE(rr.is_high_precision(0, LinearKind::kLmHead));
  EXPECT_EQ(rr.policy(0, LinearKind::kLmHead), Policy::bf16());

  r.high_precision.last_blocks.reset();
  r.high_precision.last_blocks_fraction = 0.0;
  r.high_precision.first_blocks = 0;
  r.high_precision.kinds = {LinearKind::kRouter};  // quantize the LM head
  const ResolvedRecipe q = resolve(r, ModelShape{4, {2}, false});
  EXPECT_FALSE(q.is_high_precision(3, LinearKind::kQkv));
  EXPECT_EQ(q.policy(0, LinearKind::kLmHead), r.policy);
  EXPECT_TRUE(q.is_high_precision(2, LinearKind::kRouter));
  EXPECT_FALSE(q.is_high_precision(2, LinearKind::kExpertUp));
  std::vector<std::string> what;
  for (const HighPrecisionException& e : q.exceptions()) what.push_back(e.what);
  for (const char* w : {"embeddings", "norms, non-linearities", "softmax, attention QK^T and P.V", "router"}) {
    EXPECT_NE(std::find(what.begin(), what.end(), w), what.end()) << w;
  }
  EXPECT_EQ(std::find(what.begin(), what.end(), "lm_head"), what.end());
}

TEST(RecipeResolve, MoeKindsAndErrors) {
  const ResolvedRecipe rr = resolve(preset("nvfp4"), ModelShape{6, {1, 3}, false});
  EXPECT_NO_THROW(rr.policy(1, LinearKind::kExpertUp));
  EXPECT_TRUE(rr.is_high_precision(1, LinearKind::kRouter));
  EXPECT_FALSE(rr.is_high_precision(1, LinearKind::kExpertDown));
  expect_error([&] { rr.policy(0, LinearKind::kRouter); }, {"block 0", "dense", "router"});
  expect_error([&] { rr.policy(1, LinearKind::kMlpUp); }, {"block 1", "MoE", "mlp_up"});
  expect_error([&] { rr.policy(6, LinearKind::kQkv); }, {"block 6", "0..5"});
  const ResolvedRecipe shared = resolve(preset("nvfp4"), ModelShape{6, {1, 3}, true});
  EXPECT_NO_THROW(shared.policy(1, LinearKind::kMlpUp));
  expect_error([] { resolve(preset("nvfp4"), ModelShape{6, {6}, false}); }, {"model.moe_blocks", "6"});
  expect_error([] { resolve(preset("nvfp4"), dense(0)); }, {"n_layers"});
}

TEST(RecipeResolve, OverridesApplyInOrderAndExceptionsWin) {
  Recipe r = preset("nvfp4");
  Override o0;
  o0.blocks = {{0, 1}, {-2, -1}};  // the last two blocks are the BF16 tail: the exception wins
  o0.kinds = {LinearKind::kMlpDown};
  o0.set = {{Slot{Stage::kPretrainForward, Gemm::kFprop, Operand::kInput}, std::nullopt}};
  Override o1;  // every block, every kind: MXFP8 weights in pretraining backward's Dgrad
  o1.set = {{Slot{Stage::kPretrainBackward, Gemm::kDgrad, Operand::kWeight},
             config(Format::kMxfp8, false, kRn)}};
  r.overrides = {o0, o1};
  const ResolvedRecipe rr = resolve(r, dense(12));
  const Slot fx{Stage::kPretrainForward, Gemm::kFprop, Operand::kInput};
  const Slot dw{Stage::kPretrainBackward, Gemm::kDgrad, Operand::kWeight};
  EXPECT_FALSE(rr.policy(0, LinearKind::kMlpDown).at(fx).has_value());
  EXPECT_TRUE(rr.policy(0, LinearKind::kMlpUp).at(fx).has_value());
  EXPECT_TRUE(rr.policy(2, LinearKind::kMlpDown).at(fx).has_value());
  EXPECT_EQ(rr.policy(5, LinearKind::kQkv).at(dw)->format, Format::kMxfp8);
  EXPECT_EQ(rr.policy(11, LinearKind::kMlpDown), Policy::bf16());
  EXPECT_EQ(rr.policy(0, LinearKind::kLmHead), Policy::bf16());  // in high_precision.kinds
  const std::string table = rr.table();
  EXPECT_NE(table.find("o0: blocks 0..1, -2..-1 (= 10..11), kinds mlp_down"), std::string::npos) << table;
  EXPECT_NE(table.find("policy+o0+o1"), std::string::npos) << table;

  // The tail in MXFP8 instead of BF16: no tail exception, an override for the last two blocks.
  Recipe t = preset("nvfp4");
  t.high_precision.last_blocks = 0;
  Override mx;
  mx.blocks = {{-2, -1}};
  for (const Slot& s : all_slots()) {
    const bool sr = s.operand == Operand::kGradient && s.stage != Stage::kRlSampler &&
                    s.gemm != Gemm::kFprop;
    mx.set.emplace_back(s, config(Format::kMxfp8, false, sr ? kSr : kRn));
  }
  t.overrides = {mx};
  const ResolvedRecipe tr = resolve(t, dense(12));
  EXPECT_EQ(tr.pretrain_linear(11, LinearKind::kQkv).wgrad_x.quant->format, Format::kMxfp8);
  EXPECT_EQ(tr.pretrain_linear(9, LinearKind::kQkv).wgrad_x.quant->format, Format::kNvfp4);
}

}  // namespace
}  // namespace fourbit::recipe
