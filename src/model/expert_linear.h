// The three GEMMs of the routed experts of an MoE block under a per-operand recipe: the grouped
// counterpart of gemm/linear.h. Expert g owns the rows [start_g, start_g + n_g) of the permuted
// token buffers (ops/moe.h: moe_plan, group sizes from moe_group_sizes) and its own weight slice
// W[g] [N, K] of the stacked weight W [E, N, K]:
//     Fprop  Y[rows of g]  = X[rows of g] . W[g]^T      X row-wise (once for all groups), W[g] row-wise
//     Dgrad  dX[rows of g] = dY[rows of g] . W[g]       dY row-wise (once),             W[g] column-wise
//     Wgrad  dW[g]        += dY[rows of g]^T . X[rows of g]   dY and X column-wise (once), sliced
//                                                             along the tokens per group
// Each operand is quantized from its high-precision source as gemm/linear.h does (CPU: reference
// quantizers; CUDA: quantize_cuda, NVFP4/MXFP8 through the fused scaled-domain BF16 copy), every
// expert weight on its own (its own NVFP4 global scale), the token-side operands once for all
// experts. The GEMMs are gemm::grouped_gemm.
//
// Alignment: a quantized column-wise copy is sliced along the tokens at group boundaries, so
// every group must start on a multiple of that format's block (NVFP4 16, MXFP8 32, FP8 block 128);
// cuBLASLt wants group offsets on multiples of 8 rows (BF16) or 16 (FP8). expert_row_align()
// gives the row alignment to pass to moe_plan / moe_group_sizes.
//
// Stochastic rounding: like gemm::linear_*, operand i of a call draws from stream
// options.sr.stream + i (fprop x 0, w 1; dgrad dy 2, w 3; wgrad dy 4, x 5); expert g's weight copy
// additionally XORs (g + 1) << 44 into the stream.
//
// Temporaries (quantized copies) are allocated per call (from the device's stream-ordered pool
// on CUDA), as in gemm/linear.h.
#pragma once

#include "gemm/linear.h"

#include <cstdint>
#include <span>

namespace fourbit::model {

// The stochastic-rounding stream of expert g's copy of operand i of a call (see above); the
// precision audit replays it.
inline RandomStream expert_operand_stream(RandomStream call, uint64_t i, int64_t g) {
  return {call.seed, (call.stream + i) ^ ((uint64_t)(g + 1) << 44)};
}

// The row alignment of expert groups that `recipe`'s expert GEMMs need (>= 8; the same on the CPU
// and CUDA so that both quantize the same blocks).
int expert_row_align(const gemm::LinearRecipe& recipe);
// The multiple of rows that the permuted token buffers must have in total when `recipe` quantizes
// a token-side operand: the CUDA quantize kernels work on whole tiles of 64 rows (128 for FP8
// block scales); 1 when nothing is quantized. The model pads the last expert's group with zero
// rows up to it (on the CPU too, so that both quantize the same blocks).
int expert_rows_tile(const gemm::LinearRecipe& recipe);

// Experts [first, first + n) of a stacked weight or gradient [E, N, K]: a view [n, N, K] into it
// (expert parallelism's local experts). Throws unless `stacked` is a contiguous 3-D tensor that
// holds that range.
TensorView expert_range(const TensorView& stacked, int64_t first, int64_t n);

// x: [T, K], w: [E, N, K], y: [T, N] (overwritten); sum of group_sizes = T, one size per expert.
void expert_fprop(const gemm::LinearRecipe& recipe, const TensorView& x, const TensorView& w,
                  std::span<const int64_t> group_sizes, const TensorView& y,
                  const gemm::LinearOptions& options);
// dy: [T, N], w: [E, N, K], dx: [T, K] (overwritten).
void expert_dgrad(const gemm::LinearRecipe& recipe, const TensorView& dy, const TensorView& w,
                  std::span<const int64_t> group_sizes, const TensorView& dx,
                  const gemm::LinearOptions& options);
// dy: [T, N], x: [T, K], dw: [E, N, K]; dw[g] = beta * dw[g] + dY_g^T X_g (an empty group leaves
// beta * dw[g]).
void expert_wgrad(const gemm::LinearRecipe& recipe, const TensorView& dy, const TensorView& x,
                  std::span<const int64_t> group_sizes, const TensorView& dw, float beta,
                  const gemm::LinearOptions& options);

}  // namespace fourbit::model
