// Implementation of device.h; the CUDA runtime is used only when FOURBIT_WITH_CUDA is defined.
#include "core/device.h"

#include "core/check.h"

#if defined(FOURBIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace fourbit {

#if defined(FOURBIT_WITH_CUDA)

bool built_with_cuda() { return true; }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

DeviceProperties current_device_properties() {
  int dev = 0;
  FOURBIT_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp p{};
  FOURBIT_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  DeviceProperties d;
  d.name = p.name;
  d.sm_major = p.major;
  d.sm_minor = p.minor;
  d.multiprocessors = p.multiProcessorCount;
  d.global_memory_bytes = (int64_t)p.totalGlobalMem;
  d.l2_bytes = p.l2CacheSize;
  d.shared_memory_per_block_optin = (int64_t)p.sharedMemPerBlockOptin;
  return d;
}

void* device_malloc(int64_t bytes) {
  void* p = nullptr;
  FOURBIT_CUDA_CHECK(cudaMalloc(&p, (size_t)bytes));
  return p;
}

void device_free(void* p) { cudaFree(p); }

void device_memcpy(void* dst, Device dst_device, const void* src, Device src_device,
                   int64_t bytes) {
  cudaMemcpyKind kind = cudaMemcpyDefault;
  (void)dst_device;
  (void)src_device;
  FOURBIT_CUDA_CHECK(cudaMemcpy(dst, src, (size_t)bytes, kind));
}

void device_memset(void* dst, uint8_t byte, int64_t bytes) {
  FOURBIT_CUDA_CHECK(cudaMemset(dst, byte, (size_t)bytes));
}

void device_synchronize() { FOURBIT_CUDA_CHECK(cudaDeviceSynchronize()); }

#else

namespace {
[[noreturn]] void no_cuda(const char* what) {
  throw Error(fmt::format(
      "{}: this fourbit binary was built without CUDA; rebuild on a machine with nvcc "
      "(cmake -DFOURBIT_CUDA=ON) or use --device cpu",
      what));
}
}  // namespace

bool built_with_cuda() { return false; }
int cuda_device_count() { return 0; }
DeviceProperties current_device_properties() { no_cuda("device properties"); }
void* device_malloc(int64_t) { no_cuda("device allocation"); }
void device_free(void*) {}
void device_memcpy(void*, Device, const void*, Device, int64_t) { no_cuda("device copy"); }
void device_memset(void*, uint8_t, int64_t) { no_cuda("device memset"); }
void device_synchronize() {}

#endif

}  // namespace fourbit
