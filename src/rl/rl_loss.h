// The RL policy-gradient loss of rl_trainer.h as pure functions over per-token log-probabilities
// (host doubles), so that every formula is tested on its own (tests/test_rl_trainer_loss.cpp).
//
// Per sampled token j of the batch (n tokens), with advantage A_j of its completion:
//   importance (held constant, from the first epoch's trainer log-probs lp_old):
//     rho_j = exp(lp_old_j - lp_sampler_j)
//     truncate: w_j = min(rho_j, is_cap)      (clipped_j = rho_j > is_cap)
//     mask:     w_j = 1 if mask_low <= rho_j <= is_cap, else 0 and the token leaves the denominator
//     none:     w_j = 1
//   denominator N = the tokens not masked (at least 1)
//   surrogate, one epoch (on-policy):   L = - sum_j w_j A_j lp_j / N
//   surrogate, PPO (ppo = true): r_j = exp(lp_j - lp_old_j),
//     L = - sum_j w_j min(r_j A_j, clip(r_j, 1 - clip_low, 1 + clip_high) A_j) / N
//   KL to the reference (kl_coef > 0, lp_ref given): + kl_coef sum_j k3_j / N,
//     k3_j = exp(lp_ref_j - lp_j) - (lp_ref_j - lp_j) - 1
// The per-token weight handed to the weighted cross-entropy backward is dL / d(-lp_j) (the token
// loss is -lp_j):
//   on-policy: w_j A_j / N;  PPO: w_j A_j r_j / N unless clipped (A > 0 and r > 1 + clip_high, or
//   A < 0 and r < 1 - clip_low: 0);  KL adds -kl_coef (1 - exp(lp_ref_j - lp_j)) / N.
// Mismatch metrics (RL.md) from lp_old and lp_sampler: K3 = mean(rho - log rho - 1), max and mean
// |lp_old - lp_sampler|.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace fourbit::rl {

enum class ImportanceMode : uint8_t { kTruncate, kMask, kNone };
std::string_view importance_mode_name(ImportanceMode m);      // "truncate", "mask", "none"
ImportanceMode parse_importance_mode(std::string_view name);  // throws listing the names

struct LossOptions {
  ImportanceMode importance = ImportanceMode::kTruncate;
  double is_cap = 2.0;
  double mask_low = 0.5;
  bool ppo = false;
  double clip_low = 0.2, clip_high = 0.2;
  double kl_coef = 0.0;
};

// The constant importance weights and the mismatch metrics of one rollout batch.
struct ImportanceWeights {
  std::vector<double> w;    // [n]; 0 for masked tokens
  double denominator = 1;   // N: tokens kept (at least 1)
  int64_t clipped = 0;      // truncated or masked tokens
  double k3 = 0, max_abs_diff = 0, mean_abs_diff = 0;
};
// lp_old, lp_sampler: [n].
ImportanceWeights importance_weights(std::span<const double> lp_old, std::span<const double> lp_sampler,
                                     const LossOptions& options);

struct TokenWeights {
  std::vector<double> weight;  // [n] dL / d(-lp_j)
  double loss = 0;             // L
  int64_t ppo_clipped = 0;
  double kl_ref = 0;           // mean k3 to the reference (0 without one)
};
// lp (current trainer), lp_old (first epoch), advantage: [n]; lp_ref: [n] or empty (no KL term).
TokenWeights token_weights(std::span<const double> lp, std::span<const double> lp_old,
                           std::span<const double> advantage, std::span<const double> lp_ref,
                           const ImportanceWeights& importance, const LossOptions& options);

}  // namespace fourbit::rl
