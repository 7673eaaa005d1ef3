// SwiGLU kernels: grid-stride over (row, 8-column group) items; a thread reads the 8 gate and 8 up
// values of its group (16-byte loads where the row pointers are aligned) and writes 8 outputs (or
// 8 d_gate and 8 d_up values). Each item reads and writes only its own elements, so the backward
// may run in place.
#include "ops/swiglu_kernels.h"

#include "core/error.h"
#include "ops/kernel_support.cuh"

namespace fourbit::ops::kernels {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

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
    for (int k = 0; k < 8; ++k) g[k] = g[k] * sigmoid(g[k]) * u[k];
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
    for (int k = 0; k < 8; ++k) {
      const float s = sigmoid(g[k]);
      const float silu = g[k] * s;
      const float dg = dy[k] * u[k] * s * (1.0f + g[k] * (1.0f - s));
      u[k] = dy[k] * silu;  // d up
      g[k] = dg;            // d gate
    }
    store8(dgate, c, hidden, vec, g);
    store8(dup, c, hidden, vec, u);
  }
}

}  // namespace

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
