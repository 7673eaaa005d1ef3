// Optional timing hooks of the model's forward and backward: the model brackets every op it runs
// with begin(section, work) / end() and reports every linear-layer GEMM call, so that a profiler
// (the `bench model` one times the brackets with CUDA events) can split a training step by layer
// type and by kind of work. With no profiler attached the hooks cost a pointer test.
#pragma once

#include "gemm/linear.h"
#include "recipe/recipe.h"

#include <cstdint>
#include <string_view>

namespace fourbit::model {

// Where in the model: the layer types of a training step.
enum class Section : uint8_t { kEmbedding, kAttention, kMlp, kMoe, kLmHead };
inline constexpr int kNumSections = 5;
std::string_view section_name(Section s);  // "embedding", "attention", "mlp", "moe", "lm_head+loss"

// What kind of work: a linear layer (operand quantization + GEMM, gemm::linear_* or the experts'
// grouped GEMMs), the attention kernels, or everything else (norms, RoPE, SwiGLU, routing and
// permutation, loss, residual adds, casts, copies).
enum class Work : uint8_t { kLinear, kAttention, kOther };
inline constexpr int kNumWorks = 3;
std::string_view work_name(Work w);

// One linear-layer GEMM as the model ran it. Dense: X [m, k], W [n, k] (groups = 1). Experts:
// `groups` weights [n, k] each, X the m permuted rows. Which operands were quantized (and how)
// follows from the recipe and `gemm`: fprop X row-wise, W row-wise; dgrad dY [m, n] row-wise, W
// column-wise; wgrad dY and X column-wise.
struct LinearCall {
  Section section;
  recipe::Gemm gemm;
  const gemm::LinearRecipe* recipe;  // valid during the call only
  int64_t m = 0, n = 0, k = 0;
  int groups = 1;
  // How the token-side operands were quantized (gemm/linear.h), when not one pass per operand:
  bool fprop_saves_x = false;  // fprop: X's column-wise copy made too and kept for the Wgrad
                               // (in the same pass when gemm::fprop_and_wgrad_x_share_a_pass)
  bool wgrad_saved_x = false;  // wgrad: X read from that kept copy (no quantization of X)
  bool dy_one_pass = false;    // dgrad and wgrad: dY's two copies made in one pass (counted on
                               // the dgrad call)
  bool source_amax_given = false;  // that one pass (X's or dY's) took its producer's amaxes
                                   // (ModelOptions::fuse_producer_amax): no amax pass
};

class Profiler {
 public:
  virtual ~Profiler() = default;
  // Brackets do not nest: every begin() is followed by its end() before the next begin().
  virtual void begin(Section section, Work work) = 0;
  virtual void end() = 0;
  virtual void linear_call(const LinearCall& call) { (void)call; }
};

}  // namespace fourbit::model
