// Names, slots, Policy and the validation rules of recipe.h. Each rule says where it comes from;
// the message names the slot and field, and what to do instead.
#include "recipe/recipe.h"

#include "recipe/internal.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace fourbit::recipe {

using detail::fail;

std::string_view stage_name(Stage s) {
  switch (s) {
    case Stage::kPretrainForward: return "pretrain_forward";
    case Stage::kPretrainBackward: return "pretrain_backward";
    case Stage::kRlSampler: return "rl_sampler";
    case Stage::kRlTrainer: return "rl_trainer";
  }
  return "?";
}

std::string_view gemm_name(Gemm g) {
  switch (g) {
    case Gemm::kFprop: return "fprop";
    case Gemm::kDgrad: return "dgrad";
    case Gemm::kWgrad: return "wgrad";
  }
  return "?";
}

std::string_view operand_name(Operand o) {
  switch (o) {
    case Operand::kInput: return "input";
    case Operand::kWeight: return "weight";
    case Operand::kGradient: return "gradient";
  }
  return "?";
}

std::string_view kind_name(LinearKind k) {
  switch (k) {
    case LinearKind::kQkv: return "qkv";
    case LinearKind::kAttnOut: return "attn_out";
    case LinearKind::kMlpUp: return "mlp_up";
    case LinearKind::kMlpDown: return "mlp_down";
    case LinearKind::kExpertUp: return "expert_up";
    case LinearKind::kExpertDown: return "expert_down";
    case LinearKind::kRouter: return "router";
    case LinearKind::kLmHead: return "lm_head";
  }
  return "?";
}

LinearKind parse_kind(std::string_view name, std::string_view field) {
  for (LinearKind k : kLinearKinds) {
    if (kind_name(k) == name) return k;
  }
  std::vector<std::string_view> names;
  for (LinearKind k : kLinearKinds) names.push_back(kind_name(k));
  fail(field, fmt::format("unknown linear kind '{}'; allowed: {}", name, fmt::join(names, ", ")));
}

bool stage_runs(Stage s, Gemm g) {
  switch (s) {
    case Stage::kPretrainForward: return g == Gemm::kFprop;
    case Stage::kPretrainBackward: return g != Gemm::kFprop;
    case Stage::kRlSampler: return g == Gemm::kFprop;
    case Stage::kRlTrainer: return true;
  }
  return false;
}

std::array<Operand, 2> gemm_operands(Gemm g) {
  switch (g) {
    case Gemm::kFprop: return {Operand::kInput, Operand::kWeight};
    case Gemm::kDgrad: return {Operand::kGradient, Operand::kWeight};
    case Gemm::kWgrad: return {Operand::kGradient, Operand::kInput};
  }
  return {Operand::kInput, Operand::kWeight};
}

std::string Slot::path() const {
  return fmt::format("{}.{}.{}", stage_name(stage), gemm_name(gemm), operand_name(operand));
}

namespace {

std::array<Slot, kNumSlots> make_slots() {
  std::array<Slot, kNumSlots> slots{};
  size_t i = 0;
  for (Stage s : kStages)
    for (Gemm g : kGemms)
      if (stage_runs(s, g))
        for (Operand o : gemm_operands(g)) slots[i++] = {s, g, o};
  return slots;
}

int slot_index(Slot s) {
  const auto& slots = all_slots();
  const auto it = std::find(slots.begin(), slots.end(), s);
  return it == slots.end() ? -1 : (int)(it - slots.begin());
}

std::string gemm_list(Stage s) {
  std::vector<std::string_view> g;
  for (Gemm x : kGemms)
    if (stage_runs(s, x)) g.push_back(gemm_name(x));
  return fmt::format("{}", fmt::join(g, ", "));
}

// Why a (stage, gemm, operand) triple is not a slot.
std::string not_a_slot(Slot s) {
  if (!stage_runs(s.stage, s.gemm)) {
    return fmt::format("stage {} does not run {} (it runs {})", stage_name(s.stage),
                       gemm_name(s.gemm), gemm_list(s.stage));
  }
  const auto ops = gemm_operands(s.gemm);
  return fmt::format("{} has no {} operand (its operands are {} and {})", gemm_name(s.gemm),
                     operand_name(s.operand), operand_name(ops[0]), operand_name(ops[1]));
}

}  // namespace

const std::array<Slot, kNumSlots>& all_slots() {
  static const std::array<Slot, kNumSlots> slots = make_slots();
  return slots;
}

Slot parse_slot(std::string_view path) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    const size_t dot = path.find('.', start);
    parts.push_back(path.substr(start, dot == std::string_view::npos ? dot : dot - start));
    if (dot == std::string_view::npos) break;
    start = dot + 1;
  }
  if (parts.size() != 3) {
    fail(path, "a slot is stage.gemm.operand, e.g. pretrain_backward.wgrad.gradient");
  }
  auto find = [&](auto values, auto name_of, std::string_view part, std::string_view what) {
    std::vector<std::string_view> names;
    for (auto v : values) {
      if (name_of(v) == part) return v;
      names.push_back(name_of(v));
    }
    fail(path, fmt::format("unknown {} '{}'; allowed: {}", what, part, fmt::join(names, ", ")));
  };
  const Slot s{find(kStages, stage_name, parts[0], "stage"), find(kGemms, gemm_name, parts[1], "gemm"),
               find(std::array{Operand::kInput, Operand::kWeight, Operand::kGradient}, operand_name,
                    parts[2], "operand")};
  if (slot_index(s) < 0) fail(path, not_a_slot(s));
  return s;
}

bool same_precision(const Precision& a, const Precision& b) {
  return detail::first_difference(a, b).empty();
}

std::string describe(const Precision& p) { return p ? p->describe() : std::string("bf16"); }

// ---- Policy ------------------------------------------------------------------------------------

Policy Policy::bf16() { return Policy{}; }

namespace {
size_t checked_slot_index(Slot s) {
  const int i = slot_index(s);
  if (i < 0) fail(s.path(), not_a_slot(s));
  return (size_t)i;
}
}  // namespace

Precision& Policy::at(Slot s) { return slots_[checked_slot_index(s)]; }
const Precision& Policy::at(Slot s) const { return slots_[checked_slot_index(s)]; }

bool operator==(const Policy& a, const Policy& b) {
  for (size_t i = 0; i < a.slots_.size(); ++i) {
    if (!same_precision(a.slots_[i], b.slots_[i])) return false;
  }
  return true;
}

// `set` is a map (validate() rejects a slot set twice): compared regardless of order, the way JSON
// objects are.
bool operator==(const Override& a, const Override& b) {
  if (a.blocks != b.blocks || a.kinds != b.kinds || a.set.size() != b.set.size()) return false;
  for (const auto& [slot, precision] : a.set) {
    const auto it = std::find_if(b.set.begin(), b.set.end(), [&](const auto& e) { return e.first == slot; });
    if (it == b.set.end() || !same_precision(precision, it->second)) return false;
  }
  return true;
}

bool operator==(const Recipe& a, const Recipe& b) {
  return a.name == b.name && a.policy == b.policy && a.high_precision == b.high_precision &&
         a.overrides == b.overrides && a.allow_sampler_mismatch == b.allow_sampler_mismatch;
}

std::vector<LinearKind> HighPrecision::default_kinds() {
  return {LinearKind::kRouter, LinearKind::kLmHead};
}

int HighPrecision::last_block_count(int n_layers) const {
  if (last_blocks) return *last_blocks;
  // The epsilon absorbs the binary representation of the fraction (0.15 * 10 = 1.4999...98).
  return (int)std::floor(last_blocks_fraction * n_layers + 0.5 + 1e-9);
}

// ---- validation ----------------------------------------------------------------------------------

namespace detail {

void sort_by_slot(std::vector<std::pair<Slot, Precision>>& set) {
  std::stable_sort(set.begin(), set.end(), [](const auto& a, const auto& b) {
    return slot_index(a.first) < slot_index(b.first);
  });
}

std::string first_difference(const Precision& a, const Precision& b) {
  if (a.has_value() != b.has_value()) return "format";
  if (!a) return "";
  if (a->format != b->format) return "format";
  for (const OperandField& f : operand_fields()) {
    if (f.get(*a) != f.get(*b)) return std::string(f.name);
  }
  return "";
}

namespace {

bool is_fp8(const Precision& p) {
  return p && (p->format == quant::Format::kFp8Block || p->format == quant::Format::kFp8Tensor);
}

// The fields of each operand: none set that does not apply to its format.
void check_fields(Slot s, const Precision& p) {
  if (p) check_canonical(*p, s.path());
}

// The quantizer's own checks, last: the rules above give the more specific messages.
void check_quantizer(Slot s, const Precision& p) {
  if (p) with_context(s.path(), [&] { p->validate(); });
}

// Rules that involve both operands of one GEMM (what cuBLASLt and the emulated GEMM accept).
void check_gemm(const Policy& policy, Stage stage, Gemm gemm) {
  const auto [oa, ob] = gemm_operands(gemm);
  const Slot sa{stage, gemm, oa}, sb{stage, gemm, ob};
  const Precision &a = policy.at(sa), &b = policy.at(sb);
  // gemm.cpp: an FP8 GEMM takes two FP8 operands with the same scaling, and never 2D x 2D.
  if (is_fp8(a) || is_fp8(b)) {
    const Slot& other = is_fp8(a) ? sb : sa;
    const Precision& fp8 = is_fp8(a) ? a : b;
    const Precision& q = is_fp8(a) ? b : a;
    if (!is_fp8(q) || q->format != fp8->format) {
      fail(other.path() + ".format",
           fmt::format("is {}, but the other operand of this GEMM is {}: cuBLASLt FP8 GEMMs take two "
                       "FP8 operands with the same scaling (both fp8-block or both fp8-tensor)",
                       describe(q), describe(fp8)));
    }
    if (a->block_2d && b->block_2d) {
      // Named on the operand to change: the activation or gradient (Wgrad has no weight).
      fail(sa.path() + ".block_2d",
           fmt::format("fp8-block 128x128 on both operands of {}.{} ({} and {}): cuBLASLt has no "
                       "2D x 2D FP8 GEMM; give the activation or gradient 1x128 blocks",
                       stage_name(stage), gemm_name(gemm), operand_name(oa), operand_name(ob)));
    }
  }
  // NUMERICS.md 4.2, gemm.cpp: the Hadamard transform cancels (H H^T = I) only when both Wgrad
  // operands carry it with the same signs.
  if (gemm == Gemm::kWgrad) {
    const bool ra = a && a->rht, rb = b && b->rht;
    if (ra != rb) {
      fail((ra ? sb : sa).path() + ".rht",
           fmt::format("the random Hadamard transform must be on both Wgrad operands or on neither "
                       "({} has rht = {}, {} has rht = {})",
                       operand_name(oa), ra, operand_name(ob), rb));
    }
    if (ra && a->rht_sign_mask() != b->rht_sign_mask()) {
      fail(sb.path() + ".rht_signs",
           "both Wgrad operands need the same RHT sign vector (rht_signs and rht_seed), or the "
           "transforms do not cancel");
    }
  }
}

// Rules that depend on the operand's role and stage.
void check_role(Slot s, const Precision& p) {
  if (!p) return;
  const std::string path = s.path();
  // NUMERICS.md 4.3: 2D tiles exist so that Fprop and Dgrad see one quantized weight. An
  // activation or gradient is scaled per token along K (1x16, 1x32, 1x128).
  if (p->block_2d && s.operand != Operand::kWeight) {
    fail(path + ".block_2d",
         fmt::format("2D blocks are for weights; the {} (an activation-shaped tensor, one row per "
                     "token) takes 1D blocks along the reduction dimension",
                     operand_name(s.operand)));
  }
  // NUMERICS.md 4.2: the RHT is applied to the Wgrad operands only, along tokens (the column-wise
  // copies); on a weight it would break Fprop/Dgrad consistency, and Fprop/Dgrad inputs get worse.
  if (p->rht && s.gemm != Gemm::kWgrad) {
    fail(path + ".rht",
         s.operand == Operand::kWeight
             ? std::string("no RHT on a weight operand: the transform along tokens applies only to "
                           "the Wgrad operands (dY^T and X^T), and a transformed weight would break "
                           "Fprop/Dgrad consistency (NUMERICS 4.2)")
             : fmt::format("the random Hadamard transform applies only to the Wgrad operands (the "
                           "column-wise copies along tokens), not to {} (NUMERICS 4.2)",
                           gemm_name(s.gemm)));
  }
  // quant/quantize.h: a per-row global amax exists for the row-wise copy, and the GEMMs apply it
  // to the rows of C: the token-side operand A of Fprop (X) and Dgrad (dY).
  const bool token_rows = (s.gemm == Gemm::kFprop && s.operand == Operand::kInput) ||
                          (s.gemm == Gemm::kDgrad && s.operand == Operand::kGradient);
  if (p->nvfp4_row_amax && !token_rows) {
    fail(path + ".nvfp4_row_amax",
         fmt::format("a per-token (per-row) amax applies to the token-side row-wise operands only (fprop "
                     "input, dgrad gradient), not to {}.{}",
                     gemm_name(s.gemm), operand_name(s.operand)));
  }
  // RL.md: the sampler is a deterministic function of the weights (importance ratios need it).
  if (s.stage == Stage::kRlSampler && p->rounding == quant::Rounding::kStochastic) {
    fail(path + ".rounding",
         "the RL sampler must be deterministic (RL.md 'Precision rules'): round to nearest");
  }
  // RL.md: "The trainer's backward must be unbiased: stochastic rounding on gradients, or BF16."
  if (s.stage == Stage::kRlTrainer && s.operand == Operand::kGradient &&
      p->rounding != quant::Rounding::kStochastic) {
    fail(path + ".rounding",
         "the RL trainer's backward must be unbiased (RL.md 'Precision rules'): quantize gradients "
         "with rounding = stochastic, or leave them bf16");
  }
}

}  // namespace

void check_slot(Slot s, const Precision& p) {
  check_fields(s, p);
  check_role(s, p);
  check_quantizer(s, p);
}

void check_policy(const Policy& policy, bool allow_sampler_mismatch) {
  for (const Slot& s : all_slots()) check_fields(s, policy.at(s));
  for (Stage st : kStages)
    for (Gemm g : kGemms)
      if (stage_runs(st, g)) check_gemm(policy, st, g);
  for (const Slot& s : all_slots()) check_role(s, policy.at(s));
  for (const Slot& s : all_slots()) check_quantizer(s, policy.at(s));
  if (allow_sampler_mismatch) return;
  // RL.md: the trainer's forward uses the sampler's exact quantizer contract.
  for (Operand o : gemm_operands(Gemm::kFprop)) {
    const Slot trainer{Stage::kRlTrainer, Gemm::kFprop, o}, sampler{Stage::kRlSampler, Gemm::kFprop, o};
    const std::string field = first_difference(policy.at(trainer), policy.at(sampler));
    if (field.empty()) continue;
    fail(trainer.path() + (field == "format" ? ".format" : "." + field),
         fmt::format("{} differs from {} ({}): the trainer's forward must use the sampler's exact "
                     "quantizer contract (RL.md 'Precision rules'); set both the same, or set "
                     "allow_sampler_mismatch = true for an ablation that measures the mismatch",
                     describe(policy.at(trainer)), sampler.path(), describe(policy.at(sampler))));
  }
}

}  // namespace detail

void Recipe::validate() const {
  detail::with_context(fmt::format("recipe '{}'", name), [&] {
    detail::with_context("policy", [&] { detail::check_policy(policy, allow_sampler_mismatch); });
    const HighPrecision& hp = high_precision;
    if (!(hp.last_blocks_fraction >= 0.0 && hp.last_blocks_fraction <= 1.0)) {
      fail("high_precision.last_blocks_fraction",
           fmt::format("{} is not a fraction in [0, 1]", hp.last_blocks_fraction));
    }
    if (hp.last_blocks && *hp.last_blocks < 0) {
      fail("high_precision.last_blocks", fmt::format("{} is negative", *hp.last_blocks));
    }
    if (hp.first_blocks < 0) {
      fail("high_precision.first_blocks", fmt::format("{} is negative", hp.first_blocks));
    }
    for (size_t i = 0; i < overrides.size(); ++i) {
      const Override& o = overrides[i];
      const std::string where = fmt::format("overrides[{}]", i);
      if (o.set.empty()) fail(where + ".set", "is empty: an override sets at least one slot");
      for (size_t a = 0; a < o.set.size(); ++a)
        for (size_t b = a + 1; b < o.set.size(); ++b)
          if (o.set[a].first == o.set[b].first) {
            fail(where + ".set." + o.set[a].first.path(), "is set twice in one override");
          }
      for (const BlockRange& r : o.blocks) {
        // Same-sign ranges can be ordered without the model; mixed ones are checked in resolve().
        if ((r.first < 0) == (r.last < 0) && r.first > r.last) {
          fail(where + ".blocks", fmt::format("range [{}, {}] is empty (first > last)", r.first, r.last));
        }
      }
      // Each slot on its own; the rules between slots (GEMM pairs, the sampler contract) hold per
      // layer, after all overrides: resolve() checks them.
      for (const auto& [slot, precision] : o.set) {
        detail::with_context(where + ".set", [&] { detail::check_slot(slot, precision); });
      }
    }
  });
}

}  // namespace fourbit::recipe
