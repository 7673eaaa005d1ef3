// The NCCL communicator (dist/nccl_communicator.h) on the GPUs this process sees: one rank per
// visible GPU, as threads of this process (each thread selects its GPU), every collective checked
// against the same reduction / movement computed on the CPU from the ranks' host inputs. With one
// GPU the world size is 1 and the code path (setup, unique-id file, every NCCL call) still runs.
// Fails (does not skip) without a GPU or without NCCL in the build, like the other gpu tests.
#include "dist/communicator.h"
#if defined(FOURBIT_WITH_NCCL)
#include "dist/nccl_communicator.h"
#endif

#include "core/device.h"
#include "formats/element.h"

#include <gtest/gtest.h>

#include <cmath>
#include <exception>
#include <filesystem>
#include <mutex>
#include <numeric>
#include <thread>
#include <unistd.h>

namespace fourbit::dist {
namespace {

namespace fs = std::filesystem;

double value(int rank, int64_t i) { return std::sin(0.37 * (double)i + 1.3 * rank) * (1 + rank); }

template <typename T>
Tensor upload(const std::vector<T>& host, DType dt) {
  Tensor d = Tensor::empty({(int64_t)host.size()}, dt, Device::kCuda);
  copy_tensor(d.view(), TensorView::contiguous(const_cast<T*>(host.data()), dt, {(int64_t)host.size()}, Device::kCpu));
  return d;
}

template <typename T>
std::vector<T> download(const TensorView& d) {
  std::vector<T> h((size_t)d.numel());
  copy_tensor(TensorView::contiguous(h.data(), d.dtype, {d.numel()}, Device::kCpu), d);
  return h;
}

#if defined(FOURBIT_WITH_NCCL)
// Runs fn(comm) on one thread per GPU; rethrows the first failure.
void on_every_gpu(int world, const std::function<void(Communicator&)>& fn) {
  const std::string dir = (fs::temp_directory_path() / ("fourbit_nccl_test_" + std::to_string(::getpid()))).string();
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        std::unique_ptr<Communicator> comm = make_nccl_communicator(r, world, r, dir + "/id");
        fn(*comm);
      } catch (...) {
        std::lock_guard<std::mutex> lk(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  fs::remove_all(dir);
  if (first) std::rethrow_exception(first);
}
#endif

TEST(DistNccl, CollectivesMatchTheCpuReduction) {
  ASSERT_GT(cuda_device_count(), 0) << "no CUDA device: this gpu test cannot run";
#if !defined(FOURBIT_WITH_NCCL)
  FAIL() << "this CUDA build has no NCCL (nccl.h / libnccl not found at configure time)";
#else
  const int world = cuda_device_count();
  std::printf("NCCL test over %d GPU(s)\n", world);
  const int64_t n = 1000;
  on_every_gpu(world, [&](Communicator& c) {
    const int r = c.rank();
    ASSERT_EQ(c.size(), world);
    // all_reduce f64 / f32 / bf16 against the CPU sum.
    {
      std::vector<double> h64((size_t)n);
      std::vector<float> h32((size_t)n);
      std::vector<uint16_t> h16((size_t)n);
      for (int64_t i = 0; i < n; ++i) {
        h64[(size_t)i] = value(r, i);
        h32[(size_t)i] = (float)value(r, i);
        h16[(size_t)i] = formats::encode_bf16_rn((float)value(r, i));
      }
      Tensor d64 = upload(h64, DType::kF64), d32 = upload(h32, DType::kF32), d16 = upload(h16, DType::kBF16);
      c.all_reduce_sum(d64.view());
      c.all_reduce_sum(d32.view());
      c.all_reduce_sum(d16.view());
      const std::vector<double> g64 = download<double>(d64.view());
      const std::vector<float> g32 = download<float>(d32.view());
      const std::vector<uint16_t> g16 = download<uint16_t>(d16.view());
      for (int64_t i = 0; i < n; ++i) {
        double s64 = 0, s32 = 0, s16 = 0;
        for (int p = 0; p < world; ++p) {
          s64 += value(p, i);
          s32 += (double)(float)value(p, i);
          s16 += (double)formats::decode_bf16(formats::encode_bf16_rn((float)value(p, i)));
        }
        ASSERT_NEAR(g64[(size_t)i], s64, 1e-12 * world) << i;
        ASSERT_NEAR(g32[(size_t)i], s32, 1e-6 * world * (1 + std::abs(s32))) << i;
        // bf16: NCCL may round after every addition: world roundings of 2^-8 relative each.
        ASSERT_NEAR(formats::decode_bf16(g16[(size_t)i]), s16, world * std::ldexp(1.0, -8) * (world + std::abs(s16))) << i;
      }
    }
    // reduce_scatter (uneven, in place) then all_gather (uneven, in place) of f32.
    {
      std::vector<int64_t> counts;
      for (int p = 0; p < world; ++p) counts.push_back(100 + 37 * p);
      const int64_t total = std::accumulate(counts.begin(), counts.end(), (int64_t)0);
      int64_t off = 0;
      for (int p = 0; p < r; ++p) off += counts[(size_t)p];
      std::vector<float> h((size_t)total);
      for (int64_t i = 0; i < total; ++i) h[(size_t)i] = (float)value(r, i);
      Tensor d = upload(h, DType::kF32);
      const TensorView own = TensorView::contiguous(d.ptr<float>() + off, DType::kF32, {counts[(size_t)r]}, Device::kCuda);
      c.reduce_scatter_sum(d.view(), own, counts);
      c.all_gather(own, d.view(), counts);
      const std::vector<float> g = download<float>(d.view());
      for (int64_t i = 0; i < total; ++i) {
        double s = 0;
        for (int p = 0; p < world; ++p) s += (double)(float)value(p, i);
        ASSERT_NEAR(g[(size_t)i], s, 1e-6 * world * (1 + std::abs(s))) << i;
      }
      // Equal counts take NCCL's own ReduceScatter / AllGather.
      const std::vector<int64_t> equal((size_t)world, 64);
      std::vector<float> e((size_t)(64 * world));
      for (size_t i = 0; i < e.size(); ++i) e[i] = (float)value(r, (int64_t)i);
      Tensor de = upload(e, DType::kF32);
      Tensor mine = Tensor::empty({64}, DType::kF32, Device::kCuda);
      c.reduce_scatter_sum(de.view(), mine.view(), equal);
      c.all_gather(mine.view(), de.view(), equal);
      const std::vector<float> ge = download<float>(de.view());
      for (size_t i = 0; i < ge.size(); ++i) {
        double s = 0;
        for (int p = 0; p < world; ++p) s += (double)(float)value(p, (int64_t)i);
        ASSERT_NEAR(ge[i], s, 1e-6 * world * (1 + std::abs(s))) << i;
      }
    }
    // all_to_allv of i64 counts and f32 rows, broadcast, barrier.
    {
      std::vector<int64_t> send_counts;
      std::vector<float> send;
      for (int d = 0; d < world; ++d) {
        send_counts.push_back((r + d) % 3 + 1);
        for (int j = 0; j < (r + d) % 3 + 1; ++j) send.push_back(1000.0f * r + 10.0f * d + j);
      }
      const std::vector<int64_t> recv_counts = all_to_all_counts(c, send_counts);
      Tensor ds = upload(send, DType::kF32);
      Tensor dr = Tensor::empty({std::accumulate(recv_counts.begin(), recv_counts.end(), (int64_t)0)}, DType::kF32, Device::kCuda);
      c.all_to_allv(ds.view(), send_counts, dr.view(), recv_counts);
      std::vector<float> expect;
      for (int s = 0; s < world; ++s) {
        ASSERT_EQ(recv_counts[(size_t)s], (s + r) % 3 + 1);
        for (int j = 0; j < (s + r) % 3 + 1; ++j) expect.push_back(1000.0f * s + 10.0f * r + j);
      }
      EXPECT_EQ(download<float>(dr.view()), expect);
      std::vector<double> b = {r == world - 1 ? 7.5 : -1.0, (double)r};
      Tensor db = upload(b, DType::kF64);
      c.broadcast(db.view(), world - 1);
      EXPECT_EQ(download<double>(db.view()), (std::vector<double>{7.5, (double)(world - 1)}));
      double sum = (double)r;
      all_reduce_sum_host(c, std::span<double>(&sum, 1));
      EXPECT_EQ(sum, world * (world - 1) / 2.0);
      c.barrier();
    }
  });
#endif
}

}  // namespace
}  // namespace fourbit::dist
