// The NCCL communicator: one process per GPU (built only when CMake found NCCL: FOURBIT_WITH_NCCL).
//
// Setup: the process selects GPU local_rank (cudaSetDevice; every later allocation lands there),
// rank 0 creates the ncclUniqueId and publishes it in id_file (launcher.h: publish_file), the
// others wait for that file (wait_for_file, 300 s), then ncclCommInitRank. NCCL_NVLS_ENABLE is set
// to 0 before the communicator is created (NVLink multicast off, issue #8).
// Collectives (communicator.h) are enqueued on `stream` (default: the legacy default stream, which
// the model and cudaMemcpy use, so results are ordered before any later work and host copies).
// Uneven counts: reduce_scatter_sum is one ncclReduce per rank and all_gather one ncclBroadcast
// per rank inside an NCCL group (NCCL's own ReduceScatter / AllGather when the counts are equal);
// all_to_allv is a group of ncclSend / ncclRecv. Sums follow NCCL's (fixed) algorithm order.
// Every NCCL and CUDA call is checked; errors name the call and NCCL's message.
#pragma once

#include "dist/communicator.h"

#include <memory>
#include <string>

namespace fourbit::dist {

std::unique_ptr<Communicator> make_nccl_communicator(int rank, int world_size, int local_rank,
                                                     const std::string& id_file,
                                                     void* stream = nullptr);

}  // namespace fourbit::dist
