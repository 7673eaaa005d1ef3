// Internal interface between the host side of the decode GEMV (decode_gemv.cpp, compiled by the
// C++ compiler) and its CUDA kernels (decode_gemv_kernels.cu, compiled by nvcc). Plain structs,
// the launch plan and launch functions only; validation and error messages live in decode_gemv.cpp.
//
// The GEMV kernel computes y[B, N] = alpha_eff * x[B, K] . W[N, K]^T for 1 <= B <= 64 on the
// tensor cores (mma.sync m16n8k16, FP32 accumulation), reading W either as BF16 or as packed
// NVFP4 (row-wise layout of quant/quantize.h), dequantized in registers. Work split:
//   - one CTA of kDecodeWarps warps covers kDecodeRowsPerCta = 16 * kDecodeWarps rows of W; each
//     warp owns 16 rows (the mma's M), the batch is the mma's N (8 tokens per n-tile, up to 8);
//   - K is walked in chunks of kDecodeChunk = 128 elements; grid.y splits the chunks (split-K)
//     when N alone gives too few CTAs.
//   - Up to 16 tokens the launch is "staged": a CTA issues the loads of its first chunks' weights
//     at once (a register ring, kept full while it computes), stages the x of its whole chunk
//     range in shared memory (at most kDecodeStagedChunks chunks up to 16 tokens, fewer above: 32
//     KB of x per CTA at most, so the plan splits K at least that finely), and then runs without a
//     barrier: one memory round trip per CTA instead of one per chunk. Above 16 tokens it is staged
//     only where that fine split still makes one cluster per row block and at most 4 CTAs per SM
//     (the small layers: at 64 tokens on an H200 the 2048 x 2048 and 2560 x 2048 NVFP4 GEMVs took
//     10.5-10.8 us staged vs 19.9-20.6 us per chunk, while the 11264 x 2048, 2048 x 5632 and
//     32000 x 2048 ones were slower staged: bench/notes-decode.md); elsewhere the kernel
//     double-buffers x per chunk with a barrier per chunk. stage_large = false
//     (FOURBIT_DECODE_STAGED=small) never stages above 16 tokens (for A/B runs).
//   - A staged launch with 2 to kDecodeClusterMax splits runs each row block's splits as one
//     thread-block cluster: the split partials stay in shared memory and the cluster's CTAs sum
//     them over distributed shared memory, in split order (the same sums, bit for bit, as the
//     global path below), with no workspace, atomics or second trip to memory.
//   - Otherwise split partials go to an FP32 workspace [splits, B, N]; the last CTA of a row block
//     (a per-row-block arrival counter) sums them in split order, so the result does not depend on
//     CTA scheduling (deterministic), and resets the counter to 0.
//   - Pair launches (1-16 tokens, staged): a thread's two weight rows are one output pair (a gate
//     row and its up row, or rows d and d + D/2 of an attention head), so that the epilogue can
//     finish the SwiGLU or RoPE + KV append itself (DecodeGemvParams::swiglu_half / rope_half).
// Invariants: the counters start at zero (the workspace is zeroed when allocated) and are zero
// again after every launch; one launch at a time per workspace (one stream).
#pragma once

#include "core/hd.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

namespace fourbit::gemm::kernels {

inline constexpr int kDecodeMaxTokens = 64;
inline constexpr int kDecodeWarps = 4;
inline constexpr int kDecodeRowsPerCta = 16 * kDecodeWarps;
inline constexpr int kDecodeChunk = 128;     // K elements per CTA iteration
inline constexpr int kDecodeAmaxPartials = 64;  // CTAs of the activation amax pass (at most)
inline constexpr int kDecodeStagedChunks = 8;  // most chunks per split of a staged launch
inline constexpr int kDecodeClusterMax = 8;    // most splits summed in a cluster (portable size)
inline constexpr int kDecodeXTileBytes = 8 * kDecodeChunk * 2;  // x of one chunk and one n-tile

enum class DecodeWeightFormat : uint8_t { kBf16, kNvfp4 };

// How a launch divides the work; a pure function of the shape and the SM count, shared by the
// workspace sizing (host) and the launch.
struct DecodeGemvPlan {
  int row_blocks = 0;        // grid.x = ceil(N / kDecodeRowsPerCta)
  int splits = 1;            // grid.y: split-K slices (1: no workspace traffic)
  int chunks = 0;            // ceil(K / kDecodeChunk)
  int chunks_per_split = 0;  // every split but possibly the last has this many chunks
  int n_tiles = 1;           // 8-token mma tiles the kernel instantiates: 1, 2, 4 or 8
  bool staged = false;       // n_tiles <= 2: x of the whole split in shared memory (see above)
  int x_smem_bytes = 0;      // staged: the dynamic shared memory of x, chunks_per_split tiles
  bool cluster = false;      // staged, 2..kDecodeClusterMax splits: a cluster of `splits` CTAs
  int64_t partial_floats = 0;  // workspace floats for the split partials (splits > 1, no cluster)
};

// cap_cluster (decode_gemv.cpp: on unless FOURBIT_DECODE_PLAN=split): a staged launch whose
// target split count passes kDecodeClusterMax takes kDecodeClusterMax longer splits instead,
// summed in a cluster rather than through the workspace (of the 1.1B Llama's GEMVs at batch 1-16,
// only the 2048 x 5632 one is concerned).
// per_sm and staged_chunks, when positive, replace the CTAs-per-SM target and the most chunks per
// staged split (A/B runs only: FOURBIT_DECODE_PER_SM, FOURBIT_DECODE_STAGED_CHUNKS in decode_gemv.cpp;
// staged_chunks is clamped so that x stays within 32 KB of shared memory).
inline DecodeGemvPlan plan_decode_gemv(int B, int64_t N, int64_t K, int sm_count, bool stage_large,
                                       bool cap_cluster, int per_sm_override = 0, int staged_chunks_override = 0) {
  DecodeGemvPlan p;
  p.row_blocks = (int)((N + kDecodeRowsPerCta - 1) / kDecodeRowsPerCta);
  p.chunks = (int)std::max<int64_t>(1, (K + kDecodeChunk - 1) / kDecodeChunk);
  const int tiles = (B + 7) / 8;
  p.n_tiles = tiles <= 1 ? 1 : tiles <= 2 ? 2 : tiles <= 4 ? 4 : 8;
  // Aim for a few CTAs per SM (memory-level parallelism); larger batches need fewer splits (their
  // partials cost more and each CTA does more math per weight byte). Up to 8 tokens the target is 2
  // CTAs an SM (was 6): on an H100 the 1.1B mlp_up GEMV (11264 x 2048) took 5 cluster splits and
  // 14.2 us (NVFP4) / 20.7 us (BF16) at batch 1, with 2 splits 10.5 / 18.9 us, the other layers level
  // (qkv NVFP4 +0.1 us); decode steps bf16 1.553 -> 1.497 ms, nvfp4-weights 1.457 -> 1.320, e2e4
  // 1.780 -> 1.743 (bench/notes-decode.md, session 29). FOURBIT_DECODE_PER_SM=6 restores the old
  // plan up to 8 tokens (the override applies at every batch size).
  const int per_sm = per_sm_override > 0 ? per_sm_override : p.n_tiles == 1 ? 2 : p.n_tiles == 2 ? 4 : 2;
  const int64_t target = (int64_t)std::max(1, sm_count) * per_sm;
  // At least two chunks per split: a CTA's fixed costs (prologue, partials, arrival) stay small.
  const int max_splits = std::max(1, p.chunks / 2);
  int splits = (int)std::min<int64_t>(max_splits, std::max<int64_t>(1, (target + p.row_blocks - 1) / p.row_blocks));
  // Chunks of x one staged CTA holds: 8 up to 16 tokens (16 KB), 32 KB of x above.
  const int staged_default = p.n_tiles <= 2 ? kDecodeStagedChunks : kDecodeStagedChunks * 2 / p.n_tiles;
  const int staged_max = staged_chunks_override > 0
                             ? std::min(staged_chunks_override, 32 * 1024 / (p.n_tiles * kDecodeXTileBytes))
                             : staged_default;
  const int staged_splits = (p.chunks + staged_max - 1) / staged_max;  // the fewest a staged launch takes
  p.staged = p.n_tiles <= 2 ||
             (stage_large && staged_splits <= kDecodeClusterMax &&
              (int64_t)p.row_blocks * std::max(splits, staged_splits) <= 4 * (int64_t)std::max(1, sm_count));
  if (p.staged) splits = std::max(splits, staged_splits);
  if (p.staged && cap_cluster && splits > kDecodeClusterMax) splits = std::max(kDecodeClusterMax, staged_splits);
  p.chunks_per_split = (p.chunks + splits - 1) / splits;
  p.splits = (p.chunks + p.chunks_per_split - 1) / p.chunks_per_split;  // no empty split
  p.x_smem_bytes = p.staged ? p.chunks_per_split * p.n_tiles * kDecodeXTileBytes : 0;
  p.cluster = p.staged && p.splits > 1 && p.splits <= kDecodeClusterMax;
  p.partial_floats = p.splits > 1 && !p.cluster ? (int64_t)p.splits * B * N : 0;
  return p;
}

struct DecodeGemvParams {
  DecodeWeightFormat format = DecodeWeightFormat::kBf16;
  // x: bf16 [B, K], row stride ldx (elements). With x_amax set, x holds NVFP4 scaled-domain values
  // (e2m1 * s_b, exact in FP16 as well as BF16) whose global decode scale comes from *x_amax.
  const uint16_t* x = nullptr;
  int64_t ldx = 0;
  const float* x_amax = nullptr;
  bool x_amax_per_row = false;  // x_amax[b] for token b (QuantConfig::nvfp4_row_amax)
  float x_constant = 0.0f;
  // BF16 weights: [N, K], row stride ldw.
  const uint16_t* w_bf16 = nullptr;
  int64_t ldw = 0;
  // NVFP4 weights: packed e2m1 [N, ceil(K/2) bytes], e4m3 scales [N, ceil(K/16)], global amax.
  const uint8_t* w_data = nullptr;
  const uint8_t* w_scales = nullptr;
  const float* w_amax = nullptr;
  float w_constant = 0.0f;
  int B = 0;
  int64_t N = 0, K = 0;
  float alpha = 1.0f;
  // y: [B, N] f32 or bf16, row stride ldy.
  void* y = nullptr;
  bool y_bf16 = false;
  int64_t ldy = 0;
  // Optional bf16 residual [B, N], row stride ldr (y_bf16 only): y = bf16(bf16(result) + residual).
  const uint16_t* residual = nullptr;
  int64_t ldr = 0;
  // Workspace (plan.splits > 1): partials f32 [splits, B, N]; counters u32 [row_blocks], zero.
  float* partials = nullptr;
  unsigned* counters = nullptr;
  // SwiGLU pairs (> 0; y_bf16, no residual, B <= kDecodePairMaxTokens, a multiple of
  // kDecodeRowsPerCta / 2): W's N = 2 swiglu_half rows are [gate | up] and y is bf16 [B, swiglu_half]
  // = ops::swiglu_forward of the bf16 GEMV output, bit for bit, without that output being written.
  // Row block b computes the gate rows 32 b .. 32 b + 31 and their up rows (a thread's two weight
  // rows are a gate row and its up row), so each thread or split sum ends with both halves of its
  // outputs (decode_gemv_kernels.cu, "Pair launches").
  int64_t swiglu_half = 0;
  // RoPE pairs (rope_half = D/2 > 0; y_bf16, no residual, B <= kDecodePairMaxTokens, D a multiple
  // of kDecodeRowsPerCta): W is an attention qkv projection, rows [q heads | k heads | v heads] of D
  // each; y (bf16 [B, N]) gets the q and k rows rotated as ops::rope_forward_inplace rotates them,
  // with the (cos, sin) of token b's pair d at rope_cos_sin[(b D/2 + d) 2 + {0, 1}], and (k_cache
  // set) token b's rotated k rows and its v rows are also written to k_cache / v_cache [sequences,
  // t_max, kv rows] at sequence b / rows_per_seq, position write_pos[b] (none outside [0, t_max)),
  // as ops::rope_forward_inplace_append writes them. Row block b computes pairs (d, d + D/2) of one
  // head (decode_gemv_kernels.cu, "Pair launches").
  int rope_half = 0;
  int64_t rope_q_rows = 0;        // H D: the rows before the k heads
  int64_t rope_rotated_rows = 0;  // (H + Hkv) D: the q and k rows; the v rows follow
  const float* rope_cos_sin = nullptr;
  uint16_t* k_cache = nullptr;
  uint16_t* v_cache = nullptr;
  const int32_t* write_pos = nullptr;
  int64_t t_max = 0;
  int rows_per_seq = 1;
};
// Most tokens of a pair launch (SwiGLU, RoPE): the staged kernel's 1 and 2 n-tiles.
inline constexpr int kDecodePairMaxTokens = 16;
// Where a pair launch's pairs are (decode_gemv_kernels.cu, "Pair launches"): W's rows form spans of
// 2 step rows (step = swiglu_half: one span; step = D/2: one span per head); pair q < 32 of row
// block `block` is weight rows decode_pair_base(step, block) + q and that + step, and its two split
// partials sit at rows decode_pair_row(q) and that + 8 of the block (the plain launch's layout:
// thread (g, t) of warp w holds rows 16 w + g and 16 w + g + 8, i.e. pair 8 w + g). A CPU test
// checks that the pairs cover every row of W once.
FOURBIT_HD int64_t decode_pair_base(int64_t step, int64_t block) {
  const int64_t blocks_per_span = 2 * step / kDecodeRowsPerCta;
  return block / blocks_per_span * 2 * step + block % blocks_per_span * (kDecodeRowsPerCta / 2);
}
FOURBIT_HD int decode_pair_row(int q) { return 16 * (q / 8) + q % 8; }
void launch_decode_gemv(const DecodeGemvParams& p, const DecodeGemvPlan& plan, cudaStream_t stream);

// ---- decode chain: several GEMVs in one persistent launch ----------------------------------------
// A chain runs links 0, 1, ... of small-batch GEMVs (n_tiles == 1: at most 8 tokens, BF16 x) in one
// launch of every CTA the GPU holds at once (a persistent grid, sized by occupancy), with a grid-wide
// barrier between links: link i + 1 may read what link i wrote (x, residual). Each link's work is its
// standalone plan (plan_decode_gemv: the same row blocks, splits and chunks per split, so the same
// FP32 sums in the same order: the chain's output equals the separate launches bit for bit), its
// (row block, split) items dealt to the CTAs in turn. A CTA keeps its weight ring full across items
// and links: the loads of its next item's first chunks, also those of the next link, go out while it
// finishes the current one, so the weight stream does not stop at the barriers. Split partials go
// through the workspace (the last-arriving CTA of a row block sums them in split order, as the
// standalone global path does; the cluster path's sums are the same bits).
// A link may produce its x on the fly while staging it (never written to memory):
//   - kNorm: x = ops::rmsnorm_forward(x_in, norm_weight, eps), bit for bit (each CTA recomputes the
//     rows' rstd in that kernel's summation order, norm_threads / norm_groups as in
//     DecodeQuantizeParams);
//   - kSwiglu: x = ops::swiglu_forward(x_in) with x_in = [gate | up] rows (row stride ldx >= 2K).
// Performance (H100, session 30, bench/notes-decode.md): correct but slower than the separate
// kernels (llama-1.1b bf16 decode step at batch 1 2.09 vs 1.53 ms, nvfp4-weights level), so the
// model runs it only when asked (Model::set_decode_chain, FOURBIT_DECODE_CHAIN=1): each CTA's items
// are strict sequences of round trips (x staging, fences that wait for the ring's loads, the
// split-sum atomic, the grid barrier) with only the ring in flight. Neither the L2 prefetch of
// the next item (chain_prefetch_next), the ring per item nor one fence per CTA changed that
// (session 31: 2.12-2.27 ms).
// Invariants: the barrier words and the row-block counters are zero between launches; every CTA of
// the grid is resident at once (launch_decode_chain sizes the grid by occupancy; a producer kernel
// still running when the chain starts (PDL) finishes without waiting on it).
inline constexpr int kDecodeChainMaxLinks = 8;
inline constexpr int kDecodeChainMaxTokens = 8;   // n_tiles == 1
inline constexpr int kDecodeChainMaxNormWarps = 256;  // B * norm_threads / 32 (rstd partial sums)
enum class DecodeChainProducer : uint8_t { kNone, kNorm, kSwiglu };
struct DecodeChainLink {
  DecodeGemvParams g;  // x is the producer's input (kNorm: [B, K]; kSwiglu: [B, 2K] gate | up)
  DecodeChainProducer producer = DecodeChainProducer::kNone;
  const float* norm_weight = nullptr;  // f32 [K]
  float norm_eps = 0.0f;
  int norm_threads = 0, norm_groups = 0;
  int row_blocks = 0, splits = 1, chunks = 0, chunks_per_split = 0;  // from plan_decode_gemv
};
struct DecodeChainParams {
  DecodeChainLink links[kDecodeChainMaxLinks];
  int n_links = 0;
  unsigned* barrier = nullptr;  // u32 [2]: arrivals, generation (zero, then arrivals zero after each)
  int prefetch_chunks = 0;      // DecodeChainOptions (decode_gemv.h); 0: no L2 prefetch
  bool ring_per_item = false;
};
// Launches the chain (every link's weights in `format`, plan.staged with n_tiles == 1) on a grid of
// SMs x min(occupancy, per_sm) CTAs (per_sm <= 0: the occupancy); returns the grid size.
int launch_decode_chain(const DecodeChainParams& c, DecodeWeightFormat format, int per_sm, cudaStream_t stream);

// NVFP4 1x16 row-wise quantization of a small activation x bf16 [B, K] (round to nearest), written
// straight to the scaled domain: xs bf16 [B, K] contiguous = e2m1 * s_b, and *amax_out = the global
// amax; the same values as quant::quantize_reference + dequantize_bf16_scaled_reference (the
// per-block arithmetic is quant/block_math.h). Sixteen threads quantize one block (one element
// each). Up to 16384 elements one launch does both passes (each CTA reduces the whole amax itself,
// then quantizes its own blocks); larger inputs take two launches: per-CTA partial maxima into
// `partials` (kDecodeAmaxPartials floats), then the quantization (each CTA reduces the partials).
// A NaN or Inf in x ORs quant::kDeviceErrNonFinite into *error_flags.
struct DecodeQuantizeParams {
  const uint16_t* x = nullptr;
  int64_t ldx = 0;
  int B = 0;
  int64_t K = 0;
  bool four_over_six = false;
  uint8_t four_over_six_metric = 0;  // quant::FourOverSixMetric
  float scale_constant = 0.0f;       // QuantConfig::nvfp4_scale_constant()
  float element_constant = 0.0f;     // QuantConfig::nvfp4_global_constant()
  uint16_t* xs = nullptr;            // bf16 [B, K] contiguous
  float* amax_out = nullptr;         // device float; [B] with per_row_amax
  bool per_row_amax = false;         // one amax per row (QuantConfig::nvfp4_row_amax)
  float* partials = nullptr;         // device float[kDecodeAmaxPartials]
  int* error_flags = nullptr;        // device int
  // Fused RMSNorm (optional). With norm_weight set, x is the norm's input and the quantizer reads
  // y = bf16(f32(x * rstd) * w) with rstd = 1 / sqrt(sum(x^2) / K + eps), the sum taken in
  // ops::rmsnorm_forward's order for a block of norm_threads threads with norm_groups 8-column
  // groups each: ops::rmsnorm_forward's output bit for bit. Only the single-launch path
  // (B * K <= kDecodeFusedNormElements, K % 8 == 0).
  const float* norm_weight = nullptr;  // f32 [K]
  float norm_eps = 0.0f;
  int norm_threads = 0, norm_groups = 0;
  // Fused SwiGLU (optional, not with the norm): x holds [gate | up] rows (gate at columns 0..K-1,
  // up at K..2K-1 of each row of stride ldx) and the quantizer reads ops::swiglu_forward's bf16
  // output, bit for bit.
  bool swiglu = false;
};
// Row b of a per-row problem (per_row_amax) as a one-row per-tensor problem: a one-row tensor's
// global amax is that row's amax, so the per-tensor quantizer applied to it is the per-row one.
FOURBIT_HD DecodeQuantizeParams decode_quantize_row(DecodeQuantizeParams p, int b) {
  p.x += (int64_t)b * p.ldx;
  p.xs += (int64_t)b * p.K;
  p.amax_out += b;
  p.B = 1;
  p.per_row_amax = false;
  return p;
}
inline constexpr int64_t kDecodeFusedNormElements = 16384;
inline constexpr int64_t kDecodeFusedNormPairs = 8 * 256;  // B * norm_threads (8 per thread of the CTA)
void launch_decode_quantize_x(const DecodeQuantizeParams& p, cudaStream_t stream);

}  // namespace fourbit::gemm::kernels
