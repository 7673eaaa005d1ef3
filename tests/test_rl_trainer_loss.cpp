// rl loss (cpu): the importance weights (truncate, mask, none) and mismatch metrics against hand
// computations; the per-token weights of the on-policy, PPO and KL terms against float64 central
// differences of the returned loss (weight_j = dL / d(-lp_j)); PPO clipping cases.
#include "rl/rl_loss.h"

#include "core/error.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace fourbit::rl {
namespace {

TEST(RlLoss, ImportanceWeightsHandComputed) {
  // rho = 0.4, 1, 3, 0.6 (lp_old - lp_sampler = log rho).
  const std::vector<double> rho = {0.4, 1.0, 3.0, 0.6};
  std::vector<double> lp_s = {-1.0, -2.0, -0.5, -3.0}, lp_old(4);
  for (size_t j = 0; j < 4; ++j) lp_old[j] = lp_s[j] + std::log(rho[j]);
  LossOptions o;
  ImportanceWeights t = importance_weights(lp_old, lp_s, o);
  EXPECT_NEAR(t.w[0], 0.4, 1e-14);
  EXPECT_NEAR(t.w[1], 1.0, 1e-14);
  EXPECT_NEAR(t.w[2], 2.0, 1e-14);  // truncated at C = 2
  EXPECT_NEAR(t.w[3], 0.6, 1e-14);
  EXPECT_EQ(t.clipped, 1);
  EXPECT_EQ(t.denominator, 4.0);
  double k3 = 0;
  for (double r : rho) k3 += r - std::log(r) - 1;
  EXPECT_NEAR(t.k3, k3 / 4, 1e-14);
  EXPECT_NEAR(t.max_abs_diff, std::log(3.0), 1e-14);
  EXPECT_NEAR(t.mean_abs_diff, (std::fabs(std::log(0.4)) + std::log(3.0) + std::fabs(std::log(0.6))) / 4, 1e-14);
  o.importance = ImportanceMode::kMask;  // keep [0.5, 2]: tokens 1 and 3
  t = importance_weights(lp_old, lp_s, o);
  EXPECT_EQ(t.w, (std::vector<double>{0, 1, 0, 1}));
  EXPECT_EQ(t.clipped, 2);
  EXPECT_EQ(t.denominator, 2.0);
  o.importance = ImportanceMode::kNone;
  t = importance_weights(lp_old, lp_s, o);
  EXPECT_EQ(t.w, (std::vector<double>{1, 1, 1, 1}));
  EXPECT_EQ(t.clipped, 0);
  // Equal log-probs: K3 0, weight 1.
  t = importance_weights(lp_s, lp_s, LossOptions{});
  EXPECT_EQ(t.k3, 0.0);
  EXPECT_EQ(t.w, (std::vector<double>{1, 1, 1, 1}));
  EXPECT_EQ(parse_importance_mode("none"), ImportanceMode::kNone);
  EXPECT_THROW(parse_importance_mode("cap"), Error);
}

// dL/d lp_j by central differences, compared with -weight_j.
void check_gradient(const std::vector<double>& lp0, const std::vector<double>& lp_old, const std::vector<double>& adv,
                    const std::vector<double>& lp_ref, const ImportanceWeights& iw, const LossOptions& o) {
  const TokenWeights t = token_weights(lp0, lp_old, adv, lp_ref, iw, o);
  for (size_t j = 0; j < lp0.size(); ++j) {
    const double h = 1e-6;
    std::vector<double> lp = lp0;
    lp[j] += h;
    const double up = token_weights(lp, lp_old, adv, lp_ref, iw, o).loss;
    lp[j] -= 2 * h;
    const double down = token_weights(lp, lp_old, adv, lp_ref, iw, o).loss;
    EXPECT_NEAR(-(up - down) / (2 * h), t.weight[j], 1e-7) << "token " << j;
  }
}

TEST(RlLoss, WeightsAreTheLossGradient) {
  const std::vector<double> lp_s = {-1.2, -0.3, -2.5, -0.9, -1.7, -0.05};
  const std::vector<double> lp_old = {-1.1, -0.35, -2.4, -1.3, -1.75, -0.06};
  const std::vector<double> adv = {0.5, -0.25, 0.5, -0.75, 0.0, 0.25};
  const std::vector<double> lp_ref = {-1.0, -0.5, -2.0, -1.0, -1.5, -0.1};
  for (ImportanceMode mode : {ImportanceMode::kTruncate, ImportanceMode::kMask, ImportanceMode::kNone}) {
    for (bool ppo : {false, true}) {
      for (double kl : {0.0, 0.3}) {
        SCOPED_TRACE(::testing::Message() << importance_mode_name(mode) << " ppo " << ppo << " kl " << kl);
        LossOptions o;
        o.importance = mode;
        o.ppo = ppo;
        o.kl_coef = kl;
        const ImportanceWeights iw = importance_weights(lp_old, lp_s, o);
        // At lp = lp_old (first epoch) and away from it (later PPO epochs, inside the clip range).
        std::vector<double> lp = lp_old;
        check_gradient(lp, lp_old, adv, kl > 0 ? lp_ref : std::vector<double>{}, iw, o);
        for (size_t j = 0; j < lp.size(); ++j) lp[j] += 0.05 * std::sin(3.0 * (double)j);
        check_gradient(lp, lp_old, adv, kl > 0 ? lp_ref : std::vector<double>{}, iw, o);
      }
    }
  }
}

TEST(RlLoss, OnPolicyWeightsAndPpoClipping) {
  const std::vector<double> lp_old = {-1.0, -1.0, -1.0, -1.0};
  const ImportanceWeights iw = importance_weights(lp_old, lp_old, LossOptions{});
  const std::vector<double> adv = {1.0, 1.0, -1.0, -1.0};
  // On-policy: w A / N = A / 4; loss = -sum A lp / 4 = 0 for these advantages.
  TokenWeights t = token_weights(lp_old, lp_old, adv, {}, iw, LossOptions{});
  EXPECT_EQ(t.weight, (std::vector<double>{0.25, 0.25, -0.25, -0.25}));
  EXPECT_NEAR(t.loss, 0.0, 1e-15);
  // PPO, eps 0.2: r = e^0.3 (> 1.2) clips for A > 0, e^-0.3 (< 0.8) clips for A < 0.
  LossOptions o;
  o.ppo = true;
  const std::vector<double> lp = {-0.7, -1.3, -1.3, -0.7};  // r = e^.3, e^-.3, e^-.3, e^.3
  t = token_weights(lp, lp_old, adv, {}, iw, o);
  EXPECT_EQ(t.weight[0], 0.0) << "A > 0 and r > 1 + eps: clipped";
  EXPECT_NEAR(t.weight[1], std::exp(-0.3) / 4, 1e-15) << "A > 0 and r < 1: not clipped";
  EXPECT_EQ(t.weight[2], 0.0) << "A < 0 and r < 1 - eps: clipped";
  EXPECT_NEAR(t.weight[3], -std::exp(0.3) / 4, 1e-15) << "A < 0 and r > 1: not clipped";
  EXPECT_EQ(t.ppo_clipped, 2);
  // clip_high 0.28 (DAPO's asymmetric range): r = e^0.22 = 1.246 is inside [0.8, 1.28].
  o.clip_high = 0.28;
  const std::vector<double> lp2 = {-0.78, -1.0, -1.0, -1.0};  // r0 = e^0.22 = 1.246
  t = token_weights(lp2, lp_old, adv, {}, iw, o);
  EXPECT_NEAR(t.weight[0], std::exp(0.22) / 4, 1e-15) << "inside [0.8, 1.28]";
  // KL: at lp = lp_ref the KL term has no gradient and k3 = 0.
  LossOptions k;
  k.kl_coef = 0.5;
  t = token_weights(lp_old, lp_old, adv, lp_old, iw, k);
  EXPECT_EQ(t.kl_ref, 0.0);
  EXPECT_EQ(t.weight, (std::vector<double>{0.25, 0.25, -0.25, -0.25}));
  // Size mismatch: an error naming the sizes.
  EXPECT_THROW(token_weights(lp_old, lp_old, std::vector<double>{1.0}, {}, iw, LossOptions{}), Error);
}

}  // namespace
}  // namespace fourbit::rl
