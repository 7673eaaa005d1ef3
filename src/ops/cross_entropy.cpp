// Host side of the softmax cross-entropy: checks, dispatch, and the CPU reference (a naive
// two-pass softmax per row, templated over f32/f64).
#include "ops/cross_entropy.h"

#include "ops/arg_checks.h"
#include "ops/error_flags.h"

#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>

#if defined(FOURBIT_WITH_CUDA)
#include "ops/cross_entropy_kernels.h"
#endif

namespace fourbit::ops {
namespace {

using detail::check_dtype;
using detail::check_shape;
using detail::present;

constexpr int32_t kIgnored = -1;

template <typename T>
T row_lse(const T* row, int64_t V) {
  T m = row[0];
  for (int64_t v = 1; v < V; ++v) m = std::max(m, row[v]);
  T s = 0;
  for (int64_t v = 0; v < V; ++v) s += std::exp(row[v] - m);
  return m + std::log(s);
}

// Forward and/or backward of every row; dlogits may equal logits (each row's lse is computed
// before the row is overwritten). lse_out: each row's lse is written (0 when ignored); lse_in: the
// rows' lse are taken from it instead of computed (backward only: losses and mean_loss null).
template <typename T>
void reference(T* losses, T* mean_loss, T* dlogits, const T* logits, const int32_t* targets,
               const T* row_weights, int64_t N, int64_t V, T dloss_scale, T* lse_out = nullptr,
               const T* lse_in = nullptr) {
  T sum = 0;
  int64_t count = 0;
  for (int64_t n = 0; n < N; ++n) {
    const int32_t t = targets[n];
    const T* row = logits + n * V;
    T* drow = dlogits ? dlogits + n * V : nullptr;
    if (t == kIgnored) {
      if (losses) losses[n] = 0;
      if (lse_out) lse_out[n] = 0;
      if (drow)
        for (int64_t v = 0; v < V; ++v) drow[v] = 0;
      continue;
    }
    const T lse = lse_in ? lse_in[n] : row_lse(row, V);
    if (lse_out) lse_out[n] = lse;
    const T loss = lse - row[t];
    if (losses) losses[n] = loss;
    sum += loss;
    ++count;
    const T scale = row_weights ? row_weights[n] * dloss_scale : dloss_scale;
    if (drow)
      for (int64_t v = 0; v < V; ++v)
        drow[v] = (std::exp(row[v] - lse) - (v == t ? T(1) : T(0))) * scale;
  }
  if (mean_loss) *mean_loss = count > 0 ? sum / T(count) : T(0);
}

void check_targets_cpu(std::string_view op, const TensorView& targets, int64_t V) {
  const int32_t* t = targets.ptr<const int32_t>();
  for (int64_t n = 0; n < targets.numel(); ++n) {
    FOURBIT_CHECK(t[n] == kIgnored || (t[n] >= 0 && t[n] < V),
                  "{}: targets[{}] = {} is outside [0, V = {}) and not -1 (ignored); check the "
                  "tokenizer's vocabulary size against the model's",
                  op, n, t[n], V);
  }
}

#if defined(FOURBIT_WITH_CUDA)
kernels::FloatType float_type(const TensorView& t) {
  return t.dtype == DType::kBF16 ? kernels::FloatType::kBF16 : kernels::FloatType::kF32;
}
#endif

// The shared body of the entry points. dlogits absent: forward only; losses absent: backward
// only; row_weights absent: weight 1.
// lse_out: the forward also writes each row's lse; lse_in: the backward takes them (no forward).
void run(std::string_view op, const TensorView& losses, const TensorView& mean_loss,
         const TensorView& dlogits, const TensorView& logits, const TensorView& targets,
         float dloss_scale, int* error_flag, void* stream, CrossEntropyExp exp,
         const TensorView& row_weights = TensorView{}, const TensorView& lse_out = TensorView{},
         const TensorView& lse_in = TensorView{}) {
  const Device dev = detail::common_device(op, {{"logits", &logits},
                                                {"targets", &targets},
                                                {"losses", &losses},
                                                {"mean_loss", &mean_loss},
                                                {"dlogits", &dlogits},
                                                {"row_weights", &row_weights},
                                                {"lse (out)", &lse_out},
                                                {"lse", &lse_in}});
  FOURBIT_CHECK(logits.shape.ndim == 2 && logits.shape[1] >= 1,
                "{}: logits must be [N, V] with V >= 1, got {}", op, logits.describe());
  const int64_t N = logits.shape[0], V = logits.shape[1];
  check_shape(op, "logits", logits, {N, V});
  check_shape(op, "targets", targets, {N});
  check_dtype(op, "targets", targets, {DType::kI32});
  if (present(losses)) check_shape(op, "losses", losses, {N});
  if (present(mean_loss)) {
    FOURBIT_CHECK(mean_loss.numel() == 1 && mean_loss.is_contiguous(),
                  "{}: mean_loss must hold one element, got {}", op, mean_loss.describe());
  }
  if (present(row_weights)) check_shape(op, "row_weights", row_weights, {N});
  if (present(lse_out)) check_shape(op, "lse", lse_out, {N});
  if (present(lse_in)) check_shape(op, "lse", lse_in, {N});
  if (present(dlogits)) {
    check_shape(op, "dlogits", dlogits, {N, V});
    FOURBIT_CHECK(std::isfinite(dloss_scale), "{}: dloss_scale must be finite, got {}", op,
                  dloss_scale);
  }

  if (dev == Device::kCpu) {
    const DType dt = detail::cpu_float_dtype(op, {{"logits", &logits},
                                                  {"losses", &losses},
                                                  {"mean_loss", &mean_loss},
                                                  {"dlogits", &dlogits},
                                                  {"row_weights", &row_weights},
                                                  {"lse", present(lse_out) ? &lse_out : &lse_in}});
    check_targets_cpu(op, targets, V);
    const int32_t* t = targets.ptr<const int32_t>();
    if (dt == DType::kF64) {
      reference<double>(present(losses) ? losses.ptr<double>() : nullptr,
                        present(mean_loss) ? mean_loss.ptr<double>() : nullptr,
                        present(dlogits) ? dlogits.ptr<double>() : nullptr,
                        logits.ptr<const double>(), t,
                        present(row_weights) ? row_weights.ptr<const double>() : nullptr, N, V,
                        (double)dloss_scale, present(lse_out) ? lse_out.ptr<double>() : nullptr,
                        present(lse_in) ? lse_in.ptr<const double>() : nullptr);
    } else {
      reference<float>(present(losses) ? losses.ptr<float>() : nullptr,
                       present(mean_loss) ? mean_loss.ptr<float>() : nullptr,
                       present(dlogits) ? dlogits.ptr<float>() : nullptr, logits.ptr<const float>(),
                       t, present(row_weights) ? row_weights.ptr<const float>() : nullptr, N, V,
                       dloss_scale, present(lse_out) ? lse_out.ptr<float>() : nullptr,
                       present(lse_in) ? lse_in.ptr<const float>() : nullptr);
    }
    return;
  }
#if defined(FOURBIT_WITH_CUDA)
  check_dtype(op, "logits", logits, {DType::kBF16, DType::kF32});
  if (present(losses)) check_dtype(op, "losses", losses, {DType::kF32});
  if (present(mean_loss)) check_dtype(op, "mean_loss", mean_loss, {DType::kF32});
  if (present(dlogits)) check_dtype(op, "dlogits", dlogits, {DType::kBF16, DType::kF32});
  if (present(row_weights)) check_dtype(op, "row_weights", row_weights, {DType::kF32});
  if (present(lse_out)) check_dtype(op, "lse", lse_out, {DType::kF32});
  if (present(lse_in)) check_dtype(op, "lse", lse_in, {DType::kF32});
  FOURBIT_CHECK(
      reinterpret_cast<uintptr_t>(logits.data) % dtype_bytes(logits.dtype, 1) == 0 &&
          (!present(dlogits) ||
           reinterpret_cast<uintptr_t>(dlogits.data) % dtype_bytes(dlogits.dtype, 1) == 0),
      "{}: logits and dlogits must be aligned to their element size", op);
  kernels::CrossEntropyArgs a{};
  a.logits = logits.data;
  a.dlogits = present(dlogits) ? dlogits.data : nullptr;
  a.losses = present(losses) ? losses.ptr<float>() : nullptr;
  a.mean_loss = present(mean_loss) ? mean_loss.ptr<float>() : nullptr;
  a.targets = targets.ptr<const int32_t>();
  a.logits_type = float_type(logits);
  a.dlogits_type = present(dlogits) ? float_type(dlogits) : a.logits_type;
  a.n_rows = N;
  a.vocab = V;
  a.dloss_scale = dloss_scale;
  a.row_weights = present(row_weights) ? row_weights.ptr<const float>() : nullptr;
  a.lse_out = present(lse_out) ? lse_out.ptr<float>() : nullptr;
  a.lse_in = present(lse_in) ? lse_in.ptr<const float>() : nullptr;
  a.sfu_exp = cross_entropy_exp_in_effect(exp) == CrossEntropyExp::kSfu;
  detail::DeviceFlag flag(error_flag, stream);
  a.error_flag = flag.get();
  kernels::launch_cross_entropy(a, static_cast<cudaStream_t>(stream));
  const int bits = flag.finish();
  FOURBIT_CHECK((bits & kErrIndexOutOfRange) == 0,
                "{}: a target lies outside [0, V = {}) and is not -1 (ignored); its loss and "
                "dlogits row are NaN. Check the tokenizer's vocabulary size against the model's",
                op, V);
#else
  (void)stream;
  (void)error_flag;
  (void)exp;
  detail::no_cuda_build(op);
#endif
}

}  // namespace

CrossEntropyExp cross_entropy_exp_in_effect(CrossEntropyExp requested) {
  static const std::optional<CrossEntropyExp> from_env = []() -> std::optional<CrossEntropyExp> {
    const char* v = std::getenv("FOURBIT_CE_EXP");
    const std::string s = v != nullptr ? v : "";
    FOURBIT_CHECK(s.empty() || s == "expf" || s == "sfu",
                  "FOURBIT_CE_EXP must be 'expf' or 'sfu' (the cross-entropy kernels' exponential); got '{}'", s);
    if (s.empty()) return std::nullopt;
    return s == "sfu" ? CrossEntropyExp::kSfu : CrossEntropyExp::kExpf;
  }();
  return from_env.value_or(requested);
}

void cross_entropy_forward(const TensorView& losses, const TensorView& mean_loss,
                           const TensorView& logits, const TensorView& targets, int* error_flag,
                           void* stream, CrossEntropyExp exp) {
  FOURBIT_CHECK(present(losses), "cross_entropy_forward: losses is required");
  run("cross_entropy_forward", losses, mean_loss, TensorView{}, logits, targets, 0.0f, error_flag,
      stream, exp);
}

void cross_entropy_forward_saving_lse(const TensorView& losses, const TensorView& mean_loss,
                                      const TensorView& lse, const TensorView& logits,
                                      const TensorView& targets, int* error_flag, void* stream,
                                      CrossEntropyExp exp) {
  constexpr std::string_view op = "cross_entropy_forward_saving_lse";
  FOURBIT_CHECK(present(losses), "{}: losses is required", op);
  FOURBIT_CHECK(present(lse), "{}: lse is required (use cross_entropy_forward without it)", op);
  FOURBIT_CHECK(lse.is_contiguous(), "{}: lse must be contiguous, got {}", op, lse.describe());
  run(op, losses, mean_loss, TensorView{}, logits, targets, 0.0f, error_flag, stream, exp,
      TensorView{}, lse);
}

void cross_entropy_backward_inplace_from_lse(const TensorView& logits_to_dlogits,
                                             const TensorView& lse, const TensorView& targets,
                                             float dloss_scale, const TensorView& row_weights,
                                             int* error_flag, void* stream, CrossEntropyExp exp) {
  constexpr std::string_view op = "cross_entropy_backward_inplace_from_lse";
  FOURBIT_CHECK(present(lse), "{}: lse (from cross_entropy_forward_saving_lse) is required", op);
  FOURBIT_CHECK(lse.is_contiguous(), "{}: lse must be contiguous, got {}", op, lse.describe());
  run(op, TensorView{}, TensorView{}, logits_to_dlogits, logits_to_dlogits, targets, dloss_scale,
      error_flag, stream, exp, row_weights, TensorView{}, lse);
}

void cross_entropy_backward(const TensorView& dlogits, const TensorView& logits,
                            const TensorView& targets, float dloss_scale, int* error_flag,
                            void* stream, CrossEntropyExp exp) {
  FOURBIT_CHECK(present(dlogits), "cross_entropy_backward: dlogits is required");
  FOURBIT_CHECK(detail::distinct(dlogits, logits),
                "cross_entropy_backward: dlogits aliases logits; use "
                "cross_entropy_forward_backward_inplace to overwrite the logits");
  run("cross_entropy_backward", TensorView{}, TensorView{}, dlogits, logits, targets, dloss_scale,
      error_flag, stream, exp);
}

void cross_entropy_forward_backward_inplace(const TensorView& logits_to_dlogits,
                                            const TensorView& losses, const TensorView& mean_loss,
                                            const TensorView& targets, float dloss_scale,
                                            int* error_flag, void* stream, CrossEntropyExp exp) {
  FOURBIT_CHECK(present(losses), "cross_entropy_forward_backward_inplace: losses is required");
  run("cross_entropy_forward_backward_inplace", losses, mean_loss, logits_to_dlogits,
      logits_to_dlogits, targets, dloss_scale, error_flag, stream, exp);
}

void cross_entropy_forward_backward_inplace_weighted(const TensorView& logits_to_dlogits,
                                                     const TensorView& losses,
                                                     const TensorView& mean_loss,
                                                     const TensorView& targets,
                                                     const TensorView& row_weights,
                                                     float dloss_scale, int* error_flag,
                                                     void* stream, CrossEntropyExp exp) {
  constexpr std::string_view op = "cross_entropy_forward_backward_inplace_weighted";
  FOURBIT_CHECK(present(losses), "{}: losses is required", op);
  FOURBIT_CHECK(present(row_weights), "{}: row_weights is required (use the unweighted entry point "
                "for weight 1)", op);
  run(op, losses, mean_loss, logits_to_dlogits, logits_to_dlogits, targets, dloss_scale, error_flag,
      stream, exp, row_weights);
}

}  // namespace fourbit::ops
