// Internal interface between the host side of the CUDA GEMM backends (gemm_cublaslt.cpp, compiled
// by the C++ compiler) and the small kernels they launch (gemm_kernels.cu, compiled by nvcc):
// operand conversions and epilogue scalars. Plain structs and launch functions only; validation
// and error messages live on the host side.
#pragma once

#include "gemm/fp8_scale_layout.h"
#include "quant/format.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fourbit::gemm::kernels {

// Bits OR-ed into GemmArgs::error_flag: the quantizers' (quant/format.h), so that one device flag
// serves quantizers and GEMMs.
inline constexpr int kErrMxfp8NotExact = quant::kDeviceErrMxfp8NotExact;

// NVFP4 / MXFP8 stored [rows, cols] -> scaled-domain BF16 [rows, cols] (contiguous): NVFP4
// e2m1 * s_b, MXFP8 P * 2^(k-127), both exact. An MXFP8 element with a nonzero code in a block whose
// scale code lies outside [3, 246] is not exact in BF16: it becomes NaN and kErrMxfp8NotExact is
// set in *error_flags.
struct ScaledBf16Params {
  quant::Format format;       // kNvfp4 or kMxfp8
  const uint8_t* data;        // packed e2m1x2 (ceil(cols / 2) bytes per row) or e4m3 [rows, cols]
  const uint8_t* scales;      // e4m3 [rows, ceil(cols / 16)] or e8m0 [rows, ceil(cols / 32)]
  int64_t rows, cols;
  uint16_t* out;              // bf16 [rows, cols]
  int* error_flags;           // device int
};
void launch_scaled_bf16(const ScaledBf16Params& p, cudaStream_t stream);

// The quantizer's FP8 block scales -> cuBLAS's layout (fp8_scale_layout.h), dst: device floats,
// cublas_fp8_scale_count(...) of them.
void launch_fp8_block_scales(const Fp8BlockScaleSlice& slice, float* dst, cudaStream_t stream);

// Device scalars {alpha_eff, beta} for CUBLASLT_POINTER_MODE_DEVICE:
//   alpha_eff = f32(f32(alpha * d_a) * d_b), d_x = nvfp4_global_decode_scale(*amax_x, constant_x)
// for an NVFP4 operand, 1 for any other (amax_x null).
struct EpilogueScalarParams {
  float alpha, beta;
  const float* amax_a;  // NVFP4 global amax of A's copy (device), or null
  float constant_a;
  const float* amax_b;
  float constant_b;
  float* out;  // device float[2]
};
void launch_epilogue_scalars(const EpilogueScalarParams& p, cudaStream_t stream);

// The epilogue of an emulated GEMM whose A carries one NVFP4 global amax per row
// (QuantConfig::nvfp4_row_amax): cuBLASLt wrote the raw FP32 sums acc [rows, cols] (alpha 1,
// beta 0), and row m of C becomes
//   alpha_eff_m = f32(f32(alpha * d_a[m]) * d_b),  C[m, n] = f32(alpha_eff_m * acc[m, n]) (+ beta * c_source)
// with d_a[m] = nvfp4_global_decode_scale(amax_a[m], constant_a) and d_b from B's amax (1 when
// null): the operations of the per-tensor epilogue (launch_epilogue_scalars), row by row, and those
// of the decode GEMV (decode_gemv.h), so the sampler's decode passes and the trainer's forward
// apply the same factor. With beta != 0, C = f32(f32(alpha_eff_m * acc) + f32(beta * C)).
struct RowScaledEpilogueParams {
  const float* acc;      // f32 [rows, cols], contiguous
  int64_t rows, cols;
  const float* amax_a;   // device, [rows] (already offset to the group's first row)
  float constant_a;
  const float* amax_b;   // device scalar or null
  float constant_b;
  float alpha, beta;
  void* c;               // f32 or bf16 [rows, cols], row stride ldc
  const void* c_source;  // the beta term's matrix (C itself, or another with C's layout)
  bool c_bf16;
  int64_t ldc;
};
void launch_row_scaled_epilogue(const RowScaledEpilogueParams& p, cudaStream_t stream);

// C <- beta * C for a bf16 or f32 matrix [rows, cols] with row stride ld (beta == 0 writes zeros
// without reading C): the result of a GEMM over an empty reduction.
void launch_scale_matrix(void* c, bool bf16, int64_t rows, int64_t cols, int64_t ld, float beta,
                         cudaStream_t stream);

}  // namespace fourbit::gemm::kernels
