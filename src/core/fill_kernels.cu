// device_fill_async (core/fill.h): a stream-ordered byte fill. Fills of up to 16 KB (4-byte
// aligned, whole words) are one small kernel; larger or unaligned ones are cudaMemsetAsync.
// Why: the many tiny resets of a training step (an error flag, an amax slot, a loss accumulator:
// 4-8 bytes) cost about 3 us each through cudaMemsetAsync plus a gap before the next kernel, and
// under 1 us as a kernel (Transformer Engine measured the same and added nvte_memset); ktrace
// showed the GPU idle before memsets for 0.7 ms of a 58 ms gpt2-124m step (session 27).
// Invariant: the same bytes land as with cudaMemsetAsync, in stream order.
#include "core/fill.h"
#include "core/error.h"

#include <cuda_runtime.h>

#include <cstdint>

namespace fourbit {
namespace {

constexpr int64_t kKernelFillMaxBytes = 16 * 1024;
constexpr int kFillThreads = 256;

__global__ void __launch_bounds__(kFillThreads) fill_words_kernel(uint32_t* dst, uint32_t word, int64_t words) {
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) dst[i] = word;
}

}  // namespace

void device_fill_async(void* dst, uint8_t byte, int64_t bytes, void* stream) {
  if (bytes <= 0) return;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (bytes <= kKernelFillMaxBytes && bytes % 4 == 0 && reinterpret_cast<uintptr_t>(dst) % 4 == 0) {
    fill_words_kernel<<<1, kFillThreads, 0, s>>>(static_cast<uint32_t*>(dst), 0x01010101u * byte, bytes / 4);
    FOURBIT_CUDA_CHECK_LAUNCH();
    return;
  }
  FOURBIT_CUDA_CHECK(cudaMemsetAsync(dst, byte, (size_t)bytes, s));
}

}  // namespace fourbit
