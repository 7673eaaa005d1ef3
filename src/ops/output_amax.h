// OutputAmaxes: the global amaxes that an NVFP4 quantization of an op's output needs, computed by
// the op while it writes that output, so that the quantizer skips its own read of the tensor
// (quant::CudaQuantizeOptions::given_rowwise_amax / given_colwise_amax). Definitions and device
// code: quant/amax_device.cuh; the values equal quant::amax_cuda on the written output bit for bit
// (CUDA) and the reference's amaxes on it (CPU):
//   amax      max |out| over the whole [N, C] output (NaN left out, Inf kept);
//   rht_amax  max over the 16-row column segments of the output of max |bf16(RHT16(segment))|
//             (the amax of the column-wise copy with the random Hadamard transform; N % 16 == 0).
// Both are ACCUMULATED with max into floats the caller zeroed (device floats for CUDA tensors,
// host floats for CPU ones), so several ops may contribute to one amax.
//
// Plain header (no tensor types), so that the kernels' launch interfaces take OutputAmaxes as is.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string_view>
#include <utility>

namespace fourbit {
struct TensorView;
enum class Device : uint8_t;
enum class DType : uint8_t;
}  // namespace fourbit

namespace fourbit::ops {

struct OutputAmaxes {
  float* amax = nullptr;           // required
  float* rht_amax = nullptr;       // null: no column-wise RHT amax
  uint16_t rht_sign_mask = 0;      // quant::QuantConfig::rht_sign_mask() of the consumer
  int* nonfinite_flag = nullptr;   // CUDA: NaN / Inf in the output ORs kErrNonFinite (may be null)
};

// Whether the CUDA kernels of the ops that take OutputAmaxes can compute them for an output of
// [n_rows, cols] (they take strips of 16 rows x 2 columns): n_rows % 16 == 0 and cols even. The
// CPU reference takes any shape (rht_amax: n_rows % 16 == 0).
bool output_amaxes_supported(int64_t n_rows, int64_t cols);

namespace detail {
// Checks an op's OutputAmaxes request before the op runs, naming the op: amax set; CPU: the RHT
// amax needs whole 16-row segments; CUDA: bf16 tensors (dtype), output_amaxes_supported(n_rows,
// cols), and each of `tensors` contiguous and 4-byte aligned.
void check_output_amaxes(std::string_view op, const OutputAmaxes& a, Device device, DType dtype,
                         int64_t n_rows, int64_t cols,
                         std::initializer_list<std::pair<const char*, const TensorView*>> tensors);
// The CPU reference: accumulates the amaxes of out [N, C] (f32 or f64, contiguous) into a.
void reference_output_amaxes(const TensorView& out, const OutputAmaxes& a);
}  // namespace detail

}  // namespace fourbit::ops
