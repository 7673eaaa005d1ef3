// gemm (cpu): the linear layer's three GEMMs under each preset recipe. (1) Plumbing: each GEMM
// equals the reference GEMM over operands quantized by hand in the orientation NUMERICS.md 4.1
// prescribes, with the documented random streams, bit for bit. (2) Quantization error, measured
// separately from kernel error: the relative error and bias of Y, dX and dW against the float64
// GEMM of the unquantized operands, printed as a table, with only sanity bounds asserted.
#include "gemm/linear.h"
#include "gemm_test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace fourbit::gemm {
namespace {

using testing::random_matrix;
using testing::to_doubles;

struct NamedRecipe {
  const char* name;
  LinearRecipe recipe;
};

std::vector<NamedRecipe> recipes() {
  return {{"plain", LinearRecipe::plain()},
          {"nvfp4", LinearRecipe::nvfp4()},
          {"fp8-block", LinearRecipe::fp8_block()},
          {"mxfp8", LinearRecipe::mxfp8()}};
}

// The reference GEMM over operands prepared by hand: `src_a` in orientation `copy_a` (plain
// column-wise = transposed view), likewise b.
Tensor manual_gemm(const OperandRecipe& ra, const Tensor& src_a, Copy copy_a, RandomStream sa,
                   const OperandRecipe& rb, const Tensor& src_b, Copy copy_b, RandomStream sb,
                   int64_t m, int64_t n) {
  quant::QuantizedTensor qa, qb;
  auto make = [](const OperandRecipe& r, const Tensor& src, Copy copy, RandomStream s,
                 quant::QuantizedTensor& q, const char* name) {
    const bool colwise = copy == Copy::kColwise;
    if (!r.quant) return Operand::dense(src.view(), name, colwise);
    q = quant::quantize_reference(src.view(), *r.quant, {!colwise, colwise}, {name, s});
    return Operand::quant(q, copy, name);
  };
  Tensor c = Tensor::empty({m, n}, DType::kF32, Device::kCpu);
  GemmArgs args;
  args.a = make(ra, src_a, copy_a, sa, qa, "a");
  args.b = make(rb, src_b, copy_b, sb, qb, "b");
  args.c = c.view();
  args.backend = Backend::kCpuReference;
  gemm(args);
  return c;
}

void expect_equal(const Tensor& got, const Tensor& want, const char* what) {
  const std::vector<double> g = to_doubles(got), w = to_doubles(want);
  ASSERT_EQ(g.size(), w.size());
  for (size_t i = 0; i < g.size(); ++i) ASSERT_EQ(g[i], w[i]) << what << " element " << i;
}

TEST(GemmLinear, EachGemmQuantizesItsOperandsInTheRightOrientation) {
  const int64_t m = 64, n = 48, k = 80;
  const Tensor x = random_matrix(m, k, 1), w = random_matrix(n, k, 2), dy = random_matrix(m, n, 3);
  LinearOptions o;
  o.backend = Backend::kCpuReference;
  o.sr = {77, 1000};
  auto st = [&](uint64_t i) { return RandomStream{o.sr.seed, o.sr.stream + i}; };
  for (const NamedRecipe& nr : recipes()) {
    SCOPED_TRACE(nr.name);
    const LinearRecipe& r = nr.recipe;
    Tensor y = Tensor::empty({m, n}, DType::kF32, Device::kCpu);
    Tensor dx = Tensor::empty({m, k}, DType::kF32, Device::kCpu);
    Tensor dw = Tensor::zeros({n, k}, DType::kF32, Device::kCpu);
    linear_fprop(r, x.view(), w.view(), y.view(), o);
    linear_dgrad(r, dy.view(), w.view(), dx.view(), o);
    linear_wgrad(r, dy.view(), x.view(), dw.view(), 0.0f, o);
    expect_equal(y, manual_gemm(r.fprop_x, x, Copy::kRowwise, st(0), r.fprop_w, w, Copy::kRowwise, st(1), m, n), "Y");
    expect_equal(dx, manual_gemm(r.dgrad_dy, dy, Copy::kRowwise, st(2), r.dgrad_w, w, Copy::kColwise, st(3), m, k), "dX");
    expect_equal(dw, manual_gemm(r.wgrad_dy, dy, Copy::kColwise, st(4), r.wgrad_x, x, Copy::kColwise, st(5), n, k), "dW");
    // beta = 1 accumulates a second micro-batch's Wgrad.
    Tensor dw2 = Tensor::empty({n, k}, DType::kF32, Device::kCpu);
    copy_tensor(dw2.view(), dw.view());
    linear_wgrad(r, dy.view(), x.view(), dw2.view(), 1.0f, o);
    for (int64_t i = 0; i < n * k; ++i) ASSERT_EQ(dw2.ptr<float>()[i], 2.0f * dw.ptr<float>()[i]) << i;
  }
}

// Bytes of every tensor of one orientation, for bitwise comparison of quantized copies.
std::vector<uint8_t> orientation_bytes(const quant::QuantizedData& d) {
  std::vector<uint8_t> out;
  for (const Tensor* t : {&d.data, &d.scales, &d.amax}) {
    if (!t->defined()) continue;
    const uint8_t* p = static_cast<const uint8_t*>(t->data());
    out.insert(out.end(), p, p + t->nbytes());
  }
  return out;
}

// linear_fprop_saving_x + linear_wgrad_from_saved_x are linear_fprop + linear_wgrad bit for bit,
// the kept copy is exactly the column-wise operand of stream 5, one pass is used exactly when the
// two X configs allow it, and a copy saved under another recipe is refused.
TEST(GemmLinear, SavedQuantizedXGivesTheSameGemms) {
  const int64_t m = 64, n = 48, k = 80;
  const Tensor x = random_matrix(m, k, 11), w = random_matrix(n, k, 12), dy = random_matrix(m, n, 13);
  LinearOptions o;
  o.backend = Backend::kCpuReference;
  o.sr = {78, 2000};
  std::vector<NamedRecipe> cases;
  for (const NamedRecipe& nr : recipes())
    if (wgrad_reads_quantized_x(nr.recipe)) cases.push_back(nr);
  LinearRecipe sr_x = LinearRecipe::nvfp4();  // X rounded stochastically: two passes
  sr_x.fprop_x.quant->rounding = quant::Rounding::kStochastic;
  sr_x.wgrad_x.quant->rounding = quant::Rounding::kStochastic;
  cases.push_back({"nvfp4 sr x", sr_x});
  LinearRecipe row_amax = LinearRecipe::nvfp4();  // per-token amax on the Fprop copy: two passes
  row_amax.fprop_x.quant->nvfp4_row_amax = true;
  cases.push_back({"nvfp4 row amax", row_amax});
  LinearRecipe four_six = LinearRecipe::nvfp4();  // 4/6 on both copies: one pass
  four_six.fprop_x.quant->nvfp4_scale_rule = quant::Nvfp4ScaleRule::kFourOverSix;
  four_six.wgrad_x.quant->nvfp4_scale_rule = quant::Nvfp4ScaleRule::kFourOverSix;
  cases.push_back({"nvfp4 4/6", four_six});
  ASSERT_EQ(cases.size(), 6u);
  const std::vector<bool> one_pass = {true, true, true, false, false, true};
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    SCOPED_TRACE(cases[ci].name);
    const LinearRecipe& r = cases[ci].recipe;
    EXPECT_EQ(fprop_and_wgrad_x_share_a_pass(r), one_pass[ci]);
    Tensor y = Tensor::empty({m, n}, DType::kF32, Device::kCpu), y_saving = y.to(Device::kCpu);
    Tensor dw = Tensor::zeros({n, k}, DType::kF32, Device::kCpu), dw_saved = dw.to(Device::kCpu);
    linear_fprop(r, x.view(), w.view(), y.view(), o);
    quant::QuantizedTensor saved;
    linear_fprop_saving_x(r, x.view(), w.view(), y_saving.view(), saved, o);
    expect_equal(y_saving, y, "Y");
    ASSERT_FALSE(saved.rowwise.has_value());
    ASSERT_TRUE(saved.colwise.has_value());
    const quant::QuantizedTensor want = quant::quantize_reference(
        x.view(), *r.wgrad_x.quant, {false, true}, {"x", operand_stream(o, 5)});
    EXPECT_EQ(orientation_bytes(*saved.colwise), orientation_bytes(*want.colwise));
    EXPECT_EQ(quantized_bytes(saved), (int64_t)orientation_bytes(*want.colwise).size());
    linear_wgrad(r, dy.view(), x.view(), dw.view(), 0.0f, o);
    linear_wgrad_from_saved_x(r, dy.view(), saved, dw_saved.view(), 0.0f, o);
    expect_equal(dw_saved, dw, "dW");
  }
  // NVFP4 [64, 80] kept column-wise: 80 x 64 nibbles + 80 x 4 E4M3 scales + one f32 amax.
  quant::QuantizedTensor saved;
  Tensor y = Tensor::empty({m, n}, DType::kF32, Device::kCpu);
  linear_fprop_saving_x(LinearRecipe::nvfp4(), x.view(), w.view(), y.view(), saved, o);
  EXPECT_EQ(quantized_bytes(saved), 80 * 64 / 2 + 80 * 4 + 4);
  // A copy saved under NVFP4 is not an MXFP8 Wgrad's operand; a plain recipe keeps X itself.
  Tensor dw = Tensor::zeros({n, k}, DType::kF32, Device::kCpu);
  try {
    linear_wgrad_from_saved_x(LinearRecipe::mxfp8(), dy.view(), saved, dw.view(), 0.0f, o);
    ADD_FAILURE() << "an NVFP4 copy fed an MXFP8 Wgrad";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("linear_fprop_saving_x"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(wgrad_reads_quantized_x(LinearRecipe::plain()));
  EXPECT_THROW(linear_fprop_saving_x(LinearRecipe::plain(), x.view(), w.view(), y.view(), saved, o), Error);
}

// linear_dgrad_wgrad is linear_dgrad + linear_wgrad bit for bit (X given or saved), with one pass
// over dY exactly when the two dY configs allow it; dY's stochastic rounding keeps its two streams.
TEST(GemmLinear, DgradAndWgradOfOneDyGiveTheSameGemms) {
  const int64_t m = 64, n = 48, k = 80;
  const Tensor x = random_matrix(m, k, 21), w = random_matrix(n, k, 22), dy = random_matrix(m, n, 23);
  LinearOptions o;
  o.backend = Backend::kCpuReference;
  o.sr = {79, 3000};
  std::vector<NamedRecipe> cases = recipes();
  LinearRecipe dy_row_amax = LinearRecipe::nvfp4();  // a per-row amax on Dgrad's dY: two passes
  dy_row_amax.dgrad_dy.quant->nvfp4_row_amax = true;
  cases.push_back({"nvfp4 dy row amax", dy_row_amax});
  LinearRecipe dy_rn = LinearRecipe::nvfp4();  // Dgrad's dY rounded to nearest, Wgrad's SR: two
  dy_rn.dgrad_dy.quant->rounding = quant::Rounding::kNearest;
  cases.push_back({"nvfp4 dy rn/sr", dy_rn});
  const std::vector<bool> one_pass = {false, true, true, true, false, false};
  ASSERT_EQ(cases.size(), one_pass.size());
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    SCOPED_TRACE(cases[ci].name);
    const LinearRecipe& r = cases[ci].recipe;
    EXPECT_EQ(dgrad_and_wgrad_dy_share_a_pass(r), one_pass[ci]);
    Tensor dx = Tensor::empty({m, k}, DType::kF32, Device::kCpu), dx2 = dx.to(Device::kCpu);
    Tensor dw = Tensor::zeros({n, k}, DType::kF32, Device::kCpu), dw2 = dw.to(Device::kCpu);
    linear_dgrad(r, dy.view(), w.view(), dx.view(), o);
    linear_wgrad(r, dy.view(), x.view(), dw.view(), 0.0f, o);
    linear_dgrad_wgrad(r, dy.view(), w.view(), dx2.view(), x.view(), nullptr, dw2.view(), 0.0f, o);
    expect_equal(dx2, dx, "dX");
    expect_equal(dw2, dw, "dW");
    if (!wgrad_reads_quantized_x(r)) continue;
    // With X's kept copy, and beta = 1 accumulating onto the first result.
    Tensor y = Tensor::empty({m, n}, DType::kF32, Device::kCpu);
    quant::QuantizedTensor saved;
    linear_fprop_saving_x(r, x.view(), w.view(), y.view(), saved, o);
    Tensor dx3 = Tensor::empty({m, k}, DType::kF32, Device::kCpu), dw3 = dw.to(Device::kCpu);
    linear_dgrad_wgrad(r, dy.view(), w.view(), dx3.view(), TensorView{}, &saved, dw3.view(), 1.0f, o);
    expect_equal(dx3, dx, "dX (saved X)");
    for (int64_t i = 0; i < n * k; ++i) ASSERT_EQ(dw3.ptr<float>()[i], 2.0f * dw.ptr<float>()[i]) << i;
  }
}

struct ErrorStats {
  double relative_error, relative_bias;
};

// Against the float64 GEMM C = A . B^T of the unquantized f32 sources ([M, K] . [N, K]^T).
ErrorStats stats_vs_exact(const Tensor& got, const Tensor& a, const Tensor& b, bool a_transposed,
                          bool b_transposed, int64_t m, int64_t n, int64_t k) {
  const float* pa = a.ptr<float>();
  const float* pb = b.ptr<float>();
  double err2 = 0, ref2 = 0, bias = 0, abs_sum = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t l = 0; l < k; ++l) {
        acc += (double)(a_transposed ? pa[l * m + i] : pa[i * k + l]) *
               (double)(b_transposed ? pb[l * n + j] : pb[j * k + l]);
      }
      const double d = got.ptr<float>()[i * n + j] - acc;
      err2 += d * d;
      ref2 += acc * acc;
      bias += (acc >= 0 ? d : -d);
      abs_sum += std::fabs(acc);
    }
  return {std::sqrt(err2 / ref2), bias / abs_sum};
}

TEST(GemmLinear, QuantizationErrorReport) {
  const int64_t m = 256, n = 128, k = 512;
  const Tensor x = random_matrix(m, k, 11), w = random_matrix(n, k, 12), dy = random_matrix(m, n, 13);
  LinearOptions o;
  o.sr = {5, 0};
  std::printf("%-10s %-6s %12s %12s\n", "recipe", "gemm", "rel.error", "rel.bias");
  for (const NamedRecipe& nr : recipes()) {
    Tensor y = Tensor::empty({m, n}, DType::kF32, Device::kCpu);
    Tensor dx = Tensor::empty({m, k}, DType::kF32, Device::kCpu);
    Tensor dw = Tensor::empty({n, k}, DType::kF32, Device::kCpu);
    linear_fprop(nr.recipe, x.view(), w.view(), y.view(), o);
    linear_dgrad(nr.recipe, dy.view(), w.view(), dx.view(), o);
    linear_wgrad(nr.recipe, dy.view(), x.view(), dw.view(), 0.0f, o);
    const ErrorStats s[3] = {stats_vs_exact(y, x, w, false, false, m, n, k),
                             stats_vs_exact(dx, dy, w, false, true, m, k, n),
                             stats_vs_exact(dw, dy, x, true, true, n, k, m)};
    const char* gemms[3] = {"fprop", "dgrad", "wgrad"};
    const bool plain = std::string(nr.name) == "plain";
    const double max_error = plain ? 1e-5 : std::string(nr.name) == "nvfp4" ? 0.25 : 0.08;
    for (int i = 0; i < 3; ++i) {
      std::printf("%-10s %-6s %12.4e %12.3e\n", nr.name, gemms[i], s[i].relative_error, s[i].relative_bias);
      EXPECT_LT(s[i].relative_error, max_error) << nr.name << " " << gemms[i];
      if (!plain) {
        EXPECT_GT(s[i].relative_error, 1e-4) << nr.name << " " << gemms[i] << ": was anything quantized?";
      }
      EXPECT_LT(std::fabs(s[i].relative_bias), 0.05) << nr.name << " " << gemms[i];
    }
  }
}

}  // namespace
}  // namespace fourbit::gemm
