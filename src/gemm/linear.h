// The three GEMMs of a linear layer Y = X W^T under a per-operand quantization recipe, as one
// tested unit (the model asks for "linear forward / backward under recipe R"):
//     Fprop  Y [M, N]  = X . W^T     X row-wise,     W row-wise
//     Dgrad  dX [M, K] = dY . W      dY row-wise,    W column-wise
//     Wgrad  dW [N, K] = dY^T . X    dY column-wise, X column-wise
// Each GEMM operand is quantized from its high-precision source in the orientation its reduction
// needs (the blocks run along the reduction dimension), with its own QuantConfig, or stays plain.
// The orientation is not a recipe choice: it is dictated by the GEMM (NUMERICS.md 4.1).
//
// On the CPU the operands are quantized with the reference quantizers; on CUDA with quantize_cuda,
// and NVFP4 / MXFP8 operands take the fused fast path (the quantizer writes the scaled-domain BF16
// copy the emulated GEMM reads; the packed copy is not materialized). The quantized operands are
// temporaries of each call, taken from and returned to the device's stream-ordered memory pool
// (core/device.h: no device synchronization, the freed bytes are reused by the next call). Nothing
// is cached between calls (a weight is quantized again at every GEMM that reads it), except the
// one copy a caller asks to keep: X's column-wise copy from linear_fprop_saving_x (below), which
// the training forward holds for the backward's Wgrad instead of X.
#pragma once

#include "core/rng.h"
#include "gemm/gemm.h"

#include <memory>
#include <optional>
#include <string>

namespace fourbit::gemm {

// How one GEMM operand is represented: quantized with `quant`, or plain (nullopt: the source's own
// dtype, bf16 on CUDA).
struct OperandRecipe {
  std::optional<quant::QuantConfig> quant;
};

struct LinearRecipe {
  OperandRecipe fprop_x, fprop_w;
  OperandRecipe dgrad_dy, dgrad_w;
  OperandRecipe wgrad_dy, wgrad_x;

  static LinearRecipe plain();  // no quantization (BF16 GEMMs on CUDA)
  // NVIDIA's NVFP4 recipe (NUMERICS.md 4.1): X, dY 1x16; W 16x16; SR on dY; RHT on the Wgrad pair.
  static LinearRecipe nvfp4();
  // DeepSeek-V3 FP8 (NUMERICS.md 6): X, dY 1x128 blocks, W 128x128 blocks, power-of-two scales.
  static LinearRecipe fp8_block();
  static LinearRecipe mxfp8();  // MXFP8 everywhere, round-to-nearest
  std::string describe() const;  // one line per GEMM
};

struct LinearOptions {
  Backend backend = Backend::kAuto;
  RandomStream sr{};  // stochastic rounding: operand i of a call draws from stream sr.stream + i
  void* stream = nullptr;
  std::string_view name = "linear";
  Arena* workspace = nullptr;
  // Device int32 for the quantizers' and GEMMs' error bits (see GemmArgs::error_flag); when null,
  // each CUDA quantization synchronizes and throws on NaN / Inf.
  int* error_flag = nullptr;
  // The global amaxes of the activation X (linear_fprop_saving_x) or of the gradient dY
  // (linear_dgrad_wgrad), computed by the op that wrote the tensor (ops::OutputAmaxes: the plain
  // amax and the amax after the column-wise RHT, device floats), so that the one quantization
  // pass that makes both copies skips its amax pass (quant::CudaQuantizeOptions::given_*_amax).
  // Only for those one-pass calls (fprop_and_wgrad_x_share_a_pass /
  // dgrad_and_wgrad_dy_share_a_pass) with an NVFP4 per-tensor-amax recipe.
  struct GivenAmax {
    const float* amax = nullptr;
    const float* rht_amax = nullptr;  // required when the recipe's column-wise copy has RHT
    bool given() const { return amax != nullptr; }
  };
  GivenAmax source_amax;
  // Forward calls only (linear_fprop, linear_fprop_saving_x): when set, y = x W^T + residual, the
  // residual added in the GEMM's epilogue (GemmArgs::c_source with beta 1: the sum is formed in
  // FP32 and rounded once to y's dtype, so it equals adding the FP32 GEMM result to the residual).
  // Same dtype, shape and strides as y; may be y itself; may not alias x or w.
  TensorView residual{};
};

// Whether a one-pass quantization under `cfg` can take a producer's amaxes (LinearOptions::
// source_amax): NVFP4 with one per-tensor amax, 1D blocks.
bool takes_given_amax(const quant::QuantConfig& cfg);

// One GEMM operand made from a source [rows, cols] in orientation `copy`: quantized per the
// operand recipe (on CUDA, for NVFP4/MXFP8 only the scaled-domain BF16 copy the Hopper emulation
// reads), or the plain source (its transposed view for kColwise). Owns what `operand` points into.
struct PreparedOperand {
  std::unique_ptr<quant::QuantizedTensor> quantized;
  Tensor scaled_bf16;
  Operand operand;
};
PreparedOperand prepare_operand(const OperandRecipe& recipe, const TensorView& src, Copy copy,
                                RandomStream sr, std::string_view name, const LinearOptions& options);
// The stochastic-rounding stream of operand i of a call whose stream is `call` (LinearOptions::sr):
// fprop x 0, w 1; dgrad dy 2, w 3; wgrad dy 4, x 5.
inline RandomStream operand_stream(RandomStream call, uint64_t i) { return {call.seed, call.stream + i}; }
inline RandomStream operand_stream(const LinearOptions& o, uint64_t i) { return operand_stream(o.sr, i); }

// x [M, K], w [N, K] -> y [M, N] (f32 or bf16). All tensors on one device, contiguous.
void linear_fprop(const LinearRecipe& recipe, const TensorView& x, const TensorView& w,
                  const TensorView& y, const LinearOptions& options);
// dy [M, N], w [N, K] -> dx [M, K].
void linear_dgrad(const LinearRecipe& recipe, const TensorView& dy, const TensorView& w,
                  const TensorView& dx, const LinearOptions& options);
// dy [M, N], x [M, K] -> dw [N, K]; beta = 1 accumulates into dw (gradient accumulation).
void linear_wgrad(const LinearRecipe& recipe, const TensorView& dy, const TensorView& x,
                  const TensorView& dw, float beta, const LinearOptions& options);

// ---- Keeping the Wgrad's X quantized between forward and backward ------------------------------
// A training forward must keep X [M, K] for the Wgrad dW = dY^T X. When the recipe quantizes
// wgrad_x, the backward only ever reads X's column-wise quantized copy, so the forward can keep that
// instead of X (NVFP4: 4.5 bits per value instead of 16; FP8 / MXFP8: 8.25-8.5). The saved copy is
// bit for bit the operand linear_wgrad would have made from X (same config, same stochastic-
// rounding stream 5 of the call), so the gradients do not change.
//
// One pass over X writes both copies when fprop_x and wgrad_x differ at most in the RHT fields (RHT
// touches only the column-wise copy) and both round to nearest (with stochastic rounding the two
// copies draw from different streams of the call); otherwise the column-wise copy takes its own pass.

// True when recipe.wgrad_x is quantized (the saved copy is then what the Wgrad reads).
bool wgrad_reads_quantized_x(const LinearRecipe& recipe);

// True when linear_fprop_saving_x quantizes X once for both copies.
bool fprop_and_wgrad_x_share_a_pass(const LinearRecipe& recipe);

// linear_fprop, and X's column-wise copy for the later linear_wgrad_from_saved_x into saved_x
// (allocated here on x's device: [K, M] stored; packed data, scales and amax). Needs
// wgrad_reads_quantized_x(recipe). `options.sr` must be the stream the Wgrad call would use (the
// same call stream: operand 5 is taken from it).
void linear_fprop_saving_x(const LinearRecipe& recipe, const TensorView& x, const TensorView& w,
                           const TensorView& y, quant::QuantizedTensor& saved_x,
                           const LinearOptions& options);

// linear_wgrad with X's column-wise copy saved by linear_fprop_saving_x: dy [M, N] -> dw [N, K].
void linear_wgrad_from_saved_x(const LinearRecipe& recipe, const TensorView& dy,
                               const quant::QuantizedTensor& saved_x, const TensorView& dw, float beta,
                               const LinearOptions& options);

// ---- Dgrad and Wgrad of one dY together ----------------------------------------------------------
// Both backward GEMMs read dY: Dgrad its row-wise copy, Wgrad its column-wise one. When dgrad_dy
// and wgrad_dy differ at most in the RHT fields and neither has a per-row amax, one pass over dY
// (one amax pass for both global amaxes) writes both copies, each rounded with its own stream (2
// and 4 of the call, as the separate calls draw), so the results are bit for bit theirs.
bool dgrad_and_wgrad_dy_share_a_pass(const LinearRecipe& recipe);

// linear_dgrad and then linear_wgrad: dy [M, N], w [N, K] -> dx [M, K]; dw [N, K] (beta as in
// linear_wgrad) from x [M, K], or from X's saved column-wise copy when saved_x is non-null (x is
// then not read).
void linear_dgrad_wgrad(const LinearRecipe& recipe, const TensorView& dy, const TensorView& w,
                        const TensorView& dx, const TensorView& x,
                        const quant::QuantizedTensor* saved_x, const TensorView& dw, float beta,
                        const LinearOptions& options);

// Bytes held by a quantized bundle (data, scales and amax of every orientation present).
int64_t quantized_bytes(const quant::QuantizedTensor& q);

}  // namespace fourbit::gemm
