// The FP32 block-scale layouts that cuBLASLt's Hopper FP8 block-scaled GEMMs read, and the
// conversion from the quantizer's layout, as index functions shared by the CUDA kernel
// (gemm_kernels.cu) and its CPU reference (convert_fp8_block_scales_reference below).
//
// Source: cuBLAS documentation, "128-element 1D and 128x128 2D Block Scaling For FP8 Data Types /
// Scaling factors layouts" (cuBLAS 12.9+; NUMERICS.md 7.1): for an operand with R rows (M for A, N
// for B) and L = ceil(K / 128) blocks along K,
//   VEC128_32F (1x128):     R-major [L][R]: scale (r, l) at l * R + r; R must be a multiple of 4.
//   BLK128x128_32F (2D):    K-major [ceil(R / 128)][L4], L4 = roundup(L, 4): scale (p, l) at
//                           p * L4 + l; the padding columns are written as zero.
// Starting addresses must be 16-byte aligned. The quantizer stores (quant/quantize.h) 1x128 decode
// scales row-major [R_q, L_q] and 128x128 as [ceil(R_q / 128), L_q]. A GEMM may read a sub-block
// of a stored operand (a group of a grouped GEMM): rows [row0, row0 + R), K blocks
// [block0, block0 + L) of the stored scale matrix, with row0 a multiple of 128 for 2D scales.
#pragma once

#include "core/hd.h"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fourbit::gemm {

inline constexpr int64_t kFp8ScaleBlock = 128;

struct Fp8BlockScaleSlice {
  const float* src = nullptr;  // the quantizer's scales, row-major, src_ld floats per row
  int64_t src_ld = 0;
  bool block_2d = false;
  int64_t row0 = 0, rows = 0;      // operand rows of the slice (R); 2D: row0 % 128 == 0
  int64_t block0 = 0, blocks = 0;  // K blocks of the slice (L)
};

FOURBIT_HD int64_t fp8_round_up4(int64_t x) { return (x + 3) / 4 * 4; }

// Number of floats of the cuBLAS layout for a slice.
FOURBIT_HD int64_t cublas_fp8_scale_count(bool block_2d, int64_t rows, int64_t blocks) {
  return block_2d ? (rows + kFp8ScaleBlock - 1) / kFp8ScaleBlock * fp8_round_up4(blocks)
                  : blocks * rows;
}

// The value at position i of the cuBLAS layout (0 for padding).
FOURBIT_HD float cublas_fp8_scale_at(const Fp8BlockScaleSlice& s, int64_t i) {
  if (s.block_2d) {
    const int64_t padded = fp8_round_up4(s.blocks);
    const int64_t p = i / padded, l = i % padded;
    if (l >= s.blocks) return 0.0f;
    return s.src[(s.row0 / kFp8ScaleBlock + p) * s.src_ld + s.block0 + l];
  }
  const int64_t l = i / s.rows, r = i % s.rows;
  return s.src[(s.row0 + r) * s.src_ld + s.block0 + l];
}

// CPU reference of the conversion (host scales).
inline std::vector<float> convert_fp8_block_scales_reference(const Fp8BlockScaleSlice& s) {
  std::vector<float> out((std::size_t)cublas_fp8_scale_count(s.block_2d, s.rows, s.blocks));
  for (int64_t i = 0; i < (int64_t)out.size(); ++i) out[(std::size_t)i] = cublas_fp8_scale_at(s, i);
  return out;
}

}  // namespace fourbit::gemm
