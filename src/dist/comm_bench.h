// `fourbit bench comm`: the bus bandwidth of the collectives that data and expert parallelism use
// (all-reduce, reduce-scatter, all-gather, all-to-all), measured over any Communicator: NCCL
// between the GPUs of a `fourbit launch -n N -- bench comm` run, or the in-process ranks (threads,
// CPU buffers) that the CPU tests use.
//
// Definitions (those of NVIDIA's nccl-tests, so the figures compare with theirs):
//   size S   all_reduce: the buffer; reduce_scatter: the whole send buffer (R blocks);
//            all_gather: the whole receive buffer; all_to_all: the whole send buffer.
//   algbw    S / t, t = the time of one collective (the slowest rank's).
//   busbw    algbw * 2 (R - 1) / R for all_reduce, algbw * (R - 1) / R for the others: the bytes
//            each link must carry in an optimal ring, so busbw is comparable with the link's
//            bandwidth whatever R is.
// Timing: per round, a barrier, `reps` collectives back to back, a barrier (which waits for the
// GPU work); the round's time / reps is one sample; the median of the rounds on each rank, then the
// largest over the ranks. Each case is checked once against the values it must produce (exact
// small integers; BF16 sums within R roundings), and a wrong result is reported, never timed.
// Ceiling: busbw is printed against `ceiling_gbs` when given (the measured peer-to-peer or NVLink
// figure of the machine; nothing is assumed).
#pragma once

#include "dist/communicator.h"

#include <cstdint>
#include <string>
#include <vector>

namespace fourbit::dist {

struct CommBenchOptions {
  std::vector<int64_t> sizes = {1 << 20, 8 << 20, 64 << 20, 256 << 20};  // S in bytes
  DType dtype = DType::kBF16;
  int rounds = 5, reps = 10, warmup = 2;
  std::string only;          // only the collectives whose name contains this text
  double ceiling_gbs = 0;    // > 0: busbw's fraction of it is printed
};

struct CommBenchRow {
  std::string collective;
  int64_t bytes = 0;   // S
  double us = 0;       // one collective, slowest rank
  double algbw_gbs = 0, busbw_gbs = 0;
  bool correct = false;
  std::string error;   // the first wrong element, when !correct
};

// A collective: every rank calls it with the same options; every rank gets the same rows.
std::vector<CommBenchRow> run_comm_bench(Communicator& comm, const CommBenchOptions& options);

// The table (one row per case) with a header naming the ranks, device and dtype.
std::string format_comm_bench(const std::vector<CommBenchRow>& rows, const CommBenchOptions& options,
                              int world, Device device);

}  // namespace fourbit::dist
