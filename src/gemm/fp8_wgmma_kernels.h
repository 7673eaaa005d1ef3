// Internal interface of fourbit's own Hopper FP8 GEMM for block-scaled operands (Backend::kWgmmaFp8,
// fp8_wgmma_kernels.cu): A with 1x128 blocks, B with 1x128 blocks (the DeepSeek-V3 Wgrad product
// dW = dY^T X) or 128x128 blocks (Fprop X W^T, Dgrad dY W).
//
//   C[m, n] = alpha * sum_l sa[l][m] * sb(l, n) * (sum_{k in block l} A[m, k] * B[n, k]) + beta * S[m, n]
//
// A [M, K] and B [N, K] are E4M3 with K contiguous (row strides a_ld, b_ld bytes); L = ceil(K / 128).
// The decode scales come in cuBLAS's layouts (fp8_scale_layout.h, the same conversion the cuBLASLt
// path runs): sa [L][M] (VEC128_32F); sb(l, n) = scales_b[l * N + n] for 1x128 B (VEC128_32F), or
// scales_b[(n / 128) * scales_b_ld + l] for 128x128 B (BLK128x128_32F, scales_b_ld = roundup(L, 4)). Each 128-long block's partial
// sums come from the FP8 tensor cores in FP32 registers and are promoted into separate FP32
// accumulators, scaled by sa * sb, once per block (NUMERICS.md 6: "promoted at least every 128").
// C and S are f32 or bf16 [M, N] with row stride ldc; S is read only when beta != 0 and may be C.
//
// Requirements (checked on the host, gemm.cpp and gemm_cublaslt.cpp, with messages naming the
// operand): K and the row strides multiples of 16 bytes, A and B 16-byte aligned (TMA), M and N
// multiples of 4 and the scale arrays 16-byte aligned (bulk copies of the scale rows), M, N and K
// below 2^31, K > 0 (an empty reduction is the caller's: gemm_cublaslt.cpp writes beta * C), an
// sm_90 GPU.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fourbit::gemm::kernels {

struct Fp8BlockGemmParams {
  const uint8_t* a = nullptr;  // e4m3 [M, K], row stride a_ld bytes
  int64_t a_ld = 0;
  const uint8_t* b = nullptr;  // e4m3 [N, K], row stride b_ld bytes
  int64_t b_ld = 0;
  const float* scales_a = nullptr;  // [L][M]
  const float* scales_b = nullptr;  // [L][N], or [ceil(N / 128)][scales_b_ld] when b_2d
  bool b_2d = false;
  int64_t scales_b_ld = 0;
  int64_t m = 0, n = 0, k = 0;
  void* c = nullptr;               // f32 or bf16 [M, N], row stride ldc elements
  const void* c_source = nullptr;  // the beta term's matrix (C's layout); C itself when null
  int64_t ldc = 0;
  bool c_bf16 = false;
  float alpha = 1.0f, beta = 0.0f;
};

void launch_fp8_block_gemm(const Fp8BlockGemmParams& p, cudaStream_t stream);

// The kernel's tile shape and grid, for tests and A/B runs (0: the default). block_n: 128 or 256
// columns per CTA (default 256 when N > 128); cluster_m: 1 or 2 CTAs along M sharing each B tile
// by TMA multicast; ctas: the persistent grid's size (default: as many CTAs as can be resident,
// each walking tiles first, first + grid, ...; -1: one CTA per tile; n > 0: at most n, which the
// tests use to make every CTA take several tiles). Process-wide; replaces FOURBIT_GEMM_FP8_BN,
// FOURBIT_GEMM_FP8_CLUSTER and FOURBIT_GEMM_FP8_CTAS, which are read at the first launch when this
// was never called.
struct Fp8BlockGemmShape {
  int block_n = 0;
  int cluster_m = 0;
  int ctas = 0;
};
void set_fp8_block_gemm_shape(const Fp8BlockGemmShape& shape);

}  // namespace fourbit::gemm::kernels
