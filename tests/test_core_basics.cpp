// core: CHECK, tensors, the arena allocator and the Philox-4x32-10 generator.
#include "core/arena.h"
#include "core/check.h"
#include "core/rng.h"
#include "core/tensor.h"

#include <gtest/gtest.h>

namespace fourbit {
namespace {

TEST(Check, ThrowsWithFileLineConditionAndMessage) {
  try {
    const int n = 3;
    FOURBIT_CHECK(n == 4, "n was {}", n);
    FAIL() << "CHECK did not throw";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("test_core_basics.cpp"), std::string::npos) << what;
    EXPECT_NE(what.find("n == 4"), std::string::npos) << what;
    EXPECT_NE(what.find("n was 3"), std::string::npos) << what;
  }
  EXPECT_NO_THROW(FOURBIT_CHECK(true, "never"));
}

TEST(Tensor, ShapesStridesAndCopies) {
  Tensor t = Tensor::zeros({2, 3, 4}, DType::kF32, Device::kCpu);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.view().strides, Shape({12, 4, 1}));
  EXPECT_EQ(t.view().rows(), 6);
  EXPECT_EQ(t.view().cols(), 4);
  t.ptr<float>()[5] = 2.5f;
  Tensor u = t.to(Device::kCpu);
  EXPECT_EQ(u.ptr<float>()[5], 2.5f);
  EXPECT_NE(u.data(), t.data());
  EXPECT_EQ(dtype_bytes(DType::kE2M1x2, 17), 9);
  EXPECT_EQ(Tensor::empty({5, 7}, DType::kE2M1x2, Device::kCpu).nbytes(), 18);
}

TEST(Arena, AlignsTracksPeakAndNamesTheBufferWhenFull) {
  Arena arena(4096, Device::kCpu);
  TensorView a = arena.alloc({10}, DType::kF32, "a");
  TensorView b = arena.alloc({3}, DType::kBF16, "b");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data) % Arena::kAlignment, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data) % Arena::kAlignment, 0u);
  EXPECT_EQ(static_cast<char*>(b.data) - static_cast<char*>(a.data), 256);
  const int64_t mark = arena.mark();
  arena.alloc({100}, DType::kF32, "c");
  EXPECT_GT(arena.used(), mark);
  arena.reset_to(mark);
  EXPECT_EQ(arena.used(), mark);
  try {
    arena.alloc({4096}, DType::kF32, "activations.layer0");
    FAIL() << "arena did not report running out of space";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("activations.layer0"), std::string::npos);
  }
  EXPECT_GE(arena.peak(), 256 + 400);
}

// Known-answer tests from the Random123 distribution (kat_vectors, philox4x32_10).
TEST(Philox, MatchesRandom123KnownAnswers) {
  Philox4x32Result r = philox4x32_10(0, 0, 0, 0, 0, 0);
  EXPECT_EQ(r.v[0], 0x6627e8d5u);
  EXPECT_EQ(r.v[1], 0xe169c58du);
  EXPECT_EQ(r.v[2], 0xbc57ac4cu);
  EXPECT_EQ(r.v[3], 0x9b00dbd8u);
  r = philox4x32_10(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu);
  EXPECT_EQ(r.v[0], 0x408f276du);
  EXPECT_EQ(r.v[1], 0x41c83b0eu);
  EXPECT_EQ(r.v[2], 0xa20bc7c6u);
  EXPECT_EQ(r.v[3], 0x6d5451fdu);
  r = philox4x32_10(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u);
  EXPECT_EQ(r.v[0], 0xd16cfe09u);
  EXPECT_EQ(r.v[1], 0x94fdccebu);
  EXPECT_EQ(r.v[2], 0x5001e420u);
  EXPECT_EQ(r.v[3], 0x24126ea1u);
}

TEST(Philox, StreamsAreIndependentAndBytesAreUniform) {
  const RandomStream a{42, 1}, b{42, 2};
  int same = 0;
  int64_t counts[256] = {};
  const int n = 1 << 18;
  for (int i = 0; i < n; ++i) {
    same += a.byte_at(i) == b.byte_at(i);
    counts[a.byte_at(i)]++;
  }
  EXPECT_LT(same, n / 256 * 2);  // about n/256 coincidences expected
  // Chi-square over 256 bins, 255 degrees of freedom: 99.99% quantile ~ 340.
  double chi2 = 0;
  const double expect = n / 256.0;
  for (int64_t c : counts) chi2 += (c - expect) * (c - expect) / expect;
  EXPECT_LT(chi2, 340.0);
}

}  // namespace
}  // namespace fourbit
