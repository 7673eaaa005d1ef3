// Internal to the model module: the activation buffers, the carving of the arena, and the
// forward/backward machinery shared by the training path (model.cpp) and the KV-cache forward
// (model_cached.cpp). Not part of the API.
#pragma once

#include "gemm/linear.h"
#include "model/model.h"
#include "ops/moe.h"
#include "ops/output_amax.h"

#include <array>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace fourbit::model::detail {

// Carves buffers out of an arena in order, or (arena == nullptr) only counts the bytes they would
// take with the arena's alignment: the same planning code sizes the arena and fills it.
class Carver {
 public:
  Carver(Arena* arena, Device device) : arena_(arena), device_(device) {}
  TensorView take(Shape shape, DType dtype, std::string_view name);
  int64_t bytes() const { return bytes_; }

 private:
  Arena* arena_;
  Device device_;
  int64_t bytes_ = 0;
};

// Indices into the parameter table of one block's parameters (-1: absent).
struct BlockParams {
  int attn_norm = -1, qkv = -1, attn_out = -1, mlp_norm = -1;
  int mlp_up = -1, mlp_down = -1;                  // dense MLP, or the shared expert
  int router = -1, router_bias = -1, experts_up = -1, experts_down = -1;
};

// The activations of one block. N = tokens, C = d_model, R = rows of the permuted MoE buffers
// (the worst case moe_permuted_rows, which moe_plan requires; the expert GEMMs use the first
// `rows` of them, the rest are padding that nothing reads).
//
// Training blocks whose recipe quantizes the Wgrad's X (Model::Impl::saves_quantized_x) keep that
// operand's column-wise quantized copy (saved_*, gemm::linear_fprop_saving_x) instead of X: ln1,
// ln2 and act then point at per-pass scratch that every block overwrites (only the forward reads
// them), and save_* says so. The backward's Wgrad reads saved_* and releases it.
struct BlockActs {
  TensorView ln1;        // [N, C]       attn_norm output
  TensorView ln1_rstd;   // [N]          stat dtype
  TensorView qkv;        // [N, (H + 2 Hkv) D]  after RoPE (q and k rotated in place)
  TensorView attn;       // [N, H D]     attention output
  TensorView lse;        // [B, H, T]    stat dtype (training only)
  TensorView ln2;        // [N, C]       mlp_norm output
  TensorView ln2_rstd;   // [N]
  TensorView gate_up;    // [N, 2F]      dense MLP or shared expert (F = d_ff or expert_d_ff)
  TensorView act;        // [N, F]
  bool save_ln1 = false, save_ln2 = false, save_act = false;
  // ln1 / ln2 live in per-pass scratch (only a quantized Wgrad copy kept, or recomputation): the
  // backward recomputes them from resid / mid where it needs them (recompute_qkv / _gate_up).
  bool scratch_ln1 = false, scratch_ln2 = false;
  std::optional<quant::QuantizedTensor> saved_ln1;  // qkv's X: stored [C, N]
  std::optional<quant::QuantizedTensor> saved_ln2;  // mlp_up's X (dense blocks): stored [C, N]
  std::optional<quant::QuantizedTensor> saved_act;  // mlp_down's X (dense blocks): stored [F, N]
  // MoE
  TensorView router_logits;  // [N, E]  stat dtype
  TensorView probs;          // [N, E]  stat dtype
  TensorView expert_ids;     // i32 [N, k]
  TensorView gates;          // [N, k]  stat dtype
  TensorView counts;         // i32 [E]
  TensorView router_losses;  // [2] = {aux, z}, stat dtype
  TensorView offsets;        // i32 [E + 1]
  TensorView slot_rows;      // i32 [N, k]
  TensorView row_slots;      // i32 [R]
  TensorView x_perm;         // [R, C]
  TensorView h_perm;         // [R, 2 Fe]
  TensorView act_perm;       // [R, Fe]
  TensorView y_perm;         // [R, C]
  TensorView shared_out;     // [N, C]  (n_shared_experts = 1)
  // Host side of the last forward of this block.
  int64_t rows = 0;                  // sum of the group sizes (rows in use)
  std::vector<int64_t> group_sizes;  // [E]
  std::vector<int32_t> counts_host;  // [E]

  ops::MoePlan plan() const;
};

// The backward's scratch (training only), reused by every block.
struct Scratch {
  TensorView d_resid;     // [N, C]  gradient w.r.t. the residual stream
  TensorView d_tmp;       // [N, C]
  TensorView d_ln;        // [N, C]
  TensorView d_qkv;       // [N, (H + 2 Hkv) D]
  TensorView d_attn;      // [N, H D]
  TensorView d_act;       // [N, max(F, Fe)]
  TensorView d_perm_c;    // [R, C]   d_y_perm, then d_x_perm
  TensorView d_perm_f;    // [R, Fe]  d_act_perm
  TensorView d_gates;     // [N, k]   stat dtype
  TensorView d_logits;    // [N, E]   stat dtype
  TensorView d_logits_c;  // [N, E]   activation dtype (CUDA: the router GEMMs' bf16 operand)
  TensorView norm_ws;     // CUDA rmsnorm_backward workspace (u8)
  TensorView emb_ws;      // CUDA embedding_backward workspace (u8)
};

// Every buffer of one forward (and backward) over B x T tokens.
struct Acts {
  bool training = false;  // per-block activations kept for the backward
  bool for_backward = true;  // ForwardOptions::for_backward of the training forward
  int B = 0, T = 0;
  int64_t N = 0;
  TensorView tokens;     // i32 [N]
  TensorView targets;    // i32 [N]
  TensorView positions;  // i32 [N]
  TensorView write_pos;  // i32 [N]  KV-cache forward: cache position of each row (-1: padding)
  TensorView forced;     // i32 [N, k] (MoE): one block's forced expert ids
  std::vector<TensorView> resid;  // [N, C] each: L + 1 (training) or 2 (ping-pong, KV cache)
  std::vector<TensorView> mid;    // [N, C] each: the residual after attention, L or 1
  std::vector<BlockActs> blocks;  // L (training) or 1 (KV cache: reused by every block)
  TensorView last_rows;  // [B, C]  KV cache: each sequence's last row of the final residual
  TensorView lnf;        // [rows, C]  final norm output
  TensorView lnf_rstd;   // [rows]
  TensorView logits;     // [rows, V]
  TensorView losses;     // [N] stat dtype
  TensorView mean_loss;  // [1] stat dtype
  TensorView lse;        // [N] stat dtype: the forward's per-token log-sum-exp of the logits,
                         // read by the backward's one-pass cross-entropy gradient (training)
  Scratch s;
};

// The mode that picks the LinearRecipe of every layer.
enum class Mode : uint8_t { kPretrain, kRlTrainer, kRlSampler };
inline constexpr int kNumModes = 3;

}  // namespace fourbit::model::detail

namespace fourbit::model {
// A parameter's gradient as a GEMM output: beta 1 accumulates into it, beta 0 overwrites it (its
// first writer after Model::zero_grads(), which then need not have been filled with zeros).
struct GradOut {
  const TensorView& view;
  float beta = 1.0f;
};

struct Model::Impl {
  explicit Impl(Model& model);
  void build_recipes();  // from m.recipe_

  Model& m;
  const ModelConfig& cfg;
  std::vector<detail::BlockParams> bp;
  int embedding = -1, final_norm = -1, lm_head = -1;  // lm_head: the embedding row when tied
  // [mode][block * kKinds + kind]; lm_head at block n_layers.
  std::array<std::vector<gemm::LinearRecipe>, detail::kNumModes> recipes;
  std::array<int, detail::kNumModes> row_align{};  // MoE group alignment per mode
  std::array<int, detail::kNumModes> rows_tile{};  // MoE total rows: a multiple of this
  int row_align_max = 8, rows_tile_max = 1;
  // CUDA: the token count of a pass must be a multiple of this (the quantize kernels' row tile)
  // when the mode's recipe quantizes a token-side operand of any layer; 1 otherwise.
  std::array<int, detail::kNumModes> tokens_tile{};
  void check_token_tile(int64_t n_tokens, std::string_view where) const;
  Tensor error_flag;  // CUDA: i32 [1], the ops' and quantizers' error bits
  // CUDA: f32 [2 x kAmaxSlots], the global amaxes (plain, after RHT) that a producer op computes
  // for the quantizer of the next GEMM's input (producer_amaxes): slot 0 the forward's X, slot 1
  // the backward's dY. Each is zeroed by its producer and read by the quantizer right after.
  static constexpr int kAmaxSlots = 2;
  Tensor producer_amax;

  // The pass in progress.
  detail::Mode mode = detail::Mode::kPretrain;
  uint64_t step = 0;

  // The last training forward.
  detail::Acts acts;
  bool have_forward = false;
  bool backward_done = false;
  int64_t n_valid = 0;
  // The last forward's ForwardOptions::loss_gradient_scale (backward() must get the same).
  std::optional<double> promised_loss_scale;
  // Whether the last forward wrote the logits' gradient already.
  bool logits_hold_gradient() const { return promised_loss_scale && fuses_loss_gradient(); }
  std::vector<std::array<double, 2>> router_losses;  // per MoE block {aux, z}
  struct Named {
    std::string name;
    TensorView view;
    bool overwritten_by_backward;  // the in-place backward writes gradients over it
  };
  std::vector<Named> named;  // the activations in forward order

  // ---- planning ----
  // `mode` picks the recipes that decide which Wgrad inputs a training plan keeps quantized.
  detail::Acts plan(detail::Carver& c, int B, int T, bool training, int64_t logits_rows,
                    DType logits_dtype, bool gather_last, detail::Mode mode) const;
  // Whether a training forward in `mode` keeps only the quantized column-wise copy of layer
  // (block, kind)'s X for its Wgrad: the recipe quantizes wgrad_x, X is read by nothing else in the
  // backward (qkv's ln1; in dense blocks mlp_up's ln2 and mlp_down's act), and neither
  // ModelOptions::keep_wgrad_inputs nor a GEMM observer (it audits from X) asks to keep X.
  bool saves_quantized_x(detail::Mode mode, int block, recipe::LinearKind kind) const;
  int64_t max_perm_rows(int64_t n_tokens) const;

  // ---- linear layers ----
  const gemm::LinearRecipe& linear_recipe(int block, recipe::LinearKind kind) const;
  gemm::LinearOptions linear_options(int block, recipe::LinearKind kind, const std::string& name) const;
  // fprop and dgrad round their output to bf16 under cpu_bf16_rounding (bf16_output: the output
  // is a bf16 activation on CUDA; the router's FP32 logits are not).
  // saved_x: keep X's column-wise quantized copy there for the Wgrad (gemm::linear_fprop_saving_x).
  // x_amax: X's amaxes from its producer (producer_amaxes), with saved_x only.
  void fprop(Section s, int block, recipe::LinearKind kind, const TensorView& x, const TensorView& w,
             const TensorView& y, bool bf16_output = true,
             std::optional<quant::QuantizedTensor>* saved_x = nullptr,
             gemm::LinearOptions::GivenAmax x_amax = {}, const TensorView& residual = TensorView{});
  // Whether the training forward adds the residual stream in the epilogues of attn_out and of a
  // dense block's mlp_down (ModelOptions::fuse_residual_add; never under a GemmObserver, which must
  // see the GEMMs' own outputs).
  bool fuses_residual_add() const;
  // Whether the attention backward also does RoPE's backward (ModelOptions::fuse_rope_backward).
  bool fuses_rope_backward() const;
  // Whether training recomputes ln1, qkv, ln2, gate_up and act in the backward (ModelOptions::
  // recompute_activations, FOURBIT_RECOMPUTE), and the recomputations of block l.
  bool recomputes() const;
  void recompute_qkv(int l, detail::Acts& a, detail::BlockActs& b);
  // y = rmsnorm(x) with the block norm parameter `norm` (rstd saved), rounded as an activation:
  // the forward's and the recomputation's norm step.
  void norm_forward(Section s, int norm, const TensorView& x, const TensorView& y, const TensorView& rstd);
  // b.qkv = RoPE(b.ln1 W_qkv^T) of block l; saved_x: keep X's quantized Wgrad copy there.
  void qkv_forward(int l, detail::Acts& a, detail::BlockActs& b, std::optional<quant::QuantizedTensor>* saved_x);
  // A dense block's gate_up = ln2 W_up^T (saved_x: keep X's quantized Wgrad copy there) and, with
  // with_act, act = SwiGLU(gate_up) (act_amax: its amaxes for mlp_down's quantizer): the forward's
  // and the recomputation's step.
  void gate_up_forward(int l, detail::Acts& a, detail::BlockActs& b, std::optional<quant::QuantizedTensor>* saved_x,
                       bool with_act, const std::optional<ops::OutputAmaxes>& act_amax);
  void recompute_gate_up(int l, detail::Acts& a, detail::BlockActs& b);
  // Whether a forward given ForwardOptions::loss_gradient_scale writes the loss gradient
  // (FOURBIT_FUSE_LOSS_GRAD=0: no, for A/B runs).
  bool fuses_loss_gradient() const;
  void dgrad(Section s, int block, recipe::LinearKind kind, const TensorView& dy, const TensorView& w,
             const TensorView& dx);
  // saved_x holding a copy: the Wgrad reads it instead of x (ignored) and releases it.
  void wgrad(Section s, int block, recipe::LinearKind kind, const TensorView& dy, const TensorView& x,
             GradOut dw, std::optional<quant::QuantizedTensor>* saved_x = nullptr);
  // dgrad then wgrad of one layer, dY quantized once for both where the recipe allows it
  // (gemm::linear_dgrad_wgrad); separate calls when the model keeps its Wgrad inputs
  // (keep_wgrad_inputs or an observer: the reference path). saved_x as in wgrad.
  // dy_amax: dY's amaxes from its producer (producer_amaxes).
  void dgrad_wgrad(Section s, int block, recipe::LinearKind kind, const TensorView& dy,
                   const TensorView& w, const TensorView& dx, const TensorView& x, GradOut dw,
                   std::optional<quant::QuantizedTensor>* saved_x = nullptr,
                   gemm::LinearOptions::GivenAmax dy_amax = {});
  bool keeps_wgrad_inputs() const;  // ModelOptions::keep_wgrad_inputs or an attached observer
  // The amaxes that the op writing X (the Fprop input of (block, kind), kept quantized for the
  // Wgrad: saves_x) or dY (the Dgrad/Wgrad input, dy = true) can compute for the one quantization
  // pass of that tensor (ops::OutputAmaxes, gemm::LinearOptions::source_amax), with the slot
  // zeroed; nullopt where that pass does not take them (recipe, CPU, the reference path,
  // fusion off: ModelOptions::fuse_producer_amax, FOURBIT_FUSED_AMAX) or the producer cannot
  // (`producer_can`).
  std::optional<ops::OutputAmaxes> producer_amaxes(int block, recipe::LinearKind kind, bool dy,
                                                   bool saves_x, bool producer_can) const;
  static gemm::LinearOptions::GivenAmax given_amax(const std::optional<ops::OutputAmaxes>& a);
  // Reports a GEMM that just ran to the model's GemmObserver, if any (model.h GemmObservation).
  void observe(std::string_view layer, recipe::Gemm gemm, const gemm::LinearRecipe& r,
               const TensorView& a, const TensorView& b, const TensorView& out,
               std::span<const int64_t> group_sizes, RandomStream sr) const;

  // ---- pieces of the forward shared by both paths ----
  // The MLP or MoE half of block l: out = mlp(ln2) (overwritten). forced: host i32
  // [N, n_moe, k] or absent.
  // out = the FFN's output, or out = mid + that output when `residual` (mid) is given: a dense
  // block then adds it in mlp_down's epilogue; returns whether it did (a MoE block does not).
  bool forward_ffn(int l, detail::Acts& a, detail::BlockActs& b, const TensorView& out,
                   const TensorView& forced_host, const TensorView& residual = TensorView{});
  // fuse_shared_add: the shared expert's mlp_down adds into out in its epilogue (no shared_out).
  void forward_moe(int l, detail::Acts& a, detail::BlockActs& b, const TensorView& out,
                   const TensorView& forced_host, bool fuse_shared_add = false);
  // The routed experts of MoE block l: out = sum over slots of gate * expert(ln2), locally
  // (permute, grouped GEMMs, unpermute) or across ranks (routes_across_ranks: rows, group_sizes,
  // the plan and the permuted buffers are then unused); and their backward:
  // s.d_ln = d ln2 through the experts (overwritten), s.d_gates, the experts' weight gradients.
  void routed_forward(int l, detail::Acts& a, detail::BlockActs& b, const TensorView& out);
  // Training passes while a RoutedExperts is attached (attaching or detaching drops the last
  // forward, so a backward sees the attachment of its forward).
  bool routes_across_ranks(const detail::Acts& a) const { return a.training && m.routed_experts_ != nullptr; }
  void routed_backward(int l, detail::Acts& a, detail::BlockActs& b);
  // d_resid_amax: d_resid's amaxes, when the add that ended block l + 1's backward computed them
  // (producer_amaxes for block l's mlp_down).
  void backward_ffn(int l, detail::Acts& a, detail::BlockActs& b, double loss_scale,
                    gemm::LinearOptions::GivenAmax d_resid_amax = {});

  // ---- helpers ----
  void scope_begin(Section s, Work w) const;
  void scope_end() const;
  // CPU with cpu_bf16_rounding: rounds an f32 activation to bf16 values in place, where the CUDA
  // model stores that activation in bf16. A no-op otherwise.
  void bf16(const TensorView& t) const;
  void record(std::string name, const TensorView& t, bool overwritten_by_backward = false);
  void check_error_flag(std::string_view where);
  const TensorView& w(int index) const;       // compute copy (GEMM weights)
  const TensorView& master(int index) const;  // master (norm weights, embedding, router bias)
  // The gradient of parameter `index`, for an op that accumulates into it: a zero still pending
  // from Model::zero_grads() is written first (stream-ordered).
  const TensorView& g(int index) const;
  // The gradient of parameter `index` as a GEMM output: beta 0 (overwrite) while its zeroing is
  // pending, which it then clears, else beta 1 (accumulate).
  GradOut grad_out(int index) const;
  // Whether parameter `index`'s gradient is still a pending zero from Model::zero_grads(); clears it.
  bool take_pending_grad_zero(int index) const;
  void* stream() const { return m.options_.stream; }
  int* flag() const;
};

namespace detail {

// RAII bracket for the profiler.
class Scope {
 public:
  Scope(const Model::Impl& impl, Section s, Work w) : impl_(impl) { impl_.scope_begin(s, w); }
  ~Scope() { impl_.scope_end(); }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  const Model::Impl& impl_;
};

// Host <-> device copies on the model's stream (synchronous for device -> host).
void copy_to_device(const TensorView& dst, const void* host, void* stream);
void copy_to_host(void* host, const TensorView& src, void* stream);
void sync_stream(Device device, void* stream);
// dst [rows, width] (contiguous) = rows src_row0 + i * src_step of the 2D contiguous src.
void gather_rows(const TensorView& dst, const TensorView& src, int64_t src_row0, int64_t src_step,
                 void* stream);

// The strided views of the fused QKV buffer [N, (H + 2 Hkv) D]: q, k or v as [N, heads, D] or
// [B, T, heads, D].
TensorView qkv_part3(const TensorView& qkv, int64_t col0, int64_t heads, int64_t D);
TensorView qkv_part4(const TensorView& qkv, int64_t col0, int64_t heads, int64_t D, int B, int T);

}  // namespace detail
}  // namespace fourbit::model
