// Helpers shared by the gemm tests: random operands, quantized bundles on either device, and the
// error bound that separates a backend's accumulation error from everything else.
//
// The bound. A backend multiplies exactly the dequantized operand values and accumulates in FP32
// (or, for FP8 tensor cores, a narrower accumulator promoted to FP32 at least every 128 elements),
// so for every output element
//   |c - ref| <= tol * S + out * |ref|,   S = |alpha| * sum_k |a_k b_k| + |beta * c_old|
// where ref is the float64 reference over the same dequantized operands, tol is the accumulation
// bound (recursive FP32 summation: (K - 1) u with u = 2^-24; doubled for tensor cores that truncate
// instead of rounding, plus a few u for the FP32 alpha and beta products), and out is the output
// rounding: one unit in the last place relative to |ref| (bf16 2^-7, f32 2^-23 * 2), because the
// reference and the backend each round to the output type, and two results on either side of a
// rounding boundary end one ulp apart (seen on the H200: bf16 outputs 1 ulp apart, e.g. -66.5 vs
// -67). Quantization error never enters: both sides use the same quantized values.
#pragma once

#include "core/tensor.h"
#include "formats/element.h"
#include "gemm/gemm.h"
#include "quant/quantize.h"
#include "quant/report.h"

#include <gtest/gtest.h>

#include <cmath>
#include <initializer_list>
#include <string>
#include <vector>

namespace fourbit::gemm::testing {

inline double fp32_accumulation_tolerance(int64_t k) { return 2.0 * (double)(k + 16) * std::ldexp(1.0, -24); }
// Hopper FP8 tensor cores keep ~14 bits between promotions (NUMERICS.md 6): 2^-10 leaves a 4x
// margin over 2^-12 and is still ~100x below the error of a wrong scale or element.
inline constexpr double kFp8AccumulationTolerance = 1.0 / 1024;

// Random standard-normal host tensor [rows, cols] in f32 or bf16 (never zeros).
inline Tensor random_matrix(int64_t rows, int64_t cols, uint64_t seed, DType dtype = DType::kF32) {
  Tensor x = quant::make_synthetic(quant::Distribution::kNormal, rows, cols, seed);
  if (dtype == DType::kF32) return x;
  Tensor b = Tensor::empty({rows, cols}, DType::kBF16, Device::kCpu);
  for (int64_t i = 0; i < x.numel(); ++i) b.ptr<uint16_t>()[i] = formats::encode_bf16_rn(x.ptr<float>()[i]);
  return b;
}

// Host values of a contiguous f32 or bf16 matrix.
inline std::vector<double> to_doubles(const Tensor& t) {
  const Tensor h = t.device() == Device::kCpu ? t : t.to(Device::kCpu);
  std::vector<double> v((size_t)h.numel());
  for (int64_t i = 0; i < h.numel(); ++i) {
    v[(size_t)i] = h.dtype() == DType::kF32 ? (double)h.ptr<float>()[i]
                                            : (double)formats::decode_bf16(h.ptr<uint16_t>()[i]);
  }
  return v;
}

// The logical [rows, K] values of an operand (host), exactly dequantized.
inline std::vector<double> logical_values(const Operand& op) {
  if (op.quantized) {
    return to_doubles(quant::dequantize_reference(*op.quantized, op.copy == Copy::kColwise));
  }
  const TensorView& t = op.plain;  // host, [rows, K] or (transposed) [K, rows], strided rows
  const int64_t rows = op.rows(), k = op.k();
  std::vector<double> v((size_t)(rows * k));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t l = 0; l < k; ++l) {
      const int64_t at = op.transposed ? l * t.strides[0] + r : r * t.strides[0] + l;
      v[(size_t)(r * k + l)] = t.dtype == DType::kF32 ? (double)t.ptr<const float>()[at]
                                                      : (double)formats::decode_bf16(t.ptr<const uint16_t>()[at]);
    }
  return v;
}

// S of the bound above for every element of C [M, N] (host operands).
inline std::vector<double> magnitude_sums(const Operand& a, const Operand& b, float alpha, float beta,
                                          const std::vector<double>& c_old) {
  const std::vector<double> va = logical_values(a), vb = logical_values(b);
  const int64_t m = a.rows(), n = b.rows(), k = a.k();
  std::vector<double> s((size_t)(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t l = 0; l < k; ++l) acc += std::fabs(va[(size_t)(i * k + l)] * vb[(size_t)(j * k + l)]);
      s[(size_t)(i * n + j)] = std::fabs(alpha) * acc + (beta != 0 ? std::fabs(beta * c_old[(size_t)(i * n + j)]) : 0.0);
    }
  return s;
}

// Checks |got - ref| <= tol * s + out * |ref| elementwise; reports the first violation and the
// largest ratio error / bound.
inline ::testing::AssertionResult within_bound(const std::vector<double>& got, const std::vector<double>& ref,
                                               const std::vector<double>& s, double tol, DType c_dtype,
                                               int64_t cols, const std::string& what) {
  const double out = c_dtype == DType::kBF16 ? std::ldexp(1.0, -7) : std::ldexp(1.0, -22);
  double worst = 0;
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    const double bound = tol * s[i] + out * std::fabs(ref[i]) + 1e-30;
    const double err = std::fabs(got[i] - ref[i]);
    const double ratio = std::isnan(err) ? INFINITY : err / bound;
    worst = std::max(worst, ratio);
    if (!(ratio <= 1.0)) {
      if (first < 0) first = (int64_t)i;
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess() << what << ": worst error / bound " << worst;
  const size_t f = (size_t)first;
  return ::testing::AssertionFailure()
         << what << ": " << bad << " of " << got.size() << " elements exceed the bound; first at ("
         << first / cols << ", " << first % cols << "): got " << got[f] << ", float64 reference "
         << ref[f] << ", |error| " << std::fabs(got[f] - ref[f]) << " > bound "
         << tol * s[f] + out * std::fabs(ref[f]) << " (tol " << tol << " x S " << s[f]
         << "); worst error / bound " << worst;
}

// Expects `fn` to throw fourbit::Error whose message contains every one of `words`.
template <typename Fn>
void expect_error(Fn fn, std::initializer_list<const char*> words) {
  try {
    fn();
    ADD_FAILURE() << "expected a fourbit::Error";
  } catch (const Error& e) {
    for (const char* w : words) EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
  }
}

}  // namespace fourbit::gemm::testing
