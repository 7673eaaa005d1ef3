// ZeRO-1 AdamW (zero_optimizer.h).
#include "dist/zero_optimizer.h"

#include "core/check.h"
#include "ops/adamw.h"

#include <algorithm>
#include <cmath>

namespace fourbit::dist {

namespace {

// A 1-D view of elements [begin, begin + n) of a flat contiguous tensor.
TensorView slice(const TensorView& flat, int64_t begin, int64_t n) {
  return TensorView::contiguous(static_cast<char*>(flat.data) + dtype_bytes(flat.dtype, begin),
                                flat.dtype, {n}, flat.device);
}

}  // namespace

FlatPartition FlatPartition::even(int64_t total, int world, int64_t align) {
  FOURBIT_CHECK(world >= 1 && total >= 0 && align >= 1,
                "FlatPartition: need world >= 1, total >= 0, align >= 1 (got {}, {}, {})", world,
                total, align);
  FlatPartition p;
  p.total = total;
  int64_t per = (total + world - 1) / world;
  per = (per + align - 1) / align * align;
  for (int r = 0; r < world; ++r) {
    const int64_t begin = std::min(total, per * r);
    const int64_t end = std::min(total, per * (r + 1));
    p.offsets.push_back(begin);
    p.counts.push_back(end - begin);
  }
  return p;
}

ZeroAdamW::ZeroAdamW(model::Model& model, Communicator& comm, const train::AdamWConfig& config)
    : model_(model), comm_(comm), config_(config) {
  train::validate(config);
  const model::ParamBuffer& params = model.params();
  FOURBIT_CHECK(comm.device() == params.device(),
                "ZeroAdamW: the communicator works on {} but the model is on {}",
                device_name(comm.device()), device_name(params.device()));
  const model::ParamTable& table = model.table();
  partition_ = FlatPartition::even(table.total_elements(), comm.size(),
                                   model::ParamTable::kAlignElements);
  const int64_t begin = shard_begin(), end = shard_end();
  for (int i = 0; i < table.size(); ++i) {
    const model::ParamSpec& s = table.row(i);
    decay_.push_back(train::adamw_decays(s, config));
    if (!s.trainable) continue;
    const int64_t lo = std::max(begin, s.offset), hi = std::min(end, s.offset + s.numel());
    if (lo < hi) pieces_.push_back({i, lo, hi});
  }
  const Device dev = params.device();
  m_ = Tensor::zeros({end - begin}, params.dtype(), dev);
  v_ = Tensor::zeros({end - begin}, params.dtype(), dev);
  if (dev == Device::kCuda) {
    norm_ = Tensor::zeros({1}, DType::kF32, dev);
    std::vector<TensorView> grads;
    for (const ShardPiece& p : pieces_) grads.push_back(slice(model.grads().flat(), p.begin, p.end - p.begin));
    const int64_t bytes = ops::grad_norm_workspace_bytes(grads);
    workspace_ = Tensor::zeros({(bytes + 15) / 16 * 16 + 16}, DType::kU8, dev);
  }
}

void ZeroAdamW::set_steps(int64_t steps) {
  FOURBIT_CHECK(steps >= 0, "ZeroAdamW::set_steps: steps must be >= 0, got {}", steps);
  steps_ = steps;
}

double ZeroAdamW::shard_sum_of_squares() {
  const TensorView& g = model_.grads().flat();
  if (g.device == Device::kCuda) {
    // ops::global_grad_norm's deterministic reduction gives sqrt(sum) in f32; squared back in
    // float64 (a relative error of ~1e-7 on this rank's share, far below what clipping notices).
    if (pieces_.empty()) return 0.0;
    std::vector<TensorView> grads;
    for (const ShardPiece& p : pieces_) grads.push_back(slice(g, p.begin, p.end - p.begin));
    ops::global_grad_norm(norm_.view(), grads, workspace_.view(), config_.stream);
    Tensor host = norm_.to(Device::kCpu);
    const double n = (double)host.ptr<float>()[0];
    return n * n;
  }
  double sum = 0;
  for (const ShardPiece& p : pieces_) {
    if (g.dtype == DType::kF64) {
      const double* x = g.ptr<double>();
      for (int64_t i = p.begin; i < p.end; ++i) sum += x[i] * x[i];
    } else {
      FOURBIT_CHECK(g.dtype == DType::kF32, "ZeroAdamW: gradients must be f32 or f64, got {}",
                    dtype_name(g.dtype));
      const float* x = g.ptr<float>();
      for (int64_t i = p.begin; i < p.end; ++i) sum += (double)x[i] * (double)x[i];
    }
  }
  return sum;
}

train::StepResult ZeroAdamW::step(double lr) {
  FOURBIT_CHECK(std::isfinite(lr) && lr >= 0,
                "ZeroAdamW::step: lr must be finite and >= 0, got {}", lr);
  const model::ParamBuffer& params = model_.params();
  const model::ParamBuffer& grads = model_.grads();
  const int64_t begin = shard_begin(), n = shard_end() - begin;
  // 1. Sum the gradients of shard r into this rank's grads buffer (rank r), in place.
  comm_.reduce_scatter_sum(grads.flat(), slice(grads.flat(), begin, n), partition_.counts);
  // 2. The global norm.
  double sumsq = shard_sum_of_squares();
  all_reduce_sum_host(comm_, std::span<double>(&sumsq, 1));
  double norm = std::sqrt(sumsq);
  // Rounded to the norm's dtype as train::AdamW reports it (f32, or f64 for an f64 CPU model).
  if (params.dtype() != DType::kF64) norm = (double)(float)norm;
  train::StepResult r = train::step_result_for_norm(norm, config_);
  if (!r.applied) return r;
  const float scale = (float)r.clip_scale;
  // 3. AdamW on this rank's pieces.
  for (const ShardPiece& p : pieces_) {
    const int64_t len = p.end - p.begin;
    const ops::AdamWParams a =
        train::adamw_update_params(config_, lr, steps_ + 1, decay_[(size_t)p.row], scale);
    ops::adamw_update(slice(params.flat(), p.begin, len), slice(grads.flat(), p.begin, len),
                      slice(m_.view(), p.begin - begin, len), slice(v_.view(), p.begin - begin, len),
                      TensorView{}, a, config_.stream);
  }
  // 4. Every rank gets every shard's new weights.
  comm_.all_gather(slice(params.flat(), begin, n), params.flat(), partition_.counts);
  model_.params_changed();
  ++steps_;
  r.applied = true;
  return r;
}

void ZeroAdamW::gather_state(const model::ParamBuffer& m_full, const model::ParamBuffer& v_full) {
  const model::ParamBuffer& params = model_.params();
  const int64_t begin = shard_begin(), n = shard_end() - begin;
  for (const model::ParamBuffer* full : {&m_full, &v_full}) {
    FOURBIT_CHECK(full->dtype() == params.dtype() &&
                      full->flat().numel() == partition_.total,
                  "ZeroAdamW::gather_state: the full moments must be {} [{}], got {}",
                  dtype_name(params.dtype()), partition_.total, full->flat().describe());
  }
  const Device dev = comm_.device();
  for (int which = 0; which < 2; ++which) {
    const model::ParamBuffer& full = which == 0 ? m_full : v_full;
    const Tensor& shard = which == 0 ? m_ : v_;
    if (full.device() == dev) {
      copy_tensor(slice(full.flat(), begin, n), shard.view());
      comm_.all_gather(slice(full.flat(), begin, n), full.flat(), partition_.counts);
    } else {
      Tensor tmp = Tensor::zeros({partition_.total}, params.dtype(), dev);
      copy_tensor(slice(tmp.view(), begin, n), shard.view());
      comm_.all_gather(slice(tmp.view(), begin, n), tmp.view(), partition_.counts);
      copy_tensor(full.flat(), tmp.view());
    }
  }
}

void ZeroAdamW::load_state(const model::ParamBuffer& m_full, const model::ParamBuffer& v_full) {
  const int64_t begin = shard_begin(), n = shard_end() - begin;
  for (const model::ParamBuffer* full : {&m_full, &v_full}) {
    FOURBIT_CHECK(full->dtype() == m_.dtype() && full->flat().numel() == partition_.total,
                  "ZeroAdamW::load_state: the full moments must be {} [{}], got {}",
                  dtype_name(m_.dtype()), partition_.total, full->flat().describe());
  }
  copy_tensor(m_.view(), slice(m_full.flat(), begin, n));
  copy_tensor(v_.view(), slice(v_full.flat(), begin, n));
}

}  // namespace fourbit::dist
