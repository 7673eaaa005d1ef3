// The named recipes. Every preset keeps the high-precision exceptions of DESIGN.md at their
// defaults (router and lm_head BF16, the last 15% of blocks BF16, no first blocks; embeddings,
// norms, softmax and the attention products are not GEMMs and never quantized), and every preset
// satisfies the RL rules (RL.md "Precision rules"): rl_sampler rounds to nearest,
// rl_trainer.fprop equals rl_sampler.fprop, rl_trainer's gradients are stochastically rounded (or
// BF16). Operand notation: X input, W weight, dY gradient; Wgrad's operands are the column-wise
// copies dY^T and X^T (blocks along tokens). with_sampler_precision (the --sampler-recipe variants
// of a recipe's RL Fprop) is here too: it takes its NVFP4 operands from the e2e4 preset.
#include "recipe/recipe.h"

#include "core/check.h"
#include "recipe/internal.h"

#include <fmt/format.h>

namespace fourbit::recipe {

namespace {

using quant::Format;
using quant::QuantConfig;
using quant::Rounding;

constexpr Rounding kRn = Rounding::kNearest;
constexpr Rounding kSr = Rounding::kStochastic;

QuantConfig make(Format f, bool block_2d, Rounding r, bool rht = false) {
  QuantConfig c;
  c.format = f;
  c.block_2d = block_2d;
  c.rounding = r;
  c.rht = rht;
  return c;
}

QuantConfig four_over_six(QuantConfig c) {
  c.nvfp4_scale_rule = quant::Nvfp4ScaleRule::kFourOverSix;
  c.four_over_six_metric = quant::FourOverSixMetric::kMse;  // the reference's default (NUMERICS 5.1)
  return c;
}

// The per-GEMM treatment of one training recipe: (X, W) for Fprop, (dY, W) for Dgrad, (dY^T, X^T)
// for Wgrad.
struct Training {
  Precision fprop_x, fprop_w, dgrad_dy, dgrad_w, wgrad_dy, wgrad_x;
};

void set_forward(Policy& p, Stage s, const Precision& x, const Precision& w) {
  p.at(s, Gemm::kFprop, Operand::kInput) = x;
  p.at(s, Gemm::kFprop, Operand::kWeight) = w;
}

void set_backward(Policy& p, Stage s, const Training& t) {
  p.at(s, Gemm::kDgrad, Operand::kGradient) = t.dgrad_dy;
  p.at(s, Gemm::kDgrad, Operand::kWeight) = t.dgrad_w;
  p.at(s, Gemm::kWgrad, Operand::kGradient) = t.wgrad_dy;
  p.at(s, Gemm::kWgrad, Operand::kInput) = t.wgrad_x;
}

// Pretraining (forward and backward) with `t`; the RL sampler runs the pretraining forward; the RL
// trainer runs the sampler's forward and `rl_backward`.
Policy uniform_policy(const Training& t, const Training& rl_backward) {
  Policy p;
  set_forward(p, Stage::kPretrainForward, t.fprop_x, t.fprop_w);
  set_backward(p, Stage::kPretrainBackward, t);
  set_forward(p, Stage::kRlSampler, t.fprop_x, t.fprop_w);
  set_forward(p, Stage::kRlTrainer, t.fprop_x, t.fprop_w);
  set_backward(p, Stage::kRlTrainer, rl_backward);
  return p;
}

// The same treatment with stochastic rounding on the gradient operands (RL.md: the trainer's
// backward must be unbiased).
Training with_sr_gradients(Training t) {
  if (t.dgrad_dy) t.dgrad_dy->rounding = kSr;
  if (t.wgrad_dy) t.wgrad_dy->rounding = kSr;
  return t;
}

Recipe named(std::string_view name, Policy policy) {
  Recipe r;
  r.name = std::string(name);
  r.policy = std::move(policy);
  return r;
}

// bf16: no GEMM operand quantized in any stage; the baseline the others are measured against.
Recipe bf16_preset() { return named("bf16", Policy::bf16()); }

// fp8: DeepSeek-V3's fine-grained FP8 (arXiv 2412.19437 §3.3; NUMERICS.md 6, TE's
// Float8BlockScaling), the Hopper-native recipe (cuBLASLt VEC128_32F / BLK128x128_32F, NUMERICS
// 7.1). E4M3 everywhere, X and dY in 1x128 tiles (per token, 128 channels), W in 128x128 blocks,
// power-of-two FP32 scales, round to nearest; Wgrad takes the 1x128 column-wise copies of dY and X
// (DeepSeek re-tiles saved activations 128x1). No operand pair is 128x128 x 128x128. RL trainer:
// the same with stochastic rounding on dY (RL.md).
Recipe fp8_preset() {
  const QuantConfig tiles = make(Format::kFp8Block, false, kRn);
  const QuantConfig blocks = make(Format::kFp8Block, true, kRn);
  const Training t{tiles, blocks, tiles, blocks, tiles, tiles};
  return named("fp8", uniform_policy(t, with_sr_gradients(t)));
}

// mxfp8: NVIDIA's MXFP8 recipe (arXiv 2506.08027; NUMERICS.md 6 and 2.3): MXFP8-E4M3 for every
// operand, 1x32 blocks, E8M0 scales rounded up (RCEIL; the OCP floor rule can diverge), round to
// nearest. RL trainer: stochastic rounding on dY (RL.md).
Recipe mxfp8_preset() {
  const QuantConfig mx = make(Format::kMxfp8, false, kRn);
  const Training t{mx, mx, mx, mx, mx, mx};
  return named("mxfp8", uniform_policy(t, with_sr_gradients(t)));
}

// NVIDIA's NVFP4 pretraining recipe (arXiv 2509.25149 §4; NUMERICS.md 4.1-4.5, TE's
// NVFP4BlockScaling):
//   Fprop  X 1x16 RN,              W 16x16 RN
//   Dgrad  dY 1x16 SR,             W 16x16 RN (the same quantized weight: its transpose)
//   Wgrad  dY^T 1x16 SR + RHT16,   X^T 1x16 RN + RHT16 (fixed signs, shared by all layers)
// plus the BF16 tail (the last 15% of blocks; NUMERICS 4.5). The RL sampler runs this forward and
// the RL trainer this forward and backward (SR already on dY).
Training nvfp4_training() {
  return {make(Format::kNvfp4, false, kRn),      make(Format::kNvfp4, true, kRn),
          make(Format::kNvfp4, false, kSr),      make(Format::kNvfp4, true, kRn),
          make(Format::kNvfp4, false, kSr, true), make(Format::kNvfp4, false, kRn, true)};
}

Recipe nvfp4_preset() {
  const Training t = nvfp4_training();
  return named("nvfp4", uniform_policy(t, t));
}

// nvfp4-46: the NVFP4 recipe with Four Over Six (arXiv 2512.02010; NUMERICS.md 5; TE's
// nvfp4_4over6 = "all" of weights and activations) on X and W: Fprop X and W, and Dgrad's W (the
// same quantized weight as Fprop). MSE picks 4 or 6 per block (the reference's default, our
// decision in NUMERICS.md). Gradients keep amax-to-6 with SR, and the RHT'd Wgrad operands keep
// amax-to-6 (TE: "pre-training paths that combine 4over6 with RHT are not yet implemented").
// Sampler and trainer forward: the same 4/6 quantizers (TE targets 4/6 at RL).
Recipe nvfp4_46_preset() {
  Training t = nvfp4_training();
  t.fprop_x = four_over_six(*t.fprop_x);
  t.fprop_w = four_over_six(*t.fprop_w);
  t.dgrad_w = four_over_six(*t.dgrad_w);
  return named("nvfp4-46", uniform_policy(t, t));
}

// e2e4: the four-stage policy of DESIGN.md (its table "default policy"), every stage in 4 bits
// except the RL trainer's backward:
//   pretrain_forward   NVFP4 RN, X 1x16, W 16x16                         (NUMERICS 10, 4.1)
//   pretrain_backward  NVFP4: Dgrad dY 1x16 SR, W 16x16 RN; Wgrad dY^T SR + RHT, X^T RN + RHT
//   rl_sampler         NVFP4 RN, X 1x16 with a per-token global amax, W 1x16. Per-token: a token's
//                      quantization then depends on that token alone, so the sampler's decode
//                      passes (a few tokens each) and the trainer's forward (every token at once)
//                      quantize it bit for bit alike (RL.md: "per-token activation scales"); with
//                      one amax per pass they differ whenever the passes' amaxes do. 1x16 weights:
//                      the 16x16 tiles exist only to make Fprop and Dgrad see one quantized weight
//                      (NUMERICS 4.3), and this stage has no Dgrad; finer scales give lower forward
//                      error (NUMERICS 10 allows either).
//   rl_trainer         forward = the sampler's exact contract (RL.md); backward MXFP8 (RCEIL) with
//                      SR on dY and dY^T, RN on W and X^T: DESIGN offers "MXFP8 or BF16 with
//                      stochastic rounding"; we choose MXFP8 SR, unbiased and half the bytes of
//                      BF16. No RHT (defined for NVFP4 only).
Recipe e2e4_preset() {
  const Training t = nvfp4_training();
  Policy p;
  set_forward(p, Stage::kPretrainForward, t.fprop_x, t.fprop_w);
  set_backward(p, Stage::kPretrainBackward, t);
  QuantConfig x = make(Format::kNvfp4, false, kRn);
  x.nvfp4_row_amax = true;
  const QuantConfig w = make(Format::kNvfp4, false, kRn);
  set_forward(p, Stage::kRlSampler, x, w);
  set_forward(p, Stage::kRlTrainer, x, w);
  const QuantConfig mx = make(Format::kMxfp8, false, kRn), mx_sr = make(Format::kMxfp8, false, kSr);
  set_backward(p, Stage::kRlTrainer, Training{{}, {}, mx_sr, mx, mx_sr, mx});
  return named("e2e4", std::move(p));
}

struct PresetEntry {
  std::string_view name;
  Recipe (*make)();
};

constexpr PresetEntry kPresets[] = {
    {"bf16", bf16_preset},   {"fp8", fp8_preset},         {"mxfp8", mxfp8_preset},
    {"nvfp4", nvfp4_preset}, {"nvfp4-46", nvfp4_46_preset}, {"e2e4", e2e4_preset},
};

}  // namespace

std::vector<std::string_view> preset_names() {
  std::vector<std::string_view> names;
  for (const PresetEntry& e : kPresets) names.push_back(e.name);
  return names;
}

Recipe preset(std::string_view name) {
  for (const PresetEntry& e : kPresets) {
    if (e.name == name) return e.make();
  }
  detail::fail("preset", fmt::format("unknown recipe preset '{}'; allowed: {}", name,
                                     fmt::join(preset_names(), ", ")));
}

Recipe with_sampler_precision(Recipe r, std::string_view which) {
  if (which == "recipe") return r;
  FOURBIT_CHECK(which == "bf16" || which == "nvfp4" || which == "nvfp4-tensor-amax" || which == "nvfp4-weights",
                "--sampler-recipe '{}': use bf16, nvfp4, nvfp4-tensor-amax, nvfp4-weights or recipe (the recipe's own "
                "rl_sampler stage)", which);
  const Recipe e2e4 = preset("e2e4");
  for (Operand o : {Operand::kInput, Operand::kWeight}) {
    const bool quantized = which == "nvfp4" || which == "nvfp4-tensor-amax" ||
                           (which == "nvfp4-weights" && o == Operand::kWeight);
    Precision p = quantized ? e2e4.policy.at(Stage::kRlSampler, Gemm::kFprop, o) : Precision{};
    if (p && which == "nvfp4-tensor-amax") p->nvfp4_row_amax = false;
    r.policy.at(Stage::kRlSampler, Gemm::kFprop, o) = p;
    r.policy.at(Stage::kRlTrainer, Gemm::kFprop, o) = p;
  }
  r.name += fmt::format("+sampler-{}", which);
  r.validate();
  return r;
}

}  // namespace fourbit::recipe
