// model gradient checks (cpu): the explicit backward of small dense and MoE models against float64
// central finite differences of the forward's objective (ce + aux_loss_coef * aux +
// z_loss_coef * z), for EVERY parameter tensor: every element of the small tensors (norms, the
// router) and 6 seeded elements of each larger one.
//
// Tolerance: |numeric - analytic| <= 1e-6 * max(|numeric|, |analytic|) + 1e-6 * max|analytic of
// the tensor| (the helper of the ops tests). Central differences with h = 1e-5 |x| have a truncation
// error of h^2 |f'''| / 6 (~1e-10 here) and a rounding error of ~1e-16 |loss| / h (~4e-11), both far
// below that.
//
// The router's top-k selection (and the aux loss's token counts) are piecewise constant in the
// parameters: a perturbation that changes any token's experts is detected (the routing of the
// perturbed forwards is compared with the unperturbed one) and that element is skipped; the test
// requires that almost none are.
#include "model/model.h"

#include "model_test_util.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

namespace fourbit::model {
namespace {

using testing::make_batch;
using testing::resolved;
using testing::small_dense;
using testing::small_moe;
using testing::values;

constexpr int kB = 2, kT = 6;

std::vector<int32_t> routing(const Model& m) {
  if (!m.config().is_moe()) return {};
  Tensor ids = Tensor::empty({kB * kT, m.config().n_moe_layers(), m.config().moe.top_k}, DType::kI32, Device::kCpu);
  m.expert_ids(ids.view());
  return std::vector<int32_t>(ids.ptr<int32_t>(), ids.ptr<int32_t>() + ids.numel());
}

struct CheckStats {
  int64_t checked = 0, skipped = 0;
};

// Checks every trainable tensor of `m` on `batch`. `options` are passed to every forward.
CheckStats check_all_gradients(Model& m, const testing::Batch& batch, const ForwardOptions& options) {
  CheckStats stats;
  m.zero_grads();
  const LossInfo base = m.forward(batch.tokens, batch.targets, options);
  EXPECT_TRUE(std::isfinite(base.loss));
  const std::vector<int32_t> base_routing = routing(m);
  m.backward();
  auto loss_at = [&](std::vector<int32_t>* ids) {
    const double l = m.forward(batch.tokens, batch.targets, options).loss;
    if (ids) *ids = routing(m);
    return l;
  };
  const RandomStream pick{99, 1};
  for (int i = 0; i < m.table().size(); ++i) {
    const ParamSpec& p = m.table().row(i);
    if (!p.trainable) continue;
    const std::vector<double> analytic = values(m.grads().view(i));
    double scale = 0;
    for (double a : analytic) scale = std::max(scale, std::fabs(a));
    EXPECT_GT(scale, 0.0) << p.name << ": the gradient is identically zero";
    std::vector<int64_t> idx;
    if (p.numel() <= 48) {
      for (int64_t j = 0; j < p.numel(); ++j) idx.push_back(j);
    } else {
      for (int j = 0; j < 6; ++j) idx.push_back((int64_t)(pick.block((uint64_t)(i * 16 + j)).v[0] % (uint64_t)p.numel()));
    }
    double* x = m.params().view(i).ptr<double>();
    int bad = 0;
    std::string first_bad;
    double worst_rel = 0;
    for (int64_t j : idx) {
      const double x0 = x[j];
      const double h = 1e-5 * std::max(1.0, std::fabs(x0));
      std::vector<int32_t> ids_p, ids_m;
      x[j] = x0 + h;
      const double lp = loss_at(&ids_p);
      x[j] = x0 - h;
      const double lm = loss_at(&ids_m);
      x[j] = x0;
      if (ids_p != base_routing || ids_m != base_routing) {
        ++stats.skipped;
        continue;
      }
      ++stats.checked;
      const double num = (lp - lm) / (2 * h), ana = analytic[(size_t)j];
      const double tol = 1e-6 * std::max(std::fabs(num), std::fabs(ana)) + 1e-6 * scale;
      worst_rel = std::max(worst_rel, std::fabs(num - ana) / std::max(scale, 1e-300));
      if (!(std::fabs(num - ana) <= tol)) {
        if (bad++ == 0)
          first_bad = "element " + std::to_string(j) + ": analytic " + std::to_string(ana) +
                      ", numeric " + std::to_string(num);
      }
    }
    EXPECT_EQ(bad, 0) << p.name << ": " << bad << " of " << idx.size()
                      << " gradient elements differ from central differences; first: " << first_bad
                      << " (max |num - ana| / max|ana| = " << worst_rel << ")";
  }
  return stats;
}

ModelOptions f64_options(uint64_t seed) {
  ModelOptions o;
  o.cpu_dtype = DType::kF64;
  o.seed = seed;
  o.max_batch = kB;
  o.max_seq = kT;
  return o;
}

// Norm weights away from one (their gradients are then generic) and, when present, a router bias.
void perturb_unit_params(Model& m, uint64_t seed) {
  const RandomStream rs{seed, 3};
  for (int i = 0; i < m.table().size(); ++i) {
    const ParamSpec& p = m.table().row(i);
    if (p.kind != ParamKind::kNorm && p.kind != ParamKind::kRouterBias) continue;
    double* x = m.params().view(i).ptr<double>();
    for (int64_t j = 0; j < p.numel(); ++j)
      x[j] += (p.kind == ParamKind::kNorm ? 0.3 : 0.05) * ((double)rs.uniform_at((uint64_t)(i * 1000 + j)) - 0.5);
  }
}

TEST(ModelGradients, DenseTiedEmbeddings) {
  const ModelConfig c = small_dense(true);
  Model m(c, resolved(c), f64_options(1));
  perturb_unit_params(m, 1);
  const CheckStats s = check_all_gradients(m, make_batch(kB, kT, c.vocab, 11), {});
  EXPECT_GT(s.checked, 100);
  EXPECT_EQ(s.skipped, 0);
}

TEST(ModelGradients, DenseUntiedLmHead) {
  const ModelConfig c = small_dense(false);
  Model m(c, resolved(c), f64_options(2));
  perturb_unit_params(m, 2);
  const CheckStats s = check_all_gradients(m, make_batch(kB, kT, c.vocab, 12), {});
  EXPECT_GT(s.checked, 100);
}

TEST(ModelGradients, MoeWithAuxAndZLossAndSharedExpert) {
  const ModelConfig c = small_moe(LoadBalancing::kAuxLoss, 1);
  Model m(c, resolved(c), f64_options(3));
  perturb_unit_params(m, 3);
  const CheckStats s = check_all_gradients(m, make_batch(kB, kT, c.vocab, 13), {});
  EXPECT_GT(s.checked, 100);
  EXPECT_LE(s.skipped, s.checked / 20) << "too many perturbations changed the routing";
}

TEST(ModelGradients, MoeWithSelectionBiasNoSharedExpert) {
  const ModelConfig c = small_moe(LoadBalancing::kBias, 0);
  Model m(c, resolved(c), f64_options(4));
  perturb_unit_params(m, 4);
  const CheckStats s = check_all_gradients(m, make_batch(kB, kT, c.vocab, 14), {});
  EXPECT_GT(s.checked, 100);
  EXPECT_LE(s.skipped, s.checked / 20);
}

TEST(ModelGradients, MoeUnderRoutingReplay) {
  // Forced expert ids (RL routing replay): the gates still come from the router's logits, so the
  // router gets gradients; the routing never changes, so nothing is skipped.
  const ModelConfig c = small_moe(LoadBalancing::kAuxLoss, 1);
  Model m(c, resolved(c), f64_options(5));
  perturb_unit_params(m, 5);
  Tensor forced = Tensor::empty({kB * kT, 1, 2}, DType::kI32, Device::kCpu);
  for (int n = 0; n < kB * kT; ++n) {
    forced.ptr<int32_t>()[2 * n] = n % 4;
    forced.ptr<int32_t>()[2 * n + 1] = (n + 1 + n / 4) % 4;
  }
  ForwardOptions o;
  o.forced_expert_ids = forced;
  const CheckStats s = check_all_gradients(m, make_batch(kB, kT, c.vocab, 15), o);
  EXPECT_EQ(s.skipped, 0);
  m.forward(make_batch(kB, kT, c.vocab, 15).tokens, make_batch(kB, kT, c.vocab, 15).targets, o);
  EXPECT_EQ(routing(m), std::vector<int32_t>(forced.ptr<int32_t>(), forced.ptr<int32_t>() + forced.numel()));
}

TEST(ModelGradients, ObjectiveCombinesTheLosses) {
  const ModelConfig c = small_moe(LoadBalancing::kAuxLoss, 1);
  Model m(c, resolved(c), f64_options(6));
  const testing::Batch b = make_batch(kB, kT, c.vocab, 16);
  const LossInfo info = m.forward(b.tokens, b.targets);
  EXPECT_NEAR(info.ce, std::log((double)c.vocab), 0.1);  // an untrained model is near uniform
  EXPECT_NEAR(info.aux, c.moe.top_k, 0.5);                // near balance: aux ~ k
  EXPECT_GT(info.z, 0.0);
  EXPECT_DOUBLE_EQ(info.loss, info.ce + c.moe.aux_loss_coef * info.aux + c.moe.z_loss_coef * info.z);
  int64_t valid = 0;
  for (int i = 0; i < kB * kT; ++i) valid += b.targets.ptr<int32_t>()[i] >= 0;
  EXPECT_EQ(info.n_valid, valid);
}

}  // namespace
}  // namespace fourbit::model
