// Internal interface between the host side of the CUDA quantizers (quantize_cuda.cpp, compiled by
// the C++ compiler) and the kernels (quantize_kernels.cu, compiled by nvcc). Plain structs and
// launch functions only; validation and error messages live on the host side.
#pragma once

#include "core/rng.h"
#include "quant/block_math.h"
#include "quant/format.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fourbit::quant::kernels {

inline constexpr int kErrNonFinite = kDeviceErrNonFinite;
inline constexpr int kErrMxfp8NotExact = kDeviceErrMxfp8NotExact;

// Everything a kernel needs to know about one orientation's outputs.
struct OrientationOut {
  uint8_t* data = nullptr;        // packed FP4 or E4M3, stored [R, C]; null: not written
  void* scales = nullptr;         // E4M3 / E8M0 bytes or f32 (layout in quantize.h)
  uint16_t* bf16 = nullptr;       // optional scaled-domain BF16, stored [R, C]
  const float* amax = nullptr;    // NVFP4 / FP8-tensor global amax of this orientation (device)
  bool amax_per_row = false;      // NVFP4 row-wise: amax[r] for row r (QuantConfig::nvfp4_row_amax)
  // Not null: the kernel also stores *amax here (block 0, thread 0; a per-tensor amax only), the
  // copy of a given amax into the bundle without a memcpy launch of its own.
  float* amax_copy = nullptr;
  RandomStream sr;
};

struct Params {
  const void* src;
  int64_t rows, cols;  // source [M, K]
  OrientationOut row, col;
  bool stochastic;
  bool rht;
  uint16_t rht_sign_mask;
  bool four_over_six;
  FourOverSixMetric metric;
  MxScaleRule mx_rule;
  bool fp8_pow2;
  float nvfp4_scale_constant, nvfp4_element_constant;
  int* error_flags;  // device int: kErr* bits are OR-ed in
};

struct DequantParams {
  Format format;
  bool block_2d;
  const uint8_t* data;
  const void* scales;
  const float* amax;
  bool amax_per_row;  // NVFP4: amax[r] for stored row r
  float nvfp4_constant;
  int64_t rows, cols;  // stored [R, C]
  float* out;          // f32 [R, C]
};

// Tile of source elements per CTA: the source must be a whole number of tiles.
int tile_rows(Format format);
int tile_cols(Format format);

void launch_quantize(Format format, bool block_2d, bool bf16_source, const Params& p,
                     cudaStream_t stream);
// Device scratch for a global-amax reduction without zeroed outputs (the amax kernels'
// publish_amaxes_ticket, amax_device.cuh): `count` starts at 0 and is 0 again after every kernel
// that used it; `partial` holds `capacity` (row, column) maxima, one per CTA. One ticket serves one
// stream (kernels on it run one after another); count == nullptr: no ticket (zeroed outputs and
// atomicMax).
struct AmaxTicket {
  unsigned int* count = nullptr;
  float2* partial = nullptr;
  int capacity = 0;
};

// The global amaxes of src into row_amax / col_amax (col_amax may be null). Without a ticket the
// two are zeroed first (a fill launch each) and then maxed into; with one, written once.
void launch_amax(const void* src, bool bf16_source, int64_t rows, int64_t cols, bool rht,
                 uint16_t sign_mask, float* row_amax, float* col_amax, int* error_flags,
                 cudaStream_t stream, AmaxTicket ticket = {});
void launch_dequantize(const DequantParams& p, cudaStream_t stream);
// The amax of every row of a contiguous f32 or bf16 [rows, cols] source (cols % 8 == 0) into
// row_amax[rows] (device; no zeroing needed), one warp per row; NaN / Inf set kErrNonFinite.
void launch_row_amax(const void* src, bool bf16_source, int64_t rows, int64_t cols, float* row_amax,
                     int* error_flags, cudaStream_t stream);

// Fills a device buffer with seeded standard-normal values (Philox + Box-Muller), as f32 or bf16:
// benchmark inputs, generated on the GPU.
void launch_fill_normal(void* dst, bool bf16, int64_t n, uint64_t seed, cudaStream_t stream);

}  // namespace fourbit::quant::kernels
