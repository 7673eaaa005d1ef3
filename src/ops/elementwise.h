// Elementwise helpers of the transformer: residual add, f32 <-> bf16 casts, and the NaN/Inf
// detector that lets the trainer report a non-finite value with the tensor's name.
//
// All tensors are contiguous, of any shape (treated as flat arrays of numel elements); outputs
// are overwritten. CPU: the reference loops; CUDA: 16-byte vectorized kernels (8 elements per
// thread and step; scalar accesses on a misaligned pointer or the ragged end), FP32 math, one
// rounding to the output dtype. Deterministic. `stream` is a cudaStream_t, ignored on the CPU.
#pragma once

#include "core/tensor.h"
#include "ops/output_amax.h"

#include <cstdint>
#include <string_view>

namespace fourbit::ops {

// out = a + b.
//   out, a, b: [*] same shape. CPU: all f32 or all f64. CUDA: each bf16 or f32 independently
//   (e.g. an f32 residual stream plus a bf16 branch output).
// out must not alias a or b (use add_inplace).
void add(const TensorView& out, const TensorView& a, const TensorView& b, void* stream = nullptr);

// a += b (the residual connection in place).
//   a, b: [*] same shape; dtypes as for add.
// amaxes (optional): also accumulate the global amaxes of the result (output_amax.h) for the
// NVFP4 quantizer of the next GEMM's input (the residual gradient, dY of attn_out and mlp_down);
// then a, b: [N, C], one dtype; CUDA: bf16, contiguous, output_amaxes_supported(N, C), 4-byte
// aligned.
void add_inplace(const TensorView& a, const TensorView& b, void* stream = nullptr,
                 const OutputAmaxes* amaxes = nullptr);

// out = x in another dtype: f32 -> bf16 (round to nearest even; NaN stays NaN, canonical 0x7FFF;
// overflow rounds to Inf) or bf16 -> f32 (exact). Same bits on the CPU and CUDA.
//   out, x: [*] same shape, one f32 and the other bf16.
void cast(const TensorView& out, const TensorView& x, void* stream = nullptr);

// --- non-finite values --------------------------------------------------------------------------

struct NonFiniteSummary {
  int64_t nan_count = 0;
  int64_t inf_count = 0;
  int64_t first_index = -1;  // flat index of the first NaN or Inf, -1 if none
  bool any() const { return nan_count + inf_count > 0; }
};

// ORs kErrNonFinite (ops/error_flags.h) into *flag when x holds a NaN or an Inf; leaves it alone
// otherwise. CPU: `flag` is a host int. CUDA: a device int, asynchronous (no synchronization), so
// that a step can flag many tensors and read the flag once (read_and_clear_error_flag).
//   x: [*] f32 or bf16 (f64 too on the CPU).
void flag_nonfinite(const TensorView& x, int* flag, void* stream = nullptr);

// Counts the NaNs and Infs of x and finds the first. Synchronous on CUDA (waits for `stream`);
// uses a process-wide device scratch, so host threads must not call it concurrently.
//   x: [*] f32 or bf16 (f64 too on the CPU).
NonFiniteSummary count_nonfinite(const TensorView& x, void* stream = nullptr);

// Throws fourbit::Error naming `name`, the tensor, the counts and the first position (as a
// multi-index) when x holds a NaN or Inf; returns otherwise. Synchronous on CUDA.
void check_finite(const TensorView& x, std::string_view name, void* stream = nullptr);

// Reads a device error flag (waits for `stream`), resets it to 0 on `stream` and returns the bits
// (kErr* of ops/error_flags.h). CUDA builds only.
int read_and_clear_error_flag(int* device_flag, void* stream = nullptr);

}  // namespace fourbit::ops
