// Quantization error and bias on synthetic data: the `fourbit quant-report` table.
//
// For a tensor x and its quantize-dequantize round trip x^ (back in the source layout, with any
// Hadamard transform undone):
//   relative error = ||x^ - x||_2 / ||x||_2                       (random error; averages out)
//   relative bias  = sum(sign(x) * (x^ - x)) / sum(|x|)          (systematic growth (+) or
//                                                                 shrinkage (-) of magnitudes;
//                                                                 compounds through training)
// Every case quantizes the column-wise copy (blocks along M, the Wgrad orientation, where the
// NVIDIA recipe applies RHT and stochastic rounding) so that all options are comparable.
#pragma once

#include "core/tensor.h"
#include "quant/quantize.h"

#include <string>
#include <vector>

namespace fourbit::quant {

enum class Distribution { kNormal, kHeavyTailed, kOutliers };
std::string_view distribution_name(Distribution d);

// A seeded synthetic f32 [rows, cols] tensor: standard normal; Student-t with 3 degrees of
// freedom; or normal with 0.1% of elements multiplied by 50 (outliers).
Tensor make_synthetic(Distribution d, int64_t rows, int64_t cols, uint64_t seed);

struct ReportCase {
  std::string name;  // short label
  bool bf16_only = false;  // plain BF16 rounding, the baseline
  QuantConfig config;
  double bits_per_element = 0;
};
// The cases of the report: BF16, FP8 tensor/block, MXFP8 (round-up and floor), NVFP4 with RN/SR,
// 1D/2D, RHT, Four Over Six and the unbiased-SR scale.
std::vector<ReportCase> default_report_cases();

struct ErrorStats {
  double relative_error = 0;
  double relative_bias = 0;
};
// x and x_hat: f32 host tensors of equal size.
ErrorStats error_stats(const TensorView& x, const TensorView& x_hat);

struct ReportRow {
  std::string distribution;
  std::string case_name;
  std::string config;
  double bits_per_element;
  ErrorStats stats;
};

struct ReportOptions {
  int64_t rows = 1024, cols = 1024;
  uint64_t seed = 1234;
  Device device = Device::kCpu;
};

std::vector<ReportRow> run_quant_report(const ReportOptions& options);
std::string format_report_table(const std::vector<ReportRow>& rows);

}  // namespace fourbit::quant
