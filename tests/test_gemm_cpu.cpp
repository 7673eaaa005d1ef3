// gemm (cpu): the float64 reference against independent computations (exact small cases, the
// dequantized values of every format, the scaled-domain formula the GPU emulation uses), the
// OpenBLAS backend against the reference within the FP32 accumulation bound, grouped GEMMs
// against per-group GEMMs, the cuBLAS FP8 scale-layout conversion against the documented layout,
// and the errors for every unsupported case.
#include "gemm/fp8_scale_layout.h"
#include "gemm/gemm.h"
#include "gemm_test_util.h"

#include <gtest/gtest.h>

#include <cstring>
#include <numeric>

namespace fourbit::gemm {
namespace {

using testing::expect_error;
using testing::fp32_accumulation_tolerance;
using testing::logical_values;
using testing::magnitude_sums;
using testing::random_matrix;
using testing::to_doubles;
using testing::within_bound;


quant::QuantConfig config(quant::Format f, bool two_d = false) {
  quant::QuantConfig c;
  c.format = f;
  c.block_2d = two_d;
  return c;
}

// Independent float64 GEMM over logical values.
std::vector<double> naive(const Operand& a, const Operand& b, double alpha, double beta,
                          const std::vector<double>& c_old) {
  const std::vector<double> va = logical_values(a), vb = logical_values(b);
  const int64_t m = a.rows(), n = b.rows(), k = a.k();
  std::vector<double> c((size_t)(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      long double acc = 0;
      for (int64_t l = 0; l < k; ++l) acc += (long double)va[(size_t)(i * k + l)] * vb[(size_t)(j * k + l)];
      c[(size_t)(i * n + j)] = (double)(alpha * (double)acc + (beta != 0 ? beta * c_old[(size_t)(i * n + j)] : 0.0));
    }
  return c;
}

TEST(GemmReference, ExactSmallIntegers) {
  // A [2, 3], B [2, 3]: C = A B^T exactly.
  Tensor a = Tensor::empty({2, 3}, DType::kF32, Device::kCpu), b = Tensor::empty({2, 3}, DType::kF32, Device::kCpu);
  const float av[] = {1, 2, 3, 4, 5, 6}, bv[] = {7, 8, 9, -1, 0, 2};
  std::memcpy(a.data(), av, sizeof(av));
  std::memcpy(b.data(), bv, sizeof(bv));
  Tensor c = Tensor::empty({2, 2}, DType::kF32, Device::kCpu);
  GemmArgs args;
  args.a = Operand::dense(a.view(), "a");
  args.b = Operand::dense(b.view(), "b");
  args.c = c.view();
  args.backend = Backend::kCpuReference;
  gemm(args);
  const float expected[] = {50, 5, 122, 8};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(c.ptr<float>()[i], expected[i]) << i;
  // alpha = 2, beta = -1 accumulate: C = 2 A B^T - C.
  args.alpha = 2.0f;
  args.beta = -1.0f;
  gemm(args);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(c.ptr<float>()[i], expected[i]) << i;
}

// float64 plain operands and output (what the model's finite-difference gradient checks use): the
// product keeps every bit a double holds (values that need more than FP32's 24 bits), backend auto
// picks the reference, and cpu-blas refuses them.
TEST(GemmReference, Float64OperandsStayFloat64) {
  Tensor a = Tensor::empty({2, 2}, DType::kF64, Device::kCpu), b = Tensor::empty({3, 2}, DType::kF64, Device::kCpu);
  const double e = std::ldexp(1.0, -40);
  const double av[] = {1 + e, 2, -3, 0.5}, bv[] = {1, 1 + e, 2, -1, 0.25, 4};
  std::memcpy(a.data(), av, sizeof(av));
  std::memcpy(b.data(), bv, sizeof(bv));
  Tensor c = Tensor::empty({2, 3}, DType::kF64, Device::kCpu);
  GemmArgs args;
  args.a = Operand::dense(a.view(), "a");
  args.b = Operand::dense(b.view(), "b");
  args.c = c.view();
  EXPECT_EQ(select_backend(args), Backend::kCpuReference);
  gemm(args);
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j) {
      const double want = av[2 * i] * bv[2 * j] + av[2 * i + 1] * bv[2 * j + 1];
      EXPECT_EQ(c.ptr<double>()[i * 3 + j], want) << i << "," << j;
    }
  EXPECT_NE(c.ptr<double>()[0], 3.0);  // (1 + e) + 2 (1 + e) keeps the 2^-40 terms
  if (backend_built(Backend::kCpuBlas)) {
    args.backend = Backend::kCpuBlas;
    expect_error([&] { gemm(args); }, {"cpu-reference"});
  }
}

TEST(GemmReference, TransposedAndStridedPlainViews) {
  const int64_t m = 7, n = 5, k = 11;
  Tensor a = random_matrix(m, k, 1), bt = random_matrix(k, n, 2, DType::kBF16);
  // A as a strided view of a wider buffer: [m, k] with row stride k + 3.
  Tensor wide = Tensor::zeros({m, k + 3}, DType::kF32, Device::kCpu);
  for (int64_t i = 0; i < m; ++i) std::memcpy(wide.ptr<float>() + i * (k + 3), a.ptr<float>() + i * k, k * 4);
  TensorView a_strided = wide.view();
  a_strided.shape = Shape{m, k};
  Tensor c = Tensor::empty({m, n}, DType::kF32, Device::kCpu);
  GemmArgs args;
  args.a = Operand::dense(a_strided, "a strided");
  args.b = Operand::dense(bt.view(), "b stored [K, N]", /*transposed=*/true);
  args.c = c.view();
  args.backend = Backend::kCpuReference;
  gemm(args);
  const std::vector<double> ref = naive(args.a, args.b, 1, 0, {});
  for (int64_t i = 0; i < m * n; ++i) EXPECT_FLOAT_EQ(c.ptr<float>()[i], (float)ref[(size_t)i]) << i;
}

// For every format and both copies: the reference is the float64 sum over the dequantized values.
TEST(GemmReference, QuantizedOperandsEqualTheirDequantizedValues) {
  const int64_t m = 48, n = 40, k = 80;  // K not a multiple of 32 or 128: partial blocks
  const Tensor x = random_matrix(m, k, 3), w = random_matrix(n, k, 4);
  for (quant::QuantConfig cfg : {config(quant::Format::kNvfp4), config(quant::Format::kNvfp4, true),
                                 config(quant::Format::kMxfp8), config(quant::Format::kFp8Tensor),
                                 config(quant::Format::kFp8Block), config(quant::Format::kFp8Block, true)}) {
    SCOPED_TRACE(cfg.describe());
    const quant::QuantizedTensor qx = quant::quantize_reference(x.view(), cfg, {true, true}, {"x"});
    const quant::QuantizedTensor qw = quant::quantize_reference(w.view(), cfg, {true, false}, {"w"});
    Tensor c = Tensor::empty({m, n}, DType::kF32, Device::kCpu);
    GemmArgs args;
    args.a = Operand::quant(qx, Copy::kRowwise, "x");
    args.b = Operand::quant(qw, Copy::kRowwise, "w");
    args.c = c.view();
    args.alpha = 0.75f;
    args.backend = Backend::kCpuReference;
    gemm(args);
    const std::vector<double> ref = naive(args.a, args.b, 0.75, 0, {});
    for (int64_t i = 0; i < m * n; ++i) ASSERT_FLOAT_EQ(c.ptr<float>()[i], (float)ref[(size_t)i]) << i;
  }
}

// The GPU emulation computes alpha * d_a * d_b * sum(scaled_a * scaled_b): the same function as
// the reference up to FP32 rounding of the per-element global scale (a few ulp).
TEST(GemmReference, Nvfp4ScaledDomainFormulaMatchesReference) {
  const int64_t m = 32, n = 48, k = 96;
  const Tensor x = random_matrix(m, k, 5), w = random_matrix(n, k, 6);
  const quant::QuantizedTensor qx = quant::quantize_reference(x.view(), config(quant::Format::kNvfp4), {true, false}, {"x"});
  const quant::QuantizedTensor qw = quant::quantize_reference(w.view(), config(quant::Format::kNvfp4, true), {true, false}, {"w"});
  const std::vector<double> sx = to_doubles(quant::dequantize_bf16_scaled_reference(qx, false));
  const std::vector<double> sw = to_doubles(quant::dequantize_bf16_scaled_reference(qw, false));
  const double factor = (double)quant::global_decode_scale(qx, false) * quant::global_decode_scale(qw, false);
  Tensor c = Tensor::empty({m, n}, DType::kF32, Device::kCpu);
  GemmArgs args;
  args.a = Operand::quant(qx, Copy::kRowwise, "x");
  args.b = Operand::quant(qw, Copy::kRowwise, "w");
  args.c = c.view();
  args.backend = Backend::kCpuReference;
  gemm(args);
  const std::vector<double> s = magnitude_sums(args.a, args.b, 1, 0, {});
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t l = 0; l < k; ++l) acc += sx[(size_t)(i * k + l)] * sw[(size_t)(j * k + l)];
      ASSERT_NEAR(c.ptr<float>()[i * n + j], factor * acc, 8 * std::ldexp(1.0, -24) * s[(size_t)(i * n + j)] + 1e-30)
          << i << ", " << j;
    }
}

// Wgrad over RHT-transformed column-wise copies: the transform cancels, so the product equals dY^T X
// over the copies dequantized back to the token domain, up to the FP32 rounding of the inverse
// transform; with RHT on only one operand the GEMM is rejected.
TEST(GemmReference, HadamardDomainsMustMatch) {
  const int64_t m = 64, n = 32, k = 48;  // dY [M, N], X [M, K]
  const Tensor dy = random_matrix(m, n, 7), x = random_matrix(m, k, 8);
  quant::QuantConfig rht = config(quant::Format::kNvfp4);
  rht.rht = true;
  const quant::QuantizedTensor qdy = quant::quantize_reference(dy.view(), rht, {false, true}, {"dy"});
  const quant::QuantizedTensor qx = quant::quantize_reference(x.view(), rht, {false, true}, {"x"});
  const quant::QuantizedTensor qx_plain = quant::quantize_reference(x.view(), config(quant::Format::kNvfp4), {false, true}, {"x"});
  Tensor dw = Tensor::empty({n, k}, DType::kF32, Device::kCpu);
  GemmArgs args;
  args.a = Operand::quant(qdy, Copy::kColwise, "dy");
  args.b = Operand::quant(qx, Copy::kColwise, "x");
  args.c = dw.view();
  args.backend = Backend::kCpuReference;
  gemm(args);
  // Against dY^T X from the untransformed dequantized copies (f64): equal up to FP32 rounding of
  // the inverse transform.
  const Tensor dy_hat = quant::dequantize_to_source_reference(qdy, true);
  const Tensor x_hat = quant::dequantize_to_source_reference(qx, true);
  double max_err = 0, max_ref = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < k; ++j) {
      double acc = 0;
      for (int64_t t = 0; t < m; ++t) acc += (double)dy_hat.ptr<float>()[t * n + i] * x_hat.ptr<float>()[t * k + j];
      max_err = std::max(max_err, std::fabs(acc - dw.ptr<float>()[i * k + j]));
      max_ref = std::max(max_ref, std::fabs(acc));
    }
  EXPECT_LT(max_err, 1e-5 * max_ref);
  args.b = Operand::quant(qx_plain, Copy::kColwise, "x without rht");
  expect_error([&] { gemm(args); }, {"Hadamard", "dy", "x without rht"});
}

TEST(GemmBlas, MatchesReferenceWithinFp32AccumulationBound) {
  if (!backend_built(Backend::kCpuBlas)) GTEST_SKIP() << "built without OpenBLAS (FOURBIT_BLAS=OFF)";
  struct Case { int64_t m, n, k; DType c_dtype; float alpha, beta; bool quantized; };
  for (const Case& cs : {Case{37, 29, 45, DType::kF32, 1, 0, false}, Case{64, 96, 200, DType::kBF16, 0.5f, 1, false},
                         Case{33, 17, 130, DType::kF32, -1.5f, 0.25f, true}, Case{128, 64, 256, DType::kBF16, 1, 1, true}}) {
    SCOPED_TRACE(::testing::Message() << cs.m << "x" << cs.n << "x" << cs.k << " " << dtype_name(cs.c_dtype)
                                      << (cs.quantized ? " nvfp4" : " plain"));
    const Tensor a = random_matrix(cs.m, cs.k, 11, DType::kBF16), b = random_matrix(cs.n, cs.k, 12);
    const quant::QuantizedTensor qa = quant::quantize_reference(a.view(), config(quant::Format::kNvfp4), {true, false}, {"a"});
    const Tensor c0 = random_matrix(cs.m, cs.n, 13, cs.c_dtype);
    Tensor c_ref = Tensor::empty({cs.m, cs.n}, cs.c_dtype, Device::kCpu), c_blas = Tensor::empty({cs.m, cs.n}, cs.c_dtype, Device::kCpu);
    copy_tensor(c_ref.view(), c0.view());
    copy_tensor(c_blas.view(), c0.view());
    GemmArgs args;
    args.a = cs.quantized ? Operand::quant(qa, Copy::kRowwise, "a") : Operand::dense(a.view(), "a");
    args.b = Operand::dense(b.view(), "b");
    args.alpha = cs.alpha;
    args.beta = cs.beta;
    args.c = c_ref.view();
    args.backend = Backend::kCpuReference;
    gemm(args);
    args.c = c_blas.view();
    args.backend = Backend::kCpuBlas;
    gemm(args);
    EXPECT_EQ(select_backend(GemmArgs{args.a, args.b, args.c}), Backend::kCpuBlas);
    const std::vector<double> s = magnitude_sums(args.a, args.b, cs.alpha, cs.beta, to_doubles(c0));
    EXPECT_TRUE(within_bound(to_doubles(c_blas), to_doubles(c_ref), s, fp32_accumulation_tolerance(cs.k),
                             cs.c_dtype, cs.n, "cpu-blas"));
  }
}

// GemmArgs::c_source: the beta term reads another matrix, and the result is bit for bit the
// in-place GEMM's on a C that held those values (both CPU backends, f32 and bf16 outputs, K = 0);
// c_source is not written. A c_source that differs from C in shape or dtype is refused.
TEST(GemmCSource, EqualsTheInPlaceGemmBitForBit) {
  std::vector<Backend> backends{Backend::kCpuReference};
  if (backend_built(Backend::kCpuBlas)) backends.push_back(Backend::kCpuBlas);
  struct Case { int64_t m, n, k; DType c_dtype; float alpha, beta; };
  for (Backend backend : backends)
    for (const Case& cs : {Case{37, 29, 45, DType::kF32, 1, 1}, Case{64, 96, 200, DType::kBF16, 0.5f, 1},
                           Case{8, 16, 0, DType::kBF16, 1, 0.5f}, Case{16, 8, 32, DType::kBF16, 1, 0}}) {
      SCOPED_TRACE(::testing::Message() << backend_name(backend) << " " << cs.m << "x" << cs.n << "x" << cs.k
                                        << " " << dtype_name(cs.c_dtype) << " beta " << cs.beta);
      const Tensor a = random_matrix(cs.m, std::max<int64_t>(cs.k, 1), 21, DType::kBF16);
      const Tensor b = random_matrix(cs.n, std::max<int64_t>(cs.k, 1), 22);
      TensorView av = a.view(), bv = b.view();
      av.shape = Shape{cs.m, cs.k};
      bv.shape = Shape{cs.n, cs.k};
      const Tensor c0 = random_matrix(cs.m, cs.n, 23, cs.c_dtype);
      Tensor in_place = Tensor::empty({cs.m, cs.n}, cs.c_dtype, Device::kCpu);
      Tensor source = Tensor::empty({cs.m, cs.n}, cs.c_dtype, Device::kCpu);
      Tensor out = Tensor::empty({cs.m, cs.n}, cs.c_dtype, Device::kCpu);
      copy_tensor(in_place.view(), c0.view());
      copy_tensor(source.view(), c0.view());
      std::memset(out.data(), 0x7F, (size_t)out.nbytes());
      GemmArgs args;
      args.a = Operand::dense(av, "a");
      args.b = Operand::dense(bv, "b");
      args.alpha = cs.alpha;
      args.beta = cs.beta;
      args.backend = backend;
      args.c = in_place.view();
      gemm(args);
      args.c = out.view();
      args.c_source = source.view();
      gemm(args);
      EXPECT_EQ(std::memcmp(out.data(), in_place.data(), (size_t)out.nbytes()), 0);
      EXPECT_EQ(std::memcmp(source.data(), c0.data(), (size_t)c0.nbytes()), 0) << "c_source was written";
    }
  const Tensor a = random_matrix(8, 16, 24), b = random_matrix(4, 16, 25);
  Tensor c = Tensor::empty({8, 4}, DType::kF32, Device::kCpu), wrong = Tensor::empty({4, 8}, DType::kF32, Device::kCpu);
  Tensor wrong_type = Tensor::empty({8, 4}, DType::kBF16, Device::kCpu);
  GemmArgs args;
  args.a = Operand::dense(a.view(), "a");
  args.b = Operand::dense(b.view(), "b");
  args.c = c.view();
  args.beta = 1.0f;
  args.c_source = wrong.view();
  expect_error([&] { gemm(args); }, {"c_source", "shape"});
  args.c_source = wrong_type.view();
  expect_error([&] { gemm(args); }, {"c_source", "dtype"});
}

// Grouped GEMMs equal their per-group GEMMs, with uneven and empty groups, both splits.
TEST(GemmGrouped, RowSplitEqualsPerGroupGemms) {
  const std::vector<int64_t> sizes = {5, 0, 17, 1, 0, 9};
  const int64_t t = std::accumulate(sizes.begin(), sizes.end(), int64_t{0}), n = 24, k = 40;
  const Tensor x = random_matrix(t, k, 21);
  const quant::QuantizedTensor qx = quant::quantize_reference(x.view(), config(quant::Format::kMxfp8), {true, false}, {"x"});
  std::vector<Tensor> w;
  std::vector<quant::QuantizedTensor> qw;
  std::vector<Operand> b;
  for (size_t g = 0; g < sizes.size(); ++g) w.push_back(random_matrix(n, k, 30 + g));
  for (size_t g = 0; g < sizes.size(); ++g) qw.push_back(quant::quantize_reference(w[g].view(), config(quant::Format::kMxfp8), {true, false}, {"w"}));
  for (size_t g = 0; g < sizes.size(); ++g) b.push_back(Operand::quant(qw[g], Copy::kRowwise, "w_g"));
  for (Backend backend : {Backend::kCpuReference, Backend::kCpuBlas}) {
    if (!backend_built(backend)) continue;
    SCOPED_TRACE(backend_name(backend));
    Tensor y = Tensor::empty({t, n}, DType::kF32, Device::kCpu);
    const TensorView y_view = y.view();
    GroupedGemmArgs args;
    args.split = GroupSplit::kRows;
    args.group_sizes = sizes;
    args.a = Operand::quant(qx, Copy::kRowwise, "x");
    args.b = b;
    args.c = {&y_view, 1};
    args.backend = backend;
    grouped_gemm(args);
    // Per group: a GEMM over the group's rows, through an independently quantized slice of X
    // (row-wise blocks lie within a row, so slicing rows commutes with quantization).
    int64_t offset = 0;
    for (size_t g = 0; g < sizes.size(); ++g) {
      const int64_t rows = sizes[g];
      if (rows > 0) {
        Tensor xg = Tensor::empty({rows, k}, DType::kF32, Device::kCpu);
        std::memcpy(xg.data(), x.ptr<float>() + offset * k, rows * k * 4);
        const quant::QuantizedTensor qxg = quant::quantize_reference(xg.view(), config(quant::Format::kMxfp8), {true, false}, {"xg"});
        Tensor yg = Tensor::empty({rows, n}, DType::kF32, Device::kCpu);
        GemmArgs single;
        single.a = Operand::quant(qxg, Copy::kRowwise, "xg");
        single.b = b[g];
        single.c = yg.view();
        single.backend = backend;
        gemm(single);
        for (int64_t i = 0; i < rows * n; ++i) ASSERT_EQ(yg.ptr<float>()[i], y.ptr<float>()[offset * n + i]) << g << " " << i;
      }
      offset += rows;
    }
  }
}

TEST(GemmGrouped, ReductionSplitWithEmptyGroupsAndAccumulation) {
  const std::vector<int64_t> sizes = {32, 0, 48, 16};  // multiples of 16: the RHT blocks stay inside groups
  const int64_t t = 96, n = 20, k = 24;              // dY [T, N], X [T, K]
  const Tensor dy = random_matrix(t, n, 41), x = random_matrix(t, k, 42);
  quant::QuantConfig cfg = config(quant::Format::kNvfp4);
  cfg.rht = true;
  const quant::QuantizedTensor qdy = quant::quantize_reference(dy.view(), cfg, {false, true}, {"dy"});
  const quant::QuantizedTensor qx = quant::quantize_reference(x.view(), cfg, {false, true}, {"x"});
  const Operand b = Operand::quant(qx, Copy::kColwise, "x");
  std::vector<Tensor> dw, c0;
  std::vector<TensorView> views;
  for (size_t g = 0; g < sizes.size(); ++g) {
    c0.push_back(random_matrix(n, k, 50 + g));
    dw.push_back(Tensor::empty({n, k}, DType::kF32, Device::kCpu));
    copy_tensor(dw.back().view(), c0.back().view());
  }
  for (const Tensor& d : dw) views.push_back(d.view());
  GroupedGemmArgs args;
  args.split = GroupSplit::kReduction;
  args.group_sizes = sizes;
  args.a = Operand::quant(qdy, Copy::kColwise, "dy");
  args.b = {&b, 1};
  args.c = views;
  args.beta = 1.0f;
  args.backend = Backend::kCpuReference;
  grouped_gemm(args);
  const std::vector<double> va = logical_values(args.a), vb = logical_values(b);  // [N, T], [K, T]
  int64_t offset = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < k; ++j) {
        double acc = c0[g].ptr<float>()[i * k + j];
        for (int64_t l = offset; l < offset + sizes[g]; ++l) acc += va[(size_t)(i * t + l)] * vb[(size_t)(j * t + l)];
        ASSERT_FLOAT_EQ(dw[g].ptr<float>()[i * k + j], (float)acc) << "group " << g;
      }
    offset += sizes[g];
  }
  // A group that splits a 16-token Hadamard block is rejected.
  const std::vector<int64_t> bad = {40, 56};
  args.group_sizes = bad;
  args.c = std::span<const TensorView>(views.data(), 2);
  expect_error([&] { grouped_gemm(args); }, {"multiple of 16", "RHT"});
}

TEST(GemmErrors, ShapesDevicesAndBackends) {
  const Tensor a = random_matrix(8, 16, 61), b = random_matrix(4, 12, 62);
  Tensor c = Tensor::empty({8, 4}, DType::kF32, Device::kCpu);
  GemmArgs args;
  args.a = Operand::dense(a.view(), "x");
  args.b = Operand::dense(b.view(), "w");
  args.c = c.view();
  args.name = "test fprop";
  expect_error([&] { gemm(args); }, {"test fprop", "reduction lengths", "16", "12"});
  const Tensor b2 = random_matrix(4, 16, 63);
  args.b = Operand::dense(b2.view(), "w");
  Tensor c_wrong = Tensor::empty({4, 8}, DType::kF32, Device::kCpu);
  args.c = c_wrong.view();
  expect_error([&] { gemm(args); }, {"output C", "[8, 4]"});
  args.c = c.view();
  args.backend = Backend::kCublasBf16;
  expect_error([&] { gemm(args); }, {"cublaslt-bf16"});
  // A missing copy of a quantized bundle.
  const quant::QuantizedTensor q = quant::quantize_reference(a.view(), config(quant::Format::kNvfp4), {true, false}, {"x"});
  args.backend = Backend::kAuto;
  args.a = Operand::quant(q, Copy::kColwise, "x");
  expect_error([&] { gemm(args); }, {"column-wise", "x", "Orientations"});
  // Grouped: sizes that do not add up.
  const std::vector<int64_t> sizes = {3, 3};
  std::vector<Operand> bs = {Operand::dense(b2.view(), "w0"), Operand::dense(b2.view(), "w1")};
  const TensorView cv = c.view();
  GroupedGemmArgs g;
  g.group_sizes = sizes;
  g.a = Operand::dense(a.view(), "x");
  g.b = bs;
  g.c = {&cv, 1};
  expect_error([&] { grouped_gemm(g); }, {"add up to 6", "8"});
}

// The cuBLAS layouts of fp8_scale_layout.h, written out by hand for small cases.
TEST(Fp8ScaleLayout, ReferenceMatchesDocumentedLayout) {
  // 1x128: scales [R = 8, L = 3] row-major -> [L][R].
  std::vector<float> src(8 * 3);
  std::iota(src.begin(), src.end(), 1.0f);  // src[r * 3 + l] = 1 + r * 3 + l
  Fp8BlockScaleSlice s{src.data(), 3, false, 0, 8, 0, 3};
  std::vector<float> out = convert_fp8_block_scales_reference(s);
  ASSERT_EQ(out.size(), 24u);
  for (int l = 0; l < 3; ++l)
    for (int r = 0; r < 8; ++r) EXPECT_EQ(out[l * 8 + r], 1 + r * 3 + l) << l << " " << r;
  // A slice: rows 4..7, K blocks 1..2.
  s = {src.data(), 3, false, 4, 4, 1, 2};
  out = convert_fp8_block_scales_reference(s);
  ASSERT_EQ(out.size(), 8u);
  for (int l = 0; l < 2; ++l)
    for (int r = 0; r < 4; ++r) EXPECT_EQ(out[l * 4 + r], 1 + (4 + r) * 3 + (1 + l));
  // 128x128: scales [2 row blocks, L = 5] -> [2][8] (L padded to a multiple of 4 with zeros).
  std::vector<float> src2(2 * 5);
  std::iota(src2.begin(), src2.end(), 1.0f);
  s = {src2.data(), 5, true, 0, 200, 0, 5};
  out = convert_fp8_block_scales_reference(s);
  ASSERT_EQ(out.size(), 16u);
  const float expected[16] = {1, 2, 3, 4, 5, 0, 0, 0, 6, 7, 8, 9, 10, 0, 0, 0};
  for (int i = 0; i < 16; ++i) EXPECT_EQ(out[i], expected[i]) << i;
  // 2D slice starting at row 128 and K block 2: one row block, L = 3 -> padded to 4.
  s = {src2.data(), 5, true, 128, 72, 2, 3};
  out = convert_fp8_block_scales_reference(s);
  const float expected2[4] = {8, 9, 10, 0};
  ASSERT_EQ(out.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(out[i], expected2[i]) << i;
}

}  // namespace
}  // namespace fourbit::gemm
