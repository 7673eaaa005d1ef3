// Expert parallelism (expert_parallel.h): dispatch plan, all_to_allv of the token rows, the local
// experts, all_to_allv back, combine.
#include "dist/expert_parallel.h"

#include "core/check.h"
#include "model/expert_linear.h"
#include "ops/moe.h"
#include "ops/swiglu.h"

#include <algorithm>

namespace fourbit::dist {

namespace {

TensorView rows_of(const Tensor& t, int64_t rows) {
  return TensorView::contiguous(t.data(), t.dtype(), {rows, t.shape()[1]}, t.device());
}

template <typename T>
void to_host(std::vector<T>& dst, const TensorView& src) {
  dst.resize((size_t)src.numel());
  if (dst.empty()) return;
  copy_tensor(TensorView::contiguous(dst.data(), src.dtype, src.shape, Device::kCpu), src);
}

template <typename T>
Tensor to_device(const std::vector<T>& src, DType dtype, Shape shape, Device dev) {
  Tensor t = Tensor::empty(shape, dtype, dev);
  if (!src.empty())
    copy_tensor(t.view(), TensorView::contiguous(const_cast<T*>(src.data()), dtype, shape, Device::kCpu));
  return t;
}

std::vector<int64_t> times(const std::vector<int64_t>& rows, int64_t c) {
  std::vector<int64_t> out(rows);
  for (int64_t& x : out) x *= c;
  return out;
}

void check_shape(const TensorView& t, Shape shape, Device dev, const char* name) {
  FOURBIT_CHECK(t.shape == shape && t.device == dev && t.is_contiguous(),
                "ExpertParallelMoe: {} must be a contiguous {} tensor on {}, got {}", name,
                shape.str(), device_name(dev), t.describe());
}

}  // namespace

ExpertPartition ExpertPartition::contiguous(int n_experts, int world) {
  FOURBIT_CHECK(world >= 1, "ExpertPartition: world size must be >= 1, got {}", world);
  FOURBIT_CHECK(n_experts >= world,
                "expert parallelism: {} experts cannot be split over {} ranks (every rank must "
                "own at least one expert): use at most {} expert-parallel ranks",
                n_experts, world, n_experts);
  ExpertPartition p;
  p.n_experts = n_experts;
  const int base = n_experts / world, extra = n_experts % world;
  p.first.push_back(0);
  for (int r = 0; r < world; ++r) p.first.push_back(p.first.back() + base + (r < extra ? 1 : 0));
  return p;
}

int ExpertPartition::owner(int expert) const {
  FOURBIT_CHECK(expert >= 0 && expert < n_experts, "expert id {} outside [0, {})", expert,
                n_experts);
  for (int r = 0; r < world(); ++r)
    if (expert < first[(size_t)r + 1]) return r;
  return world() - 1;
}

ExpertParallelMoe::ExpertParallelMoe(Communicator& comm, int n_experts, ExpertParallelRecipes recipes)
    : comm_(comm), partition_(ExpertPartition::contiguous(n_experts, comm.size())),
      recipes_(std::move(recipes)) {
  // The model's group alignment and row tile for these recipes (model.cpp build_recipes).
  row_align_ = std::max({8, model::expert_row_align(recipes_.up), model::expert_row_align(recipes_.down)});
  rows_tile_ = std::max({1, model::expert_rows_tile(recipes_.up), model::expert_rows_tile(recipes_.down)});
}

void ExpertParallelMoe::forward(const TensorView& x, const TensorView& expert_ids,
                                const TensorView& gates, const TensorView& w_up,
                                const TensorView& w_down, const TensorView& y,
                                const gemm::LinearOptions& options,
                                const gemm::LinearOptions* down_options) {
  const gemm::LinearOptions& down = down_options != nullptr ? *down_options : options;
  const Device dev = comm_.device();
  FOURBIT_CHECK(x.shape.ndim == 2 && expert_ids.shape.ndim == 2 && w_up.shape.ndim == 3,
                "ExpertParallelMoe::forward: x [N, C], expert_ids [N, k], w_up [E_local, 2 Fe, C] "
                "expected, got {}, {}, {}", x.describe(), expert_ids.describe(), w_up.describe());
  const int64_t N = x.shape[0], C = x.shape[1], k = expert_ids.shape[1];
  const int64_t Fe = w_up.shape[1] / 2;
  const int R = comm_.size(), E = partition_.n_experts, El = n_local_experts();
  check_shape(x, {N, C}, dev, "x");
  check_shape(expert_ids, {N, k}, dev, "expert_ids");
  FOURBIT_CHECK(expert_ids.dtype == DType::kI32, "ExpertParallelMoe: expert_ids must be i32");
  check_shape(gates, {N, k}, dev, "gates");
  check_shape(w_up, {El, 2 * Fe, C}, dev, "w_up (this rank's experts)");
  check_shape(w_down, {El, C, Fe}, dev, "w_down (this rank's experts)");
  check_shape(y, {N, C}, dev, "y");
  n_tokens_ = N;
  top_k_ = k;
  channels_ = C;
  expert_ff_ = Fe;
  w_up_ = w_up;
  w_down_ = w_down;
  gates_ = gates;

  // Counts per global expert (host), checking the ids.
  std::vector<int32_t> ids;
  to_host(ids, expert_ids);
  std::vector<int64_t> counts((size_t)E, 0);
  for (int32_t id : ids) {
    FOURBIT_CHECK(id >= 0 && id < E, "ExpertParallelMoe: expert id {} outside [0, {})", id, E);
    ++counts[(size_t)id];
  }
  // 1. Plan A: slots sorted by global expert; destination blocks are contiguous.
  offsets_a_ = Tensor::empty({E + 1}, DType::kI32, dev);
  slot_rows_a_ = Tensor::empty({N, k}, DType::kI32, dev);
  row_slots_a_ = Tensor::empty({N * k}, DType::kI32, dev);
  const ops::MoePlan plan_a{offsets_a_.view(), slot_rows_a_.view(), row_slots_a_.view()};
  ops::moe_plan(expert_ids, 1, plan_a, options.stream);
  Tensor x_send = Tensor::empty({N * k, C}, x.dtype, dev);
  ops::moe_permute(x, plan_a, x_send.view(), options.stream);

  // 2. Counts per (source, local expert), then the rows.
  send_rows_.assign((size_t)R, 0);
  std::vector<int64_t> send_expert_counts(counts), send_count_counts((size_t)R), recv_count_counts((size_t)R, El);
  for (int d = 0; d < R; ++d) {
    send_count_counts[(size_t)d] = partition_.n_local(d);
    for (int e = partition_.first[(size_t)d]; e < partition_.first[(size_t)d + 1]; ++e)
      send_rows_[(size_t)d] += counts[(size_t)e];
  }
  Tensor send_c = to_device(send_expert_counts, DType::kI64, {E}, dev);
  Tensor recv_c = Tensor::empty({(int64_t)R * El}, DType::kI64, dev);
  comm_.all_to_allv(send_c.view(), send_count_counts, recv_c.view(), recv_count_counts);
  std::vector<int64_t> recv_expert_counts;  // [R, El]
  to_host(recv_expert_counts, recv_c.view());
  recv_rows_.assign((size_t)R, 0);
  local_counts_.assign((size_t)El, 0);
  std::vector<int32_t> local_ids;  // [M]: the local expert of every received row
  for (int s = 0; s < R; ++s) {
    for (int e = 0; e < El; ++e) {
      const int64_t c = recv_expert_counts[(size_t)(s * El + e)];
      recv_rows_[(size_t)s] += c;
      local_counts_[(size_t)e] += (int32_t)c;
      local_ids.insert(local_ids.end(), (size_t)c, e);
    }
  }
  m_rows_ = (int64_t)local_ids.size();
  Tensor x_recv = Tensor::empty({m_rows_, C}, x.dtype, dev);
  comm_.all_to_allv(x_send.view(), times(send_rows_, C), x_recv.view(), times(recv_rows_, C));

  // 3-5. Plan B, the local experts, and the rows back in received order.
  Tensor y_recv = Tensor::zeros({m_rows_, C}, x.dtype, dev);
  group_sizes_ = ops::moe_group_sizes(local_counts_, row_align_);
  rows_b_ = 0;
  for (int64_t g : group_sizes_) rows_b_ += g;
  const int64_t padded = (rows_b_ + rows_tile_ - 1) / rows_tile_ * rows_tile_;
  group_sizes_.back() += padded - rows_b_;
  rows_b_ = padded;
  if (m_rows_ > 0) {
    const int64_t rb = ops::moe_permuted_rows(m_rows_, 1, El, row_align_) + rows_tile_;
    Tensor ids_b = to_device(local_ids, DType::kI32, {m_rows_, 1}, dev);
    offsets_b_ = Tensor::empty({El + 1}, DType::kI32, dev);
    slot_rows_b_ = Tensor::empty({m_rows_, 1}, DType::kI32, dev);
    row_slots_b_ = Tensor::empty({rb}, DType::kI32, dev);
    const ops::MoePlan plan_b{offsets_b_.view(), slot_rows_b_.view(), row_slots_b_.view()};
    ops::moe_plan(ids_b.view(), row_align_, plan_b, options.stream);
    x_local_ = Tensor::zeros({rb, C}, x.dtype, dev);
    h_local_ = Tensor::zeros({rb, 2 * Fe}, x.dtype, dev);
    act_local_ = Tensor::zeros({rb, Fe}, x.dtype, dev);
    Tensor y_local = Tensor::zeros({rb, C}, x.dtype, dev);
    ops::moe_permute(x_recv.view(), plan_b, x_local_.view(), options.stream);
    model::expert_fprop(recipes_.up, rows_of(x_local_, rows_b_), w_up, group_sizes_,
                        rows_of(h_local_, rows_b_), options);
    ops::swiglu_forward(rows_of(act_local_, rows_b_), rows_of(h_local_, rows_b_), options.stream);
    model::expert_fprop(recipes_.down, rows_of(act_local_, rows_b_), w_down, group_sizes_,
                        rows_of(y_local, rows_b_), down);
    ops::moe_permute_backward(y_local.view(), plan_b, y_recv.view(), options.stream);
  }
  y_send_ = Tensor::empty({N * k, C}, x.dtype, dev);
  comm_.all_to_allv(y_recv.view(), times(recv_rows_, C), y_send_.view(), times(send_rows_, C));
  // 6. Combine.
  ops::moe_unpermute(y_send_.view(), gates, plan_a, y, options.stream);
  have_forward_ = true;
}

void ExpertParallelMoe::backward(const TensorView& dy, const TensorView& dx,
                                 const TensorView& d_gates, const TensorView& dw_up,
                                 const TensorView& dw_down, const gemm::LinearOptions& options,
                                 const gemm::LinearOptions* down_options) {
  const gemm::LinearOptions& down = down_options != nullptr ? *down_options : options;
  FOURBIT_CHECK(have_forward_, "ExpertParallelMoe::backward: run forward first (once per backward)");
  have_forward_ = false;  // the backward overwrites h_local_ with its gradient
  const Device dev = comm_.device();
  const int64_t N = n_tokens_, C = channels_, k = top_k_, Fe = expert_ff_;
  const int El = n_local_experts();
  check_shape(dy, {N, C}, dev, "dy");
  check_shape(dx, {N, C}, dev, "dx");
  check_shape(d_gates, {N, k}, dev, "d_gates");
  check_shape(dw_up, {El, 2 * Fe, C}, dev, "dw_up (this rank's experts)");
  check_shape(dw_down, {El, C, Fe}, dev, "dw_down (this rank's experts)");
  const DType adt = y_send_.dtype();
  const ops::MoePlan plan_a{offsets_a_.view(), slot_rows_a_.view(), row_slots_a_.view()};
  Tensor d_y_send = Tensor::empty({N * k, C}, adt, dev);
  ops::moe_unpermute_backward(dy, y_send_.view(), gates_, plan_a, d_y_send.view(), d_gates,
                              options.stream);
  Tensor d_y_recv = Tensor::empty({m_rows_, C}, adt, dev);
  comm_.all_to_allv(d_y_send.view(), times(send_rows_, C), d_y_recv.view(), times(recv_rows_, C));
  Tensor d_x_recv = Tensor::zeros({m_rows_, C}, adt, dev);
  if (m_rows_ > 0) {
    const ops::MoePlan plan_b{offsets_b_.view(), slot_rows_b_.view(), row_slots_b_.view()};
    const int64_t rb = x_local_.shape()[0];
    Tensor d_y_local = Tensor::zeros({rb, C}, adt, dev);
    Tensor d_act = Tensor::zeros({rb, Fe}, adt, dev);
    Tensor d_x_local = Tensor::zeros({rb, C}, adt, dev);
    ops::moe_permute(d_y_recv.view(), plan_b, d_y_local.view(), options.stream);
    model::expert_dgrad(recipes_.down, rows_of(d_y_local, rows_b_), w_down_, group_sizes_,
                        rows_of(d_act, rows_b_), down);
    model::expert_wgrad(recipes_.down, rows_of(d_y_local, rows_b_), rows_of(act_local_, rows_b_),
                        group_sizes_, dw_down, 1.0f, down);
    ops::swiglu_backward_inplace(rows_of(h_local_, rows_b_), rows_of(d_act, rows_b_), options.stream);
    model::expert_dgrad(recipes_.up, rows_of(h_local_, rows_b_), w_up_, group_sizes_,
                        rows_of(d_x_local, rows_b_), options);
    model::expert_wgrad(recipes_.up, rows_of(h_local_, rows_b_), rows_of(x_local_, rows_b_),
                        group_sizes_, dw_up, 1.0f, options);
    ops::moe_permute_backward(d_x_local.view(), plan_b, d_x_recv.view(), options.stream);
  }
  Tensor d_x_send = Tensor::empty({N * k, C}, adt, dev);
  comm_.all_to_allv(d_x_recv.view(), times(recv_rows_, C), d_x_send.view(), times(send_rows_, C));
  ops::moe_permute_backward(d_x_send.view(), plan_a, dx, options.stream);
}

ExpertParallelModel::ExpertParallelModel(Communicator& comm, const model::ModelConfig& config)
    : comm_(comm), n_experts_(config.moe.n_experts) {
  FOURBIT_CHECK(config.is_moe(),
                "expert parallelism: model '{}' has no MoE blocks (set moe.layers and "
                "moe.n_experts), so there are no experts to split over the {} ranks",
                config.name, comm.size());
  partition_ = ExpertPartition::contiguous(n_experts_, comm.size());
  blocks_.resize((size_t)config.n_moe_layers());
}

ExpertParallelModel::Block& ExpertParallelModel::block(int moe_index) {
  FOURBIT_CHECK(moe_index >= 0 && moe_index < (int)blocks_.size(),
                "ExpertParallelModel: MoE block {} outside [0, {})", moe_index, blocks_.size());
  return blocks_[(size_t)moe_index];
}

int64_t ExpertParallelModel::rows_processed(int moe_index) const {
  return blocks_.at((size_t)moe_index).rows;
}

void ExpertParallelModel::forward(int moe_index, const TensorView& x, const TensorView& expert_ids,
                                  const TensorView& gates, const TensorView& w_up,
                                  const TensorView& w_down, const TensorView& y,
                                  const gemm::LinearRecipe& up_recipe,
                                  const gemm::LinearRecipe& down_recipe,
                                  const gemm::LinearOptions& up, const gemm::LinearOptions& down) {
  Block& b = block(moe_index);
  std::string recipes = up_recipe.describe() + "\n" + down_recipe.describe();
  if (!b.moe || recipes != b.recipes) {
    b.moe = std::make_unique<ExpertParallelMoe>(comm_, n_experts_, ExpertParallelRecipes{up_recipe, down_recipe});
    b.recipes = std::move(recipes);
  }
  b.moe->forward(x, expert_ids, gates, w_up, w_down, y, up, &down);
  b.rows += b.moe->received_rows();
}

void ExpertParallelModel::backward(int moe_index, const TensorView& dy, const TensorView& dx,
                                   const TensorView& d_gates, const TensorView& dw_up,
                                   const TensorView& dw_down, const gemm::LinearOptions& up,
                                   const gemm::LinearOptions& down) {
  Block& b = block(moe_index);
  FOURBIT_CHECK(b.moe != nullptr, "ExpertParallelModel::backward: MoE block {} has had no forward",
                moe_index);
  b.moe->backward(dy, dx, d_gates, dw_up, dw_down, up, &down);
}

}  // namespace fourbit::dist
