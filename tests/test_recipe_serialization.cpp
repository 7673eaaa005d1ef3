// recipe (cpu): JSON round trips exactly (every preset, a recipe that sets every kind of field, a
// resolved recipe); parsing rejects unknown keys and bad values naming the key and the allowed
// values; recipe files; --set overrides (fields, formats, wildcards, high_precision, the contract
// switch), validated the same way.
#include "recipe/recipe.h"
#include "recipe_test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>

namespace fourbit::recipe {
namespace {

using json = nlohmann::json;
using quant::Format;
using quant::Rounding;
using testing::config;
using testing::dense;
using testing::expect_error;

// A recipe that exercises every field of the JSON format.
Recipe everything_recipe() {
  Recipe r = preset("nvfp4");
  r.name = "everything";
  auto& wx = r.policy.at(parse_slot("pretrain_backward.wgrad.input"));
  auto& wdy = r.policy.at(parse_slot("pretrain_backward.wgrad.gradient"));
  for (auto* p : {&wx, &wdy}) {
    (*p)->rht_signs = quant::HadamardSigns::kRandom;
    (*p)->rht_seed = 0xFFFFFFFFFFFFFFF1ull;  // beyond double precision: must stay exact
  }
  wdy->sr_unbiased_scale = true;
  for (const char* s : {"rl_sampler.fprop.input", "rl_trainer.fprop.input"}) {
    auto& p = r.policy.at(parse_slot(s));
    p->nvfp4_scale_rule = quant::Nvfp4ScaleRule::kFourOverSix;
    p->four_over_six_metric = quant::FourOverSixMetric::kAbsMax;
  }
  quant::QuantConfig floor = config(Format::kMxfp8, false, Rounding::kStochastic);
  floor.mx_scale_rule = quant::MxScaleRule::kFloor;
  r.policy.at(parse_slot("rl_trainer.dgrad.gradient")) = floor;
  r.policy.at(parse_slot("rl_trainer.dgrad.weight")) = config(Format::kMxfp8, false, Rounding::kNearest);
  r.high_precision.kinds = {LinearKind::kRouter};
  r.high_precision.last_blocks_fraction = 0.1234567890123;
  r.high_precision.last_blocks = 1;
  r.high_precision.first_blocks = 1;
  Override o;
  o.blocks = {{1, 2}, {-3, -3}};
  o.kinds = {LinearKind::kQkv, LinearKind::kMlpDown};
  quant::QuantConfig fp32_scales = config(Format::kFp8Block, false, Rounding::kNearest);
  fp32_scales.fp8_pow2_scales = false;
  quant::QuantConfig fp32_w = fp32_scales;
  fp32_w.block_2d = true;
  o.set = {{parse_slot("pretrain_forward.fprop.input"), fp32_scales},
           {parse_slot("pretrain_forward.fprop.weight"), fp32_w},
           {parse_slot("pretrain_backward.dgrad.weight"), std::nullopt}};
  r.overrides = {o};
  r.allow_sampler_mismatch = true;
  r.policy.at(parse_slot("rl_trainer.fprop.weight"))->block_2d = false;  // a mismatch, allowed
  return r;
}

void expect_round_trip(const Recipe& r) {
  const json j = to_json(r);
  const std::string text = j.dump(2);
  const Recipe back = recipe_from_json(json::parse(text));
  EXPECT_TRUE(back == r) << text;
  EXPECT_EQ(to_json(back).dump(2), text);
}

TEST(RecipeJson, RoundTripIsExact) {
  for (std::string_view name : preset_names()) {
    SCOPED_TRACE(std::string(name));
    expect_round_trip(preset(name));
  }
  const Recipe r = everything_recipe();
  EXPECT_NO_THROW(resolve(r, dense(12)));
  expect_round_trip(r);
  const json j = to_json(r);
  EXPECT_EQ(j["policy"]["pretrain_backward.wgrad.input"]["rht_seed"].get<uint64_t>(), 0xFFFFFFFFFFFFFFF1ull);
  EXPECT_EQ(j["high_precision"]["last_blocks"], 1);
  EXPECT_EQ(j["overrides"][0]["blocks"], json::parse("[[1, 2], [-3, -3]]"));
  // Only the fields that apply to an operand are written; bf16 is just its format.
  EXPECT_EQ(j["overrides"][0]["set"]["pretrain_backward.dgrad.weight"], json::parse(R"({"format": "bf16"})"));
  EXPECT_EQ(j["policy"]["pretrain_forward.fprop.input"],
            json::parse(R"({"format": "nvfp4", "block_2d": false, "rounding": "nearest", "rht": false,
                            "nvfp4_scale_rule": "amax_to_6", "nvfp4_row_amax": false})"));
}

TEST(RecipeJson, ResolvedRoundTrip) {
  const ResolvedRecipe rr = resolve(everything_recipe(), ModelShape{12, {3, 7}, true});
  const json j = to_json(rr);
  const ResolvedRecipe back = resolved_from_json(json::parse(j.dump()));
  EXPECT_TRUE(back.recipe() == rr.recipe());
  EXPECT_EQ(back.shape(), rr.shape());
  EXPECT_EQ(back.table(), rr.table());
  for (int b = 0; b < 12; ++b) {
    for (LinearKind k : kLinearKinds) {
      if (!rr.shape().has(b, k)) continue;
      EXPECT_EQ(back.policy(b, k), rr.policy(b, k));
    }
  }
  EXPECT_EQ(to_json(back), j);
}

// Edits a preset's JSON and expects parsing to fail with a message containing `parts`.
void expect_bad_json(const std::function<void(json&)>& edit, const std::vector<std::string>& parts) {
  json j = to_json(preset("nvfp4"));
  edit(j);
  expect_error([&] { recipe_from_json(j); }, parts);
}

TEST(RecipeJson, RejectsUnknownKeysAndBadValues) {
  expect_bad_json([](json& j) { j["polcy"] = json::object(); },
                  {"recipe 'nvfp4'", "recipe.polcy", "unknown key", "allowed: format_version, name, policy"});
  expect_bad_json([](json& j) { j["policy"]["pretrain_forward.fprop.input"]["roundng"] = "nearest"; },
                  {"policy.pretrain_forward.fprop.input.roundng", "unknown key", "format, block_2d, rounding"});
  expect_bad_json([](json& j) { j["policy"]["pretrain_forward.fprop.input"]["rounding"] = "up"; },
                  {"policy.pretrain_forward.fprop.input.rounding", "'up'", "allowed: nearest, stochastic"});
  expect_bad_json([](json& j) { j["policy"]["pretrain_forward.fprop.input"]["format"] = "fp4"; },
                  {"policy.pretrain_forward.fprop.input.format", "'fp4'", "bf16, nvfp4, mxfp8, fp8-tensor, fp8-block"});
  expect_bad_json([](json& j) { j["policy"]["pretrain_forward.fprop.input"]["rht"] = "yes"; },
                  {"policy.pretrain_forward.fprop.input.rht", "true or false", "\"yes\""});
  expect_bad_json([](json& j) { j["policy"]["pretrain_forward.fprop.input"]["mx_scale_rule"] = "floor"; },
                  {"policy.pretrain_forward.fprop.input.mx_scale_rule", "does not apply", "mxfp8"});
  expect_bad_json([](json& j) { j["policy"]["pretrain_forward.fprop.input"] = {{"format", "bf16"}, {"rounding", "nearest"}}; },
                  {"policy.pretrain_forward.fprop.input.rounding", "bf16 operand"});
  expect_bad_json([](json& j) { j["policy"].erase("rl_trainer.wgrad.input"); },
                  {"policy.rl_trainer.wgrad.input", "missing"});
  expect_bad_json([](json& j) { j["policy"]["pretrain_forward.dgrad.input"] = {{"format", "bf16"}}; },
                  {"pretrain_forward.dgrad.input", "does not run dgrad"});
  expect_bad_json([](json& j) { j["format_version"] = 2; }, {"format_version", "upgrade fourbit"});
  expect_bad_json([](json& j) { j["high_precision"]["kinds"] = {"router", "lm-head"}; },
                  {"high_precision.kinds", "'lm-head'", "qkv, attn_out, mlp_up"});
  expect_bad_json([](json& j) { j["high_precision"]["last_blocks"] = 1.5; },
                  {"high_precision.last_blocks", "an integer"});
  expect_bad_json([](json& j) { j["high_precision"]["tail"] = 2; },
                  {"high_precision.tail", "allowed: kinds, last_blocks_fraction, last_blocks, first_blocks"});
  expect_bad_json([](json& j) { j["overrides"] = json::parse(R"([{"blocks": [[0, 1]], "set": {}, "when": 1}])"); },
                  {"overrides[0].when", "allowed: blocks, kinds, set"});
  expect_bad_json([](json& j) { j["overrides"] = json::parse(R"([{"blocks": [[0, 1, 2]], "set": {}}])"); },
                  {"overrides[0].blocks", "[first, last]"});
  expect_bad_json([](json& j) { j["allow_sampler_mismatch"] = 1; }, {"allow_sampler_mismatch", "true or false"});
  // Values that parse but break a rule: validated like any recipe.
  expect_bad_json([](json& j) { j["policy"]["rl_sampler.fprop.input"]["rounding"] = "stochastic"; },
                  {"rl_sampler.fprop.input.rounding", "deterministic"});
  // Block indices may be given bare.
  json j = to_json(preset("nvfp4"));
  j["overrides"] = json::parse(R"([{"blocks": [3], "set": {"pretrain_forward.fprop.input": {"format": "bf16"}}}])");
  EXPECT_EQ(recipe_from_json(j).overrides[0].blocks, (std::vector<BlockRange>{{3, 3}}));
}

TEST(RecipeJson, RecipeFiles) {
  const std::string path = ::testing::TempDir() + "fourbit_recipe_test.json";
  {
    std::ofstream f(path);
    f << to_json(everything_recipe()).dump(2);
  }
  EXPECT_TRUE(load_recipe_file(path) == everything_recipe());
  {
    std::ofstream f(path);  // a resolved recipe (fourbit recipe --output, checkpoints) loads too
    f << to_json(resolve(everything_recipe(), dense(6))).dump();
  }
  EXPECT_TRUE(load_recipe_file(path) == everything_recipe());
  {
    std::ofstream f(path);
    f << "{\"format_version\": 1,";
  }
  expect_error([&] { load_recipe_file(path); }, {path, "not valid JSON"});
  {
    std::ofstream f(path);
    json j = to_json(preset("e2e4"));
    j["policy"]["rl_trainer.fprop.weight"]["block_2d"] = true;
    f << j.dump();
  }
  expect_error([&] { load_recipe_file(path); }, {path, "rl_trainer.fprop.weight.block_2d", "allow_sampler_mismatch"});
  std::remove(path.c_str());
  expect_error([&] { load_recipe_file(path); }, {"cannot open", path});
}

TEST(RecipeSet, OperandFieldsAndFormats) {
  Recipe r = preset("nvfp4");
  apply_sets(r, {"pretrain_backward.wgrad.input.rht_signs=random", "pretrain_backward.wgrad.gradient.rht_signs=random",
                 "pretrain_backward.*.*.rht_seed=42", "pretrain_backward.dgrad.gradient.sr_unbiased_scale=true"});
  EXPECT_EQ(r.name, "nvfp4+set");
  EXPECT_EQ(r.policy.at(parse_slot("pretrain_backward.wgrad.input"))->rht_seed, 42u);
  EXPECT_EQ(r.policy.at(parse_slot("pretrain_backward.wgrad.gradient"))->rht_seed, 42u);
  EXPECT_TRUE(r.policy.at(parse_slot("pretrain_backward.dgrad.gradient"))->sr_unbiased_scale);
  // rht=false drops the fields that only made sense with it (here on both Wgrad operands).
  apply_sets(r, {"pretrain_backward.wgrad.*.rht=false"});
  EXPECT_EQ(r.policy.at(parse_slot("pretrain_backward.wgrad.input"))->rht_signs, quant::HadamardSigns::kFixed);
  EXPECT_EQ(r.policy.at(parse_slot("pretrain_backward.wgrad.input"))->rht_seed, 0u);

  // A new format starts from its defaults; the same format keeps the operand.
  Recipe f = preset("nvfp4");
  apply_sets(f, {"pretrain_forward.fprop.weight.format=nvfp4"});
  EXPECT_TRUE(f.policy.at(parse_slot("pretrain_forward.fprop.weight"))->block_2d);
  apply_sets(f, {"pretrain_forward.fprop.*=mxfp8", "pretrain_backward.*.*=mxfp8",
                 "pretrain_backward.*.gradient.rounding=stochastic"});
  for (const Slot& s : all_slots()) {
    if (s.stage != Stage::kPretrainForward && s.stage != Stage::kPretrainBackward) continue;
    const Precision& p = f.policy.at(s);
    EXPECT_TRUE(same_precision(p, config(Format::kMxfp8, false,
                                         s.operand == Operand::kGradient ? Rounding::kStochastic
                                                                         : Rounding::kNearest)))
        << s.path() << ": " << describe(p);
  }
  // The whole RL trainer backward in BF16.
  Recipe b = preset("e2e4");
  apply_sets(b, {"rl_trainer.dgrad.*=bf16", "rl_trainer.wgrad.*.format=bf16"});
  EXPECT_EQ(resolve(b, dense(12)).linear(Stage::kRlTrainer, 0, LinearKind::kQkv).wgrad_x.quant, std::nullopt);
}

TEST(RecipeSet, ErrorsNameTheKey) {
  Recipe r = preset("nvfp4");
  expect_error([&] { apply_set(r, "pretrain_forward.fprop.input.rounding"); }, {"key=value"});
  expect_error([&] { apply_set(r, "pretrain_forward.fprop.input.rounding=up"); },
               {"pretrain_forward.fprop.input.rounding", "'up'", "nearest, stochastic"});
  expect_error([&] { apply_set(r, "pretrain_forward.fprop.input.blocks=2"); },
               {"unknown operand field 'blocks'", "block_2d"});
  expect_error([&] { apply_set(r, "pretrain_forward.fprop.gradient.rounding=nearest"); },
               {"pretrain_forward.fprop.gradient", "input and weight"});
  expect_error([&] { apply_set(r, "pretraining.*.input=bf16"); }, {"unknown stage 'pretraining'", "rl_sampler"});
  expect_error([&] { apply_set(r, "pretrain_forward.dgrad.*=bf16"); }, {"matches no"});
  expect_error([&] { apply_set(r, "pretrain_forward.fprop.input.mx_scale_rule=floor"); },
               {"mx_scale_rule applies to mxfp8 only", "nvfp4 1x16 rn"});
  expect_error([&] { apply_set(r, "*.*.*.mx_scale_rule=floor"); }, {"mx_scale_rule applies to mxfp8"});
  expect_error([&] { apply_set(r, "pretrain_backward.wgrad.input.rht_seed=x"); }, {"'x'", "unsigned"});
  expect_error([&] { apply_set(r, "high_precision.last=2"); }, {"high_precision.last", "last_blocks_fraction"});
  expect_error([&] { apply_set(r, "high_precision.kinds=router,head"); }, {"'head'", "lm_head"});
  expect_error([&] { apply_set(r, "allow_sampler_mismatch=yes"); }, {"allow_sampler_mismatch", "true, false"});
  Recipe b = preset("bf16");
  expect_error([&] { apply_set(b, "rl_sampler.fprop.input.rounding=nearest"); }, {"is bf16", "format first"});
  // Combinations are validated after all settings: the contract needs both sides.
  Recipe c = preset("nvfp4");
  expect_error([&] { apply_sets(c, {"rl_sampler.fprop.weight.block_2d=false"}); },
               {"rl_trainer.fprop.weight.block_2d", "allow_sampler_mismatch"});
  Recipe d = preset("nvfp4");
  EXPECT_NO_THROW(apply_sets(d, {"rl_sampler.fprop.weight.block_2d=false", "rl_trainer.fprop.weight.block_2d=false"}));
  Recipe e = preset("nvfp4");
  EXPECT_NO_THROW(apply_sets(e, {"rl_sampler.fprop.weight.block_2d=false", "allow_sampler_mismatch=true"}));
  EXPECT_EQ(resolve(e, dense(12)).sampler_mismatches().size(), 40u);
  Recipe g = preset("nvfp4");
  expect_error([&] { apply_sets(g, {"pretrain_forward.fprop.weight.rht=true"}); },
               {"pretrain_forward.fprop.weight.rht"});
}

TEST(RecipeSet, HighPrecisionKeys) {
  Recipe r = preset("nvfp4");
  apply_sets(r, {"high_precision.last_blocks=3", "high_precision.first_blocks=2", "high_precision.kinds="});
  EXPECT_EQ(r.high_precision.last_blocks, 3);
  EXPECT_EQ(r.high_precision.first_blocks, 2);
  EXPECT_TRUE(r.high_precision.kinds.empty());
  const ResolvedRecipe rr = resolve(r, dense(12));
  EXPECT_TRUE(rr.is_high_precision(1, LinearKind::kQkv));
  EXPECT_FALSE(rr.is_high_precision(2, LinearKind::kQkv));
  EXPECT_TRUE(rr.is_high_precision(9, LinearKind::kQkv));
  EXPECT_FALSE(rr.is_high_precision(0, LinearKind::kLmHead));
  apply_sets(r, {"high_precision.last_blocks=none", "high_precision.last_blocks_fraction=0.25",
                 "high_precision.kinds=lm_head,router"});
  EXPECT_EQ(r.high_precision.last_blocks, std::nullopt);
  EXPECT_EQ(r.high_precision.last_block_count(12), 3);
  expect_error([&] { apply_sets(r, {"high_precision.last_blocks_fraction=2"}); },
               {"high_precision.last_blocks_fraction", "[0, 1]"});
}

TEST(RecipeSet, HelpListsEveryField) {
  const std::string help = settable_keys_help();
  for (const char* f : {"format", "block_2d", "rounding", "rht", "rht_signs", "rht_seed", "nvfp4_scale_rule",
                        "four_over_six_metric", "sr_unbiased_scale", "mx_scale_rule", "fp8_pow2_scales",
                        "high_precision.kinds", "allow_sampler_mismatch", "rl_trainer.wgrad.input"}) {
    EXPECT_NE(help.find(f), std::string::npos) << f;
  }
}

}  // namespace
}  // namespace fourbit::recipe
