// formats: element codecs against the CUDA toolkit's host conversion functions (cuda_fp8.h,
// cuda_fp4.h, cuda_bf16.h), the oracle ../shared/docs/NUMERICS.md section 8 calls the best one
// for element conversions: bit-exact software models of the PTX cvt instructions whose semantics
// fourbit's encoders follow ("Decisions": element encodes follow CUDA hardware semantics).
//
// Host code only: compiled by the host compiler against the CUDA headers, it runs on machines
// without a GPU (label `cpu`); built only when FOURBIT_CUDA (and so the toolkit) is on.
//
// Inputs: a strided sweep over all 2^32 FP32 bit patterns (odd stride, so every residue of the
// low bits is hit), plus every BF16 pattern, every midpoint between neighbouring values of each
// format (incl. the overflow threshold above max) and its FP32 neighbours, every FP32 value in
// the saturation windows, and signed zeros, infinities and NaNs with several payloads.
#include "formats/element.h"

#include <cuda_bf16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace fourbit::formats {
namespace {

// 2^32 / 31 = 138.5M patterns from the strided sweep per conversion (about 1 s per conversion
// on one core of the development machine in a Release build; the whole executable about 6 s).
constexpr uint64_t kStride = 31;
constexpr uint64_t kStridedCount = ((1ull << 32) + kStride - 1) / kStride;

std::string hex(uint32_t v, int digits) {
  std::ostringstream o;
  o << "0x" << std::hex << std::uppercase;
  o.width(digits);
  o.fill('0');
  o << v;
  return o.str();
}

// ------------------------------------------------------------------------------- the oracle
uint8_t cuda_e2m1(float x) {
  return (uint8_t)__nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest);
}
uint8_t cuda_fp8(float x, __nv_saturation_t sat, __nv_fp8_interpretation_t fmt) {
  return (uint8_t)__nv_cvt_float_to_fp8(x, sat, fmt);
}
uint8_t cuda_e8m0(float x, cudaRoundMode mode) {
  return (uint8_t)__nv_cvt_float_to_e8m0(x, __NV_SATFINITE, mode);
}
uint16_t cuda_bf16(float x) {
  const __nv_bfloat16_raw r = __float2bfloat16_rn(x);
  return r.x;
}
float half_raw_to_float(__half_raw h) { return __half2float(__half(h)); }
float cuda_decode_e4m3(uint8_t c) {
  return half_raw_to_float(__nv_cvt_fp8_to_halfraw(c, __NV_E4M3));
}
float cuda_decode_e5m2(uint8_t c) {
  return half_raw_to_float(__nv_cvt_fp8_to_halfraw(c, __NV_E5M2));
}
float cuda_decode_e2m1(uint8_t c) {
  return half_raw_to_float(__nv_cvt_fp4_to_halfraw(c, __NV_E2M1));
}
float cuda_decode_e8m0(uint8_t c) {
  return f32_from_bits((uint32_t)__nv_cvt_e8m0_to_bf16raw(c).x << 16);
}
float cuda_decode_bf16(uint16_t b) {
  __nv_bfloat16_raw r;
  r.x = b;
  return __bfloat162float(__nv_bfloat16(r));
}

// ------------------------------------------------------------------------------- the inputs
void add_with_neighbours(std::vector<uint32_t>& v, float x) {
  for (float s : {x, -x}) {
    v.push_back(f32_bits(s));
    v.push_back(f32_bits(std::nextafter(s, INFINITY)));
    v.push_back(f32_bits(std::nextafter(s, -INFINITY)));
  }
}

// Midpoints between adjacent finite non-negative values of a format (given by the CUDA decoder),
// including max and the virtual next value above it, with their neighbours and both signs.
template <typename Decode>
void add_midpoints(std::vector<uint32_t>& v, int ncodes, Decode decode) {
  std::vector<double> vals;
  for (int c = 0; c < ncodes; ++c) {
    const float f = decode((uint8_t)c);
    if (std::isfinite(f) && f >= 0) vals.push_back(f);
  }
  std::sort(vals.begin(), vals.end());
  vals.erase(std::unique(vals.begin(), vals.end()), vals.end());
  vals.push_back(vals.back() + (vals.back() - vals[vals.size() - 2]));
  for (size_t i = 0; i < vals.size(); ++i) {
    add_with_neighbours(v, (float)vals[i]);
    if (i + 1 < vals.size()) {
      const double mid = (vals[i] + vals[i + 1]) / 2;
      EXPECT_EQ((double)(float)mid, mid);  // one more significand bit: exact in FP32
      add_with_neighbours(v, (float)mid);
    }
  }
}

// Every FP32 value in [lo, hi], both signs.
void add_range(std::vector<uint32_t>& v, float lo, float hi) {
  for (uint32_t b = f32_bits(lo); b <= f32_bits(hi); ++b) {
    v.push_back(b);
    v.push_back(b | 0x80000000u);
  }
}

const std::vector<uint32_t>& targeted_inputs() {
  static const std::vector<uint32_t> inputs = [] {
    std::vector<uint32_t> v;
    for (uint32_t c = 0; c < (1u << 16); ++c) v.push_back(c << 16);  // every BF16 pattern
    for (uint32_t c = 0; c < 0x7F80u; ++c) {  // BF16 midpoints (c<<16)|0x8000 and neighbours
      const uint32_t mid = (c << 16) | 0x8000u;
      for (uint32_t b : {mid, mid - 1, mid + 1}) {
        v.push_back(b);
        v.push_back(b | 0x80000000u);
      }
    }
    add_midpoints(v, 16, cuda_decode_e2m1);
    add_midpoints(v, 256, cuda_decode_e4m3);
    add_midpoints(v, 256, cuda_decode_e5m2);
    for (int k = -127; k <= 127; ++k) {  // E8M0: powers of two and 1.5 * 2^k, neighbours
      add_with_neighbours(v, (float)std::ldexp(1.0, k));
      add_with_neighbours(v, (float)std::ldexp(1.5, k));
    }
    add_range(v, 4.875f, 6.25f);       // E2M1: tie 5.0, max 6, saturation
    add_range(v, 446.0f, 482.0f);      // E4M3: max 448, overflow threshold 464, 480
    add_range(v, 57000.0f, 62000.0f);  // E5M2: max 57344, overflow threshold 61440
    for (uint32_t b = 0x7F7F7000u; b <= 0x7F7FFFFFu; ++b) {  // BF16 overflow threshold window
      v.push_back(b);
      v.push_back(b | 0x80000000u);
    }
    for (uint32_t b = 0; b <= 0x1000u; ++b) {  // FP32 subnormals near 0 and near 2^-127
      v.push_back(b);
      v.push_back(b | 0x80000000u);
      v.push_back(0x003FF800u + b);
      v.push_back(0x805FF800u + b);
    }
    for (uint32_t b : {0x00000000u, 0x80000000u, 0x7F800000u, 0xFF800000u, 0x7FC00000u,
                       0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu, 0xFFFFFFFFu,
                       0x7FA00000u, 0xFFA00000u, 0x7FBFFFFFu, 0xFFBFFFFFu, 0x7F7FFFFFu,
                       0xFF7FFFFFu, 0x00800000u, 0x80800000u, 0x007FFFFFu, 0x807FFFFFu}) {
      v.push_back(b);
    }
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
    return v;
  }();
  return inputs;
}

// Calls f(bits) for the strided sweep and the targeted inputs; returns how many.
template <typename F>
uint64_t for_each_input(F f) {
  uint64_t n = 0;
  for (uint64_t b = 0; b < (1ull << 32); b += kStride, ++n) f((uint32_t)b);
  for (uint32_t b : targeted_inputs()) f(b), ++n;
  return n;
}

// Strided sweep plus the targeted inputs (about 10M: 65536 BF16 patterns, 196k BF16 midpoints,
// ~9.6M values of the saturation windows, the rest).
uint64_t min_comparisons() { return kStridedCount + 9000000; }

struct Mismatches {
  explicit Mismatches(std::string w) : what(std::move(w)) {}
  std::string what;
  uint64_t compared = 0, count = 0;
  std::string first;
  void check(bool ok, uint32_t input_bits, uint32_t got, uint32_t want, int digits) {
    ++compared;
    if (ok) return;
    if (count++ < 10) {
      std::ostringstream x;
      x << std::setprecision(9) << f32_from_bits(input_bits);
      first += "  input " + hex(input_bits, 8) + " (" + x.str() + "): fourbit " + hex(got, digits) +
               ", CUDA " + hex(want, digits) + "\n";
    }
  }
  void expect_none(uint64_t min_compared) const {
    std::cout << what << ": " << compared << " comparisons, " << count << " mismatches\n";
    EXPECT_EQ(count, 0u) << what << ": " << count << " of " << compared
                         << " comparisons differ (first 10):\n"
                         << first;
    EXPECT_GE(compared, min_compared) << what << ": too few comparisons";
  }
};

// Bit-exact encode comparison over all inputs, NaN included (fourbit defines NaN encodes as CUDA's:
// E2M1 -> 0x7, E4M3/E5M2 -> 0x7F, E8M0 -> 0xFF; element.h and NUMERICS 1.3).
template <typename Fourbit, typename Cuda>
void check_encode(const std::string& what, Fourbit fourbit, Cuda cuda, int digits) {
  Mismatches mm{what};
  const uint64_t n = for_each_input([&](uint32_t b) {
    const float x = f32_from_bits(b);
    const uint32_t got = fourbit(x), want = cuda(x);
    mm.check(got == want, b, got, want, digits);
  });
  EXPECT_EQ(mm.compared, n);
  mm.expect_none(min_comparisons());
}

// The oracle is what NUMERICS 1.3 / 9 say it is (guards against a header whose host path changed).
TEST(CudaHostOracle, OracleMatchesNumericsSection9) {
  EXPECT_EQ(cuda_e2m1(0.25f), 0x0);
  EXPECT_EQ(cuda_e2m1(5.0f), 0x6);
  EXPECT_EQ(cuda_e2m1(-0.0f), 0x8);
  EXPECT_EQ(cuda_e2m1(-NAN), 0x7);
  EXPECT_EQ(cuda_fp8(464.0f, __NV_SATFINITE, __NV_E4M3), 0x7E);
  EXPECT_EQ(cuda_fp8(464.01f, __NV_NOSAT, __NV_E4M3), 0x7F);
  EXPECT_EQ(cuda_fp8(-INFINITY, __NV_SATFINITE, __NV_E4M3), 0xFE);
  EXPECT_EQ(cuda_fp8(-NAN, __NV_SATFINITE, __NV_E4M3), 0x7F);
  EXPECT_EQ(cuda_fp8(61440.0f, __NV_SATFINITE, __NV_E5M2), 0x7B);
  EXPECT_EQ(cuda_fp8(61440.0f, __NV_NOSAT, __NV_E5M2), 0x7C);
  EXPECT_EQ(cuda_e8m0(1.5f, cudaRoundZero), 0x7F);
  EXPECT_EQ(cuda_e8m0(1.5f, cudaRoundPosInf), 0x80);
  EXPECT_EQ(cuda_e8m0(-4.0f, cudaRoundPosInf), 0x81);
  EXPECT_EQ(cuda_e8m0(INFINITY, cudaRoundPosInf), 0xFE);
  EXPECT_EQ(cuda_bf16(1.01171875f), 0x3F82);
  EXPECT_EQ(cuda_bf16(f32_from_bits(0x7F7F8000u)), 0x7F80);
}

TEST(CudaHostOracle, EncodeE2M1) {
  check_encode("E2M1 rn satfinite", [](float x) { return encode_e2m1_rn(x); }, cuda_e2m1, 1);
}
TEST(CudaHostOracle, EncodeE4M3SatFinite) {
  check_encode("E4M3 satfinite", [](float x) { return encode_e4m3_rn(x, Saturation::kSatFinite); },
               [](float x) { return cuda_fp8(x, __NV_SATFINITE, __NV_E4M3); }, 2);
}
TEST(CudaHostOracle, EncodeE4M3NoSat) {
  check_encode("E4M3 nosat", [](float x) { return encode_e4m3_rn(x, Saturation::kNoSat); },
               [](float x) { return cuda_fp8(x, __NV_NOSAT, __NV_E4M3); }, 2);
}
TEST(CudaHostOracle, EncodeE5M2SatFinite) {
  check_encode("E5M2 satfinite", [](float x) { return encode_e5m2_rn(x, Saturation::kSatFinite); },
               [](float x) { return cuda_fp8(x, __NV_SATFINITE, __NV_E5M2); }, 2);
}
TEST(CudaHostOracle, EncodeE5M2NoSat) {
  check_encode("E5M2 nosat", [](float x) { return encode_e5m2_rn(x, Saturation::kNoSat); },
               [](float x) { return cuda_fp8(x, __NV_NOSAT, __NV_E5M2); }, 2);
}
// fourbit's encode_e8m0 is the __NV_SATFINITE conversion (element.h); only that is compared.
TEST(CudaHostOracle, EncodeE8M0TowardZero) {
  check_encode("E8M0 rz satfinite",
               [](float x) { return encode_e8m0(x, E8m0Rounding::kTowardZero); },
               [](float x) { return cuda_e8m0(x, cudaRoundZero); }, 2);
}
TEST(CudaHostOracle, EncodeE8M0Up) {
  check_encode("E8M0 rp satfinite", [](float x) { return encode_e8m0(x, E8m0Rounding::kUp); },
               [](float x) { return cuda_e8m0(x, cudaRoundPosInf); }, 2);
}
TEST(CudaHostOracle, EncodeBF16) {
  // NaN compared by predicate (NUMERICS 1.3, BF16 paragraph: payloads differ between
  // implementations), everything else bit-exact.
  Mismatches mm{"BF16 rn"};
  const uint64_t n = for_each_input([&](uint32_t b) {
    const float x = f32_from_bits(b);
    const uint16_t got = encode_bf16_rn(x), want = cuda_bf16(x);
    const bool ok = is_nan_f32(x) ? (is_nan_f32(decode_bf16(got)) && is_nan_f32(decode_bf16(want)))
                                  : got == want;
    mm.check(ok, b, got, want, 4);
  });
  EXPECT_EQ(mm.compared, n);
  mm.expect_none(min_comparisons());
}

// Decoding every code; NaN by predicate (CUDA's half/bf16 NaN payloads are not fourbit's).
template <typename Fourbit, typename Cuda>
void check_decode(const std::string& what, uint32_t ncodes, Fourbit fourbit, Cuda cuda) {
  Mismatches mm{what};
  for (uint32_t c = 0; c < ncodes; ++c) {
    const float got = fourbit(c), want = cuda(c);
    const bool ok = std::isnan(want) ? std::isnan(got) : f32_bits(got) == f32_bits(want);
    mm.check(ok, c, f32_bits(got), f32_bits(want), 8);
  }
  mm.expect_none(ncodes);
}

TEST(CudaHostOracle, DecodeE2M1) {
  check_decode("decode E2M1", 16, [](uint32_t c) { return decode_e2m1((uint8_t)c); },
               [](uint32_t c) { return cuda_decode_e2m1((uint8_t)c); });
}
TEST(CudaHostOracle, DecodeE4M3) {
  check_decode("decode E4M3", 256, [](uint32_t c) { return decode_e4m3((uint8_t)c); },
               [](uint32_t c) { return cuda_decode_e4m3((uint8_t)c); });
}
TEST(CudaHostOracle, DecodeE5M2) {
  check_decode("decode E5M2", 256, [](uint32_t c) { return decode_e5m2((uint8_t)c); },
               [](uint32_t c) { return cuda_decode_e5m2((uint8_t)c); });
}
TEST(CudaHostOracle, DecodeE8M0) {
  check_decode("decode E8M0", 256, [](uint32_t c) { return decode_e8m0((uint8_t)c); },
               [](uint32_t c) { return cuda_decode_e8m0((uint8_t)c); });
}
TEST(CudaHostOracle, DecodeBF16) {
  check_decode("decode BF16", 1u << 16, [](uint32_t c) { return decode_bf16((uint16_t)c); },
               [](uint32_t c) { return cuda_decode_bf16((uint16_t)c); });
}

}  // namespace
}  // namespace fourbit::formats
