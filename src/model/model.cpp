// Implementation of model.h: construction, parameters, the training forward and backward (every op
// written out in order), and the non-finite checks. The KV-cache forward is in model_cached.cpp.
//
// Residual stream: resid[0] = embedding; per block l
//   ln1 = rmsnorm(resid[l]); qkv = ln1 W_qkv^T; rope(q, k); attn = attention(q, k, v)
//   mid[l] = resid[l] + attn W_out^T
//   ln2 = rmsnorm(mid[l]); resid[l + 1] = mid[l] + ffn(ln2)
// lnf = rmsnorm(resid[L]); logits = lnf W_head^T; losses = cross_entropy(logits, targets).
// The backward walks the same list in reverse with one running gradient d_resid.
//
// Stochastic rounding draws of linear layer (block b, kind k) at training step s come from the
// Philox stream make_stream_id(s, b * 8 + k, 0) + operand (core/rng.h; lm_head is block L), seeded
// with ModelOptions::seed: a step is reproducible, and different steps draw differently.
#include "model/model_internal.h"

#include "core/check.h"
#include "core/device.h"
#include "core/env.h"
#include "core/fill.h"
#include "core/rng.h"
#include "formats/element.h"
#include "model/expert_linear.h"
#include "ops/attention.h"
#include "ops/cross_entropy.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/error_flags.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/swiglu.h"

#include <fmt/format.h>

#if defined(FOURBIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string_view>

namespace fourbit::model {

using recipe::LinearKind;

std::string_view section_name(Section s) {
  switch (s) {
    case Section::kEmbedding: return "embedding";
    case Section::kAttention: return "attention";
    case Section::kMlp: return "mlp";
    case Section::kMoe: return "moe";
    case Section::kLmHead: return "lm_head+loss";
  }
  return "?";
}

std::string_view work_name(Work w) {
  switch (w) {
    case Work::kLinear: return "linear";
    case Work::kAttention: return "attention";
    case Work::kOther: return "other";
  }
  return "?";
}

namespace detail {

TensorView Carver::take(Shape shape, DType dtype, std::string_view name) {
  if (arena_ != nullptr) return arena_->alloc(shape, dtype, name);
  bytes_ = (bytes_ + Arena::kAlignment - 1) / Arena::kAlignment * Arena::kAlignment +
           dtype_bytes(dtype, shape.numel());
  return TensorView::contiguous(nullptr, dtype, shape, device_);
}

ops::MoePlan BlockActs::plan() const { return {offsets, slot_rows, row_slots}; }

void sync_stream(Device device, void* stream) {
#if defined(FOURBIT_WITH_CUDA)
  if (device == Device::kCuda) FOURBIT_CUDA_CHECK(cudaStreamSynchronize((cudaStream_t)stream));
#else
  (void)device;
  (void)stream;
#endif
}

void copy_to_device(const TensorView& dst, const void* host, void* stream) {
  const int64_t bytes = dst.nbytes();
  if (bytes == 0) return;
  if (dst.device == Device::kCpu) {
    std::memcpy(dst.data, host, (size_t)bytes);
    return;
  }
#if defined(FOURBIT_WITH_CUDA)
  FOURBIT_CUDA_CHECK(cudaMemcpyAsync(dst.data, host, (size_t)bytes, cudaMemcpyHostToDevice,
                                     (cudaStream_t)stream));
#else
  (void)stream;
#endif
}

void copy_to_host(void* host, const TensorView& src, void* stream) {
  const int64_t bytes = src.nbytes();
  if (bytes == 0) return;
  if (src.device == Device::kCpu) {
    std::memcpy(host, src.data, (size_t)bytes);
    return;
  }
#if defined(FOURBIT_WITH_CUDA)
  FOURBIT_CUDA_CHECK(cudaMemcpyAsync(host, src.data, (size_t)bytes, cudaMemcpyDeviceToHost,
                                     (cudaStream_t)stream));
  FOURBIT_CUDA_CHECK(cudaStreamSynchronize((cudaStream_t)stream));
#else
  (void)stream;
#endif
}

void gather_rows(const TensorView& dst, const TensorView& src, int64_t src_row0, int64_t src_step,
                 void* stream) {
  const int64_t rows = dst.shape[0], width = dst.shape[1];
  const int64_t row_bytes = dtype_bytes(dst.dtype, width);
  const char* s = static_cast<const char*>(src.data) + src_row0 * row_bytes;
  if (dst.device == Device::kCpu) {
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(static_cast<char*>(dst.data) + r * row_bytes, s + r * src_step * row_bytes,
                  (size_t)row_bytes);
    return;
  }
#if defined(FOURBIT_WITH_CUDA)
  FOURBIT_CUDA_CHECK(cudaMemcpy2DAsync(dst.data, (size_t)row_bytes, s, (size_t)(src_step * row_bytes),
                                       (size_t)row_bytes, (size_t)rows, cudaMemcpyDeviceToDevice,
                                       (cudaStream_t)stream));
#else
  (void)stream;
#endif
}

TensorView qkv_part3(const TensorView& qkv, int64_t col0, int64_t heads, int64_t D) {
  const int64_t W = qkv.shape[1];
  TensorView v;
  v.data = static_cast<char*>(qkv.data) + dtype_bytes(qkv.dtype, col0);
  v.dtype = qkv.dtype;
  v.device = qkv.device;
  v.shape = Shape{qkv.shape[0], heads, D};
  v.strides = Shape{W, D, 1};
  return v;
}

TensorView qkv_part4(const TensorView& qkv, int64_t col0, int64_t heads, int64_t D, int B, int T) {
  const int64_t W = qkv.shape[1];
  TensorView v = qkv_part3(qkv, col0, heads, D);
  v.shape = Shape{B, T, heads, D};
  v.strides = Shape{(int64_t)T * W, W, D, 1};
  return v;
}

}  // namespace detail

using detail::Acts;
using detail::BlockActs;
using detail::Mode;
using detail::Scope;

namespace {

constexpr int kKinds = (int)recipe::kLinearKinds.size();

int tensor_id(int block, LinearKind kind) { return block * kKinds + (int)kind; }

// The host values of a small stat-dtype tensor (f32 or f64).
std::vector<double> host_values(const TensorView& t, void* stream) {
  std::vector<double> v((size_t)t.numel());
  if (t.dtype == DType::kF64) {
    detail::copy_to_host(v.data(), t, stream);
    return v;
  }
  FOURBIT_CHECK(t.dtype == DType::kF32, "model: expected an f32 or f64 statistic, got {}", t.describe());
  std::vector<float> f((size_t)t.numel());
  detail::copy_to_host(f.data(), t, stream);
  for (size_t i = 0; i < f.size(); ++i) v[i] = f[i];
  return v;
}

std::string describe_flag(int bits) {
  std::string s;
  if (bits & ops::kErrNonFinite) s += "a NaN or Inf met by a quantizer or a check; ";
  if (bits & ops::kErrIndexOutOfRange) s += "an index out of range (token id, target or forced expert id); ";
  if (bits & ~(ops::kErrNonFinite | ops::kErrIndexOutOfRange)) s += fmt::format("error bits 0x{:x}; ", bits);
  return s;
}

}  // namespace

// ---- Impl: setup -----------------------------------------------------------------------------------

Model::Impl::Impl(Model& model) : m(model), cfg(model.config_) {
  const ParamTable& t = m.table_;
  embedding = t.index_of("embedding.weight");
  final_norm = t.index_of("final_norm.weight");
  lm_head = cfg.tied_embeddings ? embedding : t.index_of("lm_head.weight");
  for (int l = 0; l < cfg.n_layers; ++l) {
    const std::string p = fmt::format("blocks.{}.", l);
    detail::BlockParams b;
    b.attn_norm = t.index_of(p + "attn_norm.weight");
    b.qkv = t.index_of(p + "attn.qkv.weight");
    b.attn_out = t.index_of(p + "attn.out.weight");
    b.mlp_norm = t.index_of(p + "mlp_norm.weight");
    if (!cfg.is_moe_block(l)) {
      b.mlp_up = t.index_of(p + "mlp.up.weight");
      b.mlp_down = t.index_of(p + "mlp.down.weight");
    } else {
      b.router = t.index_of(p + "moe.router.weight");
      if (cfg.moe.load_balancing == LoadBalancing::kBias) b.router_bias = t.index_of(p + "moe.router.bias");
      b.experts_up = t.index_of(p + "moe.experts.up.weight");
      b.experts_down = t.index_of(p + "moe.experts.down.weight");
      if (cfg.moe.n_shared_experts > 0) {
        b.mlp_up = t.index_of(p + "moe.shared.up.weight");
        b.mlp_down = t.index_of(p + "moe.shared.down.weight");
      }
    }
    bp.push_back(b);
  }
  build_recipes();
  if (m.options_.device == Device::kCuda) {
    error_flag = Tensor::zeros({1}, DType::kI32, Device::kCuda);
    producer_amax = Tensor::zeros({2 * kAmaxSlots}, DType::kF32, Device::kCuda);
  }
}

void Model::Impl::build_recipes() {
  // Every (mode, block, kind) recipe, resolved once.
  const recipe::ResolvedRecipe& r = m.recipe_;
  row_align_max = 8;
  rows_tile_max = 1;
  tokens_tile.fill(1);
  const recipe::ModelShape& shape = r.shape();
  for (int mode = 0; mode < detail::kNumModes; ++mode) {
    std::vector<gemm::LinearRecipe>& v = recipes[(size_t)mode];
    v.assign((size_t)(cfg.n_layers + 1) * kKinds, gemm::LinearRecipe::plain());
    for (int l = 0; l <= cfg.n_layers; ++l) {
      for (LinearKind k : recipe::kLinearKinds) {
        const bool head = k == LinearKind::kLmHead;
        if (head != (l == cfg.n_layers)) continue;
        if (!head && !shape.has(l, k)) continue;
        const int block = head ? 0 : l;
        gemm::LinearRecipe lr;
        switch ((Mode)mode) {
          case Mode::kPretrain: lr = r.pretrain_linear(block, k); break;
          case Mode::kRlTrainer: lr = r.linear(recipe::Stage::kRlTrainer, block, k); break;
          case Mode::kRlSampler: lr = r.linear(recipe::Stage::kRlSampler, block, k); break;
        }
        v[(size_t)tensor_id(l, k)] = lr;
        tokens_tile[(size_t)mode] = std::max(tokens_tile[(size_t)mode], expert_rows_tile(lr));
      }
    }
    int align = 8, tile = 1;
    for (int l : cfg.moe.layers) {
      for (LinearKind k : {LinearKind::kExpertUp, LinearKind::kExpertDown}) {
        const gemm::LinearRecipe& lr = v[(size_t)tensor_id(l, k)];
        align = std::max(align, expert_row_align(lr));
        tile = std::max(tile, expert_rows_tile(lr));
      }
    }
    row_align[(size_t)mode] = align;
    rows_tile[(size_t)mode] = tile;
    row_align_max = std::max(row_align_max, align);
    rows_tile_max = std::max(rows_tile_max, tile);
  }
}

void Model::Impl::bf16(const TensorView& t) const {
  if (!m.options_.cpu_bf16_rounding) return;
  FOURBIT_CHECK(t.dtype == DType::kF32 && t.is_contiguous(), "model: bf16 rounding of {}", t.describe());
  float* x = t.ptr<float>();
  for (int64_t i = 0; i < t.numel(); ++i) x[i] = formats::round_to_bf16(x[i]);
}

int* Model::Impl::flag() const {
  return error_flag.defined() ? error_flag.ptr<int>() : nullptr;
}

const TensorView& Model::Impl::w(int index) const { return m.compute_params().view(index); }
const TensorView& Model::Impl::master(int index) const { return m.params_.view(index); }
bool Model::Impl::take_pending_grad_zero(int index) const {
  if (m.grad_zero_pending_.empty() || !m.grad_zero_pending_[(size_t)index]) return false;
  m.grad_zero_pending_[(size_t)index] = 0;
  return true;
}

const TensorView& Model::Impl::g(int index) const {
  const TensorView& v = m.grads_.view(index);
  if (take_pending_grad_zero(index)) {
    if (v.device == Device::kCpu) {
      fill_bytes(v, 0);
    } else {
      device_fill_async(v.data, 0, v.nbytes(), stream());
    }
  }
  return v;
}

GradOut Model::Impl::grad_out(int index) const {
  return {m.grads_.view(index), take_pending_grad_zero(index) ? 0.0f : 1.0f};
}

void Model::Impl::check_token_tile(int64_t n_tokens, std::string_view where) const {
  const int tile = tokens_tile[(size_t)mode];
  if (m.options_.device != Device::kCuda || n_tokens % tile == 0) return;
  throw Error(fmt::format(
      "{}: the recipe '{}' quantizes activations or gradients, and the CUDA quantize kernels take "
      "whole tiles of {} token rows; this call has {} tokens: use a batch x sequence (or batch x "
      "step tokens) that is a multiple of {}, or a recipe that keeps these layers in BF16",
      where, m.recipe_.recipe().name, tile, n_tokens, tile));
}

void Model::Impl::scope_begin(Section s, Work w) const {
  if (m.profiler_ != nullptr) m.profiler_->begin(s, w);
}
void Model::Impl::scope_end() const {
  if (m.profiler_ != nullptr) m.profiler_->end();
}

void Model::Impl::record(std::string name, const TensorView& t, bool overwritten_by_backward) {
  named.push_back({std::move(name), t, overwritten_by_backward});
}

void Model::Impl::check_error_flag(std::string_view where) {
  if (!error_flag.defined()) return;
  const int bits = ops::read_and_clear_error_flag(flag(), stream());
  if (bits == 0) return;
  throw Error(fmt::format(
      "model {}: a CUDA kernel reported {}run Model::check_activations_finite() / "
      "check_grads_finite() to find the tensor, and check the token ids (< vocab {}) and targets",
      where, describe_flag(bits), cfg.vocab));
}

int64_t Model::Impl::max_perm_rows(int64_t n_tokens) const {
  return ops::moe_permuted_rows(n_tokens, cfg.moe.top_k, cfg.moe.n_experts, row_align_max) +
         rows_tile_max - 1;
}


bool Model::Impl::keeps_wgrad_inputs() const {
  // FOURBIT_KEEP_WGRAD_INPUTS=1: the same for every model of the process (A/B runs of any command;
  // the results are bit for bit the same either way, only memory and time differ).
  static const bool from_env = [] {
    const char* v = std::getenv("FOURBIT_KEEP_WGRAD_INPUTS");
    return v != nullptr && std::string_view(v) == "1";
  }();
  return m.options_.keep_wgrad_inputs || from_env || static_cast<bool>(m.gemm_observer_);
}

bool Model::Impl::fuses_residual_add() const {
  static const int env = env_switch("FOURBIT_FUSE_RESIDUAL");
  const bool fuse = env < 0 ? m.options_.fuse_residual_add : env == 1;
  return fuse && !m.gemm_observer_;
}

bool Model::Impl::fuses_rope_backward() const {
  static const int env = env_switch("FOURBIT_FUSE_ROPE");
  const bool fuse = env < 0 ? m.options_.fuse_rope_backward : env == 1;
  return fuse && !m.options_.cpu_bf16_rounding;
}

bool Model::Impl::recomputes() const {
  static const int env = env_switch("FOURBIT_RECOMPUTE");
  return env < 0 ? m.options_.recompute_activations : env == 1;
}

bool Model::Impl::fuses_loss_gradient() const {
  static const int env = env_switch("FOURBIT_FUSE_LOSS_GRAD");
  return env != 0;
}

std::optional<ops::OutputAmaxes> Model::Impl::producer_amaxes(int block, LinearKind kind, bool dy,
                                                              bool saves_x, bool producer_can) const {
  // FOURBIT_FUSED_AMAX=1 / =0 overrides ModelOptions::fuse_producer_amax (A/B runs of any command).
  static const int env = env_switch("FOURBIT_FUSED_AMAX");
  const bool fuse = env < 0 ? m.options_.fuse_producer_amax : env == 1;
  if (m.options_.device != Device::kCuda || !fuse || !producer_can) return std::nullopt;
  if (keeps_wgrad_inputs()) return std::nullopt;  // the reference path: one pass per GEMM operand
  const gemm::LinearRecipe& r = linear_recipe(block, kind);
  const std::optional<quant::QuantConfig>& cfg = dy ? r.wgrad_dy.quant : r.wgrad_x.quant;
  const bool one_pass = dy ? gemm::dgrad_and_wgrad_dy_share_a_pass(r)
                           : saves_x && gemm::fprop_and_wgrad_x_share_a_pass(r);
  if (!one_pass || !gemm::takes_given_amax(*cfg)) return std::nullopt;
#if defined(FOURBIT_WITH_CUDA)
  float* slot = producer_amax.ptr<float>() + 2 * (dy ? 1 : 0);
  device_fill_async(slot, 0, 2 * sizeof(float), (cudaStream_t)stream());
  ops::OutputAmaxes a;
  a.amax = slot;
  a.rht_amax = cfg->rht ? slot + 1 : nullptr;
  a.rht_sign_mask = cfg->rht_sign_mask();
  a.nonfinite_flag = flag();
  return a;
#else
  return std::nullopt;
#endif
}

gemm::LinearOptions::GivenAmax Model::Impl::given_amax(const std::optional<ops::OutputAmaxes>& a) {
  if (!a) return {};
  return {a->amax, a->rht_amax};
}

bool Model::Impl::saves_quantized_x(Mode plan_mode, int block, LinearKind kind) const {
  if (keeps_wgrad_inputs()) return false;
  if (kind != LinearKind::kQkv && kind != LinearKind::kMlpUp && kind != LinearKind::kMlpDown) return false;
  // MoE blocks: ln2 also feeds the router (and its Wgrad); the shared expert keeps its inputs.
  if (kind != LinearKind::kQkv && cfg.is_moe_block(block)) return false;
  return gemm::wgrad_reads_quantized_x(recipes[(size_t)plan_mode][(size_t)tensor_id(block, kind)]);
}

Acts Model::Impl::plan(detail::Carver& c, int B, int T, bool training, int64_t logits_rows,
                       DType logits_dtype, bool gather_last, Mode plan_mode) const {
  const DType adt = m.act_dtype_, sdt = m.stat_dtype_, i32 = DType::kI32;
  const int64_t N = (int64_t)B * T, C = cfg.d_model, D = cfg.head_dim();
  const int64_t HD = (int64_t)cfg.n_heads * D, QKV = cfg.qkv_dim();
  const bool cuda = m.options_.device == Device::kCuda;
  Acts a;
  a.training = training;
  a.B = B;
  a.T = T;
  a.N = N;
  a.tokens = c.take({N}, i32, "tokens");
  a.targets = c.take({N}, i32, "targets");
  a.positions = c.take({N}, i32, "positions");
  if (!training) a.write_pos = c.take({N}, i32, "kv write positions");
  if (cfg.is_moe()) a.forced = c.take({N, cfg.moe.top_k}, i32, "forced expert ids");
  const int n_resid = training ? cfg.n_layers + 1 : 2;
  for (int i = 0; i < n_resid; ++i) a.resid.push_back(c.take({N, C}, adt, "residual"));
  const int n_blocks = training ? cfg.n_layers : 1;
  const int64_t E = cfg.moe.n_experts, k = cfg.moe.top_k, Fe = cfg.moe.expert_d_ff;
  const int64_t R = cfg.is_moe() ? max_perm_rows(N) : 0;
  int64_t f_max = 0;
  // Per-pass scratch for the Wgrad inputs kept quantized (carved on first need).
  std::optional<TensorView> scratch_ln1, scratch_ln2, scratch_act;
  // Per-pass scratch for what the backward recomputes (recomputes()).
  const bool recompute = training && recomputes();
  std::optional<TensorView> scratch_qkv, scratch_gate_up;
  auto scratch = [&](std::optional<TensorView>& buf, Shape shape, std::string_view name) {
    if (!buf) buf = c.take(shape, adt, name);
    return *buf;
  };
  for (int l = 0; l < n_blocks; ++l) {
    // The KV-cache path reuses one BlockActs for every block: size it for the largest block.
    const bool any_moe = cfg.is_moe();
    const bool any_dense = (int)cfg.moe.layers.size() < cfg.n_layers;
    const bool moe = training ? cfg.is_moe_block(l) : any_moe;
    const bool dense_mlp = training ? !cfg.is_moe_block(l) : any_dense;
    const bool shared = cfg.moe.n_shared_experts > 0 && moe;
    a.mid.push_back(c.take({N, C}, adt, "attention residual"));
    BlockActs b;
    b.save_ln1 = training && saves_quantized_x(plan_mode, l, LinearKind::kQkv);
    b.save_ln2 = training && dense_mlp && saves_quantized_x(plan_mode, l, LinearKind::kMlpUp);
    b.save_act = training && dense_mlp && saves_quantized_x(plan_mode, l, LinearKind::kMlpDown);
    // With recomputation ln1 and a dense block's ln2 are recomputed too (RMSNorm: cheap).
    b.scratch_ln1 = b.save_ln1 || recompute;
    b.scratch_ln2 = b.save_ln2 || (recompute && dense_mlp);
    b.ln1 = b.scratch_ln1 ? scratch(scratch_ln1, {N, C}, "attn_norm out (per-pass scratch)")
                       : c.take({N, C}, adt, "attn_norm out");
    b.ln1_rstd = c.take({N}, sdt, "attn_norm rstd");
    b.qkv = recompute ? scratch(scratch_qkv, {N, QKV}, "qkv (per-pass scratch, recomputed)")
                      : c.take({N, QKV}, adt, "qkv");
    b.attn = c.take({N, HD}, adt, "attention out");
    if (training) b.lse = c.take({B, cfg.n_heads, T}, sdt, "attention lse");
    b.ln2 = b.scratch_ln2 ? scratch(scratch_ln2, {N, C}, "mlp_norm out (per-pass scratch)")
                       : c.take({N, C}, adt, "mlp_norm out");
    b.ln2_rstd = c.take({N}, sdt, "mlp_norm rstd");
    int64_t F = 0;
    if (dense_mlp) F = cfg.d_ff;
    if (shared) F = std::max<int64_t>(F, Fe);
    if (F > 0) {
      // A MoE block's shared expert keeps its own (not recomputed).
      const bool recompute_mlp = recompute && dense_mlp;
      b.gate_up = recompute_mlp ? scratch(scratch_gate_up, {N, 2 * cfg.d_ff}, "mlp gate_up (per-pass scratch, recomputed)")
                                : c.take({N, 2 * F}, adt, "mlp gate_up");
      b.act = b.save_act || recompute_mlp ? scratch(scratch_act, {N, cfg.d_ff}, "mlp act (per-pass scratch)")
                                          : c.take({N, F}, adt, "mlp act");
    }
    f_max = std::max(f_max, F);
    if (moe) {
      b.router_logits = c.take({N, E}, sdt, "router logits");
      b.probs = c.take({N, E}, sdt, "router probs");
      b.expert_ids = c.take({N, k}, i32, "expert ids");
      b.gates = c.take({N, k}, sdt, "gates");
      b.counts = c.take({E}, i32, "expert counts");
      b.router_losses = c.take({2}, sdt, "router losses");
      b.offsets = c.take({E + 1}, i32, "moe offsets");
      b.slot_rows = c.take({N, k}, i32, "moe slot rows");
      b.row_slots = c.take({R}, i32, "moe row slots");
      b.x_perm = c.take({R, C}, adt, "moe x_perm");
      b.h_perm = c.take({R, 2 * Fe}, adt, "moe h_perm");
      b.act_perm = c.take({R, Fe}, adt, "moe act_perm");
      b.y_perm = c.take({R, C}, adt, "moe y_perm");
      if (shared) b.shared_out = c.take({N, C}, adt, "shared expert out");
    }
    a.blocks.push_back(std::move(b));
  }
  if (gather_last) a.last_rows = c.take({B, C}, adt, "last rows");
  a.lnf = c.take({logits_rows, C}, adt, "final_norm out");
  a.lnf_rstd = c.take({logits_rows}, sdt, "final_norm rstd");
  a.logits = c.take({logits_rows, cfg.vocab}, logits_dtype, "logits");
  if (training) {
    a.losses = c.take({N}, sdt, "losses");
    a.mean_loss = c.take({1}, sdt, "mean loss");
    a.lse = c.take({N}, sdt, "logits lse");
    detail::Scratch& s = a.s;
    s.d_resid = c.take({N, C}, adt, "d_resid");
    s.d_tmp = c.take({N, C}, adt, "d_tmp");
    s.d_ln = c.take({N, C}, adt, "d_ln");
    s.d_qkv = c.take({N, QKV}, adt, "d_qkv");
    s.d_attn = c.take({N, HD}, adt, "d_attn");
    if (f_max > 0) s.d_act = c.take({N, f_max}, adt, "d_act");
    if (cfg.is_moe()) {
      s.d_perm_c = c.take({R, C}, adt, "d_perm_c");
      s.d_perm_f = c.take({R, Fe}, adt, "d_perm_f");
      s.d_gates = c.take({N, k}, sdt, "d_gates");
      s.d_logits = c.take({N, E}, sdt, "d_router_logits");
      if (cuda || m.options_.cpu_bf16_rounding) s.d_logits_c = c.take({N, E}, adt, "d_router_logits bf16");
    }
    if (cuda) {
      s.norm_ws = c.take({ops::rmsnorm_backward_workspace_bytes(N, C)}, DType::kU8, "rmsnorm workspace");
      s.emb_ws = c.take({ops::embedding_backward_workspace_bytes(N, cfg.vocab, Device::kCuda)},
                        DType::kU8, "embedding workspace");
    }
  }
  return a;
}

// ---- Impl: linear layers -----------------------------------------------------------------------

const gemm::LinearRecipe& Model::Impl::linear_recipe(int block, LinearKind kind) const {
  const int l = kind == LinearKind::kLmHead ? cfg.n_layers : block;
  return recipes[(size_t)mode][(size_t)tensor_id(l, kind)];
}

gemm::LinearOptions Model::Impl::linear_options(int block, LinearKind kind, const std::string& name) const {
  gemm::LinearOptions o;
  const int l = kind == LinearKind::kLmHead ? cfg.n_layers : block;
  o.sr = RandomStream{m.options_.seed, make_stream_id(step, (uint32_t)tensor_id(l, kind), 0)};
  o.stream = stream();
  o.name = name;
  o.error_flag = flag();
  if (m.options_.device == Device::kCpu) o.backend = m.options_.cpu_gemm_backend;
  return o;
}

namespace {
std::string layer_name(int block, LinearKind kind) {
  return kind == LinearKind::kLmHead ? std::string("lm_head")
                                     : fmt::format("blocks.{}.{}", block, recipe::kind_name(kind));
}
}  // namespace

void Model::Impl::fprop(Section s, int block, LinearKind kind, const TensorView& x,
                        const TensorView& wt, const TensorView& y, bool bf16_output,
                        std::optional<quant::QuantizedTensor>* saved_x,
                        gemm::LinearOptions::GivenAmax x_amax, const TensorView& residual) {
  const gemm::LinearRecipe& r = linear_recipe(block, kind);
  FOURBIT_CHECK(!x_amax.given() || saved_x != nullptr,
                "model: {}'s X amaxes were computed by its producer, but its Fprop keeps no "
                "quantized X (internal error)", layer_name(block, kind));
  if (m.profiler_) {
    LinearCall call{s, recipe::Gemm::kFprop, &r, x.shape[0], wt.shape[0], x.shape[1], 1};
    call.fprop_saves_x = saved_x != nullptr;
    call.source_amax_given = x_amax.given();
    m.profiler_->linear_call(call);
  }
  const std::string name = layer_name(block, kind);
  Scope scope(*this, s, Work::kLinear);
  gemm::LinearOptions o = linear_options(block, kind, name);
  o.source_amax = x_amax;
  o.residual = residual;
  if (saved_x != nullptr) {
    gemm::linear_fprop_saving_x(r, x, wt, y, saved_x->emplace(), o);
  } else {
    gemm::linear_fprop(r, x, wt, y, o);
  }
  if (bf16_output) bf16(y);
  observe(name, recipe::Gemm::kFprop, r, x, wt, y, {}, o.sr);
}

void Model::Impl::dgrad(Section s, int block, LinearKind kind, const TensorView& dy,
                        const TensorView& wt, const TensorView& dx) {
  const gemm::LinearRecipe& r = linear_recipe(block, kind);
  if (m.profiler_) m.profiler_->linear_call({s, recipe::Gemm::kDgrad, &r, dy.shape[0], wt.shape[0], wt.shape[1], 1});
  const std::string name = layer_name(block, kind);
  Scope scope(*this, s, Work::kLinear);
  const gemm::LinearOptions o = linear_options(block, kind, name);
  gemm::linear_dgrad(r, dy, wt, dx, o);
  bf16(dx);
  observe(name, recipe::Gemm::kDgrad, r, dy, wt, dx, {}, o.sr);
}

void Model::Impl::wgrad(Section s, int block, LinearKind kind, const TensorView& dy,
                        const TensorView& x, GradOut dw,
                        std::optional<quant::QuantizedTensor>* saved_x) {
  const gemm::LinearRecipe& r = linear_recipe(block, kind);
  FOURBIT_CHECK(saved_x == nullptr || saved_x->has_value(),
                "model: {}'s Wgrad input was planned as a kept quantized copy, but the forward made "
                "none (internal error)", layer_name(block, kind));
  if (m.profiler_) {
    LinearCall call{s, recipe::Gemm::kWgrad, &r, dy.shape[0], dy.shape[1], x.shape[1], 1};
    call.wgrad_saved_x = saved_x != nullptr && saved_x->has_value();
    m.profiler_->linear_call(call);
  }
  const std::string name = layer_name(block, kind);
  Scope scope(*this, s, Work::kLinear);
  const gemm::LinearOptions o = linear_options(block, kind, name);
  if (saved_x != nullptr && saved_x->has_value()) {
    // No observation: X itself was not kept (saves_quantized_x is false while observed).
    gemm::linear_wgrad_from_saved_x(r, dy, **saved_x, dw.view, dw.beta, o);
    saved_x->reset();
    return;
  }
  gemm::linear_wgrad(r, dy, x, dw.view, dw.beta, o);
  observe(name, recipe::Gemm::kWgrad, r, dy, x, dw.view, {}, o.sr);
}

void Model::Impl::dgrad_wgrad(Section s, int block, LinearKind kind, const TensorView& dy,
                              const TensorView& wt, const TensorView& dx, const TensorView& x,
                              GradOut dw, std::optional<quant::QuantizedTensor>* saved_x,
                              gemm::LinearOptions::GivenAmax dy_amax) {
  if (keeps_wgrad_inputs()) {  // the reference path: one quantization per operand and GEMM
    FOURBIT_CHECK(!dy_amax.given(), "model: {}'s dY amaxes were computed by its producer on the "
                  "reference path (internal error)", layer_name(block, kind));
    dgrad(s, block, kind, dy, wt, dx);
    wgrad(s, block, kind, dy, x, dw, saved_x);
    return;
  }
  const gemm::LinearRecipe& r = linear_recipe(block, kind);
  FOURBIT_CHECK(saved_x == nullptr || saved_x->has_value(),
                "model: {}'s Wgrad input was planned as a kept quantized copy, but the forward made "
                "none (internal error)", layer_name(block, kind));
  const bool saved = saved_x != nullptr;
  if (m.profiler_) {
    const bool one_pass = gemm::dgrad_and_wgrad_dy_share_a_pass(r);
    LinearCall d{s, recipe::Gemm::kDgrad, &r, dy.shape[0], wt.shape[0], wt.shape[1], 1};
    d.dy_one_pass = one_pass;
    d.source_amax_given = dy_amax.given();
    m.profiler_->linear_call(d);
    LinearCall w{s, recipe::Gemm::kWgrad, &r, dy.shape[0], dy.shape[1], wt.shape[1], 1};
    w.dy_one_pass = one_pass;
    w.wgrad_saved_x = saved;
    m.profiler_->linear_call(w);
  }
  const std::string name = layer_name(block, kind);
  Scope scope(*this, s, Work::kLinear);
  gemm::LinearOptions o = linear_options(block, kind, name);
  o.source_amax = dy_amax;
  gemm::linear_dgrad_wgrad(r, dy, wt, dx, x, saved ? &**saved_x : nullptr, dw.view, dw.beta, o);
  bf16(dx);
  if (saved) saved_x->reset();
}

void Model::Impl::observe(std::string_view layer, recipe::Gemm gemm_kind, const gemm::LinearRecipe& r,
                          const TensorView& a, const TensorView& b, const TensorView& out,
                          std::span<const int64_t> group_sizes, RandomStream sr) const {
  if (!m.gemm_observer_) return;
  recipe::Stage stage = recipe::Stage::kRlTrainer;
  if (mode == Mode::kRlSampler) stage = recipe::Stage::kRlSampler;
  if (mode == Mode::kPretrain)
    stage = gemm_kind == recipe::Gemm::kFprop ? recipe::Stage::kPretrainForward : recipe::Stage::kPretrainBackward;
  m.gemm_observer_({layer, stage, gemm_kind, &r, a, b, out, group_sizes, sr});
}

// ---- Impl: the feed-forward half of a block -----------------------------------------------------

namespace {
// A [rows, cols] contiguous view at the start of a (larger) contiguous buffer.
TensorView prefix(const TensorView& buf, int64_t rows, int64_t cols) {
  TensorView v = buf;
  v.shape = Shape{rows, cols};
  v.strides = contiguous_strides(v.shape);
  return v;
}
}  // namespace

void Model::Impl::norm_forward(Section s, int norm, const TensorView& x, const TensorView& y,
                               const TensorView& rstd) {
  Scope sc(*this, s, Work::kOther);
  ops::rmsnorm_forward(y, rstd, x, master(norm), (float)cfg.norm_eps, stream());
  bf16(y);
}

void Model::Impl::qkv_forward(int l, Acts& a, BlockActs& b, std::optional<quant::QuantizedTensor>* saved_x) {
  const int64_t D = cfg.head_dim(), H = cfg.n_heads, Hkv = cfg.n_kv_heads;
  fprop(Section::kAttention, l, LinearKind::kQkv, b.ln1, w(bp[(size_t)l].qkv), b.qkv, true, saved_x);
  Scope s(*this, Section::kAttention, Work::kOther);
  ops::rope_forward_inplace(detail::qkv_part3(b.qkv, 0, H, D), detail::qkv_part3(b.qkv, H * D, Hkv, D), a.positions,
                            (float)cfg.rope_theta, stream());
  bf16(b.qkv);
}

// qkv of block l again, as the forward made it (the same ops on the same inputs: the same bits):
// ln1 from the residual when it lived in per-pass scratch, the qkv GEMM, RoPE.
void Model::Impl::recompute_qkv(int l, Acts& a, BlockActs& b) {
  if (b.scratch_ln1) norm_forward(Section::kAttention, bp[(size_t)l].attn_norm, a.resid[(size_t)l], b.ln1, b.ln1_rstd);
  qkv_forward(l, a, b, nullptr);
}

void Model::Impl::gate_up_forward(int l, Acts& a, BlockActs& b, std::optional<quant::QuantizedTensor>* saved_x,
                                  bool with_act, const std::optional<ops::OutputAmaxes>& act_amax) {
  const int64_t N = a.N, F = cfg.d_ff;
  const TensorView gu = prefix(b.gate_up, N, 2 * F), act = prefix(b.act, N, F);
  fprop(Section::kMlp, l, LinearKind::kMlpUp, b.ln2, w(bp[(size_t)l].mlp_up), gu, true, saved_x);
  if (!with_act) return;
  Scope s(*this, Section::kMlp, Work::kOther);
  ops::swiglu_forward(act, gu, stream(), act_amax ? &*act_amax : nullptr);
  bf16(act);
}

// A dense block's gate_up again (ln2 from mid where it lived in per-pass scratch), and the SwiGLU
// output where the mlp_down Wgrad reads it in BF16.
void Model::Impl::recompute_gate_up(int l, Acts& a, BlockActs& b) {
  if (b.scratch_ln2) norm_forward(Section::kMlp, bp[(size_t)l].mlp_norm, a.mid[(size_t)l], b.ln2, b.ln2_rstd);
  gate_up_forward(l, a, b, nullptr, !b.save_act, std::nullopt);
}

bool Model::Impl::forward_ffn(int l, Acts& a, BlockActs& b, const TensorView& out,
                              const TensorView& forced_host, const TensorView& residual) {
  if (cfg.is_moe_block(l)) {
    // Fusing (a residual given): the shared expert's output is added to the routed experts' in its
    // mlp_down epilogue; the residual itself is added by the caller (the unpermute writes out).
    forward_moe(l, a, b, out, forced_host, residual.data != nullptr);
    return false;
  }
  const detail::BlockParams& p = bp[(size_t)l];
  const int64_t N = a.N, F = cfg.d_ff;
  const TensorView gu = prefix(b.gate_up, N, 2 * F), act = prefix(b.act, N, F);
  const bool save_act = b.save_act && a.for_backward;
  const std::optional<ops::OutputAmaxes> act_amax =
      producer_amaxes(l, LinearKind::kMlpDown, false, save_act, ops::output_amaxes_supported(N, F));
  gate_up_forward(l, a, b, b.save_ln2 && a.for_backward ? &b.saved_ln2 : nullptr, true, act_amax);
  fprop(Section::kMlp, l, LinearKind::kMlpDown, act, w(p.mlp_down), out, true,
        save_act ? &b.saved_act : nullptr, given_amax(act_amax), residual);
  if (a.training && !recomputes()) {  // per-pass scratch when recomputed
    record(fmt::format("blocks.{}.mlp.gate_up", l), gu, true);
    if (!b.save_act) record(fmt::format("blocks.{}.mlp.act", l), act);  // scratch otherwise
  }
  return residual.data != nullptr;
}

void Model::Impl::routed_forward(int l, Acts& a, BlockActs& b, const TensorView& out) {
  const detail::BlockParams& p = bp[(size_t)l];
  const int64_t C = cfg.d_model, E = cfg.moe.n_experts, Fe = cfg.moe.expert_d_ff;
  const std::string up_name = layer_name(l, LinearKind::kExpertUp);
  const std::string down_name = layer_name(l, LinearKind::kExpertDown);
  if (routes_across_ranks(a)) {
    RoutedExperts& ex = *m.routed_experts_;
    const int first = ex.first_local_expert(), n = ex.n_local_experts();
    Scope s(*this, Section::kMoe, Work::kLinear);
    ex.forward(cfg.moe_index(l), b.ln2, b.expert_ids, b.gates, expert_range(w(p.experts_up), first, n),
               expert_range(w(p.experts_down), first, n), out, linear_recipe(l, LinearKind::kExpertUp),
               linear_recipe(l, LinearKind::kExpertDown), linear_options(l, LinearKind::kExpertUp, up_name),
               linear_options(l, LinearKind::kExpertDown, down_name));
    return;
  }
  {
    Scope s(*this, Section::kMoe, Work::kOther);
    b.group_sizes = ops::moe_group_sizes(b.counts_host, row_align[(size_t)mode]);
    b.rows = 0;
    for (int64_t g : b.group_sizes) b.rows += g;
    // The quantize kernels take whole tiles of rows: the last expert's group runs on into the
    // plan's padding rows (zeros, contributing nothing) up to a multiple of the tile.
    const int64_t tile = rows_tile[(size_t)mode];
    const int64_t padded = (b.rows + tile - 1) / tile * tile;
    b.group_sizes.back() += padded - b.rows;
    b.rows = padded;
    ops::moe_plan(b.expert_ids, row_align[(size_t)mode], b.plan(), stream());
    ops::moe_permute(b.ln2, b.plan(), b.x_perm, stream());
  }
  const TensorView x_perm = prefix(b.x_perm, b.rows, C), h_perm = prefix(b.h_perm, b.rows, 2 * Fe);
  const TensorView act_perm = prefix(b.act_perm, b.rows, Fe), y_perm = prefix(b.y_perm, b.rows, C);
  auto expert_call = [&](LinearKind kind, recipe::Gemm gemm_kind, int64_t m_rows, const TensorView& wt) {
    if (m.profiler_) {
      m.profiler_->linear_call({Section::kMoe, gemm_kind, &linear_recipe(l, kind), m_rows, wt.shape[1],
                                wt.shape[2], (int)E});
    }
  };
  expert_call(LinearKind::kExpertUp, recipe::Gemm::kFprop, b.rows, w(p.experts_up));
  {
    Scope s(*this, Section::kMoe, Work::kLinear);
    const gemm::LinearOptions o = linear_options(l, LinearKind::kExpertUp, up_name);
    expert_fprop(linear_recipe(l, LinearKind::kExpertUp), x_perm, w(p.experts_up), b.group_sizes,
                 h_perm, o);
    bf16(h_perm);
    observe(up_name, recipe::Gemm::kFprop, linear_recipe(l, LinearKind::kExpertUp), x_perm,
            w(p.experts_up), h_perm, b.group_sizes, o.sr);
  }
  {
    Scope s(*this, Section::kMoe, Work::kOther);
    ops::swiglu_forward(act_perm, h_perm, stream());
    bf16(act_perm);
  }
  expert_call(LinearKind::kExpertDown, recipe::Gemm::kFprop, b.rows, w(p.experts_down));
  {
    Scope s(*this, Section::kMoe, Work::kLinear);
    const gemm::LinearOptions o = linear_options(l, LinearKind::kExpertDown, down_name);
    expert_fprop(linear_recipe(l, LinearKind::kExpertDown), act_perm, w(p.experts_down),
                 b.group_sizes, y_perm, o);
    bf16(y_perm);
    observe(down_name, recipe::Gemm::kFprop, linear_recipe(l, LinearKind::kExpertDown), act_perm,
            w(p.experts_down), y_perm, b.group_sizes, o.sr);
  }
  {
    Scope s(*this, Section::kMoe, Work::kOther);
    ops::moe_unpermute(b.y_perm, b.gates, b.plan(), out, stream());
    bf16(out);
  }
  if (a.training) {
    const std::string pfx = fmt::format("blocks.{}.moe.", l);
    record(pfx + "x_perm", x_perm);
    record(pfx + "h_perm", h_perm, true);
    record(pfx + "act_perm", act_perm);
    record(pfx + "y_perm", y_perm);
  }
}

void Model::Impl::forward_moe(int l, Acts& a, BlockActs& b, const TensorView& out,
                              const TensorView& forced_host, bool fuse_shared_add) {
  const detail::BlockParams& p = bp[(size_t)l];
  const int mi = cfg.moe_index(l);
  const int64_t N = a.N, E = cfg.moe.n_experts, k = cfg.moe.top_k;
  const int64_t Fe = cfg.moe.expert_d_ff;
  // Router: logits in the stat dtype (FP32 on CUDA), the router's own recipe (BF16 by default).
  fprop(Section::kMoe, l, LinearKind::kRouter, b.ln2, w(p.router), b.router_logits, false);
  {
    Scope s(*this, Section::kMoe, Work::kOther);
    ops::RouterOptions ro;
    ro.top_k = (int)k;
    if (p.router_bias >= 0) ro.selection_bias = master(p.router_bias);
    if (forced_host.data != nullptr) {
      // Host [N, n_moe, k] -> this block's contiguous [N, k].
      std::vector<int32_t> ids((size_t)(N * k));
      const int32_t* src = forced_host.ptr<const int32_t>();
      const int64_t n_moe = cfg.n_moe_layers();
      for (int64_t n = 0; n < N; ++n)
        for (int64_t j = 0; j < k; ++j) ids[(size_t)(n * k + j)] = src[(n * n_moe + mi) * k + j];
      detail::copy_to_device(a.forced, ids.data(), stream());
      ro.forced_ids = a.forced;
      ro.error_flag = flag();
    }
    ops::router_forward(b.router_logits, ro,
                        {b.probs, b.expert_ids, b.gates, b.counts, b.router_losses}, stream());
    // The grouped GEMMs need the group sizes on the host (and the router bias update the counts).
    b.counts_host.resize((size_t)E);
    detail::copy_to_host(b.counts_host.data(), b.counts, stream());
  }
  if (a.training) {
    const std::string pfx = fmt::format("blocks.{}.moe.", l);
    record(pfx + "router_logits", b.router_logits);
    record(pfx + "router_probs", b.probs);
    record(pfx + "gates", b.gates);
  }
  routed_forward(l, a, b, out);
  if (p.mlp_up < 0) return;
  // The shared expert: a dense SwiGLU MLP of hidden size Fe over every token.
  const TensorView gu = prefix(b.gate_up, N, 2 * Fe), act = prefix(b.act, N, Fe);
  fprop(Section::kMoe, l, LinearKind::kMlpUp, b.ln2, w(p.mlp_up), gu);
  {
    Scope s(*this, Section::kMoe, Work::kOther);
    ops::swiglu_forward(act, gu, stream());
    bf16(act);
  }
  if (fuse_shared_add) {
    // out = out + act W_down^T, rounded once (LinearOptions::residual may be the output itself).
    fprop(Section::kMoe, l, LinearKind::kMlpDown, act, w(p.mlp_down), out, true, nullptr, {}, out);
  } else {
    fprop(Section::kMoe, l, LinearKind::kMlpDown, act, w(p.mlp_down), b.shared_out);
    Scope s(*this, Section::kMoe, Work::kOther);
    ops::add_inplace(out, b.shared_out, stream());
    bf16(out);
  }
  if (a.training) {
    record(fmt::format("blocks.{}.moe.shared.gate_up", l), gu, true);
    record(fmt::format("blocks.{}.moe.shared.act", l), act);
    if (!fuse_shared_add) record(fmt::format("blocks.{}.moe.shared.out", l), b.shared_out);
  }
}

void Model::Impl::routed_backward(int l, Acts& a, BlockActs& b) {
  detail::Scratch& s = a.s;
  const detail::BlockParams& p = bp[(size_t)l];
  const int64_t C = cfg.d_model;
  const Section sec = Section::kMoe;
  const std::string up_name = layer_name(l, LinearKind::kExpertUp);
  const std::string down_name = layer_name(l, LinearKind::kExpertDown);
  if (routes_across_ranks(a)) {
    RoutedExperts& ex = *m.routed_experts_;
    const int first = ex.first_local_expert(), n = ex.n_local_experts();
    Scope sc(*this, sec, Work::kLinear);
    ex.backward(cfg.moe_index(l), s.d_resid, s.d_ln, s.d_gates,
                expert_range(g(p.experts_up), first, n), expert_range(g(p.experts_down), first, n),
                linear_options(l, LinearKind::kExpertUp, up_name),
                linear_options(l, LinearKind::kExpertDown, down_name));
    return;
  }
  const int64_t E = cfg.moe.n_experts, Fe = cfg.moe.expert_d_ff;
  const TensorView x_perm = prefix(b.x_perm, b.rows, C), h_perm = prefix(b.h_perm, b.rows, 2 * Fe);
  const TensorView act_perm = prefix(b.act_perm, b.rows, Fe);
  const TensorView d_y_perm = prefix(s.d_perm_c, b.rows, C), d_act_perm = prefix(s.d_perm_f, b.rows, Fe);
  {
    Scope sc(*this, sec, Work::kOther);
    ops::moe_unpermute_backward(s.d_resid, b.y_perm, b.gates, b.plan(), s.d_perm_c, s.d_gates, stream());
    bf16(d_y_perm);
  }
  auto expert_call = [&](LinearKind kind, recipe::Gemm gemm_kind, const TensorView& wt) {
    if (m.profiler_) {
      m.profiler_->linear_call({sec, gemm_kind, &linear_recipe(l, kind), b.rows, wt.shape[1], wt.shape[2], (int)E});
    }
  };
  const gemm::LinearRecipe& r_up = linear_recipe(l, LinearKind::kExpertUp);
  const gemm::LinearRecipe& r_down = linear_recipe(l, LinearKind::kExpertDown);
  expert_call(LinearKind::kExpertDown, recipe::Gemm::kDgrad, w(p.experts_down));
  {
    Scope sc(*this, sec, Work::kLinear);
    const gemm::LinearOptions o = linear_options(l, LinearKind::kExpertDown, down_name);
    expert_dgrad(r_down, d_y_perm, w(p.experts_down), b.group_sizes, d_act_perm, o);
    bf16(d_act_perm);
    observe(down_name, recipe::Gemm::kDgrad, r_down, d_y_perm, w(p.experts_down), d_act_perm,
            b.group_sizes, o.sr);
  }
  expert_call(LinearKind::kExpertDown, recipe::Gemm::kWgrad, w(p.experts_down));
  {
    Scope sc(*this, sec, Work::kLinear);
    const gemm::LinearOptions o = linear_options(l, LinearKind::kExpertDown, down_name);
    expert_wgrad(r_down, d_y_perm, act_perm, b.group_sizes, g(p.experts_down), 1.0f, o);
    observe(down_name, recipe::Gemm::kWgrad, r_down, d_y_perm, act_perm, g(p.experts_down),
            b.group_sizes, o.sr);
  }
  {
    Scope sc(*this, sec, Work::kOther);
    ops::swiglu_backward_inplace(h_perm, d_act_perm, stream());  // h_perm now holds d_h_perm
    bf16(h_perm);
  }
  const TensorView d_x_perm = d_y_perm;  // d_y_perm is no longer needed (rows beyond `rows`
                                         // are padding, never read)
  expert_call(LinearKind::kExpertUp, recipe::Gemm::kDgrad, w(p.experts_up));
  {
    Scope sc(*this, sec, Work::kLinear);
    const gemm::LinearOptions o = linear_options(l, LinearKind::kExpertUp, up_name);
    expert_dgrad(r_up, h_perm, w(p.experts_up), b.group_sizes, d_x_perm, o);
    bf16(d_x_perm);
    observe(up_name, recipe::Gemm::kDgrad, r_up, h_perm, w(p.experts_up), d_x_perm, b.group_sizes,
            o.sr);
  }
  expert_call(LinearKind::kExpertUp, recipe::Gemm::kWgrad, w(p.experts_up));
  {
    Scope sc(*this, sec, Work::kLinear);
    const gemm::LinearOptions o = linear_options(l, LinearKind::kExpertUp, up_name);
    expert_wgrad(r_up, h_perm, x_perm, b.group_sizes, g(p.experts_up), 1.0f, o);
    observe(up_name, recipe::Gemm::kWgrad, r_up, h_perm, x_perm, g(p.experts_up), b.group_sizes,
            o.sr);
  }
  {
    Scope sc(*this, sec, Work::kOther);
    ops::moe_permute_backward(s.d_perm_c, b.plan(), s.d_ln, stream());
    bf16(s.d_ln);
  }
}

void Model::Impl::backward_ffn(int l, Acts& a, BlockActs& b, double loss_scale,
                               gemm::LinearOptions::GivenAmax d_resid_amax) {
  detail::Scratch& s = a.s;
  const detail::BlockParams& p = bp[(size_t)l];
  const int64_t N = a.N;
  const Section sec = cfg.is_moe_block(l) ? Section::kMoe : Section::kMlp;
  // d_ln accumulates d ln2 from every consumer of ln2; dense: the MLP only.
  if (!cfg.is_moe_block(l)) {
    const int64_t F = cfg.d_ff;
    if (recomputes()) recompute_gate_up(l, a, b);
    const TensorView gu = prefix(b.gate_up, N, 2 * F), act = prefix(b.act, N, F);
    const TensorView d_act = prefix(s.d_act, N, F);
    dgrad_wgrad(sec, l, LinearKind::kMlpDown, s.d_resid, w(p.mlp_down), d_act, act, grad_out(p.mlp_down),
                b.save_act ? &b.saved_act : nullptr, d_resid_amax);
    const std::optional<ops::OutputAmaxes> d_gu_amax =
        producer_amaxes(l, LinearKind::kMlpUp, true, false, ops::output_amaxes_supported(N, F));
    {
      Scope sc(*this, sec, Work::kOther);
      // gu now holds d_gate_up
      ops::swiglu_backward_inplace(gu, d_act, stream(), d_gu_amax ? &*d_gu_amax : nullptr);
      bf16(gu);
    }
    dgrad_wgrad(sec, l, LinearKind::kMlpUp, gu, w(p.mlp_up), s.d_ln, b.ln2, grad_out(p.mlp_up),
                b.save_ln2 ? &b.saved_ln2 : nullptr, given_amax(d_gu_amax));
    return;
  }
  routed_backward(l, a, b);
  {
    Scope sc(*this, sec, Work::kOther);
    // Router: the gates' gradient plus the load-balancing losses'.
    const double n_moe = cfg.n_moe_layers();
    ops::RouterLossGrads lg;
    if (cfg.moe.load_balancing == LoadBalancing::kAuxLoss)
      lg.aux = (float)(loss_scale * cfg.moe.aux_loss_coef / n_moe);
    lg.z = (float)(loss_scale * cfg.moe.z_loss_coef / n_moe);
    ops::router_backward({b.router_logits, b.probs, b.expert_ids, b.counts}, s.d_gates, lg,
                         s.d_logits, stream());
    if (s.d_logits_c.data != nullptr) {  // the router GEMMs' bf16 operand (CUDA, or emulated)
      if (s.d_logits_c.dtype == DType::kBF16) {
        ops::cast(s.d_logits_c, s.d_logits, stream());
      } else {
        copy_tensor(s.d_logits_c, s.d_logits);
        bf16(s.d_logits_c);
      }
    }
  }
  const TensorView d_logits = s.d_logits_c.data != nullptr ? s.d_logits_c : s.d_logits;
  dgrad_wgrad(sec, l, LinearKind::kRouter, d_logits, w(p.router), s.d_tmp, b.ln2, grad_out(p.router));
  {
    Scope sc(*this, sec, Work::kOther);
    ops::add_inplace(s.d_ln, s.d_tmp, stream());
    bf16(s.d_ln);
  }
  if (p.mlp_up < 0) return;
  // The shared expert.
  const int64_t Fe = cfg.moe.expert_d_ff;
  const TensorView gu = prefix(b.gate_up, N, 2 * Fe), act = prefix(b.act, N, Fe);
  const TensorView d_act = prefix(s.d_act, N, Fe);
  dgrad_wgrad(sec, l, LinearKind::kMlpDown, s.d_resid, w(p.mlp_down), d_act, act, grad_out(p.mlp_down));
  {
    Scope sc(*this, sec, Work::kOther);
    ops::swiglu_backward_inplace(gu, d_act, stream());
    bf16(gu);
  }
  dgrad_wgrad(sec, l, LinearKind::kMlpUp, gu, w(p.mlp_up), s.d_tmp, b.ln2, grad_out(p.mlp_up));
  {
    Scope sc(*this, sec, Work::kOther);
    ops::add_inplace(s.d_ln, s.d_tmp, stream());
    bf16(s.d_ln);
  }
}

// ---- Model -------------------------------------------------------------------------------------

Model::Model(ModelConfig config, recipe::ResolvedRecipe resolved, const ModelOptions& options)
    : config_(std::move(config)), recipe_(std::move(resolved)), options_(options),
      table_(ParamTable::build(config_)) {
  const bool cuda = options_.device == Device::kCuda;
  FOURBIT_CHECK(options_.max_batch >= 1, "model '{}': max_batch must be >= 1, got {}", config_.name,
                options_.max_batch);
  max_seq_ = options_.max_seq == 0 ? config_.max_seq : options_.max_seq;
  FOURBIT_CHECK(max_seq_ >= 1 && max_seq_ <= config_.max_seq,
                "model '{}': max_seq {} must lie in [1, config.max_seq = {}]", config_.name, max_seq_,
                config_.max_seq);
  if (cuda) {
    FOURBIT_CHECK(built_with_cuda() && cuda_device_count() > 0,
                  "model '{}' on cuda: {}; use device cpu", config_.name,
                  built_with_cuda() ? "no CUDA GPU is visible" : "this binary was built without CUDA");
    FOURBIT_CHECK(config_.head_dim() == 64 || config_.head_dim() == 128,
                  "model '{}': head_dim = d_model / n_heads = {}; the CUDA attention kernels take 64 "
                  "or 128 (change n_heads)", config_.name, config_.head_dim());
    act_dtype_ = DType::kBF16;
    stat_dtype_ = DType::kF32;
  } else {
    FOURBIT_CHECK(options_.cpu_dtype == DType::kF32 || options_.cpu_dtype == DType::kF64,
                  "model '{}' on the CPU: cpu_dtype must be f32 or f64, got {}", config_.name,
                  dtype_name(options_.cpu_dtype));
    act_dtype_ = stat_dtype_ = options_.cpu_dtype;
  }
  FOURBIT_CHECK(!options_.cpu_bf16_rounding || (!cuda && options_.cpu_dtype == DType::kF32),
                "model '{}': cpu_bf16_rounding needs device cpu and cpu_dtype f32", config_.name);
  const DType master = cuda ? DType::kF32 : options_.cpu_dtype;
  params_ = ParamBuffer(table_, master, options_.device);
  init_params(table_, params_, options_.seed);
  grads_ = ParamBuffer(table_, master, options_.device);
  check_recipe_shape();
  impl_ = std::make_unique<Impl>(*this);
  if (cuda) compute_ = ParamBuffer(table_, DType::kBF16, Device::kCuda);
  if (options_.cpu_bf16_rounding) compute_ = ParamBuffer(table_, DType::kF32, Device::kCpu);
  params_changed();
  size_arena();
  counts_host_.resize((size_t)config_.n_moe_layers());
}

void Model::check_recipe_shape() const {
  FOURBIT_CHECK(recipe_.shape() == config_.recipe_shape(),
                "model '{}': the recipe '{}' was resolved for another model shape ({} blocks, MoE "
                "blocks [{}]); resolve it with config.recipe_shape()",
                config_.name, recipe_.recipe().name, recipe_.shape().n_layers,
                fmt::join(recipe_.shape().moe_blocks, ", "));
}

bool Model::size_arena() {
  // A training forward plans under the pretrain or the rl_trainer recipes: room for either.
  int64_t bytes = 0;
  for (Mode plan_mode : {Mode::kPretrain, Mode::kRlTrainer}) {
    detail::Carver counter(nullptr, options_.device);
    impl_->plan(counter, options_.max_batch, max_seq_, true, (int64_t)options_.max_batch * max_seq_,
                act_dtype_, false, plan_mode);
    bytes = std::max(bytes, counter.bytes());
  }
  // Exactly that size: a recipe that keeps less (quantized Wgrad inputs) gives memory back.
  if (arena_ && arena_->capacity() == bytes) return false;
  arena_.reset();  // the old arena's memory is free for the new one
  arena_ = std::make_unique<Arena>(bytes, options_.device);
  return true;
}

void Model::set_recipe(recipe::ResolvedRecipe resolved) {
  recipe::ResolvedRecipe previous = std::move(recipe_);
  recipe_ = std::move(resolved);
  try {
    check_recipe_shape();
  } catch (...) {
    recipe_ = std::move(previous);
    throw;
  }
  impl_->build_recipes();
  impl_->have_forward = false;
  size_arena();
}

Model::~Model() = default;

void Model::zero_grads() {
  // FOURBIT_LAZY_ZERO_GRADS=0 (A/B runs): the fill here, every writer accumulating, as before.
  static const int lazy = env_switch("FOURBIT_LAZY_ZERO_GRADS");
  grad_zero_pending_.assign((size_t)table_.size(), 1);
  if (lazy == 0) write_pending_grad_zeros();
}

void Model::write_pending_grad_zeros() const {
  const auto pending = [](char p) { return p != 0; };
  if (std::none_of(grad_zero_pending_.begin(), grad_zero_pending_.end(), pending)) return;
  if (std::all_of(grad_zero_pending_.begin(), grad_zero_pending_.end(), pending)) {
    fill_bytes(grads_.flat(), 0);  // one fill (the padding between parameters is zero already)
  } else {
    for (size_t i = 0; i < grad_zero_pending_.size(); ++i)
      if (grad_zero_pending_[i]) fill_bytes(grads_.view((int)i), 0);
  }
  grad_zero_pending_.assign(grad_zero_pending_.size(), 0);
}

void Model::params_changed() {
  if (!compute_.defined()) return;
  if (compute_.dtype() == DType::kBF16) {
    ops::cast(compute_.flat(), params_.flat(), options_.stream);
    return;
  }
  // CPU with bf16 rounding: the GEMM weights are the master weights rounded to bf16, in f32.
  copy_tensor(compute_.flat(), params_.flat());
  impl_->bf16(compute_.flat());
}

int64_t Model::activation_bytes() const { return arena_->capacity(); }
int64_t Model::activation_peak_bytes() const { return arena_->peak(); }

bool Model::fuses_residual_add() const { return impl_->fuses_residual_add(); }

int64_t Model::saved_wgrad_input_bytes() const {
  if (!impl_->have_forward) return 0;
  int64_t bytes = 0;
  for (const BlockActs& b : impl_->acts.blocks)
    for (const std::optional<quant::QuantizedTensor>* q : {&b.saved_ln1, &b.saved_ln2, &b.saved_act})
      if (q->has_value()) bytes += gemm::quantized_bytes(**q);
  return bytes;
}

void Model::set_gemm_observer(GemmObserver observer) {
  FOURBIT_CHECK(!observer || routed_experts_ == nullptr,
                "model '{}': a GEMM observer (the precision audit) cannot watch an expert-parallel "
                "model: its routed experts run on other ranks; detach the expert parallelism "
                "(set_routed_experts(nullptr)) or audit a one-rank run",
                config_.name);
  gemm_observer_ = std::move(observer);
  // An observed training forward keeps every Wgrad input (saves_quantized_x): another arena size.
  // A new arena drops the last forward's activations.
  if (size_arena()) impl_->have_forward = false;
}

void Model::set_routed_experts(RoutedExperts* experts) {
  if (experts != nullptr) {
    FOURBIT_CHECK(config_.is_moe(),
                  "model '{}': expert parallelism needs an MoE model (moe.layers and moe.n_experts "
                  "set); this one is dense",
                  config_.name);
    const int first = experts->first_local_expert(), n = experts->n_local_experts();
    FOURBIT_CHECK(first >= 0 && n >= 1 && first + n <= config_.moe.n_experts,
                  "model '{}': expert parallelism gives this rank experts [{}, {}), outside the "
                  "model's {} experts",
                  config_.name, first, first + n, config_.moe.n_experts);
    FOURBIT_CHECK(!gemm_observer_,
                  "model '{}': expert parallelism cannot run under a GEMM observer (the precision "
                  "audit); detach it first",
                  config_.name);
    FOURBIT_CHECK(!options_.cpu_bf16_rounding,
                  "model '{}': expert parallelism does not emulate cpu_bf16_rounding; train it "
                  "without that option",
                  config_.name);
  }
  routed_experts_ = experts;
  impl_->have_forward = false;  // a backward must follow a forward of the same kind
}

TensorView Model::logits() const {
  FOURBIT_CHECK(impl_->have_forward && !impl_->backward_done,
                "Model::logits: no forward since the last backward (backward overwrites the logits "
                "with their gradient); run forward first");
  return impl_->acts.logits;
}

TensorView Model::token_losses() const {
  FOURBIT_CHECK(impl_->have_forward, "Model::token_losses: run forward first");
  return impl_->acts.losses;
}

void Model::expert_ids(const TensorView& out) const {
  const Impl& im = *impl_;
  FOURBIT_CHECK(im.have_forward, "Model::expert_ids: run forward first");
  const int64_t N = im.acts.N, k = config_.moe.top_k, n_moe = config_.n_moe_layers();
  FOURBIT_CHECK(out.device == Device::kCpu && out.dtype == DType::kI32 && out.is_contiguous() &&
                    out.numel() == N * n_moe * k,
                "Model::expert_ids: out must be a contiguous host i32 [{}, {}, {}], got {}", N, n_moe,
                k, out.describe());
  std::vector<int32_t> ids((size_t)(N * k));
  for (int mi = 0; mi < n_moe; ++mi) {
    const BlockActs& b = im.acts.blocks[(size_t)config_.moe.layers[(size_t)mi]];
    detail::copy_to_host(ids.data(), b.expert_ids, options_.stream);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < k; ++j) out.ptr<int32_t>()[(n * n_moe + mi) * k + j] = ids[(size_t)(n * k + j)];
  }
}

void Model::update_router_bias() {
  if (config_.moe.load_balancing != LoadBalancing::kBias || !config_.is_moe()) return;
  FOURBIT_CHECK(impl_->have_forward, "Model::update_router_bias: run a forward first");
  const int E = config_.moe.n_experts;
  for (int mi = 0; mi < config_.n_moe_layers(); ++mi) {
    const int l = config_.moe.layers[(size_t)mi];
    const TensorView bias = params_.view(impl_->bp[(size_t)l].router_bias);
    const std::vector<int32_t>& counts = counts_host_[(size_t)mi];
    double mean = 0;
    for (int32_t c : counts) mean += c;
    mean /= E;
    std::vector<double> b = host_values(bias, options_.stream);
    for (int e = 0; e < E; ++e) {
      const double d = mean - counts[(size_t)e];
      b[(size_t)e] += config_.moe.bias_update_rate * (d > 0 ? 1.0 : d < 0 ? -1.0 : 0.0);
    }
    if (bias.dtype == DType::kF64) {
      detail::copy_to_device(bias, b.data(), options_.stream);
    } else {
      std::vector<float> f(b.begin(), b.end());
      detail::copy_to_device(bias, f.data(), options_.stream);
    }
  }
  detail::sync_stream(options_.device, options_.stream);  // the host vectors die here
}

// ---- training forward ------------------------------------------------------------------------

LossInfo Model::forward(const TensorView& tokens, const TensorView& targets, const ForwardOptions& o) {
  Impl& im = *impl_;
  const ModelConfig& c = config_;
  FOURBIT_CHECK(tokens.device == Device::kCpu && tokens.dtype == DType::kI32 && tokens.shape.ndim == 2 &&
                    tokens.is_contiguous(),
                "Model::forward: tokens must be a contiguous host i32 [B, T], got {}", tokens.describe());
  FOURBIT_CHECK(targets.device == Device::kCpu && targets.dtype == DType::kI32 &&
                    targets.shape == tokens.shape && targets.is_contiguous(),
                "Model::forward: targets must be a contiguous host i32 {} like tokens, got {}",
                tokens.shape.str(), targets.describe());
  const int B = (int)tokens.shape[0], T = (int)tokens.shape[1];
  FOURBIT_CHECK(B >= 1 && B <= options_.max_batch && T >= 1 && T <= max_seq_,
                "Model::forward: batch [{}, {}] exceeds the model's max_batch {} x max_seq {} (set "
                "ModelOptions::max_batch / max_seq)", B, T, options_.max_batch, max_seq_);
  const int64_t N = (int64_t)B * T;
  int64_t n_valid = 0;
  for (int64_t i = 0; i < N; ++i) {
    const int32_t id = tokens.ptr<const int32_t>()[i], tg = targets.ptr<const int32_t>()[i];
    FOURBIT_CHECK(id >= 0 && id < c.vocab, "Model::forward: token [{}, {}] = {} lies outside [0, {})",
                  i / T, i % T, id, c.vocab);
    FOURBIT_CHECK(tg == -1 || (tg >= 0 && tg < c.vocab),
                  "Model::forward: target [{}, {}] = {} must be -1 (ignored) or in [0, {})", i / T,
                  i % T, tg, c.vocab);
    n_valid += tg >= 0;
  }
  if (o.forced_expert_ids.data != nullptr) {
    FOURBIT_CHECK(c.is_moe(), "Model::forward: forced_expert_ids given to a dense model");
    FOURBIT_CHECK(o.forced_expert_ids.device == Device::kCpu && o.forced_expert_ids.dtype == DType::kI32 &&
                      o.forced_expert_ids.is_contiguous() &&
                      o.forced_expert_ids.numel() == N * c.n_moe_layers() * c.moe.top_k,
                  "Model::forward: forced_expert_ids must be a contiguous host i32 [{}, {}, {}], got {}",
                  N, c.n_moe_layers(), c.moe.top_k, o.forced_expert_ids.describe());
  }
  im.mode = o.stage == TrainingStage::kPretrain ? Mode::kPretrain : Mode::kRlTrainer;
  im.step = o.step;
  if (o.loss_gradient_scale) {
    FOURBIT_CHECK(o.for_backward, "Model::forward: ForwardOptions::loss_gradient_scale promises a backward; "
                  "it cannot go with for_backward = false");
    FOURBIT_CHECK(std::isfinite(*o.loss_gradient_scale), "Model::forward: ForwardOptions::loss_gradient_scale "
                  "must be finite, got {}", *o.loss_gradient_scale);
  }
  im.n_valid = n_valid;
  im.check_token_tile(N, "Model::forward");
  im.have_forward = false;
  im.backward_done = false;
  im.promised_loss_scale = o.loss_gradient_scale;
  im.named.clear();

  arena_->reset();
  detail::Carver carver(arena_.get(), options_.device);
  im.acts = im.plan(carver, B, T, true, N, act_dtype_, false, im.mode);
  Acts& a = im.acts;
  a.for_backward = o.for_backward;
  void* st = options_.stream;

  detail::copy_to_device(a.tokens, tokens.data, st);
  detail::copy_to_device(a.targets, targets.data, st);
  {
    std::vector<int32_t> pos((size_t)N);
    for (int64_t i = 0; i < N; ++i) pos[(size_t)i] = (int32_t)(i % T);
    detail::copy_to_device(a.positions, pos.data(), st);
    detail::sync_stream(options_.device, st);
  }
  {
    Scope s(im, Section::kEmbedding, Work::kOther);
    ops::embedding_forward(a.resid[0], a.tokens, im.master(im.embedding), im.flag(), st);
    im.bf16(a.resid[0]);
  }
  im.record("embedding", a.resid[0]);

  const int64_t D = c.head_dim(), H = c.n_heads, Hkv = c.n_kv_heads;
  for (int l = 0; l < c.n_layers; ++l) {
    const detail::BlockParams& p = im.bp[(size_t)l];
    BlockActs& b = a.blocks[(size_t)l];
    const std::string pfx = fmt::format("blocks.{}.", l);
    im.norm_forward(Section::kAttention, p.attn_norm, a.resid[(size_t)l], b.ln1, b.ln1_rstd);
    im.qkv_forward(l, a, b, b.save_ln1 && a.for_backward ? &b.saved_ln1 : nullptr);
    {
      Scope s(im, Section::kAttention, Work::kAttention);
      TensorView out4 = b.attn;
      out4.shape = Shape{B, T, H, D};
      out4.strides = contiguous_strides(out4.shape);
      ops::attention_forward(detail::qkv_part4(b.qkv, 0, H, D, B, T),
                             detail::qkv_part4(b.qkv, H * D, Hkv, D, B, T),
                             detail::qkv_part4(b.qkv, (H + Hkv) * D, Hkv, D, B, T), out4, b.lse, {}, st);
      im.bf16(b.attn);
    }
    const TensorView mid = a.mid[(size_t)l];
    // mid = resid[l] + attn_out(attn), the add in the GEMM's epilogue or after it.
    const bool fuse_residual = im.fuses_residual_add();
    if (fuse_residual) {
      im.fprop(Section::kAttention, l, LinearKind::kAttnOut, b.attn, im.w(p.attn_out), mid, true,
               nullptr, {}, a.resid[(size_t)l]);
    } else {
      im.fprop(Section::kAttention, l, LinearKind::kAttnOut, b.attn, im.w(p.attn_out), mid);
      Scope s(im, Section::kAttention, Work::kOther);
      ops::add_inplace(mid, a.resid[(size_t)l], st);
      im.bf16(mid);
    }
    const Section ffn = c.is_moe_block(l) ? Section::kMoe : Section::kMlp;
    im.norm_forward(ffn, p.mlp_norm, mid, b.ln2, b.ln2_rstd);
    // ln1 / ln2 in per-pass scratch (their Wgrad copies kept quantized) are not kept: not named.
    if (!b.scratch_ln1) im.record(pfx + "attn_norm", b.ln1);
    if (!im.recomputes()) im.record(pfx + "attn.qkv", b.qkv);  // per-pass scratch otherwise
    im.record(pfx + "attn.out", b.attn);
    im.record(pfx + "attn.residual", mid);
    if (!b.scratch_ln2) im.record(pfx + "mlp_norm", b.ln2);
    const TensorView out = a.resid[(size_t)l + 1];
    // out = mid + ffn(ln2): a dense block adds mid in mlp_down's epilogue when fusing.
    if (!im.forward_ffn(l, a, b, out, o.forced_expert_ids, fuse_residual ? mid : TensorView{})) {
      Scope s(im, ffn, Work::kOther);
      ops::add_inplace(out, mid, st);
      im.bf16(out);
    }
    im.record(pfx + "output", out);
  }
  im.norm_forward(Section::kLmHead, im.final_norm, a.resid[(size_t)c.n_layers], a.lnf, a.lnf_rstd);
  im.fprop(Section::kLmHead, c.n_layers, LinearKind::kLmHead, a.lnf, im.w(im.lm_head), a.logits);
  {
    Scope s(im, Section::kLmHead, Work::kOther);
    if (im.logits_hold_gradient()) {
      // The backward's loss gradient now, over the logits (ForwardOptions::loss_gradient_scale):
      // the same bits as the saved-lse path below followed by the backward's pass.
      const double scale = n_valid > 0 ? *o.loss_gradient_scale / (double)n_valid : 0.0;
      ops::cross_entropy_forward_backward_inplace(a.logits, a.losses, a.mean_loss, a.targets, (float)scale,
                                                  im.flag(), st, options_.cross_entropy_exp);
      im.bf16(a.logits);
    } else {
      // The lse of every row is kept for the backward's one-pass gradient (no second softmax).
      ops::cross_entropy_forward_saving_lse(a.losses, a.mean_loss, a.lse, a.logits, a.targets, im.flag(), st,
                                            options_.cross_entropy_exp);
    }
  }
  im.record("final_norm", a.lnf);
  im.record(im.logits_hold_gradient() ? "logits (now their gradient: ForwardOptions::loss_gradient_scale)" : "logits",
            a.logits, true);

  LossInfo info;
  info.n_valid = n_valid;
  info.ce = host_values(a.mean_loss, st)[0];
  im.router_losses.assign((size_t)c.n_moe_layers(), {0.0, 0.0});
  for (int mi = 0; mi < c.n_moe_layers(); ++mi) {
    const BlockActs& b = a.blocks[(size_t)c.moe.layers[(size_t)mi]];
    const std::vector<double> v = host_values(b.router_losses, st);
    im.router_losses[(size_t)mi] = {v[0], v[1]};
    info.aux += v[0] / c.n_moe_layers();
    info.z += v[1] / c.n_moe_layers();
    counts_host_[(size_t)mi] = b.counts_host;
  }
  info.loss = info.ce + c.moe.z_loss_coef * info.z;
  if (c.moe.load_balancing == LoadBalancing::kAuxLoss) info.loss += c.moe.aux_loss_coef * info.aux;
  im.have_forward = true;
  im.check_error_flag("forward");
  if (o.check_finite && !std::isfinite(info.loss)) {
    check_activations_finite();
    throw Error(fmt::format("model forward: the loss is {} (ce {}, aux {}, z {}) although every "
                            "activation is finite", info.loss, info.ce, info.aux, info.z));
  }
  return info;
}

// ---- training backward -----------------------------------------------------------------------

void Model::backward(const BackwardOptions& o) {
  Impl& im = *impl_;
  FOURBIT_CHECK(im.have_forward && !im.backward_done,
                "Model::backward: needs a forward first (and one backward per forward)");
  FOURBIT_CHECK(im.acts.for_backward,
                "Model::backward: the last forward ran with ForwardOptions::for_backward = false "
                "(evaluation: it kept nothing for a backward); run the forward again without it");
  const ModelConfig& c = config_;
  Acts& a = im.acts;
  detail::Scratch& s = a.s;
  void* st = options_.stream;
  const int64_t D = c.head_dim(), H = c.n_heads, Hkv = c.n_kv_heads;
  const float theta = (float)c.rope_theta;
  const int L = c.n_layers;
  const int64_t N = a.N, C = c.d_model;
  if (im.promised_loss_scale) {
    FOURBIT_CHECK(o.token_weights.data == nullptr && o.loss_scale == *im.promised_loss_scale,
                  "Model::backward: the forward was given ForwardOptions::loss_gradient_scale = {} (it may "
                  "have written the loss gradient already), so the backward must get loss_scale = {} and no "
                  "token_weights; got loss_scale = {}{}", *im.promised_loss_scale, *im.promised_loss_scale,
                  o.loss_scale, o.token_weights.data ? " and token_weights" : "");
  }
  im.backward_done = true;

  // LM head and loss: dlogits over the logits (unless the forward wrote them), then the final norm.
  if (!im.logits_hold_gradient()) {
    Scope sc(im, Section::kLmHead, Work::kOther);
    if (o.token_weights.data != nullptr) {
      // Per-token weights (RL): copied next to the losses, in the stat dtype.
      const int64_t N = a.losses.numel();
      FOURBIT_CHECK(o.token_weights.device == Device::kCpu && o.token_weights.dtype == DType::kF32 &&
                        o.token_weights.is_contiguous() && o.token_weights.numel() == N,
                    "Model::backward: token_weights must be a contiguous host f32 [{}] (B*T of the "
                    "last forward), got {}", N, o.token_weights.describe());
      std::vector<double> w64;
      const void* host = o.token_weights.data;
      if (stat_dtype_ == DType::kF64) {
        const float* w = o.token_weights.ptr<const float>();
        w64.assign(w, w + N);
        host = w64.data();
      }
      Tensor weights = Tensor::empty({N}, stat_dtype_, options_.device);
      detail::copy_to_device(weights.view(), host, st);
      ops::cross_entropy_backward_inplace_from_lse(a.logits, a.lse, a.targets, (float)o.loss_scale,
                                                   weights.view(), im.flag(), st, options_.cross_entropy_exp);
      detail::sync_stream(options_.device, st);  // `weights` dies here
    } else {
      const double scale = im.n_valid > 0 ? o.loss_scale / (double)im.n_valid : 0.0;
      ops::cross_entropy_backward_inplace_from_lse(a.logits, a.lse, a.targets, (float)scale,
                                                   TensorView{}, im.flag(), st, options_.cross_entropy_exp);
    }
    im.bf16(a.logits);
  }
  im.dgrad_wgrad(Section::kLmHead, L, LinearKind::kLmHead, a.logits, im.w(im.lm_head), s.d_ln, a.lnf,
                 im.grad_out(im.lm_head));
  {
    Scope sc(im, Section::kLmHead, Work::kOther);
    ops::rmsnorm_backward(s.d_resid, im.g(im.final_norm), s.d_ln, a.resid[(size_t)L],
                          im.master(im.final_norm), a.lnf_rstd, s.norm_ws, st);
    im.bf16(s.d_resid);
  }

  gemm::LinearOptions::GivenAmax d_resid_amax;  // of d resid[l + 1], from block l + 1's last add
  // The residual gradient takes each block norm's input gradient inside the RMSNorm backward
  // (rmsnorm_backward_accumulate: bit for bit the backward plus add_inplace, the next dY's amaxes
  // included where its kernel can compute them) unless the CPU's bf16 rounding mode rounds
  // between the two.
  const bool accumulate_norm_grads = im.fuses_residual_add() && !im.m.options_.cpu_bf16_rounding;
  const bool accumulate_with_amaxes = ops::rmsnorm_backward_accumulate_amaxes_supported(N, C);
  // RoPE's backward inside the attention backward (ModelOptions::fuse_rope_backward).
  const bool fuse_rope = im.fuses_rope_backward();
  ops::AttentionOptions attn_options;
  if (fuse_rope) attn_options.rope_backward = ops::AttentionOptions::RopeBackward{a.positions, theta};
  // d_resid += the input gradient of the block norm with weight `norm` over x (its rstd); with
  // `amax`, the add also computes the amaxes of the new d_resid for the next dY's quantizer.
  auto add_norm_backward = [&](int norm, const TensorView& x, const TensorView& rstd,
                               const std::optional<ops::OutputAmaxes>& amax) {
    if (accumulate_norm_grads && (!amax || accumulate_with_amaxes)) {
      ops::rmsnorm_backward_accumulate(s.d_resid, im.g(norm), s.d_ln, x, im.master(norm), rstd, s.norm_ws, st,
                                       amax ? &*amax : nullptr);
      return;
    }
    ops::rmsnorm_backward(s.d_tmp, im.g(norm), s.d_ln, x, im.master(norm), rstd, s.norm_ws, st);
    im.bf16(s.d_tmp);
    ops::add_inplace(s.d_resid, s.d_tmp, st, amax ? &*amax : nullptr);
    im.bf16(s.d_resid);
  };
  for (int l = L - 1; l >= 0; --l) {
    const detail::BlockParams& p = im.bp[(size_t)l];
    BlockActs& b = a.blocks[(size_t)l];
    const Section ffn = c.is_moe_block(l) ? Section::kMoe : Section::kMlp;
    // Feed-forward half: d_resid is d resid[l + 1]; the branch's gradient lands in d_ln.
    im.backward_ffn(l, a, b, o.loss_scale, d_resid_amax);
    // d mid[l] is attn_out's dY: the add can compute its amaxes (Impl::producer_amaxes).
    const std::optional<ops::OutputAmaxes> d_mid_amax =
        im.producer_amaxes(l, LinearKind::kAttnOut, true, false, ops::output_amaxes_supported(N, C));
    {
      Scope sc(im, ffn, Work::kOther);
      add_norm_backward(p.mlp_norm, a.mid[(size_t)l], b.ln2_rstd, d_mid_amax);  // now d mid[l]
    }
    // Attention half.
    im.dgrad_wgrad(Section::kAttention, l, LinearKind::kAttnOut, s.d_resid, im.w(p.attn_out), s.d_attn,
                   b.attn, im.grad_out(p.attn_out), nullptr, Model::Impl::given_amax(d_mid_amax));
    if (im.recomputes()) im.recompute_qkv(l, a, b);
    {
      Scope sc(im, Section::kAttention, Work::kAttention);
      const int B = a.B, T = a.T;
      TensorView d_out4 = s.d_attn, out4 = b.attn;
      d_out4.shape = out4.shape = Shape{B, T, H, D};
      d_out4.strides = out4.strides = contiguous_strides(out4.shape);
      ops::attention_backward(d_out4, detail::qkv_part4(b.qkv, 0, H, D, B, T),
                              detail::qkv_part4(b.qkv, H * D, Hkv, D, B, T),
                              detail::qkv_part4(b.qkv, (H + Hkv) * D, Hkv, D, B, T), out4, b.lse,
                              detail::qkv_part4(s.d_qkv, 0, H, D, B, T),
                              detail::qkv_part4(s.d_qkv, H * D, Hkv, D, B, T),
                              detail::qkv_part4(s.d_qkv, (H + Hkv) * D, Hkv, D, B, T), attn_options, st);
      im.bf16(s.d_qkv);
    }
    if (!fuse_rope) {
      Scope sc(im, Section::kAttention, Work::kOther);
      ops::rope_backward_inplace(detail::qkv_part3(s.d_qkv, 0, H, D),
                                 detail::qkv_part3(s.d_qkv, H * D, Hkv, D), a.positions, theta, st);
      im.bf16(s.d_qkv);
    }
    im.dgrad_wgrad(Section::kAttention, l, LinearKind::kQkv, s.d_qkv, im.w(p.qkv), s.d_ln, b.ln1,
                   im.grad_out(p.qkv), b.save_ln1 ? &b.saved_ln1 : nullptr);
    // d resid[l] is the dY of block l - 1's mlp_down when that block is dense (its backward starts
    // with that GEMM pair; a MoE block's starts with the unpermute).
    const bool next_is_dense_down = l > 0 && !c.is_moe_block(l - 1);
    const std::optional<ops::OutputAmaxes> d_resid_out =
        im.producer_amaxes(l - 1, LinearKind::kMlpDown, true, false,
                           next_is_dense_down && ops::output_amaxes_supported(N, C));
    {
      Scope sc(im, Section::kAttention, Work::kOther);
      add_norm_backward(p.attn_norm, a.resid[(size_t)l], b.ln1_rstd, d_resid_out);  // now d resid[l]
    }
    d_resid_amax = Model::Impl::given_amax(d_resid_out);
  }
  {
    Scope sc(im, Section::kEmbedding, Work::kOther);
    ops::embedding_backward(im.g(im.embedding), s.d_resid, a.tokens, s.emb_ws, im.flag(), st);
  }
  // What no op wrote (a parameter outside this objective) is zero, as zero_grads() promised.
  for (int i = 0; i < (int)grad_zero_pending_.size(); ++i) im.g(i);
  im.check_error_flag("backward");
}

// ---- non-finite values -----------------------------------------------------------------------

void Model::check_activations_finite() const {
  FOURBIT_CHECK(impl_->have_forward, "Model::check_activations_finite: run a forward first");
  for (const Impl::Named& a : impl_->named) {
    if (a.overwritten_by_backward && impl_->backward_done) continue;  // holds a gradient now
    ops::check_finite(a.view, fmt::format("activation '{}' (model '{}')", a.name, config_.name),
                      options_.stream);
  }
}

std::vector<std::string> Model::activation_names() const {
  std::vector<std::string> names;
  for (const Impl::Named& a : impl_->named) names.push_back(a.name);
  return names;
}

TensorView Model::activation(std::string_view name) const {
  FOURBIT_CHECK(impl_->have_forward, "Model::activation: run a forward first");
  for (const Impl::Named& a : impl_->named)
    if (a.name == name) return a.view;
  throw Error(fmt::format("Model::activation: no activation '{}'; the last forward has: {}", name,
                          fmt::join(activation_names(), ", ")));
}

void Model::check_grads_finite() const {
  for (int i = 0; i < table_.size(); ++i) {
    if (!table_.row(i).trainable) continue;
    ops::check_finite(grads_.view(i), fmt::format("gradient of '{}'", table_.row(i).name), options_.stream);
  }
}

void Model::check_params_finite() const {
  for (int i = 0; i < table_.size(); ++i)
    ops::check_finite(params_.view(i), fmt::format("parameter '{}'", table_.row(i).name), options_.stream);
}

}  // namespace fourbit::model
