// decode GEMV (gpu): the CUDA kernels of gemm/decode_gemv.h against the float64 CPU reference over
// the very same operands (weights quantized on the CPU and copied), within the FP32 accumulation
// bound of gemm_test_util.h: BF16 and NVFP4 weights, plain and NVFP4 activations (quantized on the
// GPU by decode_quantize_nvfp4, which must equal the CPU quantizer bit for bit), B = 1, 3, 8, 9, 17,
// 33, 64, K not a multiple of 128 (odd K too), odd N, split-K and single-split launches, strided
// x / y, f32 and bf16 outputs, zero tensors, zero blocks and huge scales. Outputs are poisoned
// (NaN) before each launch, so an unwritten element fails; every launch runs twice and must give
// the same bits (deterministic split-K, counters reset). The decode chain (several GEMVs with fused
// RMSNorm / SwiGLU producers in one launch) against the same GEMVs and ops run one by one, bit for
// bit, and its argument errors. The SwiGLU output (the GEMV and ops::swiglu_forward in one kernel)
// against the two run one by one, bit for bit, and the RoPE output (the qkv GEMV and the RoPE kernel
// with its KV-cache append in one) against those two.
#include "core/device.h"
#include "formats/element.h"
#include "gemm/decode_gemv.h"
#include "gemm_test_util.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/swiglu.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace fourbit::gemm {
namespace {

using testing::expect_error;
using testing::fp32_accumulation_tolerance;
using testing::random_matrix;
using testing::to_doubles;
using testing::within_bound;

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

quant::QuantizedTensor to_device(const quant::QuantizedTensor& q) {
  quant::QuantizedTensor d = q;
  d.device = Device::kCuda;
  for (Tensor* t : {&d.rowwise->data, &d.rowwise->scales, &d.rowwise->amax}) *t = t->to(Device::kCuda);
  return d;
}

void poison(const TensorView& t) {
  // NaN in both f32 and bf16 (0xFFFF... bytes), over the whole strided extent.
  const int64_t extent = dtype_bytes(t.dtype, (t.shape[0] - 1) * t.strides[0] + t.shape[1]);
  FOURBIT_CUDA_CHECK(cudaMemset(t.data, 0xFF, (size_t)extent));
}

// The [rows, cols] values of a possibly strided device matrix.
std::vector<double> fetch(const TensorView& t) {
  const int64_t extent = (t.shape[0] - 1) * t.strides[0] + t.shape[1];
  std::vector<uint8_t> host((size_t)dtype_bytes(t.dtype, extent));
  FOURBIT_CUDA_CHECK(cudaMemcpy(host.data(), t.data, host.size(), cudaMemcpyDeviceToHost));
  std::vector<double> v((size_t)(t.shape[0] * t.shape[1]));
  for (int64_t r = 0; r < t.shape[0]; ++r)
    for (int64_t c = 0; c < t.shape[1]; ++c) {
      const int64_t at = r * t.strides[0] + c;
      v[(size_t)(r * t.shape[1] + c)] =
          t.dtype == DType::kF32 ? (double)reinterpret_cast<const float*>(host.data())[at]
                                 : (double)formats::decode_bf16(reinterpret_cast<const uint16_t*>(host.data())[at]);
    }
  return v;
}

std::vector<uint8_t> raw(const TensorView& t) {
  const int64_t extent = (t.shape[0] - 1) * t.strides[0] + t.shape[1];
  std::vector<uint8_t> host((size_t)dtype_bytes(t.dtype, extent));
  FOURBIT_CUDA_CHECK(cudaMemcpy(host.data(), t.data, host.size(), cudaMemcpyDeviceToHost));
  return host;
}

// A [rows, cols] view with row stride `ld` into a fresh device buffer.
struct Strided {
  Tensor buf;
  TensorView view;
};
Strided strided(int64_t rows, int64_t cols, int64_t ld, DType dtype) {
  Strided s;
  s.buf = Tensor::zeros({rows, ld}, dtype, Device::kCuda);
  s.view = s.buf.view();
  s.view.shape = Shape{rows, cols};
  return s;
}

enum class WKind { kBf16, kNvfp4 };
enum class XKind { kPlain, kNvfp4 };

struct Case {
  int B;
  int64_t N, K;
  WKind w;
  XKind x;
  DType y = DType::kF32;
  int64_t x_pad = 0, y_pad = 0;  // extra row stride
  float alpha = 1.0f;
  double w_scale = 1.0;          // multiplies the weight source (huge / tiny global scales)
  bool zero_blocks = false;      // zero some 16-blocks of the weight and of x, and a whole row
  bool four_over_six = false;
  bool row_amax = false;         // per-token activation amaxes (nvfp4_row_amax)
};

std::string describe(const Case& c) {
  return fmt::format("B={} N={} K={} w={} x={} y={} x_pad={} y_pad={} w_scale={} zero_blocks={} 4/6={} row_amax={}",
                     c.B, c.N, c.K, c.w == WKind::kBf16 ? "bf16" : "nvfp4", c.x == XKind::kPlain ? "plain" : "nvfp4",
                     c.y == DType::kF32 ? "f32" : "bf16", c.x_pad, c.y_pad, c.w_scale, c.zero_blocks, c.four_over_six,
                     c.row_amax);
}

void zero_some_blocks(Tensor& t, uint64_t seed) {  // f32 or bf16 host [R, C]
  std::mt19937 rng((uint32_t)seed);
  const int64_t R = t.shape()[0], C = t.shape()[1];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t b = 0; b * 16 < C; ++b) {
      if (rng() % 4 != 0 && r != R / 2) continue;
      for (int64_t c = b * 16; c < std::min(C, b * 16 + 16); ++c) {
        if (t.dtype() == DType::kF32) t.ptr<float>()[r * C + c] = 0.0f;
        else t.ptr<uint16_t>()[r * C + c] = 0;
      }
    }
}

void run_case(const Case& c, uint64_t seed) {
  SCOPED_TRACE(describe(c));
  // Host operands.
  Tensor wsrc = random_matrix(c.N, c.K, seed);
  for (int64_t i = 0; i < wsrc.numel(); ++i) wsrc.ptr<float>()[i] = (float)(wsrc.ptr<float>()[i] * c.w_scale);
  if (c.zero_blocks) zero_some_blocks(wsrc, seed + 1);
  Tensor xsrc = random_matrix(c.B, c.K, seed + 2, DType::kBF16);
  if (c.zero_blocks) zero_some_blocks(xsrc, seed + 3);
  if (c.row_amax) {  // rows of very different scales: a wrong row's factor cannot pass the bound
    for (int64_t i = 0; i < xsrc.numel(); ++i) {
      const float scale = std::ldexp(1.0f, 3 * (int)(i / c.K % 7) - 9);
      xsrc.ptr<uint16_t>()[i] = formats::encode_bf16_rn(formats::decode_bf16(xsrc.ptr<uint16_t>()[i]) * scale);
    }
  }

  std::optional<quant::QuantizedTensor> qw, qw_dev;
  Tensor w_bf16_host, w_bf16_dev;
  DecodeWeights w_host, w_dev;
  if (c.w == WKind::kNvfp4) {
    qw = quantize(wsrc, nvfp4(c.four_over_six));
    qw_dev = to_device(*qw);
    w_host = DecodeWeights::packed(*qw, "w");
    w_dev = DecodeWeights::packed(*qw_dev, "w");
  } else {
    w_bf16_host = Tensor::empty({c.N, c.K}, DType::kBF16, Device::kCpu);
    for (int64_t i = 0; i < wsrc.numel(); ++i) w_bf16_host.ptr<uint16_t>()[i] = formats::encode_bf16_rn(wsrc.ptr<float>()[i]);
    w_bf16_dev = w_bf16_host.to(Device::kCuda);
    w_host = DecodeWeights::plain(w_bf16_host.view(), "w");
    w_dev = DecodeWeights::plain(w_bf16_dev.view(), "w");
  }

  // Device x (strided), quantized on the device when asked.
  Strided xd = strided(c.B, c.K, c.K + c.x_pad, DType::kBF16);
  FOURBIT_CUDA_CHECK(cudaMemcpy2D(xd.view.data, (size_t)(2 * (c.K + c.x_pad)), xsrc.data(), (size_t)(2 * c.K),
                                  (size_t)(2 * c.K), (size_t)c.B, cudaMemcpyHostToDevice));
  DecodeWorkspace ws;
  Tensor xs_dev, amax_dev, flag = Tensor::zeros({1}, DType::kI32, Device::kCuda);
  DecodeReferenceArgs ra;
  ra.w = w_host;
  ra.alpha = c.alpha;
  Tensor x_ref;
  TensorView x_gemv = xd.view;
  if (c.x == XKind::kNvfp4) {
    quant::QuantConfig xc = nvfp4(c.four_over_six);
    xc.nvfp4_row_amax = c.row_amax;
    xs_dev = Tensor::empty({c.B, c.K}, DType::kBF16, Device::kCuda);
    poison(xs_dev.view());
    amax_dev = Tensor::empty({c.row_amax ? c.B : 1}, DType::kF32, Device::kCuda);
    DecodeQuantizeArgs qa;
    qa.x = xd.view;
    qa.config = xc;
    qa.xs = xs_dev.view();
    qa.amax = amax_dev.ptr<float>();
    qa.workspace = &ws;
    qa.error_flag = flag.ptr<int>();
    decode_quantize_nvfp4(qa);
    FOURBIT_CUDA_CHECK(cudaDeviceSynchronize());
    // Bit for bit the CPU quantizer.
    const quant::QuantizedTensor qx = quantize(xsrc, xc);
    x_ref = quant::dequantize_bf16_scaled_reference(qx, false);
    const Tensor xs_host = xs_dev.to(Device::kCpu);
    ASSERT_EQ(std::memcmp(xs_host.data(), x_ref.data(), (size_t)x_ref.nbytes()), 0) << "scaled-domain x differs";
    const Tensor amax_host = amax_dev.to(Device::kCpu);
    ASSERT_EQ(amax_host.numel(), qx.rowwise->amax.numel());
    for (int64_t i = 0; i < amax_host.numel(); ++i)
      ASSERT_EQ(amax_host.ptr<const float>()[i], qx.rowwise->amax.ptr<const float>()[i]) << "amax " << i;
    ra.x = x_ref.view();
    if (c.row_amax) {
      ra.x_nvfp4_row_amax.assign(amax_host.ptr<const float>(), amax_host.ptr<const float>() + c.B);
    } else {
      ra.x_nvfp4_amax = amax_host.ptr<const float>()[0];
    }
    ra.x_global_constant = xc.nvfp4_global_constant();
    x_gemv = xs_dev.view();
  } else {
    ra.x = xsrc.view();
  }
  const DecodeReference ref = decode_gemv_reference(ra);

  Strided yd = strided(c.B, c.N, c.N + c.y_pad, c.y);
  DecodeGemvArgs a;
  a.x = x_gemv;
  a.x_nvfp4_amax = c.x == XKind::kNvfp4 ? amax_dev.ptr<const float>() : nullptr;
  a.x_amax_per_row = c.x == XKind::kNvfp4 && c.row_amax;
  a.x_global_constant = ra.x_global_constant;
  a.w = w_dev;
  a.y = yd.view;
  a.alpha = c.alpha;
  a.workspace = &ws;
  std::vector<uint8_t> first;
  for (int rep = 0; rep < 2; ++rep) {
    poison(yd.view);
    decode_gemv(a);
    FOURBIT_CUDA_CHECK(cudaDeviceSynchronize());
    if (rep == 0) {
      first = raw(yd.view);
    } else {
      // Only the [B, N] elements, not the padding (left poisoned).
      const std::vector<uint8_t> second = raw(yd.view);
      const int64_t eb = dtype_bytes(c.y, 1);
      for (int64_t r = 0; r < c.B; ++r)
        ASSERT_EQ(std::memcmp(first.data() + r * (c.N + c.y_pad) * eb, second.data() + r * (c.N + c.y_pad) * eb,
                              (size_t)(c.N * eb)), 0)
            << "second launch differs in row " << r;
    }
  }
  const std::vector<double> got = fetch(yd.view);
  const std::vector<double> want(ref.y.ptr<const double>(), ref.y.ptr<const double>() + ref.y.numel());
  const std::vector<double> s(ref.abs_sum.ptr<const double>(), ref.abs_sum.ptr<const double>() + ref.abs_sum.numel());
  EXPECT_TRUE(within_bound(got, want, s, fp32_accumulation_tolerance(c.K), c.y, c.N, describe(c)));
  int flag_host = 0;
  FOURBIT_CUDA_CHECK(cudaMemcpy(&flag_host, flag.data(), 4, cudaMemcpyDeviceToHost));
  EXPECT_EQ(flag_host, 0);

  // bf16 output with a residual: bit for bit the launch above followed by a bf16 add (rounded sum of
  // the two bf16 values), i.e. ops::add_inplace.
  if (c.y == DType::kBF16) {
    const int64_t ldr = c.N + 5;
    std::mt19937_64 rng(seed ^ 0x5EEDu);
    std::normal_distribution<float> nd(0.0f, 2.0f);
    std::vector<uint16_t> res_host((size_t)(c.B * ldr));
    for (uint16_t& v : res_host) v = formats::encode_bf16_rn(nd(rng));
    Strided res = strided(c.B, c.N, ldr, DType::kBF16);
    FOURBIT_CUDA_CHECK(cudaMemcpy(res.buf.data(), res_host.data(), res_host.size() * 2, cudaMemcpyHostToDevice));
    a.residual = res.view;
    poison(yd.view);
    decode_gemv(a);
    FOURBIT_CUDA_CHECK(cudaDeviceSynchronize());
    a.residual = TensorView{};
    const std::vector<uint8_t> with_res = raw(yd.view);
    const int64_t ldy = c.N + c.y_pad;
    for (int64_t r = 0; r < c.B; ++r)
      for (int64_t n = 0; n < c.N; ++n) {
        uint16_t plain = 0, got_bits = 0;
        std::memcpy(&plain, first.data() + 2 * (r * ldy + n), 2);
        std::memcpy(&got_bits, with_res.data() + 2 * (r * ldy + n), 2);
        const uint16_t want_bits = formats::encode_bf16_rn(formats::decode_bf16(plain) + formats::decode_bf16(res_host[(size_t)(r * ldr + n)]));
        ASSERT_EQ(got_bits, want_bits) << describe(c) << ": residual epilogue at [" << r << ", " << n << "]";
      }
  }
}

TEST(DecodeGemvCuda, Nvfp4WeightsPlainActivations) {
  uint64_t seed = 100;
  // {40, 20000}: more splits than a cluster holds even though staged launches are capped at one
  // cluster (decode_gemv.cpp), so the workspace path runs on NVFP4 weights at 1-16 tokens too.
  for (int B : {1, 3, 8, 9, 17, 33, 64})
    for (auto [N, K] : {std::pair<int64_t, int64_t>{256, 2048}, {203, 1000}, {64, 8192}, {1000, 640}, {40, 20000}}) {
      run_case({B, N, K, WKind::kNvfp4, XKind::kPlain}, seed++);
    }
}

TEST(DecodeGemvCuda, Nvfp4WeightsNvfp4Activations) {
  uint64_t seed = 200;
  for (int B : {1, 3, 8, 16, 64})
    for (auto [N, K] : {std::pair<int64_t, int64_t>{512, 2048}, {131, 5632}, {77, 35}, {96, 4096}}) {
      Case c{B, N, K, WKind::kNvfp4, XKind::kNvfp4};
      run_case(c, seed++);
      c.four_over_six = true;
      run_case(c, seed++);
    }
}

// Per-token activation amaxes (the e2e4 sampler): each token's own global scale in the quantizer
// and in the GEMV's epilogue, on the one-split, split-K and cluster epilogues, bf16 and f32 outputs
// (with the residual epilogue), NVFP4 and BF16 weights.
TEST(DecodeGemvCuda, PerTokenActivationAmax) {
  uint64_t seed = 250;
  for (int B : {1, 3, 8, 16, 37, 64})
    for (auto [N, K] : {std::pair<int64_t, int64_t>{512, 2048}, {131, 5632}, {77, 35}, {96, 4096}}) {
      Case c{B, N, K, WKind::kNvfp4, XKind::kNvfp4};
      c.row_amax = true;
      run_case(c, seed++);
      c.four_over_six = true;
      c.y = DType::kBF16;
      run_case(c, seed++);
      c.w = WKind::kBf16;
      c.x_pad = 8;
      run_case(c, seed++);
    }
}

TEST(DecodeGemvCuda, Bf16Weights) {
  uint64_t seed = 300;
  for (int B : {1, 3, 8, 13, 64})
    for (auto [N, K] : {std::pair<int64_t, int64_t>{256, 2048}, {129, 1000}, {64, 8192}, {33, 7}}) {
      run_case({B, N, K, WKind::kBf16, XKind::kPlain}, seed++);
      run_case({B, N, K, WKind::kBf16, XKind::kNvfp4}, seed++);
    }
}

TEST(DecodeGemvCuda, StridedOperandsBf16OutputAlpha) {
  uint64_t seed = 400;
  for (WKind w : {WKind::kBf16, WKind::kNvfp4})
    for (int B : {1, 5, 64}) {
      Case c{B, 300, 1024, w, XKind::kPlain, DType::kBF16, 3, 7, -1.5f};
      run_case(c, seed++);
      c.y = DType::kF32;
      c.x_pad = 8;  // aligned stride
      c.y_pad = 1;
      c.K = 1030;   // not a multiple of 8: the scalar paths
      run_case(c, seed++);
    }
}

TEST(DecodeGemvCuda, ZeroBlocksHugeAndTinyScales) {
  uint64_t seed = 500;
  for (double scale : {1.0, 1e30, 1e-30})
    for (XKind x : {XKind::kPlain, XKind::kNvfp4}) {
      Case c{8, 160, 1536, WKind::kNvfp4, x};
      c.w_scale = scale;
      c.zero_blocks = true;
      run_case(c, seed++);
      c.B = 1;
      run_case(c, seed++);
    }
  // An all-zero weight: amax 0, every scale 0, y exactly 0.
  Case z{3, 64, 256, WKind::kNvfp4, XKind::kNvfp4};
  z.w_scale = 0.0;
  run_case(z, seed++);
}

// decode_quantize_nvfp4 alone, bit for bit the CPU quantizer: both scale rules, every Four Over Six
// metric, sizes on both sides of the one-launch limit (B K <= 16384), K not a multiple of 16 or of
// 8 (the scalar amax loads), a strided x, and edge fills (all zeros, one outlier per row, all-equal
// blocks, values near the E2M1 ties).
TEST(DecodeGemvCuda, QuantizeActivationMatchesCpuQuantizer) {
  struct Shape {
    int B;
    int64_t K, pad;
  };
  const Shape shapes[] = {{1, 2048, 0}, {8, 2048, 0}, {9, 2048, 8}, {2, 5632, 0}, {16, 2048, 0}, {3, 1000, 0},
                          {5, 37, 3}, {64, 512, 0}, {2, 17008, 0}};
  const quant::FourOverSixMetric metrics[] = {quant::FourOverSixMetric::kMse, quant::FourOverSixMetric::kMae,
                                              quant::FourOverSixMetric::kAbsMax};
  uint64_t seed = 800;
  for (const Shape& sh : shapes)
    for (int fill = 0; fill < 5; ++fill)
      for (int rule = 0; rule < 4; ++rule)
        for (bool per_row : {false, true}) {
        Tensor x = random_matrix(sh.B, sh.K, seed++, DType::kBF16);
        uint16_t* xv = x.ptr<uint16_t>();
        for (int64_t i = 0; i < x.numel(); ++i) {
          const int64_t c = i % sh.K;
          if (fill == 1) xv[i] = 0;                                                       // amax = 0
          if (fill == 2) xv[i] = c == 5 ? formats::encode_bf16_rn(1e4f) : xv[i];          // one outlier per row
          if (fill == 3) xv[i] = formats::encode_bf16_rn((c / 16 % 2 ? -0.75f : 2.5f) * (1 + i % 3));  // ties, equal blocks
          if (fill == 4) xv[i] = formats::encode_bf16_rn(formats::decode_bf16(xv[i]) * std::ldexp(1.0f, 4 * (int)(i / sh.K % 6) - 12));  // row scales
        }
        quant::QuantConfig cfg = nvfp4(rule > 0);
        if (rule > 0) cfg.four_over_six_metric = metrics[rule - 1];
        cfg.nvfp4_row_amax = per_row;
        Strided xd = strided(sh.B, sh.K, sh.K + sh.pad, DType::kBF16);
        FOURBIT_CUDA_CHECK(cudaMemcpy2D(xd.view.data, (size_t)(2 * (sh.K + sh.pad)), x.data(), (size_t)(2 * sh.K),
                                        (size_t)(2 * sh.K), (size_t)sh.B, cudaMemcpyHostToDevice));
        Tensor xs = Tensor::empty({sh.B, sh.K}, DType::kBF16, Device::kCuda);
        poison(xs.view());
        Tensor amax = Tensor::empty({per_row ? sh.B : 1}, DType::kF32, Device::kCuda), flag = Tensor::zeros({1}, DType::kI32, Device::kCuda);
        DecodeWorkspace ws;
        DecodeQuantizeArgs qa;
        qa.x = xd.view;
        qa.config = cfg;
        qa.xs = xs.view();
        qa.amax = amax.ptr<float>();
        qa.workspace = &ws;
        qa.error_flag = flag.ptr<int>();
        decode_quantize_nvfp4(qa);
        const quant::QuantizedTensor q = quantize(x, cfg);
        const Tensor want = quant::dequantize_bf16_scaled_reference(q, false);
        const Tensor got = xs.to(Device::kCpu);
        const std::string what = "B " + std::to_string(sh.B) + " K " + std::to_string(sh.K) + " fill " +
                                 std::to_string(fill) + " rule " + std::to_string(rule) + " per_row " + std::to_string(per_row);
        for (int64_t i = 0; i < want.numel(); ++i)
          ASSERT_EQ(got.ptr<const uint16_t>()[i], want.ptr<const uint16_t>()[i]) << what << ": element " << i;
        const Tensor amax_host = amax.to(Device::kCpu);
        ASSERT_EQ(amax_host.numel(), q.rowwise->amax.numel()) << what;
        for (int64_t i = 0; i < amax_host.numel(); ++i)
          ASSERT_EQ(amax_host.ptr<const float>()[i], q.rowwise->amax.ptr<const float>()[i]) << what << ": amax " << i;
      }
}

// One decode_quantize_nvfp4 call: its arguments over poisoned outputs [B, K], a zeroed flag and
// its own workspace (set the fused-producer fields of `args`, then run()).
struct QuantizeCall {
  Tensor xs, amax, flag;
  DecodeWorkspace ws;
  DecodeQuantizeArgs args;
  QuantizeCall(const TensorView& x, const quant::QuantConfig& cfg, int64_t B, int64_t K)
      : xs(Tensor::empty({B, K}, DType::kBF16, Device::kCuda)),
        amax(Tensor::empty({B}, DType::kF32, Device::kCuda)),  // [0] per tensor, B per row
        flag(Tensor::zeros({1}, DType::kI32, Device::kCuda)) {
    poison(xs.view());
    args.x = x;
    args.config = cfg;
    args.xs = xs.view();
    args.amax = amax.ptr<float>();
    args.workspace = &ws;
    args.error_flag = flag.ptr<int>();
  }
  QuantizeCall(const QuantizeCall&) = delete;
  void run() { decode_quantize_nvfp4(args); }
  float amax_host() const {
    float v = 0;
    FOURBIT_CUDA_CHECK(cudaMemcpy(&v, amax.data(), 4, cudaMemcpyDeviceToHost));
    return v;
  }
  std::vector<float> amaxes() const {  // one per row with nvfp4_row_amax
    const Tensor h = amax.to(Device::kCpu);
    return std::vector<float>(h.ptr<const float>(), h.ptr<const float>() + (args.config.nvfp4_row_amax ? h.numel() : 1));
  }
  int flag_host() const {
    int v = 0;
    FOURBIT_CUDA_CHECK(cudaMemcpy(&v, flag.data(), 4, cudaMemcpyDeviceToHost));
    return v;
  }
};

// A GEMV's arguments but its output: x . w^T through workspace ws, errors naming `name`.
DecodeGemvArgs gemv_args(const TensorView& x, const DecodeWeights& w, DecodeWorkspace& ws, std::string_view name) {
  DecodeGemvArgs a;
  a.x = x;
  a.w = w;
  a.workspace = &ws;
  a.name = name;
  return a;
}

// The GEMV's x as NVFP4 activations: x [B, K] quantized by decode_quantize_nvfp4 into q (per
// tensor or per token), and a's x, amax and per-row flag set to it.
void quantize_gemv_input(DecodeGemvArgs& a, std::optional<QuantizeCall>& q, const TensorView& x, int B, int64_t K,
                         bool per_row) {
  quant::QuantConfig xc = nvfp4();
  xc.nvfp4_row_amax = per_row;
  q.emplace(x, xc, B, K);
  q->run();
  a.x = q->xs.view();
  a.x_nvfp4_amax = q->amax.ptr<const float>();
  a.x_amax_per_row = per_row;
}

// A host bf16 weight [N, K] on the device as the GEMV reads it: as is, or quantized to NVFP4 on the
// CPU and copied.
struct DeviceWeights {
  Tensor bf16;
  quant::QuantizedTensor nvfp4_copy;
  DecodeWeights weights;
  DeviceWeights(const Tensor& src, WKind kind, std::string_view name) {
    if (kind == WKind::kBf16) {
      bf16 = src.to(Device::kCuda);
      weights = DecodeWeights::plain(bf16.view(), name);
    } else {
      nvfp4_copy = to_device(quantize(src, nvfp4()));
      weights = DecodeWeights::packed(nvfp4_copy, name);
    }
  }
  DeviceWeights(const DeviceWeights&) = delete;
};

// The fused RMSNorm of the activation quantizer against ops::rmsnorm_forward followed by the
// unfused quantizer: the same scaled-domain values and amax, bit for bit. Shapes cover one and two
// 8-column groups per thread of the norm's block (K 10240: 640 threads, two groups), strided rows
// (a misaligned row start takes the scalar loads), both scale rules, rows of very different scales.
TEST(DecodeGemvCuda, FusedRmsnormMatchesRmsnormThenQuantize) {
  struct Shape {
    int B;
    int64_t K, pad;
  };
  const Shape shapes[] = {{1, 2048, 0}, {3, 2048, 0}, {8, 2048, 0}, {5, 768, 4}, {1, 10240, 0}, {2, 4096, 8},
                          {64, 256, 0}, {1, 8, 0}};
  uint64_t seed = 900;
  for (const Shape& sh : shapes)
    for (int rule = 0; rule < 4; ++rule) {  // rule & 1: Four Over Six; rule & 2: per-row amax
      ASSERT_TRUE(decode_quantize_can_fuse_norm(sh.B, sh.K, rule & 2));
      Tensor x = random_matrix(sh.B, sh.K, seed++, DType::kBF16);
      uint16_t* xv = x.ptr<uint16_t>();
      for (int64_t i = 0; i < x.numel(); ++i) {  // row r scaled by 4^(r % 5 - 2)
        const float scale = std::ldexp(1.0f, 2 * (int)(i / sh.K % 5) - 4);
        xv[i] = formats::encode_bf16_rn(formats::decode_bf16(xv[i]) * scale);
      }
      Tensor w = Tensor::empty({sh.K}, DType::kF32, Device::kCpu);
      std::mt19937 rng((uint32_t)seed);
      std::uniform_real_distribution<float> u(0.5f, 1.5f);
      for (int64_t i = 0; i < sh.K; ++i) w.ptr<float>()[i] = i % 7 == 3 ? -u(rng) : u(rng);
      const Tensor wd = w.to(Device::kCuda);
      Strided xd = strided(sh.B, sh.K, sh.K + sh.pad, DType::kBF16);
      FOURBIT_CUDA_CHECK(cudaMemcpy2D(xd.view.data, (size_t)(2 * (sh.K + sh.pad)), x.data(), (size_t)(2 * sh.K),
                                      (size_t)(2 * sh.K), (size_t)sh.B, cudaMemcpyHostToDevice));
      const float eps = 1e-5f;
      quant::QuantConfig cfg = nvfp4(rule & 1);
      cfg.nvfp4_row_amax = rule & 2;
      // Unfused: the norm's bf16 output, then the quantizer.
      Tensor y = Tensor::empty({sh.B, sh.K}, DType::kBF16, Device::kCuda);
      Tensor rstd = Tensor::empty({sh.B}, DType::kF32, Device::kCuda);
      const Tensor xc = x.to(Device::kCuda);  // the norm takes contiguous rows
      ops::rmsnorm_forward(y.view(), rstd.view(), xc.view(), wd.view(), eps, nullptr);
      QuantizeCall unfused(y.view(), cfg, sh.B, sh.K), fused(xd.view, cfg, sh.B, sh.K);
      fused.args.norm_weight = wd.view();
      fused.args.norm_eps = eps;
      unfused.run();
      fused.run();
      EXPECT_EQ(unfused.flag_host(), 0);
      EXPECT_EQ(fused.flag_host(), 0);
      const float amax_want = unfused.amax_host(), amax_got = fused.amax_host();
      const Tensor& xs_want = unfused.xs;
      const Tensor& xs_got = fused.xs;
      const std::string what = fmt::format("B {} K {} pad {} rule {}", sh.B, sh.K, sh.pad, rule);
      ASSERT_EQ(amax_got, amax_want) << what;
      ASSERT_GT(amax_want, 0.0f) << what;
      ASSERT_EQ(fused.amaxes(), unfused.amaxes()) << what;
      const Tensor want = xs_want.to(Device::kCpu), got = xs_got.to(Device::kCpu);
      for (int64_t i = 0; i < want.numel(); ++i)
        ASSERT_EQ(got.ptr<const uint16_t>()[i], want.ptr<const uint16_t>()[i]) << what << ": element " << i;
    }
  // A non-finite input of the norm is flagged, and shapes outside the fused path are refused.
  Tensor x = random_matrix(2, 256, 990, DType::kBF16);
  x.ptr<uint16_t>()[300] = 0x7FC0;  // NaN in row 1
  const Tensor xd = x.to(Device::kCuda);
  const Tensor wd = Tensor::zeros({256}, DType::kF32, Device::kCuda);
  QuantizeCall nan_call(xd.view(), nvfp4(), 2, 256);
  nan_call.args.norm_weight = wd.view();
  nan_call.run();
  EXPECT_EQ(nan_call.flag_host() & quant::kDeviceErrNonFinite, quant::kDeviceErrNonFinite);
  EXPECT_FALSE(decode_quantize_can_fuse_norm(16, 2048 + 8));
  EXPECT_TRUE(decode_quantize_can_fuse_norm(16, 2048 + 8, true));  // per row: each row alone
  EXPECT_FALSE(decode_quantize_can_fuse_norm(1, 1000 + 4));
  const Tensor big = random_matrix(16, 2048 + 8, 991, DType::kBF16).to(Device::kCuda);
  const Tensor wbig = Tensor::zeros({2048 + 8}, DType::kF32, Device::kCuda);
  QuantizeCall big_call(big.view(), nvfp4(), 16, 2048 + 8);
  big_call.args.norm_weight = wbig.view();
  big_call.args.name = "blocks.0.qkv";
  expect_error([&] { big_call.run(); }, {"blocks.0.qkv", "cannot fuse the RMSNorm"});
}

// The fused SwiGLU of the activation quantizer against ops::swiglu_forward followed by the unfused
// quantizer, bit for bit, on the one-launch (B K <= 16384) and the two-launch paths.
TEST(DecodeGemvCuda, FusedSwigluMatchesSwigluThenQuantize) {
  const std::pair<int, int64_t> shapes[] = {{1, 5632}, {2, 5632}, {16, 5632}, {64, 256}, {3, 36}, {64, 1000}};
  uint64_t seed = 950;
  for (auto [B, K] : shapes)
    for (int rule = 0; rule < 4; ++rule) {  // rule & 1: Four Over Six; rule & 2: per-row amax
      Tensor gu = random_matrix(B, 2 * K, seed++, DType::kBF16);
      uint16_t* g = gu.ptr<uint16_t>();
      for (int64_t i = 0; i < gu.numel(); ++i)  // gates over [-12, 12]: both tails of the sigmoid
        if (i % (2 * K) < K) g[i] = formats::encode_bf16_rn(formats::decode_bf16(g[i]) * 4.0f);
      const Tensor gud = gu.to(Device::kCuda);
      Tensor act = Tensor::empty({B, K}, DType::kBF16, Device::kCuda);
      ops::swiglu_forward(act.view(), gud.view(), nullptr);
      quant::QuantConfig cfg = nvfp4(rule & 1);
      cfg.nvfp4_row_amax = rule & 2;
      QuantizeCall unfused(act.view(), cfg, B, K), fused(gud.view(), cfg, B, K);
      fused.args.swiglu = true;
      unfused.run();
      fused.run();
      const float amax_want = unfused.amax_host(), amax_got = fused.amax_host();
      const Tensor& xs_want = unfused.xs;
      const Tensor& xs_got = fused.xs;
      const std::string what = fmt::format("B {} K {} rule {}", B, K, rule);
      ASSERT_EQ(amax_got, amax_want) << what;
      ASSERT_EQ(fused.amaxes(), unfused.amaxes()) << what;
      const Tensor want = xs_want.to(Device::kCpu), got = xs_got.to(Device::kCpu);
      for (int64_t i = 0; i < want.numel(); ++i)
        ASSERT_EQ(got.ptr<const uint16_t>()[i], want.ptr<const uint16_t>()[i]) << what << ": element " << i;
    }
}

// The SwiGLU output (DecodeGemvArgs::swiglu) against the same GEMV into a [B, 2H] buffer followed
// by ops::swiglu_forward: bit for bit. BF16 and NVFP4 weights, plain and NVFP4 activations (per
// tensor and per token), 1-16 tokens, single-split plans (K <= 256: one split), cluster plans, a
// plan of more splits than a cluster holds (K 20000 over 2 row blocks: the workspace path, the last
// CTA's sums), the 1.1B MLP's shape, a K that is not a multiple of 128 and a strided y. The gate
// rows are scaled x4 so that the gates reach both tails of the sigmoid.
TEST(DecodeGemvCuda, SwigluOutputEqualsTheGemvThenSwiglu) {
  struct Shape3 {
    int B;
    int64_t H, K;
  };
  const Shape3 shapes[] = {{1, 5632, 2048}, {1, 32, 1400}, {3, 96, 128}, {8, 8704, 200},
                           {9, 1408, 5632}, {16, 5632, 2048}, {2, 64, 20000}};
  uint64_t seed = 3100;
  for (const Shape3& sh : shapes)
    for (WKind wk : {WKind::kBf16, WKind::kNvfp4})
      for (int xmode = 0; xmode < 3; ++xmode) {  // plain, NVFP4 per tensor, NVFP4 per token
        const int B = sh.B;
        const int64_t H = sh.H, K = sh.K, N = 2 * H;
        const std::string what = fmt::format("B {} H {} K {} {} weights, x mode {}", B, H, K,
                                             wk == WKind::kBf16 ? "bf16" : "nvfp4", xmode);
        Tensor wsrc = random_matrix(N, K, seed++, DType::kBF16);
        for (int64_t i = 0; i < H * K; ++i)  // the gate rows, x4
          wsrc.ptr<uint16_t>()[i] = formats::encode_bf16_rn(formats::decode_bf16(wsrc.ptr<uint16_t>()[i]) * 4.0f);
        const DeviceWeights dw(wsrc, wk, "mlp_up");
        const DecodeWeights& w = dw.weights;
        // x: scaled so that the gates reach about +-12 (random_matrix's K-sums grow as sqrt(K)).
        Tensor xsrc = random_matrix(B, K, seed++, DType::kBF16);
        const float xs_scale = 3.0f / std::sqrt((float)K);
        for (int64_t i = 0; i < xsrc.numel(); ++i)
          xsrc.ptr<uint16_t>()[i] = formats::encode_bf16_rn(formats::decode_bf16(xsrc.ptr<uint16_t>()[i]) * xs_scale);
        const Tensor xd = xsrc.to(Device::kCuda);
        DecodeWorkspace ws;
        DecodeGemvArgs a = gemv_args(xd.view(), w, ws, "mlp_up");
        std::optional<QuantizeCall> q;
        if (xmode > 0) quantize_gemv_input(a, q, xd.view(), B, K, xmode == 2);
        // The GEMV, then the SwiGLU.
        Tensor gu = Tensor::empty({B, N}, DType::kBF16, Device::kCuda), want = Tensor::empty({B, H}, DType::kBF16, Device::kCuda);
        a.y = gu.view();
        decode_gemv(a);
        ops::swiglu_forward(want.view(), gu.view(), nullptr);
        // One launch (twice: the counters are reset), into a strided y.
        ASSERT_TRUE(decode_gemv_swiglu_supported(B, N)) << what;
        Strided got = strided(B, H, H + 24, DType::kBF16);
        a.y = got.view;
        a.swiglu = true;
        for (int rep = 0; rep < 2; ++rep) {
          poison(got.view);
          decode_gemv(a);
          FOURBIT_CUDA_CHECK(cudaDeviceSynchronize());
          const std::vector<uint8_t> w_bits = raw(want.view()), g_bits = raw(got.view);
          for (int64_t r = 0; r < B; ++r)
            for (int64_t c = 0; c < H; ++c) {
              uint16_t wv = 0, gv = 0;
              std::memcpy(&wv, w_bits.data() + 2 * (r * H + c), 2);
              std::memcpy(&gv, g_bits.data() + 2 * (r * (H + 24) + c), 2);
              ASSERT_EQ(gv, wv) << what << ", launch " << rep << ": [" << r << ", " << c << "]";
            }
        }
      }
}

// The RoPE output (DecodeGemvArgs::rope) against the same GEMV followed by
// ops::rope_forward_inplace_append: the qkv buffer and both KV caches bit for bit. The 1.1B Llama's
// heads (32 q, 4 kv of 64) and heads of 128 (two row blocks a head), BF16 and NVFP4 weights, plain
// and NVFP4 activations, one-split (K 200), cluster and workspace (K 20000) plans, 1-16 tokens in
// one or several sequences (rows_per_seq), tokens that append nothing (write_pos -1, past t_max),
// positions up to 60000 (coarse angles) and the output without caches (the rotation alone).
TEST(DecodeGemvCuda, RopeOutputEqualsTheGemvThenRope) {
  struct RopeCase {
    int B, rows_per_seq;
    int64_t H, Hkv, D, K;
    bool caches;
  };
  const RopeCase cases[] = {{1, 1, 32, 4, 64, 2048, true},   {3, 1, 32, 4, 64, 1400, true},
                            {8, 4, 32, 4, 64, 2048, true},   {16, 16, 4, 2, 128, 200, true},
                            {2, 1, 4, 2, 128, 20000, true},  {5, 1, 8, 8, 64, 512, false}};
  const float theta = 10000.0f;
  uint64_t seed = 3300;
  for (const RopeCase& rc : cases)
    for (WKind wk : {WKind::kBf16, WKind::kNvfp4})
      for (int xmode = 0; xmode < 2; ++xmode) {  // plain, NVFP4 per token
        const int B = rc.B;
        const int64_t D = rc.D, N = (rc.H + 2 * rc.Hkv) * D, K = rc.K, seqs = B / rc.rows_per_seq, t_max = 40;
        const std::string what = fmt::format("B {} ({} a sequence) H {} Hkv {} D {} K {} {} weights, x mode {}", B,
                                             rc.rows_per_seq, rc.H, rc.Hkv, D, K, wk == WKind::kBf16 ? "bf16" : "nvfp4",
                                             xmode);
        const Tensor wsrc = random_matrix(N, K, seed++, DType::kBF16);
        const DeviceWeights dw(wsrc, wk, "qkv");
        const DecodeWeights& w = dw.weights;
        const Tensor xd = random_matrix(B, K, seed++, DType::kBF16).to(Device::kCuda);
        // Positions, and write positions: one token past t_max, one not appended, the others at
        // distinct positions of their sequence (two tokens of a sequence never share a cache row).
        std::mt19937 rng((uint32_t)seed++);
        Tensor pos = Tensor::empty({B}, DType::kI32, Device::kCpu), wpos = Tensor::empty({B}, DType::kI32, Device::kCpu);
        std::vector<int32_t> slots((size_t)t_max);
        for (int b = 0; b < B; ++b) {
          if (b % rc.rows_per_seq == 0) {  // a new sequence: a fresh permutation of its positions
            for (int32_t i = 0; i < (int32_t)t_max; ++i) slots[(size_t)i] = i;
            std::shuffle(slots.begin(), slots.end(), rng);
          }
          pos.ptr<int32_t>()[b] = b % 3 == 1 ? (int32_t)(rng() % 60000) : (int32_t)(rng() % t_max);
          wpos.ptr<int32_t>()[b] = b == 1 ? -1 : b == 2 ? (int32_t)t_max : slots[(size_t)(b % rc.rows_per_seq)];
        }
        const Tensor pos_d = pos.to(Device::kCuda), wpos_d = wpos.to(Device::kCuda);
        Tensor table = Tensor::empty({B, D / 2, 2}, DType::kF32, Device::kCuda);
        ops::rope_cos_sin_table(table.view(), pos_d.view(), theta, D, nullptr);
        const Tensor cache0 = random_matrix(seqs * t_max, rc.Hkv * D, seed++, DType::kBF16);
        auto cache = [&] {
          Tensor t = cache0.to(Device::kCuda);
          TensorView v = t.view();
          return std::make_pair(t, v);
        };
        auto [kc_want, kv_want] = cache();
        auto [vc_want, vv_want] = cache();
        auto [kc_got, kv_got] = cache();
        auto [vc_got, vv_got] = cache();
        for (TensorView* v : {&kv_want, &vv_want, &kv_got, &vv_got}) {
          v->shape = Shape{seqs, t_max, rc.Hkv, D};
          v->strides = contiguous_strides(v->shape);
        }
        DecodeWorkspace ws;
        DecodeGemvArgs a = gemv_args(xd.view(), w, ws, "qkv");
        std::optional<QuantizeCall> q;
        if (xmode > 0) quantize_gemv_input(a, q, xd.view(), B, K, true);
        // The GEMV, then the RoPE kernel with the append.
        Tensor want = Tensor::empty({B, N}, DType::kBF16, Device::kCuda);
        a.y = want.view();
        decode_gemv(a);
        auto part = [&](const Tensor& qkv, int64_t col0, int64_t heads) {
          TensorView v = qkv.view();
          v.data = static_cast<uint16_t*>(v.data) + col0;
          v.shape = Shape{B, heads, D};
          v.strides = {N, D, 1};
          return v;
        };
        ops::RopeCacheAppend ap;
        ap.v = part(want, (rc.H + rc.Hkv) * D, rc.Hkv);
        ap.k_cache = kv_want;
        ap.v_cache = vv_want;
        ap.write_pos = wpos_d.view();
        ap.rows_per_seq = rc.rows_per_seq;
        if (rc.caches) {
          ops::rope_forward_inplace_append(part(want, 0, rc.H), part(want, rc.H * D, rc.Hkv), pos_d.view(), theta, ap,
                                           nullptr);
        } else {
          ops::rope_forward_inplace(part(want, 0, rc.H), part(want, rc.H * D, rc.Hkv), pos_d.view(), theta, nullptr);
        }
        // One launch (twice), the RoPE in its epilogue.
        ASSERT_TRUE(decode_gemv_rope_supported(B, D)) << what;
        DecodeRope r;
        r.q_heads = rc.H;
        r.kv_heads = rc.Hkv;
        r.head_dim = D;
        r.cos_sin = table.view();
        if (rc.caches) {
          r.k_cache = kv_got;
          r.v_cache = vv_got;
          r.write_pos = wpos_d.view();
          r.rows_per_seq = rc.rows_per_seq;
        }
        Tensor got = Tensor::empty({B, N}, DType::kBF16, Device::kCuda);
        a.y = got.view();
        a.rope = &r;
        for (int rep = 0; rep < 2; ++rep) {
          poison(got.view());
          decode_gemv(a);
          FOURBIT_CUDA_CHECK(cudaDeviceSynchronize());
          const std::pair<const char*, std::pair<TensorView, TensorView>> outs[] = {
              {"qkv", {want.view(), got.view()}}, {"k cache", {kc_want.view(), kc_got.view()}},
              {"v cache", {vc_want.view(), vc_got.view()}}};
          for (const auto& [name, tv] : outs) {
            const std::vector<uint8_t> wb = raw(tv.first), gb = raw(tv.second);
            ASSERT_EQ(wb.size(), gb.size());
            for (size_t j = 0; j < wb.size(); j += 2)
              ASSERT_TRUE(wb[j] == gb[j] && wb[j + 1] == gb[j + 1])
                  << what << ", launch " << rep << ": " << name << " differs at element " << j / 2;
          }
        }
      }
}

TEST(DecodeGemvCuda, SwigluOutputArgumentErrors) {
  const Tensor x = random_matrix(17, 64, 3200, DType::kBF16).to(Device::kCuda);
  const Tensor w = random_matrix(128, 64, 3201, DType::kBF16).to(Device::kCuda);
  const Tensor w_odd = random_matrix(96, 64, 3202, DType::kBF16).to(Device::kCuda);
  const Tensor y = Tensor::zeros({17, 64}, DType::kBF16, Device::kCuda), y32 = Tensor::zeros({4, 64}, DType::kF32, Device::kCuda);
  DecodeWorkspace ws;
  DecodeGemvArgs a = gemv_args(x.view(), DecodeWeights::plain(w.view(), "mlp.up"), ws, "decode mlp.up");
  a.y = y.view();
  a.swiglu = true;
  expect_error([&] { decode_gemv(a); }, {"decode mlp.up", "SwiGLU output", "1 to 16 tokens", "17 tokens"});
  TensorView x4 = x.view(), y4 = y.view();
  x4.shape = Shape{4, 64};
  y4.shape = Shape{4, 64};
  a.x = x4;
  a.w = DecodeWeights::plain(w_odd.view(), "mlp.up");
  a.y = y4;
  expect_error([&] { decode_gemv(a); }, {"decode mlp.up", "multiple of 32"});
  a.w = DecodeWeights::plain(w.view(), "mlp.up");
  a.y = y32.view();
  expect_error([&] { decode_gemv(a); }, {"decode mlp.up", "bf16 [4, 64]"});
  TensorView y4w = y.view();
  y4w.shape = Shape{4, 128};
  a.y = y4w;
  expect_error([&] { decode_gemv(a); }, {"decode mlp.up", "bf16 [4, 64]"});
  a.y = y4;
  a.residual = y4;
  expect_error([&] { decode_gemv(a); }, {"decode mlp.up", "no residual"});
}

TEST(DecodeGemvCuda, NonFiniteActivationIsFlagged) {
  // One-launch path (B K <= 16384) and the two-launch path.
  for (auto [B, K] : {std::pair<int, int64_t>{2, 64}, {64, 2048}}) {
    Tensor x = random_matrix(B, K, 600 + K, DType::kBF16);
    x.ptr<uint16_t>()[K + 6] = 0x7F80;  // +Inf in row 1
    const Tensor xd = x.to(Device::kCuda);
    Tensor xs = Tensor::empty({B, K}, DType::kBF16, Device::kCuda), amax = Tensor::empty({1}, DType::kF32, Device::kCuda);
    Tensor flag = Tensor::zeros({1}, DType::kI32, Device::kCuda);
    DecodeWorkspace ws;
    DecodeQuantizeArgs qa;
    qa.x = xd.view();
    qa.config = nvfp4();
    qa.xs = xs.view();
    qa.amax = amax.ptr<float>();
    qa.workspace = &ws;
    qa.error_flag = flag.ptr<int>();
    decode_quantize_nvfp4(qa);
    int bits = 0;
    FOURBIT_CUDA_CHECK(cudaMemcpy(&bits, flag.data(), 4, cudaMemcpyDeviceToHost));
    EXPECT_EQ(bits & quant::kDeviceErrNonFinite, quant::kDeviceErrNonFinite) << "B " << B << " K " << K;
  }
}

TEST(DecodeGemvCuda, ArgumentErrors) {
  const Tensor x = random_matrix(65, 64, 700, DType::kBF16).to(Device::kCuda);
  const Tensor w = random_matrix(32, 64, 701, DType::kBF16).to(Device::kCuda);
  const Tensor y = Tensor::zeros({65, 32}, DType::kF32, Device::kCuda);
  DecodeWorkspace ws;
  DecodeGemvArgs a;
  a.x = x.view();
  a.w = DecodeWeights::plain(w.view(), "mlp.down");
  a.y = y.view();
  a.workspace = &ws;
  a.name = "decode mlp.down";
  expect_error([&] { decode_gemv(a); }, {"decode mlp.down", "65 rows", "1 to 64"});
  TensorView x8 = x.view();
  x8.shape = Shape{8, 64};
  a.x = x8;
  expect_error([&] { decode_gemv(a); }, {"decode mlp.down", "[8, 32]"});
  const Tensor w2 = random_matrix(32, 48, 702, DType::kBF16).to(Device::kCuda);
  a.w = DecodeWeights::plain(w2.view(), "mlp.down");
  expect_error([&] { decode_gemv(a); }, {"mlp.down", "K = 48"});
  a.w = DecodeWeights::plain(w.view(), "mlp.down");
  a.workspace = nullptr;
  TensorView y8 = y.view();
  y8.shape = Shape{8, 32};
  a.y = y8;
  expect_error([&] { decode_gemv(a); }, {"DecodeWorkspace"});
}

// The decode chain (decode_gemv_chain) against its links run one by one, as a transformer block's
// decode step would run them: attn_out (+ residual), RMSNorm -> mlp_up, SwiGLU -> mlp_down
// (+ residual), RMSNorm -> the next qkv, each through ops::rmsnorm_forward / ops::swiglu_forward and
// decode_gemv. Bit for bit: the chain takes each GEMV's standalone plan and sums its splits in the
// same order (through the workspace where the standalone launch uses a cluster). BF16 and NVFP4
// weights, B = 1, 3, 8, a K that is not a multiple of 128 (1400: NVFP4 rows of 700 bytes, no 16-byte
// vectors), split-K plans of clusters and of the workspace path. Outputs are poisoned first and
// every chain runs three times (the grid barrier and the counters must be reset) with different
// weight streams (DecodeChainOptions): the default, whole items prefetched into L2, and the ring
// per item without prefetch.
TEST(DecodeGemvCuda, ChainEqualsTheLinksOneByOne) {
  const int64_t D = 1024, F = 1400, Q = 1536;
  const float eps = 1e-5f;
  for (WKind wk : {WKind::kBf16, WKind::kNvfp4})
    for (int B : {1, 3, 8}) {
      const std::string what = fmt::format("{} weights, B {}", wk == WKind::kBf16 ? "bf16" : "nvfp4", B);
      uint64_t seed = 1200 + 10 * (uint64_t)B + (wk == WKind::kNvfp4 ? 5 : 0);
      // attn_out [D, D], mlp_up [2F, D], mlp_down [D, F], qkv [Q, D]
      const int64_t shapes[4][2] = {{D, D}, {2 * F, D}, {D, F}, {Q, D}};
      const char* names[4] = {"attn_out", "mlp_up", "mlp_down", "qkv"};
      std::vector<Tensor> w_bf16;
      std::vector<quant::QuantizedTensor> w_q;
      w_bf16.reserve(4);
      w_q.reserve(4);
      std::vector<DecodeWeights> w;
      for (int i = 0; i < 4; ++i) {
        const Tensor src = random_matrix(shapes[i][0], shapes[i][1], seed++, DType::kBF16);
        if (wk == WKind::kBf16) {
          w_bf16.push_back(src.to(Device::kCuda));
          w.push_back(DecodeWeights::plain(w_bf16.back().view(), names[i]));
        } else {
          w_q.push_back(to_device(quantize(src, nvfp4())));
          w.push_back(DecodeWeights::packed(w_q.back(), names[i]));
        }
      }
      auto norm_weight = [&](uint64_t s) {
        Tensor t = Tensor::empty({D}, DType::kF32, Device::kCpu);
        std::mt19937 rng((uint32_t)s);
        std::uniform_real_distribution<float> u(0.5f, 1.5f);
        for (int64_t i = 0; i < D; ++i) t.ptr<float>()[i] = i % 5 == 2 ? -u(rng) : u(rng);
        return t.to(Device::kCuda);
      };
      const Tensor n_mlp = norm_weight(seed++), n_qkv = norm_weight(seed++);
      const Tensor attn = random_matrix(B, D, seed++, DType::kBF16).to(Device::kCuda);
      const Tensor resid = random_matrix(B, D, seed++, DType::kBF16).to(Device::kCuda);
      auto bf16 = [&](int64_t cols) { return Tensor::empty({B, cols}, DType::kBF16, Device::kCuda); };
      DecodeWorkspace ws;
      auto gemv = [&](const TensorView& x, const DecodeWeights& wt, const TensorView& y, const TensorView& r) {
        DecodeGemvArgs a;
        a.x = x;
        a.w = wt;
        a.y = y;
        a.residual = r;
        a.workspace = &ws;
        a.name = wt.name;
        return a;
      };
      // One by one.
      Tensor mid = bf16(D), ln2 = bf16(D), gu = bf16(2 * F), act = bf16(F), out = bf16(D), ln1 = bf16(D),
             qkv = bf16(Q);
      const Tensor rstd = Tensor::empty({B}, DType::kF32, Device::kCuda);
      decode_gemv(gemv(attn.view(), w[0], mid.view(), resid.view()));
      ops::rmsnorm_forward(ln2.view(), rstd.view(), mid.view(), n_mlp.view(), eps, nullptr);
      decode_gemv(gemv(ln2.view(), w[1], gu.view(), {}));
      ops::swiglu_forward(act.view(), gu.view(), nullptr);
      decode_gemv(gemv(act.view(), w[2], out.view(), mid.view()));
      ops::rmsnorm_forward(ln1.view(), rstd.view(), out.view(), n_qkv.view(), eps, nullptr);
      decode_gemv(gemv(ln1.view(), w[3], qkv.view(), {}));
      // The chain, twice.
      Tensor c_mid = bf16(D), c_gu = bf16(2 * F), c_out = bf16(D), c_qkv = bf16(Q);
      std::vector<DecodeChainLink> links(4);
      links[0].gemv = gemv(attn.view(), w[0], c_mid.view(), resid.view());
      links[1].gemv = gemv(c_mid.view(), w[1], c_gu.view(), {});
      links[1].producer = DecodeProducer::kRmsnorm;
      links[1].norm_weight = n_mlp.view();
      links[1].norm_eps = eps;
      links[2].gemv = gemv(c_gu.view(), w[2], c_out.view(), c_mid.view());
      links[2].producer = DecodeProducer::kSwiglu;
      links[3].gemv = gemv(c_out.view(), w[3], c_qkv.view(), {});
      links[3].producer = DecodeProducer::kRmsnorm;
      links[3].norm_weight = n_qkv.view();
      links[3].norm_eps = eps;
      std::string why;
      ASSERT_TRUE(decode_chain_supported(links, &why)) << what << ": " << why;
      // Round 0: the default weight stream; round 1: whole items prefetched; round 2: no L2
      // prefetch, the ring per item.
      for (int round = 0; round < 3; ++round) {
        DecodeChainOptions options;
        if (round == 1) options.prefetch_chunks = 1024;
        if (round == 2) {
          options.prefetch_chunks = 0;
          options.ring_per_item = true;
        }
        for (const Tensor* t : {&c_mid, &c_gu, &c_out, &c_qkv}) poison(t->view());
        decode_gemv_chain(links, ws, nullptr, options);
        FOURBIT_CUDA_CHECK(cudaDeviceSynchronize());
        const std::pair<const Tensor*, const Tensor*> pairs[] = {{&mid, &c_mid}, {&gu, &c_gu}, {&out, &c_out},
                                                                 {&qkv, &c_qkv}};
        for (int i = 0; i < 4; ++i) {
          const std::vector<uint8_t> want = raw(pairs[i].first->view()), got = raw(pairs[i].second->view());
          ASSERT_EQ(want.size(), got.size());
          size_t first_diff = want.size();
          for (size_t j = 0; j < want.size() && first_diff == want.size(); ++j)
            if (want[j] != got[j]) first_diff = j;
          EXPECT_EQ(first_diff, want.size()) << what << ", round " << round << ": link " << names[i]
                                             << " differs from the one-by-one result at byte " << first_diff;
        }
      }
    }
}

TEST(DecodeGemvCuda, ChainArgumentErrors) {
  const Tensor x = random_matrix(9, 64, 710, DType::kBF16).to(Device::kCuda);
  const Tensor w = random_matrix(32, 64, 711, DType::kBF16).to(Device::kCuda);
  const Tensor y = Tensor::zeros({9, 32}, DType::kBF16, Device::kCuda);
  const quant::QuantizedTensor wq = to_device(quantize(random_matrix(32, 64, 712, DType::kBF16), nvfp4()));
  DecodeWorkspace ws;
  std::vector<DecodeChainLink> links(2);
  for (DecodeChainLink& l : links) {
    l.gemv.x = x.view();
    l.gemv.w = DecodeWeights::plain(w.view(), "blocks.0.attn_out");
    l.gemv.y = y.view();
  }
  links[1].gemv.name = "blocks.0.mlp_up";
  expect_error([&] { decode_gemv_chain(links, ws, nullptr); }, {"decode_gemv_chain", "1 to 8 tokens"});
  TensorView x8 = x.view(), y8 = y.view();
  x8.shape = Shape{8, 64};
  y8.shape = Shape{8, 32};
  for (DecodeChainLink& l : links) {
    l.gemv.x = x8;
    l.gemv.y = y8;
  }
  links[1].gemv.w = DecodeWeights::packed(wq, "blocks.0.mlp_up");
  expect_error([&] { decode_gemv_chain(links, ws, nullptr); }, {"blocks.0.mlp_up", "weight format"});
  links[1].gemv.w = DecodeWeights::plain(w.view(), "blocks.0.mlp_up");
  const float amax = 1.0f;
  links[1].gemv.x_nvfp4_amax = &amax;
  expect_error([&] { decode_gemv_chain(links, ws, nullptr); }, {"blocks.0.mlp_up", "NVFP4 activations"});
  links[1].gemv.x_nvfp4_amax = nullptr;
  links[1].producer = DecodeProducer::kRmsnorm;  // without its weight
  expect_error([&] { decode_gemv_chain(links, ws, nullptr); }, {"blocks.0.mlp_up", "RMSNorm weight"});
  links.resize(9, links[0]);
  expect_error([&] { decode_gemv_chain(links, ws, nullptr); }, {"9 links", "1 to 8"});
}

}  // namespace
}  // namespace fourbit::gemm
