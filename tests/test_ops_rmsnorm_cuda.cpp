// ops rmsnorm (gpu): the CUDA forward and backward against the CPU reference run in f32 on the same
// inputs (rounded to the kernel's input dtypes), for bf16 and f32 activations and weights, odd and
// large shapes (both register-group counts J = 1, 2 of the kernel, the C limit, multi-row backward chunks,
// a grid-stride forward), misaligned rows (the scalar path), with guard regions around every
// output and the workspace; determinism of the backward (same bits twice); and
// rmsnorm_backward_accumulate equal bit for bit to the backward followed by add_inplace (BF16 rows of
// C <= 4096 go through the backward's two-rows-at-a-time loop; with amaxes through the one-row loop,
// so AccumulateWithAmaxesEqualsTheSeparateAdd also checks that the two loops give the same bits).
//
// Tolerances (u = 2^-24; a sum of n FP32 terms, in any order, is within n u sum|terms| of the
// exact sum, and both sides make such an error):
//   rstd:    (2C + 16) u |rstd|                      (sum of C squares, sqrt, division)
//   y:       (2C + 16) u |y|      + 2^-8 |y| if bf16 (rounding the output to BF16: half an ulp)
//   dx:      (2C + 16) u M        + 2^-8 |dx| if bf16, M = r |g| + r^3 |x| sum_c |g x| / C
//   dweight: (2N + 16) u (|dweight_0| + sum_n |dy xhat|)          (f32 accumulation over tokens)
#include "dense_ops_test_util.h"
#include "ops/elementwise.h"
#include "ops/error_flags.h"
#include "ops/rmsnorm.h"

#include <gtest/gtest.h>

#include <cmath>

namespace fourbit::ops {
namespace {

using testing::all_close;
using testing::Guarded;
using testing::host_tensor;
using testing::random_normal;
using testing::rounded;
using testing::values_of;

constexpr double kU = 1.0 / (1 << 24);
constexpr uint8_t kPoison = 0x7F;  // f32 and bf16 0x7F7F... = 3.4e38: an unwritten output shows

class OpsRmsnormCuda : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_GT(cuda_device_count(), 0) << "the gpu tests need a CUDA GPU"; }
};

struct Case {
  int64_t N, C;
  DType act, weight;
  bool misaligned;
};

void run_case(const Case& cs) {
  const int64_t N = cs.N, C = cs.C;
  SCOPED_TRACE(::testing::Message() << "N " << N << " C " << C << " act " << dtype_name(cs.act)
                                    << " weight " << dtype_name(cs.weight)
                                    << (cs.misaligned ? " misaligned" : ""));
  const float eps = 1e-5f;
  const int64_t shift = cs.misaligned ? (cs.act == DType::kBF16 ? 2 : 4) : 0;
  const std::vector<double> x = rounded(random_normal(N * C, 100 + C, 2.0), cs.act);
  const std::vector<double> w = rounded(random_normal(C, 200 + C), cs.weight);
  const std::vector<double> dy = rounded(random_normal(N * C, 300 + C), cs.act);
  const std::vector<double> dw0 = random_normal(C, 400 + C, 0.1);

  // Reference (f32 on the rounded inputs).
  const Tensor rx = host_tensor({N, C}, DType::kF32, x), rw = host_tensor({C}, DType::kF32, w);
  Tensor ry = Tensor::empty({N, C}, DType::kF32, Device::kCpu), rr = Tensor::empty({N}, DType::kF32, Device::kCpu);
  rmsnorm_forward(ry, rr, rx, rw, eps);
  Tensor rdx = Tensor::empty({N, C}, DType::kF32, Device::kCpu);
  Tensor rdw = host_tensor({C}, DType::kF32, dw0);
  rmsnorm_backward(rdx, rdw, host_tensor({N, C}, DType::kF32, dy), rx, rw, rr, TensorView{});
  const std::vector<double> want_y = values_of(ry), want_r = values_of(rr), want_dx = values_of(rdx),
                            want_dw = values_of(rdw);

  // Error scales (float64).
  std::vector<double> m_dx((size_t)(N * C)), m_dw((size_t)C);
  for (int64_t c = 0; c < C; ++c) m_dw[(size_t)c] = std::fabs((double)(float)dw0[(size_t)c]);
  for (int64_t n = 0; n < N; ++n) {
    const double r = want_r[(size_t)n];
    double s = 0;
    for (int64_t c = 0; c < C; ++c) s += std::fabs(dy[(size_t)(n * C + c)] * w[(size_t)c] * x[(size_t)(n * C + c)]);
    for (int64_t c = 0; c < C; ++c) {
      const size_t i = (size_t)(n * C + c);
      m_dx[i] = r * std::fabs(dy[i] * w[(size_t)c]) + r * r * r * std::fabs(x[i]) * s / (double)C;
      m_dw[(size_t)c] += std::fabs(dy[i] * x[i] * r);
    }
  }
  const double out_round = cs.act == DType::kBF16 ? 1.0 / 256 : 0.0;
  const double kc = (2.0 * (double)C + 16) * kU, kn = (2.0 * (double)N + 16) * kU;

  // Device run.
  const Guarded gx = Guarded::copy_of(host_tensor({N, C}, cs.act, x), kPoison, shift);
  const Guarded gw = Guarded::copy_of(host_tensor({C}, cs.weight, w), kPoison);
  const Guarded gdy = Guarded::copy_of(host_tensor({N, C}, cs.act, dy), kPoison, shift);
  const Guarded gy = Guarded::make({N, C}, cs.act, kPoison, shift);
  const Guarded gr = Guarded::make({N}, DType::kF32, kPoison);
  rmsnorm_forward(gy.view, gr.view, gx.view, gw.view, eps);
  EXPECT_EQ(gy.damaged_guard_bytes(), 0) << "forward wrote outside y";
  EXPECT_EQ(gr.damaged_guard_bytes(), 0) << "forward wrote outside rstd";
  EXPECT_TRUE(all_close(gr.values(), want_r, [&](int64_t i) { return kc * std::fabs(want_r[(size_t)i]); }, "rstd"));
  EXPECT_TRUE(all_close(gy.values(), want_y, [&](int64_t i) { return (kc + out_round) * std::fabs(want_y[(size_t)i]) + 1e-30; }, "y"));

  // Backward on the reference's rstd, so that both sides consume identical inputs.
  const Guarded grr = Guarded::copy_of(rr, kPoison);
  const Guarded ws = Guarded::make({rmsnorm_backward_workspace_bytes(N, C)}, DType::kU8, kPoison);
  std::vector<double> first_dx, first_dw;
  for (int rep = 0; rep < 2; ++rep) {
    const Guarded gdx = Guarded::make({N, C}, cs.act, kPoison, shift);
    const Guarded gdw = Guarded::copy_of(host_tensor({C}, DType::kF32, dw0), kPoison);
    rmsnorm_backward(gdx.view, gdw.view, gdy.view, gx.view, gw.view, grr.view, ws.view);
    EXPECT_EQ(gdx.damaged_guard_bytes(), 0) << "backward wrote outside dx";
    EXPECT_EQ(gdw.damaged_guard_bytes(), 0) << "backward wrote outside dweight";
    EXPECT_EQ(ws.damaged_guard_bytes(), 0) << "backward wrote outside its workspace";
    const std::vector<double> got_dx = gdx.values(), got_dw = gdw.values();
    if (rep == 0) {
      EXPECT_TRUE(all_close(got_dx, want_dx, [&](int64_t i) { return kc * m_dx[(size_t)i] + out_round * std::fabs(want_dx[(size_t)i]) + 1e-30; }, "dx"));
      EXPECT_TRUE(all_close(got_dw, want_dw, [&](int64_t i) { return kn * m_dw[(size_t)i] + 1e-30; }, "dweight"));
      first_dx = got_dx;
      first_dw = got_dw;
    } else {
      EXPECT_TRUE(got_dx == first_dx) << "dx differs between two identical runs";
      EXPECT_TRUE(got_dw == first_dw) << "dweight differs between two identical runs (not deterministic)";
    }
  }
  // rmsnorm_backward_accumulate onto a prior gradient: the bits of rmsnorm_backward into a
  // temporary followed by add_inplace, and the same dweight.
  const Tensor prior = host_tensor({N, C}, cs.act, rounded(random_normal(N * C, 500 + C), cs.act));
  const Guarded sum = Guarded::copy_of(prior, kPoison, shift), acc = Guarded::copy_of(prior, kPoison, shift);
  const Guarded tmp = Guarded::make({N, C}, cs.act, kPoison, shift);
  const Guarded dw_sep = Guarded::copy_of(host_tensor({C}, DType::kF32, dw0), kPoison);
  const Guarded dw_acc = Guarded::copy_of(host_tensor({C}, DType::kF32, dw0), kPoison);
  rmsnorm_backward(tmp.view, dw_sep.view, gdy.view, gx.view, gw.view, grr.view, ws.view);
  add_inplace(sum.view, tmp.view);
  rmsnorm_backward_accumulate(acc.view, dw_acc.view, gdy.view, gx.view, gw.view, grr.view, ws.view);
  EXPECT_EQ(acc.damaged_guard_bytes(), 0) << "accumulate wrote outside dx";
  EXPECT_EQ(dw_acc.damaged_guard_bytes(), 0) << "accumulate wrote outside dweight";
  EXPECT_TRUE(acc.values() == sum.values()) << "accumulated dx differs from backward + add_inplace";
  EXPECT_TRUE(dw_acc.values() == first_dw) << "accumulate's dweight differs from the backward's";
}

TEST_F(OpsRmsnormCuda, MatchesReference) {
  const Case cases[] = {
      {1, 1, DType::kF32, DType::kF32, false},
      {3, 7, DType::kBF16, DType::kBF16, false},
      {17, 768, DType::kBF16, DType::kBF16, false},
      {17, 768, DType::kF32, DType::kBF16, false},
      {33, 1000, DType::kBF16, DType::kF32, false},
      {64, 4096, DType::kBF16, DType::kBF16, false},
      {5, 4097, DType::kBF16, DType::kBF16, false},    // ragged last group
      {9, 4104, DType::kF32, DType::kF32, true},       // misaligned rows: scalar path
      {9, 4104, DType::kBF16, DType::kBF16, true},
      {6, 12000, DType::kBF16, DType::kBF16, false},   // J = 2
      {3, 16384, DType::kBF16, DType::kF32, false},    // the limit
      {2, 16384, DType::kF32, DType::kF32, false},
      {1000, 136, DType::kBF16, DType::kBF16, false},  // 1 row per backward chunk (1000 chunks)
      {8192, 768, DType::kBF16, DType::kBF16, false},  // GPT-2 small at B 8: 4-row chunks
      {3000, 2100, DType::kBF16, DType::kF32, false},  // wide rows: <= 1997 chunks (workspace), 2-row chunks
      {70001, 64, DType::kBF16, DType::kBF16, false},  // grid-stride forward, 35-row chunks
      // The BF16 backward's paired rows (C <= 4096): odd chunks (a last row without a partner),
      // a ragged last group, misaligned rows.
      {4099, 1001, DType::kBF16, DType::kF32, false},  // 3-row chunks, ragged last group
      {33, 1004, DType::kBF16, DType::kBF16, true},    // misaligned rows: scalar loads of both rows
  };
  for (const Case& cs : cases) run_case(cs);
}

TEST_F(OpsRmsnormCuda, ColumnLimit) {
  const int64_t C = 16385;
  Tensor x = Tensor::zeros({1, C}, DType::kBF16, Device::kCuda), y = Tensor::zeros({1, C}, DType::kBF16, Device::kCuda);
  Tensor w = Tensor::zeros({C}, DType::kBF16, Device::kCuda), r = Tensor::zeros({1}, DType::kF32, Device::kCuda);
  try {
    rmsnorm_forward(y, r, x, w, 1e-5f);
    ADD_FAILURE() << "C = 16385 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("exceeds the CUDA kernel's limit of 16384"), std::string::npos) << e.what();
  }
}

// rmsnorm_backward_accumulate with OutputAmaxes: dx and dweight bit for bit those of the backward
// into a temporary plus add_inplace with the same amaxes, and the amaxes (plain and after the RHT)
// bit for bit add_inplace's; a NaN / Inf in the sum sets the flag; shapes the kernel cannot
// segment are refused with a message.
TEST_F(OpsRmsnormCuda, AccumulateWithAmaxesEqualsTheSeparateAdd) {
  struct Case {
    int64_t N, C;
    DType weight;
    bool rht;
    double poke;  // written into the prior gradient at one element (0: none)
  };
  for (const Case& k : {Case{16384, 768, DType::kF32, true, 0}, Case{32768, 768, DType::kBF16, true, 0},
                        Case{16384, 2048, DType::kF32, true, 0}, Case{32768, 64, DType::kF32, true, 0},
                        Case{16384, 1000, DType::kF32, false, 0}, Case{16384, 768, DType::kF32, true, INFINITY},
                        Case{16384, 768, DType::kF32, true, NAN}}) {
    const int64_t N = k.N, C = k.C;
    SCOPED_TRACE(::testing::Message() << N << " x " << C << " rht " << k.rht << " poke " << k.poke);
    ASSERT_TRUE(rmsnorm_backward_accumulate_amaxes_supported(N, C));
    const std::vector<double> x = rounded(random_normal(N * C, 600 + C, 2.0), DType::kBF16);
    const std::vector<double> w = rounded(random_normal(C, 700 + C), k.weight);
    const std::vector<double> dy = rounded(random_normal(N * C, 800 + C), DType::kBF16);
    std::vector<double> prior = rounded(random_normal(N * C, 900 + C, 3.0), DType::kBF16);
    if (k.poke != 0) prior[(size_t)(N * C / 3 + 7)] = k.poke;
    const Tensor gx = host_tensor({N, C}, DType::kBF16, x).to(Device::kCuda);
    const Tensor gw = host_tensor({C}, k.weight, w).to(Device::kCuda);
    const Tensor gdy = host_tensor({N, C}, DType::kBF16, dy).to(Device::kCuda);
    Tensor y = Tensor::empty({N, C}, DType::kBF16, Device::kCuda), r = Tensor::empty({N}, DType::kF32, Device::kCuda);
    rmsnorm_forward(y.view(), r.view(), gx.view(), gw.view(), 1e-5f);
    const Tensor ws = Tensor::zeros({rmsnorm_backward_workspace_bytes(N, C)}, DType::kU8, Device::kCuda);
    const Tensor hp = host_tensor({N, C}, DType::kBF16, prior);
    const Guarded sum = Guarded::copy_of(hp, kPoison), acc = Guarded::copy_of(hp, kPoison);
    Tensor tmp = Tensor::empty({N, C}, DType::kBF16, Device::kCuda);
    Tensor dw_sep = Tensor::zeros({C}, DType::kF32, Device::kCuda), dw_acc = Tensor::zeros({C}, DType::kF32, Device::kCuda);
    Tensor amax_sep = Tensor::zeros({2}, DType::kF32, Device::kCuda), amax_acc = Tensor::zeros({2}, DType::kF32, Device::kCuda);
    Tensor flag_sep = Tensor::zeros({1}, DType::kI32, Device::kCuda), flag_acc = Tensor::zeros({1}, DType::kI32, Device::kCuda);
    auto amaxes = [&](Tensor& a, Tensor& f) {
      OutputAmaxes o;
      o.amax = a.ptr<float>();
      o.rht_amax = k.rht ? a.ptr<float>() + 1 : nullptr;
      o.rht_sign_mask = 0xA5C3;
      o.nonfinite_flag = f.ptr<int>();
      return o;
    };
    const OutputAmaxes o_sep = amaxes(amax_sep, flag_sep), o_acc = amaxes(amax_acc, flag_acc);
    rmsnorm_backward(tmp.view(), dw_sep.view(), gdy.view(), gx.view(), gw.view(), r.view(), ws.view());
    add_inplace(sum.view, tmp.view(), nullptr, &o_sep);
    rmsnorm_backward_accumulate(acc.view, dw_acc.view(), gdy.view(), gx.view(), gw.view(), r.view(), ws.view(),
                                nullptr, &o_acc);
    EXPECT_EQ(acc.damaged_guard_bytes(), 0) << "accumulate wrote outside dx";
    const std::vector<double> a = acc.values(), b = sum.values();
    int64_t differ = 0;
    for (size_t i = 0; i < a.size(); ++i) differ += !(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i])));
    EXPECT_EQ(differ, 0) << "accumulated dx differs from backward + add_inplace";
    EXPECT_TRUE(values_of(dw_acc) == values_of(dw_sep)) << "dweight differs";
    const std::vector<double> got = values_of(amax_acc), want = values_of(amax_sep);  // f32, exact
    EXPECT_EQ(got[0], want[0]) << "amax";
    if (k.rht) {
      EXPECT_EQ(got[1], want[1]) << "RHT amax";
      EXPECT_GT(got[1], 0.0);
    }
    EXPECT_GT(got[0], 0.0);
    const int want_flag = read_and_clear_error_flag(flag_sep.ptr<int>());
    EXPECT_EQ(read_and_clear_error_flag(flag_acc.ptr<int>()), want_flag);
    EXPECT_EQ(want_flag, std::isfinite(k.poke) ? 0 : kErrNonFinite);
  }
  // Too few rows for 16-row chunks (8192 x 768 keeps 4-row chunks), and too wide for the slots.
  EXPECT_FALSE(rmsnorm_backward_accumulate_amaxes_supported(8192, 768));
  EXPECT_FALSE(rmsnorm_backward_accumulate_amaxes_supported(16384, 4096));
  const int64_t N = 8192, C = 768;
  Tensor z = Tensor::zeros({N, C}, DType::kBF16, Device::kCuda), z2 = Tensor::zeros({N, C}, DType::kBF16, Device::kCuda);
  Tensor z3 = Tensor::zeros({N, C}, DType::kBF16, Device::kCuda);
  Tensor wt = Tensor::zeros({C}, DType::kF32, Device::kCuda), dw = Tensor::zeros({C}, DType::kF32, Device::kCuda);
  Tensor rr = Tensor::zeros({N}, DType::kF32, Device::kCuda), am = Tensor::zeros({2}, DType::kF32, Device::kCuda);
  const Tensor ws = Tensor::zeros({rmsnorm_backward_workspace_bytes(N, C)}, DType::kU8, Device::kCuda);
  OutputAmaxes o;
  o.amax = am.ptr<float>();
  try {
    rmsnorm_backward_accumulate(z.view(), dw.view(), z2.view(), z3.view(), wt.view(), rr.view(), ws.view(), nullptr, &o);
    ADD_FAILURE() << "8192 x 768 with amaxes was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rmsnorm_backward_accumulate_amaxes_supported"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace fourbit::ops
