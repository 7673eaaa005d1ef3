// The RL sampler (sampler.h): the sampling distribution (temperature, top-k, top-p) on the host,
// Philox draws, and the prefill + decode loop over Model::forward_cached.
#include "rl/sampler.h"

#include "core/check.h"
#include "core/rng.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>

namespace fourbit::rl {

void SamplingOptions::validate(int64_t vocab) const {
  FOURBIT_CHECK(std::isfinite(temperature) && temperature >= 0,
                "sampling: temperature must be >= 0 (0 = greedy), got {}", temperature);
  FOURBIT_CHECK(top_p > 0 && top_p <= 1, "sampling: top_p must lie in (0, 1], got {}", top_p);
  FOURBIT_CHECK(top_k >= 0, "sampling: top_k must be >= 0 (0 = every token), got {}", top_k);
  FOURBIT_CHECK(max_new_tokens >= 1, "sampling: max_new_tokens must be >= 1, got {}", max_new_tokens);
  for (int32_t s : stop_tokens)
    FOURBIT_CHECK(s >= 0 && s < vocab, "sampling: stop token {} lies outside the vocabulary [0, {})", s,
                  vocab);
}

void sampling_distribution(std::span<const double> logits, const SamplingOptions& o, TokenDistribution& out) {
  const int64_t V = (int64_t)logits.size();
  FOURBIT_CHECK(V >= 1, "sampling_distribution: empty logits");
  out.ids.clear();
  out.logprobs.clear();
  out.entropy = 0;
  out.greedy = o.temperature == 0;
  for (int64_t v = 0; v < V; ++v)
    FOURBIT_CHECK(!std::isnan(logits[(size_t)v]), "sampling_distribution: logit {} is NaN", v);
  if (out.greedy) {
    int64_t best = 0;
    for (int64_t v = 1; v < V; ++v)
      if (logits[(size_t)v] > logits[(size_t)best]) best = v;
    out.ids.push_back((int32_t)best);
    out.logprobs.push_back(0.0);
    return;
  }
  const double inv_t = 1.0 / o.temperature;
  // Order: larger z first, then lower id (a strict weak order, so ties are deterministic).
  auto before = [&](int32_t a, int32_t b) {
    const double za = logits[(size_t)a], zb = logits[(size_t)b];
    return za > zb || (za == zb && a < b);
  };
  std::vector<int32_t> kept((size_t)V);
  std::iota(kept.begin(), kept.end(), 0);
  if (o.top_k > 0 && o.top_k < V) {
    std::nth_element(kept.begin(), kept.begin() + (o.top_k - 1), kept.end(), before);
    kept.resize((size_t)o.top_k);
  }
  auto lse_of = [&](const std::vector<int32_t>& ids) {
    double m = -std::numeric_limits<double>::infinity();
    for (int32_t v : ids) m = std::max(m, logits[(size_t)v] * inv_t);
    if (std::isinf(m)) return m;  // every kept logit -inf
    double s = 0;
    for (int32_t v : ids) s += std::exp(logits[(size_t)v] * inv_t - m);
    return m + std::log(s);
  };
  if (o.top_p < 1) {
    std::sort(kept.begin(), kept.end(), before);
    const double lse = lse_of(kept);
    double cum = 0;
    size_t n = 0;
    while (n < kept.size()) {
      cum += std::exp(logits[(size_t)kept[n]] * inv_t - lse);
      ++n;
      if (cum >= o.top_p) break;
    }
    kept.resize(n);
  }
  std::sort(kept.begin(), kept.end());
  const double lse = lse_of(kept);
  FOURBIT_CHECK(std::isfinite(lse), "sampling_distribution: the kept logits are all -inf or overflow "
                "(lse {}); check the model's logits for Inf", lse);
  out.ids = kept;
  out.logprobs.resize(kept.size());
  for (size_t i = 0; i < kept.size(); ++i) {
    const double lp = logits[(size_t)kept[i]] * inv_t - lse;
    out.logprobs[i] = lp;
    if (lp > -std::numeric_limits<double>::infinity()) out.entropy -= std::exp(lp) * lp;
  }
}

size_t sample_index(const TokenDistribution& dist, double u) {
  FOURBIT_CHECK(!dist.ids.empty(), "sample_index: empty distribution");
  double cum = 0;
  size_t last_positive = 0;
  for (size_t i = 0; i < dist.ids.size(); ++i) {
    const double p = std::exp(dist.logprobs[i]);
    if (p > 0) last_positive = i;
    cum += p;
    if (u < cum && p > 0) return i;
  }
  return last_positive;  // u beyond the rounded total: the last token with mass
}

double sampler_uniform(uint64_t seed, uint64_t call, uint64_t b, uint64_t t) {
  const RandomStream s{seed, kSamplerStreamSalt ^ call};
  const Philox4x32Result r = s.block((b << 32) | (t & 0xFFFFFFFFull));
  const uint64_t bits = ((uint64_t)r.v[0] << 21) ^ ((uint64_t)r.v[1] >> 11);  // 53 bits
  return (double)(bits & ((1ull << 53) - 1)) * (1.0 / 9007199254740992.0);
}

namespace {

model::ModelOptions model_options(const model::ModelConfig& config, const SamplerOptions& o, int max_len) {
  model::ModelOptions m;
  m.device = o.device;
  m.cpu_dtype = o.cpu_dtype;
  m.max_batch = 1;  // the training forward is not used; the KV caches size their own arenas
  m.max_seq = max_len;
  m.stream = o.stream;
  m.cpu_bf16_rounding = o.cpu_bf16_rounding;
  (void)config;
  return m;
}

// Whether the rl_sampler stage quantizes any operand of any linear layer.
bool sampler_quantizes(const model::ModelConfig& c, const recipe::ResolvedRecipe& r) {
  const recipe::ModelShape shape = c.recipe_shape();
  for (int b = 0; b <= c.n_layers; ++b) {
    for (recipe::LinearKind k : recipe::kLinearKinds) {
      const bool head = k == recipe::LinearKind::kLmHead;
      if (head != (b == c.n_layers)) continue;
      if (!head && !shape.has(b, k)) continue;
      const gemm::LinearRecipe lr = r.linear(recipe::Stage::kRlSampler, head ? 0 : b, k);
      if (lr.fprop_x.quant || lr.fprop_w.quant) return true;
    }
  }
  return false;
}

// Row `row` of the logits [rows, V] as doubles.
void logits_row(const TensorView& host, int64_t row, std::vector<double>& out) {
  const int64_t V = host.shape[1];
  out.resize((size_t)V);
  if (host.dtype == DType::kF64) {
    const double* p = host.ptr<const double>() + row * V;
    std::copy(p, p + V, out.begin());
  } else {
    FOURBIT_CHECK(host.dtype == DType::kF32, "sampler: logits must be f32 or f64, got {}", host.describe());
    const float* p = host.ptr<const float>() + row * V;
    for (int64_t v = 0; v < V; ++v) out[(size_t)v] = p[v];
  }
}

}  // namespace

Sampler::Sampler(model::ModelConfig config, recipe::ResolvedRecipe recipe, const SamplerOptions& options)
    : options_(options) {
  FOURBIT_CHECK(options.max_batch >= 1, "Sampler: max_batch must be >= 1, got {}", options.max_batch);
  max_len_ = options.max_len > 0 ? options.max_len : config.max_seq;
  FOURBIT_CHECK(max_len_ >= 2 && max_len_ <= config.max_seq,
                "Sampler: max_len {} must lie in [2, config.max_seq = {}]", max_len_, config.max_seq);
  if (options.device == Device::kCuda && sampler_quantizes(config, recipe)) row_tile_ = 128;
  const model::ModelOptions mo = model_options(config, options, max_len_);
  model_ = std::make_unique<model::Model>(std::move(config), std::move(recipe), mo);
}

int Sampler::cache_batch(int batch) const { return (batch + row_tile_ - 1) / row_tile_ * row_tile_; }

void Sampler::refresh(const model::Model& trainer) {
  const model::ParamBuffer& src = trainer.params();
  const model::ParamBuffer& dst = model_->params();
  FOURBIT_CHECK(trainer.config().name == model_->config().name && src.size() == dst.size() &&
                    src.flat().numel() == dst.flat().numel(),
                "Sampler::refresh: the trainer's model '{}' ({} tensors, {} elements) does not match "
                "the sampler's '{}' ({} tensors, {} elements)", trainer.config().name, src.size(),
                src.flat().numel(), model_->config().name, dst.size(), dst.flat().numel());
  FOURBIT_CHECK(src.dtype() == dst.dtype(),
                "Sampler::refresh: the trainer's master weights are {} and the sampler's {}; make both "
                "models with the same device and cpu_dtype", dtype_name(src.dtype()), dtype_name(dst.dtype()));
  copy_tensor(dst.flat(), src.flat());
  model_->params_changed();
}

std::vector<Rollout> Sampler::generate(std::span<const std::vector<int32_t>> prompts,
                                       const SamplingOptions& so, uint64_t call) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  const model::ModelConfig& c = model_->config();
  so.validate(c.vocab);
  const int B = (int)prompts.size();
  FOURBIT_CHECK(B >= 1 && B <= options_.max_batch, "Sampler::generate: {} prompts; between 1 and max_batch "
                "= {} allowed (SamplerOptions::max_batch)", B, options_.max_batch);
  int longest = 0;
  int64_t prompt_tokens = 0;
  for (int b = 0; b < B; ++b) {
    const int n = (int)prompts[(size_t)b].size();
    FOURBIT_CHECK(n >= 1 && n <= max_len_ - 1, "Sampler::generate: prompt {} has {} tokens; it needs 1 to "
                  "max_len - 1 = {}", b, n, max_len_ - 1);
    for (int32_t id : prompts[(size_t)b])
      FOURBIT_CHECK(id >= 0 && id < c.vocab, "Sampler::generate: prompt {} holds token {} outside [0, {})",
                    b, id, c.vocab);
    longest = std::max(longest, n);
    prompt_tokens += n;
  }
  const int Bc = cache_batch(B);
  if (!cache_ || cache_->batch() != Bc || cache_->max_step_tokens() < longest) {
    cache_.reset();
    cache_.emplace(model_->make_kv_cache(Bc, max_len_, std::max(longest, std::min(max_len_, 64))));
  }
  model::KvCache& cache = *cache_;
  cache.reset();

  const int n_moe = c.n_moe_layers();
  const int k = c.is_moe() ? c.moe.top_k : 0;
  const int64_t route_row = (int64_t)n_moe * k;
  std::vector<Rollout> out((size_t)B);
  for (int b = 0; b < B; ++b) {
    out[(size_t)b].tokens.reserve((size_t)so.max_new_tokens);
    if (c.is_moe()) out[(size_t)b].expert_ids.reserve((size_t)((prompts[(size_t)b].size() + so.max_new_tokens) * route_row));
  }

  // Prefill: prompts right-aligned in [Bc, longest]; idle sequences (padding) get no rows.
  const int Tq = longest;
  std::vector<int32_t> tokens((size_t)Bc * Tq, 0), n_new((size_t)Bc, 0);
  for (int b = 0; b < B; ++b) {
    const std::vector<int32_t>& p = prompts[(size_t)b];
    std::copy(p.begin(), p.end(), tokens.begin() + (ptrdiff_t)((size_t)b * Tq + (Tq - p.size())));
    n_new[(size_t)b] = (int32_t)p.size();
  }
  std::vector<int32_t> routes;
  model::CachedForwardOptions fo;
  fo.stage = recipe::Stage::kRlSampler;
  std::vector<bool> active((size_t)B, true);
  std::vector<double> row;
  TokenDistribution dist;
  int64_t generated = 0;
  int steps = 0;
  auto sample_all = [&](const TensorView& host_logits) {
    int n_active = 0;
    for (int b = 0; b < B; ++b) {
      if (!active[(size_t)b]) continue;
      Rollout& r = out[(size_t)b];
      logits_row(host_logits, b, row);
      sampling_distribution(row, so, dist);
      const size_t i = sample_index(dist, sampler_uniform(so.seed, call, (uint64_t)b, r.tokens.size()));
      const int32_t tok = dist.ids[i];
      r.tokens.push_back(tok);
      r.logprobs.push_back((float)dist.logprobs[i]);
      r.entropies.push_back((float)dist.entropy);
      ++generated;
      const bool stop = std::find(so.stop_tokens.begin(), so.stop_tokens.end(), tok) != so.stop_tokens.end();
      const int len = cache.lengths()[(size_t)b];  // positions fed so far
      if (stop) r.stopped = true;
      // Continuing feeds this token at position len: it needs len + 1 <= max_len.
      if (stop || (int)r.tokens.size() >= so.max_new_tokens || len + 1 > max_len_) {
        active[(size_t)b] = false;
      } else {
        ++n_active;
      }
    }
    return n_active;
  };
  // Runs one forward and samples every active sequence; returns how many are still active.
  auto forward_and_sample = [&](int tq) {
    TensorView tv = TensorView::contiguous(tokens.data(), DType::kI32, Shape{Bc, tq}, Device::kCpu);
    if (c.is_moe()) {
      routes.assign((size_t)((int64_t)Bc * tq * route_row), 0);
      fo.expert_ids_out = TensorView::contiguous(routes.data(), DType::kI32, Shape{(int64_t)Bc * tq, n_moe, k},
                                                 Device::kCpu);
    }
    const TensorView logits = model_->forward_cached(cache, tv, n_new, fo);
    if (c.is_moe()) {
      for (int b = 0; b < B; ++b) {
        for (int t = tq - n_new[(size_t)b]; t < tq; ++t) {
          const int32_t* r = routes.data() + ((int64_t)b * tq + t) * route_row;
          out[(size_t)b].expert_ids.insert(out[(size_t)b].expert_ids.end(), r, r + route_row);
        }
      }
    }
    ++steps;
    if (logits.device == Device::kCpu) return sample_all(logits);
    Tensor host = Tensor::empty(logits.shape, logits.dtype, Device::kCpu);
    copy_tensor(host.view(), logits);
    return sample_all(host.view());
  };

  int n_active = forward_and_sample(Tq);
  while (n_active > 0) {
    tokens.assign((size_t)Bc, 0);
    std::fill(n_new.begin(), n_new.end(), 0);
    for (int b = 0; b < B; ++b) {
      if (!active[(size_t)b]) continue;
      tokens[(size_t)b] = out[(size_t)b].tokens.back();
      n_new[(size_t)b] = 1;
    }
    n_active = forward_and_sample(1);
  }

  stats_.sequences = B;
  stats_.prompt_tokens = prompt_tokens;
  stats_.generated_tokens = generated;
  stats_.decode_steps = steps - 1;
  stats_.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return out;
}

}  // namespace fourbit::rl
