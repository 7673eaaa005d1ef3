// Implementation of config.h: the field table, presets, validation, --set and JSON.
#include "model/config.h"

#include "core/check.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <limits>

namespace fourbit::model {

namespace {

using json = nlohmann::json;

constexpr int kFormatVersion = 1;

[[noreturn]] void fail_field(std::string_view key, std::string_view message) {
  throw Error(fmt::format("model config: {}: {}", key, message));
}

int read_int(const json& v, std::string_view key) {
  if (!v.is_number_integer() || v.get<int64_t>() < std::numeric_limits<int>::min() ||
      v.get<int64_t>() > std::numeric_limits<int>::max()) {
    fail_field(key, fmt::format("expected an integer, got {}", v.dump()));
  }
  return (int)v.get<int64_t>();
}

double read_double(const json& v, std::string_view key) {
  if (!v.is_number() || !std::isfinite(v.get<double>()))
    fail_field(key, fmt::format("expected a finite number, got {}", v.dump()));
  return v.get<double>();
}

bool read_bool(const json& v, std::string_view key) {
  if (!v.is_boolean()) fail_field(key, fmt::format("expected true or false, got {}", v.dump()));
  return v.get<bool>();
}

std::string read_string(const json& v, std::string_view key) {
  if (!v.is_string()) fail_field(key, fmt::format("expected a string, got {}", v.dump()));
  return v.get<std::string>();
}

// moe.layers: a JSON array of block indices, or the text "all" / "none" / "1,3,5-7" ("all" needs
// n_layers, so it is expanded against the config's current n_layers).
std::vector<int> read_layers(const json& v, const ModelConfig& c, std::string_view key) {
  std::vector<int> layers;
  if (v.is_array()) {
    for (const json& x : v) layers.push_back(read_int(x, key));
    return layers;
  }
  const std::string text = v.is_string() ? v.get<std::string>() : v.dump();
  if (text == "none" || text.empty()) return layers;
  if (text == "all") {
    for (int b = 0; b < c.n_layers; ++b) layers.push_back(b);
    return layers;
  }
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string part = text.substr(start, comma - start);
    const size_t dash = part.find('-', 1);
    try {
      const int first = std::stoi(part.substr(0, dash));
      const int last = dash == std::string::npos ? first : std::stoi(part.substr(dash + 1));
      for (int b = first; b <= last; ++b) layers.push_back(b);
    } catch (const std::logic_error&) {
      fail_field(key, fmt::format("'{}' is not a block or a range (e.g. 1,3,5-7, all or none)", part));
    }
    start = comma + 1;
  }
  return layers;
}

LoadBalancing read_load_balancing(const json& v, std::string_view key) {
  const std::string s = read_string(v, key);
  if (s == "aux_loss") return LoadBalancing::kAuxLoss;
  if (s == "bias") return LoadBalancing::kBias;
  fail_field(key, fmt::format("unknown value '{}'; allowed: aux_loss, bias", s));
}

#define FOURBIT_INT_FIELD(KEY, EXPR, HELP)                                                        \
  ConfigField {                                                                                 \
    KEY, HELP, [](const ModelConfig& c) -> json { return c.EXPR; },                            \
        [](ModelConfig& c, const json& v) { c.EXPR = read_int(v, KEY); }                        \
  }
#define FOURBIT_DOUBLE_FIELD(KEY, EXPR, HELP)                                                     \
  ConfigField {                                                                                 \
    KEY, HELP, [](const ModelConfig& c) -> json { return c.EXPR; },                            \
        [](ModelConfig& c, const json& v) { c.EXPR = read_double(v, KEY); }                     \
  }

}  // namespace

std::string_view load_balancing_name(LoadBalancing l) {
  return l == LoadBalancing::kAuxLoss ? "aux_loss" : "bias";
}

bool ModelConfig::is_moe_block(int block) const { return moe_index(block) >= 0; }

int ModelConfig::moe_index(int block) const {
  const auto it = std::find(moe.layers.begin(), moe.layers.end(), block);
  return it == moe.layers.end() ? -1 : (int)(it - moe.layers.begin());
}

recipe::ModelShape ModelConfig::recipe_shape() const {
  recipe::ModelShape s;
  s.n_layers = n_layers;
  s.moe_blocks = moe.layers;
  s.shared_experts = moe.n_shared_experts > 0;
  return s;
}

const std::vector<ConfigField>& config_fields() {
  static const std::vector<ConfigField> fields = {
      {"name", "the config's name (a preset's name, or yours)",
       [](const ModelConfig& c) -> json { return c.name; },
       [](ModelConfig& c, const json& v) { c.name = read_string(v, "name"); }},
      FOURBIT_INT_FIELD("vocab", vocab, "vocabulary size V (pad to a multiple of 128 for speed)"),
      FOURBIT_INT_FIELD("d_model", d_model, "model width C"),
      FOURBIT_INT_FIELD("n_layers", n_layers, "number of transformer blocks L"),
      FOURBIT_INT_FIELD("n_heads", n_heads, "query heads H (head_dim = d_model / n_heads)"),
      FOURBIT_INT_FIELD("n_kv_heads", n_kv_heads, "key/value heads (grouped-query attention; divides n_heads)"),
      FOURBIT_INT_FIELD("d_ff", d_ff, "hidden size of the dense SwiGLU MLPs"),
      FOURBIT_INT_FIELD("max_seq", max_seq, "longest sequence (positions 0 .. max_seq - 1)"),
      FOURBIT_DOUBLE_FIELD("rope_theta", rope_theta, "RoPE base theta"),
      FOURBIT_DOUBLE_FIELD("norm_eps", norm_eps, "RMSNorm epsilon"),
      {"tied_embeddings", "the LM head reuses the token embedding matrix",
       [](const ModelConfig& c) -> json { return c.tied_embeddings; },
       [](ModelConfig& c, const json& v) { c.tied_embeddings = read_bool(v, "tied_embeddings"); }},
      {"moe.layers", "MoE blocks: a list like [1, 3] (--set also takes all, none, 1,3,5-7)",
       [](const ModelConfig& c) -> json { return c.moe.layers; },
       [](ModelConfig& c, const json& v) { c.moe.layers = read_layers(v, c, "moe.layers"); }},
      FOURBIT_INT_FIELD("moe.n_experts", moe.n_experts, "routed experts E per MoE block"),
      FOURBIT_INT_FIELD("moe.top_k", moe.top_k, "experts per token k"),
      FOURBIT_INT_FIELD("moe.expert_d_ff", moe.expert_d_ff, "hidden size of each expert (routed and shared)"),
      FOURBIT_INT_FIELD("moe.n_shared_experts", moe.n_shared_experts, "0 or 1 shared expert per MoE block"),
      {"moe.load_balancing", "aux_loss (auxiliary loss) or bias (auxiliary-loss-free selection bias)",
       [](const ModelConfig& c) -> json { return std::string(load_balancing_name(c.moe.load_balancing)); },
       [](ModelConfig& c, const json& v) {
         c.moe.load_balancing = read_load_balancing(v, "moe.load_balancing");
       }},
      FOURBIT_DOUBLE_FIELD("moe.aux_loss_coef", moe.aux_loss_coef, "weight of the auxiliary load-balancing loss"),
      FOURBIT_DOUBLE_FIELD("moe.bias_update_rate", moe.bias_update_rate, "selection-bias step per training step (load_balancing=bias)"),
      FOURBIT_DOUBLE_FIELD("moe.z_loss_coef", moe.z_loss_coef, "weight of the router z-loss (0: off)"),
  };
  return fields;
}

#undef FOURBIT_INT_FIELD
#undef FOURBIT_DOUBLE_FIELD

void ModelConfig::validate() const {
  auto check = [&](bool ok, std::string_view field, std::string message) {
    if (!ok) throw Error(fmt::format("model '{}': {}: {}", name, field, message));
  };
  check(vocab >= 2, "vocab", fmt::format("must be at least 2, got {}", vocab));
  check(d_model >= 2, "d_model", fmt::format("must be at least 2, got {}", d_model));
  check(n_layers >= 1, "n_layers", fmt::format("must be at least 1, got {}", n_layers));
  check(n_heads >= 1, "n_heads", fmt::format("must be at least 1, got {}", n_heads));
  check(d_model % n_heads == 0, "n_heads",
        fmt::format("must divide d_model ({} % {} != 0)", d_model, n_heads));
  check(head_dim() % 2 == 0, "n_heads",
        fmt::format("head_dim = d_model / n_heads = {} must be even (RoPE rotates pairs)", head_dim()));
  check(n_kv_heads >= 1 && n_heads % n_kv_heads == 0, "n_kv_heads",
        fmt::format("must be >= 1 and divide n_heads ({}), got {}", n_heads, n_kv_heads));
  check(max_seq >= 1, "max_seq", fmt::format("must be at least 1, got {}", max_seq));
  check(rope_theta > 0, "rope_theta", fmt::format("must be > 0, got {}", rope_theta));
  check(norm_eps > 0, "norm_eps", fmt::format("must be > 0, got {}", norm_eps));
  const bool any_dense = (int)moe.layers.size() < n_layers;
  check(!any_dense || d_ff >= 1, "d_ff",
        fmt::format("must be at least 1 (the dense blocks' MLP), got {}", d_ff));
  check(d_ff >= 0, "d_ff", fmt::format("must be >= 0, got {}", d_ff));
  for (size_t i = 0; i < moe.layers.size(); ++i) {
    check(moe.layers[i] >= 0 && moe.layers[i] < n_layers, "moe.layers",
          fmt::format("block {} is outside [0, {})", moe.layers[i], n_layers));
    check(i == 0 || moe.layers[i] > moe.layers[i - 1], "moe.layers",
          "must be sorted and without repeats");
  }
  if (moe.layers.empty()) {
    check(moe.n_experts == 0, "moe.n_experts",
          fmt::format("is {} but moe.layers is empty; set moe.layers (e.g. all) or moe.n_experts=0",
                      moe.n_experts));
    return;
  }
  check(moe.n_experts >= 2 && moe.n_experts <= 1024, "moe.n_experts",
        fmt::format("must lie in [2, 1024] in a model with MoE blocks, got {}", moe.n_experts));
  check(moe.top_k >= 1 && moe.top_k <= std::min(moe.n_experts, 32), "moe.top_k",
        fmt::format("must lie in [1, min(n_experts, 32)] = [1, {}], got {}",
                    std::min(moe.n_experts, 32), moe.top_k));
  check(moe.expert_d_ff >= 1, "moe.expert_d_ff", fmt::format("must be at least 1, got {}", moe.expert_d_ff));
  check(moe.n_shared_experts == 0 || moe.n_shared_experts == 1, "moe.n_shared_experts",
        fmt::format("must be 0 or 1, got {}", moe.n_shared_experts));
  check(moe.aux_loss_coef >= 0, "moe.aux_loss_coef", fmt::format("must be >= 0, got {}", moe.aux_loss_coef));
  check(moe.bias_update_rate >= 0, "moe.bias_update_rate",
        fmt::format("must be >= 0, got {}", moe.bias_update_rate));
  check(moe.z_loss_coef >= 0, "moe.z_loss_coef", fmt::format("must be >= 0, got {}", moe.z_loss_coef));
}

std::vector<std::string_view> preset_names() {
  return {"tiny", "moe-tiny", "gpt2-124m", "gpt2-124m-moe8", "350m", "1.3b", "llama-1.1b"};
}

ModelConfig preset(std::string_view name) {
  ModelConfig c;
  c.name = std::string(name);
  if (name == "tiny" || name == "moe-tiny") {
    // Byte-level vocabulary; head_dim 64 (the CUDA attention kernels take D = 64 or 128).
    c.vocab = 256;
    c.d_model = 256;
    c.n_layers = 4;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.d_ff = 768;
    c.max_seq = 256;
    if (name == "moe-tiny") {
      c.moe.layers = {1, 3};
      c.moe.n_experts = 8;
      c.moe.top_k = 2;
      c.moe.expert_d_ff = 384;
      c.moe.z_loss_coef = 1e-3;
    }
  } else if (name == "gpt2-124m" || name == "gpt2-124m-moe8") {
    // GPT-2 small's shape; SwiGLU's three matrices at d_ff = 2048 hold exactly as many parameters
    // as GPT-2's two 4d GELU ones (3 * 768 * 2048 = 2 * 768 * 3072). Vocabulary 50257 padded.
    c.vocab = 50304;
    c.d_model = 768;
    c.n_layers = 12;
    c.n_heads = 12;
    c.n_kv_heads = 12;
    c.d_ff = 2048;
    c.max_seq = 1024;
    if (name == "gpt2-124m-moe8") {
      for (int b = 0; b < c.n_layers; ++b) c.moe.layers.push_back(b);
      c.moe.n_experts = 8;
      c.moe.top_k = 2;
      c.moe.expert_d_ff = c.d_ff / c.moe.top_k;  // active MLP parameters = gpt2-124m's
    }
  } else if (name == "350m") {
    // GPT-2 medium's shape; d_ff = 8/3 d rounded to a multiple of 128 (2688: the MLP has 0.2%
    // fewer parameters than a 4d GELU MLP).
    c.vocab = 50304;
    c.d_model = 1024;
    c.n_layers = 24;
    c.n_heads = 16;
    c.n_kv_heads = 16;
    c.d_ff = 2688;
    c.max_seq = 1024;
  } else if (name == "1.3b") {
    // GPT-3 XL's shape (head_dim 128); d_ff = 8/3 d rounded to a multiple of 128.
    c.vocab = 50304;
    c.d_model = 2048;
    c.n_layers = 24;
    c.n_heads = 16;
    c.n_kv_heads = 16;
    c.d_ff = 5504;
    c.max_seq = 2048;
  } else if (name == "llama-1.1b") {
    // TinyLlama 1.1B's shape (the decode benchmark's model, BENCHMARKS.md): grouped-query attention
    // (32 heads of 64, 4 KV heads), SwiGLU d_ff 5632, untied LM head, Llama's 32000 vocabulary.
    c.vocab = 32000;
    c.d_model = 2048;
    c.n_layers = 22;
    c.n_heads = 32;
    c.n_kv_heads = 4;
    c.d_ff = 5632;
    c.max_seq = 2048;
    c.tied_embeddings = false;
  } else {
    throw Error(fmt::format("unknown model preset '{}'; presets: {}", name,
                            fmt::join(preset_names(), ", ")));
  }
  c.validate();
  return c;
}

void apply_set(ModelConfig& config, std::string_view assignment) {
  const size_t eq = assignment.find('=');
  FOURBIT_CHECK(eq != std::string_view::npos && eq > 0,
                "model --set '{}': expected key=value (keys: {})", assignment,
                "see `fourbit model --keys`");
  const std::string key(assignment.substr(0, eq));
  const std::string text(assignment.substr(eq + 1));
  for (const ConfigField& f : config_fields()) {
    if (f.key != key) continue;
    json value = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (value.is_discarded()) value = text;  // a bare string (a name, aux_loss, 1,3,5-7)
    f.set(config, value);
    return;
  }
  std::vector<std::string_view> keys;
  for (const ConfigField& f : config_fields()) keys.push_back(f.key);
  throw Error(fmt::format("model --set: unknown key '{}'; keys: {}", key, fmt::join(keys, ", ")));
}

void apply_sets(ModelConfig& config, const std::vector<std::string>& assignments) {
  for (const std::string& a : assignments) apply_set(config, a);
  if (!assignments.empty() && config.name.find("+set") == std::string::npos) config.name += "+set";
  config.validate();
}

std::string settable_keys_help() {
  std::string s;
  for (const ConfigField& f : config_fields()) s += fmt::format("  {:<22} {}\n", f.key, f.help);
  return s;
}

json to_json(const ModelConfig& config) {
  json j = json::object();
  j["format_version"] = kFormatVersion;
  for (const ConfigField& f : config_fields()) j[std::string(f.key)] = f.get(config);
  return j;
}

ModelConfig config_from_json(const json& j) {
  FOURBIT_CHECK(j.is_object(), "model config JSON: expected an object, got {}", j.dump());
  ModelConfig c;
  for (const auto& [key, value] : j.items()) {
    if (key == "format_version") {
      FOURBIT_CHECK(value.is_number_integer() && value.get<int64_t>() == kFormatVersion,
                    "model config JSON: format_version {} is not supported (this build reads {})",
                    value.dump(), kFormatVersion);
      continue;
    }
    bool known = false;
    for (const ConfigField& f : config_fields()) {
      if (f.key != key) continue;
      // moe.layers "all" depends on n_layers: JSON always holds an explicit array.
      f.set(c, value);
      known = true;
    }
    if (!known) fail_field(key, "unknown key");
  }
  c.validate();
  return c;
}

std::string describe(const ModelConfig& config) {
  std::string s;
  for (const ConfigField& f : config_fields()) {
    if (f.key.starts_with("moe.") && f.key != "moe.layers" && !config.is_moe()) continue;
    s += fmt::format("  {:<22} {}\n", f.key, f.get(config).dump());
  }
  return s;
}

}  // namespace fourbit::model
