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
// is cached between calls: a weight is quantized again at every GEMM that reads it.
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
};

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

}  // namespace fourbit::gemm
