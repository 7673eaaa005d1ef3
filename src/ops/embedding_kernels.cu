// Embedding kernels.
//
// Forward: grid-stride over tokens, one CTA per token row, 8 columns per thread and step.
// Backward (deterministic, see embedding.h): keys_in[i] = ids[i] (V for an invalid id, flagged),
// vals_in[i] = i; a stable CUB radix sort by key over the bits needed for keys <= V; then warp w
// of the accumulate kernel takes sorted position p: if p starts a run of equal keys, the warp sums
// the dout rows of the run's tokens (in increasing token order) over its 256-column slice and
// adds the sum to dtable[key, slice]. Runs of the invalid key V are skipped.
#include "ops/embedding_kernels.h"

#include "core/error.h"
#include "ops/error_flags.h"
#include "ops/kernel_support.cuh"

#include <cub/device/device_radix_sort.cuh>

namespace fourbit::ops::kernels {
namespace {

constexpr int kAccumulateWarps = 8;  // warps per CTA of the accumulate kernel
constexpr int64_t kAlign = 256;

int64_t align_up(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

int end_bit_for(int64_t vocab) {  // bits of the largest key, V
  int bits = 1;
  while (bits < 32 && (int64_t{1} << bits) <= vocab) ++bits;
  return bits;
}

size_t cub_temp_bytes(int64_t n, int64_t vocab) {
  size_t bytes = 0;
  FOURBIT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), (int)n, 0,
      end_bit_for(vocab)));
  return bytes;
}

template <typename TO, typename TT>
__global__ void embedding_forward_kernel(TO* __restrict__ out, const int32_t* __restrict__ ids,
                                         const TT* __restrict__ table, int64_t n_tokens,
                                         int64_t vocab, int64_t cols, int* error_flag) {
  core::pdl_allow_dependents();
  core::pdl_wait_for_producer();  // launched with PDL (core/pdl.cuh): nothing is read before this
  for (int64_t n = blockIdx.x; n < n_tokens; n += gridDim.x) {
    const int32_t id = ids[n];
    TO* o = out + n * cols;
    const bool valid = id >= 0 && id < vocab;
    if (!valid && threadIdx.x == 0) atomicOr(error_flag, kErrIndexOutOfRange);
    const TT* row = table + (valid ? id : 0) * cols;
    const bool vec = is_aligned16(o) && is_aligned16(row);
    for (int64_t c = (int64_t)threadIdx.x * 8; c < cols; c += (int64_t)blockDim.x * 8) {
      float v[8];
      if (valid) {
        load8(row, c, cols, vec, v);
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = 0.0f;
      }
      store8(o, c, cols, vec, v);
    }
  }
}

__global__ void sort_input_kernel(int32_t* __restrict__ keys, int32_t* __restrict__ vals,
                                  const int32_t* __restrict__ ids, int64_t n_tokens, int64_t vocab,
                                  int* error_flag) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n_tokens;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int32_t id = ids[i];
    const bool valid = id >= 0 && id < vocab;
    if (!valid) atomicOr(error_flag, kErrIndexOutOfRange);
    keys[i] = valid ? id : (int32_t)vocab;
    vals[i] = (int32_t)i;
  }
}

template <typename T>
__global__ void __launch_bounds__(kAccumulateWarps * 32)
    embedding_accumulate_kernel(float* __restrict__ dtable, const T* __restrict__ dout,
                                const int32_t* __restrict__ keys,
                                const int32_t* __restrict__ tokens, int64_t n_tokens,
                                int64_t vocab, int64_t cols) {
  const int lane = threadIdx.x & 31;
  const int64_t p = (int64_t)blockIdx.x * kAccumulateWarps + (threadIdx.x >> 5);
  if (p >= n_tokens) return;
  const int32_t key = keys[p];
  if (key >= vocab || (p > 0 && keys[p - 1] == key)) return;  // invalid, or not a run's start
  const int64_t c = (int64_t)blockIdx.y * 256 + lane * 8;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t q = p; q < n_tokens && keys[q] == key; ++q) {
    const T* row = dout + (int64_t)tokens[q] * cols;
    float v[8];
    load8(row, c, cols, is_aligned16(row), v);
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] += v[k];
  }
  float* d = dtable + (int64_t)key * cols;
  const bool vec = is_aligned16(d);
  float old[8];
  load8(d, c, cols, vec, old);
#pragma unroll
  for (int k = 0; k < 8; ++k) old[k] += acc[k];
  store8(d, c, cols, vec, old);
}

}  // namespace

void launch_embedding_forward(const EmbeddingForwardArgs& a, cudaStream_t stream) {
  if (a.n_tokens == 0) return;
  int threads = (int)((a.cols + 7) / 8);
  threads = (threads + 31) / 32 * 32;
  threads = threads < 32 ? 32 : threads > 256 ? 256 : threads;
  const unsigned grid = grid_for(a.n_tokens, 1, 1 << 20);
  with_float_type(a.out_type, [&](auto to) {
    with_float_type(a.table_type, [&](auto tt) {
      using TO = decltype(to);
      using TT = decltype(tt);
      FOURBIT_CUDA_CHECK(core::launch_pdl(embedding_forward_kernel<TO, TT>, dim3(grid), dim3((unsigned)threads), 0,
                                          stream, static_cast<TO*>(a.out), a.ids, static_cast<const TT*>(a.table),
                                          a.n_tokens, a.vocab, a.cols, a.error_flag));
    });
  });
  FOURBIT_CUDA_CHECK_LAUNCH();
}

int64_t embedding_backward_workspace_bytes(int64_t n_tokens, int64_t vocab) {
  if (n_tokens == 0) return 0;
  const int64_t arrays = 4 * align_up(n_tokens * (int64_t)sizeof(int32_t));
  return kAlign - 1 + arrays + (int64_t)cub_temp_bytes(n_tokens, vocab);
}

void launch_embedding_backward(const EmbeddingBackwardArgs& a, cudaStream_t stream) {
  if (a.n_tokens == 0) return;
  const int64_t n = a.n_tokens;
  char* base = reinterpret_cast<char*>(
      (reinterpret_cast<uintptr_t>(a.workspace) + kAlign - 1) / kAlign * kAlign);
  const int64_t array_bytes = align_up(n * (int64_t)sizeof(int32_t));
  int32_t* keys_in = reinterpret_cast<int32_t*>(base);
  int32_t* keys_out = reinterpret_cast<int32_t*>(base + array_bytes);
  int32_t* vals_in = reinterpret_cast<int32_t*>(base + 2 * array_bytes);
  int32_t* vals_out = reinterpret_cast<int32_t*>(base + 3 * array_bytes);
  void* temp = base + 4 * array_bytes;
  size_t temp_bytes = cub_temp_bytes(n, a.vocab);

  sort_input_kernel<<<grid_for(n, 256), 256, 0, stream>>>(keys_in, vals_in, a.ids, n, a.vocab,
                                                         a.error_flag);
  FOURBIT_CUDA_CHECK_LAUNCH();
  FOURBIT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, vals_in,
                                                     vals_out, (int)n, 0, end_bit_for(a.vocab),
                                                     stream));
  if (a.cols == 0) return;
  const dim3 grid((unsigned)((n + kAccumulateWarps - 1) / kAccumulateWarps),
                  (unsigned)((a.cols + 255) / 256));
  with_float_type(a.dout_type, [&](auto t) {
    using T = decltype(t);
    embedding_accumulate_kernel<T><<<grid, kAccumulateWarps * 32, 0, stream>>>(
        a.dtable, static_cast<const T*>(a.dout), keys_out, vals_out, n, a.vocab, a.cols);
  });
  FOURBIT_CUDA_CHECK_LAUNCH();
}

}  // namespace fourbit::ops::kernels
