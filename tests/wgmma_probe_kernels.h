// Launcher of the single-wgmma probe kernels (wgmma_probe_kernels.cu) for
// test_ops_attention_wgmma_cuda. Device pointers; N = 32, 64 or 128. Synchronizes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fourbit::testing {

// a: bf16 [64, 64]; b_nk: bf16 [N, 64]; b_kn: bf16 [64, N]; d_ss = a b_nk^T and d_rs = a b_kn,
// f32 [64, N], all row-major.
// d_rs is written only for N >= 64 (see the kernels' file).
cudaError_t run_wgmma_probe(int n, const uint16_t* a, const uint16_t* b_nk, const uint16_t* b_kn, float* d_ss,
                            float* d_rs);

}  // namespace fourbit::testing
