// decode GEMV (cpu): the float64 reference of gemm/decode_gemv.h against an independent
// computation over fully dequantized operands (quant::dequantize_reference, global scale folded per
// element), BF16 and NVFP4 weights, plain and NVFP4 activations, odd shapes; the activation
// quantizer support rule; argument errors naming the tensor; and (CUDA builds) the launch plan's
// invariants over many shapes and the pair launches' row mapping.
#include "gemm/decode_gemv.h"
#include "gemm_test_util.h"

#if defined(FOURBIT_WITH_CUDA)
#include "gemm/decode_gemv_kernels.h"
#endif

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <utility>
#include <vector>

namespace fourbit::gemm {
namespace {

using testing::expect_error;
using testing::random_matrix;
using testing::to_doubles;

quant::QuantConfig nvfp4(bool four_over_six = false) {
  quant::QuantConfig c;
  c.format = quant::Format::kNvfp4;
  if (four_over_six) c.nvfp4_scale_rule = quant::Nvfp4ScaleRule::kFourOverSix;
  return c;
}

quant::QuantizedTensor quantize(const Tensor& src, const quant::QuantConfig& c) {
  quant::QuantizeOptions o;
  o.tensor_name = "w";
  return quant::quantize_reference(src.view(), c, quant::Orientations{}, o);
}

// Independent: y[b, n] = alpha * sum_k x_full[b, k] * w_full[n, k] with operands dequantized to
// their real values (the global scale applied per element, in FP32, by dequantize_reference).
std::vector<double> independent(const std::vector<double>& x, const std::vector<double>& w, int64_t B, int64_t N,
                                int64_t K, double alpha) {
  std::vector<double> y((size_t)(B * N));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += x[(size_t)(b * K + k)] * w[(size_t)(n * K + k)];
      y[(size_t)(b * N + n)] = alpha * s;
    }
  return y;
}

// |got - want| <= rel * abs_sum elementwise (abs_sum from the reference).
void expect_close(const DecodeReference& r, const std::vector<double>& want, double rel, const char* what) {
  const double* y = r.y.ptr<const double>();
  const double* s = r.abs_sum.ptr<const double>();
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_LE(std::fabs(y[i] - want[i]), rel * s[i] + 1e-300) << what << " element " << i << ": " << y[i]
                                                               << " vs " << want[i];
  }
}

TEST(DecodeGemvReference, Nvfp4WeightsMatchFullDequantization) {
  for (auto [B, N, K] : {std::tuple<int64_t, int64_t, int64_t>{1, 7, 48}, {3, 33, 35}, {8, 16, 300}}) {
    const Tensor x = random_matrix(B, K, 11 + K, DType::kBF16);
    const Tensor w = random_matrix(N, K, 12 + K);
    const quant::QuantizedTensor q = quantize(w, nvfp4());
    DecodeReferenceArgs a;
    a.x = x.view();
    a.w = DecodeWeights::packed(q, "w");
    a.alpha = 0.75f;
    const DecodeReference r = decode_gemv_reference(a);
    ASSERT_EQ(r.y.shape()[0], B);
    ASSERT_EQ(r.y.shape()[1], N);
    const std::vector<double> want =
        independent(to_doubles(x), to_doubles(quant::dequantize_reference(q, false)), B, N, K, 0.75);
    // Per-element FP32 dequantization (one rounding each) vs one FP32 alpha_eff: a few ulps.
    expect_close(r, want, 4 * std::ldexp(1.0, -24), "nvfp4 weights");
  }
}

TEST(DecodeGemvReference, Nvfp4ActivationsAndFourOverSix) {
  const int64_t B = 5, N = 9, K = 64;
  const Tensor xsrc = random_matrix(B, K, 21);
  const Tensor w = random_matrix(N, K, 22);
  for (bool fos : {false, true}) {
    const quant::QuantizedTensor qx = quantize(xsrc, nvfp4(fos));
    const quant::QuantizedTensor qw = quantize(w, nvfp4(fos));
    const Tensor xs = quant::dequantize_bf16_scaled_reference(qx, false);
    DecodeReferenceArgs a;
    a.x = xs.view();
    a.x_nvfp4_amax = *qx.rowwise->amax.ptr<const float>();
    a.x_global_constant = qx.config.nvfp4_global_constant();
    a.w = DecodeWeights::packed(qw, "w");
    const DecodeReference r = decode_gemv_reference(a);
    const std::vector<double> want = independent(to_doubles(quant::dequantize_reference(qx, false)),
                                                 to_doubles(quant::dequantize_reference(qw, false)), B, N, K, 1.0);
    expect_close(r, want, 8 * std::ldexp(1.0, -24), fos ? "4/6" : "amax-to-6");
    EXPECT_EQ(r.alpha_eff, decode_alpha_eff(1.0f, a.x_nvfp4_amax, a.x_global_constant,
                                            *qw.rowwise->amax.ptr<const float>(), qw.config.nvfp4_global_constant()));
  }
}

TEST(DecodeGemvReference, Bf16WeightsStrided) {
  const int64_t B = 2, N = 6, K = 19;
  const Tensor x = random_matrix(B, K, 31, DType::kBF16);
  const Tensor wbuf = random_matrix(N, K + 5, 32, DType::kBF16);
  TensorView w = wbuf.view();
  w.shape = Shape{N, K};  // keeps the row stride K + 5
  DecodeReferenceArgs a;
  a.x = x.view();
  a.w = DecodeWeights::plain(w, "w");
  a.alpha = -2.0f;
  const DecodeReference r = decode_gemv_reference(a);
  const std::vector<double> xv = to_doubles(x), wv = to_doubles(wbuf);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += xv[(size_t)(b * K + k)] * wv[(size_t)(n * (K + 5) + k)];
      EXPECT_EQ(r.y.ptr<const double>()[b * N + n], -2.0 * s);
    }
  EXPECT_EQ(a.w.bytes(), 2 * N * K);
}

TEST(DecodeGemvReference, ZeroWeightsGiveZero) {
  const Tensor x = random_matrix(4, 40, 41, DType::kBF16);
  const Tensor w = Tensor::zeros({10, 40}, DType::kF32, Device::kCpu);
  const quant::QuantizedTensor q = quantize(w, nvfp4());
  DecodeReferenceArgs a;
  a.x = x.view();
  a.w = DecodeWeights::packed(q, "w");
  const DecodeReference r = decode_gemv_reference(a);
  for (int64_t i = 0; i < r.y.numel(); ++i) EXPECT_EQ(r.y.ptr<const double>()[i], 0.0);
  EXPECT_EQ(a.w.bytes(), 10 * 20 + 10 * 3 + 4);
}

TEST(DecodeGemvReference, ErrorsNameTheTensor) {
  const Tensor x = random_matrix(2, 32, 51, DType::kBF16);
  const Tensor w = random_matrix(4, 48, 52, DType::kBF16);
  DecodeReferenceArgs a;
  a.x = x.view();
  a.w = DecodeWeights::plain(w.view(), "blocks.3.qkv");
  expect_error([&] { decode_gemv_reference(a); }, {"blocks.3.qkv", "K = 48", "K = 32"});
  const Tensor wf = random_matrix(4, 32, 53);  // f32 weights are not a decode weight
  a.w = DecodeWeights::plain(wf.view(), "lm_head");
  expect_error([&] { decode_gemv_reference(a); }, {"lm_head", "bf16"});
  quant::QuantConfig mx;
  mx.format = quant::Format::kMxfp8;
  const quant::QuantizedTensor qm = quantize(random_matrix(4, 32, 54), mx);
  a.w = DecodeWeights::packed(qm, "mlp.up");
  expect_error([&] { decode_gemv_reference(a); }, {"mlp.up", "mxfp8"});
}

TEST(DecodeGemv, CpuTensorsAreRejected) {
  const Tensor x = random_matrix(2, 32, 61, DType::kBF16);
  const Tensor w = random_matrix(4, 32, 62, DType::kBF16);
  const Tensor y = Tensor::zeros({2, 4}, DType::kF32, Device::kCpu);
  DecodeWorkspace ws;
  DecodeGemvArgs a;
  a.x = x.view();
  a.w = DecodeWeights::plain(w.view(), "attn.out");
  a.y = y.view();
  a.workspace = &ws;
  a.name = "decode attn.out";
  expect_error([&] { decode_gemv(a); }, {"decode attn.out"});
}

TEST(DecodeGemv, ActivationQuantizerSupport) {
  std::string why;
  EXPECT_TRUE(decode_supports_activation_quant(nvfp4(), &why)) << why;
  EXPECT_TRUE(decode_supports_activation_quant(nvfp4(true), &why)) << why;
  quant::QuantConfig c = nvfp4();
  c.block_2d = true;
  EXPECT_FALSE(decode_supports_activation_quant(c, &why));
  EXPECT_NE(why.find("16x16"), std::string::npos);
  c = nvfp4();
  c.rounding = quant::Rounding::kStochastic;
  EXPECT_FALSE(decode_supports_activation_quant(c, &why));
  EXPECT_NE(why.find("stochastic"), std::string::npos);
  c.format = quant::Format::kMxfp8;
  c.rounding = quant::Rounding::kNearest;
  EXPECT_FALSE(decode_supports_activation_quant(c, &why));
  EXPECT_NE(why.find("mxfp8"), std::string::npos);
}

#if defined(FOURBIT_WITH_CUDA)
TEST(DecodeGemvPlan, CoversEveryChunkAndRow) {
  std::mt19937 rng(7);
  for (int i = 0; i < 2000; ++i) {
    const int B = 1 + (int)(rng() % 64);
    const int64_t N = 1 + (int64_t)(rng() % 40000), K = 1 + (int64_t)(rng() % 20000);
    const int sms = 1 + (int)(rng() % 200);
    const bool stage_large = i % 2 == 0;  // the default, and FOURBIT_DECODE_STAGED=small
    const bool cap_cluster = (i / 2) % 2 == 0;  // the default, and FOURBIT_DECODE_PLAN=split
    const kernels::DecodeGemvPlan p = kernels::plan_decode_gemv(B, N, K, sms, stage_large, cap_cluster);
    ASSERT_GE((int64_t)p.row_blocks * kernels::kDecodeRowsPerCta, N);
    ASSERT_LT((int64_t)(p.row_blocks - 1) * kernels::kDecodeRowsPerCta, N);
    ASSERT_EQ(p.chunks, (K + kernels::kDecodeChunk - 1) / kernels::kDecodeChunk);
    ASSERT_GE(p.splits, 1);
    ASSERT_GE((int64_t)p.splits * p.chunks_per_split, p.chunks) << "chunks left out";
    ASSERT_LT((int64_t)(p.splits - 1) * p.chunks_per_split, p.chunks) << "an empty split";
    ASSERT_LE(p.splits, 65535);
    ASSERT_GE(p.n_tiles * 8, B);
    ASSERT_LT((p.n_tiles / 2) * 8, B);
    ASSERT_EQ(p.cluster, p.staged && p.splits > 1 && p.splits <= kernels::kDecodeClusterMax);
    ASSERT_EQ(p.partial_floats, p.splits > 1 && !p.cluster ? (int64_t)p.splits * B * N : 0);
    const int staged_max = p.n_tiles <= 2 ? kernels::kDecodeStagedChunks : kernels::kDecodeStagedChunks * 2 / p.n_tiles;
    const int staged_splits = (p.chunks + staged_max - 1) / staged_max;
    if (B <= 16) {
      ASSERT_TRUE(p.staged);
    }
    if (B > 16 && !stage_large) {
      ASSERT_FALSE(p.staged);
    }
    if (B > 16 && p.staged) {  // one cluster per row block, at most 4 CTAs per SM
      ASSERT_LE(staged_splits, kernels::kDecodeClusterMax);
      ASSERT_LE((int64_t)p.row_blocks * p.splits, 4 * (int64_t)sms);
    }
    if (cap_cluster && p.staged && staged_splits <= kernels::kDecodeClusterMax) {
      ASSERT_LE(p.splits, kernels::kDecodeClusterMax);
    }
    if (p.staged) {  // x of a whole split: at most 32 KB (the launch opts in to 64 KB with the partials)
      ASSERT_LE(p.chunks_per_split, kernels::kDecodeStagedChunks);
      ASSERT_EQ(p.x_smem_bytes, p.chunks_per_split * p.n_tiles * kernels::kDecodeXTileBytes);
      ASSERT_LE(p.x_smem_bytes, 32 * 1024);
    }
  }
}

// The pair launches' row mapping (decode_pair_base / decode_pair_row): over the SwiGLU's one span
// (N = 2H rows, H a multiple of 32) and RoPE's spans of one head (D a multiple of 64, 1-40 heads),
// the pairs (base + q, base + q + step) of the N / 64 row blocks cover every row of W exactly once,
// the first of each pair in its span's lower half; and the partial rows of the 32 pairs of a block
// are its 64 rows, each once, pair q's at 16 (q / 8) + q % 8 (thread (g, t) of warp w = q / 8,
// g = q % 8 holds rows 16 w + g and 16 w + g + 8).
TEST(DecodeGemvPlan, PairLaunchesCoverEveryRowOnce) {
  constexpr int kPairs = kernels::kDecodeRowsPerCta / 2;
  std::vector<int> local(kernels::kDecodeRowsPerCta, 0);
  for (int q = 0; q < kPairs; ++q) {
    const int r = kernels::decode_pair_row(q);
    ASSERT_EQ(r, 16 * (q / 8) + q % 8);
    ++local[(size_t)r];
    ++local[(size_t)r + 8];
  }
  for (int c : local) ASSERT_EQ(c, 1);
  std::vector<std::pair<int64_t, int64_t>> layouts;  // (step, N)
  for (int64_t H : {32, 64, 96, 1408, 5632, 8704}) layouts.push_back({H, 2 * H});
  for (int64_t D : {64, 128, 192, 256, 512})
    for (int64_t heads : {1, 3, 40}) layouts.push_back({D / 2, heads * D});
  for (auto [step, N] : layouts) {
    std::vector<int> seen((size_t)N, 0);
    for (int64_t block = 0; block < N / kernels::kDecodeRowsPerCta; ++block)
      for (int q = 0; q < kPairs; ++q) {
        const int64_t lo = kernels::decode_pair_base(step, block) + q;
        ASSERT_TRUE(lo >= 0 && lo + step < N) << "step " << step << " N " << N << " block " << block << " q " << q;
        ASSERT_LT(lo % (2 * step), step) << "the first row of a pair lies in its span's lower half";
        ++seen[(size_t)lo];
        ++seen[(size_t)(lo + step)];
      }
    for (int64_t r = 0; r < N; ++r) ASSERT_EQ(seen[(size_t)r], 1) << "step " << step << " N " << N << " row " << r;
  }
}
#endif

}  // namespace
}  // namespace fourbit::gemm
