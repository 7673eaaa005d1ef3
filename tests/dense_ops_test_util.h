// Helpers shared by the dense ops tests (test_ops_{embedding,rmsnorm,rope,swiglu,cross_entropy,
// adamw,elementwise}[_cuda].cpp): host tensors from values, seeded random values, float64 central
// finite differences, guarded device outputs and a tolerance comparison that reports the worst
// element precisely.
#pragma once

#include "core/device.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "formats/element.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace fourbit::ops::testing {

// --- host values -------------------------------------------------------------------------------

// Seeded standard-normal values (Philox + Box-Muller: the same on every platform).
inline std::vector<double> random_normal(int64_t n, uint64_t seed, double scale = 1.0) {
  std::vector<double> v((size_t)n);
  const RandomStream rs{seed, 0x5eed};
  for (int64_t i = 0; i < n; ++i) {
    const double u1 = ((double)rs.uniform_at(2 * (uint64_t)i) * 16777216.0 + 1.0) / 16777217.0;
    const double u2 = (double)rs.uniform_at(2 * (uint64_t)i + 1);
    v[(size_t)i] = scale * std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  return v;
}

// Seeded integers in [lo, hi].
inline std::vector<int32_t> random_ints(int64_t n, int32_t lo, int32_t hi, uint64_t seed) {
  std::vector<int32_t> v((size_t)n);
  const RandomStream rs{seed, 0x1d5};
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t w = rs.block((uint64_t)i).v[0];
    v[(size_t)i] = lo + (int32_t)(w % (uint32_t)(hi - lo + 1));
  }
  return v;
}

inline double round_bf16(double x) { return formats::round_to_bf16((float)x); }
inline std::vector<double> rounded(const std::vector<double>& v, DType dtype) {
  std::vector<double> r(v);
  for (double& x : r) x = dtype == DType::kBF16 ? round_bf16(x) : dtype == DType::kF32 ? (double)(float)x : x;
  return r;
}

// A contiguous host tensor of `dtype` (f64, f32, bf16) holding `values` (rounded to the dtype).
inline Tensor host_tensor(Shape shape, DType dtype, const std::vector<double>& values) {
  Tensor t = Tensor::empty(shape, dtype, Device::kCpu);
  EXPECT_EQ((int64_t)values.size(), t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double x = values[(size_t)i];
    switch (dtype) {
      case DType::kF64: t.ptr<double>()[i] = x; break;
      case DType::kF32: t.ptr<float>()[i] = (float)x; break;
      case DType::kBF16: t.ptr<uint16_t>()[i] = formats::encode_bf16_rn((float)x); break;
      default: ADD_FAILURE() << "host_tensor: unsupported dtype"; break;
    }
  }
  return t;
}

inline Tensor host_ints(Shape shape, const std::vector<int32_t>& values) {
  Tensor t = Tensor::empty(shape, DType::kI32, Device::kCpu);
  EXPECT_EQ((int64_t)values.size(), t.numel());
  if (!values.empty()) std::memcpy(t.data(), values.data(), values.size() * sizeof(int32_t));
  return t;
}

// The values of a contiguous f64 / f32 / bf16 tensor on either device.
inline std::vector<double> values_of(const TensorView& view) {
  Tensor h = Tensor::empty(view.shape, view.dtype, Device::kCpu);
  copy_tensor(h.view(), view);
  std::vector<double> v((size_t)h.numel());
  for (int64_t i = 0; i < h.numel(); ++i) {
    switch (h.dtype()) {
      case DType::kF64: v[(size_t)i] = h.ptr<double>()[i]; break;
      case DType::kF32: v[(size_t)i] = h.ptr<float>()[i]; break;
      case DType::kBF16: v[(size_t)i] = formats::decode_bf16(h.ptr<uint16_t>()[i]); break;
      default: ADD_FAILURE() << "values_of: unsupported dtype"; break;
    }
  }
  return v;
}

// --- finite differences ------------------------------------------------------------------------

// Compares `analytic` (d loss / d x) with float64 central differences of loss() over every
// element of x (perturbed in place and restored): |num - ana| <= rtol * max(|num|, |ana|) + atol,
// atol = rtol * max |ana| (entries near zero are judged against the gradient's scale).
inline ::testing::AssertionResult check_gradient(const std::function<double()>& loss, double* x,
                                                 int64_t n, const std::vector<double>& analytic,
                                                 const std::string& what, double rtol = 1e-6) {
  if ((int64_t)analytic.size() != n)
    return ::testing::AssertionFailure() << what << ": analytic gradient has " << analytic.size()
                                         << " entries, expected " << n;
  double scale = 0;
  for (double a : analytic) scale = std::max(scale, std::fabs(a));
  const double atol = rtol * std::max(scale, 1e-3);
  int64_t bad = 0, worst = -1;
  double worst_excess = 0, worst_num = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double x0 = x[i];
    const double h = 1e-5 * std::max(1.0, std::fabs(x0));
    x[i] = x0 + h;
    const double lp = loss();
    x[i] = x0 - h;
    const double lm = loss();
    x[i] = x0;
    const double num = (lp - lm) / (2 * h);
    const double ana = analytic[(size_t)i];
    const double tol = rtol * std::max(std::fabs(num), std::fabs(ana)) + atol;
    const double err = std::fabs(num - ana);
    if (!(err <= tol)) {
      ++bad;
      if (worst < 0 || err / tol > worst_excess) {
        worst = i;
        worst_excess = err / tol;
        worst_num = num;
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << bad << " of " << n << " gradient entries differ from float64 central "
         << "differences; worst at index " << worst << ": analytic " << analytic[(size_t)worst]
         << ", numeric " << worst_num << " (" << worst_excess << "x the tolerance, rtol " << rtol
         << ")";
}

// sum_i a[i] * b[i]: the scalar loss whose gradient w.r.t. an output is the weight vector b.
inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// --- tolerance comparison ----------------------------------------------------------------------

// Every element: |got - want| <= tol[i] (NaN never passes unless both are NaN with nan_ok).
// Reports the count of failures and the worst one with its index.
inline ::testing::AssertionResult all_close(const std::vector<double>& got,
                                            const std::vector<double>& want,
                                            const std::function<double(int64_t)>& tol,
                                            const std::string& what, bool nan_ok = false) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << what << ": " << got.size() << " values, expected "
                                         << want.size();
  int64_t bad = 0, worst = -1;
  double worst_ratio = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], w = want[i];
    if (nan_ok && std::isnan(g) && std::isnan(w)) continue;
    if (std::isinf(w) && g == w) continue;
    const double t = tol((int64_t)i);
    const double err = std::fabs(g - w);
    if (!(err <= t)) {
      ++bad;
      const double ratio = std::isnan(err) ? 1e300 : err / t;
      if (ratio > worst_ratio) {
        worst_ratio = ratio;
        worst = (int64_t)i;
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  std::ostringstream os;
  os.precision(9);
  os << what << ": " << bad << " of " << got.size() << " elements outside the tolerance; worst at "
     << "flat index " << worst << ": got " << got[(size_t)worst] << ", want " << want[(size_t)worst]
     << ", |diff| " << std::fabs(got[(size_t)worst] - want[(size_t)worst]) << " > tol "
     << tol(worst);
  return ::testing::AssertionFailure() << os.str();
}

// --- guarded device outputs ----------------------------------------------------------------------

constexpr int64_t kGuardBytes = 256;  // on each side of every device output

// A device allocation with guard bytes around the usable region (see tests/test_quant_cuda.cpp),
// filled with a poison byte so that unwritten output elements and out-of-bounds writes show.
struct Guarded {
  std::shared_ptr<void> storage;
  int64_t bytes = 0;
  TensorView view;
  uint8_t poison_byte = 0;

  // `offset_bytes` shifts the usable region (e.g. 2 for a misaligned bf16 tensor).
  static Guarded make(Shape shape, DType dtype, uint8_t poison, int64_t offset_bytes = 0) {
    Guarded g;
    g.bytes = dtype_bytes(dtype, shape.numel());
    g.poison_byte = poison;
    g.storage = allocate_bytes(g.bytes + 2 * kGuardBytes + offset_bytes, Device::kCuda);
    g.view = TensorView::contiguous(static_cast<char*>(g.storage.get()) + kGuardBytes + offset_bytes,
                                    dtype, shape, Device::kCuda);
    device_memset(g.storage.get(), poison, g.bytes + 2 * kGuardBytes + offset_bytes);
    return g;
  }
  // A guarded device copy of a host tensor (for inputs that are also written: in-place ops).
  static Guarded copy_of(const Tensor& host, uint8_t poison, int64_t offset_bytes = 0) {
    Guarded g = make(host.shape(), host.dtype(), poison, offset_bytes);
    copy_tensor(g.view, host.view());
    return g;
  }
  // Number of guard bytes (both sides) that no longer hold the poison byte.
  int64_t damaged_guard_bytes() const {
    const int64_t offset = static_cast<char*>(view.data) - static_cast<char*>(storage.get());
    const int64_t total = bytes + kGuardBytes + offset;
    std::vector<uint8_t> h((size_t)total);
    device_memcpy(h.data(), Device::kCpu, storage.get(), Device::kCuda, total);
    int64_t bad = 0;
    for (int64_t i = 0; i < offset; ++i) bad += h[(size_t)i] != poison_byte;
    for (int64_t i = offset + bytes; i < total; ++i) bad += h[(size_t)i] != poison_byte;
    return bad;
  }
  std::vector<double> values() const { return values_of(view); }
};

}  // namespace fourbit::ops::testing
