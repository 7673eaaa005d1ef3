// Kernels of test_ops_attention_wgmma_cuda: single wgmma products on known matrices, so that the
// wrappers of src/core/wgmma.cuh and the fragment layouts the attention kernels assume are
// checked on their own (if the attention test fails and this passes, the fault is in the attention
// logic, not in the instruction's use).
//
// One CTA of one warpgroup. A [64, 64] and B tiles are stored into 128-byte-swizzled shared memory
// with swizzled_offset (the attention loaders' layout), then:
//   ss: D[64, N] = A B^T, A and B [N, 64] both K-major (4 k-steps; N = 32, 64, 128);
//   rs: D[64, N] = A B,   A from registers in the mma.m16n8k16 A layout per warp, B [64, N] MN-major
//       (N = 64, 128 only: a 128-byte-swizzled MN-major tile is made of 64-column panels, and the
//       attention kernels use register-A products only with N = D; for N = 32 d_rs is not written).
// D is written back assuming the mma.m16n8k16 C layout per warp (warp w: rows 16 w ..).
#include "wgmma_probe_kernels.h"

#include "core/wgmma.cuh"

#include <cuda_runtime.h>

namespace fourbit::testing {
namespace {

namespace wg = fourbit::wgmma;

constexpr int kAlign = 1024;

__device__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// Stores a row-major [rows, cols] bf16 matrix into the swizzled tile at byte `tile` of smem.
template <int kRows>
__device__ void store_swizzled(unsigned char* smem, uint32_t tile, const uint16_t* m, int cols) {
  for (int i = threadIdx.x; i < kRows * cols; i += blockDim.x) {
    const int r = i / cols, c = i % cols;
    *reinterpret_cast<uint16_t*>(smem + tile + wg::swizzled_offset<kRows>(r, c / 8) + 2 * (c % 8)) = m[i];
  }
}

template <int N>
__device__ void store_acc(const float (&acc)[N / 8][4], float* d) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  for (int j = 0; j < N / 8; ++j)
    for (int e = 0; e < 4; ++e) d[(16 * warp + g + 8 * (e >> 1)) * N + 8 * j + 2 * t + (e & 1)] = acc[j][e];
}

template <int N>
constexpr bool kRegisterA = N >= 64;

// a: [64, 64]; b_nk: [N, 64]; b_kn: [64, N]; d_ss, d_rs: [64, N] f32.
template <int N>
__global__ void __launch_bounds__(128) probe_kernel(const uint16_t* a, const uint16_t* b_nk, const uint16_t* b_kn,
                                                    float* d_ss, float* d_rs) {
  extern __shared__ __align__(16) unsigned char raw[];
  const uint32_t raw_addr = smem_addr(raw);
  unsigned char* smem = raw + (((raw_addr + kAlign - 1) & ~uint32_t(kAlign - 1)) - raw_addr);
  const uint32_t base = smem_addr(smem);
  constexpr uint32_t kA = 0, kBnk = 64 * 64 * 2, kBkn = kBnk + N * 64 * 2;
  store_swizzled<64>(smem, kA, a, 64);
  store_swizzled<N>(smem, kBnk, b_nk, 64);
  if constexpr (kRegisterA<N>) store_swizzled<64>(smem, kBkn, b_kn, N);
  wg::fence_proxy_async();
  __syncthreads();

  float acc[N / 8][4];
  for (int j = 0; j < N / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  wg::wgmma_fence();
  for (int kk = 0; kk < 4; ++kk) wg::mma_ss<N>(acc, wg::k_major<64>(base + kA, kk), wg::k_major<N>(base + kBnk, kk), kk > 0);
  wg::wgmma_commit();
  wg::wgmma_wait<0>();
  wg::registers_fence(acc);
  store_acc<N>(acc, d_ss);

  if constexpr (kRegisterA<N>) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int r0 = 16 * warp + g, r1 = r0 + 8;
    auto pair = [&](int r, int c) { return (uint32_t)a[r * 64 + c] | ((uint32_t)a[r * 64 + c + 1] << 16); };
    uint32_t frag[4][4];
    for (int kc = 0; kc < 4; ++kc) {
      const int c = 16 * kc + 2 * t;
      frag[kc][0] = pair(r0, c);
      frag[kc][1] = pair(r1, c);
      frag[kc][2] = pair(r0, c + 8);
      frag[kc][3] = pair(r1, c + 8);
    }
    for (int j = 0; j < N / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    wg::wgmma_fence();
    for (int kc = 0; kc < 4; ++kc) wg::mma_rs<N>(acc, frag[kc], wg::mn_major<64>(base + kBkn, kc));
    wg::wgmma_commit();
    wg::wgmma_wait<0>();
    wg::registers_fence(acc);
    store_acc<N>(acc, d_rs);
  }
}

template <int N>
void launch(const uint16_t* a, const uint16_t* b_nk, const uint16_t* b_kn, float* d_ss, float* d_rs) {
  const int smem = kAlign + 64 * 64 * 2 + N * 64 * 2 + (kRegisterA<N> ? N * 64 * 2 : 0);
  cudaFuncSetAttribute(probe_kernel<N>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  probe_kernel<N><<<1, 128, smem>>>(a, b_nk, b_kn, d_ss, d_rs);
}

}  // namespace

cudaError_t run_wgmma_probe(int n, const uint16_t* a, const uint16_t* b_nk, const uint16_t* b_kn, float* d_ss,
                            float* d_rs) {
  if (n == 32) launch<32>(a, b_nk, b_kn, d_ss, d_rs);
  else if (n == 64) launch<64>(a, b_nk, b_kn, d_ss, d_rs);
  else if (n == 128) launch<128>(a, b_nk, b_kn, d_ss, d_rs);
  else return cudaErrorInvalidValue;
  const cudaError_t e = cudaGetLastError();
  return e != cudaSuccess ? e : cudaDeviceSynchronize();
}

}  // namespace fourbit::testing
