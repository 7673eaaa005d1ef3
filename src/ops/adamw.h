// The optimizer: AdamW on FP32 master weights, the global gradient norm for clipping, and the
// BF16 copy of the updated weights that the next forward consumes.
//
// AdamW (torch.optim.AdamW semantics, decoupled weight decay), per element:
//   g     = grad * grad_scale                       (grad_scale: clipping, see clip_grad_scale)
//   m     = beta1 m + (1 - beta1) g
//   v     = beta2 v + (1 - beta2) g^2
//   m_hat = m / (1 - beta1^step),  v_hat = v / (1 - beta2^step)
//   p     = p - lr (m_hat / (sqrt(v_hat) + eps) + weight_decay p)
// The bias corrections are computed on the host in double and rounded to f32 (CPU f32 and CUDA
// use the same values). Weight decay applies to whatever tensor is passed: call the update
// per parameter group (e.g. no decay for norms and embeddings) with its own AdamWParams.
//
// Dtypes. CUDA: params, grads, m, v f32; params_bf16 bf16; FP32 math. CPU reference: params,
// grads, m, v all f32 or all f64; params_bf16 (f32 params only) bf16. Tensors are contiguous, any
// shape, equal numel. CUDA kernels: elementwise, 8 elements per thread and step (16-byte accesses
// when every pointer is aligned); the norm is a fixed-order two-stage reduction. Deterministic.
#pragma once

#include "core/tensor.h"

#include <cstdint>
#include <span>

namespace fourbit::ops {

struct AdamWParams {
  float lr = 3e-4f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // decoupled (multiplies lr * p), not L2 added to the gradient
  int64_t step = 1;           // 1-based step count of this parameter's state (bias correction)
  float grad_scale = 1.0f;    // multiplies the gradient first (clipping); 1: none
};

// One AdamW step, in place.
// params:      [*] master weights, updated
// grads:       [*] read only (the caller zeroes them for the next accumulation)
// m, v:        [*] first and second moments, updated (zero-initialized before step 1)
// params_bf16: [*] optional (TensorView{}: skip): overwritten with bf16(updated params), round to
//              nearest even, in the same pass
void adamw_update(const TensorView& params, const TensorView& grads, const TensorView& m,
                  const TensorView& v, const TensorView& params_bf16, const AdamWParams& p,
                  void* stream = nullptr);

// adamw_update over several tensors, each with its own AdamWParams: on CUDA one launch per up to
// 32 tensors (a model's optimizer step: one launch per parameter tensor left the GPU waiting for
// the host between the small kernels), the same bits as one adamw_update per tensor.
struct AdamWUpdate {
  TensorView params, grads, m, v;
  TensorView params_bf16;  // optional
  AdamWParams p;
};
void adamw_update_many(std::span<const AdamWUpdate> updates, void* stream = nullptr);

// Bytes of CUDA workspace global_grad_norm needs for these tensors (the CPU needs none).
int64_t grad_norm_workspace_bytes(std::span<const TensorView> tensors);

// norm[0] = sqrt(sum over all tensors and elements of x^2): the global L2 norm of the gradients.
// norm:      [1] CUDA: f32; CPU: f32 or f64 (the dtype of the tensors)
// tensors:   the gradient tensors, each [*] contiguous. CUDA: f32 or bf16 (mixed is fine). CPU: f32
//            or f64, all the same.
// workspace: CUDA: any dtype, contiguous, 16-byte aligned, at least grad_norm_workspace_bytes
//            bytes; CPU: ignored (TensorView{}).
// Accumulation: CPU in double, tensor by tensor, element by element. CUDA: each tensor is cut into
// a number of CTA slices that depends only on its size; each CTA sums its squares in FP64 and
// writes one partial; one CTA adds the partials in order. Deterministic; a NaN or Inf anywhere
// makes the norm NaN or Inf (the trainer's cue to skip the step).
void global_grad_norm(const TensorView& norm, std::span<const TensorView> tensors,
                      const TensorView& workspace, void* stream = nullptr);

// The clipping factor of torch.nn.utils.clip_grad_norm_: min(1, max_norm / (norm + 1e-6)), to
// pass as AdamWParams::grad_scale. max_norm <= 0 disables clipping (returns 1). A NaN norm gives
// NaN and an Inf norm 0, as in PyTorch: the trainer should skip a step whose norm is not finite.
float clip_grad_scale(float norm, float max_norm);

}  // namespace fourbit::ops
