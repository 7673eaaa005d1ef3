// Internal launch interface between attention.cpp (host: checks, dispatch, CPU reference) and
// attention_kernels.cu (nvcc). Plain structs only; every argument was validated by the host side.
// bf16 tensors are passed as uint16_t pointers (their bit patterns).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fourbit::ops::kernels {

// Element strides of a [B, T, heads, D] view whose D is unit-stride.
struct HeadStrides {
  int64_t b = 0, t = 0, h = 0;
};

struct AttentionDims {
  int batch = 0;     // B
  int seq = 0;       // T (forward/backward), Tq (decode)
  int heads = 0;     // H
  int kv_heads = 0;  // Hkv, H % Hkv == 0
  int head_dim = 0;  // D: 64 or 128
  float scale = 0;   // multiplies q . k
};

struct AttentionForwardArgs {
  AttentionDims dims;
  const uint16_t* q;  HeadStrides q_stride;    // bf16 [B, T, H, D]
  const uint16_t* k;  HeadStrides k_stride;    // bf16 [B, T, Hkv, D]
  const uint16_t* v;  HeadStrides v_stride;    // bf16 [B, T, Hkv, D]
  uint16_t* out;      HeadStrides out_stride;  // bf16 [B, T, H, D]
  float* lse;                                  // f32 [B, H, T], contiguous
  // D = 64: the kernel with 32 queries a warp (attention_kernels.cu); ignored for D = 128.
  bool wide = false;
  // The warpgroup-MMA kernel (any D; only where attention_wgmma_available()); wins over wide.
  bool wgmma = false;
  // With wgmma: the exponentials by ex2.approx.ftz (AttentionOptions::wgmma_fast_exp).
  bool wgmma_fast_exp = false;
};

// RoPE's backward rotation folded into the dq and dk stores (attention.h
// AttentionOptions::rope_backward; the arithmetic of core/rope_math.cuh).
inline constexpr int kAttentionRopeMaxPairs = 64;  // D / 2 for D <= 128
struct AttentionRopeBackward {
  const int32_t* positions = nullptr;  // i32 [B * T], token (b, t) at b * T + t; null: no rotation
  float inv_freq[kAttentionRopeMaxPairs] = {};  // f32(theta^(-2i / D)), i < D / 2 (rope.cpp)
};

struct AttentionBackwardArgs {
  AttentionDims dims;
  const uint16_t* dout; HeadStrides dout_stride;  // bf16 [B, T, H, D]
  const uint16_t* q;    HeadStrides q_stride;     // bf16 [B, T, H, D]
  const uint16_t* k;    HeadStrides k_stride;     // bf16 [B, T, Hkv, D]
  const uint16_t* v;    HeadStrides v_stride;     // bf16 [B, T, Hkv, D]
  const uint16_t* out;  HeadStrides out_stride;   // bf16 [B, T, H, D]
  const float* lse;                               // f32 [B, H, T]
  uint16_t* dq;         HeadStrides dq_stride;    // bf16 [B, T, H, D]
  uint16_t* dk;         HeadStrides dk_stride;    // bf16 [B, T, Hkv, D]
  uint16_t* dv;         HeadStrides dv_stride;    // bf16 [B, T, Hkv, D]
  // D = 64: dK/dV by the kernel with 32 keys a warp, dQ by the one with 32 queries a warp
  // (attention_kernels.cu); ignored for D = 128.
  bool wide_dkdv = false;
  bool wide_dq = false;
  // dK/dV and dQ by the warpgroup-MMA kernels (any D; only where attention_wgmma_available()).
  bool wgmma = false;
  // With wgmma: the variants whose last product of an iteration (dK += dS^T Q; dQ += dS K) runs
  // while the next iteration starts; the same bits (attention_kernels.cu).
  bool wgmma_overlap = false;
  // With wgmma: the exponentials by ex2.approx.ftz (AttentionOptions::wgmma_fast_exp).
  bool wgmma_fast_exp = false;
  AttentionRopeBackward rope;
};

// True when this build carries sm_90a code (FOURBIT_CUDA_SM90A) and the current device is
// compute capability 9.0: the wgmma kernels can run. Cached per device.
bool attention_wgmma_available();

struct AttentionDecodeArgs {
  AttentionDims dims;                                    // seq = Tq
  int cache_capacity = 0;                                // T_max
  const uint16_t* q;        HeadStrides q_stride;        // bf16 [B, Tq, H, D]
  const uint16_t* k_cache;  HeadStrides k_stride;        // bf16 [B, T_max, Hkv, D]
  const uint16_t* v_cache;  HeadStrides v_stride;        // bf16 [B, T_max, Hkv, D]
  const int32_t* cache_lengths;                          // i32 [B]
  uint16_t* out;            HeadStrides out_stride;      // bf16 [B, Tq, H, D]
  // Split-cache scratch (attention.h AttentionDecodeWorkspace); null: no split.
  float* partials = nullptr;    // f32 [max_ctas][16][D + 2]
  uint32_t* counters = nullptr; // [max_ctas], zero between calls
  int max_ctas = 0;             // CTAs of a split launch, at most (and no split beyond that many)
};

// True when the kernels exist for this head dim.
bool attention_head_dim_supported(int head_dim);

void launch_attention_forward(const AttentionForwardArgs& a, cudaStream_t stream);
// Allocates (stream-ordered) and frees the f32 [B, H, T] D_i scratch itself.
void launch_attention_backward(const AttentionBackwardArgs& a, cudaStream_t stream);
void launch_attention_decode(const AttentionDecodeArgs& a, cudaStream_t stream);

}  // namespace fourbit::ops::kernels
