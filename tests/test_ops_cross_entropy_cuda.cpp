// ops cross_entropy (gpu): the CUDA forward (losses, mean), backward and fused in-place variant
// against the CPU reference run in f32 on the same (dtype-rounded) logits: bf16 and f32 logits,
// bf16 and f32 dlogits, V from 1 to 128256 including odd V (50257: every row starts at a
// different alignment, exercising the scalar head and tail), misaligned buffers, ignored tokens,
// guard regions; determinism; out-of-range targets through a caller's flag and through the
// synchronous check; the lse-saving forward and the backward from it, bit for bit the fused call.
//
// Tolerances (u = 2^-24). The reference sums V exponentials sequentially in f32 (relative error
// <= V u) and the kernel in a tree (far less), so lse, and with it every loss, may differ by
//   |d lse| <= (V + 16) u + 4 u (|lse| + |x_target|)          (the loss tolerance)
// and a probability p = exp(x - lse) by p (|d lse| + 4 u (|x - lse| + |lse|)) (the subtraction,
// expf's 2 ulp); dlogits = (p - onehot) s:
//   |d dlogits| <= |s| p ((2V + 48) u + 4 u (|x - lse| + |lse|)) + |s| u + 2^-8 |want| if bf16
// The mean: the sum of N losses in f32 on both sides, (2N + 16) u sum|loss|, plus the losses'
// own tolerances, over n_valid. Every check runs with both exponentials (CrossEntropyExp): the
// SFU's ex2.approx of d log2(e) errs by ~2^-22 (4 u, inside the (2V + 48) u) plus the product's
// rounding, |d| u relative (inside the 4 u |x - lse| term).
#include "dense_ops_test_util.h"
#include "ops/cross_entropy.h"
#include "ops/elementwise.h"
#include "ops/error_flags.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <tuple>

namespace fourbit::ops {
namespace {

using testing::all_close;
using testing::Guarded;
using testing::host_ints;
using testing::host_tensor;
using testing::random_ints;
using testing::random_normal;
using testing::rounded;
using testing::values_of;

constexpr double kU = 1.0 / (1 << 24);
constexpr uint8_t kPoison = 0x7F;

class OpsCrossEntropyCuda : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_GT(cuda_device_count(), 0) << "the gpu tests need a CUDA GPU"; }
};

struct Case {
  int64_t N, V;
  DType logits, dlogits;
  int64_t shift_bytes;  // of the logits buffer (0: 16-byte aligned)
};

constexpr CrossEntropyExp kExps[] = {CrossEntropyExp::kExpf, CrossEntropyExp::kSfu};
const char* exp_name(CrossEntropyExp e) { return e == CrossEntropyExp::kSfu ? "sfu" : "expf"; }

void run_case(const Case& cs, CrossEntropyExp ex) {
  const int64_t N = cs.N, V = cs.V;
  SCOPED_TRACE(::testing::Message() << "N " << N << " V " << V << " logits " << dtype_name(cs.logits)
                                    << " dlogits " << dtype_name(cs.dlogits) << " shift " << cs.shift_bytes
                                    << " exp " << exp_name(ex));
  const std::vector<double> x = rounded(random_normal(N * V, 1 + V, 4.0), cs.logits);
  std::vector<int32_t> t = random_ints(N, 0, (int32_t)V - 1, 2 + N);
  for (int64_t n = 1; n < N; n += 3) t[(size_t)n] = -1;  // every third token ignored
  const int64_t n_valid = std::count_if(t.begin(), t.end(), [](int32_t v) { return v != -1; });
  const float scale = n_valid > 0 ? 1.0f / (float)n_valid : 1.0f;

  // Reference in f32.
  const Tensor rx = host_tensor({N, V}, DType::kF32, x), ht = host_ints({N}, t);
  Tensor rl = Tensor::empty({N}, DType::kF32, Device::kCpu), rm = Tensor::empty({1}, DType::kF32, Device::kCpu);
  cross_entropy_forward(rl, rm, rx, ht);
  Tensor rd = Tensor::empty({N, V}, DType::kF32, Device::kCpu);
  cross_entropy_backward(rd, rx, ht, scale);
  const std::vector<double> want_l = values_of(rl), want_d = values_of(rd);
  const double want_m = values_of(rm)[0];

  // Tolerances.
  std::vector<double> tol_l((size_t)N), lse((size_t)N);
  double sum_abs = 0, sum_tol = 0;
  for (int64_t n = 0; n < N; ++n) {
    if (t[(size_t)n] == -1) continue;
    double m = x[(size_t)(n * V)];
    for (int64_t v = 1; v < V; ++v) m = std::max(m, x[(size_t)(n * V + v)]);
    double s = 0;
    for (int64_t v = 0; v < V; ++v) s += std::exp(x[(size_t)(n * V + v)] - m);
    lse[(size_t)n] = m + std::log(s);
    tol_l[(size_t)n] = (V + 16) * kU + 4 * kU * (std::fabs(lse[(size_t)n]) + std::fabs(x[(size_t)(n * V + t[(size_t)n])]));
    sum_abs += std::fabs(want_l[(size_t)n]);
    sum_tol += tol_l[(size_t)n];
  }
  const double tol_m = n_valid > 0 ? (sum_tol + (2 * N + 16) * kU * sum_abs) / (double)n_valid : 0.0;
  const double round = cs.dlogits == DType::kBF16 ? 1.0 / 256 : 0.0;
  auto tol_d = [&](int64_t e) {
    const int64_t n = e / V;
    if (t[(size_t)n] == -1) return 0.0;
    const double z = x[(size_t)e] - lse[(size_t)n], p = std::exp(z);
    return scale * p * ((2 * V + 48) * kU + 4 * kU * (std::fabs(z) + std::fabs(lse[(size_t)n]))) + scale * kU +
           round * std::fabs(want_d[(size_t)e]);
  };

  // Device: forward, backward, fused in place; twice for determinism.
  const Tensor hx = host_tensor({N, V}, cs.logits, x);
  const Guarded gx = Guarded::copy_of(hx, kPoison, cs.shift_bytes);
  const Tensor dt = ht.to(Device::kCuda);
  std::vector<double> first_l, first_d;
  for (int rep = 0; rep < 2; ++rep) {
    const Guarded gl = Guarded::make({N}, DType::kF32, kPoison), gm = Guarded::make({1}, DType::kF32, kPoison);
    cross_entropy_forward(gl.view, gm.view, gx.view, dt, nullptr, nullptr, ex);
    EXPECT_EQ(gl.damaged_guard_bytes(), 0) << "forward wrote outside losses";
    EXPECT_EQ(gm.damaged_guard_bytes(), 0) << "forward wrote outside mean_loss";
    const std::vector<double> got_l = gl.values();
    EXPECT_TRUE(all_close(got_l, want_l, [&](int64_t n) { return tol_l[(size_t)n]; }, "losses"));
    EXPECT_NEAR(gm.values()[0], want_m, tol_m) << "mean_loss";

    // Shifted by as many elements as the logits (element-aligned in its own dtype).
    const int64_t d_shift = cs.shift_bytes / dtype_bytes(cs.logits, 1) * dtype_bytes(cs.dlogits, 1);
    const Guarded gd = Guarded::make({N, V}, cs.dlogits, kPoison, d_shift);
    cross_entropy_backward(gd.view, gx.view, dt, scale, nullptr, nullptr, ex);
    EXPECT_EQ(gd.damaged_guard_bytes(), 0) << "backward wrote outside dlogits";
    const std::vector<double> got_d = gd.values();
    EXPECT_TRUE(all_close(got_d, want_d, tol_d, "dlogits"));
    if (rep == 0) {
      first_l = got_l;
      first_d = got_d;
    } else {
      EXPECT_TRUE(got_l == first_l) << "losses differ between two identical runs";
      EXPECT_TRUE(got_d == first_d) << "dlogits differ between two identical runs";
    }
  }

  // Fused in place (dlogits in the logits' dtype): the same bits as forward + backward.
  if (cs.dlogits == cs.logits) {
    const Guarded buf = Guarded::copy_of(hx, kPoison, cs.shift_bytes);
    const Guarded gl = Guarded::make({N}, DType::kF32, kPoison), gm = Guarded::make({1}, DType::kF32, kPoison);
    cross_entropy_forward_backward_inplace(buf.view, gl.view, gm.view, dt, scale, nullptr, nullptr, ex);
    EXPECT_EQ(buf.damaged_guard_bytes(), 0) << "fused: wrote outside the logits buffer";
    EXPECT_TRUE(buf.values() == first_d) << "fused in-place dlogits differ from the backward's";
    EXPECT_TRUE(gl.values() == first_l) << "fused in-place losses differ from the forward's";

    // Training's pair: the forward keeping lse, then the one-pass backward from it: the same bits.
    const Guarded buf2 = Guarded::copy_of(hx, kPoison, cs.shift_bytes);
    const Guarded gl2 = Guarded::make({N}, DType::kF32, kPoison), gm2 = Guarded::make({1}, DType::kF32, kPoison);
    const Guarded glse = Guarded::make({N}, DType::kF32, kPoison);
    cross_entropy_forward_saving_lse(gl2.view, gm2.view, glse.view, buf2.view, dt, nullptr, nullptr, ex);
    EXPECT_EQ(glse.damaged_guard_bytes(), 0) << "forward wrote outside lse";
    EXPECT_TRUE(gl2.values() == first_l) << "losses of the lse-saving forward differ";
    const std::vector<double> got_lse = glse.values();
    for (int64_t n = 0; n < N; ++n) {
      if (t[(size_t)n] == -1) {
        EXPECT_EQ(got_lse[(size_t)n], 0.0) << "ignored token " << n;
      } else {
        EXPECT_NEAR(got_lse[(size_t)n], lse[(size_t)n], tol_l[(size_t)n]) << "lse of token " << n;
      }
    }
    cross_entropy_backward_inplace_from_lse(buf2.view, glse.view, dt, scale, TensorView{}, nullptr, nullptr, ex);
    EXPECT_EQ(buf2.damaged_guard_bytes(), 0) << "backward from lse: wrote outside the logits buffer";
    EXPECT_TRUE(buf2.values() == first_d) << "dlogits from the saved lse differ from the fused variant's";
  }
}

TEST_F(OpsCrossEntropyCuda, MatchesReference) {
  const Case cases[] = {
      {1, 1, DType::kF32, DType::kF32, 0},
      {3, 7, DType::kBF16, DType::kBF16, 0},
      {3, 7, DType::kF32, DType::kBF16, 4},
      {33, 1000, DType::kBF16, DType::kF32, 2},
      {5, 50257, DType::kBF16, DType::kBF16, 0},
      {5, 50257, DType::kF32, DType::kF32, 0},
      {4, 50304, DType::kBF16, DType::kBF16, 6},
      {3, 128256, DType::kBF16, DType::kBF16, 0},
      {2, 128256, DType::kF32, DType::kBF16, 0},
      {700, 515, DType::kBF16, DType::kBF16, 0},
  };
  for (const CrossEntropyExp ex : kExps)
    for (const Case& cs : cases) run_case(cs, ex);
}

// The two exponentials are different code: some dlogits bits differ (the choice reaches the
// kernel). Where FOURBIT_CE_EXP makes both calls one exponential there is no choice to check.
TEST_F(OpsCrossEntropyCuda, TheExponentialChoiceReachesTheKernel) {
  if (cross_entropy_exp_in_effect(CrossEntropyExp::kExpf) == cross_entropy_exp_in_effect(CrossEntropyExp::kSfu))
    GTEST_SKIP() << "FOURBIT_CE_EXP overrides both calls' exponential; unset it to run this check";
  const int64_t N = 8, V = 50257;
  const Tensor x = host_tensor({N, V}, DType::kF32, random_normal(N * V, 17, 4.0)).to(Device::kCuda);
  const Tensor t = host_ints({N}, random_ints(N, 0, (int32_t)V - 1, 18)).to(Device::kCuda);
  std::vector<double> d[2];
  for (int k = 0; k < 2; ++k) {
    Tensor g = Tensor::empty({N, V}, DType::kF32, Device::kCuda);
    cross_entropy_backward(g, x, t, 1.0f / N, nullptr, nullptr, kExps[k]);
    d[k] = values_of(g);
  }
  int64_t differ = 0;
  for (size_t i = 0; i < d[0].size(); ++i) differ += d[0][i] != d[1][i];
  std::printf("expf vs sfu: %lld of %lld dlogits differ\n", (long long)differ, (long long)d[0].size());
  EXPECT_GT(differ, (int64_t)d[0].size() / 100);
}

// Per-row weights: the kernel against the CPU reference (f32), with negative, zero and ignored
// rows; tolerance as dlogits above with |s| replaced by |s w_n| (the weight is one more FP32
// product: one more u).
TEST_F(OpsCrossEntropyCuda, WeightedRowsMatchReference) {
  for (const CrossEntropyExp ex : kExps) {
    for (const auto& [N, V, dt] : {std::tuple<int64_t, int64_t, DType>{5, 7, DType::kF32},
                                   {37, 515, DType::kBF16}, {4, 50257, DType::kBF16}}) {
      SCOPED_TRACE(::testing::Message() << "N " << N << " V " << V << " " << dtype_name(dt) << " exp " << exp_name(ex));
      const std::vector<double> x = rounded(random_normal(N * V, 7 + V, 3.0), dt);
      std::vector<int32_t> t = random_ints(N, 0, (int32_t)V - 1, 3 + N);
      t[1] = -1;
      std::vector<double> w = random_normal(N, 11 + N, 2.0);
      w[2] = 0.0;
      const float scale = 0.125f;
      const Tensor rx = host_tensor({N, V}, DType::kF32, x), ht = host_ints({N}, t);
      Tensor rbuf = host_tensor({N, V}, DType::kF32, x), rl = Tensor::empty({N}, DType::kF32, Device::kCpu);
      cross_entropy_forward_backward_inplace_weighted(rbuf, rl, TensorView{}, ht,
                                                      host_tensor({N}, DType::kF32, w), scale);
      const std::vector<double> want = values_of(rbuf);
      const Guarded buf = Guarded::copy_of(host_tensor({N, V}, dt, x), kPoison, 0);
      const Guarded gl = Guarded::make({N}, DType::kF32, kPoison);
      const Tensor dw = host_tensor({N}, DType::kF32, w).to(Device::kCuda);
      cross_entropy_forward_backward_inplace_weighted(buf.view, gl.view, TensorView{}, ht.to(Device::kCuda),
                                                      dw, scale, nullptr, nullptr, ex);
      EXPECT_EQ(buf.damaged_guard_bytes(), 0);
      const std::vector<double> got = buf.values();
      const double round = dt == DType::kBF16 ? 1.0 / 256 : 0.0;
      auto tol = [&](int64_t e) {
        const int64_t n = e / V;
        if (t[(size_t)n] == -1) return 0.0;
        const double s = std::fabs(scale * w[(size_t)n]);
        return s * ((2 * V + 64) * kU + 4 * kU * 40.0) + s * kU + round * std::fabs(want[(size_t)e]);
      };
      EXPECT_TRUE(all_close(got, want, tol, "weighted dlogits"));

      // From the forward's saved lse: the same bits as the fused weighted call above.
      const Guarded buf2 = Guarded::copy_of(host_tensor({N, V}, dt, x), kPoison, 0);
      Tensor l2 = Tensor::empty({N}, DType::kF32, Device::kCuda), lse = Tensor::empty({N}, DType::kF32, Device::kCuda);
      cross_entropy_forward_saving_lse(l2, TensorView{}, lse, buf2.view, ht.to(Device::kCuda), nullptr, nullptr, ex);
      cross_entropy_backward_inplace_from_lse(buf2.view, lse, ht.to(Device::kCuda), scale, dw, nullptr, nullptr, ex);
      EXPECT_EQ(buf2.damaged_guard_bytes(), 0);
      EXPECT_TRUE(buf2.values() == got) << "weighted dlogits from the saved lse differ from the fused call's";
      EXPECT_TRUE(values_of(l2) == gl.values()) << "losses of the lse-saving forward differ";
    }
  }
}

TEST_F(OpsCrossEntropyCuda, OutOfRangeTargets) {
  const int64_t N = 4, V = 10;
  const Tensor x = host_tensor({N, V}, DType::kBF16, random_normal(N * V, 5)).to(Device::kCuda);
  const Tensor t = host_ints({N}, {1, 10, -1, -7}).to(Device::kCuda);
  Tensor losses = Tensor::empty({N}, DType::kF32, Device::kCuda);
  Tensor flag = Tensor::zeros({1}, DType::kI32, Device::kCuda);
  cross_entropy_forward(losses, TensorView{}, x, t, flag.ptr<int>());
  EXPECT_EQ(read_and_clear_error_flag(flag.ptr<int>()), kErrIndexOutOfRange);
  const std::vector<double> l = values_of(losses);
  EXPECT_TRUE(std::isfinite(l[0]));
  EXPECT_TRUE(std::isnan(l[1]));
  EXPECT_EQ(l[2], 0.0);
  EXPECT_TRUE(std::isnan(l[3]));
  Tensor d = Tensor::empty({N, V}, DType::kBF16, Device::kCuda);
  try {
    cross_entropy_backward(d, x, t, 1.0f);
    ADD_FAILURE() << "the synchronous check did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("outside [0, V = 10)"), std::string::npos) << e.what();
  }
  const std::vector<double> dv = values_of(d);
  EXPECT_TRUE(std::isnan(dv[(size_t)V])) << "the invalid token's dlogits row should be NaN";
  // A valid call after the error: the internal flag was reset.
  const Tensor ok = host_ints({N}, {1, 2, -1, 3}).to(Device::kCuda);
  cross_entropy_backward(d, x, ok, 1.0f);
}

}  // namespace
}  // namespace fourbit::ops
