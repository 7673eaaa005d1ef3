// The transformer's configuration: shape, RoPE and norm constants, embeddings, and the
// mixture-of-experts options; named presets; validation; JSON (stored in every checkpoint).
//
// The architecture (Llama-style, pre-norm): token embedding; n_layers blocks of
//   x = x + attn_out(attention(rope(qkv(rmsnorm(x)))))
//   x = x + mlp(rmsnorm(x))        (a SwiGLU MLP, or an MoE block in the blocks of moe.layers)
// final RMSNorm; LM head (tied to the embedding or its own [V, C] matrix); softmax cross-entropy.
// Grouped-query attention: n_kv_heads key/value heads shared by n_heads / n_kv_heads query heads
// each; head_dim = d_model / n_heads. No biases anywhere.
//
// An MoE block routes each token to moe.top_k of moe.n_experts SwiGLU experts (hidden size
// moe.expert_d_ff) with softmax top-k routing and renormalized gates (ops/moe.h), plus, with
// moe.n_shared_experts = 1, one shared SwiGLU expert of the same hidden size that every token
// passes through (DeepSeekMoE style). Load balancing: the auxiliary loss (Switch/Mixtral,
// coefficient moe.aux_loss_coef) or the auxiliary-loss-free per-expert selection bias
// (DeepSeek-V3, updated by moe.bias_update_rate per step); an optional router z-loss (ST-MoE,
// moe.z_loss_coef). The losses of the MoE blocks are averaged over those blocks.
//
// One declared table of fields (config_fields()) gives --set parsing, JSON and the printed form;
// validate() checks the combination, naming the field.
#pragma once

#include "recipe/recipe.h"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace fourbit::model {

enum class LoadBalancing : uint8_t {
  kAuxLoss,  // "aux_loss": E * sum_e f_e P_e, weighted by aux_loss_coef
  kBias,     // "bias": per-expert selection bias, bias_e += rate * sign(mean count - count_e)
};
std::string_view load_balancing_name(LoadBalancing l);

struct MoeConfig {
  std::vector<int> layers;  // the MoE blocks (sorted, unique); empty: a dense model
  int n_experts = 0;        // E (0 for a dense model)
  int top_k = 0;            // k experts per token
  int expert_d_ff = 0;      // hidden size of each routed expert (and of the shared expert)
  int n_shared_experts = 0;  // 0 or 1
  LoadBalancing load_balancing = LoadBalancing::kAuxLoss;
  double aux_loss_coef = 0.01;      // with kAuxLoss
  double bias_update_rate = 0.001;  // with kBias
  double z_loss_coef = 0.0;         // 0: no z-loss
  friend bool operator==(const MoeConfig&, const MoeConfig&) = default;
};

struct ModelConfig {
  std::string name = "custom";
  int vocab = 0;
  int d_model = 0;     // C
  int n_layers = 0;    // L
  int n_heads = 0;     // H
  int n_kv_heads = 0;  // Hkv (H % Hkv == 0)
  int d_ff = 0;        // F: hidden size of the dense SwiGLU MLPs
  int max_seq = 0;     // longest sequence (positions 0 .. max_seq - 1)
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  bool tied_embeddings = true;
  MoeConfig moe;

  int head_dim() const { return d_model / n_heads; }  // D
  int qkv_dim() const { return (n_heads + 2 * n_kv_heads) * head_dim(); }
  bool is_moe() const { return !moe.layers.empty(); }
  bool is_moe_block(int block) const;
  // Position of `block` among the MoE blocks (0 .. moe.layers.size() - 1), -1 for a dense block.
  int moe_index(int block) const;
  int n_moe_layers() const { return (int)moe.layers.size(); }
  // What recipe::resolve needs to know.
  recipe::ModelShape recipe_shape() const;

  // Throws fourbit::Error naming the first offending field: "model 'tiny': n_kv_heads: ...".
  void validate() const;
  friend bool operator==(const ModelConfig&, const ModelConfig&) = default;
};

// Presets: tiny, moe-tiny (CPU/CI; head_dim 64 so that the CUDA attention kernels take them too),
// gpt2-124m, gpt2-124m-moe8 (8 experts, top-2, expert_d_ff = d_ff / 2: the active parameters of
// gpt2-124m), 350m, 1.3b.
std::vector<std::string_view> preset_names();
ModelConfig preset(std::string_view name);  // throws listing the names

// --- the declared field table -------------------------------------------------------------------
struct ConfigField {
  std::string_view key;  // "d_model", "moe.top_k", ...
  std::string_view help;
  nlohmann::json (*get)(const ModelConfig&);
  // Sets the field from a JSON value; throws naming the key when the value has the wrong type or
  // range (the combination is checked later by validate()).
  void (*set)(ModelConfig&, const nlohmann::json&);
};
const std::vector<ConfigField>& config_fields();

// "key=value": the value is read as JSON (numbers, true/false, [1, 3]) or, failing that, as a
// string; moe.layers also takes "all", "none" or "1,3,5-7". apply_sets validates after applying
// them all (some valid configs need several settings to reach).
void apply_set(ModelConfig& config, std::string_view assignment);
void apply_sets(ModelConfig& config, const std::vector<std::string>& assignments);
std::string settable_keys_help();

// {"format_version": 1, "name": ..., every field of the table}. Reading rejects unknown keys and
// validates; missing keys keep the defaults of ModelConfig. to_json -> config_from_json is exact.
nlohmann::json to_json(const ModelConfig& config);
ModelConfig config_from_json(const nlohmann::json& j);

// One line per field, "key = value" (printed at start-up).
std::string describe(const ModelConfig& config);

}  // namespace fourbit::model
