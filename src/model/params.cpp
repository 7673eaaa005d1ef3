// Implementation of params.h.
#include "model/params.h"

#include "core/check.h"
#include "core/rng.h"
#include "formats/element.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>
#include <vector>

namespace fourbit::model {

std::string_view param_kind_name(ParamKind k) {
  switch (k) {
    case ParamKind::kEmbedding: return "embedding";
    case ParamKind::kNorm: return "norm";
    case ParamKind::kLinear: return "linear";
    case ParamKind::kRouter: return "router";
    case ParamKind::kRouterBias: return "router_bias";
    case ParamKind::kExpert: return "expert";
    case ParamKind::kLmHead: return "lm_head";
  }
  return "?";
}

namespace {

constexpr double kInitStd = 0.02;

using recipe::LinearKind;

}  // namespace

ParamTable ParamTable::build(const ModelConfig& c) {
  c.validate();
  ParamTable t;
  const int64_t C = c.d_model, V = c.vocab, F = c.d_ff;
  const int64_t HD = (int64_t)c.n_heads * c.head_dim();
  const double residual_std = kInitStd / std::sqrt(2.0 * c.n_layers);

  auto add = [&](std::string name, Shape shape, ParamKind kind, int block,
                 std::optional<LinearKind> lk, InitKind init, double std, bool decay) {
    ParamSpec p;
    p.name = std::move(name);
    p.shape = shape;
    p.kind = kind;
    p.block = block;
    p.linear_kind = lk;
    p.init = init;
    p.init_std = std;
    p.weight_decay = decay;
    p.trainable = kind != ParamKind::kRouterBias;
    p.offset = t.total_elements_;
    t.total_elements_ += (p.numel() + kAlignElements - 1) / kAlignElements * kAlignElements;
    t.rows_.push_back(std::move(p));
  };
  auto linear = [&](std::string name, Shape shape, int block, LinearKind lk, double std) {
    add(std::move(name), shape, ParamKind::kLinear, block, lk, InitKind::kNormal, std, true);
  };
  auto norm = [&](std::string name, int block) {
    add(std::move(name), {C}, ParamKind::kNorm, block, std::nullopt, InitKind::kOnes, 0.0, false);
  };

  add("embedding.weight", {V, C}, ParamKind::kEmbedding, -1, std::nullopt, InitKind::kNormal,
      kInitStd, false);
  for (int b = 0; b < c.n_layers; ++b) {
    const std::string p = fmt::format("blocks.{}.", b);
    norm(p + "attn_norm.weight", b);
    linear(p + "attn.qkv.weight", {c.qkv_dim(), C}, b, LinearKind::kQkv, kInitStd);
    linear(p + "attn.out.weight", {C, HD}, b, LinearKind::kAttnOut, residual_std);
    norm(p + "mlp_norm.weight", b);
    if (!c.is_moe_block(b)) {
      linear(p + "mlp.up.weight", {2 * F, C}, b, LinearKind::kMlpUp, kInitStd);
      linear(p + "mlp.down.weight", {C, F}, b, LinearKind::kMlpDown, residual_std);
      continue;
    }
    const int64_t E = c.moe.n_experts, Fe = c.moe.expert_d_ff;
    add(p + "moe.router.weight", {E, C}, ParamKind::kRouter, b, LinearKind::kRouter,
        InitKind::kNormal, kInitStd, true);
    if (c.moe.load_balancing == LoadBalancing::kBias) {
      add(p + "moe.router.bias", {E}, ParamKind::kRouterBias, b, std::nullopt, InitKind::kZeros,
          0.0, false);
    }
    add(p + "moe.experts.up.weight", {E, 2 * Fe, C}, ParamKind::kExpert, b, LinearKind::kExpertUp,
        InitKind::kNormal, kInitStd, true);
    add(p + "moe.experts.down.weight", {E, C, Fe}, ParamKind::kExpert, b,
        LinearKind::kExpertDown, InitKind::kNormal, residual_std, true);
    if (c.moe.n_shared_experts > 0) {
      linear(p + "moe.shared.up.weight", {2 * Fe, C}, b, LinearKind::kMlpUp, kInitStd);
      linear(p + "moe.shared.down.weight", {C, Fe}, b, LinearKind::kMlpDown, residual_std);
    }
  }
  norm("final_norm.weight", -1);
  if (!c.tied_embeddings) {
    add("lm_head.weight", {V, C}, ParamKind::kLmHead, -1, LinearKind::kLmHead, InitKind::kNormal,
        kInitStd, true);
  }
  if (c.is_moe()) t.active_expert_fraction_ = (double)c.moe.top_k / c.moe.n_experts;
  return t;
}

int ParamTable::index_of(std::string_view name) const {
  for (size_t i = 0; i < rows_.size(); ++i)
    if (rows_[i].name == name) return (int)i;
  throw Error(fmt::format("no parameter named '{}' in this model ({} parameters, e.g. '{}')", name,
                          rows_.size(), rows_.empty() ? "" : rows_.front().name));
}

int64_t ParamTable::n_params() const {
  int64_t n = 0;
  for (const ParamSpec& p : rows_)
    if (p.trainable) n += p.numel();
  return n;
}

int64_t ParamTable::n_active_params() const {
  double n = 0;
  for (const ParamSpec& p : rows_) {
    if (!p.trainable) continue;
    n += p.kind == ParamKind::kExpert ? (double)p.numel() * active_expert_fraction_ : (double)p.numel();
  }
  return (int64_t)std::llround(n);
}

std::string ParamTable::table() const {
  std::string s = fmt::format("{:<36} {:<18} {:<12} {:<12} {:<16} {}\n", "parameter", "shape",
                              "kind", "recipe", "init", "decay");
  for (const ParamSpec& p : rows_) {
    const std::string init = p.init == InitKind::kOnes    ? "ones"
                             : p.init == InitKind::kZeros ? "zeros"
                                                          : fmt::format("normal({:.5f})", p.init_std);
    s += fmt::format("{:<36} {:<18} {:<12} {:<12} {:<16} {}\n", p.name, p.shape.str(),
                     param_kind_name(p.kind),
                     p.linear_kind ? recipe::kind_name(*p.linear_kind) : std::string_view("-"), init,
                     !p.trainable ? "(buffer)" : p.weight_decay ? "yes" : "no");
  }
  s += fmt::format("{} parameters ({} active per token), {} tensors\n", n_params(),
                   n_active_params(), rows_.size());
  return s;
}

ParamBuffer::ParamBuffer(const ParamTable& table, DType dtype, Device device) {
  flat_ = Tensor::zeros({table.total_elements()}, dtype, device);
  views_.reserve((size_t)table.size());
  for (const ParamSpec& p : table.rows()) {
    void* data = static_cast<char*>(flat_.data()) + dtype_bytes(dtype, p.offset);
    views_.push_back(TensorView::contiguous(data, dtype, p.shape, device));
  }
}

namespace {
// FNV-1a of the row name: the Philox stream of that row.
uint64_t name_stream(std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char ch : name) {
    h ^= (uint8_t)ch;
    h *= 0x100000001b3ull;
  }
  return h;
}
}  // namespace

double init_normal_value(uint64_t seed, std::string_view name, int64_t index, double std) {
  // Box-Muller over one Philox block per pair of elements: element 2j takes r cos(theta), element
  // 2j + 1 takes r sin(theta) of block j (two independent normals).
  const RandomStream rs{seed, name_stream(name)};
  const Philox4x32Result r = rs.block((uint64_t)index >> 1);
  const double u1 = ((double)r.v[0] + 1.0) / 4294967297.0;  // (0, 1)
  const double u2 = (double)r.v[1] / 4294967296.0;         // [0, 1)
  const double radius = std * std::sqrt(-2.0 * std::log(u1)), theta = 6.283185307179586 * u2;
  return (index & 1) ? radius * std::sin(theta) : radius * std::cos(theta);
}

void init_params(const ParamTable& table, const ParamBuffer& params, uint64_t seed) {
  const DType dtype = params.dtype();
  FOURBIT_CHECK(dtype == DType::kF64 || dtype == DType::kF32 || dtype == DType::kBF16,
                "init_params: parameters must be f64, f32 or bf16, got {}", dtype_name(dtype));
  // Built on the host in the target dtype, then copied (on the host: in place). Every element is
  // a pure function of (seed, name, index), so the work is split over threads freely.
  Tensor host = Tensor::zeros({table.total_elements()}, dtype, Device::kCpu);
  auto fill = [&](const ParamSpec& p, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      double x = p.init == InitKind::kOnes    ? 1.0
                 : p.init == InitKind::kZeros ? 0.0
                                              : init_normal_value(seed, p.name, i, p.init_std);
      // Rounded to FP32 first (the master weights' dtype), so that an f64 model of the same seed
      // holds exactly the FP32 model's values.
      x = (double)(float)x;
      const int64_t at = p.offset + i;
      switch (dtype) {
        case DType::kF64: host.ptr<double>()[at] = x; break;
        case DType::kF32: host.ptr<float>()[at] = (float)x; break;
        default: host.ptr<uint16_t>()[at] = formats::encode_bf16_rn((float)x); break;
      }
    }
  };
  constexpr int64_t kChunk = 1 << 20;
  struct Piece {
    const ParamSpec* p;
    int64_t begin, end;
  };
  std::vector<Piece> pieces;
  for (const ParamSpec& p : table.rows())
    for (int64_t b = 0; b < p.numel(); b += kChunk) pieces.push_back({&p, b, std::min(p.numel(), b + kChunk)});
  const int n_threads = (int)std::clamp<int64_t>(std::thread::hardware_concurrency(), 1,
                                                 std::max<int64_t>(1, (int64_t)pieces.size()));
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i = next++; i < pieces.size(); i = next++) fill(*pieces[i].p, pieces[i].begin, pieces[i].end);
  };
  std::vector<std::thread> threads;
  for (int t = 1; t < n_threads; ++t) threads.emplace_back(worker);
  worker();
  for (std::thread& t : threads) t.join();
  copy_tensor(params.flat(), host.view());
}

}  // namespace fourbit::model
