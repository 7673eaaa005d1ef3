// Host side of MoE routing and token permutation (moe.h): argument checks, device dispatch and the
// naive CPU reference (float64 sums whatever the storage dtype). Kernels: moe_kernels.cu.
#include "ops/moe.h"

#include "core/check.h"
#include "ops/arg_checks.h"
#include "ops/error_flags.h"

#if defined(FOURBIT_WITH_CUDA)
#include "ops/moe_kernels.h"
#endif

#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>
#include <string_view>
#include <vector>

namespace fourbit::ops {
namespace {

using detail::Named;
using detail::present;

constexpr int kMaxTopK = 32;               // one slot per lane in the CUDA router
constexpr int kCudaRouterMaxExperts = 1024;
constexpr int kCudaPlanMaxExperts = 4096;  // the rank kernel's shared memory: 36 bytes per expert

void check_i32(std::string_view op, std::string_view name, const TensorView& t, const Shape& want) {
  FOURBIT_CHECK(t.dtype == DType::kI32, "{}: {} must be i32, got {}", op, name, t.describe());
  detail::check_shape(op, name, t, want);
}

// The floating dtype of a call: f32 or f64 on the CPU (one for all), `cuda` on CUDA.
void check_float(std::string_view op, std::string_view name, const TensorView& t, Device dev,
                 std::initializer_list<DType> cuda, const Shape& want) {
  if (dev == Device::kCuda) detail::check_dtype(op, name, t, cuda);
  detail::check_shape(op, name, t, want);
}

#if defined(FOURBIT_WITH_CUDA)
kernels::FloatType float_type(const TensorView& t) {
  return t.dtype == DType::kF32 ? kernels::FloatType::kF32 : kernels::FloatType::kBF16;
}
#endif

// --- CPU reference: router -----------------------------------------------------------------------

template <typename T>
void router_forward_reference(const TensorView& logits, const RouterOptions& o,
                              const RouterOutputs& out) {
  const int64_t N = logits.shape[0], E = logits.shape[1], k = o.top_k;
  const T* lg = logits.ptr<T>();
  const T* bias = present(o.selection_bias) ? o.selection_bias.ptr<T>() : nullptr;
  const int32_t* forced = present(o.forced_ids) ? o.forced_ids.ptr<int32_t>() : nullptr;
  T* probs = out.probs.ptr<T>();
  int32_t* ids = out.expert_ids.ptr<int32_t>();
  T* gates = out.gates.ptr<T>();
  int32_t* counts = out.expert_counts.ptr<int32_t>();
  std::fill(counts, counts + E, 0);
  std::vector<double> p((size_t)E), col((size_t)E, 0.0);
  std::vector<T> sel((size_t)E);
  std::vector<char> taken((size_t)E);
  double z_sum = 0;
  for (int64_t n = 0; n < N; ++n) {
    const T* l = lg + n * E;
    double mx = -INFINITY;
    for (int64_t e = 0; e < E; ++e) mx = std::max(mx, (double)l[e]);
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += std::exp((double)l[e] - mx);
    for (int64_t e = 0; e < E; ++e) {
      p[(size_t)e] = std::exp((double)l[e] - mx) / sum;
      probs[n * E + e] = (T)p[(size_t)e];
      col[(size_t)e] += p[(size_t)e];
    }
    const double lse = mx + std::log(sum);
    z_sum += lse * lse;

    // Selection values in the storage precision (the same additions as the CUDA kernel, so ties
    // resolve identically); NaN ranks last.
    for (int64_t e = 0; e < E; ++e) {
      const T s = bias ? (T)(l[e] + bias[e]) : l[e];
      sel[(size_t)e] = std::isnan(s) ? -std::numeric_limits<T>::infinity() : s;
    }
    std::fill(taken.begin(), taken.end(), 0);
    double total = 0;
    for (int64_t j = 0; j < k; ++j) {
      int64_t id = -1;
      if (forced) {
        id = forced[n * k + j];
        FOURBIT_CHECK(id >= 0 && id < E && !taken[(size_t)id],
                      "router_forward: forced_ids[{}, {}] = {} is {}; routing replay needs k "
                      "distinct expert ids in [0, {}) per token",
                      n, j, id, id >= 0 && id < E ? "repeated" : "out of range", E);
      } else {
        for (int64_t e = 0; e < E; ++e)
          if (!taken[(size_t)e] && (id < 0 || sel[(size_t)e] > sel[(size_t)id])) id = e;
      }
      taken[(size_t)id] = 1;
      ids[n * k + j] = (int32_t)id;
      counts[id] += 1;
      total += p[(size_t)id];
    }
    for (int64_t j = 0; j < k; ++j) gates[n * k + j] = (T)(p[(size_t)ids[n * k + j]] / total);
  }
  if (present(out.losses)) {
    T* losses = out.losses.ptr<T>();
    double t = 0;
    for (int64_t e = 0; e < E; ++e) t += (double)counts[e] * col[(size_t)e];
    losses[0] = N > 0 ? (T)(t * (double)E / ((double)N * (double)N)) : T(0);
    losses[1] = N > 0 ? (T)(z_sum / (double)N) : T(0);
  }
}

template <typename T>
void router_backward_reference(const RouterSaved& s, const TensorView& d_gates,
                               const RouterLossGrads& g, const TensorView& d_logits) {
  const int64_t N = s.probs.shape[0], E = s.probs.shape[1], k = s.expert_ids.shape[1];
  const T* probs = s.probs.ptr<T>();
  const int32_t* ids = s.expert_ids.ptr<int32_t>();
  const T* dg = d_gates.ptr<T>();
  T* out = d_logits.ptr<T>();
  std::vector<double> dp((size_t)E);
  for (int64_t n = 0; n < N; ++n) {
    const T* p = probs + n * E;
    double total = 0, c = 0;
    for (int64_t j = 0; j < k; ++j) total += (double)p[ids[n * k + j]];
    for (int64_t j = 0; j < k; ++j) c += (double)dg[n * k + j] * ((double)p[ids[n * k + j]] / total);
    for (int64_t e = 0; e < E; ++e) {
      dp[(size_t)e] = g.aux != 0.0f ? (double)g.aux * (double)E *
                                          (double)s.expert_counts.ptr<int32_t>()[e] /
                                          ((double)N * (double)N)
                                    : 0.0;
    }
    for (int64_t j = 0; j < k; ++j) dp[(size_t)ids[n * k + j]] += ((double)dg[n * k + j] - c) / total;
    double pdp = 0;
    for (int64_t e = 0; e < E; ++e) pdp += (double)p[e] * dp[(size_t)e];
    double zc = 0;
    if (g.z != 0.0f) {
      const T* l = s.logits.ptr<T>() + n * E;
      double mx = -INFINITY, sum = 0;
      for (int64_t e = 0; e < E; ++e) mx = std::max(mx, (double)l[e]);
      for (int64_t e = 0; e < E; ++e) sum += std::exp((double)l[e] - mx);
      zc = (double)g.z * 2.0 * (mx + std::log(sum)) / (double)N;
    }
    for (int64_t e = 0; e < E; ++e)
      out[n * E + e] = (T)((double)p[e] * (dp[(size_t)e] - pdp) + zc * (double)p[e]);
  }
}

// --- CPU reference: permutation ------------------------------------------------------------------

void plan_reference(const TensorView& expert_ids, int row_align, const MoePlan& plan) {
  const int64_t NK = expert_ids.numel(), E = plan.offsets.shape[0] - 1, R = plan.row_slots.shape[0];
  const int32_t* ids = expert_ids.ptr<int32_t>();
  int32_t* offsets = plan.offsets.ptr<int32_t>();
  int32_t* slot_rows = plan.slot_rows.ptr<int32_t>();
  int32_t* row_slots = plan.row_slots.ptr<int32_t>();
  std::vector<int64_t> counts((size_t)E, 0), next((size_t)E);
  for (int64_t s = 0; s < NK; ++s) {
    FOURBIT_CHECK(ids[s] >= 0 && ids[s] < E,
                  "moe_plan: expert_ids[{}, {}] = {} lies outside [0, E = {})", s / expert_ids.shape[1],
                  s % expert_ids.shape[1], ids[s], E);
    counts[(size_t)ids[s]] += 1;
  }
  int64_t run = 0;
  for (int64_t e = 0; e < E; ++e) {
    offsets[e] = (int32_t)run;
    next[(size_t)e] = run;
    run += (counts[(size_t)e] + row_align - 1) / row_align * row_align;
  }
  offsets[E] = (int32_t)run;
  std::fill(row_slots, row_slots + R, -1);
  for (int64_t s = 0; s < NK; ++s) {  // slots in token order, then slot order: a stable sort
    const int64_t row = next[(size_t)ids[s]]++;
    slot_rows[s] = (int32_t)row;
    row_slots[row] = (int32_t)s;
  }
}

// The plan's indices are in range (the CPU reference reads them without further checks).
void check_plan_values(std::string_view op, const MoePlan& plan) {
  const int64_t NK = plan.slot_rows.numel(), R = plan.row_slots.numel();
  const int32_t* slot_rows = plan.slot_rows.ptr<int32_t>();
  const int32_t* row_slots = plan.row_slots.ptr<int32_t>();
  for (int64_t s = 0; s < NK; ++s)
    FOURBIT_CHECK(slot_rows[s] >= -1 && slot_rows[s] < R,
                  "{}: plan.slot_rows[{}] = {} lies outside [-1, R = {}); pass the plan moe_plan "
                  "wrote",
                  op, s, slot_rows[s], R);
  for (int64_t r = 0; r < R; ++r)
    FOURBIT_CHECK(row_slots[r] >= -1 && row_slots[r] < NK,
                  "{}: plan.row_slots[{}] = {} lies outside [-1, N k = {}); pass the plan moe_plan "
                  "wrote",
                  op, r, row_slots[r], NK);
}

template <typename T>
void permute_reference(const TensorView& x, const MoePlan& plan, const TensorView& x_perm) {
  const int64_t C = x.shape[1], k = plan.slot_rows.shape[1], R = plan.row_slots.shape[0];
  const int32_t* row_slots = plan.row_slots.ptr<int32_t>();
  for (int64_t r = 0; r < R; ++r) {
    T* dst = x_perm.ptr<T>() + r * C;
    const int32_t s = row_slots[r];
    for (int64_t c = 0; c < C; ++c) dst[c] = s < 0 ? T(0) : x.ptr<T>()[(s / k) * C + c];
  }
}

// dst[n] = sum_j w_j src[slot_rows[n, j]] with w = gates or 1.
template <typename T>
void gather_sum_reference(const TensorView& src, const T* gates, const MoePlan& plan,
                          const TensorView& dst) {
  const int64_t N = plan.slot_rows.shape[0], k = plan.slot_rows.shape[1], C = dst.shape[1];
  const int32_t* slot_rows = plan.slot_rows.ptr<int32_t>();
  std::vector<double> acc((size_t)C);
  for (int64_t n = 0; n < N; ++n) {
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t j = 0; j < k; ++j) {
      const int32_t row = slot_rows[n * k + j];
      if (row < 0) continue;
      const double w = gates ? (double)gates[n * k + j] : 1.0;
      const T* s = src.ptr<T>() + row * C;
      for (int64_t c = 0; c < C; ++c) acc[(size_t)c] += w * (double)s[c];
    }
    for (int64_t c = 0; c < C; ++c) dst.ptr<T>()[n * C + c] = (T)acc[(size_t)c];
  }
}

template <typename T>
void unpermute_backward_reference(const TensorView& dy, const TensorView& y_perm,
                                  const TensorView& gates, const MoePlan& plan,
                                  const TensorView& d_y_perm, const TensorView& d_gates) {
  const int64_t N = plan.slot_rows.shape[0], k = plan.slot_rows.shape[1], C = dy.shape[1];
  const int64_t R = plan.row_slots.shape[0];
  const int32_t* slot_rows = plan.slot_rows.ptr<int32_t>();
  const int32_t* row_slots = plan.row_slots.ptr<int32_t>();
  for (int64_t r = 0; r < R; ++r) {
    const int32_t s = row_slots[r];
    T* dst = d_y_perm.ptr<T>() + r * C;
    for (int64_t c = 0; c < C; ++c)
      dst[c] = s < 0 ? T(0) : (T)((double)gates.ptr<T>()[s] * (double)dy.ptr<T>()[(s / k) * C + c]);
  }
  for (int64_t s = 0; s < N * k; ++s) {
    const int32_t row = slot_rows[s];
    double acc = 0;
    if (row >= 0)
      for (int64_t c = 0; c < C; ++c)
        acc += (double)dy.ptr<T>()[(s / k) * C + c] * (double)y_perm.ptr<T>()[row * C + c];
    d_gates.ptr<T>()[s] = (T)acc;
  }
}

// --- shared checks of the permutation ops --------------------------------------------------------

struct PlanDims {
  int64_t n_tokens, top_k, n_experts, rows;
};

PlanDims check_plan(std::string_view op, const MoePlan& plan) {
  FOURBIT_CHECK(plan.slot_rows.shape.ndim == 2,
                "{}: plan.slot_rows must be i32 [N, k], got {}", op, plan.slot_rows.describe());
  FOURBIT_CHECK(plan.offsets.shape.ndim == 1 && plan.offsets.shape[0] >= 2,
                "{}: plan.offsets must be i32 [E + 1] with E >= 1, got {}", op,
                plan.offsets.describe());
  FOURBIT_CHECK(plan.row_slots.shape.ndim == 1, "{}: plan.row_slots must be i32 [R], got {}", op,
                plan.row_slots.describe());
  const PlanDims d{plan.slot_rows.shape[0], plan.slot_rows.shape[1], plan.offsets.shape[0] - 1,
                   plan.row_slots.shape[0]};
  check_i32(op, "plan.slot_rows", plan.slot_rows, {d.n_tokens, d.top_k});
  check_i32(op, "plan.offsets", plan.offsets, {d.n_experts + 1});
  check_i32(op, "plan.row_slots", plan.row_slots, {d.rows});
  FOURBIT_CHECK(d.n_tokens * d.top_k <= INT32_MAX && d.rows <= INT32_MAX,
                "{}: N k = {} and R = {} must fit the i32 indices", op, d.n_tokens * d.top_k, d.rows);
  return d;
}

}  // namespace

// ---- router -------------------------------------------------------------------------------------

void router_forward(const TensorView& logits, const RouterOptions& o, const RouterOutputs& out,
                    void* stream) {
  constexpr std::string_view op = "router_forward";
  FOURBIT_CHECK(logits.shape.ndim == 2 && logits.shape[1] >= 1,
                "{}: logits must be [N, E] with E >= 1, got {}", op, logits.describe());
  const int64_t N = logits.shape[0], E = logits.shape[1], k = o.top_k;
  FOURBIT_CHECK(k >= 1 && k <= E && k <= kMaxTopK,
                "{}: top_k = {} must lie in [1, min(E = {}, {})]", op, k, E, kMaxTopK);
  FOURBIT_CHECK(N * k <= INT32_MAX, "{}: N k = {} must fit the i32 indices", op, N * k);
  const Device dev = detail::common_device(
      op, {{"logits", &logits}, {"selection_bias", &o.selection_bias},
           {"forced_ids", &o.forced_ids}, {"probs", &out.probs}, {"expert_ids", &out.expert_ids},
           {"gates", &out.gates}, {"expert_counts", &out.expert_counts}, {"losses", &out.losses}});
  const bool has_bias = present(o.selection_bias), has_forced = present(o.forced_ids);
  const bool has_losses = present(out.losses);
  check_float(op, "logits", logits, dev, {DType::kF32}, {N, E});
  check_float(op, "probs", out.probs, dev, {DType::kF32}, {N, E});
  check_float(op, "gates", out.gates, dev, {DType::kF32}, {N, k});
  if (has_bias) check_float(op, "selection_bias", o.selection_bias, dev, {DType::kF32}, {E});
  if (has_losses) check_float(op, "losses", out.losses, dev, {DType::kF32}, {2});
  check_i32(op, "expert_ids", out.expert_ids, {N, k});
  check_i32(op, "expert_counts", out.expert_counts, {E});
  if (has_forced) check_i32(op, "forced_ids", o.forced_ids, {N, k});

  if (dev == Device::kCpu) {
    const DType dt = detail::cpu_float_dtype(
        op, {{"logits", &logits}, {"selection_bias", &o.selection_bias}, {"probs", &out.probs},
             {"gates", &out.gates}, {"losses", &out.losses}});
    if (dt == DType::kF32) router_forward_reference<float>(logits, o, out);
    else router_forward_reference<double>(logits, o, out);
    return;
  }
  FOURBIT_CHECK(E <= kCudaRouterMaxExperts,
                "{}: the CUDA router supports up to {} experts, got E = {}", op,
                kCudaRouterMaxExperts, E);
#if defined(FOURBIT_WITH_CUDA)
  kernels::RouterForwardArgs a{};
  a.logits = logits.ptr<float>();
  a.bias = has_bias ? o.selection_bias.ptr<float>() : nullptr;
  a.forced_ids = has_forced ? o.forced_ids.ptr<int32_t>() : nullptr;
  a.probs = out.probs.ptr<float>();
  a.expert_ids = out.expert_ids.ptr<int32_t>();
  a.gates = out.gates.ptr<float>();
  a.expert_counts = out.expert_counts.ptr<int32_t>();
  a.losses = has_losses ? out.losses.ptr<float>() : nullptr;
  a.n_tokens = N;
  a.n_experts = (int)E;
  a.top_k = (int)k;
  if (!has_forced) {
    kernels::launch_router_forward(a, static_cast<cudaStream_t>(stream));
    return;
  }
  detail::DeviceFlag flag(o.error_flag, stream);
  a.error_flag = flag.get();
  kernels::launch_router_forward(a, static_cast<cudaStream_t>(stream));
  const int bits = flag.finish();
  FOURBIT_CHECK((bits & kErrIndexOutOfRange) == 0,
                "{}: forced_ids hold an expert id outside [0, E = {}) or repeated within a token; "
                "routing replay needs k distinct valid ids per token (check the sampler's "
                "recorded routing against this model's expert count)",
                op, E);
#else
  (void)stream;
  detail::no_cuda_build(op);
#endif
}

void router_backward(const RouterSaved& s, const TensorView& d_gates, const RouterLossGrads& g,
                     const TensorView& d_logits, void* stream) {
  constexpr std::string_view op = "router_backward";
  FOURBIT_CHECK(s.probs.shape.ndim == 2 && s.probs.shape[1] >= 1,
                "{}: probs must be [N, E] with E >= 1, got {}", op, s.probs.describe());
  FOURBIT_CHECK(s.expert_ids.shape.ndim == 2, "{}: expert_ids must be i32 [N, k], got {}", op,
                s.expert_ids.describe());
  const int64_t N = s.probs.shape[0], E = s.probs.shape[1], k = s.expert_ids.shape[1];
  FOURBIT_CHECK(k >= 1 && k <= E && k <= kMaxTopK,
                "{}: expert_ids has k = {} columns; k must lie in [1, min(E = {}, {})]", op, k, E,
                kMaxTopK);
  FOURBIT_CHECK(std::isfinite(g.aux) && std::isfinite(g.z),
                "{}: the loss gradients must be finite, got aux {} z {}", op, g.aux, g.z);
  const bool need_logits = g.z != 0.0f, need_counts = g.aux != 0.0f;
  const TensorView none{};
  const Device dev = detail::common_device(
      op, {{"probs", &s.probs}, {"logits", need_logits ? &s.logits : &none},
           {"expert_ids", &s.expert_ids}, {"expert_counts", need_counts ? &s.expert_counts : &none},
           {"d_gates", &d_gates}, {"d_logits", &d_logits}});
  check_float(op, "probs", s.probs, dev, {DType::kF32}, {N, E});
  check_float(op, "d_gates", d_gates, dev, {DType::kF32}, {N, k});
  check_float(op, "d_logits", d_logits, dev, {DType::kF32}, {N, E});
  if (need_logits) check_float(op, "logits", s.logits, dev, {DType::kF32}, {N, E});
  check_i32(op, "expert_ids", s.expert_ids, {N, k});
  if (need_counts) check_i32(op, "expert_counts", s.expert_counts, {E});

  if (dev == Device::kCpu) {
    const DType dt = detail::cpu_float_dtype(
        op, {{"probs", &s.probs}, {"logits", need_logits ? &s.logits : &none},
             {"d_gates", &d_gates}, {"d_logits", &d_logits}});
    const int32_t* ids = s.expert_ids.ptr<int32_t>();
    for (int64_t i = 0; i < N * k; ++i)
      FOURBIT_CHECK(ids[i] >= 0 && ids[i] < E, "{}: expert_ids[{}, {}] = {} lies outside [0, {})",
                    op, i / k, i % k, ids[i], E);
    if (dt == DType::kF32) router_backward_reference<float>(s, d_gates, g, d_logits);
    else router_backward_reference<double>(s, d_gates, g, d_logits);
    return;
  }
  FOURBIT_CHECK(E <= kCudaRouterMaxExperts,
                "{}: the CUDA router supports up to {} experts, got E = {}", op,
                kCudaRouterMaxExperts, E);
#if defined(FOURBIT_WITH_CUDA)
  kernels::RouterBackwardArgs a{};
  a.logits = need_logits ? s.logits.ptr<float>() : nullptr;
  a.probs = s.probs.ptr<float>();
  a.expert_ids = s.expert_ids.ptr<int32_t>();
  a.expert_counts = need_counts ? s.expert_counts.ptr<int32_t>() : nullptr;
  a.d_gates = d_gates.ptr<float>();
  a.aux_grad = g.aux;
  a.z_grad = g.z;
  a.d_logits = d_logits.ptr<float>();
  a.n_tokens = N;
  a.n_experts = (int)E;
  a.top_k = (int)k;
  kernels::launch_router_backward(a, static_cast<cudaStream_t>(stream));
#else
  (void)stream;
  detail::no_cuda_build(op);
#endif
}

// ---- permutation --------------------------------------------------------------------------------

int64_t moe_permuted_rows(int64_t n_tokens, int top_k, int n_experts, int row_align) {
  FOURBIT_CHECK(n_tokens >= 0 && top_k >= 1 && n_experts >= 1 && row_align >= 1,
                "moe_permuted_rows: need N >= 0, k >= 1, E >= 1, row_align >= 1; got {}, {}, {}, {}",
                n_tokens, top_k, n_experts, row_align);
  return n_tokens * top_k + (row_align > 1 ? (int64_t)n_experts * (row_align - 1) : 0);
}

std::vector<int64_t> moe_group_sizes(std::span<const int32_t> expert_counts, int row_align) {
  FOURBIT_CHECK(row_align >= 1, "moe_group_sizes: row_align must be >= 1, got {}", row_align);
  std::vector<int64_t> sizes;
  sizes.reserve(expert_counts.size());
  for (int32_t c : expert_counts) {
    FOURBIT_CHECK(c >= 0, "moe_group_sizes: negative expert count {}", c);
    sizes.push_back(((int64_t)c + row_align - 1) / row_align * row_align);
  }
  return sizes;
}

void moe_plan(const TensorView& expert_ids, int row_align, const MoePlan& plan, void* stream) {
  constexpr std::string_view op = "moe_plan";
  const PlanDims d = check_plan(op, plan);
  check_i32(op, "expert_ids", expert_ids, {d.n_tokens, d.top_k});
  FOURBIT_CHECK(row_align >= 1, "{}: row_align must be >= 1, got {}", op, row_align);
  const int64_t need = moe_permuted_rows(d.n_tokens, (int)d.top_k, (int)d.n_experts, row_align);
  FOURBIT_CHECK(d.rows >= need,
                "{}: plan.row_slots has R = {} rows but N = {}, k = {}, E = {} with row_align {} "
                "can need {} (moe_permuted_rows)",
                op, d.rows, d.n_tokens, d.top_k, d.n_experts, row_align, need);
  const Device dev = detail::common_device(
      op, {{"expert_ids", &expert_ids}, {"plan.offsets", &plan.offsets},
           {"plan.slot_rows", &plan.slot_rows}, {"plan.row_slots", &plan.row_slots}});
  if (dev == Device::kCpu) {
    plan_reference(expert_ids, row_align, plan);
    return;
  }
  FOURBIT_CHECK(d.n_experts <= kCudaPlanMaxExperts,
                "{}: the CUDA plan supports up to {} experts, got E = {}", op, kCudaPlanMaxExperts,
                d.n_experts);
#if defined(FOURBIT_WITH_CUDA)
  kernels::MoePlanArgs a{};
  a.expert_ids = expert_ids.ptr<int32_t>();
  a.n_slots = d.n_tokens * d.top_k;
  a.n_experts = (int)d.n_experts;
  a.row_align = row_align;
  a.offsets = plan.offsets.ptr<int32_t>();
  a.slot_rows = plan.slot_rows.ptr<int32_t>();
  a.row_slots = plan.row_slots.ptr<int32_t>();
  a.rows = d.rows;
  kernels::launch_moe_plan(a, static_cast<cudaStream_t>(stream));
#else
  (void)stream;
  detail::no_cuda_build(op);
#endif
}

void moe_permute(const TensorView& x, const MoePlan& plan, const TensorView& x_perm, void* stream) {
  constexpr std::string_view op = "moe_permute";
  const PlanDims d = check_plan(op, plan);
  FOURBIT_CHECK(x.shape.ndim == 2, "{}: x must be [N, C], got {}", op, x.describe());
  const int64_t C = x.shape[1];
  const Device dev = detail::common_device(
      op, {{"x", &x}, {"x_perm", &x_perm}, {"plan.slot_rows", &plan.slot_rows},
           {"plan.row_slots", &plan.row_slots}});
  check_float(op, "x", x, dev, {DType::kBF16, DType::kF32}, {d.n_tokens, C});
  check_float(op, "x_perm", x_perm, dev, {x.dtype}, {d.rows, C});
  if (dev == Device::kCpu) {
    const DType dt = detail::cpu_float_dtype(op, {{"x", &x}, {"x_perm", &x_perm}});
    check_plan_values(op, plan);
    if (dt == DType::kF32) permute_reference<float>(x, plan, x_perm);
    else permute_reference<double>(x, plan, x_perm);
    return;
  }
#if defined(FOURBIT_WITH_CUDA)
  kernels::launch_moe_permute(float_type(x), x.data, plan.row_slots.ptr<int32_t>(), d.rows,
                              (int)d.top_k, C, x_perm.data, static_cast<cudaStream_t>(stream));
#else
  (void)stream;
  detail::no_cuda_build(op);
#endif
}

void moe_permute_backward(const TensorView& d_x_perm, const MoePlan& plan, const TensorView& dx,
                          void* stream) {
  constexpr std::string_view op = "moe_permute_backward";
  const PlanDims d = check_plan(op, plan);
  FOURBIT_CHECK(dx.shape.ndim == 2, "{}: dx must be [N, C], got {}", op, dx.describe());
  const int64_t C = dx.shape[1];
  const Device dev = detail::common_device(
      op, {{"d_x_perm", &d_x_perm}, {"dx", &dx}, {"plan.slot_rows", &plan.slot_rows},
           {"plan.row_slots", &plan.row_slots}});
  check_float(op, "d_x_perm", d_x_perm, dev, {DType::kBF16, DType::kF32}, {d.rows, C});
  check_float(op, "dx", dx, dev, {d_x_perm.dtype}, {d.n_tokens, C});
  if (dev == Device::kCpu) {
    const DType dt = detail::cpu_float_dtype(op, {{"d_x_perm", &d_x_perm}, {"dx", &dx}});
    check_plan_values(op, plan);
    if (dt == DType::kF32) gather_sum_reference<float>(d_x_perm, nullptr, plan, dx);
    else gather_sum_reference<double>(d_x_perm, nullptr, plan, dx);
    return;
  }
#if defined(FOURBIT_WITH_CUDA)
  kernels::launch_moe_gather_sum(float_type(dx), d_x_perm.data, plan.slot_rows.ptr<int32_t>(),
                                 nullptr, d.n_tokens, (int)d.top_k, C, dx.data,
                                 static_cast<cudaStream_t>(stream));
#else
  (void)stream;
  detail::no_cuda_build(op);
#endif
}

void moe_unpermute(const TensorView& y_perm, const TensorView& gates, const MoePlan& plan,
                   const TensorView& y, void* stream) {
  constexpr std::string_view op = "moe_unpermute";
  const PlanDims d = check_plan(op, plan);
  FOURBIT_CHECK(y.shape.ndim == 2, "{}: y must be [N, C], got {}", op, y.describe());
  const int64_t C = y.shape[1];
  const Device dev = detail::common_device(
      op, {{"y_perm", &y_perm}, {"gates", &gates}, {"y", &y}, {"plan.slot_rows", &plan.slot_rows},
           {"plan.row_slots", &plan.row_slots}});
  check_float(op, "y_perm", y_perm, dev, {DType::kBF16, DType::kF32}, {d.rows, C});
  check_float(op, "y", y, dev, {y_perm.dtype}, {d.n_tokens, C});
  check_float(op, "gates", gates, dev, {DType::kF32}, {d.n_tokens, d.top_k});
  if (dev == Device::kCpu) {
    const DType dt = detail::cpu_float_dtype(op, {{"y_perm", &y_perm}, {"gates", &gates}, {"y", &y}});
    check_plan_values(op, plan);
    if (dt == DType::kF32) gather_sum_reference<float>(y_perm, gates.ptr<float>(), plan, y);
    else gather_sum_reference<double>(y_perm, gates.ptr<double>(), plan, y);
    return;
  }
#if defined(FOURBIT_WITH_CUDA)
  kernels::launch_moe_gather_sum(float_type(y), y_perm.data, plan.slot_rows.ptr<int32_t>(),
                                 gates.ptr<float>(), d.n_tokens, (int)d.top_k, C, y.data,
                                 static_cast<cudaStream_t>(stream));
#else
  (void)stream;
  detail::no_cuda_build(op);
#endif
}

void moe_unpermute_backward(const TensorView& dy, const TensorView& y_perm,
                            const TensorView& gates, const MoePlan& plan,
                            const TensorView& d_y_perm, const TensorView& d_gates, void* stream) {
  constexpr std::string_view op = "moe_unpermute_backward";
  const PlanDims d = check_plan(op, plan);
  FOURBIT_CHECK(dy.shape.ndim == 2, "{}: dy must be [N, C], got {}", op, dy.describe());
  const int64_t C = dy.shape[1];
  const Device dev = detail::common_device(
      op, {{"dy", &dy}, {"y_perm", &y_perm}, {"gates", &gates}, {"d_y_perm", &d_y_perm},
           {"d_gates", &d_gates}, {"plan.slot_rows", &plan.slot_rows},
           {"plan.row_slots", &plan.row_slots}});
  check_float(op, "dy", dy, dev, {DType::kBF16, DType::kF32}, {d.n_tokens, C});
  check_float(op, "y_perm", y_perm, dev, {dy.dtype}, {d.rows, C});
  check_float(op, "d_y_perm", d_y_perm, dev, {dy.dtype}, {d.rows, C});
  check_float(op, "gates", gates, dev, {DType::kF32}, {d.n_tokens, d.top_k});
  check_float(op, "d_gates", d_gates, dev, {DType::kF32}, {d.n_tokens, d.top_k});
  if (dev == Device::kCpu) {
    const DType dt = detail::cpu_float_dtype(
        op, {{"dy", &dy}, {"y_perm", &y_perm}, {"gates", &gates}, {"d_y_perm", &d_y_perm},
             {"d_gates", &d_gates}});
    check_plan_values(op, plan);
    if (dt == DType::kF32) unpermute_backward_reference<float>(dy, y_perm, gates, plan, d_y_perm, d_gates);
    else unpermute_backward_reference<double>(dy, y_perm, gates, plan, d_y_perm, d_gates);
    return;
  }
#if defined(FOURBIT_WITH_CUDA)
  kernels::launch_moe_unpermute_backward(
      float_type(dy), dy.data, y_perm.data, gates.ptr<float>(), plan.slot_rows.ptr<int32_t>(),
      plan.row_slots.ptr<int32_t>(), d.n_tokens, (int)d.top_k, d.rows, C, d_y_perm.data,
      d_gates.ptr<float>(), static_cast<cudaStream_t>(stream));
#else
  (void)stream;
  detail::no_cuda_build(op);
#endif
}

}  // namespace fourbit::ops
