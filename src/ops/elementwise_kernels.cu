// Elementwise kernels: add, cast, non-finite detection. Flat arrays, grid-stride loops, 8 elements
// per thread and step (16-byte accesses when every pointer is 16-byte aligned, else scalar).
#include "ops/elementwise_kernels.h"

#include "core/error.h"
#include "ops/error_flags.h"
#include "ops/kernel_support.cuh"
#include "ops/output_amax.cuh"

namespace fourbit::ops::kernels {
namespace {

constexpr int kThreads = 256;

// No __restrict__: out may alias a (add_inplace).
template <typename TO, typename TA, typename TB>
__global__ void add_kernel(TO* out, const TA* a, const TB* b, int64_t n, bool vec) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x * 8;
  for (int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 8; i < n; i += stride) {
    float va[8], vb[8];
    load8(a, i, n, vec, va);
    load8(b, i, n, vec, vb);
#pragma unroll
    for (int k = 0; k < 8; ++k) va[k] = __fadd_rn(va[k], vb[k]);
    store8(out, i, n, vec, va);
  }
}

// a += b on bf16 [n_rows, cols] (n_rows % 16 == 0, cols even, 4-byte aligned), also accumulating
// the amaxes of the result (output_amax.cuh). No __restrict__ on a: read and written.
__global__ void __launch_bounds__(kAmaxThreads, 2) add_inplace_amax_kernel(bf16_t* a, const bf16_t* __restrict__ b,
                                                                        int64_t n_rows, int64_t cols,
                                                                        OutputAmaxes out) {
  amax_strip_loop<1>(n_rows, cols, out, [&](int64_t r0, int64_t c, float (&v)[1][2][kStripRows]) {
    uint32_t wa[kStripRows], wb[kStripRows];
#pragma unroll
    for (int i = 0; i < kStripRows; ++i) {  // every load before the first (in-place) store
      wa[i] = load_word(a + (r0 + i) * cols + c);
      wb[i] = load_word(b + (r0 + i) * cols + c);
    }
#pragma unroll
    for (int i = 0; i < kStripRows; ++i) {
      v[0][0][i] = __fadd_rn(lo_of(wa[i]), lo_of(wb[i]));  // add_kernel's arithmetic
      v[0][1][i] = __fadd_rn(hi_of(wa[i]), hi_of(wb[i]));
      store_pair(a + (r0 + i) * cols + c, v[0][0][i], v[0][1][i]);
    }
  });
}

template <typename TO, typename TI>
__global__ void cast_kernel(TO* __restrict__ out, const TI* __restrict__ x, int64_t n, bool vec) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x * 8;
  for (int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 8; i < n; i += stride) {
    float v[8];
    load8(x, i, n, vec, v);
    store8(out, i, n, vec, v);
  }
}

template <typename T>
__global__ void nonfinite_kernel(const T* __restrict__ x, int64_t n, bool vec, int* flag,
                                 NonFiniteCounts* counts) {
  unsigned long long nans = 0, infs = 0, first = ~0ull;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x * 8;
  for (int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 8; i < n; i += stride) {
    float v[8];
    load8(x, i, n, vec, v);  // BF16 NaN/Inf decode to FP32 NaN/Inf; padding reads as 0
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const bool is_nan = isnan(v[k]), is_inf = isinf(v[k]);
      nans += is_nan;
      infs += is_inf;
      if ((is_nan || is_inf) && first == ~0ull) first = (unsigned long long)(i + k);
    }
  }
  // Only the (rare) threads that found something touch global memory; integer atomics, so the
  // result does not depend on their order.
  if (nans + infs == 0) return;
  if (flag) atomicOr(flag, kErrNonFinite);
  if (counts) {
    atomicAdd(&counts->nan_count, nans);
    atomicAdd(&counts->inf_count, infs);
    atomicMin(&counts->first_index, first);
  }
}

bool all_aligned(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (!is_aligned16(p)) return false;
  return true;
}

}  // namespace

void launch_add_inplace_amax(void* a, const void* b, int64_t n_rows, int64_t cols,
                             const OutputAmaxes& amaxes, cudaStream_t stream) {
  if (n_rows == 0 || cols == 0) return;
  add_inplace_amax_kernel<<<amax_strip_grid(n_rows, cols), kAmaxThreads, 0, stream>>>(
      static_cast<bf16_t*>(a), static_cast<const bf16_t*>(b), n_rows, cols, amaxes);
  FOURBIT_CUDA_CHECK_LAUNCH();
}

void launch_add(void* out, FloatType out_type, const void* a, FloatType a_type, const void* b,
                FloatType b_type, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  const bool vec = all_aligned({out, a, b});
  const unsigned grid = grid_for((n + 7) / 8, kThreads);
  with_float_type(out_type, [&](auto to) {
    with_float_type(a_type, [&](auto ta) {
      with_float_type(b_type, [&](auto tb) {
        using TO = decltype(to);
        using TA = decltype(ta);
        using TB = decltype(tb);
        add_kernel<TO, TA, TB><<<grid, kThreads, 0, stream>>>(
            static_cast<TO*>(out), static_cast<const TA*>(a), static_cast<const TB*>(b), n, vec);
      });
    });
  });
  FOURBIT_CUDA_CHECK_LAUNCH();
}

void launch_cast(void* out, FloatType out_type, const void* x, FloatType x_type, int64_t n,
                 cudaStream_t stream) {
  if (n == 0) return;
  const bool vec = all_aligned({out, x});
  const unsigned grid = grid_for((n + 7) / 8, kThreads);
  with_float_type(out_type, [&](auto to) {
    with_float_type(x_type, [&](auto ti) {
      using TO = decltype(to);
      using TI = decltype(ti);
      cast_kernel<TO, TI><<<grid, kThreads, 0, stream>>>(static_cast<TO*>(out),
                                                         static_cast<const TI*>(x), n, vec);
    });
  });
  FOURBIT_CUDA_CHECK_LAUNCH();
}

void launch_nonfinite(const void* x, FloatType x_type, int64_t n, int* flag,
                      NonFiniteCounts* counts, cudaStream_t stream) {
  if (n == 0) return;
  const bool vec = is_aligned16(x);
  const unsigned grid = grid_for((n + 7) / 8, kThreads);
  with_float_type(x_type, [&](auto t) {
    using T = decltype(t);
    nonfinite_kernel<T><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(x), n, vec, flag,
                                                       counts);
  });
  FOURBIT_CUDA_CHECK_LAUNCH();
}

}  // namespace fourbit::ops::kernels
