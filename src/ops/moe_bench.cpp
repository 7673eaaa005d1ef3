// Implementation of moe_bench.h: times every MoE routing and permutation op on random data with
// CUDA events (median of the repetitions). Bytes are what each op must move at least: every input
// read once, every output written once.
#include "ops/moe_bench.h"

#include "core/check.h"
#include "core/device.h"
#include "ops/arg_checks.h"
#include "ops/moe.h"

#if defined(FOURBIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <vector>

namespace fourbit::ops {

#if defined(FOURBIT_WITH_CUDA)
namespace {

constexpr double kCopyCeilingGbps = 4260;  // device-to-device copy, bytes read + written

// Uniform values in [-2, 2) from a fixed LCG, as f32 or bf16, uploaded to the GPU.
Tensor random_device(Shape shape, DType dtype, uint64_t seed) {
  Tensor h = Tensor::empty(shape, dtype, Device::kCpu);
  uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (int64_t i = 0; i < h.numel(); ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const float x = (float)((s >> 40) & 0xFFFFFF) * (4.0f / 16777216.0f) - 2.0f;
    if (dtype == DType::kF32) {
      h.ptr<float>()[i] = x;
    } else {
      uint32_t bits;
      std::memcpy(&bits, &x, 4);
      h.ptr<uint16_t>()[i] = (uint16_t)(bits >> 16);
    }
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

struct Shape5 {
  const char* name;
  int64_t N;
  int E, k;
  int64_t C;
  int align;
};

}  // namespace

std::vector<MoeBenchRow> run_moe_bench(const MoeBenchOptions& o) {
  FOURBIT_CHECK(o.reps >= 1, "bench moe: --reps must be >= 1, got {}", o.reps);
  const Shape5 shapes[] = {{"8x-top2-d768", 32768, 8, 2, 768, 8},
                           {"8x-top2-d2048", 16384, 8, 2, 2048, 8},
                           {"64x-top8-d2048", 16384, 64, 8, 2048, 8},
                           {"256x-top8-d7168", 4096, 256, 8, 7168, 8}};
  std::vector<MoeBenchRow> rows;
  for (const Shape5& s : shapes) {
    if (!o.shape_filter.empty() && std::string(s.name).find(o.shape_filter) == std::string::npos) continue;
    const int64_t N = s.N, E = s.E, k = s.k, C = s.C;
    const int64_t R = moe_permuted_rows(N, s.k, s.E, s.align);
    const std::string shape = fmt::format("{} (N {}, E {}, k {}, C {})", s.name, N, E, k, C);
    const Tensor logits = random_device({N, E}, DType::kF32, 1);
    Tensor probs = Tensor::empty({N, E}, DType::kF32, Device::kCuda), ids = Tensor::empty({N, k}, DType::kI32, Device::kCuda),
           gates = Tensor::empty({N, k}, DType::kF32, Device::kCuda), counts = Tensor::empty({E}, DType::kI32, Device::kCuda),
           losses = Tensor::empty({2}, DType::kF32, Device::kCuda), d_logits = Tensor::empty({N, E}, DType::kF32, Device::kCuda);
    const Tensor d_gates = random_device({N, k}, DType::kF32, 2);
    Tensor offsets = Tensor::empty({E + 1}, DType::kI32, Device::kCuda), slot_rows = Tensor::empty({N, k}, DType::kI32, Device::kCuda),
           row_slots = Tensor::empty({R}, DType::kI32, Device::kCuda);
    const MoePlan plan{offsets, slot_rows, row_slots};
    const Tensor x = random_device({N, C}, DType::kBF16, 3), y_perm = random_device({R, C}, DType::kBF16, 4),
                 dy = random_device({N, C}, DType::kBF16, 5);
    Tensor x_perm = Tensor::empty({R, C}, DType::kBF16, Device::kCuda), y = Tensor::empty({N, C}, DType::kBF16, Device::kCuda),
           d_y_perm = Tensor::empty({R, C}, DType::kBF16, Device::kCuda), d_g = Tensor::empty({N, k}, DType::kF32, Device::kCuda),
           dx = Tensor::empty({N, C}, DType::kBF16, Device::kCuda);
    RouterOptions ro;
    ro.top_k = s.k;
    const RouterOutputs outs{probs, ids, gates, counts, losses};
    router_forward(logits, ro, outs);
    moe_plan(ids, s.align, plan);
    device_synchronize();

    const double nk = (double)N * k, row = 2.0 * C;
    auto add = [&](const char* op, double bytes, double ms) {
      MoeBenchRow r;
      r.shape = shape;
      r.op = op;
      r.ms = ms;
      r.bytes = bytes;
      r.gbps = bytes / (ms * 1e6);
      r.fraction_of_copy = r.gbps / kCopyCeilingGbps;
      rows.push_back(r);
    };
    add("router_forward", 4.0 * N * E * 3 + 8.0 * nk, median_ms(o.reps, [&] { router_forward(logits, ro, outs); }));
    add("router_backward", 4.0 * N * E * 3 + 12.0 * nk + 4.0 * E, median_ms(o.reps, [&] {
          router_backward({logits, probs, ids, counts}, d_gates, {0.01f, 0.001f}, d_logits);
        }));
    add("plan", 4.0 * nk * 2 + 4.0 * R + 4.0 * (E + 1), median_ms(o.reps, [&] { moe_plan(ids, s.align, plan); }));
    add("permute", row * N + row * R, median_ms(o.reps, [&] { moe_permute(x, plan, x_perm); }));
    add("unpermute", row * nk + row * N + 4.0 * nk, median_ms(o.reps, [&] { moe_unpermute(y_perm, gates, plan, y); }));
    add("unpermute_backward", row * N + row * nk + row * R + 8.0 * nk,
        median_ms(o.reps, [&] { moe_unpermute_backward(dy, y_perm, gates, plan, d_y_perm, d_g); }));
    add("permute_backward", row * nk + row * N, median_ms(o.reps, [&] { moe_permute_backward(y_perm, plan, dx); }));
  }

  std::printf("%-44s %-20s %10s %10s %9s %8s\n", "shape", "op", "ms", "MB", "GB/s", "copy");
  for (const MoeBenchRow& r : rows)
    std::printf("%-44.44s %-20s %10.4f %10.1f %9.1f %7.1f%%\n", r.shape.c_str(), r.op.c_str(), r.ms,
                r.bytes / 1e6, r.gbps, 100 * r.fraction_of_copy);
  std::printf("(ceiling, BENCHMARKS.md: device copy 4.26 TB/s, bytes read + written; bf16 activations, "
              "f32 router)\n");
  if (!o.csv_path.empty()) {
    std::ofstream f(o.csv_path);
    FOURBIT_CHECK(f.good(), "bench moe: cannot write '{}'", o.csv_path);
    f << "shape,op,ms,bytes,gbps,fraction_of_copy\n";
    for (const MoeBenchRow& r : rows)
      f << '"' << r.shape << "\"," << r.op << ',' << r.ms << ',' << r.bytes << ',' << r.gbps << ','
        << r.fraction_of_copy << '\n';
  }
  return rows;
}

#else

std::vector<MoeBenchRow> run_moe_bench(const MoeBenchOptions&) {
  detail::no_cuda_build("bench moe");
  return {};
}

#endif

}  // namespace fourbit::ops
