// The RL sampler (sampler.h): the sampling distribution (temperature, top-k, top-p) on the host,
// Philox draws, and the prefill (one pass or chunks) + decode loop over Model::forward_cached.
#include "rl/sampler.h"

#include "core/check.h"
#include "core/log.h"
#include "core/rng.h"
#include "gemm/decode_gemv.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

#if defined(FOURBIT_WITH_CUDA)
#include "rl/sampling_kernels.h"

#include <cuda_runtime_api.h>
#endif

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

void sample_rows_cuda(const TensorView& logits, std::span<const int32_t> rows, std::span<const double> u,
                      double temperature, std::span<int32_t> tokens, std::span<float> logprobs,
                      std::span<float> entropies, void* stream) {
  FOURBIT_CHECK(logits.device == Device::kCuda && logits.dtype == DType::kF32 && logits.shape.ndim == 2 &&
                    logits.is_contiguous(),
                "sample_rows_cuda: logits must be a contiguous CUDA f32 [R, V], got {}", logits.describe());
  const size_t n = rows.size();
  FOURBIT_CHECK(u.size() == n && tokens.size() == n && logprobs.size() == n && entropies.size() == n,
                "sample_rows_cuda: rows ({}), u ({}), tokens ({}), logprobs ({}), entropies ({}) must have "
                "one entry per draw", n, u.size(), tokens.size(), logprobs.size(), entropies.size());
  FOURBIT_CHECK(std::isfinite(temperature) && temperature > 0,
                "sample_rows_cuda: temperature must be > 0 (greedy runs on the host), got {}", temperature);
  for (size_t i = 0; i < n; ++i) {
    FOURBIT_CHECK(rows[i] >= 0 && rows[i] < logits.shape[0], "sample_rows_cuda: rows[{}] = {} outside [0, {})", i,
                  rows[i], logits.shape[0]);
    FOURBIT_CHECK(u[i] >= 0 && u[i] < 1, "sample_rows_cuda: u[{}] = {} outside [0, 1)", i, u[i]);
  }
  if (n == 0) return;
#if defined(FOURBIT_WITH_CUDA)
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  // One device buffer: rows (i32) | u (f64) | tokens (i32) | logprobs (f32) | entropies (f32).
  const size_t off_u = (n * 4 + 7) / 8 * 8, off_tok = off_u + n * 8, off_lp = off_tok + n * 4,
               off_ent = off_lp + n * 4, bytes = off_ent + n * 4;
  // Kept between calls (one per host thread; a decode step must not pay a cudaMalloc/cudaFree).
  static thread_local Tensor buf;
  if (!buf.defined() || buf.nbytes() < (int64_t)bytes) buf = Tensor::empty({(int64_t)bytes}, DType::kU8, Device::kCuda);
  char* d = static_cast<char*>(buf.data());
  FOURBIT_CUDA_CHECK(cudaMemcpyAsync(d, rows.data(), n * 4, cudaMemcpyHostToDevice, st));
  FOURBIT_CUDA_CHECK(cudaMemcpyAsync(d + off_u, u.data(), n * 8, cudaMemcpyHostToDevice, st));
  kernels::SampleRowsArgs a{};
  a.logits = logits.ptr<const float>();
  a.vocab = logits.shape[1];
  a.rows = reinterpret_cast<const int32_t*>(d);
  a.u = reinterpret_cast<const double*>(d + off_u);
  a.n = (int)n;
  a.inv_temperature = 1.0 / temperature;
  a.tokens = reinterpret_cast<int32_t*>(d + off_tok);
  a.logprobs = reinterpret_cast<float*>(d + off_lp);
  a.entropies = reinterpret_cast<float*>(d + off_ent);
  kernels::launch_sample_rows(a, st);
  FOURBIT_CUDA_CHECK(cudaMemcpyAsync(tokens.data(), d + off_tok, n * 4, cudaMemcpyDeviceToHost, st));
  FOURBIT_CUDA_CHECK(cudaMemcpyAsync(logprobs.data(), d + off_lp, n * 4, cudaMemcpyDeviceToHost, st));
  FOURBIT_CUDA_CHECK(cudaMemcpyAsync(entropies.data(), d + off_ent, n * 4, cudaMemcpyDeviceToHost, st));
  FOURBIT_CUDA_CHECK(cudaStreamSynchronize(st));
#else
  (void)stream;
  throw Error("sample_rows_cuda: this build has no CUDA (configure with -DFOURBIT_CUDA=ON)");
#endif
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
  FOURBIT_CHECK(options.prefill_chunk_len >= 0, "Sampler: prefill_chunk_len must be >= 0 (0 = one pass where "
                "possible), got {}", options.prefill_chunk_len);
  if (options.device == Device::kCuda && sampler_quantizes(config, recipe)) row_tile_ = 128;
  const model::ModelOptions mo = model_options(config, options, max_len_);
  model_ = std::make_unique<model::Model>(std::move(config), std::move(recipe), mo);
  if (options.device != Device::kCuda || !options.fast_decode) return;
  // Fast decode (see the top of sampler.h): keep the sampler weights only where passes can use them.
  model_->refresh_sampler_weights();
  std::string why;
  if (!model_->sampler_weights_supported(&why)) {
    model_->release_sampler_weights();
    log_info("sampler: the decode GEMV does not implement the rl_sampler recipe '{}' ({}); generation runs the "
             "emulated path{}", model_->recipe().recipe().name, why,
             row_tile_ > 1 ? fmt::format(" with the cache batch padded to a multiple of {}", row_tile_) : "");
  } else if (model_->config().is_moe() && row_tile_ > 1) {
    model_->release_sampler_weights();
    log_info("sampler: the MoE blocks' expert GEMMs under the quantizing rl_sampler recipe '{}' take passes of "
             "whole {}-token tiles, more than the decode GEMV's {}; generation runs the emulated path",
             model_->recipe().recipe().name, row_tile_, gemm::kDecodeMaxTokens);
  }
}

int Sampler::cache_batch(int batch) const {
  if (fast_decode() && batch <= gemm::kDecodeMaxTokens) return batch;
  return (batch + row_tile_ - 1) / row_tile_ * row_tile_;
}

int Sampler::prefill_chunk(int Bc, int L) const {
  int t = options_.prefill_chunk_len > 0 ? std::min(L, options_.prefill_chunk_len) : L;
  if (Bc % row_tile_ == 0) return t;  // every width takes whole tiles (or there is no tile)
  // Here fast decode is on and Bc <= 64 (cache_batch pads otherwise): a pass must take the fast
  // path (Bc * t <= 64) unless it is the one pass over L columns and Bc * L is a whole tile.
  const int64_t n = (int64_t)Bc * L;
  if (t == L && (n <= gemm::kDecodeMaxTokens || n % row_tile_ == 0)) return L;
  return std::min(t, gemm::kDecodeMaxTokens / Bc);
}

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
  if (model_->has_sampler_weights()) model_->refresh_sampler_weights();  // else a stale copy
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
  const bool fast = fast_decode();

  const int n_moe = c.n_moe_layers();
  const int k = c.is_moe() ? c.moe.top_k : 0;
  const int64_t route_row = (int64_t)n_moe * k;
  std::vector<Rollout> out((size_t)B);
  for (int b = 0; b < B; ++b) {
    out[(size_t)b].tokens.reserve((size_t)so.max_new_tokens);
    if (c.is_moe()) out[(size_t)b].expert_ids.reserve((size_t)((prompts[(size_t)b].size() + so.max_new_tokens) * route_row));
  }

  std::vector<int32_t> tokens, n_new((size_t)Bc, 0);
  std::vector<int32_t> routes;
  model::CachedForwardOptions fo;
  fo.stage = recipe::Stage::kRlSampler;
  std::vector<bool> active((size_t)B, true);
  std::vector<double> row;
  TokenDistribution dist;
  int64_t generated = 0;
  int passes = 0, fast_passes = 0;
  // The rollout case samples on the GPU (see the top of sampler.h).
  const bool on_gpu = options_.device == Device::kCuda && so.temperature > 0 && so.top_p >= 1 &&
                      (so.top_k == 0 || so.top_k >= c.vocab);
  std::vector<int32_t> g_rows, g_tokens;
  std::vector<double> g_u;
  std::vector<float> g_lp, g_ent;
  // Samples one token for every active sequence and decides which continue; returns how many do.
  auto sample_all = [&](const TensorView& logits) {
    if (on_gpu) {
      g_rows.clear();
      g_u.clear();
      for (int b = 0; b < B; ++b) {
        if (!active[(size_t)b]) continue;
        g_rows.push_back(b);
        g_u.push_back(sampler_uniform(so.seed, call, (uint64_t)b, out[(size_t)b].tokens.size()));
      }
      g_tokens.resize(g_rows.size());
      g_lp.resize(g_rows.size());
      g_ent.resize(g_rows.size());
      sample_rows_cuda(logits, g_rows, g_u, so.temperature, g_tokens, g_lp, g_ent, options_.stream);
    }
    int n_active = 0;
    size_t gi = 0;
    for (int b = 0; b < B; ++b) {
      if (!active[(size_t)b]) continue;
      Rollout& r = out[(size_t)b];
      int32_t tok;
      if (on_gpu) {
        tok = g_tokens[gi];
        r.logprobs.push_back(g_lp[gi]);
        r.entropies.push_back(g_ent[gi]);
        ++gi;
      } else {
        logits_row(logits, b, row);
        sampling_distribution(row, so, dist);
        const size_t i = sample_index(dist, sampler_uniform(so.seed, call, (uint64_t)b, r.tokens.size()));
        tok = dist.ids[i];
        r.logprobs.push_back((float)dist.logprobs[i]);
        r.entropies.push_back((float)dist.entropy);
      }
      r.tokens.push_back(tok);
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
  // One forward of tokens [Bc, tq] with n_new; keeps the routing of the real rows (MoE).
  auto forward = [&](int tq) {
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
    ++passes;
    if (fast && (int64_t)Bc * tq <= gemm::kDecodeMaxTokens) ++fast_passes;
    return logits;
  };
  // Samples every active sequence from the logits of a pass; returns how many are still active.
  auto sample = [&](const TensorView& logits) {
    if (logits.device == Device::kCpu || on_gpu) return sample_all(logits);
    Tensor host = Tensor::empty(logits.shape, logits.dtype, Device::kCpu);
    copy_tensor(host.view(), logits);
    return sample_all(host.view());
  };

  // Prefill: the prompts right-aligned in [Bc, L] (idle sequences get no rows), in chunks of
  // columns [c0, c0 + w): the first chunk takes the remainder so that the last is whole.
  const int L = longest;
  const int chunk = prefill_chunk(Bc, L);
  const int n_chunks = (L + chunk - 1) / chunk;
  int n_active = 0;
  for (int i = 0, c0 = 0; i < n_chunks; ++i) {
    const int w = i == 0 ? L - (n_chunks - 1) * chunk : chunk;
    tokens.assign((size_t)Bc * w, 0);
    std::fill(n_new.begin(), n_new.end(), 0);
    for (int b = 0; b < B; ++b) {
      const std::vector<int32_t>& p = prompts[(size_t)b];
      const int first = L - (int)p.size();  // the column of its first token
      const int from = std::max(c0, first);  // its real columns in this chunk: [from, c0 + w)
      if (from >= c0 + w) continue;
      n_new[(size_t)b] = c0 + w - from;
      std::copy(p.begin() + (from - first), p.end() - (L - (c0 + w)),
                tokens.begin() + (ptrdiff_t)((size_t)b * w + (from - c0)));
    }
    const TensorView logits = forward(w);
    c0 += w;
    if (i == n_chunks - 1) n_active = sample(logits);
  }
  const int prefill_passes = passes;
  while (n_active > 0) {
    tokens.assign((size_t)Bc, 0);
    std::fill(n_new.begin(), n_new.end(), 0);
    for (int b = 0; b < B; ++b) {
      if (!active[(size_t)b]) continue;
      tokens[(size_t)b] = out[(size_t)b].tokens.back();
      n_new[(size_t)b] = 1;
    }
    n_active = sample(forward(1));
  }

  stats_.sequences = B;
  stats_.prompt_tokens = prompt_tokens;
  stats_.generated_tokens = generated;
  stats_.prefill_passes = prefill_passes;
  stats_.decode_steps = passes - prefill_passes;
  stats_.fast_passes = fast_passes;
  stats_.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return out;
}

}  // namespace fourbit::rl
