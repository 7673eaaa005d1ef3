// ops elementwise (cpu): add / add_inplace, f32 <-> bf16 casts (hand-checked bit patterns) and the
// NaN/Inf detector (counts, first index, flag, the error message), plus argument errors.
#include "dense_ops_test_util.h"
#include "ops/elementwise.h"
#include "ops/error_flags.h"
#include "quant/quantize.h"

#include <gtest/gtest.h>

#include <limits>

namespace fourbit::ops {
namespace {

using testing::host_tensor;
using testing::random_normal;
using testing::values_of;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(OpsElementwise, AddHandComputed) {
  for (DType dt : {DType::kF32, DType::kF64}) {
    const Tensor a = host_tensor({2, 3}, dt, {1, 2, 3, -4, 0.5, 1e30});
    const Tensor b = host_tensor({2, 3}, dt, {10, -2, 0.25, 4, 0.5, -1e30});
    Tensor out = host_tensor({2, 3}, dt, {9, 9, 9, 9, 9, 9});
    add(out, a, b);
    EXPECT_EQ(values_of(out), (std::vector<double>{11, 0, 3.25, 0, 1, 0}));
    add_inplace(a, b);
    EXPECT_EQ(values_of(a), values_of(out));
  }
}

TEST(OpsElementwise, AddEmptyAndErrors) {
  Tensor e = Tensor::empty({0, 4}, DType::kF32, Device::kCpu);
  add(Tensor::empty({0, 4}, DType::kF32, Device::kCpu), e, Tensor::empty({0, 4}, DType::kF32, Device::kCpu));

  const Tensor a = host_tensor({4}, DType::kF32, {1, 2, 3, 4});
  const Tensor b64 = host_tensor({4}, DType::kF64, {1, 2, 3, 4});
  const Tensor b5 = host_tensor({5}, DType::kF32, {1, 2, 3, 4, 5});
  Tensor out = host_tensor({4}, DType::kF32, {0, 0, 0, 0});
  EXPECT_NE(error_of([&] { add(out, a, b64); }).find("one dtype"), std::string::npos);
  EXPECT_NE(error_of([&] { add(out, a, b5); }).find("b must have shape (4)"), std::string::npos);
  EXPECT_NE(error_of([&] { add(a, a, a); }).find("add_inplace"), std::string::npos);
  const Tensor bf = host_tensor({4}, DType::kBF16, {1, 2, 3, 4});
  EXPECT_NE(error_of([&] { add(out, a, bf); }).find("f32 or f64"), std::string::npos);
}

TEST(OpsElementwise, CastBitPatterns) {
  // 1 + 2^-8 and 1 + 3 * 2^-8 are ties: to even (0x3F80, 0x3F82); the largest finite f32 rounds
  // to Inf; NaN becomes the canonical 0x7FFF; -0 stays -0; an f32 subnormal stays subnormal.
  const std::vector<double> in = {1.0, 1.0 + std::ldexp(1, -8), 1.0 + 3 * std::ldexp(1, -8),
                                  (double)std::numeric_limits<float>::max(), kNaN, -0.0, -kInf,
                                  std::ldexp(1.0, -130)};
  const std::vector<uint16_t> want = {0x3F80, 0x3F80, 0x3F82, 0x7F80, 0x7FFF, 0x8000, 0xFF80, 0x0008};
  const Tensor x = host_tensor({(int64_t)in.size()}, DType::kF32, in);
  Tensor y = Tensor::empty(x.shape(), DType::kBF16, Device::kCpu);
  cast(y, x);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(y.ptr<uint16_t>()[i], want[i]) << "element " << i;
  Tensor back = Tensor::empty(x.shape(), DType::kF32, Device::kCpu);
  cast(back, y);
  EXPECT_EQ(back.ptr<float>()[0], 1.0f);
  EXPECT_EQ(back.ptr<float>()[2], 1.015625f);  // 0x3F82
  EXPECT_TRUE(std::isinf(back.ptr<float>()[3]));
  EXPECT_TRUE(std::isnan(back.ptr<float>()[4]));
  EXPECT_TRUE(std::signbit(back.ptr<float>()[5]));
  EXPECT_EQ(back.ptr<float>()[7], std::ldexp(1.0f, -130));
  EXPECT_NE(error_of([&] { cast(back, x); }).find("cast converts f32 <-> bf16"), std::string::npos);
}

TEST(OpsElementwise, NonFiniteCountsAndFlag) {
  for (DType dt : {DType::kF32, DType::kF64, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor clean = host_tensor({2, 3}, dt, {1, -2, 3e30, 0, -0.0, 1e-40});
    EXPECT_FALSE(count_nonfinite(clean).any());
    int flag = 0;
    flag_nonfinite(clean, &flag);
    EXPECT_EQ(flag, 0);
    check_finite(clean, "clean");

    const Tensor dirty = host_tensor({2, 3}, dt, {1, 2, kInf, kNaN, -kInf, kNaN});
    const NonFiniteSummary s = count_nonfinite(dirty);
    EXPECT_EQ(s.nan_count, 2);
    EXPECT_EQ(s.inf_count, 2);
    EXPECT_EQ(s.first_index, 2);
    flag_nonfinite(dirty, &flag);
    EXPECT_EQ(flag, kErrNonFinite);
    const std::string msg = error_of([&] { check_finite(dirty, "blocks.3.mlp.out"); });
    EXPECT_NE(msg.find("'blocks.3.mlp.out'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("2 NaN and 2 Inf"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[0, 2]"), std::string::npos) << msg;
  }
  // f32 overflow of a finite f64 is not the detector's business: f64 values are checked as is.
  const Tensor big = host_tensor({1}, DType::kF64, {1e300});
  EXPECT_FALSE(count_nonfinite(big).any());
}

// add_inplace with OutputAmaxes on the CPU: the sum is add_inplace's, and the amaxes are those
// the NVFP4 reference quantizer stores for it (row-wise plain, column-wise after the RHT).
TEST(OpsElementwise, AddInplaceOutputAmaxesEqualTheReferenceQuantizers) {
  const int64_t N = 32, C = 40;
  const std::vector<double> a = random_normal(N * C, 41), b = random_normal(N * C, 42, 3.0);
  quant::QuantConfig cfg;
  cfg.rht = true;
  Tensor plain = host_tensor({N, C}, DType::kF32, a), fused = host_tensor({N, C}, DType::kF32, a);
  const Tensor tb = host_tensor({N, C}, DType::kF32, b);
  add_inplace(plain, tb);
  float amax[2] = {0.0f, 0.0f};
  OutputAmaxes o;
  o.amax = &amax[0];
  o.rht_amax = &amax[1];
  o.rht_sign_mask = cfg.rht_sign_mask();
  add_inplace(fused, tb, nullptr, &o);
  EXPECT_EQ(values_of(fused), values_of(plain));
  const quant::QuantizedTensor q = quant::quantize_reference(plain.view(), cfg, {true, true}, {"sum", {}});
  EXPECT_EQ(amax[0], *q.rowwise->amax.ptr<float>());
  EXPECT_EQ(amax[1], *q.colwise->amax.ptr<float>());
  Tensor odd = host_tensor({20, 4}, DType::kF32, random_normal(80, 43));  // 20 rows: no 16-row segments
  EXPECT_THROW(add_inplace(odd, odd, nullptr, &o), Error);
}

}  // namespace
}  // namespace fourbit::ops
