// gemm (gpu): every CUDA backend against the float64 CPU reference over the very same quantized
// operands (quantized on the CPU, copied to the GPU), within the accumulation bound of
// gemm_test_util.h: BF16, FP8 per-tensor and block-scaled (1x128 x 128x128, 1x128 x 1x128,
// 128x128 x 1x128), the NVFP4 / MXFP8 emulation (with and without the producer's scaled-domain
// copy, the RHT Wgrad pair, NVFP4 x BF16), odd shapes (passed, or rejected with a clear error),
// alpha / beta / accumulate, f32 and bf16 outputs written inside guard regions, grouped GEMMs with
// uneven and empty groups, the conversion kernels against their CPU references, MXFP8 inexact
// scales, and the linear layer on the GPU against the linear layer on the CPU.
#include "core/device.h"
#include "gemm/fp8_scale_layout.h"
#include "gemm/fp8_wgmma_kernels.h"
#include "gemm/gemm_kernels.h"
#include "gemm/linear.h"
#include "gemm_test_util.h"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <numeric>

namespace fourbit::gemm {
namespace {

using testing::expect_error;
using testing::fp32_accumulation_tolerance;
using testing::kFp8AccumulationTolerance;
using testing::logical_values;
using testing::magnitude_sums;
using testing::random_matrix;
using testing::to_doubles;
using testing::within_bound;

quant::QuantConfig config(quant::Format f, bool two_d = false, bool rht = false) {
  quant::QuantConfig c;
  c.format = f;
  c.block_2d = two_d;
  c.rht = rht;
  return c;
}

quant::QuantConfig row_amax(quant::QuantConfig c) {
  c.nvfp4_row_amax = true;
  return c;
}

// One operand on the host and its copy on the device (both kept alive by this object).
struct TestOperand {
  std::string name;
  Tensor plain;  // host
  bool transposed = false;
  std::shared_ptr<quant::QuantizedTensor> q;  // host bundle
  Copy copy = Copy::kRowwise;
  bool give_scaled_bf16 = false;

  Tensor d_plain;
  quant::QuantizedTensor d_q;
  Tensor d_scaled;

  Operand host() const {
    return q ? Operand::quant(*q, copy, name) : Operand::dense(plain.view(), name, transposed);
  }
  Operand device() {
    if (!q) {
      if (!d_plain.defined()) d_plain = plain.to(Device::kCuda);
      return Operand::dense(d_plain.view(), name, transposed);
    }
    if (d_q.device != Device::kCuda) {
      d_q = *q;
      d_q.device = Device::kCuda;
      for (std::optional<quant::QuantizedData>* d : {&d_q.rowwise, &d_q.colwise}) {
        if (!d->has_value()) continue;
        for (Tensor* t : {&(*d)->data, &(*d)->scales, &(*d)->amax})
          if (t->defined()) *t = t->to(Device::kCuda);
      }
      if (give_scaled_bf16) {
        d_scaled = quant::dequantize_bf16_scaled_reference(*q, copy == Copy::kColwise).to(Device::kCuda);
      }
    }
    return Operand::quant(d_q, copy, name, d_scaled.view());
  }
};

TestOperand plain_op(const std::string& name, int64_t rows, int64_t k, uint64_t seed, bool transposed = false) {
  TestOperand o;
  o.name = name;
  o.plain = transposed ? random_matrix(k, rows, seed, DType::kBF16) : random_matrix(rows, k, seed, DType::kBF16);
  o.transposed = transposed;
  return o;
}

// A quantized operand [rows, K]: the source is [rows, K] for the row-wise copy, [K, rows] for the
// column-wise copy (whose stored matrix is the transpose).
TestOperand quant_op(const std::string& name, int64_t rows, int64_t k, uint64_t seed, quant::QuantConfig cfg,
                     Copy copy = Copy::kRowwise, bool give_scaled_bf16 = false) {
  TestOperand o;
  o.name = name;
  const bool colwise = copy == Copy::kColwise;
  const Tensor src = colwise ? random_matrix(k, rows, seed) : random_matrix(rows, k, seed);
  o.q = std::make_shared<quant::QuantizedTensor>(
      quant::quantize_reference(src.view(), cfg, {!colwise, colwise}, {name, {seed, 9}}));
  o.copy = copy;
  o.give_scaled_bf16 = give_scaled_bf16;
  return o;
}

constexpr uint8_t kPoison = 0xFF;  // NaN in f32 and bf16

// C [M, N] inside a poisoned buffer with a guard row above and below and guard columns on the
// right (row stride ld = roundup(N, 8) + 8).
struct GuardedOutput {
  Tensor buffer;
  TensorView view;
  int64_t m, n, ld;
  GuardedOutput(int64_t m_, int64_t n_, DType dtype) : m(m_), n(n_), ld((n_ + 7) / 8 * 8 + 8) {
    buffer = Tensor::empty({m + 2, ld}, dtype, Device::kCuda);
    fill_bytes(buffer.view(), kPoison);
    view = TensorView::contiguous(static_cast<char*>(buffer.data()) + dtype_bytes(dtype, ld), dtype, {m, n}, Device::kCuda);
    view.strides = Shape{ld, 1};
  }
  void set(const Tensor& host_values) {  // host [m, n] -> the view
    const Tensor h = buffer.to(Device::kCpu);
    const int64_t es = dtype_bytes(h.dtype(), 1);
    for (int64_t i = 0; i < m; ++i)
      std::memcpy(static_cast<char*>(h.data()) + ((i + 1) * ld) * es, static_cast<const char*>(host_values.data()) + i * n * es, n * es);
    copy_tensor(buffer.view(), h.view());
  }
  // The values of C and the number of guard bytes that changed.
  std::pair<Tensor, int64_t> read() const {
    const Tensor h = buffer.to(Device::kCpu);
    const int64_t es = dtype_bytes(h.dtype(), 1);
    Tensor c = Tensor::empty({m, n}, h.dtype(), Device::kCpu);
    int64_t damaged = 0;
    const auto* bytes = static_cast<const uint8_t*>(h.data());
    for (int64_t r = 0; r < m + 2; ++r)
      for (int64_t col = 0; col < ld; ++col) {
        const bool inside = r >= 1 && r <= m && col < n;
        if (inside) continue;
        for (int64_t b = 0; b < es; ++b) damaged += bytes[(r * ld + col) * es + b] != kPoison;
      }
    for (int64_t i = 0; i < m; ++i) std::memcpy(static_cast<char*>(c.data()) + i * n * es, bytes + ((i + 1) * ld) * es, n * es);
    return {c, damaged};
  }
};

struct GemmCase {
  float alpha = 1.0f, beta = 0.0f;
  DType c_dtype = DType::kF32;
  double tol = 0;  // 0: the FP32 accumulation bound for K
  Backend expected = Backend::kAuto;
  bool separate_source = false;  // the beta term reads GemmArgs::c_source (C starts poisoned)
  Backend backend = Backend::kAuto;  // GemmArgs::backend of the GPU run
};

// Runs A . B^T on the GPU and on the CPU reference and checks the bound, the guards and the
// backend selection.
void check_gemm(TestOperand& a, TestOperand& b, const GemmCase& gc, const std::string& what) {
  SCOPED_TRACE(what);
  const int64_t m = a.host().rows(), n = b.host().rows(), k = a.host().k();
  const Tensor c0 = random_matrix(m, n, 99, gc.c_dtype);
  Tensor c_ref = Tensor::empty({m, n}, gc.c_dtype, Device::kCpu);
  copy_tensor(c_ref.view(), c0.view());
  GemmArgs ref;
  ref.a = a.host();
  ref.b = b.host();
  ref.c = c_ref.view();
  ref.alpha = gc.alpha;
  ref.beta = gc.beta;
  ref.backend = Backend::kCpuReference;
  gemm(ref);

  GuardedOutput out(m, n, gc.c_dtype), source(m, n, gc.c_dtype);
  if (gc.beta != 0.0f) (gc.separate_source ? source : out).set(c0);
  GemmArgs args;
  args.a = a.device();
  args.b = b.device();
  args.c = out.view;
  args.alpha = gc.alpha;
  args.beta = gc.beta;
  if (gc.separate_source) args.c_source = source.view;
  args.name = "gpu test gemm";
  args.backend = gc.backend;
  if (gc.expected != Backend::kAuto) {
    EXPECT_EQ(select_backend(args), gc.expected) << backend_name(select_backend(args));
  }
  gemm(args);
  device_synchronize();
  const auto [c, damaged] = out.read();
  EXPECT_EQ(damaged, 0) << "the GEMM wrote outside C";
  if (gc.separate_source) {
    const auto [src_after, src_damaged] = source.read();
    EXPECT_EQ(src_damaged, 0) << "the GEMM wrote outside c_source";
    EXPECT_EQ(std::memcmp(src_after.data(), c0.data(), (size_t)(m * n * dtype_bytes(gc.c_dtype, 1))), 0)
        << "the GEMM changed c_source";
  }
  const std::vector<double> s = magnitude_sums(ref.a, ref.b, gc.alpha, gc.beta, to_doubles(c0));
  EXPECT_TRUE(within_bound(to_doubles(c), to_doubles(c_ref), s, gc.tol > 0 ? gc.tol : fp32_accumulation_tolerance(k),
                           gc.c_dtype, n, what));
}


// gc run on backend b, forced, and select_backend expected to report it.
GemmCase forced_to(Backend b, GemmCase gc) {
  gc.backend = gc.expected = b;
  return gc;
}

// The GPU is Hopper (sm_90): the wgmma kernels run there only.
bool on_sm90() {
  const DeviceProperties props = current_device_properties();
  return props.sm_major == 9 && props.sm_minor == 0;
}

std::vector<GemmCase> epilogue_variants(Backend expected, double tol, Backend forced = Backend::kAuto) {
  std::vector<GemmCase> v = {{1.0f, 0.0f, DType::kF32, tol, expected}, {0.5f, 1.0f, DType::kF32, tol, expected},
                             {1.0f, 0.0f, DType::kBF16, tol, expected}, {-2.0f, 1.0f, DType::kBF16, tol, expected},
                             {1.0f, 1.0f, DType::kBF16, tol, expected, true}, {0.5f, 1.0f, DType::kF32, tol, expected, true}};
  for (GemmCase& c : v) c.backend = forced;
  return v;
}

class GemmCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_GT(cuda_device_count(), 0) << "the gpu tests need a CUDA GPU (run them with tools/gpu-test.sh)";
  }
};

TEST_F(GemmCuda, Bf16AllLayoutsShapesAndEpilogues) {
  struct S { int64_t m, n, k; };
  for (const S& s : {S{128, 256, 384}, S{37, 29, 45}, S{64, 8, 1000}, S{1, 1, 1}}) {
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        TestOperand a = plain_op("a", s.m, s.k, 1, ta), b = plain_op("b", s.n, s.k, 2, tb);
        for (const GemmCase& gc : epilogue_variants(Backend::kCublasBf16, 0)) {
          check_gemm(a, b, gc, ::testing::PrintToString(std::vector<int64_t>{s.m, s.n, s.k}) +
                                   (ta ? " A^T" : "") + (tb ? " B^T" : "") + " alpha " +
                                   std::to_string(gc.alpha) + " beta " + std::to_string(gc.beta) +
                                   (gc.separate_source ? " (c_source)" : "") + " " +
                                   std::string(dtype_name(gc.c_dtype)));
        }
      }
  }
}

TEST_F(GemmCuda, Fp8PerTensor) {
  const quant::QuantConfig t = config(quant::Format::kFp8Tensor);
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{64, 96, 128}, {256, 128, 1024}, {40, 24, 48}}) {
    TestOperand a = quant_op("x", m, k, 3, t), b = quant_op("w", n, k, 4, t);
    for (const GemmCase& gc : epilogue_variants(Backend::kCublasFp8, kFp8AccumulationTolerance)) {
      check_gemm(a, b, gc, "fp8 tensor " + std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k));
    }
  }
  // K not a multiple of 16: rejected, naming the operand and the fix.
  TestOperand a = quant_op("x", 32, 40, 5, t), b = quant_op("w", 32, 40, 6, t);
  expect_error([&] { check_gemm(a, b, {}, "fp8 K = 40"); }, {"multiples of 16", "x", "pad K"});
}

TEST_F(GemmCuda, Fp8BlockScaled) {
  const quant::QuantConfig one_d = config(quant::Format::kFp8Block), two_d = config(quant::Format::kFp8Block, true);
  struct S { int64_t m, n, k; };
  struct P { const char* name; quant::QuantConfig a, b; };
  for (const P& p : {P{"1x128 x 128x128", one_d, two_d}, P{"1x128 x 1x128", one_d, one_d}, P{"128x128 x 1x128", two_d, one_d}}) {
    // auto picks the configured kernel for a 1x128 A (fp8_block_backend), else cuBLASLt.
    const Backend expected = !p.a.block_2d ? fp8_block_backend(p.b.block_2d) : Backend::kCublasFp8;
    for (const S& s : {S{256, 384, 640}, S{128, 128, 576}, S{300, 200, 256}}) {
      TestOperand a = quant_op("x", s.m, s.k, 7, p.a), b = quant_op("w", s.n, s.k, 8, p.b);
      for (const GemmCase& gc : epilogue_variants(expected, kFp8AccumulationTolerance)) {
        check_gemm(a, b, gc, std::string("fp8 ") + p.name + " " + std::to_string(s.m) + "x" +
                                 std::to_string(s.n) + "x" + std::to_string(s.k));
      }
    }
  }
  // Rows not a multiple of 4, and 2D x 2D: rejected with what to do.
  TestOperand a = quant_op("x", 37, 256, 9, one_d), b = quant_op("w", 64, 256, 10, two_d);
  expect_error([&] { check_gemm(a, b, {}, "fp8 block M = 37"); }, {"multiple of 4", "x"});
  TestOperand a2 = quant_op("x", 128, 256, 11, two_d);
  expect_error([&] { check_gemm(a2, b, {}, "fp8 2d x 2d"); }, {"128x128 x 128x128", "1x128"});
}

// fourbit's FP8 block kernel (Backend::kWgmmaFp8), forced, with a 1x128 A and a 1x128 or 128x128
// B: shapes with row, column and K tails (zero-filled by TMA), tiles of 256 columns (the default
// for N > 128) and of 128 (double-buffered partial sums: one, odd and even numbers of K blocks),
// more K blocks than pipeline stages, several CTAs, every epilogue; each
// without and with 2-CTA clusters sharing B by multicast (odd row-tile counts leave a cluster's
// second CTA wholly beyond M) and with a grid small enough that every CTA walks several tiles
// (the persistent loop's stage and phase counting across tiles); the Wgrad orientation
// (column-wise copies) and Dgrad's (B = W column-wise, 128x128); a scale block of zeros and an
// outlier row.
TEST_F(GemmCuda, Fp8WgmmaBlockKernelMatchesTheReference) {
  if (!on_sm90()) GTEST_SKIP() << "wgmma-fp8-block runs on sm_90 only";
  const quant::QuantConfig one_d = config(quant::Format::kFp8Block), two_d = config(quant::Format::kFp8Block, true);
  struct S { int64_t m, n, k; };
  struct ResetShape {
    ~ResetShape() { kernels::set_fp8_block_gemm_shape({}); }
  } reset_shape;
  const std::vector<S> shapes = {S{256, 384, 640}, S{128, 128, 576}, S{300, 200, 256}, S{40, 24, 48},
                                 S{520, 1000, 2176}, S{384, 128, 1664}, S{64, 132, 256}};
  // The clustered and 128-column variants: the same kinds of shape without the large one (the
  // float64 reference is most of the test's time); 384x1000 has a column tail and an odd number
  // of row tiles.
  const std::vector<S> shapes_small = {S{256, 384, 640}, S{128, 128, 576}, S{300, 200, 256}, S{384, 1000, 640},
                                       S{40, 24, 48}, S{64, 132, 256}};
  // (columns, cluster, grid): the default tile width and 128; the default persistent grid (at
  // least as many CTAs as these shapes have tiles on an H100/H200), and one of 3 or 4 CTAs, each
  // then walking several tiles.
  struct Grid { int block_n, cluster, ctas; };
  const Grid grids[] = {{0, 1, 0}, {0, 1, 3}, {0, 2, 0}, {0, 2, 4}, {128, 1, 0}, {128, 2, 4}};
  for (const auto& [block_n, cluster, ctas] : grids) {
    for (const quant::QuantConfig& bcfg : {one_d, two_d}) {
      kernels::set_fp8_block_gemm_shape({block_n, cluster, ctas});
      const std::string pair = std::string(bcfg.block_2d ? "1x128 x 128x128 " : "1x128 x 1x128 ") + "(" +
                               (block_n > 0 ? std::to_string(block_n) + " columns, " : "") + "cluster " +
                               std::to_string(cluster) + ", " +
                               (ctas > 0 ? std::to_string(ctas) + " CTAs" : "full grid") + ") ";
      for (const S& s : block_n == 0 && cluster == 1 ? shapes : shapes_small) {
        const std::string shape = std::to_string(s.m) + "x" + std::to_string(s.n) + "x" + std::to_string(s.k);
        TestOperand a = quant_op("x", s.m, s.k, 7, one_d), b = quant_op("w", s.n, s.k, 8, bcfg);
        for (const GemmCase& gc : epilogue_variants(Backend::kWgmmaFp8, kFp8AccumulationTolerance, Backend::kWgmmaFp8)) {
          check_gemm(a, b, gc, "wgmma fp8 " + pair + shape);
        }
        TestOperand dy = quant_op("dy", s.m, s.k, 9, one_d, Copy::kColwise), x = quant_op("x", s.n, s.k, 10, bcfg, Copy::kColwise);
        check_gemm(dy, x, forced_to(Backend::kWgmmaFp8, {1.0f, 1.0f, DType::kF32, kFp8AccumulationTolerance}),
                   "wgmma fp8 " + pair + "(column-wise copies) " + shape);
      }
    }
  }
  {  // A source with an all-zero scale block and one row a million times larger than the rest.
    Tensor src = random_matrix(256, 384, 11);
    for (int64_t c = 0; c < 128; ++c) src.ptr<float>()[5 * 384 + 128 + c] = 0.0f;
    for (int64_t c = 0; c < 384; ++c) src.ptr<float>()[77 * 384 + c] *= 1e6f;
    TestOperand a;
    a.name = "x with zeros and an outlier";
    a.q = std::make_shared<quant::QuantizedTensor>(quant::quantize_reference(src.view(), one_d, {true, false}, {a.name}));
    TestOperand b = quant_op("w", 192, 384, 12, one_d);
    check_gemm(a, b, forced_to(Backend::kWgmmaFp8, {1.0f, 0.0f, DType::kF32, kFp8AccumulationTolerance}),
               "wgmma fp8 zeros and outlier");
  }
  // Refusals: a 128x128 A, rows not a multiple of 4.
  TestOperand a2 = quant_op("x2", 128, 256, 13, two_d), w = quant_op("w", 64, 256, 14, one_d);
  const GemmCase forced = forced_to(Backend::kWgmmaFp8, {});
  expect_error([&] { check_gemm(a2, w, forced, "wgmma 128x128 x 1x128"); }, {"wgmma-fp8-block", "1x128", "x2"});
  TestOperand a37 = quant_op("x", 37, 256, 15, one_d), b = quant_op("w", 64, 256, 16, one_d);
  expect_error([&] { check_gemm(a37, b, forced, "wgmma M = 37"); }, {"multiple of 4", "x"});
}

TEST_F(GemmCuda, EmulatedNvfp4AndMxfp8) {
  const quant::QuantConfig nv = config(quant::Format::kNvfp4), nv2d = config(quant::Format::kNvfp4, true);
  const quant::QuantConfig mx = config(quant::Format::kMxfp8);
  struct S { int64_t m, n, k; };
  for (const S& s : {S{128, 256, 512}, S{37, 29, 45}, S{64, 48, 2048}}) {
    const std::string shape = " " + std::to_string(s.m) + "x" + std::to_string(s.n) + "x" + std::to_string(s.k);
    for (bool scaled : {false, true}) {
      const std::string how = scaled ? " (producer's bf16)" : " (packed)";
      TestOperand a = quant_op("x", s.m, s.k, 12, nv, Copy::kRowwise, scaled);
      TestOperand b = quant_op("w", s.n, s.k, 13, nv2d, Copy::kRowwise, scaled);
      for (const GemmCase& gc : epilogue_variants(Backend::kEmulated, 0)) check_gemm(a, b, gc, "nvfp4 1x16 x 16x16" + shape + how);
      TestOperand ma = quant_op("x", s.m, s.k, 14, mx, Copy::kRowwise, scaled);
      TestOperand mb = quant_op("w", s.n, s.k, 15, mx, Copy::kRowwise, scaled);
      for (const GemmCase& gc : epilogue_variants(Backend::kEmulated, 0)) check_gemm(ma, mb, gc, "mxfp8" + shape + how);
    }
    TestOperand a = quant_op("x", s.m, s.k, 16, nv), b = plain_op("w bf16", s.n, s.k, 17, true);
    check_gemm(a, b, {1.0f, 0.0f, DType::kBF16, 0, Backend::kEmulated}, "nvfp4 x bf16" + shape);
    // Per-row (per-token) amaxes on A: raw FP32 sums, then the row-scaled epilogue.
    quant::QuantConfig nv_rows = nv;
    nv_rows.nvfp4_row_amax = true;
    for (bool scaled : {false, true}) {
      TestOperand ra = quant_op("x", s.m, s.k, 40, nv_rows, Copy::kRowwise, scaled);
      TestOperand rb = quant_op("w", s.n, s.k, 41, nv2d, Copy::kRowwise, scaled);
      for (const GemmCase& gc : epilogue_variants(Backend::kEmulated, 0)) check_gemm(ra, rb, gc, "nvfp4 row-amax x 16x16" + shape);
      TestOperand pb = plain_op("w bf16", s.n, s.k, 42, true);
      check_gemm(ra, pb, {2.0f, 1.0f, DType::kBF16, 0, Backend::kEmulated}, "nvfp4 row-amax x bf16" + shape);
    }
  }
  {  // Per-row amaxes on B are refused (they would scale C's columns).
    quant::QuantConfig nv_rows = nv;
    nv_rows.nvfp4_row_amax = true;
    TestOperand a = quant_op("x", 32, 64, 43, nv), b = quant_op("w", 32, 64, 44, nv_rows);
    expect_error([&] { check_gemm(a, b, {}, "row-amax B"); }, {"per-row amaxes", "only operand A"});
  }
  // The Wgrad pair: column-wise copies with RHT along the token dimension (M = 64).
  quant::QuantConfig rht = nv;
  rht.rht = true;
  rht.rounding = quant::Rounding::kStochastic;
  TestOperand dy = quant_op("dy", 96, 64, 18, rht, Copy::kColwise), x = quant_op("x", 80, 64, 19, rht, Copy::kColwise);
  for (const GemmCase& gc : epilogue_variants(Backend::kEmulated, 0)) check_gemm(dy, x, gc, "nvfp4 wgrad rht");
}

TEST_F(GemmCuda, Mxfp8InexactScalesAreNeverSilent) {
  // Row 3 of the source is scaled into the range where its E8M0 scale code is below 3.
  Tensor src = random_matrix(32, 64, 20);
  for (int64_t c = 0; c < 64; ++c) src.ptr<float>()[3 * 64 + c] *= std::ldexp(1.0f, -128);
  TestOperand a;
  a.name = "tiny x";
  a.q = std::make_shared<quant::QuantizedTensor>(quant::quantize_reference(src.view(), config(quant::Format::kMxfp8), {true, false}, {"tiny x"}));
  TestOperand b = quant_op("w", 16, 64, 21, config(quant::Format::kMxfp8));
  Tensor c = Tensor::empty({32, 16}, DType::kF32, Device::kCuda);
  GemmArgs args;
  args.a = a.device();
  args.b = b.device();
  args.c = c.view();
  expect_error([&] { gemm(args); }, {"[3, 246]", "MXFP8"});
  Tensor flag = Tensor::zeros({1}, DType::kI32, Device::kCuda);
  args.error_flag = flag.ptr<int>();
  gemm(args);
  const Tensor hf = flag.to(Device::kCpu), hc = c.to(Device::kCpu);
  EXPECT_EQ(hf.ptr<int>()[0], kernels::kErrMxfp8NotExact);
  EXPECT_TRUE(std::isnan(hc.ptr<float>()[3 * 16]));
  EXPECT_FALSE(std::isnan(hc.ptr<float>()[0]));
}

TEST_F(GemmCuda, ScaledBf16KernelMatchesReferenceBitForBit) {
  for (quant::Format f : {quant::Format::kNvfp4, quant::Format::kMxfp8}) {
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{64, 256}, {7, 45}, {3, 16}, {1000, 768}}) {
      SCOPED_TRACE(std::string(quant::format_name(f)) + " " + std::to_string(rows) + "x" + std::to_string(cols));
      TestOperand o = quant_op("x", rows, cols, 22, config(f));
      o.device();
      const quant::QuantizedData& d = *o.d_q.rowwise;
      Tensor out = Tensor::empty({rows, cols}, DType::kBF16, Device::kCuda);
      Tensor flag = Tensor::zeros({1}, DType::kI32, Device::kCuda);
      kernels::launch_scaled_bf16({f, d.data.ptr<const uint8_t>(), d.scales.ptr<const uint8_t>(), rows, cols,
                                   out.ptr<uint16_t>(), flag.ptr<int>()}, nullptr);
      const Tensor got = out.to(Device::kCpu), want = quant::dequantize_bf16_scaled_reference(*o.q, false);
      EXPECT_EQ(std::memcmp(got.data(), want.data(), got.nbytes()), 0);
      EXPECT_EQ(flag.to(Device::kCpu).ptr<int>()[0], 0);
    }
  }
}

TEST_F(GemmCuda, Fp8ScaleLayoutKernelMatchesReference) {
  std::vector<float> src(300 * 7);
  std::iota(src.begin(), src.end(), 1.0f);
  Tensor d_src = Tensor::empty({(int64_t)src.size()}, DType::kF32, Device::kCuda);
  device_memcpy(d_src.data(), Device::kCuda, src.data(), Device::kCpu, (int64_t)src.size() * 4);
  std::vector<float> src2d(3 * 7);
  std::iota(src2d.begin(), src2d.end(), 1.0f);
  Tensor d_src2d = Tensor::empty({(int64_t)src2d.size()}, DType::kF32, Device::kCuda);
  device_memcpy(d_src2d.data(), Device::kCuda, src2d.data(), Device::kCpu, (int64_t)src2d.size() * 4);
  for (Fp8BlockScaleSlice s : {Fp8BlockScaleSlice{nullptr, 7, false, 0, 300, 0, 7}, {nullptr, 7, false, 12, 64, 2, 3},
                               {nullptr, 7, true, 0, 300, 0, 7}, {nullptr, 7, true, 128, 100, 1, 5}}) {
    s.src = s.block_2d ? src2d.data() : src.data();
    const std::vector<float> want = convert_fp8_block_scales_reference(s);
    s.src = s.block_2d ? d_src2d.ptr<float>() : d_src.ptr<float>();
    Tensor out = Tensor::empty({(int64_t)want.size()}, DType::kF32, Device::kCuda);
    fill_bytes(out.view(), kPoison);
    kernels::launch_fp8_block_scales(s, out.ptr<float>(), nullptr);
    const Tensor got = out.to(Device::kCpu);
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0)
        << (s.block_2d ? "2d" : "1d") << " rows " << s.row0 << "+" << s.rows << " blocks " << s.block0 << "+" << s.blocks;
  }
}

// Grouped GEMMs on the GPU against the CPU reference grouped GEMM.
void check_grouped(GroupSplit split, const std::vector<int64_t>& sizes, TestOperand& a, std::vector<TestOperand>& bs,
                   int64_t out_rows, int64_t out_cols, double tol, const std::string& what,
                   Backend backend = Backend::kAuto) {
  SCOPED_TRACE(what);
  const int64_t groups = (int64_t)sizes.size();
  const bool rows_split = split == GroupSplit::kRows;
  const int64_t n_out = rows_split ? 1 : groups;
  std::vector<Tensor> c0, c_ref, c_gpu;
  std::vector<TensorView> ref_views, gpu_views;
  for (int64_t i = 0; i < n_out; ++i) {
    c0.push_back(random_matrix(out_rows, out_cols, 200 + i, DType::kF32));
    c_ref.push_back(Tensor::empty({out_rows, out_cols}, DType::kF32, Device::kCpu));
    copy_tensor(c_ref.back().view(), c0.back().view());
    c_gpu.push_back(c0.back().to(Device::kCuda));
  }
  for (int64_t i = 0; i < n_out; ++i) {
    ref_views.push_back(c_ref[i].view());
    gpu_views.push_back(c_gpu[i].view());
  }
  std::vector<Operand> host_b, dev_b;
  for (TestOperand& b : bs) {
    host_b.push_back(b.host());
    dev_b.push_back(b.device());
  }
  GroupedGemmArgs args;
  args.split = split;
  args.group_sizes = sizes;
  args.a = a.host();
  args.b = host_b;
  args.c = ref_views;
  args.alpha = 0.5f;
  args.beta = 1.0f;
  args.backend = Backend::kCpuReference;
  grouped_gemm(args);
  args.a = a.device();
  args.b = dev_b;
  args.c = gpu_views;
  args.backend = backend;
  grouped_gemm(args);
  device_synchronize();
  // S per output element, group by group.
  const std::vector<double> va = logical_values(a.host());
  const int64_t k_total = a.host().k();
  int64_t offset = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const std::vector<double> vb = logical_values(host_b[rows_split ? g : 0]);
    const int64_t out = rows_split ? 0 : g;
    const std::vector<double> c0d = to_doubles(c0[out]), got = to_doubles(c_gpu[out]), ref = to_doubles(c_ref[out]);
    const int64_t r0 = rows_split ? offset : 0, r1 = rows_split ? offset + sizes[g] : out_rows;
    const int64_t k0 = rows_split ? 0 : offset, k1 = rows_split ? k_total : offset + sizes[g];
    std::vector<double> g_got, g_ref, g_s;
    for (int64_t i = r0; i < r1; ++i)
      for (int64_t j = 0; j < out_cols; ++j) {
        double acc = 0;
        for (int64_t l = k0; l < k1; ++l) acc += std::fabs(va[(size_t)(i * k_total + l)] * vb[(size_t)(j * vb.size() / out_cols + l)]);
        g_s.push_back(0.5 * acc + std::fabs(c0d[(size_t)(i * out_cols + j)]));
        g_got.push_back(got[(size_t)(i * out_cols + j)]);
        g_ref.push_back(ref[(size_t)(i * out_cols + j)]);
      }
    EXPECT_TRUE(within_bound(g_got, g_ref, g_s, tol, DType::kF32, out_cols, what + " group " + std::to_string(g)));
    offset += sizes[g];
  }
}

TEST_F(GemmCuda, GroupedRowSplit) {
  const std::vector<int64_t> sizes = {4, 0, 12, 8, 0, 40};
  const int64_t t = 64, n = 96, k = 256;
  struct P { const char* name; std::optional<quant::QuantConfig> x, w; double tol; };
  const P cases[] = {{"bf16", std::nullopt, std::nullopt, fp32_accumulation_tolerance(k)},
                     {"fp8 1x128 x 128x128", config(quant::Format::kFp8Block), config(quant::Format::kFp8Block, true), kFp8AccumulationTolerance},
                     {"nvfp4 1x16 x 16x16", config(quant::Format::kNvfp4), config(quant::Format::kNvfp4, true), fp32_accumulation_tolerance(k)},
                     {"nvfp4 1x16 row-amax x 16x16", row_amax(config(quant::Format::kNvfp4)), config(quant::Format::kNvfp4, true),
                      fp32_accumulation_tolerance(k)}};
  for (const P& p : cases) {
    TestOperand x = p.x ? quant_op("x", t, k, 30, *p.x) : plain_op("x", t, k, 30);
    std::vector<TestOperand> w;
    for (size_t g = 0; g < sizes.size(); ++g) w.push_back(p.w ? quant_op("w", n, k, 31 + g, *p.w) : plain_op("w", n, k, 31 + g));
    check_grouped(GroupSplit::kRows, sizes, x, w, t, n, p.tol, std::string("row split ") + p.name);
  }
}

TEST_F(GemmCuda, GroupedReductionSplit) {
  const int64_t n = 64, k = 48;
  {  // BF16 Wgrad from plain transposed views, groups of multiples of 8 tokens.
    const std::vector<int64_t> sizes = {16, 0, 24, 8};
    TestOperand dy = plain_op("dy", n, 48, 40, true);
    std::vector<TestOperand> x = {plain_op("x", k, 48, 41, true)};
    check_grouped(GroupSplit::kReduction, sizes, dy, x, n, k, fp32_accumulation_tolerance(48), "reduction split bf16");
  }
  {  // FP8 1x128 column-wise copies, groups of multiples of 128 tokens.
    const std::vector<int64_t> sizes = {128, 0, 256};
    TestOperand dy = quant_op("dy", n, 384, 42, config(quant::Format::kFp8Block), Copy::kColwise);
    std::vector<TestOperand> x = {quant_op("x", k, 384, 43, config(quant::Format::kFp8Block), Copy::kColwise)};
    check_grouped(GroupSplit::kReduction, sizes, dy, x, n, k, kFp8AccumulationTolerance, "reduction split fp8 1x128",
                  Backend::kCublasFp8);
    if (on_sm90()) {
      check_grouped(GroupSplit::kReduction, sizes, dy, x, n, k, kFp8AccumulationTolerance,
                    "reduction split fp8 1x128 (wgmma)", Backend::kWgmmaFp8);
    }
  }
  {  // NVFP4 with RHT, groups of multiples of 16 tokens.
    const std::vector<int64_t> sizes = {32, 0, 48, 16};
    const quant::QuantConfig rht = config(quant::Format::kNvfp4, false, true);
    TestOperand dy = quant_op("dy", n, 96, 44, rht, Copy::kColwise);
    std::vector<TestOperand> x = {quant_op("x", k, 96, 45, rht, Copy::kColwise)};
    check_grouped(GroupSplit::kReduction, sizes, dy, x, n, k, fp32_accumulation_tolerance(96), "reduction split nvfp4 rht");
  }
}

// The linear layer on the GPU (CUDA quantizers, fused scaled-domain path) against the linear layer
// on the CPU (reference quantizers, float64 GEMM): the quantizers agree bit for bit (quant tests),
// so the difference is the GEMM's accumulation only. Bound: tol * 2 ||a_i|| ||b_j|| over the
// unquantized sources (Cauchy-Schwarz; quantization changes no row norm by 2x).
TEST_F(GemmCuda, LinearLayerMatchesCpu) {
  const int64_t m = 128, n = 256, k = 384;
  const Tensor x = random_matrix(m, k, 50, DType::kBF16), w = random_matrix(n, k, 51, DType::kBF16),
               dy = random_matrix(m, n, 52, DType::kBF16);
  const Tensor x_dev = x.to(Device::kCuda), w_dev = w.to(Device::kCuda), dy_dev = dy.to(Device::kCuda);
  struct R { const char* name; LinearRecipe r; double tol; };
  for (const R& rc : {R{"plain", LinearRecipe::plain(), 0}, R{"nvfp4", LinearRecipe::nvfp4(), 0},
                      R{"fp8-block", LinearRecipe::fp8_block(), kFp8AccumulationTolerance}, R{"mxfp8", LinearRecipe::mxfp8(), 0}}) {
    SCOPED_TRACE(rc.name);
    LinearOptions cpu, gpu;
    cpu.backend = Backend::kCpuReference;
    cpu.sr = gpu.sr = {3, 4};
    auto run = [&](const char* gemm_name, int64_t rows, int64_t cols, int64_t red, const Tensor& sa, bool ta,
                   const Tensor& sb, bool tb, auto&& fn) {
      Tensor c_cpu = Tensor::empty({rows, cols}, DType::kF32, Device::kCpu);
      Tensor c_gpu = Tensor::empty({rows, cols}, DType::kF32, Device::kCuda);
      fn(c_cpu.view(), c_gpu.view());
      device_synchronize();
      const std::vector<double> va = to_doubles(sa), vb = to_doubles(sb);
      std::vector<double> s((size_t)(rows * cols));
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) {
          double na = 0, nb = 0;
          for (int64_t l = 0; l < red; ++l) {
            const double ea = ta ? va[(size_t)(l * rows + i)] : va[(size_t)(i * red + l)];
            const double eb = tb ? vb[(size_t)(l * cols + j)] : vb[(size_t)(j * red + l)];
            na += ea * ea;
            nb += eb * eb;
          }
          s[(size_t)(i * cols + j)] = 2 * std::sqrt(na * nb);
        }
      EXPECT_TRUE(within_bound(to_doubles(c_gpu), to_doubles(c_cpu), s, rc.tol > 0 ? rc.tol : fp32_accumulation_tolerance(red),
                               DType::kF32, cols, std::string(rc.name) + " " + gemm_name));
    };
    run("fprop", m, n, k, x, false, w, false, [&](const TensorView& cc, const TensorView& cg) {
      linear_fprop(rc.r, x.view(), w.view(), cc, cpu);
      linear_fprop(rc.r, x_dev.view(), w_dev.view(), cg, gpu);
    });
    run("dgrad", m, k, n, dy, false, w, true, [&](const TensorView& cc, const TensorView& cg) {
      linear_dgrad(rc.r, dy.view(), w.view(), cc, cpu);
      linear_dgrad(rc.r, dy_dev.view(), w_dev.view(), cg, gpu);
    });
    run("wgrad", n, k, m, dy, true, x, true, [&](const TensorView& cc, const TensorView& cg) {
      linear_wgrad(rc.r, dy.view(), x.view(), cc, 0.0f, cpu);
      linear_wgrad(rc.r, dy_dev.view(), x_dev.view(), cg, 0.0f, gpu);
    });
  }
}

// The Wgrad's X kept quantized (linear_fprop_saving_x): on the GPU too, Y and dW equal the
// unsaved path's bit for bit, and the kept column-wise copy equals the CPU reference quantization
// of stream 5 bit for bit (one pass or two: the presets share one, the row-amax variant does not).
TEST_F(GemmCuda, LinearSavedQuantizedXMatchesTheUnsavedPath) {
  const int64_t m = 128, n = 256, k = 384;
  const Tensor x = random_matrix(m, k, 60, DType::kBF16), w = random_matrix(n, k, 61, DType::kBF16),
               dy = random_matrix(m, n, 62, DType::kBF16);
  const Tensor x_dev = x.to(Device::kCuda), w_dev = w.to(Device::kCuda), dy_dev = dy.to(Device::kCuda);
  LinearRecipe nvfp4_row_amax = LinearRecipe::nvfp4();
  nvfp4_row_amax.fprop_x.quant->nvfp4_row_amax = true;
  LinearRecipe nvfp4_46 = LinearRecipe::nvfp4();
  nvfp4_46.fprop_x.quant->nvfp4_scale_rule = quant::Nvfp4ScaleRule::kFourOverSix;
  nvfp4_46.wgrad_x.quant->nvfp4_scale_rule = quant::Nvfp4ScaleRule::kFourOverSix;
  struct R { const char* name; LinearRecipe r; bool one_pass; };
  for (const R& rc : {R{"nvfp4", LinearRecipe::nvfp4(), true}, R{"fp8-block", LinearRecipe::fp8_block(), true},
                      R{"mxfp8", LinearRecipe::mxfp8(), true}, R{"nvfp4 row amax", nvfp4_row_amax, false},
                      R{"nvfp4 4/6", nvfp4_46, true}}) {
    SCOPED_TRACE(rc.name);
    EXPECT_EQ(fprop_and_wgrad_x_share_a_pass(rc.r), rc.one_pass);
    LinearOptions o;
    o.sr = {5, 6};
    auto host = [](const Tensor& t) { return to_doubles(t.to(Device::kCpu)); };
    Tensor y = Tensor::empty({m, n}, DType::kF32, Device::kCuda), y_saving = Tensor::empty({m, n}, DType::kF32, Device::kCuda);
    linear_fprop(rc.r, x_dev.view(), w_dev.view(), y.view(), o);
    quant::QuantizedTensor saved;
    linear_fprop_saving_x(rc.r, x_dev.view(), w_dev.view(), y_saving.view(), saved, o);
    device_synchronize();
    EXPECT_EQ(host(y_saving), host(y)) << "Y";
    ASSERT_TRUE(saved.colwise.has_value());
    ASSERT_FALSE(saved.rowwise.has_value());
    const quant::QuantizedTensor want =
        quant::quantize_reference(x.view(), *rc.r.wgrad_x.quant, {false, true}, {"x", operand_stream(o, 5)});
    auto bytes = [](const Tensor& t) {
      const Tensor h = t.to(Device::kCpu);
      const uint8_t* p = static_cast<const uint8_t*>(h.data());
      return std::vector<uint8_t>(p, p + h.nbytes());
    };
    EXPECT_EQ(bytes(saved.colwise->data), bytes(want.colwise->data)) << "column-wise data";
    EXPECT_EQ(bytes(saved.colwise->scales), bytes(want.colwise->scales)) << "column-wise scales";
    if (want.colwise->amax.defined()) {
      EXPECT_EQ(bytes(saved.colwise->amax), bytes(want.colwise->amax)) << "column-wise amax";
    }
    Tensor dw = Tensor::zeros({n, k}, DType::kF32, Device::kCuda), dw_saved = Tensor::zeros({n, k}, DType::kF32, Device::kCuda);
    linear_wgrad(rc.r, dy_dev.view(), x_dev.view(), dw.view(), 0.0f, o);
    linear_wgrad_from_saved_x(rc.r, dy_dev.view(), saved, dw_saved.view(), 0.0f, o);
    device_synchronize();
    EXPECT_EQ(host(dw_saved), host(dw)) << "dW";
  }
}

// linear_dgrad_wgrad on the GPU: dY quantized once for both GEMMs (the fused row + column pass with
// the two stochastic-rounding streams) gives dX and dW bit for bit as the separate calls, with X
// given or kept quantized by linear_fprop_saving_x.
TEST_F(GemmCuda, LinearDgradWgradOfOneDyMatchesTheSeparateCalls) {
  const int64_t m = 128, n = 256, k = 384;
  const Tensor x = random_matrix(m, k, 70, DType::kBF16), w = random_matrix(n, k, 71, DType::kBF16),
               dy = random_matrix(m, n, 72, DType::kBF16);
  const Tensor x_dev = x.to(Device::kCuda), w_dev = w.to(Device::kCuda), dy_dev = dy.to(Device::kCuda);
  struct R { const char* name; LinearRecipe r; };
  for (const R& rc : {R{"nvfp4", LinearRecipe::nvfp4()}, R{"fp8-block", LinearRecipe::fp8_block()},
                      R{"mxfp8", LinearRecipe::mxfp8()}}) {
    SCOPED_TRACE(rc.name);
    ASSERT_TRUE(dgrad_and_wgrad_dy_share_a_pass(rc.r));
    LinearOptions o;
    o.sr = {8, 9};
    auto host = [](const Tensor& t) { return to_doubles(t.to(Device::kCpu)); };
    auto f32 = [](int64_t r, int64_t c) { return Tensor::zeros({r, c}, DType::kF32, Device::kCuda); };
    Tensor dx = f32(m, k), dw = f32(n, k), dx2 = f32(m, k), dw2 = f32(n, k), dx3 = f32(m, k), dw3 = f32(n, k);
    linear_dgrad(rc.r, dy_dev.view(), w_dev.view(), dx.view(), o);
    linear_wgrad(rc.r, dy_dev.view(), x_dev.view(), dw.view(), 0.0f, o);
    linear_dgrad_wgrad(rc.r, dy_dev.view(), w_dev.view(), dx2.view(), x_dev.view(), nullptr, dw2.view(), 0.0f, o);
    Tensor y = f32(m, n);
    quant::QuantizedTensor saved;
    linear_fprop_saving_x(rc.r, x_dev.view(), w_dev.view(), y.view(), saved, o);
    linear_dgrad_wgrad(rc.r, dy_dev.view(), w_dev.view(), dx3.view(), TensorView{}, &saved, dw3.view(), 0.0f, o);
    device_synchronize();
    EXPECT_EQ(host(dx2), host(dx)) << "dX";
    EXPECT_EQ(host(dw2), host(dw)) << "dW";
    EXPECT_EQ(host(dx3), host(dx)) << "dX (saved X)";
    EXPECT_EQ(host(dw3), host(dw)) << "dW (saved X)";
  }
}

}  // namespace
}  // namespace fourbit::gemm
