// ops rmsnorm (cpu): the reference against hand-computed values, float64 central differences for
// dx and dweight, accumulate/overwrite semantics, edge cases (zeros, large and tiny magnitudes,
// one token, one column) and argument errors.
#include "dense_ops_test_util.h"
#include "ops/elementwise.h"
#include "ops/rmsnorm.h"

#include <gtest/gtest.h>

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

struct Forward {
  std::vector<double> y, rstd;
};

Forward forward(const std::vector<double>& x, const std::vector<double>& w, int64_t N, int64_t C,
                double eps, DType dt = DType::kF64) {
  const Tensor tx = host_tensor({N, C}, dt, x), tw = host_tensor({C}, dt, w);
  Tensor y = Tensor::empty({N, C}, dt, Device::kCpu), r = Tensor::empty({N}, dt, Device::kCpu);
  rmsnorm_forward(y, r, tx, tw, (float)eps);
  return {values_of(y), values_of(r)};
}

TEST(OpsRmsnorm, HandComputed) {
  for (DType dt : {DType::kF32, DType::kF64}) {
    SCOPED_TRACE(dtype_name(dt));
    // Row 0: mean(9, 16) = 12.5. Row 1: zeros -> rstd = 1/sqrt(eps), y = 0.
    const Tensor x = host_tensor({2, 2}, dt, {3, 4, 0, 0});
    const Tensor w = host_tensor({2}, dt, {1, -2});
    Tensor y = Tensor::empty({2, 2}, dt, Device::kCpu), r = Tensor::empty({2}, dt, Device::kCpu);
    rmsnorm_forward(y, r, x, w, 0.25f);
    const double r0 = 1 / std::sqrt(12.75), r1 = 1 / std::sqrt(0.25);
    const double tol = dt == DType::kF32 ? 1e-6 : 1e-15;
    const std::vector<double> yv = values_of(y), rv = values_of(r);
    EXPECT_NEAR(rv[0], r0, tol);
    EXPECT_NEAR(rv[1], r1, tol);
    EXPECT_NEAR(yv[0], 3 * r0, tol);
    EXPECT_NEAR(yv[1], -8 * r0, tol);
    EXPECT_EQ(yv[2], 0);
    EXPECT_EQ(yv[3], 0);
  }
}

TEST(OpsRmsnorm, ScaleInvarianceAndMagnitudes) {
  // With eps = 0, y(s x) = y(x) for any s > 0, from tiny to large magnitudes (in f32 too: the sum
  // of squares of 1e-15 and 1e15 values stays within the normal range).
  const int64_t N = 3, C = 7;
  const std::vector<double> x = random_normal(N * C, 11), w = random_normal(C, 12);
  const Forward base = forward(x, w, N, C, 0.0);
  for (double s : {1e-15, 1e-3, 1e3, 1e15})
    for (DType dt : {DType::kF32, DType::kF64}) {
      std::vector<double> xs(x);
      for (double& v : xs) v *= s;
      const Forward f = forward(xs, w, N, C, 0.0, dt);
      for (size_t i = 0; i < x.size(); ++i)
        EXPECT_NEAR(f.y[i], base.y[i], (dt == DType::kF32 ? 2e-6 : 1e-13) * (1 + std::fabs(base.y[i])))
            << "scale " << s << " " << dtype_name(dt) << " element " << i;
    }
}

TEST(OpsRmsnorm, FiniteDifferencesFloat64) {
  struct Case {
    int64_t N, C;
    double eps;
  };
  for (const Case cs : {Case{3, 5, 1e-5}, Case{1, 1, 1e-3}, Case{2, 16, 0.0}, Case{4, 3, 0.5}}) {
    SCOPED_TRACE(::testing::Message() << "N " << cs.N << " C " << cs.C << " eps " << cs.eps);
    const int64_t N = cs.N, C = cs.C;
    std::vector<double> x = random_normal(N * C, 1 + C), w = random_normal(C, 2 + C);
    const std::vector<double> R = random_normal(N * C, 3 + C);  // loss = sum(y * R)
    auto loss = [&] { return dot(forward(x, w, N, C, cs.eps).y, R); };

    const Tensor tx = host_tensor({N, C}, DType::kF64, x), tw = host_tensor({C}, DType::kF64, w);
    Tensor y = Tensor::empty({N, C}, DType::kF64, Device::kCpu), r = Tensor::empty({N}, DType::kF64, Device::kCpu);
    rmsnorm_forward(y, r, tx, tw, (float)cs.eps);
    Tensor dx = host_tensor({N, C}, DType::kF64, std::vector<double>((size_t)(N * C), 1e9));  // overwritten
    const std::vector<double> dw0 = random_normal(C, 4);  // accumulated into
    Tensor dw = host_tensor({C}, DType::kF64, dw0);
    rmsnorm_backward(dx, dw, host_tensor({N, C}, DType::kF64, R), tx, tw, r, TensorView{});
    std::vector<double> dwv = values_of(dw);
    for (int64_t c = 0; c < C; ++c) dwv[(size_t)c] -= dw0[(size_t)c];
    EXPECT_TRUE(check_gradient(loss, x.data(), N * C, values_of(dx), "dx"));
    EXPECT_TRUE(check_gradient(loss, w.data(), C, dwv, "dweight"));
  }
}

TEST(OpsRmsnorm, BackwardFloat32MatchesFloat64) {
  const int64_t N = 5, C = 33;
  const std::vector<double> x = random_normal(N * C, 5), w = random_normal(C, 6), R = random_normal(N * C, 7);
  std::vector<std::vector<double>> dxs, dws;
  for (DType dt : {DType::kF32, DType::kF64}) {
    const Tensor tx = host_tensor({N, C}, dt, x), tw = host_tensor({C}, dt, w);
    Tensor y = Tensor::empty({N, C}, dt, Device::kCpu), r = Tensor::empty({N}, dt, Device::kCpu);
    rmsnorm_forward(y, r, tx, tw, 1e-5f);
    Tensor dx = Tensor::empty({N, C}, dt, Device::kCpu), dw = Tensor::zeros({C}, dt, Device::kCpu);
    rmsnorm_backward(dx, dw, host_tensor({N, C}, dt, R), tx, tw, r, TensorView{});
    dxs.push_back(values_of(dx));
    dws.push_back(values_of(dw));
  }
  for (size_t i = 0; i < dxs[0].size(); ++i) EXPECT_NEAR(dxs[0][i], dxs[1][i], 1e-5 * (1 + std::fabs(dxs[1][i])));
  for (size_t i = 0; i < dws[0].size(); ++i) EXPECT_NEAR(dws[0][i], dws[1][i], 1e-5 * (1 + std::fabs(dws[1][i])));
}

// rmsnorm_backward_accumulate adds the input gradient to dx_accum: equal to the backward into a
// temporary plus add_inplace, bit for bit, in f32 and f64; dweight as the backward's.
// Random x, weight and dy of [N, C] in dtype dt, the forward's rstd, and the plain backward of dy
// into a temporary (tmp, dw_sep from zero): the separate side of the accumulate tests.
struct SeparateBackward {
  Tensor tx, tw, tdy, r, tmp, dw_sep;
  SeparateBackward(int64_t N, int64_t C, DType dt, uint64_t seed)
      : tx(host_tensor({N, C}, dt, random_normal(N * C, seed))),
        tw(host_tensor({C}, dt, random_normal(C, seed + 1))),
        tdy(host_tensor({N, C}, dt, random_normal(N * C, seed + 2))),
        r(Tensor::empty({N}, dt, Device::kCpu)),
        tmp(Tensor::empty({N, C}, dt, Device::kCpu)),
        dw_sep(Tensor::zeros({C}, dt, Device::kCpu)) {
    Tensor y = Tensor::empty({N, C}, dt, Device::kCpu);
    rmsnorm_forward(y, r, tx, tw, 1e-5f);
    rmsnorm_backward(tmp, dw_sep, tdy, tx, tw, r, TensorView{});
  }
};

TEST(OpsRmsnorm, AccumulateEqualsBackwardPlusAdd) {
  const int64_t N = 6, C = 40;
  const std::vector<double> prior = random_normal(N * C, 14);
  for (DType dt : {DType::kF32, DType::kF64}) {
    const SeparateBackward s(N, C, dt, 11);
    Tensor sum = host_tensor({N, C}, dt, prior);
    add_inplace(sum, s.tmp);
    Tensor acc = host_tensor({N, C}, dt, prior), dw_acc = Tensor::zeros({C}, dt, Device::kCpu);
    rmsnorm_backward_accumulate(acc, dw_acc, s.tdy, s.tx, s.tw, s.r, TensorView{});
    const Tensor& dw_sep = s.dw_sep;
    EXPECT_EQ(values_of(acc), values_of(sum)) << dtype_name(dt);
    EXPECT_EQ(values_of(dw_acc), values_of(dw_sep)) << dtype_name(dt);
    EXPECT_NE(values_of(acc), prior);  // it did add something
  }
}

// With OutputAmaxes, the accumulated dx is unchanged and the amaxes are those add_inplace
// computes for the same sum (the NVFP4 consumer's global amax and RHT amax).
TEST(OpsRmsnorm, AccumulateWithAmaxesEqualsTheAddsAmaxes) {
  const int64_t N = 32, C = 24;
  const std::vector<double> prior = random_normal(N * C, 24);
  const DType dt = DType::kF32;
  const SeparateBackward s(N, C, dt, 21);
  const Tensor &tx = s.tx, &tw = s.tw, &tdy = s.tdy, &r = s.r, &tmp = s.tmp;
  Tensor sum = host_tensor({N, C}, dt, prior);
  float want[2] = {0.0f, 0.0f}, got[2] = {0.0f, 0.0f};
  OutputAmaxes o_want, o_got;
  o_want.amax = &want[0];
  o_want.rht_amax = &want[1];
  o_got.amax = &got[0];
  o_got.rht_amax = &got[1];
  o_want.rht_sign_mask = o_got.rht_sign_mask = 0x2D5B;
  add_inplace(sum, tmp, nullptr, &o_want);
  Tensor acc = host_tensor({N, C}, dt, prior), dw_acc = Tensor::zeros({C}, dt, Device::kCpu);
  rmsnorm_backward_accumulate(acc, dw_acc, tdy, tx, tw, r, TensorView{}, nullptr, &o_got);
  EXPECT_EQ(values_of(acc), values_of(sum));
  EXPECT_EQ(got[0], want[0]);
  EXPECT_EQ(got[1], want[1]);
  EXPECT_GT(got[0], 0.0f);
  EXPECT_GT(got[1], 0.0f);
  // The RHT amax needs whole 16-row segments.
  const Tensor x20 = host_tensor({20, C}, dt, random_normal(20 * C, 25)), dy20 = host_tensor({20, C}, dt, random_normal(20 * C, 26));
  Tensor r20 = Tensor::empty({20}, dt, Device::kCpu), y20 = Tensor::empty({20, C}, dt, Device::kCpu);
  rmsnorm_forward(y20, r20, x20, tw, 1e-5f);
  Tensor acc20 = Tensor::zeros({20, C}, dt, Device::kCpu);
  EXPECT_THROW(rmsnorm_backward_accumulate(acc20, dw_acc, dy20, x20, tw, r20, TensorView{}, nullptr, &o_got), Error);
}

TEST(OpsRmsnorm, Errors) {
  const Tensor x = host_tensor({2, 3}, DType::kF32, std::vector<double>(6, 1.0));
  const Tensor w = host_tensor({3}, DType::kF32, {1, 1, 1});
  const Tensor w64 = host_tensor({3}, DType::kF64, {1, 1, 1});
  Tensor y = Tensor::empty({2, 3}, DType::kF32, Device::kCpu), r = Tensor::empty({2}, DType::kF32, Device::kCpu);
  EXPECT_NE(error_of([&] { rmsnorm_forward(y, r, x, w64, 1e-5f); }).find("one dtype"), std::string::npos);
  Tensor r3 = Tensor::empty({3}, DType::kF32, Device::kCpu);
  EXPECT_NE(error_of([&] { rmsnorm_forward(y, r3, x, w, 1e-5f); }).find("rstd must have shape (2)"), std::string::npos);
  EXPECT_NE(error_of([&] { rmsnorm_forward(x, r, x, w, 1e-5f); }).find("alias"), std::string::npos);
  EXPECT_NE(error_of([&] { rmsnorm_forward(y, r, x, w, -1.0f); }).find("eps"), std::string::npos);
  const Tensor x3 = host_tensor({1, 2, 3}, DType::kF32, std::vector<double>(6, 1.0));
  EXPECT_NE(error_of([&] { rmsnorm_forward(y, r, x3, w, 1e-5f); }).find("[N, C]"), std::string::npos);
  // Zero tokens: a no-op (dweight unchanged).
  Tensor e = Tensor::empty({0, 3}, DType::kF32, Device::kCpu), er = Tensor::empty({0}, DType::kF32, Device::kCpu);
  rmsnorm_forward(e, er, Tensor::empty({0, 3}, DType::kF32, Device::kCpu), w, 1e-5f);
  Tensor dw = host_tensor({3}, DType::kF32, {1, 2, 3});
  rmsnorm_backward(e, dw, Tensor::empty({0, 3}, DType::kF32, Device::kCpu),
                   Tensor::empty({0, 3}, DType::kF32, Device::kCpu), w, er, TensorView{});
  EXPECT_EQ(values_of(dw), (std::vector<double>{1, 2, 3}));
}

}  // namespace
}  // namespace fourbit::ops
