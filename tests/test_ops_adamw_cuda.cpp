// ops adamw (gpu): the CUDA AdamW update (three consecutive steps, weight decay, gradient scale,
// the fused bf16 copy) against the CPU f32 reference, on odd sizes and misaligned buffers with
// guard regions, and the batched update (adamw_update_many) against one update per tensor; the
// two-stage global gradient norm against the float64 CPU reference over a list of f32 and bf16
// tensors (empty ones included; more than one launch's batch), its determinism and NaN
// propagation.
//
// Tolerances (u = 2^-24).
//   AdamW: both sides evaluate the same FP32 formulas with IEEE division and square root; CUDA
//   may contract a product and a sum into an FMA, so each step's value differs by a few u of the
//   magnitude of its terms, and differences carried into later steps stay of that order:
//     m: 32 k u (|m| + |g s|),  v: 32 k u (v + (g s)^2),  p: 32 k u (|p| + lr (|r| + 4 + wd |p|))
//   after k steps, r = m_hat / (sqrt(v_hat) + eps) (the 4 bounds r's absolute error scale when m
//   nearly cancels: |m_hat| / sqrt(v_hat) stays O(1) in Adam). The bf16 copy must equal bf16(p) of the GPU's
//   own p exactly (same codec), and bf16 of the reference's p to one bf16 rounding (2^-8 |p|).
//   Norm: squares of f32/bf16 values are exact in FP64 and summed in FP64 on both sides (relative
//   difference <= n 2^-53), then sqrt and one rounding to f32: at most one f32 ulp apart, 2^-22.
#include "dense_ops_test_util.h"
#include "ops/adamw.h"

#include <gtest/gtest.h>

#include <limits>

namespace fourbit::ops {
namespace {

using testing::all_close;
using testing::Guarded;
using testing::host_tensor;
using testing::random_normal;
using testing::rounded;
using testing::values_of;

constexpr double kU = 1.0 / (1 << 24);
constexpr uint8_t kPoison = 0x7F;

class OpsAdamWCuda : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_GT(cuda_device_count(), 0) << "the gpu tests need a CUDA GPU"; }
};

void run_adamw(int64_t n, bool misaligned, bool with_bf16) {
  SCOPED_TRACE(::testing::Message() << "n " << n << (misaligned ? " misaligned" : "")
                                    << (with_bf16 ? " +bf16" : ""));
  const int64_t shift = misaligned ? 4 : 0;
  const std::vector<double> p0 = rounded(random_normal(n, 1 + n), DType::kF32);
  Tensor rp = host_tensor({n}, DType::kF32, p0), rm = Tensor::zeros({n}, DType::kF32, Device::kCpu),
         rv = Tensor::zeros({n}, DType::kF32, Device::kCpu);
  const Guarded gp = Guarded::copy_of(rp, kPoison, shift);
  const Guarded gm = Guarded::copy_of(rm, kPoison), gv = Guarded::copy_of(rv, kPoison, shift);
  const Guarded gb = Guarded::make({n}, DType::kBF16, kPoison, misaligned ? 2 : 0);
  AdamWParams a;
  a.lr = 1e-2f;
  a.weight_decay = 0.1f;
  std::vector<double> g;
  const int steps = 3;
  for (int step = 1; step <= steps; ++step) {
    a.step = step;
    a.grad_scale = step == 2 ? 0.3f : 1.0f;
    g = rounded(random_normal(n, 100 * step + n), DType::kF32);
    const Tensor hg = host_tensor({n}, DType::kF32, g);
    adamw_update(rp, hg, rm, rv, TensorView{}, a);
    const Guarded gg = Guarded::copy_of(hg, kPoison, shift);
    adamw_update(gp.view, gg.view, gm.view, gv.view, with_bf16 ? gb.view : TensorView{}, a);
  }
  EXPECT_EQ(gp.damaged_guard_bytes(), 0) << "wrote outside params";
  EXPECT_EQ(gm.damaged_guard_bytes(), 0) << "wrote outside m";
  EXPECT_EQ(gv.damaged_guard_bytes(), 0) << "wrote outside v";
  EXPECT_EQ(gb.damaged_guard_bytes(), 0) << "wrote outside params_bf16";

  const std::vector<double> wp = values_of(rp), wm = values_of(rm), wv = values_of(rv);
  const double bc1 = 1 - std::pow((double)a.beta1, steps), bc2 = 1 - std::pow((double)a.beta2, steps);
  const double k = 32.0 * steps * kU, lr = a.lr, wd = a.weight_decay;
  auto tol_m = [&](int64_t i) { return k * (std::fabs(wm[(size_t)i]) + std::fabs(g[(size_t)i])); };
  auto tol_v = [&](int64_t i) { return k * (wv[(size_t)i] + g[(size_t)i] * g[(size_t)i]); };
  auto tol_p = [&](int64_t i) {
    const double r = (wm[(size_t)i] / bc1) / (std::sqrt(wv[(size_t)i] / bc2) + a.eps);
    return k * (std::fabs(wp[(size_t)i]) + lr * (std::fabs(r) + 4 + wd * std::fabs(wp[(size_t)i])));
  };
  const std::vector<double> got_p = gp.values();
  EXPECT_TRUE(all_close(got_p, wp, tol_p, "params"));
  EXPECT_TRUE(all_close(gm.values(), wm, tol_m, "m"));
  EXPECT_TRUE(all_close(gv.values(), wv, tol_v, "v"));
  if (with_bf16) {
    const std::vector<double> got_b = gb.values();
    EXPECT_TRUE(got_b == rounded(got_p, DType::kBF16)) << "params_bf16 is not bf16(params)";
    EXPECT_TRUE(all_close(got_b, wp, [&](int64_t i) { return std::fabs(wp[(size_t)i]) / 256 + tol_p(i); }, "params_bf16"));
  }
}

TEST_F(OpsAdamWCuda, MatchesReference) {
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{4099}, int64_t{(1 << 20) + 5}})
    for (bool misaligned : {false, true})
      for (bool with_bf16 : {false, true}) run_adamw(n, misaligned, with_bf16);
}

TEST_F(OpsAdamWCuda, GlobalGradNorm) {
  struct Item {
    int64_t n;
    DType dt;
    int64_t shift;
  };
  const Item items[] = {{0, DType::kF32, 0},          {1, DType::kF32, 0},  {7, DType::kBF16, 2},
                        {65537, DType::kF32, 4},      {3 << 20, DType::kBF16, 0},
                        {(1 << 22) + 3, DType::kF32, 0}, {100, DType::kF32, 0}};
  std::vector<Guarded> dev;
  std::vector<TensorView> views;
  double sum = 0;
  uint64_t seed = 1;
  for (const Item& it : items) {
    const std::vector<double> x = rounded(random_normal(it.n, seed++, 0.01), it.dt);
    for (double v : x) sum += v * v;
    dev.push_back(Guarded::copy_of(host_tensor({it.n}, it.dt, x), kPoison, it.shift));
    views.push_back(dev.back().view);
  }
  const double want = (double)(float)std::sqrt(sum);
  const Guarded ws = Guarded::make({grad_norm_workspace_bytes(views)}, DType::kU8, kPoison);
  std::vector<float> got;
  for (int rep = 0; rep < 2; ++rep) {
    const Guarded norm = Guarded::make({1}, DType::kF32, kPoison);
    global_grad_norm(norm.view, views, ws.view);
    EXPECT_EQ(norm.damaged_guard_bytes(), 0) << "wrote outside norm";
    EXPECT_EQ(ws.damaged_guard_bytes(), 0) << "wrote outside the workspace";
    got.push_back((float)norm.values()[0]);
  }
  EXPECT_NEAR(got[0], want, std::ldexp(want, -22)) << "global grad norm";
  EXPECT_EQ(got[0], got[1]) << "the norm differs between two identical runs";

  // A single NaN anywhere makes the norm NaN.
  const Tensor bad = host_tensor({5000}, DType::kF32, random_normal(5000, 9)).to(Device::kCpu);
  bad.ptr<float>()[4321] = std::numeric_limits<float>::quiet_NaN();
  const Tensor dbad = bad.to(Device::kCuda);
  views.push_back(dbad.view());
  const Guarded ws2 = Guarded::make({grad_norm_workspace_bytes(views)}, DType::kU8, kPoison);
  Tensor norm = Tensor::empty({1}, DType::kF32, Device::kCuda);
  global_grad_norm(norm, views, ws2.view);
  EXPECT_TRUE(std::isnan(values_of(norm)[0])) << "a NaN gradient must give a NaN norm";
}

// adamw_update_many over more tensors than one launch takes (kAdamWBatch = 32), of odd, empty and
// misaligned sizes, each with its own parameters and some with a bf16 copy: the same bits as one
// adamw_update per tensor on the GPU.
TEST_F(OpsAdamWCuda, ManyEqualsOnePerTensor) {
  constexpr int kTensors = 70;
  std::vector<Guarded> p1, p2, m1, m2, v1, v2, b1, b2, g;
  std::vector<AdamWParams> params;
  for (int i = 0; i < kTensors; ++i) {
    const int64_t n = i % 9 == 0 ? 0 : i % 5 == 0 ? 70000 + i : 3 * i + 1;
    const int64_t shift = i % 3 == 0 ? 4 : 0;
    const Tensor hp = host_tensor({n}, DType::kF32, random_normal(n, 1000 + i));
    const Tensor hz = Tensor::zeros({n}, DType::kF32, Device::kCpu);
    p1.push_back(Guarded::copy_of(hp, kPoison, shift));
    p2.push_back(Guarded::copy_of(hp, kPoison, shift));
    for (auto* t : {&m1, &m2, &v1, &v2}) t->push_back(Guarded::copy_of(hz, kPoison, shift));
    for (auto* t : {&b1, &b2}) t->push_back(Guarded::make({n}, DType::kBF16, kPoison, i % 4 == 1 ? 2 : 0));
    g.push_back(Guarded::copy_of(host_tensor({n}, DType::kF32, random_normal(n, 2000 + i)), kPoison, shift));
    AdamWParams a;
    a.lr = 1e-3f * (float)(1 + i % 7);
    a.weight_decay = i % 2 == 0 ? 0.1f : 0.0f;
    a.grad_scale = i % 4 == 0 ? 0.3f : 1.0f;
    a.step = 1 + i % 3;
    params.push_back(a);
  }
  for (int step = 0; step < 2; ++step) {
    std::vector<AdamWUpdate> updates;
    for (int i = 0; i < kTensors; ++i) {
      const bool bf16 = i % 4 < 2;
      adamw_update(p1[i].view, g[i].view, m1[i].view, v1[i].view, bf16 ? b1[i].view : TensorView{}, params[i]);
      updates.push_back({p2[i].view, g[i].view, m2[i].view, v2[i].view, bf16 ? b2[i].view : TensorView{}, params[i]});
    }
    adamw_update_many(updates);
  }
  for (int i = 0; i < kTensors; ++i) {
    SCOPED_TRACE(::testing::Message() << "tensor " << i);
    EXPECT_EQ(p2[i].values(), p1[i].values());
    EXPECT_EQ(m2[i].values(), m1[i].values());
    EXPECT_EQ(v2[i].values(), v1[i].values());
    if (i % 4 < 2) {
      EXPECT_EQ(b2[i].values(), b1[i].values());
    }
    for (const Guarded* x : {&p2[i], &m2[i], &v2[i], &b2[i]}) EXPECT_EQ(x->damaged_guard_bytes(), 0);
  }
}

// The norm over more tensors than one launch takes (kSumsqBatch = 64, so three launches) of f32 and
// bf16, empty and misaligned: the float64 reference.
TEST_F(OpsAdamWCuda, GlobalGradNormOverManyTensors) {
  std::vector<Guarded> dev;
  std::vector<TensorView> views;
  double sum = 0;
  for (int i = 0; i < 150; ++i) {
    const int64_t n = i % 10 == 0 ? 0 : i % 7 == 0 ? 100000 + i : 37 * i;
    const DType dt = i % 3 == 0 ? DType::kBF16 : DType::kF32;
    const std::vector<double> x = rounded(random_normal(n, 500 + i, 0.01), dt);
    for (double v : x) sum += v * v;
    dev.push_back(Guarded::copy_of(host_tensor({n}, dt, x), kPoison, i % 2 == 0 ? 0 : dt == DType::kBF16 ? 2 : 4));
    views.push_back(dev.back().view);
  }
  const double want = (double)(float)std::sqrt(sum);
  const Guarded ws = Guarded::make({grad_norm_workspace_bytes(views)}, DType::kU8, kPoison);
  const Guarded norm = Guarded::make({1}, DType::kF32, kPoison);
  global_grad_norm(norm.view, views, ws.view);
  EXPECT_EQ(ws.damaged_guard_bytes(), 0) << "wrote outside the workspace";
  EXPECT_NEAR(norm.values()[0], want, std::ldexp(want, -22)) << "global grad norm over 150 tensors";
}

}  // namespace
}  // namespace fourbit::ops
