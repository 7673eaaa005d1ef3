// Internal interface of fourbit's own Hopper FP8 GEMM for two 1x128-block-scaled operands
// (Backend::kWgmmaFp8, fp8_wgmma_kernels.cu): the DeepSeek-V3 Wgrad product dW = dY^T X, whose two
// operands both carry one FP32 decode scale per 128 elements of the reduction.
//
//   C[m, n] = alpha * sum_l sa[l][m] * sb[l][n] * (sum_{k in block l} A[m, k] * B[n, k]) + beta * S[m, n]
//
// A [M, K] and B [N, K] are E4M3 with K contiguous (row strides a_ld, b_ld bytes); sa [L][M] and
// sb [L][N] (L = ceil(K / 128)) are the decode scales in cuBLAS's VEC128_32F layout
// (fp8_scale_layout.h, the same conversion the cuBLASLt path runs). Each 128-long block's partial
// sums come from the FP8 tensor cores in FP32 registers and are promoted into separate FP32
// accumulators, scaled by sa * sb, once per block (NUMERICS.md 6: "promoted at least every 128").
// C and S are f32 or bf16 [M, N] with row stride ldc; S is read only when beta != 0 and may be C.
//
// Requirements (checked on the host, gemm_cublaslt.cpp, with messages naming the operand): K and
// the row strides multiples of 16 bytes, A, B 16-byte aligned (TMA), M and N multiples of 4 and
// the scale arrays 16-byte aligned (bulk copies of the scale rows), M, N, K below 2^31, an sm_90
// GPU.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fourbit::gemm::kernels {

struct Fp8Block1dGemmParams {
  const uint8_t* a = nullptr;  // e4m3 [M, K], row stride a_ld bytes
  int64_t a_ld = 0;
  const uint8_t* b = nullptr;  // e4m3 [N, K], row stride b_ld bytes
  int64_t b_ld = 0;
  const float* scales_a = nullptr;  // [L][M]
  const float* scales_b = nullptr;  // [L][N]
  int64_t m = 0, n = 0, k = 0;
  void* c = nullptr;               // f32 or bf16 [M, N], row stride ldc elements
  const void* c_source = nullptr;  // the beta term's matrix (C's layout); C itself when null
  int64_t ldc = 0;
  bool c_bf16 = false;
  float alpha = 1.0f, beta = 0.0f;
};

void launch_fp8_block1d_gemm(const Fp8Block1dGemmParams& p, cudaStream_t stream);

}  // namespace fourbit::gemm::kernels
