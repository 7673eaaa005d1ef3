// core fill (gpu): device_fill_async against the byte pattern it must leave, at sizes that take
// the kernel (4 B to 16 KB, 4-byte aligned) and the cudaMemsetAsync fallback (unaligned, odd or
// larger), with guard bytes on both sides that must stay untouched, on a non-default stream.
#include "core/device.h"
#include "core/fill.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace fourbit {
namespace {

TEST(CoreFillCuda, LeavesTheBytesOfCudaMemset) {
  ASSERT_GT(cuda_device_count(), 0) << "the gpu tests need a CUDA GPU";
  constexpr int64_t kGuard = 64, kMax = 40000;
  uint8_t* buf = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&buf), kMax + 2 * kGuard + 8), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  struct Case { int64_t offset, bytes; uint8_t byte; };
  const Case cases[] = {{0, 4, 0x00},    {0, 8, 0xFF},     {4, 4096, 0x5A}, {0, 16384, 0x01},
                        {0, 16388, 0x02}, {1, 4, 0x03},    {0, 6, 0x04},    {2, 1001, 0x80},
                        {0, kMax, 0x7F},  {0, 0, 0x11}};
  std::vector<uint8_t> host(kMax + 2 * kGuard + 8);
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "offset " << c.offset << ", " << c.bytes << " bytes of " << (int)c.byte);
    ASSERT_EQ(cudaMemset(buf, 0xC3, host.size()), cudaSuccess);
    device_fill_async(buf + kGuard + c.offset, c.byte, c.bytes, stream);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(host.data(), buf, host.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    int64_t wrong = 0;
    for (int64_t i = 0; i < (int64_t)host.size(); ++i) {
      const bool inside = i >= kGuard + c.offset && i < kGuard + c.offset + c.bytes;
      wrong += host[(size_t)i] != (inside ? c.byte : 0xC3);
    }
    EXPECT_EQ(wrong, 0);
  }
  cudaStreamDestroy(stream);
  cudaFree(buf);
}

}  // namespace
}  // namespace fourbit
