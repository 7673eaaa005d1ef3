// JSON for recipes and resolved recipes (they go into checkpoints). Layout of a recipe:
//   {"format_version": 1, "name": "nvfp4",
//    "policy": {"pretrain_forward.fprop.input": {"format": "nvfp4", "block_2d": false, ...}, ...},
//    "high_precision": {"kinds": ["router", "lm_head"], "last_blocks_fraction": 0.15,
//                       "last_blocks": null, "first_blocks": 0},
//    "overrides": [{"blocks": [[0, 1], [-2, -1]], "kinds": ["mlp_down"],
//                   "set": {"pretrain_forward.fprop.input": {"format": "bf16"}}}],
//    "allow_sampler_mismatch": false}
// An operand object holds "format" and every field of the declared table (internal.h) that applies
// to it, always written in full so that a checkpoint does not depend on today's defaults. Reading
// accepts missing fields (their defaults), and missing high_precision / overrides /
// allow_sampler_mismatch (the defaults of recipe.h); it rejects unknown keys, fields that do not
// apply to the operand, and values of the wrong type or outside the allowed set, naming the key.
#include "recipe/recipe.h"

#include "recipe/internal.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <limits>
#include <sstream>

namespace fourbit::recipe {

namespace {

using detail::fail;
using detail::OperandField;
using json = nlohmann::json;

constexpr int kFormatVersion = 1;

// ---- writing ----------------------------------------------------------------------------------

json operand_to_json(const Precision& p) {
  json j = json::object();
  j["format"] = std::string(detail::precision_format_name(p));
  if (!p) return j;
  for (const OperandField& f : detail::operand_fields()) {
    if (!f.applies(*p)) continue;
    const uint64_t v = f.get(*p);
    switch (f.type) {
      case detail::FieldType::kBool: j[std::string(f.name)] = v != 0; break;
      case detail::FieldType::kEnum: j[std::string(f.name)] = f.value_text(*p); break;
      case detail::FieldType::kUint: j[std::string(f.name)] = v; break;
    }
  }
  return j;
}

// ---- reading ----------------------------------------------------------------------------------

void expect(bool ok, std::string_view where, std::string_view what, const json& got) {
  if (!ok) fail(where, fmt::format("expected {}, got {}", what, got.dump()));
}

void check_keys(const json& j, std::string_view where, std::initializer_list<std::string_view> allowed) {
  expect(j.is_object(), where, "an object", j);
  for (const auto& [key, value] : j.items()) {
    bool known = false;
    for (std::string_view a : allowed) known = known || a == key;
    if (!known) {
      fail(fmt::format("{}.{}", where, key),
           fmt::format("unknown key; allowed: {}", fmt::join(allowed, ", ")));
    }
  }
}

int read_int(const json& j, std::string_view where) {
  expect(j.is_number_integer() && j.get<int64_t>() >= std::numeric_limits<int>::min() &&
             j.get<int64_t>() <= std::numeric_limits<int>::max(),
         where, "an integer", j);
  return (int)j.get<int64_t>();
}

bool read_bool(const json& j, std::string_view where) {
  expect(j.is_boolean(), where, "true or false", j);
  return j.get<bool>();
}

Precision operand_from_json(const json& j, const std::string& where) {
  expect(j.is_object(), where, "an operand object such as {\"format\": \"nvfp4\", ...}", j);
  if (!j.contains("format")) {
    fail(where + ".format", fmt::format("missing; allowed: {}", fmt::join(detail::kFormatNames, ", ")));
  }
  const json& format = j.at("format");
  expect(format.is_string(), where + ".format", "a string", format);
  Precision p = detail::parse_format(format.get<std::string>(), where + ".format");
  for (const auto& [key, value] : j.items()) {
    if (key == "format") continue;
    const std::string path = fmt::format("{}.{}", where, key);
    const OperandField* f = detail::find_operand_field(key);
    if (!f) fail(path, fmt::format("unknown key; allowed: {}", detail::operand_field_names()));
    if (!p) fail(path, "a bf16 operand has no quantizer fields; give only {\"format\": \"bf16\"}");
    uint64_t v = 0;
    switch (f->type) {
      case detail::FieldType::kBool: v = read_bool(value, path); break;
      case detail::FieldType::kEnum:
        expect(value.is_string(), path, fmt::format("one of {}", f->allowed_text()), value);
        v = f->parse_text(value.get<std::string>(), path);
        break;
      case detail::FieldType::kUint:
        expect(value.is_number_unsigned(), path, f->allowed_text(), value);
        v = value.get<uint64_t>();
        break;
    }
    f->set(*p, v);
  }
  if (p) {
    // Every field given must mean something for the operand it ended up describing.
    for (const auto& [key, value] : j.items()) {
      const OperandField* f = detail::find_operand_field(key);
      if (f && !f->applies(*p)) {
        fail(where + "." + key, fmt::format("does not apply to this {} operand: it applies to {} only",
                                            quant::format_name(p->format), f->applies_to));
      }
    }
  }
  return p;
}

HighPrecision high_precision_from_json(const json& j) {
  const std::string where = "high_precision";
  check_keys(j, where, {"kinds", "last_blocks_fraction", "last_blocks", "first_blocks"});
  HighPrecision hp;
  if (j.contains("kinds")) {
    const json& k = j.at("kinds");
    expect(k.is_array(), where + ".kinds", "an array of linear kinds", k);
    hp.kinds.clear();
    for (const json& name : k) {
      expect(name.is_string(), where + ".kinds", "linear kind names", name);
      hp.kinds.push_back(parse_kind(name.get<std::string>(), where + ".kinds"));
    }
  }
  if (j.contains("last_blocks_fraction")) {
    const json& f = j.at("last_blocks_fraction");
    expect(f.is_number(), where + ".last_blocks_fraction", "a number in [0, 1]", f);
    hp.last_blocks_fraction = f.get<double>();
  }
  if (j.contains("last_blocks") && !j.at("last_blocks").is_null()) {
    hp.last_blocks = read_int(j.at("last_blocks"), where + ".last_blocks");
  }
  if (j.contains("first_blocks")) hp.first_blocks = read_int(j.at("first_blocks"), where + ".first_blocks");
  return hp;
}

Override override_from_json(const json& j, const std::string& where) {
  check_keys(j, where, {"blocks", "kinds", "set"});
  Override o;
  if (j.contains("blocks")) {
    const json& b = j.at("blocks");
    expect(b.is_array(), where + ".blocks", "an array of [first, last] ranges or block indices", b);
    for (const json& r : b) {
      if (r.is_number_integer()) {
        const int i = read_int(r, where + ".blocks");
        o.blocks.push_back({i, i});
      } else {
        expect(r.is_array() && r.size() == 2, where + ".blocks", "[first, last] or a block index", r);
        o.blocks.push_back({read_int(r[0], where + ".blocks"), read_int(r[1], where + ".blocks")});
      }
    }
  }
  if (j.contains("kinds")) {
    const json& k = j.at("kinds");
    expect(k.is_array(), where + ".kinds", "an array of linear kinds", k);
    for (const json& name : k) {
      expect(name.is_string(), where + ".kinds", "linear kind names", name);
      o.kinds.push_back(parse_kind(name.get<std::string>(), where + ".kinds"));
    }
  }
  if (!j.contains("set")) fail(where + ".set", "missing: an override sets at least one slot");
  const json& set = j.at("set");
  expect(set.is_object(), where + ".set", "an object of slot paths to operands", set);
  for (const auto& [path, operand] : set.items()) {
    const Slot slot = detail::with_context(where + ".set", [&] { return parse_slot(path); });
    o.set.emplace_back(slot, operand_from_json(operand, where + ".set." + path));
  }
  detail::sort_by_slot(o.set);  // JSON objects have no order; ours is the table's
  return o;
}

}  // namespace

nlohmann::json to_json(const Recipe& recipe) {
  json policy = json::object();
  for (const Slot& s : all_slots()) policy[s.path()] = operand_to_json(recipe.policy.at(s));
  const HighPrecision& hp = recipe.high_precision;
  json kinds = json::array();
  for (LinearKind k : hp.kinds) kinds.push_back(std::string(kind_name(k)));
  json overrides = json::array();
  for (const Override& o : recipe.overrides) {
    json blocks = json::array(), okinds = json::array(), set = json::object();
    for (const BlockRange& r : o.blocks) blocks.push_back({r.first, r.last});
    for (LinearKind k : o.kinds) okinds.push_back(std::string(kind_name(k)));
    for (const auto& [slot, precision] : o.set) set[slot.path()] = operand_to_json(precision);
    overrides.push_back({{"blocks", blocks}, {"kinds", okinds}, {"set", set}});
  }
  return {{"format_version", kFormatVersion},
          {"name", recipe.name},
          {"policy", policy},
          {"high_precision",
           {{"kinds", kinds},
            {"last_blocks_fraction", hp.last_blocks_fraction},
            {"last_blocks", hp.last_blocks ? json(*hp.last_blocks) : json(nullptr)},
            {"first_blocks", hp.first_blocks}}},
          {"overrides", overrides},
          {"allow_sampler_mismatch", recipe.allow_sampler_mismatch}};
}

Recipe recipe_from_json(const nlohmann::json& j) {
  const std::string name =
      j.is_object() && j.contains("name") && j.at("name").is_string() ? j.at("name").get<std::string>()
                                                                      : std::string("?");
  Recipe recipe = detail::with_context(fmt::format("recipe '{}'", name), [&] {
    check_keys(j, "recipe", {"format_version", "name", "policy", "high_precision", "overrides",
                             "allow_sampler_mismatch"});
    if (!j.contains("format_version")) fail("format_version", "missing (this fourbit writes 1)");
    const int version = read_int(j.at("format_version"), "format_version");
    if (version != kFormatVersion) {
      fail("format_version",
           fmt::format("{} is not supported: this fourbit reads recipe format {}{}", version,
                       kFormatVersion, version > kFormatVersion ? "; upgrade fourbit" : ""));
    }
    Recipe r;
    if (!j.contains("name")) fail("name", "missing");
    expect(j.at("name").is_string(), "name", "a string", j.at("name"));
    r.name = name;
    if (!j.contains("policy")) fail("policy", "missing: every stage.gemm.operand slot is required");
    const json& policy = j.at("policy");
    expect(policy.is_object(), "policy", "an object of slot paths to operands", policy);
    for (const auto& [path, operand] : policy.items()) {
      const Slot slot = detail::with_context("policy", [&] { return parse_slot(path); });
      r.policy.at(slot) = operand_from_json(operand, "policy." + path);
    }
    for (const Slot& s : all_slots()) {
      if (!policy.contains(s.path())) {
        fail("policy." + s.path(), "missing: every slot is required (use {\"format\": \"bf16\"} "
                                   "for no quantization)");
      }
    }
    if (j.contains("high_precision")) r.high_precision = high_precision_from_json(j.at("high_precision"));
    if (j.contains("overrides")) {
      const json& o = j.at("overrides");
      expect(o.is_array(), "overrides", "an array", o);
      for (size_t i = 0; i < o.size(); ++i) {
        r.overrides.push_back(override_from_json(o[i], fmt::format("overrides[{}]", i)));
      }
    }
    if (j.contains("allow_sampler_mismatch")) {
      r.allow_sampler_mismatch = read_bool(j.at("allow_sampler_mismatch"), "allow_sampler_mismatch");
    }
    return r;
  });
  recipe.validate();
  return recipe;
}

Recipe load_recipe_file(const std::string& path) {
  std::ifstream f(path);
  if (!f.good()) throw Error(fmt::format("cannot open recipe file '{}'", path));
  std::stringstream text;
  text << f.rdbuf();
  json j;
  try {
    j = json::parse(text.str());
  } catch (const json::parse_error& e) {
    throw Error(fmt::format("recipe file '{}' is not valid JSON: {}", path, e.what()));
  }
  // A resolved recipe (what `fourbit recipe --output` and checkpoints store) holds the recipe.
  const bool resolved = j.is_object() && j.contains("recipe") && j.contains("model");
  return detail::with_context(fmt::format("recipe file '{}'", path),
                              [&] { return recipe_from_json(resolved ? j.at("recipe") : j); });
}

nlohmann::json to_json(const ResolvedRecipe& resolved) {
  return {{"recipe", to_json(resolved.recipe())},
          {"model",
           {{"n_layers", resolved.shape().n_layers},
            {"moe_blocks", resolved.shape().moe_blocks},
            {"shared_experts", resolved.shape().shared_experts}}}};
}

ResolvedRecipe resolved_from_json(const nlohmann::json& j) {
  check_keys(j, "resolved recipe", {"recipe", "model"});
  if (!j.contains("recipe") || !j.contains("model")) {
    fail("resolved recipe", "needs both \"recipe\" and \"model\"");
  }
  const Recipe r = recipe_from_json(j.at("recipe"));
  const json& m = j.at("model");
  check_keys(m, "model", {"n_layers", "moe_blocks", "shared_experts"});
  ModelShape shape;
  if (!m.contains("n_layers")) fail("model.n_layers", "missing");
  shape.n_layers = read_int(m.at("n_layers"), "model.n_layers");
  if (m.contains("moe_blocks")) {
    expect(m.at("moe_blocks").is_array(), "model.moe_blocks", "an array of block indices", m.at("moe_blocks"));
    for (const json& b : m.at("moe_blocks")) shape.moe_blocks.push_back(read_int(b, "model.moe_blocks"));
  }
  if (m.contains("shared_experts")) {
    shape.shared_experts = read_bool(m.at("shared_experts"), "model.shared_experts");
  }
  return resolve(r, shape);
}

}  // namespace fourbit::recipe
