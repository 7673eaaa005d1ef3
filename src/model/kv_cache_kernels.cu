// The KV-cache append kernel (kv_cache_kernels.h): one CTA per token row copies the row's key and
// value slices of the fused QKV buffer into the caches. Bandwidth is negligible next to the
// decode attention that reads the whole cache, so the copy is a plain strided loop.
#include "core/error.h"
#include "core/pdl.cuh"
#include "model/kv_cache_kernels.h"

namespace fourbit::model::kernels {

namespace {

__global__ void kv_cache_append_kernel(const uint16_t* __restrict__ qkv, int64_t row_stride,
                                       int64_t k_col, int64_t v_col, int64_t width,
                                       const int32_t* __restrict__ write_pos, int64_t rows_per_seq,
                                       uint16_t* __restrict__ k_cache, uint16_t* __restrict__ v_cache,
                                       int64_t t_max) {
  core::pdl_allow_dependents();
  core::pdl_wait_for_producer();  // launched with PDL (core/pdl.cuh): nothing is read before this
  const int64_t n = blockIdx.x;
  const int32_t pos = write_pos[n];
  if (pos < 0 || pos >= t_max) return;
  const int64_t b = n / rows_per_seq;
  const uint16_t* src = qkv + n * row_stride;
  const int64_t dst = (b * t_max + pos) * width;
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    k_cache[dst + i] = src[k_col + i];
    v_cache[dst + i] = src[v_col + i];
  }
}

}  // namespace

void launch_kv_cache_append(const uint16_t* qkv, int64_t row_stride, int64_t k_col, int64_t v_col,
                            int64_t width, const int32_t* write_pos, int64_t n_rows,
                            int64_t rows_per_seq, uint16_t* k_cache, uint16_t* v_cache,
                            int64_t t_max, cudaStream_t stream) {
  if (n_rows == 0) return;
  FOURBIT_CUDA_CHECK(core::launch_pdl(kv_cache_append_kernel, dim3((unsigned)n_rows), dim3(128), 0, stream, qkv,
                                      row_stride, k_col, v_col, width, write_pos, rows_per_seq, k_cache, v_cache,
                                      t_max));
  FOURBIT_CUDA_CHECK_LAUNCH();
}

}  // namespace fourbit::model::kernels
