// The transformer (config.h): parameters laid out by the parameter table (params.h), a training
// forward and backward written out op by op (no autograd), and a KV-cache forward for generation.
//
// Devices and dtypes.
//   CPU:  every parameter, gradient and activation in ModelOptions::cpu_dtype: f32, or f64 for the
//         finite-difference gradient checks (plain recipes only: the quantizers take f32 sources).
//         Ops run their CPU references, GEMMs the CPU backends (OpenBLAS in f32, the float64
//         reference in f64); quantized recipes use the reference quantizers.
//   CUDA: FP32 master parameters and FP32 parameter gradients; a BF16 copy of the parameters for
//         the GEMMs (refresh it with params_changed() after writing the master weights; AdamW can
//         write it in its update pass); BF16 activations and activation gradients; FP32 norm
//         statistics, attention logsumexp, router logits/probabilities/gates, losses. Norm weights,
//         the embedding lookup and the router bias read the FP32 master.
// Every linear layer runs gemm::linear_fprop / dgrad / wgrad (the routed experts
// model/expert_linear.h's grouped GEMMs) under the gemm::LinearRecipe that the ResolvedRecipe
// gives for (stage, block, kind): pretraining uses pretrain_linear(block, kind), RL training
// linear(rl_trainer, ...), the KV-cache forward the Fprop operands of the stage it is given
// (rl_sampler by default).
//
// Memory. Activations (what the backward needs) and the backward's scratch come from one Arena
// per model, sized at construction for ModelOptions::max_batch x max_seq tokens by the same code
// that carves the buffers (so the size is exact, not an estimate); activation_bytes() reports it.
// Quantized recipes keep the Wgrads' X as quantized copies outside the arena (allocated per
// forward, released by the backward; ModelOptions::keep_wgrad_inputs, saved_wgrad_input_bytes()).
// A KvCache holds its own cache tensors and step arena.
//
// Conventions. forward() overwrites the activations of the previous call; backward() differentiates
// the last forward() and ACCUMULATES into the parameter gradients (zero_grads() first; gradient
// accumulation over micro-batches is repeated forward/backward). backward() overwrites the logits
// with their gradient (the fused in-place cross-entropy): read logits() before it (or, under
// ForwardOptions::loss_gradient_scale, the forward does, and logits() is the gradient already).
// The objective is  ce + moe.aux_loss_coef * aux + moe.z_loss_coef * z, with ce the mean over
// valid targets (target -1 = ignored) and aux, z averaged over the MoE blocks (aux only with
// load_balancing = aux_loss), all times BackwardOptions::loss_scale.
//
// Quantized recipes on CUDA: the quantize kernels take whole tiles of 64 token rows (128 with FP8
// block scales) and 128 features, so the token count of a pass (B * T, or B * Tq in the KV-cache
// forward) must be a multiple of 64 (128) when the recipe quantizes a token-side operand (checked,
// with a message), and every layer width a multiple of 128 (the presets' are). MoE blocks pad the
// permuted tokens themselves.
//
// Synchronization (CUDA): forward() synchronizes to read the loss and, in MoE blocks, once per
// block to read the expert counts (the grouped GEMMs' sizes live on the host); gemm::linear_*
// allocate their quantized operands per call (cudaMalloc/cudaFree synchronize). Everything runs on
// ModelOptions::stream.
#pragma once

#include "core/arena.h"
#include "core/tensor.h"
#include "model/config.h"
#include "model/params.h"
#include "model/profile.h"
#include "ops/cross_entropy.h"
#include "ops/moe.h"
#include "recipe/recipe.h"

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace fourbit::ops {
class AttentionDecodeWorkspace;  // ops/attention.h
}  // namespace fourbit::ops

namespace fourbit::model {

// Which recipe stages a training step runs: pretraining (pretrain_forward Fprop, pretrain_backward
// Dgrad/Wgrad) or RL training (rl_trainer for all three).
enum class TrainingStage : uint8_t { kPretrain, kRlTrainer };

struct ModelOptions {
  Device device = Device::kCpu;
  DType cpu_dtype = DType::kF32;  // CPU only: f32 or f64
  uint64_t seed = 0;              // parameter initialization (params.h) and stochastic rounding
  int max_batch = 1;              // the activation arena holds max_batch x max_seq tokens
  int max_seq = 0;                // 0: config.max_seq
  void* stream = nullptr;         // cudaStream_t
  // CPU f32 only: mirror the CUDA model's roundings: every activation and activation gradient
  // that the CUDA model stores in bf16 is rounded to bf16 (in f32), and the GEMMs read the master
  // weights rounded to bf16. The reference the gpu tests compare the CUDA model with: the
  // quantizers then see the same values on both sides.
  bool cpu_bf16_rounding = false;
  // CPU only: the backend of every GEMM (kAuto: OpenBLAS in f32 where built, else the naive
  // reference). The gpu tests build the reference twice, once per CPU backend, to measure how far
  // FP32 summation order alone moves a quantized model's results.
  gemm::Backend cpu_gemm_backend = gemm::Backend::kAuto;
  // Training forwards keep X [N, K] of a linear layer until its Wgrad. When the recipe quantizes
  // the Wgrad's X (all quantized presets), the backward reads only X's column-wise quantized copy,
  // so by default the forward keeps that copy instead (gemm::linear_fprop_saving_x; NVFP4: 4.5 bits
  // per value instead of 16) for the layers whose X nothing else in the backward reads: qkv (ln1),
  // and in dense blocks mlp_up (ln2) and mlp_down (act). The gradients are bit for bit the same.
  // Those X are then not named activations (they live in per-pass scratch). true (or the
  // environment variable FOURBIT_KEEP_WGRAD_INPUTS=1): keep every X, one quantization pass per
  // GEMM operand (the reference path).
  bool keep_wgrad_inputs = false;
  // CUDA: where an NVFP4 one-pass quantization of a linear layer's X or dY follows the op that
  // wrote the tensor (SwiGLU forward -> mlp_down's X, SwiGLU backward -> mlp_up's dY, in dense
  // blocks; the residual-gradient adds after the norm backwards -> attn_out's and mlp_down's dY),
  // that op also computes the tensor's global amaxes (ops::OutputAmaxes), and the quantizer skips
  // its own pass over the tensor. The gradients are bit for bit the same. On by default since
  // session 15 measured it (bench/notes-train.md: gpt2-124m nvfp4 B 32 93.74 -> 93.20 ms, H100);
  // FOURBIT_FUSED_AMAX=0 turns it off for every model of the process, =1 on (A/B runs).
  bool fuse_producer_amax = true;
  // The training forward adds the residual stream inside two GEMMs' epilogues (mid = resid +
  // attn_out(...), a dense block's out = mid + mlp_down(...); GemmArgs::c_source) instead of a
  // separate add after each, and a MoE block's shared expert adds its output to the routed
  // experts' in its mlp_down epilogue. The sum is formed in FP32 and rounded once to BF16 (the separate add
  // rounds the GEMM's output first), so the bits differ slightly from the unfused forward. The
  // backward likewise adds each block norm's input gradient to the residual gradient inside the
  // RMSNorm backward (ops::rmsnorm_backward_accumulate, bit for bit the separate add, and with the
  // next dY's amaxes for the NVFP4 recipes where its kernel can compute them:
  // rmsnorm_backward_accumulate_amaxes_supported). Not under a GemmObserver.
  // FOURBIT_FUSE_RESIDUAL=0 turns both off for every model of the process, =1 on (A/B runs).
  // Faster in every recipe (H100, session 21, bench train, unfused -> fused: gpt2-124m bf16 69.42
  // -> 68.37 ms, fp8 72.97 -> 71.56, 1.3b bf16 277.44 -> 275.42, nvfp4 324.04 -> 317.56, fp8
  // 259.49 -> 252.52). Checked against the separate adds element by element
  // (ModelCuda.FusedResidualAddsMatchTheSeparateAdds) and, with the bf16 recipe, against the CPU
  // model doing the same fused adds (Bf16RecipeMatchesTheCpuReference: the MoE routing compared
  // where the router margins leave no doubt). ModelCuda.QuantizedRecipesMatchTheCpuReference runs
  // with the separate adds: there the one rounding moves a few residual elements by one BF16 ulp,
  // and where one of them sets an NVFP4 per-tensor amax the whole tensor's scales move
  // (bench/notes-train.md, session 21: block 0's gradients 7e-2 from the CPU's against a 3.6e-2
  // bound), a chance the GPU's GEMM summation order decides, not a defect of either add.
  bool fuse_residual_add = true;
  // The loss's exponential on the GPU (ops::CrossEntropyExp): the special-function unit's
  // ex2.approx by default (H100, session 21: gpt2-124m bf16 B 32 69.64 / 69.92 -> 68.95 / 68.78 ms a
  // step against expf; OpsCrossEntropyCuda checks both against the CPU reference). Its ~1e-6
  // relative error in dlogits moves BF16 roundings, then NVFP4 per-tensor amaxes, as the fused adds
  // above do, so ModelCuda.QuantizedRecipesMatchTheCpuReference runs with kExpf.
  // FOURBIT_CE_EXP=expf|sfu overrides it for every call of the process.
  ops::CrossEntropyExp cross_entropy_exp = ops::CrossEntropyExp::kSfu;
  // The attention backward rotates dq and dk back through RoPE in its own epilogues
  // (ops::AttentionOptions::rope_backward: the same bits as the separate rope_backward pass, one
  // pass over dq and dk fewer). FOURBIT_FUSE_ROPE=0 turns it off for every model of the process,
  // =1 on (A/B runs). Not with cpu_bf16_rounding (which rounds between the two). On since its GPU
  // test (OpsAttentionCuda.RopeBackwardInTheEpiloguesEqualsTheSeparatePass) passed on the H100
  // (session 20: 12 RoPE launches of ~83 us a step fewer at gpt2-124m B 32).
  bool fuse_rope_backward = true;
  // Activation recomputation (training): ln1, qkv, and a dense block's ln2, gate_up and (where it
  // is not kept quantized) SwiGLU output live in per-pass scratch instead of one buffer per block,
  // and the backward recomputes them (the RMSNorms, the GEMM, RoPE, SwiGLU) right before it needs
  // them. The same bits (every recomputed op is deterministic and sees the forward's inputs); less
  // memory (gpt2-124m B 32: ~0.42 GB a block with nvfp4, ~0.65 GB with bf16) for one more qkv and
  // mlp_up GEMM a block. FOURBIT_RECOMPUTE=0|1 overrides it for every
  // model of the process (A/B runs). Off by default.
  bool recompute_activations = false;
};

struct ForwardOptions {
  TrainingStage stage = TrainingStage::kPretrain;
  uint64_t step = 0;  // keys the stochastic-rounding draws (with the seed), see model.cpp
  // Routing replay (RL.md): host i32 [B*T, n_moe_layers, top_k], the experts every token uses in
  // every MoE block (in the order of moe.layers); absent: the router selects.
  TensorView forced_expert_ids;
  // A non-finite loss: find the first non-finite activation (forward order) and throw naming it.
  bool check_finite = true;
  // false: no backward follows (evaluation, log-probabilities only): the forward skips what only
  // the backward reads (the Wgrads' quantized X copies), and backward() refuses to run.
  bool for_backward = true;
  // Set (pretraining): the backward that follows gets BackwardOptions{loss_scale = this value, no
  // token_weights}, so the forward's cross-entropy pass may write the loss gradient over the
  // logits right away (ops::cross_entropy_forward_backward_inplace: the logits are read once,
  // not once by the forward and again by the backward). The logits are then gone when forward()
  // returns (logits() holds their gradient). backward() refuses other options. Unset: RL (its
  // token weights come from this forward's outputs), evaluation, anything that reads logits().
  // FOURBIT_FUSE_LOSS_GRAD=0 keeps the gradient in the backward for A/B runs (same bits).
  std::optional<double> loss_gradient_scale;
};

struct BackwardOptions {
  double loss_scale = 1.0;  // d objective / d loss (e.g. 1 / micro-batches)
  // Per-token loss weights (the RL policy-gradient loss, RL.md): host f32 [B*T] of the last
  // forward. When given, the cross-entropy term of the objective is sum_n token_weights[n] *
  // token_loss[n] (instead of the mean over valid targets), i.e. d objective / d token_loss[n] =
  // loss_scale * token_weights[n]; ignored targets get no gradient whatever their weight. The
  // weights are constants (no gradient flows into them) and may be negative.
  TensorView token_weights;
};

struct LossInfo {
  double loss = 0;  // the objective: ce + aux_loss_coef * aux + z_loss_coef * z
  double ce = 0;    // mean cross-entropy over valid targets (0 when none)
  double aux = 0;   // MoE auxiliary loss averaged over the MoE blocks (perfect balance: top_k)
  double z = 0;     // router z-loss averaged over the MoE blocks
  int64_t n_valid = 0;
};

// Keys and values of every block for B sequences of up to max_len positions, plus the scratch of
// one KV-cache forward of up to max_step_tokens tokens per sequence. Made by Model::make_kv_cache.
class KvCache {
 public:
  int batch() const { return batch_; }
  int max_len() const { return max_len_; }
  int max_step_tokens() const { return max_step_tokens_; }
  const std::vector<int32_t>& lengths() const { return lengths_; }  // valid positions per sequence
  void reset();  // empties every sequence (the memory stays)
  int64_t bytes() const;  // cache tensors + step arena

 private:
  friend class Model;
  int batch_ = 0, max_len_ = 0, max_step_tokens_ = 0;
  std::vector<Tensor> k_, v_;      // per block [B, max_len, Hkv, D] (activation dtype)
  std::vector<int32_t> lengths_;   // host [B]
  Tensor lengths_device_;          // i32 [B] on the model's device
  std::unique_ptr<Arena> arena_;   // one step's activations
  std::shared_ptr<ops::AttentionDecodeWorkspace> attention_ws_;  // split-cache decode scratch (CUDA)
};

struct CachedForwardOptions {
  // The stage whose Fprop operands the linear layers use: rl_sampler (the sampler), rl_trainer,
  // or pretrain_forward.
  recipe::Stage stage = recipe::Stage::kRlSampler;
  bool all_logits = false;  // logits of every row [B * Tq, V] instead of each sequence's last [B, V]
  TensorView forced_expert_ids;  // host i32 [B * Tq, n_moe_layers, top_k] (routing replay)
  TensorView expert_ids_out;     // host i32 [B * Tq, n_moe_layers, top_k], optional: the routing
};

// One linear-layer GEMM as the model ran it, for a GemmObserver (the precision audit,
// src/audit/audit.h). Called right after the GEMM, on the model's thread; the views are valid during
// the call only (device tensors stay on the device; the observer copies what it keeps).
//   Fprop  a = X  [M, K], b = W [N, K], out = Y  [M, N]
//   Dgrad  a = dY [M, N], b = W [N, K], out = dX [M, K]
//   Wgrad  a = dY [M, N], b = X [M, K], out = dW [N, K] (ACCUMULATED: beta = 1 over the backward)
// Routed experts: W is the stacked [E, N, K] (dW too) and group_sizes holds the rows of each
// expert (the permuted token buffers, zero-padded up to the recipe's alignment); empty otherwise.
// a, b are the high-precision sources the recipe's quantizers read (`recipe`: the per-operand
// quantizers of this layer in this pass; sr: the stochastic-rounding streams the call used).
struct GemmObservation {
  std::string_view layer;  // "blocks.2.qkv", "blocks.1.expert_up", "lm_head"
  recipe::Stage stage;     // pretrain_forward / pretrain_backward / rl_sampler / rl_trainer
  recipe::Gemm gemm;
  const gemm::LinearRecipe* recipe = nullptr;
  TensorView a, b, out;
  std::span<const int64_t> group_sizes;
  RandomStream sr;
};
using GemmObserver = std::function<void(const GemmObservation&)>;

// Expert parallelism as the model sees it (dist/expert_parallel.h implements it over a
// communicator): the ROUTED experts of every MoE block run across the ranks of a run. Every rank
// routes its own tokens (the router is replicated); rank r computes experts
// [first_local_expert(), first_local_expert() + n_local_experts()) for the tokens of every rank,
// so each rank's expert GEMMs see only its own experts, with the rows of all ranks. The shared
// expert, attention and everything else stay local. Used by Model::forward (training and
// evaluation passes) and Model::backward while attached; the KV-cache passes (generation) keep
// running every expert locally.
// Every call is a collective: all ranks run the same forwards and backwards in the same order.
// Parameters stay replicated (each rank holds all E experts, updated by the data-parallel
// optimizer, dist/zero_optimizer.h): a rank's gradient rows of the experts it does not own stay
// zero, so the ranks' gradient sum is the one-rank gradient.
class RoutedExperts {
 public:
  virtual ~RoutedExperts() = default;
  virtual int first_local_expert() const = 0;
  virtual int n_local_experts() const = 0;
  // MoE block `moe_index` (0 .. n_moe_layers - 1), N tokens of this rank, k slots, C channels:
  // y [N, C] (overwritten) = sum over each token's slots of gate * expert(x). x [N, C], expert_ids
  // i32 [N, k] (global ids), gates [N, k] (stat dtype), w_up [E_local, 2 Fe, C], w_down
  // [E_local, C, Fe] (this rank's experts, compute copy). up / down: the expert_up / expert_down
  // recipes and GEMM options of this block and pass. The views must stay valid until backward.
  virtual void forward(int moe_index, const TensorView& x, const TensorView& expert_ids,
                       const TensorView& gates, const TensorView& w_up, const TensorView& w_down,
                       const TensorView& y, const gemm::LinearRecipe& up_recipe,
                       const gemm::LinearRecipe& down_recipe, const gemm::LinearOptions& up,
                       const gemm::LinearOptions& down) = 0;
  // The gradient of block moe_index's last forward: dx [N, C] and d_gates [N, k] overwritten;
  // dw_up [E_local, 2 Fe, C] and dw_down [E_local, C, Fe] ACCUMULATE over every rank's tokens.
  virtual void backward(int moe_index, const TensorView& dy, const TensorView& dx,
                        const TensorView& d_gates, const TensorView& dw_up,
                        const TensorView& dw_down, const gemm::LinearOptions& up,
                        const gemm::LinearOptions& down) = 0;
};

class Model {
 public:
  // Validates the config, builds the parameter table, allocates and initializes the parameters
  // (seed), zero gradients, and the activation arena. `recipe` must be resolved for this config's
  // shape (config.recipe_shape()).
  Model(ModelConfig config, recipe::ResolvedRecipe recipe, const ModelOptions& options);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return config_; }
  const recipe::ResolvedRecipe& recipe() const { return recipe_; }
  const ParamTable& table() const { return table_; }
  Device device() const { return options_.device; }
  DType activation_dtype() const { return act_dtype_; }  // bf16 on CUDA, cpu_dtype on the CPU
  DType stat_dtype() const { return stat_dtype_; }       // f32 on CUDA, cpu_dtype on the CPU
  int max_batch() const { return options_.max_batch; }
  // The same weights under another recipe (resolved for this config's shape). The activation
  // arena is resized to what the new recipe's training forward needs (MoE group alignment, Wgrad
  // inputs kept quantized or not); make KV caches after it (a cache's step arena is sized for the
  // recipe of its time).
  void set_recipe(recipe::ResolvedRecipe recipe);
  int max_seq() const { return max_seq_; }

  // ---- parameters ------------------------------------------------------------------------------
  const ParamBuffer& params() const { return params_; }  // master: f32 (CUDA, CPU f32) or f64
  // Same layout and dtype as params(). zero_grads() only marks every gradient as zero: its first
  // writer in backward() overwrites it (beta 0) instead of a fill followed by accumulation; what
  // no op wrote is filled at the end of backward(), or here (and in grad()) when read before. The
  // alignment padding between parameters in grads().flat() is zeroed at construction and written
  // by nobody (dist's ZeRO optimizer reduces flat slices that include it).
  const ParamBuffer& grads() const {
    write_pending_grad_zeros();
    return grads_;
  }
  // What the GEMMs read: the BF16 copy on CUDA, the master itself on the CPU.
  const ParamBuffer& compute_params() const { return compute_.defined() ? compute_ : params_; }
  TensorView param(std::string_view name) const { return params_.view(table_.index_of(name)); }
  TensorView grad(std::string_view name) const { return grads().view(table_.index_of(name)); }
  void zero_grads();
  // Refreshes the BF16 compute copy from the master weights (CUDA; a no-op on the CPU).
  void params_changed();

  // ---- training --------------------------------------------------------------------------------
  // tokens, targets: host i32 [B, T], B <= max_batch, T <= max_seq; targets[b, t] is the token
  // after tokens[b, t] or -1 (ignored). Returns the losses (synchronizes).
  LossInfo forward(const TensorView& tokens, const TensorView& targets, const ForwardOptions& options = {});
  // The gradient of the last forward's objective, accumulated into grads().
  void backward(const BackwardOptions& options = {});
  // [B*T] -log p(target) of every token of the last forward (0 where the target is -1): the
  // per-token log-probabilities the RL trainer needs. Stat dtype, on the model's device.
  TensorView token_losses() const;
  // [B*T, V] logits of the last forward (activation dtype); overwritten by backward(), or by the
  // forward itself under ForwardOptions::loss_gradient_scale.
  TensorView logits() const;
  // The last forward's routing, host i32 [B*T, n_moe_layers, top_k] (copied into `out`).
  void expert_ids(const TensorView& out) const;
  // The last forward's expert counts per MoE block (host).
  const std::vector<std::vector<int32_t>>& expert_counts() const { return counts_host_; }
  // Auxiliary-loss-free load balancing (load_balancing = bias): after a training step, moves each
  // MoE block's selection bias by bias_update_rate * sign(mean count - count_e) using the last
  // forward's counts. A no-op otherwise.
  void update_router_bias();

  // ---- non-finite values -----------------------------------------------------------------------
  // Throws naming the first activation of the last forward (in forward order) that holds a NaN or
  // an Inf, with counts and position (ops::check_finite); returns if all are finite. After a
  // backward, the activations it overwrote in place are skipped.
  void check_activations_finite() const;
  // The activations of the last forward by name, in forward order ("embedding",
  // "blocks.0.attn_norm", "blocks.0.attn.qkv", ..., "logits"); views valid until the next forward.
  // attn_norm, mlp_norm and mlp.act appear only where they are kept (ModelOptions::keep_wgrad_inputs).
  // Those the backward overwrites in place (gate_up, h_perm, logits) hold gradients after it.
  std::vector<std::string> activation_names() const;
  TensorView activation(std::string_view name) const;  // throws listing the names
  // The same over the parameter gradients (named by their parameter) and then the parameters.
  void check_grads_finite() const;
  void check_params_finite() const;

  int64_t activation_bytes() const;       // the arena's capacity
  int64_t activation_peak_bytes() const;  // the most it has held
  // Bytes of the quantized Wgrad inputs the last training forward kept outside the arena
  // (ModelOptions::keep_wgrad_inputs); the backward releases each after its Wgrad.
  int64_t saved_wgrad_input_bytes() const;
  // Whether this model's training forward and backward fuse the residual adds
  // (ModelOptions::fuse_residual_add, or FOURBIT_FUSE_RESIDUAL where it is set; never under a
  // GemmObserver).
  bool fuses_residual_add() const;

  // ---- generation ------------------------------------------------------------------------------
  // A cache for `batch` sequences of up to max_len positions (<= config.max_seq), whose forward
  // steps take up to max_step_tokens tokens per sequence.
  KvCache make_kv_cache(int batch, int max_len, int max_step_tokens) const;
  // One KV-cache forward step. tokens: host i32 [B, Tq] (B = cache.batch(), Tq <= max_step_tokens).
  // Sequence b's real tokens are its LAST n_new[b] rows (right-aligned; the rows before are
  // padding, as when prompts of different lengths are prefilled together); they take positions
  // lengths[b] .. lengths[b] + n_new[b] - 1, their keys and values are appended to the cache, and
  // lengths[b] grows by n_new[b]. Prefill: Tq = longest prompt; decode: Tq = 1, n_new = 1.
  // Returns logits, f32 on CUDA (cpu_dtype on the CPU): [B, V] for each sequence's last row, or
  // [B * Tq, V] with all_logits (padding rows hold garbage); a view valid until the next step.
  // Uses the same weights, ops and kernels as forward(); attention through ops::attention_decode.
  TensorView forward_cached(KvCache& cache, const TensorView& tokens, std::span<const int32_t> n_new,
                            const CachedForwardOptions& options = {});

  // Sampler weights (CUDA; no-ops on the CPU): a packed NVFP4 copy (4.5 bits per value) of every
  // dense linear weight that the rl_sampler stage quantizes to NVFP4, quantized from the BF16
  // compute copy as the emulated path does (BF16 layers read the compute copy). While they exist,
  // forward_cached with stage rl_sampler and at most 64 tokens per step (B * Tq <= 64) runs its
  // dense linear layers through the decode GEMV (gemm/decode_gemv.h): the same function as the
  // emulated path up to FP32 summation order, with no 64-token tile; dense models replay each step
  // layout as a CUDA graph (unless a profiler or a GEMM observer is attached). Refresh after the
  // master weights change (params_changed() does not) and after set_recipe (a stale copy is an error).
  // sampler_weights_supported: whether the decode GEMV implements every layer of the copy (weights
  // BF16 or NVFP4 round-to-nearest, activations BF16 or NVFP4 1x16 round-to-nearest); false without
  // a copy. `why` receives the first layer it does not implement and the reason (or that there is
  // no copy). An unsupported copy makes forward_cached throw on the decode path: release it.
  void refresh_sampler_weights();
  void release_sampler_weights() { sampler_.reset(); }
  bool has_sampler_weights() const { return sampler_ != nullptr; }
  bool sampler_weights_supported(std::string* why = nullptr) const;
  int64_t sampler_weight_bytes() const;  // packed data + scales of the NVFP4 copies
  // The decode chain (gemm::decode_gemv_chain): on the decode path of a dense model with BF16
  // activations and at most 8 tokens a step, each layer's attn_out, mlp_up (RMSNorm fused),
  // mlp_down (SwiGLU fused) and the next layer's qkv (RMSNorm fused; after the last layer the
  // lm_head with the final norm, where its weight has the same format) run as one persistent
  // launch, bit for bit the separate kernels' results. Off by default until measured on a GPU:
  // FOURBIT_DECODE_CHAIN=1 turns it on for the process, set_decode_chain(true) for this model.
  void set_decode_chain(bool on) { decode_chain_ = on; }
  bool decode_chain() const { return decode_chain_; }
  int64_t decode_chain_steps() const { return decode_chain_steps_; }  // forward_cached calls that ran it
  // The decode GEMVs' epilogues (gemm::DecodeGemvArgs::swiglu / rope): the dense MLP's SwiGLU in
  // mlp_up's epilogue and RoPE with the KV-cache append in qkv's, up to 16 tokens a step, bit for
  // bit the separate kernels' results. kAuto: where the layer's next quantizer has NVFP4 activations
  // and the step has at most 8 tokens (measured faster there only: model_cached.cpp); kOn: wherever
  // the GEMV allows; kOff: never; kDefault (a new model's): FOURBIT_DECODE_SWIGLU_EPILOGUE /
  // FOURBIT_DECODE_ROPE_EPILOGUE (1 or 0) where set, else off, because the model-level GPU test of
  // the epilogues (DecodeEpiloguesEqualSeparateKernels) has not run yet; kAuto is to become the
  // default once it has. An explicit kAuto / kOn / kOff takes precedence over the environment.
  enum class DecodeEpilogues : uint8_t { kDefault, kAuto, kOn, kOff };
  void set_decode_epilogues(DecodeEpilogues e) { decode_epilogues_ = e; }
  int64_t decode_epilogue_steps() const { return decode_epilogue_steps_; }  // forward_cached calls that used one
  struct SamplerWeights;  // model_cached.cpp

  // Timing hooks (profile.h); null detaches. Not owned.
  void set_profiler(Profiler* profiler) { profiler_ = profiler; }
  // Called after every linear-layer GEMM (GemmObservation); an empty function detaches.
  // While one is attached, training forwards keep every Wgrad input X (the audit measures X's
  // quantization), as with ModelOptions::keep_wgrad_inputs; attaching or detaching may resize the
  // arena, which drops the last forward's activations (run forward again).
  void set_gemm_observer(GemmObserver observer);

  // Expert parallelism (RoutedExperts above); null detaches. Not owned. Needs an MoE config whose
  // expert count is the implementation's, and no GEMM observer (the audit reads the local
  // experts' operands) and no cpu_bf16_rounding; both are refused here and at set_gemm_observer.
  void set_routed_experts(RoutedExperts* experts);
  RoutedExperts* routed_experts() const { return routed_experts_; }

  struct Impl;  // the forward/backward machinery (model.cpp)

 private:
  void check_recipe_shape() const;
  bool size_arena();  // exactly what a training forward needs; true when it made a new arena

  ModelConfig config_;
  recipe::ResolvedRecipe recipe_;
  ModelOptions options_;
  bool decode_chain_ = default_decode_chain();
  int64_t decode_chain_steps_ = 0;
  DecodeEpilogues decode_epilogues_ = DecodeEpilogues::kDefault;
  int64_t decode_epilogue_steps_ = 0;
  static bool default_decode_chain();
  ParamTable table_;
  DType act_dtype_, stat_dtype_;
  int max_seq_ = 0;
  ParamBuffer params_, grads_, compute_;
  // grad_zero_pending_[i]: parameter i's gradient is zero by zero_grads() but not written yet.
  mutable std::vector<char> grad_zero_pending_;
  void write_pending_grad_zeros() const;  // fills every pending gradient (synchronous), clears all
  std::unique_ptr<Arena> arena_;
  std::unique_ptr<Impl> impl_;
  std::vector<std::vector<int32_t>> counts_host_;
  Profiler* profiler_ = nullptr;
  GemmObserver gemm_observer_;
  RoutedExperts* routed_experts_ = nullptr;
  std::shared_ptr<SamplerWeights> sampler_;  // shared_ptr: complete only in model_cached.cpp
};

}  // namespace fourbit::model
