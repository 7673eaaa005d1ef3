// Launch interface of the KV-cache append kernel (kv_cache_kernels.cu), used by model.cpp. Plain
// arguments only (nvcc compiles the .cu; it includes no fmt); the host side validates.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fourbit::model::kernels {

// For every row n of the fused QKV buffer with write_pos[n] >= 0 (b = n / rows_per_seq):
//   k_cache[b, write_pos[n], :] = qkv[n, k_col : k_col + width]
//   v_cache[b, write_pos[n], :] = qkv[n, v_col : v_col + width]
// qkv: bf16 [n_rows, row_stride]; caches: bf16 [B, t_max, width]; write_pos: i32 [n_rows], each
// < t_max or negative (skipped).
void launch_kv_cache_append(const uint16_t* qkv, int64_t row_stride, int64_t k_col, int64_t v_col,
                            int64_t width, const int32_t* write_pos, int64_t n_rows,
                            int64_t rows_per_seq, uint16_t* k_cache, uint16_t* v_cache,
                            int64_t t_max, cudaStream_t stream);

}  // namespace fourbit::model::kernels
