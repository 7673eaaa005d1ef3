// The CUDA device seen from host code, in a form that also compiles in a CPU-only build: there,
// cuda_device_count() is 0 and every device-memory function throws a clear error.
#pragma once

#include "core/sm_count.h"
#include "core/tensor.h"

#include <cstdint>
#include <string>

namespace fourbit {

// True when this binary was built with CUDA kernels.
bool built_with_cuda();
// Number of usable CUDA devices (0 in a CPU-only build or when no GPU/driver is present).
int cuda_device_count();

struct DeviceProperties {
  std::string name;
  int sm_major = 0, sm_minor = 0;
  int multiprocessors = 0;
  int64_t global_memory_bytes = 0;
  int64_t l2_bytes = 0;
  int64_t shared_memory_per_block_optin = 0;
};
DeviceProperties current_device_properties();
// current_device_sm_count(): core/sm_count.h.

// Device memory comes from the CUDA stream-ordered allocator (cudaMallocAsync / cudaFreeAsync on
// the legacy default stream, with the device's default pool keeping freed memory for reuse). Why:
// every quantized GEMM operand is a short-lived buffer, and cudaMalloc/cudaFree per buffer cost
// tens of microseconds each and cudaFree synchronizes the whole device, which serialized the
// training step (measured: quantized gpt2-124m steps were 2-3x slower than their kernels).
// Ordering: the legacy default stream orders against every blocking stream (fourbit creates no
// non-blocking streams), so memory freed here is reused only after the work queued before the free.
void* device_malloc(int64_t bytes);
void device_free(void* p);

// Bytes of device memory held by fourbit tensors now and at most since the last reset (the pool's
// "used" counters), and reserved by the pool (what the process holds from the driver).
struct DeviceMemoryStats {
  int64_t used = 0;
  int64_t used_peak = 0;
  int64_t reserved = 0;
  int64_t reserved_peak = 0;
};
DeviceMemoryStats device_memory_stats();
void reset_device_memory_peak();  // the peaks restart from the current values
void device_memcpy(void* dst, Device dst_device, const void* src, Device src_device, int64_t bytes);
void device_memset(void* dst, uint8_t byte, int64_t bytes);
void device_synchronize();

}  // namespace fourbit
