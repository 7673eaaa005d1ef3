// Device side of OutputAmaxes (output_amax.h) for the ops' kernels (nvcc only): a CTA of 256
// threads takes tiles of 16 rows x 128 columns of an output, one 8-column group per thread (row
// t / 16, columns 8 (t % 16)); each thread rounds its 8 results to the stored BF16 values, folds
// them into the plain amax and stages them in shared memory; after a barrier one thread per staged
// column reduces the Hadamard transform of its 16-row segment (quant/amax_device.cuh), and a
// second barrier frees the stage for the next tile.
#pragma once

#include "formats/element.h"
#include "formats/fp_ops.h"
#include "ops/error_flags.h"
#include "core/error.h"
#include "ops/kernel_types.h"
#include "quant/amax_device.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace fourbit::ops::kernels {

constexpr int kAmaxTileRows = 16, kAmaxTileCols = 128, kAmaxThreads = 256;
static_assert(kAmaxTileRows * kAmaxTileCols / 8 == kAmaxThreads, "one 8-column group per thread");

// A thread's running amaxes over the tiles it saw.
struct TileAmaxes {
  float row = 0.0f, col = 0.0f;
  bool bad = false;

  // Rounds v to BF16 (the stored values), folds them into the plain amax and the non-finite flag,
  // and stages them at `stage` (16-byte aligned) for the column pass.
  __device__ __forceinline__ void round_and_stage(float v[8], float* stage) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      v[k] = formats::decode_bf16(formats::encode_bf16_rn(v[k]));
      const float x = formats::abs_f32(v[k]);
      bad |= !(x <= formats::kFloatMax);
      row = fmaxf(row, x);
    }
    reinterpret_cast<float4*>(stage)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(stage)[1] = make_float4(v[4], v[5], v[6], v[7]);
  }

  // The RHT amax of column `col_index` of a staged [16][kAmaxTileCols] tile.
  __device__ __forceinline__ void add_staged_column(const float (*tile)[kAmaxTileCols], int col_index,
                                                    uint16_t sign_mask) {
    float v[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = tile[i][col_index];
    col = fmaxf(col, quant::device::rht_segment_amax(v, sign_mask));
  }

  // Every thread of the CTA calls it once, at the end.
  __device__ __forceinline__ void publish(const AmaxOutputs& a) const {
    quant::device::publish_amaxes(row, col, a.amax, a.rht_amax, bad, a.nonfinite_flag, kErrNonFinite);
  }
};

// The tile loop of an amax kernel over an output of [n_rows, cols] tiles (n_rows % 16 == 0,
// cols % 128 == 0 in units of the tile's columns): for each of the CTA's tiles, body(n, c, m,
// stage) computes this thread's 8 results of row n, columns [c, c + 8), passes each of its
// kStages output blocks through m.round_and_stage(v, stage[s]) and stores them; then, when the
// RHT amax is wanted, the CTA reduces the staged columns. Ends with m.publish(a).
template <int kStages, typename Body>
__device__ __forceinline__ void amax_tile_loop(int64_t n_rows, int64_t cols, const AmaxOutputs& a,
                                               Body&& body) {
  __shared__ __align__(16) float tile[kStages][kAmaxTileRows][kAmaxTileCols];
  const int r = threadIdx.x / 16, c8 = (threadIdx.x % 16) * 8;
  const int64_t col_tiles = cols / kAmaxTileCols, tiles = (n_rows / kAmaxTileRows) * col_tiles;
  float* stage[kStages];
#pragma unroll
  for (int s = 0; s < kStages; ++s) stage[s] = &tile[s][r][c8];
  TileAmaxes m;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    body((t / col_tiles) * kAmaxTileRows + r, (t % col_tiles) * kAmaxTileCols + c8, m, stage);
    if (a.rht_amax != nullptr) {
      __syncthreads();
      for (int col = threadIdx.x; col < kStages * kAmaxTileCols; col += kAmaxThreads)
        m.add_staged_column(tile[col / kAmaxTileCols], col % kAmaxTileCols, a.rht_sign_mask);
      __syncthreads();
    }
  }
  m.publish(a);
}

// Grid of an amax kernel over [n_rows, cols]: one CTA per tile up to 8 per SM, then grid-stride.
inline unsigned amax_tile_grid(int64_t n_rows, int64_t cols) {
  int sms = 0, dev = 0;
  FOURBIT_CUDA_CHECK(cudaGetDevice(&dev));
  FOURBIT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int64_t tiles = (n_rows / kAmaxTileRows) * (cols / kAmaxTileCols);
  return (unsigned)std::max<int64_t>(1, std::min<int64_t>(tiles, (int64_t)sms * 8));
}

}  // namespace fourbit::ops::kernels
