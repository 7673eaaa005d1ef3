// Small CUDA kernels of the GEMM backends (interface and contracts: gemm_kernels.h): scaled-domain
// BF16 from packed NVFP4 / MXFP8, the FP8 block-scale layout conversion, the epilogue scalars and
// the empty-reduction result. All are memory-bound element-wise passes; the element arithmetic is
// the quantizer's (quant/block_math.h, formats/element.h), so the values equal
// quant::dequantize_bf16_scaled_reference bit for bit. Each is launched with programmatic dependent
// launch (core/pdl.cuh) and waits for its producer before anything else: its launch overlaps the
// tail of the kernel before (the quantizers, or cuBLASLt); FOURBIT_PDL=0 turns it off.
#include "gemm/gemm_kernels.h"

#include "core/error.h"
#include "core/pdl.cuh"
#include "formats/element.h"
#include "quant/block_math.h"
#include "quant/scaled_bf16_device.cuh"

#include <algorithm>

namespace fourbit::gemm::kernels {
namespace {

constexpr int kThreads = 256;

unsigned grid_for(int64_t work_items) {
  // Enough CTAs to fill an H100/H200 (132 SMs) several times over; grid-stride loops do the rest.
  return (unsigned)std::max<int64_t>(1, std::min<int64_t>((work_items + kThreads - 1) / kThreads, 132 * 32));
}

__device__ __forceinline__ uint16_t nvfp4_scaled_bf16(uint8_t code, float scale) {
  return formats::encode_bf16_rn(formats::mul_rn(formats::decode_e2m1(code), scale));
}

// One thread per 16-element chunk of a row (one NVFP4 block; half an MXFP8 block). Rows whose
// length is a multiple of 16 take the vectorized path: 8 (NVFP4) or 16 (MXFP8) bytes in, 32 out.
__global__ void scaled_bf16_kernel(ScaledBf16Params p) {
  core::pdl_allow_dependents();
  core::pdl_wait_for_producer();  // before any read or write (core/pdl.cuh)
  const int64_t chunks_per_row = (p.cols + 15) / 16;
  const int64_t chunks = p.rows * chunks_per_row;
  const bool vector_rows = p.cols % 16 == 0;
  const bool aligned = reinterpret_cast<uintptr_t>(p.data) % 8 == 0 && reinterpret_cast<uintptr_t>(p.out) % 16 == 0;
  if (p.format == quant::Format::kNvfp4 && vector_rows && aligned) {
    // The common case (every training operand): chunk t is micro-block t of the row-major data,
    // so its 8 packed bytes are at 8 t, its scale at t and its 16 outputs at 16 t. The quantizer's
    // helpers: branch-free decode, two values per hardware BF16 conversion (~4x fewer
    // instructions than the generic path below, which was issue-bound).
    const uint2* packed = reinterpret_cast<const uint2*>(p.data);
    for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < chunks;
         t += (int64_t)gridDim.x * blockDim.x) {
      float sv[16];
      quant::nvfp4_scaled16(packed[t], p.scales[t], sv);
      quant::store_bf16x16(p.out + 16 * t, sv);
    }
    return;
  }
  for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < chunks;
       t += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = t / chunks_per_row, c0 = (t % chunks_per_row) * 16;
    uint16_t v[16];
    const int n = (int)min((int64_t)16, p.cols - c0);
    if (p.format == quant::Format::kNvfp4) {
      const float s = formats::decode_e4m3(p.scales[r * ((p.cols + 15) / 16) + c0 / 16]);
      const uint8_t* row = p.data + r * ((p.cols + 1) / 2);
      if (vector_rows) {
        const uint2 packed = *reinterpret_cast<const uint2*>(row + c0 / 2);
        const uint32_t words[2] = {packed.x, packed.y};
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          v[i] = nvfp4_scaled_bf16((uint8_t)((words[i / 8] >> (4 * (i % 8))) & 0xF), s);
        }
      } else {
        for (int i = 0; i < n; ++i) {
          v[i] = nvfp4_scaled_bf16(formats::unpack_e2m1(row[(c0 + i) / 2], (int)((c0 + i) & 1)), s);
        }
      }
    } else {
      const uint8_t k = p.scales[r * ((p.cols + 31) / 32) + c0 / 32];
      const bool exact = k >= 3 && k <= 246;
      const uint8_t* row = p.data + r * p.cols;
      bool inexact = false;
      uint8_t codes[16];
      if (vector_rows) {
        const uint4 bytes = *reinterpret_cast<const uint4*>(row + c0);
        const uint32_t words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
#pragma unroll
        for (int i = 0; i < 16; ++i) codes[i] = (uint8_t)(words[i / 4] >> (8 * (i % 4)));
      } else {
        for (int i = 0; i < n; ++i) codes[i] = row[c0 + i];
      }
      for (int i = 0; i < n; ++i) {
        if ((codes[i] & 0x7F) != 0 && !exact) {
          inexact = true;
          v[i] = 0x7FC0;  // NaN: never a silently wrong value
        } else {
          v[i] = formats::encode_bf16_rn(quant::mxfp8_dequantize_element(codes[i], k));
        }
      }
      if (inexact) atomicOr(p.error_flags, kErrMxfp8NotExact);
    }
    uint16_t* out = p.out + r * p.cols + c0;
    if (vector_rows) {
      uint4 w[2];
      uint32_t* wp = reinterpret_cast<uint32_t*>(w);
#pragma unroll
      for (int i = 0; i < 8; ++i) wp[i] = (uint32_t)v[2 * i] | ((uint32_t)v[2 * i + 1] << 16);
      reinterpret_cast<uint4*>(out)[0] = w[0];
      reinterpret_cast<uint4*>(out)[1] = w[1];
    } else {
      for (int i = 0; i < n; ++i) out[i] = v[i];
    }
  }
}

__global__ void fp8_block_scales_kernel(Fp8BlockScaleSlice s, float* dst, int64_t n) {
  core::pdl_allow_dependents();
  core::pdl_wait_for_producer();  // before any read or write (core/pdl.cuh)
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    dst[i] = cublas_fp8_scale_at(s, i);
  }
}

__global__ void epilogue_scalars_kernel(EpilogueScalarParams p) {
  core::pdl_allow_dependents();
  core::pdl_wait_for_producer();  // before any read or write (core/pdl.cuh)
  const float d_a = p.amax_a ? quant::nvfp4_global_decode_scale(*p.amax_a, p.constant_a) : 1.0f;
  const float d_b = p.amax_b ? quant::nvfp4_global_decode_scale(*p.amax_b, p.constant_b) : 1.0f;
  p.out[0] = formats::mul_rn(formats::mul_rn(p.alpha, d_a), d_b);
  p.out[1] = p.beta;
}

__global__ void row_scaled_epilogue_kernel(RowScaledEpilogueParams p) {
  core::pdl_allow_dependents();
  core::pdl_wait_for_producer();  // before any read or write (core/pdl.cuh)
  const float d_b = p.amax_b ? quant::nvfp4_global_decode_scale(*p.amax_b, p.constant_b) : 1.0f;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < p.rows * p.cols;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / p.cols, col = i % p.cols;
    const float d_a = quant::nvfp4_global_decode_scale(p.amax_a[r], p.constant_a);
    const float alpha_eff = formats::mul_rn(formats::mul_rn(p.alpha, d_a), d_b);
    float y = formats::mul_rn(alpha_eff, p.acc[i]);
    const int64_t at = r * p.ldc + col;
    if (p.c_bf16) {
      const uint16_t* src = static_cast<const uint16_t*>(p.c_source) + at;
      if (p.beta != 0.0f) y = formats::add_rn(y, formats::mul_rn(p.beta, formats::decode_bf16(*src)));
      static_cast<uint16_t*>(p.c)[at] = formats::encode_bf16_rn(y);
    } else {
      const float* src = static_cast<const float*>(p.c_source) + at;
      if (p.beta != 0.0f) y = formats::add_rn(y, formats::mul_rn(p.beta, *src));
      static_cast<float*>(p.c)[at] = y;
    }
  }
}

template <typename T>
__global__ void scale_matrix_kernel(T* c, int64_t rows, int64_t cols, int64_t ld, float beta) {
  core::pdl_allow_dependents();
  core::pdl_wait_for_producer();  // before any read or write (core/pdl.cuh)
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < rows * cols;
       i += (int64_t)gridDim.x * blockDim.x) {
    T& x = c[(i / cols) * ld + i % cols];
    if constexpr (sizeof(T) == 2) {
      x = beta == 0.0f ? (T)0 : formats::encode_bf16_rn(formats::mul_rn(beta, formats::decode_bf16(x)));
    } else {
      x = beta == 0.0f ? 0.0f : formats::mul_rn(beta, x);
    }
  }
}

}  // namespace

void launch_scaled_bf16(const ScaledBf16Params& p, cudaStream_t stream) {
  const int64_t chunks = p.rows * ((p.cols + 15) / 16);
  FOURBIT_CUDA_CHECK(core::launch_pdl(scaled_bf16_kernel, dim3(grid_for(chunks)), dim3(kThreads), 0, stream, p));
  FOURBIT_CUDA_CHECK_LAUNCH();
}

void launch_fp8_block_scales(const Fp8BlockScaleSlice& slice, float* dst, cudaStream_t stream) {
  const int64_t n = cublas_fp8_scale_count(slice.block_2d, slice.rows, slice.blocks);
  FOURBIT_CUDA_CHECK(core::launch_pdl(fp8_block_scales_kernel, dim3(grid_for(n)), dim3(kThreads), 0, stream, slice, dst, n));
  FOURBIT_CUDA_CHECK_LAUNCH();
}

void launch_epilogue_scalars(const EpilogueScalarParams& p, cudaStream_t stream) {
  FOURBIT_CUDA_CHECK(core::launch_pdl(epilogue_scalars_kernel, dim3(1), dim3(1), 0, stream, p));
  FOURBIT_CUDA_CHECK_LAUNCH();
}

void launch_row_scaled_epilogue(const RowScaledEpilogueParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return;
  FOURBIT_CUDA_CHECK(
      core::launch_pdl(row_scaled_epilogue_kernel, dim3(grid_for(p.rows * p.cols)), dim3(kThreads), 0, stream, p));
  FOURBIT_CUDA_CHECK_LAUNCH();
}

void launch_scale_matrix(void* c, bool bf16, int64_t rows, int64_t cols, int64_t ld, float beta,
                         cudaStream_t stream) {
  const unsigned grid = grid_for(rows * cols);
  if (bf16) {
    FOURBIT_CUDA_CHECK(core::launch_pdl(scale_matrix_kernel<uint16_t>, dim3(grid), dim3(kThreads), 0, stream,
                                        static_cast<uint16_t*>(c), rows, cols, ld, beta));
  } else {
    FOURBIT_CUDA_CHECK(core::launch_pdl(scale_matrix_kernel<float>, dim3(grid), dim3(kThreads), 0, stream,
                                        static_cast<float*>(c), rows, cols, ld, beta));
  }
  FOURBIT_CUDA_CHECK_LAUNCH();
}

}  // namespace fourbit::gemm::kernels
