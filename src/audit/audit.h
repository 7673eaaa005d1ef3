// Precision audit: for every linear layer of a model, every GEMM it runs (Fprop, Dgrad, Wgrad) in
// every stage (pretrain_forward, pretrain_backward, rl_sampler, rl_trainer) and both operands of
// each GEMM, how much the recipe's quantization changes the operand and the GEMM's output.
//
// Definitions (x: the high-precision tensor, q: its approximation, same shape; sums over all
// elements, accumulated in float64):
//   rel_error = ||q - x||_2 / ||x||_2
//   rel_bias  = <q - x, x> / ||x||_2^2
// rel_bias is the component of the error along x itself: q ~ (1 + rel_bias) x + (orthogonal
// noise), so a NEGATIVE bias is a net shrinkage of magnitudes (what round-to-nearest into a
// coarse grid does), a positive one a net growth; |rel_bias| <= rel_error always. For x == 0 both
// are 0 (q == x) or +inf.
//
// What is compared:
//   operand  x = the GEMM's high-precision source (as the model passes it to gemm::linear_*:
//            f32 on the CPU, bf16 on CUDA), q = the recipe's quantizer applied in the orientation
//            the GEMM dictates (quant/quantize.h: quantize_reference, then dequantized back to the
//            source layout: column-wise copies transposed back, RHT undone), with the stochastic-
//            rounding streams the model's call used. A plain (unquantized) operand is read as it
//            is (error 0 by definition; its format prints as "plain").
//            Routed experts: each expert's weight is quantized on its own (its own NVFP4 global
//            scale) as model/expert_linear.h does; the stats sum over experts.
//   output   x = the same GEMM over the unquantized operands in FP32 (LinearRecipe::plain() on the
//            CPU; fresh output, beta = 0), q = the GEMM under the layer's recipe (the CPU's exact
//            emulation of the quantized GEMM, the function the CUDA kernels compute up to FP32
//            summation order).
// The measurement runs on the CPU from host copies of the operands (a CUDA model's tensors are
// copied after a device synchronization), so it costs about one CPU GEMM per observed GEMM.
//
// Two entry points:
//   run_audit()     a full audit of one batch: pretraining forward + backward, RL-trainer forward
//                   + backward and an RL-sampler prefill, every layer and every row (the
//                   `fourbit audit` command). It zeroes the model's gradients before and after.
//   TrainingAudit   the same measurement sampled inside training, every N steps, on a subset of
//                   the layers and of the token rows, reduced to a few numbers to log
//                   (TrainingAuditMetrics). How the trainer wires it:
//                       audit::TrainingAudit audit({.every = 100, .max_rows = 256});
//                       for each step s:
//                         audit.begin_step(model, s);        // attaches the observer on audited steps
//                         model.forward(...); model.backward(...);
//                         if (auto m = audit.end_step(model)) log(m->to_json());   // detaches
//                   begin_step/end_step bracket ONE training step's forward and backward (the
//                   micro-batches of a step all feed the same metrics). Off-steps cost nothing.
#pragma once

#include "model/model.h"
#include "recipe/recipe.h"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fourbit::audit {

// Sums behind rel_error / rel_bias, so that several tensors (experts, layers) can be pooled.
struct ErrorStats {
  double sum_sq_diff = 0;  // sum (q - x)^2
  double sum_sq_ref = 0;   // sum x^2
  double dot_diff_ref = 0;  // sum (q - x) x
  int64_t count = 0;       // elements

  void add(const float* q, const float* x, int64_t n);
  void merge(const ErrorStats& o);
  double rel_error() const;
  double rel_bias() const;
};

// One operand of one audited GEMM.
struct OperandAudit {
  recipe::Operand operand = recipe::Operand::kInput;  // input, weight or gradient
  std::string format = "plain";                       // QuantConfig::describe(), or "plain"
  bool colwise = false;                               // quantized along M (Wgrad; Dgrad's weight)
  ErrorStats stats;
};

struct GemmAudit {
  std::string layer;  // "blocks.0.qkv", "blocks.1.expert_up", "lm_head"
  recipe::Stage stage = recipe::Stage::kPretrainForward;
  recipe::Gemm gemm = recipe::Gemm::kFprop;
  int64_t m = 0, n = 0, k = 0;  // the GEMM C[m, n] = A[m, k] B[n, k]^T as gemm.h sees it
  int groups = 1;               // routed experts: E weights
  int64_t rows_used = 0;        // token rows measured (< all rows when sampled)
  OperandAudit a, b;            // in gemm order: fprop (input, weight), dgrad (gradient,
                                // weight), wgrad (gradient, input)
  ErrorStats output;
};

// Per (stage, gemm, operand-or-output) over the layers where that operand is quantized (for the
// output: where either operand is): mean and max of the per-layer rel_error, mean rel_bias, the
// layer with the largest error; the layers where it is plain are only counted.
struct SummaryRow {
  recipe::Stage stage;
  recipe::Gemm gemm;
  std::string what;  // "input", "weight", "gradient", "output"
  int layers = 0;        // quantized
  int plain_layers = 0;  // plain (error 0, not in the means)
  double mean_error = 0, max_error = 0, mean_bias = 0;
  std::string worst_layer;
};

struct AuditReport {
  std::string model;   // config name
  std::string recipe;  // recipe name
  int64_t tokens = 0;  // B * T of the batch
  std::vector<GemmAudit> gemms;

  std::vector<SummaryRow> summary() const;
  std::string table() const;    // one row per GEMM, then the summary, grouped by stage
  nlohmann::json to_json() const;
};

// Measures one observed GEMM (see the definitions above). max_rows > 0 measures a subset of the
// token rows of dense layers: chunks of `chunk` rows (a multiple of every token-side quantizer's
// block, >= 16) spread evenly over M, so that the reduction of Wgrad runs over that subset; the
// quantizers then see the subset only (its own NVFP4 global scale), an approximation of the
// full-tensor numbers. Expert layers are always measured in full.
GemmAudit measure_gemm(const model::GemmObservation& obs, int64_t max_rows = 0);

// Collects a GemmAudit per observed GEMM while attached to a model.
class GemmAuditor {
 public:
  struct Options {
    int64_t max_rows = 0;    // 0: every row (see measure_gemm)
    int layer_stride = 1;    // measure the layers whose index in call order % stride == offset
    int layer_offset = 0;
  };
  GemmAuditor() = default;
  explicit GemmAuditor(Options options) : options_(options) {}
  void attach(model::Model& model);  // model.set_gemm_observer(this auditor)
  static void detach(model::Model& model);
  void observe(const model::GemmObservation& obs);
  const std::vector<GemmAudit>& results() const { return results_; }
  std::vector<GemmAudit> take();

 private:
  Options options_;
  int64_t seen_ = 0;
  std::vector<GemmAudit> results_;
};

struct AuditOptions {
  // Stages to measure; pretrain_forward and pretrain_backward share one pass (forward +
  // backward), as do the rl_trainer GEMMs; rl_sampler is a KV-cache prefill of the batch.
  std::vector<recipe::Stage> stages = {recipe::kStages.begin(), recipe::kStages.end()};
  uint64_t step = 0;  // keys the stochastic-rounding draws (ForwardOptions::step)
  int64_t max_rows = 0;
};

// The full audit of one batch: tokens, targets host i32 [B, T] (B <= model.max_batch(),
// T <= model.max_seq()). Zeroes the model's gradients before and after; the weights are unchanged.
AuditReport run_audit(model::Model& model, const TensorView& tokens, const TensorView& targets,
                      const AuditOptions& options = {}, std::string recipe_name = "");

// ---- sampled, inside training ------------------------------------------------------------------

struct TrainingAuditOptions {
  int every = 100;         // audit the steps s with s % every == 0 (every >= 1)
  int64_t max_rows = 256;  // token rows per dense GEMM (0: all)
  int layer_stride = 4;    // one GEMM call in `layer_stride`, rotating with the step
};

// What one audited step reports: per stage run in that step and per GEMM kind, the largest
// rel_error of a quantized operand and of an output, the mean relative bias of the quantized
// operands and the layer with the largest output error.
struct TrainingAuditMetrics {
  uint64_t step = 0;
  int gemms = 0;
  struct PerGemm {
    recipe::Stage stage;
    recipe::Gemm gemm;
    int count = 0;
    double max_operand_error = 0, mean_operand_bias = 0;
    double max_output_error = 0, mean_output_error = 0;
    std::string worst_layer;
  };
  std::vector<PerGemm> per_gemm;
  nlohmann::json to_json() const;  // flat keys, e.g. "audit/pretrain_forward/fprop/max_output_error"
  std::string line() const;        // one log line
};

class TrainingAudit {
 public:
  explicit TrainingAudit(TrainingAuditOptions options = {});
  // Attaches the observer to `model` when `step` is an audited step; returns whether it did.
  bool begin_step(model::Model& model, uint64_t step);
  // Detaches and returns the step's metrics (nullopt on steps that were not audited).
  std::optional<TrainingAuditMetrics> end_step(model::Model& model);
  const TrainingAuditOptions& options() const { return options_; }

 private:
  TrainingAuditOptions options_;
  std::optional<GemmAuditor> auditor_;
  uint64_t step_ = 0;
};

// Reduces GEMM audits to the metrics above (exposed for tests).
TrainingAuditMetrics reduce_metrics(uint64_t step, const std::vector<GemmAudit>& gemms);

}  // namespace fourbit::audit
