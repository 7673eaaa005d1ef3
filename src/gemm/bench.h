// `fourbit bench gemm`: TFLOP/s of every CUDA GEMM backend at the BENCHMARKS.md shapes and the
// GPT-2-small / 1.3B layer shapes, each with its ratio to cuBLASLt BF16 on the same shape in the
// same run, with the operands' quantization excluded and included. CUDA builds only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fourbit::gemm {

struct GemmBenchOptions {
  int reps = 30;
  std::string shape_filter;  // only shapes whose name contains this ("" = all)
  std::string csv_path;      // optional: also write the table as CSV
};

struct GemmBenchRow {
  std::string shape;  // name
  int64_t m = 0, n = 0, k = 0;
  std::string backend;       // "bf16", "fp8 tensor", "fp8 1x128 x 128x128", ...
  double gemm_ms = 0;        // operands already quantized (and, for the emulation, in BF16)
  double total_ms = 0;       // quantization of both operands from BF16 included
  double gemm_tflops = 0, total_tflops = 0;
  double gemm_ratio = 0, total_ratio = 0;  // vs cuBLASLt BF16 on this shape
  double target_ratio = 0;   // BENCHMARKS.md target for total_ratio (0: none)
  std::string error;         // non-empty: this case failed (the message), its figures are 0
};

std::vector<GemmBenchRow> run_gemm_bench(const GemmBenchOptions& options);

}  // namespace fourbit::gemm
