// Implementation of attention_bench.h: times attention_forward, attention_backward and
// attention_decode on random bf16 data with CUDA events (median of the repetitions).
#include "ops/attention_bench.h"

#include "core/check.h"
#include "core/device.h"
#include "ops/arg_checks.h"
#include "ops/attention.h"

#if defined(FOURBIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <tuple>
#include <vector>

namespace fourbit::ops {

#if defined(FOURBIT_WITH_CUDA)
namespace {

constexpr double kBf16CeilingTflops = 799;  // cuBLASLt BF16 8192^3 on the H200 (BENCHMARKS.md)
constexpr double kCopyCeilingGbps = 4260;   // device-to-device copy, bytes read + written

// A bf16 device tensor of uniform values in [-2, 2) (a fixed LCG: cheap, never zeros).
Tensor random_bf16(Shape shape, uint64_t seed) {
  Tensor h = Tensor::empty(shape, DType::kBF16, Device::kCpu);
  uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (int64_t i = 0; i < h.numel(); ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const float x = (float)((s >> 40) & 0xFFFFFF) * (4.0f / 16777216.0f) - 2.0f;
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    h.ptr<uint16_t>()[i] = (uint16_t)(bits >> 16);
  }
  return h.to(Device::kCuda);
}

template <typename F>
double median_ms(int reps, F&& f) {
  f();
  f();
  cudaEvent_t start, stop;
  FOURBIT_CUDA_CHECK(cudaEventCreate(&start));
  FOURBIT_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    FOURBIT_CUDA_CHECK(cudaEventRecord(start));
    f();
    FOURBIT_CUDA_CHECK(cudaEventRecord(stop));
    FOURBIT_CUDA_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    FOURBIT_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

struct TrainShape {
  const char* name;
  int64_t B, T, H, Hkv, D;
};
struct DecodeShape {
  const char* name;
  int64_t B, len, Tq, H, Hkv, D;
};

}  // namespace

std::vector<AttentionBenchRow> run_attention_bench(const AttentionBenchOptions& o) {
  FOURBIT_CHECK(o.reps >= 1, "bench attention: --reps must be >= 1, got {}", o.reps);
  const TrainShape train[] = {{"gpt2-124m", 32, 1024, 12, 12, 64},
                              {"350m", 32, 1024, 16, 16, 64},
                              {"1.3b", 16, 1024, 16, 16, 128},
                              {"gqa-32/8-t4096", 4, 4096, 32, 8, 128}};
  const DecodeShape decode[] = {{"decode-1.1b-b16", 16, 2048, 1, 32, 4, 64},
                                {"decode-1.1b-b64", 64, 2048, 1, 32, 4, 64},
                                {"decode-1.3b-b16", 16, 2048, 1, 16, 16, 128},
                                {"prefill-chunk-1.3b", 8, 1024, 16, 16, 16, 128}};
  std::vector<AttentionBenchRow> rows;
  auto wanted = [&](const char* name) {
    return o.shape_filter.empty() || std::string(name).find(o.shape_filter) != std::string::npos;
  };
  for (const TrainShape& s : train) {
    if (!wanted(s.name)) continue;
    const std::string shape = fmt::format("{} (B {}, T {}, H {}/{}, D {})", s.name, s.B, s.T, s.H,
                                          s.Hkv, s.D);
    const Tensor q = random_bf16({s.B, s.T, s.H, s.D}, 1), k = random_bf16({s.B, s.T, s.Hkv, s.D}, 2),
                 v = random_bf16({s.B, s.T, s.Hkv, s.D}, 3), dout = random_bf16({s.B, s.T, s.H, s.D}, 4);
    Tensor out = Tensor::empty({s.B, s.T, s.H, s.D}, DType::kBF16, Device::kCuda);
    Tensor lse = Tensor::empty({s.B, s.H, s.T}, DType::kF32, Device::kCuda);
    Tensor dq = Tensor::empty({s.B, s.T, s.H, s.D}, DType::kBF16, Device::kCuda);
    Tensor dk = Tensor::empty({s.B, s.T, s.Hkv, s.D}, DType::kBF16, Device::kCuda);
    Tensor dv = Tensor::empty({s.B, s.T, s.Hkv, s.D}, DType::kBF16, Device::kCuda);
    const double fwd_flops = 2.0 * s.B * s.H * (double)s.T * s.T * s.D;
    const double fwd = median_ms(o.reps, [&] { attention_forward(q, k, v, out, lse); });
    const double bwd = median_ms(o.reps, [&] { attention_backward(dout, q, k, v, out, lse, dq, dk, dv); });
    std::vector<std::tuple<const char*, double, double>> timed = {{"forward", fwd, fwd_flops},
                                                                  {"backward", bwd, 2.5 * fwd_flops}};
    if (attention_wgmma_available()) {  // the default there is wgmma; A/B against the mma.sync kernels
      AttentionOptions ms;
      ms.wgmma_forward = ms.wgmma_backward = false;
      const double ms_fwd = median_ms(o.reps, [&] { attention_forward(q, k, v, out, lse, ms); });
      const double ms_bwd =
          median_ms(o.reps, [&] { attention_backward(dout, q, k, v, out, lse, dq, dk, dv, ms); });
      timed.emplace_back("forward (mma.sync)", ms_fwd, fwd_flops);
      timed.emplace_back("backward (mma.sync)", ms_bwd, 2.5 * fwd_flops);
      AttentionOptions np;  // the wgmma backward without the overlap (AttentionOptions::wgmma_overlap)
      np.wgmma_overlap = false;
      const double np_bwd =
          median_ms(o.reps, [&] { attention_backward(dout, q, k, v, out, lse, dq, dk, dv, np); });
      timed.emplace_back("backward (wgmma, no overlap)", np_bwd, 2.5 * fwd_flops);
      AttentionOptions fast;  // ex2.approx.ftz exponentials (AttentionOptions::wgmma_fast_exp)
      fast.wgmma_fast_exp = true;
      const double fast_fwd = median_ms(o.reps, [&] { attention_forward(q, k, v, out, lse, fast); });
      const double fast_bwd =
          median_ms(o.reps, [&] { attention_backward(dout, q, k, v, out, lse, dq, dk, dv, fast); });
      timed.emplace_back("forward (wgmma fast exp)", fast_fwd, fwd_flops);
      timed.emplace_back("backward (wgmma fast exp)", fast_bwd, 2.5 * fwd_flops);
    }
    for (const auto& [op, ms, flops] : timed) {
      AttentionBenchRow r;
      r.shape = shape;
      r.op = op;
      r.ms = ms;
      r.tflops = flops / (ms * 1e9);
      r.fraction_of_ceiling = r.tflops / kBf16CeilingTflops;
      rows.push_back(r);
    }
  }
  for (const DecodeShape& s : decode) {
    if (!wanted(s.name)) continue;
    const std::string shape = fmt::format("{} (B {}, cache {}, Tq {}, H {}/{}, D {})", s.name, s.B,
                                          s.len, s.Tq, s.H, s.Hkv, s.D);
    const Tensor q = random_bf16({s.B, s.Tq, s.H, s.D}, 5), kc = random_bf16({s.B, s.len, s.Hkv, s.D}, 6),
                 vc = random_bf16({s.B, s.len, s.Hkv, s.D}, 7);
    Tensor lens = Tensor::empty({s.B}, DType::kI32, Device::kCpu);
    for (int64_t b = 0; b < s.B; ++b) lens.ptr<int32_t>()[b] = (int32_t)s.len;
    const Tensor lens_d = lens.to(Device::kCuda);
    Tensor out = Tensor::empty({s.B, s.Tq, s.H, s.D}, DType::kBF16, Device::kCuda);
    const double ms = median_ms(o.reps, [&] { attention_decode(q, kc, vc, lens_d, out); });
    AttentionBenchRow r;
    r.shape = shape;
    r.op = "decode";
    r.ms = ms;
    const double bytes = 2.0 * 2.0 * s.B * s.len * s.Hkv * s.D + 2.0 * 2.0 * s.B * s.Tq * s.H * s.D;
    r.gbps = bytes / (ms * 1e6);
    r.fraction_of_ceiling = r.gbps / kCopyCeilingGbps;
    rows.push_back(r);
  }

  std::printf("%-56s %-16s %10s %9s %9s %8s\n", "shape", "op", "ms", "TFLOP/s", "GB/s", "ceiling");
  for (const AttentionBenchRow& r : rows) {
    std::printf("%-56.56s %-16s %10.4f %9.1f %9.1f %7.1f%%\n", r.shape.c_str(), r.op.c_str(), r.ms,
                r.tflops, r.gbps, 100 * r.fraction_of_ceiling);
  }
  std::printf("(ceilings, BENCHMARKS.md: cuBLASLt BF16 8192^3 799 TFLOP/s for forward/backward, "
              "model FLOPs with the causal half; device copy 4.26 TB/s for decode, bytes of the "
              "key/value cache read)\n");
  if (!o.csv_path.empty()) {
    std::ofstream f(o.csv_path);
    FOURBIT_CHECK(f.good(), "bench attention: cannot write '{}'", o.csv_path);
    f << "shape,op,ms,tflops,gbps,fraction_of_ceiling\n";
    for (const AttentionBenchRow& r : rows)
      f << '"' << r.shape << "\"," << r.op << ',' << r.ms << ',' << r.tflops << ',' << r.gbps << ','
        << r.fraction_of_ceiling << '\n';
  }
  return rows;
}

#else

std::vector<AttentionBenchRow> run_attention_bench(const AttentionBenchOptions&) {
  detail::no_cuda_build("bench attention");
  return {};
}

#endif

}  // namespace fourbit::ops
