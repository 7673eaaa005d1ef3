// fourbit's Hopper FP8 GEMM for a 1x128-block-scaled A and a 1x128- or 128x128-block-scaled B
// (contract: fp8_wgmma_kernels.h).
//
// Why it exists: cuBLASLt's VEC128_32F x VEC128_32F kernels (the DeepSeek-V3 Wgrad pair) run at
// about 1.0-1.16x its BF16 GEMMs on an H100, against 1.3-1.5x for 1x128 x 128x128
// (bench/results/results-2026-12-04-da35fdb.md), and Wgrad is a third of a training step's GEMM
// FLOPs under the fp8 recipe.
//
// Structure (the warp-specialized design of DeepGEMM and CUTLASS's sm90 kernels, written from the
// PTX ISA): 128 x kBlockN tiles of C (kBlockN = 128 or 256), 384 threads a CTA, a persistent grid
// (as many CTAs as can be resident; each walks tiles first, first + grid, ... in groups of row
// tiles that share B tiles in L2), optionally clusters of 2 CTAs along M that share each B tile
// by TMA multicast (half of it loaded by each).
//   - Warpgroup 0 is the producer: one thread streams the K blocks (128 values each) of the A and B
//     tiles into a ring of kStages shared-memory stages with TMA (128-byte swizzle, out-of-range
//     rows and K columns filled with zeros), and the 1x128 scale rows of that block (sa for the
//     tile's 128 rows, sb for its kBlockN columns; a 128x128 B's scales are read from global
//     memory by the consumers instead, one per half) with bulk copies; an mbarrier per stage counts
//     the bytes ("full"), another the consumer warps' releases ("empty").
//   - Warpgroups 1 and 2 are the consumers: each owns 64 rows of the tile. Per K block and per
//     128-column chunk (kBlockN 256: two) it issues four m64n128k32 E4M3 wgmmas into a partial-sum
//     register tile (FP32, restarted each block) and promotes it: acc += part * (sa[row] *
//     sb[col]) (128x128 B: sb of the chunk's 128-column block). With 256 columns each chunk is
//     waited for and promoted in turn (128 accumulators leave room for one partial tile), and only
//     the other consumer's wgmmas keep the tensor cores busy meanwhile. With 128 columns (64
//     accumulators) the partial tiles are double-buffered: block kb + 1's wgmmas are issued before
//     block kb is waited for (wait_group 1) and promoted, as cuBLASLt's 128 x 128 kernels for these
//     pairs do (the nvjet_sm90_qqtst_128x128_128x6_1x2 kernels: 6 stages, clusters of 2).
//   - Epilogue: C = alpha * acc (+ beta * S) straight from registers (column pairs as one store),
//     rows and columns checked against M and N, while the producer already loads the next tile.
//   - Stages and phases run on over tiles (a count of K blocks passed); with clusters each stage's
//     empty barrier counts one release per consumer warp of both CTAs (either CTA's multicast
//     writes into both), and cluster barriers at the start (barriers initialized) and the end (no
//     CTA leaves while its peer may still arrive on its barriers) bracket the kernel.
// Registers: the producer gives its registers up (setmaxnreg 40), the consumers take 232 each
// (40 + 2 * 232 = 3 * 168, the launch bound's share), enough for kBlockN = 256 (128 accumulators,
// 64 partial sums) and 128 (64 accumulators, 2 x 64 partial sums).
// Measured (H100, bench gemm; bench/notes-train.md "Session 25"): correct (the GPU tests), but
// 10-25% slower than cuBLASLt's 1x128 x 1x128 kernels at the 1.3b Wgrad shapes and slower than
// its 1x128 x 128x128 ones everywhere, so backend auto does not pick it by default. Tried and
// dropped: 128 x 128 and 128 x 192 tiles as two halves of 64 / 96 columns issued together, half 0
// promoted while half 1 runs (450-680 TFLOP/s against 715-800 for this 128 x 256 tile); 192
// columns as one m64n192k32 chunk (0.6-0.9x of the 256-column tile at every 1.3b Wgrad shape,
// 684dbaa; notes-train.md "Session 27"). The double-buffered 128-column tiles (H200, db1b55b) run
// at 0.91-1.0x of the 256-column ones (clusters of 2: 0.93-1.04x), so the tensor cores' wait for
// one warpgroup's promotion is not what holds the kernel back either; 256 stays the default.
//
// Numerics: every product of two E4M3 values is exact in FP32; the tensor cores sum the 128
// products of a block with their own (reduced) precision, as in cuBLASLt's split accumulator; the
// per-block scale product and the promotion are FP32 (fmaf(part, sa * sb, acc)). The GPU test
// (tests/test_gemm_cuda.cpp) holds it to the same bound against the float64 reference as cuBLASLt.
#include "gemm/fp8_wgmma_kernels.h"

#include "core/error.h"
#include "core/sm_count.h"
#include "core/wgmma.cuh"
#include "gemm/tensor_map.h"

#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <type_traits>

namespace fourbit::gemm::kernels {
namespace {

constexpr int kBlockM = 128;  // rows of A (and of C) per CTA: two consumer warpgroups of 64
constexpr int kBlockK = 128;  // one scale block: 128 E4M3 values = one 128-byte swizzled row
constexpr int kThreads = 384;
constexpr int kGroupM = 8;    // tiles of M walked together (the CTAs of a wave share B tiles in L2)

// kBlockN columns a tile (128 or 256), issued as kChunks wgmma chunks of 128 columns.
template <int kBlockN_>
struct Tiling {
  static_assert(kBlockN_ == 128 || kBlockN_ == 256, "tiles of 128 or 256 columns");
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kChunkN = 128;
  static constexpr int kChunks = kBlockN / kChunkN;
  static constexpr int kABytes = kBlockM * kBlockK;
  static constexpr int kBBytes = kBlockN * kBlockK;
  static constexpr int kStageBytes = kABytes + kBBytes;   // 1024-byte multiple: tiles stay aligned
  static constexpr int kStages = 200 * 1024 / kStageBytes < 6 ? 200 * 1024 / kStageBytes : 6;  // 6, 4
  static constexpr int kScaleFloats = kBlockM + kBlockN;  // sa then sb, per stage
  static constexpr size_t kSmemBytes =
      1024 + (size_t)kStages * kStageBytes + (size_t)kStages * kScaleFloats * 4 + 2 * kStages * 8;
};

using wgmma::smem_u32;

#if FOURBIT_WGMMA_AVAILABLE

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// Waits until the phase of `bar` with this parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// TMA: the box at (x = K offset, y = row offset) of a 2D tensor map into shared memory.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int x, int y, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(smem_u32(bar))
      : "memory");
}
// Bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned) into shared memory.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

// The same box, written into the same shared-memory offset of every CTA of the cluster in
// `cta_mask`, each CTA's mbarrier at `bar`'s offset counting the bytes that reach it.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const CUtensorMap* map, int x, int y, uint64_t* bar,
                                                      uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(smem_u32(bar)), "h"(cta_mask)
      : "memory");
}
// The shared::cluster address of `x`'s offset in CTA `rank` of the cluster (this CTA included);
// offsets from it address the same offsets in that CTA.
__device__ __forceinline__ uint32_t cluster_address(const void* x, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_u32(x)), "r"(rank));
  return remote;
}
// Arrives on the mbarrier at shared::cluster address `bar` (cluster_address), with the default
// (.release.cta) semantics: what it orders is this thread's completed shared-memory reads before
// the peer's TMA overwrites them. (.release.cluster put a full memory barrier, ERRBAR, before
// every arrival: 23% of the stall samples and half the speed, ncu at 1602b9f.)
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// Every thread of every CTA of the cluster: arrive, then wait for all (release / acquire).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

#endif  // FOURBIT_WGMMA_AVAILABLE

// Elements at and at + 1 of an f32 or bf16 matrix, as one 8- or 4-byte access where `vector` (the
// caller checked the alignment), else two.
__device__ __forceinline__ float2 load_pair(const float* x, bool vector) {
  return vector ? *reinterpret_cast<const float2*>(x) : make_float2(x[0], x[1]);
}
__device__ __forceinline__ float2 load_pair(const __nv_bfloat16* x, bool vector) {
  return vector ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(x))
                : make_float2(__bfloat162float(x[0]), __bfloat162float(x[1]));
}
__device__ __forceinline__ void store_pair(float* x, float v0, float v1, bool vector) {
  if (vector) {
    *reinterpret_cast<float2*>(x) = make_float2(v0, v1);
  } else {
    x[0] = v0;
    x[1] = v1;
  }
}
__device__ __forceinline__ void store_pair(__nv_bfloat16* x, float v0, float v1, bool vector) {
  if (vector) {
    *reinterpret_cast<__nv_bfloat162*>(x) = __floats2bfloat162_rn(v0, v1);
  } else {
    x[0] = __float2bfloat16_rn(v0);
    x[1] = __float2bfloat16_rn(v1);
  }
}

// Tile (tm, tn) of `index`: group_m row tiles at a time, column by column within the group.
__device__ __forceinline__ void tile_of(int index, int tiles_m, int tiles_n, int group_m, int& tm, int& tn) {
  const int per_group = group_m * tiles_n;
  const int group = index / per_group, first_m = group * group_m;
  const int group_rows = min(tiles_m - first_m, group_m);
  const int in_group = index % per_group;
  tm = first_m + in_group % group_rows;
  tn = in_group / group_rows;
}

// kCluster CTAs (1 or 2) along M form a cluster that shares the B tile: CTA r loads rows
// [r, r + 1) * kBlockN / kCluster of it and multicasts them to every CTA of the cluster, so the
// cluster reads B from L2 once instead of kCluster times (cluster tiles: ceil(tiles_m / kCluster)
// * tiles_n; a CTA whose rows are all beyond M still loads and multicasts its part of B).
template <int kBlockN, bool kB2d, int kCluster>
__global__ void __launch_bounds__(kThreads, 1)
    fp8_block_gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                            Fp8BlockGemmParams p) {
#if FOURBIT_WGMMA_AVAILABLE
  using T = Tiling<kBlockN>;
  constexpr int kChunks = T::kChunks, kChunkN = T::kChunkN, kJ = kChunkN / 8;  // kJ column blocks of 8 a chunk
  // One chunk (128 columns): its partial sums are double-buffered (see the consumer loop).
  constexpr bool kPipelined = kChunks == 1;
  static_assert(kCluster == 1 || kCluster == 2, "clusters of 1 or 2 CTAs along M");
  constexpr int kBRowsPerCta = T::kBlockN / kCluster;  // rows of the B tile this CTA loads (and multicasts)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* tiles = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  float* scales = reinterpret_cast<float*>(tiles + (size_t)T::kStages * T::kStageBytes);
  uint64_t* full = reinterpret_cast<uint64_t*>(scales + T::kStages * T::kScaleFloats);
  uint64_t* empty = full + T::kStages;

  const int m = (int)p.m, n = (int)p.n;
  const int tiles_m = (m + kBlockM - 1) / kBlockM, tiles_n = (n + T::kBlockN - 1) / T::kBlockN;
  const int cluster_rows = (tiles_m + kCluster - 1) / kCluster;  // row tiles of kCluster * kBlockM rows
  const int cluster_tiles = cluster_rows * tiles_n;
  const int rank = kCluster == 1 ? 0 : (int)cluster_rank();  // blockIdx.x % kCluster
  // Persistent: the cluster walks the cluster tiles first, first + stride, ...; both CTAs of a
  // cluster take the same ones (same columns: the shared B tile), rows rank apart.
  const int first_tile = (int)blockIdx.x / kCluster, tile_stride = (int)gridDim.x / kCluster;
  const auto tile_origin = [&](int t, int& m0, int& n0) {
    int tm, tn;
    tile_of(t, cluster_rows, tiles_n, kGroupM / kCluster, tm, tn);
    m0 = (tm * kCluster + rank) * kBlockM;
    n0 = tn * T::kBlockN;
  };
  const int blocks = (int)((p.k + kBlockK - 1) / kBlockK);
  const int warpgroup = (int)threadIdx.x / 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < T::kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 8 * kCluster);  // one release per consumer warp of every CTA of the cluster
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if constexpr (kCluster > 1) {
    cluster_sync();  // the peers' barriers exist before anything is multicast or arrives on them
  } else {
    __syncthreads();
  }

  // Both roles count the K blocks they have passed over all tiles (`it`): stage it % kStages,
  // phase (it / kStages) & 1. The producer runs up to kStages blocks ahead, into the next tile
  // while the consumers write this one's epilogue.
  if (warpgroup == 0) {  // producer
    setmaxnreg_dec<40>();
    if (threadIdx.x == 0) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map_a)) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map_b)) : "memory");
      int it = 0;
      for (int t = first_tile; t < cluster_tiles; t += tile_stride) {
        int m0, n0;
        tile_origin(t, m0, n0);
        const uint32_t sa_bytes = 4u * (uint32_t)max(0, min(kBlockM, m - m0));
        const uint32_t sb_bytes = kB2d ? 0u : 4u * (uint32_t)min(T::kBlockN, n - n0);
        for (int kb = 0; kb < blocks; ++kb, ++it) {
          const int s = it % T::kStages;
          // Free when every consumer warp of the cluster has released it (this CTA's multicast
          // writes into the peers' stage s as well).
          mbar_wait(&empty[s], ((uint32_t)(it / T::kStages) & 1u) ^ 1u);
          uint8_t* stage = tiles + (size_t)s * T::kStageBytes;
          float* stage_scales = scales + s * T::kScaleFloats;
          // The whole B tile reaches every CTA: its own part and the peers' multicasts, which may
          // land before this expect_tx (the phase cannot complete before this arrival).
          mbar_expect_tx(&full[s], (uint32_t)T::kStageBytes + sa_bytes + sb_bytes);
          tma_load_2d(stage, &map_a, kb * kBlockK, m0, &full[s]);
          uint8_t* b_part = stage + T::kABytes + rank * kBRowsPerCta * kBlockK;
          if constexpr (kCluster == 1) {
            tma_load_2d(b_part, &map_b, kb * kBlockK, n0, &full[s]);
          } else {
            tma_load_2d_multicast(b_part, &map_b, kb * kBlockK, n0 + rank * kBRowsPerCta, &full[s],
                                  (uint16_t)((1u << kCluster) - 1u));
          }
          if (sa_bytes > 0) bulk_load(stage_scales, p.scales_a + (int64_t)kb * m + m0, sa_bytes, &full[s]);
          if constexpr (!kB2d) bulk_load(stage_scales + kBlockM, p.scales_b + (int64_t)kb * n + n0, sb_bytes, &full[s]);
        }
      }
    }
    __syncwarp();
    if constexpr (kCluster > 1) cluster_sync();  // matches the consumers' final one
    return;
  }

  setmaxnreg_inc<232>();
  const int consumer = warpgroup - 1;  // rows 64 consumer .. of the tile
  const int warp = ((int)threadIdx.x / 32) % 4, lane = (int)threadIdx.x % 32;
  const int row_in_tile = consumer * 64 + warp * 16 + lane / 4;  // and row_in_tile + 8
  const int col_in_half = 2 * (lane % 4);                        // + 8 j (+ 1)
  const bool read_source = p.beta != 0.0f;
  const void* source = p.c_source != nullptr ? p.c_source : p.c;
  // Column pairs (col even; N is a multiple of 4) go out as one 8-byte (f32) or 4-byte (bf16)
  // store where C's and S's rows keep that alignment.
  const uintptr_t pair_bytes = p.c_bf16 ? 4 : 8;
  const bool pairs = p.ldc % 2 == 0 && reinterpret_cast<uintptr_t>(p.c) % pair_bytes == 0 &&
                     (!read_source || reinterpret_cast<uintptr_t>(source) % pair_bytes == 0);

  float acc[kChunks][kJ][4];
  int it = 0;

  // The steps of one K block, shared by both schedules below.
  // The 128x128 B scale of chunk h's columns at K block kb, from global memory (L2), loaded
  // before the stage's wait so that its latency hides behind it; a block beyond N gets 0.
  const auto b_scale = [&](int n0, int h, int kb) {
    const int c0 = n0 + h * kChunkN;
    return kB2d && c0 < n ? __ldg(p.scales_b + (int64_t)(c0 / 128) * p.scales_b_ld + kb) : 0.0f;
  };
  // Chunk h's four m64n128k32 wgmmas over stage s, into `part`, as one commit group.
  const auto issue = [&](float(&part)[kJ][4], int s, int h) {
    const uint32_t stage = smem_u32(tiles + (size_t)s * T::kStageBytes);
    const uint32_t a_tile = stage + (uint32_t)(consumer * 64 * 128);
    const uint32_t b_tile = stage + (uint32_t)(T::kABytes + h * kChunkN * 128);
    wgmma::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      wgmma::mma_ss_e4m3_n128(part, wgmma::k_major<64>(a_tile, kk), wgmma::k_major<kChunkN>(b_tile, kk), kk > 0);
    }
    wgmma::wgmma_commit();
  };
  // acc[h] += part * (sa[row] * sb[col]) with stage s's scales (sb: the 128x128 B's `scale_b`).
  const auto promote = [&](const float(&part)[kJ][4], int s, int h, float scale_b) {
    const float* sa = scales + s * T::kScaleFloats;
    const float* sb = sa + kBlockM;
    const float sa0 = sa[row_in_tile], sa1 = sa[row_in_tile + 8];
    if constexpr (kB2d) {
      const float s0 = sa0 * scale_b, s1 = sa1 * scale_b;
#pragma unroll
      for (int j = 0; j < kJ; ++j) {
        acc[h][j][0] = fmaf(part[j][0], s0, acc[h][j][0]);
        acc[h][j][1] = fmaf(part[j][1], s0, acc[h][j][1]);
        acc[h][j][2] = fmaf(part[j][2], s1, acc[h][j][2]);
        acc[h][j][3] = fmaf(part[j][3], s1, acc[h][j][3]);
      }
    } else {
      // The column pairs' scales through one shared-memory address and immediate offsets (ptxas
      // spilled with the 128-column tiles' two partial-sum tiles when each load had its own
      // address register).
      const uint32_t sb_addr = smem_u32(sb + h * kChunkN + col_in_half);
#pragma unroll
      for (int j = 0; j < kJ; ++j) {
        float2 b;
        asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(b.x), "=f"(b.y) : "r"(sb_addr + 32 * j));
        acc[h][j][0] = fmaf(part[j][0], sa0 * b.x, acc[h][j][0]);
        acc[h][j][1] = fmaf(part[j][1], sa0 * b.y, acc[h][j][1]);
        acc[h][j][2] = fmaf(part[j][2], sa1 * b.x, acc[h][j][2]);
        acc[h][j][3] = fmaf(part[j][3], sa1 * b.y, acc[h][j][3]);
      }
    }
  };
  // This warp's reads of stage s (wgmma operands, waited for; scales) are done: one release per
  // warp to the stage's empty barrier in every CTA of the cluster (addresses from the barriers'
  // base in each CTA, mapped once).
  uint32_t empty_in_cta[kCluster];
#pragma unroll
  for (int r = 0; r < kCluster; ++r) empty_in_cta[r] = kCluster == 1 ? 0u : cluster_address(empty, (uint32_t)r);
  const auto release = [&](int s) {
    __syncwarp();
    if (lane == 0) {
      if constexpr (kCluster == 1) {
        mbar_arrive(&empty[s]);
      } else {
#pragma unroll
        for (int r = 0; r < kCluster; ++r) mbar_arrive_cluster(empty_in_cta[r] + 8u * (uint32_t)s);
      }
    }
  };
  const auto wait_full = [&](int it_kb) {
    mbar_wait(&full[it_kb % T::kStages], (uint32_t)(it_kb / T::kStages) & 1u);
  };

  for (int t = first_tile; t < cluster_tiles; t += tile_stride) {
    int m0, n0;
    tile_origin(t, m0, n0);
#pragma unroll
    for (int h = 0; h < kChunks; ++h)
#pragma unroll
      for (int j = 0; j < kJ; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[h][j][e] = 0.0f;

    if constexpr (kPipelined) {
      // 128 columns: two partial-sum tiles, so that block kb + 1's wgmmas run while block kb is
      // promoted (wait_group 1) and the tensor cores do not wait for this warpgroup's promotion
      // (measured no faster than the 256-column tiles: see the file comment).
      float part[2][kJ][4];
      float scale_b[2];
      const auto start = [&](auto buf, int kb) {
        scale_b[buf] = b_scale(n0, 0, kb);
        wait_full(it + kb);
        issue(part[buf], (it + kb) % T::kStages, 0);
      };
      // Block kb (in part[buf]) once it is done: with `next`, block kb + 1 is issued first.
      const auto finish = [&](auto buf, int kb, bool next) {
        constexpr int kOther = 1 - decltype(buf)::value;
        if (next) {
          start(std::integral_constant<int, kOther>{}, kb + 1);
          wgmma::wgmma_wait<1>();
        } else {
          wgmma::wgmma_wait<0>();
        }
        wgmma::registers_fence(part[buf]);
        const int s = (it + kb) % T::kStages;
        promote(part[buf], s, 0, scale_b[buf]);
        release(s);
      };
      // Two blocks an iteration, so that the buffers' indices are constants; the loop body always
      // issues ahead (ptxas serializes every wgmma where a branch leaves it unsure which group a
      // wait retires), the last one or two blocks are the tail.
      constexpr std::integral_constant<int, 0> kBuf0{};
      constexpr std::integral_constant<int, 1> kBuf1{};
      if (blocks > 0) {
        start(kBuf0, 0);
        int kb = 0;
        for (; kb + 2 < blocks; kb += 2) {
          finish(kBuf0, kb, true);
          finish(kBuf1, kb + 1, true);
        }
        if (kb + 1 < blocks) {
          finish(kBuf0, kb, true);
          finish(kBuf1, kb + 1, false);
        } else {
          finish(kBuf0, kb, false);
        }
      }
      it += blocks;
    } else {
      // 256 columns: 128 accumulators leave room for one chunk's partial sums only, so each chunk
      // is issued, waited for and promoted in turn (the other consumer's wgmmas fill the gaps).
      float part[kJ][4];
      for (int kb = 0; kb < blocks; ++kb, ++it) {
        const int s = it % T::kStages;
        float scale_b[kChunks];
#pragma unroll
        for (int h = 0; h < kChunks; ++h) scale_b[h] = b_scale(n0, h, kb);
        wait_full(it);
#pragma unroll
        for (int h = 0; h < kChunks; ++h) {
          issue(part, s, h);
          wgmma::wgmma_wait<0>();
          wgmma::registers_fence(part);
          promote(part, s, h, scale_b[h]);
        }
        release(s);
      }
    }

    // Epilogue: C = alpha * acc (+ beta * S), while the producer already loads the next tile; one
    // loop per output type (out: C, src: S, both of that type).
    const auto write_tile = [&](auto* out, const auto* src) {
#pragma unroll
      for (int h = 0; h < kChunks; ++h)
#pragma unroll
        for (int j = 0; j < kJ; ++j)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int row = m0 + row_in_tile + 8 * r;
            const int col = n0 + h * kChunkN + 8 * j + col_in_half;
            if (row >= m || col >= n) continue;
            const int64_t at = (int64_t)row * p.ldc + col;
            float v0 = p.alpha * acc[h][j][2 * r], v1 = p.alpha * acc[h][j][2 * r + 1];
            if (read_source) {
              const float2 sv = load_pair(src + at, pairs);
              v0 = fmaf(p.beta, sv.x, v0);
              v1 = fmaf(p.beta, sv.y, v1);
            }
            store_pair(out + at, v0, v1, pairs);
          }
    };
    if (p.c_bf16) {
      write_tile(static_cast<__nv_bfloat16*>(p.c), static_cast<const __nv_bfloat16*>(source));
    } else {
      write_tile(static_cast<float*>(p.c), static_cast<const float*>(source));
    }
  }
  __syncwarp();
  // No CTA leaves while a peer may still arrive on its barriers (its last releases).
  if constexpr (kCluster > 1) cluster_sync();
#else
  (void)map_a, (void)map_b, (void)p;
  __trap();
#endif
}

// The tile shape in effect: set_fp8_block_gemm_shape's, else FOURBIT_GEMM_FP8_BN (128 | 256),
// FOURBIT_GEMM_FP8_CLUSTER (1 | 2) and FOURBIT_GEMM_FP8_CTAS (-1 | n) as read at the first launch,
// else the defaults (0 fields).
std::mutex g_shape_mutex;
bool g_shape_set = false;
Fp8BlockGemmShape g_shape;

Fp8BlockGemmShape shape_in_effect() {
  std::lock_guard<std::mutex> lock(g_shape_mutex);
  if (!g_shape_set) {
    const auto env_int = [](const char* name) {
      const char* v = std::getenv(name);
      return v != nullptr && *v != '\0' ? std::atoi(v) : 0;
    };
    g_shape = {env_int("FOURBIT_GEMM_FP8_BN"), env_int("FOURBIT_GEMM_FP8_CLUSTER"), env_int("FOURBIT_GEMM_FP8_CTAS")};
    g_shape_set = true;
  }
  return g_shape;
}

template <int kBlockN, bool kB2d, int kCluster>
void launch_tiled(const Fp8BlockGemmParams& p, int ctas_setting, cudaStream_t stream) {
  using T = Tiling<kBlockN>;
  auto* kernel = fp8_block_gemm_kernel<kBlockN, kB2d, kCluster>;
  cudaLaunchConfig_t config = {};
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = T::kSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = (unsigned)kCluster;
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  // The persistent grid: as many CTAs as can be resident at once (one an SM; fewer where the
  // GPCs' SM counts leave some SMs outside any cluster).
  static std::once_flag once;
  static int resident_ctas = 0;
  std::call_once(once, [&] {
    FOURBIT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)T::kSmemBytes));
    int clusters = 0;
    config.gridDim = dim3((unsigned)(kCluster * current_device_sm_count()));
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess || clusters <= 0) {
      (void)cudaGetLastError();
      clusters = current_device_sm_count() / kCluster;
    }
    resident_ctas = clusters * kCluster;
  });
  const CUtensorMap map_a = e4m3_tile_map(p.a, p.m, p.k, p.a_ld, kBlockK, kBlockM, "A");
  const CUtensorMap map_b = e4m3_tile_map(p.b, p.n, p.k, p.b_ld, kBlockK, T::kBlockN / kCluster, "B");
  const int64_t tiles_m = (p.m + kBlockM - 1) / kBlockM, tiles_n = (p.n + T::kBlockN - 1) / T::kBlockN;
  const int64_t all_ctas = (tiles_m + kCluster - 1) / kCluster * kCluster * tiles_n;  // one per tile
  int64_t ctas = ctas_setting < 0 ? all_ctas : ctas_setting > 0 ? ctas_setting : resident_ctas;
  ctas = std::max<int64_t>(kCluster, std::min(all_ctas, ctas / kCluster * kCluster));
  config.gridDim = dim3((unsigned)ctas);
  FOURBIT_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, map_a, map_b, p));
}

template <int kBlockN, bool kB2d>
void launch_clustered(const Fp8BlockGemmParams& p, int cluster, int ctas, cudaStream_t stream) {
  if (cluster == 2) launch_tiled<kBlockN, kB2d, 2>(p, ctas, stream);
  else launch_tiled<kBlockN, kB2d, 1>(p, ctas, stream);
}

template <bool kB2d>
void launch_columns(const Fp8BlockGemmParams& p, int block_n, int cluster, int ctas, cudaStream_t stream) {
  if (block_n == 256) launch_clustered<256, kB2d>(p, cluster, ctas, stream);
  else launch_clustered<128, kB2d>(p, cluster, ctas, stream);
}

}  // namespace

void set_fp8_block_gemm_shape(const Fp8BlockGemmShape& shape) {
  std::lock_guard<std::mutex> lock(g_shape_mutex);
  g_shape = shape;
  g_shape_set = true;
}

void launch_fp8_block_gemm(const Fp8BlockGemmParams& p, cudaStream_t stream) {
  if (p.m == 0 || p.n == 0) return;
  const Fp8BlockGemmShape shape = shape_in_effect();
  // Columns a tile: the setting's 128 or 256, else 256 where N allows it.
  const int block_n = shape.block_n == 128 || shape.block_n == 256 ? shape.block_n : p.n > 128 ? 256 : 128;
  // Clusters only where asked for (no faster in session 26) and where there are two row tiles.
  const int cluster = shape.cluster_m == 2 && p.m > kBlockM ? 2 : 1;
  if (p.b_2d) launch_columns<true>(p, block_n, cluster, shape.ctas, stream);
  else launch_columns<false>(p, block_n, cluster, shape.ctas, stream);
}

}  // namespace fourbit::gemm::kernels
