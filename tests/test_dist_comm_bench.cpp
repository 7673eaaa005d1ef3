// `bench comm`'s measurement (dist/comm_bench.h) over in-process ranks: every collective is checked
// right (its check would report a wrong result), sizes are whole blocks per rank, the bus factors
// are nccl-tests' (busbw / algbw = 2 (R - 1) / R for all-reduce, (R - 1) / R otherwise), and a
// communicator that corrupts one collective's output is reported as WRONG RESULT, not timed.
#include "dist/comm_bench.h"
#include "dist/in_process_communicator.h"

#include <gtest/gtest.h>

#include <mutex>

namespace fourbit::dist {
namespace {

CommBenchOptions small_options(DType dtype) {
  CommBenchOptions o;
  o.sizes = {4096, 10000};  // 10000 bytes is not a whole number of blocks: rounded down per rank
  o.dtype = dtype;
  o.rounds = 2;
  o.reps = 2;
  o.warmup = 1;
  return o;
}

TEST(DistCommBench, EveryCollectiveIsCorrectAndTimed) {
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    for (int R : {1, 2, 3}) {
      std::vector<std::vector<CommBenchRow>> rows((size_t)R);
      run_ranks(R, [&](Communicator& comm) { rows[(size_t)comm.rank()] = run_comm_bench(comm, small_options(dtype)); });
      ASSERT_EQ(rows[0].size(), 8u);
      const int64_t e = dtype_bytes(dtype, 1);
      for (const CommBenchRow& r : rows[0]) {
        const std::string what = fmt::format("{} {} at {} ranks, {} bytes", dtype_name(dtype), r.collective, R, r.bytes);
        EXPECT_TRUE(r.correct) << what << ": " << r.error;
        EXPECT_EQ(r.bytes % (e * R), 0) << what;
        EXPECT_GT(r.us, 0) << what;
        const double factor = r.collective == "all_reduce" ? 2.0 * (R - 1) / R : (double)(R - 1) / R;
        EXPECT_NEAR(r.busbw_gbs, r.algbw_gbs * factor, 1e-9 * r.algbw_gbs) << what;
        EXPECT_NEAR(r.algbw_gbs, (double)r.bytes / (r.us * 1e-6) * 1e-9, 1e-6 * r.algbw_gbs) << what;
      }
      for (int p = 1; p < R; ++p)  // every rank reports the same (slowest-rank) times
        for (size_t i = 0; i < rows[0].size(); ++i) EXPECT_EQ(rows[(size_t)p][i].us, rows[0][i].us);
      const std::string table = format_comm_bench(rows[0], small_options(dtype), R, Device::kCpu);
      EXPECT_NE(table.find("reduce_scatter"), std::string::npos) << table;
      EXPECT_EQ(table.find("WRONG"), std::string::npos) << table;
    }
  }
}

// Forwards to a real communicator, then corrupts all_gather's output on one rank.
class CorruptingCommunicator final : public Communicator {
 public:
  explicit CorruptingCommunicator(Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  Device device() const override { return inner_.device(); }
  void all_reduce_sum(const TensorView& x) override { inner_.all_reduce_sum(x); }
  void reduce_scatter_sum(const TensorView& s, const TensorView& r, std::span<const int64_t> c) override {
    inner_.reduce_scatter_sum(s, r, c);
  }
  void all_gather(const TensorView& s, const TensorView& r, std::span<const int64_t> c) override {
    inner_.all_gather(s, r, c);
    if (rank() == 1) static_cast<float*>(r.data)[r.numel() - 1] += 1.0f;
  }
  void all_to_allv(const TensorView& s, std::span<const int64_t> sc, const TensorView& r,
                   std::span<const int64_t> rc) override {
    inner_.all_to_allv(s, sc, r, rc);
  }
  void broadcast(const TensorView& x, int root) override { inner_.broadcast(x, root); }
  void barrier() override { inner_.barrier(); }

 private:
  Communicator& inner_;
};

TEST(DistCommBench, AWrongResultIsReportedOnEveryRankAndNotTimed) {
  CommBenchOptions o = small_options(DType::kF32);
  o.only = "all_gather";
  std::vector<std::vector<CommBenchRow>> rows(2);
  run_ranks(2, [&](Communicator& inner) {
    CorruptingCommunicator comm(inner);
    rows[(size_t)comm.rank()] = run_comm_bench(comm, o);
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(rows[(size_t)r].size(), 2u);
    for (const CommBenchRow& row : rows[(size_t)r]) {
      EXPECT_FALSE(row.correct) << "rank " << r;
      EXPECT_EQ(row.us, 0) << "rank " << r;
      EXPECT_FALSE(row.error.empty()) << "rank " << r;
    }
  }
  EXPECT_NE(rows[1][0].error.find("instead of"), std::string::npos) << rows[1][0].error;
  EXPECT_EQ(rows[0][0].error, "wrong on another rank");
  const std::string table = format_comm_bench(rows[1], o, 2, Device::kCpu);
  EXPECT_NE(table.find("WRONG RESULT"), std::string::npos) << table;
}

}  // namespace
}  // namespace fourbit::dist
