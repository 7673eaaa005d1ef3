// Softmax cross-entropy of the LM head's logits against the next-token targets, with the loss
// gradient fused in (as llm.c's fused_classifier), so that the [N, V] probabilities are never
// stored: the backward recomputes the softmax from the logits and can write dlogits over them.
//
//   lse[n]       = log sum_v exp(logits[n, v])                  (max-subtracted: no overflow)
//   losses[n]    = lse[n] - logits[n, targets[n]]               (0 for an ignored token)
//   mean_loss    = sum of losses[n] over valid n / n_valid     (0 when no token is valid)
//   dlogits[n,v] = (exp(logits[n, v] - lse[n]) - [v == targets[n]]) * dloss_scale
//                  (a row of zeros for an ignored token)
// Per-token weights (the RL policy-gradient loss, RL.md: loss = sum_n w_n * losses[n] with
// constant w_n): the _weighted entry point multiplies row n's gradient by row_weights[n], so
//   dlogits[n,v] = (exp(logits[n, v] - lse[n]) - [v == targets[n]]) * row_weights[n] * dloss_scale;
// weights may be negative or zero; losses and mean_loss are unweighted as above.
// N = tokens (B*T), V = vocabulary. targets[n] == -1 marks an ignored token (padding, prompt
// positions); any other value must lie in [0, V). dloss_scale is d(objective) / d(losses[n]),
// the same for every valid token: 1 / n_valid for the mean over one micro-batch, or 1 / (total
// valid tokens of all micro-batches) under gradient accumulation (the caller counts them on the
// host, where the targets come from).
//
// Dtypes. CPU reference: logits, losses, mean_loss, dlogits all f32 or all f64 (naive two-pass
// softmax in the scalar type). CUDA: logits bf16 or f32, dlogits bf16 or f32, losses and
// mean_loss f32; all math FP32 (logf, and the exponential each call picks: CrossEntropyExp).
// targets i32. Contiguous tensors.
//
// Invalid targets. CPU: an error naming the token. CUDA: the kernel cannot throw; it sets
// kErrIndexOutOfRange in the error flag (ops/error_flags.h) and writes NaN to that token's loss and
// dlogits row. error_flag: null -> an internal flag, checked synchronously (throws); a device int ->
// OR-ed into asynchronously, for the caller to read once per step. Ignored on the CPU.
//
// Training keeps each row's lse from the forward (cross_entropy_forward_saving_lse) and the
// backward then reads the row once (cross_entropy_backward_inplace_from_lse) instead of recomputing
// the softmax: the same bits as the fused forward-backward, one pass over [N, V] fewer.
//
// CUDA kernels: one CTA per row (up to 512 threads). Pass 1 is an online softmax (running max and
// rescaled sum per thread, then a fixed-order CTA reduction); pass 2 (backward) writes dlogits
// from the row, which the forward-and-backward entry points keep in shared memory when it fits
// (V <= 57856 BF16 logits: one DRAM read of the logits) and otherwise read again. Rows are read with 16-byte loads after a scalar head that
// reaches 16-byte alignment, so odd V (50257) is full speed. The mean is a separate single-CTA
// fixed-order reduction. Deterministic.
#pragma once

#include "core/tensor.h"

namespace fourbit::ops {

// The CUDA kernels' exponential (the CPU reference always uses std::exp). The environment
// variable FOURBIT_CE_EXP=expf|sfu, when set, overrides every call's choice (A/B runs).
enum class CrossEntropyExp : uint8_t {
  kExpf,  // expf: within 2 ulp
  kSfu,   // ex2.approx.ftz of d log2(e) on the special-function unit: fewer instructions (the
          // kernels are issue-bound), relative error ~2^-22 plus the product's rounding
};

// The exponential a call asking for `requested` gets: FOURBIT_CE_EXP where it is set (read once
// per process; any value other than expf or sfu is an error), else `requested`.
CrossEntropyExp cross_entropy_exp_in_effect(CrossEntropyExp requested);

// losses:    [N]     overwritten
// mean_loss: [1]     overwritten; optional (TensorView{}: not computed)
// logits:    [N, V]
// targets:   [N] i32
void cross_entropy_forward(const TensorView& losses, const TensorView& mean_loss,
                           const TensorView& logits, const TensorView& targets,
                           int* error_flag = nullptr, void* stream = nullptr,
                           CrossEntropyExp exp = CrossEntropyExp::kExpf);

// cross_entropy_forward, also writing each row's log-sum-exp (for the backward below).
// lse: [N] overwritten: f32 on CUDA, the logits' dtype on the CPU; 0 for an ignored token.
void cross_entropy_forward_saving_lse(const TensorView& losses, const TensorView& mean_loss,
                                      const TensorView& lse, const TensorView& logits,
                                      const TensorView& targets, int* error_flag = nullptr,
                                      void* stream = nullptr,
                                      CrossEntropyExp exp = CrossEntropyExp::kExpf);

// The backward alone, in place, from the lse that cross_entropy_forward_saving_lse wrote for these
// very logits: one read and one write of each row. dlogits equal, bit for bit, what
// cross_entropy_forward_backward_inplace(_weighted) writes (the lse comes from the same kernel and
// reduction order). A stale lse (other logits) gives wrong gradients: the caller owns the pairing.
// logits_to_dlogits: [N, V]  in: logits; out: dlogits
// lse:               [N]     from cross_entropy_forward_saving_lse
// targets:           [N] i32
// row_weights:       [N] optional (TensorView{}: weight 1); as in the _weighted entry point
void cross_entropy_backward_inplace_from_lse(const TensorView& logits_to_dlogits,
                                             const TensorView& lse, const TensorView& targets,
                                             float dloss_scale,
                                             const TensorView& row_weights = TensorView{},
                                             int* error_flag = nullptr, void* stream = nullptr,
                                             CrossEntropyExp exp = CrossEntropyExp::kExpf);

// dlogits: [N, V]  OVERWRITTEN (an activation gradient); must not alias logits (see
//                  cross_entropy_forward_backward_inplace)
// logits:  [N, V]
// targets: [N] i32
void cross_entropy_backward(const TensorView& dlogits, const TensorView& logits,
                            const TensorView& targets, float dloss_scale,
                            int* error_flag = nullptr, void* stream = nullptr,
                            CrossEntropyExp exp = CrossEntropyExp::kExpf);

// Forward and backward in one call, writing dlogits over the logits (the llm.c memory saving:
// no second [N, V] buffer). Same results as cross_entropy_forward then cross_entropy_backward.
// logits_to_dlogits: [N, V]  in: logits; out: dlogits (dtype unchanged)
// losses:            [N]     overwritten
// mean_loss:         [1]     overwritten; optional
// targets:           [N] i32
void cross_entropy_forward_backward_inplace(const TensorView& logits_to_dlogits,
                                            const TensorView& losses,
                                            const TensorView& mean_loss,
                                            const TensorView& targets, float dloss_scale,
                                            int* error_flag = nullptr, void* stream = nullptr,
                                            CrossEntropyExp exp = CrossEntropyExp::kExpf);

// The in-place forward and backward with a weight per row (see the top of this file).
// row_weights: [N] CPU: the dtype of logits (f32 or f64); CUDA: f32. Finite.
void cross_entropy_forward_backward_inplace_weighted(const TensorView& logits_to_dlogits,
                                                     const TensorView& losses,
                                                     const TensorView& mean_loss,
                                                     const TensorView& targets,
                                                     const TensorView& row_weights,
                                                     float dloss_scale, int* error_flag = nullptr,
                                                     void* stream = nullptr,
                                                     CrossEntropyExp exp = CrossEntropyExp::kExpf);

}  // namespace fourbit::ops
