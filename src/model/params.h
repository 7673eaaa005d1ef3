// The parameter table: one row per parameter tensor of a model (name, shape, kind, initialization,
// weight decay), and the flat buffers laid out from it.
//
// Every per-parameter buffer of training (FP32 master weights, gradients, AdamW's two moments, the
// BF16 compute copy) is ONE allocation laid out by the table: row i lives at elements
// [offset_i, offset_i + numel_i) of each, offsets aligned to kAlignElements (256 bytes in FP32,
// what 16-byte vector kernels and cuBLASLt want), the gaps zero. So an optimizer or an all-reduce
// can treat a buffer as one flat array, and every parameter is a view into it.
//
// Rows, in this order (C = d_model, H, Hkv, D = head_dim, F = d_ff, E = experts, Fe = expert_d_ff,
// V = vocab; `blocks.{b}.` prefixes the block rows):
//   embedding.weight              [V, C]              embedding   normal(0.02)        no decay
//   blocks.{b}.attn_norm.weight   [C]                 norm        ones                no decay
//   blocks.{b}.attn.qkv.weight    [(H + 2 Hkv) D, C]  linear qkv  normal(0.02)        decay
//                                 rows: H*D query rows, Hkv*D key rows, Hkv*D value rows
//   blocks.{b}.attn.out.weight    [C, H D]            linear attn_out  normal(0.02 / sqrt(2 L))
//   blocks.{b}.mlp_norm.weight    [C]                 norm        ones                no decay
//   dense blocks:
//   blocks.{b}.mlp.up.weight      [2F, C]             linear mlp_up: rows 0..F-1 gate, F..2F-1 up
//   blocks.{b}.mlp.down.weight    [C, F]              linear mlp_down  normal(0.02 / sqrt(2 L))
//   MoE blocks:
//   blocks.{b}.moe.router.weight  [E, C]              router      normal(0.02)        decay
//   blocks.{b}.moe.router.bias    [E]                 router_bias zeros, not trained (the
//                                 auxiliary-loss-free selection bias; only with load_balancing=bias)
//   blocks.{b}.moe.experts.up.weight    [E, 2Fe, C]   expert expert_up (stacked per expert)
//   blocks.{b}.moe.experts.down.weight  [E, C, Fe]    expert expert_down  normal(0.02 / sqrt(2 L))
//   blocks.{b}.moe.shared.up.weight     [2Fe, C]      linear mlp_up     (n_shared_experts = 1)
//   blocks.{b}.moe.shared.down.weight   [C, Fe]       linear mlp_down   normal(0.02 / sqrt(2 L))
//   final_norm.weight             [C]                 norm        ones                no decay
//   lm_head.weight                [V, C]              lm_head     normal(0.02)  (untied only)
//
// Initialization is a pure function of (seed, row name, element index): Philox-4x32-10 draws
// (core/rng.h) turned into normals by Box-Muller in float64, rounded to FP32 (the master dtype; an
// f64 model holds the same values exactly) and then to the buffer's dtype.
// It runs on the host and is copied to the device, so CPU and GPU models of one seed hold the same
// bits, and adding a row does not change the others' values.
#pragma once

#include "core/tensor.h"
#include "model/config.h"
#include "recipe/recipe.h"

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fourbit::model {

enum class ParamKind : uint8_t { kEmbedding, kNorm, kLinear, kRouter, kRouterBias, kExpert, kLmHead };
std::string_view param_kind_name(ParamKind k);

enum class InitKind : uint8_t { kNormal, kOnes, kZeros };

struct ParamSpec {
  std::string name;
  Shape shape;
  ParamKind kind = ParamKind::kLinear;
  int block = -1;  // the block index; -1 outside the blocks
  // The linear layer this weight belongs to (kLinear, kRouter, kExpert, kLmHead), for the recipe.
  std::optional<recipe::LinearKind> linear_kind;
  InitKind init = InitKind::kNormal;
  double init_std = 0.0;  // kNormal
  bool weight_decay = false;
  bool trainable = true;  // false: a buffer (the router bias), no gradient, no optimizer update
  int64_t offset = 0;     // elements into the flat buffers
  int64_t numel() const { return shape.numel(); }
};

class ParamTable {
 public:
  static constexpr int64_t kAlignElements = 64;

  // Validates the config and lists its parameters.
  static ParamTable build(const ModelConfig& config);

  const std::vector<ParamSpec>& rows() const { return rows_; }
  const ParamSpec& row(int index) const { return rows_[(size_t)index]; }
  int size() const { return (int)rows_.size(); }
  int index_of(std::string_view name) const;  // throws naming the parameter
  const ParamSpec& find(std::string_view name) const { return row(index_of(name)); }
  int64_t total_elements() const { return total_elements_; }  // including alignment gaps

  // Trainable parameters (router bias excluded); the active count counts the routed experts
  // top_k / n_experts times (what one token uses).
  int64_t n_params() const;
  int64_t n_active_params() const;

  // One line per row: name, shape, kind, init, decay.
  std::string table() const;

 private:
  std::vector<ParamSpec> rows_;
  int64_t total_elements_ = 0;
  double active_expert_fraction_ = 1.0;
};

// One flat buffer laid out by a table, and a view of every row into it.
class ParamBuffer {
 public:
  ParamBuffer() = default;
  // Zero-filled.
  ParamBuffer(const ParamTable& table, DType dtype, Device device);

  const TensorView& flat() const { return flat_.view(); }  // [total_elements]
  const TensorView& view(int index) const { return views_[(size_t)index]; }
  int size() const { return (int)views_.size(); }
  DType dtype() const { return flat_.dtype(); }
  Device device() const { return flat_.device(); }
  bool defined() const { return flat_.defined(); }

 private:
  Tensor flat_;
  std::vector<TensorView> views_;
};

// Writes the initial values of every row into `params` (any dtype f64 / f32 / bf16, any device).
void init_params(const ParamTable& table, const ParamBuffer& params, uint64_t seed);

// The initial value of element `index` of a kNormal row named `name` (exposed for tests).
double init_normal_value(uint64_t seed, std::string_view name, int64_t index, double std);

}  // namespace fourbit::model
