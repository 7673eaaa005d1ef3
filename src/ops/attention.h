// Causal self-attention with grouped-query attention (GQA): forward, backward, and the KV-cache
// decode variant used by the RL sampler.
//
// Math, per batch b and query head h (key/value head hk = h / (H / Hkv)), with S = scale q k^T:
//     out[b, i, h] = sum_{j <= i} softmax_j(S[i, j]) v[b, j, hk]
//     lse[b, h, i] = log sum_{j <= i} exp(S[i, j])          (natural log, f32)
// The backward is the FlashAttention-2 one: P = exp(S - lse) is recomputed from the saved lse,
// D_i = rowsum(dout * out), dS = P * (dP - D), dq = scale dS k, dk = scale dS^T q, dv = P^T dout;
// dk and dv of a key/value head sum over the H / Hkv query heads that share it. dq, dk and dv are
// activation gradients: OVERWRITTEN, never accumulated.
//
// Layouts. Every [B, T, heads, D] tensor (q, k, v, out, their gradients, the caches) may be a
// strided view: any strides on its three outer dimensions, unit stride along D. This lets the
// model pass slices of a fused QKV buffer [B, T, (H + 2 Hkv) D] without copies. lse is a
// contiguous f32 [B, H, T]; cache_lengths a contiguous i32 [B]. Outputs never alias inputs (dq,
// dk, dv may be disjoint slices of one buffer).
//
// CPU (the reference): f32 or f64, one dtype for every floating tensor, lse included (so that the
// f64 finite-difference tests see no f32 rounding). Naive loops that materialize the T x T scores
// of one (b, h): the ground truth.
//
// CUDA: q, k, v, out, dout, dq, dk, dv and the caches are bf16, lse is f32; every reduction and the
// softmax are FP32. Head dims D = 64 and D = 128 only (others are rejected with a message);
// every row of D elements must start on a 16-byte boundary (strides multiples of 8 elements).
// The kernels are our own FlashAttention-2 style kernels on BF16 tensor cores (mma.sync
// m16n8k16, FP32 accumulation; on Hopper optionally warpgroup MMA, AttentionOptions::wgmma_*; see
// attention_kernels.cu for the tiling), not cuDNN's fused
// attention: they need no extra runtime dependency (the build and GPU machines carry different
// cuDNN releases), they accept GQA and strided views as they come, and the backward is
// deterministic (dq is computed by its own pass over the keys instead of FP32 atomics, at the
// cost of recomputing Q K^T and dO V^T once more). P and dS are rounded to bf16 before their
// tensor-core products, as in FlashAttention-2; the gpu tests state the resulting tolerances.
// Deterministic: the same inputs give the same bits.
#pragma once

#include "core/tensor.h"

#include <optional>

namespace fourbit::ops {

class AttentionDecodeWorkspace;

// Per-kernel tile shapes for D = 64 (ignored for D = 128). The defaults are the fastest measured
// on an H100 (bench/notes-train.md, session 16: wide forward 0.275 -> 0.251 ms at gpt2-124m B 32;
// the wide dK/dV + dQ pair 1.02 -> 1.10 ms, slower). FOURBIT_ATTENTION_WIDE overrides every call
// of the process for A/B runs, read once: "0" (all narrow), "1" (all wide), or a comma list of
// the wide ones out of forward, dkdv, dq.
struct AttentionTiles {
  bool wide_forward = true;
  bool wide_dkdv = false;
  bool wide_dq = false;
};

struct AttentionOptions {
  // Multiplies q . k before the softmax; unset: 1 / sqrt(D). Must be finite and > 0.
  std::optional<float> scale;
  // attention_decode on CUDA: scratch that lets the kernel split the cache over several CTAs
  // (flash-decoding). Null: one CTA streams the whole cache of its (b, kv head, 16 query rows).
  AttentionDecodeWorkspace* decode_workspace = nullptr;
  // CUDA with D = 64: which kernels give each warp 32 rows instead of 16 ("wide": less
  // shared-memory traffic per tensor-core op, more registers; attention_kernels.cu). Same
  // tolerances and determinism either way; the wide backward kernels sum in another FP32 order.
  AttentionTiles tiles;
  // attention_backward on CUDA: the Hopper warpgroup-MMA (wgmma) dK/dV and dQ kernels, used where
  // the build has sm_90a code and the device is compute capability 9.0 (else the mma.sync ones
  // above, whatever this says). Same contract and tolerances, deterministic; their FP32 sums run in
  // another order, so the bits differ from the mma.sync kernels'. FOURBIT_ATTENTION_WGMMA=0/1
  // overrides every call of the process for A/B runs (1 where they cannot run is an error).
  // On by default since session 23 (H100, fourbit bench attention: backward 0.98 -> 0.80 ms at
  // gpt2-124m B 32, 1.22 -> 0.78 ms at 1.3b B 16; bench train gpt2-124m bf16 481k -> 508k tokens/s).
  bool wgmma_backward = true;
  // attention_forward on CUDA: the warpgroup-MMA forward kernel, under the same conditions (its bits
  // differ from the mma.sync kernels'). FOURBIT_ATTENTION_WGMMA_FORWARD=0/1 overrides. On by
  // default (H100: 0.254 -> 0.212 ms at gpt2-124m B 32, 0.342 -> 0.255 ms at 1.3b B 16).
  bool wgmma_forward = true;
  // With wgmma_backward: the software-pipelined dK/dV and dQ kernels (each iteration's last product
  // runs on while the next iteration starts). The same bits as without.
  // FOURBIT_ATTENTION_WGMMA_OVERLAP=0/1 overrides. On by default (session 23, H200, bench
  // attention: backward 0.650 -> 0.639 ms at gpt2-124m B 32, 0.772 -> 0.735 ms at 1.3b B 16,
  // 5.09 -> 4.92 ms at gqa-32/8 T 4096).
  bool wgmma_overlap = true;
  // With the wgmma kernels: the exponentials by ex2.approx.ftz instead of exp2f (probabilities
  // below 2^-126 become 0; fewer instructions in kernels that ncu showed issue-bound).
  // FOURBIT_ATTENTION_WGMMA_FAST_EXP=0/1 overrides. Off by default. Session 24 (H100, ea1c2ab):
  // OpsAttentionCuda.WgmmaFastExpKernelsMatchTheReference passed; fourbit bench attention, two
  // runs: forward 0.206 / 0.203 -> 0.188 / 0.186 ms and backward 0.632 / 0.631 -> 0.605 / 0.604 ms
  // at gpt2-124m B 32, forward 0.249 -> 0.240 and backward 0.702 -> 0.679 ms at 1.3b B 16, but the
  // gqa-32/8 T 4096 forward 1.587 / 1.583 -> 1.674 / 1.623 ms (backward equal); and bench train, two
  // rounds each, could not tell the steps apart (gpt2-124m bf16 60.62 / 61.00 -> 61.41 / 60.22 ms).
  // The rest of the GPU suite has not run with it on.
  bool wgmma_fast_exp = false;
  // attention_backward only: q and k came out of rope_forward with these positions and theta, and
  // dq, dk are wanted w.r.t. its inputs. Then dq and dk are rotated back as rope_backward does, with
  // the same bits as attention_backward followed by rope_backward_inplace on dq and dk (CUDA: in
  // the kernels' epilogues, which saves the separate pass over dq and dk).
  struct RopeBackward {
    TensorView positions;  // i32 [B * T] (token (b, t) at b * T + t), contiguous, on q's device
    float theta = 10000.0f;
  };
  std::optional<RopeBackward> rope_backward;
};

// Scratch of the split-cache decode kernel, made once by the owner of a KV cache (never inside a
// CUDA-graph capture: it allocates) and passed to every attention_decode call on its stream. Its
// size does not depend on the shapes: the kernel splits the cache only while the CTAs of the whole
// launch stay within kDecodeSplitCtas, so kDecodeSplitCtas x 16 query rows x (128 + 2) f32 partials
// (acc, running max, running sum) and kDecodeSplitCtas counters always suffice. The counters are
// zero between calls (the last CTA of each group resets its own). Calls that share one workspace
// must be ordered (one stream).
class AttentionDecodeWorkspace {
 public:
  static constexpr int kDecodeSplitCtas = 1024;
  explicit AttentionDecodeWorkspace(Device device);
  float* partials() const { return partials_.ptr<float>(); }
  uint32_t* counters() const { return counters_.ptr<uint32_t>(); }
  Device device() const { return partials_.device(); }

 private:
  Tensor partials_;  // f32 [kDecodeSplitCtas * 16 * 130]
  Tensor counters_;  // i32 [kDecodeSplitCtas], zero
};

// True where AttentionOptions::wgmma_forward / wgmma_backward take effect: a CUDA build with sm_90a code and a
// current device of compute capability 9.0. False in CPU-only builds.
bool attention_wgmma_available();

// Causal forward. Writes out and lse.
void attention_forward(const TensorView& q,    // [B, T, H, D]
                       const TensorView& k,    // [B, T, Hkv, D]
                       const TensorView& v,    // [B, T, Hkv, D]
                       const TensorView& out,  // [B, T, H, D]
                       const TensorView& lse,  // [B, H, T]: f32 on CUDA, q's dtype on the CPU
                       const AttentionOptions& options = {}, void* stream = nullptr);

// Backward of attention_forward given its saved out and lse. Overwrites dq, dk, dv (with
// options.rope_backward: dq, dk w.r.t. the queries and keys before RoPE).
// On CUDA it needs a scratch f32 [B, H, T] for D_i, taken with cudaMallocAsync on `stream` and
// released on it (no host synchronization).
void attention_backward(const TensorView& dout,  // [B, T, H, D]
                        const TensorView& q,     // [B, T, H, D]
                        const TensorView& k,     // [B, T, Hkv, D]
                        const TensorView& v,     // [B, T, Hkv, D]
                        const TensorView& out,   // [B, T, H, D]  (from the forward)
                        const TensorView& lse,   // [B, H, T]     (from the forward)
                        const TensorView& dq,    // [B, T, H, D]    overwritten
                        const TensorView& dk,    // [B, T, Hkv, D]  overwritten
                        const TensorView& dv,    // [B, T, Hkv, D]  overwritten
                        const AttentionOptions& options = {}, void* stream = nullptr);

// KV-cache decode (forward only). Each sequence b holds cache_lengths[b] valid positions
// [0, len) in its cache, the Tq new tokens' keys and values already written at [len - Tq, len).
// New token t of sequence b sits at position len - Tq + t and attends causally to cache
// positions [0, len - Tq + t]. A row whose position would be negative (len < Tq) is padding: its
// output is zero (this lets a batch prefill right-aligned prompts of different lengths).
// Lengths must lie in [0, T_max]: checked on the CPU; the CUDA kernel, which cannot check without
// synchronizing, clamps them into that range.
// CUDA: a simple FP32 kernel (decode is bound by reading the cache, not by math); one CTA per
// (b, kv head, 16 query rows) and cache split. With options.decode_workspace, a launch of fewer
// than 6 CTAs per SM splits the cache (T_max, in 64-position tiles) over up to that many CTAs, each
// keeping a partial online softmax; the last CTA of a group merges the partials in split order
// (deterministic; a different FP32 rounding than the unsplit kernel, same tolerance).
void attention_decode(const TensorView& q,              // [B, Tq, H, D]
                      const TensorView& k_cache,        // [B, T_max, Hkv, D]
                      const TensorView& v_cache,        // [B, T_max, Hkv, D]
                      const TensorView& cache_lengths,  // i32 [B], on the tensors' device
                      const TensorView& out,            // [B, Tq, H, D]
                      const AttentionOptions& options = {}, void* stream = nullptr);

}  // namespace fourbit::ops
