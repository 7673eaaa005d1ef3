// rl sampler (cpu): the sampling distribution (temperature, top-k, top-p, greedy) against hand
// computations and, with fixed-seed Philox draws, against observed frequencies; generation with
// stop tokens, max_new_tokens and the cache length; determinism of the draws; the sampler's
// log-probabilities against the trainer's recomputation (Model::forward + token_losses) with the
// bf16 recipe (float tolerance) and with the quantized presets (measured and printed); routing
// replay of the sampler's experts in the trainer's forward (MoE); refresh(); chunked prefill
// (SamplerOptions::prefill_chunk_len) against one pass, and its log-probabilities against the
// trainer's.
#include "rl/sampler.h"

#include "rl/rl_trainer.h"

#include "../tests/model_test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <numeric>

namespace fourbit::rl {
namespace {

using model::ModelConfig;

TEST(RlSampler, DistributionHandComputed) {
  const std::vector<double> logits = {1.0, 3.0, 2.0, 3.0, -1.0};
  TokenDistribution d;
  SamplingOptions o;
  // Temperature 1, everything kept: log_softmax.
  sampling_distribution(logits, o, d);
  ASSERT_EQ(d.ids.size(), 5u);
  double lse = 0;
  for (double x : logits) lse += std::exp(x);
  lse = std::log(lse);
  double entropy = 0;
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(d.ids[i], (int32_t)i);
    EXPECT_NEAR(d.logprobs[i], logits[i] - lse, 1e-14);
    entropy -= std::exp(logits[i] - lse) * (logits[i] - lse);
  }
  EXPECT_NEAR(d.entropy, entropy, 1e-14);
  // Temperature 2: softmax(z / 2).
  o.temperature = 2;
  sampling_distribution(logits, o, d);
  double lse2 = 0;
  for (double x : logits) lse2 += std::exp(x / 2);
  lse2 = std::log(lse2);
  EXPECT_NEAR(d.logprobs[4], -0.5 - lse2, 1e-14);
  // Top-k 2: the two 3.0s (ids 1 and 3), each 1/2.
  o.temperature = 1;
  o.top_k = 2;
  sampling_distribution(logits, o, d);
  ASSERT_EQ(d.ids, (std::vector<int32_t>{1, 3}));
  EXPECT_NEAR(d.logprobs[0], std::log(0.5), 1e-14);
  // Top-k 1 among ties: the lower id.
  o.top_k = 1;
  sampling_distribution(logits, o, d);
  EXPECT_EQ(d.ids, (std::vector<int32_t>{1}));
  EXPECT_EQ(d.logprobs[0], 0.0);
  // Top-p: p(1) = p(3) = e^3 / S ~ 0.4223 each, p(2) ~ 0.1554: 0.5 needs both 3.0s, 0.9 adds id 2.
  o.top_k = 0;
  o.top_p = 0.5;
  sampling_distribution(logits, o, d);
  EXPECT_EQ(d.ids, (std::vector<int32_t>{1, 3}));
  o.top_p = 0.9;
  sampling_distribution(logits, o, d);
  EXPECT_EQ(d.ids, (std::vector<int32_t>{1, 2, 3}));
  const double kept = std::log(2 * std::exp(3.0) + std::exp(2.0));
  EXPECT_NEAR(d.logprobs[1], 2.0 - kept, 1e-14);
  // Top-p smaller than the largest probability: one token.
  o.top_p = 0.01;
  sampling_distribution(logits, o, d);
  EXPECT_EQ(d.ids, (std::vector<int32_t>{1}));
  // Greedy.
  o = SamplingOptions{};
  o.temperature = 0;
  sampling_distribution(logits, o, d);
  EXPECT_TRUE(d.greedy);
  EXPECT_EQ(d.ids, (std::vector<int32_t>{1}));
  EXPECT_EQ(d.entropy, 0.0);
  // -inf logits are never sampled.
  const std::vector<double> masked = {-INFINITY, 0.0, -INFINITY};
  sampling_distribution(masked, SamplingOptions{}, d);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(d.ids[sample_index(d, sampler_uniform(1, 2, 3, (uint64_t)i))], 1);
}

TEST(RlSampler, OptionErrorsNameTheField) {
  auto msg = [](SamplingOptions o) {
    try {
      o.validate(10);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  SamplingOptions o;
  o.temperature = -1;
  EXPECT_NE(msg(o).find("temperature"), std::string::npos);
  o = {};
  o.top_p = 0;
  EXPECT_NE(msg(o).find("top_p"), std::string::npos);
  o = {};
  o.top_k = -2;
  EXPECT_NE(msg(o).find("top_k"), std::string::npos);
  o = {};
  o.stop_tokens = {10};
  EXPECT_NE(msg(o).find("stop token"), std::string::npos);
}

// Frequencies of 40000 fixed-seed draws against the distribution's probabilities, for
// temperature, top-k and top-p: every kept token within 5 standard deviations (binomial), every
// dropped token never drawn. Also checks that the draws are uniform in [0, 1).
TEST(RlSampler, DrawFrequenciesMatchTheDistribution) {
  std::vector<double> logits(12);
  for (size_t v = 0; v < logits.size(); ++v) logits[v] = std::sin(1.7 * (double)v) * 2.0;
  struct Case {
    double temperature, top_p;
    int top_k;
  };
  const int n = 40000;
  for (const Case cs : {Case{1.0, 1.0, 0}, Case{0.5, 1.0, 0}, Case{1.5, 1.0, 5}, Case{1.0, 0.8, 0},
                        Case{0.7, 0.9, 4}}) {
    SCOPED_TRACE(::testing::Message() << "T " << cs.temperature << " top_p " << cs.top_p << " top_k " << cs.top_k);
    SamplingOptions o;
    o.temperature = cs.temperature;
    o.top_p = cs.top_p;
    o.top_k = cs.top_k;
    TokenDistribution d;
    sampling_distribution(logits, o, d);
    if (cs.top_k > 0) {
      EXPECT_LE((int)d.ids.size(), cs.top_k);
    }
    std::map<int32_t, int> count;
    double sum_u = 0;
    for (int i = 0; i < n; ++i) {
      const double u = sampler_uniform(7, 3, (uint64_t)(i % 64), (uint64_t)(i / 64));
      ASSERT_GE(u, 0.0);
      ASSERT_LT(u, 1.0);
      sum_u += u;
      ++count[d.ids[sample_index(d, u)]];
    }
    EXPECT_NEAR(sum_u / n, 0.5, 5 * std::sqrt(1.0 / 12 / n));
    double total_p = 0;
    for (size_t i = 0; i < d.ids.size(); ++i) {
      const double p = std::exp(d.logprobs[i]);
      total_p += p;
      const double sd = std::sqrt(n * p * (1 - p));
      EXPECT_NEAR(count[d.ids[i]], n * p, 5 * sd + 1) << "token " << d.ids[i];
    }
    EXPECT_NEAR(total_p, 1.0, 1e-12);
    int drawn = 0;
    for (const auto& [id, c] : count) drawn += c;
    EXPECT_EQ(drawn, n) << "a token outside the kept set was drawn";
    // The kept set under top-p: the smallest prefix by probability reaching top_p.
    if (cs.top_p < 1 && cs.top_k == 0) {
      SamplingOptions full = o;
      full.top_p = 1;
      TokenDistribution f;
      sampling_distribution(logits, full, f);
      std::vector<double> ps;
      for (double lp : f.logprobs) ps.push_back(std::exp(lp));
      std::sort(ps.rbegin(), ps.rend());
      double cum = 0;
      size_t need = 0;
      while (cum < cs.top_p) cum += ps[need++];
      EXPECT_EQ(d.ids.size(), need);
    }
  }
}

ModelConfig sampler_config(bool moe) {
  ModelConfig c = moe ? model::testing::small_moe() : model::testing::small_dense();
  c.d_model = 32;
  c.d_ff = 64;
  c.max_seq = 32;
  if (moe) c.moe.expert_d_ff = 32;
  c.validate();
  return c;
}

// A preset, or "e2e4-w4a16": e2e4 with the RL Fprop's activations in BF16 and its weights in NVFP4
// (recipe::with_sampler_precision(..., "nvfp4-weights")), or "e2e4-tensor-amax": e2e4 with one activation
// amax per pass instead of per token.
recipe::ResolvedRecipe resolved(const ModelConfig& c, std::string_view preset) {
  const bool variant = preset == "e2e4-w4a16" || preset == "e2e4-tensor-amax";
  recipe::Recipe r = recipe::preset(variant ? "e2e4" : preset);
  r.high_precision.last_blocks = 0;  // quantize both blocks of the 2-block model
  if (preset == "e2e4-w4a16") r = recipe::with_sampler_precision(r, "nvfp4-weights");
  if (preset == "e2e4-tensor-amax") r = recipe::with_sampler_precision(r, "nvfp4-tensor-amax");
  return recipe::resolve(r, c.recipe_shape());
}

std::vector<std::vector<int32_t>> prompts_for(int B, int vocab) {
  std::vector<std::vector<int32_t>> p;
  for (int b = 0; b < B; ++b) {
    std::vector<int32_t> q;
    for (int t = 0; t < 2 + (b * 3) % 5; ++t) q.push_back((b * 7 + t * 5 + 1) % vocab);
    p.push_back(q);
  }
  return p;
}

TEST(RlSampler, StopTokensLengthsAndDeterminism) {
  const ModelConfig c = sampler_config(false);
  SamplerOptions so;
  so.max_batch = 6;
  so.max_len = 16;
  Sampler s(c, resolved(c, "bf16"), so);
  const auto prompts = prompts_for(6, c.vocab);
  SamplingOptions o;
  o.max_new_tokens = 10;
  o.seed = 5;
  const std::vector<Rollout> a = s.generate(prompts, o, 0);
  ASSERT_EQ(a.size(), 6u);
  for (size_t b = 0; b < a.size(); ++b) {
    EXPECT_EQ(a[b].tokens.size(), 10u) << "no stop tokens: max_new_tokens";
    EXPECT_FALSE(a[b].stopped);
    EXPECT_EQ(a[b].logprobs.size(), a[b].tokens.size());
    for (float lp : a[b].logprobs) EXPECT_LE(lp, 0.0f);
  }
  EXPECT_EQ(s.last_stats().generated_tokens, 60);
  // Same seed and call: the same tokens; another call: other tokens.
  const std::vector<Rollout> again = s.generate(prompts, o, 0);
  for (size_t b = 0; b < a.size(); ++b) EXPECT_EQ(again[b].tokens, a[b].tokens);
  const std::vector<Rollout> other = s.generate(prompts, o, 1);
  int differ = 0;
  for (size_t b = 0; b < a.size(); ++b) differ += other[b].tokens != a[b].tokens;
  EXPECT_GT(differ, 0);
  // The batch composition does not change a sequence's draws (sequence 0 alone).
  const std::vector<Rollout> alone = s.generate(std::span(prompts).first(1), o, 0);
  EXPECT_EQ(alone[0].tokens, a[0].tokens);
  EXPECT_NEAR(alone[0].logprobs[3], a[0].logprobs[3], 1e-5);

  // Stop tokens: every sequence ends at its first stop token, which it keeps.
  std::map<int32_t, int> freq;
  for (const Rollout& r : a)
    for (int32_t t : r.tokens) ++freq[t];
  const int32_t common = std::max_element(freq.begin(), freq.end(), [](auto& x, auto& y) {
                           return x.second < y.second;
                         })->first;
  o.stop_tokens = {common};
  const std::vector<Rollout> st = s.generate(prompts, o, 0);
  int stopped = 0;
  for (size_t b = 0; b < st.size(); ++b) {
    const auto it = std::find(a[b].tokens.begin(), a[b].tokens.end(), common);
    if (it == a[b].tokens.end()) {
      EXPECT_EQ(st[b].tokens, a[b].tokens);
      EXPECT_FALSE(st[b].stopped);
    } else {
      ++stopped;
      EXPECT_TRUE(st[b].stopped);
      EXPECT_EQ(st[b].tokens, std::vector<int32_t>(a[b].tokens.begin(), it + 1));
    }
  }
  EXPECT_GT(stopped, 0);
  // The cache length bounds a completion: prompt + completion <= max_len.
  o.stop_tokens.clear();
  o.max_new_tokens = 100;
  const std::vector<Rollout> full = s.generate(prompts, o, 2);
  for (size_t b = 0; b < full.size(); ++b) {
    EXPECT_EQ(prompts[b].size() + full[b].tokens.size(), (size_t)so.max_len + 1)
        << "the last sampled token need not be fed";
  }
  // Greedy: deterministic whatever the seed.
  o.temperature = 0;
  o.max_new_tokens = 5;
  o.seed = 1;
  const auto g1 = s.generate(prompts, o, 0);
  o.seed = 2;
  const auto g2 = s.generate(prompts, o, 9);
  for (size_t b = 0; b < g1.size(); ++b) EXPECT_EQ(g1[b].tokens, g2[b].tokens);
}

// The trainer's recomputation of the sampled tokens' log-probabilities: a training forward over
// prompt + completion with targets on the completion only; logp = -token_losses.
struct Recomputed {
  double max_abs = 0, mean_abs = 0;
  int64_t n = 0;
};
Recomputed recompute(model::Model& trainer, const std::vector<std::vector<int32_t>>& prompts,
                     const std::vector<Rollout>& rollouts, bool replay) {
  const ModelConfig& c = trainer.config();
  const int B = (int)prompts.size();
  int T = 0;
  for (int b = 0; b < B; ++b) T = std::max(T, (int)(prompts[(size_t)b].size() + rollouts[(size_t)b].tokens.size() - 1));
  std::vector<int32_t> tokens((size_t)B * T, 0), targets((size_t)B * T, -1);
  const int64_t rr = c.is_moe() ? (int64_t)c.n_moe_layers() * c.moe.top_k : 0;
  std::vector<int32_t> routes((size_t)(B * T * rr));
  for (size_t i = 0; i < routes.size(); ++i) routes[i] = (int32_t)(i % c.moe.top_k);
  for (int b = 0; b < B; ++b) {
    std::vector<int32_t> seq = prompts[(size_t)b];
    seq.insert(seq.end(), rollouts[(size_t)b].tokens.begin(), rollouts[(size_t)b].tokens.end());
    const int P = (int)prompts[(size_t)b].size();
    for (int t = 0; t + 1 < (int)seq.size(); ++t) {
      tokens[(size_t)(b * T + t)] = seq[(size_t)t];
      if (t + 1 >= P) targets[(size_t)(b * T + t)] = seq[(size_t)(t + 1)];
    }
    if (rr > 0) {
      const std::vector<int32_t>& e = rollouts[(size_t)b].expert_ids;
      EXPECT_EQ((int64_t)e.size(), (int64_t)(seq.size() - 1) * rr);
      std::copy(e.begin(), e.end(), routes.begin() + (ptrdiff_t)(b * T * rr));
    }
  }
  model::ForwardOptions fo;
  fo.stage = model::TrainingStage::kRlTrainer;
  fo.for_backward = false;  // log-probabilities only
  if (replay && rr > 0)
    fo.forced_expert_ids = TensorView::contiguous(routes.data(), DType::kI32, Shape{(int64_t)B * T, c.n_moe_layers(), c.moe.top_k}, Device::kCpu);
  trainer.forward(TensorView::contiguous(tokens.data(), DType::kI32, Shape{B, T}, Device::kCpu),
                  TensorView::contiguous(targets.data(), DType::kI32, Shape{B, T}, Device::kCpu), fo);
  const TensorView losses = trainer.token_losses();
  Recomputed r;
  for (int b = 0; b < B; ++b) {
    const int P = (int)prompts[(size_t)b].size();
    for (size_t i = 0; i < rollouts[(size_t)b].tokens.size(); ++i) {
      const int t = P - 1 + (int)i;
      const double lp = -(double)losses.ptr<const float>()[b * T + t];
      const double d = std::fabs(lp - rollouts[(size_t)b].logprobs[i]);
      r.max_abs = std::max(r.max_abs, d);
      r.mean_abs += d;
      ++r.n;
    }
  }
  r.mean_abs /= (double)std::max<int64_t>(1, r.n);
  return r;
}

// bf16 recipe on the CPU (f32): the sampler's log-probabilities (KV-cache forward, f32 logits,
// double log-softmax) equal the trainer's (full forward, f32 cross-entropy) to f32 rounding; so
// do MXFP8, NVFP4 weights with BF16 activations, and e2e4, whose NVFP4 activations carry a
// per-token amax: a token quantizes alike in a decode step and in the training forward. With one
// NVFP4 activation amax per pass (the nvfp4 preset, e2e4-tensor-amax) a decode step's rows and the
// training forward's whole batch get different global scales, so the two differ by more; measured
// and printed (and bounded loosely: the same model, not another).
// Chunked prefill (prefill_chunk_len 4 over prompts of 2 to 6 tokens: a first chunk of 2 columns
// in which the 2-token prompts have no rows, then 4) is held to the same bounds.
TEST(RlSampler, LogprobsMatchTheTrainersRecomputation) {
  for (bool moe : {false, true}) {
    const ModelConfig c = sampler_config(moe);
    for (std::string_view preset : {"bf16", "mxfp8", "nvfp4", "e2e4", "e2e4-w4a16", "e2e4-tensor-amax"}) {
      for (int chunk : {0, 4}) {
        SCOPED_TRACE(::testing::Message() << c.name << " " << preset << " prefill_chunk_len " << chunk);
        SamplerOptions so;
        so.max_batch = 5;
        so.max_len = 24;
        so.prefill_chunk_len = chunk;
        Sampler s(c, resolved(c, preset), so);
        model::ModelOptions mo;
        mo.seed = 99;  // other weights than the sampler's: refresh() must copy them
        mo.max_batch = 5;
        mo.max_seq = 24;
        model::Model trainer(c, resolved(c, preset), mo);
        s.refresh(trainer);
        const auto prompts = prompts_for(5, c.vocab);
        SamplingOptions o;
        o.max_new_tokens = 12;
        o.seed = 11;
        const std::vector<Rollout> r = s.generate(prompts, o, 4);
        EXPECT_EQ(s.last_stats().prefill_passes, chunk == 0 ? 1 : 2);
        const Recomputed d = recompute(trainer, prompts, r, true);
        std::printf("[ sampler vs trainer ] %-10s %-10s chunk %d tokens %3lld  max |dlogp| %.3e  mean %.3e\n",
                    c.name.c_str(), std::string(preset).c_str(), chunk, (long long)d.n, d.max_abs, d.mean_abs);
        if (preset == "bf16" || preset == "mxfp8" || preset == "e2e4-w4a16" || preset == "e2e4") {
          // No per-pass activation scale: every row quantizes alike in any pass (measured: f32
          // rounding, <= 5e-7).
          EXPECT_LT(d.max_abs, 2e-5);
        } else {
          EXPECT_LT(d.mean_abs, 0.2);
        }
      }
    }
  }
}

// Chunked prefill against one pass on the same weights, in f64 (bf16 recipe): the chunks feed the
// same tokens at the same positions, so the logits agree to f64 summation order and the draws
// give the same tokens, log-probabilities and experts. Chunk widths 1 (a decode-like pass per
// column), 3 (uneven: the first chunk takes the remainder) and >= L (one pass).
TEST(RlSampler, ChunkedPrefillMatchesOnePass) {
  for (bool moe : {false, true}) {
    const ModelConfig c = sampler_config(moe);
    SamplerOptions so;
    so.max_batch = 6;
    so.max_len = 20;
    so.cpu_dtype = DType::kF64;
    Sampler one(c, resolved(c, "bf16"), so);
    EXPECT_FALSE(one.fast_decode()) << "no decode GEMV on the cpu";
    std::vector<std::vector<int32_t>> prompts = prompts_for(6, c.vocab);
    prompts[2].clear();  // L = 9: prompts of 2 to 9 tokens
    for (int i = 0; i < 9; ++i) prompts[2].push_back((i * 11 + 3) % c.vocab);
    const int L = 9;
    SamplingOptions o;
    o.max_new_tokens = 6;
    o.seed = 17;
    const std::vector<Rollout> ref = one.generate(prompts, o, 3);
    EXPECT_EQ(one.last_stats().prefill_passes, 1);
    EXPECT_EQ(one.last_stats().fast_passes, 0);
    const int decode_steps = one.last_stats().decode_steps;
    for (int chunk : {1, 3, 9, 50}) {
      SCOPED_TRACE(::testing::Message() << c.name << " prefill_chunk_len " << chunk);
      so.prefill_chunk_len = chunk;
      Sampler chunked(c, resolved(c, "bf16"), so);
      const std::vector<Rollout> r = chunked.generate(prompts, o, 3);
      EXPECT_EQ(chunked.last_stats().prefill_passes, (L + chunk - 1) / chunk);
      EXPECT_EQ(chunked.last_stats().decode_steps, decode_steps);
      ASSERT_EQ(r.size(), ref.size());
      for (size_t b = 0; b < r.size(); ++b) {
        EXPECT_EQ(r[b].tokens, ref[b].tokens) << "sequence " << b;
        ASSERT_EQ(r[b].logprobs.size(), ref[b].logprobs.size());
        for (size_t i = 0; i < r[b].logprobs.size(); ++i)
          EXPECT_NEAR(r[b].logprobs[i], ref[b].logprobs[i], 2e-6) << "sequence " << b << " token " << i;
        EXPECT_EQ(r[b].expert_ids, ref[b].expert_ids) << "sequence " << b;
      }
    }
  }
  SamplerOptions bad;
  bad.prefill_chunk_len = -1;
  const ModelConfig c = sampler_config(false);
  EXPECT_THROW(Sampler(c, resolved(c, "bf16"), bad), Error);
}

// Where the quantized mismatch comes from: a KV-cache prefill of whole sequences (the same rows
// in one pass, like the training forward) under rl_sampler gives the training forward's
// (rl_trainer) logits up to the attention kernels' f32 summation order, for every recipe; decode
// steps quantize one row per sequence per pass, and NVFP4's per-tensor activation scale then
// differs (the test above measures that difference).
TEST(RlSampler, PrefillOfWholeSequencesMatchesTheTrainingForward) {
  for (bool moe : {false, true}) {
    const ModelConfig c = sampler_config(moe);
    for (std::string_view preset : {"bf16", "mxfp8", "nvfp4", "e2e4"}) {
      SCOPED_TRACE(::testing::Message() << c.name << " " << preset);
      const int B = 3, T = 10;
      model::ModelOptions mo;
      mo.seed = 8;
      mo.max_batch = B;
      mo.max_seq = T;
      model::Model m(c, resolved(c, preset), mo);
      const model::testing::Batch batch = model::testing::make_batch(B, T, c.vocab, 5, 0);
      model::ForwardOptions fo;
      fo.stage = model::TrainingStage::kRlTrainer;
      fo.for_backward = false;  // logits only
      m.forward(batch.tokens, batch.targets, fo);
      const std::vector<double> train_logits = model::testing::values(m.logits());
      const int64_t rr = c.is_moe() ? (int64_t)c.n_moe_layers() * c.moe.top_k : 0;
      std::vector<int32_t> routes((size_t)(B * T * rr));
      if (moe) m.expert_ids(TensorView::contiguous(routes.data(), DType::kI32, Shape{B * T, c.n_moe_layers(), c.moe.top_k}, Device::kCpu));
      model::KvCache cache = m.make_kv_cache(B, T, T);
      model::CachedForwardOptions co;
      co.stage = recipe::Stage::kRlSampler;
      co.all_logits = true;
      if (moe) co.forced_expert_ids = TensorView::contiguous(routes.data(), DType::kI32, Shape{B * T, c.n_moe_layers(), c.moe.top_k}, Device::kCpu);
      const std::vector<int32_t> n_new(B, T);
      const std::vector<double> cached = model::testing::values(m.forward_cached(cache, batch.tokens, n_new, co));
      ASSERT_EQ(cached.size(), train_logits.size());
      double max_abs = 0, ref = 0;
      for (size_t i = 0; i < cached.size(); ++i) {
        max_abs = std::max(max_abs, std::fabs(cached[i] - train_logits[i]));
        ref = std::max(ref, std::fabs(train_logits[i]));
      }
      std::printf("[ prefill vs training forward ] %-11s %-6s max |dlogit| %.3e (max |logit| %.2f)\n", c.name.c_str(),
                  std::string(preset).c_str(), max_abs, ref);
      EXPECT_LT(max_abs, 1e-4 * std::max(1.0, ref));  // measured: 0 (bitwise) for every recipe
    }
  }
}

TEST(RlSampler, RefreshCopiesTheTrainersWeights) {
  const ModelConfig c = sampler_config(false);
  SamplerOptions so;
  so.max_batch = 2;
  so.max_len = 12;
  Sampler s(c, resolved(c, "bf16"), so);
  model::ModelOptions mo;
  mo.seed = 1234;
  model::Model trainer(c, resolved(c, "bf16"), mo);
  const auto before = model::testing::values(s.model().params().flat());
  s.refresh(trainer);
  const auto after = model::testing::values(s.model().params().flat());
  EXPECT_NE(before, after);
  EXPECT_EQ(after, model::testing::values(trainer.params().flat()));
  // A different model is refused with a message naming both.
  ModelConfig other = c;
  other.name = "other";
  other.d_ff = 96;
  model::Model wrong(other, resolved(other, "bf16"), mo);
  try {
    s.refresh(wrong);
    FAIL() << "refresh accepted another model";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("other"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace fourbit::rl
