// recipe (cpu): invalid combinations are rejected with a message that names the field (slot path
// and QuantConfig field), both in the policy and in a layer reached through overrides; the
// sampler/trainer quantizer contract and its explicit ablation switch.
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

Precision& at(Recipe& r, std::string_view path) { return r.policy.at(parse_slot(path)); }

// Sets a field on the preset's operand and expects validate() (and resolve()) to name `field`.
void expect_rejected(std::string_view preset_name, const std::function<void(Recipe&)>& edit,
                     const std::vector<std::string>& parts) {
  Recipe r = preset(preset_name);
  edit(r);
  expect_error([&] { r.validate(); }, parts);
  expect_error([&] { resolve(r, dense(12)); }, parts);
}

TEST(RecipeValidation, RhtOnlyOnWgradOperands) {
  expect_rejected("nvfp4", [](Recipe& r) { at(r, "pretrain_forward.fprop.weight")->block_2d = false;
                                           at(r, "pretrain_forward.fprop.weight")->rht = true; },
                  {"recipe 'nvfp4'", "pretrain_forward.fprop.weight.rht", "weight"});
  expect_rejected("nvfp4", [](Recipe& r) { at(r, "pretrain_backward.dgrad.gradient")->rht = true; },
                  {"pretrain_backward.dgrad.gradient.rht", "Wgrad"});
  expect_rejected("nvfp4", [](Recipe& r) { at(r, "pretrain_backward.wgrad.input")->rht = false; },
                  {"pretrain_backward.wgrad.input.rht", "both Wgrad operands"});
  expect_rejected("nvfp4", [](Recipe& r) {
                    at(r, "pretrain_backward.wgrad.input")->rht_signs = quant::HadamardSigns::kRandom;
                    at(r, "pretrain_backward.wgrad.input")->rht_seed = 7;
                  },
                  {"pretrain_backward.wgrad.input.rht_signs", "same RHT sign vector"});
  // rht is NVFP4-only: on MXFP8 the field is not available at all.
  expect_rejected("mxfp8", [](Recipe& r) { at(r, "pretrain_backward.wgrad.input")->rht = true; },
                  {"pretrain_backward.wgrad.input.rht", "applies to nvfp4 only"});
}

TEST(RecipeValidation, TwoDimensionalBlocks) {
  expect_rejected("nvfp4", [](Recipe& r) { at(r, "pretrain_forward.fprop.input")->block_2d = true; },
                  {"pretrain_forward.fprop.input.block_2d", "2D blocks are for weights"});
  expect_rejected("mxfp8", [](Recipe& r) { at(r, "pretrain_forward.fprop.weight")->block_2d = true; },
                  {"pretrain_forward.fprop.weight.block_2d", "mxfp8", "nvfp4 and fp8-block"});
  // cuBLASLt has no 128x128 x 128x128 FP8 GEMM: reported as that, before the weights-only rule.
  expect_rejected("fp8", [](Recipe& r) { at(r, "pretrain_backward.dgrad.gradient")->block_2d = true; },
                  {"pretrain_backward.dgrad.gradient.block_2d", "2D x 2D", "pretrain_backward.dgrad"});
}

TEST(RecipeValidation, Fp8OperandsPairWithFp8) {
  expect_rejected("fp8", [](Recipe& r) { at(r, "pretrain_forward.fprop.input") = std::nullopt; },
                  {"pretrain_forward.fprop.input.format", "bf16", "two FP8 operands"});
  expect_rejected("nvfp4", [](Recipe& r) {
                    at(r, "pretrain_forward.fprop.weight") = config(Format::kFp8Tensor, false, Rounding::kNearest);
                  },
                  {"pretrain_forward.fprop.input.format", "fp8-tensor"});
  expect_rejected("fp8", [](Recipe& r) {
                    at(r, "pretrain_forward.fprop.input") = config(Format::kFp8Tensor, false, Rounding::kNearest);
                  },
                  {"pretrain_forward.fprop.weight.format", "same scaling"});
}

TEST(RecipeValidation, SamplerIsDeterministicTrainerBackwardUnbiased) {
  expect_rejected("nvfp4", [](Recipe& r) {
                    at(r, "rl_sampler.fprop.input")->rounding = Rounding::kStochastic;
                    at(r, "rl_trainer.fprop.input")->rounding = Rounding::kStochastic;
                  },
                  {"rl_sampler.fprop.input.rounding", "deterministic"});
  expect_rejected("e2e4", [](Recipe& r) { at(r, "rl_trainer.dgrad.gradient")->rounding = Rounding::kNearest; },
                  {"rl_trainer.dgrad.gradient.rounding", "unbiased"});
  // BF16 gradients are fine.
  Recipe r = preset("e2e4");
  at(r, "rl_trainer.dgrad.gradient") = std::nullopt;
  at(r, "rl_trainer.dgrad.weight") = std::nullopt;
  at(r, "rl_trainer.wgrad.gradient") = std::nullopt;
  at(r, "rl_trainer.wgrad.input") = std::nullopt;
  EXPECT_NO_THROW(resolve(r, dense(12)));
}

TEST(RecipeValidation, FieldsThatDoNotApplyStayAtTheirDefaults) {
  expect_rejected("nvfp4", [](Recipe& r) { at(r, "pretrain_forward.fprop.input")->sr_unbiased_scale = true; },
                  {"pretrain_forward.fprop.input.sr_unbiased_scale", "rounding = stochastic"});
  expect_rejected("nvfp4", [](Recipe& r) {
                    at(r, "pretrain_forward.fprop.input")->four_over_six_metric = quant::FourOverSixMetric::kMae;
                  },
                  {"pretrain_forward.fprop.input.four_over_six_metric", "four_over_six"});
  expect_rejected("nvfp4", [](Recipe& r) { at(r, "pretrain_forward.fprop.input")->mx_scale_rule = quant::MxScaleRule::kFloor; },
                  {"pretrain_forward.fprop.input.mx_scale_rule", "mxfp8"});
  expect_rejected("nvfp4", [](Recipe& r) { at(r, "pretrain_forward.fprop.input")->rht_seed = 3; },
                  {"pretrain_forward.fprop.input.rht_seed"});
}

TEST(RecipeValidation, HighPrecisionSettings) {
  expect_rejected("nvfp4", [](Recipe& r) { r.high_precision.last_blocks_fraction = 1.5; },
                  {"high_precision.last_blocks_fraction", "1.5"});
  expect_rejected("nvfp4", [](Recipe& r) { r.high_precision.first_blocks = -1; },
                  {"high_precision.first_blocks"});
  Recipe r = preset("nvfp4");
  r.high_precision.last_blocks = 13;
  expect_error([&] { resolve(r, dense(12)); }, {"high_precision.last_blocks", "13", "12 blocks"});
}

TEST(RecipeValidation, SlotsAndOverrides) {
  Policy p;
  expect_error([&] { p.at(Stage::kPretrainForward, Gemm::kDgrad, Operand::kWeight); },
               {"pretrain_forward.dgrad.weight", "does not run dgrad"});
  expect_error([&] { p.at(Stage::kRlTrainer, Gemm::kFprop, Operand::kGradient); },
               {"rl_trainer.fprop.gradient", "input and weight"});
  expect_error([] { parse_slot("rl_trainer.fprop"); }, {"stage.gemm.operand"});
  expect_error([] { parse_slot("rl_trainer.xgrad.input"); }, {"xgrad", "fprop, dgrad, wgrad"});

  Recipe r = preset("nvfp4");
  Override o;
  o.blocks = {{5, 20}};
  o.set = {{parse_slot("pretrain_forward.fprop.input"), std::nullopt}};
  r.overrides = {o};
  expect_error([&] { resolve(r, dense(12)); }, {"overrides[0].blocks", "0..11"});
  r.overrides[0].blocks = {{3, 2}};
  expect_error([&] { r.validate(); }, {"overrides[0].blocks", "empty"});
  // An override's slot on its own is checked by validate(), naming the override.
  r.overrides[0].blocks = {{0, 1}};
  r.overrides[0].set = {{parse_slot("pretrain_forward.fprop.input"), config(Format::kMxfp8, true, Rounding::kNearest)}};
  expect_error([&] { r.validate(); }, {"overrides[0].set", "pretrain_forward.fprop.input.block_2d"});
  // A rule between slots broken only in the overridden layers: resolve() names the layer.
  r.overrides[0].set = {{parse_slot("pretrain_forward.fprop.input"), config(Format::kFp8Block, false, Rounding::kNearest)}};
  EXPECT_NO_THROW(r.validate());
  expect_error([&] { resolve(r, dense(12)); },
               {"block 0 qkv (after overrides 0)", "pretrain_forward.fprop.weight.format"});
  r.overrides[0].set.emplace_back(parse_slot("pretrain_forward.fprop.input"), std::nullopt);
  expect_error([&] { r.validate(); }, {"overrides[0].set.pretrain_forward.fprop.input", "twice"});
}

TEST(RecipeContract, TrainerForwardMustEqualSampler) {
  // The e2e4 sampler has 1x16 weights; the trainer given 16x16 weights breaks the contract.
  Recipe r = preset("e2e4");
  at(r, "rl_trainer.fprop.weight")->block_2d = true;
  expect_error([&] { r.validate(); },
               {"rl_trainer.fprop.weight.block_2d", "rl_sampler.fprop.weight", "allow_sampler_mismatch"});
  // Allowed for an ablation: it resolves and the mismatch is reported in every layer it touches.
  r.allow_sampler_mismatch = true;
  const ResolvedRecipe rr = resolve(r, dense(12));
  EXPECT_EQ(rr.sampler_mismatches().size(), 10u * 4u);  // 10 quantized blocks x 4 linears
  EXPECT_NE(rr.sampler_mismatches()[0].find("block 0 qkv: weight trainer nvfp4 16x16 rn vs sampler "
                                            "nvfp4 1x16 rn"),
            std::string::npos)
      << rr.sampler_mismatches()[0];
  EXPECT_NE(rr.table().find("DIFFERS in 40 operand(s)"), std::string::npos);

  // A format difference names the format.
  Recipe f = preset("nvfp4");
  at(f, "rl_trainer.fprop.input") = config(Format::kMxfp8, false, Rounding::kNearest);
  expect_error([&] { f.validate(); }, {"rl_trainer.fprop.input.format", "mxfp8 rn", "nvfp4 1x16 rn"});
  // The 4/6 choice is part of the contract.
  Recipe s = preset("nvfp4-46");
  at(s, "rl_trainer.fprop.input")->nvfp4_scale_rule = quant::Nvfp4ScaleRule::kAmaxTo6;
  at(s, "rl_trainer.fprop.input")->four_over_six_metric = quant::FourOverSixMetric::kMse;
  expect_error([&] { s.validate(); }, {"rl_trainer.fprop.input.nvfp4_scale_rule"});

  // Broken by an override in some layers only: resolve() names the first such layer.
  Recipe o = preset("nvfp4");
  Override ov;
  ov.blocks = {{4, 5}};
  ov.kinds = {LinearKind::kAttnOut};
  ov.set = {{parse_slot("rl_sampler.fprop.input"), std::nullopt}};
  o.overrides = {ov};
  EXPECT_NO_THROW(o.validate());
  expect_error([&] { resolve(o, dense(12)); }, {"block 4 attn_out", "rl_trainer.fprop.input.format"});
  // The same override on both stages keeps the contract.
  o.overrides[0].set.emplace_back(parse_slot("rl_trainer.fprop.input"), std::nullopt);
  const ResolvedRecipe ok = resolve(o, dense(12));
  EXPECT_FALSE(ok.policy(4, LinearKind::kAttnOut).at(parse_slot("rl_sampler.fprop.input")).has_value());
  EXPECT_TRUE(ok.sampler_mismatches().empty());
}

}  // namespace
}  // namespace fourbit::recipe
