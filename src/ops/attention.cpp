// Host side of causal GQA attention (attention.h): argument checks, device dispatch and the naive
// CPU reference. The CUDA kernels are in attention_kernels.cu.
//
// The reference materializes, per (b, h), the T x T probability matrix and does every sum in
// float64 whatever the storage dtype (f32 or f64): it is the ground truth the kernels and the
// finite-difference tests are measured against, not a fast path.
#include "ops/attention.h"

#include "core/check.h"
#include "core/device.h"
#include "core/env.h"
#include "ops/arg_checks.h"
#include "ops/rope.h"

#if defined(FOURBIT_WITH_CUDA)
#include "ops/attention_kernels.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string_view>
#include <vector>

namespace fourbit::ops {
namespace {

// --- checks --------------------------------------------------------------------------------------

struct Dims {
  int64_t batch = 0, seq = 0, heads = 0, kv_heads = 0, head_dim = 0;
};

// A [B, T, heads, D] tensor: shape, dtype and "unit stride along D, non-negative outer strides".
void check_heads(std::string_view op, std::string_view name, const TensorView& x, int64_t B,
                 int64_t T, int64_t heads, int64_t D, DType dtype) {
  FOURBIT_CHECK(x.shape.ndim == 4 && x.shape[0] == B && x.shape[1] == T && x.shape[2] == heads &&
                    x.shape[3] == D,
                "{}: {} must be [B, T, heads, D] = ({}, {}, {}, {}), got {}", op, name, B, T,
                heads, D, x.describe());
  FOURBIT_CHECK(x.dtype == dtype, "{}: {} must be {} like q, got {}", op, name, dtype_name(dtype),
                x.describe());
  FOURBIT_CHECK(x.strides[3] == 1 || D == 1,
                "{}: {} must have unit stride along D (strides {}); make it contiguous", op, name,
                x.strides.str());
  FOURBIT_CHECK(x.strides[0] >= 0 && x.strides[1] >= 0 && x.strides[2] >= 0,
                "{}: {} has negative strides {}", op, name, x.strides.str());
  FOURBIT_CHECK(x.numel() == 0 || x.data != nullptr, "{}: {} has no data", op, name);
}

void check_lse(std::string_view op, const TensorView& lse, const Dims& d, DType dtype) {
  FOURBIT_CHECK(lse.shape.ndim == 3 && lse.shape[0] == d.batch && lse.shape[1] == d.heads &&
                    lse.shape[2] == d.seq,
                "{}: lse must be [B, H, T] = ({}, {}, {}), got {}", op, d.batch, d.heads, d.seq,
                lse.describe());
  FOURBIT_CHECK(lse.dtype == dtype, "{}: lse must be {}, got {}", op, dtype_name(dtype),
                lse.describe());
  FOURBIT_CHECK(lse.is_contiguous(), "{}: lse must be contiguous, got strides {}", op,
                lse.strides.str());
}

Dims qkv_dims(std::string_view op, const TensorView& q, const TensorView& k, const TensorView& v,
              const char* seq_name = "T") {
  FOURBIT_CHECK(q.shape.ndim == 4, "{}: q must be [B, {}, H, D], got {}", op, seq_name,
                q.describe());
  FOURBIT_CHECK(k.shape.ndim == 4, "{}: k must be 4-dimensional [B, T, Hkv, D], got {}", op,
                k.describe());
  Dims d{q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3]};
  FOURBIT_CHECK(d.head_dim > 0 && d.heads > 0 && d.kv_heads > 0,
                "{}: empty head dimension: q {}, k {}", op, q.describe(), k.describe());
  FOURBIT_CHECK(d.heads % d.kv_heads == 0,
                "{}: the query heads H = {} must be a multiple of the key/value heads Hkv = {} "
                "(grouped-query attention)",
                op, d.heads, d.kv_heads);
  FOURBIT_CHECK(q.dtype == DType::kF32 || q.dtype == DType::kF64 || q.dtype == DType::kBF16,
                "{}: q must be f32 or f64 (CPU) or bf16 (CUDA), got {}", op, q.describe());
  (void)v;
  return d;
}

float resolve_scale(std::string_view op, const AttentionOptions& o, int64_t head_dim) {
  const float scale = o.scale ? *o.scale : (float)(1.0 / std::sqrt((double)head_dim));
  FOURBIT_CHECK(std::isfinite(scale) && scale > 0.0f, "{}: scale must be finite and > 0, got {}",
                op, scale);
  return scale;
}

void check_cpu_dtype(std::string_view op, DType dt) {
  FOURBIT_CHECK(dt == DType::kF32 || dt == DType::kF64,
                "{}: the CPU reference takes f32 or f64 tensors, got {}; bf16 attention runs on "
                "CUDA",
                op, dtype_name(dt));
}

// AttentionOptions::rope_backward: positions i32 [B * T], contiguous, on the tensors' device; theta
// finite and > 0; D even.
void check_rope_backward(std::string_view op, const AttentionOptions::RopeBackward& r, const Dims& d,
                         Device dev) {
  const TensorView& pos = r.positions;
  FOURBIT_CHECK(pos.dtype == DType::kI32 && pos.shape.ndim == 1 && pos.shape[0] == d.batch * d.seq &&
                    pos.is_contiguous() && pos.device == dev && (pos.data != nullptr || d.batch * d.seq == 0),
                "{}: rope_backward.positions must be a contiguous i32 [B * T] = ({}) tensor on {}, got {}",
                op, d.batch * d.seq, device_name(dev), pos.describe());
  FOURBIT_CHECK(std::isfinite(r.theta) && r.theta > 0.0f,
                "{}: rope_backward.theta must be finite and > 0, got {}", op, r.theta);
  FOURBIT_CHECK(d.head_dim % 2 == 0, "{}: rope_backward needs an even head dim (pairs i, i + D/2), got D = {}",
                op, d.head_dim);
}

// Sequence b of a [B, T, heads, D] view as the [T, heads, D] view that the RoPE ops take.
TensorView sequence_view(const TensorView& x, int64_t b) {
  TensorView s = x;
  s.data = static_cast<char*>(x.data) + dtype_bytes(x.dtype, b * x.strides[0]);
  s.shape = Shape{x.shape[1], x.shape[2], x.shape[3]};
  s.strides = Shape{x.strides[1], x.strides[2], x.strides[3]};
  return s;
}

// --- CPU reference -------------------------------------------------------------------------------

// Element (b, t, h, d) of a [B, T, heads, D] view.
template <typename T>
struct Heads {
  T* p;
  int64_t sb, st, sh;
  Heads(const TensorView& x)
      : p(x.ptr<T>()), sb(x.strides[0]), st(x.strides[1]), sh(x.strides[2]) {}
  T* row(int64_t b, int64_t t, int64_t h) const { return p + b * sb + t * st + h * sh; }
};

template <typename T>
double dot(const T* a, const T* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += (double)a[i] * (double)b[i];
  return s;
}

template <typename T>
void forward_reference(const TensorView& qv, const TensorView& kv, const TensorView& vv,
                       const TensorView& outv, const TensorView& lsev, const Dims& d,
                       double scale) {
  const Heads<T> q(qv), k(kv), v(vv), out(outv);
  T* lse = lsev.ptr<T>();
  const int64_t Tn = d.seq, D = d.head_dim, group = d.heads / d.kv_heads;
  std::vector<double> p((size_t)(Tn * Tn));  // P[i, j], j <= i
  std::vector<double> acc((size_t)D);
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t h = 0; h < d.heads; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < Tn; ++i) {
        double mx = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          p[(size_t)(i * Tn + j)] = scale * dot(q.row(b, i, h), k.row(b, j, hk), D);
          mx = std::max(mx, p[(size_t)(i * Tn + j)]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(p[(size_t)(i * Tn + j)] - mx);
        const double l = mx + std::log(sum);
        lse[(b * d.heads + h) * Tn + i] = (T)l;
        for (int64_t j = 0; j <= i; ++j) p[(size_t)(i * Tn + j)] = std::exp(p[(size_t)(i * Tn + j)] - l);
      }
      for (int64_t i = 0; i < Tn; ++i) {
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = 0; j <= i; ++j) {
          const T* vr = v.row(b, j, hk);
          for (int64_t c = 0; c < D; ++c) acc[(size_t)c] += p[(size_t)(i * Tn + j)] * (double)vr[c];
        }
        T* o = out.row(b, i, h);
        for (int64_t c = 0; c < D; ++c) o[c] = (T)acc[(size_t)c];
      }
    }
}

template <typename T>
void backward_reference(const TensorView& doutv, const TensorView& qv, const TensorView& kv,
                        const TensorView& vv, const TensorView& outv, const TensorView& lsev,
                        const TensorView& dqv, const TensorView& dkv, const TensorView& dvv,
                        const Dims& d, double scale) {
  const Heads<T> dout(doutv), q(qv), k(kv), v(vv), out(outv), dq(dqv), dk(dkv), dv(dvv);
  const T* lse = lsev.ptr<T>();
  const int64_t Tn = d.seq, D = d.head_dim, group = d.heads / d.kv_heads;
  // dk and dv sum over the query heads of a group: accumulate in float64, store at the end.
  std::vector<double> dk_acc((size_t)(Tn * D)), dv_acc((size_t)(Tn * D)), dq_acc((size_t)D);
  std::vector<double> p((size_t)(Tn * Tn)), ds((size_t)(Tn * Tn));
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t hk = 0; hk < d.kv_heads; ++hk) {
      std::fill(dk_acc.begin(), dk_acc.end(), 0.0);
      std::fill(dv_acc.begin(), dv_acc.end(), 0.0);
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        for (int64_t i = 0; i < Tn; ++i) {
          const double l = (double)lse[(b * d.heads + h) * Tn + i];
          const double delta = dot(dout.row(b, i, h), out.row(b, i, h), D);
          for (int64_t j = 0; j <= i; ++j) {
            const double pij = std::exp(scale * dot(q.row(b, i, h), k.row(b, j, hk), D) - l);
            const double dp = dot(dout.row(b, i, h), v.row(b, j, hk), D);
            p[(size_t)(i * Tn + j)] = pij;
            ds[(size_t)(i * Tn + j)] = pij * (dp - delta);
          }
        }
        for (int64_t i = 0; i < Tn; ++i) {
          std::fill(dq_acc.begin(), dq_acc.end(), 0.0);
          const T* qi = q.row(b, i, h);
          const T* gi = dout.row(b, i, h);
          for (int64_t j = 0; j <= i; ++j) {
            const double pij = p[(size_t)(i * Tn + j)], dsij = ds[(size_t)(i * Tn + j)];
            const T* kj = k.row(b, j, hk);
            for (int64_t c = 0; c < D; ++c) {
              dq_acc[(size_t)c] += dsij * (double)kj[c];
              dk_acc[(size_t)(j * D + c)] += dsij * (double)qi[c];
              dv_acc[(size_t)(j * D + c)] += pij * (double)gi[c];
            }
          }
          T* o = dq.row(b, i, h);
          for (int64_t c = 0; c < D; ++c) o[c] = (T)(scale * dq_acc[(size_t)c]);
        }
      }
      for (int64_t j = 0; j < Tn; ++j) {
        T* ok = dk.row(b, j, hk);
        T* ov = dv.row(b, j, hk);
        for (int64_t c = 0; c < D; ++c) {
          ok[c] = (T)(scale * dk_acc[(size_t)(j * D + c)]);
          ov[c] = (T)dv_acc[(size_t)(j * D + c)];
        }
      }
    }
}

template <typename T>
void decode_reference(const TensorView& qv, const TensorView& kcv, const TensorView& vcv,
                      const int32_t* lengths, const TensorView& outv, const Dims& d,
                      double scale) {
  const Heads<T> q(qv), kc(kcv), vc(vcv), out(outv);
  const int64_t Tq = d.seq, D = d.head_dim, group = d.heads / d.kv_heads;
  std::vector<double> s, acc((size_t)D);
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t t = 0; t < Tq; ++t)
      for (int64_t h = 0; h < d.heads; ++h) {
        const int64_t hk = h / group;
        const int64_t pos = lengths[b] - Tq + t;
        std::fill(acc.begin(), acc.end(), 0.0);
        if (pos >= 0) {
          s.assign((size_t)(pos + 1), 0.0);
          double mx = -INFINITY;
          for (int64_t j = 0; j <= pos; ++j) {
            s[(size_t)j] = scale * dot(q.row(b, t, h), kc.row(b, j, hk), D);
            mx = std::max(mx, s[(size_t)j]);
          }
          double sum = 0;
          for (int64_t j = 0; j <= pos; ++j) sum += std::exp(s[(size_t)j] - mx);
          for (int64_t j = 0; j <= pos; ++j) {
            const double pj = std::exp(s[(size_t)j] - mx) / sum;
            const T* vr = vc.row(b, j, hk);
            for (int64_t c = 0; c < D; ++c) acc[(size_t)c] += pj * (double)vr[c];
          }
        }
        T* o = out.row(b, t, h);
        for (int64_t c = 0; c < D; ++c) o[c] = (T)acc[(size_t)c];
      }
}

// --- CUDA ----------------------------------------------------------------------------------------

#if defined(FOURBIT_WITH_CUDA)
kernels::HeadStrides head_strides(const TensorView& x) {
  return {x.strides[0], x.strides[1], x.strides[2]};
}
const uint16_t* bf16_in(const TensorView& x) { return static_cast<const uint16_t*>(x.data); }
uint16_t* bf16_out(const TensorView& x) { return static_cast<uint16_t*>(x.data); }
#endif

// What the CUDA kernels need beyond the common checks: bf16, a supported D and 16-byte rows.
void check_cuda_heads(std::string_view op,
                      std::initializer_list<std::pair<std::string_view, const TensorView*>> ts,
                      const Dims& d) {
  const int64_t head_dim = d.head_dim;
  FOURBIT_CHECK(d.batch <= 65535 && d.heads <= 65535 && d.seq <= (int64_t)1 << 30,
                "{}: the CUDA kernels take B <= 65535, H <= 65535 and T <= 2^30 (grid limits), got "
                "B = {}, H = {}, T = {}",
                op, d.batch, d.heads, d.seq);
#if defined(FOURBIT_WITH_CUDA)
  FOURBIT_CHECK(kernels::attention_head_dim_supported((int)head_dim),
                "{}: the CUDA kernels support head dims D = 64 and 128, got D = {}; use one of "
                "those (or the CPU reference)",
                op, head_dim);
#else
  (void)head_dim;
#endif
  for (const auto& [name, t] : ts) {
    FOURBIT_CHECK(t->dtype == DType::kBF16, "{}: on CUDA {} must be bf16, got {}", op, name,
                  t->describe());
    const bool aligned = reinterpret_cast<uintptr_t>(t->data) % 16 == 0 && t->strides[0] % 8 == 0 &&
                         t->strides[1] % 8 == 0 && t->strides[2] % 8 == 0;
    FOURBIT_CHECK(aligned,
                  "{}: on CUDA every D-row of {} must start on a 16-byte boundary (16-byte aligned "
                  "data, strides multiples of 8 elements); got strides {}",
                  op, name, t->strides.str());
  }
}

// FOURBIT_ATTENTION_WIDE (AttentionTiles): "0", "1" or a comma list out of forward, dkdv, dq;
// unset leaves AttentionOptions::tiles in charge. Read once per process; an unknown word is an
// error that names the variable.
[[maybe_unused]] const std::optional<AttentionTiles>& tiles_forced() {
  static const std::optional<AttentionTiles> forced = []() -> std::optional<AttentionTiles> {
    const char* v = std::getenv("FOURBIT_ATTENTION_WIDE");
    if (v == nullptr) return std::nullopt;
    const std::string_view s(v);
    if (s == "0") return AttentionTiles{false, false, false};
    if (s == "1") return AttentionTiles{true, true, true};
    AttentionTiles t{false, false, false};
    size_t begin = 0;
    while (begin <= s.size()) {
      const size_t end = std::min(s.find(',', begin), s.size());
      const std::string_view word = s.substr(begin, end - begin);
      if (word == "forward") t.wide_forward = true;
      else if (word == "dkdv") t.wide_dkdv = true;
      else if (word == "dq") t.wide_dq = true;
      else
        FOURBIT_CHECK(false,
                      "FOURBIT_ATTENTION_WIDE='{}': expected 0, 1 or a comma list out of forward, "
                      "dkdv, dq (the kernels that take 32 rows a warp)",
                      s);
      begin = end + 1;
    }
    return t;
  }();
  return forced;
}

[[maybe_unused]] AttentionTiles resolve_tiles(const AttentionOptions& options) {
  return tiles_forced().value_or(options.tiles);
}

// An option, or the environment switch that overrides it (env_switch: 0/1, -1 unset).
bool overridden(bool option, int forced) { return forced == -1 ? option : forced == 1; }

// AttentionOptions::wgmma_forward / wgmma_backward (`wanted`), or the switch `variable` (0/1)
// when set; true only where the kernels can run (an explicit 1 where they cannot is an error).
[[maybe_unused]] bool resolve_wgmma(bool wanted, const char* variable, int forced) {
#if defined(FOURBIT_WITH_CUDA)
  if (!overridden(wanted, forced)) return false;
  const bool available = kernels::attention_wgmma_available();
  FOURBIT_CHECK(available || forced != 1,
                "{}=1: the warpgroup-MMA attention kernels need a build with sm_90a code "
                "(FOURBIT_CUDA_GENCODE) and a compute capability 9.0 GPU; unset it or set 0 to use "
                "the mma.sync kernels",
                variable);
  return available;
#else
  (void)wanted, (void)variable, (void)forced;
  return false;
#endif
}
[[maybe_unused]] bool resolve_wgmma_backward(const AttentionOptions& options) {
  static const int forced = env_switch("FOURBIT_ATTENTION_WGMMA");
  return resolve_wgmma(options.wgmma_backward, "FOURBIT_ATTENTION_WGMMA", forced);
}
[[maybe_unused]] bool resolve_wgmma_overlap(const AttentionOptions& options) {
  static const int forced = env_switch("FOURBIT_ATTENTION_WGMMA_OVERLAP");
  return overridden(options.wgmma_overlap, forced);
}
[[maybe_unused]] bool resolve_wgmma_fast_exp(const AttentionOptions& options) {
  static const int forced = env_switch("FOURBIT_ATTENTION_WGMMA_FAST_EXP");
  return overridden(options.wgmma_fast_exp, forced);
}
[[maybe_unused]] bool resolve_wgmma_forward(const AttentionOptions& options) {
  static const int forced = env_switch("FOURBIT_ATTENTION_WGMMA_FORWARD");
  return resolve_wgmma(options.wgmma_forward, "FOURBIT_ATTENTION_WGMMA_FORWARD", forced);
}

}  // namespace

bool attention_wgmma_available() {
#if defined(FOURBIT_WITH_CUDA)
  return cuda_device_count() > 0 && kernels::attention_wgmma_available();
#else
  return false;
#endif
}

void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                       const TensorView& out, const TensorView& lse,
                       const AttentionOptions& options, void* stream) {
  constexpr std::string_view op = "attention_forward";
  const Dims d = qkv_dims(op, q, k, v);
  const DType dt = q.dtype;
  check_heads(op, "q", q, d.batch, d.seq, d.heads, d.head_dim, dt);
  check_heads(op, "k", k, d.batch, d.seq, d.kv_heads, d.head_dim, dt);
  check_heads(op, "v", v, d.batch, d.seq, d.kv_heads, d.head_dim, dt);
  check_heads(op, "out", out, d.batch, d.seq, d.heads, d.head_dim, dt);
  const Device dev = detail::common_device(op, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", &lse}});
  const float scale = resolve_scale(op, options, d.head_dim);
  if (dev == Device::kCpu) {
    check_cpu_dtype(op, dt);
    check_lse(op, lse, d, dt);
    if (d.batch * d.seq == 0) return;
    if (dt == DType::kF32) forward_reference<float>(q, k, v, out, lse, d, scale);
    else forward_reference<double>(q, k, v, out, lse, d, scale);
    return;
  }
  check_lse(op, lse, d, DType::kF32);
  check_cuda_heads(op, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}}, d);
  if (d.batch * d.seq == 0) return;
#if defined(FOURBIT_WITH_CUDA)
  kernels::AttentionForwardArgs a{};
  a.dims = {(int)d.batch, (int)d.seq, (int)d.heads, (int)d.kv_heads, (int)d.head_dim, scale};
  a.q = bf16_in(q);
  a.q_stride = head_strides(q);
  a.k = bf16_in(k);
  a.k_stride = head_strides(k);
  a.v = bf16_in(v);
  a.v_stride = head_strides(v);
  a.out = bf16_out(out);
  a.out_stride = head_strides(out);
  a.lse = lse.ptr<float>();
  a.wide = resolve_tiles(options).wide_forward;
  a.wgmma = resolve_wgmma_forward(options);
  a.wgmma_fast_exp = a.wgmma && resolve_wgmma_fast_exp(options);
  kernels::launch_attention_forward(a, static_cast<cudaStream_t>(stream));
#else
  (void)stream;
  detail::no_cuda_build(op);
#endif
}

void attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& out, const TensorView& lse,
                        const TensorView& dq, const TensorView& dk, const TensorView& dv,
                        const AttentionOptions& options, void* stream) {
  constexpr std::string_view op = "attention_backward";
  const Dims d = qkv_dims(op, q, k, v);
  const DType dt = q.dtype;
  check_heads(op, "q", q, d.batch, d.seq, d.heads, d.head_dim, dt);
  check_heads(op, "k", k, d.batch, d.seq, d.kv_heads, d.head_dim, dt);
  check_heads(op, "v", v, d.batch, d.seq, d.kv_heads, d.head_dim, dt);
  check_heads(op, "out", out, d.batch, d.seq, d.heads, d.head_dim, dt);
  check_heads(op, "dout", dout, d.batch, d.seq, d.heads, d.head_dim, dt);
  check_heads(op, "dq", dq, d.batch, d.seq, d.heads, d.head_dim, dt);
  check_heads(op, "dk", dk, d.batch, d.seq, d.kv_heads, d.head_dim, dt);
  check_heads(op, "dv", dv, d.batch, d.seq, d.kv_heads, d.head_dim, dt);
  const Device dev = detail::common_device(op, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out},
                                        {"lse", &lse}, {"dout", &dout}, {"dq", &dq}, {"dk", &dk},
                                        {"dv", &dv}});
  const float scale = resolve_scale(op, options, d.head_dim);
  if (options.rope_backward) check_rope_backward(op, *options.rope_backward, d, dev);
  if (dev == Device::kCpu) {
    check_cpu_dtype(op, dt);
    check_lse(op, lse, d, dt);
    if (d.batch * d.seq == 0) return;
    if (dt == DType::kF32) backward_reference<float>(dout, q, k, v, out, lse, dq, dk, dv, d, scale);
    else backward_reference<double>(dout, q, k, v, out, lse, dq, dk, dv, d, scale);
    if (const auto& r = options.rope_backward) {  // the separate pass, per sequence
      for (int64_t b = 0; b < d.batch; ++b) {
        TensorView pos = r->positions;
        pos.data = r->positions.ptr<int32_t>() + b * d.seq;
        pos.shape = Shape{d.seq};
        pos.strides = Shape{1};
        rope_backward_inplace(sequence_view(dq, b), sequence_view(dk, b), pos, r->theta);
      }
    }
    return;
  }
  check_lse(op, lse, d, DType::kF32);
  check_cuda_heads(op, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"dout", &dout},
                        {"dq", &dq}, {"dk", &dk}, {"dv", &dv}},
                   d);
  if (d.batch * d.seq == 0) return;
#if defined(FOURBIT_WITH_CUDA)
  kernels::AttentionBackwardArgs a{};
  a.dims = {(int)d.batch, (int)d.seq, (int)d.heads, (int)d.kv_heads, (int)d.head_dim, scale};
  a.dout = bf16_in(dout);
  a.dout_stride = head_strides(dout);
  a.q = bf16_in(q);
  a.q_stride = head_strides(q);
  a.k = bf16_in(k);
  a.k_stride = head_strides(k);
  a.v = bf16_in(v);
  a.v_stride = head_strides(v);
  a.out = bf16_in(out);
  a.out_stride = head_strides(out);
  a.lse = lse.ptr<float>();
  a.dq = bf16_out(dq);
  a.dq_stride = head_strides(dq);
  a.dk = bf16_out(dk);
  a.dk_stride = head_strides(dk);
  a.dv = bf16_out(dv);
  a.dv_stride = head_strides(dv);
  const AttentionTiles tiles = resolve_tiles(options);
  a.wide_dkdv = tiles.wide_dkdv;
  a.wide_dq = tiles.wide_dq;
  a.wgmma = resolve_wgmma_backward(options);
  a.wgmma_overlap = a.wgmma && resolve_wgmma_overlap(options);
  a.wgmma_fast_exp = a.wgmma && resolve_wgmma_fast_exp(options);
  if (const auto& r = options.rope_backward) {
    static_assert(kernels::kAttentionRopeMaxPairs * 2 >= 128, "D <= 128 on CUDA");
    a.rope.positions = r->positions.ptr<const int32_t>();
    detail::inv_freq_table_f32(r->theta, d.head_dim, a.rope.inv_freq);
  }
  kernels::launch_attention_backward(a, static_cast<cudaStream_t>(stream));
#else
  (void)stream;
  detail::no_cuda_build(op);
#endif
}

AttentionDecodeWorkspace::AttentionDecodeWorkspace(Device device) {
  // The CPU reference never splits: a CPU workspace holds nothing.
  const int64_t partials = device == Device::kCuda ? (int64_t)kDecodeSplitCtas * 16 * (128 + 2) : 0;
  const int64_t counters = device == Device::kCuda ? kDecodeSplitCtas : 0;
  partials_ = Tensor::empty({partials}, DType::kF32, device);
  counters_ = Tensor::zeros({counters}, DType::kI32, device);
}

void attention_decode(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                      const TensorView& cache_lengths, const TensorView& out,
                      const AttentionOptions& options, void* stream) {
  constexpr std::string_view op = "attention_decode";
  const Dims d = qkv_dims(op, q, k_cache, v_cache, "Tq");
  const DType dt = q.dtype;
  const int64_t t_max = k_cache.shape[1];
  check_heads(op, "q", q, d.batch, d.seq, d.heads, d.head_dim, dt);
  check_heads(op, "k_cache", k_cache, d.batch, t_max, d.kv_heads, d.head_dim, dt);
  check_heads(op, "v_cache", v_cache, d.batch, t_max, d.kv_heads, d.head_dim, dt);
  check_heads(op, "out", out, d.batch, d.seq, d.heads, d.head_dim, dt);
  FOURBIT_CHECK(cache_lengths.shape.ndim == 1 && cache_lengths.shape[0] == d.batch &&
                    cache_lengths.dtype == DType::kI32 && cache_lengths.is_contiguous(),
                "{}: cache_lengths must be a contiguous i32 [B] = ({}), got {}", op, d.batch,
                cache_lengths.describe());
  const Device dev = detail::common_device(op, {{"q", &q}, {"k_cache", &k_cache}, {"v_cache", &v_cache},
                                        {"cache_lengths", &cache_lengths}, {"out", &out}});
  const float scale = resolve_scale(op, options, d.head_dim);
  if (dev == Device::kCpu) {
    check_cpu_dtype(op, dt);
    const int32_t* lengths = cache_lengths.ptr<int32_t>();
    for (int64_t b = 0; b < d.batch; ++b) {
      FOURBIT_CHECK(lengths[b] >= 0 && lengths[b] <= t_max,
                    "{}: cache_lengths[{}] = {} lies outside [0, T_max = {}]", op, b, lengths[b],
                    t_max);
    }
    if (d.batch * d.seq == 0) return;
    if (dt == DType::kF32) decode_reference<float>(q, k_cache, v_cache, lengths, out, d, scale);
    else decode_reference<double>(q, k_cache, v_cache, lengths, out, d, scale);
    return;
  }
  FOURBIT_CHECK(t_max <= (int64_t)1 << 30, "{}: the CUDA kernel takes T_max <= 2^30, got {}", op,
                t_max);
  check_cuda_heads(op, {{"q", &q}, {"k_cache", &k_cache}, {"v_cache", &v_cache}, {"out", &out}}, d);
  if (d.batch * d.seq == 0) return;
#if defined(FOURBIT_WITH_CUDA)
  kernels::AttentionDecodeArgs a{};
  a.dims = {(int)d.batch, (int)d.seq, (int)d.heads, (int)d.kv_heads, (int)d.head_dim, scale};
  a.cache_capacity = (int)t_max;
  a.q = bf16_in(q);
  a.q_stride = head_strides(q);
  a.k_cache = bf16_in(k_cache);
  a.k_stride = head_strides(k_cache);
  a.v_cache = bf16_in(v_cache);
  a.v_stride = head_strides(v_cache);
  a.cache_lengths = cache_lengths.ptr<int32_t>();
  a.out = bf16_out(out);
  a.out_stride = head_strides(out);
  if (AttentionDecodeWorkspace* ws = options.decode_workspace; ws != nullptr) {
    FOURBIT_CHECK(ws->device() == Device::kCuda,
                  "{}: the decode workspace was made for the CPU; make it with Device::kCuda", op);
    a.partials = ws->partials();
    a.counters = ws->counters();
    // Split while the launch has fewer than 6 CTAs per SM: a CTA is 4 warps that mostly wait on
    // shared memory and the cache, so an SM wants several. The workspace caps it.
    a.max_ctas = (int)std::min<int64_t>(AttentionDecodeWorkspace::kDecodeSplitCtas,
                                        6 * (int64_t)current_device_sm_count());
  }
  kernels::launch_attention_decode(a, static_cast<cudaStream_t>(stream));
#else
  (void)stream;
  detail::no_cuda_build(op);
#endif
}

}  // namespace fourbit::ops
