// quant: the CPU reference quantizers against NUMERICS.md section 9 vectors, plus properties that
// must hold on random data (2D transposition, RHT inverse and outlier spreading, Four Over Six,
// statistical unbiasedness of stochastic rounding and the bias of round-to-nearest).
#include "formats/element.h"
#include "quant/quantize.h"
#include "quant/report.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

namespace fourbit::quant {
namespace {

using formats::f32_bits;
using formats::f32_from_bits;

Tensor host_tensor(const std::vector<float>& v, int64_t rows, int64_t cols) {
  Tensor t = Tensor::empty({rows, cols}, DType::kF32, Device::kCpu);
  std::copy(v.begin(), v.end(), t.ptr<float>());
  return t;
}

uint8_t fp4_code(const QuantizedData& d, int64_t r, int64_t c) {
  const uint8_t* row = d.data.ptr<const uint8_t>() + r * ((d.cols + 1) / 2);
  return formats::unpack_e2m1(row[c / 2], (int)(c & 1));
}

QuantizedTensor quantize(const Tensor& t, QuantConfig cfg, Orientations o = {true, false},
                         uint64_t seed = 0) {
  QuantizeOptions opt;
  opt.tensor_name = "test";
  opt.sr = RandomStream{seed, 3};
  return quantize_reference(t.view(), cfg, o, opt);
}

// ---- NUMERICS 9.5 / 9.6: MXFP8 ---------------------------------------------------------------

TEST(Mxfp8, ScaleCodeTable) {
  struct V { float amax; uint8_t rceil, floor; };
  const V v[] = {{448.0f, 0x7F, 0x7F},
                 {std::nextafter(448.0f, 1e9f), 0x80, 0x7F},
                 {500.0f, 0x80, 0x7F},
                 {300.0f, 0x7F, 0x7F},
                 {460.0f, 0x80, 0x7F},
                 {1.0f, 0x77, 0x77},
                 {0.0f, 0x00, 0x00},
                 {3.0e38f, 0xF7, 0xF6}};
  for (const V& x : v) {
    EXPECT_EQ(mxfp8_scale_code(x.amax, MxScaleRule::kRoundUp), x.rceil) << x.amax;
    EXPECT_EQ(mxfp8_scale_code(x.amax, MxScaleRule::kFloor), x.floor) << x.amax;
  }
}

TEST(Mxfp8, Numerics96Block) {
  std::vector<float> v = {500, -3.3f, 0.01f, 1.0f, 250, -460, 100, 0};
  for (int i = 0; i < 24; ++i) v.push_back(0.5f * i);
  const Tensor t = host_tensor(v, 1, 32);
  QuantConfig cfg;
  cfg.format = Format::kMxfp8;
  QuantizedTensor q = quantize(t, cfg);
  EXPECT_EQ(q.rowwise->scales.ptr<uint8_t>()[0], 0x80);
  const uint8_t rceil[8] = {0x78, 0xBD, 0x03, 0x30, 0x70, 0xF6, 0x64, 0x00};
  const float rceil_values[8] = {512, -3.25f, 0.01171875f, 1.0f, 256, -448, 96, 0};
  Tensor deq = dequantize_reference(q, false);
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(q.rowwise->data.ptr<uint8_t>()[i], rceil[i]) << i;
    EXPECT_EQ(deq.ptr<float>()[i], rceil_values[i]) << i;
  }
  cfg.mx_scale_rule = MxScaleRule::kFloor;
  q = quantize(t, cfg);
  EXPECT_EQ(q.rowwise->scales.ptr<uint8_t>()[0], 0x7F);
  const uint8_t floor_codes[8] = {0x7E, 0xC5, 0x05, 0x38, 0x78, 0xFE, 0x6C, 0x00};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(q.rowwise->data.ptr<uint8_t>()[i], floor_codes[i]) << i;
}

// ---- NUMERICS 9.7: NVFP4 -----------------------------------------------------------------------

TEST(Nvfp4, Numerics97WorkedExample) {
  std::vector<float> v = {10, -5, 2.5f, 1, 0.3f, -0.1f, 0, -0.0f, 7.5f, -7.6f, 3.3f, 1.7f, 0.9f, 0.6f, -2.2f, 4.4f};
  for (int i = 0; i < 16; ++i) v.push_back((float)(0.001 * i));
  const Nvfp4TensorScales ts = nvfp4_tensor_scales(10.0f, kNvfp4GlobalConstant, kNvfp4GlobalConstant);
  EXPECT_EQ(f32_bits(ts.s_enc), 0x43866666u);
  EXPECT_EQ(f32_bits(ts.s_dec), 0x3B73CF3Eu);
  EXPECT_EQ(nvfp4_block_scale(10.0f, ts), 0x7E);
  EXPECT_EQ(f32_bits(nvfp4_element_multiplier(0x7E, ts)), 0x3F199999u);

  QuantizedTensor q = quantize(host_tensor(v, 1, 32), QuantConfig{});
  const QuantizedData& d = *q.rowwise;
  EXPECT_EQ(*d.amax.ptr<float>(), 10.0f);
  EXPECT_EQ(d.scales.ptr<uint8_t>()[0], 0x7E);
  EXPECT_EQ(d.scales.ptr<uint8_t>()[1], 0x33);
  const uint8_t codes0[16] = {7, 0xD, 3, 1, 0, 8, 0, 8, 6, 0xE, 4, 2, 1, 1, 0xB, 5};
  const uint8_t codes1[16] = {0, 1, 2, 2, 3, 4, 4, 5, 5, 6, 6, 6, 6, 7, 7, 7};
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(fp4_code(d, 0, i), codes0[i]) << i;
    EXPECT_EQ(fp4_code(d, 0, 16 + i), codes1[i]) << i;
  }
  const uint8_t packed[8] = {0xD7, 0x13, 0x80, 0x80, 0xE6, 0x24, 0x11, 0x5B};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(d.data.ptr<uint8_t>()[i], packed[i]) << i;
  const float deq0[16] = {10, -5, 2.5f, 0.8333f, 0, -0.0f, 0, -0.0f, 6.6667f, -6.6667f, 3.3333f, 1.6667f, 0.8333f, 0.8333f, -2.5f, 5.0f};
  Tensor deq = dequantize_reference(q, false);
  for (int i = 0; i < 16; ++i) EXPECT_NEAR(deq.ptr<float>()[i], deq0[i], 1e-4) << i;
  EXPECT_TRUE(std::signbit(deq.ptr<float>()[5]));
}

TEST(Nvfp4, Numerics97EdgeVectors) {
  // S_enc = 1 by putting A = 2688 in another block.
  std::vector<float> v(48, 0.0f);
  v[0] = 2688.0f;
  v[16] = 6.36f;     // block 1: scale rounds down to 1.0 -> 6.36 saturates to 6
  v[17] = -1.0f;
  v[32] = 0.005f;    // block 2: scale underflows to 0 -> e_b = FLT_MAX -> codes +-6
  v[33] = -0.001f;
  QuantizedTensor q = quantize(host_tensor(v, 1, 48), QuantConfig{});
  const QuantizedData& d = *q.rowwise;
  EXPECT_EQ(d.scales.ptr<uint8_t>()[1], 0x38);
  EXPECT_EQ(fp4_code(d, 0, 16), 0x7);
  EXPECT_EQ(fp4_code(d, 0, 17), 0xA);
  EXPECT_EQ(d.scales.ptr<uint8_t>()[2], 0x00);
  EXPECT_EQ(fp4_code(d, 0, 32), 0x7);
  EXPECT_EQ(fp4_code(d, 0, 33), 0xF);
  EXPECT_EQ(fp4_code(d, 0, 34), 0x0);
  Tensor deq = dequantize_reference(q, false);
  EXPECT_EQ(deq.ptr<float>()[32], 0.0f);
  EXPECT_FLOAT_EQ(deq.ptr<float>()[16], 6.0f);

  // All-zero tensor: A = 0 -> S_enc = 1, scales 0, codes 0, dequantized 0.
  QuantizedTensor z = quantize(host_tensor(std::vector<float>(32, 0.0f), 2, 16), QuantConfig{});
  EXPECT_EQ(*z.rowwise->amax.ptr<float>(), 0.0f);
  for (int i = 0; i < 2; ++i) EXPECT_EQ(z.rowwise->scales.ptr<uint8_t>()[i], 0);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(z.rowwise->data.ptr<uint8_t>()[i], 0);
  Tensor zd = dequantize_reference(z, false);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(zd.ptr<float>()[i], 0.0f);
}

TEST(Nvfp4, PartialBlocksAndOddColumns) {
  // 3 x 21: the second block of each row holds 5 elements; rows pack into 11 bytes.
  std::vector<float> v(63);
  for (int i = 0; i < 63; ++i) v[i] = std::sin(0.37f * i) * (1 + i % 5);
  QuantizedTensor q = quantize(host_tensor(v, 3, 21), QuantConfig{});
  EXPECT_EQ(q.rowwise->scales.shape(), Shape({3, 2}));
  EXPECT_EQ(q.rowwise->data.nbytes(), 3 * 11);
  Tensor deq = dequantize_reference(q, false);
  double err = 0, ref = 0;
  for (int i = 0; i < 63; ++i) {
    err += std::pow(deq.ptr<float>()[i] - v[i], 2);
    ref += v[i] * v[i];
  }
  EXPECT_LT(std::sqrt(err / ref), 0.12);
  // The padding nibble of each row is zero.
  for (int r = 0; r < 3; ++r) EXPECT_EQ(q.rowwise->data.ptr<uint8_t>()[r * 11 + 10] >> 4, 0);
}

// ---- NUMERICS 9.8: Four Over Six ----------------------------------------------------------------

TEST(FourOverSix, Numerics98Blocks) {
  QuantConfig cfg;
  cfg.nvfp4_scale_rule = Nvfp4ScaleRule::kFourOverSix;
  const std::vector<float> a = {1.0f, 0.85f, 0.8f, 0.75f, 0.9f, 0.95f, 0.7f, 0.72f, -0.88f, -0.92f, 0.78f, 0.83f, 0.81f, -0.79f, 0.86f, 0.74f};
  const FourOverSixTensorScales ts = four_over_six_tensor_scales(1.0f, kFourOverSixGlobalConstant, kFourOverSixGlobalConstant);
  EXPECT_EQ(ts.encode, 1536.0f);
  const FourOverSixScalePair pair = four_over_six_scales(1.0f, ts);
  EXPECT_EQ(pair.map6, 0x78);
  EXPECT_EQ(pair.map4, 0x7C);
  QuantizedTensor q = quantize(host_tensor(a, 1, 16), cfg);
  EXPECT_EQ(q.rowwise->scales.ptr<uint8_t>()[0], 0x7C);
  const uint8_t ca[16] = {6, 5, 5, 5, 6, 6, 5, 5, 0xE, 0xE, 5, 5, 5, 0xD, 5, 5};
  for (int i = 0; i < 16; ++i) EXPECT_EQ(fp4_code(*q.rowwise, 0, i), ca[i]) << i;
  cfg.four_over_six_metric = FourOverSixMetric::kMae;
  EXPECT_EQ(quantize(host_tensor(a, 1, 16), cfg).rowwise->scales.ptr<uint8_t>()[0], 0x7C);

  cfg.four_over_six_metric = FourOverSixMetric::kMse;
  const std::vector<float> b = {1.0f, 0.5f, 0.25f, 0, -0.5f, 0.125f, 0.3f, 0.6f, -0.2f, 0.1f, 0.05f, 0.9f, -1.0f, 0.45f, 0.33f, 0.16f};
  q = quantize(host_tensor(b, 1, 16), cfg);
  EXPECT_EQ(q.rowwise->scales.ptr<uint8_t>()[0], 0x78);
  const uint8_t cb[16] = {7, 5, 3, 0, 0xD, 2, 4, 6, 0xA, 1, 1, 7, 0xF, 5, 4, 2};
  for (int i = 0; i < 16; ++i) EXPECT_EQ(fp4_code(*q.rowwise, 0, i), cb[i]) << i;
}

TEST(FourOverSix, ReciprocalDivisionIsCorrectlyRoundedForEverySignificand) {
  // four_over_six_div_constant's fast path (RN(1/C) and one FMA correction) against div_rn for
  // all 2^23 significands, both signs, at the lowest and highest exponent of its range and in
  // between. Between the ends each operation's result is the low end's times a power of two
  // (exact scaling of correctly rounded operations), provided no intermediate is subnormal at the
  // low end or overflows at the high end: checked on the correction term r = a - q C and q.
  const int lo = (int)(kFourOverSixFastDivMinBits >> 23) - 127;   // -64
  const int hi = (int)(kFourOverSixFastDivEndBits >> 23) - 128;   // 63: the highest exponent in range
  for (float c : {kFourOverSixGlobalConstant, kFourOverSixGlobalConstantUnbiasedSr}) {
    const float rcp = four_over_six_constant_reciprocal(c);
    ASSERT_NE(rcp, 0.0f);
    int64_t wrong = 0, underflow = 0, overflow = 0;
    for (int e : {lo, -20, 0, 20, hi}) {
      for (uint32_t m = 0; m < (1u << 23); ++m) {
        for (uint32_t sign : {0u, 0x80000000u}) {
          const float a = f32_from_bits(sign | ((uint32_t)(e + 127) << 23) | m);
          wrong += f32_bits(four_over_six_div_constant(a, c, rcp)) != f32_bits(formats::div_rn(a, c));
          const float q = formats::mul_rn(a, rcp);
          const float r = std::fabs(formats::fma_rn(-q, c, a));
          if (e == lo) underflow += std::fabs(q) < 0x1p-120f || (r != 0.0f && r < 0x1p-120f);
          if (e == hi) overflow += std::fabs(q) > 0x1p120f || r > 0x1p120f;
        }
      }
    }
    EXPECT_EQ(wrong, 0) << "C = " << c;
    EXPECT_EQ(underflow, 0) << "C = " << c;
    EXPECT_EQ(overflow, 0) << "C = " << c;
  }
  // Signed zeros (fast path, sign kept) and values outside the range (div_rn): equal to div_rn.
  for (float a : {0.0f, -0.0f, 1e-30f, 1e-45f, 3e38f, std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN()}) {
    const float want = formats::div_rn(a, kFourOverSixGlobalConstant);
    const float got = four_over_six_div_constant(a, kFourOverSixGlobalConstant,
                                                 four_over_six_constant_reciprocal(kFourOverSixGlobalConstant));
    EXPECT_TRUE(f32_bits(got) == f32_bits(want) || (std::isnan(got) && std::isnan(want))) << a;
  }
  EXPECT_EQ(four_over_six_constant_reciprocal(2688.0f), 0.0f);
}

TEST(FourOverSix, LowersErrorOnNormalData) {
  const Tensor x = make_synthetic(Distribution::kNormal, 256, 256, 11);
  QuantConfig six;
  QuantConfig four_six;
  four_six.nvfp4_scale_rule = Nvfp4ScaleRule::kFourOverSix;
  for (bool two_d : {false, true}) {
    six.block_2d = four_six.block_2d = two_d;
    const double e6 = error_stats(x.view(), dequantize_reference(quantize(x, six), false).view()).relative_error;
    const double e46 = error_stats(x.view(), dequantize_reference(quantize(x, four_six), false).view()).relative_error;
    // 1x16 blocks: clearly better. 16x16 tiles: the tile max is far out in the tail and the
    // choice rarely matters (measured: 0.1118 vs 0.1120), so only "not worse" is required.
    EXPECT_LT(e46, two_d ? e6 : e6 * 0.95) << "2d=" << two_d << " 6: " << e6 << " 4/6: " << e46;
  }
}

// ---- 2D blocks -----------------------------------------------------------------------------------

TEST(Nvfp4, TwoDimensionalColumnwiseIsTheExactTranspose) {
  const Tensor x = make_synthetic(Distribution::kHeavyTailed, 48, 80, 5);
  for (Nvfp4ScaleRule rule : {Nvfp4ScaleRule::kAmaxTo6, Nvfp4ScaleRule::kFourOverSix}) {
    QuantConfig cfg;
    cfg.block_2d = true;
    cfg.nvfp4_scale_rule = rule;
    QuantizedTensor q = quantize(x, cfg, {true, true});
    for (int64_t r = 0; r < 48; ++r)
      for (int64_t c = 0; c < 80; ++c) {
        ASSERT_EQ(fp4_code(*q.rowwise, r, c), fp4_code(*q.colwise, c, r));
        ASSERT_EQ(q.rowwise->scales.ptr<uint8_t>()[r * 5 + c / 16],
                  q.colwise->scales.ptr<uint8_t>()[c * 3 + r / 16]);
      }
    // Every row of a 16x16 tile carries the same scale.
    for (int64_t r = 0; r < 48; ++r)
      for (int64_t b = 0; b < 5; ++b)
        EXPECT_EQ(q.rowwise->scales.ptr<uint8_t>()[r * 5 + b],
                  q.rowwise->scales.ptr<uint8_t>()[(r / 16 * 16) * 5 + b]);
  }
}

TEST(Fp8Block, ScalesAndTranspose) {
  std::vector<float> v(2 * 256, 0.5f);
  v[0] = 448.0f;   // block (0,0): scale 1
  v[128] = 100.0f; // block (0,1): 448/100 = 4.48 -> pow2 4 -> decode 0.25
  // row 1: block (1,0) all 0.5 -> 896 -> pow2 512 ; block (1,1) zeros -> scale 1
  for (int i = 384; i < 512; ++i) v[i] = 0.0f;
  QuantConfig cfg;
  cfg.format = Format::kFp8Block;
  QuantizedTensor q = quantize(host_tensor(v, 2, 256), cfg);
  const float* s = q.rowwise->scales.ptr<float>();
  EXPECT_EQ(s[0], 1.0f);
  EXPECT_EQ(s[1], 0.25f);
  EXPECT_EQ(s[2], 1.0f / 512);
  EXPECT_EQ(s[3], 1.0f);
  cfg.fp8_pow2_scales = false;
  q = quantize(host_tensor(v, 2, 256), cfg);
  EXPECT_EQ(q.rowwise->scales.ptr<float>()[1], 1.0f / (448.0f / 100.0f));
  cfg.fp8_pow2_scales = true;
  cfg.block_2d = true;
  const Tensor x = make_synthetic(Distribution::kNormal, 200, 300, 3);
  q = quantize(x, cfg, {true, true});
  EXPECT_EQ(q.rowwise->scales.shape(), Shape({2, 3}));
  EXPECT_EQ(q.colwise->scales.shape(), Shape({3, 2}));
  for (int64_t r = 0; r < 200; ++r)
    for (int64_t c = 0; c < 300; ++c)
      ASSERT_EQ(q.rowwise->data.ptr<uint8_t>()[r * 300 + c], q.colwise->data.ptr<uint8_t>()[c * 200 + r]);
}

// ---- NUMERICS 9.9: RHT ----------------------------------------------------------------------------

TEST(Rht, Numerics99Vectors) {
  float ones[16], ramp[16];
  for (int i = 0; i < 16; ++i) {
    ones[i] = 1.0f;
    ramp[i] = (float)i;
  }
  rht16_forward(ones, kRhtFixedSignMask);
  rht16_forward(ramp, kRhtFixedSignMask);
  const float e1[16] = {-1, 0, 1, 0, 1, 0, -1, 0, 1, 2, 1, 0, 1, 0, 1, -2};
  const float e2[16] = {-14.5f, -7.5f, 6.5f, -0.5f, 6.5f, -0.5f, -14.5f, 8.5f, 7.5f, 14.5f, 0.5f, 1.5f, 0.5f, -2.5f, 9.5f, -15.5f};
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(ones[i], e1[i]) << i;
    EXPECT_EQ(ramp[i], e2[i]) << i;
  }
  // H H^T = I: the inverse of the (exact, here) forward transform recovers the input.
  rht16_inverse(ramp, kRhtFixedSignMask);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(ramp[i], (float)i);
}

TEST(Rht, InverseRecoversInputToBf16Tolerance) {
  const Tensor x = make_synthetic(Distribution::kHeavyTailed, 4, 64, 9);
  for (uint16_t mask : {kRhtFixedSignMask, (uint16_t)0, (uint16_t)0x1234}) {
    std::vector<float> y(x.ptr<float>(), x.ptr<float>() + 256);
    rht_reference(y.data(), 4, 64, mask, false);
    for (float v : y) EXPECT_EQ(v, formats::round_to_bf16(v));  // rounded to BF16
    rht_reference(y.data(), 4, 64, mask, true);
    double err = 0, ref = 0;
    for (int i = 0; i < 256; ++i) {
      err += std::pow(y[i] - x.ptr<float>()[i], 2);
      ref += std::pow(x.ptr<float>()[i], 2);
    }
    EXPECT_LT(std::sqrt(err / ref), 4e-3);
    EXPECT_GT(std::sqrt(err / ref), 0.0);
  }
}

// Heavy tails and outliers: round-to-nearest on a 16-element block that holds a large element
// flushes the block's small elements towards zero, a systematic shrinkage of magnitudes (bias)
// that compounds over training. The Hadamard transform spreads the outlier over its block and
// leaves Gaussian-like blocks: the shrinkage bias drops severalfold. The L2 error does not drop
// with 16-element blocks (measured: 0.089 -> 0.097 on student-t, 0.074 -> 0.101 with outliers;
// quant-report prints it), because the outlier's energy lands on every element of its block.
TEST(Rht, SpreadsOutliersAndCutsTheShrinkageBias) {
  for (Distribution d : {Distribution::kOutliers, Distribution::kHeavyTailed}) {
    const Tensor x = make_synthetic(d, 1024, 512, 21);
    QuantConfig plain;
    QuantConfig rht;
    rht.rht = true;
    const ErrorStats s_plain = error_stats(x.view(), dequantize_to_source_reference(quantize(x, plain, {false, true}), true).view());
    const ErrorStats s_rht = error_stats(x.view(), dequantize_to_source_reference(quantize(x, rht, {false, true}), true).view());
    EXPECT_LT(s_plain.relative_bias, -0.005) << distribution_name(d);
    EXPECT_LT(std::fabs(s_rht.relative_bias), 0.4 * std::fabs(s_plain.relative_bias))
        << distribution_name(d) << ": plain " << s_plain.relative_bias << " rht " << s_rht.relative_bias;
    EXPECT_LT(s_rht.relative_error, 0.12) << distribution_name(d);
  }
}

TEST(Rht, ColumnwiseAmaxIsTakenAfterTheTransform) {
  const Tensor x = make_synthetic(Distribution::kNormal, 32, 16, 4);
  QuantConfig cfg;
  cfg.rht = true;
  QuantizedTensor q = quantize(x, cfg, {true, true});
  std::vector<float> t(512);
  for (int r = 0; r < 32; ++r)
    for (int c = 0; c < 16; ++c) t[c * 32 + r] = x.ptr<float>()[r * 16 + c];
  rht_reference(t.data(), 16, 32, kRhtFixedSignMask, false);
  float amax = 0;
  for (float v : t) amax = std::max(amax, std::fabs(v));
  EXPECT_EQ(*q.colwise->amax.ptr<float>(), amax);
  EXPECT_NE(*q.colwise->amax.ptr<float>(), *q.rowwise->amax.ptr<float>());
}

// ---- Stochastic rounding: unbiased, replayable; round-to-nearest's bias detected ----------------

struct SignedErrorStats {
  double mean = 0, standard_error = 0;
};

// Mean of sign(x) (q(x) - x) / step over elements, where step = 1 (values in FP4 grid units).
SignedErrorStats signed_error(const std::vector<float>& x, const std::vector<float>& q) {
  double s = 0, s2 = 0;
  const size_t n = x.size();
  for (size_t i = 0; i < n; ++i) {
    const double e = (x[i] >= 0 ? 1.0 : -1.0) * ((double)q[i] - x[i]);
    s += e;
    s2 += e * e;
  }
  SignedErrorStats r;
  r.mean = s / n;
  r.standard_error = std::sqrt(std::max(0.0, s2 / n - r.mean * r.mean) / n);
  return r;
}

TEST(StochasticRounding, UnbiasedWhereRoundToNearestIsBiased) {
  // Blocks of 16: element 0 = 6 pins the scale to exactly 1 (A = 2688 elsewhere), the other 15
  // lie in (0.5, 0.75) or (2, 2.5) or their negatives, where round-to-nearest always rounds
  // towards zero. 2^20 blocks of draws.
  const int64_t rows = 1024, cols = 16 * 64;
  std::vector<float> v((size_t)(rows * cols));
  const RandomStream rs{99, 1};
  for (int64_t i = 0; i < rows * cols; ++i) {
    const float u = rs.uniform_at((uint64_t)i);
    float x = (i % 2) ? 0.5f + 0.25f * u : 2.0f + 0.5f * u;
    if (i % 3 == 0) x = -x;
    v[(size_t)i] = (i % 16 == 0) ? 6.0f : x;
  }
  v[0] = 2688.0f;
  const Tensor t = host_tensor(v, rows, cols);
  std::vector<float> x, q_rn, q_sr;
  QuantConfig rn;
  QuantConfig sr;
  sr.rounding = Rounding::kStochastic;
  const Tensor d_rn = dequantize_reference(quantize(t, rn, {true, false}, 1), false);
  const Tensor d_sr = dequantize_reference(quantize(t, sr, {true, false}, 1), false);
  for (int64_t i = 0; i < rows * cols; ++i) {
    if (i % 16 == 0) continue;  // block maxima (exact)
    x.push_back(v[(size_t)i]);
    q_rn.push_back(d_rn.ptr<float>()[i]);
    q_sr.push_back(d_sr.ptr<float>()[i]);
  }
  const SignedErrorStats e_rn = signed_error(x, q_rn);
  const SignedErrorStats e_sr = signed_error(x, q_sr);
  EXPECT_GT(std::fabs(e_rn.mean), 50 * e_rn.standard_error + 1e-3) << "RN bias not detected";
  EXPECT_LT(std::fabs(e_sr.mean), 4 * e_sr.standard_error) << "SR mean " << e_sr.mean << " se " << e_sr.standard_error;
  EXPECT_GT(x.size(), 900000u);
}

TEST(StochasticRounding, UnbiasedOnRealBlocksWithTheSixteenSeventeenthsScale) {
  // Normal data through the full NVFP4 path: mean signed error over ~1M elements ~ 0.
  const Tensor t = make_synthetic(Distribution::kNormal, 1024, 1024, 5);
  QuantConfig sr;
  sr.rounding = Rounding::kStochastic;
  sr.sr_unbiased_scale = true;
  const Tensor d = dequantize_reference(quantize(t, sr, {true, false}, 2), false);
  std::vector<float> x(t.ptr<float>(), t.ptr<float>() + t.numel());
  std::vector<float> q(d.ptr<float>(), d.ptr<float>() + d.numel());
  const SignedErrorStats e = signed_error(x, q);
  EXPECT_LT(std::fabs(e.mean), 4 * e.standard_error) << e.mean << " se " << e.standard_error;
  // Round-to-nearest on the same data is biased (block maxima saturate after scale round-down).
  const Tensor d_rn = dequantize_reference(quantize(t, QuantConfig{}, {true, false}), false);
  std::vector<float> q_rn(d_rn.ptr<float>(), d_rn.ptr<float>() + d_rn.numel());
  const SignedErrorStats e_rn = signed_error(x, q_rn);
  EXPECT_GT(std::fabs(e_rn.mean), 4 * e_rn.standard_error);
}

TEST(StochasticRounding, DrawsAreAFunctionOfSeedStreamAndIndex) {
  const Tensor t = make_synthetic(Distribution::kNormal, 64, 64, 5);
  QuantConfig sr;
  sr.rounding = Rounding::kStochastic;
  const QuantizedTensor a = quantize(t, sr, {true, true}, 17);
  const QuantizedTensor b = quantize(t, sr, {true, true}, 17);
  const QuantizedTensor c = quantize(t, sr, {true, true}, 18);
  auto same = [](const QuantizedData& x, const QuantizedData& y) {
    return std::equal(x.data.ptr<uint8_t>(), x.data.ptr<uint8_t>() + x.data.nbytes(), y.data.ptr<uint8_t>());
  };
  EXPECT_TRUE(same(*a.rowwise, *b.rowwise));
  EXPECT_TRUE(same(*a.colwise, *b.colwise));
  EXPECT_FALSE(same(*a.rowwise, *c.rowwise));
}

// ---- Errors ------------------------------------------------------------------------------------

TEST(Quantize, NonFiniteInputIsAnErrorNamingTheTensor) {
  std::vector<float> v(32, 1.0f);
  v[19] = std::numeric_limits<float>::quiet_NaN();
  QuantizeOptions opt;
  opt.tensor_name = "layer3.mlp.fc1.input";
  try {
    quantize_reference(host_tensor(v, 2, 16).view(), QuantConfig{}, {true, false}, opt);
    FAIL() << "NaN was quantized";
  } catch (const Error& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("layer3.mlp.fc1.input"), std::string::npos) << w;
    EXPECT_NE(w.find("NaN at row 1, column 3"), std::string::npos) << w;
  }
  v[19] = std::numeric_limits<float>::infinity();
  EXPECT_THROW(quantize_reference(host_tensor(v, 2, 16).view(), QuantConfig{}, {true, false}, opt), Error);
}

TEST(Quantize, InvalidConfigsNameTheField) {
  QuantConfig c;
  c.format = Format::kMxfp8;
  c.block_2d = true;
  try {
    c.validate();
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("block_2d"), std::string::npos);
  }
  c = {};
  c.rht = true;
  c.block_2d = true;
  EXPECT_THROW(c.validate(), Error);
}

TEST(Quantize, Bf16ScaledValuesAreExactAndTimesGlobalScaleGiveTheDequantized) {
  const Tensor x = make_synthetic(Distribution::kOutliers, 64, 128, 8);
  for (Format f : {Format::kNvfp4, Format::kMxfp8, Format::kFp8Block}) {
    QuantConfig cfg;
    cfg.format = f;
    const QuantizedTensor q = quantize(x, cfg);
    const Tensor b = dequantize_bf16_scaled_reference(q, false);
    const Tensor d = dequantize_reference(q, false);
    const float g = global_decode_scale(q, false);
    for (int64_t i = 0; i < x.numel(); ++i) {
      const float scaled = formats::decode_bf16(b.ptr<uint16_t>()[i]);
      ASSERT_NEAR(scaled * g, d.ptr<float>()[i], 2e-6f * std::fabs(d.ptr<float>()[i]) + 1e-30f)
          << format_name(f) << " at " << i;
    }
  }
}

// nvfp4_row_amax: a row's quantization is that row quantized alone (per-tensor amax = its own
// amax), whatever the other rows hold; the amaxes are per row, and dequantization uses them.
TEST(Nvfp4RowAmax, EachRowIsQuantizedAsIfAlone) {
  const int64_t rows = 12, cols = 40;  // a partial last block
  Tensor x = make_synthetic(Distribution::kOutliers, rows, cols, 21);
  for (int64_t c = 0; c < cols; ++c) {
    x.ptr<float>()[3 * cols + c] *= 1e4f;   // a row far above the others
    x.ptr<float>()[5 * cols + c] *= 1e-6f;  // and one far below
    x.ptr<float>()[7 * cols + c] = 0.0f;    // an all-zero row
  }
  for (bool fos : {false, true})
    for (bool sr : {false, true}) {
      QuantConfig per_row;
      per_row.nvfp4_row_amax = true;
      per_row.rounding = sr ? Rounding::kStochastic : Rounding::kNearest;
      if (fos) per_row.nvfp4_scale_rule = Nvfp4ScaleRule::kFourOverSix;
      QuantConfig per_tensor = per_row;
      per_tensor.nvfp4_row_amax = false;
      const QuantizedTensor q = quantize(x, per_row, {true, false}, 5);
      ASSERT_EQ(q.rowwise->amax.numel(), rows);
      const Tensor deq = dequantize_reference(q, false);
      for (int64_t r = 0; r < rows; ++r) {
        SCOPED_TRACE(::testing::Message() << per_row.describe() << " row " << r);
        // The row alone as a 1-row tensor. SR draws are keyed by element index, which differs
        // between the two, so with SR only the amax and the global scale are compared.
        const Tensor row = host_tensor(std::vector<float>(x.ptr<float>() + r * cols, x.ptr<float>() + (r + 1) * cols), 1, cols);
        const QuantizedTensor alone = quantize(row, per_tensor, {true, false}, 5);
        float want_amax = 0.0f;
        for (int64_t c = 0; c < cols; ++c) want_amax = std::max(want_amax, std::fabs(x.ptr<float>()[r * cols + c]));
        EXPECT_EQ(q.rowwise->amax.ptr<float>()[r], want_amax);
        EXPECT_EQ(*alone.rowwise->amax.ptr<float>(), want_amax);
        if (!sr) {
          for (int64_t b = 0; b < (cols + 15) / 16; ++b) {
            ASSERT_EQ(q.rowwise->scales.ptr<uint8_t>()[r * 3 + b], alone.rowwise->scales.ptr<uint8_t>()[b]) << "block " << b;
          }
          for (int64_t c = 0; c < cols; ++c) {
            ASSERT_EQ(fp4_code(*q.rowwise, r, c), fp4_code(*alone.rowwise, 0, c)) << "column " << c;
          }
          const Tensor d_alone = dequantize_reference(alone, false);
          for (int64_t c = 0; c < cols; ++c) ASSERT_EQ(deq.ptr<float>()[r * cols + c], d_alone.ptr<float>()[c]);
        }
        const float g = global_decode_scale(q, false, r);
        EXPECT_EQ(g, global_decode_scale(alone, false));
      }
      // Per-tensor would have flushed the small row (row 5) to zero against the 1e4 row; per row keeps it.
      if (!sr) {
        double kept = 0;
        for (int64_t c = 0; c < cols; ++c) kept += std::fabs(deq.ptr<float>()[5 * cols + c]);
        EXPECT_GT(kept, 0.0);
        const QuantizedTensor t = quantize(x, per_tensor, {true, false}, 5);
        const Tensor dt = dequantize_reference(t, false);
        double flushed = 0;
        for (int64_t c = 0; c < cols; ++c) flushed += std::fabs(dt.ptr<float>()[5 * cols + c]);
        EXPECT_EQ(flushed, 0.0) << "the test's small row should be lost under one per-tensor scale";
      }
    }
}

TEST(Nvfp4RowAmax, RejectedWhereItHasNoMeaning) {
  const Tensor x = make_synthetic(Distribution::kNormal, 16, 32, 1);
  QuantConfig c;
  c.nvfp4_row_amax = true;
  EXPECT_THROW(quantize(x, c, {true, true}), Error);  // the column-wise copy
  c.block_2d = true;
  EXPECT_THROW(c.validate(), Error);
  QuantConfig m;
  m.format = Format::kMxfp8;
  m.nvfp4_row_amax = true;
  EXPECT_THROW(m.validate(), Error);
}

}  // namespace
}  // namespace fourbit::quant
