// ops rope (cpu): the reference against hand-computed rotations (rotate-half pairing), position 0
// = identity, backward(forward) = identity, float64 central differences for dq and dk, strided
// views of a fused QKV buffer, the in-place variants, q alone, the f32 recipe against f64 at large
// positions, and argument errors.
#include "dense_ops_test_util.h"
#include "ops/rope.h"

#include <gtest/gtest.h>

namespace fourbit::ops {
namespace {

using testing::check_gradient;
using testing::dot;
using testing::host_ints;
using testing::host_tensor;
using testing::random_ints;
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

TEST(OpsRope, HandComputedRotateHalf) {
  // D = 4, theta = 100: inv_freq = (1, 0.1); position 2: angles (2, 0.2). Pairs (0, 2), (1, 3).
  for (DType dt : {DType::kF32, DType::kF64}) {
    SCOPED_TRACE(dtype_name(dt));
    const double tol = dt == DType::kF32 ? 1e-6 : 1e-15;
    const std::vector<double> x = {1, 2, 3, 4};
    const Tensor q = host_tensor({1, 1, 4}, dt, x);
    Tensor out = Tensor::empty({1, 1, 4}, dt, Device::kCpu);
    rope_forward(out, TensorView{}, q, TensorView{}, host_ints({1}, {2}), 100.0f);
    const std::vector<double> o = values_of(out);
    const double c0 = std::cos(2.0), s0 = std::sin(2.0), c1 = std::cos(0.2), s1 = std::sin(0.2);
    EXPECT_NEAR(o[0], 1 * c0 - 3 * s0, tol);
    EXPECT_NEAR(o[2], 3 * c0 + 1 * s0, tol);
    EXPECT_NEAR(o[1], 2 * c1 - 4 * s1, tol);
    EXPECT_NEAR(o[3], 4 * c1 + 2 * s1, tol);
  }
}

TEST(OpsRope, PositionZeroIsIdentityAndNormIsPreserved) {
  const int64_t N = 3, H = 2, D = 8;
  const std::vector<double> x = random_normal(N * H * D, 1);
  const Tensor q = host_tensor({N, H, D}, DType::kF64, x);
  Tensor out = Tensor::empty({N, H, D}, DType::kF64, Device::kCpu);
  rope_forward(out, TensorView{}, q, TensorView{}, host_ints({N}, {0, 7, -5}), 10000.0f);
  const std::vector<double> o = values_of(out);
  for (int64_t i = 0; i < H * D; ++i) EXPECT_EQ(o[(size_t)i], x[(size_t)i]) << "position 0, element " << i;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < D / 2; ++i) {
        const size_t a = (size_t)((n * H + h) * D + i), b = a + D / 2;
        EXPECT_NEAR(o[a] * o[a] + o[b] * o[b], x[a] * x[a] + x[b] * x[b], 1e-13);
      }
}

TEST(OpsRope, BackwardInvertsForward) {
  const int64_t N = 4, H = 3, Hkv = 1, D = 6;
  const std::vector<double> xq = random_normal(N * H * D, 2), xk = random_normal(N * Hkv * D, 3);
  const Tensor pos = host_ints({N}, {0, 1, 1000, 123456});
  const Tensor q = host_tensor({N, H, D}, DType::kF64, xq), k = host_tensor({N, Hkv, D}, DType::kF64, xk);
  Tensor qr = Tensor::empty(q.shape(), DType::kF64, Device::kCpu), kr = Tensor::empty(k.shape(), DType::kF64, Device::kCpu);
  rope_forward(qr, kr, q, k, pos, 500000.0f);
  Tensor qb = Tensor::empty(q.shape(), DType::kF64, Device::kCpu), kb = Tensor::empty(k.shape(), DType::kF64, Device::kCpu);
  rope_backward(qb, kb, qr, kr, pos, 500000.0f);
  const std::vector<double> a = values_of(qb), b = values_of(kb);
  for (size_t i = 0; i < xq.size(); ++i) EXPECT_NEAR(a[i], xq[i], 1e-14);
  for (size_t i = 0; i < xk.size(); ++i) EXPECT_NEAR(b[i], xk[i], 1e-14);
}

TEST(OpsRope, FiniteDifferencesFloat64) {
  const int64_t N = 3, H = 4, Hkv = 2, D = 6;
  std::vector<double> xq = random_normal(N * H * D, 4), xk = random_normal(N * Hkv * D, 5);
  const std::vector<double> Rq = random_normal(N * H * D, 6), Rk = random_normal(N * Hkv * D, 7);
  const Tensor pos = host_ints({N}, {3, 0, 77});
  const float theta = 10000.0f;
  auto loss = [&] {
    Tensor qr = Tensor::empty({N, H, D}, DType::kF64, Device::kCpu), kr = Tensor::empty({N, Hkv, D}, DType::kF64, Device::kCpu);
    rope_forward(qr, kr, host_tensor({N, H, D}, DType::kF64, xq), host_tensor({N, Hkv, D}, DType::kF64, xk), pos, theta);
    return dot(values_of(qr), Rq) + dot(values_of(kr), Rk);
  };
  Tensor dq = host_tensor({N, H, D}, DType::kF64, std::vector<double>((size_t)(N * H * D), 1e9));
  Tensor dk = host_tensor({N, Hkv, D}, DType::kF64, std::vector<double>((size_t)(N * Hkv * D), 1e9));
  rope_backward(dq, dk, host_tensor({N, H, D}, DType::kF64, Rq), host_tensor({N, Hkv, D}, DType::kF64, Rk), pos, theta);
  EXPECT_TRUE(check_gradient(loss, xq.data(), N * H * D, values_of(dq), "dq"));
  EXPECT_TRUE(check_gradient(loss, xk.data(), N * Hkv * D, values_of(dk), "dk"));
}

TEST(OpsRope, StridedFusedQkvAndInplace) {
  // q and k are slices of a fused [N, (H + 2 Hkv) D] buffer; the v slice must stay untouched.
  const int64_t N = 5, H = 4, Hkv = 2, D = 8, W = (H + 2 * Hkv) * D;
  for (DType dt : {DType::kF32, DType::kF64}) {
    SCOPED_TRACE(dtype_name(dt));
    const std::vector<double> fused = random_normal(N * W, 8);
    const Tensor pos = host_ints({N}, random_ints(N, 0, 4096, 9));
    std::vector<double> xq, xk;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < W; ++c) {
        if (c < H * D) xq.push_back(fused[(size_t)(n * W + c)]);
        else if (c < (H + Hkv) * D) xk.push_back(fused[(size_t)(n * W + c)]);
      }
    Tensor qr = Tensor::empty({N, H, D}, dt, Device::kCpu), kr = Tensor::empty({N, Hkv, D}, dt, Device::kCpu);
    rope_forward(qr, kr, host_tensor({N, H, D}, dt, xq), host_tensor({N, Hkv, D}, dt, xk), pos, 10000.0f);

    Tensor buf = host_tensor({N, W}, dt, fused);
    TensorView qv = TensorView::contiguous(buf.data(), dt, {N, H, D}, Device::kCpu);
    qv.strides = Shape{W, D, 1};
    TensorView kv = qv;
    kv.shape = Shape{N, Hkv, D};
    kv.data = static_cast<char*>(buf.data()) + dtype_bytes(dt, H * D);
    rope_forward_inplace(qv, kv, pos, 10000.0f);
    const std::vector<double> after = values_of(buf), wq = values_of(qr), wk = values_of(kr);
    size_t iq = 0, ik = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < W; ++c) {
        const double got = after[(size_t)(n * W + c)];
        if (c < H * D) EXPECT_EQ(got, wq[iq++]);
        else if (c < (H + Hkv) * D) EXPECT_EQ(got, wk[ik++]);
        else EXPECT_EQ(got, (dt == DType::kF32 ? (double)(float)fused[(size_t)(n * W + c)] : fused[(size_t)(n * W + c)])) << "v was modified";
      }
    // In-place backward restores the inputs (to rounding).
    rope_backward_inplace(qv, kv, pos, 10000.0f);
    const std::vector<double> back = values_of(buf);
    for (size_t i = 0; i < back.size(); ++i) EXPECT_NEAR(back[i], fused[i], dt == DType::kF32 ? 1e-5 : 1e-13);
  }
}

TEST(OpsRope, Float32RecipeAgreesWithFloat64) {
  // The f32 reference rounds inv_freq and the angle to f32: at position p the angle's error is
  // up to ~p * inv_freq * 2^-23, which bounds the f32-vs-f64 difference (times |x|).
  const int64_t N = 4, H = 2, D = 128;
  const std::vector<double> x = random_normal(N * H * D, 10);
  const std::vector<int32_t> p = {1, 4095, 131071, 1 << 20};
  const Tensor pos = host_ints({N}, p);
  std::vector<std::vector<double>> out;
  for (DType dt : {DType::kF32, DType::kF64}) {
    Tensor o = Tensor::empty({N, H, D}, dt, Device::kCpu);
    rope_forward(o, TensorView{}, host_tensor({N, H, D}, dt, x), TensorView{}, pos, 500000.0f);
    out.push_back(values_of(o));
  }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < D; ++i) {
        const int64_t j = i % (D / 2);
        const double angle = p[(size_t)n] * std::pow(500000.0, -2.0 * (double)j / (double)D);
        const size_t e = (size_t)((n * H + h) * D + i), lo = (size_t)((n * H + h) * D + j);
        const double mag = std::fabs(x[lo]) + std::fabs(x[lo + D / 2]);
        EXPECT_NEAR(out[0][e], out[1][e], (angle * std::ldexp(1.0, -22) + 1e-6) * mag) << "n " << n << " i " << i;
      }
}

TEST(OpsRope, Errors) {
  const Tensor q = host_tensor({2, 1, 4}, DType::kF32, std::vector<double>(8, 1.0));
  Tensor o = Tensor::empty({2, 1, 4}, DType::kF32, Device::kCpu);
  const Tensor pos = host_ints({2}, {0, 1});
  const Tensor q5 = host_tensor({2, 1, 5}, DType::kF32, std::vector<double>(10, 1.0));
  Tensor o5 = Tensor::empty({2, 1, 5}, DType::kF32, Device::kCpu);
  EXPECT_NE(error_of([&] { rope_forward(o5, TensorView{}, q5, TensorView{}, pos, 1e4f); }).find("D even"), std::string::npos);
  EXPECT_NE(error_of([&] { rope_forward(o, TensorView{}, q, TensorView{}, host_ints({3}, {0, 1, 2}), 1e4f); }).find("positions must have shape (2)"), std::string::npos);
  EXPECT_NE(error_of([&] { rope_forward(o, TensorView{}, q, TensorView{}, host_tensor({2}, DType::kF32, {0, 1}), 1e4f); }).find("i32"), std::string::npos);
  EXPECT_NE(error_of([&] { rope_forward(o, TensorView{}, q, TensorView{}, pos, 0.0f); }).find("theta"), std::string::npos);
  EXPECT_NE(error_of([&] { rope_forward(o, q, q, TensorView{}, pos, 1e4f); }).find("together"), std::string::npos);
  EXPECT_NE(error_of([&] { rope_forward(q, TensorView{}, q, TensorView{}, pos, 1e4f); }).find("_inplace"), std::string::npos);
  const Tensor k3 = host_tensor({2, 1, 6}, DType::kF32, std::vector<double>(12, 1.0));
  Tensor ko = Tensor::empty({2, 1, 6}, DType::kF32, Device::kCpu);
  EXPECT_NE(error_of([&] { rope_forward(o, ko, q, k3, pos, 1e4f); }).find("k must be [N = 2, heads, D = 4]"), std::string::npos);
  TensorView strided = q.view();
  strided.strides = Shape{4, 4, 2};
  EXPECT_NE(error_of([&] { rope_forward_inplace(strided, TensorView{}, pos, 1e4f); }).find("unit stride"), std::string::npos);
}

}  // namespace
}  // namespace fourbit::ops
