// ops swiglu (cpu): the reference against hand-computed values, float64 central differences for
// d_gate_up, the in-place backward against the out-of-place one, large magnitudes and errors.
#include "dense_ops_test_util.h"
#include "ops/swiglu.h"
#include "quant/quantize.h"

#include <gtest/gtest.h>

#include <tuple>
#include <utility>

namespace fourbit::ops {
namespace {

using testing::check_gradient;
using testing::dot;
using testing::host_tensor;
using testing::random_normal;
using testing::values_of;

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::vector<double> forward(const std::vector<double>& gu, int64_t N, int64_t F, DType dt = DType::kF64) {
  Tensor out = Tensor::empty({N, F}, dt, Device::kCpu);
  swiglu_forward(out, host_tensor({N, 2 * F}, dt, gu));
  return values_of(out);
}

TEST(OpsSwiglu, HandComputed) {
  // Row: gate (0, 1, -1), up (5, 2, 3). sigmoid(1) = 0.7310585786300049.
  const double s1 = 0.7310585786300049;
  for (DType dt : {DType::kF32, DType::kF64}) {
    SCOPED_TRACE(dtype_name(dt));
    const double tol = dt == DType::kF32 ? 1e-6 : 1e-15;
    const std::vector<double> gu = {0, 1, -1, 5, 2, 3};
    const std::vector<double> out = forward(gu, 1, 3, dt);
    EXPECT_EQ(out[0], 0.0);
    EXPECT_NEAR(out[1], 1 * s1 * 2, tol);
    EXPECT_NEAR(out[2], -1 * (1 - s1) * 3, tol);

    // Backward with dout = (1, 1, 2): at g = 0, d_gate = dout * u / 2, d_up = 0.
    Tensor d = Tensor::empty({1, 6}, dt, Device::kCpu);
    swiglu_backward(d, host_tensor({1, 3}, dt, {1, 1, 2}), host_tensor({1, 6}, dt, gu));
    const std::vector<double> dv = values_of(d);
    EXPECT_NEAR(dv[0], 2.5, tol);
    EXPECT_NEAR(dv[1], 2 * s1 * (1 + (1 - s1)), tol);
    EXPECT_NEAR(dv[2], 2 * 3 * (1 - s1) * (1 - s1), tol);
    EXPECT_EQ(dv[3], 0.0);
    EXPECT_NEAR(dv[4], s1, tol);
    EXPECT_NEAR(dv[5], 2 * -(1 - s1), tol);
  }
}

TEST(OpsSwiglu, FiniteDifferencesFloat64) {
  for (auto [N, F] : {std::pair<int64_t, int64_t>{3, 4}, {1, 1}, {2, 9}}) {
    SCOPED_TRACE(::testing::Message() << "N " << N << " F " << F);
    std::vector<double> gu = random_normal(N * 2 * F, 10 + F, 3.0);
    const std::vector<double> R = random_normal(N * F, 20 + F);
    auto loss = [&] { return dot(forward(gu, N, F), R); };
    Tensor d = host_tensor({N, 2 * F}, DType::kF64, std::vector<double>((size_t)(N * 2 * F), 1e9));
    swiglu_backward(d, host_tensor({N, F}, DType::kF64, R), host_tensor({N, 2 * F}, DType::kF64, gu));
    EXPECT_TRUE(check_gradient(loss, gu.data(), N * 2 * F, values_of(d), "d_gate_up"));
  }
}

TEST(OpsSwiglu, InplaceEqualsOutOfPlace) {
  const int64_t N = 4, F = 13;
  for (DType dt : {DType::kF32, DType::kF64}) {
    const std::vector<double> gu = random_normal(N * 2 * F, 5, 2.0), R = random_normal(N * F, 6);
    Tensor d = Tensor::empty({N, 2 * F}, dt, Device::kCpu);
    swiglu_backward(d, host_tensor({N, F}, dt, R), host_tensor({N, 2 * F}, dt, gu));
    Tensor inplace = host_tensor({N, 2 * F}, dt, gu);
    swiglu_backward_inplace(inplace, host_tensor({N, F}, dt, R));
    EXPECT_EQ(values_of(inplace), values_of(d)) << dtype_name(dt);
  }
}

TEST(OpsSwiglu, LargeMagnitudes) {
  // exp(-g) overflows f32 for g < -88.7: sigmoid is then exactly 0 and nothing becomes NaN.
  const std::vector<double> gu = {100, -100, 1e4, -1e4, 2, 2, 2, 2};
  for (DType dt : {DType::kF32, DType::kF64}) {
    SCOPED_TRACE(dtype_name(dt));
    const std::vector<double> out = forward(gu, 1, 4, dt);
    EXPECT_NEAR(out[0], 200, 1e-4);
    EXPECT_NEAR(out[1], 0, 1e-30);
    EXPECT_NEAR(out[2], 2e4, 1e-2);
    EXPECT_EQ(out[3], 0);
    Tensor d = Tensor::empty({1, 8}, dt, Device::kCpu);
    swiglu_backward(d, host_tensor({1, 4}, dt, {1, 1, 1, 1}), host_tensor({1, 8}, dt, gu));
    for (double v : values_of(d)) EXPECT_TRUE(std::isfinite(v));
  }
}

TEST(OpsSwiglu, Errors) {
  const Tensor gu = host_tensor({2, 6}, DType::kF32, std::vector<double>(12, 1.0));
  Tensor out = Tensor::empty({2, 3}, DType::kF32, Device::kCpu);
  const Tensor odd = host_tensor({2, 5}, DType::kF32, std::vector<double>(10, 1.0));
  EXPECT_NE(error_of([&] { swiglu_forward(out, odd); }).find("[N, 2F]"), std::string::npos);
  Tensor out4 = Tensor::empty({2, 4}, DType::kF32, Device::kCpu);
  EXPECT_NE(error_of([&] { swiglu_forward(out4, gu); }).find("out must have shape (2, 3)"), std::string::npos);
  EXPECT_NE(error_of([&] { swiglu_backward(gu, out, gu); }).find("swiglu_backward_inplace"), std::string::npos);
  Tensor out64 = Tensor::empty({2, 3}, DType::kF64, Device::kCpu);
  EXPECT_NE(error_of([&] { swiglu_forward(out64, gu); }).find("one dtype"), std::string::npos);
}

// OutputAmaxes on the CPU: the amaxes of the output equal those the NVFP4 reference quantizer
// stores for it (row-wise: the plain amax; column-wise with RHT: the amax after the transform),
// for the forward and the in-place backward, and they accumulate (max) into what is there.
TEST(OpsSwiglu, OutputAmaxesEqualTheReferenceQuantizers) {
  const int64_t N = 32, F = 48;
  std::vector<double> gu = random_normal(N * 2 * F, 5, 3.0);
  gu[(size_t)(7 * 2 * F + F + 3)] = 40.0;  // an outlier in up
  const std::vector<double> dout = random_normal(N * F, 6);
  for (bool rht : {true, false}) {
    SCOPED_TRACE(rht ? "rht" : "no rht");
    quant::QuantConfig cfg;  // NVFP4 1x16
    cfg.rht = rht;
    auto reference_amaxes = [&](const Tensor& out) {
      const quant::QuantizedTensor q = quant::quantize_reference(out.view(), cfg, {true, true}, {"out", {}});
      return std::pair<float, float>{*q.rowwise->amax.ptr<float>(), *q.colwise->amax.ptr<float>()};
    };
    float amax[2] = {0.0f, 0.0f};
    OutputAmaxes a;
    a.amax = &amax[0];
    a.rht_amax = rht ? &amax[1] : nullptr;
    a.rht_sign_mask = cfg.rht_sign_mask();

    Tensor out = Tensor::empty({N, F}, DType::kF32, Device::kCpu);
    swiglu_forward(out, host_tensor({N, 2 * F}, DType::kF32, gu), nullptr, &a);
    auto [row, col] = reference_amaxes(out);
    EXPECT_EQ(amax[0], row);
    if (rht) {
      EXPECT_EQ(amax[1], col);
    }
    EXPECT_GT(amax[0], 10.0f);

    amax[0] = amax[1] = 0.0f;
    Tensor d = host_tensor({N, 2 * F}, DType::kF32, gu);
    swiglu_backward_inplace(d, host_tensor({N, F}, DType::kF32, dout), nullptr, &a);
    std::tie(row, col) = reference_amaxes(d);
    EXPECT_EQ(amax[0], row);
    if (rht) {
      EXPECT_EQ(amax[1], col);
    }

    // Accumulation: a larger value already there stays.
    amax[0] = 1e6f;
    swiglu_forward(out, host_tensor({N, 2 * F}, DType::kF32, gu), nullptr, &a);
    EXPECT_EQ(amax[0], 1e6f);
  }
  float amax = 0.0f;
  OutputAmaxes a;
  a.amax = &amax;
  float r = 0.0f;
  a.rht_amax = &r;
  Tensor out = Tensor::empty({20, 4}, DType::kF32, Device::kCpu);  // N % 16 != 0 with an RHT amax
  const std::string e = error_of([&] { swiglu_forward(out, host_tensor({20, 8}, DType::kF32, random_normal(160, 7)), nullptr, &a); });
  EXPECT_NE(e.find("N % 16"), std::string::npos) << e;
}

}  // namespace
}  // namespace fourbit::ops
