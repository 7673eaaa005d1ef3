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
//
// OutputAmaxes (the *_amax kernels): the outputs equal the plain kernels' bit for bit, and the
// amaxes equal quant::amax_cuda over those outputs bit for bit (plain and after the column-wise
// RHT, both sign vectors), also with an outlier, a NaN (left out, flagged) and an Inf (kept).
#include "dense_ops_test_util.h"
#include "ops/error_flags.h"
#include "ops/swiglu.h"
#include "quant/quantize.h"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>

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

// Device f32 [2] -> host.
std::array<float, 2> read2(const Tensor& t) {
  std::array<float, 2> h{};
  device_memcpy(h.data(), Device::kCpu, t.data(), Device::kCuda, sizeof(h));
  return h;
}
int read_flag(const Tensor& t) {
  int h = 0;
  device_memcpy(&h, Device::kCpu, t.data(), Device::kCuda, sizeof(h));
  return h;
}

// Equal values, NaN equal to NaN (the decoded BF16 outputs hold a NaN where the input had one).
bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i])))) return false;
  return true;
}

uint32_t bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

// The amaxes that quant::amax_cuda finds in `out` (bf16 [N, C] on the device).
std::array<float, 2> amax_pass(const TensorView& out, bool rht, uint16_t mask) {
  Tensor a = Tensor::zeros({2}, DType::kF32, Device::kCuda);
  Tensor flag = Tensor::zeros({1}, DType::kI32, Device::kCuda);
  quant::amax_cuda(out, a.ptr<float>(), a.ptr<float>() + 1, rht, mask, flag.ptr<int>(), nullptr);
  return read2(a);
}

// `poke`: host edits of the gate_up values before upload (outliers, NaN, Inf).
void amax_case(int64_t N, int64_t F, bool rht, uint16_t mask, uint64_t seed,
               void (*poke)(std::vector<double>&, int64_t N, int64_t F) = nullptr) {
  SCOPED_TRACE(::testing::Message() << "N " << N << " F " << F << " rht " << rht << " mask " << mask);
  const DType dt = DType::kBF16;
  std::vector<double> gu = random_normal(N * 2 * F, seed, 3.0);
  if (poke) poke(gu, N, F);
  gu = rounded(gu, dt);
  const std::vector<double> dout = rounded(random_normal(N * F, seed + 1), dt);
  const Tensor h_gu = host_tensor({N, 2 * F}, dt, gu), h_dout = host_tensor({N, F}, dt, dout);
  const Guarded g_gu = Guarded::copy_of(h_gu, kPoison), g_dout = Guarded::copy_of(h_dout, kPoison);
  bool any_nonfinite = false;
  for (double v : gu) any_nonfinite |= !std::isfinite(v);

  Tensor amax = Tensor::zeros({2}, DType::kF32, Device::kCuda);
  Tensor flag = Tensor::zeros({1}, DType::kI32, Device::kCuda);
  OutputAmaxes a;
  a.amax = amax.ptr<float>();
  a.rht_amax = rht ? amax.ptr<float>() + 1 : nullptr;
  a.rht_sign_mask = mask;
  a.nonfinite_flag = flag.ptr<int>();

  // Forward.
  const Guarded plain = Guarded::make({N, F}, dt, kPoison), fused = Guarded::make({N, F}, dt, kPoison);
  swiglu_forward(plain.view, g_gu.view);
  swiglu_forward(fused.view, g_gu.view, nullptr, &a);
  EXPECT_EQ(fused.damaged_guard_bytes(), 0) << "fused forward wrote outside out";
  EXPECT_TRUE(same_bits(fused.values(), plain.values())) << "fused forward's output differs from the plain kernel's";
  std::array<float, 2> want = amax_pass(plain.view, rht, mask), got = read2(amax);
  EXPECT_EQ(bits(got[0]), bits(want[0])) << "forward amax " << got[0] << " vs the amax pass's " << want[0];
  if (rht) {
    EXPECT_EQ(bits(got[1]), bits(want[1])) << "forward RHT amax " << got[1] << " vs " << want[1];
  }
  if (!rht) {
    EXPECT_EQ(got[1], 0.0f) << "no RHT amax asked, but one was written";
  }
  EXPECT_EQ(read_flag(flag) != 0, any_nonfinite) << "forward non-finite flag";

  // In-place backward.
  device_memset(amax.data(), 0, 2 * sizeof(float));
  const Guarded plain_d = Guarded::copy_of(h_gu, kPoison), fused_d = Guarded::copy_of(h_gu, kPoison);
  swiglu_backward_inplace(plain_d.view, g_dout.view);
  swiglu_backward_inplace(fused_d.view, g_dout.view, nullptr, &a);
  EXPECT_EQ(fused_d.damaged_guard_bytes(), 0) << "fused backward wrote outside d_gate_up";
  EXPECT_TRUE(same_bits(fused_d.values(), plain_d.values())) << "fused backward's output differs from the plain kernel's";
  want = amax_pass(plain_d.view, rht, mask);
  got = read2(amax);
  EXPECT_EQ(bits(got[0]), bits(want[0])) << "backward amax " << got[0] << " vs the amax pass's " << want[0];
  if (rht) {
    EXPECT_EQ(bits(got[1]), bits(want[1])) << "backward RHT amax " << got[1] << " vs " << want[1];
  }
  EXPECT_GT(got[0], 0.0f);
}

TEST_F(OpsSwigluCuda, OutputAmaxesEqualTheQuantizersAmaxPass) {
  for (bool rht : {true, false}) {
    amax_case(16, 128, rht, 0x2D5B, 11);
    amax_case(64, 256, rht, 0x0000, 12);
    amax_case(48, 1024, rht, 0xA5C3, 13);
  }
  amax_case(32, 98, true, 0x2D5B, 18);      // F not a multiple of the 64 columns of a warp
  amax_case(8192, 2048, true, 0x2D5B, 14);  // gpt2-124m's MLP at B 8: grid-stride loop
  // One outlier: the amaxes come from one element / one segment.
  amax_case(32, 384, true, 0x2D5B, 15, [](std::vector<double>& gu, int64_t, int64_t F) {
    gu[(size_t)(17 * 2 * F + 300)] = 1000.0;
    gu[(size_t)(17 * 2 * F + F + 300)] = -20.0;
  });
  // A NaN (left out of both amaxes, flagged) and an Inf (kept).
  amax_case(32, 128, true, 0x2D5B, 16, [](std::vector<double>& gu, int64_t, int64_t F) {
    gu[(size_t)(3 * 2 * F + F + 5)] = std::nan("");
  });
  amax_case(32, 128, true, 0x2D5B, 17, [](std::vector<double>& gu, int64_t, int64_t F) {
    gu[(size_t)(9 * 2 * F + F + 77)] = INFINITY;
  });
}

TEST_F(OpsSwigluCuda, OutputAmaxesRejectShapesTheKernelCannotTile) {
  Tensor amax = Tensor::zeros({2}, DType::kF32, Device::kCuda);
  OutputAmaxes a;
  a.amax = amax.ptr<float>();
  Tensor gu = Tensor::zeros({24, 256}, DType::kBF16, Device::kCuda);  // N % 16 != 0
  Tensor out = Tensor::zeros({24, 128}, DType::kBF16, Device::kCuda);
  EXPECT_THROW(swiglu_forward(out.view(), gu.view(), nullptr, &a), Error);
  Tensor gu2 = Tensor::zeros({16, 194}, DType::kBF16, Device::kCuda);  // F = 97: odd
  Tensor out2 = Tensor::zeros({16, 97}, DType::kBF16, Device::kCuda);
  EXPECT_THROW(swiglu_forward(out2.view(), gu2.view(), nullptr, &a), Error);
  Tensor gu3 = Tensor::zeros({16, 256}, DType::kF32, Device::kCuda);  // f32
  Tensor out3 = Tensor::zeros({16, 128}, DType::kF32, Device::kCuda);
  EXPECT_THROW(swiglu_forward(out3.view(), gu3.view(), nullptr, &a), Error);
}

}  // namespace
}  // namespace fourbit::ops
