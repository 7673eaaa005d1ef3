// NcclCommunicator (nccl_communicator.h).
#include "dist/nccl_communicator.h"

#include "core/check.h"
#include "core/log.h"
#include "dist/launcher.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#define FOURBIT_NCCL_CHECK(comm, call)                                                         \
  do {                                                                                         \
    const ncclResult_t fourbit_nccl_ = (call);                                                 \
    if (fourbit_nccl_ != ncclSuccess) {                                                        \
      FOURBIT_CHECK(false, "{} failed: {} ({})", #call, ncclGetErrorString(fourbit_nccl_),     \
                    (comm) != nullptr ? ncclGetLastError(comm) : "");                          \
    }                                                                                          \
  } while (0)

namespace fourbit::dist {

namespace {

ncclDataType_t nccl_dtype(DType t) {
  switch (t) {
    case DType::kF64: return ncclFloat64;
    case DType::kF32: return ncclFloat32;
    case DType::kBF16: return ncclBfloat16;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
    default: FOURBIT_CHECK(false, "NCCL: dtype {} is not supported", dtype_name(t));
  }
  return ncclFloat32;
}

char* at(const TensorView& x, int64_t elements) {
  return static_cast<char*>(x.data) + dtype_bytes(x.dtype, elements);
}

bool all_equal(std::span<const int64_t> counts) {
  for (int64_t c : counts)
    if (c != counts[0]) return false;
  return true;
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(int rank, int world, int local_rank, const std::string& id_file, void* stream)
      : rank_(rank), world_(world), stream_(static_cast<cudaStream_t>(stream)) {
    int devices = 0;
    FOURBIT_CUDA_CHECK(cudaGetDeviceCount(&devices));
    FOURBIT_CHECK(local_rank < devices,
                  "rank {}: LOCAL_RANK {} but this host shows {} GPU(s): launch at most {} "
                  "processes per host (CUDA_VISIBLE_DEVICES limits what is visible)",
                  rank, local_rank, devices, devices);
    FOURBIT_CUDA_CHECK(cudaSetDevice(local_rank));
    const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
    if (nvls != nullptr && std::strcmp(nvls, "0") != 0)
      log_warn("NCCL_NVLS_ENABLE={} overridden to 0 (NVLink multicast stays off)", nvls);
    ::setenv("NCCL_NVLS_ENABLE", "0", 1);
    ncclUniqueId id;
    if (rank == 0) {
      FOURBIT_NCCL_CHECK(nullptr, ncclGetUniqueId(&id));
      publish_file(id_file, std::string(id.internal, sizeof(id.internal)));
    } else {
      const std::string s = wait_for_file(id_file, sizeof(id.internal), 300.0);
      std::memcpy(id.internal, s.data(), sizeof(id.internal));
    }
    FOURBIT_NCCL_CHECK(nullptr, ncclCommInitRank(&comm_, world, id, rank));
    FOURBIT_CUDA_CHECK(cudaMalloc(&barrier_buf_, sizeof(float)));
  }

  ~NcclCommunicator() override {
    if (barrier_buf_ != nullptr) cudaFree(barrier_buf_);
    if (comm_ != nullptr) ncclCommDestroy(comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return world_; }
  Device device() const override { return Device::kCuda; }

  void all_reduce_sum(const TensorView& x) override {
    check_buffer(x, Device::kCuda, true, x.numel(), "all_reduce_sum");
    if (x.numel() == 0) return;
    FOURBIT_NCCL_CHECK(comm_, ncclAllReduce(x.data, x.data, (size_t)x.numel(), nccl_dtype(x.dtype),
                                            ncclSum, comm_, stream_));
  }

  void reduce_scatter_sum(const TensorView& send, const TensorView& recv,
                          std::span<const int64_t> counts) override {
    const int64_t total = check_counts(counts, world_, "reduce_scatter_sum");
    check_buffer(send, Device::kCuda, true, total, "reduce_scatter_sum (send)");
    check_buffer(recv, Device::kCuda, true, counts[(size_t)rank_], "reduce_scatter_sum (recv)");
    FOURBIT_CHECK(send.dtype == recv.dtype, "reduce_scatter_sum: send is {} but recv is {}",
                  dtype_name(send.dtype), dtype_name(recv.dtype));
    const ncclDataType_t dt = nccl_dtype(send.dtype);
    if (all_equal(counts)) {
      if (counts[0] == 0) return;
      FOURBIT_NCCL_CHECK(comm_, ncclReduceScatter(send.data, recv.data, (size_t)counts[0], dt,
                                                  ncclSum, comm_, stream_));
      return;
    }
    FOURBIT_NCCL_CHECK(comm_, ncclGroupStart());
    int64_t off = 0;
    for (int p = 0; p < world_; ++p) {
      const int64_t n = counts[(size_t)p];
      if (n > 0) {
        void* dst = p == rank_ ? recv.data : at(send, off);  // ignored on non-roots
        FOURBIT_NCCL_CHECK(comm_, ncclReduce(at(send, off), dst, (size_t)n, dt, ncclSum, p, comm_,
                                             stream_));
      }
      off += n;
    }
    FOURBIT_NCCL_CHECK(comm_, ncclGroupEnd());
  }

  void all_gather(const TensorView& send, const TensorView& recv,
                  std::span<const int64_t> counts) override {
    const int64_t total = check_counts(counts, world_, "all_gather");
    check_buffer(send, Device::kCuda, false, counts[(size_t)rank_], "all_gather (send)");
    check_buffer(recv, Device::kCuda, false, total, "all_gather (recv)");
    FOURBIT_CHECK(send.dtype == recv.dtype, "all_gather: send is {} but recv is {}",
                  dtype_name(send.dtype), dtype_name(recv.dtype));
    const ncclDataType_t dt = nccl_dtype(send.dtype);
    if (all_equal(counts)) {
      if (counts[0] == 0) return;
      FOURBIT_NCCL_CHECK(comm_, ncclAllGather(send.data, recv.data, (size_t)counts[0], dt, comm_,
                                              stream_));
      return;
    }
    FOURBIT_NCCL_CHECK(comm_, ncclGroupStart());
    int64_t off = 0;
    for (int p = 0; p < world_; ++p) {
      const int64_t n = counts[(size_t)p];
      if (n > 0) {
        const void* src = p == rank_ ? send.data : at(recv, off);
        FOURBIT_NCCL_CHECK(comm_, ncclBroadcast(src, at(recv, off), (size_t)n, dt, p, comm_,
                                                stream_));
      }
      off += n;
    }
    FOURBIT_NCCL_CHECK(comm_, ncclGroupEnd());
  }

  void all_to_allv(const TensorView& send, std::span<const int64_t> send_counts,
                   const TensorView& recv, std::span<const int64_t> recv_counts) override {
    const int64_t st = check_counts(send_counts, world_, "all_to_allv (send counts)");
    const int64_t rt = check_counts(recv_counts, world_, "all_to_allv (recv counts)");
    check_buffer(send, Device::kCuda, false, st, "all_to_allv (send)");
    check_buffer(recv, Device::kCuda, false, rt, "all_to_allv (recv)");
    FOURBIT_CHECK(send.dtype == recv.dtype, "all_to_allv: send is {} but recv is {}",
                  dtype_name(send.dtype), dtype_name(recv.dtype));
    const ncclDataType_t dt = nccl_dtype(send.dtype);
    FOURBIT_NCCL_CHECK(comm_, ncclGroupStart());
    int64_t soff = 0, roff = 0;
    for (int p = 0; p < world_; ++p) {
      if (send_counts[(size_t)p] > 0)
        FOURBIT_NCCL_CHECK(comm_, ncclSend(at(send, soff), (size_t)send_counts[(size_t)p], dt, p,
                                           comm_, stream_));
      if (recv_counts[(size_t)p] > 0)
        FOURBIT_NCCL_CHECK(comm_, ncclRecv(at(recv, roff), (size_t)recv_counts[(size_t)p], dt, p,
                                           comm_, stream_));
      soff += send_counts[(size_t)p];
      roff += recv_counts[(size_t)p];
    }
    FOURBIT_NCCL_CHECK(comm_, ncclGroupEnd());
  }

  void broadcast(const TensorView& x, int root) override {
    FOURBIT_CHECK(root >= 0 && root < world_, "broadcast: root {} outside [0, {})", root, world_);
    check_buffer(x, Device::kCuda, false, x.numel(), "broadcast");
    if (x.numel() == 0) return;
    FOURBIT_NCCL_CHECK(comm_, ncclBroadcast(x.data, x.data, (size_t)x.numel(), nccl_dtype(x.dtype),
                                            root, comm_, stream_));
  }

  void barrier() override {
    FOURBIT_NCCL_CHECK(comm_, ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclFloat32, ncclSum,
                                            comm_, stream_));
    FOURBIT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

 private:
  int rank_, world_;
  cudaStream_t stream_;
  ncclComm_t comm_ = nullptr;
  void* barrier_buf_ = nullptr;  // f32 [1]
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(int rank, int world_size, int local_rank,
                                                     const std::string& id_file, void* stream) {
  FOURBIT_CHECK(world_size >= 1 && rank >= 0 && rank < world_size && local_rank >= 0,
                "make_nccl_communicator: rank {} of {} (local rank {}) is not valid", rank,
                world_size, local_rank);
  return std::make_unique<NcclCommunicator>(rank, world_size, local_rank, id_file, stream);
}

}  // namespace fourbit::dist
