// Implementation of decode_bench.h: decode steps of a Llama-shaped model per rl_sampler weight
// format, and the decode GEMV alone at its layer shapes, against the measured copy bandwidth.
#include "model/decode_bench.h"

#include "core/check.h"
#include "core/device.h"
#include "gemm/decode_gemv.h"
#include "gemm/gemm.h"
#include "model/model.h"
#include "ops/rope.h"
#include "quant/quantize.h"
#include "recipe/recipe.h"

#if defined(FOURBIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <vector>

namespace fourbit::model {

#if defined(FOURBIT_WITH_CUDA)
namespace {

// The rl_sampler precisions timed: bf16, e2e4 (NVFP4 weights and activations, the RL sampler's
// default) and nvfp4-weights (NVFP4 weights, BF16 activations: "W4A16", no activation quantizer;
// BENCHMARKS.md's NVFP4-weights decode target reads it).
constexpr const char* kRecipes[] = {"bf16", "e2e4", "nvfp4-weights"};

recipe::Recipe bench_recipe(std::string_view name) {
  if (name == "nvfp4-weights") return recipe::with_sampler_precision(recipe::preset("bf16"), "nvfp4-weights");
  return recipe::preset(name);
}
constexpr int kWarmupSteps = 3;

class Timer {
 public:
  Timer() {
    FOURBIT_CUDA_CHECK(cudaEventCreate(&a_));
    FOURBIT_CUDA_CHECK(cudaEventCreate(&b_));
  }
  ~Timer() {
    cudaEventDestroy(a_);
    cudaEventDestroy(b_);
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;
  void start() { FOURBIT_CUDA_CHECK(cudaEventRecord(a_, nullptr)); }
  double stop_ms() {
    FOURBIT_CUDA_CHECK(cudaEventRecord(b_, nullptr));
    FOURBIT_CUDA_CHECK(cudaEventSynchronize(b_));
    float ms = 0;
    FOURBIT_CUDA_CHECK(cudaEventElapsedTime(&ms, a_, b_));
    return ms;
  }

 private:
  cudaEvent_t a_ = nullptr, b_ = nullptr;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Device-to-device copy bandwidth, bytes read + written (the HBM ceiling of this run), GB/s.
double measure_copy_gbps(Timer& timer) {
  const int64_t bytes = int64_t{1} << 30;
  Tensor a = Tensor::empty({bytes}, DType::kU8, Device::kCuda), b = Tensor::empty({bytes}, DType::kU8, Device::kCuda);
  FOURBIT_CUDA_CHECK(cudaMemset(a.data(), 0x5A, (size_t)bytes));
  std::vector<double> ms;
  for (int r = 0; r < 11; ++r) {
    timer.start();
    FOURBIT_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), (size_t)bytes, cudaMemcpyDeviceToDevice, nullptr));
    const double t = timer.stop_ms();
    if (r > 0) ms.push_back(t);
  }
  return 2.0 * (double)bytes / (median(ms) * 1e-3) / 1e9;
}

// CUDA events around every bracket of the model; sums per kind of work after the step.
class BusyProfiler : public Profiler {
 public:
  ~BusyProfiler() override {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  void begin(Section, Work w) override {
    work_ = w;
    record();
  }
  void end() override {
    record();
    spans_.push_back({work_, used_ - 2});
  }
  std::array<double, kNumWorks> totals() {
    std::array<double, kNumWorks> t{};
    if (used_ > 0) FOURBIT_CUDA_CHECK(cudaEventSynchronize(events_[used_ - 1]));
    for (const auto& [w, first] : spans_) {
      float ms = 0;
      FOURBIT_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[first], events_[first + 1]));
      t[(size_t)w] += ms;
    }
    return t;
  }

 private:
  void record() {
    if (used_ == events_.size()) {
      cudaEvent_t e;
      FOURBIT_CUDA_CHECK(cudaEventCreate(&e));
      events_.push_back(e);
    }
    FOURBIT_CUDA_CHECK(cudaEventRecord(events_[used_++], nullptr));
  }
  std::vector<cudaEvent_t> events_;
  size_t used_ = 0;
  Work work_ = Work::kOther;
  std::vector<std::pair<Work, size_t>> spans_;
};

struct LayerShape {
  const char* name;
  recipe::LinearKind kind;
  int64_t n, k;
  int count;  // layers of this shape in the model
};

std::vector<LayerShape> layer_shapes(const ModelConfig& c) {
  FOURBIT_CHECK(!c.is_moe(), "bench decode: model '{}' has MoE blocks; the decode benchmark takes dense models", c.name);
  const int64_t C = c.d_model, HD = (int64_t)c.n_heads * c.head_dim(), F = c.d_ff;
  return {{"qkv", recipe::LinearKind::kQkv, c.qkv_dim(), C, c.n_layers},
          {"attn_out", recipe::LinearKind::kAttnOut, C, HD, c.n_layers},
          {"mlp_up", recipe::LinearKind::kMlpUp, 2 * F, C, c.n_layers},
          {"mlp_down", recipe::LinearKind::kMlpDown, C, F, c.n_layers},
          {"lm_head", recipe::LinearKind::kLmHead, c.vocab, C, 1}};
}

double nvfp4_bytes(int64_t n, int64_t k) { return (double)n * (double)((k + 1) / 2) + (double)n * (double)((k + 15) / 16); }

// Weight bytes one decode step reads under the rl_sampler stage of `r`.
double step_weight_bytes(const ModelConfig& c, const recipe::ResolvedRecipe& r) {
  double bytes = 0;
  for (const LayerShape& s : layer_shapes(c)) {
    for (int l = 0; l < s.count; ++l) {
      const int block = s.kind == recipe::LinearKind::kLmHead ? 0 : l;
      const gemm::LinearRecipe lr = r.linear(recipe::Stage::kRlSampler, block, s.kind);
      const bool nv = lr.fprop_w.quant && lr.fprop_w.quant->format == quant::Format::kNvfp4;
      bytes += nv ? nvfp4_bytes(s.n, s.k) : 2.0 * (double)s.n * (double)s.k;
    }
  }
  return bytes;
}

void print_step_header() {
  std::printf("%-14s %-13s %5s %6s %10s %11s %10s %7s %7s %7s %8s\n", "section", "recipe", "batch", "cache",
              "ms/step", "tokens/s", "GB/s", "copy%", "busy%", "linear%", "vs bf16");
}

void print_step(const DecodeBenchRow& r, int cache) {
  const std::string ratio = r.ratio > 0 ? fmt::format("{:.2f}x", r.ratio) : "";
  std::printf("%-14s %-13s %5d %6d %10.3f %11.0f %10.1f %6.1f%% %6.1f%% %6.1f%% %8s\n", r.section.c_str(),
              r.weights.c_str(), r.batch, cache, r.ms, r.tokens_per_s, r.gb_per_s, 100 * r.frac_copy,
              100 * r.busy_frac, 100 * r.linear_frac, ratio.c_str());
}

void print_gemv_header() {
  std::printf("%-12s %-9s %-9s %5s %7s %7s %10s %10s %7s %10s\n", "section", "layer", "weights", "batch", "N", "K",
              "us", "GB/s", "copy%", "ratio");
}

void print_gemv(const DecodeBenchRow& r) {
  const std::string ratio = r.ratio > 0 ? fmt::format("{:.2f}x", r.ratio) : "";
  std::printf("%-12s %-9s %-9s %5d %7lld %7lld %10.2f %10.1f %6.1f%% %10s\n", r.section.c_str(), r.layer.c_str(),
              r.weights.c_str(), r.batch, (long long)r.n, (long long)r.k, r.ms * 1e3, r.gb_per_s,
              100 * r.frac_copy, ratio.c_str());
}

// ---- decode steps --------------------------------------------------------------------------------

void bench_steps(const DecodeBenchOptions& o, const ModelConfig& config, double copy_gbps,
                 std::vector<DecodeBenchRow>& rows) {
  std::unique_ptr<Model> model;
  print_step_header();
  for (const char* recipe_name : kRecipes) {
    if (!o.recipe_filter.empty() && std::string(recipe_name).find(o.recipe_filter) == std::string::npos) continue;
    recipe::ResolvedRecipe resolved = recipe::resolve(bench_recipe(recipe_name), config.recipe_shape());
    const double weight_bytes = step_weight_bytes(config, resolved);
    if (!model) {
      ModelOptions mo;
      mo.device = Device::kCuda;
      mo.max_batch = 1;
      mo.max_seq = 128;  // the training arena is not used here
      model = std::make_unique<Model>(config, std::move(resolved), mo);
    } else {
      model->set_recipe(std::move(resolved));
    }
    Model& m = *model;
    m.refresh_sampler_weights();
    for (int B : o.batches) {
      const int max_len = o.cache_len + kWarmupSteps + o.reps + 2;
      FOURBIT_CHECK(max_len <= config.max_seq, "bench decode: cache {} + steps exceeds max_seq {}", o.cache_len,
                    config.max_seq);
      // sampler: with sampler weights (the decode GEMV); eager: a no-op GEMM observer keeps the step
      // from being replayed as a CUDA graph.
      auto run = [&](bool sampler, bool eager, const char* section) {
        if (!sampler) m.release_sampler_weights();
        if (eager) m.set_gemm_observer([](const GemmObservation&) {});
        KvCache cache = m.make_kv_cache(B, max_len, std::max(1, o.cache_len));
        uint64_t lcg = 12345 + (uint64_t)B;
        auto next_id = [&] {
          lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
          return (int32_t)((lcg >> 33) % (uint64_t)config.vocab);
        };
        if (o.cache_len > 0) {
          Tensor prompt = Tensor::empty({B, o.cache_len}, DType::kI32, Device::kCpu);
          for (int64_t i = 0; i < prompt.numel(); ++i) prompt.ptr<int32_t>()[i] = next_id();
          const std::vector<int32_t> n_prompt((size_t)B, o.cache_len);
          m.forward_cached(cache, prompt, n_prompt);
        }
        Tensor tok = Tensor::empty({B, 1}, DType::kI32, Device::kCpu);
        const std::vector<int32_t> ones((size_t)B, 1);
        auto step = [&] {
          for (int b = 0; b < B; ++b) tok.ptr<int32_t>()[b] = next_id();
          m.forward_cached(cache, tok, ones);
        };
        for (int i = 0; i < kWarmupSteps; ++i) step();
        std::vector<double> ms;
        for (int r = 0; r < o.reps; ++r) {
          FOURBIT_CUDA_CHECK(cudaDeviceSynchronize());
          const auto t0 = std::chrono::steady_clock::now();
          step();  // forward_cached synchronizes before returning
          ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        }
        DecodeBenchRow row;
        row.section = section;
        row.weights = recipe_name;
        row.layer = config.name;
        row.batch = B;
        row.ms = median(ms);
        row.tokens_per_s = B / (row.ms * 1e-3);
        const double avg_len = o.cache_len + kWarmupSteps + o.reps / 2.0;
        const double kv_bytes = (double)config.n_layers * 2.0 * B * avg_len * config.n_kv_heads * config.head_dim() * 2.0;
        row.bytes = weight_bytes + kv_bytes;
        row.gb_per_s = row.bytes / (row.ms * 1e-3) / 1e9;
        row.frac_copy = row.gb_per_s / copy_gbps;
        // One profiled step: GPU-bracketed share and its linear part.
        BusyProfiler prof;
        m.set_profiler(&prof);
        FOURBIT_CUDA_CHECK(cudaDeviceSynchronize());
        const auto t0 = std::chrono::steady_clock::now();
        step();
        const double prof_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        m.set_profiler(nullptr);
        const std::array<double, kNumWorks> t = prof.totals();
        const double busy = t[0] + t[1] + t[2];
        row.busy_frac = busy / prof_ms;
        row.linear_frac = busy > 0 ? t[(size_t)Work::kLinear] / busy : 0;
        print_step(row, o.cache_len);
        rows.push_back(row);
        if (eager) m.set_gemm_observer(nullptr);
        if (!sampler) m.refresh_sampler_weights();
      };
      run(true, false, "step");
      run(true, true, "step-eager");
      // The emulated path accepts only multiples of its 64-token tile in quantized recipes.
      if (std::string(recipe_name) != "bf16" && B % 64 == 0) run(false, true, "step-emulated");
    }
  }
}

// ---- the GEMV alone ------------------------------------------------------------------------------

void bench_gemv(const DecodeBenchOptions& o, const ModelConfig& config, double copy_gbps,
                std::vector<DecodeBenchRow>& rows) {
  Timer timer;
  gemm::DecodeWorkspace ws;
  Tensor flag = Tensor::zeros({1}, DType::kI32, Device::kCuda);
  const double target_bytes = 256e6;  // per timing: well beyond the 60 MB L2
  const int reps = std::max(5, std::min(o.reps, 25));
  print_gemv_header();
  for (const LayerShape& s : layer_shapes(config)) {
    if (!o.layer_filter.empty() && std::string_view(s.name).find(o.layer_filter) == std::string_view::npos) continue;
    const bool f32_out = s.kind == recipe::LinearKind::kLmHead;
    // BF16 copies (also the cuBLASLt operands) and NVFP4 copies, from different random sources.
    const double bf16_bytes = 2.0 * (double)s.n * (double)s.k, nv_bytes = nvfp4_bytes(s.n, s.k) + 4;
    const int n_bf16 = (int)std::clamp(std::ceil(target_bytes / bf16_bytes), 2.0, 512.0);
    const int n_nv = (int)std::clamp(std::ceil(target_bytes / nv_bytes), 2.0, 512.0);
    std::vector<Tensor> w_bf16;
    for (int i = 0; i < n_bf16; ++i) {
      w_bf16.push_back(Tensor::empty({s.n, s.k}, DType::kBF16, Device::kCuda));
      quant::fill_normal_cuda(w_bf16.back().view(), 1000 + (uint64_t)i, nullptr);
    }
    std::vector<quant::QuantizedTensor> w_nv;
    {
      quant::QuantConfig wc;  // e2e4's sampler weight quantizer: NVFP4 1x16 RN
      wc.format = quant::Format::kNvfp4;
      Tensor src = Tensor::empty({s.n, s.k}, DType::kBF16, Device::kCuda);
      for (int i = 0; i < n_nv; ++i) {
        quant::fill_normal_cuda(src.view(), 5000 + (uint64_t)i, nullptr);
        w_nv.push_back(quant::allocate_quantized(wc, s.n, s.k, quant::Orientations{}, Device::kCuda));
        quant::CudaQuantizeOptions qo;
        qo.tensor_name = s.name;
        quant::quantize_cuda(src.view(), w_nv.back(), qo);
      }
    }
    for (int B : o.batches) {
      Tensor x = Tensor::empty({B, s.k}, DType::kBF16, Device::kCuda);
      quant::fill_normal_cuda(x.view(), 77 + (uint64_t)B, nullptr);
      Tensor xs = Tensor::empty({B, s.k}, DType::kBF16, Device::kCuda), amax = Tensor::zeros({1}, DType::kF32, Device::kCuda);
      {
        gemm::DecodeQuantizeArgs q;
        q.x = x.view();
        q.config.format = quant::Format::kNvfp4;
        q.xs = xs.view();
        q.amax = amax.ptr<float>();
        q.workspace = &ws;
        q.error_flag = flag.ptr<int>();
        q.name = "x";
        gemm::decode_quantize_nvfp4(q);
      }
      Tensor y = Tensor::empty({B, s.n}, f32_out ? DType::kF32 : DType::kBF16, Device::kCuda);
      const double io_bytes = 2.0 * B * (double)s.k + (f32_out ? 4.0 : 2.0) * B * (double)s.n;
      auto time_it = [&](int copies, const std::function<void(int)>& launch) {
        for (int i = 0; i < copies; ++i) launch(i);  // warm-up (and workspace growth)
        std::vector<double> ms;
        for (int r = 0; r < reps; ++r) {
          timer.start();
          for (int i = 0; i < copies; ++i) launch(i);
          ms.push_back(timer.stop_ms() / copies);
        }
        return median(ms);
      };
      auto add_row = [&](const char* section, const char* weights, double ms, double wbytes) {
        DecodeBenchRow row;
        row.section = section;
        row.weights = weights;
        row.layer = s.name;
        row.batch = B;
        row.n = s.n;
        row.k = s.k;
        row.ms = ms;
        row.bytes = wbytes + io_bytes;
        row.gb_per_s = row.bytes / (ms * 1e-3) / 1e9;
        row.frac_copy = row.gb_per_s / copy_gbps;
        rows.push_back(row);
        return rows.size() - 1;
      };
      // The GEMV over the BF16 copies, or over the NVFP4 copies with x_in: NVFP4 scaled-domain
      // activations (x_amax set) or plain BF16 (null); `output` sets where the result goes.
      using Output = std::function<void(gemm::DecodeGemvArgs&)>;
      auto time_bf16 = [&](const Output& output) {
        return time_it(n_bf16, [&](int i) {
          gemm::DecodeGemvArgs a;
          a.x = x.view();
          a.w = gemm::DecodeWeights::plain(w_bf16[(size_t)i].view(), s.name);
          a.workspace = &ws;
          output(a);
          gemm::decode_gemv(a);
        });
      };
      auto time_nvfp4 = [&](const TensorView& x_in, const float* x_amax, const Output& output) {
        return time_it(n_nv, [&](int i) {
          gemm::DecodeGemvArgs a;
          a.x = x_in;
          a.x_nvfp4_amax = x_amax;
          a.w = gemm::DecodeWeights::packed(w_nv[(size_t)i], s.name);
          a.workspace = &ws;
          output(a);
          gemm::decode_gemv(a);
        });
      };
      const Output plain = [&](gemm::DecodeGemvArgs& a) { a.y = y.view(); };
      const double ms_bf16 = time_bf16(plain);
      const double ms_nv = time_nvfp4(xs.view(), amax.ptr<const float>(), plain);
      const double ms_w4a16 = time_nvfp4(x.view(), nullptr, plain);
      const double ms_cublas = time_it(n_bf16, [&](int i) {
        gemm::GemmArgs g;
        g.a = gemm::Operand::dense(x.view(), "x");
        g.b = gemm::Operand::dense(w_bf16[(size_t)i].view(), s.name);
        g.c = y.view();
        g.backend = gemm::Backend::kCublasBf16;
        g.name = "bench decode cublas";
        gemm::gemm(g);
      });
      const size_t i_cublas = add_row("gemv-cublas", "bf16", ms_cublas, bf16_bytes);
      const size_t i_bf16 = add_row("gemv", "bf16", ms_bf16, bf16_bytes);
      const size_t i_nv = add_row("gemv", "nvfp4", ms_nv, nv_bytes);
      const size_t i_w4a16 = add_row("gemv", "nvfp4-a16", ms_w4a16, nv_bytes);
      rows[i_bf16].ratio = ms_cublas / ms_bf16;
      rows[i_nv].ratio = ms_cublas / ms_nv;
      rows[i_w4a16].ratio = ms_cublas / ms_w4a16;
      for (size_t i : {i_cublas, i_bf16, i_nv, i_w4a16}) print_gemv(rows[i]);
      // The pair launches (gemm::DecodeGemvArgs::swiglu / rope) of mlp_up and qkv, against the rows
      // above: the same weights and plan, the epilogue's outputs instead of y.
      const bool swiglu_layer = s.kind == recipe::LinearKind::kMlpUp && gemm::decode_gemv_swiglu_supported(B, s.n);
      const bool rope_layer = s.kind == recipe::LinearKind::kQkv && gemm::decode_gemv_rope_supported(B, config.head_dim());
      if (swiglu_layer || rope_layer) {
        Tensor act, positions, cos_sin, k_cache, v_cache;  // the SwiGLU's output; RoPE's inputs and caches
        gemm::DecodeRope rope;
        if (swiglu_layer) act = Tensor::empty({B, s.n / 2}, DType::kBF16, Device::kCuda);
        if (rope_layer) {
          const int64_t D = config.head_dim(), Hkv = config.n_kv_heads;
          positions = Tensor::zeros({B}, DType::kI32, Device::kCuda);
          cos_sin = Tensor::empty({B, D / 2, 2}, DType::kF32, Device::kCuda);
          k_cache = Tensor::empty({B, 1, Hkv, D}, DType::kBF16, Device::kCuda);
          v_cache = Tensor::empty({B, 1, Hkv, D}, DType::kBF16, Device::kCuda);
          ops::rope_cos_sin_table(cos_sin.view(), positions.view(), (float)config.rope_theta, D, nullptr);
          rope.q_heads = config.n_heads;
          rope.kv_heads = Hkv;
          rope.head_dim = D;
          rope.cos_sin = cos_sin.view();
          rope.k_cache = k_cache.view();
          rope.v_cache = v_cache.view();
          rope.write_pos = positions.view();
        }
        const Output pair = [&](gemm::DecodeGemvArgs& a) {
          a.y = swiglu_layer ? act.view() : y.view();
          a.swiglu = swiglu_layer;
          a.rope = rope_layer ? &rope : nullptr;
        };
        const double pb_bf16 = time_bf16(pair);
        const double pb_nv = time_nvfp4(xs.view(), amax.ptr<const float>(), pair);
        const double pb_w4a16 = time_nvfp4(x.view(), nullptr, pair);
        const char* section = swiglu_layer ? "gemv-swiglu" : "gemv-rope";
        const size_t j_bf16 = add_row(section, "bf16", pb_bf16, bf16_bytes);
        const size_t j_nv = add_row(section, "nvfp4", pb_nv, nv_bytes);
        const size_t j_w4a16 = add_row(section, "nvfp4-a16", pb_w4a16, nv_bytes);
        rows[j_bf16].ratio = ms_cublas / pb_bf16;
        rows[j_nv].ratio = ms_cublas / pb_nv;
        rows[j_w4a16].ratio = ms_cublas / pb_w4a16;
        for (size_t i : {j_bf16, j_nv, j_w4a16}) print_gemv(rows[i]);
      }
    }
  }
  int bits = 0;
  FOURBIT_CUDA_CHECK(cudaMemcpy(&bits, flag.data(), 4, cudaMemcpyDeviceToHost));
  FOURBIT_CHECK(bits == 0, "bench decode: the activation quantizer flagged non-finite inputs ({})", bits);
}

}  // namespace

std::vector<DecodeBenchRow> run_decode_bench(const DecodeBenchOptions& o) {
  FOURBIT_CHECK(o.reps >= 1, "bench decode: --reps must be >= 1, got {}", o.reps);
  FOURBIT_CHECK(o.cache_len >= 0, "bench decode: --cache must be >= 0, got {}", o.cache_len);
  FOURBIT_CHECK(!o.batches.empty(), "bench decode: --batches is empty");
  for (int B : o.batches) {
    FOURBIT_CHECK(B >= 1 && B <= gemm::kDecodeMaxTokens, "bench decode: batch {} must lie in [1, {}]", B,
                  gemm::kDecodeMaxTokens);
  }
  const ModelConfig config = preset(o.preset);
  Timer timer;
  const double copy_gbps = measure_copy_gbps(timer);
  std::printf("device-to-device copy: %.1f GB/s (bytes read + written); model %s\n", copy_gbps, config.name.c_str());
  std::vector<DecodeBenchRow> rows;
  if (o.steps) bench_steps(o, config, copy_gbps, rows);
  if (o.gemv) bench_gemv(o, config, copy_gbps, rows);

  // Step ratios nvfp4 (e2e4) over bf16 at the same batch, and the BENCHMARKS.md targets.
  std::map<int, double> bf16_tps;
  for (const DecodeBenchRow& r : rows)
    if (r.section == "step" && r.weights == std::string("bf16")) bf16_tps[r.batch] = r.tokens_per_s;
  for (DecodeBenchRow& r : rows) {
    if (r.section.rfind("step", 0) == 0 && r.weights != std::string("bf16") && bf16_tps.count(r.batch)) {
      r.ratio = r.tokens_per_s / bf16_tps[r.batch];
    }
  }
  if (o.steps) {
    std::printf("\ntargets (BENCHMARKS.md):\n");
    for (const DecodeBenchRow& r : rows) {
      if (r.section != "step") continue;
      if (r.weights == std::string("bf16") && r.batch == 1) {
        std::printf("  bf16 batch 1: %.1f%% of the copy bandwidth (target >= 70%%)\n", 100 * r.frac_copy);
      }
      if (r.weights != std::string("bf16") && r.batch <= 8 && r.ratio > 0) {
        std::printf("  %s batch %d: %.2fx our bf16 tokens/s (target >= 2.5x)\n", r.weights.c_str(), r.batch, r.ratio);
      }
      if (r.weights != std::string("bf16") && r.batch == 16) {
        std::printf("  %s batch 16: %.0f tokens/s = %.2fx Hugging Face's 4431 (target >= 5x)\n", r.weights.c_str(),
                    r.tokens_per_s, r.tokens_per_s / 4431.0);
      }
    }
  }
  if (!o.csv_path.empty()) {
    std::ofstream f(o.csv_path);
    FOURBIT_CHECK(f.good(), "bench decode: cannot write '{}'", o.csv_path);
    f << "section,weights,layer,batch,n,k,ms,tokens_per_s,bytes,gb_per_s,frac_copy,busy_frac,linear_frac,ratio\n";
    for (const DecodeBenchRow& r : rows) {
      f << fmt::format("{},{},{},{},{},{},{:.6f},{:.1f},{:.0f},{:.2f},{:.4f},{:.4f},{:.4f},{:.4f}\n", r.section,
                       r.weights, r.layer, r.batch, r.n, r.k, r.ms, r.tokens_per_s, r.bytes, r.gb_per_s, r.frac_copy,
                       r.busy_frac, r.linear_frac, r.ratio);
    }
  }
  return rows;
}

#else

std::vector<DecodeBenchRow> run_decode_bench(const DecodeBenchOptions&) {
  throw Error("bench decode needs a CUDA build (configure with FOURBIT_CUDA=ON) and a GPU");
}

#endif

}  // namespace fourbit::model
