// RMSNorm kernels. A row of C columns is held in registers by one CTA: thread t owns the 8-column
// groups t, t + T, ..., t + (J-1) T (T <= 1024 threads, J <= 2 groups each: C <= 16384), so each row is read once.
//
// Forward: grid-stride over rows.
// Backward: CTA b processes the rows of chunk b in order, writes dx per row and keeps its
// partial dweight sums in registers (BF16 rows of C <= 4096: two rows per iteration, the same
// arithmetic in the same order), then stores them to partial[b, :]; a second kernel sums the
// partials over b in a fixed order (32 columns x 8 row-groups per CTA, then the 8 groups in order)
// and adds the result to dweight. No float atomics: deterministic.
#include "ops/rmsnorm_kernels.h"

#include "core/env.h"
#include "core/error.h"
#include "ops/error_flags.h"
#include "ops/kernel_support.cuh"
#include "ops/output_amax.cuh"

#include <type_traits>

namespace fourbit::ops::kernels {
namespace {

struct RowShape {
  int threads;
  int groups;  // J: 8-column groups per thread
};

RowShape row_shape(int cols) {
  const int chunks = (cols + 7) / 8;
  const int j = chunks <= 1024 ? 1 : 2;
  int t = (chunks + j - 1) / j;
  t = (t + 31) / 32 * 32;
  return {t < 32 ? 32 : t, j};
}

// Registers: at 1024 threads a thread has 64. With J = 1 the weight (and in the backward the row
// of x and g) stay in registers; with J > 1 they are re-read after the row reduction instead (an
// L1/L2 hit: the CTA has just read them), which keeps the kernels free of spills.
template <typename TX, typename TW, int J>
__global__ void __launch_bounds__(1024)
    rmsnorm_forward_kernel(TX* __restrict__ y, float* __restrict__ rstd,
                           const TX* __restrict__ x, const TW* __restrict__ w, int64_t n_rows,
                           int cols, float eps) {
  constexpr bool kCacheWeight = J == 1;
  __shared__ float scratch[32];
  core::pdl_allow_dependents();  // a PDL-launched consumer (the decode GEMV) may start loading its weights
  core::pdl_wait_for_producer();  // launched with PDL (core/pdl.cuh): nothing is read before this
  const bool w_vec = is_aligned16(w);
  float wv[8];
  if (kCacheWeight) load8(w, (int64_t)threadIdx.x * 8, cols, w_vec, wv);

  for (int64_t row = blockIdx.x; row < n_rows; row += gridDim.x) {
    const TX* xr = x + row * cols;
    TX* yr = y + row * cols;
    const bool vec = w_vec && is_aligned16(xr) && is_aligned16(yr);
    float v[J][8];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      load8(xr, (int64_t)(j * blockDim.x + threadIdx.x) * 8, cols, vec, v[j]);
#pragma unroll
      for (int k = 0; k < 8; ++k) ss = fmaf(v[j][k], v[j][k], ss);
    }
    ss = block_sum(ss, scratch);
    const float r = 1.0f / sqrtf(ss / (float)cols + eps);
    if (threadIdx.x == 0) rstd[row] = r;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int64_t c = (int64_t)(j * blockDim.x + threadIdx.x) * 8;
      if (!kCacheWeight) load8(w, c, cols, w_vec, wv);
#pragma unroll
      for (int k = 0; k < 8; ++k) v[j][k] = v[j][k] * r * wv[k];
      store8(yr, c, cols, vec, v[j]);
    }
  }
}

// Eight BF16 values as their bits (word i: value 2i in the low half, 2i + 1 in the high half, as
// load8_aligned reads them); missing values past the row's end are 0, as load8 reads them.
struct Bf16x8 {
  uint32_t w[4];
  __device__ __forceinline__ float at(int k) const {
    return __uint_as_float(k % 2 == 0 ? w[k / 2] << 16 : w[k / 2] & 0xFFFF0000u);
  }
};
__device__ __forceinline__ Bf16x8 load8_bits(const bf16_t* row, int64_t c, int64_t n, bool vec) {
  Bf16x8 r;
  if (vec && c + 8 <= n) {
    const uint4 a = *reinterpret_cast<const uint4*>(row + c);
    r.w[0] = a.x;
    r.w[1] = a.y;
    r.w[2] = a.z;
    r.w[3] = a.w;
    return r;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = c + 2 * i < n ? (uint32_t)row[c + 2 * i] : 0u;
    const uint32_t hi = c + 2 * i + 1 < n ? (uint32_t)row[c + 2 * i + 1] : 0u;
    r.w[i] = lo | hi << 16;
  }
  return r;
}

// kAccumulate: dx holds a gradient that the result is added to, dx = dx + round(result) with
// add_kernel's arithmetic (the result rounded to TX first), so the bits equal this kernel into a
// temporary followed by add_inplace.
// kAmax (BF16, J = 1, with kAccumulate; rows_per_chunk and n_rows multiples of 16): also the
// OutputAmaxes of the accumulated dx, as add_inplace_amax computes them (output_amax.cuh): each
// thread parks the BF16 bits it stored for its 8 columns of the last 16 rows in its own slots of
// dynamic shared memory ([16][blockDim.x] x 16 bytes; only the thread itself reads them back, so
// no barrier), and after every 16th row of its chunk (a 16-row segment: chunks start on multiples
// of 16) folds each column's Hadamard transform into the RHT amax.
// kPairRows (BF16, J = 1, no amaxes, C <= 8 kPairMaxThreads): two rows per iteration (see there);
// its own launch bounds leave the registers that both rows' values need.
constexpr int kPairMaxThreads = 512;
template <typename TX, typename TW, int J, bool kAccumulate, bool kAmax = false, bool kPairRows = false>
// kAmax: C <= 2048, 256 threads.
__global__ void __launch_bounds__(kAmax ? kRmsnormAmaxMaxCols / 8 : kPairRows ? kPairMaxThreads : 1024)
    rmsnorm_backward_kernel(TX* __restrict__ dx, float* __restrict__ partial,
                            const TX* __restrict__ dy, const TX* __restrict__ x,
                            const TW* __restrict__ w, const float* __restrict__ rstd,
                            int64_t n_rows, int cols, int64_t rows_per_chunk, OutputAmaxes amaxes) {
  static_assert(!kAmax || (kAccumulate && J == 1 && sizeof(TX) == 2), "amaxes: bf16, one group, accumulating");
  constexpr bool kCache = J == 1;
  __shared__ float scratch[32];
  extern __shared__ uint4 segment_slots[];  // kAmax: [16][blockDim.x]
  float out_amax = 0.0f, rht_amax = 0.0f;
  bool bad = false;
  const bool w_vec = is_aligned16(w);
  float wv[8], acc[J][8];
  if (kCache) load8(w, (int64_t)threadIdx.x * 8, cols, w_vec, wv);
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[j][k] = 0.0f;

  const int64_t first = (int64_t)blockIdx.x * rows_per_chunk;
  const int64_t last = min(n_rows, first + rows_per_chunk);
  static_assert(!kPairRows || (kCache && !kAmax && std::is_same_v<TX, bf16_t>), "pairs: bf16, one group, no amaxes");
  if constexpr (kPairRows) {
    // Two rows per iteration: both rows' loads are in flight together and their reductions share
    // one pair of barriers, so a chunk takes half as many dependent round trips. The rows are held
    // as their BF16 bits (4 registers per 8 values; 89-98 registers in all, under this variant's
    // own launch bounds) and widened where used. The arithmetic is the one-row loop's below, row by row in
    // the same order (acc gets row a, then row b), so the bits are the same. An odd chunk's last
    // row pairs with nothing (has_b false: row b reads as zeros and is neither summed nor stored).
    __shared__ float2 scratch2[32];
    const int64_t c = (int64_t)threadIdx.x * 8;
    for (int64_t row = first; row < last; row += 2) {
      const bool has_b = row + 1 < last;
      const float ra = rstd[row], rb = has_b ? rstd[row + 1] : 0.0f;
      const TX* xa = x + row * cols;
      const TX* dya = dy + row * cols;
      TX* dxa = dx + row * cols;
      const TX* xb = xa + cols;
      const TX* dyb = dya + cols;
      TX* dxb = dxa + cols;
      const bool vec_a = w_vec && is_aligned16(xa) && is_aligned16(dya) && is_aligned16(dxa);
      const bool vec_b = w_vec && is_aligned16(xb) && is_aligned16(dyb) && is_aligned16(dxb);
      const int64_t cols_b = has_b ? cols : 0;  // no row b: every value reads as 0
      const Bf16x8 xva = load8_bits(xa, c, cols, vec_a), dya_bits = load8_bits(dya, c, cols, vec_a);
      const Bf16x8 xvb = load8_bits(xb, c, cols_b, vec_b), dyb_bits = load8_bits(dyb, c, cols_b, vec_b);
      Bf16x8 preva{}, prevb{};
      if constexpr (kAccumulate) {
        preva = load8_bits(dxa, c, cols, vec_a);
        prevb = load8_bits(dxb, c, cols_b, vec_b);
      }
      float2 dot = make_float2(0.0f, 0.0f);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float g = dya_bits.at(k);
        acc[0][k] = fmaf(g, xva.at(k) * ra, acc[0][k]);
        dot.x = fmaf(g * wv[k], xva.at(k), dot.x);
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float g = dyb_bits.at(k);
        if (has_b) acc[0][k] = fmaf(g, xvb.at(k) * rb, acc[0][k]);
        dot.y = fmaf(g * wv[k], xvb.at(k), dot.y);
      }
      dot = block_sum2(dot, scratch2);
      const float coef_a = ra * ra * dot.x / (float)cols, coef_b = rb * rb * dot.y / (float)cols;
      float outa[8], outb[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        outa[k] = ra * fmaf(-xva.at(k), coef_a, dya_bits.at(k) * wv[k]);
        outb[k] = rb * fmaf(-xvb.at(k), coef_b, dyb_bits.at(k) * wv[k]);
        if constexpr (kAccumulate) {
          outa[k] = __fadd_rn(preva.at(k), to_float<TX>(from_float<TX>(outa[k])));
          outb[k] = __fadd_rn(prevb.at(k), to_float<TX>(from_float<TX>(outb[k])));
        }
      }
      store8(dxa, c, cols, vec_a, outa);
      store8(dxb, c, cols_b, vec_b, outb);
    }
  } else {
    for (int64_t row = first; row < last; ++row) {
      const float r = rstd[row];
      const TX* xr = x + row * cols;
      const TX* dyr = dy + row * cols;
      TX* dxr = dx + row * cols;
      const bool vec = w_vec && is_aligned16(xr) && is_aligned16(dyr) && is_aligned16(dxr);
      float xv[8], g[8];  // x and g = dy * w of the current group (of the only group when kCache)
      // kCache: the gradient dx is accumulated into is loaded with x and dy, before the row's
      // reduction (it does not depend on it), so its round trip overlaps theirs instead of following
      // the reduction.
      float prev[8];
      float dot = 0.0f;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const int64_t c = (int64_t)(j * blockDim.x + threadIdx.x) * 8;
        load8(xr, c, cols, vec, xv);
        load8(dyr, c, cols, vec, g);
        if (kCache && kAccumulate) load8(dxr, c, cols, vec, prev);
        if (!kCache) load8(w, c, cols, w_vec, wv);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          acc[j][k] = fmaf(g[k], xv[k] * r, acc[j][k]);  // dy * xhat
          g[k] *= wv[k];                                  // g = dy * w
          dot = fmaf(g[k], xv[k], dot);
        }
      }
      dot = block_sum(dot, scratch);
      // dx = r * (g - xhat * mean(g * xhat)) = r * (g - x * (r * r * dot / C))
      const float coef = r * r * dot / (float)cols;
#pragma unroll 1  // no per-group state here; a rolled loop keeps J = 2 free of spills
      for (int j = 0; j < J; ++j) {
        const int64_t c = (int64_t)(j * blockDim.x + threadIdx.x) * 8;
        if (!kCache) {
          load8(xr, c, cols, vec, xv);
          load8(dyr, c, cols, vec, g);
          load8(w, c, cols, w_vec, wv);
#pragma unroll
          for (int k = 0; k < 8; ++k) g[k] *= wv[k];
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) g[k] = r * fmaf(-xv[k], coef, g[k]);  // the contraction explicit
        if constexpr (kAccumulate) {
          if (!kCache) load8(dxr, c, cols, vec, prev);
#pragma unroll
          for (int k = 0; k < 8; ++k) g[k] = __fadd_rn(prev[k], to_float<TX>(from_float<TX>(g[k])));
        }
        if constexpr (kAmax) {
          // Rounded once (round_pair: g then holds the stored values; columns past `cols` hold 0
          // and are not stored), stored from those words, their amax, and this row's segment slot.
          uint32_t wd[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            wd[k] = round_pair(g[2 * k], g[2 * k + 1]);
            fold_amax(g[2 * k], out_amax, bad);
            fold_amax(g[2 * k + 1], out_amax, bad);
          }
          if (vec && c + 8 <= cols) {
            *reinterpret_cast<uint4*>(dxr + c) = make_uint4(wd[0], wd[1], wd[2], wd[3]);
          } else {
            store8(dxr, c, cols, vec, g);  // exact: the values are BF16 already
          }
          const int seg_row = (int)((row - first) & 15);
          segment_slots[seg_row * blockDim.x + threadIdx.x] = make_uint4(wd[0], wd[1], wd[2], wd[3]);
          if (seg_row == 15 && amaxes.rht_amax != nullptr) {
            // Each slot word once: word k holds columns 2k and 2k + 1 of the segment's 16 rows.
            const uint32_t* words = reinterpret_cast<const uint32_t*>(segment_slots);
#pragma unroll 1
            for (int k = 0; k < 4; ++k) {
              float lo[16], hi[16];
#pragma unroll
              for (int i = 0; i < 16; ++i) {
                const uint32_t word = words[(i * blockDim.x + threadIdx.x) * 4 + k];
                lo[i] = lo_of(word);
                hi[i] = hi_of(word);
              }
              rht_amax = fmaxf(rht_amax, fmaxf(quant::device::rht_segment_amax(lo, amaxes.rht_sign_mask),
                                               quant::device::rht_segment_amax(hi, amaxes.rht_sign_mask)));
            }
          }
        } else {
          store8(dxr, c, cols, vec, g);
        }
      }
    }
  }
  if constexpr (kAmax) {
    quant::device::publish_amaxes(out_amax, rht_amax, amaxes.amax, amaxes.rht_amax, bad, amaxes.nonfinite_flag,
                                  kErrNonFinite);
  }
  float* pr = partial + (int64_t)blockIdx.x * cols;
  const bool p_vec = is_aligned16(pr);
#pragma unroll
  for (int j = 0; j < J; ++j) store8(pr, (int64_t)(j * blockDim.x + threadIdx.x) * 8, cols, p_vec, acc[j]);
}

// dweight[c] += sum_b partial[b, c] in a fixed order that depends only on n_chunks. blockDim
// (32, kDweightRows): thread (x, y) of column c keeps 4 independent sums of the partials
// b = y + kDweightRows * (4 i + k), k = 0..3 (4 loads in flight instead of one dependent chain of
// n_chunks / 8 L2 round trips: with 2048 chunks that chain was ~256 deep), adds them as
// (s0 + s1) + (s2 + s3), and the rows' sums are added in y order in shared memory.
constexpr int kDweightRows = 32;
__global__ void __launch_bounds__(32 * kDweightRows)
rmsnorm_dweight_kernel(float* __restrict__ dweight, const float* __restrict__ partial, int64_t n_chunks,
                       int cols) {
  __shared__ float sums[kDweightRows][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (c < cols) {
    constexpr int64_t kStep = 4 * kDweightRows;
    int64_t b = threadIdx.y;
    for (; b + 3 * kDweightRows < n_chunks; b += kStep) {
#pragma unroll
      for (int k = 0; k < 4; ++k) s[k] += partial[(b + k * kDweightRows) * cols + c];
    }
#pragma unroll
    for (int k = 0; k < 3; ++k)  // the last 0..3 partials of this row
      if (b + k * kDweightRows < n_chunks) s[k] += partial[(b + k * kDweightRows) * cols + c];
  }
  sums[threadIdx.y][threadIdx.x] = (s[0] + s[1]) + (s[2] + s[3]);
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total = 0.0f;
#pragma unroll
    for (int g = 0; g < kDweightRows; ++g) total += sums[g][threadIdx.x];
    dweight[c] += total;
  }
}

template <typename F>
void with_groups(int groups, F&& f) {
  if (groups == 1) {
    f(std::integral_constant<int, 1>{});
  } else {
    f(std::integral_constant<int, 2>{});
  }
}

}  // namespace

void launch_rmsnorm_forward(const RmsnormForwardArgs& a, cudaStream_t stream) {
  if (a.n_rows == 0) return;
  const RowShape rs = row_shape(a.cols);
  const unsigned grid = (unsigned)(a.n_rows < 4096 ? a.n_rows : 4096);
  with_float_type(a.act_type, [&](auto tx) {
    with_float_type(a.weight_type, [&](auto tw) {
      with_groups(rs.groups, [&](auto j) {
        using TX = decltype(tx);
        using TW = decltype(tw);
        FOURBIT_CUDA_CHECK(core::launch_pdl(rmsnorm_forward_kernel<TX, TW, decltype(j)::value>, dim3(grid),
                                            dim3((unsigned)rs.threads), 0, stream, static_cast<TX*>(a.y), a.rstd,
                                            static_cast<const TX*>(a.x), static_cast<const TW*>(a.weight),
                                            a.n_rows, a.cols, a.eps));
      });
    });
  });
  FOURBIT_CUDA_CHECK_LAUNCH();
}

void launch_rmsnorm_backward(const RmsnormBackwardArgs& a, cudaStream_t stream) {
  if (a.n_rows == 0 || a.cols == 0) return;
  const RowShape rs = row_shape(a.cols);
  with_float_type(a.act_type, [&](auto tx) {
    with_float_type(a.weight_type, [&](auto tw) {
      with_groups(rs.groups, [&](auto j) {
        using TX = decltype(tx);
        using TW = decltype(tw);
        constexpr int kJ = decltype(j)::value;
        auto kernel = a.accumulate ? rmsnorm_backward_kernel<TX, TW, kJ, true>
                                   : rmsnorm_backward_kernel<TX, TW, kJ, false>;
        size_t smem = 0;
        if constexpr (kJ == 1 && std::is_same_v<TX, bf16_t>) {
          static const bool pair_rows = env_switch("FOURBIT_RMSNORM_PAIR_ROWS") != 0;  // A/B: =0 off
          if (pair_rows && a.amaxes.amax == nullptr && rs.threads <= kPairMaxThreads) {
            kernel = a.accumulate ? rmsnorm_backward_kernel<TX, TW, 1, true, false, true>
                                  : rmsnorm_backward_kernel<TX, TW, 1, false, false, true>;
          }
          if (a.amaxes.amax != nullptr) {
            kernel = rmsnorm_backward_kernel<TX, TW, 1, true, true>;
            smem = (size_t)16 * rs.threads * sizeof(uint4);
            FOURBIT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
          }
        }
        kernel<<<(unsigned)a.n_chunks, rs.threads, smem, stream>>>(
            static_cast<TX*>(a.dx), a.partial, static_cast<const TX*>(a.dy),
            static_cast<const TX*>(a.x), static_cast<const TW*>(a.weight), a.rstd, a.n_rows,
            a.cols, a.rows_per_chunk, a.amaxes);
      });
    });
  });
  FOURBIT_CUDA_CHECK_LAUNCH();
  rmsnorm_dweight_kernel<<<(unsigned)((a.cols + 31) / 32), dim3(32, kDweightRows), 0, stream>>>(
      a.dweight, a.partial, a.n_chunks, a.cols);
  FOURBIT_CUDA_CHECK_LAUNCH();
}

}  // namespace fourbit::ops::kernels
