// ops cross_entropy (cpu): the reference against hand-computed losses and gradients, ignored
// tokens (-1) and the mean over valid tokens, float64 central differences of the mean loss and of
// a weighted sum of losses w.r.t. the logits, the fused in-place variant against forward +
// backward, the backward from the forward's saved lse against the fused variant, numerical stability at large magnitudes, and argument errors (including an
// out-of-range target naming the token).
#include "dense_ops_test_util.h"
#include "ops/cross_entropy.h"

#include <gtest/gtest.h>

namespace fourbit::ops {
namespace {

using testing::check_gradient;
using testing::host_ints;
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

struct Result {
  std::vector<double> losses;
  double mean;
};

Result forward(const std::vector<double>& logits, const std::vector<int32_t>& targets, int64_t V,
               DType dt = DType::kF64) {
  const int64_t N = (int64_t)targets.size();
  Tensor losses = Tensor::empty({N}, dt, Device::kCpu), mean = Tensor::empty({1}, dt, Device::kCpu);
  cross_entropy_forward(losses, mean, host_tensor({N, V}, dt, logits), host_ints({N}, targets));
  return {values_of(losses), values_of(mean)[0]};
}

std::vector<double> backward(const std::vector<double>& logits, const std::vector<int32_t>& targets,
                             int64_t V, double scale, DType dt = DType::kF64) {
  const int64_t N = (int64_t)targets.size();
  Tensor d = host_tensor({N, V}, dt, std::vector<double>((size_t)(N * V), 1e9));
  cross_entropy_backward(d, host_tensor({N, V}, dt, logits), host_ints({N}, targets), (float)scale);
  return values_of(d);
}

TEST(OpsCrossEntropy, HandComputed) {
  // logits (1, 2, 3), target 2: lse = 3 + log(1 + e^-1 + e^-2); softmax = exp(x - lse).
  const double lse = 3 + std::log(1 + std::exp(-1.0) + std::exp(-2.0));
  for (DType dt : {DType::kF32, DType::kF64}) {
    SCOPED_TRACE(dtype_name(dt));
    const double tol = dt == DType::kF32 ? 1e-6 : 1e-14;
    const Result r = forward({1, 2, 3, 5, 5, 5}, {2, 0}, 3, dt);
    EXPECT_NEAR(r.losses[0], lse - 3, tol);
    EXPECT_NEAR(r.losses[1], std::log(3.0), tol);  // uniform logits: log V
    EXPECT_NEAR(r.mean, (lse - 3 + std::log(3.0)) / 2, tol);
    const std::vector<double> d = backward({1, 2, 3, 5, 5, 5}, {2, 0}, 3, 0.5, dt);
    EXPECT_NEAR(d[0], 0.5 * std::exp(1 - lse), tol);
    EXPECT_NEAR(d[1], 0.5 * std::exp(2 - lse), tol);
    EXPECT_NEAR(d[2], 0.5 * (std::exp(3 - lse) - 1), tol);
    EXPECT_NEAR(d[3], 0.5 * (1.0 / 3 - 1), tol);
    EXPECT_NEAR(d[4], 0.5 / 3, tol);
  }
}

TEST(OpsCrossEntropy, IgnoredTokens) {
  const std::vector<double> logits = random_normal(4 * 5, 1);
  const Result r = forward(logits, {-1, 3, -1, 0}, 5);
  EXPECT_EQ(r.losses[0], 0.0);
  EXPECT_EQ(r.losses[2], 0.0);
  EXPECT_NEAR(r.mean, (r.losses[1] + r.losses[3]) / 2, 1e-15);
  const std::vector<double> d = backward(logits, {-1, 3, -1, 0}, 5, 1.0);
  for (int v = 0; v < 5; ++v) {
    EXPECT_EQ(d[(size_t)v], 0.0);
    EXPECT_EQ(d[(size_t)(10 + v)], 0.0);
  }
  // Every token ignored: the mean is 0, not NaN.
  EXPECT_EQ(forward(logits, {-1, -1, -1, -1}, 5).mean, 0.0);
}

TEST(OpsCrossEntropy, FiniteDifferencesFloat64) {
  const int64_t V = 7;
  const std::vector<int32_t> targets = {3, -1, 0, 6};
  const int64_t N = (int64_t)targets.size();
  std::vector<double> logits = random_normal(N * V, 2, 3.0);
  // The mean loss: its gradient is the backward with dloss_scale = 1 / n_valid.
  auto mean = [&] { return forward(logits, targets, V).mean; };
  EXPECT_TRUE(check_gradient(mean, logits.data(), N * V, backward(logits, targets, V, 1.0 / 3), "dlogits (mean)"));
  // A scaled sum (gradient accumulation: scale = 1 / total tokens of all micro-batches).
  auto total = [&] {
    const Result r = forward(logits, targets, V);
    return 0.125 * (r.losses[0] + r.losses[1] + r.losses[2] + r.losses[3]);
  };
  EXPECT_TRUE(check_gradient(total, logits.data(), N * V, backward(logits, targets, V, 0.125), "dlogits (sum)"));
}

TEST(OpsCrossEntropy, FusedInplaceEqualsForwardPlusBackward) {
  const int64_t V = 11;
  const std::vector<int32_t> targets = {10, -1, 0, 4, 4};
  const int64_t N = (int64_t)targets.size();
  const std::vector<double> logits = random_normal(N * V, 3, 2.0);
  for (DType dt : {DType::kF32, DType::kF64}) {
    const Result r = forward(logits, targets, V, dt);
    const std::vector<double> d = backward(logits, targets, V, 0.25, dt);
    Tensor buf = host_tensor({N, V}, dt, logits);
    Tensor losses = Tensor::empty({N}, dt, Device::kCpu), mean = Tensor::empty({1}, dt, Device::kCpu);
    cross_entropy_forward_backward_inplace(buf, losses, mean, host_ints({N}, targets), 0.25f);
    EXPECT_EQ(values_of(buf), d) << dtype_name(dt);
    EXPECT_EQ(values_of(losses), r.losses) << dtype_name(dt);
    EXPECT_EQ(values_of(mean)[0], r.mean) << dtype_name(dt);
  }
}

// Training's pair: the forward keeps each row's lse and the backward reads the row once from it.
// Losses, mean and dlogits (unweighted and weighted) equal the fused in-place variant's exactly;
// an ignored token's lse is 0.
TEST(OpsCrossEntropy, BackwardFromSavedLseEqualsTheFusedInplaceVariant) {
  const int64_t V = 13;
  const std::vector<int32_t> targets = {12, -1, 0, 5, 5, 3};
  const int64_t N = (int64_t)targets.size();
  const std::vector<double> logits = random_normal(N * V, 9, 3.0);
  const std::vector<double> weights = {0.5, 2.0, -1.5, 0.0, 1.0, 3.0};
  for (DType dt : {DType::kF32, DType::kF64}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor fused = host_tensor({N, V}, dt, logits), fused_w = host_tensor({N, V}, dt, logits);
    Tensor fl = Tensor::empty({N}, dt, Device::kCpu), fm = Tensor::empty({1}, dt, Device::kCpu);
    cross_entropy_forward_backward_inplace(fused, fl, fm, host_ints({N}, targets), 0.25f);
    Tensor fl_w = Tensor::empty({N}, dt, Device::kCpu);
    cross_entropy_forward_backward_inplace_weighted(fused_w, fl_w, TensorView{}, host_ints({N}, targets),
                                                    host_tensor({N}, dt, weights), 0.25f);

    Tensor buf = host_tensor({N, V}, dt, logits), buf_w = host_tensor({N, V}, dt, logits);
    Tensor losses = Tensor::empty({N}, dt, Device::kCpu), mean = Tensor::empty({1}, dt, Device::kCpu);
    Tensor lse = host_tensor({N}, dt, std::vector<double>((size_t)N, 1e9));
    cross_entropy_forward_saving_lse(losses, mean, lse, buf, host_ints({N}, targets));
    EXPECT_EQ(values_of(losses), values_of(fl));
    EXPECT_EQ(values_of(mean)[0], values_of(fm)[0]);
    EXPECT_EQ(values_of(lse)[1], 0.0) << "an ignored token's lse";
    // lse - x_target is the loss.
    for (int64_t n = 0; n < N; ++n) {
      if (targets[(size_t)n] == -1) continue;
      EXPECT_NEAR(values_of(lse)[(size_t)n] - logits[(size_t)(n * V + targets[(size_t)n])],
                  values_of(losses)[(size_t)n], 1e-5);
    }
    cross_entropy_backward_inplace_from_lse(buf, lse, host_ints({N}, targets), 0.25f);
    EXPECT_EQ(values_of(buf), values_of(fused)) << "unweighted dlogits";
    cross_entropy_backward_inplace_from_lse(buf_w, lse, host_ints({N}, targets), 0.25f,
                                            host_tensor({N}, dt, weights));
    EXPECT_EQ(values_of(buf_w), values_of(fused_w)) << "weighted dlogits";
  }
  // Argument errors name the tensor.
  Tensor buf = host_tensor({N, V}, DType::kF32, logits);
  const std::string e1 = error_of([&] {
    cross_entropy_backward_inplace_from_lse(buf, Tensor::empty({N + 1}, DType::kF32, Device::kCpu),
                                            host_ints({N}, targets), 1.0f);
  });
  EXPECT_NE(e1.find("lse"), std::string::npos) << e1;
  const std::string e2 = error_of([&] {
    cross_entropy_backward_inplace_from_lse(buf, TensorView{}, host_ints({N}, targets), 1.0f);
  });
  EXPECT_NE(e2.find("lse"), std::string::npos) << e2;
}

// Per-row weights (the RL loss sum_n w_n losses[n]): float64 central differences of that weighted
// sum, with negative, zero and ignored rows; the losses stay unweighted.
TEST(OpsCrossEntropy, WeightedRowsFiniteDifferencesFloat64) {
  const int64_t V = 6;
  const std::vector<int32_t> targets = {2, -1, 5, 0, 3};
  const int64_t N = (int64_t)targets.size();
  const std::vector<double> w = {0.75, 3.0, -1.25, 0.0, 0.5};
  std::vector<double> logits = random_normal(N * V, 4, 2.0);
  auto objective = [&] {
    const Result r = forward(logits, targets, V);
    double s = 0;
    for (int64_t n = 0; n < N; ++n) s += w[(size_t)n] * r.losses[(size_t)n];
    return 0.5 * s;
  };
  for (DType dt : {DType::kF32, DType::kF64}) {
    const Result r = forward(logits, targets, V, dt);
    Tensor buf = host_tensor({N, V}, dt, logits);
    Tensor losses = Tensor::empty({N}, dt, Device::kCpu), mean = Tensor::empty({1}, dt, Device::kCpu);
    cross_entropy_forward_backward_inplace_weighted(buf, losses, mean, host_ints({N}, targets),
                                                    host_tensor({N}, dt, w), 0.5f);
    EXPECT_EQ(values_of(losses), r.losses) << dtype_name(dt);
    EXPECT_EQ(values_of(mean)[0], r.mean) << dtype_name(dt);
    const std::vector<double> d = values_of(buf);
    for (int64_t v = 0; v < V; ++v) {
      EXPECT_EQ(d[(size_t)(V + v)], 0.0) << "an ignored row gets no gradient whatever its weight";
      EXPECT_EQ(d[(size_t)(3 * V + v)], 0.0) << "a zero weight gives a zero row";
    }
    if (dt == DType::kF64) {
      EXPECT_TRUE(check_gradient(objective, logits.data(), N * V, d, "dlogits (weighted)"));
    } else {  // f32 equals f64 to rounding
      const std::vector<double> d64 = [&] {
        Tensor b = host_tensor({N, V}, DType::kF64, logits);
        Tensor l = Tensor::empty({N}, DType::kF64, Device::kCpu);
        cross_entropy_forward_backward_inplace_weighted(b, l, TensorView{}, host_ints({N}, targets),
                                                        host_tensor({N}, DType::kF64, w), 0.5f);
        return values_of(b);
      }();
      for (size_t i = 0; i < d.size(); ++i) EXPECT_NEAR(d[i], d64[i], 1e-6);
    }
  }
  // Errors: wrong length, wrong dtype.
  Tensor buf = host_tensor({N, V}, DType::kF32, logits);
  Tensor losses = Tensor::empty({N}, DType::kF32, Device::kCpu);
  EXPECT_NE(error_of([&] {
              cross_entropy_forward_backward_inplace_weighted(buf, losses, TensorView{}, host_ints({N}, targets),
                                                              host_tensor({N - 1}, DType::kF32, {1, 1, 1, 1}), 1.0f);
            }).find("row_weights"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              cross_entropy_forward_backward_inplace_weighted(buf, losses, TensorView{}, host_ints({N}, targets),
                                                              host_tensor({N}, DType::kF64, w), 1.0f);
            }).find("row_weights"),
            std::string::npos);
}

TEST(OpsCrossEntropy, LargeMagnitudesAreStable) {
  // exp(1e4) overflows any float: the max-subtracted softmax never evaluates it.
  for (DType dt : {DType::kF32, DType::kF64}) {
    SCOPED_TRACE(dtype_name(dt));
    const Result r = forward({1e4, 1e4 - 1, -1e4, 1000, 0, -1000}, {1, 1}, 3, dt);
    // In f32, lse ~ 1e4 carries an ulp of 2^-10: the loss is good to ~1e-3 there.
    EXPECT_NEAR(r.losses[0], 1 + std::log1p(std::exp(-1.0)), dt == DType::kF32 ? 2e-3 : 1e-9);
    EXPECT_NEAR(r.losses[1], 1000, 1e-3);
    const std::vector<double> d = backward({1e4, 1e4 - 1, -1e4, 1000, 0, -1000}, {1, 1}, 3, 1.0, dt);
    for (double v : d) EXPECT_TRUE(std::isfinite(v));
    EXPECT_NEAR(d[4], -1.0, 1e-6);
    EXPECT_EQ(d[2], 0.0);
  }
}

TEST(OpsCrossEntropy, SingleTokenAndSingleClass) {
  const Result r = forward({42}, {0}, 1);  // V = 1: probability 1, loss 0
  EXPECT_EQ(r.losses[0], 0.0);
  EXPECT_EQ(backward({42}, {0}, 1, 1.0)[0], 0.0);
}

TEST(OpsCrossEntropy, Errors) {
  const Tensor logits = host_tensor({2, 3}, DType::kF32, std::vector<double>(6, 0.0));
  Tensor losses = Tensor::empty({2}, DType::kF32, Device::kCpu);
  const std::string bad = error_of([&] { cross_entropy_forward(losses, TensorView{}, logits, host_ints({2}, {0, 3})); });
  EXPECT_NE(bad.find("targets[1] = 3 is outside [0, V = 3)"), std::string::npos) << bad;
  EXPECT_NE(error_of([&] { cross_entropy_forward(losses, TensorView{}, logits, host_ints({2}, {0, -2})); }).find("targets[1] = -2"), std::string::npos);
  EXPECT_NE(error_of([&] { cross_entropy_forward(losses, TensorView{}, logits, host_ints({3}, {0, 0, 0})); }).find("targets must have shape (2)"), std::string::npos);
  Tensor losses64 = Tensor::empty({2}, DType::kF64, Device::kCpu);
  EXPECT_NE(error_of([&] { cross_entropy_forward(losses64, TensorView{}, logits, host_ints({2}, {0, 0})); }).find("one dtype"), std::string::npos);
  EXPECT_NE(error_of([&] { cross_entropy_backward(logits, logits, host_ints({2}, {0, 0}), 1.0f); }).find("cross_entropy_forward_backward_inplace"), std::string::npos);
  Tensor d = Tensor::empty({2, 3}, DType::kF32, Device::kCpu);
  EXPECT_NE(error_of([&] { cross_entropy_backward(d, logits, host_ints({2}, {0, 0}), NAN); }).find("dloss_scale"), std::string::npos);
}

}  // namespace
}  // namespace fourbit::ops
