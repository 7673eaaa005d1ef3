// `fourbit bench gemm` (bench.h). For every shape and backend: the median over `reps` CUDA-event-
// timed runs (after warm-up) of (1) the GEMM alone over operands quantized beforehand and (2) the
// quantization of both operands from BF16 sources plus the GEMM, each as TFLOP/s (2 M N K / time)
// and as a ratio to cuBLASLt BF16 on the same shape in this run. Inputs are random normal BF16
// (never zeros); each timed run uses the next of several input sets, enough of them to exceed
// three times the L2 cache, so small shapes are not timed out of L2.
//
// Quantization as a producer would run it: NVFP4 with its global-amax pass; the emulated formats
// write only the scaled-domain BF16 copy the GEMM reads (the fused fast path), except for the
// "packed operands" rows, where the quantizer writes the packed copy and the GEMM dequantizes it.
// The FP8 block-scaled pairs run twice, forced: cuBLASLt's kernel and fourbit's (wgmma-fp8-block);
// the "wgrad" shapes are the 1x128 x 1x128 pair's shapes in the fp8 recipe's training step.
#include "gemm/bench.h"

#include "core/check.h"
#include "core/device.h"
#include "core/log.h"
#include "gemm/gemm.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <optional>

namespace fourbit::gemm {
namespace {

struct Shape3 {
  std::string name;
  int64_t m, n, k;
};

std::vector<Shape3> bench_shapes() {
  return {
      {"8192^3", 8192, 8192, 8192},
      {"16384x8192x2048", 16384, 8192, 2048},
      {"gpt2-small mlp-up 4096x3072x768", 4096, 3072, 768},
      // GPT-2 small (d 768), 8 x 1024 tokens per micro-batch.
      {"gpt2-small qkv", 8192, 2304, 768},
      {"gpt2-small attn-out", 8192, 768, 768},
      {"gpt2-small mlp-up", 8192, 3072, 768},
      {"gpt2-small mlp-down", 8192, 768, 3072},
      // 1.3B (d 2048, MLP 8192), 16 x 1024 tokens.
      {"1.3b qkv", 16384, 6144, 2048},
      {"1.3b attn-out", 16384, 2048, 2048},
      {"1.3b mlp-up", 16384, 8192, 2048},
      {"1.3b mlp-down", 16384, 2048, 8192},
      // The Wgrad products dW [N_out, N_in] = dY^T X of the 1.3B layers (K = the 16 x 1024 tokens),
      // the shape of the fp8 recipe's 1x128 x 1x128 GEMMs.
      {"1.3b wgrad qkv", 6144, 2048, 16384},
      {"1.3b wgrad attn-out", 2048, 2048, 16384},
      {"1.3b wgrad mlp-up", 8192, 2048, 16384},
      {"1.3b wgrad mlp-down", 2048, 8192, 16384},
  };
}

struct BenchCase {
  std::string name;
  std::optional<quant::QuantConfig> a, b;
  bool packed_operands = false;  // emulated: the GEMM dequantizes the packed copies itself
  double target_ratio = 0;
  Backend backend = Backend::kAuto;
};

std::vector<BenchCase> bench_cases() {
  quant::QuantConfig fp8_tensor;
  fp8_tensor.format = quant::Format::kFp8Tensor;
  quant::QuantConfig fp8_1d;
  fp8_1d.format = quant::Format::kFp8Block;
  quant::QuantConfig fp8_2d = fp8_1d;
  fp8_2d.block_2d = true;
  quant::QuantConfig nvfp4;
  quant::QuantConfig nvfp4_2d;
  nvfp4_2d.block_2d = true;
  quant::QuantConfig mxfp8;
  mxfp8.format = quant::Format::kMxfp8;
  return {
      {"bf16", std::nullopt, std::nullopt},
      {"fp8 tensor", fp8_tensor, fp8_tensor},
      {"fp8 1x128 x 128x128 (cublaslt)", fp8_1d, fp8_2d, false, 1.3, Backend::kCublasFp8},
      {"fp8 1x128 x 128x128 (wgmma)", fp8_1d, fp8_2d, false, 1.3, Backend::kWgmmaFp8},
      {"fp8 1x128 x 1x128 (cublaslt)", fp8_1d, fp8_1d, false, 1.3, Backend::kCublasFp8},
      {"fp8 1x128 x 1x128 (wgmma)", fp8_1d, fp8_1d, false, 1.3, Backend::kWgmmaFp8},
      {"nvfp4 emulated 1x16 x 16x16", nvfp4, nvfp4_2d, false, 0.8},
      {"nvfp4 emulated, packed operands", nvfp4, nvfp4_2d, true},
      {"mxfp8 emulated", mxfp8, mxfp8},
  };
}

double median_event_ms(int reps, const std::function<void(int)>& fn) {
  for (int i = 0; i < 3; ++i) fn(i);
  FOURBIT_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<cudaEvent_t> events(2 * (size_t)reps);
  for (cudaEvent_t& e : events) FOURBIT_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < reps; ++i) {
    FOURBIT_CUDA_CHECK(cudaEventRecord(events[2 * i]));
    fn(i);
    FOURBIT_CUDA_CHECK(cudaEventRecord(events[2 * i + 1]));
  }
  FOURBIT_CUDA_CHECK(cudaEventSynchronize(events.back()));
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    float t = 0;
    FOURBIT_CUDA_CHECK(cudaEventElapsedTime(&t, events[2 * i], events[2 * i + 1]));
    ms.push_back(t);
  }
  for (cudaEvent_t e : events) cudaEventDestroy(e);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// One input set: BF16 sources and their prepared operands for one case.
struct InputSet {
  Tensor a_src, b_src;  // bf16 [M, K], [N, K]
  quant::QuantizedTensor qa, qb;
  Tensor a_bf16, b_bf16;  // scaled-domain copies (emulated, fused path)
};

class ShapeBench {
 public:
  ShapeBench(const Shape3& s, int sets, int* flag) : shape_(s), flag_(flag) {
    for (int i = 0; i < sets; ++i) {
      InputSet in;
      in.a_src = Tensor::empty({s.m, s.k}, DType::kBF16, Device::kCuda);
      in.b_src = Tensor::empty({s.n, s.k}, DType::kBF16, Device::kCuda);
      quant::fill_normal_cuda(in.a_src.view(), 100 + 2 * i, nullptr);
      quant::fill_normal_cuda(in.b_src.view(), 101 + 2 * i, nullptr);
      sets_.push_back(std::move(in));
    }
    c_ = Tensor::empty({s.m, s.n}, DType::kBF16, Device::kCuda);
  }

  // Prepares every set for `bc` and returns {gemm-only ms, quantize + gemm ms}.
  std::pair<double, double> time(const BenchCase& bc, int reps) {
    for (InputSet& in : sets_) allocate(bc, in);
    for (size_t i = 0; i < sets_.size(); ++i) quantize(bc, sets_[i]);
    const int n = (int)sets_.size();
    const double gemm_ms = median_event_ms(reps, [&](int i) { run_gemm(bc, sets_[i % n]); });
    const double total_ms = bc.a ? median_event_ms(reps, [&](int i) {
      quantize(bc, sets_[i % n]);
      run_gemm(bc, sets_[i % n]);
    }) : gemm_ms;
    return {gemm_ms, total_ms};
  }

 private:
  static bool emulated(const std::optional<quant::QuantConfig>& c) {
    return c && (c->format == quant::Format::kNvfp4 || c->format == quant::Format::kMxfp8);
  }

  void allocate(const BenchCase& bc, InputSet& in) {
    if (!bc.a) return;
    in.qa = quant::allocate_quantized(*bc.a, shape_.m, shape_.k, {true, false}, Device::kCuda);
    in.qb = quant::allocate_quantized(*bc.b, shape_.n, shape_.k, {true, false}, Device::kCuda);
    const bool fused = emulated(bc.a) && !bc.packed_operands;
    in.a_bf16 = fused ? Tensor::empty({shape_.m, shape_.k}, DType::kBF16, Device::kCuda) : Tensor();
    in.b_bf16 = fused ? Tensor::empty({shape_.n, shape_.k}, DType::kBF16, Device::kCuda) : Tensor();
  }

  void quantize(const BenchCase& bc, InputSet& in) {
    if (!bc.a) return;
    quant::CudaQuantizeOptions o;
    o.nonfinite_flag = flag_;
    const bool fused = in.a_bf16.defined();
    o.write_packed = !fused;
    o.write_bf16_scaled = fused;
    o.tensor_name = "bench a";
    const TensorView a_view = in.a_bf16.view(), b_view = in.b_bf16.view();
    quant::quantize_cuda(in.a_src.view(), in.qa, o, fused ? &a_view : nullptr);
    o.tensor_name = "bench b";
    quant::quantize_cuda(in.b_src.view(), in.qb, o, fused ? &b_view : nullptr);
  }

  void run_gemm(const BenchCase& bc, const InputSet& in) {
    GemmArgs args;
    if (bc.a) {
      args.a = Operand::quant(in.qa, Copy::kRowwise, "a", in.a_bf16.view());
      args.b = Operand::quant(in.qb, Copy::kRowwise, "b", in.b_bf16.view());
    } else {
      args.a = Operand::dense(in.a_src.view(), "a");
      args.b = Operand::dense(in.b_src.view(), "b");
    }
    args.c = c_.view();
    args.backend = bc.backend;
    args.name = "bench gemm";
    args.error_flag = flag_;
    gemm(args);
  }

  Shape3 shape_;
  int* flag_;
  std::vector<InputSet> sets_;
  Tensor c_;
};

// The first line of an error message, without double quotes (it becomes a quoted CSV field).
std::string csv_safe(const std::string& message) {
  std::string line = message.substr(0, message.find('\n'));
  std::replace(line.begin(), line.end(), '"', '\'');
  return line;
}

}  // namespace

std::vector<GemmBenchRow> run_gemm_bench(const GemmBenchOptions& o) {
  const DeviceProperties props = current_device_properties();
  log_info("bench gemm on {} ({} SMs, L2 {} MB): median of {} CUDA-event-timed runs per case",
           props.name, props.multiprocessors, props.l2_bytes >> 20, o.reps);
  Tensor flag = Tensor::zeros({1}, DType::kI32, Device::kCuda);
  std::vector<GemmBenchRow> rows;
  for (const Shape3& s : bench_shapes()) {
    if (!o.shape_filter.empty() && s.name.find(o.shape_filter) == std::string::npos) continue;
    const double set_bytes = 2.0 * (double)(s.m + s.n) * (double)s.k;  // the BF16 sources
    const int sets = (int)std::clamp(std::ceil(3.0 * (double)props.l2_bytes / set_bytes), 1.0, 16.0);
    ShapeBench bench(s, sets, flag.ptr<int>());
    const double flops = 2.0 * (double)s.m * (double)s.n * (double)s.k;
    double bf16_ms = 0;
    for (const BenchCase& bc : bench_cases()) {
      GemmBenchRow r;
      r.shape = s.name;
      r.m = s.m;
      r.n = s.n;
      r.k = s.k;
      r.backend = bc.name;
      r.target_ratio = bc.target_ratio;
      try {  // one failing case (e.g. a configuration cuBLASLt rejects) must not hide the others
        const auto [gemm_ms, total_ms] = bench.time(bc, o.reps);
        if (!bc.a) bf16_ms = gemm_ms;
        r.gemm_ms = gemm_ms;
        r.total_ms = total_ms;
        r.gemm_tflops = flops / (gemm_ms * 1e9);
        r.total_tflops = flops / (total_ms * 1e9);
        r.gemm_ratio = bf16_ms / gemm_ms;
        r.total_ratio = bf16_ms / total_ms;
      } catch (const Error& e) {
        r.error = e.what();
        log_warn("bench gemm: {} / {} failed: {}", s.name, bc.name, e.what());
      }
      rows.push_back(r);
    }
  }
  int host_flag = 0;
  FOURBIT_CUDA_CHECK(cudaMemcpy(&host_flag, flag.data(), sizeof(int), cudaMemcpyDeviceToHost));
  FOURBIT_CHECK(host_flag == 0, "bench gemm: the kernels flagged errors ({}) on random data", host_flag);

  std::printf("%-32s %-32s %9s %8s %6s | %9s %8s %6s  %s\n", "shape (M x N x K)", "backend",
              "gemm ms", "TFLOP/s", "x bf16", "+quant ms", "TFLOP/s", "x bf16", "target");
  for (const GemmBenchRow& r : rows) {
    const std::string target =
        !r.error.empty()    ? "FAILED (see the warning above)"
        : r.target_ratio > 0 ? fmt::format(">= {:.1f}x with quantization: {}", r.target_ratio,
                                           r.total_ratio >= r.target_ratio ? "met" : "MISSED")
                             : "";
    const std::string shape = fmt::format("{} ({}x{}x{})", r.shape, r.m, r.n, r.k);
    std::printf("%-32.32s %-32s %9.4f %8.1f %6.2f | %9.4f %8.1f %6.2f  %s\n", shape.c_str(),
                r.backend.c_str(), r.gemm_ms, r.gemm_tflops, r.gemm_ratio, r.total_ms,
                r.total_tflops, r.total_ratio, target.c_str());
  }
  std::printf("(targets, BENCHMARKS.md: emulated NVFP4 with quantization >= 0.8x cuBLASLt BF16; FP8 "
              "block-scaled with quantization >= 1.3x BF16; ceilings measured on H200: BF16 8192^3 "
              "799 TFLOP/s, FP8 per-tensor 1463, FP8 1x128 x 128x128 1212)\n");
  if (!o.csv_path.empty()) {
    std::ofstream f(o.csv_path);
    FOURBIT_CHECK(f.good(), "bench gemm: cannot write '{}'", o.csv_path);
    f << "shape,m,n,k,backend,gemm_ms,gemm_tflops,gemm_ratio_bf16,total_ms,total_tflops,"
         "total_ratio_bf16,target_ratio,error\n";
    for (const GemmBenchRow& r : rows) {
      f << '"' << r.shape << "\"," << r.m << ',' << r.n << ',' << r.k << ",\"" << r.backend << "\","
        << r.gemm_ms << ',' << r.gemm_tflops << ',' << r.gemm_ratio << ',' << r.total_ms << ','
        << r.total_tflops << ',' << r.total_ratio << ',' << r.target_ratio << ",\""
        << csv_safe(r.error) << "\"\n";
    }
  }
  const int64_t failed = std::count_if(rows.begin(), rows.end(), [](const GemmBenchRow& r) { return !r.error.empty(); });
  FOURBIT_CHECK(failed == 0, "bench gemm: {} of {} cases failed (their errors are above)", failed, rows.size());
  return rows;
}

}  // namespace fourbit::gemm
