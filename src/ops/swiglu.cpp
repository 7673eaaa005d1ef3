// Host side of SwiGLU: checks, dispatch, and the CPU reference (templated over f32/f64).
#include "ops/swiglu.h"

#include "ops/arg_checks.h"

#include <cmath>

#if defined(FOURBIT_WITH_CUDA)
#include "ops/swiglu_kernels.h"
#endif

namespace fourbit::ops {
namespace {

using detail::check_dtype;
using detail::check_shape;

template <typename T>
T sigmoid(T g) {
  return T(1) / (T(1) + std::exp(-g));
}

template <typename T>
void forward_reference(T* out, const T* gate_up, int64_t n_rows, int64_t F) {
  for (int64_t n = 0; n < n_rows; ++n)
    for (int64_t j = 0; j < F; ++j) {
      const T g = gate_up[n * 2 * F + j], u = gate_up[n * 2 * F + F + j];
      out[n * F + j] = g * sigmoid(g) * u;
    }
}

// d_gate_up may equal gate_up: each element is read before it is written.
template <typename T>
void backward_reference(T* d_gate_up, const T* dout, const T* gate_up, int64_t n_rows, int64_t F) {
  for (int64_t n = 0; n < n_rows; ++n)
    for (int64_t j = 0; j < F; ++j) {
      const T g = gate_up[n * 2 * F + j], u = gate_up[n * 2 * F + F + j];
      const T dy = dout[n * F + j];
      const T s = sigmoid(g);
      d_gate_up[n * 2 * F + j] = dy * u * s * (T(1) + g * (T(1) - s));
      d_gate_up[n * 2 * F + F + j] = dy * (g * s);
    }
}

// N and F from gate_up [N, 2F].
std::pair<int64_t, int64_t> shape_of(std::string_view op, const TensorView& gate_up) {
  FOURBIT_CHECK(
      gate_up.shape.ndim == 2 && gate_up.shape[1] % 2 == 0,
      "{}: gate_up must be [N, 2F] (gate in the first F columns, up in the last F), got {}", op,
      gate_up.describe());
  return {gate_up.shape[0], gate_up.shape[1] / 2};
}

#if defined(FOURBIT_WITH_CUDA)
kernels::FloatType float_type(const TensorView& t) {
  return t.dtype == DType::kBF16 ? kernels::FloatType::kBF16 : kernels::FloatType::kF32;
}
#endif

void backward(std::string_view op, const TensorView& d_gate_up, const TensorView& dout,
              const TensorView& gate_up, void* stream, const OutputAmaxes* amaxes = nullptr) {
  const Device dev = detail::common_device(
      op, {{"d_gate_up", &d_gate_up}, {"dout", &dout}, {"gate_up", &gate_up}});
  const auto [N, F] = shape_of(op, gate_up);
  check_shape(op, "gate_up", gate_up, {N, 2 * F});
  check_shape(op, "d_gate_up", d_gate_up, {N, 2 * F});
  check_shape(op, "dout", dout, {N, F});
  if (amaxes) {
    detail::check_output_amaxes(op, *amaxes, dev, gate_up.dtype, N, F,
                                {{"d_gate_up", &d_gate_up}, {"dout", &dout}, {"gate_up", &gate_up}});
  }
  if (dev == Device::kCpu) {
    const DType dt = detail::cpu_float_dtype(
        op, {{"d_gate_up", &d_gate_up}, {"dout", &dout}, {"gate_up", &gate_up}});
    if (dt == DType::kF64) {
      backward_reference(d_gate_up.ptr<double>(), dout.ptr<const double>(),
                         gate_up.ptr<const double>(), N, F);
    } else {
      backward_reference(d_gate_up.ptr<float>(), dout.ptr<const float>(),
                         gate_up.ptr<const float>(), N, F);
    }
    if (amaxes) detail::reference_output_amaxes(d_gate_up, *amaxes);
    return;
  }
#if defined(FOURBIT_WITH_CUDA)
  check_dtype(op, "gate_up", gate_up, {DType::kBF16, DType::kF32});
  check_dtype(op, "d_gate_up", d_gate_up, {gate_up.dtype});
  check_dtype(op, "dout", dout, {gate_up.dtype});
  if (amaxes) {
    kernels::launch_swiglu_backward_amax(d_gate_up.data, dout.data, gate_up.data, N, F, *amaxes,
                                         static_cast<cudaStream_t>(stream));
    return;
  }
  kernels::launch_swiglu_backward(d_gate_up.data, dout.data, gate_up.data, float_type(gate_up), N,
                                  F, static_cast<cudaStream_t>(stream));
#else
  (void)stream;
  detail::no_cuda_build(op);
#endif
}

}  // namespace

void swiglu_forward(const TensorView& out, const TensorView& gate_up, void* stream,
                    const OutputAmaxes* amaxes) {
  constexpr std::string_view op = "swiglu_forward";
  const Device dev = detail::common_device(op, {{"out", &out}, {"gate_up", &gate_up}});
  const auto [N, F] = shape_of(op, gate_up);
  check_shape(op, "gate_up", gate_up, {N, 2 * F});
  check_shape(op, "out", out, {N, F});
  FOURBIT_CHECK(detail::distinct(out, gate_up), "{}: out must not alias gate_up", op);
  if (amaxes) detail::check_output_amaxes(op, *amaxes, dev, gate_up.dtype, N, F, {{"out", &out}, {"gate_up", &gate_up}});
  if (dev == Device::kCpu) {
    const DType dt = detail::cpu_float_dtype(op, {{"out", &out}, {"gate_up", &gate_up}});
    if (dt == DType::kF64) {
      forward_reference(out.ptr<double>(), gate_up.ptr<const double>(), N, F);
    } else {
      forward_reference(out.ptr<float>(), gate_up.ptr<const float>(), N, F);
    }
    if (amaxes) detail::reference_output_amaxes(out, *amaxes);
    return;
  }
#if defined(FOURBIT_WITH_CUDA)
  check_dtype(op, "gate_up", gate_up, {DType::kBF16, DType::kF32});
  check_dtype(op, "out", out, {gate_up.dtype});
  if (amaxes) {
    kernels::launch_swiglu_forward_amax(out.data, gate_up.data, N, F, *amaxes,
                                        static_cast<cudaStream_t>(stream));
    return;
  }
  kernels::launch_swiglu_forward(out.data, gate_up.data, float_type(gate_up), N, F,
                                 static_cast<cudaStream_t>(stream));
#else
  (void)stream;
  detail::no_cuda_build(op);
#endif
}

void swiglu_backward(const TensorView& d_gate_up, const TensorView& dout, const TensorView& gate_up,
                     void* stream) {
  FOURBIT_CHECK(detail::distinct(d_gate_up, gate_up) && detail::distinct(d_gate_up, dout),
                "swiglu_backward: d_gate_up aliases an input; use swiglu_backward_inplace to "
                "overwrite gate_up");
  backward("swiglu_backward", d_gate_up, dout, gate_up, stream);
}

void swiglu_backward_inplace(const TensorView& gate_up_to_d_gate_up, const TensorView& dout,
                             void* stream, const OutputAmaxes* amaxes) {
  FOURBIT_CHECK(detail::distinct(gate_up_to_d_gate_up, dout),
                "swiglu_backward_inplace: dout aliases gate_up");
  backward("swiglu_backward_inplace", gate_up_to_d_gate_up, dout, gate_up_to_d_gate_up, stream,
           amaxes);
}

}  // namespace fourbit::ops
