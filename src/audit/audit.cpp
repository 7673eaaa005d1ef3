// Implementation of audit.h: the per-GEMM measurement (host copies of the operands, the reference
// quantizers, the CPU GEMMs), the observer, the full audit, the sampled training audit, the
// printed table and the JSON.
#include "audit/audit.h"

#include "core/check.h"
#include "core/device.h"
#include "formats/element.h"
#include "gemm/linear.h"
#include "model/expert_linear.h"
#include "quant/quantize.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <tuple>

namespace fourbit::audit {

using recipe::Gemm;
using recipe::Operand;
using recipe::Stage;

// ---- ErrorStats -----------------------------------------------------------------------------------

void ErrorStats::add(const float* q, const float* x, int64_t n) {
  double sd = 0, sr = 0, dot = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = (double)q[i] - (double)x[i];
    sd += d * d;
    sr += (double)x[i] * (double)x[i];
    dot += d * (double)x[i];
  }
  sum_sq_diff += sd;
  sum_sq_ref += sr;
  dot_diff_ref += dot;
  count += n;
}

void ErrorStats::merge(const ErrorStats& o) {
  sum_sq_diff += o.sum_sq_diff;
  sum_sq_ref += o.sum_sq_ref;
  dot_diff_ref += o.dot_diff_ref;
  count += o.count;
}

double ErrorStats::rel_error() const {
  if (sum_sq_ref == 0) return sum_sq_diff == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(sum_sq_diff / sum_sq_ref);
}

double ErrorStats::rel_bias() const {
  if (sum_sq_ref == 0) return sum_sq_diff == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  return dot_diff_ref / sum_sq_ref;
}

namespace {

// ---- host copies ----------------------------------------------------------------------------------

// A contiguous tensor on any device (f32, f64 or bf16) as a host f32 tensor of the same shape.
Tensor to_host_f32(const TensorView& v, std::string_view what) {
  FOURBIT_CHECK(v.is_contiguous(), "audit: {} must be contiguous, got {}", what, v.describe());
  Tensor raw = Tensor::empty(v.shape, v.dtype, Device::kCpu);
  if (v.device != Device::kCpu) device_synchronize();  // the model's stream may still write it
  copy_tensor(raw.view(), v);
  if (v.dtype == DType::kF32) return raw;
  Tensor out = Tensor::empty(v.shape, DType::kF32, Device::kCpu);
  float* o = out.ptr<float>();
  const int64_t n = v.numel();
  switch (v.dtype) {
    case DType::kF64:
      for (int64_t i = 0; i < n; ++i) o[i] = (float)raw.ptr<double>()[i];
      break;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) o[i] = formats::decode_bf16(raw.ptr<uint16_t>()[i]);
      break;
    default:
      FOURBIT_CHECK(false, "audit: {} has dtype {}; the audit reads f32, f64 or bf16", what,
                    dtype_name(v.dtype));
  }
  return out;
}

// A contiguous tensor as a 2D [rows, cols] view (leading dimensions folded into rows).
TensorView view_2d(const Tensor& t) {
  TensorView v = t.view();
  v.shape = Shape{v.rows(), v.cols()};
  v.strides = contiguous_strides(v.shape);
  return v;
}

// Rows `rows` of a host f32 [M, C] matrix, in order, as a new [rows.size(), C] tensor.
Tensor gather(const TensorView& src, const std::vector<int64_t>& rows) {
  const int64_t C = src.shape[1];
  Tensor out = Tensor::empty({(int64_t)rows.size(), C}, DType::kF32, Device::kCpu);
  for (size_t i = 0; i < rows.size(); ++i)
    std::memcpy(out.ptr<float>() + (int64_t)i * C, src.ptr<const float>() + rows[i] * C, (size_t)C * 4);
  return out;
}

// Expert g's [N, K] slice of a host f32 [E, N, K] tensor (a view into it).
TensorView expert_slice(const Tensor& w, int64_t g) {
  const int64_t N = w.shape()[1], K = w.shape()[2];
  return TensorView::contiguous(w.ptr<float>() + g * N * K, DType::kF32, {N, K}, Device::kCpu);
}

using gemm::operand_stream;
using model::expert_operand_stream;

// Adds the error of `recipe`'s quantization of `src` (host f32 [M, K]) to `out`.
void measure_operand(OperandAudit& out, const gemm::OperandRecipe& recipe, const TensorView& src,
                     bool colwise, RandomStream sr, std::string_view name) {
  out.colwise = colwise;
  const float* x = src.ptr<const float>();
  if (!recipe.quant) {
    out.format = "plain";
    out.stats.add(x, x, src.numel());
    return;
  }
  out.format = recipe.quant->describe();
  const quant::QuantizedTensor q =
      quant::quantize_reference(src, *recipe.quant, {!colwise, colwise}, {name, sr});
  const Tensor back = quant::dequantize_to_source_reference(q, colwise);
  out.stats.add(back.ptr<float>(), x, src.numel());
}

// The token-row chunk of a sampled GEMM: a multiple of the blocks that run along M.
int64_t row_chunk(const gemm::LinearRecipe& r, Gemm g) {
  int64_t chunk = 16;
  if (g == Gemm::kWgrad) {
    for (const gemm::OperandRecipe* o : {&r.wgrad_dy, &r.wgrad_x}) {
      if (o->quant) chunk = std::max<int64_t>(chunk, o->quant->block_size());
    }
  }
  return chunk;
}

std::vector<int64_t> sample_rows(int64_t M, int64_t chunk, int64_t max_rows) {
  std::vector<int64_t> rows;
  if (max_rows <= 0 || M <= max_rows || M < chunk) {
    rows.resize((size_t)M);
    for (int64_t i = 0; i < M; ++i) rows[(size_t)i] = i;
    return rows;
  }
  const int64_t total = M / chunk, want = std::max<int64_t>(1, std::min(total, max_rows / chunk));
  for (int64_t c = 0; c < want; ++c) {
    const int64_t start = c * total / want * chunk;
    for (int64_t i = 0; i < chunk; ++i) rows.push_back(start + i);
  }
  return rows;
}

}  // namespace

// ---- one GEMM -----------------------------------------------------------------------------------

GemmAudit measure_gemm(const model::GemmObservation& obs, int64_t max_rows) {
  FOURBIT_CHECK(obs.recipe != nullptr, "audit: observation of '{}' carries no recipe", obs.layer);
  const gemm::LinearRecipe& r = *obs.recipe;
  const gemm::LinearRecipe plain = gemm::LinearRecipe::plain();
  GemmAudit ga;
  ga.layer = std::string(obs.layer);
  ga.stage = obs.stage;
  ga.gemm = obs.gemm;
  const std::array<Operand, 2> roles = recipe::gemm_operands(obs.gemm);
  ga.a.operand = roles[0];
  ga.b.operand = roles[1];
  const bool experts = !obs.group_sizes.empty();
  const std::string where = fmt::format("{} {} ({})", obs.layer, recipe::gemm_name(obs.gemm),
                                        recipe::stage_name(obs.stage));
  Tensor a = to_host_f32(obs.a, where + " operand A");
  Tensor b = to_host_f32(obs.b, where + " operand B");
  gemm::LinearOptions lo;
  lo.sr = obs.sr;
  lo.name = ga.layer;

  if (!experts) {
    Tensor a_rows, b_rows;  // owners of the sampled rows
    TensorView av = view_2d(a), bv = view_2d(b);
    const int64_t M = av.shape[0];
    const std::vector<int64_t> rows = sample_rows(M, row_chunk(r, obs.gemm), max_rows);
    if ((int64_t)rows.size() != M) {
      a_rows = gather(av, rows);
      av = a_rows.view();
      if (obs.gemm == Gemm::kWgrad) {
        b_rows = gather(bv, rows);
        bv = b_rows.view();
      }
    }
    ga.rows_used = (int64_t)rows.size();
    const int64_t Mu = av.shape[0];
    Tensor q, ref;
    switch (obs.gemm) {
      case Gemm::kFprop: {  // a = X [M, K], b = W [N, K]
        ga.m = Mu, ga.n = bv.shape[0], ga.k = av.shape[1];
        measure_operand(ga.a, r.fprop_x, av, false, operand_stream(obs.sr, 0), "x");
        measure_operand(ga.b, r.fprop_w, bv, false, operand_stream(obs.sr, 1), "w");
        q = Tensor::empty({ga.m, ga.n}, DType::kF32, Device::kCpu);
        ref = Tensor::empty({ga.m, ga.n}, DType::kF32, Device::kCpu);
        gemm::linear_fprop(r, av, bv, q, lo);
        gemm::linear_fprop(plain, av, bv, ref, lo);
        break;
      }
      case Gemm::kDgrad: {  // a = dY [M, N], b = W [N, K] -> dX [M, K]
        ga.m = Mu, ga.n = bv.shape[1], ga.k = bv.shape[0];
        measure_operand(ga.a, r.dgrad_dy, av, false, operand_stream(obs.sr, 2), "dy");
        measure_operand(ga.b, r.dgrad_w, bv, true, operand_stream(obs.sr, 3), "w");
        q = Tensor::empty({ga.m, ga.n}, DType::kF32, Device::kCpu);
        ref = Tensor::empty({ga.m, ga.n}, DType::kF32, Device::kCpu);
        gemm::linear_dgrad(r, av, bv, q, lo);
        gemm::linear_dgrad(plain, av, bv, ref, lo);
        break;
      }
      case Gemm::kWgrad: {  // a = dY [M, N], b = X [M, K] -> dW [N, K]
        ga.m = av.shape[1], ga.n = bv.shape[1], ga.k = Mu;
        measure_operand(ga.a, r.wgrad_dy, av, true, operand_stream(obs.sr, 4), "dy");
        measure_operand(ga.b, r.wgrad_x, bv, true, operand_stream(obs.sr, 5), "x");
        q = Tensor::zeros({ga.m, ga.n}, DType::kF32, Device::kCpu);
        ref = Tensor::zeros({ga.m, ga.n}, DType::kF32, Device::kCpu);
        gemm::linear_wgrad(r, av, bv, q, 0.0f, lo);
        gemm::linear_wgrad(plain, av, bv, ref, 0.0f, lo);
        break;
      }
    }
    ga.output.add(q.ptr<float>(), ref.ptr<float>(), q.numel());
    return ga;
  }

  // Routed experts: the stacked weight (or its gradient) [E, N, K]; token operands [rows, *].
  const int64_t E = (int64_t)obs.group_sizes.size();
  ga.groups = (int)E;
  ga.rows_used = a.shape()[0];
  const TensorView& w3 = obs.gemm == Gemm::kWgrad ? obs.out : obs.b;
  FOURBIT_CHECK(w3.shape.ndim == 3 && w3.shape[0] == E,
                "audit: {}: expected a stacked expert tensor [E={}, N, K], got {}", where, E,
                w3.describe());
  const int64_t N = w3.shape[1], K = w3.shape[2];
  Tensor q, ref;
  switch (obs.gemm) {
    case Gemm::kFprop: {
      ga.m = a.shape()[0], ga.n = N, ga.k = K;
      measure_operand(ga.a, r.fprop_x, a, false, operand_stream(obs.sr, 0), "x");
      for (int64_t g = 0; g < E; ++g)
        measure_operand(ga.b, r.fprop_w, expert_slice(b, g), false, expert_operand_stream(obs.sr, 1, g), "w");
      q = Tensor::empty({ga.m, N}, DType::kF32, Device::kCpu);
      ref = Tensor::empty({ga.m, N}, DType::kF32, Device::kCpu);
      model::expert_fprop(r, a, b, obs.group_sizes, q, lo);
      model::expert_fprop(plain, a, b, obs.group_sizes, ref, lo);
      break;
    }
    case Gemm::kDgrad: {
      ga.m = a.shape()[0], ga.n = K, ga.k = N;
      measure_operand(ga.a, r.dgrad_dy, a, false, operand_stream(obs.sr, 2), "dy");
      for (int64_t g = 0; g < E; ++g)
        measure_operand(ga.b, r.dgrad_w, expert_slice(b, g), true, expert_operand_stream(obs.sr, 3, g), "w");
      q = Tensor::empty({ga.m, K}, DType::kF32, Device::kCpu);
      ref = Tensor::empty({ga.m, K}, DType::kF32, Device::kCpu);
      model::expert_dgrad(r, a, b, obs.group_sizes, q, lo);
      model::expert_dgrad(plain, a, b, obs.group_sizes, ref, lo);
      break;
    }
    case Gemm::kWgrad: {
      ga.m = N, ga.n = K, ga.k = a.shape()[0];
      measure_operand(ga.a, r.wgrad_dy, a, true, operand_stream(obs.sr, 4), "dy");
      measure_operand(ga.b, r.wgrad_x, b, true, operand_stream(obs.sr, 5), "x");
      q = Tensor::zeros({E, N, K}, DType::kF32, Device::kCpu);
      ref = Tensor::zeros({E, N, K}, DType::kF32, Device::kCpu);
      model::expert_wgrad(r, a, b, obs.group_sizes, q, 0.0f, lo);
      model::expert_wgrad(plain, a, b, obs.group_sizes, ref, 0.0f, lo);
      break;
    }
  }
  ga.output.add(q.ptr<float>(), ref.ptr<float>(), q.numel());
  return ga;
}

// ---- the observer -------------------------------------------------------------------------------

void GemmAuditor::attach(model::Model& model) {
  model.set_gemm_observer([this](const model::GemmObservation& obs) { observe(obs); });
}

void GemmAuditor::detach(model::Model& model) { model.set_gemm_observer({}); }

void GemmAuditor::observe(const model::GemmObservation& obs) {
  const int stride = std::max(1, options_.layer_stride);
  const int64_t index = seen_++;
  if (index % stride != ((options_.layer_offset % stride) + stride) % stride) return;
  results_.push_back(measure_gemm(obs, options_.max_rows));
}

std::vector<GemmAudit> GemmAuditor::take() {
  std::vector<GemmAudit> out = std::move(results_);
  results_.clear();
  seen_ = 0;
  return out;
}

// ---- the full audit -----------------------------------------------------------------------------

AuditReport run_audit(model::Model& m, const TensorView& tokens, const TensorView& targets,
                      const AuditOptions& o, std::string recipe_name) {
  FOURBIT_CHECK(tokens.shape.ndim == 2 && tokens.dtype == DType::kI32 && tokens.device == Device::kCpu,
                "audit: tokens must be host i32 [B, T], got {}", tokens.describe());
  auto wants = [&](Stage s) { return std::find(o.stages.begin(), o.stages.end(), s) != o.stages.end(); };
  AuditReport report;
  report.model = m.config().name;
  report.recipe = std::move(recipe_name);
  report.tokens = tokens.numel();
  GemmAuditor auditor(GemmAuditor::Options{o.max_rows, 1, 0});
  struct Detach {
    model::Model& m;
    ~Detach() { GemmAuditor::detach(m); }
  } detach{m};
  auditor.attach(m);
  m.zero_grads();
  auto keep = [&](std::vector<GemmAudit> v) {
    for (GemmAudit& g : v) {
      if (wants(g.stage)) report.gemms.push_back(std::move(g));
    }
  };
  if (wants(Stage::kPretrainForward) || wants(Stage::kPretrainBackward)) {
    model::ForwardOptions fo;
    fo.stage = model::TrainingStage::kPretrain;
    fo.step = o.step;
    m.forward(tokens, targets, fo);
    if (wants(Stage::kPretrainBackward)) m.backward();
    keep(auditor.take());
  }
  if (wants(Stage::kRlTrainer)) {
    model::ForwardOptions fo;
    fo.stage = model::TrainingStage::kRlTrainer;
    fo.step = o.step;
    m.forward(tokens, targets, fo);
    m.backward();
    keep(auditor.take());
  }
  if (wants(Stage::kRlSampler)) {
    const int B = (int)tokens.shape[0], T = (int)tokens.shape[1];
    model::KvCache cache = m.make_kv_cache(B, T, T);
    std::vector<int32_t> n_new((size_t)B, T);
    model::CachedForwardOptions co;
    co.stage = Stage::kRlSampler;
    m.forward_cached(cache, tokens, n_new, co);
    keep(auditor.take());
  }
  m.zero_grads();
  return report;
}

// ---- summaries ------------------------------------------------------------------------------------

namespace {

struct Acc {
  int n = 0, plain = 0;
  double sum_err = 0, max_err = -1, sum_bias = 0;
  std::string worst;
  void add(const ErrorStats& s, const std::string& layer) {
    const double e = s.rel_error();
    ++n;
    sum_err += e;
    sum_bias += s.rel_bias();
    if (e > max_err) max_err = e, worst = layer;
  }
};

std::string fmt_err(const ErrorStats& s) { return fmt::format("{:10.4e} {:+10.3e}", s.rel_error(), s.rel_bias()); }

}  // namespace

std::vector<SummaryRow> AuditReport::summary() const {
  // (stage, gemm, what) in a fixed order: what = 0 input, 1 weight, 2 gradient, 3 output.
  std::map<std::tuple<int, int, int>, Acc> acc;
  for (const GemmAudit& g : gemms) {
    // Plain operands (and the outputs of GEMMs with no quantized operand) are counted, not pooled.
    for (const OperandAudit* op : {&g.a, &g.b}) {
      Acc& a = acc[{(int)g.stage, (int)g.gemm, (int)op->operand}];
      if (op->format == "plain") {
        ++a.plain;
      } else {
        a.add(op->stats, g.layer);
      }
    }
    Acc& out = acc[{(int)g.stage, (int)g.gemm, 3}];
    if (g.a.format == "plain" && g.b.format == "plain") {
      ++out.plain;
    } else {
      out.add(g.output, g.layer);
    }
  }
  std::vector<SummaryRow> rows;
  for (const auto& [key, a] : acc) {
    SummaryRow r;
    r.stage = (Stage)std::get<0>(key);
    r.gemm = (Gemm)std::get<1>(key);
    const int w = std::get<2>(key);
    r.what = w == 3 ? "output" : std::string(recipe::operand_name((Operand)w));
    r.layers = a.n;
    r.plain_layers = a.plain;
    r.mean_error = a.n > 0 ? a.sum_err / a.n : 0.0;
    r.max_error = a.n > 0 ? a.max_err : 0.0;
    r.mean_bias = a.n > 0 ? a.sum_bias / a.n : 0.0;
    r.worst_layer = a.worst;
    rows.push_back(std::move(r));
  }
  return rows;
}

std::string AuditReport::table() const {
  std::string s = fmt::format("precision audit: model '{}', recipe '{}', {} tokens, {} GEMMs\n", model,
                              recipe, tokens, gemms.size());
  s += "rel.error = ||q(x) - x|| / ||x||; rel.bias = <q(x) - x, x> / ||x||^2 (negative: shrinkage); "
       "output: quantized GEMM vs the FP32 GEMM of the unquantized operands\n";
  for (Stage st : recipe::kStages) {
    bool any = false;
    for (const GemmAudit& g : gemms) any = any || g.stage == st;
    if (!any) continue;
    s += fmt::format("\n== {} ==\n", recipe::stage_name(st));
    s += fmt::format("{:<20} {:<5} {:>16} | {:<8} {:<22} {:>10} {:>10} | {:<8} {:<22} {:>10} {:>10} | {:>10} {:>10}\n",
                     "layer", "gemm", "m x n x k", "A", "A format", "rel.error", "rel.bias", "B",
                     "B format", "rel.error", "rel.bias", "out.error", "out.bias");
    for (const GemmAudit& g : gemms) {
      if (g.stage != st) continue;
      s += fmt::format("{:<20} {:<5} {:>16} | {:<8} {:<22} {} | {:<8} {:<22} {} | {}\n", g.layer,
                       recipe::gemm_name(g.gemm), fmt::format("{}x{}x{}", g.m, g.n, g.k),
                       recipe::operand_name(g.a.operand), g.a.format + (g.a.colwise ? " (col)" : ""),
                       fmt_err(g.a.stats), recipe::operand_name(g.b.operand),
                       g.b.format + (g.b.colwise ? " (col)" : ""), fmt_err(g.b.stats), fmt_err(g.output));
    }
  }
  s += "\nsummary (per stage, GEMM and tensor, over the layers where it is quantized; plain ones "
       "counted):\n";
  s += fmt::format("{:<18} {:<5} {:<8} {:>6} {:>6} {:>11} {:>11} {:>11}  {}\n", "stage", "gemm", "tensor",
                   "quant", "plain", "mean.error", "max.error", "mean.bias", "worst layer");
  for (const SummaryRow& r : summary()) {
    s += fmt::format("{:<18} {:<5} {:<8} {:>6} {:>6} {:>11.4e} {:>11.4e} {:>+11.3e}  {}\n",
                     recipe::stage_name(r.stage), recipe::gemm_name(r.gemm), r.what, r.layers,
                     r.plain_layers, r.mean_error, r.max_error, r.mean_bias, r.worst_layer);
  }
  return s;
}

namespace {
nlohmann::json stats_json(const ErrorStats& s) {
  return {{"rel_error", s.rel_error()}, {"rel_bias", s.rel_bias()}, {"elements", s.count},
          {"norm", std::sqrt(s.sum_sq_ref)}};
}
nlohmann::json operand_json(const OperandAudit& o) {
  nlohmann::json j = stats_json(o.stats);
  j["operand"] = std::string(recipe::operand_name(o.operand));
  j["format"] = o.format;
  j["orientation"] = o.colwise ? "colwise" : "rowwise";
  return j;
}
}  // namespace

nlohmann::json AuditReport::to_json() const {
  nlohmann::json j;
  j["format_version"] = 1;
  j["model"] = model;
  j["recipe"] = recipe;
  j["tokens"] = tokens;
  j["definitions"] = {{"rel_error", "||q(x) - x||_2 / ||x||_2"},
                      {"rel_bias", "<q(x) - x, x> / ||x||_2^2 (negative: magnitude shrinkage)"},
                      {"output", "GEMM under the recipe vs the FP32 GEMM of the unquantized operands"}};
  nlohmann::json stages = nlohmann::json::object();
  for (const GemmAudit& g : gemms) {
    nlohmann::json e = {{"layer", g.layer},
                        {"gemm", std::string(recipe::gemm_name(g.gemm))},
                        {"m", g.m}, {"n", g.n}, {"k", g.k}, {"groups", g.groups},
                        {"rows_used", g.rows_used},
                        {"operands", {operand_json(g.a), operand_json(g.b)}},
                        {"output", stats_json(g.output)}};
    stages[std::string(recipe::stage_name(g.stage))].push_back(std::move(e));
  }
  j["stages"] = stages;
  nlohmann::json sum = nlohmann::json::array();
  for (const SummaryRow& r : summary()) {
    sum.push_back({{"stage", std::string(recipe::stage_name(r.stage))},
                   {"gemm", std::string(recipe::gemm_name(r.gemm))},
                   {"tensor", r.what},
                   {"quantized_layers", r.layers},
                   {"plain_layers", r.plain_layers},
                   {"mean_rel_error", r.mean_error},
                   {"max_rel_error", r.max_error},
                   {"mean_rel_bias", r.mean_bias},
                   {"worst_layer", r.worst_layer}});
  }
  j["summary"] = sum;
  return j;
}

// ---- sampled training audit -----------------------------------------------------------------------

TrainingAuditMetrics reduce_metrics(uint64_t step, const std::vector<GemmAudit>& gemms) {
  TrainingAuditMetrics m;
  m.step = step;
  m.gemms = (int)gemms.size();
  std::map<std::pair<int, int>, TrainingAuditMetrics::PerGemm> per;
  std::map<std::pair<int, int>, int> quantized_operands;
  for (const GemmAudit& g : gemms) {
    auto& p = per[{(int)g.stage, (int)g.gemm}];
    p.stage = g.stage;
    p.gemm = g.gemm;
    ++p.count;
    for (const OperandAudit* op : {&g.a, &g.b}) {
      if (op->format == "plain") continue;
      p.max_operand_error = std::max(p.max_operand_error, op->stats.rel_error());
      p.mean_operand_bias += op->stats.rel_bias();
      ++quantized_operands[{(int)g.stage, (int)g.gemm}];
    }
    const double e = g.output.rel_error();
    if (e >= p.max_output_error) p.max_output_error = e, p.worst_layer = g.layer;
    p.mean_output_error += e;
  }
  for (auto& [key, p] : per) {
    const int nq = quantized_operands[key];
    if (nq > 0) p.mean_operand_bias /= nq;
    p.mean_output_error /= p.count;
    m.per_gemm.push_back(p);
  }
  return m;
}

nlohmann::json TrainingAuditMetrics::to_json() const {
  nlohmann::json j;
  j["audit/step"] = step;
  j["audit/gemms"] = gemms;
  for (const PerGemm& p : per_gemm) {
    const std::string k = fmt::format("audit/{}/{}/", recipe::stage_name(p.stage), recipe::gemm_name(p.gemm));
    j[k + "count"] = p.count;
    j[k + "max_operand_error"] = p.max_operand_error;
    j[k + "mean_operand_bias"] = p.mean_operand_bias;
    j[k + "max_output_error"] = p.max_output_error;
    j[k + "mean_output_error"] = p.mean_output_error;
    j[k + "worst_layer"] = p.worst_layer;
  }
  return j;
}

std::string TrainingAuditMetrics::line() const {
  std::string s = fmt::format("audit step {}: {} GEMMs", step, gemms);
  for (const PerGemm& p : per_gemm) {
    s += fmt::format("; {} {}: out.err mean {:.3e} max {:.3e} ({}), op.err max {:.3e}, op.bias {:+.2e}",
                     recipe::stage_name(p.stage), recipe::gemm_name(p.gemm), p.mean_output_error,
                     p.max_output_error, p.worst_layer, p.max_operand_error, p.mean_operand_bias);
  }
  return s;
}

TrainingAudit::TrainingAudit(TrainingAuditOptions options) : options_(options) {
  FOURBIT_CHECK(options_.every >= 1, "training audit: every must be >= 1, got {}", options_.every);
  FOURBIT_CHECK(options_.layer_stride >= 1, "training audit: layer_stride must be >= 1, got {}",
                options_.layer_stride);
  FOURBIT_CHECK(options_.max_rows >= 0, "training audit: max_rows must be >= 0, got {}", options_.max_rows);
}

bool TrainingAudit::begin_step(model::Model& model, uint64_t step) {
  auditor_.reset();
  if (step % (uint64_t)options_.every != 0) return false;
  step_ = step;
  // Rotate which GEMM calls are measured so that every layer is covered over successive audits.
  const int offset = (int)((step / (uint64_t)options_.every) % (uint64_t)options_.layer_stride);
  auditor_.emplace(GemmAuditor::Options{options_.max_rows, options_.layer_stride, offset});
  auditor_->attach(model);
  return true;
}

std::optional<TrainingAuditMetrics> TrainingAudit::end_step(model::Model& model) {
  if (!auditor_) return std::nullopt;
  GemmAuditor::detach(model);
  TrainingAuditMetrics m = reduce_metrics(step_, auditor_->results());
  auditor_.reset();
  return m;
}

}  // namespace fourbit::audit
