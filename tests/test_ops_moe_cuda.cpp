// ops moe (gpu): the CUDA router, plan and permutation kernels against the CPU reference run on the
// same values (f32 for the router; bf16 data converted exactly to f32 for the permutation). Every
// output lives inside guard regions and every case runs twice with two poison fills (0xFF: NaN /
// -1, 0x7F: huge / 0x7F7F7F7F), so a missed element or an out-of-bounds write fails, and the two
// runs must agree bit for bit (determinism).
//
// Tolerances:
//   expert ids, counts, offsets, slot_rows, row_slots, permuted rows: exact (integer work and
//     copies; the selection compares the very same FP32 values logit + bias on both sides).
//   probs, gates: FP32 softmax with warp sums of at most 32 + 5 terms per partial: 1e-5 relative.
//   aux and z losses: FP32 sums of up to 256 terms per chunk and 256 chunks: 1e-4 relative.
//   d_logits: FP32 with one cancellation (dp - sum p dp), and the aux-loss term enters every row
//     through FP32 sums over all N tokens: 1e-5 |ref| + 1e-4 * max |ref| of the row (the H200
//     showed 3.5e-5 of the row max on one element of 64000 with 1e-5 as the row term).
//   un-permute, permute backward: FP32 sums of k terms ((k + 2) 2^-24), plus, for a bf16 output,
//     2 u = 2^-7 (u = 2^-8, bf16's unit roundoff: the rounding alone can reach u), times
//     sum_j |g_j y_j| (the reference run on absolute values).
//   d_y_perm: one FP32 product (the f32 reference's value exactly), rounded to bf16: 2 u |ref|
//     (2^-23 |ref| for f32).
//   d_gates: an FP32 dot product over C: (C + 32) 2^-24 * sum_c |dy_c y_c|.
#include "core/device.h"
#include "ops/error_flags.h"
#include "ops/moe.h"

#include "dense_ops_test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace fourbit::ops {
namespace {

using testing::all_close;
using testing::Guarded;
using testing::host_ints;
using testing::host_tensor;
using testing::random_ints;
using testing::random_normal;
using testing::rounded;
using testing::values_of;

constexpr uint8_t kPoisons[2] = {0xFF, 0x7F};

std::vector<int32_t> ints_of(const TensorView& t) {
  Tensor h = Tensor::empty(t.shape, DType::kI32, Device::kCpu);
  copy_tensor(h.view(), t);
  return std::vector<int32_t>(h.ptr<int32_t>(), h.ptr<int32_t>() + h.numel());
}

std::vector<uint8_t> bytes_of(const TensorView& x) {
  std::vector<uint8_t> h((size_t)x.nbytes());
  if (!h.empty()) device_memcpy(h.data(), Device::kCpu, x.data, Device::kCuda, x.nbytes());
  return h;
}

std::vector<double> abs_of(std::vector<double> v) {
  for (double& x : v) x = std::fabs(x);
  return v;
}

::testing::AssertionResult same_ints(const std::vector<int32_t>& got, const std::vector<int32_t>& want,
                                     const std::string& what) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << what << ": " << got.size() << " values, expected " << want.size();
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i]) {
      if (first < 0) first = (int64_t)i;
      ++bad;
    }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << got.size()
                                       << " values differ, first at flat index " << first << " (gpu "
                                       << got[(size_t)first] << ", cpu " << want[(size_t)first] << ")";
}

class OpsMoeCuda : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_GT(cuda_device_count(), 0) << "the gpu tests need a CUDA GPU"; }
};

// ---- router -------------------------------------------------------------------------------------

struct RouterCase {
  int64_t N, E;
  int k;
  bool bias = false, forced = false, coarse = false;  // coarse: logits on a 0.5 grid (many ties)
};

std::string describe(const RouterCase& c) {
  return "N " + std::to_string(c.N) + " E " + std::to_string(c.E) + " k " + std::to_string(c.k) +
         (c.bias ? " bias" : "") + (c.forced ? " forced" : "") + (c.coarse ? " ties" : "");
}

void check_router(const RouterCase& c, uint64_t seed) {
  SCOPED_TRACE(describe(c));
  const int64_t N = c.N, E = c.E, k = c.k;
  std::vector<double> lg = rounded(random_normal(N * E, seed, 2.0), DType::kF32);
  if (c.coarse)
    for (double& x : lg) x = std::round(x * 2) / 2;
  const std::vector<double> bias = rounded(random_normal(E, seed + 1, 1.0), DType::kF32);
  std::vector<int32_t> forced;
  for (int64_t n = 0; n < N; ++n) {
    const std::vector<int32_t> perm = random_ints(k, 0, (int32_t)E - 1, seed + 2 + (uint64_t)n);
    std::vector<char> used((size_t)E, 0);
    for (int64_t j = 0; j < k; ++j) {  // k distinct ids: linear probing from a random start
      int32_t id = perm[(size_t)j];
      while (used[(size_t)id]) id = (id + 1) % (int32_t)E;
      used[(size_t)id] = 1;
      forced.push_back(id);
    }
  }
  const std::vector<double> dg = rounded(random_normal(N * k, seed + 3), DType::kF32);

  // CPU reference (f32 storage).
  const Tensor logits_h = host_tensor({N, E}, DType::kF32, lg);
  const Tensor bias_h = host_tensor({E}, DType::kF32, bias);
  const Tensor forced_h = host_ints({N, k}, forced);
  Tensor probs_h = Tensor::empty({N, E}, DType::kF32, Device::kCpu);
  Tensor ids_h = Tensor::empty({N, k}, DType::kI32, Device::kCpu);
  Tensor gates_h = Tensor::empty({N, k}, DType::kF32, Device::kCpu);
  Tensor counts_h = Tensor::empty({E}, DType::kI32, Device::kCpu);
  Tensor losses_h = Tensor::empty({2}, DType::kF32, Device::kCpu);
  RouterOptions oh;
  oh.top_k = c.k;
  if (c.bias) oh.selection_bias = bias_h;
  if (c.forced) oh.forced_ids = forced_h;
  router_forward(logits_h, oh, {probs_h, ids_h, gates_h, counts_h, losses_h});
  const float ga = 0.37f, gz = 0.11f;
  Tensor dl_h = Tensor::empty({N, E}, DType::kF32, Device::kCpu);
  router_backward({logits_h, probs_h, ids_h, counts_h}, host_tensor({N, k}, DType::kF32, dg), {ga, gz}, dl_h);
  const std::vector<double> probs_w = values_of(probs_h), gates_w = values_of(gates_h),
                            losses_w = values_of(losses_h), dl_w = values_of(dl_h);
  std::vector<double> dl_rowmax((size_t)N, 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t e = 0; e < E; ++e)
      dl_rowmax[(size_t)n] = std::max(dl_rowmax[(size_t)n], std::fabs(dl_w[(size_t)(n * E + e)]));

  const Tensor logits_d = logits_h.to(Device::kCuda), bias_d = bias_h.to(Device::kCuda),
               forced_d = forced_h.to(Device::kCuda), dg_d = host_tensor({N, k}, DType::kF32, dg).to(Device::kCuda);
  std::vector<uint8_t> first_bits;
  for (uint8_t poison : kPoisons) {
    SCOPED_TRACE(::testing::Message() << "poison 0x" << std::hex << (int)poison);
    Guarded probs = Guarded::make({N, E}, DType::kF32, poison), ids = Guarded::make({N, k}, DType::kI32, poison),
            gates = Guarded::make({N, k}, DType::kF32, poison), counts = Guarded::make({E}, DType::kI32, poison),
            losses = Guarded::make({2}, DType::kF32, poison), dl = Guarded::make({N, E}, DType::kF32, poison);
    RouterOptions o;
    o.top_k = c.k;
    if (c.bias) o.selection_bias = bias_d;
    if (c.forced) o.forced_ids = forced_d;
    router_forward(logits_d, o, {probs.view, ids.view, gates.view, counts.view, losses.view});
    router_backward({logits_d, probs.view, ids.view, counts.view}, dg_d, {ga, gz}, dl.view);
    device_synchronize();
    for (const Guarded* g : {&probs, &ids, &gates, &counts, &losses, &dl})
      ASSERT_EQ(g->damaged_guard_bytes(), 0) << "a router output was written outside its tensor";
    ASSERT_TRUE(same_ints(ints_of(ids.view), ints_of(ids_h), "expert_ids"));
    ASSERT_TRUE(same_ints(ints_of(counts.view), ints_of(counts_h), "expert_counts"));
    ASSERT_TRUE(all_close(probs.values(), probs_w, [&](int64_t i) { return 1e-5 * probs_w[(size_t)i] + 1e-30; }, "probs"));
    ASSERT_TRUE(all_close(gates.values(), gates_w, [&](int64_t i) { return 1e-5 * gates_w[(size_t)i] + 1e-30; }, "gates"));
    ASSERT_TRUE(all_close(losses.values(), losses_w, [&](int64_t i) { return 1e-4 * std::fabs(losses_w[(size_t)i]); },
                          "losses {aux, z}"));
    ASSERT_TRUE(all_close(dl.values(), dl_w, [&](int64_t i) {
      return 1e-5 * std::fabs(dl_w[(size_t)i]) + 1e-4 * dl_rowmax[(size_t)(i / E)];
    }, "d_logits"));
    std::vector<uint8_t> bits;
    for (const Guarded* g : {&probs, &ids, &gates, &counts, &losses, &dl}) {
      const std::vector<uint8_t> b = bytes_of(g->view);
      bits.insert(bits.end(), b.begin(), b.end());
    }
    if (first_bits.empty()) first_bits = bits;
    else ASSERT_TRUE(first_bits == bits) << "router not deterministic: outputs differ between runs";
  }
}

TEST_F(OpsMoeCuda, RouterMatchesTheReference) {
  uint64_t seed = 100;
  for (const RouterCase& c : {RouterCase{1, 8, 2}, RouterCase{37, 8, 1}, RouterCase{1000, 64, 2},
                              RouterCase{999, 100, 6}, RouterCase{513, 256, 8}, RouterCase{300, 1000, 8},
                              RouterCase{77, 33, 32}, RouterCase{50, 4, 4}, RouterCase{5000, 64, 8}}) {
    check_router(c, seed += 10);
    if (HasFatalFailure()) return;
  }
}

TEST_F(OpsMoeCuda, RouterTiesBiasAndReplayMatchTheReference) {
  uint64_t seed = 200;
  for (const RouterCase& c : {RouterCase{500, 16, 2, false, false, true}, RouterCase{500, 300, 8, false, false, true},
                              RouterCase{400, 64, 4, true}, RouterCase{400, 64, 4, true, false, true},
                              RouterCase{400, 64, 4, false, true}, RouterCase{123, 257, 6, true, true}}) {
    check_router(c, seed += 10);
    if (HasFatalFailure()) return;
  }
}

TEST_F(OpsMoeCuda, InvalidForcedIdsAreReported) {
  const int64_t N = 3, E = 8;
  const Tensor logits = host_tensor({N, E}, DType::kF32, random_normal(N * E, 1)).to(Device::kCuda);
  Tensor probs = Tensor::empty({N, E}, DType::kF32, Device::kCuda), ids = Tensor::empty({N, 2}, DType::kI32, Device::kCuda),
         gates = Tensor::empty({N, 2}, DType::kF32, Device::kCuda), counts = Tensor::empty({E}, DType::kI32, Device::kCuda);
  for (const std::vector<int32_t>& bad : {std::vector<int32_t>{0, 1, 2, 8, 4, 5}, std::vector<int32_t>{0, 1, 3, 3, 4, 5},
                                          std::vector<int32_t>{0, 1, -1, 3, 4, 5}}) {
    const Tensor forced = host_ints({N, 2}, bad).to(Device::kCuda);
    RouterOptions o;
    o.forced_ids = forced;
    try {  // null error flag: the op synchronizes and throws
      router_forward(logits, o, {probs, ids, gates, counts, {}});
      ADD_FAILURE() << "invalid forced ids were accepted: " << bad[2] << " " << bad[3];
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("forced_ids hold an expert id outside [0, E = 8) or repeated"),
                std::string::npos) << e.what();
    }
    // A caller's flag: the bit is OR-ed in, nothing is thrown.
    Tensor flag = host_ints({1}, {0}).to(Device::kCuda);
    o.error_flag = flag.ptr<int32_t>();
    router_forward(logits, o, {probs, ids, gates, counts, {}});
    device_synchronize();
    EXPECT_EQ(ints_of(flag.view())[0], kErrIndexOutOfRange);
  }
}

// ---- plan ---------------------------------------------------------------------------------------

struct PlanCase {
  int64_t N;
  int k, E, align;
};

void check_plan(const PlanCase& c, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "plan N " << c.N << " k " << c.k << " E " << c.E << " row_align " << c.align);
  // Skewed ids: half the slots go to the first quarter of the experts, and the last expert is never
  // used (empty group).
  std::vector<int32_t> ids = random_ints(c.N * c.k, 0, c.E > 1 ? c.E - 2 : 0, seed);
  for (size_t i = 0; i < ids.size(); i += 2) ids[i] = ids[i] % std::max(1, c.E / 4);
  const Tensor ids_h = host_ints({c.N, c.k}, ids);
  const int64_t R = moe_permuted_rows(c.N, c.k, c.E, c.align) + 3;  // 3 extra rows: padding
  Tensor off_h = Tensor::empty({c.E + 1}, DType::kI32, Device::kCpu), sr_h = Tensor::empty({c.N, c.k}, DType::kI32, Device::kCpu),
         rs_h = Tensor::empty({R}, DType::kI32, Device::kCpu);
  moe_plan(ids_h, c.align, {off_h, sr_h, rs_h});
  const Tensor ids_d = ids_h.to(Device::kCuda);
  for (uint8_t poison : kPoisons) {
    SCOPED_TRACE(::testing::Message() << "poison 0x" << std::hex << (int)poison);
    Guarded off = Guarded::make({c.E + 1}, DType::kI32, poison), sr = Guarded::make({c.N, c.k}, DType::kI32, poison),
            rs = Guarded::make({R}, DType::kI32, poison);
    moe_plan(ids_d, c.align, {off.view, sr.view, rs.view});
    device_synchronize();
    for (const Guarded* g : {&off, &sr, &rs}) ASSERT_EQ(g->damaged_guard_bytes(), 0) << "plan: write outside a tensor";
    ASSERT_TRUE(same_ints(ints_of(off.view), ints_of(off_h), "offsets"));
    ASSERT_TRUE(same_ints(ints_of(sr.view), ints_of(sr_h), "slot_rows"));
    ASSERT_TRUE(same_ints(ints_of(rs.view), ints_of(rs_h), "row_slots"));
  }
}

TEST_F(OpsMoeCuda, PlanMatchesTheReference) {
  uint64_t seed = 300;
  for (const PlanCase& c : {PlanCase{1, 1, 4, 1}, PlanCase{3, 2, 4, 8}, PlanCase{1000, 2, 8, 1},
                            PlanCase{3000, 6, 64, 8}, PlanCase{20000, 2, 300, 1}, PlanCase{4097, 8, 256, 128},
                            PlanCase{2048, 1, 1, 16}, PlanCase{500, 4, 1024, 1}, PlanCase{0, 2, 8, 8}}) {
    check_plan(c, seed += 10);
    if (HasFatalFailure()) return;
  }
}

// ---- permute, un-permute and their backwards ----------------------------------------------------

struct PermCase {
  int64_t N;
  int k, E, align;
  int64_t C;
  DType dtype;
};

void check_permutation(const PermCase& c, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "N " << c.N << " k " << c.k << " E " << c.E << " row_align "
                                    << c.align << " C " << c.C << " " << dtype_name(c.dtype));
  const int64_t N = c.N, k = c.k, C = c.C;
  const Tensor ids_h = host_ints({N, k}, random_ints(N * k, 0, c.E - 1, seed));
  const int64_t R = moe_permuted_rows(N, c.k, c.E, c.align);
  Tensor off_h = Tensor::empty({c.E + 1}, DType::kI32, Device::kCpu), sr_h = Tensor::empty({N, k}, DType::kI32, Device::kCpu),
         rs_h = Tensor::empty({R}, DType::kI32, Device::kCpu);
  moe_plan(ids_h, c.align, {off_h, sr_h, rs_h});
  const MoePlan plan_h{off_h, sr_h, rs_h};
  const Tensor off_d = off_h.to(Device::kCuda), sr_d = sr_h.to(Device::kCuda), rs_d = rs_h.to(Device::kCuda);
  const MoePlan plan_d{off_d, sr_d, rs_d};

  const std::vector<double> x = rounded(random_normal(N * C, seed + 1), c.dtype);
  const std::vector<double> y_perm = rounded(random_normal(R * C, seed + 2), c.dtype);
  const std::vector<double> dy = rounded(random_normal(N * C, seed + 3), c.dtype);
  const std::vector<double> d_x_perm = rounded(random_normal(R * C, seed + 4), c.dtype);
  const std::vector<double> gates = rounded(random_normal(N * k, seed + 5), DType::kF32);
  auto h32 = [](Shape s, const std::vector<double>& v) { return host_tensor(s, DType::kF32, v); };
  auto dev = [&](Shape s, const std::vector<double>& v) { return host_tensor(s, c.dtype, v).to(Device::kCuda); };

  // References (f32 storage, float64 math) and their magnitude bounds.
  Tensor xp_w = Tensor::empty({R, C}, DType::kF32, Device::kCpu);
  moe_permute(h32({N, C}, x), plan_h, xp_w);
  Tensor y_w = Tensor::empty({N, C}, DType::kF32, Device::kCpu), y_b = Tensor::empty({N, C}, DType::kF32, Device::kCpu);
  moe_unpermute(h32({R, C}, y_perm), h32({N, k}, gates), plan_h, y_w);
  moe_unpermute(h32({R, C}, abs_of(y_perm)), h32({N, k}, abs_of(gates)), plan_h, y_b);
  Tensor dx_w = Tensor::empty({N, C}, DType::kF32, Device::kCpu), dx_b = Tensor::empty({N, C}, DType::kF32, Device::kCpu);
  moe_permute_backward(h32({R, C}, d_x_perm), plan_h, dx_w);
  moe_permute_backward(h32({R, C}, abs_of(d_x_perm)), plan_h, dx_b);
  Tensor dyp_w = Tensor::empty({R, C}, DType::kF32, Device::kCpu), dg_w = Tensor::empty({N, k}, DType::kF32, Device::kCpu);
  Tensor dyp_b = Tensor::empty({R, C}, DType::kF32, Device::kCpu), dg_b = Tensor::empty({N, k}, DType::kF32, Device::kCpu);
  moe_unpermute_backward(h32({N, C}, dy), h32({R, C}, y_perm), h32({N, k}, gates), plan_h, dyp_w, dg_w);
  moe_unpermute_backward(h32({N, C}, abs_of(dy)), h32({R, C}, abs_of(y_perm)), h32({N, k}, abs_of(gates)), plan_h,
                         dyp_b, dg_b);
  const std::vector<double> xp_want = values_of(xp_w), y_want = values_of(y_w), y_bound = values_of(y_b),
                            dx_want = values_of(dx_w), dx_bound = values_of(dx_b), dyp_want = values_of(dyp_w),
                            dg_want = values_of(dg_w), dg_bound = values_of(dg_b);
  // FP32 sums of k products ((k + 2) 2^-24), then the output rounding (bf16 only).
  const double out_rel = (c.dtype == DType::kBF16 ? std::ldexp(1.0, -7) : 0.0) + (double)(k + 2) * std::ldexp(1.0, -24);
  // One FP32 product: exactly the reference's f32 value; a bf16 output rounds it once more.
  const double product_rel = c.dtype == DType::kBF16 ? std::ldexp(1.0, -7) : std::ldexp(1.0, -23);
  const double dot_rel = (double)(C + 32) * std::ldexp(1.0, -24);

  const Tensor x_d = dev({N, C}, x), yp_d = dev({R, C}, y_perm), dy_d = dev({N, C}, dy), dxp_d = dev({R, C}, d_x_perm);
  const Tensor g_d = h32({N, k}, gates).to(Device::kCuda);
  std::vector<uint8_t> first_bits;
  for (uint8_t poison : kPoisons) {
    SCOPED_TRACE(::testing::Message() << "poison 0x" << std::hex << (int)poison);
    Guarded xp = Guarded::make({R, C}, c.dtype, poison), y = Guarded::make({N, C}, c.dtype, poison),
            dx = Guarded::make({N, C}, c.dtype, poison), dyp = Guarded::make({R, C}, c.dtype, poison),
            dg = Guarded::make({N, k}, DType::kF32, poison);
    moe_permute(x_d, plan_d, xp.view);
    moe_unpermute(yp_d, g_d, plan_d, y.view);
    moe_permute_backward(dxp_d, plan_d, dx.view);
    moe_unpermute_backward(dy_d, yp_d, g_d, plan_d, dyp.view, dg.view);
    device_synchronize();
    for (const Guarded* g : {&xp, &y, &dx, &dyp, &dg})
      ASSERT_EQ(g->damaged_guard_bytes(), 0) << "a permutation output was written outside its tensor";
    ASSERT_TRUE(all_close(xp.values(), xp_want, [](int64_t) { return 0.0; }, "x_perm (an exact copy, zero padding)"));
    ASSERT_TRUE(all_close(y.values(), y_want, [&](int64_t i) { return out_rel * y_bound[(size_t)i]; }, "y (unpermute)"));
    ASSERT_TRUE(all_close(dx.values(), dx_want, [&](int64_t i) { return out_rel * dx_bound[(size_t)i]; },
                          "dx (permute backward)"));
    ASSERT_TRUE(all_close(dyp.values(), dyp_want, [&](int64_t i) { return product_rel * std::fabs(dyp_want[(size_t)i]); },
                          "d_y_perm (zero padding)"));
    ASSERT_TRUE(all_close(dg.values(), dg_want, [&](int64_t i) { return dot_rel * dg_bound[(size_t)i] + 1e-30; },
                          "d_gates"));
    std::vector<uint8_t> bits;
    for (const Guarded* g : {&xp, &y, &dx, &dyp, &dg}) {
      const std::vector<uint8_t> b = bytes_of(g->view);
      bits.insert(bits.end(), b.begin(), b.end());
    }
    if (first_bits.empty()) first_bits = bits;
    else ASSERT_TRUE(first_bits == bits) << "permutation ops not deterministic: outputs differ between runs";
  }
}

TEST_F(OpsMoeCuda, PermutationOpsMatchTheReference) {
  uint64_t seed = 400;
  for (DType dt : {DType::kBF16, DType::kF32})
    for (const PermCase& c : {PermCase{1, 1, 2, 1, 1, dt}, PermCase{17, 2, 4, 8, 7, dt}, PermCase{300, 2, 8, 1, 64, dt},
                              PermCase{257, 4, 16, 16, 768, dt}, PermCase{100, 8, 64, 8, 1000, dt},
                              PermCase{64, 2, 5, 128, 33, dt}}) {
      check_permutation(c, seed += 10);
      if (HasFatalFailure()) return;
    }
}

}  // namespace
}  // namespace fourbit::ops
