// ops rope (gpu): the CUDA kernel (forward, backward, both in place, q alone) against the CPU
// reference run in f32 on the same (dtype-rounded) inputs: bf16 and f32, several (N, H, Hkv, D)
// including D/2 not a multiple of 8 (ragged group) and D = 6 (misaligned halves: the scalar
// path), positions up to 2^20 and negative ones, contiguous tensors and strided slices of a fused
// QKV buffer (whose v slice must stay untouched), guard regions around every output.
//
// Tolerance (u = 2^-24). Both sides compute inv_freq and the angle identically (rope.h: f64 pow
// rounded to f32, one IEEE product), then cos/sin in FP32 (CUDA sincosf <= 2 ulp, glibc < 1 ulp)
// and one rotation (CUDA may contract into FMAs):
//   |got - want| <= 16 u (|x_lo| + |x_hi|) + 2^-8 |want| if bf16
#include "dense_ops_test_util.h"
#include "ops/rope.h"

#include <gtest/gtest.h>

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

constexpr double kU = 1.0 / (1 << 24);
constexpr uint8_t kPoison = 0x7F;

class OpsRopeCuda : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_GT(cuda_device_count(), 0) << "the gpu tests need a CUDA GPU"; }
};

struct Case {
  int64_t N, H, Hkv, D;
  DType dt;
};

std::vector<int32_t> positions_for(int64_t N, uint64_t seed) {
  std::vector<int32_t> p = random_ints(N, 0, 8191, seed);
  const int32_t special[] = {0, 1, 131071, 1 << 20, -3};
  for (size_t i = 0; i < std::size(special) && (int64_t)i < N; ++i) p[(size_t)i] = special[i];
  return p;
}

// Tolerance for rotating x ([N, heads, D], row-major values) into want.
std::function<double(int64_t)> tolerance(const std::vector<double>& x, const std::vector<double>& want,
                                         int64_t D, DType dt) {
  const double round = dt == DType::kBF16 ? 1.0 / 256 : 0.0;
  return [&x, &want, D, round](int64_t e) {
    const int64_t row = e / D, i = e % D, j = i % (D / 2);
    const double mag = std::fabs(x[(size_t)(row * D + j)]) + std::fabs(x[(size_t)(row * D + j + D / 2)]);
    return 16 * kU * mag + round * std::fabs(want[(size_t)e]) + 1e-37;
  };
}

// Reference rotation in f32 of x [N, heads, D].
std::vector<double> reference(const std::vector<double>& x, int64_t N, int64_t heads, int64_t D,
                              const Tensor& pos, float theta, bool inverse) {
  Tensor out = Tensor::empty({N, heads, D}, DType::kF32, Device::kCpu);
  const Tensor in = host_tensor({N, heads, D}, DType::kF32, x);
  if (inverse) {
    rope_backward(out, TensorView{}, in, TensorView{}, pos, theta);
  } else {
    rope_forward(out, TensorView{}, in, TensorView{}, pos, theta);
  }
  return values_of(out);
}

void run_case(const Case& cs) {
  const int64_t N = cs.N, H = cs.H, Hkv = cs.Hkv, D = cs.D;
  SCOPED_TRACE(::testing::Message() << "N " << N << " H " << H << " Hkv " << Hkv << " D " << D << " "
                                    << dtype_name(cs.dt));
  const float theta = 10000.0f;
  const std::vector<double> xq = rounded(random_normal(N * H * D, 1 + D), cs.dt);
  const std::vector<double> xk = rounded(random_normal(N * Hkv * D, 2 + D), cs.dt);
  const Tensor hpos = host_ints({N}, positions_for(N, 3 + N));
  const Tensor dpos = hpos.to(Device::kCuda);
  const Tensor hq = host_tensor({N, H, D}, cs.dt, xq), hk = host_tensor({N, Hkv, D}, cs.dt, xk);
  const Guarded gq = Guarded::copy_of(hq, kPoison), gk = Guarded::copy_of(hk, kPoison);

  for (bool inverse : {false, true}) {
    SCOPED_TRACE(inverse ? "backward" : "forward");
    const std::vector<double> wq = reference(xq, N, H, D, hpos, theta, inverse);
    const std::vector<double> wk = reference(xk, N, Hkv, D, hpos, theta, inverse);
    const auto tq = tolerance(xq, wq, D, cs.dt), tk = tolerance(xk, wk, D, cs.dt);

    const Guarded oq = Guarded::make({N, H, D}, cs.dt, kPoison), ok = Guarded::make({N, Hkv, D}, cs.dt, kPoison);
    if (inverse) {
      rope_backward(oq.view, ok.view, gq.view, gk.view, dpos, theta);
    } else {
      rope_forward(oq.view, ok.view, gq.view, gk.view, dpos, theta);
    }
    EXPECT_EQ(oq.damaged_guard_bytes(), 0) << "wrote outside the q output";
    EXPECT_EQ(ok.damaged_guard_bytes(), 0) << "wrote outside the k output";
    EXPECT_TRUE(all_close(oq.values(), wq, tq, "q"));
    EXPECT_TRUE(all_close(ok.values(), wk, tk, "k"));

    // q alone.
    const Guarded oq2 = Guarded::make({N, H, D}, cs.dt, kPoison);
    if (inverse) {
      rope_backward(oq2.view, TensorView{}, gq.view, TensorView{}, dpos, theta);
    } else {
      rope_forward(oq2.view, TensorView{}, gq.view, TensorView{}, dpos, theta);
    }
    EXPECT_TRUE(oq2.values() == oq.values()) << "q alone differs from q with k";

    // In place on strided slices of a fused [N, (H + 2 Hkv) D] buffer.
    const int64_t W = (H + 2 * Hkv) * D;
    std::vector<double> fused((size_t)(N * W));
    const std::vector<double> xv = rounded(random_normal(N * Hkv * D, 4 + D), cs.dt);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < W; ++c)
        fused[(size_t)(n * W + c)] = c < H * D            ? xq[(size_t)(n * H * D + c)]
                                     : c < (H + Hkv) * D ? xk[(size_t)(n * Hkv * D + c - H * D)]
                                                         : xv[(size_t)(n * Hkv * D + c - (H + Hkv) * D)];
    const Guarded buf = Guarded::copy_of(host_tensor({N, W}, cs.dt, fused), kPoison);
    TensorView qv = TensorView::contiguous(buf.view.data, cs.dt, {N, H, D}, Device::kCuda);
    qv.strides = Shape{W, D, 1};
    TensorView kv = qv;
    kv.shape = Shape{N, Hkv, D};
    kv.data = static_cast<char*>(buf.view.data) + dtype_bytes(cs.dt, H * D);
    if (inverse) {
      rope_backward_inplace(qv, kv, dpos, theta);
    } else {
      rope_forward_inplace(qv, kv, dpos, theta);
    }
    EXPECT_EQ(buf.damaged_guard_bytes(), 0) << "in place: wrote outside the fused buffer";
    const std::vector<double> after = buf.values();
    std::vector<double> got_q, got_k, got_v;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < W; ++c) {
        const double v = after[(size_t)(n * W + c)];
        (c < H * D ? got_q : c < (H + Hkv) * D ? got_k : got_v).push_back(v);
      }
    EXPECT_TRUE(got_q == oq.values()) << "in-place strided q differs from the out-of-place result";
    EXPECT_TRUE(got_k == ok.values()) << "in-place strided k differs from the out-of-place result";
    EXPECT_TRUE(got_v == xv) << "the v slice of the fused buffer was modified";
    if (inverse) continue;

    // The fused KV-cache append (rope_forward_inplace_append): the same in-place rotation, and the
    // rotated keys and the values in the cache rows write_pos names. R rows per sequence at
    // positions 2 .. R + 1; one row at position -1 and one at t_max append nothing; positions 0
    // and 1 are never written and must keep the poison.
    const int64_t R = N % 3 == 0 ? 3 : 1, Bc = N / R, t_max = R + 3;
    std::vector<int32_t> wpos((size_t)N);
    for (int64_t n = 0; n < N; ++n) wpos[(size_t)n] = (int32_t)(n % R + 2);
    if (N > 2) wpos[1] = -1;
    if (N > 3) wpos[3] = (int32_t)t_max;
    const Tensor dwpos = host_ints({N}, wpos).to(Device::kCuda);
    const Guarded buf2 = Guarded::copy_of(host_tensor({N, W}, cs.dt, fused), kPoison);
    TensorView q2 = qv, k2 = kv, v2 = kv;
    q2.data = buf2.view.data;
    k2.data = static_cast<char*>(buf2.view.data) + dtype_bytes(cs.dt, H * D);
    v2.data = static_cast<char*>(buf2.view.data) + dtype_bytes(cs.dt, (H + Hkv) * D);
    const Guarded kc = Guarded::make({Bc, t_max, Hkv, D}, cs.dt, kPoison);
    const Guarded vc = Guarded::make({Bc, t_max, Hkv, D}, cs.dt, kPoison);
    RopeCacheAppend ap;
    ap.v = v2;
    ap.k_cache = kc.view;
    ap.v_cache = vc.view;
    ap.write_pos = dwpos.view();
    ap.rows_per_seq = R;
    rope_forward_inplace_append(q2, k2, dpos, theta, ap);
    EXPECT_EQ(buf2.damaged_guard_bytes() + kc.damaged_guard_bytes() + vc.damaged_guard_bytes(), 0)
        << "append: wrote outside a buffer";
    EXPECT_TRUE(buf2.values() == after) << "append: the in-place rotation differs from rope_forward_inplace";
    const std::vector<double> kcv = kc.values(), vcv = vc.values();
    const std::vector<double> poison = Guarded::make({1}, cs.dt, kPoison).values();
    int64_t wrong = 0;
    for (int64_t n = 0; n < N; ++n) {
      const int32_t p = wpos[(size_t)n];
      if (p < 0 || p >= t_max) continue;
      for (int64_t e = 0; e < Hkv * D; ++e) {
        const size_t at = (size_t)(((n / R) * t_max + p) * Hkv * D + e);
        wrong += kcv[at] != got_k[(size_t)(n * Hkv * D + e)];
        wrong += vcv[at] != xv[(size_t)(n * Hkv * D + e)];
      }
    }
    for (int64_t b = 0; b < Bc; ++b)
      for (int64_t p = 0; p < 2; ++p)
        for (int64_t e = 0; e < Hkv * D; ++e) {
          const size_t at = (size_t)((b * t_max + p) * Hkv * D + e);
          wrong += !(kcv[at] == poison[0] || (std::isnan(kcv[at]) && std::isnan(poison[0])));
          wrong += !(vcv[at] == poison[0] || (std::isnan(vcv[at]) && std::isnan(poison[0])));
        }
    EXPECT_EQ(wrong, 0) << "append: cache entries differ from the rotated keys / the values / the poison";
  }
}

TEST_F(OpsRopeCuda, MatchesReference) {
  const Case cases[] = {
      {1, 1, 1, 2, DType::kF32},      {5, 3, 1, 6, DType::kBF16},   {5, 3, 1, 6, DType::kF32},
      {17, 32, 8, 128, DType::kBF16}, {64, 12, 12, 64, DType::kBF16}, {64, 12, 12, 64, DType::kF32},
      {3, 4, 2, 256, DType::kBF16},   {9, 2, 2, 40, DType::kBF16},   {2, 1, 1, 512, DType::kF32},
      {2000, 4, 1, 128, DType::kBF16},
  };
  for (const Case& cs : cases) run_case(cs);
}

}  // namespace
}  // namespace fourbit::ops
