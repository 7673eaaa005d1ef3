// Rotary position embedding (RoPE) of the queries and keys, Llama / Hugging Face "rotate half"
// convention: dimension i of a head is paired with dimension i + D/2 (NOT the interleaved pairs
// (2i, 2i + 1) of the original RoFormer / GPT-J / Meta's complex-number code). For a token at
// position p and i in [0, D/2):
//   inv_freq_i = theta^(-2i / D)
//   angle      = p * inv_freq_i
//   out[i]         = x[i] cos(angle) - x[i + D/2] sin(angle)
//   out[i + D/2]   = x[i + D/2] cos(angle) + x[i] sin(angle)
// The backward applies the inverse rotation (angle -> -angle) to the incoming gradient. The whole
// head dimension D is rotated (no partial rotary dimension) and there is no RoPE scaling (Llama
// 3.1 / YaRN frequency adjustments are not implemented). Only the D/2 frequencies are precomputed
// (on the host, per call); cos and sin are evaluated per token.
//
// FP32 math (CPU f32 reference and CUDA alike, so that they agree to a few ulp):
//   inv_freq_i = f32(pow(f64(theta), -2i / D))   (computed in double, rounded once to float)
//   angle      = f32(f32(p) * inv_freq_i)        (one IEEE product: identical on both sides)
//   cos, sin   = FP32 cosf / sinf of angle       (CUDA sincosf: <= 2 ulp; glibc: < 1 ulp)
//   out        = FP32 products and sums of x, cos, sin
// At large positions the FP32 angle itself is coarse (ulp(1e5) ~ 0.008 rad), as in the usual FP32
// implementations; the f64 reference (used by the finite-difference tests) computes everything in
// double.
//
// Layouts. q: [N, H, D], k: [N, Hkv, D] with N = tokens (B*T), H = query heads, Hkv = key/value
// heads. Every q/k tensor (inputs, outputs, gradients) may be a strided view: any strides on its
// two outer dimensions, unit stride along D. So the model can pass slices of a fused QKV buffer
// [N, (H + 2 Hkv) D] (a [B, T, heads, D] slice is viewed as [B*T, heads, D]). positions: [N] i32,
// contiguous, the absolute position of each token (any value: negative positions rotate
// backwards). The k tensors are optional: pass TensorView{} for both k and its output to rotate
// q alone. Outputs must not overlap inputs except in the _inplace variants.
//
// Dtypes. CPU: all q/k tensors f32 or all f64. CUDA: all bf16 or all f32; D even, D <= 512.
// CUDA kernel: one CTA per token computes the D/2 (cos, sin) pairs into shared memory, then
// rotates every head of q and k of that token (8 pairs per thread and step, 16-byte accesses when
// aligned). Deterministic.
#pragma once

#include "core/tensor.h"

namespace fourbit::ops {

// q_rot: [N, H, D]    overwritten
// k_rot: [N, Hkv, D]  overwritten (absent iff k is absent)
// q:     [N, H, D]
// k:     [N, Hkv, D]
// positions: [N] i32
void rope_forward(const TensorView& q_rot, const TensorView& k_rot, const TensorView& q,
                  const TensorView& k, const TensorView& positions, float theta,
                  void* stream = nullptr);

// Rotates q and k in place.
void rope_forward_inplace(const TensorView& q, const TensorView& k, const TensorView& positions,
                          float theta, void* stream = nullptr);

// The decode step's KV-cache append fused into the in-place forward rotation (CUDA only): besides
// rotating q and k in place exactly as rope_forward_inplace does, token n's rotated k heads and its
// v heads are written to k_cache and v_cache at batch n / rows_per_seq, position write_pos[n]
// (rows whose write_pos lies outside [0, t_max) append nothing). One kernel instead of two.
struct RopeCacheAppend {
  TensorView v;                 // [N, Hkv, D] (a strided view is fine), q's dtype
  TensorView k_cache, v_cache;  // [B, t_max, Hkv, D] contiguous, q's dtype, on the device
  TensorView write_pos;         // [N] i32 on the device
  int64_t rows_per_seq = 1;     // token rows per sequence: B = N / rows_per_seq
};
void rope_forward_inplace_append(const TensorView& q, const TensorView& k, const TensorView& positions,
                                 float theta, const RopeCacheAppend& append, void* stream = nullptr);

// The (cos, sin) pair of every token's rotation of pair i, as the CUDA RoPE kernels evaluate it
// (CUDA only): table[n][i] = (cos, sin) of angle f32(f32(positions[n]) * inv_freq_i), i < D / 2.
// The decode step evaluates it once for all its layers' qkv GEMVs, which rotate q and k in their
// epilogue with these values (gemm::DecodeGemvArgs::rope): the same bits as the RoPE kernel.
// table: f32 [N, D / 2, 2] contiguous, on the device   OVERWRITTEN
// positions: [N] i32 on the device
void rope_cos_sin_table(const TensorView& table, const TensorView& positions, float theta, int64_t head_dim,
                        void* stream = nullptr);

// dq = R(-angle) dq_rot, dk = R(-angle) dk_rot: the gradients w.r.t. the forward's inputs.
// dq:     [N, H, D]    OVERWRITTEN (activation gradient)
// dk:     [N, Hkv, D]  OVERWRITTEN (absent iff dk_rot is absent)
// dq_rot: [N, H, D]    gradient w.r.t. the forward's q_rot
// dk_rot: [N, Hkv, D]  gradient w.r.t. the forward's k_rot
void rope_backward(const TensorView& dq, const TensorView& dk, const TensorView& dq_rot,
                   const TensorView& dk_rot, const TensorView& positions, float theta,
                   void* stream = nullptr);

// The backward in place: dq_rot and dk_rot are overwritten with dq and dk.
void rope_backward_inplace(const TensorView& dq_rot_to_dq, const TensorView& dk_rot_to_dk,
                           const TensorView& positions, float theta, void* stream = nullptr);

namespace detail {
// theta^(-2i / D) in double, the frequency of pair i.
double inv_freq_f64(float theta, int64_t i, int64_t D);
// The CUDA kernels' table: out[i] = f32(inv_freq_f64(theta, i, D)) for i < D / 2.
void inv_freq_table_f32(float theta, int64_t D, float* out);
}  // namespace detail

}  // namespace fourbit::ops
