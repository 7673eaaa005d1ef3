// Implementation of linear.h: quantize each GEMM operand in its orientation, then one gemm().
#include "gemm/linear.h"

#include "core/check.h"

#include <memory>
#include <utility>

namespace fourbit::gemm {

LinearRecipe LinearRecipe::plain() { return {}; }

LinearRecipe LinearRecipe::nvfp4() {
  quant::QuantConfig act;  // 1x16, round to nearest
  quant::QuantConfig weight;
  weight.block_2d = true;
  quant::QuantConfig grad;
  grad.rounding = quant::Rounding::kStochastic;
  quant::QuantConfig wgrad_act = act, wgrad_grad = grad;
  wgrad_act.rht = true;
  wgrad_grad.rht = true;
  LinearRecipe r;
  r.fprop_x = {act};
  r.fprop_w = {weight};
  r.dgrad_dy = {grad};
  r.dgrad_w = {weight};
  r.wgrad_dy = {wgrad_grad};
  r.wgrad_x = {wgrad_act};
  return r;
}

LinearRecipe LinearRecipe::fp8_block() {
  quant::QuantConfig tiles;
  tiles.format = quant::Format::kFp8Block;
  quant::QuantConfig blocks = tiles;
  blocks.block_2d = true;
  LinearRecipe r;
  r.fprop_x = {tiles};
  r.fprop_w = {blocks};
  r.dgrad_dy = {tiles};
  r.dgrad_w = {blocks};
  r.wgrad_dy = {tiles};
  r.wgrad_x = {tiles};
  return r;
}

LinearRecipe LinearRecipe::mxfp8() {
  quant::QuantConfig mx;
  mx.format = quant::Format::kMxfp8;
  return {{mx}, {mx}, {mx}, {mx}, {mx}, {mx}};
}

std::string LinearRecipe::describe() const {
  auto d = [](const OperandRecipe& o) { return o.quant ? o.quant->describe() : std::string("plain"); };
  return fmt::format("fprop: x {} . w {}; dgrad: dy {} . w {}; wgrad: dy {} . x {}", d(fprop_x),
                     d(fprop_w), d(dgrad_dy), d(dgrad_w), d(wgrad_dy), d(wgrad_x));
}

PreparedOperand prepare_operand(const OperandRecipe& recipe, const TensorView& src, Copy copy,
                                RandomStream sr, std::string_view name, const LinearOptions& options) {
  PreparedOperand p;
  if (!recipe.quant) {
    // The column-wise orientation of a plain source is its transposed view.
    p.operand = Operand::dense(src, name, copy == Copy::kColwise);
    return p;
  }
  const quant::QuantConfig& cfg = *recipe.quant;
  const bool colwise = copy == Copy::kColwise;
  const quant::Orientations orientations{!colwise, colwise};
  p.quantized = std::make_unique<quant::QuantizedTensor>();
  if (src.device == Device::kCpu) {
    *p.quantized = quant::quantize_reference(src, cfg, orientations, {name, sr});
    p.operand = Operand::quant(*p.quantized, copy, name);
    return p;
  }
#if defined(FOURBIT_WITH_CUDA)
  *p.quantized = quant::allocate_quantized(cfg, src.rows(), src.cols(), orientations, Device::kCuda);
  quant::CudaQuantizeOptions qo;
  qo.tensor_name = name;
  qo.sr = sr;
  qo.nonfinite_flag = options.error_flag;
  qo.stream = options.stream;
  const bool emulated = cfg.format == quant::Format::kNvfp4 || cfg.format == quant::Format::kMxfp8;
  TensorView bf16_view;
  if (emulated) {  // the fused fast path: only the scaled-domain BF16 copy (and the amax)
    p.scaled_bf16 = colwise ? Tensor::empty({src.cols(), src.rows()}, DType::kBF16, Device::kCuda)
                            : Tensor::empty({src.rows(), src.cols()}, DType::kBF16, Device::kCuda);
    bf16_view = p.scaled_bf16.view();
    qo.write_packed = false;
    qo.write_bf16_scaled = true;
  }
  quant::quantize_cuda(src, *p.quantized, qo, colwise ? nullptr : &bf16_view,
                       colwise ? &bf16_view : nullptr);
  p.operand = Operand::quant(*p.quantized, copy, name, bf16_view);
#else
  (void)options;
  FOURBIT_CHECK(false, "linear '{}': operand '{}' is on cuda but this build has no CUDA", options.name, name);
#endif
  return p;
}

bool takes_given_amax(const quant::QuantConfig& cfg) {
  return cfg.format == quant::Format::kNvfp4 && !cfg.nvfp4_row_amax && !cfg.block_2d;
}

namespace {

#if defined(FOURBIT_WITH_CUDA)
// Passes LinearOptions::source_amax to the quantizer of the one-pass call `what` under cfg.
void use_source_amax(const LinearOptions& o, const quant::QuantConfig& cfg, std::string_view what,
                     quant::CudaQuantizeOptions& qo) {
  if (!o.source_amax.given()) return;
  FOURBIT_CHECK(takes_given_amax(cfg) && (!cfg.rht || o.source_amax.rht_amax != nullptr),
                "linear '{}': the {} was given its producer's amaxes, but its recipe ({}) does not "
                "take them (NVFP4 1D with a per-tensor amax, and the RHT amax with RHT)",
                o.name, what, cfg.describe());
  qo.given_rowwise_amax = o.source_amax.amax;
  qo.given_colwise_amax = o.source_amax.rht_amax;  // read with RHT only
}
#endif

// The producer's amaxes are only taken by the one-pass calls.
void check_no_source_amax(const LinearOptions& o, std::string_view call) {
  FOURBIT_CHECK(!o.source_amax.given(),
                "linear '{}': {} takes no producer amaxes (LinearOptions::source_amax); pass them "
                "only to the one-pass calls whose recipe shares the pass", o.name, call);
}

// Only the forward calls take a residual.
void check_no_residual(const LinearOptions& o, std::string_view call) {
  FOURBIT_CHECK(o.residual.data == nullptr,
                "linear '{}': {} takes no residual (LinearOptions::residual is for the forward "
                "calls only)", o.name, call);
}

// beta == 0 and a residual in `o`: C = A . B^T + residual (the forward calls).
void run(const PreparedOperand& a, const PreparedOperand& b, const TensorView& c, float beta,
         const LinearOptions& o, std::string_view gemm_name) {
  GemmArgs args;
  args.a = a.operand;
  args.b = b.operand;
  args.c = c;
  args.beta = beta;
  if (o.residual.data != nullptr) {
    FOURBIT_CHECK(beta == 0.0f, "linear '{}': a residual with beta {} (internal)", o.name, beta);
    args.c_source = o.residual;
    args.beta = 1.0f;
  }
  args.backend = o.backend;
  args.stream = o.stream;
  args.name = gemm_name;
  args.workspace = o.workspace;
  args.error_flag = o.error_flag;
  gemm(args);
}

}  // namespace

void linear_fprop(const LinearRecipe& recipe, const TensorView& x, const TensorView& w,
                  const TensorView& y, const LinearOptions& o) {
  check_no_source_amax(o, "linear_fprop");
  const std::string name = fmt::format("{} fprop", o.name);
  const PreparedOperand a = prepare_operand(recipe.fprop_x, x, Copy::kRowwise, operand_stream(o, 0), "x", o);
  const PreparedOperand b = prepare_operand(recipe.fprop_w, w, Copy::kRowwise, operand_stream(o, 1), "w", o);
  run(a, b, y, 0.0f, o, name);
}

void linear_dgrad(const LinearRecipe& recipe, const TensorView& dy, const TensorView& w,
                  const TensorView& dx, const LinearOptions& o) {
  check_no_source_amax(o, "linear_dgrad");
  check_no_residual(o, "linear_dgrad");
  const std::string name = fmt::format("{} dgrad", o.name);
  const PreparedOperand a = prepare_operand(recipe.dgrad_dy, dy, Copy::kRowwise, operand_stream(o, 2), "dy", o);
  const PreparedOperand b = prepare_operand(recipe.dgrad_w, w, Copy::kColwise, operand_stream(o, 3), "w", o);
  run(a, b, dx, 0.0f, o, name);
}

void linear_wgrad(const LinearRecipe& recipe, const TensorView& dy, const TensorView& x,
                  const TensorView& dw, float beta, const LinearOptions& o) {
  check_no_source_amax(o, "linear_wgrad");
  check_no_residual(o, "linear_wgrad");
  const std::string name = fmt::format("{} wgrad", o.name);
  const PreparedOperand a = prepare_operand(recipe.wgrad_dy, dy, Copy::kColwise, operand_stream(o, 4), "dy", o);
  const PreparedOperand b = prepare_operand(recipe.wgrad_x, x, Copy::kColwise, operand_stream(o, 5), "x", o);
  run(a, b, dw, beta, o, name);
}

// ---- the Wgrad's X kept quantized ---------------------------------------------------------------

bool wgrad_reads_quantized_x(const LinearRecipe& r) { return r.wgrad_x.quant.has_value(); }

bool fprop_and_wgrad_x_share_a_pass(const LinearRecipe& r) {
  if (!r.fprop_x.quant || !r.wgrad_x.quant) return false;
  const quant::QuantConfig& f = *r.fprop_x.quant;
  const quant::QuantConfig& w = *r.wgrad_x.quant;
  if (f.rounding != quant::Rounding::kNearest || w.rounding != quant::Rounding::kNearest) return false;
  if (f.nvfp4_row_amax || w.nvfp4_row_amax) return false;  // a per-row amax is row-wise only
  quant::QuantConfig f_with_w_rht = f;  // the RHT fields act on the column-wise copy only
  f_with_w_rht.rht = w.rht;
  f_with_w_rht.rht_signs = w.rht_signs;
  f_with_w_rht.rht_seed = w.rht_seed;
  return f_with_w_rht == w;
}

int64_t quantized_bytes(const quant::QuantizedTensor& q) {
  int64_t bytes = 0;
  for (const std::optional<quant::QuantizedData>* d : {&q.rowwise, &q.colwise}) {
    if (!d->has_value()) continue;
    for (const Tensor* t : {&(*d)->data, &(*d)->scales, &(*d)->amax})
      if (t->defined()) bytes += t->nbytes();
  }
  return bytes;
}

namespace {

// X's column-wise copy alone, packed, as prepare_operand(wgrad_x, x, kColwise, stream 5) makes it.
quant::QuantizedTensor quantize_colwise_packed(const quant::QuantConfig& cfg, const TensorView& x,
                                               RandomStream sr, const LinearOptions& o) {
  const quant::Orientations col_only{false, true};
  if (x.device == Device::kCpu) return quant::quantize_reference(x, cfg, col_only, {"x", sr});
#if defined(FOURBIT_WITH_CUDA)
  quant::QuantizedTensor q = quant::allocate_quantized(cfg, x.rows(), x.cols(), col_only, Device::kCuda);
  quant::CudaQuantizeOptions qo;
  qo.tensor_name = "x";
  qo.sr = sr;
  qo.nonfinite_flag = o.error_flag;
  qo.stream = o.stream;
  quant::quantize_cuda(x, q, qo);
  return q;
#else
  FOURBIT_CHECK(false, "linear '{}': operand 'x' is on cuda but this build has no CUDA", o.name);
  return {};
#endif
}

}  // namespace

void linear_fprop_saving_x(const LinearRecipe& recipe, const TensorView& x, const TensorView& w,
                           const TensorView& y, quant::QuantizedTensor& saved_x, const LinearOptions& o) {
  FOURBIT_CHECK(wgrad_reads_quantized_x(recipe),
                "linear '{}': linear_fprop_saving_x needs a recipe whose wgrad_x is quantized ({})",
                o.name, recipe.describe());
  const std::string name = fmt::format("{} fprop", o.name);
  const PreparedOperand b = prepare_operand(recipe.fprop_w, w, Copy::kRowwise, operand_stream(o, 1), "w", o);
  if (!fprop_and_wgrad_x_share_a_pass(recipe)) {
    check_no_source_amax(o, "linear_fprop_saving_x without a shared pass");
    const PreparedOperand a = prepare_operand(recipe.fprop_x, x, Copy::kRowwise, operand_stream(o, 0), "x", o);
    saved_x = quantize_colwise_packed(*recipe.wgrad_x.quant, x, operand_stream(o, 5), o);
    run(a, b, y, 0.0f, o, name);
    return;
  }
  // One pass: the row-wise copy for this GEMM (as prepare_operand makes it), the column-wise copy
  // kept. Both round to nearest, so neither draws from its stream.
  const quant::QuantConfig& cfg = *recipe.wgrad_x.quant;
  const quant::Orientations both{true, true};
  quant::QuantizedTensor q;
  PreparedOperand a;
  if (x.device == Device::kCpu) {
    q = quant::quantize_reference(x, cfg, both, {"x", operand_stream(o, 0)});
    a.operand = Operand::quant(q, Copy::kRowwise, "x");
    run(a, b, y, 0.0f, o, name);
  } else {
#if defined(FOURBIT_WITH_CUDA)
    q = quant::allocate_quantized(cfg, x.rows(), x.cols(), both, Device::kCuda);
    quant::CudaQuantizeOptions qo;
    qo.tensor_name = "x";
    qo.sr = operand_stream(o, 0);
    qo.nonfinite_flag = o.error_flag;
    qo.stream = o.stream;
    use_source_amax(o, cfg, "saved X", qo);
    TensorView bf16_row;
    const bool emulated = cfg.format == quant::Format::kNvfp4 || cfg.format == quant::Format::kMxfp8;
    if (emulated) {
      // The emulated GEMM reads the row-wise copy's scaled-domain BF16 values: its packed data and
      // scales are not written (undefined tensors); the column-wise copy is written packed.
      a.scaled_bf16 = Tensor::empty({x.rows(), x.cols()}, DType::kBF16, Device::kCuda);
      bf16_row = a.scaled_bf16.view();
      q.rowwise->data = Tensor();
      q.rowwise->scales = Tensor();
      qo.write_bf16_scaled = true;
    }
    quant::quantize_cuda(x, q, qo, emulated ? &bf16_row : nullptr, nullptr);
    a.operand = Operand::quant(q, Copy::kRowwise, "x", bf16_row);
    run(a, b, y, 0.0f, o, name);
#else
    FOURBIT_CHECK(false, "linear '{}': operand 'x' is on cuda but this build has no CUDA", o.name);
#endif
  }
  // Keep the column-wise copy only (the row-wise one dies with this call).
  saved_x = quant::QuantizedTensor{};
  saved_x.config = q.config;
  saved_x.rows = q.rows;
  saved_x.cols = q.cols;
  saved_x.device = q.device;
  saved_x.colwise = std::move(q.colwise);
}

void linear_wgrad_from_saved_x(const LinearRecipe& recipe, const TensorView& dy,
                               const quant::QuantizedTensor& saved_x, const TensorView& dw, float beta,
                               const LinearOptions& o) {
  check_no_residual(o, "linear_wgrad_from_saved_x");
  FOURBIT_CHECK(recipe.wgrad_x.quant.has_value() && saved_x.colwise.has_value() &&
                    saved_x.config == *recipe.wgrad_x.quant,
                "linear '{}': the saved X ({}) is not the column-wise copy that this recipe's Wgrad "
                "reads ({}); save it with linear_fprop_saving_x under the same recipe",
                o.name, saved_x.colwise ? saved_x.config.describe() : std::string("no column-wise copy"),
                recipe.wgrad_x.quant ? recipe.wgrad_x.quant->describe() : std::string("plain x"));
  FOURBIT_CHECK(saved_x.rows == dy.rows(),
                "linear '{}': the saved X has {} rows (tokens) but dy {} has {}", o.name, saved_x.rows,
                dy.describe(), dy.rows());
  const std::string name = fmt::format("{} wgrad", o.name);
  const PreparedOperand a = prepare_operand(recipe.wgrad_dy, dy, Copy::kColwise, operand_stream(o, 4), "dy", o);
  PreparedOperand b;
  b.operand = Operand::quant(saved_x, Copy::kColwise, "x");
  run(a, b, dw, beta, o, name);
}

// ---- Dgrad and Wgrad of one dY ------------------------------------------------------------------

bool dgrad_and_wgrad_dy_share_a_pass(const LinearRecipe& r) {
  if (!r.dgrad_dy.quant || !r.wgrad_dy.quant) return false;
  const quant::QuantConfig& d = *r.dgrad_dy.quant;
  const quant::QuantConfig& w = *r.wgrad_dy.quant;
  if (d.nvfp4_row_amax || w.nvfp4_row_amax || d.block_2d || w.block_2d) return false;
  quant::QuantConfig d_with_w_rht = d;  // the RHT fields act on the column-wise copy only
  d_with_w_rht.rht = w.rht;
  d_with_w_rht.rht_signs = w.rht_signs;
  d_with_w_rht.rht_seed = w.rht_seed;
  return d_with_w_rht == w;
}

void linear_dgrad_wgrad(const LinearRecipe& recipe, const TensorView& dy, const TensorView& w,
                        const TensorView& dx, const TensorView& x, const quant::QuantizedTensor* saved_x,
                        const TensorView& dw, float beta, const LinearOptions& o) {
  check_no_residual(o, "linear_dgrad_wgrad");
  if (!dgrad_and_wgrad_dy_share_a_pass(recipe)) {
    check_no_source_amax(o, "linear_dgrad_wgrad without a shared pass");
    linear_dgrad(recipe, dy, w, dx, o);
    if (saved_x != nullptr) {
      linear_wgrad_from_saved_x(recipe, dy, *saved_x, dw, beta, o);
    } else {
      linear_wgrad(recipe, dy, x, dw, beta, o);
    }
    return;
  }
  // One pass over dY: the row-wise copy with stream 2 (Dgrad), the column-wise one with stream 4
  // (Wgrad), as prepare_operand draws them in the separate calls.
  const quant::QuantConfig& cfg = *recipe.wgrad_dy.quant;
  const RandomStream row_sr = operand_stream(o, 2);
  const RandomStream col_src = operand_stream(o, 4);
  const RandomStream col_sr{col_src.seed, col_src.stream ^ quant::kColwiseStreamBit};
  const quant::Orientations both{true, true};
  quant::QuantizedTensor q;
  PreparedOperand dy_row, dy_col;
  if (dy.device == Device::kCpu) {
    q = quant::quantize_reference(dy, cfg, both, {"dy", row_sr}, col_sr);
    dy_row.operand = Operand::quant(q, Copy::kRowwise, "dy");
    dy_col.operand = Operand::quant(q, Copy::kColwise, "dy");
  } else {
#if defined(FOURBIT_WITH_CUDA)
    q = quant::allocate_quantized(cfg, dy.rows(), dy.cols(), both, Device::kCuda);
    quant::CudaQuantizeOptions qo;
    qo.tensor_name = "dy";
    qo.sr = row_sr;
    qo.colwise_sr = col_sr;
    qo.nonfinite_flag = o.error_flag;
    qo.stream = o.stream;
    use_source_amax(o, cfg, "dY", qo);
    TensorView bf16_row, bf16_col;
    const bool emulated = cfg.format == quant::Format::kNvfp4 || cfg.format == quant::Format::kMxfp8;
    if (emulated) {
      // Both GEMMs read scaled-domain BF16 copies; the packed data is not written.
      dy_row.scaled_bf16 = Tensor::empty({dy.rows(), dy.cols()}, DType::kBF16, Device::kCuda);
      dy_col.scaled_bf16 = Tensor::empty({dy.cols(), dy.rows()}, DType::kBF16, Device::kCuda);
      bf16_row = dy_row.scaled_bf16.view();
      bf16_col = dy_col.scaled_bf16.view();
      for (std::optional<quant::QuantizedData>* d : {&q.rowwise, &q.colwise}) {
        (*d)->data = Tensor();
        (*d)->scales = Tensor();
      }
      qo.write_bf16_scaled = true;
    }
    quant::quantize_cuda(dy, q, qo, emulated ? &bf16_row : nullptr, emulated ? &bf16_col : nullptr);
    dy_row.operand = Operand::quant(q, Copy::kRowwise, "dy", bf16_row);
    dy_col.operand = Operand::quant(q, Copy::kColwise, "dy", bf16_col);
#else
    FOURBIT_CHECK(false, "linear '{}': operand 'dy' is on cuda but this build has no CUDA", o.name);
#endif
  }
  {
    const PreparedOperand wc = prepare_operand(recipe.dgrad_w, w, Copy::kColwise, operand_stream(o, 3), "w", o);
    run(dy_row, wc, dx, 0.0f, o, fmt::format("{} dgrad", o.name));
  }
  dy_row = PreparedOperand{};  // its BF16 copy goes back to the pool before the Wgrad's operands
  const std::string wgrad_name = fmt::format("{} wgrad", o.name);
  if (saved_x != nullptr) {
    FOURBIT_CHECK(recipe.wgrad_x.quant.has_value() && saved_x->colwise.has_value() &&
                      saved_x->config == *recipe.wgrad_x.quant && saved_x->rows == dy.rows(),
                  "linear '{}': the saved X does not match this recipe's Wgrad operand or dy {}; save "
                  "it with linear_fprop_saving_x under the same recipe", o.name, dy.describe());
    PreparedOperand xs;
    xs.operand = Operand::quant(*saved_x, Copy::kColwise, "x");
    run(dy_col, xs, dw, beta, o, wgrad_name);
  } else {
    const PreparedOperand xc = prepare_operand(recipe.wgrad_x, x, Copy::kColwise, operand_stream(o, 5), "x", o);
    run(dy_col, xc, dw, beta, o, wgrad_name);
  }
}

}  // namespace fourbit::gemm
