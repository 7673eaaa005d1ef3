// formats: element codecs against NUMERICS.md section 9 vectors, exhaustive decode tables, and an
// independent brute-force nearest-value encoder on a dense sweep of floats (every BF16 pattern,
// every midpoint between neighbouring codes and its float neighbours, random floats).
#include "core/rng.h"
#include "formats/element.h"
#include "formats/scale_layout.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

namespace fourbit::formats {
namespace {

float bits(uint32_t u) { return f32_from_bits(u); }
const float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

TEST(E2M1, Numerics91Vectors) {
  EXPECT_EQ(encode_e2m1_rn(0.0f), 0x0);
  EXPECT_EQ(encode_e2m1_rn(-0.0f), 0x8);
  EXPECT_EQ(encode_e2m1_rn(0.25f), 0x0);
  EXPECT_EQ(encode_e2m1_rn(std::nextafter(0.25f, 1.0f)), 0x1);
  EXPECT_EQ(encode_e2m1_rn(0.75f), 0x2);
  EXPECT_EQ(encode_e2m1_rn(1.25f), 0x2);
  EXPECT_EQ(encode_e2m1_rn(1.75f), 0x4);
  EXPECT_EQ(encode_e2m1_rn(2.5f), 0x4);
  EXPECT_EQ(encode_e2m1_rn(3.5f), 0x6);
  EXPECT_EQ(encode_e2m1_rn(5.0f), 0x6);
  EXPECT_EQ(encode_e2m1_rn(5.0001f), 0x7);
  EXPECT_EQ(encode_e2m1_rn(7.0f), 0x7);
  EXPECT_EQ(encode_e2m1_rn(1e9f), 0x7);
  EXPECT_EQ(encode_e2m1_rn(kInf), 0x7);
  EXPECT_EQ(encode_e2m1_rn(-0.25f), 0x8);
  EXPECT_EQ(encode_e2m1_rn(-0.26f), 0x9);
  EXPECT_EQ(encode_e2m1_rn(-3.5f), 0xE);
  EXPECT_EQ(encode_e2m1_rn(-5.5f), 0xF);
  EXPECT_EQ(encode_e2m1_rn(-kInf), 0xF);
  EXPECT_EQ(encode_e2m1_rn(kNaN), 0x7);
  EXPECT_EQ(encode_e2m1_rn(-kNaN), 0x7);
  EXPECT_EQ(pack_e2m1x2(encode_e2m1_rn(1.0f), encode_e2m1_rn(-6.0f)), 0xF2);
}

TEST(E2M1, DecodeTable) {
  const float expect[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(f32_bits(decode_e2m1((uint8_t)c)), f32_bits(expect[c])) << "code " << c;
  }
}

TEST(E4M3, Numerics92Vectors) {
  EXPECT_EQ(decode_e4m3(0x01), 0.001953125f);
  EXPECT_EQ(decode_e4m3(0x07), 0.013671875f);
  EXPECT_EQ(decode_e4m3(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(decode_e4m3(0x38), 1.0f);
  EXPECT_EQ(decode_e4m3(0x7E), 448.0f);
  EXPECT_TRUE(std::isnan(decode_e4m3(0x7F)));
  EXPECT_TRUE(std::isnan(decode_e4m3(0xFF)));
  EXPECT_EQ(decode_e4m3(0xFE), -448.0f);
  EXPECT_EQ(f32_bits(decode_e4m3(0x80)), 0x80000000u);
  struct V { float in; uint8_t sat, nosat; };
  const V v[] = {{std::ldexp(1.0f, -10), 0x00, 0x00},
                 {std::ldexp(1.0f, -10) * (1 + std::ldexp(1.0f, -23)), 0x01, 0x01},
                 {0.00146484375f, 0x01, 0x01},
                 {0.0137f, 0x07, 0x07},
                 {1.0625f, 0x38, 0x38},
                 {1.0625001f, 0x39, 0x39},
                 {1.1875f, 0x3A, 0x3A},
                 {248.0f, 0x78, 0x78},
                 {449.0f, 0x7E, 0x7E},
                 {464.0f, 0x7E, 0x7E},
                 {464.01f, 0x7E, 0x7F},
                 {480.0f, 0x7E, 0x7F},
                 {1000.0f, 0x7E, 0x7F},
                 {kInf, 0x7E, 0x7F},
                 {-1000.0f, 0xFE, 0xFF},
                 {-kInf, 0xFE, 0xFF},
                 {kNaN, 0x7F, 0x7F}};
  for (const V& x : v) {
    EXPECT_EQ(encode_e4m3_rn(x.in), x.sat) << x.in;
    EXPECT_EQ(encode_e4m3_rn(x.in, Saturation::kNoSat), x.nosat) << x.in;
  }
  EXPECT_EQ(encode_e4m3_rn(-kNaN), 0x7F);
}

TEST(E5M2, Numerics93Vectors) {
  EXPECT_EQ(encode_e5m2_rn(1.125f), 0x3C);
  EXPECT_EQ(encode_e5m2_rn(1.375f), 0x3E);
  EXPECT_EQ(encode_e5m2_rn(61439.0f), 0x7B);
  EXPECT_EQ(encode_e5m2_rn(61440.0f), 0x7B);
  EXPECT_EQ(encode_e5m2_rn(61440.0f, Saturation::kNoSat), 0x7C);
  EXPECT_EQ(encode_e5m2_rn(std::ldexp(1.0f, -17)), 0x00);
  EXPECT_EQ(encode_e5m2_rn(1.5f * std::ldexp(1.0f, -17)), 0x01);
  EXPECT_EQ(encode_e5m2_rn(kInf), 0x7B);
  EXPECT_EQ(encode_e5m2_rn(kInf, Saturation::kNoSat), 0x7C);
  EXPECT_EQ(encode_e5m2_rn(-kInf, Saturation::kNoSat), 0xFC);
  EXPECT_EQ(encode_e5m2_rn(kNaN), 0x7F);
  EXPECT_EQ(decode_e5m2(0x7B), 57344.0f);
  EXPECT_EQ(decode_e5m2(0x01), std::ldexp(1.0f, -16));
  EXPECT_TRUE(std::isinf(decode_e5m2(0x7C)));
  EXPECT_TRUE(std::isnan(decode_e5m2(0x7D)));
}

TEST(BF16, Numerics94Vectors) {
  EXPECT_EQ(encode_bf16_rn(1.00390625f), 0x3F80);
  EXPECT_EQ(encode_bf16_rn(1.01171875f), 0x3F82);
  EXPECT_EQ(encode_bf16_rn(3.4e38f), 0x7F80);
  EXPECT_EQ(encode_bf16_rn(std::ldexp(1.0f, -133)), 0x0001);
  EXPECT_EQ(encode_bf16_rn(std::ldexp(1.0f, -134)), 0x0000);
  EXPECT_EQ(encode_bf16_rn(-0.0f), 0x8000);
  EXPECT_EQ(encode_bf16_rn(kNaN), 0x7FFF);
}

TEST(E8M0, Numerics95Vectors) {
  EXPECT_EQ(f32_bits(decode_e8m0(0x00)), 0x00400000u);
  EXPECT_EQ(decode_e8m0(0x01), std::ldexp(1.0f, -126));
  EXPECT_EQ(decode_e8m0(0x7F), 1.0f);
  EXPECT_EQ(decode_e8m0(0xFE), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(decode_e8m0(0xFF)));
  using R = E8m0Rounding;
  EXPECT_EQ(encode_e8m0(1.5f, R::kTowardZero), 0x7F);
  EXPECT_EQ(encode_e8m0(1.5f, R::kUp), 0x80);
  EXPECT_EQ(encode_e8m0(3.0f, R::kTowardZero), 0x80);
  EXPECT_EQ(encode_e8m0(3.0f, R::kUp), 0x81);
  EXPECT_EQ(encode_e8m0(0.75f, R::kTowardZero), 0x7E);
  EXPECT_EQ(encode_e8m0(0.75f, R::kUp), 0x7F);
  EXPECT_EQ(encode_e8m0(0.0f, R::kUp), 0x00);
  EXPECT_EQ(encode_e8m0(-4.0f, R::kUp), 0x81);
  EXPECT_EQ(encode_e8m0(1.5f * std::ldexp(1.0f, -127), R::kTowardZero), 0x00);
  EXPECT_EQ(encode_e8m0(1.5f * std::ldexp(1.0f, -127), R::kUp), 0x01);
  EXPECT_EQ(encode_e8m0(kInf, R::kUp), 0xFE);
  EXPECT_EQ(encode_e8m0(kNaN, R::kUp), 0xFF);
  for (int c = 0; c < 255; ++c) {
    EXPECT_EQ(decode_e8m0((uint8_t)c) * e8m0_reciprocal((uint8_t)c), 1.0f) << c;
  }
}

TEST(ScaleLayout, Numerics910SwizzleVectors) {
  EXPECT_EQ(swizzled_scale_index(0, 0, 4), 0);
  EXPECT_EQ(swizzled_scale_index(0, 1, 4), 1);
  EXPECT_EQ(swizzled_scale_index(0, 3, 4), 3);
  EXPECT_EQ(swizzled_scale_index(1, 0, 4), 16);
  EXPECT_EQ(swizzled_scale_index(31, 0, 4), 496);
  EXPECT_EQ(swizzled_scale_index(32, 0, 4), 4);
  EXPECT_EQ(swizzled_scale_index(64, 0, 4), 8);
  EXPECT_EQ(swizzled_scale_index(96, 0, 4), 12);
  EXPECT_EQ(swizzled_scale_index(127, 3, 4), 511);
  EXPECT_EQ(swizzled_scale_index(128, 0, 4), 512);
  EXPECT_EQ(swizzled_scale_index(0, 4, 8), 512);
  EXPECT_EQ(swizzled_scale_index(128, 0, 8), 1024);
  EXPECT_EQ(swizzled_scale_index(129, 5, 8), 1553);
  // A permutation of the padded matrix.
  std::vector<int> seen(256 * 8, 0);
  for (int r = 0; r < 256; ++r)
    for (int c = 0; c < 8; ++c) seen[(size_t)swizzled_scale_index(r, c, 8)]++;
  for (int s : seen) EXPECT_EQ(s, 1);
}

// ---- Brute-force oracle: nearest representable value, ties to the even code ----------------

struct Grid {
  std::vector<double> values;  // non-negative finite values in increasing order
  std::vector<uint8_t> codes;
};

template <const MiniFloat& F>
Grid make_grid() {
  Grid g;
  for (int c = 0; c <= F.max_code; ++c) {
    const float v = decode_minifloat<F>((uint8_t)c);
    if (std::isfinite(v)) {
      g.values.push_back(v);
      g.codes.push_back((uint8_t)c);
    }
  }
  return g;
}

template <const MiniFloat& F>
uint8_t brute_force_rn(float x, const Grid& g, bool saturate) {
  const uint8_t sign = std::signbit(x) ? (uint8_t)(1u << (F.exp_bits + F.man_bits)) : 0;
  const double a = std::fabs((double)x);
  const double max = g.values.back();
  if (std::isinf(x) || a > max) {
    // Beyond max: rounds to max if below max + half an ulp of the top binade (ties to even, max's
    // code is odd for E4M3/E5M2 and E2M1... so the tie goes up = overflow), else overflows.
    const double top_ulp = max - g.values[g.values.size() - 2];
    const bool within_half = !std::isinf(x) && (a < max + top_ulp / 2 ||
                                                (a == max + top_ulp / 2 && (g.codes.back() % 2 == 0)));
    if (within_half || saturate || (F.nan_code < 0 && F.inf_code < 0)) return g.codes.back() | sign;
    return (uint8_t)((F.inf_code >= 0 ? F.inf_code : F.nan_code) | sign);
  }
  size_t best = 0;
  for (size_t i = 1; i < g.values.size(); ++i) {
    const double d_best = std::fabs(a - g.values[best]);
    const double d = std::fabs(a - g.values[i]);
    if (d < d_best || (d == d_best && g.codes[i] % 2 == 0)) best = i;
  }
  return g.codes[best] | sign;
}

std::vector<float> dense_sweep(const std::vector<double>& grid_values) {
  std::vector<float> xs;
  for (uint32_t b = 0; b < 65536; ++b) {
    const float x = bits(b << 16);
    if (!std::isnan(x)) xs.push_back(x);
  }
  for (size_t i = 0; i + 1 < grid_values.size(); ++i) {
    const float mid = (float)((grid_values[i] + grid_values[i + 1]) / 2);
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f)}) {
      xs.push_back(x);
      xs.push_back(-x);
    }
  }
  const RandomStream rs{7, 7};
  for (uint64_t i = 0; i < 200000; ++i) {
    const uint32_t r = rs.block(i).v[0];
    const float x = bits((r & 0x807FFFFFu) | ((uint32_t)(100 + (r >> 23) % 60) << 23));
    xs.push_back(x);
  }
  return xs;
}

template <const MiniFloat& F>
void check_against_brute_force(const char* name) {
  const Grid g = make_grid<F>();
  int mismatches = 0;
  for (float x : dense_sweep(g.values)) {
    for (Saturation sat : {Saturation::kSatFinite, Saturation::kNoSat}) {
      const uint8_t got = encode_minifloat_rn<F>(x, sat);
      const uint8_t want = brute_force_rn<F>(x, g, sat == Saturation::kSatFinite);
      if (got != want && ++mismatches <= 10) {
        ADD_FAILURE() << name << " encode(" << x << " = 0x" << std::hex << f32_bits(x)
                      << ") = 0x" << (int)got << ", brute force 0x" << (int)want;
      }
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(Encode, E2M1MatchesBruteForce) { check_against_brute_force<kE2M1>("e2m1"); }
TEST(Encode, E4M3MatchesBruteForce) { check_against_brute_force<kE4M3>("e4m3"); }
TEST(Encode, E5M2MatchesBruteForce) { check_against_brute_force<kE5M2>("e5m2"); }

TEST(Encode, FastE2M1EncodersEqualTheGenericOne) {
  const Grid g = make_grid<kE2M1>();
  int64_t n = 0;
  for (float x : dense_sweep(g.values)) {
    ASSERT_EQ(encode_e2m1_rn_fast(x), encode_e2m1_rn(x)) << x;
    ASSERT_EQ(encode_e2m1_rn_not_nan(x), encode_e2m1_rn(x)) << x;
    ASSERT_EQ(f32_bits(e2m1_value_rn_not_nan(x)), f32_bits(decode_e2m1(encode_e2m1_rn(x)))) << x;
    ++n;
  }
  // Every float whose exponent is in the E2M1 neighbourhood, at a stride.
  for (uint64_t b = 0; b < (1ull << 32); b += 97) {
    const float x = bits((uint32_t)b);
    ASSERT_EQ(encode_e2m1_rn_fast(x), encode_e2m1_rn(x)) << std::hex << b;
    if (!std::isnan(x)) {
      ASSERT_EQ(encode_e2m1_rn_not_nan(x), encode_e2m1_rn(x)) << std::hex << b;
      ASSERT_EQ(f32_bits(e2m1_value_rn_not_nan(x)), f32_bits(decode_e2m1(encode_e2m1_rn(x)))) << std::hex << b;
    }
    ++n;
  }
  EXPECT_GT(n, 40000000);
}

TEST(Encode, FastE2M1StochasticEncoderEqualsTheGenericOne) {
  const Grid g = make_grid<kE2M1>();
  std::vector<float> xs = dense_sweep(g.values);
  // Values whose dithered sum t lands exactly on, or one ulp beside, a grid point or a range
  // boundary (where the step of t differs from the step of |x|).
  for (double v : g.values) {
    for (double step : {0.5, 1.0, 2.0}) {
      for (uint32_t r = 0; r < 256; ++r) {
        const float a = (float)(v - (2.0 * r + 1.0) / 512.0 * step);
        if (!(a > 0.0f)) continue;
        for (float x : {a, std::nextafter(a, 0.0f), std::nextafter(a, 1e30f)}) {
          xs.push_back(x);
          xs.push_back(-x);
        }
      }
    }
  }
  for (float x : {6.0f, 6.5f, 8.0f, 1e30f, std::numeric_limits<float>::infinity(), 0.0f, -0.0f})
    xs.push_back(x);
  int64_t n = 0;
  for (float x : xs) {
    for (uint32_t r = 0; r < 256; ++r) {
      ASSERT_EQ(encode_e2m1_sr_not_nan(x, r), encode_e2m1_sr(x, r))
          << x << " (0x" << std::hex << f32_bits(x) << "), rbits " << std::dec << r;
      ASSERT_EQ(f32_bits(e2m1_value_sr_not_nan(x, r)), f32_bits(decode_e2m1(encode_e2m1_sr(x, r))))
          << x << " (0x" << std::hex << f32_bits(x) << "), rbits " << std::dec << r;
      ++n;
    }
  }
  EXPECT_GT(n, 50000000);
}

TEST(Encode, EveryCodeRoundTrips) {
  for (int c = 0; c < 16; ++c) EXPECT_EQ(encode_e2m1_rn(decode_e2m1((uint8_t)c)), c);
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) != 0x7F) {
      EXPECT_EQ(encode_e4m3_rn(decode_e4m3((uint8_t)c)), c) << c;
    }
    if ((c & 0x7C) != 0x7C) {
      EXPECT_EQ(encode_e5m2_rn(decode_e5m2((uint8_t)c)), c) << c;
    }
  }
  for (uint32_t b = 0; b < 65536; ++b) {
    if ((b & 0x7FFF) <= 0x7F80) {
      EXPECT_EQ(encode_bf16_rn(decode_bf16((uint16_t)b)), b);
    }
  }
}

// ---- Stochastic rounding ---------------------------------------------------------------------

TEST(StochasticRounding, ProbabilityOfRoundingUpIsTheFractionQuantisedTo256) {
  // x = 1.3 lies between 1.0 (code 2) and 1.5 (code 3): P(up) = #{u : u*0.5 >= 0.2}/256.
  int ups = 0;
  for (uint32_t r = 0; r < 256; ++r) {
    const uint8_t c = encode_e2m1_sr(1.3f, r);
    ASSERT_TRUE(c == 2 || c == 3);
    ups += c == 3;
  }
  // t = fma(u, 0.5, 1.3) >= 1.5  <=>  u = (r + 1/2) / 256 >= 0.4  <=>  r >= 101.9: P = 154/256
  // = round(256 * 0.6) / 256 (up to FP32 rounding of 1.3 and of the fma).
  EXPECT_NEAR(ups, 154, 1);
  // Grid values are kept exactly for every draw; saturation at 6; sign and -0 kept.
  for (uint32_t r = 0; r < 256; ++r) {
    EXPECT_EQ(encode_e2m1_sr(3.0f, r), 0x5);
    EXPECT_EQ(encode_e2m1_sr(-4.0f, r), 0xE);
    const uint8_t c59 = encode_e2m1_sr(5.9f, r);
    EXPECT_TRUE(c59 == 0x6 || c59 == 0x7);
    EXPECT_EQ(encode_e2m1_sr(7.0f, r), 0x7);
    EXPECT_EQ(encode_e2m1_sr(-0.0f, r), 0x8);
    EXPECT_EQ(encode_e4m3_sr(1.0f, r), 0x38);
    EXPECT_EQ(encode_e4m3_sr(500.0f, r), 0x7E);
  }
}

TEST(StochasticRounding, BF16AddsBitsBelowTheKeptOnes) {
  const float x = bits(0x3F808000u);  // exactly halfway between two BF16 values
  int ups = 0;
  for (uint32_t r = 0; r < 65536; r += 1) ups += encode_bf16_sr(x, r) == 0x3F81;
  EXPECT_EQ(ups, 32768);
  EXPECT_EQ(encode_bf16_sr(1.0f, 0xFFFF), 0x3F80);
}

}  // namespace
}  // namespace fourbit::formats
