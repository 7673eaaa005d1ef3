// The RL policy-gradient loss (rl_loss.h): importance weights, mismatch metrics, and the per-token
// weights and value of the surrogate.
#include "rl/rl_loss.h"

#include "core/check.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace fourbit::rl {

std::string_view importance_mode_name(ImportanceMode m) {
  switch (m) {
    case ImportanceMode::kTruncate: return "truncate";
    case ImportanceMode::kMask: return "mask";
    case ImportanceMode::kNone: return "none";
  }
  return "?";
}

ImportanceMode parse_importance_mode(std::string_view name) {
  if (name == "truncate") return ImportanceMode::kTruncate;
  if (name == "mask") return ImportanceMode::kMask;
  if (name == "none") return ImportanceMode::kNone;
  throw Error(fmt::format("unknown importance mode '{}'; use truncate, mask or none", name));
}

ImportanceWeights importance_weights(std::span<const double> lp_old, std::span<const double> lp_sampler,
                                     const LossOptions& o) {
  FOURBIT_CHECK(lp_old.size() == lp_sampler.size(), "importance_weights: {} trainer and {} sampler log-probs",
                lp_old.size(), lp_sampler.size());
  const size_t n = lp_old.size();
  ImportanceWeights r;
  r.w.resize(n);
  int64_t kept = 0;
  for (size_t j = 0; j < n; ++j) {
    const double d = lp_old[j] - lp_sampler[j], rho = std::exp(d);
    r.k3 += rho - d - 1;
    r.max_abs_diff = std::max(r.max_abs_diff, std::fabs(d));
    r.mean_abs_diff += std::fabs(d);
    switch (o.importance) {
      case ImportanceMode::kTruncate:
        r.w[j] = std::min(rho, o.is_cap);
        r.clipped += rho > o.is_cap;
        ++kept;
        break;
      case ImportanceMode::kMask: {
        const bool in = rho >= o.mask_low && rho <= o.is_cap;
        r.w[j] = in ? 1.0 : 0.0;
        r.clipped += !in;
        kept += in;
        break;
      }
      case ImportanceMode::kNone:
        r.w[j] = 1.0;
        ++kept;
        break;
    }
  }
  if (n > 0) {
    r.k3 /= (double)n;
    r.mean_abs_diff /= (double)n;
  }
  r.denominator = (double)std::max<int64_t>(kept, 1);
  return r;
}

TokenWeights token_weights(std::span<const double> lp, std::span<const double> lp_old,
                           std::span<const double> advantage, std::span<const double> lp_ref,
                           const ImportanceWeights& iw, const LossOptions& o) {
  const size_t n = lp.size();
  FOURBIT_CHECK(lp_old.size() == n && advantage.size() == n && iw.w.size() == n &&
                    (lp_ref.empty() || lp_ref.size() == n),
                "token_weights: sizes differ (lp {}, lp_old {}, advantage {}, importance {}, lp_ref {})", n,
                lp_old.size(), advantage.size(), iw.w.size(), lp_ref.size());
  const bool kl = o.kl_coef > 0 && !lp_ref.empty();
  TokenWeights t;
  t.weight.assign(n, 0.0);
  for (size_t j = 0; j < n; ++j) {
    if (kl) t.kl_ref += std::exp(lp_ref[j] - lp[j]) - (lp_ref[j] - lp[j]) - 1;
    if (iw.w[j] == 0 && o.importance == ImportanceMode::kMask) continue;  // masked: out of the loss
    const double A = advantage[j], w = iw.w[j];
    double g, value;
    if (o.ppo) {
      const double r = std::exp(lp[j] - lp_old[j]);
      const double rc = std::clamp(r, 1 - o.clip_low, 1 + o.clip_high);
      const bool clip = (A > 0 && r > 1 + o.clip_high) || (A < 0 && r < 1 - o.clip_low);
      t.ppo_clipped += clip;
      g = clip ? 0.0 : w * A * r;
      value = -w * std::min(r * A, rc * A);
    } else {
      g = w * A;
      value = -w * A * lp[j];
    }
    if (kl) {
      const double dref = lp_ref[j] - lp[j];
      g += -o.kl_coef * (1 - std::exp(dref));
      value += o.kl_coef * (std::exp(dref) - dref - 1);
    }
    t.weight[j] = g / iw.denominator;
    t.loss += value / iw.denominator;
  }
  if (kl && n > 0) t.kl_ref /= (double)n;
  return t;
}

}  // namespace fourbit::rl
