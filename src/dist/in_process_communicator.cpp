// The in-process communicator (in_process_communicator.h): ranks are threads, collectives are two
// barriers around direct reads of the other ranks' buffers.
#include "dist/in_process_communicator.h"

#include "core/check.h"
#include "formats/element.h"

#include <cstring>
#include <exception>
#include <thread>

namespace fourbit::dist {

namespace {

const char* op_name(int op) {
  static const char* kNames[] = {"all_reduce_sum", "reduce_scatter_sum", "all_gather",
                                 "all_to_allv",    "broadcast",          "barrier"};
  return kNames[op];
}

char* bytes_at(const TensorView& x, int64_t elements) {
  return static_cast<char*>(x.data) + dtype_bytes(x.dtype, elements);
}

bool overlaps(const TensorView& a, const TensorView& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const char* a0 = static_cast<const char*>(a.data);
  const char* b0 = static_cast<const char*>(b.data);
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

template <typename T>
void sum_typed(void* out, const std::vector<const void*>& in, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    T acc = static_cast<const T*>(in[0])[i];
    for (size_t p = 1; p < in.size(); ++p) acc += static_cast<const T*>(in[p])[i];
    static_cast<T*>(out)[i] = acc;
  }
}

// out[i] = in[0][i] + in[1][i] + ... in rank order, in the dtype's precision (bf16 through f32).
// `out` may be one of `in` (each index is read from every input before it is written).
void sum_in_rank_order(void* out, const std::vector<const void*>& in, int64_t n, DType dtype) {
  switch (dtype) {
    case DType::kF64: sum_typed<double>(out, in, n); return;
    case DType::kF32: sum_typed<float>(out, in, n); return;
    case DType::kBF16: {
      for (int64_t i = 0; i < n; ++i) {
        float acc = formats::decode_bf16(static_cast<const uint16_t*>(in[0])[i]);
        for (size_t p = 1; p < in.size(); ++p)
          acc += formats::decode_bf16(static_cast<const uint16_t*>(in[p])[i]);
        static_cast<uint16_t*>(out)[i] = formats::encode_bf16_rn(acc);
      }
      return;
    }
    default: FOURBIT_CHECK(false, "sum_in_rank_order: dtype {} cannot be summed", dtype_name(dtype));
  }
}

}  // namespace

InProcessGroup::InProcessGroup(int size) : size_(size) {
  FOURBIT_CHECK(size >= 1, "InProcessGroup: the number of ranks must be >= 1, got {}", size);
  posts_.resize((size_t)size);
}

void InProcessGroup::abort() {
  std::lock_guard<std::mutex> lk(mu_);
  aborted_ = true;
  cv_.notify_all();
}

void InProcessGroup::wait(int rank) {
  std::unique_lock<std::mutex> lk(mu_);
  FOURBIT_CHECK(!aborted_, "rank {}: another rank of the in-process group failed", rank);
  const uint64_t gen = generation_;
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return;
  }
  cv_.wait(lk, [&] { return generation_ != gen || aborted_; });
  FOURBIT_CHECK(generation_ != gen, "rank {}: another rank of the in-process group failed", rank);
}

InProcessCommunicator::InProcessCommunicator(std::shared_ptr<InProcessGroup> group, int rank)
    : group_(std::move(group)), rank_(rank) {
  FOURBIT_CHECK(group_ != nullptr, "InProcessCommunicator: no group");
  FOURBIT_CHECK(rank >= 0 && rank < group_->size(),
                "InProcessCommunicator: rank {} outside [0, {})", rank, group_->size());
}

const std::vector<InProcessGroup::Post>& InProcessCommunicator::exchange(InProcessGroup::Post post,
                                                                         const char* what) {
  const InProcessGroup::Op op = post.op;
  const DType dtype = post.send.dtype;
  {
    std::lock_guard<std::mutex> lk(group_->mu_);
    group_->posts_[(size_t)rank_] = std::move(post);
  }
  group_->wait(rank_);
  const std::vector<InProcessGroup::Post>& posts = group_->posts_;
  for (int p = 0; p < size(); ++p) {
    const InProcessGroup::Post& q = posts[(size_t)p];
    if (q.op != op) {
      group_->wait(rank_);  // let every rank see the mismatch before anyone posts again
      FOURBIT_CHECK(false, "{}: rank {} called {} while rank {} called {}: every rank must call "
                    "the same collectives in the same order", what, rank_, what, p,
                    op_name((int)q.op));
    }
    if (op != InProcessGroup::Op::kBarrier && q.send.dtype != dtype) {
      group_->wait(rank_);
      FOURBIT_CHECK(false, "{}: rank {} passed {} but rank {} passed {}", what, rank_,
                    dtype_name(dtype), p, dtype_name(q.send.dtype));
    }
  }
  return posts;
}

void InProcessCommunicator::all_reduce_sum(const TensorView& x) {
  check_buffer(x, Device::kCpu, true, x.numel(), "all_reduce_sum");
  InProcessGroup::Post post;
  post.op = InProcessGroup::Op::kAllReduce;
  post.send = x;
  const auto& posts = exchange(post, "all_reduce_sum");
  for (const auto& q : posts)
    if (q.send.numel() != x.numel()) {
      group_->wait(rank_);
      FOURBIT_CHECK(false, "all_reduce_sum: rank {} has {} elements, another rank {}", rank_,
                    x.numel(), q.send.numel());
    }
  // Every rank reads every buffer: sum into a private copy, write it after the second barrier.
  std::vector<char> sum((size_t)x.nbytes());
  std::vector<const void*> in;
  for (const auto& q : posts) in.push_back(q.send.data);
  sum_in_rank_order(sum.data(), in, x.numel(), x.dtype);
  group_->wait(rank_);
  if (!sum.empty()) std::memcpy(x.data, sum.data(), sum.size());
}

void InProcessCommunicator::reduce_scatter_sum(const TensorView& send, const TensorView& recv,
                                               std::span<const int64_t> counts) {
  const int64_t total = check_counts(counts, size(), "reduce_scatter_sum");
  check_buffer(send, Device::kCpu, true, total, "reduce_scatter_sum (send)");
  check_buffer(recv, Device::kCpu, true, counts[(size_t)rank_], "reduce_scatter_sum (recv)");
  FOURBIT_CHECK(send.dtype == recv.dtype, "reduce_scatter_sum: send is {} but recv is {}",
                dtype_name(send.dtype), dtype_name(recv.dtype));
  int64_t offset = 0;
  for (int p = 0; p < rank_; ++p) offset += counts[(size_t)p];
  const TensorView own = TensorView::contiguous(bytes_at(send, offset), send.dtype,
                                                {counts[(size_t)rank_]}, Device::kCpu);
  FOURBIT_CHECK(!overlaps(recv, send) || recv.data == own.data,
                "reduce_scatter_sum: recv overlaps send other than exactly at this rank's block");
  InProcessGroup::Post post;
  post.op = InProcessGroup::Op::kReduceScatter;
  post.send = send;
  post.counts.assign(counts.begin(), counts.end());
  const auto& posts = exchange(post, "reduce_scatter_sum");
  for (const auto& q : posts)
    if (q.counts != posts[(size_t)rank_].counts) {
      group_->wait(rank_);
      FOURBIT_CHECK(false, "reduce_scatter_sum: the ranks passed different counts");
    }
  std::vector<const void*> in;
  for (const auto& q : posts) in.push_back(bytes_at(q.send, offset));
  sum_in_rank_order(recv.data, in, counts[(size_t)rank_], recv.dtype);
  group_->wait(rank_);
}

void InProcessCommunicator::all_gather(const TensorView& send, const TensorView& recv,
                                       std::span<const int64_t> counts) {
  const int64_t total = check_counts(counts, size(), "all_gather");
  check_buffer(send, Device::kCpu, false, counts[(size_t)rank_], "all_gather (send)");
  check_buffer(recv, Device::kCpu, false, total, "all_gather (recv)");
  FOURBIT_CHECK(send.dtype == recv.dtype, "all_gather: send is {} but recv is {}",
                dtype_name(send.dtype), dtype_name(recv.dtype));
  int64_t own_offset = 0;
  for (int p = 0; p < rank_; ++p) own_offset += counts[(size_t)p];
  FOURBIT_CHECK(!overlaps(send, recv) || send.data == bytes_at(recv, own_offset),
                "all_gather: send overlaps recv other than exactly at this rank's block");
  InProcessGroup::Post post;
  post.op = InProcessGroup::Op::kAllGather;
  post.send = send;
  post.counts.assign(counts.begin(), counts.end());
  const auto& posts = exchange(post, "all_gather");
  for (const auto& q : posts)
    if (q.counts != posts[(size_t)rank_].counts) {
      group_->wait(rank_);
      FOURBIT_CHECK(false, "all_gather: the ranks passed different counts");
    }
  int64_t offset = 0;
  for (int p = 0; p < size(); ++p) {
    char* dst = bytes_at(recv, offset);
    const int64_t n = counts[(size_t)p];
    if (dst != posts[(size_t)p].send.data && n > 0)
      std::memcpy(dst, posts[(size_t)p].send.data, (size_t)dtype_bytes(recv.dtype, n));
    offset += n;
  }
  group_->wait(rank_);
}

void InProcessCommunicator::all_to_allv(const TensorView& send, std::span<const int64_t> send_counts,
                                        const TensorView& recv,
                                        std::span<const int64_t> recv_counts) {
  const int64_t send_total = check_counts(send_counts, size(), "all_to_allv (send counts)");
  const int64_t recv_total = check_counts(recv_counts, size(), "all_to_allv (recv counts)");
  check_buffer(send, Device::kCpu, false, send_total, "all_to_allv (send)");
  check_buffer(recv, Device::kCpu, false, recv_total, "all_to_allv (recv)");
  FOURBIT_CHECK(send.dtype == recv.dtype, "all_to_allv: send is {} but recv is {}",
                dtype_name(send.dtype), dtype_name(recv.dtype));
  FOURBIT_CHECK(!overlaps(send, recv), "all_to_allv: send and recv must not overlap");
  InProcessGroup::Post post;
  post.op = InProcessGroup::Op::kAllToAll;
  post.send = send;
  post.counts.assign(send_counts.begin(), send_counts.end());
  const auto& posts = exchange(post, "all_to_allv");
  for (int p = 0; p < size(); ++p) {
    if (posts[(size_t)p].counts[(size_t)rank_] != recv_counts[(size_t)p]) {
      group_->wait(rank_);
      FOURBIT_CHECK(false, "all_to_allv: rank {} expects {} elements from rank {}, which sends {}",
                    rank_, recv_counts[(size_t)p], p, posts[(size_t)p].counts[(size_t)rank_]);
    }
  }
  int64_t offset = 0;
  for (int p = 0; p < size(); ++p) {
    const InProcessGroup::Post& q = posts[(size_t)p];
    int64_t src_offset = 0;
    for (int d = 0; d < rank_; ++d) src_offset += q.counts[(size_t)d];
    const int64_t n = recv_counts[(size_t)p];
    if (n > 0)
      std::memcpy(bytes_at(recv, offset), bytes_at(q.send, src_offset),
                  (size_t)dtype_bytes(recv.dtype, n));
    offset += n;
  }
  group_->wait(rank_);
}

void InProcessCommunicator::broadcast(const TensorView& x, int root) {
  FOURBIT_CHECK(root >= 0 && root < size(), "broadcast: root {} outside [0, {})", root, size());
  check_buffer(x, Device::kCpu, false, x.numel(), "broadcast");
  InProcessGroup::Post post;
  post.op = InProcessGroup::Op::kBroadcast;
  post.send = x;
  post.root = root;
  const auto& posts = exchange(post, "broadcast");
  for (const auto& q : posts)
    if (q.root != root || q.send.numel() != x.numel()) {
      group_->wait(rank_);
      FOURBIT_CHECK(false, "broadcast: the ranks passed different roots or sizes");
    }
  if (rank_ != root && x.numel() > 0)
    std::memcpy(x.data, posts[(size_t)root].send.data, (size_t)x.nbytes());
  group_->wait(rank_);
}

void InProcessCommunicator::barrier() {
  InProcessGroup::Post post;
  post.op = InProcessGroup::Op::kBarrier;
  exchange(post, "barrier");
  group_->wait(rank_);
}

void run_ranks(int size, const std::function<void(Communicator& comm)>& fn) {
  auto group = std::make_shared<InProcessGroup>(size);
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        InProcessCommunicator comm(group, r);
        fn(comm);
      } catch (...) {
        {
          std::lock_guard<std::mutex> lk(mu);
          if (!first) first = std::current_exception();
        }
        group->abort();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace fourbit::dist
