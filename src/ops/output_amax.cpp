// The CPU reference of OutputAmaxes (output_amax.h): naive loops over the output, the RHT of each
// 16-row column segment through quant/block_math.h's rht16_forward (the quantizer reference's).
#include "ops/output_amax.h"

#include "core/check.h"
#include "core/tensor.h"
#include "formats/element.h"
#include "quant/block_math.h"

#include <algorithm>
#include <cmath>

namespace fourbit::ops {

bool output_amaxes_supported(int64_t n_rows, int64_t cols) { return n_rows % 16 == 0 && cols % 2 == 0; }

namespace detail {

void check_output_amaxes(std::string_view op, const OutputAmaxes& a, Device device, DType dtype,
                         int64_t n_rows, int64_t cols,
                         std::initializer_list<std::pair<const char*, const TensorView*>> tensors) {
  FOURBIT_CHECK(a.amax != nullptr, "{}: OutputAmaxes::amax is required", op);
  if (device == Device::kCpu) {
    FOURBIT_CHECK(a.rht_amax == nullptr || n_rows % 16 == 0,
                  "{}: the output's RHT amax needs N % 16 == 0 (16-row segments), got N = {}", op, n_rows);
    return;
  }
  FOURBIT_CHECK(dtype == DType::kBF16 && output_amaxes_supported(n_rows, cols),
                "{}: the CUDA kernel computes the output amaxes for bf16 tensors with N % 16 == 0 and "
                "an even number of columns only, got {} [{}, {}]; quantize with the separate amax "
                "pass instead", op, dtype_name(dtype), n_rows, cols);
  for (const auto& [name, t] : tensors)
    FOURBIT_CHECK(t->is_contiguous() && reinterpret_cast<uintptr_t>(t->data) % 4 == 0,
                  "{}: with output amaxes, {} ({}) must be contiguous and start on a 4-byte boundary",
                  op, name, t->describe());
}

namespace {

template <typename T>
void accumulate(const T* out, int64_t n_rows, int64_t cols, const OutputAmaxes& a) {
  float m = *a.amax;
  for (int64_t i = 0; i < n_rows * cols; ++i) {
    const float x = std::fabs((float)out[i]);
    if (!std::isnan(x)) m = std::max(m, x);
  }
  *a.amax = m;
  if (a.rht_amax == nullptr) return;
  float r = *a.rht_amax;
  for (int64_t r0 = 0; r0 < n_rows; r0 += 16)
    for (int64_t c = 0; c < cols; ++c) {
      float v[16];
      for (int i = 0; i < 16; ++i) v[i] = (float)out[(r0 + i) * cols + c];
      quant::rht16_forward(v, a.rht_sign_mask);
      for (float y : v) {
        const float x = std::fabs(y);
        if (!std::isnan(x)) r = std::max(r, x);
      }
    }
  *a.rht_amax = r;
}

}  // namespace

void reference_output_amaxes(const TensorView& out, const OutputAmaxes& a) {
  FOURBIT_CHECK(a.amax != nullptr, "output amaxes: OutputAmaxes::amax is required");
  FOURBIT_CHECK(out.device == Device::kCpu && out.shape.ndim == 2 && out.is_contiguous() &&
                    (out.dtype == DType::kF32 || out.dtype == DType::kF64),
                "output amaxes: the output must be a contiguous f32/f64 CPU matrix, got {}", out.describe());
  const int64_t n_rows = out.shape[0], cols = out.shape[1];
  FOURBIT_CHECK(a.rht_amax == nullptr || n_rows % 16 == 0,
                "output amaxes: the RHT amax needs rows in whole 16-row segments, got {}", out.describe());
  if (out.dtype == DType::kF64) {
    accumulate(out.ptr<const double>(), n_rows, cols, a);
  } else {
    accumulate(out.ptr<const float>(), n_rows, cols, a);
  }
}

}  // namespace detail
}  // namespace fourbit::ops
