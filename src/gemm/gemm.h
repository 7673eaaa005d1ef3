// One GEMM entry point over plain (BF16/F32) and quantized (NVFP4, MXFP8, FP8) operands, on the CPU
// and on CUDA GPUs, plus the grouped GEMM of mixture-of-experts layers.
//
// Every GEMM is "TN" over its stored operands:
//     C[M, N] = alpha * A[M, K] . B[N, K]^T + beta * C[M, N]
// A and B are given as logical matrices [rows, K] whose reduction dimension K is the contiguous
// one, exactly how quantized copies are stored (quant/quantize.h): the row-wise copy of X [M, K] is
// [M, K]; the column-wise copy is its transpose [K, M], blocks along M. For a linear layer
// Y = X W^T (X [M, K], W [N, K], dY [M, N]):
//     Fprop  Y [M, N]  = X . W^T       A = X row-wise [M, K],   B = W row-wise [N, K]
//     Dgrad  dX [M, K] = dY . W        A = dY row-wise [M, N],  B = W column-wise [K, N]
//     Wgrad  dW [N, K] = dY^T . X      A = dY column-wise [N, M], B = X column-wise [K, M]
// (linear.h runs the three with per-operand quantization.) Plain operands may instead be
// "transposed" views, stored [K, rows], so that a BF16 layer needs no explicit transposes.
//
// Numerics. Every backend multiplies exactly the values the operands represent (the dequantized
// values of quant::dequantize_reference) and differs from the float64 reference only by its
// accumulation: the CPU reference accumulates in float64, everything else in FP32 (the FP8 tensor
// cores with cuBLAS's split accumulator: partial sums are promoted to FP32 at least every 128
// elements of K, NUMERICS.md 6). Per-tensor factors (FP8 decode scales, the NVFP4 global decode
// scale) are applied in FP32 after the reduction, together with alpha. NVFP4 and MXFP8 GEMMs run on
// Hopper as an exact emulation (NUMERICS.md 3.7): operands in the "scaled domain" (e2m1 * s_b,
// P * 2^(k-127)), exactly representable in BF16, through a BF16 tensor-core GEMM. Unsupported
// combinations are errors that name the operand and say what to do; nothing falls back silently to
// different numerics. There is no Blackwell-native block-scaled path (VEC16_UE4M3 / VEC32_UE8M0):
// NVFP4 / MXFP8 always take the emulation, and the Hopper-only FP8 block modes are refused elsewhere. Random-Hadamard-transformed copies (Wgrad operands) may only be multiplied
// with a copy transformed with the same signs (H H^T = I cancels in the product).
//
// Streams and memory. CUDA GEMMs are asynchronous on `stream`; nothing synchronizes the host,
// except where documented (a null `error_flag` when the GEMM itself must dequantize MXFP8). Scratch
// buffers (converted scales, scaled-domain BF16 operands, the alpha scalar) come from `workspace`
// when given (and are released before returning; later work on the same stream may reuse them),
// else from a per-process buffer of this module that grows as needed; cuBLASLt's 32 MiB workspace
// is the module's own. Both per-process buffers assume that concurrent GEMMs run on one stream.
// C may not alias A or B.
#pragma once

#include "core/arena.h"
#include "core/tensor.h"
#include "quant/quantize.h"

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace fourbit::gemm {

enum class Backend : uint8_t {
  kAuto,          // chosen from the operand formats and the device (logged once per selection)
  kCpuReference,  // naive loops, float64 accumulation: the ground truth
  kCpuBlas,       // OpenBLAS sgemm over the exactly dequantized operands (FP32 accumulation)
  kCublasBf16,    // cuBLASLt BF16 x BF16, FP32 accumulation
  kCublasFp8,     // cuBLASLt FP8 E4M3: per-tensor or 1x128 / 128x128 block scales (Hopper)
  kEmulated,      // exact NVFP4 / MXFP8 emulation: scaled-domain BF16 operands + cuBLASLt BF16
  kWgmmaFp8,      // fourbit's FP8 E4M3 kernel: 1x128 A x 1x128 or 128x128 B block scales (Hopper; fp8_wgmma_kernels.h)
};
std::string_view backend_name(Backend b);
// Which kernel backend auto gives a block-scaled FP8 GEMM with a 1x128 A, by B's blocks: 1x128
// (the fp8 recipe's Wgrad) or 128x128 (its Fprop and Dgrad); kCublasFp8 or kWgmmaFp8. The
// environment variable FOURBIT_GEMM_FP8_BLOCK (read once per process) overrides the default:
// "cublas" (both on cuBLASLt), "wgmma" (both on kWgmmaFp8), "wgmma-wgrad" (only the 1x128 pair).
Backend fp8_block_backend(bool b_128x128);
// True when this binary contains the backend (kCpuBlas needs OpenBLAS; the cuBLASLt ones CUDA).
bool backend_built(Backend b);

enum class Copy : uint8_t { kRowwise, kColwise };

// One GEMM operand: the logical matrix [rows, K] with K contiguous.
struct Operand {
  // Plain operand: bf16 or f32 with unit stride along its last dimension. Not transposed: `plain`
  // is [rows, K] (row stride >= K). Transposed: `plain` is stored [K, rows] (row stride >= rows).
  TensorView plain;
  bool transposed = false;
  // Quantized operand (when non-null): the given copy of this bundle, [rows, K] = the copy's
  // stored matrix [R, C]. The bundle must outlive the GEMM call (not its asynchronous execution:
  // only device pointers are kept).
  const quant::QuantizedTensor* quantized = nullptr;
  Copy copy = Copy::kRowwise;
  // Optional, NVFP4 / MXFP8 on CUDA: the producer's scaled-domain BF16 copy of that orientation
  // (quant::CudaQuantizeOptions::write_bf16_scaled), bf16 [R, C]. The emulation then reads it
  // instead of dequantizing the packed data (the fused fast path); the bundle still supplies the
  // format and the global amax, and its packed data may be left unwritten.
  TensorView scaled_bf16;
  std::string_view name = "operand";  // appears in every error about this operand

  static Operand dense(const TensorView& t, std::string_view name, bool transposed = false);
  static Operand quant(const quant::QuantizedTensor& q, Copy copy, std::string_view name,
                       const TensorView& scaled_bf16 = {});

  int64_t rows() const;  // logical rows (M for A, N for B)
  int64_t k() const;     // logical reduction length
  std::string describe() const;  // "a = X (nvfp4 16x16 rn, row-wise) [128, 256] on cuda"
};

struct GemmArgs {
  Operand a;      // [M, K]
  Operand b;      // [N, K]
  TensorView c;   // f32 or bf16 [M, N], unit column stride, row stride >= N; read when beta != 0
  float alpha = 1.0f;
  float beta = 0.0f;  // 1: accumulate into C
  // Optional: the beta term reads this matrix instead of C, i.e. C = alpha * A . B^T + beta *
  // c_source (cuBLASLt's separate C and D). Same dtype, shape and strides as C; may be C itself,
  // may not alias A or B. A residual connection y = x + f(...) is one GEMM this way (the sum is
  // formed in FP32 and rounded once to C's dtype). Not for grouped GEMMs.
  TensorView c_source{};
  Backend backend = Backend::kAuto;
  void* stream = nullptr;  // cudaStream_t
  std::string_view name = "gemm";  // appears in errors and in the backend log line
  Arena* workspace = nullptr;      // device arena for scratch (see the header comment)
  // Device int32 into which error bits are OR-ed: bit 2 when an MXFP8 block scale outside [3, 246]
  // is met while dequantizing to BF16 (those elements become NaN); the same bit as the quantizer's,
  // so one flag (CudaQuantizeOptions::nonfinite_flag) can serve both. When null and the GEMM must
  // dequantize an MXFP8 operand itself, it synchronizes its stream and throws on that error.
  int* error_flag = nullptr;
};

// Runs C = alpha * A . B^T + beta * C (or beta * c_source) on the operands' device. Throws fourbit::Error for
// mismatched shapes or devices, unsupported format pairs or alignments, naming the operand.
void gemm(const GemmArgs& args);

// The backend that kAuto resolves to for these operands on this build and device (no GEMM run).
Backend select_backend(const GemmArgs& args);

// ---- Grouped GEMM (mixture of experts) --------------------------------------------------------
//
// One GEMM per group (expert) g with a host-known token count n_g (zero allowed); groups are
// consecutive slices of the token dimension T = sum n_g of the shared operands:
//   kRows      (Fprop, Dgrad)  C[T, N] rows of g = A[T, K] rows of g . B_g[N, K]^T
//              a: shared [T, K]; b: one operand per group; c: one [T, N] (row-split)
//   kReduction (Wgrad)         C_g[M, N] = A[M, T] cols of g . B[N, T] cols of g ^T
//              a, b: shared, K = T; c: one [M, N] per group (an empty group gives beta * C_g)
// The counts are read on the host (the router's counts are copied to the host once per step, not
// once per expert), so the launches of all groups follow each other without a synchronization;
// per-group work is one cuBLASLt GEMM (plus, for FP8 block scales, one scale-layout kernel and, for
// the emulation, one alpha kernel). Shared operands are converted once for all groups. Why a loop
// of GEMMs: the cuBLAS of CUDA 13.0 (cuBLAS 13.1) has no device-side grouped cuBLASLt matmul
// (CUBLASLT_BATCH_MODE_GROUPED is documented for later releases only), and cublasGemmGroupedBatchedEx
// takes host arrays of shapes and no FP8 scales; a device-sized grouped kernel (token counts read
// on the GPU) would remove the once-per-step copy of the counts and is future work.
// Alignment: quantized column slices (kReduction) must start at a multiple of the block (FP8: 128;
// NVFP4 with RHT: 16, so that the transform cancels within the group); cuBLASLt needs 16-byte
// aligned slices (token offsets multiple of 8 for BF16, 16 for FP8).
enum class GroupSplit : uint8_t { kRows, kReduction };

struct GroupedGemmArgs {
  GroupSplit split = GroupSplit::kRows;
  std::span<const int64_t> group_sizes;  // host, one per group
  Operand a;
  std::span<const Operand> b;     // kRows: one per group; kReduction: exactly one
  std::span<const TensorView> c;  // kRows: exactly one; kReduction: one per group
  float alpha = 1.0f;
  float beta = 0.0f;
  Backend backend = Backend::kAuto;
  void* stream = nullptr;
  std::string_view name = "grouped gemm";
  Arena* workspace = nullptr;
  int* error_flag = nullptr;
};

void grouped_gemm(const GroupedGemmArgs& args);

}  // namespace fourbit::gemm
