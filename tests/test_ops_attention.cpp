// ops attention (cpu): the CPU reference of causal GQA attention against hand-computed cases,
// float64 central finite differences for dq, dk and dv, grouped-query attention against explicitly
// repeated key/value heads, strided (fused-QKV) views, the KV-cache decode against the full
// forward, padding rows, saturated softmax, and the argument errors.
#include "ops/attention.h"
#include "ops/rope.h"

#include "dense_ops_test_util.h"

#include <gtest/gtest.h>

#include <cmath>
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

struct Shape4 {
  int64_t B, T, H, Hkv, D;
};

struct Inputs {
  Tensor q, k, v;
};

Inputs random_inputs(const Shape4& s, DType dt, uint64_t seed, double scale = 1.0) {
  return {host_tensor({s.B, s.T, s.H, s.D}, dt, random_normal(s.B * s.T * s.H * s.D, seed, scale)),
          host_tensor({s.B, s.T, s.Hkv, s.D}, dt, random_normal(s.B * s.T * s.Hkv * s.D, seed + 1, scale)),
          host_tensor({s.B, s.T, s.Hkv, s.D}, dt, random_normal(s.B * s.T * s.Hkv * s.D, seed + 2, scale))};
}

struct Outputs {
  Tensor out, lse;
};

Outputs forward(const Inputs& in, const Shape4& s, DType dt, AttentionOptions o = {}) {
  Outputs r{Tensor::empty({s.B, s.T, s.H, s.D}, dt, Device::kCpu),
            Tensor::empty({s.B, s.H, s.T}, dt, Device::kCpu)};
  attention_forward(in.q, in.k, in.v, r.out, r.lse, o);
  return r;
}

void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(OpsAttention, SingleTokenReturnsItsValueAndScoreAsLse) {
  // T = 1: the softmax has one entry, out = v and lse = scale q . k, per head (GQA 4 -> 2).
  const Shape4 s{2, 1, 4, 2, 3};
  const Inputs in = random_inputs(s, DType::kF64, 11);
  AttentionOptions o;
  o.scale = 0.5f;
  const Outputs r = forward(in, s, DType::kF64, o);
  const std::vector<double> q = values_of(in.q), k = values_of(in.k), v = values_of(in.v);
  const std::vector<double> out = values_of(r.out), lse = values_of(r.lse);
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h) {
      const int64_t hk = h / 2;
      double dotqk = 0;
      for (int64_t c = 0; c < s.D; ++c) {
        dotqk += q[(size_t)((b * s.H + h) * s.D + c)] * k[(size_t)((b * s.Hkv + hk) * s.D + c)];
        EXPECT_EQ(out[(size_t)((b * s.H + h) * s.D + c)], v[(size_t)((b * s.Hkv + hk) * s.D + c)]);
      }
      EXPECT_NEAR(lse[(size_t)(b * s.H + h)], 0.5 * dotqk, 1e-15);
    }
}

TEST(OpsAttention, HandComputedTwoTokens) {
  // q = [[1, 0], [0, 1]], k = [[1, 0], [1, 1]], v = [[1, 2], [3, 4]], scale 1.
  // Row 0 sees key 0 only: out = [1, 2], lse = 1. Row 1: scores [0, 1], p = [1, e] / (1 + e).
  const Shape4 s{1, 2, 1, 1, 2};
  Inputs in{host_tensor({1, 2, 1, 2}, DType::kF64, {1, 0, 0, 1}),
            host_tensor({1, 2, 1, 2}, DType::kF64, {1, 0, 1, 1}),
            host_tensor({1, 2, 1, 2}, DType::kF64, {1, 2, 3, 4})};
  AttentionOptions o;
  o.scale = 1.0f;
  const Outputs r = forward(in, s, DType::kF64, o);
  const double e = std::exp(1.0), p0 = 1 / (1 + e), p1 = e / (1 + e);
  EXPECT_TRUE(all_close(values_of(r.out), {1, 2, p0 * 1 + p1 * 3, p0 * 2 + p1 * 4},
                        [](int64_t) { return 1e-15; }, "out"));
  EXPECT_TRUE(all_close(values_of(r.lse), {1.0, std::log(1 + e)}, [](int64_t) { return 1e-15; },
                        "lse"));
}

TEST(OpsAttention, ZeroQueriesAverageThePrefixAndLargeScoresPickTheArgmax) {
  const Shape4 s{1, 5, 2, 1, 4};
  Inputs in = random_inputs(s, DType::kF64, 21);
  const std::vector<double> v = values_of(in.v);
  // q = 0: uniform weights over keys 0..i, lse = log(i + 1).
  in.q = host_tensor({1, 5, 2, 4}, DType::kF64, std::vector<double>(40, 0.0));
  Outputs r = forward(in, s, DType::kF64);
  std::vector<double> out = values_of(r.out), lse = values_of(r.lse);
  for (int64_t i = 0; i < s.T; ++i)
    for (int64_t h = 0; h < s.H; ++h) {
      EXPECT_NEAR(lse[(size_t)(h * s.T + i)], std::log((double)(i + 1)), 1e-14);
      for (int64_t c = 0; c < s.D; ++c) {
        double mean = 0;
        for (int64_t j = 0; j <= i; ++j) mean += v[(size_t)(j * s.D + c)] / (double)(i + 1);
        EXPECT_NEAR(out[(size_t)((i * s.H + h) * s.D + c)], mean, 1e-14);
      }
    }
  // Huge scores (|S| ~ 1e4): no overflow, out = v of the best key, lse = the best score.
  in = random_inputs(s, DType::kF64, 22, 100.0);
  r = forward(in, s, DType::kF64);
  out = values_of(r.out);
  lse = values_of(r.lse);
  const std::vector<double> q = values_of(in.q), k = values_of(in.k), v2 = values_of(in.v);
  const double scale = 0.5;
  for (int64_t i = 0; i < s.T; ++i)
    for (int64_t h = 0; h < s.H; ++h) {
      int64_t best = 0;
      double best_s = -INFINITY;
      for (int64_t j = 0; j <= i; ++j) {
        double sc = 0;
        for (int64_t c = 0; c < s.D; ++c) sc += q[(size_t)((i * s.H + h) * s.D + c)] * k[(size_t)(j * s.D + c)];
        if (scale * sc > best_s) best_s = scale * sc, best = j;
      }
      EXPECT_NEAR(lse[(size_t)(h * s.T + i)], best_s, 1e-9 * std::fabs(best_s));
      for (int64_t c = 0; c < s.D; ++c)
        EXPECT_NEAR(out[(size_t)((i * s.H + h) * s.D + c)], v2[(size_t)(best * s.D + c)], 1e-9);
      for (int64_t c = 0; c < s.D; ++c) EXPECT_TRUE(std::isfinite(out[(size_t)((i * s.H + h) * s.D + c)]));
    }
}

// Float64 central differences of L = sum(out * W) for every element of q, k and v.
void check_gradients(const Shape4& s, float scale, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "B " << s.B << " T " << s.T << " H " << s.H << " Hkv "
                                    << s.Hkv << " D " << s.D);
  Inputs in = random_inputs(s, DType::kF64, seed);
  AttentionOptions o;
  o.scale = scale;
  const std::vector<double> w = random_normal(s.B * s.T * s.H * s.D, seed + 7);
  const Tensor dout = host_tensor({s.B, s.T, s.H, s.D}, DType::kF64, w);
  Outputs r = forward(in, s, DType::kF64, o);
  // Outputs pre-filled with NaN: the backward must overwrite every element.
  const double nan = std::nan("");
  Tensor dq = host_tensor({s.B, s.T, s.H, s.D}, DType::kF64, std::vector<double>((size_t)(s.B * s.T * s.H * s.D), nan));
  Tensor dk = host_tensor({s.B, s.T, s.Hkv, s.D}, DType::kF64, std::vector<double>((size_t)(s.B * s.T * s.Hkv * s.D), nan));
  Tensor dv = host_tensor({s.B, s.T, s.Hkv, s.D}, DType::kF64, std::vector<double>((size_t)(s.B * s.T * s.Hkv * s.D), nan));
  attention_backward(dout, in.q, in.k, in.v, r.out, r.lse, dq, dk, dv, o);
  auto loss = [&] {
    const Outputs f = forward(in, s, DType::kF64, o);
    return testing::dot(values_of(f.out), w);
  };
  EXPECT_TRUE(check_gradient(loss, in.q.ptr<double>(), in.q.numel(), values_of(dq), "dq"));
  EXPECT_TRUE(check_gradient(loss, in.k.ptr<double>(), in.k.numel(), values_of(dk), "dk"));
  EXPECT_TRUE(check_gradient(loss, in.v.ptr<double>(), in.v.numel(), values_of(dv), "dv"));
}

TEST(OpsAttention, BackwardMatchesFiniteDifferences) {
  check_gradients({2, 5, 4, 2, 3}, 0.7f, 31);  // GQA, group of 2
  check_gradients({1, 4, 3, 3, 2}, 1.3f, 41);  // plain multi-head
  check_gradients({1, 6, 4, 1, 2}, 0.9f, 51);  // multi-query (Hkv = 1)
  check_gradients({2, 1, 2, 1, 3}, 0.6f, 61);  // T = 1
}

// AttentionOptions::rope_backward: with q and k produced by rope_forward, dq and dk come back as
// the gradients w.r.t. RoPE's inputs. Checked two ways (f64): equal to the separate
// rope_backward_inplace over all B * T tokens, and against central differences of
// L = sum(dout * attention(rope(q), rope(k), v)) in a few elements of q and k.
TEST(OpsAttention, RopeBackwardOptionGivesTheGradientsBeforeRope) {
  const Shape4 s{2, 5, 4, 2, 6};
  const int64_t N = s.B * s.T;
  const float theta = 100.0f;
  const Inputs raw = random_inputs(s, DType::kF64, 91);
  const Tensor positions = host_ints({N}, {3, 0, 7, 1, 2, 40, -2, 5, 6, 1000});
  auto tokens = [](const Tensor& x) {
    TensorView v = x.view();
    v.shape = fourbit::Shape{x.shape()[0] * x.shape()[1], x.shape()[2], x.shape()[3]};
    v.strides = contiguous_strides(v.shape);
    return v;
  };
  auto rotated = [&](const Inputs& in) {
    Inputs r{Tensor::empty(in.q.shape(), DType::kF64, Device::kCpu), Tensor::empty(in.k.shape(), DType::kF64, Device::kCpu),
             in.v};
    rope_forward(tokens(r.q), tokens(r.k), tokens(in.q), tokens(in.k), positions, theta);
    return r;
  };
  const Tensor dout = host_tensor({s.B, s.T, s.H, s.D}, DType::kF64, random_normal(s.B * s.T * s.H * s.D, 92));
  auto loss = [&](const Inputs& in) {
    const Outputs o = forward(rotated(in), s, DType::kF64);
    const std::vector<double> out = values_of(o.out), d = values_of(dout);
    double l = 0;
    for (size_t i = 0; i < out.size(); ++i) l += out[i] * d[i];
    return l;
  };
  const Inputs rot = rotated(raw);
  const Outputs o = forward(rot, s, DType::kF64);
  auto grads = [&] {
    return Inputs{Tensor::empty({s.B, s.T, s.H, s.D}, DType::kF64, Device::kCpu),
                  Tensor::empty({s.B, s.T, s.Hkv, s.D}, DType::kF64, Device::kCpu),
                  Tensor::empty({s.B, s.T, s.Hkv, s.D}, DType::kF64, Device::kCpu)};
  };
  Inputs separate = grads(), fused = grads();
  attention_backward(dout, rot.q, rot.k, rot.v, o.out, o.lse, separate.q, separate.k, separate.v);
  rope_backward_inplace(tokens(separate.q), tokens(separate.k), positions, theta);
  AttentionOptions options;
  options.rope_backward = AttentionOptions::RopeBackward{positions, theta};
  attention_backward(dout, rot.q, rot.k, rot.v, o.out, o.lse, fused.q, fused.k, fused.v, options);
  auto exact = [](int64_t) { return 0.0; };
  EXPECT_TRUE(all_close(values_of(fused.q), values_of(separate.q), exact, "dq"));
  EXPECT_TRUE(all_close(values_of(fused.k), values_of(separate.k), exact, "dk"));
  EXPECT_TRUE(all_close(values_of(fused.v), values_of(separate.v), exact, "dv"));

  const double h = 1e-6;
  for (const bool is_q : {true, false}) {
    const Tensor& x = is_q ? raw.q : raw.k;
    const std::vector<double> g = values_of(is_q ? fused.q : fused.k);
    for (const int64_t i : {int64_t{0}, int64_t{17}, x.numel() / 2 + 3, x.numel() - 1}) {
      Inputs plus{host_tensor(raw.q.shape(), DType::kF64, values_of(raw.q)),
                  host_tensor(raw.k.shape(), DType::kF64, values_of(raw.k)), raw.v};
      Inputs minus{host_tensor(raw.q.shape(), DType::kF64, values_of(raw.q)),
                   host_tensor(raw.k.shape(), DType::kF64, values_of(raw.k)), raw.v};
      (is_q ? plus.q : plus.k).ptr<double>()[i] += h;
      (is_q ? minus.q : minus.k).ptr<double>()[i] -= h;
      const double numeric = (loss(plus) - loss(minus)) / (2 * h);
      EXPECT_NEAR(g[(size_t)i], numeric, 1e-6 * (1.0 + std::fabs(numeric)))
          << (is_q ? "dq" : "dk") << " element " << i;
    }
  }
  expect_error(
      [&] {
        AttentionOptions bad;
        bad.rope_backward = AttentionOptions::RopeBackward{host_ints({N - 1}, std::vector<int32_t>((size_t)(N - 1), 0)), theta};
        attention_backward(dout, rot.q, rot.k, rot.v, o.out, o.lse, fused.q, fused.k, fused.v, bad);
      },
      "rope_backward.positions must be a contiguous i32 [B * T] = (10)");
}

TEST(OpsAttention, GroupedQueryAttentionEqualsRepeatedKeyValueHeads) {
  const Shape4 s{2, 6, 6, 2, 4};
  const Shape4 full{2, 6, 6, 6, 4};
  const Inputs in = random_inputs(s, DType::kF64, 71);
  // Repeat each kv head over its group of 3 query heads.
  auto repeat = [&](const Tensor& x) {
    const std::vector<double> v = values_of(x);
    std::vector<double> r((size_t)(full.B * full.T * full.H * full.D));
    for (int64_t b = 0; b < s.B; ++b)
      for (int64_t t = 0; t < s.T; ++t)
        for (int64_t h = 0; h < s.H; ++h)
          for (int64_t c = 0; c < s.D; ++c)
            r[(size_t)(((b * s.T + t) * s.H + h) * s.D + c)] =
                v[(size_t)(((b * s.T + t) * s.Hkv + h / 3) * s.D + c)];
    return host_tensor({full.B, full.T, full.H, full.D}, DType::kF64, r);
  };
  const Inputs rep{in.q, repeat(in.k), repeat(in.v)};
  const Outputs a = forward(in, s, DType::kF64), b = forward(rep, full, DType::kF64);
  auto exact = [](int64_t) { return 1e-13; };
  EXPECT_TRUE(all_close(values_of(a.out), values_of(b.out), exact, "out"));
  EXPECT_TRUE(all_close(values_of(a.lse), values_of(b.lse), exact, "lse"));

  const Tensor dout = host_tensor({s.B, s.T, s.H, s.D}, DType::kF64, random_normal(s.B * s.T * s.H * s.D, 72));
  Tensor dq = Tensor::empty({s.B, s.T, s.H, s.D}, DType::kF64, Device::kCpu);
  Tensor dk = Tensor::empty({s.B, s.T, s.Hkv, s.D}, DType::kF64, Device::kCpu);
  Tensor dv = Tensor::empty({s.B, s.T, s.Hkv, s.D}, DType::kF64, Device::kCpu);
  Tensor dq2 = Tensor::empty({s.B, s.T, s.H, s.D}, DType::kF64, Device::kCpu);
  Tensor dk2 = Tensor::empty({s.B, s.T, s.H, s.D}, DType::kF64, Device::kCpu);
  Tensor dv2 = Tensor::empty({s.B, s.T, s.H, s.D}, DType::kF64, Device::kCpu);
  attention_backward(dout, in.q, in.k, in.v, a.out, a.lse, dq, dk, dv);
  attention_backward(dout, rep.q, rep.k, rep.v, b.out, b.lse, dq2, dk2, dv2);
  EXPECT_TRUE(all_close(values_of(dq), values_of(dq2), exact, "dq"));
  // The GQA gradient of a kv head is the sum over its group of the repeated heads' gradients.
  auto group_sum = [&](const Tensor& x) {
    const std::vector<double> v = values_of(x);
    std::vector<double> r((size_t)(s.B * s.T * s.Hkv * s.D), 0.0);
    for (int64_t b = 0; b < s.B; ++b)
      for (int64_t t = 0; t < s.T; ++t)
        for (int64_t h = 0; h < s.H; ++h)
          for (int64_t c = 0; c < s.D; ++c)
            r[(size_t)(((b * s.T + t) * s.Hkv + h / 3) * s.D + c)] +=
                v[(size_t)(((b * s.T + t) * s.H + h) * s.D + c)];
    return r;
  };
  EXPECT_TRUE(all_close(values_of(dk), group_sum(dk2), exact, "dk"));
  EXPECT_TRUE(all_close(values_of(dv), group_sum(dv2), exact, "dv"));
}

// Views [B, T, heads, D] into a fused buffer [B, T, H + 2 Hkv, D] (as the QKV GEMM writes it).
TensorView fused_slice(const Tensor& fused, int64_t head0, int64_t heads) {
  TensorView v = fused.view();
  v.data = fused.ptr<double>() + head0 * fused.shape()[3];
  v.shape = {fused.shape()[0], fused.shape()[1], heads, fused.shape()[3]};
  return v;  // strides stay those of the fused buffer
}

TEST(OpsAttention, StridedFusedQkvViewsGiveTheContiguousResults) {
  const Shape4 s{2, 5, 4, 2, 3};
  const int64_t heads = s.H + 2 * s.Hkv;
  const Tensor fused = host_tensor({s.B, s.T, heads, s.D}, DType::kF64, random_normal(s.B * s.T * heads * s.D, 81));
  const TensorView q = fused_slice(fused, 0, s.H), k = fused_slice(fused, s.H, s.Hkv),
                   v = fused_slice(fused, s.H + s.Hkv, s.Hkv);
  // Contiguous copies, element by element.
  auto contiguous = [&](const TensorView& x) {
    Tensor c = Tensor::empty(x.shape, DType::kF64, Device::kCpu);
    int64_t i = 0;
    for (int64_t b = 0; b < x.shape[0]; ++b)
      for (int64_t t = 0; t < x.shape[1]; ++t)
        for (int64_t h = 0; h < x.shape[2]; ++h)
          for (int64_t d = 0; d < x.shape[3]; ++d)
            c.ptr<double>()[i++] =
                x.ptr<double>()[b * x.strides[0] + t * x.strides[1] + h * x.strides[2] + d];
    return c;
  };
  const Inputs in{contiguous(q), contiguous(k), contiguous(v)};
  const Outputs ref = forward(in, s, DType::kF64);
  Outputs got{Tensor::empty({s.B, s.T, s.H, s.D}, DType::kF64, Device::kCpu),
              Tensor::empty({s.B, s.H, s.T}, DType::kF64, Device::kCpu)};
  attention_forward(q, k, v, got.out, got.lse);
  auto exact = [](int64_t) { return 0.0; };
  EXPECT_TRUE(all_close(values_of(got.out), values_of(ref.out), exact, "out"));
  EXPECT_TRUE(all_close(values_of(got.lse), values_of(ref.lse), exact, "lse"));

  const Tensor dout = host_tensor({s.B, s.T, s.H, s.D}, DType::kF64, random_normal(s.B * s.T * s.H * s.D, 82));
  Tensor dq = Tensor::empty({s.B, s.T, s.H, s.D}, DType::kF64, Device::kCpu);
  Tensor dk = Tensor::empty({s.B, s.T, s.Hkv, s.D}, DType::kF64, Device::kCpu);
  Tensor dv = Tensor::empty({s.B, s.T, s.Hkv, s.D}, DType::kF64, Device::kCpu);
  attention_backward(dout, in.q, in.k, in.v, ref.out, ref.lse, dq, dk, dv);
  const Tensor dfused = Tensor::zeros({s.B, s.T, heads, s.D}, DType::kF64, Device::kCpu);
  const TensorView gq = fused_slice(dfused, 0, s.H), gk = fused_slice(dfused, s.H, s.Hkv),
                   gv = fused_slice(dfused, s.H + s.Hkv, s.Hkv);
  attention_backward(dout, q, k, v, ref.out, ref.lse, gq, gk, gv);
  EXPECT_TRUE(all_close(values_of(contiguous(gq)), values_of(dq), exact, "dq"));
  EXPECT_TRUE(all_close(values_of(contiguous(gk)), values_of(dk), exact, "dk"));
  EXPECT_TRUE(all_close(values_of(contiguous(gv)), values_of(dv), exact, "dv"));
}

TEST(OpsAttention, DecodeEqualsTheLastRowsOfTheFullForward) {
  // Three sequences with 9, 5 and 3 cached positions in a cache of 10; 2 new tokens each.
  const int64_t B = 3, Tmax = 10, H = 4, Hkv = 2, D = 3, Tq = 2;
  const std::vector<int32_t> lengths = {9, 5, 3};
  const Tensor kc = host_tensor({B, Tmax, Hkv, D}, DType::kF64, random_normal(B * Tmax * Hkv * D, 91));
  const Tensor vc = host_tensor({B, Tmax, Hkv, D}, DType::kF64, random_normal(B * Tmax * Hkv * D, 92));
  const Tensor q = host_tensor({B, Tq, H, D}, DType::kF64, random_normal(B * Tq * H * D, 93));
  Tensor out = Tensor::empty({B, Tq, H, D}, DType::kF64, Device::kCpu);
  attention_decode(q, kc, vc, host_ints({B}, lengths), out);
  const std::vector<double> got = values_of(out), qv = values_of(q), kv = values_of(kc), vv = values_of(vc);
  for (int64_t b = 0; b < B; ++b) {
    // The full causal forward over this sequence's len positions; its queries are arbitrary
    // except the last Tq, which are the decode queries.
    const int64_t len = lengths[(size_t)b];
    const Shape4 s{1, len, H, Hkv, D};
    std::vector<double> fq = random_normal(len * H * D, 94 + b), fk((size_t)(len * Hkv * D)), fv(fk.size());
    for (int64_t i = 0; i < len * Hkv * D; ++i) {
      fk[(size_t)i] = kv[(size_t)(b * Tmax * Hkv * D + i)];
      fv[(size_t)i] = vv[(size_t)(b * Tmax * Hkv * D + i)];
    }
    for (int64_t i = 0; i < Tq * H * D; ++i) fq[(size_t)((len - Tq) * H * D + i)] = qv[(size_t)(b * Tq * H * D + i)];
    const Inputs in{host_tensor({1, len, H, D}, DType::kF64, fq), host_tensor({1, len, Hkv, D}, DType::kF64, fk),
                    host_tensor({1, len, Hkv, D}, DType::kF64, fv)};
    const std::vector<double> full = values_of(forward(in, s, DType::kF64).out);
    for (int64_t i = 0; i < Tq * H * D; ++i)
      EXPECT_NEAR(got[(size_t)(b * Tq * H * D + i)], full[(size_t)((len - Tq) * H * D + i)], 1e-14)
          << "sequence " << b << " element " << i;
  }
}

TEST(OpsAttention, DecodeRowsBeforeTheStartArePaddingAndWriteZeros) {
  // len 1 < Tq = 3: tokens 0 and 1 would sit at negative positions (zeros); token 2 at position 0
  // sees only itself (out = v[0]). len 0: every row is padding.
  const int64_t B = 2, Tmax = 4, H = 2, Hkv = 1, D = 2, Tq = 3;
  const Tensor kc = host_tensor({B, Tmax, Hkv, D}, DType::kF64, random_normal(B * Tmax * Hkv * D, 101));
  const Tensor vc = host_tensor({B, Tmax, Hkv, D}, DType::kF64, random_normal(B * Tmax * Hkv * D, 102));
  const Tensor q = host_tensor({B, Tq, H, D}, DType::kF64, random_normal(B * Tq * H * D, 103));
  Tensor out = host_tensor({B, Tq, H, D}, DType::kF64, std::vector<double>((size_t)(B * Tq * H * D), 7.0));
  attention_decode(q, kc, vc, host_ints({B}, {1, 0}), out);
  const std::vector<double> o = values_of(out), v = values_of(vc);
  for (int64_t t = 0; t < Tq; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t c = 0; c < D; ++c) {
        const double want = t == 2 ? v[(size_t)c] : 0.0;
        EXPECT_EQ(o[(size_t)((t * H + h) * D + c)], want) << "b 0 t " << t;
        EXPECT_EQ(o[(size_t)(((Tq + t) * H + h) * D + c)], 0.0) << "b 1 t " << t;
      }
}

TEST(OpsAttention, F32ReferenceAgreesWithF64) {
  const Shape4 s{2, 7, 4, 2, 8};
  const Inputs in64 = random_inputs(s, DType::kF64, 111);
  const Inputs in32{host_tensor({s.B, s.T, s.H, s.D}, DType::kF32, values_of(in64.q)),
                    host_tensor({s.B, s.T, s.Hkv, s.D}, DType::kF32, values_of(in64.k)),
                    host_tensor({s.B, s.T, s.Hkv, s.D}, DType::kF32, values_of(in64.v))};
  const Outputs a = forward(in64, s, DType::kF64), b = forward(in32, s, DType::kF32);
  // Inputs rounded to f32 (2^-24 relative) move the outputs by a few 2^-24 of their scale.
  EXPECT_TRUE(all_close(values_of(b.out), values_of(a.out), [](int64_t) { return 1e-6; }, "out"));
  EXPECT_TRUE(all_close(values_of(b.lse), values_of(a.lse), [](int64_t) { return 1e-6; }, "lse"));
}

TEST(OpsAttention, ArgumentErrorsNameTheProblem) {
  const Shape4 s{1, 3, 4, 2, 2};
  const Inputs in = random_inputs(s, DType::kF32, 121);
  Tensor out = Tensor::empty({1, 3, 4, 2}, DType::kF32, Device::kCpu);
  Tensor lse = Tensor::empty({1, 4, 3}, DType::kF32, Device::kCpu);
  // H % Hkv != 0.
  const Tensor k3 = host_tensor({1, 3, 3, 2}, DType::kF32, random_normal(18, 1));
  expect_error([&] { attention_forward(in.q, k3, k3, out, lse); }, "multiple of the key/value heads");
  // Wrong shapes.
  const Tensor short_k = host_tensor({1, 2, 2, 2}, DType::kF32, random_normal(8, 1));
  expect_error([&] { attention_forward(in.q, short_k, in.v, out, lse); }, "k must be");
  Tensor bad_lse = Tensor::empty({1, 3, 4}, DType::kF32, Device::kCpu);
  expect_error([&] { attention_forward(in.q, in.k, in.v, out, bad_lse); }, "lse must be [B, H, T]");
  // Mixed dtypes and bf16 on the CPU.
  const Tensor v64 = host_tensor({1, 3, 2, 2}, DType::kF64, random_normal(12, 1));
  expect_error([&] { attention_forward(in.q, in.k, v64, out, lse); }, "v must be f32");
  const Inputs b16 = random_inputs(s, DType::kBF16, 122);
  Tensor out16 = Tensor::empty({1, 3, 4, 2}, DType::kBF16, Device::kCpu);
  expect_error([&] { attention_forward(b16.q, b16.k, b16.v, out16, lse); }, "bf16 attention runs on CUDA");
  // Mixed devices: the op names the tensor (no data is touched before the check).
  TensorView fake_cuda = out.view();
  fake_cuda.device = Device::kCuda;
  expect_error([&] { attention_forward(in.q, in.k, in.v, fake_cuda, lse); }, "out is on cuda");
  // Scale.
  AttentionOptions o;
  o.scale = -1.0f;
  expect_error([&] { attention_forward(in.q, in.k, in.v, out, lse, o); }, "scale must be finite and > 0");
  // Unit stride along D.
  const Tensor wide = host_tensor({1, 3, 4, 4}, DType::kF32, random_normal(48, 2));
  TensorView strided_q = wide.view();
  strided_q.shape[3] = 2;
  strided_q.strides[3] = 2;
  expect_error([&] { attention_forward(strided_q, in.k, in.v, out, lse); }, "q must have unit stride along D");
  // Decode: lengths outside [0, T_max].
  Tensor dq_out = Tensor::empty({1, 3, 4, 2}, DType::kF32, Device::kCpu);
  expect_error([&] { attention_decode(in.q, in.k, in.v, host_ints({1}, {4}), dq_out); },
               "cache_lengths[0] = 4 lies outside [0, T_max = 3]");
  expect_error([&] { attention_decode(in.q, in.k, in.v, host_ints({2}, {1, 1}), dq_out); },
               "cache_lengths must be a contiguous i32 [B]");
}

}  // namespace
}  // namespace fourbit::ops
