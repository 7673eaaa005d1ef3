// N ranks as N threads of one process: the fake communicator that the CPU tests use to check the
// data- and expert-parallel logic against the single-rank result (issue #8).
//
// An InProcessGroup is the rendezvous that its N InProcessCommunicators share. A collective is two
// barriers: every rank posts its arguments (buffers, counts, root) and waits until all have
// posted; every rank then checks that all posted the same collective with matching dtypes and
// counts (an Error on every rank otherwise), computes ITS OWN output by reading the other ranks'
// posted buffers directly (no copies through the group), and waits at the second barrier so that
// no rank returns (and reuses its buffers) while another still reads them. Sums add the ranks'
// values in rank order 0..R-1 in the buffer's precision (bf16: accumulated in f32, rounded to
// bf16 once), so the result is bit for bit a plain single-process loop over the ranks' buffers.
//
// Failure: a rank that throws outside a collective would leave the others waiting forever;
// run_ranks() therefore aborts the group when a rank's function throws, which makes every
// waiting (and later) collective throw "another rank failed", and rethrows the first error.
// CPU buffers only.
#pragma once

#include "dist/communicator.h"

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace fourbit::dist {

class InProcessGroup {
 public:
  explicit InProcessGroup(int size);
  int size() const { return size_; }
  // Makes every current and future wait of this group throw (a rank failed).
  void abort();

 private:
  friend class InProcessCommunicator;
  enum class Op : uint8_t { kAllReduce, kReduceScatter, kAllGather, kAllToAll, kBroadcast, kBarrier };
  struct Post {
    Op op = Op::kBarrier;
    TensorView send, recv;
    std::vector<int64_t> counts, recv_counts;  // reduce_scatter / all_gather: per rank; a2a: send
    int root = 0;
  };
  // Waits until all ranks reached this barrier (generation-counted, reusable).
  void wait(int rank);

  int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
  std::vector<Post> posts_;  // [size]
};

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<InProcessGroup> group, int rank);

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  Device device() const override { return Device::kCpu; }
  void all_reduce_sum(const TensorView& x) override;
  void reduce_scatter_sum(const TensorView& send, const TensorView& recv,
                          std::span<const int64_t> counts) override;
  void all_gather(const TensorView& send, const TensorView& recv,
                  std::span<const int64_t> counts) override;
  void all_to_allv(const TensorView& send, std::span<const int64_t> send_counts,
                   const TensorView& recv, std::span<const int64_t> recv_counts) override;
  void broadcast(const TensorView& x, int root) override;
  void barrier() override;

 private:
  // Posts `post`, waits for every rank, checks that they all posted `post.op` with `post`'s dtype.
  const std::vector<InProcessGroup::Post>& exchange(InProcessGroup::Post post, const char* what);
  std::shared_ptr<InProcessGroup> group_;
  int rank_;
};

// Runs fn(comm) for ranks 0..size-1, each on its own thread with its own InProcessCommunicator of
// one fresh group; waits for all; rethrows the first exception (aborting the group so that the
// other ranks do not wait forever).
void run_ranks(int size, const std::function<void(Communicator& comm)>& fn);

}  // namespace fourbit::dist
