// Decode GEMV: the small-batch linear layer of generation, y[B, N] = alpha * x[B, K] . W[N, K]^T for
// 1 <= B <= 64 tokens, reading the weight straight from BF16 or from packed NVFP4 (4.5 bits per
// value: the row-wise storage layout of quant/quantize.h) and dequantizing it in registers.
// Decoding is memory bound: the weight bytes are the cost, so NVFP4 weights read ~3.6x fewer bytes
// than BF16 ones (HOPPER: no FP4 tensor cores; the math runs on BF16/FP16 tensor cores over the
// exactly dequantized values).
//
// Numerics. The result equals the exact NVFP4 emulation of gemm.h (scaled-domain BF16 operands,
// cuBLASLt BF16 GEMM with FP32 accumulation, global decode scales in the FP32 epilogue) up to the
// order of the FP32 additions: every product x_k * w_k is exact, sums are FP32, and
//     y = f32(alpha_eff * sum),  alpha_eff = f32(f32(alpha * d_x) * d_w),
// with d_x = A_x / C_x when x holds NVFP4 scaled-domain values (x_nvfp4_amax set; 1 otherwise) and
// d_w = A_w / C_w for NVFP4 weights (1 for BF16). With per-token activation amaxes
// (QuantConfig::nvfp4_row_amax) A_x is token b's own, so alpha_eff is per token: the emulated
// GEMM's row-scaled epilogue (gemm_kernels.h), operation for operation. BF16 outputs are rounded to
// nearest from FP32.
// The result is deterministic (split-K partials are summed in a fixed order).
//
// Activations. With an NVFP4 activation quantizer (the rl_sampler recipe), decode_quantize_nvfp4
// quantizes x [B, K] (any B: no 64-row tile) straight to the scaled domain plus a device amax,
// bit-identical to quant::quantize_reference + dequantize_bf16_scaled_reference; pass both to
// decode_gemv. Plain BF16 activations are passed as they are.
//
// Streams and memory. Everything is asynchronous on `stream`. Split-K partials and arrival
// counters live in a DecodeWorkspace, which one stream uses at a time.
#pragma once

#include "core/tensor.h"
#include "quant/quantize.h"

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fourbit::gemm {

inline constexpr int kDecodeMaxTokens = 64;
inline constexpr int kDecodeChainMaxTokens = 8;  // decode_gemv_chain: one 8-token mma tile

// One linear layer's weight W [N, K] (N output features, K the reduction) as the GEMV reads it.
struct DecodeWeights {
  TensorView bf16;                                // BF16 [N, K], unit column stride, or
  const quant::QuantizedTensor* nvfp4 = nullptr;  // NVFP4 with a row-wise copy [N, K]
  std::string_view name = "weight";               // appears in every error about it

  static DecodeWeights plain(const TensorView& w, std::string_view name);
  static DecodeWeights packed(const quant::QuantizedTensor& q, std::string_view name);
  bool is_nvfp4() const { return nvfp4 != nullptr; }
  int64_t rows() const;  // N
  int64_t k() const;     // K
  Device device() const;
  int64_t bytes() const;  // bytes one GEMV reads: BF16 2 N K; NVFP4 N ceil(K/2) + N ceil(K/16) + 4
  std::string describe() const;
};

// Device scratch of the decode kernels: split-K partials, per-row-block arrival counters (zero
// between launches) and the activation amax partials. Grows on demand (a reallocation synchronizes
// the device); one stream at a time.
class DecodeWorkspace {
 public:
  DecodeWorkspace() = default;
  DecodeWorkspace(const DecodeWorkspace&) = delete;
  DecodeWorkspace& operator=(const DecodeWorkspace&) = delete;

  // Makes room for `partial_floats` split-K partials and `counters` counters.
  void reserve(int64_t partial_floats, int64_t counters);
  // Reserves what decode_gemv needs for B tokens and an N x K weight on this device.
  void reserve_for(int B, int64_t N, int64_t K);
  float* partials() const;
  unsigned* barrier() const;  // u32 [2]: decode_gemv_chain's grid barrier (zero between launches)
  unsigned* counters() const;
  float* amax_partials() const;
  int64_t bytes() const { return buffer_.defined() ? buffer_.nbytes() : 0; }

 private:
  static constexpr int64_t kBarrierWords = 64;  // 256 bytes: the float regions stay aligned
  Tensor buffer_;  // u8: [barrier u32 x 64][counters u32][amax partials f32][split partials f32]
  int64_t n_counters_ = 0, n_partials_ = 0;
};

// RoPE and the KV-cache append in the epilogue of an attention's qkv GEMV (DecodeGemvArgs::rope):
// W's rows are [q heads | k heads | v heads] of head_dim rows each.
struct DecodeRope {
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0;
  TensorView cos_sin;  // f32 [B, head_dim / 2, 2]: ops::rope_cos_sin_table of the tokens' positions
  // Optional (both or neither): bf16 [sequences, t_max, kv_heads, head_dim] contiguous.
  TensorView k_cache, v_cache;
  TensorView write_pos;      // i32 [B]: token b's cache position (outside [0, t_max): not appended)
  int64_t rows_per_seq = 1;  // token b belongs to sequence b / rows_per_seq
};

struct DecodeGemvArgs {
  TensorView x;  // bf16 [B, K] on CUDA, unit column stride (row stride >= K), 1 <= B <= 64
  // Device float: x holds NVFP4 scaled-domain values (decode_quantize_nvfp4) with this global amax
  // and global constant (QuantConfig::nvfp4_global_constant()); null: x is plain BF16.
  const float* x_nvfp4_amax = nullptr;
  bool x_amax_per_row = false;  // x_nvfp4_amax holds B amaxes, one per token (nvfp4_row_amax)
  float x_global_constant = quant::kNvfp4GlobalConstant;
  DecodeWeights w;
  TensorView y;  // f32 or bf16 [B, N] on CUDA, unit column stride (row stride >= N); overwritten
  // Optional residual: bf16 [B, N] on CUDA, unit column stride. Then y (bf16 only) =
  // bf16(bf16(alpha_eff * x . W^T) + residual), bit for bit the GEMV followed by ops::add_inplace
  // (y, residual): the transformer block's residual add without its own kernel.
  TensorView residual;
  float alpha = 1.0f;
  // SwiGLU output (optional): W [2H, K] holds the gate rows, then the up rows (the MLP's gate/up
  // projection), and y is bf16 [B, H] = ops::swiglu_forward(bf16(alpha_eff * x . W^T)), bit for
  // bit, without the [B, 2H] product being written: the GEMV and the SwiGLU in one kernel. Needs
  // decode_gemv_swiglu_supported(B, 2H) and no residual.
  bool swiglu = false;
  // RoPE output (optional, not with swiglu): y (bf16 [B, (H + 2 Hkv) D]) gets the q and k rows
  // rotated (ops::rope_forward_inplace's bits) and the v rows as computed, and with caches given,
  // the rotated k rows and the v rows are also written to them (ops::rope_forward_inplace_append's
  // bits): the GEMV and the RoPE kernel in one. Needs decode_gemv_rope_supported(B, head_dim) and no
  // residual.
  const DecodeRope* rope = nullptr;
  void* stream = nullptr;  // cudaStream_t
  DecodeWorkspace* workspace = nullptr;  // required
  std::string_view name = "decode gemv";  // appears in every error
};

// Whether decode_gemv takes DecodeGemvArgs::swiglu for B tokens and a weight of N = 2H rows: 1 to
// 16 tokens and H a multiple of 32.
bool decode_gemv_swiglu_supported(int64_t B, int64_t N);
// Whether decode_gemv takes DecodeGemvArgs::rope for B tokens and heads of head_dim: 1 to 16
// tokens, head_dim a multiple of 64.
bool decode_gemv_rope_supported(int64_t B, int64_t head_dim);

// y = alpha_eff * x . W^T (see the header comment). Throws fourbit::Error naming the tensor for a
// wrong device, dtype, shape or stride. CUDA builds only (throws otherwise).
void decode_gemv(const DecodeGemvArgs& args);

// Whether decode_quantize_nvfp4 implements this activation quantizer: NVFP4, 1x16 blocks, round to
// nearest, amax-to-6 or Four Over Six, no 16/17 scale, a per-tensor or per-row amax; `why` (if
// given) says what is not.
bool decode_supports_activation_quant(const quant::QuantConfig& config, std::string* why = nullptr);

struct DecodeQuantizeArgs {
  TensorView x;               // bf16 [B, K] on CUDA, unit column stride, 1 <= B <= 64
  quant::QuantConfig config;  // decode_supports_activation_quant(config)
  TensorView xs;              // bf16 [B, K] contiguous, on CUDA: the scaled-domain values
  float* amax = nullptr;      // device float: the global amax; B floats with config.nvfp4_row_amax
  DecodeWorkspace* workspace = nullptr;  // required (amax partials)
  int* error_flag = nullptr;  // device int: NaN/Inf in x ORs quant::kDeviceErrNonFinite; required
  void* stream = nullptr;
  std::string_view name = "activation";
  // Fused RMSNorm (optional): with norm_weight (f32 [K] on CUDA) given, x is the norm's input and
  // the quantizer reads ops::rmsnorm_forward(x, norm_weight, norm_eps)'s bf16 output, bit for bit,
  // without it being written: one kernel instead of two. Needs decode_quantize_can_fuse_norm(B, K,
  // config.nvfp4_row_amax).
  TensorView norm_weight;
  float norm_eps = 0.0f;
  // Fused SwiGLU (optional, not with the norm): x is the [B, 2K] gate/up buffer (gate columns
  // 0..K-1, up K..2K-1) and the quantizer reads ops::swiglu_forward's bf16 output [B, K], bit for
  // bit, without it being written. Any B <= kDecodeMaxTokens.
  bool swiglu = false;
};
void decode_quantize_nvfp4(const DecodeQuantizeArgs& args);
// Whether decode_quantize_nvfp4 can fuse the RMSNorm for a [B, K] activation (B * K <= 16384,
// K % 8 == 0, B <= kDecodeMaxTokens; with per-row amaxes each row is its own problem: K <= 16384).
bool decode_quantize_can_fuse_norm(int64_t B, int64_t K, bool per_row_amax = false);

// ---- decode chain: several GEMVs in one launch ---------------------------------------------------
// A chain runs dependent decode GEMVs (link i may read what links < i wrote: x, residual) in one
// persistent launch with a grid-wide barrier between links; each CTA's weight loads run ahead
// across the barriers, so the weight stream does not stop between layers (decode_gemv_kernels.h).
// A link can make its x on the fly from its producer's input, never written to memory:
//   - kRmsnorm: x = ops::rmsnorm_forward(gemv.x, norm_weight, norm_eps)'s bf16 output;
//   - kSwiglu:  x = ops::swiglu_forward(gemv.x) with gemv.x the [B, 2K] gate | up input.
// Every link's y equals what its producer op followed by decode_gemv writes, bit for bit (the same
// plan, the same sums in the same order). gemv.stream and gemv.workspace are ignored. Slower than
// the separate kernels so far (decode_gemv_kernels.h, "Performance").
enum class DecodeProducer : uint8_t { kNone, kRmsnorm, kSwiglu };
struct DecodeChainLink {
  DecodeGemvArgs gemv;
  DecodeProducer producer = DecodeProducer::kNone;
  TensorView norm_weight;  // kRmsnorm: f32 [K] on CUDA
  float norm_eps = 0.0f;
};
// Whether decode_gemv_chain runs these links: 1 to 8 links of 1 to 8 tokens, BF16 activations (no
// NVFP4 x), every weight in one format (all BF16 or all NVFP4), x rows of 16-byte aligned 8-element
// pieces; `why` (if given) says what is not.
bool decode_chain_supported(std::span<const DecodeChainLink> links, std::string* why = nullptr);
// Variants of the chain kernel's weight stream, for A/B runs (the same results either way).
struct DecodeChainOptions {
  // Chunks of its next item that each CTA prefetches into L2 as it starts an item: -1 the format's
  // default (4 BF16, 6 NVFP4: 16 / 4.5 KB a row block each), 0 none, n up to the whole item
  // (FOURBIT_DECODE_CHAIN_PREFETCH=n; unset: the default).
  int prefetch_chunks = -1;
  // The register ring's loads of an item's first chunks are issued when the item starts instead of
  // running ahead from the previous item (FOURBIT_DECODE_CHAIN_RING=item): no fence then waits for
  // them.
  bool ring_per_item = false;
  static DecodeChainOptions from_env();  // read once per process
};
// Runs the chain on `stream`. Throws fourbit::Error naming the link's tensor for bad operands (as
// decode_gemv) or for an unsupported chain. CUDA builds only.
void decode_gemv_chain(std::span<const DecodeChainLink> links, DecodeWorkspace& workspace, void* stream,
                       const DecodeChainOptions& options = DecodeChainOptions::from_env());

// ---- CPU reference -------------------------------------------------------------------------------
// Naive loops: float64 sums of x_k * w_k over the exactly dequantized scaled-domain weights
// (quant::dequantize_bf16_scaled_reference), times alpha_eff computed in FP32 as on the GPU.
struct DecodeReferenceArgs {
  TensorView x;  // f32 or bf16 [B, K] on the CPU, contiguous (NVFP4 scaled-domain values or plain)
  std::optional<float> x_nvfp4_amax;  // host: as DecodeGemvArgs::x_nvfp4_amax
  std::vector<float> x_nvfp4_row_amax;  // host, B floats: per-token amaxes instead (nvfp4_row_amax)
  float x_global_constant = quant::kNvfp4GlobalConstant;
  DecodeWeights w;  // on the CPU (an NVFP4 bundle with a host amax)
  float alpha = 1.0f;
};
struct DecodeReference {
  Tensor y;        // f64 [B, N]
  Tensor abs_sum;  // f64 [B, N]: |alpha_eff| * sum_k |x_k w_k|, the scale of the summation error
  float alpha_eff = 1.0f;  // token 0's with per-token amaxes
};
DecodeReference decode_gemv_reference(const DecodeReferenceArgs& args);

// alpha_eff = f32(f32(alpha * d_x) * d_w) from host amaxes (nullopt: that factor is 1).
float decode_alpha_eff(float alpha, std::optional<float> x_amax, float x_constant, std::optional<float> w_amax,
                       float w_constant);

}  // namespace fourbit::gemm
