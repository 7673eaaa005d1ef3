// Implementation of tensor.h: shapes, views, owning tensors and copies.
#include "core/tensor.h"

#include "core/device.h"

#include <cstdlib>
#include <cstring>

namespace fourbit {

Shape::Shape(std::initializer_list<int64_t> d) {
  FOURBIT_CHECK(d.size() <= (size_t)kMaxDims, "shape has {} dims; at most {} are supported",
                d.size(), kMaxDims);
  for (int64_t v : d) dims[ndim++] = v;
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= dims[i];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (ndim != o.ndim) return false;
  for (int i = 0; i < ndim; ++i)
    if (dims[i] != o.dims[i]) return false;
  return true;
}

std::string Shape::str() const {
  std::string s = "(";
  for (int i = 0; i < ndim; ++i) s += fmt::format("{}{}", i ? ", " : "", dims[i]);
  return s + ")";
}

Shape contiguous_strides(const Shape& shape) {
  Shape s = shape;
  int64_t stride = 1;
  for (int i = shape.ndim - 1; i >= 0; --i) {
    s.dims[i] = stride;
    stride *= shape.dims[i];
  }
  return s;
}

TensorView TensorView::contiguous(void* data, DType dtype, Shape shape, Device device) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.shape = shape;
  v.strides = contiguous_strides(shape);
  v.device = device;
  return v;
}

bool TensorView::is_contiguous() const { return strides == contiguous_strides(shape); }

std::string TensorView::describe() const {
  return fmt::format("{} {} on {}", dtype_name(dtype), shape.str(), device_name(device));
}

std::shared_ptr<void> allocate_bytes(int64_t bytes, Device device) {
  FOURBIT_CHECK(bytes >= 0, "negative allocation size {}", bytes);
  const int64_t padded = bytes == 0 ? 64 : (bytes + 63) / 64 * 64;
  if (device == Device::kCpu) {
    void* p = std::aligned_alloc(64, (size_t)padded);
    FOURBIT_CHECK(p != nullptr, "host allocation of {} bytes failed: out of memory", bytes);
    return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  }
  void* p = device_malloc(padded);
  return std::shared_ptr<void>(p, [](void* q) { device_free(q); });
}

Tensor Tensor::empty(Shape shape, DType dtype, Device device) {
  Tensor t;
  t.storage_ = allocate_bytes(dtype_bytes(dtype, shape.numel()), device);
  t.view_ = TensorView::contiguous(t.storage_.get(), dtype, shape, device);
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  fill_bytes(t.view(), 0);
  return t;
}

Tensor Tensor::alias(const TensorView& view, std::shared_ptr<void> storage) {
  Tensor t;
  t.view_ = view;
  t.storage_ = std::move(storage);
  return t;
}

Tensor Tensor::to(Device device) const {
  FOURBIT_CHECK(view_.is_contiguous(), "Tensor::to needs a contiguous tensor, got {}",
                view_.describe());
  Tensor t = empty(view_.shape, view_.dtype, device);
  copy_tensor(t.view(), view_);
  return t;
}

void copy_tensor(const TensorView& dst, const TensorView& src) {
  FOURBIT_CHECK(dst.dtype == src.dtype && dst.numel() == src.numel(),
                "copy_tensor: {} and {} differ in dtype or size", dst.describe(), src.describe());
  FOURBIT_CHECK(dst.is_contiguous() && src.is_contiguous(),
                "copy_tensor needs contiguous tensors ({} <- {})", dst.describe(), src.describe());
  const int64_t bytes = src.nbytes();
  if (bytes == 0) return;
  if (dst.device == Device::kCpu && src.device == Device::kCpu) {
    std::memcpy(dst.data, src.data, (size_t)bytes);
  } else {
    device_memcpy(dst.data, dst.device, src.data, src.device, bytes);
  }
}

void fill_bytes(const TensorView& dst, uint8_t byte) {
  FOURBIT_CHECK(dst.is_contiguous(), "fill_bytes needs a contiguous tensor, got {}",
                dst.describe());
  if (dst.device == Device::kCpu) {
    std::memset(dst.data, byte, (size_t)dst.nbytes());
  } else {
    device_memset(dst.data, byte, dst.nbytes());
  }
}

}  // namespace fourbit
