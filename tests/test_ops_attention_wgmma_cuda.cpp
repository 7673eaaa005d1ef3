// ops attention (gpu): single wgmma products through the wrappers of src/core/wgmma.cuh,
// on small-integer bf16 matrices (every product and FP32 sum exact, so the comparison is exact):
// D = A B^T with both operands K-major from swizzled shared memory (N = 32, 64, 128), and D = A B
// with A from registers and B MN-major (N = 64, 128: the attention kernels' N = D). This pins down what the attention kernels
// assume beyond the shared-memory layout (tested on the CPU by test_ops_attention_wgmma_layout):
// the accumulator and register-A fragment layouts are mma.m16n8k16's per warp. A failure here
// points at the instruction's use; a failure only in WgmmaKernelsMatchTheReference, at the
// attention logic.
#include "ops/attention.h"

#include "dense_ops_test_util.h"
#include "wgmma_probe_kernels.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace fourbit::ops {
namespace {

using testing::host_tensor;
using testing::random_ints;
using testing::values_of;

std::vector<double> small_ints(int64_t n, uint64_t seed) {
  std::vector<double> v;
  for (int32_t x : random_ints(n, -4, 4, seed)) v.push_back(x);
  return v;
}

TEST(OpsAttentionWgmmaCuda, SingleProductsMatchExactly) {
  if (!attention_wgmma_available()) GTEST_SKIP() << "needs an sm_90a build on a compute 9.0 GPU";
  for (int n : {32, 64, 128}) {
    SCOPED_TRACE("N " + std::to_string(n));
    const std::vector<double> a = small_ints(64 * 64, 11 + n), b_nk = small_ints((int64_t)n * 64, 12 + n),
                              b_kn = small_ints(64 * (int64_t)n, 13 + n);
    const Tensor a_d = host_tensor({64, 64}, DType::kBF16, a).to(Device::kCuda);
    const Tensor b_nk_d = host_tensor({n, 64}, DType::kBF16, b_nk).to(Device::kCuda);
    const Tensor b_kn_d = host_tensor({64, n}, DType::kBF16, b_kn).to(Device::kCuda);
    Tensor d_ss = Tensor::empty({64, n}, DType::kF32, Device::kCuda);
    Tensor d_rs = Tensor::empty({64, n}, DType::kF32, Device::kCuda);
    ASSERT_EQ(fourbit::testing::run_wgmma_probe(n, a_d.ptr<uint16_t>(), b_nk_d.ptr<uint16_t>(), b_kn_d.ptr<uint16_t>(),
                                       d_ss.ptr<float>(), d_rs.ptr<float>()),
              cudaSuccess);
    const std::vector<double> ss = values_of(d_ss.to(Device::kCpu)), rs = values_of(d_rs.to(Device::kCpu));
    int bad_ss = 0, bad_rs = 0, first_ss = -1, first_rs = -1;
    for (int i = 0; i < 64; ++i)
      for (int j = 0; j < n; ++j) {
        double want_ss = 0, want_rs = 0;
        for (int k = 0; k < 64; ++k) {
          want_ss += a[i * 64 + k] * b_nk[(size_t)j * 64 + k];
          want_rs += a[i * 64 + k] * b_kn[(size_t)k * n + j];
        }
        const int idx = i * n + j;
        if (ss[(size_t)idx] != want_ss && bad_ss++ == 0) first_ss = idx;
        if (n >= 64 && rs[(size_t)idx] != want_rs && bad_rs++ == 0) first_rs = idx;
      }
    EXPECT_EQ(bad_ss, 0) << "A B^T (both K-major): first wrong element at row " << first_ss / n << ", column "
                         << first_ss % n;
    EXPECT_EQ(bad_rs, 0) << "A B (A in registers, B MN-major): first wrong element at row " << first_rs / n
                         << ", column " << first_rs % n;
  }
}

}  // namespace
}  // namespace fourbit::ops
