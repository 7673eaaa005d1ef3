// model decode (gpu): forward_cached with sampler weights (the decode GEMV over packed NVFP4 or BF16
// weights, model.h refresh_sampler_weights) against the same model without them (the emulated path:
// quantize kernels + dequantize to BF16 + cuBLASLt), for the bf16, e2e4, nvfp4 and nvfp4-46
// recipes.
//
// Layer by layer (the strong check): a GemmObserver recomputes every dense linear layer of the
// decode path with gemm::linear_fprop (the emulated path) from the very same inputs and compares:
// both multiply the same exactly-quantized operands and sum in FP32, so per element
//   |y - y_emulated| <= 4 * 2 (K + 16) 2^-24 * S + one output ulp (bf16 2^-7, f32 2^-22) * |y_emulated|
// with S = sum_k |x_k| |w_k| over the high-precision operands (the factor 4 covers quantized
// magnitudes exceeding them). End to end: two models with one seed, one with sampler weights, run
// the same prefill and decode steps; the remaining differences are FP32 summation orders that flip a
// bf16 rounding (and then possibly a quantized element) now and then, so the bound is the model gpu
// test's: err(fast, emulated) <= 0.1 * q + 5e-3 with q = err(emulated quantized, emulated bf16) the
// size of the quantization itself; bf16 recipe 1e-2. Also: no 64-token tile on the decode path
// (B = 3), CUDA-graph replay bit-identical to op-by-op steps, the decode chain and the decode GEMVs'
// SwiGLU / RoPE epilogues bit-identical to the separate kernels, stale weights after a master-weight
// change until refresh, a stale copy after set_recipe and an unsupported sampler format are errors
// that say what to do. 64 tokens per step wherever the
// emulated path must run too (its quantize kernels take 64-row tiles).
#include "core/device.h"
#include "gemm/linear.h"
#include "model/model.h"
#include "recipe/recipe.h"

#include "model_test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace fourbit::model {
namespace {

using testing::close_normwise;
using testing::diff_norm2;
using testing::norm2;
using testing::values;

class ModelDecodeCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_GT(cuda_device_count(), 0) << "the gpu tests need a CUDA GPU (run them with tools/gpu-test.sh)";
  }
};

// head_dim 64, GQA 2:1, every width a multiple of 128 (the quantize kernels' tiles), untied head.
ModelConfig decode_config() {
  ModelConfig c;
  c.name = "decode-dense";
  c.vocab = 512;
  c.d_model = 128;
  c.n_layers = 2;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.d_ff = 384;
  c.max_seq = 64;
  c.tied_embeddings = false;
  c.validate();
  return c;
}

std::unique_ptr<Model> make_model(const ModelConfig& c, const std::string& recipe, uint64_t seed = 42) {
  ModelOptions o;
  o.device = Device::kCuda;
  o.seed = seed;
  o.max_batch = 1;
  o.max_seq = 16;
  return std::make_unique<Model>(c, testing::resolved(c, recipe), o);
}

// A bf16-trained model whose sampler runs `sampler` (recipe::with_sampler_precision), its sampler
// weights built.
std::unique_ptr<Model> sampler_model(const ModelConfig& c, const char* sampler, int max_batch) {
  ModelOptions o;
  o.device = Device::kCuda;
  o.seed = 42;
  o.max_batch = max_batch;
  o.max_seq = 16;
  auto m = std::make_unique<Model>(
      c, recipe::resolve(recipe::with_sampler_precision(recipe::preset("bf16"), sampler), c.recipe_shape()), o);
  m->refresh_sampler_weights();
  return m;
}

double rel(const std::vector<double>& a, const std::vector<double>& b) {
  const double n = norm2(b);
  return diff_norm2(a, b) / (n > 0 ? n : 1.0);
}

Tensor ids(int B, int T, int vocab, uint64_t seed) {
  Tensor t = Tensor::empty({B, T}, DType::kI32, Device::kCpu);
  uint64_t s = seed;
  for (int64_t i = 0; i < t.numel(); ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    t.ptr<int32_t>()[i] = (int32_t)((s >> 33) % (uint64_t)vocab);
  }
  return t;
}

// Runs prefill (Tq tokens each) and `steps` single-token decode steps on B sequences; returns the
// logits of every call, concatenated.
std::vector<double> run(Model& m, int B, int Tq, int steps, uint64_t seed) {
  KvCache cache = m.make_kv_cache(B, Tq + steps, Tq);
  std::vector<double> out;
  const std::vector<int32_t> n_prompt((size_t)B, Tq), ones((size_t)B, 1);
  CachedForwardOptions o;
  o.all_logits = true;
  const std::vector<double> pre = values(m.forward_cached(cache, ids(B, Tq, m.config().vocab, seed), n_prompt, o));
  out.insert(out.end(), pre.begin(), pre.end());
  for (int s = 0; s < steps; ++s) {
    const std::vector<double> l = values(m.forward_cached(cache, ids(B, 1, m.config().vocab, seed + 1 + s), ones));
    out.insert(out.end(), l.begin(), l.end());
  }
  return out;
}

// The per-layer check (header comment): recomputes each dense Fprop with the emulated path.
struct LayerChecker {
  int checked = 0;
  double worst = 0;  // largest error / bound
  std::string failure;
  void operator()(const GemmObservation& ob) {
    if (ob.gemm != recipe::Gemm::kFprop || !ob.group_sizes.empty()) return;
    const TensorView& x = ob.a;  // [M, K]
    const TensorView& w = ob.b;  // [N, K] bf16
    const int64_t M = x.shape[0], K = x.shape[1], N = w.shape[0];
    Tensor ref = Tensor::empty({M, N}, ob.out.dtype, Device::kCuda);
    gemm::LinearOptions lo;
    lo.name = "reference";
    gemm::linear_fprop(*ob.recipe, x, w, ref.view(), lo);
    const std::vector<double> got = values(ob.out), want = values(ref.view()), xv = values(x), wv = values(w);
    const double tol = 4 * 2.0 * (double)(K + 16) * std::ldexp(1.0, -24);
    const double out_ulp = ob.out.dtype == DType::kBF16 ? std::ldexp(1.0, -7) : std::ldexp(1.0, -22);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += std::fabs(xv[(size_t)(i * K + k)] * wv[(size_t)(j * K + k)]);
        const double want_ij = want[(size_t)(i * N + j)], got_ij = got[(size_t)(i * N + j)];
        const double bound = tol * s + out_ulp * std::fabs(want_ij) + 1e-30;
        const double ratio = std::fabs(got_ij - want_ij) / bound;
        worst = std::max(worst, std::isnan(ratio) ? INFINITY : ratio);
        if (!(ratio <= 1.0) && failure.empty()) {
          failure = std::string(ob.layer) + ": element (" + std::to_string(i) + ", " + std::to_string(j) + ") " +
                    std::to_string(got_ij) + " vs emulated " + std::to_string(want_ij);
        }
      }
    ++checked;
  }
};

TEST_F(ModelDecodeCuda, LayersMatchTheEmulatedPath) {
  const ModelConfig c = decode_config();
  for (const char* recipe : {"bf16", "e2e4", "nvfp4", "nvfp4-46"}) {
    SCOPED_TRACE(recipe);
    auto m = make_model(c, recipe);
    m->refresh_sampler_weights();
    ASSERT_TRUE(m->has_sampler_weights());
    if (std::string(recipe) != "bf16") {
      EXPECT_GT(m->sampler_weight_bytes(), 0);
    }
    auto checker = std::make_shared<LayerChecker>();
    m->set_gemm_observer([checker](const GemmObservation& ob) { (*checker)(ob); });
    // 64 tokens per call (the emulated recomputation's tile): prefill 4 x 16, then 64 x 1.
    run(*m, 4, 16, 0, 1);
    run(*m, 64, 1, 2, 2);
    m->set_gemm_observer(nullptr);
    // qkv, attn_out, mlp_up, mlp_down per block + lm_head, per call (1 + 3 calls).
    EXPECT_EQ(checker->checked, 4 * (4 * c.n_layers + 1));
    EXPECT_TRUE(checker->failure.empty()) << checker->failure;
    std::printf("%s: decode GEMV vs emulated per layer, worst error / bound %.3e\n", recipe, checker->worst);
  }
}

TEST_F(ModelDecodeCuda, LogitsMatchTheEmulatedPath) {
  const ModelConfig c = decode_config();
  auto bf16_ref = make_model(c, "bf16");  // no sampler weights: emulated (cuBLASLt BF16)
  const std::vector<double> bf16_a = run(*bf16_ref, 4, 16, 0, 11), bf16_b = run(*bf16_ref, 64, 1, 3, 12);
  for (const char* recipe : {"bf16", "e2e4", "nvfp4", "nvfp4-46"}) {
    SCOPED_TRACE(recipe);
    auto fast = make_model(c, recipe), slow = make_model(c, recipe);
    fast->refresh_sampler_weights();
    const std::vector<double> fa = run(*fast, 4, 16, 0, 11), sa = run(*slow, 4, 16, 0, 11);
    const std::vector<double> fb = run(*fast, 64, 1, 3, 12), sb = run(*slow, 64, 1, 3, 12);
    if (std::string(recipe) == "bf16") {
      EXPECT_TRUE(close_normwise(fa, sa, 1e-2, "bf16 prefill 4 x 16"));
      EXPECT_TRUE(close_normwise(fb, sb, 1e-2, "bf16 decode 64 x 1"));
      continue;
    }
    const double qa = rel(sa, bf16_a), qb = rel(sb, bf16_b);
    ASSERT_GT(qa, 1e-3) << "the quantized recipe should change the logits";
    EXPECT_TRUE(close_normwise(fa, sa, 0.1 * qa + 5e-3, "prefill 4 x 16"));
    EXPECT_TRUE(close_normwise(fb, sb, 0.1 * qb + 5e-3, "decode 64 x 1"));
    std::printf("%s: logits fast vs emulated %.3e / %.3e (quantization effect %.3e / %.3e)\n", recipe, rel(fa, sa),
                rel(fb, sb), qa, qb);
  }
}

// Dense models replay the decode step as a CUDA graph; a GEMM observer forces op-by-op launches. The
// same kernels in the same order: bit-identical logits, for several step layouts and repeated
// replays (a second cache of the same layout replays the first one's graph only where its buffers
// coincide; either way the results must not change).
TEST_F(ModelDecodeCuda, GraphReplayEqualsEagerSteps) {
  const ModelConfig c = decode_config();
  for (const char* recipe : {"bf16", "e2e4"}) {
    SCOPED_TRACE(recipe);
    auto m = make_model(c, recipe);
    m->refresh_sampler_weights();
    for (auto [B, Tq] : {std::pair<int, int>{64, 1}, {3, 5}, {1, 1}}) {
      const std::vector<double> graph1 = run(*m, B, Tq, 3, 31);
      const std::vector<double> graph2 = run(*m, B, Tq, 3, 31);
      m->set_gemm_observer([](const GemmObservation&) {});
      const std::vector<double> eager = run(*m, B, Tq, 3, 31);
      m->set_gemm_observer(nullptr);
      EXPECT_EQ(graph1, eager) << "B " << B << " Tq " << Tq;
      EXPECT_EQ(graph2, eager) << "B " << B << " Tq " << Tq;
    }
  }
}

// The decode chain (model.h set_decode_chain): each layer's attn_out, MLP and the next layer's qkv
// in one launch, bit for bit the separate kernels. On and off give identical logits for BF16 and
// NVFP4 weights (BF16 activations), prefill and decode steps of 1 to 8 tokens (CUDA graph replays,
// one graph per layout and setting); decode_chain_steps() shows that the chain ran.
TEST_F(ModelDecodeCuda, DecodeChainEqualsSeparateKernels) {
  const ModelConfig c = decode_config();
  for (const char* sampler : {"bf16", "nvfp4-weights"}) {
    SCOPED_TRACE(sampler);
    const std::unique_ptr<Model> model = sampler_model(c, sampler, 1);
    Model& m = *model;
    for (auto [B, Tq] : {std::pair<int, int>{1, 1}, {3, 1}, {8, 1}, {4, 2}}) {
      const int64_t before = m.decode_chain_steps();
      m.set_decode_chain(true);
      const std::vector<double> on = run(m, B, Tq, 3, 41);
      EXPECT_EQ(m.decode_chain_steps(), before + 4) << "B " << B << " Tq " << Tq << ": every call should chain";
      m.set_decode_chain(false);
      const std::vector<double> off = run(m, B, Tq, 3, 41);
      EXPECT_EQ(m.decode_chain_steps(), before + 4);
      EXPECT_EQ(on, off) << "B " << B << " Tq " << Tq;
    }
    // 9 tokens a step (3 x 3 prefill) take the separate kernels.
    const int64_t before = m.decode_chain_steps();
    m.set_decode_chain(true);
    run(m, 3, 3, 0, 43);
    EXPECT_EQ(m.decode_chain_steps(), before);
  }
}

// The decode GEMVs' epilogues (Model::set_decode_epilogues: the SwiGLU in mlp_up's, RoPE and the
// KV append in qkv's) against the separate kernels: identical logits over prefill and decode steps
// (the later steps read the caches the epilogues wrote), for BF16 and NVFP4 activations, 1-16 tokens
// a step; kAuto uses them exactly where the rule says (NVFP4 activations, at most 8 tokens).
TEST_F(ModelDecodeCuda, DecodeEpiloguesEqualSeparateKernels) {
  const ModelConfig c = decode_config();
  for (const char* sampler : {"bf16", "nvfp4"}) {
    SCOPED_TRACE(sampler);
    const std::unique_ptr<Model> model = sampler_model(c, sampler, 16);
    Model& m = *model;
    for (auto [B, Tq] : {std::pair<int, int>{1, 1}, {3, 1}, {8, 1}, {4, 2}, {16, 1}, {5, 3}}) {
      const std::string what = "B " + std::to_string(B) + " Tq " + std::to_string(Tq);
      int64_t before = m.decode_epilogue_steps();
      m.set_decode_epilogues(Model::DecodeEpilogues::kOn);
      const std::vector<double> on = run(m, B, Tq, 3, 51);
      EXPECT_EQ(m.decode_epilogue_steps(), before + 4) << what << ": every call should use the epilogues";
      before = m.decode_epilogue_steps();
      m.set_decode_epilogues(Model::DecodeEpilogues::kOff);
      const std::vector<double> off = run(m, B, Tq, 3, 51);
      EXPECT_EQ(m.decode_epilogue_steps(), before) << what;
      EXPECT_EQ(on, off) << what;
      m.set_decode_epilogues(Model::DecodeEpilogues::kAuto);
      const std::vector<double> automatic = run(m, B, Tq, 3, 51);
      EXPECT_EQ(automatic, off) << what;
      const bool nvfp4_x = std::string(sampler) == "nvfp4";
      const int64_t want = (nvfp4_x && B * Tq <= 8 ? 1 : 0) + (nvfp4_x && B <= 8 ? 3 : 0);  // prefill, 3 steps
      EXPECT_EQ(m.decode_epilogue_steps(), before + want) << what << ": kAuto";
    }
  }
}

TEST_F(ModelDecodeCuda, NoTokenTileOnTheDecodePath) {
  const ModelConfig c = decode_config();
  auto m = make_model(c, "e2e4");
  // Without sampler weights the emulated path needs 64-token multiples.
  KvCache cache = m->make_kv_cache(3, 8, 5);
  const std::vector<int32_t> n5(3, 5);
  try {
    m->forward_cached(cache, ids(3, 5, c.vocab, 3), n5);
    ADD_FAILURE() << "expected the token-tile error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tiles of 64"), std::string::npos) << e.what();
  }
  m->refresh_sampler_weights();
  KvCache cache2 = m->make_kv_cache(3, 8, 5);
  const std::vector<double> l = values(m->forward_cached(cache2, ids(3, 5, c.vocab, 3), n5));
  ASSERT_EQ(l.size(), (size_t)(3 * c.vocab));
  for (double v : l) ASSERT_TRUE(std::isfinite(v));
  const std::vector<int32_t> ones(3, 1);
  const std::vector<double> d = values(m->forward_cached(cache2, ids(3, 1, c.vocab, 4), ones));
  for (double v : d) ASSERT_TRUE(std::isfinite(v));
  EXPECT_EQ(cache2.lengths()[0], 6);
}

TEST_F(ModelDecodeCuda, RefreshAfterWeightChangesAndRecipeChecks) {
  const ModelConfig c = decode_config();
  auto fast = make_model(c, "e2e4"), slow = make_model(c, "e2e4");
  EXPECT_FALSE(fast->sampler_weights_supported());
  fast->refresh_sampler_weights();
  EXPECT_TRUE(fast->sampler_weights_supported());
  // New master weights (another seed's initialization), as after a trainer update.
  auto other = make_model(c, "e2e4", 43);
  for (Model* m : {fast.get(), slow.get()}) {
    copy_tensor(m->params().flat(), other->params().flat());
    m->params_changed();
  }
  const std::vector<double> ref = run(*slow, 64, 1, 1, 21);
  const std::vector<double> stale = run(*fast, 64, 1, 1, 21);
  EXPECT_GT(rel(stale, ref), 0.1) << "stale sampler weights should not match the changed model";
  fast->refresh_sampler_weights();
  const std::vector<double> fresh = run(*fast, 64, 1, 1, 21);
  EXPECT_LT(rel(fresh, ref), 0.05) << "refreshed sampler weights should match the changed model";

  // set_recipe leaves a stale copy: an error that names the fix.
  fast->set_recipe(testing::resolved(c, "nvfp4-46"));
  try {
    run(*fast, 64, 1, 0, 22);
    ADD_FAILURE() << "expected the stale sampler weights error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("refresh_sampler_weights"), std::string::npos) << e.what();
  }
  // A sampler format the decode GEMV does not read (MXFP8): an error that names the way out.
  fast->set_recipe(testing::resolved(c, "mxfp8"));
  fast->refresh_sampler_weights();
  std::string why;
  EXPECT_FALSE(fast->sampler_weights_supported(&why));
  // The first unsupported operand is named: here qkv's activation quantizer (checked before the weight's).
  EXPECT_NE(why.find("blocks.0.qkv: activation quantizer format mxfp8"), std::string::npos) << why;
  try {
    run(*fast, 64, 1, 0, 23);
    ADD_FAILURE() << "expected the unsupported-format error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("release_sampler_weights"), std::string::npos) << e.what();
  }
  fast->release_sampler_weights();
  EXPECT_FALSE(fast->has_sampler_weights());
  const std::vector<double> emulated = run(*fast, 64, 1, 0, 23);
  for (double v : emulated) ASSERT_TRUE(std::isfinite(v));
}

}  // namespace
}  // namespace fourbit::model
