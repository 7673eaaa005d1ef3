// Host side of the optimizer ops: checks, dispatch, and the CPU references (AdamW templated over
// f32/f64; the gradient norm accumulated in double).
#include "ops/adamw.h"

#include "formats/element.h"
#include "ops/arg_checks.h"

#include <fmt/format.h>

#include <cmath>
#include <string>

#if defined(FOURBIT_WITH_CUDA)
#include "ops/adamw_kernels.h"
#endif

namespace fourbit::ops {
namespace {

using detail::check_dtype;
using detail::present;

// CUDA grad norm: CTAs per tensor, a function of the size only (>= 8K elements per CTA, at most
// 1024 CTAs; an empty tensor still gets one CTA, which writes a zero partial). With 64K a CTA
// (before session 16), a GPT-2-small layer's matrices got 9-27 CTAs each, whose threads ran 32
// loop iterations of one load each: ~13 us a tensor, 0.9 ms a step over 74 tensors (tools/ktrace).
constexpr int64_t kSumElementsPerBlock = 8 * 1024;
constexpr int64_t kSumMaxBlocks = 1024;
int64_t sumsq_blocks(int64_t n) {
  const int64_t b = (n + kSumElementsPerBlock - 1) / kSumElementsPerBlock;
  return b < 1 ? 1 : b > kSumMaxBlocks ? kSumMaxBlocks : b;
}

template <typename T>
void adamw_reference(T* p, const T* g, T* m, T* v, uint16_t* p_bf16, int64_t n,
                     const AdamWParams& a, T bc1, T bc2) {
  const T lr = a.lr, b1 = a.beta1, b2 = a.beta2, eps = a.eps, wd = a.weight_decay,
          scale = a.grad_scale;
  for (int64_t i = 0; i < n; ++i) {
    const T gs = g[i] * scale;
    m[i] = b1 * m[i] + (T(1) - b1) * gs;
    v[i] = b2 * v[i] + (T(1) - b2) * (gs * gs);
    const T m_hat = m[i] / bc1, v_hat = v[i] / bc2;
    p[i] = p[i] - lr * (m_hat / (std::sqrt(v_hat) + eps) + wd * p[i]);
    if (p_bf16) p_bf16[i] = formats::encode_bf16_rn((float)p[i]);
  }
}

// The checks of one update (op names it in the messages); returns its device.
Device check_update(std::string_view op, const AdamWUpdate& u) {
  const auto& [params, grads, m, v, params_bf16, a] = u;
  const Device dev = detail::common_device(op, {{"params", &params},
                                                {"grads", &grads},
                                                {"m", &m},
                                                {"v", &v},
                                                {"params_bf16", &params_bf16}});
  for (const detail::Named& t : {detail::Named{"params", &params}, detail::Named{"grads", &grads},
                                 detail::Named{"m", &m}, detail::Named{"v", &v}}) {
    FOURBIT_CHECK(t.t->numel() == params.numel() && t.t->is_contiguous(),
                  "{}: {} must be contiguous with {} elements (as params), got {}", op, t.name,
                  params.numel(), t.t->describe());
  }
  if (present(params_bf16)) {
    FOURBIT_CHECK(params_bf16.numel() == params.numel() && params_bf16.is_contiguous(),
                  "{}: params_bf16 must be contiguous with {} elements, got {}", op, params.numel(),
                  params_bf16.describe());
    check_dtype(op, "params_bf16", params_bf16, {DType::kBF16});
  }
  FOURBIT_CHECK(detail::distinct(params, grads) && detail::distinct(params, m) &&
                    detail::distinct(params, v) && detail::distinct(m, v) &&
                    detail::distinct(grads, m) && detail::distinct(grads, v),
                "{}: params, grads, m and v must be distinct buffers", op);
  FOURBIT_CHECK(a.step >= 1, "{}: step must be >= 1 (1-based), got {}", op, a.step);
  FOURBIT_CHECK(std::isfinite(a.lr) && a.lr >= 0, "{}: lr must be finite and >= 0, got {}", op,
                a.lr);
  FOURBIT_CHECK(a.beta1 >= 0 && a.beta1 < 1 && a.beta2 >= 0 && a.beta2 < 1,
                "{}: beta1 and beta2 must lie in [0, 1), got {} and {}", op, a.beta1, a.beta2);
  FOURBIT_CHECK(std::isfinite(a.eps) && a.eps >= 0 && std::isfinite(a.weight_decay) &&
                    a.weight_decay >= 0 && std::isfinite(a.grad_scale),
                "{}: eps and weight_decay must be finite and >= 0 and grad_scale finite, got {}, "
                "{}, {}",
                op, a.eps, a.weight_decay, a.grad_scale);
  return dev;
}

}  // namespace

void adamw_update(const TensorView& params, const TensorView& grads, const TensorView& m,
                  const TensorView& v, const TensorView& params_bf16, const AdamWParams& a,
                  void* stream) {
  const AdamWUpdate u{params, grads, m, v, params_bf16, a};
  adamw_update_many(std::span<const AdamWUpdate>(&u, 1), stream);
}

void adamw_update_many(std::span<const AdamWUpdate> updates, void* stream) {
#if defined(FOURBIT_WITH_CUDA)
  kernels::AdamWBatch batch;
  const auto flush = [&] {
    if (batch.count > 0) kernels::launch_adamw(batch, static_cast<cudaStream_t>(stream));
    batch.count = 0;
  };
#endif
  for (size_t i = 0; i < updates.size(); ++i) {
    const auto& [params, grads, m, v, params_bf16, a] = updates[i];
    // Messages name the update where there are several.
    const std::string op = updates.size() == 1 ? std::string("adamw_update") : fmt::format("adamw_update_many: updates[{}]", i);
    const Device dev = check_update(op, updates[i]);
    const double bc1 = 1.0 - std::pow((double)a.beta1, (double)a.step);
    const double bc2 = 1.0 - std::pow((double)a.beta2, (double)a.step);
    const int64_t n = params.numel();

    if (dev == Device::kCpu) {
      const DType dt =
          detail::cpu_float_dtype(op, {{"params", &params}, {"grads", &grads}, {"m", &m}, {"v", &v}});
      uint16_t* pb = present(params_bf16) ? params_bf16.ptr<uint16_t>() : nullptr;
      if (dt == DType::kF64) {
        FOURBIT_CHECK(pb == nullptr, "{}: params_bf16 needs f32 params on the CPU", op);
        adamw_reference<double>(params.ptr<double>(), grads.ptr<const double>(), m.ptr<double>(),
                                v.ptr<double>(), nullptr, n, a, bc1, bc2);
      } else {
        adamw_reference<float>(params.ptr<float>(), grads.ptr<const float>(), m.ptr<float>(),
                               v.ptr<float>(), pb, n, a, (float)bc1, (float)bc2);
      }
      continue;
    }
#if defined(FOURBIT_WITH_CUDA)
    for (const detail::Named& t : {detail::Named{"params", &params}, detail::Named{"grads", &grads},
                                   detail::Named{"m", &m}, detail::Named{"v", &v}})
      check_dtype(op, t.name, *t.t, {DType::kF32});
    batch.seg[batch.count++] = {.params = params.ptr<float>(),
                                .grads = grads.ptr<const float>(),
                                .m = m.ptr<float>(),
                                .v = v.ptr<float>(),
                                .params_bf16 = present(params_bf16) ? params_bf16.ptr<uint16_t>() : nullptr,
                                .n = n,
                                .first_block = 0,
                                .blocks = 0,
                                .lr = a.lr,
                                .beta1 = a.beta1,
                                .beta2 = a.beta2,
                                .eps = a.eps,
                                .weight_decay = a.weight_decay,
                                .grad_scale = a.grad_scale,
                                .bias_correction1 = (float)bc1,
                                .bias_correction2 = (float)bc2};
    if (batch.count == kernels::kAdamWBatch) flush();
#else
    detail::no_cuda_build(op);
#endif
  }
#if defined(FOURBIT_WITH_CUDA)
  flush();
#else
  (void)stream;
#endif
}

int64_t grad_norm_workspace_bytes(std::span<const TensorView> tensors) {
  int64_t blocks = 0;
  for (const TensorView& t : tensors) blocks += sumsq_blocks(t.numel());
  return blocks * (int64_t)sizeof(double);
}

void global_grad_norm(const TensorView& norm, std::span<const TensorView> tensors,
                      const TensorView& workspace, void* stream) {
  constexpr std::string_view op = "global_grad_norm";
  FOURBIT_CHECK(norm.numel() == 1 && norm.is_contiguous(), "{}: norm must hold one element, got {}",
                op, present(norm) ? norm.describe() : "none");
  for (size_t i = 0; i < tensors.size(); ++i) {
    FOURBIT_CHECK(tensors[i].device == norm.device, "{}: tensors[{}] is on {} but norm is on {}",
                  op, i, device_name(tensors[i].device), device_name(norm.device));
    FOURBIT_CHECK(tensors[i].is_contiguous(), "{}: tensors[{}] must be contiguous, got {}", op, i,
                  tensors[i].describe());
  }
  if (norm.device == Device::kCpu) {
    check_dtype(op, "norm", norm, {DType::kF32, DType::kF64});
    double sum = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const TensorView& t = tensors[i];
      FOURBIT_CHECK(t.dtype == norm.dtype,
                    "{}: the CPU reference computes in one dtype: tensors[{}] is {} but norm is {}",
                    op, i, dtype_name(t.dtype), dtype_name(norm.dtype));
      for (int64_t j = 0; j < t.numel(); ++j) {
        const double x =
            t.dtype == DType::kF64 ? t.ptr<const double>()[j] : (double)t.ptr<const float>()[j];
        sum += x * x;
      }
    }
    if (norm.dtype == DType::kF64) {
      norm.ptr<double>()[0] = std::sqrt(sum);
    } else {
      norm.ptr<float>()[0] = (float)std::sqrt(sum);
    }
    return;
  }
#if defined(FOURBIT_WITH_CUDA)
  check_dtype(op, "norm", norm, {DType::kF32});
  for (size_t i = 0; i < tensors.size(); ++i) {
    FOURBIT_CHECK(tensors[i].dtype == DType::kF32 || tensors[i].dtype == DType::kBF16,
                  "{}: tensors[{}] must be f32 or bf16 on cuda, got {}", op, i,
                  tensors[i].describe());
  }
  const int64_t need = grad_norm_workspace_bytes(tensors);
  FOURBIT_CHECK(need == 0 || (present(workspace) && workspace.device == Device::kCuda &&
                              workspace.is_contiguous() && workspace.nbytes() >= need &&
                              detail::aligned16(workspace.data)),
                "{}: workspace must be a contiguous, 16-byte aligned CUDA tensor of at least {} "
                "bytes (grad_norm_workspace_bytes), got {}",
                op, need, present(workspace) ? workspace.describe() : "none");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  double* partials = static_cast<double*>(workspace.data);
  // Up to kSumsqBatch tensors a launch; each tensor's partials where its own launch put them
  // (a launch writes from partials + launch_first, its segments' first_block counted from there).
  kernels::SumsqBatch batch;
  int64_t first = 0, launch_first = 0;
  const auto flush = [&] {
    if (batch.count > 0) kernels::launch_sumsq_partials(batch, partials + launch_first, s);
    batch.count = 0;
    launch_first = first;
  };
  for (const TensorView& t : tensors) {
    const int64_t blocks = sumsq_blocks(t.numel());
    batch.seg[batch.count++] = {t.data, t.numel(), (int32_t)(first - launch_first), (int32_t)blocks,
                                t.dtype == DType::kBF16 ? kernels::FloatType::kBF16 : kernels::FloatType::kF32};
    first += blocks;
    if (batch.count == kernels::kSumsqBatch) flush();
  }
  flush();
  kernels::launch_norm_from_partials(partials, first, norm.ptr<float>(), s);
#else
  (void)workspace;
  (void)stream;
  detail::no_cuda_build(op);
#endif
}

float clip_grad_scale(float norm, float max_norm) {
  if (!(max_norm > 0)) return 1.0f;
  const float scale = (float)((double)max_norm / ((double)norm + 1e-6));
  if (std::isnan(scale)) return scale;  // a NaN norm must not turn into "no clipping"
  return scale < 1.0f ? scale : 1.0f;
}

}  // namespace fourbit::ops
