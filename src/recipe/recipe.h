// The precision policy as data: for every stage of a model's life, every GEMM of a linear layer
// and every operand of that GEMM, the quantizer to use (quant::QuantConfig) or none (BF16); the
// high-precision exceptions; per-layer overrides; presets; validation; resolution to the
// gemm::LinearRecipe of each (stage, block, linear kind); a printed table; JSON (checkpoints).
// The policy itself is ../shared/docs/DESIGN.md ("the four stages") and NUMERICS.md sections 4-6
// and 10; the RL rules are RL.md ("Precision rules").
//
// Stages and the GEMMs they run (a linear layer Y = X W^T; gemm/linear.h):
//   pretrain_forward   Fprop  Y  = X . W^T    operands input (X),         weight (W)
//   pretrain_backward  Dgrad  dX = dY . W     operands gradient (dY),     weight (W, column-wise)
//                      Wgrad  dW = dY^T . X   operands gradient (dY^T),   input (X^T)
//   rl_sampler         Fprop (prefill and decode)
//   rl_trainer         Fprop (the sampler's exact quantizer contract), Dgrad, Wgrad
// That is 14 slots (stage x GEMM x operand); each holds a QuantConfig or nothing (BF16). The
// orientation of each operand (row-wise or column-wise blocks) is not a choice: the GEMM dictates
// it (quant/quantize.h).
//
// Resolution order for one linear layer (block b, kind k): the recipe's policy, then each override
// whose selector matches (in order; later wins), then the high-precision exceptions (they win: the
// tail blocks, the first blocks and the kinds listed in high_precision are BF16 in every stage). To
// run the tail in another format instead of BF16, set high_precision.last_blocks to 0 and add an
// override for those blocks (negative block indices count from the end).
//
// Invariants of a validated recipe: every quantized operand passes quant::QuantConfig::validate(),
// fields that do not apply to an operand's format are at their defaults (so equal policies have
// equal JSON), and the checks listed at Recipe::validate() hold in every resolved layer.
// Errors are fourbit::Error with a message that names the field, e.g.
//   recipe 'nvfp4': pretrain_forward.fprop.weight.rht: ...
#pragma once

#include "gemm/linear.h"
#include "quant/quantize.h"

#include <nlohmann/json_fwd.hpp>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fourbit::recipe {

enum class Stage : uint8_t { kPretrainForward, kPretrainBackward, kRlSampler, kRlTrainer };
enum class Gemm : uint8_t { kFprop, kDgrad, kWgrad };
enum class Operand : uint8_t { kInput, kWeight, kGradient };
// The linear layers of a transformer. mlp_up is the fused gate+up projection of a SwiGLU MLP (also
// a MoE block's shared expert); expert_up / expert_down are the routed experts' grouped GEMMs;
// router and expert_* exist only in MoE blocks; lm_head sits after the last block.
enum class LinearKind : uint8_t {
  kQkv, kAttnOut, kMlpUp, kMlpDown, kExpertUp, kExpertDown, kRouter, kLmHead
};

inline constexpr std::array<Stage, 4> kStages = {Stage::kPretrainForward, Stage::kPretrainBackward,
                                                 Stage::kRlSampler, Stage::kRlTrainer};
inline constexpr std::array<Gemm, 3> kGemms = {Gemm::kFprop, Gemm::kDgrad, Gemm::kWgrad};
inline constexpr std::array<LinearKind, 8> kLinearKinds = {
    LinearKind::kQkv,      LinearKind::kAttnOut,    LinearKind::kMlpUp,  LinearKind::kMlpDown,
    LinearKind::kExpertUp, LinearKind::kExpertDown, LinearKind::kRouter, LinearKind::kLmHead};

std::string_view stage_name(Stage s);        // "pretrain_forward", ...
std::string_view gemm_name(Gemm g);          // "fprop", "dgrad", "wgrad"
std::string_view operand_name(Operand o);    // "input", "weight", "gradient"
std::string_view kind_name(LinearKind k);    // "qkv", "attn_out", ...
// Parse a name; throws naming `field` and listing the allowed names.
LinearKind parse_kind(std::string_view name, std::string_view field);

bool stage_runs(Stage s, Gemm g);
// The two operands of a GEMM in (A, B) order: fprop (input, weight), dgrad (gradient, weight),
// wgrad (gradient, input).
std::array<Operand, 2> gemm_operands(Gemm g);

struct Slot {
  Stage stage;
  Gemm gemm;
  Operand operand;
  std::string path() const;  // "pretrain_backward.wgrad.gradient"
  friend bool operator==(const Slot&, const Slot&) = default;
};

inline constexpr int kNumSlots = 14;
// Every slot, in table order (stage, then GEMM, then the GEMM's operands in (A, B) order).
const std::array<Slot, kNumSlots>& all_slots();
// "stage.gemm.operand" -> the slot; throws naming the path and what is allowed.
Slot parse_slot(std::string_view path);

// One operand's precision: quantized with this config, or BF16 (nullopt: no quantization).
using Precision = std::optional<quant::QuantConfig>;
bool same_precision(const Precision& a, const Precision& b);  // every field equal
std::string describe(const Precision& p);                      // "bf16", "nvfp4 16x16 rn", ...

// The precision of every slot, for one linear layer (or the recipe's default for all of them).
class Policy {
 public:
  static Policy bf16();  // every slot BF16
  Precision& at(Slot s);  // throws if the stage does not run the GEMM or it has no such operand
  const Precision& at(Slot s) const;
  Precision& at(Stage s, Gemm g, Operand o) { return at(Slot{s, g, o}); }
  const Precision& at(Stage s, Gemm g, Operand o) const { return at(Slot{s, g, o}); }
  friend bool operator==(const Policy& a, const Policy& b);

 private:
  std::array<Precision, kNumSlots> slots_;  // indexed like all_slots()
};

// Blocks first..last inclusive; a negative index counts from the end (-1 = the last block).
struct BlockRange {
  int first = 0, last = -1;
  friend bool operator==(const BlockRange&, const BlockRange&) = default;
};

// A patch for the policy of the layers it selects.
struct Override {
  std::vector<BlockRange> blocks;  // empty: every block (and lm_head, if `kinds` selects it)
  std::vector<LinearKind> kinds;   // empty: every kind
  std::vector<std::pair<Slot, Precision>> set;  // a map: each slot at most once
  friend bool operator==(const Override& a, const Override& b);
};

// What stays BF16 in every stage, whatever the policy and the overrides say (DESIGN.md; NVIDIA's
// recipe, NUMERICS.md 4.5). Embeddings, norms, softmax and the attention products are not GEMMs of
// a linear layer and never go through the recipe; ResolvedRecipe::exceptions() lists them too.
struct HighPrecision {
  static std::vector<LinearKind> default_kinds();  // router, lm_head
  std::vector<LinearKind> kinds = default_kinds();
  // The last blocks: round(last_blocks_fraction * n_layers), halves rounded up (12 blocks at 0.15:
  // 1.8 -> 2; 10 -> 1.5 -> 2; 24 -> 3.6 -> 4), unless last_blocks gives the count directly.
  double last_blocks_fraction = 0.15;
  std::optional<int> last_blocks;
  int first_blocks = 0;
  int last_block_count(int n_layers) const;
  friend bool operator==(const HighPrecision&, const HighPrecision&) = default;
};

struct Recipe {
  std::string name;
  Policy policy;
  HighPrecision high_precision;
  std::vector<Override> overrides;
  // The RL trainer's Fprop must equal the sampler's (RL.md: the mismatch comes from different
  // numerics); true allows a difference, for ablations that measure it.
  bool allow_sampler_mismatch = false;

  // Layer-independent checks of the policy and of every override's patch (each applied to the
  // policy), throwing on the first violation with the field's path:
  //  - a field that does not apply to the operand's format is at its default (e.g. block_2d on
  //    mxfp8, rht on fp8, rht_signs without rht); quant::QuantConfig::validate() passes;
  //  - block_2d only on weight operands (activations and gradients have 1D blocks along K);
  //  - rht only on the Wgrad operands, on both or neither, with the same signs;
  //  - an fp8 operand pairs with an fp8 operand of the same scaling (cuBLASLt), never 128x128 on
  //    both;
  //  - rl_sampler.fprop rounds to nearest (the sampler is deterministic; RL.md);
  //  - rl_trainer's dgrad/wgrad gradients are BF16 or stochastically rounded (unbiased backward);
  //  - rl_trainer.fprop equals rl_sampler.fprop unless allow_sampler_mismatch;
  //  - high_precision counts are >= 0 and the fraction lies in [0, 1].
  // An override's slots are checked one by one here; the rules between slots (GEMM pairs, the
  // sampler contract) and the model-dependent ones (block ranges) are checked by resolve() on each
  // layer's effective policy, after all overrides.
  void validate() const;
  friend bool operator==(const Recipe& a, const Recipe& b);
};

// ---- presets (presets.cpp documents each one and its sources) --------------------------------
std::vector<std::string_view> preset_names();  // bf16, fp8, mxfp8, nvfp4, nvfp4-46, e2e4
Recipe preset(std::string_view name);          // throws listing the names
// `--sampler-recipe` of `fourbit rl` and `fourbit sample`, and `fourbit bench decode`: the recipe
// with the RL Fprop (rl_sampler and rl_trainer, the quantizer contract kept) set to "bf16" (no quantization), "nvfp4" (the e2e4 preset's NVFP4
// sampler operands: 1x16 weights, activations with a per-token global amax, so a decode step
// quantizes each token exactly as the training forward does), "nvfp4-tensor-amax" (the same with
// one activation amax per pass instead: a decode step's few rows and the training forward's whole
// batch then get different global scales; kept to measure what per-token scales buy) or
// "nvfp4-weights" (NVFP4 weights, BF16 activations); "recipe" returns it unchanged. Other stages
// are untouched; validated.
Recipe with_sampler_precision(Recipe r, std::string_view which);

// ---- --set style overrides (set.cpp) -----------------------------------------------------------
// Applies one "key=value". Keys:
//   stage.gemm.operand=FORMAT           bf16, or a format (starts the operand afresh from that
//                                       format's defaults; the same format keeps it unchanged)
//   stage.gemm.operand.FIELD=VALUE      format or one QuantConfig field (settable_keys_help())
//   any of stage, gemm, operand may be `*`: every existing slot that matches (fields: every match
//                                       the field applies to; an error if none)
//   high_precision.kinds=router,lm_head (comma list; empty for none)
//   high_precision.last_blocks_fraction=0.15 | high_precision.last_blocks=N|none
//   high_precision.first_blocks=N       allow_sampler_mismatch=true|false
// Values are checked here; combinations are checked by validate(), which apply_sets() calls after
// applying them all (some valid recipes need several settings to reach). The name gets "+set".
void apply_set(Recipe& recipe, std::string_view assignment);
void apply_sets(Recipe& recipe, const std::vector<std::string>& assignments);
std::string settable_keys_help();  // one line per key, from the declared field table

// ---- JSON (json.cpp) -----------------------------------------------------------------------------
// Every key is written; parsing rejects unknown keys and bad values naming the key and the allowed
// values, requires every slot in "policy", and validates. to_json -> from_json is exact.
nlohmann::json to_json(const Recipe& recipe);
Recipe recipe_from_json(const nlohmann::json& j);
// A user's own recipe: a JSON file holding a recipe, or a resolved recipe (its "recipe" part).
Recipe load_recipe_file(const std::string& path);

// ---- resolution (resolve.cpp) --------------------------------------------------------------------
struct ModelShape {
  int n_layers = 0;
  std::vector<int> moe_blocks;  // indices of the MoE blocks (router, expert_up, expert_down)
  bool shared_experts = false;  // MoE blocks also have a dense MLP (mlp_up, mlp_down)
  bool is_moe(int block) const;
  bool has(int block, LinearKind kind) const;  // whether block `block` has this linear layer
  friend bool operator==(const ModelShape&, const ModelShape&) = default;
};

// A place that stays in high precision, for the printed table and logs.
struct HighPrecisionException {
  std::string what;       // "blocks 10-11", "lm_head", "embeddings", ...
  std::string precision;  // "bf16 GEMMs in every stage", "fp32", ...
  std::string why;        // the rule and its source
};

class ResolvedRecipe {
 public:
  const Recipe& recipe() const { return recipe_; }
  const ModelShape& shape() const { return shape_; }

  // The effective policy of one linear layer. `block` in [0, n_layers); ignored for lm_head.
  // Throws for kinds the block does not have (router / expert_* in a dense block).
  const Policy& policy(int block, LinearKind kind) const;
  // The operands of the GEMMs `stage` runs; the GEMMs it does not run are left plain (for the
  // sampler only the Fprop operands are set). Pretraining runs all three GEMMs: use
  // pretrain_linear(), which takes Fprop from pretrain_forward and Dgrad/Wgrad from
  // pretrain_backward. RL training uses linear(Stage::kRlTrainer, ...).
  gemm::LinearRecipe linear(Stage stage, int block, LinearKind kind) const;
  gemm::LinearRecipe pretrain_linear(int block, LinearKind kind) const;
  // Whether the high-precision exceptions made this layer BF16 in every stage.
  bool is_high_precision(int block, LinearKind kind) const;
  const std::vector<HighPrecisionException>& exceptions() const { return exceptions_; }
  // Layers whose rl_trainer Fprop differs from rl_sampler's ("block 3 qkv: weight ..."); empty
  // unless recipe().allow_sampler_mismatch.
  const std::vector<std::string>& sampler_mismatches() const { return sampler_mismatches_; }

  // The readable table: rows stage x GEMM x operand of the policy, columns format / block /
  // rounding / RHT / scale rule; then the exceptions, the overrides and a map of every layer.
  std::string table() const;

 private:
  friend ResolvedRecipe resolve(const Recipe& recipe, const ModelShape& shape);
  struct Layer {
    Policy policy;
    bool high_precision = false;
    std::vector<int> overrides;  // indices of the overrides that matched, in order
    bool present = false;        // the block has this kind
  };
  const Layer& layer(int block, LinearKind kind) const;

  Recipe recipe_;
  ModelShape shape_;
  std::vector<Layer> layers_;  // (n_layers + 1, kinds): the last row holds lm_head
  std::vector<HighPrecisionException> exceptions_;
  std::vector<std::string> sampler_mismatches_;
};

// Validates the recipe and resolves it for a model: every (block, kind) the model has, with the
// same checks as Recipe::validate() on each layer's effective policy. Throws naming the layer and
// the field.
ResolvedRecipe resolve(const Recipe& recipe, const ModelShape& shape);

// {"recipe": to_json(recipe), "model": {"n_layers": N, "moe_blocks": [...]}}; parsing resolves
// again (what a checkpoint stores and reloads).
nlohmann::json to_json(const ResolvedRecipe& resolved);
ResolvedRecipe resolved_from_json(const nlohmann::json& j);

}  // namespace fourbit::recipe
