// Host side of RoPE: checks, dispatch, and the CPU reference (templated over f32/f64; the f32
// instantiation follows the FP32 recipe of rope.h, the f64 one computes everything in double).
#include "ops/rope.h"

#include "ops/arg_checks.h"

#include <cmath>
#include <type_traits>

#if defined(FOURBIT_WITH_CUDA)
#include "ops/rope_kernels.h"
#endif

namespace fourbit::ops {

namespace detail {
// theta^(-2i / D) in double: the one definition of the frequencies, used by the CPU reference and
// passed to the CUDA kernels as a table (so both sides start from the same bits).
double inv_freq_f64(float theta, int64_t i, int64_t D) {
  return std::pow((double)theta, -2.0 * (double)i / (double)D);
}
void inv_freq_table_f32(float theta, int64_t D, float* out) {
  for (int64_t i = 0; i < D / 2; ++i) out[i] = (float)inv_freq_f64(theta, i, D);
}
}  // namespace detail

namespace {

using detail::check_dtype;
using detail::present;

// Element (n, h, d) of a [N, heads, D] view with unit stride along D.
template <typename T>
T& at(const TensorView& t, int64_t n, int64_t h, int64_t d) {
  return t.ptr<T>()[n * t.strides[0] + h * t.strides[1] + d];
}

using detail::inv_freq_f64;

template <typename T>
void rotate_reference(const TensorView& out, const TensorView& in, const int32_t* positions,
                      float theta, bool inverse) {
  const int64_t N = in.shape[0], heads = in.shape[1], D = in.shape[2], half = D / 2;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < half; ++i) {
      const T inv_freq = (T)inv_freq_f64(theta, i, D);  // f32: rounded once, as on the GPU
      const T angle = (T)positions[n] * inv_freq;
      const T c = std::cos(angle);
      const T s = inverse ? -std::sin(angle) : std::sin(angle);
      for (int64_t h = 0; h < heads; ++h) {
        const T lo = at<T>(in, n, h, i), hi = at<T>(in, n, h, i + half);
        at<T>(out, n, h, i) = lo * c - hi * s;
        at<T>(out, n, h, i + half) = hi * c + lo * s;
      }
    }
}

// Checks one [N, heads, D] view (unit stride along D, non-negative outer strides).
void check_view(std::string_view op, std::string_view name, const TensorView& t, int64_t N,
                int64_t D) {
  FOURBIT_CHECK(t.shape.ndim == 3 && t.shape[0] == N && t.shape[2] == D,
                "{}: {} must be [N = {}, heads, D = {}], got {}", op, name, N, D, t.describe());
  FOURBIT_CHECK(
      t.strides[2] == 1 && t.strides[0] >= 0 && t.strides[1] >= 0,
      "{}: {} must have unit stride along D and non-negative outer strides, got strides {}", op,
      name, t.strides.str());
}

#if defined(FOURBIT_WITH_CUDA)
kernels::RopeTensor rope_tensor(const TensorView& t) {
  kernels::RopeTensor r;
  if (!present(t)) return r;
  r.data = t.data;
  r.stride_n = t.strides[0];
  r.stride_h = t.strides[1];
  r.heads = (int)t.shape[1];
  return r;
}
#endif

void run(std::string_view op, const TensorView& q_out, const TensorView& k_out, const TensorView& q,
         const TensorView& k, const TensorView& positions, float theta, bool inverse, bool inplace,
         void* stream, const RopeCacheAppend* append = nullptr) {
  const Device dev = detail::common_device(
      op, {{"q", &q}, {"k", &k}, {"q_out", &q_out}, {"k_out", &k_out}, {"positions", &positions}});
  FOURBIT_CHECK(q.shape.ndim == 3 && q.shape[2] >= 2 && q.shape[2] % 2 == 0,
                "{}: q must be [N, H, D] with D even (rotate-half pairs i and i + D/2), got {}", op,
                present(q) ? q.describe() : "none");
  const int64_t N = q.shape[0], D = q.shape[2];
  check_view(op, "q", q, N, D);
  check_view(op, inplace ? "q" : "q output", q_out, N, D);
  FOURBIT_CHECK(q_out.shape == q.shape, "{}: q output must have q's shape {}, got {}", op,
                q.shape.str(), q_out.shape.str());
  FOURBIT_CHECK(present(k) == present(k_out),
                "{}: k and its output must be given together (or both absent to rotate q alone)",
                op);
  if (present(k)) {
    check_view(op, "k", k, N, D);
    check_view(op, inplace ? "k" : "k output", k_out, N, D);
    FOURBIT_CHECK(k_out.shape == k.shape, "{}: k output must have k's shape {}, got {}", op,
                  k.shape.str(), k_out.shape.str());
  }
  if (!inplace) {
    bool distinct = detail::distinct(q_out, q);
    if (present(k)) {
      distinct = distinct && detail::distinct(q_out, k) && detail::distinct(k_out, q) &&
                 detail::distinct(k_out, k);
    }
    FOURBIT_CHECK(distinct, "{}: an output aliases an input; use the _inplace variant", op);
  }
  detail::check_shape(op, "positions", positions, {N});
  check_dtype(op, "positions", positions, {DType::kI32});
  FOURBIT_CHECK(std::isfinite(theta) && theta > 0, "{}: theta must be finite and > 0, got {}", op,
                theta);

  if (append != nullptr) {
    FOURBIT_CHECK(dev == Device::kCuda, "{}: the fused KV-cache append runs on CUDA; on the CPU rotate, then copy", op);
    FOURBIT_CHECK(present(k), "{}: the KV-cache append needs k", op);
    const int64_t Hkv = k.shape[1];
    check_view(op, "v", append->v, N, D);
    FOURBIT_CHECK(append->v.shape == k.shape && append->v.dtype == q.dtype,
                  "{}: v must match k's shape {} and q's dtype, got {}", op, k.shape.str(), append->v.describe());
    for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"k_cache", &append->k_cache},
                                  {"v_cache", &append->v_cache}}) {
      FOURBIT_CHECK(t->device == Device::kCuda && t->dtype == q.dtype && t->shape.ndim == 4 && t->shape[2] == Hkv &&
                        t->shape[3] == D && t->is_contiguous(),
                    "{}: {} must be a contiguous [B, t_max, {}, {}] {} tensor on cuda, got {}", op, name, Hkv, D,
                    dtype_name(q.dtype), t->describe());
    }
    FOURBIT_CHECK(append->v_cache.shape == append->k_cache.shape, "{}: v_cache {} and k_cache {} differ", op,
                  append->v_cache.shape.str(), append->k_cache.shape.str());
    FOURBIT_CHECK(append->rows_per_seq >= 1 && N % append->rows_per_seq == 0 &&
                      N / append->rows_per_seq <= append->k_cache.shape[0],
                  "{}: {} rows at {} per sequence do not fit the cache's {} sequences", op, N, append->rows_per_seq,
                  append->k_cache.shape[0]);
    FOURBIT_CHECK(append->write_pos.device == Device::kCuda && append->write_pos.dtype == DType::kI32 &&
                      append->write_pos.shape.ndim == 1 && append->write_pos.shape[0] == N &&
                      append->write_pos.is_contiguous(),
                  "{}: write_pos must be a contiguous i32 [{}] on cuda, got {}", op, N, append->write_pos.describe());
  }
  if (dev == Device::kCpu) {
    const DType dt = detail::cpu_float_dtype(
        op, {{"q", &q}, {"k", &k}, {"q output", &q_out}, {"k output", &k_out}});
    const int32_t* pos = positions.ptr<const int32_t>();
    auto rotate = [&](const TensorView& out, const TensorView& in) {
      if (dt == DType::kF64) {
        rotate_reference<double>(out, in, pos, theta, inverse);
      } else {
        rotate_reference<float>(out, in, pos, theta, inverse);
      }
    };
    rotate(q_out, q);
    if (present(k)) rotate(k_out, k);
    return;
  }
#if defined(FOURBIT_WITH_CUDA)
  check_dtype(op, "q", q, {DType::kBF16, DType::kF32});
  check_dtype(op, "q output", q_out, {q.dtype});
  if (present(k)) {
    check_dtype(op, "k", k, {q.dtype});
    check_dtype(op, "k output", k_out, {q.dtype});
  }
  FOURBIT_CHECK(D <= kernels::kRopeMaxHeadDim,
                "{}: head dim D = {} exceeds the CUDA kernel's limit of {}", op, D,
                kernels::kRopeMaxHeadDim);
  kernels::RopeArgs a{};
  a.q_out = rope_tensor(q_out);
  a.k_out = rope_tensor(k_out);
  a.q_in = rope_tensor(q);
  a.k_in = rope_tensor(k);
  a.positions = positions.ptr<const int32_t>();
  a.type = q.dtype == DType::kBF16 ? kernels::FloatType::kBF16 : kernels::FloatType::kF32;
  a.n_rows = N;
  a.head_dim = (int)D;
  detail::inv_freq_table_f32(theta, D, a.inv_freq);
  a.inverse = inverse;
  if (append != nullptr) {
    a.k_cache = append->k_cache.data;
    a.v_cache = append->v_cache.data;
    a.v_in = rope_tensor(append->v);
    a.write_pos = append->write_pos.ptr<const int32_t>();
    a.rows_per_seq = append->rows_per_seq;
    a.t_max = append->k_cache.shape[1];
  }
  kernels::launch_rope(a, static_cast<cudaStream_t>(stream));
#else
  (void)stream;
  detail::no_cuda_build(op);
#endif
}

}  // namespace

void rope_forward(const TensorView& q_rot, const TensorView& k_rot, const TensorView& q,
                  const TensorView& k, const TensorView& positions, float theta, void* stream) {
  run("rope_forward", q_rot, k_rot, q, k, positions, theta, false, false, stream);
}

void rope_forward_inplace(const TensorView& q, const TensorView& k, const TensorView& positions,
                          float theta, void* stream) {
  run("rope_forward_inplace", q, k, q, k, positions, theta, false, true, stream);
}

void rope_forward_inplace_append(const TensorView& q, const TensorView& k, const TensorView& positions,
                                 float theta, const RopeCacheAppend& append, void* stream) {
  run("rope_forward_inplace_append", q, k, q, k, positions, theta, false, true, stream, &append);
}

void rope_cos_sin_table(const TensorView& table, const TensorView& positions, float theta, int64_t head_dim,
                        void* stream) {
  const char* op = "rope_cos_sin_table";
  FOURBIT_CHECK(positions.device == Device::kCuda && positions.dtype == DType::kI32 && positions.shape.ndim == 1 &&
                    positions.is_contiguous(),
                "{}: positions must be a contiguous i32 [N] on cuda, got {}", op, positions.describe());
  const int64_t N = positions.shape[0];
  FOURBIT_CHECK(head_dim >= 2 && head_dim % 2 == 0, "{}: head dim D = {} must be even and positive", op, head_dim);
  FOURBIT_CHECK(table.device == Device::kCuda && table.dtype == DType::kF32 && table.shape.ndim == 3 &&
                    table.shape[0] == N && table.shape[1] == head_dim / 2 && table.shape[2] == 2 && table.is_contiguous(),
                "{}: table must be a contiguous f32 [{}, {}, 2] on cuda, got {}", op, N, head_dim / 2, table.describe());
#if defined(FOURBIT_WITH_CUDA)
  FOURBIT_CHECK(head_dim <= kernels::kRopeMaxHeadDim, "{}: head dim D = {} exceeds the CUDA kernel's limit of {}", op,
                head_dim, kernels::kRopeMaxHeadDim);
  kernels::RopeTableArgs a{};
  a.table = table.ptr<float>();
  a.positions = positions.ptr<const int32_t>();
  a.n_rows = N;
  a.head_dim = (int)head_dim;
  detail::inv_freq_table_f32(theta, head_dim, a.inv_freq);
  kernels::launch_rope_table(a, static_cast<cudaStream_t>(stream));
#else
  (void)theta;
  (void)stream;
  detail::no_cuda_build(op);
#endif
}

void rope_backward(const TensorView& dq, const TensorView& dk, const TensorView& dq_rot,
                   const TensorView& dk_rot, const TensorView& positions, float theta,
                   void* stream) {
  run("rope_backward", dq, dk, dq_rot, dk_rot, positions, theta, true, false, stream);
}

void rope_backward_inplace(const TensorView& dq_rot_to_dq, const TensorView& dk_rot_to_dk,
                           const TensorView& positions, float theta, void* stream) {
  run("rope_backward_inplace", dq_rot_to_dq, dk_rot_to_dk, dq_rot_to_dq, dk_rot_to_dk, positions,
      theta, true, true, stream);
}

}  // namespace fourbit::ops
