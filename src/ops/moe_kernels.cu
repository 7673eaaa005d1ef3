// MoE routing and token permutation kernels (contract in moe.h, launch interface in
// moe_kernels.h). Everything is deterministic: integer atomics only (their results do not depend
// on order), float sums in a fixed order (sequential over slots and chunks, fixed warp butterflies).
//
//   router forward   one warp per token: the E logits spread over the lanes (up to 32 each),
//                    softmax with warp max/sum, k rounds of a warp arg-max on (logit + bias, lower
//                    id first) or the forced ids, gates renormalized over the k selected probs
//                    (summed in slot order); counts with integer atomics. Losses: per-token
//                    lse^2, then per-chunk column sums of probs and a single-CTA final sum, both
//                    in a fixed order.
//   router backward  one warp per token, the same layout.
//   plan             a stable counting sort of the N k slots: (1) per-chunk expert histograms
//                    (2048 slots per chunk, shared-memory integer atomics), (2) one CTA turns them
//                    into expert offsets (padded to row_align) and per-chunk bases, (3) per chunk,
//                    in rounds of 256 slots, each slot's rank among the same expert's earlier slots
//                    (__match_any_sync within a warp, per-warp counts across warps).
//   permute          one CTA per permuted row, a raw copy of the token's row (bits preserved).
//   gathers          one CTA per token: the k slots' rows summed in slot order in FP32.
//   d_gates          one warp per slot: a dot product with a fixed butterfly.
#include "ops/moe_kernels.h"

#include "core/fill.h"
#include "core/error.h"
#include "ops/error_flags.h"
#include "ops/kernel_support.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <type_traits>

namespace fourbit::ops::kernels {
namespace {

constexpr unsigned kFull = 0xFFFFFFFFu;
constexpr int kRouterWarps = 8;  // tokens per CTA of the router kernels
constexpr int kLossChunks = 256;  // at most this many token chunks in the loss reduction

// Scratch memory ordered on the stream: allocated before the kernels that use it, freed after.
class StreamScratch {
 public:
  StreamScratch(size_t bytes, cudaStream_t stream) : stream_(stream) {
    if (bytes > 0) FOURBIT_CUDA_CHECK(cudaMallocAsync(&ptr_, bytes, stream));
  }
  ~StreamScratch() {
    if (ptr_) cudaFreeAsync(ptr_, stream_);
  }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

// --- router forward ------------------------------------------------------------------------------

// Is (v1, i1) ranked before (v2, i2)? Larger value first, then lower id; i = INT_MAX is "none".
__device__ __forceinline__ bool ranks_before(float v1, int i1, float v2, int i2) {
  if (i1 == INT_MAX) return false;
  if (i2 == INT_MAX) return true;
  return v1 > v2 || (v1 == v2 && i1 < i2);
}

template <int kPerLane>
__global__ void __launch_bounds__(kRouterWarps * 32)
    router_forward_kernel(const RouterForwardArgs a, float* z_terms) {
  const int64_t n = (int64_t)blockIdx.x * kRouterWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (n >= a.n_tokens) return;
  const int E = a.n_experts, k = a.top_k;
  const float* lg = a.logits + n * E;

  float x[kPerLane], sel[kPerLane];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    x[i] = e < E ? lg[e] : -INFINITY;
    float s = e < E ? (a.bias ? x[i] + a.bias[e] : x[i]) : -INFINITY;
    sel[i] = isnan(s) ? -INFINITY : s;  // NaN ranks last, so every lane agrees on the order
    mx = fmaxf(mx, x[i]);
  }
  mx = warp_max(mx);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    x[i] = lane + 32 * i < E ? expf(x[i] - mx) : 0.0f;
    sum += x[i];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    if (e < E) {
      x[i] = x[i] / sum;  // now the probability
      a.probs[n * E + e] = x[i];
    }
  }

  uint32_t taken = 0;  // bit i: expert lane + 32 i is already one of this token's slots
  float total = 0.0f;  // sum of the selected probabilities, in slot order
  int my_id = 0;
  float my_p = 0.0f;
  for (int j = 0; j < k; ++j) {
    int id;
    float pid;
    if (a.forced_ids) {
      id = a.forced_ids[n * k + j];
      float cand = 0.0f;
      bool repeated = false;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        if (lane + 32 * i == id) {
          cand = x[i];
          repeated = (taken >> i) & 1u;
          taken |= 1u << i;
        }
      }
      const bool bad = id < 0 || id >= E || __any_sync(kFull, repeated);
      pid = __shfl_sync(kFull, cand, id & 31);
      if (lane == 0) {
        if (bad) atomicOr(a.error_flag, kErrIndexOutOfRange);
        else atomicAdd(&a.expert_counts[id], 1);
      }
    } else {
      float bv = -INFINITY, bp = 0.0f;
      int bi = INT_MAX;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int e = lane + 32 * i;
        if (e < E && !((taken >> i) & 1u) && ranks_before(sel[i], e, bv, bi)) {
          bv = sel[i];
          bi = e;
          bp = x[i];
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(kFull, bv, off);
        const int oi = __shfl_xor_sync(kFull, bi, off);
        const float op = __shfl_xor_sync(kFull, bp, off);
        if (ranks_before(ov, oi, bv, bi)) {
          bv = ov;
          bi = oi;
          bp = op;
        }
      }
      id = bi;
      pid = bp;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i)
        if (lane + 32 * i == id) taken |= 1u << i;
      if (lane == 0) atomicAdd(&a.expert_counts[id], 1);
    }
    total += pid;
    if (lane == j) {
      my_id = id;
      my_p = pid;
    }
  }
  if (lane < k) {
    a.expert_ids[n * k + lane] = my_id;
    a.gates[n * k + lane] = my_p / total;
  }
  if (z_terms && lane == 0) {
    const float lse = mx + logf(sum);
    z_terms[n] = lse * lse;
  }
}

// partial[c][e] = sum of probs[n, e] over chunk c's tokens (e < E); partial[c][E] = sum of z terms.
__global__ void __launch_bounds__(256)
    router_loss_partials_kernel(const float* probs, const float* z_terms, int64_t n_tokens, int E,
                                int64_t chunk, float* partial) {
  __shared__ float scratch[32];
  const int64_t n0 = (int64_t)blockIdx.x * chunk;
  const int64_t n1 = min(n0 + chunk, n_tokens);
  float* out = partial + (int64_t)blockIdx.x * (E + 1);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    float s = 0.0f;
    for (int64_t n = n0; n < n1; ++n) s += probs[n * E + e];
    out[e] = s;
  }
  float z = 0.0f;
  for (int64_t n = n0 + threadIdx.x; n < n1; n += blockDim.x) z += z_terms[n];
  z = block_sum(z, scratch);
  if (threadIdx.x == 0) out[E] = z;
}

__global__ void __launch_bounds__(256)
    router_loss_final_kernel(const float* partial, int n_chunks, const int32_t* counts,
                             int64_t n_tokens, int E, float* losses) {
  __shared__ float scratch[32];
  float t = 0.0f;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    float p = 0.0f;
    for (int c = 0; c < n_chunks; ++c) p += partial[(int64_t)c * (E + 1) + e];
    t += (float)counts[e] * p;
  }
  t = block_sum(t, scratch);
  if (threadIdx.x == 0) {
    float z = 0.0f;
    for (int c = 0; c < n_chunks; ++c) z += partial[(int64_t)c * (E + 1) + E];
    const float n = (float)n_tokens;
    losses[0] = t * ((float)E / (n * n));
    losses[1] = z / n;
  }
}

// --- router backward -----------------------------------------------------------------------------

template <int kPerLane>
__global__ void __launch_bounds__(kRouterWarps * 32)
    router_backward_kernel(const RouterBackwardArgs a) {
  const int64_t n = (int64_t)blockIdx.x * kRouterWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (n >= a.n_tokens) return;
  const int E = a.n_experts, k = a.top_k;

  float p[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? a.probs[n * E + e] : 0.0f;
  }
  const int my_id = lane < k ? a.expert_ids[n * k + lane] : -1;
  const float my_dg = lane < k ? a.d_gates[n * k + lane] : 0.0f;
  float my_p = 0.0f;  // probs[n, id] of this lane's slot
  for (int j = 0; j < k; ++j) {
    const int id = __shfl_sync(kFull, my_id, j);
    float cand = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (lane + 32 * i == id) cand = p[i];
    const float pid = __shfl_sync(kFull, cand, id & 31);
    if (lane == j) my_p = pid;
  }
  // gate_j = p_j / S; d p_{id_j} = (dg_j - sum_j' dg_j' gate_j') / S. Sums in slot order.
  float total = 0.0f;
  for (int j = 0; j < k; ++j) total += __shfl_sync(kFull, my_p, j);
  float c = 0.0f;
  for (int j = 0; j < k; ++j)
    c += __shfl_sync(kFull, my_dg, j) * (__shfl_sync(kFull, my_p, j) / total);

  const float nf = (float)a.n_tokens;
  const float aux_scale = a.aux_grad * ((float)E / (nf * nf));
  float dp[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    dp[i] = (a.aux_grad != 0.0f && e < E) ? aux_scale * (float)a.expert_counts[e] : 0.0f;
  }
  for (int j = 0; j < k; ++j) {
    const int id = __shfl_sync(kFull, my_id, j);
    const float v = (__shfl_sync(kFull, my_dg, j) - c) / total;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (lane + 32 * i == id) dp[i] += v;
  }
  float pdp = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) pdp += p[i] * dp[i];
  pdp = warp_sum(pdp);

  float zc = 0.0f;  // d z / d logit_e = (2 / N) lse p_e
  if (a.z_grad != 0.0f) {
    const float* lg = a.logits + n * E;
    float l[kPerLane], mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      l[i] = lane + 32 * i < E ? lg[lane + 32 * i] : -INFINITY;
      mx = fmaxf(mx, l[i]);
    }
    mx = warp_max(mx);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) s += lane + 32 * i < E ? expf(l[i] - mx) : 0.0f;
    s = warp_sum(s);
    zc = a.z_grad * 2.0f * (mx + logf(s)) / nf;
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    if (e < E) a.d_logits[n * E + e] = p[i] * (dp[i] - pdp) + zc * p[i];
  }
}

// --- plan ----------------------------------------------------------------------------------------

constexpr int kPlanThreads = 256;
constexpr int kPlanRounds = 8;
constexpr int kPlanChunk = kPlanThreads * kPlanRounds;  // slots per chunk

__device__ __forceinline__ int slot_expert(const MoePlanArgs& a, int64_t slot) {
  if (slot >= a.n_slots) return -1;
  const int e = a.expert_ids[slot];
  return e >= 0 && e < a.n_experts ? e : -1;
}

// chunk_counts[c][e] = number of chunk c's slots routed to e.
__global__ void __launch_bounds__(kPlanThreads)
    plan_histogram_kernel(const MoePlanArgs a, int32_t* chunk_counts) {
  extern __shared__ int32_t hist[];
  const int E = a.n_experts;
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t base = (int64_t)blockIdx.x * kPlanChunk;
  for (int r = 0; r < kPlanRounds; ++r) {
    const int e = slot_expert(a, base + r * kPlanThreads + threadIdx.x);
    if (e >= 0) atomicAdd(&hist[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    chunk_counts[(int64_t)blockIdx.x * E + e] = hist[e];
}

// offsets (padded to row_align) and chunk_base[c][e] = offsets[e] + slots of e in chunks < c.
__global__ void __launch_bounds__(1024)
    plan_offsets_kernel(const MoePlanArgs a, const int32_t* chunk_counts, int n_chunks,
                        int32_t* chunk_base) {
  extern __shared__ int32_t padded[];  // [E]: padded size, then the offset
  const int E = a.n_experts;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int total = 0;
    for (int c = 0; c < n_chunks; ++c) total += chunk_counts[(int64_t)c * E + e];
    padded[e] = (total + a.row_align - 1) / a.row_align * a.row_align;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int run = 0;
    for (int e = 0; e < E; ++e) {
      const int size = padded[e];
      padded[e] = run;
      a.offsets[e] = run;
      run += size;
    }
    a.offsets[E] = run;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int run = padded[e];
    for (int c = 0; c < n_chunks; ++c) {
      chunk_base[(int64_t)c * E + e] = run;
      run += chunk_counts[(int64_t)c * E + e];
    }
  }
}

// Every slot's row: its expert's chunk base + earlier slots of the same expert in the chunk.
__global__ void __launch_bounds__(kPlanThreads)
    plan_ranks_kernel(const MoePlanArgs a, const int32_t* chunk_base) {
  extern __shared__ int32_t sm[];
  const int E = a.n_experts;
  constexpr int kWarps = kPlanThreads / 32;
  int32_t* running = sm;            // [E]: next row of each expert
  int32_t* warp_counts = sm + E;    // [kWarps][E]: this round's slots per warp and expert
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    running[e] = chunk_base[(int64_t)blockIdx.x * E + e];
  const int64_t base = (int64_t)blockIdx.x * kPlanChunk;
  for (int r = 0; r < kPlanRounds; ++r) {
    for (int i = threadIdx.x; i < kWarps * E; i += blockDim.x) warp_counts[i] = 0;
    __syncthreads();
    const int64_t slot = base + r * kPlanThreads + threadIdx.x;
    const int e = slot_expert(a, slot);
    const uint32_t same = __match_any_sync(kFull, e);
    const int rank = __popc(same & ((1u << lane) - 1u));
    if (e >= 0 && lane == __ffs(same) - 1) warp_counts[warp * E + e] = __popc(same);
    __syncthreads();
    if (e >= 0) {
      int row = running[e] + rank;
      for (int w = 0; w < warp; ++w) row += warp_counts[w * E + e];
      a.slot_rows[slot] = row;
      a.row_slots[row] = (int32_t)slot;
    } else if (slot < a.n_slots) {
      a.slot_rows[slot] = -1;
    }
    __syncthreads();
    for (int ee = threadIdx.x; ee < E; ee += blockDim.x) {
      int add = 0;
      for (int w = 0; w < kWarps; ++w) add += warp_counts[w * E + ee];
      running[ee] += add;
    }
    __syncthreads();
  }
}

// --- permute and gathers -------------------------------------------------------------------------

template <typename Unit>
__global__ void __launch_bounds__(128)
    permute_kernel(const Unit* x, const int32_t* row_slots, int top_k, int64_t units_per_row,
                   Unit* x_perm) {
  const int64_t r = blockIdx.x;
  const int32_t slot = row_slots[r];
  Unit* dst = x_perm + r * units_per_row;
  if (slot < 0) {
    for (int64_t i = threadIdx.x; i < units_per_row; i += blockDim.x) dst[i] = Unit{};
    return;
  }
  const Unit* src = x + (int64_t)(slot / top_k) * units_per_row;
  for (int64_t i = threadIdx.x; i < units_per_row; i += blockDim.x) dst[i] = src[i];
}

template <typename T>
__global__ void __launch_bounds__(128)
    gather_sum_kernel(const T* src, const int32_t* slot_rows, const float* gates, int top_k,
                      int64_t C, bool vec, T* dst) {
  const int64_t n = blockIdx.x;
  T* out = dst + n * C;
  for (int64_t c = threadIdx.x * 8; c < C; c += blockDim.x * 8) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int j = 0; j < top_k; ++j) {
      const int32_t row = slot_rows[n * top_k + j];
      if (row < 0) continue;
      const float g = gates ? gates[n * top_k + j] : 1.0f;
      float v[8];
      load8(src + (int64_t)row * C, c, C, vec, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = fmaf(g, v[i], acc[i]);
    }
    store8(out, c, C, vec, acc);
  }
}

template <typename T>
__global__ void __launch_bounds__(128)
    scale_rows_kernel(const T* dy, const float* gates, const int32_t* row_slots, int top_k,
                      int64_t C, bool vec, T* d_y_perm) {
  const int64_t r = blockIdx.x;
  const int32_t slot = row_slots[r];
  T* out = d_y_perm + r * C;
  const float g = slot >= 0 ? gates[slot] : 0.0f;
  const T* in = slot >= 0 ? dy + (int64_t)(slot / top_k) * C : nullptr;
  for (int64_t c = threadIdx.x * 8; c < C; c += blockDim.x * 8) {
    float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (in) {
      load8(in, c, C, vec, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] *= g;
    }
    store8(out, c, C, vec, v);
  }
}

template <typename T>
__global__ void __launch_bounds__(128)
    gate_grad_kernel(const T* dy, const T* y_perm, const int32_t* slot_rows, int64_t n_slots,
                     int top_k, int64_t C, bool vec, float* d_gates) {
  const int64_t s = (int64_t)blockIdx.x * 4 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (s >= n_slots) return;
  const int32_t row = slot_rows[s];
  float acc = 0.0f;
  if (row >= 0) {
    const T* a = dy + (s / top_k) * C;
    const T* b = y_perm + (int64_t)row * C;
    for (int64_t c = lane * 8; c < C; c += 32 * 8) {
      float va[8], vb[8];
      load8(a, c, C, vec, va);
      load8(b, c, C, vec, vb);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc = fmaf(va[i], vb[i], acc);
    }
  }
  acc = warp_sum(acc);
  if (lane == 0) d_gates[s] = acc;
}

// 16-byte vector accesses need every row to start on a 16-byte boundary.
template <typename T>
bool rows_aligned16(const void* p, int64_t C) {
  return is_aligned16(p) && (C * (int64_t)sizeof(T)) % 16 == 0;
}

// Runs f(std::integral_constant<int, values per lane>) for E experts.
template <typename F>
void with_router_width(int E, F&& f) {
  if (E <= 64) f(std::integral_constant<int, 2>{});
  else if (E <= 256) f(std::integral_constant<int, 8>{});
  else f(std::integral_constant<int, 32>{});
}

}  // namespace

void launch_router_forward(const RouterForwardArgs& a, cudaStream_t stream) {
  device_fill_async(a.expert_counts, 0, sizeof(int32_t) * a.n_experts, stream);
  if (a.n_tokens == 0) {
    if (a.losses) device_fill_async(a.losses, 0, 2 * sizeof(float), stream);
    return;
  }
  const int64_t chunk = std::max<int64_t>(256, (a.n_tokens + kLossChunks - 1) / kLossChunks);
  const int n_chunks = (int)((a.n_tokens + chunk - 1) / chunk);
  const size_t z_bytes = a.losses ? sizeof(float) * a.n_tokens : 0;
  const size_t partial_bytes = a.losses ? sizeof(float) * n_chunks * (a.n_experts + 1) : 0;
  StreamScratch scratch(z_bytes + partial_bytes, stream);
  float* z_terms = a.losses ? scratch.as<float>() : nullptr;
  float* partial = a.losses ? scratch.as<float>() + a.n_tokens : nullptr;
  const unsigned blocks = (unsigned)((a.n_tokens + kRouterWarps - 1) / kRouterWarps);
  with_router_width(a.n_experts, [&](auto width) {
    router_forward_kernel<decltype(width)::value><<<blocks, kRouterWarps * 32, 0, stream>>>(a, z_terms);
  });
  FOURBIT_CUDA_CHECK_LAUNCH();
  if (a.losses) {
    router_loss_partials_kernel<<<n_chunks, 256, 0, stream>>>(a.probs, z_terms, a.n_tokens,
                                                              a.n_experts, chunk, partial);
    FOURBIT_CUDA_CHECK_LAUNCH();
    router_loss_final_kernel<<<1, 256, 0, stream>>>(partial, n_chunks, a.expert_counts, a.n_tokens,
                                                    a.n_experts, a.losses);
    FOURBIT_CUDA_CHECK_LAUNCH();
  }
}

void launch_router_backward(const RouterBackwardArgs& a, cudaStream_t stream) {
  if (a.n_tokens == 0) return;
  const unsigned blocks = (unsigned)((a.n_tokens + kRouterWarps - 1) / kRouterWarps);
  with_router_width(a.n_experts, [&](auto width) {
    router_backward_kernel<decltype(width)::value><<<blocks, kRouterWarps * 32, 0, stream>>>(a);
  });
  FOURBIT_CUDA_CHECK_LAUNCH();
}

void launch_moe_plan(const MoePlanArgs& a, cudaStream_t stream) {
  const int E = a.n_experts;
  if (a.rows > 0) device_fill_async(a.row_slots, 0xFF, sizeof(int32_t) * a.rows, stream);
  const int n_chunks = (int)((a.n_slots + kPlanChunk - 1) / kPlanChunk);
  StreamScratch scratch(sizeof(int32_t) * 2 * (size_t)std::max(n_chunks, 1) * E, stream);
  int32_t* chunk_counts = scratch.as<int32_t>();
  int32_t* chunk_base = chunk_counts + (int64_t)n_chunks * E;
  if (n_chunks > 0) {
    plan_histogram_kernel<<<n_chunks, kPlanThreads, sizeof(int32_t) * E, stream>>>(a, chunk_counts);
    FOURBIT_CUDA_CHECK_LAUNCH();
  }
  plan_offsets_kernel<<<1, 1024, sizeof(int32_t) * E, stream>>>(a, chunk_counts, n_chunks,
                                                                chunk_base);
  FOURBIT_CUDA_CHECK_LAUNCH();
  if (n_chunks > 0) {
    const int smem = (int)sizeof(int32_t) * (1 + kPlanThreads / 32) * E;
    if (smem > 48 * 1024) {
      FOURBIT_CUDA_CHECK(cudaFuncSetAttribute(plan_ranks_kernel,
                                              cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    plan_ranks_kernel<<<n_chunks, kPlanThreads, smem, stream>>>(a, chunk_base);
    FOURBIT_CUDA_CHECK_LAUNCH();
  }
}

void launch_moe_permute(FloatType t, const void* x, const int32_t* row_slots, int64_t rows,
                        int top_k, int64_t channels, void* x_perm, cudaStream_t stream) {
  if (rows == 0 || channels == 0) return;
  const int64_t row_bytes = channels * (t == FloatType::kF32 ? 4 : 2);
  const auto aligned = [&](uintptr_t n) {
    return row_bytes % (int64_t)n == 0 && reinterpret_cast<uintptr_t>(x) % n == 0 &&
           reinterpret_cast<uintptr_t>(x_perm) % n == 0;
  };
  if (aligned(16)) {
    permute_kernel<uint4><<<(unsigned)rows, 128, 0, stream>>>(
        static_cast<const uint4*>(x), row_slots, top_k, row_bytes / 16, static_cast<uint4*>(x_perm));
  } else if (aligned(4)) {
    permute_kernel<uint32_t><<<(unsigned)rows, 128, 0, stream>>>(
        static_cast<const uint32_t*>(x), row_slots, top_k, row_bytes / 4,
        static_cast<uint32_t*>(x_perm));
  } else {
    permute_kernel<uint16_t><<<(unsigned)rows, 128, 0, stream>>>(
        static_cast<const uint16_t*>(x), row_slots, top_k, row_bytes / 2,
        static_cast<uint16_t*>(x_perm));
  }
  FOURBIT_CUDA_CHECK_LAUNCH();
}

void launch_moe_gather_sum(FloatType t, const void* src, const int32_t* slot_rows,
                           const float* gates, int64_t n_tokens, int top_k, int64_t channels,
                           void* dst, cudaStream_t stream) {
  if (n_tokens == 0 || channels == 0) return;
  with_float_type(t, [&](auto tag) {
    using T = decltype(tag);
    const bool vec = rows_aligned16<T>(src, channels) && rows_aligned16<T>(dst, channels);
    gather_sum_kernel<T><<<(unsigned)n_tokens, 128, 0, stream>>>(
        static_cast<const T*>(src), slot_rows, gates, top_k, channels, vec, static_cast<T*>(dst));
  });
  FOURBIT_CUDA_CHECK_LAUNCH();
}

void launch_moe_unpermute_backward(FloatType t, const void* dy, const void* y_perm,
                                   const float* gates, const int32_t* slot_rows,
                                   const int32_t* row_slots, int64_t n_tokens, int top_k,
                                   int64_t rows, int64_t channels, void* d_y_perm,
                                   float* d_gates, cudaStream_t stream) {
  const int64_t n_slots = n_tokens * top_k;
  with_float_type(t, [&](auto tag) {
    using T = decltype(tag);
    const bool vec = rows_aligned16<T>(dy, channels) && rows_aligned16<T>(y_perm, channels) &&
                     rows_aligned16<T>(d_y_perm, channels);
    if (rows > 0 && channels > 0) {
      scale_rows_kernel<T><<<(unsigned)rows, 128, 0, stream>>>(
          static_cast<const T*>(dy), gates, row_slots, top_k, channels, vec, static_cast<T*>(d_y_perm));
      FOURBIT_CUDA_CHECK_LAUNCH();
    }
    if (n_slots > 0) {
      gate_grad_kernel<T><<<(unsigned)((n_slots + 3) / 4), 128, 0, stream>>>(
          static_cast<const T*>(dy), static_cast<const T*>(y_perm), slot_rows, n_slots, top_k,
          channels, vec, d_gates);
      FOURBIT_CUDA_CHECK_LAUNCH();
    }
  });
}

}  // namespace fourbit::ops::kernels
