// Host side of the CUDA quantizers: validation, output binding, the global-amax pass and error
// reporting. The kernels themselves live in quantize_kernels.cu (see quantize_kernels.h).
#include "quant/quantize.h"

#include "core/check.h"
#include "core/env.h"
#include "core/fill.h"
#include "core/sm_count.h"
#include "quant/quantize_kernels.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <map>
#include <mutex>
#include <utility>

namespace fourbit::quant {
namespace {

using kernels::kErrMxfp8NotExact;
using kernels::kErrNonFinite;


int* default_error_flag() {
  static int* flag = nullptr;
  static std::once_flag once;
  std::call_once(once, [] { FOURBIT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&flag), sizeof(int))); });
  return flag;
}

float* default_error_flag_scratch_amax() {
  static float* amax = nullptr;
  static std::once_flag once;
  std::call_once(once, [] { FOURBIT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&amax), sizeof(float))); });
  return amax;
}

void report_error_flags(int flags, std::string_view tensor_name, const TensorView& src) {
  FOURBIT_CHECK((flags & kErrNonFinite) == 0,
                "tensor '{}' ({}) contains NaN or Inf: refusing to quantize a non-finite value; "
                "find where it was produced (fourbit reports NaN/Inf at the first quantizer that "
                "sees it)",
                tensor_name, src.describe());
  FOURBIT_CHECK((flags & kErrMxfp8NotExact) == 0,
                "tensor '{}': an MXFP8 block scale code lies outside [3, 246], so its scaled "
                "values are not exact in BF16 and the exact GEMM emulation cannot consume them "
                "(a block amax below ~2^-115 or above ~2^127)",
                tensor_name);
}

std::atomic<int> g_amax_reduction{-1};

// The amax ticket of (device, stream) when the ticket reduction is on (set_amax_reduction), else
// none. Created on first use: count zeroed on the stream itself, partials for 8 CTAs an SM (the
// amax kernels' largest grid). Never freed: one per stream the process quantizes on.
kernels::AmaxTicket amax_ticket_for(cudaStream_t stream) {
  int mode = g_amax_reduction.load();
  if (mode < 0) {
    static const int env = env_switch("FOURBIT_QUANT_AMAX_TICKET");
    mode = env == 1 ? 1 : 0;
  }
  if (mode != 1) return {};
  int device = 0;
  FOURBIT_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<std::pair<int, cudaStream_t>, kernels::AmaxTicket> tickets;
  std::lock_guard<std::mutex> lock(mutex);
  kernels::AmaxTicket& t = tickets[{device, stream}];
  if (t.count == nullptr) {
    const int capacity = current_device_sm_count() * 8;
    void* mem = nullptr;
    FOURBIT_CUDA_CHECK(cudaMalloc(&mem, 16 + sizeof(float2) * (size_t)capacity));
    FOURBIT_CUDA_CHECK(cudaMemsetAsync(mem, 0, 16, stream));
    t.count = static_cast<unsigned int*>(mem);
    t.partial = reinterpret_cast<float2*>(static_cast<char*>(mem) + 16);
    t.capacity = capacity;
  }
  return t;
}

}  // namespace

void set_amax_reduction(int mode) {
  FOURBIT_CHECK(mode >= -1 && mode <= 1, "set_amax_reduction: mode must be -1, 0 or 1, got {}", mode);
  g_amax_reduction.store(mode);
}

void amax_cuda(const TensorView& src, float* rowwise_amax, float* colwise_amax, bool colwise_rht,
               uint16_t rht_sign_mask, int* nonfinite_flag, void* stream_ptr) {
  const int64_t rows = src.rows(), cols = src.cols();
  FOURBIT_CHECK(src.device == Device::kCuda && src.is_contiguous() &&
                    (src.dtype == DType::kBF16 || src.dtype == DType::kF32),
                "amax_cuda: the source must be a contiguous bf16 or f32 CUDA tensor, got {}",
                src.describe());
  FOURBIT_CHECK(rows % 16 == 0 && cols % 2 == 0,
                "amax_cuda: {} needs rows % 16 == 0 and an even number of columns", src.describe());
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  kernels::launch_amax(src.data, src.dtype == DType::kBF16, rows, cols, colwise_rht, rht_sign_mask,
                       rowwise_amax, colwise_amax, nonfinite_flag, stream, amax_ticket_for(stream));
}

void quantize_cuda(const TensorView& src, QuantizedTensor& out, const CudaQuantizeOptions& o,
                   const TensorView* bf16_rowwise, const TensorView* bf16_colwise) {
  const QuantConfig& cfg = out.config;
  cfg.validate();
  cudaStream_t stream = static_cast<cudaStream_t>(o.stream);
  FOURBIT_CHECK(src.device == Device::kCuda && src.is_contiguous() &&
                    (src.dtype == DType::kBF16 || src.dtype == DType::kF32),
                "quantize_cuda('{}'): the source must be a contiguous bf16 or f32 CUDA tensor, got {}",
                o.tensor_name, src.describe());
  const int64_t M = src.rows(), K = src.cols();
  FOURBIT_CHECK(out.device == Device::kCuda && out.rows == M && out.cols == K,
                "quantize_cuda('{}'): output bundle is {} x {} on {}, source is {}", o.tensor_name,
                out.rows, out.cols, device_name(out.device), src.describe());
  const int tr = kernels::tile_rows(cfg.format);
  FOURBIT_CHECK(M % tr == 0 && K % 128 == 0,
                "quantize_cuda('{}'): {} is not a multiple of the {}x128 tile of the {} kernel; pad "
                "the tensor (rows to a multiple of {}, columns to a multiple of 128) or use the CPU "
                "reference",
                o.tensor_name, src.describe(), tr, format_name(cfg.format), tr);
  FOURBIT_CHECK(reinterpret_cast<uintptr_t>(src.data) % 16 == 0,
                "quantize_cuda('{}'): source must be 16-byte aligned", o.tensor_name);
  const bool want_bf16 = o.write_bf16_scaled;
  FOURBIT_CHECK(o.write_packed || want_bf16, "quantize_cuda('{}'): nothing to write", o.tensor_name);

  kernels::Params p{};
  p.src = src.data;
  p.rows = M;
  p.cols = K;
  p.stochastic = cfg.rounding == Rounding::kStochastic;
  p.rht = cfg.rht;
  p.rht_sign_mask = cfg.rht_sign_mask();
  p.four_over_six = cfg.format == Format::kNvfp4 && cfg.nvfp4_scale_rule == Nvfp4ScaleRule::kFourOverSix;
  p.metric = cfg.four_over_six_metric;
  p.mx_rule = cfg.mx_scale_rule;
  p.fp8_pow2 = cfg.fp8_pow2_scales;
  p.nvfp4_scale_constant = cfg.nvfp4_scale_constant();
  p.nvfp4_element_constant = cfg.nvfp4_global_constant();
  int* flags = o.nonfinite_flag ? o.nonfinite_flag : default_error_flag();
  if (!o.nonfinite_flag) device_fill_async(flags, 0, sizeof(int), stream);
  p.error_flags = flags;

  // Streams are bound even for an absent orientation: 2D column-wise SR uses the row-wise draws.
  auto bind = [&](std::optional<QuantizedData>& d, kernels::OrientationOut& oo, const TensorView* bf16,
                  RandomStream sr) {
    oo.sr = sr;
    if (!d) return;
    // An orientation whose data tensor is undefined gets no packed output (only its BF16 copy).
    const bool packed = o.write_packed && d->data.defined();
    if (packed) {
      oo.data = d->data.ptr<uint8_t>();
      oo.scales = d->scales.data();
    }
    if (want_bf16 && (bf16 != nullptr || !packed)) {
      FOURBIT_CHECK(bf16 != nullptr && bf16->dtype == DType::kBF16 && bf16->device == Device::kCuda &&
                        bf16->numel() == d->rows * d->cols,
                    "quantize_cuda('{}'): write_bf16_scaled needs a bf16 CUDA output of {} x {} for "
                    "each orientation that is not written packed",
                    o.tensor_name, d->rows, d->cols);
      oo.bf16 = bf16->ptr<uint16_t>();
    }
  };
  bind(out.rowwise, p.row, bf16_rowwise, o.sr);
  FOURBIT_CHECK(!o.colwise_sr || !cfg.block_2d,
                "quantize_cuda('{}'): colwise_sr applies to 1D blocks only (a 2D column-wise copy "
                "is the transpose of the row-wise one)", o.tensor_name);
  bind(out.colwise, p.col, bf16_colwise,
       o.colwise_sr ? *o.colwise_sr : RandomStream{o.sr.seed, o.sr.stream ^ kColwiseStreamBit});

  // Global amax (NVFP4: per orientation, column-wise after RHT, or per row; FP8 tensor: one).
  if (cfg.nvfp4_row_amax) {
    FOURBIT_CHECK(!out.colwise && out.rowwise && out.rowwise->amax.numel() == M,
                  "quantize_cuda('{}'): a per-row amax (nvfp4_row_amax) needs a bundle with only the "
                  "row-wise copy and {} amaxes (allocate_quantized makes it)", o.tensor_name, M);
    FOURBIT_CHECK(o.given_rowwise_amax == nullptr,
                  "quantize_cuda('{}'): per-row amaxes (nvfp4_row_amax) are computed here; do not "
                  "pass given_rowwise_amax", o.tensor_name);
    float* row_amax = out.rowwise->amax.ptr<float>();
    kernels::launch_row_amax(src.data, src.dtype == DType::kBF16, M, K, row_amax, flags, stream);
    p.row.amax = row_amax;
    p.row.amax_per_row = true;
  } else if (cfg.format == Format::kNvfp4 || cfg.format == Format::kFp8Tensor) {
    std::optional<QuantizedData>& any = out.rowwise ? out.rowwise : out.colwise;
    float* row_amax = out.rowwise ? out.rowwise->amax.ptr<float>() : nullptr;
    float* col_amax = out.colwise ? out.colwise->amax.ptr<float>() : nullptr;
    if (cfg.format == Format::kFp8Tensor) {
      row_amax = any->amax.ptr<float>();
      col_amax = (out.rowwise && out.colwise) ? out.colwise->amax.ptr<float>() : nullptr;
    }
    const bool given = o.given_rowwise_amax != nullptr;
    if (!given) {
      float* first = row_amax ? row_amax : col_amax;
      float* second = row_amax ? col_amax : nullptr;
      const bool rht_col = cfg.rht && out.colwise.has_value();
      if (!row_amax && rht_col) {
        // Only the column-wise copy with RHT: compute both into a scratch row amax.
        first = default_error_flag_scratch_amax();
        second = col_amax;
      }
      amax_cuda(src, first, second, rht_col, p.rht_sign_mask, flags, o.stream);
    }
    if (out.rowwise) p.row.amax = out.rowwise->amax.defined() ? out.rowwise->amax.ptr<float>() : row_amax;
    if (out.colwise) p.col.amax = out.colwise->amax.defined() ? out.colwise->amax.ptr<float>() : row_amax;
    if (cfg.format == Format::kFp8Tensor) p.row.amax = any->amax.ptr<float>();
    if (given) {
      // Each bundle with an amax gets the given one. The quantize kernel reads a given amax where
      // it is and its first thread stores it into the bundle (OrientationOut::amax_copy), so no
      // memcpy launch precedes the kernel; with FOURBIT_QUANT_AMAX_COPY=0 (A/B), or an empty
      // source (no kernel launches), a memcpy each, and the kernel reads the bundles.
      static const bool copy_switch = env_switch("FOURBIT_QUANT_AMAX_COPY") != 0;
      const bool in_kernel = copy_switch && M > 0 && K > 0;
      const auto take = [&](std::optional<QuantizedData>& d, kernels::OrientationOut& oo, const float* amax) {
        if (!d || !d->amax.defined()) return;
        if (in_kernel) {
          oo.amax_copy = d->amax.ptr<float>();
          oo.amax = amax;
        } else {
          FOURBIT_CUDA_CHECK(cudaMemcpyAsync(d->amax.data(), amax, sizeof(float), cudaMemcpyDeviceToDevice, stream));
        }
      };
      FOURBIT_CHECK(!cfg.rht || !out.colwise || !out.colwise->amax.defined() || o.given_colwise_amax != nullptr,
                    "quantize_cuda('{}'): with RHT the column-wise amax (after the transform) "
                    "must be given too", o.tensor_name);
      take(out.rowwise, p.row, o.given_rowwise_amax);
      take(out.colwise, p.col, cfg.rht ? o.given_colwise_amax : o.given_rowwise_amax);
      // FP8 per-tensor scaling reads p.row.amax for either orientation: the given amax too, never a
      // bundle slot that the same launch writes (only the column-wise bundle may exist).
      if (in_kernel && cfg.format == Format::kFp8Tensor) p.row.amax = o.given_rowwise_amax;
    }
  }

  kernels::launch_quantize(cfg.format, cfg.block_2d, src.dtype == DType::kBF16, p, stream);

  if (!o.nonfinite_flag) {
    int host_flags = 0;
    FOURBIT_CUDA_CHECK(cudaMemcpyAsync(&host_flags, flags, sizeof(int), cudaMemcpyDeviceToHost, stream));
    FOURBIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    report_error_flags(host_flags, o.tensor_name, src);
  }
}

void dequantize_cuda(const QuantizedTensor& q, bool colwise, const TensorView& out, void* stream) {
  const std::optional<QuantizedData>& od = colwise ? q.colwise : q.rowwise;
  FOURBIT_CHECK(od.has_value(), "dequantize_cuda: the {} copy was not quantized",
                colwise ? "column-wise" : "row-wise");
  FOURBIT_CHECK(out.dtype == DType::kF32 && out.device == Device::kCuda &&
                    out.numel() == od->rows * od->cols,
                "dequantize_cuda: output must be f32 [{}, {}] on cuda, got {}", od->rows, od->cols,
                out.describe());
  kernels::DequantParams p{};
  p.format = q.config.format;
  p.block_2d = q.config.block_2d;
  p.data = od->data.ptr<const uint8_t>();
  p.scales = od->scales.data();
  p.amax = od->amax.defined() ? od->amax.ptr<const float>() : nullptr;
  p.amax_per_row = od->amax.defined() && od->amax.numel() > 1;
  p.nvfp4_constant = q.config.nvfp4_global_constant();
  p.rows = od->rows;
  p.cols = od->cols;
  p.out = out.ptr<float>();
  kernels::launch_dequantize(p, static_cast<cudaStream_t>(stream));
}

void fill_normal_cuda(const TensorView& dst, uint64_t seed, void* stream) {
  FOURBIT_CHECK(dst.device == Device::kCuda && dst.is_contiguous() &&
                    (dst.dtype == DType::kF32 || dst.dtype == DType::kBF16),
                "fill_normal_cuda needs a contiguous f32 or bf16 CUDA tensor, got {}", dst.describe());
  kernels::launch_fill_normal(dst.data, dst.dtype == DType::kBF16, dst.numel(), seed,
                              static_cast<cudaStream_t>(stream));
}

}  // namespace fourbit::quant
