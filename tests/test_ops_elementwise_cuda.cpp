// ops elementwise (gpu): the CUDA add, add_inplace, cast and NaN/Inf detector against the CPU
// reference, on odd sizes, every dtype combination and misaligned (scalar-path) pointers, with
// guard regions around every output. add_inplace with OutputAmaxes: the sum equals the plain
// add_inplace's bit for bit and the amaxes equal quant::amax_cuda on it bit for bit.
//
// Tolerance: none. add computes one FP32 addition of the exact input values and rounds once to the
// output dtype, which is exactly what the f32 reference followed by a round-to-bf16 does; the casts
// are the same codec on both sides (formats/element.h). So every output must match bit for bit.
#include "dense_ops_test_util.h"
#include "ops/elementwise.h"
#include "ops/error_flags.h"
#include "quant/quantize.h"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>

namespace fourbit::ops {
namespace {

using testing::Guarded;
using testing::host_tensor;
using testing::random_normal;
using testing::rounded;
using testing::values_of;

class OpsElementwiseCuda : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_GT(cuda_device_count(), 0) << "the gpu tests need a CUDA GPU"; }
};

double exact(int64_t) { return 0.0; }

const int64_t kSizes[] = {1, 7, 8, 9, 4097, (1 << 20) + 3};

// Bytes that move a tensor off 16-byte alignment while keeping its element alignment.
int64_t misalign(DType dt) { return dt == DType::kBF16 ? 2 : 4; }

TEST_F(OpsElementwiseCuda, AddMatchesReferenceExactly) {
  const DType types[] = {DType::kF32, DType::kBF16};
  for (int64_t n : kSizes)
    for (DType to : types)
      for (DType ta : types)
        for (DType tb : types)
          for (bool shifted : {false, true}) {
            SCOPED_TRACE(::testing::Message() << "n " << n << " out " << dtype_name(to) << " a "
                                              << dtype_name(ta) << " b " << dtype_name(tb)
                                              << (shifted ? " misaligned" : ""));
            const std::vector<double> a = rounded(random_normal(n, 1 + n, 3.0), ta);
            const std::vector<double> b = rounded(random_normal(n, 2 + n), tb);
            std::vector<double> want((size_t)n);
            for (int64_t i = 0; i < n; ++i) want[(size_t)i] = (double)((float)a[(size_t)i] + (float)b[(size_t)i]);
            want = rounded(want, to);

            const Guarded da = Guarded::copy_of(host_tensor({n}, ta, a), 0x5A, shifted ? misalign(ta) : 0);
            const Guarded db = Guarded::copy_of(host_tensor({n}, tb, b), 0x5A, shifted ? misalign(tb) : 0);
            const Guarded out = Guarded::make({n}, to, 0xA5, shifted ? misalign(to) : 0);
            add(out.view, da.view, db.view);
            EXPECT_EQ(out.damaged_guard_bytes(), 0) << "add wrote outside its output";
            EXPECT_TRUE(testing::all_close(out.values(), want, exact, "add"));
            if (ta == to) {
              add_inplace(da.view, db.view);
              EXPECT_EQ(da.damaged_guard_bytes(), 0) << "add_inplace wrote outside a";
              EXPECT_TRUE(testing::all_close(da.values(), want, exact, "add_inplace"));
            }
          }
}

TEST_F(OpsElementwiseCuda, CastMatchesReferenceBitForBit) {
  for (int64_t n : kSizes)
    for (bool shifted : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "n " << n << (shifted ? " misaligned" : ""));
      std::vector<double> v = random_normal(n, 7 + n, 100.0);
      const double specials[] = {std::numeric_limits<double>::quiet_NaN(),
                                 std::numeric_limits<double>::infinity(), -0.0, 1e-40,
                                 (double)std::numeric_limits<float>::max(), 1.0 + std::ldexp(1, -8)};
      for (size_t i = 0; i < std::size(specials) && (int64_t)i < n; ++i) v[(size_t)(i * 3 % n)] = specials[i];
      const Tensor x32 = host_tensor({n}, DType::kF32, v);
      Tensor want16 = Tensor::empty({n}, DType::kBF16, Device::kCpu);
      cast(want16, x32);
      Tensor want32 = Tensor::empty({n}, DType::kF32, Device::kCpu);
      cast(want32, want16);

      const Guarded dx = Guarded::copy_of(x32, 0x11, shifted ? 4 : 0);
      const Guarded d16 = Guarded::make({n}, DType::kBF16, 0xA5, shifted ? 2 : 0);
      cast(d16.view, dx.view);
      const Guarded d32 = Guarded::make({n}, DType::kF32, 0xA5, shifted ? 4 : 0);
      cast(d32.view, d16.view);
      EXPECT_EQ(d16.damaged_guard_bytes(), 0);
      EXPECT_EQ(d32.damaged_guard_bytes(), 0);
      Tensor got16 = Tensor::empty({n}, DType::kBF16, Device::kCpu);
      copy_tensor(got16.view(), d16.view);
      Tensor got32 = Tensor::empty({n}, DType::kF32, Device::kCpu);
      copy_tensor(got32.view(), d32.view);
      EXPECT_EQ(std::memcmp(got16.data(), want16.data(), (size_t)want16.nbytes()), 0)
          << "f32 -> bf16 differs from the CPU codec";
      EXPECT_EQ(std::memcmp(got32.data(), want32.data(), (size_t)want32.nbytes()), 0)
          << "bf16 -> f32 differs from the CPU codec";
    }
}

TEST_F(OpsElementwiseCuda, NonFiniteDetector) {
  const int64_t n = (1 << 20) + 5;
  for (DType dt : {DType::kF32, DType::kBF16})
    for (bool shifted : {false, true}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << (shifted ? " misaligned" : ""));
      std::vector<double> v = random_normal(n, 3, 1e30);  // huge but finite in f32 and bf16
      const Guarded clean = Guarded::copy_of(host_tensor({n}, dt, v), 0, shifted ? misalign(dt) : 0);
      EXPECT_FALSE(count_nonfinite(clean.view).any());
      check_finite(clean.view, "clean");

      v[777777] = std::numeric_limits<double>::quiet_NaN();
      v[(size_t)n - 1] = std::numeric_limits<double>::quiet_NaN();
      v[1000] = -std::numeric_limits<double>::infinity();
      const Tensor host = host_tensor({n}, dt, v);
      const NonFiniteSummary want = count_nonfinite(host);
      ASSERT_EQ(want.nan_count, 2);
      const Guarded dirty = Guarded::copy_of(host, 0, shifted ? misalign(dt) : 0);
      const NonFiniteSummary got = count_nonfinite(dirty.view);
      EXPECT_EQ(got.nan_count, want.nan_count);
      EXPECT_EQ(got.inf_count, want.inf_count);
      EXPECT_EQ(got.first_index, 1000);

      Tensor flag = Tensor::zeros({1}, DType::kI32, Device::kCuda);
      flag_nonfinite(clean.view, flag.ptr<int>());
      EXPECT_EQ(read_and_clear_error_flag(flag.ptr<int>()), 0);
      flag_nonfinite(dirty.view, flag.ptr<int>());
      flag_nonfinite(clean.view, flag.ptr<int>());
      EXPECT_EQ(read_and_clear_error_flag(flag.ptr<int>()), kErrNonFinite);
      EXPECT_EQ(read_and_clear_error_flag(flag.ptr<int>()), 0) << "the flag was not cleared";
      try {
        check_finite(dirty.view, "lm_head.out");
        ADD_FAILURE() << "check_finite did not throw";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("'lm_head.out'"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("first is at [1000]"), std::string::npos) << e.what();
      }
    }
}

TEST_F(OpsElementwiseCuda, AddInplaceOutputAmaxesEqualTheQuantizersAmaxPass) {
  auto read2 = [](const Tensor& t) {
    std::array<float, 2> h{};
    device_memcpy(h.data(), Device::kCpu, t.data(), Device::kCuda, sizeof(h));
    return h;
  };
  auto bits = [](float x) {
    uint32_t b;
    std::memcpy(&b, &x, 4);
    return b;
  };
  struct Case {
    int64_t n, c;
    bool rht;
    uint16_t mask;
    double poke;  // a value written at one element of b (0: none)
  };
  for (const Case& k : {Case{16, 128, true, 0x2D5B, 0}, Case{64, 768, true, 0xA5C3, 0}, Case{16, 66, true, 0x2D5B, 0},
                        Case{48, 256, false, 0, 0}, Case{8192, 768, true, 0x2D5B, 0},
                        Case{32, 384, true, 0x2D5B, -500.0}, Case{32, 128, true, 0x2D5B, NAN},
                        Case{32, 128, true, 0x2D5B, INFINITY}}) {
    SCOPED_TRACE(::testing::Message() << k.n << " x " << k.c << " rht " << k.rht << " poke " << k.poke);
    std::vector<double> a = rounded(random_normal(k.n * k.c, 31, 2.0), DType::kBF16);
    std::vector<double> b = rounded(random_normal(k.n * k.c, 32, 0.5), DType::kBF16);
    if (k.poke != 0) b[(size_t)(k.n * k.c / 2 + 5)] = k.poke;
    const Tensor ha = host_tensor({k.n, k.c}, DType::kBF16, a), hb = host_tensor({k.n, k.c}, DType::kBF16, b);
    const Guarded plain = Guarded::copy_of(ha, 0x7F), fused = Guarded::copy_of(ha, 0x7F);
    const Guarded gb = Guarded::copy_of(hb, 0x7F);
    Tensor amax = Tensor::zeros({2}, DType::kF32, Device::kCuda);
    Tensor flag = Tensor::zeros({1}, DType::kI32, Device::kCuda);
    OutputAmaxes o;
    o.amax = amax.ptr<float>();
    o.rht_amax = k.rht ? amax.ptr<float>() + 1 : nullptr;
    o.rht_sign_mask = k.mask;
    o.nonfinite_flag = flag.ptr<int>();
    add_inplace(plain.view, gb.view);
    add_inplace(fused.view, gb.view, nullptr, &o);
    EXPECT_EQ(fused.damaged_guard_bytes(), 0);
    const std::vector<double> f = fused.values(), pv = plain.values();
    bool same = f.size() == pv.size();
    for (size_t i = 0; same && i < f.size(); ++i) same = f[i] == pv[i] || (std::isnan(f[i]) && std::isnan(pv[i]));
    EXPECT_TRUE(same) << "the fused add's sum differs from add_inplace's";
    Tensor want = Tensor::zeros({2}, DType::kF32, Device::kCuda);
    Tensor want_flag = Tensor::zeros({1}, DType::kI32, Device::kCuda);
    quant::amax_cuda(plain.view, want.ptr<float>(), want.ptr<float>() + 1, k.rht, k.mask,
                     want_flag.ptr<int>(), nullptr);
    const std::array<float, 2> got = read2(amax), w = read2(want);
    EXPECT_EQ(bits(got[0]), bits(w[0])) << got[0] << " vs the amax pass's " << w[0];
    if (k.rht) {
      EXPECT_EQ(bits(got[1]), bits(w[1])) << got[1] << " vs the amax pass's " << w[1];
    }
    EXPECT_EQ(read_and_clear_error_flag(flag.ptr<int>()), std::isfinite(k.poke) ? 0 : kErrNonFinite);
  }
  // Shapes the kernel cannot tile are refused with a message.
  Tensor x = Tensor::zeros({24, 128}, DType::kBF16, Device::kCuda), amax = Tensor::zeros({2}, DType::kF32, Device::kCuda);
  OutputAmaxes o;
  o.amax = amax.ptr<float>();
  EXPECT_THROW(add_inplace(x.view(), x.view(), nullptr, &o), Error);
}

}  // namespace
}  // namespace fourbit::ops
