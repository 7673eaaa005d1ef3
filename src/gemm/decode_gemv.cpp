// Host side of the decode GEMV (decode_gemv.h): argument validation naming the tensor, the
// workspace, the launches (CUDA builds) and the float64 CPU reference.
#include "gemm/decode_gemv.h"

#include "core/check.h"
#include "core/device.h"
#include "core/env.h"
#include "core/error.h"
#include "formats/element.h"
#include "quant/block_math.h"

#if defined(FOURBIT_WITH_CUDA)
#include "gemm/decode_gemv_kernels.h"

#include <cuda_runtime_api.h>
#endif

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <string_view>
#include <cmath>
#include <vector>

namespace fourbit::gemm {

// ---- DecodeWeights -------------------------------------------------------------------------------

DecodeWeights DecodeWeights::plain(const TensorView& w, std::string_view name) {
  DecodeWeights d;
  d.bf16 = w;
  d.name = name;
  return d;
}

DecodeWeights DecodeWeights::packed(const quant::QuantizedTensor& q, std::string_view name) {
  DecodeWeights d;
  d.nvfp4 = &q;
  d.name = name;
  return d;
}

int64_t DecodeWeights::rows() const { return nvfp4 != nullptr ? nvfp4->rows : bf16.shape[0]; }
int64_t DecodeWeights::k() const { return nvfp4 != nullptr ? nvfp4->cols : bf16.shape[1]; }
Device DecodeWeights::device() const { return nvfp4 != nullptr ? nvfp4->device : bf16.device; }

int64_t DecodeWeights::bytes() const {
  const int64_t n = rows(), k = this->k();
  if (nvfp4 == nullptr) return 2 * n * k;
  return n * ((k + 1) / 2) + n * ((k + 15) / 16) + 4;
}

std::string DecodeWeights::describe() const {
  if (nvfp4 != nullptr) {
    return fmt::format("{} (nvfp4 {}, row-wise) [{}, {}] on {}", name, nvfp4->config.describe(), rows(), k(),
                       nvfp4->device == Device::kCuda ? "cuda" : "cpu");
  }
  return fmt::format("{} = {}", name, bf16.describe());
}

namespace {

// Checks a weight bundle and returns its (N, K).
void check_weights(const DecodeWeights& w, Device device, std::string_view where) {
  if (w.nvfp4 != nullptr) {
    const quant::QuantizedTensor& q = *w.nvfp4;
    FOURBIT_CHECK(q.config.format == quant::Format::kNvfp4,
                  "{}: weight '{}' is {} (the decode GEMV reads nvfp4 or bf16 weights)", where, w.name,
                  quant::format_name(q.config.format));
    FOURBIT_CHECK(q.rowwise.has_value(), "{}: weight '{}' has no row-wise copy (quantize it with "
                  "Orientations{{.rowwise = true}})", where, w.name);
    const quant::QuantizedData& d = *q.rowwise;
    FOURBIT_CHECK(q.device == device && d.data.device() == device,
                  "{}: weight '{}' must be on {}", where, w.name, device == Device::kCuda ? "cuda" : "the cpu");
    FOURBIT_CHECK(d.rows == q.rows && d.cols == q.cols && q.rows >= 1 && q.cols >= 1,
                  "{}: weight '{}' row-wise copy is [{}, {}] for a [{}, {}] source", where, w.name, d.rows,
                  d.cols, q.rows, q.cols);
    FOURBIT_CHECK(d.data.nbytes() >= d.rows * ((d.cols + 1) / 2) && d.scales.nbytes() >= d.rows * ((d.cols + 15) / 16) &&
                      d.amax.defined(),
                  "{}: weight '{}' row-wise copy is smaller than its [{}, {}] layout", where, w.name, d.rows, d.cols);
    return;
  }
  const TensorView& t = w.bf16;
  FOURBIT_CHECK(t.data != nullptr, "{}: weight '{}' is empty (give a bf16 tensor or an nvfp4 bundle)", where, w.name);
  FOURBIT_CHECK(t.device == device && t.dtype == DType::kBF16 && t.shape.ndim == 2 && t.strides[1] == 1 &&
                    t.strides[0] >= t.shape[1] && t.shape[0] >= 1 && t.shape[1] >= 1,
                "{}: weight '{}' must be a bf16 [N, K] matrix with unit column stride on {}, got {}", where, w.name,
                device == Device::kCuda ? "cuda" : "the cpu", t.describe());
}

}  // namespace

float decode_alpha_eff(float alpha, std::optional<float> x_amax, float x_constant, std::optional<float> w_amax,
                       float w_constant) {
  float a = alpha;
  if (x_amax) a = formats::mul_rn(a, quant::nvfp4_global_decode_scale(*x_amax, x_constant));
  if (w_amax) a = formats::mul_rn(a, quant::nvfp4_global_decode_scale(*w_amax, w_constant));
  return a;
}

bool decode_supports_activation_quant(const quant::QuantConfig& c, std::string* why) {
  std::string reason;
  if (c.format != quant::Format::kNvfp4) {
    reason = fmt::format("format {} (only nvfp4)", quant::format_name(c.format));
  } else if (c.block_2d) {
    reason = "16x16 blocks (activations take 1x16)";
  } else if (c.rounding != quant::Rounding::kNearest) {
    reason = "stochastic rounding (the sampler rounds to nearest)";
  } else if (c.sr_unbiased_scale) {
    reason = "the 16/17 scale";
  }
  if (why != nullptr) *why = reason;
  return reason.empty();
}

// ---- CPU reference ---------------------------------------------------------------------------------

DecodeReference decode_gemv_reference(const DecodeReferenceArgs& a) {
  const std::string_view where = "decode_gemv_reference";
  check_weights(a.w, Device::kCpu, where);
  const TensorView& x = a.x;
  FOURBIT_CHECK(x.device == Device::kCpu && (x.dtype == DType::kF32 || x.dtype == DType::kBF16) &&
                    x.shape.ndim == 2 && x.is_contiguous(),
                "{}: x must be a contiguous f32 or bf16 [B, K] on the cpu, got {}", where, x.describe());
  const int64_t B = x.shape[0], K = x.shape[1], N = a.w.rows();
  FOURBIT_CHECK(K == a.w.k(), "{}: x has K = {} but weight '{}' has K = {}", where, K, a.w.name, a.w.k());
  std::vector<double> xv((size_t)(B * K));
  for (int64_t i = 0; i < B * K; ++i) {
    xv[(size_t)i] = x.dtype == DType::kF32 ? (double)x.ptr<const float>()[i]
                                           : (double)formats::decode_bf16(x.ptr<const uint16_t>()[i]);
  }
  std::vector<double> wv((size_t)(N * K));
  std::optional<float> w_amax;
  float w_constant = 1.0f;
  if (a.w.nvfp4 != nullptr) {
    const Tensor s = quant::dequantize_bf16_scaled_reference(*a.w.nvfp4, false);  // bf16 [N, K]
    for (int64_t i = 0; i < N * K; ++i) wv[(size_t)i] = formats::decode_bf16(s.ptr<const uint16_t>()[i]);
    w_amax = *a.w.nvfp4->rowwise->amax.ptr<const float>();
    w_constant = a.w.nvfp4->config.nvfp4_global_constant();
  } else {
    const TensorView& t = a.w.bf16;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k)
        wv[(size_t)(n * K + k)] = formats::decode_bf16(t.ptr<const uint16_t>()[n * t.strides[0] + k]);
  }
  const bool per_row = !a.x_nvfp4_row_amax.empty();
  FOURBIT_CHECK(!per_row || ((int64_t)a.x_nvfp4_row_amax.size() == B && !a.x_nvfp4_amax),
                "{}: give either x_nvfp4_amax or {} per-token amaxes, got {}", where, B, a.x_nvfp4_row_amax.size());
  auto alpha_of = [&](int64_t b) {
    return decode_alpha_eff(a.alpha, per_row ? std::optional<float>(a.x_nvfp4_row_amax[(size_t)b]) : a.x_nvfp4_amax,
                            a.x_global_constant, w_amax, w_constant);
  };
  DecodeReference r;
  r.alpha_eff = alpha_of(0);
  r.y = Tensor::empty({B, N}, DType::kF64, Device::kCpu);
  r.abs_sum = Tensor::empty({B, N}, DType::kF64, Device::kCpu);
  for (int64_t b = 0; b < B; ++b) {
    const double alpha = alpha_of(b);
    for (int64_t n = 0; n < N; ++n) {
      double s = 0.0, sa = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = xv[(size_t)(b * K + k)] * wv[(size_t)(n * K + k)];
        s += p;
        sa += std::fabs(p);
      }
      r.y.ptr<double>()[b * N + n] = alpha * s;
      r.abs_sum.ptr<double>()[b * N + n] = std::fabs(alpha) * sa;
    }
  }
  return r;
}

namespace {
// An A/B variable of the decode kernels: an integer in [0, 1024] (core/env.h), nullopt when unset.
std::optional<int> decode_env_int(const char* name) { return env_int(name, 1024); }
}  // namespace
DecodeChainOptions DecodeChainOptions::from_env() {
  static const DecodeChainOptions options = [] {
    DecodeChainOptions o;
    o.prefetch_chunks = decode_env_int("FOURBIT_DECODE_CHAIN_PREFETCH").value_or(o.prefetch_chunks);
    const char* ring = std::getenv("FOURBIT_DECODE_CHAIN_RING");
    o.ring_per_item = ring != nullptr && std::string_view(ring) == "item";
    return o;
  }();
  return options;
}

// ---- CUDA ------------------------------------------------------------------------------------------

#if defined(FOURBIT_WITH_CUDA)


void DecodeWorkspace::reserve(int64_t partial_floats, int64_t counters) {
  if (partial_floats <= n_partials_ && counters <= n_counters_ && buffer_.defined()) return;
  const int64_t nc = std::max(counters, n_counters_), np = std::max(partial_floats, n_partials_);
  // Counters rounded up to 64 so that the float regions stay 256-byte aligned.
  const int64_t nc_padded = (nc + 63) / 64 * 64;
  const int64_t bytes = (kBarrierWords + nc_padded) * 4 + (int64_t)kernels::kDecodeAmaxPartials * 4 + np * 4;
  buffer_ = Tensor::zeros({bytes}, DType::kU8, Device::kCuda);  // zero barrier and counters
  n_counters_ = nc_padded;
  n_partials_ = np;
}

namespace {
// FOURBIT_DECODE_STAGED=small: batches above 16 tokens take the per-chunk double-buffered kernel
// (decode_gemv_kernels.h); anything else (the default): every batch is staged. Read once.
bool decode_stage_large_batches() {
  static const bool stage = [] {
    const char* v = std::getenv("FOURBIT_DECODE_STAGED");
    return v == nullptr || std::string_view(v) != "small";
  }();
  return stage;
}

// plan_decode_gemv's cap_cluster: on unless FOURBIT_DECODE_PLAN=split (for A/B runs). Staged
// launches whose split target passes a cluster take one cluster of longer splits: on an H200 the
// 2048 x 5632 GEMV at 1-16 tokens went from 20-27 us (15-22 splits through the workspace) to 8-13
// us, and the 1.1B decode step at batch 1 from 1.82 to 1.37 ms (bf16), 2.17 to 1.71 ms (e2e4)
// (bench/notes-decode.md). Read once.
bool decode_cap_cluster() {
  static const bool cap = [] {
    const char* v = std::getenv("FOURBIT_DECODE_PLAN");
    return v == nullptr || std::string_view(v) != "split";
  }();
  return cap;
}

// FOURBIT_DECODE_PER_SM=n and FOURBIT_DECODE_STAGED_CHUNKS=n (positive integers; unset or 0: the
// plan's own choice) override plan_decode_gemv's CTAs-per-SM target and most chunks per staged
// split, for A/B runs of other work splits. Read once.
kernels::DecodeGemvPlan decode_plan(int B, int64_t N, int64_t K, bool cap_cluster) {
  static const int per_sm = decode_env_int("FOURBIT_DECODE_PER_SM").value_or(0);
  static const int staged_chunks = decode_env_int("FOURBIT_DECODE_STAGED_CHUNKS").value_or(0);
  return kernels::plan_decode_gemv(B, N, K, current_device_sm_count(), decode_stage_large_batches(), cap_cluster,
                                   per_sm, staged_chunks);
}
}  // namespace

namespace {
// The split partials of `plan` when every split goes through the workspace, a cluster's too (a
// chain link's: decode_gemv_chain).
int64_t chain_partial_floats(const kernels::DecodeGemvPlan& plan, int64_t B, int64_t N) {
  return plan.splits > 1 ? (int64_t)plan.splits * B * N : 0;
}
}  // namespace

// The workspace of the uncapped plan: a superset of the capped one's (a cluster needs no partials),
// and of the capped plan's as a chain link.
void DecodeWorkspace::reserve_for(int B, int64_t N, int64_t K) {
  const kernels::DecodeGemvPlan plan = decode_plan(B, N, K, /*cap_cluster=*/false);
  const int64_t chain_floats = chain_partial_floats(decode_plan(B, N, K, decode_cap_cluster()), B, N);
  reserve(std::max(plan.partial_floats, chain_floats), plan.row_blocks);
}

unsigned* DecodeWorkspace::barrier() const {
  return buffer_.defined() ? static_cast<unsigned*>(buffer_.data()) : nullptr;
}
unsigned* DecodeWorkspace::counters() const {
  return buffer_.defined() ? static_cast<unsigned*>(buffer_.data()) + kBarrierWords : nullptr;
}
float* DecodeWorkspace::amax_partials() const {
  return buffer_.defined()
             ? reinterpret_cast<float*>(static_cast<char*>(buffer_.data()) + (kBarrierWords + n_counters_) * 4)
             : nullptr;
}
float* DecodeWorkspace::partials() const {
  return buffer_.defined() ? amax_partials() + kernels::kDecodeAmaxPartials : nullptr;
}

namespace {
// Checks a GEMV's operands and fills the kernel's parameters, all but the workspace. x_per_k:
// columns of x per reduction element (2: x is a fused SwiGLU's [B, 2K] gate | up input).
kernels::DecodeGemvParams gemv_params(const DecodeGemvArgs& a, int x_per_k) {
  const std::string_view where = a.name;
  check_weights(a.w, Device::kCuda, where);
  const TensorView& x = a.x;
  FOURBIT_CHECK(x.device == Device::kCuda && x.dtype == DType::kBF16 && x.shape.ndim == 2 && x.strides[1] == 1 &&
                    x.strides[0] >= x.shape[1] && x.shape[1] % x_per_k == 0,
                "{}: x must be a bf16 [B, {}K] matrix with unit column stride on cuda, got {}", where,
                x_per_k == 1 ? "" : "2", x.describe());
  const int64_t B = x.shape[0], K = x.shape[1] / x_per_k, N = a.w.rows();
  FOURBIT_CHECK(B >= 1 && B <= kDecodeMaxTokens, "{}: x has {} rows; the decode GEMV takes 1 to {} tokens",
                where, B, kDecodeMaxTokens);
  FOURBIT_CHECK(K == a.w.k(), "{}: x {} has K = {} but weight {} has K = {}", where, x.describe(), K,
                a.w.describe(), a.w.k());
  if (a.swiglu) {
    FOURBIT_CHECK(decode_gemv_swiglu_supported(B, N),
                  "{}: a SwiGLU output needs 1 to {} tokens and a weight of 2H rows with H a multiple of {}; got {} "
                  "tokens and weight {} (run the GEMV into a [B, 2H] buffer and ops::swiglu_forward instead)",
                  where, kernels::kDecodePairMaxTokens, kernels::kDecodeRowsPerCta / 2, B, a.w.describe());
    FOURBIT_CHECK(a.rope == nullptr, "{}: give either a SwiGLU or a RoPE output, not both", where);
  }
  // y: [B, N], or [B, N / 2] for a SwiGLU output; bf16 only (and no residual) with an epilogue.
  const TensorView& y = a.y;
  const bool epilogue = a.swiglu || a.rope != nullptr;
  const int64_t y_cols = a.swiglu ? N / 2 : N;
  FOURBIT_CHECK(y.device == Device::kCuda && (y.dtype == DType::kBF16 || (y.dtype == DType::kF32 && !epilogue)) &&
                    y.shape.ndim == 2 && y.shape[0] == B && y.shape[1] == y_cols && y.strides[1] == 1 &&
                    y.strides[0] >= y_cols,
                "{}: {}y must be {} [{}, {}] matrix with unit column stride on cuda, got {}", where,
                a.swiglu ? "with a SwiGLU output " : a.rope != nullptr ? "with a RoPE output " : "",
                epilogue ? "a bf16" : "an f32 or bf16", B, y_cols, y.describe());
  FOURBIT_CHECK(!epilogue || a.residual.data == nullptr, "{}: a {} output takes no residual", where,
                a.swiglu ? "SwiGLU" : "RoPE");
  if (a.rope != nullptr) {
    const DecodeRope& r = *a.rope;
    const int64_t D = r.head_dim, rows = (r.q_heads + 2 * r.kv_heads) * D;
    FOURBIT_CHECK(decode_gemv_rope_supported(B, D) && r.q_heads >= 1 && r.kv_heads >= 1,
                  "{}: a RoPE output needs 1 to {} tokens, q and kv heads and a head dim that is a multiple of {}; "
                  "got {} tokens, {} q heads, {} kv heads of {} (run the GEMV, then ops::rope_forward_inplace_append)",
                  where, kernels::kDecodePairMaxTokens, kernels::kDecodeRowsPerCta, B, r.q_heads, r.kv_heads, D);
    FOURBIT_CHECK(N == rows, "{}: a RoPE output needs a weight of (q heads + 2 kv heads) x head dim = {} rows, got {}",
                  where, rows, a.w.describe());
    const TensorView& cs = r.cos_sin;
    FOURBIT_CHECK(cs.device == Device::kCuda && cs.dtype == DType::kF32 && cs.shape.ndim == 3 && cs.shape[0] == B &&
                      cs.shape[1] == D / 2 && cs.shape[2] == 2 && cs.is_contiguous(),
                  "{}: the RoPE (cos, sin) table must be a contiguous f32 [{}, {}, 2] on cuda "
                  "(ops::rope_cos_sin_table), got {}", where, B, D / 2, cs.describe());
    FOURBIT_CHECK((r.k_cache.data == nullptr) == (r.v_cache.data == nullptr),
                  "{}: give both KV caches or neither", where);
    if (r.k_cache.data != nullptr) {
      for (const TensorView* c : {&r.k_cache, &r.v_cache}) {
        FOURBIT_CHECK(c->device == Device::kCuda && c->dtype == DType::kBF16 && c->shape.ndim == 4 &&
                          c->shape[2] == r.kv_heads && c->shape[3] == D && c->is_contiguous() &&
                          c->shape == r.k_cache.shape,
                      "{}: the KV caches must be contiguous bf16 [sequences, t_max, {}, {}] on cuda, got {} and {}",
                      where, r.kv_heads, D, r.k_cache.describe(), r.v_cache.describe());
      }
      FOURBIT_CHECK(r.rows_per_seq >= 1 && B % r.rows_per_seq == 0 && B / r.rows_per_seq <= r.k_cache.shape[0],
                    "{}: {} tokens of {} a sequence do not fit the cache's {} sequences", where, B, r.rows_per_seq,
                    r.k_cache.shape[0]);
      FOURBIT_CHECK(r.write_pos.device == Device::kCuda && r.write_pos.dtype == DType::kI32 &&
                        r.write_pos.shape.ndim == 1 && r.write_pos.shape[0] == B && r.write_pos.is_contiguous(),
                    "{}: write_pos must be a contiguous i32 [{}] on cuda, got {}", where, B, r.write_pos.describe());
    }
  }
  const TensorView& r = a.residual;
  if (r.data != nullptr) {
    FOURBIT_CHECK(y.dtype == DType::kBF16, "{}: a residual needs a bf16 y, got {}", where, y.describe());
    FOURBIT_CHECK(r.device == Device::kCuda && r.dtype == DType::kBF16 && r.shape.ndim == 2 && r.shape[0] == B &&
                      r.shape[1] == N && r.strides[1] == 1 && r.strides[0] >= N,
                  "{}: residual must be a bf16 [{}, {}] matrix with unit column stride on cuda, got {}", where, B, N,
                  r.describe());
  }
  kernels::DecodeGemvParams p;
  p.x = x.ptr<const uint16_t>();
  p.ldx = x.strides[0];
  p.x_amax = a.x_nvfp4_amax;
  p.x_amax_per_row = a.x_amax_per_row;
  FOURBIT_CHECK(!a.x_amax_per_row || a.x_nvfp4_amax != nullptr,
                "{}: x_amax_per_row without x_nvfp4_amax", where);
  p.x_constant = a.x_global_constant;
  if (a.w.nvfp4 != nullptr) {
    const quant::QuantizedData& d = *a.w.nvfp4->rowwise;
    p.format = kernels::DecodeWeightFormat::kNvfp4;
    p.w_data = d.data.ptr<const uint8_t>();
    p.w_scales = d.scales.ptr<const uint8_t>();
    p.w_amax = d.amax.ptr<const float>();
    p.w_constant = a.w.nvfp4->config.nvfp4_global_constant();
  } else {
    p.format = kernels::DecodeWeightFormat::kBf16;
    p.w_bf16 = a.w.bf16.ptr<const uint16_t>();
    p.ldw = a.w.bf16.strides[0];
  }
  p.B = (int)B;
  p.N = N;
  p.K = K;
  p.alpha = a.alpha;
  p.y = y.data;
  p.y_bf16 = y.dtype == DType::kBF16;
  p.ldy = y.strides[0];
  if (r.data != nullptr) {
    p.residual = r.ptr<const uint16_t>();
    p.ldr = r.strides[0];
  }
  p.swiglu_half = a.swiglu ? N / 2 : 0;
  if (a.rope != nullptr) {
    const DecodeRope& r = *a.rope;
    p.rope_half = (int)(r.head_dim / 2);
    p.rope_q_rows = r.q_heads * r.head_dim;
    p.rope_rotated_rows = (r.q_heads + r.kv_heads) * r.head_dim;
    p.rope_cos_sin = r.cos_sin.ptr<const float>();
    if (r.k_cache.data != nullptr) {
      p.k_cache = r.k_cache.ptr<uint16_t>();
      p.v_cache = r.v_cache.ptr<uint16_t>();
      p.write_pos = r.write_pos.ptr<const int32_t>();
      p.t_max = r.k_cache.shape[1];
      p.rows_per_seq = (int)r.rows_per_seq;
    }
  }
  return p;
}
}  // namespace

void decode_gemv(const DecodeGemvArgs& a) {
  kernels::DecodeGemvParams p = gemv_params(a, 1);
  FOURBIT_CHECK(a.workspace != nullptr, "{}: a DecodeWorkspace is required", a.name);
  const kernels::DecodeGemvPlan plan = decode_plan(p.B, p.N, p.K, decode_cap_cluster());
  a.workspace->reserve(plan.partial_floats, plan.row_blocks);
  p.partials = a.workspace->partials();
  p.counters = a.workspace->counters();
  kernels::launch_decode_gemv(p, plan, (cudaStream_t)a.stream);
}

// ops::rmsnorm_forward's block shape for K columns (ops/rmsnorm_kernels.cu, row_shape): the fused
// norm replays that block's summation order. A GPU test checks the two agree bit for bit.
namespace {
struct NormBlock {
  int threads, groups;
};
NormBlock norm_block(int64_t K) {
  const int64_t chunks = (K + 7) / 8;
  const int groups = chunks <= 1024 ? 1 : 2;
  int64_t threads = (chunks + groups - 1) / groups;
  threads = std::max<int64_t>(32, (threads + 31) / 32 * 32);
  return {(int)threads, groups};
}
}  // namespace

void decode_quantize_nvfp4(const DecodeQuantizeArgs& a) {
  const std::string_view where = a.name;
  std::string why;
  FOURBIT_CHECK(decode_supports_activation_quant(a.config, &why),
                "decode_quantize_nvfp4: activation '{}' quantizer '{}' is not supported: {}", where,
                a.config.describe(), why);
  const TensorView& x = a.x;
  FOURBIT_CHECK(x.device == Device::kCuda && x.dtype == DType::kBF16 && x.shape.ndim == 2 && x.strides[1] == 1 &&
                    x.strides[0] >= x.shape[1] && x.shape[0] >= 1 && x.shape[0] <= kDecodeMaxTokens &&
                    x.shape[1] >= 1,
                "decode_quantize_nvfp4: activation '{}' must be a bf16 [B, K] matrix (1 <= B <= {}) with unit "
                "column stride on cuda, got {}", where, kDecodeMaxTokens, x.describe());
  FOURBIT_CHECK(!a.swiglu || a.norm_weight.data == nullptr,
                "decode_quantize_nvfp4: activation '{}': fuse the RMSNorm or the SwiGLU, not both", where);
  FOURBIT_CHECK(!a.swiglu || x.shape[1] % 2 == 0,
                "decode_quantize_nvfp4: the fused SwiGLU of '{}' needs a [B, 2K] gate/up input, got {}", where,
                x.describe());
  const int64_t K = a.swiglu ? x.shape[1] / 2 : x.shape[1];  // the quantized activation's width
  const TensorView& xs = a.xs;
  FOURBIT_CHECK(xs.device == Device::kCuda && xs.dtype == DType::kBF16 && xs.shape.ndim == 2 &&
                    xs.shape[0] == x.shape[0] && xs.shape[1] == K && xs.is_contiguous(),
                "decode_quantize_nvfp4: the scaled-domain output of '{}' must be a contiguous bf16 [{}, {}] on "
                "cuda, got {}", where, x.shape[0], K, xs.describe());
  FOURBIT_CHECK(a.amax != nullptr && a.workspace != nullptr && a.error_flag != nullptr,
                "decode_quantize_nvfp4: activation '{}' needs an amax output, a workspace and an error flag", where);
  a.workspace->reserve(0, 0);
  kernels::DecodeQuantizeParams p;
  p.x = x.ptr<const uint16_t>();
  p.ldx = x.strides[0];
  p.B = (int)x.shape[0];
  p.K = K;
  p.swiglu = a.swiglu;
  p.four_over_six = a.config.nvfp4_scale_rule == quant::Nvfp4ScaleRule::kFourOverSix;
  p.four_over_six_metric = (uint8_t)a.config.four_over_six_metric;
  p.scale_constant = a.config.nvfp4_scale_constant();
  p.element_constant = a.config.nvfp4_global_constant();
  p.xs = xs.ptr<uint16_t>();
  p.amax_out = a.amax;
  p.per_row_amax = a.config.nvfp4_row_amax;
  p.partials = a.workspace->amax_partials();
  p.error_flags = a.error_flag;
  if (a.norm_weight.data != nullptr) {
    const TensorView& w = a.norm_weight;
    FOURBIT_CHECK(decode_quantize_can_fuse_norm(x.shape[0], x.shape[1], p.per_row_amax),
                  "decode_quantize_nvfp4: activation '{}' [{}, {}] cannot fuse the RMSNorm (needs B * K <= {} and "
                  "K % 8 == 0); run ops::rmsnorm_forward first and pass its output", where, x.shape[0], x.shape[1],
                  kernels::kDecodeFusedNormElements);
    FOURBIT_CHECK(w.device == Device::kCuda && w.dtype == DType::kF32 && w.shape.ndim == 1 &&
                      w.shape[0] == x.shape[1] && w.is_contiguous(),
                  "decode_quantize_nvfp4: the RMSNorm weight of '{}' must be a contiguous f32 [{}] on cuda, got {}",
                  where, x.shape[1], w.describe());
    const NormBlock nb = norm_block(x.shape[1]);
    p.norm_weight = w.ptr<const float>();
    p.norm_eps = a.norm_eps;
    p.norm_threads = nb.threads;
    p.norm_groups = nb.groups;
  }
  kernels::launch_decode_quantize_x(p, (cudaStream_t)a.stream);
}

bool decode_quantize_can_fuse_norm(int64_t B, int64_t K, bool per_row_amax) {
  if (!(B >= 1 && B <= kDecodeMaxTokens)) return false;
  const int64_t rows = per_row_amax ? 1 : B;  // per row: each CTA normalizes its own row alone
  if (!(K >= 8 && K % 8 == 0 && rows * K <= kernels::kDecodeFusedNormElements)) return false;
  const NormBlock nb = norm_block(K);
  return rows * nb.threads <= kernels::kDecodeFusedNormPairs;  // every (row, thread) pair's loads at once
}

bool decode_gemv_swiglu_supported(int64_t B, int64_t N) {
  return B >= 1 && B <= kernels::kDecodePairMaxTokens && N >= kernels::kDecodeRowsPerCta &&
         N % kernels::kDecodeRowsPerCta == 0;
}

bool decode_gemv_rope_supported(int64_t B, int64_t head_dim) {
  return B >= 1 && B <= kernels::kDecodePairMaxTokens && head_dim >= kernels::kDecodeRowsPerCta &&
         head_dim % kernels::kDecodeRowsPerCta == 0;
}

// ---- decode chain ----------------------------------------------------------------------------------

namespace {
static_assert(kDecodeChainMaxTokens == kernels::kDecodeChainMaxTokens);
int x_per_k(const DecodeChainLink& l) { return l.producer == DecodeProducer::kSwiglu ? 2 : 1; }
}  // namespace

bool decode_chain_supported(std::span<const DecodeChainLink> links, std::string* why) {
  std::string reason;
  if (links.empty() || links.size() > (size_t)kernels::kDecodeChainMaxLinks) {
    reason = fmt::format("{} links (a chain has 1 to {})", links.size(), kernels::kDecodeChainMaxLinks);
  }
  for (size_t i = 0; i < links.size() && reason.empty(); ++i) {
    const DecodeChainLink& l = links[i];
    const TensorView& x = l.gemv.x;
    const std::string_view name = l.gemv.name;
    if (x.shape.ndim != 2 || x.shape[0] < 1 || x.shape[0] > kernels::kDecodeChainMaxTokens) {
      reason = fmt::format("{}: x {} (a chain takes 1 to {} tokens)", name, x.describe(),
                           kernels::kDecodeChainMaxTokens);
    } else if (l.gemv.x_nvfp4_amax != nullptr) {
      reason = fmt::format("{}: NVFP4 activations (a chain takes BF16 x)", name);
    } else if (l.gemv.swiglu || l.gemv.rope != nullptr) {
      reason = fmt::format("{}: a SwiGLU or RoPE output (a chain takes plain GEMV links)", name);
    } else if (l.gemv.w.is_nvfp4() != links[0].gemv.w.is_nvfp4()) {
      reason = fmt::format("{}: its weight format differs from the first link's", name);
    } else if (x.shape[1] % (8 * x_per_k(l)) != 0 || x.strides[0] % 8 != 0 ||
               reinterpret_cast<uintptr_t>(x.data) % 16 != 0) {
      reason = fmt::format("{}: x {} is not made of 16-byte aligned 8-element pieces", name, x.describe());
    } else if (l.producer == DecodeProducer::kRmsnorm &&
               x.shape[0] * norm_block(x.shape[1]).threads / 32 > kernels::kDecodeChainMaxNormWarps) {
      reason = fmt::format("{}: a fused RMSNorm of {} columns", name, x.shape[1]);
    }
  }
  if (why != nullptr) *why = reason;
  return reason.empty();
}

void decode_gemv_chain(std::span<const DecodeChainLink> links, DecodeWorkspace& workspace, void* stream,
                       const DecodeChainOptions& options) {
  std::string why;
  FOURBIT_CHECK(decode_chain_supported(links, &why), "decode_gemv_chain: {}", why);
  kernels::DecodeChainParams c;
  c.n_links = (int)links.size();
  int64_t partial_floats = 0, counters = 0;
  for (int i = 0; i < c.n_links; ++i) {
    const DecodeChainLink& l = links[(size_t)i];
    kernels::DecodeChainLink& k = c.links[i];
    k.g = gemv_params(l.gemv, x_per_k(l));
    const kernels::DecodeGemvPlan plan = decode_plan(k.g.B, k.g.N, k.g.K, decode_cap_cluster());
    FOURBIT_CHECK(plan.staged && plan.n_tiles == 1, "decode_gemv_chain: {}: no staged one-tile plan", l.gemv.name);
    k.row_blocks = plan.row_blocks;
    k.splits = plan.splits;
    k.chunks = plan.chunks;
    k.chunks_per_split = plan.chunks_per_split;
    partial_floats = std::max(partial_floats, chain_partial_floats(plan, k.g.B, k.g.N));
    counters = std::max<int64_t>(counters, plan.row_blocks);
    if (l.producer == DecodeProducer::kRmsnorm) {
      const TensorView& w = l.norm_weight;
      FOURBIT_CHECK(w.device == Device::kCuda && w.dtype == DType::kF32 && w.shape.ndim == 1 &&
                        w.shape[0] == k.g.K && w.is_contiguous(),
                    "decode_gemv_chain: the RMSNorm weight of '{}' must be a contiguous f32 [{}] on cuda, got {}",
                    l.gemv.name, k.g.K, w.describe());
      const NormBlock nb = norm_block(k.g.K);
      k.producer = kernels::DecodeChainProducer::kNorm;
      k.norm_weight = w.ptr<const float>();
      k.norm_eps = l.norm_eps;
      k.norm_threads = nb.threads;
      k.norm_groups = nb.groups;
    } else if (l.producer == DecodeProducer::kSwiglu) {
      k.producer = kernels::DecodeChainProducer::kSwiglu;
    }
  }
  workspace.reserve(partial_floats, counters);
  for (int i = 0; i < c.n_links; ++i) {
    c.links[i].g.partials = workspace.partials();
    c.links[i].g.counters = workspace.counters();
  }
  c.barrier = workspace.barrier();
  const bool nvfp4 = c.links[0].g.format == kernels::DecodeWeightFormat::kNvfp4;
  c.prefetch_chunks = options.prefetch_chunks >= 0 ? options.prefetch_chunks : nvfp4 ? 6 : 4;
  c.ring_per_item = options.ring_per_item;
  // FOURBIT_DECODE_CHAIN_PER_SM=n caps the persistent grid at n CTAs an SM (A/B runs; default: the
  // occupancy). Read once.
  static const int per_sm = decode_env_int("FOURBIT_DECODE_CHAIN_PER_SM").value_or(0);
  kernels::launch_decode_chain(c, c.links[0].g.format, per_sm, (cudaStream_t)stream);
}

#else  // no CUDA
void DecodeWorkspace::reserve(int64_t, int64_t) {
  throw Error("DecodeWorkspace: this build has no CUDA (configure with FOURBIT_CUDA=ON)");
}
void DecodeWorkspace::reserve_for(int, int64_t, int64_t) {
  throw Error("DecodeWorkspace: this build has no CUDA (configure with FOURBIT_CUDA=ON)");
}
float* DecodeWorkspace::partials() const { return nullptr; }
unsigned* DecodeWorkspace::barrier() const { return nullptr; }
unsigned* DecodeWorkspace::counters() const { return nullptr; }
float* DecodeWorkspace::amax_partials() const { return nullptr; }

void decode_gemv(const DecodeGemvArgs& a) {
  throw Error(fmt::format("{}: the decode GEMV runs on CUDA; this build has no CUDA (use "
                          "decode_gemv_reference on the CPU)", a.name));
}

void decode_quantize_nvfp4(const DecodeQuantizeArgs& a) {
  throw Error(fmt::format("decode_quantize_nvfp4: activation '{}': this build has no CUDA", a.name));
}

bool decode_quantize_can_fuse_norm(int64_t, int64_t, bool) { return false; }

bool decode_gemv_swiglu_supported(int64_t, int64_t) { return false; }
bool decode_gemv_rope_supported(int64_t, int64_t) { return false; }

bool decode_chain_supported(std::span<const DecodeChainLink>, std::string* why) {
  if (why != nullptr) *why = "this build has no CUDA";
  return false;
}

void decode_gemv_chain(std::span<const DecodeChainLink>, DecodeWorkspace&, void*, const DecodeChainOptions&) {
  throw Error("decode_gemv_chain: this build has no CUDA");
}
#endif

}  // namespace fourbit::gemm
