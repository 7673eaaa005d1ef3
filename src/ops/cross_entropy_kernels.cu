// Softmax cross-entropy kernels: one CTA per row (grid-stride over rows).
//
// A row of V elements is split into a scalar head (up to the first 16-byte boundary), a body of
// aligned 8-element vectors and a scalar tail. Pass 1: each thread keeps an online-softmax pair
// (running max m, sum s of exp(x - m)), updated once per 8 elements; the pairs are combined by a
// butterfly over the warp and then over the warps in a fixed order, so every thread ends with
// the same (m, s) and lse = m + log(s). Pass 2 (backward) re-reads the row and writes
// (exp(x - lse) - onehot) * scale; in place, each element is read before it is written by the
// same thread. A second, single-CTA kernel sums the valid losses in a fixed order for the mean.
// The forward may keep lse per row (lse_out); a backward given those (lse_in) skips pass 1.
// Forward and backward in one launch, staged (kStage): pass 1 also copies the row's aligned body
// into shared memory (each thread its own 16-byte vectors, read back by the same thread: no
// barrier needed), and pass 2 reads it from there. The logits then cross DRAM once instead of
// twice; without staging the second read depends on the row surviving in L2, and at 4 CTAs of
// 512 threads an SM and V = 50257 (100 KB a BF16 row) the rows in flight exceed the L2. Used when
// two CTAs of staged rows fit an SM (kMaxStageBytes).
#include "ops/cross_entropy_kernels.h"

#include "core/fill.h"
#include "core/error.h"
#include "ops/error_flags.h"
#include "ops/kernel_support.cuh"

#include <math_constants.h>

namespace fourbit::ops::kernels {
namespace {

constexpr int kMaxThreads = 512;
// The largest staged row: two CTAs an SM must fit (2 x 113 KB + scratch of the 228 KB of sm_90),
// i.e. V <= 57856 BF16 or 28928 FP32 logits (50257 BF16: 100.5 KB). Larger rows are read twice.
constexpr int64_t kMaxStageBytes = 113 * 1024;
constexpr int kMeanThreads = 1024;

struct Softmax {
  float m;  // running max (-inf: nothing seen yet)
  float s;  // sum of exp(x - m)
};

// exp(d): expf, or with kSfu 2^(d log2(e)) on the special-function unit: one FMUL and
// ex2.approx.ftz (relative error ~2^-22 like expf's 2 ulp, plus the product's rounding, u |d|;
// results below 2^-126 flush to 0). expf adds a range reduction of ~8 instructions, and these
// kernels are issue-bound with two exponentials per logit. FOURBIT_CE_EXP picks (cross_entropy.cpp).
template <bool kSfu>
__device__ __forceinline__ float exp_of(float d) {
  if constexpr (kSfu) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(d * 1.4426950408889634f));
    return y;
  } else {
    return expf(d);
  }
}

template <bool kSfu>
__device__ __forceinline__ Softmax combine(Softmax a, Softmax b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -CUDART_INF_F) return a;  // both empty (or all -inf)
  return {m, a.s * exp_of<kSfu>(a.m - m) + b.s * exp_of<kSfu>(b.m - m)};
}

// Adds up to 8 values (padding must be -inf).
template <bool kSfu>
__device__ __forceinline__ void add8(Softmax& st, const float v[8]) {
  float mx = v[0];
#pragma unroll
  for (int k = 1; k < 8; ++k) mx = fmaxf(mx, v[k]);
  if (mx > st.m) {
    st.s *= exp_of<kSfu>(st.m - mx);
    st.m = mx;
  }
  if (st.m == -CUDART_INF_F) return;
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < 8; ++k) s += exp_of<kSfu>(v[k] - st.m);
  st.s += s;
  // A NaN logit: fmaxf skips it, expf(NaN) poisons s, and the loss becomes NaN, as it should.
}

template <bool kSfu>
__device__ __forceinline__ Softmax block_softmax(Softmax st, Softmax* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Softmax other;
    other.m = __shfl_xor_sync(0xFFFFFFFFu, st.m, o);
    other.s = __shfl_xor_sync(0xFFFFFFFFu, st.s, o);
    st = combine<kSfu>(st, other);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  if (lane == 0) scratch[warp] = st;
  __syncthreads();
  Softmax total = scratch[0];
  for (int w = 1; w < n_warps; ++w) total = combine<kSfu>(total, scratch[w]);
  __syncthreads();
  return total;
}

// Where the 16-byte aligned body of a row starts and ends.
template <typename T>
__device__ __forceinline__ void split_row(const T* row, int64_t n, int64_t& head, int64_t& body_end) {
  const uint32_t mis = (uint32_t)(reinterpret_cast<uintptr_t>(row) & 15u);
  head = mis ? (int64_t)((16u - mis) / sizeof(T)) : 0;
  if (head > n) head = n;
  body_end = head + (n - head) / 8 * 8;
}

// row[0, n) = value, with 16-byte stores over the aligned body.
template <typename T>
__device__ __forceinline__ void fill_row(T* row, int64_t n, float value) {
  int64_t head, body_end;
  split_row(row, n, head, body_end);
  const int tid = threadIdx.x;
  const T x = from_float<T>(value);
  if (tid < head) row[tid] = x;
  if (tid < n - body_end) row[body_end + tid] = x;
  float v[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = value;
  for (int64_t i = head + (int64_t)tid * 8; i < body_end; i += (int64_t)blockDim.x * 8)
    store8_aligned(row + i, v);
}

// One staged vector: 8 logits as stored (16 bytes of BF16 or 32 of FP32), copied as a whole.
template <typename T>
struct alignas(16) Raw8 {
  T e[8];
};

// No __restrict__ on logits / dlogits: they are the same buffer in the in-place variant.
// kStage: dynamic shared memory holds the row's aligned body (body_end - head elements).
template <typename TL, typename TD, bool kStage, bool kSfu>
__global__ void __launch_bounds__(kMaxThreads)
    cross_entropy_kernel(const TL* logits, TD* dlogits, float* __restrict__ losses,
                         const int32_t* __restrict__ targets, int64_t n_rows, int64_t vocab,
                         float dloss_scale, const float* __restrict__ row_weights,
                         int* error_flag, float* __restrict__ lse_out,
                         const float* __restrict__ lse_in) {
  __shared__ Softmax scratch[32];
  extern __shared__ __align__(16) unsigned char staged_raw[];
  Raw8<TL>* staged = reinterpret_cast<Raw8<TL>*>(staged_raw);  // [(body_end - head) / 8]
  const int tid = threadIdx.x;
  for (int64_t n = blockIdx.x; n < n_rows; n += gridDim.x) {
    const int32_t target = targets[n];
    const TL* row = logits + n * vocab;
    TD* drow = dlogits ? dlogits + n * vocab : nullptr;
    if (target == -1) {  // ignored: zero loss and gradient (uniform across the CTA: no sync issue)
      if (losses && tid == 0) losses[n] = 0.0f;
      if (lse_out && tid == 0) lse_out[n] = 0.0f;
      if (drow) fill_row(drow, vocab, 0.0f);
      continue;
    }
    if (target < 0 || target >= vocab) {
      if (tid == 0) {
        atomicOr(error_flag, kErrIndexOutOfRange);
        if (losses) losses[n] = CUDART_NAN_F;
      }
      if (drow) fill_row(drow, vocab, CUDART_NAN_F);
      continue;
    }

    int64_t head, body_end;
    split_row(row, vocab, head, body_end);
    float v[8];
    const int64_t tail = vocab - body_end;
    float lse;
    if (lse_in != nullptr) {
      lse = lse_in[n];  // the forward's, for these logits
    } else {
      Softmax st{-CUDART_INF_F, 0.0f};
      if (tid < head || tid < tail) {  // the scalar head and tail elements (< 8 each)
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = -CUDART_INF_F;
        if (tid < head) v[0] = to_float(row[tid]);
        if (tid < tail) v[1] = to_float(row[body_end + tid]);
        add8<kSfu>(st, v);
      }
#pragma unroll 2  // two 16-byte loads in flight a thread
      for (int64_t i = head + (int64_t)tid * 8; i < body_end; i += (int64_t)blockDim.x * 8) {
        if constexpr (kStage) {
          const Raw8<TL> r = *reinterpret_cast<const Raw8<TL>*>(row + i);
          staged[(i - head) / 8] = r;
          load8_aligned(r.e, v);
        } else {
          load8_aligned(row + i, v);
        }
        add8<kSfu>(st, v);
      }
      // Read before the barrier in block_softmax: in place, pass 2 overwrites the row.
      const float x_target = tid == 0 ? to_float(row[target]) : 0.0f;
      st = block_softmax<kSfu>(st, scratch);
      lse = st.m + logf(st.s);
      if (losses && tid == 0) losses[n] = lse - x_target;
      if (lse_out && tid == 0) lse_out[n] = lse;
    }
    if (!drow) continue;

    // Pass 2: dlogits. The same split as the read; vector stores where drow's body is aligned.
    const bool dvec = is_aligned16(drow + head);
    const float scale = row_weights ? row_weights[n] * dloss_scale : dloss_scale;
    auto grad = [&](float x, int64_t idx) {
      return (exp_of<kSfu>(x - lse) - (idx == target ? 1.0f : 0.0f)) * scale;
    };
    if (tid < head) drow[tid] = from_float<TD>(grad(to_float(row[tid]), tid));
    if (tid < tail) {
      const int64_t idx = body_end + tid;
      drow[idx] = from_float<TD>(grad(to_float(row[idx]), idx));
    }
    for (int64_t i = head + (int64_t)tid * 8; i < body_end; i += (int64_t)blockDim.x * 8) {
      if constexpr (kStage) {
        load8_aligned(staged[(i - head) / 8].e, v);  // this thread's own vector from pass 1
      } else {
        load8_aligned(row + i, v);
      }
      // The one-hot term only in the vector that holds the target (one thread a row); elsewhere
      // (e - 0) * scale is e * scale, the same bits without a 64-bit compare per logit.
      if ((uint64_t)(target - i) < 8u) {
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = grad(v[k], i + k);
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = exp_of<kSfu>(v[k] - lse) * scale;
      }
      if (dvec) {
        store8_aligned(drow + i, v);
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) drow[i + k] = from_float<TD>(v[k]);
      }
    }
  }
}

// mean_loss = sum of losses[n] over targets[n] != -1, / their count (0 if none). One CTA.
__global__ void __launch_bounds__(kMeanThreads)
    mean_loss_kernel(float* __restrict__ mean_loss, const float* __restrict__ losses,
                     const int32_t* __restrict__ targets, int64_t n_rows) {
  __shared__ float fscratch[32];
  __shared__ int iscratch[32];
  float sum = 0.0f;
  int count = 0;
  for (int64_t n = threadIdx.x; n < n_rows; n += blockDim.x) {
    if (targets[n] != -1) {
      sum += losses[n];
      ++count;
    }
  }
  sum = block_sum(sum, fscratch);
  count = block_sum(count, iscratch);
  if (threadIdx.x == 0) mean_loss[0] = count > 0 ? sum / (float)count : 0.0f;
}

}  // namespace

void launch_cross_entropy(const CrossEntropyArgs& a, cudaStream_t stream) {
  if (a.n_rows == 0) {
    if (a.mean_loss) device_fill_async(a.mean_loss, 0, sizeof(float), stream);
    return;
  }
  int threads = (int)((a.vocab + 7) / 8);
  threads = (threads + 31) / 32 * 32;
  threads = threads < 32 ? 32 : threads > kMaxThreads ? kMaxThreads : threads;
  const unsigned grid = grid_for(a.n_rows, 1, 1 << 20);
  with_float_type(a.logits_type, [&](auto tl) {
    with_float_type(a.dlogits_type, [&](auto td) {
      using TL = decltype(tl);
      using TD = decltype(td);
      // Both passes in this launch: stage the row when its body fits (at most V elements).
      const int64_t stage_bytes = a.vocab * (int64_t)sizeof(TL);
      const bool stage = a.dlogits != nullptr && a.lse_in == nullptr && stage_bytes <= kMaxStageBytes;
      auto kernel = a.sfu_exp ? (stage ? cross_entropy_kernel<TL, TD, true, true> : cross_entropy_kernel<TL, TD, false, true>)
                              : (stage ? cross_entropy_kernel<TL, TD, true, false> : cross_entropy_kernel<TL, TD, false, false>);
      size_t smem = 0;
      if (stage) {
        smem = (size_t)stage_bytes;
        FOURBIT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
      }
      kernel<<<grid, threads, smem, stream>>>(
          static_cast<const TL*>(a.logits), static_cast<TD*>(a.dlogits), a.losses, a.targets, a.n_rows,
          a.vocab, a.dloss_scale, a.row_weights, a.error_flag, a.lse_out, a.lse_in);
    });
  });
  FOURBIT_CUDA_CHECK_LAUNCH();
  if (a.mean_loss) {
    mean_loss_kernel<<<1, kMeanThreads, 0, stream>>>(a.mean_loss, a.losses, a.targets, a.n_rows);
    FOURBIT_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace fourbit::ops::kernels
