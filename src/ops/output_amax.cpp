// The CPU reference of OutputAmaxes (output_amax.h): naive loops over the output, the RHT of each
// 16-row column segment through quant/block_math.h's rht16_forward (the quantizer reference's).
#include "ops/output_amax.h"

#include "core/check.h"
#include "formats/element.h"
#include "quant/block_math.h"

#include <algorithm>
#include <cmath>

namespace fourbit::ops::detail {
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

}  // namespace fourbit::ops::detail
