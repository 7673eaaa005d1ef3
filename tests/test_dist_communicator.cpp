// The in-process communicator (dist/in_process_communicator.h): every collective against a plain
// single-process computation over the ranks' buffers, for 1..4 ranks, uneven counts, in-place use,
// bf16 rounding, and the errors for mismatched calls.
#include "dist/in_process_communicator.h"

#include "core/check.h"
#include "formats/element.h"

#include <gtest/gtest.h>

#include <cmath>
#include <mutex>
#include <numeric>
#include <vector>

namespace fourbit::dist {
namespace {

// A value that is different on every rank and index, with bits below f32 rounding of the sum.
float value(int rank, int64_t i) { return 1.0f / (float)(3 + rank) + (float)i * 0.37f - 0.001f * (float)(i * i % 7); }

TensorView view(std::vector<float>& v) {
  return TensorView::contiguous(v.data(), DType::kF32, {(int64_t)v.size()}, Device::kCpu);
}

TEST(DistCommunicator, AllReduceSumsInRankOrder) {
  for (int R = 1; R <= 4; ++R) {
    const int64_t n = 37;
    std::vector<std::vector<float>> out((size_t)R);
    run_ranks(R, [&](Communicator& c) {
      std::vector<float> x((size_t)n);
      for (int64_t i = 0; i < n; ++i) x[(size_t)i] = value(c.rank(), i);
      c.all_reduce_sum(view(x));
      out[(size_t)c.rank()] = x;
    });
    for (int64_t i = 0; i < n; ++i) {
      float expect = value(0, i);
      for (int p = 1; p < R; ++p) expect += value(p, i);
      for (int r = 0; r < R; ++r) ASSERT_EQ(out[(size_t)r][(size_t)i], expect) << "R " << R << " rank " << r << " i " << i;
    }
  }
}

TEST(DistCommunicator, AllReduceBf16RoundsOnce) {
  const int R = 3;
  std::vector<uint16_t> result;
  std::mutex mu;
  run_ranks(R, [&](Communicator& c) {
    // 1 + 2^-8 + 2^-8: bf16 steps by 2^-7 at 1, so a bf16 running sum rounds each 1 + 2^-8 (a
    // tie) back to 1; the f32 sum 1 + 2^-7, rounded once, is representable and kept.
    const float v = c.rank() == 0 ? 1.0f : std::ldexp(1.0f, -8);
    std::vector<uint16_t> x(4, formats::encode_bf16_rn(v));
    if (c.rank() > 0) {
      ASSERT_EQ(formats::decode_bf16(x[0]), std::ldexp(1.0f, -8));
    }
    c.all_reduce_sum(TensorView::contiguous(x.data(), DType::kBF16, {4}, Device::kCpu));
    std::lock_guard<std::mutex> lk(mu);
    if (c.rank() == 1) result = x;
  });
  for (uint16_t b : result) EXPECT_EQ(formats::decode_bf16(b), 1.0f + std::ldexp(1.0f, -7));
}

TEST(DistCommunicator, ReduceScatterAndAllGatherUnevenInPlace) {
  for (int R = 1; R <= 4; ++R) {
    std::vector<int64_t> counts;
    for (int p = 0; p < R; ++p) counts.push_back(5 + 3 * p - (p == 2 ? 8 : 0));  // rank 2 gets 0
    const int64_t total = std::accumulate(counts.begin(), counts.end(), (int64_t)0);
    std::vector<std::vector<float>> full((size_t)R);
    run_ranks(R, [&](Communicator& c) {
      const int r = c.rank();
      std::vector<float> x((size_t)total);
      for (int64_t i = 0; i < total; ++i) x[(size_t)i] = value(r, i);
      int64_t off = 0;
      for (int p = 0; p < r; ++p) off += counts[(size_t)p];
      const TensorView own = TensorView::contiguous(x.data() + off, DType::kF32,
                                                    {counts[(size_t)r]}, Device::kCpu);
      c.reduce_scatter_sum(view(x), own, counts);  // in place
      for (int64_t i = 0; i < counts[(size_t)r]; ++i) x[(size_t)(off + i)] *= 2.0f;
      c.all_gather(own, view(x), counts);  // in place
      full[(size_t)r] = x;
    });
    for (int64_t i = 0; i < total; ++i) {
      float expect = value(0, i);
      for (int p = 1; p < R; ++p) expect += value(p, i);
      expect *= 2.0f;
      for (int r = 0; r < R; ++r) ASSERT_EQ(full[(size_t)r][(size_t)i], expect) << R << " " << r << " " << i;
    }
  }
}

TEST(DistCommunicator, AllToAllvAndBroadcast) {
  for (int R = 1; R <= 4; ++R) {
    // Rank s sends (s + d) % 3 elements to rank d, holding 1000 s + 10 d + j.
    std::vector<std::vector<float>> got((size_t)R);
    std::vector<std::vector<int64_t>> counts_seen((size_t)R);
    run_ranks(R, [&](Communicator& c) {
      const int s = c.rank();
      std::vector<int64_t> send_counts;
      std::vector<float> send;
      for (int d = 0; d < R; ++d) {
        send_counts.push_back((s + d) % 3);
        for (int j = 0; j < (s + d) % 3; ++j) send.push_back(1000.0f * s + 10.0f * d + j);
      }
      const std::vector<int64_t> recv_counts = all_to_all_counts(c, send_counts);
      std::vector<float> recv((size_t)std::accumulate(recv_counts.begin(), recv_counts.end(), (int64_t)0));
      c.all_to_allv(view(send), send_counts, view(recv), recv_counts);
      std::vector<float> b = {c.rank() == R - 1 ? 7.5f : -1.0f, 2.0f * (float)c.rank()};
      c.broadcast(view(b), R - 1);
      recv.push_back(b[0]);
      recv.push_back(b[1]);
      got[(size_t)s] = recv;
      counts_seen[(size_t)s] = recv_counts;
    });
    for (int d = 0; d < R; ++d) {
      std::vector<float> expect;
      for (int s = 0; s < R; ++s) {
        EXPECT_EQ(counts_seen[(size_t)d][(size_t)s], (s + d) % 3);
        for (int j = 0; j < (s + d) % 3; ++j) expect.push_back(1000.0f * s + 10.0f * d + j);
      }
      expect.push_back(7.5f);
      expect.push_back(2.0f * (float)(R - 1));
      EXPECT_EQ(got[(size_t)d], expect) << "R " << R << " rank " << d;
    }
  }
}

TEST(DistCommunicator, MismatchedCallsAreErrorsNotHangs) {
  // Rank 1 calls a different collective: every rank gets an Error (no deadlock).
  try {
    run_ranks(2, [&](Communicator& c) {
      std::vector<float> x(4, 1.0f);
      if (c.rank() == 0) c.all_reduce_sum(view(x)); else c.broadcast(view(x), 0);
    });
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("same collectives"), std::string::npos) << e.what();
  }
  // A rank that fails outside a collective: the others are released by run_ranks' abort.
  try {
    run_ranks(3, [&](Communicator& c) {
      if (c.rank() == 2) throw Error("rank 2 failed on purpose");
      c.barrier();
    });
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("on purpose"), std::string::npos) << e.what();
  }
  // Wrong counts.
  EXPECT_THROW(run_ranks(2, [&](Communicator& c) {
                 std::vector<float> x(4, 1.0f), y(2);
                 const std::vector<int64_t> counts = {2, 3};
                 c.reduce_scatter_sum(view(x), view(y), counts);
               }),
               Error);
}

}  // namespace
}  // namespace fourbit::dist
