// `--set key=value` overrides on a recipe (recipe.h lists the keys). Operand fields come from the
// declared field table (internal.h), so the keys, their values and the help cannot drift apart.
#include "recipe/recipe.h"

#include "recipe/internal.h"

#include <fmt/format.h>

#include <charconv>
#include <cstdlib>

namespace fourbit::recipe {

namespace {

using detail::fail;

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    const size_t at = s.find(sep, start);
    parts.push_back(s.substr(start, at == std::string_view::npos ? at : at - start));
    if (at == std::string_view::npos) return parts;
    start = at + 1;
  }
}

bool parse_bool(std::string_view v, std::string_view key) {
  if (v == "true") return true;
  if (v == "false") return false;
  fail(key, fmt::format("bad value '{}'; allowed: true, false", v));
}

int parse_int(std::string_view v, std::string_view key) {
  int x = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (ec != std::errc() || end != v.data() + v.size() || v.empty()) {
    fail(key, fmt::format("bad value '{}'; expected an integer", v));
  }
  return x;
}

double parse_double(std::string_view v, std::string_view key) {
  const std::string s(v);
  char* end = nullptr;
  const double x = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size()) {
    fail(key, fmt::format("bad value '{}'; expected a number in [0, 1]", v));
  }
  return x;
}

void set_high_precision(HighPrecision& hp, std::string_view field, std::string_view value,
                        std::string_view key) {
  if (field == "kinds") {
    hp.kinds.clear();
    if (value.empty()) return;
    for (std::string_view k : split(value, ',')) hp.kinds.push_back(parse_kind(k, key));
  } else if (field == "last_blocks_fraction") {
    hp.last_blocks_fraction = parse_double(value, key);
  } else if (field == "last_blocks") {
    if (value == "none") {
      hp.last_blocks.reset();
    } else {
      hp.last_blocks = parse_int(value, key);
    }
  } else if (field == "first_blocks") {
    hp.first_blocks = parse_int(value, key);
  } else {
    fail(key, "unknown key; allowed: high_precision.kinds, high_precision.last_blocks_fraction, "
              "high_precision.last_blocks, high_precision.first_blocks");
  }
}

// The slots a (possibly wildcarded) stage.gemm.operand pattern selects.
std::vector<Slot> match_slots(std::string_view stage, std::string_view gemm, std::string_view operand,
                              std::string_view key) {
  if (stage != "*" && gemm != "*" && operand != "*") {
    return {parse_slot(fmt::format("{}.{}.{}", stage, gemm, operand))};
  }
  // Each named segment must be a known name, even when another segment is a wildcard.
  std::vector<Slot> slots;
  bool stage_known = stage == "*", gemm_known = gemm == "*", operand_known = operand == "*";
  for (const Slot& s : all_slots()) {
    const bool st = stage == "*" || stage_name(s.stage) == stage;
    const bool g = gemm == "*" || gemm_name(s.gemm) == gemm;
    const bool o = operand == "*" || operand_name(s.operand) == operand;
    stage_known = stage_known || stage_name(s.stage) == stage;
    gemm_known = gemm_known || gemm_name(s.gemm) == gemm;
    operand_known = operand_known || operand_name(s.operand) == operand;
    if (st && g && o) slots.push_back(s);
  }
  if (!stage_known) {
    fail(key, fmt::format("unknown stage '{}'; allowed: pretrain_forward, pretrain_backward, "
                          "rl_sampler, rl_trainer",
                          stage));
  }
  if (!gemm_known) fail(key, fmt::format("unknown gemm '{}'; allowed: fprop, dgrad, wgrad", gemm));
  if (!operand_known) {
    fail(key, fmt::format("unknown operand '{}'; allowed: input, weight, gradient", operand));
  }
  if (slots.empty()) fail(key, "matches no stage.gemm.operand slot");
  return slots;
}

void set_format(Precision& p, std::string_view value, std::string_view key) {
  Precision next = detail::parse_format(value, key);
  if (next && p && p->format == next->format) return;  // the same format: keep its fields
  p = next;
}

void set_operand_field(Recipe& r, const std::vector<Slot>& slots, bool wildcard,
                       std::string_view field_name, std::string_view value, std::string_view key) {
  if (field_name == "format") {
    for (const Slot& s : slots) set_format(r.policy.at(s), value, key);
    return;
  }
  const detail::OperandField* f = detail::find_operand_field(field_name);
  if (!f) {
    fail(key, fmt::format("unknown operand field '{}'; allowed: {}", field_name,
                          detail::operand_field_names()));
  }
  const uint64_t v = f->parse_text(value, key);
  int applied = 0;
  for (const Slot& s : slots) {
    Precision& p = r.policy.at(s);
    if (!p || !f->applies(*p)) {
      if (wildcard) continue;
      fail(key, p ? fmt::format("{} applies to {} only; this operand is {}", f->name, f->applies_to,
                                describe(p))
                  : fmt::format("{} is bf16: set its format first ({}.format=...)", s.path(), s.path()));
    }
    f->set(*p, v);
    detail::canonicalize(*p);  // e.g. rht=false resets rht_signs
    ++applied;
  }
  if (applied == 0) {
    fail(key, fmt::format("{} applies to {} only, and no matching operand is one", f->name,
                          f->applies_to));
  }
}

}  // namespace

void apply_set(Recipe& recipe, std::string_view assignment) {
  const size_t eq = assignment.find('=');
  if (eq == std::string_view::npos) {
    fail(fmt::format("--set '{}'", assignment), "expected key=value, e.g. "
                                                "pretrain_forward.fprop.input.rounding=stochastic");
  }
  const std::string_view key = assignment.substr(0, eq), value = assignment.substr(eq + 1);
  const std::vector<std::string_view> parts = split(key, '.');
  detail::with_context(fmt::format("recipe '{}': --set", recipe.name), [&] {
    if (key == "allow_sampler_mismatch") {
      recipe.allow_sampler_mismatch = parse_bool(value, key);
    } else if (parts.size() == 2 && parts[0] == "high_precision") {
      set_high_precision(recipe.high_precision, parts[1], value, key);
    } else if (parts.size() == 3 || parts.size() == 4) {
      const bool wildcard = parts[0] == "*" || parts[1] == "*" || parts[2] == "*";
      const std::vector<Slot> slots = match_slots(parts[0], parts[1], parts[2], key);
      set_operand_field(recipe, slots, wildcard, parts.size() == 4 ? parts[3] : "format", value, key);
    } else {
      fail(key, "unknown key; expected stage.gemm.operand[.field], high_precision.FIELD or "
                "allow_sampler_mismatch (fourbit recipe --keys lists them)");
    }
  });
  if (!recipe.name.ends_with("+set")) recipe.name += "+set";
}

void apply_sets(Recipe& recipe, const std::vector<std::string>& assignments) {
  for (const std::string& a : assignments) apply_set(recipe, a);
  recipe.validate();
}

std::string settable_keys_help() {
  std::string s;
  s += "Slots (stage.gemm.operand; any part may be *):\n";
  for (const Slot& slot : all_slots()) s += fmt::format("  {}\n", slot.path());
  s += "\nKeys:\n";
  const auto line = [&](std::string_view key, std::string_view values, std::string_view help) {
    s += fmt::format("  {:<44} {}\n  {:<44}   {}\n", key, values, "", help);
  };
  line("SLOT=FORMAT  or  SLOT.format=FORMAT", fmt::format("{}", fmt::join(detail::kFormatNames, " | ")),
       "bf16 = no quantization; a new format starts from its defaults");
  for (const detail::OperandField& f : detail::operand_fields()) {
    line(fmt::format("SLOT.{}=", f.name), f.type == detail::FieldType::kUint ? "N" : fmt::format("{}", fmt::join(f.values, " | ")),
         fmt::format("{} [{}]", f.help, f.applies_to));
  }
  line("high_precision.kinds=", "comma list of linear kinds (empty: none)",
       "kinds kept BF16 in every stage (default router,lm_head)");
  line("high_precision.last_blocks_fraction=", "0..1",
       "last blocks kept BF16: round(fraction * n_layers), halves up (default 0.15)");
  line("high_precision.last_blocks=", "N | none", "an explicit count instead of the fraction");
  line("high_precision.first_blocks=", "N", "first blocks kept BF16 (default 0)");
  line("allow_sampler_mismatch=", "true | false",
       "let rl_trainer.fprop differ from rl_sampler.fprop (ablations; RL.md)");
  return s;
}

}  // namespace fourbit::recipe
