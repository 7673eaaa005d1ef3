// Implementation of bench.h: CUDA-event profiling of a training step (model/profile.h) and the
// replay of its operand quantizations.
#include "model/bench.h"

#include "core/check.h"
#include "core/device.h"
#include "model/model.h"

#if defined(FOURBIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <vector>

namespace fourbit::model {

#if defined(FOURBIT_WITH_CUDA)
namespace {

struct BenchShape {
  const char* preset;
  int batch, seq;
};
constexpr BenchShape kShapes[] = {{"gpt2-124m", 8, 1024}, {"gpt2-124m-moe8", 8, 1024}, {"1.3b", 4, 2048}};
constexpr const char* kRecipes[] = {"bf16", "fp8", "nvfp4", "e2e4"};

// Records a pair of CUDA events around every bracket of the model; the times are read after the
// step (one synchronization).
class EventProfiler : public Profiler {
 public:
  struct Call {
    LinearCall call;
    gemm::LinearRecipe recipe;
  };
  ~EventProfiler() override {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  void start() {
    used_ = 0;
    spans_.clear();
    calls.clear();
  }
  void begin(Section s, Work w) override {
    open_ = {s, w};
    record();
  }
  void end() override {
    record();
    spans_.push_back({open_.first, open_.second, used_ - 2});
  }
  void linear_call(const LinearCall& c) override { calls.push_back({c, *c.recipe}); }
  // ms per (section, work); waits for the events.
  std::array<std::array<double, kNumWorks>, kNumSections> totals() {
    std::array<std::array<double, kNumWorks>, kNumSections> t{};
    if (used_ > 0) FOURBIT_CUDA_CHECK(cudaEventSynchronize(events_[used_ - 1]));
    for (const Span& s : spans_) {
      float ms = 0;
      FOURBIT_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[s.first_event], events_[s.first_event + 1]));
      t[(size_t)s.section][(size_t)s.work] += ms;
    }
    return t;
  }
  std::vector<Call> calls;

 private:
  struct Span {
    Section section;
    Work work;
    size_t first_event;
  };
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
  std::pair<Section, Work> open_{};
  std::vector<Span> spans_;
};

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
  void start() { FOURBIT_CUDA_CHECK(cudaEventRecord(a_, nullptr)); }
  double stop_ms() {
    FOURBIT_CUDA_CHECK(cudaEventRecord(b_, nullptr));
    FOURBIT_CUDA_CHECK(cudaEventSynchronize(b_));
    float ms = 0;
    FOURBIT_CUDA_CHECK(cudaEventElapsedTime(&ms, a_, b_));
    return ms;
  }

 private:
  cudaEvent_t a_, b_;
};

// One quantization pass of a linear call, as gemm/linear.cpp (and model/expert_linear.cpp) run it:
// one or both orientations of one source; each written as the scaled-domain BF16 copy (the NVFP4 /
// MXFP8 GEMM operands) or packed (FP8, and X's copies kept for the Wgrad).
struct QuantOp {
  quant::QuantConfig config;
  int64_t rows, cols;
  bool rowwise, colwise;
  bool row_packed = false, col_packed = false;  // emulated formats: packed instead of BF16
  bool amax_given = false;  // the amaxes come from the producer (LinearCall::source_amax_given)
  quant::Orientations orientations() const { return {rowwise, colwise}; }
};

std::vector<QuantOp> quant_ops(const EventProfiler::Call& c) {
  std::vector<QuantOp> ops;
  const gemm::LinearRecipe& r = c.recipe;
  const LinearCall& l = c.call;
  auto add = [&](const gemm::OperandRecipe& o, int64_t rows, int64_t cols, bool colwise, int times,
                 bool packed = false) {
    if (!o.quant) return;
    for (int i = 0; i < times; ++i) ops.push_back({*o.quant, rows, cols, !colwise, colwise, false, packed});
  };
  switch (l.gemm) {
    case recipe::Gemm::kFprop:
      if (l.fprop_saves_x && gemm::fprop_and_wgrad_x_share_a_pass(r)) {
        ops.push_back({*r.wgrad_x.quant, l.m, l.k, true, true, false, true, l.source_amax_given});  // X: both, col packed
      } else {
        add(r.fprop_x, l.m, l.k, false, 1);
        if (l.fprop_saves_x) add(r.wgrad_x, l.m, l.k, true, 1, true);
      }
      add(r.fprop_w, l.n, l.k, false, l.groups);
      break;
    case recipe::Gemm::kDgrad:
      if (l.dy_one_pass) {
        ops.push_back({*r.wgrad_dy.quant, l.m, l.n, true, true, false, false, l.source_amax_given});  // dY: both copies, BF16
      } else {
        add(r.dgrad_dy, l.m, l.n, false, 1);
      }
      add(r.dgrad_w, l.n, l.k, true, l.groups);
      break;
    case recipe::Gemm::kWgrad:
      if (!l.dy_one_pass) add(r.wgrad_dy, l.m, l.n, true, 1);
      if (!l.wgrad_saved_x) add(r.wgrad_x, l.m, l.k, true, 1);  // a kept copy: converted in the GEMM
      break;
  }
  return ops;
}

// Times one quantization pass like gemm/linear.cpp: allocate, quantize (the scaled-domain BF16
// copies the emulated GEMMs read, packed data where the op says so), free. Median of 3. With
// op.amax_given the amaxes are computed beforehand, outside the timing (the producer did it).
double time_quant(const QuantOp& op, const Tensor& source, int* flag, Timer& timer) {
  TensorView src = TensorView::contiguous(source.data(), DType::kBF16, {op.rows, op.cols}, Device::kCuda);
  Tensor given;
  if (op.amax_given) {
    given = Tensor::zeros({2}, DType::kF32, Device::kCuda);
    quant::amax_cuda(src, given.ptr<float>(), given.ptr<float>() + 1, op.config.rht,
                     op.config.rht_sign_mask(), flag, nullptr);
  }
  std::vector<double> ms;
  for (int rep = 0; rep < 3; ++rep) {
    timer.start();
    {
      quant::QuantizedTensor q =
          quant::allocate_quantized(op.config, op.rows, op.cols, op.orientations(), Device::kCuda);
      quant::CudaQuantizeOptions qo;
      qo.tensor_name = "bench";
      qo.nonfinite_flag = flag;
      if (op.amax_given) {
        qo.given_rowwise_amax = given.ptr<float>();
        qo.given_colwise_amax = given.ptr<float>() + 1;  // read with RHT only
      }
      const bool emulated = op.config.format == quant::Format::kNvfp4 || op.config.format == quant::Format::kMxfp8;
      Tensor row_bf16, col_bf16;
      TensorView row_view, col_view;
      if (emulated) {
        qo.write_bf16_scaled = true;
        if (op.rowwise && !op.row_packed) {
          row_bf16 = Tensor::empty({op.rows, op.cols}, DType::kBF16, Device::kCuda);
          row_view = row_bf16.view();
          q.rowwise->data = Tensor();
          q.rowwise->scales = Tensor();
        }
        if (op.colwise && !op.col_packed) {
          col_bf16 = Tensor::empty({op.cols, op.rows}, DType::kBF16, Device::kCuda);
          col_view = col_bf16.view();
          q.colwise->data = Tensor();
          q.colwise->scales = Tensor();
        }
        qo.write_bf16_scaled = row_bf16.defined() || col_bf16.defined();
      }
      quant::quantize_cuda(src, q, qo, row_bf16.defined() ? &row_view : nullptr,
                           col_bf16.defined() ? &col_view : nullptr);
    }
    ms.push_back(timer.stop_ms());
  }
  std::sort(ms.begin(), ms.end());
  return ms[1];
}

void print_row(const ModelBenchRow& r) {
  const double total = std::max(r.ms, 1e-9);
  const std::string tps = r.tokens_per_s > 0 ? fmt::format("{:.0f}", r.tokens_per_s) : "";
  std::printf("%-30s %-6s %-13s %6d %10.3f %10.3f %6.1f%% %6.1f%% %6.1f%% %6.1f%% %11s\n", r.shape.c_str(),
              r.recipe.c_str(), r.section.c_str(), r.layers, r.ms_per_layer, r.ms, 100 * r.gemm_ms / total,
              100 * r.attention_ms / total, 100 * r.quant_ms / total, 100 * r.other_ms / total, tps.c_str());
}

}  // namespace

std::vector<ModelBenchRow> run_model_bench(const ModelBenchOptions& o) {
  FOURBIT_CHECK(o.reps >= 1, "bench model: --reps must be >= 1, got {}", o.reps);
  std::vector<ModelBenchRow> rows;
  Timer timer;
  Tensor flag = Tensor::zeros({1}, DType::kI32, Device::kCuda);
  std::printf("%-30s %-6s %-13s %6s %10s %10s %7s %7s %7s %7s %11s\n", "shape", "recipe", "section",
              "layers", "ms/layer", "ms", "gemm%", "attn%", "quant%", "rest%", "tokens/s");
  for (const BenchShape& shape : kShapes) {
    if (!o.shape_filter.empty() && std::string(shape.preset).find(o.shape_filter) == std::string::npos) continue;
    const ModelConfig config = preset(shape.preset);
    const std::string shape_name = fmt::format("{} (B {}, T {})", shape.preset, shape.batch, shape.seq);
    std::unique_ptr<Model> model;
    // A seeded batch (the values do not matter for the time; routing does, mildly).
    Tensor tokens = Tensor::empty({shape.batch, shape.seq}, DType::kI32, Device::kCpu);
    Tensor targets = Tensor::empty({shape.batch, shape.seq}, DType::kI32, Device::kCpu);
    for (int64_t i = 0; i < tokens.numel(); ++i) {
      tokens.ptr<int32_t>()[i] = (int32_t)((i * 2654435761u) % (uint64_t)config.vocab);
      targets.ptr<int32_t>()[i] = (int32_t)((i * 40503u + 17) % (uint64_t)config.vocab);
    }
    for (const char* recipe_name : kRecipes) {
      if (!o.recipe_filter.empty() && std::string(recipe_name).find(o.recipe_filter) == std::string::npos) continue;
      recipe::ResolvedRecipe resolved = recipe::resolve(recipe::preset(recipe_name), config.recipe_shape());
      if (!model) {
        ModelOptions mo;
        mo.device = Device::kCuda;
        mo.max_batch = shape.batch;
        mo.max_seq = shape.seq;
        model = std::make_unique<Model>(config, std::move(resolved), mo);
      } else {
        model->set_recipe(std::move(resolved));
      }
      Model& m = *model;
      auto step = [&](uint64_t i) {
        ForwardOptions fo;
        fo.step = i;
        fo.loss_gradient_scale = 1.0;  // as the trainer: the loss gradient in the forward
        m.zero_grads();
        m.forward(tokens, targets, fo);
        m.backward();
      };
      step(0);  // warm-up (cuBLASLt heuristics, allocations)
      std::vector<double> step_ms;
      for (int r = 0; r < o.reps; ++r) {
        timer.start();
        step((uint64_t)r + 1);
        step_ms.push_back(timer.stop_ms());
      }
      std::sort(step_ms.begin(), step_ms.end());
      const double median_ms = step_ms[step_ms.size() / 2];
      // The profiled step.
      EventProfiler prof;
      prof.start();
      m.set_profiler(&prof);
      timer.start();
      step(100);
      const double profiled_ms = timer.stop_ms();
      m.set_profiler(nullptr);
      const auto t = prof.totals();
      // Quantization replay per section.
      std::array<double, kNumSections> quant_ms{};
      {
        int64_t max_elems = 0;
        for (const auto& c : prof.calls)
          for (const QuantOp& q : quant_ops(c)) max_elems = std::max(max_elems, q.rows * q.cols);
        if (max_elems > 0) {
          Tensor source = Tensor::empty({max_elems}, DType::kBF16, Device::kCuda);
          quant::fill_normal_cuda(source.view(), 7, nullptr);
          std::map<std::string, double> cache;
          for (const auto& c : prof.calls) {
            for (const QuantOp& q : quant_ops(c)) {
              const std::string key = fmt::format("{} {}x{} {}", q.config.describe(), q.rows, q.cols, q.colwise);
              auto it = cache.find(key);
              if (it == cache.end()) it = cache.emplace(key, time_quant(q, source, flag.ptr<int>(), timer)).first;
              quant_ms[(size_t)c.call.section] += it->second;
            }
          }
        }
      }
      int n_dense = 0, n_moe = 0;
      for (int l = 0; l < config.n_layers; ++l) (config.is_moe_block(l) ? n_moe : n_dense) += 1;
      double bracketed = 0;
      const size_t first_row = rows.size();
      ModelBenchRow step_row;
      step_row.shape = shape_name;
      step_row.recipe = recipe_name;
      step_row.section = "step";
      step_row.layers = 1;
      for (int s = 0; s < kNumSections; ++s) {
        const Section sec = (Section)s;
        const int layers = sec == Section::kAttention ? config.n_layers
                           : sec == Section::kMlp     ? n_dense
                           : sec == Section::kMoe     ? n_moe
                                                      : 1;
        if (layers == 0) continue;
        ModelBenchRow r;
        r.shape = shape_name;
        r.recipe = recipe_name;
        r.section = std::string(section_name(sec));
        r.layers = layers;
        const double linear = t[(size_t)s][(size_t)Work::kLinear];
        r.quant_ms = std::min(quant_ms[(size_t)s], linear);
        r.gemm_ms = linear - r.quant_ms;
        r.attention_ms = t[(size_t)s][(size_t)Work::kAttention];
        r.other_ms = t[(size_t)s][(size_t)Work::kOther];
        r.ms = linear + r.attention_ms + r.other_ms;
        r.ms_per_layer = r.ms / layers;
        bracketed += r.ms;
        step_row.gemm_ms += r.gemm_ms;
        step_row.quant_ms += r.quant_ms;
        step_row.attention_ms += r.attention_ms;
        step_row.other_ms += r.other_ms;
        rows.push_back(r);
      }
      step_row.other_ms += std::max(0.0, profiled_ms - bracketed);  // host gaps between brackets
      step_row.ms = step_row.ms_per_layer = profiled_ms;
      step_row.tokens_per_s = (double)shape.batch * shape.seq / (median_ms * 1e-3);
      rows.push_back(step_row);
      for (size_t i = first_row; i < rows.size(); ++i) print_row(rows[i]);
      std::printf("%-30s %-6s unprofiled step %.3f ms (median of %d), profiled %.3f ms; activations %.2f GiB\n",
                  shape_name.c_str(), recipe_name, median_ms, o.reps, profiled_ms,
                  (double)m.activation_bytes() / (1 << 30));
      std::fflush(stdout);
    }
  }
  if (!o.csv_path.empty()) {
    std::ofstream f(o.csv_path);
    FOURBIT_CHECK(f.good(), "bench model: cannot write '{}'", o.csv_path);
    f << "shape,recipe,section,layers,ms_per_layer,ms,gemm_ms,attention_ms,quant_ms,rest_ms,tokens_per_s\n";
    for (const ModelBenchRow& r : rows) {
      f << fmt::format("\"{}\",{},{},{},{:.4f},{:.4f},{:.4f},{:.4f},{:.4f},{:.4f},{:.0f}\n", r.shape, r.recipe,
                       r.section, r.layers, r.ms_per_layer, r.ms, r.gemm_ms, r.attention_ms, r.quant_ms,
                       r.other_ms, r.tokens_per_s);
    }
  }
  return rows;
}

#else

std::vector<ModelBenchRow> run_model_bench(const ModelBenchOptions&) {
  throw Error("bench model needs a CUDA build and a GPU; rebuild with nvcc available (-DFOURBIT_CUDA=ON)");
}

#endif

}  // namespace fourbit::model
