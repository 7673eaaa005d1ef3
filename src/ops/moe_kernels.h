// Internal launch interface between moe.cpp (host: checks, dispatch, CPU reference) and
// moe_kernels.cu (nvcc). Plain structs only; every argument was validated by the host side.
#pragma once

#include "ops/kernel_types.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fourbit::ops::kernels {

inline constexpr int kRouterMaxExperts = 1024;  // 32 values per lane of the per-token warp
inline constexpr int kRouterMaxTopK = 32;       // one slot per lane

struct RouterForwardArgs {
  const float* logits;        // [N, E]
  const float* bias;          // [E] or null
  const int32_t* forced_ids;  // [N, k] or null
  float* probs;               // [N, E]
  int32_t* expert_ids;        // [N, k]
  float* gates;               // [N, k]
  int32_t* expert_counts;     // [E] (zeroed by the launcher)
  float* losses;              // [2] or null
  int* error_flag;            // device int (forced ids only)
  int64_t n_tokens;
  int n_experts, top_k;
};

struct RouterBackwardArgs {
  const float* logits;         // [N, E] (read when z_grad != 0)
  const float* probs;          // [N, E]
  const int32_t* expert_ids;   // [N, k]
  const int32_t* expert_counts;  // [E] (read when aux_grad != 0)
  const float* d_gates;        // [N, k]
  float aux_grad, z_grad;
  float* d_logits;             // [N, E]
  int64_t n_tokens;
  int n_experts, top_k;
};

struct MoePlanArgs {
  const int32_t* expert_ids;  // [N * k]
  int64_t n_slots;            // N * k
  int n_experts, row_align;
  int32_t* offsets;           // [E + 1]
  int32_t* slot_rows;         // [N * k]
  int32_t* row_slots;         // [R]
  int64_t rows;               // R
};

void launch_router_forward(const RouterForwardArgs& a, cudaStream_t stream);
void launch_router_backward(const RouterBackwardArgs& a, cudaStream_t stream);
void launch_moe_plan(const MoePlanArgs& a, cudaStream_t stream);

// x_perm[r] = x[row_slots[r] / k], or 0 for row_slots[r] < 0.  x: [N, C], x_perm: [R, C]
void launch_moe_permute(FloatType t, const void* x, const int32_t* row_slots, int64_t rows,
                        int top_k, int64_t channels, void* x_perm, cudaStream_t stream);

// dst[n] = sum_j (gates ? gates[n * k + j] : 1) * src[slot_rows[n * k + j]] (j ascending, FP32;
// slot_rows < 0 contributes nothing).  src: [R, C], dst: [N, C]
void launch_moe_gather_sum(FloatType t, const void* src, const int32_t* slot_rows,
                           const float* gates, int64_t n_tokens, int top_k, int64_t channels,
                           void* dst, cudaStream_t stream);

// d_y_perm[r] = gates[s] * dy[s / k] with s = row_slots[r] (0 for s < 0);
// d_gates[n * k + j] = dy[n] . y_perm[slot_rows[n * k + j]] (0 for a row < 0).
void launch_moe_unpermute_backward(FloatType t, const void* dy, const void* y_perm,
                                   const float* gates, const int32_t* slot_rows,
                                   const int32_t* row_slots, int64_t n_tokens, int top_k,
                                   int64_t rows, int64_t channels, void* d_y_perm,
                                   float* d_gates, cudaStream_t stream);

}  // namespace fourbit::ops::kernels
