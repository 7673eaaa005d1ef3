// The CUDA device seen from host code, in a form that also compiles in a CPU-only build: there,
// cuda_device_count() is 0 and every device-memory function throws a clear error.
#pragma once

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

void* device_malloc(int64_t bytes);
void device_free(void* p);
void device_memcpy(void* dst, Device dst_device, const void* src, Device src_device, int64_t bytes);
void device_memset(void* dst, uint8_t byte, int64_t bytes);
void device_synchronize();

}  // namespace fourbit
