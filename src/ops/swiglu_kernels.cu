// SwiGLU kernels: grid-stride over (row, 8-column group) items; a thread reads the 8 gate and 8 up
// values of its group (16-byte loads where the row pointers are aligned) and writes 8 outputs (or
// 8 d_gate and 8 d_up values). Each item reads and writes only its own elements, so the backward
// may run in place.
//
// The *_amax variants (bf16) also accumulate the global amaxes of what they write (OutputAmaxes):
// a thread takes strips of 16 rows x 2 columns of F (output_amax.cuh). The values written are
// those of the plain kernels (the same helpers, swiglu_value / swiglu_gradients).
#include "ops/swiglu_kernels.h"

#include "core/error.h"
#include "ops/kernel_support.cuh"
#include "ops/output_amax.cuh"

#include <algorithm>

namespace fourbit::ops::kernels {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

// out = silu(g) * u
__device__ __forceinline__ float swiglu_value(float g, float u) { return g * sigmoid(g) * u; }

// g <- d gate, u <- d up, from dy = d out.
__device__ __forceinline__ void swiglu_gradients(float& g, float& u, float dy) {
  const float s = sigmoid(g);
  const float silu = g * s;
  const float dg = dy * u * s * (1.0f + g * (1.0f - s));
  u = dy * silu;  // d up
  g = dg;         // d gate
}

template <typename T>
__global__ void swiglu_forward_kernel(T* __restrict__ out, const T* __restrict__ gate_up,
                                      int64_t n_rows, int64_t hidden) {
  core::pdl_allow_dependents();  // a PDL-launched consumer (the decode GEMV) may start loading its weights
  core::pdl_wait_for_producer();  // launched with PDL (core/pdl.cuh): nothing is read before this
  const int64_t groups = (hidden + 7) / 8;
  const int64_t items = n_rows * groups;
  for (int64_t it = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; it < items;
       it += (int64_t)gridDim.x * blockDim.x) {
    const int64_t n = it / groups, c = (it % groups) * 8;
    const T* gate = gate_up + n * 2 * hidden;
    const T* up = gate + hidden;
    T* o = out + n * hidden;
    const bool vec = is_aligned16(gate) && is_aligned16(up) && is_aligned16(o);
    float g[8], u[8];
    load8(gate, c, hidden, vec, g);
    load8(up, c, hidden, vec, u);
#pragma unroll
    for (int k = 0; k < 8; ++k) g[k] = swiglu_value(g[k], u[k]);
    store8(o, c, hidden, vec, g);
  }
}

// No __restrict__ on d_gate_up / gate_up: they are the same buffer in the in-place variant.
template <typename T>
__global__ void swiglu_backward_kernel(T* d_gate_up, const T* __restrict__ dout,
                                       const T* gate_up, int64_t n_rows, int64_t hidden) {
  const int64_t groups = (hidden + 7) / 8;
  const int64_t items = n_rows * groups;
  for (int64_t it = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; it < items;
       it += (int64_t)gridDim.x * blockDim.x) {
    const int64_t n = it / groups, c = (it % groups) * 8;
    const T* gate = gate_up + n * 2 * hidden;
    const T* up = gate + hidden;
    const T* d = dout + n * hidden;
    T* dgate = d_gate_up + n * 2 * hidden;
    T* dup = dgate + hidden;
    const bool vec = is_aligned16(gate) && is_aligned16(up) && is_aligned16(d) &&
                     is_aligned16(dgate) && is_aligned16(dup);
    float g[8], u[8], dy[8];
    load8(gate, c, hidden, vec, g);
    load8(up, c, hidden, vec, u);
    load8(d, c, hidden, vec, dy);
#pragma unroll
    for (int k = 0; k < 8; ++k) swiglu_gradients(g[k], u[k], dy[k]);
    store8(dgate, c, hidden, vec, g);
    store8(dup, c, hidden, vec, u);
  }
}

// --- the variants that also compute the output's amaxes -------------------------------------------

static_assert(kAmaxThreads == kThreads, "the amax kernels run 256 threads (output_amax.cuh)");

__global__ void __launch_bounds__(kThreads, 2) swiglu_forward_amax_kernel(bf16_t* __restrict__ out,
                                                                       const bf16_t* __restrict__ gate_up,
                                                                       int64_t n_rows, int64_t hidden,
                                                                       OutputAmaxes a) {
  core::pdl_allow_dependents();
  core::pdl_wait_for_producer();  // launched with PDL (core/pdl.cuh): nothing is read before this
  amax_strip_loop<1>(n_rows, hidden, a, [&](int64_t r0, int64_t c, float (&v)[1][2][kStripRows]) {
    uint32_t g[kStripRows], u[kStripRows];
#pragma unroll
    for (int i = 0; i < kStripRows; ++i) {
      const bf16_t* gate = gate_up + (r0 + i) * 2 * hidden + c;
      g[i] = load_word(gate);
      u[i] = load_word(gate + hidden);
    }
#pragma unroll
    for (int i = 0; i < kStripRows; ++i) {
      v[0][0][i] = swiglu_value(lo_of(g[i]), lo_of(u[i]));
      v[0][1][i] = swiglu_value(hi_of(g[i]), hi_of(u[i]));
      store_pair(out + (r0 + i) * hidden + c, v[0][0][i], v[0][1][i]);
    }
  });
}

// No __restrict__ on d_gate_up / gate_up: they are the same buffer in the in-place use.
__global__ void __launch_bounds__(kThreads, 2) swiglu_backward_amax_kernel(bf16_t* d_gate_up,
                                                                        const bf16_t* __restrict__ dout,
                                                                        const bf16_t* gate_up,
                                                                        int64_t n_rows, int64_t hidden,
                                                                        OutputAmaxes a) {
  amax_strip_loop<2>(n_rows, hidden, a, [&](int64_t r0, int64_t c, float (&v)[2][2][kStripRows]) {
    uint32_t g[kStripRows], u[kStripRows], d[kStripRows];
#pragma unroll
    for (int i = 0; i < kStripRows; ++i) {  // every load before the first (in-place) store
      const bf16_t* gate = gate_up + (r0 + i) * 2 * hidden + c;
      g[i] = load_word(gate);
      u[i] = load_word(gate + hidden);
      d[i] = load_word(dout + (r0 + i) * hidden + c);
    }
#pragma unroll
    for (int i = 0; i < kStripRows; ++i) {
      bf16_t* dgate = d_gate_up + (r0 + i) * 2 * hidden + c;
      float g0 = lo_of(g[i]), g1 = hi_of(g[i]), u0 = lo_of(u[i]), u1 = hi_of(u[i]);
      const float dy0 = lo_of(d[i]), dy1 = hi_of(d[i]);
      swiglu_gradients(g0, u0, dy0);
      swiglu_gradients(g1, u1, dy1);
      store_pair(dgate, g0, g1);           // d gate (g0, g1 now hold the stored values)
      store_pair(dgate + hidden, u0, u1);  // d up
      v[0][0][i] = g0, v[0][1][i] = g1, v[1][0][i] = u0, v[1][1][i] = u1;
    }
  });
}

}  // namespace

void launch_swiglu_forward_amax(void* out, const void* gate_up, int64_t n_rows, int64_t hidden,
                                const OutputAmaxes& amaxes, cudaStream_t stream) {
  if (n_rows == 0 || hidden == 0) return;
  FOURBIT_CUDA_CHECK(core::launch_pdl(swiglu_forward_amax_kernel, dim3(amax_strip_grid(n_rows, hidden)),
                                      dim3(kThreads), 0, stream, static_cast<bf16_t*>(out),
                                      static_cast<const bf16_t*>(gate_up), n_rows, hidden, amaxes));
  FOURBIT_CUDA_CHECK_LAUNCH();
}

void launch_swiglu_backward_amax(void* d_gate_up, const void* dout, const void* gate_up,
                                 int64_t n_rows, int64_t hidden, const OutputAmaxes& amaxes,
                                 cudaStream_t stream) {
  if (n_rows == 0 || hidden == 0) return;
  swiglu_backward_amax_kernel<<<amax_strip_grid(n_rows, hidden), kThreads, 0, stream>>>(
      static_cast<bf16_t*>(d_gate_up), static_cast<const bf16_t*>(dout),
      static_cast<const bf16_t*>(gate_up), n_rows, hidden, amaxes);
  FOURBIT_CUDA_CHECK_LAUNCH();
}

void launch_swiglu_forward(void* out, const void* gate_up, FloatType type, int64_t n_rows,
                           int64_t hidden, cudaStream_t stream) {
  const int64_t items = n_rows * ((hidden + 7) / 8);
  if (items == 0) return;
  with_float_type(type, [&](auto t) {
    using T = decltype(t);
    FOURBIT_CUDA_CHECK(core::launch_pdl(swiglu_forward_kernel<T>, dim3(grid_for(items, kThreads)), dim3(kThreads), 0,
                                        stream, static_cast<T*>(out), static_cast<const T*>(gate_up), n_rows,
                                        hidden));
  });
  FOURBIT_CUDA_CHECK_LAUNCH();
}

void launch_swiglu_backward(void* d_gate_up, const void* dout, const void* gate_up,
                            FloatType type, int64_t n_rows, int64_t hidden, cudaStream_t stream) {
  const int64_t items = n_rows * ((hidden + 7) / 8);
  if (items == 0) return;
  with_float_type(type, [&](auto t) {
    using T = decltype(t);
    swiglu_backward_kernel<T><<<grid_for(items, kThreads), kThreads, 0, stream>>>(
        static_cast<T*>(d_gate_up), static_cast<const T*>(dout), static_cast<const T*>(gate_up),
        n_rows, hidden);
  });
  FOURBIT_CUDA_CHECK_LAUNCH();
}

}  // namespace fourbit::ops::kernels
