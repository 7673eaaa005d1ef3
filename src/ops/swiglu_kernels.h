// Launch interface of the SwiGLU kernels (swiglu_kernels.cu), used by swiglu.cpp. Plain arguments
// only; validation and messages live on the host side.
#pragma once

#include "ops/kernel_types.h"
#include "ops/output_amax.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fourbit::ops::kernels {

// out: [N, F]; gate_up: [N, 2F]; all of `type`.
void launch_swiglu_forward(void* out, const void* gate_up, FloatType type, int64_t n_rows,
                           int64_t hidden, cudaStream_t stream);

// d_gate_up: [N, 2F] (may equal gate_up: in place); dout: [N, F]; gate_up: [N, 2F].
void launch_swiglu_backward(void* d_gate_up, const void* dout, const void* gate_up,
                            FloatType type, int64_t n_rows, int64_t hidden, cudaStream_t stream);

// The same two ops on bf16 tensors, also accumulating the output's amaxes; n_rows % 16 == 0,
// hidden even, 4-byte aligned (output_amaxes_supported).
void launch_swiglu_forward_amax(void* out, const void* gate_up, int64_t n_rows, int64_t hidden,
                                const OutputAmaxes& amaxes, cudaStream_t stream);
void launch_swiglu_backward_amax(void* d_gate_up, const void* dout, const void* gate_up,
                                 int64_t n_rows, int64_t hidden, const OutputAmaxes& amaxes,
                                 cudaStream_t stream);

}  // namespace fourbit::ops::kernels
