// Implementation of linear.h: quantize each GEMM operand in its orientation, then one gemm().
#include "gemm/linear.h"

#include "core/check.h"

#include <memory>

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

namespace {

void run(const PreparedOperand& a, const PreparedOperand& b, const TensorView& c, float beta,
         const LinearOptions& o, std::string_view gemm_name) {
  GemmArgs args;
  args.a = a.operand;
  args.b = b.operand;
  args.c = c;
  args.beta = beta;
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
  const std::string name = fmt::format("{} fprop", o.name);
  const PreparedOperand a = prepare_operand(recipe.fprop_x, x, Copy::kRowwise, operand_stream(o, 0), "x", o);
  const PreparedOperand b = prepare_operand(recipe.fprop_w, w, Copy::kRowwise, operand_stream(o, 1), "w", o);
  run(a, b, y, 0.0f, o, name);
}

void linear_dgrad(const LinearRecipe& recipe, const TensorView& dy, const TensorView& w,
                  const TensorView& dx, const LinearOptions& o) {
  const std::string name = fmt::format("{} dgrad", o.name);
  const PreparedOperand a = prepare_operand(recipe.dgrad_dy, dy, Copy::kRowwise, operand_stream(o, 2), "dy", o);
  const PreparedOperand b = prepare_operand(recipe.dgrad_w, w, Copy::kColwise, operand_stream(o, 3), "w", o);
  run(a, b, dx, 0.0f, o, name);
}

void linear_wgrad(const LinearRecipe& recipe, const TensorView& dy, const TensorView& x,
                  const TensorView& dw, float beta, const LinearOptions& o) {
  const std::string name = fmt::format("{} wgrad", o.name);
  const PreparedOperand a = prepare_operand(recipe.wgrad_dy, dy, Copy::kColwise, operand_stream(o, 4), "dy", o);
  const PreparedOperand b = prepare_operand(recipe.wgrad_x, x, Copy::kColwise, operand_stream(o, 5), "x", o);
  run(a, b, dw, beta, o, name);
}

}  // namespace fourbit::gemm
