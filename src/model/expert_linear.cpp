// Implementation of expert_linear.h: quantize the operands (mirroring gemm/linear.cpp's per-operand
// preparation), then one gemm::grouped_gemm per GEMM.
#include "model/expert_linear.h"

#include "core/check.h"

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <vector>

namespace fourbit::model {

namespace {

using gemm::Copy;
using gemm::LinearOptions;
using gemm::Operand;
using gemm::OperandRecipe;

// One GEMM operand made from a source [rows, cols] in orientation `copy`; owns what Operand points
// into.
struct Prepared {
  std::unique_ptr<quant::QuantizedTensor> quantized;
  Tensor scaled_bf16;
  Operand operand;
};

Prepared prepare(const OperandRecipe& recipe, const TensorView& src, Copy copy, RandomStream sr,
                 std::string_view name, const LinearOptions& o) {
  Prepared p;
  const bool colwise = copy == Copy::kColwise;
  if (!recipe.quant) {
    p.operand = Operand::dense(src, name, colwise);
    return p;
  }
  const quant::QuantConfig& cfg = *recipe.quant;
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
  qo.nonfinite_flag = o.error_flag;
  qo.stream = o.stream;
  const bool emulated = cfg.format == quant::Format::kNvfp4 || cfg.format == quant::Format::kMxfp8;
  TensorView bf16_view;
  if (emulated) {
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
  FOURBIT_CHECK(false, "{}: operand '{}' is on cuda but this build has no CUDA", o.name, name);
#endif
  return p;
}

RandomStream operand_stream(const LinearOptions& o, uint64_t i) { return {o.sr.seed, o.sr.stream + i}; }
RandomStream expert_stream(const LinearOptions& o, uint64_t i, int64_t g) {
  return {o.sr.seed, (o.sr.stream + i) ^ ((uint64_t)(g + 1) << 44)};
}

// Expert g's slice [N, K] of the stacked weight [E, N, K].
TensorView expert_slice(const TensorView& w, int64_t g) {
  TensorView s = TensorView::contiguous(
      static_cast<char*>(w.data) + dtype_bytes(w.dtype, g * w.shape[1] * w.shape[2]), w.dtype,
      {w.shape[1], w.shape[2]}, w.device);
  return s;
}

void check_stacked(const TensorView& w, std::span<const int64_t> group_sizes, std::string_view what) {
  FOURBIT_CHECK(w.shape.ndim == 3 && w.is_contiguous(),
                "{}: the expert weight must be a contiguous [E, N, K] tensor, got {}", what,
                w.describe());
  FOURBIT_CHECK((int64_t)group_sizes.size() == w.shape[0],
                "{}: {} group sizes for {} experts", what, group_sizes.size(), w.shape[0]);
}

// The per-expert weight operands in orientation `copy`.
std::vector<Prepared> prepare_weights(const OperandRecipe& recipe, const TensorView& w, Copy copy,
                                      uint64_t operand_index, const LinearOptions& o) {
  std::vector<Prepared> out;
  out.reserve((size_t)w.shape[0]);
  for (int64_t g = 0; g < w.shape[0]; ++g) {
    out.push_back(prepare(recipe, expert_slice(w, g), copy, expert_stream(o, operand_index, g),
                          "w", o));
  }
  return out;
}

std::vector<Operand> operands_of(const std::vector<Prepared>& p) {
  std::vector<Operand> ops;
  ops.reserve(p.size());
  for (const Prepared& x : p) ops.push_back(x.operand);
  return ops;
}

}  // namespace

int expert_row_align(const gemm::LinearRecipe& r) {
  int align = 8;  // cuBLASLt BF16: 16-byte aligned group slices
  for (const OperandRecipe* o : {&r.fprop_x, &r.fprop_w, &r.dgrad_dy, &r.dgrad_w, &r.wgrad_dy, &r.wgrad_x}) {
    if (!o->quant) continue;
    const int block = o->quant->block_size();
    align = std::max(align, block > 0 ? block : 16);  // FP8 per-tensor: cuBLASLt's 16
    if (o->quant->format == quant::Format::kFp8Block || o->quant->format == quant::Format::kFp8Tensor)
      align = std::max(align, 16);
  }
  return align;
}

int expert_rows_tile(const gemm::LinearRecipe& r) {
  int tile = 1;
  for (const OperandRecipe* o : {&r.fprop_x, &r.dgrad_dy, &r.wgrad_dy, &r.wgrad_x}) {
    if (!o->quant) continue;
    tile = std::max(tile, o->quant->format == quant::Format::kFp8Block ? 128 : 64);
  }
  return tile;
}

void expert_fprop(const gemm::LinearRecipe& r, const TensorView& x, const TensorView& w,
                  std::span<const int64_t> group_sizes, const TensorView& y, const LinearOptions& o) {
  const std::string name = fmt::format("{} fprop", o.name);
  check_stacked(w, group_sizes, name);
  const Prepared a = prepare(r.fprop_x, x, Copy::kRowwise, operand_stream(o, 0), "x", o);
  const std::vector<Prepared> b = prepare_weights(r.fprop_w, w, Copy::kRowwise, 1, o);
  const std::vector<Operand> bs = operands_of(b);
  const TensorView c[1] = {y};
  gemm::GroupedGemmArgs args;
  args.split = gemm::GroupSplit::kRows;
  args.group_sizes = group_sizes;
  args.a = a.operand;
  args.b = bs;
  args.c = c;
  args.backend = o.backend;
  args.stream = o.stream;
  args.name = name;
  args.workspace = o.workspace;
  args.error_flag = o.error_flag;
  gemm::grouped_gemm(args);
}

void expert_dgrad(const gemm::LinearRecipe& r, const TensorView& dy, const TensorView& w,
                  std::span<const int64_t> group_sizes, const TensorView& dx, const LinearOptions& o) {
  const std::string name = fmt::format("{} dgrad", o.name);
  check_stacked(w, group_sizes, name);
  const Prepared a = prepare(r.dgrad_dy, dy, Copy::kRowwise, operand_stream(o, 2), "dy", o);
  const std::vector<Prepared> b = prepare_weights(r.dgrad_w, w, Copy::kColwise, 3, o);
  const std::vector<Operand> bs = operands_of(b);
  const TensorView c[1] = {dx};
  gemm::GroupedGemmArgs args;
  args.split = gemm::GroupSplit::kRows;
  args.group_sizes = group_sizes;
  args.a = a.operand;
  args.b = bs;
  args.c = c;
  args.backend = o.backend;
  args.stream = o.stream;
  args.name = name;
  args.workspace = o.workspace;
  args.error_flag = o.error_flag;
  gemm::grouped_gemm(args);
}

void expert_wgrad(const gemm::LinearRecipe& r, const TensorView& dy, const TensorView& x,
                  std::span<const int64_t> group_sizes, const TensorView& dw, float beta,
                  const LinearOptions& o) {
  const std::string name = fmt::format("{} wgrad", o.name);
  check_stacked(dw, group_sizes, name);
  const Prepared a = prepare(r.wgrad_dy, dy, Copy::kColwise, operand_stream(o, 4), "dy", o);
  const Prepared b = prepare(r.wgrad_x, x, Copy::kColwise, operand_stream(o, 5), "x", o);
  std::vector<TensorView> c;
  for (int64_t g = 0; g < dw.shape[0]; ++g) c.push_back(expert_slice(dw, g));
  const Operand bs[1] = {b.operand};
  gemm::GroupedGemmArgs args;
  args.split = gemm::GroupSplit::kReduction;
  args.group_sizes = group_sizes;
  args.a = a.operand;
  args.b = bs;
  args.c = c;
  args.beta = beta;
  args.backend = o.backend;
  args.stream = o.stream;
  args.name = name;
  args.workspace = o.workspace;
  args.error_flag = o.error_flag;
  gemm::grouped_gemm(args);
}

}  // namespace fourbit::model
