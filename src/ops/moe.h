// Mixture-of-experts routing and token permutation: everything of an MoE block except the expert
// GEMMs (gemm::grouped_gemm). One MoE layer runs
//   forward:  router GEMM (caller, FP32)  -> router_forward (probs, top-k ids, gates, counts, losses)
//             -> moe_plan (the permutation) -> moe_permute (x -> x_perm, grouped by expert)
//             -> grouped expert GEMMs -> moe_unpermute (y = sum over the k slots of gate * y_perm)
//   backward: moe_unpermute_backward (d_y_perm, d_gates) -> grouped GEMM backward
//             -> moe_permute_backward (dx) ; router_backward (d_logits) -> router GEMM backward.
// Sizes: N tokens, E experts, k experts per token (slot (n, j) = n * k + j, j < k), C channels,
// R rows of the permuted buffers (see moe_plan).
//
// Router (softmax top-k with renormalized gates):
//   probs[n, e]  = softmax_e(logits[n, :])
//   expert_ids   = the k experts with the largest logits[n, e] + bias[e] (bias optional, for
//                  SELECTION ONLY: auxiliary-loss-free load balancing, DeepSeek-V3 style), in
//                  descending order; ties go to the lower expert id. Deterministic.
//                  With forced_ids (routing replay for RL, RL.md) the given ids are used as they
//                  are, in their order.
//   gates[n, j]  = probs[n, id_j] / sum_{j'} probs[n, id_j']  (from the UNBIASED probs, so the
//                  router gets gradients also under replay and with a bias)
//   expert_counts[e] = number of slots routed to e (what the grouped GEMM needs on the host: copy
//                  it once per step).
//   Auxiliary load-balancing loss (Switch / Mixtral, the value of HF's load_balancing_loss_func):
//     aux = E * sum_e f_e * P_e,  f_e = expert_counts[e] / N (top-k counted: sum_e f_e = k),
//     P_e = mean over tokens of probs[n, e]; perfect balance gives aux = k. f_e is a constant
//     (piecewise constant in the logits): the gradient flows through P_e only.
//   z-loss (ST-MoE): z = mean over tokens of logsumexp(logits[n, :])^2.
//   Both are returned unweighted; router_backward takes d objective / d aux and / d z (the loss
//   coefficients, times any loss scale) and adds their gradients to d_logits.
//
// Permutation: moe_plan sorts the slots by expert, stably (within an expert: token order, then
// slot order), with a counting sort (per-chunk histograms, prefix sums, per-warp ranks): integer
// only, deterministic. Expert e owns rows [offsets[e], offsets[e + 1]) of x_perm; its first
// expert_counts[e] rows hold its slots, the rest (row_align > 1) are padding rows, zero-filled by
// moe_permute and moe_unpermute_backward so that padded groups can go straight to the grouped
// GEMM (gemm.h wants group boundaries on multiples of 8 rows for bf16, 16 for FP8, 128 for FP8
// block-scaled reduction slices). Rows from offsets[E] to R are padding too.
// Un-permute and both backward gathers are per token and sum the k slots in slot order: no float
// atomics, deterministic.
//
// Dtypes. CPU (the reference): one floating dtype, f32 or f64, for every floating tensor of a call
// (logits, probs, gates, bias, losses, x, y, gradients); naive loops with float64 sums. CUDA:
// router tensors f32 (the router stays in high precision, DESIGN.md); x, x_perm, y_perm, y and
// their gradients bf16 or f32 (one dtype per call); gates and d_gates f32. Integer tensors i32.
// Every tensor contiguous. Backward functions OVERWRITE their outputs (all are activation
// gradients). Outputs never alias inputs.
//
// Invalid expert ids (outside [0, E), or repeated within a token in forced_ids) are errors: the CPU
// throws; CUDA router_forward ORs kErrIndexOutOfRange into the error flag (ops/error_flags.h; a
// null flag makes it synchronize and throw). Downstream CUDA kernels never access memory out of
// bounds for such ids: an out-of-range id's slot gets no row (slot_rows = -1) and contributes
// nothing.
#pragma once

#include "core/tensor.h"

#include <cstdint>
#include <span>
#include <vector>

namespace fourbit::ops {

// ---- router -------------------------------------------------------------------------------------

struct RouterOptions {
  int top_k = 2;               // k, 1 <= k <= min(E, 32)
  TensorView selection_bias;   // [E], optional (absent: TensorView{}): added to logits for selection
  TensorView forced_ids;       // i32 [N, k], optional: routing replay
  int* error_flag = nullptr;   // CUDA with forced_ids: see the file comment and ops/error_flags.h
};

struct RouterOutputs {
  TensorView probs;          // [N, E]
  TensorView expert_ids;     // i32 [N, k]
  TensorView gates;          // [N, k]
  TensorView expert_counts;  // i32 [E]
  TensorView losses;         // [2] = {aux, z}, optional (absent: not computed)
};

// logits: [N, E] (the router GEMM's output, FP32). E <= 1024 on CUDA.
void router_forward(const TensorView& logits, const RouterOptions& options,
                    const RouterOutputs& outputs, void* stream = nullptr);

// What router_backward needs from the forward.
struct RouterSaved {
  TensorView logits;         // [N, E] (only read when z_loss_grad != 0)
  TensorView probs;          // [N, E]
  TensorView expert_ids;     // i32 [N, k] (the selected or forced ids)
  TensorView expert_counts;  // i32 [E]   (only read when aux_loss_grad != 0)
};

struct RouterLossGrads {
  float aux = 0.0f;  // d objective / d aux (e.g. the aux-loss coefficient)
  float z = 0.0f;    // d objective / d z   (e.g. the z-loss coefficient)
};

// d_logits [N, E] = the gradient through gates = renormalized softmax (from d_gates [N, k]), plus
// loss_grads.aux * d aux / d logits + loss_grads.z * d z / d logits. Overwrites d_logits.
void router_backward(const RouterSaved& saved, const TensorView& d_gates,
                     const RouterLossGrads& loss_grads, const TensorView& d_logits,
                     void* stream = nullptr);

// ---- permutation --------------------------------------------------------------------------------

// Where every slot lives in the permuted buffers; written by moe_plan, read by the rest.
struct MoePlan {
  TensorView offsets;    // i32 [E + 1]: expert e's rows are [offsets[e], offsets[e + 1])
  TensorView slot_rows;  // i32 [N, k]: the row of slot (n, j); -1 only for an invalid id (CUDA)
  TensorView row_slots;  // i32 [R]: the slot n * k + j held by row r; -1 for a padding row
};

// The number of rows R the permuted buffers need: N * k without padding (row_align == 1), else
// the worst case N * k + E * (row_align - 1). Any larger R is accepted (extra rows are padding).
int64_t moe_permuted_rows(int64_t n_tokens, int top_k, int n_experts, int row_align);

// Host-side group sizes for gemm::grouped_gemm from expert_counts copied to the host: expert e's
// count rounded up to a multiple of row_align (these sum to offsets[E]).
std::vector<int64_t> moe_group_sizes(std::span<const int32_t> expert_counts, int row_align);

// expert_ids: i32 [N, k]; row_align >= 1 (a multiple of it starts every expert's group).
void moe_plan(const TensorView& expert_ids, int row_align, const MoePlan& plan,
              void* stream = nullptr);

// x_perm[slot_rows[n, j]] = x[n]; padding rows = 0.         x: [N, C], x_perm: [R, C]
void moe_permute(const TensorView& x, const MoePlan& plan, const TensorView& x_perm,
                 void* stream = nullptr);

// dx[n] = sum_j d_x_perm[slot_rows[n, j]] (slot order).       d_x_perm: [R, C], dx: [N, C]
void moe_permute_backward(const TensorView& d_x_perm, const MoePlan& plan, const TensorView& dx,
                          void* stream = nullptr);

// y[n] = sum_j gates[n, j] * y_perm[slot_rows[n, j]] (slot order, FP32 sums).
//                                                  y_perm: [R, C], gates: [N, k], y: [N, C]
void moe_unpermute(const TensorView& y_perm, const TensorView& gates, const MoePlan& plan,
                   const TensorView& y, void* stream = nullptr);

// d_y_perm[slot_rows[n, j]] = gates[n, j] * dy[n] (padding rows = 0);
// d_gates[n, j] = dy[n] . y_perm[slot_rows[n, j]].
//   dy: [N, C], y_perm: [R, C], gates: [N, k], d_y_perm: [R, C], d_gates: [N, k]
void moe_unpermute_backward(const TensorView& dy, const TensorView& y_perm,
                            const TensorView& gates, const MoePlan& plan,
                            const TensorView& d_y_perm, const TensorView& d_gates,
                            void* stream = nullptr);

}  // namespace fourbit::ops
