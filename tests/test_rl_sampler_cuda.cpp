// rl sampler and trainer (gpu): the CUDA sampling kernel against the host sampling on the same
// logits and draws; the CUDA sampler against the CPU sampler on the same weights (the
// sampling is host code over the copied logits, so identical logits give identical draws; the
// CUDA and CPU logits differ by rounding only, so almost every first token agrees), the CUDA
// sampler's log-probabilities against the CUDA trainer's recomputation (bf16, e2e4; dense and
// MoE; printed), quantized-recipe batch padding to the 128-row tile, and a tiny RL run on the GPU
// with the NVFP4 (e2e4) sampler that must raise the reward of an easy task. Fast decode (sampler.h):
// which recipes and models keep sampler weights, that batches of <= 64 run their passes through
// the decode GEMV (a 3-sequence e2e4 batch runs at all only there: the emulated path takes whole
// 64-token tiles), the trainer's recomputation of those rollouts (48 sequences: chunked prefill
// under the quantized recipes), and long prompts prefilled in chunks against the CPU sampler.
//
// Tolerances. bf16 recipe: the sampler reads f32 logits of the KV-cache forward, the trainer's
// cross-entropy reads the bf16 logits of the training forward: a logit of magnitude |x| < 8
// carries a rounding of up to 2^-9 |x| < 0.016, and the log-softmax moves by at most twice that,
// so |dlogp| < 0.05 per token (plus the bf16 activations' differences between the cached and the
// full forward, which are of the same order); the mean is far smaller.
#include "rl/rl_trainer.h"

#include "core/device.h"
#include "rl/byte_tokens.h"
#include "rl_test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <tuple>
#include <utility>

namespace fourbit::rl {
namespace {

class RlCuda : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_GT(cuda_device_count(), 0) << "the gpu tests need a CUDA GPU"; }
};

// The smallest shape the CUDA kernels take: head_dim 64, widths multiples of 128 (quantize tiles).
model::ModelConfig cuda_config(bool moe) {
  model::ModelConfig c;
  c.name = moe ? "rl-cuda-moe" : "rl-cuda";
  c.vocab = 384;
  c.d_model = 128;
  c.n_layers = 2;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.d_ff = 256;
  c.max_seq = 64;
  if (moe) {
    c.moe.layers = {1};
    c.moe.n_experts = 4;
    c.moe.top_k = 2;
    c.moe.expert_d_ff = 128;
  }
  c.validate();
  return c;
}

// A preset, or "e2e4-w4a16": e2e4 with NVFP4 weights and BF16 activations in the RL Fprop, or
// "e2e4-tensor-amax": e2e4 with one activation amax per pass instead of per token.
recipe::ResolvedRecipe resolved(const model::ModelConfig& c, std::string_view preset) {
  const bool variant = preset == "e2e4-w4a16" || preset == "e2e4-tensor-amax";
  recipe::Recipe r = recipe::preset(variant ? "e2e4" : preset);
  r.high_precision.last_blocks = 0;
  if (preset == "e2e4-w4a16") r = recipe::with_sampler_precision(r, "nvfp4-weights");
  if (preset == "e2e4-tensor-amax") r = recipe::with_sampler_precision(r, "nvfp4-tensor-amax");
  return recipe::resolve(r, c.recipe_shape());
}

std::vector<std::vector<int32_t>> prompts_for(int B) {
  std::vector<std::vector<int32_t>> p;
  for (int b = 0; b < B; ++b) {
    std::vector<int32_t> q{kEndOfDocumentToken};
    for (int t = 0; t < 2 + b % 5; ++t) q.push_back('0' + (b * 7 + t * 3) % 10);
    q.push_back('=');
    p.push_back(q);
  }
  return p;
}

// The CUDA sampling kernel against the host reference on the same logits and draws: every token
// equal (the two differ only in FP64 summation order, ~1e-15 of a CDF boundary), log-probs and
// entropies to float rounding (both are computed in FP64 and rounded to f32 once: 1 ulp of
// values below ~20 in magnitude: 4e-6).
TEST_F(RlCuda, SamplingKernelMatchesTheHost) {
  for (const auto& [R, V] : {std::pair<int, int>{3, 5}, {37, 384}, {8, 50304}, {5, 1}}) {
    for (double temperature : {1.0, 0.7, 1.6}) {
      SCOPED_TRACE(::testing::Message() << "R " << R << " V " << V << " T " << temperature);
      std::vector<float> logits((size_t)R * V);
      for (size_t i = 0; i < logits.size(); ++i)
        logits[i] = (float)(4.0 * std::sin(0.77 * (double)i + 0.1 * R) + (i % 13 == 0 ? 6.0 : 0.0));
      const Tensor host = [&] {
        Tensor t = Tensor::empty({R, V}, DType::kF32, Device::kCpu);
        std::copy(logits.begin(), logits.end(), t.ptr<float>());
        return t;
      }();
      const Tensor dev = host.to(Device::kCuda);
      std::vector<int32_t> rows;
      std::vector<double> u;
      for (int i = 0; i < 3 * R; ++i) {
        rows.push_back((i * 7) % R);
        u.push_back(sampler_uniform(9, 4, (uint64_t)i, 0));
      }
      std::vector<int32_t> tok(rows.size());
      std::vector<float> lp(rows.size()), ent(rows.size());
      sample_rows_cuda(dev, rows, u, temperature, tok, lp, ent);
      SamplingOptions o;
      o.temperature = temperature;
      TokenDistribution d;
      std::vector<double> row((size_t)V);
      for (size_t i = 0; i < rows.size(); ++i) {
        for (int v = 0; v < V; ++v) row[(size_t)v] = logits[(size_t)rows[i] * V + v];
        sampling_distribution(row, o, d);
        const size_t k = sample_index(d, u[i]);
        EXPECT_EQ(tok[i], d.ids[k]) << "draw " << i;
        EXPECT_NEAR(lp[i], d.logprobs[k], 4e-6 + 1e-6 * std::fabs(d.logprobs[k])) << "draw " << i;
        EXPECT_NEAR(ent[i], d.entropy, 4e-6 + 1e-6 * d.entropy) << "draw " << i;
      }
    }
  }
}

// Sequence-by-sequence: the first sampled token comes from the prefill logits alone; the draws
// u are the same on both devices, so the tokens differ only where u falls within the logits'
// rounding difference of a CDF boundary (a probability of order 1e-3 per token).
TEST_F(RlCuda, CudaAndCpuSamplersDrawTheSameTokens) {
  const model::ModelConfig c = cuda_config(false);
  model::ModelOptions mo;
  mo.seed = 3;
  model::Model weights(c, resolved(c, "bf16"), mo);  // CPU f32 master weights
  SamplerOptions so;
  so.max_batch = 64;
  so.max_len = 32;
  so.cpu_bf16_rounding = true;  // the CPU mirror of the CUDA model's roundings
  Sampler cpu(c, resolved(c, "bf16"), so);
  cpu.refresh(weights);
  so.device = Device::kCuda;
  so.cpu_bf16_rounding = false;
  Sampler gpu(c, resolved(c, "bf16"), so);
  gpu.refresh(weights);  // the same f32 master weights, copied to the GPU
  const auto prompts = prompts_for(64);
  SamplingOptions o;
  o.max_new_tokens = 8;
  o.seed = 21;
  const std::vector<Rollout> a = cpu.generate(prompts, o, 0), b = gpu.generate(prompts, o, 0);
  int same_first = 0, same_all = 0;
  double max_lp = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].tokens[0] == b[i].tokens[0]) {
      ++same_first;
      max_lp = std::max(max_lp, (double)std::fabs(a[i].logprobs[0] - b[i].logprobs[0]));
    }
    same_all += a[i].tokens == b[i].tokens;
  }
  std::printf("[ cuda vs cpu sampler ] first tokens equal %d / 64, whole completions %d / 64, max |dlogp| of "
              "equal first tokens %.3e\n", same_first, same_all, max_lp);
  EXPECT_GE(same_first, 60);
  EXPECT_GE(same_all, 48);
  EXPECT_LT(max_lp, 0.05);
}

// One RL step on the GPU from a fresh model: the metrics of the trainer's recomputation of the
// sampler's tokens (K3, max / mean |dlogp|), printed per recipe; 8 completions of each of
// `prompts` prompts (16: 128 sequences, a whole 128-row tile, the emulated path; <= 8: at most 64,
// the fast path where fast_decode()). `sampler`: the sampler's stats of the step and fast_decode().
struct SamplerUse {
  SamplerStats stats;
  bool fast_decode = false;
};
StepMetrics one_step(const model::ModelConfig& c, std::string_view preset, const Task& task, int prompts = 16,
                     SamplerUse* sampler = nullptr) {
  RlModelOptions mo;
  mo.device = Device::kCuda;
  mo.init_seed = 5;
  RlConfig rl;
  rl.prompts_per_step = prompts;
  rl.group_size = 8;
  rl.max_new_tokens = 8;
  rl.max_len = 32;
  rl.seed = 3;
  RlTrainer t(c, resolved(c, preset), mo, task, rl);
  const StepMetrics m = t.step();
  std::printf("[ %-11s %-10s B %3d fast %d ] %s | mean|dlogp| %.3e\n", c.name.c_str(), std::string(preset).c_str(),
              prompts * rl.group_size, (int)t.sampler().fast_decode(), progress_line(m).c_str(), m.mean_abs_logp_diff);
  if (sampler != nullptr) *sampler = {t.sampler().last_stats(), t.sampler().fast_decode()};
  return m;
}

TEST_F(RlCuda, TrainerRecomputesTheSamplersLogprobs) {
  const auto task = testing::make_ascii_task();
  for (bool moe : {false, true}) {
    const model::ModelConfig c = cuda_config(moe);
    const StepMetrics bf16 = one_step(c, "bf16", task);
    EXPECT_LT(bf16.max_abs_logp_diff, 0.05);
    EXPECT_LT(bf16.mean_abs_logp_diff, 0.01);
    EXPECT_LT(bf16.k3, 1e-3);
    const StepMetrics e2e4 = one_step(c, "e2e4", task);
    EXPECT_TRUE(std::isfinite(e2e4.k3) && std::isfinite(e2e4.loss) && e2e4.applied);
    EXPECT_LT(e2e4.mean_abs_logp_diff, 0.2);
    // Per-token activation amaxes: RL.md's K3 < 1e-3 for dense models. One amax per pass: printed.
    if (!moe) {
      EXPECT_LT(e2e4.k3, 1e-3);
    }
    const StepMetrics per_pass = one_step(c, "e2e4-tensor-amax", task);
    std::printf("[ k3 ] %s e2e4 per-token amax %.3e (max |dlogp| %.3e), per-pass amax %.3e (max |dlogp| %.3e), "
                "bf16 %.3e\n", c.name.c_str(), e2e4.k3, e2e4.max_abs_logp_diff, per_pass.k3,
                per_pass.max_abs_logp_diff, bf16.k3);
    // NVFP4 weights, BF16 activations: no per-pass activation scale, so as close as bf16.
    const StepMetrics w4 = one_step(c, "e2e4-w4a16", task);
    EXPECT_LT(w4.max_abs_logp_diff, 0.05);
    EXPECT_LT(w4.k3, 1e-3);
  }
}

// Which samplers keep sampler weights (fast_decode), and that their passes of <= 64 tokens run:
// dense models under bf16, e2e4 (NVFP4 weights and activations) and NVFP4 weights with BF16
// activations; MoE models only without a quantizing rl_sampler stage (the expert GEMMs keep the
// 128-token passes); MXFP8 not at all (the decode GEMV reads BF16 or NVFP4 weights). B = 3 under
// e2e4 runs only on the decode GEMV (the emulated path rejects 3-token passes); B = 65 pads to
// 128 sequences and runs the emulated path.
TEST_F(RlCuda, FastDecodeRunsBatchesOfAtMost64OnTheDecodeGemv) {
  struct Case {
    bool moe;
    const char* preset;
    bool fast;
  };
  for (const Case& k : {Case{false, "bf16", true}, Case{false, "e2e4", true}, Case{false, "e2e4-w4a16", true},
                        Case{false, "mxfp8", false}, Case{true, "bf16", true}, Case{true, "e2e4", false}}) {
    const model::ModelConfig c = cuda_config(k.moe);
    SCOPED_TRACE(::testing::Message() << c.name << " " << k.preset);
    model::ModelOptions mo;
    mo.seed = 3;
    model::Model weights(c, resolved(c, k.preset), mo);
    SamplerOptions so;
    so.device = Device::kCuda;
    so.max_batch = 65;
    so.max_len = 32;
    Sampler s(c, resolved(c, k.preset), so);
    EXPECT_EQ(s.fast_decode(), k.fast);
    s.refresh(weights);
    EXPECT_EQ(s.fast_decode(), k.fast) << "refresh() rebuilds the sampler weights";
    SamplingOptions o;
    o.max_new_tokens = 6;
    o.seed = 2;
    for (int B : {3, 64, 65}) {
      const std::vector<Rollout> r = s.generate(prompts_for(B), o, (uint64_t)B);
      const SamplerStats& st = s.last_stats();
      std::printf("[ fast decode ] %-11s %-10s B %2d fast %d: prefill passes %d, decode steps %d, decode-GEMV passes "
                  "%d\n", c.name.c_str(), k.preset, B, (int)s.fast_decode(), st.prefill_passes, st.decode_steps,
                  st.fast_passes);
      EXPECT_EQ(st.decode_steps, 5);
      if (k.fast && B <= 64) {
        EXPECT_GE(st.fast_passes, st.decode_steps);  // every decode step; the prefill too where it fits
        if (B == 3) {
          EXPECT_EQ(st.fast_passes, st.prefill_passes + st.decode_steps);
        }
      } else {
        EXPECT_EQ(st.fast_passes, 0);
      }
      for (const Rollout& x : r) {
        ASSERT_EQ(x.tokens.size(), 6u);
        for (float lp : x.logprobs) EXPECT_TRUE(std::isfinite(lp) && lp <= 0);
      }
    }
  }
}

// SamplerOptions::fast_decode = false (`fourbit rl --no-fast-decode`): no sampler weights, every
// pass on the emulated path (64 sequences padded to 128 under e2e4), and the same tokens as the
// fast path up to the kernels' rounding (checked loosely: the tokens are drawn from the same draws).
TEST_F(RlCuda, FastDecodeCanBeTurnedOff) {
  const model::ModelConfig c = cuda_config(false);
  model::ModelOptions mo;
  mo.seed = 3;
  model::Model weights(c, resolved(c, "e2e4"), mo);
  SamplerOptions so;
  so.device = Device::kCuda;
  so.max_batch = 64;
  so.max_len = 32;
  so.fast_decode = false;
  Sampler slow(c, resolved(c, "e2e4"), so);
  EXPECT_FALSE(slow.fast_decode());
  slow.refresh(weights);
  EXPECT_FALSE(slow.fast_decode()) << "refresh() must not build sampler weights when fast decode is off";
  so.fast_decode = true;
  Sampler fast(c, resolved(c, "e2e4"), so);
  fast.refresh(weights);
  EXPECT_TRUE(fast.fast_decode());
  SamplingOptions o;
  o.max_new_tokens = 6;
  o.seed = 2;
  const std::vector<Rollout> a = slow.generate(prompts_for(64), o, 1);
  EXPECT_EQ(slow.last_stats().fast_passes, 0);
  const std::vector<Rollout> b = fast.generate(prompts_for(64), o, 1);
  EXPECT_GT(fast.last_stats().fast_passes, 0);
  int64_t same = 0, total = 0;
  for (size_t i = 0; i < a.size(); ++i)
    for (size_t t = 0; t < std::min(a[i].tokens.size(), b[i].tokens.size()); ++t) {
      same += a[i].tokens[t] == b[i].tokens[t];
      ++total;
    }
  std::printf("[ fast decode off ] %lld of %lld tokens equal to the fast path's\n", (long long)same, (long long)total);
  EXPECT_GT(same, total * 9 / 10);
}

// The trainer's recomputation of rollouts sampled on the fast path: 48 sequences (6 prompts x 8) of
// 4-token prompts: decode steps of 48 tokens on the decode GEMV; prefill in one pass (bf16: no
// token tile) or in 4 chunks of one column (quantized: 48 x 4 is no whole 128-token tile). Held to
// the bounds of the 128-sequence test above.
TEST_F(RlCuda, TrainerRecomputesTheFastSamplersLogprobs) {
  const auto task = testing::make_ascii_task();
  for (bool moe : {false, true}) {
    const model::ModelConfig c = cuda_config(moe);
    SamplerUse use;
    const StepMetrics bf16 = one_step(c, "bf16", task, 6, &use);
    EXPECT_TRUE(use.fast_decode);
    EXPECT_GE(use.stats.fast_passes, use.stats.decode_steps);
    EXPECT_GT(use.stats.decode_steps, 0);
    EXPECT_LT(bf16.max_abs_logp_diff, 0.05);
    EXPECT_LT(bf16.mean_abs_logp_diff, 0.01);
    EXPECT_LT(bf16.k3, 1e-3);
    const StepMetrics e2e4 = one_step(c, "e2e4", task, 6, &use);
    EXPECT_EQ(use.fast_decode, !moe);
    if (!moe) {
      EXPECT_EQ(use.stats.fast_passes, use.stats.prefill_passes + use.stats.decode_steps);
      EXPECT_GT(use.stats.prefill_passes, 1) << "48 x 4 prompt tokens: chunked prefill";
    }
    EXPECT_TRUE(std::isfinite(e2e4.k3) && std::isfinite(e2e4.loss) && e2e4.applied);
    EXPECT_LT(e2e4.mean_abs_logp_diff, 0.2);
    const StepMetrics w4 = one_step(c, "e2e4-w4a16", task, 6, &use);
    EXPECT_EQ(use.fast_decode, !moe);
    EXPECT_LT(w4.max_abs_logp_diff, 0.05);
    EXPECT_LT(w4.k3, 1e-3);
  }
}

// Long prompts (12 to 20 tokens, 5 sequences: a [5, 20] prefill of 100 tokens, neither <= 64 nor a whole
// tile) prefill in chunks of 64 / 5 = 12 columns (8, then 12) on the fast path under NVFP4 weights
// with BF16 activations, and in forced chunks of 3 columns under bf16; against the CPU sampler's
// one-pass prefill on the same weights: the same tokens and log-probs up to rounding (as the
// CUDA-vs-CPU test above).
TEST_F(RlCuda, LongPromptsPrefillInChunksLikeOnePass) {
  const model::ModelConfig c = cuda_config(false);
  std::vector<std::vector<int32_t>> prompts;
  for (int b = 0; b < 5; ++b) {
    std::vector<int32_t> q;
    for (int t = 0; t < 12 + 2 * b; ++t) q.push_back((b * 31 + t * 17 + 5) % c.vocab);
    prompts.push_back(q);
  }
  for (const auto& [preset, chunk, passes] : {std::tuple<const char*, int, int>{"e2e4-w4a16", 0, 2},
                                              std::tuple<const char*, int, int>{"bf16", 3, 7}}) {
    SCOPED_TRACE(::testing::Message() << preset << " prefill_chunk_len " << chunk);
    model::ModelOptions mo;
    mo.seed = 4;
    model::Model weights(c, resolved(c, preset), mo);
    SamplerOptions so;
    so.max_batch = 5;
    so.max_len = 40;
    so.cpu_bf16_rounding = true;
    Sampler cpu(c, resolved(c, preset), so);
    cpu.refresh(weights);
    so.device = Device::kCuda;
    so.cpu_bf16_rounding = false;
    so.prefill_chunk_len = chunk;
    Sampler gpu(c, resolved(c, preset), so);
    gpu.refresh(weights);
    ASSERT_TRUE(gpu.fast_decode());
    SamplingOptions o;
    o.max_new_tokens = 8;
    o.seed = 13;
    const std::vector<Rollout> a = cpu.generate(prompts, o, 0), b = gpu.generate(prompts, o, 0);
    const SamplerStats& st = gpu.last_stats();
    EXPECT_EQ(cpu.last_stats().prefill_passes, 1);
    EXPECT_EQ(st.prefill_passes, passes);
    EXPECT_EQ(st.fast_passes, st.prefill_passes + st.decode_steps);
    // Log-probs compared along each sequence up to its first differing token (the decode steps
    // read the keys and values the chunks wrote).
    int same_first = 0, compared = 0;
    double max_lp = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      same_first += a[i].tokens[0] == b[i].tokens[0];
      for (size_t t = 0; t < a[i].tokens.size() && t < b[i].tokens.size() && a[i].tokens[t] == b[i].tokens[t]; ++t) {
        max_lp = std::max(max_lp, (double)std::fabs(a[i].logprobs[t] - b[i].logprobs[t]));
        ++compared;
      }
    }
    std::printf("[ chunked prefill vs cpu ] %-10s chunks %d: first tokens equal %d / 5, %d of 40 tokens compared, "
                "max |dlogp| %.3e\n", preset, st.prefill_passes, same_first, compared, max_lp);
    EXPECT_GE(same_first, 4);
    EXPECT_GE(compared, 20);
    EXPECT_LT(max_lp, 0.05);
  }
}

// RL on the GPU with the NVFP4 sampler (e2e4): 30 steps of 128 rollouts on the digit task.
TEST_F(RlCuda, TinyRunWithTheNvfp4SamplerRaisesTheReward) {
  const model::ModelConfig c = cuda_config(false);
  const auto task = testing::make_digit_task();
  RlModelOptions mo;
  mo.device = Device::kCuda;
  mo.init_seed = 1;
  RlConfig rl;
  rl.prompts_per_step = 16;
  rl.group_size = 8;
  rl.max_new_tokens = 3;
  rl.max_len = 16;
  rl.lr = 1e-2;
  rl.seed = 7;
  RlTrainer t(c, resolved(c, "e2e4"), mo, task, rl);
  double first = 0, last = 0, k3 = 0;
  const int steps = 30;
  for (int s = 0; s < steps; ++s) {
    const StepMetrics m = t.step();
    if (s < 5) first += m.reward_mean / 5;
    if (s >= steps - 5) last += m.reward_mean / 5;
    k3 = std::max(k3, m.k3);
    if (s % 5 == 0 || s == steps - 1) std::printf("%s\n", progress_line(m).c_str());
  }
  std::printf("[ cuda tiny rl e2e4 ] reward first 5 steps %.3f, last 5 %.3f, max k3 %.3e\n", first, last, k3);
  EXPECT_LT(first, 0.3);
  EXPECT_GT(last, 0.6);
}

}  // namespace
}  // namespace fourbit::rl
