// device_fill_async: a stream-ordered byte fill of device memory, small fills as one kernel
// (core/fill_kernels.cu). A header without fmt, so that nvcc-compiled files (.cu) can include it.
#pragma once

#include <cstdint>

namespace fourbit {

// Every byte of dst[0, bytes) (device memory) set to `byte`, in order on `stream` (a
// cudaStream_t; null: the default stream). A CPU-only build throws.
void device_fill_async(void* dst, uint8_t byte, int64_t bytes, void* stream);

}  // namespace fourbit
