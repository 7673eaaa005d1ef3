// TMA tensor maps for the FP8 GEMM kernel (contract: tensor_map.h).
#include "gemm/tensor_map.h"

#include "core/check.h"
#include "core/error.h"

#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

namespace fourbit::gemm {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    FOURBIT_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found));
    FOURBIT_CHECK(found == cudaDriverEntryPointSuccess && f != nullptr,
                  "the CUDA driver has no cuTensorMapEncodeTiled (query result {}): the FP8 block GEMM "
                  "needs a driver for CUDA 12 or newer", (int)found);
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

}  // namespace

CUtensorMap e4m3_tile_map(const uint8_t* base, int64_t rows, int64_t k, int64_t ld, int box_k, int box_rows,
                          const char* operand) {
  FOURBIT_CHECK(box_k == 128 && box_rows >= 1 && box_rows <= 256,
                "e4m3_tile_map: a 128-byte-swizzled box is 128 bytes wide and at most 256 rows (got {} x {})",
                box_k, box_rows);
  CUtensorMap map{};
  const cuuint64_t dims[2] = {(cuuint64_t)k, (cuuint64_t)rows};
  const cuuint64_t strides[1] = {(cuuint64_t)ld};
  const cuuint32_t box[2] = {(cuuint32_t)box_k, (cuuint32_t)box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<uint8_t*>(base), dims,
                                          strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                          CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  FOURBIT_CHECK(r == CUDA_SUCCESS,
                "fp8 block GEMM: cuTensorMapEncodeTiled failed (CUresult {}) for operand {} [{}, {}] with row "
                "stride {} bytes at {}: the rows need 16-byte alignment and a stride that is a multiple of 16",
                (int)r, operand, rows, k, ld, (const void*)base);
  return map;
}

}  // namespace fourbit::gemm
