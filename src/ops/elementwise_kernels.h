// Launch interface of the elementwise kernels (elementwise_kernels.cu), used by elementwise.cpp.
// Plain arguments only; validation and messages live on the host side.
#pragma once

#include "ops/kernel_types.h"
#include "ops/output_amax.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fourbit::ops::kernels {

// a += b on bf16 [n_rows, cols], n_rows % 16 == 0, cols even, 4-byte aligned, also
// accumulating the result's amaxes (ops::OutputAmaxes).
void launch_add_inplace_amax(void* a, const void* b, int64_t n_rows, int64_t cols,
                             const OutputAmaxes& amaxes, cudaStream_t stream);

// out[i] = a[i] + b[i], i < n. out may equal a (the in-place add).
void launch_add(void* out, FloatType out_type, const void* a, FloatType a_type, const void* b,
                FloatType b_type, int64_t n, cudaStream_t stream);

// out[i] = x[i] converted (f32 <-> bf16).
void launch_cast(void* out, FloatType out_type, const void* x, FloatType x_type, int64_t n,
                 cudaStream_t stream);

// Device result of a non-finite count; first_index is ~0 when none was found.
struct NonFiniteCounts {
  unsigned long long nan_count;
  unsigned long long inf_count;
  unsigned long long first_index;
};
// ORs kErrNonFinite into *flag (if flag) and accumulates into *counts (if counts; initialize it
// to {0, 0, ~0} first) when x holds NaN or Inf.
void launch_nonfinite(const void* x, FloatType x_type, int64_t n, int* flag,
                      NonFiniteCounts* counts, cudaStream_t stream);

}  // namespace fourbit::ops::kernels
