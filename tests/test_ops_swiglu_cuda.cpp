// ops swiglu (gpu): the CUDA forward, backward and in-place backward against the CPU reference run
// in f32 on the same (dtype-rounded) inputs; bf16 and f32; odd and model-sized shapes, misaligned
// rows (F odd: every other row is off 16-byte alignment, the scalar path); guard regions.
//
// Tolerances (u = 2^-24). Both sides evaluate the same FP32 formulas; they differ by expf (CUDA:
// 2 ulp; glibc: < 1 ulp) and so by a few ulp in sigmoid:
//   out, d_up: 16 u |want|                                          + 2^-8 |want| if bf16
//   d_gate:    (16 + 8 |g|) u M,  M = |dout u| s (1 + |g| (1 - s))   + 2^-8 |want| if bf16
// (d_gate = dout u s (1 + g (1 - s)) cancels near g = -1.28, so its error is judged against M,
// the same sum without the cancellation; an error of a few ulp in s is amplified by |g|.)
#include "dense_ops_test_util.h"
#include "ops/swiglu.h"

#include <gtest/gtest.h>

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

class OpsSwigluCuda : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_GT(cuda_device_count(), 0) << "the gpu tests need a CUDA GPU"; }
};

void run_case(int64_t N, int64_t F, DType dt) {
  SCOPED_TRACE(::testing::Message() << "N " << N << " F " << F << " " << dtype_name(dt));
  const std::vector<double> gu = rounded(random_normal(N * 2 * F, 1 + F, 3.0), dt);
  const std::vector<double> dout = rounded(random_normal(N * F, 2 + F), dt);
  const Tensor h_gu = host_tensor({N, 2 * F}, dt, gu), h_dout = host_tensor({N, F}, dt, dout);

  Tensor r_out = Tensor::empty({N, F}, DType::kF32, Device::kCpu);
  swiglu_forward(r_out, host_tensor({N, 2 * F}, DType::kF32, gu));
  Tensor r_d = Tensor::empty({N, 2 * F}, DType::kF32, Device::kCpu);
  swiglu_backward(r_d, host_tensor({N, F}, DType::kF32, dout), host_tensor({N, 2 * F}, DType::kF32, gu));
  const std::vector<double> want_out = values_of(r_out), want_d = values_of(r_d);

  const double round = dt == DType::kBF16 ? 1.0 / 256 : 0.0;
  auto tol_out = [&](int64_t i) { return (16 * kU + round) * std::fabs(want_out[(size_t)i]) + 1e-37; };
  auto tol_d = [&](int64_t i) {
    const int64_t n = i / (2 * F), c = i % (2 * F), j = c % F;
    const double g = gu[(size_t)(n * 2 * F + j)], u = gu[(size_t)(n * 2 * F + F + j)];
    const double dy = dout[(size_t)(n * F + j)];
    const double s = 1 / (1 + std::exp(-g));
    const double m = c < F ? std::fabs(dy * u) * s * (1 + std::fabs(g) * (1 - s)) : std::fabs(dy * g * s);
    return (16 + 8 * std::fabs(g)) * kU * m + round * std::fabs(want_d[(size_t)i]) + 1e-37;
  };

  const Guarded g_gu = Guarded::copy_of(h_gu, kPoison), g_dout = Guarded::copy_of(h_dout, kPoison);
  const Guarded g_out = Guarded::make({N, F}, dt, kPoison);
  swiglu_forward(g_out.view, g_gu.view);
  EXPECT_EQ(g_out.damaged_guard_bytes(), 0) << "forward wrote outside out";
  EXPECT_TRUE(all_close(g_out.values(), want_out, tol_out, "out"));

  const Guarded g_d = Guarded::make({N, 2 * F}, dt, kPoison);
  swiglu_backward(g_d.view, g_dout.view, g_gu.view);
  EXPECT_EQ(g_d.damaged_guard_bytes(), 0) << "backward wrote outside d_gate_up";
  EXPECT_TRUE(all_close(g_d.values(), want_d, tol_d, "d_gate_up"));

  const Guarded g_inplace = Guarded::copy_of(h_gu, kPoison);
  swiglu_backward_inplace(g_inplace.view, g_dout.view);
  EXPECT_EQ(g_inplace.damaged_guard_bytes(), 0) << "in-place backward wrote outside gate_up";
  EXPECT_TRUE(g_inplace.values() == g_d.values()) << "in-place backward differs from out-of-place";
}

TEST_F(OpsSwigluCuda, MatchesReference) {
  for (DType dt : {DType::kBF16, DType::kF32}) {
    run_case(1, 1, dt);
    run_case(3, 5, dt);      // F odd: misaligned rows, scalar path
    run_case(7, 11008, dt);  // Llama-2 7B
    run_case(64, 1536, dt);
    run_case(1000, 8, dt);
    run_case(2, 14339, dt);  // ragged last group
  }
  run_case(8192, 1024, DType::kBF16);  // 1M items: grid-stride loop
}

}  // namespace
}  // namespace fourbit::ops
