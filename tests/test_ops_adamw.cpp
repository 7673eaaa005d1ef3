// ops adamw (cpu): the AdamW reference against a hand-computed step and against an independent
// float64 implementation in PyTorch's formulation over several steps (decay, bias correction,
// gradient scale), the fused bf16 copy, the global gradient norm (hand values, empty list, NaN),
// the clipping factor, and argument errors. (AdamW has no backward: no finite differences.)
#include "dense_ops_test_util.h"
#include "ops/adamw.h"

#include <gtest/gtest.h>

#include <limits>

namespace fourbit::ops {
namespace {

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

TEST(OpsAdamW, HandComputedFirstStep) {
  // m = 0.1 * 0.5, v = 0.001 * 0.25; m_hat = 0.5, v_hat = 0.25: the step is lr * (0.5 / (0.5 +
  // eps) + wd * p) = 0.1 * (1 - 2e-8 + 0.1).
  for (DType dt : {DType::kF32, DType::kF64}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor p = host_tensor({1}, dt, {1.0}), g = host_tensor({1}, dt, {0.5});
    Tensor m = host_tensor({1}, dt, {0.0}), v = host_tensor({1}, dt, {0.0});
    AdamWParams a;
    a.lr = 0.1f;
    a.beta1 = 0.9f;
    a.beta2 = 0.999f;
    a.eps = 1e-8f;
    a.weight_decay = 0.1f;
    adamw_update(p, g, m, v, TensorView{}, a);
    // The f64 reference computes with the f32 hyperparameters' exact values.
    const double lr = a.lr, b1 = a.beta1, b2 = a.beta2, eps = a.eps, wd = a.weight_decay;
    const double tol = dt == DType::kF32 ? 4 * std::ldexp(1.0, -24) : 1e-15;
    EXPECT_NEAR(values_of(p)[0], 1 - lr * (0.5 / (0.5 + eps) + wd), tol);
    EXPECT_NEAR(values_of(m)[0], (1 - b1) * 0.5, tol * 0.05);
    EXPECT_NEAR(values_of(v)[0], (1 - b2) * 0.25, tol * 0.00025);
  }
}

// Independent float64 AdamW in torch.optim.AdamW's formulation (decay first, then the addcdiv
// with step_size = lr / bc1 and denom = sqrt(v) / sqrt(bc2) + eps).
void torch_adamw(std::vector<double>& p, const std::vector<double>& g, std::vector<double>& m,
                 std::vector<double>& v, const AdamWParams& a) {
  const double lr = a.lr, b1 = a.beta1, b2 = a.beta2, eps = a.eps, wd = a.weight_decay;
  const double bc1 = 1 - std::pow(b1, (double)a.step), bc2 = 1 - std::pow(b2, (double)a.step);
  for (size_t i = 0; i < p.size(); ++i) {
    const double gs = g[i] * (double)a.grad_scale;
    p[i] *= 1 - lr * wd;
    m[i] = b1 * m[i] + (1 - b1) * gs;
    v[i] = b2 * v[i] + (1 - b2) * gs * gs;
    p[i] -= lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + eps);
  }
}

TEST(OpsAdamW, MatchesTorchFormulationOverSteps) {
  const int64_t n = 37;
  std::vector<double> p = random_normal(n, 1), m(n, 0.0), v(n, 0.0);
  Tensor tp = host_tensor({n}, DType::kF64, p), tm = Tensor::zeros({n}, DType::kF64, Device::kCpu),
         tv = Tensor::zeros({n}, DType::kF64, Device::kCpu);
  AdamWParams a;
  a.lr = 1e-2f;
  a.weight_decay = 0.05f;
  for (int64_t step = 1; step <= 5; ++step) {
    a.step = step;
    a.grad_scale = step == 3 ? 0.25f : 1.0f;
    const std::vector<double> g = random_normal(n, 10 + step, step == 4 ? 1e-6 : 1.0);
    torch_adamw(p, g, m, v, a);
    adamw_update(tp, host_tensor({n}, DType::kF64, g), tm, tv, TensorView{}, a);
  }
  const std::vector<double> gp = values_of(tp), gm = values_of(tm), gv = values_of(tv);
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_NEAR(gp[(size_t)i], p[(size_t)i], 1e-12 * (1 + std::fabs(p[(size_t)i]))) << i;
    EXPECT_NEAR(gm[(size_t)i], m[(size_t)i], 1e-14) << i;
    EXPECT_NEAR(gv[(size_t)i], v[(size_t)i], 1e-14) << i;
  }
}

TEST(OpsAdamW, GradScaleAndFusedBf16Copy) {
  const int64_t n = 20;
  const std::vector<double> p0 = random_normal(n, 3), g = random_normal(n, 4);
  std::vector<double> g2(g);
  for (double& x : g2) x *= 0.5;
  AdamWParams a;
  a.step = 7;
  a.weight_decay = 0.1f;
  Tensor p1 = host_tensor({n}, DType::kF32, p0), m1 = Tensor::zeros({n}, DType::kF32, Device::kCpu), v1 = Tensor::zeros({n}, DType::kF32, Device::kCpu);
  Tensor pb = Tensor::empty({n}, DType::kBF16, Device::kCpu);
  a.grad_scale = 0.5f;
  adamw_update(p1, host_tensor({n}, DType::kF32, g), m1, v1, pb, a);
  Tensor p2 = host_tensor({n}, DType::kF32, p0), m2 = Tensor::zeros({n}, DType::kF32, Device::kCpu), v2 = Tensor::zeros({n}, DType::kF32, Device::kCpu);
  a.grad_scale = 1.0f;
  adamw_update(p2, host_tensor({n}, DType::kF32, g2), m2, v2, TensorView{}, a);
  EXPECT_EQ(values_of(p1), values_of(p2));  // g * 0.5 is exact in f32: identical updates
  for (int64_t i = 0; i < n; ++i)
    EXPECT_EQ(pb.ptr<uint16_t>()[i], formats::encode_bf16_rn(p1.ptr<float>()[i])) << i;
}

TEST(OpsAdamW, GlobalGradNorm) {
  for (DType dt : {DType::kF32, DType::kF64}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor a = host_tensor({2}, dt, {3, 4}), b = host_tensor({1, 1}, dt, {12});
    const Tensor e = Tensor::empty({0}, dt, Device::kCpu);
    Tensor norm = Tensor::empty({1}, dt, Device::kCpu);
    const TensorView list[] = {a.view(), e.view(), b.view()};
    global_grad_norm(norm, list, TensorView{});
    EXPECT_EQ(values_of(norm)[0], 13.0);
    global_grad_norm(norm, std::span<const TensorView>{}, TensorView{});
    EXPECT_EQ(values_of(norm)[0], 0.0);
    const Tensor bad = host_tensor({2}, dt, {1, std::numeric_limits<double>::quiet_NaN()});
    const TensorView with_nan[] = {a.view(), bad.view()};
    global_grad_norm(norm, with_nan, TensorView{});
    EXPECT_TRUE(std::isnan(values_of(norm)[0]));
  }
  // f32 squares summed in double: 1e20^2 = 1e40 overflows f32 but not the accumulator.
  const Tensor big = host_tensor({2}, DType::kF32, {1e20, 1e20});
  Tensor norm = Tensor::empty({1}, DType::kF32, Device::kCpu);
  const TensorView list[] = {big.view()};
  global_grad_norm(norm, list, TensorView{});
  EXPECT_NEAR(values_of(norm)[0], std::sqrt(2.0) * 1e20, 1e14);
}

TEST(OpsAdamW, ClipScale) {
  EXPECT_FLOAT_EQ(clip_grad_scale(10.0f, 1.0f), (float)(1.0 / (10.0 + 1e-6)));
  EXPECT_EQ(clip_grad_scale(0.5f, 1.0f), 1.0f);
  EXPECT_EQ(clip_grad_scale(100.0f, 0.0f), 1.0f);
  EXPECT_TRUE(std::isnan(clip_grad_scale(std::numeric_limits<float>::quiet_NaN(), 1.0f)));
  EXPECT_EQ(clip_grad_scale(std::numeric_limits<float>::infinity(), 1.0f), 0.0f);
}

// adamw_update_many: each tensor with its own parameters, the same values as one adamw_update
// per tensor; an invalid update is named by its index.
TEST(OpsAdamW, ManyEqualsOnePerTensor) {
  const int64_t sizes[] = {5, 0, 130, 1};
  std::vector<Tensor> p1, p2, m1, m2, v1, v2, g;
  std::vector<AdamWUpdate> updates;
  std::vector<AdamWParams> params;
  for (size_t i = 0; i < std::size(sizes); ++i) {
    const int64_t n = sizes[i];
    p1.push_back(host_tensor({n}, DType::kF32, random_normal(n, 10 + i)));
    p2.push_back(p1.back().to(Device::kCpu));
    g.push_back(host_tensor({n}, DType::kF32, random_normal(n, 20 + i)));
    for (auto* t : {&m1, &m2, &v1, &v2}) t->push_back(Tensor::zeros({n}, DType::kF32, Device::kCpu));
    AdamWParams a;
    a.lr = 0.01f * (float)(i + 1);
    a.weight_decay = i % 2 == 0 ? 0.1f : 0.0f;
    a.grad_scale = 0.5f + 0.25f * (float)i;
    a.step = 1 + (int64_t)i;
    params.push_back(a);
  }
  for (size_t i = 0; i < std::size(sizes); ++i) {
    adamw_update(p1[i], g[i], m1[i], v1[i], TensorView{}, params[i]);
    updates.push_back({p2[i], g[i], m2[i], v2[i], TensorView{}, params[i]});
  }
  adamw_update_many(updates);
  for (size_t i = 0; i < std::size(sizes); ++i) {
    SCOPED_TRACE(::testing::Message() << "tensor " << i);
    EXPECT_EQ(values_of(p2[i]), values_of(p1[i]));
    if (sizes[i] > 0) {
      EXPECT_NE(values_of(p2[i]), values_of(host_tensor({sizes[i]}, DType::kF32, random_normal(sizes[i], 10 + i))));
    }
    EXPECT_EQ(values_of(m2[i]), values_of(m1[i]));
    EXPECT_EQ(values_of(v2[i]), values_of(v1[i]));
  }
  updates[2].p.step = 0;
  EXPECT_NE(error_of([&] { adamw_update_many(updates); }).find("updates[2]: step must be >= 1"), std::string::npos);
}

TEST(OpsAdamW, Errors) {
  Tensor p = host_tensor({4}, DType::kF32, {1, 2, 3, 4}), g = host_tensor({4}, DType::kF32, {1, 1, 1, 1});
  Tensor m = Tensor::zeros({4}, DType::kF32, Device::kCpu), v = Tensor::zeros({4}, DType::kF32, Device::kCpu);
  AdamWParams a;
  a.step = 0;
  EXPECT_NE(error_of([&] { adamw_update(p, g, m, v, TensorView{}, a); }).find("step must be >= 1"), std::string::npos);
  a.step = 1;
  a.beta2 = 1.0f;
  EXPECT_NE(error_of([&] { adamw_update(p, g, m, v, TensorView{}, a); }).find("beta1 and beta2"), std::string::npos);
  a.beta2 = 0.95f;
  Tensor g5 = host_tensor({5}, DType::kF32, {1, 1, 1, 1, 1});
  EXPECT_NE(error_of([&] { adamw_update(p, g5, m, v, TensorView{}, a); }).find("grads must be contiguous with 4 elements"), std::string::npos);
  Tensor g64 = host_tensor({4}, DType::kF64, {1, 1, 1, 1});
  EXPECT_NE(error_of([&] { adamw_update(p, g64, m, v, TensorView{}, a); }).find("one dtype"), std::string::npos);
  EXPECT_NE(error_of([&] { adamw_update(p, g, m, m, TensorView{}, a); }).find("distinct"), std::string::npos);
  Tensor n64 = Tensor::empty({1}, DType::kF64, Device::kCpu);
  const TensorView list[] = {p.view()};
  EXPECT_NE(error_of([&] { global_grad_norm(n64, list, TensorView{}); }).find("one dtype"), std::string::npos);
}

}  // namespace
}  // namespace fourbit::ops
