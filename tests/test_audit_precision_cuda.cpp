// The precision audit of a CUDA model (gpu label): the observer sees device tensors (bf16
// activations, the bf16 weight copy), copies them after a synchronization and measures on the
// host. Compared with the CPU model that mirrors the CUDA roundings (cpu_bf16_rounding) and holds
// the same weights: the weight operands are the same bf16 values on both sides, so their errors
// agree to rounding; activations and gradients differ by the devices' FP32 summation orders only,
// so their errors agree to a few percent.
#include "audit/audit.h"

#include "model_test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>

namespace fourbit::audit {
namespace {

TEST(AuditCuda, MatchesTheCpuMirror) {
  const model::ModelConfig c = model::preset("tiny");
  recipe::Recipe r = recipe::preset("nvfp4");
  const int B = 2, T = 64;  // 128 tokens: a multiple of the quantize kernels' 64-row tile
  const auto batch = model::testing::make_batch(B, T, c.vocab, 12);
  AuditReport reports[2];
  for (int d = 0; d < 2; ++d) {
    model::ModelOptions o;
    o.device = d == 0 ? Device::kCpu : Device::kCuda;
    o.cpu_bf16_rounding = d == 0;
    o.seed = 4;
    o.max_batch = B;
    o.max_seq = T;
    model::Model m(c, recipe::resolve(r, c.recipe_shape()), o);
    AuditOptions ao;
    ao.stages = {recipe::Stage::kPretrainForward, recipe::Stage::kPretrainBackward, recipe::Stage::kRlSampler};
    reports[d] = run_audit(m, batch.tokens, batch.targets, ao, "nvfp4");
  }
  ASSERT_EQ(reports[0].gemms.size(), reports[1].gemms.size());
  for (size_t i = 0; i < reports[0].gemms.size(); ++i) {
    const GemmAudit& a = reports[0].gemms[i];
    const GemmAudit& g = reports[1].gemms[i];
    SCOPED_TRACE(a.layer + " " + std::string(recipe::gemm_name(a.gemm)) + " " +
                 std::string(recipe::stage_name(a.stage)));
    ASSERT_EQ(a.layer, g.layer);
    ASSERT_EQ(a.gemm, g.gemm);
    for (int k = 0; k < 2; ++k) {
      const OperandAudit& x = k == 0 ? a.a : a.b;
      const OperandAudit& y = k == 0 ? g.a : g.b;
      EXPECT_EQ(x.format, y.format);
      if (x.operand == recipe::Operand::kWeight) {
        EXPECT_NEAR(y.stats.rel_error(), x.stats.rel_error(), 1e-6 * x.stats.rel_error() + 1e-12);
      } else if (x.operand == recipe::Operand::kGradient) {
        // Gradients are stochastically rounded: the draws are the same on both devices, but the
        // gradients themselves differ in their last BF16 bits (attention and norm backward run in
        // another order), which moves the per-tensor amax and so which draws round which values;
        // the measured error is then another sample of the same distribution (H200: 4.6% apart on
        // a tensor of the tiny model), not the same number.
        EXPECT_NEAR(y.stats.rel_error(), x.stats.rel_error(), 0.1 * x.stats.rel_error() + 1e-9);
      } else {
        EXPECT_NEAR(y.stats.rel_error(), x.stats.rel_error(), 0.03 * x.stats.rel_error() + 1e-9);
      }
    }
    EXPECT_NEAR(g.output.rel_error(), a.output.rel_error(), 0.05 * a.output.rel_error() + 1e-6);
  }
}

}  // namespace
}  // namespace fourbit::audit
