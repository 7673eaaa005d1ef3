// SwiGLU, the activation of the Llama MLP: out = silu(gate) * up, silu(g) = g * sigmoid(g).
//
// Layout: the gate and up projections come out of one fused GEMM side by side,
//   gate_up[n, 0:F]  = gate[n, :]   (the FIRST F columns)
//   gate_up[n, F:2F] = up[n, :]     (the LAST F columns)
// N = tokens (B*T), F = MLP hidden size.
//
// Dtypes. CPU reference: all f32 or all f64. CUDA: all bf16 or all f32 (one dtype per call); FP32
// math (sigmoid through expf). Tensors are contiguous. CUDA kernels: elementwise, 8 columns per
// thread and step, 16-byte accesses when the rows are aligned. Deterministic.
#pragma once

#include "core/tensor.h"
#include "ops/output_amax.h"

namespace fourbit::ops {

// out[n, j] = silu(gate_up[n, j]) * gate_up[n, F + j]
// out:     [N, F]   overwritten
// gate_up: [N, 2F]
// With `amaxes`, also the global amaxes of out (output_amax.h) for the NVFP4 quantizer of the
// next GEMM's input; CUDA needs bf16 tensors and output_amaxes_supported(N, F).
void swiglu_forward(const TensorView& out, const TensorView& gate_up, void* stream = nullptr,
                    const OutputAmaxes* amaxes = nullptr);

// With g = gate, u = up, s = sigmoid(g):
//   d_gate_up[n, j]     = dout[n, j] * u * s * (1 + g * (1 - s))   (d gate)
//   d_gate_up[n, F + j] = dout[n, j] * g * s                       (d up)
// d_gate_up: [N, 2F]  OVERWRITTEN (an activation gradient)
// dout:      [N, F]
// gate_up:   [N, 2F]  the forward's input
// d_gate_up must not alias gate_up or dout (see swiglu_backward_inplace).
void swiglu_backward(const TensorView& d_gate_up, const TensorView& dout,
                     const TensorView& gate_up, void* stream = nullptr);

// The same, writing d_gate_up over gate_up (which the backward no longer needs afterwards): saves
// the [N, 2F] buffer.
// gate_up_to_d_gate_up: [N, 2F]  in: the forward's input; out: d_gate_up
// dout:                 [N, F]
// With `amaxes`, also the global amaxes of d_gate_up (output_amax.h), the dY of the gate/up
// projection's Dgrad and Wgrad; CUDA needs bf16 tensors and output_amaxes_supported(N, F).
void swiglu_backward_inplace(const TensorView& gate_up_to_d_gate_up, const TensorView& dout,
                             void* stream = nullptr, const OutputAmaxes* amaxes = nullptr);

}  // namespace fourbit::ops
