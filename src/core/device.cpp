// Implementation of device.h; the CUDA runtime is used only when FOURBIT_WITH_CUDA is defined.
#include "core/device.h"

#include "core/check.h"
#include "core/fill.h"

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

int current_device_sm_count() {
  int dev = 0;
  FOURBIT_CUDA_CHECK(cudaGetDevice(&dev));
  static thread_local int cached_device = -1, cached_count = 0;
  if (dev != cached_device) {
    FOURBIT_CUDA_CHECK(cudaDeviceGetAttribute(&cached_count, cudaDevAttrMultiProcessorCount, dev));
    cached_device = dev;
  }
  return cached_count;
}

namespace {
// The current device's default memory pool, set (once per device) to keep every freed byte for
// reuse instead of returning it to the driver at each synchronization.
cudaMemPool_t default_pool() {
  int dev = 0;
  FOURBIT_CUDA_CHECK(cudaGetDevice(&dev));
  static bool configured[64] = {};
  cudaMemPool_t pool = nullptr;
  FOURBIT_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
  if (dev >= 0 && dev < 64 && !configured[dev]) {
    uint64_t keep = ~uint64_t{0};
    FOURBIT_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    configured[dev] = true;
  }
  return pool;
}
}  // namespace

void* device_malloc(int64_t bytes) {
  void* p = nullptr;
  default_pool();
  const cudaError_t e = cudaMallocAsync(&p, (size_t)bytes, cudaStreamLegacy);
  if (e != cudaSuccess) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    throw Error(fmt::format("device allocation of {} bytes failed: {} ({} of {} MiB free on the "
                            "device); use a smaller batch or model, or free other processes' memory",
                            bytes, cudaGetErrorString(e), free_b >> 20, total_b >> 20));
  }
  FOURBIT_CHECK(reinterpret_cast<uintptr_t>(p) % 256 == 0,
                "device allocation of {} bytes: the pool returned {} (not 256-byte aligned), which "
                "the kernels' vector loads assume", bytes, p);
  return p;
}

void device_free(void* p) {
  if (p) cudaFreeAsync(p, cudaStreamLegacy);
}

DeviceMemoryStats device_memory_stats() {
  cudaMemPool_t pool = default_pool();
  DeviceMemoryStats s;
  uint64_t v = 0;
  FOURBIT_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &v));
  s.used = (int64_t)v;
  FOURBIT_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &v));
  s.used_peak = (int64_t)v;
  FOURBIT_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &v));
  s.reserved = (int64_t)v;
  FOURBIT_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &v));
  s.reserved_peak = (int64_t)v;
  return s;
}

void reset_device_memory_peak() {
  cudaMemPool_t pool = default_pool();
  uint64_t zero = 0;
  FOURBIT_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero));
  FOURBIT_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero));
}

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
int current_device_sm_count() { no_cuda("device properties"); }
void* device_malloc(int64_t) { no_cuda("device allocation"); }
void device_free(void*) {}
DeviceMemoryStats device_memory_stats() { return {}; }
void reset_device_memory_peak() {}
void device_memcpy(void*, Device, const void*, Device, int64_t) { no_cuda("device copy"); }
void device_memset(void*, uint8_t, int64_t) { no_cuda("device memset"); }
void device_fill_async(void*, uint8_t, int64_t, void*) { no_cuda("device fill"); }
void device_synchronize() {}

#endif

}  // namespace fourbit
