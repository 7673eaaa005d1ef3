// model forward paths (cpu): f32 against f64, the KV-cache forward against the full forward,
// routing replay, every recipe preset through the reference quantizers, the bf16-rounding CPU mode,
// memory accounting, the profiler hooks, non-finite reporting and argument errors.
#include "gemm/gemm.h"
#include "model/model.h"

#include "model_test_util.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace fourbit::model {
namespace {

using testing::close_normwise;
using testing::make_batch;
using testing::resolved;
using testing::small_dense;
using testing::small_moe;
using testing::values;

ModelOptions cpu_options(DType dtype, uint64_t seed, int max_batch, int max_seq) {
  ModelOptions o;
  o.cpu_dtype = dtype;
  o.seed = seed;
  o.max_batch = max_batch;
  o.max_seq = max_seq;
  return o;
}

std::vector<int32_t> routing(const Model& m, int64_t n_tokens) {
  if (!m.config().is_moe()) return {};
  Tensor ids = Tensor::empty({n_tokens, m.config().n_moe_layers(), m.config().moe.top_k}, DType::kI32, Device::kCpu);
  m.expert_ids(ids.view());
  return std::vector<int32_t>(ids.ptr<int32_t>(), ids.ptr<int32_t>() + ids.numel());
}

// f32 and f64 models of one seed start from the same weights (the init rounds to FP32 first) and
// differ only by f32 rounding: ~1e-7 per op, a few hundred ops deep.
TEST(ModelForward, F32MatchesF64) {
  for (const ModelConfig& c : {small_dense(false), small_moe()}) {
    SCOPED_TRACE(c.name);
    const int B = 2, T = 8;
    Model m32(c, resolved(c), cpu_options(DType::kF32, 21, B, T));
    Model m64(c, resolved(c), cpu_options(DType::kF64, 21, B, T));
    const testing::Batch batch = make_batch(B, T, c.vocab, 31);
    m32.zero_grads();
    m64.zero_grads();
    const LossInfo l32 = m32.forward(batch.tokens, batch.targets);
    const LossInfo l64 = m64.forward(batch.tokens, batch.targets);
    ASSERT_EQ(routing(m32, B * T), routing(m64, B * T));
    EXPECT_NEAR(l32.loss, l64.loss, 1e-5 * l64.loss);
    EXPECT_TRUE(close_normwise(values(m32.logits()), values(m64.logits()), 1e-5, "logits"));
    m32.backward();
    m64.backward();
    for (int i = 0; i < m32.table().size(); ++i) {
      if (!m32.table().row(i).trainable) continue;
      EXPECT_TRUE(close_normwise(values(m32.grads().view(i)), values(m64.grads().view(i)), 1e-4,
                                 "gradient of " + m32.table().row(i).name));
    }
  }
}

// Prefill two right-aligned prompts of different lengths, then decode one token per step: the
// logits at every new position equal the full forward's logits there, and so does the routing.
void check_kv_cache(const ModelConfig& c, DType dtype, double tol) {
  const int B = 2, T = 8;
  const int prompt[B] = {5, 3};
  Model m(c, resolved(c), cpu_options(dtype, 41, B, T));
  const testing::Batch batch = make_batch(B, T, c.vocab, 51);
  m.forward(batch.tokens, batch.targets);
  const std::vector<double> full = values(m.logits());  // [B * T, V]
  const std::vector<int32_t> full_routing = routing(m, B * T);
  const int64_t V = c.vocab, n_moe = c.n_moe_layers(), k = c.moe.top_k;
  auto full_row = [&](int b, int t) {
    return std::vector<double>(full.begin() + (b * T + t) * V, full.begin() + (b * T + t + 1) * V);
  };
  KvCache cache = m.make_kv_cache(B, T, 5);
  // Prefill: Tq = 5, sequence 1's prompt right-aligned after 2 padding rows.
  Tensor toks = Tensor::zeros({B, 5}, DType::kI32, Device::kCpu);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < prompt[b]; ++t)
      toks.ptr<int32_t>()[b * 5 + 5 - prompt[b] + t] = batch.tokens.ptr<int32_t>()[b * T + t];
  const int32_t n_new[B] = {prompt[0], prompt[1]};
  CachedForwardOptions o;
  o.all_logits = true;
  Tensor ids = Tensor::empty({B * 5, std::max<int64_t>(n_moe, 1), std::max<int64_t>(k, 1)}, DType::kI32, Device::kCpu);
  if (c.is_moe()) o.expert_ids_out = ids;
  const std::vector<double> pre = values(m.forward_cached(cache, toks, n_new, o));
  EXPECT_EQ(cache.lengths(), (std::vector<int32_t>{5, 3}));
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < prompt[b]; ++t) {
      const int row = b * 5 + 5 - prompt[b] + t;
      const std::vector<double> got(pre.begin() + row * V, pre.begin() + (row + 1) * V);
      EXPECT_TRUE(close_normwise(got, full_row(b, t), tol, "prefill logits b " + std::to_string(b) + " t " + std::to_string(t)));
      for (int64_t mi = 0; mi < n_moe; ++mi)
        for (int64_t j = 0; j < k; ++j)
          EXPECT_EQ(ids.ptr<int32_t>()[(row * n_moe + mi) * k + j],
                    full_routing[(size_t)(((b * T + t) * n_moe + mi) * k + j)])
              << "routing of prefill row " << row;
    }
  }
  // Decode: feed the next token of each sequence until both hold T positions; a sequence that is
  // full sits out (n_new = 0).
  for (int step = 0; step < T - 3; ++step) {
    Tensor next = Tensor::zeros({B, 1}, DType::kI32, Device::kCpu);
    int32_t grow[B];
    std::vector<int> pos(B);
    for (int b = 0; b < B; ++b) {
      pos[(size_t)b] = cache.lengths()[(size_t)b];
      grow[b] = pos[(size_t)b] < T ? 1 : 0;
      next.ptr<int32_t>()[b] = grow[b] ? batch.tokens.ptr<int32_t>()[b * T + pos[(size_t)b]] : 0;
    }
    const std::vector<double> last = values(m.forward_cached(cache, next, grow));  // [B, V]
    for (int b = 0; b < B; ++b) {
      if (!grow[b]) continue;
      const std::vector<double> got(last.begin() + b * V, last.begin() + (b + 1) * V);
      EXPECT_TRUE(close_normwise(got, full_row(b, pos[(size_t)b]), tol,
                                 "decode logits b " + std::to_string(b) + " position " + std::to_string(pos[(size_t)b])));
    }
  }
  EXPECT_EQ(cache.lengths(), (std::vector<int32_t>{T, T}));
  EXPECT_THROW(m.forward_cached(cache, Tensor::zeros({B, 1}, DType::kI32, Device::kCpu), n_new), Error);
}

TEST(ModelKvCache, DecodeMatchesTheFullForwardF64) {
  check_kv_cache(small_dense(false), DType::kF64, 1e-12);
  check_kv_cache(small_moe(), DType::kF64, 1e-12);
  check_kv_cache(small_moe(LoadBalancing::kBias, 0), DType::kF64, 1e-12);
}

TEST(ModelKvCache, DecodeMatchesTheFullForwardF32) {
  check_kv_cache(small_dense(), DType::kF32, 1e-5);
  check_kv_cache(small_moe(), DType::kF32, 1e-5);
}

TEST(ModelKvCache, ForcedRoutingReplaysTheSampler) {
  const ModelConfig c = small_moe();
  const int B = 2, Tq = 4;
  Model m(c, resolved(c), cpu_options(DType::kF64, 42, B, 8));
  KvCache a = m.make_kv_cache(B, 8, Tq), b = m.make_kv_cache(B, 8, Tq);
  const testing::Batch batch = make_batch(B, Tq, c.vocab, 52);
  const int32_t n_new[2] = {Tq, Tq};
  Tensor ids = Tensor::empty({B * Tq, 1, 2}, DType::kI32, Device::kCpu);
  CachedForwardOptions sample;
  sample.all_logits = true;
  sample.expert_ids_out = ids;
  const std::vector<double> la = values(m.forward_cached(a, batch.tokens, n_new, sample));
  CachedForwardOptions replay;
  replay.all_logits = true;
  replay.forced_expert_ids = ids;
  EXPECT_TRUE(close_normwise(values(m.forward_cached(b, batch.tokens, n_new, replay)), la, 1e-14, "replayed logits"));
  // The training forward under the sampler's routing uses the same experts.
  ForwardOptions fo;
  fo.forced_expert_ids = ids;
  m.forward(batch.tokens, batch.targets, fo);
  EXPECT_EQ(routing(m, B * Tq), std::vector<int32_t>(ids.ptr<int32_t>(), ids.ptr<int32_t>() + ids.numel()));
  // Other ids change the output; invalid ones are an error.
  Tensor other = Tensor::empty({B * Tq, 1, 2}, DType::kI32, Device::kCpu);
  for (int i = 0; i < B * Tq; ++i) {
    other.ptr<int32_t>()[2 * i] = (ids.ptr<int32_t>()[2 * i] + 1) % 4;
    other.ptr<int32_t>()[2 * i + 1] = (ids.ptr<int32_t>()[2 * i + 1] + 1) % 4;
  }
  fo.forced_expert_ids = other;
  const double forced_loss = m.forward(batch.tokens, batch.targets, fo).loss;
  fo.forced_expert_ids = ids;
  EXPECT_NE(forced_loss, m.forward(batch.tokens, batch.targets, fo).loss);
  other.ptr<int32_t>()[0] = 4;
  fo.forced_expert_ids = other;
  EXPECT_THROW(m.forward(batch.tokens, batch.targets, fo), Error);
}

// Every recipe preset runs forward and backward on the CPU (reference quantizers); the quantized
// losses stay near the BF16 one and the gradients point the same way; stochastic rounding is keyed
// by the step.
// The dense and MoE models that every recipe preset runs on (widths the quantizers' blocks divide).
std::vector<ModelConfig> preset_test_configs() {
  ModelConfig dense = small_dense();
  dense.d_model = 32;
  dense.d_ff = 64;
  ModelConfig moe = small_moe();
  moe.d_model = 32;
  moe.d_ff = 64;
  moe.moe.expert_d_ff = 32;
  return {dense, moe};
}

// zero_grads() only marks the gradients zero: the first Wgrad GEMM of each one overwrites it (beta
// 0) and everything else is filled before it is accumulated into or read. Stale values (here NaN
// bytes) must therefore never reach a gradient, reading grads() right after zero_grads() must give
// zeros, and a second backward must accumulate onto the first. (Only the parameters' own elements
// are poisoned: the alignment padding between them in the flat buffer is zero from construction
// and written by nobody.)
void poison_grads(const Model& m) {
  for (int i = 0; i < m.table().size(); ++i) fill_bytes(m.grads().view(i), 0xFF);
}

TEST(ModelForward, ZeroGradsOverwritesStaleGradientsAndAccumulates) {
  for (const ModelConfig& c : {small_dense(true), small_dense(false), small_moe()}) {
    SCOPED_TRACE(c.name + (c.tied_embeddings ? " (tied)" : ""));
    const int B = 2, T = 8;
    const testing::Batch batch = make_batch(B, T, c.vocab, 37);
    Model m(c, resolved(c), cpu_options(DType::kF32, 23, B, T));
    m.zero_grads();
    m.forward(batch.tokens, batch.targets);
    m.backward();
    const std::vector<double> g = values(m.grads().flat());

    poison_grads(m);  // NaN in every gradient
    m.zero_grads();
    for (double v : values(m.grads().flat())) ASSERT_EQ(v, 0.0) << "grads() read after zero_grads()";

    poison_grads(m);
    m.zero_grads();
    m.forward(batch.tokens, batch.targets);
    m.backward();
    EXPECT_EQ(values(m.grads().flat()), g) << "a stale gradient survived zero_grads()";

    m.forward(batch.tokens, batch.targets);
    m.backward();  // accumulates: 2 g up to f32 rounding (a tied embedding adds two terms in turn)
    std::vector<double> twice = g;
    for (double& v : twice) v *= 2.0;
    EXPECT_TRUE(close_normwise(values(m.grads().flat()), twice, 1e-6, "accumulated gradients"));
  }
}

TEST(ModelRecipes, EveryPresetRunsOnTheCpu) {
  for (const ModelConfig& c : preset_test_configs()) {
    SCOPED_TRACE(c.name);
    const int B = 2, T = 16;
    const testing::Batch batch = make_batch(B, T, c.vocab, 61);
    Model ref(c, resolved(c, "bf16"), cpu_options(DType::kF32, 71, B, T));
    ref.zero_grads();
    const double ref_loss = ref.forward(batch.tokens, batch.targets).loss;
    ref.backward();
    for (std::string_view name : recipe::preset_names()) {
      SCOPED_TRACE(std::string(name));
      recipe::Recipe r = recipe::preset(name);
      r.high_precision.last_blocks = 0;  // quantize every block of this 2-block model
      Model m(c, recipe::resolve(r, c.recipe_shape()), cpu_options(DType::kF32, 71, B, T));
      m.zero_grads();
      ForwardOptions fo;
      fo.step = 3;
      const LossInfo info = m.forward(batch.tokens, batch.targets, fo);
      EXPECT_NEAR(info.loss, ref_loss, 0.05 * ref_loss);
      m.backward();
      m.check_grads_finite();
      const std::vector<double> g = values(m.grad("blocks.0.attn.qkv.weight"));
      const std::vector<double> gr = values(ref.grad("blocks.0.attn.qkv.weight"));
      double dot = 0;
      for (size_t i = 0; i < g.size(); ++i) dot += g[i] * gr[i];
      EXPECT_GT(dot / (testing::norm2(g) * testing::norm2(gr)), 0.5) << "gradient direction vs bf16";
      if (name != "bf16") {
        EXPECT_NE(info.loss, ref_loss) << "the recipe quantized nothing";
      }
      // The same step draws the same bits; another step other ones (recipes with SR gradients).
      const std::vector<double> g1 = values(m.grads().flat());
      m.zero_grads();
      m.forward(batch.tokens, batch.targets, fo);
      m.backward();
      EXPECT_EQ(values(m.grads().flat()), g1) << "not deterministic";
      fo.step = 4;
      m.zero_grads();
      m.forward(batch.tokens, batch.targets, fo);
      m.backward();
      const bool sr = r.policy.at(recipe::Stage::kPretrainBackward, recipe::Gemm::kDgrad, recipe::Operand::kGradient)
                          .has_value() &&
                      r.policy.at(recipe::Stage::kPretrainBackward, recipe::Gemm::kDgrad, recipe::Operand::kGradient)
                              ->rounding == quant::Rounding::kStochastic;
      if (sr) {
        EXPECT_NE(values(m.grads().flat()), g1) << "the stochastic rounding ignores the step";
      }
    }
  }
}

// Keeping the Wgrads' X as their quantized column-wise copies (the default) changes no bit of the
// losses or gradients against keeping X (ModelOptions::keep_wgrad_inputs), in pretraining and in
// RL training, for every preset; it shrinks the arena exactly by the per-block ln1 / ln2 / act that
// become per-pass scratch, and a GEMM observer makes the model keep X again.
TEST(ModelRecipes, QuantizedWgradInputsKeepTheGradientsBitForBit) {
  const std::vector<ModelConfig> configs = preset_test_configs();
  const ModelConfig& dense = configs[0];
  const int B = 2, T = 16;
  for (const ModelConfig& c : configs) {
    SCOPED_TRACE(c.name);
    const testing::Batch batch = make_batch(B, T, c.vocab, 62);
    for (std::string_view name : recipe::preset_names()) {
      SCOPED_TRACE(std::string(name));
      recipe::Recipe r = recipe::preset(name);
      r.high_precision.last_blocks = 0;  // quantize every block of this 2-block model
      const recipe::ResolvedRecipe rr = recipe::resolve(r, c.recipe_shape());
      ModelOptions o = cpu_options(DType::kF32, 72, B, T);
      o.keep_wgrad_inputs = true;
      Model keep(c, rr, o);
      o.keep_wgrad_inputs = false;
      Model saving(c, rr, o);
      for (TrainingStage stage : {TrainingStage::kPretrain, TrainingStage::kRlTrainer}) {
        SCOPED_TRACE(stage == TrainingStage::kPretrain ? "pretrain" : "rl_trainer");
        ForwardOptions fo;
        fo.stage = stage;
        fo.step = 5;
        keep.zero_grads();
        saving.zero_grads();
        const LossInfo lk = keep.forward(batch.tokens, batch.targets, fo);
        const LossInfo ls = saving.forward(batch.tokens, batch.targets, fo);
        EXPECT_EQ(lk.loss, ls.loss);
        EXPECT_EQ(keep.saved_wgrad_input_bytes(), 0);
        const std::vector<std::string> names = saving.activation_names();
        const bool any_saved = saving.saved_wgrad_input_bytes() > 0;
        EXPECT_EQ(any_saved, std::find(names.begin(), names.end(), "blocks.0.attn_norm") == names.end());
        if (name != "bf16" && stage == TrainingStage::kPretrain) {
          EXPECT_TRUE(any_saved) << "a quantized recipe kept its Wgrad inputs in full precision";
        }
        keep.backward();
        saving.backward();
        EXPECT_EQ(saving.saved_wgrad_input_bytes(), 0) << "the backward released every saved copy";
        ASSERT_EQ(values(saving.grads().flat()), values(keep.grads().flat()));
      }
      if (name == "bf16") {
        EXPECT_EQ(saving.activation_bytes(), keep.activation_bytes());
      } else {
        // Per block: ln1 (every block), ln2 and act (dense blocks) leave the arena; one scratch
        // of each remains. The arena rounds every buffer to its alignment.
        auto aligned = [](int64_t bytes) { return (bytes + Arena::kAlignment - 1) / Arena::kAlignment * Arena::kAlignment; };
        const int64_t N = (int64_t)B * T, C = c.d_model, F = c.d_ff, f32 = 4;
        int64_t dense_blocks = 0;
        for (int l = 0; l < c.n_layers; ++l) dense_blocks += c.is_moe_block(l) ? 0 : 1;
        int64_t freed = (c.n_layers - 1) * aligned(N * C * f32);
        if (dense_blocks > 0) freed += (dense_blocks - 1) * (aligned(N * C * f32) + aligned(N * F * f32));
        EXPECT_EQ(keep.activation_bytes() - saving.activation_bytes(), freed);
      }
    }
  }
  // An evaluation forward keeps nothing for a backward, and a backward after it is refused.
  Model m(dense, resolved(dense, "nvfp4"), cpu_options(DType::kF32, 73, B, T));
  const testing::Batch batch = make_batch(B, T, dense.vocab, 63);
  ForwardOptions eval;
  eval.for_backward = false;
  const double eval_loss = m.forward(batch.tokens, batch.targets, eval).loss;
  EXPECT_EQ(m.saved_wgrad_input_bytes(), 0);
  try {
    m.backward();
    ADD_FAILURE() << "a backward ran after an evaluation forward";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("for_backward"), std::string::npos) << e.what();
  }
  // An attached observer (an audit) sees X: the next forward keeps every X.
  EXPECT_EQ(m.forward(batch.tokens, batch.targets).loss, eval_loss);
  EXPECT_GT(m.saved_wgrad_input_bytes(), 0);
  int observed = 0;
  m.set_gemm_observer([&](const GemmObservation&) { ++observed; });
  m.forward(batch.tokens, batch.targets);
  m.backward();
  EXPECT_EQ(m.saved_wgrad_input_bytes(), 0);
  EXPECT_EQ(observed, 3 * (dense.n_layers * 4 + 1));  // fprop, dgrad, wgrad of 4 layers a block + lm_head
}

// The CPU model that mirrors the CUDA model's bf16 roundings: activations are bf16 values, and the
// result stays close to the f32 model.
TEST(ModelForward, Bf16RoundingMode) {
  const ModelConfig c = small_moe();
  const int B = 2, T = 8;
  ModelOptions o = cpu_options(DType::kF32, 81, B, T);
  Model f32(c, resolved(c), o);
  o.cpu_bf16_rounding = true;
  Model emu(c, resolved(c), o);
  const testing::Batch batch = make_batch(B, T, c.vocab, 91);
  const LossInfo a = f32.forward(batch.tokens, batch.targets), b = emu.forward(batch.tokens, batch.targets);
  EXPECT_NEAR(a.loss, b.loss, 1e-2);
  EXPECT_NE(a.loss, b.loss);
  for (double x : values(emu.logits())) ASSERT_EQ(x, (double)formats::round_to_bf16((float)x));
  emu.backward();
  f32.backward();
  EXPECT_TRUE(close_normwise(values(emu.grads().flat()), values(f32.grads().flat()), 0.05, "gradients"));
  o.cpu_dtype = DType::kF64;
  EXPECT_THROW(Model(c, resolved(c), o), Error);
}

// ModelOptions::cpu_gemm_backend: the naive reference loops and OpenBLAS (where built) compute the
// same model to FP32 rounding; asking for OpenBLAS in a build without it is an error naming it.
TEST(ModelForward, CpuGemmBackendIsSelectable) {
  const ModelConfig c = small_moe();
  const int B = 2, T = 8;
  const testing::Batch batch = make_batch(B, T, c.vocab, 95);
  ModelOptions o = cpu_options(DType::kF32, 85, B, T);
  o.cpu_gemm_backend = gemm::Backend::kCpuReference;
  Model naive(c, resolved(c), o);
  const LossInfo ln = naive.forward(batch.tokens, batch.targets);
  o.cpu_gemm_backend = gemm::Backend::kCpuBlas;
  Model blas(c, resolved(c), o);
  if (!gemm::backend_built(gemm::Backend::kCpuBlas)) {
    try {
      blas.forward(batch.tokens, batch.targets);
      ADD_FAILURE() << "cpu-blas was accepted in a build without OpenBLAS";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("cpu-blas"), std::string::npos) << e.what();
    }
    return;
  }
  const LossInfo lb = blas.forward(batch.tokens, batch.targets);
  ASSERT_EQ(routing(naive, B * T), routing(blas, B * T));
  EXPECT_NEAR(ln.loss, lb.loss, 1e-5 * ln.loss);
  EXPECT_TRUE(close_normwise(values(naive.logits()), values(blas.logits()), 1e-5, "logits"));
}

TEST(ModelForward, ArenaIsSizedExactlyAndReused) {
  const ModelConfig c = small_moe();
  Model m(c, resolved(c), cpu_options(DType::kF32, 1, 3, 8));
  EXPECT_EQ(m.activation_peak_bytes(), 0);
  const testing::Batch small = make_batch(1, 5, c.vocab, 1), full = make_batch(3, 8, c.vocab, 2);
  m.forward(small.tokens, small.targets);
  m.backward();
  EXPECT_LT(m.activation_peak_bytes(), m.activation_bytes());
  m.forward(full.tokens, full.targets);
  m.backward();
  EXPECT_EQ(m.activation_peak_bytes(), m.activation_bytes());
  const testing::Batch too_long = make_batch(1, 9, c.vocab, 3), too_wide = make_batch(4, 2, c.vocab, 3);
  EXPECT_THROW(m.forward(too_long.tokens, too_long.targets), Error);
  EXPECT_THROW(m.forward(too_wide.tokens, too_wide.targets), Error);
}

TEST(ModelForward, GradientsAccumulateAndLossScaleApplies) {
  const ModelConfig c = small_moe();
  Model m(c, resolved(c), cpu_options(DType::kF64, 3, 2, 8));
  const testing::Batch batch = make_batch(2, 8, c.vocab, 4);
  m.zero_grads();
  m.forward(batch.tokens, batch.targets);
  m.backward();
  const std::vector<double> once = values(m.grads().flat());
  m.forward(batch.tokens, batch.targets);
  BackwardOptions half;
  half.loss_scale = 0.5;
  m.backward(half);
  const std::vector<double> twice = values(m.grads().flat());
  for (size_t i = 0; i < once.size(); ++i) ASSERT_NEAR(twice[i], 1.5 * once[i], 1e-12 * (1 + std::fabs(once[i])));
  EXPECT_THROW(m.backward(), Error);  // one backward per forward
  EXPECT_THROW(m.logits(), Error);    // overwritten by the backward
}

class CountingProfiler : public Profiler {
 public:
  void begin(Section s, Work w) override {
    EXPECT_FALSE(open_) << "nested begin";
    open_ = true;
    ++brackets[{s, w}];
  }
  void end() override {
    EXPECT_TRUE(open_) << "end without begin";
    open_ = false;
  }
  void linear_call(const LinearCall& c) override { ++linears[{c.section, c.gemm}]; }
  std::map<std::pair<Section, Work>, int> brackets;
  std::map<std::pair<Section, recipe::Gemm>, int> linears;

 private:
  bool open_ = false;
};

TEST(ModelForward, ProfilerSeesEverySectionAndLinear) {
  const ModelConfig c = small_moe();  // block 0 dense, block 1 MoE with a shared expert
  Model m(c, resolved(c), cpu_options(DType::kF32, 5, 2, 8));
  CountingProfiler p;
  m.set_profiler(&p);
  const testing::Batch batch = make_batch(2, 8, c.vocab, 6);
  m.forward(batch.tokens, batch.targets);
  m.backward();
  using G = recipe::Gemm;
  EXPECT_EQ((p.linears[{Section::kAttention, G::kFprop}]), 4);  // qkv, out per block
  EXPECT_EQ((p.linears[{Section::kAttention, G::kWgrad}]), 4);
  EXPECT_EQ((p.linears[{Section::kMlp, G::kFprop}]), 2);
  EXPECT_EQ((p.linears[{Section::kMoe, G::kFprop}]), 5);  // router, 2 expert, 2 shared
  EXPECT_EQ((p.linears[{Section::kMoe, G::kDgrad}]), 5);
  EXPECT_EQ((p.linears[{Section::kLmHead, G::kDgrad}]), 1);
  EXPECT_EQ((p.brackets[{Section::kAttention, Work::kAttention}]), 4);  // forward + backward, 2 blocks
  EXPECT_GT((p.brackets[{Section::kEmbedding, Work::kOther}]), 0);
  EXPECT_GT((p.brackets[{Section::kLmHead, Work::kOther}]), 0);
  EXPECT_GT((p.brackets[{Section::kMoe, Work::kLinear}]), 0);
}

// ModelOptions::fuse_residual_add: attn_out and a dense block's mlp_down add the residual stream in
// their epilogues (one separate add fewer each); a MoE block keeps the separate residual add, and its
// shared expert's mlp_down adds into the routed experts' output in its epilogue (one add fewer). In
// f64 the sum is the same either way; with the CUDA model's bf16 roundings it is rounded once
// instead of twice.
TEST(ModelForward, FusedResidualAddsMatchTheSeparateAdds) {
  const ModelConfig c = small_moe();  // block 0 dense, block 1 MoE
  const int B = 2, T = 8;
  const testing::Batch batch = make_batch(B, T, c.vocab, 17);
  struct Run {
    double loss;
    std::vector<double> grads;
    std::map<std::pair<Section, Work>, int> forward_brackets;
  };
  auto run = [&](DType dtype, bool bf16_rounding, bool fuse) {
    ModelOptions o = cpu_options(dtype, 23, B, T);
    o.cpu_bf16_rounding = bf16_rounding;
    o.fuse_residual_add = fuse;
    Model m(c, resolved(c), o);
    CountingProfiler p;
    m.set_profiler(&p);
    m.zero_grads();
    const LossInfo l = m.forward(batch.tokens, batch.targets);
    Run r{l.loss, {}, p.brackets};
    m.set_profiler(nullptr);
    m.backward();
    r.grads = values(m.grads().flat());
    return r;
  };
  const Run sep64 = run(DType::kF64, false, false), fused64 = run(DType::kF64, false, true);
  EXPECT_NEAR(fused64.loss, sep64.loss, 1e-12 * sep64.loss);
  EXPECT_TRUE(close_normwise(fused64.grads, sep64.grads, 1e-12, "f64 gradients"));
  // One add fewer in each block's attention, in the dense block's MLP, and in the MoE block (the
  // shared expert's).
  using P = std::pair<Section, Work>;
  const P attn{Section::kAttention, Work::kOther}, mlp{Section::kMlp, Work::kOther}, moe{Section::kMoe, Work::kOther};
  EXPECT_EQ(sep64.forward_brackets.at(attn) - fused64.forward_brackets.at(attn), c.n_layers);
  EXPECT_EQ(sep64.forward_brackets.at(mlp) - fused64.forward_brackets.at(mlp), 1);
  EXPECT_EQ(sep64.forward_brackets.at(moe) - fused64.forward_brackets.at(moe), 1);
  // The bf16-rounding mode: one rounding of the sum instead of two, close to the separate adds.
  const Run sep16 = run(DType::kF32, true, false), fused16 = run(DType::kF32, true, true);
  EXPECT_NEAR(fused16.loss, sep16.loss, 2e-3 * sep16.loss);
  EXPECT_TRUE(close_normwise(fused16.grads, sep16.grads, 0.02, "bf16-rounding gradients"));
  EXPECT_NEAR(fused16.loss, sep64.loss, 1e-2 * sep64.loss);
}

// ModelOptions::fuse_rope_backward: the attention backward rotates dq and dk back through RoPE
// itself (the same arithmetic as the separate pass): the same gradients bit for bit, and one
// separate step fewer per block in the backward.
TEST(ModelForward, FusedRopeBackwardGivesTheSameGradients) {
  const ModelConfig c = small_moe();
  const int B = 2, T = 8;
  const testing::Batch batch = make_batch(B, T, c.vocab, 19);
  using P = std::pair<Section, Work>;
  for (const DType dtype : {DType::kF64, DType::kF32}) {
    auto run = [&](bool fuse, int& backward_attention_other) {
      ModelOptions o = cpu_options(dtype, 29, B, T);
      o.fuse_rope_backward = fuse;
      Model m(c, resolved(c), o);
      m.zero_grads();
      m.forward(batch.tokens, batch.targets);
      CountingProfiler p;
      m.set_profiler(&p);
      m.backward();
      m.set_profiler(nullptr);
      const auto it = p.brackets.find(P{Section::kAttention, Work::kOther});
      backward_attention_other = it == p.brackets.end() ? 0 : it->second;
      return values(m.grads().flat());
    };
    int sep_brackets = 0, fused_brackets = 0;
    const std::vector<double> sep = run(false, sep_brackets), fused = run(true, fused_brackets);
    ASSERT_EQ(sep.size(), fused.size());
    int64_t differ = 0;
    for (size_t i = 0; i < sep.size(); ++i) differ += sep[i] != fused[i];
    EXPECT_EQ(differ, 0) << dtype_name(dtype) << ": gradients that differ with the fused RoPE backward";
    EXPECT_EQ(sep_brackets - fused_brackets, c.n_layers) << dtype_name(dtype);
  }
}

// ModelOptions::recompute_activations: qkv, a dense block's gate_up and act in per-pass scratch,
// recomputed in the backward: the loss and every gradient bit for bit those of the plain step, in
// less activation memory; with the quantized recipes (the recomputed GEMMs quantize their X again,
// ln1 / ln2 recomputed where only their quantized Wgrad copies were kept).
TEST(ModelForward, RecomputedActivationsGiveTheSameGradients) {
  // small-dense: two dense blocks share the scratch; small-moe: block 1's MoE (its shared expert
  // keeps its own buffers) after a dense block 0.
  for (const auto& [c, preset] : {std::pair{small_dense(), std::string("bf16")}, std::pair{small_dense(), std::string("fp8")},
                                  std::pair{small_dense(), std::string("nvfp4")}, std::pair{small_moe(), std::string("bf16")},
                                  std::pair{small_moe(), std::string("nvfp4")}}) {
    SCOPED_TRACE(c.name + " " + preset);
    const int B = 2, T = 16;
    const testing::Batch batch = make_batch(B, T, c.vocab, 27);
    auto run = [&](bool recompute, double& loss, int64_t& arena) {
      ModelOptions o = cpu_options(DType::kF32, 37, B, T);
      o.recompute_activations = recompute;
      Model m(c, resolved(c, preset), o);
      m.zero_grads();
      ForwardOptions fo;
      fo.step = 2;
      loss = m.forward(batch.tokens, batch.targets, fo).loss;
      m.backward();
      arena = m.activation_bytes();
      return values(m.grads().flat());
    };
    double loss_plain = 0, loss_re = 0;
    int64_t arena_plain = 0, arena_re = 0;
    const std::vector<double> plain = run(false, loss_plain, arena_plain), re = run(true, loss_re, arena_re);
    EXPECT_EQ(loss_plain, loss_re);
    ASSERT_EQ(plain.size(), re.size());
    int64_t differ = 0;
    for (size_t i = 0; i < plain.size(); ++i) differ += plain[i] != re[i];
    EXPECT_EQ(differ, 0) << "gradients that differ with recomputed activations";
    EXPECT_LT(arena_re, arena_plain);
  }
}

// ForwardOptions::loss_gradient_scale: the forward writes the loss gradient over the logits; the
// losses and every parameter gradient equal those of the plain forward + backward bit for bit,
// the backward refuses other options, and the promise needs for_backward.
TEST(ModelForward, LossGradientInTheForwardGivesTheSameGradients) {
  const ModelConfig c = small_moe();
  const int B = 2, T = 8;
  testing::Batch batch = make_batch(B, T, c.vocab, 23);
  batch.targets.ptr<int32_t>()[3] = -1;  // an ignored token
  for (const DType dtype : {DType::kF64, DType::kF32}) {
    auto run = [&](std::optional<double> promise, double loss_scale, double& loss) {
      Model m(c, resolved(c), cpu_options(dtype, 31, B, T));
      m.zero_grads();
      ForwardOptions fo;
      fo.loss_gradient_scale = promise;
      loss = m.forward(batch.tokens, batch.targets, fo).loss;
      BackwardOptions bo;
      bo.loss_scale = loss_scale;
      m.backward(bo);
      return values(m.grads().flat());
    };
    double loss_sep = 0, loss_fused = 0;
    const std::vector<double> sep = run(std::nullopt, 0.25, loss_sep), fused = run(0.25, 0.25, loss_fused);
    EXPECT_EQ(loss_sep, loss_fused) << dtype_name(dtype);
    ASSERT_EQ(sep.size(), fused.size());
    int64_t differ = 0, nonzero = 0;
    for (size_t i = 0; i < sep.size(); ++i) differ += sep[i] != fused[i], nonzero += sep[i] != 0;
    EXPECT_EQ(differ, 0) << dtype_name(dtype) << ": gradients that differ with the loss gradient in the forward";
    EXPECT_GT(nonzero, (int64_t)sep.size() / 2) << dtype_name(dtype);
  }
  Model m(c, resolved(c), cpu_options(DType::kF32, 31, B, T));
  ForwardOptions fo;
  fo.loss_gradient_scale = 0.5;
  m.forward(batch.tokens, batch.targets, fo);
  BackwardOptions other;
  other.loss_scale = 1.0;
  try {
    m.backward(other);
    ADD_FAILURE() << "a backward with another loss_scale went through";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("loss_gradient_scale"), std::string::npos) << e.what();
  }
  other.loss_scale = 0.5;
  m.backward(other);  // the refused call left the model able to run the right one
  fo.for_backward = false;
  EXPECT_THROW(m.forward(batch.tokens, batch.targets, fo), Error);
}

TEST(ModelForward, NonFiniteValuesAreReportedByName) {
  const ModelConfig c = small_dense();
  Model m(c, resolved(c), cpu_options(DType::kF32, 7, 2, 8));
  const testing::Batch batch = make_batch(2, 8, c.vocab, 8);
  m.params().view(m.table().index_of("blocks.1.mlp.down.weight")).ptr<float>()[3] =
      std::numeric_limits<float>::quiet_NaN();
  m.params_changed();
  try {
    m.forward(batch.tokens, batch.targets);
    ADD_FAILURE() << "a NaN weight went unnoticed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("blocks.1.output"), std::string::npos) << e.what();
  }
  EXPECT_THROW(m.check_params_finite(), Error);
  ForwardOptions quiet;
  quiet.check_finite = false;
  EXPECT_TRUE(std::isnan(m.forward(batch.tokens, batch.targets, quiet).loss));
  m.backward();
  try {
    m.check_grads_finite();
    ADD_FAILURE() << "NaN gradients went unnoticed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gradient of"), std::string::npos) << e.what();
  }
  Tensor bad = Tensor::zeros({2, 8}, DType::kI32, Device::kCpu);
  bad.ptr<int32_t>()[5] = c.vocab;
  EXPECT_THROW(m.forward(bad, batch.targets), Error);
  EXPECT_THROW(m.forward(batch.tokens, bad), Error);
}

TEST(ModelForward, RouterBiasMovesTowardBalance) {
  const ModelConfig c = small_moe(LoadBalancing::kBias, 0);
  Model m(c, resolved(c), cpu_options(DType::kF32, 9, 2, 8));
  const testing::Batch batch = make_batch(2, 8, c.vocab, 10);
  m.forward(batch.tokens, batch.targets);
  const std::vector<int32_t> counts = m.expert_counts()[0];
  m.update_router_bias();
  const std::vector<double> bias = values(m.param("blocks.1.moe.router.bias"));
  const double mean = 2.0 * 16 / 4;
  for (int e = 0; e < 4; ++e) {
    const double want = counts[(size_t)e] < mean ? c.moe.bias_update_rate
                        : counts[(size_t)e] > mean ? -c.moe.bias_update_rate : 0.0;
    EXPECT_NEAR(bias[(size_t)e], want, 1e-9) << "expert " << e << " count " << counts[(size_t)e];
  }
}

TEST(ModelForward, RejectsAMismatchedRecipe) {
  const ModelConfig c = small_moe();
  EXPECT_THROW(Model(c, resolved(small_dense()), cpu_options(DType::kF32, 1, 1, 4)), Error);
}

}  // namespace
}  // namespace fourbit::model
