// TMA tensor maps (CUtensorMap) for the FP8 GEMM kernel (fp8_wgmma_kernels.cu): built on the host
// through the driver's cuTensorMapEncodeTiled, which is found once through the CUDA runtime
// (cudaGetDriverEntryPointByVersion), so that fourbit needs no link to libcuda.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace fourbit::gemm {

// The map of an E4M3 (byte) matrix [rows, k] with row stride ld bytes, read in boxes of box_k x
// box_rows elements, 128-byte swizzled (box_k must be 128: one swizzle row), elements outside the
// matrix read as zero. Throws, naming the operand, if the driver refuses it (base not 16-byte
// aligned, ld not a multiple of 16).
CUtensorMap e4m3_tile_map(const uint8_t* base, int64_t rows, int64_t k, int64_t ld, int box_k, int box_rows,
                          const char* operand);

}  // namespace fourbit::gemm
