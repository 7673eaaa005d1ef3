// RMSNorm over the last dimension, as in Llama:
//   rstd[n]  = 1 / sqrt(mean_c(x[n, c]^2) + eps)
//   y[n, c]  = x[n, c] * rstd[n] * weight[c]
// N = tokens (B*T), C = d_model. The forward saves rstd for the backward.
//
// Dtypes. CPU reference: every floating tensor f32, or every one f64 (rstd included). CUDA: x, y,
// dy, dx bf16 or f32 (one dtype for the activations of a call); weight bf16 or f32; rstd f32;
// dweight f32. All CUDA math is FP32. Tensors are contiguous; C <= 16384 on CUDA.
//
// CUDA kernels: one CTA per row (up to 1024 threads, 8 columns per thread and step, 16-byte
// accesses when the rows are 16-byte aligned). The backward's dweight is reduced over rows in a
// fixed order (per-chunk partial sums in the workspace, then a second pass), so it is
// deterministic: the same inputs give the same bits.
#pragma once

#include "core/tensor.h"
#include "ops/output_amax.h"

#include <cstdint>

namespace fourbit::ops {

// y:      [N, C]  overwritten
// rstd:   [N]     overwritten (saved statistic)
// x:      [N, C]
// weight: [C]
// y must not alias x.
void rmsnorm_forward(const TensorView& y, const TensorView& rstd, const TensorView& x,
                     const TensorView& weight, float eps, void* stream = nullptr);

// Bytes of CUDA workspace rmsnorm_backward needs for N rows of C columns (the CPU needs none).
int64_t rmsnorm_backward_workspace_bytes(int64_t n_rows, int64_t C);

// With xhat = x * rstd and g = dy * weight:
//   dx[n, c]    = rstd[n] * (g[n, c] - xhat[n, c] * mean_c'(g[n, c'] * xhat[n, c']))  OVERWRITTEN
//   dweight[c] += sum_n dy[n, c] * xhat[n, c]                                          ACCUMULATED
// dx:        [N, C]  overwritten
// dweight:   [C]     accumulated (f32 on CUDA)
// dy:        [N, C]
// x:         [N, C]  the forward's input
// weight:    [C]
// rstd:      [N]     the forward's saved statistic
// workspace: CUDA: any dtype, contiguous, at least rmsnorm_backward_workspace_bytes(N, C) bytes;
//            CPU: ignored (pass TensorView{}).
// dx must not alias dy or x.
void rmsnorm_backward(const TensorView& dx, const TensorView& dweight, const TensorView& dy,
                      const TensorView& x, const TensorView& weight, const TensorView& rstd,
                      const TensorView& workspace, void* stream = nullptr);

// rmsnorm_backward adding dx to a gradient instead of overwriting it (a residual stream's
// gradient, which receives the norm's input gradient):
//   dx_accum[n, c] = dx_accum[n, c] + round(dx[n, c])                                  ACCUMULATED
// where round() rounds to dx_accum's dtype and the sum is rounded to it again: the bits equal
// rmsnorm_backward into a temporary followed by add_inplace(dx_accum, temporary), without the
// temporary's write and read. dweight, shapes and aliasing rules as rmsnorm_backward.
// amaxes (optional): also accumulate the global amaxes of the new dx_accum (output_amax.h), the
// bits add_inplace(dx_accum, temporary, stream, amaxes) gives; CUDA: bf16, contiguous,
// rmsnorm_backward_accumulate_amaxes_supported(N, C).
void rmsnorm_backward_accumulate(const TensorView& dx_accum, const TensorView& dweight,
                                 const TensorView& dy, const TensorView& x, const TensorView& weight,
                                 const TensorView& rstd, const TensorView& workspace,
                                 void* stream = nullptr, const OutputAmaxes* amaxes = nullptr);

// Whether rmsnorm_backward_accumulate computes OutputAmaxes for [N, C] on CUDA: N % 16 == 0,
// C <= 2048 (its 16-row segment slots in shared memory) and row chunks of whole 16-row segments
// (at least 1024 of them: N >= 16384 for C <= 2048). The CPU takes N % 16 == 0.
bool rmsnorm_backward_accumulate_amaxes_supported(int64_t n_rows, int64_t C);

}  // namespace fourbit::ops
