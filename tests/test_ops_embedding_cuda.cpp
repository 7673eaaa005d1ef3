// ops embedding (gpu): the CUDA lookup against the CPU reference (bit for bit: a copy through
// FP32, rounded once to the output dtype) for every table/out dtype pair, odd and model-sized
// shapes, misaligned rows; the deterministic sort-based backward against the f32 reference with
// heavily repeated ids (one id taking 40% of the tokens), bf16 and f32 dout, guard regions, the
// same bits on a second run; out-of-range ids through a caller's flag and the synchronous check.
//
// Backward tolerance (u = 2^-24): dtable[v, c] = dtable0 + sum of the k_v dout values of id v, in
// f32 on both sides in different orders (the reference adds to dtable0 token by token, the kernel
// sums the tokens first), so |got - want| <= 2 (k_v + 2) u (|dtable0| + sum |dout|).
#include "dense_ops_test_util.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/error_flags.h"

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

class OpsEmbeddingCuda : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_GT(cuda_device_count(), 0) << "the gpu tests need a CUDA GPU"; }
};

double exact(int64_t) { return 0.0; }

TEST_F(OpsEmbeddingCuda, ForwardMatchesReferenceExactly) {
  struct Case {
    int64_t N, V, C, shift_elems;
  };
  const Case cases[] = {{1, 1, 1, 0}, {7, 50, 9, 0}, {1000, 50257, 264, 0}, {64, 128, 4096, 1}, {33, 1000, 100, 3}};
  for (const Case& cs : cases)
    for (DType tt : {DType::kBF16, DType::kF32})
      for (DType to : {DType::kBF16, DType::kF32}) {
        SCOPED_TRACE(::testing::Message() << "N " << cs.N << " V " << cs.V << " C " << cs.C << " table "
                                          << dtype_name(tt) << " out " << dtype_name(to) << " shift " << cs.shift_elems);
        const std::vector<double> table = rounded(random_normal(cs.V * cs.C, 1 + cs.V), tt);
        const std::vector<int32_t> id = random_ints(cs.N, 0, (int32_t)cs.V - 1, 2 + cs.N);
        Tensor ref = Tensor::empty({cs.N, cs.C}, DType::kF32, Device::kCpu);
        embedding_forward(ref, host_ints({cs.N}, id), host_tensor({cs.V, cs.C}, DType::kF32, table));
        const std::vector<double> want = rounded(values_of(ref), to);

        const Guarded gt = Guarded::copy_of(host_tensor({cs.V, cs.C}, tt, table), kPoison);
        const Guarded out = Guarded::make({cs.N, cs.C}, to, kPoison, cs.shift_elems * dtype_bytes(to, 1));
        embedding_forward(out.view, host_ints({cs.N}, id).to(Device::kCuda), gt.view);
        EXPECT_EQ(out.damaged_guard_bytes(), 0) << "forward wrote outside out";
        EXPECT_TRUE(all_close(out.values(), want, exact, "out"));
      }
}

void run_backward(int64_t N, int64_t V, int64_t C, DType dout_type, bool hot_id) {
  SCOPED_TRACE(::testing::Message() << "N " << N << " V " << V << " C " << C << " dout "
                                    << dtype_name(dout_type) << (hot_id ? " hot id" : ""));
  std::vector<int32_t> id = random_ints(N, 0, (int32_t)V - 1, 5 + N);
  if (hot_id)
    for (int64_t n = 0; n < N; n += 5) id[(size_t)n] = id[(size_t)(n + 2 < N ? n + 2 : 0)] = 7 % (int32_t)V;
  const std::vector<double> dout = rounded(random_normal(N * C, 6 + C), dout_type);
  const std::vector<double> d0 = rounded(random_normal(V * C, 7 + C, 0.1), DType::kF32);

  Tensor ref = host_tensor({V, C}, DType::kF32, d0);
  embedding_backward(ref, host_tensor({N, C}, DType::kF32, dout), host_ints({N}, id), TensorView{});
  const std::vector<double> want = values_of(ref);
  std::vector<double> mag(d0.size()), count((size_t)V, 0.0);
  for (size_t i = 0; i < d0.size(); ++i) mag[i] = std::fabs(d0[i]);
  for (int64_t n = 0; n < N; ++n) {
    count[(size_t)id[(size_t)n]] += 1;
    for (int64_t c = 0; c < C; ++c) mag[(size_t)(id[(size_t)n] * C + c)] += std::fabs(dout[(size_t)(n * C + c)]);
  }
  auto tol = [&](int64_t e) { return 2 * (count[(size_t)(e / C)] + 2) * kU * mag[(size_t)e]; };

  const Guarded gd = Guarded::copy_of(host_tensor({N, C}, dout_type, dout), kPoison);
  const Tensor gid = host_ints({N}, id).to(Device::kCuda);
  const Guarded ws = Guarded::make({embedding_backward_workspace_bytes(N, V, Device::kCuda)}, DType::kU8, kPoison);
  std::vector<double> first;
  for (int rep = 0; rep < 2; ++rep) {
    const Guarded dt = Guarded::copy_of(host_tensor({V, C}, DType::kF32, d0), kPoison);
    embedding_backward(dt.view, gd.view, gid, ws.view);
    EXPECT_EQ(dt.damaged_guard_bytes(), 0) << "backward wrote outside dtable";
    EXPECT_EQ(ws.damaged_guard_bytes(), 0) << "backward wrote outside its workspace";
    const std::vector<double> got = dt.values();
    if (rep == 0) {
      EXPECT_TRUE(all_close(got, want, tol, "dtable"));
      first = got;
    } else {
      EXPECT_TRUE(got == first) << "dtable differs between two identical runs (not deterministic)";
    }
  }
}

TEST_F(OpsEmbeddingCuda, BackwardMatchesReferenceAndIsDeterministic) {
  for (DType dt : {DType::kBF16, DType::kF32}) {
    run_backward(1, 1, 1, dt, false);
    run_backward(9, 5, 13, dt, false);
    run_backward(5000, 50, 300, dt, false);      // long runs of equal ids
    run_backward(4096, 50257, 136, dt, true);   // 40% of the tokens on one id
    run_backward(2048, 128256, 20, dt, false);  // a vocabulary needing 17 key bits
    run_backward(3000, 1000, 4099, dt, false);  // 17 column slices, the last ragged
  }
}

TEST_F(OpsEmbeddingCuda, OutOfRangeIds) {
  const int64_t V = 10, C = 16, N = 4;
  const Tensor table = host_tensor({V, C}, DType::kBF16, random_normal(V * C, 1)).to(Device::kCuda);
  const Tensor ids = host_ints({N}, {1, 10, 2, -1}).to(Device::kCuda);
  Tensor out = Tensor::empty({N, C}, DType::kBF16, Device::kCuda);
  Tensor flag = Tensor::zeros({1}, DType::kI32, Device::kCuda);
  embedding_forward(out, ids, table, flag.ptr<int>());
  EXPECT_EQ(read_and_clear_error_flag(flag.ptr<int>()), kErrIndexOutOfRange);
  const std::vector<double> o = values_of(out);
  for (int64_t c = 0; c < C; ++c) {
    EXPECT_EQ(o[(size_t)(C + c)], 0.0) << "an invalid id's row must be zero";
    EXPECT_EQ(o[(size_t)(3 * C + c)], 0.0) << "an invalid id's row must be zero";
  }
  try {
    embedding_forward(out, ids, table);
    ADD_FAILURE() << "the synchronous check did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("outside the vocabulary [0, 10)"), std::string::npos) << e.what();
  }
  // Backward: invalid tokens are skipped, valid ones accumulate.
  Tensor dtable = Tensor::zeros({V, C}, DType::kF32, Device::kCuda);
  const Tensor dout = host_tensor({N, C}, DType::kF32, std::vector<double>((size_t)(N * C), 1.0)).to(Device::kCuda);
  Tensor ws = Tensor::empty({embedding_backward_workspace_bytes(N, V, Device::kCuda)}, DType::kU8, Device::kCuda);
  embedding_backward(dtable, dout, ids, ws, flag.ptr<int>());
  EXPECT_EQ(read_and_clear_error_flag(flag.ptr<int>()), kErrIndexOutOfRange);
  const std::vector<double> d = values_of(dtable);
  double total = 0;
  for (double x : d) total += x;
  EXPECT_EQ(total, 2.0 * C) << "only the two valid tokens may contribute";
  EXPECT_EQ(d[(size_t)(1 * C)], 1.0);
  EXPECT_EQ(d[(size_t)(2 * C)], 1.0);
}

}  // namespace
}  // namespace fourbit::ops
