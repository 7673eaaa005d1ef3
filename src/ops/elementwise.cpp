// Host side of the elementwise helpers: checks, dispatch, and the CPU reference loops.
#include "ops/elementwise.h"

#include "core/fill.h"
#include "formats/element.h"
#include "ops/arg_checks.h"
#include "ops/error_flags.h"

#include <cmath>
#include <mutex>
#include <vector>

#include <fmt/ranges.h>

#if defined(FOURBIT_WITH_CUDA)
#include "ops/elementwise_kernels.h"

#include <cuda_runtime_api.h>
#endif

namespace fourbit::ops {
namespace {

using detail::check_dtype;
using detail::Named;

#if defined(FOURBIT_WITH_CUDA)
kernels::FloatType float_type(const TensorView& t) {
  return t.dtype == DType::kBF16 ? kernels::FloatType::kBF16 : kernels::FloatType::kF32;
}
#endif

template <typename T>
void add_reference(T* out, const T* a, const T* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

// Checks shared by add and add_inplace; returns the device.
Device check_add(std::string_view op, const TensorView& out, const TensorView& a,
                 const TensorView& b) {
  const Device dev = detail::common_device(op, {{"out", &out}, {"a", &a}, {"b", &b}});
  detail::check_shape(op, "a", a, a.shape);
  detail::check_shape(op, "b", b, a.shape);
  detail::check_shape(op, "out", out, a.shape);
  if (dev == Device::kCpu) {
    detail::cpu_float_dtype(op, {{"out", &out}, {"a", &a}, {"b", &b}});
  } else {
    for (const Named& n : {Named{"out", &out}, Named{"a", &a}, Named{"b", &b}})
      check_dtype(op, n.name, *n.t, {DType::kBF16, DType::kF32});
  }
  return dev;
}

void run_add(std::string_view op, const TensorView& out, const TensorView& a, const TensorView& b,
             void* stream) {
  const Device dev = check_add(op, out, a, b);
  const int64_t n = a.numel();
  if (dev == Device::kCpu) {
    if (a.dtype == DType::kF64) {
      add_reference(out.ptr<double>(), a.ptr<const double>(), b.ptr<const double>(), n);
    } else {
      add_reference(out.ptr<float>(), a.ptr<const float>(), b.ptr<const float>(), n);
    }
    return;
  }
#if defined(FOURBIT_WITH_CUDA)
  kernels::launch_add(out.data, float_type(out), a.data, float_type(a), b.data, float_type(b), n,
                      static_cast<cudaStream_t>(stream));
#else
  (void)stream;
  detail::no_cuda_build(op);
#endif
}

template <typename T>
NonFiniteSummary count_reference(const T* x, int64_t n) {
  NonFiniteSummary s;
  for (int64_t i = 0; i < n; ++i) {
    double v;
    if constexpr (std::is_same_v<T, uint16_t>) {
      v = formats::decode_bf16(x[i]);
    } else {
      v = x[i];
    }
    const bool is_nan = std::isnan(v), is_inf = std::isinf(v);
    s.nan_count += is_nan;
    s.inf_count += is_inf;
    if ((is_nan || is_inf) && s.first_index < 0) s.first_index = i;
  }
  return s;
}

NonFiniteSummary count_cpu(const TensorView& x) {
  switch (x.dtype) {
    case DType::kF64:
      return count_reference(x.ptr<const double>(), x.numel());
    case DType::kBF16:
      return count_reference(x.ptr<const uint16_t>(), x.numel());
    default:
      return count_reference(x.ptr<const float>(), x.numel());
  }
}

void check_nonfinite_input(std::string_view op, const TensorView& x) {
  if (x.device == Device::kCpu) {
    check_dtype(op, "x", x, {DType::kF32, DType::kBF16, DType::kF64});
  } else {
    check_dtype(op, "x", x, {DType::kF32, DType::kBF16});
  }
  FOURBIT_CHECK(x.is_contiguous(), "{}: x must be contiguous, got strides {}", op, x.strides.str());
}

#if defined(FOURBIT_WITH_CUDA)
kernels::NonFiniteCounts* counts_scratch() {
  static kernels::NonFiniteCounts* p = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    FOURBIT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), sizeof(kernels::NonFiniteCounts)));
  });
  return p;
}
#endif

}  // namespace

void add(const TensorView& out, const TensorView& a, const TensorView& b, void* stream) {
  FOURBIT_CHECK(detail::distinct(out, a) && detail::distinct(out, b),
                "add: out aliases an input; use add_inplace for a += b");
  run_add("add", out, a, b, stream);
}

void add_inplace(const TensorView& a, const TensorView& b, void* stream,
                 const OutputAmaxes* output_amaxes) {
  constexpr std::string_view op = "add_inplace";
  if (output_amaxes == nullptr) {
    run_add(op, a, a, b, stream);
    return;
  }
  const OutputAmaxes& amaxes = *output_amaxes;
  const Device dev = check_add(op, a, a, b);
  FOURBIT_CHECK(a.shape.ndim == 2, "{}: with output amaxes, a must be a matrix [N, C], got {}", op, a.describe());
  const int64_t N = a.shape[0], C = a.shape[1];
  FOURBIT_CHECK(a.dtype == b.dtype, "{}: with output amaxes, a ({}) and b ({}) must have one dtype", op,
                a.describe(), b.describe());
  detail::check_output_amaxes(op, amaxes, dev, a.dtype, N, C, {{"a", &a}, {"b", &b}});
  if (dev == Device::kCpu) {
    run_add(op, a, a, b, stream);
    detail::reference_output_amaxes(a, amaxes);
    return;
  }
#if defined(FOURBIT_WITH_CUDA)
  kernels::launch_add_inplace_amax(a.data, b.data, N, C, amaxes, static_cast<cudaStream_t>(stream));
#else
  (void)stream;
  detail::no_cuda_build(op);
#endif
}

void cast(const TensorView& out, const TensorView& x, void* stream) {
  constexpr std::string_view op = "cast";
  const Device dev = detail::common_device(op, {{"out", &out}, {"x", &x}});
  detail::check_shape(op, "x", x, x.shape);
  detail::check_shape(op, "out", out, x.shape);
  check_dtype(op, "x", x, {DType::kF32, DType::kBF16});
  check_dtype(op, "out", out, {DType::kF32, DType::kBF16});
  FOURBIT_CHECK(out.dtype != x.dtype, "cast: out and x are both {}; cast converts f32 <-> bf16",
                dtype_name(x.dtype));
  const int64_t n = x.numel();
  if (dev == Device::kCpu) {
    if (x.dtype == DType::kF32) {
      const float* src = x.ptr<const float>();
      uint16_t* dst = out.ptr<uint16_t>();
      for (int64_t i = 0; i < n; ++i) dst[i] = formats::encode_bf16_rn(src[i]);
    } else {
      const uint16_t* src = x.ptr<const uint16_t>();
      float* dst = out.ptr<float>();
      for (int64_t i = 0; i < n; ++i) dst[i] = formats::decode_bf16(src[i]);
    }
    return;
  }
#if defined(FOURBIT_WITH_CUDA)
  kernels::launch_cast(out.data, float_type(out), x.data, float_type(x), n,
                       static_cast<cudaStream_t>(stream));
#else
  (void)stream;
  detail::no_cuda_build(op);
#endif
}

void flag_nonfinite(const TensorView& x, int* flag, void* stream) {
  check_nonfinite_input("flag_nonfinite", x);
  FOURBIT_CHECK(flag != nullptr, "flag_nonfinite: flag is null");
  if (x.device == Device::kCpu) {
    if (count_cpu(x).any()) *flag |= kErrNonFinite;
    return;
  }
#if defined(FOURBIT_WITH_CUDA)
  kernels::launch_nonfinite(x.data, float_type(x), x.numel(), flag, nullptr,
                            static_cast<cudaStream_t>(stream));
#else
  (void)stream;
  detail::no_cuda_build("flag_nonfinite");
#endif
}

NonFiniteSummary count_nonfinite(const TensorView& x, void* stream) {
  check_nonfinite_input("count_nonfinite", x);
  if (x.device == Device::kCpu) return count_cpu(x);
#if defined(FOURBIT_WITH_CUDA)
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  kernels::NonFiniteCounts* d = counts_scratch();
  kernels::NonFiniteCounts h{0, 0, ~0ull};
  FOURBIT_CUDA_CHECK(cudaMemcpyAsync(d, &h, sizeof(h), cudaMemcpyHostToDevice, s));
  kernels::launch_nonfinite(x.data, float_type(x), x.numel(), nullptr, d, s);
  FOURBIT_CUDA_CHECK(cudaMemcpyAsync(&h, d, sizeof(h), cudaMemcpyDeviceToHost, s));
  FOURBIT_CUDA_CHECK(cudaStreamSynchronize(s));
  NonFiniteSummary r;
  r.nan_count = (int64_t)h.nan_count;
  r.inf_count = (int64_t)h.inf_count;
  r.first_index = h.first_index == ~0ull ? -1 : (int64_t)h.first_index;
  return r;
#else
  (void)stream;
  detail::no_cuda_build("count_nonfinite");
#endif
}

void check_finite(const TensorView& x, std::string_view name, void* stream) {
  const NonFiniteSummary s = count_nonfinite(x, stream);
  if (!s.any()) return;
  // The first position as a multi-index, outermost first.
  std::vector<int64_t> index((size_t)x.shape.ndim);
  int64_t rest = s.first_index;
  for (int d = x.shape.ndim - 1; d >= 0; --d) {
    index[(size_t)d] = rest % x.shape[d];
    rest /= x.shape[d];
  }
  const std::string where = fmt::format("{}", fmt::join(index, ", "));
  FOURBIT_CHECK(false,
                "tensor '{}' ({}) holds {} NaN and {} Inf values (of {}); the first is at [{}] "
                "(flat index {}). It was produced by the op that wrote '{}' or by one before it: "
                "check the learning rate, the loss scale and the inputs of that step",
                name, x.describe(), s.nan_count, s.inf_count, x.numel(), where, s.first_index,
                name);
}

int read_and_clear_error_flag(int* device_flag, void* stream) {
  FOURBIT_CHECK(device_flag != nullptr, "read_and_clear_error_flag: flag is null");
#if defined(FOURBIT_WITH_CUDA)
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  int bits = 0;
  FOURBIT_CUDA_CHECK(cudaMemcpyAsync(&bits, device_flag, sizeof(int), cudaMemcpyDeviceToHost, s));
  device_fill_async(device_flag, 0, sizeof(int), s);
  FOURBIT_CUDA_CHECK(cudaStreamSynchronize(s));
  return bits;
#else
  (void)stream;
  detail::no_cuda_build("read_and_clear_error_flag");
#endif
}

}  // namespace fourbit::ops
