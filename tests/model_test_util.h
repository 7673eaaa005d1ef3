// Helpers shared by the model tests (test_model_*.cpp): small configs, seeded batches, host copies
// of model tensors and norm-wise comparisons that report the worst element.
#pragma once

#include "core/rng.h"
#include "core/tensor.h"
#include "formats/element.h"
#include "model/config.h"
#include "model/model.h"
#include "recipe/recipe.h"

#include <gtest/gtest.h>

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

namespace fourbit::model::testing {

// A dense model small enough for float64 finite differences: GQA (2 heads, 1 kv head, D = 8), an
// untied LM head optional.
inline ModelConfig small_dense(bool tied = true) {
  ModelConfig c;
  c.name = "small-dense";
  c.vocab = 32;
  c.d_model = 16;
  c.n_layers = 2;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.d_ff = 24;
  c.max_seq = 16;
  c.tied_embeddings = tied;
  c.validate();
  return c;
}

// A small MoE model: block 1 of 2 is MoE (4 experts, top-2, a shared expert), aux and z losses
// with large coefficients so that their gradients are visible.
inline ModelConfig small_moe(LoadBalancing lb = LoadBalancing::kAuxLoss, int shared = 1) {
  ModelConfig c = small_dense();
  c.name = "small-moe";
  c.moe.layers = {1};
  c.moe.n_experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_d_ff = 12;
  c.moe.n_shared_experts = shared;
  c.moe.load_balancing = lb;
  c.moe.aux_loss_coef = 0.1;
  c.moe.z_loss_coef = 0.01;
  c.validate();
  return c;
}

inline recipe::ResolvedRecipe resolved(const ModelConfig& c, const std::string& preset = "bf16") {
  return recipe::resolve(recipe::preset(preset), c.recipe_shape());
}

// Seeded token ids in [0, vocab) and targets (the next token, some positions ignored with -1).
struct Batch {
  Tensor tokens, targets;  // host i32 [B, T]
};
inline Batch make_batch(int B, int T, int vocab, uint64_t seed, int ignore_every = 5) {
  Batch b{Tensor::empty({B, T}, DType::kI32, Device::kCpu), Tensor::empty({B, T}, DType::kI32, Device::kCpu)};
  const RandomStream rs{seed, 0xba7c4};
  for (int64_t i = 0; i < (int64_t)B * T; ++i) {
    b.tokens.ptr<int32_t>()[i] = (int32_t)(rs.block((uint64_t)i).v[0] % (uint32_t)vocab);
    const int32_t target = (int32_t)(rs.block((uint64_t)i).v[1] % (uint32_t)vocab);
    b.targets.ptr<int32_t>()[i] = ignore_every > 0 && i % ignore_every == ignore_every - 1 ? -1 : target;
  }
  return b;
}

// The values of a contiguous f64 / f32 / bf16 tensor on either device, as doubles.
inline std::vector<double> values(const TensorView& v) {
  Tensor h = Tensor::empty(v.shape, v.dtype, Device::kCpu);
  copy_tensor(h.view(), v);
  std::vector<double> out((size_t)h.numel());
  for (int64_t i = 0; i < h.numel(); ++i) {
    switch (h.dtype()) {
      case DType::kF64: out[(size_t)i] = h.ptr<double>()[i]; break;
      case DType::kF32: out[(size_t)i] = h.ptr<float>()[i]; break;
      case DType::kBF16: out[(size_t)i] = formats::decode_bf16(h.ptr<uint16_t>()[i]); break;
      default: ADD_FAILURE() << "values: unsupported dtype " << dtype_name(h.dtype()); break;
    }
  }
  return out;
}

inline double norm2(const std::vector<double>& a) {
  double s = 0;
  for (double x : a) s += x * x;
  return std::sqrt(s);
}

inline double diff_norm2(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += (a[i] - b[i]) * (a[i] - b[i]);
  return std::sqrt(s);
}

// ||got - want|| / ||want|| <= tol (and the same size; NaN fails), reporting the measured error
// and the worst element.
inline ::testing::AssertionResult close_normwise(const std::vector<double>& got,
                                                 const std::vector<double>& want, double tol,
                                                 const std::string& what) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << what << ": " << got.size() << " values, expected " << want.size();
  const double ref = norm2(want);
  const double err = diff_norm2(got, want) / (ref > 0 ? ref : 1.0);
  if (err <= tol) return ::testing::AssertionSuccess() << what << ": relative error " << err;
  size_t worst = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (!(std::fabs(got[i] - want[i]) <= std::fabs(got[worst] - want[worst]))) worst = i;
  return ::testing::AssertionFailure() << what << ": norm-wise relative error " << err << " > " << tol
                                       << " (||want|| = " << ref << "); worst element " << worst
                                       << ": got " << got[worst] << ", want " << want[worst];
}

}  // namespace fourbit::model::testing
