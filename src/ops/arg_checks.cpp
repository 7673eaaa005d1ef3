// Implementation of arg_checks.h.
#include "ops/arg_checks.h"

#include "core/fill.h"

#if defined(FOURBIT_WITH_CUDA)
#include <cuda_runtime_api.h>

#include <mutex>
#endif

namespace fourbit::ops::detail {

Device common_device(std::string_view op, std::initializer_list<Named> tensors) {
  const Named* first = nullptr;
  for (const Named& n : tensors) {
    if (!present(*n.t)) continue;
    if (!first) {
      first = &n;
      continue;
    }
    FOURBIT_CHECK(n.t->device == first->t->device,
                  "{}: {} is on {} but {} is on {}: all tensors of one call must be on the same "
                  "device",
                  op, n.name, device_name(n.t->device), first->name, device_name(first->t->device));
  }
  return first ? first->t->device : Device::kCpu;
}

void no_cuda_build(std::string_view op) {
  throw Error(fmt::format(
      "{}: the tensors are on cuda but this fourbit binary was built without CUDA; rebuild with "
      "nvcc available (cmake -DFOURBIT_CUDA=ON) or pass CPU tensors",
      op));
}

std::string dtype_list(std::initializer_list<DType> dtypes) {
  std::string s;
  size_t i = 0;
  for (DType d : dtypes) {
    if (i > 0) s += i + 1 == dtypes.size() ? " or " : ", ";
    s += dtype_name(d);
    ++i;
  }
  return s;
}

DType cpu_float_dtype(std::string_view op, std::initializer_list<Named> tensors) {
  const Named* first = nullptr;
  for (const Named& n : tensors) {
    if (!present(*n.t)) continue;
    if (!first) {
      check_dtype(op, n.name, *n.t, {DType::kF32, DType::kF64});
      first = &n;
      continue;
    }
    FOURBIT_CHECK(n.t->dtype == first->t->dtype,
                  "{}: the CPU reference computes in one dtype (f32 or f64) for all floating "
                  "tensors, but {} is {} and {} is {}",
                  op, first->name, dtype_name(first->t->dtype), n.name, dtype_name(n.t->dtype));
  }
  return first ? first->t->dtype : DType::kF32;
}

#if defined(FOURBIT_WITH_CUDA)
namespace {
int* internal_flag() {
  static int* flag = nullptr;
  static std::once_flag once;
  std::call_once(
      once, [] { FOURBIT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&flag), sizeof(int))); });
  return flag;
}
}  // namespace

DeviceFlag::DeviceFlag(int* caller_flag, void* stream)
    : flag_(caller_flag ? caller_flag : internal_flag()),
      internal_(caller_flag == nullptr),
      stream_(stream) {
  if (internal_) {
    device_fill_async(flag_, 0, sizeof(int), static_cast<cudaStream_t>(stream_));
  }
}

int DeviceFlag::finish() {
  if (!internal_) return 0;
  int bits = 0;
  cudaStream_t s = static_cast<cudaStream_t>(stream_);
  FOURBIT_CUDA_CHECK(cudaMemcpyAsync(&bits, flag_, sizeof(int), cudaMemcpyDeviceToHost, s));
  FOURBIT_CUDA_CHECK(cudaStreamSynchronize(s));
  return bits;
}
#endif

}  // namespace fourbit::ops::detail
