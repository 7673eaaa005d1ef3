// RoPE kernels. The rotation: grid-stride over tokens; per token the CTA evaluates the D/2 (cos, sin) pairs into
// shared memory (the FP32 recipe of rope.h; the frequencies come precomputed in RopeArgs), then rotates every (head, 8-pair group) item of q and
// k. A thread reads the 8 low and 8 high elements of its pairs and writes them back rotated, so
// out may equal in. The (cos, sin) table of the decode GEMV's RoPE epilogue: one pair a thread.
#include "ops/rope_kernels.h"

#include "core/error.h"
#include "ops/kernel_support.cuh"
#include "core/rope_math.cuh"

namespace fourbit::ops::kernels {
namespace {

constexpr int kThreads = 128;

template <typename T>
__global__ void rope_kernel(RopeArgs a) {
  __shared__ float cos_s[kRopeMaxHeadDim / 2], sin_s[kRopeMaxHeadDim / 2];
  core::pdl_allow_dependents();
  core::pdl_wait_for_producer();  // launched with PDL (core/pdl.cuh): nothing is read before this
  const int half = a.head_dim / 2;
  const int groups = (half + 7) / 8;
  const int heads = a.q_in.heads + a.k_in.heads;
  for (int64_t n = blockIdx.x; n < a.n_rows; n += gridDim.x) {
    // The cache row of token n (append only): batch n / rows_per_seq at position write_pos[n].
    const int32_t wp = a.k_cache != nullptr ? a.write_pos[n] : -1;
    const bool append = wp >= 0 && wp < a.t_max;
    const int64_t cache_row = append ? ((n / a.rows_per_seq) * a.t_max + wp) * (int64_t)a.k_in.heads * a.head_dim : 0;
    __syncthreads();  // the previous token's items are done with cos_s / sin_s
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
      core::rope_cos_sin(a.positions[n], a.inv_freq[i], a.inverse, cos_s[i], sin_s[i]);
    }
    __syncthreads();
    for (int it = threadIdx.x; it < heads * groups; it += blockDim.x) {
      const int h = it / groups, c = (it % groups) * 8;
      const bool is_q = h < a.q_in.heads;
      const RopeTensor& in = is_q ? a.q_in : a.k_in;
      const RopeTensor& out = is_q ? a.q_out : a.k_out;
      const int hh = is_q ? h : h - a.q_in.heads;
      const T* in_lo = static_cast<const T*>(in.data) + n * in.stride_n + hh * in.stride_h;
      T* out_lo = static_cast<T*>(out.data) + n * out.stride_n + hh * out.stride_h;
      const T* in_hi = in_lo + half;
      T* out_hi = out_lo + half;
      const bool vec = is_aligned16(in_lo) && is_aligned16(in_hi) && is_aligned16(out_lo) &&
                       is_aligned16(out_hi);
      float lo[8], hi[8];
      load8(in_lo, c, half, vec, lo);
      load8(in_hi, c, half, vec, hi);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const int i = min(c + k, half - 1);  // past the ragged end: any valid pair, not stored
        core::rope_rotate(lo[k], hi[k], cos_s[i], sin_s[i]);
      }
      store8(out_lo, c, half, vec, lo);
      store8(out_hi, c, half, vec, hi);
      if (!is_q && append) {  // the rotated key into the cache as well
        T* cache_lo = static_cast<T*>(a.k_cache) + cache_row + (int64_t)hh * a.head_dim;
        T* cache_hi = cache_lo + half;
        const bool cvec = is_aligned16(cache_lo) && is_aligned16(cache_hi);
        store8(cache_lo, c, half, cvec, lo);
        store8(cache_hi, c, half, cvec, hi);
      }
    }
    if (append) {  // the values, copied
      const int vgroups = (a.head_dim + 7) / 8;
      for (int it = threadIdx.x; it < a.v_in.heads * vgroups; it += blockDim.x) {
        const int h = it / vgroups, c = (it % vgroups) * 8;
        const T* src = static_cast<const T*>(a.v_in.data) + n * a.v_in.stride_n + h * a.v_in.stride_h;
        T* dst = static_cast<T*>(a.v_cache) + cache_row + (int64_t)h * a.head_dim;
        const bool vvec = is_aligned16(src) && is_aligned16(dst);
        float v[8];
        load8(src, c, a.head_dim, vvec, v);
        store8(dst, c, a.head_dim, vvec, v);
      }
    }
  }
}

__global__ void rope_table_kernel(RopeTableArgs a) {
  core::pdl_allow_dependents();
  core::pdl_wait_for_producer();  // the positions may come from an earlier kernel
  const int half = a.head_dim / 2;
  const int64_t total = a.n_rows * half;
  for (int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; j < total; j += (int64_t)gridDim.x * blockDim.x) {
    float c, s;
    core::rope_cos_sin(a.positions[j / half], a.inv_freq[j % half], false, c, s);
    a.table[2 * j] = c;
    a.table[2 * j + 1] = s;
  }
}

}  // namespace

void launch_rope_table(const RopeTableArgs& a, cudaStream_t stream) {
  const int64_t total = a.n_rows * (a.head_dim / 2);
  if (total == 0) return;
  const unsigned grid = grid_for(total, kThreads);
  FOURBIT_CUDA_CHECK(core::launch_pdl(rope_table_kernel, dim3(grid), dim3(kThreads), 0, stream, a));
  FOURBIT_CUDA_CHECK_LAUNCH();
}

void launch_rope(const RopeArgs& a, cudaStream_t stream) {
  if (a.n_rows == 0 || a.q_in.heads + a.k_in.heads == 0) return;
  const unsigned grid = grid_for(a.n_rows, 1);
  with_float_type(a.type, [&](auto t) {
    using T = decltype(t);
    FOURBIT_CUDA_CHECK(core::launch_pdl(rope_kernel<T>, dim3(grid), dim3(kThreads), 0, stream, a));
  });
  FOURBIT_CUDA_CHECK_LAUNCH();
}

}  // namespace fourbit::ops::kernels
