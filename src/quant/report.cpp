// Implementation of report.h.
#include "quant/report.h"

#include "core/rng.h"
#include "formats/element.h"

#include <cmath>

namespace fourbit::quant {

std::string_view distribution_name(Distribution d) {
  switch (d) {
    case Distribution::kNormal: return "normal";
    case Distribution::kHeavyTailed: return "student-t(3)";
    case Distribution::kOutliers: return "normal+0.1% x50";
  }
  return "?";
}

namespace {
double gaussian(const RandomStream& s, uint64_t i) {
  // Box-Muller on two uniforms in (0, 1].
  const double u1 = 1.0 - s.uniform_at(2 * i);
  const double u2 = s.uniform_at(2 * i + 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}
}  // namespace

Tensor make_synthetic(Distribution d, int64_t rows, int64_t cols, uint64_t seed) {
  Tensor t = Tensor::empty({rows, cols}, DType::kF32, Device::kCpu);
  float* p = t.ptr<float>();
  const RandomStream a{seed, 1}, b{seed, 2};
  const int64_t n = rows * cols;
  for (int64_t i = 0; i < n; ++i) {
    double x = gaussian(a, (uint64_t)i);
    if (d == Distribution::kHeavyTailed) {
      double chi2 = 0;
      for (int k = 0; k < 3; ++k) {
        const double z = gaussian(b, (uint64_t)(3 * i + k));
        chi2 += z * z;
      }
      x = x / std::sqrt(chi2 / 3.0);
    } else if (d == Distribution::kOutliers) {
      if (b.uniform_at((uint64_t)i) < 0.001f) x *= 50.0;
    }
    p[i] = (float)x;
  }
  return t;
}

std::vector<ReportCase> default_report_cases() {
  std::vector<ReportCase> cases;
  auto add = [&](std::string name, QuantConfig c, double bits) {
    cases.push_back({std::move(name), false, c, bits});
  };
  cases.push_back({"bf16", true, {}, 16.0});
  QuantConfig c;
  c.format = Format::kFp8Tensor;
  add("fp8 tensor", c, 8.0);
  c = {};
  c.format = Format::kFp8Block;
  add("fp8 1x128", c, 8.0 + 32.0 / 128);
  c.block_2d = true;
  add("fp8 128x128", c, 8.0 + 32.0 / (128 * 128));
  c = {};
  c.format = Format::kMxfp8;
  add("mxfp8", c, 8.25);
  c.mx_scale_rule = MxScaleRule::kFloor;
  add("mxfp8 floor", c, 8.25);
  c.mx_scale_rule = MxScaleRule::kRoundUp;
  c.rounding = Rounding::kStochastic;
  add("mxfp8 sr", c, 8.25);
  c = {};
  c.format = Format::kNvfp4;
  add("nvfp4", c, 4.5);
  c.rounding = Rounding::kStochastic;
  add("nvfp4 sr", c, 4.5);
  c.sr_unbiased_scale = true;
  add("nvfp4 sr 16/17", c, 4.5);
  c = {};
  c.format = Format::kNvfp4;
  c.block_2d = true;
  add("nvfp4 2d", c, 4.0 + 8.0 / 256);
  c = {};
  c.format = Format::kNvfp4;
  c.rht = true;
  add("nvfp4 rht", c, 4.5);
  c.rounding = Rounding::kStochastic;
  add("nvfp4 rht sr", c, 4.5);
  c = {};
  c.format = Format::kNvfp4;
  c.nvfp4_scale_rule = Nvfp4ScaleRule::kFourOverSix;
  add("nvfp4 4/6", c, 4.5);
  c.block_2d = true;
  add("nvfp4 2d 4/6", c, 4.0 + 8.0 / 256);
  return cases;
}

ErrorStats error_stats(const TensorView& x, const TensorView& x_hat) {
  FOURBIT_CHECK(x.numel() == x_hat.numel() && x.dtype == DType::kF32 && x_hat.dtype == DType::kF32,
                "error_stats: {} vs {}", x.describe(), x_hat.describe());
  double err2 = 0, ref2 = 0, signed_err = 0, abs_sum = 0;
  const float* a = x.ptr<const float>();
  const float* b = x_hat.ptr<const float>();
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double d = (double)b[i] - (double)a[i];
    err2 += d * d;
    ref2 += (double)a[i] * a[i];
    signed_err += a[i] > 0 ? d : (a[i] < 0 ? -d : 0.0);
    abs_sum += std::fabs((double)a[i]);
  }
  ErrorStats s;
  s.relative_error = ref2 > 0 ? std::sqrt(err2 / ref2) : 0.0;
  s.relative_bias = abs_sum > 0 ? signed_err / abs_sum : 0.0;
  return s;
}

namespace {
Tensor round_trip(const ReportCase& rc, const Tensor& x, const ReportOptions& opt, uint64_t seed) {
  if (rc.bf16_only) {
    Tensor out = Tensor::empty(x.shape(), DType::kF32, Device::kCpu);
    for (int64_t i = 0; i < x.numel(); ++i)
      out.ptr<float>()[i] = formats::round_to_bf16(x.ptr<float>()[i]);
    return out;
  }
  QuantizeOptions qo;
  qo.tensor_name = "synthetic";
  qo.sr = RandomStream{seed, 7};
  Orientations o{false, true};
  if (opt.device == Device::kCpu) {
    QuantizedTensor q = quantize_reference(x.view(), rc.config, o, qo);
    return dequantize_to_source_reference(q, true);
  }
#if defined(FOURBIT_WITH_CUDA)
  Tensor xd = x.to(Device::kCuda);
  QuantizedTensor q = allocate_quantized(rc.config, x.shape()[0], x.shape()[1], o, Device::kCuda);
  CudaQuantizeOptions co;
  co.tensor_name = "synthetic";
  co.sr = qo.sr;
  quantize_cuda(xd.view(), q, co);
  // Bring the quantized bundle to the host and reuse the reference's dequantization.
  QuantizedTensor h = q;
  h.device = Device::kCpu;
  QuantizedData& d = *h.colwise;
  d.data = d.data.to(Device::kCpu);
  d.scales = d.scales.to(Device::kCpu);
  if (d.amax.defined()) d.amax = d.amax.to(Device::kCpu);
  return dequantize_to_source_reference(h, true);
#else
  FOURBIT_CHECK(false, "quant-report --device cuda needs a CUDA build");
  return {};
#endif
}
}  // namespace

std::vector<ReportRow> run_quant_report(const ReportOptions& opt) {
  std::vector<ReportRow> rows;
  const Distribution dists[] = {Distribution::kNormal, Distribution::kHeavyTailed,
                                Distribution::kOutliers};
  for (Distribution dist : dists) {
    const Tensor x = make_synthetic(dist, opt.rows, opt.cols, opt.seed);
    for (const ReportCase& rc : default_report_cases()) {
      const Tensor x_hat = round_trip(rc, x, opt, opt.seed);
      rows.push_back({std::string(distribution_name(dist)), rc.name,
                      rc.bf16_only ? "bf16 rn" : rc.config.describe(), rc.bits_per_element,
                      error_stats(x.view(), x_hat.view())});
    }
  }
  return rows;
}

std::string format_report_table(const std::vector<ReportRow>& rows) {
  std::string s = fmt::format("{:<17} {:<15} {:<26} {:>6} {:>12} {:>12}\n", "distribution", "case",
                              "quantizer", "bits", "rel.error", "rel.bias");
  s += std::string(93, '-') + "\n";
  std::string last;
  for (const ReportRow& r : rows) {
    if (!last.empty() && r.distribution != last) s += "\n";
    last = r.distribution;
    s += fmt::format("{:<17} {:<15} {:<26} {:>6.2f} {:>12.4e} {:>+12.3e}\n", r.distribution,
                     r.case_name, r.config, r.bits_per_element, r.stats.relative_error,
                     r.stats.relative_bias);
  }
  return s;
}

}  // namespace fourbit::quant
