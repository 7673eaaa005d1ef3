// The KV-cache forward of model.h (generation: prefill, then decode steps). The same weights, ops
// and linear layers as the training forward; the attention appends each new row's key and value
// to the cache and runs ops::attention_decode over it. Activations are not kept between blocks
// (one set of block buffers serves every block, the residual stream ping-pongs between two).
//
// Fast decode (CUDA): with sampler weights built (refresh_sampler_weights: the packed NVFP4 copy
// of every dense linear weight the rl_sampler stage quantizes, plus scratch for the scaled-domain
// activations) and at most kDecodeMaxTokens tokens in a step, the dense linear layers run the
// decode GEMV (gemm/decode_gemv.h) instead of linear_fprop: NVFP4 activations are quantized by
// decode_quantize_nvfp4 (no 64-token tile; bit-identical to the quantize kernels), the weights are
// read packed. Same function as the emulated path up to FP32 summation order. MoE blocks keep
// their FFN on the grouped path (and its token tile). Dense models capture the step body (embedding
// to logits; no host synchronization or allocation inside) as a CUDA graph per step layout and
// replay it: the host then only copies the step's token ids, positions and lengths and launches once.
#include "model/model_internal.h"

#include "core/check.h"
#include "core/env.h"
#include "core/log.h"
#include "gemm/decode_gemv.h"
#include "ops/attention.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/swiglu.h"

#if defined(FOURBIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <span>
#include <string>

namespace fourbit::model {

using detail::Acts;
using detail::BlockActs;
using detail::Mode;
using detail::Scope;
using recipe::LinearKind;

// The sampler's copy of the dense linear weights (model.h refresh_sampler_weights).
struct Model::SamplerWeights {
  struct Layer {
    bool present = false;  // a dense linear layer (qkv, attn_out, mlp_up/down of dense blocks, lm_head)
    int param = -1;        // its weight in the parameter table
    std::optional<quant::QuantConfig> w_config;  // the rl_sampler weight quantizer it was built with
    std::optional<quant::QuantConfig> x_config;  // and activation quantizer
    quant::QuantizedTensor packed;               // NVFP4 row-wise [N, K] on CUDA (w_config set)
  };
  std::vector<Layer> layers;  // [tensor id = block * kinds + kind]; lm_head at block n_layers
  bool all_supported = true;  // every present layer: weights BF16 / NVFP4, activations BF16 / NVFP4 1x16 RN
  std::string unsupported;    // the first layer that is not, and why
  gemm::DecodeWorkspace workspace;
  Tensor xs;    // bf16 [kDecodeMaxTokens, max K]: scaled-domain activations of the current layer
  Tensor amax;  // f32 [kDecodeMaxTokens]: their global amax ([0]), or one per token (nvfp4_row_amax)
  Tensor rope_table;  // f32 [kDecodeMaxTokens, head_dim / 2, 2]: the step's RoPE (cos, sin) (rope epilogue)
  int64_t packed_bytes = 0;

  // CUDA graphs of the step body (dense models): one per step layout. A step replays its graph when
  // every buffer the body touches sits where it did at capture (the key) and the recipe still has
  // the quantizers the copy was built with (checked on every step). A capture that fails (an op
  // that synchronizes or allocates) turns graphs off for this copy; the steps then run eagerly.
  struct GraphKey {
    std::vector<const void*> buffers;  // step arena, caches, lengths, parameter buffers, flag
    int B = 0, Tq = 0, max_len = 0;
    bool all_logits = false;
    bool chain = false;  // the step body runs the decode chain
    DecodeEpilogues epilogues = DecodeEpilogues::kDefault;  // Model::set_decode_epilogues
    bool operator==(const GraphKey&) const = default;
  };
  bool graphs_enabled = true;
#if defined(FOURBIT_WITH_CUDA)
  std::vector<std::pair<GraphKey, cudaGraphExec_t>> graphs;
  cudaStream_t capture_stream = nullptr;
  ~SamplerWeights() {
    if (!graphs.empty()) cudaDeviceSynchronize();  // no replay in flight
    for (auto& [key, exec] : graphs) cudaGraphExecDestroy(exec);
    if (capture_stream != nullptr) cudaStreamDestroy(capture_stream);
  }
#endif
};

namespace {
// Whether the dense MLP's SwiGLU runs in mlp_up's decode GEMV epilogue (DecodeGemvArgs::swiglu) and
// RoPE with the KV-cache append in the qkv GEMV's (DecodeGemvArgs::rope), where the GEMV allows (1-16
// tokens); the same bits either way. setting: 1 on, 0 off, -1 the measured rule (Model::DecodeEpilogues::
// kAuto): only where the next quantizer has NVFP4 activations (mlp_down's for the SwiGLU, qkv's own
// for RoPE) and the step has at most 8 tokens. Measured on an H100 (llama-1.1b, bench/notes-decode.md,
// session 31): e2e4 -2..-7% a step at 1 and 8 tokens, +4-5% at 16; bf16 and nvfp4-weights (BF16
// activations) level or 2-6% slower.
bool decode_epilogue_wanted(int setting, bool nvfp4_activations, int64_t tokens) {
  if (setting >= 0) return setting == 1;
  return nvfp4_activations && tokens <= 8;
}
// FOURBIT_DECODE_SWIGLU_EPILOGUE / FOURBIT_DECODE_ROPE_EPILOGUE = 1 turn them on wherever the GEMV
// allows, 0 off, for the models left at DecodeEpilogues::kDefault (A/B runs); unset: off.
int decode_swiglu_epilogue_setting() {
  static const int v = env_switch("FOURBIT_DECODE_SWIGLU_EPILOGUE");
  return v;
}
int decode_rope_epilogue_setting() {
  static const int v = env_switch("FOURBIT_DECODE_ROPE_EPILOGUE");
  return v;
}
}  // namespace

bool Model::default_decode_chain() {
  static const bool on = env_switch("FOURBIT_DECODE_CHAIN") == 1;
  return on;
}

void KvCache::reset() {
  std::fill(lengths_.begin(), lengths_.end(), 0);
}

int64_t KvCache::bytes() const {
  int64_t n = arena_ ? arena_->capacity() : 0;
  for (const Tensor& t : k_) n += t.nbytes();
  for (const Tensor& t : v_) n += t.nbytes();
  return n;
}

KvCache Model::make_kv_cache(int batch, int max_len, int max_step_tokens) const {
  FOURBIT_CHECK(batch >= 1, "make_kv_cache: batch must be >= 1, got {}", batch);
  FOURBIT_CHECK(max_len >= 1 && max_len <= config_.max_seq,
                "make_kv_cache: max_len {} must lie in [1, config.max_seq = {}]", max_len, config_.max_seq);
  FOURBIT_CHECK(max_step_tokens >= 1 && max_step_tokens <= max_len,
                "make_kv_cache: max_step_tokens {} must lie in [1, max_len = {}]", max_step_tokens, max_len);
  KvCache c;
  c.batch_ = batch;
  c.max_len_ = max_len;
  c.max_step_tokens_ = max_step_tokens;
  const Shape shape{batch, max_len, config_.n_kv_heads, config_.head_dim()};
  for (int l = 0; l < config_.n_layers; ++l) {
    c.k_.push_back(Tensor::zeros(shape, act_dtype_, options_.device));
    c.v_.push_back(Tensor::zeros(shape, act_dtype_, options_.device));
  }
  c.lengths_.assign((size_t)batch, 0);
  c.lengths_device_ = Tensor::zeros({batch}, DType::kI32, options_.device);
  const int64_t n_tokens = (int64_t)batch * max_step_tokens;
  detail::Carver counter(nullptr, options_.device);
  impl_->plan(counter, batch, max_step_tokens, false, n_tokens, stat_dtype_, true, Mode::kRlSampler);
  c.arena_ = std::make_unique<Arena>(counter.bytes(), options_.device);
  if (options_.device == Device::kCuda) c.attention_ws_ = std::make_shared<ops::AttentionDecodeWorkspace>(Device::kCuda);
  return c;
}

namespace {

// Appends the keys and values of the rows with write_pos >= 0 to the caches (CPU).
void kv_append_cpu(const TensorView& qkv, int64_t k_col, int64_t v_col, int64_t width,
                   const std::vector<int32_t>& write_pos, int64_t rows_per_seq, const Tensor& k_cache,
                   const Tensor& v_cache, int64_t t_max) {
  const int64_t row_bytes = dtype_bytes(qkv.dtype, width);
  const int64_t stride = qkv.shape[1];
  for (size_t n = 0; n < write_pos.size(); ++n) {
    if (write_pos[n] < 0) continue;
    const int64_t b = (int64_t)n / rows_per_seq;
    const char* src = static_cast<const char*>(qkv.data) + dtype_bytes(qkv.dtype, (int64_t)n * stride);
    const int64_t at = dtype_bytes(qkv.dtype, (b * t_max + write_pos[n]) * width);
    std::memcpy(static_cast<char*>(k_cache.data()) + at, src + dtype_bytes(qkv.dtype, k_col), (size_t)row_bytes);
    std::memcpy(static_cast<char*>(v_cache.data()) + at, src + dtype_bytes(qkv.dtype, v_col), (size_t)row_bytes);
  }
}

constexpr int kKinds = (int)recipe::kLinearKinds.size();

int layer_id(int block, LinearKind kind) { return block * kKinds + (int)kind; }

std::string layer_name(int block, LinearKind kind) {
  return kind == LinearKind::kLmHead ? std::string("lm_head")
                                     : fmt::format("blocks.{}.{}", block, recipe::kind_name(kind));
}

// A [rows, cols] contiguous view at the start of a (larger) contiguous buffer.
TensorView prefix(const TensorView& buf, int64_t rows, int64_t cols) {
  TensorView v = buf;
  v.shape = Shape{rows, cols};
  v.strides = contiguous_strides(v.shape);
  return v;
}

// Restores the mode and step of the training pass when the cached forward returns.
class ModeGuard {
 public:
  ModeGuard(Model::Impl& im, Mode mode) : im_(im), mode_(im.mode), step_(im.step) { im.mode = mode; }
  ~ModeGuard() {
    im_.mode = mode_;
    im_.step = step_;
  }

 private:
  Model::Impl& im_;
  Mode mode_;
  uint64_t step_;
};

}  // namespace

void Model::refresh_sampler_weights() {
  if (options_.device != Device::kCuda) return;  // the CPU keeps the reference path
  Impl& im = *impl_;
  const ModelConfig& c = config_;
  const std::vector<gemm::LinearRecipe>& recipes = im.recipes[(size_t)Mode::kRlSampler];
  std::shared_ptr<SamplerWeights> old = sampler_;
  auto sw = std::make_shared<SamplerWeights>();
  sw->layers.resize((size_t)(c.n_layers + 1) * kKinds);
  struct Entry {
    int block;
    LinearKind kind;
    int param;
  };
  std::vector<Entry> entries;
  for (int l = 0; l < c.n_layers; ++l) {
    const detail::BlockParams& p = im.bp[(size_t)l];
    entries.push_back({l, LinearKind::kQkv, p.qkv});
    entries.push_back({l, LinearKind::kAttnOut, p.attn_out});
    if (!c.is_moe_block(l)) {
      entries.push_back({l, LinearKind::kMlpUp, p.mlp_up});
      entries.push_back({l, LinearKind::kMlpDown, p.mlp_down});
    }
  }
  entries.push_back({c.n_layers, LinearKind::kLmHead, im.lm_head});
  int64_t max_k = 1;
  for (const Entry& e : entries) {
    const int id = layer_id(e.block, e.kind);
    const gemm::LinearRecipe& r = recipes[(size_t)id];
    SamplerWeights::Layer& L = sw->layers[(size_t)id];
    L.present = true;
    L.param = e.param;
    const TensorView& w = im.w(e.param);  // bf16 [N, K]
    max_k = std::max(max_k, w.shape[1]);
    const std::string name = layer_name(e.block, e.kind);
    std::string why;
    L.x_config = r.fprop_x.quant;
    if (r.fprop_x.quant && !gemm::decode_supports_activation_quant(*r.fprop_x.quant, &why)) {
      if (sw->all_supported) sw->unsupported = fmt::format("{}: activation quantizer {}", name, why);
      sw->all_supported = false;
    }
    if (!r.fprop_w.quant) continue;
    const quant::QuantConfig& wc = *r.fprop_w.quant;
    if (wc.format != quant::Format::kNvfp4 || wc.rounding != quant::Rounding::kNearest) {
      if (sw->all_supported) {
        sw->unsupported = fmt::format("{}: weight quantizer {} (the decode GEMV reads bf16 or nvfp4 round-to-nearest "
                                      "weights)", name, wc.describe());
      }
      sw->all_supported = false;
      continue;
    }
    L.w_config = wc;
    // Reuse the previous copy's buffers when it was built with the same quantizer.
    const SamplerWeights::Layer* prev = old != nullptr ? &old->layers[(size_t)id] : nullptr;
    if (prev != nullptr && prev->present && prev->w_config == L.w_config) {
      L.packed = prev->packed;
    } else {
      L.packed = quant::allocate_quantized(wc, w.shape[0], w.shape[1], quant::Orientations{}, Device::kCuda);
    }
#if defined(FOURBIT_WITH_CUDA)
    quant::CudaQuantizeOptions qo;
    qo.tensor_name = name;
    qo.stream = options_.stream;
    quant::quantize_cuda(w, L.packed, qo);
#endif
    sw->packed_bytes += L.packed.rowwise->data.nbytes() + L.packed.rowwise->scales.nbytes();
  }
  // Scratch, sized for the largest step and layer.
  if (old != nullptr && old->xs.defined() && old->xs.shape()[1] >= max_k) {
    sw->xs = old->xs;
    sw->amax = old->amax;
    sw->rope_table = old->rope_table;
  } else {
    sw->xs = Tensor::empty({gemm::kDecodeMaxTokens, max_k}, DType::kBF16, Device::kCuda);
    sw->amax = Tensor::zeros({gemm::kDecodeMaxTokens}, DType::kF32, Device::kCuda);  // per token, or [0]
    sw->rope_table = Tensor::empty({gemm::kDecodeMaxTokens, std::max<int64_t>(1, c.head_dim() / 2), 2}, DType::kF32,
                                   Device::kCuda);
  }
  for (const Entry& e : entries) {
    const TensorView& w = im.w(e.param);
    for (int B = 1; B <= gemm::kDecodeMaxTokens; ++B) sw->workspace.reserve_for(B, w.shape[0], w.shape[1]);
  }
  sampler_ = std::move(sw);
}

int64_t Model::sampler_weight_bytes() const { return sampler_ ? sampler_->packed_bytes : 0; }

bool Model::sampler_weights_supported(std::string* why) const {
  if (sampler_ == nullptr) {
    if (why != nullptr) *why = "no sampler weights (refresh_sampler_weights() builds them, on CUDA only)";
    return false;
  }
  if (why != nullptr) *why = sampler_->unsupported;
  return sampler_->all_supported;
}

TensorView Model::forward_cached(KvCache& cache, const TensorView& tokens, std::span<const int32_t> n_new,
                                 const CachedForwardOptions& o) {
  Impl& im = *impl_;
  const ModelConfig& c = config_;
  FOURBIT_CHECK(cache.arena_ != nullptr, "forward_cached: the cache was not made by make_kv_cache");
  FOURBIT_CHECK(tokens.device == Device::kCpu && tokens.dtype == DType::kI32 && tokens.shape.ndim == 2 &&
                    tokens.is_contiguous(),
                "forward_cached: tokens must be a contiguous host i32 [B, Tq], got {}", tokens.describe());
  const int B = (int)tokens.shape[0], Tq = (int)tokens.shape[1];
  FOURBIT_CHECK(B == cache.batch() && Tq >= 1 && Tq <= cache.max_step_tokens(),
                "forward_cached: tokens [{}, {}] do not fit the cache (batch {}, at most {} tokens per "
                "step)", B, Tq, cache.batch(), cache.max_step_tokens());
  FOURBIT_CHECK((int)n_new.size() == B, "forward_cached: n_new has {} entries for {} sequences",
                n_new.size(), B);
  const int64_t N = (int64_t)B * Tq;
  std::vector<int32_t> new_lengths((size_t)B), positions((size_t)N), write_pos((size_t)N);
  for (int b = 0; b < B; ++b) {
    const int32_t len = cache.lengths_[(size_t)b];
    FOURBIT_CHECK(n_new[(size_t)b] >= 0 && n_new[(size_t)b] <= Tq,
                  "forward_cached: n_new[{}] = {} must lie in [0, Tq = {}]", b, n_new[(size_t)b], Tq);
    FOURBIT_CHECK(len + n_new[(size_t)b] <= cache.max_len(),
                  "forward_cached: sequence {} would grow to {} positions, beyond the cache's max_len {}",
                  b, len + n_new[(size_t)b], cache.max_len());
    new_lengths[(size_t)b] = len + n_new[(size_t)b];
    for (int t = 0; t < Tq; ++t) {
      const int32_t pos = new_lengths[(size_t)b] - Tq + t;
      positions[(size_t)(b * Tq + t)] = pos;
      write_pos[(size_t)(b * Tq + t)] = t >= Tq - n_new[(size_t)b] ? pos : -1;
    }
  }
  for (int64_t i = 0; i < N; ++i) {
    const int32_t id = tokens.ptr<const int32_t>()[i];
    FOURBIT_CHECK(id >= 0 && id < c.vocab,
                  "forward_cached: token [{}, {}] = {} lies outside [0, {}) (padding rows need a valid "
                  "id too, e.g. 0)", i / Tq, i % Tq, id, c.vocab);
  }
  const int n_moe = c.n_moe_layers();
  const int64_t k = c.moe.top_k;
  for (const TensorView* t : {&o.forced_expert_ids, &o.expert_ids_out}) {
    if (t->data == nullptr) continue;
    FOURBIT_CHECK(c.is_moe(), "forward_cached: expert ids given for a dense model");
    FOURBIT_CHECK(t->device == Device::kCpu && t->dtype == DType::kI32 && t->is_contiguous() &&
                      t->numel() == N * n_moe * k,
                  "forward_cached: expert ids must be a contiguous host i32 [{}, {}, {}], got {}", N,
                  n_moe, k, t->describe());
  }
  Mode mode = Mode::kRlSampler;
  switch (o.stage) {
    case recipe::Stage::kRlSampler: mode = Mode::kRlSampler; break;
    case recipe::Stage::kRlTrainer: mode = Mode::kRlTrainer; break;
    case recipe::Stage::kPretrainForward: mode = Mode::kPretrain; break;
    case recipe::Stage::kPretrainBackward:
      throw Error("forward_cached: stage pretrain_backward runs no Fprop; use pretrain_forward, "
                  "rl_sampler or rl_trainer");
  }
  ModeGuard guard(im, mode);
  // The decode GEMV path (sampler weights, see the header comment).
  SamplerWeights* sw = nullptr;
  if (sampler_ != nullptr && options_.device == Device::kCuda && o.stage == recipe::Stage::kRlSampler &&
      N <= gemm::kDecodeMaxTokens) {
    FOURBIT_CHECK(sampler_->all_supported,
                  "forward_cached: the rl_sampler recipe '{}' has a layer the decode GEMV does not implement ({}); "
                  "release_sampler_weights() to use the emulated path", recipe_.recipe().name, sampler_->unsupported);
    sw = sampler_.get();
  }
  // Without MoE blocks the decode path has no token tile.
  if (sw == nullptr || c.is_moe()) im.check_token_tile(N, "forward_cached");
  // The stream of the step body: the model's, or a capture stream while a CUDA graph is captured.
  void* stream = options_.stream;
  // The sampler copy of layer (l, kind) must match the recipe's quantizers of now.
  auto check_layer = [&](int l, LinearKind kind, int param) -> const SamplerWeights::Layer& {
    const int block = kind == LinearKind::kLmHead ? c.n_layers : l;
    const SamplerWeights::Layer& L = sw->layers[(size_t)layer_id(block, kind)];
    const gemm::LinearRecipe& r = im.linear_recipe(l, kind);
    if (!(L.present && L.param == param && L.w_config == r.fprop_w.quant &&
          L.x_config == r.fprop_x.quant)) {
      auto desc = [](const std::optional<quant::QuantConfig>& q) { return q ? q->describe() : std::string("bf16"); };
      throw Error(fmt::format(
          "forward_cached: the sampler weights of {} were built for another recipe (weight {}, activation {}; the "
          "recipe now says {}, {}): call refresh_sampler_weights() after set_recipe", layer_name(l, kind),
          desc(L.w_config), desc(L.x_config), desc(r.fprop_w.quant), desc(r.fprop_x.quant)));
    }
    return L;
  };
  // What the decode GEMV reads for layer (l, kind): its packed NVFP4 copy, or the BF16 compute weight.
  auto sampler_gemv_weights = [&](const SamplerWeights::Layer& L, int param, std::string_view name) {
    return L.w_config ? gemm::DecodeWeights::packed(L.packed, name) : gemm::DecodeWeights::plain(im.w(param), name);
  };
  // What a decode linear layer fuses around its GEMV (decode path only):
  //   norm_param >= 0: x is the input of that RMSNorm, fused into the activation quantizer
  //     (norm_fusable); the normalized activation is never written;
  //   swiglu_in: x is the [gate | up] buffer, its SwiGLU fused into the activation quantizer;
  //   swiglu_out: y is the SwiGLU of the [gate | up] product (DecodeGemvArgs::swiglu), never written;
  //   rope: RoPE and the KV append in the GEMV's epilogue (DecodeGemvArgs::rope).
  struct Fused {
    int norm_param = -1;
    bool swiglu_in = false, swiglu_out = false;
    const gemm::DecodeRope* rope = nullptr;
  };
  // One dense linear layer: y = x W^T under the rl_sampler recipe through the decode GEMV.
  auto decode_linear = [&](Section sec, int l, LinearKind kind, const TensorView& x, int param, const TensorView& y,
                           const TensorView& residual, const Fused& f) {
    const SamplerWeights::Layer& L = check_layer(l, kind, param);
    const gemm::LinearRecipe& r = im.linear_recipe(l, kind);
    const std::string name = layer_name(l, kind);
    const TensorView& wt = im.w(param);
    if (profiler_ != nullptr) profiler_->linear_call({sec, recipe::Gemm::kFprop, &r, x.shape[0], wt.shape[0], wt.shape[1], 1});
    Scope scope(im, sec, Work::kLinear);
    gemm::DecodeGemvArgs g;
    g.x = x;
    if (r.fprop_x.quant) {
      gemm::DecodeQuantizeArgs q;
      q.x = x;
      q.config = *r.fprop_x.quant;
      q.xs = prefix(sw->xs.view(), x.shape[0], f.swiglu_in ? x.shape[1] / 2 : x.shape[1]);
      q.amax = sw->amax.ptr<float>();
      q.workspace = &sw->workspace;
      q.error_flag = im.flag();
      q.stream = stream;
      q.name = name;
      if (f.norm_param >= 0) {
        q.norm_weight = im.master(f.norm_param);
        q.norm_eps = (float)c.norm_eps;
      }
      q.swiglu = f.swiglu_in;
      gemm::decode_quantize_nvfp4(q);
      g.x = q.xs;
      g.x_nvfp4_amax = sw->amax.ptr<const float>();
      g.x_amax_per_row = q.config.nvfp4_row_amax;
      g.x_global_constant = r.fprop_x.quant->nvfp4_global_constant();
    }
    g.w = sampler_gemv_weights(L, param, name);
    g.y = y;
    g.residual = residual;
    g.swiglu = f.swiglu_out;
    g.rope = f.rope;
    g.stream = stream;
    g.workspace = &sw->workspace;
    g.name = name;
    gemm::decode_gemv(g);
    if (gemm_observer_) im.observe(name, recipe::Gemm::kFprop, r, x, wt, y, {}, im.linear_options(l, kind, name).sr);
  };
  // The decode GEMV adds a block's residual in its epilogue (the same bits as ops::add_inplace after
  // it), except for an observer, which must see the GEMM's own output.
  const bool fuse_residual = sw != nullptr && !gemm_observer_;
  // Whether the RMSNorm before layer (l, kind) runs inside its activation quantizer (decode path,
  // NVFP4 activations, a small enough activation; not under an observer, which must see the norm's
  // output as the GEMM's input).
  auto norm_fusable = [&](int l, LinearKind kind, int64_t rows) {
    const std::optional<quant::QuantConfig>& xq = im.linear_recipe(l, kind).fprop_x.quant;
    return sw != nullptr && !gemm_observer_ && xq.has_value() &&
           gemm::decode_quantize_can_fuse_norm(rows, c.d_model, xq->nvfp4_row_amax);
  };
  auto linear = [&](Section sec, int l, LinearKind kind, const TensorView& x, int param, const TensorView& y,
                    bool bf16_output, const TensorView& residual = TensorView{}, const Fused& fused = Fused{}) {
    if (sw != nullptr) {
      decode_linear(sec, l, kind, x, param, y, fuse_residual ? residual : TensorView{}, fused);
    } else {
      im.fprop(sec, l, kind, x, im.w(param), y, bf16_output);
    }
  };

  // The decode chain (model.h set_decode_chain): a dense model with at most kDecodeChainMaxTokens
  // tokens a step, BF16 activations in every linear layer and one weight format (all NVFP4 copies
  // or all BF16), no profiler or observer (they want the individual calls).
  bool chain = decode_chain_ && sw != nullptr && !c.is_moe() && fuse_residual && profiler_ == nullptr &&
               N <= gemm::kDecodeChainMaxTokens;
  // Whether layer (l, kind) fits the chain: BF16 activations, weights in the chain's format (layer
  // 0's qkv's).
  auto chainable = [&](int l, LinearKind kind) {
    const bool nvfp4 = sw->layers[(size_t)layer_id(l, kind)].w_config.has_value();
    return !im.linear_recipe(l, kind).fprop_x.quant.has_value() &&
           nvfp4 == sw->layers[(size_t)layer_id(0, LinearKind::kQkv)].w_config.has_value();
  };
  for (int l = 0; chain && l < c.n_layers; ++l) {
    for (LinearKind kind : {LinearKind::kQkv, LinearKind::kAttnOut, LinearKind::kMlpUp, LinearKind::kMlpDown}) {
      chain = chain && chainable(l, kind);
    }
  }
  // The lm_head (final norm fused) ends the last layer's chain where it fits too and its input is
  // the whole final residual (one token a sequence, or every row's logits).
  const bool chain_head = chain && (Tq == 1 || o.all_logits) && chainable(c.n_layers, LinearKind::kLmHead);
  // One link of a chain: layer (l, kind) as decode_linear would run it (BF16 x, sampler weights),
  // x made by `producer` (the RMSNorm of norm_param, or the SwiGLU); `name` keeps the layer's name.
  auto chain_link = [&](int l, LinearKind kind, const TensorView& x, int param, const TensorView& y,
                        const TensorView& residual, gemm::DecodeProducer producer, int norm_param,
                        std::string& name) {
    const SamplerWeights::Layer& L = check_layer(l, kind, param);
    name = layer_name(l, kind);
    gemm::DecodeChainLink k;
    k.gemv.x = x;
    k.gemv.w = sampler_gemv_weights(L, param, name);
    k.gemv.y = y;
    k.gemv.residual = residual;
    k.gemv.name = name;
    k.producer = producer;
    if (norm_param >= 0) {
      k.norm_weight = im.master(norm_param);
      k.norm_eps = (float)c.norm_eps;
    }
    return k;
  };

  cache.arena_->reset();
  detail::Carver carver(cache.arena_.get(), options_.device);
  Acts a = im.plan(carver, B, Tq, false, o.all_logits ? N : B, stat_dtype_, !o.all_logits,
                   Mode::kRlSampler);
  void* st = options_.stream;
  detail::copy_to_device(a.tokens, tokens.data, st);
  detail::copy_to_device(a.positions, positions.data(), st);
  detail::copy_to_device(a.write_pos, write_pos.data(), st);
  detail::copy_to_device(cache.lengths_device_.view(), new_lengths.data(), st);
  detail::sync_stream(options_.device, st);  // the host vectors above are locals

  // The epilogues of the decode GEMVs (model.h set_decode_epilogues): the SwiGLU in mlp_up's (dense
  // MLP blocks) and RoPE with the KV append in qkv's, by layer; not under an observer, which must see
  // the GEMMs' own outputs, nor in the chain.
  auto epilogue_setting = [&](int env_setting) {
    switch (decode_epilogues_) {
      case DecodeEpilogues::kAuto: return -1;
      case DecodeEpilogues::kOn: return 1;
      case DecodeEpilogues::kOff: return 0;
      default: return env_setting >= 0 ? env_setting : 0;  // kDefault
    }
  };
  auto swiglu_wanted = [&](int l) {
    return fuse_residual && !chain && !c.is_moe_block(l) && gemm::decode_gemv_swiglu_supported(N, 2 * c.d_ff) &&
           decode_epilogue_wanted(epilogue_setting(decode_swiglu_epilogue_setting()),
                                  im.linear_recipe(l, LinearKind::kMlpDown).fprop_x.quant.has_value(), N);
  };
  auto rope_wanted = [&](int l) {
    return fuse_residual && !chain && gemm::decode_gemv_rope_supported(N, c.head_dim()) &&
           decode_epilogue_wanted(epilogue_setting(decode_rope_epilogue_setting()),
                                  im.linear_recipe(l, LinearKind::kQkv).fprop_x.quant.has_value(), N);
  };
  bool any_rope = false, any_swiglu = false;
  for (int l = 0; l < c.n_layers; ++l) {
    any_rope = any_rope || rope_wanted(l);
    any_swiglu = any_swiglu || swiglu_wanted(l);
  }
  // The step's (cos, sin) table for the RoPE epilogues: f32 [N, head_dim / 2, 2] in sw->rope_table.
  TensorView rope_table;
  if (any_rope) {
    rope_table = sw->rope_table.view();
    rope_table.shape = Shape{N, c.head_dim() / 2, 2};
    rope_table.strides = contiguous_strides(rope_table.shape);
  }

  // The step body, from the embedding to the logits, on `stream`.
  auto body = [&]() {
    void* const st = stream;
    {
      Scope s(im, Section::kEmbedding, Work::kOther);
      ops::embedding_forward(a.resid[0], a.tokens, im.master(im.embedding), im.flag(), st);
      im.bf16(a.resid[0]);
    }
    const int64_t D = c.head_dim(), H = c.n_heads, Hkv = c.n_kv_heads;
    const float eps = (float)c.norm_eps, theta = (float)c.rope_theta;
    BlockActs& b = a.blocks[0];
    const TensorView mid = a.mid[0];
    std::vector<int32_t> ids((size_t)(N * k));
    // With the chain, layer l's qkv ran in the chain of layer l - 1 (layer 0's alone); the chain of
    // layer l runs attn_out, the MLP and layer l + 1's qkv.
    std::array<std::string, 4> chain_names;
    auto qkv_link = [&](int l) {
      return chain_link(l, LinearKind::kQkv, a.resid[(size_t)(l % 2)], im.bp[(size_t)l].qkv, b.qkv, {},
                        gemm::DecodeProducer::kRmsnorm, im.bp[(size_t)l].attn_norm, chain_names[3]);
    };
    auto run_chain = [&](std::span<const gemm::DecodeChainLink> links) {
      Scope s(im, Section::kAttention, Work::kLinear);
      gemm::decode_gemv_chain(links, sw->workspace, st);
    };
    if (chain) {
      const gemm::DecodeChainLink first[1] = {qkv_link(0)};
      run_chain(first);
    }
    // RoPE and the KV append in the qkv GEMV's epilogue (not under an observer, which must see the
    // GEMM's own output, nor in the chain): the (cos, sin) of the step's positions once, here.
    if (any_rope) {
      Scope s(im, Section::kAttention, Work::kOther);
      ops::rope_cos_sin_table(rope_table, a.positions, theta, D, st);
    }
    auto qkv_rope = [&](int l) {
      gemm::DecodeRope r;
      r.q_heads = H;
      r.kv_heads = Hkv;
      r.head_dim = D;
      r.cos_sin = rope_table;
      r.k_cache = cache.k_[(size_t)l].view();
      r.v_cache = cache.v_[(size_t)l].view();
      r.write_pos = a.write_pos;
      r.rows_per_seq = Tq;
      return r;
    };
    for (int l = 0; l < c.n_layers; ++l) {
      const detail::BlockParams& p = im.bp[(size_t)l];
      const TensorView x = a.resid[(size_t)(l % 2)], out = a.resid[(size_t)((l + 1) % 2)];
      const bool rope_out = rope_wanted(l);
      const gemm::DecodeRope rope = rope_out ? qkv_rope(l) : gemm::DecodeRope{};
      const gemm::DecodeRope* rope_arg = rope_out ? &rope : nullptr;
      if (chain) {
        // qkv is done (above, or in the previous layer's chain)
      } else if (norm_fusable(l, LinearKind::kQkv, N)) {
        linear(Section::kAttention, l, LinearKind::kQkv, x, p.qkv, b.qkv, true, {},
               {.norm_param = p.attn_norm, .rope = rope_arg});
      } else {
        {
          Scope s(im, Section::kAttention, Work::kOther);
          ops::rmsnorm_forward(b.ln1, b.ln1_rstd, x, im.master(p.attn_norm), eps, st);
          im.bf16(b.ln1);
        }
        linear(Section::kAttention, l, LinearKind::kQkv, b.ln1, p.qkv, b.qkv, true, {}, {.rope = rope_arg});
      }
      if (!rope_out) {
        Scope s(im, Section::kAttention, Work::kOther);
        const TensorView q3 = detail::qkv_part3(b.qkv, 0, H, D), k3 = detail::qkv_part3(b.qkv, H * D, Hkv, D);
        const Tensor& kc = cache.k_[(size_t)l];
        const Tensor& vc = cache.v_[(size_t)l];
        if (options_.device == Device::kCpu) {
          ops::rope_forward_inplace(q3, k3, a.positions, theta, st);
          im.bf16(b.qkv);
          kv_append_cpu(b.qkv, H * D, (H + Hkv) * D, Hkv * D, write_pos, Tq, kc, vc, cache.max_len());
        } else {  // one kernel: the rotation writes the new keys and values into the cache as well
          ops::RopeCacheAppend ap;
          ap.v = detail::qkv_part3(b.qkv, (H + Hkv) * D, Hkv, D);
          ap.k_cache = kc.view();
          ap.v_cache = vc.view();
          ap.write_pos = a.write_pos;
          ap.rows_per_seq = Tq;
          ops::rope_forward_inplace_append(q3, k3, a.positions, theta, ap, st);
        }
      }
      {
        Scope s(im, Section::kAttention, Work::kAttention);
        TensorView out4 = b.attn;
        out4.shape = Shape{B, Tq, H, D};
        out4.strides = contiguous_strides(out4.shape);
        ops::AttentionOptions ao;
        ao.decode_workspace = cache.attention_ws_.get();
        ops::attention_decode(detail::qkv_part4(b.qkv, 0, H, D, B, Tq), cache.k_[(size_t)l],
                              cache.v_[(size_t)l], cache.lengths_device_, out4, ao, st);
        im.bf16(b.attn);
      }
      if (chain) {
        const TensorView gu = prefix(b.gate_up, N, 2 * c.d_ff);
        std::vector<gemm::DecodeChainLink> links = {
            chain_link(l, LinearKind::kAttnOut, b.attn, p.attn_out, mid, x, gemm::DecodeProducer::kNone, -1,
                       chain_names[0]),
            chain_link(l, LinearKind::kMlpUp, mid, p.mlp_up, gu, {}, gemm::DecodeProducer::kRmsnorm, p.mlp_norm,
                       chain_names[1]),
            chain_link(l, LinearKind::kMlpDown, gu, p.mlp_down, out, mid, gemm::DecodeProducer::kSwiglu, -1,
                       chain_names[2])};
        if (l + 1 < c.n_layers) {
          links.push_back(qkv_link(l + 1));
        } else if (chain_head) {  // out is the final residual, one row per sequence (Tq 1) or all rows
          links.push_back(chain_link(c.n_layers, LinearKind::kLmHead, out, im.lm_head, a.logits, {},
                                     gemm::DecodeProducer::kRmsnorm, im.final_norm, chain_names[3]));
        }
        run_chain(links);
        continue;
      }
      linear(Section::kAttention, l, LinearKind::kAttnOut, b.attn, p.attn_out, mid, true, x);
      const Section ffn = c.is_moe_block(l) ? Section::kMoe : Section::kMlp;
      if (!fuse_residual) {
        Scope s(im, Section::kAttention, Work::kOther);
        ops::add_inplace(mid, x, st);
        im.bf16(mid);
      }
      const bool decode_mlp = sw != nullptr && !c.is_moe_block(l);  // the dense MLP on the decode GEMV
      const bool fuse_ln2 = decode_mlp && norm_fusable(l, LinearKind::kMlpUp, N);
      if (!fuse_ln2) {
        Scope s(im, ffn, Work::kOther);
        ops::rmsnorm_forward(b.ln2, b.ln2_rstd, mid, im.master(p.mlp_norm), eps, st);
        im.bf16(b.ln2);
      }
      if (decode_mlp) {
        const TensorView gu = prefix(b.gate_up, N, 2 * c.d_ff), act = prefix(b.act, N, c.d_ff);
        // The SwiGLU runs in mlp_up's GEMV epilogue (up to 16 tokens; not under an observer, which
        // must see the GEMM's own output): mlp_up writes act, and the [gate | up] product is never
        // written. Else inside mlp_down's activation quantizer where there is one (as norm_fusable),
        // or as its own kernel.
        const bool swiglu_out = swiglu_wanted(l);
        const TensorView up_out = swiglu_out ? act : gu;
        if (fuse_ln2) {
          linear(Section::kMlp, l, LinearKind::kMlpUp, mid, p.mlp_up, up_out, true, {},
                 {.norm_param = p.mlp_norm, .swiglu_out = swiglu_out});
        } else {
          linear(Section::kMlp, l, LinearKind::kMlpUp, b.ln2, p.mlp_up, up_out, true, {}, {.swiglu_out = swiglu_out});
        }
        if (swiglu_out) {
          linear(Section::kMlp, l, LinearKind::kMlpDown, act, p.mlp_down, out, true, mid);
        } else if (!gemm_observer_ && im.linear_recipe(l, LinearKind::kMlpDown).fprop_x.quant.has_value()) {
          linear(Section::kMlp, l, LinearKind::kMlpDown, gu, p.mlp_down, out, true, mid, {.swiglu_in = true});
        } else {
          {
            Scope s(im, Section::kMlp, Work::kOther);
            ops::swiglu_forward(act, gu, st);
          }
          linear(Section::kMlp, l, LinearKind::kMlpDown, act, p.mlp_down, out, true, mid);
        }
      } else {
        im.forward_ffn(l, a, b, out, o.forced_expert_ids);
      }
      if (!(decode_mlp && fuse_residual)) {  // else mlp_down added it
        Scope s(im, ffn, Work::kOther);
        ops::add_inplace(out, mid, st);
        im.bf16(out);
      }
      if (o.expert_ids_out.data != nullptr && c.is_moe_block(l)) {
        const int mi = c.moe_index(l);
        detail::copy_to_host(ids.data(), b.expert_ids, st);
        int32_t* dst = o.expert_ids_out.ptr<int32_t>();
        for (int64_t n = 0; n < N; ++n)
          for (int64_t j = 0; j < k; ++j) dst[(n * n_moe + mi) * k + j] = ids[(size_t)(n * k + j)];
      }
    }
    if (chain_head) return;  // the last layer's chain ran the final norm and the lm_head
    const TensorView final_resid = a.resid[(size_t)(c.n_layers % 2)];
    TensorView final_norm_input;  // set when the final norm runs inside the lm_head's quantizer
    {
      Scope s(im, Section::kLmHead, Work::kOther);
      TensorView x = final_resid;
      if (!o.all_logits) {
        detail::gather_rows(a.last_rows, final_resid, Tq - 1, Tq, st);
        x = a.last_rows;
      }
      if (norm_fusable(c.n_layers, LinearKind::kLmHead, x.shape[0])) {
        final_norm_input = x;
      } else {
        ops::rmsnorm_forward(a.lnf, a.lnf_rstd, x, im.master(im.final_norm), eps, st);
        im.bf16(a.lnf);
      }
    }
    // FP32 logits (for sampling), not rounded.
    if (final_norm_input.data != nullptr) {
      linear(Section::kLmHead, c.n_layers, LinearKind::kLmHead, final_norm_input, im.lm_head, a.logits, false, {},
             {.norm_param = im.final_norm});
    } else {
      linear(Section::kLmHead, c.n_layers, LinearKind::kLmHead, a.lnf, im.lm_head, a.logits, false);
    }
  };

  // Dense models on the decode path replay a CUDA graph of the body (one launch instead of a few
  // hundred), unless a profiler or an observer wants the individual calls.
  const bool use_graph = sw != nullptr && sw->graphs_enabled && !c.is_moe() && profiler_ == nullptr && !gemm_observer_;
  if (!use_graph) {
    body();
  } else {
#if defined(FOURBIT_WITH_CUDA)
    // What decode_linear checks, for every layer: a replay does not run it.
    for (int l = 0; l < c.n_layers; ++l) {
      const detail::BlockParams& p = im.bp[(size_t)l];
      check_layer(l, LinearKind::kQkv, p.qkv);
      check_layer(l, LinearKind::kAttnOut, p.attn_out);
      check_layer(l, LinearKind::kMlpUp, p.mlp_up);
      check_layer(l, LinearKind::kMlpDown, p.mlp_down);
    }
    check_layer(c.n_layers, LinearKind::kLmHead, im.lm_head);
    SamplerWeights::GraphKey key;
    key.B = B;
    key.Tq = Tq;
    key.max_len = cache.max_len();
    key.all_logits = o.all_logits;
    key.chain = chain;
    key.epilogues = decode_epilogues_;
    key.buffers = {a.tokens.data, a.logits.data, cache.lengths_device_.data(), params_.flat().data,
                   compute_params().flat().data, im.flag(), cache.attention_ws_.get()};
    for (int l = 0; l < c.n_layers; ++l) {
      key.buffers.push_back(cache.k_[(size_t)l].data());
      key.buffers.push_back(cache.v_[(size_t)l].data());
    }
    cudaGraphExec_t exec = nullptr;
    for (auto& [k2, e] : sw->graphs)
      if (k2 == key) exec = e;
    if (exec == nullptr) {
      if (sw->capture_stream == nullptr) {
        FOURBIT_CUDA_CHECK(cudaStreamCreateWithFlags(&sw->capture_stream, cudaStreamNonBlocking));
      }
      if (sw->graphs.size() >= 16) {  // many layouts: start over
        FOURBIT_CUDA_CHECK(cudaDeviceSynchronize());
        for (auto& [k2, e] : sw->graphs) cudaGraphExecDestroy(e);
        sw->graphs.clear();
      }
      std::string failure;
      FOURBIT_CUDA_CHECK(cudaStreamBeginCapture(sw->capture_stream, cudaStreamCaptureModeThreadLocal));
      stream = sw->capture_stream;
      try {
        body();
      } catch (const std::exception& e) {
        failure = e.what();
      }
      stream = options_.stream;
      cudaGraph_t graph = nullptr;
      const cudaError_t ended = cudaStreamEndCapture(sw->capture_stream, &graph);
      if (ended != cudaSuccess && failure.empty()) failure = cudaGetErrorString(ended);
      if (failure.empty() && graph != nullptr) {
        const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
        if (made != cudaSuccess) {
          failure = cudaGetErrorString(made);
          exec = nullptr;
        }
      }
      if (graph != nullptr) cudaGraphDestroy(graph);
      (void)cudaGetLastError();  // a failed capture leaves its error here
      if (exec != nullptr) {
        sw->graphs.push_back({std::move(key), exec});
      } else {
        sw->graphs_enabled = false;
        log_warn("forward_cached: capturing the decode step as a CUDA graph failed ({}); the decode steps run "
                 "eagerly", failure);
      }
    }
    if (exec != nullptr) {
      FOURBIT_CUDA_CHECK(cudaGraphLaunch(exec, (cudaStream_t)options_.stream));
    } else {
      body();
    }
#else
    body();
#endif
  }
  im.check_error_flag("forward_cached");
  if (chain) ++decode_chain_steps_;
  if (any_rope || any_swiglu) ++decode_epilogue_steps_;
  cache.lengths_ = new_lengths;
  return a.logits;
}

}  // namespace fourbit::model
