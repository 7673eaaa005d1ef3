// ops embedding (cpu): the reference lookup and scatter-add against hand-computed values
// (repeated ids accumulate, untouched rows stay), float64 central differences for dtable,
// accumulation into a non-zero dtable, zero tokens, and argument errors (out-of-range ids name the
// token).
#include "dense_ops_test_util.h"
#include "ops/embedding.h"

#include <gtest/gtest.h>

namespace fourbit::ops {
namespace {

using testing::check_gradient;
using testing::dot;
using testing::host_ints;
using testing::host_tensor;
using testing::random_ints;
using testing::random_normal;
using testing::values_of;

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(OpsEmbedding, HandComputed) {
  for (DType dt : {DType::kF32, DType::kF64}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor table = host_tensor({3, 2}, dt, {1, 2, 3, 4, 5, 6});
    const Tensor ids = host_ints({3}, {2, 0, 2});
    Tensor out = Tensor::empty({3, 2}, dt, Device::kCpu);
    embedding_forward(out, ids, table);
    EXPECT_EQ(values_of(out), (std::vector<double>{5, 6, 1, 2, 5, 6}));
    Tensor dtable = host_tensor({3, 2}, dt, {10, 10, 10, 10, 10, 10});
    embedding_backward(dtable, host_tensor({3, 2}, dt, {1, 2, 3, 4, 5, 6}), ids, TensorView{});
    EXPECT_EQ(values_of(dtable), (std::vector<double>{13, 14, 10, 10, 16, 18}));
  }
}

TEST(OpsEmbedding, FiniteDifferencesFloat64) {
  const int64_t V = 6, C = 5, N = 9;
  std::vector<double> table = random_normal(V * C, 1);
  const std::vector<int32_t> id = random_ints(N, 0, (int32_t)V - 2, 2);  // id V-1 never used
  const Tensor ids = host_ints({N}, id);
  const std::vector<double> R = random_normal(N * C, 3);
  auto loss = [&] {
    Tensor out = Tensor::empty({N, C}, DType::kF64, Device::kCpu);
    embedding_forward(out, ids, host_tensor({V, C}, DType::kF64, table));
    return dot(values_of(out), R);
  };
  Tensor dtable = Tensor::zeros({V, C}, DType::kF64, Device::kCpu);
  embedding_backward(dtable, host_tensor({N, C}, DType::kF64, R), ids, TensorView{});
  EXPECT_TRUE(check_gradient(loss, table.data(), V * C, values_of(dtable), "dtable"));
}

TEST(OpsEmbedding, EmptyAndErrors) {
  const Tensor table = host_tensor({3, 2}, DType::kF32, {1, 2, 3, 4, 5, 6});
  Tensor out0 = Tensor::empty({0, 2}, DType::kF32, Device::kCpu);
  embedding_forward(out0, host_ints({0}, {}), table);
  Tensor dtable = host_tensor({3, 2}, DType::kF32, {1, 1, 1, 1, 1, 1});
  embedding_backward(dtable, out0, host_ints({0}, {}), TensorView{});
  EXPECT_EQ(values_of(dtable), std::vector<double>(6, 1.0));

  Tensor out = Tensor::empty({2, 2}, DType::kF32, Device::kCpu);
  std::string e = error_of([&] { embedding_forward(out, host_ints({2}, {0, 3}), table); });
  EXPECT_NE(e.find("ids[1] = 3 is outside the vocabulary [0, 3)"), std::string::npos) << e;
  e = error_of([&] { embedding_backward(dtable, out, host_ints({2}, {-1, 0}), TensorView{}); });
  EXPECT_NE(e.find("ids[0] = -1"), std::string::npos) << e;
  Tensor out64 = Tensor::empty({2, 2}, DType::kF64, Device::kCpu);
  EXPECT_NE(error_of([&] { embedding_forward(out64, host_ints({2}, {0, 1}), table); }).find("one dtype"), std::string::npos);
  Tensor out3 = Tensor::empty({2, 3}, DType::kF32, Device::kCpu);
  EXPECT_NE(error_of([&] { embedding_forward(out3, host_ints({2}, {0, 1}), table); }).find("out must have shape (2, 2)"), std::string::npos);
  EXPECT_NE(error_of([&] { embedding_forward(out, host_tensor({2}, DType::kF32, {0, 1}), table); }).find("i32"), std::string::npos);
}

}  // namespace
}  // namespace fourbit::ops
