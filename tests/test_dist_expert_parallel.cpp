// Expert parallelism (dist/expert_parallel.h) with the in-process communicator against the
// single-rank routed-expert computation on the same tokens: the ops sequence of the model's MoE
// block (model.cpp forward_moe / backward_ffn, routed part: moe_plan, permute, grouped expert
// GEMMs, SwiGLU, unpermute, and their backward) over ALL ranks' tokens concatenated in rank order,
// with all E experts on one rank.
//
// Checked per rank: the output y, the input gradient dx, the gate gradients, and the gradients of
// the rank's local experts (the matching slices of the single-rank expert gradients), for R = 1..4
// ranks, uneven token counts per rank, uneven expert ranges (E not a multiple of R), experts that
// get no token, and a rank whose experts all get no token. In float64 the results are equal to
// ~1e-15 (the same rows reach each expert in the same order, the reference GEMM sums in order);
// in float32 (OpenBLAS, whose blocking depends on the group sizes) to 2e-6 of the largest value.
#include "dist/expert_parallel.h"
#include "dist/in_process_communicator.h"
#include "gemm/linear.h"
#include "model/expert_linear.h"
#include "ops/moe.h"
#include "ops/swiglu.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>

namespace fourbit::dist {
namespace {

constexpr int64_t kC = 16, kFe = 12, kK = 2;

Tensor random_tensor(Shape shape, DType dt, uint64_t seed, double scale) {
  Tensor t = Tensor::empty(shape, dt, Device::kCpu);
  std::mt19937_64 g(seed);
  std::normal_distribution<double> n(0.0, scale);
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (dt == DType::kF64) t.ptr<double>()[i] = n(g);
    else t.ptr<float>()[i] = (float)n(g);
  }
  return t;
}

std::vector<double> values(const TensorView& t) {
  std::vector<double> v((size_t)t.numel());
  for (int64_t i = 0; i < t.numel(); ++i)
    v[(size_t)i] = t.dtype == DType::kF64 ? t.ptr<double>()[i] : (double)t.ptr<float>()[i];
  return v;
}

TensorView rows(const Tensor& t, int64_t first, int64_t n) {
  const int64_t cols = t.numel() / t.shape()[0];
  return TensorView::contiguous(static_cast<char*>(t.data()) + dtype_bytes(t.dtype(), first * cols),
                                t.dtype(), {n, cols}, Device::kCpu);
}

TensorView prefix(const Tensor& t, int64_t n) { return rows(t, 0, n); }

// The single-rank reference over all tokens: returns y, dx, d_gates, dw_up, dw_down.
struct Reference {
  Tensor y, dx, d_gates, dw_up, dw_down;
};
Reference single_rank(const Tensor& x, const Tensor& ids, const Tensor& gates, const Tensor& w_up,
                      const Tensor& w_down, const Tensor& dy, const gemm::LinearRecipe& recipe) {
  const int64_t N = x.shape()[0], E = w_up.shape()[0];
  const DType dt = x.dtype();
  const int align = std::max(8, model::expert_row_align(recipe));
  const int64_t R = ops::moe_permuted_rows(N, (int)kK, (int)E, align);
  Tensor offsets = Tensor::empty({E + 1}, DType::kI32, Device::kCpu);
  Tensor slot_rows = Tensor::empty({N, kK}, DType::kI32, Device::kCpu);
  Tensor row_slots = Tensor::empty({R}, DType::kI32, Device::kCpu);
  const ops::MoePlan plan{offsets.view(), slot_rows.view(), row_slots.view()};
  ops::moe_plan(ids.view(), align, plan);
  std::vector<int32_t> counts((size_t)E, 0);
  for (int64_t i = 0; i < N * kK; ++i) ++counts[(size_t)ids.ptr<int32_t>()[i]];
  const std::vector<int64_t> groups = ops::moe_group_sizes(counts, align);
  const int64_t used = std::accumulate(groups.begin(), groups.end(), (int64_t)0);
  Tensor x_perm = Tensor::zeros({R, kC}, dt, Device::kCpu), h = Tensor::zeros({R, 2 * kFe}, dt, Device::kCpu);
  Tensor act = Tensor::zeros({R, kFe}, dt, Device::kCpu), y_perm = Tensor::zeros({R, kC}, dt, Device::kCpu);
  ops::moe_permute(x.view(), plan, x_perm.view());
  model::expert_fprop(recipe, prefix(x_perm, used), w_up.view(), groups, prefix(h, used), {});
  ops::swiglu_forward(prefix(act, used), prefix(h, used));
  model::expert_fprop(recipe, prefix(act, used), w_down.view(), groups, prefix(y_perm, used), {});
  Reference r;
  r.y = Tensor::empty({N, kC}, dt, Device::kCpu);
  ops::moe_unpermute(y_perm.view(), gates.view(), plan, r.y.view());
  // Backward.
  Tensor d_y_perm = Tensor::zeros({R, kC}, dt, Device::kCpu), d_act = Tensor::zeros({R, kFe}, dt, Device::kCpu);
  Tensor d_x_perm = Tensor::zeros({R, kC}, dt, Device::kCpu);
  r.d_gates = Tensor::empty({N, kK}, dt, Device::kCpu);
  r.dx = Tensor::empty({N, kC}, dt, Device::kCpu);
  r.dw_up = Tensor::zeros(w_up.shape(), dt, Device::kCpu);
  r.dw_down = Tensor::zeros(w_down.shape(), dt, Device::kCpu);
  ops::moe_unpermute_backward(dy.view(), y_perm.view(), gates.view(), plan, d_y_perm.view(), r.d_gates.view());
  model::expert_dgrad(recipe, prefix(d_y_perm, used), w_down.view(), groups, prefix(d_act, used), {});
  model::expert_wgrad(recipe, prefix(d_y_perm, used), prefix(act, used), groups, r.dw_down.view(), 1.0f, {});
  ops::swiglu_backward_inplace(prefix(h, used), prefix(d_act, used));
  model::expert_dgrad(recipe, prefix(h, used), w_up.view(), groups, prefix(d_x_perm, used), {});
  model::expert_wgrad(recipe, prefix(h, used), prefix(x_perm, used), groups, r.dw_up.view(), 1.0f, {});
  ops::moe_permute_backward(d_x_perm.view(), plan, r.dx.view());
  return r;
}

void expect_close(const std::vector<double>& got, const std::vector<double>& want, double rel,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0, worst = 0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  for (size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, std::abs(got[i] - want[i]));
    ASSERT_LE(std::abs(got[i] - want[i]), rel * scale + 1e-300) << what << " element " << i;
  }
  ASSERT_GT(scale, 0) << what << " is all zero: the check would be vacuous";
}

struct Case {
  int world, n_experts;
  std::vector<int> excluded;  // experts no token is routed to
  DType dtype;
};

void run_case(const Case& c) {
  SCOPED_TRACE(fmt::format("R {} E {} excluded {} {}", c.world, c.n_experts,
                           fmt::join(c.excluded, ","), dtype_name(c.dtype)));
  const int R = c.world, E = c.n_experts;
  const DType dt = c.dtype;
  // Uneven token counts per rank, concatenated in rank order for the reference.
  std::vector<int64_t> n_tok, first_tok;
  int64_t N = 0;
  for (int r = 0; r < R; ++r) {
    first_tok.push_back(N);
    n_tok.push_back(5 + 3 * r);
    N += n_tok.back();
  }
  std::vector<int> allowed;
  for (int e = 0; e < E; ++e)
    if (std::find(c.excluded.begin(), c.excluded.end(), e) == c.excluded.end()) allowed.push_back(e);
  ASSERT_GE((int)allowed.size(), (int)kK);
  Tensor ids = Tensor::empty({N, kK}, DType::kI32, Device::kCpu);
  std::mt19937_64 g(42 + (uint64_t)E * 7 + (uint64_t)R);
  for (int64_t n = 0; n < N; ++n) {
    std::vector<int> pick = allowed;
    std::shuffle(pick.begin(), pick.end(), g);
    for (int64_t j = 0; j < kK; ++j) ids.ptr<int32_t>()[n * kK + j] = pick[(size_t)j];
  }
  Tensor gates = random_tensor({N, kK}, dt, 3, 0.5);
  for (int64_t i = 0; i < gates.numel(); ++i) {
    if (dt == DType::kF64) gates.ptr<double>()[i] = std::abs(gates.ptr<double>()[i]);
    else gates.ptr<float>()[i] = std::abs(gates.ptr<float>()[i]);
  }
  Tensor x = random_tensor({N, kC}, dt, 4, 1.0), dy = random_tensor({N, kC}, dt, 5, 1.0);
  Tensor w_up = random_tensor({E, 2 * kFe, kC}, dt, 6, 0.3), w_down = random_tensor({E, kC, kFe}, dt, 7, 0.3);
  const gemm::LinearRecipe recipe = gemm::LinearRecipe::plain();
  const Reference ref = single_rank(x, ids, gates, w_up, w_down, dy, recipe);
  const double tol = dt == DType::kF64 ? 1e-13 : 2e-6;

  std::vector<int64_t> received((size_t)R);
  run_ranks(R, [&](Communicator& comm) {
    const int r = comm.rank();
    ExpertParallelMoe ep(comm, E, {recipe, recipe});
    const int e0 = ep.first_local_expert(), el = ep.n_local_experts();
    Tensor y = Tensor::empty({n_tok[(size_t)r], kC}, dt, Device::kCpu);
    Tensor dx = Tensor::empty({n_tok[(size_t)r], kC}, dt, Device::kCpu);
    Tensor d_gates = Tensor::empty({n_tok[(size_t)r], kK}, dt, Device::kCpu);
    Tensor dw_up = Tensor::zeros({el, 2 * kFe, kC}, dt, Device::kCpu);
    Tensor dw_down = Tensor::zeros({el, kC, kFe}, dt, Device::kCpu);
    const int64_t f = first_tok[(size_t)r], n = n_tok[(size_t)r];
    ep.forward(rows(x, f, n), rows(ids, f, n), rows(gates, f, n), model::expert_range(w_up.view(), e0, el),
               model::expert_range(w_down.view(), e0, el), y.view());
    ep.backward(rows(dy, f, n), dx.view(), d_gates.view(), dw_up.view(), dw_down.view());
    received[(size_t)r] = ep.received_rows();
    expect_close(values(y.view()), values(rows(ref.y, f, n)), tol, fmt::format("rank {} y", r));
    expect_close(values(dx.view()), values(rows(ref.dx, f, n)), tol, fmt::format("rank {} dx", r));
    expect_close(values(d_gates.view()), values(rows(ref.d_gates, f, n)), tol,
                 fmt::format("rank {} d_gates", r));
    // A rank whose experts got no token has zero expert gradients, as the reference slice.
    const std::vector<double> want_up = values(model::expert_range(ref.dw_up.view(), e0, el));
    const std::vector<double> want_down = values(model::expert_range(ref.dw_down.view(), e0, el));
    if (ep.received_rows() == 0) {
      for (double v : want_up) ASSERT_EQ(v, 0.0);
      EXPECT_EQ(values(dw_up.view()), want_up);
      EXPECT_EQ(values(dw_down.view()), want_down);
    } else {
      expect_close(values(dw_up.view()), want_up, tol, fmt::format("rank {} dw_up", r));
      expect_close(values(dw_down.view()), want_down, tol, fmt::format("rank {} dw_down", r));
    }
  });
  // Every routed slot was processed exactly once, somewhere.
  EXPECT_EQ(std::accumulate(received.begin(), received.end(), (int64_t)0), N * kK);
}

TEST(DistExpertParallel, PartitionIsContiguousAndUneven) {
  const ExpertPartition p = ExpertPartition::contiguous(6, 4);
  EXPECT_EQ(p.first, (std::vector<int>{0, 2, 4, 5, 6}));
  EXPECT_EQ(p.owner(4), 2);
  EXPECT_EQ(p.owner(5), 3);
  try {
    ExpertPartition::contiguous(3, 4);
    FAIL() << "3 experts over 4 ranks must be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("at most 3"), std::string::npos) << e.what();
  }
}

TEST(DistExpertParallel, F64MatchesSingleRank) {
  run_case({1, 4, {}, DType::kF64});
  run_case({2, 4, {1}, DType::kF64});        // expert 1 gets no token
  run_case({2, 5, {}, DType::kF64});         // uneven: 3 + 2 experts
  run_case({3, 7, {2, 6}, DType::kF64});     // 3 + 2 + 2
  run_case({4, 6, {}, DType::kF64});         // 2 + 2 + 1 + 1
  run_case({4, 4, {3}, DType::kF64});        // rank 3's only expert gets no token
  run_case({3, 6, {2, 3}, DType::kF64});     // rank 1's experts (2, 3) get no token
}

TEST(DistExpertParallel, F32MatchesSingleRank) {
  run_case({2, 4, {}, DType::kF32});
  run_case({3, 5, {4}, DType::kF32});
  run_case({4, 8, {0, 1}, DType::kF32});     // rank 0 receives nothing
}

}  // namespace
}  // namespace fourbit::dist
