// Resolution of a recipe for a model (recipe.h: policy, then overrides in order, then the
// high-precision exceptions), the per-layer checks, and the printed table.
#include "recipe/recipe.h"

#include "recipe/internal.h"

#include <fmt/format.h>

#include <algorithm>

namespace fourbit::recipe {

using detail::fail;

bool ModelShape::is_moe(int block) const {
  return std::find(moe_blocks.begin(), moe_blocks.end(), block) != moe_blocks.end();
}

bool ModelShape::has(int block, LinearKind kind) const {
  switch (kind) {
    case LinearKind::kQkv:
    case LinearKind::kAttnOut: return true;
    case LinearKind::kMlpUp:
    case LinearKind::kMlpDown: return !is_moe(block) || shared_experts;
    case LinearKind::kExpertUp:
    case LinearKind::kExpertDown:
    case LinearKind::kRouter: return is_moe(block);
    case LinearKind::kLmHead: return true;
  }
  return false;
}

namespace {

constexpr size_t kNumKinds = kLinearKinds.size();

std::string block_range_text(int first, int last) {
  return first == last ? fmt::format("{}", first) : fmt::format("{}-{}", first, last);
}

std::string blocks_label(int first, int last) {
  return (first == last ? "block " : "blocks ") + block_range_text(first, last);
}

// An override's block ranges as absolute [first, last] pairs; throws when one leaves the model.
std::vector<std::pair<int, int>> absolute_ranges(const Override& o, int n_layers, const std::string& where) {
  std::vector<std::pair<int, int>> ranges;
  for (const BlockRange& r : o.blocks) {
    const int first = r.first < 0 ? n_layers + r.first : r.first;
    const int last = r.last < 0 ? n_layers + r.last : r.last;
    if (first < 0 || last >= n_layers || first > last) {
      fail(where + ".blocks",
           fmt::format("range [{}, {}] (blocks {}..{}) is empty or outside the model's blocks "
                       "0..{}; negative indices count from the end",
                       r.first, r.last, first, last, n_layers - 1));
    }
    ranges.emplace_back(first, last);
  }
  return ranges;
}

bool selects(const Override& o, const std::vector<std::pair<int, int>>& ranges, int block,
             LinearKind kind) {
  if (!o.kinds.empty() && std::find(o.kinds.begin(), o.kinds.end(), kind) == o.kinds.end()) {
    return false;
  }
  if (o.blocks.empty()) return true;
  if (kind == LinearKind::kLmHead) return false;  // lm_head is in no block
  for (const auto& [first, last] : ranges) {
    if (block >= first && block <= last) return true;
  }
  return false;
}

std::string layer_name(int block, LinearKind kind) {
  return kind == LinearKind::kLmHead ? std::string("lm_head")
                                     : fmt::format("block {} {}", block, kind_name(kind));
}

}  // namespace

ResolvedRecipe resolve(const Recipe& recipe, const ModelShape& shape) {
  recipe.validate();
  ResolvedRecipe out;
  out.recipe_ = recipe;
  out.shape_ = shape;
  const int n = shape.n_layers;
  detail::with_context(fmt::format("recipe '{}'", recipe.name), [&] {
    if (n < 1) fail("model", fmt::format("n_layers must be at least 1, got {}", n));
    for (int b : shape.moe_blocks) {
      if (b < 0 || b >= n) fail("model.moe_blocks", fmt::format("block {} is outside 0..{}", b, n - 1));
      if (std::count(shape.moe_blocks.begin(), shape.moe_blocks.end(), b) > 1) {
        fail("model.moe_blocks", fmt::format("block {} is listed twice", b));
      }
    }
    const HighPrecision& hp = recipe.high_precision;
    const int last = hp.last_block_count(n);
    if (last > n) {
      fail("high_precision.last_blocks", fmt::format("{} exceeds the model's {} blocks", last, n));
    }
    if (hp.first_blocks > n) {
      fail("high_precision.first_blocks", fmt::format("{} exceeds the model's {} blocks", hp.first_blocks, n));
    }
    std::vector<std::vector<std::pair<int, int>>> ranges;
    for (size_t i = 0; i < recipe.overrides.size(); ++i) {
      ranges.push_back(absolute_ranges(recipe.overrides[i], n, fmt::format("overrides[{}]", i)));
    }

    out.layers_.assign((size_t)(n + 1) * kNumKinds, {});
    for (int b = 0; b <= n; ++b) {
      for (LinearKind kind : kLinearKinds) {
        // Row n holds lm_head only; rows 0..n-1 the block linears.
        if ((b == n) != (kind == LinearKind::kLmHead) || !shape.has(b, kind)) continue;
        ResolvedRecipe::Layer& layer = out.layers_[(size_t)b * kNumKinds + (size_t)kind];
        layer.present = true;
        layer.policy = recipe.policy;
        for (size_t i = 0; i < recipe.overrides.size(); ++i) {
          const Override& o = recipe.overrides[i];
          if (!selects(o, ranges[i], b, kind)) continue;
          for (const auto& [slot, precision] : o.set) layer.policy.at(slot) = precision;
          layer.overrides.push_back((int)i);
        }
        const bool by_kind = std::find(hp.kinds.begin(), hp.kinds.end(), kind) != hp.kinds.end();
        const bool by_block = kind != LinearKind::kLmHead && (b < hp.first_blocks || b >= n - last);
        if (by_kind || by_block) {
          layer.policy = Policy::bf16();
          layer.high_precision = true;
        }
        const std::string where =
            layer.overrides.empty()
                ? layer_name(b, kind)
                : fmt::format("{} (after overrides {})", layer_name(b, kind), fmt::join(layer.overrides, ", "));
        detail::with_context(where, [&] {
          detail::check_policy(layer.policy, recipe.allow_sampler_mismatch);
        });
        for (Operand o : gemm_operands(Gemm::kFprop)) {
          const Precision& t = layer.policy.at(Stage::kRlTrainer, Gemm::kFprop, o);
          const Precision& s = layer.policy.at(Stage::kRlSampler, Gemm::kFprop, o);
          if (!same_precision(t, s)) {
            out.sampler_mismatches_.push_back(fmt::format("{}: {} trainer {} vs sampler {}",
                                                          layer_name(b, kind), operand_name(o),
                                                          describe(t), describe(s)));
          }
        }
      }
    }

    // The exceptions, for the table and the logs.
    auto& ex = out.exceptions_;
    ex.push_back({"embeddings", "bf16 (a lookup, not a GEMM)", "DESIGN.md; NUMERICS 4.5"});
    ex.push_back({"norms, non-linearities", "fp32 math", "DESIGN.md; NUMERICS 4.5"});
    ex.push_back({"softmax, attention QK^T and P.V", "bf16 operands, fp32 softmax (not linear layers)",
                  "DESIGN.md; NUMERICS 4.5"});
    for (LinearKind k : hp.kinds) {
      ex.push_back({std::string(kind_name(k)), "bf16 GEMMs in every stage",
                    k == LinearKind::kRouter || k == LinearKind::kLmHead
                        ? "high_precision.kinds; DESIGN.md, RL.md (same in sampler and trainer)"
                        : "high_precision.kinds"});
    }
    if (hp.first_blocks > 0) {
      ex.push_back({blocks_label(0, hp.first_blocks - 1),
                    "bf16 GEMMs in every stage, every linear",
                    fmt::format("high_precision.first_blocks = {}", hp.first_blocks)});
    }
    if (last > 0) {
      ex.push_back(
          {blocks_label(n - last, n - 1), "bf16 GEMMs in every stage, every linear",
           hp.last_blocks ? fmt::format("high_precision.last_blocks = {}", *hp.last_blocks)
                          : fmt::format("last {:g}% of {} blocks = {:g}, rounded to nearest "
                                        "(halves up): {}; NUMERICS 4.5",
                                        hp.last_blocks_fraction * 100, n, hp.last_blocks_fraction * n, last)});
    }
    ex.push_back({"master weights, weight gradients, optimizer state", "fp32",
                  "DESIGN.md; NUMERICS 4.5"});
  });
  return out;
}

const ResolvedRecipe::Layer& ResolvedRecipe::layer(int block, LinearKind kind) const {
  const int n = shape_.n_layers;
  if (kind == LinearKind::kLmHead) block = n;
  if (block < 0 || block >= n + (kind == LinearKind::kLmHead ? 1 : 0)) {
    fail(fmt::format("recipe '{}'", recipe_.name),
         fmt::format("block {} is outside the model's blocks 0..{}", block, n - 1));
  }
  const Layer& l = layers_[(size_t)block * kNumKinds + (size_t)kind];
  if (!l.present) {
    fail(fmt::format("recipe '{}'", recipe_.name),
         fmt::format("block {} ({}) has no {} layer", block,
                     shape_.is_moe(block) ? "MoE, no shared experts" : "dense", kind_name(kind)));
  }
  return l;
}

const Policy& ResolvedRecipe::policy(int block, LinearKind kind) const { return layer(block, kind).policy; }

bool ResolvedRecipe::is_high_precision(int block, LinearKind kind) const {
  return layer(block, kind).high_precision;
}

namespace {

gemm::OperandRecipe operand(const Policy& p, Stage s, Gemm g, Operand o) {
  return stage_runs(s, g) ? gemm::OperandRecipe{p.at(s, g, o)} : gemm::OperandRecipe{};
}

gemm::LinearRecipe to_linear(const Policy& p, Stage forward, Stage backward) {
  gemm::LinearRecipe r;
  r.fprop_x = operand(p, forward, Gemm::kFprop, Operand::kInput);
  r.fprop_w = operand(p, forward, Gemm::kFprop, Operand::kWeight);
  r.dgrad_dy = operand(p, backward, Gemm::kDgrad, Operand::kGradient);
  r.dgrad_w = operand(p, backward, Gemm::kDgrad, Operand::kWeight);
  r.wgrad_dy = operand(p, backward, Gemm::kWgrad, Operand::kGradient);
  r.wgrad_x = operand(p, backward, Gemm::kWgrad, Operand::kInput);
  return r;
}

}  // namespace

gemm::LinearRecipe ResolvedRecipe::linear(Stage stage, int block, LinearKind kind) const {
  return to_linear(policy(block, kind), stage, stage);
}

gemm::LinearRecipe ResolvedRecipe::pretrain_linear(int block, LinearKind kind) const {
  return to_linear(policy(block, kind), Stage::kPretrainForward, Stage::kPretrainBackward);
}

// ---- the table -----------------------------------------------------------------------------------

namespace {

// Left-aligned columns separated by two spaces; a rule under the header row.
std::string format_columns(const std::vector<std::vector<std::string>>& rows, std::string_view indent) {
  std::vector<size_t> width;
  for (const auto& r : rows)
    for (size_t c = 0; c < r.size(); ++c) {
      if (width.size() <= c) width.push_back(0);
      width[c] = std::max(width[c], r[c].size());
    }
  std::string s;
  auto emit = [&](const std::vector<std::string>& r) {
    std::string line(indent);
    for (size_t c = 0; c < r.size(); ++c) {
      line += c + 1 < r.size() ? fmt::format("{:<{}}  ", r[c], width[c]) : r[c];
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    s += line + "\n";
  };
  for (size_t i = 0; i < rows.size(); ++i) {
    emit(rows[i]);
    if (i == 0) {
      std::vector<std::string> rule;
      for (size_t w : width) rule.push_back(std::string(w, '-'));
      emit(rule);
    }
  }
  return s;
}

std::string_view tensor_label(Gemm g, Operand o) {
  if (g == Gemm::kWgrad) return o == Operand::kGradient ? "dY^T" : "X^T";
  if (o == Operand::kGradient) return "dY";
  return o == Operand::kWeight ? "W" : "X";
}

// Which copy the GEMM reads (gemm/linear.h): Fprop both row-wise, Dgrad W column-wise, Wgrad both.
std::string_view copy_label(Gemm g, Operand o) {
  return g == Gemm::kWgrad || (g == Gemm::kDgrad && o == Operand::kWeight) ? "col" : "row";
}

std::string block_label(const quant::QuantConfig& c) {
  switch (c.format) {
    case quant::Format::kNvfp4: return c.block_2d ? "16x16" : "1x16";
    case quant::Format::kMxfp8: return "1x32";
    case quant::Format::kFp8Block: return c.block_2d ? "128x128" : "1x128";
    case quant::Format::kFp8Tensor: return "tensor";
  }
  return "?";
}

std::string rht_label(const quant::QuantConfig& c) {
  if (!c.rht) return "-";
  switch (c.rht_signs) {
    case quant::HadamardSigns::kNone: return "16, no signs";
    case quant::HadamardSigns::kFixed: return "16, fixed signs";
    case quant::HadamardSigns::kRandom: return fmt::format("16, random signs (seed {})", c.rht_seed);
  }
  return "?";
}

std::string scale_label(const quant::QuantConfig& c) {
  switch (c.format) {
    case quant::Format::kNvfp4: {
      std::string s = c.nvfp4_scale_rule == quant::Nvfp4ScaleRule::kFourOverSix
                          ? fmt::format("e4m3, 4/6 ({})", detail::find_operand_field("four_over_six_metric")->value_text(c))
                          : std::string("e4m3, amax to 6");
      if (c.sr_unbiased_scale) s += ", 16/17";
      if (c.nvfp4_row_amax) s += ", per-token amax";
      return s;
    }
    case quant::Format::kMxfp8:
      return c.mx_scale_rule == quant::MxScaleRule::kRoundUp ? "e8m0, round up" : "e8m0, floor";
    case quant::Format::kFp8Block:
    case quant::Format::kFp8Tensor: return c.fp8_pow2_scales ? "fp32, power of 2" : "fp32";
  }
  return "?";
}

std::string policy_table(const Policy& policy) {
  std::vector<std::vector<std::string>> rows = {
      {"stage", "gemm", "operand", "tensor", "copy", "format", "block", "rounding", "rht", "scale rule"}};
  Stage prev_stage = Stage::kRlTrainer;
  bool first = true;
  for (const Slot& s : all_slots()) {
    const bool new_stage = first || s.stage != prev_stage;
    const bool new_gemm = new_stage || s.operand == gemm_operands(s.gemm)[0];
    first = false;
    prev_stage = s.stage;
    const Precision& p = policy.at(s);
    rows.push_back({new_stage ? std::string(stage_name(s.stage)) : "",
                    new_gemm ? std::string(gemm_name(s.gemm)) : "", std::string(operand_name(s.operand)),
                    std::string(tensor_label(s.gemm, s.operand)), std::string(copy_label(s.gemm, s.operand)),
                    std::string(detail::precision_format_name(p)), p ? block_label(*p) : "-",
                    p ? (p->rounding == quant::Rounding::kNearest ? "nearest" : "stochastic") : "-",
                    p ? rht_label(*p) : "-", p ? scale_label(*p) : "-"});
  }
  return format_columns(rows, "  ");
}

std::string blocks_text(const std::vector<BlockRange>& blocks, int n_layers) {
  if (blocks.empty()) return "every block";
  std::vector<std::string> parts;
  for (const BlockRange& r : blocks) {
    std::string t = r.first == r.last ? fmt::format("{}", r.first) : fmt::format("{}..{}", r.first, r.last);
    if (r.first < 0 || r.last < 0) {
      const int a = r.first < 0 ? n_layers + r.first : r.first, b = r.last < 0 ? n_layers + r.last : r.last;
      t += fmt::format(" (= {})", a == b ? fmt::format("{}", a) : fmt::format("{}..{}", a, b));
    }
    parts.push_back(t);
  }
  return "blocks " + fmt::format("{}", fmt::join(parts, ", "));
}

}  // namespace

std::string ResolvedRecipe::table() const {
  const int n = shape_.n_layers;
  std::string s = fmt::format(
      "recipe '{}': {} blocks{}\n\nPolicy (every linear layer unless an exception or override below "
      "says otherwise; bf16 = not quantized):\n",
      recipe_.name, n,
      shape_.moe_blocks.empty() ? std::string(" (dense)")
                                : fmt::format(" ({} MoE: {})", shape_.moe_blocks.size(),
                                              fmt::join(shape_.moe_blocks, ", ")));
  s += policy_table(recipe_.policy);

  s += "\nHigh precision (every stage; wins over the overrides):\n";
  std::vector<std::vector<std::string>> ex = {{"what", "precision", "rule"}};
  for (const HighPrecisionException& e : exceptions_) ex.push_back({e.what, e.precision, e.why});
  s += format_columns(ex, "  ");

  s += "\nPer-layer overrides (in order, over the policy):\n";
  if (recipe_.overrides.empty()) s += "  none\n";
  for (size_t i = 0; i < recipe_.overrides.size(); ++i) {
    const Override& o = recipe_.overrides[i];
    std::vector<std::string_view> kinds;
    for (LinearKind k : o.kinds) kinds.push_back(kind_name(k));
    s += fmt::format("  o{}: {}, {}\n", i, blocks_text(o.blocks, n),
                     kinds.empty() ? std::string("every kind") : fmt::format("kinds {}", fmt::join(kinds, ", ")));
    std::vector<std::pair<Slot, Precision>> set = o.set;
    detail::sort_by_slot(set);
    for (const auto& [slot, precision] : set) {
      s += fmt::format("      {} = {}\n", slot.path(), describe(precision));
    }
  }

  // Layer map: consecutive blocks with the same cells share a row.
  std::vector<LinearKind> columns;
  for (LinearKind k : kLinearKinds) {
    if (k == LinearKind::kLmHead) continue;
    bool any = false;
    for (int b = 0; b < n; ++b) any = any || shape_.has(b, k);
    if (any) columns.push_back(k);
  }
  auto cell = [&](int b, LinearKind k) -> std::string {
    const Layer& l = layers_[(size_t)b * kNumKinds + (size_t)k];
    if (!l.present) return "-";
    std::string c = l.high_precision ? "bf16" : "policy";
    for (int i : l.overrides) c += fmt::format("+o{}", i);
    return c;
  };
  s += "\nLayer map (policy = the table above, +oN = override N applied, bf16 = high precision):\n";
  std::vector<std::vector<std::string>> map = {{"blocks"}};
  for (LinearKind k : columns) map[0].push_back(std::string(kind_name(k)));
  for (int b = 0; b < n;) {
    int e = b;
    auto row_of = [&](int x) {
      std::vector<std::string> r;
      for (LinearKind k : columns) r.push_back(cell(x, k));
      return r;
    };
    const std::vector<std::string> cells = row_of(b);
    while (e + 1 < n && row_of(e + 1) == cells) ++e;
    std::vector<std::string> row = {block_range_text(b, e)};
    row.insert(row.end(), cells.begin(), cells.end());
    map.push_back(row);
    b = e + 1;
  }
  s += format_columns(map, "  ");
  s += fmt::format("  lm_head: {}\n", cell(n, LinearKind::kLmHead));

  s += "\nRL sampler/trainer contract (rl_trainer.fprop = rl_sampler.fprop, RL.md): ";
  if (sampler_mismatches_.empty()) {
    s += "identical in every layer\n";
  } else {
    s += fmt::format("DIFFERS in {} operand(s), allowed by allow_sampler_mismatch:\n",
                     sampler_mismatches_.size());
    constexpr size_t kShown = 6;
    for (size_t i = 0; i < std::min(kShown, sampler_mismatches_.size()); ++i) {
      s += "  " + sampler_mismatches_[i] + "\n";
    }
    if (sampler_mismatches_.size() > kShown) {
      s += fmt::format("  ... and {} more\n", sampler_mismatches_.size() - kShown);
    }
  }
  return s;
}

}  // namespace fourbit::recipe
