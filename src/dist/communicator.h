// Collective communication between the ranks of a data- or expert-parallel run: the one interface
// that the ZeRO-1 optimizer (zero_optimizer.h), expert parallelism (expert_parallel.h) and the
// data-parallel trainer hooks (data_parallel.h) are written against. Two implementations:
//   InProcessCommunicator (in_process_communicator.h): N ranks as threads of one process, CPU
//     buffers; the test double that checks the sharding and dispatch logic without GPUs.
//   NcclCommunicator (nccl_communicator.h, only when the build found NCCL): one process per GPU.
//
// Contract shared by every implementation.
//   * Every rank calls the same collectives in the same order with matching arguments (dtype,
//     counts); a mismatch is an error (the in-process one detects it, NCCL may hang).
//   * Buffers are contiguous tensors on device(), viewed as flat arrays of numel() elements of
//     their dtype; counts are in elements. Data movement (all_gather, all_to_allv, broadcast)
//     takes f64, f32, bf16, i32 or i64; reductions take f64, f32 or bf16.
//   * Sums are deterministic. The in-process communicator adds the ranks' values in rank order
//     (0, 1, ..., R-1) in the buffer's own precision (bf16: in f32, rounded once at the end), so
//     its result equals a plain single-process loop over the ranks' buffers. NCCL's order is its
//     own (ring/tree) but fixed for a given topology.
//   * Completion: on return a CPU buffer holds the result; a CUDA buffer holds it for any work
//     enqueued afterwards on the communicator's stream (synchronize before reading on the host).
//   * Aliasing: reduce_scatter_sum's recv may be exactly its own block of send (in place);
//     all_gather's send may be exactly its own block of recv (in place); all_to_allv's buffers
//     must not overlap.
#pragma once

#include "core/tensor.h"

#include <cstdint>
#include <span>
#include <vector>

namespace fourbit::dist {

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Device device() const = 0;  // where the buffers of the collectives live

  // x[i] = sum over ranks of x[i], in place.                                x: [n] on every rank
  virtual void all_reduce_sum(const TensorView& x) = 0;
  // recv[i] = sum over ranks p of send_p[offset_r + i], offset_r = counts[0] + ... + counts[r-1].
  //   send: [sum(counts)] (one block per rank, in rank order), recv: [counts[rank()]]
  virtual void reduce_scatter_sum(const TensorView& send, const TensorView& recv,
                                  std::span<const int64_t> counts) = 0;
  // recv = the ranks' send buffers concatenated in rank order.
  //   send: [counts[rank()]], recv: [sum(counts)]
  virtual void all_gather(const TensorView& send, const TensorView& recv,
                          std::span<const int64_t> counts) = 0;
  // Personalized exchange. send holds one block per destination p (send_counts[p] elements),
  // contiguous in rank order; recv receives one block per source p (recv_counts[p] elements) in
  // rank order. recv_counts[p] must equal rank p's send_counts[rank()] (exchange the counts
  // first: all_to_all_counts below).
  virtual void all_to_allv(const TensorView& send, std::span<const int64_t> send_counts,
                           const TensorView& recv, std::span<const int64_t> recv_counts) = 0;
  // x = root's x on every rank.
  virtual void broadcast(const TensorView& x, int root) = 0;
  // Returns when every rank has called it (and, for CUDA, the stream's work before it is done).
  virtual void barrier() = 0;
};

// ---- helpers over any communicator --------------------------------------------------------------

// Sums host doubles over the ranks (through a small buffer on comm.device()); every rank gets the
// same sums. Synchronizes.
void all_reduce_sum_host(Communicator& comm, std::span<double> values);
// The counts every peer will send to this rank: recv[p] = rank p's send_counts[rank()].
// send_counts: one per rank. Synchronizes.
std::vector<int64_t> all_to_all_counts(Communicator& comm, std::span<const int64_t> send_counts);

// Checks shared by the implementations: a contiguous buffer of an allowed dtype on `device`,
// with `numel` elements; `what` names the collective and the argument in the message.
void check_buffer(const TensorView& x, Device device, bool reduction, int64_t numel,
                  const char* what);
// Validates per-rank counts (one per rank, each >= 0) and returns their sum.
int64_t check_counts(std::span<const int64_t> counts, int size, const char* what);

}  // namespace fourbit::dist
