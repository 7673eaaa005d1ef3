// Quantizers: configuration, the quantized-tensor bundle, the CPU reference and the CUDA entry
// points. The numerics are specified in ../shared/docs/NUMERICS.md; the per-block arithmetic lives
// in block_math.h and is shared bit for bit by the CPU reference and the CUDA kernels.
//
// Orientation. A source tensor is viewed as a matrix X [rows, cols] = [M, K] (all leading
// dimensions folded into rows). The row-wise copy has its blocks along cols: it feeds a GEMM that
// reduces over K (Fprop: X and W; Dgrad: dY). The column-wise copy has its blocks along rows and is
// stored transposed, [cols, rows], blocks along its last dimension: it feeds a GEMM that reduces
// over M (Wgrad: dY^T and X^T; Dgrad's W). Row-wise and column-wise copies are quantized
// independently from the high-precision source, except for 2D blocks, where the column-wise copy
// is exactly the transpose of the row-wise one (same tile scales).
//
// Storage of one orientation whose stored matrix is [R, C] (blocks along C):
//   NVFP4     data   e2m1x2 [R, C]: row r occupies ceil(C/2) bytes, element c in the low nibble of
//                    byte c/2 when c is even, high nibble when odd; an odd C pads a zero nibble.
//             scales e4m3 [R, ceil(C/16)]: scale (r, j) covers elements 16j .. 16j+15 of row r.
//                    2D (16x16 tiles): the tile scale is repeated in each of the tile's 16 rows.
//             amax   f32 [1]: the global amax of what this orientation quantized (after RHT);
//                    with nvfp4_row_amax, f32 [R]: one global amax per stored row (row-wise only).
//   MXFP8     data   e4m3 [R, C]; scales e8m0 [R, ceil(C/32)].
//   FP8 block data   e4m3 [R, C]; scales f32 decode scales (1 / encode scale):
//                    1x128: [R, ceil(C/128)]; 128x128: [ceil(R/128), ceil(C/128)].
//   FP8 tensor data  e4m3 [R, C]; scales f32 [1] decode scale; amax f32 [1].
// A partial last block (C not a multiple of the block) is quantized from the elements present (as
// if the rest were zero) and has its own scale. The CUDA kernels require C (and R for 2D blocks
// or the column-wise copy) to be a multiple of the block size and say so otherwise.
//
// Stochastic rounding draws 8 bits per element from Philox-4x32-10 (core/rng.h) at
// counter = (stored element index r*C + c) / 16, byte (index % 16), with stream
// `sr.stream` for the row-wise copy and `sr.stream ^ kColwiseStreamBit` for the column-wise copy
// (or the stream given as colwise_sr: one pass can then write two copies that separate calls with
// their own streams would write, e.g. a gradient's Dgrad and Wgrad operands).
//
// NaN or Inf anywhere in the source is an error naming the tensor; nothing non-finite is encoded.
#pragma once

#include "core/rng.h"
#include "core/tensor.h"
#include "quant/block_math.h"
#include "quant/format.h"

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace fourbit::quant {

std::string_view format_name(Format f);

struct QuantConfig {
  Format format = Format::kNvfp4;
  // NVFP4: 16x16 tiles instead of 1x16 blocks; FP8 block: 128x128 instead of 1x128.
  bool block_2d = false;
  Rounding rounding = Rounding::kNearest;
  // Random Hadamard transform (16 points along the column-wise copy's blocks, i.e. along M)
  // before the column-wise quantization. NVFP4 only (the Wgrad operands of the NVIDIA recipe).
  bool rht = false;
  HadamardSigns rht_signs = HadamardSigns::kFixed;
  uint64_t rht_seed = 0;  // for HadamardSigns::kRandom
  Nvfp4ScaleRule nvfp4_scale_rule = Nvfp4ScaleRule::kAmaxTo6;
  FourOverSixMetric four_over_six_metric = FourOverSixMetric::kMse;
  // NVFP4 with stochastic rounding: scale the elements by 16/17 (block_math.h) so that a block
  // maximum whose E4M3 scale rounded down cannot saturate (removes SR's saturation bias).
  bool sr_unbiased_scale = false;
  // NVFP4 1x16, row-wise copy only: one global amax (and so one FP32 global scale) per row of the
  // source instead of one per tensor, TE's "row-scaled" NVFP4 (NUMERICS.md 3.1). For token-side
  // operands (activations X, gradients dY) a row is a token, so a token's quantization depends on
  // that token alone: the RL sampler's decode passes and the trainer's forward then quantize it
  // bit for bit alike, whatever else shares the pass (RL.md: per-token activation scales). The
  // GEMMs apply the per-row decode scale to the rows of C in the FP32 epilogue.
  bool nvfp4_row_amax = false;
  MxScaleRule mx_scale_rule = MxScaleRule::kRoundUp;
  bool fp8_pow2_scales = true;  // FP8 block / tensor: scales rounded down to powers of two

  int block_size() const;  // elements per scale along the blocked dimension (16, 32, 128; 0 = tensor)
  // NVFP4 global constants: for the block scales (2688, or 6 * 256 = 1536 for Four Over Six),
  // and for the elements and the decode (the same, times 16/17 with sr_unbiased_scale and SR).
  float nvfp4_scale_constant() const;
  float nvfp4_global_constant() const;
  uint16_t rht_sign_mask() const;
  std::string describe() const;  // "nvfp4 2d rn", "nvfp4 1d sr rht 4/6(mse)", ...
  // Every field equal (also those that do not apply to the format: compare what applies with the
  // recipe module's field table when that matters).
  bool operator==(const QuantConfig&) const = default;
  void validate() const;         // throws naming the offending field
};

struct Orientations {
  bool rowwise = true;
  bool colwise = false;
};

inline constexpr uint64_t kColwiseStreamBit = 1ull << 63;

struct QuantizeOptions {
  std::string_view tensor_name = "tensor";  // appears in every error about this tensor
  RandomStream sr{};                        // stochastic rounding draws (see above)
};

// One orientation of a quantized tensor (see the storage table above).
struct QuantizedData {
  Tensor data;
  Tensor scales;
  Tensor amax;  // f32 [1]: NVFP4 global amax, FP8 tensor amax; empty otherwise
  int64_t rows = 0, cols = 0;  // stored matrix [R, C]
};

struct QuantizedTensor {
  QuantConfig config;
  int64_t rows = 0, cols = 0;  // the source matrix [M, K]
  std::optional<QuantizedData> rowwise;  // stored [M, K]
  std::optional<QuantizedData> colwise;  // stored [K, M]
  Device device = Device::kCpu;
};

// Allocates the outputs (uninitialised) for `src_rows x src_cols` on `device`.
QuantizedTensor allocate_quantized(const QuantConfig& config, int64_t src_rows, int64_t src_cols,
                                   Orientations orientations, Device device);

// ---- CPU reference (naive loops; the ground truth for tests) --------------------------------
// src: f32 or bf16, contiguous, on the CPU.
QuantizedTensor quantize_reference(const TensorView& src, const QuantConfig& config,
                                   Orientations orientations, const QuantizeOptions& options);
// The same with the column-wise copy's draws from exactly `colwise_sr` (instead of
// options.sr.stream ^ kColwiseStreamBit). 1D blocks only (a 2D column-wise copy is the transpose
// of the row-wise one).
QuantizedTensor quantize_reference(const TensorView& src, const QuantConfig& config,
                                   Orientations orientations, const QuantizeOptions& options,
                                   RandomStream colwise_sr);

// Dequantizes one orientation to f32 [R, C] in its stored layout (column-wise: transposed, and in
// the Hadamard domain when RHT was applied).
Tensor dequantize_reference(const QuantizedTensor& q, bool colwise);

// Dequantizes one orientation back to the source layout f32 [M, K]: transposes the column-wise
// copy and undoes its Hadamard transform. What error and bias are measured on.
Tensor dequantize_to_source_reference(const QuantizedTensor& q, bool colwise);

// "Scaled-domain" BF16 values that the exact Hopper GEMM emulation consumes, [R, C] stored layout:
// NVFP4 e2m1 * s_b and MXFP8 P * 2^(k-127) (both exact in BF16; MXFP8 scale codes outside
// [3, 246] are rejected), FP8 q * decode scale (exact with power-of-two scales). The per-tensor
// factor that remains (NVFP4: the global decode scale) is returned by global_decode_scale().
Tensor dequantize_bf16_scaled_reference(const QuantizedTensor& q, bool colwise);

// NVFP4: A * f32(1 / C) (the factor applied after a GEMM over scaled-domain operands); 1 for the
// other formats. Reads the amax from host memory. With nvfp4_row_amax, `row` selects the row's
// amax (for a per-tensor amax it is ignored).
float global_decode_scale(const QuantizedTensor& q, bool colwise, int64_t row = 0);

// Applies the 16-point RHT along the last dimension of an f32 [R, C] host matrix (C % 16 == 0),
// in place, rounding to BF16 like the quantizer does; `inverse` undoes it (FP32, no rounding).
void rht_reference(float* data, int64_t rows, int64_t cols, uint16_t sign_mask, bool inverse);

// Throws fourbit::Error naming `tensor_name` and the first non-finite element, if any.
void check_finite_reference(const TensorView& src, std::string_view tensor_name);

// ---- CUDA (quantize_cuda.cu) -----------------------------------------------------------------
#if defined(FOURBIT_WITH_CUDA)
struct CudaQuantizeOptions {
  std::string_view tensor_name = "tensor";
  RandomStream sr{};
  // The column-wise copy's draws exactly (default: sr.stream ^ kColwiseStreamBit); 1D blocks only.
  std::optional<RandomStream> colwise_sr;
  // If set, the global amax (row-wise, column-wise post-RHT) is taken from these device scalars
  // instead of being computed by an extra pass over the source (e.g. produced by the previous op).
  // Not with nvfp4_row_amax (its per-row amaxes are always computed here). given_colwise_amax is
  // read only when the column-wise copy has RHT (required then); without RHT both copies take
  // given_rowwise_amax.
  const float* given_rowwise_amax = nullptr;
  const float* given_colwise_amax = nullptr;
  // Non-finite inputs set this device flag (int32); when null, quantize_cuda synchronizes and
  // throws naming the tensor. Training passes a monitor that is checked once per step.
  int* nonfinite_flag = nullptr;
  // Also (or only) write the scaled-domain BF16 values for the exact GEMM emulation. An
  // orientation whose QuantizedData::data is an undefined Tensor is never written packed (its BF16
  // copy must then be requested): e.g. a row-wise copy only for this GEMM, a column-wise one kept.
  bool write_packed = true;
  bool write_bf16_scaled = false;
  void* stream = nullptr;  // cudaStream_t
};

// Fused quantization of a device tensor (f32 or bf16 [M, K]) into `out` (allocated with
// allocate_quantized on the device). One pass over the source writes every requested orientation
// (plus one amax pass for NVFP4 and FP8-tensor unless the amax is given).
// bf16_rowwise / bf16_colwise: optional outputs for write_bf16_scaled, bf16 [M, K] / [K, M].
void quantize_cuda(const TensorView& src, QuantizedTensor& out, const CudaQuantizeOptions& options,
                   const TensorView* bf16_rowwise = nullptr, const TensorView* bf16_colwise = nullptr);

// Global amax of the source (row-wise) and of its column-wise RHT (if `rht_sign_mask` is used),
// into device scalars; sets *nonfinite_flag if any input is NaN/Inf.
void amax_cuda(const TensorView& src, float* rowwise_amax, float* colwise_amax, bool colwise_rht,
               uint16_t rht_sign_mask, int* nonfinite_flag, void* stream);

// How amax_cuda's fast kernels combine their CTAs' maxima: 0 zeroes the outputs first (a fill
// launch each) and maxes into them with atomics; 1 takes a per-stream ticket and lets the last CTA
// write them (no fills; session 28, not yet the default: FOURBIT_QUANT_AMAX_TICKET=1 turns it on);
// -1 (the start) follows the environment. The same bits either way. For A/B runs and tests.
void set_amax_reduction(int mode);

// Dequantizes one orientation on the device to f32 [R, C] (stored layout).
void dequantize_cuda(const QuantizedTensor& q, bool colwise, const TensorView& out, void* stream);

// Fills a contiguous f32 or bf16 CUDA tensor with seeded standard-normal values (Philox +
// Box-Muller, on the GPU): benchmark and test inputs.
void fill_normal_cuda(const TensorView& dst, uint64_t seed, void* stream);
#endif

}  // namespace fourbit::quant
