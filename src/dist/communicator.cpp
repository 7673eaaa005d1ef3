// The helpers of communicator.h shared by every Communicator implementation.
#include "dist/communicator.h"

#include "core/check.h"

namespace fourbit::dist {

void check_buffer(const TensorView& x, Device device, bool reduction, int64_t numel,
                  const char* what) {
  const bool moves = x.dtype == DType::kF64 || x.dtype == DType::kF32 || x.dtype == DType::kBF16 ||
                     x.dtype == DType::kI32 || x.dtype == DType::kI64;
  const bool reduces = x.dtype == DType::kF64 || x.dtype == DType::kF32 || x.dtype == DType::kBF16;
  FOURBIT_CHECK(reduction ? reduces : moves,
                "{}: dtype {} is not supported (reductions: f64, f32, bf16; data movement also "
                "i32, i64)",
                what, dtype_name(x.dtype));
  FOURBIT_CHECK(x.numel() == 0 || x.data != nullptr, "{}: the buffer is null", what);
  FOURBIT_CHECK(x.device == device, "{}: the buffer is on {} but the communicator works on {}",
                what, device_name(x.device), device_name(device));
  FOURBIT_CHECK(x.is_contiguous(), "{}: the buffer must be contiguous, got {}", what,
                x.describe());
  FOURBIT_CHECK(x.numel() == numel, "{}: the buffer holds {} elements but the counts say {}", what,
                x.numel(), numel);
}

int64_t check_counts(std::span<const int64_t> counts, int size, const char* what) {
  FOURBIT_CHECK((int)counts.size() == size, "{}: {} counts given for {} ranks (one per rank)",
                what, counts.size(), size);
  int64_t sum = 0;
  for (size_t p = 0; p < counts.size(); ++p) {
    FOURBIT_CHECK(counts[p] >= 0, "{}: count for rank {} is negative ({})", what, p, counts[p]);
    sum += counts[p];
  }
  return sum;
}

void all_reduce_sum_host(Communicator& comm, std::span<double> values) {
  if (values.empty()) return;
  const int64_t n = (int64_t)values.size();
  Tensor buf = Tensor::empty({n}, DType::kF64, comm.device());
  copy_tensor(buf.view(), TensorView::contiguous(values.data(), DType::kF64, {n}, Device::kCpu));
  comm.all_reduce_sum(buf.view());
  copy_tensor(TensorView::contiguous(values.data(), DType::kF64, {n}, Device::kCpu), buf.view());
}

std::vector<int64_t> all_to_all_counts(Communicator& comm, std::span<const int64_t> send_counts) {
  const int R = comm.size();
  check_counts(send_counts, R, "all_to_all_counts");
  std::vector<int64_t> send(send_counts.begin(), send_counts.end()), recv((size_t)R, 0);
  Tensor s = Tensor::empty({R}, DType::kI64, comm.device());
  Tensor r = Tensor::empty({R}, DType::kI64, comm.device());
  copy_tensor(s.view(), TensorView::contiguous(send.data(), DType::kI64, {R}, Device::kCpu));
  const std::vector<int64_t> ones((size_t)R, 1);
  comm.all_to_allv(s.view(), ones, r.view(), ones);
  copy_tensor(TensorView::contiguous(recv.data(), DType::kI64, {R}, Device::kCpu), r.view());
  return recv;
}

}  // namespace fourbit::dist
