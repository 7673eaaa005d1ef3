// rl trainer (cpu): the quantizer contract (the sampler's and the trainer's Fprop quantization of
// the same weight and activation tensors are bitwise identical under e2e4; a recipe that breaks
// the contract differs), the model's per-token weighted backward (linearity, equality with the
// mean loss), the step's metrics (K3 ~ 0 with the bf16 recipe, larger with e2e4; MoE routing
// replay), the options (mask, PPO epochs, KL to the reference, std normalisation), and a tiny RL
// run that must raise the reward of an easy task from chance level.
#include "rl/rl_trainer.h"

#include "../tests/model_test_util.h"
#include "quant/quantize.h"
#include "rl/byte_tokens.h"
#include "rl_test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>

namespace fourbit::rl {
namespace {

using model::ModelConfig;

ModelConfig rl_config(bool moe = false) {
  ModelConfig c = moe ? model::testing::small_moe() : model::testing::small_dense();
  c.name = moe ? "rl-moe" : "rl-dense";
  c.vocab = 264;  // bytes + end of document, padded
  c.d_model = 32;
  c.d_ff = 64;
  c.max_seq = 32;
  if (moe) c.moe.expert_d_ff = 32;
  c.validate();
  return c;
}

// A preset, or "e2e4-tensor-amax": e2e4 with one NVFP4 activation amax per pass in the RL forward.
recipe::ResolvedRecipe resolved(const ModelConfig& c, std::string_view preset) {
  recipe::Recipe r = recipe::preset(preset == "e2e4-tensor-amax" ? "e2e4" : preset);
  r.high_precision.last_blocks = 0;
  if (preset == "e2e4-tensor-amax") r = recipe::with_sampler_precision(r, "nvfp4-tensor-amax");
  return recipe::resolve(r, c.recipe_shape());
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), (size_t)a.nbytes()) == 0;
}

bool same_quantization(const quant::QuantizedTensor& a, const quant::QuantizedTensor& b) {
  if (!a.rowwise || !b.rowwise) return false;
  return same_bytes(a.rowwise->data, b.rowwise->data) && same_bytes(a.rowwise->scales, b.rowwise->scales) &&
         same_bytes(a.rowwise->amax, b.rowwise->amax);
}

// RL.md: "the trainer's and the sampler's quantization of the same tensor must be bitwise
// identical". Every linear layer's weight of a model, and one activation, through the Fprop
// operand configs the recipe gives each stage.
TEST(RlTrainer, SamplerAndTrainerQuantizeBitwiseIdentically) {
  const ModelConfig c = rl_config(true);
  for (bool break_contract : {false, true}) {
    SCOPED_TRACE(break_contract ? "contract broken on purpose" : "e2e4");
    recipe::Recipe r = recipe::preset("e2e4");
    r.high_precision.last_blocks = 0;
    if (break_contract) {
      r.allow_sampler_mismatch = true;
      // The other NVFP4 weight block shape (1x16 <-> 16x16) in the trainer only.
      recipe::Precision& w = r.policy.at(recipe::Stage::kRlTrainer, recipe::Gemm::kFprop, recipe::Operand::kWeight);
      ASSERT_TRUE(w.has_value());
      w->block_2d = !w->block_2d;
    }
    const recipe::ResolvedRecipe rr = recipe::resolve(r, c.recipe_shape());
    model::ModelOptions mo;
    mo.seed = 5;
    model::Model m(c, rr, mo);
    int compared = 0, identical = 0;
    for (int i = 0; i < m.table().size(); ++i) {
      const std::string& name = m.table().row(i).name;
      if (name.find(".weight") == std::string::npos || m.params().view(i).shape.ndim != 2) continue;
      recipe::LinearKind kind;
      int block = -1;
      if (name.find("qkv") != std::string::npos) kind = recipe::LinearKind::kQkv;
      else if (name.find("attn.out") != std::string::npos) kind = recipe::LinearKind::kAttnOut;
      else continue;  // the attention projections of every block suffice (and exist in both kinds)
      block = std::atoi(name.c_str() + std::strlen("blocks."));
      const gemm::LinearRecipe ls = rr.linear(recipe::Stage::kRlSampler, block, kind);
      const gemm::LinearRecipe lt = rr.linear(recipe::Stage::kRlTrainer, block, kind);
      ASSERT_TRUE(ls.fprop_w.quant.has_value() && lt.fprop_w.quant.has_value()) << name;
      const TensorView w = m.params().view(i);
      const quant::QuantizedTensor qs = quant::quantize_reference(w, *ls.fprop_w.quant, {}, {.tensor_name = name});
      const quant::QuantizedTensor qt = quant::quantize_reference(w, *lt.fprop_w.quant, {}, {.tensor_name = name});
      ++compared;
      identical += same_quantization(qs, qt);
      // An activation [16, K] through the input operands.
      std::vector<float> x((size_t)(16 * w.shape[1]));
      for (size_t j = 0; j < x.size(); ++j) x[j] = (float)std::sin(0.37 * (double)j) * (1.0f + (float)(j % 7));
      const TensorView xv = TensorView::contiguous(x.data(), DType::kF32, Shape{16, w.shape[1]}, Device::kCpu);
      const quant::QuantizedTensor xs = quant::quantize_reference(xv, *ls.fprop_x.quant, {}, {});
      const quant::QuantizedTensor xt = quant::quantize_reference(xv, *lt.fprop_x.quant, {}, {});
      EXPECT_TRUE(same_quantization(xs, xt)) << name << " input";
      // A decode step quantizes a few rows at a time (its tokens), the trainer's forward all of
      // them: with the per-token amax of e2e4's RL activations, rows 3 and 11 quantized alone by
      // the sampler equal those rows of the trainer's quantization of all 16, byte for byte.
      if (!break_contract) {
        ASSERT_TRUE(ls.fprop_x.quant->nvfp4_row_amax);
        const int64_t K = w.shape[1], row_bytes = (K + 1) / 2, blocks = (K + 15) / 16;
        const int64_t picked[2] = {3, 11};
        std::vector<float> sub;
        for (int64_t r : picked) sub.insert(sub.end(), x.begin() + r * K, x.begin() + (r + 1) * K);
        const TensorView sv = TensorView::contiguous(sub.data(), DType::kF32, Shape{2, K}, Device::kCpu);
        const quant::QuantizedTensor step = quant::quantize_reference(sv, *ls.fprop_x.quant, {}, {});
        for (int i = 0; i < 2; ++i) {
          const int64_t r = picked[i];
          EXPECT_EQ(std::memcmp(step.rowwise->data.ptr<uint8_t>() + i * row_bytes,
                                xt.rowwise->data.ptr<uint8_t>() + r * row_bytes, (size_t)row_bytes), 0)
              << name << " row " << r << " codes";
          EXPECT_EQ(std::memcmp(step.rowwise->scales.ptr<uint8_t>() + i * blocks,
                                xt.rowwise->scales.ptr<uint8_t>() + r * blocks, (size_t)blocks), 0)
              << name << " row " << r << " block scales";
          EXPECT_EQ(step.rowwise->amax.ptr<float>()[i], xt.rowwise->amax.ptr<float>()[r]) << name << " row " << r;
        }
      }
    }
    EXPECT_GE(compared, 4);
    if (break_contract) {
      EXPECT_EQ(identical, 0) << "1x16 and 16x16 weight blocks must quantize differently";
      EXPECT_FALSE(rr.sampler_mismatches().empty());
    } else {
      EXPECT_EQ(identical, compared);
    }
  }
}

// The weighted backward: weights 1 / n_valid on every valid token give the mean loss's gradient;
// the gradient is linear in the weights.
TEST(RlTrainer, WeightedBackwardIsTheWeightedLossGradient) {
  const ModelConfig c = rl_config(false);
  const int B = 2, T = 8;
  model::ModelOptions mo;
  mo.seed = 3;
  mo.max_batch = B;
  mo.max_seq = T;
  mo.cpu_dtype = DType::kF64;
  model::Model m(c, recipe::resolve(recipe::preset("bf16"), c.recipe_shape()), mo);
  const model::testing::Batch batch = model::testing::make_batch(B, T, c.vocab, 17);
  const int32_t* tg = batch.targets.ptr<const int32_t>();
  int n_valid = 0;
  for (int i = 0; i < B * T; ++i) n_valid += tg[i] >= 0;
  auto grads = [&](const std::vector<float>* w) {
    m.zero_grads();
    m.forward(batch.tokens, batch.targets);
    model::BackwardOptions bo;
    if (w) bo.token_weights = TensorView::contiguous(const_cast<float*>(w->data()), DType::kF32, Shape{B * T}, Device::kCpu);
    m.backward(bo);
    return model::testing::values(m.grads().flat());
  };
  const std::vector<double> g_mean = grads(nullptr);
  std::vector<float> w_mean((size_t)(B * T), 0.0f), w1((size_t)(B * T)), w2((size_t)(B * T)), w12((size_t)(B * T));
  for (int i = 0; i < B * T; ++i) {
    w_mean[(size_t)i] = tg[i] >= 0 ? 1.0f / (float)n_valid : 5.0f;  // ignored rows: weight unused
    w1[(size_t)i] = (float)std::sin(i + 1.0);
    w2[(size_t)i] = (float)std::cos(3.0 * i);
    w12[(size_t)i] = w1[(size_t)i] + w2[(size_t)i];
  }
  const std::vector<double> g_w = grads(&w_mean);
  EXPECT_LT(model::testing::diff_norm2(g_w, g_mean), 1e-6 * model::testing::norm2(g_mean));
  const std::vector<double> g1 = grads(&w1), g2 = grads(&w2), g12 = grads(&w12);
  std::vector<double> sum(g1.size());
  for (size_t i = 0; i < g1.size(); ++i) sum[i] = g1[i] + g2[i];
  EXPECT_LT(model::testing::diff_norm2(g12, sum), 1e-6 * model::testing::norm2(sum));
  EXPECT_GT(model::testing::diff_norm2(g1, g2), 0.1 * model::testing::norm2(g1));
  // A wrong length is refused, naming the option.
  m.zero_grads();
  m.forward(batch.tokens, batch.targets);
  std::vector<float> short_w(3, 1.0f);
  model::BackwardOptions bo;
  bo.token_weights = TensorView::contiguous(short_w.data(), DType::kF32, Shape{3}, Device::kCpu);
  try {
    m.backward(bo);
    FAIL() << "accepted 3 weights";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token_weights"), std::string::npos);
  }
}

using testing::make_ascii_task;
using testing::make_digit_task;

RlConfig small_rl(int P = 8, int G = 8) {
  RlConfig rl;
  rl.prompts_per_step = P;
  rl.group_size = G;
  rl.max_new_tokens = 3;
  rl.max_len = 16;
  rl.lr = 1e-2;
  rl.seed = 7;
  return rl;
}

TEST(RlTrainer, TinyRunRaisesTheReward) {
  const ModelConfig c = rl_config(false);
  const testing::DigitTask task = make_digit_task();
  RlModelOptions mo;
  mo.init_seed = 1;
  RlTrainer t(c, resolved(c, "bf16"), mo, task, small_rl());
  const double before = t.evaluate(64, 1.0);
  double first = 0, last = 0;
  const int steps = 40;
  for (int s = 0; s < steps; ++s) {
    const StepMetrics m = t.step();
    if (s < 5) first += m.reward_mean / 5;
    if (s >= steps - 5) last += m.reward_mean / 5;
    ASSERT_TRUE(m.applied);
    EXPECT_LT(m.k3, 1e-6) << "bf16 sampler and trainer compute the same distribution";
    EXPECT_EQ(m.clipped_fraction, 0.0);
    if (s % 10 == 0 || s == steps - 1) std::printf("%s\n", progress_line(m).c_str());
  }
  const double after = t.evaluate(64, 1.0);
  std::printf("[ tiny rl ] reward of the first 5 steps %.3f, last 5 %.3f; held-out (T=1) before %.3f after %.3f\n",
              first, last, before, after);
  EXPECT_LT(first, 0.3);
  EXPECT_GT(last, 0.6);
  EXPECT_GT(after, before + 0.4);
}

// Metrics of the quantized sampler, the options, and MoE routing replay.
TEST(RlTrainer, MismatchMetricsAndOptions) {
  const testing::AsciiTask task = make_ascii_task();
  RlModelOptions mo;
  mo.init_seed = 2;
  auto run = [&](const ModelConfig& c, std::string_view preset, RlConfig rl, int steps) {
    RlTrainer t(c, resolved(c, preset), mo, task, rl);
    StepMetrics m;
    double k3 = 0;
    for (int s = 0; s < steps; ++s) {
      m = t.step();
      k3 += m.k3 / steps;
      EXPECT_TRUE(std::isfinite(m.loss) && std::isfinite(m.grad_norm) && m.applied);
      EXPECT_GT(m.sampled_tokens, 0);
      EXPECT_GT(m.entropy, 0.0);
      EXPECT_GT(m.reward_std, 0.0);
    }
    std::printf("[ %-8s %-5s ] %s\n", c.name.c_str(), std::string(preset).c_str(), progress_line(m).c_str());
    m.k3 = k3;
    return m;
  };
  const ModelConfig dense = rl_config(false), moe = rl_config(true);
  const StepMetrics bf16 = run(dense, "bf16", small_rl(4, 4), 2);
  const StepMetrics e2e4 = run(dense, "e2e4", small_rl(4, 4), 2);
  const StepMetrics per_pass = run(dense, "e2e4-tensor-amax", small_rl(4, 4), 2);
  EXPECT_LT(bf16.k3, 1e-6);
  // e2e4's per-token activation amax: a decode step quantizes each token as the training forward
  // does, so the NVFP4 sampler is as close to its trainer as the bf16 one (f32 rounding).
  EXPECT_LT(e2e4.k3, 1e-6);
  // One activation amax per pass: the decode steps' row sets get other global scales than the
  // training forward's whole batch, and K3 shows it.
  EXPECT_GT(per_pass.k3, 1000 * std::max(e2e4.k3, 1e-12)) << "the per-pass amax's mismatch shows in K3";
  EXPECT_GT(per_pass.max_abs_logp_diff, 100 * e2e4.max_abs_logp_diff);
  // Breaking the quantizer contract (a BF16 trainer forward under the NVFP4 sampler) raises K3 far
  // above the exact contract's f32 rounding.
  {
    recipe::Recipe broken = recipe::preset("e2e4");
    broken.high_precision.last_blocks = 0;
    broken.allow_sampler_mismatch = true;
    for (recipe::Operand op : {recipe::Operand::kInput, recipe::Operand::kWeight})
      broken.policy.at(recipe::Stage::kRlTrainer, recipe::Gemm::kFprop, op).reset();
    RlTrainer t(dense, recipe::resolve(broken, dense.recipe_shape()), mo, task, small_rl(4, 4));
    double k3 = 0;
    for (int s = 0; s < 2; ++s) k3 += t.step().k3 / 2;
    std::printf("[ contract ] K3 e2e4 %.3e, with a bf16 trainer forward %.3e\n", e2e4.k3, k3);
    EXPECT_GT(k3, 1000 * std::max(e2e4.k3, 1e-12));
  }
  // MoE with routing replay: the bf16 trainer reproduces the sampler's log-probabilities.
  const StepMetrics moe_replay = run(moe, "bf16", small_rl(4, 4), 2);
  EXPECT_LT(moe_replay.max_abs_logp_diff, 1e-4);
  // Options run and report.
  RlConfig opt = small_rl(4, 4);
  opt.importance = ImportanceMode::kMask;
  opt.std_normalize = true;
  opt.ppo_epochs = 3;
  opt.clip_high = 0.28;
  opt.kl_coef = 0.1;
  opt.lr = 3e-2;  // large steps, so that PPO clips and the policy leaves the reference
  const StepMetrics o = run(dense, "e2e4", opt, 3);
  EXPECT_GT(o.kl_ref, 0.0);
  EXPECT_GT(o.ppo_clipped_fraction, 0.0);
  // Config errors name the field.
  RlConfig bad = small_rl();
  bad.group_size = 1;
  EXPECT_THROW(bad.validate(), Error);
  bad = small_rl();
  bad.temperature = 0.7;
  try {
    bad.validate();
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("temperature"), std::string::npos);
  }
  EXPECT_EQ(parse_importance_mode("mask"), ImportanceMode::kMask);
  EXPECT_THROW(parse_importance_mode("clip"), Error);
}

TEST(RlTrainer, PromptAndCompletionText) {
  Example ex;
  ex.prompt = "1+2=";
  const std::vector<int32_t> p = RlTrainer::prompt_tokens(ex);
  EXPECT_EQ(p, (std::vector<int32_t>{kEndOfDocumentToken, '1', '+', '2', '='}));
  EXPECT_EQ(RlTrainer::completion_text({'3', '\n', 'x'}), "3\nx");
  EXPECT_EQ(RlTrainer::completion_text({'3', kEndOfDocumentToken, '4'}), "3");
}

}  // namespace
}  // namespace fourbit::rl

namespace fourbit::rl {
namespace {

// Arithmetic for real: a small model pretrained briefly (supervised, on solved "a+b=c\n"
// examples after an end-of-document token, as the corpus writes them) knows the format but not
// all the sums; RL on add:digits=1 must then raise the held-out greedy accuracy.
TEST(RlTrainer, PretrainedModelImprovesAtAdditionWithRl) {
  ModelConfig c = rl_config(false);
  c.name = "rl-add";
  c.d_model = 64;
  c.d_ff = 128;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.validate();
  const std::unique_ptr<Task> task = make_task("add:digits=1");
  // Pretraining batches: documents of 4 solved examples, windows of T tokens.
  const int B = 16, T = 24;
  model::ModelOptions mo;
  mo.seed = 11;
  mo.max_batch = B;
  mo.max_seq = T;
  model::Model m(c, resolved(c, "bf16"), mo);
  train::AdamW opt(m, train::AdamWConfig{.beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.0, .grad_clip = 1.0});
  std::vector<int32_t> stream;
  uint64_t index = 0;
  auto fill = [&](size_t need) {
    while (stream.size() < need) {
      stream.push_back(kEndOfDocumentToken);
      for (int e = 0; e < 4; ++e)
        for (char ch : task->make_example(1000, index++).text()) stream.push_back((unsigned char)ch);
    }
  };
  std::vector<int32_t> tokens((size_t)(B * T)), targets((size_t)(B * T));
  size_t pos = 0;
  const int pretrain_steps = 300;  // greedy accuracy ~0.2 (600 steps: ~0.97, nothing left to learn)
  double loss = 0;
  for (int s = 0; s < pretrain_steps; ++s) {
    fill(pos + (size_t)(B * T) + 1);
    for (int i = 0; i < B * T; ++i) {
      tokens[(size_t)i] = stream[pos + (size_t)i];
      targets[(size_t)i] = stream[pos + (size_t)i + 1];
    }
    pos += (size_t)(B * T);
    m.zero_grads();
    loss = m.forward(TensorView::contiguous(tokens.data(), DType::kI32, Shape{B, T}, Device::kCpu),
                     TensorView::contiguous(targets.data(), DType::kI32, Shape{B, T}, Device::kCpu)).loss;
    m.backward();
    opt.step(3e-3);
  }
  RlConfig rl = small_rl(16, 8);
  rl.max_new_tokens = 4;
  rl.lr = 3e-4;  // a fine-tuning rate: 3e-3 destroys the pretrained model within 40 steps
  RlModelOptions ro;
  RlTrainer t(c, resolved(c, "bf16"), ro, *task, rl, &m);
  const double before = t.evaluate(256);
  double first = 0, last = 0;
  const int steps = 40;
  for (int s = 0; s < steps; ++s) {
    const StepMetrics sm = t.step();
    if (s < 5) first += sm.reward_mean / 5;
    if (s >= steps - 5) last += sm.reward_mean / 5;
    if (s % 10 == 0 || s == steps - 1) std::printf("%s\n", progress_line(sm).c_str());
  }
  const double after = t.evaluate(256);
  std::printf("[ add:digits=1 ] pretraining loss %.3f after %d steps; RL reward first 5 steps %.3f, last 5 %.3f; "
              "held-out greedy accuracy before %.3f after %.3f\n", loss, pretrain_steps, first, last, before, after);
  // Measured: before 0.234, after 0.730 (the sampled training reward is noisier: 0.32 -> 0.35).
  EXPECT_GT(after, before + 0.2);
}

}  // namespace
}  // namespace fourbit::rl
