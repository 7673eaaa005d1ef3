// Host side of RMSNorm: checks, dispatch, and the CPU reference (naive loops over rows and
// columns, templated over f32/f64, accumulating in the scalar type).
#include "ops/rmsnorm.h"

#include "ops/arg_checks.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#if defined(FOURBIT_WITH_CUDA)
#include "ops/rmsnorm_kernels.h"
#endif

namespace fourbit::ops {
namespace {

using detail::check_dtype;
using detail::check_shape;

// CUDA backward: the rows are split into chunks, one CTA each, whose rows the CTA walks in order
// (one row's load, reduction and store at a time). The chunk count is a function of N and C only,
// so that the dweight reduction order does not depend on the device: up to 2048 chunks (enough
// CTAs to keep every SM's loads in flight: with 256, a GPT-2-small step spent ~4x the memory
// time in these kernels, bench/notes-train.md, session 15), fewer for wide rows so that the f32
// partial sums (chunks x C) stay within 4 Mi floats (16 MiB), but never fewer than 256.
// FOURBIT_RMSNORM_MAX_CHUNKS=<n> (read once per process) replaces the bound, for A/B runs (256:
// the kernels' launch before session 15).
// The widest rows whose output amaxes the CUDA backward computes (kernels::kRmsnormAmaxMaxCols).
constexpr int64_t kAmaxMaxCols = 2048;

int64_t max_row_chunks(int64_t C) {
  static const int64_t forced = [] {
    const char* v = std::getenv("FOURBIT_RMSNORM_MAX_CHUNKS");
    const long long n = v != nullptr ? std::atoll(v) : 0;
    return n > 0 ? (int64_t)n : int64_t{0};
  }();
  if (forced > 0) return forced;
  const int64_t by_workspace = (int64_t{4} << 20) / std::max<int64_t>(C, 1);
  return std::clamp<int64_t>(by_workspace, 256, 2048);
}
// Chunks of whole 16-row segments where that leaves at least 1024 chunks (rmsnorm_backward_
// accumulate's output amaxes need them; a rule of N and C alone, so that dweight has the same bits
// with and without amaxes).
int64_t rows_per_chunk(int64_t n_rows, int64_t C) {
  const int64_t chunks = max_row_chunks(C);
  const int64_t rows = (n_rows + chunks - 1) / chunks;
  if (n_rows % 16 != 0 || rows % 16 == 0) return rows;
  const int64_t rows16 = (rows + 15) / 16 * 16;
  return (n_rows + rows16 - 1) / rows16 >= 1024 ? rows16 : rows;
}
int64_t n_chunks(int64_t n_rows, int64_t C) {
  return n_rows == 0 ? 0 : (n_rows + rows_per_chunk(n_rows, C) - 1) / rows_per_chunk(n_rows, C);
}

template <typename T>
void forward_reference(T* y, T* rstd, const T* x, const T* w, int64_t n_rows, int64_t cols, T eps) {
  for (int64_t n = 0; n < n_rows; ++n) {
    const T* xr = x + n * cols;
    T ss = 0;
    for (int64_t c = 0; c < cols; ++c) ss += xr[c] * xr[c];
    const T r = T(1) / std::sqrt(ss / T(cols) + eps);
    rstd[n] = r;
    for (int64_t c = 0; c < cols; ++c) y[n * cols + c] = xr[c] * r * w[c];
  }
}

template <typename T>
void backward_reference(T* dx, T* dw, const T* dy, const T* x, const T* w, const T* rstd,
                        int64_t n_rows, int64_t cols, bool accumulate) {
  for (int64_t n = 0; n < n_rows; ++n) {
    const T* xr = x + n * cols;
    const T* dyr = dy + n * cols;
    const T r = rstd[n];
    T dot = 0;  // sum_c g * xhat
    for (int64_t c = 0; c < cols; ++c) dot += dyr[c] * w[c] * (xr[c] * r);
    const T mean = dot / T(cols);
    for (int64_t c = 0; c < cols; ++c) {
      const T xhat = xr[c] * r;
      const T v = r * (dyr[c] * w[c] - xhat * mean);
      dx[n * cols + c] = accumulate ? dx[n * cols + c] + v : v;
      dw[c] += dyr[c] * xhat;
    }
  }
}

#if defined(FOURBIT_WITH_CUDA)
kernels::FloatType float_type(const TensorView& t) {
  return t.dtype == DType::kBF16 ? kernels::FloatType::kBF16 : kernels::FloatType::kF32;
}
#endif

// [N, C] of x, after checking that it is 2-D with C >= 1.
std::pair<int64_t, int64_t> rows_cols(std::string_view op, const TensorView& x) {
  FOURBIT_CHECK(x.shape.ndim == 2, "{}: x must be [N, C] (2-D; view [B, T, C] as [B*T, C]), got {}",
                op, x.describe());
  FOURBIT_CHECK(x.shape[1] >= 1, "{}: x must have at least one column, got {}", op, x.describe());
  return {x.shape[0], x.shape[1]};
}

}  // namespace

void rmsnorm_forward(const TensorView& y, const TensorView& rstd, const TensorView& x,
                     const TensorView& weight, float eps, void* stream) {
  constexpr std::string_view op = "rmsnorm_forward";
  const Device dev =
      detail::common_device(op, {{"y", &y}, {"rstd", &rstd}, {"x", &x}, {"weight", &weight}});
  const auto [N, C] = rows_cols(op, x);
  check_shape(op, "x", x, {N, C});
  check_shape(op, "y", y, {N, C});
  check_shape(op, "rstd", rstd, {N});
  check_shape(op, "weight", weight, {C});
  FOURBIT_CHECK(std::isfinite(eps) && eps >= 0, "{}: eps must be finite and >= 0, got {}", op, eps);
  FOURBIT_CHECK(detail::distinct(y, x), "{}: y must not alias x", op);
  if (dev == Device::kCpu) {
    const DType dt =
        detail::cpu_float_dtype(op, {{"y", &y}, {"rstd", &rstd}, {"x", &x}, {"weight", &weight}});
    if (dt == DType::kF64) {
      forward_reference(y.ptr<double>(), rstd.ptr<double>(), x.ptr<const double>(),
                        weight.ptr<const double>(), N, C, (double)eps);
    } else {
      forward_reference(y.ptr<float>(), rstd.ptr<float>(), x.ptr<const float>(),
                        weight.ptr<const float>(), N, C, eps);
    }
    return;
  }
#if defined(FOURBIT_WITH_CUDA)
  check_dtype(op, "x", x, {DType::kBF16, DType::kF32});
  check_dtype(op, "y", y, {x.dtype});
  check_dtype(op, "weight", weight, {DType::kBF16, DType::kF32});
  check_dtype(op, "rstd", rstd, {DType::kF32});
  FOURBIT_CHECK(C <= kernels::kRmsnormMaxCols, "{}: C = {} exceeds the CUDA kernel's limit of {}",
                op, C, kernels::kRmsnormMaxCols);
  kernels::RmsnormForwardArgs a{};
  a.y = y.data;
  a.rstd = rstd.ptr<float>();
  a.x = x.data;
  a.weight = weight.data;
  a.act_type = float_type(x);
  a.weight_type = float_type(weight);
  a.n_rows = N;
  a.cols = (int)C;
  a.eps = eps;
  kernels::launch_rmsnorm_forward(a, static_cast<cudaStream_t>(stream));
#else
  (void)stream;
  detail::no_cuda_build(op);
#endif
}

int64_t rmsnorm_backward_workspace_bytes(int64_t n_rows, int64_t C) {
  return n_chunks(n_rows, C) * C * (int64_t)sizeof(float);
}

namespace {
void rmsnorm_backward_impl(std::string_view op, bool accumulate, const TensorView& dx,
                           const TensorView& dweight, const TensorView& dy, const TensorView& x,
                           const TensorView& weight, const TensorView& rstd,
                           const TensorView& workspace, void* stream,
                           const OutputAmaxes* amaxes = nullptr) {
  const Device dev = detail::common_device(op, {{"dx", &dx},
                                                {"dweight", &dweight},
                                                {"dy", &dy},
                                                {"x", &x},
                                                {"weight", &weight},
                                                {"rstd", &rstd}});
  const auto [N, C] = rows_cols(op, x);
  check_shape(op, "x", x, {N, C});
  check_shape(op, "dy", dy, {N, C});
  check_shape(op, "dx", dx, {N, C});
  check_shape(op, "rstd", rstd, {N});
  check_shape(op, "weight", weight, {C});
  check_shape(op, "dweight", dweight, {C});
  FOURBIT_CHECK(detail::distinct(dx, dy) && detail::distinct(dx, x),
                "{}: dx must not alias dy or x", op);
  if (amaxes != nullptr) {
    detail::check_output_amaxes(op, *amaxes, dev, dx.dtype, N, C, {{"dx", &dx}});
    FOURBIT_CHECK(dev == Device::kCpu || rmsnorm_backward_accumulate_amaxes_supported(N, C),
                  "{}: the CUDA kernel computes the output amaxes for N % 16 == 0, C <= {} and 16-row "
                  "chunks only (rmsnorm_backward_accumulate_amaxes_supported), got [{}, {}]; add with "
                  "add_inplace's amaxes instead", op, kAmaxMaxCols, N, C);
  }
  if (dev == Device::kCpu) {
    const DType dt = detail::cpu_float_dtype(op, {{"dx", &dx},
                                                  {"dweight", &dweight},
                                                  {"dy", &dy},
                                                  {"x", &x},
                                                  {"weight", &weight},
                                                  {"rstd", &rstd}});
    if (dt == DType::kF64) {
      backward_reference(dx.ptr<double>(), dweight.ptr<double>(), dy.ptr<const double>(),
                         x.ptr<const double>(), weight.ptr<const double>(),
                         rstd.ptr<const double>(), N, C, accumulate);
    } else {
      backward_reference(dx.ptr<float>(), dweight.ptr<float>(), dy.ptr<const float>(),
                         x.ptr<const float>(), weight.ptr<const float>(), rstd.ptr<const float>(),
                         N, C, accumulate);
    }
    if (amaxes != nullptr) detail::reference_output_amaxes(dx, *amaxes);
    return;
  }
#if defined(FOURBIT_WITH_CUDA)
  check_dtype(op, "x", x, {DType::kBF16, DType::kF32});
  check_dtype(op, "dy", dy, {x.dtype});
  check_dtype(op, "dx", dx, {x.dtype});
  check_dtype(op, "weight", weight, {DType::kBF16, DType::kF32});
  check_dtype(op, "rstd", rstd, {DType::kF32});
  check_dtype(op, "dweight", dweight, {DType::kF32});
  FOURBIT_CHECK(C <= kernels::kRmsnormMaxCols, "{}: C = {} exceeds the CUDA kernel's limit of {}",
                op, C, kernels::kRmsnormMaxCols);
  const int64_t need = rmsnorm_backward_workspace_bytes(N, C);
  FOURBIT_CHECK(
      need == 0 || (detail::present(workspace) && workspace.device == Device::kCuda &&
                    workspace.is_contiguous() && workspace.nbytes() >= need &&
                    detail::aligned16(workspace.data)),
      "{}: workspace must be a contiguous, 16-byte aligned CUDA tensor of at least {} bytes "
      "(rmsnorm_backward_workspace_bytes({}, {})), got {}",
      op, need, N, C, detail::present(workspace) ? workspace.describe() : "none");
  kernels::RmsnormBackwardArgs a{};
  a.dx = dx.data;
  a.dweight = dweight.ptr<float>();
  a.partial = static_cast<float*>(workspace.data);
  a.dy = dy.data;
  a.x = x.data;
  a.weight = weight.data;
  a.rstd = rstd.ptr<const float>();
  a.act_type = float_type(x);
  a.weight_type = float_type(weight);
  a.n_rows = N;
  a.cols = (int)C;
  a.n_chunks = n_chunks(N, C);
  a.rows_per_chunk = rows_per_chunk(N, C);
  a.accumulate = accumulate;
  if (amaxes != nullptr) a.amaxes = *amaxes;
  kernels::launch_rmsnorm_backward(a, static_cast<cudaStream_t>(stream));
#else
  (void)stream;
  (void)workspace;
  (void)accumulate;
  detail::no_cuda_build(op);
#endif
}
}  // namespace

void rmsnorm_backward(const TensorView& dx, const TensorView& dweight, const TensorView& dy,
                      const TensorView& x, const TensorView& weight, const TensorView& rstd,
                      const TensorView& workspace, void* stream) {
  rmsnorm_backward_impl("rmsnorm_backward", false, dx, dweight, dy, x, weight, rstd, workspace, stream);
}

void rmsnorm_backward_accumulate(const TensorView& dx_accum, const TensorView& dweight,
                                 const TensorView& dy, const TensorView& x, const TensorView& weight,
                                 const TensorView& rstd, const TensorView& workspace, void* stream,
                                 const OutputAmaxes* amaxes) {
  rmsnorm_backward_impl("rmsnorm_backward_accumulate", true, dx_accum, dweight, dy, x, weight, rstd,
                        workspace, stream, amaxes);
}

bool rmsnorm_backward_accumulate_amaxes_supported(int64_t n_rows, int64_t C) {
#if defined(FOURBIT_WITH_CUDA)
  const int64_t chunk_rows = rows_per_chunk(n_rows, C);
  static_assert(kAmaxMaxCols == kernels::kRmsnormAmaxMaxCols, "one limit");
  return n_rows % 16 == 0 && C >= 1 && C <= kAmaxMaxCols && chunk_rows % 16 == 0;
#else
  return n_rows % 16 == 0 && C >= 1;
#endif
}

}  // namespace fourbit::ops
