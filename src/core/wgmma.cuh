// Hopper warpgroup MMA (wgmma, sm_90a): the PTX wrappers, the 128-byte-swizzled shared-memory
// tile layout they read, and its matrix descriptors. Users: the attention kernels
// (ops/attention_kernels.cu, BF16) and the FP8 block-scaled GEMM (gemm/fp8_wgmma_kernels.cu, E4M3).
//
// FP8 (E4M3) tiles use the same layout with bytes for elements: a row of 128 E4M3 values is one
// 128-byte panel row, and a K-major k-step of m64nNk32 (32 values) is the same +32 bytes as a BF16
// k16 step, so k_major<kRows>(tile, kk) addresses both. FP8 wgmma reads both operands K-major from
// shared memory (the PTX ISA allows no transposed FP8 operands).
//
// Tile layout ("swizzled tile"): a [kRows, D] bf16 tile (D a multiple of 64) is stored as D / 64
// panels of kRows x 128 bytes (64 columns each), panel p at p * kRows * 128 bytes. Within a panel,
// row r occupies bytes [128 r, 128 r + 128) and its 16-byte chunk c (columns 8 c .. 8 c + 7) sits
// at chunk position c ^ (r % 8): the 128-byte swizzle of the PTX ISA ("Shared Memory Matrix
// Layout", Swizzle<3, 4, 3>), which the hardware undoes given a descriptor with swizzle mode 1.
// Every panel starts on a 1024-byte boundary (kRows % 8 == 0 and 1024-aligned tile bases), so the
// swizzle pattern of an address depends only on its own bits and the descriptors' base offset is 0.
//
// Such a tile serves as either kind of wgmma operand:
//   K-major (the reduction index runs along the row: S = Q K^T reads Q and K this way): the
//     k-step kk (columns 16 kk .. 16 kk + 15) starts at panel kk / 4, byte 32 (kk % 4); the
//     stride between 8-row groups (SBO) is 1024 bytes; LBO is unused.
//   MN-major (the reduction index runs down the rows: dV = P^T dO reads dO this way, N = D): the
//     k-step kk (rows 16 kk .. 16 kk + 15) starts at byte 2048 kk; SBO = 1024 bytes (8 rows down),
//     LBO = the panel stride (the next 64 columns).
// The accumulator layout of m64nNk16 is the m16n8k16 C layout per warp (warp w of the warpgroup
// holds rows 16 w .. 16 w + 15; d[j][e] is column block j, element e as in mma.m16n8k16), and the
// register A operand is the m16n8k16 A layout per warp: P and dS go from accumulators to A
// operands without leaving the thread, as in FlashAttention-2 and -3.
//
// Ordering rules the callers follow: wgmma_fence() before the first wgmma that reads registers
// written by ordinary instructions (accumulators, A operands); wgmma_commit() closes a group;
// wgmma_wait<N>() waits until at most N groups are pending, after which the accumulators may be
// read (registers_fence() keeps the compiler from moving their uses above the wait). Shared
// memory written by ordinary or cp.async stores is made visible to wgmma (the async proxy) by
// fence_proxy_async() in the writing thread before the CTA barrier.
//
// The layout functions are host-callable too: tests/test_ops_attention_wgmma_layout.cpp checks on
// the CPU that every descriptor addresses, through the PTX ISA's canonical layouts, exactly the
// element that the swizzled load_tile (attention_kernels.cu) stored there.
#pragma once

#include "core/hd.h"

#include <cstdint>
#include <type_traits>

namespace fourbit::wgmma {

// Byte offset of 16-byte chunk `chunk` (columns 8 chunk ..) of row r in a swizzled tile of kRows rows.
template <int kRows>
FOURBIT_HD uint32_t swizzled_offset(int r, int chunk) {
  return (uint32_t)((chunk >> 3) * kRows * 128 + r * 128 + (((chunk & 7) ^ (r & 7)) << 4));
}

// The 64-bit shared-memory matrix descriptor, 128-byte swizzle, base offset 0.
FOURBIT_HD uint64_t descriptor(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return (uint64_t)((smem_addr & 0x3FFFFu) >> 4) | ((uint64_t)((lbo_bytes & 0x3FFFFu) >> 4) << 16) |
         ((uint64_t)((sbo_bytes & 0x3FFFFu) >> 4) << 32) | (1ull << 62);
}

// A descriptor plus a byte offset / 16 on its address field (bits 0-13). The same 64 bits as
// building the descriptor of the offset address whenever that address lies below 2^18 (all of
// shared memory): the field then takes the step without a carry into the fields above it. One
// 32-bit add on the low word, so a tile's k-steps share one descriptor and add constants
// (tests/test_ops_attention_wgmma_layout.cpp checks the equality at every 1024-aligned address).
FOURBIT_HD uint64_t advance(uint64_t desc, uint32_t step) {
  const uint32_t lo = (uint32_t)desc + step, hi = (uint32_t)(desc >> 32);
  return (uint64_t)hi << 32 | lo;
}

// K-major operand: k-step kk (16 reduction columns) of a swizzled tile of kRows rows at tile_addr:
// +32 bytes a k-step within a 64-column panel, panels kRows * 128 bytes apart.
template <int kRows>
FOURBIT_HD uint64_t k_major(uint32_t tile_addr, int kk) {
  return advance(descriptor(tile_addr, 16, 1024), (uint32_t)((kk >> 2) * kRows * 128 + (kk & 3) * 32) >> 4);
}

// MN-major operand: k-step kk (16 reduction rows) of a swizzled tile of kRows rows at tile_addr:
// +2048 bytes (16 rows) a k-step; 64-column panels kRows * 128 bytes apart (LBO).
template <int kRows>
FOURBIT_HD uint64_t mn_major(uint32_t tile_addr, int kk) {
  return advance(descriptor(tile_addr, kRows * 128, 1024), (uint32_t)(kk * 2048) >> 4);
}

#if defined(__CUDACC__)

// The 32-bit shared-state-space address of a pointer into shared memory (what the descriptors
// above and the PTX shared-memory operands take).
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FOURBIT_WGMMA_AVAILABLE 1
#else
#define FOURBIT_WGMMA_AVAILABLE 0
#endif

__device__ __forceinline__ void wgmma_fence() {
#if FOURBIT_WGMMA_AVAILABLE
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if FOURBIT_WGMMA_AVAILABLE
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if FOURBIT_WGMMA_AVAILABLE
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
__device__ __forceinline__ void fence_proxy_async() {
#if FOURBIT_WGMMA_AVAILABLE
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Pins registers in place across a wait: accumulators (float; no use moved above the wait) and
// register A operands (uint32_t; not reused while an in-flight wgmma reads them). Takes any number
// of [NB][4] arrays.
template <typename R, int NB, typename... More>
__device__ __forceinline__ void registers_fence(R (&r)[NB][4], More&... more) {
#pragma unroll
  for (int j = 0; j < NB; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if constexpr (std::is_same_v<R, float>) asm volatile("" : "+f"(r[j][e])::"memory");
      else asm volatile("" : "+r"(r[j][e])::"memory");
    }
  if constexpr (sizeof...(More) > 0) registers_fence(more...);
}

#if FOURBIT_WGMMA_AVAILABLE
// The operand lists of the wgmma wrappers: accumulator row-blocks d[i] (4 floats each) as "+f"
// constraints, and the matching "%n" register lists of the instruction text.
#define FOURBIT_WGMMA_D4(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define FOURBIT_WGMMA_D16(i) FOURBIT_WGMMA_D4(i), FOURBIT_WGMMA_D4(i + 1), FOURBIT_WGMMA_D4(i + 2), FOURBIT_WGMMA_D4(i + 3)
#define FOURBIT_WGMMA_D32 FOURBIT_WGMMA_D16(0), FOURBIT_WGMMA_D16(4)
#define FOURBIT_WGMMA_D64 FOURBIT_WGMMA_D32, FOURBIT_WGMMA_D16(8), FOURBIT_WGMMA_D16(12)
#define FOURBIT_WGMMA_R16(a, b, c, d_, e, f, g, h, i, j, k, l, m, n, o, p)                                    \
  "%" #a ", %" #b ", %" #c ", %" #d_ ", %" #e ", %" #f ", %" #g ", %" #h ", %" #i ", %" #j ", %" #k ", %" #l \
  ", %" #m ", %" #n ", %" #o ", %" #p
#define FOURBIT_WGMMA_R32                                                                           \
  FOURBIT_WGMMA_R16(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15) ", " FOURBIT_WGMMA_R16(   \
      16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31)
#define FOURBIT_WGMMA_R64                                                                           \
  FOURBIT_WGMMA_R32 ", " FOURBIT_WGMMA_R16(32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, \
                                           46, 47) ", " FOURBIT_WGMMA_R16(48, 49, 50, 51, 52, 53, \
                                                                          54, 55, 56, 57, 58, 59, \
                                                                          60, 61, 62, 63)
// The shared-memory-operand wrappers: D[64 x N] (+)= A B over one k-step, A and B K-major in
// shared memory; accumulate = 0 overwrites D. NAME(d, desc_a, desc_b, accumulate) with d
// [NB][4] (N / 2 floats a thread); A, B, P: the operand numbers of the two descriptors and the
// accumulate flag (after the N / 2 accumulators); FLAGS: the instruction's scale (and, for BF16,
// transpose) immediates.
#define FOURBIT_WGMMA_SS(NAME, NB, SHAPE_TYPES, RLIST, DLIST, A, B, P, FLAGS)                              \
  __device__ __forceinline__ void NAME(float(&d)[NB][4], uint64_t desc_a, uint64_t desc_b, int accumulate) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #P ", 0;\n"                                            \
                 "wgmma.mma_async.sync.aligned." SHAPE_TYPES " {" RLIST "}, %" #A ", %" #B ", p, " FLAGS     \
                 ";\n}\n"                                                                                    \
                 : DLIST                                                                                     \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                              \
  }

// BF16, k-steps of 16: N = 32, 64, 128.
FOURBIT_WGMMA_SS(wgmma_ss_n32, 4, "m64n32k16.f32.bf16.bf16",
                 FOURBIT_WGMMA_R16(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), FOURBIT_WGMMA_D16(0),
                 16, 17, 18, "1, 1, 0, 0")
FOURBIT_WGMMA_SS(wgmma_ss_n64, 8, "m64n64k16.f32.bf16.bf16", FOURBIT_WGMMA_R32, FOURBIT_WGMMA_D32, 32, 33, 34,
                 "1, 1, 0, 0")
FOURBIT_WGMMA_SS(wgmma_ss_n128, 16, "m64n128k16.f32.bf16.bf16", FOURBIT_WGMMA_R64, FOURBIT_WGMMA_D64, 64, 65, 66,
                 "1, 1, 0, 0")
// E4M3 x E4M3, k-steps of 32: N = 128. The tensor cores add FP8 products into the
// accumulators with less than FP32 precision: callers promote partial sums into FP32 registers at
// least every 128 elements of K (NUMERICS.md 6).
FOURBIT_WGMMA_SS(wgmma_ss_e4m3_n128, 16, "m64n128k32.f32.e4m3.e4m3", FOURBIT_WGMMA_R64, FOURBIT_WGMMA_D64, 64, 65,
                 66, "1, 1")
#undef FOURBIT_WGMMA_SS

// D[64 x N] += A[64 x 16] B[16 x N], A in registers (the mma.m16n8k16 A layout, warp w holding
// rows 16 w ..), B from shared memory, MN-major. N = 64, 128 (the attention kernels' N = D; a
// 128-byte-swizzled MN-major tile is 64 columns wide).
__device__ __forceinline__ void wgmma_rs_n64(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" FOURBIT_WGMMA_R32
               "}, {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
               : FOURBIT_WGMMA_D32
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" FOURBIT_WGMMA_R64
               "}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
               : FOURBIT_WGMMA_D64
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

#undef FOURBIT_WGMMA_D4
#undef FOURBIT_WGMMA_D16
#undef FOURBIT_WGMMA_D32
#undef FOURBIT_WGMMA_D64
#undef FOURBIT_WGMMA_R16
#undef FOURBIT_WGMMA_R32
#undef FOURBIT_WGMMA_R64
#endif  // FOURBIT_WGMMA_AVAILABLE

// D[64 x N] (+)= A B over one k-step, A and B K-major in shared memory; accumulate = 0 overwrites D.
template <int N>
__device__ __forceinline__ void mma_ss(float (&d)[N / 8][4], uint64_t desc_a, uint64_t desc_b, int accumulate) {
#if FOURBIT_WGMMA_AVAILABLE
  if constexpr (N == 32) wgmma_ss_n32(d, desc_a, desc_b, accumulate);
  else if constexpr (N == 64) wgmma_ss_n64(d, desc_a, desc_b, accumulate);
  else wgmma_ss_n128(d, desc_a, desc_b, accumulate);
#else
  (void)d, (void)desc_a, (void)desc_b, (void)accumulate;
  __trap();
#endif
}

// D[64 x N] += A B over one k-step, A in registers, B MN-major in shared memory.
template <int N>
__device__ __forceinline__ void mma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc_b) {
  static_assert(N == 64 || N == 128, "register-A products with N = 64 or 128");
#if FOURBIT_WGMMA_AVAILABLE
  if constexpr (N == 64) wgmma_rs_n64(d, a, desc_b);
  else wgmma_rs_n128(d, a, desc_b);
#else
  (void)d, (void)a, (void)desc_b;
  __trap();
#endif
}

// D[64 x 128] (+)= A B over one k-step of 32 E4M3 values, A and B K-major in shared memory.
__device__ __forceinline__ void mma_ss_e4m3_n128(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b, int accumulate) {
#if FOURBIT_WGMMA_AVAILABLE
  wgmma_ss_e4m3_n128(d, desc_a, desc_b, accumulate);
#else
  (void)d, (void)desc_a, (void)desc_b, (void)accumulate;
  __trap();
#endif
}

#endif  // __CUDACC__

}  // namespace fourbit::wgmma
