// Implementation of expert_linear.h: quantize the operands (gemm::prepare_operand, per expert for
// the stacked weights), then one gemm::grouped_gemm per GEMM.
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

using Prepared = gemm::PreparedOperand;
using gemm::operand_stream;


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
    out.push_back(gemm::prepare_operand(recipe, expert_slice(w, g), copy,
                                        expert_operand_stream(o.sr, operand_index, g), "w", o));
  }
  return out;
}

std::vector<Operand> operands_of(const std::vector<Prepared>& p) {
  std::vector<Operand> ops;
  ops.reserve(p.size());
  for (const Prepared& x : p) ops.push_back(x.operand);
  return ops;
}

// One grouped GEMM of an expert linear: a [*, K] . b (per group, or one) -> c (one, or per group).
void run_grouped(gemm::GroupSplit split, std::span<const int64_t> group_sizes, const Operand& a,
                 std::span<const Operand> b, std::span<const TensorView> c, float beta,
                 const LinearOptions& o, std::string_view name) {
  gemm::GroupedGemmArgs args;
  args.split = split;
  args.group_sizes = group_sizes;
  args.a = a;
  args.b = b;
  args.c = c;
  args.beta = beta;
  args.backend = o.backend;
  args.stream = o.stream;
  args.name = name;
  args.workspace = o.workspace;
  args.error_flag = o.error_flag;
  gemm::grouped_gemm(args);
}

}  // namespace

TensorView expert_range(const TensorView& stacked, int64_t first, int64_t n) {
  FOURBIT_CHECK(stacked.shape.ndim == 3 && stacked.is_contiguous() && first >= 0 && n >= 0 &&
                    first + n <= stacked.shape[0],
                "expert_range: experts [{}, {}) of a contiguous [E, rows, cols] tensor, got {}",
                first, first + n, stacked.describe());
  const int64_t per = stacked.shape[1] * stacked.shape[2];
  return TensorView::contiguous(static_cast<char*>(stacked.data) + dtype_bytes(stacked.dtype, first * per),
                                stacked.dtype, {n, stacked.shape[1], stacked.shape[2]}, stacked.device);
}

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
  const Prepared a = gemm::prepare_operand(r.fprop_x, x, Copy::kRowwise, operand_stream(o, 0), "x", o);
  const std::vector<Prepared> b = prepare_weights(r.fprop_w, w, Copy::kRowwise, 1, o);
  const std::vector<Operand> bs = operands_of(b);
  const TensorView c[1] = {y};
  run_grouped(gemm::GroupSplit::kRows, group_sizes, a.operand, bs, c, 0.0f, o, name);
}

void expert_dgrad(const gemm::LinearRecipe& r, const TensorView& dy, const TensorView& w,
                  std::span<const int64_t> group_sizes, const TensorView& dx, const LinearOptions& o) {
  const std::string name = fmt::format("{} dgrad", o.name);
  check_stacked(w, group_sizes, name);
  const Prepared a = gemm::prepare_operand(r.dgrad_dy, dy, Copy::kRowwise, operand_stream(o, 2), "dy", o);
  const std::vector<Prepared> b = prepare_weights(r.dgrad_w, w, Copy::kColwise, 3, o);
  const std::vector<Operand> bs = operands_of(b);
  const TensorView c[1] = {dx};
  run_grouped(gemm::GroupSplit::kRows, group_sizes, a.operand, bs, c, 0.0f, o, name);
}

void expert_wgrad(const gemm::LinearRecipe& r, const TensorView& dy, const TensorView& x,
                  std::span<const int64_t> group_sizes, const TensorView& dw, float beta,
                  const LinearOptions& o) {
  const std::string name = fmt::format("{} wgrad", o.name);
  check_stacked(dw, group_sizes, name);
  const Prepared a = gemm::prepare_operand(r.wgrad_dy, dy, Copy::kColwise, operand_stream(o, 4), "dy", o);
  const Prepared b = gemm::prepare_operand(r.wgrad_x, x, Copy::kColwise, operand_stream(o, 5), "x", o);
  std::vector<TensorView> c;
  for (int64_t g = 0; g < dw.shape[0]; ++g) c.push_back(expert_slice(dw, g));
  const Operand bs[1] = {b.operand};
  run_grouped(gemm::GroupSplit::kReduction, group_sizes, a.operand, bs, c, beta, o, name);
}

}  // namespace fourbit::model
