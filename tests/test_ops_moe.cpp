// ops moe (cpu): the CPU reference of the MoE router and token permutation against hand-computed
// cases (top-k, ties, selection bias, forced ids, losses, stable plan with and without padding,
// empty experts), float64 central finite differences for every backward (router with and without
// the aux and z losses, bias, forced ids, k = 1 and k = E; un-permute w.r.t. y_perm and gates;
// permute w.r.t. x) and for a whole MoE block composed from these ops, plus edge cases and errors.
#include "ops/moe.h"

#include "dense_ops_test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

namespace fourbit::ops {
namespace {

using testing::all_close;
using testing::check_gradient;
using testing::host_ints;
using testing::host_tensor;
using testing::random_normal;
using testing::values_of;

std::vector<int32_t> ints_of(const Tensor& t) {
  return std::vector<int32_t>(t.ptr<int32_t>(), t.ptr<int32_t>() + t.numel());
}

void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

auto tight = [](int64_t) { return 1e-14; };

struct Router {
  Tensor probs, ids, gates, counts, losses;
  RouterOutputs outputs() const { return {probs, ids, gates, counts, losses}; }
};

Router make_router(int64_t N, int64_t E, int64_t k, DType dt = DType::kF64) {
  return {Tensor::empty({N, E}, dt, Device::kCpu), Tensor::empty({N, k}, DType::kI32, Device::kCpu),
          Tensor::empty({N, k}, dt, Device::kCpu), Tensor::empty({E}, DType::kI32, Device::kCpu),
          Tensor::empty({2}, dt, Device::kCpu)};
}

Router run_router(const Tensor& logits, int k, const TensorView& bias = {},
                  const TensorView& forced = {}) {
  Router r = make_router(logits.shape()[0], logits.shape()[1], k, logits.dtype());
  RouterOptions o;
  o.top_k = k;
  o.selection_bias = bias;
  o.forced_ids = forced;
  router_forward(logits, o, r.outputs());
  return r;
}

// Independent float64 losses from the definitions in moe.h.
std::pair<double, double> losses_by_hand(const std::vector<double>& logits, int64_t N, int64_t E,
                                         const std::vector<int32_t>& counts) {
  double aux = 0, z = 0;
  std::vector<double> mean_p((size_t)E, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    double s = 0;
    for (int64_t e = 0; e < E; ++e) s += std::exp(logits[(size_t)(n * E + e)]);
    for (int64_t e = 0; e < E; ++e) mean_p[(size_t)e] += std::exp(logits[(size_t)(n * E + e)]) / s / (double)N;
    z += std::log(s) * std::log(s) / (double)N;
  }
  for (int64_t e = 0; e < E; ++e) aux += (double)E * ((double)counts[(size_t)e] / (double)N) * mean_p[(size_t)e];
  return {aux, z};
}

TEST(OpsMoeRouter, HandComputedTopTwoWithTiesBrokenByLowerId) {
  // Token 0: logits [1, 3, 2, 0] -> experts 1 then 2. Token 1: all equal -> experts 0 then 1.
  const std::vector<double> lg = {1, 3, 2, 0, 0, 0, 0, 0};
  const Router r = run_router(host_tensor({2, 4}, DType::kF64, lg), 2);
  EXPECT_EQ(ints_of(r.ids), (std::vector<int32_t>{1, 2, 0, 1}));
  EXPECT_EQ(ints_of(r.counts), (std::vector<int32_t>{1, 2, 1, 0}));
  const double s0 = std::exp(1) + std::exp(3) + std::exp(2) + 1;
  std::vector<double> probs = {std::exp(1) / s0, std::exp(3) / s0, std::exp(2) / s0, 1 / s0, .25, .25, .25, .25};
  EXPECT_TRUE(all_close(values_of(r.probs), probs, tight, "probs"));
  const double g1 = std::exp(3) / (std::exp(3) + std::exp(2));
  EXPECT_TRUE(all_close(values_of(r.gates), {g1, 1 - g1, 0.5, 0.5}, tight, "gates"));
  const auto [aux, z] = losses_by_hand(lg, 2, 4, ints_of(r.counts));
  EXPECT_TRUE(all_close(values_of(r.losses), {aux, z}, tight, "losses"));
}

TEST(OpsMoeRouter, SelectionBiasChangesTheChoiceButNotTheGates) {
  // Bias on expert 2 makes it win; the gates still renormalize the unbiased probs.
  const std::vector<double> lg = {2, 1, 0, 0};
  const Tensor logits = host_tensor({1, 4}, DType::kF64, lg);
  const Router r = run_router(logits, 2, host_tensor({4}, DType::kF64, {0, 0, 5, 0}));
  EXPECT_EQ(ints_of(r.ids), (std::vector<int32_t>{2, 0}));
  const double p0 = std::exp(2), p2 = std::exp(0);
  EXPECT_TRUE(all_close(values_of(r.gates), {p2 / (p0 + p2), p0 / (p0 + p2)}, tight, "gates"));
  // Ties created by the bias: experts 1 and 2 both at 1 -> 1 first.
  const Router t = run_router(host_tensor({1, 4}, DType::kF64, {0, 0, 0, 0}), 2,
                              host_tensor({4}, DType::kF64, {0, 1, 1, 0}));
  EXPECT_EQ(ints_of(t.ids), (std::vector<int32_t>{1, 2}));
  EXPECT_TRUE(all_close(values_of(t.gates), {0.5, 0.5}, tight, "tied gates"));
}

TEST(OpsMoeRouter, ForcedIdsAreUsedAsGivenWithGatesFromTheCurrentProbs) {
  const std::vector<double> lg = {3, 2, 1, 0, 0, 1, 2, 3};
  const Tensor logits = host_tensor({2, 4}, DType::kF64, lg);
  const Router r = run_router(logits, 2, {}, host_ints({2, 2}, {3, 0, 1, 2}));
  EXPECT_EQ(ints_of(r.ids), (std::vector<int32_t>{3, 0, 1, 2}));
  EXPECT_EQ(ints_of(r.counts), (std::vector<int32_t>{1, 1, 1, 1}));
  const double a = std::exp(0) / (std::exp(0) + std::exp(3)), b = std::exp(1) / (std::exp(1) + std::exp(2));
  EXPECT_TRUE(all_close(values_of(r.gates), {a, 1 - a, b, 1 - b}, tight, "gates"));
  const auto [aux, z] = losses_by_hand(lg, 2, 4, ints_of(r.counts));
  EXPECT_TRUE(all_close(values_of(r.losses), {aux, z}, tight, "losses"));
  expect_error([&] { run_router(logits, 2, {}, host_ints({2, 2}, {3, 7, 1, 2})); },
               "forced_ids[0, 1] = 7 is out of range");
  expect_error([&] { run_router(logits, 2, {}, host_ints({2, 2}, {3, 0, 2, 2})); },
               "forced_ids[1, 1] = 2 is repeated");
}

TEST(OpsMoeRouter, F32MatchesF64AndEmptyBatchGivesZeros) {
  const int64_t N = 9, E = 7;
  const std::vector<double> lg = random_normal(N * E, 5, 2.0);
  const Router a = run_router(host_tensor({N, E}, DType::kF64, lg), 3);
  const Router b = run_router(host_tensor({N, E}, DType::kF32, lg), 3);
  EXPECT_EQ(ints_of(a.ids), ints_of(b.ids));
  EXPECT_EQ(ints_of(a.counts), ints_of(b.counts));
  auto f32 = [](int64_t) { return 1e-6; };
  EXPECT_TRUE(all_close(values_of(b.gates), values_of(a.gates), f32, "gates"));
  EXPECT_TRUE(all_close(values_of(b.losses), values_of(a.losses), f32, "losses"));
  const Router e = run_router(Tensor::empty({0, E}, DType::kF64, Device::kCpu), 2);
  EXPECT_EQ(ints_of(e.counts), std::vector<int32_t>(E, 0));
  EXPECT_EQ(values_of(e.losses), (std::vector<double>{0, 0}));
}

// Float64 finite differences of L = sum(gates * W) + ga * aux + gz * z w.r.t. the logits.
void check_router_gradient(int64_t N, int64_t E, int k, uint64_t seed, float ga, float gz,
                           bool bias, bool forced) {
  SCOPED_TRACE(::testing::Message() << "N " << N << " E " << E << " k " << k << " aux " << ga
                                    << " z " << gz << (bias ? " bias" : "") << (forced ? " forced" : ""));
  Tensor logits = host_tensor({N, E}, DType::kF64, random_normal(N * E, seed, 1.5));
  const Tensor b = host_tensor({E}, DType::kF64, random_normal(E, seed + 1, 2.0));
  std::vector<int32_t> fids;
  for (int64_t n = 0; n < N; ++n)
    for (int j = 0; j < k; ++j) fids.push_back((int32_t)((n * 3 + j * 5 + 1) % E));  // distinct if gcd(5, E) = 1
  const Tensor f = host_ints({N, k}, fids);
  const TensorView bias_v = bias ? b.view() : TensorView{}, forced_v = forced ? f.view() : TensorView{};
  const std::vector<double> w = random_normal(N * k, seed + 2);
  const Router r = run_router(logits, k, bias_v, forced_v);
  Tensor d_logits = host_tensor({N, E}, DType::kF64, std::vector<double>((size_t)(N * E), std::nan("")));
  RouterSaved saved{logits, r.probs, r.ids, r.counts};
  router_backward(saved, host_tensor({N, k}, DType::kF64, w), RouterLossGrads{ga, gz}, d_logits);
  const std::vector<int32_t> ids0 = ints_of(r.ids);
  auto loss = [&] {
    const Router q = run_router(logits, k, bias_v, forced_v);
    EXPECT_EQ(ints_of(q.ids), ids0) << "the perturbation changed the selection";
    const std::vector<double> l = values_of(q.losses);
    return testing::dot(values_of(q.gates), w) + (double)ga * l[0] + (double)gz * l[1];
  };
  EXPECT_TRUE(check_gradient(loss, logits.ptr<double>(), logits.numel(), values_of(d_logits), "d_logits"));
}

TEST(OpsMoeRouter, BackwardMatchesFiniteDifferences) {
  check_router_gradient(5, 6, 2, 10, 0.0f, 0.0f, false, false);    // gates only
  check_router_gradient(5, 6, 2, 20, 0.7f, 0.0f, false, false);    // + aux
  check_router_gradient(5, 6, 2, 30, 0.0f, 0.3f, false, false);    // + z
  check_router_gradient(6, 7, 3, 40, 0.5f, 0.2f, true, false);     // all, with selection bias
  check_router_gradient(6, 7, 3, 50, 0.5f, 0.2f, false, true);     // all, routing replay
  check_router_gradient(4, 5, 1, 60, 0.4f, 0.1f, false, false);    // k = 1: gates are constant 1
  check_router_gradient(3, 4, 4, 70, 0.4f, 0.1f, false, false);    // k = E: every expert selected
  check_router_gradient(1, 3, 2, 80, 0.4f, 0.1f, false, false);    // a single token
}

struct Plan {
  Tensor offsets, slot_rows, row_slots;
  MoePlan view() const { return {offsets, slot_rows, row_slots}; }
};

Plan run_plan(const Tensor& ids, int E, int align, int64_t extra_rows = 0) {
  const int64_t N = ids.shape()[0], k = ids.shape()[1];
  const int64_t R = moe_permuted_rows(N, (int)k, E, align) + extra_rows;
  Plan p{Tensor::empty({E + 1}, DType::kI32, Device::kCpu), Tensor::empty({N, k}, DType::kI32, Device::kCpu),
         Tensor::empty({R}, DType::kI32, Device::kCpu)};
  moe_plan(ids, align, p.view());
  return p;
}

TEST(OpsMoePlan, StableOrderOffsetsAndEmptyExperts) {
  // ids [[2, 0], [2, 1], [0, 2]]: counts [2, 1, 3, 0]; expert 3 is empty.
  const Tensor ids = host_ints({3, 2}, {2, 0, 2, 1, 0, 2});
  const Plan p = run_plan(ids, 4, 1);
  EXPECT_EQ(ints_of(p.offsets), (std::vector<int32_t>{0, 2, 3, 6, 6}));
  // Expert 0: slots 1, 4; expert 1: slot 3; expert 2: slots 0, 2, 5 (token order, then slot).
  EXPECT_EQ(ints_of(p.row_slots), (std::vector<int32_t>{1, 4, 3, 0, 2, 5}));
  EXPECT_EQ(ints_of(p.slot_rows), (std::vector<int32_t>{3, 0, 4, 2, 1, 5}));
  // Groups padded to 4 rows: offsets [0, 4, 8, 12, 12], R = 6 + 4 * 3 = 18, padding rows -1.
  const Plan q = run_plan(ids, 4, 4);
  EXPECT_EQ(ints_of(q.offsets), (std::vector<int32_t>{0, 4, 8, 12, 12}));
  std::vector<int32_t> want(18, -1);
  want[0] = 1, want[1] = 4, want[4] = 3, want[8] = 0, want[9] = 2, want[10] = 5;
  EXPECT_EQ(ints_of(q.row_slots), want);
  EXPECT_EQ(ints_of(q.slot_rows), (std::vector<int32_t>{8, 0, 9, 4, 1, 10}));
  EXPECT_EQ(moe_group_sizes(std::vector<int32_t>{2, 1, 3, 0}, 4), (std::vector<int64_t>{4, 4, 4, 0}));
  // A token routed twice to the same expert (allowed in a plan: slots are distinct).
  const Plan d = run_plan(host_ints({1, 2}, {1, 1}), 2, 1);
  EXPECT_EQ(ints_of(d.offsets), (std::vector<int32_t>{0, 0, 2}));
  EXPECT_EQ(ints_of(d.slot_rows), (std::vector<int32_t>{0, 1}));
  // No tokens: offsets all zero; extra rows are padding.
  const Plan e = run_plan(Tensor::empty({0, 2}, DType::kI32, Device::kCpu), 3, 1, 2);
  EXPECT_EQ(ints_of(e.offsets), (std::vector<int32_t>{0, 0, 0, 0}));
  EXPECT_EQ(ints_of(e.row_slots), (std::vector<int32_t>{-1, -1}));
}

TEST(OpsMoePermute, RoundTripAndPaddingRows) {
  const int64_t N = 5, k = 2, C = 3;
  const int E = 3;
  const Tensor ids = host_ints({N, k}, {0, 2, 1, 0, 2, 1, 0, 1, 2, 0});
  const Plan p = run_plan(ids, E, 4);
  const std::vector<double> xv = random_normal(N * C, 3);
  const Tensor x = host_tensor({N, C}, DType::kF64, xv);
  const int64_t R = p.row_slots.numel();
  Tensor x_perm = host_tensor({R, C}, DType::kF64, std::vector<double>((size_t)(R * C), 9.0));
  moe_permute(x, p.view(), x_perm);
  const std::vector<double> xp = values_of(x_perm);
  const std::vector<int32_t> rs = ints_of(p.row_slots);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c)
      EXPECT_EQ(xp[(size_t)(r * C + c)], rs[(size_t)r] < 0 ? 0.0 : xv[(size_t)(rs[(size_t)r] / k * C + c)]) << r;
  // Un-permuting the permuted rows with gates that sum to 1 gives x back.
  const Tensor gates = host_tensor({N, k}, DType::kF64, {0.25, 0.75, 0.5, 0.5, 0.1, 0.9, 1, 0, 0.3, 0.7});
  Tensor y = Tensor::empty({N, C}, DType::kF64, Device::kCpu);
  moe_unpermute(x_perm, gates, p.view(), y);
  EXPECT_TRUE(all_close(values_of(y), xv, tight, "y"));
  // The permute backward of all-ones sums each token's k copies: k.
  Tensor dx = Tensor::empty({N, C}, DType::kF64, Device::kCpu);
  moe_permute_backward(host_tensor({R, C}, DType::kF64, std::vector<double>((size_t)(R * C), 1.0)), p.view(), dx);
  EXPECT_EQ(values_of(dx), std::vector<double>((size_t)(N * C), (double)k));
}

TEST(OpsMoePermute, BackwardsMatchFiniteDifferences) {
  for (int align : {1, 4}) {
    SCOPED_TRACE(::testing::Message() << "row_align " << align);
    const int64_t N = 4, k = 2, C = 3;
    const int E = 3;
    const Tensor ids = host_ints({N, k}, {2, 0, 2, 1, 0, 2, 1, 2});  // expert 1 twice, 2 four times
    const Plan p = run_plan(ids, E, align);
    const int64_t R = p.row_slots.numel();
    // Un-permute: L = sum(y * W) w.r.t. y_perm (padding rows included: gradient 0) and gates.
    Tensor y_perm = host_tensor({R, C}, DType::kF64, random_normal(R * C, 11));
    Tensor gates = host_tensor({N, k}, DType::kF64, random_normal(N * k, 12));
    const std::vector<double> w = random_normal(N * C, 13);
    Tensor y = Tensor::empty({N, C}, DType::kF64, Device::kCpu);
    auto loss = [&] {
      moe_unpermute(y_perm, gates, p.view(), y);
      return testing::dot(values_of(y), w);
    };
    Tensor d_y_perm = host_tensor({R, C}, DType::kF64, std::vector<double>((size_t)(R * C), std::nan("")));
    Tensor d_gates = host_tensor({N, k}, DType::kF64, std::vector<double>((size_t)(N * k), std::nan("")));
    moe_unpermute_backward(host_tensor({N, C}, DType::kF64, w), y_perm, gates, p.view(), d_y_perm, d_gates);
    EXPECT_TRUE(check_gradient(loss, y_perm.ptr<double>(), y_perm.numel(), values_of(d_y_perm), "d_y_perm"));
    EXPECT_TRUE(check_gradient(loss, gates.ptr<double>(), gates.numel(), values_of(d_gates), "d_gates"));
    // Permute: L = sum(x_perm * W) w.r.t. x.
    Tensor x = host_tensor({N, C}, DType::kF64, random_normal(N * C, 14));
    const std::vector<double> wp = random_normal(R * C, 15);
    Tensor x_perm = Tensor::empty({R, C}, DType::kF64, Device::kCpu);
    auto loss_p = [&] {
      moe_permute(x, p.view(), x_perm);
      return testing::dot(values_of(x_perm), wp);
    };
    Tensor dx = host_tensor({N, C}, DType::kF64, std::vector<double>((size_t)(N * C), std::nan("")));
    moe_permute_backward(host_tensor({R, C}, DType::kF64, wp), p.view(), dx);
    EXPECT_TRUE(check_gradient(loss_p, x.ptr<double>(), x.numel(), values_of(dx), "dx"));
  }
}

// A whole MoE block in float64 from these ops, with the expert GEMMs and the router GEMM as plain
// loops: y = unpermute(expert_e(permute(x))), experts y_e = x_e W_e^T, router logits = x Wr^T.
// Its backward, chained from the ops' backwards, must match finite differences w.r.t. x.
TEST(OpsMoeBlock, ComposedForwardAndBackwardMatchFiniteDifferences) {
  const int64_t N = 5, C = 4, F = 3;
  const int E = 4, k = 2, align = 2;
  Tensor x = host_tensor({N, C}, DType::kF64, random_normal(N * C, 21));
  const std::vector<double> wr = random_normal(E * C, 22), we = random_normal(E * F * C, 23);
  const std::vector<double> w_out = random_normal(N * F, 24);
  const float ga = 0.3f, gz = 0.2f;
  const int64_t R = moe_permuted_rows(N, k, E, align);

  struct State {
    Tensor logits;
    Router router;
    Plan plan;
    Tensor x_perm, y_perm, y;
    std::vector<int32_t> offsets;
  };
  auto forward = [&](State& s) {
    const std::vector<double> xv = values_of(x);
    std::vector<double> lg((size_t)(N * E), 0.0);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t e = 0; e < E; ++e)
        for (int64_t c = 0; c < C; ++c) lg[(size_t)(n * E + e)] += xv[(size_t)(n * C + c)] * wr[(size_t)(e * C + c)];
    s.logits = host_tensor({N, E}, DType::kF64, lg);
    s.router = run_router(s.logits, k);
    s.plan = run_plan(s.router.ids, E, align);
    s.offsets = ints_of(s.plan.offsets);
    s.x_perm = Tensor::empty({R, C}, DType::kF64, Device::kCpu);
    moe_permute(x, s.plan.view(), s.x_perm);
    const std::vector<double> xp = values_of(s.x_perm);
    std::vector<double> yp((size_t)(R * F), 0.0);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = s.offsets[(size_t)e]; r < s.offsets[(size_t)e + 1]; ++r)
        for (int64_t f = 0; f < F; ++f)
          for (int64_t c = 0; c < C; ++c)
            yp[(size_t)(r * F + f)] += xp[(size_t)(r * C + c)] * we[(size_t)((e * F + f) * C + c)];
    s.y_perm = host_tensor({R, F}, DType::kF64, yp);
    s.y = Tensor::empty({N, F}, DType::kF64, Device::kCpu);
    moe_unpermute(s.y_perm, s.router.gates, s.plan.view(), s.y);
    const std::vector<double> l = values_of(s.router.losses);
    return testing::dot(values_of(s.y), w_out) + ga * l[0] + gz * l[1];
  };
  State s;
  forward(s);
  // Backward.
  Tensor d_y_perm = Tensor::empty({R, F}, DType::kF64, Device::kCpu), d_gates = Tensor::empty({N, k}, DType::kF64, Device::kCpu);
  moe_unpermute_backward(host_tensor({N, F}, DType::kF64, w_out), s.y_perm, s.router.gates, s.plan.view(), d_y_perm, d_gates);
  const std::vector<double> dyp = values_of(d_y_perm);
  std::vector<double> dxp((size_t)(R * C), 0.0);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = s.offsets[(size_t)e]; r < s.offsets[(size_t)e + 1]; ++r)
      for (int64_t f = 0; f < F; ++f)
        for (int64_t c = 0; c < C; ++c) dxp[(size_t)(r * C + c)] += dyp[(size_t)(r * F + f)] * we[(size_t)((e * F + f) * C + c)];
  Tensor dx = Tensor::empty({N, C}, DType::kF64, Device::kCpu);
  moe_permute_backward(host_tensor({R, C}, DType::kF64, dxp), s.plan.view(), dx);
  Tensor d_logits = Tensor::empty({N, E}, DType::kF64, Device::kCpu);
  router_backward(RouterSaved{s.logits, s.router.probs, s.router.ids, s.router.counts}, d_gates,
                  RouterLossGrads{ga, gz}, d_logits);
  std::vector<double> g = values_of(dx);
  const std::vector<double> dl = values_of(d_logits);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t e = 0; e < E; ++e)
      for (int64_t c = 0; c < C; ++c) g[(size_t)(n * C + c)] += dl[(size_t)(n * E + e)] * wr[(size_t)(e * C + c)];
  const std::vector<int32_t> ids0 = ints_of(s.router.ids);
  auto loss = [&] {
    State t;
    const double l = forward(t);
    EXPECT_EQ(ints_of(t.router.ids), ids0) << "the perturbation changed the routing";
    return l;
  };
  EXPECT_TRUE(check_gradient(loss, x.ptr<double>(), x.numel(), g, "dx of the MoE block"));
}

TEST(OpsMoe, ArgumentErrorsNameTheProblem) {
  const Tensor logits = host_tensor({3, 4}, DType::kF32, random_normal(12, 1));
  expect_error([&] { run_router(logits, 5); }, "top_k = 5 must lie in [1, min(E = 4, 32)]");
  expect_error([&] { run_router(logits, 0); }, "top_k = 0");
  Router r = make_router(3, 4, 2, DType::kF32);
  RouterOptions o;
  o.top_k = 2;
  r.gates = Tensor::empty({3, 2}, DType::kF64, Device::kCpu);
  expect_error([&] { router_forward(logits, o, r.outputs()); }, "gates is f64");
  r = make_router(3, 4, 2, DType::kF32);
  r.ids = Tensor::empty({3, 3}, DType::kI32, Device::kCpu);
  expect_error([&] { router_forward(logits, o, r.outputs()); }, "expert_ids must have shape (3, 2)");
  const Tensor ids = host_ints({2, 2}, {0, 1, 1, 3});
  Plan p{Tensor::empty({4}, DType::kI32, Device::kCpu), Tensor::empty({2, 2}, DType::kI32, Device::kCpu),
         Tensor::empty({4}, DType::kI32, Device::kCpu)};
  expect_error([&] { moe_plan(ids, 1, p.view()); }, "expert_ids[1, 1] = 3 lies outside [0, E = 3)");
  expect_error([&] { moe_plan(ids, 2, p.view()); }, "has R = 4 rows but");
  const Plan good = run_plan(host_ints({2, 2}, {0, 1, 1, 2}), 3, 1);
  const Tensor x = host_tensor({2, 5}, DType::kF32, random_normal(10, 2));
  Tensor xp = Tensor::empty({4, 5}, DType::kF64, Device::kCpu);
  expect_error([&] { moe_permute(x, good.view(), xp); }, "but x is f32 and x_perm is f64");
  Tensor bad_rows = host_ints({2, 2}, {0, 9, 1, 2});
  const MoePlan broken{good.offsets, bad_rows, good.row_slots};
  Tensor xp32 = Tensor::empty({4, 5}, DType::kF32, Device::kCpu);
  expect_error([&] { moe_permute_backward(xp32, broken, Tensor::empty({2, 5}, DType::kF32, Device::kCpu)); },
               "plan.slot_rows[1] = 9 lies outside [-1, R = 4)");
}

}  // namespace
}  // namespace fourbit::ops
